//! The churn benchmark behind `ipwarden-e2e churn`: bare pods are created at a set rate,
//! round robin over the nodes, and deleted after a fixed lifetime; a share of them lose their
//! CNI DEL (leaks the controller must reclaim) and a share are force-deleted. Then a bounded
//! wait until every record of a deleted pod is released, and a [`Report`]: allocation and
//! reclaim latency, apiserver writes per pod life, controller CPU and peak memory, and IP
//! conflicts seen between live pods. The IPAM under test is ipwarden or a peer
//! ([`crate::peers`]): the same workload, each measured by its own records and resources.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde::Serialize;
use serde_json::json;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::cluster::Cluster;
use crate::error::{Error, Result};
use crate::exposition::{Histogram, Labels, Scrape};
use crate::ipwarden;
use crate::kubelet::{SKIP_DEL_ANNOTATION, SandboxSource};
use crate::peers::{Installed, Ipam, Measured};
use crate::procstat::{self, Usage};
use crate::storm::{REPLICAS, StormReport};
use crate::wait::{self, Probe};

/// The namespace churn pods live in.
const NAMESPACE: &str = "default";

/// The label every churn pod carries.
const CHURN_LABEL: &str = "e2e.ipwarden.io/churn";

/// The pods' grace period: short, so a traced pod's deadline comes soon after its deletion.
const GRACE_SECONDS: i64 = 1;

/// How often the pods are checked for an IP held by two live pods.
const CONFLICT_POLL: Duration = Duration::from_secs(1);

/// How long the watches may take to list the cluster before churn starts.
const WATCH_SYNC_TIMEOUT: Duration = Duration::from_secs(60);

/// The namespace of the nodes' heartbeat Leases, which are no IPAM's writes.
const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";

/// The apiserver request verbs that write.
pub(crate) const WRITE_VERBS: [&str; 6] = ["POST", "PUT", "PATCH", "APPLY", "DELETE", "DELETECOLLECTION"];

/// What load to apply.
#[derive(Clone, Debug)]
pub struct ChurnOptions {
    /// Pods created per second, across all nodes.
    pub rate: f64,
    /// How long pods are created for.
    pub duration: Duration,
    /// How long each pod lives before it is deleted.
    pub lifetime: Duration,
    /// Percent of pods whose CNI DEL the runtime loses (leaks for the GC).
    pub leak_percent: u32,
    /// Percent of pods deleted with grace period 0.
    pub force_percent: u32,
    /// How long to wait after the last deletion for every record of a deleted pod to go.
    pub settle_timeout: Duration,
}

impl Default for ChurnOptions {
    fn default() -> Self {
        Self {
            rate: 2.0,
            duration: Duration::from_secs(120),
            lifetime: Duration::from_secs(10),
            leak_percent: 10,
            force_percent: 10,
            settle_timeout: Duration::from_secs(300),
        }
    }
}

/// How a churn pod ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fate {
    /// Deleted with its grace period; the kubelet calls CNI DEL.
    Deleted,
    /// Deleted with its grace period, but the runtime loses its CNI DEL: a leak.
    Leaked,
    /// Deleted with grace period 0: the pod object goes at once, CNI DEL follows.
    ForceDeleted,
}

/// The fate of the `n`th pod. Every 100 consecutive pods hold exactly `leak_percent` leaked
/// and `force_percent` force-deleted ones, spread out: `n * 37 mod 100` visits each slot of
/// 0..100 once per hundred pods since 37 and 100 are coprime.
pub fn fate(n: u64, leak_percent: u32, force_percent: u32) -> Fate {
    let slot = (n % 100) * 37 % 100;
    if slot < u64::from(leak_percent) {
        Fate::Leaked
    } else if slot < u64::from(leak_percent) + u64::from(force_percent) {
        Fate::ForceDeleted
    } else {
        Fate::Deleted
    }
}

/// Latency figures of one kind of event.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Latency {
    /// How many events were measured.
    pub samples: u64,
    /// The median, in seconds.
    pub p50_seconds: Option<f64>,
    /// The 99th percentile, in seconds.
    pub p99_seconds: Option<f64>,
}

impl Latency {
    /// From a histogram's buckets, interpolated as `histogram_quantile` does.
    pub fn of_histogram(histogram: &Histogram) -> Self {
        Self {
            samples: histogram.count().round() as u64,
            p50_seconds: histogram.quantile(0.5),
            p99_seconds: histogram.quantile(0.99),
        }
    }

    /// From exact measurements, by nearest rank.
    pub fn of_samples(mut seconds: Vec<f64>) -> Self {
        seconds.sort_by(f64::total_cmp);
        Self {
            samples: seconds.len() as u64,
            p50_seconds: nearest_rank(&seconds, 0.5),
            p99_seconds: nearest_rank(&seconds, 0.99),
        }
    }
}

/// The nearest-rank `q` quantile of sorted values: the smallest value with at least a
/// fraction `q` of the values at or below it.
pub(crate) fn nearest_rank(sorted: &[f64], q: f64) -> Option<f64> {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.max(1) - 1).copied()
}

/// How many pods of each kind the run created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PodCounts {
    /// Pods created.
    pub created: u64,
    /// Of those, with their CNI DEL lost.
    pub leaked: u64,
    /// Of those, force-deleted.
    pub force_deleted: u64,
    /// Of those, seen with an IP in their status.
    pub got_ip: u64,
    /// Create or delete calls that failed (logged; the run goes on).
    pub api_failures: u64,
}

/// Apiserver writes on one resource during the run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ResourceWrites {
    /// Write requests (POST, PUT, PATCH, APPLY, DELETE), any response code.
    pub writes: u64,
    /// Of those, answered 409 Conflict.
    pub conflicts: u64,
}

/// The IPAM's apiserver writes during the run, against the pod lives they paid for.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Writes {
    /// Writes on each of the IPAM's own resources ([`Ipam::write_resources`]).
    pub by_resource: BTreeMap<String, ResourceWrites>,
    /// Lease updates outside kube-node-lease seen by a watch (the control plane runs without
    /// leader election, so these are the IPAM's: Whereabouts' lock, ipwarden's leader Lease).
    pub lease_updates: u64,
    /// All of the above.
    pub total: u64,
    /// `total / pods created`.
    pub per_pod_life: Option<f64>,
    /// Writes on the objects holding the records ([`Ipam::records`]; ipwarden: IPBlocks) per
    /// pod created.
    pub record_writes_per_pod_life: Option<f64>,
    /// Of those writes, the 409 Conflict answers per pod whose record was released.
    pub record_conflicts_per_release: Option<f64>,
    /// Successful allocations by ipwarden's agents (0 for a peer: no such counter).
    pub allocations: u64,
    /// IPs released by ipwarden's agents (CNI DEL, CNI GC, start-up GC).
    pub agent_releases: u64,
    /// Records released by ipwarden's controller (the GC).
    pub controller_releases: u64,
}

/// One controller replica's resource use.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ControllerUsage {
    /// Its identity.
    pub identity: String,
    /// Whether it led at the end of the run.
    pub leader: bool,
    /// CPU seconds (user + system) used during the run.
    pub cpu_seconds: f64,
    /// Peak resident memory since it started, in MiB.
    pub peak_rss_mib: f64,
}

