//! Picking a spare for an ADD and holding it until the ADD's checkpoint entry is saved.

use std::net::IpAddr;

use kube::ResourceExt;

use crate::agent::checkpoint::CheckpointIp;
use crate::agent::core::{Core, ResolvedPool};
use crate::ipam::spares;

impl Core {
    /// Picks a spare of `pool` for an ADD, if the node keeps spares, its Node exists, and it has
    /// one ready: the lowest bindable spare of its own blocks that no checkpoint entry and no
    /// other call holds. The caller saves it in the checkpoint, then calls
    /// [`Core::spares_saved`].
    pub(in crate::agent) fn pick_spare(&self, pool: &ResolvedPool) -> Option<CheckpointIp> {
        if self.spares.wanted == 0 || pool.deleting || !self.node_registered() {
            return None;
        }
        let own = self.own_blocks_of(&pool.name, &pool.layout);
        // Held first: a spare let go of after this point is in the checkpoint already.
        let mut held = self.spares.held();
        let in_checkpoint = self.held_in_checkpoint();
        let now = jiff::Timestamp::now();
        for block in &own {
            let free = spares::bindable_in(&block.spec, &pool.layout, &self.settings.node, now)
                .into_iter()
                .find(|ip| !held.holds(ip) && !in_checkpoint.contains(ip));
            if let Some(ip) = free {
                held.picked.insert(ip);
                return Some(pool.checkpoint_ip(ip.to_string(), block.name_any()));
            }
        }
        None
    }

    /// Lets go of an ADD's picked spares once its checkpoint entry is saved (they are bound
    /// from now on) or failed (they are free again), and wakes the tending when they were
    /// bound, so their records are written at once.
    pub(in crate::agent) fn spares_saved(&self, picked: &[CheckpointIp], bound: bool) {
        if picked.is_empty() {
            return;
        }
        let mut held = self.spares.held();
        for ip in picked.iter().filter_map(|ip| ip.ip.parse::<IpAddr>().ok()) {
            held.picked.remove(&ip);
        }
        drop(held);
        if bound {
            self.metrics.spare_ips_bound.inc_by(u64::try_from(picked.len()).unwrap_or(u64::MAX));
            self.spares.wake.notify_one();
        }
    }
}
