//! Spare IPs (`IPBlock.spec.spares`, the agent's `--spare-ips`): addresses a node's agent
//! holds ready in the blocks affine to its node. An ADD binds one to its sandbox in the node's
//! checkpoint and answers at once; the pod's record replaces the spare in a write right after
//! ([`convert`]). Until then the block shows the IP as a spare, which no other node and no
//! other allocation takes, so the IP is never handed out twice; the checkpoint tells which
//! sandbox holds it. These are the pure edits; the agent's `spares` module does the I/O.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::affinity::{self, Use};
use super::choose::{BlockUsage, choose_ip};
use super::free::{self, Asker, Hold, SpareRight};
use super::pools::PoolView;
use super::{PoolLayout, blocks};
use crate::crd::{Allocation, IPBlockSpec};

/// Whether `ip` is a spare of the block that no record holds: one its node's agent may bind.
pub fn is_bindable(spec: &IPBlockSpec, ip: &str) -> bool {
    spec.spares.contains(ip) && !spec.allocations.contains_key(ip)
}

/// Whether `ip` is a bindable spare ([`is_bindable`]) of `node`'s, the block's affinity: every
/// edit of a spare's node checks it, so a node never touches another's spares (a block freed
/// and claimed by another node meanwhile).
pub fn is_bindable_for(spec: &IPBlockSpec, node: &str, ip: &str) -> bool {
    spec.affinity.as_deref() == Some(node) && is_bindable(spec, ip)
}

/// The bindable spares of the block ([`is_bindable`]), in address order.
pub fn bindable(spec: &IPBlockSpec) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> =
        spec.spares.iter().filter(|ip| !spec.allocations.contains_key(*ip)).filter_map(|ip| ip.parse().ok()).collect();
    ips.sort();
    ips
}

/// Whether a node labelled `node_labels` keeps spares in `pool`: only in the pools a stateless
/// pod's first interface takes there without naming one (default, and usable on the node by the
/// same rule as every ADD's, [`super::pools::unusable_on_node`]: not being deleted nor disabled,
/// with a valid layout, not overlapping (`overlapping`), selecting the node), since only such
/// ADDs bind spares. A pool the node allocated from for fixed or list IPs, or for a secondary
/// network, keeps none: its spares would be the lowest free addresses, other workloads' fixed
/// IPs, which other nodes could then never take (issue 26, F4).
pub fn kept_in(
    pool: &PoolView<'_>,
    node_labels: &BTreeMap<String, String>,
    overlapping: &BTreeMap<String, BTreeSet<String>>,
) -> bool {
    pool.spec.default && super::pools::unusable_on_node(pool, node_labels, overlapping).is_none()
}

/// The spares of `node`'s block that an ADD of the node may bind now, in address order: those
/// the one rule of [`free::hold`] leaves to the node (no record, and the pool's current
/// `layout` still hands them out). A spare the layout no longer allows (its pool edited since:
/// `exclude`, `gateway` or `ranges`) is never bound, and is given back ([`out_of_layout`]).
pub fn bindable_in(spec: &IPBlockSpec, layout: &PoolLayout, node: &str, now: Timestamp) -> Vec<IpAddr> {
    let asker = Asker { spares: SpareRight::Own(node), cooldown: Duration::ZERO };
    bindable(spec).into_iter().filter(|ip| free::hold(spec, layout, *ip, &asker, now).is_none()).collect()
}

/// The bindable spares of the block that the pool's current `layout` no longer hands out: given
/// back whatever the node's target.
pub fn out_of_layout(spec: &IPBlockSpec, layout: &PoolLayout, now: Timestamp) -> Vec<IpAddr> {
    bindable(spec)
        .into_iter()
        .filter(|ip| free::hold(spec, layout, *ip, &Asker::ADOPT, now) == Some(Hold::Layout))
        .collect()
}

/// Adds up to `count` IPs of block `net` (of the pool laid out as `layout`) to its spares:
/// ready ones (no record, not a spare, past their cooldown, not in `exclude`: the IPs the
/// node's checkpoint holds), chosen as an allocation would choose them. Returns those added.
pub fn reserve(
    spec: &mut IPBlockSpec,
    layout: &PoolLayout,
    net: IpNet,
    count: usize,
    exclude: &BTreeSet<IpAddr>,
    now: Timestamp,
    cooldown: Duration,
) -> Vec<IpAddr> {
    let (mut taken, released) = blocks::usage(spec);
    taken.extend(exclude.iter().copied());
    let mut added = Vec::new();
    while added.len() < count {
        let usage = BlockUsage { allocated: &taken, released: &released };
        let Ok(ip) = choose_ip(layout, net, usage, now, cooldown) else { break };
        taken.insert(ip);
        spec.spares.insert(ip.to_string());
        added.push(ip);
    }
    added
}

