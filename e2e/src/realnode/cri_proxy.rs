//! A CRI proxy in front of a real node's runtime, for faults the runtime itself cannot be made
//! to show on cue: an agent given the proxy's socket as `--cri-socket` asks the runtime through
//! it. It forwards the calls the agent makes (`Version`, `ListPodSandbox`, `PodSandboxStatus`,
//! `GetContainerEvents`) unchanged, answers `Unimplemented` to the others, and fails the next
//! status calls on request with `Unavailable`, as containerd answers while it restarts, or as
//! a call past the agent's timeout ends.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::*;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Request, Response, Status};

use crate::error::{Error, Result};
use crate::kubelet::cri::{runtime_service, serve};

/// The status calls still to fail.
#[derive(Debug, Default)]
struct Failures {
    status_calls: AtomicUsize,
}

/// The service: the runtime's client and the faults.
struct Proxy {
    runtime: RuntimeServiceClient<Channel>,
    failures: Arc<Failures>,
}

runtime_service! {
    Proxy {
        type GetContainerEventsStream =
            Pin<Box<dyn futures::Stream<Item = std::result::Result<ContainerEventResponse, Status>> + Send>>;

        async fn version(&self, request: Request<VersionRequest>) -> std::result::Result<Response<VersionResponse>, Status> {
            self.runtime.clone().version(request.into_inner()).await
        }

        async fn list_pod_sandbox(
            &self,
            request: Request<ListPodSandboxRequest>,
        ) -> std::result::Result<Response<ListPodSandboxResponse>, Status> {
            self.runtime.clone().list_pod_sandbox(request.into_inner()).await
        }

        async fn pod_sandbox_status(
            &self,
            request: Request<PodSandboxStatusRequest>,
        ) -> std::result::Result<Response<PodSandboxStatusResponse>, Status> {
            let failing = self.failures.status_calls.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
            if failing.is_ok() {
                return Err(Status::unavailable("e2e CRI proxy fault: this status call fails"));
            }
            self.runtime.clone().pod_sandbox_status(request.into_inner()).await
        }

        async fn get_container_events(
            &self,
            request: Request<GetEventsRequest>,
        ) -> std::result::Result<Response<Self::GetContainerEventsStream>, Status> {
            let events = self.runtime.clone().get_container_events(request.into_inner()).await?.into_inner();
            Ok(Response::new(Box::pin(events)))
        }
    }
}

/// A running proxy; stops when dropped.
#[derive(Debug)]
pub struct CriProxy {
    socket: PathBuf,
    failures: Arc<Failures>,
    task: JoinHandle<()>,
}

impl CriProxy {
    /// Serves on `socket` a proxy of the runtime listening on `runtime`.
    pub async fn start(runtime: &Path, socket: &Path) -> Result<Self> {
        let failures = Arc::new(Failures::default());
        let proxy = Proxy { runtime: runtime_client(runtime)?, failures: failures.clone() };
        let task = tokio::spawn(serve(socket, proxy).await?);
        Ok(Self { socket: socket.to_path_buf(), failures, task })
    }

    /// The proxy's socket, to give an agent as `--cri-socket`.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Makes the next `count` `PodSandboxStatus` calls fail with `Unavailable`.
    pub fn fail_next_status_calls(&self, count: usize) {
        self.failures.status_calls.store(count, Ordering::Relaxed);
    }

    /// How many of the status calls made to fail have not been made yet.
    pub fn status_calls_to_fail(&self) -> usize {
        self.failures.status_calls.load(Ordering::Relaxed)
    }
}

/// A CRI client of the runtime listening on `socket`, connecting on its first call.
pub(crate) fn runtime_client(socket: &Path) -> Result<RuntimeServiceClient<Channel>> {
    let dial = socket.to_path_buf();
    let endpoint = Endpoint::try_from("http://cri.invalid").map_err(|e| Error::Tool {
        command: "CRI client".to_string(),
        reason: format!("building the endpoint of {}: {e}", socket.display()),
    })?;
    let channel = endpoint.connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
        let dial = dial.clone();
        async move { tokio::net::UnixStream::connect(dial).await.map(TokioIo::new) }
    }));
    Ok(RuntimeServiceClient::new(channel))
}

impl Drop for CriProxy {
    fn drop(&mut self) {
        self.task.abort();
        let _gone = std::fs::remove_file(&self.socket);
    }
}
