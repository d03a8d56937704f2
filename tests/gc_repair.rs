//! A record repaired for the pod that reports its IP, on the real control plane: the repair
//! makes the record the adopter's whole attachment (its node, its workload), so the adopter's
//! own DEL releases it and no other node's agent takes it for one of its leftovers.

mod support;

use e2e::wait::{self, Probe};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};
use serde_json::json;
use support::{Ipwarden, TIMEOUT, create_pod, inject_record, ip_of, record_json, records, wait_pods_with_ips};

const NS: &str = "default";
const POOL: &str = "pool";
const BLOCK: &str = "pool-10-72-0-0-24";
const CIDR: &str = "10.72.0.0/24";

/// A cluster of two nodes with a leading controller, where pod `adopter` runs on node-1 and
/// the record of its IP was overwritten with one naming another pod's sandbox on node-0, and
/// the controller has repaired it for `adopter`. Returns the cluster, the controller's index,
/// the IP and the adopter's UID.
async fn repaired_for_adopter() -> (Ipwarden, usize, String, String) {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(2, &[(POOL, json!({"cidr": CIDR, "default": true}))], &[]).await;
    let client = ipwarden.client();
    let controller = ipwarden.start_controller("repair", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(controller).await;
    create_pod(&client, NS, "adopter", "node-1", json!({"app": "adopter"})).await;
    let adopter = wait_pods_with_ips(&client, NS, "app=adopter", 1).await.remove("adopter").expect("adopter runs");
    let (ip, uid) = (ip_of(&adopter), adopter.uid().unwrap_or_default());
    inject_record(&client, POOL, BLOCK, CIDR, &ip, record_json(NS, "impostor", "impostor-uid", "node-0", None, false))
        .await;
    wait::until("the record repaired for the pod reporting its IP", TIMEOUT, || async {
        let held = records(&client).await.get(&ip).map(|r| r.pod.uid.clone());
        Ok(if held.as_deref() == Some(uid.as_str()) { Probe::Done(()) } else { Probe::Pending(format!("{held:?}")) })
    })
    .await
    .expect("repair");
    (ipwarden, controller, ip, uid)
}

/// Deletes the adopter with the controller stopped, so that only the adopter's DEL can free
/// the record, and waits until it has.
async fn adopters_del_releases(ipwarden: &mut Ipwarden, controller: usize, ip: &str) {
    ipwarden.controllers[controller].stop();
    let client = ipwarden.client();
    Api::<Pod>::namespaced(client.clone(), NS).delete("adopter", &DeleteParams::default()).await.expect("delete");
    wait::until("the adopter's DEL releasing the repaired record", TIMEOUT, || async {
        Ok(match records(&client).await.get(ip) {
            None => Probe::Done(()),
            Some(r) => Probe::Pending(format!("still recorded for {} on {} ({})", r.pod.name, r.node, r.pod.uid)),
        })
    })
    .await
    .expect("the DEL of the pod that adopted the record releases it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_repair_the_adopting_pods_del_releases_the_record() {
    let (mut ipwarden, controller, ip, _uid) = repaired_for_adopter().await;
    adopters_del_releases(&mut ipwarden, controller, &ip).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_repair_agent_restarts_on_the_old_and_the_adopting_node_keep_the_record_while_the_pod_lives() {
    let (mut ipwarden, controller, ip, uid) = repaired_for_adopter().await;
    let client = ipwarden.client();
    // Start-up GC runs before an agent serves: once it serves, its GC is done.
    for (node, role) in [(0, "the old node"), (1, "the adopter's node")] {
        ipwarden.agents[node].restart().expect("restart the agent");
        ipwarden.wait_agent_serving(node).await;
        let held = records(&client).await.get(&ip).map(|r| (r.pod.uid.clone(), r.node.clone()));
        assert_eq!(
            held,
            Some((uid.clone(), "node-1".to_string())),
            "after a restart of {role}'s agent the adopter's record of {ip} stays, naming the adopter's node"
        );
    }
    // The adopter's node kept its checkpoint entry through the restart: its DEL still frees it.
    adopters_del_releases(&mut ipwarden, controller, &ip).await;
}
