//! The runtime's word on the node's sandboxes (`--cri-socket`, module [`crate::cri`]): asked
//! every `--cri-poll-interval-seconds`, when the runtime's events report a sandbox's end, and
//! before each pass over release marks, CNI GC and the start-up GC. A sandbox the runtime still
//! has counts as listed (the release handshake waits for its DEL however long it takes); an
//! attachment whose sandbox the runtime no longer has is released by the agent itself, and a
//! mark on its IP is answered at once. Only the runtime the node's kubelet uses is asked (its
//! `Version` must match the Node's `containerRuntimeVersion`). When it cannot be asked,
//! nothing is concluded: the sandbox grace decides, as without `--cri-socket`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::reflector::ObjectRef;

use super::block_writes::ReleaseTrigger;
use super::checkpoint::{AttachmentKey, CheckpointEntry, Listing};
use super::core::Core;
use super::error::Error;
use crate::crd::PodRef;
use crate::cri::client::{CriClient, RuntimeVersion};
use crate::cri::sandboxes::{PodKnown, RuntimeSandboxes, SandboxVerdict};

/// The first wait before following the runtime's events again after the stream broke; it
/// doubles up to [`EVENTS_RETRY_MAX`].
const EVENTS_RETRY: Duration = Duration::from_secs(1);

/// The longest wait before following the runtime's events again.
const EVENTS_RETRY_MAX: Duration = Duration::from_secs(30);

/// How many pods' attachments one release of stale attachments (CNI GC, gone sandboxes)
/// releases at once.
const STALE_PODS_AT_ONCE: usize = 16;

/// The runtime's CRI endpoints and the agent's last word from the one it asks.
pub struct Runtime {
    /// The sockets that existed at start (`--cri-socket`), in order.
    candidates: Vec<CriClient>,
    /// The first candidate whose `Version` matched the Node's `containerRuntimeVersion`.
    chosen: Mutex<Option<(CriClient, RuntimeVersion)>>,
    /// How old an attachment of a pod that is not running must be before the runtime's not
    /// listing its sandbox counts ([`crate::cri::sandboxes::verdict`]).
    settle: Duration,
    /// The newest answer, `None` after a failed question: a stale answer concludes nothing.
    last: Mutex<Option<Arc<RuntimeSandboxes>>>,
    /// Whether the last question got an answer (the log says when it changes).
    reachable: AtomicBool,
}

impl Runtime {
    /// The runtime behind one of `candidates` (the sockets that exist, in the order given).
    pub fn new(candidates: Vec<CriClient>, settle: Duration) -> Self {
        Self { candidates, chosen: Mutex::new(None), settle, last: Mutex::new(None), reachable: AtomicBool::new(true) }
    }
}

/// When the agent follows the runtime's event stream again, and whether a new stream wakes
/// the sweep ([`Core::follow_runtime_events`]).
#[derive(Debug)]
struct Following {
    /// The next wait before following again.
    retry: Duration,
    /// Whether the last stream ended cleanly without an event: nothing was missed.
    last_was_empty: bool,
}

impl Default for Following {
    fn default() -> Self {
        Self { retry: EVENTS_RETRY, last_was_empty: false }
    }
}

impl Following {
    /// Whether following the stream again wakes the sweep: events may have been missed since
    /// the last stream, unless it ended at once and empty (a runtime that sends none).
    fn wakes_on_open(&self) -> bool {
        !self.last_was_empty
    }

    /// A stream ended after `lasted`: `carried`, it gave at least one event; `broke`, it ended
    /// with an error. The backoff starts over only after a stream that carried an event or
    /// lasted the longest wait. Returns whether this is the first of a run of empty streams.
    fn ended(&mut self, carried: bool, broke: bool, lasted: Duration) -> bool {
        let empty = !carried && !broke;
        let first_empty = empty && !self.last_was_empty;
        self.last_was_empty = empty;
        if carried || lasted >= EVENTS_RETRY_MAX {
            self.retry = EVENTS_RETRY;
        }
        first_empty
    }

    /// The stream could not be opened, after `waited` (containerd answers the open only with
    /// its first event, so a restart of a quiet runtime fails an open that waited for hours):
    /// events may be missed meanwhile, and a long wait starts the backoff over.
    fn failed(&mut self, waited: Duration) {
        self.last_was_empty = false;
        if waited >= EVENTS_RETRY_MAX {
            self.retry = EVENTS_RETRY;
        }
    }

    /// The wait before following again; the next one doubles, up to [`EVENTS_RETRY_MAX`].
    fn next_wait(&mut self) -> Duration {
        let wait = self.retry;
        self.retry = (self.retry * 2).min(EVENTS_RETRY_MAX);
        wait
    }
}

