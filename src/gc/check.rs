//! The consistency report behind `ipwarden check` (and the chaos suites' invariant checker):
//! what in the cluster's IPAM state breaks an invariant right now. Pure over a snapshot.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde::Serialize;

use super::index::{ClusterIndex, PodFacts};
use super::rules::{RuleSettings, Verdict};
use crate::crd::{IPBlock, IPClaim, IPPool};
use crate::ipam::pools;

/// One kind of inconsistency.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ProblemKind {
    /// Two live pods report the same IP (invariant 1).
    Conflict,
    /// A record the GC would release: its pod is gone, replaced or finished (invariant 3).
    LeakedRecord,
    /// A record naming another UID than the live pod that reports its IP (to be repaired).
    WrongUid,
    /// A live pod reports an IP of a pool that has no record for it.
    UnrecordedPodIp,
    /// A claim whose IPs have no record for its pod.
    ClaimWithoutRecord,
    /// A pool's status counts differ from its records.
    CountDrift,
    /// A pool's ranges name its defaulted gateway, which it never hands out: it holds one IP
    /// fewer than its ranges say ([`pools::gateway_withheld_from_ranges`]).
    GatewayInRanges,
}

/// One inconsistency.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Problem {
    /// What kind.
    pub kind: ProblemKind,
    /// The object it concerns (an IP, a pod, a claim or a pool).
    pub subject: String,
    /// What exactly is wrong.
    pub detail: String,
}

/// A snapshot to check.
pub struct Snapshot<'a> {
    /// Every pod.
    pub pods: &'a [Arc<Pod>],
    /// Every pool.
    pub pools: &'a [Arc<IPPool>],
    /// Every block.
    pub blocks: &'a [Arc<IPBlock>],
    /// Every claim.
    pub claims: &'a [Arc<IPClaim>],
    /// The index built from the same snapshot.
    pub index: &'a ClusterIndex,
}

/// The IPs that more than one pod reports (invariant 1 broken), with those pods'
/// `namespace/name`. A terminating pod still holds what it reports until it is gone (it
/// serves through its grace period); finished pods and host-network pods (which report the
/// node's IP) do not count. The one sharing by design is exempt: a KubeVirt live migration's
/// source and target, as the IP's record names them (its pod and its `migrationTarget`).
pub fn conflicts<'a>(
    pods: impl IntoIterator<Item = &'a PodFacts>,
    blocks: impl IntoIterator<Item = &'a Arc<IPBlock>>,
) -> BTreeMap<String, Vec<String>> {
    let mut holders: BTreeMap<&str, Vec<(String, &str)>> = BTreeMap::new();
    for pod in pods {
        if pod.finished() || pod.host_network {
            continue;
        }
        for ip in &pod.ips {
            holders.entry(ip).or_default().push((format!("{}/{}", pod.namespace, pod.name), &pod.uid));
        }
    }
    holders.retain(|_, pods| pods.len() > 1);
    if !holders.is_empty() {
        let migrating: HashMap<&str, (&str, &str)> = blocks
            .into_iter()
            .flat_map(|b| b.spec.allocations.iter())
            .filter_map(|(ip, r)| {
                Some((ip.as_str(), (r.pod.uid.as_str(), r.migration_target.as_ref()?.pod.uid.as_str())))
            })
            .collect();
        holders.retain(|ip, pods| {
            let by_design = migrating
                .get(ip)
                .is_some_and(|(source, target)| pods.iter().all(|(_, uid)| uid == source || uid == target));
            !by_design
        });
    }
    holders
        .into_iter()
        .map(|(ip, pods)| {
            let mut names: Vec<String> = pods.into_iter().map(|(pod, _)| pod).collect();
            names.sort();
            (ip.to_string(), names)
        })
        .collect()
}

