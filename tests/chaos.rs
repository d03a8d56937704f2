//! Chaos suites (CI-sized): the design's invariants under the churn and faults real clusters
//! have. Each suite runs on the real control plane with 3 simulated nodes, an agent per node
//! and 2 controller replicas, with the invariant checker (the code of `ipwarden check`)
//! polling every second; after the run the cluster must settle with no problem left.
//!
//! The suites run one at a time (a shared lock): two of them side by side on 2 cores would
//! test the machine's scheduler more than ipwarden.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use e2e::controlplane::ComponentName;
use e2e::wait::{self, Probe};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, PropagationPolicy};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::invariants::{InvariantChecker, wait_settled};
use support::{
    Ipwarden, TIMEOUT, claims, create_pod, inject_record, ip_of, pod_template, pods_with_ips, record_json, records,
};

const NS: &str = "default";
const POOL: &str = "chaos";

/// How long a suite's leaks may take to be reclaimed once injected, and the cluster to settle
/// after a run, with the suites' settings (sweep every 5 s, sandbox grace 5 s, pod GC of a
/// deleted node's pods up to a minute): documented in docs/testing.md.
const SETTLE: Duration = Duration::from_secs(150);

/// Rounds of the mixed-workload suite: 4 in CI, more for a soak (`make soak`).
fn rounds() -> usize {
    std::env::var("IPWARDEN_CHAOS_ROUNDS").ok().and_then(|r| r.parse().ok()).filter(|r| *r >= 2).unwrap_or(4)
}

/// The agents ask their runtime over CRI (`--cri-socket`), as in production on containerd.
const AGENT_ARGS: [&str; 4] = [
    "--reuse-cooldown-seconds=1",
    "--release-sandbox-grace-seconds=5",
    e2e::ipwarden::WITH_CRI,
    "--cri-poll-interval-seconds=1",
];
const CONTROLLER_ARGS: [&str; 1] = ["--full-scan-interval-seconds=5"];

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// 3 nodes with agents, 2 controller replicas (one leading), and the invariant checker. The
/// agents run as the chart installs them, each on a token bound to its node under the
/// node-bound write policies, so every write of the churn is one the apiserver lets a node make.
async fn start(pool: serde_json::Value) -> (Ipwarden, InvariantChecker) {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start_node_bound(3, &[(POOL, pool)], &AGENT_ARGS).await;
    ipwarden.start_controller("a", &CONTROLLER_ARGS);
    ipwarden.start_controller("b", &CONTROLLER_ARGS);
    ipwarden.wait_any_leader().await;
    let checker = InvariantChecker::start(ipwarden.client());
    (ipwarden, checker)
}

/// A small deterministic generator: the suites' "random" choices are the same every run.
struct Dice(u64);

impl Dice {
    fn roll(&mut self, low: i32, high: i32) -> i32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let span = u64::try_from(high - low + 1).expect("a range");
        low + i32::try_from(self.0 % span).expect("small")
    }
}

async fn create_statefulset(client: &Client, name: &str, replicas: i32) {
    let sts: StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "serviceName": name, "podManagementPolicy": "Parallel",
                 "selector": {"matchLabels": {"app": name}}, "template": pod_template(name, json!({}))},
    }))
    .expect("sts");
    Api::<StatefulSet>::namespaced(client.clone(), NS).create(&PostParams::default(), &sts).await.expect("create sts");
}

async fn create_deployment(client: &Client, name: &str, replicas: i32) {
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}}, "template": pod_template(name, json!({}))},
    }))
    .expect("deployment");
    Api::<Deployment>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &deployment)
        .await
        .expect("create deployment");
}

async fn scale<K>(client: &Client, name: &str, replicas: i32)
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned,
{
    let patch = json!({"spec": {"replicas": replicas}});
    Api::<K>::namespaced(client.clone(), NS)
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_or_else(|e| panic!("scaling {name} to {replicas}: {e}"));
}

/// Waits until exactly `count` live pods of `app` report IPs; returns them by name.
async fn running(client: &Client, app: &str, count: usize) -> BTreeMap<String, Pod> {
    wait::until(&format!("{count} pods of {app} with IPs"), TIMEOUT, || async {
        let pods = pods_with_ips(client, NS, &format!("app={app}")).await?;
        Ok(if pods.len() == count { Probe::Done(pods) } else { Probe::Pending(format!("{} of {count}", pods.len())) })
    })
    .await
    .expect("workload converges")
}

