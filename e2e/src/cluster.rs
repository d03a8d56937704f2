//! A whole test cluster: the control plane plus simulated nodes, in one run directory that
//! is removed after a clean stop and kept (with its logs named) after a failure.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams};

use crate::binaries::{self, ControlPlaneBinaries};
use crate::cni::CniNetwork;
use crate::controlplane::{ControlPlane, ControlPlaneOptions};
use crate::error::{Error, Result};
use crate::kubelet::{self, NodeHandle, SIMULATED_NODE_LABEL};
use crate::realnode::{NodeBinaries, RealNode, RealNodeContext};
use crate::wait::{self, Probe};

/// Environment variable: the directory under which run directories are created (default:
/// the system temp directory).
pub const RUN_ROOT_ENV: &str = "IPWARDEN_E2E_DIR";

/// Environment variable: when set to 1, run directories are kept even after a clean stop.
pub const KEEP_ENV: &str = "IPWARDEN_E2E_KEEP";

/// How long registered nodes may take to turn Ready and lose their not-ready taint.
const NODES_READY_TIMEOUT: Duration = Duration::from_secs(90);

/// How long the service-account controllers may take to create `default` accounts.
const SERVICE_ACCOUNT_TIMEOUT: Duration = Duration::from_secs(60);

/// What kind of cluster to start.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// How many simulated nodes to register.
    pub nodes: usize,
    /// The CNI network the simulated kubelet uses; `None` means the standard `host-local`
    /// plugin found on this machine.
    pub network: Option<CniNetwork>,
    /// Control-plane settings.
    pub control_plane: ControlPlaneOptions,
    /// Real nodes (kubelet and a runtime) besides the simulated ones; none by default.
    pub real_nodes: Option<RealNodesOptions>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self { nodes: 3, network: None, control_plane: ControlPlaneOptions::default(), real_nodes: None }
    }
}

/// Real nodes of a cluster (docs/testing.md, "Real nodes").
#[derive(Clone, Debug)]
pub struct RealNodesOptions {
    /// How many, named `real-node-0`, `real-node-1`, ...
    pub count: usize,
    /// The ipwarden binary, installed as the nodes' `ipwarden-cni` plugin.
    pub ipwarden: PathBuf,
    /// The container runtime they run.
    pub runtime: crate::realnode::Runtime,
    /// Another IPAM for the nodes' network: replaces ipwarden's `ipam` section of the chart's
    /// conflist, with its `cniVersion` (`None`: the chart's conflist as it is). `{NODE_INDEX}`
    /// and `{NODE_DIR}` in it stand for each node's index and directory (per-node ranges, a
    /// per-node data directory).
    pub ipam: Option<(String, serde_json::Value)>,
}

/// The chart's `conflist` with `ipam` as its main plugin's IPAM and `version` as its
/// `cniVersion`.
fn with_ipam(conflist: &str, version: &str, ipam: &serde_json::Value) -> Result<String> {
    let invalid = |reason: String| Error::Tool { command: "replacing the conflist's IPAM".to_string(), reason };
    let mut parsed: serde_json::Value =
        serde_json::from_str(conflist).map_err(|e| invalid(format!("the chart's conflist: {e}")))?;
    let main = parsed["plugins"].get_mut(0).ok_or_else(|| invalid(format!("no plugin in {conflist}")))?;
    main["ipam"] = ipam.clone();
    parsed["cniVersion"] = serde_json::Value::String(version.to_string());
    serde_json::to_string_pretty(&parsed).map_err(|e| invalid(e.to_string()))
}

/// Where the chart's conflist, rendered for the real nodes, names the agent's socket directory;
/// each node puts its own there.
const SOCKET_DIR_MARKER: &str = "/ipwarden-e2e-agent-socket-dir";

/// A running test cluster. Dropping it stops everything it started.
pub struct Cluster {
    dir: PathBuf,
    control_plane: ControlPlane,
    nodes: Vec<NodeHandle>,
    real_nodes: Vec<RealNode>,
    real_context: Option<RealNodeContext>,
    network: CniNetwork,
    keep: bool,
    stopped: bool,
}

