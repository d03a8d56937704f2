//! KubeVirt objects on KubeVirt's real CRDs, shaped as KubeVirt makes them: a VirtualMachine,
//! its VirtualMachineInstance (owned by the VM), virt-launcher pods (owned by the VMI, labelled
//! as virt-controller labels them; a migration target also carries the migration's UID) and
//! VirtualMachineInstanceMigrations. No KubeVirt controller runs: the test plays its part.

use e2e::wait::{self, Probe};
use ipwarden::crd::IPClaim;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use super::TIMEOUT;

/// The API of KubeVirt's kind `kind` in `namespace`.
pub fn api(client: &Client, namespace: &str, kind: &str) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk("kubevirt.io", "v1", kind));
    Api::namespaced_with(client.clone(), namespace, &resource)
}

async fn create(client: &Client, namespace: &str, kind: &str, body: serde_json::Value) -> DynamicObject {
    let object: DynamicObject = serde_json::from_value(body).expect("KubeVirt object");
    api(client, namespace, kind).create(&PostParams::default(), &object).await.expect("create KubeVirt object")
}

fn owner_reference(kind: &str, object: &DynamicObject) -> serde_json::Value {
    json!({"apiVersion": "kubevirt.io/v1", "kind": kind, "name": object.name_any(),
           "uid": object.uid().unwrap_or_default(), "controller": true, "blockOwnerDeletion": true})
}

/// Creates VirtualMachine `name` (runStrategy Always) and returns it.
pub async fn create_vm(client: &Client, namespace: &str, name: &str) -> DynamicObject {
    create(
        client,
        namespace,
        "VirtualMachine",
        json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"runStrategy": "Always",
                     "template": {"metadata": {"labels": {"kubevirt.io/vm": name}},
                                  "spec": {"domain": {"devices": {}}}}},
        }),
    )
    .await
}

/// Creates the VM's instance, named after it and owned by it, as virt-controller does on start.
pub async fn create_vmi(client: &Client, namespace: &str, vm: &DynamicObject) -> DynamicObject {
    create(
        client,
        namespace,
        "VirtualMachineInstance",
        json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": vm.name_any(), "namespace": namespace, "labels": {"kubevirt.io/vm": vm.name_any()},
                         "ownerReferences": [owner_reference("VirtualMachine", vm)]},
            "spec": {"domain": {"devices": {}}},
        }),
    )
    .await
}

/// Creates a virt-launcher pod of `vmi` on `node`, as virt-controller renders it (generated
/// name, labels, domain annotation, controller reference to the VMI); a migration target
/// also carries `kubevirt.io/migrationJobUID`. Returns the created pod.
pub async fn create_launcher(
    client: &Client,
    namespace: &str,
    vmi: &DynamicObject,
    node: &str,
    migration_uid: Option<&str>,
) -> Pod {
    let name = vmi.name_any();
    let mut labels = json!({"kubevirt.io": "virt-launcher", "kubevirt.io/created-by": vmi.uid().unwrap_or_default(),
                            "vm.kubevirt.io/name": name, "kubevirt.io/vm": name});
    if let Some(uid) = migration_uid {
        labels["kubevirt.io/migrationJobUID"] = json!(uid);
    }
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"generateName": format!("virt-launcher-{name}-"), "namespace": namespace, "labels": labels,
                     "annotations": {"kubevirt.io/domain": name},
                     "ownerReferences": [owner_reference("VirtualMachineInstance", vmi)]},
        "spec": {"nodeName": node, "hostname": name, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "compute", "image": "registry.invalid/kubevirt/virt-launcher:v1.6.0"}]},
    }))
    .expect("launcher pod");
    Api::<Pod>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &pod)
        .await
        .expect("create launcher")
}

/// Creates VirtualMachineInstanceMigration `name` of VMI `vmi` and sets its phase.
pub async fn create_migration(client: &Client, namespace: &str, name: &str, vmi: &str, phase: &str) -> DynamicObject {
    create(
        client,
        namespace,
        "VirtualMachineInstanceMigration",
        json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"vmiName": vmi},
        }),
    )
    .await;
    set_migration_phase(client, namespace, name, phase).await
}

/// Sets migration `name`'s `status.phase`, as virt-controller does as it goes.
pub async fn set_migration_phase(client: &Client, namespace: &str, name: &str, phase: &str) -> DynamicObject {
    api(client, namespace, "VirtualMachineInstanceMigration")
        .patch_status(name, &PatchParams::default(), &Patch::Merge(json!({"status": {"phase": phase}})))
        .await
        .expect("set migration phase")
}

/// Waits until pod `name` runs with an IP and returns the pod.
pub async fn wait_running_with_ip(client: &Client, namespace: &str, name: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    wait::until(&format!("pod {name} running with an IP"), TIMEOUT, || async {
        let pod = pods.get_opt(name).await.map_err(e2e::Error::kube(format!("reading pod {name}")))?;
        Ok(match pod {
            Some(p) if !super::ip_of(&p).is_empty() => Probe::Done(p),
            _ => Probe::Pending("no IP yet".into()),
        })
    })
    .await
    .expect("pod runs with an IP")
}

/// The IPClaims of VM instance `vmi` (whatever they are named).
pub async fn claims_of_vmi(client: &Client, namespace: &str, vmi: &str) -> Vec<IPClaim> {
    super::claims(client, namespace)
        .await
        .into_values()
        .filter(|c| c.spec.owner.as_ref().is_some_and(|o| o.kind == "VirtualMachineInstance" && o.name == vmi))
        .collect()
}

/// Records in VMI `vmi`'s `status.migrationState` (kubevirt.io/api v1.6.0,
/// `VirtualMachineInstanceMigrationState`) that migration `name` goes to `target`, and
/// whether it `completed`: virt-controller names the migration, target node and pod once the
/// target pod is scheduled, and virt-handler sets `completed` once the VM runs there.
pub async fn record_migration_state(
    client: &Client,
    namespace: &str,
    name: &str,
    vmi: &str,
    target: &Pod,
    completed: bool,
) {
    let migration = api(client, namespace, "VirtualMachineInstanceMigration").get(name).await.expect("read migration");
    let state = json!({"status": {"migrationState": {
        "migrationUid": migration.uid().unwrap_or_default(),
        "targetNode": target.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default(),
        "targetPod": target.name_any(),
        "completed": completed,
    }}});
    // KubeVirt's VMI CRD has no status subresource: its status is written with the object.
    api(client, namespace, "VirtualMachineInstance")
        .patch(vmi, &PatchParams::default(), &Patch::Merge(state))
        .await
        .expect("record the migration in the VMI");
}

/// Completes migration `name` of VMI `vmi` to `target` as KubeVirt does: the VMI records
/// the migration completed ([`record_migration_state`]) and virt-controller sets the
/// migration's phase to `Succeeded`.
pub async fn complete_migration(client: &Client, namespace: &str, name: &str, vmi: &str, target: &Pod) {
    record_migration_state(client, namespace, name, vmi, target, true).await;
    set_migration_phase(client, namespace, name, "Succeeded").await;
}
