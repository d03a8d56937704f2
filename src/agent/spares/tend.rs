//! The tending: one pass writes the records of bound spares, gives back and reserves spares,
//! one edit per block batched with the node's other writes.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use futures::future::join_all;
use jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;

use super::{Planned, Withdrawn};
use crate::agent::core::Core;
use crate::crd::{Allocation, IPBlock};
use crate::ipam::affinity::{self, Candidate, KnownBlock, Use};
use crate::ipam::{PoolLayout, pools, spares};

impl Core {
    /// Writes the records of the spares bound since the last pass (each replaces its spare),
    /// gives back the withdrawn spares again, and brings each pool's ready spares to what
    /// [`spares::target`] says: reserves more in the node's own blocks (or a free block it
    /// claims), or gives back what it holds beyond it (all of a pool being deleted, disabled,
    /// no longer selecting the node, or with at most one free block left for others to claim).
    /// What one block gets is one edit, so a pass writes each block at most once. Returns
    /// whether every write of the pass went through (else the caller tries again soon: a free
    /// block another node claimed first, a conflict, an apiserver error).
    pub async fn tend_spares(&self) -> bool {
        let done = self.tend(true).await;
        self.count_ready_spares();
        done
    }

    /// Writes the records of the spares bound before the agent stopped: start-up, before the
    /// start-up GC reads the blocks.
    pub(in crate::agent) async fn write_bound_spares(&self) {
        if !self.tend(false).await {
            tracing::warn!("writing the records of spares bound before the stop failed; the tending retries");
        }
    }

    /// One pass of the tending; `reserve`: also reserve and give back spares. Returns whether
    /// every write went through.
    async fn tend(&self, reserve: bool) -> bool {
        let node = self.settings.node.clone();
        let mut plans: BTreeMap<String, Planned> = BTreeMap::new();
        let bound: Vec<(String, String, Allocation)> = self.checkpoint.read(|c| {
            c.entries()
                .filter_map(|e| Some((e, e.spare_record.as_ref()?)))
                .flat_map(|(e, record)| e.ips.iter().map(move |i| (i.block.clone(), i.ip.clone(), (**record).clone())))
                .collect()
        });
        let still_bound: BTreeSet<IpAddr> = bound.iter().filter_map(|(_, ip, _)| ip.parse().ok()).collect();
        self.spares.held().lost.retain(|ip| still_bound.contains(ip));
        let mut copies: BTreeMap<String, Option<IPBlock>> = BTreeMap::new();
        for (block, ip, record) in bound {
            let copy = copies.entry(block.clone()).or_insert_with(|| self.newest_block(&block));
            let Some(copy) = copy.as_ref() else { continue };
            if copy.spec.affinity.as_deref() == Some(node.as_str()) && copy.spec.spares.contains(&ip) {
                plans.entry(block).or_default().tending.convert.push((ip, record));
            } else if copy.spec.allocations.get(&ip).is_none_or(|r| r.pod.uid != record.pod.uid)
                // A DEL releases the IP (stamping it) before its entry goes: no loss.
                && copy.spec.released.get(&ip).is_none_or(|at| at.0 < record.allocated_at.0)
            {
                self.report_lost(&block, &ip, &record);
            }
        }
        if reserve {
            // Withdrawn spares the node's copy still shows: given back (again).
            for (ip, block) in self.withdrawn_by_copy().0 {
                plans.entry(block).or_default().tending.give_back.push(ip);
            }
            // Which pools keep spares: worked out once a pass, from the caches as they are now.
            let kept = self.pools_keeping_spares();
            for pool in self.pools_to_tend(&kept) {
                self.plan_pool(&pool, &kept, &mut plans);
            }
            self.plan_orphaned(&mut plans);
        }
        let in_checkpoint = self.held_in_checkpoint();
        let cooldown = self.settings.cooldown;
        let writes = plans.into_iter().map(|(block, Planned { tending, create })| {
            let (exclude, node) = (in_checkpoint.clone(), node.clone());
            async move {
                let done = self
                    .edit_in_batch(&block, create, move |spec| {
                        let done = spares::tend(spec, &node, &tending, &exclude, Timestamp::now(), cooldown);
                        (done.changed(), done)
                    })
                    .await;
                match done {
                    Some(done) => {
                        let claimed = !done.claim_lost;
                        for (ip, pod) in done.held_by_other {
                            let first = ip.parse::<IpAddr>().is_ok_and(|addr| self.spares.held().lost.insert(addr));
                            if first {
                                tracing::error!(%ip, %block, %pod,
                                    "a spare bound on this node holds another pod's record; its record was not written");
                            }
                        }
                        claimed
                    }
                    None => {
                        tracing::debug!(%block, "tending the block's spares failed; retrying on the next pass");
                        false
                    }
                }
            }
        });
        let written = join_all(writes).await;
        self.settle_from_copies();
        written.into_iter().all(|ok| ok)
    }

