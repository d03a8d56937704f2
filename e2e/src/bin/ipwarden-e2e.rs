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
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Up { nodes, kubeconfig, demo, churn_seconds } => {
            up(nodes, kubeconfig, demo.then(|| Duration::from_secs(churn_seconds))).await
        }
    }
}

async fn up(nodes: usize, kubeconfig: PathBuf, churn: Option<Duration>) -> anyhow::Result<()> {
    let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let options = e2e::ClusterOptions { nodes, ..e2e::ClusterOptions::default() };
    let cluster = tokio::select! {
        cluster = e2e::Cluster::start(options) => cluster.context("starting the test cluster")?,
        _ = terminate.recv() => return Ok(()),
        _ = interrupt.recv() => return Ok(()),
    };
    if let Some(parent) = kubeconfig.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::copy(cluster.kubeconfig(), &kubeconfig)
        .with_context(|| format!("copying the kubeconfig to {}", kubeconfig.display()))?;
    println!("cluster ready: {} simulated nodes", cluster.nodes().len());
    println!("  kubeconfig: {}", kubeconfig.display());
    println!("  kubectl:    {} --kubeconfig {} get nodes", cluster.kubectl().display(), kubeconfig.display());
    println!("  run dir:    {}", cluster.dir().display());
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
    cluster.stop();
    Ok(())
}
