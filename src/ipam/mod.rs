//! The pure allocation domain: pool geometry and the choice of one IP within a block, which
//! pool a pod uses and which blocks a pool owns (`pools`), which blocks a node tries first
//! (`affinity`), the edits of a block's records (`blocks`), the IPs a pod asks for by name
//! (`fixed`), the IPs a node holds ready (`spares`), whether an IP may go to a request (`free`), and what a workload's owner wants
//! (`workload`).
//!
//! Nothing here does I/O: the node agent and the controller feed it what they read and
//! write back what it returns.

pub mod affinity;
pub mod blocks;
mod choose;
pub mod fixed;
pub mod free;
mod layout;
pub mod pool_conditions;
pub mod pools;
pub mod spares;
pub mod workload;

pub use choose::{BlockUsage, ChooseError, choose_ip};
pub use layout::{
    DEFAULT_BLOCK_PREFIX_V4, DEFAULT_BLOCK_PREFIX_V6, LayoutError, MAX_BLOCK_ADDRESSES, MIN_BLOCK_PREFIX_V4,
    MIN_BLOCK_PREFIX_V6, PoolLayout, first_host,
};

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Maps an address onto a number so that pool arithmetic is the same for both families.
fn addr_to_int(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// Inverse of [`addr_to_int`]; for IPv4 only the low 32 bits are meaningful.
fn int_to_addr(v4: bool, n: u128) -> IpAddr {
    if v4 { IpAddr::V4(Ipv4Addr::from(n as u32)) } else { IpAddr::V6(Ipv6Addr::from(n)) }
}
