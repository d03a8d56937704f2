//! The release handshake (docs/gc-rules.md, "Release handshake"): before the controller
//! releases a record of a node whose agent can answer, it marks the record
//! `marked-for-release`; the agent answers under its allocation lock; only
//! `ready-for-release` lets the controller release. Both sides' decisions are here, pure.
//!
//! A recreated sticky pod taking its predecessor's record over uses the same handshake
//! (docs/gc-rules.md, "Sticky takeover"): its agent marks the record, the record's node
//! answers, and only then is the record taken over ([`reclaim_step`]); the controller
//! leaves such marks to the agents and answers only for a node that cannot
//! ([`controller_takeover_step`]).

use std::time::Duration;

use jiff::Timestamp;

use super::index::PodFacts;
use super::rules::{NodeState, NotReadyGate, NotReadyPolicy, ReleaseReason, not_ready_gate};
use crate::crd::{Allocation, HandshakeState, Takeover};
use crate::ipam::workload::KUBEVIRT_VMI_KIND;

/// Whether `record` is marked for release (by the controller, or by an agent's sticky
/// takeover) and waits for its node's agent to answer.
pub fn marked_for_release(record: &Allocation) -> bool {
    record.release_handshake.as_ref().is_some_and(|h| h.state == HandshakeState::MarkedForRelease)
}

/// Whether the record's node agent has answered its release handshake.
pub fn answered(record: &Allocation) -> bool {
    record
        .release_handshake
        .as_ref()
        .is_some_and(|h| matches!(h.state, HandshakeState::ReadyForRelease | HandshakeState::DoNotRelease))
}

/// Whether an agent marked the record for a sticky takeover.
pub fn takeover_marked(record: &Allocation) -> bool {
    record.release_handshake.as_ref().is_some_and(|h| h.takeover.is_some())
}

/// Whether the record carries the controller's release mark, answered `ready-for-release`
/// by its node's agent (not a sticky takeover's).
fn answered_controller_mark(record: &Allocation) -> bool {
    record
        .release_handshake
        .as_ref()
        .is_some_and(|h| h.state == HandshakeState::ReadyForRelease && h.takeover.is_none())
}

/// The reasons of a controller mark written when the record's pod (its UID) was gone or
/// finished: the ones a later read of the pod could not turn ([`mark_settles_release`]).
const POD_ENDED_REASONS: [ReleaseReason; 4] = [
    ReleaseReason::PodGone,
    ReleaseReason::NodeDeleted,
    ReleaseReason::TerminatingPastDeadline,
    ReleaseReason::Completed,
];

/// Whether the release of `record` (`sticky`: it is a sticky owner's) may go without the
/// controller's second live read of its pod. The controller writes its mark only after a
/// live read showed the record's pod gone or finished, and the agent answers
/// `ready-for-release` only after its own live read: a pod UID never comes back, and while
/// the record exists ipwarden gives its IP to no other pod. Only for a mark of a pod that
/// ended ([`POD_ENDED_REASONS`]; not `uid_mismatch`, whose live namesake could come to report
/// the IP through another IPAM) and a record no owner or workload can want back: a sticky or
/// list-bound record's owner is re-read at release time, after a fresh look at the pod. The
/// pods the index shows reporting the IP still stop the release.
pub fn mark_settles_release(record: &Allocation, sticky: bool) -> bool {
    !sticky
        && record.held_for.is_none()
        && answered_controller_mark(record)
        && record
            .release_handshake
            .as_ref()
            .is_some_and(|h| POD_ENDED_REASONS.iter().any(|reason| reason.label() == h.reason))
}

/// Whether the record's handshake is one the controller acts on as soon as it appears: an
/// agent's answer, or a sticky takeover mark (answered for a node whose agent cannot).
pub fn actionable(record: &Allocation) -> bool {
    answered(record) || takeover_marked(record)
}

/// What the controller does with a record the rule table wants released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ControllerStep {
    /// Write `marked-for-release` and wait for the agent.
    Mark,
    /// Marked already; the agent has not answered yet.
    Await,
    /// Release the record (after the usual re-checks).
    Release,
    /// Clear the handshake: the agent refused, so the record is looked at afresh later.
    Abort,
}

