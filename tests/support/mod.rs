//! A real control plane with simulated nodes, ipwarden's CRDs, one `ipwarden agent` process
//! per node, and the kubelet invoking the real `ipwarden-cni` plugin binary.

#![allow(dead_code)] // Each test binary uses a different part of this support module.

pub mod invariants;
pub mod kubevirt;
pub mod realnode;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use e2e::cni::{Invocation, NodeInfo, PodArgs};
use e2e::kubelet::Sandbox;
use e2e::process::Component;
use e2e::realnode::Runtime;
use e2e::wait::{self, Probe};
use e2e::{Cluster, ClusterOptions, CniNetwork, Error};
use ipwarden::crd::{IPBlock, IPClaim, IPPool};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

/// The bound on every wait of these tests.
pub const TIMEOUT: Duration = Duration::from_secs(180);

/// A cluster running ipwarden's data plane.
pub struct Ipwarden {
    /// The cluster (control plane + simulated nodes).
    pub cluster: Cluster,
    /// One agent per node, in node order.
    pub agents: Vec<Component>,
    /// Each agent's metrics port on 127.0.0.1.
    pub metrics_ports: Vec<u16>,
    /// Controller replicas started with [`Ipwarden::start_controller`].
    pub controllers: Vec<Component>,
    /// Each controller's metrics port on 127.0.0.1.
    pub controller_ports: Vec<u16>,
    /// The identity each node's agent started from now on uses, by node index (none: the
    /// admin); [`Ipwarden::run_agents_as_chart_account`] sets them.
    pub agent_run_as: Vec<e2e::ipwarden::RunAs>,
    /// The identity and namespace controllers started from now on use (default: the admin,
    /// namespace `default`).
    pub controller_run_as: Option<e2e::ipwarden::RunAs>,
}

/// The binary under test.
fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_ipwarden"))
}

/// The release namespace of [`Ipwarden::start_node_bound`]: its agents' ServiceAccount lives
/// there, so a test asks for another token of it (a node's agent's credentials) there too.
pub const NODE_BOUND_NAMESPACE: &str = "ipwarden-system";

/// The network the simulated kubelet uses: the real `ipwarden-cni`, talking to the node's agent.
pub fn network() -> CniNetwork {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("cni-bin-{}", std::process::id()));
    e2e::ipwarden::network(binary(), &dir).expect("CNI network")
}

impl Ipwarden {
    /// Starts a cluster of `nodes` nodes, installs the CRDs, creates `pools` (name, spec)
    /// and starts an agent per node with `agent_args` added to its command line.
    pub async fn start(nodes: usize, pools: &[(&str, serde_json::Value)], agent_args: &[&str]) -> Self {
        Self::start_with_network(nodes, pools, agent_args, network()).await
    }

    /// Like [`Ipwarden::start`] with a given network (e.g. one whose kubelet calls CNI GC).
    pub async fn start_with_network(
        nodes: usize,
        pools: &[(&str, serde_json::Value)],
        agent_args: &[&str],
        network: CniNetwork,
    ) -> Self {
        let mut ipwarden = Self::without_agents(nodes, pools, network).await;
        ipwarden.start_agents(agent_args).await;
        ipwarden
    }

    /// Like [`Ipwarden::start`], installed as the chart installs it: its ServiceAccounts, RBAC
    /// and node-bound write policies in namespace `ipwarden-system`, each agent on a token bound
    /// to a pod on its node, and controllers (as the admin) in that namespace with the agents'
    /// heartbeat Leases.
    pub async fn start_node_bound(nodes: usize, pools: &[(&str, serde_json::Value)], agent_args: &[&str]) -> Self {
        let mut ipwarden = Self::without_agents(nodes, pools, network()).await;
        apply_chart_rbac(&ipwarden, NODE_BOUND_NAMESPACE).await;
        ipwarden.run_agents_as_chart_account(NODE_BOUND_NAMESPACE).await;
        let admin = ipwarden.cluster.kubeconfig().to_path_buf();
        ipwarden.controller_run_as =
            Some(e2e::ipwarden::RunAs { kubeconfig: admin, namespace: NODE_BOUND_NAMESPACE.to_string() });
        ipwarden.start_agents(agent_args).await;
        ipwarden
    }

