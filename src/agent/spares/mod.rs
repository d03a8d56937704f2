//! Spare IPs (`--spare-ips`, decision 0016): the node keeps a few IPs of each default pool
//! selecting it ([`crate::ipam::spares::kept_in`]) ready in its own blocks (`IPBlock.spec.spares`), so that an ADD of a pod
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
//!
//! One flow a file: `pick` (an ADD binds a spare), `withdraw` (a spare given back or taken
//! as a fixed IP, until its block shows it gone), `tend` (records written, spares reserved and
//! given back), `settle` (after a lost checkpoint) and `metrics`; this file holds the book the
//! node's calls share and the reads they all make.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::Notify;

use super::core::Core;
use crate::crd::IPBlock;
use crate::ipam::pools::{self, PoolSet};
use crate::ipam::{PoolLayout, spares};

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

mod metrics;
mod pick;
mod settle;
mod tend;
mod withdraw;

impl Core {
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

    /// The ready spares ((block, IP)) of `own` blocks: bindable under the pool's current
    /// `layout`, and in no checkpoint entry.
    fn ready_spares(
        &self,
        own: &[IPBlock],
        layout: &PoolLayout,
        in_checkpoint: &BTreeSet<IpAddr>,
    ) -> Vec<(String, IpAddr)> {
        own.iter()
            .flat_map(|b| {
                spares::bindable_in(&b.spec, layout, &self.settings.node, jiff::Timestamp::now())
                    .into_iter()
                    .map(|ip| (b.name_any(), ip))
            })
            .filter(|(_, ip)| !in_checkpoint.contains(ip))
            .collect()
    }

    /// The cached pools this node keeps spares in ([`spares::kept_in`]: by the pool checks its
    /// ADDs make, on the same caches), and none while its Node is absent
    /// ([`Core::node_registered`]).
    pub(super) fn pools_keeping_spares(&self) -> BTreeSet<String> {
        if !self.node_registered() {
            return BTreeSet::new();
        }
        let labels = self.node_labels_cached();
        let snapshot = self.pools.state();
        let set = PoolSet::of(&snapshot, &self.known_blocks());
        let views = set.views();
        let overlapping = pools::overlaps(&views, set.orphans());
        views.iter().filter(|v| spares::kept_in(v, &labels, &overlapping)).map(|v| v.name.to_string()).collect()
    }

    /// Whether the node cache holds this node's Node. While it does not (deleted with its agent
    /// still running, or not registered yet) the node binds no spare and gives its spares back:
    /// the leader clears a gone node's spares, and a spare bound then whose record could not be
    /// written yet would go to another node's pod too (issue 26, S1).
    fn node_registered(&self) -> bool {
        self.node.get(&ObjectRef::new(&self.settings.node)).is_some()
    }

    /// This node's labels, as the node cache has them.
    fn node_labels_cached(&self) -> BTreeMap<String, String> {
        self.node.get(&ObjectRef::new(&self.settings.node)).map(|n| n.labels().clone()).unwrap_or_default()
    }
}
