//! The GC controller end to end on the real control plane: every class of rule row, the
//! manual trigger through the CLI, leader failover with a standby that never writes, and a
//! controller killed in the middle of a sweep.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use e2e::wait::{self, Probe};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::{
    Ipwarden, TIMEOUT, claims, create_pod, create_statefulset, inject_claim, inject_legacy_claim, inject_record, ip_of,
    metric_sum, pod_template, record_json, records, wait_pods_with_ips, wait_record_gone,
};

const NS: &str = "default";
const POOL: &str = "pool";
const BLOCK: &str = "pool-10-70-0-0-24";
const CIDR: &str = "10.70.0.0/24";

fn pool() -> [(&'static str, serde_json::Value); 1] {
    [(POOL, json!({"cidr": CIDR, "default": true}))]
}

/// Writes a leaked record for `ip` into the test pool's block.
async fn leak(client: &kube::Client, ip: &str, record: serde_json::Value) {
    inject_record(client, POOL, BLOCK, CIDR, ip, record).await;
}

fn workload(kind: &str, name: &str, spec: serde_json::Value) -> serde_json::Value {
    json!({"metadata": {"name": name}, "spec": spec, "kind": kind})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_class_of_rule_row_is_enforced_end_to_end_and_live_records_are_never_touched() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    // Node-1 skips DEL: its agent still holds those sandboxes, so it answers the release
    // handshake only once their grace has run out.
    let mut ipwarden = Ipwarden::start(2, &pool(), &["--release-sandbox-grace-seconds=2"]).await;
    let client = ipwarden.client();
    let controller =
        ipwarden.start_controller("solo", &["--full-scan-interval-seconds=3", "--claim-janitor-interval-seconds=1"]);
    ipwarden.wait_leader(controller).await;

    // Live workloads that must come through untouched.
    for i in 0..4 {
        create_pod(&client, NS, &format!("live-{i}"), &format!("node-{}", i % 2), json!({"app": "live"})).await;
    }
    let live = wait_pods_with_ips(&client, NS, "app=live", 4).await;
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), NS);
    let sts = |name: &str, replicas: i32, extra: serde_json::Value| -> StatefulSet {
        serde_json::from_value(workload(
            "StatefulSet",
            name,
            json!({"replicas": replicas, "serviceName": name,
            "selector": {"matchLabels": {"app": name}}, "template": pod_template(name, extra)}),
        ))
        .expect("sts")
    };
    statefulsets.create(&PostParams::default(), &sts("db", 1, json!({}))).await.expect("db");
    // A StatefulSet whose pod cannot be created (missing ServiceAccount): its ordinal 0 is
    // wanted but absent. One whose pod stays Pending (no node matches): restarting.
    statefulsets
        .create(&PostParams::default(), &sts("blocked", 1, json!({"serviceAccountName": "missing"})))
        .await
        .expect("blocked");
    statefulsets
        .create(&PostParams::default(), &sts("pending", 1, json!({"nodeSelector": {"nowhere": "true"}})))
        .await
        .expect("pending");
    let db = wait_pods_with_ips(&client, NS, "app=db", 1).await;

    // Row "uid == r.uid, Succeeded": a Job pod completes on a node that skips DEL.
    ipwarden.cluster.nodes()[1].faults().set_skip_del(true);
    let job: Job = serde_json::from_value(workload("Job", "batch", json!({"backoffLimit": 0, "template": {
        "metadata": {"labels": {"app": "batch"}, "annotations": {e2e::kubelet::RUN_SECONDS_ANNOTATION: "1"}},
        "spec": {"restartPolicy": "Never", "nodeName": "node-1", "containers": [{"name": "c", "image": "registry.invalid/c:1"}]}}})))
    .expect("job");
    Api::<Job>::namespaced(client.clone(), NS).create(&PostParams::default(), &job).await.expect("job");
    let job_pod = wait::until("the Job pod's IP", TIMEOUT, || async {
        let pods = Api::<Pod>::namespaced(client.clone(), NS)
            .list(&ListParams::default().labels("app=batch"))
            .await
            .map_err(e2e::Error::kube("list"))?;
        Ok(match pods.items.into_iter().find(|p| !ip_of(p).is_empty()) {
            Some(pod) => Probe::Done(pod),
            None => Probe::Pending("no IP yet".into()),
        })
    })
    .await
    .expect("job pod runs");
    let job_ip = ip_of(&job_pod);
    // The claim a version before decision 0015 wrote for it: the janitor's to delete.
    let job_uid = job_pod.uid().unwrap_or_default();
    inject_legacy_claim(&client, NS, &job_pod.name_any(), &job_uid, &job_ip).await;

    // Row "pod absent" via a force delete whose DEL is skipped: traced, released at deadline.
    create_pod(&client, NS, "forced", "node-1", json!({"app": "forced"})).await;
    let forced = wait_pods_with_ips(&client, NS, "app=forced", 1).await;
    let forced_ip = ip_of(&forced["forced"]);
    let force = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    Api::<Pod>::namespaced(client.clone(), NS).delete("forced", &force).await.expect("force delete");

    // Row "terminating past its deadline": a finalizer keeps the pod Terminating after the
    // kubelet (which skips DEL on node-1) let it go.
    let held_pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "held", "labels": {"app": "held"}, "finalizers": ["e2e.ipwarden.io/hold"]},
        "spec": {"nodeName": "node-1", "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "c", "image": "registry.invalid/c:1"}]},
    }))
    .expect("pod");
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods_api.create(&PostParams::default(), &held_pod).await.expect("held pod");
    let held_ip = ip_of(&wait_pods_with_ips(&client, NS, "app=held", 1).await["held"]);
    pods_api.delete("held", &DeleteParams::default()).await.expect("delete held");

    // Rows 9 and 10: sticky records of a pod of the same name with another UID and IPs.
    // A hostNetwork pod reports IPs without ipwarden (no claim): re-added without ipwarden.
    let outsider: Pod = serde_json::from_value(json!({
        "metadata": {"name": "outsider", "labels": {"app": "outsider"}},
        "spec": {"nodeName": "node-0", "hostNetwork": true, "containers": [{"name": "c", "image": "registry.invalid/c:1"}]},
    }))
    .expect("pod");
    pods_api.create(&PostParams::default(), &outsider).await.expect("outsider");
    wait_pods_with_ips(&client, NS, "app=outsider", 1).await;
    leak(
        &client,
        "10.70.0.207",
        record_json(NS, "outsider", "outsider-old", "node-0", Some(("StatefulSet", "outsider")), true),
    )
    .await;
    // db-0 runs with its own claim and IP: an old sticky record of it elsewhere is stale. Until
    // the claim is bound to db-0 the row would be "re-added without ipwarden", and from decision
    // 0022 on the controller, not the ADD, writes it: the leak comes once it witnessed the claim.
    support::wait_witnessed(&client, NS, "db-0", &db["db-0"].uid().unwrap_or_default()).await;
    leak(&client, "10.70.0.208", record_json(NS, "db-0", "db0-old", "node-0", Some(("StatefulSet", "db")), true)).await;

    // Injected leaks, one per row.
    let live_uid = live["live-0"].uid().unwrap_or_default();
    leak(&client, "10.70.0.201", record_json(NS, "ghost", "ghost-uid", "node-0", None, false)).await;
    leak(&client, "10.70.0.202", record_json(NS, "live-1", "stale-uid", "node-0", None, false)).await;
    leak(&client, "10.70.0.203", record_json(NS, "lost", "lost-uid", "node-gone", None, false)).await;
    let sts_owner = |name| Some(("StatefulSet", name));
    leak(&client, "10.70.0.204", record_json(NS, "db-3", "db3-uid", "node-0", sts_owner("db"), true)).await;
    leak(&client, "10.70.0.205", record_json(NS, "blocked-0", "b-uid", "node-0", sts_owner("blocked"), true)).await;
    leak(&client, "10.70.0.206", record_json(NS, "pending-0", "p-uid", "node-0", sts_owner("pending"), true)).await;
    // Row "IP in a live pod's podIPs, record names another UID": repaired, never released.
    let live0_ip = ip_of(&live["live-0"]);
    leak(&client, &live0_ip, record_json(NS, "impostor", "impostor-uid", "node-0", None, false)).await;

    wait_record_gone(&client, "10.70.0.201", TIMEOUT, "pod_gone: a record naming a pod that never existed").await;
    wait_record_gone(&client, "10.70.0.202", TIMEOUT, "uid_mismatch: a stateless record naming an old UID").await;
    wait_record_gone(&client, "10.70.0.203", TIMEOUT, "node_deleted: a record on a node that is gone").await;
    wait_record_gone(&client, "10.70.0.204", TIMEOUT, "a sticky record of an ordinal the StatefulSet no longer wants")
        .await;
    wait_record_gone(&client, &job_ip, TIMEOUT, "completed: a finished Job pod whose DEL was missed").await;
    wait_record_gone(&client, &forced_ip, TIMEOUT, "a force-deleted pod whose DEL was missed").await;
    wait_record_gone(&client, &held_ip, TIMEOUT, "terminating_past_deadline: a pod stuck Terminating").await;
    wait_record_gone(&client, "10.70.0.207", TIMEOUT, "sticky_readded_without_ipwarden").await;
    wait_record_gone(&client, "10.70.0.208", TIMEOUT, "sticky_stale_record").await;
    wait::until("the impostor record repaired to the pod reporting the IP", TIMEOUT, || async {
        let uid = records(&client).await.get(&live0_ip).map(|r| r.pod.uid.clone());
        Ok(if uid.as_deref() == Some(live_uid.as_str()) { Probe::Done(()) } else { Probe::Pending(format!("{uid:?}")) })
    })
    .await
    .expect("repair");

    // After more sweeps, what must stay has stayed.
    ipwarden.wait_sweeps(controller, 2).await;
    let held = records(&client).await;
    assert!(held.contains_key("10.70.0.205"), "absent pod, sticky, owner wants ordinal: reservation kept");
    assert!(held.contains_key("10.70.0.206"), "recreated sticky pod with empty podIPs: kept while it restarts");
    for pod in live.values().chain(db.values()) {
        let ip = ip_of(pod);
        assert_eq!(held.get(&ip).map(|r| r.pod.uid.clone()), pod.uid(), "{}'s record is untouched", pod.name_any());
    }

    let text = ipwarden.scrape_controller(controller).await.unwrap_or_default();
    let reasons = [
        ("pod_gone", None),
        ("uid_mismatch", None),
        ("node_deleted", None),
        ("completed", None),
        ("terminating_past_deadline", Some("handshake")),
        ("sticky_readded_without_ipwarden", None),
        ("sticky_stale_record", None),
    ];
    for (reason, trigger) in reasons {
        let mut labels = vec![format!("reason=\"{reason}\"")];
        labels.extend(trigger.map(|t: &str| format!("trigger=\"{t}\"")));
        let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
        assert!(metric_sum(&text, "ipwarden_gc_releases_total", &labels) >= 1.0, "a release counted under {reason}");
    }
    assert!(metric_sum(&text, "ipwarden_gc_repairs_total", &[]) >= 1.0, "the repair is counted");
    assert_eq!(
        metric_sum(&text, "ipwarden_gc_releases_total", &["reason=\"node_deleted\"", "trigger=\"handshake\""]),
        0.0,
        "a record on a deleted node has no agent to ask"
    );
    let answers = ipwarden.scrape_agent(1).await;
    assert!(
        metric_sum(&answers, "ipwarden_agent_release_handshake_answers_total", &["answer=\"ready_for_release\""])
            >= 3.0,
        "node-1's agent answered the marks of the Job pod, the forced pod and the held pod"
    );
    wait::until("the pool's status counts matching its records", TIMEOUT, || async {
        let pool =
            Api::<ipwarden::crd::IPPool>::all(client.clone()).get(POOL).await.map_err(e2e::Error::kube("get pool"))?;
        let status = pool.status.unwrap_or_default();
        let held = records(&client).await;
        let sticky = held.values().filter(|r| r.sticky).count();
        // 254 addresses but the gateway (10.70.0.1, defaulted).
        let expected = (253, held.len() as i64, sticky as i64);
        let shown = (status.total, status.allocated, status.sticky_reserved);
        Ok(if shown == expected { Probe::Done(()) } else { Probe::Pending(format!("{shown:?}, want {expected:?}")) })
    })
    .await
    .expect("kubectl get ippools shows true counts");
    let mut unhold = pods_api.get("held").await.expect("held pod");
    unhold.metadata.finalizers = None;
    pods_api.replace("held", &PostParams::default(), &unhold).await.expect("release the finalizer");
    wait::until("the completed Job pod's legacy claim deleted", TIMEOUT, || async {
        let names: BTreeSet<String> = claims(&client, NS).await.into_keys().collect();
        let job_claims: BTreeSet<&String> = names.iter().filter(|k| k.starts_with("batch-")).collect();
        Ok(if job_claims.is_empty() { Probe::Done(()) } else { Probe::Pending(format!("{job_claims:?}")) })
    })
    .await
    .expect("the janitor deletes a completed Job pod's claim");
}

