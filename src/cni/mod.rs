//! The CNI plugin (`ipwarden cni`, or the binary invoked as `ipwarden-cni`).
//!
//! The runtime runs the plugin once per call with `CNI_*` variables and the network
//! configuration on stdin. [`run`] validates both, forwards the call to the node agent through
//! a [`Transport`] and turns the reply into what the spec asks to print: the result for `ADD`,
//! nothing for `DEL`/`CHECK`/`GC`/`STATUS`, the version list for `VERSION`, and on failure the
//! CNI error object on stdout with exit code 1.
//!
//! Choices where the spec leaves room:
//! - `GC` and `STATUS` under `cniVersion` 1.0.0 are code 1 (incompatible version): the verbs
//!   do not exist in 1.0.0, and code 2 is about configuration fields, not verbs.
//! - `GC` without `cni.dev/valid-attachments` (or `cni.dev/attachments`) is code 7: a missing
//!   list must never be read as "keep nothing", while an empty list is forwarded as is.
//! - `CHECK` without `prevResult` is code 7, as the spec requires `prevResult` there.
//! - An unreachable or timed-out agent is code 11 (code 50 for `STATUS`); an agent reply that
//!   cannot be decoded, or an `ADD` reply without a result, is code 5 (code 50 for `STATUS`).
//! - Errors carry the configuration's `cniVersion` when it is a supported one, else 1.1.0.
//! - `VERSION` never fails: it echoes a requested `cniVersion` that looks like `X.Y.Z`
//!   (digits only), else answers 1.1.0.

pub mod args;
pub mod env;
pub mod netconf;
pub mod unix;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

use crate::protocol::{AgentRequest, AgentResponse, AttachmentRequest, CniError, GcRequest, StatusRequest};
use env::{CniEnv, Command};
use netconf::{AgentSettings, LATEST_VERSION, NetConf, SUPPORTED_VERSIONS};
pub use unix::UnixTransport;

/// Carries one request to the node agent and brings back its response.
///
/// A trait so that [`run`] is tested with an in-memory agent; production uses [`UnixTransport`].
pub trait Transport {
    /// Sends `request` to the agent described by `agent` and waits for its single response.
    fn call(&self, agent: &AgentSettings, request: &AgentRequest) -> Result<AgentResponse, TransportError>;
}

/// Why a call to the agent did not produce a response.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The socket is missing, refuses connections, or could not be dialled.
    #[error("cannot connect to the ipwarden agent at {}: {source}", .socket.display())]
    Unreachable {
        /// The socket path tried.
        socket: PathBuf,
        /// The connect error.
        #[source]
        source: std::io::Error,
    },
    /// The call did not complete within the configured timeout.
    #[error("the ipwarden agent at {} did not answer within {timeout:?}", .socket.display())]
    TimedOut {
        /// The socket path used.
        socket: PathBuf,
        /// The configured budget for the whole call.
        timeout: Duration,
    },
    /// The connection broke while writing the request or reading the response.
    #[error("the connection to the ipwarden agent at {} failed: {source}", .socket.display())]
    Io {
        /// The socket path used.
        socket: PathBuf,
        /// The read or write error.
        #[source]
        source: std::io::Error,
    },
    /// The agent answered something that is not a valid [`AgentResponse`] line.
    #[error("the ipwarden agent at {} sent an invalid response: {reason}", .socket.display())]
    Protocol {
        /// The socket path used.
        socket: PathBuf,
        /// What was wrong with the response.
        reason: String,
    },
}

/// What the plugin process must print on stdout and exit with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Bytes for stdout: a JSON document and a newline, or nothing.
    pub stdout: Vec<u8>,
    /// Process exit code: 0 on success, 1 when `stdout` holds a CNI error.
    pub exit_code: i32,
}

/// A printed document: `body`'s fields preceded by `cniVersion`.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Versioned<'a, T: Serialize> {
    cni_version: &'a str,
    #[serde(flatten)]
    body: &'a T,
}

/// The `VERSION` answer.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct VersionInfo<'a> {
    cni_version: &'a str,
    supported_versions: [&'a str; 2],
}

/// Encodes `document` as one line of JSON, or an I/O failure error object if that fails.
fn print_line(version: &str, document: &impl Serialize) -> Vec<u8> {
    let mut line = serde_json::to_vec(document).unwrap_or_else(|e| {
        serde_json::json!({"cniVersion": version, "code": CniError::IO_FAILURE, "msg": format!("failed to encode output: {e}")})
            .to_string()
            .into_bytes()
    });
    line.push(b'\n');
    line
}

/// The outcome for a failed call: the error object on stdout and exit code 1.
fn failure(version: &str, error: &CniError) -> Outcome {
    Outcome { stdout: print_line(version, &Versioned { cni_version: version, body: error }), exit_code: 1 }
}

/// The `cniVersion` string of stdin, read leniently (no validation).
fn requested_version(stdin: &[u8]) -> Option<String> {
    match serde_json::from_slice::<Value>(stdin).ok()? {
        Value::Object(mut map) => match map.remove("cniVersion")? {
            Value::String(version) => Some(version),
            _ => None,
        },
        _ => None,
    }
}

/// Whether `version` looks like `X.Y.Z` with decimal digits only.
fn is_version_like(version: &str) -> bool {
    let parts: Vec<&str> = version.split('.').collect();
    parts.len() == 3 && parts.iter().all(|part| !part.is_empty() && part.len() <= 9 && part.bytes().all(|b| b.is_ascii_digit()))
}

