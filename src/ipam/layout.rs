//! Pool geometry: which addresses of a pool may ever be handed out, and how the pool
//! splits into fixed-size blocks that nodes claim one at a time.
//!
//! All address sets are kept as sorted intervals of numbers, so even an IPv6 /64 pool
//! is described, counted and walked without enumerating its addresses.

use std::net::IpAddr;

use ipnet::IpNet;
use thiserror::Error;

use super::{addr_to_int, int_to_addr};

/// Most addresses one block may hold: a block is stored as one etcd object, and etcd
/// refuses objects much above 1.5 MB, so its size must stay bounded.
pub const MAX_BLOCK_ADDRESSES: u32 = 4096;
/// Shortest IPv4 block prefix allowed; a /20 holds exactly [`MAX_BLOCK_ADDRESSES`].
pub const MIN_BLOCK_PREFIX_V4: u8 = 20;
/// Shortest IPv6 block prefix allowed; a /116 holds exactly [`MAX_BLOCK_ADDRESSES`].
pub const MIN_BLOCK_PREFIX_V6: u8 = 116;
/// IPv4 block prefix used when none is configured (or the pool's own, if longer).
pub const DEFAULT_BLOCK_PREFIX_V4: u8 = 24;
/// IPv6 block prefix used when none is configured (or the pool's own, if longer).
pub const DEFAULT_BLOCK_PREFIX_V6: u8 = 120;

/// An inclusive interval of addresses, as numbers.
type Interval = (u128, u128);

/// Why a pool configuration was rejected; each message names the offending input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    /// The pool CIDR does not parse.
    #[error("cidr {input:?} is not an ip network such as 10.0.0.0/16 or fd00::/64")]
    InvalidCidr {
        /// The text given as the pool CIDR.
        input: String,
    },
    /// A CIDR (the pool's or an exclusion) has bits set beyond its prefix.
    #[error("{what} {input} has host bits set; did you mean {network}?")]
    HostBitsSet {
        /// Which setting held the CIDR ("cidr" or "exclude").
        what: &'static str,
        /// The text as given.
        input: String,
        /// The same network with its host bits cleared.
        network: IpNet,
    },
    /// The block prefix is longer than an address of the pool's family.
    #[error("block prefix /{block_prefix} is longer than /{max}, the longest prefix of cidr {cidr}")]
    BlockPrefixTooLong {
        /// The configured block prefix.
        block_prefix: u8,
        /// The address length of the pool's family.
        max: u8,
        /// The pool CIDR.
        cidr: IpNet,
    },
    /// The block prefix is shorter than the pool's, so a block would not fit in the pool.
    #[error("block prefix /{block_prefix} is shorter than the prefix of cidr {cidr}; a block must fit inside the pool")]
    BlockPrefixShorterThanPool {
        /// The configured block prefix.
        block_prefix: u8,
        /// The pool CIDR.
        cidr: IpNet,
    },
    /// The block prefix would make blocks larger than [`MAX_BLOCK_ADDRESSES`].
    #[error(
        "block prefix /{block_prefix} makes blocks of more than {limit} addresses; use /{min} or longer for cidr {cidr}",
        limit = MAX_BLOCK_ADDRESSES
    )]
    BlockTooLarge {
        /// The configured block prefix.
        block_prefix: u8,
        /// The shortest block prefix allowed for the pool's family.
        min: u8,
        /// The pool CIDR.
        cidr: IpNet,
    },
    /// A range bound or the gateway does not parse as an IP address.
    #[error("{what} {input:?} is not an ip address")]
    InvalidIp {
        /// Which setting held the text ("range start", "range end" or "gateway").
        what: &'static str,
        /// The text as given.
        input: String,
    },
    /// An exclusion is neither an IP address nor a CIDR.
    #[error("exclude {input:?} is neither an ip address nor a cidr")]
    InvalidExclude {
        /// The text as given.
        input: String,
    },
    /// An address or network belongs to the other IP family than the pool.
    #[error("{what} {value} is not of the same ip family as cidr {cidr}")]
    WrongFamily {
        /// Which setting held the value.
        what: &'static str,
        /// The parsed value.
        value: String,
        /// The pool CIDR.
        cidr: IpNet,
    },
    /// A range whose end comes before its start.
    #[error("range {start}-{end} ends before it starts")]
    RangeReversed {
        /// The first address of the range.
        start: IpAddr,
        /// The last address of the range.
        end: IpAddr,
    },
    /// A range that is not entirely inside the pool CIDR.
    #[error("range {start}-{end} lies outside cidr {cidr}")]
    RangeOutside {
        /// The first address of the range.
        start: IpAddr,
        /// The last address of the range.
        end: IpAddr,
        /// The pool CIDR.
        cidr: IpNet,
    },
    /// A gateway that is not inside the pool CIDR.
    #[error("gateway {gateway} lies outside cidr {cidr}")]
    GatewayOutside {
        /// The configured gateway.
        gateway: IpAddr,
        /// The pool CIDR.
        cidr: IpNet,
    },
}