/// What the controllers' GC did during the run, from their counters: why IPs took as long as
/// they did to come back.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GcActivity {
    /// `ipwarden_gc_releases_total` by `trigger` (trace, handshake, sweep, manual).
    pub releases_by_trigger: BTreeMap<String, u64>,
    /// `ipwarden_gc_release_handshakes_total` by `step` (marked, aborted).
    pub handshakes_by_step: BTreeMap<String, u64>,
    /// `ipwarden_gc_skips_total` by `reason`.
    pub skips_by_reason: BTreeMap<String, u64>,
}

/// IPs seen on two live pods at once, and compare-and-swap retries.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Conflicts {
    /// Distinct (IP, pods) pairs whose pods' sandboxes held the IP at once: must be 0.
    pub ip_conflicts: usize,
    /// Up to ten of them, `ip: pod, pod`.
    pub examples: Vec<String>,
    /// Distinct IPs a deleted pod still showed in the API after its sandbox let go of them,
    /// while another pod had them (not conflicts: kubelet had yet to confirm the deletion).
    pub lingering: usize,
    /// Up to ten of them, `ip: holder; sandbox gone: pod`.
    pub lingering_examples: Vec<String>,
    /// How many times the pods were checked.
    pub polls: u64,
    /// IPBlock writes the agents retried after a resourceVersion conflict.
    pub agent_cas_retries: u64,
    /// IPBlock writes the controllers retried after a resourceVersion conflict.
    pub controller_cas_retries: u64,
}

/// Everything the run measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    /// The IPAM measured.
    pub ipam: String,
    /// Simulated nodes.
    pub nodes: usize,
    /// Pods created per second.
    pub rate_per_second: f64,
    /// Seconds of pod creation.
    pub duration_seconds: f64,
    /// Seconds each pod lived.
    pub lifetime_seconds: f64,
    /// Seconds from the first creation to the end of the settle wait (the window of the
    /// counters and CPU figures).
    pub window_seconds: f64,
    /// The pods.
    pub pods: PodCounts,
    /// Time the agents took to serve an ADD (agents' allocation histogram).
    pub allocation_agent: Latency,
    /// From the create call to the pod's status showing its IP (pod watch).
    pub allocation_end_to_end: Latency,
    /// From the delete call to the pod's record leaving the IPAM's records (ipwarden: its
    /// IPBlock; Whereabouts: its IPPool), pods deleted gracefully (released on CNI DEL).
    pub release_deleted: Latency,
    /// The same for force-deleted pods.
    pub release_force_deleted: Latency,
    /// The same for leaked pods (released by the runtime's CNI GC through the agent, or by the
    /// IPAM's controller).
    pub reclaim_leaked: Latency,
    /// ipwarden controllers' reclaim latency histogram: from a traced pod's end to its IP free.
    pub reclaim_controller: Latency,
    /// Apiserver writes.
    pub writes: Writes,
    /// The controller replicas.
    pub controllers: Vec<ControllerUsage>,
    /// The GC's releases, handshakes and skips.
    pub gc: GcActivity,
    /// Conflicts.
    pub conflicts: Conflicts,
    /// Whether every record of a deleted pod was released within the settle bound.
    pub settled: bool,
    /// Seconds from the last deletion to settled (or to giving up).
    pub settle_seconds: f64,
    /// What was still pending when the settle wait gave up; empty when settled.
    pub unsettled: String,
    /// The StatefulSet scale storm on a pool of 5 IPs, on a cluster of its own, when run.
    pub storm: Option<StormReport>,
    /// Why the storm was not run, when it was not.
    pub storm_skipped: String,
}

/// The metrics and resource use of everything measured, at one moment.
pub(crate) struct Snapshot {
    pub(crate) agents: Vec<Scrape>,
    pub(crate) controllers: Vec<Scrape>,
    pub(crate) apiserver: Scrape,
    pub(crate) usage: Vec<Usage>,
    /// Lease updates seen so far by the lease watch.
    pub(crate) lease_updates: u64,
}

pub(crate) async fn scrape_port(port: u16, what: &str) -> Result<Scrape> {
    let text = ipwarden::get(port, "/metrics").await?;
    Scrape::parse(&text).map_err(|source| Error::Scrape { what: what.to_string(), source })
}

pub(crate) async fn snapshot(client: &Client, installed: &Installed, lease_updates: &AtomicU64) -> Result<Snapshot> {
    let scrape_all = async |processes: &[Measured<'_>]| -> Result<Vec<Scrape>> {
        let mut scrapes = Vec::new();
        for process in processes {
            if let Some(port) = process.metrics_port {
                scrapes.push(scrape_port(port, process.name).await?);
            }
        }
        Ok(scrapes)
    };
    let agents = scrape_all(&installed.agents()).await?;
    let controllers = installed.controllers();
    let scraped = scrape_all(&controllers).await?;
    let mut usage = Vec::new();
    for controller in &controllers {
        let pid = controller.component.pid().ok_or_else(|| Error::Exited {
            component: controller.name.to_string(),
            status: "not running".into(),
            log: controller.component.log().to_path_buf(),
        })?;
        usage.push(procstat::usage(pid)?);
    }
    let apiserver = scrape_apiserver(client).await?;
    let lease_updates = lease_updates.load(Ordering::Relaxed);
    Ok(Snapshot { agents, controllers: scraped, apiserver, usage, lease_updates })
}

/// The apiserver's own `/metrics`, read with `client`.
pub(crate) async fn scrape_apiserver(client: &Client) -> Result<Scrape> {
    let mut request = http::Request::new(Vec::new());
    *request.uri_mut() = http::Uri::from_static("/metrics");
    let text = client.request_text(request).await.map_err(Error::kube("reading the apiserver's /metrics"))?;
    Scrape::parse(&text).map_err(|source| Error::Scrape { what: "kube-apiserver".into(), source })
}

/// What the watches and the pod workers saw, keyed by pod UID.
#[derive(Default)]
pub(crate) struct Timeline {
    /// Pods created, with their fate and when they were created and deleted.
    pods: HashMap<String, PodTimes>,
    /// When each pod's status first showed an IP.
    pub(crate) ip_seen: HashMap<String, Instant>,
    /// When each pod's (`namespace/name`) last record left the IPAM's records.
    pub(crate) released: HashMap<String, Instant>,
    api_failures: u64,
}

struct PodTimes {
    /// `namespace/name`: how the IPAMs' records name the pod (churn names are unique).
    key: String,
    fate: Fate,
    created: Instant,
    deleted: Option<Instant>,
}

/// State shared between the benchmark's tasks.
pub(crate) type Shared<T> = Arc<Mutex<T>>;

/// Runs `f` on the state behind `shared`.
pub(crate) fn with<T, R>(shared: &Shared<T>, f: impl FnOnce(&mut T) -> R) -> R {
    // A poisoned lock means a panicking task; the data is still the best there is.
    let mut guard = shared.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    f(&mut guard)
}

/// Notes when each pod's records leave the IPAM's records, from a watch of all of them.
async fn watch_releases(client: Client, ipam: Ipam, timeline: Shared<Timeline>) {
    let records: Api<DynamicObject> = Api::all_with(client, &ipam.records());
    let mut held: HashMap<String, HashSet<String>> = HashMap::new();
    let mut events = watcher(records, watcher::Config::default()).default_backoff().boxed();
    while let Some(event) = events.next().await {
        let (name, now_held) = match event {
            Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object)) => {
                let pods = ipam.held_pods(&object);
                (object.name_any(), pods)
            }
            Ok(watcher::Event::Delete(object)) => (object.name_any(), HashSet::new()),
            Ok(watcher::Event::Init | watcher::Event::InitDone) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "churn: watch of the IPAM's records failed; retrying");
                continue;
            }
        };
        let before = held.insert(name, now_held.clone()).unwrap_or_default();
        let now = Instant::now();
        with(&timeline, |t| {
            for pod in before.difference(&now_held) {
                t.released.entry(pod.clone()).or_insert(now);
            }
        });
    }
}

