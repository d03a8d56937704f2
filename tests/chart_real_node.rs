//! ipwarden installed the way users install it, on real nodes (kubelet + containerd): `helm
//! install` of the chart, whose agent DaemonSet and controller Deployment run as pods from
//! ipwarden's image under kubelet (docs/testing.md, "The chart on real nodes").

mod support;

use std::collections::BTreeSet;
use std::path::Path;

use e2e::cluster::RealNodesOptions;
use e2e::realnode::chart::{self, AGENT_SELECTOR, CONTROLLER_SELECTOR, ChartInstallation, NAMESPACE};
use e2e::realnode::{NODE_VIEW, Runtime};
use e2e::wait::{self, Probe};
use e2e::{Cluster, ClusterOptions};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::realnode::netns_ips;
use support::{TIMEOUT, metric, pod_template};

/// The live pods of `namespace` matching `selector`, once `count` of them run and are Ready.
async fn wait_ready_pods(client: &Client, namespace: &str, selector: &str, count: usize) -> Vec<Pod> {
    chart::ready_pods(client, namespace, selector, count).await.expect("the pods run and are Ready")
}

fn pod_ip(pod: &Pod) -> String {
    pod.status.as_ref().and_then(|s| s.pod_ip.clone()).unwrap_or_default()
}

/// Runs the `ipwarden` CLI with `args` against `cluster`, as an admin would; whether it
/// succeeded, and its output.
fn ipwarden_cli(cluster: &Cluster, args: &[&str]) -> (bool, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_ipwarden"))
        .args(args)
        .env("KUBECONFIG", cluster.kubeconfig())
        .output()
        .expect("ipwarden runs");
    (output.status.success(), String::from_utf8_lossy(&output.stdout).into_owned())
}

async fn scrape(address: &str, port: u16) -> String {
    e2e::ipwarden::get_at(address, port, "/metrics").await.unwrap_or_else(|e| panic!("scraping {address}:{port}: {e}"))
}

