//! Writes each IPPool's conditions (`Overlapping`, `GatewayInRanges`, judged by
//! [`crate::ipam::pool_conditions`]) from the controller's index, on the leader only. The
//! controller writes them, not the agents: they state a cluster-wide fact, which no node's
//! agent may set for every pool (decision 0022).

use jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use super::pool::PoolContext;
use crate::crd::IPPool;

/// The field manager of the controller's condition writes.
const FIELD_MANAGER: &str = "ipwarden-controller-pool-conditions";

/// Brings every pool's conditions in line with the pools and blocks the index holds, where
/// they differ (server-side apply of `status.conditions`, forced: it takes them over from the
/// agents of earlier versions).
pub async fn reconcile(context: PoolContext) {
    let (pools, blocks) = {
        let index = context.index.read();
        (index.pools(), index.blocks())
    };
    let api: Api<IPPool> = Api::all(context.client.clone());
    for (pool, conditions) in crate::ipam::pool_conditions::to_write(&pools, &blocks, Timestamp::now()) {
        if !context.leading.is_leading() {
            return;
        }
        let patch =
            json!({"apiVersion": "ipwarden.io/v1alpha1", "kind": "IPPool", "status": {"conditions": conditions}});
        let params = PatchParams::apply(FIELD_MANAGER).force();
        if let Err(e) = api.patch_status(&pool, &params, &Patch::Apply(&patch)).await {
            tracing::warn!(pool = %pool, error = %e, "updating the pool's conditions failed");
        }
    }
}