/// What the benchmarks' watches feed.
pub(crate) struct Watched {
    /// When pods got their IPs and when their records were released.
    pub(crate) timeline: Shared<Timeline>,
    /// Every pod of the cluster.
    pub(crate) pods: Store<Pod>,
    /// What the conflict checks saw.
    pub(crate) conflicts: Shared<ChecksSeen>,
}

/// Starts on `background` the watches of `cluster`'s pods (IP times, conflict checks against
/// its nodes' sandboxes) and of the IPAM's records (release times); returns once the pods are
/// listed (`what` names the pod watch in the timeout error).
pub(crate) async fn watch(cluster: &Cluster, ipam: Ipam, background: &mut JoinSet<()>, what: &str) -> Result<Watched> {
    let client = cluster.client();
    let timeline: Shared<Timeline> = Arc::default();
    let (pods, writer) = reflector::store::<Pod>();
    background.spawn(watch_pods(client.clone(), writer, timeline.clone()));
    background.spawn(watch_releases(client.clone(), ipam, timeline.clone()));
    let sandboxes = SandboxSource::of(cluster.nodes());
    let conflicts = watch_conflicts(pods.clone(), sandboxes, background, what).await?;
    Ok(Watched { timeline, pods, conflicts })
}

/// Counts updates of Leases outside kube-node-lease (after the initial list).
async fn watch_leases(client: Client, updates: Arc<AtomicU64>) {
    let leases: Api<Lease> = Api::all(client);
    let mut events = watcher(leases, watcher::Config::default()).default_backoff().boxed();
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Apply(lease)) if lease.namespace().as_deref() != Some(NODE_LEASE_NAMESPACE) => {
                updates.fetch_add(1, Ordering::Relaxed);
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "churn: Lease watch error; retrying"),
        }
    }
}

/// Notes when each pod's status first shows an IP, and feeds the pod store.
async fn watch_pods(client: Client, writer: reflector::store::Writer<Pod>, timeline: Shared<Timeline>) {
    let pods: Api<Pod> = Api::all(client);
    let mut applied =
        watcher(pods, watcher::Config::default()).default_backoff().reflect(writer).applied_objects().boxed();
    while let Some(pod) = applied.next().await {
        match pod {
            Ok(pod) if !pod_ips(&pod).is_empty() => {
                let now = Instant::now();
                with(&timeline, |t| {
                    t.ip_seen.entry(pod.uid().unwrap_or_default()).or_insert(now);
                });
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "churn: pod watch error; retrying"),
        }
    }
}

fn pod_ips(pod: &Pod) -> Vec<String> {
    let Some(status) = pod.status.as_ref() else { return Vec::new() };
    let mut ips: Vec<String> = status.pod_ips.iter().flatten().map(|ip| ip.ip.clone()).collect();
    if ips.is_empty() {
        ips.extend(status.pod_ip.clone());
    }
    ips
}

/// The IPs that two or more live (not Succeeded or Failed), non-host-network pods report at
/// once, told apart by what the runtimes hold (`sandboxes`: the IPs of each pod's sandbox, by
/// pod UID; `None` when unknown, and every holder then counts as holding the IP).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SharedIps {
    /// IPs two or more pods' sandboxes hold at once: a real conflict, each as
    /// `ip: ns/pod (uid), ns/pod (uid)`.
    pub conflicts: Vec<String>,
    /// IPs that a pod still reports in the API after its sandbox let go of them (a deleted pod
    /// whose DEL freed the IP, not yet removed) while another pod has them: not a conflict,
    /// each as `ip: ns/pod (uid), ...; sandbox gone: ns/pod (uid), ...`.
    pub lingering: Vec<String>,
}

/// Classifies the IPs of `pods` that two or more of them report ([`SharedIps`]).
pub fn shared_ips<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    sandboxes: Option<&HashMap<String, BTreeSet<String>>>,
) -> SharedIps {
    let mut holders: HashMap<String, BTreeMap<String, bool>> = HashMap::new();
    for pod in pods {
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
        let host_network = pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false);
        if host_network || phase == "Succeeded" || phase == "Failed" {
            continue;
        }
        let uid = pod.uid().unwrap_or_default();
        let key = format!("{}/{} ({uid})", pod.namespace().unwrap_or_default(), pod.name_any());
        for ip in pod_ips(pod) {
            let held = sandboxes.is_none_or(|s| s.get(&uid).is_some_and(|ips| ips.contains(&ip)));
            holders.entry(ip).or_default().insert(key.clone(), held);
        }
    }
    let mut found = SharedIps::default();
    for (ip, pods) in holders.into_iter().filter(|(_, pods)| pods.len() > 1) {
        let (held, gone): (Vec<_>, Vec<_>) = pods.into_iter().partition(|(_, held)| *held);
        let names = |pods: Vec<(String, bool)>| pods.into_iter().map(|(key, _)| key).collect::<Vec<_>>().join(", ");
        if held.len() > 1 {
            found.conflicts.push(format!("{ip}: {}", names(held)));
        } else {
            found.lingering.push(format!("{ip}: {}; sandbox gone: {}", names(held), names(gone)));
        }
    }
    found.conflicts.sort();
    found.lingering.sort();
    found
}

/// What the conflict checks saw.
#[derive(Clone, Debug, Default)]
pub(crate) struct ChecksSeen {
    /// Every distinct conflict ([`SharedIps::conflicts`]).
    pub(crate) conflicts: BTreeSet<String>,
    /// Every distinct lingering IP ([`SharedIps::lingering`]).
    pub(crate) lingering: BTreeSet<String>,
    /// How many checks ran.
    pub(crate) polls: u64,
}

/// Waits until `watch` (which feeds `store`) has listed the pods, then checks them for
/// conflicts, against what `sandboxes` hold, every [`CONFLICT_POLL`] in a task on
/// `background`; returns what the checks see.
pub(crate) async fn watch_conflicts(
    store: Store<Pod>,
    sandboxes: SandboxSource,
    background: &mut JoinSet<()>,
    watch: &str,
) -> Result<Shared<ChecksSeen>> {
    let synced = tokio::time::timeout(WATCH_SYNC_TIMEOUT, store.wait_until_ready()).await;
    if !matches!(synced, Ok(Ok(()))) {
        return Err(Error::Timeout {
            what: format!("{watch} to list the pods"),
            timeout: WATCH_SYNC_TIMEOUT,
            last: format!("{synced:?}"),
        });
    }
    let seen: Shared<ChecksSeen> = Arc::default();
    background.spawn(poll_conflicts(store, sandboxes, seen.clone()));
    Ok(seen)
}

/// Checks the pod store for conflicts every [`CONFLICT_POLL`] until aborted. The runtimes are
/// read after the pods: a sandbox torn down in between makes its pod's IP lingering, one set up
/// in between is not in the API yet.
async fn poll_conflicts(store: Store<Pod>, sandboxes: SandboxSource, seen: Shared<ChecksSeen>) {
    let mut ticker = tokio::time::interval(CONFLICT_POLL);
    loop {
        ticker.tick().await;
        let state = store.state();
        let held = sandboxes.ips_by_pod();
        let found = shared_ips(state.iter().map(|pod| &**pod), Some(&held));
        with(&seen, |seen| {
            seen.polls += 1;
            for conflict in found.conflicts {
                if seen.conflicts.insert(conflict.clone()) {
                    tracing::error!(%conflict, "churn: an IP is held by two live pods");
                }
            }
            for lingering in found.lingering {
                if seen.lingering.insert(lingering.clone()) {
                    tracing::info!(%lingering, "churn: a deleted pod still shows an IP its sandbox let go");
                }
            }
        });
    }
}

