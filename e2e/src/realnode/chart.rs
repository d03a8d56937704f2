//! ipwarden installed on real nodes the way users install it: `helm install` of the chart, its
//! agent DaemonSet and controller Deployment running as pods from ipwarden's image under the
//! nodes' kubelets (docs/testing.md, "The chart on real nodes"). The image is the test image
//! (`e2e/image/test-image.sh`: the release image's Debian base and a binary built on this
//! host), imported into each node's containerd, as there is no registry. The values set only
//! what differs on this machine: the image; the node's directories, which live in its run
//! directory instead of `/etc/cni/net.d`, `/opt/cni/bin`, `/run/ipwarden`, `/var/lib/ipwarden`
//! and `/run/containerd`, and which every node's kubelet and runtime see at one path
//! ([`super::NODE_VIEW`]), as every real machine has its own `/etc/cni/net.d`; the agent's port
//! on the node's IP only (`agent.listenOnHostIP`), as the real nodes share this host's network;
//! and the controllers' toleration of the real nodes' taint. The pods reach the apiserver
//! through the `kubernetes` Service as in-cluster pods do ([`super::service`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};

use super::RealNode;
use super::service::KubernetesService;
use crate::cluster::Cluster;
use crate::error::{Error, Result};
use crate::helm::{Helm, chart};
use crate::wait::{self, Probe};

/// The repository of the test image; its tag names the build ([`install`]).
pub const IMAGE_REPOSITORY: &str = "localhost/ipwarden";

/// The release's name.
pub const RELEASE: &str = "ipwarden";

/// The namespace the chart is installed into, as docs/install.md does it.
pub const NAMESPACE: &str = "ipwarden-system";

/// The chart installed on the cluster's real node (the `kubernetes` Service for its pods lives
/// as long as the node).
#[derive(Debug)]
pub struct ChartInstallation {
    helm: Helm,
    values: Vec<String>,
}

/// Writes the test image of `binary` as `localhost/ipwarden:<tag>` into `dir` and imports it
/// into the real nodes' runtimes, kept across their reboots.
pub async fn load_image(cluster: &Cluster, binary: &Path, tag: &str, dir: &Path) -> Result<()> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("image/test-image.sh");
    let archive = dir.join(format!("ipwarden-{tag}.tar"));
    let args = [
        script.display().to_string(),
        binary.display().to_string(),
        format!("{IMAGE_REPOSITORY}:{tag}"),
        archive.display().to_string(),
    ];
    crate::process::run_tool(Path::new("bash"), &args, None).await?;
    for node in cluster.real_nodes() {
        node.import_kept_image(&archive, &format!("{IMAGE_REPOSITORY}:{tag}")).await?;
    }
    Ok(())
}

/// The directory of `node` the chart's agent keeps its socket and checkpoint in (one
/// directory for both, which the chart mounts once), as `/run/ipwarden` and
/// `/var/lib/ipwarden` on a real machine.
pub fn agent_dir(node: &RealNode) -> PathBuf {
    node.dir().join("ipwarden")
}

/// The chart's values for this machine: image `tag` (never pulled) and the nodes' directories
/// as the nodes see them.
fn values(cluster: &Cluster, tag: &str) -> Result<Vec<String>> {
    let Some(node) = cluster.real_nodes().first() else {
        return Err(Error::Tool {
            command: "helm install (the chart on real nodes)".into(),
            reason: "the cluster has no real nodes".into(),
        });
    };
    let paths = node.paths();
    if paths.runtime == super::Runtime::Crio && !super::host::has_sys_resource() {
        return Err(Error::Tool {
            command: "helm install (the chart on a CRI-O node)".into(),
            reason: "the chart's agent is system-node-critical, so kubelet gives it oom_score_adj -997, which runc \
                     may set only with CAP_SYS_RESOURCE, which this host's root lacks; containerd clamps the value \
                     (restrict_oom_score_adj), CRI-O has no such setting: run the chart on containerd here"
                .into(),
        });
    }
    let seen = |path: &Path| paths.seen_by_node(path).display().to_string();
    Ok(vec![
        format!("image.repository={IMAGE_REPOSITORY}"),
        format!("image.tag={tag}"),
        "image.pullPolicy=Never".into(),
        format!("cni.binDir={}", seen(&paths.cni_bin_dir())),
        format!("cni.confDir={}", seen(&paths.cni_conf_dir())),
        format!("agent.socketDir={}", seen(&agent_dir(node))),
        format!("agent.checkpointDir={}", seen(&agent_dir(node))),
        format!("agent.cri.sockets={{{}}}", seen(&paths.runtime_socket())),
        "agent.listenOnHostIP=true".into(),
        // The test's real nodes are tainted (only pods made for them go there); the agent
        // tolerates every taint already.
        format!("controller.tolerations[0].key={}", super::REAL_NODE_LABEL),
        "controller.tolerations[0].operator=Exists".into(),
    ])
}

/// Installs the chart (image `tag`, loaded by [`load_image`]) into [`NAMESPACE`], as
/// docs/install.md says, on the cluster's real nodes.
pub async fn install(cluster: &Cluster, tag: &str) -> Result<ChartInstallation> {
    let values = values(cluster, tag)?;
    let context = cluster.real_context().ok_or_else(|| Error::Tool {
        command: "helm install (the chart on real nodes)".into(),
        reason: "the cluster has no real nodes".into(),
    })?;
    let port = apiserver_port(cluster.server())?;
    {
        let mut service = context.service.lock().map_err(|_| super::poisoned())?;
        if service.is_none() {
            let mut host = context.host.lock().map_err(|_| super::poisoned())?;
            *service = Some(KubernetesService::start(&mut host, port)?);
        }
    }
    let installation = ChartInstallation { helm: Helm::locate()?.for_cluster(cluster.kubeconfig()), values };
    installation.run_with_values("install", &["--create-namespace"]).await?;
    Ok(installation)
}

