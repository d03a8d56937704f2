//! Block affinity: which blocks of a pool a node tries, and in which order, when it
//! allocates. Each node allocates from the blocks affine to it, claims a free block of the
//! pool when those have no ready IP, and borrows single IPs from other nodes' blocks only when
//! the pool has no free block left, so that nodes rarely write the same block (no conflicts)
//! and small pools still hand out every address.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;

use super::pools::block_name;
use super::{PoolLayout, blocks};
use crate::crd::IPBlockSpec;

/// One block of the pool as the node's cache shows it.
#[derive(Clone, Copy, Debug)]
pub struct KnownBlock<'a> {
    /// The IPBlock's name.
    pub name: &'a str,
    /// Its CIDR.
    pub net: IpNet,
    /// The node it is affine to, if any.
    pub affinity: Option<&'a str>,
    /// How many addresses it holds, its spares counted ([`blocks::held`]): a block holding
    /// spares is nobody's to claim.
    pub records: usize,
}

impl<'a> KnownBlock<'a> {
    /// What `plan` needs of `block`; `None` for a block without a name or with a CIDR that
    /// does not parse.
    pub fn of(block: &'a crate::crd::IPBlock) -> Option<Self> {
        Some(Self {
            name: block.metadata.name.as_deref()?,
            net: block.spec.cidr.parse().ok()?,
            affinity: block.spec.affinity.as_deref(),
            records: blocks::held(&block.spec),
        })
    }
}

/// How a node may use one block it tries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// Affine to the node: allocate from it.
    Own,
    /// Free (no affinity, no record, or not created yet): claim it for the node and allocate
    /// from it in the same write, if it is still free then.
    Claim,
    /// Another node's, or unclaimed but holding records: take one IP from it.
    Borrow,
}

/// One block to try, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The IPBlock's name.
    pub name: String,
    /// Its CIDR.
    pub net: IpNet,
    /// How the node may use it.
    pub how: Use,
}

