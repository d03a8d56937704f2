//! The agent's start-up and node-local state on the real control plane: a restart while a
//! pod of the node drains keeps that pod's IP, a missing checkpoint is rebuilt before CNI is
//! served (so a sandbox still attached keeps guarding its IP), and a second agent for the
//! same node refuses to start.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use e2e::wait::{self, Probe};
use ipwarden::crd::HandshakeState;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use support::{Ipwarden, TIMEOUT, create_pod, ip_of, record_state, records, wait_pods_with_ips};

const NS: &str = "default";

/// A pool of exactly one IP, handed out again at once: a record freed too early goes to the
/// next pod straight away.
fn one_ip_pool() -> [(&'static str, serde_json::Value); 1] {
    [(
        "pool",
        json!({"cidr": "10.74.0.0/24", "default": true, "ranges": [{"start": "10.74.0.10", "end": "10.74.0.10"}]}),
    )]
}

/// The IP pod `name` reports ("" when none, or when it is gone).
async fn reported_ip(client: &kube::Client, name: &str) -> String {
    Api::<Pod>::namespaced(client.clone(), NS)
        .get_opt(name)
        .await
        .expect("read pod")
        .map(|p| ip_of(&p))
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_restarted_while_a_pod_drains_keeps_its_ip_until_the_del() {
    let mut ipwarden = Ipwarden::start(1, &one_ip_pool(), &["--reuse-cooldown-seconds=0"]).await;
    let client = ipwarden.client();
    // The controller sweeps too: it must not mark the draining pod's record before its
    // deadline, so the agent's handshake answer never decides about a pod that still serves.
    let controller = ipwarden.start_controller("gc", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(controller).await;
    // A 60 s grace; the containers take 40 s to stop after SIGTERM (a DaemonSet rollout
    // restarts the agent meanwhile).
    let draining: Pod = serde_json::from_value(json!({
        "metadata": {"name": "draining", "labels": {"app": "draining"},
                     "annotations": {e2e::kubelet::STOP_SECONDS_ANNOTATION: "40"}},
        "spec": {"nodeName": "node-0", "terminationGracePeriodSeconds": 60,
                 "containers": [{"name": "app", "image": "registry.invalid/ipwarden-test/app:1"}]},
    }))
    .expect("pod");
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.create(&PostParams::default(), &draining).await.expect("create pod");
    let draining = wait_pods_with_ips(&client, NS, "app=draining", 1).await.remove("draining").expect("draining");
    let (ip, uid) = (ip_of(&draining), draining.uid().unwrap_or_default());
    let deleted = pods.delete("draining", &DeleteParams::default()).await.expect("delete");
    // The kubelet stops the containers (and DELs) 40 s after SIGTERM, that is 20 s before the
    // deletion timestamp (when the 60 s grace runs out). The promise is checked only on reads
    // that start clearly before then: after it, the DEL may be under way while the pod object
    // still exists, and then a freed record is right. The margin covers the timestamp's
    // whole-second precision.
    let deletion = deleted.left().and_then(|p| p.metadata.deletion_timestamp).expect("the pod is terminating").0;
    let containers_stop = deletion - jiff::SignedDuration::from_secs(20);
    let still_draining = || Timestamp::now() + jiff::SignedDuration::from_secs(3) < containers_stop;

    ipwarden.agents[0].restart().expect("restart");
    ipwarden.wait_agent_serving(0).await;
    let restarted_while_draining = still_draining();
    let record = record_state(&client, &ip).await;
    assert!(
        restarted_while_draining,
        "the agent restart must fall within the 40 s drain for this test to mean anything"
    );
    assert_eq!(record, Some((uid.clone(), None)), "start-up GC kept the record of a pod that still drains on the node");

    create_pod(&client, NS, "next", "node-0", json!({"app": "next"})).await;
    let checked = AtomicUsize::new(0);
    wait::until("the draining pod gone", TIMEOUT, || async {
        let draining = still_draining();
        let (record, next_ip) = (record_state(&client, &ip).await, reported_ip(&client, "next").await);
        if draining {
            assert_eq!(record, Some((uid.clone(), None)), "the record stays, unmarked, until the DEL");
            assert_eq!(next_ip, "", "no other pod gets the IP while the draining pod holds it");
            checked.fetch_add(1, Ordering::Relaxed);
        }
        let exists = pods.get_opt("draining").await.map_err(e2e::Error::kube("read pod"))?.is_some();
        Ok(if exists { Probe::Pending("draining".into()) } else { Probe::Done(()) })
    })
    .await
    .expect("the pod drains and goes");
    let checked = checked.into_inner();
    assert!(checked > 10, "the record was checked throughout the drain ({checked} checks)");
    let next = wait_pods_with_ips(&client, NS, "app=next", 1).await;
    assert_eq!(ip_of(&next["next"]), ip, "the IP goes to the next pod once the draining pod let go of it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_checkpoint_is_rebuilt_so_a_sandbox_still_attached_keeps_its_ip() {
    let agent_args = ["--release-sandbox-grace-seconds=3600", "--reuse-cooldown-seconds=0"];
    let mut ipwarden = Ipwarden::start(1, &one_ip_pool(), &agent_args).await;
    let client = ipwarden.client();
    let controller = ipwarden.start_controller("gc", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(controller).await;
    create_pod(&client, NS, "victim", "node-0", json!({"app": "victim"})).await;
    let victim = wait_pods_with_ips(&client, NS, "app=victim", 1).await.remove("victim").expect("victim");
    let (ip, uid) = (ip_of(&victim), victim.uid().unwrap_or_default());

    // The node's disk is replaced while the agent is down: the checkpoint is gone.
    let node = &ipwarden.cluster.nodes()[0];
    let checkpoint = node.dir().join("checkpoint.json");
    ipwarden.agents[0].stop();
    std::fs::remove_file(&checkpoint).expect("remove the checkpoint");
    ipwarden.agents[0].restart().expect("restart");
    ipwarden.wait_agent_serving(0).await;

    // The pod object is force-deleted while its sandbox still runs (its DEL held back): the
    // controller marks the record, and the agent must know the sandbox is still attached.
    let node = &ipwarden.cluster.nodes()[0];
    node.faults().set_skip_del(true);
    let sandbox = node.sandboxes().remove(&uid).expect("the victim's sandbox");
    let force = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    Api::<Pod>::namespaced(client.clone(), NS).delete("victim", &force).await.expect("force delete");
    create_pod(&client, NS, "next", "node-0", json!({"app": "next"})).await;
    wait::until("the controller marking the record (or freeing it)", TIMEOUT, || async {
        Ok(match record_state(&client, &ip).await {
            Some((_, None)) => Probe::Pending("not marked yet".into()),
            _ => Probe::Done(()),
        })
    })
    .await
    .expect("the record is marked");
    ipwarden.wait_sweeps(controller, 3).await;
    assert_eq!(
        record_state(&client, &ip).await,
        Some((uid.clone(), Some(HandshakeState::MarkedForRelease))),
        "the sandbox still attached keeps the record marked, not freed"
    );
    assert_eq!(reported_ip(&client, "next").await, "", "the next pod did not get the IP the sandbox still uses");
    let rebuilt: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&checkpoint).unwrap_or_default()).unwrap_or_default();
    assert_eq!(rebuilt["entries"].as_array().map(Vec::len), Some(1), "the checkpoint was rebuilt from the IPBlocks");

    // The late DEL frees it, and the waiting pod gets it.
    support::late_del(&ipwarden, 0, NS, "victim", &uid, &sandbox).await;
    let next = wait_pods_with_ips(&client, NS, "app=next", 1).await;
    assert_eq!(ip_of(&next["next"]), ip, "the IP is handed out again only after the sandbox let go of it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_agent_for_the_same_node_refuses_to_start_naming_the_holder() {
    let mut ipwarden = Ipwarden::start(1, &[("pool", json!({"cidr": "10.75.0.0/24", "default": true}))], &[]).await;
    let client = ipwarden.client();
    create_pod(&client, NS, "before", "node-0", json!({"app": "before"})).await;
    let before = wait_pods_with_ips(&client, NS, "app=before", 1).await.remove("before").expect("before");
    let holder = ipwarden.agents[0].pid().expect("the first agent runs");

    // Same node, same socket and checkpoint (a DaemonSet with maxSurge, or one started by hand).
    let port = e2e::process::free_port().expect("free port");
    let binary = std::path::Path::new(env!("CARGO_BIN_EXE_ipwarden"));
    let mut second = e2e::ipwarden::start_agent(&ipwarden.cluster, binary, 0, port, &[]).expect("spawn");
    let exited = wait::until("the second agent exiting", Duration::from_secs(60), || {
        let running = second.ensure_running();
        async move {
            Ok(match running {
                Err(e2e::Error::Exited { status, .. }) => Probe::Done(status),
                _ => Probe::Pending("still running".into()),
            })
        }
    })
    .await
    .expect("the second agent refuses to start");
    assert!(!exited.contains("exit status: 0"), "it exits non-zero: {exited}");
    let log = std::fs::read_to_string(second.log()).expect("agent log");
    let refusal = log.lines().find(|l| l.contains("is held by")).unwrap_or_default();
    assert!(
        refusal.contains(&format!("pid {holder}")) && refusal.contains("node-0"),
        "the error names the holder's pid and node: {refusal:?}"
    );

    // The first agent kept serving, and kept what it wrote.
    ipwarden.agents[0].ensure_running().expect("the first agent still runs");
    create_pod(&client, NS, "after", "node-0", json!({"app": "after"})).await;
    let after = wait_pods_with_ips(&client, NS, "app=after", 1).await.remove("after").expect("after");
    let held = records(&client).await;
    assert_eq!(held.get(&ip_of(&before)).map(|r| r.pod.uid.clone()), before.uid(), "the earlier record stays");
    assert_eq!(held.get(&ip_of(&after)).map(|r| r.pod.uid.clone()), after.uid(), "the new pod got its record");
}
