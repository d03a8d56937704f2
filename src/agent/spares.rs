//! Spare IPs (`--spare-ips`, decision 0016): the node keeps a few IPs of each pool it
//! allocates from ready in its own blocks (`IPBlock.spec.spares`), so that an ADD of a pod
//! whose workload keeps no IPs binds one in the checkpoint and answers without waiting for an
//! apiserver write. The pod's record replaces the spare right after ([`Core::tend_spares`],
//! woken by the ADD), in one batched write with the node's other block edits. The pure edits
//! are in [`crate::ipam::spares`].
//!
//! Which spare is free to bind: a bindable spare of the node's newest copy of the block that
//! no checkpoint entry holds and no other call of this node has picked or withdrawn
//! ([`SpareBook`]). An ADD holds its pick until its checkpoint entry is saved (or it failed),
//! so two ADDs never bind one spare, and a spare bound before a crash is found in the
//! checkpoint at the next start.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use futures::future::join_all;
use jiff::Timestamp;
use kube::ResourceExt;
use tokio::sync::Notify;

use super::checkpoint::CheckpointIp;
use super::core::{Core, ResolvedPool};
use crate::crd::{Allocation, IPBlock};
use crate::ipam::blocks;
use crate::ipam::spares;

/// How often the spares are tended when no ADD wakes them: conversions that failed are
/// retried, and pools that changed (deleted, disabled, full) get theirs given back.
pub const TEND_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// The node's spare IPs in use by its calls: how many it keeps per pool, and which it has
/// picked or withdrawn.
pub struct SpareBook {
    /// How many spares the node keeps ready in each pool it allocates from (0: none).
    wanted: usize,
    /// Spares an ADD picked and has not saved in the checkpoint yet, or that are being given
    /// back: no other call takes them.
    held: Mutex<BTreeSet<IpAddr>>,
    /// Wakes [`Core::tend_spares`]: an ADD bound spares.
    wake: Arc<Notify>,
}

impl SpareBook {
    /// A book keeping `wanted` spares per pool.
    pub fn new(wanted: usize) -> Self {
        Self { wanted, held: Mutex::default(), wake: Arc::default() }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, BTreeSet<IpAddr>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lets go of `ips` (picked or withdrawn).
    fn release(&self, ips: impl IntoIterator<Item = IpAddr>) {
        let mut held = self.held();
        for ip in ips {
            held.remove(&ip);
        }
    }
}

impl Core {
    /// Picks a spare of `pool` for an ADD, if the node keeps spares and has one ready: the
    /// lowest bindable spare of its own blocks that no checkpoint entry and no other call
    /// holds. The caller saves it in the checkpoint, then calls [`Core::spares_saved`].
    pub(super) fn pick_spare(&self, pool: &ResolvedPool) -> Option<CheckpointIp> {
        if self.spares.wanted == 0 || pool.deleting {
            return None;
        }
        let in_checkpoint = self.held_in_checkpoint();
        let own = self.own_blocks_of(&pool.name);
        let mut held = self.spares.held();
        for block in &own {
            let free =
                spares::bindable(&block.spec).into_iter().find(|ip| !held.contains(ip) && !in_checkpoint.contains(ip));
            if let Some(ip) = free {
                held.insert(ip);
                self.metrics.spare_ips_bound.inc();
                return Some(CheckpointIp {
                    ip: ip.to_string(),
                    prefix_len: pool.layout.cidr().prefix_len(),
                    gateway: pool.gateway.clone(),
                    pool: pool.name.clone(),
                    block: block.name_any(),
                });
            }
        }
        None
    }

    /// Lets go of an ADD's picked spares once its checkpoint entry is saved (they are bound
    /// from now on) or failed (they are free again), and wakes the tending when they were
    /// bound, so their records are written at once.
    pub(super) fn spares_saved(&self, picked: &[CheckpointIp], bound: bool) {
        if picked.is_empty() {
            return;
        }
        self.spares.release(picked.iter().filter_map(|ip| ip.ip.parse().ok()));
        if bound {
            self.spares.wake.notify_one();
        }
    }

    /// Keeps `ip` from the node's other calls if it is a ready spare of this node's block
    /// `block` (a fixed IP the pod asks for): says whether it did; the caller then takes it
    /// and lets go with [`Core::let_go_of_spare`].
    pub(super) fn withdraw_spare(&self, block: &str, ip: IpAddr) -> bool {
        let spare = self.newest_block(block).is_some_and(|b| {
            b.spec.affinity.as_deref() == Some(self.settings.node.as_str())
                && spares::is_bindable(&b.spec, &ip.to_string())
        });
        spare && !self.held_in_checkpoint().contains(&ip) && self.spares.held().insert(ip)
    }

