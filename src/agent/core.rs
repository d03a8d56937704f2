//! The agent's allocation core: its state (caches, checkpoint, client, block store) and the
//! reads every flow shares. Each flow has its own file: the CNI verbs (`add`, `cni_verbs`),
//! the release of a sandbox's records (`block_writes`), the answers to the controller's
//! release marks (`release_marks`) and the start-up recovery (`startup`). Decisions come from
//! the pure modules (`ipam`, `gc`); these files read, write and retry.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::api::Api;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt};

use super::batch::Batches;
use super::checkpoint::{AttachmentKey, Checkpoint, CheckpointIp};
use super::checkpoint_store::CheckpointStore;
use super::error::Error;
use super::metrics::AgentMetrics;
use super::serial::{KeyGuard, KeyedLocks, Serial};
use super::spares::SpareBook;
use crate::block_store::BlockStore;
use crate::crd::{IPBlock, IPPool, IPPoolSpec};
use crate::ipam::PoolLayout;
use crate::ipam::blocks;
use crate::ipam::pools;
use crate::ipam::workload;
use crate::own_writes::OwnWrites;
use crate::protocol::{AttachmentRequest, IpConfig, IpamResult, PodRef as RuntimePodRef, Route};

/// The agent's settings that shape allocation.
#[derive(Clone, Debug)]
pub struct Settings {
    /// This node's name.
    pub node: String,
    /// How long a released IP is not handed out again.
    pub cooldown: Duration,
    /// Owner kinds whose pods keep their IPs between pods.
    pub sticky_kinds: Vec<String>,
    /// How long a sandbox still attached on the node holds a record marked for release
    /// before its DEL counts as lost.
    pub sandbox_grace: Duration,
    /// How many spare IPs the node keeps ready per default pool selecting it (module `spares`).
    pub spare_ips: usize,
}

/// The agent's watch caches: what allocation reads instead of the apiserver.
pub struct Caches {
    /// Every IPPool.
    pub pools: Store<IPPool>,
    /// Every IPBlock.
    pub blocks: Store<IPBlock>,
    /// Every Namespace (their pool annotation and labels place pods).
    pub namespaces: Store<Namespace>,
    /// This node's Node object (its labels select pools).
    pub node: Store<Node>,
    /// This node's pods (`spec.nodeName`), without their managed fields: an ADD's pod.
    pub pods: Store<Pod>,
    /// Notified on every event of the node's pod watch: an ADD whose pod the cache has not
    /// seen yet waits for it a moment ([`POD_CACHE_WAIT`]) before reading it live.
    pub pod_events: Arc<tokio::sync::Notify>,
    /// What this agent's block writes stored, until the block watch shows them (the watch
    /// feeds it [`OwnWrites::observe`]).
    pub own_block_writes: Arc<OwnWrites<IPBlock>>,
    /// Wakes the spares' tending (module `spares`): notified by the pool watch on every change
    /// of the pools, and by ADDs that bound spares.
    pub spares_wake: Arc<tokio::sync::Notify>,
}

/// The agent's state: caches, the checkpoint, and the client.
pub struct Core {
    pub(super) client: Client,
    pub(super) settings: Settings,
    pub(super) pools: Store<IPPool>,
    pub(super) blocks: Store<IPBlock>,
    pub(super) namespaces: Store<Namespace>,
    pub(super) node: Store<Node>,
    pub(super) pods: Store<Pod>,
    pod_events: Arc<tokio::sync::Notify>,
    pub(super) checkpoint: CheckpointStore,
    pub(super) metrics: Arc<AgentMetrics>,
    pub(super) store: BlockStore,
    /// Which calls wait for which (module `serial`).
    pub(super) serial: Serial,
    /// One writer per block on this node, so the node's own writes never conflict.
    block_locks: KeyedLocks,
    /// The edits of the node's calls (ADDs, DELs) waiting for a block's writer, written
    /// together by its next write (module `batch`).
    pub(super) batches: Batches,
    /// The node's spare IPs in use by its calls (module `spares`).
    pub(super) spares: SpareBook,
    /// When this agent started, and whether the runtime has called CNI GC since: until it
    /// has, no sandbox of the checkpoint counts as gone for lack of a listing.
    pub(super) started: std::time::Instant,
    runtime_gc_seen: std::sync::atomic::AtomicBool,
    /// The runtime's CRI endpoint (`--cri-socket`), if the agent may ask it.
    pub(super) runtime: Option<super::runtime_sandboxes::Runtime>,
    /// The copy of each block this agent's last write stored, until the watch cache has
    /// caught up with it: the base of the next write, so consecutive writes need no read.
    written: Arc<OwnWrites<IPBlock>>,
}