/// A churn pod `name` bound to `node`, annotated to lose its CNI DEL when it is to leak.
pub(crate) fn manifest(name: &str, node: &str, fate: Fate) -> Result<Pod> {
    let mut annotations = serde_json::Map::new();
    if fate == Fate::Leaked {
        annotations.insert(SKIP_DEL_ANNOTATION.into(), json!("true"));
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {CHURN_LABEL: "true"}, "annotations": annotations},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": GRACE_SECONDS,
            "containers": [{"name": "app", "image": "registry.invalid/ipwarden-churn/app:1"}],
        },
    }))
    .map_err(|e| Error::Kube { what: format!("building pod {name}"), source: kube::Error::SerdeError(e) })
}

/// One pod's life: created, kept for `lifetime`, deleted as its fate says.
async fn live(pods: Api<Pod>, manifest: Pod, fate: Fate, lifetime: Duration, timeline: Shared<Timeline>) {
    let name = manifest.name_any();
    let created = Instant::now();
    let uid = match pods.create(&PostParams::default(), &manifest).await {
        Ok(pod) => pod.uid().unwrap_or_default(),
        Err(e) => {
            tracing::warn!(pod = %name, error = %e, "churn: creating the pod failed");
            with(&timeline, |t| t.api_failures += 1);
            return;
        }
    };
    let key = format!("{NAMESPACE}/{name}");
    with(&timeline, |t| t.pods.insert(uid.clone(), PodTimes { key, fate, created, deleted: None }));
    // The pod's lifetime is the workload, not a wait for a condition.
    tokio::time::sleep_until(created + lifetime).await;
    let params = match fate {
        Fate::ForceDeleted => DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() },
        Fate::Deleted | Fate::Leaked => DeleteParams::default(),
    };
    let deleted = Instant::now();
    match pods.delete(&name, &params).await {
        Ok(_) => with(&timeline, |t| {
            if let Some(times) = t.pods.get_mut(&uid) {
                times.deleted = Some(deleted);
            }
        }),
        Err(e) => {
            tracing::warn!(pod = %name, error = %e, "churn: deleting the pod failed");
            with(&timeline, |t| t.api_failures += 1);
        }
    }
}

/// Runs the churn on `cluster`, where `installed` runs the IPAM under test, and reports.
pub async fn run(cluster: &Cluster, installed: &Installed, options: &ChurnOptions) -> Result<Report> {
    let ipam = installed.ipam();
    let nodes: Vec<String> = cluster.nodes().iter().map(|n| n.name().to_string()).collect();
    if nodes.is_empty() {
        return Err(Error::Churn("the cluster has no nodes".into()));
    }
    // Negative, zero, infinite and NaN rates have no period (or a zero one).
    let period = Duration::try_from_secs_f64(1.0 / options.rate).ok().filter(|p| !p.is_zero()).ok_or_else(|| {
        Error::Churn(format!("the rate must be a positive number of pods per second, not {}", options.rate))
    })?;
    let client = cluster.client();
    let mut background = JoinSet::new();
    let Watched { timeline, conflicts: seen, .. } =
        watch(cluster, ipam, &mut background, "the churn's pod watch").await?;
    let lease_updates: Arc<AtomicU64> = Arc::default();
    background.spawn(watch_leases(client.clone(), lease_updates.clone()));

    let before = snapshot(&client, installed, &lease_updates).await?;
    let started = Instant::now();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut lives = JoinSet::new();
    let mut round_robin = nodes.iter().cycle();
    let mut n: u64 = 0;
    loop {
        ticker.tick().await;
        if started.elapsed() >= options.duration {
            break;
        }
        let fate = fate(n, options.leak_percent, options.force_percent);
        let Some(node) = round_robin.next() else { break };
        let manifest = manifest(&format!("churn-{n:06}"), node, fate)?;
        lives.spawn(live(pods.clone(), manifest, fate, options.lifetime, timeline.clone()));
        n += 1;
    }
    tracing::info!(pods = n, "churn: creation done; waiting for the last deletions");
    while lives.join_next().await.is_some() {}

    let last_deletion = Instant::now();
    let churned: HashSet<String> = with(&timeline, |t| t.pods.values().map(|p| p.key.clone()).collect());
    let (settled, unsettled) = match settle(&client, ipam, &churned, options.settle_timeout).await {
        Ok(()) => (true, String::new()),
        Err(Error::Timeout { last, .. }) => (false, last),
        Err(e) => return Err(e),
    };
    let settle_seconds = last_deletion.elapsed().as_secs_f64();
    let window_seconds = started.elapsed().as_secs_f64();
    let after = snapshot(&client, installed, &lease_updates).await?;
    background.abort_all();
    let conflicts_seen = with(&seen, |seen| seen.clone());
    let identities: Vec<String> = installed.controllers().iter().map(|c| c.name.to_string()).collect();
    let report = with(&timeline, |timeline| Report {
        ipam: ipam.to_string(),
        nodes: nodes.len(),
        rate_per_second: options.rate,
        duration_seconds: options.duration.as_secs_f64(),
        lifetime_seconds: options.lifetime.as_secs_f64(),
        window_seconds,
        settled,
        settle_seconds,
        unsettled,
        ..measure(ipam, &before, &after, timeline, &identities, conflicts_seen)
    });
    Ok(report)
}

/// Waits until no churn pod is left and no record of the IPAM names one.
async fn settle(client: &Client, ipam: Ipam, churned: &HashSet<String>, timeout: Duration) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let records: Api<DynamicObject> = Api::all_with(client.clone(), &ipam.records());
    wait::until("every record of a deleted churn pod released", timeout, || {
        let (pods, records) = (pods.clone(), records.clone());
        async move {
            let left = pods
                .list(&ListParams::default().labels(&format!("{CHURN_LABEL}=true")))
                .await
                .map_err(Error::kube("listing churn pods"))?
                .items
                .len();
            let held = records
                .list(&ListParams::default())
                .await
                .map_err(Error::kube(format!("listing {}", ipam.records().plural)))?
                .items
                .iter()
                .flat_map(|object| ipam.held_pods(object))
                .filter(|pod| churned.contains(pod))
                .count();
            Ok(if left == 0 && held == 0 {
                Probe::Done(())
            } else {
                Probe::Pending(format!("{left} churn pods left, {held} records of churn pods held"))
            })
        }
    })
    .await
}

fn counter(scrapes: &[Scrape], name: &str, select: impl Fn(&Labels) -> bool + Copy) -> f64 {
    scrapes.iter().map(|s| s.sum_where(name, select)).sum()
}

/// Histogram `name` of all `scrapes`, added bucket by bucket.
pub(crate) fn histogram(scrapes: &[Scrape], name: &str) -> Histogram {
    let mut total = Histogram::default();
    for scrape in scrapes {
        total.merge(&scrape.histogram(name));
    }
    total
}

