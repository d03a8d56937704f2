//! The node's one allocation actor: ADD, DEL, CHECK, GC, STATUS and the answers to the
//! controller's release marks are messages to it and are served one at a time, so neither
//! node-side GC nor a release answer ever interleaves with an allocation.

use std::sync::Arc;

use actix::{Actor, AtomicResponse, Context, Handler, Message, WrapFuture};

use super::core::Core;
use super::error::Error;
use crate::protocol::{AgentRequest, IpamResult};

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

impl Handler<Call> for NodeAllocator {
    // Atomic: the actor takes no other message until this one's future is done.
    type Result = AtomicResponse<Self, Result<Option<IpamResult>, Error>>;

    fn handle(&mut self, Call(request): Call, _ctx: &mut Context<Self>) -> Self::Result {
        let core = self.core.clone();
        AtomicResponse::new(Box::pin(
            async move {
                match &request {
                    AgentRequest::Add(r) => core.add(r).await.map(Some),
                    AgentRequest::Del(r) => core.del(r).await.map(|()| None),
                    AgentRequest::Check(r) => core.check(r).await.map(|()| None),
                    AgentRequest::Gc(r) => core.gc(r).await.map(|()| None),
                    AgentRequest::Status(r) => core.status(r).await.map(|()| None),
                }
            }
            .into_actor(self),
        ))
    }
}

/// Answer the controller's release marks on this node's records, under the allocation lock.
#[derive(Message)]
#[rtype(result = "()")]
pub struct AnswerMarks;

impl Handler<AnswerMarks> for NodeAllocator {
    type Result = AtomicResponse<Self, ()>;

    fn handle(&mut self, _msg: AnswerMarks, _ctx: &mut Context<Self>) -> Self::Result {
        let core = self.core.clone();
        AtomicResponse::new(Box::pin(
            async move {
                if let Err(e) = core.answer_marks().await {
                    tracing::warn!(error = %e, "answering release marks failed; retrying on the next pass");
                }
            }
            .into_actor(self),
        ))
    }
}
