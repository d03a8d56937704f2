//! The burst benchmark behind `ipwarden-e2e churn --burst N`: instead of the churn's steady
//! rate, N pods are created at once on each node, the benchmark waits (bounded) until all of
//! them run with their IPs, deletes them all at once and waits (bounded) until every record
//! of theirs is released; `--bursts K` does this K times in a row on the same cluster. It
//! measures how fast an IPAM serves a node that gets many pods at once (after a drain, a
//! rollout): per burst and over all bursts, the time from the creations to the last pod
//! Running, per node and overall, ADDs per second, the agents' allocation latency, and the
//! writes on the IPAM's record objects with their 409 Conflicts per ADD and per release.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use serde::Serialize;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::churn::{
    Fate, Latency, ResourceWrites, Shared, Snapshot, Timeline, Watched, grown, histogram, manifest, per, ratio,
    resource_writes, seconds, snapshot, watch, with,
};
use crate::cluster::Cluster;
use crate::error::{Error, Result};
use crate::exposition::{Histogram, Labels};
use crate::peers::{Installed, Ipam};
use crate::wait::{self, Probe};

/// The namespace burst pods live in.
const NAMESPACE: &str = "default";

/// The agents' allocation latency histogram.
const ALLOCATION_HISTOGRAM: &str = "ipwarden_agent_allocation_duration_seconds";

/// The apiserver's own latency histogram of the requests it served.
const APISERVER_HISTOGRAM: &str = "apiserver_request_duration_seconds";

/// The apiserver's time for the write requests (any resource) it served between two scrapes:
/// the queue every write of the burst waits in, the IPAM's among them.
fn apiserver_writes(before: &Snapshot, after: &Snapshot) -> Histogram {
    let writes = |l: &Labels| l.get("verb").is_some_and(|v| crate::churn::WRITE_VERBS.contains(&v.as_str()));
    after
        .apiserver
        .histogram_where(APISERVER_HISTOGRAM, writes)
        .since(&before.apiserver.histogram_where(APISERVER_HISTOGRAM, writes))
}

/// What load to apply.
#[derive(Clone, Debug)]
pub struct BurstOptions {
    /// Pods created at once on each node in one burst.
    pub per_node: usize,
    /// Bursts, one after the other.
    pub bursts: u32,
    /// How long a burst's pods may take to all run with their IPs.
    pub running_timeout: Duration,
    /// How long a burst's records may take to all be released after the deletions.
    pub release_timeout: Duration,
    /// Release marks staged on the first node right before each burst's creations (ipwarden
    /// only; [`stage_marks`]): the node answers them while its burst's ADDs come in.
    pub marks: usize,
}

/// The pool and block [`stage_marks`] writes into: the top /24 of the harness's default pool
/// (10.244.0.0/16 with /24 blocks). A node whose first block is picked by its name's hash could
/// claim it; staging waits for the block to hold no record first, so such a run stops with a
/// timeout rather than writing over a pod's record.
const MARKS_POOL: &str = "default";
const MARKS_BLOCK: &str = "default-10-244-255-0-24";
const MARKS_CIDR: &str = "10.244.255.0/24";

/// The most marks [`stage_marks`] can stage: the addresses of its block but the network and
/// broadcast ones.
pub const MAX_MARKS: usize = 254;

/// [`stage_marks`]'s block now: how many records it holds, and how many of those still wait
/// for their node's answer.
async fn staged_marks(client: &Client) -> Result<(usize, usize)> {
    let resource = crate::scale::ipwarden_resource("IPBlock");
    let api: Api<kube::api::DynamicObject> = Api::all_with(client.clone(), &resource);
    let block = api.get_opt(MARKS_BLOCK).await.map_err(Error::kube(format!("reading IPBlock {MARKS_BLOCK}")))?;
    let records = block.and_then(|b| b.data.get("spec")?.get("allocations")?.as_object().cloned()).unwrap_or_default();
    let waiting = records
        .values()
        .filter(|r| r.pointer("/releaseHandshake/state").and_then(|s| s.as_str()) == Some("marked-for-release"))
        .count();
    Ok((records.len(), waiting))
}

/// Waits (bounded) until [`staged_marks`] says `done` of (records, waiting).
async fn await_marks(
    client: &Client,
    what: &str,
    timeout: Duration,
    done: impl Fn(usize, usize) -> bool,
) -> Result<()> {
    let done = &done;
    wait::until(what, timeout, || {
        let client = client.clone();
        async move {
            let (records, waiting) = staged_marks(&client).await?;
            Ok(if done(records, waiting) {
                Probe::Done(())
            } else {
                Probe::Pending(format!("{records} staged records, {waiting} waiting for an answer"))
            })
        }
    })
    .await
}