/// Gives back `node`'s spares `ips` that are still bindable: they leave the spare set and are free
/// at once (no pod ever had them, so there is nothing to cool down). Returns how many left.
pub fn give_back(spec: &mut IPBlockSpec, node: &str, ips: &[IpAddr]) -> usize {
    let mut gone = 0;
    for ip in ips.iter().map(IpAddr::to_string) {
        if is_bindable_for(spec, node, &ip) {
            spec.spares.remove(&ip);
            gone += 1;
        }
    }
    gone
}

/// What [`convert`] found at the IP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Converted {
    /// The spare is now `record`.
    Written,
    /// The IP is no spare of the node (converted before, released by its sandbox's DEL, or
    /// the block is no longer the node's): nothing to do.
    NotSpare,
    /// Another pod's record holds the IP: left alone. Only a write that ignored the spare
    /// (a component older than spares) leads here; the caller reports it.
    HeldByOther,
}

/// Turns `node`'s spare `ip`, bound on the node to `record`'s sandbox, into `record`. A record
/// of the same pod already there is replaced by the sandbox's own.
pub fn convert(spec: &mut IPBlockSpec, node: &str, ip: &str, record: &Allocation) -> Converted {
    if spec.affinity.as_deref() != Some(node) || !spec.spares.contains(ip) {
        return Converted::NotSpare;
    }
    if spec.allocations.get(ip).is_some_and(|held| held.pod.uid != record.pod.uid) {
        return Converted::HeldByOther;
    }
    spec.spares.remove(ip);
    spec.released.remove(ip);
    spec.allocations.insert(ip.to_string(), record.clone());
    Converted::Written
}

/// Releases `node`'s spare `ip` whose sandbox ended before its record was written (a DEL, or the
/// node's GC, right after the ADD): it leaves the spares and cools down from `now`, as a
/// released record's IP does. Says whether the block changed.
pub fn release_bound(spec: &mut IPBlockSpec, node: &str, ip: &str, now: Timestamp) -> bool {
    if !is_bindable_for(spec, node, ip) {
        return false;
    }
    spec.spares.remove(ip);
    spec.released.insert(ip.to_string(), Time(now));
    true
}

/// Settles the spares of a node whose checkpoint was lost (no one knows which were bound):
/// a spare some pod of the node reports (`reported`: IP → that pod) becomes its record, as a
/// repair writes it ([`blocks::adopted_record`], on `network`); the others leave the spares
/// and cool down from `now`, as a released IP does. Returns how many it settled.
pub fn settle_unknown(
    spec: &mut IPBlockSpec,
    node: &str,
    reported: &BTreeMap<String, blocks::Adopter>,
    network: &str,
    now: Timestamp,
) -> usize {
    if spec.affinity.as_deref() != Some(node) {
        return 0;
    }
    let spares: Vec<String> = spec.spares.iter().filter(|ip| !spec.allocations.contains_key(*ip)).cloned().collect();
    for ip in &spares {
        match reported.get(ip) {
            Some(adopter) => {
                spec.spares.remove(ip);
                spec.allocations.insert(ip.clone(), blocks::adopted_record(adopter, network, now));
            }
            None => {
                release_bound(spec, node, ip, now);
            }
        }
    }
    spec.spares.retain(|ip| !spec.allocations.contains_key(ip));
    spares.len()
}

/// Spares to reserve in one block ([`reserve`]).
#[derive(Clone, Debug)]
pub struct Reserve {
    /// The pool's layout.
    pub layout: PoolLayout,
    /// The block's CIDR.
    pub net: IpNet,
    /// How many.
    pub count: usize,
    /// Whether the block is a free one the node claims in the same write
    /// ([`affinity::take_for`]); nothing is reserved when another node claimed it first.
    pub claim: bool,
}

