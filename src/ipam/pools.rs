//! Pure decisions about pools as the cluster defines them: each pool's layout, which pools
//! overlap, which pools a pod may use, and the names of a pool's IPBlocks.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use kube::ResourceExt;

use crate::crd::{IPBlock, IPPool, IPPoolSpec, POOL_ANNOTATION, POOLS_ANNOTATION};
use crate::ipam::{LayoutError, PoolLayout, first_host};

/// The condition type set on a pool that overlaps another; such pools are not used.
pub const OVERLAPPING_CONDITION: &str = "Overlapping";

/// The condition type set on a pool whose `ranges` name its defaulted gateway
/// ([`gateway_withheld_from_ranges`]): True while the pool holds one IP fewer than its ranges say.
pub const GATEWAY_IN_RANGES_CONDITION: &str = "GatewayInRanges";

/// Builds the allocation layout of a pool from its spec: its [`gateway`], set or defaulted,
/// is never handed out.
pub fn layout(spec: &IPPoolSpec) -> Result<PoolLayout, LayoutError> {
    let ranges: Vec<(&str, &str)> = spec.ranges.iter().map(|r| (r.start.as_str(), r.end.as_str())).collect();
    let exclude: Vec<&str> = spec.exclude.iter().map(String::as_str).collect();
    PoolLayout::new(&spec.cidr, &ranges, &exclude, gateway(spec).as_deref(), spec.block_size)
}

/// The pool's gateway, the one answer for every reader (the layout, CNI results, the reason a
/// fixed IP is refused): `spec.gateway` as written when set (the layout refuses it if
/// malformed), else the CIDR's first address after its network address ([`first_host`]):
/// host-local defaults it so, and the `bridge` plugin (`isGateway`) takes it for itself, so
/// it must never go to a pod; `ptp` needs a gateway in every result
/// (docs/decisions/0019-default-gateway.md). `None` for a CIDR too small to spare one (IPv4
/// /31 or /32, IPv6 /127 or /128) and for a CIDR that does not parse or has host bits set
/// (the pool then has no layout and hands out nothing).
pub fn gateway(spec: &IPPoolSpec) -> Option<String> {
    if let Some(gateway) = &spec.gateway {
        return Some(gateway.clone());
    }
    let cidr: IpNet = spec.cidr.parse().ok()?;
    if cidr.trunc() != cidr {
        return None;
    }
    first_host(cidr).map(|ip| ip.to_string())
}

/// The defaulted gateway ([`gateway`]: `spec.gateway` unset) when the pool's `ranges` name it,
/// with what an admin should know: the layout never hands it out, so the pool holds one IP
/// fewer than its ranges say. A pool sized to its workload before decision 0019 defaulted the
/// gateway shrank so in the upgrade; the pool's [`GATEWAY_IN_RANGES_CONDITION`], `ipwarden
/// check` and the ADD that finds the pool full all say it with this one text. `None` when
/// `spec.gateway` is set (the admin chose it), without ranges (the whole CIDR, whose first
/// address host-local withholds too), or when the ranges leave it out or `exclude` takes it.
pub fn gateway_withheld_from_ranges(spec: &IPPoolSpec) -> Option<String> {
    // A pool whose layout is invalid hands out nothing: its gateway withholds nothing.
    layout(spec).ok()?;
    gateway_withheld_from_laid_out_ranges(spec)
}

/// [`gateway_withheld_from_ranges`] of a pool whose layout is known to be valid (the ADD path
/// has it already, and need not lay the pool out again).
pub fn gateway_withheld_from_laid_out_ranges(spec: &IPPoolSpec) -> Option<String> {
    if spec.gateway.is_some() {
        return None;
    }
    let defaulted = gateway(spec)?;
    let address: IpAddr = defaulted.parse().ok()?;
    let family = |ip: &IpAddr| ip.is_ipv4() == address.is_ipv4();
    let named = spec.ranges.iter().any(|range| {
        let bounds = (range.start.parse::<IpAddr>(), range.end.parse::<IpAddr>());
        matches!(bounds, (Ok(start), Ok(end)) if family(&start) && family(&end) && start <= address && address <= end)
    });
    // An address the admin excluded was never the pool's to hand out: nothing shrank.
    let excluded = spec.exclude.iter().any(|entry| {
        entry.parse::<IpNet>().map(|net| net.contains(&address)).unwrap_or_else(|_| entry.parse() == Ok(address))
    });
    (named && !excluded).then(|| {
        format!(
            "its gateway {defaulted} lies in spec.ranges but is never handed out: spec.gateway is unset, so the \
             gateway defaults to the CIDR's first address after its network address (decision 0019); set \
             spec.gateway to {defaulted} to keep it so, or start the ranges after it"
        )
    })
}

/// Whether CNI results of the pool carry a default route via its [`gateway`]: `spec.defaultRoute`,
/// true when unset; false for a secondary network's pool, whose pods route by default
/// through their primary network.
pub fn default_route(spec: &IPPoolSpec) -> bool {
    spec.default_route.unwrap_or(true)
}

/// Whether the pool of `spec` owns a block of CIDR `block_cidr` (that names the pool): the
/// block is a cell of the pool's CIDR cut at its block size, both immutable. Ranges,
/// exclusions and the gateway only say which IPs of a block are handed out, so an edit of
/// them, even into an invalid layout, never disowns a block and the records in it. A pool
/// whose grid cannot be computed owns every block naming it: keeping records is the safe side.
pub fn owns_block(spec: &IPPoolSpec, block_cidr: &str) -> bool {
    match PoolLayout::new(&spec.cidr, &[], &[], None, spec.block_size) {
        Ok(grid) => block_cidr.parse::<IpNet>().is_ok_and(|c| grid.is_block(c)),
        Err(_) => true,
    }
}

/// Whether the records of a block of CIDR `block_cidr` are retired: no pool keeps them, so
/// they go as their pods go and no sticky reservation outlives its pod there. `pool` is the
/// pool the block names, if it exists, with whether it is being deleted. Retired: the pool is
/// absent, being deleted, or does not own the block ([`owns_block`]).
pub fn block_is_retired(pool: Option<(&IPPoolSpec, bool)>, block_cidr: &str) -> bool {
    !matches!(pool, Some((spec, false)) if owns_block(spec, block_cidr))
}

/// The IPBlock object name of `block` in `pool`: DNS-safe and the same on every node, so
/// two agents creating the same block collide on the name instead of duplicating it.
pub fn block_name(pool: &str, block: IpNet) -> String {
    let text = block.to_string().replace(['.', ':', '/'], "-");
    format!("{pool}-{text}")
}

/// An IPClaim entry whose `block` is not the IPBlock that holds its IP's record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("it names IPBlock {named:?} for {ip} of pool {pool}, but that IP's block is {canonical}")]
pub struct ForeignBlock {
    /// The block the claim names.
    pub named: String,
    /// The claimed IP.
    pub ip: IpAddr,
    /// The pool the claim names.
    pub pool: String,
    /// The block that holds the IP's record.
    pub canonical: String,
}

