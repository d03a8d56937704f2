//! The release handshake end to end on the real control plane, with real agents and the
//! real plugin: the controller marks a record, the node's agent answers, and only
//! `ready-for-release` frees the IP. Covers the race the handshake exists for (the IP
//! still used on the node while the controller decided to free it), restarts of the
//! controller and of the agent, an aborted handshake, and a NotReady node handled by the
//! NotReady policy instead; the runtime's CNI GC deciding a lost DEL's fate; and the reuse
//! cooldown counted from a leaked pod's end.

mod support;

use e2e::wait::{self, Probe};
use ipwarden::crd::HandshakeState;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::{
    Ipwarden, TIMEOUT, create_pod, inject_record, ip_of, metric_sum, record_json, record_state, records,
    wait_pods_with_ips, wait_record_gone,
};

const NS: &str = "default";
const POOL: &str = "pool";
const BLOCK: &str = "pool-10-72-0-0-24";
const CIDR: &str = "10.72.0.0/24";

async fn wait_state(client: &kube::Client, ip: &str, want: Option<HandshakeState>, what: &str) {
    wait::until(what, TIMEOUT, || async {
        Ok(match record_state(client, ip).await {
            Some((_, state)) if state == want => Probe::Done(()),
            other => Probe::Pending(format!("record of {ip}: {other:?}")),
        })
    })
    .await
    .expect("handshake state");
}

async fn releases(ipwarden: &Ipwarden, controller: usize) -> f64 {
    let text = ipwarden.scrape_controller(controller).await.unwrap_or_default();
    metric_sum(&text, "ipwarden_gc_releases_total", &[])
}

