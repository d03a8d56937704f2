//! Keeps each IPPool's conditions true to the pools and blocks that exist: `Overlapping` (an
//! orphaned block still holding records counts as an overlap) and `GatewayInRanges` (its
//! ranges name the defaulted gateway, which is never handed out). Every agent computes the
//! same answer and writes only when a stored condition differs, so the writes are idempotent
//! and rare.

use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::crd::{IPBlock, IPPool};
use crate::ipam::pools::{self, GATEWAY_IN_RANGES_CONDITION, OVERLAPPING_CONDITION, PoolSet};

/// Brings every pool's conditions in line with the current pools and `blocks` (as the agent
/// knows them: its cache and its own writes, the same view its ADDs choose pools by).
pub async fn reconcile(client: &Client, pools: &Store<IPPool>, blocks: &[Arc<IPBlock>]) {
    let snapshot: Vec<Arc<IPPool>> = pools.state();
    let pool_set = PoolSet::of(&snapshot, blocks);
    let views = pool_set.views();
    let api: Api<IPPool> = Api::all(client.clone());
    for (pool, (overlapping, message)) in pools::overlap_conditions(&views, pool_set.orphans()) {
        let Some(current) = snapshot.iter().find(|p| p.name_any() == pool) else { continue };
        let reason = if overlapping { "CidrOverlap" } else { "NoOverlap" };
        let withheld = pools::gateway_withheld_from_ranges(&current.spec);
        let wanted = [
            (OVERLAPPING_CONDITION, overlapping, reason, message),
            match withheld {
                Some(why) => (GATEWAY_IN_RANGES_CONDITION, true, "DefaultedGatewayInRanges", why),
                None => (GATEWAY_IN_RANGES_CONDITION, false, "GatewayOutsideRanges", String::new()),
            },
        ];
        let stored = |type_: &str| current.status.as_ref().and_then(|s| s.conditions.iter().find(|c| c.type_ == type_));
        let status = |on: bool| if on { "True" } else { "False" };
        let unchanged = wanted.iter().all(|(type_, on, _, message)| {
            stored(type_).is_some_and(|c| c.status == status(*on) && c.message == *message)
        });
        if unchanged {
            continue;
        }
        let conditions: Vec<Condition> = wanted
            .into_iter()
            .map(|(type_, on, reason, message)| {
                // A condition that keeps its status keeps the time it took it.
                let since = stored(type_)
                    .filter(|c| c.status == status(on))
                    .map_or_else(|| Time(Timestamp::now()), |c| c.last_transition_time.clone());
                Condition {
                    type_: type_.to_string(),
                    status: status(on).to_string(),
                    reason: reason.to_string(),
                    message,
                    last_transition_time: since,
                    observed_generation: current.metadata.generation,
                }
            })
            .collect();
        let patch = json!({
            "apiVersion": "ipwarden.io/v1alpha1",
            "kind": "IPPool",
            "status": {"conditions": conditions},
        });
        let params = PatchParams::apply("ipwarden-agent-pool-conditions").force();
        if let Err(e) = api.patch_status(&pool, &params, &Patch::Apply(&patch)).await {
            tracing::warn!(pool = %pool, error = %e, "updating the pool's conditions failed");
        }
    }
}