    /// Logs, once per IP, a spare bound on this node that is neither a spare nor its pod's
    /// record any more: its pod runs with an IP no record holds (something that does not know
    /// spares rewrote the block).
    fn report_lost(&self, block: &str, ip: &str, record: &Allocation) {
        let Ok(addr) = ip.parse::<IpAddr>() else { return };
        if self.spares.held().lost.insert(addr) {
            tracing::error!(%ip, %block, pod = %format!("{}/{}", record.pod.namespace, record.pod.name),
                "a spare bound on this node is no spare and not its pod's record any more; its record was not written");
        }
    }

    /// The pools whose spares this node tends: with `--spare-ips` above 0, those it keeps
    /// spares in (`kept`, [`Core::pools_keeping_spares`]: where its stateless pods go, so even its
    /// first burst finds spares), and every pool where it still holds spares (from an earlier
    /// run, or a pool that no longer keeps them), to give them back.
    pub(super) fn pools_to_tend(&self, kept: &BTreeSet<String>) -> BTreeSet<String> {
        let node = self.settings.node.as_str();
        let mut tended: BTreeSet<String> = self
            .known_blocks()
            .iter()
            .filter(|b| b.spec.affinity.as_deref() == Some(node) && !b.spec.spares.is_empty())
            .map(|b| b.spec.pool.clone())
            .collect();
        if self.spares.wanted > 0 {
            tended.extend(kept.iter().cloned());
        }
        tended
    }

    /// Plans what the node's blocks of `pool` get to bring its ready spares to their target:
    /// spares to reserve, block by block (as many as each has ready IPs for, then in a free
    /// block it claims), or spares to give back, withdrawn so no ADD takes them meanwhile; none
    /// are kept unless `kept` (the pools keeping spares) names the pool.
    fn plan_pool(&self, pool: &str, kept: &BTreeSet<String>, plans: &mut BTreeMap<String, Planned>) {
        let Some(resolved) = self.resolve_pool(pool) else { return };
        let own = self.own_blocks_of(pool, &resolved.layout);
        let free = self.free_blocks(pool, &resolved.layout);
        let usable = kept.contains(pool);
        // Spares never take the pool's last free block: that one goes to a node's first pod.
        let target = if usable { spares::target(self.spares.wanted, !free.is_empty()) } else { 0 };
        // Held first, then the checkpoint: a pick let go of after this is in the checkpoint.
        let mut held = self.spares.held();
        let in_checkpoint = self.held_in_checkpoint();
        // Spares the pool's current layout no longer hands out go back whatever the target.
        let stale: Vec<(String, IpAddr)> = own
            .iter()
            .flat_map(|b| {
                spares::out_of_layout(&b.spec, &resolved.layout, Timestamp::now())
                    .into_iter()
                    .map(|ip| (b.name_any(), ip))
            })
            .filter(|(_, ip)| !in_checkpoint.contains(ip) && !held.holds(ip))
            .collect();
        for (block, ip) in &stale {
            held.withdrawn.insert(*ip, Withdrawn { block: block.clone(), busy: false });
            plans.entry(block.clone()).or_default().tending.give_back.push(*ip);
        }
        let ready: Vec<(String, IpAddr)> = self
            .ready_spares(&own, &resolved.layout, &in_checkpoint)
            .into_iter()
            .filter(|(_, ip)| !held.holds(ip))
            .collect();
        if ready.len() > target {
            for (block, ip) in &ready[target..] {
                held.withdrawn.insert(*ip, Withdrawn { block: block.clone(), busy: false });
                plans.entry(block.clone()).or_default().tending.give_back.push(*ip);
            }
            return;
        }
        drop(held);
        let mut missing = target - ready.len();
        let (now, cooldown) = (Timestamp::now(), self.settings.cooldown);
        for block in &own {
            let Ok(net) = block.spec.cidr.parse() else { continue };
            if missing == 0 {
                return;
            }
            // As many as the block has ready IPs for (a dry run on the copy held).
            let room =
                spares::reserve(&mut block.spec.clone(), &resolved.layout, net, missing, &in_checkpoint, now, cooldown);
            if !room.is_empty() {
                missing -= room.len();
                let reserve = spares::Reserve { layout: resolved.layout.clone(), net, count: room.len(), claim: false };
                plans.entry(block.name_any()).or_default().tending.reserve = Some(reserve);
            }
        }
        // The node's own blocks have no room: it claims a free block for the rest, as an ADD
        // would, in the write that reserves them (which makes the block when it does not exist
        // yet, and leaves it when another node claimed it first).
        // Only when another free block stays after it: else the next pass's target is 0 and the
        // block would be claimed for spares given back at once.
        let claimable = free.len() >= 2;
        if let Some(free) = free.into_iter().next().filter(|_| missing > 0 && claimable) {
            let count = missing.min(resolved.layout.allocatable_in(free.net).count());
            let reserve = spares::Reserve { layout: resolved.layout.clone(), net: free.net, count, claim: true };
            let planned = plans.entry(free.name).or_default();
            planned.tending.reserve = Some(reserve);
            planned.create = Some((pool.to_string(), free.net));
        }
    }

