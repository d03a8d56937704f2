//! The scale benchmark behind `ipwarden-e2e scale`: the real control plane with many Node
//! objects but no kubelet processes. The benchmark writes what kubelets and agents would have
//! written, in bulk: each node Ready with an agent heartbeat Lease, pods with their
//! `status.podIPs`, the IPBlocks holding one record per pod and an IPClaim per StatefulSet pod. Then it
//! starts a controller pair and measures the leader's start-up and first full sweep, the
//! requests the controllers make during a quiet minute, and how long 1,000 leaks (pods
//! deleted without their records) take to be reclaimed, answering each release handshake as
//! the node's agent would.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::churn::{grown_by, nearest_rank, scrape_apiserver, scrape_port};
use crate::cluster::{Cluster, ClusterOptions};
use crate::controlplane::{AUDIT_LOG, ComponentName, ControlPlaneOptions};
use crate::error::{Error, Result};
use crate::exposition::Scrape;
use crate::ipwarden::{self, Daemon, RunAs};
use crate::procstat::{self, Usage};
use crate::wait::{self, Probe};

/// The namespace of the pods, claims, StatefulSets, agent Leases and the controllers' Lease.
const NAMESPACE: &str = "default";

/// The label on every object the benchmark creates.
const SCALE_LABEL: &str = "e2e.ipwarden.io/scale";

/// The label ipwarden's controller selects agent heartbeat Leases by (the agent's
/// `heartbeat::NODE_LABEL`; the harness does not depend on the ipwarden crate).
const AGENT_NODE_LABEL: &str = "ipwarden.io/agent-node";

/// The simulated agents' Lease duration: longer than any run, so no Lease goes stale and
/// none has to be renewed (1,000 renewals every few seconds would be the agents' load, not
/// the controller's).
const AGENT_LEASE_SECONDS: i32 = 3600;

/// The pool finalizer the leader puts on every pool in use (`crd::pool::POOL_FINALIZER`).
const POOL_FINALIZER: &str = "ipwarden.io/pool-in-use";

/// Pods per StatefulSet.
const STATEFULSET_REPLICAS: usize = 10;

/// Each pool is a /20 of 10.0.0.0/8 ...
const POOL_PREFIX: u32 = 20;
/// ... cut into /26 blocks ...
const BLOCK_PREFIX: u32 = 26;
/// ... of which the benchmark fills this many addresses (from the block's third), so a
/// pool of 100 pods has two blocks, as agents filling a block and opening the next would.
const RECORDS_PER_BLOCK: usize = 60;

/// kube-controller-manager without the controllers that need kubelets or would fight the
/// benchmark: the node lifecycle controller (it would mark every node NotReady, taint it and
/// evict its pods, since no kubelet renews a node Lease) and the StatefulSet controller (the
/// benchmark writes the StatefulSets' pods itself, with their IPs).
pub const KCM_CONTROLLERS: &str = "*,-node-lifecycle-controller,-statefulset-controller";

/// The ServiceAccount the controllers run as (bound to cluster-admin), so the apiserver's
/// audit log tells their requests from everyone else's.
pub const CONTROLLER_ACCOUNT: &str = "ipwarden-scale-controller";

/// The controller replicas.
const IDENTITIES: [&str; 2] = ["controller-a", "controller-b"];

/// How long the controllers may take to list the cluster and report ready.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(600);

/// How long the leader may take to finish its first full sweep, and to put its finalizer on
/// every pool.
const SWEEP_TIMEOUT: Duration = Duration::from_secs(600);

/// What to build and measure.
#[derive(Clone, Debug)]
pub struct ScaleOptions {
    /// Node objects (no kubelet process each).
    pub nodes: usize,
    /// Pods, each with one IP and one record.
    pub pods: usize,
    /// IPPools, the pods spread round robin over them.
    pub pools: usize,
    /// Percent of the pods that belong to StatefulSets (sticky records and claims).
    pub sticky_percent: u32,
    /// Bare pods deleted without their records once the controllers are settled.
    pub leaks: usize,
    /// The quiet window over which the controllers' requests are counted.
    pub quiet: Duration,
    /// API calls in flight at once while the cluster is filled and the leaks deleted.
    pub concurrency: usize,
    /// How long the leaks may take to be reclaimed before the run gives up.
    pub leak_timeout: Duration,
    /// The simulated agents ask their runtime over CRI (`ipwarden agent --cri-socket`): each
    /// node's agent, at its next question after a leak's deletion ([`AGENT_RUNTIME_POLL`],
    /// the nodes' questions spread evenly over it), finds the sandbox gone and releases the
    /// record itself, as `SweepRuntime` does for an attachment older than the settle time.
    pub agents_ask_runtime: bool,
    /// The controllers' `--additional-grace-seconds`: 0 by default, so a vanished pod's
    /// deadline is its deletion and the watch-event lag is measured alone; the controller's
    /// own default (5 s) with [`ScaleOptions::agents_ask_runtime`] shows who releases first.
    pub additional_grace: Duration,
}

/// The agents' `--cri-poll-interval-seconds` default, which [`ScaleOptions::agents_ask_runtime`]
/// simulates.
pub const AGENT_RUNTIME_POLL: Duration = Duration::from_secs(5);

impl Default for ScaleOptions {
    fn default() -> Self {
        Self {
            nodes: 1000,
            pods: 30_000,
            pools: 300,
            sticky_percent: 10,
            leaks: 1000,
            quiet: Duration::from_secs(60),
            concurrency: 64,
            leak_timeout: Duration::from_secs(300),
            agents_ask_runtime: false,
            additional_grace: Duration::ZERO,
        }
    }
}

/// The cluster the benchmark runs on: no simulated kubelets, kube-controller-manager with
/// [`KCM_CONTROLLERS`], and an audit log of the controllers' requests.
pub fn cluster_options() -> ClusterOptions {
    ClusterOptions {
        nodes: 0,
        network: None,
        control_plane: ControlPlaneOptions {
            controllers: KCM_CONTROLLERS.to_string(),
            audit_policy: Some(audit_policy()),
            ..ControlPlaneOptions::default()
        },
        real_nodes: None,
    }
}

/// An audit policy that logs the metadata of the controllers' requests and nothing else.
fn audit_policy() -> String {
    format!(
        "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n\
         - level: Metadata\n  users: [\"system:serviceaccount:{NAMESPACE}:{CONTROLLER_ACCOUNT}\"]\n\
         - level: None\n"
    )
}

/// One pod as the benchmark lays the cluster out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedPod {
    /// Its name in [`NAMESPACE`].
    pub name: String,
    /// The index of its node.
    pub node: usize,
    /// The index of its pool.
    pub pool: usize,
    /// The index of its block within the pool.
    pub block: usize,
    /// Its IP.
    pub ip: Ipv4Addr,
    /// The index of its StatefulSet, for a sticky pod.
    pub statefulset: Option<usize>,
}

/// The name of node `index`.
pub fn node_name(index: usize) -> String {
    format!("scale-node-{index:05}")
}

fn node_ip(index: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(172, 16, 0, 1)).wrapping_add(index as u32))
}

/// The name of pool `index`.
pub fn pool_name(index: usize) -> String {
    format!("scale-{index:04}")
}

fn pool_base(pool: usize) -> u32 {
    u32::from(Ipv4Addr::new(10, 0, 0, 0)) + ((pool as u32) << (32 - POOL_PREFIX))
}

/// The CIDR of pool `index`.
pub fn pool_cidr(index: usize) -> String {
    format!("{}/{POOL_PREFIX}", Ipv4Addr::from(pool_base(index)))
}

fn block_base(pool: usize, block: usize) -> u32 {
    pool_base(pool) + ((block as u32) << (32 - BLOCK_PREFIX))
}

/// The CIDR of block `block` of pool `pool`.
pub fn block_cidr(pool: usize, block: usize) -> String {
    format!("{}/{BLOCK_PREFIX}", Ipv4Addr::from(block_base(pool, block)))
}

/// The IPBlock name of block `block` of pool `pool`, as the agent names it
/// (`pools::block_name`: the pool, then the CIDR with `.` and `/` as `-`).
pub fn block_name(pool: usize, block: usize) -> String {
    format!("{}-{}", pool_name(pool), block_cidr(pool, block).replace(['.', '/'], "-"))
}

/// The name of StatefulSet `index`.
pub fn statefulset_name(index: usize) -> String {
    format!("scale-sts-{index:04}")
}

