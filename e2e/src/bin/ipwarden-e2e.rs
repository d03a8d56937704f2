//! `ipwarden-e2e up`: runs a test cluster for a human until SIGINT or SIGTERM, with its admin
//! kubeconfig copied to a fixed path, optionally with the churning demo workload.
//! `make cluster-up` / `make cluster-down` and `make demo` drive it.
//!
//! `ipwarden-e2e churn`: the churn benchmark (`make churn-bench`, docs/benchmarks.md), of
//! ipwarden or of a peer IPAM (`--ipam`, `make peer-bench`); with `--burst`, the allocation
//! speed benchmark instead (pods created at once on each node).
//!
//! `ipwarden-e2e scale`: the scale benchmark (`make scale-bench`, docs/benchmarks.md).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tokio::signal::unix::{SignalKind, signal};

/// The e2e harness's command line.
#[derive(Parser)]
#[command(name = "ipwarden-e2e", about = "Local Kubernetes control plane with simulated nodes for ipwarden")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a cluster and keep it running until SIGINT or SIGTERM.
    Up {
        /// How many simulated nodes to register.
        #[arg(long, default_value_t = 3, env = "IPWARDEN_E2E_NODES")]
        nodes: usize,
        /// Where to copy the admin kubeconfig once the nodes are Ready.
        #[arg(long, default_value = ".e2e/kubeconfig")]
        kubeconfig: PathBuf,
        /// Also run the demo workload: a StatefulSet and a Deployment with pods deleted one at
        /// a time.
        #[arg(long)]
        demo: bool,
        /// With --demo: seconds between two pod deletions.
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
        churn_seconds: u64,
        /// Run ipwarden from this binary: its CNI plugin on every node, an agent per node, two
        /// controller replicas and a default pool. Without it, nodes use Debian's host-local.
        #[arg(long)]
        ipwarden: Option<PathBuf>,
        /// With --ipwarden: a flag added to every agent's command line, e.g.
        /// `--agent-arg=--release-sandbox-grace-seconds=5`; repeat for more.
        #[arg(long = "agent-arg", value_name = "FLAG", allow_hyphen_values = true, requires = "ipwarden")]
        agent_args: Vec<String>,
        /// With --ipwarden: a flag added to every controller replica's command line, e.g.
        /// `--controller-arg=--full-scan-interval-seconds=5`; repeat for more.
        #[arg(long = "controller-arg", value_name = "FLAG", allow_hyphen_values = true, requires = "ipwarden")]
        controller_args: Vec<String>,
        /// When each simulated node's runtime calls CNI GC: `never` (containerd, the default),
        /// `startup` (once at the runtime's start, as CRI-O) or every this many seconds (no
        /// runtime does).
        #[arg(long, default_value = "never", value_parser = clap::value_parser!(e2e::cni::RuntimeGc))]
        runtime_gc: e2e::cni::RuntimeGc,
        /// With --ipwarden: this many real nodes besides the simulated ones, a real kubelet and
        /// containerd each with the chart's CNI chain (needs root; docs/testing.md, "Real
        /// nodes"). Their pods need the toleration `e2e.ipwarden.io/real` and the image
        /// `localhost/ipwarden-e2e/busybox:1` with `imagePullPolicy: Never`.
        #[arg(long, default_value_t = 0, requires = "ipwarden")]
        real_nodes: usize,
        /// The container runtime of the real nodes: `containerd` or `crio` (CRI-O, built by
        /// e2e/cluster/build-crio.sh; conmon from Debian).
        #[arg(long, default_value = "containerd", value_enum, requires = "real_nodes")]
        runtime: e2e::realnode::Runtime,
        /// With --ipwarden: how it runs. `processes`: an agent per node and two controller
        /// replicas on this host. `chart`: as users install it, `helm install` of the chart
        /// with its pods from ipwarden's image under the real nodes' kubelets; needs `--nodes 0
        /// --real-nodes N` (docs/testing.md, "The chart on real nodes").
        #[arg(long, default_value = "processes", value_parser = clap::value_parser!(e2e::up::Install), requires = "ipwarden")]
        install: e2e::up::Install,
    },
    /// Measure an IPAM under pod churn: start a cluster running it (ipwarden as `up
    /// --ipwarden` does), create bare pods at a set rate round robin over the nodes, delete
    /// each after its lifetime, wait until every IP of a deleted pod is released, report and
    /// stop. Exits non-zero when an IP was seen on two live pods or the cluster did not settle.
    Churn {
        /// The IPAMs to measure, comma-separated, one after the other with the same workload:
        /// ipwarden, or a peer built from its Go module (whereabouts). With more than one, a
        /// comparison with ratios to the first follows the reports.
        #[arg(long, default_value = "ipwarden", value_delimiter = ',')]
        ipam: Vec<e2e::peers::Ipam>,
        /// The ipwarden binary to measure (needed with --ipam ipwarden).
        #[arg(long)]
        ipwarden: Option<PathBuf>,
        /// With --ipwarden: a flag added to every agent's command line in the churn's (or the
        /// bursts') cluster, e.g. `--agent-arg=--spare-ips=64`; repeat for more. The storm's
        /// cluster keeps its own flags.
        #[arg(long = "agent-arg", value_name = "FLAG", allow_hyphen_values = true, requires = "ipwarden")]
        agent_args: Vec<String>,
        /// How many simulated nodes to register.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
        nodes: u64,
        /// Pods created per second, across all nodes.
        #[arg(long, default_value_t = 2.0)]
        rate: f64,
        /// How long to create pods for.
        #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
        duration_seconds: u64,
        /// How long each pod lives before it is deleted.
        #[arg(long, default_value_t = 10)]
        lifetime_seconds: u64,
        /// Percent of pods whose CNI DEL the simulated runtime loses: leaks for the GC.
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=100))]
        leak_percent: u32,
        /// Percent of pods deleted with grace period 0.
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=100))]
        force_percent: u32,
        /// How long to wait after the last deletion for every IP to be released.
        #[arg(long, default_value_t = 300)]
        settle_timeout_seconds: u64,
        /// Handovers of the StatefulSet scale storm run after each IPAM's churn, on a cluster
        /// of its own whose pool has 5 IPs (two StatefulSets of 5 take turns); 0: no storm.
        #[arg(long, default_value_t = 10)]
        storm_cycles: u32,
        /// Instead of the steady rate: create this many pods at once on each node, wait until
        /// all run with their IPs, delete them all at once, wait (--settle-timeout-seconds) until
        /// every record of theirs is released, and report the allocation speed. No leaks, no
        /// force deletes, no storm.
        #[arg(
            long,
            value_parser = clap::value_parser!(u64).range(1..=10_000),
            conflicts_with_all = ["rate", "duration_seconds", "lifetime_seconds", "leak_percent", "force_percent", "storm_cycles"],
        )]
        burst: Option<u64>,
        /// With --burst: how many bursts, one after the other on the same cluster.
        #[arg(long, default_value_t = 1, requires = "burst", value_parser = clap::value_parser!(u32).range(1..))]
        bursts: u32,
        /// With --burst: how long the pods of one burst may take to all run with their IPs.
        #[arg(long, default_value_t = 120, requires = "burst")]
        burst_timeout_seconds: u64,
        /// With --burst (ipwarden only): release marks staged on the first node right before each
        /// burst, records of gone pods whose sandboxes its runtime lost, which the node answers
        /// while the burst's ADDs come in (docs/benchmarks.md, "ADDs while a node answers release marks").
        #[arg(long, default_value_t = 0, requires = "burst", value_parser = clap::value_parser!(u64).range(0..=e2e::burst::MAX_MARKS as u64))]
        marks_per_burst: u64,
        /// `table` for people, `json` for scripts.
        #[arg(long, value_enum, default_value_t = Output::Table)]
        output: Output,
        /// When each simulated node's runtime calls CNI GC: `never` (containerd, the default),
        /// `startup` (once at the runtime's start, as CRI-O) or every this many seconds (no
        /// runtime does).
        #[arg(long, default_value = "never", value_parser = clap::value_parser!(e2e::cni::RuntimeGc))]
        runtime_gc: e2e::cni::RuntimeGc,
    },
    /// The node benchmark on real nodes (kubelet, containerd, runc; root): the four phases
    /// peers publish (create, re-create, recover, delete) of Deployments of pods, for each run
    /// in turn on a cluster of its own (docs/benchmarks.md, "Real nodes"). Exits non-zero
    /// when a phase did not complete or an ipwarden run left records, pod IPs and network
    /// namespaces in disagreement.
    NodeBench {
        /// The ipwarden binary to measure, installed with the chart from a test image of it
        /// (docs/testing.md, "The chart on real nodes").
        #[arg(long)]
        ipwarden: PathBuf,
        /// Real nodes.
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=200))]
        nodes: u64,
        /// Deployments.
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
        deployments: u64,
        /// Pods per Deployment.
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
        replicas: u64,
        /// The runs, in order (comma-separated).
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            default_value = "host-local,ipwarden-ample,ipwarden-exact,whereabouts-ample,whereabouts-exact"
        )]
        runs: Vec<e2e::nodebench::BenchIpam>,
        /// How long a phase may take before its run is given up.
        #[arg(long, default_value_t = 900)]
        phase_timeout_seconds: u64,
        /// How long the records, pod IPs and network namespaces may take to agree after a phase.
        #[arg(long, default_value_t = 90)]
        settle_timeout_seconds: u64,
        /// `table` for people, `json` for scripts.
        #[arg(long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Measure the controller at cluster scale: Node objects without kubelets, pods, records
    /// and claims written in bulk as kubelets and agents would, a controller pair; report its
    /// start-up, first sweep, requests in a quiet window and the reclaim of injected leaks.
    /// Exits non-zero when a leak was not reclaimed in time.
    Scale {
        /// The ipwarden binary to measure.
        #[arg(long)]
        ipwarden: PathBuf,
        /// Node objects to register.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
        nodes: u64,
        /// Pods, one IP and one record each.
        #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
        pods: u64,
        /// IPPools the pods are spread over.
        #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=4096))]
        pools: u64,
        /// Percent of the pods that belong to StatefulSets of 10.
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=100))]
        sticky_percent: u32,
        /// Bare pods deleted without their records (leaks for the controller).
        #[arg(long, default_value_t = 1000)]
        leaks: u64,
        /// Seconds of the quiet window in which the controllers' requests are counted.
        #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
        quiet_seconds: u64,
        /// API calls in flight at once while filling the cluster and deleting the leaks.
        #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1024))]
        concurrency: u64,
        /// How long the leaks may take to be reclaimed.
        #[arg(long, default_value_t = 300)]
        leak_timeout_seconds: u64,
        /// The simulated agents ask their runtime over CRI (`ipwarden agent --cri-socket`):
        /// each releases its node's leaked records itself at its next question (every 5 s).
        #[arg(long)]
        agents_ask_runtime: bool,
        /// The controllers' `--additional-grace-seconds` (0: the watch-event lag measured
        /// alone; 5 is the controller's own default).
        #[arg(long, default_value_t = 0)]
        additional_grace_seconds: u64,
        /// Where to write the report as JSON too.
        #[arg(long, default_value = ".e2e/scale-report.json")]
        report: PathBuf,
        /// `table` for people, `json` for scripts.
        #[arg(long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
}

