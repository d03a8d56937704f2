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
        "block prefix /{block_prefix} makes blocks of more than {limit} addresses; \
         use /{min} or longer for cidr {cidr}",
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
        let (min_block, default_block) = if v4 {
            (MIN_BLOCK_PREFIX_V4, DEFAULT_BLOCK_PREFIX_V4)
        } else {
            (MIN_BLOCK_PREFIX_V6, DEFAULT_BLOCK_PREFIX_V6)
        };
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
        if network_is_reserved(cidr) {
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

    /// Whether `block` is one of this pool's blocks (inside the CIDR, of the block size,
    /// aligned): a block written under another layout of the same pool name is not.
    pub fn is_block(&self, block: IpNet) -> bool {
        self.block_of(block.network()) == Some(block)
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
        let (low, high) =
            if self.is_block(block) { (addr_to_int(block.network()), addr_to_int(block.broadcast())) } else { (1, 0) };
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

/// Whether the network address of `cidr` is no pod's: up to an IPv4 /30 (the network
/// address) and an IPv6 /126 (the Subnet-Router anycast address). An IPv4 /31 or /32
/// (RFC 3021) and an IPv6 /127 (RFC 6164) or /128 use every address.
fn network_is_reserved(cidr: IpNet) -> bool {
    match cidr {
        IpNet::V4(_) => cidr.prefix_len() <= 30,
        IpNet::V6(_) => cidr.prefix_len() <= 126,
    }
}

/// The first address after the network address of `cidr` (`10.244.0.0/16` -> `10.244.0.1`,
/// `fd00::/64` -> `fd00::1`): the gateway a pool without `spec.gateway` gets
/// ([`crate::ipam::pools::gateway`]). `None` when the network address is itself a host
/// (`network_is_reserved`): a /31, /32, /127 or /128 has no address to spare for one.
pub fn first_host(cidr: IpNet) -> Option<IpAddr> {
    let cidr = cidr.trunc();
    network_is_reserved(cidr).then(|| int_to_addr(matches!(cidr, IpNet::V4(_)), addr_to_int(cidr.network()) + 1))
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

#[cfg(test)]
mod test {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn net(text: &str) -> IpNet {
        text.parse().unwrap()
    }

    fn pool(cidr: &str) -> PoolLayout {
        PoolLayout::new(cidr, &[], &[], None, None).unwrap()
    }

    fn allocatable(layout: &PoolLayout) -> Vec<IpAddr> {
        layout.blocks().flat_map(|block| layout.allocatable_in(block).collect::<Vec<_>>()).collect()
    }

    #[test]
    fn every_invalid_configuration_is_rejected_with_a_message_naming_the_input() {
        type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a [&'a str], Option<&'a str>, Option<u8>, &'a str);
        let cases: &[Case<'_>] = &[
            (
                "10.0.0.0",
                &[],
                &[],
                None,
                None,
                "cidr \"10.0.0.0\" is not an ip network such as 10.0.0.0/16 or fd00::/64",
            ),
            ("10.0.0.0/33", &[], &[], None, None, "cidr \"10.0.0.0/33\" is not an ip network"),
            ("10.0.0.1/24", &[], &[], None, None, "cidr 10.0.0.1/24 has host bits set; did you mean 10.0.0.0/24?"),
            ("fd00::1/64", &[], &[], None, None, "cidr fd00::1/64 has host bits set; did you mean fd00::/64?"),
            (
                "10.0.0.0/16",
                &[],
                &[],
                None,
                Some(33),
                "block prefix /33 is longer than /32, the longest prefix of cidr",
            ),
            ("fd00::/64", &[], &[], None, Some(129), "block prefix /129 is longer than /128"),
            (
                "10.0.0.0/24",
                &[],
                &[],
                None,
                Some(22),
                "block prefix /22 is shorter than the prefix of cidr 10.0.0.0/24",
            ),
            (
                "10.0.0.0/8",
                &[],
                &[],
                None,
                Some(19),
                "block prefix /19 makes blocks of more than 4096 addresses; use /20 or longer for cidr 10.0.0.0/8",
            ),
            (
                "fd00::/64",
                &[],
                &[],
                None,
                Some(112),
                "block prefix /112 makes blocks of more than 4096 addresses; use /116",
            ),
            (
                "10.0.0.0/24",
                &[("10.0.0.x", "10.0.0.9")],
                &[],
                None,
                None,
                "range start \"10.0.0.x\" is not an ip address",
            ),
            ("10.0.0.0/24", &[("10.0.0.1", "")], &[], None, None, "range end \"\" is not an ip address"),
            (
                "10.0.0.0/24",
                &[("fd00::1", "10.0.0.9")],
                &[],
                None,
                None,
                "range start fd00::1 is not of the same ip family",
            ),
            (
                "fd00::/64",
                &[("fd00::1", "10.0.0.9")],
                &[],
                None,
                None,
                "range end 10.0.0.9 is not of the same ip family",
            ),
            (
                "10.0.0.0/24",
                &[("10.0.0.9", "10.0.0.5")],
                &[],
                None,
                None,
                "range 10.0.0.9-10.0.0.5 ends before it starts",
            ),
            (
                "10.0.0.0/24",
                &[("10.1.0.5", "10.1.0.9")],
                &[],
                None,
                None,
                "range 10.1.0.5-10.1.0.9 lies outside cidr 10.0.0.0/24",
            ),
            (
                "10.0.0.0/24",
                &[("10.0.0.250", "10.0.1.5")],
                &[],
                None,
                None,
                "range 10.0.0.250-10.0.1.5 lies outside cidr",
            ),
            (
                "fd00::/120",
                &[("fd00::1", "fd00::1:0")],
                &[],
                None,
                None,
                "range fd00::1-fd00::1:0 lies outside cidr fd00::/120",
            ),
            ("10.0.0.0/24", &[], &["nope"], None, None, "exclude \"nope\" is neither an ip address nor a cidr"),
            ("10.0.0.0/24", &[], &["10.0.0.0/40"], None, None, "exclude \"10.0.0.0/40\" is neither"),
            (
                "10.0.0.0/24",
                &[],
                &["fd00::/120"],
                None,
                None,
                "exclude fd00::/120 is not of the same ip family as cidr",
            ),
            (
                "fd00::/64",
                &[],
                &["10.0.0.1"],
                None,
                None,
                "exclude 10.0.0.1 is not of the same ip family as cidr fd00::/64",
            ),
            (
                "10.0.0.0/24",
                &[],
                &["10.0.0.1/30"],
                None,
                None,
                "exclude 10.0.0.1/30 has host bits set; did you mean 10.0.0.0/30?",
            ),
            ("10.0.0.0/24", &[], &[], Some("gw"), None, "gateway \"gw\" is not an ip address"),
            ("10.0.0.0/24", &[], &[], Some("fd00::1"), None, "gateway fd00::1 is not of the same ip family as cidr"),
            ("10.0.0.0/24", &[], &[], Some("10.0.1.1"), None, "gateway 10.0.1.1 lies outside cidr 10.0.0.0/24"),
        ];
        for &(cidr, ranges, exclude, gateway, block_prefix, expected) in cases {
            let error = PoolLayout::new(cidr, ranges, exclude, gateway, block_prefix).unwrap_err().to_string();
            assert!(
                error.contains(expected),
                "{cidr} {ranges:?} {exclude:?} {gateway:?} {block_prefix:?}: got {error:?}"
            );
            assert!(error.starts_with(|c: char| !c.is_uppercase()), "{error:?} should start lowercase");
        }
    }

    #[test]
    fn block_size_limit_constants_agree() {
        assert_eq!(1u32 << (32 - MIN_BLOCK_PREFIX_V4), MAX_BLOCK_ADDRESSES);
        assert_eq!(1u32 << (128 - MIN_BLOCK_PREFIX_V6), MAX_BLOCK_ADDRESSES);
    }

    #[test]
    fn default_block_prefix_is_24_or_120_unless_the_pool_is_smaller() {
        let cases = [
            ("10.0.0.0/8", 24),
            ("10.0.0.0/24", 24),
            ("10.0.0.0/26", 26),
            ("10.0.0.1/32", 32),
            ("fd00::/48", 120),
            ("fd00::/120", 120),
            ("fd00::/125", 125),
        ];
        for (cidr, expected) in cases {
            assert_eq!(pool(cidr).block_prefix(), expected, "{cidr}");
        }
    }

    #[test]
    fn an_explicit_block_prefix_is_used_when_valid() {
        let cases = [
            ("10.0.0.0/8", 20),
            ("10.0.0.0/16", 16 + 10),
            ("10.0.0.0/20", 20),
            ("10.0.0.0/30", 32),
            ("fd00::/64", 116),
            ("fd00::/64", 128),
            ("fd00::/116", 116),
        ];
        for (cidr, block_prefix) in cases {
            let layout = PoolLayout::new(cidr, &[], &[], None, Some(block_prefix)).unwrap();
            assert_eq!(layout.block_prefix(), block_prefix, "{cidr}");
        }
    }

    #[test]
    fn network_broadcast_and_gateway_are_never_allocatable() {
        let layout = PoolLayout::new("10.0.0.0/24", &[], &[], Some("10.0.0.1"), None).unwrap();
        for never in ["10.0.0.0", "10.0.0.255", "10.0.0.1"] {
            assert!(!layout.is_allocatable(ip(never)), "{never}");
        }
        for ok in ["10.0.0.2", "10.0.0.254"] {
            assert!(layout.is_allocatable(ip(ok)), "{ok}");
        }
        assert_eq!(layout.capacity(), 253);
        let smallest = pool("10.0.0.4/30");
        assert_eq!(allocatable(&smallest), [ip("10.0.0.5"), ip("10.0.0.6")]);
    }

    #[test]
    fn slash_31_and_slash_32_pools_use_every_address() {
        assert_eq!(allocatable(&pool("10.0.0.4/31")), [ip("10.0.0.4"), ip("10.0.0.5")]);
        assert_eq!(allocatable(&pool("10.0.0.7/32")), [ip("10.0.0.7")]);
        assert_eq!(pool("10.0.0.4/31").capacity(), 2);
        assert_eq!(pool("10.0.0.7/32").capacity(), 1);
    }

    #[test]
    fn the_ipv6_subnet_router_anycast_address_is_never_allocatable() {
        let layout = pool("fd00::/120");
        assert!(!layout.is_allocatable(ip("fd00::")));
        assert!(layout.is_allocatable(ip("fd00::1")));
        assert!(layout.is_allocatable(ip("fd00::ff")), "ipv6 has no broadcast address");
        assert_eq!(layout.capacity(), 255);
        assert_eq!(pool("fd00::/126").capacity(), 3);
        assert_eq!(allocatable(&pool("fd00::/127")), [ip("fd00::"), ip("fd00::1")]);
        assert_eq!(allocatable(&pool("fd00::5/128")), [ip("fd00::5")]);
    }

    #[test]
    fn ranges_limit_allocation_to_their_addresses() {
        let layout = PoolLayout::new(
            "10.0.0.0/24",
            &[("10.0.0.10", "10.0.0.12"), ("10.0.0.11", "10.0.0.13"), ("10.0.0.255", "10.0.0.255")],
            &[],
            None,
            None,
        )
        .unwrap();
        let expected: Vec<IpAddr> = ["10.0.0.10", "10.0.0.11", "10.0.0.12", "10.0.0.13"].map(ip).to_vec();
        assert_eq!(allocatable(&layout), expected, "overlapping ranges merge; broadcast stays reserved");
        assert_eq!(layout.capacity(), 4);
        assert!(!layout.is_allocatable(ip("10.0.0.9")));
        assert!(layout.contains(ip("10.0.0.9")));
    }

    #[test]
    fn excluded_ips_and_cidrs_are_never_allocatable() {
        let layout = PoolLayout::new(
            "10.0.0.0/24",
            &[],
            &["10.0.0.7", "10.0.0.16/28", "10.0.0.0/31", "10.0.1.0/24"],
            None,
            None,
        )
        .unwrap();
        for never in ["10.0.0.1", "10.0.0.7", "10.0.0.16", "10.0.0.31"] {
            assert!(!layout.is_allocatable(ip(never)), "{never}");
        }
        for ok in ["10.0.0.2", "10.0.0.6", "10.0.0.8", "10.0.0.15", "10.0.0.32"] {
            assert!(layout.is_allocatable(ip(ok)), "{ok}");
        }
        assert_eq!(layout.capacity(), 254 - 1 - 16 - 1);
        let v6 = PoolLayout::new("fd00::/64", &[], &["fd00::1", "fd00::100/120"], None, None).unwrap();
        assert!(!v6.is_allocatable(ip("fd00::1")));
        assert!(!v6.is_allocatable(ip("fd00::1ff")));
        assert!(v6.is_allocatable(ip("fd00::200")));
        assert_eq!(v6.capacity(), (1u128 << 64) - 1 - 1 - 256);
    }

    #[test]
    fn addresses_of_the_other_family_or_outside_the_cidr_are_neither_contained_nor_allocatable() {
        let layout = pool("10.0.0.0/24");
        for outside in ["10.0.1.1", "::a00:1", "::ffff:10.0.0.1"] {
            assert!(!layout.contains(ip(outside)), "{outside}");
            assert!(!layout.is_allocatable(ip(outside)), "{outside}");
            assert_eq!(layout.block_of(ip(outside)), None, "{outside}");
        }
    }

    #[test]
    fn a_slash_16_pool_has_256_blocks_of_slash_24_and_capacity_65534() {
        let layout = pool("10.1.0.0/16");
        assert!(layout.family_is_v4());
        assert_eq!(layout.cidr(), net("10.1.0.0/16"));
        assert_eq!(layout.block_count(), 256);
        assert_eq!(layout.blocks().count(), 256);
        assert_eq!(layout.capacity(), 65534);
        assert_eq!(layout.blocks().next(), Some(net("10.1.0.0/24")));
        assert_eq!(layout.blocks().last(), Some(net("10.1.255.0/24")));
        assert_eq!(layout.allocatable_in(net("10.1.0.0/24")).count(), 255);
        assert_eq!(layout.allocatable_in(net("10.1.7.0/24")).count(), 256);
        assert_eq!(layout.allocatable_in(net("10.1.255.0/24")).count(), 255);
    }

    #[test]
    fn a_v6_slash_64_pool_has_2_pow_56_blocks_and_yields_the_first_immediately() {
        let layout = pool("fd00:1::/64");
        assert!(!layout.family_is_v4());
        assert_eq!(layout.block_count(), 1u128 << 56);
        assert_eq!(layout.blocks().next(), Some(net("fd00:1::/120")));
        assert_eq!(layout.blocks().nth(3), Some(net("fd00:1::300/120")));
        assert_eq!(layout.capacity(), (1u128 << 64) - 1);
        assert_eq!(layout.block_at((1u128 << 56) - 1), Some(net("fd00:1::ffff:ffff:ffff:ff00/120")));
    }

    #[test]
    fn blocks_jump_straight_to_the_ranges_of_a_huge_pool() {
        let layout = PoolLayout::new(
            "fd00::/64",
            &[("fd00::10", "fd00::20"), ("fd00::ffff:ffff:ffff:fe80", "fd00::ffff:ffff:ffff:ffff")],
            &[],
            None,
            None,
        )
        .unwrap();
        let blocks: Vec<IpNet> = layout.blocks().collect();
        assert_eq!(
            blocks,
            [net("fd00::/120"), net("fd00::ffff:ffff:ffff:fe00/120"), net("fd00::ffff:ffff:ffff:ff00/120")]
        );
        assert_eq!(layout.capacity(), 17 + 384);
    }

    #[test]
    fn blocks_skip_blocks_without_allocatable_addresses_and_never_repeat() {
        let layout = PoolLayout::new(
            "10.0.0.0/22",
            &[("10.0.0.10", "10.0.0.20"), ("10.0.0.30", "10.0.0.40"), ("10.0.2.0", "10.0.3.255")],
            &["10.0.2.0/24"],
            None,
            None,
        )
        .unwrap();
        assert_eq!(layout.blocks().collect::<Vec<_>>(), [net("10.0.0.0/24"), net("10.0.3.0/24")]);
        let all_excluded = PoolLayout::new("10.0.0.0/24", &[], &["10.0.0.0/24"], None, None).unwrap();
        assert_eq!(all_excluded.blocks().next(), None);
        assert_eq!(all_excluded.capacity(), 0);
    }

    #[test]
    fn block_at_walks_blocks_in_address_order_and_ends_after_the_last() {
        let layout = PoolLayout::new("10.0.0.0/22", &[], &[], None, Some(23)).unwrap();
        assert_eq!(layout.block_count(), 2);
        assert_eq!(layout.block_at(0), Some(net("10.0.0.0/23")));
        assert_eq!(layout.block_at(1), Some(net("10.0.2.0/23")));
        assert_eq!(layout.block_at(2), None);
        assert_eq!(layout.block_at(u128::MAX), None);
    }

    #[test]
    fn block_of_returns_the_enclosing_block_and_none_outside_the_pool() {
        let layout = pool("10.0.0.0/16");
        assert_eq!(layout.block_of(ip("10.0.3.77")), Some(net("10.0.3.0/24")));
        assert_eq!(layout.block_of(ip("10.0.0.0")), Some(net("10.0.0.0/24")));
        assert_eq!(layout.block_of(ip("10.1.0.0")), None);
        let v6 = PoolLayout::new("fd00::/64", &[], &[], None, Some(124)).unwrap();
        assert_eq!(v6.block_of(ip("fd00::1234")), Some(net("fd00::1230/124")));
    }

    #[test]
    fn allocatable_in_yields_nothing_for_a_network_that_is_not_a_block() {
        let layout = pool("10.0.0.0/16");
        for not_a_block in ["10.0.0.0/23", "10.0.0.0/25", "10.0.0.128/24", "10.1.0.0/24", "fd00::/120"] {
            assert_eq!(layout.allocatable_in(net(not_a_block)).count(), 0, "{not_a_block}");
        }
    }

    #[test]
    fn overlaps_compares_cidrs_within_one_family() {
        let cases = [
            ("10.0.0.0/16", "10.0.5.0/24", true),
            ("10.0.5.0/24", "10.0.0.0/16", true),
            ("10.0.0.0/24", "10.0.1.0/24", false),
            ("10.0.0.0/24", "10.0.0.255/32", true),
            ("0.0.0.0/0", "fd00::/64", false),
            ("fd00::/64", "fd00::/120", true),
            ("fd00::/64", "fd00:0:0:1::/64", false),
        ];
        for (a, b, expected) in cases {
            assert_eq!(pool(a).overlaps(&pool(b)), expected, "{a} vs {b}");
        }
    }
}
