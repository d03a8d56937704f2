//! The operator CLI against a real cluster: `ipwarden check` finds nothing on a consistent
//! cluster and reports an injected leak with exit status 1; `ipwarden status` counts used
//! IPs and leak candidates per pool and node; `ipwarden gc --dry-run` shows the leader's own
//! plan; `ipwarden status` lists IPs in numeric order and counts sticky records as `kubectl
//! get ippools` does.

mod support;

use e2e::wait::{self, Probe};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use support::{
    Ipwarden, TIMEOUT, column, create_pod, create_statefulset, inject_record, record_json, wait_pods_with_ips,
};

fn ipwarden_cli(ipwarden: &Ipwarden, args: &[&str]) -> (bool, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_ipwarden"))
        .args(args)
        .env("KUBECONFIG", ipwarden.cluster.kubeconfig())
        .output()
        .expect("ipwarden runs");
    (output.status.success(), String::from_utf8_lossy(&output.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_and_status_report_a_consistent_cluster_and_injected_leaks_in_numeric_ip_order() {
    let ipwarden = Ipwarden::start(1, &[("pool", json!({"cidr": "10.90.0.0/24", "default": true}))], &[]).await;
    let client = ipwarden.client();
    create_pod(&client, "default", "a", "node-0", json!({"app": "cli"})).await;
    create_pod(&client, "default", "b", "node-0", json!({"app": "cli"})).await;
    wait_pods_with_ips(&client, "default", "app=cli", 2).await;

    let (ok, text) = ipwarden_cli(&ipwarden, &["check"]);
    assert!(ok, "a consistent cluster passes: {text}");
    assert!(text.contains("no problem found"));
    let (_, status) = ipwarden_cli(&ipwarden, &["status", "-o", "json"]);
    let status: Value = serde_json::from_str(&status).expect("status JSON");
    assert_eq!(status["summary"][0]["node"], "node-0");
    assert_eq!(status["summary"][0]["counts"]["used"], 2);
    assert_eq!(status["summary"][0]["counts"]["leakCandidates"], 0);
    assert_eq!(status["summary"][0]["counts"]["affineBlocks"], 1, "node-0 claimed the pool's block: {status}");

    let leak = record_json("default", "ghost", "ghost-uid", "node-0", None, false);
    inject_record(&client, "pool", "pool-10-90-0-0-24", "10.90.0.0/24", "10.90.0.250", leak).await;
    let (ok, report) = ipwarden_cli(&ipwarden, &["check", "-o", "json"]);
    assert!(!ok, "a leak makes check exit non-zero");
    let report: Value = serde_json::from_str(&report).expect("check JSON");
    assert_eq!(report["problems"][0]["kind"], "leakedRecord");
    assert_eq!(report["problems"][0]["subject"], "10.90.0.250");
    let (_, table) = ipwarden_cli(&ipwarden, &["status", "-a"]);
    assert!(table.contains("leak-candidate") && table.contains("10.90.0.250"), "status -a lists the leak: {table}");

    for (ip, block, cidr) in [
        ("10.90.0.9", "pool-10-90-0-0-24", "10.90.0.0/24"),
        ("10.90.0.10", "pool-10-90-0-0-24", "10.90.0.0/24"),
        ("fd00:90::9", "pool-fd00-90--120", "fd00:90::/120"),
    ] {
        let leak = record_json("default", &format!("ghost-{ip}"), &format!("uid-{ip}"), "node-0", None, false);
        inject_record(&client, "pool", block, cidr, ip, leak).await;
    }
    let (_, table) = ipwarden_cli(&ipwarden, &["status", "-a"]);
    let listed: Vec<&str> = table
        .split("\n\n")
        .nth(1)
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let injected: Vec<&str> = listed
        .iter()
        .copied()
        .filter(|ip| ["10.90.0.9", "10.90.0.10", "10.90.0.250", "fd00:90::9"].contains(ip))
        .collect();
    assert_eq!(
        injected,
        ["10.90.0.9", "10.90.0.10", "10.90.0.250", "fd00:90::9"],
        "numeric order, IPv4 first: {table}"
    );
    let mut sorted: Vec<std::net::IpAddr> = listed.iter().map(|ip| ip.parse().expect("an IP")).collect();
    sorted.sort();
    let sorted: Vec<String> = sorted.iter().map(ToString::to_string).collect();
    assert_eq!(listed, sorted, "every IP in numeric order: {table}");
}

/// `kubectl get ippools` and `ipwarden status` both have a STICKY column; both count the
/// records of sticky workloads (StatefulSet, KubeVirt), held by a pod now or not. A running
/// StatefulSet pod's record showed as 1 in the first and 0 in the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_kubectl_get_ippools_count_the_same_sticky_records() {
    let mut ipwarden = Ipwarden::start(1, &[("pool", json!({"cidr": "10.96.0.0/24", "default": true}))], &[]).await;
    let client = ipwarden.client();
    let controller = ipwarden.start_controller("sticky", &[]);
    ipwarden.wait_leader(controller).await;
    create_statefulset(&client, "default", "web", json!({})).await;
    create_pod(&client, "default", "plain", "node-0", json!({"app": "plain"})).await;
    wait_pods_with_ips(&client, "default", "app=web", 1).await;
    wait_pods_with_ips(&client, "default", "app=plain", 1).await;
    let kubectl_args =
        vec![format!("--kubeconfig={}", ipwarden.cluster.kubeconfig().display()), "get".into(), "ippools".into()];
    let kubectl = wait::until("kubectl get ippools counting 2 allocated IPs", TIMEOUT, || async {
        let table = e2e::process::run_tool(&ipwarden.cluster.kubectl(), &kubectl_args, None).await?;
        let allocated = column(&table, "pool", "ALLOCATED");
        Ok(if allocated.as_deref() == Some("2") { Probe::Done(table) } else { Probe::Pending(table) })
    })
    .await
    .expect("the controller writes the pool's counts");
    assert_eq!(column(&kubectl, "pool", "STICKY").as_deref(), Some("1"), "the StatefulSet pod's record: {kubectl}");
    let (ok, status) = ipwarden_cli(&ipwarden, &["status"]);
    assert!(ok, "status: {status}");
    assert_eq!(
        column(&status, "pool", "STICKY"),
        column(&kubectl, "pool", "STICKY"),
        "one meaning:\n{status}\n{kubectl}"
    );
}

/// A controller run with an hour of additional grace keeps tracing a pod stuck Terminating;
/// the dry run must show that leader's plan, not one made with default rule settings (5 s of
/// additional grace), which would release the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_dry_run_shows_the_plan_the_leader_makes_with_its_own_rule_flags() {
    let mut ipwarden = Ipwarden::start(1, &[("pool", json!({"cidr": "10.91.0.0/24", "default": true}))], &[]).await;
    let client = ipwarden.client();
    let flags = ["--full-scan-interval-seconds=3600", "--additional-grace-seconds=3600"];
    let controller = ipwarden.start_controller("dry", &flags);
    ipwarden.wait_leader(controller).await;
    // Bound to a node without a kubelet, so nothing runs it and only the finalizer holds it.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let stuck: Pod = serde_json::from_value(json!({
        "metadata": {"name": "stuck", "finalizers": ["e2e.ipwarden.io/hold"]},
        "spec": {"nodeName": "node-gone", "containers": [{"name": "app", "image": "registry.invalid/ipwarden-test/app:1"}]},
    }))
    .expect("pod");
    let uid = pods.create(&PostParams::default(), &stuck).await.expect("stuck pod").uid().expect("uid");
    let record = record_json("default", "stuck", &uid, "node-0", None, false);
    inject_record(&client, "pool", "pool-10-91-0-0-24", "10.91.0.0/24", "10.91.0.240", record).await;
    pods.delete("stuck", &DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() })
        .await
        .expect("delete the stuck pod");
    let deleted_at = pods.get("stuck").await.expect("stuck pod").metadata.deletion_timestamp.expect("terminating").0;
    // The condition is the clock itself: the deadline default settings would give the pod.
    wait::until("6 s past the stuck pod's deletionTimestamp", TIMEOUT, || async {
        let past = jiff::Timestamp::now().duration_since(deleted_at).as_secs() >= 6;
        Ok(if past { Probe::Done(()) } else { Probe::Pending("within default settings' deadline".into()) })
    })
    .await
    .expect("past the default deadline");

    let (ok, dry) = ipwarden_cli(&ipwarden, &["gc", "--dry-run", "-o", "json"]);
    assert!(ok, "dry run: {dry}");
    let plan: Value = serde_json::from_str(&dry).expect("dry-run JSON");
    assert_eq!(plan["changes"], json!([]), "the leader traces the pod for an hour: nothing to change; {plan}");
    assert_eq!(plan["traced"], 1, "the stuck pod's record is traced until its deadline: {plan}");
    let (ok, run) = ipwarden_cli(&ipwarden, &["gc", "-o", "json"]);
    assert!(ok, "gc: {run}");
    let report: Value = serde_json::from_str(&run).expect("report JSON");
    assert_eq!(
        (report["traced"].as_u64(), report["planned"].as_u64()),
        (Some(1), Some(0)),
        "the sweep agrees: {report}"
    );
}