/// How many pods belong to StatefulSets: the asked share, in whole StatefulSets.
pub fn sticky_pods(options: &ScaleOptions) -> usize {
    let share = options.pods * options.sticky_percent.min(100) as usize / 100;
    share - share % STATEFULSET_REPLICAS
}

/// Lays the pods out: pod `i` runs on node `i mod nodes` and takes its IP from pool
/// `i mod pools`, filling that pool's blocks in order; the first [`sticky_pods`] pods belong
/// to StatefulSets of [`STATEFULSET_REPLICAS`], the others are bare.
pub fn plan(options: &ScaleOptions) -> Result<Vec<PlannedPod>> {
    let per_pool = options.pods.div_ceil(options.pools.max(1));
    let capacity = RECORDS_PER_BLOCK << (BLOCK_PREFIX - POOL_PREFIX);
    if options.nodes == 0 || options.pods == 0 || options.pools == 0 {
        return Err(Error::Scale("nodes, pods and pools must each be at least 1".into()));
    }
    if options.pools > 1 << (POOL_PREFIX - 8) {
        return Err(Error::Scale(format!("at most {} pools fit in 10.0.0.0/8", 1 << (POOL_PREFIX - 8))));
    }
    if per_pool > capacity {
        return Err(Error::Scale(format!("{per_pool} pods per pool; a pool holds at most {capacity}")));
    }
    let sticky = sticky_pods(options);
    if options.leaks > options.pods - sticky {
        return Err(Error::Scale(format!(
            "{} leaks asked, but only {} pods are bare",
            options.leaks,
            options.pods - sticky
        )));
    }
    Ok((0..options.pods)
        .map(|i| {
            let (pool, slot) = (i % options.pools, i / options.pools);
            let block = slot / RECORDS_PER_BLOCK;
            let ip = Ipv4Addr::from(block_base(pool, block) + 2 + (slot % RECORDS_PER_BLOCK) as u32);
            let statefulset = (i < sticky).then_some(i / STATEFULSET_REPLICAS);
            let name = match statefulset {
                Some(s) => format!("{}-{}", statefulset_name(s), i % STATEFULSET_REPLICAS),
                None => format!("scale-pod-{i:06}"),
            };
            PlannedPod { name, node: i % options.nodes, pool, block, ip, statefulset }
        })
        .collect())
}

/// The pods deleted as leaks: `leaks` bare pods spread evenly over the bare ones (and so
/// over the pools and nodes).
pub fn leaked(options: &ScaleOptions) -> Vec<usize> {
    let sticky = sticky_pods(options);
    let bare = options.pods.saturating_sub(sticky);
    (0..options.leaks.min(bare)).map(|m| sticky + m * bare / options.leaks).collect()
}

/// Latency figures of one kind of event, from exact samples (nearest rank).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Span {
    /// How many events were measured.
    pub samples: u64,
    /// The median, in seconds.
    pub p50_seconds: Option<f64>,
    /// The 99th percentile, in seconds.
    pub p99_seconds: Option<f64>,
    /// The largest, in seconds.
    pub max_seconds: Option<f64>,
}

impl Span {
    /// From exact measurements.
    pub fn of(mut seconds: Vec<f64>) -> Self {
        seconds.sort_by(f64::total_cmp);
        Self {
            samples: seconds.len() as u64,
            p50_seconds: nearest_rank(&seconds, 0.5),
            p99_seconds: nearest_rank(&seconds, 0.99),
            max_seconds: seconds.last().copied(),
        }
    }
}

/// How long each step of filling the cluster took, in seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Setup {
    /// Node objects created and their status written Ready.
    pub nodes_seconds: f64,
    /// Agent heartbeat Leases created.
    pub agent_leases_seconds: f64,
    /// IPPools and StatefulSets created.
    pub pools_and_statefulsets_seconds: f64,
    /// Pods created and their status written (two writes each).
    pub pods_seconds: f64,
    /// IPBlocks created with their records.
    pub blocks_seconds: f64,
    /// IPClaims created.
    pub claims_seconds: f64,
    /// All of it.
    pub total_seconds: f64,
    /// IPBlocks written.
    pub blocks: usize,
    /// StatefulSets written.
    pub statefulsets: usize,
    /// Pods that belong to StatefulSets.
    pub sticky_pods: usize,
}

/// The leader's start, from its log.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Startup {
    /// The replica that led.
    pub leader: String,
    /// From the leader's "controller starting" to "caches synced" (listing the cluster).
    pub cache_sync_seconds: Option<f64>,
    /// From the leader's "leadership changed" to the end of its first full sweep.
    pub leadership_to_first_sweep_seconds: Option<f64>,
    /// The first sweep's own `duration_ms` (plan and writes).
    pub first_sweep_ms: Option<u64>,
    /// Records the first sweep looked at.
    pub first_sweep_scanned: Option<u64>,
    /// The first sweep's report as logged.
    pub first_sweep_report: String,
}

/// One process's resource use.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ProcessUsage {
    /// What it is.
    pub name: String,
    /// Whether it led the first sweep (controllers only).
    pub leader: bool,
    /// Peak resident memory since it started, in MiB.
    pub peak_rss_mib: f64,
    /// CPU seconds from the controllers' start to the end of the first sweep.
    pub cpu_startup_seconds: f64,
    /// CPU seconds during the quiet window.
    pub cpu_quiet_seconds: f64,
    /// CPU seconds from the end of the quiet window to the last reclaim (the leak phase).
    pub cpu_leaks_seconds: f64,
}

/// Requests counted over a window.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Requests {
    /// The controllers' requests (both replicas), from the apiserver's audit log, by
    /// `verb resource[/subresource]` (audit verbs: get, list, watch, create, update, patch,
    /// delete). A watch counts when it starts.
    pub controllers: BTreeMap<String, u64>,
    /// Of those, GETs of single pods, IPBlocks, IPClaims, Nodes or StatefulSets: per-record
    /// reads (leader election's Lease and the trigger ConfigMap are not).
    pub controller_per_record_gets: u64,
    /// Of those, the ones answered with an error, by `verb resource[/subresource] code`
    /// (409: a compare-and-swap lost to another writer).
    pub controller_failures: BTreeMap<String, u64>,
    /// Every client's requests, from the apiserver's `apiserver_request_total`, by
    /// `VERB resource[/subresource]`.
    pub apiserver: BTreeMap<String, u64>,
}

/// The leaks and their reclaim.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Leaks {
    /// Pods deleted without their records.
    pub injected: usize,
    /// Of those, whose record the controller released within the bound.
    pub reclaimed: usize,
    /// Seconds from the first deletion call to the last release (or to giving up).
    pub all_reclaimed_seconds: f64,
    /// Seconds the deletion calls took, all of them.
    pub delete_seconds: f64,
    /// Per leak: from its deletion call to its record gone from its IPBlock (block watch).
    pub reclaim: Span,
    /// Per leak: from its deletion call to the controller's first write on its record (the
    /// release mark, or the release itself), as the benchmark's block watch sees it. The
    /// controllers run with `--additional-grace-seconds=0`, so this is the watch-event lag:
    /// the pod's deletion event reaching the controller, its decision, the live re-read of
    /// the pod, the batched block write and the write's event reaching the benchmark.
    pub watch_lag: Span,
    /// Release marks the simulated agents answered `ready-for-release`.
    pub answered: u64,
    /// Answers that failed (the record changed under them, or an API error).
    pub answer_failures: u64,
    /// Records the simulated agents released themselves, the runtime no longer having their
    /// sandboxes ([`ScaleOptions::agents_ask_runtime`]).
    pub released_by_agents: u64,
    /// `ipwarden_gc_releases_total` grown during the leak phase, by `trigger`.
    pub releases_by_trigger: BTreeMap<String, u64>,
    /// `ipwarden_gc_skips_total` grown during the leak phase, by `reason`: changes dropped at
    /// write time (each one's live reads, if it made any, were spent for nothing).
    pub skips_by_reason: BTreeMap<String, u64>,
    /// Requests during the leak phase.
    pub requests: Requests,
    /// What was still pending when the wait gave up; empty when all were reclaimed.
    pub unreclaimed: String,
}

