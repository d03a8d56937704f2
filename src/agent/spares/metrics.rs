//! `ipwarden_agent_spare_ips`: the ready spares of every pool the node tends.

use crate::agent::core::Core;

impl Core {
    /// Sets `ipwarden_agent_spare_ips` for every pool the node tends (and only those).
    pub(super) fn count_ready_spares(&self) {
        let in_checkpoint = self.held_in_checkpoint();
        self.metrics.spare_ips.clear();
        for pool in self.pools_to_tend(&self.pools_keeping_spares()) {
            let Some(resolved) = self.resolve_pool(&pool) else { continue };
            let own = self.own_blocks_of(&pool, &resolved.layout);
            let ready = self.ready_spares(&own, &resolved.layout, &in_checkpoint).len();
            self.metrics
                .spare_ips
                .get_or_create(&crate::agent::metrics::PoolLabels { pool })
                .set(i64::try_from(ready).unwrap_or(i64::MAX));
        }
    }
}
