//! `ipwarden agent`: the node agent. It serves the CNI plugin on a unix socket, allocates
//! with compare-and-swap on IPBlocks, keeps IPClaims and a node-local checkpoint, and
//! exposes metrics. See docs/agent.md for every flag.

mod add;
pub mod allocator;
mod batch;
mod block_writes;
pub mod checkpoint;
pub mod checkpoint_store;
mod cni_verbs;
pub mod core;
pub mod error;
pub mod heartbeat;
pub mod lock;
pub mod metrics;
mod release_marks;
mod runtime_sandboxes;
pub mod serial;
pub mod server;
pub mod spares;
mod startup;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use actix::Actor;
use anyhow::Context;
use futures::StreamExt;
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Api, Client, ResourceExt};
use prometheus_client::registry::Registry;
use tokio::sync::Notify;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};

use crate::crd::{IPBlock, IPPool};
use crate::ipam::workload::DEFAULT_STICKY_KINDS;
use crate::own_writes::OwnWrites;
use checkpoint::{Checkpoint, Restored};

/// Only host-local reservations at least this old are collected at start: an ADD in flight
/// has reserved its IP before its pod's status shows it.
const HOST_LOCAL_MIN_AGE: Duration = Duration::from_secs(300);

/// How often the agent looks for release marks it has not answered yet, besides reacting to
/// block changes at once (a sandbox's grace runs out without a block change).
const MARK_RESCAN_INTERVAL: Duration = Duration::from_secs(5);

/// How long the agent waits for its caches and CRDs at start.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);

/// How often an agent waiting for its Node looks at its node cache again.
const NODE_WAIT_POLL: Duration = Duration::from_secs(1);

/// How often an agent still waiting for its Node says so again.
const NODE_WAIT_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Waits until the node cache holds Node `name`, saying what the agent waits for: an agent
/// started before its kubelet registered the Node (a joining node, an agent started ahead of its
/// kubelet) cannot own its agent Lease yet, and exiting would only crash-loop its pod until the
/// Node comes (issue 24). It serves CNI calls once the Node exists.
async fn wait_for_node(nodes: &reflector::Store<Node>, name: &str) {
    let key = reflector::ObjectRef::new(name);
    if nodes.get(&key).is_some() {
        return;
    }
    let started = tokio::time::Instant::now();
    let mut said: Option<tokio::time::Instant> = None;
    while nodes.get(&key).is_none() {
        if said.is_none_or(|at| at.elapsed() >= NODE_WAIT_LOG_INTERVAL) {
            tracing::info!(
                node = %name,
                waited_seconds = started.elapsed().as_secs(),
                "waiting for its Node to be registered by the node's kubelet: the agent Lease is owned by the Node, and CNI calls are served once it exists"
            );
            said = Some(tokio::time::Instant::now());
        }
        tokio::time::sleep(NODE_WAIT_POLL).await;
    }
    tracing::info!(node = %name, waited_seconds = started.elapsed().as_secs(), "its Node is registered");
}