/// The controller's step for a record the rules want released, given the handshake state
/// in the record and whether the record's node has an agent to ask (the node exists and is
/// Ready). Without one, the rule table's node rows (node deleted, NotReady policy) already
/// decided, and the record is released directly.
pub fn controller_step(state: Option<HandshakeState>, agent_can_answer: bool) -> ControllerStep {
    if !agent_can_answer {
        return ControllerStep::Release;
    }
    match state {
        None => ControllerStep::Mark,
        Some(HandshakeState::MarkedForRelease) => ControllerStep::Await,
        Some(HandshakeState::ReadyForRelease) => ControllerStep::Release,
        Some(HandshakeState::DoNotRelease) => ControllerStep::Abort,
    }
}

/// The record's pod as the agent reads it live at answer time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodOnNode {
    /// No pod of that name, or one with another UID.
    Gone,
    /// The record's pod, terminating or finished.
    Ending,
    /// The record's pod, Pending or Running and not terminating.
    Active,
}

/// The agent's answer to a mark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentAnswer {
    /// Nothing on the node uses the IP: the controller may release it.
    Ready,
    /// The record's pod is alive: never release.
    DoNotRelease,
    /// A sandbox with the IP is still attached on the node (its DEL has not arrived):
    /// answer later; after `sandbox_grace` the DEL counts as lost.
    NotYet,
}

impl AgentAnswer {
    /// The state written for the answer, if any.
    pub fn state(self) -> Option<HandshakeState> {
        match self {
            Self::Ready => Some(HandshakeState::ReadyForRelease),
            Self::DoNotRelease => Some(HandshakeState::DoNotRelease),
            Self::NotYet => None,
        }
    }

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Ready => "ready_for_release",
            Self::DoNotRelease => "do_not_release",
            Self::NotYet => "not_yet",
        }
    }
}

/// The sandboxes of the node that hold a marked record's IP, as its agent knows them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SandboxOnNode {
    /// None: its DEL came, or the runtime's CNI GC no longer listed it and dropped it.
    Detached,
    /// One is in the agent's checkpoint (an ADD without its DEL), and the runtime's CNI GC
    /// has not listed it within the sandbox grace: after the grace its DEL counts as lost.
    Attached,
    /// One is in the checkpoint and the runtime's CNI GC listed it within the sandbox grace:
    /// the runtime still has it, so its DEL is late, not lost.
    ListedByRuntime,
    /// Every one is in the checkpoint, and the runtime, asked over CRI, no longer has it
    /// (`crate::cri::sandboxes`): its DEL is lost, with no need to wait out the grace.
    GoneFromRuntime,
}

impl SandboxOnNode {
    /// From whether a checkpoint entry holds the IP and how long ago the runtime's CNI GC
    /// last listed such an entry (`None`: not since the agent started or the entry was
    /// written).
    pub fn of(attached: bool, listed_ago: Option<Duration>, sandbox_grace: Duration) -> Self {
        match (attached, listed_ago) {
            (false, _) => Self::Detached,
            (true, Some(ago)) if ago < sandbox_grace => Self::ListedByRuntime,
            (true, _) => Self::Attached,
        }
    }
}

/// The agent's answer to a mark that has stood for `marked_for`, given the sandboxes on the
/// node that hold the IP. Only the runtime can say a sandbox is gone: one it still lists is
/// never counted as a lost DEL, however long the mark has stood.
pub fn agent_answer(
    pod: PodOnNode,
    sandbox: SandboxOnNode,
    marked_for: Duration,
    sandbox_grace: Duration,
) -> AgentAnswer {
    match (pod, sandbox) {
        (PodOnNode::Active, _) => AgentAnswer::DoNotRelease,
        (_, SandboxOnNode::ListedByRuntime) => AgentAnswer::NotYet,
        (_, SandboxOnNode::Attached) if marked_for < sandbox_grace => AgentAnswer::NotYet,
        (_, SandboxOnNode::GoneFromRuntime) => AgentAnswer::Ready,
        _ => AgentAnswer::Ready,
    }
}