/// The blocks `node` tries for one IP of the pool laid out as `layout`, in order: its own
/// blocks (by address), the free blocks the cache knows, at most `fresh` blocks not created
/// yet ([`fresh_blocks`]), then every other block, starting at an offset of the node's own so that
/// borrowing nodes spread over the lenders. Blocks that are not blocks of `layout` (written
/// under an earlier layout of a pool of this name) are never tried.
pub fn plan(node: &str, pool: &str, layout: &PoolLayout, known: &[KnownBlock<'_>], fresh: usize) -> Vec<Candidate> {
    let mut known: Vec<&KnownBlock<'_>> = known.iter().filter(|b| layout.is_block(b.net)).collect();
    known.sort_by_key(|b| b.net);
    let candidate = |b: &KnownBlock<'_>, how| Candidate { name: b.name.to_string(), net: b.net, how };
    let own = known.iter().filter(|b| b.affinity == Some(node)).map(|b| candidate(b, Use::Own));
    let free = known.iter().filter(|b| b.affinity.is_none() && b.records == 0).map(|b| candidate(b, Use::Claim));
    let created: BTreeSet<IpNet> = known.iter().map(|b| b.net).collect();
    let fresh = fresh_blocks(node, layout, &created, fresh).into_iter().map(|net| Candidate {
        name: block_name(pool, net),
        net,
        how: Use::Claim,
    });
    let mut others: Vec<Candidate> = known
        .iter()
        .filter(|b| b.affinity.is_some_and(|a| a != node) || (b.affinity.is_none() && b.records > 0))
        .map(|b| candidate(b, Use::Borrow))
        .collect();
    if !others.is_empty() {
        let offset = node_hash(node) % others.len();
        others.rotate_left(offset);
    }
    own.chain(free).chain(fresh).chain(others).collect()
}

/// How many blocks a node looks at from its own starting block for ones not created yet,
/// before it looks from the pool's first block.
const FRESH_SCAN: u128 = 4096;

/// At most `count` blocks of the pool with an allocatable address that are not `created`:
/// from a starting block of the node's own (so that nodes claiming at the same time rarely
/// race for one block), wrapping around, then from the pool's first block (a pool whose
/// `ranges` leave most blocks empty).
fn fresh_blocks(node: &str, layout: &PoolLayout, created: &BTreeSet<IpNet>, count: usize) -> Vec<IpNet> {
    let blocks = layout.block_count();
    let start = (node_hash(node) as u128) % blocks;
    let from_start = (0..blocks.min(FRESH_SCAN)).filter_map(|k| layout.block_at(start.wrapping_add(k) % blocks));
    let mut fresh: Vec<IpNet> = Vec::new();
    for net in from_start.chain(layout.blocks()) {
        if fresh.len() == count {
            break;
        }
        if !created.contains(&net) && !fresh.contains(&net) && layout.allocatable_in(net).next().is_some() {
            fresh.push(net);
        }
    }
    fresh
}

/// `candidates` ([`plan`]'s) with the blocks holding one of `returning` first, their order
/// otherwise kept: a pod taking back the IPs of its sandbox the runtime lost gets them before
/// a fresh IP of an earlier block.
pub fn holding_first(mut candidates: Vec<Candidate>, returning: &BTreeSet<IpAddr>) -> Vec<Candidate> {
    candidates.sort_by_key(|c| !returning.iter().any(|ip| c.net.contains(ip)));
    candidates
}

/// Whether `node` may allocate in `block` as `how` says, as the block stands when the write
/// is made; claims the block for `node` when it meant to use the block as its own or to claim
/// it and the block is free. A block another node holds in the meantime is left alone (it
/// comes back as a lender only when no free block is left).
pub fn take_for(block: &mut IPBlockSpec, node: &str, how: Use) -> bool {
    match how {
        Use::Borrow => true,
        // A node's own block that it finds free (its affinity released or never written, as
        // after the block was deleted and made anew) is claimed again.
        Use::Own | Use::Claim => match block.affinity.as_deref() {
            Some(owner) => owner == node,
            None if blocks::holds_nothing(block) => {
                block.affinity = Some(node.to_string());
                true
            }
            None => false,
        },
    }
}

/// Whether [`release`] would change `block` for `gone`: the block is affine to it and holds
/// spares, or no record.
pub fn releasable(block: &IPBlockSpec, gone: &str) -> bool {
    block.affinity.as_deref() == Some(gone) && (!block.spares.is_empty() || block.allocations.is_empty())
}

/// Frees what `gone` (a node that no longer exists) holds in `block`: its spares, whatever
/// records the block keeps (no sandbox of a node that is gone binds one any more; the caller
/// waits while a pod reports one), and its affinity once the block holds no record, so any
/// node may claim the block. Says whether it changed.
pub fn release(block: &mut IPBlockSpec, gone: &str) -> bool {
    if !releasable(block, gone) {
        return false;
    }
    block.spares.clear();
    if block.allocations.is_empty() {
        block.affinity = None;
    }
    true
}

/// A stable hash of the node name, so each node starts borrowing, and looking for blocks not
/// created yet, at its own offset. Names that differ in one character (`node-1`, `node-2`) land
/// far apart (FNV-1a, then a 64-bit mix), so their first blocks are not neighbours that the next
/// claim of one would race the other for.
fn node_hash(node: &str) -> usize {
    let fnv = node.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    let mut x = fnv ^ (fnv >> 33);
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^= x >> 33;
    // Truncated on 32-bit targets, which only narrows the spread.
    x as usize
}

#[cfg(test)]
mod test {
    use super::*;

    fn layout() -> PoolLayout {
        // Four /28 blocks.
        PoolLayout::new("10.0.0.0/26", &[], &[], None, Some(28)).unwrap()
    }

    fn net(text: &str) -> IpNet {
        text.parse().unwrap()
    }

    fn known<'a>(name: &'a str, cidr: &str, affinity: Option<&'a str>, records: usize) -> KnownBlock<'a> {
        KnownBlock { name, net: net(cidr), affinity, records }
    }

    fn order(candidates: &[Candidate]) -> Vec<(String, Use)> {
        candidates.iter().map(|c| (c.net.to_string(), c.how)).collect()
    }

    #[test]
    fn a_node_tries_its_own_blocks_then_free_ones_then_fresh_ones_then_borrows() {
        let blocks = [
            known("b3", "10.0.0.48/28", Some("a"), 3),
            known("b1", "10.0.0.16/28", Some("b"), 5),
            known("b0", "10.0.0.0/28", Some("a"), 14),
            known("b2", "10.0.0.32/28", None, 0),
        ];
        let plan = plan("a", "p", &layout(), &blocks, 8);
        assert_eq!(
            order(&plan),
            [
                ("10.0.0.0/28".to_string(), Use::Own),
                ("10.0.0.48/28".to_string(), Use::Own),
                ("10.0.0.32/28".to_string(), Use::Claim),
                ("10.0.0.16/28".to_string(), Use::Borrow),
            ]
        );
    }

    #[test]
    fn the_blocks_holding_ips_a_pod_takes_back_go_first_the_rest_in_order() {
        let blocks = [
            known("b0", "10.0.0.0/28", Some("a"), 14),
            known("b3", "10.0.0.48/28", Some("a"), 3),
            known("b1", "10.0.0.16/28", Some("b"), 5),
        ];
        let planned = plan("a", "p", &layout(), &blocks, 0);
        let nets = |c: &[Candidate]| c.iter().map(|c| c.net.to_string()).collect::<Vec<_>>();
        // (IPs taken back, the blocks' order)
        let cases: [(&[&str], [&str; 3]); 4] = [
            (&[], ["10.0.0.0/28", "10.0.0.48/28", "10.0.0.16/28"]),
            (&["10.0.0.20"], ["10.0.0.16/28", "10.0.0.0/28", "10.0.0.48/28"]),
            (&["10.0.0.50", "10.0.0.20"], ["10.0.0.48/28", "10.0.0.16/28", "10.0.0.0/28"]),
            (&["10.0.1.1"], ["10.0.0.0/28", "10.0.0.48/28", "10.0.0.16/28"]),
        ];
        for (returning, expected) in cases {
            let returning: BTreeSet<IpAddr> = returning.iter().map(|ip| ip.parse().unwrap()).collect();
            assert_eq!(nets(&holding_first(planned.clone(), &returning)), expected, "{returning:?}");
        }
    }

    #[test]
    fn blocks_not_yet_created_are_claimed_from_the_nodes_own_start_and_named_as_the_pool_names_them() {
        let blocks = [known("p-10-0-0-0-28", "10.0.0.0/28", Some("b"), 1)];
        let plan = plan("a", "p", &layout(), &blocks, 3);
        let claims: Vec<&Candidate> = plan.iter().filter(|c| c.how == Use::Claim).collect();
        let nets: BTreeSet<String> = claims.iter().map(|c| c.net.to_string()).collect();
        assert_eq!(nets, BTreeSet::from(["10.0.0.16/28", "10.0.0.32/28", "10.0.0.48/28"].map(String::from)));
        assert_eq!(plan.last().map(|c| (c.net.to_string(), c.how)), Some(("10.0.0.0/28".to_string(), Use::Borrow)));
        for claim in claims {
            assert_eq!(claim.name, block_name("p", claim.net));
        }
    }

    #[test]
    fn nodes_claiming_at_once_start_at_different_blocks_and_still_find_the_last_free_one() {
        let firsts: BTreeSet<IpNet> =
            ["n1", "n2", "n3", "n4", "n5", "n6"].iter().map(|node| plan(node, "p", &layout(), &[], 1)[0].net).collect();
        assert!(firsts.len() > 1, "every node claims the same block first: {firsts:?}");
        let taken: Vec<KnownBlock<'_>> = ["10.0.0.0/28", "10.0.0.16/28", "10.0.0.48/28"]
            .iter()
            .map(|cidr| known("x", cidr, Some("owner"), 1))
            .collect();
        for node in ["n1", "n2", "n3", "n4"] {
            let claims: Vec<String> = plan(node, "p", &layout(), &taken, 8)
                .into_iter()
                .filter(|c| c.how == Use::Claim)
                .map(|c| c.net.to_string())
                .collect();
            assert_eq!(claims, ["10.0.0.32/28"], "{node}");
        }
        // A pool whose ranges leave the blocks near a node's start empty still offers the rest.
        let sparse = PoolLayout::new("10.0.0.0/16", &[("10.0.200.1", "10.0.200.9")], &[], None, Some(28)).unwrap();
        let claims = plan("n1", "p", &sparse, &[], 2);
        assert_eq!(claims.iter().map(|c| c.net.to_string()).collect::<Vec<_>>(), ["10.0.200.0/28"]);
    }

    #[test]
    fn an_unclaimed_block_with_records_is_lent_not_claimed_and_a_foreign_layout_is_never_tried() {
        let blocks = [known("old", "10.0.0.0/28", None, 2), known("orphan", "10.0.0.0/27", None, 0)];
        let plan = plan("a", "p", &layout(), &blocks, 0);
        assert_eq!(order(&plan), [("10.0.0.0/28".to_string(), Use::Borrow)]);
    }

    #[test]
    fn borrowing_nodes_start_at_different_lenders() {
        let blocks: Vec<KnownBlock<'_>> = ["10.0.0.0/28", "10.0.0.16/28", "10.0.0.32/28", "10.0.0.48/28"]
            .iter()
            .map(|cidr| known("x", cidr, Some("owner"), 16))
            .collect();
        let firsts: std::collections::BTreeSet<IpNet> = ["n1", "n2", "n3", "n4", "n5", "n6"]
            .iter()
            .map(|node| plan(node, "p", &layout(), &blocks, 0)[0].net)
            .collect();
        assert!(firsts.len() > 1, "every node starts borrowing at the same block: {firsts:?}");
    }

    #[test]
    fn nodes_named_alike_start_looking_for_new_blocks_far_apart() {
        let layout = PoolLayout::new("10.244.0.0/16", &[], &[], None, Some(24)).unwrap();
        let starts: Vec<IpNet> = ["node-0", "node-1", "node-2", "node-3"]
            .iter()
            .map(|node| fresh_blocks(node, &layout, &BTreeSet::new(), 1)[0])
            .collect();
        let index = |net: &IpNet| u32::from(net.network().to_string().parse::<std::net::Ipv4Addr>().unwrap()) >> 8;
        for (i, a) in starts.iter().enumerate() {
            for b in &starts[i + 1..] {
                assert!(index(a).abs_diff(index(b)) > 1, "neighbouring first blocks: {starts:?}");
            }
        }
    }

    #[test]
    fn a_claim_takes_only_a_block_still_free_when_written() {
        let spec = |affinity: Option<&str>, records: bool| {
            let mut spec = IPBlockSpec { affinity: affinity.map(String::from), ..IPBlockSpec::default() };
            if records {
                spec.allocations.insert("10.0.0.1".into(), serde_json::from_value(record()).unwrap());
            }
            spec
        };
        // (affinity, has records, use, may allocate, affinity after)
        let cases = [
            (None, false, Use::Claim, true, Some("a")),
            (Some("a"), true, Use::Claim, true, Some("a")),
            (Some("b"), false, Use::Claim, false, Some("b")),
            (None, true, Use::Claim, false, None),
            (Some("b"), true, Use::Borrow, true, Some("b")),
            (None, false, Use::Own, true, Some("a")),
            (Some("b"), true, Use::Own, false, Some("b")),
        ];
        for (affinity, records, how, may, after) in cases {
            let mut block = spec(affinity, records);
            assert_eq!(take_for(&mut block, "a", how), may, "{affinity:?} {records} {how:?}");
            assert_eq!(block.affinity.as_deref(), after, "{affinity:?} {records} {how:?}");
        }
    }

    #[test]
    fn a_gone_nodes_spares_always_go_and_its_affinity_once_the_block_holds_no_record() {
        let mut empty = IPBlockSpec { affinity: Some("gone".into()), ..IPBlockSpec::default() };
        assert!(!release(&mut empty, "other"));
        assert!(release(&mut empty, "gone"));
        assert_eq!(empty.affinity, None);
        let mut spares_only = IPBlockSpec { affinity: Some("gone".into()), ..IPBlockSpec::default() };
        spares_only.spares.insert("10.0.0.2".into());
        assert!(release(&mut spares_only, "gone"), "the spares of a gone node go with its affinity");
        assert!(spares_only.affinity.is_none() && spares_only.spares.is_empty());
        let mut held = IPBlockSpec { affinity: Some("gone".into()), ..IPBlockSpec::default() };
        held.allocations.insert("10.0.0.1".into(), serde_json::from_value(record()).unwrap());
        assert!(!releasable(&held, "gone") && !release(&mut held, "gone"), "a record and no spare: nothing to free");
        assert_eq!(held.affinity.as_deref(), Some("gone"));
        held.spares.insert("10.0.0.2".into());
        assert!(!releasable(&held, "other") && !release(&mut held, "other"));
        assert!(release(&mut held, "gone"), "the spares go where a record stays");
        assert!(held.spares.is_empty() && held.allocations.len() == 1);
        assert_eq!(held.affinity.as_deref(), Some("gone"), "the record keeps the block the gone node's");
    }

    fn record() -> serde_json::Value {
        serde_json::json!({
            "pod": {"namespace": "ns", "name": "p", "uid": "u"},
            "node": "gone", "containerId": "c", "interface": "eth0", "allocatedAt": "2026-01-01T00:00:00Z"
        })
    }
}