/// What one pass of a node's tending does to one of its blocks, in one write: records for
/// bound spares ([`convert`]), spares given back ([`give_back`]), spares reserved ([`reserve`]).
#[derive(Clone, Debug, Default)]
pub struct Tending {
    /// (IP, record) of each spare bound on the node whose record is to be written.
    pub convert: Vec<(String, Allocation)>,
    /// Spares to give back.
    pub give_back: Vec<IpAddr>,
    /// Spares to reserve.
    pub reserve: Option<Reserve>,
}

/// What [`tend`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tended {
    /// Records written in place of spares.
    pub converted: usize,
    /// Spares given back.
    pub given_back: usize,
    /// Spares reserved.
    pub reserved: usize,
    /// (IP, `namespace/name`) of each bound spare another pod's record holds.
    pub held_by_other: Vec<(String, String)>,
    /// The free block to claim for the reserve was claimed by another node first.
    pub claim_lost: bool,
}

impl Tended {
    /// Whether the block changed.
    pub fn changed(&self) -> bool {
        self.converted + self.given_back + self.reserved > 0
    }
}

/// Applies `plan` to the block: the records first, then the spares given back, then those
/// reserved (ready IPs not in `exclude`, the node's checkpoint, nor just given back).
pub fn tend(
    spec: &mut IPBlockSpec,
    node: &str,
    plan: &Tending,
    exclude: &BTreeSet<IpAddr>,
    now: Timestamp,
    cooldown: Duration,
) -> Tended {
    let mut done = Tended::default();
    for (ip, record) in &plan.convert {
        match convert(spec, node, ip, record) {
            Converted::Written => done.converted += 1,
            Converted::HeldByOther => {
                let holder = spec.allocations.get(ip).map(|r| format!("{}/{}", r.pod.namespace, r.pod.name));
                done.held_by_other.push((ip.clone(), holder.unwrap_or_default()));
            }
            Converted::NotSpare => {}
        }
    }
    done.given_back = give_back(spec, node, &plan.give_back);
    if let Some(Reserve { layout, net, count, claim }) = &plan.reserve {
        let how = if *claim { Use::Claim } else { Use::Own };
        if affinity::take_for(spec, node, how) {
            let mut exclude = exclude.clone();
            exclude.extend(&plan.give_back);
            done.reserved = reserve(spec, layout, *net, *count, &exclude, now, cooldown).len();
        } else {
            done.claim_lost = *claim;
        }
    }
    done
}

