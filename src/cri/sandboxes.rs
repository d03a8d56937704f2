//! What the container runtime says of the node's sandboxes, and what the agent concludes
//! from it for an attachment in its checkpoint (docs/agent.md, "Sandbox truth from the
//! runtime"). Pure: the CRI calls are in [`super::client`].

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// One sandbox as the runtime answered for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeSandbox {
    /// Listed `SANDBOX_READY`: its pause process runs and its network is up.
    Ready,
    /// Listed `SANDBOX_NOTREADY`. `network_closed`: the runtime says its network namespace is
    /// closed (containerd's verbose status, `netNamespaceClosed`), which it does only after the
    /// network's teardown; a runtime that does not say counts as open.
    NotReady {
        /// Whether the sandbox's network namespace is gone.
        network_closed: bool,
    },
    /// Not listed, and `PodSandboxStatus` answered `NotFound`: the runtime has no such sandbox.
    Absent,
    /// Not listed, and its status could not be read (an error other than `NotFound`).
    Unknown,
}

/// The runtime's answers for the sandboxes the agent asked about, and when it asked.
#[derive(Clone, Debug)]
pub struct RuntimeSandboxes {
    /// When the listing was requested: an attachment recorded later may be missing from it
    /// only because it is newer.
    pub requested_at: Instant,
    /// When the last answer came (the listing's, or the last status call's): what this answer
    /// returned, the runtime had at some time before then, which is the time it is noted at
    /// (questions overlap, so an older question's status call may find a sandbox a newer
    /// question's missed).
    pub answered_at: Instant,
    /// By sandbox ID (the CNI container ID).
    pub sandboxes: BTreeMap<String, RuntimeSandbox>,
}

/// What the agent concludes of one attachment from the runtime's word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SandboxVerdict {
    /// The runtime still has the sandbox and its network: never released for lack of a DEL,
    /// whatever else says so; its DEL (or the runtime's teardown) frees it.
    Live,
    /// The runtime no longer has the sandbox's network: its DEL is lost, and its IPs are free.
    Gone,
    /// The runtime's word does not settle it; the release handshake's sandbox grace does.
    Unsure,
}

impl RuntimeSandboxes {
    /// Whether the runtime has sandbox `id` with its network up, whatever else is known: its
    /// verdict is [`SandboxVerdict::Live`].
    pub fn is_live(&self, id: &str) -> bool {
        matches!(
            self.sandboxes.get(id),
            Some(RuntimeSandbox::Ready | RuntimeSandbox::NotReady { network_closed: false })
        )
    }

    /// Whether the runtime could not say whether it has sandbox `id` (its status call failed).
    pub fn is_unknown(&self, id: &str) -> bool {
        self.sandboxes.get(id) == Some(&RuntimeSandbox::Unknown)
    }

    /// The verdict on the attachment of sandbox `id` recorded at `recorded_at`, whose pod is
    /// `pod`; `seen_at`: when the newest answer (over CRI or CNI GC) came that returned the
    /// sandbox, never one that only failed to deny it.
    pub fn verdict(
        &self,
        id: &str,
        recorded_at: Instant,
        seen_at: Option<Instant>,
        pod: PodKnown,
        settle: Duration,
    ) -> SandboxVerdict {
        let Some(&sandbox) = self.sandboxes.get(id) else { return SandboxVerdict::Unsure };
        let age = self.requested_at.checked_duration_since(recorded_at);
        // Seen by an answer that came before this one was asked for: an answer that came
        // later may have seen a sandbox this answer's listing missed because it came just after.
        let seen = seen_at.is_some_and(|at| at < self.requested_at);
        verdict(sandbox, age, seen, pod, settle)
    }
}

/// What the agent knows of an attachment's pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodKnown {
    /// A live read (a release mark's) shows it gone or no longer active (terminating, which
    /// includes a pod still inside its grace period, or finished): it counts as not running
    /// whatever the cache still says, and proves nothing of its sandbox, which the kubelet
    /// may still be starting.
    Ended,
    /// The node's pod cache shows it, under the attachment's UID, not finished.
    Running,
    /// The cache does not show it running: gone, finished, or not seen yet.
    NotRunning,
}