/// Everything the run measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ScaleReport {
    /// Node objects.
    pub nodes: usize,
    /// Pods.
    pub pods: usize,
    /// Pools.
    pub pools: usize,
    /// Filling the cluster.
    pub setup: Setup,
    /// The leader's start and first sweep.
    pub startup: Startup,
    /// The controller replicas.
    pub controllers: Vec<ProcessUsage>,
    /// etcd, kube-apiserver and kube-controller-manager.
    pub control_plane: Vec<ProcessUsage>,
    /// The quiet window's length in seconds.
    pub quiet_seconds: f64,
    /// Requests during the quiet window.
    pub quiet: Requests,
    /// The leaks.
    pub leaks: Leaks,
}

/// The API resource of ipwarden's custom resource `kind`, for dynamic objects.
pub(crate) fn ipwarden_resource(kind: &str) -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk("ipwarden.io", "v1alpha1", kind))
}

fn now_time() -> Time {
    Time(jiff::Timestamp::now())
}

fn from_json<K: DeserializeOwned>(what: &str, value: Value) -> Result<K> {
    serde_json::from_value(value)
        .map_err(|e| Error::Kube { what: format!("building {what}"), source: kube::Error::SerdeError(e) })
}

/// Runs `task` on every item, at most `concurrency` at once, failing with the first error.
async fn bounded<T, R, F, Fut>(items: impl IntoIterator<Item = T>, concurrency: usize, task: F) -> Result<Vec<R>>
where
    F: Fn(T) -> Fut,
    Fut: Future<Output = Result<R>>,
{
    stream::iter(items).map(task).buffer_unordered(concurrency.max(1)).try_collect().await
}

async fn create<K>(api: &Api<K>, what: String, object: Value) -> Result<K>
where
    K: kube::Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    let object: K = from_json(&what, object)?;
    api.create(&PostParams::default(), &object).await.map_err(Error::kube(format!("creating {what}")))
}

/// Creates the ipwarden object `name` with `spec`, labelled [`SCALE_LABEL`].
async fn create_dynamic(api: &Api<DynamicObject>, resource: &ApiResource, name: &str, spec: Value) -> Result<()> {
    let mut object = DynamicObject::new(name, resource);
    object.metadata.labels = Some(BTreeMap::from([(SCALE_LABEL.to_string(), "true".to_string())]));
    object.data = json!({"spec": spec});
    api.create(&PostParams::default(), &object)
        .await
        .map(drop)
        .map_err(Error::kube(format!("creating {} {name}", resource.kind)))
}

async fn write_status<K>(api: &Api<K>, what: &str, name: &str, status: Value) -> Result<()>
where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&json!({"status": status})))
        .await
        .map(drop)
        .map_err(Error::kube(format!("writing the status of {what} {name}")))
}

/// Creates node `index` and writes its status Ready, as its kubelet would; returns its UID.
async fn create_node(nodes: &Api<Node>, index: usize) -> Result<String> {
    let name = node_name(index);
    let metadata = json!({"name": name, "labels": {SCALE_LABEL: "true", "kubernetes.io/hostname": name}});
    let created = create(nodes, format!("Node {name}"), json!({"metadata": metadata})).await?;
    let now = now_time();
    let resources = json!({"cpu": "64", "memory": "256Gi", "pods": "250"});
    let status = json!({
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "simulated by the scale benchmark", "lastHeartbeatTime": now, "lastTransitionTime": now}],
        "addresses": [{"type": "InternalIP", "address": node_ip(index).to_string()}],
        "capacity": resources, "allocatable": resources,
    });
    write_status(nodes, "Node", &name, status).await?;
    Ok(created.uid().unwrap_or_default())
}

/// The agent heartbeat Lease of node `index`, as the agent writes it (owned by its Node).
async fn create_agent_lease(leases: &Api<Lease>, index: usize, node_uid: &str) -> Result<()> {
    let node = node_name(index);
    let lease = json!({
        "metadata": {"name": format!("ipwarden-agent-{node}"), "labels": {AGENT_NODE_LABEL: node},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}]},
        "spec": {"holderIdentity": node, "leaseDurationSeconds": AGENT_LEASE_SECONDS,
            "renewTime": MicroTime(jiff::Timestamp::now())},
    });
    create(leases, format!("agent Lease of {node}"), lease).await.map(drop)
}

async fn create_statefulset(api: &Api<StatefulSet>, index: usize) -> Result<String> {
    let name = statefulset_name(index);
    let spec = json!({
        "metadata": {"name": name, "labels": {SCALE_LABEL: "true"}},
        "spec": {"replicas": STATEFULSET_REPLICAS, "serviceName": name, "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "app", "image": "registry.invalid/ipwarden-scale/app:1"}]}}},
    });
    Ok(create(api, format!("StatefulSet {name}"), spec).await?.uid().unwrap_or_default())
}

/// Creates the pod and writes its status Running with its IP, as its kubelet would after the
/// CNI ADD; returns its UID.
async fn create_pod(pods: &Api<Pod>, pod: &PlannedPod, statefulset_uid: Option<&str>) -> Result<String> {
    let mut labels = json!({SCALE_LABEL: "true"});
    let mut owners = Vec::new();
    if let (Some(s), Some(uid)) = (pod.statefulset, statefulset_uid) {
        let owner = statefulset_name(s);
        labels["app"] = json!(owner);
        labels["statefulset.kubernetes.io/pod-name"] = json!(pod.name);
        owners.push(json!({"apiVersion": "apps/v1", "kind": "StatefulSet", "name": owner, "uid": uid,
            "controller": true, "blockOwnerDeletion": true}));
    }
    let manifest = json!({
        "metadata": {"name": pod.name, "labels": labels, "ownerReferences": owners},
        "spec": {"nodeName": node_name(pod.node), "automountServiceAccountToken": false,
            "containers": [{"name": "app", "image": "registry.invalid/ipwarden-scale/app:1"}]},
    });
    let created = create(pods, format!("Pod {}", pod.name), manifest).await?;
    let (now, ip, host) = (now_time(), pod.ip.to_string(), node_ip(pod.node).to_string());
    let status = json!({
        "phase": "Running", "startTime": now, "hostIP": host, "hostIPs": [{"ip": host}],
        "podIP": ip, "podIPs": [{"ip": ip}],
        "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "Ready", "status": "True", "lastTransitionTime": now}],
    });
    write_status(pods, "Pod", &pod.name, status).await?;
    Ok(created.uid().unwrap_or_default())
}

fn owner(pod: &PlannedPod) -> Value {
    pod.statefulset.map_or(Value::Null, |s| json!({"kind": "StatefulSet", "name": statefulset_name(s)}))
}

/// The record of `pod` (UID `uid`) as the agent writes it on ADD.
fn record(pod: &PlannedPod, index: usize, uid: &str) -> Value {
    let mut record = json!({
        "pod": {"namespace": NAMESPACE, "name": pod.name, "uid": uid},
        "node": node_name(pod.node), "network": ipwarden::NETWORK,
        "containerId": format!("{index:064x}"), "interface": "eth0",
        "sticky": pod.statefulset.is_some(), "allocatedAt": now_time(),
    });
    if pod.statefulset.is_some() {
        record["owner"] = owner(pod);
    }
    record
}

/// The IPClaim spec of StatefulSet pod `pod` as the agent writes it on ADD (a stateless pod has
/// none: docs/decisions/0015-no-claim-for-stateless-pods.md).
fn claim(pod: &PlannedPod, uid: &str) -> Value {
    json!({
        "podUid": uid, "node": node_name(pod.node), "owner": owner(pod), "sticky": true, "boundAt": now_time(),
        "interfaces": [{"interface": "eth0", "ips": [{"ip": pod.ip.to_string(), "pool": pool_name(pod.pool),
            "block": block_name(pod.pool, pod.block)}]}],
    })
}

/// Seconds since `start`.
fn since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64()
}

