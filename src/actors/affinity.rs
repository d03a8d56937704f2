//! Block affinities of nodes that are gone, released by the leader on the pool supervisor's
//! timer: a block affine to a node the cluster no longer has is freed for any node to claim
//! once it holds no record ([`crate::ipam::affinity::release`]), with the node's spares, once
//! no pod reports one of them. Until then its records (a sticky reservation, a leak the GC has
//! not reclaimed yet) keep it, and other nodes may only borrow from it.

use kube::ResourceExt;

use super::pool::PoolContext;
use crate::block_store::CasOutcome;
use crate::gc::rules::NodeState;

/// One pass over the indexed blocks; does nothing unless this replica leads.
pub async fn reconcile(context: PoolContext) {
    let gone: Vec<(String, String)> = {
        let index = context.index.read();
        index
            .blocks_by_name()
            .values()
            .filter(|b| b.spec.allocations.is_empty())
            // A spare a pod still reports was bound by the node's agent just before the node
            // went (its record not written yet): the block waits for that pod to go.
            .filter(|b| b.spec.spares.iter().all(|ip| index.live_holder(ip).is_none()))
            .filter_map(|b| Some((b.name_any(), b.spec.affinity.clone()?)))
            .filter(|(_, node)| index.node(node) == NodeState::Deleted)
            .collect()
    };
    for (block, node) in gone {
        if !context.leading.is_leading() {
            return;
        }
        let released = context
            .store
            .update(&block, None, |b| crate::ipam::affinity::release(&mut b.spec, &node).then_some(()))
            .await;
        match released {
            Ok(CasOutcome::Written(())) => {
                tracing::info!(%block, %node, "released the block's affinity to a node that is gone")
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(%block, %node, error = %e, "releasing a block's affinity failed; retrying on the next pass")
            }
        }
    }
}