    /// Plans giving back every ready spare of this node's orphaned blocks (their pool is gone,
    /// or laid out anew so it no longer has them: [`pools::block_is_retired`] of a pool not being
    /// deleted): no pool's tending reaches them, and an orphan holding spares would stay, keeping
    /// every pool over its CIDR `Overlapping` (issue 26, F1). A spare a checkpoint entry holds
    /// (a pod bound it before the pool went) stays until that pod's DEL releases it.
    fn plan_orphaned(&self, plans: &mut BTreeMap<String, Planned>) {
        let node = self.settings.node.as_str();
        let orphaned: Vec<Arc<IPBlock>> = self
            .known_blocks()
            .into_iter()
            .filter(|b| b.spec.affinity.as_deref() == Some(node) && !b.spec.spares.is_empty())
            .filter(|b| {
                let pool = self.pools.get(&ObjectRef::new(&b.spec.pool));
                pools::block_is_retired(pool.as_deref().map(|p| (&p.spec, false)), &b.spec.cidr)
            })
            .collect();
        if orphaned.is_empty() {
            return;
        }
        // Held first, then the checkpoint: a pick let go of after this is in the checkpoint.
        let mut held = self.spares.held();
        let in_checkpoint = self.held_in_checkpoint();
        for block in orphaned {
            let name = block.name_any();
            for ip in spares::bindable(&block.spec) {
                if in_checkpoint.contains(&ip) || held.holds(&ip) {
                    continue;
                }
                held.withdrawn.insert(ip, Withdrawn { block: name.clone(), busy: false });
                plans.entry(name.clone()).or_default().tending.give_back.push(ip);
            }
        }
    }

    /// The blocks of pool `pool` (laid out as `layout`) that no node has claimed and that have
    /// an allocatable address, in the order an ADD would claim them ([`affinity::plan`]), but
    /// the last one: empty when the pool has at most one left, as far as this node knows.
    fn free_blocks(&self, pool: &str, layout: &PoolLayout) -> Vec<Candidate> {
        let blocks = self.newest_blocks_of(pool);
        let known: Vec<KnownBlock<'_>> = blocks.iter().filter_map(KnownBlock::of).collect();
        let node = self.settings.node.as_str();
        let mut free: Vec<Candidate> =
            affinity::plan(node, pool, layout, &known, 3).into_iter().filter(|c| c.how == Use::Claim).collect();
        free.pop();
        free
    }
}
