//! The pure IP allocation engine: pool geometry and the choice of one IP within a block.
//!
//! Nothing here does I/O or knows about Kubernetes; the node agent feeds it the pool
//! configuration and the current usage of a block and gets back the address to hand out.

mod choose;
mod layout;

pub use choose::{BlockUsage, ChooseError, choose_ip};
pub use layout::{
    DEFAULT_BLOCK_PREFIX_V4, DEFAULT_BLOCK_PREFIX_V6, LayoutError, MAX_BLOCK_ADDRESSES, MIN_BLOCK_PREFIX_V4,
    MIN_BLOCK_PREFIX_V6, PoolLayout,
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
