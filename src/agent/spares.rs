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
use crate::ipam::spares::{self, Converted};

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
    /// then brings each pool's ready spares to what [`spares::target`] says: reserves more in
    /// the node's own blocks, or gives back what it holds beyond it (all of a pool being
    /// deleted or disabled, or without a free block left for others to claim).
    pub async fn tend_spares(&self) {
        self.convert_bound_spares().await;
        let node = self.settings.node.clone();
        let known = self.known_blocks();
        let mut pools: BTreeSet<String> = known
            .iter()
            .filter(|b| b.spec.affinity.as_deref() == Some(node.as_str()))
            .map(|b| b.spec.pool.clone())
            .collect();
        if self.spares.wanted == 0 {
            // Only to give back what an earlier run with spares left.
            pools.retain(|pool| known.iter().any(|b| b.spec.pool == *pool && !b.spec.spares.is_empty()));
        }
        for pool in pools {
            self.tend_pool(&pool, &known).await;
        }
    }

    /// Writes the record of every spare the checkpoint binds and the node's newest copy of
    /// its block still shows as a spare, all at once (the node's writes of one block share a
    /// write). A failure is retried by the next pass.
    pub(super) async fn convert_bound_spares(&self) {
        let bound: Vec<(String, String, Allocation)> = self.checkpoint.read(|c| {
            c.entries()
                .filter_map(|e| Some((e, e.spare_record.as_ref()?)))
                .flat_map(|(e, record)| e.ips.iter().map(move |i| (i.block.clone(), i.ip.clone(), (**record).clone())))
                .collect()
        });
        let due: Vec<(String, String, Allocation)> = bound
            .into_iter()
            .filter(|(block, ip, _)| self.newest_block(block).is_some_and(|b| b.spec.spares.contains(ip)))
            .collect();
        let writes = due.into_iter().map(|(block, ip, record)| async move {
            let converted = self
                .edit_in_batch(&block, None, {
                    let (ip, record) = (ip.clone(), record.clone());
                    move |spec| {
                        let converted = spares::convert(spec, &ip, &record);
                        (converted == Converted::Written, converted)
                    }
                })
                .await;
            match converted {
                Some(Converted::HeldByOther) => {
                    tracing::error!(%ip, %block, pod = %format!("{}/{}", record.pod.namespace, record.pod.name),
                    "a spare bound on this node holds another pod's record; its record was not written")
                }
                Some(_) => {}
                None => {
                    tracing::debug!(%ip, %block, "writing a bound spare's record failed; retrying on the next pass")
                }
            }
        });
        join_all(writes).await;
    }

    /// Brings the ready spares of `pool` on this node to their target.
    async fn tend_pool(&self, pool: &str, known: &[Arc<IPBlock>]) {
        let Some(resolved) = self.resolve_pool(pool) else {
            return self.give_back_all(pool).await;
        };
        let usable = !resolved.deleting && !self.pool_disabled(pool);
        let claimed = known
            .iter()
            .filter(|b| b.spec.pool == pool && (b.spec.affinity.is_some() || !blocks::holds_nothing(&b.spec)))
            .count();
        let free_blocks = u128::try_from(claimed).is_ok_and(|claimed| claimed < resolved.layout.block_count());
        let target = if usable { spares::target(self.spares.wanted, free_blocks) } else { 0 };
        let in_checkpoint = self.held_in_checkpoint();
        let own = self.own_blocks_of(pool);
        let ready: Vec<(String, IpAddr)> = own
            .iter()
            .flat_map(|b| spares::bindable(&b.spec).into_iter().map(|ip| (b.name_any(), ip)))
            .filter(|(_, ip)| !in_checkpoint.contains(ip))
            .collect();
        self.metrics
            .spare_ips
            .get_or_create(&super::metrics::PoolLabels { pool: pool.to_string() })
            .set(i64::try_from(ready.len()).unwrap_or(i64::MAX));
        if ready.len() > target {
            let extra = ready[target..].to_vec();
            return self.give_back(extra).await;
        }
        let mut missing = target - ready.len();
        for block in &own {
            if missing == 0 {
                break;
            }
            let Ok(net) = block.spec.cidr.parse() else { continue };
            let (layout, exclude, cooldown) = (resolved.layout.clone(), in_checkpoint.clone(), self.settings.cooldown);
            let added = self
                .edit_in_batch(&block.name_any(), None, move |spec| {
                    let added = spares::reserve(spec, &layout, net, missing, &exclude, Timestamp::now(), cooldown);
                    (!added.is_empty(), added.len())
                })
                .await
                .unwrap_or(0);
            missing = missing.saturating_sub(added);
        }
    }

    /// Gives back the spares `ready` ((block, IP)) that no call holds: withdrawn from the
    /// book while their blocks are written, so no ADD binds one meanwhile.
    async fn give_back(&self, ready: Vec<(String, IpAddr)>) {
        let withdrawn: Vec<(String, IpAddr)> = {
            let mut held = self.spares.held();
            ready.into_iter().filter(|(_, ip)| held.insert(*ip)).collect()
        };
        let mut by_block: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
        for (block, ip) in &withdrawn {
            by_block.entry(block.clone()).or_default().push(*ip);
        }
        let writes = by_block.into_iter().map(|(block, ips)| async move {
            let gone = self
                .edit_in_batch(&block, None, move |spec| {
                    let gone = spares::give_back(spec, &ips);
                    (gone > 0, gone)
                })
                .await;
            if gone.is_none() {
                tracing::debug!(%block, "giving spares back failed; retrying on the next pass");
            }
        });
        join_all(writes).await;
        self.spares.release(withdrawn.into_iter().map(|(_, ip)| ip));
    }

    /// Gives back every ready spare of `pool` (a pool the cache no longer has).
    async fn give_back_all(&self, pool: &str) {
        let in_checkpoint = self.held_in_checkpoint();
        let ready: Vec<(String, IpAddr)> = self
            .own_blocks_of(pool)
            .iter()
            .flat_map(|b| spares::bindable(&b.spec).into_iter().map(|ip| (b.name_any(), ip)))
            .filter(|(_, ip)| !in_checkpoint.contains(ip))
            .collect();
        self.give_back(ready).await;
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
