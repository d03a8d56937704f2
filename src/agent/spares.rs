//! Spare IPs (`--spare-ips`, decision 0016): the node keeps a few IPs of each pool it
//! allocates from ready in its own blocks (`IPBlock.spec.spares`), so that an ADD of a pod
//! whose workload keeps no IPs binds one in the checkpoint and answers without waiting for an
//! apiserver write. The pod's record replaces the spare right after ([`Core::tend_spares`],
//! woken by the ADD), in one batched write with the node's other block edits. The pure edits
//! are in [`crate::ipam::spares`].
//!
//! Which spare is free to bind: a bindable spare of the node's newest copy of its block that
//! no checkpoint entry holds, that no other call of this node has picked, and that is not
//! withdrawn ([`SpareBook`]). An ADD holds its pick until its checkpoint entry is saved (or it
//! failed), so two ADDs never bind one spare, and a spare bound before a crash is found in the
//! checkpoint at the next start. A spare being given back, or taken as a fixed IP, is
//! withdrawn for good: it is given back (again) on every pass until the node's copy of the
//! block shows it is no spare any more. A write whose outcome is unknown (a timeout) leaves
//! that copy behind, and no read tells whether such a write will still land, so the only safe
//! way back for the IP is through a write of the node's own.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use futures::future::join_all;
use jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::Notify;

use super::checkpoint::CheckpointIp;
use super::core::{Core, ResolvedPool};
use super::error::Error;
use crate::crd::{Allocation, IPBlock};
use crate::ipam::affinity::{self, Candidate, KnownBlock, Use};
use crate::ipam::{PoolLayout, blocks, pools, spares};

/// How often the spares are tended when no ADD wakes them: records that failed are written,
/// withdrawn spares settled, and pools that changed (deleted, disabled, full) get theirs back.
pub const TEND_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// How soon the tending tries again after a pass whose writes did not all go through.
pub const TEND_RETRY: std::time::Duration = std::time::Duration::from_millis(100);

/// What one pass of the tending writes to one block, and the block to make when it does
/// not exist yet (a free block claimed for spares).
#[derive(Default)]
struct Planned {
    tending: spares::Tending,
    create: Option<(String, ipnet::IpNet)>,
}

/// The spares the node's calls keep from each other.
#[derive(Default)]
struct Held {
    /// Picked by an ADD whose checkpoint entry is not saved yet.
    picked: BTreeSet<IpAddr>,
    /// Being given back or taken as a fixed IP: until the node's copy of the block shows them
    /// no spares any more.
    withdrawn: BTreeMap<IpAddr, Withdrawn>,
    /// Bound spares found lost (neither a spare nor their pod's record, or another pod's
    /// record), reported once; forgotten once no checkpoint entry binds them any more.
    lost: BTreeSet<IpAddr>,
}

/// A withdrawn spare.
struct Withdrawn {
    /// Its block.
    block: String,
    /// Whether the call that withdrew it (a fixed IP's ADD) has not written yet.
    busy: bool,
}

impl Held {
    fn holds(&self, ip: &IpAddr) -> bool {
        self.picked.contains(ip) || self.withdrawn.contains_key(ip)
    }
}

/// The node's spare IPs in use by its calls: how many it keeps per pool, and which its calls
/// hold.
pub struct SpareBook {
    /// How many spares the node keeps ready in each pool it keeps spares in (0: none).
    wanted: usize,
    held: Mutex<Held>,
    /// Wakes [`Core::tend_spares`]: an ADD bound spares, a spare was withdrawn, or the pools
    /// changed.
    wake: Arc<Notify>,
}

impl SpareBook {
    /// A book keeping `wanted` spares per pool, whose tending `wake` wakes.
    pub fn new(wanted: usize, wake: Arc<Notify>) -> Self {
        Self { wanted, held: Mutex::default(), wake }
    }

