//! The one live read of a record's owner, for the agent (DEL, start-up GC) and the
//! controller's pool actors (the re-check right before a release is written): the facts
//! [`workload::owner_wants`] and [`workload::workload_lives`] decide on, read from the API,
//! not from a cache. Also the agent's read, at the ADD of a pod drawing from an
//! `ipwarden.io/ip-list`, of the workload its IPs are held for, and at a VM source's DEL, of
//! the VM instance's migration state.

use std::fmt::Debug;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::batch::v1::{CronJob, Job};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::{Client, Resource};
use serde::de::DeserializeOwned;

use crate::crd::{Allocation, MigrationTarget, OwnerRef};
use crate::ipam::workload::{self, KUBEVIRT_VMI_KIND, OwnerFacts, Presence, StatefulSetFacts, WorkloadKind};

/// Whether `record` is still reserved for a workload, from live reads: its sticky owner
/// still wants its ordinal or VM (only asked when `sticky`: the caller judges stickiness by
/// its settings), or it is a list reservation ([`workload::list_reservation_for`]; the
/// caller's write detaches it when `detaching`) whose workload lives. An owner that cannot
/// be read wants.
pub async fn record_held(client: &Client, record: &Allocation, sticky: bool, detaching: bool) -> bool {
    if sticky && record_owner_wants(client, record).await {
        return true;
    }
    match workload::list_reservation_for(record, detaching) {
        Some(workload) => workload::workload_lives(read(client, &record.pod.namespace, workload).await),
        None => false,
    }
}

/// The workload the list-drawn IPs of a pod controlled by `controller` (in `namespace`) are
/// held for ([`workload::list_workload`]): reads the controller's own controller when it is
/// a ReplicaSet or a Job ([`WorkloadKind::parent`]: a Deployment, a CronJob), nothing
/// otherwise. A controller already gone holds nothing.
pub async fn list_workload(
    client: &Client,
    namespace: &str,
    controller: Option<&OwnerRef>,
) -> Result<Option<OwnerRef>, kube::Error> {
    let references = match controller.map(|c| (WorkloadKind::of(&c.kind), c.name.as_str())) {
        Some((Some(WorkloadKind::ReplicaSet), name)) => owner_references::<ReplicaSet>(client, namespace, name).await?,
        Some((Some(WorkloadKind::Job), name)) => owner_references::<Job>(client, namespace, name).await?,
        _ => return Ok(workload::list_workload(controller, None)),
    };
    let Some(references) = references else { return Ok(None) };
    Ok(workload::list_workload(controller, workload::controller_in(Some(&references)).as_ref()))
}

/// The ownerReferences of `K`/`name` (metadata only), `None` when it does not exist.
async fn owner_references<K>(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Option<Vec<OwnerReference>>, kube::Error>
where
    K: Resource<Scope = NamespaceResourceScope> + Clone + Debug + DeserializeOwned,
    K::DynamicType: Default,
{
    let meta = Api::<K>::namespaced(client.clone(), namespace).get_metadata_opt(name).await?;
    Ok(meta.map(|m| m.metadata.owner_references.unwrap_or_default()))
}

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
    let name = owner.name.as_str();
    match (WorkloadKind::of(&owner.kind), owner.kind.as_str()) {
        (Some(WorkloadKind::Deployment), _) => presence::<Deployment>(client, namespace, name).await,
        (Some(WorkloadKind::ReplicaSet), _) => presence::<ReplicaSet>(client, namespace, name).await,
        (Some(WorkloadKind::CronJob), _) => presence::<CronJob>(client, namespace, name).await,
        (Some(WorkloadKind::Job), _) => presence::<Job>(client, namespace, name).await,
        (None, "StatefulSet") => match Api::<StatefulSet>::namespaced(client.clone(), namespace).get_opt(name).await {
            Ok(sts) => OwnerFacts::StatefulSet(sts.as_ref().map(statefulset_facts)),
            Err(e) => {
                tracing::debug!(statefulset = %name, error = %e, "reading the owner failed; it counts as wanting");
                OwnerFacts::Unknown
            }
        },
        (None, KUBEVIRT_VMI_KIND) => {
            let instance = kubevirt_presence(client, namespace, KUBEVIRT_VMI_KIND, name).await;
            let vm = kubevirt_presence(client, namespace, KUBEVIRT_VM_KIND, name).await;
            match (instance, vm) {
                (Some(instance), Some(vm)) => OwnerFacts::VirtualMachine { instance, vm },
                _ => OwnerFacts::Unknown,
            }
        }
        (None, _) => OwnerFacts::Unknown,
    }
}

/// Whether workload `K`/`name` is there: [`OwnerFacts::Workload`], or
/// [`OwnerFacts::Unknown`] when it cannot be read.
async fn presence<K>(client: &Client, namespace: &str, name: &str) -> OwnerFacts
where
    K: Resource<Scope = NamespaceResourceScope> + Clone + Debug + DeserializeOwned,
    K::DynamicType: Default,
{
    match Api::<K>::namespaced(client.clone(), namespace).get_metadata_opt(name).await {
        Ok(Some(meta)) if meta.metadata.deletion_timestamp.is_some() => OwnerFacts::Workload(Presence::Deleting),
        Ok(Some(_)) => OwnerFacts::Workload(Presence::Live),
        Ok(None) => OwnerFacts::Workload(Presence::Absent),
        Err(e) => {
            tracing::debug!(kind = %K::kind(&K::DynamicType::default()), name, error = %e, "reading the owner failed; it counts as wanting");
            OwnerFacts::Unknown
        }
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

/// What the source sandbox of `record` (a KubeVirt VM's record), leaving, does with the
/// live migration `target` attached to it, by its VM instance's `status.migrationState` read
/// live ([`workload::handover_check`]). A VMI that is gone (a 404, as where KubeVirt is not
/// installed) records no migration; any other read error is returned.
pub async fn migration_handover(
    client: &Client,
    record: &Allocation,
    target: &MigrationTarget,
) -> Result<workload::Handover, kube::Error> {
    let Some(owner) = record.owner.as_ref().filter(|o| o.kind == KUBEVIRT_VMI_KIND) else {
        return Ok(workload::Handover::Refused(format!(
            "the record of pod {} is not a VM instance's",
            record.pod.name
        )));
    };
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &record.pod.namespace, &kubevirt_resource(KUBEVIRT_VMI_KIND));
    let vmi = api.get_opt(&owner.name).await?;
    let state = vmi.as_ref().and_then(|v| v.data.pointer("/status/migrationState"));
    let text = |field: &str| state.and_then(|s| s.get(field)).and_then(|v| v.as_str()).unwrap_or_default();
    let flag = |field: &str| state.and_then(|s| s.get(field)).and_then(|v| v.as_bool()).unwrap_or(false);
    let phase = vmi.as_ref().and_then(|v| v.data.pointer("/status/phase")).and_then(|p| p.as_str());
    let deleting = vmi.as_ref().is_some_and(|v| v.metadata.deletion_timestamp.is_some());
    let facts = state.map(|_| workload::MigrationState {
        migration_uid: text("migrationUid"),
        target_node: text("targetNode"),
        target_pod: text("targetPod"),
        source_node: text("sourceNode"),
        source_pod: text("sourcePod"),
        completed: flag("completed"),
        failed: flag("failed"),
        instance_ended: deleting || matches!(phase, Some("Succeeded" | "Failed")),
    });
    Ok(workload::handover_check(target, facts.as_ref()))
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
