//! Real nodes: a real kubelet and container runtime (containerd, or CRI-O: [`Runtime`], both
//! with runc) on this machine, joined to the test cluster's control plane, running real
//! containers in real network namespaces through the chart's CNI chain (`ptp` + `portmap`,
//! `ipwarden-cni` as IPAM), so what a real runtime does (when it calls which CNI verb, what it
//! passes) is the runtime's own, not the harness's guess. kubelet, containerd and the CNI
//! plugins come from `e2e/cluster/build-node.sh`, CRI-O from `e2e/cluster/build-crio.sh`
//! (pinned Go modules, cached outside the repo), runc and conmon from Debian; the pause and
//! workload images are made locally (there is no registry). The agent of a real node runs on the host like the
//! simulated nodes' agents, or as the chart's pod ([`chart`]). docs/testing.md, "Real nodes",
//! says what the host needs.

pub mod chain_hold;
pub mod chart;
mod config;
pub mod cri_proxy;
pub mod host;
mod service;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_cri::v1::{ContainerFilter, ListContainersRequest, ListPodSandboxRequest, PodSandboxFilter, VersionRequest};
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::Api;

pub use config::{BUSYBOX_IMAGE, NODE_VIEW, NodePaths, PAUSE_IMAGE, Runtime};
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

/// libcni's cache directory (host-wide; neither runtime lets it move).
const CNI_CACHE: &str = "/var/lib/cni";

/// Where libcni caches each attachment's result (host-wide; containerd does not let it move).
const CNI_RESULT_CACHE: &str = "/var/lib/cni/results";

/// Environment variable naming a directory that already holds CRI-O's binaries (crio,
/// copyimg, pinns); skips `e2e/cluster/build-crio.sh`.
pub const CRIO_BIN_DIR_ENV: &str = "IPWARDEN_CRIO_BIN_DIR";

/// Where Debian installs runc.
const RUNC: &str = "/usr/sbin/runc";

/// Where Debian installs conmon, CRI-O's container monitor.
const CONMON: &str = "/usr/bin/conmon";

/// The images every node holds: archive name in the build's `images/`, image name.
const NODE_IMAGES: [(&str, &str); 2] = [("pause.tar", PAUSE_IMAGE), ("busybox.tar", BUSYBOX_IMAGE)];

/// How long the runtime may take to answer on its socket after its start.
const RUNTIME_READY_TIMEOUT: Duration = Duration::from_secs(60);

/// How long one readiness question to the runtime may take.
const VERSION_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a real node may take to register and turn Ready (11 s seen on this machine).
const NODE_READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The binaries and images of a real node.
#[derive(Clone, Debug)]
pub struct NodeBinaries {
    /// The directory holding kubelet, containerd, containerd-shim-runc-v2, ctr, the CNI
    /// plugins in `cni/` and the image archives in `images/`.
    pub dir: PathBuf,
    /// The directory holding CRI-O's crio, copyimg and pinns, when the nodes run CRI-O.
    pub crio: Option<PathBuf>,
}

impl NodeBinaries {
    /// Finds them for nodes running `runtime`: from [`NODE_BIN_DIR_ENV`] (and
    /// [`CRIO_BIN_DIR_ENV`]) when set, otherwise by running the build scripts, which return at
    /// once when the pinned build is already cached.
    pub fn locate(runtime: Runtime) -> Result<Self> {
        let dir = match std::env::var_os(NODE_BIN_DIR_ENV) {
            Some(dir) => PathBuf::from(dir),
            None => crate::binaries::run_build_script(
                &Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/build-node.sh"),
                "binary directory",
            )?,
        };
        let crio = match runtime {
            Runtime::Containerd => None,
            Runtime::Crio => Some(match std::env::var_os(CRIO_BIN_DIR_ENV) {
                Some(dir) => PathBuf::from(dir),
                None => crate::binaries::run_build_script(
                    &Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/build-crio.sh"),
                    "binary directory",
                )?,
            }),
        };
        let found = Self { dir, crio };
        for name in ["kubelet", "containerd", "containerd-shim-runc-v2", "ctr", "cni/ptp", "images/pause.tar"] {
            present(
                &found.dir.join(name),
                name,
                &format!("run e2e/cluster/build-node.sh or unset {NODE_BIN_DIR_ENV}"),
            )?;
        }
        if let Some(crio) = &found.crio {
            for name in ["crio", "copyimg", "pinns"] {
                present(&crio.join(name), name, &format!("run e2e/cluster/build-crio.sh or unset {CRIO_BIN_DIR_ENV}"))?;
            }
            present(Path::new(CONMON), "conmon", "install Debian's conmon (e2e/cluster/install-deps.sh)")?;
        }
        present(Path::new(RUNC), "runc", "install Debian's runc (e2e/cluster/install-deps.sh)")?;
        Ok(found)
    }

