//! Dual stack on the real control plane: an IPv4 and an IPv6 default pool, so every pod gets
//! one IP of each family through the real CNI plugin. DEL frees both, a StatefulSet pod keeps
//! both across a restart, and an ADD that cannot get its second family, or whose IPClaim
//! write is refused, undoes its block writes: kubelet retries leak nothing.

mod support;

use std::collections::BTreeMap;

use e2e::cni::{Invocation, PodArgs};
use e2e::wait::{self, Probe};
use ipwarden::crd::{Allocation, IPBlock, IPClaim};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use support::{Ipwarden, TIMEOUT, claims, create_pod, metric, network};

const NS: &str = "default";
const V4: &str = "v4";
const V6: &str = "v6";

/// The dual-stack pool pair: a /24 of IPv4 and `v6` as the IPv6 pool's spec.
fn pools(v6: Value) -> [(&'static str, Value); 2] {
    [(V4, json!({"cidr": "10.70.0.0/24", "default": true})), (V6, v6)]
}

/// Every record of pool `pool`, by IP.
async fn pool_records(client: &Client, pool: &str) -> Result<BTreeMap<String, Allocation>, e2e::Error> {
    let blocks = Api::<IPBlock>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(e2e::Error::kube("list blocks"))?;
    Ok(blocks.items.into_iter().filter(|b| b.spec.pool == pool).flat_map(|b| b.spec.allocations).collect())
}

/// The pod's `status.podIPs`, in order.
fn pod_ips(pod: &Pod) -> Vec<String> {
    pod.status.as_ref().and_then(|s| s.pod_ips.as_ref()).into_iter().flatten().map(|ip| ip.ip.clone()).collect()
}

/// Waits until pod `name` runs with two pod IPs under a UID other than `not_uid`.
async fn wait_dual_stack(client: &Client, name: &str, not_uid: Option<&str>) -> Pod {
    wait::until(&format!("{name} running with two pod IPs"), TIMEOUT, || async {
        let pod =
            Api::<Pod>::namespaced(client.clone(), NS).get_opt(name).await.map_err(e2e::Error::kube("get pod"))?;
        Ok(match pod {
            Some(pod) if pod_ips(&pod).len() == 2 && pod.uid().as_deref() != not_uid => Probe::Done(pod),
            Some(pod) => Probe::Pending(format!("podIPs {:?}", pod_ips(&pod))),
            None => Probe::Pending("no pod".into()),
        })
    })
    .await
    .expect("the pod runs dual-stack")
}

/// Waits until a controller has witnessed the claim of StatefulSet pod `pod` for its UID
/// holding both its pod IPs: an ADD writes one family after the other, and a witness may come
/// in between.
async fn wait_witnessed_dual_stack(client: &Client, pod: &Pod) {
    let (name, uid, ips) = (pod.name_any(), pod.uid().unwrap_or_default(), pod_ips(pod));
    wait::until(&format!("{name}'s claim witnessed naming {ips:?}"), TIMEOUT, || async {
        let claim = claims(client, NS).await.remove(&name);
        let seen = claim.and_then(|c| c.status).and_then(|s| s.witnessed).filter(|w| w.pod_uid == uid);
        let seen: Vec<String> =
            seen.iter().flat_map(|w| &w.interfaces).flat_map(|i| &i.ips).map(|c| c.ip.clone()).collect();
        Ok(if seen == ips { Probe::Done(()) } else { Probe::Pending(format!("{seen:?}")) })
    })
    .await
    .expect("the controller witnesses both families");
}

/// Asserts that `pod` holds one IPv4 address of pool v4 first and one IPv6 address of pool
/// v6, each recorded for its UID, and that its claim names both when it is a StatefulSet pod
/// (a stateless pod has none); returns the two IPs. A StatefulSet pod's claim is read once the
/// controller (which must run) witnessed the pod holding both: the controller writes the claim
/// after the ADD, not the ADD itself (decision 0022).
async fn assert_dual_stack(ipwarden: &Ipwarden, pod: &Pod) -> Vec<String> {
    let client = &ipwarden.client();
    let ips = pod_ips(pod);
    let name = pod.name_any();
    assert!(
        ips[0].starts_with("10.70.0.") && ips[1].starts_with("fd00:70::"),
        "{name}: IPv4 first, then IPv6: {ips:?}"
    );
    let uid = pod.uid().unwrap_or_default();
    for (pool, ip) in [(V4, &ips[0]), (V6, &ips[1])] {
        let records = pool_records(client, pool).await.expect("records");
        assert_eq!(records.get(ip).map(|r| r.pod.uid.as_str()), Some(uid.as_str()), "{ip} is recorded for {name}");
    }
    let sticky = pod.owner_references().iter().any(|o| o.kind == "StatefulSet");
    if sticky {
        wait_witnessed_dual_stack(client, pod).await;
    }
    let claim = claims(client, NS).await.remove(&name);
    if !sticky {
        assert!(claim.is_none(), "{name}, a stateless pod, has no claim");
        return ips;
    }
    let claim = claim.unwrap_or_else(|| panic!("{name} has a claim"));
    let claimed: Vec<String> = claim.spec.interfaces[0].ips.iter().map(|i| i.ip.clone()).collect();
    assert_eq!(claimed, ips, "{name}'s claim names both IPs");
    ips
}

fn statefulset(name: &str) -> StatefulSet {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"replicas": 1, "serviceName": name, "selector": {"matchLabels": {"app": name}},
                 "template": support::pod_template(name, json!({}))},
    }))
    .expect("statefulset")
}

