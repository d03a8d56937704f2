//! The node benchmark (`ipwarden-e2e node-bench`, docs/benchmarks.md, "Real nodes"): the
//! four phases peers publish (Spiderpool's docs/concepts/ipam-performance.md) on real nodes
//! (kubelet, containerd and runc): **create** Deployments of 10 pods until every pod runs,
//! **re-create** (every pod deleted at once, the Deployments stay) until all run again,
//! **recover** (every node powered off and on: kubelet, the runtime and ipwarden's agent
//! killed, the runtime's state and network namespaces wiped, everything started again) until
//! all run again, and **delete** the Deployments until every pod is gone. Each run is one IPAM
//! on a cluster of its own, back to back: ipwarden as users install it (`helm install` of its
//! chart: the agent DaemonSet and the controller Deployment as pods from its image under the
//! nodes' kubelets, [`chart`]) and Whereabouts (its plugin), each with a pool of exactly as
//! many IPs as pods or an ample one, and Debian's `host-local` with a range per
//! node, the floor (no cluster-wide coordination at all). After each phase the records, the
//! pods' `podIPs` and the IPs in the nodes' network namespaces must agree, with no IP on two
//! pods.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;

use crate::churn::{Latency, WRITE_VERBS, histogram, scrape_apiserver};
use crate::cluster::{Cluster, ClusterOptions, RealNodesOptions};
use crate::error::{Error, Result};
use crate::exposition::Scrape;
use crate::peers::{Ipam, whereabouts};
use crate::realnode::Runtime;
use crate::realnode::chart::{self, ChartInstallation};
use crate::wait::{self, Probe};

/// The namespace of the benchmark's Deployments.
const NAMESPACE: &str = "default";

/// The label of the benchmark's pods.
const BENCH_LABEL: &str = "e2e.ipwarden.io/node-bench";

/// The CIDR of the exact pool; its ranges hold exactly as many IPs as pods.
const EXACT_CIDR: &str = "10.70.0.0/16";

/// The first IP of the exact pool's range.
const EXACT_FIRST: &str = "10.70.0.1";

/// The exact pool's gateway, outside its range.
const EXACT_GATEWAY: &str = "10.70.255.254";

/// Whereabouts' ample range's first and last IPs and its gateway: ipwarden's documented pool
/// (10.244.0.0/16, its gateway the first address, withheld).
const AMPLE_FIRST: &str = "10.244.0.2";
const AMPLE_LAST: &str = "10.244.255.254";
const AMPLE_GATEWAY: &str = "10.244.0.1";

/// The IPAM of one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BenchIpam {
    /// ipwarden from its chart, with a pool of exactly as many IPs as pods (the benchmark's
    /// and the chart's controller pods).
    IpwardenExact,
    /// ipwarden from its chart, with the documented pool, 10.244.0.0/16.
    IpwardenAmple,
    /// Debian's `host-local`, a /24 per node (ample).
    HostLocal,
    /// Whereabouts' plugin with a range of exactly as many IPs as pods.
    WhereaboutsExact,
    /// Whereabouts' plugin with ipwarden's documented pool's CIDR, 10.244.0.0/16.
    WhereaboutsAmple,
}

impl BenchIpam {
    /// Whether this is ipwarden.
    fn is_ipwarden(self) -> bool {
        matches!(self, Self::IpwardenExact | Self::IpwardenAmple)
    }

    /// Whether this is a peer measured beside ipwarden, whose failures are results to report
    /// rather than the benchmark's own.
    fn is_peer(self) -> bool {
        matches!(self, Self::WhereaboutsExact | Self::WhereaboutsAmple)
    }
}

impl std::fmt::Display for BenchIpam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::IpwardenExact => "ipwarden (chart), exact pool",
            Self::IpwardenAmple => "ipwarden (chart), ample pool",
            Self::HostLocal => "host-local, /24 per node",
            Self::WhereaboutsExact => "Whereabouts, exact range",
            Self::WhereaboutsAmple => "Whereabouts, ample range",
        })
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct NodeBenchOptions {
    /// Real nodes.
    pub nodes: usize,
    /// Deployments, spread over the nodes by the scheduler.
    pub deployments: usize,
    /// Pods per Deployment.
    pub replicas: usize,
    /// The runs, in order, each on a cluster of its own.
    pub runs: Vec<BenchIpam>,
    /// The ipwarden binary (agents, controllers, the CNI plugin).
    pub ipwarden: PathBuf,
    /// How long a phase may take before the run is given up.
    pub phase_timeout: Duration,
    /// How long the records, the pods' IPs and the network namespaces may take to agree after
    /// a phase (a DEL in flight, a lost one freed).
    pub settle_timeout: Duration,
}

