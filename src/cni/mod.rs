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
    /// The request would be longer than the agent reads ([`crate::protocol::MAX_REQUEST_BYTES`]):
    /// no retry can fix it, so it is not sent.
    #[error("the request to the ipwarden agent is {bytes} bytes, over the agent's limit of {limit} bytes")]
    Oversized {
        /// The encoded request's length, newline included.
        bytes: usize,
        /// The agent's limit.
        limit: usize,
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
        let msg = format!("failed to encode output: {e}");
        serde_json::json!({"cniVersion": version, "code": CniError::IO_FAILURE, "msg": msg}).to_string().into_bytes()
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
    parts.len() == 3
        && parts.iter().all(|part| !part.is_empty() && part.len() <= 9 && part.bytes().all(|b| b.is_ascii_digit()))
}

/// Maps a transport failure to the CNI error the runtime should see.
fn transport_failure(command: Command, error: &TransportError) -> CniError {
    let msg = error.to_string();
    let details = match error {
        TransportError::Unreachable { .. } | TransportError::TimedOut { .. } | TransportError::Io { .. } => {
            "the ipwarden node agent is not reachable; is it running on this node?"
        }
        TransportError::Protocol { .. } => "the plugin and the ipwarden node agent disagree on the protocol",
        TransportError::Oversized { .. } => "the network configuration or CNI_ARGS are too large",
    };
    let error = match (command, error) {
        (_, TransportError::Oversized { .. }) => CniError::invalid_network_config(msg),
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
        Command::Status => Ok(AgentRequest::Status(StatusRequest {
            network: conf.name.clone(),
            cni_version: conf.cni_version.clone(),
        })),
        Command::Check if conf.prev_result.is_none() => {
            Err(CniError::invalid_network_config(format!("CHECK of network {:?} requires prevResult", conf.name)))
        }
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
                runtime_config_ips: conf.runtime_config_ips()?,
                args_ips: cni_args.ip,
                pools: conf.pools.clone(),
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
    // One byte past the limit is enough to refuse; the rest is never read (nor buffered).
    let limit = u64::try_from(netconf::MAX_NETCONF_BYTES).unwrap_or(u64::MAX).saturating_add(1);
    let outcome = match std::io::stdin().lock().take(limit).read_to_end(&mut stdin) {
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

#[cfg(test)]
mod test {
    use super::*;
    use crate::protocol::{Attachment, Dns, IpConfig, IpamResult, PodRef, Route};
    use proptest::prelude::*;
    use serde_json::json;
    use std::cell::RefCell;

    /// In-memory agent: records every request and answers with `reply`.
    struct FakeAgent {
        reply: fn() -> Result<AgentResponse, TransportError>,
        calls: RefCell<Vec<(AgentSettings, AgentRequest)>>,
    }

    impl FakeAgent {
        fn new(reply: fn() -> Result<AgentResponse, TransportError>) -> Self {
            Self { reply, calls: RefCell::new(Vec::new()) }
        }

        fn ok() -> Self {
            Self::new(|| Ok(AgentResponse::Ok { result: Some(sample_result()) }))
        }

        fn only_request(&self) -> AgentRequest {
            let calls = self.calls.borrow();
            assert_eq!(calls.len(), 1, "expected exactly one agent call: {calls:?}");
            calls[0].1.clone()
        }
    }

    impl Transport for FakeAgent {
        fn call(&self, agent: &AgentSettings, request: &AgentRequest) -> Result<AgentResponse, TransportError> {
            self.calls.borrow_mut().push((agent.clone(), request.clone()));
            (self.reply)()
        }
    }

    fn sample_result() -> IpamResult {
        IpamResult {
            ips: vec![IpConfig { address: "10.0.0.5/24".into(), gateway: Some("10.0.0.1".into()), interface: None }],
            routes: vec![Route { dst: "0.0.0.0/0".into(), gw: Some("10.0.0.1".into()) }],
            dns: Some(Dns { nameservers: vec!["10.96.0.10".into()], ..Dns::default() }),
        }
    }

    const POD_ARGS: &str =
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=123";

    /// A full attachment environment for `command`, minus `without`, plus `extra`.
    fn vars(command: &str, without: &[&str], extra: &[(&str, &str)]) -> HashMap<String, String> {
        let mut map: HashMap<String, String> = [
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", "abc"),
            ("CNI_NETNS", "/var/run/netns/cni-1"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_PATH", "/opt/cni/bin"),
            ("CNI_ARGS", POD_ARGS),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        for name in without {
            map.remove(*name);
        }
        map.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        map
    }

    /// A top-level ipwarden configuration with `extra` fields merged in.
    fn conf(version: &str, extra: Value) -> Vec<u8> {
        let mut value = json!({"cniVersion": version, "name": "pods", "type": "ipwarden"});
        if let (Some(map), Value::Object(extra)) = (value.as_object_mut(), extra) {
            map.extend(extra);
        }
        value.to_string().into_bytes()
    }

    fn stdout_json(outcome: &Outcome) -> Value {
        serde_json::from_slice(&outcome.stdout).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {outcome:?}"))
    }

    fn assert_error(outcome: &Outcome, code: u32, version: &str, case: &str) {
        assert_eq!(outcome.exit_code, 1, "{case}");
        let printed = stdout_json(outcome);
        assert_eq!(printed["code"], json!(code), "{case}: {printed}");
        assert_eq!(printed["cniVersion"], json!(version), "{case}: {printed}");
        assert!(printed["msg"].as_str().is_some_and(|m| !m.is_empty()), "{case}: {printed}");
    }

    fn attachment(container_id: &str) -> Attachment {
        Attachment { container_id: container_id.into(), ifname: "eth0".into() }
    }

    #[test]
    fn version_prints_supported_versions_without_calling_the_agent() {
        let cases: [(&[u8], &str); 6] = [
            (br#"{"cniVersion": "1.0.0"}"#, "1.0.0"),
            (br#"{"cniVersion": "1.1.0"}"#, "1.1.0"),
            (br#"{"cniVersion": "0.4.0"}"#, "0.4.0"),
            (br#"{"cniVersion": "one"}"#, "1.1.0"),
            (b"", "1.1.0"),
            (b"garbage", "1.1.0"),
        ];
        for (stdin, version) in cases {
            let agent = FakeAgent::ok();
            let outcome = run(&vars("VERSION", &[], &[]), stdin, &agent);
            assert_eq!(outcome.exit_code, 0);
            assert_eq!(stdout_json(&outcome), json!({"cniVersion": version, "supportedVersions": ["1.0.0", "1.1.0"]}));
            assert!(agent.calls.borrow().is_empty());
        }
    }

    #[test]
    fn add_forwards_every_field_and_prints_the_result_with_the_netconf_version() {
        for version in ["1.0.0", "1.1.0"] {
            let agent = FakeAgent::ok();
            let prev = json!({"cniVersion": version, "interfaces": [{"name": "eth0"}]});
            let outcome = run(&vars("ADD", &[], &[]), &conf(version, json!({"prevResult": prev})), &agent);
            assert_eq!(outcome.exit_code, 0, "{outcome:?}");
            assert!(outcome.stdout.ends_with(b"\n"));
            assert_eq!(
                stdout_json(&outcome),
                json!({
                    "cniVersion": version,
                    "ips": [{"address": "10.0.0.5/24", "gateway": "10.0.0.1"}],
                    "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.1"}],
                    "dns": {"nameservers": ["10.96.0.10"]}
                })
            );
            let AgentRequest::Add(request) = agent.only_request() else { panic!("not an ADD") };
            assert_eq!(request.network, "pods");
            assert_eq!(request.cni_version, version);
            assert_eq!(request.container_id, "abc");
            assert_eq!(request.ifname, "eth0");
            assert_eq!(request.netns.as_deref(), Some("/var/run/netns/cni-1"));
            assert_eq!(
                request.pod,
                Some(PodRef { namespace: "default".into(), name: "web-0".into(), uid: Some("123".into()) })
            );
            assert_eq!(request.prev_result, Some(prev));
        }
    }

    #[test]
    fn add_forwards_the_pools_of_the_ipwarden_ipam_section() {
        let agent = FakeAgent::ok();
        let ipam = json!({"ipam": {"type": "ipwarden", "pools": ["net1-v4", "net1-v6"]}});
        let outcome = run(&vars("ADD", &[], &[]), &conf("1.1.0", ipam), &agent);
        assert_eq!(outcome.exit_code, 0, "{outcome:?}");
        let AgentRequest::Add(request) = agent.only_request() else { panic!("not an ADD") };
        assert_eq!(request.pools, ["net1-v4", "net1-v6"]);
    }

    #[test]
    fn add_forwards_the_fixed_ips_of_runtime_config_and_cni_args_as_given() {
        let agent = FakeAgent::ok();
        let args = format!("{POD_ARGS};IP=10.0.0.8,fd00::8");
        let rc = json!({"runtimeConfig": {"ips": ["10.0.0.7/24"]}});
        let outcome = run(&vars("ADD", &[], &[("CNI_ARGS", &args)]), &conf("1.1.0", rc), &agent);
        assert_eq!(outcome.exit_code, 0, "{outcome:?}");
        let AgentRequest::Add(request) = agent.only_request() else { panic!("not an ADD") };
        assert_eq!(request.runtime_config_ips, Some(vec!["10.0.0.7/24".to_string()]));
        assert_eq!(request.args_ips.as_deref(), Some("10.0.0.8,fd00::8"));

        let agent = FakeAgent::ok();
        let outcome = run(&vars("ADD", &[], &[]), &conf("1.1.0", json!({"runtimeConfig": {"ips": "x"}})), &agent);
        assert_error(&outcome, 6, "1.1.0", "runtimeConfig.ips not a list");
        assert!(agent.calls.borrow().is_empty());
    }

    #[test]
    fn add_without_cni_args_forwards_no_pod() {
        let agent = FakeAgent::ok();
        let outcome = run(&vars("ADD", &["CNI_ARGS"], &[]), &conf("1.1.0", json!({})), &agent);
        assert_eq!(outcome.exit_code, 0);
        let AgentRequest::Add(request) = agent.only_request() else { panic!("not an ADD") };
        assert_eq!((request.pod, request.prev_result), (None, None));
    }

    #[test]
    fn del_without_netns_is_forwarded_and_prints_nothing() {
        let agent = FakeAgent::new(|| Ok(AgentResponse::Ok { result: None }));
        let outcome = run(&vars("DEL", &["CNI_NETNS"], &[]), &conf("1.0.0", json!({})), &agent);
        assert_eq!(outcome, Outcome { stdout: Vec::new(), exit_code: 0 });
        let AgentRequest::Del(request) = agent.only_request() else { panic!("not a DEL") };
        assert_eq!(request.container_id, "abc");
        assert_eq!(request.ifname, "eth0");
        assert_eq!(request.netns, None);
        assert_eq!(request.pod.map(|p| p.name), Some("web-0".into()));
    }

    #[test]
    fn del_with_an_unparsable_netconf_still_fails_without_calling_the_agent() {
        let agent = FakeAgent::ok();
        let outcome = run(&vars("DEL", &[], &[]), b"{not json", &agent);
        assert_error(&outcome, 6, "1.1.0", "del with bad netconf");
        assert!(agent.calls.borrow().is_empty());
    }

    #[test]
    fn check_forwards_prev_result_and_prints_nothing() {
        let agent = FakeAgent::ok();
        let prev = json!({"cniVersion": "1.1.0", "ips": [{"address": "10.0.0.5/24"}]});
        let outcome = run(&vars("CHECK", &[], &[]), &conf("1.1.0", json!({"prevResult": prev})), &agent);
        assert_eq!(outcome, Outcome { stdout: Vec::new(), exit_code: 0 });
        let AgentRequest::Check(request) = agent.only_request() else { panic!("not a CHECK") };
        assert_eq!(request.prev_result, Some(prev));
        assert_eq!(request.netns.as_deref(), Some("/var/run/netns/cni-1"));
    }

    #[test]
    fn gc_forwards_valid_attachments_from_either_key_and_prints_nothing() {
        let listed = json!([{"containerID": "c1", "ifname": "eth0"}, {"containerID": "c2", "ifname": "eth0"}]);
        for key in ["cni.dev/valid-attachments", "cni.dev/attachments"] {
            let agent = FakeAgent::new(|| Ok(AgentResponse::Ok { result: None }));
            let mut extra = serde_json::Map::new();
            extra.insert(key.into(), listed.clone());
            let outcome = run(&vars("GC", &[], &[]), &conf("1.1.0", Value::Object(extra)), &agent);
            assert_eq!(outcome, Outcome { stdout: Vec::new(), exit_code: 0 }, "{key}");
            assert_eq!(
                agent.only_request(),
                AgentRequest::Gc(GcRequest {
                    network: "pods".into(),
                    cni_version: "1.1.0".into(),
                    valid_attachments: vec![attachment("c1"), attachment("c2")],
                }),
                "{key}"
            );
        }
    }

    #[test]
    fn gc_with_an_empty_list_forwards_the_empty_list() {
        let agent = FakeAgent::new(|| Ok(AgentResponse::Ok { result: None }));
        let outcome = run(&vars("GC", &[], &[]), &conf("1.1.0", json!({"cni.dev/valid-attachments": []})), &agent);
        assert_eq!(outcome.exit_code, 0);
        let AgentRequest::Gc(request) = agent.only_request() else { panic!("not a GC") };
        assert!(request.valid_attachments.is_empty());
    }

    #[test]
    fn gc_without_a_list_is_code_7_and_never_reaches_the_agent() {
        let agent = FakeAgent::ok();
        let outcome = run(&vars("GC", &[], &[]), &conf("1.1.0", json!({})), &agent);
        assert_error(&outcome, 7, "1.1.0", "gc without list");
        assert!(stdout_json(&outcome)["msg"].as_str().unwrap_or_default().contains("valid-attachments"));
        assert!(agent.calls.borrow().is_empty());
    }

    #[test]
    fn status_is_forwarded_and_prints_nothing_when_ready() {
        let agent = FakeAgent::new(|| Ok(AgentResponse::Ok { result: None }));
        let env: HashMap<String, String> = [("CNI_COMMAND".to_string(), "STATUS".to_string())].into();
        let outcome = run(&env, &conf("1.1.0", json!({})), &agent);
        assert_eq!(outcome, Outcome { stdout: Vec::new(), exit_code: 0 });
        assert_eq!(
            agent.only_request(),
            AgentRequest::Status(StatusRequest { network: "pods".into(), cni_version: "1.1.0".into() })
        );
    }

    #[test]
    fn agent_settings_follow_the_ipam_section_or_the_top_level() {
        let cases = [
            (
                json!({"cniVersion": "1.1.0", "name": "pods", "type": "bridge",
                       "ipam": {"type": "ipwarden", "socket": "/run/a.sock", "timeoutSeconds": 7}}),
                AgentSettings { socket: "/run/a.sock".into(), timeout: Duration::from_secs(7) },
            ),
            (
                json!({"cniVersion": "1.1.0", "name": "pods", "type": "ipwarden-cni",
                       "socket": "/run/b.sock", "timeoutSeconds": 9}),
                AgentSettings { socket: "/run/b.sock".into(), timeout: Duration::from_secs(9) },
            ),
            (
                json!({"cniVersion": "1.1.0", "name": "pods", "type": "ipwarden"}),
                AgentSettings { socket: netconf::DEFAULT_SOCKET.into(), timeout: Duration::from_secs(30) },
            ),
        ];
        for (config, expected) in cases {
            let agent = FakeAgent::ok();
            let outcome = run(&vars("ADD", &[], &[]), config.to_string().as_bytes(), &agent);
            assert_eq!(outcome.exit_code, 0, "{config}");
            assert_eq!(agent.calls.borrow()[0].0, expected, "{config}");
        }
    }

    #[test]
    fn every_error_path_prints_the_cni_error_object_and_exits_1() {
        fn refused() -> Result<AgentResponse, TransportError> {
            Err(TransportError::Unreachable {
                socket: "/run/ipwarden/agent.sock".into(),
                source: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
            })
        }
        fn timed_out() -> Result<AgentResponse, TransportError> {
            Err(TransportError::TimedOut { socket: "/run/x.sock".into(), timeout: Duration::from_secs(30) })
        }
        fn broken() -> Result<AgentResponse, TransportError> {
            Err(TransportError::Io {
                socket: "/run/x.sock".into(),
                source: std::io::Error::from(std::io::ErrorKind::BrokenPipe),
            })
        }
        fn garbled() -> Result<AgentResponse, TransportError> {
            Err(TransportError::Protocol { socket: "/run/x.sock".into(), reason: "not json".into() })
        }
        fn oversized() -> Result<AgentResponse, TransportError> {
            Err(TransportError::Oversized { bytes: 2_000_000, limit: 1_048_576 })
        }
        fn no_result() -> Result<AgentResponse, TransportError> {
            Ok(AgentResponse::Ok { result: None })
        }
        fn unknown_container() -> Result<AgentResponse, TransportError> {
            Ok(AgentResponse::Error(CniError::unknown_container("no allocation for container abc")))
        }
        fn exhausted() -> Result<AgentResponse, TransportError> {
            Ok(AgentResponse::Error(CniError::new(CniError::LIMITED_RESOURCES, "no free addresses in 10.0.0.0/24")))
        }
        fn ok() -> Result<AgentResponse, TransportError> {
            Ok(AgentResponse::Ok { result: Some(sample_result()) })
        }
        type Reply = fn() -> Result<AgentResponse, TransportError>;
        /// Case name, environment, stdin, agent reply, expected code, expected printed cniVersion.
        type Case = (&'static str, HashMap<String, String>, Vec<u8>, Reply, u32, &'static str);
        let status = || [("CNI_COMMAND".to_string(), "STATUS".to_string())].into_iter().collect();
        let gc_list = json!({"cni.dev/valid-attachments": []});
        let prev = json!({"prevResult": {"ips": []}});
        let cases: Vec<Case> = vec![
            ("unsupported version", vars("ADD", &[], &[]), conf("0.4.0", json!({})), ok, 1, "1.1.0"),
            ("gc under 1.0.0", vars("GC", &[], &[]), conf("1.0.0", gc_list.clone()), ok, 1, "1.0.0"),
            ("status under 1.0.0", status(), conf("1.0.0", json!({})), ok, 1, "1.0.0"),
            (
                "agent says unknown container",
                vars("CHECK", &[], &[]),
                conf("1.0.0", prev.clone()),
                unknown_container,
                3,
                "1.0.0",
            ),
            ("no command", vars("ADD", &["CNI_COMMAND"], &[]), conf("1.1.0", json!({})), ok, 4, "1.1.0"),
            ("unknown command", vars("UP", &[], &[]), conf("1.1.0", json!({})), ok, 4, "1.1.0"),
            (
                "add without container id",
                vars("ADD", &["CNI_CONTAINERID"], &[]),
                conf("1.0.0", json!({})),
                ok,
                4,
                "1.0.0",
            ),
            ("add without netns", vars("ADD", &["CNI_NETNS"], &[]), conf("1.1.0", json!({})), ok, 4, "1.1.0"),
            (
                "add with empty ifname",
                vars("ADD", &[], &[("CNI_IFNAME", "")]),
                conf("1.1.0", json!({})),
                ok,
                4,
                "1.1.0",
            ),
            ("check without netns", vars("CHECK", &["CNI_NETNS"], &[]), conf("1.1.0", prev.clone()), ok, 4, "1.1.0"),
            ("del without ifname", vars("DEL", &["CNI_IFNAME"], &[]), conf("1.1.0", json!({})), ok, 4, "1.1.0"),
            (
                "malformed cni args",
                vars("ADD", &[], &[("CNI_ARGS", "K8S_POD_NAME")]),
                conf("1.1.0", json!({})),
                ok,
                4,
                "1.1.0",
            ),
            ("add, agent answers no result", vars("ADD", &[], &[]), conf("1.1.0", json!({})), no_result, 5, "1.1.0"),
            ("add, agent garbles", vars("ADD", &[], &[]), conf("1.1.0", json!({})), garbled, 5, "1.1.0"),
            ("not json", vars("ADD", &[], &[]), b"{".to_vec(), ok, 6, "1.1.0"),
            ("name not a string", vars("ADD", &[], &[]), conf("1.0.0", json!({"name": 1})), ok, 6, "1.0.0"),
            ("no name", vars("ADD", &[], &[]), br#"{"cniVersion": "1.0.0"}"#.to_vec(), ok, 7, "1.0.0"),
            (
                "timeout out of range",
                vars("ADD", &[], &[]),
                conf("1.1.0", json!({"timeoutSeconds": 0})),
                ok,
                7,
                "1.1.0",
            ),
            ("check without prevResult", vars("CHECK", &[], &[]), conf("1.1.0", json!({})), ok, 7, "1.1.0"),
            ("add, agent refused", vars("ADD", &[], &[]), conf("1.1.0", json!({})), refused, 11, "1.1.0"),
            ("del, agent refused", vars("DEL", &[], &[]), conf("1.1.0", json!({})), refused, 11, "1.1.0"),
            ("check, agent timed out", vars("CHECK", &[], &[]), conf("1.1.0", prev.clone()), timed_out, 11, "1.1.0"),
            ("gc, connection broke", vars("GC", &[], &[]), conf("1.1.0", gc_list.clone()), broken, 11, "1.1.0"),
            (
                "add, request over the agent's limit",
                vars("ADD", &[], &[]),
                conf("1.1.0", json!({})),
                oversized,
                7,
                "1.1.0",
            ),
            ("status, request over the agent's limit", status(), conf("1.1.0", json!({})), oversized, 7, "1.1.0"),
            ("status, agent refused", status(), conf("1.1.0", json!({})), refused, 50, "1.1.0"),
            ("status, agent timed out", status(), conf("1.1.0", json!({})), timed_out, 50, "1.1.0"),
            ("status, agent garbles", status(), conf("1.1.0", json!({})), garbled, 50, "1.1.0"),
            ("status, agent out of addresses", status(), conf("1.1.0", json!({})), exhausted, 51, "1.1.0"),
        ];
        for (case, env, stdin, reply, code, version) in cases {
            let outcome = run(&env, &stdin, &FakeAgent::new(reply));
            assert_error(&outcome, code, version, case);
        }
    }

    #[test]
    fn agent_errors_are_printed_unchanged_with_the_netconf_version() {
        fn exhausted() -> Result<AgentResponse, TransportError> {
            Ok(AgentResponse::Error(
                CniError::new(CniError::LIMITED_RESOURCES, "no free addresses").with_details("pool 10.0.0.0/24"),
            ))
        }
        let outcome = run(&vars("ADD", &[], &[]), &conf("1.0.0", json!({})), &FakeAgent::new(exhausted));
        assert_eq!(
            stdout_json(&outcome),
            json!({"cniVersion": "1.0.0", "code": 51, "msg": "no free addresses", "details": "pool 10.0.0.0/24"})
        );
    }

    /// A socket path in a fresh directory under the system temp dir.
    fn socket_in_temp_dir(name: &str) -> (PathBuf, PathBuf) {
        let dir = std::env::temp_dir().join(format!("ipwarden-cni-run-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        (dir.join("agent.sock"), dir)
    }

    #[test]
    fn add_round_trips_through_a_real_unix_socket() {
        use std::io::{BufRead, BufReader};
        let (socket, dir) = socket_in_temp_dir("add");
        let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let server = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut line = String::new();
            BufReader::new(&stream).read_line(&mut line).unwrap();
            let reply = serde_json::to_string(&AgentResponse::Ok { result: Some(sample_result()) }).unwrap();
            (&stream).write_all(format!("{reply}\n").as_bytes()).unwrap();
            serde_json::from_str::<AgentRequest>(&line).unwrap()
        });
        let stdin = conf("1.1.0", json!({"socket": socket.to_string_lossy(), "timeoutSeconds": 5}));
        let outcome = run(&vars("ADD", &[], &[]), &stdin, &UnixTransport);
        let request = server.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(outcome.exit_code, 0, "{}", String::from_utf8_lossy(&outcome.stdout));
        assert_eq!(stdout_json(&outcome)["ips"][0]["address"], json!("10.0.0.5/24"));
        let AgentRequest::Add(request) = request else { panic!("not an ADD") };
        assert_eq!(request.container_id, "abc");
        assert_eq!(request.pod.map(|p| p.namespace), Some("default".into()));
    }

    #[test]
    fn unreachable_agent_is_code_11_and_code_50_for_status() {
        let (socket, dir) = socket_in_temp_dir("unreachable");
        let stdin = conf("1.1.0", json!({"socket": socket.to_string_lossy(), "cni.dev/valid-attachments": []}));
        let status: HashMap<String, String> = [("CNI_COMMAND".to_string(), "STATUS".to_string())].into();
        for (env, code) in
            [(vars("ADD", &[], &[]), 11), (vars("DEL", &[], &[]), 11), (vars("GC", &[], &[]), 11), (status, 50)]
        {
            let outcome = run(&env, &stdin, &UnixTransport);
            assert_error(&outcome, code, "1.1.0", "unreachable");
            assert!(stdout_json(&outcome)["msg"].as_str().unwrap_or_default().contains("agent.sock"));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn arbitrary_env() -> impl Strategy<Value = HashMap<String, String>> {
        let key = prop_oneof![
            Just("CNI_COMMAND".to_string()),
            Just("CNI_CONTAINERID".to_string()),
            Just("CNI_NETNS".to_string()),
            Just("CNI_IFNAME".to_string()),
            Just("CNI_ARGS".to_string()),
            Just("CNI_PATH".to_string()),
            any::<String>(),
        ];
        let value = prop_oneof![
            Just("ADD".to_string()),
            Just("DEL".to_string()),
            Just("CHECK".to_string()),
            Just("GC".to_string()),
            Just("STATUS".to_string()),
            Just("VERSION".to_string()),
            Just(POD_ARGS.to_string()),
            any::<String>(),
        ];
        proptest::collection::hash_map(key, value, 0..8)
    }

    fn arbitrary_stdin() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..256),
            (prop_oneof![Just("1.0.0"), Just("1.1.0"), Just("0.4.0")], any::<bool>(), any::<i32>()).prop_map(
                |(version, list, timeout)| {
                    let mut value = json!({"cniVersion": version, "name": "pods", "timeoutSeconds": timeout,
                                           "prevResult": {}});
                    if list {
                        value["cni.dev/valid-attachments"] = json!([{"containerID": "c", "ifname": "eth0"}]);
                    }
                    value.to_string().into_bytes()
                }
            ),
        ]
    }

    proptest! {
        #[test]
        fn run_never_panics_and_always_prints_json_or_nothing(env in arbitrary_env(), stdin in arbitrary_stdin()) {
            let agent = FakeAgent::ok();
            let outcome = run(&env, &stdin, &agent);
            prop_assert!(outcome.exit_code == 0 || outcome.exit_code == 1);
            if outcome.exit_code == 1 || !outcome.stdout.is_empty() {
                let printed: Value = serde_json::from_slice(&outcome.stdout).map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert!(printed["cniVersion"].is_string());
            }
        }
    }
}
