//! Pure rules for the claim janitor: is an IPClaim's workload gone for good, is the claim's
//! binding in effect, so that the controller writes it down as witnessed, and which live
//! sticky pods lack the claim the controller then creates?

use std::collections::HashMap;

use kube::ResourceExt;

use super::index::{ClaimBinding, ClaimFacts, ClusterIndex, PodFacts};
use super::rules::Phase;
use crate::crd::{ClaimedIp, OwnerRef};
use crate::ipam::workload::{self, Claimant, KUBEVIRT_VMI_KIND};

/// Whether `claim` (in `namespace`, named `name`) can be deleted. A claim no ADD reads back
/// goes once its pod is gone, replaced or completed (Job pods included): a stateless one
/// (`sticky: false`, an older version's; decision 0015) or one whose owner kind is no longer
/// in the sticky kinds, whose pods neither rebind nor delete it. Otherwise: a StatefulSet
/// pod's once it is gone or completed and its StatefulSet no longer wants the ordinal; a
/// KubeVirt VM's (`vm.<VM>`, which outlives its launcher pods) once the VM no longer wants it,
/// by the same rule as its records ([`ClusterIndex::wants`]: kept while the controller does
/// not watch KubeVirt). A claim the controller witnessed with its owner is judged by that
/// witness (its pod's UID and owner, sticky), not by its spec, which another node's agent may
/// rewrite (rule C-1) to make the claim look gone.
pub fn gone_for_good(index: &ClusterIndex, namespace: &str, name: &str, claim: &ClaimFacts) -> bool {
    let (pod_uid, sticky, owner) = match &claim.witnessed {
        Some(w) if w.owner.is_some() => (&w.pod_uid, true, w.owner.as_ref()),
        _ => (&claim.pod_uid, claim.sticky, claim.owner.as_ref()),
    };
    let pod = index.pod(namespace, name);
    let pod_done = match pod {
        None => true,
        Some(p) => p.uid != *pod_uid || p.phase == Phase::Completed,
    };
    let read_back = |o: &&OwnerRef| sticky && workload::is_sticky(Some(o), index.sticky_kinds());
    let Some(owner) = owner.filter(read_back) else {
        return pod_done;
    };
    if owner.kind == KUBEVIRT_VMI_KIND {
        return !index.wants(namespace, owner, name);
    }
    // A recreated StatefulSet pod (another UID) takes the claim over in its ADD: not gone.
    let replaced_by_same_ordinal = pod.is_some_and(|p| p.uid != *pod_uid && p.phase != Phase::Completed);
    !index.wants(namespace, owner, name) && pod_done && !replaced_by_same_ordinal
}

/// The live pods of sticky owners by namespace and claim name ([`workload::claim_name`]):
/// the pods whose bindings [`witness`] may write down, found once for all claims.
pub fn claimants(index: &ClusterIndex) -> HashMap<(String, String), Vec<&PodFacts>> {
    let mut claimants: HashMap<(String, String), Vec<&PodFacts>> = HashMap::new();
    for pod in index.pods().filter(|p| !p.terminal() && workload::is_sticky(p.owner.as_ref(), index.sticky_kinds())) {
        let name = workload::claim_name(&pod.name, pod.owner.as_ref());
        claimants.entry((pod.namespace.clone(), name)).or_default().push(pod);
    }
    claimants
}