/// Creates StatefulSet `db` and waits until db-0 runs dual-stack (and, while a controller
/// runs, until it witnessed db-0's claim); returns it and its IPs.
async fn db_running_dual_stack(ipwarden: &Ipwarden) -> (Pod, Vec<String>) {
    let client = &ipwarden.client();
    Api::<StatefulSet>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &statefulset("db"))
        .await
        .expect("create db");
    let db0 = wait_dual_stack(client, "db-0", None).await;
    let ips = assert_dual_stack(ipwarden, &db0).await;
    (db0, ips)
}

/// Waits until agent 0 has counted at least `count` ADDs with `result`.
async fn wait_adds(ipwarden: &Ipwarden, result: &str, count: f64) {
    let series = format!(r#"ipwarden_agent_allocations_total{{result="{result}"}}"#);
    wait::until(&format!("{count} ADDs with result {result}"), TIMEOUT, || async {
        let seen = metric(&ipwarden.scrape_agent(0).await, &series);
        Ok(if seen >= count { Probe::Done(()) } else { Probe::Pending(format!("{seen}")) })
    })
    .await
    .expect("the kubelet retries the ADD");
}

/// Creates pod `name` bound to a node no kubelet runs, so only the test wires it; returns its
/// CNI arguments and the netconf that reaches node-0's agent.
async fn unwired_pod(ipwarden: &Ipwarden, name: &str) -> (PodArgs, Value) {
    let client = ipwarden.client();
    create_pod(&client, NS, name, "elsewhere", json!({"app": name})).await;
    let pod = Api::<Pod>::namespaced(client, NS).get(name).await.expect("pod");
    let args = PodArgs { namespace: NS.into(), name: name.into(), uid: pod.uid().unwrap_or_default() };
    let netconf = json!({"cniVersion": "1.1.0", "name": "ipwarden", "type": "ipwarden-cni",
                         "socket": ipwarden.cluster.nodes()[0].dir().join("agent.sock")});
    (args, netconf)
}

/// Waits until exactly `count` records are left in both pools (the running pods' own).
async fn wait_records(client: &Client, count: usize) {
    wait::until(&format!("{count} records left"), TIMEOUT, || async {
        let held = support::records(client).await.len();
        Ok(if held == count { Probe::Done(()) } else { Probe::Pending(format!("{held} records")) })
    })
    .await
    .expect("nothing leaked");
}

/// Waits until no record is left and pod `name`'s claim is gone.
async fn wait_freed(client: &Client, name: &str) {
    wait::until(&format!("both of {name}'s IPs and its claim freed"), TIMEOUT, || async {
        let held = support::records(client).await.len();
        let claimed = claims(client, NS).await.contains_key(name);
        Ok(if held == 0 && !claimed {
            Probe::Done(())
        } else {
            Probe::Pending(format!("{held} records, claim {claimed}"))
        })
    })
    .await
    .expect("both families freed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dual_stack_pod_gets_one_ip_per_family_and_its_del_frees_both() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let ipwarden = Ipwarden::start(1, &pools(json!({"cidr": "fd00:70::/120", "default": true})), &[]).await;
    let client = ipwarden.client();

    // The CNI result itself, from the plugin binary: one address per family with its prefix.
    let (args, netconf) = unwired_pod(&ipwarden, "manual").await;
    let add = Invocation { command: "ADD", container_id: "dual", ifname: "eth0", pod: Some(&args), netconf: &netconf };
    let result = network().invoke(&add).await.expect("ADD").expect("a result");
    let addresses: Vec<&str> =
        result["ips"].as_array().expect("ips").iter().filter_map(|i| i["address"].as_str()).collect();
    assert_eq!(addresses.len(), 2, "one address per family: {addresses:?}");
    assert!(addresses[0].starts_with("10.70.0.") && addresses[0].ends_with("/24"), "{addresses:?}");
    assert!(addresses[1].starts_with("fd00:70::") && addresses[1].ends_with("/120"), "{addresses:?}");
    let del = Invocation { command: "DEL", ..add };
    network().invoke(&del).await.expect("DEL");
    assert!(support::records(&client).await.is_empty(), "DEL freed both families");

    // Through the kubelet: pod status reports both, records and claim agree, DEL frees both.
    create_pod(&client, NS, "web", "node-0", json!({"app": "web"})).await;
    let web = wait_dual_stack(&client, "web", None).await;
    assert_dual_stack(&ipwarden, &web).await;
    Api::<Pod>::namespaced(client.clone(), NS).delete("web", &DeleteParams::default()).await.expect("delete web");
    wait_freed(&client, "web").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dual_stack_statefulset_pod_recreated_keeps_both_ips() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &pools(json!({"cidr": "fd00:70::/120", "default": true})), &[]).await;
    let client = ipwarden.client();
    // A recreated sticky pod takes back the IPs the controller witnessed its claim holding
    // (decision 0022): assert_dual_stack waits for that witness before db-0 is deleted.
    let controller = ipwarden.start_controller("controller", &[]);
    ipwarden.wait_leader(controller).await;
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), NS);
    statefulsets.create(&PostParams::default(), &statefulset("db")).await.expect("create db");
    let before = wait_dual_stack(&client, "db-0", None).await;
    let ips = assert_dual_stack(&ipwarden, &before).await;

    Api::<Pod>::namespaced(client.clone(), NS).delete("db-0", &DeleteParams::default()).await.expect("delete db-0");
    let after = wait_dual_stack(&client, "db-0", before.uid().as_deref()).await;
    assert_eq!(assert_dual_stack(&ipwarden, &after).await, ips, "the recreated pod keeps both IPs");
    assert_eq!(support::records(&client).await.len(), 2, "nothing else is held");

    let scale = json!({"spec": {"replicas": 0}});
    statefulsets.patch("db", &PatchParams::default(), &Patch::Merge(scale)).await.expect("scale down");
    wait_freed(&client, "db-0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sticky_pod_keeps_its_ipv6_when_only_its_ipv4_pool_is_being_deleted() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pools = pools(json!({"cidr": "fd00:70::/120", "default": true}));
    let mut ipwarden = Ipwarden::start(1, &pools, &["--reuse-cooldown-seconds=0"]).await;
    let client = ipwarden.client();
    ipwarden.start_controller("controller-0", &["--full-scan-interval-seconds=600"]);
    ipwarden.wait_leader(0).await;
    let (before, ips) = db_running_dual_stack(&ipwarden).await;
    support::delete_pool_in_use(&client, V4).await;
    e2e::ipwarden::create_pool(&client, "v4-next", json!({"cidr": "10.71.0.0/24", "default": true}))
        .await
        .expect("create pool v4-next");

    Api::<Pod>::namespaced(client.clone(), NS).delete("db-0", &DeleteParams::default()).await.expect("delete db-0");
    let after = wait_dual_stack(&client, "db-0", before.uid().as_deref()).await;
    let now = pod_ips(&after);
    assert!(now[0].starts_with("10.71.0."), "the IPv4 pool being deleted gave its IP up: {now:?}");
    assert_eq!(now[1], ips[1], "the IPv6 pool, not being deleted, gave the sticky IPv6 back");
    // From decision 0022 on, the controller writes the claim after the ADD: read it once the
    // controller witnessed the new db-0.
    wait_witnessed_dual_stack(&client, &after).await;
    let claim = claims(&client, NS).await.remove("db-0").expect("db-0 has a claim");
    let claimed: Vec<String> = claim.spec.interfaces[0].ips.iter().map(|i| i.ip.clone()).collect();
    assert_eq!(claimed, now, "the claim names the pod's IPs");
    wait_records(&client, 2).await;
}