/// A validated pool: its CIDR, block size, and the exact set of addresses that may be
/// handed out, so that allocation never has to re-check the configuration rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolLayout {
    cidr: IpNet,
    block_prefix: u8,
    /// Allocatable addresses as sorted, disjoint intervals.
    allocatable: Vec<Interval>,
}

impl PoolLayout {
    /// Validates a pool configuration and computes its allocatable addresses; ranges and
    /// exclusions are inclusive, and no ranges means the whole CIDR.
    pub fn new(
        cidr: &str,
        ranges: &[(&str, &str)],
        exclude: &[&str],
        gateway: Option<&str>,
        block_prefix: Option<u8>,
    ) -> Result<PoolLayout, LayoutError> {
        let input = cidr;
        let cidr: IpNet = input.parse().map_err(|_| LayoutError::InvalidCidr { input: input.to_owned() })?;
        if cidr.trunc() != cidr {
            return Err(LayoutError::HostBitsSet { what: "cidr", input: input.to_owned(), network: cidr.trunc() });
        }
        let v4 = matches!(cidr, IpNet::V4(_));
        let prefix = cidr.prefix_len();
        let max = cidr.max_prefix_len();
        let (min_block, default_block) =
            if v4 { (MIN_BLOCK_PREFIX_V4, DEFAULT_BLOCK_PREFIX_V4) } else { (MIN_BLOCK_PREFIX_V6, DEFAULT_BLOCK_PREFIX_V6) };
        let block_prefix = match block_prefix {
            None => prefix.max(default_block),
            Some(block_prefix) if block_prefix > max => {
                return Err(LayoutError::BlockPrefixTooLong { block_prefix, max, cidr });
            }
            Some(block_prefix) if block_prefix < prefix => {
                return Err(LayoutError::BlockPrefixShorterThanPool { block_prefix, cidr });
            }
            Some(block_prefix) if block_prefix < min_block => {
                return Err(LayoutError::BlockTooLarge { block_prefix, min: min_block, cidr });
            }
            Some(block_prefix) => block_prefix,
        };

        let first = addr_to_int(cidr.network());
        let last = addr_to_int(cidr.broadcast());

        let mut allowed = Vec::with_capacity(ranges.len().max(1));
        for &(start, end) in ranges {
            let start = parse_ip("range start", start, cidr)?;
            let end = parse_ip("range end", end, cidr)?;
            if start > end {
                return Err(LayoutError::RangeReversed { start, end });
            }
            if !cidr.contains(&start) || !cidr.contains(&end) {
                return Err(LayoutError::RangeOutside { start, end, cidr });
            }
            allowed.push((addr_to_int(start), addr_to_int(end)));
        }
        if allowed.is_empty() {
            allowed.push((first, last));
        }

        let mut reserved = Vec::with_capacity(exclude.len() + 3);
        if (v4 && prefix <= 30) || (!v4 && prefix <= 126) {
            reserved.push((first, first));
        }
        if v4 && prefix <= 30 {
            reserved.push((last, last));
        }
        if let Some(gateway) = gateway {
            let gateway = parse_ip("gateway", gateway, cidr)?;
            if !cidr.contains(&gateway) {
                return Err(LayoutError::GatewayOutside { gateway, cidr });
            }
            let n = addr_to_int(gateway);
            reserved.push((n, n));
        }
        for &text in exclude {
            reserved.push(parse_exclude(text, cidr)?);
        }

        let allocatable = subtract(&merge(allowed), &merge(reserved));
        Ok(PoolLayout { cidr, block_prefix, allocatable })
    }

