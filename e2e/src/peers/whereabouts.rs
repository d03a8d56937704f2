//! Whereabouts on a test cluster, built from its pinned Go module by
//! `e2e/cluster/build-whereabouts.sh`: its CNI IPAM plugin called by the simulated kubelet, its
//! CRDs and a NetworkAttachmentDefinition, and per node the ip-control-loop and reconciler
//! (`whereabouts-controller`, run with a kubeconfig instead of in-cluster configuration).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::{Value, json};

use crate::cluster::Cluster;
use crate::cni::{CniNetwork, NodeInfo};
use crate::error::{Error, Result};
use crate::process::Component;
use crate::wait::{self, Probe};

/// The NetworkAttachmentDefinition's (and network's) name.
pub const NETWORK: &str = "whereabouts";

/// The range Whereabouts allocates from in the churn: ipwarden's default pool's CIDR, for a
/// like-for-like comparison.
pub const RANGE: &str = "10.244.0.0/16";

/// The node slice size of [`Setup::node_slices`]: a /24 of [`RANGE`] per node.
pub const NODE_SLICE_SIZE: &str = "/24";

/// The namespace of Whereabouts' IPPools, NodeSlicePools and Leases (the plugin's default: the
/// kubeconfig's context names none), and of the NetworkAttachmentDefinition: the node slice
/// controller makes the NodeSlicePool its dependent, which only an owner in the same
/// namespace can have (the garbage collector deletes it otherwise).
const POOL_NAMESPACE: &str = "kube-system";

/// What Whereabouts allocates from and how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setup {
    /// The range (a CIDR).
    pub range: String,
    /// The first and last IP handed out, when not the whole range.
    pub bounds: Option<(String, String)>,
    /// The node slice size: when set, each node allocates from a slice of its own, assigned by
    /// the node slice controller, under a Lease per slice instead of the cluster-wide one.
    pub node_slice_size: Option<String>,
}

impl Setup {
    /// The whole [`RANGE`], one cluster-wide Lease.
    pub fn whole_range() -> Self {
        Self { range: RANGE.into(), bounds: None, node_slice_size: None }
    }

    /// [`RANGE`] in [`NODE_SLICE_SIZE`] slices, one per node.
    pub fn node_slices() -> Self {
        Self { node_slice_size: Some(NODE_SLICE_SIZE.into()), ..Self::whole_range() }
    }

    /// IPs `first..=last` of `range`, one cluster-wide Lease.
    pub fn bounded(range: &str, first: &str, last: &str) -> Self {
        Self { range: range.into(), bounds: Some((first.into(), last.into())), node_slice_size: None }
    }
}

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

/// The Whereabouts IPAM configuration of `setup`, the cluster through `kubeconfig`, logging
/// errors only.
fn ipam(kubeconfig: &Path, setup: &Setup) -> Value {
    let mut ipam = range_ipam(setup);
    ipam["kubernetes"] = json!({"kubeconfig": kubeconfig});
    ipam
}

/// The Whereabouts IPAM configuration of `setup`'s range, logging errors only.
fn range_ipam(setup: &Setup) -> Value {
    let mut ipam = json!({"type": "whereabouts", "range": setup.range, "log_level": "error"});
    if let Some((first, last)) = &setup.bounds {
        ipam["range_start"] = json!(first);
        ipam["range_end"] = json!(last);
    }
    if let Some(size) = &setup.node_slice_size {
        ipam["node_slice_size"] = json!(size);
    }
    ipam
}

/// The netconf of a node: [`ipam`] with its flat file and log in the node's directory.
fn netconf(node: &NodeInfo, kubeconfig: &Path, setup: &Setup) -> Value {
    let mut ipam = ipam(kubeconfig, setup);
    ipam["configuration_path"] = json!(node.dir.join(FLAT_FILE));
    ipam["log_file"] = json!(node.dir.join("whereabouts.log"));
    json!({"cniVersion": "1.0.0", "name": NETWORK, "type": "whereabouts", "ipam": ipam})
}

/// A CNI network whose plugin is Whereabouts' `whereabouts` binary from `build_dir`, called
/// directly as the IPAM (as host-local is in [`CniNetwork::host_local`]), with pods'
/// network-status annotations naming the NetworkAttachmentDefinition, as Multus writes them.
/// With node slices the plugin names its node by `NODENAME`, as it would by the host's
/// `/etc/hostname`.
pub fn network(build_dir: &Path, kubeconfig: KubeconfigSlot, setup: &Setup) -> CniNetwork {
    let for_netconf = setup.clone();
    let node_env: Option<crate::cni::NodeEnvFn> = setup
        .node_slice_size
        .is_some()
        .then(|| Arc::new(|node: &NodeInfo| vec![("NODENAME".to_string(), node.name.clone())]) as _);
    CniNetwork {
        plugin_dirs: vec![build_dir.to_path_buf()],
        netconf: Arc::new(move |node| {
            netconf(node, kubeconfig.get().map_or(Path::new(""), PathBuf::as_path), &for_netconf)
        }),
        runtime_gc: crate::cni::RuntimeGc::Never,
        network_status: Some(format!("{POOL_NAMESPACE}/{NETWORK}")),
        node_env,
    }
}