/// One phase of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// The Deployments created, until every pod runs.
    Create,
    /// Every pod deleted at once, until as many new ones run.
    Recreate,
    /// Every node powered off and on, until every pod runs again.
    Recover,
    /// The Deployments deleted, until every pod is gone.
    Delete,
}

impl Phase {
    const ALL: [Self; 4] = [Self::Create, Self::Recreate, Self::Recover, Self::Delete];

    fn name(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Recreate => "re-create",
            Self::Recover => "recover",
            Self::Delete => "delete",
        }
    }
}

/// What one phase measured.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseReport {
    /// Which phase.
    pub phase: Phase,
    /// From its first call until its end state, in seconds.
    pub seconds: f64,
    /// Whether it reached its end state within the bound; when not, why in `failure`.
    pub completed: bool,
    /// Why it did not complete; empty when it did.
    pub failure: String,
    /// Whether, after it, the records, the pods' `podIPs` and the IPs in the nodes' network
    /// namespaces agreed within the settle bound, with no IP on two pods or in two namespaces
    /// (no leak, no duplicate); when not, what they were in `inconsistency`.
    pub consistent: bool,
    /// What disagreed; empty when consistent.
    pub inconsistency: String,
    /// Each pod's time from its creation (recover: from the power-off) to running, from the
    /// pods' own times (whole seconds, as the apiserver keeps them).
    pub pod_running: Latency,
    /// Sandbox creations that failed, from kubelet's `FailedCreatePodSandBox` Events.
    pub failed_sandboxes: u64,
    /// ipwarden's ADDs in the phase, from the agents' histogram, failed ones included (`None`
    /// for host-local).
    pub ipam_adds: Option<Latency>,
    /// ipwarden's DELs in the phase, from the agents' histogram (`None` for the others).
    pub ipam_dels: Option<Latency>,
    /// Of those, the ADDs the agents refused (pool exhausted, only cooling IPs, ...), from
    /// `ipwarden_agent_allocations_total` (`None` for host-local).
    pub ipam_adds_refused: Option<u64>,
    /// Write requests the apiserver served during the phase (every resource).
    pub apiserver_writes: u64,
}

/// One IPAM's run.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// The IPAM and its pool.
    pub ipam: BenchIpam,
    /// The phases it went through, in order (fewer when one failed).
    pub phases: Vec<PhaseReport>,
    /// What stopped the run short of its phases' end states (a failed call, a component that
    /// would not start); empty when nothing did.
    pub error: String,
}

/// The benchmark's report.
#[derive(Clone, Debug, Serialize)]
pub struct NodeBenchReport {
    /// Real nodes.
    pub nodes: usize,
    /// Pods (Deployments times replicas).
    pub pods: usize,
    /// The runs, in order.
    pub runs: Vec<RunReport>,
}

impl NodeBenchReport {
    /// Whether every phase of every run but a peer's completed (a peer's failure is a result,
    /// reported like its times).
    pub fn all_completed(&self) -> bool {
        self.runs
            .iter()
            .filter(|r| !r.ipam.is_peer())
            .all(|r| r.error.is_empty() && r.phases.len() == Phase::ALL.len() && r.phases.iter().all(|p| p.completed))
    }

    /// Whether every phase of every ipwarden run left the records, the pods' IPs and the
    /// network namespaces in agreement (host-local's and the peers' are reported, not judged:
    /// host-local leaks every reservation of a rebooted node by design).
    pub fn ipwarden_consistent(&self) -> bool {
        let ipwarden = self.runs.iter().filter(|r| r.ipam.is_ipwarden());
        ipwarden.flat_map(|r| &r.phases).all(|p| p.consistent)
    }

    /// The time of `phase` in the host-local run, if there is one.
    fn floor(&self, phase: Phase) -> Option<f64> {
        let run = self.runs.iter().find(|r| r.ipam == BenchIpam::HostLocal)?;
        run.phases.iter().find(|p| p.phase == phase && p.completed).map(|p| p.seconds)
    }
}