    fn held(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
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
        let own = self.own_blocks_of(&pool.name, &pool.layout);
        // Held first: a spare let go of after this point is in the checkpoint already.
        let mut held = self.spares.held();
        let in_checkpoint = self.held_in_checkpoint();
        for block in &own {
            let free = spares::bindable_in(&block.spec, &pool.layout)
                .into_iter()
                .find(|ip| !held.holds(ip) && !in_checkpoint.contains(ip));
            if let Some(ip) = free {
                held.picked.insert(ip);
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

    /// Withdraws `ip` if it is a ready spare of this node's block `block` (a fixed IP the pod
    /// asks for): says whether it did; the caller then takes it in a write of the block and
    /// calls [`Core::spare_write_done`].
    pub(super) fn withdraw_spare(&self, block: &str, ip: IpAddr) -> bool {
        let node = self.settings.node.as_str();
        let spare = self.newest_block(block).is_some_and(|b| spares::is_bindable_for(&b.spec, node, &ip.to_string()));
        let mut held = self.spares.held();
        if !spare || held.holds(&ip) || self.held_in_checkpoint().contains(&ip) {
            return false;
        }
        held.withdrawn.insert(ip, Withdrawn { block: block.to_string(), busy: true });
        true
    }

    /// After the write that took the withdrawn spare `ip` as a fixed IP (or failed to): lets
    /// go of it if the node's newest copy shows it settled (the write stored), and otherwise
    /// wakes the tending, which gives it back.
    pub(super) fn spare_write_done(&self, ip: IpAddr) {
        if let Some(withdrawn) = self.spares.held().withdrawn.get_mut(&ip) {
            withdrawn.busy = false;
        }
        self.settle_from_copies();
        if !self.spares.held().withdrawn.is_empty() {
            self.spares.wake.notify_one();
        }
    }

    /// Every IP the checkpoint holds.
    fn held_in_checkpoint(&self) -> BTreeSet<IpAddr> {
        self.checkpoint.read(|c| c.entries().flat_map(|e| &e.ips).filter_map(|i| i.ip.parse().ok()).collect())
    }

    /// The newest copies of this node's blocks of `pool` (laid out as `layout`: a block written
    /// under an earlier layout of the name is not the pool's), by address.
    fn own_blocks_of(&self, pool: &str, layout: &PoolLayout) -> Vec<IPBlock> {
        let node = self.settings.node.as_str();
        let mut own: Vec<(ipnet::IpNet, IPBlock)> = self
            .newest_blocks_of(pool)
            .into_iter()
            .filter(|b| b.spec.affinity.as_deref() == Some(node))
            .filter_map(|b| Some((b.spec.cidr.parse().ok().filter(|net| layout.is_block(*net))?, b)))
            .collect();
        own.sort_by_key(|(net, _)| *net);
        own.into_iter().map(|(_, b)| b).collect()
    }

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
    pub(super) async fn write_bound_spares(&self) {
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
            for pool in self.pools_to_tend() {
                self.plan_pool(&pool, &mut plans);
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

    /// Lets go of the withdrawn spares that the node's newest copy of their block no longer
    /// shows as its spares: what withdrew them was written.
    fn settle_from_copies(&self) {
        let settled = self.withdrawn_by_copy().1;
        let mut held = self.spares.held();
        for ip in settled {
            held.withdrawn.remove(&ip);
        }
    }

    /// The withdrawn spares no call is writing, by what the node's newest copy of their block
    /// shows: still its spares ((IP, block)), and no spares any more.
    fn withdrawn_by_copy(&self) -> (Vec<(IpAddr, String)>, Vec<IpAddr>) {
        let node = self.settings.node.as_str();
        let withdrawn: Vec<(IpAddr, String)> = self
            .spares
            .held()
            .withdrawn
            .iter()
            .filter(|(_, w)| !w.busy)
            .map(|(ip, w)| (*ip, w.block.clone()))
            .collect();
        let (still, gone): (Vec<_>, Vec<_>) = withdrawn.into_iter().partition(|(ip, block)| {
            self.newest_block(block).is_some_and(|b| spares::is_bindable_for(&b.spec, node, &ip.to_string()))
        });
        (still, gone.into_iter().map(|(ip, _)| ip).collect())
    }

    /// The pools whose spares this node tends: with `--spare-ips` above 0, those it keeps
    /// spares in ([`spares::kept_in`]: where its stateless pods go, so even its first burst finds
    /// spares), and every pool where it still holds spares (from an earlier run, or a pool that
    /// no longer keeps them), to give them back.
    fn pools_to_tend(&self) -> BTreeSet<String> {
        let node = self.settings.node.as_str();
        let mut tended: BTreeSet<String> = self
            .known_blocks()
            .iter()
            .filter(|b| b.spec.affinity.as_deref() == Some(node) && !b.spec.spares.is_empty())
            .map(|b| b.spec.pool.clone())
            .collect();
        if self.spares.wanted > 0 {
            let labels = self.node_labels_cached();
            tended.extend(self.pools.state().iter().filter(|p| spares::kept_in(p, &labels)).map(|p| p.name_any()));
        }
        tended
    }

    /// Plans what the node's blocks of `pool` get to bring its ready spares to their target:
    /// spares to reserve, block by block (as many as each has ready IPs for, then in a free
    /// block it claims), or spares to give back, withdrawn so no ADD takes them meanwhile.
    fn plan_pool(&self, pool: &str, plans: &mut BTreeMap<String, Planned>) {
        let Some(resolved) = self.resolve_pool(pool) else { return };
        let own = self.own_blocks_of(pool, &resolved.layout);
        let free = self.free_blocks(pool, &resolved.layout);
        let usable = self.keeps_spares_in(pool);
        // Spares never take the pool's last free block: that one goes to a node's first pod.
        let target = if usable { spares::target(self.spares.wanted, !free.is_empty()) } else { 0 };
        // Held first, then the checkpoint: a pick let go of after this is in the checkpoint.
        let mut held = self.spares.held();
        let in_checkpoint = self.held_in_checkpoint();
        // Spares the pool's current layout no longer hands out go back whatever the target.
        let stale: Vec<(String, IpAddr)> = own
            .iter()
            .flat_map(|b| spares::out_of_layout(&b.spec, &resolved.layout).into_iter().map(|ip| (b.name_any(), ip)))
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
        let known: Vec<KnownBlock<'_>> = blocks
            .iter()
            .filter_map(|b| {
                Some(KnownBlock {
                    name: b.metadata.name.as_deref()?,
                    net: b.spec.cidr.parse().ok()?,
                    affinity: b.spec.affinity.as_deref(),
                    records: b.spec.allocations.len() + b.spec.spares.len(),
                })
            })
            .collect();
        let node = self.settings.node.as_str();
        let mut free: Vec<Candidate> =
            affinity::plan(node, pool, layout, &known, 3).into_iter().filter(|c| c.how == Use::Claim).collect();
        free.pop();
        free
    }

    /// The ready spares ((block, IP)) of `own` blocks: bindable under the pool's current
    /// `layout`, and in no checkpoint entry.
    fn ready_spares(
        &self,
        own: &[IPBlock],
        layout: &PoolLayout,
        in_checkpoint: &BTreeSet<IpAddr>,
    ) -> Vec<(String, IpAddr)> {
        own.iter()
            .flat_map(|b| spares::bindable_in(&b.spec, layout).into_iter().map(|ip| (b.name_any(), ip)))
            .filter(|(_, ip)| !in_checkpoint.contains(ip))
            .collect()
    }

    /// Sets `ipwarden_agent_spare_ips` for every pool the node tends (and only those).
    fn count_ready_spares(&self) {
        let in_checkpoint = self.held_in_checkpoint();
        self.metrics.spare_ips.clear();
        for pool in self.pools_to_tend() {
            let Some(resolved) = self.resolve_pool(&pool) else { continue };
            let own = self.own_blocks_of(&pool, &resolved.layout);
            let ready = self.ready_spares(&own, &resolved.layout, &in_checkpoint).len();
            self.metrics
                .spare_ips
                .get_or_create(&super::metrics::PoolLabels { pool })
                .set(i64::try_from(ready).unwrap_or(i64::MAX));
        }
    }

    /// Whether this node keeps spares in the cached pool `pool` ([`spares::kept_in`]).
    fn keeps_spares_in(&self, pool: &str) -> bool {
        let labels = self.node_labels_cached();
        self.pools.state().iter().any(|p| p.name_any() == pool && spares::kept_in(p, &labels))
    }

    /// This node's labels, as the node cache has them.
    fn node_labels_cached(&self) -> BTreeMap<String, String> {
        self.node.get(&ObjectRef::new(&self.settings.node)).map(|n| n.labels().clone()).unwrap_or_default()
    }

    /// After the checkpoint was rebuilt from the records (lost or corrupt), no one knows which
    /// of this node's spares were bound: each one a pod of this node reports becomes that
    /// pod's record (as a repair writes it: its sandbox unknown), and the others leave the
    /// spares and cool down, as a released IP does. Only a pod's own network's interface
    /// ([`crate::ipam::fixed::POD_INTERFACE`], the one its status reports) takes spares. Written before the
    /// agent serves.
    pub async fn settle_spares_after_rebuild(&self, network: &str) -> Result<usize, Error> {
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
            let (reported, network, node) = (reported.clone(), network.to_string(), node.clone());
            let changed = self
                .write_block(&block.name_any(), &block.spec.pool, net, move |spec| {
                    let changed = spares::settle_unknown(spec, &node, &reported, &network, Timestamp::now());
                    (changed > 0).then_some(changed)
                })
                .await?;
            settled += changed.unwrap_or(0);
        }
        Ok(settled)
    }
}