/// A cluster of `nodes` real nodes with the chart installed (image tag `tags[0]`, every tag of
/// `tags` loaded), the documented pool, the agents and both controllers Ready, the Nodes Ready;
/// with `from_empty`, the nodes' plugin and conflist removed first, so the init containers
/// install them.
async fn installed(nodes: usize, tags: &[&str], from_empty: bool) -> (Cluster, ChartInstallation, Vec<Pod>, Vec<Pod>) {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let binary = Path::new(env!("CARGO_BIN_EXE_ipwarden"));
    let options = ClusterOptions {
        nodes: 0,
        real_nodes: Some(RealNodesOptions {
            count: nodes,
            ipwarden: binary.to_path_buf(),
            runtime: Runtime::Containerd,
            ipam: None,
        }),
        ..ClusterOptions::default()
    };
    let mut cluster = Cluster::start(options).await.expect("a cluster with a real node");
    let client = cluster.client();
    if from_empty {
        for file in chart::installed_files(&cluster) {
            std::fs::remove_file(&file).unwrap_or_else(|e| panic!("removing {}: {e}", file.display()));
        }
    }
    let images = cluster.dir().to_path_buf();
    for tag in tags {
        chart::load_image(&cluster, binary, tag, &images).await.expect("a test image imported");
    }
    let installation = chart::install(&cluster, tags[0]).await.expect("helm install");
    e2e::ipwarden::create_pool(&client, "default", json!({"cidr": "10.244.0.0/16", "default": true}))
        .await
        .expect("the documented pool");
    let (agents, controllers) = chart::wait_running(&mut cluster).await.expect("the chart's pods run, the Node Ready");
    (cluster, installation, agents, controllers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_installed_on_a_real_node_runs_from_its_image_and_gives_pods_their_ips() {
    let (cluster, _installation, agents, controllers) = installed(1, &["e2e-1"], true).await;
    let client = cluster.client();
    for file in chart::installed_files(&cluster) {
        assert!(file.exists(), "the init container installed {}", file.display());
    }
    let leases: Api<Lease> = Api::namespaced(client.clone(), NAMESPACE);
    let names: BTreeSet<String> = controllers.iter().map(ResourceExt::name_any).collect();
    let holder = wait::until("a controller pod holds the Lease", TIMEOUT, || async {
        let lease = leases.get_opt("ipwarden-controller").await.map_err(e2e::Error::kube("reading the Lease"))?;
        let holder = lease.and_then(|l| l.spec).and_then(|s| s.holder_identity).unwrap_or_default();
        Ok(if names.contains(&holder) { Probe::Done(holder) } else { Probe::Pending(holder) })
    })
    .await
    .expect("one controller leads");

    // A user's Deployment on the node: its pods get IPs from the chart's agent.
    let spec = e2e::realnode::workload_spec();
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "web"}}, "template": pod_template("web", spec)},
    }))
    .expect("a Deployment");
    Api::<Deployment>::namespaced(client.clone(), "default")
        .create(&Default::default(), &deployment)
        .await
        .expect("create the Deployment");
    let web = wait_ready_pods(&client, "default", "app=web", 3).await;
    let node = &cluster.real_nodes()[0];
    let pod_ips: BTreeSet<String> = web.iter().chain(&controllers).map(pod_ip).collect();
    assert_eq!(pod_ips.len(), 5, "every pod its own IP: {pod_ips:?}");
    assert_eq!(netns_ips(node), pod_ips, "the IPs in the pods' network namespaces are their podIPs");
    let records: BTreeSet<String> = support::records(&client).await.into_keys().collect();
    assert_eq!(records, pod_ips, "one record per pod IP");
    let (ok, text) = ipwarden_cli(&cluster, &["check"]);
    assert!(ok && text.contains("no problem found"), "ipwarden check passes on the installation: {text}");
    let (ok, status) = ipwarden_cli(&cluster, &["status", "-o", "json"]);
    let status: serde_json::Value = serde_json::from_str(&status).unwrap_or_else(|e| panic!("{e}: {status}"));
    assert!(ok, "{status}");
    assert_eq!(status["summary"][0]["node"], node.name(), "{status}");
    assert_eq!(status["summary"][0]["counts"]["used"], 5, "ipwarden status counts the five pods: {status}");

    // Metrics from the pods' ports: the agent's on the node's network, the controllers' on theirs.
    let agent_metrics = scrape(&pod_ip(&agents[0]), 9612).await;
    assert!(metric(&agent_metrics, "ipwarden_agent_allocations_total{result=\"success\"}") >= 5.0, "{agent_metrics}");
    for controller in &controllers {
        let text = scrape(&pod_ip(controller), 9611).await;
        assert!(text.contains("ipwarden_"), "{}: {text}", controller.name_any());
    }

    // The agent pod deleted: the DaemonSet brings it back, and nothing changes.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    pods.delete(&agents[0].name_any(), &Default::default()).await.expect("delete the agent pod");
    wait::until("the agent pod replaced", TIMEOUT, || async {
        let listed = pods
            .list(&ListParams::default().labels(AGENT_SELECTOR))
            .await
            .map_err(e2e::Error::kube("listing agent pods"))?;
        Ok(if listed.items.iter().any(|p| p.uid() != agents[0].uid()) {
            Probe::Done(())
        } else {
            Probe::Pending(String::new())
        })
    })
    .await
    .expect("a new agent pod");
    let agents = wait_ready_pods(&client, NAMESPACE, AGENT_SELECTOR, 1).await;
    assert_unchanged(&client, &cluster, &pod_ips, "the agent pod replaced").await;

    // The agent's container SIGKILLed inside containerd: kubelet restarts it in the same pod.
    let killed = std::process::Command::new("kill").args(["-KILL", &agent_process(node.name())]).status();
    assert!(killed.as_ref().is_ok_and(|s| s.success()), "SIGKILL the agent: {killed:?}");
    wait::until("the agent container restarted and Ready", TIMEOUT, || async {
        let pod = pods.get(&agents[0].name_any()).await.map_err(e2e::Error::kube("reading the agent pod"))?;
        let status = pod.status.unwrap_or_default();
        let restarts: i32 = status.container_statuses.unwrap_or_default().iter().map(|c| c.restart_count).sum();
        let ready = status.conditions.unwrap_or_default().iter().any(|c| c.type_ == "Ready" && c.status == "True");
        Ok(if restarts >= 1 && ready {
            Probe::Done(())
        } else {
            Probe::Pending(format!("{restarts} restarts, ready {ready}"))
        })
    })
    .await
    .expect("kubelet restarts the agent");
    assert_unchanged(&client, &cluster, &pod_ips, "the agent container killed").await;

    // The leading controller pod deleted: a live one leads, and nothing is released. Which one
    // is a race the test does not stage: the leader gives the Lease up as it stops, and the
    // standby or the Deployment's replacement, whichever asks first, takes it.
    pods.delete(&holder, &Default::default()).await.expect("delete the leading controller pod");
    let successor = wait::until("another controller pod leads", TIMEOUT, || async {
        let lease = leases.get_opt("ipwarden-controller").await.map_err(e2e::Error::kube("reading the Lease"))?;
        let now = lease.and_then(|l| l.spec).and_then(|s| s.holder_identity).unwrap_or_default();
        Ok(if !now.is_empty() && now != holder { Probe::Done(now) } else { Probe::Pending(now) })
    })
    .await
    .expect("a controller pod takes over");
    let running: BTreeSet<String> =
        wait_ready_pods(&client, NAMESPACE, CONTROLLER_SELECTOR, 2).await.iter().map(ResourceExt::name_any).collect();
    assert!(running.contains(&successor), "the leader {successor} is one of the running controller pods {running:?}");
    let web_ips: BTreeSet<String> = web.iter().map(pod_ip).collect();
    let records: BTreeSet<String> = support::records(&client).await.into_keys().collect();
    assert!(records.is_superset(&web_ips), "no workload IP released: {records:?}");
    cluster.stop();
}

