//! Simulated nodes: a fake kubelet that registers Nodes, keeps their Ready condition and
//! node Leases fresh, and runs the pods scheduled to them through a real CNI plugin.
//!
//! Pods are "run" without containers: the kubelet asks the CNI plugin for the sandbox's
//! network (ADD), reports the pod Running with the IPs of the CNI result, completes pods
//! annotated with [`RUN_SECONDS_ANNOTATION`], and on deletion lets the containers stop
//! ([`STOP_SECONDS_ANNOTATION`], capped by the grace period), then calls DEL before removing
//! the pod, as a real kubelet and container runtime do. The runtime answers CRI's sandbox
//! listing on the node's [`CRI_SOCKET`] (module `cri`).

pub(crate) mod cri;
mod pods;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::cni::{CniNetwork, NodeInfo, RuntimeGc};
use crate::error::{Error, Result};

pub use cri::{CRI_SOCKET, socket_in as cri_socket};
use pods::RuntimeCalls;
pub use pods::{
    EXIT_CODE_ANNOTATION, EXTRA_INTERFACES_ANNOTATION, EXTRA_NETCONF_ANNOTATION, RUN_SECONDS_ANNOTATION,
    SKIP_DEL_ANNOTATION, STOP_SECONDS_ANNOTATION,
};

/// The field manager of every write the simulated kubelet makes.
const FIELD_MANAGER: &str = "ipwarden-e2e-kubelet";

/// How often a live node renews its Lease.
const LEASE_RENEW_INTERVAL: Duration = Duration::from_secs(3);

/// How often a live node re-posts its status (real kubelets: every 5 minutes while the
/// Lease is fresh; more often here so a recovered node turns Ready quickly).
const STATUS_INTERVAL: Duration = Duration::from_secs(10);

/// How soon a node whose runtime calls CNI GC once at its start ([`RuntimeGc::Startup`]) tries
/// again while the plugin does not answer yet.
const STARTUP_GC_RETRY: Duration = Duration::from_secs(1);

/// The lease duration a node announces; the node lifecycle controller uses its own
/// `--node-monitor-grace-period` to decide a node is lost.
const LEASE_DURATION_SECONDS: i32 = 40;

/// The label every simulated node carries.
pub const SIMULATED_NODE_LABEL: &str = "e2e.ipwarden.io/simulated";

/// The address every simulated node reports; the simulated kubelet serves nothing there.
pub const NODE_ADDRESS: &str = "127.0.0.1";

/// Failures a test can switch on for one node, changeable while pods run.
#[derive(Debug, Default)]
pub struct Faults {
    status_delay_ms: AtomicU64,
    skip_del: AtomicBool,
    crash_adds: AtomicUsize,
    cri_unavailable: AtomicBool,
    hold_teardowns: AtomicBool,
    hide_new_sandboxes: AtomicBool,
    hidden: Mutex<std::collections::HashSet<String>>,
    failing_status_calls: AtomicUsize,
    events_end_at_once: AtomicBool,
}