/// How `churn`, `scale` and `node-bench` print their report.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Output {
    /// Aligned text for people.
    Table,
    /// The report as one JSON object.
    Json,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // `up` speaks for itself on stdout; its log shows only what went wrong unless RUST_LOG
    // asks for more. The benchmarks log their progress.
    let default_filter = if matches!(cli.command, Command::Up { .. }) { "warn" } else { "info" };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Up {
            nodes,
            kubeconfig,
            demo,
            churn_seconds,
            ipwarden,
            agent_args,
            controller_args,
            runtime_gc,
            real_nodes,
            runtime,
            install,
        } => {
            let demo = demo.then(|| Duration::from_secs(churn_seconds));
            up(e2e::up::UpOptions {
                nodes,
                kubeconfig,
                ipwarden,
                agent_args,
                controller_args,
                demo,
                runtime_gc,
                real_nodes,
                runtime,
                install,
            })
            .await
        }
        Command::Churn {
            ipam,
            ipwarden,
            agent_args,
            nodes,
            rate,
            duration_seconds,
            lifetime_seconds,
            leak_percent,
            force_percent,
            settle_timeout_seconds,
            storm_cycles,
            burst,
            bursts,
            burst_timeout_seconds,
            marks_per_burst,
            output,
            runtime_gc,
        } => {
            let nodes = usize::try_from(nodes)?;
            if let Some(per_node) = burst {
                let options = e2e::burst::BurstOptions {
                    per_node: usize::try_from(per_node)?,
                    bursts,
                    running_timeout: Duration::from_secs(burst_timeout_seconds),
                    release_timeout: Duration::from_secs(settle_timeout_seconds),
                    marks: usize::try_from(marks_per_burst)?,
                };
                anyhow::ensure!(
                    options.marks == 0 || ipam.iter().all(|i| *i == e2e::peers::Ipam::Ipwarden),
                    "--marks-per-burst stages ipwarden's release marks: measure --ipam ipwarden alone"
                );
                return burst_each(nodes, &ipam, ipwarden.as_deref(), &agent_args, runtime_gc, &options, output).await;
            }
            anyhow::ensure!(
                rate > 0.0 && rate <= 1000.0,
                "--rate must be more than 0 and at most 1000 pods per second"
            );
            anyhow::ensure!(leak_percent + force_percent <= 100, "--leak-percent plus --force-percent exceed 100");
            let options = e2e::churn::ChurnOptions {
                rate,
                duration: Duration::from_secs(duration_seconds),
                lifetime: Duration::from_secs(lifetime_seconds),
                leak_percent,
                force_percent,
                settle_timeout: Duration::from_secs(settle_timeout_seconds),
            };
            let storm = e2e::storm::StormOptions { cycles: storm_cycles, handover_timeout: STORM_HANDOVER_TIMEOUT };
            let mut reports = Vec::new();
            for ipam in ipam {
                reports.push(churn(nodes, ipam, ipwarden.as_deref(), &agent_args, runtime_gc, &options, &storm).await?);
            }
            for report in &reports {
                match output {
                    Output::Table => println!("{report}"),
                    Output::Json => println!("{}", serde_json::to_string_pretty(report)?),
                }
            }
            if reports.len() > 1 && matches!(output, Output::Table) {
                print!("{}", e2e::churn::compare(&reports));
            }
            for report in &reports {
                anyhow::ensure!(
                    report.conflicts.ip_conflicts == 0 || report.ipam != "ipwarden",
                    "churn: {} IPs were held by two live pods at once",
                    report.conflicts.ip_conflicts
                );
                anyhow::ensure!(
                    report.settled,
                    "churn of {}: the cluster did not settle: {}",
                    report.ipam,
                    report.unsettled
                );
            }
            Ok(())
        }
        Command::NodeBench {
            ipwarden,
            nodes,
            deployments,
            replicas,
            runs,
            phase_timeout_seconds,
            settle_timeout_seconds,
            output,
        } => {
            let options = e2e::nodebench::NodeBenchOptions {
                nodes: usize::try_from(nodes)?,
                deployments: usize::try_from(deployments)?,
                replicas: usize::try_from(replicas)?,
                runs,
                ipwarden: std::fs::canonicalize(&ipwarden)
                    .with_context(|| format!("finding the ipwarden binary {}", ipwarden.display()))?,
                phase_timeout: Duration::from_secs(phase_timeout_seconds),
                settle_timeout: Duration::from_secs(settle_timeout_seconds),
            };
            let measured = async { e2e::nodebench::run(&options).await.context("running the node benchmark") };
            let report = stoppable("node-bench", measured).await?;
            match output {
                Output::Table => println!("{report}"),
                Output::Json => println!("{}", serde_json::to_string_pretty(&report)?),
            }
            anyhow::ensure!(report.all_completed(), "node-bench: a phase did not complete (see the report)");
            anyhow::ensure!(
                report.ipwarden_consistent(),
                "node-bench: an ipwarden run left records, pod IPs and network namespaces in disagreement"
            );
            Ok(())
        }
        Command::Scale {
            ipwarden,
            nodes,
            pods,
            pools,
            sticky_percent,
            leaks,
            quiet_seconds,
            concurrency,
            leak_timeout_seconds,
            agents_ask_runtime,
            additional_grace_seconds,
            report,
            output,
        } => {
            let options = e2e::scale::ScaleOptions {
                nodes: usize::try_from(nodes)?,
                pods: usize::try_from(pods)?,
                pools: usize::try_from(pools)?,
                sticky_percent,
                leaks: usize::try_from(leaks)?,
                quiet: Duration::from_secs(quiet_seconds),
                concurrency: usize::try_from(concurrency)?,
                leak_timeout: Duration::from_secs(leak_timeout_seconds),
                agents_ask_runtime,
                additional_grace: Duration::from_secs(additional_grace_seconds),
            };
            scale(&ipwarden, &options, &report, output).await
        }
    }
}