/// A claim witnessed with one family (its pod's IPv6 pool came later, or the controller saw
/// the pod's first ADD between its two families' writes) does not keep a recreated pod off the
/// other family: the ADD takes the claimed IPv4 back and allocates the IPv6 its pools now give.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sticky_pod_whose_claim_holds_one_family_gets_the_other_when_recreated() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let [v4, _] = pools(json!({}));
    let mut ipwarden = Ipwarden::start(1, &[v4], &[]).await;
    let client = ipwarden.client();
    ipwarden.start_controller("controller-0", &["--full-scan-interval-seconds=600"]);
    ipwarden.wait_leader(0).await;
    Api::<StatefulSet>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &statefulset("db"))
        .await
        .expect("create db");
    let before = support::wait_pods_with_ips(&client, NS, "app=db", 1).await.remove("db-0").expect("db-0");
    let uid = before.uid().unwrap_or_default();
    let witnessed = support::wait_witnessed(&client, NS, "db-0", &uid).await;
    assert_eq!(witnessed.len(), 1, "the claim is witnessed with IPv4 only: {witnessed:?}");
    e2e::ipwarden::create_pool(&client, V6, json!({"cidr": "fd00:70::/120", "default": true}))
        .await
        .expect("create pool v6");

    Api::<Pod>::namespaced(client.clone(), NS).delete("db-0", &DeleteParams::default()).await.expect("delete db-0");
    let after = wait_dual_stack(&client, "db-0", Some(&uid)).await;
    // The controller witnesses the new IPv6 beside the IPv4 (assert_dual_stack waits for that
    // witness before it reads the claim).
    let ips = assert_dual_stack(&ipwarden, &after).await;
    assert_eq!(ips[0], witnessed[0], "the recreated pod keeps its claimed IPv4");
    wait_records(&client, 2).await;
}