/// The agent's flags; each has an environment fallback.
#[derive(clap::Args, Debug, Clone)]
pub struct AgentArgs {
    /// The Node this agent serves (in a DaemonSet: from the downward API).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// The unix socket the CNI plugin connects to (created with mode 0600).
    #[arg(long, env = "IPWARDEN_AGENT_SOCKET", default_value = "/run/ipwarden/agent.sock")]
    pub socket: PathBuf,
    /// The node-local checkpoint file.
    #[arg(long, env = "IPWARDEN_CHECKPOINT", default_value = "/var/lib/ipwarden/checkpoint.json")]
    pub checkpoint: PathBuf,
    /// Seconds a released IP waits before it is handed out again (0 disables the cooldown).
    #[arg(long, env = "IPWARDEN_REUSE_COOLDOWN_SECONDS", default_value_t = 30)]
    pub reuse_cooldown_seconds: u64,
    /// Owner kinds whose pods keep their IPs across restarts (comma-separated; empty: none).
    #[arg(long, env = "IPWARDEN_STICKY_OWNER_KINDS", value_delimiter = ',', default_values_t = DEFAULT_STICKY_KINDS.map(String::from))]
    pub sticky_owner_kinds: Vec<String>,
    /// Where /metrics, /healthz and /readyz are served (IPv4:port or [IPv6]:port; an IPv4
    /// address may go in brackets too, as the chart's `[$(HOST_IP)]:<port>` gives it).
    #[arg(long, env = "IPWARDEN_AGENT_METRICS_ADDRESS", default_value = "0.0.0.0:9612",
          value_parser = crate::http::parse_listen_address)]
    pub metrics_address: SocketAddr,
    /// At start, also collect the host-local plugin's reservations under this data directory
    /// that no live pod of the node holds (with --host-local-network).
    #[arg(long, env = "IPWARDEN_HOST_LOCAL_DATA_DIR", requires = "host_local_network")]
    pub host_local_data_dir: Option<PathBuf>,
    /// The host-local network name to collect at start.
    #[arg(long, env = "IPWARDEN_HOST_LOCAL_NETWORK", requires = "host_local_data_dir")]
    pub host_local_network: Option<String>,
    /// Seconds a sandbox still attached on this node (ADDed, no DEL yet) keeps a record the
    /// controller marked for release; after that its DEL counts as lost and the agent
    /// answers ready-for-release.
    #[arg(long, env = "IPWARDEN_RELEASE_SANDBOX_GRACE_SECONDS", default_value_t = 60)]
    pub release_sandbox_grace_seconds: u64,
    /// At start, before serving CNI, record the IPs that this node's running pods got from
    /// another IPAM inside ipwarden's pools, as `ipwarden adopt` does for the whole cluster.
    #[arg(long, env = "IPWARDEN_ADOPT_ON_START")]
    pub adopt_on_start: bool,
    /// The CNI network name (the netconf's `name`) that `--adopt-on-start`'s records carry:
    /// the agent knows a network's name only from CNI calls (and its checkpoint of them),
    /// which a node moving from another IPAM has not made yet.
    #[arg(long, env = "IPWARDEN_ADOPT_NETWORK", default_value = crate::gc::adopt::DEFAULT_NETWORK)]
    pub adopt_network: String,
    /// Apply ipwarden's CRDs at start (off when the chart installs them).
    #[arg(long, env = "IPWARDEN_INSTALL_CRDS")]
    pub install_crds: bool,
    /// The namespace of this node's agent Lease (the agent's own namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// Seconds the controller waits, seeing the agent Lease unchanged, before it takes this
    /// agent as gone (and applies the NotReady policy to the node's records).
    #[arg(long, env = "IPWARDEN_AGENT_LEASE_DURATION_SECONDS", default_value_t = heartbeat::DEFAULT_LEASE_DURATION.as_secs())]
    pub lease_duration_seconds: u64,
    /// Seconds between renewals of the agent Lease.
    #[arg(long, env = "IPWARDEN_AGENT_LEASE_RENEW_SECONDS", default_value_t = 5)]
    pub lease_renew_seconds: u64,
    /// Spare IPs the node keeps ready in each default pool selecting it (where its stateless
    /// pods go without naming a pool): an ADD of a pod whose workload keeps no IPs takes one on its own network's
    /// interface and answers before its record is written (0: none, every ADD waits for its
    /// record's write). They sit in the node's own blocks (or a free block it claims), count as
    /// used for everyone else, and go back while the pool is being deleted or disabled, no
    /// longer selects the node, is no default pool, or has at most one block no node has
    /// claimed.
    #[arg(long, env = "IPWARDEN_SPARE_IPS", default_value_t = 0)]
    pub spare_ips: usize,
    /// The container runtime's CRI socket (containerd: /run/containerd/containerd.sock; CRI-O:
    /// /run/crio/crio.sock), or several comma-separated: the agent asks the first that exists
    /// at start and whose runtime's `Version` is the Node's `containerRuntimeVersion` (the
    /// runtime kubelet uses) which sandboxes it still has: an attachment whose sandbox is gone
    /// is released at once, and one the runtime still has is never released for lack of a
    /// DEL. Unset, or none fits: the sandbox grace alone decides.
    #[arg(long, env = "IPWARDEN_CRI_SOCKET", value_delimiter = ',')]
    pub cri_socket: Vec<PathBuf>,
    /// Seconds between two questions to the runtime (besides those before each pass over
    /// release marks, each CNI GC and the start-up GC).
    #[arg(long, env = "IPWARDEN_CRI_POLL_INTERVAL_SECONDS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub cri_poll_interval_seconds: u64,
    /// Seconds one CRI call (not the event stream) may take before the runtime counts as
    /// unreachable for that pass.
    #[arg(long, env = "IPWARDEN_CRI_TIMEOUT_SECONDS", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub cri_timeout_seconds: u64,
    /// Seconds after its ADD before the runtime's not listing a sandbox counts as the sandbox
    /// being gone, for an attachment no release mark names: a runtime lists a sandbox only
    /// once its network is set up and its pause container started.
    #[arg(long, env = "IPWARDEN_CRI_SANDBOX_SETTLE_SECONDS", default_value_t = 60)]
    pub cri_sandbox_settle_seconds: u64,
}

