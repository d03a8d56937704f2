//! Pure rule for the claim janitor: is an IPClaim's workload gone for good?

use super::index::ClusterIndex;
use super::rules::Phase;
use crate::crd::IPClaim;
use crate::ipam::workload::KUBEVIRT_VMI_KIND;

/// Whether `claim` (in `namespace`, named `name`) can be deleted: a stateless pod that is
/// gone, replaced or completed (Job pods included); a StatefulSet pod that is gone or
/// completed and whose ordinal its StatefulSet no longer wants; a KubeVirt VM's claim
/// (`vm.<VM>`, which outlives its launcher pods) once the VM no longer wants it, by the same
/// rule as its records ([`ClusterIndex::wants`]: kept while the controller does not watch
/// KubeVirt).
pub fn gone_for_good(index: &ClusterIndex, namespace: &str, name: &str, claim: &IPClaim) -> bool {
    let owner = claim.spec.owner.as_ref();
    if let Some(vm) = owner.filter(|o| o.kind == KUBEVIRT_VMI_KIND) {
        return !index.wants(namespace, vm, name);
    }
    let pod = index.pods.get(&(namespace.to_string(), name.to_string()));
    let pod_done = match pod {
        None => true,
        Some(p) => p.uid != claim.spec.pod_uid || p.phase == Phase::Completed,
    };
    if !claim.spec.sticky {
        return pod_done;
    }
    let wanted = owner.is_none_or(|o| index.wants(namespace, o, name));
    // A recreated StatefulSet pod (another UID) takes the claim over in its ADD: not gone.
    let replaced_by_same_ordinal = pod.is_some_and(|p| p.uid != claim.spec.pod_uid && p.phase != Phase::Completed);
    !wanted && pod_done && !replaced_by_same_ordinal
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::gc::index::{KubeVirtIndex, PodFacts, StatefulSetFacts};

    type Key = (String, String);
    use serde_json::json;

    fn claim(uid: &str, sticky: bool, owner: Option<(&str, &str)>) -> IPClaim {
        serde_json::from_value(json!({
            "apiVersion": "ipwarden.io/v1alpha1", "kind": "IPClaim", "metadata": {"name": "web-1", "namespace": "ns"},
            "spec": {"podUid": uid, "node": "n", "sticky": sticky, "interfaces": [], "boundAt": "2026-01-01T00:00:00Z",
                     "owner": owner.map(|(kind, name)| json!({"kind": kind, "name": name}))},
        }))
        .expect("claim")
    }

    fn with_pod(uid: &str, phase: Phase) -> ClusterIndex {
        let mut index = ClusterIndex::default();
        index
            .pods
            .insert(("ns".into(), "web-1".into()), PodFacts { uid: uid.into(), phase, deletion: None, ips: vec![] });
        index
    }

    #[test]
    fn a_stateless_claim_goes_with_its_pod_its_replacement_or_its_completion() {
        let c = claim("u1", false, Some(("Job", "batch")));
        assert!(gone_for_good(&ClusterIndex::default(), "ns", "web-1", &c), "pod gone");
        assert!(gone_for_good(&with_pod("u2", Phase::Active), "ns", "web-1", &c), "replaced");
        assert!(gone_for_good(&with_pod("u1", Phase::Completed), "ns", "web-1", &c), "completed Job pod");
        assert!(!gone_for_good(&with_pod("u1", Phase::Active), "ns", "web-1", &c), "still running");
    }

    #[test]
    fn a_statefulset_claim_stays_while_its_ordinal_is_wanted() {
        let c = claim("u1", true, Some(("StatefulSet", "web")));
        let mut index = ClusterIndex::default();
        index
            .statefulsets
            .insert(("ns".into(), "web".into()), StatefulSetFacts { replicas: 2, start: 0, deleting: false });
        assert!(!gone_for_good(&index, "ns", "web-1", &c), "ordinal 1 of 2 is wanted");
        index
            .statefulsets
            .insert(("ns".into(), "web".into()), StatefulSetFacts { replicas: 1, start: 0, deleting: false });
        assert!(gone_for_good(&index, "ns", "web-1", &c), "scaled down below the ordinal");
        index.statefulsets.clear();
        assert!(gone_for_good(&index, "ns", "web-1", &c), "StatefulSet deleted");
    }

    #[test]
    fn a_vm_claim_goes_with_its_vm_and_stays_while_kubevirt_is_not_watched() {
        let c = claim("u1", true, Some((KUBEVIRT_VMI_KIND, "vm1")));
        let key = ("ns".to_string(), "vm1".to_string());
        assert!(!gone_for_good(&ClusterIndex::default(), "ns", "vm.vm1", &c), "KubeVirt not watched");
        let watched = |instances: &[(Key, bool)], vms: &[(Key, bool)]| {
            ClusterIndex::default().with_kubevirt(Some(KubeVirtIndex {
                instances: instances.iter().cloned().collect(),
                vms: vms.iter().cloned().collect(),
            }))
        };
        assert!(!gone_for_good(&watched(&[], &[(key.clone(), false)]), "ns", "vm.vm1", &c), "a stopped VM");
        assert!(!gone_for_good(&watched(&[(key.clone(), false)], &[]), "ns", "vm.vm1", &c), "a running instance");
        assert!(gone_for_good(&watched(&[], &[(key.clone(), true)]), "ns", "vm.vm1", &c), "the VM is being deleted");
        assert!(gone_for_good(&watched(&[], &[]), "ns", "vm.vm1", &c), "the VM is gone");
    }
}