/// Fills the cluster: nodes, agent Leases, pools, StatefulSets, pods, blocks and claims.
/// Returns each pod's UID, in plan order.
async fn fill(
    client: &Client,
    options: &ScaleOptions,
    planned: &[PlannedPod],
    setup: &mut Setup,
) -> Result<Vec<String>> {
    let c = options.concurrency;
    let started = Instant::now();
    let step = Instant::now();
    let nodes: Api<Node> = Api::all(client.clone());
    let node_uids = bounded(0..options.nodes, c, |i| {
        let nodes = nodes.clone();
        async move { Ok((i, create_node(&nodes, i).await?)) }
    })
    .await?;
    setup.nodes_seconds = since(step);
    tracing::info!(seconds = setup.nodes_seconds, "scale: nodes created");

    let step = Instant::now();
    let leases: Api<Lease> = Api::namespaced(client.clone(), NAMESPACE);
    bounded(node_uids, c, |(i, uid)| {
        let leases = leases.clone();
        async move { create_agent_lease(&leases, i, &uid).await }
    })
    .await?;
    setup.agent_leases_seconds = since(step);

    let step = Instant::now();
    let pool_resource = ipwarden_resource("IPPool");
    let pools: Api<DynamicObject> = Api::all_with(client.clone(), &pool_resource);
    bounded(0..options.pools, c, |p| {
        let (pools, resource) = (pools.clone(), pool_resource.clone());
        let spec = json!({"cidr": pool_cidr(p), "blockSize": BLOCK_PREFIX});
        async move { create_dynamic(&pools, &resource, &pool_name(p), spec).await }
    })
    .await?;
    setup.sticky_pods = sticky_pods(options);
    setup.statefulsets = setup.sticky_pods / STATEFULSET_REPLICAS;
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), NAMESPACE);
    let sts_uids: HashMap<usize, String> = bounded(0..setup.statefulsets, c, |s| {
        let api = statefulsets.clone();
        async move { Ok((s, create_statefulset(&api, s).await?)) }
    })
    .await?
    .into_iter()
    .collect();
    setup.pools_and_statefulsets_seconds = since(step);

    let step = Instant::now();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let mut uids = bounded(planned.iter().enumerate(), c, |(i, pod)| {
        let pods = pods.clone();
        let owner_uid = pod.statefulset.and_then(|s| sts_uids.get(&s)).cloned();
        async move { Ok((i, create_pod(&pods, pod, owner_uid.as_deref()).await?)) }
    })
    .await?;
    uids.sort();
    let uids: Vec<String> = uids.into_iter().map(|(_, uid)| uid).collect();
    setup.pods_seconds = since(step);
    tracing::info!(seconds = setup.pods_seconds, "scale: pods created");

    let step = Instant::now();
    let mut blocks: BTreeMap<(usize, usize), serde_json::Map<String, Value>> = BTreeMap::new();
    for (i, pod) in planned.iter().enumerate() {
        blocks.entry((pod.pool, pod.block)).or_default().insert(pod.ip.to_string(), record(pod, i, &uids[i]));
    }
    setup.blocks = blocks.len();
    let block_resource = ipwarden_resource("IPBlock");
    let block_api: Api<DynamicObject> = Api::all_with(client.clone(), &block_resource);
    bounded(blocks, c, |((pool, block), allocations)| {
        let (api, resource) = (block_api.clone(), block_resource.clone());
        let spec = json!({"pool": pool_name(pool), "cidr": block_cidr(pool, block), "allocations": allocations, "released": {}});
        async move { create_dynamic(&api, &resource, &block_name(pool, block), spec).await }
    })
    .await?;
    setup.blocks_seconds = since(step);

    let step = Instant::now();
    let claim_resource = ipwarden_resource("IPClaim");
    let claims: Api<DynamicObject> = Api::namespaced_with(client.clone(), NAMESPACE, &claim_resource);
    let sticky = planned.iter().zip(&uids).filter(|(pod, _)| pod.statefulset.is_some());
    bounded(sticky, c, |(pod, uid)| {
        let (api, resource) = (claims.clone(), claim_resource.clone());
        let data = claim(pod, uid);
        async move { create_dynamic(&api, &resource, &pod.name, data).await }
    })
    .await?;
    setup.claims_seconds = since(step);
    setup.total_seconds = since(started);
    Ok(uids)
}

/// Creates the controllers' ServiceAccount, binds it to cluster-admin and returns a
/// kubeconfig for it.
async fn controller_identity(cluster: &Cluster) -> Result<std::path::PathBuf> {
    let client = cluster.client();
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), NAMESPACE);
    create(
        &accounts,
        format!("ServiceAccount {CONTROLLER_ACCOUNT}"),
        json!({"metadata": {"name": CONTROLLER_ACCOUNT}}),
    )
    .await?;
    let bindings: Api<ClusterRoleBinding> = Api::all(client);
    let binding = json!({
        "metadata": {"name": CONTROLLER_ACCOUNT},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": CONTROLLER_ACCOUNT, "namespace": NAMESPACE}],
    });
    create(&bindings, format!("ClusterRoleBinding {CONTROLLER_ACCOUNT}"), binding).await?;
    crate::accounts::kubeconfig_for(cluster, NAMESPACE, CONTROLLER_ACCOUNT).await
}

/// Installs ipwarden's CRDs as `binary crd` prints them.
async fn install_crds(cluster: &Cluster, binary: &Path) -> Result<()> {
    let yaml = crate::process::run_tool(binary, &["crd".to_string()], None).await?;
    let file = cluster.dir().join("ipwarden-crds.yaml");
    std::fs::write(&file, yaml).map_err(Error::io("writing the CRDs", &file))?;
    let names = ["ippools.ipwarden.io", "ipblocks.ipwarden.io", "ipclaims.ipwarden.io"];
    cluster.apply_crds(&file, &names, Duration::from_secs(60)).await
}

/// What the benchmark's block watch saw, by pod UID.
#[derive(Default)]
struct Seen {
    /// When a record of the pod first carried a release handshake.
    marked: HashMap<String, Instant>,
    /// When the pod's last record left the blocks.
    released: HashMap<String, Instant>,
    answered: u64,
    answer_failures: u64,
}

type Shared<T> = Arc<Mutex<T>>;

fn with<T, R>(shared: &Shared<T>, f: impl FnOnce(&mut T) -> R) -> R {
    // A poisoned lock means a panicking task; the data is still the best there is.
    let mut guard = shared.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    f(&mut guard)
}

/// A block's records: UID by IP, with the handshake state when there is one.
fn records(block: &DynamicObject) -> HashMap<String, (String, Option<String>)> {
    block.data["spec"]["allocations"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(ip, r)| {
            let uid = r["pod"]["uid"].as_str()?.to_string();
            let state = r["releaseHandshake"]["state"].as_str().map(str::to_string);
            Some((ip.clone(), (uid, state)))
        })
        .collect()
}

