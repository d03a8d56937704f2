//! Real nodes: a real kubelet and containerd (with runc) on this machine, joined to the test
//! cluster's control plane, running real containers in real network namespaces through the
//! chart's CNI chain (`ptp` + `portmap`, `ipwarden-cni` as IPAM), so what a real runtime does
//! (when it calls which CNI verb, what it passes) is the runtime's own, not the harness's
//! guess. kubelet, containerd and the CNI plugins come from `e2e/cluster/build-node.sh` (pinned
//! Go modules, cached outside the repo), runc from Debian; the pause and workload images are
//! made locally (there is no registry). The agent of a real node runs on the host like the
//! simulated nodes' agents, or as the chart's pod ([`chart`]). docs/testing.md, "Real nodes",
//! says what the host needs.

pub mod chain_hold;
pub mod chart;
mod config;
pub mod cri_proxy;
pub mod host;
mod service;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::Api;

pub use config::{BUSYBOX_IMAGE, NodePaths, PAUSE_IMAGE};
use host::HostGuard;

use crate::error::{Error, Result};
use crate::process::Component;
use crate::wait::{self, Probe};

/// Environment variable naming a directory that already holds the real node's binaries
/// (kubelet, containerd, containerd-shim-runc-v2, ctr, cni/, images/); skips the build script.
pub const NODE_BIN_DIR_ENV: &str = "IPWARDEN_NODE_BIN_DIR";

/// The label every real node carries, and the key of its `NoSchedule` taint: a pod runs there
/// only when it tolerates it (it must use the node's local images; the simulated nodes' pods
/// name images no registry serves).
pub const REAL_NODE_LABEL: &str = "e2e.ipwarden.io/real";

/// The spec of a pod of the workload image on the real nodes: the real nodes' toleration and
/// node selector, and one container of [`BUSYBOX_IMAGE`] (never pulled) sleeping for an hour
/// (as PID 1 without a handler it ignores SIGTERM, so a deletion ends it after the 1 s grace).
/// Its service-account token is mounted, as users' pods have it.
pub fn workload_spec() -> serde_json::Value {
    serde_json::json!({
        "nodeSelector": {REAL_NODE_LABEL: "true"},
        "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                        "command": ["/bin/sleep", "3600"]}],
    })
}

/// Where kubelet links every container's log (host-wide; its links into a node's directory
/// go with the node).
const CONTAINER_LOG_LINKS: &str = "/var/log/containers";

/// Where libcni caches each attachment's result (host-wide; containerd does not let it move).
const CNI_RESULT_CACHE: &str = "/var/lib/cni/results";

/// Where Debian installs runc.
const RUNC: &str = "/usr/sbin/runc";

/// How long containerd may take to answer on its socket after its start.
const CONTAINERD_READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a real node may take to register and turn Ready (11 s seen on this machine).
const NODE_READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The binaries and images of a real node.
#[derive(Clone, Debug)]
pub struct NodeBinaries {
    /// The directory holding kubelet, containerd, containerd-shim-runc-v2, ctr, the CNI
    /// plugins in `cni/` and the image archives in `images/`.
    pub dir: PathBuf,
}

