//! `ipwarden-e2e up` (`make demo`, `make cluster-up`): a test cluster for a person to look at,
//! running ipwarden (or, bare, Debian's host-local) and optionally the demo workload, with
//! progress while it starts, a short summary once it is ready, and the demo's events after.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::cluster::{Cluster, ClusterOptions};
use crate::cni::RuntimeGc;
use crate::error::{Error, Result};
use crate::ipwarden::Installation;
use crate::realnode::Runtime;
use crate::realnode::chart::{self, ChartInstallation};

/// What `up` starts.
#[derive(Clone, Debug)]
pub struct UpOptions {
    /// How many simulated nodes to register.
    pub nodes: usize,
    /// Where the admin kubeconfig is copied once the cluster is ready; the CNI plugin is linked
    /// into `cni-bin` beside it.
    pub kubeconfig: PathBuf,
    /// The ipwarden binary to run: its CNI plugin on every node, an agent per node, two
    /// controller replicas and a default pool. `None`: a bare cluster on Debian's host-local.
    pub ipwarden: Option<PathBuf>,
    /// Flags added to every agent's command line (e.g. a shorter sandbox grace).
    pub agent_args: Vec<String>,
    /// Flags added to every controller replica's command line (e.g. a 5 s sweep).
    pub controller_args: Vec<String>,
    /// With the demo workload: how long between two pod deletions.
    pub demo: Option<Duration>,
    /// When the simulated runtime calls CNI GC (default never, as containerd).
    pub runtime_gc: RuntimeGc,
    /// How many real nodes (kubelet and a runtime, docs/testing.md "Real nodes") to run
    /// beside the simulated ones; needs `ipwarden` and root.
    pub real_nodes: usize,
    /// The real nodes' container runtime.
    pub runtime: Runtime,
    /// How ipwarden runs.
    pub install: Install,
}

/// How `up` runs ipwarden.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Install {
    /// As processes on this host: an agent per node, two controller replicas.
    #[default]
    Processes,
    /// As users install it: `helm install` of the chart, its pods from ipwarden's image under
    /// the real nodes' kubelets (real nodes only, no simulated ones: [`chart`]).
    Chart,
}

impl std::str::FromStr for Install {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, Self::Err> {
        match text {
            "processes" => Ok(Self::Processes),
            "chart" => Ok(Self::Chart),
            other => Err(format!("{other:?} is neither `processes` nor `chart`")),
        }
    }
}

/// How ipwarden runs on a cluster `up` started, if it does.
enum Running<'a> {
    /// Not at all: a bare cluster.
    Bare,
    /// As processes on this host.
    Processes(&'a Installation),
    /// From its chart.
    Chart,
}

/// How many nodes of each kind a cluster gets.
#[derive(Clone, Copy, Debug)]
pub struct NodeCounts {
    /// Simulated nodes.
    pub simulated: usize,
    /// Real nodes (kubelet and a runtime; only with ipwarden).
    pub real: usize,
    /// The real nodes' container runtime.
    pub runtime: Runtime,
}

/// Where `up` writes what a person reads, one line per call: progress, the summary, the
/// demo's events. The binary prints them; a test keeps them.
pub type Say = Arc<dyn Fn(&str) + Send + Sync>;

/// A cluster `up` started. [`Up::stop`] (or dropping it) stops everything and removes the
/// kubeconfig copy.
pub struct Up {
    // Dropped in this order after `drop`: the demo's tasks, ipwarden (held only to be
    // stopped then), then the cluster.
    tasks: Vec<JoinHandle<()>>,
    _installation: Option<Installation>,
    _chart: Option<ChartInstallation>,
    cluster: Cluster,
    kubeconfig: PathBuf,
}

impl Up {
    /// The cluster.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Stops the demo, ipwarden and the cluster, and removes the kubeconfig copy and the run
    /// directory.
    pub fn stop(self) {
        drop(self);
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        let _already_gone = std::fs::remove_file(&self.kubeconfig);
    }
}