/// Whereabouts running on a test cluster: one `whereabouts-controller` per node, as its
/// DaemonSet runs, and with node slices the node slice controller. Dropping it stops them.
pub struct Installation {
    /// Whether nodes allocate from slices of their own.
    pub node_slices: bool,
    /// `(name, process)` per node, in node order, then the node slice controller if any.
    pub controllers: Vec<(String, Component)>,
}

/// Installs Whereabouts as `setup` says on `cluster` (whose network is [`network`] of the same
/// `setup` with the cluster's kubeconfig in its slot): the CRDs, the
/// NetworkAttachmentDefinition, each node's flat file, a controller per node, each waited on
/// until its caches are synced, and with node slices the node slice controller, waited on
/// until every node has its slice.
pub async fn install(cluster: &Cluster, build_dir: &Path, setup: &Setup) -> Result<Installation> {
    cluster.apply_crds(&build_dir.join("crds.yaml"), &CRD_NAMES, READY_TIMEOUT).await?;
    let nad = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("k8s.cni.cncf.io", "v1", "NetworkAttachmentDefinition"),
        "network-attachment-definitions",
    );
    let api: Api<DynamicObject> = Api::namespaced_with(cluster.client(), POOL_NAMESPACE, &nad);
    let mut object = DynamicObject::new(NETWORK, &nad).within(POOL_NAMESPACE);
    // The node slice controller reads the NetworkAttachmentDefinition's configuration as the
    // plugin does, flat file included: one in the cluster's directory, for the control plane.
    let mut ipam = ipam(cluster.kubeconfig(), setup);
    ipam["configuration_path"] = json!(write_flat_file(cluster, cluster.dir())?);
    let config = json!({"cniVersion": "1.0.0", "name": NETWORK, "type": "whereabouts", "ipam": ipam});
    object.data = json!({"spec": {"config": config.to_string()}});
    api.create(&PostParams::default(), &object)
        .await
        .map_err(Error::kube(format!("creating NetworkAttachmentDefinition {POOL_NAMESPACE}/{NETWORK}")))?;
    let mut installation = Installation { node_slices: setup.node_slice_size.is_some(), controllers: Vec::new() };
    for node in cluster.nodes() {
        write_flat_file(cluster, node.dir())?;
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
    if installation.node_slices {
        let name = "nodeslicecontroller".to_string();
        let args = vec![format!("--kubeconfig={}", cluster.kubeconfig().display())];
        let env = vec![("WHEREABOUTS_NAMESPACE".to_string(), POOL_NAMESPACE.to_string())];
        let log = cluster.dir().join("nodeslicecontroller.log");
        let component = Component::start_with_env(&name, &build_dir.join("nodeslicecontroller"), args, env, log)?;
        installation.controllers.push((name, component));
        wait_sliced(cluster).await?;
    }
    Ok(installation)
}

/// Writes Whereabouts' flat configuration file for `cluster` into `dir`; returns its path.
fn write_flat_file(cluster: &Cluster, dir: &Path) -> Result<PathBuf> {
    let flat = dir.join(FLAT_FILE);
    let contents = json!({"datastore": "kubernetes", "kubernetes": {"kubeconfig": cluster.kubeconfig()}});
    std::fs::write(&flat, contents.to_string()).map_err(Error::io("writing Whereabouts' flat file", &flat))?;
    Ok(flat)
}

