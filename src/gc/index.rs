//! A plain in-memory index of the cluster that every GC decision reads: trimmed pods, the
//! IPs pods report, claims, StatefulSets, KubeVirt objects, nodes and their agents' Leases,
//! pools and blocks. It is maintained incrementally: the controller applies each watch event
//! to it ([`ClusterIndex::apply`], [`ClusterIndex::delete`], and a relist's
//! [`ClusterIndex::relist_started`] / [`ClusterIndex::relist_done`]), so the cost of keeping
//! it grows with events, not with the cluster, and every question is a map lookup. The CLI
//! builds one from lists through the same functions ([`ClusterIndex::from_objects`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use kube::api::DynamicObject;
use kube::core::PartialObjectMeta;

use super::agents::{AgentLease, Observations, stale_agents};
use super::handshake::{TakeoverStep, claimant_refusal, controller_takeover_step};
use super::rules::{
    Facts, IpHolder, NodeState, NotReadyGate, Phase, PodView, RecordView, RuleSettings, Verdict, decide, not_ready_gate,
};
use crate::crd::{Allocation, ClaimedInterface, IPBlock, IPClaim, IPPool, OwnerRef, PodRef};
use crate::ipam::blocks::{Adopter, may_be_attached};
pub use crate::ipam::workload::StatefulSetFacts;
use crate::ipam::workload::{self, KUBEVIRT_VMI_KIND, OwnerFacts, Presence, WorkloadKind};

/// What the rules need of one pod: the index keeps this, never the whole object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodFacts {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID as the runtime knows it ([`workload::runtime_uid`]: a static pod's config hash).
    pub uid: String,
    /// The pod object's own `metadata.uid` (a static pod's mirror has one beside its config
    /// hash): what `kubectl describe pod` matches Events on.
    pub object_uid: String,
    /// Its phase.
    pub phase: Phase,
    /// Its deletionTimestamp.
    pub deletion: Option<Timestamp>,
    /// Its `status.podIPs`.
    pub ips: Vec<String>,
    /// Its node (`spec.nodeName`).
    pub node: String,
    /// Its controller.
    pub owner: Option<OwnerRef>,
    /// Whether it runs in the host's network (its IPs are the node's).
    pub host_network: bool,
}

impl PodFacts {
    /// Extracts the facts of a pod object.
    pub fn of(pod: &Pod) -> Self {
        let status = pod.status.as_ref();
        let phase = match status.and_then(|s| s.phase.as_deref()) {
            Some("Succeeded" | "Failed") => Phase::Completed,
            _ => Phase::Active,
        };
        let ips = status
            .and_then(|s| s.pod_ips.as_ref())
            .map(|ips| ips.iter().map(|ip| ip.ip.clone()).collect())
            .unwrap_or_default();
        let spec = pod.spec.as_ref();
        Self {
            namespace: pod.namespace().unwrap_or_default(),
            name: pod.name_any(),
            uid: workload::runtime_uid(pod).unwrap_or_default().to_string(),
            object_uid: pod.metadata.uid.clone().unwrap_or_default(),
            phase,
            deletion: pod.metadata.deletion_timestamp.as_ref().map(|t| t.0),
            ips,
            node: spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
            owner: workload::controller_of(pod),
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
        }
    }

    /// Whether the pod no longer protects its IPs (terminating or completed).
    pub fn terminal(&self) -> bool {
        self.deletion.is_some() || self.phase == Phase::Completed
    }

    /// The pod as a migration target's backing ([`workload::target_unbacked`]): a terminating
    /// pod still runs its sandbox, so only a finished one has ended.
    pub fn as_target(&self) -> workload::TargetPod<'_> {
        workload::TargetPod {
            uid: &self.uid,
            node: &self.node,
            owner: self.owner.as_ref(),
            ended: self.phase == Phase::Completed,
        }
    }

    /// Whether the pod's containers are done (Succeeded or Failed). Until then the pod uses
    /// its IPs, terminating or not: a draining pod still serves, and its sandbox's DEL frees
    /// the IP (the node agent's start-up GC, `ipwarden check`'s conflicts).
    pub fn finished(&self) -> bool {
        self.phase == Phase::Completed
    }

    /// The pod as a record names it.
    pub fn pod_ref(&self) -> PodRef {
        PodRef { namespace: self.namespace.clone(), name: self.name.clone(), uid: self.uid.clone() }
    }
}

/// What the janitor needs of one claim.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimFacts {
    /// The claim object's UID: a status write goes to this object only.
    pub object_uid: String,
    /// The UID of the pod the claim is bound to.
    pub pod_uid: String,
    /// The node the claim is bound to.
    pub node: String,
    /// The workload's controller.
    pub owner: Option<OwnerRef>,
    /// Whether the claim is a sticky reservation.
    pub sticky: bool,
    /// The IPs per interface.
    pub interfaces: Vec<ClaimedInterface>,
    /// The binding the controller last saw in effect (`status.witnessed`).
    pub witnessed: Option<ClaimBinding>,
}

/// A claim's binding as the controller witnesses it (`status.witnessed` without its time):
/// which pod held which IPs on which node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimBinding {
    /// The pod's UID.
    pub pod_uid: String,
    /// The node it ran on.
    pub node: String,
    /// Its controller (`None` in a witness an earlier version wrote).
    pub owner: Option<OwnerRef>,
    /// Its IPs per interface.
    pub interfaces: Vec<ClaimedInterface>,
}

/// A pod reporting an IP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// The pod.
    pub pod: PodRef,
    /// Whether it is terminating or completed.
    pub terminal: bool,
    /// Its node (`spec.nodeName`), which a repair writes into the record it adopts.
    pub node: String,
    /// Its controller, which a repair writes into the record it adopts.
    pub owner: Option<OwnerRef>,
}

/// The index's hash maps: foldhash (seeded per process, so names chosen by users cannot
/// collide on purpose) is several times faster than SipHash on the short names every sweep
/// looks up once per record (docs/decisions/0002-dependencies.md).
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The index's hash sets (see [`Map`]).
type Set<K> = HashSet<K, foldhash::fast::RandomState>;

/// Objects by namespace and name, looked up without building a key.
type ByNamespace<V> = Map<String, Map<String, V>>;

fn get<'a, V>(map: &'a ByNamespace<V>, namespace: &str, name: &str) -> Option<&'a V> {
    map.get(namespace)?.get(name)
}

fn insert<V>(map: &mut ByNamespace<V>, namespace: &str, name: &str, value: V) -> Option<V> {
    map.entry(namespace.to_string()).or_default().insert(name.to_string(), value)
}

fn remove<V>(map: &mut ByNamespace<V>, namespace: &str, name: &str) -> Option<V> {
    let names = map.get_mut(namespace)?;
    let removed = names.remove(name);
    if names.is_empty() {
        map.remove(namespace);
    }
    removed
}

fn keys<V>(map: &ByNamespace<V>) -> Vec<ObjectKey> {
    map.iter()
        .flat_map(|(ns, names)| names.keys().map(|name| ObjectKey { namespace: ns.clone(), name: name.clone() }))
        .collect()
}