/// Why a takeover mark's claimant does not get the record: the pod the mark names, read live,
/// is not a live pod of that UID on the node the mark names, of the record's workload (the
/// same pod name, or for a VM the same VirtualMachineInstance). `None`: it is, and the answer
/// may consent. The record's node checks this before it answers `ready-for-release`, so only
/// a real pod of the workload on the node that asked gets the IP (decision 0022, informed
/// consent): a node cannot win another node's record for a pod it made up.
pub fn claimant_refusal(record: &Allocation, takeover: &Takeover, claimant: Option<&PodFacts>) -> Option<String> {
    let who = format!(
        "the takeover's claimant {}/{} (UID {}) on node {}",
        takeover.pod.namespace, takeover.pod.name, takeover.pod.uid, takeover.node
    );
    let same_workload = match record.owner.as_ref() {
        Some(owner) if owner.kind == KUBEVIRT_VMI_KIND => {
            claimant.is_some_and(|c| c.owner.as_ref() == Some(owner) && c.namespace == record.pod.namespace)
        }
        _ => takeover.pod.namespace == record.pod.namespace && takeover.pod.name == record.pod.name,
    };
    match claimant {
        None => Some(format!("{who} does not exist")),
        Some(c) if c.uid != takeover.pod.uid => Some(format!("{who} does not exist: that pod has UID {}", c.uid)),
        Some(c) if c.terminal() => Some(format!("{who} is ending")),
        Some(c) if c.node != takeover.node => Some(format!("{who} runs on node {:?}, not there", c.node)),
        Some(_) if !same_workload => Some(format!("{who} is not a pod of the record's workload")),
        Some(_) => None,
    }
}

/// An agent's answer to the mark on the record at `ip`, to write when the record there is
/// still `uid`'s and still marked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MarkAnswer {
    /// The record's IP.
    pub ip: String,
    /// The record's pod UID, as the answer was decided for.
    pub uid: String,
    /// When the mark answered was made: a record marked again since waits for an answer of
    /// its own (its sandbox grace counts from the new mark).
    pub marked_at: Timestamp,
    /// The answer.
    pub state: HandshakeState,
    /// Why, for the record's `detail`.
    pub detail: String,
}

/// Writes `answers` into a block's records, all in one edit: each only where the record is
/// still its pod's and still under the same `marked-for-release` mark (a new record, a DEL,
/// another answer or a new mark since leaves it alone). Returns the IPs answered, in
/// `answers`' order.
pub fn write_answers(
    records: &mut std::collections::BTreeMap<String, Allocation>,
    answers: &[MarkAnswer],
) -> Vec<String> {
    let mut written = Vec::new();
    for answer in answers {
        let Some(record) = records.get_mut(&answer.ip).filter(|r| r.pod.uid == answer.uid) else { continue };
        let Some(handshake) = record
            .release_handshake
            .as_mut()
            .filter(|h| h.state == HandshakeState::MarkedForRelease && h.marked_at.0 == answer.marked_at)
        else {
            continue;
        };
        handshake.state = answer.state;
        handshake.detail = Some(answer.detail.clone());
        written.push(answer.ip.clone());
    }
    written
}

/// The record of a claimed IP as a recreated sticky pod's ADD sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClaimedRecord {
    /// The record names the new pod's UID (the same pod setting up a new sandbox).
    pub same_pod: bool,
    /// The record belongs to the same sticky workload (StatefulSet ordinal, KubeVirt VM).
    pub same_workload: bool,
    /// The record's node is this node.
    pub own_node: bool,
    /// The record's node is this node and no sandbox in this agent's checkpoint holds the
    /// IP: this agent knows the sandbox is gone.
    pub detached_here: bool,
    /// The record's release handshake.
    pub handshake: Option<HandshakeState>,
    /// The handshake is a takeover another pod, or another node, asked for: its answer is
    /// not this pod's to act on (decision 0022: a node takes another node's record only on
    /// an answer given for its own pod).
    pub asked_for_another: bool,
}

/// What a recreated sticky pod's ADD does with the record of a claimed IP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReclaimStep {
    /// Write the new pod's record now.
    Take,
    /// Mark the record for a sticky takeover and fail the ADD with "try again later".
    Mark,
    /// Marked already: fail the ADD with "try again later" until the record's node answers.
    Wait,
    /// Another workload's record: not this pod's to take.
    NotOurs,
}