/// Counter `name` summed over `select`ed label sets, after minus before.
pub(crate) fn grown(before: &[Scrape], after: &[Scrape], name: &str, select: impl Fn(&Labels) -> bool + Copy) -> u64 {
    (counter(after, name, select) - counter(before, name, select)).max(0.0).round() as u64
}

/// Counter `name` after minus before, for each value of label `label` that grew.
pub(crate) fn grown_by(before: &[Scrape], after: &[Scrape], name: &str, label: &str) -> BTreeMap<String, u64> {
    let values: BTreeSet<&String> = after
        .iter()
        .flat_map(|scrape| scrape.samples.iter())
        .filter(|sample| sample.name == name)
        .filter_map(|sample| sample.labels.get(label))
        .collect();
    values
        .into_iter()
        .map(|value| (value.clone(), grown(before, after, name, |l| l.get(label) == Some(value))))
        .filter(|(_, count)| *count > 0)
        .collect()
}

/// Writes on `resource` (as `apiserver_request_total` labels it) between two scrapes of the
/// apiserver, whatever their answer, with the 409 Conflict answers among them.
pub(crate) fn resource_writes(before: &Scrape, after: &Scrape, resource: &str) -> ResourceWrites {
    let writes_on = |conflicts_only: bool| {
        move |labels: &Labels| {
            labels.get("resource").is_some_and(|r| r == resource)
                && labels.get("verb").is_some_and(|v| WRITE_VERBS.contains(&v.as_str()))
                && (!conflicts_only || labels.get("code").is_some_and(|c| c == "409"))
        }
    };
    let (before, after) = (std::slice::from_ref(before), std::slice::from_ref(after));
    ResourceWrites {
        writes: grown(before, after, "apiserver_request_total", writes_on(false)),
        conflicts: grown(before, after, "apiserver_request_total", writes_on(true)),
    }
}

/// `numerator / denominator`, none when nothing was divided by.
pub(crate) fn per(numerator: u64, denominator: u64) -> Option<f64> {
    (denominator > 0).then(|| numerator as f64 / denominator as f64)
}

/// The figures from two snapshots and the timeline (everything but the run's settings).
fn measure(
    ipam: Ipam,
    before: &Snapshot,
    after: &Snapshot,
    timeline: &Timeline,
    identities: &[String],
    seen: ChecksSeen,
) -> Report {
    let any = |_: &Labels| true;
    let agent_releases = grown(&before.agents, &after.agents, "ipwarden_agent_releases_total", |l| {
        l.get("result").is_some_and(|r| r == "released")
    });
    let controller_releases = grown(&before.controllers, &after.controllers, "ipwarden_gc_releases_total", any);
    let by_resource: BTreeMap<String, ResourceWrites> = ipam
        .write_resources()
        .iter()
        .map(|resource| (resource.to_string(), resource_writes(&before.apiserver, &after.apiserver, resource)))
        .collect();
    let lease_updates = after.lease_updates.saturating_sub(before.lease_updates);
    let total = by_resource.values().map(|r| r.writes).sum::<u64>() + lease_updates;
    let records = resource_writes(&before.apiserver, &after.apiserver, &ipam.records().plural);
    let released_pods = timeline.pods.values().filter(|pod| timeline.released.contains_key(&pod.key)).count();
    let writes = Writes {
        by_resource,
        lease_updates,
        total,
        per_pod_life: per(total, timeline.pods.len() as u64),
        record_writes_per_pod_life: per(records.writes, timeline.pods.len() as u64),
        record_conflicts_per_release: per(records.conflicts, released_pods as u64),
        allocations: grown(&before.agents, &after.agents, "ipwarden_agent_allocations_total", |l| {
            l.get("result").is_some_and(|r| r == "success")
        }),
        agent_releases,
        controller_releases,
    };

    let mut end_to_end = Vec::new();
    let mut released: HashMap<Fate, Vec<f64>> = HashMap::new();
    let mut pods = PodCounts { api_failures: timeline.api_failures, ..PodCounts::default() };
    for (uid, times) in &timeline.pods {
        pods.created += 1;
        match times.fate {
            Fate::Leaked => pods.leaked += 1,
            Fate::ForceDeleted => pods.force_deleted += 1,
            Fate::Deleted => {}
        }
        if let Some(seen) = timeline.ip_seen.get(uid) {
            pods.got_ip += 1;
            end_to_end.push(seen.saturating_duration_since(times.created).as_secs_f64());
        }
        if let (Some(deleted), Some(gone)) = (times.deleted, timeline.released.get(&times.key)) {
            released.entry(times.fate).or_default().push(gone.saturating_duration_since(deleted).as_secs_f64());
        }
    }
    let mut take = |fate| Latency::of_samples(released.remove(&fate).unwrap_or_default());

    let controllers = identities
        .iter()
        .zip(before.usage.iter().zip(&after.usage))
        .enumerate()
        .map(|(i, (identity, (start, end)))| ControllerUsage {
            identity: identity.clone(),
            leader: after.controllers.get(i).is_some_and(|scrape| scrape.sum("ipwarden_controller_leader") >= 1.0),
            cpu_seconds: end.cpu_seconds - start.cpu_seconds,
            peak_rss_mib: end.peak_rss_bytes as f64 / (1024.0 * 1024.0),
        })
        .collect();
    Report {
        pods,
        allocation_agent: Latency::of_histogram(
            &histogram(&after.agents, "ipwarden_agent_allocation_duration_seconds")
                .since(&histogram(&before.agents, "ipwarden_agent_allocation_duration_seconds")),
        ),
        allocation_end_to_end: Latency::of_samples(end_to_end),
        release_deleted: take(Fate::Deleted),
        release_force_deleted: take(Fate::ForceDeleted),
        reclaim_leaked: take(Fate::Leaked),
        reclaim_controller: Latency::of_histogram(
            &histogram(&after.controllers, "ipwarden_gc_reclaim_latency_seconds")
                .since(&histogram(&before.controllers, "ipwarden_gc_reclaim_latency_seconds")),
        ),
        writes,
        controllers,
        gc: GcActivity {
            releases_by_trigger: grown_by(
                &before.controllers,
                &after.controllers,
                "ipwarden_gc_releases_total",
                "trigger",
            ),
            handshakes_by_step: grown_by(
                &before.controllers,
                &after.controllers,
                "ipwarden_gc_release_handshakes_total",
                "step",
            ),
            skips_by_reason: grown_by(&before.controllers, &after.controllers, "ipwarden_gc_skips_total", "reason"),
        },
        conflicts: Conflicts {
            ip_conflicts: seen.conflicts.len(),
            examples: seen.conflicts.into_iter().take(10).collect(),
            lingering: seen.lingering.len(),
            lingering_examples: seen.lingering.into_iter().take(10).collect(),
            polls: seen.polls,
            agent_cas_retries: grown(&before.agents, &after.agents, "ipwarden_agent_conflict_retries_total", any),
            controller_cas_retries: grown(
                &before.controllers,
                &after.controllers,
                "ipwarden_gc_conflict_retries_total",
                any,
            ),
        },
        ..Report::default()
    }
}

/// Seconds for people: milliseconds below one second, `-` without a value.
pub(crate) fn seconds(value: Option<f64>) -> String {
    match value {
        None => "-".to_string(),
        Some(s) if s < 1.0 => format!("{:.1} ms", s * 1000.0),
        Some(s) => format!("{s:.2} s"),
    }
}

