//! Watches of KubeVirt's VirtualMachines and VirtualMachineInstances (metadata only, into
//! the index), so that the controller decides on a VM's records and claim by the same rule as the agent
//! ([`crate::ipam::workload::owner_wants`]). KubeVirt may be absent: its API is looked for at
//! start and then every [`DISCOVERY_INTERVAL`] until it is served; only then are the two
//! kinds watched. Until both are listed, a VM's reservations are kept.

use std::time::Duration;

use kube::Client;
use kube::api::{Api, DynamicObject};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher;

use super::watches::{SharedIndex, drain, watch_into};
use crate::gc::index::{Kind, Watched};
use crate::ipam::workload::KUBEVIRT_VMI_KIND;
use crate::owners::{KUBEVIRT_API_VERSION, KUBEVIRT_VM_KIND, kubevirt_resource};

/// How often the controller looks for KubeVirt's API while it is not served.
pub const DISCOVERY_INTERVAL: Duration = Duration::from_secs(10);

/// The plural resource names that must both be served before the controller watches them.
const RESOURCES: [&str; 2] = ["virtualmachines", "virtualmachineinstances"];

/// Whether the apiserver serves both KubeVirt kinds the controller watches.
async fn served(client: &Client) -> Result<bool, kube::Error> {
    match client.list_api_group_resources(KUBEVIRT_API_VERSION).await {
        Ok(list) => Ok(RESOURCES.iter().all(|r| list.resources.iter().any(|served| served.name == *r))),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Looks for KubeVirt's API in the background (at once, then every
/// [`DISCOVERY_INTERVAL`] until it is served), then feeds both kinds' metadata to `index`.
pub fn watch_when_served(client: Client, index: SharedIndex) {
    tokio::spawn(async move {
        loop {
            match served(&client).await {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "looking for KubeVirt's API failed; retrying"),
            }
            tokio::time::sleep(DISCOVERY_INTERVAL).await;
        }
        tracing::info!("KubeVirt's API is served: watching VirtualMachines and VirtualMachineInstances");
        let vmi_api: Api<PartialObjectMeta<DynamicObject>> =
            Api::all_with(client.clone(), &kubevirt_resource(KUBEVIRT_VMI_KIND));
        let instances =
            watch_into(index.clone(), Kind::VirtualMachineInstance, vmi_api, watcher::Config::default(), |o| {
                Watched::VirtualMachineInstance(o)
            });
        drain(instances, Kind::VirtualMachineInstance);
        let vm_api: Api<PartialObjectMeta<DynamicObject>> = Api::all_with(client, &kubevirt_resource(KUBEVIRT_VM_KIND));
        let vms =
            watch_into(index, Kind::VirtualMachine, vm_api, watcher::Config::default(), |o| Watched::VirtualMachine(o));
        drain(vms, Kind::VirtualMachine);
    });
}