/// Answers a release mark `ready-for-release` as the record's node agent does when no
/// sandbox holds the IP: a JSON patch that applies only while the record still names `uid`
/// and is still marked.
async fn answer(client: Client, block: String, ip: String, uid: String, seen: Shared<Seen>) {
    let record = format!("/spec/allocations/{ip}");
    let patch = json!([
        {"op": "test", "path": format!("{record}/pod/uid"), "value": uid},
        {"op": "test", "path": format!("{record}/releaseHandshake/state"), "value": "marked-for-release"},
        {"op": "replace", "path": format!("{record}/releaseHandshake/state"), "value": "ready-for-release"},
        {"op": "add", "path": format!("{record}/releaseHandshake/detail"), "value": "no sandbox on this node holds the IP"},
    ]);
    let request = http::Request::patch(format!("/apis/ipwarden.io/v1alpha1/ipblocks/{block}"))
        .header(http::header::CONTENT_TYPE, "application/json-patch+json")
        .body(patch.to_string().into_bytes());
    let result = match request {
        Ok(request) => client.request_text(request).await.map(drop).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    with(&seen, |s| match result {
        Ok(()) => s.answered += 1,
        Err(e) => {
            tracing::warn!(%block, %ip, error = %e, "scale: answering a release mark failed");
            s.answer_failures += 1;
        }
    });
}

/// The first tick of a timer ticking every `period` from `first` that is not before `at`.
fn next_tick(first: Instant, at: Instant, period: Duration) -> Instant {
    match at.checked_duration_since(first) {
        None => first,
        Some(since) => {
            let ticks = since.as_nanos().div_ceil(period.as_nanos().max(1));
            first + period.mul_f64(ticks as f64)
        }
    }
}

/// After `wait`, releases the record at `ip` of `block` as its node's agent does when the
/// runtime no longer has the sandbox: a JSON patch that applies only while the record still
/// names `uid` (whatever its handshake). Answers whether the record was released.
async fn release_as_agent(client: Client, block: String, ip: String, uid: String, wait: Duration) -> bool {
    tokio::time::sleep(wait).await;
    let record = format!("/spec/allocations/{ip}");
    let patch = json!([
        {"op": "test", "path": format!("{record}/pod/uid"), "value": uid},
        {"op": "remove", "path": record},
    ]);
    let request = http::Request::patch(format!("/apis/ipwarden.io/v1alpha1/ipblocks/{block}"))
        .header(http::header::CONTENT_TYPE, "application/json-patch+json")
        .body(patch.to_string().into_bytes());
    match request {
        Ok(request) => client.request_text(request).await.is_ok(),
        Err(_) => false,
    }
}

/// Watches every IPBlock: notes when each pod's records are first marked and when they go,
/// and answers each release mark as the simulated agents.
async fn watch_blocks(client: Client, seen: Shared<Seen>) {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ipwarden_resource("IPBlock"));
    let mut held: HashMap<String, HashMap<String, (String, Option<String>)>> = HashMap::new();
    let mut asked: HashSet<(String, String)> = HashSet::new();
    let mut answers = JoinSet::new();
    let mut events = watcher(api, watcher::Config::default()).default_backoff().boxed();
    while let Some(event) = events.next().await {
        let (name, now_held) = match event {
            Ok(watcher::Event::Apply(block) | watcher::Event::InitApply(block)) => (block.name_any(), records(&block)),
            Ok(watcher::Event::Delete(block)) => (block.name_any(), HashMap::new()),
            Ok(watcher::Event::Init | watcher::Event::InitDone) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "scale: IPBlock watch error; retrying");
                continue;
            }
        };
        let now = Instant::now();
        let before = held.insert(name.clone(), now_held.clone()).unwrap_or_default();
        let uids: HashSet<&String> = now_held.values().map(|(uid, _)| uid).collect();
        with(&seen, |s| {
            for (uid, _) in before.values().filter(|(uid, _)| !uids.contains(uid)) {
                s.released.entry(uid.clone()).or_insert(now);
            }
            for (uid, _) in now_held.values().filter(|(_, state)| state.is_some()) {
                s.marked.entry(uid.clone()).or_insert(now);
            }
        });
        for (ip, (uid, state)) in &now_held {
            if state.as_deref() == Some("marked-for-release") && asked.insert((uid.clone(), ip.clone())) {
                answers.spawn(answer(client.clone(), name.clone(), ip.clone(), uid.clone(), seen.clone()));
            }
        }
        while answers.try_join_next().is_some() {}
    }
}

/// Times read from a controller's JSON log.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogTimes {
    /// "controller starting".
    pub starting: Option<jiff::Timestamp>,
    /// "the cluster is listed; electing a leader" (before the index: "caches synced; electing a leader").
    pub synced: Option<jiff::Timestamp>,
    /// The first "leadership changed" with `leading: true`.
    pub leading: Option<jiff::Timestamp>,
    /// The first "sweep done" after it, with its report.
    pub first_sweep: Option<(jiff::Timestamp, String)>,
}

/// Reads the start-up milestones from a controller's `--log-format=json` log.
pub fn log_times(log: &str) -> LogTimes {
    let mut times = LogTimes::default();
    for line in log.lines() {
        let Ok(entry) = serde_json::from_str::<Value>(line) else { continue };
        let Some(at) = entry["timestamp"].as_str().and_then(|t| t.parse::<jiff::Timestamp>().ok()) else { continue };
        let fields = &entry["fields"];
        match fields["message"].as_str() {
            Some("controller starting") => times.starting = times.starting.or(Some(at)),
            Some("the cluster is listed; electing a leader" | "caches synced; electing a leader") => {
                times.synced = times.synced.or(Some(at))
            }
            Some("leadership changed") if fields["leading"].as_bool() == Some(true) => {
                times.leading = times.leading.or(Some(at));
            }
            Some("sweep done") if times.leading.is_some() && times.first_sweep.is_none() => {
                times.first_sweep = Some((at, fields["report"].as_str().unwrap_or_default().to_string()));
            }
            _ => {}
        }
    }
    times
}

/// The number after `name: ` in a Debug-printed struct (the logged sweep report).
pub fn debug_field(text: &str, name: &str) -> Option<u64> {
    let start = text.find(&format!("{name}: "))? + name.len() + 2;
    let digits: String = text[start..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

fn seconds_between(from: Option<jiff::Timestamp>, to: Option<jiff::Timestamp>) -> Option<f64> {
    Some(to?.duration_since(from?).as_secs_f64())
}

/// An audit log's requests in a window ([`audit_counts`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AuditCounts {
    /// By `verb resource[/subresource]`.
    pub requests: BTreeMap<String, u64>,
    /// Those answered with an error, by `verb resource[/subresource] code`.
    pub failures: BTreeMap<String, u64>,
}

/// The controllers' requests in the audit log whose reception time lies in `[from, to)`, by
/// `verb resource[/subresource]`: each request once, at `ResponseComplete`, except watches,
/// counted when they start (`ResponseStarted`), since they last.
pub fn audit_counts(log: &str, from: jiff::Timestamp, to: jiff::Timestamp) -> AuditCounts {
    let mut counts = AuditCounts::default();
    for line in log.lines() {
        let Ok(event) = serde_json::from_str::<Value>(line) else { continue };
        let verb = event["verb"].as_str().unwrap_or_default();
        let stage = event["stage"].as_str().unwrap_or_default();
        let counted = if verb == "watch" { stage == "ResponseStarted" } else { stage == "ResponseComplete" };
        let received = event["requestReceivedTimestamp"].as_str().and_then(|t| t.parse::<jiff::Timestamp>().ok());
        if !counted || !received.is_some_and(|t| t >= from && t < to) {
            continue;
        }
        let object = &event["objectRef"];
        let uri = event["requestURI"].as_str().unwrap_or_default();
        let path = uri.split('?').next().unwrap_or_default();
        let mut resource = object["resource"].as_str().unwrap_or(path).to_string();
        if let Some(sub) = object["subresource"].as_str() {
            resource = format!("{resource}/{sub}");
        }
        let request = format!("{verb} {resource}");
        if let Some(code) = event["responseStatus"]["code"].as_u64().filter(|code| *code >= 400) {
            *counts.failures.entry(format!("{request} {code}")).or_insert(0) += 1;
        }
        *counts.requests.entry(request).or_insert(0) += 1;
    }
    counts
}

/// The resources whose objects the GC judges one by one: a GET of one of them is a
/// per-record read.
const PER_RECORD: [&str; 5] = ["pods", "ipblocks", "ipclaims", "nodes", "statefulsets"];

/// Of audit counts, the GETs of single objects of [`PER_RECORD`] resources.
fn per_record_gets(counts: &BTreeMap<String, u64>) -> u64 {
    counts.iter().filter(|(key, _)| PER_RECORD.iter().any(|r| key.as_str() == format!("get {r}"))).map(|(_, n)| n).sum()
}

/// `apiserver_request_total` after minus before, by `VERB resource[/subresource]`.
pub fn request_deltas(before: &Scrape, after: &Scrape) -> BTreeMap<String, u64> {
    let key = |labels: &crate::exposition::Labels| {
        let verb = labels.get("verb").map_or("", String::as_str);
        let resource = labels.get("resource").map_or("(none)", String::as_str);
        match labels.get("subresource").filter(|s| !s.is_empty()) {
            Some(sub) => format!("{verb} {resource}/{sub}"),
            None => format!("{verb} {resource}"),
        }
    };
    let total = |scrape: &Scrape| {
        let mut sums: BTreeMap<String, f64> = BTreeMap::new();
        for sample in scrape.samples.iter().filter(|s| s.name == "apiserver_request_total") {
            *sums.entry(key(&sample.labels)).or_default() += sample.value;
        }
        sums
    };
    let earlier = total(before);
    total(after)
        .into_iter()
        .map(|(k, v)| {
            let grown = (v - earlier.get(&k).copied().unwrap_or(0.0)).max(0.0).round() as u64;
            (k, grown)
        })
        .filter(|(_, n)| *n > 0)
        .collect()
}

fn usage_of(component: &crate::process::Component) -> Result<Usage> {
    let pid = component.pid().ok_or_else(|| Error::Exited {
        component: component.name().to_string(),
        status: "not running".into(),
        log: component.log().to_path_buf(),
    })?;
    procstat::usage(pid)
}

/// CPU and peak memory of every measured process at one moment, by name.
type Usages = BTreeMap<String, Usage>;

/// Measures the controllers and etcd, kube-apiserver and kube-controller-manager.
fn measure(cluster: &mut Cluster, controllers: &[Daemon]) -> Result<Usages> {
    let mut usages = Usages::new();
    for controller in controllers {
        usages.insert(controller.name.clone(), usage_of(&controller.component)?);
    }
    let plane = cluster.control_plane();
    for name in [ComponentName::Etcd, ComponentName::Apiserver, ComponentName::ControllerManager] {
        if let Some(pid) = plane.pid(name) {
            usages.insert(name.binary().to_string(), procstat::usage(pid)?);
        }
    }
    Ok(usages)
}

/// Each process's figures from the usages measured before the controllers started, after
/// the first sweep, around the quiet window and at the end of the leak phase.
fn process_usages(phases: [&Usages; 5], leader: &str) -> Vec<ProcessUsage> {
    let [before, swept, quiet_start, quiet_end, end] = phases;
    let cpu = |from: &Usages, to: &Usages, name: &str| {
        to.get(name).map_or(0.0, |u| u.cpu_seconds) - from.get(name).map_or(0.0, |u| u.cpu_seconds)
    };
    end.iter()
        .map(|(name, usage)| ProcessUsage {
            name: name.clone(),
            leader: name == leader,
            peak_rss_mib: mib(usage.peak_rss_bytes),
            cpu_startup_seconds: cpu(before, swept, name),
            cpu_quiet_seconds: cpu(quiet_start, quiet_end, name),
            cpu_leaks_seconds: cpu(quiet_end, end, name),
        })
        .collect()
}

async fn scrape_all(controllers: &[Daemon]) -> Result<Vec<Scrape>> {
    let mut scrapes = Vec::new();
    for controller in controllers {
        scrapes.push(scrape_port(controller.metrics_port, &controller.name).await?);
    }
    Ok(scrapes)
}

fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(Error::io("reading", path))
}