/// A ratio with two decimals, `-` without a value.
pub(crate) fn ratio(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_string(), |v| format!("{v:.2}"))
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.pods;
        writeln!(
            f,
            "churn of {}: {} nodes, {} pods/s for {} s, each pod living {} s",
            self.ipam, self.nodes, self.rate_per_second, self.duration_seconds, self.lifetime_seconds
        )?;
        writeln!(
            f,
            "pods: {} created ({} leaked: CNI DEL lost; {} force-deleted), {} got an IP, {} failed API calls",
            p.created, p.leaked, p.force_deleted, p.got_ip, p.api_failures
        )?;
        if self.settled {
            writeln!(f, "settled: yes, {:.1} s after the last deletion", self.settle_seconds)?;
        } else {
            writeln!(f, "settled: NO after {:.1} s: {}", self.settle_seconds, self.unsettled)?;
        }
        writeln!(f, "window of counters and CPU: {:.1} s", self.window_seconds)?;
        writeln!(f)?;
        writeln!(f, "{:<52} {:>8} {:>10} {:>10}", "latency", "samples", "p50", "p99")?;
        let rows = [
            ("allocation in the agent (agents' histogram)", &self.allocation_agent),
            ("allocation end to end (create -> status podIPs)", &self.allocation_end_to_end),
            ("release after delete (CNI DEL; delete -> record gone)", &self.release_deleted),
            ("release after force delete (same)", &self.release_force_deleted),
            ("reclaim of leaked IPs by the GC (same)", &self.reclaim_leaked),
            ("reclaim, controllers' histogram (pod end -> free)", &self.reclaim_controller),
        ];
        for (what, latency) in rows {
            let (p50, p99) = (seconds(latency.p50_seconds), seconds(latency.p99_seconds));
            writeln!(f, "{what:<52} {:>8} {p50:>10} {p99:>10}", latency.samples)?;
        }
        writeln!(f)?;
        let w = &self.writes;
        writeln!(f, "{:<52} {:>8} {:>12}", "apiserver writes", "total", "409s")?;
        for (resource, counted) in &w.by_resource {
            writeln!(f, "{resource:<52} {:>8} {:>12}", counted.writes, counted.conflicts)?;
        }
        writeln!(f, "{:<52} {:>8} {:>12}", "lease updates (outside kube-node-lease)", w.lease_updates, "-")?;
        writeln!(f, "{:<52} {:>8} {:>12}", "all, per pod life", w.total, ratio(w.per_pod_life))?;
        writeln!(
            f,
            "record objects' writes per pod life: {}; their 409s per release: {}",
            ratio(w.record_writes_per_pod_life),
            ratio(w.record_conflicts_per_release)
        )?;
        writeln!(
            f,
            "releases: {} (agents {}, controller {}); allocations: {}",
            w.agent_releases + w.controller_releases,
            w.agent_releases,
            w.controller_releases,
            w.allocations
        )?;
        writeln!(f)?;
        writeln!(f, "{:<16} {:>6} {:>14} {:>14}", "controller", "leader", "CPU seconds", "peak RSS MiB")?;
        for c in &self.controllers {
            let leader = if c.leader { "yes" } else { "no" };
            writeln!(f, "{:<16} {leader:>6} {:>14.2} {:>14.1}", c.identity, c.cpu_seconds, c.peak_rss_mib)?;
        }
        let counts = |counts: &BTreeMap<String, u64>| {
            let listed: Vec<String> = counts.iter().map(|(key, count)| format!("{key} {count}")).collect();
            if listed.is_empty() { "none".to_string() } else { listed.join(", ") }
        };
        writeln!(f, "GC releases by trigger: {}", counts(&self.gc.releases_by_trigger))?;
        writeln!(f, "GC release handshakes: {}", counts(&self.gc.handshakes_by_step))?;
        writeln!(f, "GC skips by reason: {}", counts(&self.gc.skips_by_reason))?;
        writeln!(f)?;
        let c = &self.conflicts;
        writeln!(f, "IP conflicts between live pods: {} ({} polls, one a second)", c.ip_conflicts, c.polls)?;
        for example in &c.examples {
            writeln!(f, "  {example}")?;
        }
        writeln!(f, "IPs a deleted pod still showed after its sandbox let go (not conflicts): {}", c.lingering)?;
        for example in &c.lingering_examples {
            writeln!(f, "  {example}")?;
        }
        writeln!(
            f,
            "CAS retries (resourceVersion conflicts): agents {}, controllers {}",
            c.agent_cas_retries, c.controller_cas_retries
        )?;
        match &self.storm {
            None if self.storm_skipped.is_empty() => Ok(()),
            None => writeln!(f, "\nStatefulSet scale storm: not run: {}", self.storm_skipped),
            Some(storm) => {
                let done =
                    if storm.completed { "completed".to_string() } else { format!("STOPPED: {}", storm.failure) };
                writeln!(
                    f,
                    "\nStatefulSet scale storm (2 x {} pods on {} IPs): {} cycles, {done}",
                    REPLICAS, REPLICAS, storm.cycles
                )?;
                let h = &storm.handover;
                writeln!(f, "handover p50 {}, p99 {}", seconds(h.p50_seconds), seconds(h.p99_seconds))?;
                writeln!(f, "IP conflicts between live pods: {}", storm.ip_conflicts)?;
                for example in &storm.examples {
                    writeln!(f, "  {example}")?;
                }
                writeln!(
                    f,
                    "IPs an outgoing pod still showed after its sandbox let go (not conflicts): {}",
                    storm.lingering
                )?;
                for example in &storm.lingering_examples {
                    writeln!(f, "  {example}")?;
                }
                writeln!(
                    f,
                    "pods back under a name that ran before: {}, with its last IP: {}",
                    storm.returned, storm.sticky_kept
                )
            }
        }
    }
}

