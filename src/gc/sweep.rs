//! The sweep plan: every record of every block against the index, in one linear pass, with
//! no API call per record. What to release or repair goes to the pool actors; the rest is
//! counted.

use std::collections::BTreeMap;
use std::sync::Arc;

use jiff::Timestamp;
use kube::ResourceExt;

use super::handshake::{ControllerStep, TakeoverStep, controller_step};
use super::index::ClusterIndex;
use super::rules::{ReleaseReason, RuleSettings, Verdict};
use crate::crd::{Allocation, IPBlock, MigrationTarget, PodRef, Takeover};
use crate::ipam::blocks::Adopter;

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
    /// The record's node when the decision was made.
    pub node: String,
    /// The claim name of the record's workload.
    pub claim: String,
    /// Whether the record's node has an agent to answer the release handshake.
    pub via_agent: bool,
    /// Whether the record's block is retired ([`ClusterIndex::retired`]): a sticky
    /// record there goes with its pod, whatever its owner wants.
    pub retired: bool,
    /// What to do.
    pub action: ChangeAction,
}

impl RecordChange {
    /// A change to `record`, the record of `ip` in `block`.
    pub fn of(index: &ClusterIndex, block: &IPBlock, ip: &str, record: &Allocation, action: ChangeAction) -> Self {
        let name = block.name_any();
        Self {
            pool: block.spec.pool.clone(),
            ip: ip.to_string(),
            pod: record.pod.clone(),
            node: record.node.clone(),
            claim: crate::ipam::workload::claim_name(&record.pod.name, record.owner.as_ref()),
            via_agent: index.agent_can_answer(record),
            retired: index.retired(&name),
            block: name,
            action,
        }
    }
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
    /// Make the record the whole attachment of the pod reporting the IP
    /// ([`crate::ipam::blocks::repair`]).
    Repair {
        /// The adopting pod, its node and its workload.
        adopter: Adopter,
    },
    /// Clear the controller's release mark: the record is no longer a candidate.
    AbortHandshake,
    /// Clear an agent's sticky takeover mark whose waiting pod no longer waits.
    AbortTakeover,
    /// Answer `ready-for-release` to a sticky takeover mark for the record's node, whose
    /// agent cannot answer (node deleted, or NotReady past the NotReady policy, or at once
    /// for a reservation).
    AnswerTakeover {
        /// Decided for a reservation: answered only while the record still names no sandbox.
        detached: bool,
        /// The mark the decision checked (its claimant, and when it was written): a mark
        /// written since, for another claimant, is not answered unchecked.
        mark: MarkSeen,
    },
    /// Detach the record's KubeVirt migration target, which no pod backs
    /// ([`crate::ipam::workload::target_unbacked`]).
    DetachTarget {
        /// The target as the decision found it: detached only while the record carries this
        /// very target.
        target: MigrationTarget,
        /// Why no pod backs it ([`crate::ipam::workload::target_unbacked`]).
        why: &'static str,
    },
}

/// A sticky takeover mark as the controller's decision saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MarkSeen {
    /// The waiting pod and its node.
    pub claimant: Takeover,
    /// When the mark was written.
    pub marked_at: Timestamp,
}

impl MarkSeen {
    /// The takeover mark `record` carries, if any.
    pub fn of(record: &Allocation) -> Option<Self> {
        let handshake = record.release_handshake.as_ref()?;
        Some(Self { claimant: handshake.takeover.clone()?, marked_at: handshake.marked_at.0 })
    }

    /// Whether `record` still carries this very mark.
    pub fn still_on(&self, record: &Allocation) -> bool {
        Self::of(record).as_ref() == Some(self)
    }
}

/// The next step for one record, from its verdict and its release handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Planned {
    /// Leave it; the label says why.
    Keep(&'static str),
    /// Look again at this instant.
    Trace(Timestamp),
    /// Carry this out.
    Change(ChangeAction),
    /// Repair it for the pod reporting its IP, which the sweep resolves from the IP index.
    Repair,
}

/// Why a record marked for release is left while its agent has not answered.
pub const AWAITING_AGENT: &str = "awaiting_agent";

/// Why a record marked for a sticky takeover is left to the agents.
pub const STICKY_TAKEOVER: &str = "sticky_takeover";