/// Writes `count` records of pods that never existed, on `node`, each already marked for
/// release by the controller, into one block: what a node finds after its runtime lost the
/// sandboxes of that many pods that are now gone (the controller marks such records in one
/// sweep). The node's agent answers them all in its next pass (no sandbox of its holds them:
/// `ready-for-release`), and the controller releases them. The block holds no record when
/// this is called, so conflicts come only from the node's other writes.
async fn stage_marks(client: &Client, node: &str, burst: u32, count: usize) -> Result<()> {
    use kube::api::DynamicObject;
    let resource = crate::scale::ipwarden_resource("IPBlock");
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
    let now = jiff::Timestamp::now().to_string();
    let records: serde_json::Map<String, serde_json::Value> = (1..=count.min(MAX_MARKS))
        .map(|i| {
            let uid = format!("00000000-0000-4000-8000-{burst:04}{i:08}");
            let record = serde_json::json!({
                "pod": {"namespace": NAMESPACE, "name": format!("gone-{burst:03}-{i:03}"), "uid": uid},
                "node": node, "network": "ipwarden", "containerId": format!("lost-{uid}"), "interface": "eth0",
                "sticky": false, "allocatedAt": now,
                "releaseHandshake": {"state": "marked-for-release", "markedAt": now, "reason": "pod_gone"},
            });
            (format!("10.244.255.{i}"), record)
        })
        .collect();
    for _ in 0..20 {
        let written =
            match api.get_opt(MARKS_BLOCK).await.map_err(Error::kube(format!("reading IPBlock {MARKS_BLOCK}")))? {
                Some(mut block) => {
                    let spec = block.data.get_mut("spec").and_then(|s| s.as_object_mut());
                    let Some(spec) = spec else {
                        return Err(Error::Churn(format!("IPBlock {MARKS_BLOCK} has no spec")));
                    };
                    let allocations = spec.entry("allocations").or_insert_with(|| serde_json::json!({}));
                    if let Some(allocations) = allocations.as_object_mut() {
                        allocations.extend(records.clone());
                    }
                    api.replace(MARKS_BLOCK, &PostParams::default(), &block).await.map(drop)
                }
                None => {
                    let mut block = DynamicObject::new(MARKS_BLOCK, &resource);
                    block.data =
                        serde_json::json!({"spec": {"pool": MARKS_POOL, "cidr": MARKS_CIDR, "allocations": records}});
                    api.create(&PostParams::default(), &block).await.map(drop)
                }
            };
        match written {
            Ok(()) => return Ok(()),
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(e) => return Err(Error::kube(format!("staging {count} release marks in IPBlock {MARKS_BLOCK}"))(e)),
        }
    }
    Err(Error::Churn(format!("staging release marks in IPBlock {MARKS_BLOCK}: 20 conflicts in a row")))
}

/// One pod of a burst, as measured.
#[derive(Clone, Debug, PartialEq)]
pub struct PodSample {
    /// The node it was bound to.
    pub node: String,
    /// Seconds from the burst's start (before its first create call) to the pod's status
    /// showing its IP (the simulated kubelet posts `Running` and the IPs at once); none when
    /// it did not within the bound.
    pub running: Option<f64>,
    /// Seconds from its delete call to its record leaving the IPAM's records; none when it did
    /// not within the bound.
    pub released: Option<f64>,
}

/// What one burst measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Burst {
    /// Pods created (create calls that succeeded).
    pub pods: u64,
    /// Create or delete calls that failed (logged; the burst goes on).
    pub api_failures: u64,
    /// Of the pods, how many ran with an IP within the bound.
    pub running: u64,
    /// Per node, seconds from the burst's start to its last pod Running (of those that ran).
    pub last_running_by_node: BTreeMap<String, f64>,
    /// Seconds from the burst's start to the last pod Running (of those that ran).
    pub last_running_seconds: Option<f64>,
    /// Pods that ran divided by `last_running_seconds`.
    pub adds_per_second: Option<f64>,
    /// From the burst's start to each pod Running: nearest-rank quantiles.
    pub running_latency: Latency,
    /// The same seconds, ascending, which [`summarize`] puts together.
    #[serde(skip)]
    pub running_times: Vec<f64>,
    /// Successful ADDs counted by the agents (ipwarden only).
    pub allocations: u64,
    /// ADDs the agents answered with an error (ipwarden only).
    pub allocation_failures: u64,
    /// The agents' allocation histogram over the burst's ADDs (ipwarden only).
    pub allocation_agent: Latency,
    /// The same histogram's buckets, which [`summarize`] adds up.
    #[serde(skip)]
    pub allocation_histogram: Histogram,
    /// The apiserver's own time for every write request (any resource: pod creates, status
    /// patches, the IPAM's writes) from the burst's start to its last pod Running.
    pub apiserver_writes: Latency,
    /// The same histogram's buckets, which [`summarize`] adds up.
    #[serde(skip)]
    pub apiserver_write_histogram: Histogram,
    /// Writes on the IPAM's record objects from the burst's start to its last pod Running.
    pub add_writes: ResourceWrites,
    /// Of the pods, how many had their record released within the bound.
    pub released: u64,
    /// From each delete call to the pod's record gone: nearest-rank quantiles.
    pub release_latency: Latency,
    /// Writes on the record objects from the deletions to the last record released.
    pub release_writes: ResourceWrites,
}