/// Checks the block an IPClaim names for `ip` of `pool` (`block` is the pool's block that
/// contains it). Claims are namespaced objects a user may edit; the agent writes the named
/// block, so anything but the canonical name must be refused, never written.
pub fn check_claimed_block(pool: &str, block: IpNet, ip: IpAddr, named: &str) -> Result<(), ForeignBlock> {
    let canonical = block_name(pool, block);
    if named == canonical {
        return Ok(());
    }
    Err(ForeignBlock { named: named.to_string(), ip, pool: pool.to_string(), canonical })
}

/// A snapshot of pools with their layouts computed once, to hand out [`PoolView`]s, and the
/// orphaned blocks beside them.
pub struct PoolSet {
    names: Vec<String>,
    specs: Vec<IPPoolSpec>,
    deleting: Vec<bool>,
    layouts: Vec<Result<PoolLayout, LayoutError>>,
    orphans: Vec<OrphanedBlock>,
    retired: BTreeSet<String>,
}

/// What the pool checks need of one IPBlock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSummary {
    /// The block's name.
    pub name: String,
    /// The pool it names.
    pub pool: String,
    /// Its CIDR as written.
    pub cidr: String,
    /// How many records and spare IPs it holds (a spare may be in use by a pod whose record
    /// is about to be written).
    pub records: usize,
}

impl BlockSummary {
    /// The summary of `block`.
    pub fn of(block: &IPBlock) -> Self {
        Self {
            name: block.name_any(),
            pool: block.spec.pool.clone(),
            cidr: block.spec.cidr.clone(),
            records: super::blocks::held(&block.spec),
        }
    }
}

/// A block no pool owns: its pool is gone, or was recreated with a layout (CIDR or block
/// size) that has no such block. Its records may still name running pods, so a pool over
/// it must not hand their IPs out again (docs/gc-rules.md, "Pools in use").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OrphanedBlock {
    /// The block's name.
    pub name: String,
    /// The pool it names.
    pub pool: String,
    /// Its CIDR; `None` when it does not parse (it then overlaps nothing).
    pub cidr: Option<IpNet>,
    /// How many records and spare IPs it holds.
    pub records: usize,
}

impl PoolSet {
    /// Computes the layouts of `pools` (name, spec, whether it is being deleted) and which
    /// of `blocks` no pool owns.
    pub fn new(
        pools: impl IntoIterator<Item = (String, IPPoolSpec, bool)>,
        blocks: impl IntoIterator<Item = BlockSummary>,
    ) -> Self {
        let mut set = Self {
            names: Vec::new(),
            specs: Vec::new(),
            deleting: Vec::new(),
            layouts: Vec::new(),
            orphans: Vec::new(),
            retired: BTreeSet::new(),
        };
        for (name, spec, deleting) in pools {
            set.layouts.push(layout(&spec));
            set.names.push(name);
            set.specs.push(spec);
            set.deleting.push(deleting);
        }
        for block in blocks {
            let pool = set.names.iter().position(|name| *name == block.pool).map(|i| (&set.specs[i], set.deleting[i]));
            if !block_is_retired(pool, &block.cidr) {
                continue;
            }
            set.retired.insert(block.name.clone());
            if pool.is_none_or(|(spec, _)| !owns_block(spec, &block.cidr)) {
                let cidr = block.cidr.parse::<IpNet>().ok();
                set.orphans.push(OrphanedBlock { name: block.name, pool: block.pool, cidr, records: block.records });
            }
        }
        set
    }

    /// The set of the cached `pools` and `blocks`.
    pub fn of(pools: &[Arc<IPPool>], blocks: &[Arc<IPBlock>]) -> Self {
        Self::new(
            pools.iter().map(|p| (p.name_any(), p.spec.clone(), p.metadata.deletion_timestamp.is_some())),
            blocks.iter().map(|b| BlockSummary::of(b)),
        )
    }

    /// One view per pool.
    pub fn views(&self) -> Vec<PoolView<'_>> {
        self.names
            .iter()
            .zip(&self.specs)
            .zip(&self.deleting)
            .zip(&self.layouts)
            .map(|(((name, spec), deleting), layout)| PoolView {
                name,
                spec,
                deleting: *deleting,
                layout: layout.as_ref(),
            })
            .collect()
    }

    /// The blocks no pool owns, empty or not.
    pub fn orphans(&self) -> &[OrphanedBlock] {
        &self.orphans
    }

    /// The names of the blocks whose records no pool keeps: orphaned blocks and the blocks
    /// of pools being deleted. Their records go as their pods go; no sticky reservation
    /// outlives its pod there.
    pub fn retired(&self) -> &BTreeSet<String> {
        &self.retired
    }
}

/// A pool as the selection sees it.
#[derive(Clone, Debug)]
pub struct PoolView<'a> {
    /// The pool's name.
    pub name: &'a str,
    /// Its spec.
    pub spec: &'a IPPoolSpec,
    /// Whether it is being deleted (it then hands out nothing).
    pub deleting: bool,
    /// Its layout, or why it has none.
    pub layout: Result<&'a PoolLayout, &'a LayoutError>,
}

/// Whether two networks share an address.
fn nets_overlap(a: IpNet, b: IpNet) -> bool {
    a.contains(&b.network()) || b.contains(&a.network())
}