/// Runs `up` until SIGINT or SIGTERM, printing what it says.
async fn up(options: e2e::up::UpOptions) -> anyhow::Result<()> {
    let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let say: e2e::up::Say = std::sync::Arc::new(|line: &str| println!("{line}"));
    let running = tokio::select! {
        started = e2e::up::start(&options, say) => started?,
        _ = terminate.recv() => return Ok(()),
        _ = interrupt.recv() => return Ok(()),
    };
    println!("press Ctrl-C to stop");
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    println!("stopping the cluster");
    running.stop();
    Ok(())
}

/// Where `churn` links the plugin under test (its own, so a `make demo` running beside it keeps
/// its binary).
const CHURN_PLUGIN_DIR: &str = ".e2e/churn-cni-bin";

/// How long one handover of the storm may take before the storm is given up.
const STORM_HANDOVER_TIMEOUT: Duration = Duration::from_secs(300);

/// The pool a benchmark cluster's IPAM hands out.
#[derive(Clone, Copy)]
enum Pool {
    /// The churn's: 10.244.0.0/16.
    Churn,
    /// The storm's: 5 IPs.
    Storm,
}

/// A cluster of `nodes` nodes running `ipam` (ipwarden from `ipwarden`) with `pool`.
async fn start_ipam(
    nodes: usize,
    ipam: e2e::peers::Ipam,
    ipwarden: Option<&Path>,
    agent_args: &[String],
    runtime_gc: e2e::cni::RuntimeGc,
    pool: Pool,
) -> anyhow::Result<(e2e::Cluster, e2e::peers::Installed)> {
    use e2e::peers::{Installed, Ipam, whereabouts};
    use e2e::storm::{CIDR, FIRST_IP, LAST_IP};
    match ipam {
        Ipam::Ipwarden => {
            let binary = ipwarden.context("--ipam ipwarden needs --ipwarden <binary>")?;
            if let Pool::Churn = pool {
                let agent_args: Vec<&str> = agent_args.iter().map(String::as_str).collect();
                let plugin_dir = Path::new(CHURN_PLUGIN_DIR);
                let (cluster, installation) = e2e::up::start_cluster(
                    e2e::up::NodeCounts { simulated: nodes, real: 0, runtime: e2e::realnode::Runtime::Containerd },
                    Some(binary),
                    plugin_dir,
                    &agent_args,
                    &[],
                    runtime_gc,
                    &|line| tracing::info!("{line}"),
                )
                .await?;
                return Ok((cluster, Installed::Ipwarden(installation.context("ipwarden was not started")?)));
            }
            let binary = std::fs::canonicalize(binary).with_context(|| format!("finding {}", binary.display()))?;
            let network =
                e2e::CniNetwork { runtime_gc, ..e2e::ipwarden::network(&binary, Path::new(CHURN_PLUGIN_DIR))? };
            let (cluster, installation) = e2e::storm::start_ipwarden(nodes, &binary, network)
                .await
                .context("starting the storm's cluster with ipwarden")?;
            Ok((cluster, Installed::Ipwarden(installation)))
        }
        Ipam::Whereabouts | Ipam::WhereaboutsNodeSlices => {
            let setup = match (ipam, pool) {
                (Ipam::WhereaboutsNodeSlices, Pool::Churn) => whereabouts::Setup::node_slices(),
                (_, Pool::Churn) => whereabouts::Setup::whole_range(),
                (_, Pool::Storm) => whereabouts::Setup::bounded(CIDR, FIRST_IP, LAST_IP),
            };
            let build = whereabouts::build().context("building Whereabouts")?;
            let kubeconfig = whereabouts::KubeconfigSlot::default();
            let network =
                Some(e2e::CniNetwork { runtime_gc, ..whereabouts::network(&build, kubeconfig.clone(), &setup) });
            let options = e2e::ClusterOptions { nodes, network, ..e2e::ClusterOptions::default() };
            let cluster = e2e::Cluster::start(options).await.context("starting the test cluster")?;
            kubeconfig.get_or_init(|| cluster.kubeconfig().to_path_buf());
            let installation =
                whereabouts::install(&cluster, &build, &setup).await.context("installing Whereabouts")?;
            Ok((cluster, Installed::Whereabouts(installation)))
        }
    }
}

