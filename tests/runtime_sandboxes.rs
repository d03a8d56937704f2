//! Sandbox truth from the runtime (`--cri-socket`, issue 25) on the real control plane with
//! the simulated runtime's CRI service, whose nodes never call CNI GC (containerd's
//! behaviour): a lost DEL is freed by the agent alone, with no controller, once the runtime no
//! longer has a sandbox it listed, and long before the sandbox grace with one; a sandbox the
//! runtime still has READY keeps its IP, its pod gone, far past the grace; and when the runtime
//! cannot be asked, the grace decides again.

mod support;

use std::time::{Duration, Instant};

use e2e::ipwarden::WITH_CRI;
use e2e::wait::{self, Probe};
use ipwarden::crd::HandshakeState;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};
use serde_json::json;
use support::{
    Ipwarden, TIMEOUT, create_pod, ip_of, metric, record_state, records, wait_pods_with_ips, wait_record_gone,
};

const NS: &str = "default";

/// An agent's count of the questions the runtime answered.
const QUERIES_OK: &str = "ipwarden_agent_runtime_queries_total{result=\"ok\"}";

/// The sandbox grace of node-0's agent: far longer than a release through the runtime's word
/// may take, so a release before it can only come from that word.
const LONG_GRACE: Duration = Duration::from_secs(150);

/// The sandbox grace of node-1's agent: short, so a release held past it is held by the
/// runtime's word.
const SHORT_GRACE: Duration = Duration::from_secs(3);

/// Waits until agent `index` has had `count` more questions answered by its runtime than now.
async fn wait_questions(ipwarden: &Ipwarden, index: usize, count: u32) {
    let asked = metric(&ipwarden.scrape_agent(index).await, QUERIES_OK);
    wait::until(&format!("{count} more questions to the runtime"), TIMEOUT, || async {
        let now = metric(&ipwarden.scrape_agent(index).await, QUERIES_OK);
        Ok(if now >= asked + f64::from(count) { Probe::Done(()) } else { Probe::Pending(format!("{now} questions")) })
    })
    .await
    .expect("questions");
}

/// Agent flags under which only the runtime's word may free an IP within a test: a question
/// every second, absence alone never counting (settle time an hour), no sandbox grace within
/// the test's time, no reuse cooldown.
const ONLY_THE_RUNTIMES_WORD: [&str; 5] = [
    WITH_CRI,
    "--cri-poll-interval-seconds=1",
    "--cri-sandbox-settle-seconds=3600",
    "--reuse-cooldown-seconds=0",
    "--release-sandbox-grace-seconds=3600",
];

/// Creates pod `starting` on node-0 while the runtime is still making its sandbox (its ADD
/// returned; it is not in the runtime's store yet) and holds the kubelet's teardowns: deleted,
/// the sandbox may still start. Returns the pod's IP and UID.
async fn start_a_pod_whose_sandbox_is_still_being_made(ipwarden: &Ipwarden) -> (String, String) {
    let client = ipwarden.client();
    let node = &ipwarden.cluster.nodes()[0];
    node.faults().set_hide_new_sandboxes(true);
    node.faults().set_hold_teardowns(true);
    create_pod(&client, NS, "starting", "node-0", json!({"app": "starting"})).await;
    let pod = wait_pods_with_ips(&client, NS, "app=starting", 1).await.remove("starting").expect("pod");
    (ip_of(&pod), pod.uid().unwrap_or_default())
}

/// Force-deletes pod `name`.
async fn force_delete(client: &kube::Client, name: &str) {
    let force = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    Api::<Pod>::namespaced(client.clone(), NS).delete(name, &force).await.expect("force delete");
}

