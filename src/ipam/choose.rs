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
    if !layout.is_block(block) {
        return Err(ChooseError::NotABlock { block, cidr: layout.cidr() });
    }
    let (first, last) = (block.network(), block.broadcast());
    // Both maps are sorted like the block's addresses, so one forward pass over each suffices.
    let mut allocated = usage.allocated.range(first..=last).peekable();
    let mut released = usage.released.range(first..=last).peekable();
    let mut best: Option<(Timestamp, IpAddr)> = None;
    let mut cooling = 0usize;
    let mut next_free_at: Option<Timestamp> = None;
    for ip in layout.allocatable_in(block) {
        while allocated.next_if(|&&taken| taken < ip).is_some() {}
        if allocated.next_if(|&&taken| taken == ip).is_some() {
            continue;
        }
        while released.next_if(|&(&gone, _)| gone < ip).is_some() {}
        let Some((_, &released_at)) = released.next_if(|&(&gone, _)| gone == ip) else {
            // Never released ranks first, and addresses ascend: nothing can beat it.
            return Ok(ip);
        };
        if !cooldown.is_zero() {
            let free_at = released_at.checked_add(cooldown).unwrap_or(Timestamp::MAX);
            if free_at > now {
                cooling += 1;
                next_free_at = Some(next_free_at.map_or(free_at, |t| t.min(free_at)));
                continue;
            }
        }
        // A strict comparison keeps the lowest address among equally old releases.
        if best.is_none_or(|(oldest, _)| released_at < oldest) {
            best = Some((released_at, ip));
        }
    }
    match (best, next_free_at) {
        (Some((_, ip)), _) => Ok(ip),
        (None, Some(next_free_at)) => Err(ChooseError::Cooling { block, cooling, next_free_at }),
        (None, None) => Err(ChooseError::Exhausted { block }),
    }
}

#[cfg(test)]
mod test {
    use super::super::{MAX_BLOCK_ADDRESSES, MIN_BLOCK_PREFIX_V4, MIN_BLOCK_PREFIX_V6, addr_to_int, int_to_addr};
    use super::*;
    use proptest::prelude::*;