/// What a block write edits first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Base {
    /// The newest copy the agent holds: no read, one conflict if it is stale and leads to a
    /// write. Callers that must not act on a copy showing nothing to do (a release whose record
    /// the copy lacks, an ADD about to say a pool is full) look again with [`Base::Fresh`].
    Newest,
    /// A fresh read.
    Fresh,
}

/// A pool resolved for allocation.
pub(super) struct ResolvedPool {
    pub(super) name: String,
    pub(super) layout: PoolLayout,
    /// The pool's gateway, set or defaulted ([`pools::gateway`]).
    gateway: Option<String>,
    /// Whether results route by default via `gateway` ([`pools::default_route`]).
    default_route: bool,
    /// The defaulted gateway its ranges name, for the error of an ADD that finds it full
    /// ([`pools::gateway_withheld_from_ranges`]; `layout` is valid).
    pub(super) withheld_gateway: Option<String>,
    /// Being deleted: it hands out nothing, and a sticky pod does not get its IP back.
    pub(super) deleting: bool,
}

impl ResolvedPool {
    /// Pool `name` of `spec`, laid out as `layout`, `deleting` or not.
    pub(super) fn new(name: &str, spec: &IPPoolSpec, layout: PoolLayout, deleting: bool) -> Self {
        Self {
            name: name.to_string(),
            layout,
            gateway: pools::gateway(spec),
            default_route: pools::default_route(spec),
            withheld_gateway: pools::gateway_withheld_from_laid_out_ranges(spec),
            deleting,
        }
    }

    /// The checkpoint entry of `ip` of this pool, whose record is in `block`: with what the
    /// CNI result says beside the address (prefix length, gateway, default route). Every
    /// entry an allocation writes is made here.
    pub(super) fn checkpoint_ip(&self, ip: String, block: String) -> CheckpointIp {
        CheckpointIp {
            ip,
            prefix_len: self.layout.cidr().prefix_len(),
            gateway: self.gateway.clone(),
            default_route: self.default_route,
            pool: self.name.clone(),
            block,
        }
    }
}

/// Whether an ADD may take its pod from the node's pod cache: the cache holds the pod with the
/// UID the runtime gave (`cached_uid` read by [`workload::runtime_uid`]: a static pod's config
/// hash), and the pod's workload keeps no IPs. A sticky pod is read live: the
/// cache may still hold a pod just deleted and recreated under the same name (a StatefulSet's),
/// whose old sandbox's ADD would then take the claim's IPs back for a pod that is gone; the
/// live read tells it is stale.
fn cache_serves_add(cached_uid: Option<&str>, runtime_uid: Option<&str>, sticky: bool) -> bool {
    !sticky && runtime_uid.is_some() && cached_uid == runtime_uid
}

pub(super) use crate::ipam::blocks::new_block;

/// How long an ADD waits for the node's pod cache to show its pod (with the runtime's UID)
/// before it reads the pod live.
pub const POD_CACHE_WAIT: Duration = Duration::from_millis(100);

/// The field manager of this node's agent on the objects it writes.
pub(super) fn field_manager(node: &str) -> String {
    format!("ipwarden-agent-{node}")
}

pub(super) fn attachment_key(request: &AttachmentRequest) -> AttachmentKey {
    AttachmentKey {
        network: request.network.clone(),
        container_id: request.container_id.clone(),
        ifname: request.ifname.clone(),
    }
}

/// The CNI result for `ips`: each address with its pool's prefix length and gateway, and a
/// default route via the gateway when the pool has one and routes by default
/// (`spec.defaultRoute`: a secondary network's pool pushes no second default route).
pub fn result_of(ips: &[CheckpointIp]) -> IpamResult {
    let routes = ips
        .iter()
        .filter(|ip| ip.default_route)
        .filter_map(|ip| {
            let gateway = ip.gateway.clone()?;
            let dst = if ip.ip.contains(':') { "::/0" } else { "0.0.0.0/0" };
            Some(Route { dst: dst.to_string(), gw: Some(gateway) })
        })
        .collect();
    IpamResult {
        ips: ips
            .iter()
            .map(|ip| IpConfig {
                address: format!("{}/{}", ip.ip, ip.prefix_len),
                gateway: ip.gateway.clone(),
                interface: None,
            })
            .collect(),
        routes,
        dns: None,
    }
}

