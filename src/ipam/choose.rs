//! Choosing the next IP to hand out within one block.
//!
//! A just-released address may still sit in a peer's conntrack table or ARP cache, so it
//! is held back for a cooldown, and among the ready addresses the one released longest
//! ago is reused first.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use jiff::Timestamp;
use thiserror::Error;

use super::PoolLayout;

/// What is currently known about the addresses of one block: which are in use and when
/// the others were last released.
#[derive(Debug, Clone, Copy)]
pub struct BlockUsage<'a> {
    /// Addresses of the block currently assigned to a workload.
    pub allocated: &'a BTreeSet<IpAddr>,
    /// When each previously used address of the block was last released.
    pub released: &'a BTreeMap<IpAddr, Timestamp>,
}

/// Why no address could be chosen in a block; the caller then tries another block.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ChooseError {
    /// Every allocatable address of the block is allocated.
    #[error("every allocatable ip of block {block} is allocated")]
    Exhausted {
        /// The block that was searched.
        block: IpNet,
    },
    /// Some addresses are free but all of them were released too recently.
    #[error(
        "all {cooling} free IPs of block {block} are cooling down after release; the first is free at {next_free_at}"
    )]
    Cooling {
        /// The block that was searched.
        block: IpNet,
        /// How many free addresses are cooling down.
        cooling: usize,
        /// The earliest instant at which one of them becomes ready.
        next_free_at: Timestamp,
    },
    /// The given network is not an aligned block of the pool's block size.
    #[error("{block} is not a block of pool {cidr}")]
    NotABlock {
        /// The network passed as a block.
        block: IpNet,
        /// The pool CIDR.
        cidr: IpNet,
    },
}

/// Picks the address to hand out in `block`: an allocatable, unallocated one whose
/// `cooldown` since release has passed, preferring the one released longest ago (never
/// released first), then the lowest; a zero `cooldown` disables cooling.
pub fn choose_ip(
    layout: &PoolLayout,
    block: IpNet,
    usage: BlockUsage<'_>,
    now: Timestamp,
    cooldown: Duration,
) -> Result<IpAddr, ChooseError> {
    if layout.block_of(block.network()) != Some(block) {
        return Err(ChooseError::NotABlock { block, cidr: layout.cidr() });
    }
    let mut best: Option<(Option<Timestamp>, IpAddr)> = None;
    let mut cooling = 0usize;
    let mut next_free_at: Option<Timestamp> = None;
    for ip in layout.allocatable_in(block).filter(|ip| !usage.allocated.contains(ip)) {
        let released = usage.released.get(&ip).copied();
        if let Some(at) = released
            && !cooldown.is_zero()
        {
            let free_at = at.checked_add(cooldown).unwrap_or(Timestamp::MAX);
            if free_at > now {
                cooling += 1;
                next_free_at = Some(next_free_at.map_or(free_at, |t| t.min(free_at)));
                continue;
            }
        }
        // Addresses come in ascending order, so a strict comparison keeps the lowest on ties.
        if best.is_none_or(|(best_released, _)| released < best_released) {
            best = Some((released, ip));
        }
    }
    match (best, next_free_at) {
        (Some((_, ip)), _) => Ok(ip),
        (None, Some(next_free_at)) => Err(ChooseError::Cooling { block, cooling, next_free_at }),
        (None, None) => Err(ChooseError::Exhausted { block }),
    }
}
