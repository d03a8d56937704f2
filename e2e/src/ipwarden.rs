//! Running ipwarden itself on a test cluster: the CNI network that invokes the real
//! `ipwarden-cni` binary, one agent process per node, controller replicas, pools, and the
//! processes' HTTP endpoints. The binary under test is passed in (the harness does not
//! depend on the ipwarden crate).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::json;

use crate::cluster::Cluster;
use crate::cni::CniNetwork;
use crate::error::{Error, Result};
use crate::process::Component;
use crate::wait::{self, Probe};

/// The netconf name of ipwarden's network in tests.
pub const NETWORK: &str = "ipwarden";

/// A CNI network whose plugin is `binary` installed as `ipwarden-cni` in `plugin_dir`, talking
/// to the agent socket in each node's directory.
pub fn network(binary: &Path, plugin_dir: &Path) -> Result<CniNetwork> {
    std::fs::create_dir_all(plugin_dir).map_err(Error::io("creating the CNI plugin directory", plugin_dir))?;
    // Link under a unique name, then rename over the final one: atomic, so tests that set up
    // the same directory at once never see it missing or collide.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let link = plugin_dir.join("ipwarden-cni");
    let unique = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let temp = plugin_dir.join(format!(".ipwarden-cni-{}-{unique}", std::process::id()));
    std::os::unix::fs::symlink(binary, &temp).map_err(Error::io("linking ipwarden-cni", &temp))?;
    std::fs::rename(&temp, &link).map_err(Error::io("installing ipwarden-cni", &link))?;
    Ok(CniNetwork {
        plugin_dirs: vec![plugin_dir.to_path_buf()],
        netconf: Arc::new(
            |node| json!({"cniVersion": "1.1.0", "name": NETWORK, "type": "ipwarden-cni", "socket": node.dir.join("agent.sock")}),
        ),
        runtime_gc: crate::cni::RuntimeGc::Never,
        network_status: None,
        node_env: None,
    })
}

/// The agent socket of a node.
pub fn agent_socket(cluster: &Cluster, node: usize) -> PathBuf {
    cluster.nodes()[node].dir().join("agent.sock")
}

/// The checkpoint file of a node's agent.
pub fn checkpoint_path(node_dir: &Path) -> PathBuf {
    node_dir.join("checkpoint.json")
}

/// Holds every checkpoint save of a node's agent until dropped: the agent saves by writing
/// `checkpoint.tmp` beside the file and renaming it into place, so a FIFO at that path makes
/// the save block in open(2) (no reader) with its records already written. A test stages "the
/// agent crashed between its block write and its checkpoint save" with it, then kills the
/// agent, instead of racing a kill against the agent's writes. Kill the agent before dropping
/// the hold: the FIFO is removed on drop, so the next agent saves normally, but a save already
/// blocked on it stays blocked in the running agent. Start the hold while the agent saves
/// nothing (no ADD or DEL under way on the node), so no save in flight meets the FIFO half made.
#[derive(Debug)]
pub struct CheckpointHold {
    fifo: PathBuf,
}

impl CheckpointHold {
    /// Starts holding the saves of the agent whose node directory is `node_dir`.
    pub fn start(node_dir: &Path) -> Result<Self> {
        let fifo = checkpoint_path(node_dir).with_extension("tmp");
        match std::fs::remove_file(&fifo) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("removing a stale checkpoint temp file", &fifo)(e)),
        }
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR)
            .map_err(|e| Error::io("making the checkpoint hold FIFO", &fifo)(e.into()))?;
        Ok(Self { fifo })
    }
}

impl Drop for CheckpointHold {
    fn drop(&mut self) {
        let _gone = std::fs::remove_file(&self.fifo);
    }
}

/// Holds the releases the controller is about to write (an answered mark's, or one no agent
/// can answer), the migration targets it is about to detach and the takeovers it is about to
/// answer, before their live re-reads, while it lives: the controller started with
/// `--test-release-hold=<path>` waits while the file at `path` exists, with `<path>.held`
/// present while a release waits. A test stages "the release was
/// decided on the old state, then the state changed, then the write re-read it" with it,
/// instead of racing the batch window.
#[derive(Debug)]
pub struct ReleaseHold {
    path: PathBuf,
}

impl ReleaseHold {
    /// Starts holding the releases of a controller given `--test-release-hold=<path>`.
    pub fn start(path: &Path) -> Result<Self> {
        let _stale = std::fs::remove_file(held_marker(path));
        std::fs::write(path, b"").map_err(Error::io("making the release hold", path))?;
        Ok(Self { path: path.to_path_buf() })
    }

    /// The controller flag that obeys this hold.
    pub fn flag(&self) -> String {
        format!("--test-release-hold={}", self.path.display())
    }

    /// Whether a release (or a detach, or an answer) waits on the hold.
    pub fn holds_a_release(&self) -> bool {
        held_marker(&self.path).exists()
    }
}

