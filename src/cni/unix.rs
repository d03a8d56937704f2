//! [`Transport`] over the agent's unix socket, using blocking std sockets.
//!
//! The plugin is a short-lived process, so blocking I/O is simplest. The whole call (connect,
//! write, read) shares one deadline of [`AgentSettings::timeout`], capped at [`MAX_TIMEOUT`].
//! std has no connect timeout for unix sockets, so connecting runs on a helper thread that is
//! abandoned on timeout (the process exits right after).

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use super::netconf::{AgentSettings, TIMEOUT_SECONDS_RANGE};
use super::{Transport, TransportError};
use crate::protocol::{AgentRequest, AgentResponse, MAX_REQUEST_BYTES};

/// Largest response line accepted from the agent; a longer one is a protocol error.
pub const MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;

/// Longest budget for one call, whatever [`AgentSettings::timeout`] says, so deadlines cannot overflow.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(*TIMEOUT_SECONDS_RANGE.end());

/// The production transport: one connection to the agent's unix socket per call.
#[derive(Debug, Clone, Copy, Default)]
pub struct UnixTransport;

/// Time left until `deadline`, or a timeout error once it has passed.
fn remaining(deadline: Instant, socket: &Path, timeout: Duration) -> Result<Duration, TransportError> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|left| !left.is_zero())
        .ok_or_else(|| TransportError::TimedOut { socket: socket.to_path_buf(), timeout })
}

/// Maps an I/O error during an established exchange to a timeout or a connection error.
fn exchange_error(error: io::Error, socket: &Path, timeout: Duration) -> TransportError {
    match error.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            TransportError::TimedOut { socket: socket.to_path_buf(), timeout }
        }
        _ => TransportError::Io { socket: socket.to_path_buf(), source: error },
    }
}

/// Connects to `socket`, giving up after `timeout`.
fn connect(socket: &Path, timeout: Duration) -> Result<UnixStream, TransportError> {
    let (sender, receiver) = mpsc::channel();
    let path = socket.to_path_buf();
    thread::Builder::new()
        .name("agent-connect".into())
        .spawn(move || {
            // The receiver is gone only if the caller already timed out; nothing is left to tell.
            let _ = sender.send(UnixStream::connect(&path));
        })
        .map_err(|source| TransportError::Unreachable { socket: socket.to_path_buf(), source })?;
    match receiver.recv_timeout(timeout) {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(source)) => Err(TransportError::Unreachable { socket: socket.to_path_buf(), source }),
        Err(RecvTimeoutError::Timeout) => Err(TransportError::TimedOut { socket: socket.to_path_buf(), timeout }),
        Err(RecvTimeoutError::Disconnected) => Err(TransportError::Unreachable {
            socket: socket.to_path_buf(),
            source: io::Error::other("connect thread ended without a result"),
        }),
    }
}

/// Reads one response line (up to `\n` or end of stream) before `deadline`.
fn read_line(
    stream: &mut UnixStream,
    deadline: Instant,
    socket: &Path,
    timeout: Duration,
) -> Result<Vec<u8>, TransportError> {
    let mut line = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let left = remaining(deadline, socket, timeout)?;
        stream.set_read_timeout(Some(left)).map_err(|e| exchange_error(e, socket, timeout))?;
        let read = match stream.read(&mut chunk) {
            Ok(read) => read,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => return Err(exchange_error(error, socket, timeout)),
        };
        let received = &chunk[..read];
        if read == 0 {
            break;
        }
        if let Some(end) = received.iter().position(|byte| *byte == b'\n') {
            line.extend_from_slice(&received[..end]);
            break;
        }
        line.extend_from_slice(received);
        if line.len() > MAX_RESPONSE_BYTES {
            return Err(TransportError::Protocol {
                socket: socket.to_path_buf(),
                reason: format!("response is longer than {MAX_RESPONSE_BYTES} bytes"),
            });
        }
    }
    if line.iter().all(u8::is_ascii_whitespace) {
        return Err(TransportError::Protocol {
            socket: socket.to_path_buf(),
            reason: "connection closed without a response".into(),
        });
    }
    Ok(line)
}