/// One figure of the comparison: its name and how to read it from a report.
type Figure = (&'static str, fn(&Report) -> Option<f64>);

/// The figures [`compare`] puts side by side; all lower-is-better.
const FIGURES: [Figure; 16] = [
    ("allocation end to end p50 (s)", |r| r.allocation_end_to_end.p50_seconds),
    ("allocation end to end p99 (s)", |r| r.allocation_end_to_end.p99_seconds),
    ("release after delete p50 (s)", |r| r.release_deleted.p50_seconds),
    ("release after delete p99 (s)", |r| r.release_deleted.p99_seconds),
    ("release after force delete p50 (s)", |r| r.release_force_deleted.p50_seconds),
    ("release after force delete p99 (s)", |r| r.release_force_deleted.p99_seconds),
    ("leak reclaim p50 (s)", |r| r.reclaim_leaked.p50_seconds),
    ("leak reclaim p99 (s)", |r| r.reclaim_leaked.p99_seconds),
    ("apiserver writes per pod life", |r| r.writes.per_pod_life),
    ("record objects' writes per pod life", |r| r.writes.record_writes_per_pod_life),
    ("record objects' 409s per release", |r| r.writes.record_conflicts_per_release),
    ("409 Conflict answers", |r| Some(r.writes.by_resource.values().map(|w| w.conflicts).sum::<u64>() as f64)),
    ("controller CPU seconds (all replicas)", |r| Some(r.controllers.iter().map(|c| c.cpu_seconds).sum())),
    ("controller peak RSS MiB (all replicas)", |r| Some(r.controllers.iter().map(|c| c.peak_rss_mib).sum())),
    ("storm handover p50 (s)", |r| r.storm.as_ref().and_then(|s| s.handover.p50_seconds)),
    ("storm handover p99 (s)", |r| r.storm.as_ref().and_then(|s| s.handover.p99_seconds)),
];

/// One row of the storm's figures in [`compare`]: its name and how to write a storm's cell.
type StormRow = (&'static str, fn(&StormReport) -> String);

/// The reports of one workload run on several IPAMs, side by side: one column per IPAM with
/// its value and its ratio to the first report's (ipwarden's when it leads), then conflicts
/// and whether each run settled.
pub fn compare(reports: &[Report]) -> String {
    use std::fmt::Write;
    let mut table = String::new();
    let first = reports.first();
    let _ = write!(table, "{:<40}", "figure");
    for report in reports {
        let _ = write!(table, " {:>24}", report.ipam);
    }
    table.push('\n');
    for (name, read) in FIGURES {
        let _ = write!(table, "{name:<40}");
        let base = first.and_then(read);
        for report in reports {
            let cell = match (read(report), base) {
                (None, _) => "-".to_string(),
                (Some(value), Some(base)) if base > 0.0 => format!("{value:.3} (x{:.2})", value / base),
                (Some(value), _) => format!("{value:.3}"),
            };
            let _ = write!(table, " {cell:>24}");
        }
        table.push('\n');
    }
    let _ = write!(table, "{:<40}", "IP conflicts between live pods");
    for report in reports {
        let _ = write!(table, " {:>24}", report.conflicts.ip_conflicts);
    }
    table.push('\n');
    let storm_rows: [StormRow; 3] = [
        (
            "storm cycles completed",
            |s| if s.completed { s.cycles.to_string() } else { format!("{} (stopped)", s.cycles) },
        ),
        ("storm IP conflicts between live pods", |s| s.ip_conflicts.to_string()),
        ("storm sticky IPs kept (of pods back)", |s| format!("{} of {}", s.sticky_kept, s.returned)),
    ];
    for (name, cell) in storm_rows {
        let _ = write!(table, "{name:<40}");
        for report in reports {
            let _ = write!(table, " {:>24}", report.storm.as_ref().map_or_else(|| "-".to_string(), cell));
        }
        table.push('\n');
    }
    let _ = write!(table, "{:<40}", "settled");
    for report in reports {
        let settled = if report.settled { format!("yes ({:.1} s)", report.settle_seconds) } else { "NO".into() };
        let _ = write!(table, " {settled:>24}");
    }
    table.push('\n');
    table
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn every_hundred_pods_hold_exactly_the_asked_shares_of_leaks_and_force_deletes() {
        for start in [0, 100, 1700] {
            let fates: Vec<Fate> = (start..start + 100).map(|n| fate(n, 10, 5)).collect();
            assert_eq!(fates.iter().filter(|f| **f == Fate::Leaked).count(), 10);
            assert_eq!(fates.iter().filter(|f| **f == Fate::ForceDeleted).count(), 5);
        }
        // Spread out: no two leaks in a row within the first hundred.
        let leaks: Vec<u64> = (0..100).filter(|n| fate(*n, 10, 0) == Fate::Leaked).collect();
        assert!(leaks.windows(2).all(|w| w[1] - w[0] > 1), "{leaks:?}");
        assert!((0..100).all(|n| fate(n, 0, 0) == Fate::Deleted));
    }

    #[test]
    fn nearest_rank_quantiles_of_exact_samples() {
        let latency = Latency::of_samples((1..=100).rev().map(f64::from).collect());
        assert_eq!(latency.samples, 100);
        assert_eq!(latency.p50_seconds, Some(50.0));
        assert_eq!(latency.p99_seconds, Some(99.0));
        assert_eq!(Latency::of_samples(vec![3.0]).p99_seconds, Some(3.0));
        assert_eq!(Latency::of_samples(Vec::new()).p50_seconds, None);
    }

    fn pod(name: &str, ips: &[&str], phase: &str, host_network: bool) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
            "spec": {"hostNetwork": host_network, "containers": [{"name": "app"}]},
            "status": {"phase": phase, "podIPs": ips.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>()},
        }))
        .expect("valid pod")
    }

    #[test]
    fn an_ip_on_two_live_pods_is_a_conflict_but_not_with_a_finished_or_host_network_pod() {
        let pods = [
            pod("a", &["10.244.0.5"], "Running", false),
            pod("b", &["10.244.0.5"], "Pending", false),
            pod("c", &["10.244.0.6"], "Running", false),
            pod("d", &["10.244.0.6"], "Succeeded", false),
            pod("e", &["127.0.0.1"], "Running", true),
            pod("f", &["127.0.0.1"], "Running", true),
        ];
        let found = shared_ips(&pods, None);
        assert_eq!(found.conflicts, vec!["10.244.0.5: default/a (uid-a), default/b (uid-b)".to_string()]);
        assert!(found.lingering.is_empty());
        assert_eq!(shared_ips(&pods[2..], None), SharedIps::default());
    }

    #[test]
    fn an_ip_two_sandboxes_hold_is_a_conflict_and_one_whose_sandbox_let_go_lingers() {
        let pods = [
            pod("alpha-2", &["10.60.0.3"], "Running", false),
            pod("beta-4", &["10.60.0.3"], "Running", false),
            pod("a", &["10.60.0.4"], "Running", false),
            pod("b", &["10.60.0.4"], "Running", false),
            pod("x", &["10.60.0.5"], "Running", false),
            pod("y", &["10.60.0.5"], "Pending", false),
        ];
        let held = |entries: &[(&str, &str)]| -> HashMap<String, BTreeSet<String>> {
            let mut map: HashMap<String, BTreeSet<String>> = HashMap::new();
            for (uid, ip) in entries {
                map.entry(uid.to_string()).or_default().insert(ip.to_string());
            }
            map
        };
        // alpha-2's sandbox is gone, beta-4's holds the IP; a and b both hold theirs; x's
        // sandbox holds another IP and y has none: neither holds .5.
        let sandboxes = held(&[
            ("uid-beta-4", "10.60.0.3"),
            ("uid-a", "10.60.0.4"),
            ("uid-b", "10.60.0.4"),
            ("uid-x", "10.60.0.9"),
        ]);
        let found = shared_ips(&pods, Some(&sandboxes));
        assert_eq!(found.conflicts, vec!["10.60.0.4: default/a (uid-a), default/b (uid-b)".to_string()]);
        assert_eq!(
            found.lingering,
            vec![
                "10.60.0.3: default/beta-4 (uid-beta-4); sandbox gone: default/alpha-2 (uid-alpha-2)".to_string(),
                "10.60.0.5: ; sandbox gone: default/x (uid-x), default/y (uid-y)".to_string(),
            ]
        );
    }

    fn scrape(text: &str) -> Scrape {
        Scrape::parse(text).expect("valid exposition")
    }

    #[test]
    fn writes_count_only_write_verbs_on_the_ipams_resources_and_leases_between_the_snapshots() {
        let apiserver = |posts: u32, puts: u32, conflicts: u32, gets: u32| {
            scrape(&format!(
                "apiserver_request_total{{code=\"201\",resource=\"ipblocks\",verb=\"POST\"}} {posts}\n\
                 apiserver_request_total{{code=\"200\",resource=\"ipblocks\",verb=\"PUT\"}} {puts}\n\
                 apiserver_request_total{{code=\"409\",resource=\"ipblocks\",verb=\"PUT\"}} {conflicts}\n\
                 apiserver_request_total{{code=\"200\",resource=\"ipblocks\",verb=\"GET\"}} {gets}\n\
                 apiserver_request_total{{code=\"200\",resource=\"ipclaims\",verb=\"DELETE\"}} {posts}\n"
            ))
        };
        let agent = |released: u32| {
            scrape(&format!(
                "ipwarden_agent_releases_total{{result=\"released\"}} {released}\nipwarden_agent_releases_total{{result=\"error\"}} 5\n"
            ))
        };
        let controller = |released: u32, leader: u32| {
            scrape(&format!(
                "ipwarden_gc_releases_total{{pool=\"default\",reason=\"pod_gone\",trigger=\"handshake\"}} {released}\n\
                 ipwarden_gc_releases_total{{pool=\"default\",reason=\"pod_gone\",trigger=\"sweep\"}} 4\n\
                 ipwarden_controller_leader {leader}\n"
            ))
        };
        let usage = |cpu: f64| Usage { cpu_seconds: cpu, peak_rss_bytes: 64 * 1024 * 1024 };
        let before = Snapshot {
            agents: vec![agent(1), agent(0)],
            controllers: vec![controller(0, 1), controller(0, 0)],
            apiserver: apiserver(2, 10, 0, 50),
            usage: vec![usage(1.0), usage(1.0)],
            lease_updates: 5,
        };
        let after = Snapshot {
            agents: vec![agent(5), agent(4)],
            controllers: vec![controller(2, 1), controller(0, 0)],
            apiserver: apiserver(4, 30, 3, 500),
            usage: vec![usage(3.5), usage(1.25)],
            lease_updates: 9,
        };
        let identities = ["controller-a".to_string(), "controller-b".to_string()];
        let mut timeline = Timeline::default();
        for n in 0..10 {
            let times =
                PodTimes { key: format!("default/p{n}"), fate: Fate::Deleted, created: Instant::now(), deleted: None };
            timeline.pods.insert(format!("u{n}"), times);
        }
        // Half the pods' records are gone: the 409s count per release, the writes per pod.
        timeline.released.extend((0..5).map(|n| (format!("default/p{n}"), Instant::now())));
        let report = measure(
            Ipam::Ipwarden,
            &before,
            &after,
            &timeline,
            &identities,
            ChecksSeen { polls: 7, ..ChecksSeen::default() },
        );
        let w = report.writes;
        assert_eq!((w.agent_releases, w.controller_releases), (8, 2));
        // Sweep releases stayed at 4: only the handshake trigger grew.
        assert_eq!(report.gc.releases_by_trigger, BTreeMap::from([("handshake".to_string(), 2)]));
        assert_eq!(w.by_resource["ipblocks"], ResourceWrites { writes: 2 + 20 + 3, conflicts: 3 });
        assert_eq!(w.by_resource["ipclaims"], ResourceWrites { writes: 2, conflicts: 0 });
        assert_eq!(w.lease_updates, 4);
        assert_eq!(w.total, 25 + 2 + 4);
        assert_eq!(w.per_pod_life, Some(3.1));
        assert_eq!((w.record_writes_per_pod_life, w.record_conflicts_per_release), (Some(2.5), Some(0.6)));
        // A peer's resources only: ipwarden's writes are none of Whereabouts'.
        let peer = measure(
            Ipam::Whereabouts,
            &before,
            &after,
            &timeline,
            &identities,
            ChecksSeen { polls: 7, ..ChecksSeen::default() },
        );
        assert_eq!(peer.writes.by_resource["ippools"], ResourceWrites::default());
        assert_eq!(peer.writes.total, 4);
        assert_eq!(report.controllers[0].cpu_seconds, 2.5);
        assert!(report.controllers[0].leader && !report.controllers[1].leader);
        assert_eq!(report.controllers[1].peak_rss_mib, 64.0);
        assert_eq!(report.conflicts.polls, 7);
    }

    #[test]
    fn the_table_says_when_the_cluster_did_not_settle_and_names_each_conflict() {
        let report = Report {
            unsettled: "2 churn pods left".into(),
            conflicts: Conflicts {
                ip_conflicts: 1,
                examples: vec!["10.244.0.5: default/a, default/b".into()],
                ..Conflicts::default()
            },
            ..Report::default()
        };
        let table = report.to_string();
        assert!(table.contains("settled: NO after 0.0 s: 2 churn pods left"), "{table}");
        assert!(table.contains("IP conflicts between live pods: 1"), "{table}");
        assert!(table.contains("  10.244.0.5: default/a, default/b"), "{table}");
    }

    #[test]
    fn the_comparison_gives_each_ipam_a_column_with_its_ratio_to_the_first() {
        let report = |ipam: &str, p50: f64, cpu: f64| Report {
            ipam: ipam.into(),
            allocation_end_to_end: Latency { samples: 1, p50_seconds: Some(p50), p99_seconds: None },
            controllers: vec![ControllerUsage { cpu_seconds: cpu, ..ControllerUsage::default() }],
            settled: true,
            ..Report::default()
        };
        let storm =
            StormReport { cycles: 10, returned: 40, sticky_kept: 12, completed: true, ..StormReport::default() };
        let peer = Report { storm: Some(storm), ..report("whereabouts", 0.4, 1.0) };
        let table = compare(&[report("ipwarden", 0.1, 2.0), peer]);
        let row = |name: &str| table.lines().find(|l| l.starts_with(name)).unwrap_or_default().to_string();
        assert!(row("figure").contains("ipwarden") && row("figure").contains("whereabouts"), "{table}");
        assert!(row("allocation end to end p50").contains("0.400 (x4.00)"), "{table}");
        assert!(row("allocation end to end p99").contains(" -"), "{table}");
        assert!(row("controller CPU seconds").contains("1.000 (x0.50)"), "{table}");
        assert!(row("settled").contains("yes (0.0 s)"), "{table}");
        assert!(row("storm sticky IPs kept").trim_end().ends_with("-                 12 of 40"), "{table}");
        assert!(row("storm cycles completed").ends_with(" 10"), "{table}");
    }

    #[test]
    fn end_to_end_latencies_are_split_by_how_the_pod_ended() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut timeline = Timeline::default();
        let times = |key: &str, fate, created, deleted| PodTimes { key: key.into(), fate, created, deleted };
        timeline.pods.insert("u1".into(), times("default/a", Fate::Deleted, at(0), Some(at(10))));
        timeline.pods.insert("u2".into(), times("default/b", Fate::Leaked, at(1), Some(at(11))));
        timeline.pods.insert("u3".into(), times("default/c", Fate::Deleted, at(2), None));
        timeline.ip_seen.extend([("u1".to_string(), at(1)), ("u2".to_string(), at(4))]);
        timeline.released.extend([("default/a".to_string(), at(12)), ("default/b".to_string(), at(81))]);
        let empty = Snapshot {
            agents: Vec::new(),
            controllers: Vec::new(),
            apiserver: Scrape::default(),
            usage: Vec::new(),
            lease_updates: 0,
        };
        let report = measure(Ipam::Whereabouts, &empty, &empty, &timeline, &[], ChecksSeen::default());
        assert_eq!((report.pods.created, report.pods.leaked, report.pods.got_ip), (3, 1, 2));
        assert_eq!(report.allocation_end_to_end.p99_seconds, Some(3.0));
        assert_eq!(report.release_deleted.samples, 1);
        assert_eq!(report.release_deleted.p50_seconds, Some(2.0));
        assert_eq!(report.reclaim_leaked.p50_seconds, Some(70.0));
        assert_eq!(report.release_force_deleted.samples, 0);
    }
}