/// The file the controller keeps while a release waits on the hold at `path`: `<path>.held`.
fn held_marker(path: &Path) -> PathBuf {
    let mut held = path.as_os_str().to_owned();
    held.push(".held");
    held.into()
}

impl Drop for ReleaseHold {
    fn drop(&mut self) {
        let _gone = std::fs::remove_file(&self.path);
    }
}

/// Who an ipwarden process talks to the apiserver as, and where the controller keeps its
/// Lease and trigger ConfigMap.
#[derive(Clone, Debug)]
pub struct RunAs {
    /// The kubeconfig (the admin's, or a ServiceAccount's from [`crate::accounts`]).
    pub kubeconfig: PathBuf,
    /// The controller's and the agents' `--namespace`.
    pub namespace: String,
}

impl RunAs {
    /// The admin identity, namespace `default`.
    pub fn admin(cluster: &Cluster) -> Self {
        Self { kubeconfig: cluster.kubeconfig().to_path_buf(), namespace: "default".to_string() }
    }
}

fn spawn(binary: &Path, name: &str, args: Vec<String>, log: PathBuf, kubeconfig: &Path) -> Result<Component> {
    let env = vec![
        ("KUBECONFIG".to_string(), kubeconfig.display().to_string()),
        ("RUST_LOG".to_string(), "info,kube_client=warn".to_string()),
    ];
    Component::start_with_env(name, binary, args, env, log)
}

/// Starts the agent of node `node` as the admin, serving metrics on 127.0.0.1:`metrics_port`,
/// with `extra` flags; its log is `agent.log` in the node's directory.
pub fn start_agent(
    cluster: &Cluster,
    binary: &Path,
    node: usize,
    metrics_port: u16,
    extra: &[&str],
) -> Result<Component> {
    start_agent_as(cluster, binary, node, metrics_port, extra, &RunAs::admin(cluster))
}

/// Stands, in an agent's arguments, for its node's CRI socket ([`Cluster::cri_sockets`]):
/// `--cri-socket={cri-socket}` makes every agent ask its own node's runtime.
pub const CRI_SOCKET_OF_NODE: &str = "{cri-socket}";

/// The agent argument that makes it ask its node's runtime over CRI.
pub const WITH_CRI: &str = "--cri-socket={cri-socket}";

/// Like [`start_agent`], talking to the apiserver as `run_as`. `node` counts the simulated
/// nodes, then the real ones ([`Cluster::node_dirs`]). [`CRI_SOCKET_OF_NODE`] in an argument
/// of `extra` is replaced by the node's CRI socket.
pub fn start_agent_as(
    cluster: &Cluster,
    binary: &Path,
    node: usize,
    metrics_port: u16,
    extra: &[&str],
    run_as: &RunAs,
) -> Result<Component> {
    let (name, dir) = cluster.node_dirs().swap_remove(node);
    let mut args = vec![
        "agent".to_string(),
        format!("--node-name={name}"),
        format!("--socket={}", dir.join("agent.sock").display()),
        format!("--checkpoint={}", checkpoint_path(&dir).display()),
        format!("--metrics-address=127.0.0.1:{metrics_port}"),
        format!("--namespace={}", run_as.namespace),
    ];
    let cri = cluster.cri_sockets().swap_remove(node);
    args.extend(extra.iter().map(|a| a.replace(CRI_SOCKET_OF_NODE, &cri.display().to_string())));
    spawn(binary, &format!("agent-{name}"), args, dir.join("agent.log"), &run_as.kubeconfig)
}

/// Starts a controller replica named `identity` as the admin in namespace `default`, serving
/// metrics on 127.0.0.1:`metrics_port`, with `extra` flags; its log is in the run directory.
pub fn start_controller(
    cluster: &Cluster,
    binary: &Path,
    identity: &str,
    metrics_port: u16,
    extra: &[&str],
) -> Result<Component> {
    start_controller_as(cluster, binary, identity, metrics_port, extra, &RunAs::admin(cluster))
}