impl Transport for UnixTransport {
    fn call(&self, agent: &AgentSettings, request: &AgentRequest) -> Result<AgentResponse, TransportError> {
        let socket: &Path = &agent.socket;
        let timeout = agent.timeout.min(MAX_TIMEOUT);
        let deadline = Instant::now() + timeout;
        let mut payload = serde_json::to_vec(request).map_err(|e| TransportError::Protocol {
            socket: socket.to_path_buf(),
            reason: format!("cannot encode the request: {e}"),
        })?;
        payload.push(b'\n');
        if payload.len() > MAX_REQUEST_BYTES {
            return Err(TransportError::Oversized { bytes: payload.len(), limit: MAX_REQUEST_BYTES });
        }
        let mut stream = connect(socket, timeout)?;
        stream
            .set_write_timeout(Some(remaining(deadline, socket, timeout)?))
            .map_err(|e| exchange_error(e, socket, timeout))?;
        stream.write_all(&payload).map_err(|e| exchange_error(e, socket, timeout))?;
        stream.shutdown(Shutdown::Write).map_err(|e| exchange_error(e, socket, timeout))?;
        let line = read_line(&mut stream, deadline, socket, timeout)?;
        serde_json::from_slice(&line).map_err(|e| TransportError::Protocol {
            socket: socket.to_path_buf(),
            reason: format!(
                "cannot decode the response {:?}: {e}",
                String::from_utf8_lossy(&line[..line.len().min(200)])
            ),
        })
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::protocol::{IpConfig, IpamResult, StatusRequest};
    use std::io::BufRead;
    use std::os::unix::net::UnixListener;
    use std::path::PathBuf;

    /// A fresh directory under the system temp dir, removed again by [`TempDir::drop`].
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let path = std::env::temp_dir().join(format!("ipwarden-cni-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).unwrap();
            Self(path)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn settings(socket: PathBuf, millis: u64) -> AgentSettings {
        AgentSettings { socket, timeout: Duration::from_millis(millis) }
    }

    fn status_request() -> AgentRequest {
        AgentRequest::Status(StatusRequest { network: "pods".into(), cni_version: "1.1.0".into() })
    }

    /// Serves one connection: reads the request line and answers with `reply`.
    fn serve_once(listener: UnixListener, reply: &'static [u8]) -> thread::JoinHandle<String> {
        thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = io::BufReader::new(stream.try_clone().unwrap());
            let mut request = String::new();
            reader.read_line(&mut request).unwrap();
            let mut rest = Vec::new();
            reader.read_to_end(&mut rest).unwrap();
            assert!(rest.is_empty(), "the plugin sends exactly one line");
            (&stream).write_all(reply).unwrap();
            request
        })
    }

    #[test]
    fn round_trip_sends_one_line_and_decodes_the_response() {
        let dir = TempDir::new("round-trip");
        let socket = dir.0.join("agent.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let server = serve_once(listener, b"{\"ok\":{\"result\":{\"ips\":[{\"address\":\"10.0.0.5/24\"}]}}}\n");
        let response = UnixTransport.call(&settings(socket, 5_000), &status_request()).unwrap();
        let request = server.join().unwrap();
        assert!(request.ends_with('\n'));
        assert_eq!(serde_json::from_str::<AgentRequest>(&request).unwrap(), status_request());
        assert_eq!(
            response,
            AgentResponse::Ok {
                result: Some(IpamResult {
                    ips: vec![IpConfig { address: "10.0.0.5/24".into(), gateway: None, interface: None }],
                    ..IpamResult::default()
                })
            }
        );
    }

    #[test]
    fn response_without_trailing_newline_is_accepted_at_end_of_stream() {
        let dir = TempDir::new("no-newline");
        let socket = dir.0.join("agent.sock");
        let server = serve_once(UnixListener::bind(&socket).unwrap(), b"{\"ok\":{}}");
        let response = UnixTransport.call(&settings(socket, 5_000), &status_request()).unwrap();
        server.join().unwrap();
        assert_eq!(response, AgentResponse::Ok { result: None });
    }

    #[test]
    fn missing_socket_is_unreachable() {
        let dir = TempDir::new("missing");
        let error = UnixTransport.call(&settings(dir.0.join("none.sock"), 1_000), &status_request()).unwrap_err();
        assert!(matches!(error, TransportError::Unreachable { .. }), "{error:?}");
        assert!(error.to_string().contains("none.sock"), "{error}");
    }

    #[test]
    fn a_request_over_the_agents_limit_is_refused_before_connecting() {
        let dir = TempDir::new("oversized");
        let request =
            AgentRequest::Status(StatusRequest { network: "n".repeat(MAX_REQUEST_BYTES), cni_version: "1.1.0".into() });
        let error = UnixTransport.call(&settings(dir.0.join("none.sock"), 1_000), &request).unwrap_err();
        assert!(matches!(error, TransportError::Oversized { limit: MAX_REQUEST_BYTES, .. }), "{error:?}");
    }

    #[test]
    fn huge_timeout_is_capped_instead_of_overflowing_the_deadline() {
        let dir = TempDir::new("huge-timeout");
        let agent = AgentSettings { socket: dir.0.join("none.sock"), timeout: Duration::MAX };
        let error = UnixTransport.call(&agent, &status_request()).unwrap_err();
        assert!(matches!(error, TransportError::Unreachable { .. }), "{error:?}");
    }

    #[test]
    fn stale_socket_file_without_listener_is_unreachable() {
        let dir = TempDir::new("stale");
        let socket = dir.0.join("agent.sock");
        drop(UnixListener::bind(&socket).unwrap());
        let error = UnixTransport.call(&settings(socket, 1_000), &status_request()).unwrap_err();
        assert!(matches!(error, TransportError::Unreachable { .. }), "{error:?}");
    }

    #[test]
    fn silent_agent_times_out() {
        let dir = TempDir::new("silent");
        let socket = dir.0.join("agent.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let server = thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            thread::sleep(Duration::from_millis(600));
            drop(stream);
        });
        let started = Instant::now();
        let error = UnixTransport.call(&settings(socket, 200), &status_request()).unwrap_err();
        assert!(matches!(error, TransportError::TimedOut { .. }), "{error:?}");
        assert!(started.elapsed() < Duration::from_millis(550));
        server.join().unwrap();
    }

    #[test]
    fn garbage_or_empty_responses_are_protocol_errors() {
        for (name, reply) in [("garbage", &b"not json\n"[..]), ("empty", &b""[..]), ("blank", &b"\n"[..])] {
            let dir = TempDir::new(name);
            let socket = dir.0.join("agent.sock");
            let server = serve_once(UnixListener::bind(&socket).unwrap(), reply);
            let error = UnixTransport.call(&settings(socket, 5_000), &status_request()).unwrap_err();
            server.join().unwrap();
            assert!(matches!(error, TransportError::Protocol { .. }), "{name}: {error:?}");
        }
    }
}
