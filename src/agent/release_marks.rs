//! Answering the controller's release marks on this node's records
//! ([`crate::gc::handshake`]). The live reads of the records' pods happen first, without the
//! node gate; only the local decision (which checkpoint entries hold the IP), the writes (one
//! compare-and-swap per block, every mark of the block in it) and the checkpoint edits run with
//! the node to itself, so hundreds of marks after a runtime crash stall the node's ADDs for a
//! block write or two, not for a pod read and a write per mark (issue 26).

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use ipnet::IpNet;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::Api;

use super::block_writes::ReleaseTrigger;
use super::checkpoint::AttachmentKey;
use super::core::Core;
use super::error::Error;
use crate::crd::Allocation;
use crate::cri::sandboxes::SandboxVerdict;
use crate::gc::handshake::{
    AgentAnswer, MarkAnswer, PodOnNode, SandboxOnNode, agent_answer, claimant_refusal, write_answers,
};
use crate::gc::index::PodFacts;

/// How many pods of marked records are read at once.
const POD_READS_AT_ONCE: usize = 16;

/// A release mark on this node's record, with its pod as read live before the node gate.
/// A pod's life only moves on (running, ending, gone), so by the time the answer is written
/// the pod is at least this far along: an answer decided from this read never releases the
/// IP of a pod that runs.
pub struct Marked {
    block: String,
    pool: String,
    cidr: IpNet,
    ip: String,
    record: Allocation,
    pod: PodOnNode,
    /// For a takeover mark whose claimant, read live, is not a live pod of the record's
    /// workload on the node that asked: why (the answer is then `do-not-release`).
    claimant_refused: Option<String>,
}

impl Marked {
    /// When the record was marked, as read from the cache.
    fn marked_at(&self) -> Timestamp {
        self.record.release_handshake.as_ref().map_or(Timestamp::UNIX_EPOCH, |h| h.marked_at.0)
    }
}

/// The answer decided for a [`Marked`] record with the node to itself.
struct Decided {
    answer: AgentAnswer,
    detail: String,
    /// The checkpoint entries holding the IP (dropped with a `ready-for-release`).
    attached: Vec<AttachmentKey>,
}