/// The names of pools whose CIDR overlaps another pool's, or an orphaned block that still
/// holds records, each with what it overlaps.
pub fn overlaps(pools: &[PoolView<'_>], orphans: &[OrphanedBlock]) -> BTreeMap<String, BTreeSet<String>> {
    let mut found: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for pool in pools {
        let Ok(layout) = pool.layout else { continue };
        for orphan in orphans.iter().filter(|o| o.records > 0) {
            if orphan.cidr.is_some_and(|cidr| nets_overlap(layout.cidr(), cidr)) {
                found.entry(pool.name.to_string()).or_default().insert(format!("orphaned IPBlock {}", orphan.name));
            }
        }
    }
    for (i, a) in pools.iter().enumerate() {
        for b in &pools[i + 1..] {
            if let (Ok(la), Ok(lb)) = (a.layout, b.layout)
                && la.overlaps(lb)
            {
                found.entry(a.name.to_string()).or_default().insert(b.name.to_string());
                found.entry(b.name.to_string()).or_default().insert(a.name.to_string());
            }
        }
    }
    found
}

/// The `Overlapping` condition each pool should carry: (status, message) by pool name.
pub fn overlap_conditions(pools: &[PoolView<'_>], orphans: &[OrphanedBlock]) -> BTreeMap<String, (bool, String)> {
    let found = overlaps(pools, orphans);
    pools
        .iter()
        .map(|pool| {
            let condition = match found.get(pool.name) {
                Some(others) => {
                    let others: Vec<&str> = others.iter().map(String::as_str).collect();
                    (true, format!("overlaps {}; no IP is allocated from it until that is resolved", others.join(", ")))
                }
                None => (false, "overlaps no other pool".to_string()),
            };
            (pool.name.to_string(), condition)
        })
        .collect()
}

/// What the controller does about a pool's finalizer ([`crate::crd::POOL_FINALIZER`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinalizerStep {
    /// Put it on: the pool is live and has none yet (created before the controller ran).
    Add,
    /// Leave it: the pool is being deleted and its blocks still hold records.
    Wait,
    /// Delete the pool's (empty) blocks, then take it off: the pool may go.
    Remove,
    /// Nothing to do.
    Nothing,
}

/// The finalizer step for a pool that `has` the finalizer or not, is `deleting` or not,
/// and whose blocks hold `records` records.
pub fn finalizer_step(has: bool, deleting: bool, records: usize) -> FinalizerStep {
    match (has, deleting) {
        (false, false) => FinalizerStep::Add,
        (true, true) if records > 0 => FinalizerStep::Wait,
        (true, true) => FinalizerStep::Remove,
        _ => FinalizerStep::Nothing,
    }
}

/// What the selection knows about the pod and the interface being wired.
#[derive(Clone, Debug)]
pub struct PodPlacement<'a> {
    /// The interface being wired (`CNI_IFNAME`).
    pub interface: &'a str,
    /// The pod's `ipwarden.io/pools` annotation (interface -> pools, JSON), as written.
    pub interface_annotation: Option<&'a str>,
    /// The attachment's network (the netconf `name`) and the pools its `ipam.pools` names.
    pub network: (&'a str, &'a [String]),
    /// The pod's `ipwarden.io/pool` annotation.
    pub pod_annotation: Option<&'a str>,
    /// The namespace's `ipwarden.io/pool` annotation.
    pub namespace_annotation: Option<&'a str>,
    /// The namespace's labels, for namespace selectors.
    pub namespace_labels: &'a BTreeMap<String, String>,
    /// The node's labels, for node selectors.
    pub node_labels: &'a BTreeMap<String, String>,
}

/// Why no pool could be chosen for a pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectError {
    /// An annotation or the netconf names a pool that does not exist.
    #[error("pool {pool} named by {named_by} does not exist")]
    UnknownPool {
        /// The missing pool.
        pool: String,
        /// What named it, e.g. "ipam.pools of network net1".
        named_by: String,
    },
    /// The pod's `ipwarden.io/pools` annotation is not a JSON map of lists of pool names.
    #[error(
        "pod annotation {POOLS_ANNOTATION} must be a JSON map of interface name to pool names, such as {{\"net1\": [\"net1-v4\"]}}, not {value}: {reason}"
    )]
    MalformedPoolsAnnotation {
        /// The annotation's value, quoted, cut after its first 64 characters.
        value: String,
        /// Why it does not parse.
        reason: String,
    },
    /// The chosen pool cannot be used.
    #[error("pool {pool} named by {named_by} cannot be used: {reason}")]
    Unusable {
        /// The pool.
        pool: String,
        /// What named it, e.g. "the pod annotation ipwarden.io/pool".
        named_by: String,
        /// Why (overlap, invalid layout, selectors).
        reason: String,
    },
    /// Two chosen pools are of the same IP family.
    #[error(
        "pools {first} and {second} named by {named_by} are both {family}; an interface gets at most one IP per family"
    )]
    SameFamily {
        /// One pool.
        first: String,
        /// The other.
        second: String,
        /// IPv4 or IPv6.
        family: &'static str,
        /// What chose them, e.g. "the default pools".
        named_by: String,
    },
    /// Nothing names the interface's pools and no default pool fits.
    #[error(
        "no pool is named for the interface ({POOLS_ANNOTATION}, the netconf's ipam.pools, {POOL_ANNOTATION} on the pod or its namespace), and no default pool fits it{}",
        skipped_text(.skipped)
    )]
    NoDefault {
        /// The default pools that exist but cannot serve the pod, with why ("pool p: it
        /// is being deleted").
        skipped: Vec<String>,
    },
}

/// What named the pools an interface allocates from, in the order of precedence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PoolSource<'a> {
    /// The pod's `ipwarden.io/pools` entry for the interface.
    InterfaceAnnotation(&'a str),
    /// The network's netconf `ipam.pools`.
    Network(&'a str),
    /// The pod's `ipwarden.io/pool` annotation.
    PodAnnotation,
    /// The namespace's `ipwarden.io/pool` annotation.
    NamespaceAnnotation,
    /// Nothing: the default pools that fit.
    Defaults,
}

impl std::fmt::Display for PoolSource<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::InterfaceAnnotation(interface) => {
                write!(f, "the pod annotation {POOLS_ANNOTATION} for interface {interface}")
            }
            Self::Network(network) => write!(f, "ipam.pools of network {network}"),
            Self::PodAnnotation => write!(f, "the pod annotation {POOL_ANNOTATION}"),
            Self::NamespaceAnnotation => write!(f, "the namespace annotation {POOL_ANNOTATION}"),
            Self::Defaults => write!(f, "the default pools"),
        }
    }
}

/// The pool names that decide an interface's pools, with what named them; `None` when
/// nothing names any (the default pools then serve it). An empty list, or a blank value,
/// names nothing. A malformed `ipwarden.io/pools` annotation is an error for every
/// interface: guessing what it meant could put an interface on the wrong network.
fn named_pools<'a>(placement: &PodPlacement<'a>) -> Result<Option<(PoolSource<'a>, Vec<String>)>, SelectError> {
    let per_interface = match placement.interface_annotation.filter(|v| !v.trim().is_empty()) {
        Some(text) => serde_json::from_str::<BTreeMap<String, Vec<String>>>(text)
            .map_err(|e| SelectError::MalformedPoolsAnnotation { value: shown_value(text), reason: e.to_string() })?
            .remove(placement.interface),
        None => None,
    };
    let split = |text: Option<&str>| -> Vec<String> {
        text.into_iter().flat_map(|t| t.split(',')).map(str::trim).map(str::to_string).collect()
    };
    let (network, network_pools) = placement.network;
    let candidates = [
        (PoolSource::InterfaceAnnotation(placement.interface), per_interface.unwrap_or_default()),
        (PoolSource::Network(network), network_pools.to_vec()),
        (PoolSource::PodAnnotation, split(placement.pod_annotation)),
        (PoolSource::NamespaceAnnotation, split(placement.namespace_annotation)),
    ];
    Ok(candidates.into_iter().find_map(|(source, names)| {
        let names: Vec<String> = names.into_iter().filter(|n| !n.trim().is_empty()).collect();
        (!names.is_empty()).then_some((source, names))
    }))
}

/// How many characters of a malformed annotation an error quotes: enough to recognise it,
/// not a whole pasted document in every ADD's error and log line.
const SHOWN_VALUE_CHARS: usize = 64;

