//! The runtime's word on the node's sandboxes (`--cri-socket`, module [`crate::cri`]): asked
//! every `--cri-poll-interval-seconds` and before each pass over release marks, CNI GC and
//! the start-up GC. A sandbox the runtime still has counts as listed (the release handshake
//! waits for its DEL however long it takes); an attachment whose sandbox the runtime no
//! longer has is released by the agent itself, and a mark on its IP is answered at once.
//! When the runtime cannot be asked, nothing is concluded: the sandbox grace decides, as
//! without `--cri-socket`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;

use super::block_writes::ReleaseTrigger;
use super::checkpoint::{AttachmentKey, CheckpointEntry};
use super::core::Core;
use super::error::Error;
use crate::cri::client::CriClient;
use crate::cri::sandboxes::{Known, RuntimeSandboxes, SandboxVerdict};

/// The first wait before following the runtime's events again after the stream broke; it
/// doubles up to [`EVENTS_RETRY_MAX`].
const EVENTS_RETRY: Duration = Duration::from_secs(1);

/// The longest wait before following the runtime's events again.
const EVENTS_RETRY_MAX: Duration = Duration::from_secs(30);

/// How many pods' attachments one release of stale attachments (CNI GC, gone sandboxes)
/// releases at once.
const STALE_PODS_AT_ONCE: usize = 16;

/// The runtime's CRI endpoint and the agent's last word from it.
pub struct Runtime {
    client: CriClient,
    /// How old an attachment must be before the runtime's not listing its sandbox counts
    /// ([`crate::cri::sandboxes::verdict`]).
    settle: Duration,
    last: Mutex<Option<RuntimeSandboxes>>,
    /// Whether the last question got an answer (the log says when it changes).
    reachable: AtomicBool,
}

impl Runtime {
    /// The runtime behind `client`.
    pub fn new(client: CriClient, settle: Duration) -> Self {
        Self { client, settle, last: Mutex::new(None), reachable: AtomicBool::new(true) }
    }
}

impl Core {
    /// Asks the runtime about every sandbox the checkpoint or this node's records name, keeps
    /// the answer, and notes the sandboxes it still has as listed (module `release_marks`).
    /// Returns whether it answered; without `--cri-socket`, false.
    pub(super) async fn ask_runtime(&self) -> bool {
        let Some(runtime) = &self.runtime else { return false };
        let mut of_interest: BTreeSet<String> =
            self.checkpoint.read(|c| c.entries().map(|e| e.key.container_id.clone()).collect());
        of_interest.extend(self.blocks.state().iter().flat_map(|b| {
            b.spec
                .allocations
                .values()
                .filter(|r| r.node == self.settings.node && !r.container_id.is_empty())
                .map(|r| r.container_id.clone())
                .collect::<Vec<_>>()
        }));
        let answer = match runtime.client.sandboxes(&of_interest).await {
            Ok(answer) => answer,
            Err(e) => {
                self.metrics.runtime_query("error");
                if runtime.reachable.swap(false, Ordering::Relaxed) {
                    tracing::warn!(error = %e, socket = %runtime.client.socket().display(), "the runtime cannot be asked which sandboxes it has; release marks wait out the sandbox grace until it answers again");
                } else {
                    tracing::debug!(error = %e, "the runtime still cannot be asked which sandboxes it has");
                }
                return false;
            }
        };
        self.metrics.runtime_query("ok");
        if !runtime.reachable.swap(true, Ordering::Relaxed) {
            tracing::info!(socket = %runtime.client.socket().display(), "the runtime answers again which sandboxes it has");
        }
        let live: Vec<AttachmentKey> = self
            .checkpoint
            .read(|c| c.entries().filter(|e| answer.is_live(&e.key.container_id)).map(|e| e.key.clone()).collect());
        self.checkpoint.note_listed(&live, answer.requested_at);
        self.runtime_gc_called();
        if let Ok(mut last) = runtime.last.lock() {
            *last = Some(answer);
        }
        true
    }

    /// The verdict of the runtime's last answer on the attachment `key` (`pod_ended`: a live
    /// read shows its pod gone or finished); [`SandboxVerdict::Unsure`] without one. An
    /// attachment the runtime listed before (over CRI or CNI GC) is no ADD under way.
    pub(super) fn runtime_verdict(&self, key: &AttachmentKey, pod_ended: bool) -> SandboxVerdict {
        let Some(runtime) = &self.runtime else { return SandboxVerdict::Unsure };
        let Some((recorded_at, listed)) =
            self.checkpoint.read(|c| c.recorded_at(key).map(|at| (at, c.listed_at(key).is_some())))
        else {
            return SandboxVerdict::Unsure;
        };
        let last = runtime.last.lock().ok();
        last.as_ref().and_then(|l| l.as_ref()).map_or(SandboxVerdict::Unsure, |answer| {
            let known = Known { pod_ended, seen_by_runtime: listed };
            answer.verdict(&key.container_id, recorded_at, known, runtime.settle)
        })
    }