/// Maps a transport failure to the CNI error the runtime should see.
fn transport_failure(command: Command, error: &TransportError) -> CniError {
    let msg = error.to_string();
    let details = match error {
        TransportError::Unreachable { .. } | TransportError::TimedOut { .. } | TransportError::Io { .. } => {
            "the ipwarden node agent is not reachable; is it running on this node?"
        }
        TransportError::Protocol { .. } => "the plugin and the ipwarden node agent disagree on the protocol",
    };
    let error = match (command, error) {
        (Command::Status, _) => CniError::plugin_not_available(msg),
        (_, TransportError::Protocol { .. }) => CniError::io_failure(msg),
        _ => CniError::try_again_later(msg),
    };
    error.with_details(details)
}

/// Returns a variable that [`env::parse_env`] guarantees for attachment verbs.
fn attachment_var(value: Option<String>, name: &str, command: Command) -> Result<String, CniError> {
    value.ok_or_else(|| {
        CniError::invalid_environment(format!(
            "missing or empty environment variable {name} required by {}",
            command.as_str()
        ))
    })
}

/// Builds the agent request for a validated call.
fn build_request(env: CniEnv, conf: &NetConf) -> Result<AgentRequest, CniError> {
    let command = env.command;
    match command {
        Command::Gc | Command::Status if conf.cni_version != LATEST_VERSION => Err(CniError::incompatible_version(
            format!("{} requires cniVersion {LATEST_VERSION}, got {}", command.as_str(), conf.cni_version),
        )),
        Command::Gc => match &conf.valid_attachments {
            Some(list) => Ok(AgentRequest::Gc(GcRequest {
                network: conf.name.clone(),
                cni_version: conf.cni_version.clone(),
                valid_attachments: list.clone(),
            })),
            None => Err(CniError::invalid_network_config(format!(
                "GC of network {:?} requires cni.dev/valid-attachments",
                conf.name
            ))),
        },
        Command::Status => {
            Ok(AgentRequest::Status(StatusRequest { network: conf.name.clone(), cni_version: conf.cni_version.clone() }))
        }
        Command::Check if conf.prev_result.is_none() => Err(CniError::invalid_network_config(format!(
            "CHECK of network {:?} requires prevResult",
            conf.name
        ))),
        Command::Add | Command::Del | Command::Check => {
            let cni_args = env.args.as_deref().map(args::parse_args).transpose()?.unwrap_or_default();
            let request = AttachmentRequest {
                network: conf.name.clone(),
                cni_version: conf.cni_version.clone(),
                container_id: attachment_var(env.container_id, "CNI_CONTAINERID", command)?,
                ifname: attachment_var(env.ifname, "CNI_IFNAME", command)?,
                netns: env.netns,
                pod: cni_args.pod(),
                prev_result: conf.prev_result.clone().map(Value::Object),
            };
            Ok(match command {
                Command::Add => AgentRequest::Add(request),
                Command::Del => AgentRequest::Del(request),
                _ => AgentRequest::Check(request),
            })
        }
        Command::Version => Err(CniError::invalid_environment("VERSION is answered without the agent")),
    }
}

/// Runs a validated non-VERSION call and returns what to print on success.
fn execute(env: CniEnv, stdin: &[u8], transport: &dyn Transport) -> Result<Vec<u8>, CniError> {
    let command = env.command;
    let conf = netconf::parse_netconf(stdin)?;
    let request = build_request(env, &conf)?;
    match transport.call(&conf.agent, &request) {
        Err(error) => Err(transport_failure(command, &error)),
        Ok(AgentResponse::Error(error)) => Err(error),
        Ok(AgentResponse::Ok { result }) => match (command, result) {
            (Command::Add, Some(result)) => {
                Ok(print_line(&conf.cni_version, &Versioned { cni_version: &conf.cni_version, body: &result }))
            }
            (Command::Add, None) => Err(CniError::io_failure(format!(
                "the ipwarden agent returned no result for ADD on network {:?}",
                conf.name
            ))),
            _ => Ok(Vec::new()),
        },
    }
}

/// Runs one plugin call: `env` holds the process environment and `stdin` the configuration.
///
/// Pure except for `transport`; never panics, whatever the input.
pub fn run(env: &HashMap<String, String>, stdin: &[u8], transport: &dyn Transport) -> Outcome {
    let requested = requested_version(stdin);
    let error_version = requested.as_deref().filter(|v| SUPPORTED_VERSIONS.contains(v)).unwrap_or(LATEST_VERSION);
    let env = match env::parse_env(env) {
        Ok(env) => env,
        Err(error) => return failure(error_version, &error),
    };
    if env.command == Command::Version {
        let version = requested.as_deref().filter(|v| is_version_like(v)).unwrap_or(LATEST_VERSION);
        let info = VersionInfo { cni_version: version, supported_versions: SUPPORTED_VERSIONS };
        return Outcome { stdout: print_line(version, &info), exit_code: 0 };
    }
    match execute(env, stdin, transport) {
        Ok(stdout) => Outcome { stdout, exit_code: 0 },
        Err(error) => failure(error_version, &error),
    }
}

/// Entry point for the binary: reads the real environment and stdin, prints, returns the exit code.
pub fn main_from_process() -> i32 {
    let vars: HashMap<String, String> = std::env::vars_os()
        .map(|(key, value)| (key.to_string_lossy().into_owned(), value.to_string_lossy().into_owned()))
        .collect();
    let mut stdin = Vec::new();
    let outcome = match std::io::stdin().lock().read_to_end(&mut stdin) {
        Ok(_) => run(&vars, &stdin, &UnixTransport),
        Err(error) => failure(
            LATEST_VERSION,
            &CniError::io_failure(format!("failed to read the network configuration from stdin: {error}")),
        ),
    };
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(&outcome.stdout).and_then(|()| stdout.flush()) {
        Ok(()) => outcome.exit_code,
        Err(_) => 1,
    }
}