    /// CRI-O's binary `name`.
    fn crio(&self, name: &str) -> Result<PathBuf> {
        self.crio.as_ref().map(|dir| dir.join(name)).ok_or_else(|| Error::MissingBinary {
            what: name.to_string(),
            path: PathBuf::from(name),
            hint: "the real nodes' binaries were located for containerd only".to_string(),
        })
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
    /// The runtime every node runs.
    pub runtime: Runtime,
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
        runtime: Runtime,
    ) -> Result<Self> {
        let host = HostGuard::acquire()?;
        let (host, service) = (Arc::new(Mutex::new(host)), Arc::default());
        Ok(Self { binaries, kubeconfig, ca_cert, conflist, ipwarden, runtime, host, service })
    }
}

/// The file name of the node's conflist in its CNI configuration directory (the chart's
/// `cni.confFile`).
pub const CONFLIST: &str = "10-ipwarden.conflist";

/// The placeholder of the agent's socket in [`RealNodeContext::conflist`].
pub const AGENT_SOCKET_PLACEHOLDER: &str = "{AGENT_SOCKET}";

/// The placeholder of the node's index in [`RealNodeContext::conflist`] (another IPAM's
/// per-node range).
pub const NODE_INDEX_PLACEHOLDER: &str = "{NODE_INDEX}";

/// The placeholder of the node's directory in [`RealNodeContext::conflist`] (another IPAM's
/// per-node data).
pub const NODE_DIR_PLACEHOLDER: &str = "{NODE_DIR}";

/// One real node: its runtime and kubelet processes and its directory.
pub struct RealNode {
    name: String,
    index: usize,
    paths: NodePaths,
    context: RealNodeContext,
    runtime: Option<Component>,
    kubelet: Option<Component>,
    /// The images imported with [`RealNode::import_kept_image`]: on disk on a real machine, so
    /// imported again at [`RealNode::boot`].
    kept_images: Mutex<Vec<(PathBuf, String)>>,
    stopped: bool,
}

