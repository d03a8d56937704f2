//! Keeps each IPPool's `Overlapping` condition true to the pools and orphaned blocks that
//! exist (an orphaned block still holding records counts as an overlap). Every agent
//! computes the same answer and writes only when the stored condition differs, so the
//! writes are idempotent and rare.

use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::crd::{IPBlock, IPPool};
use crate::ipam::pools::{self, OVERLAPPING_CONDITION, PoolSet};

/// Brings every pool's `Overlapping` condition in line with the current pools and `blocks`
/// (as the agent knows them: its cache and its own writes, the same view its ADDs choose
/// pools by).
pub async fn reconcile(client: &Client, pools: &Store<IPPool>, blocks: &[Arc<IPBlock>]) {
    let snapshot: Vec<Arc<IPPool>> = pools.state();
    let pool_set = PoolSet::of(&snapshot, blocks);
    let views = pool_set.views();
    let api: Api<IPPool> = Api::all(client.clone());
    for (pool, (overlapping, message)) in pools::overlap_conditions(&views, pool_set.orphans()) {
        let Some(current) = snapshot.iter().find(|p| p.name_any() == pool) else { continue };
        let status = if overlapping { "True" } else { "False" };
        let existing =
            current.status.as_ref().and_then(|s| s.conditions.iter().find(|c| c.type_ == OVERLAPPING_CONDITION));
        if existing.is_some_and(|c| c.status == status && c.message == message) {
            continue;
        }
        let condition = Condition {
            type_: OVERLAPPING_CONDITION.to_string(),
            status: status.to_string(),
            reason: if overlapping { "CidrOverlap" } else { "NoOverlap" }.to_string(),
            message,
            last_transition_time: Time(Timestamp::now()),
            observed_generation: current.metadata.generation,
        };
        let patch = json!({
            "apiVersion": "ipwarden.io/v1alpha1",
            "kind": "IPPool",
            "status": {"conditions": [condition]},
        });
        let params = PatchParams::apply("ipwarden-agent-pool-conditions").force();
        if let Err(e) = api.patch_status(&pool, &params, &Patch::Apply(&patch)).await {
            tracing::warn!(pool = %pool, error = %e, "updating the Overlapping condition failed");
        }
    }
}
