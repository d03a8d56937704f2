//! The simulated runtime's CRI `RuntimeService`, on a unix socket in the node's directory
//! ([`CRI_SOCKET`]): what an agent started with `--cri-socket` asks about the node's sandboxes.
//!
//! It answers as containerd 2.4 does (`internal/cri/server`): `ListPodSandbox` lists the
//! sandboxes in its store, which a sandbox enters only after its network is set up (CNI ADD)
//! and leaves when it is removed, so a sandbox whose ADD is in flight is not listed, and one
//! torn down (with or without its DEL) is gone; `PodSandboxStatus` of a sandbox not in the
//! store fails with `NotFound`, and its verbose `info` carries containerd's
//! `netNamespaceClosed`. The simulated runtime removes a sandbox as soon as it is torn down
//! (the kubelet's `RemovePodSandbox` following its `StopPodSandbox` at once), so it never
//! lists a NOTREADY one. `GetContainerEvents` streams a sandbox's `CONTAINER_CREATED_EVENT`
//! and `CONTAINER_STARTED_EVENT` when it enters the store and its `CONTAINER_DELETED_EVENT`
//! when it leaves, naming the sandbox itself as the container, as containerd does (which sends
//! the stream's response headers only with its first event; this one sends them at once,
//! which the agent, setting no timeout on the stream, does not tell apart). The calls
//! the agent makes are served; the others answer `Unimplemented`.
//! [`super::Faults::set_cri_unavailable`] makes every call fail with
//! `Unavailable`, as containerd answers while it is not initialized.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use k8s_cri::v1::runtime_service_server::RuntimeServiceServer;
use k8s_cri::v1::*;
use tonic::{Request, Response, Status};

use super::pods::RuntimeCalls;
use super::{Faults, Sandbox};
use crate::error::{Error, Result};

/// The socket's name in the node's directory.
pub const CRI_SOCKET: &str = "cri.sock";

/// The runtime's name, as `Version` answers it; the Node reports
/// `<RUNTIME_NAME>://<REPORTED_RUNTIME_VERSION>` as its `containerRuntimeVersion`.
pub const RUNTIME_NAME: &str = "e2e";

/// The runtime's version, as `Version` answers it: a distribution's package version, as
/// Debian's containerd answers `1.6.20~ds1`.
pub const RUNTIME_VERSION: &str = "2.4.2~ds1";

/// [`RUNTIME_VERSION`] as kubelet reports it in the Node's `containerRuntimeVersion`: a version
/// that does not read as semantic is read as generic, which drops what follows its numbers
/// (Kubernetes v1.37 `kuberuntime.newRuntimeVersion`, apimachinery's `util/version`).
pub const REPORTED_RUNTIME_VERSION: &str = "2.4.2";

/// How many events a slow follower of the event stream may fall behind before it misses some.
const EVENTS_BUFFERED: usize = 1024;

/// Where the simulated runtime publishes its container events.
pub(super) type Events = tokio::sync::broadcast::Sender<ContainerEventResponse>;

/// A new event channel.
pub(super) fn events() -> Events {
    tokio::sync::broadcast::channel(EVENTS_BUFFERED).0
}

/// Publishes the events of sandbox `id` entering (`entered`) or leaving the runtime's store.
pub(super) fn publish(events: &Events, id: &str, entered: bool) {
    let kinds: &[ContainerEventType] = match entered {
        true => &[ContainerEventType::ContainerCreatedEvent, ContainerEventType::ContainerStartedEvent],
        false => &[ContainerEventType::ContainerDeletedEvent],
    };
    let created_at = jiff::Timestamp::now().as_nanosecond().try_into().unwrap_or(i64::MAX);
    for kind in kinds {
        // No follower: nobody to tell.
        let _ = events.send(ContainerEventResponse {
            container_id: id.to_string(),
            container_event_type: *kind as i32,
            created_at,
            ..ContainerEventResponse::default()
        });
    }
}

/// The node's sandboxes, by pod UID, as the CRI service sees them.
pub(super) struct CriService {
    pub(super) sandboxes: Arc<Mutex<HashMap<String, Sandbox>>>,
    pub(super) faults: Arc<Faults>,
    pub(super) events: Events,
    pub(super) calls: Arc<RuntimeCalls>,
}

