//! The data plane on the real control plane: agents allocating concurrently through the
//! real CNI plugin binary, sticky StatefulSet IPs, and an agent killed in the middle of ADDs.

mod support;

use std::collections::{BTreeMap, BTreeSet};

use e2e::wait::{self, Probe};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::{Ipwarden, TIMEOUT, claims, create_pod, ip_of, metric, records, wait_pods_with_ips};

const NS: &str = "default";

/// Asserts that records, claims and pod IPs tell the same story for `pods`: a StatefulSet
/// pod's claim names its UID and IP, a stateless pod has no claim. A StatefulSet pod's claim
/// is read once the controller witnessed it for that pod: from decision 0022 on, the
/// controller writes it after the ADD, not the ADD itself.
async fn assert_consistent(ipwarden: &Ipwarden, pods: &BTreeMap<String, Pod>) {
    let client = ipwarden.client();
    for (name, pod) in pods.iter().filter(|(_, p)| p.owner_references().iter().any(|o| o.kind == "StatefulSet")) {
        support::wait_witnessed(&client, NS, name, &pod.uid().unwrap_or_default()).await;
    }
    let records = records(&client).await;
    let claims = claims(&client, NS).await;
    let ips: BTreeSet<String> = pods.values().map(ip_of).collect();
    assert_eq!(ips.len(), pods.len(), "every pod has its own IP");
    for (name, pod) in pods {
        let ip = ip_of(pod);
        let uid = pod.uid().unwrap_or_default();
        let record = records.get(&ip).unwrap_or_else(|| panic!("{name}'s IP {ip} has a record"));
        assert_eq!(record.pod.uid, uid, "{ip} is recorded for {name}'s UID");
        assert_eq!(Some(&record.node), pod.spec.as_ref().and_then(|s| s.node_name.as_ref()), "{ip}'s node");
        let sticky = pod.owner_references().iter().any(|o| o.kind == "StatefulSet");
        assert_eq!(record.sticky, sticky, "{ip}'s record is sticky only for a StatefulSet pod");
        if !sticky {
            assert!(!claims.contains_key(name), "{name}, a stateless pod, has no claim");
            continue;
        }
        let claim = claims.get(name).unwrap_or_else(|| panic!("{name} has a claim"));
        assert_eq!(claim.spec.pod_uid, uid, "{name}'s claim names its UID");
        assert_eq!(claim.spec.interfaces[0].ips[0].ip, ip, "{name}'s claim names its IP");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_adds_from_four_agents_get_distinct_ips_that_records_agree_on_and_write_no_claim() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let ipwarden = Ipwarden::start(4, &[("pool", json!({"cidr": "10.50.0.0/24", "default": true}))], &[]).await;
    let client = ipwarden.client();
    let creations = (0..200).map(|i| {
        let client = client.clone();
        async move {
            let node = format!("node-{}", i % 4);
            create_pod(&client, NS, &format!("burst-{i}"), &node, json!({"app": "burst"})).await;
        }
    });
    futures::stream::iter(creations).buffer_unordered(32).collect::<Vec<()>>().await;
    let pods = wait_pods_with_ips(&client, NS, "app=burst", 200).await;
    assert!(pods.values().all(|p| ip_of(p).starts_with("10.50.0.")), "IPs come from the pool");
    assert_consistent(&ipwarden, &pods).await;
    assert_eq!(records(&client).await.len(), 200, "exactly one record per pod");

    // A loaded machine can make the plugin give up on a queued ADD that the agent then
    // serves; the runtime DELs that sandbox and retries. So count: allocations minus
    // releases is exactly one per pod.
    let (mut successes, mut released, mut from_cache, mut live) = (0.0, 0.0, 0.0, 0.0);
    for index in 0..4 {
        let text = ipwarden.scrape_agent(index).await;
        assert!(text.contains("ipwarden_agent_allocation_duration_seconds_bucket"), "latency histogram exposed");
        assert!(text.contains("ipwarden_agent_conflict_retries_total"), "conflict retries exposed");
        successes += metric(&text, r#"ipwarden_agent_allocations_total{result="success"}"#);
        released += metric(&text, r#"ipwarden_agent_releases_total{result="released"}"#);
        from_cache += metric(&text, r#"ipwarden_agent_pod_reads_total{source="cache"}"#);
        live += metric(&text, r#"ipwarden_agent_pod_reads_total{source="apiserver"}"#);
    }
    assert!(successes >= 200.0, "the agents counted at least 200 successful ADDs ({successes})");
    // The kubelet sees a pod through the same kind of watch as its agent, so the agent's
    // cache nearly always has the pod by the time its ADD comes.
    assert!(from_cache >= 100.0, "most ADDs read their pod from the node's pod cache: {from_cache} cache, {live} live");
    assert_eq!(successes - released, 200.0, "every allocation beyond one per pod was released again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statefulset_pod_deleted_and_recreated_keeps_its_ip_and_scale_down_frees_it() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(2, &[("pool", json!({"cidr": "10.51.0.0/24", "default": true}))], &[]).await;
    let client = ipwarden.client();
    // The controller witnesses the claims, so that an IP follows its pod to the other node
    // (decision 0022), and deletes a witnessed claim of a let-go ordinal on its next pass.
    let controller = ipwarden.start_controller("controller", &["--claim-janitor-interval-seconds=1"]);
    ipwarden.wait_leader(controller).await;
    let sts: StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": "db"},
        "spec": {"replicas": 2, "serviceName": "db", "selector": {"matchLabels": {"app": "db"}},
                 "template": {"metadata": {"labels": {"app": "db"}},
                              "spec": {"terminationGracePeriodSeconds": 1,
                                       "containers": [{"name": "db", "image": "registry.invalid/db:1"}]}}},
    }))
    .expect("sts");
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), NS);
    statefulsets.create(&PostParams::default(), &sts).await.expect("create sts");
    let before = wait_pods_with_ips(&client, NS, "app=db", 2).await;
    assert_consistent(&ipwarden, &before).await;
    let old = &before["db-1"];
    support::wait_witnessed(&client, NS, "db-1", &old.uid().unwrap_or_default()).await;

    Api::<Pod>::namespaced(client.clone(), NS).delete("db-1", &DeleteParams::default()).await.expect("delete db-1");
    let old_uid = old.uid().unwrap_or_default();
    let after = wait::until("db-1 recreated with a new UID", TIMEOUT, || async {
        let pods = support::pods_with_ips(&client, NS, "app=db").await?;
        Ok(match pods.get("db-1") {
            Some(pod) if pod.uid().unwrap_or_default() != old_uid && pods.len() == 2 => Probe::Done(pods),
            _ => Probe::Pending(format!("{:?}", pods.keys().collect::<Vec<_>>())),
        })
    })
    .await
    .expect("db-1 comes back");
    assert_eq!(ip_of(&after["db-1"]), ip_of(old), "the recreated pod keeps its IP");
    assert_eq!(ip_of(&after["db-0"]), ip_of(&before["db-0"]), "the other pod is untouched");
    assert_consistent(&ipwarden, &after).await;

    let scale = json!({"spec": {"replicas": 1}});
    statefulsets.patch("db", &PatchParams::default(), &Patch::Merge(scale)).await.expect("scale down");
    let freed_ip = ip_of(&after["db-1"]);
    wait::until("db-1's IP and claim freed by scale-down", TIMEOUT, || async {
        let held = records(&client).await.contains_key(&freed_ip);
        let claimed = claims(&client, NS).await.contains_key("db-1");
        Ok(if !held && !claimed { Probe::Done(()) } else { Probe::Pending(format!("record {held}, claim {claimed}")) })
    })
    .await
    .expect("scale-down frees the ordinal");
    let mut dels = 0.0;
    for index in 0..2 {
        dels += metric(&ipwarden.scrape_agent(index).await, "ipwarden_agent_release_duration_seconds_count");
    }
    assert!(dels >= 2.0, "the DELs of the deleted and the scaled-down pod are timed: {dels}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_in_the_middle_of_adds_restarts_without_a_duplicate_or_a_lost_record() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(2, &[("pool", json!({"cidr": "10.52.0.0/24", "default": true}))], &[]).await;
    let client = ipwarden.client();
    // The agent's checkpoint saves are held: records get written, no ADD is answered, so the
    // kill lands with every ADD due whatever the machine's speed.
    let node0_dir = ipwarden.cluster.nodes()[0].dir().to_path_buf();
    let hold = e2e::ipwarden::CheckpointHold::start(&node0_dir).expect("hold node-0's checkpoint saves");
    for i in 0..30 {
        create_pod(&client, NS, &format!("crash-{i}"), "node-0", json!({"app": "crash"})).await;
    }
    wait::until("some records written on node-0", TIMEOUT, || async {
        let n = records(&client).await.len();
        Ok(if n >= 5 { Probe::Done(()) } else { Probe::Pending(format!("{n} records")) })
    })
    .await
    .expect("ADDs start");
    ipwarden.agents[0].kill();
    drop(hold);
    let saved = std::fs::read_to_string(e2e::ipwarden::checkpoint_path(&node0_dir)).unwrap_or_default();
    assert!(!saved.contains("crash-"), "the held checkpoint saved no pod: {saved}");
    // Pods created while the agent is down: ADDs due at its restart too.
    for i in 30..40 {
        create_pod(&client, NS, &format!("crash-{i}"), "node-0", json!({"app": "crash"})).await;
    }
    ipwarden.agents[0].restart().expect("agent restarts");
    ipwarden.wait_agent_serving(0).await;

    let pods = wait_pods_with_ips(&client, NS, "app=crash", 40).await;
    assert_consistent(&ipwarden, &pods).await;
    wait::until("one record per pod (failed sandboxes released)", TIMEOUT, || async {
        let n = records(&client).await.len();
        Ok(if n == 40 { Probe::Done(()) } else { Probe::Pending(format!("{n} records")) })
    })
    .await
    .expect("no leaked or lost record");
    let checkpoint =
        std::fs::read_to_string(ipwarden.cluster.nodes()[0].dir().join("checkpoint.json")).expect("checkpoint");
    let entries =
        serde_json::from_str::<serde_json::Value>(&checkpoint).expect("json")["entries"].as_array().map(Vec::len);
    assert_eq!(entries, Some(40), "the checkpoint holds one entry per running pod");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_pools_get_a_condition_and_hand_out_nothing_until_resolved() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pools =
        [("wide", json!({"cidr": "10.54.0.0/24", "default": true})), ("narrow", json!({"cidr": "10.54.0.128/25"}))];
    let mut ipwarden = Ipwarden::start(1, &pools, &[]).await;
    // The controller writes the pools' conditions; the agent judges the overlap by itself.
    ipwarden.start_controller("conditions", &[]);
    let client = ipwarden.client();
    let api: Api<ipwarden::crd::IPPool> = Api::all(client.clone());
    let overlapping = |pool: ipwarden::crd::IPPool| {
        pool.status.and_then(|s| s.conditions.into_iter().find(|c| c.type_ == "Overlapping")).map(|c| c.status)
    };
    wait::until("both pools marked Overlapping", TIMEOUT, || async {
        let wide = overlapping(api.get("wide").await.map_err(e2e::Error::kube("get wide"))?);
        let narrow = overlapping(api.get("narrow").await.map_err(e2e::Error::kube("get narrow"))?);
        Ok(if wide.as_deref() == Some("True") && narrow.as_deref() == Some("True") {
            Probe::Done(())
        } else {
            Probe::Pending(format!("wide {wide:?}, narrow {narrow:?}"))
        })
    })
    .await
    .expect("overlap is reported");
    create_pod(&client, NS, "waiting", "node-0", json!({"app": "waiting"})).await;
    wait::until("the agent refusing the ADD for want of a usable pool", TIMEOUT, || async {
        let refused = metric(&ipwarden.scrape_agent(0).await, r#"ipwarden_agent_allocations_total{result="no_pool"}"#);
        Ok(if refused >= 1.0 { Probe::Done(()) } else { Probe::Pending("no refusal yet".into()) })
    })
    .await
    .expect("the ADD is refused");
    assert!(records(&client).await.is_empty(), "nothing is allocated from overlapping pools");

    api.delete("narrow", &DeleteParams::default()).await.expect("delete narrow");
    let pods = wait_pods_with_ips(&client, NS, "app=waiting", 1).await;
    assert!(ip_of(&pods["waiting"]).starts_with("10.54.0."), "the pod is served once the overlap is gone");
    wait::until("the Overlapping condition clearing", TIMEOUT, || async {
        let wide = overlapping(api.get("wide").await.map_err(e2e::Error::kube("get wide"))?);
        Ok(if wide.as_deref() == Some("False") { Probe::Done(()) } else { Probe::Pending(format!("{wide:?}")) })
    })
    .await
    .expect("the condition clears");
}

/// A pod whose sandbox the runtime lost after its ADD (the runtime crashed before recording
/// it, so no DEL follows) gets a new sandbox, whose ADD takes the lost one's IP back at once:
/// the same pod's own IP carries no other pod's traffic, so the reuse cooldown does not hold
/// it. The pool has exactly the two pods' IPs and the cooldown outlasts the test, so a new
/// sandbox that had to wait for the cooldown or take another IP could not run. Both a pod
/// given any IP and a pod with a fixed IP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pods_new_sandbox_takes_back_at_once_the_ip_of_the_sandbox_the_runtime_lost() {
    let pool = json!({"cidr": "10.77.0.0/24", "default": true,
                      "ranges": [{"start": "10.77.0.10", "end": "10.77.0.11"}]});
    let ipwarden = Ipwarden::start(1, &[("exact", pool)], &["--reuse-cooldown-seconds=3600"]).await;
    let client = ipwarden.client();
    let faults = ipwarden.cluster.nodes()[0].faults();

    faults.crash_next_adds(1);
    create_pod(&client, NS, "any-ip", "node-0", json!({"app": "lost"})).await;
    let pods = wait_pods_with_ips(&client, NS, "app=lost", 1).await;
    assert_eq!(ip_of(&pods["any-ip"]), "10.77.0.10", "the pod keeps the IP its lost sandbox got");

    faults.crash_next_adds(1);
    let fixed: Pod = serde_json::from_value(json!({
        "metadata": {"name": "fixed-ip", "labels": {"app": "lost"}, "annotations": {"ipwarden.io/ips": "10.77.0.11"}},
        "spec": {"nodeName": "node-0", "containers": [{"name": "app", "image": "registry.invalid/ipwarden-test/app:1"}]},
    }))
    .expect("a pod");
    Api::<Pod>::namespaced(client.clone(), NS).create(&PostParams::default(), &fixed).await.expect("create fixed-ip");
    let pods = wait_pods_with_ips(&client, NS, "app=lost", 2).await;
    assert_eq!(ip_of(&pods["fixed-ip"]), "10.77.0.11", "the fixed IP, back from its lost sandbox");

    let log = std::fs::read_to_string(ipwarden.agents[0].log()).expect("the agent's log");
    let superseded = log.matches("replaces one whose DEL never came").count();
    assert_eq!(superseded, 2, "each pod's lost sandbox was superseded by its new one");
    let text = ipwarden.scrape_agent(0).await;
    assert_eq!(metric(&text, "ipwarden_agent_allocations_total{result=\"cooling\"}"), 0.0, "no ADD waited");
    let records = records(&client).await;
    assert_eq!(records.len(), 2, "{records:?}");
    for pod in pods.values() {
        assert_eq!(records[&ip_of(pod)].pod.uid, pod.uid().unwrap_or_default(), "{}'s record", pod.name_any());
    }
}