    /// Whether the runtime's last answer shows sandbox `container_id` live, whatever its age.
    pub(super) fn runtime_has(&self, container_id: &str) -> bool {
        let Some(runtime) = &self.runtime else { return false };
        let last = runtime.last.lock().ok();
        last.as_ref().and_then(|l| l.as_ref()).is_some_and(|answer| answer.is_live(container_id))
    }

    /// Follows the runtime's container events (`GetContainerEvents`) and wakes `sweep` (the
    /// loop sending [`super::allocator::SweepRuntime`]) when one reports the end of a sandbox
    /// the checkpoint holds, and on each (re)connection, since events may have been missed:
    /// the sandbox's release then waits for no poll. A runtime that streams no events
    /// (`Unimplemented`) leaves the poll alone, said once; a broken stream is followed again
    /// after a backoff.
    pub async fn follow_runtime_events(self: std::sync::Arc<Self>, sweep: std::sync::Arc<tokio::sync::Notify>) {
        let Some(runtime) = &self.runtime else { return };
        let mut retry = EVENTS_RETRY;
        loop {
            match runtime.client.ended_sandboxes().await {
                Ok(ended) => {
                    retry = EVENTS_RETRY;
                    sweep.notify_one();
                    let mut ended = std::pin::pin!(ended);
                    while let Some(event) = ended.next().await {
                        match event {
                            Ok(id) if self.checkpoint.read(|c| c.entries().any(|e| e.key.container_id == id)) => {
                                tracing::debug!(container_id = %id, "the runtime reports the end of a sandbox of the checkpoint");
                                sweep.notify_one();
                            }
                            Ok(_) => {}
                            Err(e) => {
                                tracing::debug!(error = %e, "the runtime's event stream broke; following it again");
                                break;
                            }
                        }
                    }
                }
                Err(e) if crate::cri::client::unimplemented(&e) => {
                    tracing::info!(error = %e, "the runtime streams no container events; the agent asks it on its timer only");
                    return;
                }
                Err(e) => tracing::debug!(error = %e, "following the runtime's events failed; trying again"),
            }
            tokio::time::sleep(retry).await;
            retry = (retry * 2).min(EVENTS_RETRY_MAX);
        }
    }

    /// The checkpoint's attachments whose sandbox the runtime, asked now, no longer has.
    /// Asked without the node to itself: only [`Core::release_gone`] needs it.
    pub async fn gone_from_runtime(&self) -> Vec<AttachmentKey> {
        if !self.ask_runtime().await {
            return Vec::new();
        }
        let keys: Vec<AttachmentKey> = self.checkpoint.read(|c| c.entries().map(|e| e.key.clone()).collect());
        keys.into_iter().filter(|k| self.runtime_verdict(k, false) == SandboxVerdict::Gone).collect()
    }

    /// Releases the attachments of `gone` ([`Core::gone_from_runtime`]) that are still in the
    /// checkpoint and still gone by the runtime's last answer (an attachment recorded again
    /// since is not), as their DELs would have. Runs with the node to itself (module `serial`).
    pub async fn release_gone(&self, gone: Vec<AttachmentKey>) -> Result<(), Error> {
        // Decided before the checkpoint is read: a verdict reads it too (its lock is not reentrant).
        let still_gone: Vec<&AttachmentKey> =
            gone.iter().filter(|k| self.runtime_verdict(k, false) == SandboxVerdict::Gone).collect();
        let entries: Vec<CheckpointEntry> =
            self.checkpoint.read(|c| still_gone.iter().filter_map(|k| c.get(k).cloned()).collect());
        for entry in &entries {
            tracing::info!(container_id = %entry.key.container_id, pod = %format!("{}/{}", entry.pod.namespace, entry.pod.name), "the runtime no longer has the sandbox; releasing its attachment");
        }
        self.release_stale(entries, ReleaseTrigger::RuntimeGone).await
    }

    /// Releases stale attachments (CNI GC, gone sandboxes): one pod's one after the other, as
    /// its DELs would be; different pods' at once, so their block writes share
    /// compare-and-swaps (module `batch`) and hundreds after a runtime crash hold the node for a
    /// few writes per block, not one per attachment. Returns the first failure; every one is
    /// logged.
    pub(super) async fn release_stale(
        &self,
        stale: Vec<CheckpointEntry>,
        trigger: ReleaseTrigger,
    ) -> Result<(), Error> {
        let mut by_pod: BTreeMap<(String, String), Vec<CheckpointEntry>> = BTreeMap::new();
        for entry in stale {
            by_pod.entry((entry.pod.namespace.clone(), entry.pod.name.clone())).or_default().push(entry);
        }
        let released: Vec<Result<(), Error>> = futures::stream::iter(by_pod.into_values())
            .map(|entries| async move {
                for entry in entries {
                    self.detach(&entry.key, Some(&entry), Some(&entry.pod.uid), trigger).await?;
                }
                Ok(())
            })
            .buffer_unordered(STALE_PODS_AT_ONCE)
            .collect()
            .await;
        let mut errors = released.into_iter().filter_map(Result::err);
        let Some(first) = errors.next() else { return Ok(()) };
        for e in errors {
            tracing::warn!(error = %e, trigger = trigger.label(), "releasing a stale attachment failed; the next pass retries");
        }
        Err(first)
    }
}