/// After [`start_a_pod_whose_sandbox_is_still_being_made`]: the runtime has the sandbox at
/// last (and says so to the agent), which keeps `ip`; then the kubelet tears it down with its
/// DEL, which frees `ip`.
async fn let_the_sandbox_start_and_end(ipwarden: &Ipwarden, ip: &str) {
    let node = &ipwarden.cluster.nodes()[0];
    node.faults().set_hide_new_sandboxes(false);
    wait_questions(ipwarden, 0, 2).await;
    assert!(record_state(&ipwarden.client(), ip).await.is_some(), "{ip} kept while the runtime lists its sandbox");
    let dels = node.dels();
    node.faults().set_hold_teardowns(false);
    wait_record_gone(&ipwarden.client(), ip, TIMEOUT, "the IP freed by the sandbox's DEL").await;
    // The simulated kubelet forgets the sandbox only after its DEL returned, as kubelet does
    // after StopPodSandbox: wait for that, not for the record alone.
    wait::until("the runtime forgetting the torn-down sandbox", TIMEOUT, || async {
        Ok(match node.sandboxes().len() {
            0 => Probe::Done(()),
            up => Probe::Pending(format!("{up} sandboxes up")),
        })
    })
    .await
    .expect("sandbox gone");
    assert!(node.dels() > dels, "the sandbox went with its DEL");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_del_is_freed_before_the_grace_a_ready_sandbox_never_and_an_unreachable_runtime_falls_back_to_the_grace()
{
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pool = json!({"cidr": "10.74.0.0/24", "default": true});
    let mut ipwarden = Ipwarden::without_agents(2, &[("pool", pool)], support::network()).await;
    let long = format!("--release-sandbox-grace-seconds={}", LONG_GRACE.as_secs());
    let short = format!("--release-sandbox-grace-seconds={}", SHORT_GRACE.as_secs());
    // Absence alone counts only after the settle time, far longer than the test.
    let common =
        [WITH_CRI, "--cri-poll-interval-seconds=1", "--reuse-cooldown-seconds=0", "--cri-sandbox-settle-seconds=3600"];
    ipwarden.start_agent(0, &[&common[..], &[long.as_str()]].concat()).await;
    ipwarden.start_agent(1, &[&common[..], &[short.as_str()]].concat()).await;
    let client = ipwarden.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let force = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };

    // No controller yet. node-0's runtime lists a pod's sandbox to the agent, then tears it
    // down without its DEL: the agent alone frees the IP (on the runtime's event, or its next
    // question), since a sandbox the runtime listed and no longer has is gone.
    ipwarden.cluster.nodes()[0].faults().set_skip_del(true);
    create_pod(&client, NS, "alone", "node-0", json!({"app": "alone"})).await;
    let alone_ip = ip_of(&wait_pods_with_ips(&client, NS, "app=alone", 1).await["alone"]);
    wait_questions(&ipwarden, 0, 2).await;
    pods.delete("alone", &DeleteParams::default()).await.expect("delete pod");
    wait_record_gone(&client, &alone_ip, TIMEOUT, "the lost DEL's IP freed by the agent alone").await;

    let controller =
        ipwarden.start_controller("gc", &["--full-scan-interval-seconds=2", "--additional-grace-seconds=0"]);
    ipwarden.wait_leader(controller).await;

    // node-0: the pod's DEL is lost (the runtime tears its sandbox down without it). Its IP is
    // free well before the sandbox grace: the runtime listed the sandbox, and no longer does.
    ipwarden.cluster.nodes()[0].faults().set_skip_del(true);
    create_pod(&client, NS, "lost", "node-0", json!({"app": "lost"})).await;
    let lost_ip = ip_of(&wait_pods_with_ips(&client, NS, "app=lost", 1).await["lost"]);
    wait_questions(&ipwarden, 0, 2).await;
    pods.delete("lost", &DeleteParams::default()).await.expect("delete pod");
    let deleted = Instant::now();
    wait_record_gone(&client, &lost_ip, LONG_GRACE / 2, "the lost DEL's IP freed before the sandbox grace").await;
    tracing::info!(seconds = deleted.elapsed().as_secs_f64(), "lost DEL reclaimed");
    assert!(ipwarden.cluster.nodes()[0].sandboxes().is_empty(), "the runtime has no sandbox left");

    // node-1: the pod is force-deleted while its sandbox's teardown is stuck: the runtime
    // still has it READY. The controller marks its record, and the mark stays unanswered for
    // three sandbox graces.
    let node = &ipwarden.cluster.nodes()[1];
    node.faults().set_hold_teardowns(true);
    create_pod(&client, NS, "held", "node-1", json!({"app": "held"})).await;
    let held = wait_pods_with_ips(&client, NS, "app=held", 1).await.remove("held").expect("pod held");
    let (held_ip, held_uid) = (ip_of(&held), held.uid().unwrap_or_default());
    pods.delete("held", &force).await.expect("force delete");
    wait::until("the held sandbox's record marked", TIMEOUT, || async {
        Ok(match record_state(&client, &held_ip).await {
            Some((uid, Some(HandshakeState::MarkedForRelease))) if uid == held_uid => Probe::Done(()),
            other => Probe::Pending(format!("record of {held_ip}: {other:?}")),
        })
    })
    .await
    .expect("mark");
    let marked = Instant::now();
    while marked.elapsed() < 3 * SHORT_GRACE {
        match record_state(&client, &held_ip).await {
            Some((uid, Some(HandshakeState::MarkedForRelease))) if uid == held_uid => {}
            other => panic!(
                "the record of {held_ip}, whose sandbox the runtime has READY, is {other:?} {:?} after its mark",
                marked.elapsed()
            ),
        }
        assert_eq!(node.sandboxes().len(), 1, "the sandbox is still up");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // The runtime stops answering: the agent falls back to the grace, and the IP is freed.
    node.faults().set_cri_unavailable(true);
    let agent =
        support::scrape_agent_until(&ipwarden, 1, "ipwarden_agent_runtime_queries_total{result=\"error\"}").await;
    assert!(agent > 0.0, "the failed questions are counted");
    wait_record_gone(&client, &held_ip, TIMEOUT, "the held IP freed after the grace once the runtime is silent").await;

    // The teardown goes through at last; its DEL finds nothing left to free.
    node.faults().set_cri_unavailable(false);
    node.faults().set_hold_teardowns(false);
    wait::until("the held sandbox torn down", TIMEOUT, || async {
        Ok(match ipwarden.cluster.nodes()[1].sandboxes().len() {
            0 => Probe::Done(()),
            n => Probe::Pending(format!("{n} sandboxes")),
        })
    })
    .await
    .expect("teardown");
    assert!(records(&client).await.is_empty(), "no record is left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_pods_sandbox_the_runtime_has_not_listed_yet_keeps_its_ip_past_the_settle_time() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pool = json!({"cidr": "10.75.0.0/24", "default": true});
    let args = [
        WITH_CRI,
        "--cri-poll-interval-seconds=1",
        "--cri-sandbox-settle-seconds=1",
        "--reuse-cooldown-seconds=0",
        "--release-sandbox-grace-seconds=3600",
    ];
    let ipwarden = Ipwarden::start(1, &[("pool", pool)], &args).await;
    let client = ipwarden.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

    // The runtime has not put the sandbox into its store yet (still starting it, as containerd
    // after the CNI ADD returned), while the pod runs with its IP. No controller runs: only the
    // agent could release the IP. It must not, however long past the settle time.
    let node = &ipwarden.cluster.nodes()[0];
    node.faults().set_hide_new_sandboxes(true);
    create_pod(&client, NS, "starting", "node-0", json!({"app": "starting"})).await;
    let pod = wait_pods_with_ips(&client, NS, "app=starting", 1).await.remove("starting").expect("pod");
    let (ip, uid) = (ip_of(&pod), pod.uid().unwrap_or_default());
    wait_questions(&ipwarden, 0, 5).await;
    assert_eq!(
        record_state(&client, &ip).await.map(|(owner, _)| owner),
        Some(uid.clone()),
        "a running pod keeps the IP of a sandbox the runtime has not listed yet"
    );

    // One status call for the unlisted sandbox fails (containerd restarting, or a call past
    // the agent's timeout): the runtime said nothing of the sandbox, so its absence from the
    // next answers, still unlisted, proves nothing either.
    node.faults().fail_next_status_calls(1);
    wait::until("the failing status call made", TIMEOUT, || async {
        Ok(match node.faults().status_calls_to_fail() {
            0 => Probe::Done(()),
            n => Probe::Pending(format!("{n} to fail")),
        })
    })
    .await
    .expect("status call");
    wait_questions(&ipwarden, 0, 3).await;
    assert_eq!(
        record_state(&client, &ip).await.map(|(owner, _)| owner),
        Some(uid),
        "a running pod keeps the IP of a sandbox whose status the runtime once failed to give"
    );

    // The pod ends and its sandbox goes without a DEL, never listed: once the pod is gone from
    // the agent's cache and the settle time has passed, the agent frees the IP.
    node.faults().set_skip_del(true);
    pods.delete("starting", &DeleteParams::default()).await.expect("delete pod");
    wait_record_gone(&client, &ip, TIMEOUT, "the never-listed sandbox's IP freed once its pod is gone").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mark_on_a_sandbox_still_being_made_for_a_deleted_pod_waits_for_the_runtime_to_have_it() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pool = json!({"cidr": "10.76.0.0/24", "default": true});
    let mut ipwarden = Ipwarden::start(1, &[("pool", pool)], &ONLY_THE_RUNTIMES_WORD).await;
    let controller =
        ipwarden.start_controller("gc", &["--full-scan-interval-seconds=2", "--additional-grace-seconds=0"]);
    ipwarden.wait_leader(controller).await;
    let client = ipwarden.client();

    // The pod is force-deleted while the runtime is still making its sandbox: a StatefulSet
    // pod's successor elsewhere would get the IP at once if the mark were answered now.
    let (ip, uid) = start_a_pod_whose_sandbox_is_still_being_made(&ipwarden).await;
    force_delete(&client, "starting").await;
    wait::until("the controller acts on the record", TIMEOUT, || async {
        Ok(match record_state(&client, &ip).await {
            Some((owner, None)) if owner == uid => Probe::Pending(format!("record of {ip} unmarked")),
            _ => Probe::Done(()),
        })
    })
    .await
    .expect("mark");
    wait_questions(&ipwarden, 0, 5).await;
    assert_eq!(
        record_state(&client, &ip).await,
        Some((uid.clone(), Some(HandshakeState::MarkedForRelease))),
        "the mark on the IP of a sandbox the runtime may still start stays unanswered"
    );
    assert_eq!(ipwarden.cluster.nodes()[0].sandboxes().len(), 1, "the sandbox is still up");
    let_the_sandbox_start_and_end(&ipwarden, &ip).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_that_ends_its_event_stream_at_once_is_asked_at_the_poll_interval() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    const POLL: Duration = Duration::from_secs(3);
    let pool = json!({"cidr": "10.77.0.0/24", "default": true});
    let mut ipwarden = Ipwarden::without_agents(1, &[("pool", pool)], support::network()).await;
    // As CRI-O with its default enable_pod_events = false: every event stream ends at once.
    ipwarden.cluster.nodes()[0].faults().set_events_end_at_once(true);
    let poll = format!("--cri-poll-interval-seconds={}", POLL.as_secs());
    ipwarden.start_agent(0, &[WITH_CRI, &poll]).await;
    wait::until("the agent followed the events twice", TIMEOUT, || async {
        Ok(match ipwarden.cluster.nodes()[0].cri_calls() {
            (_, streams) if streams >= 2 => Probe::Done(()),
            (_, streams) => Probe::Pending(format!("{streams} event streams")),
        })
    })
    .await
    .expect("event streams");

    // Five questions take four poll intervals at least: none comes from the empty streams.
    // A loaded machine only makes them slower.
    wait_questions(&ipwarden, 0, 1).await;
    let (first, (lists_before, streams_before)) = (Instant::now(), ipwarden.cluster.nodes()[0].cri_calls());
    wait_questions(&ipwarden, 0, 5).await;
    let took = first.elapsed();
    let (lists, streams) = ipwarden.cluster.nodes()[0].cri_calls();
    tracing::info!(?took, lists = lists - lists_before, streams = streams - streams_before, "five questions");
    assert!(
        took >= POLL * 5 / 2,
        "five questions to a runtime that streams no events came within {took:?}, not one per {POLL:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_up_gc_keeps_a_gone_pods_ip_while_the_runtime_cannot_say_whether_it_has_the_sandbox() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pool = json!({"cidr": "10.78.0.0/24", "default": true});
    let mut ipwarden = Ipwarden::start(1, &[("pool", pool)], &ONLY_THE_RUNTIMES_WORD).await;
    let client = ipwarden.client();

    // The pod is force-deleted while its agent is down and the runtime still makes its sandbox.
    let (ip, uid) = start_a_pod_whose_sandbox_is_still_being_made(&ipwarden).await;
    ipwarden.agents[0].kill();
    force_delete(&client, "starting").await;

    // The agent starts again while every status call fails: its start-up GC finds no pod for
    // the record, and the runtime cannot say whether it has the sandbox.
    ipwarden.cluster.nodes()[0].faults().fail_next_status_calls(usize::MAX);
    ipwarden.agents[0].restart().expect("agent restarts");
    ipwarden.wait_agent_serving(0).await;
    ipwarden.cluster.nodes()[0].faults().fail_next_status_calls(0);
    assert_eq!(
        record_state(&client, &ip).await,
        Some((uid, None)),
        "the start-up GC keeps the IP of a sandbox the runtime could not say it lacks"
    );

    let_the_sandbox_start_and_end(&ipwarden, &ip).await;
}
