//! Node-side GC on the real control plane: the agent's start-up GC releases what no local
//! pod holds, and the CNI GC verb releases every attachment the runtime no longer lists. The
//! simulated runtime as the real ones behave: no CNI GC by default, three DELs per deletion,
//! STATUS every 5 s.

mod support;

use e2e::cni::Invocation;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};
use serde_json::json;
use support::{Ipwarden, create_pod, ip_of, records, wait_pods_with_ips};

const NS: &str = "default";

fn pool() -> [(&'static str, serde_json::Value); 1] {
    [("pool", json!({"cidr": "10.80.0.0/24", "default": true}))]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_releases_at_start_what_no_local_pod_holds_and_keeps_the_rest() {
    let mut ipwarden = Ipwarden::start(1, &pool(), &[]).await;
    let client = ipwarden.client();
    create_pod(&client, NS, "stays", "node-0", json!({"app": "gc"})).await;
    create_pod(&client, NS, "goes", "node-0", json!({"app": "gc"})).await;
    let pods = wait_pods_with_ips(&client, NS, "app=gc", 2).await;

    // While the agent is down, a pod is force deleted and its DEL never reaches the agent.
    ipwarden.agents[0].kill();
    ipwarden.cluster.nodes()[0].faults().set_skip_del(true);
    let force = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    Api::<Pod>::namespaced(client.clone(), NS).delete("goes", &force).await.expect("force delete");
    e2e::wait::until("the pod gone", support::TIMEOUT, || async {
        let left = support::pods_with_ips(&client, NS, "app=gc").await?;
        Ok(if left.len() == 1 {
            e2e::wait::Probe::Done(())
        } else {
            e2e::wait::Probe::Pending(format!("{}", left.len()))
        })
    })
    .await
    .expect("pod removed");
    assert!(records(&client).await.contains_key(&ip_of(&pods["goes"])), "the leak exists before the restart");

    ipwarden.agents[0].restart().expect("restart");
    ipwarden.wait_agent_serving(0).await;
    let held = records(&client).await;
    assert!(!held.contains_key(&ip_of(&pods["goes"])), "start-up GC released the gone pod's IP before serving");
    let stays = &pods["stays"];
    assert_eq!(held.get(&ip_of(stays)).map(|r| r.pod.uid.clone()), stays.uid(), "the live pod's record is kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cni_gc_verb_releases_attachments_the_runtime_no_longer_lists() {
    let ipwarden = Ipwarden::start(1, &pool(), &[]).await;
    let client = ipwarden.client();
    let node = &ipwarden.cluster.nodes()[0];
    node.faults().set_skip_del(true);
    create_pod(&client, NS, "kept", "node-0", json!({"app": "verb"})).await;
    create_pod(&client, NS, "missed", "node-0", json!({"app": "verb"})).await;
    let pods = wait_pods_with_ips(&client, NS, "app=verb", 2).await;
    Api::<Pod>::namespaced(client.clone(), NS).delete("missed", &DeleteParams::default()).await.expect("delete");
    let missed_uid = pods["missed"].uid().unwrap_or_default();
    e2e::wait::until("the runtime forgetting the deleted pod's sandbox", support::TIMEOUT, || async {
        Ok(if node.sandboxes().contains_key(&missed_uid) {
            e2e::wait::Probe::Pending("sandbox still up".into())
        } else {
            e2e::wait::Probe::Done(())
        })
    })
    .await
    .expect("sandbox torn down without DEL");
    assert!(records(&client).await.contains_key(&ip_of(&pods["missed"])), "the missed DEL leaked the IP");

    let valid: Vec<e2e::cni::Attachment> = node
        .sandboxes()
        .into_values()
        .map(|s| e2e::cni::Attachment { container_id: s.container_id, ifname: s.ifname })
        .collect();
    assert_eq!(valid.len(), 1);
    let network = support::network();
    let netconf = e2e::cni::with_valid_attachments(
        &(network.netconf)(&e2e::cni::NodeInfo {
            name: node.name().to_string(),
            index: 0,
            dir: node.dir().to_path_buf(),
        }),
        &valid,
    );
    network
        .invoke(&Invocation { command: "GC", container_id: "", ifname: "", pod: None, netconf: &netconf })
        .await
        .expect("GC succeeds");
    let held = records(&client).await;
    assert!(!held.contains_key(&ip_of(&pods["missed"])), "GC released the unlisted attachment");
    assert_eq!(held.get(&ip_of(&pods["kept"])).map(|r| r.pod.uid.clone()), pods["kept"].uid(), "the listed one stays");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_calls_during_a_burst_of_adds_release_nothing_just_allocated_and_reclaim_a_missed_del() {
    let mut network = support::network();
    // The kubelet calls CNI GC every 300 ms with its live and in-flight sandboxes: no runtime
    // does, but it stages many GC calls against a burst of ADDs.
    network.runtime_gc = e2e::cni::RuntimeGc::Every(std::time::Duration::from_millis(300));
    let ipwarden = Ipwarden::start_with_network(1, &pool(), &[], network).await;
    let client = ipwarden.client();
    let creations = (0..30).map(|i| {
        let client = client.clone();
        async move { create_pod(&client, NS, &format!("burst-{i}"), "node-0", json!({"app": "burst"})).await }
    });
    futures::StreamExt::collect::<Vec<()>>(futures::StreamExt::buffer_unordered(futures::stream::iter(creations), 10))
        .await;
    let pods = wait_pods_with_ips(&client, NS, "app=burst", 30).await;
    let held = records(&client).await;
    for pod in pods.values() {
        assert_eq!(held.get(&ip_of(pod)).map(|r| r.pod.uid.clone()), pod.uid(), "{} keeps its record", pod.name_any());
    }
    let text = ipwarden.scrape_agent(0).await;
    assert_eq!(
        support::metric(&text, r#"ipwarden_agent_releases_total{result="released"}"#),
        0.0,
        "no GC released anything during the burst"
    );

    ipwarden.cluster.nodes()[0].faults().set_skip_del(true);
    let gone_ip = ip_of(&pods["burst-0"]);
    Api::<Pod>::namespaced(client.clone(), NS).delete("burst-0", &DeleteParams::default()).await.expect("delete");
    e2e::wait::until("the periodic GC reclaiming the missed DEL", support::TIMEOUT, || async {
        Ok(if records(&client).await.contains_key(&gone_ip) {
            e2e::wait::Probe::Pending("still recorded".into())
        } else {
            e2e::wait::Probe::Done(())
        })
    })
    .await
    .expect("GC reclaims it");
    assert_eq!(records(&client).await.len(), 29, "only the deleted pod's IP went");
}

/// The simulated runtime behaves as containerd 2.4 does by default (issue 24): no CNI GC, STATUS
/// about every 5 s, and a deleted pod's sandbox torn down with three DELs; the agent answers
/// STATUS ready and releases the pod's IP once for the three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_runtime_polls_status_repeats_dels_and_the_ip_is_released_once() {
    let ipwarden = Ipwarden::start(1, &pool(), &[]).await;
    let client = ipwarden.client();
    assert_eq!(support::network().runtime_gc, e2e::cni::RuntimeGc::Never, "containerd's default");
    create_pod(&client, NS, "once", "node-0", json!({"app": "once"})).await;
    let pods = wait_pods_with_ips(&client, NS, "app=once", 1).await;
    let ip = ip_of(&pods["once"]);
    Api::<Pod>::namespaced(client.clone(), NS).delete("once", &DeleteParams::default()).await.expect("delete");
    // One DEL at the sandbox's stop, two at its removal once the pod is gone.
    e2e::wait::until("the pod's three DELs made and its record released", support::TIMEOUT, || async {
        let dels = ipwarden.cluster.nodes()[0].dels();
        let held = records(&client).await.contains_key(&ip);
        Ok(if dels >= 3 && !held {
            e2e::wait::Probe::Done(dels)
        } else {
            e2e::wait::Probe::Pending(format!("{dels} DELs, record held {held}"))
        })
    })
    .await
    .map(|dels| assert_eq!(dels, 3, "the runtime's DELs of the deleted pod"))
    .expect("the three DELs went through");
    let text = ipwarden.scrape_agent(0).await;
    assert_eq!(support::metric(&text, r#"ipwarden_agent_releases_total{result="released"}"#), 1.0, "one release");
    assert_eq!(support::metric(&text, r#"ipwarden_agent_releases_total{result="error"}"#), 0.0, "no failed DEL");
    e2e::wait::until("two STATUS calls answered ready", support::TIMEOUT, || async {
        let (ready, calls) = ipwarden.cluster.nodes()[0].network_status();
        Ok(if ready && calls >= 2 {
            e2e::wait::Probe::Done(())
        } else {
            e2e::wait::Probe::Pending(format!("ready {ready}, {calls} calls"))
        })
    })
    .await
    .expect("the runtime polls STATUS and the agent answers it");
}
