//! Fixed IPs: a pod, or the runtime on its behalf, names the IPs it must get (one per IP
//! family) instead of letting the agent choose. Four sources, the first that says anything
//! wins: the netconf's `runtimeConfig.ips` (the CNI "ips" capability), then `IP=` in
//! `CNI_ARGS`, then the pod annotation `ipwarden.io/ips`, then the pod annotation
//! `ipwarden.io/ip-list` (set on a workload's pod template: a list its pods draw from, any
//! number per family, one free IP of each family taken). Each entry is an address or a CIDR
//! (only its address counts: the prefix length is the pool's). The pool of each IP is the pool
//! whose CIDR holds it, default or not; it must be usable by the pod as any pool is
//! ([`pools::select`]'s rules). An IP that cannot be had fails the ADD with the reason: no
//! silent fallback to another IP.

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;
use jiff::Timestamp;

use super::PoolLayout;
use super::affinity::{self, Use};
use super::blocks;
use super::free::{self, Asker, Hold, SpareRight};
use super::pools::{self, OrphanedBlock, PodPlacement, PoolView};
use crate::crd::{Allocation, IPBlockSpec, IPPoolSpec};

/// Pod annotation naming the pod's fixed IPs (comma-separated, at most one per IP family).
pub const IPS_ANNOTATION: &str = "ipwarden.io/ips";

/// Pod annotation (on a workload's pod template) listing the IPs its pods draw from
/// (comma-separated): each pod takes the first free one of each family listed.
pub const IP_LIST_ANNOTATION: &str = "ipwarden.io/ip-list";

/// Where a fixed-IP request came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The netconf's `runtimeConfig.ips`.
    RuntimeConfig,
    /// `IP=` in `CNI_ARGS`.
    CniArgs,
    /// The pod annotation [`IPS_ANNOTATION`].
    Annotation,
    /// The pod annotation [`IP_LIST_ANNOTATION`].
    List,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::RuntimeConfig => "runtimeConfig.ips",
            Self::CniArgs => "CNI_ARGS IP",
            Self::Annotation => "annotation ipwarden.io/ips",
            Self::List => "annotation ipwarden.io/ip-list",
        })
    }
}

/// The fixed IPs an ADD must allocate, IPv4 first (a dual-stack pod's primary IP is IPv4,
/// as with pools chosen by [`pools::select`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Requested {
    /// Which source named them.
    pub source: Source,
    /// One per family named; any number for a [`Source::List`], in its order per family.
    pub ips: Vec<IpAddr>,
}

impl Requested {
    /// What to allocate: one IP of each group, the first that can be had. Each named IP is a
    /// group of its own; a list's IPs are grouped by family (IPv4 first).
    pub fn choices(&self) -> Vec<Vec<IpAddr>> {
        if self.source != Source::List {
            return self.ips.iter().map(|ip| vec![*ip]).collect();
        }
        let (v4, v6): (Vec<IpAddr>, Vec<IpAddr>) = self.ips.iter().partition(|ip| ip.is_ipv4());
        [v4, v6].into_iter().filter(|group| !group.is_empty()).collect()
    }

    /// Whether `ips` (a sticky pod's claimed IPs, taken back) are what this request asks
    /// for: exactly one IP of each group of [`Requested::choices`] and no other.
    pub fn satisfied_by(&self, ips: &[IpAddr]) -> bool {
        let choices = self.choices();
        ips.len() == choices.len()
            && choices.iter().all(|group| ips.iter().filter(|ip| group.contains(ip)).count() == 1)
    }
}

/// What a refusal lets the runtime do, which its CNI code and metric label say.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Refusal {
    /// Never possible as asked: fix the request or the pools.
    Never,
    /// Possible once the IP has cooled down.
    Cooling,
    /// Possible once the pod holding the IP is gone.
    InUse,
}