/// The binding of claim `claim` (in `namespace`, named `name`) to write down as witnessed
/// (`status.witnessed`) and as its spec, when either differs from it ([`spec_lags`]): the IPs the block records give
/// the claim's own live pod of a sticky owner kind on its node
/// ([`workload::recorded_interfaces`], among `claimants`), whatever the claim's spec says
/// (even `sticky: false`, which an older version wrote and another node's agent may write),
/// with what the earlier witness listed while a sticky record of the claim still holds it.
/// None when no such pod holds a record of the claim, or two do (a VM's two launcher pods,
/// each with records of their own). A node's agent may rewrite a claim's spec (rule C-1) and
/// add records naming itself, but the claim's pod runs where the scheduler put it and only
/// that node writes records naming it there (decision 0022), so the witness is what the
/// workload's pod really holds.
pub fn witness(
    index: &ClusterIndex,
    claimants: &HashMap<(String, String), Vec<&PodFacts>>,
    namespace: &str,
    name: &str,
    claim: &ClaimFacts,
) -> Option<ClaimBinding> {
    let before = claim.witnessed.as_ref().map_or(&[][..], |w| w.interfaces.as_slice());
    let pods = claimants.get(&(namespace.to_string(), name.to_string()))?;
    let mut bindings = pods.iter().filter_map(|pod| {
        let owner = pod.owner.as_ref()?;
        let records = index.records_of(&pod.uid).map(|(block, ip, record)| {
            (ClaimedIp { ip: ip.to_string(), pool: block.spec.pool.clone(), block: block.name_any() }, record)
        });
        let claimant = Claimant { namespace, claim: name, uid: &pod.uid, node: &pod.node, owner };
        let reserved = |c: &ClaimedIp| {
            index.block(&c.block).is_some_and(|b| {
                b.spec.pool == c.pool
                    && b.spec.allocations.get(&c.ip).is_some_and(|r| {
                        r.sticky
                            && r.pod.namespace == namespace
                            && workload::claim_name(&r.pod.name, r.owner.as_ref()) == name
                    })
            })
        };
        let interfaces = workload::recorded_interfaces(claimant, records, &claim.interfaces, before, reserved)?;
        Some(ClaimBinding { pod_uid: pod.uid.clone(), node: pod.node.clone(), owner: Some(owner.clone()), interfaces })
    });
    let binding = bindings.next()?;
    if bindings.next().is_some() {
        return None;
    }
    (claim.witnessed.as_ref() != Some(&binding) || spec_lags(claim, &binding)).then_some(binding)
}

/// Whether `claim`'s spec says other than `binding`, the binding in effect: the controller
/// writes the spec too (decision 0022), so that what `kubectl get ipc` shows, what an older
/// version's agents read during an upgrade and what a rule reading the spec judges follow the
/// records, whoever wrote the spec before.
pub fn spec_lags(claim: &ClaimFacts, binding: &ClaimBinding) -> bool {
    !claim.sticky
        || claim.pod_uid != binding.pod_uid
        || claim.node != binding.node
        || claim.owner != binding.owner
        || claim.interfaces != binding.interfaces
}

/// A claim to create: its namespace, its name and the binding it is created with.
pub type Missing = (String, String, ClaimBinding);