    /// Lets go of a spare [`Core::withdraw_spare`] kept.
    pub(super) fn let_go_of_spare(&self, ip: IpAddr) {
        self.spares.release([ip]);
    }

    /// Every IP the checkpoint holds.
    fn held_in_checkpoint(&self) -> BTreeSet<IpAddr> {
        self.checkpoint.read(|c| c.entries().flat_map(|e| &e.ips).filter_map(|i| i.ip.parse().ok()).collect())
    }

    /// The newest copies of this node's blocks of `pool`, by address.
    fn own_blocks_of(&self, pool: &str) -> Vec<IPBlock> {
        let node = self.settings.node.as_str();
        let mut own: Vec<IPBlock> =
            self.newest_blocks_of(pool).into_iter().filter(|b| b.spec.affinity.as_deref() == Some(node)).collect();
        own.sort_by_key(|b| b.spec.cidr.parse::<ipnet::IpNet>().ok());
        own
    }

    /// What an ADD that bound spares notifies, so [`Core::tend_spares`] runs at once.
    pub fn spares_wake(&self) -> Arc<Notify> {
        self.spares.wake.clone()
    }

    /// Writes the records of the spares bound since the last pass (each replaces its spare),
    /// and brings each pool's ready spares to what [`spares::target`] says: reserves more in
    /// the node's own blocks, or gives back what it holds beyond it (all of a pool being
    /// deleted or disabled, or without a free block left for others to claim). What one block
    /// gets is one edit, so a pass writes each block at most once.
    pub async fn tend_spares(&self) {
        self.tend(true).await;
    }

    /// Writes the records of the spares bound before the agent stopped: start-up, before the
    /// start-up GC reads the blocks.
    pub(super) async fn write_bound_spares(&self) {
        self.tend(false).await;
    }

    /// One pass of the tending; `reserve`: also reserve and give back spares.
    async fn tend(&self, reserve: bool) {
        let in_checkpoint = self.held_in_checkpoint();
        let mut plans: BTreeMap<String, spares::Tending> = BTreeMap::new();
        let bound: Vec<(String, String, Allocation)> = self.checkpoint.read(|c| {
            c.entries()
                .filter_map(|e| Some((e, e.spare_record.as_ref()?)))
                .flat_map(|(e, record)| e.ips.iter().map(move |i| (i.block.clone(), i.ip.clone(), (**record).clone())))
                .collect()
        });
        for (block, ip, record) in bound {
            if self.newest_block(&block).is_some_and(|b| b.spec.spares.contains(&ip)) {
                plans.entry(block).or_default().convert.push((ip, record));
            }
        }
        let mut withdrawn = Vec::new();
        if reserve {
            for pool in self.pools_to_tend() {
                self.plan_pool(&pool, &in_checkpoint, &mut plans, &mut withdrawn);
            }
        }
        let cooldown = self.settings.cooldown;
        let writes = plans.into_iter().map(|(block, plan)| {
            let exclude = in_checkpoint.clone();
            async move {
                let done = self
                    .edit_in_batch(&block, None, move |spec| {
                        let done = spares::tend(spec, &plan, &exclude, Timestamp::now(), cooldown);
                        (done.changed(), done)
                    })
                    .await;
                match done {
                    Some(done) => {
                        for (ip, pod) in done.held_by_other {
                            tracing::error!(%ip, %block, %pod,
                                "a spare bound on this node holds another pod's record; its record was not written");
                        }
                    }
                    None => tracing::debug!(%block, "tending the block's spares failed; retrying on the next pass"),
                }
            }
        });
        join_all(writes).await;
        self.spares.release(withdrawn);
        if reserve {
            self.count_ready_spares();
        }
    }

    /// The pools whose spares this node tends: those with a block affine to it (the pools it
    /// allocates from); with `--spare-ips 0`, only those where it still holds spares (from an
    /// earlier run), to give them back.
    fn pools_to_tend(&self) -> BTreeSet<String> {
        let node = self.settings.node.as_str();
        let known = self.known_blocks();
        known
            .iter()
            .filter(|b| b.spec.affinity.as_deref() == Some(node))
            .filter(|b| self.spares.wanted > 0 || !b.spec.spares.is_empty())
            .map(|b| b.spec.pool.clone())
            .collect()
    }

