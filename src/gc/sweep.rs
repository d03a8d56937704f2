//! The sweep plan: every record of every block against the index, in one linear pass, with
//! no API call per record. What to release or repair goes to the pool actors; the rest is
//! counted.

use std::collections::BTreeMap;
use std::sync::Arc;

use jiff::Timestamp;
use kube::ResourceExt;

use super::index::ClusterIndex;
use super::rules::{ReleaseReason, RuleSettings, Verdict};
use crate::crd::{IPBlock, PodRef};

/// A change to one record, decided from a snapshot and re-checked before it is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordChange {
    /// The pool.
    pub pool: String,
    /// The IPBlock holding the record.
    pub block: String,
    /// The IP.
    pub ip: String,
    /// The pod the record named when the decision was made (its UID is the CAS condition).
    pub pod: PodRef,
    /// The claim name of the record's workload.
    pub claim: String,
    /// What to do.
    pub action: ChangeAction,
}

/// A release or a repair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChangeAction {
    /// Remove the record (and the claim naming its UID, when `delete_claim`).
    Release {
        /// The rule row.
        reason: ReleaseReason,
        /// Whether the claim goes too.
        delete_claim: bool,
    },
    /// Write this pod into the record: the pod reporting the IP adopts it.
    Repair {
        /// The adopting pod.
        pod: PodRef,
    },
}

/// What one sweep found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SweepPlan {
    /// Records looked at.
    pub scanned: usize,
    /// Releases and repairs to carry out.
    pub changes: Vec<RecordChange>,
    /// Records of terminating pods to look at again at their deadline.
    pub traced: Vec<(RecordChange, Timestamp)>,
    /// Records kept, by reason label.
    pub kept: BTreeMap<&'static str, usize>,
}

/// Plans one sweep over `blocks`.
pub fn plan(index: &ClusterIndex, blocks: &[Arc<IPBlock>], now: Timestamp, settings: &RuleSettings) -> SweepPlan {
    let mut plan = SweepPlan::default();
    for block in blocks {
        let block_name = block.name_any();
        for (ip, record) in &block.spec.allocations {
            plan.scanned += 1;
            let change = |action| RecordChange {
                pool: block.spec.pool.clone(),
                block: block_name.clone(),
                ip: ip.clone(),
                pod: record.pod.clone(),
                claim: crate::workload::claim_name(&record.pod.name, record.owner.as_ref()),
                action,
            };
            match index.evaluate(ip, record, now, settings) {
                Verdict::Keep(reason) => *plan.kept.entry(reason.label()).or_default() += 1,
                Verdict::TraceUntil(when) => {
                    let placeholder =
                        ChangeAction::Release { reason: ReleaseReason::TerminatingPastDeadline, delete_claim: false };
                    plan.traced.push((change(placeholder), when));
                }
                Verdict::Release { reason, delete_claim } => {
                    plan.changes.push(change(ChangeAction::Release { reason, delete_claim }))
                }
                Verdict::Repair { uid } => {
                    let pod = index.live_ips.get(ip).map(|h| h.pod.clone()).unwrap_or_else(|| PodRef {
                        namespace: record.pod.namespace.clone(),
                        name: record.pod.name.clone(),
                        uid: uid.to_string(),
                    });
                    plan.changes.push(change(ChangeAction::Repair { pod }))
                }
            }
        }
    }
    plan
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::gc::rules::NotReadyPolicy;
    use k8s_openapi::api::core::v1::{Node, Pod};
    use serde_json::json;
    use std::time::Duration;

    fn block(allocations: serde_json::Value) -> Arc<IPBlock> {
        Arc::new(
            serde_json::from_value(json!({
                "apiVersion": "ipwarden.io/v1alpha1", "kind": "IPBlock", "metadata": {"name": "p-10-0-0-0-24"},
                "spec": {"pool": "p", "cidr": "10.0.0.0/24", "allocations": allocations},
            }))
            .expect("block"),
        )
    }

    fn record(name: &str, uid: &str) -> serde_json::Value {
        json!({"pod": {"namespace": "ns", "name": name, "uid": uid}, "node": "n1", "network": "ipwarden",
               "containerId": "c", "interface": "eth0", "allocatedAt": "2026-01-01T00:00:00Z"})
    }

    fn pod(name: &str, uid: &str, ip: &str) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(json!({"metadata": {"namespace": "ns", "name": name, "uid": uid},
                "status": {"phase": "Running", "podIPs": [{"ip": ip}]}}))
            .expect("pod"),
        )
    }

    fn ready_node() -> Arc<Node> {
        Arc::new(
            serde_json::from_value(json!({"metadata": {"name": "n1"},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]}}))
            .expect("node"),
        )
    }

    #[test]
    fn a_sweep_releases_leaks_repairs_adopted_ips_and_keeps_live_records() {
        let blocks = [block(json!({
            "10.0.0.1": record("live", "u-live"),
            "10.0.0.2": record("gone", "u-gone"),
            "10.0.0.3": record("stale-name", "u-old"),
        }))];
        let pods = [pod("live", "u-live", "10.0.0.1"), pod("adopter", "u-new", "10.0.0.3")];
        let index = ClusterIndex::build(&pods, &[ready_node()], &[], &[], &[]);
        let settings = RuleSettings { additional_delay: Duration::ZERO, not_ready: NotReadyPolicy::Keep };
        let plan = plan(&index, &blocks, Timestamp::now(), &settings);
        assert_eq!(plan.scanned, 3);
        assert_eq!(plan.kept.get("in_use"), Some(&1));
        let actions: Vec<(&str, &ChangeAction)> = plan.changes.iter().map(|c| (c.ip.as_str(), &c.action)).collect();
        assert_eq!(
            actions,
            vec![
                ("10.0.0.2", &ChangeAction::Release { reason: ReleaseReason::PodGone, delete_claim: false }),
                (
                    "10.0.0.3",
                    &ChangeAction::Repair {
                        pod: PodRef { namespace: "ns".into(), name: "adopter".into(), uid: "u-new".into() }
                    }
                ),
            ]
        );
    }
}