/// The PID (on this host) of the chart's agent process on real node `node`: every node's agent
/// has the same command line, its `NODE_NAME` tells them apart.
fn agent_process(node: &str) -> String {
    let socket = format!("--socket={NODE_VIEW}/ipwarden/agent.sock");
    let output = std::process::Command::new("pgrep").args(["-f", "--", &socket]).output().expect("pgrep");
    let wanted = format!("NODE_NAME={node}");
    let pids: Vec<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| l.trim().to_string())
        .filter(|pid| {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            environ.split(|b| *b == 0).any(|v| v == wanted.as_bytes())
        })
        .collect();
    assert_eq!(pids.len(), 1, "one agent process of {node}: {pids:?}");
    pids[0].clone()
}

/// The IPs in the network namespaces of every real node's pods.
fn all_netns_ips(cluster: &Cluster) -> BTreeSet<String> {
    let mut all = BTreeSet::new();
    for node in cluster.real_nodes() {
        let ips = netns_ips(node);
        let twice: Vec<&String> = ips.intersection(&all).collect();
        assert!(twice.is_empty(), "an IP in network namespaces of two nodes: {twice:?}");
        all.extend(ips);
    }
    all
}

/// Asserts that the records, and the IPs in the pods' network namespaces, are still `pod_ips`.
async fn assert_unchanged(client: &Client, cluster: &Cluster, pod_ips: &BTreeSet<String>, after: &str) {
    let records: BTreeSet<String> = support::records(client).await.into_keys().collect();
    assert_eq!(&records, pod_ips, "no record changed: {after}");
    assert_eq!(&all_netns_ips(cluster), pod_ips, "no pod's IP changed: {after}");
}

