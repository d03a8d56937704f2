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

    /// The verdict on the attachment of sandbox `id` recorded at `recorded_at`. `known`: what
    /// else is known of it ([`Known`]).
    pub fn verdict(&self, id: &str, recorded_at: Instant, known: Known, settle: Duration) -> SandboxVerdict {
        let Some(&sandbox) = self.sandboxes.get(id) else { return SandboxVerdict::Unsure };
        let age = self.requested_at.checked_duration_since(recorded_at);
        verdict(sandbox, age, known, settle)
    }
}

/// What the agent knows of an attachment besides the runtime's answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Known {
    /// A live read shows the attachment's pod gone or finished (a release mark's answer).
    pub pod_ended: bool,
    /// The runtime has listed the sandbox since the attachment was recorded (over CRI, or in
    /// a CNI GC's valid attachments): it exists, so it is no ADD still under way.
    pub seen_by_runtime: bool,
}

/// The verdict on an attachment whose sandbox the runtime answered `sandbox` for, `age` after
/// the attachment was recorded (`None`: recorded after the runtime was asked).
///
/// containerd adds a sandbox to the store its listing reads only after the sandbox's network
/// is set up (CNI ADD) and its pause container started, so a sandbox that is not listed may be
/// one whose ADD has just returned. Such an absence counts once the runtime has listed the
/// sandbox before (sandbox IDs never come back), once the attachment is older than `settle`,
/// or when its pod ended (the pod of a release mark: a sandbox still starting for it is torn
/// down by the kubelet, and a released IP waits out the reuse cooldown).
pub fn verdict(sandbox: RuntimeSandbox, age: Option<Duration>, known: Known, settle: Duration) -> SandboxVerdict {
    let absence_counts = age.is_some_and(|age| age >= settle || known.pod_ended || known.seen_by_runtime);
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
        let old = Some(Duration::from_secs(61));
        let young = Some(Duration::from_secs(5));
        let closed = RuntimeSandbox::NotReady { network_closed: true };
        let open = RuntimeSandbox::NotReady { network_closed: false };
        let nothing = Known::default();
        let ended = Known { pod_ended: true, ..Known::default() };
        let seen = Known { seen_by_runtime: true, ..Known::default() };
        let cases = [
            // (runtime's answer, age, what else is known, verdict)
            (RuntimeSandbox::Ready, old, ended, SandboxVerdict::Live),
            (RuntimeSandbox::Ready, None, ended, SandboxVerdict::Live),
            (open, old, ended, SandboxVerdict::Live),
            (closed, young, nothing, SandboxVerdict::Gone),
            (closed, None, ended, SandboxVerdict::Unsure),
            (RuntimeSandbox::Absent, old, nothing, SandboxVerdict::Gone),
            (RuntimeSandbox::Absent, Some(SETTLE), nothing, SandboxVerdict::Gone),
            (RuntimeSandbox::Absent, young, nothing, SandboxVerdict::Unsure),
            (RuntimeSandbox::Absent, young, ended, SandboxVerdict::Gone),
            (RuntimeSandbox::Absent, young, seen, SandboxVerdict::Gone),
            (RuntimeSandbox::Absent, None, ended, SandboxVerdict::Unsure),
            (RuntimeSandbox::Absent, None, seen, SandboxVerdict::Unsure),
            (RuntimeSandbox::Unknown, old, ended, SandboxVerdict::Unsure),
        ];
        for (sandbox, age, known, expected) in cases {
            assert_eq!(verdict(sandbox, age, known, SETTLE), expected, "{sandbox:?} {age:?} {known:?}");
        }
    }

    #[test]
    fn an_attachment_the_runtime_was_not_asked_about_is_unsure() {
        let now = Instant::now();
        let listing = RuntimeSandboxes { requested_at: now, sandboxes: BTreeMap::new() };
        let ended = Known { pod_ended: true, ..Known::default() };
        assert_eq!(listing.verdict("abc", now, ended, SETTLE), SandboxVerdict::Unsure);
    }

    #[test]
    fn an_attachment_recorded_after_the_listing_was_asked_for_is_never_gone() {
        let asked = Instant::now();
        let recorded = asked + Duration::from_millis(1);
        let listing =
            RuntimeSandboxes { requested_at: asked, sandboxes: BTreeMap::from([("a".into(), RuntimeSandbox::Absent)]) };
        let ended = Known { pod_ended: true, ..Known::default() };
        assert_eq!(listing.verdict("a", recorded, ended, Duration::ZERO), SandboxVerdict::Unsure);
        assert_eq!(listing.verdict("a", asked, ended, Duration::ZERO), SandboxVerdict::Gone);
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