    /// A cluster with the CRDs and `pools` but no agent yet (to set [`Ipwarden::agent_run_as`]
    /// first); [`Ipwarden::start_agents`] starts them.
    pub async fn without_agents(nodes: usize, pools: &[(&str, serde_json::Value)], network: CniNetwork) -> Self {
        let options = ClusterOptions { nodes, network: Some(network), ..ClusterOptions::default() };
        Self::on(Cluster::start(options).await.expect("cluster starts"), pools).await
    }

    /// ipwarden's CRDs and `pools` on `cluster`, with no agent or controller yet.
    async fn on(cluster: Cluster, pools: &[(&str, serde_json::Value)]) -> Self {
        ipwarden::crd::install(&cluster.client(), Duration::from_secs(60)).await.expect("CRDs install");
        for (name, spec) in pools {
            e2e::ipwarden::create_pool(&cluster.client(), name, spec.clone()).await.expect("create pool");
        }
        Self {
            cluster,
            agents: Vec::new(),
            metrics_ports: Vec::new(),
            controllers: Vec::new(),
            controller_ports: Vec::new(),
            agent_run_as: Vec::new(),
            controller_run_as: None,
        }
    }

    /// A cluster of `real` real nodes (kubelet, containerd, the chart's conflist) and no
    /// simulated one, with the CRDs, `pools` and an agent per node started with `agent_args`.
    pub async fn with_real_nodes(real: usize, pools: &[(&str, serde_json::Value)], agent_args: &[&str]) -> Self {
        let control_plane = e2e::controlplane::ControlPlaneOptions::default();
        Self::with_real_nodes_in(real, Runtime::Containerd, pools, agent_args, control_plane).await
    }

    /// Like [`Ipwarden::with_real_nodes`], with the nodes running `runtime`, on a control
    /// plane with `control_plane`'s settings (a node monitor grace long enough to stop kubelet
    /// without its Node turning NotReady).
    pub async fn with_real_nodes_in(
        real: usize,
        runtime: Runtime,
        pools: &[(&str, serde_json::Value)],
        agent_args: &[&str],
        control_plane: e2e::controlplane::ControlPlaneOptions,
    ) -> Self {
        let ipwarden = binary().to_path_buf();
        let options = ClusterOptions {
            nodes: 0,
            real_nodes: Some(e2e::cluster::RealNodesOptions { count: real, ipwarden, runtime, ipam: None }),
            control_plane,
            ..ClusterOptions::default()
        };
        let cluster = Cluster::start(options).await.expect("cluster with real nodes starts");
        let mut ipwarden = Self::on(cluster, pools).await;
        ipwarden.start_agents(agent_args).await;
        ipwarden.cluster.wait_real_nodes_ready().await.expect("real nodes turn Ready with their agents");
        ipwarden
    }

    /// Starts an agent per node (simulated, then real) with `agent_args` and waits until each
    /// serves.
    pub async fn start_agents(&mut self, agent_args: &[&str]) {
        for index in 0..self.cluster.node_dirs().len() {
            self.spawn_agent_unwaited(index, agent_args);
        }
        for index in 0..self.agents.len() {
            self.wait_agent_serving(index).await;
        }
    }

    /// Starts the agent of node `index` with `agent_args` and waits until it serves; agents
    /// started one by one must be started in node order (the agent's index is its node's).
    pub async fn start_agent(&mut self, index: usize, agent_args: &[&str]) {
        let at = self.spawn_agent_unwaited(index, agent_args);
        self.wait_agent_serving(at).await;
    }

    /// Starts the agent of node `index` without waiting for it to serve; returns its index
    /// among the agents.
    pub fn spawn_agent_unwaited(&mut self, index: usize, agent_args: &[&str]) -> usize {
        let port = e2e::process::free_port().expect("free port");
        let agent = self.spawn_agent(index, port, agent_args);
        self.agents.push(agent);
        self.metrics_ports.push(port);
        self.agents.len() - 1
    }

