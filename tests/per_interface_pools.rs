//! Per-interface pools (Multus): a pod attached to two networks gets each interface's IPs
//! from that interface's pools: the pod's `ipwarden.io/pools` entry for the interface, else
//! the network's netconf `ipam.pools`, else the pod's own rules (`ipwarden.io/pool`, the
//! namespace's, the default pools). Status lists each record's interface and network,
//! `ipwarden check` finds nothing wrong with the second interface's records, the
//! controller's sweeps keep them while the pod lives, an interface's DEL releases that
//! interface's records alone, and the DELs release them all (the controller, when the DELs
//! are lost).
//! A pool that does not exist, named by a netconf or the annotation, fails the ADD naming it.

mod support;

use std::collections::BTreeMap;

use e2e::cni::{Invocation, PodArgs};
use e2e::kubelet::{EXTRA_INTERFACES_ANNOTATION, EXTRA_NETCONF_ANNOTATION, SKIP_DEL_ANNOTATION};
use e2e::wait::{self, Probe};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use support::{Ipwarden, TIMEOUT, records};

const NS: &str = "default";

/// Creates pod `name` (label `app=multus`) bound to `node`, with `annotations`.
async fn create_pod(client: &kube::Client, name: &str, node: &str, annotations: Value) {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS, "labels": {"app": "multus"}, "annotations": annotations},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "app", "image": "registry.invalid/ipwarden-test/app:1"}]},
    }))
    .expect("pod");
    Api::<Pod>::namespaced(client.clone(), NS).create(&PostParams::default(), &pod).await.expect("create pod");
}

/// The netconf fields of network `net-b` (a NetworkAttachmentDefinition's config) with `pools`.
fn network_b(ipwarden: &Ipwarden, pools: Value) -> Value {
    let socket = ipwarden.cluster.nodes()[0].dir().join("agent.sock");
    json!({"name": "net-b", "ipam": {"type": "ipwarden", "pools": pools, "socket": socket}})
}

/// The netconf the runtime hands the plugin for an attachment to `net-b` with `pools`.
fn netconf_b(ipwarden: &Ipwarden, pools: Value) -> Value {
    let mut netconf = json!({"cniVersion": "1.1.0", "type": "ipwarden-cni"});
    if let (Some(conf), Some(fields)) = (netconf.as_object_mut(), network_b(ipwarden, pools).as_object()) {
        conf.extend(fields.clone());
    }
    netconf
}

/// Runs the real plugin's DEL of `pod`'s `interface` alone (as a runtime detaching one
/// network does), with the sandbox and pod UID its record holds.
async fn del_interface(client: &kube::Client, pod: &str, interface: &str, netconf: &Value) {
    let record = records(client)
        .await
        .into_values()
        .find(|r| r.pod.name == pod && r.interface == interface)
        .unwrap_or_else(|| panic!("{pod} holds a record of {interface}"));
    let args = PodArgs { namespace: NS.into(), name: pod.into(), uid: record.pod.uid.clone() };
    let call =
        Invocation { command: "DEL", container_id: &record.container_id, ifname: interface, pod: Some(&args), netconf };
    support::network().invoke(&call).await.unwrap_or_else(|e| panic!("DEL of {pod} {interface}: {e}"));
}

/// The pod's records: interface -> (network, IPs).
async fn interfaces_of(client: &kube::Client, pod: &str) -> BTreeMap<String, (String, Vec<String>)> {
    let mut found: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
    for (ip, record) in records(client).await.into_iter().filter(|(_, r)| r.pod.name == pod) {
        let entry = found.entry(record.interface).or_insert_with(|| (record.network, Vec::new()));
        entry.1.push(ip);
    }
    found
}