impl Core {
    /// Creates the core over synced caches and a restored checkpoint.
    pub fn new(
        client: Client,
        settings: Settings,
        caches: Caches,
        checkpoint: Checkpoint,
        metrics: Arc<AgentMetrics>,
    ) -> Self {
        let store = BlockStore::new(
            Api::all(client.clone()),
            field_manager(&settings.node),
            Some(metrics.conflict_retries.clone()),
        );
        let Caches { pools, blocks, namespaces, node, pods, pod_events, own_block_writes, spares_wake } = caches;
        let spares = SpareBook::new(settings.spare_ips, spares_wake);
        Self {
            client,
            settings,
            pools,
            blocks,
            namespaces,
            node,
            pods,
            pod_events,
            checkpoint: CheckpointStore::new(checkpoint),
            metrics,
            store,
            serial: Serial::default(),
            block_locks: KeyedLocks::default(),
            batches: Batches::default(),
            spares,
            started: std::time::Instant::now(),
            runtime_gc_seen: std::sync::atomic::AtomicBool::new(false),
            runtime: None,
            written: own_block_writes,
        }
    }

    /// Lets the core ask the runtime which sandboxes it has (`--cri-socket`).
    pub fn with_runtime(mut self, runtime: super::runtime_sandboxes::Runtime) -> Self {
        self.runtime = Some(runtime);
        self
    }

    /// The newest copy of block `name` this agent knows: the watch cache's, or its own last
    /// write's while the cache has not caught up ([`OwnWrites::newest`]).
    pub(super) fn newest_block(&self, name: &str) -> Option<IPBlock> {
        self.written.newest(name, self.blocks.get(&ObjectRef::new(name)), Instant::now()).map(|block| (*block).clone())
    }

    /// The newest copies ([`Core::newest_block`]) of the blocks of pool `pool`.
    pub(super) fn newest_blocks_of(&self, pool: &str) -> Vec<IPBlock> {
        let mut names: Vec<String> =
            self.blocks.state().iter().filter(|b| b.spec.pool == pool).map(|b| b.name_any()).collect();
        names.extend(self.written.names_where(|b| b.spec.pool == pool, Instant::now()));
        names.sort();
        names.dedup();
        names.iter().filter_map(|name| self.newest_block(name)).collect()
    }

    /// Every block as this agent knows it ([`OwnWrites::overlay`]): what pool selection reads,
    /// so that the records of an orphaned block this agent wrote keep a pool over it from
    /// handing their IPs out while the watch has not delivered those writes yet.
    pub(super) fn known_blocks(&self) -> Vec<Arc<IPBlock>> {
        self.written.overlay(self.blocks.state(), Instant::now())
    }

    /// Holds block `name` for this node's one writer of it, edits it in one compare-and-swap
    /// and remembers what the write stored ([`Core::cas_block_held`]).
    pub(super) async fn cas_block<T>(
        &self,
        name: &str,
        base: Base,
        create: Option<&dyn Fn() -> IPBlock>,
        edit: impl FnMut(&mut IPBlock) -> Option<T>,
    ) -> Result<crate::block_store::CasOutcome<T>, crate::block_store::CasError> {
        let writer = self.block_writer(name).await;
        self.cas_block_held(&writer, name, base, create, edit).await
    }