/// Scales Deployment `name` of the default namespace to `replicas`.
async fn scale(client: &Client, name: &str, replicas: i32) {
    let patch = json!({"spec": {"replicas": replicas}});
    Api::<Deployment>::namespaced(client.clone(), "default")
        .patch(name, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch))
        .await
        .expect("scale the Deployment");
}

/// The IPs of the live pods on the pod network (every pod but the hostNetwork agent).
async fn pod_network_ips(client: &Client) -> Vec<String> {
    let pods = Api::<Pod>::all(client.clone()).list(&ListParams::default()).await.expect("list pods").items;
    pods.iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| !p.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false))
        .map(pod_ip)
        .filter(|ip| !ip.is_empty())
        .collect()
}

/// Waits until the records, the pods' `podIPs` and the IPs in their network namespaces are one
/// set, with no IP on two pods; returns it.
async fn wait_consistent(client: &Client, cluster: &Cluster, what: &str) -> BTreeSet<String> {
    wait::until(&format!("records, podIPs and network namespaces agree ({what})"), TIMEOUT, || async {
        let ips = pod_network_ips(client).await;
        let unique: BTreeSet<String> = ips.iter().cloned().collect();
        if unique.len() != ips.len() {
            return Err(e2e::Error::Tool { command: what.into(), reason: format!("an IP on two pods: {ips:?}") });
        }
        let records: BTreeSet<String> = support::records(client).await.into_keys().collect();
        let netns = all_netns_ips(cluster);
        Ok(if records == unique && netns == unique {
            Probe::Done(unique)
        } else {
            Probe::Pending(format!("records {records:?}, podIPs {unique:?}, netns {netns:?}"))
        })
    })
    .await
    .expect("the node settles")
}

/// The images of the live pods matching `selector` in the chart's namespace.
async fn images_of(client: &Client, selector: &str) -> BTreeSet<String> {
    let pods = Api::<Pod>::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default().labels(selector))
        .await
        .expect("list pods")
        .items;
    pods.iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .flat_map(|p| p.spec.iter().flat_map(|s| s.containers.iter().filter_map(|c| c.image.clone())))
        .collect()
}