/// Why the storm is not run for `ipam`, if it is not.
fn storm_skipped(ipam: e2e::peers::Ipam, storm: &e2e::storm::StormOptions) -> Option<String> {
    if storm.cycles == 0 {
        return Some("--storm-cycles 0".into());
    }
    (ipam == e2e::peers::Ipam::WhereaboutsNodeSlices).then(|| {
        "node slices give each node a CIDR of its own; 5 IPs cannot be sliced among the nodes \
         (the storm of plain Whereabouts is the same plugin on one shared range)"
            .to_string()
    })
}

/// One churn run of `ipam` on a cluster of its own, then the storm on another, each stopped
/// afterwards.
async fn churn(
    nodes: usize,
    ipam: e2e::peers::Ipam,
    ipwarden: Option<&Path>,
    agent_args: &[String],
    runtime_gc: e2e::cni::RuntimeGc,
    options: &e2e::churn::ChurnOptions,
    storm: &e2e::storm::StormOptions,
) -> anyhow::Result<e2e::churn::Report> {
    let measured = async {
        let (cluster, installation) = start_ipam(nodes, ipam, ipwarden, agent_args, runtime_gc, Pool::Churn).await?;
        eprintln!(
            "churn: {ipam} on a cluster ready ({} nodes, run dir {}); creating {} pods/s for {:?}",
            nodes,
            cluster.dir().display(),
            options.rate,
            options.duration
        );
        let mut report = e2e::churn::run(&cluster, &installation, options).await.context("running the churn")?;
        drop(installation);
        cluster.stop();
        if let Some(reason) = storm_skipped(ipam, storm) {
            report.storm_skipped = reason;
            return anyhow::Ok(report);
        }
        let (cluster, installation) = start_ipam(nodes, ipam, ipwarden, &[], runtime_gc, Pool::Storm).await?;
        eprintln!(
            "storm: {ipam} on a cluster ready (run dir {}); {} handovers of 5 IPs",
            cluster.dir().display(),
            storm.cycles
        );
        report.storm = Some(e2e::storm::run(&cluster, storm).await.context("running the storm")?);
        drop(installation);
        cluster.stop();
        anyhow::Ok(report)
    };
    stoppable("churn", measured).await
}