    /// The pool's network, as configured.
    pub fn cidr(&self) -> IpNet {
        self.cidr
    }

    /// The prefix length of every block of this pool.
    pub fn block_prefix(&self) -> u8 {
        self.block_prefix
    }

    /// Whether the pool hands out IPv4 (true) or IPv6 (false) addresses.
    pub fn family_is_v4(&self) -> bool {
        matches!(self.cidr, IpNet::V4(_))
    }

    /// Whether `ip` lies in the pool CIDR, allocatable or not.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.cidr.contains(&ip)
    }

    /// Whether `ip` may ever be handed out: inside a range and not reserved or excluded.
    pub fn is_allocatable(&self, ip: IpAddr) -> bool {
        if !self.contains(ip) {
            return false;
        }
        let n = addr_to_int(ip);
        let i = self.allocatable.partition_point(|&(_, end)| end < n);
        self.allocatable.get(i).is_some_and(|&(start, _)| start <= n)
    }

    /// The block holding `ip`, or `None` if `ip` is not in the pool CIDR.
    pub fn block_of(&self, ip: IpAddr) -> Option<IpNet> {
        if !self.contains(ip) {
            return None;
        }
        IpNet::new(ip, self.block_prefix).ok().map(|block| block.trunc())
    }

    /// How many blocks the CIDR splits into, allocatable or not (saturating at
    /// `u128::MAX` for an IPv6 /0 pool of /128 blocks).
    pub fn block_count(&self) -> u128 {
        1u128.checked_shl(u32::from(self.block_prefix - self.cidr.prefix_len())).unwrap_or(u128::MAX)
    }

    /// The `index`-th block of the CIDR in address order, or `None` past the last one;
    /// lets callers spread nodes over the pool by picking a start index.
    pub fn block_at(&self, index: u128) -> Option<IpNet> {
        if index >= self.block_count() {
            return None;
        }
        let offset = index << self.block_host_bits();
        self.block_starting_at(addr_to_int(self.cidr.network()) + offset)
    }

    /// The blocks holding at least one allocatable address, lazily and in address order;
    /// blocks with nothing allocatable are skipped without being visited.
    pub fn blocks(&self) -> impl Iterator<Item = IpNet> {
        Blocks { layout: self, next_interval: 0, cursor: Some(0) }
    }

    /// The allocatable addresses of `block` in address order; nothing if `block` is not
    /// one of this pool's blocks.
    pub fn allocatable_in(&self, block: IpNet) -> impl Iterator<Item = IpAddr> {
        let (low, high) = if self.block_of(block.network()) == Some(block) {
            (addr_to_int(block.network()), addr_to_int(block.broadcast()))
        } else {
            (1, 0)
        };
        let v4 = self.family_is_v4();
        self.allocatable
            .iter()
            .filter_map(move |&(start, end)| {
                let (start, end) = (start.max(low), end.min(high));
                (start <= end).then_some((start, end))
            })
            .flat_map(move |(start, end)| (start..=end).map(move |n| int_to_addr(v4, n)))
    }

    /// How many addresses of the whole pool are allocatable, computed from the intervals
    /// so that huge IPv6 pools are counted instantly.
    pub fn capacity(&self) -> u128 {
        self.allocatable.iter().map(|&(start, end)| (end - start).saturating_add(1)).fold(0, u128::saturating_add)
    }

    /// Whether the two pools' CIDRs share any address, so that overlapping pools can be refused.
    pub fn overlaps(&self, other: &PoolLayout) -> bool {
        self.family_is_v4() == other.family_is_v4()
            && addr_to_int(self.cidr.network()) <= addr_to_int(other.cidr.broadcast())
            && addr_to_int(other.cidr.network()) <= addr_to_int(self.cidr.broadcast())
    }

    /// Number of host bits in a block; at most 12 because of [`MAX_BLOCK_ADDRESSES`].
    fn block_host_bits(&self) -> u32 {
        u32::from(self.cidr.max_prefix_len() - self.block_prefix)
    }

    /// The block whose first address is `start`, which must be block-aligned.
    fn block_starting_at(&self, start: u128) -> Option<IpNet> {
        IpNet::new(int_to_addr(self.family_is_v4(), start), self.block_prefix).ok()
    }
}

