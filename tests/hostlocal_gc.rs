//! `ipwarden gc host-local` against Debian's real host-local plugin: reservations made by the
//! plugin for sandboxes that are gone are released; those live pods hold, young ones, and the
//! plugin's own lock and last_reserved_ip files stay.

use std::time::{Duration, SystemTime};

use e2e::cni::{Invocation, NodeInfo, PodArgs};
use e2e::{Cluster, ClusterOptions};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};

fn files(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("store")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn age(path: &std::path::Path, ago: Duration) {
    let file = std::fs::File::options().write(true).open(path).expect("open reservation");
    file.set_modified(SystemTime::now() - ago).expect("set mtime");
}

/// Runs `ipwarden gc host-local` for node-0 (minimum age 60 s) and returns the released IPs.
fn gc_host_local(cluster: &Cluster, dry: bool) -> Vec<String> {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_ipwarden"));
    command.args(["gc", "-o", "json", "host-local", "--network", "e2e-host-local", "--node", "node-0"]);
    command.arg("--data-dir").arg(cluster.nodes()[0].dir().join("host-local")).args(["--min-age-seconds", "60"]);
    if dry {
        command.arg("--dry-run");
    }
    let output = command.env("KUBECONFIG", cluster.kubeconfig()).output().expect("ipwarden runs");
    assert!(output.status.success(), "gc host-local: {}", String::from_utf8_lossy(&output.stderr));
    let report: Value = serde_json::from_slice(&output.stdout).expect("JSON report");
    let mut ips: Vec<String> = report["released"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["ip"].as_str().map(String::from))
        .collect();
    ips.sort();
    ips
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_host_local_reservations_are_released_and_live_young_and_plugin_files_kept() {
    let cluster = Cluster::start(ClusterOptions { nodes: 1, ..ClusterOptions::default() }).await.expect("cluster");
    let client = cluster.client();
    for name in ["live-a", "live-b"] {
        let pod: Pod = serde_json::from_value(json!({"metadata": {"name": name, "labels": {"app": "hl"}},
            "spec": {"nodeName": "node-0", "containers": [{"name": "c", "image": "registry.invalid/c:1"}]}}))
        .expect("pod");
        Api::<Pod>::namespaced(client.clone(), "default").create(&PostParams::default(), &pod).await.expect("pod");
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let live_ips = e2e::wait::until("live pods with host-local IPs", Duration::from_secs(120), || async {
        let list =
            pods.list(&kube::api::ListParams::default().labels("app=hl")).await.map_err(e2e::Error::kube("list"))?;
        let ips: Vec<String> = list.items.iter().filter_map(|p| p.status.as_ref()?.pod_ip.clone()).collect();
        Ok(if ips.len() == 2 { e2e::wait::Probe::Done(ips) } else { e2e::wait::Probe::Pending(format!("{ips:?}")) })
    })
    .await
    .expect("pods run");

    // Reservations of sandboxes the runtime forgot: made by the real plugin, then aged.
    let node = &cluster.nodes()[0];
    let network = e2e::CniNetwork::host_local(&e2e::binaries::standard_cni_plugins().expect("host-local"));
    let netconf = (network.netconf)(&NodeInfo { name: "node-0".into(), index: 0, dir: node.dir().to_path_buf() });
    let args = PodArgs { namespace: "default".into(), name: "gone".into(), uid: "gone-uid".into() };
    let mut stale_ips = Vec::new();
    for container in ["stale-1", "stale-2", "young"] {
        let call =
            Invocation { command: "ADD", container_id: container, ifname: "eth0", pod: Some(&args), netconf: &netconf };
        let result: Value = network.invoke(&call).await.expect("host-local ADD").expect("result");
        let ip = e2e::cni::result_ips(&result).remove(0);
        if container != "young" {
            stale_ips.push(ip);
        }
    }
    let store = node.dir().join("host-local/e2e-host-local");
    // An old plugin's file holds only the container ID.
    std::fs::write(store.join("10.244.0.250"), "old-format-container").expect("old-format reservation");
    stale_ips.push("10.244.0.250".to_string());
    for ip in stale_ips.iter().chain(&live_ips) {
        age(&store.join(ip), Duration::from_secs(3600));
    }
    let before = files(&store);

    let mut expected = stale_ips.clone();
    expected.sort();
    assert_eq!(gc_host_local(&cluster, true), expected, "the dry run lists exactly the stale reservations");
    assert_eq!(files(&store), before, "a dry run removes nothing");
    assert_eq!(gc_host_local(&cluster, false), expected, "the stale reservations are released");
    let after = files(&store);
    for ip in &stale_ips {
        assert!(!after.contains(ip), "{ip} released");
    }
    for ip in &live_ips {
        assert!(after.contains(ip), "{ip} is held by a live pod and stays");
    }
    assert!(
        after.contains(&"lock".to_string()) && after.iter().any(|f| f.starts_with("last_reserved_ip")),
        "plugin files stay"
    );
    assert_eq!(
        after.len(),
        live_ips.len() + 1 + 2,
        "live reservations, the young one, lock and last_reserved_ip remain"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_pods_old_host_local_reservation_is_kept() {
    let cluster = Cluster::start(ClusterOptions { nodes: 1, ..ClusterOptions::default() }).await.expect("cluster");
    let client = cluster.client();
    // Deleted, but its containers take 120 s to stop: it still serves from its IP.
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "draining", "annotations": {e2e::kubelet::STOP_SECONDS_ANNOTATION: "120"}},
        "spec": {"nodeName": "node-0", "terminationGracePeriodSeconds": 120,
                 "containers": [{"name": "c", "image": "registry.invalid/c:1"}]}}))
    .expect("pod");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.create(&PostParams::default(), &pod).await.expect("pod");
    let ip = e2e::wait::until("the pod with a host-local IP", Duration::from_secs(120), || async {
        let pod = pods.get("draining").await.map_err(e2e::Error::kube("get"))?;
        Ok(match pod.status.and_then(|s| s.pod_ip) {
            Some(ip) => e2e::wait::Probe::Done(ip),
            None => e2e::wait::Probe::Pending("no IP yet".into()),
        })
    })
    .await
    .expect("pod runs");
    pods.delete("draining", &kube::api::DeleteParams::default()).await.expect("delete");
    let store = cluster.nodes()[0].dir().join("host-local/e2e-host-local");
    age(&store.join(&ip), Duration::from_secs(3600));

    assert_eq!(gc_host_local(&cluster, false), Vec::<String>::new(), "nothing is released while the pod drains");
    assert!(files(&store).contains(&ip), "the draining pod's reservation stays");
}
