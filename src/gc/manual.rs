//! The manual-GC contract between `ipwarden gc` and the leading controller: the ConfigMap
//! and its keys, the two kinds of request, and the answers (a sweep's report, or the plan a
//! dry run would carry out). Both sides import it from here, so neither knows the other's
//! internals.

use std::collections::BTreeMap;

use super::sweep::{ChangeAction, RecordChange, SweepPlan};

/// The ConfigMap, in the controller's namespace, carrying manual GC requests and answers.
pub const TRIGGER_CONFIGMAP: &str = "ipwarden-gc";

/// Data key: the ID of the newest request.
pub const REQUEST_KEY: &str = "request";

/// Data key: what the newest request asks for ([`Mode`]); absent means a sweep.
pub const MODE_KEY: &str = "mode";

/// Data key: the ID of the newest request the leader answered.
pub const HANDLED_KEY: &str = "handled";

/// Data key: the answer, a JSON [`SweepReport`] or [`DryRunPlan`] by the request's mode.
pub const RESULT_KEY: &str = "result";

/// Data key: why the request could not be served.
pub const ERROR_KEY: &str = "error";

/// What an operator asks the leader for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A full sweep, carried out; answered with a [`SweepReport`].
    Sweep,
    /// The plan a sweep would carry out now, made with the leader's own rule settings and
    /// index, writing nothing; answered with a [`DryRunPlan`].
    DryRun,
}

impl Mode {
    /// The value under [`MODE_KEY`].
    pub fn value(self) -> &'static str {
        match self {
            Self::Sweep => "sweep",
            Self::DryRun => "dry-run",
        }
    }

    /// The mode a request's [`MODE_KEY`] value names; an absent or unknown value is a sweep,
    /// as requests from CLIs older than the dry run are.
    pub fn of(value: Option<&str>) -> Self {
        if value == Some(Self::DryRun.value()) { Self::DryRun } else { Self::Sweep }
    }
}

/// What one sweep did; what `ipwarden gc` prints.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SweepReport {
    /// Records looked at.
    pub scanned: usize,
    /// Releases and repairs decided.
    pub planned: usize,
    /// Records released.
    pub released: usize,
    /// Records repaired.
    pub repaired: usize,
    /// Records marked for release, waiting for their node's agent.
    #[serde(default)]
    pub marked: usize,
    /// Release handshakes cleared.
    #[serde(default)]
    pub aborted: usize,
    /// Sticky takeover marks answered for a node whose agent cannot answer.
    #[serde(default)]
    pub answered: usize,
    /// KubeVirt migration targets detached because no pod backs them.
    #[serde(default)]
    pub detached: usize,
    /// Decided changes the re-check dropped.
    pub skipped: usize,
    /// Changes that failed.
    pub failed: usize,
    /// Records of terminating pods still within their deadline.
    pub traced: usize,
    /// Records kept, by reason.
    pub kept: BTreeMap<String, usize>,
    /// How long it took, in milliseconds.
    pub duration_ms: u64,
}

/// What a sweep would do now; what `ipwarden gc --dry-run` prints.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DryRunPlan {
    /// Records looked at.
    pub scanned: usize,
    /// The changes a sweep would carry out.
    pub changes: Vec<PlannedChange>,
    /// Records of terminating pods traced until their deadline.
    pub traced: usize,
    /// Records kept, by reason.
    pub kept: BTreeMap<String, usize>,
}

/// One change of a [`DryRunPlan`], as an operator reads it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PlannedChange {
    /// The IP.
    pub ip: String,
    /// Its pool.
    pub pool: String,
    /// The IPBlock holding its record.
    pub block: String,
    /// The record's pod, `namespace/name`.
    pub pod: String,
    /// The record's pod UID.
    pub pod_uid: String,
    /// What would be done ([`describe`]).
    pub action: String,
    /// Why: the rule, or what the action rests on.
    pub rule: String,
}

impl DryRunPlan {
    /// The operator's view of `plan`.
    pub fn of(plan: &SweepPlan) -> Self {
        let changes = plan
            .changes
            .iter()
            .map(|c| {
                let (action, rule) = describe(c);
                PlannedChange {
                    ip: c.ip.clone(),
                    pool: c.pool.clone(),
                    block: c.block.clone(),
                    pod: format!("{}/{}", c.pod.namespace, c.pod.name),
                    pod_uid: c.pod.uid.clone(),
                    action: action.to_string(),
                    rule,
                }
            })
            .collect();
        Self {
            scanned: plan.scanned,
            changes,
            traced: plan.traced.len(),
            kept: plan.kept.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        }
    }
}

/// The action and rule columns of one change. A release on a node with a live agent goes
/// through the release handshake first.
pub fn describe(change: &RecordChange) -> (&'static str, String) {
    match &change.action {
        ChangeAction::Release { reason, .. } if change.via_agent => ("release (handshake)", reason.label().to_string()),
        ChangeAction::Release { reason, .. } => ("release", reason.label().to_string()),
        ChangeAction::Repair { adopter } => {
            ("repair", format!("adopt by {}/{} on {}", adopter.pod.namespace, adopter.pod.name, adopter.node))
        }
        ChangeAction::AbortHandshake => ("abort handshake", "no longer a candidate".to_string()),
        ChangeAction::AbortTakeover => ("abort takeover", "its pod no longer waits".to_string()),
        ChangeAction::AnswerTakeover { .. } => ("answer takeover", "the node's agent cannot answer".to_string()),
        ChangeAction::DetachTarget { target, why } => (
            "detach migration target",
            format!("{why}: pod {} (UID {}) on {}", target.pod.name, target.pod.uid, target.node),
        ),
    }
}

#[cfg(test)]
mod test {
    use super::Mode;

    #[test]
    fn a_request_without_a_known_mode_is_a_sweep_and_the_dry_run_round_trips() {
        for (value, mode) in [(None, Mode::Sweep), (Some("sweep"), Mode::Sweep), (Some("other"), Mode::Sweep)] {
            assert_eq!(Mode::of(value), mode, "{value:?}");
        }
        assert_eq!(Mode::of(Some(Mode::DryRun.value())), Mode::DryRun);
    }
}