/// Lazy walk over the blocks with allocatable addresses, jumping from interval to interval.
struct Blocks<'a> {
    layout: &'a PoolLayout,
    /// Index of the first interval that may still reach `cursor` or beyond.
    next_interval: usize,
    /// First address not yet covered by a yielded block; `None` once the address space ends.
    cursor: Option<u128>,
}

impl Iterator for Blocks<'_> {
    type Item = IpNet;

    fn next(&mut self) -> Option<IpNet> {
        loop {
            let cursor = self.cursor?;
            let &(start, end) = self.layout.allocatable.get(self.next_interval)?;
            if end < cursor {
                self.next_interval += 1;
                continue;
            }
            let host_mask = (1u128 << self.layout.block_host_bits()) - 1;
            let block_start = start.max(cursor) & !host_mask;
            self.cursor = (block_start | host_mask).checked_add(1);
            return self.layout.block_starting_at(block_start);
        }
    }
}

/// Parses an address setting and checks it is of the pool's family.
fn parse_ip(what: &'static str, input: &str, cidr: IpNet) -> Result<IpAddr, LayoutError> {
    let ip: IpAddr = input.parse().map_err(|_| LayoutError::InvalidIp { what, input: input.to_owned() })?;
    if ip.is_ipv4() != matches!(cidr, IpNet::V4(_)) {
        return Err(LayoutError::WrongFamily { what, value: ip.to_string(), cidr });
    }
    Ok(ip)
}

/// Parses an exclusion (an address or a CIDR) into the interval it covers.
fn parse_exclude(input: &str, cidr: IpNet) -> Result<Interval, LayoutError> {
    let net = match input.parse::<IpAddr>() {
        Ok(ip) => IpNet::from(ip),
        Err(_) => input.parse::<IpNet>().map_err(|_| LayoutError::InvalidExclude { input: input.to_owned() })?,
    };
    if net.network().is_ipv4() != matches!(cidr, IpNet::V4(_)) {
        return Err(LayoutError::WrongFamily { what: "exclude", value: input.to_owned(), cidr });
    }
    if net.trunc() != net {
        return Err(LayoutError::HostBitsSet { what: "exclude", input: input.to_owned(), network: net.trunc() });
    }
    Ok((addr_to_int(net.network()), addr_to_int(net.broadcast())))
}

/// Sorts intervals and fuses those that overlap or touch.
fn merge(mut intervals: Vec<Interval>) -> Vec<Interval> {
    intervals.sort_unstable();
    let mut merged: Vec<Interval> = Vec::with_capacity(intervals.len());
    for (start, end) in intervals {
        match merged.last_mut() {
            Some(last) if start <= last.1.saturating_add(1) => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    merged
}

/// The addresses of `allowed` that are in no interval of `removed`; both must be merged.
fn subtract(allowed: &[Interval], removed: &[Interval]) -> Vec<Interval> {
    let mut out = Vec::with_capacity(allowed.len() + removed.len());
    for &(start, end) in allowed {
        let mut cursor = Some(start);
        for &(cut_start, cut_end) in removed.iter().filter(|&&(s, e)| s <= end && e >= start) {
            let Some(from) = cursor else { break };
            if cut_start > from {
                out.push((from, cut_start - 1));
            }
            cursor = cut_end.checked_add(1);
        }
        if let Some(from) = cursor
            && from <= end
        {
            out.push((from, end));
        }
    }
    out
}
