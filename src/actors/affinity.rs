//! Block affinities and spares of nodes that are gone, released by the leader on the pool
//! supervisor's timer ([`crate::ipam::affinity::release`]), once the node has been gone for an
//! agent Lease duration (an agent still running on a Node deleted by hand has failed a Lease
//! renewal and stopped by then) and no pod reports one of its spares: the spares go at once,
//! even from a block that keeps records; the block is
//! freed for any node to claim once it holds no record. Until then its records (a sticky
//! reservation, an IP another node's pod holds, a leak the GC has not reclaimed yet) keep it,
//! and other nodes may only borrow from it.

use kube::ResourceExt;

use super::pool::PoolContext;
use crate::block_store::CasOutcome;

/// One pass over the indexed blocks; does nothing unless this replica leads.
pub async fn reconcile(context: PoolContext) {
    let now = std::time::Instant::now();
    let gone: Vec<(String, String)> = {
        let index = context.index.read();
        // A node gone for less than an agent Lease may still run its agent (a Node deleted by
        // hand): until that agent has failed a Lease renewal and stopped, it may bind a spare
        // whose pod has not posted its IP yet.
        let grace = index.default_agent_lease();
        index
            .blocks_by_name()
            .values()
            .filter_map(|b| {
                let node = b.spec.affinity.as_deref()?;
                let gone_long = index.node_gone_for(node, now).is_some_and(|gone| gone >= grace);
                (gone_long && crate::ipam::affinity::releasable(&b.spec, node)).then_some((b, node))
            })
            // A spare a pod still reports was bound by the node's agent just before the node
            // went (its record not written yet): the block waits for that pod to go.
            .filter(|(b, _)| {
                crate::ipam::spares::bindable(&b.spec).iter().all(|ip| index.live_holder(&ip.to_string()).is_none())
            })
            .map(|(b, node)| (b.name_any(), node.to_string()))
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
                tracing::warn!(%block, %node, error = %e, "releasing what a node that is gone held in the block failed; retrying on the next pass")
            }
        }
    }
}
