//! Pure rule for the claim janitor: is an IPClaim's workload gone for good?

use super::index::ClusterIndex;
use super::rules::Phase;
use crate::crd::IPClaim;
use crate::workload::KUBEVIRT_VMI_KIND;

/// Whether `claim` (in `namespace`, named `name`) can be deleted: a stateless pod that is
/// gone, replaced or completed (Job pods included); a StatefulSet pod that is gone or
/// completed and whose ordinal its StatefulSet no longer wants. KubeVirt claims are left to
/// their VM's lifecycle (the controller does not watch KubeVirt's API).
pub fn gone_for_good(index: &ClusterIndex, namespace: &str, name: &str, claim: &IPClaim) -> bool {
    let owner = claim.spec.owner.as_ref();
    if owner.is_some_and(|o| o.kind == KUBEVIRT_VMI_KIND) {
        return false;
    }
    let pod = index.pods.get(&(namespace.to_string(), name.to_string()));
    let pod_done = match pod {
        None => true,
        Some(p) => p.uid != claim.spec.pod_uid || p.phase == Phase::Completed,
    };
    if !claim.spec.sticky {
        return pod_done;
    }
    let wanted = match owner {
        Some(o) if o.kind == "StatefulSet" => index
            .statefulsets
            .get(&(namespace.to_string(), o.name.clone()))
            .is_some_and(|s| crate::workload::statefulset_wants(&o.name, s.replicas, s.start, s.deleting, name)),
        _ => true,
    };
    // A recreated StatefulSet pod (another UID) takes the claim over in its ADD: not gone.
    let replaced_by_same_ordinal = pod.is_some_and(|p| p.uid != claim.spec.pod_uid && p.phase != Phase::Completed);
    !wanted && pod_done && !replaced_by_same_ordinal
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::gc::index::{PodFacts, StatefulSetFacts};
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
    fn kubevirt_claims_are_left_to_their_vm() {
        let c = claim("u1", true, Some((KUBEVIRT_VMI_KIND, "vm1")));
        assert!(!gone_for_good(&ClusterIndex::default(), "ns", "web-1", &c));
    }
}
