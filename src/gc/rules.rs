//! The GC rule table (docs/gc-rules.md): what to do with one allocation record given its
//! pod, its claim, its owner and its node. Pure: every input is a plain view, every output a
//! [`Verdict`]; the actors only gather the views and carry the verdicts out.

use std::time::Duration;

use jiff::Timestamp;

/// A pod's lifecycle phase as the rules need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Pending or Running (or Unknown): may hold its IP.
    Active,
    /// Succeeded or Failed: its containers are done.
    Completed,
}

/// One allocation record.
#[derive(Clone, Debug)]
pub struct RecordView<'a> {
    /// The IP.
    pub ip: &'a str,
    /// The UID the record names.
    pub pod_uid: &'a str,
    /// The node the record names.
    pub node: &'a str,
    /// Whether the record is a sticky (StatefulSet / KubeVirt) one.
    pub sticky: bool,
    /// Whether its pod has an IPClaim to go with it ([`crate::ipam::workload::has_claim`]):
    /// a stateless pod has none, so its release reads and deletes no claim.
    pub has_claim: bool,
}

/// The pod a record names, looked up by namespace and name.
#[derive(Clone, Debug)]
pub struct PodView<'a> {
    /// Its UID.
    pub uid: &'a str,
    /// Its phase.
    pub phase: Phase,
    /// `deletionTimestamp`, when it is terminating (it already includes the grace period).
    pub deletion: Option<Timestamp>,
    /// Its `status.podIPs`.
    pub ips: &'a [String],
}

/// The pod that reports the record's IP right now, from the index of live pods' IPs.
#[derive(Clone, Debug)]
pub struct IpHolder<'a> {
    /// Its UID.
    pub uid: &'a str,
    /// Whether it is terminating or completed (then it no longer protects the IP).
    pub terminal: bool,
}

/// The record's node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeState {
    /// Ready (or the record names no node).
    Ready,
    /// NotReady or Unknown since this instant.
    NotReady(Timestamp),
    /// The Node object is gone.
    Deleted,
}

/// What to do on nodes that are NotReady.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotReadyPolicy {
    /// Keep IPs of pods on NotReady nodes until the node comes back or is deleted
    /// (conservative: a partitioned node may still run the pod).
    Keep,
    /// Release them once the node has been NotReady this long.
    ReleaseAfter(Duration),
}

/// Settings of the rules.
#[derive(Clone, Copy, Debug)]
pub struct RuleSettings {
    /// Delay added to `deletionTimestamp` before a terminating pod's IP is released.
    pub additional_delay: Duration,
    /// The NotReady policy.
    pub not_ready: NotReadyPolicy,
}

/// Everything the rules know about one record.
#[derive(Clone, Debug)]
pub struct Facts<'a> {
    /// The record.
    pub record: RecordView<'a>,
    /// Its pod by namespace/name, if it exists.
    pub pod: Option<PodView<'a>>,
    /// The UID its IPClaim names, if there is a claim.
    pub claim_uid: Option<&'a str>,
    /// Whether the sticky owner still wants the ordinal / VM (false for non-sticky records).
    pub owner_wants: bool,
    /// Whether the record is held for the workload whose `ipwarden.io/ip-list` it was drawn
    /// from (`heldFor`), and that workload still lives (false for other records).
    pub list_held: bool,
    /// Its node.
    pub node: NodeState,
    /// The live pod reporting its IP, if any.
    pub holder: Option<IpHolder<'a>>,
    /// Now.
    pub now: Timestamp,
}

/// Why a record is kept (a skip, in metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepReason {
    /// A live pod with the record's UID reports the IP, or is Pending/Running.
    InUse,
    /// Running but `status.podIPs` is still empty: status lags the CNI result.
    StatusLags,
    /// A sticky reservation whose owner still wants it.
    StickyReservation,
    /// An IP of a workload's `ipwarden.io/ip-list`, held for the workload while it lives.
    ListReservation,
    /// A sticky pod was recreated and has not reported IPs yet: ADD will adopt the IP.
    StickyRestarting,
    /// The pod's node is NotReady and the policy keeps its IPs.
    NodeNotReady,
    /// The pod is still running on a deleted node; pod GC will remove it first.
    PodOnDeletedNode,
}