/// Waits until the NodeSlicePool of [`NETWORK`] assigns a slice to every node.
async fn wait_sliced(cluster: &Cluster) -> Result<()> {
    let resource =
        ApiResource::from_gvk(&GroupVersionKind::gvk("whereabouts.cni.cncf.io", "v1alpha1", "NodeSlicePool"));
    let api: Api<DynamicObject> = Api::namespaced_with(cluster.client(), POOL_NAMESPACE, &resource);
    let nodes: Vec<String> = cluster.nodes().iter().map(|n| n.name().to_string()).collect();
    wait::until("every node's slice in the NodeSlicePool", READY_TIMEOUT, || {
        let (api, nodes) = (api.clone(), nodes.clone());
        async move {
            let pool = api.get_opt(NETWORK).await.map_err(Error::kube(format!("reading NodeSlicePool {NETWORK}")))?;
            let assigned: Vec<String> = pool
                .iter()
                .flat_map(|p| p.data["status"]["allocations"].as_array().cloned().unwrap_or_default())
                .filter_map(|a| a["nodeName"].as_str().map(str::to_string))
                .collect();
            Ok(if nodes.iter().all(|n| assigned.contains(n)) {
                Probe::Done(())
            } else {
                Probe::Pending(format!("slices assigned to {assigned:?}"))
            })
        }
    })
    .await
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

/// The IPAM section of a real node's conflist (`{NODE_DIR}` is the node's directory,
/// [`crate::realnode::NODE_DIR_PLACEHOLDER`]): Whereabouts on `setup`'s range, answering
/// `gateway` as the gateway (the `ptp` plugin gives it to the host's end of each pod's veth;
/// Whereabouts has none of its own), reading the cluster from the flat file
/// [`prepare_real_nodes`] writes in the node's directory, logging there.
pub fn real_node_ipam(setup: &Setup, gateway: &str) -> Value {
    let node_dir = crate::realnode::NODE_DIR_PLACEHOLDER;
    let mut ipam = range_ipam(setup);
    ipam["gateway"] = json!(gateway);
    ipam["configuration_path"] = json!(format!("{node_dir}/{FLAT_FILE}"));
    ipam["log_file"] = json!(format!("{node_dir}/whereabouts.log"));
    ipam
}

/// Readies `cluster`'s real nodes for Whereabouts' plugin from `build_dir`, named by their
/// conflists ([`real_node_ipam`]): its CRDs, and on each node the plugin in its CNI plugin
/// directory and the flat file. The plugin alone, as a real node runs it without Multus: the
/// ip-control-loop and reconciler tell a live pod's IP from a leaked one by the pod's Multus
/// network-status annotation, which no real node here writes, so they would free every live
/// pod's IP.
pub async fn prepare_real_nodes(cluster: &Cluster, build_dir: &Path) -> Result<()> {
    cluster.apply_crds(&build_dir.join("crds.yaml"), &CRD_NAMES, READY_TIMEOUT).await?;
    for node in cluster.real_nodes() {
        let plugin = node.paths().cni_bin_dir().join("whereabouts");
        let _absent = std::fs::remove_file(&plugin);
        let target = build_dir.join("whereabouts");
        std::os::unix::fs::symlink(&target, &plugin)
            .map_err(Error::io(format!("linking {}", target.display()), &plugin))?;
        write_flat_file(cluster, node.dir())?;
    }
    Ok(())
}

/// Every IP Whereabouts' IPPools hold, with the pod (`namespace/name`) its allocation names:
/// an allocation's key is its IP's offset from the address the range is written with.
pub async fn allocations(client: &kube::Client) -> Result<std::collections::BTreeMap<String, String>> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &super::Ipam::Whereabouts.records());
    let pools = api.list(&Default::default()).await.map_err(Error::kube("listing Whereabouts' IPPools"))?;
    let mut held = std::collections::BTreeMap::new();
    for pool in &pools.items {
        let range = pool.data["spec"]["range"].as_str().unwrap_or_default();
        let first: std::net::IpAddr = range.split('/').next().unwrap_or_default().parse().map_err(|e| Error::Tool {
            command: format!("reading IPPool {}", pool.name_any()),
            reason: format!("its range {range:?} does not start with an address: {e}"),
        })?;
        for (offset, allocation) in pool.data["spec"]["allocations"].as_object().into_iter().flatten() {
            let ip = offset.parse::<u128>().ok().and_then(|offset| add_offset(first, offset));
            let pod = allocation["podref"].as_str().unwrap_or_default().to_string();
            held.insert(ip.map_or_else(|| format!("offset {offset} of {range}"), |ip| ip.to_string()), pod);
        }
    }
    Ok(held)
}

/// `first` plus `offset`, if that is still an address of its family.
fn add_offset(first: std::net::IpAddr, offset: u128) -> Option<std::net::IpAddr> {
    match first {
        std::net::IpAddr::V4(v4) => {
            let sum = u128::from(u32::from(v4)).checked_add(offset)?;
            Some(std::net::Ipv4Addr::from(u32::try_from(sum).ok()?).into())
        }
        std::net::IpAddr::V6(v6) => Some(std::net::Ipv6Addr::from(u128::from(v6).checked_add(offset)?).into()),
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn an_allocations_offset_counts_from_the_ranges_first_address() {
        let first: std::net::IpAddr = "10.244.0.0".parse().unwrap();
        assert_eq!(add_offset(first, 2), Some("10.244.0.2".parse().unwrap()));
        assert_eq!(add_offset(first, 256 + 7), Some("10.244.1.7".parse().unwrap()));
        assert_eq!(add_offset("255.255.255.255".parse().unwrap(), 1), None);
        assert_eq!(add_offset("fd00::".parse().unwrap(), 16), Some("fd00::10".parse().unwrap()));
    }

    #[test]
    fn a_real_nodes_ipam_names_the_gateway_and_the_nodes_own_flat_file() {
        let ipam = real_node_ipam(&Setup::bounded("10.70.0.0/16", "10.70.0.1", "10.70.0.200"), "10.70.255.254");
        assert_eq!(ipam["gateway"], "10.70.255.254");
        assert_eq!(ipam["range_end"], "10.70.0.200");
        assert_eq!(ipam["configuration_path"], "{NODE_DIR}/whereabouts.conf");
        assert!(ipam.get("kubernetes").is_none(), "the kubeconfig comes from the flat file: {ipam}");
    }
}