impl Cluster {
    /// Builds (or reuses) the control plane binaries, starts the control plane and the
    /// simulated nodes, and waits until the nodes are Ready and schedulable.
    pub async fn start(options: ClusterOptions) -> Result<Self> {
        let network = match options.network {
            Some(network) => network,
            None => CniNetwork::host_local(&binaries::standard_cni_plugins()?),
        };
        let binaries = ControlPlaneBinaries::locate()?;
        let dir = new_run_dir()?;
        tracing::info!(dir = %dir.display(), "starting test cluster");
        let control_plane = match ControlPlane::start(&dir, binaries, &options.control_plane).await {
            Ok(plane) => plane,
            Err(e) => {
                eprintln!("ipwarden-e2e: control plane failed to start; logs kept in {}", dir.display());
                return Err(e);
            }
        };
        let mut cluster = Self {
            dir,
            control_plane,
            nodes: Vec::new(),
            real_nodes: Vec::new(),
            real_context: None,
            network: network.clone(),
            keep: std::env::var(KEEP_ENV).is_ok_and(|v| v == "1"),
            stopped: false,
        };
        let client = cluster.client();
        for index in 0..options.nodes {
            let name = format!("node-{index}");
            let node_dir = cluster.dir.join("nodes").join(&name);
            cluster.nodes.push(kubelet::start_node(client.clone(), name, index, node_dir, network.clone()).await?);
        }
        if let Some(real) = options.real_nodes.filter(|real| real.count > 0) {
            cluster.start_real_nodes(&real).await?;
        }
        cluster.wait_nodes_ready().await?;
        cluster.wait_default_service_account("default").await?;
        Ok(cluster)
    }

    /// Starts the real nodes: the chart's conflist rendered by helm, then each node's
    /// runtime and kubelet, then waits until every one is registered (Ready comes with its
    /// agent: [`Cluster::wait_real_nodes_ready`]).
    async fn start_real_nodes(&mut self, options: &RealNodesOptions) -> Result<()> {
        let binaries = NodeBinaries::locate(options.runtime)?;
        let rendered = crate::helm::Helm::locate()?
            .template(
                "ipwarden",
                "kube-system",
                &[&format!("agent.socketDir={SOCKET_DIR_MARKER}")],
                &["templates/cni-configmap.yaml"],
            )
            .await?;
        let conflist = rendered
            .iter()
            .find_map(|doc| doc["data"]["conflist"].as_str())
            .ok_or_else(|| Error::Tool {
                command: "helm template (cni-configmap.yaml)".to_string(),
                reason: "the chart rendered no conflist".to_string(),
            })?
            .replace(&format!("{SOCKET_DIR_MARKER}/agent.sock"), crate::realnode::AGENT_SOCKET_PLACEHOLDER);
        let conflist = match &options.ipam {
            None => conflist,
            Some((version, ipam)) => with_ipam(&conflist, version, ipam)?,
        };
        let admin = self.kubeconfig().to_path_buf();
        let context = RealNodeContext::new(
            binaries,
            admin,
            self.pki().ca_cert.clone(),
            conflist,
            options.ipwarden.clone(),
            options.runtime,
        )?;
        self.real_context = Some(context.clone());
        for index in 0..options.count {
            let name = format!("real-node-{index}");
            let dir = self.dir.join("real-nodes").join(&name);
            let node = RealNode::start(context.clone(), name, index, dir).await?;
            self.real_nodes.push(node);
        }
        let client = self.client();
        for node in &mut self.real_nodes {
            node.wait_registered(&client, false).await?;
        }
        Ok(())
    }

    /// Waits until every real node is Ready and schedulable: a real node turns Ready once its
    /// network plugin answers STATUS, so after its agent serves.
    pub async fn wait_real_nodes_ready(&mut self) -> Result<()> {
        let client = self.client();
        for node in &mut self.real_nodes {
            node.wait_registered(&client, true).await?;
        }
        Ok(())
    }

    /// What the real nodes share, while there are any.
    pub(crate) fn real_context(&self) -> Option<&RealNodeContext> {
        self.real_context.as_ref()
    }

    /// A client with the admin identity.
    pub fn client(&self) -> Client {
        self.control_plane.client()
    }

    /// The admin kubeconfig file.
    pub fn kubeconfig(&self) -> &Path {
        &self.control_plane.kubeconfig
    }

