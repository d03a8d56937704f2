//! The release handshake (docs/gc-rules.md, "Release handshake"): before the controller
//! releases a record of a node whose agent can answer, it marks the record
//! `marked-for-release`; the agent answers under its allocation lock; only
//! `ready-for-release` lets the controller release. Both sides' decisions are here, pure.

use std::time::Duration;

use crate::crd::HandshakeState;

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

/// The agent's answer to a mark that has stood for `marked_for`. `sandbox_attached` is
/// whether the agent's checkpoint holds a sandbox with the IP (an ADD without its DEL).
pub fn agent_answer(
    pod: PodOnNode,
    sandbox_attached: bool,
    marked_for: Duration,
    sandbox_grace: Duration,
) -> AgentAnswer {
    match pod {
        PodOnNode::Active => AgentAnswer::DoNotRelease,
        _ if sandbox_attached && marked_for < sandbox_grace => AgentAnswer::NotYet,
        _ => AgentAnswer::Ready,
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
        let table = [
            (PodOnNode::Active, false, early, AgentAnswer::DoNotRelease),
            (PodOnNode::Active, true, late, AgentAnswer::DoNotRelease),
            (PodOnNode::Gone, false, early, AgentAnswer::Ready),
            (PodOnNode::Gone, true, early, AgentAnswer::NotYet),
            (PodOnNode::Gone, true, late, AgentAnswer::Ready),
            (PodOnNode::Ending, true, early, AgentAnswer::NotYet),
            (PodOnNode::Ending, false, early, AgentAnswer::Ready),
        ];
        for (pod, attached, marked_for, answer) in table {
            assert_eq!(
                agent_answer(pod, attached, marked_for, grace),
                answer,
                "{pod:?} attached={attached} {marked_for:?}"
            );
        }
    }

    proptest! {
        #[test]
        fn an_active_pod_is_never_ready_for_release(attached: bool, marked_secs in 0u64..10_000, grace_secs in 0u64..10_000) {
            let answer = agent_answer(PodOnNode::Active, attached, Duration::from_secs(marked_secs), Duration::from_secs(grace_secs));
            prop_assert_eq!(answer, AgentAnswer::DoNotRelease);
        }

        #[test]
        fn an_attached_sandbox_holds_the_ip_for_the_whole_grace(marked_secs in 0u64..10_000, grace_secs in 0u64..10_000) {
            let answer = agent_answer(PodOnNode::Gone, true, Duration::from_secs(marked_secs), Duration::from_secs(grace_secs));
            prop_assert_eq!(answer == AgentAnswer::Ready, marked_secs >= grace_secs);
        }
    }
}
