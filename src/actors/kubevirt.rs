//! Metadata caches of KubeVirt's VirtualMachines and VirtualMachineInstances, so that the
//! controller decides on a VM's records and claim by the same rule as the agent
//! ([`crate::ipam::workload::owner_wants`]). KubeVirt may be absent: its API is looked for at
//! start and then every [`DISCOVERY_INTERVAL`] until it is served; only then are the two
//! kinds watched. Until they are synced, a VM's reservations are kept.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use kube::api::{Api, DynamicObject};
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{Store, reflector, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};

use crate::gc::index::KubeVirtIndex;
use crate::ipam::workload::KUBEVIRT_VMI_KIND;
use crate::owners::{KUBEVIRT_API_VERSION, KUBEVIRT_VM_KIND, kubevirt_resource};

/// How often the controller looks for KubeVirt's API while it is not served.
pub const DISCOVERY_INTERVAL: Duration = Duration::from_secs(10);

/// The plural resource names that must both be served before the controller watches them.
const RESOURCES: [&str; 2] = ["virtualmachines", "virtualmachineinstances"];

type MetaStore = Store<PartialObjectMeta<DynamicObject>>;

/// The caches; cheap to clone.
#[derive(Clone)]
pub struct KubeVirtCaches {
    instances: MetaStore,
    vms: MetaStore,
    synced: Arc<AtomicBool>,
}

impl KubeVirtCaches {
    /// Caches that fill once KubeVirt's API is served: spawns the task that looks for it and
    /// then watches both kinds (metadata only).
    pub fn start(client: Client) -> Self {
        let instances = Writer::new(kubevirt_resource(KUBEVIRT_VMI_KIND));
        let vms = Writer::new(kubevirt_resource(KUBEVIRT_VM_KIND));
        let caches = Self { instances: instances.as_reader(), vms: vms.as_reader(), synced: Arc::default() };
        tokio::spawn(watch_when_served(client, instances, vms, caches.clone()));
        caches
    }

    /// The cached objects, or `None` until both kinds are watched and synced.
    pub fn index(&self) -> Option<KubeVirtIndex> {
        if !self.synced.load(Ordering::SeqCst) {
            return None;
        }
        let by_key = |store: &MetaStore| -> HashMap<(String, String), bool> {
            store
                .state()
                .iter()
                .map(|o| ((o.namespace().unwrap_or_default(), o.name_any()), o.metadata.deletion_timestamp.is_some()))
                .collect()
        };
        Some(KubeVirtIndex { instances: by_key(&self.instances), vms: by_key(&self.vms) })
    }
}

/// Whether the apiserver serves both KubeVirt kinds the controller watches.
async fn served(client: &Client) -> Result<bool, kube::Error> {
    match client.list_api_group_resources(KUBEVIRT_API_VERSION).await {
        Ok(list) => Ok(RESOURCES.iter().all(|r| list.resources.iter().any(|served| served.name == *r))),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

async fn watch_when_served(
    client: Client,
    instances: Writer<PartialObjectMeta<DynamicObject>>,
    vms: Writer<PartialObjectMeta<DynamicObject>>,
    caches: KubeVirtCaches,
) {
    loop {
        match served(&client).await {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "looking for KubeVirt's API failed; retrying"),
        }
        tokio::time::sleep(DISCOVERY_INTERVAL).await;
    }
    tracing::info!("KubeVirt's API is served: watching VirtualMachines and VirtualMachineInstances");
    for (writer, kind) in [(instances, KUBEVIRT_VMI_KIND), (vms, KUBEVIRT_VM_KIND)] {
        let api: Api<PartialObjectMeta<DynamicObject>> = Api::all_with(client.clone(), &kubevirt_resource(kind));
        let stream = reflector(writer, watcher(api, watcher::Config::default())).default_backoff();
        tokio::spawn(stream.for_each(move |event| async move {
            if let Err(e) = event {
                tracing::warn!(kind, error = %e, "KubeVirt watch error; retrying with backoff");
            }
        }));
    }
    let synced = async {
        caches.instances.wait_until_ready().await?;
        caches.vms.wait_until_ready().await
    };
    match synced.await {
        Ok(()) => caches.synced.store(true, Ordering::SeqCst),
        Err(e) => tracing::error!(error = %e, "a KubeVirt cache closed before syncing; VM reservations stay kept"),
    }
}