impl CriService {
    fn check_available(&self) -> std::result::Result<(), Status> {
        match self.faults.cri_unavailable() {
            true => Err(Status::unavailable("server is not initialized yet (e2e fault)")),
            false => Ok(()),
        }
    }

    fn find(&self, id: &str) -> Option<(String, Sandbox)> {
        if self.faults.hidden_from_cri(id) {
            return None;
        }
        let sandboxes = self.sandboxes.lock().ok()?;
        sandboxes.iter().find(|(_, s)| s.container_id == id).map(|(uid, s)| (uid.clone(), s.clone()))
    }
}

/// The CRI view of a sandbox of pod `uid`.
fn pod_sandbox(uid: &str, sandbox: &Sandbox) -> PodSandbox {
    let (namespace, name) = sandbox.pod.split_once('/').unwrap_or(("", &sandbox.pod));
    PodSandbox {
        id: sandbox.container_id.clone(),
        metadata: Some(PodSandboxMetadata {
            name: name.to_string(),
            uid: uid.to_string(),
            namespace: namespace.to_string(),
            attempt: 0,
        }),
        state: PodSandboxState::SandboxReady as i32,
        created_at: 1,
        ..PodSandbox::default()
    }
}

/// A `RuntimeService` for `$service` serving the calls the agent makes (`Version`,
/// `ListPodSandbox`, `PodSandboxStatus`, `GetContainerEvents`) as written, and answering
/// `Unimplemented` for every other call (the agent never makes those).
macro_rules! runtime_service {
    (@impl $service:ty { $($served:tt)* } $($call:ident($request:ident) -> $response:ident;)*) => {
        #[tonic::async_trait]
        impl k8s_cri::v1::runtime_service_server::RuntimeService for $service {
            $($served)*
            $(
                async fn $call(
                    &self,
                    _request: tonic::Request<k8s_cri::v1::$request>,
                ) -> std::result::Result<tonic::Response<k8s_cri::v1::$response>, tonic::Status> {
                    Err(tonic::Status::unimplemented(concat!("the e2e CRI service does not serve ", stringify!($call))))
                }
            )*
        }
    };
    ($service:ty { $($served:tt)* }) => {
        $crate::kubelet::cri::runtime_service!(@impl $service { $($served)* }
            run_pod_sandbox(RunPodSandboxRequest) -> RunPodSandboxResponse;
            stop_pod_sandbox(StopPodSandboxRequest) -> StopPodSandboxResponse;
            remove_pod_sandbox(RemovePodSandboxRequest) -> RemovePodSandboxResponse;
            create_container(CreateContainerRequest) -> CreateContainerResponse;
            start_container(StartContainerRequest) -> StartContainerResponse;
            stop_container(StopContainerRequest) -> StopContainerResponse;
            remove_container(RemoveContainerRequest) -> RemoveContainerResponse;
            list_containers(ListContainersRequest) -> ListContainersResponse;
            container_status(ContainerStatusRequest) -> ContainerStatusResponse;
            update_container_resources(UpdateContainerResourcesRequest) -> UpdateContainerResourcesResponse;
            reopen_container_log(ReopenContainerLogRequest) -> ReopenContainerLogResponse;
            exec_sync(ExecSyncRequest) -> ExecSyncResponse;
            exec(ExecRequest) -> ExecResponse;
            attach(AttachRequest) -> AttachResponse;
            port_forward(PortForwardRequest) -> PortForwardResponse;
            container_stats(ContainerStatsRequest) -> ContainerStatsResponse;
            list_container_stats(ListContainerStatsRequest) -> ListContainerStatsResponse;
            pod_sandbox_stats(PodSandboxStatsRequest) -> PodSandboxStatsResponse;
            list_pod_sandbox_stats(ListPodSandboxStatsRequest) -> ListPodSandboxStatsResponse;
            update_runtime_config(UpdateRuntimeConfigRequest) -> UpdateRuntimeConfigResponse;
            status(StatusRequest) -> StatusResponse;
            checkpoint_container(CheckpointContainerRequest) -> CheckpointContainerResponse;
            list_metric_descriptors(ListMetricDescriptorsRequest) -> ListMetricDescriptorsResponse;
            list_pod_sandbox_metrics(ListPodSandboxMetricsRequest) -> ListPodSandboxMetricsResponse;
            runtime_config(RuntimeConfigRequest) -> RuntimeConfigResponse;
        );
    };
}
pub(crate) use runtime_service;