/// Waits until the live pods of `app` are `count` new ones (none of `old`'s UIDs), with IPs.
async fn replaced(client: &Client, app: &str, count: usize, old: &BTreeMap<String, Pod>) -> BTreeMap<String, Pod> {
    let old_uids: BTreeSet<String> = old.values().filter_map(|p| p.uid()).collect();
    wait::until(&format!("{count} new pods of {app} with IPs"), TIMEOUT, || async {
        let pods = pods_with_ips(client, NS, &format!("app={app}")).await?;
        let fresh = pods.values().filter(|p| p.uid().is_some_and(|u| !old_uids.contains(&u))).count();
        Ok(if fresh == count && pods.len() == count {
            Probe::Done(pods)
        } else {
            Probe::Pending(format!("{fresh} new of {count}"))
        })
    })
    .await
    .expect("pods recreated")
}

fn ips(pods: &BTreeMap<String, Pod>) -> BTreeMap<String, String> {
    pods.iter().map(|(name, pod)| (name.clone(), ip_of(pod))).collect()
}

async fn delete_pods(client: &Client, selector: &str) {
    Api::<Pod>::namespaced(client.clone(), NS)
        .delete_collection(&DeleteParams::default(), &ListParams::default().labels(selector))
        .await
        .expect("delete pods");
}

async fn delete_pod(client: &Client, name: &str, grace: Option<u32>) {
    let params = DeleteParams { grace_period_seconds: grace, ..DeleteParams::default() };
    Api::<Pod>::namespaced(client.clone(), NS).delete(name, &params).await.expect("delete pod");
}

/// Waits until no pod is left in the namespace, then until no record and no claim is.
async fn wait_empty(client: &Client) {
    wait::until("every pod gone", SETTLE, || async {
        let left = Api::<Pod>::namespaced(client.clone(), NS)
            .list(&ListParams::default())
            .await
            .map_err(e2e::Error::kube("list pods"))?
            .items
            .len();
        Ok(if left == 0 { Probe::Done(()) } else { Probe::Pending(format!("{left} pods left")) })
    })
    .await
    .expect("pods deleted");
    wait::until("the pool empty and every claim gone", SETTLE, || async {
        let (held, claimed) = (records(client).await, claims(client, NS).await);
        Ok(if held.is_empty() && claimed.is_empty() {
            Probe::Done(())
        } else {
            Probe::Pending(format!("{} records, claims {:?}", held.len(), claimed.keys().collect::<Vec<_>>()))
        })
    })
    .await
    .expect("nothing left behind");
}