impl ChartInstallation {
    /// `helm upgrade` to image `tag` (loaded by [`load_image`]), the other values kept.
    pub async fn upgrade(&mut self, tag: &str) -> Result<()> {
        for value in &mut self.values {
            if value.starts_with("image.tag=") {
                *value = format!("image.tag={tag}");
            }
        }
        self.run_with_values("upgrade", &[]).await
    }

    /// `helm <verb>` of the chart as [`RELEASE`] in [`NAMESPACE`] with `flags` and the values.
    async fn run_with_values(&self, verb: &str, flags: &[&str]) -> Result<()> {
        let chart = chart().display().to_string();
        let mut args: Vec<&str> = vec![verb, RELEASE, chart.as_str(), "--namespace", NAMESPACE];
        args.extend(flags);
        for value in &self.values {
            args.extend(["--set", value.as_str()]);
        }
        self.helm.run(&args).await.map(drop)
    }

    /// `helm uninstall`.
    pub async fn uninstall(&self) -> Result<()> {
        self.helm.run(&["uninstall", RELEASE, "--namespace", NAMESPACE, "--wait"]).await.map(drop)
    }
}

/// The port of the apiserver URL `server` (`https://127.0.0.1:<port>`).
fn apiserver_port(server: &str) -> Result<u16> {
    server.rsplit(':').next().and_then(|port| port.trim_end_matches('/').parse().ok()).ok_or_else(|| Error::Tool {
        command: "reading the apiserver's port".into(),
        reason: format!("no port in {server}"),
    })
}

/// The tag of the image `ipwarden-e2e up --install chart` runs.
pub const UP_TAG: &str = "e2e";

/// Waits until the chart runs: an agent pod Ready on every real node, with them the Nodes, then
/// both controller pods Ready (on the pod network, they need the agents). Returns the agent
/// and controller pods.
pub async fn wait_running(cluster: &mut Cluster) -> Result<(Vec<Pod>, Vec<Pod>)> {
    let client = cluster.client();
    let agents = ready_pods(&client, NAMESPACE, AGENT_SELECTOR, cluster.real_nodes().len()).await?;
    cluster.wait_real_nodes_ready().await?;
    let controllers = ready_pods(&client, NAMESPACE, CONTROLLER_SELECTOR, CONTROLLER_REPLICAS).await?;
    Ok((agents, controllers))
}

/// The controller pods the chart runs (its `controller.replicas`), on the pod network: each
/// holds a pod IP.
pub const CONTROLLER_REPLICAS: usize = 2;

/// The port of the agent's metrics on its node's IP (the chart's `agent.metricsPort`).
pub const AGENT_METRICS_PORT: u16 = 9612;

/// The chart's agent pods.
pub const AGENT_SELECTOR: &str = "app.kubernetes.io/component=agent";

/// The chart's controller pods.
pub const CONTROLLER_SELECTOR: &str = "app.kubernetes.io/component=controller";

/// How long the chart's pods, or a workload's, may take to run.
const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// The live pods of `namespace` matching `selector`, once there are `count` of them, all
/// Running and Ready (their probes passed); while waiting, each pod's phase and why its
/// containers wait.
pub async fn ready_pods(client: &Client, namespace: &str, selector: &str, count: usize) -> Result<Vec<Pod>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    wait::until(&format!("{count} Ready pods {selector} in {namespace}"), READY_TIMEOUT, || async {
        let listed = pods
            .list(&ListParams::default().labels(selector))
            .await
            .map_err(Error::kube(format!("listing pods {selector} in {namespace}")))?;
        let live: Vec<Pod> = listed.items.into_iter().filter(|p| p.metadata.deletion_timestamp.is_none()).collect();
        Ok(if live.len() == count && live.iter().all(is_ready) {
            Probe::Done(live)
        } else {
            Probe::Pending(format!("{:?}", live.iter().map(waiting).collect::<Vec<_>>()))
        })
    })
    .await
}

/// Whether `pod` runs and is Ready.
fn is_ready(pod: &Pod) -> bool {
    let status = pod.status.clone().unwrap_or_default();
    status.phase.as_deref() == Some("Running")
        && status.conditions.unwrap_or_default().iter().any(|c| c.type_ == "Ready" && c.status == "True")
}

/// `pod`'s name, phase and why its containers wait.
fn waiting(pod: &Pod) -> String {
    let status = pod.status.clone().unwrap_or_default();
    let reasons: Vec<String> = status
        .init_container_statuses
        .unwrap_or_default()
        .into_iter()
        .chain(status.container_statuses.unwrap_or_default())
        .filter_map(|c| c.state.and_then(|s| s.waiting).map(|w| format!("{}: {:?} {:?}", c.name, w.reason, w.message)))
        .collect();
    format!("{} {:?} {reasons:?}", pod.name_any(), status.phase)
}

/// Where the node's ipwarden files are, for a test to look: the plugin and the conflist the
/// init container installs.
pub fn installed_files(cluster: &Cluster) -> Vec<PathBuf> {
    cluster
        .real_nodes()
        .iter()
        .flat_map(|n| [n.paths().cni_bin_dir().join("ipwarden-cni"), n.paths().cni_conf_dir().join(super::CONFLIST)])
        .collect()
}