    fn spawn_agent(&self, index: usize, metrics_port: u16, extra: &[&str]) -> Component {
        let run_as =
            self.agent_run_as.get(index).cloned().unwrap_or_else(|| e2e::ipwarden::RunAs::admin(&self.cluster));
        e2e::ipwarden::start_agent_as(&self.cluster, binary(), index, metrics_port, extra, &run_as)
            .expect("agent starts")
    }

    /// Makes the agents started from now on run as the chart's agent ServiceAccount with
    /// `namespace` as their `--namespace`, each with a token bound to a pod on its own node, as
    /// kubelet mints for the chart's DaemonSet pods (so the chart's node-bound write policies
    /// know each agent's node).
    pub async fn run_agents_as_chart_account(&mut self, namespace: &str) {
        let mut run_as = Vec::new();
        for (node, _) in self.cluster.node_dirs() {
            let kubeconfig =
                e2e::accounts::node_bound_kubeconfig_for(&self.cluster, namespace, "ipwarden-agent", &node)
                    .await
                    .expect("a token bound to a pod on the agent's node");
            run_as.push(e2e::ipwarden::RunAs { kubeconfig, namespace: namespace.to_string() });
        }
        self.agent_run_as = run_as;
    }

    /// Waits until agent `index` reports ready on /readyz (caches synced, checkpoint
    /// restored, socket bound).
    pub async fn wait_agent_serving(&mut self, index: usize) {
        let port = self.metrics_ports[index];
        e2e::ipwarden::wait_ready(&mut self.agents[index], port, TIMEOUT).await.expect("agent serves");
    }

    /// Starts a controller replica named `identity` (short timings for tests, unless `extra`
    /// sets the same flag, plus `extra`) and returns its index.
    pub fn start_controller(&mut self, identity: &str, extra: &[&str]) -> usize {
        let port = e2e::process::free_port().expect("free port");
        let defaults = [
            "--lease-duration-seconds=4",
            "--additional-grace-seconds=1",
            "--batch-window-ms=100",
            "--claim-janitor-interval-seconds=2",
        ];
        let flag = |arg: &str| arg.split('=').next().unwrap_or(arg).to_string();
        let mut args: Vec<&str> = defaults.into_iter().filter(|d| !extra.iter().any(|e| flag(e) == flag(d))).collect();
        args.extend(extra);
        let run_as = self.controller_run_as.clone().unwrap_or_else(|| e2e::ipwarden::RunAs::admin(&self.cluster));
        let controller = e2e::ipwarden::start_controller_as(&self.cluster, binary(), identity, port, &args, &run_as)
            .expect("controller starts");
        self.controllers.push(controller);
        self.controller_ports.push(port);
        self.controllers.len() - 1
    }

    /// Controller `index`'s /metrics text, or None while it does not answer.
    pub async fn scrape_controller(&self, index: usize) -> Option<String> {
        e2e::ipwarden::get(self.controller_ports[index], "/metrics").await.ok()
    }

    /// Waits until controller `index` leads (its `ipwarden_controller_leader` is 1).
    pub async fn wait_leader(&mut self, index: usize) {
        let log = self.controllers[index].log().display().to_string();
        let port = self.controller_ports[index];
        let controller = &mut self.controllers[index];
        wait::until(&format!("controller {index} leading (log {log})"), TIMEOUT, || {
            let running = controller.ensure_running();
            async move {
                running?;
                let text = e2e::ipwarden::get(port, "/metrics").await.unwrap_or_default();
                Ok(if metric(&text, "ipwarden_controller_leader") == 1.0 {
                    Probe::Done(())
                } else {
                    Probe::Pending("not leading".into())
                })
            }
        })
        .await
        .expect("controller leads");
    }

    /// Waits until some controller replica leads and returns its index.
    pub async fn wait_any_leader(&self) -> usize {
        wait::until("a controller replica leading", TIMEOUT, || async {
            for index in 0..self.controllers.len() {
                let text = self.scrape_controller(index).await.unwrap_or_default();
                if metric(&text, "ipwarden_controller_leader") == 1.0 {
                    return Ok(Probe::Done(index));
                }
            }
            Ok(Probe::Pending("no replica leads".into()))
        })
        .await
        .expect("a leader")
    }