/// The bursts added up: the sustained figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BurstSummary {
    /// Pods created in all bursts.
    pub pods: u64,
    /// Of those, run with an IP within their burst's bound.
    pub running: u64,
    /// Of those, released within their burst's bound.
    pub released: u64,
    /// The bursts' times to their last pod Running, added.
    pub running_seconds: f64,
    /// `running / running_seconds`: ADDs per second while pods were waiting for an IP.
    pub adds_per_second: Option<f64>,
    /// The shortest and the longest time to a burst's last pod Running.
    pub last_running_range: Option<(f64, f64)>,
    /// From its burst's start to each pod Running, over all bursts.
    pub running_latency: Latency,
    /// The agents' allocation histogram over every burst's ADDs (ipwarden only).
    pub allocation_agent: Latency,
    /// The apiserver's own time for the write requests while pods were being added.
    pub apiserver_writes: Latency,
    /// Record objects' writes while pods were being added, with their 409s.
    pub add_writes: ResourceWrites,
    /// Record objects' writes while pods were being released, with their 409s.
    pub release_writes: ResourceWrites,
    /// `add_writes.writes / running`.
    pub writes_per_add: Option<f64>,
    /// `add_writes.conflicts / running`.
    pub conflicts_per_add: Option<f64>,
    /// `release_writes.writes / released`.
    pub writes_per_release: Option<f64>,
    /// `release_writes.conflicts / released`.
    pub conflicts_per_release: Option<f64>,
    /// All the record objects' writes per pod created (an ADD and a release each).
    pub writes_per_pod_life: Option<f64>,
}

/// Everything the burst benchmark measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BurstReport {
    /// The IPAM measured.
    pub ipam: String,
    /// The record objects whose writes are counted (ipwarden: `ipblocks`).
    pub records: String,
    /// Simulated nodes.
    pub nodes: usize,
    /// Pods created at once on each node per burst.
    pub per_node: usize,
    /// Each burst, in order.
    pub bursts: Vec<Burst>,
    /// The bursts added up.
    pub summary: BurstSummary,
    /// Distinct (IP, pods) pairs whose pods' sandboxes held the IP at once: must be 0.
    pub ip_conflicts: usize,
    /// Up to ten of them.
    pub conflict_examples: Vec<String>,
    /// Distinct IPs a deleted pod still showed after its sandbox let go of them, while another
    /// pod had them (not conflicts).
    pub lingering: usize,
    /// Whether every burst ran and released all its pods within the bounds; when not, why
    /// in `failure`.
    pub completed: bool,
    /// Why the bursts stopped or fell short; empty when completed.
    pub failure: String,
}

/// The pods' seconds, ascending.
fn sorted(seconds: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut all: Vec<f64> = seconds.collect();
    all.sort_by(f64::total_cmp);
    all
}

/// One burst's figures from its pods and the snapshots taken before it (`before`), once its
/// pods ran (`added`) and once their records were released (`released`).
pub(crate) fn measure_burst(
    ipam: Ipam,
    (before, added, released): (&Snapshot, &Snapshot, &Snapshot),
    pods: &[PodSample],
    api_failures: u64,
) -> Burst {
    let records = ipam.records().plural;
    let mut last_running_by_node: BTreeMap<String, f64> = BTreeMap::new();
    for pod in pods {
        if let Some(running) = pod.running {
            let last = last_running_by_node.entry(pod.node.clone()).or_insert(running);
            *last = last.max(running);
        }
    }
    let running = sorted(pods.iter().filter_map(|p| p.running));
    let last_running_seconds = running.last().copied();
    let success = |l: &Labels| l.get("result").is_some_and(|r| r == "success");
    let allocation_histogram =
        histogram(&added.agents, ALLOCATION_HISTOGRAM).since(&histogram(&before.agents, ALLOCATION_HISTOGRAM));
    let releases = sorted(pods.iter().filter_map(|p| p.released));
    let apiserver_write_histogram = apiserver_writes(before, added);
    Burst {
        pods: pods.len() as u64,
        api_failures,
        running: running.len() as u64,
        last_running_by_node,
        last_running_seconds,
        adds_per_second: last_running_seconds.filter(|s| *s > 0.0).map(|s| running.len() as f64 / s),
        running_latency: Latency::of_samples(running.clone()),
        running_times: running,
        allocations: grown(&before.agents, &added.agents, "ipwarden_agent_allocations_total", success),
        allocation_failures: grown(&before.agents, &added.agents, "ipwarden_agent_allocations_total", |l| !success(l)),
        allocation_agent: Latency::of_histogram(&allocation_histogram),
        allocation_histogram,
        apiserver_writes: Latency::of_histogram(&apiserver_write_histogram),
        apiserver_write_histogram,
        add_writes: resource_writes(&before.apiserver, &added.apiserver, &records),
        released: releases.len() as u64,
        release_latency: Latency::of_samples(releases),
        release_writes: resource_writes(&added.apiserver, &released.apiserver, &records),
    }
}