/// Runs `work` unless SIGTERM or SIGINT comes first, which stops `what` with an error.
async fn stoppable<T>(what: &str, work: impl Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    tokio::select! {
        result = work => result,
        _ = terminate.recv() => anyhow::bail!("{what}: stopped by SIGTERM"),
        _ = interrupt.recv() => anyhow::bail!("{what}: stopped by SIGINT"),
    }
}

/// The burst benchmark of each of `ipams` in turn, each on a cluster of its own that is
/// stopped afterwards; prints the reports, and fails when ipwarden put an IP on two live pods
/// or a burst's pods did not all run and get released within the bounds.
async fn burst_each(
    nodes: usize,
    ipams: &[e2e::peers::Ipam],
    ipwarden: Option<&Path>,
    agent_args: &[String],
    runtime_gc: e2e::cni::RuntimeGc,
    options: &e2e::burst::BurstOptions,
    output: Output,
) -> anyhow::Result<()> {
    let mut reports = Vec::new();
    for &ipam in ipams {
        let measured = async {
            let (cluster, installation) =
                start_ipam(nodes, ipam, ipwarden, agent_args, runtime_gc, Pool::Churn).await?;
            eprintln!(
                "burst: {ipam} on a cluster ready ({nodes} nodes, run dir {}); {} bursts of {} pods on each node",
                cluster.dir().display(),
                options.bursts,
                options.per_node
            );
            let report = e2e::burst::run(&cluster, &installation, options).await.context("running the bursts")?;
            drop(installation);
            cluster.stop();
            anyhow::Ok(report)
        };
        reports.push(stoppable("burst", measured).await?);
    }
    for report in &reports {
        match output {
            Output::Table => println!("{report}"),
            Output::Json => println!("{}", serde_json::to_string_pretty(report)?),
        }
    }
    for report in &reports {
        anyhow::ensure!(
            report.ip_conflicts == 0 || report.ipam != "ipwarden",
            "burst: {} IPs were held by two live pods at once",
            report.ip_conflicts
        );
        anyhow::ensure!(report.completed, "burst of {}: {}", report.ipam, report.failure);
    }
    Ok(())
}