impl std::fmt::Display for NodeBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "node benchmark: {} pods as Deployments on {} real nodes", self.pods, self.nodes)?;
        for run in &self.runs {
            writeln!(f, "\n{}", run.ipam)?;
            if !run.error.is_empty() {
                writeln!(f, "STOPPED: {}", run.error)?;
            }
            writeln!(
                f,
                "{:<10} {:>9} {:>9} {:>14} {:>8} {:>16} {:>8} {:>16} {:>7}",
                "phase",
                "seconds",
                "x floor",
                "pod p50/p99 s",
                "failed",
                "ADD p50/p99 ms",
                "refused",
                "DEL p50/p99 ms",
                "writes"
            )?;
            for phase in &run.phases {
                let ratio = self.floor(phase.phase).filter(|f| *f > 0.0).map(|f| phase.seconds / f);
                let millis = |latency: Option<Latency>| {
                    latency.map_or("-".to_string(), |a| {
                        let ms = |v: Option<f64>| v.map_or("-".to_string(), |s| format!("{:.0}", s * 1000.0));
                        format!("{}/{}", ms(a.p50_seconds), ms(a.p99_seconds))
                    })
                };
                let (adds, dels) = (millis(phase.ipam_adds), millis(phase.ipam_dels));
                let refused = phase.ipam_adds_refused.map_or("-".to_string(), |n| n.to_string());
                let pods = format!(
                    "{}/{}",
                    phase.pod_running.p50_seconds.map_or("-".into(), |s| format!("{s:.0}")),
                    phase.pod_running.p99_seconds.map_or("-".into(), |s| format!("{s:.0}"))
                );
                let mut line = format!(
                    "{:<10} {:>9.1} {:>9} {:>14} {:>8} {:>16} {:>8} {:>16} {:>7}",
                    phase.phase.name(),
                    phase.seconds,
                    ratio.map_or("-".to_string(), |r| format!("{r:.2}")),
                    pods,
                    phase.failed_sandboxes,
                    adds,
                    refused,
                    dels,
                    phase.apiserver_writes
                );
                if !phase.failure.is_empty() {
                    let _ = write!(line, "  FAILED: {}", phase.failure);
                }
                if !phase.inconsistency.is_empty() {
                    let _ = write!(line, "  NOT SETTLED: {}", phase.inconsistency);
                }
                writeln!(f, "{line}")?;
            }
        }
        Ok(())
    }
}

/// Runs the benchmark: each run of `options` on a cluster of its own, one after the other; a
/// run that fails says why in its report and the next one runs.
pub async fn run(options: &NodeBenchOptions) -> Result<NodeBenchReport> {
    if options.nodes == 0 || options.deployments == 0 || options.replicas == 0 {
        return Err(Error::Tool {
            command: "node-bench".into(),
            reason: format!(
                "it needs at least one of each: {} nodes, {} Deployments, {} replicas",
                options.nodes, options.deployments, options.replicas
            ),
        });
    }
    let pods = options.deployments * options.replicas;
    let mut runs = Vec::new();
    for ipam in &options.runs {
        let run = one_run(*ipam, options).await;
        tracing::info!(report = %NodeBenchReport { nodes: options.nodes, pods, runs: vec![run.clone()] }, "node-bench: run done");
        runs.push(run);
    }
    Ok(NodeBenchReport { nodes: options.nodes, pods, runs })
}

/// The `ipam` section of the host-local runs' conflist: a /24 per node, its data in the node's
/// directory (on a real machine, `/var/lib/cni/networks`, one per node).
fn host_local_ipam() -> serde_json::Value {
    json!({
        "type": "host-local",
        "ranges": [[{"subnet": format!("10.80.{}.0/24", crate::realnode::NODE_INDEX_PLACEHOLDER)}]],
        "dataDir": format!("{}/host-local", crate::realnode::NODE_DIR_PLACEHOLDER),
    })
}

/// The exact pool's spec: ranges of exactly `pods` IPs from [`EXACT_FIRST`], a gateway
/// outside them.
fn exact_pool(pods: usize) -> serde_json::Value {
    json!({"cidr": EXACT_CIDR, "gateway": EXACT_GATEWAY, "default": true,
           "ranges": [{"start": EXACT_FIRST, "end": exact_last(pods).to_string()}]})
}

/// The last IP of an exact range of `pods` IPs from [`EXACT_FIRST`].
fn exact_last(pods: usize) -> std::net::Ipv4Addr {
    let first = std::net::Ipv4Addr::new(10, 70, 0, 1);
    let further = u32::try_from(pods.max(1) - 1).unwrap_or(u32::MAX);
    std::net::Ipv4Addr::from(u32::from(first).saturating_add(further))
}

/// ipwarden's chart as the run installed it, or nothing for the peers.
type Installed = Option<ChartInstallation>;

/// The tag of the image of ipwarden the runs install.
const IMAGE_TAG: &str = "node-bench";

async fn one_run(ipam: BenchIpam, options: &NodeBenchOptions) -> RunReport {
    let mut phases = Vec::new();
    let error = match phases_of(ipam, options, &mut phases).await {
        Ok(()) => String::new(),
        Err(e) => e.to_string(),
    };
    RunReport { ipam, phases, error }
}