/// Adds two write counts.
fn plus(a: ResourceWrites, b: ResourceWrites) -> ResourceWrites {
    ResourceWrites { writes: a.writes + b.writes, conflicts: a.conflicts + b.conflicts }
}

/// The sustained figures of `bursts`.
pub fn summarize(bursts: &[Burst]) -> BurstSummary {
    let mut allocations = Histogram::default();
    let mut apiserver = Histogram::default();
    let mut running = Vec::new();
    let mut summary = BurstSummary::default();
    for burst in bursts {
        allocations.merge(&burst.allocation_histogram);
        apiserver.merge(&burst.apiserver_write_histogram);
        running.extend(&burst.running_times);
        summary.pods += burst.pods;
        summary.running += burst.running;
        summary.released += burst.released;
        summary.running_seconds += burst.last_running_seconds.unwrap_or(0.0);
        summary.add_writes = plus(summary.add_writes, burst.add_writes);
        summary.release_writes = plus(summary.release_writes, burst.release_writes);
    }
    let times = sorted(bursts.iter().filter_map(|b| b.last_running_seconds));
    let ratio = |n: u64, d: f64| (d > 0.0).then(|| n as f64 / d);
    BurstSummary {
        adds_per_second: ratio(summary.running, summary.running_seconds),
        last_running_range: times.first().zip(times.last()).map(|(min, max)| (*min, *max)),
        running_latency: Latency::of_samples(running),
        allocation_agent: Latency::of_histogram(&allocations),
        apiserver_writes: Latency::of_histogram(&apiserver),
        writes_per_add: per(summary.add_writes.writes, summary.running),
        conflicts_per_add: per(summary.add_writes.conflicts, summary.running),
        writes_per_release: per(summary.release_writes.writes, summary.released),
        conflicts_per_release: per(summary.release_writes.conflicts, summary.released),
        writes_per_pod_life: per(summary.add_writes.writes + summary.release_writes.writes, summary.pods),
        ..summary
    }
}

/// What one burst's tasks saw: its pods (name, node, UID) and when each was deleted.
struct Created {
    name: String,
    node: String,
    uid: String,
    deleted: Option<Instant>,
}

/// Runs `calls` at once and returns their results, a panicked task counted as a failed call.
async fn all_at_once<T: Send + 'static>(calls: Vec<impl Future<Output = Option<T>> + Send + 'static>) -> (Vec<T>, u64) {
    let mut tasks = JoinSet::new();
    for call in calls {
        tasks.spawn(call);
    }
    let (mut done, mut failed) = (Vec::new(), 0);
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Some(value)) => done.push(value),
            Ok(None) | Err(_) => failed += 1,
        }
    }
    (done, failed)
}