/// A cluster of `nodes.simulated` simulated nodes; with `ipwarden`, its CNI plugin (linked into `plugin_dir`) on
/// every node, called with CNI GC as `runtime_gc` says, an agent per node (with the chart's
/// defaults, [`CHART_AGENT_DEFAULTS`], then `agent_args`), the default pool and two
/// controller replicas (with `controller_args`),
/// saying `progress` when ipwarden starts; `nodes.real` real nodes beside them (with
/// `ipwarden` only), Ready once their agents serve. `up` and the churn benchmark start their
/// clusters with it.
pub async fn start_cluster(
    nodes: NodeCounts,
    ipwarden: Option<&Path>,
    plugin_dir: &Path,
    agent_args: &[&str],
    controller_args: &[&str],
    runtime_gc: RuntimeGc,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Result<(Cluster, Option<Installation>)> {
    let binary = match ipwarden {
        Some(binary) => Some(std::fs::canonicalize(binary).map_err(Error::io("finding the ipwarden binary", binary))?),
        None => None,
    };
    let network = match &binary {
        Some(binary) => Some(crate::CniNetwork { runtime_gc, ..crate::ipwarden::network(binary, plugin_dir)? }),
        None => None,
    };
    let real_nodes = binary.clone().filter(|_| nodes.real > 0).map(|ipwarden| crate::cluster::RealNodesOptions {
        count: nodes.real,
        ipwarden,
        runtime: nodes.runtime,
        ipam: None,
    });
    let options = ClusterOptions { nodes: nodes.simulated, network, real_nodes, ..ClusterOptions::default() };
    let mut cluster = Cluster::start(options).await?;
    let Some(binary) = binary else { return Ok((cluster, None)) };
    progress("starting ipwarden: an agent per node, the default pool 10.244.0.0/16, 2 controller replicas");
    let pool = crate::ipwarden::default_pool();
    let agent_args = with_chart_defaults(agent_args);
    let installed = match crate::ipwarden::install_with(&cluster, &binary, pool, &agent_args, controller_args).await {
        Ok(installation) => cluster.wait_real_nodes_ready().await.map(|()| installation),
        Err(e) => Err(e),
    };
    match installed {
        Ok(installation) => Ok((cluster, Some(installation))),
        Err(e) => {
            cluster.stop_after_failure();
            Err(e)
        }
    }
}

/// The agent flags the chart sets whose value differs from the agent's own default: each agent
/// asks its node's runtime over CRI (`agent.cri.enabled`), so what `up` and the churn benchmark
/// run is what the chart ships.
pub const CHART_AGENT_DEFAULTS: [&str; 1] = [crate::ipwarden::WITH_CRI];

/// [`CHART_AGENT_DEFAULTS`] and then `agent_args`, leaving out a default whose flag
/// `agent_args` sets itself.
fn with_chart_defaults<'a>(agent_args: &[&'a str]) -> Vec<&'a str> {
    let flag = |arg: &str| arg.split('=').next().unwrap_or_default().to_string();
    let given: Vec<String> = agent_args.iter().map(|a| flag(a)).collect();
    CHART_AGENT_DEFAULTS.iter().filter(|d| !given.contains(&flag(d))).chain(agent_args).copied().collect()
}

/// How long the demo's pods may take to run, and its narration to list the IPBlocks.
const DEMO_READY_TIMEOUT: Duration = Duration::from_secs(180);