fn ipwarden_cli(ipwarden: &Ipwarden, args: &[&str]) -> String {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_ipwarden"))
        .args(args)
        .env("KUBECONFIG", ipwarden.cluster.kubeconfig())
        .output()
        .expect("ipwarden runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "ipwarden {args:?}: {}: {stderr}", output.status);
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_interface_of_a_pod_on_two_networks_draws_from_its_own_pools_and_keeps_them_while_the_pod_lives() {
    let pools = [
        ("a-v4", json!({"cidr": "10.84.0.0/24", "default": true})),
        ("b-v4", json!({"cidr": "10.85.0.0/24"})),
        ("b-v6", json!({"cidr": "fd85::/120"})),
    ];
    // A sandbox whose DEL is lost holds a record marked for release this long (default 60 s).
    let mut ipwarden = Ipwarden::start(1, &pools, &["--release-sandbox-grace-seconds=2"]).await;
    let client = ipwarden.client();
    let net1_on_b = json!({"net1": network_b(&ipwarden, json!(["b-v4", "b-v6"]))}).to_string();
    let two_networks = json!({EXTRA_INTERFACES_ANNOTATION: "net1", EXTRA_NETCONF_ANNOTATION: net1_on_b});
    create_pod(&client, "multi", "node-0", two_networks.clone()).await;
    // The annotation names net1's pools: they replace the netconf's, and a-v4 serves both
    // interfaces of the pod (two IPs of one pool, one per interface).
    let mut overridden = two_networks.clone();
    overridden["ipwarden.io/pools"] = json!(json!({"net1": ["a-v4"]}).to_string());
    create_pod(&client, "override", "node-0", overridden).await;
    // A pod whose DELs the runtime loses: the controller reclaims both interfaces' IPs.
    let mut lost = two_networks.clone();
    lost[SKIP_DEL_ANNOTATION] = json!("true");
    create_pod(&client, "lost-del", "node-0", lost).await;
    support::wait_pods_with_ips(&client, NS, "app=multus", 3).await;

    let multi = interfaces_of(&client, "multi").await;
    let (network, eth0) = &multi["eth0"];
    assert_eq!(network, "ipwarden");
    assert!(eth0.len() == 1 && eth0[0].starts_with("10.84.0."), "eth0 from the default pool: {eth0:?}");
    let (network, net1) = &multi["net1"];
    assert_eq!(network, "net-b");
    let mut net1 = net1.clone();
    net1.sort();
    assert!(net1.len() == 2 && net1[0].starts_with("10.85.0.") && net1[1].starts_with("fd85::"), "{net1:?}");
    let overridden = interfaces_of(&client, "override").await;
    let (eth0, net1) = (&overridden["eth0"].1, &overridden["net1"].1);
    assert!(eth0.len() == 1 && eth0[0].starts_with("10.84.0."), "{eth0:?}");
    assert!(net1.len() == 1 && net1[0].starts_with("10.84.0.") && net1 != eth0, "the annotation wins: {net1:?}");

    // Status lists each record's interface and network; check finds nothing wrong although
    // the pod's status.podIPs lists eth0's IP only.
    let status: Value = serde_json::from_str(&ipwarden_cli(&ipwarden, &["status", "-a", "-o", "json"])).expect("json");
    let rows: Vec<(String, String, String)> = status["ips"]
        .as_array()
        .expect("ips")
        .iter()
        .filter(|row| row["pod"] == "default/multi")
        .map(|row| {
            let text = |key: &str| row[key].as_str().unwrap_or_default().to_string();
            (text("interface"), text("network"), text("state"))
        })
        .collect();
    let used = |interface: &str, network: &str| (interface.to_string(), network.to_string(), "used".to_string());
    assert_eq!(rows, [used("eth0", "ipwarden"), used("net1", "net-b"), used("net1", "net-b")], "{status}");
    let problems = ipwarden::cli::check::problems(&client).await.expect("check");
    assert!(problems.is_empty(), "{problems:?}");

    // A running controller's sweeps release neither interface's records while the pod lives.
    let before = records(&client).await;
    let controller = ipwarden.start_controller("controller", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(controller).await;
    ipwarden.wait_sweeps(controller, 2).await;
    let after = records(&client).await;
    assert_eq!(after.keys().collect::<Vec<_>>(), before.keys().collect::<Vec<_>>(), "nothing released");
    assert!(after.values().all(|r| r.repaired_at.is_none()), "nothing repaired");

    // Unknown pools fail the ADD naming the pool and who named it; a malformed annotation
    // fails naming the annotation. The pods are bound to a node no kubelet runs, so the test
    // sees the answers.
    create_pod(&client, "by-netconf", "elsewhere", json!({})).await;
    create_pod(&client, "by-annotation", "elsewhere", json!({"ipwarden.io/pools": r#"{"net1": ["missing"]}"#})).await;
    create_pod(&client, "malformed", "elsewhere", json!({"ipwarden.io/pools": "net1=b-v4"})).await;
    let network = support::network();
    let add = |pod: &'static str, pools: Value| {
        let (network, client, netconf) = (network.clone(), client.clone(), netconf_b(&ipwarden, pools));
        async move {
            let uid = Api::<Pod>::namespaced(client, NS).get(pod).await.expect("pod").uid().unwrap_or_default();
            let args = PodArgs { namespace: NS.into(), name: pod.into(), uid };
            let call =
                Invocation { command: "ADD", container_id: pod, ifname: "net1", pod: Some(&args), netconf: &netconf };
            network.invoke(&call).await.expect_err("the ADD fails").to_string()
        }
    };
    let err = add("by-netconf", json!(["b-v4", "nope"])).await;
    assert!(err.contains("code 100") && err.contains("pool nope") && err.contains("net-b"), "{err}");
    let err = add("by-annotation", json!(["b-v4"])).await;
    assert!(err.contains("code 100") && err.contains("pool missing") && err.contains("ipwarden.io/pools"), "{err}");
    let err = add("malformed", json!(["b-v4"])).await;
    assert!(err.contains("code 100") && err.contains("ipwarden.io/pools") && err.contains("net1=b-v4"), "{err}");
    let err = add("by-netconf", json!(["b-v4", "a-v4"])).await;
    assert!(err.contains("both IPv4") && err.contains("net-b"), "one pool per family: {err}");
    let failed = ["by-netconf", "by-annotation", "malformed"];
    assert!(!records(&client).await.values().any(|r| failed.contains(&r.pod.name.as_str())), "nothing allocated");

    // Each interface's DEL releases that interface's records alone: net1's leaves eth0's IP
    // held, and eth0's leaves net1's.
    let multi = interfaces_of(&client, "multi").await;
    del_interface(&client, "multi", "net1", &netconf_b(&ipwarden, json!(["b-v4", "b-v6"]))).await;
    let eth0_only = BTreeMap::from([("eth0".to_string(), multi["eth0"].clone())]);
    assert_eq!(interfaces_of(&client, "multi").await, eth0_only, "net1's DEL releases net1's IPs only");
    let overridden = interfaces_of(&client, "override").await;
    let socket = ipwarden.cluster.nodes()[0].dir().join("agent.sock");
    let eth0_netconf =
        json!({"cniVersion": "1.1.0", "name": e2e::ipwarden::NETWORK, "type": "ipwarden-cni", "socket": socket});
    del_interface(&client, "override", "eth0", &eth0_netconf).await;
    let net1_only = BTreeMap::from([("net1".to_string(), overridden["net1"].clone())]);
    assert_eq!(interfaces_of(&client, "override").await, net1_only, "eth0's DEL releases eth0's IP only");

    // Deleting the pods: the runtime's DELs of both interfaces release every record, and the
    // controller those of the pod whose DELs were lost.
    assert_eq!(interfaces_of(&client, "lost-del").await.len(), 2, "lost-del holds eth0 and net1");
    let api = Api::<Pod>::namespaced(client.clone(), NS);
    for pod in ["multi", "override", "lost-del"] {
        api.delete(pod, &DeleteParams::default()).await.expect("delete");
    }
    wait::until("both pods' records released", TIMEOUT, || async {
        let left: Vec<String> = records(&client).await.into_keys().collect();
        Ok(if left.is_empty() { Probe::Done(()) } else { Probe::Pending(format!("still recorded: {left:?}")) })
    })
    .await
    .expect("the DELs and the controller release both interfaces' IPs");
}
