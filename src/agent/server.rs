//! The unix socket the CNI plugin talks to: one JSON request line per connection, one JSON
//! response line back. The socket is mode 0600: only root (the runtime) may allocate.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use actix::Addr;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use super::allocator::{Call, NodeAllocator};
use super::error::Error;
use crate::ipam::fixed::Refusal;
use crate::protocol::{AgentRequest, AgentResponse, CniError, MAX_REQUEST_BYTES};

/// ipwarden's own CNI error code: no pool fits the pod.
pub const NO_POOL_FITS: u32 = 100;

/// ipwarden's own CNI error code: every IP of the chosen pool is taken.
pub const POOL_EXHAUSTED: u32 = 101;

/// ipwarden's own CNI error code: the pod's IPClaim names an object that does not hold the
/// claimed IP's record (a hand-edited claim); the claim must be fixed or deleted.
pub const INVALID_CLAIM: u32 = 102;

/// ipwarden's own CNI error code: the pod's fixed IP can never be had as asked (malformed,
/// in no pool, in a pool the pod may not use, or never handed out by its pool).
pub const FIXED_IP_REFUSED: u32 = 103;

/// ipwarden's own CNI error code: another pod holds the pod's fixed IP (for a list: one of
/// its IPs of the family; the others held too or cooling down).
pub const FIXED_IP_IN_USE: u32 = 104;

/// The CNI error the plugin hands the runtime for `error`: the code says what the runtime
/// may do (retry later, give up, fix the configuration), the message what failed.
pub fn to_cni(error: &Error) -> CniError {
    let code = match error {
        Error::NoPodInRequest => CniError::INVALID_ENVIRONMENT,
        Error::StaleSandbox { .. } | Error::UnknownAttachment { .. } => CniError::UNKNOWN_CONTAINER,
        Error::NoPoolFits { .. } => NO_POOL_FITS,
        Error::PoolExhausted { .. } => POOL_EXHAUSTED,
        Error::InvalidClaim { .. } => INVALID_CLAIM,
        Error::FixedIp { cause, .. } => match cause.refusal() {
            Refusal::Never => FIXED_IP_REFUSED,
            Refusal::InUse => FIXED_IP_IN_USE,
            Refusal::Cooling => CniError::TRY_AGAIN_LATER,
        },
        Error::Checkpoint(_) => CniError::IO_FAILURE,
        Error::PrevResultMismatch { .. } => CniError::INVALID_NETWORK_CONFIG,
        Error::NoPool => CniError::PLUGIN_NOT_AVAILABLE,
        Error::PodMissing { .. }
        | Error::Cooling { .. }
        | Error::AwaitingTakeover { .. }
        | Error::HandoverPending { .. }
        | Error::Api { .. }
        | Error::Superseded { .. }
        | Error::Write(_) => CniError::TRY_AGAIN_LATER,
    };
    CniError::new(code, error.to_string())
}

/// Binds the socket at `path` (replacing a stale one) with mode 0600.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Accepts connections forever, each served on its own task.
pub async fn serve(listener: UnixListener, allocator: Addr<NodeAllocator>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(serve_one(stream, allocator.clone()));
            }
            Err(e) => tracing::warn!(error = %e, "accepting a CNI connection failed"),
        }
    }
}

async fn serve_one(stream: UnixStream, allocator: Addr<NodeAllocator>) {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let limit = u64::try_from(MAX_REQUEST_BYTES).unwrap_or(u64::MAX);
    let response = match BufReader::new(read.take(limit.saturating_add(1))).read_line(&mut line).await {
        Err(e) => AgentResponse::Error(CniError::io_failure(format!("reading the request: {e}"))),
        Ok(_) if line.len() > MAX_REQUEST_BYTES => AgentResponse::Error(CniError::invalid_network_config(format!(
            "the request is larger than the agent's limit of {MAX_REQUEST_BYTES} bytes"
        ))),
        Ok(_) => match serde_json::from_str::<AgentRequest>(&line) {
            Err(e) => AgentResponse::Error(CniError::decoding_failure(format!("decoding the request: {e}"))),
            Ok(request) => match allocator.send(Call(request)).await {
                Ok(Ok(result)) => AgentResponse::Ok { result },
                Ok(Err(error)) => AgentResponse::Error(to_cni(&error)),
                Err(e) => AgentResponse::Error(CniError::try_again_later(format!("the allocator is not running: {e}"))),
            },
        },
    };
    let mut bytes = serde_json::to_vec(&response).unwrap_or_else(|e| {
        format!(r#"{{"error":{{"code":5,"msg":"encoding the response: {e}","details":""}}}}"#).into_bytes()
    });
    bytes.push(b'\n');
    if let Err(e) = write.write_all(&bytes).await {
        tracing::debug!(error = %e, "the plugin went away before the answer");
    }
}