/// The verdict on an attachment whose sandbox the runtime answered `sandbox` for, `age` after
/// the attachment was recorded (`None`: recorded after the runtime was asked); `seen`: an
/// answer to an earlier question returned the sandbox.
///
/// containerd adds a sandbox to the store its listing reads only after the CNI ADD returned
/// and the sandbox was created and started (which may pull the pause image; other plugins of a
/// Multus chain run in between too), so a sandbox that is not listed may be one still being
/// made. Such an absence counts when the runtime had the sandbox before (sandbox IDs never
/// come back), or once the attachment is older than `settle` and its pod is not running. A
/// pod known ended changes nothing before that: a sandbox the kubelet is still starting for a
/// deleted pod holds its IP until the kubelet tears it down, and the IP released early could
/// go at once to a StatefulSet pod's successor on another node. The IP of a running pod whose
/// sandbox the runtime never had is left to the release handshake.
pub fn verdict(
    sandbox: RuntimeSandbox,
    age: Option<Duration>,
    seen: bool,
    pod: PodKnown,
    settle: Duration,
) -> SandboxVerdict {
    let absence_counts = age.is_some_and(|age| seen || (pod != PodKnown::Running && age >= settle));
    match sandbox {
        RuntimeSandbox::Ready | RuntimeSandbox::NotReady { network_closed: false } => SandboxVerdict::Live,
        RuntimeSandbox::NotReady { network_closed: true } if age.is_some() => SandboxVerdict::Gone,
        RuntimeSandbox::Absent if absence_counts => SandboxVerdict::Gone,
        RuntimeSandbox::NotReady { network_closed: true } | RuntimeSandbox::Absent | RuntimeSandbox::Unknown => {
            SandboxVerdict::Unsure
        }
    }
}