    /// Waits until controller `index` has finished `count` more full sweeps than when called.
    pub async fn wait_sweeps(&self, index: usize, count: u32) {
        let sweeps = || async {
            let text = self.scrape_controller(index).await.unwrap_or_default();
            metric_sum(&text, "ipwarden_gc_sweep_duration_seconds_count", &[])
        };
        let target = sweeps().await + f64::from(count);
        wait::until(&format!("{count} more sweeps of controller {index}"), TIMEOUT, || async {
            let done = sweeps().await;
            Ok(if done >= target { Probe::Done(()) } else { Probe::Pending(format!("{done} of {target} sweeps")) })
        })
        .await
        .expect("sweeps go on");
    }

    /// Agent `index`'s /metrics text.
    pub async fn scrape_agent(&self, index: usize) -> String {
        e2e::ipwarden::get(self.metrics_ports[index], "/metrics").await.expect("scrape /metrics")
    }

    /// The admin client.
    pub fn client(&self) -> Client {
        self.cluster.client()
    }
}

/// The value of the series `name_and_labels` in exposition `text` (0 when absent).
pub fn metric(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(name_and_labels)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The pod UID and handshake state of `ip`'s record, or None when there is none.
pub async fn record_state(client: &Client, ip: &str) -> Option<(String, Option<ipwarden::crd::HandshakeState>)> {
    records(client).await.get(ip).map(|r| (r.pod.uid.clone(), r.release_handshake.as_ref().map(|h| h.state)))
}

/// Waits, at most `within`, until no record holds `ip` (`what` names the wait).
pub async fn wait_record_gone(client: &Client, ip: &str, within: Duration, what: &str) {
    wait::until(what, within, || async {
        Ok(match record_state(client, ip).await {
            None => Probe::Done(()),
            Some(state) => Probe::Pending(format!("record of {ip}: {state:?}")),
        })
    })
    .await
    .expect("record released");
}

/// Waits until agent `index`'s series `name_and_labels` is above zero, and returns it.
pub async fn scrape_agent_until(ipwarden: &Ipwarden, index: usize, name_and_labels: &str) -> f64 {
    wait::until(&format!("{name_and_labels} above zero"), TIMEOUT, || async {
        let value = metric(&ipwarden.scrape_agent(index).await, name_and_labels);
        Ok(if value > 0.0 { Probe::Done(value) } else { Probe::Pending(format!("{value}")) })
    })
    .await
    .expect("metric above zero")
}

/// The sum of every series of `name` whose labels contain all of `labels` (e.g.
/// `reason="pod_gone"`).
pub fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(&format!("{name}{{")) || line.starts_with(&format!("{name} ")))
        .filter(|line| labels.iter().all(|l| line.contains(l)))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Writes `record` for `ip` straight into block `block` of `pool` (a leak injected by a
/// test), creating the block when needed; compare-and-swap, retried on conflict.
pub async fn inject_record(client: &Client, pool: &str, block: &str, cidr: &str, ip: &str, record: serde_json::Value) {
    let api: Api<IPBlock> = Api::all(client.clone());
    let allocation: ipwarden::crd::Allocation = serde_json::from_value(record).expect("record");
    for _ in 0..50 {
        let written = match api.get_opt(block).await.expect("read block") {
            Some(mut existing) => {
                existing.spec.allocations.insert(ip.to_string(), allocation.clone());
                api.replace(block, &PostParams::default(), &existing).await.map(drop)
            }
            None => {
                let mut spec =
                    ipwarden::crd::IPBlockSpec { pool: pool.into(), cidr: cidr.into(), ..Default::default() };
                spec.allocations.insert(ip.to_string(), allocation.clone());
                api.create(&PostParams::default(), &IPBlock::new(block, spec)).await.map(drop)
            }
        };
        match written {
            Ok(()) => return,
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(e) => panic!("injecting a record into {block}: {e}"),
        }
    }
    panic!("injecting a record into {block}: too many conflicts");
}

/// Sends the DEL that node `index`'s runtime held back for `sandbox` of pod
/// `namespace`/`name` (UID `uid`), through the real plugin, as a runtime does late.
pub async fn late_del(ipwarden: &Ipwarden, index: usize, namespace: &str, name: &str, uid: &str, sandbox: &Sandbox) {
    let node = &ipwarden.cluster.nodes()[index];
    let info = NodeInfo { name: node.name().to_string(), index, dir: node.dir().to_path_buf() };
    let network = network();
    let netconf = e2e::cni::with_prev_result(&(network.netconf)(&info), &sandbox.result);
    let args = PodArgs { namespace: namespace.into(), name: name.into(), uid: uid.into() };
    let del = Invocation {
        command: "DEL",
        container_id: &sandbox.container_id,
        ifname: &sandbox.ifname,
        pod: Some(&args),
        netconf: &netconf,
    };
    network.invoke(&del).await.expect("the late DEL succeeds");
}

/// Calls CNI GC on node `index` as its runtime does, listing `valid` as the sandboxes it
/// still has (`cni.dev/valid-attachments`), through the real plugin.
pub async fn runtime_gc(ipwarden: &Ipwarden, index: usize, valid: &[&Sandbox]) {
    let node = &ipwarden.cluster.nodes()[index];
    let info = NodeInfo { name: node.name().to_string(), index, dir: node.dir().to_path_buf() };
    let network = network();
    let valid: Vec<e2e::cni::Attachment> = valid
        .iter()
        .map(|s| e2e::cni::Attachment { container_id: s.container_id.clone(), ifname: s.ifname.clone() })
        .collect();
    let netconf = e2e::cni::with_valid_attachments(&(network.netconf)(&info), &valid);
    let gc = Invocation { command: "GC", container_id: "", ifname: "", pod: None, netconf: &netconf };
    network.invoke(&gc).await.expect("the runtime's GC succeeds");
}

/// A record as the agent writes it.
pub fn record_json(
    namespace: &str,
    pod: &str,
    uid: &str,
    node: &str,
    owner: Option<(&str, &str)>,
    sticky: bool,
) -> serde_json::Value {
    json!({"pod": {"namespace": namespace, "name": pod, "uid": uid}, "node": node, "network": "ipwarden",
           "containerId": format!("injected-{uid}"), "interface": "eth0", "sticky": sticky,
           "owner": owner.map(|(kind, name)| json!({"kind": kind, "name": name})),
           "allocatedAt": "2026-01-01T00:00:00Z"})
}

/// The column `header` of the row starting with `key` in a table as kubectl (or `ipwarden
/// status`) prints it: the cell starting where the header starts (columns are left-aligned,
/// and a cell may be empty, which kubectl shows as nothing or `<none>`; both read `<none>`).
pub fn column(table: &str, key: &str, header: &str) -> Option<String> {
    let mut lines = table.lines();
    let headers = lines.next()?;
    let at = headers.match_indices(header).map(|(at, _)| at).find(|&at| {
        let before = headers[..at].chars().next_back().is_none_or(char::is_whitespace);
        let after = headers[at + header.len()..].chars().next().is_none_or(char::is_whitespace);
        before && after
    })?;
    let row = lines.find(|l| l.split_whitespace().next() == Some(key))?;
    let cell = row.get(at..).unwrap_or_default().split_whitespace().next().unwrap_or_default();
    let starts_here = row[..at.min(row.len())].chars().next_back().is_none_or(char::is_whitespace);
    Some(if cell.is_empty() || !starts_here { "<none>".to_string() } else { cell.to_string() })
}

/// Creates StatefulSet `name` in `namespace` with one replica whose pods are labelled
/// `app=<name>`, their spec extended by `extra` (see [`pod_template`]).
pub async fn create_statefulset(client: &Client, namespace: &str, name: &str, extra: serde_json::Value) {
    let sts: k8s_openapi::api::apps::v1::StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"replicas": 1, "serviceName": name, "selector": {"matchLabels": {"app": name}},
                 "template": pod_template(name, extra)},
    }))
    .expect("statefulset");
    Api::<k8s_openapi::api::apps::v1::StatefulSet>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &sts)
        .await
        .expect("create statefulset");
}