impl Core {
    /// The marks on this node's records, from the cache, each with its pod read live
    /// ([`POD_READS_AT_ONCE`] at a time), and only those that have an answer to write by the
    /// checkpoint as it is now: a pass with nothing to write never takes the node gate. A
    /// pod whose read failed leaves its mark for the next pass.
    pub async fn marks_to_answer(&self) -> Vec<Marked> {
        // The runtime's word first: a sandbox it no longer has lets a mark be answered now.
        self.ask_runtime(false).await;
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
        let read: Vec<Result<Marked, Error>> = futures::stream::iter(marked)
            .map(|(block, pool, cidr, ip, record)| async move {
                let pod = self.pod_on_node(&record).await?;
                let claimant_refused = self.claimant_refused(&record).await?;
                Ok(Marked { block, pool, cidr, ip, record, pod, claimant_refused })
            })
            .buffered(POD_READS_AT_ONCE)
            .collect()
            .await;
        let (mut due, mut failed, mut first_error) = (Vec::new(), 0usize, None);
        for marked in read {
            match marked {
                Ok(marked) if self.decide(&marked).answer.state().is_some() => due.push(marked),
                Ok(_) => {}
                Err(e) => {
                    failed += 1;
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_error {
            tracing::warn!(failed, error = %e, "reading the pods of marked records failed; their marks wait for the next pass");
        }
        due
    }

    /// The answer to `marked` by its pod (read before) and the checkpoint as it is now.
    fn decide(&self, marked: &Marked) -> Decided {
        // Only the marked record's pod is known ended: another pod's entry holding the IP (an
        // ADD under way) is judged by the pod cache.
        let ended_uid = (marked.pod != PodOnNode::Active).then_some(marked.record.pod.uid.as_str());
        let (attached, listed_ago) = self.checkpoint.read(|checkpoint| {
            let attached: Vec<AttachmentKey> = checkpoint
                .entries()
                .filter(|e| e.ips.iter().any(|i| i.ip == marked.ip))
                .map(|e| e.key.clone())
                .collect();
            let listed = attached.iter().filter_map(|k| checkpoint.listed_at(k)).max();
            (attached, listed.map(|at| at.elapsed()))
        });
        // Until the runtime's first CNI GC since the agent started, the runtime has not
        // said which sandboxes it still has: count them as listed at the start.
        let listed_ago = listed_ago.or_else(|| self.runtime_gc_pending().then(|| self.started.elapsed()));
        let marked_at = marked.marked_at();
        let marked_for = Duration::try_from(Timestamp::now().duration_since(marked_at)).unwrap_or(Duration::ZERO);
        let grace = self.settings.sandbox_grace;
        let gone = !attached.is_empty()
            && attached.iter().all(|key| self.runtime_verdict(key, ended_uid, None) == SandboxVerdict::Gone);
        let sandbox = match gone {
            true => SandboxOnNode::GoneFromRuntime,
            false => SandboxOnNode::of(!attached.is_empty(), listed_ago, grace),
        };
        if let Some(refused) = &marked.claimant_refused {
            return Decided { answer: AgentAnswer::DoNotRelease, detail: refused.clone(), attached };
        }
        let answer = agent_answer(marked.pod, sandbox, marked_for, grace);
        let detail = match (answer, sandbox) {
            (AgentAnswer::DoNotRelease, _) => "the pod is running on this node".to_string(),
            (_, SandboxOnNode::Detached) => "no sandbox on this node holds the IP".to_string(),
            (_, SandboxOnNode::GoneFromRuntime) => "the runtime no longer has its sandbox".to_string(),
            (_, _) => format!("its sandbox got no DEL within {} s of the mark; counted as lost", grace.as_secs()),
        };
        Decided { answer, detail, attached }
    }

    /// Answers `marks` ([`Core::marks_to_answer`]). Runs with the node to itself (module
    /// `serial`), so no ADD, DEL or GC interleaves: each answer is decided again from the
    /// checkpoint as it is now, the answers of one block are written in one compare-and-swap,
    /// and after `ready-for-release` the IP is in no checkpoint entry, so only a new record
    /// (which clears the mark) could hand it out again. Returns how many marks were answered;
    /// marks that must wait are left for the next pass.
    pub async fn answer_marks(&self, marks: Vec<Marked>) -> Result<usize, Error> {
        let mut by_block: BTreeMap<(String, String, IpNet), Vec<(Marked, Decided)>> = BTreeMap::new();
        for marked in marks {
            let decided = self.decide(&marked);
            if decided.answer.state().is_some() {
                by_block
                    .entry((marked.block.clone(), marked.pool.clone(), marked.cidr))
                    .or_default()
                    .push((marked, decided));
            }
        }
        let (mut answered, mut first_error) = (0, None);
        for ((block, pool, cidr), marks) in by_block {
            let answers: Vec<MarkAnswer> = marks
                .iter()
                .filter_map(|(marked, decided)| {
                    Some(MarkAnswer {
                        ip: marked.ip.clone(),
                        uid: marked.record.pod.uid.clone(),
                        marked_at: marked.marked_at(),
                        state: decided.answer.state()?,
                        detail: decided.detail.clone(),
                    })
                })
                .collect();
            let written = self
                .write_block(&block, &pool, cidr, |spec| {
                    let written = write_answers(&mut spec.allocations, &answers);
                    (!written.is_empty()).then_some(written)
                })
                .await?
                .unwrap_or_default();
            // Every answer written is followed up, whatever fails for another: the controller
            // releases their records now, so a checkpoint entry left here would stay for good.
            for (marked, decided) in marks.iter().filter(|(m, _)| written.contains(&m.ip)) {
                match self.answered(marked, decided).await {
                    Ok(()) => answered += 1,
                    Err(e) => {
                        tracing::warn!(ip = %marked.ip, error = %e, "dropping the checkpoint entries of an IP answered ready-for-release failed");
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        first_error.map_or(Ok(answered), Err)
    }

    /// What follows a written answer: after `ready-for-release`, the checkpoint entries holding
    /// the IP go (with the spares bound to them whose records are not written yet); the
    /// metric and the log line.
    async fn answered(&self, marked: &Marked, decided: &Decided) -> Result<(), Error> {
        if decided.answer == AgentAnswer::Ready {
            for key in &decided.attached {
                let entry = self.checkpoint.read(|c| c.get(key).cloned());
                let uid = entry.as_ref().map(|e| e.pod.uid.clone());
                let trigger = ReleaseTrigger::ReleaseMark;
                self.release_bound_spares(entry.as_ref(), &key.container_id, &key.ifname, uid.as_deref(), trigger)
                    .await?;
                self.checkpoint.remove(key).await?;
            }
        }
        self.metrics.handshake_answer(decided.answer.label());
        let pod = format!("{}/{}", marked.record.pod.namespace, marked.record.pod.name);
        tracing::info!(ip = %marked.ip, %pod, answer = decided.answer.label(), detail = %decided.detail, "answered a release mark");
        Ok(())
    }

    /// For a takeover mark on `record`: why its claimant may not have the record, from a live
    /// read of the pod the mark names ([`claimant_refusal`]); `None` for a mark of the
    /// controller, or a claimant that is who the mark says.
    async fn claimant_refused(&self, record: &Allocation) -> Result<Option<String>, Error> {
        let Some(takeover) = record.release_handshake.as_ref().and_then(|h| h.takeover.as_ref()) else {
            return Ok(None);
        };
        let claimant = self.read_pod(&takeover.pod.namespace, &takeover.pod.name, "the takeover's claimant").await?;
        Ok(claimant_refusal(record, takeover, claimant.as_ref()))
    }

    /// Pod `namespace`/`name` as the handshake needs it, read live (not from the cache);
    /// `what` names it in the error.
    async fn read_pod(&self, namespace: &str, name: &str, what: &str) -> Result<Option<PodFacts>, Error> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let pod = pods.get_opt(name).await.map_err(Error::api(format!("reading {what} {namespace}/{name}")))?;
        Ok(pod.map(|p| PodFacts::of(&p)))
    }

    /// The record's pod as the handshake needs it, from a live read (not the cache). A
    /// terminating pod counts as ending here, unlike in start-up GC: the controller marks
    /// its record only once `deletionTimestamp` (the end of the grace period, when the
    /// kubelet kills what still runs) has passed, and its attached sandbox still waits
    /// `sandbox_grace` for the DEL.
    async fn pod_on_node(&self, record: &Allocation) -> Result<PodOnNode, Error> {
        Ok(match self.read_pod(&record.pod.namespace, &record.pod.name, "pod").await? {
            Some(facts) if facts.uid == record.pod.uid && !facts.terminal() => PodOnNode::Active,
            Some(facts) if facts.uid == record.pod.uid => PodOnNode::Ending,
            _ => PodOnNode::Gone,
        })
    }
}