/// The phases of one run, each pushed to `phases` as it ends.
async fn phases_of(ipam: BenchIpam, options: &NodeBenchOptions, phases: &mut Vec<PhaseReport>) -> Result<()> {
    let pods = options.deployments * options.replicas;
    let other_ipam = match ipam {
        BenchIpam::HostLocal => Some(host_local_ipam()),
        BenchIpam::WhereaboutsExact => Some(whereabouts::real_node_ipam(
            &whereabouts::Setup::bounded(EXACT_CIDR, EXACT_FIRST, &exact_last(pods).to_string()),
            EXACT_GATEWAY,
        )),
        BenchIpam::WhereaboutsAmple => Some(whereabouts::real_node_ipam(
            &whereabouts::Setup::bounded(whereabouts::RANGE, AMPLE_FIRST, AMPLE_LAST),
            AMPLE_GATEWAY,
        )),
        BenchIpam::IpwardenExact | BenchIpam::IpwardenAmple => None,
    };
    let real_nodes = RealNodesOptions {
        count: options.nodes,
        ipwarden: options.ipwarden.clone(),
        runtime: Runtime::Containerd,
        ipam: other_ipam.map(|ipam| ("1.0.0".to_string(), ipam)),
    };
    let mut cluster =
        Cluster::start(ClusterOptions { nodes: 0, real_nodes: Some(real_nodes), ..Default::default() }).await?;
    let installed = match start_ipam(&mut cluster, ipam, &options.ipwarden, pods).await {
        Ok(installed) => installed,
        Err(e) => {
            cluster.stop_after_failure();
            return Err(e);
        }
    };
    for phase in Phase::ALL {
        tracing::info!(%ipam, phase = phase.name(), "node-bench: phase starts");
        let report = match run_phase(&mut cluster, &installed, ipam, phase, options).await {
            Ok(report) => report,
            Err(e) => {
                cluster.stop_after_failure();
                return Err(e);
            }
        };
        let stop = !report.completed;
        phases.push(report);
        if stop {
            break;
        }
    }
    cluster.stop();
    Ok(())
}

/// Installs ipwarden's chart (the image of `binary`) and the pool `ipam` names, readies the
/// nodes for Whereabouts' plugin, or nothing for host-local; returns once the nodes are Ready
/// (with ipwarden, its agents and controllers too). ipwarden's exact pool holds an IP for each
/// of the chart's controller pods besides the benchmark's pods: they are pods on the same
/// network.
async fn start_ipam(cluster: &mut Cluster, ipam: BenchIpam, binary: &Path, pods: usize) -> Result<Installed> {
    let installed = match ipam {
        BenchIpam::HostLocal => None,
        BenchIpam::WhereaboutsExact | BenchIpam::WhereaboutsAmple => {
            whereabouts::prepare_real_nodes(cluster, &whereabouts::build()?).await?;
            None
        }
        BenchIpam::IpwardenExact | BenchIpam::IpwardenAmple => {
            chart::load_image(cluster, binary, IMAGE_TAG, cluster.dir()).await?;
            let installation = chart::install(cluster, IMAGE_TAG).await?;
            let pool = match ipam {
                BenchIpam::IpwardenExact => exact_pool(pods + chart::CONTROLLER_REPLICAS),
                _ => crate::ipwarden::default_pool(),
            };
            crate::ipwarden::create_pool(&cluster.client(), "default", pool).await?;
            chart::wait_running(cluster).await?;
            Some(installation)
        }
    };
    cluster.wait_real_nodes_ready().await?;
    Ok(installed)
}

/// What the phase's counters read at one moment.
struct Counters {
    agents: Vec<Scrape>,
    apiserver: Scrape,
    failed_sandboxes: u64,
}

async fn counters(client: &Client, installed: &Installed) -> Result<Counters> {
    let mut agents = Vec::new();
    if installed.is_some() {
        let listed = Api::<Pod>::namespaced(client.clone(), chart::NAMESPACE)
            .list(&ListParams::default().labels(chart::AGENT_SELECTOR))
            .await
            .map_err(Error::kube("listing the agent pods"))?;
        for agent in listed.items.iter().filter(|p| p.metadata.deletion_timestamp.is_none()) {
            let Some(ip) = agent.status.as_ref().and_then(|s| s.pod_ip.clone()) else {
                return Err(Error::Tool {
                    command: format!("scraping agent pod {}", agent.name_any()),
                    reason: "it has no IP yet".into(),
                });
            };
            let text = crate::ipwarden::get_at(&ip, chart::AGENT_METRICS_PORT, "/metrics").await?;
            let what = format!("agent pod {}", agent.name_any());
            agents.push(Scrape::parse(&text).map_err(|source| Error::Scrape { what, source })?);
        }
    }
    let apiserver = scrape_apiserver(client).await?;
    let events = Api::<Event>::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default())
        .await
        .map_err(Error::kube("listing Events"))?
        .items;
    let failed_sandboxes = events
        .iter()
        .filter(|e| e.reason.as_deref() == Some("FailedCreatePodSandBox"))
        .map(|e| u64::try_from(e.count.unwrap_or(1)).unwrap_or(0))
        .sum();
    Ok(Counters { agents, apiserver, failed_sandboxes })
}