/// A witness the controller wrote between a first ADD's two families' writes (it writes the
/// other family about a second later) costs a pod recreated within that second its IPv6: the
/// ADD takes back what the controller saw, the IPv4, and allocates a fresh IPv6, whatever the
/// claim's spec names (decision 0022: the spec chooses no IP). Staged: the controller stops
/// once it witnessed both families, and the witness is written back to the IPv4 alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sticky_pod_recreated_after_a_partial_witness_keeps_the_witnessed_ipv4_and_gets_a_fresh_ipv6() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &pools(json!({"cidr": "fd00:70::/120", "default": true})), &[]).await;
    let client = ipwarden.client();
    let controller = ipwarden.start_controller("controller", &[]);
    ipwarden.wait_leader(controller).await;
    let (db0, before) = db_running_dual_stack(&ipwarden).await;
    ipwarden.controllers[controller].kill();
    let api: Api<IPClaim> = Api::namespaced(client.clone(), NS);
    let mut claim = api.get("db-0").await.expect("db-0's claim");
    assert_eq!(
        claim.spec.interfaces[0].ips.iter().map(|c| c.ip.clone()).collect::<Vec<_>>(),
        before,
        "the spec names both IPs"
    );
    let mut ipv4_only = claim.spec.interfaces.clone();
    ipv4_only[0].ips.retain(|c| !c.ip.contains(':'));
    claim.status = serde_json::from_value(json!({"witnessed": {"podUid": db0.uid(), "node": claim.spec.node,
        "owner": claim.spec.owner, "interfaces": ipv4_only, "at": "2026-01-01T00:00:00Z"}}))
    .expect("a status");
    api.replace_status("db-0", &PostParams::default(), &claim).await.expect("write the witness");

    Api::<Pod>::namespaced(client.clone(), NS).delete("db-0", &DeleteParams::default()).await.expect("delete db-0");
    let after = pod_ips(&wait_dual_stack(&client, "db-0", db0.uid().as_deref()).await);
    assert_eq!(after[0], before[0], "the witnessed IPv4 is kept");
    assert!(after[1].starts_with("fd00:70::") && after[1] != before[1], "a fresh IPv6: {after:?}, before {before:?}");
    let held = support::records(&client).await;
    let old = held.get(&before[1]).map(|r| r.pod.uid.clone());
    assert_eq!(old, db0.uid(), "the old IPv6 stays the old pod's reservation, for the GC to judge");
}

