//! `ipwarden-e2e up`: runs a test cluster for a human until SIGINT or SIGTERM, with its admin
//! kubeconfig copied to a fixed path, optionally with the churning demo workload.
//! `make cluster-up` / `make cluster-down` and `make demo` drive it.

use std::path::PathBuf;
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
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Up { nodes, kubeconfig, demo, churn_seconds, ipwarden } => {
            up(nodes, kubeconfig, demo.then(|| Duration::from_secs(churn_seconds)), ipwarden).await
        }
    }
}

/// How long an ipwarden process may take to report ready.
const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// ipwarden's processes on the demo cluster, stopped when dropped.
struct Ipwarden {
    processes: Vec<e2e::process::Component>,
    endpoints: Vec<(String, u16)>,
}

async fn start_ipwarden(cluster: &e2e::Cluster, binary: &std::path::Path) -> anyhow::Result<Ipwarden> {
    let mut started = Ipwarden { processes: Vec::new(), endpoints: Vec::new() };
    for node in 0..cluster.nodes().len() {
        let port = e2e::process::free_port()?;
        // The first agent installs the CRDs; the others find them.
        let extra: &[&str] = if node == 0 { &["--install-crds"] } else { &[] };
        let mut agent = e2e::ipwarden::start_agent(cluster, binary, node, port, extra)?;
        e2e::ipwarden::wait_ready(&mut agent, port, READY_TIMEOUT).await?;
        started.endpoints.push((format!("agent {}", cluster.nodes()[node].name()), port));
        started.processes.push(agent);
    }
    e2e::ipwarden::create_pool(
        &cluster.client(),
        "default",
        serde_json::json!({"cidr": "10.244.0.0/16", "default": true}),
    )
    .await?;
    for identity in ["controller-a", "controller-b"] {
        let port = e2e::process::free_port()?;
        let mut controller = e2e::ipwarden::start_controller(cluster, binary, identity, port, &[])?;
        e2e::ipwarden::wait_ready(&mut controller, port, READY_TIMEOUT).await?;
        started.endpoints.push((identity.to_string(), port));
        started.processes.push(controller);
    }
    Ok(started)
}

async fn up(
    nodes: usize,
    kubeconfig: PathBuf,
    churn: Option<Duration>,
    ipwarden: Option<PathBuf>,
) -> anyhow::Result<()> {
    let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let state_dir = kubeconfig.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    let network = match &ipwarden {
        Some(binary) => {
            let binary = std::fs::canonicalize(binary).with_context(|| format!("finding {}", binary.display()))?;
            Some(e2e::ipwarden::network(&binary, &state_dir.join("cni-bin"))?)
        }
        None => None,
    };
    let options = e2e::ClusterOptions { nodes, network, ..e2e::ClusterOptions::default() };
    let cluster = tokio::select! {
        cluster = e2e::Cluster::start(options) => cluster.context("starting the test cluster")?,
        _ = terminate.recv() => return Ok(()),
        _ = interrupt.recv() => return Ok(()),
    };
    std::fs::create_dir_all(state_dir).with_context(|| format!("creating {}", state_dir.display()))?;
    let running = match &ipwarden {
        Some(binary) => Some(
            start_ipwarden(&cluster, &std::fs::canonicalize(binary)?)
                .await
                .context("starting ipwarden's agents and controllers")?,
        ),
        None => None,
    };
    std::fs::copy(cluster.kubeconfig(), &kubeconfig)
        .with_context(|| format!("copying the kubeconfig to {}", kubeconfig.display()))?;
    println!("cluster ready: {} simulated nodes", cluster.nodes().len());
    println!("  kubeconfig: {}", kubeconfig.display());
    println!("  kubectl:    {} --kubeconfig {} get nodes", cluster.kubectl().display(), kubeconfig.display());
    println!("  run dir:    {}", cluster.dir().display());
    if let (Some(running), Some(binary)) = (&running, &ipwarden) {
        for (name, port) in &running.endpoints {
            println!("  metrics:    http://127.0.0.1:{port}/metrics ({name})");
        }
        println!("  status:     KUBECONFIG={} {} status", kubeconfig.display(), binary.display());
        println!("  check:      KUBECONFIG={} {} check", kubeconfig.display(), binary.display());
        println!("  GC preview: KUBECONFIG={} {} gc --dry-run", kubeconfig.display(), binary.display());
        println!("  pools:      kubectl ... get ippools,ipblocks; kubectl ... get ipclaims -A");
    }
    let churning = match churn {
        Some(interval) => {
            e2e::demo::create(&cluster.client()).await.context("creating the demo workload")?;
            println!(
                "  demo:       StatefulSet default/web and Deployment default/api, a pod deleted every {interval:?}"
            );
            tokio::spawn(e2e::demo::churn(cluster.client(), interval))
        }
        None => tokio::spawn(std::future::pending()),
    };
    println!("press Ctrl-C to stop");
    tokio::select! {
        _ = terminate.recv() => {}
        _ = interrupt.recv() => {}
    }
    churning.abort();
    println!("stopping the cluster");
    let _removed = std::fs::remove_file(&kubeconfig);
    drop(running);
    cluster.stop();
    Ok(())
}
