//! Answering the controller's release marks on this node's records
//! ([`crate::gc::handshake`]), under the allocation lock.

use std::time::Duration;

use ipnet::IpNet;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::Api;

use super::block_writes::ReleaseTrigger;
use super::checkpoint::AttachmentKey;
use super::core::Core;
use super::error::Error;
use crate::crd::{Allocation, HandshakeState};
use crate::gc::handshake::{AgentAnswer, PodOnNode, SandboxOnNode, agent_answer};

/// A release mark on this node's record and the answer decided for it.
pub struct Due {
    block: String,
    pool: String,
    cidr: IpNet,
    ip: String,
    record: Allocation,
    answer: AgentAnswer,
    state: HandshakeState,
    sandbox: SandboxOnNode,
    /// The checkpoint entries holding the IP (dropped with a `ready-for-release`).
    attached: Vec<AttachmentKey>,
}

impl Core {
    /// The marks on this node's records that have an answer to write now
    /// ([`crate::gc::handshake`]), decided from the cache, the checkpoint and a live read of
    /// each record's pod; marks that must wait are left out. Read without the node to itself
    /// first, so a pass with nothing to write never stalls an ADD, and again by
    /// [`Core::answer_marks`] with the node to itself.
    pub async fn answers_due(&self) -> Result<Vec<Due>, Error> {
        let marked: Vec<(String, String, IpNet, String, Allocation)> = self
            .blocks
            .state()
            .iter()
            .filter_map(|b| b.spec.cidr.parse::<IpNet>().ok().map(|cidr| (b, cidr)))
            .flat_map(|(b, cidr)| {
                b.spec
                    .allocations
                    .iter()
                    .filter(|(_, r)| self.is_mark_for_this_node(r))
                    .map(move |(ip, r)| (b.name_any(), b.spec.pool.clone(), cidr, ip.clone(), r.clone()))
            })
            .collect();
        let mut due = Vec::new();
        for (block, pool, cidr, ip, record) in marked {
            let pod = self.pod_on_node(&record).await?;
            let (attached, listed_ago) = self.checkpoint.read(|checkpoint| {
                let attached: Vec<AttachmentKey> =
                    checkpoint.entries().filter(|e| e.ips.iter().any(|i| i.ip == ip)).map(|e| e.key.clone()).collect();
                let listed = attached.iter().filter_map(|k| checkpoint.listed_at(k)).max();
                (attached, listed.map(|at| at.elapsed()))
            });
            // Until the runtime's first CNI GC since the agent started, the runtime has not
            // said which sandboxes it still has: count them as listed at the start.
            let listed_ago = listed_ago.or_else(|| self.runtime_gc_pending().then(|| self.started.elapsed()));
            let marked_at = record.release_handshake.as_ref().map_or(Timestamp::UNIX_EPOCH, |h| h.marked_at.0);
            let marked_for = Duration::try_from(Timestamp::now().duration_since(marked_at)).unwrap_or(Duration::ZERO);
            let grace = self.settings.sandbox_grace;
            let sandbox = SandboxOnNode::of(!attached.is_empty(), listed_ago, grace);
            let answer = agent_answer(pod, sandbox, marked_for, grace);
            let Some(state) = answer.state() else { continue };
            due.push(Due { block, pool, cidr, ip, record, answer, state, sandbox, attached });
        }
        Ok(due)
    }

    /// Answers the controller's release marks on this node's records that have an answer
    /// now ([`Core::answers_due`]). Runs with the node to itself (module `serial`), so no
    /// ADD, DEL or GC interleaves: after `ready-for-release` the IP is in no checkpoint entry,
    /// and only a new record (which clears the mark) could hand it out again. Returns how
    /// many marks were answered; marks that must wait are left for the next pass.
    pub async fn answer_marks(&self) -> Result<usize, Error> {
        let mut answered = 0;
        for due in self.answers_due().await? {
            let Due { block, pool, cidr, ip, record, answer, state, sandbox, attached } = due;
            let detail = match (answer, sandbox) {
                (AgentAnswer::DoNotRelease, _) => "the pod is running on this node".to_string(),
                (_, SandboxOnNode::Detached) => "no sandbox on this node holds the IP".to_string(),
                (_, _) => format!(
                    "its sandbox got no DEL within {} s of the mark; counted as lost",
                    self.settings.sandbox_grace.as_secs()
                ),
            };
            let written = self
                .write_block(&block, &pool, cidr, |spec| {
                    let current = spec.allocations.get_mut(&ip).filter(|r| r.pod.uid == record.pod.uid)?;
                    let handshake =
                        current.release_handshake.as_mut().filter(|h| h.state == HandshakeState::MarkedForRelease)?;
                    handshake.state = state;
                    handshake.detail = Some(detail.clone());
                    Some(())
                })
                .await?;
            if written.is_none() {
                continue;
            }
            if answer == AgentAnswer::Ready {
                for key in &attached {
                    let entry = self.checkpoint.read(|c| c.get(key).cloned());
                    let uid = entry.as_ref().map(|e| e.pod.uid.clone());
                    let trigger = ReleaseTrigger::ReleaseMark;
                    self.release_bound_spares(entry.as_ref(), &key.container_id, &key.ifname, uid.as_deref(), trigger)
                        .await?;
                    self.checkpoint.remove(key).await?;
                }
            }
            self.metrics.handshake_answer(answer.label());
            tracing::info!(%ip, pod = %format!("{}/{}", record.pod.namespace, record.pod.name), answer = answer.label(), %detail, "answered a release mark");
            answered += 1;
        }
        Ok(answered)
    }

    /// The record's pod as the handshake needs it, from a live read (not the cache). A
    /// terminating pod counts as ending here, unlike in start-up GC: the controller marks
    /// its record only once `deletionTimestamp` (the end of the grace period, when the
    /// kubelet kills what still runs) has passed, and its attached sandbox still waits
    /// `sandbox_grace` for the DEL.
    async fn pod_on_node(&self, record: &Allocation) -> Result<PodOnNode, Error> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &record.pod.namespace);
        let pod = pods
            .get_opt(&record.pod.name)
            .await
            .map_err(Error::api(format!("reading pod {}/{}", record.pod.namespace, record.pod.name)))?;
        Ok(match pod.map(|p| crate::gc::index::PodFacts::of(&p)) {
            Some(facts) if facts.uid == record.pod.uid && !facts.terminal() => PodOnNode::Active,
            Some(facts) if facts.uid == record.pod.uid => PodOnNode::Ending,
            _ => PodOnNode::Gone,
        })
    }
}