    const MINUTE: Duration = Duration::from_secs(60);

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn net(text: &str) -> IpNet {
        text.parse().unwrap()
    }

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + seconds).unwrap()
    }

    fn small_pool() -> PoolLayout {
        PoolLayout::new("10.0.0.0/29", &[], &[], Some("10.0.0.1"), None).unwrap()
    }

    fn choose(
        layout: &PoolLayout,
        allocated: &[&str],
        released: &[(&str, i64)],
        now: i64,
        cooldown: Duration,
    ) -> Result<IpAddr, ChooseError> {
        let allocated: BTreeSet<IpAddr> = allocated.iter().map(|text| ip(text)).collect();
        let released: BTreeMap<IpAddr, Timestamp> = released.iter().map(|&(text, s)| (ip(text), at(s))).collect();
        let block = layout.blocks().next().unwrap();
        choose_ip(layout, block, BlockUsage { allocated: &allocated, released: &released }, at(now), cooldown)
    }

    #[test]
    fn the_lowest_never_used_ip_is_chosen_first() {
        assert_eq!(choose(&small_pool(), &[], &[], 0, MINUTE), Ok(ip("10.0.0.2")));
    }

    #[test]
    fn allocated_ips_are_skipped() {
        assert_eq!(choose(&small_pool(), &["10.0.0.2", "10.0.0.3"], &[], 0, MINUTE), Ok(ip("10.0.0.4")));
    }

    #[test]
    fn never_released_ips_are_preferred_over_released_ones() {
        let released = [("10.0.0.2", -3600), ("10.0.0.3", -7200)];
        assert_eq!(choose(&small_pool(), &[], &released, 0, MINUTE), Ok(ip("10.0.0.4")));
    }

    #[test]
    fn among_released_ips_the_one_released_longest_ago_wins() {
        let allocated = ["10.0.0.2", "10.0.0.6"];
        let released = [("10.0.0.3", -600), ("10.0.0.4", -900), ("10.0.0.5", -600)];
        assert_eq!(choose(&small_pool(), &allocated, &released, 0, MINUTE), Ok(ip("10.0.0.4")));
        let tied = [("10.0.0.3", -600), ("10.0.0.4", -600), ("10.0.0.5", -600)];
        assert_eq!(choose(&small_pool(), &allocated, &tied, 0, MINUTE), Ok(ip("10.0.0.3")), "ties go to the lowest");
    }

    #[test]
    fn ips_still_cooling_down_are_skipped_and_ready_exactly_when_the_cooldown_ends() {
        let allocated = ["10.0.0.2", "10.0.0.3", "10.0.0.4"];
        let released = [("10.0.0.5", -30), ("10.0.0.6", -60)];
        assert_eq!(choose(&small_pool(), &allocated, &released, 0, MINUTE), Ok(ip("10.0.0.6")));
    }

    #[test]
    fn a_block_whose_free_ips_all_cool_down_says_when_the_first_is_free() {
        let allocated = ["10.0.0.2", "10.0.0.3"];
        let released = [("10.0.0.4", -30), ("10.0.0.5", -10), ("10.0.0.6", -50)];
        let error = choose(&small_pool(), &allocated, &released, 0, MINUTE).unwrap_err();
        assert_eq!(error, ChooseError::Cooling { block: net("10.0.0.0/29"), cooling: 3, next_free_at: at(10) });
        assert_eq!(
            error.to_string(),
            format!(
                "all 3 free IPs of block 10.0.0.0/29 are cooling down after release; the first is free at {}",
                at(10)
            )
        );
    }

    #[test]
    fn a_zero_cooldown_disables_cooling() {
        let allocated = ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"];
        let released = [("10.0.0.6", 0)];
        assert_eq!(choose(&small_pool(), &allocated, &released, 0, Duration::ZERO), Ok(ip("10.0.0.6")));
        let from_the_future = [("10.0.0.6", 100)];
        assert_eq!(choose(&small_pool(), &allocated, &from_the_future, 0, Duration::ZERO), Ok(ip("10.0.0.6")));
    }

    #[test]
    fn a_huge_cooldown_keeps_ips_cooling_instead_of_overflowing() {
        let allocated = ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"];
        let error = choose(&small_pool(), &allocated, &[("10.0.0.6", 0)], 0, Duration::MAX).unwrap_err();
        assert_eq!(error, ChooseError::Cooling { block: net("10.0.0.0/29"), cooling: 1, next_free_at: Timestamp::MAX });
    }

    #[test]
    fn a_block_with_every_ip_allocated_is_exhausted() {
        let allocated = ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.0.6"];
        let error = choose(&small_pool(), &allocated, &[("10.0.0.6", -10)], 0, MINUTE).unwrap_err();
        assert_eq!(error, ChooseError::Exhausted { block: net("10.0.0.0/29") });
        assert_eq!(error.to_string(), "every allocatable ip of block 10.0.0.0/29 is allocated");
    }

    #[test]
    fn a_network_that_is_not_a_block_of_the_pool_is_refused() {
        let layout = PoolLayout::new("10.0.0.0/16", &[], &[], None, None).unwrap();
        let (allocated, released) = (BTreeSet::new(), BTreeMap::new());
        for not_a_block in ["10.1.0.0/24", "10.0.0.0/25", "10.0.0.0/23", "10.0.0.5/24", "fd00::/120"] {
            let usage = BlockUsage { allocated: &allocated, released: &released };
            let error = choose_ip(&layout, net(not_a_block), usage, at(0), MINUTE).unwrap_err();
            assert_eq!(error, ChooseError::NotABlock { block: net(not_a_block), cidr: net("10.0.0.0/16") });
            assert_eq!(error.to_string(), format!("{not_a_block} is not a block of pool 10.0.0.0/16"));
        }
    }

    #[test]
    fn a_full_size_block_is_handed_out_whole_before_it_is_exhausted() {
        let layout = PoolLayout::new("fd00::/112", &[], &[], None, Some(MIN_BLOCK_PREFIX_V6)).unwrap();
        let block = layout.blocks().nth(1).unwrap();
        let (mut allocated, released) = (BTreeSet::new(), BTreeMap::new());
        while let Ok(ip) =
            choose_ip(&layout, block, BlockUsage { allocated: &allocated, released: &released }, at(0), MINUTE)
        {
            assert!(allocated.insert(ip), "{ip} handed out twice");
        }
        assert_eq!(allocated.len(), MAX_BLOCK_ADDRESSES as usize);
        assert!(allocated.iter().all(|ip| block.contains(ip)));
    }

    /// A pool configuration drawn at random, kept as the raw rules so tests can judge
    /// addresses against the specification independently of the interval arithmetic.
    #[derive(Debug, Clone)]
    struct PoolSpec {
        v4: bool,
        prefix: u8,
        network: u128,
        ranges: Vec<(u128, u128)>,
        exclude: Vec<(u128, u8)>,
        gateway: Option<u128>,
        block_prefix: Option<u8>,
    }

    impl PoolSpec {
        fn max(&self) -> u8 {
            if self.v4 { 32 } else { 128 }
        }

        fn last(&self) -> u128 {
            self.network | low_mask(self.max() - self.prefix)
        }

        fn text(&self, n: u128) -> String {
            int_to_addr(self.v4, n).to_string()
        }

        fn layout(&self) -> PoolLayout {
            let cidr = format!("{}/{}", self.text(self.network), self.prefix);
            let ranges: Vec<(String, String)> =
                self.ranges.iter().map(|&(s, e)| (self.text(s), self.text(e))).collect();
            let ranges: Vec<(&str, &str)> = ranges.iter().map(|(s, e)| (s.as_str(), e.as_str())).collect();
            let exclude: Vec<String> = self
                .exclude
                .iter()
                .map(|&(n, p)| if p == self.max() { self.text(n) } else { format!("{}/{p}", self.text(n)) })
                .collect();
            let exclude: Vec<&str> = exclude.iter().map(String::as_str).collect();
            let gateway = self.gateway.map(|g| self.text(g));
            PoolLayout::new(&cidr, &ranges, &exclude, gateway.as_deref(), self.block_prefix).unwrap()
        }

        /// The rules of the specification, applied directly to one address.
        fn allowed(&self, n: u128) -> bool {
            let in_cidr = self.network <= n && n <= self.last();
            let in_ranges = self.ranges.is_empty() || self.ranges.iter().any(|&(s, e)| s <= n && n <= e);
            let network_or_broadcast = if self.v4 {
                self.prefix <= 30 && (n == self.network || n == self.last())
            } else {
                self.prefix <= 126 && n == self.network
            };
            let excluded = self.exclude.iter().any(|&(x, p)| x <= n && n <= (x | low_mask(self.max() - p)));
            in_cidr && in_ranges && !network_or_broadcast && self.gateway != Some(n) && !excluded
        }
    }

    fn low_mask(bits: u8) -> u128 {
        if bits >= 128 { u128::MAX } else { (1u128 << bits) - 1 }
    }

    /// Random valid pools: the prefix ranges bound the pool size, an explicit block prefix
    /// leaves at most `max_block_bits` host bits, and offsets cluster near the start of the
    /// pool half of the time so that exclusions and ranges hit the first blocks.
    fn pool_spec(
        v4_prefixes: std::ops::RangeInclusive<u8>,
        v6_prefixes: std::ops::RangeInclusive<u8>,
        max_block_bits: u8,
    ) -> impl Strategy<Value = PoolSpec> {
        let offset = || prop_oneof![0u128..4096, any::<u128>()];
        (
            any::<bool>(),
            v4_prefixes,
            v6_prefixes,
            any::<u128>(),
            prop::collection::vec((offset(), offset()), 0..3),
            prop::collection::vec((offset(), any::<u8>()), 0..4),
            prop::option::of(offset()),
            prop::option::of(any::<u8>()),
        )
            .prop_map(move |(v4, p4, p6, base, ranges, exclude, gateway, block_seed)| {
                let (prefix, max) = if v4 { (p4, 32u8) } else { (p6, 128u8) };
                let host_bits = max - prefix;
                let space = if v4 { low_mask(32) } else { u128::MAX };
                let network = base & space & !low_mask(host_bits);
                let size_mask = low_mask(host_bits);
                let at = |offset: u128| network | (offset & size_mask);
                let ranges = ranges
                    .into_iter()
                    .map(|(a, b)| {
                        let (a, b) = (at(a), at(b));
                        (a.min(b), a.max(b))
                    })
                    .collect();
                let exclude = exclude
                    .into_iter()
                    .map(|(offset, seed)| {
                        let p = prefix + seed % (host_bits + 1);
                        (at(offset) & !low_mask(max - p), p)
                    })
                    .collect();
                let min_block = if v4 { MIN_BLOCK_PREFIX_V4 } else { MIN_BLOCK_PREFIX_V6 };
                let low = prefix.max(min_block).max(max - max_block_bits);
                let block_prefix = block_seed.map(|seed| low + seed % (max - low + 1));
                PoolSpec { v4, prefix, network, ranges, exclude, gateway: gateway.map(at), block_prefix }
            })
    }

    /// One step of a random allocation history.
    #[derive(Debug, Clone)]
    enum Step {
        Allocate,
        Release(usize),
        Wait(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => Just(Step::Allocate),
            2 => any::<usize>().prop_map(Step::Release),
            1 => (0u64..90).prop_map(Step::Wait),
        ]
    }

    fn block_addresses(block: IpNet) -> impl Iterator<Item = u128> {
        addr_to_int(block.network())..=addr_to_int(block.broadcast())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn choose_ip_follows_every_rule_over_random_histories(
            spec in pool_spec(8..=32, 40..=128, 12),
            block_seed in any::<usize>(),
            cooldown_secs in prop_oneof![Just(0u64), 1u64..120],
            steps in prop::collection::vec(step(), 1..120),
        ) {
            let layout = spec.layout();
            let blocks: Vec<IpNet> = layout.blocks().take(8).collect();
            prop_assume!(!blocks.is_empty());
            let block = blocks[block_seed % blocks.len()];
            let cooldown = Duration::from_secs(cooldown_secs);
            let mut now = at(0);
            let mut allocated = BTreeSet::new();
            let mut released = BTreeMap::new();
            for step in steps {
                match step {
                    Step::Wait(secs) => now = now.checked_add(Duration::from_secs(secs)).unwrap(),
                    Step::Release(seed) => {
                        if let Some(&ip) = allocated.iter().nth(seed % allocated.len().max(1)) {
                            allocated.remove(&ip);
                            released.insert(ip, now);
                        }
                    }
                    Step::Allocate => {
                        let usage = BlockUsage { allocated: &allocated, released: &released };
                        let result = choose_ip(&layout, block, usage, now, cooldown);
                        let free: Vec<IpAddr> = block_addresses(block)
                            .filter(|&n| spec.allowed(n))
                            .map(|n| int_to_addr(spec.v4, n))
                            .filter(|ip| !allocated.contains(ip))
                            .collect();
                        let free_at =
                            |ip: &IpAddr| released.get(ip).map(|&r: &Timestamp| r.checked_add(cooldown).unwrap());
                        let is_ready = |ip: &IpAddr| cooldown.is_zero() || free_at(ip).is_none_or(|t| t <= now);
                        let expected = free.iter().filter(|ip| is_ready(ip)).min_by_key(|ip| (released.get(*ip), **ip));
                        match result {
                            Ok(chosen) => {
                                prop_assert!(block.contains(&chosen));
                                prop_assert!(spec.allowed(addr_to_int(chosen)), "{chosen} breaks a pool rule");
                                prop_assert!(!allocated.contains(&chosen));
                                prop_assert!(is_ready(&chosen), "{chosen} chosen before its cooldown ended");
                                prop_assert_eq!(Some(&chosen), expected);
                                allocated.insert(chosen);
                                released.remove(&chosen);
                            }
                            Err(ChooseError::Exhausted { block: b }) => {
                                prop_assert_eq!(b, block);
                                prop_assert!(free.is_empty());
                            }
                            Err(ChooseError::Cooling { block: b, cooling, next_free_at }) => {
                                prop_assert_eq!(b, block);
                                prop_assert!(expected.is_none());
                                prop_assert_eq!(cooling, free.len());
                                prop_assert_eq!(Some(next_free_at), free.iter().filter_map(free_at).min());
                            }
                            Err(other) => return Err(TestCaseError::fail(format!("unexpected {other}"))),
                        }
                    }
                }
            }
        }

        #[test]
        fn allocating_a_block_until_exhausted_hands_out_each_allocatable_ip_once(
            spec in pool_spec(8..=32, 40..=128, 8),
            block_seed in any::<usize>(),
        ) {
            let layout = spec.layout();
            let blocks: Vec<IpNet> = layout.blocks().take(8).collect();
            prop_assume!(!blocks.is_empty());
            let block = blocks[block_seed % blocks.len()];
            let released = BTreeMap::new();
            let mut allocated = BTreeSet::new();
            let mut handed_out = Vec::new();
            loop {
                let usage = BlockUsage { allocated: &allocated, released: &released };
                match choose_ip(&layout, block, usage, at(0), MINUTE) {
                    Ok(ip) => {
                        prop_assert!(allocated.insert(ip), "{ip} handed out twice");
                        handed_out.push(ip);
                    }
                    Err(ChooseError::Exhausted { .. }) => break,
                    Err(other) => return Err(TestCaseError::fail(format!("unexpected {other}"))),
                }
            }
            let expected: Vec<IpAddr> =
                block_addresses(block).filter(|&n| spec.allowed(n)).map(|n| int_to_addr(spec.v4, n)).collect();
            prop_assert_eq!(handed_out.len(), layout.allocatable_in(block).count());
            prop_assert_eq!(handed_out, expected);
        }

        #[test]
        fn capacity_and_blocks_agree_with_the_rules_on_small_pools(spec in pool_spec(20..=32, 114..=128, 12)) {
            let layout = spec.layout();
            let all: Vec<u128> = (spec.network..=spec.last()).filter(|&n| spec.allowed(n)).collect();
            let from_blocks: u128 = layout.blocks().map(|b| layout.allocatable_in(b).count() as u128).sum();
            prop_assert_eq!(layout.capacity(), from_blocks);
            prop_assert_eq!(layout.capacity(), all.len() as u128);
            for n in spec.network..=spec.last() {
                prop_assert_eq!(layout.is_allocatable(int_to_addr(spec.v4, n)), spec.allowed(n));
            }
            let expected_blocks: Vec<IpNet> = (0..layout.block_count())
                .filter_map(|i| layout.block_at(i))
                .filter(|&b| layout.allocatable_in(b).next().is_some())
                .collect();
            prop_assert_eq!(layout.blocks().collect::<Vec<_>>(), expected_blocks);
        }

        #[test]
        fn is_allocatable_agrees_with_the_rules_on_huge_pools(
            spec in pool_spec(0..=32, 0..=128, 12),
            probes in prop::collection::vec(any::<u128>(), 64),
        ) {
            let layout = spec.layout();
            let interesting = spec.ranges.iter().flat_map(|&(s, e)| [s, e, s.wrapping_sub(1), e.wrapping_add(1)])
                .chain(spec.exclude.iter().flat_map(|&(x, p)| [x, x.wrapping_sub(1), x | low_mask(spec.max() - p)]))
                .chain([spec.network, spec.last(), spec.network.wrapping_add(1)]);
            let size_mask = low_mask(spec.max() - spec.prefix);
            for n in probes.iter().map(|p| spec.network | (p & size_mask)).chain(interesting) {
                if !spec.v4 || n <= u128::from(u32::MAX) {
                    let ip = int_to_addr(spec.v4, n);
                    prop_assert_eq!(layout.is_allocatable(ip), spec.allowed(n), "at {}", ip);
                }
            }
        }
    }
}