/// How many spares a node keeps in a pool: `wanted` while the pool has free blocks to spare
/// (`free_blocks`: more than one no node has claimed yet; the last goes to a node's first pod),
/// none otherwise, since then other nodes may soon have to borrow single IPs from this node's
/// blocks and spares are never lent.
pub fn target(wanted: usize, free_blocks: bool) -> usize {
    if free_blocks { wanted } else { 0 }
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::crd::PodRef;

    fn layout() -> PoolLayout {
        PoolLayout::new("10.0.0.0/24", &[], &[], Some("10.0.0.1"), None).unwrap()
    }

    fn net() -> IpNet {
        "10.0.0.0/24".parse().unwrap()
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + seconds).unwrap()
    }

    fn record(uid: &str) -> Allocation {
        Allocation {
            pod: PodRef { namespace: "ns".into(), name: format!("pod-{uid}"), uid: uid.into() },
            node: "n1".into(),
            network: "net".into(),
            container_id: format!("c-{uid}"),
            interface: "eth0".into(),
            owner: None,
            sticky: false,
            held_for: None,
            allocated_at: Time(at(0)),
            release_handshake: None,
            migration_target: None,
            repaired_at: None,
        }
    }

    fn spec() -> IPBlockSpec {
        IPBlockSpec { pool: "p".into(), cidr: "10.0.0.0/24".into(), affinity: Some("n1".into()), ..Default::default() }
    }

    #[test]
    fn spares_are_ready_ips_no_record_no_checkpoint_entry_and_no_cooldown_holds() {
        let mut spec = spec();
        spec.allocations.insert("10.0.0.2".into(), record("a"));
        spec.released.insert("10.0.0.3".into(), Time(at(0)));
        let exclude = BTreeSet::from([ip("10.0.0.4")]);
        let added = reserve(&mut spec, &layout(), net(), 3, &exclude, at(10), Duration::from_secs(30));
        assert_eq!(added, vec![ip("10.0.0.5"), ip("10.0.0.6"), ip("10.0.0.7")]);
        assert_eq!(bindable(&spec), added);
        // Spares count as taken: the next reserve and every allocation pass them by.
        let more = reserve(&mut spec, &layout(), net(), 1, &BTreeSet::new(), at(10), Duration::from_secs(30));
        assert_eq!(more, vec![ip("10.0.0.4")]);
        let (taken, _) = blocks::usage(&spec);
        assert!(added.iter().all(|ip| taken.contains(ip)));
    }

    #[test]
    fn a_spare_the_pools_layout_no_longer_allows_is_not_bindable_and_goes_back() {
        let mut spec = spec();
        spec.spares = ["10.0.0.4", "10.0.0.5", "10.0.0.6"].map(String::from).into();
        // The pool's layout after an edit: 10.0.0.5 excluded, 10.0.0.6 the gateway.
        let edited = PoolLayout::new("10.0.0.0/24", &[], &["10.0.0.5"], Some("10.0.0.6"), None).unwrap();
        assert_eq!(bindable_in(&spec, &edited, "n1", at(0)), vec![ip("10.0.0.4")]);
        assert_eq!(out_of_layout(&spec, &edited, at(0)), vec![ip("10.0.0.5"), ip("10.0.0.6")]);
        assert_eq!(bindable_in(&spec, &layout(), "n1", at(0)), vec![ip("10.0.0.4"), ip("10.0.0.5"), ip("10.0.0.6")]);
        assert!(bindable_in(&spec, &layout(), "n2", at(0)).is_empty(), "another node binds the spares");
        assert!(out_of_layout(&spec, &layout(), at(0)).is_empty());
    }

    #[test]
    fn spares_are_kept_only_in_the_default_pools_a_stateless_pod_of_the_node_takes() {
        let spec = |extra: serde_json::Value| -> crate::crd::IPPoolSpec {
            let mut spec = serde_json::json!({"cidr": "10.0.0.0/24", "default": true});
            for (key, value) in extra.as_object().into_iter().flatten() {
                spec[key] = value.clone();
            }
            serde_json::from_value(spec).unwrap()
        };
        let labels = BTreeMap::from([("zone".to_string(), "a".to_string())]);
        // (the pool's spec, being deleted, overlapping another pool, kept)
        let cases = [
            (serde_json::json!({}), false, false, true),
            (serde_json::json!({"default": false}), false, false, false),
            (serde_json::json!({"disabled": true}), false, false, false),
            (serde_json::json!({}), true, false, false),
            (serde_json::json!({}), false, true, false),
            (serde_json::json!({"blockSize": 20}), false, false, false),
            (serde_json::json!({"nodeSelector": {"matchLabels": {"zone": "b"}}}), false, false, false),
            (serde_json::json!({"nodeSelector": {"matchLabels": {"zone": "a"}}}), false, false, true),
        ];
        for (extra, deleting, overlaps, kept) in cases {
            let set = super::super::pools::PoolSet::new([("p".to_string(), spec(extra.clone()), deleting)], []);
            let views = set.views();
            let overlapping = if overlaps {
                BTreeMap::from([("p".to_string(), BTreeSet::from(["q".to_string()]))])
            } else {
                BTreeMap::new()
            };
            assert_eq!(
                kept_in(&views[0], &labels, &overlapping),
                kept,
                "{extra}, deleting {deleting}, overlapping {overlaps}"
            );
        }
    }

    #[test]
    fn a_full_block_reserves_what_it_has() {
        let layout = PoolLayout::new("10.0.0.0/30", &[], &[], None, None).unwrap();
        let mut spec = IPBlockSpec { cidr: "10.0.0.0/30".into(), ..spec() };
        let added =
            reserve(&mut spec, &layout, "10.0.0.0/30".parse().unwrap(), 5, &BTreeSet::new(), at(0), Duration::ZERO);
        assert_eq!(added, vec![ip("10.0.0.1"), ip("10.0.0.2")]);
    }

    #[test]
    fn a_bound_spare_becomes_its_record_once_and_never_overwrites_another_pods_record() {
        let mut spec = spec();
        spec.spares.insert("10.0.0.5".into());
        assert_eq!(convert(&mut spec, "n1", "10.0.0.5", &record("a")), Converted::Written);
        assert_eq!(spec.allocations.get("10.0.0.5"), Some(&record("a")));
        assert!(spec.spares.is_empty());
        assert_eq!(convert(&mut spec, "n1", "10.0.0.5", &record("a")), Converted::NotSpare, "a second conversion");

        spec.spares.insert("10.0.0.6".into());
        spec.allocations.insert("10.0.0.6".into(), record("other"));
        assert_eq!(convert(&mut spec, "n1", "10.0.0.6", &record("a")), Converted::HeldByOther);
        assert_eq!(spec.allocations.get("10.0.0.6"), Some(&record("other")));
        assert!(!is_bindable(&spec, "10.0.0.6"), "a recorded IP is no spare");
    }

    #[test]
    fn a_del_before_the_conversion_and_the_conversion_after_it_leave_the_ip_cooling_and_unrecorded() {
        // Either order of the two edits ends the same: the IP cools down, no record names it.
        let mut del_first = spec();
        del_first.spares.insert("10.0.0.5".into());
        assert!(release_bound(&mut del_first, "n1", "10.0.0.5", at(5)));
        assert_eq!(convert(&mut del_first, "n1", "10.0.0.5", &record("a")), Converted::NotSpare);
        assert!(del_first.allocations.is_empty() && del_first.spares.is_empty());
        assert_eq!(del_first.released.get("10.0.0.5"), Some(&Time(at(5))));

        let mut converted_first = spec();
        converted_first.spares.insert("10.0.0.5".into());
        assert_eq!(convert(&mut converted_first, "n1", "10.0.0.5", &record("a")), Converted::Written);
        assert!(!release_bound(&mut converted_first, "n1", "10.0.0.5", at(5)), "the record's release is the DEL's");
        let outcome = blocks::release_attachment(
            &mut converted_first,
            "10.0.0.5",
            "c-a",
            "eth0",
            Some("a"),
            blocks::STATELESS,
            at(5),
        );
        assert_eq!(outcome, blocks::ReleaseOutcome::Released);
        assert!(converted_first.allocations.is_empty() && converted_first.spares.is_empty());
        assert!(converted_first.released.contains_key("10.0.0.5"));
    }

    #[test]
    fn a_node_never_touches_the_spares_of_a_block_that_is_not_its_own() {
        let mut spec = IPBlockSpec { affinity: Some("n2".into()), ..spec() };
        spec.spares.insert("10.0.0.5".into());
        assert!(!is_bindable_for(&spec, "n1", "10.0.0.5") && is_bindable_for(&spec, "n2", "10.0.0.5"));
        assert_eq!(convert(&mut spec, "n1", "10.0.0.5", &record("a")), Converted::NotSpare);
        assert!(!release_bound(&mut spec, "n1", "10.0.0.5", at(0)));
        assert_eq!(give_back(&mut spec, "n1", &[ip("10.0.0.5")]), 0);
        assert_eq!(settle_unknown(&mut spec, "n1", &BTreeMap::new(), "net", at(0)), 0);
        assert_eq!(spec.spares, BTreeSet::from(["10.0.0.5".to_string()]));
        assert!(spec.allocations.is_empty() && spec.released.is_empty());
    }

    #[test]
    fn spares_given_back_are_free_at_once_and_a_recorded_one_stays() {
        let mut spec = spec();
        spec.spares.extend(["10.0.0.5".to_string(), "10.0.0.6".to_string()]);
        spec.allocations.insert("10.0.0.6".into(), record("a"));
        assert_eq!(give_back(&mut spec, "n1", &[ip("10.0.0.5"), ip("10.0.0.6"), ip("10.0.0.9")]), 1);
        assert_eq!(spec.spares, BTreeSet::from(["10.0.0.6".to_string()]));
        assert_eq!(spec.released, BTreeMap::new());
    }

    #[test]
    fn after_a_lost_checkpoint_a_spare_a_pod_reports_becomes_its_record_and_the_others_cool_down() {
        let mut spec = spec();
        spec.spares.extend(["10.0.0.5".to_string(), "10.0.0.6".to_string(), "10.0.0.7".to_string()]);
        spec.allocations.insert("10.0.0.7".into(), record("a"));
        let adopter = blocks::Adopter {
            pod: PodRef { namespace: "ns".into(), name: "web".into(), uid: "w".into() },
            node: "n1".into(),
            owner: None,
            sticky: false,
        };
        let reported = BTreeMap::from([("10.0.0.5".to_string(), adopter)]);
        assert_eq!(settle_unknown(&mut spec, "n1", &reported, "net", at(9)), 2);
        assert!(spec.spares.is_empty());
        let adopted = &spec.allocations["10.0.0.5"];
        assert_eq!((adopted.pod.uid.as_str(), adopted.repaired_at.is_some()), ("w", true));
        assert!(!spec.allocations.contains_key("10.0.0.6"));
        assert_eq!(spec.released.get("10.0.0.6"), Some(&Time(at(9))));
        assert_eq!(spec.allocations["10.0.0.7"], record("a"), "a recorded IP is left alone");
    }

    #[test]
    fn one_pass_writes_records_gives_back_and_reserves_in_one_edit() {
        let mut spec = spec();
        spec.spares.extend(["10.0.0.5".to_string(), "10.0.0.6".to_string(), "10.0.0.7".to_string()]);
        spec.allocations.insert("10.0.0.7".into(), record("other"));
        let plan = Tending {
            convert: vec![("10.0.0.5".into(), record("a")), ("10.0.0.7".into(), record("b"))],
            give_back: vec![ip("10.0.0.6")],
            reserve: Some(Reserve { layout: layout(), net: net(), count: 2, claim: false }),
        };
        let exclude = BTreeSet::from([ip("10.0.0.2")]);
        let done = tend(&mut spec, "n1", &plan, &exclude, at(0), Duration::ZERO);
        assert_eq!((done.converted, done.given_back, done.reserved), (1, 1, 2));
        assert_eq!(done.held_by_other, vec![("10.0.0.7".to_string(), "ns/pod-other".to_string())]);
        assert!(done.changed());
        assert_eq!(spec.allocations["10.0.0.5"], record("a"));
        // The reserve takes the lowest ready IPs: .1 is the gateway, .2 in the checkpoint.
        assert_eq!(bindable(&spec), vec![ip("10.0.0.3"), ip("10.0.0.4")]);
        assert!(spec.spares.contains("10.0.0.7"), "another pod's record: the spare entry stays for the report");
        assert!(!tend(&mut spec, "n1", &Tending::default(), &exclude, at(0), Duration::ZERO).changed());

        // A spare given back is not reserved again by the same edit (it would stay withdrawn).
        let mut spec = spec_of(&["10.0.0.2"]);
        let plan = Tending {
            give_back: vec![ip("10.0.0.2")],
            reserve: Some(Reserve { layout: layout(), net: net(), count: 1, claim: false }),
            ..Tending::default()
        };
        let done = tend(&mut spec, "n1", &plan, &BTreeSet::new(), at(0), Duration::ZERO);
        assert_eq!((done.given_back, done.reserved), (1, 1));
        assert_eq!(bindable(&spec), vec![ip("10.0.0.3")]);
    }

    fn spec_of(spares: &[&str]) -> IPBlockSpec {
        let mut spec = spec();
        spec.spares.extend(spares.iter().map(|ip| ip.to_string()));
        spec
    }

    #[test]
    fn spares_go_only_into_the_nodes_own_block_or_a_free_block_it_claims() {
        let reserve = |claim| Tending {
            reserve: Some(Reserve { layout: layout(), net: net(), count: 1, claim }),
            ..Tending::default()
        };
        let none = BTreeSet::new();
        // (affinity, claim, reserved, affinity after, claim lost)
        let cases = [
            (Some("n1"), false, 1, Some("n1"), false),
            (None, true, 1, Some("n1"), false),
            (Some("n2"), true, 0, Some("n2"), true),
            (Some("n2"), false, 0, Some("n2"), false),
        ];
        for (owner, claim, reserved, after, lost) in cases {
            let mut spec = IPBlockSpec { affinity: owner.map(String::from), ..spec() };
            let done = tend(&mut spec, "n1", &reserve(claim), &none, at(0), Duration::ZERO);
            assert_eq!((done.reserved, done.claim_lost), (reserved, lost), "{owner:?} claim {claim}");
            assert_eq!(spec.affinity.as_deref(), after, "{owner:?} claim {claim}");
        }
    }

    #[test]
    fn a_pool_without_a_free_block_gets_no_spares() {
        assert_eq!(target(8, true), 8);
        assert_eq!(target(8, false), 0);
    }
}