/// The claims the controller creates (decision 0022: the controller writes the claims): each
/// claim name among `claimants` that no IPClaim has, whose one live pod reports an IP, whose
/// records give it a binding ([`witness`]) holding every IP it reports from a pool's CIDR, and
/// whose owner still wants it ([`ClusterIndex::wants`]: not a StatefulSet ordinal being scaled
/// away, nor one whose set is not in the cache yet), with that binding, written as the new
/// claim's spec and then as its witness. A live sticky pod lacks its claim when someone
/// deleted it, or `ipwarden adopt` wrote none; without one, its next life would start on new
/// IPs. The reported IPs make sure the pod's ADD is over (the kubelet reports them once every
/// network's ADD returned; a failed ADD takes its records back, and a claim created
/// meanwhile would outlive them) and, as `ipwarden adopt` requires, that no pool IP
/// the pod uses on its own network would be left out of its claim. An IP outside every pool is
/// another IPAM's (ipwarden serving only a secondary network, whose IPs the pod does not
/// report). Sorted by namespace and name.
pub fn missing(index: &ClusterIndex, claimants: &HashMap<(String, String), Vec<&PodFacts>>) -> Vec<Missing> {
    let cidrs: Vec<ipnet::IpNet> = index.pools().iter().filter_map(|p| p.spec.cidr.parse().ok()).collect();
    let reported_all = |pods: &[&PodFacts], binding: &ClaimBinding| {
        // Compared as addresses: the kubelet and the records may spell an IPv6 differently.
        let address = |ip: &str| ip.parse::<std::net::IpAddr>().ok();
        let pooled = |ip: &&String| address(ip).is_some_and(|ip| cidrs.iter().any(|c| c.contains(&ip)));
        let recorded =
            |ip: &String| binding.interfaces.iter().flat_map(|i| &i.ips).any(|c| address(&c.ip) == address(ip));
        pods.iter()
            .find(|p| p.uid == binding.pod_uid)
            .is_some_and(|p| !p.ips.is_empty() && p.ips.iter().filter(pooled).all(recorded))
    };
    let mut missing: Vec<Missing> = claimants
        .iter()
        .filter(|((namespace, name), _)| index.claim(namespace, name).is_none())
        .filter_map(|((namespace, name), pods)| {
            let binding = witness(index, claimants, namespace, name, &ClaimFacts::default())?;
            let wanted = binding.owner.as_ref().is_some_and(|owner| index.wants(namespace, owner, name));
            (wanted && reported_all(pods, &binding)).then(|| (namespace.clone(), name.clone(), binding))
        })
        .collect();
    missing.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
    missing
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::crd::ClaimedInterface;
    use crate::gc::index::{Kind, Watched};
    use jiff::Timestamp;
    use k8s_openapi::api::apps::v1::StatefulSet;
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::DynamicObject;
    use kube::core::PartialObjectMeta;
    use serde_json::json;

    fn claim(uid: &str, sticky: bool, owner: Option<(&str, &str)>) -> ClaimFacts {
        ClaimFacts {
            object_uid: "claim-uid".into(),
            pod_uid: uid.into(),
            node: "node-0".into(),
            sticky,
            owner: owner.map(|(kind, name)| OwnerRef { kind: kind.into(), name: name.into() }),
            interfaces: Vec::new(),
            witnessed: None,
        }
    }

    fn with_pod(uid: &str, phase: &str) -> ClusterIndex {
        let pod: Pod = serde_json::from_value(json!({"metadata": {"namespace": "ns", "name": "web-1", "uid": uid},
            "status": {"phase": phase}}))
        .expect("pod");
        ClusterIndex::from_objects(&[], [Watched::Pod(&pod)])
    }

    fn statefulset(replicas: i32) -> StatefulSet {
        serde_json::from_value(json!({"metadata": {"namespace": "ns", "name": "web"},
            "spec": {"replicas": replicas, "serviceName": "web", "selector": {}, "template": {}}}))
        .expect("sts")
    }

    #[test]
    fn a_stateless_claim_goes_with_its_pod_its_replacement_or_its_completion() {
        let c = claim("u1", false, Some(("Job", "batch")));
        assert!(gone_for_good(&ClusterIndex::default(), "ns", "web-1", &c), "pod gone");
        assert!(gone_for_good(&with_pod("u2", "Running"), "ns", "web-1", &c), "replaced");
        assert!(gone_for_good(&with_pod("u1", "Succeeded"), "ns", "web-1", &c), "completed Job pod");
        assert!(!gone_for_good(&with_pod("u1", "Running"), "ns", "web-1", &c), "still running");
    }

    fn sticky_kinds() -> Vec<String> {
        vec!["StatefulSet".into(), KUBEVIRT_VMI_KIND.into()]
    }

    #[test]
    fn a_claim_no_pod_reads_back_goes_with_its_pod_whatever_its_owner_wants() {
        let (vms, statefulsets) = (KUBEVIRT_VMI_KIND, "StatefulSet");
        // (claim's owner kind, its `sticky` flag, the one sticky kind, its pod, gone?, case)
        let cases = [
            (statefulsets, true, vms, Some(("u2", "Running")), true, "owner kind taken off, pod replaced"),
            (statefulsets, true, vms, None, true, "owner kind taken off, pod gone"),
            (statefulsets, true, vms, Some(("u1", "Running")), false, "owner kind taken off, pod runs"),
            (statefulsets, true, statefulsets, Some(("u2", "Running")), false, "sticky: taken over"),
            (vms, false, vms, None, true, "an older version's stateless VM claim"),
            (vms, true, statefulsets, None, true, "VM kind taken off"),
        ];
        for (kind, sticky, sticky_kind, pod, gone, case) in cases {
            let (owner, name) = if kind == vms { ("vm1", "vm.vm1") } else { ("web", "web-1") };
            let pod: Option<Pod> = pod.map(|(uid, phase)| {
                serde_json::from_value(json!({"metadata": {"namespace": "ns", "name": name, "uid": uid},
                    "status": {"phase": phase}}))
                .expect("pod")
            });
            let web = statefulset(2);
            let objects = std::iter::once(Watched::StatefulSet(&web)).chain(pod.iter().map(Watched::Pod));
            let index = ClusterIndex::from_objects(&[sticky_kind.to_string()], objects);
            assert_eq!(gone_for_good(&index, "ns", name, &claim("u1", sticky, Some((kind, owner)))), gone, "{case}");
        }
    }

    #[test]
    fn a_statefulset_claim_stays_while_its_ordinal_is_wanted() {
        let c = claim("u1", true, Some(("StatefulSet", "web")));
        let mut index = ClusterIndex::new(&sticky_kinds(), std::time::Duration::from_secs(20));
        index.apply(Watched::StatefulSet(&statefulset(2)));
        assert!(!gone_for_good(&index, "ns", "web-1", &c), "ordinal 1 of 2 is wanted");
        index.apply(Watched::StatefulSet(&statefulset(1)));
        assert!(gone_for_good(&index, "ns", "web-1", &c), "scaled down below the ordinal");
        index.delete(Watched::StatefulSet(&statefulset(1)));
        assert!(gone_for_good(&index, "ns", "web-1", &c), "StatefulSet deleted");
    }

    #[test]
    fn a_vm_claim_goes_with_its_vm_and_stays_while_kubevirt_is_not_watched() {
        let c = claim("u1", true, Some((KUBEVIRT_VMI_KIND, "vm1")));
        let unwatched = ClusterIndex::from_objects(&sticky_kinds(), []);
        assert!(!gone_for_good(&unwatched, "ns", "vm.vm1", &c), "KubeVirt not watched");
        let object = |deleting: bool| -> PartialObjectMeta<DynamicObject> {
            let deletion = deleting.then(|| k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now()));
            let meta: PartialObjectMeta<DynamicObject> = serde_json::from_value(json!({"apiVersion": "kubevirt.io/v1",
                "kind": "VirtualMachine", "metadata": {"namespace": "ns", "name": "vm1", "deletionTimestamp": deletion}}))
            .expect("metadata");
            meta
        };
        let watched = |instance: Option<bool>, vm: Option<bool>| {
            let mut index = ClusterIndex::new(&sticky_kinds(), std::time::Duration::from_secs(20));
            for kind in [Kind::VirtualMachine, Kind::VirtualMachineInstance] {
                index.relist_started(kind);
            }
            if let Some(deleting) = instance {
                index.apply(Watched::VirtualMachineInstance(&object(deleting)));
            }
            if let Some(deleting) = vm {
                index.apply(Watched::VirtualMachine(&object(deleting)));
            }
            for kind in [Kind::VirtualMachine, Kind::VirtualMachineInstance] {
                index.relist_done(kind);
            }
            index
        };
        assert!(!gone_for_good(&watched(None, Some(false)), "ns", "vm.vm1", &c), "a stopped VM");
        assert!(!gone_for_good(&watched(Some(false), None), "ns", "vm.vm1", &c), "a running instance");
        assert!(gone_for_good(&watched(None, Some(true)), "ns", "vm.vm1", &c), "the VM is being deleted");
        assert!(gone_for_good(&watched(None, None), "ns", "vm.vm1", &c), "the VM is gone");
    }

    /// What the witness rows vary, each from the state where web-1's claim is in effect.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Change {
        None,
        PodGone,
        PodTerminating,
        PodOnAnotherNode,
        PodOfAnotherOwner,
        PodOfAnotherUid,
        RecordOfAnotherNode,
        RecordOfAnotherPod,
        RecordMissing,
        ClaimNamesAnotherBlock,
        ClaimNamesNoIp,
        AlreadyWitnessed,
        WitnessedSpecRewritten,
        NotSticky,
        ClaimOfAnotherPod,
        RecordsOfTwoPods,
        BlockOfAnotherPool,
        SpecLeavesARecordOut,
    }

    fn witness_with(change: Change) -> Option<ClaimBinding> {
        let mut pod = json!({"metadata": {"namespace": "ns", "name": "web-1", "uid": "u1",
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": "s",
                    "controller": true}]},
            "spec": {"nodeName": "node-0"}, "status": {"phase": "Running", "podIPs": [{"ip": "10.0.0.5"}]}});
        match change {
            Change::PodTerminating => pod["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z"),
            Change::PodOnAnotherNode => pod["spec"]["nodeName"] = json!("node-1"),
            Change::PodOfAnotherOwner => pod["metadata"]["ownerReferences"][0]["name"] = json!("other"),
            Change::PodOfAnotherUid => pod["metadata"]["uid"] = json!("u2"),
            _ => {}
        }
        let pod: Pod = serde_json::from_value(pod).expect("pod");
        let mut record = crate::ipam::blocks::test::record("u1", "c1");
        record.pod.namespace = "ns".into();
        record.pod.name = "web-1".into();
        record.sticky = true;
        record.owner = Some(OwnerRef { kind: "StatefulSet".into(), name: "web".into() });
        match change {
            Change::RecordOfAnotherNode => record.node = "node-1".into(),
            Change::RecordOfAnotherPod => record.pod.uid = "forged".into(),
            _ => {}
        }
        let mut block = json!({"apiVersion": "ipwarden.io/v1alpha1", "kind": "IPBlock", "metadata": {"name": "b"},
            "spec": {"pool": "p", "cidr": "10.0.0.0/24", "allocations": {"10.0.0.5": record}}});
        if change == Change::RecordsOfTwoPods {
            let mut other = crate::ipam::blocks::test::record("u1", "c1");
            (other.pod.namespace, other.pod.name, other.sticky) = ("ns".into(), "web-2".into(), true);
            block["spec"]["allocations"]["10.0.0.6"] = serde_json::to_value(other).expect("a record");
        }
        if change == Change::SpecLeavesARecordOut {
            let mut second = crate::ipam::blocks::test::record("u1", "c1");
            (second.pod.namespace, second.pod.name, second.sticky) = ("ns".into(), "web-1".into(), true);
            second.owner = record.owner.clone();
            block["spec"]["allocations"]["10.0.0.6"] = serde_json::to_value(second).expect("a record");
        }
        if change == Change::BlockOfAnotherPool {
            block["spec"]["pool"] = json!("q");
        }
        if change == Change::RecordMissing {
            block["spec"]["allocations"] = json!({});
        }
        let block: std::sync::Arc<crate::crd::IPBlock> =
            std::sync::Arc::new(serde_json::from_value(block).expect("block"));
        let mut objects = vec![Watched::Block(&block)];
        if change != Change::PodGone {
            objects.push(Watched::Pod(&pod));
        }
        let index = ClusterIndex::from_objects(&sticky_kinds(), objects);
        let ips = match change {
            Change::ClaimNamesAnotherBlock => {
                vec![crate::crd::ClaimedIp { ip: "10.0.0.5".into(), pool: "p".into(), block: "x".into() }]
            }
            Change::ClaimNamesNoIp => Vec::new(),
            Change::RecordsOfTwoPods => ["10.0.0.5", "10.0.0.6"]
                .map(|ip| crate::crd::ClaimedIp { ip: ip.into(), pool: "p".into(), block: "b".into() })
                .to_vec(),
            _ => vec![crate::crd::ClaimedIp { ip: "10.0.0.5".into(), pool: "p".into(), block: "b".into() }],
        };
        let mut claim = claim("u1", change != Change::NotSticky, Some(("StatefulSet", "web")));
        claim.interfaces = vec![ClaimedInterface { interface: "eth0".into(), ips }];
        if matches!(change, Change::AlreadyWitnessed | Change::WitnessedSpecRewritten) {
            claim.witnessed = Some(ClaimBinding {
                pod_uid: "u1".into(),
                node: "node-0".into(),
                owner: Some(OwnerRef { kind: "StatefulSet".into(), name: "web".into() }),
                interfaces: claim.interfaces.clone(),
            });
        }
        if change == Change::WitnessedSpecRewritten {
            (claim.pod_uid, claim.node) = ("forged".into(), "node-1".into());
        }
        let name = if change == Change::ClaimOfAnotherPod { "web-0" } else { "web-1" };
        witness(&index, &claimants(&index), "ns", name, &claim)
    }

    #[test]
    fn a_claim_is_witnessed_as_its_live_pods_records_on_its_node_hold_it_whatever_its_spec_says() {
        let ips_of = |binding: &ClaimBinding| -> Vec<(String, String, String)> {
            binding
                .interfaces
                .iter()
                .flat_map(|i| &i.ips)
                .map(|c| (c.ip.clone(), c.pool.clone(), c.block.clone()))
                .collect()
        };
        let at = |ip: &str, pool: &str| (ip.to_string(), pool.to_string(), "b".to_string());
        let from_records = [
            (Change::None, vec![at("10.0.0.5", "p")]),
            (Change::ClaimNamesAnotherBlock, vec![at("10.0.0.5", "p")]),
            (Change::ClaimNamesNoIp, vec![at("10.0.0.5", "p")]),
            (Change::NotSticky, vec![at("10.0.0.5", "p")]),
            (Change::RecordsOfTwoPods, vec![at("10.0.0.5", "p")]),
            (Change::BlockOfAnotherPool, vec![at("10.0.0.5", "q")]),
            (Change::SpecLeavesARecordOut, vec![at("10.0.0.5", "p"), at("10.0.0.6", "p")]),
            // Witnessed as it is, but the spec says otherwise: the binding is written again.
            (Change::WitnessedSpecRewritten, vec![at("10.0.0.5", "p")]),
        ];
        for (change, expected) in from_records {
            let seen = witness_with(change).unwrap_or_else(|| panic!("{change:?}: witnessed"));
            assert_eq!((seen.pod_uid.as_str(), seen.node.as_str()), ("u1", "node-0"), "{change:?}");
            assert_eq!(
                seen.interfaces.iter().map(|i| i.interface.as_str()).collect::<Vec<_>>(),
                ["eth0"],
                "{change:?}"
            );
            assert_eq!(ips_of(&seen), expected, "{change:?}");
        }
        let not_witnessed = [
            Change::PodGone,
            Change::PodTerminating,
            Change::PodOnAnotherNode,
            Change::PodOfAnotherOwner,
            Change::PodOfAnotherUid,
            Change::RecordOfAnotherNode,
            Change::RecordOfAnotherPod,
            Change::RecordMissing,
            Change::AlreadyWitnessed,
            Change::ClaimOfAnotherPod,
        ];
        for change in not_witnessed {
            assert_eq!(witness_with(change), None, "{change:?}");
        }
    }

    #[test]
    fn a_claims_spec_lags_its_binding_whenever_it_says_anything_else() {
        let owner = || Some(OwnerRef { kind: "StatefulSet".into(), name: "web".into() });
        let binding =
            ClaimBinding { pod_uid: "u1".into(), node: "node-0".into(), owner: owner(), interfaces: Vec::new() };
        let said = || ClaimFacts { owner: owner(), ..claim("u1", true, None) };
        type Edit = (&'static str, fn(&mut ClaimFacts));
        let edits: [Edit; 5] = [
            ("another pod", |c| c.pod_uid = "u2".into()),
            ("another node", |c| c.node = "node-1".into()),
            ("another owner", |c| c.owner = None),
            ("stateless", |c| c.sticky = false),
            ("other IPs", |c| c.interfaces = vec![ClaimedInterface { interface: "eth0".into(), ips: Vec::new() }]),
        ];
        assert!(!spec_lags(&said(), &binding), "the spec says what the binding says");
        for (case, edit) in edits {
            let mut lagging = said();
            edit(&mut lagging);
            assert!(spec_lags(&lagging, &binding), "{case}");
        }
    }

    #[test]
    fn a_vm_claim_is_witnessed_from_the_one_launcher_pod_holding_records_of_it() {
        let launcher = |name: &str, uid: &str, node: &str| -> Pod {
            serde_json::from_value(json!({"metadata": {"namespace": "ns", "name": name, "uid": uid,
                    "ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": KUBEVIRT_VMI_KIND, "name": "vm1",
                        "uid": "i", "controller": true}]},
                "spec": {"nodeName": node}, "status": {"phase": "Running"}}))
            .expect("pod")
        };
        let record = |uid: &str, name: &str, node: &str| {
            let mut r = crate::ipam::blocks::test::record(uid, "c1");
            (r.pod.namespace, r.pod.name, r.node, r.sticky) = ("ns".into(), name.into(), node.into(), true);
            r.owner = Some(OwnerRef { kind: KUBEVIRT_VMI_KIND.into(), name: "vm1".into() });
            serde_json::to_value(r).expect("a record")
        };
        let (source, target) =
            (launcher("virt-launcher-vm1-a", "s1", "node-0"), launcher("virt-launcher-vm1-b", "t1", "node-1"));
        let witnessed = |allocations: serde_json::Value| {
            let block: std::sync::Arc<crate::crd::IPBlock> = std::sync::Arc::new(
                serde_json::from_value(json!({"apiVersion": "ipwarden.io/v1alpha1", "kind": "IPBlock",
                    "metadata": {"name": "b"}, "spec": {"pool": "p", "cidr": "10.0.0.0/24", "allocations": allocations}}))
                .expect("block"),
            );
            let index = ClusterIndex::from_objects(
                &sticky_kinds(),
                [Watched::Block(&block), Watched::Pod(&source), Watched::Pod(&target)],
            );
            let c = claim("forged", true, Some((KUBEVIRT_VMI_KIND, "vm1")));
            witness(&index, &claimants(&index), "ns", "vm.vm1", &c).map(|b| (b.pod_uid, b.node))
        };
        let source_only = json!({"10.0.0.5": record("s1", "virt-launcher-vm1-a", "node-0")});
        assert_eq!(witnessed(source_only), Some(("s1".into(), "node-0".into())), "the source holds the VM's record");
        let handed_over = json!({"10.0.0.5": record("t1", "virt-launcher-vm1-b", "node-1")});
        assert_eq!(
            witnessed(handed_over),
            Some(("t1".into(), "node-1".into())),
            "the target holds it after the handover"
        );
        let both = json!({"10.0.0.5": record("s1", "virt-launcher-vm1-a", "node-0"),
            "10.0.0.6": record("t1", "virt-launcher-vm1-b", "node-1")});
        assert_eq!(witnessed(both), None, "two launcher pods each hold records of the VM");
        let forged = json!({"10.0.0.5": record("t1", "virt-launcher-vm1-b", "node-0")});
        assert_eq!(witnessed(forged), None, "a record naming the target on another node than its own");
    }

    #[test]
    fn a_witnessed_claim_is_judged_by_its_witness_not_by_a_spec_another_node_rewrote() {
        let running = with_pod("u1", "Running");
        let mut forged = claim("forged", false, Some(("StatefulSet", "other")));
        assert!(gone_for_good(&running, "ns", "web-1", &forged), "by the rewritten spec, gone");
        forged.witnessed = Some(ClaimBinding {
            pod_uid: "u1".into(),
            node: "node-0".into(),
            owner: Some(OwnerRef { kind: "StatefulSet".into(), name: "web".into() }),
            interfaces: Vec::new(),
        });
        assert!(!gone_for_good(&running, "ns", "web-1", &forged), "by the witness, its pod runs");
        assert!(gone_for_good(&ClusterIndex::default(), "ns", "web-1", &forged), "the pod and its set are gone");
        if let Some(witnessed) = forged.witnessed.as_mut() {
            witnessed.owner = None;
        }
        assert!(
            gone_for_good(&running, "ns", "web-1", &forged),
            "a witness without owner (an older version's): the spec"
        );
    }

    #[test]
    fn the_controller_creates_the_claim_a_live_sticky_pod_lacks_while_its_ordinal_is_wanted() {
        // (the StatefulSet's replicas (None: not cached), web-1 terminating, its record held,
        // the IPs web-1 reports, its claim stored, a claim to create, case); the pools' CIDRs
        // are 10.0.0.0/24 and fd00::/64.
        let ours: &[&str] = &["10.0.0.5"];
        let rows = [
            (Some(2), false, true, ours, false, true, "a live pod holding its record, no claim"),
            (Some(2), false, true, ours, true, false, "the claim exists: witnessed, not created"),
            (Some(2), true, true, ours, false, false, "the pod is terminating"),
            (Some(2), false, false, ours, false, false, "no record holds the pod's IP"),
            (Some(1), false, true, ours, false, false, "the ordinal is being scaled away"),
            (None, false, true, ours, false, false, "the StatefulSet is not cached yet"),
            (Some(2), false, true, &[], false, false, "the pod reports no IP yet: its ADD may still fail"),
            (Some(2), false, true, &["10.0.0.5", "fd00::5"], false, false, "a pool IP the pod reports is not recorded"),
            (Some(2), false, true, &["fd00:0::5", "10.0.0.5"], false, false, "so is an IPv6 spelled otherwise"),
            (
                Some(2),
                false,
                true,
                &["192.168.1.7"],
                false,
                true,
                "another IPAM's IP: ipwarden serves a second network",
            ),
            (Some(2), false, true, &["10.0.0.5", "192.168.1.7"], false, true, "beside another network's IP"),
        ];
        for (replicas, terminating, recorded, reported, stored, created, case) in rows {
            let reported: Vec<serde_json::Value> = reported.iter().map(|ip| json!({"ip": ip})).collect();
            let mut pod = json!({"metadata": {"namespace": "ns", "name": "web-1", "uid": "u1",
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": "s",
                        "controller": true}]},
                "spec": {"nodeName": "node-0"}, "status": {"phase": "Running", "podIPs": reported}});
            if terminating {
                pod["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
            }
            let pod: Pod = serde_json::from_value(pod).expect("pod");
            let mut record = crate::ipam::blocks::test::record("u1", "c1");
            (record.pod.namespace, record.pod.name, record.sticky) = ("ns".into(), "web-1".into(), true);
            record.owner = Some(OwnerRef { kind: "StatefulSet".into(), name: "web".into() });
            let allocations = if recorded { json!({"10.0.0.5": record}) } else { json!({}) };
            let block: std::sync::Arc<crate::crd::IPBlock> = std::sync::Arc::new(
                serde_json::from_value(json!({"apiVersion": "ipwarden.io/v1alpha1", "kind": "IPBlock",
                    "metadata": {"name": "b"}, "spec": {"pool": "p", "cidr": "10.0.0.0/24", "allocations": allocations}}))
                .expect("block"),
            );
            let claim: crate::crd::IPClaim = serde_json::from_value(json!({"apiVersion": "ipwarden.io/v1alpha1",
                "kind": "IPClaim", "metadata": {"namespace": "ns", "name": "web-1", "uid": "c"},
                "spec": {"podUid": "u1", "node": "node-0", "sticky": true, "interfaces": [],
                    "boundAt": "2026-01-01T00:00:00Z"}}))
            .expect("claim");
            let set = replicas.map(statefulset);
            let pools: Vec<std::sync::Arc<crate::crd::IPPool>> = [("p", "10.0.0.0/24"), ("p6", "fd00::/64")]
                .map(|(name, cidr)| {
                    std::sync::Arc::new(
                        serde_json::from_value(json!({"apiVersion": "ipwarden.io/v1alpha1", "kind": "IPPool",
                            "metadata": {"name": name}, "spec": {"cidr": cidr}}))
                        .expect("pool"),
                    )
                })
                .to_vec();
            let mut objects = vec![Watched::Block(&block), Watched::Pod(&pod)];
            objects.extend(pools.iter().map(Watched::Pool));
            objects.extend(set.as_ref().map(Watched::StatefulSet));
            if stored {
                objects.push(Watched::Claim(&claim));
            }
            let index = ClusterIndex::from_objects(&sticky_kinds(), objects);
            let missing = missing(&index, &claimants(&index));
            let expected = created.then(|| {
                let ip = crate::crd::ClaimedIp { ip: "10.0.0.5".into(), pool: "p".into(), block: "b".into() };
                let binding = ClaimBinding {
                    pod_uid: "u1".into(),
                    node: "node-0".into(),
                    owner: record.owner.clone(),
                    interfaces: vec![ClaimedInterface { interface: "eth0".into(), ips: vec![ip] }],
                };
                ("ns".to_string(), "web-1".to_string(), binding)
            });
            assert_eq!(missing, Vec::from_iter(expected), "{case}");
        }
    }
}
