//! `ipwarden controller`: the cluster-wide garbage collector, as actix actors.
//!
//! - [`leader::Leader`] elects one writer with a Lease.
//! - [`tracer::PodTracer`] follows pod events and evaluates a pod's records at its deadline.
//! - [`sweeper::Sweeper`] walks every record on a timer, on leadership gain and on request.
//! - [`pool::PoolSupervisor`] runs one [`pool::PoolActor`] per IPPool, the only writer of
//!   that pool's records; on its timer the leader also keeps the pool finalizer
//!   ([`finalizer`]) and releases the block affinities of nodes that are gone ([`affinity`]).
//! - [`janitor::ClaimJanitor`] deletes claims whose workload is gone for good and writes
//!   down the binding of each claim it sees in effect.
//! - [`manual::ManualTrigger`] serves `ipwarden gc`.
//!
//! Decisions come from `crate::gc` (pure) over the one index [`watches::SharedIndex`] the
//! watches keep; these actors read it and write.

pub mod affinity;
pub mod events;
pub mod finalizer;
pub mod janitor;
pub mod kubevirt;
pub mod leader;
pub mod manual;
pub mod metrics;
pub mod pool;
pub mod pool_conditions;
pub mod sweeper;
pub mod tracer;
pub mod watches;
pub mod workloads;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use actix::{Actor, AsyncContext};
use anyhow::Context as _;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::watcher;
use kube::{Api, Client};
use prometheus_client::registry::Registry;

use crate::crd::{IPBlock, IPClaim, IPPool};
use crate::gc::index::{Kind, Watched};
use crate::gc::rules::{NotReadyPolicy, RuleSettings};
use crate::ipam::workload::DEFAULT_STICKY_KINDS;
use crate::own_writes::OwnWrites;

/// How long the controller waits for its watches' first lists at start.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);

/// What to do with records the rules would release while their node is NotReady.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum NotReadyMode {
    /// Keep them until the node returns or is deleted (a partitioned node may still run the
    /// sandbox, and its agent cannot answer the release handshake).
    Keep,
    /// Release them after `--not-ready-release-after-seconds`.
    Release,
}

/// The controller's flags; each has an environment fallback.
#[derive(clap::Args, Debug, Clone)]
pub struct ControllerArgs {
    /// Run the garbage collector (off: elect, cache and serve metrics, but never write).
    #[arg(long, env = "IPWARDEN_GC_ENABLED", default_value_t = true, action = clap::ArgAction::Set)]
    pub gc_enabled: bool,
    /// Seconds between full sweeps.
    #[arg(long, env = "IPWARDEN_GC_FULL_SCAN_INTERVAL_SECONDS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    pub full_scan_interval_seconds: u64,
    /// Seconds added to a terminating pod's deletionTimestamp before its IP is released.
    #[arg(long, env = "IPWARDEN_GC_ADDITIONAL_GRACE_SECONDS", default_value_t = 5)]
    pub additional_grace_seconds: u64,
    /// What to do with records the rules would release while their node is NotReady (and
    /// with a sticky takeover waiting on such a node).
    #[arg(long, env = "IPWARDEN_GC_NOT_READY_POLICY", value_enum, default_value_t = NotReadyMode::Keep)]
    pub not_ready_policy: NotReadyMode,
    /// With `--not-ready-policy release`: seconds a node must be NotReady first.
    #[arg(long, env = "IPWARDEN_GC_NOT_READY_RELEASE_AFTER_SECONDS", default_value_t = 300)]
    pub not_ready_release_after_seconds: u64,
    /// Milliseconds a pool actor collects changes before writing each block once.
    #[arg(long, env = "IPWARDEN_GC_BATCH_WINDOW_MS", default_value_t = 200)]
    pub batch_window_ms: u64,
    /// Owner kinds whose pods keep their IPs (comma-separated; empty: none).
    #[arg(long, env = "IPWARDEN_STICKY_OWNER_KINDS", value_delimiter = ',', default_values_t = DEFAULT_STICKY_KINDS.map(String::from))]
    pub sticky_owner_kinds: Vec<String>,
    /// Seconds between claim janitor passes.
    #[arg(long, env = "IPWARDEN_CLAIM_JANITOR_INTERVAL_SECONDS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub claim_janitor_interval_seconds: u64,
    /// Milliseconds between decisions of which claims to write down as witnessed
    /// (`status.witnessed`), made only when the controller's index changed since the last.
    #[arg(long, env = "IPWARDEN_CLAIM_WITNESS_INTERVAL_MS", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..))]
    pub claim_witness_interval_ms: u64,
    /// The namespace of the leader Lease and of the manual-trigger ConfigMap.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// The leader Lease's name.
    #[arg(long, env = "IPWARDEN_LEASE_NAME", default_value = "ipwarden-controller")]
    pub lease_name: String,
    /// The leader Lease's duration in seconds; a dead leader is replaced within it.
    #[arg(long, env = "IPWARDEN_LEASE_DURATION_SECONDS", default_value_t = 15, value_parser = clap::value_parser!(u64).range(2..))]
    pub lease_duration_seconds: u64,
    /// This replica's identity in the Lease (default: the pod name, else the host name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Where /metrics, /healthz and /readyz are served.
    #[arg(long, env = "IPWARDEN_CONTROLLER_METRICS_ADDRESS", default_value = "0.0.0.0:9611")]
    pub metrics_address: SocketAddr,
    /// Apply ipwarden's CRDs at start.
    #[arg(long, env = "IPWARDEN_INSTALL_CRDS")]
    pub install_crds: bool,
    /// Tests only (hidden): seconds added to this replica's wall clock wherever it reads it
    /// for the Lease, to play a node whose clock is off.
    #[arg(long, hide = true, default_value_t = 0, allow_hyphen_values = true)]
    pub test_clock_offset_seconds: i64,
    /// Tests only (hidden): while this file exists, every release about to be written (an
    /// answered mark's, or one no agent can answer), every migration target about to be
    /// detached and every takeover about to be answered waits before its live re-reads, so a
    /// test can change the pod, its owner or the mark between the decision and the write
    /// instead of racing the batch window
    /// ([`pool::PoolContext::test_release_hold`]).
    #[arg(long, hide = true)]
    pub test_release_hold: Option<std::path::PathBuf>,
}