impl Faults {
    /// Waits this long between a successful CNI ADD and the pod status patch, so pod
    /// status lags the CNI result as it does under a loaded kubelet.
    pub fn set_status_delay(&self, delay: Duration) {
        self.status_delay_ms.store(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// The current status delay.
    pub fn status_delay(&self) -> Duration {
        Duration::from_millis(self.status_delay_ms.load(Ordering::Relaxed))
    }

    /// When on, sandboxes are torn down without calling CNI DEL: the missed DEL that leaks
    /// an IP.
    pub fn set_skip_del(&self, skip: bool) {
        self.skip_del.store(skip, Ordering::Relaxed);
    }

    /// Whether CNI DEL is skipped.
    pub fn skip_del(&self) -> bool {
        self.skip_del.load(Ordering::Relaxed)
    }

    /// Makes the next `count` ADDs "crash" the runtime after the plugin answered: the result
    /// is thrown away unrecorded and no DEL follows; the pod is retried with a new sandbox.
    pub fn crash_next_adds(&self, count: usize) {
        self.crash_adds.store(count, Ordering::Relaxed);
    }

    /// When on, every CRI call fails with `Unavailable` (the runtime cannot be asked), as
    /// containerd answers while it is not initialized (module `cri`).
    pub fn set_cri_unavailable(&self, unavailable: bool) {
        self.cri_unavailable.store(unavailable, Ordering::Relaxed);
    }

    /// Whether CRI calls fail.
    pub fn cri_unavailable(&self) -> bool {
        self.cri_unavailable.load(Ordering::Relaxed)
    }

    /// When on, the sandboxes of deleted pods are not torn down (no DEL, and the runtime
    /// keeps them READY) until it is off again: a teardown stuck in the runtime.
    pub fn set_hold_teardowns(&self, hold: bool) {
        self.hold_teardowns.store(hold, Ordering::Relaxed);
    }

    /// Whether teardowns wait.
    pub fn hold_teardowns(&self) -> bool {
        self.hold_teardowns.load(Ordering::Relaxed)
    }

    /// While on, a new sandbox enters the runtime's store only when this is switched off: CRI
    /// neither lists it nor finds its status, as containerd while it still creates and starts
    /// a sandbox whose CNI ADD has returned (a slow pause image pull). Its pod runs meanwhile.
    pub fn set_hide_new_sandboxes(&self, hide: bool) {
        self.hide_new_sandboxes.store(hide, Ordering::Relaxed);
        if !hide && let Ok(mut hidden) = self.hidden.lock() {
            hidden.clear();
        }
    }

    /// Hides sandbox `id` from CRI if new sandboxes are hidden.
    fn hide_if_asked(&self, id: &str) {
        if self.hide_new_sandboxes.load(Ordering::Relaxed)
            && let Ok(mut hidden) = self.hidden.lock()
        {
            hidden.insert(id.to_string());
        }
    }

    /// Whether CRI must not show sandbox `id` yet.
    fn hidden_from_cri(&self, id: &str) -> bool {
        self.hidden.lock().is_ok_and(|hidden| hidden.contains(id))
    }

    /// Makes the next `count` CRI `PodSandboxStatus` calls fail with `Unavailable`, as one
    /// call does while containerd restarts, or as a call past the agent's timeout.
    pub fn fail_next_status_calls(&self, count: usize) {
        self.failing_status_calls.store(count, Ordering::Relaxed);
    }

    /// How many of the status calls made to fail have not been made yet.
    pub fn status_calls_to_fail(&self) -> usize {
        self.failing_status_calls.load(Ordering::Relaxed)
    }

    /// Consumes one pending status call failure, if any.
    fn take_status_failure(&self) -> bool {
        self.failing_status_calls.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok()
    }

    /// When on, CRI `GetContainerEvents` answers with a stream that ends at once without an
    /// event, as CRI-O does with its default `enable_pod_events = false` (CRI-O
    /// `server/container_events.go`, v1.34: it returns before sending anything).
    pub fn set_events_end_at_once(&self, end: bool) {
        self.events_end_at_once.store(end, Ordering::Relaxed);
    }

    /// Whether event streams end at once.
    fn events_end_at_once(&self) -> bool {
        self.events_end_at_once.load(Ordering::Relaxed)
    }

    /// Consumes one pending ADD crash, if any.
    fn take_add_crash(&self) -> bool {
        self.crash_adds.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok()
    }
}

/// A sandbox the simulated runtime created and has not torn down.
#[derive(Clone, Debug)]
pub struct Sandbox {
    /// The pod's namespace and name.
    pub pod: String,
    /// The sandbox's container ID.
    pub container_id: String,
    /// The interface name.
    pub ifname: String,
    /// The CNI ADD result (passed back as `prevResult` on DEL).
    pub result: serde_json::Value,
    /// The IPs of the result.
    pub ips: Vec<String>,
    /// The secondary interfaces (`e2e.ipwarden.io/extra-interfaces`) and their ADD results.
    pub extra: Vec<(String, serde_json::Value)>,
}

/// The simulated runtimes' sandboxes, readable from any task while the nodes run: what the
/// conflict checks of the benchmarks ask to tell an IP two pods really hold from one a deleted
/// pod still shows in the API after its sandbox is gone.
#[derive(Clone, Debug, Default)]
pub struct SandboxSource(Vec<Arc<Mutex<HashMap<String, Sandbox>>>>);

impl SandboxSource {
    /// The sandboxes of `nodes`.
    pub fn of(nodes: &[NodeHandle]) -> Self {
        Self(nodes.iter().map(|n| n.sandboxes.clone()).collect())
    }

    /// The IPs each pod's sandbox holds now, by pod UID.
    pub fn ips_by_pod(&self) -> HashMap<String, BTreeSet<String>> {
        let mut ips: HashMap<String, BTreeSet<String>> = HashMap::new();
        for node in &self.0 {
            let Ok(sandboxes) = node.lock() else { continue };
            for (uid, sandbox) in sandboxes.iter() {
                ips.entry(uid.clone()).or_default().extend(sandbox.ips.iter().cloned());
            }
        }
        ips
    }
}

/// A simulated node a test can inspect and break.
#[derive(Debug)]
pub struct NodeHandle {
    info: NodeInfo,
    faults: Arc<Faults>,
    alive: watch::Sender<bool>,
    sandboxes: Arc<Mutex<HashMap<String, Sandbox>>>,
    calls: Arc<RuntimeCalls>,
    tasks: JoinSet<()>,
}

impl NodeHandle {
    /// The Node's name.
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// The node's private directory.
    pub fn dir(&self) -> &std::path::Path {
        &self.info.dir
    }

    /// The node's fault switches.
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// Simulates losing the node: no more heartbeats, and its pods are no longer touched
    /// (no ADD, DEL or status), until [`NodeHandle::recover`].
    pub fn lose(&self) {
        self.alive.send_replace(false);
    }

    /// Brings a lost node back: heartbeats resume and its pods are reconciled again.
    pub fn recover(&self) {
        self.alive.send_replace(true);
    }

    /// The sandboxes currently up on this node, by pod UID.
    pub fn sandboxes(&self) -> HashMap<String, Sandbox> {
        self.sandboxes.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// What the runtime's CNI STATUS calls answered: whether the last succeeded, and how many
    /// were made.
    pub fn network_status(&self) -> (bool, u64) {
        (self.calls.ready.load(Ordering::Relaxed), self.calls.status.load(Ordering::Relaxed))
    }

    /// How many CNI DEL calls of this node's runtime succeeded.
    pub fn dels(&self) -> u64 {
        self.calls.dels.load(Ordering::Relaxed)
    }

    /// How many CRI `ListPodSandbox` calls were made, and how many `GetContainerEvents`
    /// streams opened.
    pub fn cri_calls(&self) -> (u64, u64) {
        (self.calls.cri_listings.load(Ordering::Relaxed), self.calls.cri_event_streams.load(Ordering::Relaxed))
    }

    /// Stops the node's kubelet tasks (the Node object stays).
    pub fn stop(&mut self) {
        self.tasks.abort_all();
    }
}

/// Registers node `index` named `name` and starts its kubelet.
pub async fn start_node(
    client: Client,
    name: String,
    index: usize,
    dir: PathBuf,
    network: CniNetwork,
) -> Result<NodeHandle> {
    std::fs::create_dir_all(&dir).map_err(Error::io("creating node directory", &dir))?;
    let info = NodeInfo { name, index, dir };
    let node_uid = register(&client, &info.name).await?;
    let (alive, alive_rx) = watch::channel(true);
    let faults = Arc::new(Faults::default());
    let sandboxes = Arc::new(Mutex::new(HashMap::new()));
    let calls = Arc::new(RuntimeCalls::default());
    let mut tasks = JoinSet::new();
    tasks.spawn(heartbeat(client.clone(), info.name.clone(), node_uid, alive_rx.clone()));
    let events = cri::events();
    let cri = cri::CriService {
        sandboxes: sandboxes.clone(),
        faults: faults.clone(),
        events: events.clone(),
        calls: calls.clone(),
    };
    tasks.spawn(cri::serve(&cri::socket_in(&info.dir), cri).await?);
    let pods = pods::NodeRuntime {
        client,
        node: info.clone(),
        network,
        faults: faults.clone(),
        alive: alive_rx,
        sandboxes: sandboxes.clone(),
        pending: Arc::default(),
        gc_gate: Arc::default(),
        calls: calls.clone(),
        events,
    };
    tasks.spawn(pods.clone().status_loop());
    match pods.network.runtime_gc {
        RuntimeGc::Never => {}
        RuntimeGc::Startup => {
            tasks.spawn(pods.clone().gc_loop(STARTUP_GC_RETRY, true));
        }
        RuntimeGc::Every(interval) => {
            tasks.spawn(pods.clone().gc_loop(interval, false));
        }
    }
    tasks.spawn(pods.run());
    Ok(NodeHandle { info, faults, alive, sandboxes, calls, tasks })
}

/// Creates the Node (or finds it, on re-registration), posts its status, returns its UID.
async fn register(client: &Client, name: &str) -> Result<String> {
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                SIMULATED_NODE_LABEL: "true",
            },
        },
    }))
    .map_err(|e| Error::Kube { what: format!("building Node {name}"), source: kube::Error::SerdeError(e) })?;
    let created = match nodes.create(&PostParams::default(), &node).await {
        Ok(created) => created,
        Err(kube::Error::Api(status)) if status.code == 409 => {
            nodes.get(name).await.map_err(Error::kube(format!("reading the existing Node {name}")))?
        }
        Err(e) => return Err(Error::kube(format!("registering Node {name}"))(e)),
    };
    post_status(client, name, Timestamp::now()).await?;
    Ok(created.uid().unwrap_or_default())
}

