//! The CRI calls the agent makes: `Version`, `ListPodSandbox`, then `PodSandboxStatus` for the
//! sandboxes of interest the listing does not show READY, and the `GetContainerEvents` stream.
//! Over the runtime's unix socket; each unary call is bounded by a timeout (the stream is not:
//! containerd sends its headers with its first event); the channel reconnects by itself after
//! the runtime restarts.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerEventType, GetEventsRequest, ListPodSandboxRequest, PodSandboxState, PodSandboxStatusRequest,
    VersionRequest,
};
use tonic::transport::{Channel, Endpoint, Uri};

use super::sandboxes::{RuntimeSandbox, RuntimeSandboxes, network_closed};

/// How many `PodSandboxStatus` calls run at once.
const STATUS_CALLS_AT_ONCE: usize = 16;

/// Whether `error` is the runtime saying it does not serve the call at all.
pub fn unimplemented(error: &CriError) -> bool {
    matches!(error, CriError::Call { status, .. } if status.code() == tonic::Code::Unimplemented)
}

/// A failed conversation with the runtime.
#[derive(Debug, thiserror::Error)]
pub enum CriError {
    /// The socket path cannot name a channel.
    #[error("the CRI socket {socket} cannot be used: {source}")]
    Endpoint {
        /// The socket.
        socket: PathBuf,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// A call got no answer within the timeout.
    #[error("CRI {call} over {socket} got no answer within {timeout:?}")]
    Timeout {
        /// The call.
        call: &'static str,
        /// The socket.
        socket: PathBuf,
        /// The timeout.
        timeout: Duration,
    },
    /// A call failed (the runtime is down, restarting, slow or refuses).
    #[error("CRI {call} over {socket} failed: {status}")]
    Call {
        /// The call.
        call: &'static str,
        /// The socket.
        socket: PathBuf,
        /// The gRPC status.
        status: Box<tonic::Status>,
    },
}

/// A client of the runtime's CRI `RuntimeService` on a unix socket.
#[derive(Clone, Debug)]
pub struct CriClient {
    socket: PathBuf,
    channel: Channel,
    timeout: Duration,
}

/// What the runtime says it is (`Version`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuntimeVersion {
    /// `runtime_name`, e.g. `containerd`.
    pub name: String,
    /// `runtime_version`, e.g. `v2.4.2`.
    pub version: String,
}

impl RuntimeVersion {
    /// How kubelet reports it as the Node's `status.nodeInfo.containerRuntimeVersion`:
    /// `<name>://<version>`, the version as [`kubelet_version`] reads it.
    pub fn as_node_reports(&self) -> String {
        format!("{}://{}", self.name, kubelet_version(&self.version))
    }

    /// Whether the Node's `status.nodeInfo.containerRuntimeVersion`, `reported`, names this
    /// runtime: kubelet writes it from the same `Version` call ([`RuntimeVersion::as_node_reports`]).
    /// The agent asks only the runtime its kubelet uses.
    pub fn is_reported_as(&self, reported: &str) -> bool {
        // Two runtimes of one name whose versions kubelet cannot read would be told apart by
        // nothing: such a runtime is never taken for the node's.
        kubelet_version(&self.version) != UNKNOWN_VERSION && reported == self.as_node_reports()
    }

    /// Whether the runtime hands each container event to one follower only, taking them from
    /// kubelet's evented PLEG: containerd before 2.0 drains one channel for all followers.
    pub fn events_exclusive(&self) -> bool {
        self.name == "containerd" && (self.version.starts_with("v1.") || self.version.starts_with("1."))
    }
}

/// The runtime's version `raw` as kubelet reports it in the Node's `containerRuntimeVersion`
/// (Kubernetes v1.37 `kuberuntime.newRuntimeVersion` and apimachinery's `util/version`): read
/// as semantic (three numbers, an optional pre-release and build metadata), else as generic
/// (two numbers or more, anything after them dropped), after an optional leading `v`, and
/// written back as its numbers (leading zeros gone), pre-release and build metadata. A version
/// neither reads is reported `Unknown`. So containerd's `v2.4.2` is `2.4.2`, and a
/// distribution's `1.6.20~ds1` is `1.6.20`.
pub fn kubelet_version(raw: &str) -> String {
    parse_kubelet_version(raw).unwrap_or_else(|| UNKNOWN_VERSION.to_string())
}