/// Why a fixed IP cannot be allocated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FixedError {
    /// The request does not parse, or names two IPs of one family.
    #[error("{from} {value:?} is malformed: {reason}")]
    Malformed {
        /// The source.
        from: Source,
        /// The value as given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No pool's CIDR holds the IP.
    #[error("fixed IP {ip} lies in no pool (pools: {})", list_or_none(.pools))]
    NotInAnyPool {
        /// The IP.
        ip: IpAddr,
        /// Every pool as `name (cidr)`, by name.
        pools: Vec<String>,
    },
    /// The IP's pool may not serve the pod (disabled, being deleted, overlapping, selectors).
    #[error("fixed IP {ip} is in pool {pool}, which cannot be used: {reason}")]
    PoolUnusable {
        /// The IP.
        ip: IpAddr,
        /// Its pool.
        pool: String,
        /// Why.
        reason: String,
    },
    /// The pool never hands the IP out (network, broadcast, gateway, excluded, out of range).
    #[error("fixed IP {ip} of pool {pool} is never handed out: {reason}")]
    NotAllocatable {
        /// The IP.
        ip: IpAddr,
        /// Its pool.
        pool: String,
        /// Why.
        reason: String,
    },
    /// Another pod's record holds the IP.
    #[error("fixed IP {ip} is held by pod {pod} on node {node}")]
    Held {
        /// The IP.
        ip: IpAddr,
        /// `namespace/name` of the holder.
        pod: String,
        /// The holder's node.
        node: String,
    },
    /// The IP is reserved, between its pods, for the workload whose `ipwarden.io/ip-list`
    /// it was drawn from: only that workload's pods may take it.
    #[error("fixed IP {ip} is reserved for {workload} (drawn from its ipwarden.io/ip-list; last held by pod {pod})")]
    Reserved {
        /// The IP.
        ip: IpAddr,
        /// `Kind namespace/name` of the workload.
        workload: String,
        /// `namespace/name` of its last pod.
        pod: String,
    },
    /// The IP is a spare another node holds ready (`--spare-ips`): that node hands it out
    /// or gives it back.
    #[error("fixed IP {ip} is a spare IP of node {node}, held ready for its pods or just handed to one")]
    Spare {
        /// The IP.
        ip: IpAddr,
        /// The node holding it.
        node: String,
    },
    /// The IP was released lately and cools down before reuse.
    #[error("fixed IP {ip} was released lately and cools down before reuse until {until}")]
    Cooling {
        /// The IP.
        ip: IpAddr,
        /// When it is free.
        until: Timestamp,
    },
    /// No IP of one family of a list can be had.
    #[error("no {family} address of {from} can be had: {}", reasons_text(.reasons))]
    ListTaken {
        /// The list's source.
        from: Source,
        /// IPv4 or IPv6.
        family: &'static str,
        /// Why each IP of the family was refused, in the list's order.
        reasons: Vec<FixedError>,
    },
}

impl FixedError {
    /// What the refusal lets the runtime do: a list refuses as its most hopeful IP does.
    pub fn refusal(&self) -> Refusal {
        match self {
            Self::Held { .. } | Self::Reserved { .. } | Self::Spare { .. } => Refusal::InUse,
            Self::Cooling { .. } => Refusal::Cooling,
            Self::ListTaken { reasons, .. } => reasons.iter().map(Self::refusal).max().unwrap_or(Refusal::Never),
            _ => Refusal::Never,
        }
    }
}

/// The error for a group of [`Requested::choices`] none of which could be had (`reasons`,
/// one per IP tried): a named IP's own reason, or, for a list, every IP's.
pub fn none_of(from: Source, mut reasons: Vec<FixedError>, v4: bool) -> FixedError {
    match (from, reasons.len()) {
        (Source::List, _) | (_, 0) => FixedError::ListTaken { from, family: if v4 { "IPv4" } else { "IPv6" }, reasons },
        _ => reasons.swap_remove(0),
    }
}

fn reasons_text(reasons: &[FixedError]) -> String {
    reasons.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

fn list_or_none(items: &[String]) -> String {
    if items.is_empty() { "none".to_string() } else { items.join(", ") }
}

/// The interface the kubelet gives a pod's own network. The pod's annotations name the IPs
/// of that interface only: another network's attachment of the same pod (Multus' `net1`, …)
/// is not pinned by them (its own netconf's `runtimeConfig.ips` may pin it).
pub const POD_INTERFACE: &str = "eth0";

/// The pod's annotations `ipwarden.io/ips` and `ipwarden.io/ip-list` as they apply to the
/// attachment of interface `ifname`: as they are for [`POD_INTERFACE`], absent for another.
pub fn annotations_for<'a>(
    ifname: &str,
    ips: Option<&'a str>,
    list: Option<&'a str>,
) -> (Option<&'a str>, Option<&'a str>) {
    if ifname == POD_INTERFACE { (ips, list) } else { (None, None) }
}