/// A workload's pod template: label `app`, grace 1 s, one container, plus `extra` spec fields.
pub fn pod_template(app: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut spec =
        json!({"terminationGracePeriodSeconds": 1, "containers": [{"name": "c", "image": "registry.invalid/c:1"}]});
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
        spec.extend(extra.clone());
    }
    json!({"metadata": {"labels": {"app": app}}, "spec": spec})
}

/// Creates a bare pod bound to `node` (no scheduler involved).
pub async fn create_pod(client: &Client, namespace: &str, name: &str, node: &str, labels: serde_json::Value) {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "app", "image": "registry.invalid/ipwarden-test/app:1"}]},
    }))
    .expect("pod");
    Api::<Pod>::namespaced(client.clone(), namespace).create(&PostParams::default(), &pod).await.expect("create pod");
}

/// Live (not terminating) pods matching `selector` that report an IP, by name.
pub async fn pods_with_ips(client: &Client, namespace: &str, selector: &str) -> Result<BTreeMap<String, Pod>, Error> {
    let list = Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(selector))
        .await
        .map_err(Error::kube(format!("listing pods {selector}")))?;
    Ok(list
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.pod_ip.as_ref()).is_some())
        .map(|p| (p.name_any(), p))
        .collect())
}

/// Waits until exactly `count` pods matching `selector` run with an IP.
pub async fn wait_pods_with_ips(
    client: &Client,
    namespace: &str,
    selector: &str,
    count: usize,
) -> BTreeMap<String, Pod> {
    wait::until(&format!("{count} pods {selector} with IPs"), TIMEOUT, || async {
        let pods = pods_with_ips(client, namespace, selector).await?;
        Ok(if pods.len() == count { Probe::Done(pods) } else { Probe::Pending(format!("{} of {count}", pods.len())) })
    })
    .await
    .expect("pods get IPs")
}