/// Waits until one replica leads and has finished a full sweep; returns its index.
async fn wait_first_sweep(controllers: &[Daemon]) -> Result<usize> {
    wait::until("the leader's first full sweep", SWEEP_TIMEOUT, || async {
        let scrapes = scrape_all(controllers).await?;
        let leader = scrapes.iter().position(|s| s.sum("ipwarden_controller_leader") >= 1.0);
        Ok(match leader {
            Some(i) if scrapes[i].sum("ipwarden_gc_sweep_duration_seconds_count") >= 1.0 => Probe::Done(i),
            Some(i) => Probe::Pending(format!("{} leads, sweeping", controllers[i].name)),
            None => Probe::Pending("no replica leads yet".into()),
        })
    })
    .await
}

/// Waits until the leader has put its finalizer on every pool: the last of its start-up
/// writes, so the quiet window that follows sees the steady state.
async fn wait_pool_finalizers(client: &Client, pools: usize) -> Result<()> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &ipwarden_resource("IPPool"));
    wait::until("the pool finalizer on every pool", SWEEP_TIMEOUT, || async {
        let list = api
            .list_metadata(&kube::api::ListParams::default().labels(SCALE_LABEL))
            .await
            .map_err(Error::kube("listing the pools"))?;
        let done = list.items.iter().filter(|p| p.finalizers().iter().any(|f| f == POOL_FINALIZER)).count();
        Ok(if done >= pools { Probe::Done(()) } else { Probe::Pending(format!("{done}/{pools} pools")) })
    })
    .await
}

/// Starts the controller pair as [`CONTROLLER_ACCOUNT`] and waits until both are ready.
async fn start_controllers(cluster: &Cluster, binary: &Path, additional_grace: Duration) -> Result<Vec<Daemon>> {
    let run_as = RunAs { kubeconfig: controller_identity(cluster).await?, namespace: NAMESPACE.to_string() };
    let mut controllers = Vec::new();
    let grace = format!("--additional-grace-seconds={}", additional_grace.as_secs());
    for identity in IDENTITIES {
        let port = crate::process::free_port()?;
        let extra = ["--log-format=json", grace.as_str()];
        let component = ipwarden::start_controller_as(cluster, binary, identity, port, &extra, &run_as)?;
        controllers.push(Daemon { name: identity.to_string(), metrics_port: port, component });
    }
    for controller in &mut controllers {
        ipwarden::wait_ready(&mut controller.component, controller.metrics_port, STARTUP_TIMEOUT).await?;
    }
    Ok(controllers)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Builds the cluster's contents on `cluster` (started with [`cluster_options`]), runs the
/// controllers from `binary` and measures.
pub async fn run(cluster: &mut Cluster, binary: &Path, options: &ScaleOptions) -> Result<ScaleReport> {
    let planned = plan(options)?;
    let client = cluster.client();
    install_crds(cluster, binary).await?;
    let mut report =
        ScaleReport { nodes: options.nodes, pods: options.pods, pools: options.pools, ..ScaleReport::default() };
    let uids = fill(&client, options, &planned, &mut report.setup).await?;
    tracing::info!(seconds = report.setup.total_seconds, "scale: cluster filled; starting the controllers");

    let seen: Shared<Seen> = Arc::default();
    let mut background = JoinSet::new();
    background.spawn(watch_blocks(client.clone(), seen.clone()));
    let before = measure(cluster, &[])?;

    let controllers = start_controllers(cluster, binary, options.additional_grace).await?;
    let leader = wait_first_sweep(&controllers).await?;
    let swept = measure(cluster, &controllers)?;
    let log = read_text(controllers[leader].component.log())?;
    let times = log_times(&log);
    let sweep_report = times.first_sweep.as_ref().map(|(_, r)| r.clone()).unwrap_or_default();
    report.startup = Startup {
        leader: controllers[leader].name.clone(),
        cache_sync_seconds: seconds_between(times.starting, times.synced),
        leadership_to_first_sweep_seconds: seconds_between(times.leading, times.first_sweep.as_ref().map(|(t, _)| *t)),
        first_sweep_ms: debug_field(&sweep_report, "duration_ms"),
        first_sweep_scanned: debug_field(&sweep_report, "scanned"),
        first_sweep_report: sweep_report,
    };
    tracing::info!(startup = ?report.startup, "scale: first sweep done");
    wait_pool_finalizers(&client, options.pools).await?;

    let audit = cluster.dir().join(AUDIT_LOG);
    let quiet_start = (scrape_apiserver(&client).await?, measure(cluster, &controllers)?, jiff::Timestamp::now());
    // The quiet window is the measurement itself: whatever the controllers do in it is counted.
    tokio::time::sleep(options.quiet).await;
    let quiet_end = (jiff::Timestamp::now(), measure(cluster, &controllers)?, scrape_apiserver(&client).await?);
    report.quiet_seconds = options.quiet.as_secs_f64();
    let controller_requests = audit_counts(&read_text(&audit)?, quiet_start.2, quiet_end.0);
    report.quiet = Requests {
        controller_per_record_gets: per_record_gets(&controller_requests.requests),
        controllers: controller_requests.requests,
        controller_failures: controller_requests.failures,
        apiserver: request_deltas(&quiet_start.0, &quiet_end.2),
    };
    tracing::info!(quiet = ?report.quiet.controllers, "scale: quiet window measured");

    let leak_start = (scrape_apiserver(&client).await?, scrape_all(&controllers).await?, jiff::Timestamp::now());
    report.leaks = inject_leaks(&client, options, &planned, &uids, &seen).await?;
    let leak_end = (jiff::Timestamp::now(), measure(cluster, &controllers)?, scrape_apiserver(&client).await?);
    let controller_requests = audit_counts(&read_text(&audit)?, leak_start.2, leak_end.0);
    report.leaks.requests = Requests {
        controller_per_record_gets: per_record_gets(&controller_requests.requests),
        controllers: controller_requests.requests,
        controller_failures: controller_requests.failures,
        apiserver: request_deltas(&leak_start.0, &leak_end.2),
    };
    let after = scrape_all(&controllers).await?;
    report.leaks.releases_by_trigger = grown_by(&leak_start.1, &after, "ipwarden_gc_releases_total", "trigger");
    report.leaks.skips_by_reason = grown_by(&leak_start.1, &after, "ipwarden_gc_skips_total", "reason");
    with(&seen, |s| (report.leaks.answered, report.leaks.answer_failures) = (s.answered, s.answer_failures));

    let leader_name = controllers[leader].name.clone();
    let processes = process_usages([&before, &swept, &quiet_start.1, &quiet_end.1, &leak_end.1], &leader_name);
    (report.controllers, report.control_plane) =
        processes.into_iter().partition(|p| controllers.iter().any(|c| c.name == p.name));
    background.abort_all();
    Ok(report)
}

/// Deletes the leaked pods (grace period 0: no kubelet would finish a graceful deletion),
/// leaving their records (bare pods: no claims), and waits until the controller released every
/// record.
async fn inject_leaks(
    client: &Client,
    options: &ScaleOptions,
    planned: &[PlannedPod],
    uids: &[String],
    seen: &Shared<Seen>,
) -> Result<Leaks> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let chosen = leaked(options);
    let started = Instant::now();
    let deleted: Vec<(String, Instant, Option<tokio::task::JoinHandle<bool>>)> =
        bounded(chosen, options.concurrency, |i| {
            let pods = pods.clone();
            let (name, uid) = (planned[i].name.clone(), uids[i].clone());
            let agent = options.agents_ask_runtime.then(|| {
                let pod = &planned[i];
                let phase = AGENT_RUNTIME_POLL.mul_f64(pod.node as f64 / options.nodes.max(1) as f64);
                (block_name(pod.pool, pod.block), pod.ip.to_string(), phase)
            });
            async move {
                let params = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
                pods.delete(&name, &params).await.map_err(Error::kube(format!("deleting Pod {name}")))?;
                let at = Instant::now();
                let release = agent.map(|(block, ip, phase)| {
                    let wait = next_tick(started + phase, at, AGENT_RUNTIME_POLL).saturating_duration_since(at);
                    tokio::spawn(release_as_agent(client.clone(), block, ip, uid.clone(), wait))
                });
                Ok((uid, at, release))
            }
        })
        .await?;
    let mut released_by_agents = 0;
    let deleted: Vec<(String, Instant)> = {
        let mut kept = Vec::new();
        for (uid, at, release) in deleted {
            if let Some(release) = release {
                released_by_agents += u64::from(release.await.unwrap_or(false));
            }
            kept.push((uid, at));
        }
        kept
    };
    let delete_seconds = since(started);
    let leaked_uids: Vec<String> = deleted.iter().map(|(uid, _)| uid.clone()).collect();
    let waited = wait::until("every leaked record released", options.leak_timeout, || {
        let pending = with(seen, |s| leaked_uids.iter().filter(|uid| !s.released.contains_key(*uid)).count());
        async move {
            Ok(if pending == 0 { Probe::Done(()) } else { Probe::Pending(format!("{pending} records not released")) })
        }
    })
    .await;
    let unreclaimed = match waited {
        Ok(()) => String::new(),
        Err(Error::Timeout { last, .. }) => last,
        Err(e) => return Err(e),
    };
    let all_reclaimed_seconds = since(started);
    with(seen, |s| {
        let mut reclaim = Vec::new();
        let mut lag = Vec::new();
        for (uid, at) in &deleted {
            let released = s.released.get(uid);
            if let Some(gone) = released {
                reclaim.push(gone.saturating_duration_since(*at).as_secs_f64());
            }
            if let Some(first) = s.marked.get(uid).or(released) {
                lag.push(first.saturating_duration_since(*at).as_secs_f64());
            }
        }
        Ok(Leaks {
            injected: deleted.len(),
            reclaimed: reclaim.len(),
            all_reclaimed_seconds,
            delete_seconds,
            reclaim: Span::of(reclaim),
            watch_lag: Span::of(lag),
            released_by_agents,
            unreclaimed,
            ..Leaks::default()
        })
    })
}