/// Every problem of the snapshot at `now`, sorted by kind and subject.
pub fn check(snapshot: &Snapshot<'_>, now: Timestamp, settings: &RuleSettings) -> Vec<Problem> {
    let mut problems = Vec::new();
    let pod_facts: Vec<PodFacts> = snapshot.pods.iter().map(|p| PodFacts::of(p)).collect();
    for (ip, pods) in conflicts(&pod_facts, snapshot.blocks) {
        problems.push(Problem {
            kind: ProblemKind::Conflict,
            subject: ip,
            detail: format!("held by {}", pods.join(", ")),
        });
    }
    let mut records: HashMap<&str, (&str, &crate::crd::Allocation)> = HashMap::new();
    let mut per_pool: BTreeMap<&str, i64> = BTreeMap::new();
    for block in snapshot.blocks {
        *per_pool.entry(&block.spec.pool).or_default() +=
            i64::try_from(block.spec.allocations.len()).unwrap_or(i64::MAX);
        for (ip, record) in &block.spec.allocations {
            records.insert(ip, (&block.spec.pool, record));
            let pod = format!("{}/{} (uid {})", record.pod.namespace, record.pod.name, record.pod.uid);
            match snapshot.index.evaluate(&block.name_any(), ip, record, now, settings) {
                Verdict::Release { reason, .. } => problems.push(Problem {
                    kind: ProblemKind::LeakedRecord,
                    subject: ip.clone(),
                    detail: format!("recorded for {pod}: {}", reason.label()),
                }),
                Verdict::Repair { uid } => problems.push(Problem {
                    kind: ProblemKind::WrongUid,
                    subject: ip.clone(),
                    detail: format!("recorded for {pod} but reported by the pod with uid {uid}"),
                }),
                Verdict::Keep(_) | Verdict::TraceUntil(_) => {}
            }
        }
    }
    for pool in snapshot.pools {
        if let Some(why) = pools::gateway_withheld_from_ranges(&pool.spec) {
            problems.push(Problem { kind: ProblemKind::GatewayInRanges, subject: pool.name_any(), detail: why });
        }
    }
    let layouts: Vec<_> =
        snapshot.pools.iter().filter_map(|p| Some((p.name_any(), pools::layout(&p.spec).ok()?))).collect();
    // A node's spare that its pod reports: the agent writes the record right after the ADD.
    let spares: HashMap<String, &str> = snapshot
        .blocks
        .iter()
        .filter_map(|b| Some((b, b.spec.affinity.as_deref()?)))
        .flat_map(|(b, node)| crate::ipam::spares::bindable(&b.spec).into_iter().map(move |ip| (ip.to_string(), node)))
        .collect();
    for facts in &pod_facts {
        if facts.terminal() || facts.host_network {
            continue;
        }
        for ip in &facts.ips {
            let Ok(addr) = ip.parse() else { continue };
            let Some((pool, _)) = layouts.iter().find(|(_, l)| l.contains(addr)) else { continue };
            let bound_spare = spares.get(ip.as_str()) == Some(&facts.node.as_str());
            if !bound_spare
                && records.get(ip.as_str()).is_none_or(|(_, r)| !crate::ipam::blocks::names_pod(r, &facts.uid))
            {
                problems.push(Problem {
                    kind: ProblemKind::UnrecordedPodIp,
                    subject: ip.clone(),
                    detail: format!(
                        "pod {}/{} reports it, pool {pool} has no record for that pod",
                        facts.namespace, facts.name
                    ),
                });
            }
        }
    }
    for claim in snapshot.claims {
        for claimed in claim.spec.interfaces.iter().flat_map(|i| i.ips.iter()) {
            if records.get(claimed.ip.as_str()).is_none_or(|(_, r)| r.pod.uid != claim.spec.pod_uid) {
                problems.push(Problem {
                    kind: ProblemKind::ClaimWithoutRecord,
                    subject: format!("{}/{}", claim.namespace().unwrap_or_default(), claim.name_any()),
                    detail: format!(
                        "claims {} for uid {} but no record holds it for that uid",
                        claimed.ip, claim.spec.pod_uid
                    ),
                });
            }
        }
    }
    for pool in snapshot.pools {
        let Some(status) = pool.status.as_ref().filter(|s| s.total > 0) else { continue };
        // Counts of other blocks than these (written before the latest change, or by a leader
        // that has not yet recounted) say nothing about drift.
        let blocks_now = crate::ipam::blocks::pool_fingerprint(snapshot.blocks, &pool.name_any());
        if status.counted_blocks.as_deref() != Some(blocks_now.as_str()) {
            continue;
        }
        let counted = per_pool.get(pool.name_any().as_str()).copied().unwrap_or(0);
        if status.allocated != counted {
            problems.push(Problem {
                kind: ProblemKind::CountDrift,
                subject: pool.name_any(),
                detail: format!("status says {} allocated, the blocks hold {counted} records", status.allocated),
            });
        }
    }
    problems.sort_by(|a, b| (a.kind, &a.subject).cmp(&(b.kind, &b.subject)));
    problems
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::gc::rules::NotReadyPolicy;
    use serde_json::json;
    use std::time::Duration;

    fn pod(name: &str, uid: &str, ip: &str) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(json!({"metadata": {"namespace": "ns", "name": name, "uid": uid},
                "status": {"phase": "Running", "podIPs": [{"ip": ip}]}}))
            .expect("pod"),
        )
    }

    fn block(records: serde_json::Value) -> Arc<IPBlock> {
        Arc::new(
            serde_json::from_value(json!({"apiVersion": "ipwarden.io/v1alpha1", "kind": "IPBlock",
                "metadata": {"name": "p-10-0-0-0-24"}, "spec": {"pool": "p", "cidr": "10.0.0.0/24", "allocations": records}}))
            .expect("block"),
        )
    }

    fn record(name: &str, uid: &str) -> serde_json::Value {
        json!({"pod": {"namespace": "ns", "name": name, "uid": uid}, "node": "", "network": "ipwarden",
               "containerId": "c", "interface": "eth0", "allocatedAt": "2026-01-01T00:00:00Z"})
    }

    fn pool(allocated: i64, counted_blocks: &str) -> Arc<IPPool> {
        Arc::new(
            serde_json::from_value(
                json!({"apiVersion": "ipwarden.io/v1alpha1", "kind": "IPPool", "metadata": {"name": "p"},
                "spec": {"cidr": "10.0.0.0/24"},
                "status": {"total": 254, "allocated": allocated, "countedBlocks": counted_blocks}}),
            )
            .expect("pool"),
        )
    }

    fn facts(pods: &[Arc<Pod>]) -> Vec<PodFacts> {
        pods.iter().map(|p| PodFacts::of(p)).collect()
    }

    fn index_of(pods: &[Arc<Pod>], sticky: &[String]) -> ClusterIndex {
        ClusterIndex::from_objects(sticky, pods.iter().map(|p| crate::gc::index::Watched::Pod(p)))
    }

    fn kinds(problems: &[Problem]) -> Vec<(ProblemKind, &str)> {
        problems.iter().map(|p| (p.kind, p.subject.as_str())).collect()
    }

    fn launcher(name: &str, uid: &str, vmi: &str) -> Arc<Pod> {
        Arc::new(
            serde_json::from_value(json!({"metadata": {"namespace": "ns", "name": name, "uid": uid,
                "ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "name": vmi,
                                     "uid": "vmi", "controller": true}]},
                "status": {"phase": "Running", "podIPs": [{"ip": "10.0.0.1"}]}}))
            .expect("launcher pod"),
        )
    }

    #[test]
    fn a_live_migrations_source_and_target_sharing_the_vm_ip_is_no_problem() {
        let settings = RuleSettings { additional_delay: Duration::ZERO, not_ready: NotReadyPolicy::Keep };
        let pods = [launcher("virt-launcher-vm1-a", "src", "vm1"), launcher("virt-launcher-vm1-b", "dst", "vm1")];
        let mut migrating = record("virt-launcher-vm1-a", "src");
        migrating["owner"] = json!({"kind": "VirtualMachineInstance", "name": "vm1"});
        migrating["sticky"] = json!(true);
        migrating["migrationTarget"] = json!({"migrationUid": "m1", "node": "", "containerId": "c2", "interface": "eth0",
            "pod": {"namespace": "ns", "name": "virt-launcher-vm1-b", "uid": "dst"}});
        let blocks = [block(json!({"10.0.0.1": migrating}))];
        let pools = [pool(1, &crate::ipam::blocks::pool_fingerprint(&blocks, "p"))];
        let sticky = vec!["VirtualMachineInstance".to_string()];
        for order in [[0, 1], [1, 0]] {
            let pods = [pods[order[0]].clone(), pods[order[1]].clone()];
            let index = index_of(&pods, &sticky);
            let snapshot = Snapshot { pods: &pods, pools: &pools, blocks: &blocks, claims: &[], index: &index };
            assert_eq!(kinds(&check(&snapshot, Timestamp::now(), &settings)), vec![], "pods in order {order:?}");
        }
        let strangers = [launcher("virt-launcher-vm1-a", "src", "vm1"), launcher("virt-launcher-vm2-a", "x", "vm2")];
        assert_eq!(conflicts(&facts(&strangers), &blocks).len(), 1, "launchers of two VMs on one IP conflict");
        let third = [pods[0].clone(), launcher("virt-launcher-vm1-c", "other", "vm1")];
        assert_eq!(conflicts(&facts(&third), &blocks).len(), 1, "a launcher the record does not name conflicts");
        assert_eq!(conflicts(&facts(&pods), &[]).len(), 1, "without a record naming both, sharing is a conflict");
    }

    #[test]
    fn a_consistent_cluster_has_no_problem_and_each_break_is_reported() {
        let settings = RuleSettings { additional_delay: Duration::ZERO, not_ready: NotReadyPolicy::Keep };
        let good_pods = [pod("a", "ua", "10.0.0.1")];
        let good_blocks = [block(json!({"10.0.0.1": record("a", "ua")}))];
        let pools = [pool(1, &crate::ipam::blocks::pool_fingerprint(&good_blocks, "p"))];
        let index = index_of(&good_pods, &[]);
        let snapshot = Snapshot { pods: &good_pods, pools: &pools, blocks: &good_blocks, claims: &[], index: &index };
        assert!(check(&snapshot, Timestamp::now(), &settings).is_empty());

        let pods = [pod("a", "ua", "10.0.0.1"), pod("b", "ub", "10.0.0.1"), pod("c", "uc", "10.0.0.3")];
        let blocks = [block(json!({"10.0.0.1": record("a", "ua"), "10.0.0.2": record("gone", "ug")}))];
        let pools = [pool(1, &crate::ipam::blocks::pool_fingerprint(&blocks, "p"))];
        let index = index_of(&pods, &[]);
        let snapshot = Snapshot { pods: &pods, pools: &pools, blocks: &blocks, claims: &[], index: &index };
        let problems = check(&snapshot, Timestamp::now(), &settings);
        assert_eq!(
            kinds(&problems),
            vec![
                (ProblemKind::Conflict, "10.0.0.1"),
                (ProblemKind::LeakedRecord, "10.0.0.2"),
                (ProblemKind::UnrecordedPodIp, "10.0.0.1"),
                (ProblemKind::UnrecordedPodIp, "10.0.0.3"),
                (ProblemKind::CountDrift, "p"),
            ]
        );
    }

    #[test]
    fn counts_are_judged_only_against_the_blocks_they_were_taken_from() {
        let settings = RuleSettings { additional_delay: Duration::ZERO, not_ready: NotReadyPolicy::Keep };
        let pods = [pod("a", "ua", "10.0.0.1")];
        let before = [block(json!({}))];
        let mut after = (*block(json!({"10.0.0.1": record("a", "ua")}))).clone();
        after.metadata.resource_version = Some("2".into());
        let after = [Arc::new(after)];
        let index = index_of(&pods, &[]);
        let stale = [pool(0, &crate::ipam::blocks::pool_fingerprint(&before, "p"))];
        let snapshot = Snapshot { pods: &pods, pools: &stale, blocks: &after, claims: &[], index: &index };
        assert!(check(&snapshot, Timestamp::now(), &settings).is_empty(), "a status of older blocks is not drift");
        let wrong = [pool(0, &crate::ipam::blocks::pool_fingerprint(&after, "p"))];
        let snapshot = Snapshot { pods: &pods, pools: &wrong, blocks: &after, claims: &[], index: &index };
        assert_eq!(kinds(&check(&snapshot, Timestamp::now(), &settings)), vec![(ProblemKind::CountDrift, "p")]);
    }

    #[test]
    fn a_terminating_pod_still_holds_its_ip_and_a_finished_one_does_not() {
        let with = |name: &str, phase: &str, deletion: Option<&str>| -> Arc<Pod> {
            let value = json!({"metadata": {"namespace": "ns", "name": name, "uid": name, "deletionTimestamp": deletion},
                "status": {"phase": phase, "podIPs": [{"ip": "10.0.0.9"}]}});
            Arc::new(serde_json::from_value(value).expect("pod"))
        };
        let draining = with("draining", "Running", Some("2026-01-01T00:00:00Z"));
        let done = with("done", "Succeeded", None);
        let newcomer = with("newcomer", "Running", None);
        let found = conflicts(&facts(&[draining, newcomer.clone()]), &[]);
        assert_eq!(found.get("10.0.0.9"), Some(&vec!["ns/draining".to_string(), "ns/newcomer".to_string()]));
        assert!(conflicts(&facts(&[done, newcomer]), &[]).is_empty(), "a finished pod holds nothing");
    }
}