/// The agent pods' `Ready` times and creation times show the DaemonSet's rollout one node at a
/// time: each new agent pod was created only once the one before it was Ready.
fn assert_one_node_at_a_time(agents: &[Pod]) {
    let ready_at = |pod: &Pod| {
        let conditions = pod.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
        conditions.into_iter().find(|c| c.type_ == "Ready").and_then(|c| c.last_transition_time).map(|t| t.0)
    };
    let mut agents: Vec<&Pod> = agents.iter().collect();
    agents.sort_by_key(|p| p.metadata.creation_timestamp.clone().map(|t| t.0));
    for pair in agents.windows(2) {
        let (earlier, later) = (pair[0], pair[1]);
        let ready = ready_at(earlier).expect("a Ready agent has a Ready time");
        let created = later.metadata.creation_timestamp.clone().expect("a creation time").0;
        assert!(
            ready <= created,
            "{} was created at {created} before {} was Ready at {ready}: two nodes without their agent",
            later.name_any(),
            earlier.name_any()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_helm_upgrade_under_a_changing_workload_then_an_uninstall_and_a_reinstall_change_no_pods_ip() {
    let (cluster, mut installation, _, _) = installed(2, &["e2e-1", "e2e-2"], false).await;
    let client = cluster.client();
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 12, "selector": {"matchLabels": {"app": "web"}},
                 "template": pod_template("web", e2e::realnode::workload_spec())},
    }))
    .expect("a Deployment");
    Api::<Deployment>::namespaced(client.clone(), "default")
        .create(&Default::default(), &deployment)
        .await
        .expect("create the Deployment");
    wait_ready_pods(&client, "default", "app=web", 12).await;

    // The upgrade rolls the agents of both nodes while the workload grows to 24 pods, loses
    // three by force and shrinks.
    installation.upgrade("e2e-2").await.expect("helm upgrade");
    scale(&client, "web", 24).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let listed = pods.list(&ListParams::default().labels("app=web")).await.expect("list web").items;
    for pod in listed.iter().take(3) {
        pods.delete(&pod.name_any(), &kube::api::DeleteParams { grace_period_seconds: Some(0), ..Default::default() })
            .await
            .expect("force-delete a web pod");
    }
    let grown = wait_ready_pods(&client, "default", "app=web", 24).await;
    let on: BTreeSet<String> = grown.iter().filter_map(|p| p.spec.as_ref().and_then(|s| s.node_name.clone())).collect();
    assert_eq!(on.len(), 2, "the workload runs on both real nodes: {on:?}");
    scale(&client, "web", 14).await;
    let upgraded = format!("{}:e2e-2", chart::IMAGE_REPOSITORY);
    wait::until("the agents and the controllers run the new image", TIMEOUT, || async {
        let images = [images_of(&client, AGENT_SELECTOR).await, images_of(&client, CONTROLLER_SELECTOR).await];
        Ok(if images.iter().all(|i| i.len() == 1 && i.contains(&upgraded)) {
            Probe::Done(())
        } else {
            Probe::Pending(format!("{images:?}"))
        })
    })
    .await
    .expect("the rollout ends");
    let agents = wait_ready_pods(&client, NAMESPACE, AGENT_SELECTOR, 2).await;
    assert_one_node_at_a_time(&agents);
    wait_ready_pods(&client, NAMESPACE, CONTROLLER_SELECTOR, 2).await;
    let web = wait_ready_pods(&client, "default", "app=web", 14).await;
    wait_consistent(&client, &cluster, "after the upgrade").await;
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(client.clone(), "default")
        .list(&ListParams::default())
        .await
        .expect("list events")
        .items;
    let retried = events.iter().filter(|e| e.reason.as_deref() == Some("FailedCreatePodSandBox")).count();
    println!("ADDs kubelet retried during the upgrade: {retried}");

    // Uninstalled with pods running: they keep their IPs; the CRDs and the records stay.
    installation.uninstall().await.expect("helm uninstall");
    let web_ips: BTreeSet<String> = web.iter().map(pod_ip).collect();
    let records: BTreeSet<String> = support::records(&client).await.into_keys().collect();
    assert!(records.is_superset(&web_ips), "the records stay: {records:?}");
    assert!(all_netns_ips(&cluster).is_superset(&web_ips), "the pods keep their IPs");
    for file in chart::installed_files(&cluster) {
        assert!(file.exists(), "the plugin and the conflist stay on the node (docs/install.md): {}", file.display());
    }
    // A pod created meanwhile waits for the agent (kubelet retries its ADD).
    let mut spec = e2e::realnode::workload_spec();
    spec["nodeName"] = json!(cluster.real_nodes()[0].name());
    let late: Pod =
        serde_json::from_value(json!({"metadata": {"name": "late", "labels": {"app": "late"}}, "spec": spec}))
            .expect("a pod");
    pods.create(&Default::default(), &late).await.expect("create the late pod");

    // Reinstalled: the agent takes over from its checkpoint, the pods keep their IPs, the late
    // pod gets one, and nothing is doubled or released.
    let _reinstalled = chart::install(&cluster, "e2e-2").await.expect("helm install again");
    wait_ready_pods(&client, NAMESPACE, AGENT_SELECTOR, 2).await;
    wait_ready_pods(&client, NAMESPACE, CONTROLLER_SELECTOR, 2).await;
    wait_ready_pods(&client, "default", "app=late", 1).await;
    let settled = wait_consistent(&client, &cluster, "after the reinstall").await;
    assert!(settled.is_superset(&web_ips), "no web pod's IP changed");
    cluster.stop();
}
