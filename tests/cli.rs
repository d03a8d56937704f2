//! The operator CLI against a real cluster: `ipwarden check` finds nothing on a consistent
//! cluster and reports an injected leak with exit status 1; `ipwarden status` counts used
//! IPs and leak candidates per pool and node.

mod support;

use serde_json::{Value, json};
use support::{Ipwarden, create_pod, inject_record, record_json, wait_pods_with_ips};

fn ipwarden_cli(ipwarden: &Ipwarden, args: &[&str]) -> (bool, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_ipwarden"))
        .args(args)
        .env("KUBECONFIG", ipwarden.cluster.kubeconfig())
        .output()
        .expect("ipwarden runs");
    (output.status.success(), String::from_utf8_lossy(&output.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_and_status_report_a_consistent_cluster_and_an_injected_leak() {
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

    let leak = record_json("default", "ghost", "ghost-uid", "node-0", None, false);
    inject_record(&client, "pool", "pool-10-90-0-0-24", "10.90.0.0/24", "10.90.0.250", leak).await;
    let (ok, report) = ipwarden_cli(&ipwarden, &["check", "-o", "json"]);
    assert!(!ok, "a leak makes check exit non-zero");
    let report: Value = serde_json::from_str(&report).expect("check JSON");
    assert_eq!(report["problems"][0]["kind"], "leakedRecord");
    assert_eq!(report["problems"][0]["subject"], "10.90.0.250");
    let (_, table) = ipwarden_cli(&ipwarden, &["status", "-a"]);
    assert!(table.contains("leak-candidate") && table.contains("10.90.0.250"), "status -a lists the leak: {table}");
}