/// Posts the node's capacity and conditions (Ready since `ready_since`).
async fn post_status(client: &Client, name: &str, ready_since: Timestamp) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let now = Timestamp::now().to_string();
    let since = ready_since.to_string();
    let condition = |kind: &str, status: &str, reason: &str| {
        json!({"type": kind, "status": status, "reason": reason, "message": reason,
               "lastHeartbeatTime": now, "lastTransitionTime": since})
    };
    let resources = json!({"cpu": "16", "memory": "64Gi", "pods": "250", "ephemeral-storage": "100Gi"});
    let status = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID"),
                condition("Ready", "True", "KubeletReady"),
            ],
            "addresses": [{"type": "InternalIP", "address": NODE_ADDRESS}, {"type": "Hostname", "address": name}],
            "nodeInfo": {
                "machineID": name, "systemUUID": name, "bootID": since,
                "kernelVersion": "simulated", "osImage": "ipwarden e2e simulated node",
                "containerRuntimeVersion": format!("{}://{}", cri::RUNTIME_NAME, cri::REPORTED_RUNTIME_VERSION),
            "kubeletVersion": "v1.37.2",
                "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
            },
        },
    });
    nodes
        .patch_status(name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&status))
        .await
        .map(drop)
        .map_err(Error::kube(format!("posting status of Node {name}")))
}