runtime_service! {
    CriService {
        type GetContainerEventsStream =
            Pin<Box<dyn futures::Stream<Item = std::result::Result<ContainerEventResponse, Status>> + Send>>;

        async fn version(
            &self,
            _request: Request<VersionRequest>,
        ) -> std::result::Result<Response<VersionResponse>, Status> {
            self.check_available()?;
            Ok(Response::new(VersionResponse {
                version: "0.1.0".to_string(),
                runtime_name: RUNTIME_NAME.to_string(),
                runtime_version: RUNTIME_VERSION.to_string(),
                runtime_api_version: "v1".to_string(),
            }))
        }

        async fn list_pod_sandbox(
            &self,
            _request: Request<ListPodSandboxRequest>,
        ) -> std::result::Result<Response<ListPodSandboxResponse>, Status> {
            self.calls.cri_listings.fetch_add(1, Ordering::Relaxed);
            self.check_available()?;
            let sandboxes = self.sandboxes.lock().map_err(|_| Status::internal("sandbox table poisoned"))?;
            let items = sandboxes
            .iter()
            .filter(|(_, s)| !self.faults.hidden_from_cri(&s.container_id))
            .map(|(uid, s)| pod_sandbox(uid, s))
            .collect();
            Ok(Response::new(ListPodSandboxResponse { items }))
        }

        async fn pod_sandbox_status(
            &self,
            request: Request<PodSandboxStatusRequest>,
        ) -> std::result::Result<Response<PodSandboxStatusResponse>, Status> {
            self.check_available()?;
            if self.faults.take_status_failure() {
                return Err(Status::unavailable("server is not initialized yet (e2e fault: one status call)"));
            }
            let id = request.into_inner().pod_sandbox_id;
            let Some((uid, sandbox)) = self.find(&id) else {
                return Err(Status::not_found(format!("an error occurred when try to find sandbox: not found: {id}")));
            };
            let listed = pod_sandbox(&uid, &sandbox);
            let status = PodSandboxStatus {
                id: listed.id,
                metadata: listed.metadata,
                state: listed.state,
                created_at: listed.created_at,
                ..PodSandboxStatus::default()
            };
            let info = HashMap::from([("info".to_string(), r#"{"netNamespaceClosed":false}"#.to_string())]);
            Ok(Response::new(PodSandboxStatusResponse { status: Some(status), info, ..PodSandboxStatusResponse::default() }))
        }

        async fn get_container_events(
            &self,
            _request: Request<GetEventsRequest>,
        ) -> std::result::Result<Response<Self::GetContainerEventsStream>, Status> {
            self.calls.cri_event_streams.fetch_add(1, Ordering::Relaxed);
            self.check_available()?;
            if self.faults.events_end_at_once() {
                return Ok(Response::new(Box::pin(futures::stream::empty())));
            }
        let events = futures::stream::unfold(self.events.subscribe(), |mut events| async move {
            loop {
                match events.recv().await {
                    Ok(event) => return Some((Ok(event), events)),
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
                }
            }
        });
        Ok(Response::new(Box::pin(events)))
        }
    }
}

/// The CRI socket of the simulated node whose directory is `dir`.
pub fn socket_in(dir: &Path) -> PathBuf {
    dir.join(CRI_SOCKET)
}

/// Binds the CRI socket `socket` (replacing a stale one) and serves `service` on it until the
/// returned task is aborted.
pub(crate) async fn serve<S>(socket: &Path, service: S) -> Result<impl std::future::Future<Output = ()> + use<S>>
where
    S: k8s_cri::v1::runtime_service_server::RuntimeService,
{
    let socket = socket.to_path_buf();
    match std::fs::remove_file(&socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("removing a stale CRI socket", &socket)(e)),
    }
    let listener = tokio::net::UnixListener::bind(&socket).map_err(Error::io("binding the CRI socket", &socket))?;
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    Ok(async move {
        let served = tonic::transport::Server::builder()
            .add_service(RuntimeServiceServer::new(service))
            .serve_with_incoming(incoming)
            .await;
        if let Err(e) = served {
            tracing::warn!(socket = %socket.display(), error = %e, "an e2e CRI service stopped");
        }
    })
}