/// Starts what `options` asks for, saying what it does, copies the kubeconfig, says the
/// summary and starts the demo; returns once the cluster (and the demo's pods) are ready.
pub async fn start(options: &UpOptions, say: Say) -> Result<Up> {
    let state_dir = options.kubeconfig.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if options.install == Install::Chart {
        return start_with_chart(options, state_dir, say).await;
    }
    let plugin_dir = state_dir.join("cni-bin");
    say(&format!("starting the control plane and {} simulated nodes", options.nodes));
    let agent_args: Vec<&str> = options.agent_args.iter().map(String::as_str).collect();
    let controller_args: Vec<&str> = options.controller_args.iter().map(String::as_str).collect();
    let ipwarden = options.ipwarden.as_deref();
    if options.real_nodes > 0 {
        say(&format!("and {} real nodes (kubelet and {})", options.real_nodes, options.runtime.name()));
    }
    let (cluster, installation) = start_cluster(
        NodeCounts { simulated: options.nodes, real: options.real_nodes, runtime: options.runtime },
        ipwarden,
        &plugin_dir,
        &agent_args,
        &controller_args,
        options.runtime_gc,
        say.as_ref(),
    )
    .await?;
    let running = installation.as_ref().map_or(Running::Bare, Running::Processes);
    match demo_and_summary(options, state_dir, &cluster, running, &say).await {
        Ok(tasks) => {
            Ok(Up { tasks, _installation: installation, _chart: None, cluster, kubeconfig: options.kubeconfig.clone() })
        }
        Err(e) => {
            drop(installation);
            cluster.stop_after_failure();
            Err(e)
        }
    }
}

/// [`start`] with [`Install::Chart`]: the real nodes, the test image of `options.ipwarden`
/// loaded into each, the chart installed, the documented pool.
async fn start_with_chart(options: &UpOptions, state_dir: &Path, say: Say) -> Result<Up> {
    let binary = match (&options.ipwarden, options.nodes, options.real_nodes) {
        (Some(binary), 0, 1..) => {
            std::fs::canonicalize(binary).map_err(Error::io("finding the ipwarden binary", binary))?
        }
        _ => {
            return Err(Error::Tool {
                command: "up --install chart".into(),
                reason: "the chart runs on real nodes only: pass --ipwarden <binary> --nodes 0 --real-nodes N \
                         (docs/testing.md, \"The chart on real nodes\")"
                    .into(),
            });
        }
    };
    let count = options.real_nodes;
    let nodes = if count == 1 { "1 real node".to_string() } else { format!("{count} real nodes") };
    say(&format!("starting the control plane and {nodes} (kubelet and {})", options.runtime.name()));
    let real_nodes = Some(crate::cluster::RealNodesOptions {
        count,
        ipwarden: binary.clone(),
        runtime: options.runtime,
        ipam: None,
    });
    let mut cluster = Cluster::start(ClusterOptions { nodes: 0, real_nodes, ..ClusterOptions::default() }).await?;
    say(
        "installing ipwarden with its Helm chart: its image loaded into the nodes, helm install, the default pool 10.244.0.0/16",
    );
    let installed = async {
        chart::load_image(&cluster, &binary, chart::UP_TAG, cluster.dir()).await?;
        let installation = chart::install(&cluster, chart::UP_TAG).await?;
        crate::ipwarden::create_pool(&cluster.client(), "default", crate::ipwarden::default_pool()).await?;
        chart::wait_running(&mut cluster).await?;
        Ok(installation)
    }
    .await;
    let installation = match installed {
        Ok(installation) => installation,
        Err(e) => {
            cluster.stop_after_failure();
            return Err(e);
        }
    };
    match demo_and_summary(options, state_dir, &cluster, Running::Chart, &say).await {
        Ok(tasks) => Ok(Up {
            tasks,
            _installation: None,
            _chart: Some(installation),
            cluster,
            kubeconfig: options.kubeconfig.clone(),
        }),
        Err(e) => {
            cluster.stop_after_failure();
            Err(e)
        }
    }
}