/// The fixed IPs named by the first source that names any (see the module docs), or `None`
/// when none does. An empty list or blank string names nothing.
pub fn requested(
    runtime_config: Option<&[String]>,
    cni_args: Option<&str>,
    annotation: Option<&str>,
    list: Option<&str>,
) -> Result<Option<Requested>, FixedError> {
    let runtime_config = runtime_config.filter(|ips| !ips.is_empty()).map(|ips| (Source::RuntimeConfig, ips.to_vec()));
    let split = |from: Source, text: Option<&str>| {
        text.filter(|t| !t.trim().is_empty()).map(|t| (from, t.split(',').map(str::to_string).collect::<Vec<_>>()))
    };
    let chosen = runtime_config
        .or_else(|| split(Source::CniArgs, cni_args))
        .or_else(|| split(Source::Annotation, annotation))
        .or_else(|| split(Source::List, list));
    let Some((from, entries)) = chosen else { return Ok(None) };
    let malformed = |reason: String| FixedError::Malformed { from, value: entries.join(","), reason };
    let mut ips: Vec<IpAddr> = Vec::new();
    for entry in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
        let ip = match (entry.parse::<IpAddr>(), entry.parse::<IpNet>()) {
            (Ok(ip), _) => ip,
            (_, Ok(net)) => net.addr(),
            _ => return Err(malformed(format!("{entry:?} is neither an IP address nor a CIDR"))),
        };
        if from == Source::List {
            if !ips.contains(&ip) {
                ips.push(ip);
            }
            continue;
        }
        if let Some(other) = ips.iter().find(|other| other.is_ipv4() == ip.is_ipv4()) {
            let family = if ip.is_ipv4() { "IPv4" } else { "IPv6" };
            return Err(malformed(format!("{other} and {ip} are both {family}; a pod gets at most one IP per family")));
        }
        ips.push(ip);
    }
    if ips.is_empty() {
        return Err(malformed("it names no IP".to_string()));
    }
    ips.sort_by_key(|ip| !ip.is_ipv4());
    Ok(Some(Requested { source: from, ips }))
}

/// Where a fixed IP is allocated: its pool and block.
#[derive(Clone, Debug)]
pub struct FixedIn<'a> {
    /// The pool whose CIDR holds the IP.
    pub pool: PoolView<'a>,
    /// The pool's layout.
    pub layout: &'a PoolLayout,
    /// The block of the pool holding the IP.
    pub block: IpNet,
}

/// The pool `ip` is allocated from: the one whose CIDR holds it, if the pod may use it and
/// the pool hands `ip` out at all.
pub fn pool_of<'a>(
    pools: &[PoolView<'a>],
    orphans: &[OrphanedBlock],
    placement: &PodPlacement<'_>,
    ip: IpAddr,
) -> Result<FixedIn<'a>, FixedError> {
    let found = pools.iter().find_map(|p| {
        let layout = p.layout.ok()?;
        Some((p, layout, layout.block_of(ip)?))
    });
    let Some((pool, layout, block)) = found else {
        let mut pools: Vec<String> = pools.iter().map(|p| format!("{} ({})", p.name, p.spec.cidr)).collect();
        pools.sort();
        return Err(FixedError::NotInAnyPool { ip, pools });
    };
    if let Some(reason) = pools::unusable(pool, placement, &pools::overlaps(pools, orphans)) {
        return Err(FixedError::PoolUnusable { ip, pool: pool.name.to_string(), reason });
    }
    if !layout.is_allocatable(ip) {
        let reason = why_not_allocatable(pool.spec, layout, ip);
        return Err(FixedError::NotAllocatable { ip, pool: pool.name.to_string(), reason });
    }
    Ok(FixedIn { pool: pool.clone(), layout, block })
}

/// Why `layout` (of `spec`) never hands out `ip`, which lies in its CIDR.
fn why_not_allocatable(spec: &IPPoolSpec, layout: &PoolLayout, ip: IpAddr) -> String {
    let cidr = layout.cidr();
    if pools::gateway(spec).and_then(|g| g.parse::<IpAddr>().ok()) == Some(ip) {
        return match spec.gateway {
            Some(_) => "it is the pool's gateway".to_string(),
            None => {
                "it is the pool's gateway (spec.gateway is unset: the first address after its cidr's network address)"
                    .to_string()
            }
        };
    }
    if let Some(entry) = spec
        .exclude
        .iter()
        .find(|e| e.parse::<IpAddr>().ok() == Some(ip) || e.parse::<IpNet>().is_ok_and(|net: IpNet| net.contains(&ip)))
    {
        return format!("it is excluded by spec.exclude entry {entry}");
    }
    if ip == cidr.network() {
        return format!("it is the network address of {cidr}");
    }
    if ip == cidr.broadcast() {
        return format!("it is the broadcast address of {cidr}");
    }
    "it lies outside the pool's spec.ranges".to_string()
}