/// Burst `index`: creates `per_node` pods on each of `nodes` at once, waits until they run,
/// deletes them at once and waits until their records are released. Returns the burst and,
/// when a bound was passed, why.
async fn one_burst(
    index: u32,
    nodes: &[String],
    installed: &Installed,
    client: &Client,
    (timeline, pod_store): (&Shared<Timeline>, &Store<Pod>),
    options: &BurstOptions,
) -> Result<(Burst, Option<String>)> {
    let ipam = installed.ipam();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let no_leases = AtomicU64::new(0);
    let before = snapshot(client, installed, &no_leases).await?;
    if options.marks > 0 {
        // The last burst's marks gone first, so staging does not race their answers; the burst
        // starts with the node's first answer written, while it answers the others.
        await_marks(client, "the last burst's staged marks released", options.release_timeout, |records, _| {
            records == 0
        })
        .await?;
        stage_marks(client, &nodes[0], index, options.marks).await?;
        // Begun: an answer written, or records already released after their answers.
        let count = options.marks.min(MAX_MARKS);
        let first = |records, waiting| records < count || waiting < records;
        await_marks(client, "the node's first answer to the staged marks", options.running_timeout, first).await?;
    }
    let start = Instant::now();
    let mut creates = Vec::new();
    for (n, node) in nodes.iter().enumerate() {
        for i in 0..options.per_node {
            let name = format!("burst-{index:03}-{n:03}-{i:04}");
            let manifest = manifest(&name, node, Fate::Deleted)?;
            let (pods, node) = (pods.clone(), node.clone());
            creates.push(async move {
                match pods.create(&PostParams::default(), &manifest).await {
                    Ok(pod) => Some(Created { name, node, uid: pod.uid().unwrap_or_default(), deleted: None }),
                    Err(e) => {
                        tracing::warn!(pod = %name, error = %e, "burst: creating the pod failed");
                        None
                    }
                }
            });
        }
    }
    let (created, mut api_failures) = all_at_once(creates).await;
    let uids: Vec<String> = created.iter().map(|c| c.uid.clone()).collect();
    let ran = wait::until(&format!("every pod of burst {index} running with an IP"), options.running_timeout, || {
        let missing = with(timeline, |t| uids.iter().filter(|uid| !t.ip_seen.contains_key(*uid)).count());
        let of = uids.len();
        async move {
            Ok(if missing == 0 {
                Probe::Done(())
            } else {
                Probe::Pending(format!("{missing} of {of} pods without an IP"))
            })
        }
    })
    .await;
    let added = snapshot(client, installed, &no_leases).await?;

    let deletes = created.into_iter().map(|mut pod| {
        let pods = pods.clone();
        async move {
            let deleted = Instant::now();
            match pods.delete(&pod.name, &DeleteParams::default()).await {
                Ok(_) => pod.deleted = Some(deleted),
                Err(e) => tracing::warn!(pod = %pod.name, error = %e, "burst: deleting the pod failed"),
            }
            Some(pod)
        }
    });
    let (created, panicked) = all_at_once(deletes.collect()).await;
    api_failures += panicked + created.iter().filter(|pod| pod.deleted.is_none()).count() as u64;
    let names: HashSet<String> = created.iter().map(|pod| pod.name.clone()).collect();
    let keys: Vec<String> = names.iter().map(|name| format!("{NAMESPACE}/{name}")).collect();
    let gone = wait::until(&format!("every record of burst {index} released"), options.release_timeout, || {
        let held = with(timeline, |t| keys.iter().filter(|key| !t.released.contains_key(*key)).count());
        let left = pod_store.state().iter().filter(|pod| names.contains(&pod.name_any())).count();
        async move {
            Ok(if held == 0 && left == 0 {
                Probe::Done(())
            } else {
                Probe::Pending(format!("{held} records held, {left} pods left"))
            })
        }
    })
    .await;
    let released = snapshot(client, installed, &no_leases).await?;

    let samples: Vec<PodSample> = with(timeline, |t| {
        created
            .iter()
            .map(|pod| PodSample {
                node: pod.node.clone(),
                running: t.ip_seen.get(&pod.uid).map(|at| at.saturating_duration_since(start).as_secs_f64()),
                released: pod
                    .deleted
                    .zip(t.released.get(&format!("{NAMESPACE}/{}", pod.name)))
                    .map(|(deleted, gone)| gone.saturating_duration_since(deleted).as_secs_f64()),
            })
            .collect()
    });
    let burst = measure_burst(ipam, (&before, &added, &released), &samples, api_failures);
    let failure = match (ran, gone) {
        (Err(Error::Timeout { what, timeout, last }), _) | (_, Err(Error::Timeout { what, timeout, last })) => {
            Some(format!("{what}: not within {timeout:?}: {last}"))
        }
        (Err(e), _) | (_, Err(e)) => return Err(e),
        (Ok(()), Ok(())) if api_failures > 0 => Some(format!("{api_failures} create or delete calls failed")),
        (Ok(()), Ok(())) => None,
    };
    Ok((burst, failure))
}