/// No IP is reported by two pods that are not finished.
async fn assert_no_duplicate_ip(client: &kube::Client) {
    let pods = Api::<Pod>::namespaced(client.clone(), NS).list(&ListParams::default()).await.expect("pods");
    let mut seen = std::collections::BTreeMap::new();
    for pod in pods.items.iter().filter(|p| !ipwarden::gc::index::PodFacts::of(p).terminal()) {
        let ip = ip_of(pod);
        if ip.is_empty() {
            continue;
        }
        if let Some(other) = seen.insert(ip.clone(), pod.name_any()) {
            panic!("{ip} is held by both {other} and {}", pod.name_any());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ip_still_used_on_its_node_is_never_freed_even_across_a_controller_restart() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    // Two IPs in the pool, no cooldown: without the handshake the leaked IP would go to the
    // next pod at once.
    let pool = json!({"cidr": CIDR, "default": true, "ranges": [{"start": "10.72.0.10", "end": "10.72.0.11"}]});
    let agent_args = ["--release-sandbox-grace-seconds=3600", "--reuse-cooldown-seconds=0"];
    let mut ipwarden = Ipwarden::start(2, &[(POOL, pool)], &agent_args).await;
    let client = ipwarden.client();
    let first = ipwarden.start_controller("first", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(first).await;

    // The victim runs on node-1, whose runtime will not send DEL (yet): its sandbox keeps
    // using the IP after the pod object is force-deleted.
    let node = &ipwarden.cluster.nodes()[1];
    node.faults().set_skip_del(true);
    create_pod(&client, NS, "victim", "node-1", json!({"app": "victim"})).await;
    let victim = wait_pods_with_ips(&client, NS, "app=victim", 1).await.remove("victim").expect("victim");
    let (victim_ip, victim_uid) = (ip_of(&victim), victim.uid().unwrap_or_default());
    let sandbox = node.sandboxes().remove(&victim_uid).expect("the victim's sandbox");
    let force = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    Api::<Pod>::namespaced(client.clone(), NS).delete("victim", &force).await.expect("force delete");

    wait_state(&client, &victim_ip, Some(HandshakeState::MarkedForRelease), "the controller marking the leak").await;
    // The other IP goes to a pod on node-0; the next pod finds the pool exhausted instead of
    // getting the victim's IP while its sandbox still runs.
    create_pod(&client, NS, "other", "node-0", json!({"app": "other"})).await;
    wait_pods_with_ips(&client, NS, "app=other", 1).await;
    create_pod(&client, NS, "next", "node-0", json!({"app": "next"})).await;
    ipwarden.wait_sweeps(first, 3).await;
    let held = record_state(&client, &victim_ip).await;
    assert_eq!(held, Some((victim_uid.clone(), Some(HandshakeState::MarkedForRelease))), "still marked, not freed");
    assert_eq!(releases(&ipwarden, first).await, 0.0, "nothing released while node-1's agent says not yet");
    let next = Api::<Pod>::namespaced(client.clone(), NS).get("next").await.expect("next pod");
    assert_eq!(ip_of(&next), "", "the next pod got no IP: the only free one would have been the victim's");

    // A new leader reads the mark from the block and does not take a shortcut.
    ipwarden.controllers[first].kill();
    let second = ipwarden.start_controller("second", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(second).await;
    ipwarden.wait_sweeps(second, 3).await;
    let held = record_state(&client, &victim_ip).await;
    assert_eq!(held, Some((victim_uid.clone(), Some(HandshakeState::MarkedForRelease))), "the restart kept the mark");
    assert_eq!(releases(&ipwarden, second).await, 0.0, "the new leader released nothing either");
    assert_no_duplicate_ip(&client).await;

    // The runtime's late DEL arrives: the agent frees the IP and the waiting pod gets it.
    support::late_del(&ipwarden, 1, NS, "victim", &victim_uid, &sandbox).await;
    let next = wait_pods_with_ips(&client, NS, "app=next", 1).await;
    assert_eq!(ip_of(&next["next"]), victim_ip, "the IP is handed out again only after the sandbox let go of it");
    assert_no_duplicate_ip(&client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mark_waits_for_a_dead_agent_is_aborted_when_wanted_again_and_a_not_ready_node_follows_the_policy() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    // The agents' Leases last an hour: a dead agent counts as alive throughout, so its marks
    // wait (tests/agent_heartbeat.rs covers the Lease going stale).
    let agents = ["--lease-duration-seconds=3600"];
    let mut ipwarden = Ipwarden::start(2, &[(POOL, json!({"cidr": CIDR, "default": true}))], &agents).await;
    let client = ipwarden.client();
    let policy =
        ["--full-scan-interval-seconds=2", "--not-ready-policy=release", "--not-ready-release-after-seconds=1"];
    let first = ipwarden.start_controller("first", &policy);
    ipwarden.wait_leader(first).await;

    // web runs on node-0 with one replica; ordinal 3 is not wanted.
    let sts: StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 1, "serviceName": "web", "podManagementPolicy": "Parallel",
                 "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"nodeName": "node-0", "terminationGracePeriodSeconds": 1,
                                       "containers": [{"name": "c", "image": "registry.invalid/c:1"}]}}},
    }))
    .expect("sts");
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), NS);
    statefulsets.create(&PostParams::default(), &sts).await.expect("web");
    wait_pods_with_ips(&client, NS, "app=web", 1).await;

    // node-0's agent dies (its node stays Ready); a leftover reservation of web-3 is there.
    ipwarden.agents[0].kill();
    let ip = "10.72.0.203";
    let record = record_json(NS, "web-3", "web3-old", "node-0", Some(("StatefulSet", "web")), true);
    inject_record(&client, POOL, BLOCK, CIDR, ip, record).await;
    wait_state(&client, ip, Some(HandshakeState::MarkedForRelease), "the unwanted ordinal marked").await;
    ipwarden.wait_sweeps(first, 3).await;
    assert_eq!(record_state(&client, ip).await.and_then(|s| s.1), Some(HandshakeState::MarkedForRelease));
    ipwarden.controllers[first].kill();
    let second = ipwarden.start_controller("second", &policy);
    ipwarden.wait_leader(second).await;
    ipwarden.wait_sweeps(second, 3).await;
    let held = record_state(&client, ip).await;
    assert_eq!(held.and_then(|s| s.1), Some(HandshakeState::MarkedForRelease), "unanswered marks wait, restart or not");
    assert_eq!(releases(&ipwarden, second).await, 0.0, "no release without the agent's answer");

    // web scales to 4: ordinal 3 is wanted again while its pod cannot start (no agent), so
    // the reservation is no longer a candidate and the controller aborts the handshake.
    let scale = json!({"spec": {"replicas": 4}});
    statefulsets.patch("web", &PatchParams::default(), &Patch::Merge(&scale)).await.expect("scale up");
    wait_state(&client, ip, None, "the handshake aborted once web-3 is wanted again").await;
    assert!(record_state(&client, ip).await.is_some(), "the reservation itself stays");

    // The agent comes back: web-3 starts, and the old reservation is resolved through the
    // handshake (released once the agent answers, or adopted by web-3): never left behind.
    ipwarden.agents[0].restart().expect("agent restarts");
    ipwarden.wait_agent_serving(0).await;
    wait_pods_with_ips(&client, NS, "app=web", 4).await;
    wait::until("no record of the old web-3 left", TIMEOUT, || async {
        Ok(match record_state(&client, ip).await {
            Some((uid, state)) if uid == "web3-old" => Probe::Pending(format!("still {state:?}")),
            _ => Probe::Done(()),
        })
    })
    .await
    .expect("old reservation resolved");
    assert_no_duplicate_ip(&client).await;

    // node-1 is lost: its agent cannot answer, so a leak there follows the NotReady policy
    // (release after 1 s) and is released without a mark.
    ipwarden.cluster.nodes()[1].lose();
    wait::until("node-1 NotReady", TIMEOUT, || async {
        let node = Api::<Node>::all(client.clone()).get("node-1").await.map_err(e2e::Error::kube("get node"))?;
        let ready = node
            .status
            .and_then(|s| s.conditions)
            .and_then(|c| c.into_iter().find(|c| c.type_ == "Ready"))
            .map(|c| c.status);
        Ok(if ready.as_deref() == Some("True") { Probe::Pending("still Ready".into()) } else { Probe::Done(()) })
    })
    .await
    .expect("node-1 goes NotReady");
    let text = ipwarden.scrape_controller(second).await.unwrap_or_default();
    let marks_before = metric_sum(&text, "ipwarden_gc_release_handshakes_total", &["step=\"marked\""]);
    let lost = "10.72.0.204";
    inject_record(&client, POOL, BLOCK, CIDR, lost, record_json(NS, "ghost", "ghost-uid", "node-1", None, false)).await;
    wait_record_gone(&client, lost, TIMEOUT, "the leak on the NotReady node released by the policy").await;
    let text = ipwarden.scrape_controller(second).await.unwrap_or_default();
    assert_eq!(metric_sum(&text, "ipwarden_gc_releases_total", &["reason=\"node_not_ready\""]), 1.0);
    let marks_after = metric_sum(&text, "ipwarden_gc_release_handshakes_total", &["step=\"marked\""]);
    assert_eq!(marks_after, marks_before, "no handshake with a node whose agent cannot answer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_del_is_reclaimed_once_the_runtime_stops_listing_its_sandbox_and_never_while_it_lists_it() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    // Without the runtime's word, a sandbox still in the checkpoint counts as lost GRACE
    // seconds after the mark.
    const GRACE: u64 = 3;
    let grace = format!("--release-sandbox-grace-seconds={GRACE}");
    let agent_args = [grace.as_str(), "--reuse-cooldown-seconds=0"];
    let mut ipwarden = Ipwarden::start(1, &[(POOL, json!({"cidr": CIDR, "default": true}))], &agent_args).await;
    let client = ipwarden.client();
    let controller =
        ipwarden.start_controller("gc", &["--full-scan-interval-seconds=2", "--additional-grace-seconds=0"]);
    ipwarden.wait_leader(controller).await;

    // Both pods' DELs are lost. The test is their runtime: it still has `listed`'s sandbox
    // (its teardown is stuck), `dropped`'s is gone.
    let node = &ipwarden.cluster.nodes()[0];
    node.faults().set_skip_del(true);
    create_pod(&client, NS, "listed", "node-0", json!({"app": "gc"})).await;
    create_pod(&client, NS, "dropped", "node-0", json!({"app": "gc"})).await;
    let pods = wait_pods_with_ips(&client, NS, "app=gc", 2).await;
    let sandbox = |name: &str| node.sandboxes().remove(&pods[name].uid().unwrap_or_default()).expect("sandbox");
    let listed = sandbox("listed");
    let (listed_ip, listed_uid) = (ip_of(&pods["listed"]), pods["listed"].uid().unwrap_or_default());
    let force = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    for name in ["listed", "dropped"] {
        Api::<Pod>::namespaced(client.clone(), NS).delete(name, &force).await.expect("force delete");
    }

    // The runtime's GC no longer lists `dropped`: its IP is free by the time the call returns.
    support::runtime_gc(&ipwarden, 0, &[&listed]).await;
    assert_eq!(record_state(&client, &ip_of(&pods["dropped"])).await, None, "the GC freed the unlisted sandbox's IP");

    // While the runtime keeps listing `listed` (every second, as a runtime's GC timer would),
    // its DEL is late, not lost: the mark stays unanswered far past the sandbox grace.
    let started = std::time::Instant::now();
    let mut marked: Option<std::time::Instant> = None;
    while marked.is_none_or(|at| at.elapsed() < std::time::Duration::from_secs(3 * GRACE)) {
        assert!(started.elapsed() < TIMEOUT, "the controller never marked the record of {listed_ip}");
        support::runtime_gc(&ipwarden, 0, &[&listed]).await;
        match record_state(&client, &listed_ip).await {
            Some((uid, Some(HandshakeState::MarkedForRelease))) if uid == listed_uid => {
                marked.get_or_insert_with(std::time::Instant::now);
            }
            Some((uid, None)) if uid == listed_uid && marked.is_none() => {}
            other => panic!(
                "the record of {listed_ip}, whose sandbox the runtime still lists, is {other:?} {:?} after its mark",
                marked.map(|at| at.elapsed())
            ),
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }

    // The runtime lets go of the sandbox: its next GC frees the IP.
    support::runtime_gc(&ipwarden, 0, &[]).await;
    assert_eq!(record_state(&client, &listed_ip).await, None, "the GC freed the IP once the sandbox was gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaked_ip_whose_pod_ended_a_cooldown_ago_is_reused_as_soon_as_it_is_released() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    // The cooldown runs out while the agent still waits for the lost DELs (GRACE after the
    // mark), so the IPs are ready for reuse the moment they are released.
    const COOLDOWN: u64 = 10;
    const GRACE: u64 = 12;
    let (cooldown, grace) =
        (format!("--reuse-cooldown-seconds={COOLDOWN}"), format!("--release-sandbox-grace-seconds={GRACE}"));
    let pool = json!({"cidr": CIDR, "default": true, "ranges": [{"start": "10.72.0.10", "end": "10.72.0.12"}]});
    let mut ipwarden = Ipwarden::start(1, &[(POOL, pool)], &[cooldown.as_str(), grace.as_str()]).await;
    let client = ipwarden.client();
    // Leaks are found by the tracer (which knows when each pod ended), not by a sweep.
    let controller =
        ipwarden.start_controller("gc", &["--full-scan-interval-seconds=3600", "--additional-grace-seconds=0"]);
    ipwarden.wait_leader(controller).await;

    // The pool's three IPs leak: their pods are deleted and the runtime loses every DEL.
    ipwarden.cluster.nodes()[0].faults().set_skip_del(true);
    for i in 0..3 {
        create_pod(&client, NS, &format!("leak-{i}"), "node-0", json!({"app": "leak"})).await;
    }
    let leaked = wait_pods_with_ips(&client, NS, "app=leak", 3).await;
    let leaked_ips: Vec<String> = leaked.values().map(ip_of).collect();
    let leaked_uids: Vec<String> = leaked.values().filter_map(|p| p.uid()).collect();
    for i in 0..3 {
        Api::<Pod>::namespaced(client.clone(), NS)
            .delete(&format!("leak-{i}"), &DeleteParams::default())
            .await
            .expect("delete");
    }
    create_pod(&client, NS, "pending", "node-0", json!({"app": "pending"})).await;

    wait::until("the controller releasing a leaked IP", TIMEOUT, || async {
        let held = records(&client).await;
        let left = held.values().filter(|r| leaked_uids.contains(&r.pod.uid)).count();
        Ok(if left < 3 { Probe::Done(()) } else { Probe::Pending(format!("{left} leaked records")) })
    })
    .await
    .expect("a leak released");
    let released = std::time::Instant::now();
    let pending = wait_pods_with_ips(&client, NS, "app=pending", 1).await.remove("pending").expect("pending");
    let waited = released.elapsed();
    assert!(leaked_ips.contains(&ip_of(&pending)), "the pending pod got a leaked IP: {}", ip_of(&pending));
    assert!(
        waited < std::time::Duration::from_secs(COOLDOWN / 2),
        "the pending pod waited {waited:?} after the release, though the leaked pods ended more than the \
         {COOLDOWN} s cooldown before it"
    );
}