/// A watched kind of object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// Pods.
    Pod,
    /// Nodes.
    Node,
    /// IPClaims.
    Claim,
    /// StatefulSets.
    StatefulSet,
    /// IPBlocks.
    Block,
    /// IPPools.
    Pool,
    /// The agents' heartbeat Leases.
    AgentLease,
    /// KubeVirt's VirtualMachines.
    VirtualMachine,
    /// KubeVirt's VirtualMachineInstances.
    VirtualMachineInstance,
    /// Deployments, ReplicaSets, CronJobs and Jobs (metadata only): the workloads a
    /// list-bound record can be held for ([`WorkloadKind`]).
    Workload(WorkloadKind),
}

/// One watched object, as applied to the index.
#[derive(Clone, Copy, Debug)]
pub enum Watched<'a> {
    /// A pod.
    Pod(&'a Pod),
    /// A node.
    Node(&'a Node),
    /// An IPClaim.
    Claim(&'a IPClaim),
    /// A StatefulSet.
    StatefulSet(&'a StatefulSet),
    /// An IPBlock.
    Block(&'a Arc<IPBlock>),
    /// An IPPool.
    Pool(&'a Arc<IPPool>),
    /// An agent heartbeat Lease (labelled with its node).
    AgentLease(&'a Lease),
    /// A KubeVirt VirtualMachine's metadata.
    VirtualMachine(&'a PartialObjectMeta<DynamicObject>),
    /// A KubeVirt VirtualMachineInstance's metadata.
    VirtualMachineInstance(&'a PartialObjectMeta<DynamicObject>),
    /// A workload's metadata.
    Workload(WorkloadKind, &'a ObjectMeta),
}

/// Where an object sits in the index: its namespace (empty for cluster-scoped kinds, and for
/// agent Leases keyed by node) and name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ObjectKey {
    /// The namespace.
    pub namespace: String,
    /// The name.
    pub name: String,
}

impl Watched<'_> {
    /// The kind.
    pub fn kind(&self) -> Kind {
        match self {
            Self::Pod(_) => Kind::Pod,
            Self::Node(_) => Kind::Node,
            Self::Claim(_) => Kind::Claim,
            Self::StatefulSet(_) => Kind::StatefulSet,
            Self::Block(_) => Kind::Block,
            Self::Pool(_) => Kind::Pool,
            Self::AgentLease(_) => Kind::AgentLease,
            Self::VirtualMachine(_) => Kind::VirtualMachine,
            Self::VirtualMachineInstance(_) => Kind::VirtualMachineInstance,
            Self::Workload(kind, _) => Kind::Workload(*kind),
        }
    }

    /// Where it sits in the index; `None` for an agent Lease without its node label, or not
    /// named for that node ([`crate::agent::heartbeat::lease_name`]): only a node's own Lease
    /// is its heartbeat, not any Lease that carries its name in a label (decision 0022).
    pub fn key(&self) -> Option<ObjectKey> {
        let namespaced =
            |namespace: Option<String>, name: String| ObjectKey { namespace: namespace.unwrap_or_default(), name };
        Some(match self {
            Self::Pod(o) => namespaced(o.namespace(), o.name_any()),
            Self::Claim(o) => namespaced(o.namespace(), o.name_any()),
            Self::StatefulSet(o) => namespaced(o.namespace(), o.name_any()),
            Self::VirtualMachine(o) | Self::VirtualMachineInstance(o) => namespaced(o.namespace(), o.name_any()),
            Self::Workload(_, meta) => namespaced(meta.namespace.clone(), meta.name.clone().unwrap_or_default()),
            Self::Node(o) => namespaced(None, o.name_any()),
            Self::Block(o) => namespaced(None, o.name_any()),
            Self::Pool(o) => namespaced(None, o.name_any()),
            Self::AgentLease(o) => {
                let node = o.labels().get(crate::agent::heartbeat::NODE_LABEL)?;
                if o.name_any() != crate::agent::heartbeat::lease_name(node) {
                    return None;
                }
                namespaced(None, node.clone())
            }
        })
    }
}

/// KubeVirt objects by namespace and name: whether each is being deleted.
#[derive(Clone, Debug, Default)]
struct KubeVirtIndex {
    /// VirtualMachineInstances.
    instances: ByNamespace<bool>,
    /// VirtualMachines.
    vms: ByNamespace<bool>,
}

/// Whether object `name` of `objects` (each with whether it is being deleted) is there.
fn presence(objects: &ByNamespace<bool>, namespace: &str, name: &str) -> Presence {
    match get(objects, namespace, name) {
        None => Presence::Absent,
        Some(true) => Presence::Deleting,
        Some(false) => Presence::Live,
    }
}

fn node_state(node: &Node) -> NodeState {
    let ready =
        node.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|c| c.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) if c.status == "True" => NodeState::Ready,
        Some(c) => NodeState::NotReady(c.last_transition_time.as_ref().map_or(Timestamp::UNIX_EPOCH, |t| t.0)),
        // A node that never reported is not yet trusted to run anything; treat as NotReady.
        None => NodeState::NotReady(node.creation_timestamp().map_or(Timestamp::UNIX_EPOCH, |t| t.0)),
    }
}

/// How long the index remembers when a node was deleted.
const FORGET_DELETED_NODES: Duration = Duration::from_secs(3600);

/// The index.
#[derive(Clone, Debug, Default)]
pub struct ClusterIndex {
    /// Owner kinds whose records count as sticky; a record of another kind is not, so an
    /// owner kind removed from the list leaves ipwarden's stickiness.
    sticky_kinds: Vec<String>,
    /// Agent Leases that go unrenewed this long make their node's agent gone, unless the
    /// Lease names its own duration.
    default_agent_lease: Duration,
    pods: ByNamespace<PodFacts>,
    /// The pods reporting each IP.
    holders: Map<String, Vec<Holder>>,
    claims: ByNamespace<ClaimFacts>,
    statefulsets: ByNamespace<StatefulSetFacts>,
    kubevirt: KubeVirtIndex,
    /// The workloads list-bound records are held for, by kind: whether each is being deleted.
    workloads: HashMap<WorkloadKind, ByNamespace<bool>>,
    /// Node states by name.
    nodes: Map<String, NodeState>,
    /// When this controller saw each node deleted, on its monotonic clock (forgotten when the
    /// node comes back, or an hour later).
    nodes_deleted_at: HashMap<String, Instant>,
    /// When the index was made: a node never seen counts as deleted since then.
    created: Option<Instant>,
    /// The agent Leases by node, as last seen.
    leases: HashMap<String, AgentLease>,
    /// When this controller last saw each node's agent Lease change, on its monotonic clock.
    observed: Observations,
    /// The nodes whose agent is gone, with when its Lease went stale, as last judged
    /// ([`ClusterIndex::judge_agents`]); empty until the Leases are listed.
    stale_agents: HashMap<String, Timestamp>,
    pools: BTreeMap<String, Arc<IPPool>>,
    blocks: BTreeMap<String, Arc<IPBlock>>,
    /// Block names by the pool they name.
    blocks_of_pool: Map<String, BTreeSet<String>>,
    /// Blocks whose records no pool keeps ([`crate::ipam::pools::block_is_retired`]): orphaned
    /// blocks and the blocks of pools being deleted.
    retired: Set<String>,
    /// Each pod UID's records: (block, IP).
    /// (Usually one record a UID, so a short list, not a tree.)
    records_of_uid: Map<String, Vec<(Arc<str>, String)>>,
    /// The kinds whose first list has been applied.
    synced: BTreeSet<Kind>,
    /// The keys each relisting kind has seen since its relist started.
    relisting: Map<Kind, Set<ObjectKey>>,
}

impl ClusterIndex {
    /// An empty index judging stickiness by `sticky_kinds` and agent Leases by
    /// `default_agent_lease` where a Lease names no duration.
    pub fn new(sticky_kinds: &[String], default_agent_lease: Duration) -> Self {
        Self {
            sticky_kinds: sticky_kinds.to_vec(),
            default_agent_lease,
            created: Some(Instant::now()),
            ..Self::default()
        }
    }

    /// How long node `name` has been gone at `now`, as this controller saw it: `None` while it
    /// exists; a node never seen counts from the index's making (an index made without a clock,
    /// the CLI's, counts it gone for ever).
    pub fn node_gone_for(&self, name: &str, now: Instant) -> Option<Duration> {
        if self.nodes.contains_key(name) {
            return None;
        }
        let since = self.nodes_deleted_at.get(name).copied().or(self.created);
        Some(since.map_or(Duration::MAX, |at| now.saturating_duration_since(at)))
    }

    /// The agent Lease duration that judges agents whose Lease names none.
    pub fn default_agent_lease(&self) -> Duration {
        self.default_agent_lease
    }

    /// An index of listed objects (the CLI's), applied as a watch would apply them. Agent
    /// Leases and KubeVirt objects are not among them: every agent counts as live and a
    /// VM's reservation is kept.
    pub fn from_objects<'a>(sticky_kinds: &[String], objects: impl IntoIterator<Item = Watched<'a>>) -> Self {
        let mut index = Self::new(sticky_kinds, crate::agent::heartbeat::DEFAULT_LEASE_DURATION);
        for object in objects {
            index.apply(object);
        }
        index
    }

    /// Applies an added or changed object.
    pub fn apply(&mut self, object: Watched<'_>) {
        let Some(key) = object.key() else { return };
        if let Some(seen) = self.relisting.get_mut(&object.kind()) {
            seen.insert(key.clone());
        }
        match object {
            Watched::Pod(pod) => self.apply_pod(PodFacts::of(pod)),
            Watched::Node(node) => {
                self.nodes_deleted_at.remove(&key.name);
                self.nodes.insert(key.name, node_state(node));
            }
            Watched::Claim(claim) => {
                let witnessed = claim.status.as_ref().and_then(|s| s.witnessed.as_ref());
                let facts = ClaimFacts {
                    object_uid: claim.metadata.uid.clone().unwrap_or_default(),
                    pod_uid: claim.spec.pod_uid.clone(),
                    node: claim.spec.node.clone(),
                    owner: claim.spec.owner.clone(),
                    sticky: claim.spec.sticky,
                    interfaces: claim.spec.interfaces.clone(),
                    witnessed: witnessed.map(|w| ClaimBinding {
                        pod_uid: w.pod_uid.clone(),
                        node: w.node.clone(),
                        owner: w.owner.clone(),
                        interfaces: w.interfaces.clone(),
                    }),
                };
                insert(&mut self.claims, &key.namespace, &key.name, facts);
            }
            Watched::StatefulSet(sts) => {
                insert(&mut self.statefulsets, &key.namespace, &key.name, crate::owners::statefulset_facts(sts));
            }
            Watched::Block(block) => self.apply_block(block.clone()),
            Watched::Pool(pool) => {
                self.pools.insert(key.name.clone(), pool.clone());
                self.judge_blocks_of(&key.name);
            }
            Watched::AgentLease(lease) => {
                let version = lease.resource_version();
                let duration = lease
                    .spec
                    .as_ref()
                    .and_then(|s| s.lease_duration_seconds)
                    .and_then(|s| u64::try_from(s).ok())
                    .map(Duration::from_secs);
                self.leases.insert(key.name, AgentLease { version: version.unwrap_or_default(), duration });
            }
            Watched::VirtualMachine(vm) => {
                insert(&mut self.kubevirt.vms, &key.namespace, &key.name, vm.metadata.deletion_timestamp.is_some());
            }
            Watched::VirtualMachineInstance(vmi) => {
                let deleting = vmi.metadata.deletion_timestamp.is_some();
                insert(&mut self.kubevirt.instances, &key.namespace, &key.name, deleting);
            }
            Watched::Workload(kind, meta) => {
                let deleting = meta.deletion_timestamp.is_some();
                insert(self.workloads.entry(kind).or_default(), &key.namespace, &key.name, deleting);
            }
        }
    }

    /// Applies a deleted object.
    pub fn delete(&mut self, object: Watched<'_>) {
        if let Some(key) = object.key() {
            self.remove(object.kind(), &key);
        }
    }

    /// Starts a relist of `kind`: what it does not list again before
    /// [`ClusterIndex::relist_done`] is gone.
    pub fn relist_started(&mut self, kind: Kind) {
        self.relisting.insert(kind, Set::default());
    }

    /// Ends a relist of `kind`: removes what it did not list, and counts the kind as
    /// synced.
    pub fn relist_done(&mut self, kind: Kind) {
        if let Some(seen) = self.relisting.remove(&kind) {
            for key in self.keys(kind).into_iter().filter(|k| !seen.contains(k)) {
                self.remove(kind, &key);
            }
        }
        self.synced.insert(kind);
    }

    /// Whether every kind in `kinds` has been listed once.
    pub fn synced(&self, kinds: &[Kind]) -> bool {
        kinds.iter().all(|k| self.synced.contains(k))
    }

    fn keys(&self, kind: Kind) -> Vec<ObjectKey> {
        let cluster = |names: Vec<&String>| -> Vec<ObjectKey> {
            names.into_iter().map(|n| ObjectKey { namespace: String::new(), name: n.clone() }).collect()
        };
        match kind {
            Kind::Pod => keys(&self.pods),
            Kind::Claim => keys(&self.claims),
            Kind::StatefulSet => keys(&self.statefulsets),
            Kind::VirtualMachine => keys(&self.kubevirt.vms),
            Kind::VirtualMachineInstance => keys(&self.kubevirt.instances),
            Kind::Workload(kind) => self.workloads.get(&kind).map(keys).unwrap_or_default(),
            Kind::Node => cluster(self.nodes.keys().collect()),
            Kind::Block => cluster(self.blocks.keys().collect()),
            Kind::Pool => cluster(self.pools.keys().collect()),
            Kind::AgentLease => cluster(self.leases.keys().collect()),
        }
    }

    fn remove(&mut self, kind: Kind, key: &ObjectKey) {
        match kind {
            Kind::Pod => {
                if let Some(old) = remove(&mut self.pods, &key.namespace, &key.name) {
                    self.forget_holder(&old);
                }
            }
            Kind::Node => {
                if self.nodes.remove(&key.name).is_some() {
                    self.nodes_deleted_at.insert(key.name.clone(), Instant::now());
                }
            }
            Kind::Claim => {
                remove(&mut self.claims, &key.namespace, &key.name);
            }
            Kind::StatefulSet => {
                remove(&mut self.statefulsets, &key.namespace, &key.name);
            }
            Kind::Block => {
                if let Some(old) = self.blocks.remove(&key.name) {
                    self.forget_block(&old);
                }
            }
            Kind::Pool => {
                self.pools.remove(&key.name);
                self.judge_blocks_of(&key.name);
            }
            Kind::AgentLease => {
                self.leases.remove(&key.name);
            }
            Kind::VirtualMachine => {
                remove(&mut self.kubevirt.vms, &key.namespace, &key.name);
            }
            Kind::VirtualMachineInstance => {
                remove(&mut self.kubevirt.instances, &key.namespace, &key.name);
            }
            Kind::Workload(kind) => {
                if let Some(objects) = self.workloads.get_mut(&kind) {
                    remove(objects, &key.namespace, &key.name);
                }
            }
        }
    }

    fn apply_pod(&mut self, facts: PodFacts) {
        if let Some(old) = get(&self.pods, &facts.namespace, &facts.name) {
            if *old == facts {
                return;
            }
            let old = old.clone();
            self.forget_holder(&old);
        }
        let holder = Holder {
            pod: facts.pod_ref(),
            terminal: facts.terminal(),
            node: facts.node.clone(),
            owner: facts.owner.clone(),
        };
        for ip in &facts.ips {
            self.holders.entry(ip.clone()).or_default().push(holder.clone());
        }
        let (namespace, name) = (facts.namespace.clone(), facts.name.clone());
        insert(&mut self.pods, &namespace, &name, facts);
    }

    fn forget_holder(&mut self, old: &PodFacts) {
        for ip in &old.ips {
            if let Some(holders) = self.holders.get_mut(ip) {
                holders.retain(|h| !(h.pod.namespace == old.namespace && h.pod.name == old.name));
                if holders.is_empty() {
                    self.holders.remove(ip);
                }
            }
        }
    }

    fn apply_block(&mut self, block: Arc<IPBlock>) {
        let name = block.name_any();
        if let Some(old) = self.blocks.remove(&name) {
            self.forget_block(&old);
        }
        let shared: Arc<str> = Arc::from(name.as_str());
        for (ip, record) in &block.spec.allocations {
            self.records_of_uid.entry(record.pod.uid.clone()).or_default().push((shared.clone(), ip.clone()));
        }
        self.blocks_of_pool.entry(block.spec.pool.clone()).or_default().insert(name.clone());
        let retired = self.judge(&block);
        self.set_retired(&name, retired);
        self.blocks.insert(name, block);
    }

    fn forget_block(&mut self, old: &IPBlock) {
        let name = old.name_any();
        for (ip, record) in &old.spec.allocations {
            if let Some(records) = self.records_of_uid.get_mut(&record.pod.uid) {
                records.retain(|(block, at)| !(**block == *name && at == ip));
                if records.is_empty() {
                    self.records_of_uid.remove(&record.pod.uid);
                }
            }
        }
        if let Some(blocks) = self.blocks_of_pool.get_mut(&old.spec.pool) {
            blocks.remove(&name);
            if blocks.is_empty() {
                self.blocks_of_pool.remove(&old.spec.pool);
            }
        }
        self.retired.remove(&name);
    }

    fn judge(&self, block: &IPBlock) -> bool {
        let pool = self.pools.get(&block.spec.pool).map(|p| (&p.spec, p.metadata.deletion_timestamp.is_some()));
        crate::ipam::pools::block_is_retired(pool, &block.spec.cidr)
    }

    fn judge_blocks_of(&mut self, pool: &str) {
        let names: Vec<String> = self.blocks_of_pool.get(pool).into_iter().flatten().cloned().collect();
        for name in names {
            let retired = self.blocks.get(&name).is_some_and(|b| self.judge(b));
            self.set_retired(&name, retired);
        }
    }

    fn set_retired(&mut self, block: &str, retired: bool) {
        if retired {
            self.retired.insert(block.to_string());
        } else {
            self.retired.remove(block);
        }
    }

    /// Judges every node's agent at `now` (this controller's monotonic clock; `wall` read at
    /// the same moment): an agent whose Lease this controller has seen unchanged (or missing)
    /// for a whole Lease duration is gone ([`stale_agents`]). The controller calls it every
    /// second once the Leases are listed; until then every agent counts as live.
    pub fn judge_agents(&mut self, now: Instant, wall: Timestamp) {
        if !self.synced.contains(&Kind::AgentLease) {
            return;
        }
        self.nodes_deleted_at.retain(|_, at| now.saturating_duration_since(*at) < FORGET_DELETED_NODES);
        let nodes = self.nodes.keys().map(String::as_str);
        self.stale_agents = stale_agents(nodes, &self.leases, &mut self.observed, self.default_agent_lease, now, wall);
    }

    /// How many workload kinds have not been listed yet (RBAC not granting them, a kind not
    /// served): until then their workloads live, and no list reservation of theirs goes.
    pub fn unlisted_workload_kinds(&self) -> usize {
        WorkloadKind::ALL.into_iter().filter(|k| !self.synced(&[Kind::Workload(*k)])).count()
    }

    /// How many nodes have no live agent, as last judged.
    pub fn nodes_without_live_agent(&self) -> usize {
        self.stale_agents.len()
    }

    /// The state of node `name`: a Ready node whose agent is gone counts as NotReady since
    /// its Lease went stale, since its agent cannot answer the release handshake.
    pub fn node(&self, name: &str) -> NodeState {
        match self.nodes.get(name) {
            None => NodeState::Deleted,
            Some(NodeState::Ready) => self.stale_agents.get(name).map_or(NodeState::Ready, |t| NodeState::NotReady(*t)),
            Some(state) => *state,
        }
    }

    /// The state of the record's node (Ready when the record names none).
    fn node_of(&self, record: &Allocation) -> NodeState {
        if record.node.is_empty() { NodeState::Ready } else { self.node(&record.node) }
    }

    /// The facts of pod `namespace`/`name`.
    pub fn pod(&self, namespace: &str, name: &str) -> Option<&PodFacts> {
        get(&self.pods, namespace, name)
    }

    /// The pods, trimmed.
    pub fn pods(&self) -> impl Iterator<Item = &PodFacts> {
        self.pods.values().flat_map(HashMap::values)
    }

    /// How many pods the index holds.
    pub fn pod_count(&self) -> usize {
        self.pods.values().map(HashMap::len).sum()
    }

    /// The claims by namespace and name.
    pub fn claims(&self) -> impl Iterator<Item = (&str, &str, &ClaimFacts)> {
        self.claims.iter().flat_map(|(ns, names)| names.iter().map(move |(n, c)| (ns.as_str(), n.as_str(), c)))
    }

    /// Claim `namespace/name`, when the index holds one.
    pub fn claim(&self, namespace: &str, name: &str) -> Option<&ClaimFacts> {
        get(&self.claims, namespace, name)
    }

    /// The pools.
    pub fn pools(&self) -> Vec<Arc<IPPool>> {
        self.pools.values().cloned().collect()
    }

    /// The owner kinds whose records count as sticky.
    pub fn sticky_kinds(&self) -> &[String] {
        &self.sticky_kinds
    }

    /// Whether some block names pool `pool` (a gone pool's blocks are still released
    /// through it).
    pub fn has_blocks_of(&self, pool: &str) -> bool {
        self.blocks_of_pool.contains_key(pool)
    }

    /// Pool `name`.
    pub fn pool(&self, name: &str) -> Option<&Arc<IPPool>> {
        self.pools.get(name)
    }

    /// The blocks, by name.
    pub fn blocks(&self) -> Vec<Arc<IPBlock>> {
        self.blocks.values().cloned().collect()
    }

    /// The blocks by name, for a walk over every record.
    pub fn blocks_by_name(&self) -> &BTreeMap<String, Arc<IPBlock>> {
        &self.blocks
    }

    /// Block `name`.
    pub fn block(&self, name: &str) -> Option<&Arc<IPBlock>> {
        self.blocks.get(name)
    }

    /// Whether block `name` is retired: no pool keeps its records (its pool is gone, being
    /// deleted, or no longer has such a block), so no sticky reservation is kept in it.
    pub fn retired(&self, block: &str) -> bool {
        self.retired.contains(block)
    }

    /// The records naming pod UID `uid`, with their blocks.
    pub fn records_of<'a>(
        &'a self,
        uid: &str,
    ) -> impl Iterator<Item = (&'a Arc<IPBlock>, &'a str, &'a Allocation)> + 'a {
        self.records_of_uid.get(uid).into_iter().flatten().filter_map(|(block, ip)| {
            let block = self.blocks.get(&**block)?;
            let (ip, record) = block.spec.allocations.get_key_value(ip)?;
            Some((block, ip.as_str(), record))
        })
    }

    /// The pods reporting `ip`.
    pub fn holders(&self, ip: &str) -> &[Holder] {
        self.holders.get(ip).map_or(&[], Vec::as_slice)
    }

    /// The pod holding `ip`: a non-terminal pod reporting it, else a terminal one.
    pub fn live_holder(&self, ip: &str) -> Option<&Holder> {
        let holders = self.holders(ip);
        holders.iter().find(|h| !h.terminal).or_else(|| holders.first())
    }

    /// Whether a sticky record's owner still wants it, by [`workload::owner_wants`] on the
    /// watched owner.
    pub fn owner_wants(&self, record: &Allocation) -> bool {
        let Some(owner) = record.owner.as_ref() else { return false };
        self.wants(&record.pod.namespace, owner, &record.pod.name)
    }

    /// Whether `owner` (in `namespace`) still wants the IPs of its pod `pod_name`, by
    /// [`workload::owner_wants`] on the watched owner. Until KubeVirt's kinds are watched, a
    /// VM's wishes are unknown (and its reservations kept).
    pub fn wants(&self, namespace: &str, owner: &OwnerRef, pod_name: &str) -> bool {
        workload::owner_wants(&owner.name, pod_name, self.owner_facts(namespace, owner))
    }

    /// Whether the record is a list reservation ([`workload::list_reservation_for`]) of a
    /// workload that still lives, by [`workload::workload_lives`] on the watched workload.
    /// Until its kind is listed, it lives.
    pub fn list_held(&self, record: &Allocation) -> bool {
        let Some(held_for) = workload::list_reservation_for(record, false) else { return false };
        workload::workload_lives(self.owner_facts(&record.pod.namespace, held_for))
    }

    /// What the watches say of `owner` in `namespace`; [`OwnerFacts::Unknown`] for a kind
    /// not watched, or not listed yet.
    fn owner_facts(&self, namespace: &str, owner: &OwnerRef) -> OwnerFacts {
        match owner.kind.as_str() {
            "StatefulSet" => OwnerFacts::StatefulSet(get(&self.statefulsets, namespace, &owner.name).copied()),
            KUBEVIRT_VMI_KIND if self.synced(&[Kind::VirtualMachine, Kind::VirtualMachineInstance]) => {
                OwnerFacts::VirtualMachine {
                    instance: presence(&self.kubevirt.instances, namespace, &owner.name),
                    vm: presence(&self.kubevirt.vms, namespace, &owner.name),
                }
            }
            kind => match WorkloadKind::of(kind) {
                Some(kind) if self.synced(&[Kind::Workload(kind)]) => {
                    let objects = self.workloads.get(&kind);
                    OwnerFacts::Workload(objects.map_or(Presence::Absent, |o| presence(o, namespace, &owner.name)))
                }
                _ => OwnerFacts::Unknown,
            },
        }
    }

    /// Whether the record's node has an agent that can answer the release handshake: the
    /// record names a node, and that node exists, is Ready and has a live agent Lease.
    pub fn agent_can_answer(&self, record: &Allocation) -> bool {
        !record.node.is_empty() && self.node(&record.node) == NodeState::Ready
    }

    /// The live pod reporting `ip`, as a repair writes it into the record it adopts.
    pub fn adopter(&self, ip: &str) -> Option<Adopter> {
        let holder = self.live_holder(ip)?;
        Some(Adopter {
            pod: holder.pod.clone(),
            node: holder.node.clone(),
            owner: holder.owner.clone(),
            sticky: workload::is_sticky(holder.owner.as_ref(), &self.sticky_kinds),
        })
    }

    /// Why the record's migration target is backed by no pod in the cache
    /// ([`workload::target_unbacked`]); `None` when it is, or the record has no target. The
    /// cache may lag a target just attached: the write re-reads the pod live. A target on a
    /// NotReady node is kept as long as the NotReady policy keeps that node's records: a
    /// partitioned node may still run a force-deleted target's sandbox.
    pub fn target_unbacked(
        &self,
        record: &Allocation,
        now: Timestamp,
        settings: &RuleSettings,
    ) -> Option<&'static str> {
        let target = record.migration_target.as_ref()?;
        if let NodeState::NotReady(since) = self.node(&target.node)
            && not_ready_gate(since, settings.not_ready, now) != NotReadyGate::Open
        {
            return None;
        }
        let pod = self.pod(&target.pod.namespace, &target.pod.name);
        workload::target_unbacked(record.owner.as_ref(), target, pod.map(PodFacts::as_target))
    }

    /// The controller's step for a record an agent marked for a sticky takeover; `None`
    /// when the record carries no such mark.
    pub fn takeover_step(&self, record: &Allocation, now: Timestamp, settings: &RuleSettings) -> Option<TakeoverStep> {
        let handshake = record.release_handshake.as_ref()?;
        let takeover = handshake.takeover.as_ref()?;
        let waiting = self
            .pod(&takeover.pod.namespace, &takeover.pod.name)
            .is_some_and(|p| p.ips.is_empty() && claimant_refusal(record, takeover, Some(p)).is_none());
        let detached = !may_be_attached(record);
        Some(controller_takeover_step(
            handshake.state,
            waiting,
            detached,
            self.node_of(record),
            settings.not_ready,
            now,
        ))
    }

    /// The verdict at `now` for the record of `ip` in block `block`. In a retired block a
    /// sticky record is an ordinary one: it goes with its pod, whatever its owner wants.
    pub fn evaluate<'a>(
        &'a self,
        block: &str,
        ip: &'a str,
        record: &'a Allocation,
        now: Timestamp,
        settings: &RuleSettings,
    ) -> Verdict<'a> {
        let sticky = workload::record_is_sticky(record, &self.sticky_kinds) && !self.retired(block);
        let claim_name = workload::claim_name(&record.pod.name, record.owner.as_ref());
        // The pod the claim is bound to in effect: a successor of the record's name when it
        // holds sticky records of the claim (its ADD took them back; the claim janitor writes
        // that binding down about a second later), else the witness's, else the spec's.
        let claim_uid = get(&self.claims, &record.pod.namespace, &claim_name).map(|c| {
            let successor = self.pod(&record.pod.namespace, &record.pod.name).filter(|p| {
                p.uid != record.pod.uid
                    && self.records_of(&p.uid).any(|(_, _, r)| {
                        r.sticky
                            && r.pod.namespace == record.pod.namespace
                            && workload::claim_name(&r.pod.name, r.owner.as_ref()) == claim_name
                    })
            });
            match (successor, &c.witnessed) {
                (Some(pod), _) => pod.uid.as_str(),
                (None, Some(witnessed)) => witnessed.pod_uid.as_str(),
                (None, None) => c.pod_uid.as_str(),
            }
        });
        let facts = Facts {
            record: RecordView {
                ip,
                pod_uid: &record.pod.uid,
                node: &record.node,
                sticky,
                has_claim: workload::has_claim(record),
            },
            pod: self.pod(&record.pod.namespace, &record.pod.name).map(|p| PodView {
                uid: &p.uid,
                phase: p.phase,
                deletion: p.deletion,
                ips: &p.ips,
            }),
            claim_uid,
            owner_wants: sticky && self.owner_wants(record),
            list_held: !self.retired(block) && self.list_held(record),
            node: self.node_of(record),
            // A live migration's target reporting the IP holds it for the record, as its source does.
            holder: self.live_holder(ip).map(|h| IpHolder {
                uid: if crate::ipam::blocks::names_pod(record, &h.pod.uid) { &record.pod.uid } else { &h.pod.uid },
                terminal: h.terminal,
            }),
            now,
        };
        decide(&facts, settings)
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::gc::rules::{KeepReason, NotReadyPolicy, ReleaseReason};
    use serde_json::json;

    const SECOND: jiff::SignedDuration = jiff::SignedDuration::from_secs(1);

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_780_000_000 + seconds).expect("timestamp")
    }

    fn record(name: &str, uid: &str, node: &str) -> Allocation {
        serde_json::from_value(json!({
            "pod": {"namespace": "ns", "name": name, "uid": uid}, "node": node, "network": "n",
            "containerId": "c", "interface": "eth0", "allocatedAt": "2026-01-01T00:00:00Z",
        }))
        .expect("record")
    }

    fn node(name: &str, ready: bool) -> Node {
        serde_json::from_value(json!({"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready",
            "status": if ready { "True" } else { "False" }, "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}))
        .expect("node")
    }

    fn lease(node: &str, version: &str) -> Lease {
        serde_json::from_value(
            json!({"metadata": {"name": crate::agent::heartbeat::lease_name(node), "namespace": "ipwarden",
            "resourceVersion": version, "labels": {crate::agent::heartbeat::NODE_LABEL: node}},
            "spec": {"leaseDurationSeconds": 20}}),
        )
        .expect("lease")
    }

    fn pod(name: &str, uid: &str, ips: &[&str], phase: &str) -> Pod {
        serde_json::from_value(json!({"metadata": {"namespace": "ns", "name": name, "uid": uid},
            "spec": {"nodeName": "n1", "containers": []},
            "status": {"phase": phase, "podIPs": ips.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>()}}))
        .expect("pod")
    }

    fn block(name: &str, pool: &str, cidr: &str, records: &[(&str, Allocation)]) -> Arc<IPBlock> {
        let allocations: serde_json::Map<String, serde_json::Value> =
            records.iter().map(|(ip, r)| (ip.to_string(), serde_json::to_value(r).expect("record"))).collect();
        Arc::new(
            serde_json::from_value(json!({"apiVersion": "ipwarden.io/v1alpha1", "kind": "IPBlock",
                "metadata": {"name": name}, "spec": {"pool": pool, "cidr": cidr, "allocations": allocations}}))
            .expect("block"),
        )
    }

    fn pool(name: &str, cidr: &str, deleting: bool) -> Arc<IPPool> {
        let mut pool: IPPool = serde_json::from_value(json!({"apiVersion": "ipwarden.io/v1alpha1", "kind": "IPPool",
            "metadata": {"name": name}, "spec": {"cidr": cidr, "blockSize": 24}}))
        .expect("pool");
        pool.metadata.deletion_timestamp =
            deleting.then(|| k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(0)));
        Arc::new(pool)
    }

    #[test]
    fn a_node_counts_as_gone_from_its_deletion_and_one_never_seen_from_the_index_start() {
        let mut index = ClusterIndex::new(&[], Duration::from_secs(20));
        let start = Instant::now();
        index.apply(Watched::Node(&node("n", true)));
        assert_eq!(index.node_gone_for("n", start), None, "it exists");
        index.delete(Watched::Node(&node("n", true)));
        let later = Instant::now() + Duration::from_secs(30);
        assert!(index.node_gone_for("n", later).is_some_and(|d| d >= Duration::from_secs(30)));
        assert!(index.node_gone_for("n", Instant::now()).is_some_and(|d| d < Duration::from_secs(30)));
        index.apply(Watched::Node(&node("n", true)));
        assert_eq!(index.node_gone_for("n", later), None, "it came back");
        assert!(index.node_gone_for("never", later).is_some_and(|d| d >= Duration::from_secs(30)), "since the start");
        let cli = ClusterIndex::default();
        assert_eq!(cli.node_gone_for("never", later), Some(Duration::MAX));
    }

    #[test]
    fn only_the_lease_named_for_its_node_is_that_nodes_heartbeat() {
        let own = lease("n1", "1");
        assert_eq!(Watched::AgentLease(&own).key().map(|k| k.name), Some("n1".to_string()));
        let mut decoy = lease("n1", "1");
        decoy.metadata.name = Some("decoy-of-n1".to_string());
        assert_eq!(Watched::AgentLease(&decoy).key(), None, "a decoy labelled n1 is nobody's heartbeat");
        let mut other = lease("n1", "1");
        other.metadata.name = Some(crate::agent::heartbeat::lease_name("n2"));
        assert_eq!(Watched::AgentLease(&other).key(), None, "n2's name with n1's label: neither's");
    }

    #[test]
    fn a_ready_node_whose_agent_is_gone_follows_the_not_ready_policy_from_when_its_lease_went_stale() {
        let mut index = ClusterIndex::new(&[], Duration::from_secs(20));
        for name in ["dead-agent", "live-agent", "no-lease"] {
            index.apply(Watched::Node(&node(name, true)));
        }
        index.apply(Watched::Node(&node("not-ready", false)));
        let start = Instant::now();
        let judge = |index: &mut ClusterIndex, seconds: u64| {
            index.judge_agents(start + Duration::from_secs(seconds), at(i64::try_from(seconds).expect("seconds")));
        };
        judge(&mut index, 100);
        assert_eq!(index.node("dead-agent"), NodeState::Ready, "not judged before the Leases are listed");
        index.relist_started(Kind::AgentLease);
        for name in ["dead-agent", "live-agent", "not-ready"] {
            index.apply(Watched::AgentLease(&lease(name, "1")));
        }
        index.relist_done(Kind::AgentLease);
        judge(&mut index, 0);
        judge(&mut index, 19);
        assert!(index.agent_can_answer(&record("gone", "u", "dead-agent")), "live within its duration");
        // A relist that lists the same version is no renewal; a new version is.
        index.apply(Watched::AgentLease(&lease("dead-agent", "1")));
        index.apply(Watched::AgentLease(&lease("live-agent", "2")));
        judge(&mut index, 40);
        judge(&mut index, 50);
        let stale_since = at(20);
        assert!(index.agent_can_answer(&record("gone", "u", "live-agent")));
        assert!(!index.agent_can_answer(&record("gone", "u", "dead-agent")), "no handshake with a gone agent");
        assert_eq!(index.node("dead-agent"), NodeState::NotReady(stale_since));
        assert_eq!(index.node("no-lease"), NodeState::NotReady(stale_since), "never had one: gone too");
        let not_ready_since = Timestamp::from_second(1_767_225_600).expect("2026-01-01");
        assert_eq!(index.node("not-ready"), NodeState::NotReady(not_ready_since), "NotReady keeps its own since");
        assert_eq!(index.node("deleted"), NodeState::Deleted, "a deleted node stays deleted");
        assert_eq!(index.nodes_without_live_agent(), 3);

        let now = at(50);
        let keep = RuleSettings { additional_delay: Duration::ZERO, not_ready: NotReadyPolicy::Keep };
        let dead = record("gone", "u", "dead-agent");
        assert_eq!(index.evaluate("b", "10.0.0.1", &dead, now, &keep), Verdict::Keep(KeepReason::NodeNotReady));
        let release =
            |secs| RuleSettings { not_ready: NotReadyPolicy::ReleaseAfter(Duration::from_secs(secs)), ..keep };
        let verdict = index.evaluate("b", "10.0.0.1", &dead, now, &release(10));
        assert!(matches!(verdict, Verdict::Release { reason: ReleaseReason::NodeNotReady, .. }), "{verdict:?}");
        let verdict = index.evaluate("b", "10.0.0.1", &dead, now, &release(60));
        assert_eq!(verdict, Verdict::TraceUntil(stale_since + 60 * SECOND));

        // A deleted Lease counts as missing from then on; a deleted node is forgotten, and
        // one re-created under the same name is observed afresh.
        index.delete(Watched::AgentLease(&lease("live-agent", "2")));
        judge(&mut index, 60);
        judge(&mut index, 79);
        assert!(index.agent_can_answer(&record("gone", "u", "live-agent")), "missing for 19 s");
        judge(&mut index, 81);
        assert!(!index.agent_can_answer(&record("gone", "u", "live-agent")));
        index.delete(Watched::Node(&node("dead-agent", true)));
        judge(&mut index, 90);
        index.apply(Watched::Node(&node("dead-agent", true)));
        judge(&mut index, 91);
        assert!(index.agent_can_answer(&record("gone", "u", "dead-agent")), "a new node starts live");
    }

    #[test]
    fn a_vm_record_is_kept_while_its_vm_is_there_or_kubevirt_unwatched_and_released_once_the_vm_is_gone() {
        let mut vm_record = record("virt-launcher-vm1-x", "u", "n");
        vm_record.sticky = true;
        vm_record.owner = Some(OwnerRef { kind: KUBEVIRT_VMI_KIND.into(), name: "vm1".into() });
        let settings = RuleSettings { additional_delay: Duration::ZERO, not_ready: NotReadyPolicy::Keep };
        let vm = |deleting: bool| {
            let deletion = deleting.then(|| k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(0)));
            let meta: PartialObjectMeta<DynamicObject> = serde_json::from_value(json!({"apiVersion": "kubevirt.io/v1",
                "kind": "VirtualMachine", "metadata": {"namespace": "ns", "name": "vm1", "deletionTimestamp": deletion}}))
            .expect("metadata");
            meta
        };
        let mut index = ClusterIndex::new(&[KUBEVIRT_VMI_KIND.to_string()], Duration::from_secs(20));
        index.apply(Watched::Node(&node("n", true)));
        let kept = Verdict::Keep(KeepReason::StickyReservation);
        assert_eq!(index.evaluate("b", "10.0.0.1", &vm_record, at(0), &settings), kept, "KubeVirt not watched");
        for kind in [Kind::VirtualMachine, Kind::VirtualMachineInstance] {
            index.relist_started(kind);
        }
        index.apply(Watched::VirtualMachine(&vm(false)));
        assert_eq!(index.evaluate("b", "10.0.0.1", &vm_record, at(0), &settings), kept, "not yet synced");
        for kind in [Kind::VirtualMachine, Kind::VirtualMachineInstance] {
            index.relist_done(kind);
        }
        assert_eq!(index.evaluate("b", "10.0.0.1", &vm_record, at(0), &settings), kept, "a stopped VM");
        index.apply(Watched::VirtualMachine(&vm(true)));
        let verdict = index.evaluate("b", "10.0.0.1", &vm_record, at(1), &settings);
        assert!(matches!(verdict, Verdict::Release { reason: ReleaseReason::PodGone, .. }), "deleting: {verdict:?}");
        index.delete(Watched::VirtualMachine(&vm(true)));
        let verdict = index.evaluate("b", "10.0.0.1", &vm_record, at(2), &settings);
        assert!(matches!(verdict, Verdict::Release { reason: ReleaseReason::PodGone, .. }), "gone: {verdict:?}");
    }

    #[test]
    fn a_list_bound_record_is_kept_detached_while_its_deployment_lives_or_is_unlisted_and_released_once_it_goes() {
        let mut held = record("api-7c9f-x2x4q", "u", "n");
        held.held_for = Some(OwnerRef { kind: "Deployment".into(), name: "api".into() });
        // Its DEL lost, the record is still attached: no reservation, whatever the workload.
        let attached = held.clone();
        held.container_id.clear();
        let settings = RuleSettings { additional_delay: Duration::ZERO, not_ready: NotReadyPolicy::Keep };
        let deployment = |deleting: bool| ObjectMeta {
            namespace: Some("ns".into()),
            name: Some("api".into()),
            deletion_timestamp: deleting.then(|| k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(0))),
            ..ObjectMeta::default()
        };
        let kind = Kind::Workload(WorkloadKind::Deployment);
        let mut index = ClusterIndex::new(&[], Duration::from_secs(20));
        index.apply(Watched::Node(&node("n", true)));
        // The verdict as a keep reason, or the other verdict described.
        let verdict = |index: &ClusterIndex| match index.evaluate("b", "10.0.0.1", &held, at(1), &settings) {
            Verdict::Keep(reason) => Ok(reason),
            other => Err(format!("{other:?}")),
        };
        let kept = Ok(KeepReason::ListReservation);
        assert_eq!(verdict(&index), kept, "Deployments not listed yet");
        assert_eq!(index.unlisted_workload_kinds(), WorkloadKind::ALL.len());
        index.relist_started(kind);
        index.apply(Watched::Workload(WorkloadKind::Deployment, &deployment(false)));
        index.relist_done(kind);
        assert_eq!(verdict(&index), kept, "the Deployment lives");
        assert_eq!(index.unlisted_workload_kinds(), WorkloadKind::ALL.len() - 1, "Deployments listed");
        let lost_del = index.evaluate("b", "10.0.0.1", &attached, at(1), &settings);
        assert!(matches!(lost_del, Verdict::Release { reason: ReleaseReason::PodGone, .. }), "{lost_del:?}");
        index.apply(Watched::Workload(WorkloadKind::Deployment, &deployment(true)));
        assert!(verdict(&index).is_err_and(|v| v.contains("PodGone")), "deleting: {:?}", verdict(&index));
        index.delete(Watched::Workload(WorkloadKind::Deployment, &deployment(true)));
        assert!(verdict(&index).is_err_and(|v| v.contains("PodGone")), "gone: {:?}", verdict(&index));
    }

    #[test]
    fn pod_events_move_the_ip_holders_and_a_live_holder_wins_over_a_terminal_one() {
        let mut index = ClusterIndex::default();
        index.apply(Watched::Pod(&pod("a", "ua", &["10.0.0.1"], "Running")));
        assert_eq!(index.live_holder("10.0.0.1").map(|h| h.pod.name.as_str()), Some("a"));
        index.apply(Watched::Pod(&pod("a", "ua", &["10.0.0.2"], "Running")));
        assert!(index.holders("10.0.0.1").is_empty(), "the old IP is forgotten");
        index.apply(Watched::Pod(&pod("done", "ud", &["10.0.0.2"], "Succeeded")));
        index.apply(Watched::Pod(&pod("a", "ua", &["10.0.0.2"], "Running")));
        assert_eq!(index.holders("10.0.0.2").len(), 2);
        assert_eq!(index.live_holder("10.0.0.2").map(|h| h.pod.name.as_str()), Some("a"), "live before terminal");
        index.delete(Watched::Pod(&pod("a", "ua", &[], "Running")));
        assert_eq!(index.live_holder("10.0.0.2").map(|h| h.pod.name.as_str()), Some("done"));
        assert!(index.pod("ns", "a").is_none());
        assert_eq!(index.pod_count(), 1);
    }

    #[test]
    fn block_events_keep_the_records_of_each_uid() {
        let mut index = ClusterIndex::default();
        let one = block("p-a", "p", "10.0.0.0/24", &[("10.0.0.1", record("a", "ua", "n1"))]);
        index.apply(Watched::Block(&one));
        let found = |index: &ClusterIndex, uid: &str| -> Vec<String> {
            index.records_of(uid).map(|(b, ip, _)| format!("{}:{ip}", b.name_any())).collect()
        };
        assert_eq!(found(&index, "ua"), ["p-a:10.0.0.1"]);
        let moved = block(
            "p-a",
            "p",
            "10.0.0.0/24",
            &[("10.0.0.2", record("a", "ua", "n1")), ("10.0.0.3", record("b", "ub", "n1"))],
        );
        index.apply(Watched::Block(&moved));
        assert_eq!(found(&index, "ua"), ["p-a:10.0.0.2"], "the edited block's old records are forgotten");
        assert_eq!(found(&index, "ub"), ["p-a:10.0.0.3"]);
        index.delete(Watched::Block(&moved));
        assert!(found(&index, "ua").is_empty() && found(&index, "ub").is_empty());
    }

    #[test]
    fn a_block_is_retired_while_its_pool_is_gone_deleting_or_of_another_layout() {
        let mut index = ClusterIndex::default();
        let b = block("p-10-0-0-0-24", "p", "10.0.0.0/24", &[]);
        index.apply(Watched::Block(&b));
        assert!(index.retired("p-10-0-0-0-24"), "no pool");
        index.apply(Watched::Pool(&pool("p", "10.0.0.0/16", false)));
        assert!(!index.retired("p-10-0-0-0-24"), "its pool");
        index.apply(Watched::Pool(&pool("p", "10.0.0.0/16", true)));
        assert!(index.retired("p-10-0-0-0-24"), "its pool is being deleted");
        index.delete(Watched::Pool(&pool("p", "10.0.0.0/16", true)));
        index.apply(Watched::Pool(&pool("p", "10.1.0.0/16", false)));
        assert!(index.retired("p-10-0-0-0-24"), "a pool of that name over other addresses");
    }

    #[test]
    fn a_relist_forgets_what_it_no_longer_lists() {
        let mut index = ClusterIndex::default();
        index.apply(Watched::Pod(&pod("a", "ua", &["10.0.0.1"], "Running")));
        index.apply(Watched::Pod(&pod("b", "ub", &["10.0.0.2"], "Running")));
        assert!(!index.synced(&[Kind::Pod]));
        index.relist_started(Kind::Pod);
        index.apply(Watched::Pod(&pod("b", "ub", &["10.0.0.2"], "Running")));
        index.relist_done(Kind::Pod);
        assert!(index.synced(&[Kind::Pod]));
        assert!(index.pod("ns", "a").is_none() && index.holders("10.0.0.1").is_empty(), "deleted while unwatched");
        assert!(index.pod("ns", "b").is_some());
    }

    #[test]
    fn a_sticky_record_in_a_retired_block_is_judged_as_an_ordinary_one() {
        let sticky = ["StatefulSet".to_string()];
        let web: StatefulSet = serde_json::from_value(json!({"metadata": {"namespace": "ns", "name": "web"},
            "spec": {"replicas": 1, "serviceName": "web", "selector": {}, "template": {}}}))
        .expect("sts");
        let mut reservation = record("web-0", "u-old", "n1");
        reservation.sticky = true;
        reservation.owner = Some(OwnerRef { kind: "StatefulSet".into(), name: "web".into() });
        let mut index =
            ClusterIndex::from_objects(&sticky, [Watched::StatefulSet(&web), Watched::Node(&node("n1", true))]);
        let b = block("p-10-0-0-0-24", "p", "10.0.0.0/24", &[("10.0.0.7", reservation.clone())]);
        index.apply(Watched::Pool(&pool("p", "10.0.0.0/16", false)));
        index.apply(Watched::Block(&b));
        let settings = RuleSettings { additional_delay: Duration::ZERO, not_ready: NotReadyPolicy::Keep };
        let verdict = index.evaluate("p-10-0-0-0-24", "10.0.0.7", &reservation, at(0), &settings);
        assert_eq!(verdict, Verdict::Keep(KeepReason::StickyReservation));
        index.apply(Watched::Pool(&pool("p", "10.0.0.0/16", true)));
        let verdict = index.evaluate("p-10-0-0-0-24", "10.0.0.7", &reservation, at(1), &settings);
        assert!(matches!(verdict, Verdict::Release { reason: ReleaseReason::PodGone, .. }), "{verdict:?}");
    }

    #[test]
    fn a_terminating_pod_is_terminal_but_only_a_succeeded_or_failed_one_is_finished() {
        // (phase, terminating, terminal, finished)
        let table = [
            ("Running", false, false, false),
            ("Running", true, true, false),
            ("Pending", true, true, false),
            ("Succeeded", false, true, true),
            ("Failed", true, true, true),
        ];
        for (phase, terminating, terminal, finished) in table {
            let mut pod = pod("p", "u", &[], phase);
            if terminating {
                pod.metadata.deletion_timestamp =
                    Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now()));
            }
            let facts = PodFacts::of(&pod);
            assert_eq!(
                (facts.terminal(), facts.finished()),
                (terminal, finished),
                "{phase}, terminating {terminating}"
            );
        }
    }
}
