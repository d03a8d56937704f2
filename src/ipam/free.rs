//! "May this IP go to this request": the one rule every path that writes a new record at an
//! IP obeys (issue 26). A record holds an IP; the pool's current layout may no longer hand it
//! out; a spare holds it for its node; a release holds it back for the cooldown. Who asks
//! ([`Asker`]) says which spares it may bind and whether the cooldown applies to it. The
//! callers: a sticky pod taking back its claimed IP (`agent::add`), a pod's new sandbox
//! taking back the IPs of the one the runtime lost (`agent::batch::grant`), a fixed or list IP
//! ([`super::fixed::check_free`]), adopt ([`crate::gc::adopt::apply`]), a node binding its
//! spares ([`super::spares::bindable_in`]), and the chooser of a new pod's IP, which applies the
//! same rule to a whole block at once ([`super::blocks::usage`] and [`super::choose_ip`]; a
//! property test there checks they agree).

use std::net::IpAddr;
use std::time::Duration;

use jiff::Timestamp;

use super::PoolLayout;
use crate::crd::{Allocation, IPBlockSpec};

/// What keeps an IP from a new record, if anything.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Hold<'a> {
    /// A record holds it. Whether the asker may take that record over (a sticky pod's own, a
    /// list reservation of its workload) is the caller's own rule; the IP is not free.
    Record(&'a Allocation),
    /// The pool's current layout does not hand it out (network or broadcast address, the
    /// gateway, excluded, outside `ranges`): the pool was edited since, or the request names it.
    Layout,
    /// A spare no record holds yet, of the block's node (`None`: a block without affinity),
    /// which this asker may not bind: its node's agent hands it out or gives it back.
    Spare(Option<&'a str>),
    /// Released less than the cooldown ago; free at `until`.
    Cooling {
        /// When the cooldown ends.
        until: Timestamp,
    },
}

/// Which spares an asker may bind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpareRight<'a> {
    /// None: a new pod's IP, a sticky pod's claimed IP.
    None,
    /// Those of this node's blocks: an ADD of the node that kept the spare from the node's
    /// other calls (picked or withdrawn) before asking.
    Own(&'a str),
    /// Any: a pod of another IPAM that already uses the IP (adopt), so no ADD may bind it.
    Any,
}

/// Who asks for an IP, as far as [`hold`] cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Asker<'a> {
    /// The spares it may bind.
    pub spares: SpareRight<'a>,
    /// How long a released IP is held back from it; zero when the cooldown does not apply (a
    /// pod taking back its own IP, one that already uses it, a spare bound by its node: spares
    /// are reserved only once their cooldown ended).
    pub cooldown: Duration,
}

impl Asker<'_> {
    /// A pod taking back an IP that was its own: a sticky pod's claimed IP, or the IP of a
    /// sandbox of the same pod that the runtime lost. No other pod's traffic can be sent to
    /// it, so no cooldown.
    pub const RECLAIM: Asker<'static> = Asker { spares: SpareRight::None, cooldown: Duration::ZERO };
    /// Adopt: a live pod of another IPAM uses the IP, whatever ipwarden thought of it.
    pub const ADOPT: Asker<'static> = Asker { spares: SpareRight::Any, cooldown: Duration::ZERO };
}

/// What keeps `ip` of block `spec` (of the pool laid out as `layout`) from a new record of
/// `asker` at `now`; `None`: it may have it. Checked in this order: a record, the layout, a
/// spare, the cooldown.
pub fn hold<'a>(
    spec: &'a IPBlockSpec,
    layout: &PoolLayout,
    ip: IpAddr,
    asker: &Asker<'_>,
    now: Timestamp,
) -> Option<Hold<'a>> {
    let key = ip.to_string();
    if let Some(record) = spec.allocations.get(&key) {
        return Some(Hold::Record(record));
    }
    if !layout.is_allocatable(ip) {
        return Some(Hold::Layout);
    }
    let node = spec.affinity.as_deref();
    let may_bind = match asker.spares {
        SpareRight::None => false,
        SpareRight::Own(own) => node == Some(own),
        SpareRight::Any => true,
    };
    if spec.spares.contains(&key) && !may_bind {
        return Some(Hold::Spare(node));
    }
    let released = spec.released.get(&key).map(|at| at.0).filter(|_| !asker.cooldown.is_zero())?;
    let until = released.checked_add(asker.cooldown).unwrap_or(Timestamp::MAX);
    (until > now).then_some(Hold::Cooling { until })
}