    /// Plans what the node's blocks of `pool` get to bring its ready spares to their target:
    /// spares to reserve, block by block (as many as each has ready IPs for), or spares to give
    /// back, withdrawn from the book (`withdrawn`) so no ADD takes them meanwhile.
    fn plan_pool(
        &self,
        pool: &str,
        in_checkpoint: &BTreeSet<IpAddr>,
        plans: &mut BTreeMap<String, spares::Tending>,
        withdrawn: &mut Vec<IpAddr>,
    ) {
        let resolved = self.resolve_pool(pool);
        let target = match &resolved {
            Some(resolved) if !resolved.deleting && !self.pool_disabled(pool) => {
                spares::target(self.spares.wanted, self.pool_has_free_block(pool, &resolved.layout))
            }
            _ => 0,
        };
        let own = self.own_blocks_of(pool);
        let ready = self.ready_spares(&own, in_checkpoint);
        if ready.len() > target {
            let mut held = self.spares.held();
            for (block, ip) in &ready[target..] {
                if held.insert(*ip) {
                    withdrawn.push(*ip);
                    plans.entry(block.clone()).or_default().give_back.push(*ip);
                }
            }
            return;
        }
        let (Some(resolved), mut missing) = (resolved, target - ready.len()) else { return };
        let now = Timestamp::now();
        for block in &own {
            let Ok(net) = block.spec.cidr.parse() else { continue };
            if missing == 0 {
                break;
            }
            // As many as the block has ready IPs for (a dry run on the copy held).
            let mut copy = block.spec.clone();
            let room =
                spares::reserve(&mut copy, &resolved.layout, net, missing, in_checkpoint, now, self.settings.cooldown);
            if room.is_empty() {
                continue;
            }
            missing -= room.len();
            plans.entry(block.name_any()).or_default().reserve =
                Some(spares::Reserve { layout: resolved.layout.clone(), net, count: room.len() });
        }
    }

    /// Whether pool `pool` (laid out as `layout`) has a block no node has claimed, as far as
    /// this node knows.
    fn pool_has_free_block(&self, pool: &str, layout: &crate::ipam::PoolLayout) -> bool {
        let claimed = self
            .known_blocks()
            .iter()
            .filter(|b| b.spec.pool == pool && (b.spec.affinity.is_some() || !blocks::holds_nothing(&b.spec)))
            .count();
        u128::try_from(claimed).is_ok_and(|claimed| claimed < layout.block_count())
    }

    /// The ready spares ((block, IP)) of `own` blocks: bindable, and in no checkpoint entry.
    fn ready_spares(&self, own: &[IPBlock], in_checkpoint: &BTreeSet<IpAddr>) -> Vec<(String, IpAddr)> {
        own.iter()
            .flat_map(|b| spares::bindable(&b.spec).into_iter().map(|ip| (b.name_any(), ip)))
            .filter(|(_, ip)| !in_checkpoint.contains(ip))
            .collect()
    }

    /// Sets `ipwarden_agent_spare_ips` for every pool the node tends.
    fn count_ready_spares(&self) {
        let in_checkpoint = self.held_in_checkpoint();
        for pool in self.pools_to_tend() {
            let ready = self.ready_spares(&self.own_blocks_of(&pool), &in_checkpoint).len();
            self.metrics
                .spare_ips
                .get_or_create(&super::metrics::PoolLabels { pool })
                .set(i64::try_from(ready).unwrap_or(i64::MAX));
        }
    }

    /// Whether the cached pool `pool` is disabled (`spec.disabled`).
    fn pool_disabled(&self, pool: &str) -> bool {
        self.pools.state().iter().any(|p| p.name_any() == pool && p.spec.disabled)
    }

    /// After the checkpoint was rebuilt from the records (lost or corrupt), no one knows which
    /// of this node's spares were bound: each one a pod of this node reports becomes that
    /// pod's record (as a repair writes it: its sandbox unknown), and the others leave the
    /// spares and cool down, as a released IP does. Written before the agent serves.
    pub async fn settle_spares_after_rebuild(&self, network: &str) -> Result<usize, super::error::Error> {
        let node = self.settings.node.clone();
        let reported: BTreeMap<String, blocks::Adopter> = self
            .pods
            .state()
            .iter()
            .map(|p| crate::gc::index::PodFacts::of(p))
            .filter(|facts| !facts.finished())
            .flat_map(|facts| {
                let adopter = blocks::Adopter {
                    pod: crate::crd::PodRef { namespace: facts.namespace, name: facts.name, uid: facts.uid },
                    node: node.clone(),
                    owner: facts.owner,
                    sticky: false,
                };
                facts.ips.into_iter().map(move |ip| (ip, adopter.clone()))
            })
            .collect();
        let mut settled = 0;
        for block in self.blocks.state().iter().filter(|b| b.spec.affinity.as_deref() == Some(node.as_str())) {
            if block.spec.spares.is_empty() {
                continue;
            }
            let Ok(net) = block.spec.cidr.parse() else { continue };
            let (reported, network) = (reported.clone(), network.to_string());
            let changed = self
                .write_block(&block.name_any(), &block.spec.pool, net, move |spec| {
                    let changed = spares::settle_unknown(spec, &reported, &network, Timestamp::now());
                    (changed > 0).then_some(changed)
                })
                .await?;
            settled += changed.unwrap_or(0);
        }
        Ok(settled)
    }
}
