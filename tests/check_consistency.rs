//! `ipwarden check` on the real control plane where it used to be wrong: no false count
//! drift while a new leader has not yet rewritten a pool's status, and a draining pod that
//! still reports its IP counts as that IP's holder, so a second pod with it is a conflict.

mod support;

use std::sync::Mutex;

use e2e::wait::{self, Probe};
use ipwarden::crd::IPPool;
use ipwarden::gc::check::ProblemKind;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::{Ipwarden, TIMEOUT, create_pod, metric, wait_pods_with_ips};

const NS: &str = "default";

fn pool() -> [(&'static str, serde_json::Value); 1] {
    [("pool", json!({"cidr": "10.64.0.0/24", "default": true}))]
}

async fn allocated_in_status(client: &kube::Client) -> i64 {
    let pool = Api::<IPPool>::all(client.clone()).get("pool").await.expect("pool");
    pool.status.map(|s| s.allocated).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_no_count_drift_while_a_new_leader_has_not_rewritten_the_status() {
    let mut ipwarden = Ipwarden::start(2, &pool(), &[]).await;
    let client = ipwarden.client();
    ipwarden.start_controller("first", &[]);
    ipwarden.wait_leader(0).await;
    ipwarden.start_controller("second", &[]);
    for i in 0..3 {
        create_pod(&client, NS, &format!("before-{i}"), &format!("node-{}", i % 2), json!({"app": "drift"})).await;
    }
    wait_pods_with_ips(&client, NS, "app=drift", 3).await;
    wait::until("the leader's status counts the first pods", TIMEOUT, || async {
        let allocated = allocated_in_status(&client).await;
        Ok(if allocated == 3 { Probe::Done(()) } else { Probe::Pending(format!("{allocated} allocated")) })
    })
    .await
    .expect("status written");

    // The leader dies; pods get IPs while no replica writes status, until the standby leads
    // and rewrites it. `check` polls all along.
    let drift = Mutex::new(Vec::new());
    let polls = Mutex::new(0u32);
    ipwarden.controllers[0].kill();
    for i in 0..3 {
        create_pod(&client, NS, &format!("after-{i}"), &format!("node-{}", i % 2), json!({"app": "drift"})).await;
    }
    wait::until("the new leader's status counting every pod", TIMEOUT, || async {
        let problems = ipwarden::cli::check::problems(&client).await.expect("check reads the cluster");
        drift.lock().expect("lock").extend(problems.into_iter().filter(|p| p.kind == ProblemKind::CountDrift));
        *polls.lock().expect("lock") += 1;
        let allocated = allocated_in_status(&client).await;
        Ok(if allocated == 6 { Probe::Done(()) } else { Probe::Pending(format!("{allocated} allocated")) })
    })
    .await
    .expect("the new leader writes the status");
    let (drift, polls) = (drift.into_inner().expect("lock"), polls.into_inner().expect("lock"));
    assert!(polls >= 3, "check polled through the failover ({polls} polls)");
    let first: Vec<_> = drift.iter().take(3).collect();
    assert!(
        drift.is_empty(),
        "no count drift against a status older than the records: {} reports, first {first:?}",
        drift.len()
    );
    let problems = ipwarden::cli::check::problems(&client).await.expect("check");
    assert!(problems.is_empty(), "settled: no problem at all: {problems:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_pod_that_still_reports_an_ip_conflicts_with_a_new_pod_reporting_it() {
    let mut ipwarden = Ipwarden::start(1, &pool(), &[]).await;
    let client = ipwarden.client();
    ipwarden.start_controller("only", &[]);
    ipwarden.wait_leader(0).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    // Two pods no kubelet runs (their node does not exist) both report 10.64.0.77; the first
    // is being deleted but is still draining (a finalizer keeps it), as during a long grace.
    let draining: Pod = serde_json::from_value(json!({
        "metadata": {"name": "draining", "namespace": NS, "finalizers": ["e2e.ipwarden.io/hold"]},
        "spec": {"nodeName": "node-absent", "containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &draining).await.expect("create draining");
    create_pod(&client, NS, "newcomer", "node-absent", json!({"app": "newcomer"})).await;
    let status = json!({"status": {"phase": "Running", "podIP": "10.64.0.77", "podIPs": [{"ip": "10.64.0.77"}]}});
    for name in ["draining", "newcomer"] {
        pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await.expect("report the IP");
    }
    pods.delete("draining", &DeleteParams::default()).await.expect("delete: it drains");

    let problems = ipwarden::cli::check::problems(&client).await.expect("check");
    let conflict = problems.iter().find(|p| p.kind == ProblemKind::Conflict && p.subject == "10.64.0.77");
    let conflict = conflict.unwrap_or_else(|| panic!("check reports the conflict: {problems:?}"));
    assert!(
        conflict.detail.contains("default/draining") && conflict.detail.contains("default/newcomer"),
        "{conflict:?}"
    );
    wait::until("the controller's conflict gauge", TIMEOUT, || async {
        let text = ipwarden.scrape_controller(0).await.unwrap_or_default();
        let conflicts = metric(&text, "ipwarden_ip_conflicts");
        Ok(if conflicts == 1.0 { Probe::Done(()) } else { Probe::Pending(format!("{conflicts} conflicts")) })
    })
    .await
    .expect("the gauge counts the conflict");

    let mut release = pods.get("draining").await.expect("draining");
    release.metadata.finalizers = None;
    pods.replace("draining", &PostParams::default(), &release).await.expect("let it go");
}