/// Seconds for people: milliseconds below one second, `-` without a value.
fn seconds(value: Option<f64>) -> String {
    match value {
        None => "-".to_string(),
        Some(s) if s < 1.0 => format!("{:.1} ms", s * 1000.0),
        Some(s) => format!("{s:.2} s"),
    }
}

fn listed(counts: &BTreeMap<String, u64>) -> String {
    let items: Vec<String> = counts.iter().map(|(key, n)| format!("{key} {n}")).collect();
    if items.is_empty() { "none".to_string() } else { items.join(", ") }
}

impl std::fmt::Display for ScaleReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.setup;
        writeln!(
            f,
            "scale: {} nodes, {} pods ({} in {} StatefulSets), {} pools, {} blocks",
            self.nodes, self.pods, s.sticky_pods, s.statefulsets, self.pools, s.blocks
        )?;
        writeln!(
            f,
            "setup: {:.1} s (nodes {:.1}, agent Leases {:.1}, pools+StatefulSets {:.1}, pods {:.1}, blocks {:.1}, claims {:.1})",
            s.total_seconds,
            s.nodes_seconds,
            s.agent_leases_seconds,
            s.pools_and_statefulsets_seconds,
            s.pods_seconds,
            s.blocks_seconds,
            s.claims_seconds
        )?;
        let st = &self.startup;
        writeln!(f, "leader: {}; cache sync {}", st.leader, seconds(st.cache_sync_seconds))?;
        writeln!(
            f,
            "leadership -> end of first sweep: {} (sweep's own duration {} ms, {} records scanned)",
            seconds(st.leadership_to_first_sweep_seconds),
            st.first_sweep_ms.map_or("-".to_string(), |v| v.to_string()),
            st.first_sweep_scanned.map_or("-".to_string(), |v| v.to_string())
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "{:<24} {:>6} {:>10} {:>12} {:>10} {:>10}",
            "process", "leader", "peak MiB", "CPU start", "CPU quiet", "CPU leaks"
        )?;
        for p in self.controllers.iter().chain(&self.control_plane) {
            let leader = if p.leader { "yes" } else { "" };
            writeln!(
                f,
                "{:<24} {leader:>6} {:>10.1} {:>12.2} {:>10.2} {:>10.2}",
                p.name, p.peak_rss_mib, p.cpu_startup_seconds, p.cpu_quiet_seconds, p.cpu_leaks_seconds
            )?;
        }
        writeln!(f)?;
        writeln!(f, "quiet {:.0} s, controllers' requests: {}", self.quiet_seconds, listed(&self.quiet.controllers))?;
        writeln!(f, "quiet, controllers' per-record GETs: {}", self.quiet.controller_per_record_gets)?;
        writeln!(f, "quiet, apiserver_request_total (all clients): {}", listed(&self.quiet.apiserver))?;
        writeln!(f)?;
        let l = &self.leaks;
        writeln!(
            f,
            "leaks: {} injected ({:.1} s of deletions), {} reclaimed, all within {:.2} s{}",
            l.injected,
            l.delete_seconds,
            l.reclaimed,
            l.all_reclaimed_seconds,
            if l.unreclaimed.is_empty() { String::new() } else { format!(" — NOT ALL: {}", l.unreclaimed) }
        )?;
        writeln!(f, "{:<44} {:>8} {:>10} {:>10} {:>10}", "per leak", "samples", "p50", "p99", "max")?;
        for (what, span) in
            [("delete -> record released", &l.reclaim), ("watch lag: delete -> controller's first write", &l.watch_lag)]
        {
            writeln!(
                f,
                "{what:<44} {:>8} {:>10} {:>10} {:>10}",
                span.samples,
                seconds(span.p50_seconds),
                seconds(span.p99_seconds),
                seconds(span.max_seconds)
            )?;
        }
        writeln!(f, "marks answered by the simulated agents: {} ({} failed)", l.answered, l.answer_failures)?;
        writeln!(
            f,
            "records released by the simulated agents (the runtime lost the sandbox): {}",
            l.released_by_agents
        )?;
        writeln!(f, "GC releases by trigger: {}", listed(&l.releases_by_trigger))?;
        writeln!(f, "GC changes dropped at write time, by reason: {}", listed(&l.skips_by_reason))?;
        writeln!(f, "leaks, controllers' requests: {}", listed(&l.requests.controllers))?;
        writeln!(f, "leaks, controllers' failed requests: {}", listed(&l.requests.controller_failures))?;
        writeln!(f, "leaks, apiserver_request_total (all clients): {}", listed(&l.requests.apiserver))
    }
}

#[cfg(test)]
mod test {
    use super::*;

    fn options(nodes: usize, pods: usize, pools: usize, leaks: usize) -> ScaleOptions {
        ScaleOptions { nodes, pods, pools, leaks, ..ScaleOptions::default() }
    }