/// How a fixed or list IP's ADD on `node` asks for its IP ([`free::Asker`]): it binds the
/// node's own spare only when `spare_withdrawn` (its agent kept the spare from its other calls
/// first), and a release holds the IP back for `cooldown`.
pub fn asker(node: &str, spare_withdrawn: bool, cooldown: Duration) -> Asker<'_> {
    let spares = if spare_withdrawn { SpareRight::Own(node) } else { SpareRight::None };
    Asker { spares, cooldown }
}

/// Whether `record` may take `ip` of block `spec` (of the pool laid out as `layout`) now, by
/// [`free::hold`]; and where a record holds the IP, whether it is only a reservation (no
/// sandbox holds it) of the same pod name on the same node (a recreated StatefulSet pod's own
/// sticky IP) or, for a list reservation, held for the same workload as `record` (`heldFor`: a
/// pod of the workload whose list names the IP; a namesake outside it is not). A record of the
/// same sandbox is the caller's idempotent case.
pub fn check_free(
    spec: &IPBlockSpec,
    layout: &PoolLayout,
    ip: IpAddr,
    record: &Allocation,
    asker: &Asker<'_>,
    now: Timestamp,
) -> Result<(), FixedError> {
    let held = match free::hold(spec, layout, ip, asker, now) {
        None => return Ok(()),
        Some(Hold::Record(held)) => held,
        Some(Hold::Layout) => {
            let reason = "the pool's current layout does not hand it out".to_string();
            return Err(FixedError::NotAllocatable { ip, pool: spec.pool.clone(), reason });
        }
        Some(Hold::Spare(node)) => {
            return Err(FixedError::Spare {
                ip,
                node: node.unwrap_or("(no node: a block without affinity)").to_string(),
            });
        }
        Some(Hold::Cooling { until }) => return Err(FixedError::Cooling { ip, until }),
    };
    let reservation = !blocks::may_be_attached(held);
    let same_namespace = held.pod.namespace == record.pod.namespace;
    let own_reservation = reservation
        && same_namespace
        && match held.held_for.as_ref() {
            // A list reservation is its workload's, not its last pod's name's.
            Some(workload) => record.held_for.as_ref() == Some(workload),
            // A sticky pod's own reservation, on this node only: another node's goes through
            // the pod's IPClaim and that node's answer (decision 0022).
            None => held.pod.name == record.pod.name && held.node == record.node,
        };
    if own_reservation {
        return Ok(());
    }
    if let Some(workload) = held.held_for.as_ref().filter(|_| reservation) {
        return Err(FixedError::Reserved {
            ip,
            workload: format!("{} {}/{}", workload.kind, held.pod.namespace, workload.name),
            pod: format!("{}/{}", held.pod.namespace, held.pod.name),
        });
    }
    Err(FixedError::Held { ip, pod: format!("{}/{}", held.pod.namespace, held.pod.name), node: held.node.clone() })
}

