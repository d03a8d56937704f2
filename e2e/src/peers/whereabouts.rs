//! Whereabouts on a test cluster, built from its pinned Go module by
//! `e2e/cluster/build-whereabouts.sh`: its CNI IPAM plugin called by the simulated kubelet, its
//! CRDs and a NetworkAttachmentDefinition, and per node the ip-control-loop and reconciler
//! (`whereabouts-controller`, run with a kubeconfig instead of in-cluster configuration).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::{Value, json};

use crate::cluster::Cluster;
use crate::cni::{CniNetwork, NodeInfo};
use crate::error::{Error, Result};
use crate::process::Component;
use crate::wait::{self, Probe};

/// The namespace of the NetworkAttachmentDefinition and of the pods.
const NAMESPACE: &str = "default";

/// The NetworkAttachmentDefinition's (and network's) name.
pub const NETWORK: &str = "whereabouts";

/// The range Whereabouts allocates from: ipwarden's default pool's CIDR, for a like-for-like
/// comparison.
pub const RANGE: &str = "10.244.0.0/16";

/// How often each node's reconciler runs: once a minute, the finest schedule Whereabouts' cron
/// expression (minutes, no seconds) can give it.
pub const RECONCILE_INTERVAL: Duration = Duration::from_secs(60);

/// The CRDs `crds.yaml` holds.
const CRD_NAMES: [&str; 4] = [
    "ippools.whereabouts.cni.cncf.io",
    "nodeslicepools.whereabouts.cni.cncf.io",
    "overlappingrangeipreservations.whereabouts.cni.cncf.io",
    "network-attachment-definitions.k8s.cni.cncf.io",
];

/// What `whereabouts-controller` prints once its caches are synced.
const READY_LINE: &str = "whereabouts-controller: caches synced";

/// How long the CRDs and controllers may take to be ready.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The directory of the built plugin, controller and CRDs, built on first use and then
/// returned at once from the cache.
pub fn build() -> Result<PathBuf> {
    crate::binaries::run_build_script(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/build-whereabouts.sh"),
        "build directory",
    )
}

/// The kubeconfig Whereabouts' plugin reads, known once the cluster has started (before any
/// pod is created).
pub type KubeconfigSlot = Arc<OnceLock<PathBuf>>;

/// The file name of the node's flat configuration file, which Whereabouts' plugin refuses to
/// run without (its DaemonSet writes it on each host; here it is in the node's directory).
const FLAT_FILE: &str = "whereabouts.conf";

/// The Whereabouts IPAM configuration: the whole [`RANGE`], the cluster through `kubeconfig`,
/// logging errors only.
fn ipam(kubeconfig: &Path) -> Value {
    json!({"type": "whereabouts", "range": RANGE, "kubernetes": {"kubeconfig": kubeconfig}, "log_level": "error"})
}

/// The netconf of a node: [`ipam`] with its flat file and log in the node's directory.
fn netconf(node: &NodeInfo, kubeconfig: &Path) -> Value {
    let mut ipam = ipam(kubeconfig);
    ipam["configuration_path"] = json!(node.dir.join(FLAT_FILE));
    ipam["log_file"] = json!(node.dir.join("whereabouts.log"));
    json!({"cniVersion": "1.0.0", "name": NETWORK, "type": "whereabouts", "ipam": ipam})
}

/// A CNI network whose plugin is Whereabouts' `whereabouts` binary from `build_dir`, called
/// directly as the IPAM (as host-local is in [`CniNetwork::host_local`]), with pods'
/// network-status annotations naming the NetworkAttachmentDefinition, as Multus writes them.
pub fn network(build_dir: &Path, kubeconfig: KubeconfigSlot) -> CniNetwork {
    CniNetwork {
        plugin_dirs: vec![build_dir.to_path_buf()],
        netconf: Arc::new(move |node| netconf(node, kubeconfig.get().map_or(Path::new(""), PathBuf::as_path))),
        gc_interval: None,
        network_status: Some(format!("{NAMESPACE}/{NETWORK}")),
    }
}

/// Whereabouts running on a test cluster: one `whereabouts-controller` per node, as its
/// DaemonSet runs. Dropping it stops them.
pub struct Installation {
    /// `(name, process)` per node, in node order.
    pub controllers: Vec<(String, Component)>,
}

/// Installs Whereabouts on `cluster` (whose network is [`network`] with the cluster's
/// kubeconfig in its slot): the CRDs, the NetworkAttachmentDefinition, each node's flat file,
/// and a controller per node, each waited on until its caches are synced.
pub async fn install(cluster: &Cluster, build_dir: &Path) -> Result<Installation> {
    cluster.apply_crds(&build_dir.join("crds.yaml"), &CRD_NAMES, READY_TIMEOUT).await?;
    let nad = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("k8s.cni.cncf.io", "v1", "NetworkAttachmentDefinition"),
        "network-attachment-definitions",
    );
    let api: Api<DynamicObject> = Api::namespaced_with(cluster.client(), NAMESPACE, &nad);
    let mut object = DynamicObject::new(NETWORK, &nad).within(NAMESPACE);
    let config =
        json!({"cniVersion": "1.0.0", "name": NETWORK, "type": "whereabouts", "ipam": ipam(cluster.kubeconfig())});
    object.data = json!({"spec": {"config": config.to_string()}});
    api.create(&PostParams::default(), &object)
        .await
        .map_err(Error::kube(format!("creating NetworkAttachmentDefinition {NAMESPACE}/{NETWORK}")))?;
    let mut installation = Installation { controllers: Vec::new() };
    for node in cluster.nodes() {
        let flat = node.dir().join(FLAT_FILE);
        let contents = json!({"datastore": "kubernetes", "kubernetes": {"kubeconfig": cluster.kubeconfig()}});
        std::fs::write(&flat, contents.to_string()).map_err(Error::io("writing Whereabouts' flat file", &flat))?;
        let name = format!("whereabouts-controller {}", node.name());
        let args = vec![
            format!("--kubeconfig={}", cluster.kubeconfig().display()),
            format!("--node-name={}", node.name()),
            format!("--reconcile-interval={}s", RECONCILE_INTERVAL.as_secs()),
        ];
        let log = node.dir().join("whereabouts-controller.log");
        let mut component = Component::start(&name, &build_dir.join("whereabouts-controller"), args, log)?;
        wait_synced(&mut component).await?;
        installation.controllers.push((name, component));
    }
    Ok(installation)
}

/// Waits until `component` has logged [`READY_LINE`], failing at once if it exits.
async fn wait_synced(component: &mut Component) -> Result<()> {
    let what = format!("{} synced (log {})", component.name(), component.log().display());
    wait::until(&what, READY_TIMEOUT, || {
        let running = component.ensure_running();
        let log = component.log().to_path_buf();
        async move {
            running?;
            let text = std::fs::read_to_string(&log).map_err(Error::io("reading the controller's log", &log))?;
            Ok(if text.contains(READY_LINE) { Probe::Done(()) } else { Probe::Pending("caches not synced".into()) })
        }
    })
    .await
}