    #[test]
    fn a_nodes_next_question_is_its_first_tick_not_before_the_deletion() {
        let first = Instant::now();
        let period = Duration::from_secs(5);
        let after = |secs: f64| first + Duration::from_secs_f64(secs);
        assert_eq!(next_tick(after(2.0), first, period), after(2.0), "before the first tick: the first");
        assert_eq!(next_tick(first, after(5.0), period), after(5.0), "on a tick: that tick");
        assert_eq!(next_tick(first, after(5.1), period), after(10.0));
        assert_eq!(next_tick(after(1.0), after(12.0), period), after(16.0));
    }

    #[test]
    fn pods_spread_over_nodes_and_pools_and_fill_each_pools_blocks_in_order() {
        let planned = plan(&options(3, 250, 2, 10)).expect("plan");
        assert_eq!(planned.len(), 250);
        assert_eq!((planned[0].node, planned[0].pool, planned[0].block), (0, 0, 0));
        assert_eq!(planned[0].ip, Ipv4Addr::new(10, 0, 0, 2));
        assert_eq!(planned[1].ip, Ipv4Addr::new(10, 0, 16, 2), "pool 1 is the next /20");
        // The 61st pod of pool 0 opens its second /26 block.
        let pod = &planned[2 * RECORDS_PER_BLOCK];
        assert_eq!((pod.pool, pod.block, pod.ip), (0, 1, Ipv4Addr::new(10, 0, 0, 66)));
        assert_eq!(block_cidr(0, 1), "10.0.0.64/26");
        assert_eq!(block_name(0, 1), "scale-0000-10-0-0-64-26");
        let ips: HashSet<Ipv4Addr> = planned.iter().map(|p| p.ip).collect();
        assert_eq!(ips.len(), planned.len(), "every IP once");
        // 10% sticky: 25 pods, in whole StatefulSets of 10.
        assert_eq!(planned.iter().filter(|p| p.statefulset.is_some()).count(), 20);
        assert_eq!(planned[19].name, "scale-sts-0001-9");
        assert_eq!(planned[20].name, "scale-pod-000020");
    }

    #[test]
    fn leaks_are_bare_pods_spread_evenly() {
        let o = options(10, 1000, 10, 100);
        let chosen = leaked(&o);
        assert_eq!(chosen.len(), 100);
        assert!(chosen.iter().all(|i| *i >= sticky_pods(&o)));
        assert_eq!(chosen.iter().collect::<HashSet<_>>().len(), 100);
        assert_eq!((chosen[0], chosen[1]), (100, 109));
    }

    #[test]
    fn impossible_layouts_are_refused_with_the_reason() {
        let full = plan(&options(1, 4000, 1, 0)).expect_err("too many pods per pool");
        assert!(full.to_string().contains("a pool holds at most 3840"), "{full}");
        assert!(plan(&options(1, 10, 1, 10)).is_ok());
        let leaks = plan(&ScaleOptions { sticky_percent: 100, ..options(1, 10, 1, 1) }).expect_err("no bare pod");
        assert!(leaks.to_string().contains("only 0 pods are bare"), "{leaks}");
        assert!(plan(&options(0, 10, 1, 0)).is_err());
    }

    #[test]
    fn the_leaders_log_gives_its_start_up_milestones() {
        let log = r#"{"timestamp":"2026-11-23T10:00:00.000000Z","level":"INFO","fields":{"message":"controller starting"}}
{"timestamp":"2026-11-23T10:00:02.500000Z","level":"INFO","fields":{"message":"caches synced; electing a leader"}}
{"timestamp":"2026-11-23T10:00:02.600000Z","level":"INFO","fields":{"message":"sweep done","report":"early"}}
{"timestamp":"2026-11-23T10:00:03.000000Z","level":"INFO","fields":{"message":"leadership changed","leading":true}}
not json
{"timestamp":"2026-11-23T10:00:03.750000Z","level":"INFO","fields":{"message":"sweep done","trigger":"sweep","report":"SweepReport { scanned: 30000, planned: 0, kept: {\"in_use\": 30000}, duration_ms: 712 }"}}
{"timestamp":"2026-11-23T10:05:03.000000Z","level":"INFO","fields":{"message":"sweep done","report":"later"}}"#;
        let times = log_times(log);
        assert_eq!(seconds_between(times.starting, times.synced), Some(2.5));
        assert_eq!(seconds_between(times.leading, times.first_sweep.as_ref().map(|(t, _)| *t)), Some(0.75));
        let report = times.first_sweep.map(|(_, r)| r).unwrap_or_default();
        assert_eq!(debug_field(&report, "duration_ms"), Some(712));
        assert_eq!(debug_field(&report, "scanned"), Some(30000));
        assert_eq!(debug_field(&report, "missing"), None);
    }

    #[test]
    fn audit_counts_take_each_request_once_within_the_window() {
        let event = |verb: &str, stage: &str, at: &str, resource: &str| {
            json!({"verb": verb, "stage": stage, "requestReceivedTimestamp": at,
                "objectRef": {"resource": resource}})
            .to_string()
        };
        let log = [
            event("get", "ResponseComplete", "2026-11-23T10:00:10Z", "pods"),
            event("watch", "ResponseStarted", "2026-11-23T10:00:11Z", "pods"),
            event("watch", "ResponseComplete", "2026-11-23T10:00:11Z", "pods"),
            event("list", "ResponseComplete", "2026-11-23T09:59:59Z", "pods"),
            event("update", "ResponseComplete", "2026-11-23T10:00:20Z", "leases"),
            json!({"verb": "patch", "stage": "ResponseComplete", "requestReceivedTimestamp": "2026-11-23T10:00:30Z",
                "objectRef": {"resource": "pods", "subresource": "status"}})
            .to_string(),
            event("get", "ResponseComplete", "2026-11-23T10:01:00Z", "pods"),
            json!({"verb": "get", "stage": "ResponseComplete", "requestReceivedTimestamp": "2026-11-23T10:00:40Z",
                "requestURI": "/apis?timeout=32s"})
            .to_string(),
            event("get", "ResponseComplete", "2026-11-23T10:00:50Z", "leases"),
            json!({"verb": "update", "stage": "ResponseComplete", "requestReceivedTimestamp": "2026-11-23T10:00:55Z",
                "objectRef": {"resource": "ipblocks"}, "responseStatus": {"code": 409}})
            .to_string(),
        ]
        .join("\n");
        let at = |t: &str| t.parse::<jiff::Timestamp>().expect("timestamp");
        let counts = audit_counts(&log, at("2026-11-23T10:00:00Z"), at("2026-11-23T10:01:00Z"));
        let expected: BTreeMap<String, u64> = [
            ("get pods", 1),
            ("watch pods", 1),
            ("update leases", 1),
            ("patch pods/status", 1),
            ("get /apis", 1),
            ("get leases", 1),
            ("update ipblocks", 1),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        assert_eq!(counts.requests, expected);
        assert_eq!(counts.failures, BTreeMap::from([("update ipblocks 409".to_string(), 1)]));
        assert_eq!(per_record_gets(&counts.requests), 1, "the Lease is not a record");
    }

    #[test]
    fn request_deltas_group_the_apiserver_counter_by_verb_and_resource() {
        let scrape = |gets: u32, watches: u32| {
            Scrape::parse(&format!(
                "apiserver_request_total{{code=\"200\",resource=\"pods\",subresource=\"\",verb=\"GET\"}} {gets}\n\
                 apiserver_request_total{{code=\"404\",resource=\"pods\",subresource=\"\",verb=\"GET\"}} 1\n\
                 apiserver_request_total{{code=\"200\",resource=\"pods\",subresource=\"status\",verb=\"PATCH\"}} 4\n\
                 apiserver_request_total{{code=\"0\",resource=\"ipblocks\",verb=\"WATCH\"}} {watches}\n"
            ))
            .expect("valid exposition")
        };
        let deltas = request_deltas(&scrape(10, 1), &scrape(13, 3));
        let expected: BTreeMap<String, u64> =
            [("GET pods", 3), ("WATCH ipblocks", 2)].into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        assert_eq!(deltas, expected);
    }

    #[test]
    fn spans_report_nearest_rank_quantiles_and_the_maximum() {
        let span = Span::of((1..=100).rev().map(f64::from).collect());
        assert_eq!(
            (span.samples, span.p50_seconds, span.p99_seconds, span.max_seconds),
            (100, Some(50.0), Some(99.0), Some(100.0))
        );
        assert_eq!(Span::of(Vec::new()).max_seconds, None);
    }
}