/// Waits until pod `name` (matching `selector`) runs with an IP under another UID than
/// `before`'s: its controller recreated it.
pub async fn wait_recreated(client: &Client, namespace: &str, selector: &str, before: &Pod) -> Pod {
    let name = before.name_any();
    wait::until(&format!("{name} recreated with an IP"), TIMEOUT, || async {
        let pods = pods_with_ips(client, namespace, selector).await?;
        Ok(match pods.get(&name) {
            Some(pod) if pod.uid() != before.uid() => Probe::Done(pod.clone()),
            _ => Probe::Pending(format!("{:?}", pods.keys().collect::<Vec<_>>())),
        })
    })
    .await
    .expect("the pod comes back")
}

/// The pod's IP.
pub fn ip_of(pod: &Pod) -> String {
    pod.status.as_ref().and_then(|s| s.pod_ip.clone()).unwrap_or_default()
}

/// Every allocation record: IP -> (pod namespace/name, pod uid, node, container id).
pub async fn records(client: &Client) -> BTreeMap<String, ipwarden::crd::Allocation> {
    Api::<IPBlock>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("list blocks")
        .items
        .into_iter()
        .flat_map(|b| b.spec.allocations.into_iter())
        .collect()
}

/// The finalizer the controller keeps on every pool while a block of it holds a record.
pub const POOL_FINALIZER: &str = "ipwarden.io/pool-in-use";

/// Deletes pool `name` once the controller has put its finalizer on it, and asserts that it
/// stays, being deleted (a block of it holds a record).
pub async fn delete_pool_in_use(client: &Client, name: &str) {
    let pools: Api<IPPool> = Api::all(client.clone());
    wait::until(&format!("the controller putting its finalizer on pool {name}"), TIMEOUT, || async {
        let pool = pools.get(name).await.map_err(Error::kube(format!("reading pool {name}")))?;
        Ok(if pool.finalizers().iter().any(|f| f == POOL_FINALIZER) {
            Probe::Done(())
        } else {
            Probe::Pending(format!("finalizers {:?}", pool.finalizers()))
        })
    })
    .await
    .expect("the pool gets the finalizer");
    pools.delete(name, &DeleteParams::default()).await.expect("delete pool");
    let pool = pools.get(name).await.expect("the pool still exists while in use");
    assert!(pool.metadata.deletion_timestamp.is_some(), "pool {name} is being deleted");
}