/// Renews the node's Lease in kube-node-lease, owned by the Node like a kubelet's.
async fn renew_lease(client: &Client, name: &str, node_uid: &str) -> Result<()> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-node-lease");
    let lease = json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": node_uid}],
        },
        "spec": {
            "holderIdentity": name,
            "leaseDurationSeconds": LEASE_DURATION_SECONDS,
            "renewTime": Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string(),
        },
    });
    leases
        .patch(name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&lease))
        .await
        .map(drop)
        .map_err(Error::kube(format!("renewing Lease of Node {name}")))
}

/// Renews the Lease and re-posts status while the node is alive; after a loss, posts
/// status at once on recovery so the node turns Ready again.
async fn heartbeat(client: Client, name: String, node_uid: String, mut alive: watch::Receiver<bool>) {
    let mut ready_since = Timestamp::now();
    let mut last_status = tokio::time::Instant::now();
    loop {
        if !*alive.borrow_and_update() {
            if alive.wait_for(|up| *up).await.is_err() {
                return;
            }
            ready_since = Timestamp::now();
            last_status = tokio::time::Instant::now() - STATUS_INTERVAL;
        }
        if let Err(e) = renew_lease(&client, &name, &node_uid).await {
            tracing::warn!(node = %name, error = %e, "lease renewal failed");
        }
        if last_status.elapsed() >= STATUS_INTERVAL {
            match post_status(&client, &name, ready_since).await {
                Ok(()) => last_status = tokio::time::Instant::now(),
                Err(e) => tracing::warn!(node = %name, error = %e, "node status post failed"),
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(LEASE_RENEW_INTERVAL) => {}
            changed = alive.changed() => if changed.is_err() { return },
        }
    }
}