/// Why a record is released (the `reason` label of the release metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseReason {
    /// No pod of that name exists.
    PodGone,
    /// The pod terminated and its deadline passed.
    TerminatingPastDeadline,
    /// The pod Succeeded or Failed.
    Completed,
    /// A stateless pod of the same name now has another UID.
    UidMismatch,
    /// A sticky pod was re-added without ipwarden (its claim names another UID).
    StickyReaddedWithoutIpwarden,
    /// A sticky pod was re-added with other IPs: this record is stale.
    StickyStaleRecord,
    /// The node was deleted.
    NodeDeleted,
    /// The node has been NotReady longer than the policy allows.
    NodeNotReady,
}

/// What to do with one record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict<'a> {
    /// Leave it.
    Keep(KeepReason),
    /// Look again at this instant (a terminating pod before its deadline).
    TraceUntil(Timestamp),
    /// Release it (conditionally on its UID); `delete_claim` when the record's pod has a
    /// claim and it names that UID.
    Release {
        /// The rule row.
        reason: ReleaseReason,
        /// Whether the claim goes too.
        delete_claim: bool,
    },
    /// A live pod with another UID reports the IP: the record is adopted by that UID,
    /// never released.
    Repair {
        /// The UID to write into the record.
        uid: &'a str,
    },
}

impl KeepReason {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::InUse => "in_use",
            Self::StatusLags => "status_lags",
            Self::StickyReservation => "sticky_reservation",
            Self::ListReservation => "list_reservation",
            Self::StickyRestarting => "sticky_restarting",
            Self::NodeNotReady => "node_not_ready",
            Self::PodOnDeletedNode => "pod_on_deleted_node",
        }
    }
}

impl ReleaseReason {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::PodGone => "pod_gone",
            Self::TerminatingPastDeadline => "terminating_past_deadline",
            Self::Completed => "completed",
            Self::UidMismatch => "uid_mismatch",
            Self::StickyReaddedWithoutIpwarden => "sticky_readded_without_ipwarden",
            Self::StickyStaleRecord => "sticky_stale_record",
            Self::NodeDeleted => "node_deleted",
            Self::NodeNotReady => "node_not_ready",
        }
    }
}

impl ReleaseReason {
    /// Whether a release for this reason, of a sticky record, rests on its owner no longer
    /// wanting it: then the pool actor re-reads the owner right before writing (a fast scale
    /// down and up can leave the decision's cache stale). The rows of a sticky pod re-added
    /// with other IPs release whatever the owner wants; a release on a NotReady node may
    /// have come from any row, so it counts as resting on the owner (keeping is the safe side).
    pub fn rests_on_owner(self) -> bool {
        !matches!(self, Self::UidMismatch | Self::StickyReaddedWithoutIpwarden | Self::StickyStaleRecord)
    }
}

fn release(reason: ReleaseReason, facts: &Facts<'_>) -> Verdict<'static> {
    // A claim an older version wrote for a stateless pod is the claim janitor's.
    let delete_claim = facts.record.has_claim && facts.claim_uid == Some(facts.record.pod_uid);
    Verdict::Release { reason, delete_claim }
}

/// The verdict for one record. Rows are checked in the order of docs/gc-rules.md; the first
/// guard (a live pod reports the IP) comes before all of them, so an IP in use is never
/// released whatever the other facts say. A release of a record on a NotReady node waits
/// for the NotReady policy whatever the row: the node's agent cannot answer the release
/// handshake, and a partitioned node may still run the sandbox.
pub fn decide<'a>(facts: &Facts<'a>, settings: &RuleSettings) -> Verdict<'a> {
    let verdict = decide_row(facts, settings);
    let (Verdict::Release { .. }, NodeState::NotReady(since)) = (verdict, facts.node) else { return verdict };
    match not_ready_gate(since, settings.not_ready, facts.now) {
        NotReadyGate::Closed => Verdict::Keep(KeepReason::NodeNotReady),
        NotReadyGate::OpensAt(due) => Verdict::TraceUntil(due),
        NotReadyGate::Open => release(ReleaseReason::NodeNotReady, facts),
    }
}

/// Whether the NotReady policy lets go of what a NotReady node holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotReadyGate {
    /// Never, while the node stays NotReady (policy `keep`).
    Closed,
    /// Not before this instant.
    OpensAt(Timestamp),
    /// Now.
    Open,
}

