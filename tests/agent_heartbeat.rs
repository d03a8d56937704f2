//! The agents' heartbeat on the real control plane: each agent renews a Lease for its node,
//! and the controller takes a Ready node whose agent Lease went stale as one whose agent
//! cannot answer the release handshake, so the NotReady policy applies there instead of a
//! mark that nobody will ever answer.

mod support;

use std::time::Duration;

use e2e::wait::{self, Probe};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use support::{Ipwarden, TIMEOUT, inject_record, metric_sum, record_json, records, wait_record_gone};

const NS: &str = "default";
const POOL: &str = "pool";
const BLOCK: &str = "pool-10-73-0-0-24";
const CIDR: &str = "10.73.0.0/24";

/// The agent Lease's default duration (the agent's `--lease-duration-seconds`), plus the
/// policy's 1 s, two full-scan intervals and slack for a loaded machine.
const STALE_AGENT_BOUND: Duration = Duration::from_secs(20 + 1 + 4 + 15);

/// Renews, every second until aborted, a Lease named `name` that carries `node`'s agent label
/// (what any agent's token may write today): a decoy for that node's heartbeat.
async fn renew_decoy(leases: Api<Lease>, name: &'static str, node: &'static str) {
    loop {
        let lease = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "labels": {ipwarden::agent::heartbeat::NODE_LABEL: node}},
            "spec": {"holderIdentity": node, "leaseDurationSeconds": 20,
                     "renewTime": jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()}});
        if let Err(e) = leases.patch(name, &PatchParams::apply("decoy").force(), &Patch::Apply(&lease)).await {
            tracing::warn!(error = %e, "renewing the decoy Lease");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

async fn controller_metric(ipwarden: &Ipwarden, controller: usize, name: &str, labels: &[&str]) -> f64 {
    let text = ipwarden.scrape_controller(controller).await.unwrap_or_default();
    metric_sum(&text, name, labels)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leak_on_a_ready_node_whose_agent_is_gone_is_released_by_the_not_ready_policy() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(2, &[(POOL, json!({"cidr": CIDR, "default": true}))], &[]).await;
    let client = ipwarden.client();
    let policy =
        ["--full-scan-interval-seconds=2", "--not-ready-policy=release", "--not-ready-release-after-seconds=1"];
    let controller = ipwarden.start_controller("only", &policy);
    ipwarden.wait_leader(controller).await;

    // node-0's agent stops; the fake kubelet keeps node-0 Ready. A leak there is released
    // by the NotReady policy once the agent's Lease is stale, without a handshake. A Lease
    // labelled with node-0 under another name, renewed all along, counts for nothing: only
    // node-0's own Lease `ipwarden-agent-node-0` is its heartbeat (decision 0022).
    ipwarden.agents[0].kill();
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    let decoy = tokio::spawn(renew_decoy(leases.clone(), "decoy-of-node-0", "node-0"));
    let versions = wait::until("the decoy Lease written", TIMEOUT, || async {
        let lease = leases.get_opt("decoy-of-node-0").await.map_err(e2e::Error::kube("reading the decoy"))?;
        Ok(match lease.and_then(|l| l.metadata.resource_version) {
            Some(version) => Probe::Done(version),
            None => Probe::Pending("not written yet".into()),
        })
    })
    .await
    .expect("the decoy Lease is written");
    wait::until("the decoy Lease renewed", TIMEOUT, || async {
        let lease = leases.get_opt("decoy-of-node-0").await.map_err(e2e::Error::kube("reading the decoy"))?;
        let now = lease.and_then(|l| l.metadata.resource_version).unwrap_or_default();
        Ok(if now != versions { Probe::Done(()) } else { Probe::Pending(now) })
    })
    .await
    .expect("the decoy Lease is renewed");
    let dead = "10.73.0.200";
    inject_record(&client, POOL, BLOCK, CIDR, dead, record_json(NS, "ghost-0", "ghost-0-uid", "node-0", None, false))
        .await;
    wait_record_gone(&client, dead, STALE_AGENT_BOUND, "the leak on the Ready node without an agent released").await;
    let released =
        controller_metric(&ipwarden, controller, "ipwarden_gc_releases_total", &["reason=\"node_not_ready\""]).await;
    assert_eq!(released, 1.0, "released by the NotReady policy");
    decoy.abort();
    // The gauge is refreshed with the pool gauges (every 10 s).
    let gauge_bound = Duration::from_secs(20);
    wait::until("node-0 counted as a node without a live agent", gauge_bound, || async {
        let without = controller_metric(&ipwarden, controller, "ipwarden_nodes_without_live_agent", &[]).await;
        Ok(if without == 1.0 { Probe::Done(()) } else { Probe::Pending(format!("gauge {without}")) })
    })
    .await
    .expect("node-0 counts as a node without a live agent");

    // node-1's agent is alive: a leak there goes through the handshake as before.
    let marks = ["step=\"marked\""];
    let marked_before = controller_metric(&ipwarden, controller, "ipwarden_gc_release_handshakes_total", &marks).await;
    let live = "10.73.0.201";
    inject_record(&client, POOL, BLOCK, CIDR, live, record_json(NS, "ghost-1", "ghost-1-uid", "node-1", None, false))
        .await;
    wait_record_gone(&client, live, TIMEOUT, "the leak on the node with a live agent released").await;
    let marked_after = controller_metric(&ipwarden, controller, "ipwarden_gc_release_handshakes_total", &marks).await;
    assert_eq!(marked_after, marked_before + 1.0, "the live agent's leak was marked and answered");
    let released =
        controller_metric(&ipwarden, controller, "ipwarden_gc_releases_total", &["reason=\"node_not_ready\""]).await;
    assert_eq!(released, 1.0, "only the dead agent's leak skipped the handshake");
}

/// Issue 24, problem 3: an agent started before its Node is registered (a DaemonSet pod on a
/// joining node, an agent started ahead of its kubelet) waits for it, saying so, instead of
/// exiting on the agent Lease it cannot own yet; once the Node exists it serves, and its pods
/// get IPs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_started_before_its_node_is_registered_waits_for_it_and_then_serves() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pool = json!({"cidr": "10.75.0.0/24", "default": true});
    let mut ipwarden = Ipwarden::without_agents(2, &[(POOL, pool)], support::network()).await;
    // node-1's kubelet stops and its Node goes; its agent starts before it comes back.
    ipwarden.cluster.delete_node(1).await.expect("node-1 deleted");
    ipwarden.start_agent(0, &[]).await;
    let waiting = ipwarden.spawn_agent_unwaited(1, &[]);
    let log = ipwarden.agents[waiting].log().to_path_buf();
    wait::until("the agent says it waits for its Node", TIMEOUT, || {
        let exited = ipwarden.agents[waiting].ensure_running().err();
        let log = log.clone();
        async move {
            if let Some(exited) = exited {
                panic!("the agent exited while its Node was not registered: {exited}");
            }
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            Ok(if text.contains("waiting for its Node") { Probe::Done(()) } else { Probe::Pending(text) })
        }
    })
    .await
    .expect("a log line saying what the agent waits for");

    ipwarden.cluster.reregister_node(1).await.expect("node-1 registered");
    ipwarden.wait_agent_serving(waiting).await;
    support::create_pod(&ipwarden.client(), NS, "joined", "node-1", json!({"app": "joined"})).await;
    let pods = support::wait_pods_with_ips(&ipwarden.client(), NS, "app=joined", 1).await;
    let ip = support::ip_of(&pods["joined"]);
    assert_eq!(records(&ipwarden.client()).await.get(&ip).map(|r| r.node.clone()), Some("node-1".to_string()));
}