/// What kubelet reports for a version it cannot read.
const UNKNOWN_VERSION: &str = "Unknown";

/// Whether `c` is whitespace to Go's regular expressions (`\s`: `[\t\n\f\r ]`).
fn go_space(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\x0c' | '\r' | ' ')
}

fn parse_kubelet_version(raw: &str) -> Option<String> {
    let trimmed = raw.trim_start_matches(go_space);
    let trimmed = trimmed.strip_prefix('v').unwrap_or(trimmed);
    // The numbers: runs of digits joined by single dots; whatever follows is the extra.
    let digits = |from: usize| trimmed[from..].bytes().take_while(u8::is_ascii_digit).count();
    let mut end = digits(0);
    if end == 0 {
        return None;
    }
    while trimmed[end..].starts_with('.') && digits(end + 1) > 0 {
        end += 1 + digits(end + 1);
    }
    let (numbers, extra) = trimmed.split_at(end);
    // kubelet's pattern matches no line break after the numbers.
    if extra.contains('\n') {
        return None;
    }
    let components: Vec<&str> = numbers.split('.').collect();
    let number = |c: &str| c.parse::<u64>().ok();
    let semantic = components.len() == 3 && components.iter().all(|c| *c == "0" || !c.starts_with('0'));
    let parsed: Vec<u64> = components.iter().map(|c| number(c)).collect::<Option<_>>()?;
    let numbers = parsed.iter().map(u64::to_string).collect::<Vec<_>>().join(".");
    if semantic && let Some(suffix) = semver_suffix(extra) {
        return Some(numbers + &suffix);
    }
    // Generic: at least two numbers, the first without a leading zero; the rest is dropped.
    (components.len() >= 2 && (components[0] == "0" || !components[0].starts_with('0'))).then_some(numbers)
}