async fn run_phase(
    cluster: &mut Cluster,
    installed: &Installed,
    ipam: BenchIpam,
    phase: Phase,
    options: &NodeBenchOptions,
) -> Result<PhaseReport> {
    let client = cluster.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let total = options.deployments * options.replicas;
    let before = counters(&client, installed).await?;
    let started = Instant::now();
    let since = Timestamp::now();
    let outcome: Result<Vec<Pod>> = match phase {
        Phase::Create => {
            create_deployments(&client, options.deployments, options.replicas).await?;
            wait_running(&pods, total, |_| true, options.phase_timeout).await
        }
        Phase::Recreate => {
            let old = bench_pods(&pods).await?;
            delete_all(&pods, &old).await?;
            let old: HashSet<String> = old.iter().filter_map(|p| p.uid()).collect();
            wait_running(&pods, total, |p| !old.contains(&p.uid().unwrap_or_default()), options.phase_timeout).await
        }
        Phase::Recover => {
            let before: HashSet<String> = bench_pods(&pods).await?.iter().flat_map(container_ids).collect();
            power_cycle(cluster).await?;
            let restarted = |p: &Pod| {
                let now = container_ids(p);
                !now.is_empty() && now.iter().all(|id| !before.contains(id))
            };
            wait_running(&pods, total, restarted, options.phase_timeout).await
        }
        Phase::Delete => {
            Api::<Deployment>::namespaced(client.clone(), NAMESPACE)
                .delete_collection(&DeleteParams::default(), &ListParams::default().labels(BENCH_LABEL))
                .await
                .map_err(Error::kube("deleting the Deployments"))?;
            wait_gone(&pods, options.phase_timeout).await.map(|()| Vec::new())
        }
    };
    let seconds = started.elapsed().as_secs_f64();
    let after = counters(&client, installed).await?;
    let (completed, failure, running) = match outcome {
        Ok(running) => (true, String::new(), running),
        Err(Error::Timeout { what, last, .. }) => (false, format!("{what}: {last}"), Vec::new()),
        Err(e) => return Err(e),
    };
    let samples: Vec<f64> = running.iter().filter_map(|p| running_after(p, phase, since)).collect();
    let inconsistency = match check_settled(cluster, ipam, options.settle_timeout).await {
        Ok(()) => String::new(),
        Err(why) => why,
    };
    let agents_latency = |name: &str| {
        installed.as_ref().map(|_| {
            let now = histogram(&after.agents, name);
            // The recover phase restarted the agents: their histograms hold its calls alone
            // (the benchmark pods' and the restarted controller pods' ADDs).
            match phase {
                Phase::Recover => Latency::of_histogram(&now),
                _ => Latency::of_histogram(&now.since(&histogram(&before.agents, name))),
            }
        })
    };
    let adds = agents_latency("ipwarden_agent_allocation_duration_seconds");
    let dels = agents_latency("ipwarden_agent_release_duration_seconds");
    let refused = installed.as_ref().map(|_| {
        let count = |scrapes: &[Scrape]| -> f64 {
            let refused = |l: &crate::exposition::Labels| l.get("result").is_some_and(|r| r != "success");
            scrapes.iter().map(|s| s.sum_where("ipwarden_agent_allocations_total", refused)).sum()
        };
        let earlier = if phase == Phase::Recover { 0.0 } else { count(&before.agents) };
        (count(&after.agents) - earlier).max(0.0).round() as u64
    });
    let writes = |s: &Scrape| {
        s.sum_where("apiserver_request_total", |l| l.get("verb").is_some_and(|v| WRITE_VERBS.contains(&v.as_str())))
    };
    Ok(PhaseReport {
        phase,
        seconds,
        completed,
        failure,
        consistent: inconsistency.is_empty(),
        inconsistency,
        pod_running: Latency::of_samples(samples),
        failed_sandboxes: after.failed_sandboxes.saturating_sub(before.failed_sandboxes),
        ipam_adds: adds,
        ipam_dels: dels,
        ipam_adds_refused: refused,
        apiserver_writes: (writes(&after.apiserver) - writes(&before.apiserver)).max(0.0).round() as u64,
    })
}

/// Creates `count` Deployments of `replicas` pods on the real nodes.
async fn create_deployments(client: &Client, count: usize, replicas: usize) -> Result<()> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    for index in 0..count {
        let name = format!("bench-{index}");
        let labels = json!({"app": name, BENCH_LABEL: "true"});
        let deployment: Deployment = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {BENCH_LABEL: "true"}},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": labels}, "spec": crate::realnode::workload_spec()}},
        }))
        .map_err(|e| Error::Kube { what: format!("building Deployment {name}"), source: kube::Error::SerdeError(e) })?;
        deployments
            .create(&PostParams::default(), &deployment)
            .await
            .map_err(Error::kube(format!("creating Deployment {name}")))?;
    }
    Ok(())
}