/// The NotReady policy for a node NotReady since `since`, at `now`. Every release on a
/// NotReady node, and every answer given for its agent, goes through this one gate.
pub fn not_ready_gate(since: Timestamp, policy: NotReadyPolicy, now: Timestamp) -> NotReadyGate {
    match policy {
        NotReadyPolicy::Keep => NotReadyGate::Closed,
        NotReadyPolicy::ReleaseAfter(after) => {
            let due = since.saturating_add(after).unwrap_or(Timestamp::MAX);
            if now >= due { NotReadyGate::Open } else { NotReadyGate::OpensAt(due) }
        }
    }
}

fn decide_row<'a>(facts: &Facts<'a>, settings: &RuleSettings) -> Verdict<'a> {
    let record = &facts.record;
    // Invariant 2: a non-terminal pod reporting the IP protects it; another UID is adopted.
    if let Some(holder) = facts.holder.as_ref().filter(|h| !h.terminal) {
        return if holder.uid == record.pod_uid {
            Verdict::Keep(KeepReason::InUse)
        } else {
            Verdict::Repair { uid: holder.uid }
        };
    }
    // What keeps the record once its pod is done: its sticky owner's ordinal or VM, else
    // the workload of the list it was drawn from.
    let reservation = if record.sticky && facts.owner_wants {
        Some(KeepReason::StickyReservation)
    } else {
        facts.list_held.then_some(KeepReason::ListReservation)
    };
    let Some(pod) = facts.pod.as_ref() else {
        // Pod absent (after a confirming read by the pool actor).
        if let Some(reason) = reservation {
            return Verdict::Keep(reason);
        }
        let reason = if facts.node == NodeState::Deleted { ReleaseReason::NodeDeleted } else { ReleaseReason::PodGone };
        return release(reason, facts);
    };
    if pod.uid == record.pod_uid {
        if pod.phase == Phase::Completed {
            return match reservation {
                Some(reason) => Verdict::Keep(reason),
                None => release(ReleaseReason::Completed, facts),
            };
        }
        let Some(deleted_at) = pod.deletion else {
            return match facts.node {
                NodeState::Deleted => Verdict::Keep(KeepReason::PodOnDeletedNode),
                _ if pod.ips.is_empty() => Verdict::Keep(KeepReason::StatusLags),
                _ => Verdict::Keep(KeepReason::InUse),
            };
        };
        // deletionTimestamp already includes the grace period (Spiderpool added it twice).
        let deadline = deleted_at.saturating_add(settings.additional_delay).unwrap_or(Timestamp::MAX);
        if facts.now < deadline && facts.node != NodeState::Deleted {
            return Verdict::TraceUntil(deadline);
        }
        if let Some(reason) = reservation {
            return Verdict::Keep(reason);
        }
        let reason = match facts.node {
            NodeState::Deleted => ReleaseReason::NodeDeleted,
            _ => ReleaseReason::TerminatingPastDeadline,
        };
        return release(reason, facts);
    }
    // A pod of the same name with another UID.
    if record.sticky && pod.ips.is_empty() {
        // Spiderpool #3778: the recreated pod is restarting; its ADD will adopt the IP.
        return Verdict::Keep(KeepReason::StickyRestarting);
    }
    if facts.list_held {
        // The workload's pods, whatever their names, take the IP back from its list.
        return Verdict::Keep(KeepReason::ListReservation);
    }
    if record.sticky {
        if facts.claim_uid != Some(pod.uid) {
            return Verdict::Release { reason: ReleaseReason::StickyReaddedWithoutIpwarden, delete_claim: true };
        }
        // The IP is not among the pod's IPs (the holder guard handled that case).
        return Verdict::Release { reason: ReleaseReason::StickyStaleRecord, delete_claim: false };
    }
    release(ReleaseReason::UidMismatch, facts)
}