    /// The apiserver's URL.
    pub fn server(&self) -> &str {
        &self.control_plane.server
    }

    /// The cluster's PKI (CA, serving and admin certificates).
    pub fn pki(&self) -> &crate::pki::Pki {
        &self.control_plane.pki
    }

    /// The run directory (PKI, component logs, node state).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The control plane, to kill or restart a component.
    pub fn control_plane(&mut self) -> &mut ControlPlane {
        &mut self.control_plane
    }

    /// The simulated nodes.
    pub fn nodes(&self) -> &[NodeHandle] {
        &self.nodes
    }

    /// The real nodes.
    pub fn real_nodes(&self) -> &[RealNode] {
        &self.real_nodes
    }

    /// Real node `index`, to stop, kill or restart its kubelet and runtime.
    pub fn real_node(&mut self, index: usize) -> &mut RealNode {
        &mut self.real_nodes[index]
    }

    /// Every node's name and directory (where its agent's socket and checkpoint go): the
    /// simulated nodes, then the real ones.
    pub fn node_dirs(&self) -> Vec<(String, PathBuf)> {
        let simulated = self.nodes.iter().map(|n| (n.name().to_string(), n.dir().to_path_buf()));
        let real = self.real_nodes.iter().map(|n| (n.name().to_string(), n.dir().to_path_buf()));
        simulated.chain(real).collect()
    }

    /// Every node's CRI socket, in [`Cluster::node_dirs`]'s order: the simulated runtime's
    /// (module `kubelet`), then each real node's runtime.
    pub fn cri_sockets(&self) -> Vec<PathBuf> {
        let simulated = self.nodes.iter().map(|n| crate::kubelet::cri_socket(n.dir()));
        let real = self.real_nodes.iter().map(|n| n.paths().runtime_socket());
        simulated.chain(real).collect()
    }

    /// Removes node `index` as when its machine leaves: its kubelet stops and the Node
    /// object is deleted (its pods stay, as they do until the pod GC deletes them).
    pub async fn delete_node(&mut self, index: usize) -> Result<()> {
        self.nodes[index].stop();
        let name = self.nodes[index].name().to_string();
        let nodes: Api<Node> = Api::all(self.client());
        nodes.delete(&name, &DeleteParams::default()).await.map_err(Error::kube(format!("deleting Node {name}")))?;
        wait::until(&format!("Node {name} gone"), NODES_READY_TIMEOUT, || {
            let nodes = nodes.clone();
            let name = name.clone();
            async move {
                Ok(match nodes.get_opt(&name).await.map_err(Error::kube(format!("reading Node {name}")))? {
                    Some(_) => Probe::Pending("still there".to_string()),
                    None => Probe::Done(()),
                })
            }
        })
        .await
    }

    /// Registers node `index` again under its name, as a machine that rejoins with its disk
    /// (the same directory), with a new kubelet that has no sandbox from before; waits until
    /// every node is Ready and schedulable.
    pub async fn reregister_node(&mut self, index: usize) -> Result<()> {
        let name = self.nodes[index].name().to_string();
        let dir = self.nodes[index].dir().to_path_buf();
        self.nodes[index] = kubelet::start_node(self.client(), name, index, dir, self.network.clone()).await?;
        self.wait_nodes_ready().await
    }

    /// The kubectl binary built with the control plane.
    pub fn kubectl(&self) -> PathBuf {
        self.control_plane.binaries.path("kubectl")
    }

    /// Applies the CRDs in `file` (server-side with the cluster's kubectl: big schemas do not
    /// fit client-side apply's annotation) and waits until each of `names` is Established.
    pub async fn apply_crds(&self, file: &Path, names: &[&str], timeout: Duration) -> Result<()> {
        let args = [
            "apply".to_string(),
            "--server-side".to_string(),
            "--field-manager=ipwarden-e2e".to_string(),
            format!("--kubeconfig={}", self.kubeconfig().display()),
            "-f".to_string(),
            file.display().to_string(),
        ];
        crate::process::run_tool(&self.kubectl(), &args, None).await?;
        let api: Api<CustomResourceDefinition> = Api::all(self.client());
        for name in names {
            wait::until(&format!("CRD {name} Established"), timeout, || async {
                let crd = api.get_opt(name).await.map_err(Error::kube(format!("reading CRD {name}")))?;
                let established = crd
                    .and_then(|c| c.status)
                    .and_then(|s| s.conditions)
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Established" && c.status == "True"));
                Ok(if established { Probe::Done(()) } else { Probe::Pending("not Established".into()) })
            })
            .await?;
        }
        Ok(())
    }