/// Waits until none of `ips` has a record.
async fn wait_reclaimed(client: &Client, ips: &[String], what: &str) {
    wait::until(what, SETTLE, || async {
        let held = records(client).await;
        let left: Vec<&String> = ips.iter().filter(|ip| held.contains_key(*ip)).collect();
        Ok(if left.is_empty() { Probe::Done(()) } else { Probe::Pending(format!("still recorded: {left:?}")) })
    })
    .await
    .expect("leaks reclaimed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_workloads_with_random_repartition_and_a_killed_leader_leave_nothing_behind() {
    let _serial = SERIAL.lock().await;
    // 24 IPs: the most the workloads below ask for at once, surge included, plus a few.
    let pool =
        json!({"cidr": "10.80.0.0/24", "default": true, "ranges": [{"start": "10.80.0.10", "end": "10.80.0.33"}]});
    let (mut ipwarden, checker) = start(pool).await;
    let client = ipwarden.client();
    create_statefulset(&client, "db", 3).await;
    create_statefulset(&client, "cache", 2).await;
    create_deployment(&client, "api", 4).await;
    let job: Job = serde_json::from_value(json!({
        "metadata": {"name": "batch"},
        "spec": {"completions": 6, "parallelism": 2, "backoffLimit": 0,
                 "template": {"metadata": {"labels": {"app": "batch"}, "annotations": {e2e::kubelet::RUN_SECONDS_ANNOTATION: "2"}},
                              "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                                       "containers": [{"name": "c", "image": "registry.invalid/c:1"}]}}},
    }))
    .expect("job");
    Api::<Job>::namespaced(client.clone(), NS).create(&PostParams::default(), &job).await.expect("job");
    for i in 0..3 {
        create_pod(&client, NS, &format!("bare-{i}"), &format!("node-{i}"), json!({"app": "bare"})).await;
    }

    let mut dice = Dice(0x5eed_1234_abcd_0001);
    let mut killed = None;
    let rounds = rounds();
    for round in 0..rounds {
        let (db, cache, api) = (dice.roll(1, 4), dice.roll(1, 3), dice.roll(2, 5));
        scale::<StatefulSet>(&client, "db", db).await;
        scale::<StatefulSet>(&client, "cache", cache).await;
        scale::<Deployment>(&client, "api", api).await;
        let live = pods_with_ips(&client, NS, "app=api").await.expect("api pods");
        if let Some(name) = live.keys().nth(usize::try_from(dice.roll(0, 3)).unwrap_or(0) % live.len().max(1)) {
            delete_pod(&client, name, None).await;
        }
        delete_pod(&client, &format!("bare-{round}"), None).await;
        let node = format!("node-{}", round % 3);
        create_pod(&client, NS, &format!("bare-{}", round + 3), &node, json!({"app": "bare"})).await;
        if round == 1 {
            let leader = ipwarden.wait_any_leader().await;
            ipwarden.controllers[leader].kill();
            killed = Some(leader);
        }
        if round == rounds - 1
            && let Some(leader) = killed
        {
            ipwarden.controllers[leader].restart().expect("the killed controller restarts");
        }
        let db = usize::try_from(db).expect("replicas");
        let (cache, api) = (usize::try_from(cache).expect("replicas"), usize::try_from(api).expect("replicas"));
        running(&client, "db", db).await;
        running(&client, "cache", cache).await;
        running(&client, "api", api).await;
        running(&client, "bare", 3).await;
    }
    wait::until("the Job completing", TIMEOUT, || async {
        let job = Api::<Job>::namespaced(client.clone(), NS).get("batch").await.map_err(e2e::Error::kube("job"))?;
        let succeeded = job.status.and_then(|s| s.succeeded).unwrap_or(0);
        Ok(if succeeded == 6 { Probe::Done(()) } else { Probe::Pending(format!("{succeeded} of 6")) })
    })
    .await
    .expect("job completes");

    let background =
        DeleteParams { propagation_policy: Some(PropagationPolicy::Background), ..DeleteParams::default() };
    for name in ["db", "cache"] {
        Api::<StatefulSet>::namespaced(client.clone(), NS).delete(name, &background).await.expect("delete sts");
    }
    Api::<Deployment>::namespaced(client.clone(), NS).delete("api", &background).await.expect("delete deployment");
    Api::<Job>::namespaced(client.clone(), NS).delete("batch", &background).await.expect("delete job");
    delete_pods(&client, "app=bare").await;
    wait_empty(&client).await;
    checker.finish().await;
    wait_settled(&client, SETTLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_injected_leak_is_reclaimed_and_nothing_else_is_touched() {
    let _serial = SERIAL.lock().await;
    let (mut ipwarden, checker) = start(json!({"cidr": "10.81.0.0/24", "default": true})).await;
    let client = ipwarden.client();
    // Bystanders on node-0 and node-1 must come through untouched.
    for i in 0..4 {
        create_pod(&client, NS, &format!("by-{i}"), &format!("node-{}", i % 2), json!({"app": "by"})).await;
    }
    let bystanders = running(&client, "by", 4).await;
    let mut leaks: Vec<String> = Vec::new();

    // An agent killed between allocation and checkpoint: its checkpoint saves are held (the
    // records are written, no ADD is answered), then it is SIGKILLed.
    const BURST: usize = 12;
    let node0_dir = ipwarden.cluster.nodes()[0].dir().to_path_buf();
    let hold = e2e::ipwarden::CheckpointHold::start(&node0_dir).expect("hold node-0's checkpoint saves");
    for i in 0..BURST {
        create_pod(&client, NS, &format!("burst-{i}"), "node-0", json!({"app": "burst"})).await;
    }
    let burst_records =
        || async { records(&client).await.values().filter(|r| r.pod.name.starts_with("burst-")).count() };
    wait::until("the burst's records written", TIMEOUT, || async {
        Ok(if burst_records().await >= 1 { Probe::Done(()) } else { Probe::Pending("no record yet".into()) })
    })
    .await
    .expect("burst starts");
    ipwarden.agents[0].kill();
    drop(hold);
    let checkpoint = std::fs::read_to_string(e2e::ipwarden::checkpoint_path(&node0_dir)).expect("node-0's checkpoint");
    assert!(!checkpoint.contains("burst-"), "the held checkpoint saved no burst pod: {checkpoint}");
    ipwarden.agents[0].restart().expect("agent restarts");
    ipwarden.wait_agent_serving(0).await;
    running(&client, "burst", BURST).await;

    // DEL skipped on node-1, once for a graceful delete and once for a force delete.
    for name in ["skipped", "forced"] {
        create_pod(&client, NS, name, "node-1", json!({"app": "skip"})).await;
    }
    let skip = running(&client, "skip", 2).await;
    leaks.extend(skip.values().map(ip_of));
    let node1 = &ipwarden.cluster.nodes()[1];
    node1.faults().set_skip_del(true);
    delete_pod(&client, "skipped", None).await;
    delete_pod(&client, "forced", Some(0)).await;
    let skip_uids: Vec<String> = skip.values().filter_map(|p| p.uid()).collect();
    wait::until("node-1's runtime letting both sandboxes go without DEL", TIMEOUT, || async {
        let sandboxes = node1.sandboxes();
        Ok(if skip_uids.iter().any(|u| sandboxes.contains_key(u)) {
            Probe::Pending("sandboxes still up".into())
        } else {
            Probe::Done(())
        })
    })
    .await
    .expect("sandboxes gone");
    node1.faults().set_skip_del(false);

    // A node lost with pods on it, then deleted: pod GC removes its pods, their IPs go.
    for i in 0..2 {
        create_pod(&client, NS, &format!("lost-{i}"), "node-2", json!({"app": "lost"})).await;
    }
    leaks.extend(running(&client, "lost", 2).await.values().map(ip_of));
    ipwarden.cluster.nodes()[2].lose();
    Api::<Node>::all(client.clone()).delete("node-2", &DeleteParams::default()).await.expect("delete node-2");

    // Records no agent wrote: a pod that never existed, a live pod's name with a bogus UID, a
    // node that does not exist.
    let bogus = [
        ("10.81.0.240", record_json(NS, "never-existed", "u-never", "node-0", None, false)),
        ("10.81.0.241", record_json(NS, "by-0", "u-bogus", "node-0", None, false)),
        ("10.81.0.242", record_json(NS, "ghost", "u-ghost", "no-such-node", None, false)),
    ];
    for (ip, record) in bogus {
        inject_record(&client, POOL, "chaos-10-81-0-0-24", "10.81.0.0/24", ip, record).await;
        leaks.push(ip.to_string());
    }

    wait_reclaimed(&client, &leaks, "every injected leak reclaimed").await;
    let held = records(&client).await;
    for (name, pod) in &bystanders {
        assert_eq!(held.get(&ip_of(pod)).map(|r| r.pod.uid.clone()), pod.uid(), "{name}'s record untouched");
    }
    let burst: Vec<_> = held.values().filter(|r| r.pod.name.starts_with("burst-")).collect();
    assert_eq!(burst.len(), BURST, "one record per burst pod after the agent's crash: {burst:?}");
    checker.finish().await;
    wait_settled(&client, SETTLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statefulset_pods_keep_their_ips_through_deletions_a_drain_and_a_controller_restart() {
    let _serial = SERIAL.lock().await;
    let (mut ipwarden, checker) = start(json!({"cidr": "10.82.0.0/24", "default": true})).await;
    let client = ipwarden.client();
    create_statefulset(&client, "web", 4).await;
    let first = running(&client, "web", 4).await;
    let fixed = ips(&first);
    // A pod's IPs follow it to another node once the controller witnessed its claim (before
    // that, no other node's record is taken for it: decision 0022).
    for (name, pod) in &first {
        support::wait_witnessed(&client, NS, name, &pod.uid().unwrap_or_default()).await;
    }

    // One pod deleted.
    delete_pod(&client, "web-1", None).await;
    let uid = first["web-1"].uid();
    let pods = wait::until("web-1 recreated", TIMEOUT, || async {
        let pods = pods_with_ips(&client, NS, "app=web").await?;
        let fresh = pods.get("web-1").is_some_and(|p| p.uid() != uid);
        Ok(if fresh && pods.len() == 4 { Probe::Done(pods) } else { Probe::Pending("web-1 not back".into()) })
    })
    .await
    .expect("web-1 back");
    assert_eq!(ips(&pods), fixed, "web-1 got its IP back");

    // All at once.
    delete_pods(&client, "app=web").await;
    let pods = replaced(&client, "web", 4, &pods).await;
    assert_eq!(ips(&pods), fixed, "every pod got its IP back");

    // A node drained: cordoned, its pods deleted, recreated on the other nodes.
    let drained = pods["web-0"].spec.as_ref().and_then(|s| s.node_name.clone()).expect("web-0's node");
    let nodes: Api<Node> = Api::all(client.clone());
    let cordon = |on: bool| json!({"spec": {"unschedulable": on}});
    nodes.patch(&drained, &PatchParams::default(), &Patch::Merge(&cordon(true))).await.expect("cordon");
    for (name, pod) in &pods {
        if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(drained.as_str()) {
            delete_pod(&client, name, None).await;
        }
    }
    let moved: Vec<String> = pods
        .iter()
        .filter(|(_, p)| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(drained.as_str()))
        .map(|(n, _)| n.clone())
        .collect();
    let pods = wait::until("the drained pods recreated elsewhere", TIMEOUT, || async {
        let now = pods_with_ips(&client, NS, "app=web").await?;
        let back = moved.iter().all(|n| {
            now.get(n).is_some_and(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(drained.as_str()))
        });
        Ok(if back && now.len() == 4 { Probe::Done(now) } else { Probe::Pending(format!("{moved:?} not back")) })
    })
    .await
    .expect("drained pods back");
    assert_eq!(ips(&pods), fixed, "the drained pods kept their IPs on their new nodes");
    nodes.patch(&drained, &PatchParams::default(), &Patch::Merge(&cordon(false))).await.expect("uncordon");

    // The leader killed while every pod is being recreated.
    delete_pods(&client, "app=web").await;
    let leader = ipwarden.wait_any_leader().await;
    ipwarden.controllers[leader].kill();
    ipwarden.controllers[leader].restart().expect("controller restarts");
    let pods = replaced(&client, "web", 4, &pods).await;
    assert_eq!(ips(&pods), fixed, "a controller restart during recreation changes no IP");

    // Scale-down frees the removed ordinals' IPs and claims.
    scale::<StatefulSet>(&client, "web", 2).await;
    running(&client, "web", 2).await;
    wait_reclaimed(&client, &[fixed["web-2"].clone(), fixed["web-3"].clone()], "web-2 and web-3 freed").await;
    wait::until("web-2 and web-3's claims gone", SETTLE, || async {
        let names: BTreeSet<String> = claims(&client, NS).await.into_keys().collect();
        let left = names.contains("web-2") || names.contains("web-3");
        Ok(if left { Probe::Pending(format!("{names:?}")) } else { Probe::Done(()) })
    })
    .await
    .expect("claims of removed ordinals deleted");

    // A StatefulSet deleted frees everything it had.
    create_statefulset(&client, "cache", 2).await;
    let cache = ips(&running(&client, "cache", 2).await);
    let background =
        DeleteParams { propagation_policy: Some(PropagationPolicy::Background), ..DeleteParams::default() };
    Api::<StatefulSet>::namespaced(client.clone(), NS).delete("cache", &background).await.expect("delete cache");
    wait_reclaimed(&client, &cache.values().cloned().collect::<Vec<_>>(), "the deleted StatefulSet's IPs freed").await;

    // web moves off ipwarden (host network): its records and claims are reclaimed.
    let web_ips: Vec<String> = ips(&running(&client, "web", 2).await).into_values().collect();
    let off = json!({"spec": {"template": {"spec": {"hostNetwork": true}}}});
    Api::<StatefulSet>::namespaced(client.clone(), NS)
        .patch("web", &PatchParams::default(), &Patch::Merge(&off))
        .await
        .expect("move web to host network");
    wait_reclaimed(&client, &web_ips, "web's IPs reclaimed after it left ipwarden").await;
    wait::until("every claim gone", SETTLE, || async {
        let names: Vec<String> = claims(&client, NS).await.into_keys().collect();
        Ok(if names.is_empty() { Probe::Done(()) } else { Probe::Pending(format!("{names:?}")) })
    })
    .await
    .expect("claims reclaimed");
    checker.finish().await;
    wait_settled(&client, SETTLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_controller_an_agent_the_apiserver_and_etcd_during_churn_loses_nothing() {
    let _serial = SERIAL.lock().await;
    let (mut ipwarden, checker) = start(json!({"cidr": "10.83.0.0/24", "default": true})).await;
    let client = ipwarden.client();
    create_deployment(&client, "churn", 6).await;
    create_statefulset(&client, "steady", 3).await;
    let mut pods = running(&client, "churn", 6).await;
    running(&client, "steady", 3).await;
    let churn = tokio::spawn(e2e::demo::churn_pods(client.clone(), NS, "app=churn", Duration::from_secs(1)));

    let faults = ["controller", "agent", "apiserver", "etcd"];
    for fault in faults {
        match fault {
            "controller" => {
                let leader = ipwarden.wait_any_leader().await;
                ipwarden.controllers[leader].kill();
                ipwarden.controllers[leader].restart().expect("controller restarts");
            }
            "agent" => {
                ipwarden.agents[1].kill();
                ipwarden.agents[1].restart().expect("agent restarts");
                ipwarden.wait_agent_serving(1).await;
            }
            "apiserver" => {
                let control_plane = ipwarden.cluster.control_plane();
                control_plane.kill(ComponentName::Apiserver).expect("kill apiserver");
                control_plane.restart(ComponentName::Apiserver).await.expect("apiserver restarts");
            }
            _ => {
                let control_plane = ipwarden.cluster.control_plane();
                control_plane.kill(ComponentName::Etcd).expect("kill etcd");
                control_plane.restart(ComponentName::Etcd).await.expect("etcd restarts");
            }
        }
        // Churn goes on after the fault: new pods keep getting IPs.
        let before: BTreeSet<String> = pods.values().filter_map(|p| p.uid()).collect();
        pods = wait::until(&format!("new churn pods with IPs after the {fault} restart"), TIMEOUT, || async {
            let now = pods_with_ips(&client, NS, "app=churn").await?;
            let fresh = now.values().filter(|p| p.uid().is_some_and(|u| !before.contains(&u))).count();
            Ok(if fresh >= 2 { Probe::Done(now) } else { Probe::Pending(format!("{fresh} new pods")) })
        })
        .await
        .expect("churn continues");
    }
    churn.abort();
    scale::<Deployment>(&client, "churn", 6).await;
    running(&client, "churn", 6).await;
    let steady = running(&client, "steady", 3).await;
    let held = records(&client).await;
    for (name, pod) in &steady {
        assert_eq!(held.get(&ip_of(pod)).map(|r| r.pod.uid.clone()), pod.uid(), "{name}'s record survived");
    }
    let background =
        DeleteParams { propagation_policy: Some(PropagationPolicy::Background), ..DeleteParams::default() };
    Api::<Deployment>::namespaced(client.clone(), NS).delete("churn", &background).await.expect("delete churn");
    Api::<StatefulSet>::namespaced(client.clone(), NS).delete("steady", &background).await.expect("delete steady");
    wait_empty(&client).await;
    checker.finish().await;
    wait_settled(&client, SETTLE).await;
}

#[test]
fn the_checker_flags_a_statefulset_pod_back_with_another_ip_once_witnessed_unless_its_ordinal_was_let_go() {
    use support::invariants::{StickyMemory, Witnessed, sticky_changes};
    let pod = |uid: &str, ip: &str| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"namespace": NS, "name": "web-1", "uid": uid,
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": "s", "controller": true}]},
            "status": {"phase": "Running", "podIPs": [{"ip": ip}]},
        }))
        .expect("pod")
    };
    let sts = |replicas: i32| -> StatefulSet {
        serde_json::from_value(json!({"metadata": {"namespace": NS, "name": "web"}, "spec": {
            "replicas": replicas, "serviceName": "web", "selector": {}, "template": {}}}))
        .expect("sts")
    };
    let witnessed = |ips: &[&str]| -> Witnessed {
        ips.iter().map(|ip| ((NS.to_string(), "web-1".to_string()), ip.to_string())).collect()
    };
    let (none, five) = (witnessed(&[]), witnessed(&["10.0.0.5"]));
    let mut memory = StickyMemory::new();
    assert!(sticky_changes(&[pod("u0", "10.0.0.6")], &[sts(2)], &none, &mut memory).is_empty());
    assert!(
        sticky_changes(&[pod("u1", "10.0.0.5")], &[sts(2)], &none, &mut memory).is_empty(),
        "recreated with another IP before the controller witnessed the first"
    );
    assert!(sticky_changes(&[pod("u1", "10.0.0.5")], &[sts(2)], &five, &mut memory).is_empty());
    assert!(sticky_changes(&[pod("u1", "10.0.0.5")], &[sts(2)], &five, &mut memory).is_empty(), "same pod, same IP");
    let moved = sticky_changes(&[pod("u2", "10.0.0.9")], &[sts(2)], &five, &mut memory);
    assert_eq!(moved.len(), 1, "recreated with another IP: {moved:?}");
    assert!(sticky_changes(&[], &[sts(1)], &five, &mut memory).is_empty(), "scaled below the ordinal");
    assert!(
        sticky_changes(&[pod("u3", "10.0.0.7")], &[sts(2)], &five, &mut memory).is_empty(),
        "a let-go ordinal may move"
    );
}