/// The pre-release and build metadata of a semantic version, as kubelet writes them back
/// (`-<pre-release>+<build>`), or `None` when `extra` is neither.
fn semver_suffix(extra: &str) -> Option<String> {
    let extra = extra.trim_end_matches(go_space);
    let identifiers = |part: &str| {
        !part.is_empty()
            && part.split('.').all(|id| !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
    };
    let (rest, build) = match extra.split_once('+') {
        Some((rest, build)) if identifiers(build) => (rest, Some(build)),
        Some(_) => return None,
        None => (extra, None),
    };
    let pre = match rest {
        "" => None,
        rest => {
            let pre = rest.strip_prefix('-').filter(|pre| identifiers(pre))?;
            // A numeric identifier has no leading zero (one too long for a number is not checked).
            let numeric_zero = |id: &str| id.len() > 1 && id.starts_with('0') && id.parse::<u64>().is_ok();
            (!pre.split('.').any(numeric_zero)).then_some(pre)?;
            Some(pre)
        }
    };
    Some(pre.map(|p| format!("-{p}")).unwrap_or_default() + &build.map(|b| format!("+{b}")).unwrap_or_default())
}

impl CriClient {
    /// A client of the runtime at `socket`, each call failing after `timeout`. Connects on the
    /// first call, and again after a broken connection.
    pub fn new(socket: &Path, timeout: Duration) -> Result<Self, CriError> {
        let path = socket.to_path_buf();
        // The URI is never dialled: the connector below opens the socket.
        let endpoint = Endpoint::try_from("http://cri.invalid")
            .map_err(|source| CriError::Endpoint { socket: path.clone(), source })?
            .connect_timeout(timeout);
        let dial = path.clone();
        let channel = endpoint.connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
            let dial = dial.clone();
            async move { tokio::net::UnixStream::connect(dial).await.map(TokioIo::new) }
        }));
        Ok(Self { socket: path, channel, timeout })
    }

    /// Runs the unary `call` named `name`, failing after the client's timeout.
    async fn bounded<T>(
        &self,
        name: &'static str,
        call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, CriError> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(self.failed(name, status)),
            Err(_) => Err(CriError::Timeout { call: name, socket: self.socket.clone(), timeout: self.timeout }),
        }
    }

    /// What the runtime says it is.
    pub async fn version(&self) -> Result<RuntimeVersion, CriError> {
        let mut client = RuntimeServiceClient::new(self.channel.clone());
        let request = VersionRequest { version: "v1".to_string() };
        let answer = self.bounded("Version", client.version(request)).await?;
        Ok(RuntimeVersion { name: answer.runtime_name, version: answer.runtime_version })
    }

    /// The socket this client talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// What the runtime says of each sandbox in `of_interest`: one listing, then one verbose
    /// status call for each such sandbox the listing does not show READY (its network's state,
    /// or the `NotFound` that makes it absent). Fails when the listing fails; a status call's
    /// failure other than `NotFound` leaves that sandbox [`RuntimeSandbox::Unknown`].
    pub async fn sandboxes(&self, of_interest: &BTreeSet<String>) -> Result<RuntimeSandboxes, CriError> {
        let requested_at = Instant::now();
        let mut client = RuntimeServiceClient::new(self.channel.clone());
        let listing = client.list_pod_sandbox(ListPodSandboxRequest { filter: None });
        let listed = self.bounded("ListPodSandbox", listing).await?.items;
        let ready: BTreeSet<String> =
            listed.into_iter().filter(|s| s.state == PodSandboxState::SandboxReady as i32).map(|s| s.id).collect();
        let mut sandboxes: BTreeMap<String, RuntimeSandbox> =
            of_interest.intersection(&ready).map(|id| (id.clone(), RuntimeSandbox::Ready)).collect();
        let asked = of_interest.difference(&ready).cloned().collect::<Vec<_>>();
        let answers: Vec<(String, RuntimeSandbox)> = futures::stream::iter(asked)
            .map(|id| {
                let mut client = client.clone();
                async move {
                    let request = PodSandboxStatusRequest { pod_sandbox_id: id.clone(), verbose: true };
                    let answer = match self.bounded("PodSandboxStatus", client.pod_sandbox_status(request)).await {
                        Ok(response) => {
                            match response.status.map(|s| s.state) {
                                Some(state) if state == PodSandboxState::SandboxReady as i32 => RuntimeSandbox::Ready,
                                _ => RuntimeSandbox::NotReady { network_closed: network_closed(&response.info) },
                            }
                        }
                        Err(CriError::Call { status, .. }) if status.code() == tonic::Code::NotFound => {
                            RuntimeSandbox::Absent
                        }
                        Err(e) => {
                            tracing::debug!(sandbox = %id, error = %e, "the runtime did not say whether it has the sandbox");
                            RuntimeSandbox::Unknown
                        }
                    };
                    (id, answer)
                }
            })
            .buffer_unordered(STATUS_CALLS_AT_ONCE)
            .collect()
            .await;
        sandboxes.extend(answers);
        Ok(RuntimeSandboxes { requested_at, answered_at: Instant::now(), sandboxes })
    }

    /// The runtime's container event stream (`GetContainerEvents`, which kubelet's evented
    /// PLEG follows), each event reduced to the ID of the sandbox it reports stopped or deleted
    /// (containerd names the sandbox itself as the container of its own events), or `None`
    /// for any other event. Ends when the runtime closes it or a message fails; a runtime
    /// that streams no events answers `Unimplemented`, or (CRI-O with `enable_pod_events =
    /// false`) ends the stream at once without an event.
    pub async fn ended_sandboxes(
        &self,
    ) -> Result<impl futures::Stream<Item = Result<Option<String>, CriError>> + use<>, CriError> {
        let mut client = RuntimeServiceClient::new(self.channel.clone());
        let events = client
            .get_container_events(GetEventsRequest {})
            .await
            .map_err(|status| self.failed("GetContainerEvents", status))?
            .into_inner();
        let socket = self.socket.clone();
        let ended =
            [ContainerEventType::ContainerStoppedEvent as i32, ContainerEventType::ContainerDeletedEvent as i32];
        Ok(events.filter_map(move |event| {
            let item = match event {
                Ok(event) if ended.contains(&event.container_event_type) => Ok(Some(event.container_id)),
                Ok(_) => Ok(None),
                Err(status) => {
                    Err(CriError::Call { call: "GetContainerEvents", socket: socket.clone(), status: Box::new(status) })
                }
            };
            futures::future::ready(Some(item))
        }))
    }

    fn failed(&self, call: &'static str, status: tonic::Status) -> CriError {
        CriError::Call { call, socket: self.socket.clone(), status: Box::new(status) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_reads_as_kubelet_reports_it() {
        let cases = [
            // (the runtime's Version, as the Node reports it)
            ("v2.4.2", "2.4.2"),
            ("2.4.2", "2.4.2"),
            ("1.32.0", "1.32.0"),
            ("1.32.0-rc.1", "1.32.0-rc.1"),
            ("1.32.0-rc.1+dev.3", "1.32.0-rc.1+dev.3"),
            ("v1.7.27+unknown", "1.7.27+unknown"),
            ("1.6.20~ds1", "1.6.20"),
            ("1.7.24-0ubuntu1~24.04.1", "1.7.24"),
            ("1.7.24~ds1-1+b1", "1.7.24"),
            ("2.0", "2.0"),
            ("1.06.3~x", "1.6.3"),
            ("1.2.3.4", "1.2.3.4"),
            ("1.2.3-01", "1.2.3"),
            ("1.2.", "1.2"),
            ("1.2..3", "1.2"),
            ("1..2", "Unknown"),
            ("1", "Unknown"),
            ("0", "Unknown"),
            ("01.2.3", "Unknown"),
            ("dev", "Unknown"),
            ("", "Unknown"),
            // Go's `\s` is [\t\n\f\r ], its `.` matches no line break.
            (" \t1.2.3", "1.2.3"),
            ("\u{a0}1.2.3", "Unknown"),
            ("\u{b}1.2.3", "Unknown"),
            ("1.7.24\n", "Unknown"),
            ("1.6.20~ds1\n", "Unknown"),
            ("1.2.3-rc.1 \r", "1.2.3-rc.1"),
            ("1.2.3-rc.1\u{b}", "1.2.3"),
            ("1.2.3-rc.1\u{a0}", "1.2.3"),
            ("1.2.3-099999999999999999999", "1.2.3-099999999999999999999"),
            ("99999999999999999999.1.2", "Unknown"),
        ];
        for (raw, reported) in cases {
            assert_eq!(kubelet_version(raw), reported, "{raw:?}");
        }
    }

    #[test]
    fn a_runtime_is_the_nodes_when_kubelet_reports_its_name_and_version() {
        let containerd = RuntimeVersion { name: "containerd".into(), version: "v2.4.2".into() };
        assert!(containerd.is_reported_as("containerd://2.4.2"), "kubelet drops the v of a semantic version");
        let debian = RuntimeVersion { name: "containerd".into(), version: "1.6.20~ds1".into() };
        assert!(debian.is_reported_as("containerd://1.6.20"), "kubelet drops what follows a generic version");
        assert!(!debian.is_reported_as("containerd://1.6.2"));
        let unreadable = RuntimeVersion { name: "containerd".into(), version: "dev".into() };
        assert!(!unreadable.is_reported_as("containerd://Unknown"), "an unreadable version is no one's");
        assert!(!containerd.is_reported_as("containerd://1.7.2"), "another containerd");
        assert!(!containerd.is_reported_as("cri-o://2.4.2"));
        assert!(!containerd.is_reported_as("containerd"));
        assert!(!containerd.is_reported_as(""));
        let crio = RuntimeVersion { name: "cri-o".into(), version: "1.32.0".into() };
        assert!(crio.is_reported_as("cri-o://1.32.0"));
    }

    #[test]
    fn only_containerd_1_hands_each_event_to_one_follower() {
        let version = |name: &str, version: &str| RuntimeVersion { name: name.into(), version: version.into() };
        assert!(version("containerd", "v1.7.27").events_exclusive());
        assert!(version("containerd", "1.7.2").events_exclusive());
        assert!(!version("containerd", "v2.4.2").events_exclusive());
        assert!(!version("cri-o", "1.32.0").events_exclusive());
    }
}