/// Like [`start_controller`], talking to the apiserver as `run_as` and keeping its Lease in
/// `run_as.namespace`.
pub fn start_controller_as(
    cluster: &Cluster,
    binary: &Path,
    identity: &str,
    metrics_port: u16,
    extra: &[&str],
    run_as: &RunAs,
) -> Result<Component> {
    let mut args = vec![
        "controller".to_string(),
        format!("--identity={identity}"),
        format!("--namespace={}", run_as.namespace),
        format!("--metrics-address=127.0.0.1:{metrics_port}"),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let log = cluster.dir().join(format!("controller-{identity}.log"));
    spawn(binary, &format!("controller-{identity}"), args, log, &run_as.kubeconfig)
}

/// A plain-HTTP client for an ipwarden process's endpoint on `address`:`port` (127.0.0.1, or
/// a pod's IP).
fn endpoint_client(address: &str, port: u16) -> Result<Client> {
    let text = format!("http://{address}:{port}");
    let uri: http::Uri = text
        .parse()
        .map_err(|e: http::uri::InvalidUri| Error::Kubeconfig { path: text.clone().into(), reason: e.to_string() })?;
    Client::try_from(kube::Config::new(uri)).map_err(Error::kube(format!("building a client for {text}")))
}

/// GETs `path` (e.g. `/metrics`, or a path with a query) from the process on
/// 127.0.0.1:`port`.
pub async fn get(port: u16, path: &str) -> Result<String> {
    get_at("127.0.0.1", port, path).await
}

/// GETs `path` from the process on `address`:`port` (a pod's IP and its metrics port).
pub async fn get_at(address: &str, port: u16, path: &str) -> Result<String> {
    let mut request = http::Request::new(Vec::new());
    *request.uri_mut() = path
        .parse()
        .map_err(|e: http::uri::InvalidUri| Error::Kubeconfig { path: path.into(), reason: e.to_string() })?;
    endpoint_client(address, port)?
        .request_text(request)
        .await
        .map_err(Error::kube(format!("GET {path} on {address}:{port}")))
}

/// Waits until the process on `port` answers `/readyz` with ok, failing at once if it exits.
pub async fn wait_ready(component: &mut Component, port: u16, timeout: Duration) -> Result<()> {
    let what = format!("{} ready (log {})", component.name(), component.log().display());
    wait::until(&what, timeout, || {
        let running = component.ensure_running();
        async move {
            running?;
            Ok(match wait::quietly(get(port, "/readyz")).await {
                Ok(body) if body == "ok" => Probe::Done(()),
                Ok(body) => Probe::Pending(body),
                Err(e) => Probe::Pending(e.to_string()),
            })
        }
    })
    .await
}

/// How long an ipwarden process may take to report ready.
const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// One ipwarden process on a test cluster.
pub struct Daemon {
    /// What it is: `agent node-0`, `controller-a`, ...
    pub name: String,
    /// Its `/metrics` port on 127.0.0.1.
    pub metrics_port: u16,
    /// The process itself; stopped when dropped.
    pub component: Component,
}

/// ipwarden as `ipwarden-e2e up --ipwarden` runs it: an agent per node, a default pool
/// 10.244.0.0/16 and two controller replicas. Dropping it stops the processes.
pub struct Installation {
    /// One agent per node, in node order.
    pub agents: Vec<Daemon>,
    /// The controller replicas `controller-a` and `controller-b`.
    pub controllers: Vec<Daemon>,
}

/// Starts ipwarden from `binary` on `cluster` (whose network must be [`network`]): an agent
/// per node (the first installs the CRDs), the default pool, then two controller replicas,
/// each waited on until ready.
pub async fn install(cluster: &Cluster, binary: &Path) -> Result<Installation> {
    install_with(cluster, binary, default_pool(), &[], &[]).await
}

/// The spec of the default pool [`install`] creates: 10.244.0.0/16.
pub fn default_pool() -> serde_json::Value {
    json!({"cidr": "10.244.0.0/16", "default": true})
}

/// [`install`] with `pool` as the default pool's spec, `agent_args` added to every agent's
/// command line and `controller_args` to every controller's (the benchmark's StatefulSet storm
/// runs on a pool of a few IPs; `ipwarden-e2e up` passes a user's flags through).
pub async fn install_with(
    cluster: &Cluster,
    binary: &Path,
    pool: serde_json::Value,
    agent_args: &[&str],
    controller_args: &[&str],
) -> Result<Installation> {
    let mut installed = Installation { agents: Vec::new(), controllers: Vec::new() };
    for (node, (name, _)) in cluster.node_dirs().into_iter().enumerate() {
        let port = crate::process::free_port()?;
        let mut extra = agent_args.to_vec();
        if node == 0 {
            extra.push("--install-crds");
        }
        let mut agent = start_agent(cluster, binary, node, port, &extra)?;
        wait_ready(&mut agent, port, READY_TIMEOUT).await?;
        let name = format!("agent {name}");
        installed.agents.push(Daemon { name, metrics_port: port, component: agent });
    }
    create_pool(&cluster.client(), "default", pool).await?;
    for identity in ["controller-a", "controller-b"] {
        let port = crate::process::free_port()?;
        let mut controller = start_controller(cluster, binary, identity, port, controller_args)?;
        wait_ready(&mut controller, port, READY_TIMEOUT).await?;
        installed.controllers.push(Daemon { name: identity.to_string(), metrics_port: port, component: controller });
    }
    Ok(installed)
}

/// Creates IPPool `name` with `spec`.
pub async fn create_pool(client: &Client, name: &str, spec: serde_json::Value) -> Result<()> {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk("ipwarden.io", "v1alpha1", "IPPool"));
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
    let mut pool = DynamicObject::new(name, &resource);
    pool.data = json!({"spec": spec});
    api.create(&PostParams::default(), &pool).await.map(drop).map_err(Error::kube(format!("creating IPPool {name}")))
}