    /// Waits until every simulated node is Ready and carries no not-ready taint.
    pub async fn wait_nodes_ready(&mut self) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.client());
        let expected = self.nodes.len();
        let plane = &mut self.control_plane;
        wait::until("simulated nodes Ready and schedulable", NODES_READY_TIMEOUT, || {
            let running = plane.ensure_running();
            let nodes = nodes.clone();
            async move {
                running?;
                let params = ListParams::default().labels(&format!("{SIMULATED_NODE_LABEL}=true"));
                let list = nodes.list(&params).await.map_err(Error::kube("listing simulated nodes"))?;
                let ready = list.items.iter().filter(|node| node_schedulable(node)).count();
                Ok(if ready == expected {
                    Probe::Done(())
                } else {
                    Probe::Pending(format!("{ready}/{expected} ready"))
                })
            }
        })
        .await
    }

    /// Waits until the service-account controller created the `default` ServiceAccount
    /// of `namespace` (pods are refused before it exists).
    pub async fn wait_default_service_account(&self, namespace: &str) -> Result<()> {
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client(), namespace);
        wait::until(&format!("ServiceAccount {namespace}/default"), SERVICE_ACCOUNT_TIMEOUT, || {
            let accounts = accounts.clone();
            async move {
                Ok(match accounts.get_opt("default").await.map_err(Error::kube("reading ServiceAccount default"))? {
                    Some(_) => Probe::Done(()),
                    None => Probe::Pending("not created yet".to_string()),
                })
            }
        })
        .await
    }

    /// Stops the nodes and the control plane and removes the run directory (kept when
    /// [`KEEP_ENV`] is 1).
    pub fn stop(mut self) {
        self.shutdown(false);
    }

    /// Like [`Cluster::stop`], but keeps the run directory and names its logs: for a start-up
    /// that failed after the cluster was up (an ipwarden process exited), so the log its error
    /// names is still there to read.
    pub fn stop_after_failure(mut self) {
        self.shutdown(true);
    }

    fn shutdown(&mut self, failed: bool) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        for node in &mut self.nodes {
            node.stop();
        }
        let real_node_logs: Vec<PathBuf> = self.real_nodes.iter().flat_map(RealNode::logs).collect();
        for node in &mut self.real_nodes {
            node.stop();
        }
        // The host is put back once the last real node is gone (the guard goes with the
        // context).
        self.real_nodes.clear();
        self.real_context = None;
        let keep = failed || self.keep;
        if keep {
            self.control_plane.stop();
        } else {
            // Nothing of a run that passed is read again; a graceful stop would only wait:
            // kube-apiserver does not exit on SIGTERM within the 10 s grace.
            self.control_plane.kill_all();
        }
        if keep {
            eprintln!("ipwarden-e2e: run directory kept: {}", self.dir.display());
            for log in self.control_plane.logs() {
                eprintln!("ipwarden-e2e:   log: {}", log.display());
            }
            for log in &real_node_logs {
                eprintln!("ipwarden-e2e:   log: {}", log.display());
            }
        } else if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("ipwarden-e2e: could not remove {}: {e}", self.dir.display());
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.shutdown(std::thread::panicking());
    }
}

pub(crate) fn node_schedulable(node: &Node) -> bool {
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .into_iter()
        .flatten()
        .any(|t| t.key == "node.kubernetes.io/not-ready" || t.key == "node.kubernetes.io/unreachable");
    ready && !tainted
}

fn new_run_dir() -> Result<PathBuf> {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let root = std::env::var_os(RUN_ROOT_ENV).map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let name = format!(
        "ipwarden-e2e-{}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        jiff::Timestamp::now().as_millisecond()
    );
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).map_err(Error::io("creating run directory", &dir))?;
    Ok(dir)
}