/// Deletes every pod of `old` at once: one request each, many in flight (a DeleteCollection
/// of hundreds of pods outlasts the apiserver's request timeout on a loaded machine); a pod
/// already gone counts as deleted.
async fn delete_all(pods: &Api<Pod>, old: &[Pod]) -> Result<()> {
    let deletions = old.iter().map(|pod| async move {
        let name = pod.name_any();
        match pods.delete(&name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(e) => Err(Error::kube(format!("deleting bench pod {name}"))(e)),
        }
    });
    let results: Vec<Result<()>> =
        futures::stream::iter(deletions).buffer_unordered(DELETIONS_IN_FLIGHT).collect().await;
    results.into_iter().collect()
}

/// Deletions [`delete_all`] keeps in flight.
const DELETIONS_IN_FLIGHT: usize = 32;

/// The benchmark's live pods (not being deleted).
async fn bench_pods(pods: &Api<Pod>) -> Result<Vec<Pod>> {
    let listed =
        pods.list(&ListParams::default().labels(BENCH_LABEL)).await.map_err(Error::kube("listing bench pods"))?;
    Ok(listed.items.into_iter().filter(|p| p.metadata.deletion_timestamp.is_none()).collect())
}

/// Whether `pod` runs, Ready, with an IP.
fn is_running(pod: &Pod) -> bool {
    let status = pod.status.clone().unwrap_or_default();
    status.phase.as_deref() == Some("Running")
        && status.pod_ip.is_some()
        && status.conditions.unwrap_or_default().iter().any(|c| c.type_ == "Ready" && c.status == "True")
}

/// The IDs of `pod`'s containers as its status names them (a restarted container has a new one).
fn container_ids(pod: &Pod) -> Vec<String> {
    let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.as_ref());
    statuses.into_iter().flatten().filter_map(|c| c.container_id.clone()).collect()
}

/// When `pod` turned Ready.
fn ready_at(pod: &Pod) -> Option<Timestamp> {
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    conditions.iter().find(|c| c.type_ == "Ready" && c.status == "True")?.last_transition_time.as_ref().map(|t| t.0)
}

/// `pod`'s seconds from its creation (recover: from `since`, the power-off) to Ready. The
/// apiserver keeps whole seconds, so a figure may be up to a second off (a recover's low).
fn running_after(pod: &Pod, phase: Phase, since: Timestamp) -> Option<f64> {
    let start = match phase {
        Phase::Recover => Timestamp::from_second(since.as_second()).ok()?,
        _ => pod.metadata.creation_timestamp.as_ref()?.0,
    };
    let ready = ready_at(pod)?;
    Some(ready.duration_since(start).as_secs_f64())
}

/// Waits until `count` live bench pods that `counts` selects run; returns them.
async fn wait_running(
    pods: &Api<Pod>,
    count: usize,
    counts: impl Fn(&Pod) -> bool,
    timeout: Duration,
) -> Result<Vec<Pod>> {
    wait::until(&format!("{count} bench pods running"), timeout, || async {
        let live = bench_pods(pods).await?;
        let running: Vec<Pod> = live.into_iter().filter(|p| counts(p) && is_running(p)).collect();
        Ok(if running.len() >= count {
            Probe::Done(running)
        } else {
            Probe::Pending(format!("{} running", running.len()))
        })
    })
    .await
}

/// Waits until no bench pod is left, being deleted or not.
async fn wait_gone(pods: &Api<Pod>, timeout: Duration) -> Result<()> {
    wait::until("every bench pod gone", timeout, || async {
        let listed =
            pods.list(&ListParams::default().labels(BENCH_LABEL)).await.map_err(Error::kube("listing bench pods"))?;
        Ok(if listed.items.is_empty() {
            Probe::Done(())
        } else {
            Probe::Pending(format!("{} left", listed.items.len()))
        })
    })
    .await
}

/// Every node's "reboot" at once: kubelet, the runtime and every container (ipwarden's agent
/// and controller pods among them) killed, the runtime's state and network namespaces wiped;
/// the nodes started again, their kubelets starting the pods again (the agent's checkpoint
/// kept on the node's disk).
async fn power_cycle(cluster: &mut Cluster) -> Result<()> {
    for index in 0..cluster.real_nodes().len() {
        cluster.real_node(index).power_off();
    }
    for index in 0..cluster.real_nodes().len() {
        cluster.real_node(index).boot().await?;
    }
    cluster.wait_real_nodes_ready().await
}

