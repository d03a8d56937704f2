//! Block affinities and spares of nodes that are gone, released by the leader on the pool
//! supervisor's timer ([`crate::ipam::affinity::release`]), once no pod reports one of the
//! node's spares: the spares go at once, even from a block that keeps records; the block is
//! freed for any node to claim once it holds no record. Until then its records (a sticky
//! reservation, an IP another node's pod holds, a leak the GC has not reclaimed yet) keep it,
//! and other nodes may only borrow from it.

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
            // A spare a pod still reports was bound by the node's agent just before the node
            // went (its record not written yet): the block waits for that pod to go.
            .filter(|b| b.spec.spares.iter().all(|ip| index.live_holder(ip).is_none()))
            .filter_map(|b| {
                let node = b.spec.affinity.as_deref()?;
                let frees = index.node(node) == NodeState::Deleted && crate::ipam::affinity::releasable(&b.spec, node);
                frees.then(|| (b.name_any(), node.to_string()))
            })
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
                tracing::info!(%block, %node, "released what a node that is gone held in the block (its spares; its affinity once no record is left)")
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(%block, %node, error = %e, "releasing a block's affinity failed; retrying on the next pass")
            }
        }
    }
}