    /// Waits to be this node's one writer of block `name`.
    pub(super) async fn block_writer(&self, name: &str) -> KeyGuard<'_> {
        self.block_locks.lock(name).await
    }

    /// Edits block `name`, whose writer the caller is (`_writer`), in one compare-and-swap and
    /// remembers what the write stored. With [`Base::Newest`] the first attempt edits the
    /// newest copy this agent knows (or, when it knows none, `create`'s object, created
    /// without a read); with [`Base::Fresh`] it reads first.
    pub(super) async fn cas_block_held<T>(
        &self,
        _writer: &KeyGuard<'_>,
        name: &str,
        base: Base,
        create: Option<&dyn Fn() -> IPBlock>,
        edit: impl FnMut(&mut IPBlock) -> Option<T>,
    ) -> Result<crate::block_store::CasOutcome<T>, crate::block_store::CasError> {
        let base = match base {
            Base::Newest => self.newest_block(name).or_else(|| create.map(|create| create())),
            Base::Fresh => None,
        };
        let (outcome, stored) = self.store.update_from(name, base, create, edit).await?;
        // `None`: gone (a deleted block, whose copy must not be edited again), or nothing stored.
        self.written.remember(name, stored, Instant::now());
        Ok(outcome)
    }

    pub(super) fn resolve_pool(&self, name: &str) -> Option<ResolvedPool> {
        let pool = self.pools.state().into_iter().find(|p| p.name_any() == name)?;
        let layout = pools::layout(&pool.spec).ok()?;
        Some(ResolvedPool::new(name, &pool.spec, layout, pool.metadata.deletion_timestamp.is_some()))
    }

    /// The checkpoint entry of `ip` of pool `pool`, recorded in `block`, for a record found in
    /// the blocks (an ADD's lost answer, a rebuilt checkpoint): as its pool says now
    /// ([`ResolvedPool::checkpoint_ip`]); a host route (/32, /128) without gateway when the pool
    /// is gone or has no layout.
    pub(super) fn checkpoint_ip(&self, pool: String, block: String, ip: String) -> CheckpointIp {
        match self.resolve_pool(&pool) {
            Some(resolved) => resolved.checkpoint_ip(ip, block),
            None => {
                let prefix_len = if ip.contains(':') { 128 } else { 32 };
                CheckpointIp { ip, prefix_len, gateway: None, default_route: true, pool, block }
            }
        }
    }

    pub(super) fn checkpoint_ips(&self, found: Vec<(String, String, String)>) -> Vec<CheckpointIp> {
        found.into_iter().map(|(pool, block, ip)| self.checkpoint_ip(pool, block, ip)).collect()
    }

    /// Namespace `name` from the cache; read live only when the cache does not have it yet
    /// (a namespace made moments before its first pod).
    pub(super) async fn namespace(&self, name: &str) -> Result<Option<Arc<Namespace>>, Error> {
        if let Some(cached) = self.namespaces.get(&ObjectRef::new(name)) {
            return Ok(Some(cached));
        }
        let live = Api::<Namespace>::all(self.client.clone())
            .get_opt(name)
            .await
            .map_err(Error::api(format!("reading namespace {name}")))?;
        Ok(live.map(Arc::new))
    }

    /// The pod of an ADD from this node's pod cache when [`cache_serves_add`]; read live
    /// otherwise: the cache has not seen it within [`POD_CACHE_WAIT`] (the kubelet's watch and
    /// the agent's see a new pod at about the same time, and a live read under a burst waits in
    /// the apiserver's queue), the runtime gave no UID (only a live read tells a recreated pod
    /// of the same name), or the pod is sticky.
    pub(super) async fn pod(&self, pod_ref: &RuntimePodRef) -> Result<Option<Arc<Pod>>, Error> {
        let key = ObjectRef::new(&pod_ref.name).within(&pod_ref.namespace);
        let deadline = tokio::time::Instant::now() + POD_CACHE_WAIT;
        loop {
            // Registered before the look, so an event between the two is not missed.
            let event = self.pod_events.notified();
            tokio::pin!(event);
            event.as_mut().enable();
            let cached = self.pods.get(&key);
            let cached_uid = cached.as_deref().and_then(workload::runtime_uid).map(str::to_string);
            if let Some(cached) = cached {
                let sticky =
                    workload::is_sticky(workload::controller_of(&cached).as_ref(), &self.settings.sticky_kinds);
                if cache_serves_add(cached_uid.as_deref(), pod_ref.uid.as_deref(), sticky) {
                    self.metrics.pod_read("cache");
                    return Ok(Some(cached));
                }
                // A sticky pod (this one, or its predecessor of the same name) is read live at
                // once; so is the pod itself when the cache cannot serve it.
                if sticky || cached_uid.as_deref() == pod_ref.uid.as_deref() {
                    break;
                }
            }
            if pod_ref.uid.is_none()
                || tokio::time::Instant::now() >= deadline
                || tokio::time::timeout_at(deadline, event).await.is_err()
            {
                break;
            }
        }
        self.metrics.pod_read("apiserver");
        let live = Api::<Pod>::namespaced(self.client.clone(), &pod_ref.namespace)
            .get_opt(&pod_ref.name)
            .await
            .map_err(Error::api(format!("reading pod {}/{}", pod_ref.namespace, pod_ref.name)))?;
        Ok(live.map(Arc::new))
    }

    /// This node's labels from the cache; read live only when the cache does not have the
    /// Node yet.
    pub(super) async fn node_labels(&self) -> Result<BTreeMap<String, String>, Error> {
        let node = &self.settings.node;
        if let Some(cached) = self.node.get(&ObjectRef::new(node)) {
            return Ok(cached.labels().clone());
        }
        let live = Api::<Node>::all(self.client.clone())
            .get_opt(node)
            .await
            .map_err(Error::api(format!("reading node {node}")))?;
        Ok(live.map(|n| n.labels().clone()).unwrap_or_default())
    }

    /// Whether the runtime has not said which sandboxes it has (by CNI GC, or over CRI) since
    /// this agent started.
    pub(super) fn runtime_gc_pending(&self) -> bool {
        !self.runtime_gc_seen.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Notes that the runtime said which sandboxes it has.
    pub(super) fn runtime_gc_called(&self) {
        self.runtime_gc_seen.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether `record` carries a release mark this node's agent is to answer.
    pub(super) fn is_mark_for_this_node(&self, record: &crate::crd::Allocation) -> bool {
        record.node == self.settings.node && crate::gc::handshake::marked_for_release(record)
    }

    /// Whether the cache shows any mark for this node to answer: checked before the mark
    /// answers take the node alone, so a pass with nothing to do never stalls an ADD.
    pub fn has_marks_to_answer(&self) -> bool {
        self.blocks.state().iter().any(|b| b.spec.allocations.values().any(|r| self.is_mark_for_this_node(r)))
    }

    /// (block name, ip, pool) of every record of this node's sandbox, from the cache.
    pub(super) fn records_of_sandbox(&self, container_id: &str, ifname: &str) -> Vec<(String, String, String)> {
        let node = &self.settings.node;
        self.blocks
            .state()
            .iter()
            .flat_map(|block| {
                blocks::find_attachment(&block.spec, container_id, ifname)
                    .into_iter()
                    .filter(|ip| {
                        block.spec.allocations.get(ip).is_some_and(|a| {
                            a.node == *node || a.migration_target.as_ref().is_some_and(|t| t.node == *node)
                        })
                    })
                    .map(|ip| (block.name_any(), ip, block.spec.pool.clone()))
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn an_add_takes_its_pod_from_the_cache_only_with_the_runtimes_uid_and_when_it_keeps_no_ips() {
        let cases = [
            (Some("u1"), Some("u1"), false, true),
            (Some("u1"), Some("u1"), true, false),
            (Some("old"), Some("new"), false, false),
            (Some("u1"), None, false, false),
            (None, None, false, false),
        ];
        for (cached, runtime, sticky, serves) in cases {
            assert_eq!(cache_serves_add(cached, runtime, sticky), serves, "{cached:?} {runtime:?} sticky {sticky}");
        }
    }

    fn ip(ip: &str, gateway: Option<&str>, default_route: bool) -> CheckpointIp {
        CheckpointIp {
            ip: ip.into(),
            prefix_len: 24,
            gateway: gateway.map(Into::into),
            default_route,
            pool: "p".into(),
            block: "b".into(),
        }
    }

    #[test]
    fn a_result_carries_prefix_lengths_gateways_and_a_default_route_where_the_pool_routes_by_default() {
        let cases = [
            // (the IPs, their gateways in the result, the result's routes)
            (vec![ip("10.0.0.5", Some("10.0.0.1"), true)], vec![Some("10.0.0.1")], vec![("0.0.0.0/0", "10.0.0.1")]),
            (vec![ip("fd00::5", Some("fd00::1"), true)], vec![Some("fd00::1")], vec![("::/0", "fd00::1")]),
            // A secondary network's pool: the gateway (ptp, bridge need it), no default route.
            (vec![ip("10.1.0.5", Some("10.1.0.1"), false)], vec![Some("10.1.0.1")], vec![]),
            // A pool too small for a gateway (a /31, a /32): no route to make.
            (vec![ip("10.0.0.5", None, true)], vec![None], vec![]),
            (
                vec![ip("10.0.0.5", Some("10.0.0.1"), true), ip("fd00::5", Some("fd00::1"), false)],
                vec![Some("10.0.0.1"), Some("fd00::1")],
                vec![("0.0.0.0/0", "10.0.0.1")],
            ),
        ];
        for (ips, gateways, routes) in cases {
            let result = result_of(&ips);
            let addresses: Vec<String> = ips.iter().map(|i| format!("{}/24", i.ip)).collect();
            let got: Vec<&str> = result.ips.iter().map(|i| i.address.as_str()).collect();
            assert_eq!(got, addresses);
            let got: Vec<Option<&str>> = result.ips.iter().map(|i| i.gateway.as_deref()).collect();
            assert_eq!(got, gateways, "{addresses:?}");
            let got: Vec<(&str, &str)> =
                result.routes.iter().map(|r| (r.dst.as_str(), r.gw.as_deref().unwrap_or_default())).collect();
            assert_eq!(got, routes, "{addresses:?}");
        }
    }
}