/// Waits until no pod on the pod network (the bench pods, and ipwarden's controller pods) is
/// being deleted any more and the records, the pods' IPs and the IPs in the nodes' network
/// namespaces are one set, each record naming the pod that has its IP (ipwarden; host-local's
/// name a container), with no IP on two pods and none in two namespaces; says why not when the
/// bound passes. Pods that ended (Failed, Succeeded) have no sandbox and are left out.
async fn check_settled(cluster: &Cluster, ipam: BenchIpam, timeout: Duration) -> std::result::Result<(), String> {
    let client = cluster.client();
    let outcome = wait::until("records, podIPs and network namespaces agree", timeout, || async {
        let listed =
            Api::<Pod>::all(client.clone()).list(&ListParams::default()).await.map_err(Error::kube("listing pods"))?;
        let networked: Vec<&Pod> =
            listed.items.iter().filter(|p| !p.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false)).collect();
        let terminating = networked.iter().filter(|p| p.metadata.deletion_timestamp.is_some()).count();
        let live = networked.iter().filter(|p| {
            let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
            !matches!(phase, Some("Failed" | "Succeeded"))
        });
        let holders: Vec<(String, String)> =
            live.filter_map(|p| Some((p.status.as_ref()?.pod_ip.clone()?, p.uid().unwrap_or_default()))).collect();
        let mut netns: Vec<String> = Vec::new();
        for node in cluster.real_nodes() {
            netns.extend(node.netns_ips());
        }
        let records = records(cluster, ipam).await?;
        let differences = disagreements(&records, &holders, &netns);
        Ok(if terminating == 0 && differences.is_empty() {
            Probe::Done(())
        } else {
            Probe::Pending(format!("{terminating} pods terminating; {}", differences.join("; ")))
        })
    })
    .await;
    outcome.map_err(|e| e.to_string())
}

/// How `records` (IP -> the UID of the pod its record names, if it names one), the live pods'
/// `holders` (IP, UID) and the IPs in the nodes' network namespaces disagree, each kind with
/// its count and a few examples; empty when they agree.
fn disagreements(
    records: &BTreeMap<String, Option<String>>,
    holders: &[(String, String)],
    netns: &[String],
) -> Vec<String> {
    const EXAMPLES: usize = 5;
    let twice = |ips: &mut dyn Iterator<Item = &String>| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        ips.filter(|ip| !seen.insert(ip.to_string())).cloned().collect()
    };
    let pods: BTreeMap<&String, &String> = holders.iter().map(|(ip, uid)| (ip, uid)).collect();
    let pod_ips: BTreeSet<&String> = pods.keys().copied().collect();
    let recorded: BTreeSet<&String> = records.keys().collect();
    let in_netns: BTreeSet<&String> = netns.iter().collect();
    let wrong_owner: BTreeSet<&String> = records
        .iter()
        .filter(|(ip, owner)| owner.as_ref().is_some_and(|uid| pods.get(ip).is_some_and(|held| *held != uid)))
        .map(|(ip, _)| ip)
        .collect();
    let kinds: [(&str, BTreeSet<String>); 7] = [
        ("IPs on two pods", twice(&mut holders.iter().map(|(ip, _)| ip))),
        ("IPs in two network namespaces", twice(&mut netns.iter())),
        ("recorded, no pod's", recorded.difference(&pod_ips).map(|ip| ip.to_string()).collect()),
        ("a pod's, not recorded", pod_ips.difference(&recorded).map(|ip| ip.to_string()).collect()),
        ("in a network namespace, no pod's", in_netns.difference(&pod_ips).map(|ip| ip.to_string()).collect()),
        ("a pod's, in no network namespace", pod_ips.difference(&in_netns).map(|ip| ip.to_string()).collect()),
        ("recorded for another pod", wrong_owner.into_iter().cloned().collect()),
    ];
    kinds
        .into_iter()
        .filter(|(_, ips)| !ips.is_empty())
        .map(|(kind, ips)| {
            let examples: Vec<&String> = ips.iter().take(EXAMPLES).collect();
            let more = if ips.len() > EXAMPLES { ", ..." } else { "" };
            format!("{} {kind} ({examples:?}{more})", ips.len())
        })
        .collect()
}