/// Why the runtime could not be asked.
enum NotAsked {
    /// Its calls failed.
    Failed(crate::cri::client::CriError),
    /// No candidate is the runtime the node's kubelet uses (or the Node does not say yet).
    NotTheNodes(String),
}

impl Core {
    /// The runtime the node's kubelet uses: the first candidate socket whose `Version` is the
    /// Node's `status.nodeInfo.containerRuntimeVersion`, found once and kept. A node with two
    /// runtimes (a system containerd beside k3s', CRI-O beside a containerd for builds) would
    /// otherwise have the agent ask one that has none of the node's sandboxes and release them all.
    async fn node_runtime(&self, runtime: &Runtime) -> Result<(CriClient, RuntimeVersion), NotAsked> {
        if let Some(chosen) = runtime.chosen.lock().ok().and_then(|c| c.clone()) {
            return Ok(chosen);
        }
        let node = self.node.get(&ObjectRef::<Node>::new(&self.settings.node));
        let reported = node
            .and_then(|n| n.status.as_ref()?.node_info.as_ref().map(|i| i.container_runtime_version.clone()))
            .filter(|v| !v.is_empty())
            .ok_or_else(|| NotAsked::NotTheNodes("the Node does not report its container runtime yet".to_string()))?;
        let mut tried = Vec::new();
        for candidate in &runtime.candidates {
            match candidate.version().await {
                Ok(version) if version.is_reported_as(&reported) => {
                    tracing::info!(socket = %candidate.socket().display(), runtime = %reported, "asking the node's runtime over CRI which sandboxes it has");
                    if let Ok(mut chosen) = runtime.chosen.lock() {
                        *chosen = Some((candidate.clone(), version.clone()));
                    }
                    return Ok((candidate.clone(), version));
                }
                Ok(version) => tried.push(format!("{} is {}", candidate.socket().display(), version.as_node_reports())),
                Err(e) => tried.push(e.to_string()),
            }
        }
        Err(NotAsked::NotTheNodes(format!("the Node's runtime is {reported}; {}", tried.join("; "))))
    }

    /// Asks the node's runtime about every sandbox of the checkpoint (`with_records`: and of
    /// this node's records, for the start-up GC), keeps the answer if no newer one is kept,
    /// and notes the sandboxes it has, or could not say it lacks, as listed (module
    /// `release_marks`). `None` without `--cri-socket` or an answer; a failure drops the kept
    /// answer, so nothing is concluded from a runtime that went silent.
    pub(super) async fn ask_runtime(&self, with_records: bool) -> Option<Arc<RuntimeSandboxes>> {
        let runtime = self.runtime.as_ref()?;
        let mut of_interest: BTreeSet<String> =
            self.checkpoint.read(|c| c.entries().map(|e| e.key.container_id.clone()).collect());
        if with_records {
            of_interest.extend(self.blocks.state().iter().flat_map(|b| {
                b.spec
                    .allocations
                    .values()
                    .filter(|r| r.node == self.settings.node && !r.container_id.is_empty())
                    .map(|r| r.container_id.clone())
                    .collect::<Vec<_>>()
            }));
        }
        let asked = match self.node_runtime(runtime).await {
            Ok((client, _)) => client.sandboxes(&of_interest).await.map_err(NotAsked::Failed),
            Err(e) => Err(e),
        };
        let answer = match asked {
            Ok(answer) => Arc::new(answer),
            Err(e) => {
                self.metrics.runtime_query("error");
                if let Ok(mut last) = runtime.last.lock() {
                    *last = None;
                }
                let why = match e {
                    NotAsked::Failed(e) => e.to_string(),
                    NotAsked::NotTheNodes(why) => format!("no socket of --cri-socket is the node's runtime: {why}"),
                };
                if runtime.reachable.swap(false, Ordering::Relaxed) {
                    tracing::warn!(error = %why, "the runtime cannot be asked which sandboxes it has; release marks wait out the sandbox grace until it answers");
                } else {
                    tracing::debug!(error = %why, "the runtime still cannot be asked which sandboxes it has");
                }
                return None;
            }
        };
        self.metrics.runtime_query("ok");
        if !runtime.reachable.swap(true, Ordering::Relaxed) {
            tracing::info!("the runtime answers which sandboxes it has");
        }
        // A sandbox whose status the runtime could not give counts as listed too (only an
        // answer that it lacks one may end a wait), but not as seen: a sandbox still being made
        // fails its status as easily as one that runs, and only a sandbox the runtime had can
        // be gone.
        let (live, unknown): (Vec<AttachmentKey>, Vec<AttachmentKey>) = self.checkpoint.read(|c| {
            c.entries()
                .filter(|e| answer.is_live(&e.key.container_id) || answer.is_unknown(&e.key.container_id))
                .map(|e| e.key.clone())
                .partition(|key| answer.is_live(&key.container_id))
        });
        // Noted when the answer came, not when it was asked: questions overlap, and an older
        // one may find a sandbox that a newer one missed (`RuntimeSandboxes::answered_at`).
        self.checkpoint.note_listed(&live, answer.answered_at, Listing::Returned);
        self.checkpoint.note_listed(&unknown, answer.answered_at, Listing::Undenied);
        self.runtime_gc_called();
        if let Ok(mut last) = runtime.last.lock()
            && last.as_ref().is_none_or(|kept| kept.requested_at <= answer.requested_at)
        {
            *last = Some(answer.clone());
        }
        Some(answer)
    }