/// The next step for a record given its verdict and, for a record an agent marked for a
/// sticky takeover, the controller's `takeover` step. A record that is no longer a
/// candidate has its handshake aborted; one marked and waiting for its agent is left
/// alone; a takeover mark follows its own step (only a repair goes before it). A record kept,
/// or marked for a takeover, whose migration target no pod backs (`target_unbacked`, why) has
/// the target detached first: a takeover cannot complete while another node's target is
/// attached.
pub fn next_step(
    verdict: Verdict<'_>,
    record: &Allocation,
    via_agent: bool,
    takeover: Option<TakeoverStep>,
    target_unbacked: Option<&'static str>,
) -> Planned {
    let handshake = record.release_handshake.as_ref().map(|h| h.state);
    let repair = matches!(verdict, Verdict::Repair { .. });
    if let (Some(target), Some(why)) = (record.migration_target.as_ref(), target_unbacked)
        && !repair
        && (takeover.is_some() || matches!(verdict, Verdict::Keep(_)))
    {
        return Planned::Change(ChangeAction::DetachTarget { target: target.clone(), why });
    }
    if let Some(step) = takeover.filter(|_| !repair) {
        return match (step, MarkSeen::of(record)) {
            (TakeoverStep::LeaveToAgents, _) => Planned::Keep(STICKY_TAKEOVER),
            (TakeoverStep::Abort, _) => Planned::Change(ChangeAction::AbortTakeover),
            (TakeoverStep::AnswerForAgent, Some(mark)) => Planned::Change(ChangeAction::AnswerTakeover {
                detached: !crate::ipam::blocks::may_be_attached(record),
                mark,
            }),
            // A takeover step exists only for a record carrying a takeover mark.
            (TakeoverStep::AnswerForAgent, None) => Planned::Keep(STICKY_TAKEOVER),
            (TakeoverStep::AnswerAt(when), _) => Planned::Trace(when),
        };
    }
    match verdict {
        Verdict::Keep(_) if handshake.is_some() => Planned::Change(ChangeAction::AbortHandshake),
        Verdict::Keep(reason) => Planned::Keep(reason.label()),
        Verdict::TraceUntil(when) => Planned::Trace(when),
        Verdict::Release { reason, delete_claim } => {
            if controller_step(handshake, via_agent) == ControllerStep::Await {
                Planned::Keep(AWAITING_AGENT)
            } else {
                Planned::Change(ChangeAction::Release { reason, delete_claim })
            }
        }
        Verdict::Repair { .. } => Planned::Repair,
    }
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
pub fn plan<'a>(
    index: &ClusterIndex,
    blocks: impl IntoIterator<Item = &'a Arc<IPBlock>>,
    now: Timestamp,
    settings: &RuleSettings,
) -> SweepPlan {
    let mut plan = SweepPlan::default();
    for block in blocks {
        let name = block.name_any();
        for (ip, record) in &block.spec.allocations {
            plan.scanned += 1;
            let verdict = index.evaluate(&name, ip, record, now, settings);
            let via_agent = index.agent_can_answer(record);
            let takeover = index.takeover_step(record, now, settings);
            let unbacked = index.target_unbacked(record, now, settings);
            match next_step(verdict, record, via_agent, takeover, unbacked) {
                Planned::Keep(reason) => *plan.kept.entry(reason).or_default() += 1,
                Planned::Trace(when) => {
                    let placeholder =
                        ChangeAction::Release { reason: ReleaseReason::TerminatingPastDeadline, delete_claim: false };
                    plan.traced.push((RecordChange::of(index, block, ip, record, placeholder), when));
                }
                Planned::Repair => {
                    // The verdict came from this very index entry, so it is there.
                    if let Some(adopter) = index.adopter(ip) {
                        let repair = ChangeAction::Repair { adopter };
                        plan.changes.push(RecordChange::of(index, block, ip, record, repair));
                    }
                }
                Planned::Change(action) => plan.changes.push(RecordChange::of(index, block, ip, record, action)),
            }
        }
    }
    plan
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::crd::IPPool;
    use crate::gc::index::Watched;
    use crate::gc::rules::NotReadyPolicy;
    use k8s_openapi::api::apps::v1::StatefulSet;
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

    fn ready_node() -> Node {
        serde_json::from_value(json!({"metadata": {"name": "n1"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}))
        .expect("node")
    }

    /// An index of `pods`, `statefulsets` and the Ready node n1.
    fn index_of(pods: &[Arc<Pod>], statefulsets: &[StatefulSet], sticky: &[String]) -> ClusterIndex {
        let node = ready_node();
        let objects = pods.iter().map(|p| Watched::Pod(p)).chain(statefulsets.iter().map(Watched::StatefulSet));
        ClusterIndex::from_objects(sticky, objects.chain([Watched::Node(&node)]))
    }

    #[test]
    fn a_sweep_releases_leaks_repairs_adopted_ips_and_keeps_live_records() {
        let blocks = [block(json!({
            "10.0.0.1": record("live", "u-live"),
            "10.0.0.2": record("gone", "u-gone"),
            "10.0.0.3": record("stale-name", "u-old"),
        }))];
        let adopter: Arc<Pod> = Arc::new(
            serde_json::from_value(json!({"metadata": {"namespace": "ns", "name": "adopter", "uid": "u-new",
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "db", "uid": "s",
                                         "controller": true}]},
                "spec": {"nodeName": "n2", "containers": []},
                "status": {"phase": "Running", "podIPs": [{"ip": "10.0.0.3"}]}}))
            .expect("pod"),
        );
        let pods = [pod("live", "u-live", "10.0.0.1"), adopter];
        let index = index_of(&pods, &[], &["StatefulSet".to_string()]);
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
                        adopter: Adopter {
                            pod: PodRef { namespace: "ns".into(), name: "adopter".into(), uid: "u-new".into() },
                            node: "n2".into(),
                            owner: Some(crate::crd::OwnerRef { kind: "StatefulSet".into(), name: "db".into() }),
                            sticky: true,
                        }
                    }
                ),
            ]
        );
    }

    #[test]
    fn a_static_pods_record_is_kept_while_its_mirror_pod_lives_whatever_the_mirrors_uid() {
        // The runtime runs a static pod under its config hash, which the ADD recorded; the
        // mirror pod carries it in `kubernetes.io/config.mirror` under a uid of its own, and
        // kubelet may recreate the mirror (a new uid) while the static pod runs on.
        let mirror = |uid: &str, hash: &str, ips: &[&str]| -> Arc<Pod> {
            Arc::new(
                serde_json::from_value(json!({"metadata": {"namespace": "ns", "name": "static-n1", "uid": uid,
                        "annotations": {crate::ipam::workload::MIRROR_POD_ANNOTATION: hash}},
                    "spec": {"nodeName": "n1", "containers": []},
                    "status": {"phase": "Running", "podIPs": ips.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>()}}))
                .expect("pod"),
            )
        };
        let cases = [
            // (the mirror pod, what the sweep does with the record naming uid "hash-1")
            (mirror("mirror-a", "hash-1", &["10.0.0.4"]), "kept: in_use"),
            (mirror("mirror-a", "hash-1", &[]), "kept: status_lags"),
            (mirror("mirror-b", "hash-1", &["10.0.0.4"]), "kept: in_use"),
            // Another static pod under the same name (its manifest changed): the record is stale.
            (mirror("mirror-c", "hash-2", &[]), "released: uid_mismatch"),
            // The same IP reported by the new static pod: adopted for its hash, never freed.
            (mirror("mirror-c", "hash-2", &["10.0.0.4"]), "repaired for hash-2"),
        ];
        for (pod, expected) in cases {
            let plan = planned(json!({"10.0.0.4": record("static-n1", "hash-1")}), std::slice::from_ref(&pod));
            let got = match plan.changes.first().map(|c| &c.action) {
                None => format!("kept: {}", plan.kept.keys().next().copied().unwrap_or_default()),
                Some(ChangeAction::Release { reason, .. }) => format!("released: {}", reason.label()),
                Some(ChangeAction::Repair { adopter }) => format!("repaired for {}", adopter.pod.uid),
                Some(other) => format!("{other:?}"),
            };
            assert_eq!(got, expected, "{:?}", pod.metadata);
        }
    }

    fn marked(mut record: serde_json::Value, state: &str) -> serde_json::Value {
        record["releaseHandshake"] = json!({"state": state, "markedAt": "2026-01-01T00:00:00Z", "reason": "pod_gone"});
        record
    }

    fn planned(allocations: serde_json::Value, pods: &[Arc<Pod>]) -> SweepPlan {
        let index = index_of(pods, &[], &[]);
        let settings = RuleSettings { additional_delay: Duration::ZERO, not_ready: NotReadyPolicy::Keep };
        plan(&index, &[block(allocations)], Timestamp::now(), &settings)
    }

    #[test]
    fn a_leak_on_a_ready_node_waits_for_its_agent_once_marked() {
        let fresh = planned(json!({"10.0.0.2": record("gone", "u-gone")}), &[]);
        assert!(fresh.changes[0].via_agent, "n1 is Ready: the release goes through the handshake");
        let waiting = planned(json!({"10.0.0.2": marked(record("gone", "u-gone"), "marked-for-release")}), &[]);
        assert!(waiting.changes.is_empty());
        assert_eq!(waiting.kept.get(AWAITING_AGENT), Some(&1));
        let answered = planned(json!({"10.0.0.2": marked(record("gone", "u-gone"), "ready-for-release")}), &[]);
        assert!(matches!(answered.changes[0].action, ChangeAction::Release { reason: ReleaseReason::PodGone, .. }));
    }

    #[test]
    fn a_record_that_stopped_being_a_candidate_has_its_handshake_aborted() {
        let pods = [pod("live", "u-live", "10.0.0.1")];
        let plan = planned(json!({"10.0.0.1": marked(record("live", "u-live"), "marked-for-release")}), &pods);
        assert_eq!(plan.changes.len(), 1);
        assert_eq!(plan.changes[0].action, ChangeAction::AbortHandshake);
    }

    #[test]
    fn a_sticky_takeover_mark_is_left_to_the_agents_while_its_pod_waits() {
        let takeover = |node: &str, state: &str| {
            let mut r = marked(record("web-0", "u-old"), state);
            r["node"] = json!(node);
            r["sticky"] = json!(true);
            r["owner"] = json!({"kind": "StatefulSet", "name": "web"});
            r["releaseHandshake"]["takeover"] =
                json!({"pod": {"namespace": "ns", "name": "web-0", "uid": "u-new"}, "node": "n2"});
            r
        };
        let waiting: Arc<Pod> = Arc::new(
            serde_json::from_value(json!({"metadata": {"namespace": "ns", "name": "web-0", "uid": "u-new"},
                "spec": {"nodeName": "n2"}, "status": {"phase": "Pending"}}))
            .expect("pod"),
        );
        let sticky = ["StatefulSet".to_string()];
        let settings = RuleSettings { additional_delay: Duration::ZERO, not_ready: NotReadyPolicy::Keep };
        let plan_of = |record: serde_json::Value, pods: &[Arc<Pod>]| {
            let index = index_of(pods, &[], &sticky);
            plan(&index, &[block(json!({"10.0.0.7": record}))], Timestamp::now(), &settings)
        };
        for state in ["marked-for-release", "ready-for-release"] {
            let left = plan_of(takeover("n1", state), std::slice::from_ref(&waiting));
            assert!(left.changes.is_empty(), "{state}: {:?}", left.changes);
            assert_eq!(left.kept.get(STICKY_TAKEOVER), Some(&1), "{state}");
        }
        let stale = plan_of(takeover("n1", "marked-for-release"), &[]);
        assert_eq!(stale.changes[0].action, ChangeAction::AbortTakeover, "the waiting pod is gone");
        let mut elsewhere = (*waiting).clone();
        elsewhere.spec.get_or_insert_default().node_name = Some("n3".into());
        let forged = plan_of(takeover("deleted-node", "marked-for-release"), &[Arc::new(elsewhere)]);
        assert_eq!(forged.changes[0].action, ChangeAction::AbortTakeover, "the waiting pod is not where the mark says");
        let answered = plan_of(takeover("deleted-node", "marked-for-release"), std::slice::from_ref(&waiting));
        let ChangeAction::AnswerTakeover { detached, mark } = &answered.changes[0].action else {
            panic!("a deleted node cannot answer: {:?}", answered.changes[0].action);
        };
        assert!(!detached);
        assert_eq!((mark.claimant.pod.uid.as_str(), mark.claimant.node.as_str()), ("u-new", "n2"), "the mark checked");
    }

    #[test]
    fn a_kept_vm_record_has_its_migration_target_detached_once_no_launcher_of_the_vm_backs_it() {
        use crate::ipam::workload::KUBEVIRT_VMI_KIND;
        let launcher = |name: &str, uid: &str, node: &str, vmi: &str| -> Arc<Pod> {
            Arc::new(
                serde_json::from_value(json!({"metadata": {"namespace": "ns", "name": name, "uid": uid,
                    "ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": KUBEVIRT_VMI_KIND, "name": vmi,
                                         "uid": "vmi-uid", "controller": true}]},
                    "spec": {"nodeName": node}, "status": {"phase": "Running", "podIPs": [{"ip": "10.0.0.7"}]}}))
                .expect("pod"),
            )
        };
        let mut vm = record("virt-launcher-vm1-src", "u-src");
        vm["sticky"] = json!(true);
        vm["owner"] = json!({"kind": KUBEVIRT_VMI_KIND, "name": "vm1"});
        vm["migrationTarget"] = json!({"migrationUid": "m1", "node": "n2", "containerId": "c2", "interface": "eth0",
                                       "pod": {"namespace": "ns", "name": "virt-launcher-vm1-dst", "uid": "u-dst"}});
        let source = launcher("virt-launcher-vm1-src", "u-src", "n1", "vm1");
        let sticky = [KUBEVIRT_VMI_KIND.to_string()];
        let settings = RuleSettings { additional_delay: Duration::ZERO, not_ready: NotReadyPolicy::Keep };
        let plan_with = |record: &serde_json::Value, pods: &[Arc<Pod>]| {
            plan(&index_of(pods, &[], &sticky), &[block(json!({"10.0.0.7": record}))], Timestamp::now(), &settings)
        };
        let target: crate::crd::MigrationTarget =
            serde_json::from_value(vm["migrationTarget"].clone()).expect("target");
        let detach = |why| ChangeAction::DetachTarget { target: target.clone(), why };
        let actions = |plan: &SweepPlan| plan.changes.iter().map(|c| c.action.clone()).collect::<Vec<_>>();
        let forged = plan_with(&vm, std::slice::from_ref(&source));
        assert_eq!(actions(&forged), [detach("target_pod_gone")], "no pod backs it");
        let real = launcher("virt-launcher-vm1-dst", "u-dst", "n2", "vm1");
        let migrating = plan_with(&vm, &[source.clone(), real]);
        assert!(
            migrating.changes.is_empty(),
            "a live launcher of the VM on the target's node: {:?}",
            migrating.changes
        );
        let of_another_vm = launcher("virt-launcher-vm1-dst", "u-dst", "n2", "vm2");
        let decoy = plan_with(&vm, &[source.clone(), of_another_vm]);
        assert_eq!(actions(&decoy), [detach("target_pod_not_the_vms")], "another VM's pod");

        // The VM's reservation, which a new launcher on n3 marked for a takeover: the target goes
        // first, as the take cannot complete while another node's target is attached.
        let mut reservation = vm.clone();
        reservation["containerId"] = json!("");
        reservation["releaseHandshake"] = json!({"state": "ready-for-release", "markedAt": "2026-01-01T00:00:00Z",
            "reason": "sticky takeover", "takeover": {"pod": {"namespace": "ns", "name": "virt-launcher-vm1-new",
            "uid": "u-new"}, "node": "n3"}});
        let mut waiting = (*launcher("virt-launcher-vm1-new", "u-new", "n3", "vm1")).clone();
        waiting.status = None;
        let waiting = Arc::new(waiting);
        let restarting = plan_with(&reservation, std::slice::from_ref(&waiting));
        assert_eq!(actions(&restarting), [detach("target_pod_gone")], "the takeover waits on the target");
    }

    #[test]
    fn a_sticky_reservation_in_a_retired_block_goes_with_its_pod() {
        let mut reservation = record("web-0", "u-old");
        reservation["sticky"] = json!(true);
        reservation["owner"] = json!({"kind": "StatefulSet", "name": "web"});
        let web: StatefulSet = serde_json::from_value(json!({
            "metadata": {"namespace": "ns", "name": "web"}, "spec": {"replicas": 1, "serviceName": "web",
            "selector": {}, "template": {}}}))
        .expect("sts");
        let sticky = ["StatefulSet".to_string()];
        let mut index = index_of(&[], &[web], &sticky);
        let settings = RuleSettings { additional_delay: Duration::ZERO, not_ready: NotReadyPolicy::Keep };
        let blocks = [block(json!({"10.0.0.7": reservation}))];
        let pool: Arc<IPPool> = Arc::new(
            serde_json::from_value(json!({"apiVersion": "ipwarden.io/v1alpha1", "kind": "IPPool",
                "metadata": {"name": "p"}, "spec": {"cidr": "10.0.0.0/16", "blockSize": 24}}))
            .expect("pool"),
        );
        index.apply(Watched::Pool(&pool));
        index.apply(Watched::Block(&blocks[0]));
        let kept = plan(&index, &blocks, Timestamp::now(), &settings);
        assert_eq!(kept.kept.get("sticky_reservation"), Some(&1), "a live pool keeps the reservation");
        index.delete(Watched::Pool(&pool));
        let released = plan(&index, &blocks, Timestamp::now(), &settings);
        assert!(
            matches!(released.changes[0].action, ChangeAction::Release { reason: ReleaseReason::PodGone, .. }),
            "{:?}",
            released.changes
        );
    }

    #[test]
    fn a_record_on_a_deleted_node_is_released_without_asking() {
        let mut gone = record("gone", "u-gone");
        gone["node"] = json!("deleted-node");
        let plan = planned(json!({"10.0.0.2": marked(gone, "marked-for-release")}), &[]);
        assert!(!plan.changes[0].via_agent);
        assert!(matches!(plan.changes[0].action, ChangeAction::Release { reason: ReleaseReason::NodeDeleted, .. }));
    }
}