/// The last word before a release is written, on a live read of the record's pod (by
/// namespace and name): `Some(reason)` stops the release. Caches lag both ways: a recreated
/// pod may have taken the record while the cache still shows its predecessor, or a new pod's
/// status may not yet list the IP; the live read settles it. `live` is the pod's UID, whether
/// it is terminal, and its `status.podIPs`.
pub fn recheck_release(record_uid: &str, ip: &str, live: Option<(&str, bool, &[String])>) -> Option<&'static str> {
    match live {
        None => None,
        Some((uid, terminal, _)) if uid == record_uid => (!terminal).then_some("pod_exists"),
        Some((_, terminal, ips)) => (!terminal && ips.iter().any(|i| i == ip)).then_some("in_use"),
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn only_releases_that_rest_on_an_unwanted_owner_re_read_it() {
        use ReleaseReason::*;
        let table = [
            (PodGone, true),
            (TerminatingPastDeadline, true),
            (Completed, true),
            (NodeDeleted, true),
            (NodeNotReady, true),
            (UidMismatch, false),
            (StickyReaddedWithoutIpwarden, false),
            (StickyStaleRecord, false),
        ];
        for (reason, rests) in table {
            assert_eq!(reason.rests_on_owner(), rests, "{reason:?}");
        }
    }

    #[test]
    fn a_release_is_stopped_by_a_live_pod_that_owns_or_reports_the_record() {
        let ip = "10.0.0.5";
        let reports = vec![ip.to_string()];
        let none: Vec<String> = Vec::new();
        assert_eq!(recheck_release("u1", ip, None), None, "pod gone: release");
        assert_eq!(recheck_release("u1", ip, Some(("u1", false, &none))), Some("pod_exists"), "the cache was stale");
        assert_eq!(recheck_release("u1", ip, Some(("u1", true, &reports))), None, "its own pod is finished");
        assert_eq!(
            recheck_release("u1", ip, Some(("u2", false, &reports))),
            Some("in_use"),
            "another live pod reports it"
        );
        assert_eq!(recheck_release("u1", ip, Some(("u2", false, &none))), None, "a replacement with other IPs");
        assert_eq!(recheck_release("u1", ip, Some(("u2", true, &reports))), None, "a finished replacement");
    }

    const NOW: i64 = 1_000_000;

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).expect("timestamp")
    }

    fn settings() -> RuleSettings {
        RuleSettings { additional_delay: Duration::from_secs(5), not_ready: NotReadyPolicy::Keep }
    }

    fn facts<'a>(sticky: bool, pod: Option<PodView<'a>>) -> Facts<'a> {
        Facts {
            record: RecordView { ip: "10.0.0.5", pod_uid: "old", node: "n1", sticky, has_claim: sticky },
            pod,
            claim_uid: Some("old"),
            owner_wants: sticky,
            list_held: false,
            node: NodeState::Ready,
            holder: None,
            now: at(NOW),
        }
    }

    const IPS: &[String] = &[];

    fn pod<'a>(uid: &'a str, phase: Phase, deletion: Option<Timestamp>, ips: &'a [String]) -> PodView<'a> {
        PodView { uid, phase, deletion, ips }
    }

    fn ips(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    fn released(reason: ReleaseReason, delete_claim: bool) -> Verdict<'static> {
        Verdict::Release { reason, delete_claim }
    }

    #[test]
    fn pod_absent_and_sticky_owner_still_wants_it_keeps_the_reservation() {
        assert_eq!(decide(&facts(true, None), &settings()), Verdict::Keep(KeepReason::StickyReservation));
    }

    #[test]
    fn pod_absent_otherwise_releases_and_deletes_a_sticky_pods_claim_naming_its_uid() {
        assert_eq!(decide(&facts(false, None), &settings()), released(ReleaseReason::PodGone, false));
        let mut unwanted = facts(true, None);
        unwanted.owner_wants = false;
        assert_eq!(decide(&unwanted, &settings()), released(ReleaseReason::PodGone, true));
        let mut other_claim = facts(false, None);
        other_claim.claim_uid = Some("newer");
        assert_eq!(decide(&other_claim, &settings()), released(ReleaseReason::PodGone, false));
    }

    #[test]
    fn a_release_deletes_the_claim_only_of_a_record_whose_pod_has_one() {
        // A claim an older version left for a stateless pod is the janitor's, not the release's.
        let legacy = facts(false, None);
        assert_eq!(legacy.claim_uid, Some(legacy.record.pod_uid));
        assert_eq!(decide(&legacy, &settings()), released(ReleaseReason::PodGone, false));
        // A sticky pod's record in a retired block is released as an ordinary one, claim and all.
        let mut retired = facts(false, None);
        retired.record.has_claim = true;
        assert_eq!(decide(&retired, &settings()), released(ReleaseReason::PodGone, true));
    }

    #[test]
    fn same_uid_pending_or_running_keeps() {
        let running = ips(&["10.0.0.5"]);
        assert_eq!(
            decide(&facts(false, Some(pod("old", Phase::Active, None, &running))), &settings()),
            Verdict::Keep(KeepReason::InUse)
        );
    }

    #[test]
    fn same_uid_running_with_empty_pod_ips_keeps_because_status_lags_cni() {
        // Spiderpool #4888, Antrea #8239: podIPs appear after the CNI result.
        assert_eq!(
            decide(&facts(false, Some(pod("old", Phase::Active, None, IPS))), &settings()),
            Verdict::Keep(KeepReason::StatusLags)
        );
    }

    #[test]
    fn same_uid_terminating_before_its_deadline_is_traced_until_deletion_timestamp_plus_delay_only() {
        let deletion = at(NOW - 2);
        let verdict = decide(&facts(false, Some(pod("old", Phase::Active, Some(deletion), IPS))), &settings());
        assert_eq!(verdict, Verdict::TraceUntil(at(NOW + 3)), "deadline = deletionTimestamp + 5 s, not + grace again");
    }

    #[test]
    fn same_uid_terminating_past_its_deadline_releases_unless_sticky_and_wanted() {
        let deletion = Some(at(NOW - 10));
        let gone = decide(&facts(false, Some(pod("old", Phase::Active, deletion, IPS))), &settings());
        assert_eq!(gone, released(ReleaseReason::TerminatingPastDeadline, false));
        let sticky = decide(&facts(true, Some(pod("old", Phase::Active, deletion, IPS))), &settings());
        assert_eq!(sticky, Verdict::Keep(KeepReason::StickyReservation));
    }

    #[test]
    fn same_uid_terminating_on_a_not_ready_node_follows_the_policy() {
        let deletion = Some(at(NOW - 10));
        let mut on_not_ready = facts(false, Some(pod("old", Phase::Active, deletion, IPS)));
        on_not_ready.node = NodeState::NotReady(at(NOW - 60));
        assert_eq!(
            decide(&on_not_ready, &settings()),
            Verdict::Keep(KeepReason::NodeNotReady),
            "conservative default keeps"
        );
        let after =
            |secs| RuleSettings { not_ready: NotReadyPolicy::ReleaseAfter(Duration::from_secs(secs)), ..settings() };
        assert_eq!(decide(&on_not_ready, &after(30)), released(ReleaseReason::NodeNotReady, false));
        assert_eq!(decide(&on_not_ready, &after(120)), Verdict::TraceUntil(at(NOW + 60)));
    }

    #[test]
    fn every_release_on_a_not_ready_node_waits_for_the_policy() {
        let mut gone = facts(false, None);
        gone.node = NodeState::NotReady(at(NOW - 60));
        assert_eq!(decide(&gone, &settings()), Verdict::Keep(KeepReason::NodeNotReady), "its sandbox may still run");
        let after =
            |secs| RuleSettings { not_ready: NotReadyPolicy::ReleaseAfter(Duration::from_secs(secs)), ..settings() };
        assert_eq!(decide(&gone, &after(30)), released(ReleaseReason::NodeNotReady, false));
        assert_eq!(decide(&gone, &after(90)), Verdict::TraceUntil(at(NOW + 30)));
    }

    #[test]
    fn same_uid_completed_releases_unless_sticky_and_wanted() {
        let done = ips(&["10.0.0.5"]);
        assert_eq!(
            decide(&facts(false, Some(pod("old", Phase::Completed, None, &done))), &settings()),
            released(ReleaseReason::Completed, false)
        );
        assert_eq!(
            decide(&facts(true, Some(pod("old", Phase::Completed, None, &done))), &settings()),
            Verdict::Keep(KeepReason::StickyReservation)
        );
    }

    #[test]
    fn other_uid_sticky_with_empty_pod_ips_keeps_while_the_pod_restarts() {
        // Spiderpool #3778: releasing here gave the IP to another pod while ADD re-adopted it.
        assert_eq!(
            decide(&facts(true, Some(pod("new", Phase::Active, None, IPS))), &settings()),
            Verdict::Keep(KeepReason::StickyRestarting)
        );
    }

    #[test]
    fn other_uid_sticky_readded_without_ipwarden_releases_and_deletes_the_claim() {
        let other = ips(&["192.168.9.9"]);
        assert_eq!(
            decide(&facts(true, Some(pod("new", Phase::Active, None, &other))), &settings()),
            released(ReleaseReason::StickyReaddedWithoutIpwarden, true)
        );
    }

    #[test]
    fn other_uid_sticky_with_its_claim_but_other_ips_releases_only_the_stale_record() {
        let other = ips(&["10.0.0.9"]);
        let mut claimed = facts(true, Some(pod("new", Phase::Active, None, &other)));
        claimed.claim_uid = Some("new");
        assert_eq!(decide(&claimed, &settings()), released(ReleaseReason::StickyStaleRecord, false));
    }

    #[test]
    fn an_ip_a_live_pod_reports_is_repaired_to_that_pod_never_released() {
        // Whereabouts: matching by name alone freed the new IP of a recreated pod.
        let mut adopted = facts(false, Some(pod("new", Phase::Active, None, IPS)));
        adopted.holder = Some(IpHolder { uid: "new", terminal: false });
        assert_eq!(decide(&adopted, &settings()), Verdict::Repair { uid: "new" });
        let mut own = facts(false, None);
        own.holder = Some(IpHolder { uid: "old", terminal: false });
        assert_eq!(decide(&own, &settings()), Verdict::Keep(KeepReason::InUse));
    }

    #[test]
    fn other_uid_stateless_releases() {
        let other = ips(&["10.0.0.9"]);
        assert_eq!(
            decide(&facts(false, Some(pod("new", Phase::Active, None, &other))), &settings()),
            released(ReleaseReason::UidMismatch, false)
        );
    }

    #[test]
    fn node_deleted_releases_absent_or_terminating_pods_unless_sticky_and_wanted() {
        let mut absent = facts(false, None);
        absent.node = NodeState::Deleted;
        assert_eq!(decide(&absent, &settings()), released(ReleaseReason::NodeDeleted, false));
        let mut terminating = facts(false, Some(pod("old", Phase::Active, Some(at(NOW)), IPS)));
        terminating.node = NodeState::Deleted;
        assert_eq!(
            decide(&terminating, &settings()),
            released(ReleaseReason::NodeDeleted, false),
            "no waiting for a deadline"
        );
        let mut sticky = facts(true, None);
        sticky.node = NodeState::Deleted;
        assert_eq!(decide(&sticky, &settings()), Verdict::Keep(KeepReason::StickyReservation));
        let mut running = facts(false, Some(pod("old", Phase::Active, None, IPS)));
        running.node = NodeState::Deleted;
        assert_eq!(decide(&running, &settings()), Verdict::Keep(KeepReason::PodOnDeletedNode));
    }

    #[test]
    fn a_list_bound_record_is_kept_for_its_living_workload_in_every_row_that_ends_its_pod() {
        let done = ips(&["10.0.0.5"]);
        let other = ips(&["10.0.0.9"]);
        let held = |pod: Option<PodView<'static>>| Facts { list_held: true, ..facts(false, pod) };
        let kept = Verdict::Keep(KeepReason::ListReservation);
        let deletion = Some(at(NOW - 10));
        let cases = [
            ("pod absent", held(None)),
            ("completed", held(Some(pod("old", Phase::Completed, None, Box::leak(done.into_boxed_slice()))))),
            ("terminating past its deadline", held(Some(pod("old", Phase::Active, deletion, IPS)))),
            (
                "a pod of the same name with another UID",
                held(Some(pod("new", Phase::Active, None, Box::leak(other.into_boxed_slice())))),
            ),
        ];
        for (row, case) in cases {
            assert_eq!(decide(&case, &settings()), kept, "{row}");
            let gone = Facts { list_held: false, ..case.clone() };
            assert!(
                matches!(decide(&gone, &settings()), Verdict::Release { .. }),
                "{row}: released once the workload is gone"
            );
        }
    }

    fn arb_uid() -> impl Strategy<Value = &'static str> {
        prop_oneof![Just("a"), Just("b"), Just("c")]
    }

    prop_compose! {
        fn arb_case()(
            record_uid in arb_uid(), sticky in any::<bool>(), owner_wants in any::<bool>(), list_held in any::<bool>(),
            pod in proptest::option::of((arb_uid(), any::<bool>(), proptest::option::of(-100i64..100), any::<bool>())),
            claim in proptest::option::of(arb_uid()),
            node in 0u8..3, holder in proptest::option::of((arb_uid(), any::<bool>())),
            policy in proptest::option::of(0u64..200),
        ) -> (Facts<'static>, RuleSettings, Vec<String>) {
            let pod_ips = if pod.is_some_and(|p| p.3) { vec!["10.0.0.5".to_string()] } else { Vec::new() };
            let ips: &'static [String] = Box::leak(pod_ips.clone().into_boxed_slice());
            let facts = Facts {
                record: RecordView { ip: "10.0.0.5", pod_uid: record_uid, node: "n1", sticky, has_claim: sticky },
                pod: pod.map(|(uid, completed, deletion, _)| PodView {
                    uid,
                    phase: if completed { Phase::Completed } else { Phase::Active },
                    deletion: deletion.map(|d| at(NOW + d)),
                    ips,
                }),
                claim_uid: claim,
                owner_wants,
                list_held,
                node: match node { 0 => NodeState::Ready, 1 => NodeState::NotReady(at(NOW - 50)), _ => NodeState::Deleted },
                holder: holder.map(|(uid, terminal)| IpHolder { uid, terminal }),
                now: at(NOW),
            };
            let settings = RuleSettings {
                additional_delay: Duration::from_secs(5),
                not_ready: policy.map_or(NotReadyPolicy::Keep, |s| NotReadyPolicy::ReleaseAfter(Duration::from_secs(s))),
            };
            (facts, settings, pod_ips)
        }
    }

    proptest! {
        #[test]
        fn no_verdict_releases_an_ip_a_non_terminal_pod_reports((facts, settings, _ips) in arb_case()) {
            let verdict = decide(&facts, &settings);
            if facts.holder.as_ref().is_some_and(|h| !h.terminal) {
                prop_assert!(!matches!(verdict, Verdict::Release { .. }), "{verdict:?} for {facts:?}");
            }
        }

        #[test]
        fn no_verdict_releases_the_record_of_a_live_non_terminal_pod((facts, settings, _ips) in arb_case()) {
            let verdict = decide(&facts, &settings);
            let live_owner = facts.pod.as_ref().is_some_and(|p| {
                p.uid == facts.record.pod_uid && p.phase == Phase::Active && p.deletion.is_none()
            });
            if live_owner {
                prop_assert!(matches!(verdict, Verdict::Keep(_) | Verdict::Repair { .. }), "{verdict:?} for {facts:?}");
            }
        }

        #[test]
        fn a_not_ready_node_releases_only_by_its_policy((facts, settings, _ips) in arb_case()) {
            let verdict = decide(&facts, &settings);
            if let (Verdict::Release { reason, .. }, NodeState::NotReady(since)) = (verdict, facts.node) {
                prop_assert_eq!(reason, ReleaseReason::NodeNotReady);
                let NotReadyPolicy::ReleaseAfter(after) = settings.not_ready else {
                    return Err(TestCaseError::fail("released under the keep policy"));
                };
                prop_assert!(facts.now >= since.saturating_add(after).unwrap_or(Timestamp::MAX));
            }
        }

        #[test]
        fn no_verdict_releases_a_sticky_reservation_its_owner_still_wants((facts, settings, _ips) in arb_case()) {
            let verdict = decide(&facts, &settings);
            let same_pod_or_absent = facts.pod.as_ref().is_none_or(|p| p.uid == facts.record.pod_uid);
            if facts.record.sticky && facts.owner_wants && same_pod_or_absent {
                prop_assert!(!matches!(verdict, Verdict::Release { .. }), "{verdict:?} for {facts:?}");
            }
        }

        #[test]
        fn no_verdict_releases_a_list_reservation_its_workload_still_holds((facts, settings, _ips) in arb_case()) {
            let verdict = decide(&facts, &settings);
            if facts.list_held {
                prop_assert!(!matches!(verdict, Verdict::Release { .. }), "{verdict:?} for {facts:?}");
            }
        }
    }
}