/// What [`start`] does once ipwarden runs: the kubeconfig copy, the demo workload and its
/// narration (started once its pods run), the summary, then the demo's churn.
async fn demo_and_summary(
    options: &UpOptions,
    state_dir: &Path,
    cluster: &Cluster,
    running: Running<'_>,
    say: &Say,
) -> Result<Vec<JoinHandle<()>>> {
    std::fs::create_dir_all(state_dir).map_err(Error::io("creating the state directory", state_dir))?;
    std::fs::copy(cluster.kubeconfig(), &options.kubeconfig)
        .map_err(Error::io("copying the kubeconfig", &options.kubeconfig))?;
    let mut tasks = Vec::new();
    if options.demo.is_some() {
        say("creating the demo workload (StatefulSet default/web, Deployment default/api, 3 pods each)");
        let on_real_nodes = cluster.nodes().is_empty() && !cluster.real_nodes().is_empty();
        crate::demo::create(&cluster.client(), on_real_nodes).await?;
        crate::demo::wait_running(&cluster.client(), DEMO_READY_TIMEOUT).await?;
        if !matches!(running, Running::Bare) {
            let (synced, listed) = tokio::sync::oneshot::channel();
            tasks.push(tokio::spawn(crate::demo::narrate(cluster.client(), say.clone(), synced)));
            let listing = tokio::time::timeout(DEMO_READY_TIMEOUT, listed).await;
            if !matches!(listing, Ok(Ok(()))) {
                return Err(Error::Timeout {
                    what: "the demo's first listing of the IPBlocks".to_string(),
                    timeout: DEMO_READY_TIMEOUT,
                    last: format!("{listing:?}"),
                });
            }
        }
    }
    summary(options, cluster, &running, say);
    if let Some(interval) = options.demo {
        say(&format!("demo: a pod deleted every {interval:?}; what happens to its IP follows"));
        tasks.push(tokio::spawn(crate::demo::churn(cluster.client(), interval, say.clone())));
    }
    Ok(tasks)
}

/// The lines a person needs to look at the cluster.
fn summary(options: &UpOptions, cluster: &Cluster, running: &Running<'_>, say: &Say) {
    let kubeconfig = options.kubeconfig.display();
    let kubectl = format!("{} --kubeconfig {kubeconfig}", cluster.kubectl().display());
    match running {
        Running::Processes(installation) => say(&format!(
            "cluster ready: {} simulated nodes running ipwarden ({} agents, {} controller replicas)",
            cluster.nodes().len(),
            installation.agents.len(),
            installation.controllers.len()
        )),
        Running::Chart => say(&format!(
            "cluster ready: real node {} running ipwarden from its Helm chart (release {} in {}: the agent \
             DaemonSet, 2 controller pods)",
            cluster.real_nodes().iter().map(|n| n.name()).collect::<Vec<_>>().join(", "),
            chart::RELEASE,
            chart::NAMESPACE
        )),
        Running::Bare => {
            say(&format!("cluster ready: {} simulated nodes on host-local, no ipwarden", cluster.nodes().len()))
        }
    }
    say(&format!("  kubeconfig: {kubeconfig}"));
    say(&format!("  kubectl:    {kubectl} get pods -A -o wide"));
    if let (false, Some(binary)) = (matches!(running, Running::Bare), &options.ipwarden) {
        say(&format!("              {kubectl} get ippools,ipblocks; ... get ipclaims -A"));
        say(&format!("  ipwarden:   KUBECONFIG={kubeconfig} {} status (also: check; gc --dry-run)", binary.display()));
    }
    match running {
        Running::Processes(installation) => {
            let ports = |daemons: &[crate::ipwarden::Daemon]| {
                daemons.iter().map(|d| d.metrics_port.to_string()).collect::<Vec<_>>().join(" ")
            };
            say(&format!(
                "  metrics:    http://127.0.0.1:<port>/metrics; agents (node order) {}, controllers {}",
                ports(&installation.agents),
                ports(&installation.controllers)
            ));
        }
        Running::Chart => say(&format!(
            "  metrics:    the agent's http://127.0.0.1:9612/metrics; the controllers' http://<pod IP>:9611/metrics \
             ({kubectl} get pods -n {} -o wide)",
            chart::NAMESPACE
        )),
        Running::Bare => {}
    }
    say(&format!("  logs:       {}", cluster.dir().display()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agents_get_the_charts_defaults_unless_their_arguments_set_the_same_flag() {
        let cases: [(&[&str], &[&str]); 3] = [
            (&[], &["--cri-socket={cri-socket}"]),
            (&["--spare-ips=4"], &["--cri-socket={cri-socket}", "--spare-ips=4"]),
            (&["--cri-socket=/run/other.sock"], &["--cri-socket=/run/other.sock"]),
        ];
        for (given, expected) in cases {
            assert_eq!(with_chart_defaults(given), expected, "{given:?}");
        }
    }
}