/// Runs the bursts on `cluster`, where `installed` runs the IPAM under test, and reports. The
/// bursts stop at the first one whose pods did not run or were not released in time.
pub async fn run(cluster: &Cluster, installed: &Installed, options: &BurstOptions) -> Result<BurstReport> {
    let ipam = installed.ipam();
    let nodes: Vec<String> = cluster.nodes().iter().map(|n| n.name().to_string()).collect();
    if nodes.is_empty() || options.per_node == 0 || options.bursts == 0 {
        return Err(Error::Churn("a burst needs nodes, pods per node and at least one burst".into()));
    }
    let client = cluster.client();
    let mut background = JoinSet::new();
    let Watched { timeline, pods: store, conflicts: seen } =
        watch(cluster, ipam, &mut background, "the burst's pod watch").await?;
    let mut bursts = Vec::new();
    let mut failure = String::new();
    for index in 0..options.bursts {
        let (burst, stopped) = one_burst(index, &nodes, installed, &client, (&timeline, &store), options).await?;
        tracing::info!(burst = index, running = burst.running, seconds = ?burst.last_running_seconds, "burst: done");
        bursts.push(burst);
        if let Some(why) = stopped {
            failure = format!("burst {index}: {why}");
            break;
        }
    }
    if options.marks > 0 && failure.is_empty() {
        let all_released = |records, _| records == 0;
        if let Err(e) = await_marks(&client, "every staged mark released", options.release_timeout, all_released).await
        {
            failure = format!("the staged release marks: {e}");
        }
    }
    background.abort_all();
    let seen = with(&seen, |seen| seen.clone());
    Ok(BurstReport {
        ipam: ipam.to_string(),
        records: ipam.records().plural,
        nodes: nodes.len(),
        per_node: options.per_node,
        summary: summarize(&bursts),
        bursts,
        ip_conflicts: seen.conflicts.len(),
        conflict_examples: seen.conflicts.into_iter().take(10).collect(),
        lingering: seen.lingering.len(),
        completed: failure.is_empty(),
        failure,
    })
}