/// The IPs the IPAM has recorded, each with the UID of the pod its record names (`None` where
/// the record names none: host-local's name a container): ipwarden's IPBlock records,
/// Whereabouts' IPPool allocations (their pods' names resolved to the UIDs of the live pods of
/// those names), or host-local's reservation files in every node's data directory, under the
/// network name of the node's conflist.
async fn records(cluster: &Cluster, ipam: BenchIpam) -> Result<BTreeMap<String, Option<String>>> {
    if ipam.is_peer() {
        let listed = Api::<Pod>::namespaced(cluster.client(), NAMESPACE)
            .list(&ListParams::default().labels(BENCH_LABEL))
            .await
            .map_err(Error::kube("listing bench pods"))?;
        let uids: BTreeMap<String, String> = listed
            .items
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .map(|p| (format!("{NAMESPACE}/{}", p.name_any()), p.uid().unwrap_or_default()))
            .collect();
        let held = whereabouts::allocations(&cluster.client()).await?;
        return Ok(held
            .into_iter()
            .map(|(ip, pod)| {
                let uid = uids.get(&pod).cloned().unwrap_or_else(|| format!("{pod} (no live pod of that name)"));
                (ip, Some(uid))
            })
            .collect());
    }
    if ipam == BenchIpam::HostLocal {
        let mut ips = BTreeMap::new();
        for node in cluster.real_nodes() {
            let conflist_path = node.paths().cni_conf_dir().join(crate::realnode::CONFLIST);
            let text =
                std::fs::read_to_string(&conflist_path).map_err(Error::io("reading the conflist", &conflist_path))?;
            let conflist: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Tool {
                command: format!("parsing {}", conflist_path.display()),
                reason: e.to_string(),
            })?;
            let network = conflist["name"].as_str().unwrap_or_default();
            let dir = node.dir().join("host-local").join(network);
            let entries = match std::fs::read_dir(&dir) {
                Ok(entries) => entries,
                // No reservation made on this node yet.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io("reading host-local's reservations", &dir)(e)),
            };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().to_string();
                if name.parse::<std::net::IpAddr>().is_ok() {
                    ips.insert(name, None);
                }
            }
        }
        return Ok(ips);
    }
    let blocks: Api<DynamicObject> = Api::all_with(cluster.client(), &Ipam::Ipwarden.records());
    let listed = blocks.list(&ListParams::default()).await.map_err(Error::kube("listing IPBlocks"))?;
    let mut ips = BTreeMap::new();
    for block in &listed.items {
        for (ip, record) in block.data["spec"]["allocations"].as_object().into_iter().flatten() {
            ips.insert(ip.clone(), record["pod"]["uid"].as_str().map(str::to_string));
        }
    }
    Ok(ips)
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn the_exact_pool_holds_exactly_as_many_ips_as_pods() {
        let pool = exact_pool(200);
        assert_eq!(pool["ranges"][0]["start"], "10.70.0.1");
        assert_eq!(pool["ranges"][0]["end"], "10.70.0.200");
        assert_eq!(exact_pool(300)["ranges"][0]["end"], "10.70.1.44");
    }

    #[test]
    fn every_kind_of_disagreement_is_counted_with_a_few_examples() {
        let owned = |ip: &str, uid: Option<&str>| (ip.to_string(), uid.map(str::to_string));
        let held = |ip: &str, uid: &str| (ip.to_string(), uid.to_string());
        let records: BTreeMap<String, Option<String>> =
            [owned("10.0.0.1", Some("a")), owned("10.0.0.2", None), owned("10.0.0.3", Some("x"))].into();
        let agreeing = [held("10.0.0.1", "a"), held("10.0.0.2", "b"), held("10.0.0.3", "x")];
        let netns: Vec<String> = ["10.0.0.1", "10.0.0.2", "10.0.0.3"].map(String::from).into();
        assert!(disagreements(&records, &agreeing, &netns).is_empty());

        let holders = [held("10.0.0.1", "a"), held("10.0.0.1", "c"), held("10.0.0.3", "y"), held("10.0.0.4", "d")];
        let netns: Vec<String> = ["10.0.0.1", "10.0.0.1", "10.0.0.9"].map(String::from).into();
        let found = disagreements(&records, &holders, &netns);
        let expected = [
            r#"1 IPs on two pods (["10.0.0.1"])"#,
            r#"1 IPs in two network namespaces (["10.0.0.1"])"#,
            r#"1 recorded, no pod's (["10.0.0.2"])"#,
            r#"1 a pod's, not recorded (["10.0.0.4"])"#,
            r#"1 in a network namespace, no pod's (["10.0.0.9"])"#,
            r#"2 a pod's, in no network namespace (["10.0.0.3", "10.0.0.4"])"#,
            r#"2 recorded for another pod (["10.0.0.1", "10.0.0.3"])"#,
        ];
        assert_eq!(found, expected);
        let many: Vec<(String, String)> = (10..20).map(|i| held(&format!("10.0.1.{i}"), "p")).collect();
        let found = disagreements(&BTreeMap::new(), &many, &[]);
        assert!(found[0].starts_with("10 a pod's, not recorded (") && found[0].ends_with(", ...)"), "{found:?}");
    }

    #[test]
    fn an_exact_range_ends_where_as_many_ips_as_pods_end() {
        assert_eq!(exact_last(1).to_string(), EXACT_FIRST);
        assert_eq!(exact_last(256).to_string(), "10.70.1.0");
    }

    #[test]
    fn host_local_takes_a_range_and_a_data_directory_per_node() {
        let ipam = host_local_ipam().to_string();
        assert!(ipam.contains("10.80.{NODE_INDEX}.0/24"), "{ipam}");
        assert!(ipam.contains("{NODE_DIR}/host-local"), "{ipam}");
    }
}