/// The verdict of `verbose_info`, the `info` map of a verbose `PodSandboxStatus`, on whether the
/// sandbox's network namespace is closed: containerd puts a JSON object under `info` with a
/// boolean `netNamespaceClosed`. Anything else (another runtime, no such key, bad JSON) is
/// `false`, which keeps a NOTREADY sandbox live.
pub fn network_closed(verbose_info: &std::collections::HashMap<String, String>) -> bool {
    verbose_info
        .get("info")
        .and_then(|info| serde_json::from_str::<serde_json::Value>(info).ok())
        .and_then(|info| info.get("netNamespaceClosed").and_then(serde_json::Value::as_bool))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    const SETTLE: Duration = Duration::from_secs(60);

    #[test]
    fn the_verdict_table() {
        use PodKnown::{Ended, NotRunning, Running};
        let old = Some(Duration::from_secs(61));
        let young = Some(Duration::from_secs(5));
        let closed = RuntimeSandbox::NotReady { network_closed: true };
        let open = RuntimeSandbox::NotReady { network_closed: false };
        let absent = RuntimeSandbox::Absent;
        let cases = [
            // (runtime's answer, age, listed before, pod, verdict)
            (RuntimeSandbox::Ready, old, false, Ended, SandboxVerdict::Live),
            (RuntimeSandbox::Ready, None, false, NotRunning, SandboxVerdict::Live),
            (open, old, true, Ended, SandboxVerdict::Live),
            (closed, young, false, Running, SandboxVerdict::Gone),
            (closed, None, true, Ended, SandboxVerdict::Unsure),
            (absent, old, false, NotRunning, SandboxVerdict::Gone),
            (absent, Some(SETTLE), false, NotRunning, SandboxVerdict::Gone),
            (absent, young, false, NotRunning, SandboxVerdict::Unsure),
            // A running pod whose sandbox was never listed: still being made, however long.
            (absent, old, false, Running, SandboxVerdict::Unsure),
            (absent, young, true, Running, SandboxVerdict::Gone),
            // A pod known ended whose sandbox was never returned: it may still be being made.
            (absent, young, false, Ended, SandboxVerdict::Unsure),
            (absent, young, true, Ended, SandboxVerdict::Gone),
            (absent, old, false, Ended, SandboxVerdict::Gone),
            (absent, None, true, Ended, SandboxVerdict::Unsure),
            (RuntimeSandbox::Unknown, old, true, Ended, SandboxVerdict::Unsure),
        ];
        for (sandbox, age, seen, pod, expected) in cases {
            assert_eq!(verdict(sandbox, age, seen, pod, SETTLE), expected, "{sandbox:?} {age:?} seen={seen} {pod:?}");
        }
    }

    #[test]
    fn an_attachment_the_runtime_was_not_asked_about_is_unsure() {
        let now = Instant::now();
        let listing = RuntimeSandboxes { requested_at: now, answered_at: now, sandboxes: BTreeMap::new() };
        assert_eq!(listing.verdict("abc", now, None, PodKnown::Ended, SETTLE), SandboxVerdict::Unsure);
    }

    #[test]
    fn an_attachment_recorded_after_the_listing_was_asked_for_is_never_gone() {
        let asked = Instant::now();
        let recorded = asked + Duration::from_millis(1);
        let listing = absent_a(asked);
        assert_eq!(listing.verdict("a", recorded, None, PodKnown::Ended, Duration::ZERO), SandboxVerdict::Unsure);
        assert_eq!(listing.verdict("a", asked, None, PodKnown::Ended, Duration::ZERO), SandboxVerdict::Gone);
    }

    #[test]
    fn only_a_sighting_older_than_the_answer_makes_an_absence_count() {
        // The sandbox entered the runtime's store just after this answer's listing, and a later
        // question listed it: this answer's absence is no proof that it is gone.
        let recorded = Instant::now();
        let asked = recorded + Duration::from_secs(1);
        let listing = absent_a(asked);
        let later = Some(asked + Duration::from_millis(1));
        let earlier = Some(asked - Duration::from_millis(1));
        assert_eq!(listing.verdict("a", recorded, later, PodKnown::Running, SETTLE), SandboxVerdict::Unsure);
        assert_eq!(listing.verdict("a", recorded, Some(asked), PodKnown::Running, SETTLE), SandboxVerdict::Unsure);
        assert_eq!(listing.verdict("a", recorded, earlier, PodKnown::Running, SETTLE), SandboxVerdict::Gone);
    }

    /// An answer to a question asked at `asked` that did not find sandbox `a`.
    fn absent_a(asked: Instant) -> RuntimeSandboxes {
        let sandboxes = BTreeMap::from([("a".into(), RuntimeSandbox::Absent)]);
        RuntimeSandboxes { requested_at: asked, answered_at: asked, sandboxes }
    }

    #[test]
    fn a_sandbox_an_older_question_found_after_a_newer_one_missed_it_is_not_gone_by_the_newer_answer() {
        // Questions overlap: A is asked, then B; B's status call misses the sandbox still being
        // made, which then enters the store, and A's status call, queued behind others, finds
        // it. A's sighting is noted when A was answered, which is after B was asked.
        let recorded = Instant::now();
        let a_asked = recorded + Duration::from_secs(1);
        let b = absent_a(a_asked + Duration::from_millis(10));
        let a_answered = b.requested_at + Duration::from_millis(10);
        assert_eq!(b.verdict("a", recorded, Some(a_answered), PodKnown::Running, SETTLE), SandboxVerdict::Unsure);
        assert_eq!(
            b.verdict("a", recorded, Some(a_asked), PodKnown::Running, SETTLE),
            SandboxVerdict::Gone,
            "noted when A was asked, the sighting would prove B's absence"
        );
    }

    #[test]
    fn network_closed_reads_containerds_verbose_info_and_nothing_else() {
        let info = |text: &str| HashMap::from([("info".to_string(), text.to_string())]);
        assert!(network_closed(&info(r#"{"pid":0,"netNamespaceClosed":true}"#)));
        assert!(!network_closed(&info(r#"{"netNamespaceClosed":false}"#)));
        assert!(!network_closed(&info(r#"{"pid":12}"#)));
        assert!(!network_closed(&info("not json")));
        assert!(!network_closed(&info(r#"{"netNamespaceClosed":"yes"}"#)));
        assert!(!network_closed(&HashMap::new()));
    }
}