/// The step for a claimed IP's record. A sandbox still attached elsewhere is never shared,
/// and another node's record is never taken without that node's consent: the record is taken
/// over at once only on this node, when this agent knows no sandbox of it holds the IP (a
/// reservation its DEL left, a sandbox gone), or by the same pod re-creating its sandbox, as a
/// runtime runs one sandbox per pod. Otherwise only once the record's node's agent (or the
/// controller for a node that cannot answer) said `ready-for-release` to this pod's takeover
/// mark, a reservation on another node included (decision 0022: this node could name any pod
/// in its record). An answer to a takeover another pod (an earlier one of the workload) or
/// another node asked for is asked again for this pod. The claimed IPs are the ones the
/// controller witnessed the workload's pod hold (decision 0022): no node's word but the
/// records of the node the pod ran on.
pub fn reclaim_step(record: ClaimedRecord) -> ReclaimStep {
    if !record.same_pod && !record.same_workload {
        return ReclaimStep::NotOurs;
    }
    if record.own_node && (record.same_pod || record.detached_here) {
        return ReclaimStep::Take;
    }
    match record.handshake {
        Some(HandshakeState::ReadyForRelease) if record.asked_for_another => ReclaimStep::Mark,
        Some(HandshakeState::ReadyForRelease) => ReclaimStep::Take,
        Some(HandshakeState::MarkedForRelease) => ReclaimStep::Wait,
        None | Some(HandshakeState::DoNotRelease) => ReclaimStep::Mark,
    }
}

/// What the controller does with a record an agent marked for a sticky takeover.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TakeoverStep {
    /// The agents settle it: the record's node answers, the waiting pod takes over.
    LeaveToAgents,
    /// The waiting pod is gone or got its IPs elsewhere: clear the mark, so the record is
    /// judged by the rule table again.
    Abort,
    /// The record's node cannot answer and the NotReady policy (or the node's deletion, or
    /// the record being a reservation no sandbox holds) lets go: answer `ready-for-release`
    /// for its agent.
    AnswerForAgent,
    /// Answer for the agent at this instant, when the NotReady policy's bound has passed.
    AnswerAt(Timestamp),
}

