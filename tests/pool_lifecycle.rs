//! Pools in use on the real control plane: a pool deleted while pods hold its IPs waits on
//! its finalizer and hands out nothing, a pool recreated over the blocks of a deleted one
//! never hands out an IP those blocks still record, and `spec.disabled` drains a pool.

mod support;

use std::collections::BTreeMap;

use e2e::cni::{Invocation, PodArgs};
use e2e::wait::{self, Probe};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::{Value, json};
use support::{Ipwarden, TIMEOUT, column, create_pod, ip_of, metric, metric_sum, records, wait_pods_with_ips};

use ipwarden::crd::IPPool;

const NS: &str = "default";

/// ADDs a sandbox for pod `name` (bound to a node no kubelet runs, created here) through the
/// real plugin and node-0's agent, as a runtime would; the CNI error when it fails.
async fn manual_add(ipwarden: &Ipwarden, name: &str) -> Result<Option<Value>, e2e::Error> {
    let client = ipwarden.client();
    create_pod(&client, NS, name, "elsewhere", json!({"app": "manual"})).await;
    let pod = Api::<Pod>::namespaced(client, NS).get(name).await.expect("pod");
    let args = PodArgs { namespace: NS.into(), name: name.into(), uid: pod.uid().unwrap_or_default() };
    let network = support::network();
    let socket = e2e::ipwarden::agent_socket(&ipwarden.cluster, 0);
    let conf = json!({"cniVersion": "1.1.0", "name": "ipwarden", "type": "ipwarden-cni", "socket": socket});
    let call = Invocation { command: "ADD", container_id: name, ifname: "eth0", pod: Some(&args), netconf: &conf };
    network.invoke(&call).await
}