/// Runs the controller until SIGINT or SIGTERM. Must run inside an actix System.
pub async fn run(args: ControllerArgs) -> anyhow::Result<()> {
    let client = Client::try_default().await.context("building the Kubernetes client (kubeconfig or in-cluster)")?;
    if args.install_crds {
        crate::crd::install(&client, STARTUP_TIMEOUT).await.context("installing the CRDs")?;
    }
    let identity = args
        .identity
        .clone()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| format!("ipwarden-controller-{}", std::process::id()));
    let mut registry = Registry::default();
    let metrics = metrics::ControllerMetrics::register(&mut registry);
    let ready = Arc::new(AtomicBool::new(false));
    let endpoint = crate::http::Endpoint { registry: Arc::new(registry), ready: ready.clone() };
    let address = crate::http::spawn(args.metrics_address, endpoint)
        .await
        .with_context(|| format!("binding the metrics address {}", args.metrics_address))?;
    tracing::info!(%address, %identity, "controller starting");

    let sticky_kinds: Vec<String> =
        args.sticky_owner_kinds.iter().map(|k| k.trim().to_string()).filter(|k| !k.is_empty()).collect();
    let index = watches::SharedIndex::new(&sticky_kinds, crate::agent::heartbeat::DEFAULT_LEASE_DURATION);
    let all = watcher::Config::default;
    let pod_events =
        watches::watch_into(index.clone(), Kind::Pod, Api::<Pod>::all(client.clone()), all(), |o| Watched::Pod(o));
    // What the pool actors' writes stored, until this watch shows them.
    let own_block_writes: Arc<OwnWrites<IPBlock>> = Arc::default();
    let seen_writes = own_block_writes.clone();
    let block_events =
        watches::watch_shared_into(index.clone(), Kind::Block, Api::<IPBlock>::all(client.clone()), |o| {
            Watched::Block(o)
        })
        .inspect(move |event| {
            if let Ok(event) = event {
                seen_writes.observe_event(event);
            }
        });
    let node_events =
        watches::watch_into(index.clone(), Kind::Node, Api::<Node>::all(client.clone()), all(), |o| Watched::Node(o));
    watches::drain(node_events, Kind::Node);
    let claim_events =
        watches::watch_into(index.clone(), Kind::Claim, Api::<IPClaim>::all(client.clone()), all(), |o| {
            Watched::Claim(o)
        });
    watches::drain(claim_events, Kind::Claim);
    let sts_api = Api::<StatefulSet>::all(client.clone());
    let sts_events = watches::watch_into(index.clone(), Kind::StatefulSet, sts_api, all(), |o| Watched::StatefulSet(o));
    watches::drain(sts_events, Kind::StatefulSet);
    workloads::watch(&client, &index);
    let pool_events =
        watches::watch_shared_into(index.clone(), Kind::Pool, Api::<IPPool>::all(client.clone()), |o| Watched::Pool(o));
    watches::drain(pool_events, Kind::Pool);
    let lease_config = all().labels(crate::agent::heartbeat::NODE_LABEL);
    let lease_api = Api::<Lease>::namespaced(client.clone(), &args.namespace);
    let lease_events =
        watches::watch_into(index.clone(), Kind::AgentLease, lease_api, lease_config, |o| Watched::AgentLease(o));
    watches::drain(lease_events, Kind::AgentLease);
    kubevirt::watch_when_served(client.clone(), index.clone());
    index.judge_agents_every_second();

    let leading = leader::Leadership::default();
    let settings = RuleSettings {
        additional_delay: Duration::from_secs(args.additional_grace_seconds),
        not_ready: match args.not_ready_policy {
            NotReadyMode::Keep => NotReadyPolicy::Keep,
            NotReadyMode::Release => {
                NotReadyPolicy::ReleaseAfter(Duration::from_secs(args.not_ready_release_after_seconds))
            }
        },
    };
    let events =
        events::EventWriter::new(client.clone(), "ipwarden-controller", &identity, metrics.event_failures.clone());
    let pool_context = pool::PoolContext {
        client: client.clone(),
        index: index.clone(),
        leading: leading.clone(),
        metrics: metrics.clone(),
        store: crate::block_store::BlockStore::new(
            kube::Api::all(client.clone()),
            format!("ipwarden-controller-{identity}"),
            Some(metrics.conflict_retries.clone()),
        ),
        own_writes: own_block_writes,
        batch_window: Duration::from_millis(args.batch_window_ms),
        events,
        test_release_hold: args.test_release_hold.clone(),
    };

    let mut subscribers = Vec::new();
    let mut gc_actors = None;
    // The claims keep sticky pods' IPs (decision 0022: only the controller writes them), so
    // the janitor runs with the GC off too; it then deletes no claim.
    let janitor = janitor::ClaimJanitor::new(
        client.clone(),
        index.clone(),
        leading.clone(),
        metrics.clone(),
        Duration::from_secs(args.claim_janitor_interval_seconds),
        Duration::from_millis(args.claim_witness_interval_ms),
        args.gc_enabled,
    )
    .start();
    if args.gc_enabled {
        let supervisor = pool::PoolSupervisor::new(pool_context).start();
        let sweeper = sweeper::Sweeper::new(
            index.clone(),
            supervisor.clone(),
            leading.clone(),
            settings,
            metrics.clone(),
            Duration::from_secs(args.full_scan_interval_seconds),
        );
        let tracer =
            tracer::PodTracer::new(index.clone(), supervisor.clone(), leading.clone(), settings, metrics.clone());
        let tracer = tracer::PodTracer::create(move |ctx| {
            ctx.add_stream(pod_events);
            tracer
        });
        gc_actors = Some((supervisor, tracer));
        subscribers.push(sweeper_recipient(sweeper, block_events, &client, &args, &leading));
    } else {
        watches::drain(pod_events, Kind::Pod);
        watches::drain(block_events, Kind::Block);
    }

    let kinds = [Kind::Pod, Kind::Node, Kind::Claim, Kind::StatefulSet, Kind::Block, Kind::Pool, Kind::AgentLease];
    tokio::time::timeout(STARTUP_TIMEOUT, index.wait_listed(&kinds))
        .await
        .context("the watches did not list the cluster in time (are the CRDs installed?)")?;
    ready.store(true, Ordering::SeqCst);
    tracing::info!("the cluster is listed; electing a leader");

    let lease_api = Api::namespaced(client.clone(), &args.namespace);
    let election = leader::Election {
        api: lease_api,
        name: args.lease_name.clone(),
        identity,
        duration: Duration::from_secs(args.lease_duration_seconds),
        clock_offset: jiff::SignedDuration::from_secs(args.test_clock_offset_seconds),
    };
    let _leader = leader::Leader::new(election, leading, subscribers, metrics).start();

    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    tracing::info!("stopping");
    drop((gc_actors, janitor));
    actix::System::current().stop();
    Ok(())
}

/// Starts the sweeper and the manual trigger; returns the sweeper's leadership recipient.
fn sweeper_recipient(
    sweeper: sweeper::Sweeper,
    block_events: impl futures::Stream<Item = Result<watcher::Event<Arc<IPBlock>>, watcher::Error>> + 'static,
    client: &Client,
    args: &ControllerArgs,
    leading: &leader::Leadership,
) -> actix::Recipient<leader::LeadershipChanged> {
    let sweeper = sweeper::Sweeper::create(move |ctx| {
        ctx.add_stream(block_events.filter_map(|event| async move {
            match event {
                Ok(watcher::Event::Apply(block) | watcher::Event::InitApply(block)) => Some(Ok(block)),
                Ok(_) => None,
                Err(e) => Some(Err(e)),
            }
        }));
        sweeper
    });
    let trigger_api = Api::namespaced(client.clone(), &args.namespace);
    manual::ManualTrigger::new(trigger_api, sweeper.clone(), leading.clone()).start();
    sweeper.recipient()
}