    /// What the node's pod cache says of `pod`; [`PodKnown::Ended`] when its UID is
    /// `ended_uid`, the pod a live read showed gone or finished.
    fn pod_known(&self, pod: &PodRef, ended_uid: Option<&str>) -> PodKnown {
        if ended_uid == Some(pod.uid.as_str()) {
            return PodKnown::Ended;
        }
        let cached = self.pods.get(&ObjectRef::new(&pod.name).within(&pod.namespace));
        let facts = cached.map(|p| crate::gc::index::PodFacts::of(&p));
        match facts {
            Some(facts) if facts.uid == pod.uid && !facts.finished() => PodKnown::Running,
            _ => PodKnown::NotRunning,
        }
    }

    /// The verdict of `answer` (the kept one when `None`) on the attachment `key`; its pod
    /// counts as ended when its UID is `ended_uid` (a live read showed that pod gone or
    /// finished). [`SandboxVerdict::Unsure`] without an answer or an entry.
    pub(super) fn runtime_verdict(
        &self,
        key: &AttachmentKey,
        ended_uid: Option<&str>,
        answer: Option<&RuntimeSandboxes>,
    ) -> SandboxVerdict {
        let Some(runtime) = &self.runtime else { return SandboxVerdict::Unsure };
        let Some((recorded_at, seen_at, pod)) = self
            .checkpoint
            .read(|c| c.get(key).and_then(|e| Some((c.recorded_at(key)?, c.seen_at(key), e.pod.clone()))))
        else {
            return SandboxVerdict::Unsure;
        };
        let known = self.pod_known(&pod, ended_uid);
        let kept = match answer {
            Some(_) => None,
            None => runtime.last.lock().ok().and_then(|l| l.clone()),
        };
        match answer.or(kept.as_deref()) {
            Some(answer) => answer.verdict(&key.container_id, recorded_at, seen_at, known, runtime.settle),
            None => SandboxVerdict::Unsure,
        }
    }