/// `text` quoted, cut after [`SHOWN_VALUE_CHARS`] characters (marked by `...`).
fn shown_value(text: &str) -> String {
    let head: String = text.chars().take(SHOWN_VALUE_CHARS).collect();
    let cut = if head.len() < text.len() { "..." } else { "" };
    format!("{head:?}{cut}")
}

fn skipped_text(skipped: &[String]) -> String {
    if skipped.is_empty() { String::new() } else { format!(" ({})", skipped.join("; ")) }
}

fn family(layout: &PoolLayout) -> &'static str {
    if layout.family_is_v4() { "IPv4" } else { "IPv6" }
}

/// Why `pool` cannot serve the pod, or `None` when it can: [`unusable_on_node`]'s reasons, and
/// its namespace selector.
pub(super) fn unusable(
    pool: &PoolView<'_>,
    placement: &PodPlacement<'_>,
    overlapping: &BTreeMap<String, BTreeSet<String>>,
) -> Option<String> {
    if let Some(why) = unusable_state(pool, overlapping) {
        return Some(why);
    }
    if !selector_matches(pool.spec.namespace_selector.as_ref(), placement.namespace_labels) {
        return Some("its namespaceSelector does not match the pod's namespace".to_string());
    }
    node_unselected(pool, placement.node_labels)
}

/// Why no pod on a node labelled `node_labels` may take IPs of `pool`, whatever the pod and its
/// namespace, or `None`: being deleted, disabled, without a valid layout, overlapping another pool
/// or an orphaned block that holds records (`overlapping`, from [`overlaps`]), or not selecting
/// the node. The one rule of "may this node use this pool" that ADDs ([`select`], through
/// [`unusable`]) and the spares (`spares::kept_in`) share.
pub fn unusable_on_node(
    pool: &PoolView<'_>,
    node_labels: &BTreeMap<String, String>,
    overlapping: &BTreeMap<String, BTreeSet<String>>,
) -> Option<String> {
    unusable_state(pool, overlapping).or_else(|| node_unselected(pool, node_labels))
}

/// Why `pool` hands out nothing to anyone now, or `None`.
fn unusable_state(pool: &PoolView<'_>, overlapping: &BTreeMap<String, BTreeSet<String>>) -> Option<String> {
    if pool.deleting {
        return Some(
            "it is being deleted: it hands out no IP, and goes once its pods have released theirs".to_string(),
        );
    }
    if pool.spec.disabled {
        return Some(
            "it is disabled (spec.disabled): it keeps the IPs it handed out but hands out no new one".to_string(),
        );
    }
    if let Err(e) = pool.layout {
        return Some(format!("invalid layout: {e}"));
    }
    if let Some(others) = overlapping.get(pool.name) {
        let others: Vec<&str> = others.iter().map(String::as_str).collect();
        return Some(format!("it overlaps {}", others.join(", ")));
    }
    None
}

/// Why `pool` does not serve a node labelled `node_labels`, or `None`.
fn node_unselected(pool: &PoolView<'_>, node_labels: &BTreeMap<String, String>) -> Option<String> {
    (!selector_matches(pool.spec.node_selector.as_ref(), node_labels))
        .then(|| "its nodeSelector does not match the node".to_string())
}

/// The pools an interface of a pod allocates from ([`named_pools`]): those the pod's
/// `ipwarden.io/pools` annotation names for the interface, else those its network's netconf
/// names, else those the pod's `ipwarden.io/pool` annotation names (comma-separated), else
/// its namespace's, else every default pool that fits it (one per IP family, IPv4 first).
/// Pools being deleted, disabled, overlapping (another pool or an orphaned block with
/// records) or invalid, and pools whose selectors do not match, are never chosen.
pub fn select<'a>(
    pools: &[PoolView<'a>],
    orphans: &[OrphanedBlock],
    placement: &PodPlacement<'_>,
) -> Result<Vec<PoolView<'a>>, SelectError> {
    let overlapping = overlaps(pools, orphans);
    let named = named_pools(placement)?;
    let source = named.as_ref().map_or(PoolSource::Defaults, |(source, _)| *source);
    let chosen: Vec<PoolView<'a>> = match &named {
        Some((source, names)) => {
            let mut chosen = Vec::new();
            for name in names.iter().map(|n| n.trim()) {
                let pool = pools
                    .iter()
                    .find(|p| p.name == name)
                    .ok_or_else(|| SelectError::UnknownPool { pool: name.to_string(), named_by: source.to_string() })?;
                if let Some(reason) = unusable(pool, placement, &overlapping) {
                    return Err(SelectError::Unusable { pool: name.to_string(), named_by: source.to_string(), reason });
                }
                chosen.push(pool.clone());
            }
            chosen
        }
        None => {
            let mut defaults: Vec<PoolView<'a>> = pools
                .iter()
                .filter(|p| p.spec.default && unusable(p, placement, &overlapping).is_none())
                .cloned()
                .collect();
            // IPv4 first whatever order the pools were read in, so a dual-stack pod's primary
            // IP (`status.podIP`) is always of the same family.
            defaults.sort_by_key(|p| !p.layout.is_ok_and(PoolLayout::family_is_v4));
            defaults
        }
    };
    if chosen.is_empty() {
        let skipped = pools
            .iter()
            .filter(|p| p.spec.default)
            .filter_map(|p| Some(format!("pool {}: {}", p.name, unusable(p, placement, &overlapping)?)))
            .collect();
        return Err(SelectError::NoDefault { skipped });
    }
    for (i, a) in chosen.iter().enumerate() {
        for b in &chosen[i + 1..] {
            if let (Ok(la), Ok(lb)) = (a.layout, b.layout)
                && la.family_is_v4() == lb.family_is_v4()
            {
                return Err(SelectError::SameFamily {
                    first: a.name.to_string(),
                    second: b.name.to_string(),
                    family: family(la),
                    named_by: source.to_string(),
                });
            }
        }
    }
    Ok(chosen)
}