impl NodeBinaries {
    /// Finds them: from [`NODE_BIN_DIR_ENV`] when set, otherwise by running the build script,
    /// which returns at once when the pinned build is already cached.
    pub fn locate() -> Result<Self> {
        let dir = match std::env::var_os(NODE_BIN_DIR_ENV) {
            Some(dir) => PathBuf::from(dir),
            None => crate::binaries::run_build_script(
                &Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/build-node.sh"),
                "binary directory",
            )?,
        };
        let found = Self { dir };
        for name in ["kubelet", "containerd", "containerd-shim-runc-v2", "ctr", "cni/ptp", "images/pause.tar"] {
            let path = found.dir.join(name);
            if !path.is_file() {
                return Err(Error::MissingBinary {
                    what: name.to_string(),
                    path,
                    hint: format!("run e2e/cluster/build-node.sh or unset {NODE_BIN_DIR_ENV}"),
                });
            }
        }
        if !Path::new(RUNC).is_file() {
            return Err(Error::MissingBinary {
                what: "runc".to_string(),
                path: PathBuf::from(RUNC),
                hint: "install Debian's runc (e2e/cluster/install-deps.sh)".to_string(),
            });
        }
        Ok(found)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// What a set of real nodes shares: the binaries, the cluster's kubeconfig and CA, the host
/// guard (dropped, so the host put back, with the last node).
#[derive(Clone)]
pub struct RealNodeContext {
    /// The binaries and images.
    pub binaries: NodeBinaries,
    /// The kubeconfig kubelet talks to the apiserver with.
    pub kubeconfig: PathBuf,
    /// The cluster CA certificate.
    pub ca_cert: PathBuf,
    /// The CNI conflist every node's containerd reads, with `{AGENT_SOCKET}` where the agent's
    /// socket goes (the chart's, rendered by helm).
    pub conflist: String,
    /// The ipwarden binary, installed as `ipwarden-cni` in every node's CNI plugin directory.
    pub ipwarden: PathBuf,
    host: Arc<Mutex<HostGuard>>,
    /// The `kubernetes` Service for the nodes' pods, once a chart install started it; it lives
    /// as long as the nodes.
    service: Arc<Mutex<Option<service::KubernetesService>>>,
}

impl RealNodeContext {
    /// Takes the machine's real-node lock (waiting for another run's real nodes) and records
    /// the host state to put back.
    pub fn new(
        binaries: NodeBinaries,
        kubeconfig: PathBuf,
        ca_cert: PathBuf,
        conflist: String,
        ipwarden: PathBuf,
    ) -> Result<Self> {
        let host = HostGuard::acquire()?;
        let (host, service) = (Arc::new(Mutex::new(host)), Arc::default());
        Ok(Self { binaries, kubeconfig, ca_cert, conflist, ipwarden, host, service })
    }
}

/// The placeholder of the agent's socket in [`RealNodeContext::conflist`].
pub const AGENT_SOCKET_PLACEHOLDER: &str = "{AGENT_SOCKET}";

/// One real node: its containerd and kubelet processes and its directory.
pub struct RealNode {
    name: String,
    index: usize,
    paths: NodePaths,
    context: RealNodeContext,
    containerd: Option<Component>,
    kubelet: Option<Component>,
    stopped: bool,
}

impl RealNode {
    /// Prepares node `index` named `name` in `dir` (conflist, plugins, configuration), starts
    /// containerd, imports the images, starts kubelet. Does not wait for the Node: see
    /// [`RealNode::wait_registered`].
    pub async fn start(context: RealNodeContext, name: String, index: usize, dir: PathBuf) -> Result<Self> {
        let paths = NodePaths { dir };
        for dir in [
            paths.cni_conf_dir(),
            paths.cni_bin_dir(),
            paths.static_pods(),
            paths.kubelet_root(),
            paths.containerd_root(),
        ] {
            std::fs::create_dir_all(&dir).map_err(Error::io("creating a real node directory", &dir))?;
        }
        install_plugins(&context, &paths)?;
        let conflist = context.conflist.replace(AGENT_SOCKET_PLACEHOLDER, &paths.agent_socket().display().to_string());
        write(&paths.cni_conf_dir().join("10-ipwarden.conflist"), &conflist)?;
        write(&paths.containerd_config(), &config::containerd_toml(&paths, Path::new(RUNC)))?;
        let settings = config::KubeletSettings {
            port: crate::process::free_port()?,
            healthz_port: crate::process::free_port()?,
            cgroup_root: cgroup_root(&name),
            client_ca: context.ca_cert.clone(),
        };
        let kubelet_config = config::kubelet_config(&paths, &settings);
        write(&paths.kubelet_config(), &kubelet_config.to_string())?;
        context.host.lock().map_err(|_| poisoned())?.add_node(
            &paths.dir,
            &paths.containerd_socket(),
            &settings.cgroup_root,
        )?;
        // From here on, a failure drops the node, whose teardown undoes what was done.
        let mut node = Self { name, index, paths, context, containerd: None, kubelet: None, stopped: false };
        host::share_mounts_under(&node.paths.dir)?;
        host::create_cgroups(&settings.cgroup_root)?;
        node.context.host.lock().map_err(|_| poisoned())?.add_node_ip(&host::node_ip(index))?;
        node.start_containerd().await?;
        node.import_images().await?;
        node.start_kubelet()?;
        Ok(node)
    }

    /// The Node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node's directory (the agent's socket and checkpoint go there).
    pub fn dir(&self) -> &Path {
        &self.paths.dir
    }

    /// The node's paths.
    pub fn paths(&self) -> &NodePaths {
        &self.paths
    }

    /// Waits until the Node is registered, and also Ready and schedulable when `ready`: a
    /// real node turns Ready only once its network plugin answers STATUS, so only after its
    /// agent serves.
    pub async fn wait_registered(&mut self, client: &Client, ready: bool) -> Result<()> {
        let nodes: Api<Node> = Api::all(client.clone());
        let name = self.name.clone();
        let what = if ready { format!("real node {name} Ready") } else { format!("real node {name} registered") };
        let (containerd, kubelet) = (&mut self.containerd, &mut self.kubelet);
        wait::until(&what, NODE_READY_TIMEOUT, || {
            let running = ensure(containerd).and_then(|()| ensure(kubelet));
            let nodes = nodes.clone();
            let name = name.clone();
            async move {
                running?;
                Ok(match nodes.get_opt(&name).await.map_err(Error::kube(format!("reading Node {name}")))? {
                    Some(node) if !ready || crate::cluster::node_schedulable(&node) => Probe::Done(()),
                    Some(node) => Probe::Pending(format!("not Ready: {}", ready_message(&node))),
                    None => Probe::Pending("not registered".to_string()),
                })
            }
        })
        .await
    }

    async fn start_containerd(&mut self) -> Result<()> {
        let args = vec!["--config".to_string(), self.paths.containerd_config().display().to_string()];
        let log = self.paths.dir.join("containerd.log");
        let component = Component::start_with_env(
            &format!("containerd-{}", self.name),
            &self.context.binaries.path("containerd"),
            args,
            vec![("PATH".to_string(), path_with(&self.context.binaries.dir))],
            log,
        )?;
        self.containerd = Some(component);
        let socket = self.paths.containerd_socket();
        let containerd = &mut self.containerd;
        let ctr = self.context.binaries.path("ctr");
        wait::until(&format!("containerd of {} answering", self.name), CONTAINERD_READY_TIMEOUT, || {
            let running = ensure(containerd);
            let ctr = ctr.clone();
            let socket = socket.clone();
            async move {
                running?;
                let args = ["--address".to_string(), socket.display().to_string(), "version".to_string()];
                Ok(match wait::quietly(crate::process::run_tool(&ctr, &args, None)).await {
                    Ok(_) => Probe::Done(()),
                    Err(e) => Probe::Pending(e.to_string()),
                })
            }
        })
        .await
    }

    async fn import_images(&self) -> Result<()> {
        for archive in ["pause.tar", "busybox.tar"] {
            self.ctr(&["images", "import", &self.context.binaries.path("images").join(archive).display().to_string()])
                .await?;
        }
        Ok(())
    }

    fn start_kubelet(&mut self) -> Result<()> {
        let args = vec![
            format!("--config={}", self.paths.kubelet_config().display()),
            format!("--kubeconfig={}", self.context.kubeconfig.display()),
            format!("--root-dir={}", self.paths.kubelet_root().display()),
            format!("--cert-dir={}", self.paths.kubelet_root().join("pki").display()),
            format!("--hostname-override={}", self.name),
            format!("--node-ip={}", host::node_ip(self.index)),
            format!("--node-labels={REAL_NODE_LABEL}=true"),
            format!("--register-with-taints={REAL_NODE_LABEL}=true:NoSchedule"),
            "--v=2".to_string(),
        ];
        let component = Component::start_with_env(
            &format!("kubelet-{}", self.name),
            &self.context.binaries.path("kubelet"),
            args,
            vec![("PATH".to_string(), path_with(&self.context.binaries.dir))],
            self.paths.dir.join("kubelet.log"),
        )?;
        self.kubelet = Some(component);
        Ok(())
    }

    /// Runs `ctr` against this node's containerd in the `k8s.io` namespace (kubelet's).
    pub async fn ctr(&self, args: &[&str]) -> Result<String> {
        let mut full = vec![
            "--address".to_string(),
            self.paths.containerd_socket().display().to_string(),
            "--namespace".to_string(),
            "k8s.io".to_string(),
        ];
        full.extend(args.iter().map(|a| a.to_string()));
        crate::process::run_tool(&self.context.binaries.path("ctr"), &full, None).await
    }

    /// Stops kubelet (SIGTERM), as a node's service manager does on a restart.
    pub fn stop_kubelet(&mut self) {
        if let Some(kubelet) = self.kubelet.as_mut() {
            kubelet.stop();
        }
    }

    /// Starts kubelet again after [`RealNode::stop_kubelet`] or [`RealNode::kill_kubelet`].
    pub fn restart_kubelet(&mut self) -> Result<()> {
        match self.kubelet.as_mut() {
            Some(kubelet) => kubelet.restart(),
            None => self.start_kubelet(),
        }
    }

    /// Kills kubelet (SIGKILL).
    pub fn kill_kubelet(&mut self) {
        if let Some(kubelet) = self.kubelet.as_mut() {
            kubelet.kill();
        }
    }

    /// Stops containerd (SIGTERM): its containers keep running under their shims.
    pub fn stop_containerd(&mut self) {
        if let Some(containerd) = self.containerd.as_mut() {
            containerd.stop();
        }
    }

    /// Kills containerd (SIGKILL): its containers keep running under their shims.
    pub fn kill_containerd(&mut self) {
        if let Some(containerd) = self.containerd.as_mut() {
            containerd.kill();
        }
    }

    /// Freezes containerd (SIGSTOP): its socket stays, and every call on it hangs, as a runtime
    /// stuck under load. Its containers keep running.
    pub fn freeze_containerd(&self) {
        if let Some(containerd) = self.containerd.as_ref() {
            containerd.pause();
        }
    }

    /// Lets containerd run again after [`RealNode::freeze_containerd`] (SIGCONT).
    pub fn thaw_containerd(&self) {
        if let Some(containerd) = self.containerd.as_ref() {
            containerd.resume();
        }
    }

    /// Starts containerd again and waits until it answers.
    pub async fn restart_containerd(&mut self) -> Result<()> {
        if let Some(containerd) = self.containerd.as_mut() {
            containerd.stop();
        }
        self.start_containerd().await
    }

    /// Kills every container of this node and their shims, as a machine's power loss does.
    pub fn kill_containers(&self) {
        host::remove_cgroups(&cgroup_root(&self.name));
        host::kill_shims_of(&self.paths.containerd_socket().display().to_string());
    }

    /// A node's "reboot" of its runtime state: kubelet and containerd killed, every container
    /// killed, the network namespaces, containerd's state and root (sandboxes, containers; the
    /// images are imported again) and kubelet's pod directories wiped. The node directory's
    /// agent checkpoint is kept. Start the node again with [`RealNode::boot`].
    pub fn power_off(&mut self) {
        self.kill_kubelet();
        self.kill_containerd();
        self.kill_containers();
        host::unmount_under(&self.paths.dir.join("containerd"));
        host::unmount_under(&self.paths.kubelet_root());
        for dir in [self.paths.containerd_state(), self.paths.containerd_root(), self.paths.kubelet_root()] {
            let _gone = std::fs::remove_dir_all(&dir);
        }
    }

    /// Starts containerd, the images and kubelet again after [`RealNode::power_off`].
    pub async fn boot(&mut self) -> Result<()> {
        for dir in [self.paths.kubelet_root(), self.paths.containerd_root()] {
            std::fs::create_dir_all(&dir).map_err(Error::io("creating a real node directory", &dir))?;
        }
        host::create_cgroups(&cgroup_root(&self.name))?;
        self.start_containerd().await?;
        self.import_images().await?;
        match self.kubelet.as_mut() {
            Some(kubelet) => kubelet.restart(),
            None => self.start_kubelet(),
        }
    }

    /// The component logs, for failure messages.
    pub fn logs(&self) -> Vec<PathBuf> {
        vec![self.paths.dir.join("kubelet.log"), self.paths.dir.join("containerd.log")]
    }

    /// Stops kubelet and containerd, kills every container, unmounts and removes what the node
    /// made outside its directory (cgroups); the host-wide changes are put back when the last
    /// node of the set is gone.
    pub fn stop(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        self.stop_kubelet();
        self.kill_containers();
        self.stop_containerd();
        self.kill_containers();
        host::unmount_under(&self.paths.dir);
        host::remove_links_into(Path::new(CONTAINER_LOG_LINKS), &self.paths.dir);
        host::remove_files_naming(Path::new(CNI_RESULT_CACHE), &self.paths.dir);
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The message of the Node's Ready condition (why it is not Ready).
fn ready_message(node: &Node) -> String {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .map(|c| format!("{} {}", c.status, c.message.clone().unwrap_or_default()))
        .unwrap_or_else(|| "no Ready condition".to_string())
}

/// The cgroup under which node `name`'s kubelet puts its pods.
fn cgroup_root(name: &str) -> String {
    format!("/ipwarden-e2e-{name}")
}

fn install_plugins(context: &RealNodeContext, paths: &NodePaths) -> Result<()> {
    let bin = paths.cni_bin_dir();
    for plugin in ["ptp", "bridge", "portmap", "loopback"] {
        link(&context.binaries.path("cni").join(plugin), &bin.join(plugin))?;
    }
    link(&context.ipwarden, &bin.join("ipwarden-cni"))
}

fn link(target: &Path, link: &Path) -> Result<()> {
    let _absent = std::fs::remove_file(link);
    std::os::unix::fs::symlink(target, link).map_err(Error::io(format!("linking {}", target.display()), link))
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(Error::io("writing a real node's configuration", path))
}

fn ensure(component: &mut Option<Component>) -> Result<()> {
    component.as_mut().map_or(Ok(()), Component::ensure_running)
}

fn poisoned() -> Error {
    Error::Tool { command: "real node host guard".to_string(), reason: "a thread panicked holding it".to_string() }
}

/// `PATH` with `dir` first (containerd finds its shim there, the shim finds runc in /usr/sbin).
fn path_with(dir: &Path) -> String {
    let rest = std::env::var("PATH").unwrap_or_default();
    format!("{}:/usr/sbin:/usr/bin:/sbin:/bin:{rest}", dir.display())
}