/// `kubectl get ippools` as an operator sees it.
async fn kubectl_get_ippools(ipwarden: &Ipwarden) -> String {
    let args =
        vec![format!("--kubeconfig={}", ipwarden.cluster.kubeconfig().display()), "get".into(), "ippools".into()];
    e2e::process::run_tool(&ipwarden.cluster.kubectl(), &args, None).await.expect("kubectl get ippools")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_use_pool_being_deleted_waits_on_its_finalizer_refuses_adds_and_goes_once_the_dels_release_its_records() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pools = [("old", json!({"cidr": "10.70.0.0/24", "default": true}))];
    let mut ipwarden = Ipwarden::start(1, &pools, &["--reuse-cooldown-seconds=0"]).await;
    let client = ipwarden.client();
    // A long sweep interval: only the pods' DELs may release the records in time.
    ipwarden.start_controller("lifecycle", &["--full-scan-interval-seconds=600"]);
    ipwarden.wait_leader(0).await;

    // A sticky pod: its DEL would keep a reservation its StatefulSet still wants.
    support::create_statefulset(&client, NS, "db", json!({})).await;
    let held = ip_of(&wait_pods_with_ips(&client, NS, "app=db", 1).await["db-0"]);

    support::delete_pool_in_use(&client, "old").await;
    let pools_api: Api<IPPool> = Api::all(client.clone());
    let table = kubectl_get_ippools(&ipwarden).await;
    assert!(column(&table, "old", "DELETING").is_some_and(|c| c != "<none>"), "kubectl shows it deleting:\n{table}");

    let refused = manual_add(&ipwarden, "newcomer").await.expect_err("a deleting pool hands out nothing");
    let refused = refused.to_string();
    assert!(refused.contains("pool old") && refused.contains("being deleted"), "the ADD says why: {refused}");

    Api::<Pod>::namespaced(client.clone(), NS).delete("db-0", &DeleteParams::default()).await.expect("delete db-0");
    wait::until("the DEL releasing the record and the pool going", TIMEOUT, || async {
        let recorded = records(&client).await.contains_key(&held);
        let exists = pools_api.get_opt("old").await.map_err(e2e::Error::kube("reading pool old"))?.is_some();
        Ok(if !recorded && !exists {
            Probe::Done(())
        } else {
            Probe::Pending(format!("record of {held} {recorded}, pool exists {exists}"))
        })
    })
    .await
    .expect("the last record released, the pool deleted");
    let agent = ipwarden.scrape_agent(0).await;
    assert!(metric(&agent, r#"ipwarden_agent_releases_total{result="released"}"#) >= 1.0, "the DEL released it");
    let controller = ipwarden.scrape_controller(0).await.unwrap_or_default();
    assert_eq!(metric_sum(&controller, "ipwarden_gc_releases_total", &[]), 0.0, "no GC release was needed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_recreated_with_another_block_size_over_orphaned_blocks_hands_out_no_ip_they_still_record() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    // No controller yet: the pool has no finalizer (created before any controller ran), so its
    // deletion leaves its blocks, and their live records, orphaned. The controller starts with
    // the recreated pool: it writes the pool's conditions.
    let pools = [("p", json!({"cidr": "10.71.0.0/28", "default": true}))];
    let mut ipwarden = Ipwarden::start(1, &pools, &["--reuse-cooldown-seconds=0"]).await;
    let client = ipwarden.client();
    for i in 0..4 {
        create_pod(&client, NS, &format!("old-{i}"), "node-0", json!({"app": "old"})).await;
    }
    let old = wait_pods_with_ips(&client, NS, "app=old", 4).await;
    let pools_api: Api<IPPool> = Api::all(client.clone());
    pools_api.delete("p", &DeleteParams::default()).await.expect("delete pool p");
    wait::until("pool p gone", TIMEOUT, || async {
        let exists = pools_api.get_opt("p").await.map_err(e2e::Error::kube("reading pool p"))?.is_some();
        Ok(if exists { Probe::Pending("still there".into()) } else { Probe::Done(()) })
    })
    .await
    .expect("the pool goes");
    e2e::ipwarden::create_pool(&client, "p", json!({"cidr": "10.71.0.0/28", "blockSize": 30, "default": true}))
        .await
        .expect("recreate pool p");
    ipwarden.start_controller("orphans", &["--full-scan-interval-seconds=2"]);

    for i in 0..4 {
        create_pod(&client, NS, &format!("new-{i}"), "node-0", json!({"app": "new"})).await;
    }
    let overlapping = |pool: IPPool| {
        pool.status
            .and_then(|s| s.conditions.into_iter().find(|c| c.type_ == "Overlapping"))
            .map(|c| (c.status, c.message))
    };
    let outcome = wait::until("the new pods served, or the orphaned block reported", TIMEOUT, || async {
        let served = support::pods_with_ips(&client, NS, "app=new").await?;
        let condition = overlapping(pools_api.get("p").await.map_err(e2e::Error::kube("reading pool p"))?);
        let refused = metric(&ipwarden.scrape_agent(0).await, r#"ipwarden_agent_allocations_total{result="no_pool"}"#);
        Ok(match condition {
            Some((status, message)) if status == "True" && refused >= 4.0 => Probe::Done(Ok(message)),
            _ if served.len() == 4 => Probe::Done(Err(served)),
            other => Probe::Pending(format!("{} served, condition {other:?}, {refused} refused", served.len())),
        })
    })
    .await
    .expect("the ADDs are answered");
    let old_ips: BTreeMap<String, String> = old.iter().map(|(name, pod)| (ip_of(pod), name.clone())).collect();
    let message = outcome.unwrap_or_else(|served| {
        let duplicates: Vec<String> = served
            .iter()
            .filter_map(|(name, pod)| {
                old_ips.get(&ip_of(pod)).map(|holder| format!("{name} got {holder}'s {}", ip_of(pod)))
            })
            .collect();
        panic!("the recreated pool handed out IPs the orphaned block still records: {duplicates:?}")
    });
    assert!(message.contains("orphaned IPBlock p-10-71-0-0-28"), "the condition names the orphaned block: {message}");

    // As the old pods go, their DELs release the orphaned records and the pool serves.
    for i in 0..4 {
        Api::<Pod>::namespaced(client.clone(), NS)
            .delete(&format!("old-{i}"), &DeleteParams::default())
            .await
            .expect("delete old pod");
    }
    let new = wait_pods_with_ips(&client, NS, "app=new", 4).await;
    let mut ips: Vec<String> = new.values().map(ip_of).collect();
    ips.sort();
    ips.dedup();
    assert_eq!(ips.len(), 4, "every new pod has its own IP");

    // A controller reclaims what an orphaned block records for a pod that is gone, by the
    // normal sweep rules, and deletes the orphaned blocks once empty: a sticky record there
    // goes with its pod even while its StatefulSet still wants the ordinal (no pool will hand
    // the IP out again). StatefulSet `held` wants `held-0` but cannot create it (its service
    // account does not exist), so the pod stays gone.
    support::create_statefulset(&client, NS, "held", json!({"serviceAccountName": "absent"})).await;
    let ghost = support::record_json(NS, "ghost", "ghost-uid", "node-0", Some(("StatefulSet", "gone")), true);
    support::inject_record(&client, "vanished", "vanished-10-79-0-0-24", "10.79.0.0/24", "10.79.0.7", ghost).await;
    let wanted = support::record_json(NS, "held-0", "held-uid", "node-0", Some(("StatefulSet", "held")), true);
    support::inject_record(&client, "vanished", "vanished-10-79-0-0-24", "10.79.0.0/24", "10.79.0.8", wanted).await;
    let blocks: Api<ipwarden::crd::IPBlock> = Api::all(client.clone());
    wait::until("the orphaned records reclaimed and the empty orphaned blocks deleted", TIMEOUT, || async {
        let names: Vec<String> = blocks
            .list(&Default::default())
            .await
            .map_err(e2e::Error::kube("listing blocks"))?
            .items
            .iter()
            .map(ResourceExt::name_any)
            .collect();
        let orphans: Vec<&String> =
            names.iter().filter(|n| *n == "p-10-71-0-0-28" || *n == "vanished-10-79-0-0-24").collect();
        Ok(if orphans.is_empty() { Probe::Done(()) } else { Probe::Pending(format!("left: {orphans:?}")) })
    })
    .await
    .expect("the orphans are cleaned up");
    assert_eq!(records(&client).await.len(), 4, "only the new pods' records are left");
    let held_0 = Api::<Pod>::namespaced(client.clone(), NS).get_opt("held-0").await.expect("read held-0");
    assert!(held_0.is_none(), "held-0 never existed, so its record was a reservation of a wanted ordinal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disabled_pool_hands_out_no_new_ip_keeps_the_existing_ones_and_shows_it_in_kubectl_get() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pools = [("main", json!({"cidr": "10.73.0.0/24", "default": true}))];
    let ipwarden = Ipwarden::start(1, &pools, &[]).await;
    let client = ipwarden.client();
    create_pod(&client, NS, "kept", "node-0", json!({"app": "kept"})).await;
    let kept = ip_of(&wait_pods_with_ips(&client, NS, "app=kept", 1).await["kept"]);

    let pools_api: Api<IPPool> = Api::all(client.clone());
    let disable = |disabled: bool| json!({"spec": {"disabled": disabled}});
    pools_api.patch("main", &PatchParams::default(), &Patch::Merge(disable(true))).await.expect("disable");
    let table = kubectl_get_ippools(&ipwarden).await;
    assert_eq!(column(&table, "main", "DISABLED").as_deref(), Some("true"), "kubectl shows it disabled:\n{table}");

    let refused = manual_add(&ipwarden, "newcomer").await.expect_err("a disabled pool hands out nothing");
    let refused = refused.to_string();
    assert!(refused.contains("pool main") && refused.contains("disabled"), "the ADD says why: {refused}");
    create_pod(&client, NS, "waiting", "node-0", json!({"app": "waiting"})).await;
    wait::until("the agent refusing the waiting pod's ADD", TIMEOUT, || async {
        let refused = metric(&ipwarden.scrape_agent(0).await, r#"ipwarden_agent_allocations_total{result="no_pool"}"#);
        Ok(if refused >= 2.0 { Probe::Done(()) } else { Probe::Pending(format!("{refused} refused")) })
    })
    .await
    .expect("the ADD is refused");
    let held = records(&client).await;
    assert_eq!(held.len(), 1, "nothing new was allocated: {held:?}");
    assert!(held.contains_key(&kept), "the existing IP is kept");

    pools_api.patch("main", &PatchParams::default(), &Patch::Merge(disable(false))).await.expect("enable");
    let served = wait_pods_with_ips(&client, NS, "app=waiting", 1).await;
    assert_ne!(ip_of(&served["waiting"]), kept, "the re-enabled pool serves the waiting pod");
}

/// A disabled pool still gives a sticky pod its reserved IP back, in a single-stack cluster
/// where no pool of the other family exists (the recreated pod asks the pools for that one
/// too, and none fitting is no reason to refuse it the IP it ran with).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disabled_pool_still_gives_a_recreated_statefulset_pod_its_reserved_ip() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pools = [("main", json!({"cidr": "10.73.0.0/24", "default": true}))];
    let mut ipwarden = Ipwarden::start(1, &pools, &[]).await;
    let client = ipwarden.client();
    // The recreated pod takes back the IP the controller witnessed its claim holding (decision
    // 0022). The controller does not read `spec.disabled`, which only stops ADDs' new IPs.
    let controller = ipwarden.start_controller("controller", &[]);
    ipwarden.wait_leader(controller).await;
    support::create_statefulset(&client, NS, "db", json!({})).await;
    let before = wait_pods_with_ips(&client, NS, "app=db", 1).await.remove("db-0").expect("db-0");
    support::wait_witnessed(&client, NS, "db-0", &before.uid().unwrap_or_default()).await;
    let disable = json!({"spec": {"disabled": true}});
    Api::<IPPool>::all(client.clone())
        .patch("main", &PatchParams::default(), &Patch::Merge(disable))
        .await
        .expect("disable");

    Api::<Pod>::namespaced(client.clone(), NS).delete("db-0", &DeleteParams::default()).await.expect("delete db-0");
    let after = support::wait_recreated(&client, NS, "app=db", &before).await;
    assert_eq!(ip_of(&after), ip_of(&before), "db-0 keeps its IP");
    assert_eq!(records(&client).await.len(), 1, "nothing else is held");
}

/// Ranges, exclusions and the gateway only say which IPs of a block are handed out; the
/// blocks a pool owns follow from its CIDR and block size alone (both immutable). A range
/// edited into an invalid layout (the apiserver accepts a reversed one) must not disown the
/// pool's blocks, which would make their sticky records ordinary ones and free a StatefulSet
/// pod's reserved IP at its DEL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_whose_ranges_are_edited_into_an_invalid_layout_keeps_its_blocks_and_their_reservations() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pools = [("grid", json!({"cidr": "10.73.0.0/24", "default": true}))];
    let mut ipwarden = Ipwarden::start(1, &pools, &["--reuse-cooldown-seconds=0"]).await;
    let client = ipwarden.client();
    let controller = ipwarden.start_controller("grid", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(controller).await;
    support::create_statefulset(&client, NS, "db", json!({})).await;
    let held = ip_of(&wait_pods_with_ips(&client, NS, "app=db", 1).await["db-0"]);

    let reversed = json!({"spec": {"ranges": [{"start": "10.73.0.200", "end": "10.73.0.100"}]}});
    Api::<IPPool>::all(client.clone())
        .patch("grid", &PatchParams::default(), &Patch::Merge(&reversed))
        .await
        .expect("the apiserver accepts a reversed range");
    let refused = manual_add(&ipwarden, "probe").await.expect_err("the agent refuses the invalid layout");
    assert!(refused.to_string().contains("10.73.0.200"), "the ADD names the range: {refused}");

    // db-0 is deleted; its DEL keeps the reservation its StatefulSet still wants, and no sweep
    // or orphan clean-up takes it.
    Api::<Pod>::namespaced(client.clone(), NS).delete("db-0", &DeleteParams::default()).await.expect("delete db-0");
    ipwarden.wait_sweeps(controller, 3).await;
    let record = records(&client).await.remove(&held);
    assert_eq!(
        record.map(|r| (r.pod.name, r.sticky)),
        Some(("db-0".to_string(), true)),
        "db-0's reserved IP {held} stays its own"
    );
    let controller_metrics = ipwarden.scrape_controller(controller).await.unwrap_or_default();
    assert_eq!(metric(&controller_metrics, "ipwarden_orphaned_block_records"), 0.0, "no block is orphaned");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sticky_record_in_an_orphaned_block_goes_with_its_pod_at_the_pods_deadline_not_at_the_next_sweep() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pools = [("p", json!({"cidr": "10.72.0.0/24", "default": true}))];
    let mut ipwarden = Ipwarden::start(1, &pools, &[]).await;
    let client = ipwarden.client();
    // StatefulSet `held` wants ordinal 0 (it cannot create the pod: its service account does
    // not exist). Pod `held-0` is a bare stand-in no kubelet runs (its node does not exist);
    // its sticky record sits in a block whose pool is gone, so no pool keeps the reservation.
    support::create_statefulset(&client, NS, "held", json!({"serviceAccountName": "absent"})).await;
    create_pod(&client, NS, "held-0", "nowhere", json!({"app": "stand-in"})).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let uid = pods.get("held-0").await.expect("read held-0").uid().expect("uid");
    let record = support::record_json(NS, "held-0", &uid, "node-0", Some(("StatefulSet", "held")), true);
    support::inject_record(&client, "vanished", "vanished-10-80-0-0-24", "10.80.0.0/24", "10.80.0.9", record).await;
    // A sweep every 10 minutes: within this test only the pod's trace may release the record.
    let controller = ipwarden.start_controller("tracer", &["--full-scan-interval-seconds=600"]);
    ipwarden.wait_leader(controller).await;
    wait::until("the leader's first sweep", TIMEOUT, || async {
        let text = ipwarden.scrape_controller(controller).await.unwrap_or_default();
        let swept = metric_sum(&text, "ipwarden_gc_sweep_duration_seconds_count", &[]);
        Ok(if swept >= 1.0 { Probe::Done(()) } else { Probe::Pending("no sweep yet".into()) })
    })
    .await
    .expect("the new leader sweeps at once");
    assert!(records(&client).await.contains_key("10.80.0.9"), "the pod is live: the sweep keeps its record");

    pods.delete("held-0", &DeleteParams::default().grace_period(0)).await.expect("delete held-0");
    wait::until("the record released at the pod's deadline", std::time::Duration::from_secs(60), || async {
        let left = records(&client).await.contains_key("10.80.0.9");
        Ok(if left { Probe::Pending("still recorded".into()) } else { Probe::Done(()) })
    })
    .await
    .expect("the tracer releases a sticky record of a retired block with its pod");
}

/// Decision 0019 keeps a pool's defaulted gateway (no `spec.gateway`: the CIDR's first address)
/// from every pod, also where the admin's `ranges` name it: such a pool, sized to its workload
/// before the upgrade that brought 0019, holds one IP fewer after it. That must not go unseen:
/// the pool says so in its `GatewayInRanges` condition, `ipwarden check` reports it, and an ADD
/// that finds the pool full names the gateway. Setting `spec.gateway` says the admin knows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_whose_ranges_name_its_defaulted_gateway_says_so_in_its_condition_check_and_a_refused_add() {
    let pool = json!({"cidr": "10.86.0.0/29", "default": true, "ranges": [{"start": "10.86.0.1", "end": "10.86.0.2"}]});
    let mut ipwarden = Ipwarden::start(1, &[("sized", pool)], &[]).await;
    ipwarden.start_controller("conditions", &[]);
    let client = ipwarden.client();
    create_pod(&client, NS, "only", "node-0", json!({"app": "only"})).await;
    let only = wait_pods_with_ips(&client, NS, "app=only", 1).await;
    assert_eq!(only.values().map(ip_of).collect::<Vec<_>>(), ["10.86.0.2"], "the gateway is never handed out");

    let refused = manual_add(&ipwarden, "second").await.expect_err("the pool's one IP is taken");
    let refused = refused.to_string();
    assert!(refused.contains("exhausted") && refused.contains("10.86.0.1"), "the ADD names the gateway: {refused}");
    assert!(refused.contains("spec.gateway"), "and says why it is one: {refused}");

    let pools: Api<IPPool> = Api::all(client.clone());
    let condition = |pool: IPPool| {
        pool.status
            .and_then(|s| s.conditions.into_iter().find(|c| c.type_ == "GatewayInRanges"))
            .map(|c| (c.status, c.message))
    };
    let message = wait::until("the pool's GatewayInRanges condition", TIMEOUT, || async {
        Ok(match condition(pools.get("sized").await.map_err(e2e::Error::kube("reading pool sized"))?) {
            Some((status, message)) if status == "True" => Probe::Done(message),
            other => Probe::Pending(format!("{other:?}")),
        })
    })
    .await
    .expect("the condition says so");
    assert!(message.contains("10.86.0.1"), "{message}");
    let flagged = |problems: &[ipwarden::gc::check::Problem]| {
        problems.iter().any(|p| p.subject == "sized" && p.detail.contains("10.86.0.1"))
    };
    let problems = ipwarden::cli::check::problems(&client).await.expect("check reads the cluster");
    assert!(flagged(&problems), "ipwarden check reports the pool: {problems:?}");

    let knowingly = json!({"spec": {"gateway": "10.86.0.1"}});
    pools.patch("sized", &PatchParams::default(), &Patch::Merge(&knowingly)).await.expect("set spec.gateway");
    wait::until("the condition clearing once spec.gateway is set", TIMEOUT, || async {
        Ok(match condition(pools.get("sized").await.map_err(e2e::Error::kube("reading pool sized"))?) {
            Some((status, _)) if status == "False" => Probe::Done(()),
            other => Probe::Pending(format!("{other:?}")),
        })
    })
    .await
    .expect("the condition clears");
    let problems = ipwarden::cli::check::problems(&client).await.expect("check reads the cluster");
    assert!(!flagged(&problems), "nothing to report once the gateway is set: {problems:?}");
}