/// The controller's step for a takeover mark in `state`. `claimant_waiting`: the waiting
/// pod still exists with its UID, is not terminal, reports no IPs yet, runs on the node the
/// mark names and is of the record's workload ([`claimant_refusal`]). `detached`: the record
/// names no sandbox (its DEL came), so nothing on its node holds the IP and the NotReady
/// policy, which waits for a sandbox that may still run, does not apply. `node`: the record's
/// node, whose agent answers while it is Ready.
pub fn controller_takeover_step(
    state: HandshakeState,
    claimant_waiting: bool,
    detached: bool,
    node: NodeState,
    policy: NotReadyPolicy,
    now: Timestamp,
) -> TakeoverStep {
    if !claimant_waiting {
        return TakeoverStep::Abort;
    }
    if state != HandshakeState::MarkedForRelease {
        return TakeoverStep::LeaveToAgents;
    }
    match node {
        NodeState::Ready => TakeoverStep::LeaveToAgents,
        NodeState::Deleted => TakeoverStep::AnswerForAgent,
        NodeState::NotReady(_) if detached => TakeoverStep::AnswerForAgent,
        NodeState::NotReady(since) => match not_ready_gate(since, policy, now) {
            NotReadyGate::Closed => TakeoverStep::LeaveToAgents,
            NotReadyGate::OpensAt(due) => TakeoverStep::AnswerAt(due),
            NotReadyGate::Open => TakeoverStep::AnswerForAgent,
        },
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use proptest::prelude::*;

    const STATES: [Option<HandshakeState>; 4] = [
        None,
        Some(HandshakeState::MarkedForRelease),
        Some(HandshakeState::ReadyForRelease),
        Some(HandshakeState::DoNotRelease),
    ];

    #[test]
    fn answers_are_written_only_where_the_record_is_still_its_pods_and_still_marked() {
        use crate::crd::ReleaseHandshake;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let marked = |uid: &str, state: HandshakeState| {
            let mut record = crate::ipam::blocks::test::record(uid, "c");
            record.release_handshake = Some(ReleaseHandshake {
                state,
                marked_at: Time(Timestamp::UNIX_EPOCH),
                reason: "pod_gone".into(),
                detail: None,
                pod_ended_at: None,
                takeover: None,
            });
            record
        };
        let mut records = std::collections::BTreeMap::from([
            ("10.0.0.1".to_string(), marked("a", HandshakeState::MarkedForRelease)),
            ("10.0.0.2".to_string(), marked("b", HandshakeState::MarkedForRelease)),
            ("10.0.0.3".to_string(), marked("new", HandshakeState::MarkedForRelease)),
            ("10.0.0.4".to_string(), marked("d", HandshakeState::DoNotRelease)),
            ("10.0.0.5".to_string(), crate::ipam::blocks::test::record("e", "c")),
            ("10.0.0.9".to_string(), marked("g", HandshakeState::MarkedForRelease)),
        ]);
        let answer = |ip: &str, uid: &str, state| MarkAnswer {
            ip: ip.into(),
            uid: uid.into(),
            marked_at: Timestamp::UNIX_EPOCH,
            state,
            detail: format!("because {uid}"),
        };
        let answers = [
            answer("10.0.0.1", "a", HandshakeState::ReadyForRelease),
            answer("10.0.0.2", "b", HandshakeState::DoNotRelease),
            answer("10.0.0.3", "old", HandshakeState::ReadyForRelease),
            answer("10.0.0.4", "d", HandshakeState::ReadyForRelease),
            answer("10.0.0.5", "e", HandshakeState::ReadyForRelease),
            answer("10.0.0.6", "f", HandshakeState::ReadyForRelease),
            MarkAnswer {
                marked_at: Timestamp::from_second(60).unwrap(),
                ..answer("10.0.0.9", "g", HandshakeState::ReadyForRelease)
            },
        ];
        let before = records.clone();
        assert_eq!(write_answers(&mut records, &answers), ["10.0.0.1", "10.0.0.2"]);
        let state = |ip: &str| records[ip].release_handshake.as_ref().map(|h| (h.state, h.detail.clone()));
        assert_eq!(state("10.0.0.1"), Some((HandshakeState::ReadyForRelease, Some("because a".into()))));
        assert_eq!(state("10.0.0.2"), Some((HandshakeState::DoNotRelease, Some("because b".into()))));
        // .9 was marked anew (at 0 s) after the answer's mark (at 60 s) was decided.
        for untouched in ["10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.9"] {
            assert_eq!(records[untouched], before[untouched], "{untouched} changed");
        }
        assert!(!records.contains_key("10.0.0.6"), "an answer wrote a record");
    }

    #[test]
    fn the_controller_releases_only_after_the_agent_said_ready() {
        let table = [
            (None, ControllerStep::Mark),
            (Some(HandshakeState::MarkedForRelease), ControllerStep::Await),
            (Some(HandshakeState::ReadyForRelease), ControllerStep::Release),
            (Some(HandshakeState::DoNotRelease), ControllerStep::Abort),
        ];
        for (state, step) in table {
            assert_eq!(controller_step(state, true), step, "state {state:?}");
        }
    }

    #[test]
    fn only_an_answered_controller_mark_on_a_record_nobody_wants_back_spares_the_second_pod_read() {
        use crate::crd::{OwnerRef, ReleaseHandshake, Takeover};
        let marked = |state, takeover: bool, reason: &str| ReleaseHandshake {
            state,
            marked_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::UNIX_EPOCH),
            reason: reason.into(),
            detail: None,
            pod_ended_at: None,
            takeover: takeover
                .then(|| Takeover { pod: crate::ipam::blocks::test::record("u2", "c2").pod, node: "node-1".into() }),
        };
        let held = Some(OwnerRef { kind: "Deployment".into(), name: "web".into() });
        // (handshake, held for a workload, sticky, settles)
        let handshake = |state, takeover| marked(state, takeover, "pod_gone");
        let table = [
            (Some(handshake(HandshakeState::ReadyForRelease, false)), None, false, true),
            (Some(marked(HandshakeState::ReadyForRelease, false, "completed")), None, false, true),
            (Some(marked(HandshakeState::ReadyForRelease, false, "node_deleted")), None, false, true),
            (Some(marked(HandshakeState::ReadyForRelease, false, "terminating_past_deadline")), None, false, true),
            (Some(marked(HandshakeState::ReadyForRelease, false, "uid_mismatch")), None, false, false),
            (Some(marked(HandshakeState::ReadyForRelease, false, "node_not_ready")), None, false, false),
            (Some(handshake(HandshakeState::ReadyForRelease, false)), None, true, false),
            (Some(handshake(HandshakeState::ReadyForRelease, false)), held.clone(), false, false),
            (Some(handshake(HandshakeState::ReadyForRelease, true)), None, false, false),
            (Some(handshake(HandshakeState::MarkedForRelease, false)), None, false, false),
            (Some(handshake(HandshakeState::DoNotRelease, false)), None, false, false),
            (None, None, false, false),
        ];
        for (handshake, held_for, sticky, settles) in table {
            let mut record = crate::ipam::blocks::test::record("u1", "c1");
            record.release_handshake = handshake;
            record.held_for = held_for;
            assert_eq!(mark_settles_release(&record, sticky), settles, "{record:?} sticky {sticky}");
        }
    }

    #[test]
    fn without_an_agent_to_ask_the_node_rows_have_decided() {
        for state in STATES {
            assert_eq!(controller_step(state, false), ControllerStep::Release, "state {state:?}");
        }
    }

    #[test]
    fn the_agent_answers_by_its_pod_and_its_sandboxes() {
        let grace = Duration::from_secs(60);
        let early = Duration::from_secs(5);
        let late = Duration::from_secs(61);
        use SandboxOnNode::{Attached, Detached, GoneFromRuntime, ListedByRuntime};
        let table = [
            (PodOnNode::Active, Detached, early, AgentAnswer::DoNotRelease),
            (PodOnNode::Active, Attached, late, AgentAnswer::DoNotRelease),
            (PodOnNode::Gone, Detached, early, AgentAnswer::Ready),
            (PodOnNode::Gone, Attached, early, AgentAnswer::NotYet),
            (PodOnNode::Gone, Attached, late, AgentAnswer::Ready),
            (PodOnNode::Gone, ListedByRuntime, late, AgentAnswer::NotYet),
            (PodOnNode::Ending, Attached, early, AgentAnswer::NotYet),
            (PodOnNode::Ending, ListedByRuntime, late, AgentAnswer::NotYet),
            (PodOnNode::Ending, Detached, early, AgentAnswer::Ready),
            (PodOnNode::Gone, GoneFromRuntime, early, AgentAnswer::Ready),
            (PodOnNode::Ending, GoneFromRuntime, early, AgentAnswer::Ready),
            (PodOnNode::Active, GoneFromRuntime, late, AgentAnswer::DoNotRelease),
        ];
        for (pod, sandbox, marked_for, answer) in table {
            assert_eq!(agent_answer(pod, sandbox, marked_for, grace), answer, "{pod:?} {sandbox:?} {marked_for:?}");
        }
    }

    #[test]
    fn a_sandbox_counts_as_listed_by_the_runtime_only_within_the_grace_of_its_listing() {
        let grace = Duration::from_secs(60);
        let secs = |s| Some(Duration::from_secs(s));
        let table = [
            (false, None, SandboxOnNode::Detached),
            (false, secs(1), SandboxOnNode::Detached),
            (true, None, SandboxOnNode::Attached),
            (true, secs(0), SandboxOnNode::ListedByRuntime),
            (true, secs(59), SandboxOnNode::ListedByRuntime),
            (true, secs(60), SandboxOnNode::Attached),
            (true, secs(3_600), SandboxOnNode::Attached),
        ];
        for (attached, listed_ago, sandbox) in table {
            assert_eq!(SandboxOnNode::of(attached, listed_ago, grace), sandbox, "attached={attached} {listed_ago:?}");
        }
    }

    #[test]
    fn a_takeover_is_consented_to_only_for_a_live_pod_of_the_workload_on_the_node_that_asked() {
        let owner = |kind: &str, name: &str| Some(crate::crd::OwnerRef { kind: kind.into(), name: name.into() });
        let record = |name: &str, owner| Allocation {
            pod: crate::crd::PodRef { namespace: "ns".into(), name: name.into(), uid: "old".into() },
            node: "node-b".into(),
            network: "ipwarden".into(),
            container_id: "c".into(),
            interface: "eth0".into(),
            owner,
            sticky: true,
            held_for: None,
            allocated_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::UNIX_EPOCH),
            release_handshake: None,
            migration_target: None,
            repaired_at: None,
        };
        let takeover = |name: &str| Takeover {
            pod: crate::crd::PodRef { namespace: "ns".into(), name: name.into(), uid: "new".into() },
            node: "node-a".into(),
        };
        let pod = |name: &str, uid: &str, node: &str, owner| PodFacts {
            namespace: "ns".into(),
            name: name.into(),
            uid: uid.into(),
            object_uid: uid.into(),
            phase: super::super::rules::Phase::Active,
            deletion: None,
            ips: Vec::new(),
            node: node.into(),
            owner,
            host_network: false,
        };
        let web = record("web-0", owner("StatefulSet", "web"));
        let vm = record("virt-launcher-vm-abc", owner(KUBEVIRT_VMI_KIND, "vm"));
        let mut ending = pod("web-0", "new", "node-a", None);
        ending.deletion = Some(Timestamp::UNIX_EPOCH);
        let table = [
            (&web, takeover("web-0"), Some(pod("web-0", "new", "node-a", None)), None),
            (&web, takeover("web-0"), None, Some("does not exist")),
            (&web, takeover("web-0"), Some(pod("web-0", "other", "node-a", None)), Some("that pod has UID other")),
            (&web, takeover("web-0"), Some(ending), Some("is ending")),
            (&web, takeover("web-0"), Some(pod("web-0", "new", "node-c", None)), Some("runs on node \"node-c\"")),
            (
                &web,
                takeover("web-1"),
                Some(pod("web-1", "new", "node-a", None)),
                Some("not a pod of the record's workload"),
            ),
            (
                &vm,
                takeover("virt-launcher-vm-xyz"),
                Some(pod("virt-launcher-vm-xyz", "new", "node-a", owner(KUBEVIRT_VMI_KIND, "vm"))),
                None,
            ),
            (
                &vm,
                takeover("virt-launcher-vm2-xyz"),
                Some(pod("virt-launcher-vm2-xyz", "new", "node-a", owner(KUBEVIRT_VMI_KIND, "vm2"))),
                Some("not a pod of the record's workload"),
            ),
        ];
        for (record, takeover, claimant, refusal) in table {
            let got = claimant_refusal(record, &takeover, claimant.as_ref());
            match (refusal, &got) {
                (None, None) => {}
                (Some(expected), Some(got)) if got.contains(expected) => {}
                _ => panic!("{} for {:?}: expected {refusal:?}, got {got:?}", record.pod.name, claimant.map(|c| c.uid)),
            }
        }
    }

    #[test]
    fn a_sticky_record_is_taken_over_only_once_its_sandbox_let_go() {
        let record = |same_pod, same_workload, own_node, detached_here, handshake| ClaimedRecord {
            same_pod,
            same_workload,
            own_node,
            detached_here,
            handshake,
            asked_for_another: false,
        };
        let for_another =
            |handshake| ClaimedRecord { asked_for_another: true, ..record(false, true, false, false, handshake) };
        let ready = Some(HandshakeState::ReadyForRelease);
        let marked = Some(HandshakeState::MarkedForRelease);
        let refused = Some(HandshakeState::DoNotRelease);
        let table = [
            (record(false, false, true, true, None), ReclaimStep::NotOurs),
            (record(false, false, false, false, ready), ReclaimStep::NotOurs),
            // The same pod on its own node: a new sandbox of the pod the runtime runs once.
            (record(true, false, true, false, None), ReclaimStep::Take),
            // This node's reservation, or a record no sandbox here holds.
            (record(false, true, true, true, None), ReclaimStep::Take),
            // Another node's record, a reservation included (decision 0022: the record's node
            // or the controller answers first), and this node's record its sandbox still holds.
            (record(false, true, false, false, None), ReclaimStep::Mark),
            (record(true, true, false, false, None), ReclaimStep::Mark),
            (record(false, true, true, false, None), ReclaimStep::Mark),
            (record(false, true, false, false, refused), ReclaimStep::Mark),
            (record(false, true, false, false, marked), ReclaimStep::Wait),
            (record(false, true, false, false, ready), ReclaimStep::Take),
            // An answer given to an earlier pod of the workload (or one on another node) is
            // asked again for this one; a mark still waiting for it is waited on.
            (for_another(ready), ReclaimStep::Mark),
            (for_another(marked), ReclaimStep::Wait),
            (ClaimedRecord { asked_for_another: true, ..record(false, true, true, true, ready) }, ReclaimStep::Take),
        ];
        for (record, step) in table {
            assert_eq!(reclaim_step(record), step, "{record:?}");
        }
    }

    #[test]
    fn the_controller_answers_a_takeover_only_for_a_node_that_cannot() {
        let now = Timestamp::from_second(1_000).expect("ts");
        let since = Timestamp::from_second(990).expect("ts");
        let after = |s| NotReadyPolicy::ReleaseAfter(Duration::from_secs(s));
        let marked = HandshakeState::MarkedForRelease;
        let due = Timestamp::from_second(1_020).expect("ts");
        let not_ready = NodeState::NotReady(since);
        let (attached, detached) = (false, true);
        let table = [
            (marked, false, attached, NodeState::Ready, NotReadyPolicy::Keep, TakeoverStep::Abort),
            (HandshakeState::ReadyForRelease, false, attached, NodeState::Deleted, after(0), TakeoverStep::Abort),
            (marked, true, attached, NodeState::Ready, after(0), TakeoverStep::LeaveToAgents),
            (
                HandshakeState::ReadyForRelease,
                true,
                attached,
                NodeState::Deleted,
                after(0),
                TakeoverStep::LeaveToAgents,
            ),
            (marked, true, attached, NodeState::Deleted, NotReadyPolicy::Keep, TakeoverStep::AnswerForAgent),
            (marked, true, attached, not_ready, NotReadyPolicy::Keep, TakeoverStep::LeaveToAgents),
            (marked, true, attached, not_ready, after(30), TakeoverStep::AnswerAt(due)),
            (marked, true, attached, not_ready, after(10), TakeoverStep::AnswerForAgent),
            // A reservation (its DEL came): no sandbox holds the IP, so a node that cannot answer
            // is answered for at once, whatever the NotReady policy; a Ready one answers itself.
            (marked, true, detached, not_ready, NotReadyPolicy::Keep, TakeoverStep::AnswerForAgent),
            (marked, true, detached, not_ready, after(30), TakeoverStep::AnswerForAgent),
            (marked, true, detached, NodeState::Ready, after(0), TakeoverStep::LeaveToAgents),
            (marked, false, detached, not_ready, after(0), TakeoverStep::Abort),
        ];
        for (state, waiting, detached, node, policy, step) in table {
            assert_eq!(
                controller_takeover_step(state, waiting, detached, node, policy, now),
                step,
                "{state:?} waiting={waiting} detached={detached} {node:?} {policy:?}"
            );
        }
    }

    fn pods() -> impl Strategy<Value = PodOnNode> {
        prop_oneof![Just(PodOnNode::Gone), Just(PodOnNode::Ending), Just(PodOnNode::Active)]
    }

    fn sandboxes() -> impl Strategy<Value = SandboxOnNode> {
        prop_oneof![
            Just(SandboxOnNode::Detached),
            Just(SandboxOnNode::Attached),
            Just(SandboxOnNode::ListedByRuntime),
            Just(SandboxOnNode::GoneFromRuntime),
        ]
    }

    proptest! {
        #[test]
        fn an_active_pod_is_never_ready_for_release(sandbox in sandboxes(), marked_secs in 0u64..10_000, grace_secs in 0u64..10_000) {
            let answer = agent_answer(PodOnNode::Active, sandbox, Duration::from_secs(marked_secs), Duration::from_secs(grace_secs));
            prop_assert_eq!(answer, AgentAnswer::DoNotRelease);
        }

        #[test]
        fn an_attached_sandbox_holds_the_ip_for_the_whole_grace(marked_secs in 0u64..10_000, grace_secs in 0u64..10_000) {
            let answer = agent_answer(PodOnNode::Gone, SandboxOnNode::Attached, Duration::from_secs(marked_secs), Duration::from_secs(grace_secs));
            prop_assert_eq!(answer == AgentAnswer::Ready, marked_secs >= grace_secs);
        }

        #[test]
        fn a_sandbox_the_runtime_still_lists_is_never_ready_for_release(pod in pods(), marked_secs in 0u64..10_000, grace_secs in 0u64..10_000) {
            let answer = agent_answer(pod, SandboxOnNode::ListedByRuntime, Duration::from_secs(marked_secs), Duration::from_secs(grace_secs));
            prop_assert_ne!(answer, AgentAnswer::Ready);
        }
    }
}