impl std::fmt::Display for BurstReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "bursts of {}: {} nodes, {} pods created at once on each, {} bursts",
            self.ipam,
            self.nodes,
            self.per_node,
            self.bursts.len()
        )?;
        if self.completed {
            writeln!(f, "completed: every pod ran with an IP and was released within the bounds")?;
        } else {
            writeln!(f, "completed: NO: {}", self.failure)?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "{:>5} {:>9} {:>10} {:>8} {:>10} {:>10} {:>13} {:>10} {:>13}",
            "burst",
            "running",
            "last run",
            "ADD/s",
            "alloc p50",
            "alloc p99",
            "writes (409)",
            "rel p99",
            "writes (409)"
        )?;
        for (n, b) in self.bursts.iter().enumerate() {
            writeln!(
                f,
                "{n:>5} {:>9} {:>10} {:>8} {:>10} {:>10} {:>13} {:>10} {:>13}",
                format!("{}/{}", b.running, b.pods),
                seconds(b.last_running_seconds),
                ratio(b.adds_per_second),
                seconds(b.allocation_agent.p50_seconds),
                seconds(b.allocation_agent.p99_seconds),
                format!("{} ({})", b.add_writes.writes, b.add_writes.conflicts),
                seconds(b.release_latency.p99_seconds),
                format!("{} ({})", b.release_writes.writes, b.release_writes.conflicts),
            )?;
        }
        writeln!(
            f,
            "(last run: from the burst's start to its last pod Running; writes: {} while adding and while releasing)",
            self.records
        )?;
        for (n, b) in self.bursts.iter().enumerate() {
            let nodes: Vec<String> =
                b.last_running_by_node.iter().map(|(node, s)| format!("{node} {}", seconds(Some(*s)))).collect();
            let (p50, p99) = (seconds(b.running_latency.p50_seconds), seconds(b.running_latency.p99_seconds));
            writeln!(
                f,
                "burst {n}: start to Running p50 {p50}, p99 {p99}; last pod Running per node: {}",
                nodes.join(", ")
            )?;
        }
        let s = &self.summary;
        writeln!(f)?;
        writeln!(f, "over all bursts: {} pods, {} ran, {} released", s.pods, s.running, s.released)?;
        let range = s
            .last_running_range
            .map_or_else(|| "-".to_string(), |(min, max)| format!("{} to {}", seconds(Some(min)), seconds(Some(max))));
        writeln!(f, "sustained ADD/s (pods run / bursts' times to their last Running): {}", ratio(s.adds_per_second))?;
        writeln!(f, "time to a burst's last pod Running: {range}")?;
        let quantiles = |l: &Latency| format!("p50 {}, p99 {}", seconds(l.p50_seconds), seconds(l.p99_seconds));
        writeln!(f, "from a burst's start to each pod Running: {}", quantiles(&s.running_latency))?;
        writeln!(
            f,
            "allocation in the agent (agents' histogram, {} ADDs): {}",
            s.allocation_agent.samples,
            quantiles(&s.allocation_agent)
        )?;
        writeln!(
            f,
            "the apiserver's own time for write requests while adding (any resource, {} requests): {}",
            s.apiserver_writes.samples,
            quantiles(&s.apiserver_writes)
        )?;
        writeln!(
            f,
            "{} writes: {} per ADD ({} 409s per ADD), {} per release ({} 409s per release), {} per pod life",
            self.records,
            ratio(s.writes_per_add),
            ratio(s.conflicts_per_add),
            ratio(s.writes_per_release),
            ratio(s.conflicts_per_release),
            ratio(s.writes_per_pod_life)
        )?;
        writeln!(
            f,
            "{} 409 Conflict answers: {} while adding, {} while releasing",
            self.records, s.add_writes.conflicts, s.release_writes.conflicts
        )?;
        writeln!(f, "IP conflicts between live pods: {}", self.ip_conflicts)?;
        for example in &self.conflict_examples {
            writeln!(f, "  {example}")?;
        }
        writeln!(f, "IPs a deleted pod still showed after its sandbox let go (not conflicts): {}", self.lingering)
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::exposition::Scrape;

    fn scrape(text: &str) -> Scrape {
        Scrape::parse(text).expect("valid exposition")
    }

    /// A snapshot whose apiserver counted `puts` IPBlock writes, `conflicts` of them 409s,
    /// and whose one agent served `adds` ADDs (`fast` of them within 1 ms, the rest within
    /// 64 ms) and failed `failed`.
    fn snapshot_at(puts: u32, conflicts: u32, adds: u32, fast: u32, failed: u32) -> Snapshot {
        let agent = scrape(&format!(
            "ipwarden_agent_allocations_total{{result=\"success\"}} {adds}\n\
             ipwarden_agent_allocations_total{{result=\"exhausted\"}} {failed}\n\
             ipwarden_agent_allocation_duration_seconds_bucket{{le=\"0.001\"}} {fast}\n\
             ipwarden_agent_allocation_duration_seconds_bucket{{le=\"0.064\"}} {adds}\n\
             ipwarden_agent_allocation_duration_seconds_bucket{{le=\"+Inf\"}} {adds}\n"
        ));
        let apiserver = scrape(&format!(
            "apiserver_request_total{{code=\"200\",resource=\"ipblocks\",verb=\"PUT\"}} {}\n\
             apiserver_request_total{{code=\"409\",resource=\"ipblocks\",verb=\"PUT\"}} {conflicts}\n\
             apiserver_request_total{{code=\"200\",resource=\"ipblocks\",verb=\"GET\"}} 1000\n\
             apiserver_request_total{{code=\"201\",resource=\"ipclaims\",verb=\"POST\"}} 77\n\
             apiserver_request_duration_seconds_bucket{{resource=\"ipblocks\",verb=\"PUT\",le=\"0.025\"}} {puts}\n\
             apiserver_request_duration_seconds_bucket{{resource=\"ipblocks\",verb=\"PUT\",le=\"+Inf\"}} {puts}\n\
             apiserver_request_duration_seconds_bucket{{resource=\"ipblocks\",verb=\"GET\",le=\"0.025\"}} {}\n\
             apiserver_request_duration_seconds_bucket{{resource=\"ipblocks\",verb=\"GET\",le=\"+Inf\"}} {}\n",
            puts - conflicts,
            puts * 100,
            puts * 100
        ));
        Snapshot { agents: vec![agent], controllers: Vec::new(), apiserver, usage: Vec::new(), lease_updates: 0 }
    }

    fn pod(node: &str, running: Option<f64>, released: Option<f64>) -> PodSample {
        PodSample { node: node.into(), running, released }
    }

    #[test]
    fn a_burst_counts_its_adds_per_second_from_the_last_running_pod_and_splits_writes_at_the_adds() {
        let pods = [
            pod("node-0", Some(0.5), Some(0.1)),
            pod("node-0", Some(2.0), Some(0.3)),
            pod("node-1", Some(1.0), Some(0.2)),
            pod("node-1", None, None),
        ];
        let (before, added, released) =
            (snapshot_at(10, 1, 5, 5, 0), snapshot_at(16, 2, 8, 6, 1), snapshot_at(20, 2, 8, 6, 1));
        let burst = measure_burst(Ipam::Ipwarden, (&before, &added, &released), &pods, 1);
        assert_eq!((burst.pods, burst.running, burst.released, burst.api_failures), (4, 3, 3, 1));
        assert_eq!(burst.last_running_by_node, BTreeMap::from([("node-0".into(), 2.0), ("node-1".into(), 1.0)]));
        assert_eq!(burst.last_running_seconds, Some(2.0));
        assert_eq!(burst.adds_per_second, Some(1.5));
        assert_eq!(burst.running_latency.p50_seconds, Some(1.0));
        assert_eq!(burst.running_times, vec![0.5, 1.0, 2.0]);
        assert_eq!((burst.allocations, burst.allocation_failures), (3, 1));
        assert_eq!(burst.apiserver_writes.samples, 6, "the apiserver's write requests while adding, reads left out");
        assert!(burst.apiserver_writes.p99_seconds.is_some_and(|s| s <= 0.025));
        // 1 of the 3 ADDs within 1 ms, 2 in (1 ms, 64 ms].
        assert_eq!(burst.allocation_agent.samples, 3);
        let p50 = burst.allocation_agent.p50_seconds.unwrap_or_default();
        assert!((p50 - 0.01675).abs() < 1e-9, "{p50}");
        // Only write verbs on ipblocks; the claims and the reads are not the records' writes.
        assert_eq!(burst.add_writes, ResourceWrites { writes: 6, conflicts: 1 });
        assert_eq!(burst.release_writes, ResourceWrites { writes: 4, conflicts: 0 });
        assert_eq!(burst.release_latency.p99_seconds, Some(0.3));
    }

    #[test]
    fn a_burst_where_no_pod_ran_has_no_rate() {
        let none = snapshot_at(0, 0, 0, 0, 0);
        let burst = measure_burst(Ipam::Ipwarden, (&none, &none, &none), &[pod("node-0", None, None)], 0);
        assert_eq!((burst.last_running_seconds, burst.adds_per_second), (None, None));
        assert!(burst.last_running_by_node.is_empty());
        assert_eq!(summarize(&[burst]).adds_per_second, None);
    }

    #[test]
    fn the_sustained_rate_adds_every_burst_and_the_per_release_figures_divide_by_releases() {
        let burst = |running: u64, seconds: f64, fast: f64| Burst {
            pods: 4,
            running,
            released: 4,
            last_running_seconds: Some(seconds),
            running_times: vec![seconds / 4.0, seconds],
            allocation_histogram: Histogram { buckets: vec![(0.001, fast), (0.064, 4.0), (f64::INFINITY, 4.0)] },
            add_writes: ResourceWrites { writes: 4, conflicts: 1 },
            release_writes: ResourceWrites { writes: 5, conflicts: 2 },
            ..Burst::default()
        };
        let summary = summarize(&[burst(4, 1.0, 4.0), burst(4, 3.0, 0.0)]);
        assert_eq!((summary.pods, summary.running, summary.released), (8, 8, 8));
        assert_eq!(summary.adds_per_second, Some(2.0));
        assert_eq!(summary.last_running_range, Some((1.0, 3.0)));
        // Pods of both bursts, each timed from its own burst's start: 0.25, 0.75, 1 and 3 s.
        assert_eq!(summary.running_latency.samples, 4);
        assert_eq!(summary.running_latency.p50_seconds, Some(0.75));
        // Half the 8 ADDs within 1 ms: the median is the first bucket's bound.
        assert_eq!((summary.allocation_agent.samples, summary.allocation_agent.p50_seconds), (8, Some(0.001)));
        assert_eq!((summary.writes_per_add, summary.conflicts_per_add), (Some(1.0), Some(0.25)));
        assert_eq!((summary.writes_per_release, summary.conflicts_per_release), (Some(1.25), Some(0.5)));
        assert_eq!(summary.writes_per_pod_life, Some(2.25));
    }

    #[test]
    fn the_table_has_a_row_per_burst_and_says_when_a_burst_fell_short() {
        let burst = Burst {
            pods: 200,
            running: 200,
            last_running_seconds: Some(2.5),
            adds_per_second: Some(80.0),
            last_running_by_node: BTreeMap::from([("node-0".into(), 2.5), ("node-1".into(), 0.75)]),
            add_writes: ResourceWrites { writes: 210, conflicts: 8 },
            ..Burst::default()
        };
        let report = BurstReport {
            ipam: "ipwarden".into(),
            records: "ipblocks".into(),
            nodes: 2,
            per_node: 100,
            summary: summarize(std::slice::from_ref(&burst)),
            bursts: vec![burst],
            failure: "burst 1: every pod of burst 1 running with an IP: not within 60s: 3 of 200 pods without an IP"
                .into(),
            ..BurstReport::default()
        };
        let table = report.to_string();
        let row = table.lines().find(|l| l.trim_start().starts_with("0 ")).unwrap_or_default();
        assert!(row.contains("200/200") && row.contains("2.50 s") && row.contains("80.00"), "{table}");
        assert!(row.contains("210 (8)"), "{table}");
        assert!(table.contains("last pod Running per node: node-0 2.50 s, node-1 750.0 ms"), "{table}");
        assert!(table.contains("completed: NO: burst 1: every pod"), "{table}");
        assert!(table.contains("sustained ADD/s (pods run / bursts' times to their last Running): 80.00"), "{table}");
        assert!(table.contains("ipblocks writes: 1.05 per ADD (0.04 409s per ADD)"), "{table}");
    }
}