fn ipwarden_cli(ipwarden: &Ipwarden, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_ipwarden"))
        .args(args)
        .env("KUBECONFIG", ipwarden.cluster.kubeconfig())
        .output()
        .expect("ipwarden runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipwarden_gc_asks_the_leader_for_a_sweep_and_prints_its_result_and_dry_run_changes_nothing() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &pool(), &[]).await;
    let client = ipwarden.client();
    // No timer sweep during the test: only the manual one can release the leak.
    let controller = ipwarden.start_controller("manual", &["--full-scan-interval-seconds=3600"]);
    ipwarden.wait_leader(controller).await;
    wait::until("the leadership sweep", TIMEOUT, || async {
        let text = ipwarden.scrape_controller(controller).await.unwrap_or_default();
        let sweeps = metric_sum(&text, "ipwarden_gc_sweep_duration_seconds_count", &[]);
        Ok(if sweeps >= 1.0 { Probe::Done(()) } else { Probe::Pending("no sweep yet".into()) })
    })
    .await
    .expect("first sweep");
    leak(&client, "10.70.0.210", record_json(NS, "ghost", "ghost-uid", "node-0", None, false)).await;

    let dry = ipwarden_cli(&ipwarden, &["gc", "--dry-run", "-o", "json"]);
    assert!(dry.status.success(), "dry run: {}", String::from_utf8_lossy(&dry.stderr));
    let plan: serde_json::Value = serde_json::from_slice(&dry.stdout).expect("dry-run JSON");
    assert_eq!(plan["changes"][0]["ip"], "10.70.0.210");
    assert_eq!(plan["changes"][0]["rule"], "pod_gone");
    assert_eq!(plan["changes"][0]["action"], "release (handshake)", "node-0's agent will be asked first");
    assert!(records(&client).await.contains_key("10.70.0.210"), "a dry run changes nothing");

    let run = ipwarden_cli(&ipwarden, &["gc", "-o", "json"]);
    assert!(run.status.success(), "gc: {}", String::from_utf8_lossy(&run.stderr));
    let report: serde_json::Value = serde_json::from_slice(&run.stdout).expect("report JSON");
    assert_eq!(report["marked"], 1, "node-0 has an agent: the leak is marked for release first; {report}");
    assert!(report["scanned"].as_u64().is_some_and(|n| n >= 1));
    wait_record_gone(&client, "10.70.0.210", TIMEOUT, "the leak released once node-0's agent answered").await;
    let text = ipwarden.scrape_controller(controller).await.unwrap_or_default();
    assert_eq!(metric_sum(&text, "ipwarden_gc_release_handshakes_total", &["step=\"marked\""]), 1.0);
    assert_eq!(metric_sum(&text, "ipwarden_gc_releases_total", &["trigger=\"handshake\""]), 1.0);

    let table = ipwarden_cli(&ipwarden, &["gc"]);
    assert!(String::from_utf8_lossy(&table.stdout).contains("marked for release"), "a table for people");
}

/// Field managers that wrote each IPBlock.
async fn block_writers(client: &kube::Client) -> BTreeSet<String> {
    Api::<ipwarden::crd::IPBlock>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("blocks")
        .items
        .iter()
        .flat_map(|b| b.metadata.managed_fields.iter().flatten().filter_map(|f| f.manager.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_within_the_lease_and_never_writes_while_standing_by() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &pool(), &[]).await;
    let client = ipwarden.client();
    let first = ipwarden.start_controller("first", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(first).await;
    let second = ipwarden.start_controller("second", &["--full-scan-interval-seconds=2"]);
    leak(&client, "10.70.0.220", record_json(NS, "ghost-a", "a-uid", "node-0", None, false)).await;
    wait_record_gone(&client, "10.70.0.220", TIMEOUT, "the leader releasing the first leak").await;
    let standby = ipwarden.scrape_controller(second).await.unwrap_or_default();
    assert_eq!(metric_sum(&standby, "ipwarden_controller_leader", &[]), 0.0, "the second replica stands by");
    assert!(!block_writers(&client).await.contains("ipwarden-controller-second"), "a standby never writes");
    let ready = ipwarden.scrape_controller(second).await.is_some();
    assert!(ready, "the standby serves metrics (warm caches)");

    ipwarden.controllers[first].kill();
    let killed = std::time::Instant::now();
    ipwarden.wait_leader(second).await;
    // The lease (4 s) must expire before the standby may take it; the rest is the standby's
    // renew period (1 s) and slack for a loaded machine.
    assert!(killed.elapsed() < std::time::Duration::from_secs(15), "took over in {:?}", killed.elapsed());
    leak(&client, "10.70.0.221", record_json(NS, "ghost-b", "b-uid", "node-0", None, false)).await;
    wait_record_gone(&client, "10.70.0.221", TIMEOUT, "the new leader releasing the second leak").await;
    let text = ipwarden.scrape_controller(second).await.unwrap_or_default();
    assert_eq!(
        metric_sum(&text, "ipwarden_gc_releases_total", &[]),
        1.0,
        "the new leader released only the second leak"
    );
    assert!(block_writers(&client).await.contains("ipwarden-controller-second"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_killed_in_the_middle_of_a_sweep_loses_nothing() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &pool(), &[]).await;
    let client = ipwarden.client();
    for i in 0..3 {
        create_pod(&client, NS, &format!("keep-{i}"), "node-0", json!({"app": "keep"})).await;
    }
    let live = wait_pods_with_ips(&client, NS, "app=keep", 3).await;
    for i in 0..120u32 {
        let ip = format!("10.70.0.{}", 100 + i);
        leak(&client, &ip, record_json(NS, &format!("ghost-{i}"), &format!("g{i}"), "node-0", None, false)).await;
    }
    let controller = ipwarden.start_controller("crashy", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(controller).await;
    ipwarden.controllers[controller].kill();
    let after_kill = records(&client).await.len();
    ipwarden.controllers[controller].restart().expect("restart");
    wait::until("every injected leak reclaimed after the restart", TIMEOUT, || async {
        let n = records(&client).await.len();
        Ok(if n == 3 { Probe::Done(()) } else { Probe::Pending(format!("{n} records (3 live)")) })
    })
    .await
    .expect("nothing lost");
    assert!(after_kill > 3, "the kill came before the sweep finished ({after_kill} records left then)");
    let held = records(&client).await;
    for pod in live.values() {
        assert_eq!(held.get(&ip_of(pod)).map(|r| r.pod.uid.clone()), pod.uid(), "live records untouched");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stateless_pod_gets_no_claim_and_a_claim_an_older_version_left_goes_once_its_pod_is_gone() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &pool(), &[]).await;
    let client = ipwarden.client();
    let controller = ipwarden.start_controller("janitor", &["--claim-janitor-interval-seconds=1"]);
    ipwarden.wait_leader(controller).await;
    create_pod(&client, NS, "plain", "node-0", json!({"app": "plain"})).await;
    create_statefulset(&client, NS, "web", json!({})).await;
    let plain = wait_pods_with_ips(&client, NS, "app=plain", 1).await.remove("plain").expect("plain pod");
    let web = wait_pods_with_ips(&client, NS, "app=web", 1).await.remove("web-0").expect("web-0");
    // From decision 0022 on, the controller, not the ADD, writes a sticky pod's claim: read the
    // claims once it witnessed web-0's.
    support::wait_witnessed(&client, NS, "web-0", &web.uid().unwrap_or_default()).await;
    let claimed = claims(&client, NS).await;
    assert!(claimed.contains_key("web-0"), "a StatefulSet pod still gets its claim: {:?}", claimed.keys());
    assert!(!claimed.contains_key("plain"), "a plain pod's ADD writes no claim: {:?}", claimed.keys());

    // What an older version left: a claim for the live plain pod and one for a pod long gone.
    let (plain_uid, plain_ip) = (plain.uid().unwrap_or_default(), ip_of(&plain));
    inject_legacy_claim(&client, NS, "plain", &plain_uid, &plain_ip).await;
    inject_legacy_claim(&client, NS, "ghost", "ghost-uid", "10.70.0.250").await;
    let left = wait::until("the janitor deletes the gone pod's legacy claim", TIMEOUT, || async {
        let names: BTreeSet<String> = claims(&client, NS).await.into_keys().collect();
        Ok(if names.contains("ghost") { Probe::Pending(format!("{names:?}")) } else { Probe::Done(names) })
    })
    .await
    .expect("the ghost's claim goes");
    assert!(left.contains("plain"), "the live plain pod's legacy claim stays while it runs: {left:?}");

    Api::<Pod>::namespaced(client.clone(), NS).delete("plain", &DeleteParams::default()).await.expect("delete plain");
    wait::until("the plain pod's record and legacy claim gone", TIMEOUT, || async {
        let held = records(&client).await.contains_key(&plain_ip);
        let claimed = claims(&client, NS).await.contains_key("plain");
        Ok(if !held && !claimed { Probe::Done(()) } else { Probe::Pending(format!("record {held}, claim {claimed}")) })
    })
    .await
    .expect("an upgrade's stateless claims are cleaned up");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sticky_claim_whose_owner_kind_is_no_longer_sticky_goes_once_its_pod_is_replaced() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let only_vms = "--sticky-owner-kinds=VirtualMachineInstance";
    let mut ipwarden = Ipwarden::start(1, &pool(), &[only_vms]).await;
    let client = ipwarden.client();
    let controller = ipwarden.start_controller("janitor", &["--claim-janitor-interval-seconds=1", only_vms]);
    ipwarden.wait_leader(controller).await;
    create_statefulset(&client, NS, "web", json!({})).await;
    wait_pods_with_ips(&client, NS, "app=web", 1).await;

    // Left while StatefulSet was sticky, by an earlier web-0: the stateless web-0 never takes it over.
    let spec = json!({"podUid": "earlier-uid", "sticky": true, "owner": {"kind": "StatefulSet", "name": "web"}});
    inject_claim(&client, NS, "web-0", spec, json!([{"ip": "10.70.0.250", "pool": POOL, "block": BLOCK}])).await;
    wait::until("the janitor deletes the claim no pod will read back", Duration::from_secs(20), || async {
        let names: BTreeSet<String> = claims(&client, NS).await.into_keys().collect();
        Ok(if names.contains("web-0") { Probe::Pending(format!("{names:?}")) } else { Probe::Done(()) })
    })
    .await
    .expect("a claim whose owner kind is no longer sticky goes with its pod");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sticky_pod_does_not_take_back_the_ips_of_a_stateless_claim_an_older_version_left() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &pool(), &[]).await;
    let client = ipwarden.client();
    create_pod(&client, NS, "plain", "node-0", json!({"app": "plain"})).await;
    wait_pods_with_ips(&client, NS, "app=plain", 1).await;
    let old = "10.70.0.250";
    let ips = json!([{"ip": old, "pool": POOL, "block": BLOCK}]);
    inject_claim(&client, NS, "web-0", json!({"podUid": "old-uid", "sticky": false}), ips).await;

    create_statefulset(&client, NS, "web", json!({})).await;
    let web = wait_pods_with_ips(&client, NS, "app=web", 1).await.remove("web-0").expect("web-0");
    assert_ne!(ip_of(&web), old, "a stateless claim keeps no IPs for a sticky pod of the same name");
    let controller = ipwarden.start_controller("controller", &[]);
    ipwarden.wait_leader(controller).await;
    wait::until("the controller writing web-0's sticky claim over the stateless one", TIMEOUT, || async {
        let claim = claims(&client, NS).await.remove("web-0").map(|c| c.spec);
        Ok(match claim {
            Some(c) if c.sticky && c.pod_uid == web.uid().unwrap_or_default() => Probe::Done(()),
            other => Probe::Pending(format!("{other:?}")),
        })
    })
    .await
    .expect("web-0's claim is sticky and bound to it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaks_released_in_one_batch_leave_an_event_each_findable_by_its_pod_and_by_its_pool() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &pool(), &[]).await;
    let client = ipwarden.client();
    // Five leaks of one pool in place before the controller starts: its first sweep releases
    // them together (their node is gone, so no handshake spreads them out).
    let leaks: Vec<(String, String)> = (0..5).map(|i| (format!("10.70.0.{}", 200 + i), format!("gone-{i}"))).collect();
    for (ip, pod) in &leaks {
        leak(&client, ip, record_json(NS, pod, &format!("uid-{pod}"), "no-such-node", None, false)).await;
    }
    let controller = ipwarden.start_controller("solo", &[]);
    ipwarden.wait_leader(controller).await;
    for (ip, _) in &leaks {
        wait_record_gone(&client, ip, TIMEOUT, "the leak released").await;
    }

    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let released = |list: Vec<Event>| -> Vec<Event> {
        list.into_iter().filter(|e| e.reason.as_deref() == Some("IPReleased")).collect()
    };
    for (ip, pod) in &leaks {
        // What `kubectl get events --field-selector involvedObject.name=<pod>` asks (core/v1,
        // the version kubectl reads: the controller writes events.k8s.io/v1).
        let by_pod = ListParams::default().fields(&format!("involvedObject.name={pod}"));
        let found = wait::until(&format!("the Event of {pod}"), TIMEOUT, || async {
            let list = events.list(&by_pod).await.map_err(e2e::Error::kube("events"))?;
            let found = released(list.items);
            Ok(if found.is_empty() { Probe::Pending("none yet".into()) } else { Probe::Done(found) })
        })
        .await
        .expect("an Event regarding the pod");
        assert_eq!(found.len(), 1, "one Event for {pod}: {found:?}");
        let event = &found[0];
        let note = event.message.clone().unwrap_or_default();
        for part in [ip.as_str(), pod.as_str(), &format!("uid-{pod}"), "no-such-node", POOL] {
            assert!(note.contains(part), "{part} in the note of {pod}'s Event: {note}");
        }
        let regarding = &event.involved_object;
        assert_eq!(
            (regarding.kind.as_deref(), regarding.uid.as_deref()),
            (Some("Pod"), Some(format!("uid-{pod}").as_str())),
            "{pod}'s Event regards its pod"
        );
    }
    let by_pool = ListParams::default().labels(&format!("ipwarden.io/pool={POOL}"));
    let of_pool = released(Api::<Event>::all(client.clone()).list(&by_pool).await.expect("events").items);
    let ips: BTreeSet<String> = of_pool
        .iter()
        .filter_map(|e| e.message.clone())
        .filter_map(|n| leaks.iter().find(|(ip, _)| n.contains(&format!("released {ip} "))).map(|(ip, _)| ip.clone()))
        .collect();
    assert_eq!(ips.len(), leaks.len(), "every release found by the pool's label: {of_pool:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_of_a_static_pods_released_record_is_listed_by_describe_of_its_mirror_pod() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &pool(), &[]).await;
    let client = ipwarden.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    // A static pod's mirror as kubelet creates it: the config hash in kubernetes.io/config.mirror,
    // a UID of its own. In the host's network, so the simulated runtime runs it without CNI.
    let mirror: Pod = serde_json::from_value(json!({
        "metadata": {"name": "static-web-node-0",
                     "annotations": {"kubernetes.io/config.mirror": "hash-web", "kubernetes.io/config.source": "file"}},
        "spec": {"nodeName": "node-0", "hostNetwork": true, "containers": [{"name": "c", "image": "registry.invalid/c:1"}]},
    }))
    .expect("mirror pod");
    let mirror = pods.create(&PostParams::default(), &mirror).await.expect("create the mirror pod");
    let mirror_uid = mirror.uid().expect("a created pod has a UID");
    wait::until("the mirror pod running", TIMEOUT, || async {
        let phase = pods.get("static-web-node-0").await.map_err(e2e::Error::kube("read"))?.status.and_then(|s| s.phase);
        Ok(if phase.as_deref() == Some("Running") { Probe::Done(()) } else { Probe::Pending(format!("{phase:?}")) })
    })
    .await
    .expect("running");
    // The static pod finished; the record its ADD left names it by its config hash, the UID
    // its runtime knows (agent.md), and its DEL was lost: the controller's to release.
    let finished = json!({"status": {"phase": "Succeeded"}});
    pods.patch_status("static-web-node-0", &PatchParams::default(), &Patch::Merge(&finished))
        .await
        .expect("the static pod finishes");
    let ip = "10.70.0.210";
    leak(&client, ip, record_json(NS, "static-web-node-0", "hash-web", "node-0", None, false)).await;
    let controller = ipwarden.start_controller("solo", &[]);
    ipwarden.wait_leader(controller).await;
    wait_record_gone(&client, ip, TIMEOUT, "the finished static pod's record released").await;

    // What `kubectl describe pod` asks for the pod's Events: its name and its object's UID.
    let events: Api<Event> = Api::namespaced(client.clone(), NS);
    let described =
        ListParams::default().fields(&format!("involvedObject.name=static-web-node-0,involvedObject.uid={mirror_uid}"));
    let found = wait::until("the release's Event listed by describe", Duration::from_secs(30), || async {
        let list = events.list(&described).await.map_err(e2e::Error::kube("events"))?;
        let released: Vec<Event> =
            list.items.into_iter().filter(|e| e.reason.as_deref() == Some("IPReleased")).collect();
        Ok(if released.is_empty() { Probe::Pending("none".into()) } else { Probe::Done(released) })
    })
    .await
    .expect("the Event of the static pod's release regards its mirror pod's UID");
    let note = found[0].message.clone().unwrap_or_default();
    assert!(note.contains("hash-web"), "the note names the record's UID, the config hash: {note}");
}