    /// Follows the node runtime's container events (`GetContainerEvents`) and wakes `sweep`
    /// (the loop sending [`super::allocator::SweepRuntime`]) when one reports the end of a
    /// sandbox the checkpoint holds, and each time it follows the stream again unless the last
    /// one ended at once without an event, since events may have been missed: the sandbox's
    /// release then waits for no poll. A runtime that streams no events (`Unimplemented`), or hands each event
    /// to one follower only (containerd 1.x, whose events kubelet's evented PLEG would lose),
    /// leaves the poll alone, said once. A broken stream is followed again after a backoff
    /// (1 s doubling to 30 s), which starts over only after a stream that carried an event or
    /// lasted (or waited to open) the longest wait: a runtime that ends each stream at once
    /// without an event (CRI-O with `enable_pod_events = false`) has its stream tried again
    /// ever more rarely, up to every 30 s, and no question is asked for it.
    pub async fn follow_runtime_events(self: Arc<Self>, sweep: Arc<tokio::sync::Notify>) {
        let Some(runtime) = &self.runtime else { return };
        let mut following = Following::default();
        loop {
            let opened = std::time::Instant::now();
            let followed = match self.node_runtime(runtime).await {
                Ok((_, version)) if version.events_exclusive() => {
                    tracing::info!(runtime = %version.as_node_reports(), "the runtime hands each container event to one follower, so the agent leaves them to kubelet and asks on its timer only");
                    return;
                }
                Ok((client, _)) => {
                    // Asked now, not once the stream is open: containerd answers the open only
                    // with its first event, which may be hours away on a quiet node.
                    if following.wakes_on_open() {
                        sweep.notify_one();
                    }
                    client.ended_sandboxes().await
                }
                Err(NotAsked::Failed(e)) => Err(e),
                Err(NotAsked::NotTheNodes(why)) => {
                    tracing::debug!(%why, "not following the runtime's events yet");
                    tokio::time::sleep(following.next_wait()).await;
                    continue;
                }
            };
            match followed {
                Ok(ended) => {
                    let (mut carried, mut broke) = (false, false);
                    let mut ended = std::pin::pin!(ended);
                    while let Some(event) = ended.next().await {
                        carried |= event.is_ok();
                        match event {
                            Ok(Some(id)) if self.checkpoint.read(|c| c.entries().any(|e| e.key.container_id == id)) => {
                                tracing::debug!(container_id = %id, "the runtime reports the end of a sandbox of the checkpoint");
                                sweep.notify_one();
                            }
                            Ok(_) => {}
                            Err(e) => {
                                tracing::debug!(error = %e, "the runtime's event stream broke; following it again");
                                broke = true;
                                break;
                            }
                        }
                    }
                    if following.ended(carried, broke, opened.elapsed()) {
                        tracing::info!(
                            "the runtime ended its event stream without an event (CRI-O with enable_pod_events = false does); the agent asks it on its timer and tries its events again with a backoff up to 30 s"
                        );
                    }
                }
                Err(e) if crate::cri::client::unimplemented(&e) => {
                    tracing::info!(error = %e, "the runtime streams no container events; the agent asks it on its timer only");
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "following the runtime's events failed; trying again");
                    following.failed(opened.elapsed());
                }
            }
            tokio::time::sleep(following.next_wait()).await;
        }
    }

    /// The checkpoint's attachments whose sandbox the runtime, asked now, no longer has (by
    /// that answer and the pod cache: a running pod's sandbox the runtime never listed is still
    /// being made). Asked without the node to itself: only [`Core::release_gone`] needs it.
    pub async fn gone_from_runtime(&self) -> Vec<AttachmentKey> {
        let Some(answer) = self.ask_runtime(false).await else { return Vec::new() };
        let keys: Vec<AttachmentKey> = self.checkpoint.read(|c| c.entries().map(|e| e.key.clone()).collect());
        keys.into_iter().filter(|k| self.runtime_verdict(k, None, Some(&answer)) == SandboxVerdict::Gone).collect()
    }

    /// Releases the attachments of `gone` ([`Core::gone_from_runtime`]) that are still in the
    /// checkpoint and still gone by the runtime's newest answer (an attachment recorded again
    /// since is not), as their DELs would have. Runs with the node to itself (module `serial`).
    pub async fn release_gone(&self, gone: Vec<AttachmentKey>) -> Result<(), Error> {
        // Decided before the checkpoint is read: a verdict reads it too (its lock is not reentrant).
        let still_gone: Vec<&AttachmentKey> =
            gone.iter().filter(|k| self.runtime_verdict(k, None, None) == SandboxVerdict::Gone).collect();
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{EVENTS_RETRY, EVENTS_RETRY_MAX, Following};

    #[test]
    fn a_runtime_that_ends_every_stream_at_once_without_an_event_is_followed_again_ever_more_rarely() {
        let mut following = Following::default();
        assert!(following.wakes_on_open(), "the first stream may follow missed events");
        let mut waits = Vec::new();
        for round in 0..8 {
            let first_empty = following.ended(false, false, Duration::ZERO);
            assert_eq!(first_empty, round == 0, "said once, at the first empty stream");
            assert!(!following.wakes_on_open(), "an empty stream missed nothing: no extra question");
            waits.push(following.next_wait().as_secs());
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
    }

    #[test]
    fn a_stream_that_carried_events_or_lasted_starts_the_backoff_over_and_the_next_stream_wakes_the_sweep() {
        let cases = [
            // (carried, broke, lasted, backoff starts over, the next stream wakes the sweep)
            (true, true, Duration::ZERO, true, true),
            (true, false, Duration::ZERO, true, true),
            (false, true, Duration::ZERO, false, true),
            (false, true, EVENTS_RETRY_MAX, true, true),
            (false, false, EVENTS_RETRY_MAX, true, false),
        ];
        for (carried, broke, lasted, starts_over, wakes) in cases {
            let mut following = Following::default();
            for _ in 0..4 {
                following.next_wait();
            }
            following.ended(carried, broke, lasted);
            assert_eq!(following.next_wait() == EVENTS_RETRY, starts_over, "{carried} {broke} {lasted:?}");
            assert_eq!(following.wakes_on_open(), wakes, "{carried} {broke} {lasted:?}");
        }
        let mut following = Following::default();
        following.ended(false, false, Duration::ZERO);
        following.failed(Duration::ZERO);
        assert!(following.wakes_on_open(), "events may be missed while the stream cannot be opened");
        following.next_wait();
        following.failed(Duration::ZERO);
        assert_eq!(following.next_wait(), EVENTS_RETRY * 2, "a failure at once backs off further");
        following.failed(EVENTS_RETRY_MAX);
        assert_eq!(following.next_wait(), EVENTS_RETRY, "an open that waited the longest wait starts over");
    }
}
