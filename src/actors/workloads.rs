//! Watches of the workloads a list-bound record can be held for (Deployments, ReplicaSets,
//! CronJobs, Jobs; metadata only, into the index), so that the sweep keeps such a record
//! while its workload lives and releases it once the workload is gone
//! ([`crate::ipam::workload::workload_lives`]). Until a kind is listed, its workloads live.

use std::fmt::Debug;

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::batch::v1::{CronJob, Job};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher;
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;

use super::watches::{SharedIndex, drain, watch_into};
use crate::gc::index::{Kind, Watched};
use crate::ipam::workload::WorkloadKind;

/// Starts the watch of each workload kind into `index`.
pub fn watch(client: &Client, index: &SharedIndex) {
    watch_kind::<Deployment>(client, index, WorkloadKind::Deployment, |o| {
        Watched::Workload(WorkloadKind::Deployment, &o.metadata)
    });
    watch_kind::<ReplicaSet>(client, index, WorkloadKind::ReplicaSet, |o| {
        Watched::Workload(WorkloadKind::ReplicaSet, &o.metadata)
    });
    watch_kind::<CronJob>(client, index, WorkloadKind::CronJob, |o| {
        Watched::Workload(WorkloadKind::CronJob, &o.metadata)
    });
    watch_kind::<Job>(client, index, WorkloadKind::Job, |o| Watched::Workload(WorkloadKind::Job, &o.metadata));
}

fn watch_kind<K>(
    client: &Client,
    index: &SharedIndex,
    kind: WorkloadKind,
    watched: fn(&PartialObjectMeta<K>) -> Watched<'_>,
) where
    K: Resource + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default,
{
    let api: Api<PartialObjectMeta<K>> = Api::all(client.clone());
    let events = watch_into(index.clone(), Kind::Workload(kind), api, watcher::Config::default(), watched);
    drain(events, Kind::Workload(kind));
}