/// Whether a label selector matches `labels`; an absent selector matches everything. An
/// unknown operator matches nothing, so a typo never widens a pool's reach.
pub fn selector_matches(selector: Option<&LabelSelector>, labels: &BTreeMap<String, String>) -> bool {
    let Some(selector) = selector else { return true };
    let labels_match =
        selector.match_labels.iter().flatten().all(|(key, value)| labels.get(key).is_some_and(|v| v == value));
    let expressions_match = selector.match_expressions.iter().flatten().all(|expr| {
        let values = expr.values.as_deref().unwrap_or_default();
        let value = labels.get(&expr.key);
        match expr.operator.as_str() {
            "In" => value.is_some_and(|v| values.contains(v)),
            "NotIn" => value.is_none_or(|v| !values.contains(v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            _ => false,
        }
    });
    labels_match && expressions_match
}

#[cfg(test)]
mod test {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_the_canonical_block_of_a_claimed_ip_is_accepted() {
        let block: IpNet = "10.0.1.0/24".parse().expect("net");
        let ip: IpAddr = "10.0.1.7".parse().expect("ip");
        assert_eq!(check_claimed_block("p", block, ip, "p-10-0-1-0-24"), Ok(()));
        for named in ["p-10-0-0-0-24", "other-10-0-1-0-24", "kube-system-evil", ""] {
            let refused = check_claimed_block("p", block, ip, named).expect_err(named);
            assert_eq!(refused.canonical, "p-10-0-1-0-24");
            assert!(refused.to_string().contains(named), "{refused}");
        }
    }

    fn spec(value: serde_json::Value) -> IPPoolSpec {
        serde_json::from_value(value).expect("valid spec")
    }

    #[test]
    fn a_pool_without_a_gateway_gets_its_cidrs_first_address_unless_every_address_is_a_host() {
        let cases = [
            // (spec, gateway)
            (json!({"cidr": "10.244.0.0/16"}), Some("10.244.0.1")),
            (json!({"cidr": "10.0.0.4/30"}), Some("10.0.0.5")),
            (json!({"cidr": "10.0.0.4/31"}), None),
            (json!({"cidr": "10.0.0.7/32"}), None),
            (json!({"cidr": "fd00::/64"}), Some("fd00::1")),
            (json!({"cidr": "fd00:10:244::/126"}), Some("fd00:10:244::1")),
            (json!({"cidr": "fd00::/127"}), None),
            (json!({"cidr": "fd00::5/128"}), None),
            // An explicit gateway wins, wherever it is, and is kept as written for the layout
            // to judge.
            (json!({"cidr": "10.244.0.0/16", "gateway": "10.244.255.254"}), Some("10.244.255.254")),
            (json!({"cidr": "10.0.0.4/31", "gateway": "10.0.0.5"}), Some("10.0.0.5")),
            (json!({"cidr": "fd00::/64", "gateway": "fd00::ffff"}), Some("fd00::ffff")),
            (json!({"cidr": "10.0.0.0/24", "gateway": "gw"}), Some("gw")),
            // Ranges and exclusions do not move the defaulted gateway.
            (
                json!({"cidr": "10.0.0.0/24", "ranges": [{"start": "10.0.0.100", "end": "10.0.0.200"}]}),
                Some("10.0.0.1"),
            ),
            (json!({"cidr": "10.0.0.0/24", "exclude": ["10.0.0.0/28"]}), Some("10.0.0.1")),
            // No layout, no gateway.
            (json!({"cidr": "10.0.0.1/24"}), None),
            (json!({"cidr": "not a cidr"}), None),
        ];
        for (value, expected) in cases {
            let text = value.to_string();
            assert_eq!(gateway(&spec(value)).as_deref(), expected, "{text}");
        }
    }

    #[test]
    fn only_ranges_naming_the_defaulted_gateway_are_reported() {
        let range = |start: &str, end: &str| json!([{"start": start, "end": end}]);
        let cases = [
            // (spec, the gateway reported)
            (json!({"cidr": "10.60.0.0/29", "ranges": range("10.60.0.1", "10.60.0.5")}), Some("10.60.0.1")),
            (json!({"cidr": "10.60.0.0/29", "ranges": range("10.60.0.0", "10.60.0.7")}), Some("10.60.0.1")),
            (json!({"cidr": "fd00::/120", "ranges": range("fd00::1", "fd00::1")}), Some("fd00::1")),
            // A second range naming it is enough.
            (
                json!({"cidr": "10.60.0.0/24", "ranges": [{"start": "10.60.0.9", "end": "10.60.0.9"},
                                                          {"start": "10.60.0.1", "end": "10.60.0.2"}]}),
                Some("10.60.0.1"),
            ),
            // Ranges that leave it out, or no ranges (the whole CIDR, as host-local): nothing shrank.
            (json!({"cidr": "10.60.0.0/29", "ranges": range("10.60.0.2", "10.60.0.6")}), None),
            (json!({"cidr": "10.60.0.0/29"}), None),
            // The admin set the gateway, or excluded the address: they know.
            (json!({"cidr": "10.60.0.0/29", "gateway": "10.60.0.1", "ranges": range("10.60.0.1", "10.60.0.5")}), None),
            (
                json!({"cidr": "10.60.0.0/29", "exclude": ["10.60.0.1"], "ranges": range("10.60.0.1", "10.60.0.5")}),
                None,
            ),
            (
                json!({"cidr": "10.60.0.0/29", "exclude": ["10.60.0.0/30"], "ranges": range("10.60.0.1", "10.60.0.5")}),
                None,
            ),
            // No gateway to default (a /31), another family's range, a range that does not parse.
            (json!({"cidr": "10.60.0.0/31", "ranges": range("10.60.0.0", "10.60.0.1")}), None),
            (json!({"cidr": "10.60.0.0/29", "ranges": range("::", "ffff::")}), None),
            (json!({"cidr": "10.60.0.0/29", "ranges": range("x", "10.60.0.5")}), None),
            (json!({"cidr": "10.60.0.0/29", "ranges": range("10.60.0.1", "ffff::")}), None),
            // A pool whose layout is invalid hands out nothing at all.
            (json!({"cidr": "10.60.0.0/29", "exclude": ["nonsense"], "ranges": range("10.60.0.1", "10.60.0.5")}), None),
        ];
        for (value, expected) in cases {
            let text = value.to_string();
            let note = gateway_withheld_from_ranges(&spec(value));
            assert_eq!(note.is_some(), expected.is_some(), "{text}: {note:?}");
            if let (Some(note), Some(gateway)) = (note, expected) {
                assert!(note.starts_with(&format!("its gateway {gateway} lies in spec.ranges")), "{text}: {note}");
                assert!(note.contains(&format!("set spec.gateway to {gateway}")), "{text}: {note}");
            }
        }
    }

    #[test]
    fn the_layout_never_hands_out_the_gateway_set_or_defaulted() {
        let cases = [
            // (spec, the gateway, an address it hands out, capacity)
            (json!({"cidr": "10.244.0.0/24"}), "10.244.0.1", "10.244.0.2", 253),
            (json!({"cidr": "10.244.0.0/24", "gateway": "10.244.0.254"}), "10.244.0.254", "10.244.0.1", 253),
            (json!({"cidr": "10.0.0.4/30"}), "10.0.0.5", "10.0.0.6", 1),
            (json!({"cidr": "fd00::/120"}), "fd00::1", "fd00::2", 254),
            (json!({"cidr": "fd00::/64", "blockSize": 120}), "fd00::1", "fd00::ffff", (1u128 << 64) - 2),
        ];
        for (value, gateway, handed_out, capacity) in cases {
            let text = value.to_string();
            let layout = layout(&spec(value)).expect("layout");
            assert!(!layout.is_allocatable(gateway.parse().expect("ip")), "{text}: {gateway}");
            assert!(layout.is_allocatable(handed_out.parse().expect("ip")), "{text}: {handed_out}");
            assert_eq!(layout.capacity(), capacity, "{text}");
        }
        // Without a gateway to spare, every address is a pod's.
        for (cidr, capacity) in [("10.0.0.4/31", 2), ("10.0.0.7/32", 1), ("fd00::/127", 2), ("fd00::5/128", 1)] {
            assert_eq!(layout(&spec(json!({"cidr": cidr}))).expect("layout").capacity(), capacity, "{cidr}");
        }
    }

    #[test]
    fn a_pool_routes_by_default_unless_it_says_not_to() {
        for (value, routes) in [
            (json!({"cidr": "10.0.0.0/24"}), true),
            (json!({"cidr": "10.0.0.0/24", "defaultRoute": true}), true),
            (json!({"cidr": "10.0.0.0/24", "defaultRoute": false}), false),
        ] {
            let text = value.to_string();
            assert_eq!(default_route(&spec(value)), routes, "{text}");
        }
    }

    #[test]
    fn a_pool_owns_the_cells_of_its_cidr_at_its_block_size_whatever_its_ranges_say() {
        let plain = spec(json!({"cidr": "10.0.0.0/16", "blockSize": 24}));
        let reversed =
            spec(json!({"cidr": "10.0.0.0/16", "blockSize": 24, "ranges": [{"start": "10.0.9.9", "end": "10.0.0.1"}]}));
        let excluded = spec(json!({"cidr": "10.0.0.0/16", "blockSize": 24, "exclude": ["10.0.3.0/24"]}));
        let broken = spec(json!({"cidr": "not a cidr"}));
        let cases = [
            (&plain, "10.0.3.0/24", true),
            (&plain, "10.0.3.0/26", false),
            (&plain, "10.1.0.0/24", false),
            (&plain, "garbage", false),
            (&reversed, "10.0.3.0/24", true),
            (&excluded, "10.0.3.0/24", true),
            (&broken, "10.0.3.0/24", true),
        ];
        for (pool, block, owned) in cases {
            assert_eq!(owns_block(pool, block), owned, "{} owns {block}", pool.cidr);
        }
    }

    struct Pools(PoolSet);

    impl Pools {
        fn new(items: &[(&str, serde_json::Value)]) -> Self {
            Self(PoolSet::new(items.iter().map(|(name, value)| (name.to_string(), spec(value.clone()), false)), []))
        }

        fn views(&self) -> Vec<PoolView<'_>> {
            self.0.views()
        }
    }

    fn names<'a>(chosen: &[PoolView<'a>]) -> Vec<&'a str> {
        chosen.iter().map(|p| p.name).collect()
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn the_pod_annotation_wins_over_the_namespace_annotation_and_the_default() {
        let pools = Pools::new(&[
            ("a", json!({"cidr": "10.1.0.0/24", "default": true})),
            ("b", json!({"cidr": "10.2.0.0/24"})),
            ("c", json!({"cidr": "10.3.0.0/24"})),
        ]);
        let empty = BTreeMap::new();
        let base = PodPlacement {
            interface: "eth0",
            interface_annotation: None,
            network: ("pods", &[]),
            pod_annotation: None,
            namespace_annotation: None,
            namespace_labels: &empty,
            node_labels: &empty,
        };
        let views = pools.views();
        let pod = PodPlacement { pod_annotation: Some("b"), namespace_annotation: Some("c"), ..base.clone() };
        assert_eq!(names(&select(&views, &[], &pod).expect("pod pool")), ["b"]);
        let ns = PodPlacement { namespace_annotation: Some("c"), ..base.clone() };
        assert_eq!(names(&select(&views, &[], &ns).expect("namespace pool")), ["c"]);
        assert_eq!(names(&select(&views, &[], &base).expect("default pool")), ["a"]);
    }

    #[test]
    fn an_interface_draws_from_its_annotation_entry_else_its_network_else_the_pod_rules() {
        let pools = Pools::new(&[
            ("a", json!({"cidr": "10.1.0.0/24", "default": true})),
            ("b", json!({"cidr": "10.2.0.0/24"})),
            ("b6", json!({"cidr": "fd02::/64"})),
            ("c", json!({"cidr": "10.3.0.0/24"})),
            ("p", json!({"cidr": "10.4.0.0/24"})),
        ]);
        let views = pools.views();
        let empty = BTreeMap::new();
        let net_b = ["b".to_string(), "b6".to_string()];
        let entries = r#"{"net1": ["c"], "net2": []}"#;
        // (interface, ipwarden.io/pools, the netconf's ipam.pools, ipwarden.io/pool, chosen)
        type Row<'a> = (&'a str, Option<&'a str>, &'a [String], Option<&'a str>, &'a [&'a str]);
        let table: [Row<'_>; 7] = [
            ("net1", Some(entries), &net_b, Some("p"), &["c"]),
            // An empty entry names nothing: the network's pools serve it.
            ("net2", Some(entries), &net_b, Some("p"), &["b", "b6"]),
            ("net1", None, &net_b, Some("p"), &["b", "b6"]),
            ("net1", Some("  "), &net_b, None, &["b", "b6"]),
            // No entry and no network pools: the pod's rules, as for a pod of one network.
            ("eth0", Some(entries), &[], Some("p"), &["p"]),
            ("eth0", Some(entries), &[], None, &["a"]),
            // The same pool may serve two interfaces: each draws its own IP from it.
            ("net3", Some(r#"{"net3": ["a"]}"#), &net_b, None, &["a"]),
        ];
        for (interface, annotation, network_pools, pod_annotation, chosen) in table {
            let placement = PodPlacement {
                interface,
                interface_annotation: annotation,
                network: ("net-b", network_pools),
                pod_annotation,
                namespace_annotation: None,
                namespace_labels: &empty,
                node_labels: &empty,
            };
            let got = select(&views, &[], &placement).expect("pools");
            assert_eq!(names(&got), chosen, "{interface} with {annotation:?}, {network_pools:?}, {pod_annotation:?}");
        }
    }

    #[test]
    fn a_bad_per_interface_choice_fails_naming_what_named_it() {
        let pools = Pools::new(&[
            ("a", json!({"cidr": "10.1.0.0/24", "default": true})),
            ("b", json!({"cidr": "10.2.0.0/24"})),
        ]);
        let views = pools.views();
        let empty = BTreeMap::new();
        let placement = |annotation, network_pools| PodPlacement {
            interface: "net1",
            interface_annotation: annotation,
            network: ("net-b", network_pools),
            pod_annotation: None,
            namespace_annotation: None,
            namespace_labels: &empty,
            node_labels: &empty,
        };
        let unknown = ["b".to_string(), "nope".to_string()];
        let err = select(&views, &[], &placement(None, &unknown)).expect_err("unknown");
        assert_eq!(err.to_string(), "pool nope named by ipam.pools of network net-b does not exist");
        let two_v4 = ["a".to_string(), "b".to_string()];
        let err = select(&views, &[], &placement(None, &two_v4)).expect_err("same family").to_string();
        assert!(err.starts_with("pools a and b named by ipam.pools of network net-b are both IPv4"), "{err}");
        let err = select(&views, &[], &placement(Some(r#"{"net1": ["gone"]}"#), &two_v4)).expect_err("unknown");
        assert_eq!(
            err.to_string(),
            "pool gone named by the pod annotation ipwarden.io/pools for interface net1 does not exist"
        );
        for malformed in ["net1=b", r#"{"net1": "b"}"#, r#"["b"]"#] {
            let err = select(&views, &[], &placement(Some(malformed), &[])).expect_err(malformed);
            assert!(matches!(err, SelectError::MalformedPoolsAnnotation { .. }), "{malformed}: {err}");
            assert!(err.to_string().starts_with("pod annotation ipwarden.io/pools must be a JSON map"), "{err}");
            assert!(err.to_string().contains(&format!("not {malformed:?}: ")), "quotes the value: {err}");
        }
        let long = format!("net1={}", "b".repeat(100));
        let err = select(&views, &[], &placement(Some(&long), &[])).expect_err("long").to_string();
        assert!(err.contains(&format!("not \"net1={}\"...: ", "b".repeat(59))), "cut after 64 characters: {err}");
    }

    #[test]
    fn an_annotation_may_name_one_pool_per_family_for_dual_stack() {
        let pools = Pools::new(&[("v4", json!({"cidr": "10.1.0.0/24"})), ("v6", json!({"cidr": "fd00::/64"}))]);
        let empty = BTreeMap::new();
        let placement = PodPlacement {
            interface: "eth0",
            interface_annotation: None,
            network: ("pods", &[]),
            pod_annotation: Some("v4, v6"),
            namespace_annotation: None,
            namespace_labels: &empty,
            node_labels: &empty,
        };
        assert_eq!(names(&select(&pools.views(), &[], &placement).expect("dual stack")), ["v4", "v6"]);
        let same = PodPlacement { pod_annotation: Some("v4,v4"), ..placement };
        assert!(matches!(select(&pools.views(), &[], &same), Err(SelectError::SameFamily { .. })));
    }

    #[test]
    fn default_pools_of_both_families_come_ipv4_first_whatever_the_cache_order() {
        let v6 = ("v6", json!({"cidr": "fd00::/64", "default": true}));
        let v4 = ("v4", json!({"cidr": "10.1.0.0/24", "default": true}));
        let empty = BTreeMap::new();
        let placement = PodPlacement {
            interface: "eth0",
            interface_annotation: None,
            network: ("pods", &[]),
            pod_annotation: None,
            namespace_annotation: None,
            namespace_labels: &empty,
            node_labels: &empty,
        };
        for order in [[v6.clone(), v4.clone()], [v4.clone(), v6.clone()]] {
            let pools = Pools::new(&order);
            assert_eq!(names(&select(&pools.views(), &[], &placement).expect("dual stack")), ["v4", "v6"]);
        }
    }

    #[test]
    fn overlapping_pools_are_never_chosen_and_say_what_they_overlap() {
        let pools = Pools::new(&[
            ("wide", json!({"cidr": "10.0.0.0/16", "default": true})),
            ("narrow", json!({"cidr": "10.0.5.0/24"})),
            ("apart", json!({"cidr": "10.9.0.0/24", "default": true})),
        ]);
        let views = pools.views();
        let found = overlaps(&views, &[]);
        assert_eq!(found.keys().collect::<Vec<_>>(), ["narrow", "wide"]);
        let empty = BTreeMap::new();
        let placement = PodPlacement {
            interface: "eth0",
            interface_annotation: None,
            network: ("pods", &[]),
            pod_annotation: Some("narrow"),
            namespace_annotation: None,
            namespace_labels: &empty,
            node_labels: &empty,
        };
        let err = select(&views, &[], &placement).expect_err("overlapping pool refused");
        assert_eq!(
            err.to_string(),
            "pool narrow named by the pod annotation ipwarden.io/pool cannot be used: it overlaps wide"
        );
        let defaults = PodPlacement { pod_annotation: None, ..placement };
        assert_eq!(names(&select(&views, &[], &defaults).expect("non-overlapping default")), ["apart"]);
    }

    #[test]
    fn overlap_conditions_mark_both_sides_and_clear_the_rest() {
        let pools = Pools::new(&[
            ("wide", json!({"cidr": "10.0.0.0/16"})),
            ("narrow", json!({"cidr": "10.0.5.0/24"})),
            ("apart", json!({"cidr": "fd00::/64"})),
        ]);
        let conditions = overlap_conditions(&pools.views(), &[]);
        assert!(conditions["wide"].0);
        assert!(conditions["wide"].1.starts_with("overlaps narrow"));
        assert!(conditions["narrow"].0);
        assert_eq!(conditions["apart"], (false, "overlaps no other pool".to_string()));
    }

    #[test]
    fn unknown_annotated_pools_and_missing_defaults_are_errors() {
        let pools = Pools::new(&[("a", json!({"cidr": "10.1.0.0/24"}))]);
        let empty = BTreeMap::new();
        let placement = PodPlacement {
            interface: "eth0",
            interface_annotation: None,
            network: ("pods", &[]),
            pod_annotation: None,
            namespace_annotation: Some("nope"),
            namespace_labels: &empty,
            node_labels: &empty,
        };
        assert_eq!(
            select(&pools.views(), &[], &placement).err(),
            Some(SelectError::UnknownPool {
                pool: "nope".into(),
                named_by: "the namespace annotation ipwarden.io/pool".into()
            })
        );
        let none = PodPlacement { namespace_annotation: None, ..placement };
        assert_eq!(select(&pools.views(), &[], &none).err(), Some(SelectError::NoDefault { skipped: Vec::new() }));
    }

    #[test]
    fn selectors_restrict_default_pools_to_matching_namespaces_and_nodes() {
        let pools = Pools::new(&[
            ("zone-a", json!({"cidr": "10.1.0.0/24", "default": true, "nodeSelector": {"matchLabels": {"zone": "a"}}})),
            ("zone-b", json!({"cidr": "10.2.0.0/24", "default": true, "nodeSelector": {"matchLabels": {"zone": "b"}}})),
            (
                "team",
                json!({"cidr": "10.3.0.0/24", "namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["x"]}]}}),
            ),
        ]);
        let node_b = labels(&[("zone", "b")]);
        let ns = labels(&[("team", "y")]);
        let placement = PodPlacement {
            interface: "eth0",
            interface_annotation: None,
            network: ("pods", &[]),
            pod_annotation: None,
            namespace_annotation: None,
            namespace_labels: &ns,
            node_labels: &node_b,
        };
        assert_eq!(names(&select(&pools.views(), &[], &placement).expect("zone b default")), ["zone-b"]);
        let annotated = PodPlacement { pod_annotation: Some("team"), ..placement };
        let err = select(&pools.views(), &[], &annotated).expect_err("selector excludes namespace");
        assert!(err.to_string().contains("namespaceSelector"), "{err}");
    }

    #[test]
    fn selector_operators_follow_kubernetes_semantics() {
        let selector = |op: &str, values: &[&str]| -> LabelSelector {
            serde_json::from_value(json!({"matchExpressions": [{"key": "k", "operator": op, "values": values}]}))
                .expect("selector")
        };
        let with = labels(&[("k", "v")]);
        let without = labels(&[]);
        let cases = [
            ("In", vec!["v"], true, false),
            ("NotIn", vec!["v"], false, true),
            ("Exists", vec![], true, false),
            ("DoesNotExist", vec![], false, true),
            ("Bogus", vec!["v"], false, false),
        ];
        for (op, values, on_with, on_without) in cases {
            assert_eq!(selector_matches(Some(&selector(op, &values)), &with), on_with, "{op} on labelled");
            assert_eq!(selector_matches(Some(&selector(op, &values)), &without), on_without, "{op} on unlabelled");
        }
        assert!(selector_matches(None, &without), "no selector matches everything");
    }

    fn placement<'a>(annotation: Option<&'a str>, empty: &'a BTreeMap<String, String>) -> PodPlacement<'a> {
        PodPlacement {
            interface: "eth0",
            interface_annotation: None,
            network: ("pods", &[]),
            pod_annotation: annotation,
            namespace_annotation: None,
            namespace_labels: empty,
            node_labels: empty,
        }
    }

    #[test]
    fn pools_being_deleted_or_disabled_are_never_chosen_and_the_error_says_why() {
        let set = PoolSet::new(
            [
                ("old".to_string(), spec(json!({"cidr": "10.1.0.0/24", "default": true})), true),
                ("drained".to_string(), spec(json!({"cidr": "10.2.0.0/24", "default": true, "disabled": true})), false),
            ],
            [],
        );
        let views = set.views();
        let empty = BTreeMap::new();
        let err = select(&views, &[], &placement(Some("old"), &empty)).expect_err("deleting pool refused");
        assert!(
            err.to_string().starts_with(
                "pool old named by the pod annotation ipwarden.io/pool cannot be used: it is being deleted"
            ),
            "{err}"
        );
        let err = select(&views, &[], &placement(Some("drained"), &empty)).expect_err("disabled pool refused");
        assert!(
            err.to_string().starts_with(
                "pool drained named by the pod annotation ipwarden.io/pool cannot be used: it is disabled"
            ),
            "{err}"
        );
        let err = select(&views, &[], &placement(None, &empty)).expect_err("no default fits").to_string();
        assert!(err.contains("pool old: it is being deleted") && err.contains("pool drained: it is disabled"), "{err}");
    }

    #[test]
    fn blocks_of_a_gone_pool_or_of_another_layout_are_orphaned_and_block_the_pool_over_them_while_they_hold_records() {
        let block = |name: &str, pool: &str, cidr: &str, records: usize| BlockSummary {
            name: name.into(),
            pool: pool.into(),
            cidr: cidr.into(),
            records,
        };
        let set = PoolSet::new(
            [("p".to_string(), spec(json!({"cidr": "10.0.0.0/28", "blockSize": 30, "default": true})), false)],
            [
                block("p-10-0-0-0-30", "p", "10.0.0.0/30", 1),
                block("p-10-0-0-0-28", "p", "10.0.0.0/28", 2),
                block("gone-10-0-0-16-28", "gone", "10.0.0.16/28", 3),
                block("gone-10-9-0-0-24", "gone", "10.9.0.0/24", 0),
            ],
        );
        let orphans: Vec<&str> = set.orphans().iter().map(|o| o.name.as_str()).collect();
        assert_eq!(orphans, ["p-10-0-0-0-28", "gone-10-0-0-16-28", "gone-10-9-0-0-24"], "the pool's own block is not");
        assert!(!set.retired().contains("p-10-0-0-0-30") && set.retired().len() == 3, "orphans are retired");
        let views = set.views();
        let found = overlaps(&views, set.orphans());
        assert_eq!(found["p"].iter().collect::<Vec<_>>(), ["orphaned IPBlock p-10-0-0-0-28"]);
        let empty = BTreeMap::new();
        let err = select(&views, set.orphans(), &placement(Some("p"), &empty)).expect_err("refused");
        assert_eq!(
            err.to_string(),
            "pool p named by the pod annotation ipwarden.io/pool cannot be used: it overlaps orphaned IPBlock p-10-0-0-0-28"
        );

        let released: Vec<OrphanedBlock> =
            set.orphans().iter().cloned().map(|o| OrphanedBlock { records: 0, ..o }).collect();
        assert!(overlaps(&views, &released).is_empty(), "empty orphaned blocks overlap nothing");
        assert_eq!(names(&select(&views, &released, &placement(None, &empty)).expect("served")), ["p"]);
    }

    #[test]
    fn a_block_is_retired_when_its_pool_is_absent_deleting_or_does_not_own_it() {
        let pool = spec(json!({"cidr": "10.0.0.0/28", "blockSize": 30, "default": true}));
        // (pool, being deleted, block CIDR, retired)
        let table = [
            (Some(&pool), false, "10.0.0.4/30", false),
            (Some(&pool), true, "10.0.0.4/30", true),
            (Some(&pool), false, "10.0.0.0/28", true),
            (Some(&pool), false, "10.9.0.0/30", true),
            (None, false, "10.0.0.4/30", true),
        ];
        for (spec, deleting, cidr, retired) in table {
            let pool = spec.map(|s| (s, deleting));
            assert_eq!(block_is_retired(pool, cidr), retired, "pool {:?}, deleting {deleting}, {cidr}", spec.is_some());
        }
    }

    #[test]
    fn the_finalizer_goes_on_live_pools_and_comes_off_a_deleting_pool_only_once_no_record_is_left() {
        // (has, deleting, records, step)
        let table = [
            (false, false, 0, FinalizerStep::Add),
            (false, false, 3, FinalizerStep::Add),
            (true, false, 3, FinalizerStep::Nothing),
            (true, true, 1, FinalizerStep::Wait),
            (true, true, 0, FinalizerStep::Remove),
            (false, true, 2, FinalizerStep::Nothing),
        ];
        for (has, deleting, records, step) in table {
            assert_eq!(
                finalizer_step(has, deleting, records),
                step,
                "has {has}, deleting {deleting}, {records} records"
            );
        }
    }

    #[test]
    fn block_names_are_dns_safe_for_both_families() {
        assert_eq!(block_name("default", "10.244.1.0/24".parse().expect("net")), "default-10-244-1-0-24");
        assert_eq!(block_name("v6", "fd00::100/120".parse().expect("net")), "v6-fd00--100-120");
    }
}
