//! The agent's start-up and node-local state on the real control plane: a restart while a
//! pod of the node drains keeps that pod's IP, a missing checkpoint is rebuilt before CNI is
//! served (so a sandbox still attached keeps guarding its IP), and a second agent for the
//! same node refuses to start.

mod support;

use e2e::wait::{self, Probe};
use ipwarden::crd::HandshakeState;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use support::{Ipwarden, TIMEOUT, create_pod, ip_of, records, wait_pods_with_ips};

const NS: &str = "default";

/// A pool of exactly one IP, handed out again at once: a record freed too early goes to the
/// next pod straight away.
fn one_ip_pool() -> [(&'static str, serde_json::Value); 1] {
    [(
        "pool",
        json!({"cidr": "10.74.0.0/24", "default": true, "ranges": [{"start": "10.74.0.10", "end": "10.74.0.10"}]}),
    )]
}

/// The pod UID and handshake state of `ip`'s record, or None when there is none.
async fn record_state(client: &kube::Client, ip: &str) -> Option<(String, Option<HandshakeState>)> {
    records(client).await.get(ip).map(|r| (r.pod.uid.clone(), r.release_handshake.as_ref().map(|h| h.state)))
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
    pods.delete("draining", &DeleteParams::default()).await.expect("delete");

    ipwarden.agents[0].restart().expect("restart");
    ipwarden.wait_agent_serving(0).await;
    assert_eq!(
        record_state(&client, &ip).await.map(|(u, _)| u),
        Some(uid.clone()),
        "start-up GC kept the record of a pod that still drains on the node"
    );

    create_pod(&client, NS, "next", "node-0", json!({"app": "next"})).await;
    wait::until("the draining pod gone", TIMEOUT, || async {
        let exists = pods.get_opt("draining").await.map_err(e2e::Error::kube("read pod"))?.is_some();
        let (record, next_ip) = (record_state(&client, &ip).await, reported_ip(&client, "next").await);
        if exists {
            assert_eq!(record.map(|(u, _)| u), Some(uid.clone()), "the record stays until the DEL");
            assert_eq!(next_ip, "", "no other pod gets the IP while the draining pod holds it");
            return Ok(Probe::Pending("draining".into()));
        }
        Ok(Probe::Done(()))
    })
    .await
    .expect("the pod drains and goes");
    let next = wait_pods_with_ips(&client, NS, "app=next", 1).await;
    assert_eq!(ip_of(&next["next"]), ip, "the IP goes to the next pod once the draining pod let go of it");
}
