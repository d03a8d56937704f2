//! The pool finalizer ([`POOL_FINALIZER`]) and orphaned blocks, kept by the leader on the
//! pool supervisor's timer: the finalizer goes on every live pool; a pool being deleted
//! keeps it while a block of the pool holds a record or a node's spare IP (the agents give
//! their spares of a pool being deleted back), then its empty blocks are deleted and
//! the finalizer comes off; an orphaned block is deleted once empty. Decisions come from
//! [`crate::ipam::pools`]; every write is conditional on the resourceVersion it was decided on.

use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::{Client, ResourceExt};
use serde_json::json;

use super::pool::PoolContext;
use crate::crd::{IPBlock, IPPool, POOL_FINALIZER};
use crate::ipam::pools::{FinalizerStep, PoolSet, finalizer_step};

/// One pass over the cached pools and blocks; does nothing unless this replica leads.
pub async fn reconcile(context: PoolContext) {
    let (pools, blocks) = {
        let index = context.index.read();
        (index.pools(), index.blocks())
    };
    let set = PoolSet::of(&pools, &blocks);
    for pool in &pools {
        let name = pool.name_any();
        let records: usize = blocks
            .iter()
            .filter(|b| b.spec.pool == name && !set.orphans().iter().any(|o| o.name == b.name_any()))
            .map(|b| crate::ipam::blocks::held(&b.spec))
            .sum();
        let has = pool.finalizers().iter().any(|f| f == POOL_FINALIZER);
        let deleting = pool.metadata.deletion_timestamp.is_some();
        let step = finalizer_step(has, deleting, records);
        if matches!(step, FinalizerStep::Wait | FinalizerStep::Nothing) || !context.leading.is_leading() {
            continue;
        }
        let done = match step {
            FinalizerStep::Add => add(&context.client, pool).await,
            _ => release(&context.client, pool).await,
        };
        match done {
            Ok(true) => tracing::info!(pool = %name, step = ?step, "pool finalizer updated"),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(pool = %name, step = ?step, error = %e, "updating the pool finalizer failed; retrying on the next pass")
            }
        }
    }
    for orphan in set.orphans().iter().filter(|o| o.records == 0) {
        let Some(block) = blocks.iter().find(|b| b.name_any() == orphan.name) else { continue };
        if !context.leading.is_leading() {
            return;
        }
        match delete_if_unchanged(&context.client, block).await {
            Ok(()) => tracing::info!(block = %orphan.name, pool = %orphan.pool, "deleted an empty orphaned block"),
            Err(e) => {
                tracing::debug!(block = %orphan.name, error = %e, "orphaned block not deleted; retrying on the next pass")
            }
        }
    }
}

/// Puts the finalizer on `pool`, conditional on its resourceVersion.
async fn add(client: &Client, pool: &IPPool) -> Result<bool, kube::Error> {
    let mut finalizers = pool.finalizers().to_vec();
    finalizers.push(POOL_FINALIZER.to_string());
    patch_finalizers(client, pool, finalizers).await.map(|()| true)
}

/// Deletes the blocks of `pool` (being deleted) and takes its finalizer off, if a live
/// read finds none of them holding a record or a spare; `false` when one still does.
async fn release(client: &Client, pool: &IPPool) -> Result<bool, kube::Error> {
    let name = pool.name_any();
    let api: Api<IPBlock> = Api::all(client.clone());
    // The pool's own blocks: one written under an earlier layout of this name is orphaned.
    let own = |b: &IPBlock| b.spec.pool == name && crate::ipam::pools::owns_block(&pool.spec, &b.spec.cidr);
    let blocks: Vec<IPBlock> = api.list(&ListParams::default()).await?.items.into_iter().filter(own).collect();
    if blocks.iter().any(|b| !crate::ipam::blocks::holds_nothing(&b.spec)) {
        return Ok(false);
    }
    for block in &blocks {
        delete_if_unchanged(client, block).await?;
    }
    let finalizers = pool.finalizers().iter().filter(|f| *f != POOL_FINALIZER).cloned().collect();
    patch_finalizers(client, pool, finalizers).await.map(|()| true)
}

/// Deletes `block` if it is still the version read (an agent that wrote a record since
/// makes this fail with 409); a block already gone counts as deleted.
async fn delete_if_unchanged(client: &Client, block: &IPBlock) -> Result<(), kube::Error> {
    let api: Api<IPBlock> = Api::all(client.clone());
    let params = DeleteParams {
        preconditions: Some(Preconditions { resource_version: block.resource_version(), uid: block.uid() }),
        ..DeleteParams::default()
    };
    match api.delete(&block.name_any(), &params).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

/// Writes `finalizers` on `pool`, conditional on the resourceVersion it was read at.
async fn patch_finalizers(client: &Client, pool: &IPPool, finalizers: Vec<String>) -> Result<(), kube::Error> {
    let api: Api<IPPool> = Api::all(client.clone());
    let patch = json!({"metadata": {"resourceVersion": pool.resource_version(), "finalizers": finalizers}});
    api.patch(&pool.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await.map(drop)
}
