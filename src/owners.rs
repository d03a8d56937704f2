//! The one live read of a sticky record's owner, for the agent (DEL, start-up GC) and the
//! controller's pool actors (the re-check right before a release is written): the facts
//! [`workload::owner_wants`] decides on, read from the API, not from a cache.

use k8s_openapi::api::apps::v1::StatefulSet;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};

use crate::crd::{Allocation, OwnerRef};
use crate::ipam::workload::{self, KUBEVIRT_VMI_KIND, OwnerFacts, Presence, StatefulSetFacts};

/// KubeVirt's API group and version.
pub const KUBEVIRT_API_VERSION: &str = "kubevirt.io/v1";

/// The kind of KubeVirt's VirtualMachines.
pub const KUBEVIRT_VM_KIND: &str = "VirtualMachine";

/// Whether the owner of sticky `record` still wants its IP, from a live read of the owner.
/// A record without an owner is not wanted; an owner that cannot be read is.
pub async fn record_owner_wants(client: &Client, record: &Allocation) -> bool {
    let Some(owner) = record.owner.as_ref() else { return false };
    let facts = read(client, &record.pod.namespace, owner).await;
    workload::owner_wants(&owner.name, &record.pod.name, facts)
}

/// What the API says now about `owner` in `namespace`; [`OwnerFacts::Unknown`] on errors.
pub async fn read(client: &Client, namespace: &str, owner: &OwnerRef) -> OwnerFacts {
    match owner.kind.as_str() {
        "StatefulSet" => match Api::<StatefulSet>::namespaced(client.clone(), namespace).get_opt(&owner.name).await {
            Ok(sts) => OwnerFacts::StatefulSet(sts.as_ref().map(statefulset_facts)),
            Err(e) => {
                tracing::debug!(statefulset = %owner.name, error = %e, "reading the owner failed; it counts as wanting");
                OwnerFacts::Unknown
            }
        },
        KUBEVIRT_VMI_KIND => {
            let instance = kubevirt_presence(client, namespace, KUBEVIRT_VMI_KIND, &owner.name).await;
            let vm = kubevirt_presence(client, namespace, KUBEVIRT_VM_KIND, &owner.name).await;
            match (instance, vm) {
                (Some(instance), Some(vm)) => OwnerFacts::VirtualMachine { instance, vm },
                _ => OwnerFacts::Unknown,
            }
        }
        _ => OwnerFacts::Unknown,
    }
}

/// What "owner still wants" needs of a StatefulSet object.
pub fn statefulset_facts(sts: &StatefulSet) -> StatefulSetFacts {
    StatefulSetFacts {
        replicas: sts.spec.replicas.unwrap_or(1),
        start: sts.spec.ordinals.as_ref().and_then(|o| o.start).unwrap_or(0),
        deleting: sts.metadata.deletion_timestamp.is_some(),
    }
}

/// The API resource of KubeVirt's kind `kind`.
pub fn kubevirt_resource(kind: &str) -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk("kubevirt.io", "v1", kind))
}

/// Whether KubeVirt object `kind`/`name` is there; `None` when it cannot be read (a 404 of
/// the kind itself, KubeVirt not installed, reads as absent).
async fn kubevirt_presence(client: &Client, namespace: &str, kind: &str, name: &str) -> Option<Presence> {
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &kubevirt_resource(kind));
    match api.get_opt(name).await {
        Ok(Some(object)) if object.metadata.deletion_timestamp.is_some() => Some(Presence::Deleting),
        Ok(Some(_)) => Some(Presence::Live),
        Ok(None) => Some(Presence::Absent),
        Err(kube::Error::Api(status)) if status.code == 404 => Some(Presence::Absent),
        Err(e) => {
            tracing::debug!(kind, name, error = %e, "reading the owner failed; it counts as wanting");
            None
        }
    }
}