/// Runs the agent until the process is stopped. Must run inside an actix System.
pub async fn run(args: AgentArgs) -> anyhow::Result<()> {
    // Before anything touches the socket or the checkpoint; held until the process exits.
    let _lock = lock::AgentLock::acquire(&args.checkpoint, &args.node_name)?;
    let client = Client::try_default().await.context("building the Kubernetes client (kubeconfig or in-cluster)")?;
    if args.install_crds {
        crate::crd::install(&client, STARTUP_TIMEOUT).await.context("installing the CRDs")?;
    }
    let mut registry = Registry::default();
    let metrics = Arc::new(metrics::AgentMetrics::register(&mut registry));
    let ready = Arc::new(AtomicBool::new(false));
    let endpoint = crate::http::Endpoint { registry: Arc::new(registry), ready: ready.clone() };
    crate::http::spawn(args.metrics_address, endpoint)
        .await
        .with_context(|| format!("binding the metrics address {}", args.metrics_address))?;

    let (namespaces, namespaces_writer) = reflector::store::<Namespace>();
    let (node_cache, node_writer) = reflector::store::<Node>();
    let (pod_cache, pod_writer) = reflector::store::<Pod>();
    let only_this_node = watcher::Config::default().fields(&format!("metadata.name={}", args.node_name));
    let pods_of_this_node = watcher::Config::default().fields(&format!("spec.nodeName={}", args.node_name));
    let pod_events = Arc::new(Notify::new());
    let pod_changed = pod_events.clone();
    tokio::spawn(
        reflector(
            pod_writer,
            watcher(Api::<Pod>::all(client.clone()), pods_of_this_node).modify(|pod| pod.managed_fields_mut().clear()),
        )
        .default_backoff()
        .for_each(move |_| {
            pod_changed.notify_waiters();
            async {}
        }),
    );
    tokio::spawn(
        reflector(namespaces_writer, watcher(Api::<Namespace>::all(client.clone()), watcher::Config::default()))
            .default_backoff()
            .for_each(|_| async {}),
    );
    tokio::spawn(
        reflector(node_writer, watcher(Api::<Node>::all(client.clone()), only_this_node))
            .default_backoff()
            .for_each(|_| async {}),
    );
    let (pools, pools_writer) = reflector::store::<IPPool>();
    let (blocks, blocks_writer) = reflector::store::<IPBlock>();
    let pool_events = reflector(pools_writer, watcher(Api::<IPPool>::all(client.clone()), watcher::Config::default()));
    let block_events =
        reflector(blocks_writer, watcher(Api::<IPBlock>::all(client.clone()), watcher::Config::default()));
    let own_block_writes: Arc<OwnWrites<IPBlock>> = Arc::default();
    let spares_wake = Arc::new(Notify::new());
    let tend_on_pool_change = spares_wake.clone();
    tokio::spawn(pool_events.default_backoff().for_each(move |event| {
        if matches!(event, Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone)) {
            // A new default pool gets the node's spares before its first pods.
            tend_on_pool_change.notify_one();
        }
        async {}
    }));
    let marks = Arc::new(Notify::new());
    let (node, notify, seen_writes) = (args.node_name.clone(), marks.clone(), own_block_writes.clone());
    let observed = block_events.default_backoff().inspect(move |event| {
        if let Ok(event) = event {
            seen_writes.observe_event(event);
        }
    });
    tokio::spawn(observed.touched_objects().for_each(move |block| {
        if let Ok(block) = block
            && block.spec.allocations.values().any(|r| r.node == node && crate::gc::handshake::marked_for_release(r))
        {
            notify.notify_one();
        }
        async {}
    }));
    tokio::time::timeout(STARTUP_TIMEOUT, async {
        pools.wait_until_ready().await?;
        blocks.wait_until_ready().await?;
        namespaces.wait_until_ready().await?;
        node_cache.wait_until_ready().await?;
        pod_cache.wait_until_ready().await
    })
    .await
    .context("the IPPool, IPBlock, Namespace, Node and Pod caches did not sync in time (are the CRDs installed?)")?
    .context("the IPPool, IPBlock, Namespace, Node and Pod caches closed before syncing")?;

    let (checkpoint, restored) = Checkpoint::load(&args.checkpoint)?;
    let settings = core::Settings {
        node: args.node_name.clone(),
        cooldown: Duration::from_secs(args.reuse_cooldown_seconds),
        sticky_kinds: args.sticky_owner_kinds.iter().map(|k| k.trim().to_string()).filter(|k| !k.is_empty()).collect(),
        sandbox_grace: Duration::from_secs(args.release_sandbox_grace_seconds),
        spare_ips: args.spare_ips,
    };
    let caches = core::Caches {
        pools,
        blocks,
        namespaces,
        node: node_cache,
        pods: pod_cache,
        pod_events,
        own_block_writes,
        spares_wake: spares_wake.clone(),
    };
    let mut core = core::Core::new(client.clone(), settings, caches, checkpoint, metrics);
    let cri_sockets: Vec<&PathBuf> = args.cri_socket.iter().filter(|path| path.exists()).collect();
    if cri_sockets.is_empty() && !args.cri_socket.is_empty() {
        let tried = args.cri_socket.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
        tracing::warn!(%tried, "no CRI socket exists; release marks wait out the sandbox grace (--release-sandbox-grace-seconds)");
    }
    if !cri_sockets.is_empty() {
        let timeout = Duration::from_secs(args.cri_timeout_seconds);
        let clients = cri_sockets
            .iter()
            .map(|socket| {
                crate::cri::client::CriClient::new(socket, timeout)
                    .with_context(|| format!("setting up the CRI client of {}", socket.display()))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let settle = Duration::from_secs(args.cri_sandbox_settle_seconds);
        core = core.with_runtime(runtime_sandboxes::Runtime::new(clients, settle));
        let sockets = cri_sockets.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
        tracing::info!(%sockets, "the agent will ask the node's runtime over CRI which sandboxes it has");
    }
    let core = Arc::new(core);
    let path = args.checkpoint.display();
    if restored == Restored::Loaded {
        tracing::info!(%path, "checkpoint restored");
    } else {
        // Before the rebuilt file is saved: a stop in between leaves it missing, so the next
        // start settles them again (the settling is idempotent).
        let settled = core
            .settle_spares_after_rebuild(&args.adopt_network)
            .await
            .context("settling the node's spare IPs before rebuilding the checkpoint")?;
        if settled > 0 {
            tracing::warn!(settled, "spare IPs of this node settled: the lost checkpoint said which were bound");
        }
        // A lost file (new disk, changed path) is rebuilt like a corrupt one: the handshake
        // needs to know which sandboxes are still attached.
        let count = core.rebuild_checkpoint().await.context("rebuilding the checkpoint")?;
        match restored {
            Restored::MovedAside(aside) => {
                tracing::warn!(corrupt = %aside.display(), entries = count, "checkpoint was corrupt: moved aside and rebuilt from the IPBlocks");
            }
            _ if count == 0 => tracing::info!(%path, "no checkpoint and no record of this node: first start"),
            _ => {
                tracing::warn!(%path, entries = count, "no checkpoint: rebuilt from this node's records in the IPBlocks")
            }
        }
    }

    let released = core.startup_gc().await.context("start-up GC")?;
    tracing::info!(released, "start-up GC done");
    if let (Some(data_dir), Some(network)) = (&args.host_local_data_dir, &args.host_local_network) {
        let live = crate::hostlocal::live_ips_on_node(&client, &args.node_name)
            .await
            .context("listing the node's pods for host-local GC")?;
        let freed = crate::hostlocal::collect(data_dir, network, &live, HOST_LOCAL_MIN_AGE, false)?;
        tracing::info!(released = freed.len(), %network, "host-local start-up GC done");
    }
    if args.adopt_on_start {
        let adopted =
            core.adopt_local_pods(&args.adopt_network).await.context("adopting the IPs of this node's pods")?;
        tracing::info!(adopted, "start-up adoption done");
    }
    let heartbeat = heartbeat::Heartbeat {
        leases: Api::namespaced(client.clone(), &args.namespace),
        nodes: Api::all(client.clone()),
        node: args.node_name.clone(),
        duration: Duration::from_secs(args.lease_duration_seconds),
    };
    wait_for_node(&core.node, &args.node_name).await;
    heartbeat.renew().await.context("writing the agent Lease")?;
    tokio::spawn(heartbeat.run(Duration::from_secs(args.lease_renew_seconds.max(1))));
    // Spares ready before the first CNI call (a node taking its first burst).
    if !core.tend_spares().await {
        tracing::warn!("reserving spare IPs before serving failed; the tending retries");
    }
    let runtime_sweep = Arc::new(Notify::new());
    if !cri_sockets.is_empty() {
        tokio::spawn(core.clone().follow_runtime_events(runtime_sweep.clone()));
    }
    let allocator = allocator::NodeAllocator::new(core).start();
    tokio::spawn(answer_marks(allocator.clone(), marks));
    tokio::spawn(tend_spares(allocator.clone(), spares_wake));
    if !cri_sockets.is_empty() {
        let interval = Duration::from_secs(args.cri_poll_interval_seconds);
        tokio::spawn(sweep_runtime(allocator.clone(), interval, runtime_sweep));
    }
    let listener =
        server::bind(&args.socket).with_context(|| format!("binding the CNI socket {}", args.socket.display()))?;
    ready.store(true, Ordering::Relaxed);
    tracing::info!(socket = %args.socket.display(), node = %args.node_name, "serving CNI");
    server::serve(listener, allocator).await;
    Ok(())
}

/// Asks the allocation actor to answer release marks whenever a block with a mark for this
/// node changes, and every [`MARK_RESCAN_INTERVAL`] in any case.
async fn answer_marks(allocator: actix::Addr<allocator::NodeAllocator>, marks: Arc<Notify>) {
    loop {
        let _woken = tokio::time::timeout(MARK_RESCAN_INTERVAL, marks.notified()).await;
        if allocator.send(allocator::AnswerMarks).await.is_err() {
            return;
        }
    }
}

/// Asks the allocation actor to release the attachments whose sandboxes the runtime no longer
/// has (`--cri-socket`) whenever the runtime's events report a sandbox's end (`wake`), and
/// every `interval` in any case.
async fn sweep_runtime(allocator: actix::Addr<allocator::NodeAllocator>, interval: Duration, wake: Arc<Notify>) {
    loop {
        let _woken = tokio::time::timeout(interval, wake.notified()).await;
        if allocator.send(allocator::SweepRuntime).await.is_err() {
            return;
        }
    }
}

/// Asks the allocation actor to tend the node's spare IPs whenever an ADD bound some, every
/// [`spares::TEND_INTERVAL`] in any case, and soon again after a pass whose writes did not all
/// go through ([`spares::TEND_RETRY`], doubling up to the interval).
async fn tend_spares(allocator: actix::Addr<allocator::NodeAllocator>, wake: Arc<Notify>) {
    let mut failed: u32 = 0;
    loop {
        let wait = match failed {
            0 => spares::TEND_INTERVAL,
            n => spares::TEND_RETRY.saturating_mul(1 << (n - 1).min(6)).min(spares::TEND_INTERVAL),
        };
        let _woken = tokio::time::timeout(wait, wake.notified()).await;
        match allocator.send(allocator::TendSpares).await {
            Ok(true) => failed = 0,
            Ok(false) => failed = failed.saturating_add(1),
            Err(_) => return,
        }
    }
}