async fn scale(ipwarden: &Path, options: &e2e::scale::ScaleOptions, file: &Path, output: Output) -> anyhow::Result<()> {
    e2e::scale::plan(options)?;
    let binary = std::fs::canonicalize(ipwarden).with_context(|| format!("finding {}", ipwarden.display()))?;
    let measured = async {
        let mut cluster =
            e2e::Cluster::start(e2e::scale::cluster_options()).await.context("starting the test cluster")?;
        eprintln!(
            "scale: control plane ready (run dir {}); filling it with {} nodes, {} pods in {} pools",
            cluster.dir().display(),
            options.nodes,
            options.pods,
            options.pools
        );
        let report = e2e::scale::run(&mut cluster, &binary, options).await.context("running the scale benchmark")?;
        cluster.stop();
        anyhow::Ok(report)
    };
    let report = stoppable("scale", measured).await?;
    let json = serde_json::to_string_pretty(&report)?;
    if let Some(dir) = file.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(file, &json).with_context(|| format!("writing {}", file.display()))?;
    match output {
        Output::Table => print!("{report}"),
        Output::Json => println!("{json}"),
    }
    anyhow::ensure!(
        report.leaks.unreclaimed.is_empty(),
        "scale: leaks not reclaimed in time: {}",
        report.leaks.unreclaimed
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn up_takes_repeated_agent_and_controller_flags_in_either_spelling() {
        let cli = Cli::try_parse_from([
            "ipwarden-e2e",
            "up",
            "--ipwarden=target/debug/ipwarden",
            "--controller-arg=--full-scan-interval-seconds=5",
            "--controller-arg",
            "--additional-grace-seconds=2",
            "--agent-arg",
            "--release-sandbox-grace-seconds=5",
        ])
        .expect("the command line parses");
        let Command::Up { agent_args, controller_args, .. } = cli.command else { panic!("not up") };
        assert_eq!(controller_args, ["--full-scan-interval-seconds=5", "--additional-grace-seconds=2"]);
        assert_eq!(agent_args, ["--release-sandbox-grace-seconds=5"]);
    }

    #[test]
    fn up_refuses_process_flags_for_a_bare_cluster() {
        let parsed = Cli::try_parse_from(["ipwarden-e2e", "up", "--agent-arg=--reuse-cooldown-seconds=1"]);
        assert!(parsed.is_err(), "--agent-arg without --ipwarden was accepted");
    }
}