#[cfg(test)]
mod test {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("ip")
    }

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(seconds).expect("timestamp")
    }

    /// 10.0.0.0/24 with gateway 10.0.0.1 and 10.0.0.9 excluded; node-1's block holding a
    /// record at .5, a spare at .6, a recorded spare at .7, .8 released at 100 s.
    fn block() -> (IPBlockSpec, PoolLayout) {
        let layout = PoolLayout::new("10.0.0.0/24", &[], &["10.0.0.9"], Some("10.0.0.1"), Some(24)).expect("layout");
        let mut spec = IPBlockSpec { pool: "p".into(), cidr: "10.0.0.0/24".into(), ..Default::default() };
        spec.affinity = Some("node-1".into());
        spec.allocations.insert("10.0.0.5".into(), crate::ipam::blocks::test::record("u5", "c5"));
        spec.allocations.insert("10.0.0.7".into(), crate::ipam::blocks::test::record("u7", "c7"));
        spec.spares.extend(["10.0.0.6".to_string(), "10.0.0.7".to_string()]);
        spec.released.insert("10.0.0.8".into(), Time(at(100)));
        (spec, layout)
    }

    #[test]
    fn each_asker_meets_records_the_layout_spares_and_the_cooldown_as_the_rule_says() {
        let (spec, layout) = block();
        let minute = Duration::from_secs(60);
        let fresh = Asker { spares: SpareRight::None, cooldown: minute };
        let own = Asker { spares: SpareRight::Own("node-1"), cooldown: minute };
        let other = Asker { spares: SpareRight::Own("node-2"), cooldown: minute };
        let record = |text: &str| Some(Hold::Record(&spec.allocations[text]));
        let cooling = Some(Hold::Cooling { until: at(160) });
        let spare = Some(Hold::Spare(Some("node-1")));
        // (ip, fresh, own node's spare, another node's, reclaim, adopt), at 130 s.
        let table = [
            ("10.0.0.4", None, None, None, None, None),
            (
                "10.0.0.5",
                record("10.0.0.5"),
                record("10.0.0.5"),
                record("10.0.0.5"),
                record("10.0.0.5"),
                record("10.0.0.5"),
            ),
            ("10.0.0.6", spare, None, spare, spare, None),
            (
                "10.0.0.7",
                record("10.0.0.7"),
                record("10.0.0.7"),
                record("10.0.0.7"),
                record("10.0.0.7"),
                record("10.0.0.7"),
            ),
            ("10.0.0.8", cooling, cooling, cooling, None, None),
            (
                "10.0.0.1",
                Some(Hold::Layout),
                Some(Hold::Layout),
                Some(Hold::Layout),
                Some(Hold::Layout),
                Some(Hold::Layout),
            ),
            (
                "10.0.0.9",
                Some(Hold::Layout),
                Some(Hold::Layout),
                Some(Hold::Layout),
                Some(Hold::Layout),
                Some(Hold::Layout),
            ),
            (
                "10.0.0.0",
                Some(Hold::Layout),
                Some(Hold::Layout),
                Some(Hold::Layout),
                Some(Hold::Layout),
                Some(Hold::Layout),
            ),
        ];
        for (text, want_fresh, want_own, want_other, want_reclaim, want_adopt) in table {
            let now = at(130);
            assert_eq!(hold(&spec, &layout, ip(text), &fresh, now), want_fresh, "{text}: a new pod");
            assert_eq!(hold(&spec, &layout, ip(text), &own, now), want_own, "{text}: the spare's node");
            assert_eq!(hold(&spec, &layout, ip(text), &other, now), want_other, "{text}: another node");
            assert_eq!(hold(&spec, &layout, ip(text), &Asker::RECLAIM, now), want_reclaim, "{text}: a reclaim");
            assert_eq!(hold(&spec, &layout, ip(text), &Asker::ADOPT, now), want_adopt, "{text}: adopt");
        }
        assert_eq!(hold(&spec, &layout, ip("10.0.0.8"), &fresh, at(160)), None, "free exactly when the cooldown ends");
    }

    #[test]
    fn a_spare_the_layout_no_longer_allows_is_held_by_the_layout_for_its_own_node_too() {
        let (mut spec, layout) = block();
        spec.spares.insert("10.0.0.9".into());
        let own = Asker { spares: SpareRight::Own("node-1"), cooldown: Duration::ZERO };
        assert_eq!(hold(&spec, &layout, ip("10.0.0.9"), &own, at(0)), Some(Hold::Layout));
    }

    #[test]
    fn a_spare_of_a_block_without_affinity_is_no_nodes_own() {
        let (mut spec, layout) = block();
        spec.affinity = None;
        let own = Asker { spares: SpareRight::Own("node-1"), cooldown: Duration::ZERO };
        assert_eq!(hold(&spec, &layout, ip("10.0.0.6"), &own, at(0)), Some(Hold::Spare(None)));
    }

    proptest::proptest! {
        /// The chooser of a new pod's IP applies this rule in set form (`blocks::usage`, then
        /// `choose_ip` over the layout's addresses): what it picks is free by [`hold`], and when it
        /// picks nothing, nothing in the block is.
        #[test]
        fn the_chooser_picks_only_what_the_rule_leaves_free_and_misses_nothing_it_leaves(
            states in proptest::collection::vec(0u8..5, 16),
            released_ago in proptest::collection::vec(0i64..120, 16),
            cooldown in 0u64..90,
        ) {
            let layout = PoolLayout::new("10.0.0.0/28", &[], &["10.0.0.3"], Some("10.0.0.1"), Some(28)).expect("layout");
            let net: ipnet::IpNet = "10.0.0.0/28".parse().expect("net");
            let mut spec = IPBlockSpec { pool: "p".into(), cidr: net.to_string(), affinity: Some("node-1".into()), ..Default::default() };
            let now = at(1_000);
            for (i, (state, ago)) in states.iter().zip(&released_ago).enumerate() {
                let key = format!("10.0.0.{i}");
                match state {
                    1 => { spec.allocations.insert(key, crate::ipam::blocks::test::record("u", "c")); }
                    2 => { spec.spares.insert(key); }
                    3 => { spec.released.insert(key, Time(at(1_000 - ago))); }
                    4 => {
                        spec.spares.insert(key.clone());
                        spec.allocations.insert(key, crate::ipam::blocks::test::record("u", "c"));
                    }
                    _ => {}
                }
            }
            let asker = Asker { spares: SpareRight::None, cooldown: Duration::from_secs(cooldown) };
            let (allocated, released) = crate::ipam::blocks::usage(&spec);
            let usage = crate::ipam::BlockUsage { allocated: &allocated, released: &released };
            let free: Vec<IpAddr> = net.hosts().chain([net.network(), net.broadcast()])
                .filter(|ip| hold(&spec, &layout, *ip, &asker, now).is_none())
                .collect();
            match crate::ipam::choose_ip(&layout, net, usage, now, asker.cooldown) {
                Ok(chosen) => proptest::prop_assert!(free.contains(&chosen), "{chosen} is not free by the rule"),
                Err(e) => proptest::prop_assert!(free.is_empty(), "{e}, but the rule leaves {free:?} free"),
            }
        }
    }
}