/// Marks node `name` (un)schedulable, as `kubectl cordon` / `uncordon` do.
pub async fn cordon(client: &Client, name: &str, unschedulable: bool) {
    let patch = json!({"spec": {"unschedulable": unschedulable}});
    Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
        .patch(name, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch))
        .await
        .expect("cordon");
}

/// Waits until the controller has written down claim `namespace/name` as in effect for pod
/// `uid` (`status.witnessed`), and returns the IPs it saw.
pub async fn wait_witnessed(client: &Client, namespace: &str, name: &str, uid: &str) -> Vec<String> {
    wait::until(&format!("the controller witnessing claim {namespace}/{name}"), TIMEOUT, || async {
        let claim = claims(client, namespace).await.remove(name);
        let seen = claim.and_then(|c| c.status).and_then(|s| s.witnessed);
        Ok(match seen {
            Some(w) if w.pod_uid == uid => {
                Probe::Done(w.interfaces.iter().flat_map(|i| &i.ips).map(|c| c.ip.clone()).collect())
            }
            other => Probe::Pending(format!("{other:?}")),
        })
    })
    .await
    .expect("witnessed")
}

/// Every IPClaim of `namespace`, by name.
pub async fn claims(client: &Client, namespace: &str) -> BTreeMap<String, IPClaim> {
    Api::<IPClaim>::namespaced(client.clone(), namespace)
        .list(&ListParams::default())
        .await
        .expect("list claims")
        .items
        .into_iter()
        .map(|c| (c.name_any(), c))
        .collect()
}

/// Creates the IPClaim a version before decision 0015 wrote for stateless pod `pod` (bound to
/// `uid`, holding `ip` on eth0): the claims an upgrade finds and the claim janitor removes.
pub async fn inject_legacy_claim(client: &Client, namespace: &str, pod: &str, uid: &str, ip: &str) {
    let ips = json!([{"ip": ip, "pool": "legacy", "block": "legacy"}]);
    inject_claim(client, namespace, pod, json!({"podUid": uid, "sticky": false}), ips).await;
}

/// Creates IPClaim `name` bound on node-0 with `spec` (podUid, sticky, owner) holding `ips`
/// (`[{ip, pool, block}]`) on eth0: a claim left by an older version or an earlier setting.
pub async fn inject_claim(
    client: &Client,
    namespace: &str,
    name: &str,
    spec: serde_json::Value,
    ips: serde_json::Value,
) {
    let mut full = json!({"node": "node-0", "boundAt": "2026-01-01T00:00:00Z",
                          "interfaces": [{"interface": "eth0", "ips": ips}]});
    if let (Some(full), Some(spec)) = (full.as_object_mut(), spec.as_object()) {
        full.extend(spec.clone());
    }
    let claim: IPClaim = serde_json::from_value(json!({
        "apiVersion": "ipwarden.io/v1alpha1", "kind": "IPClaim",
        "metadata": {"name": name, "namespace": namespace}, "spec": full,
    }))
    .expect("claim");
    Api::<IPClaim>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &claim)
        .await
        .expect("create legacy claim");
}

/// Renders the chart's ServiceAccounts, RBAC and the agent's node-bound write policies for
/// release namespace `namespace` (created here) and applies them with the built kubectl, so
/// processes can run as those accounts; returns once the policies are in force.
pub async fn apply_chart_rbac(ipwarden: &Ipwarden, namespace: &str) {
    let object: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}})).expect("namespace");
    Api::<Namespace>::all(ipwarden.client()).create(&PostParams::default(), &object).await.expect("namespace");
    let helm = e2e::helm::Helm::locate().expect("helm builds");
    let chart = e2e::helm::chart().display().to_string();
    let mut args = vec!["template", "ipwarden", chart.as_str(), "--namespace", namespace];
    let templates = [
        "templates/serviceaccounts.yaml",
        "templates/controller-rbac.yaml",
        "templates/agent-rbac.yaml",
        "templates/agent-policies.yaml",
    ];
    for template in templates {
        args.extend(["--show-only", template]);
    }
    let rendered = helm.run(&args).await.expect("helm template renders the RBAC");
    let kubectl = ipwarden.cluster.kubectl();
    let apply = vec![
        format!("--kubeconfig={}", ipwarden.cluster.kubeconfig().display()),
        "apply".into(),
        "-f".into(),
        "-".into(),
    ];
    let applied = e2e::process::run_tool(&kubectl, &apply, Some(rendered.as_bytes())).await.expect("kubectl apply");
    assert!(applied.contains("clusterrole.rbac.authorization.k8s.io/ipwarden-agent created"), "{applied}");
    wait_node_bound_policies(ipwarden, namespace).await;
}