/// A StatefulSet pod with one fixed IPv4 in a dual-stack cluster runs with that IP alone (its
/// fixed IPs are all it gets), and a restart takes it back without touching the IPv6 pool:
/// no IPv6 allocated to be rolled back again, which would also cool that IP down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sticky_pod_with_one_fixed_ipv4_restarts_without_touching_the_ipv6_pool() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let ipwarden = Ipwarden::start(1, &pools(json!({"cidr": "fd00:70::/120", "default": true})), &[]).await;
    let client = ipwarden.client();
    let mut fixed = statefulset("db");
    let template = fixed.spec.template.metadata.as_mut().expect("template metadata");
    template.annotations = Some([("ipwarden.io/ips".to_string(), "10.70.0.50".to_string())].into());
    Api::<StatefulSet>::namespaced(client.clone(), NS).create(&PostParams::default(), &fixed).await.expect("create db");
    let before = support::wait_pods_with_ips(&client, NS, "app=db", 1).await.remove("db-0").expect("db-0");
    assert_eq!(pod_ips(&before), ["10.70.0.50"], "the fixed IPv4 alone");

    Api::<Pod>::namespaced(client.clone(), NS).delete("db-0", &DeleteParams::default()).await.expect("delete db-0");
    let after = support::wait_recreated(&client, NS, "app=db", &before).await;
    assert_eq!(pod_ips(&after), ["10.70.0.50"], "the fixed IPv4 alone, again");
    let agent = ipwarden.scrape_agent(0).await;
    assert_eq!(metric(&agent, r#"ipwarden_agent_releases_total{result="rolled_back"}"#), 0.0, "nothing rolled back");
    let v6 = pool_records(&client, V6).await.expect("records");
    assert!(v6.is_empty(), "no IPv6 record: {v6:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_ipv6_pool_fails_the_add_naming_it_and_kubelet_retries_leak_no_ipv4() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let one_ip =
        json!({"cidr": "fd00:70::/120", "ranges": [{"start": "fd00:70::10", "end": "fd00:70::10"}], "default": true});
    let mut ipwarden = Ipwarden::start(1, &pools(one_ip), &["--reuse-cooldown-seconds=0"]).await;
    let client = ipwarden.client();
    create_pod(&client, NS, "holder", "node-0", json!({"app": "holder"})).await;
    let holder = wait_dual_stack(&client, "holder", None).await;
    let held = assert_dual_stack(&ipwarden, &holder).await;

    // The CNI error the runtime sees: code 101, naming the pool.
    let (args, netconf) = unwired_pod(&ipwarden, "manual").await;
    let add = Invocation { command: "ADD", container_id: "dual", ifname: "eth0", pod: Some(&args), netconf: &netconf };
    let error = network().invoke(&add).await.expect_err("no IPv6 address is left").to_string();
    assert!(error.contains("code 101") && error.contains("pool v6 is exhausted"), "{error}");

    // A StatefulSet pod keeps failing the same way; every retry is a new sandbox.
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), NS);
    statefulsets.create(&PostParams::default(), &statefulset("db")).await.expect("create db");
    wait_adds(&ipwarden, "exhausted", 5.0).await;
    let v4 = pool_records(&client, V4).await.expect("records");
    assert_eq!(v4.keys().collect::<Vec<_>>(), [&held[0]], "retries left no IPv4 record or reservation: {v4:#?}");
    assert_eq!(pool_records(&client, V6).await.expect("records").len(), 1, "only the holder's IPv6 record");

    Api::<Pod>::namespaced(client.clone(), NS).delete("holder", &DeleteParams::default()).await.expect("delete");
    let db = wait_dual_stack(&client, "db-0", None).await;
    assert_eq!(pod_ips(&db)[1], held[1], "db-0 got the freed IPv6 address");
    wait_records(&client, 2).await;
    // From decision 0022 on, a controller writes db-0's claim once it runs; started only now,
    // after nothing was seen leaked, so that no GC sweep of its frees what the retries or the
    // holder's DEL should have.
    let controller = ipwarden.start_controller("controller", &[]);
    ipwarden.wait_leader(controller).await;
    assert_dual_stack(&ipwarden, &db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_add_whose_checkpoint_cannot_be_saved_undoes_its_block_records() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden =
        Ipwarden::start(1, &pools(json!({"cidr": "fd00:70::/120", "default": true})), &["--reuse-cooldown-seconds=0"])
            .await;
    let client = ipwarden.client();
    let controller = ipwarden.start_controller("controller", &[]);
    ipwarden.wait_leader(controller).await;
    // The node cannot save the checkpoint: a directory squats the name of its temp file, so
    // creating that file fails (EISDIR), which the agent running as root cannot override
    // (a read-only mode would not stop it).
    let squatter = ipwarden.cluster.nodes()[0].dir().join("checkpoint.tmp");
    std::fs::create_dir(&squatter).expect("squat the checkpoint's temp file");
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), NS);
    statefulsets.create(&PostParams::default(), &statefulset("db")).await.expect("create db");
    wait_adds(&ipwarden, "error", 5.0).await;
    let left = support::records(&client).await;
    assert!(left.is_empty(), "every failed ADD undid its block records, reservations included: {left:#?}");
    assert!(!claims(&client, NS).await.contains_key("db-0"), "no claim for a pod whose ADDs all failed");

    std::fs::remove_dir(&squatter).expect("free the checkpoint's temp file");
    let db = wait_dual_stack(&client, "db-0", None).await;
    assert_dual_stack(&ipwarden, &db).await;
    wait_records(&client, 2).await;
}