/// Takes `ip` of block `spec` for `record` on `node` ([`check_free`], asking as `asker`): a
/// free block is claimed for the node, as its first allocation there would; another node's
/// block lends the IP; the node's own spare, when `asker` may bind it, leaves the spares.
/// Returns what the IP held before (for a rollback), or `None` when `record`'s sandbox holds it
/// already (a retried ADD whose answer was lost: nothing to write).
pub fn take(
    spec: &mut IPBlockSpec,
    node: &str,
    layout: &PoolLayout,
    ip: IpAddr,
    record: &Allocation,
    asker: &Asker<'_>,
    now: Timestamp,
) -> Result<Option<blocks::Prior>, FixedError> {
    let key = ip.to_string();
    let mine = spec.allocations.get(&key).is_some_and(|held| {
        blocks::holds_sandbox(held, &record.container_id, &record.interface) && held.pod.uid == record.pod.uid
    });
    if mine {
        return Ok(None);
    }
    check_free(spec, layout, ip, record, asker, now)?;
    if super::spares::is_bindable(spec, &key) {
        spec.spares.remove(&key);
    }
    affinity::take_for(spec, node, Use::Claim);
    Ok(Some(blocks::allocate(spec, ip, record.clone())))
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::ipam::pools::PoolSet;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    fn layout() -> PoolLayout {
        PoolLayout::new("10.0.0.0/24", &[], &[], None, None).unwrap()
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn the_pod_annotations_pin_the_pod_network_interface_only() {
        assert_eq!(annotations_for("eth0", Some("10.0.0.7"), Some("10.0.0.8")), (Some("10.0.0.7"), Some("10.0.0.8")));
        assert_eq!(
            annotations_for("net1", Some("10.0.0.7"), Some("10.0.0.8")),
            (None, None),
            "another network's interface"
        );
    }

    #[test]
    fn the_first_source_that_names_ips_wins_and_ipv4_comes_first() {
        let rc = ["fd00::7/64".to_string(), "10.0.0.7/24".to_string()];
        /// runtimeConfig.ips, CNI_ARGS IP, the annotation, and what they ask for.
        type Case<'a> = (Option<&'a [String]>, Option<&'a str>, Option<&'a str>, Option<(Source, Vec<&'a str>)>);
        let cases: Vec<Case<'_>> = vec![
            (None, None, None, Some((Source::List, vec!["10.0.0.99"]))),
            (Some(&[]), Some(" "), Some(""), Some((Source::List, vec!["10.0.0.99"]))),
            (Some(&rc), Some("10.0.0.8"), Some("10.0.0.9"), Some((Source::RuntimeConfig, vec!["10.0.0.7", "fd00::7"]))),
            (Some(&[]), Some("10.0.0.8"), Some("10.0.0.9"), Some((Source::CniArgs, vec!["10.0.0.8"]))),
            (None, None, Some("fd00::9, 10.0.0.9"), Some((Source::Annotation, vec!["10.0.0.9", "fd00::9"]))),
            (None, Some("10.0.0.8/24,"), None, Some((Source::CniArgs, vec!["10.0.0.8"]))),
        ];
        for (rc, args, annotation, want) in cases {
            let got = requested(rc, args, annotation, Some("10.0.0.99")).unwrap();
            let want = want.map(|(source, ips)| Requested { source, ips: ips.into_iter().map(ip).collect() });
            assert_eq!(got, want, "{rc:?} {args:?} {annotation:?}");
        }
    }

    #[test]
    fn malformed_requests_say_which_source_and_why() {
        let cases = [
            (Some("10.0.0.300"), "annotation ipwarden.io/ips \"10.0.0.300\" is malformed: \"10.0.0.300\" is neither"),
            (Some("10.0.0.1,10.0.0.2"), "10.0.0.1 and 10.0.0.2 are both IPv4"),
            (Some("fd00::1,fd00::1"), "are both IPv6"),
            (Some(",,"), "it names no IP"),
        ];
        for (annotation, want) in cases {
            let err = requested(None, None, annotation, None).unwrap_err();
            assert!(matches!(err, FixedError::Malformed { from: Source::Annotation, .. }), "{err}");
            assert!(err.to_string().contains(want), "{annotation:?}: {err}");
        }
        let err = requested(None, Some("x"), None, None).unwrap_err();
        assert!(err.to_string().starts_with("CNI_ARGS IP \"x\""), "{err}");
    }

    #[test]
    fn a_list_draws_one_ip_per_family_in_its_order_and_refuses_as_its_most_hopeful_ip() {
        let list = requested(None, None, None, Some("10.0.0.8, fd00::8, 10.0.0.7, 10.0.0.8")).unwrap().unwrap();
        assert_eq!(list.choices(), vec![vec![ip("10.0.0.8"), ip("10.0.0.7")], vec![ip("fd00::8")]]);
        let named = requested(None, None, Some("fd00::8,10.0.0.8"), None).unwrap().unwrap();
        assert_eq!(named.choices(), vec![vec![ip("10.0.0.8")], vec![ip("fd00::8")]]);
        let ips = |list: &[&str]| list.iter().map(|t| ip(t)).collect::<Vec<_>>();
        let satisfied = [
            (&named, ips(&["fd00::8", "10.0.0.8"]), true),
            (&named, ips(&["10.0.0.8"]), false),
            (&named, ips(&["10.0.0.9", "fd00::8"]), false),
            (&list, ips(&["10.0.0.7", "fd00::8"]), true),
            (&list, ips(&["10.0.0.7"]), false),
            (&list, ips(&["10.0.0.7", "10.0.0.8"]), false),
            (&list, ips(&["10.0.0.6", "fd00::8"]), false),
        ];
        for (request, claimed, want) in satisfied {
            assert_eq!(request.satisfied_by(&claimed), want, "{request:?} by {claimed:?}");
        }

        let held = FixedError::Held { ip: ip("10.0.0.8"), pod: "ns/a".into(), node: "n".into() };
        let cooling = FixedError::Cooling { ip: ip("10.0.0.7"), until: Timestamp::UNIX_EPOCH };
        let never = FixedError::NotInAnyPool { ip: ip("10.9.0.1"), pools: vec![] };
        let taken = none_of(Source::List, vec![held.clone(), cooling.clone()], true);
        assert_eq!(taken.refusal(), Refusal::InUse);
        assert_eq!(
            taken.to_string(),
            "no IPv4 address of annotation ipwarden.io/ip-list can be had: fixed IP 10.0.0.8 is held by pod ns/a on node n; \
             fixed IP 10.0.0.7 was released lately and cools down before reuse until 1970-01-01T00:00:00Z"
        );
        assert_eq!(none_of(Source::List, vec![never.clone(), cooling.clone()], true).refusal(), Refusal::Cooling);
        assert_eq!(none_of(Source::List, vec![never.clone()], true).refusal(), Refusal::Never);
        assert_eq!(none_of(Source::Annotation, vec![held.clone()], true), held, "a named IP's own reason");
    }

    fn pool(name: &str, spec: serde_json::Value) -> Arc<crate::crd::IPPool> {
        Arc::new(crate::crd::IPPool::new(name, serde_json::from_value(spec).unwrap()))
    }

    fn pool_of_ip(pools: &[Arc<crate::crd::IPPool>], text: &str) -> Result<String, FixedError> {
        let set = PoolSet::of(pools, &[]);
        let views = set.views();
        let (ns, node) = (BTreeMap::from([("team".to_string(), "a".to_string())]), BTreeMap::new());
        let placement = PodPlacement {
            interface: "eth0",
            interface_annotation: None,
            network: ("pods", &[]),
            pod_annotation: None,
            namespace_annotation: None,
            namespace_labels: &ns,
            node_labels: &node,
        };
        pool_of(&views, set.orphans(), &placement, ip(text)).map(|p| p.pool.name.to_string())
    }

    #[test]
    fn the_pool_follows_the_ip_and_refuses_what_it_never_hands_out() {
        let pools = [
            pool(
                "main",
                serde_json::json!({"cidr": "10.0.0.0/24", "gateway": "10.0.0.1", "exclude": ["10.0.0.64/28"],
                    "ranges": [{"start": "10.0.0.2", "end": "10.0.0.200"}], "default": true}),
            ),
            pool("extra", serde_json::json!({"cidr": "10.1.0.0/24"})),
            pool("off", serde_json::json!({"cidr": "10.2.0.0/24", "disabled": true})),
            pool(
                "other-team",
                serde_json::json!({"cidr": "10.3.0.0/24", "namespaceSelector": {"matchLabels": {"team": "b"}}}),
            ),
        ];
        let cases = [
            ("10.0.0.7", Ok("main")),
            ("10.1.0.7", Ok("extra")),
            (
                "10.1.0.1",
                Err(
                    "it is the pool's gateway (spec.gateway is unset: the first address after its cidr's network address)",
                ),
            ),
            ("10.0.0.1", Err("fixed IP 10.0.0.1 of pool main is never handed out: it is the pool's gateway")),
            ("10.0.0.0", Err("it is the network address of 10.0.0.0/24")),
            ("10.1.0.255", Err("it is the broadcast address of 10.1.0.0/24")),
            ("10.0.0.70", Err("it is excluded by spec.exclude entry 10.0.0.64/28")),
            ("10.0.0.250", Err("it lies outside the pool's spec.ranges")),
            ("10.2.0.7", Err("fixed IP 10.2.0.7 is in pool off, which cannot be used: it is disabled")),
            ("10.3.0.7", Err("its namespaceSelector does not match")),
            (
                "192.168.0.1",
                Err(
                    "fixed IP 192.168.0.1 lies in no pool (pools: extra (10.1.0.0/24), main (10.0.0.0/24), off (10.2.0.0/24), other-team (10.3.0.0/24))",
                ),
            ),
        ];
        for (text, want) in cases {
            match (pool_of_ip(&pools, text), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{text}"),
                (Err(got), Err(want)) => assert!(got.to_string().contains(want), "{text}: {got}"),
                (got, want) => panic!("{text}: got {got:?}, want {want:?}"),
            }
        }
    }

    fn record(namespace: &str, name: &str, container: &str) -> Allocation {
        let mut record = blocks::test::record(&format!("{name}-uid"), container);
        record.pod.namespace = namespace.into();
        record.pod.name = name.into();
        record.node = "node-1".into();
        record
    }

    #[test]
    fn a_fixed_ip_is_free_unless_another_pod_holds_it_or_it_cools_down() {
        let now = Timestamp::from_second(1_700_000_000).unwrap();
        let minute = Duration::from_secs(60);
        let released_at = Time(now.checked_sub(jiff::SignedDuration::from_secs(30)).unwrap());
        let mut spec = IPBlockSpec::default();
        spec.allocations.insert("10.0.0.7".into(), record("ns", "web", "c1"));
        spec.allocations.insert("10.0.0.8".into(), record("ns", "db-0", ""));
        spec.released.insert("10.0.0.9".into(), released_at);
        let me = record("ns", "db-0", "c2");
        let check =
            |text: &str, cooldown| check_free(&spec, &layout(), ip(text), &me, &asker("node-1", false, cooldown), now);
        assert_eq!(
            check("10.0.0.7", minute).unwrap_err().to_string(),
            "fixed IP 10.0.0.7 is held by pod ns/web on node node-1"
        );
        assert_eq!(check("10.0.0.8", minute), Ok(()), "the pod's own sticky reservation is taken over");
        let elsewhere = Allocation { node: "node-2".into(), ..record("ns", "db-0", "") };
        let mut moved = spec.clone();
        moved.allocations.insert("10.0.0.8".into(), elsewhere);
        assert_eq!(
            check_free(&moved, &layout(), ip("10.0.0.8"), &me, &asker("node-1", false, minute), now)
                .unwrap_err()
                .to_string(),
            "fixed IP 10.0.0.8 is held by pod ns/db-0 on node node-2",
            "another node's reservation goes only with that node's answer to the pod's claim (decision 0022)"
        );
        let until = now.checked_add(jiff::SignedDuration::from_secs(30)).unwrap();
        assert_eq!(check("10.0.0.9", minute), Err(FixedError::Cooling { ip: ip("10.0.0.9"), until }));
        assert_eq!(check("10.0.0.9", Duration::ZERO), Ok(()), "no cooldown configured");
        assert_eq!(check("10.0.0.9", Duration::from_secs(10)), Ok(()), "cooled down");
        assert_eq!(check("10.0.0.10", minute), Ok(()), "never used");
        let other = record("other", "db-0", "c3");
        assert!(
            check_free(&spec, &layout(), ip("10.0.0.8"), &other, &asker("node-1", false, minute), now).is_err(),
            "same name, other namespace"
        );
    }

    #[test]
    fn a_list_reservation_is_free_for_its_workloads_pods_only_and_refused_naming_the_workload() {
        let now = Timestamp::from_second(1_700_000_000).unwrap();
        let held_for = |kind: &str, name: &str| Some(crate::crd::OwnerRef { kind: kind.into(), name: name.into() });
        let mut spec = IPBlockSpec::default();
        let mut reserved = record("ns", "api-7f-abcde", "");
        reserved.held_for = held_for("Deployment", "api");
        spec.allocations.insert("10.0.0.7".into(), reserved.clone());
        let attached = Allocation { container_id: "c1".into(), ..reserved };
        spec.allocations.insert("10.0.0.8".into(), attached);
        let check = |text: &str, me: &Allocation| {
            check_free(&spec, &layout(), ip(text), me, &asker("node-1", false, Duration::ZERO), now)
        };
        let mut sibling = record("ns", "api-9c-fghij", "c2");
        sibling.held_for = held_for("Deployment", "api");
        assert_eq!(check("10.0.0.7", &sibling), Ok(()), "a pod of the workload takes its reservation back");
        assert!(matches!(check("10.0.0.8", &sibling), Err(FixedError::Held { .. })), "not while a sandbox holds it");
        let plain = record("ns", "intruder", "c3");
        assert_eq!(
            check("10.0.0.7", &plain).unwrap_err().to_string(),
            "fixed IP 10.0.0.7 is reserved for Deployment ns/api (drawn from its ipwarden.io/ip-list; \
             last held by pod ns/api-7f-abcde)"
        );
        assert_eq!(check("10.0.0.7", &plain).unwrap_err().refusal(), Refusal::InUse);
        let mut other_workload = record("ns", "web-1", "c4");
        other_workload.held_for = held_for("Deployment", "web");
        assert!(matches!(check("10.0.0.7", &other_workload), Err(FixedError::Reserved { .. })));
        let mut other_namespace = record("other", "api-1", "c5");
        other_namespace.held_for = held_for("Deployment", "api");
        assert!(matches!(check("10.0.0.7", &other_namespace), Err(FixedError::Reserved { .. })));
    }

    #[test]
    fn a_pod_named_like_the_last_holder_of_a_list_reservation_takes_it_only_as_a_pod_of_its_workload() {
        let now = Timestamp::from_second(1_700_000_000).unwrap();
        let held_for = |kind: &str, name: &str| Some(crate::crd::OwnerRef { kind: kind.into(), name: name.into() });
        let mut spec = IPBlockSpec::default();
        let mut reserved = record("ns", "api-7f-abcde", "");
        reserved.held_for = held_for("Deployment", "api");
        spec.allocations.insert("10.0.0.7".into(), reserved);
        let namesake = |workload| Allocation { held_for: workload, ..record("ns", "api-7f-abcde", "c2") };
        let cases = [
            (None, false, "a bare pod of the same name"),
            (held_for("Deployment", "web"), false, "a pod of the same name in another workload"),
            (held_for("Deployment", "api"), true, "a pod of the same name in the workload"),
        ];
        for (workload, free, case) in cases {
            let checked = check_free(
                &spec,
                &layout(),
                ip("10.0.0.7"),
                &namesake(workload),
                &asker("node-1", false, Duration::ZERO),
                now,
            );
            assert_eq!(checked.is_ok(), free, "{case}: {checked:?}");
        }
    }

    #[test]
    fn taking_a_fixed_ip_claims_a_free_block_and_is_idempotent_for_the_same_sandbox() {
        let now = Timestamp::from_second(1_700_000_000).unwrap();
        let mut spec = IPBlockSpec::default();
        let me = record("ns", "web", "c1");
        let prior =
            take(&mut spec, "node-1", &layout(), ip("10.0.0.7"), &me, &asker("node-1", false, Duration::ZERO), now)
                .unwrap();
        assert_eq!(prior, Some(blocks::Prior::Free(None)));
        assert_eq!(spec.affinity.as_deref(), Some("node-1"), "the free block is claimed");
        assert_eq!(spec.allocations.get("10.0.0.7"), Some(&me));
        assert_eq!(
            take(&mut spec, "node-1", &layout(), ip("10.0.0.7"), &me, &asker("node-1", false, Duration::ZERO), now),
            Ok(None),
            "same sandbox"
        );
        let err = take(
            &mut spec,
            "node-2",
            &layout(),
            ip("10.0.0.7"),
            &record("ns", "web2", "c2"),
            &asker("node-2", false, Duration::ZERO),
            now,
        );
        assert!(matches!(err, Err(FixedError::Held { .. })), "{err:?}");
        let lent = take(
            &mut spec,
            "node-2",
            &layout(),
            ip("10.0.0.8"),
            &record("ns", "web2", "c2"),
            &asker("node-2", false, Duration::ZERO),
            now,
        );
        assert!(lent.is_ok(), "another node's block lends the IP: {lent:?}");
        assert_eq!(spec.affinity.as_deref(), Some("node-1"), "and stays node-1's");
    }

    #[test]
    fn a_spare_is_taken_only_by_its_own_node_once_its_agent_withdrew_it() {
        let now = Timestamp::from_second(1_700_000_000).unwrap();
        let mut spec = IPBlockSpec { affinity: Some("node-1".into()), ..IPBlockSpec::default() };
        spec.spares.insert("10.0.0.7".into());
        let me = record("ns", "web", "c1");
        let other_node =
            take(&mut spec, "node-2", &layout(), ip("10.0.0.7"), &me, &asker("node-2", true, Duration::ZERO), now);
        assert_eq!(other_node, Err(FixedError::Spare { ip: ip("10.0.0.7"), node: "node-1".into() }));
        assert_eq!(other_node.unwrap_err().refusal(), Refusal::InUse);
        let not_withdrawn =
            take(&mut spec, "node-1", &layout(), ip("10.0.0.7"), &me, &asker("node-1", false, Duration::ZERO), now);
        assert!(matches!(not_withdrawn, Err(FixedError::Spare { .. })), "{not_withdrawn:?}");
        let taken =
            take(&mut spec, "node-1", &layout(), ip("10.0.0.7"), &me, &asker("node-1", true, Duration::ZERO), now);
        assert_eq!(taken, Ok(Some(blocks::Prior::Free(None))));
        assert!(spec.spares.is_empty());
        assert_eq!(spec.allocations.get("10.0.0.7"), Some(&me));
    }

    #[test]
    fn a_fixed_ip_the_layout_does_not_hand_out_is_refused_by_take_too() {
        let now = Timestamp::from_second(1_700_000_000).unwrap();
        let mut spec = IPBlockSpec { pool: "p".into(), ..IPBlockSpec::default() };
        let edited = PoolLayout::new("10.0.0.0/24", &[], &["10.0.0.7"], None, None).unwrap();
        let me = record("ns", "web", "c1");
        let taken =
            take(&mut spec, "node-1", &edited, ip("10.0.0.7"), &me, &asker("node-1", true, Duration::ZERO), now);
        assert!(matches!(taken, Err(FixedError::NotAllocatable { .. })), "{taken:?}");
        assert!(spec.allocations.is_empty() && spec.affinity.is_none());
    }
}
