//! The node's allocation actor: ADD, DEL, CHECK, GC, STATUS and the answers to the
//! controller's release marks are messages to it. Calls of different pods run concurrently,
//! those of one pod one at a time, and node-side GC and release answers alone (module
//! `serial`), so neither ever interleaves with an allocation.

use std::sync::Arc;

use actix::{Actor, Context, Handler, Message, ResponseFuture};

use super::core::Core;
use super::error::Error;
use crate::protocol::{AgentRequest, AttachmentRequest, IpamResult};

/// The actor owning the node's allocation core.
pub struct NodeAllocator {
    core: Arc<Core>,
}

impl NodeAllocator {
    /// Wraps the core; start it with [`Actor::start`].
    pub fn new(core: Arc<Core>) -> Self {
        Self { core }
    }
}

impl Actor for NodeAllocator {
    type Context = Context<Self>;
}

/// One CNI call forwarded by the socket server; answers ADD's result, or nothing for the
/// other verbs.
#[derive(Message)]
#[rtype(result = "Result<Option<IpamResult>, Error>")]
pub struct Call(pub AgentRequest);

/// The key that serialises calls of one pod: `namespace/name`, or the sandbox when the
/// runtime named no pod (the runtime itself never overlaps calls of one sandbox).
fn pod_key(request: &AttachmentRequest) -> String {
    match &request.pod {
        Some(pod) => format!("{}/{}", pod.namespace, pod.name),
        None => format!("sandbox {}", request.container_id),
    }
}

impl Handler<Call> for NodeAllocator {
    // Not atomic: the actor takes the next message at once, and each call waits for its
    // turn in `serial` instead.
    type Result = ResponseFuture<Result<Option<IpamResult>, Error>>;

    fn handle(&mut self, Call(request): Call, _ctx: &mut Context<Self>) -> Self::Result {
        let core = self.core.clone();
        Box::pin(async move {
            match &request {
                AgentRequest::Add(r) => {
                    let _turn = core.serial.pod(&pod_key(r)).await;
                    core.add(r).await.map(Some)
                }
                AgentRequest::Del(r) => {
                    let _turn = core.serial.pod(&pod_key(r)).await;
                    core.del(r).await.map(|()| None)
                }
                AgentRequest::Check(r) => {
                    let _turn = core.serial.pod(&pod_key(r)).await;
                    core.check(r).await.map(|()| None)
                }
                AgentRequest::Gc(r) => {
                    // The runtime is asked first: a slow one must not hold the node.
                    let runtime = core.ask_runtime(false).await;
                    let _alone = core.serial.alone().await;
                    core.gc(r, runtime.as_deref()).await.map(|()| None)
                }
                AgentRequest::Status(r) => core.status(r).await.map(|()| None),
            }
        })
    }
}

/// Answer the controller's release marks on this node's records, with no CNI call under way.
#[derive(Message)]
#[rtype(result = "()")]
pub struct AnswerMarks;

impl Handler<AnswerMarks> for NodeAllocator {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _msg: AnswerMarks, _ctx: &mut Context<Self>) -> Self::Result {
        let core = self.core.clone();
        Box::pin(async move {
            if !core.has_marks_to_answer() {
                return;
            }
            // The pods are read first without the node to itself, and marks that must wait (a
            // sandbox the runtime still lists) are left out: only the writes stall CNI calls.
            let marks = core.marks_to_answer().await;
            if marks.is_empty() {
                return;
            }
            let _alone = core.serial.alone().await;
            if let Err(e) = core.answer_marks(marks).await {
                tracing::warn!(error = %e, "answering release marks failed; retrying on the next pass");
            }
        })
    }
}

/// Ask the runtime which sandboxes it has and release the attachments of those it no longer
/// has ([`Core::gone_from_runtime`], [`Core::release_gone`]); with the node to itself only
/// when there is one to release.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SweepRuntime;

impl Handler<SweepRuntime> for NodeAllocator {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _msg: SweepRuntime, _ctx: &mut Context<Self>) -> Self::Result {
        let core = self.core.clone();
        Box::pin(async move {
            let gone = core.gone_from_runtime().await;
            if gone.is_empty() {
                return;
            }
            let _alone = core.serial.alone().await;
            if let Err(e) = core.release_gone(gone).await {
                tracing::warn!(error = %e, "releasing the attachments of sandboxes the runtime no longer has failed; retrying on the next pass");
            }
        })
    }
}

/// Tend the node's spare IPs ([`Core::tend_spares`]): write the records of bound spares, and
/// reserve or give back spares, never while a node GC or mark answer runs; answers whether
/// every write went through.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct TendSpares;

impl Handler<TendSpares> for NodeAllocator {
    type Result = ResponseFuture<bool>;

    fn handle(&mut self, _msg: TendSpares, _ctx: &mut Context<Self>) -> Self::Result {
        let core = self.core.clone();
        Box::pin(async move {
            let _beside = core.serial.beside_verbs().await;
            core.tend_spares().await
        })
    }
}
