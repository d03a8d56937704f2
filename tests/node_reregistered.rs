//! A Node deleted and registered again under the same name, on the real control plane: the
//! records of the old incarnation's pods are released by the GC rules, the agent of the new
//! incarnation starts clean (nothing of the old pods comes back from its checkpoint), and
//! new pods on the node get IPs.

mod support;

use std::collections::BTreeSet;

use e2e::wait::{self, Probe};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};
use serde_json::json;
use support::{Ipwarden, TIMEOUT, create_pod, ip_of, records, wait_pods_with_ips};

const NS: &str = "default";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_deleted_and_registered_again_starts_clean_and_its_old_records_are_released() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pool = json!({"cidr": "10.74.0.0/24", "default": true});
    let mut ipwarden = Ipwarden::start(2, &[("pool", pool)], &["--reuse-cooldown-seconds=0"]).await;
    let client = ipwarden.client();
    let controller = ipwarden.start_controller("only", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(controller).await;
    for name in ["old-0", "old-1"] {
        create_pod(&client, NS, name, "node-1", json!({"app": "old"})).await;
    }
    let old = wait_pods_with_ips(&client, NS, "app=old", 2).await;
    let old_uids: BTreeSet<String> = old.values().filter_map(|p| p.uid()).collect();

    // node-1's machine leaves: its agent and kubelet stop, the Node is deleted, and its pods
    // are force deleted as the pod GC deletes the pods of a node that is gone.
    ipwarden.agents[1].kill();
    ipwarden.cluster.delete_node(1).await.expect("node-1 deleted");
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let force = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    for name in old.keys() {
        pods.delete(name, &force).await.expect("force delete");
    }

    // The rules release the old pods' records (node deleted, pod gone) while it is away.
    wait::until("no record of the old incarnation's pods", TIMEOUT, || async {
        let left: Vec<String> = records(&client)
            .await
            .values()
            .filter(|r| old_uids.contains(&r.pod.uid))
            .map(|r| r.pod.name.clone())
            .collect();
        Ok(if left.is_empty() { Probe::Done(()) } else { Probe::Pending(format!("records of {left:?}")) })
    })
    .await
    .expect("old records released");

    // It rejoins under the same name, with its disk (checkpoint) from before.
    ipwarden.cluster.reregister_node(1).await.expect("node-1 registered again");
    ipwarden.agents[1].restart().expect("agent restarts");
    ipwarden.wait_agent_serving(1).await;
    let checkpoint = std::fs::read_to_string(ipwarden.cluster.nodes()[1].dir().join("checkpoint.json"))
        .expect("read the checkpoint");
    for uid in &old_uids {
        assert!(!checkpoint.contains(uid.as_str()), "the new agent's checkpoint has the old pod {uid}: {checkpoint}");
    }

    // New pods on the node get IPs, each its own.
    for name in ["new-0", "new-1"] {
        create_pod(&client, NS, name, "node-1", json!({"app": "new"})).await;
    }
    let new = wait_pods_with_ips(&client, NS, "app=new", 2).await;
    let ips: BTreeSet<String> = new.values().map(ip_of).collect();
    assert_eq!(ips.len(), 2, "distinct IPs: {ips:?}");
    let held = records(&client).await;
    for pod in new.values() {
        let record = held.get(&ip_of(pod)).expect("a record for the new pod's IP");
        assert_eq!(Some(record.pod.uid.clone()), pod.uid(), "the record names the new pod");
    }
}