impl RealNode {
    /// Prepares node `index` named `name` in `dir` (conflist, plugins, configuration), starts
    /// its runtime, imports the images, starts kubelet. Does not wait for the Node: see
    /// [`RealNode::wait_registered`].
    pub async fn start(context: RealNodeContext, name: String, index: usize, dir: PathBuf) -> Result<Self> {
        let paths = NodePaths { dir, runtime: context.runtime };
        for dir in [paths.cni_conf_dir(), paths.cni_bin_dir(), paths.static_pods(), paths.kubelet_root()] {
            create_dir(&dir)?;
        }
        install_plugins(&context, &paths)?;
        let conflist = context
            .conflist
            .replace(AGENT_SOCKET_PLACEHOLDER, &paths.agent_socket().display().to_string())
            .replace(NODE_INDEX_PLACEHOLDER, &index.to_string())
            .replace(NODE_DIR_PLACEHOLDER, &paths.dir.display().to_string());
        write(&paths.cni_conf_dir().join(CONFLIST), &conflist)?;
        match paths.runtime {
            Runtime::Containerd => {
                create_dir(&paths.containerd_root())?;
                write(&paths.containerd_config(), &config::containerd_toml(&paths, Path::new(RUNC)))?;
            }
            Runtime::Crio => {
                for dir in [paths.crio_config_dir(), paths.crio_cni_cache(), paths.crio_dir().join("hooks.d")] {
                    create_dir(&dir)?;
                }
                let pinns = context.binaries.crio("pinns")?;
                write(&paths.crio_config(), &config::crio_conf(&paths, &pinns, Path::new(CONMON), Path::new(RUNC)))?;
                write(&paths.crio_policy(), config::CRIO_POLICY)?;
            }
        }
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
            &paths.runtime_marker(),
            &settings.cgroup_root,
        )?;
        // From here on, a failure drops the node, whose teardown undoes what was done.
        let mut node = Self {
            name,
            index,
            paths,
            context,
            runtime: None,
            kubelet: None,
            kept_images: Mutex::default(),
            stopped: false,
        };
        host::share_mounts_under(&node.paths.dir)?;
        if node.paths.runtime == Runtime::Crio {
            node.context.host.lock().map_err(|_| poisoned())?.mount_cgroup_v1_controllers(&["hugetlb"])?;
        }
        host::create_cgroups(&settings.cgroup_root)?;
        node.context.host.lock().map_err(|_| poisoned())?.add_node_ip(&host::node_ip(index))?;
        node.start_runtime().await?;
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
        let (runtime, kubelet) = (&mut self.runtime, &mut self.kubelet);
        wait::until(&what, NODE_READY_TIMEOUT, || {
            let running = ensure(runtime).and_then(|()| ensure(kubelet));
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

    /// Starts the node's runtime and waits until it answers a CRI `Version` call (CRI-O opens
    /// its socket before its start-up work: storage repair, restore, CNI GC). The runtime runs
    /// in the node's mount namespace ([`RealNode::node_namespace`]); CRI-O's also has the
    /// node's [`NodePaths::crio_cni_cache`] bound over `/var/lib/cni`.
    async fn start_runtime(&mut self) -> Result<()> {
        let (program, args, extra) = match self.paths.runtime {
            Runtime::Containerd => (
                self.context.binaries.path("containerd"),
                vec!["--config".to_string(), self.paths.containerd_config().display().to_string()],
                None,
            ),
            Runtime::Crio => {
                create_dir(Path::new(CNI_CACHE))?;
                let args = vec![
                    "--config".to_string(),
                    self.paths.crio_config().display().to_string(),
                    "--config-dir".to_string(),
                    self.paths.crio_config_dir().display().to_string(),
                ];
                (
                    self.context.binaries.crio("crio")?,
                    args,
                    Some((self.paths.crio_cni_cache(), PathBuf::from(CNI_CACHE))),
                )
            }
        };
        let (program, args) = self.node_namespace(&program, args, extra)?;
        let component = Component::start_with_env(
            &format!("{}-{}", self.paths.runtime.name(), self.name),
            &program,
            args,
            vec![("PATH".to_string(), path_with(&self.context.binaries.dir))],
            self.paths.runtime_log(),
        )?;
        self.runtime = Some(component);
        let socket = self.paths.runtime_socket();
        let runtime = &mut self.runtime;
        let what = format!("{} of {} answering", self.paths.runtime.name(), self.name);
        let client = cri_proxy::runtime_client(&socket)?;
        wait::until(&what, RUNTIME_READY_TIMEOUT, || {
            let running = ensure(runtime);
            let mut client = client.clone();
            let socket = socket.clone();
            async move {
                running?;
                let version = client.version(VersionRequest { version: "v1".to_string() });
                Ok(match tokio::time::timeout(VERSION_CALL_TIMEOUT, version).await {
                    Ok(Ok(_)) => Probe::Done(()),
                    Ok(Err(status)) => Probe::Pending(format!("{}: {status}", socket.display())),
                    Err(_) => Probe::Pending(format!("{}: no answer in {VERSION_CALL_TIMEOUT:?}", socket.display())),
                })
            }
        })
        .await
    }

    async fn import_images(&self) -> Result<()> {
        for (archive, name) in NODE_IMAGES {
            self.import_image(&self.context.binaries.path("images").join(archive), name).await?;
        }
        Ok(())
    }

    /// [`RealNode::import_image`], and again at every [`RealNode::boot`], as an image a real
    /// machine holds on disk survives its reboot.
    pub async fn import_kept_image(&self, archive: &Path, name: &str) -> Result<()> {
        self.import_image(archive, name).await?;
        self.kept_images.lock().map_err(|_| poisoned())?.push((archive.to_path_buf(), name.to_string()));
        Ok(())
    }

    /// Imports the OCI archive `archive` into the node's runtime: with `ctr` for containerd
    /// (which names the image from the archive's annotation), with CRI-O's image copier into
    /// its storage as image `name` for CRI-O.
    pub async fn import_image(&self, archive: &Path, name: &str) -> Result<()> {
        match self.paths.runtime {
            Runtime::Containerd => self.ctr(&["images", "import", &archive.display().to_string()]).await.map(drop),
            Runtime::Crio => {
                let crio = self.paths.crio_dir();
                let args = [
                    "--root".to_string(),
                    crio.join("root").display().to_string(),
                    "--runroot".to_string(),
                    crio.join("runroot").display().to_string(),
                    "--storage-driver".to_string(),
                    "overlay".to_string(),
                    "--signature-policy".to_string(),
                    self.paths.crio_policy().display().to_string(),
                    "--image-name".to_string(),
                    name.to_string(),
                    "--import-from".to_string(),
                    format!("oci-archive:{}", archive.display()),
                ];
                crate::process::run_tool(&self.context.binaries.crio("copyimg")?, &args, None).await.map(drop)
            }
        }
    }

    /// `program` with `args` as started in the node's own mount namespace, where the node's
    /// directory is bound at [`NODE_VIEW`] (and `extra`'s source at its target): kubelet
    /// and the runtime of every node see their own directory at that one path, which the
    /// chart's hostPaths name. The mount holding each target is made private there first (on a
    /// systemd host `/` is shared, and the bind would reach the host and the other nodes); the
    /// node directory's own mounts stay shared with the host, so kubelet, the runtime and the
    /// tests see each other's network namespaces, volumes and root filesystems.
    fn node_namespace(
        &self,
        program: &Path,
        args: Vec<String>,
        extra: Option<(PathBuf, PathBuf)>,
    ) -> Result<(PathBuf, Vec<String>)> {
        create_dir(Path::new(NODE_VIEW))?;
        let binds = [(self.paths.dir.clone(), PathBuf::from(NODE_VIEW))].into_iter().chain(extra);
        let mut command: Vec<String> =
            ["--mount", "--propagation", "unchanged", "--", "sh", "-ec"].map(String::from).to_vec();
        command.push(
            "while [ \"$1\" != -- ]; do mount --make-private \"$(findmnt -no TARGET -T \"$2\")\"; \
             mount --rbind \"$1\" \"$2\"; shift 2; done; shift; exec \"$@\""
                .to_string(),
        );
        command.push("node-namespace".to_string());
        for (source, target) in binds {
            command.extend([source.display().to_string(), target.display().to_string()]);
        }
        command.push("--".to_string());
        command.push(program.display().to_string());
        command.extend(args);
        Ok((PathBuf::from("unshare"), command))
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
        let (program, args) = self.node_namespace(&self.context.binaries.path("kubelet"), args, None)?;
        let component = Component::start_with_env(
            &format!("kubelet-{}", self.name),
            &program,
            args,
            vec![("PATH".to_string(), path_with(&self.context.binaries.dir))],
            self.paths.dir.join("kubelet.log"),
        )?;
        self.kubelet = Some(component);
        Ok(())
    }

    /// The IDs of the sandboxes the node's runtime holds, in any state, of pod `pod` only when
    /// given: what kubelet sees over CRI, from either runtime.
    pub async fn sandboxes(&self, pod: Option<&str>) -> Result<BTreeSet<String>> {
        let filter = pod.map(|name| PodSandboxFilter { label_selector: pod_label(name), ..Default::default() });
        let request = ListPodSandboxRequest { filter };
        let listed = cri_proxy::runtime_client(&self.paths.runtime_socket())?
            .list_pod_sandbox(request)
            .await
            .map_err(|e| self.cri_failed("ListPodSandbox", e))?;
        Ok(listed.into_inner().items.into_iter().map(|s| s.id).collect())
    }

    /// The IDs of pod `pod`'s sandboxes and containers, in any state, that the node's runtime
    /// holds: empty once kubelet has removed the pod from the runtime.
    pub async fn pod_containers(&self, pod: &str) -> Result<BTreeSet<String>> {
        let filter = ContainerFilter { label_selector: pod_label(pod), ..Default::default() };
        let listed = cri_proxy::runtime_client(&self.paths.runtime_socket())?
            .list_containers(ListContainersRequest { filter: Some(filter) })
            .await
            .map_err(|e| self.cri_failed("ListContainers", e))?;
        let mut ids: BTreeSet<String> = listed.into_inner().containers.into_iter().map(|c| c.id).collect();
        ids.extend(self.sandboxes(Some(pod)).await?);
        Ok(ids)
    }

    fn cri_failed(&self, call: &str, status: tonic::Status) -> Error {
        Error::Tool {
            command: format!("CRI {call} on {}", self.paths.runtime_socket().display()),
            reason: status.to_string(),
        }
    }

    /// Runs `ctr` against this node's containerd in the `k8s.io` namespace (kubelet's); fails
    /// on a node running another runtime.
    pub async fn ctr(&self, args: &[&str]) -> Result<String> {
        if self.paths.runtime != Runtime::Containerd {
            return Err(Error::Tool {
                command: format!("ctr {}", args.join(" ")),
                reason: format!("{} runs {}, not containerd", self.name, self.paths.runtime.name()),
            });
        }
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

    /// Stops the runtime (SIGTERM): its containers keep running under their shims (conmons).
    pub fn stop_runtime(&mut self) {
        if let Some(runtime) = self.runtime.as_mut() {
            runtime.stop();
        }
    }

    /// Kills the runtime (SIGKILL): its containers keep running under their shims (conmons).
    pub fn kill_runtime(&mut self) {
        if let Some(runtime) = self.runtime.as_mut() {
            runtime.kill();
        }
    }

    /// Freezes the runtime (SIGSTOP): its socket stays, and every call on it hangs, as a
    /// runtime stuck under load. Its containers keep running.
    pub fn freeze_runtime(&self) {
        if let Some(runtime) = self.runtime.as_ref() {
            runtime.pause();
        }
    }

    /// Lets the runtime run again after [`RealNode::freeze_runtime`] (SIGCONT).
    pub fn thaw_runtime(&self) {
        if let Some(runtime) = self.runtime.as_ref() {
            runtime.resume();
        }
    }

    /// Starts the runtime again and waits until it answers.
    pub async fn restart_runtime(&mut self) -> Result<()> {
        if let Some(runtime) = self.runtime.as_mut() {
            runtime.stop();
        }
        self.start_runtime().await
    }

    /// Kills every container of this node and their shims (conmons), as a machine's power
    /// loss does.
    pub fn kill_containers(&self) {
        host::remove_cgroups(&cgroup_root(&self.name));
        host::kill_monitors_of(self.paths.runtime, &self.paths.runtime_marker());
    }

    /// Kills pod `uid`'s containers and their shim or conmon (everything in its cgroup, in each
    /// QoS class kubelet may have put it), as a crash of that pod's processes does.
    pub fn kill_pod(&self, uid: &str) {
        for qos in ["kubepods/besteffort", "kubepods/burstable", "kubepods"] {
            host::remove_cgroups(&format!("{}/{qos}/pod{uid}", cgroup_root(&self.name)));
        }
    }

    /// CRI-O only, with CRI-O stopped: removes sandbox `id`'s spec from CRI-O's storage
    /// (`overlay-containers/<id>/userdata/config.json`, what `LoadSandbox` reads at its start),
    /// so the next CRI-O cannot restore the sandbox, as when a disk fault loses its state.
    pub fn forget_sandbox(&self, id: &str) -> Result<()> {
        if self.paths.runtime != Runtime::Crio {
            return Err(Error::Tool {
                command: format!("forgetting sandbox {id}"),
                reason: format!("{} runs {}, not CRI-O", self.name, self.paths.runtime.name()),
            });
        }
        let spec = self.paths.crio_dir().join("root/overlay-containers").join(id).join("userdata/config.json");
        std::fs::remove_file(&spec).map_err(Error::io("removing a CRI-O sandbox's spec", &spec))
    }

    /// A node's "reboot" of its runtime state: kubelet and the runtime killed, every container
    /// killed, the network namespaces, the runtime's state ([`NodePaths::wiped_at_power_off`])
    /// and kubelet's pod directories wiped. The node directory's agent checkpoint is kept (and
    /// a CRI-O node's CNI result cache, on disk in /var/lib/cni on a real machine). Start the
    /// node again with [`RealNode::boot`].
    pub fn power_off(&mut self) {
        self.kill_kubelet();
        self.kill_runtime();
        self.kill_containers();
        host::unmount_under(&self.paths.runtime_dir());
        host::unmount_under(&self.paths.kubelet_root());
        for dir in self.paths.wiped_at_power_off().iter().chain([&self.paths.kubelet_root()]) {
            let _gone = std::fs::remove_dir_all(dir);
        }
    }

    /// Starts the runtime, the images and kubelet again after [`RealNode::power_off`].
    pub async fn boot(&mut self) -> Result<()> {
        create_dir(&self.paths.kubelet_root())?;
        if self.paths.runtime == Runtime::Containerd {
            create_dir(&self.paths.containerd_root())?;
        }
        host::create_cgroups(&cgroup_root(&self.name))?;
        self.start_runtime().await?;
        self.import_images().await?;
        let kept = self.kept_images.lock().map_err(|_| poisoned())?.clone();
        for (archive, name) in kept {
            self.import_image(&archive, &name).await?;
        }
        match self.kubelet.as_mut() {
            Some(kubelet) => kubelet.restart(),
            None => self.start_kubelet(),
        }
    }

    /// The IPv4 addresses of `eth0` in every network namespace of the node's runtime, one per
    /// namespace that has one: the IPs its pods really have (an IP in two namespaces shows
    /// twice).
    pub fn netns_ips(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(self.paths.netns_dir()) else { return Vec::new() };
        entries.flatten().filter_map(|entry| eth0_ipv4(&entry.path())).collect()
    }

    /// The component logs, for failure messages.
    pub fn logs(&self) -> Vec<PathBuf> {
        vec![self.paths.dir.join("kubelet.log"), self.paths.runtime_log()]
    }

    /// Stops kubelet and the runtime, kills every container, unmounts and removes what the node
    /// made outside its directory (cgroups); the host-wide changes are put back when the last
    /// node of the set is gone.
    pub fn stop(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        self.stop_kubelet();
        self.kill_containers();
        self.stop_runtime();
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

/// The IPv4 address of `eth0` in network namespace `netns`, if it has one.
fn eth0_ipv4(netns: &Path) -> Option<String> {
    let output = std::process::Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .args(["ip", "-o", "-4", "addr", "show", "dev", "eth0"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let word = text.split_whitespace().skip_while(|w| *w != "inet").nth(1)?;
    Some(word.split('/').next()?.to_string())
}

/// The CRI label selector of pod `name`'s sandboxes and containers (kubelet's label).
fn pod_label(name: &str) -> std::collections::HashMap<String, String> {
    [("io.kubernetes.pod.name".to_string(), name.to_string())].into()
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
    // Debian's, the node benchmark's floor (nodebench).
    link(&crate::binaries::standard_cni_plugins()?.join("host-local"), &bin.join("host-local"))?;
    link(&context.ipwarden, &bin.join("ipwarden-cni"))
}

fn link(target: &Path, link: &Path) -> Result<()> {
    let _absent = std::fs::remove_file(link);
    std::os::unix::fs::symlink(target, link).map_err(Error::io(format!("linking {}", target.display()), link))
}

fn create_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(Error::io("creating a real node directory", dir))
}

/// Fails naming `what` and `hint` when `path` is not a file.
fn present(path: &Path, what: &str, hint: &str) -> Result<()> {
    match path.is_file() {
        true => Ok(()),
        false => Err(Error::MissingBinary { what: what.to_string(), path: path.to_path_buf(), hint: hint.to_string() }),
    }
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

/// `PATH` with `dir` first (containerd finds its shim there, the shim finds runc in /usr/sbin;
/// CRI-O finds conmon and runc in /usr/bin and /usr/sbin from its configuration).
fn path_with(dir: &Path) -> String {
    let rest = std::env::var("PATH").unwrap_or_default();
    format!("{}:/usr/sbin:/usr/bin:/sbin:/bin:{rest}", dir.display())
}