/// Waits until the apiserver enforces each of the chart's node-bound write policies, each
/// seen refusing a dry run (which passes admission and stores nothing) by one of its own
/// rules: a Lease and an IPClaim written with a token bound to no node (T0), a block whose
/// record names another node than the token's (B-U3), and a block over an existing pool's
/// IPs under another pool's name (B-C2, when a pool exists).
async fn wait_node_bound_policies(ipwarden: &Ipwarden, namespace: &str) {
    let unbound = e2e::accounts::kubeconfig_for(&ipwarden.cluster, namespace, "ipwarden-agent").await.expect("token");
    let unbound = e2e::controlplane::client_for(&unbound).await.expect("agent client");
    let (node, _) = ipwarden.cluster.node_dirs().into_iter().next().expect("a node");
    let bound = e2e::accounts::node_bound_kubeconfig_for(&ipwarden.cluster, namespace, "ipwarden-agent", &node).await;
    let bound = e2e::controlplane::client_for(&bound.expect("node-bound token")).await.expect("agent client");
    let dry_run = PostParams { dry_run: true, ..PostParams::default() };
    let lease: k8s_openapi::api::coordination::v1::Lease =
        serde_json::from_value(json!({"metadata": {"name": format!("ipwarden-agent-{node}")}})).expect("lease");
    let claim: IPClaim = serde_json::from_value(json!({
        "apiVersion": "ipwarden.io/v1alpha1", "kind": "IPClaim", "metadata": {"name": "probe"},
        "spec": {"podUid": "probe", "node": node, "boundAt": "2026-01-01T00:00:00Z", "interfaces": []},
    }))
    .expect("claim");
    let block = |cidr: &str, allocations: serde_json::Value| {
        let spec = json!({"pool": "probe", "cidr": cidr, "allocations": allocations});
        let name = format!("probe-{}", cidr.replace(['.', ':', '/'], "-"));
        IPBlock::new(&name, serde_json::from_value(spec).expect("block spec"))
    };
    let elsewhere = json!({"192.0.2.1": record_json("default", "probe", "probe", "probe-other-node", None, false)});
    let foreign = block("192.0.2.0/24", elsewhere);
    let pools = Api::<IPPool>::all(ipwarden.client()).list(&ListParams::default()).await.expect("pools");
    let over_a_pool = pools.items.first().map(|pool| block(&pool.spec.cidr, json!({})));
    let refused = |rule: &str, result: Result<(), kube::Error>| match result {
        Err(kube::Error::Api(s)) if s.message.contains(rule) => Ok(()),
        other => Err(format!("{rule}: {other:?}")),
    };
    wait::until("the node-bound write policies are enforced", TIMEOUT, || async {
        let blocks = Api::<IPBlock>::all(bound.clone());
        let mut checks = vec![
            refused(
                "ipwarden T0",
                Api::namespaced(unbound.clone(), namespace).create(&dry_run, &lease).await.map(drop),
            ),
            refused(
                "ipwarden T0",
                Api::namespaced(unbound.clone(), namespace).create(&dry_run, &claim).await.map(drop),
            ),
            refused("ipwarden B-U3", blocks.create(&dry_run, &foreign).await.map(drop)),
        ];
        if let Some(block) = &over_a_pool {
            checks.push(refused("ipwarden B-C2", blocks.create(&dry_run, block).await.map(drop)));
        }
        Ok(match checks.into_iter().find_map(Result::err) {
            None => Probe::Done(()),
            Some(last) => Probe::Pending(last),
        })
    })
    .await
    .expect("policies enforced");
}
