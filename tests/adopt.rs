//! `ipwarden adopt` on the real control plane: pods started with Debian's host-local plugin
//! keep running while the nodes switch to ipwarden; adopt records their IPs (refusing an IP
//! two pods report, and saying so), and the pods ipwarden then starts never get one of them.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use e2e::CniNetwork;
use e2e::wait::{self, Probe};
use ipwarden::crd::{IPBlock, IPClaim};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::{Value, json};
use support::{Ipwarden, TIMEOUT, claims, cordon, create_pod, ip_of, records, wait_pods_with_ips};

const NS: &str = "default";

/// A network that runs host-local until `switched` is set, then ipwarden: the nodes' CNI
/// configuration replaced under running pods, as an operator does when moving IPAMs.
fn switchable_network() -> (CniNetwork, Arc<AtomicBool>) {
    let host_local = CniNetwork::host_local(&e2e::binaries::standard_cni_plugins().expect("host-local plugin"));
    let ipwarden = support::network();
    let switched = Arc::new(AtomicBool::new(false));
    let flag = switched.clone();
    let (old, new) = (host_local.netconf.clone(), ipwarden.netconf.clone());
    let network = CniNetwork {
        plugin_dirs: host_local.plugin_dirs.iter().chain(&ipwarden.plugin_dirs).cloned().collect(),
        netconf: Arc::new(move |node| if flag.load(Ordering::SeqCst) { new(node) } else { old(node) }),
        ..host_local
    };
    (network, switched)
}

/// A cluster of `nodes` nodes on host-local, with ipwarden's CRDs and a pool over the nodes'
/// host-local ranges (10.244.<node>.0/24, one block each) but no agent yet; setting the flag
/// returned switches the nodes to ipwarden.
async fn host_local_cluster(nodes: usize) -> (Ipwarden, Arc<AtomicBool>) {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let (network, switched) = switchable_network();
    let pool = json!({"cidr": "10.244.0.0/16", "blockSize": 24, "default": true});
    (Ipwarden::without_agents(nodes, &[("pool", pool)], network).await, switched)
}

/// Runs `ipwarden adopt -o json` (with `--dry-run` when `dry`) plus `extra`; returns its exit
/// success and its JSON report.
fn adopt(ipwarden: &Ipwarden, dry: bool, extra: &[&str]) -> (bool, Value) {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_ipwarden"));
    command.args(["adopt", "-o", "json"]).args(extra);
    if dry {
        command.arg("--dry-run");
    }
    let output = command.env("KUBECONFIG", ipwarden.cluster.kubeconfig()).output().expect("ipwarden runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let report = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("adopt prints JSON ({e}): {}\n{stderr}", String::from_utf8_lossy(&output.stdout)));
    (output.status.success(), report)
}

/// The IPs of a report's list `key` (`adopt`, `skipped` or `refused`), sorted.
fn ips(report: &Value, key: &str) -> Vec<String> {
    let mut ips: Vec<String> =
        report[key].as_array().into_iter().flatten().filter_map(|e| e["ip"].as_str().map(String::from)).collect();
    ips.sort();
    ips
}

/// A pod bound to a node no kubelet runs, whose status says it runs with `ip`: a second
/// reporter of an IP, as a stale or hand-edited status shows one.
async fn ghost_pod(ipwarden: &Ipwarden, name: &str, ip: &str) {
    create_pod(&ipwarden.client(), NS, name, "ghost-node", json!({"app": "ghost"})).await;
    let status = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}});
    Api::<Pod>::namespaced(ipwarden.client(), NS)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("patch the ghost pod's status");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_local_pods_are_adopted_without_restart_and_ipwarden_never_hands_their_ips_out_again() {
    let (mut ipwarden, switched) = host_local_cluster(2).await;
    let client = ipwarden.client();
    for index in 0..6 {
        create_pod(&client, NS, &format!("old-{index}"), &format!("node-{}", index % 2), json!({"app": "old"})).await;
    }
    let old: BTreeMap<String, Pod> = wait_pods_with_ips(&client, NS, "app=old", 6).await;
    let old_ips: BTreeMap<String, String> = old.values().map(|p| (ip_of(p), p.uid().unwrap_or_default())).collect();
    assert!(old_ips.keys().all(|ip| ip.starts_with("10.244.")), "host-local handed out {old_ips:?}");
    let doubled = ip_of(&old["old-0"]);
    ghost_pod(&ipwarden, "ghost-double", &doubled).await;
    ghost_pod(&ipwarden, "ghost-outside", "192.168.77.7").await;

    ipwarden.start_agents(&[]).await;
    switched.store(true, Ordering::SeqCst);

    let single: Vec<String> = old_ips.keys().filter(|ip| **ip != doubled).cloned().collect();
    let (ok, plan) = adopt(&ipwarden, true, &[]);
    assert!(!ok, "a refused IP makes adopt exit non-zero: {plan:#}");
    assert_eq!(ips(&plan, "adopt"), single, "the dry run plans every IP only one pod reports: {plan:#}");
    assert_eq!(ips(&plan, "refused"), std::slice::from_ref(&doubled), "{plan:#}");
    let named = plan["refused"][0]["pods"].to_string();
    assert!(named.contains("default/old-0") && named.contains("default/ghost-double"), "both pods named: {named}");
    assert_eq!(ips(&plan, "skipped"), ["192.168.77.7"], "the IP outside every pool is skipped: {plan:#}");
    assert!(records(&client).await.is_empty(), "a dry run writes nothing");

    let (ok, applied) = adopt(&ipwarden, false, &[]);
    assert!(!ok, "still refused: {applied:#}");
    assert_eq!(ips(&applied, "adopt"), single, "{applied:#}");
    let force = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    Api::<Pod>::namespaced(client.clone(), NS).delete("ghost-double", &force).await.expect("delete the ghost");
    let (ok, again) = adopt(&ipwarden, false, &[]);
    assert!(ok, "nothing refused once the second reporter is gone: {again:#}");
    assert_eq!(ips(&again, "adopt"), std::slice::from_ref(&doubled), "{again:#}");
    assert_eq!(ips(&again, "skipped").len(), 6, "the rest is already recorded (and one is outside): {again:#}");

    let recorded = records(&client).await;
    for (ip, uid) in &old_ips {
        let record = recorded.get(ip).unwrap_or_else(|| panic!("{ip} adopted: {recorded:?}"));
        assert_eq!(&record.pod.uid, uid, "{ip} is recorded for the pod that reports it");
        assert!(record.repaired_at.is_some() && record.container_id.is_empty(), "{ip}: {record:?}");
        assert_eq!(record.network, e2e::ipwarden::NETWORK, "{ip}: the chart's network name, adopt's default");
    }

    // Churn through ipwarden: pods come and go, half the adopted pods too.
    for index in 0..10 {
        create_pod(&client, NS, &format!("new-{index}"), &format!("node-{}", index % 2), json!({"app": "new"})).await;
    }
    let new_pods = wait_pods_with_ips(&client, NS, "app=new", 10).await;
    // Each agent ran, its block cache empty, when adopt created its node's block: the blocks
    // adopt made stay affine to their nodes, each new pod's IP comes from a block of its own
    // node (adopt's, once the agent's watch has shown it; a fresh claim when the watch lags
    // under load), and the ADDs' writes keep adopt's records (a stale cached copy costs a 409
    // and a retry, never a record).
    let blocks = Api::<IPBlock>::all(client.clone()).list(&Default::default()).await.expect("list blocks").items;
    let affinities: BTreeMap<String, Option<String>> =
        blocks.iter().map(|b| (b.name_any(), b.spec.affinity.clone())).collect();
    let adopted_blocks: BTreeMap<String, Option<String>> = applied["adopt"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| (a["block"].as_str().unwrap_or_default().to_string(), a["node"].as_str().map(String::from)))
        .collect();
    for (block, node) in &adopted_blocks {
        assert_eq!(affinities.get(block), Some(node), "adopt's block {block} stays affine to its node");
    }
    for pod in new_pods.values() {
        let ip = ip_of(pod);
        let block = blocks.iter().find(|b| b.spec.allocations.contains_key(&ip)).expect("the new pod's block");
        assert_eq!(
            block.spec.affinity,
            pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            "{ip} from its node's block"
        );
    }
    let churned = records(&client).await;
    for (ip, uid) in &old_ips {
        assert_eq!(churned.get(ip).map(|r| &r.pod.uid), Some(uid), "{ip}'s adopted record outlives the churn");
    }
    for pod in new_pods.values() {
        let record = churned.get(&ip_of(pod));
        assert_eq!(record.map(|r| r.pod.uid.clone()), pod.uid(), "{} is recorded", pod.name_any());
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    for index in 0..5 {
        pods.delete(&format!("new-{index}"), &DeleteParams::default()).await.expect("delete new pod");
    }
    let gone: Vec<String> = (0..3).map(|index| ip_of(&old[&format!("old-{index}")])).collect();
    for index in 0..3 {
        pods.delete(&format!("old-{index}"), &DeleteParams::default()).await.expect("delete old pod");
    }
    // The pods' DELs name the old IPAM's sandboxes, so the controller releases these records
    // once the pods are gone, by the rule table.
    ipwarden.start_controller("controller-a", &[]);
    wait::until("the controller releasing the adopted records of the deleted pods", TIMEOUT, || async {
        let recorded = records(&client).await;
        let left: Vec<&String> = gone.iter().filter(|ip| recorded.contains_key(*ip)).collect();
        Ok(if left.is_empty() { Probe::Done(()) } else { Probe::Pending(format!("still recorded: {left:?}")) })
    })
    .await
    .expect("the controller releases an adopted record once its pod is gone");
    for index in 10..20 {
        create_pod(&client, NS, &format!("new-{index}"), &format!("node-{}", index % 2), json!({"app": "new"})).await;
    }
    let new = wait_pods_with_ips(&client, NS, "app=new", 15).await;
    let mut live: BTreeMap<String, String> = BTreeMap::new();
    for pod in new.values().chain(old.values().filter(|p| ["old-3", "old-4", "old-5"].contains(&p.name_any().as_str())))
    {
        if let Some(other) = live.insert(ip_of(pod), pod.name_any()) {
            panic!("{} and {other} share {}", pod.name_any(), ip_of(pod));
        }
    }
    let held: BTreeSet<&String> = old_ips.keys().filter(|ip| !gone.contains(ip)).collect();
    for pod in new.values() {
        let ip = ip_of(pod);
        assert!(!held.contains(&ip), "{} got {ip}, adopted for a live pod", pod.name_any());
        assert!(ip.starts_with("10.244."), "{} got {ip} from the pool", pod.name_any());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_started_with_adopt_on_start_records_its_nodes_host_local_pods_before_serving() {
    let (mut ipwarden, switched) = host_local_cluster(1).await;
    let client = ipwarden.client();
    for index in 0..3 {
        create_pod(&client, NS, &format!("old-{index}"), "node-0", json!({"app": "old"})).await;
    }
    let old = wait_pods_with_ips(&client, NS, "app=old", 3).await;
    switched.store(true, Ordering::SeqCst);

    // Start-up adoption runs before the agent serves: once it serves, the records are there.
    ipwarden.start_agents(&["--adopt-on-start"]).await;
    let recorded = records(&client).await;
    for pod in old.values() {
        let record = recorded.get(&ip_of(pod)).unwrap_or_else(|| panic!("{} adopted: {recorded:?}", ip_of(pod)));
        assert_eq!(record.pod.uid, pod.uid().unwrap_or_default(), "{} recorded for {}", ip_of(pod), pod.name_any());
        assert_eq!(record.node, "node-0");
        assert_eq!(record.network, e2e::ipwarden::NETWORK, "the chart's network name, the agent's default");
    }
    create_pod(&client, NS, "new-0", "node-0", json!({"app": "new"})).await;
    let new = wait_pods_with_ips(&client, NS, "app=new", 1).await;
    let ip = ip_of(&new["new-0"]);
    assert!(old.values().all(|p| ip_of(p) != ip), "the new pod got {ip}, an adopted IP");
}

/// web-0 once it exists with a UID other than `not_uid`, whether or not it runs yet.
async fn wait_web0_other_than(client: &kube::Client, not_uid: &str) -> Pod {
    wait::until("web-0 recreated by its StatefulSet", TIMEOUT, || async {
        let pod =
            Api::<Pod>::namespaced(client.clone(), NS).get_opt("web-0").await.map_err(e2e::Error::kube("get web-0"))?;
        Ok(match pod {
            Some(pod) if pod.uid().unwrap_or_default() != not_uid => Probe::Done(pod),
            other => Probe::Pending(format!("web-0: {:?}", other.map(|p| p.uid()))),
        })
    })
    .await
    .expect("web-0 recreated")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_statefulset_pod_recreated_on_ipwarden_gets_its_ip_back_and_the_controller_keeps_it_meanwhile() {
    let (mut ipwarden, switched) = host_local_cluster(1).await;
    let client = ipwarden.client();
    support::create_statefulset(&client, NS, "web", json!({})).await;
    let first = wait_pods_with_ips(&client, NS, "app=web", 1).await.remove("web-0").expect("web-0");
    let (ip, first_uid) = (ip_of(&first), first.uid().unwrap_or_default());
    ipwarden.start_agents(&[]).await;
    switched.store(true, Ordering::SeqCst);

    // A network name other than the default, so that the flag is seen to take effect.
    let (ok, report) = adopt(&ipwarden, false, &["--network", "pods"]);
    assert!(ok, "{report:#}");
    assert_eq!(ips(&report, "adopt"), std::slice::from_ref(&ip), "{report:#}");
    let adopted = records(&client).await.remove(&ip).expect("web-0's IP recorded");
    assert_eq!(adopted.network, "pods", "the record names the network given: {adopted:?}");
    // A run that stopped between the records and the claim (here: the claim deleted) is
    // finished by the next run, which finds the records already there.
    Api::<IPClaim>::namespaced(client.clone(), NS)
        .delete("web-0", &DeleteParams::default())
        .await
        .expect("delete claim");
    let (ok, again) = adopt(&ipwarden, false, &["--network", "pods"]);
    assert!(ok && ips(&again, "skipped") == [ip.clone()], "already recorded: {again:#}");
    let claim = claims(&client, NS).await.remove("web-0").expect("the next run writes web-0's claim again");
    assert_eq!(claim.spec.pod_uid, first_uid);
    // Only now: a controller creates a live sticky pod's missing claim itself.
    let controller = ipwarden.start_controller("controller-a", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(controller).await;
    // The recreated pod takes back the IP the controller witnessed its claim holding
    // (decision 0022): the adopted record, witnessed for the first web-0.
    support::wait_witnessed(&client, NS, "web-0", &first_uid).await;

    // web-0 gone and its successor waiting for a schedulable node: the tracer and two full
    // sweeps see the adopted record, and must keep it as web-0's reservation.
    cordon(&client, "node-0", true).await;
    Api::<Pod>::namespaced(client.clone(), NS).delete("web-0", &DeleteParams::default()).await.expect("delete web-0");
    wait_web0_other_than(&client, &first_uid).await;
    ipwarden.wait_sweeps(controller, 2).await;
    let kept = records(&client).await.remove(&ip);
    assert!(kept.as_ref().is_some_and(|r| r.sticky), "the controller keeps the adopted StatefulSet IP: {kept:?}");

    cordon(&client, "node-0", false).await;
    let second = wait::until("web-0 running on ipwarden", TIMEOUT, || async {
        let pods = support::pods_with_ips(&client, NS, "app=web").await?;
        Ok(match pods.get("web-0") {
            Some(pod) if pod.uid().unwrap_or_default() != first_uid => Probe::Done(pod.clone()),
            _ => Probe::Pending("no new web-0 with an IP".into()),
        })
    })
    .await
    .expect("web-0 runs again");
    assert_eq!(ip_of(&second), ip, "the recreated StatefulSet pod gets its adopted IP back");
    let taken = records(&client).await.remove(&ip).expect("the IP recorded for the new web-0");
    assert_eq!(taken.pod.uid, second.uid().unwrap_or_default());
    assert!(taken.sticky && !taken.container_id.is_empty(), "now an ordinary sticky record: {taken:?}");
    assert_eq!(taken.network, e2e::ipwarden::NETWORK, "the ADD's network: {taken:?}");
    // From decision 0022 on, the controller, not the ADD, writes the claim: read it once the
    // controller witnessed it for the second web-0.
    support::wait_witnessed(&client, NS, "web-0", &second.uid().unwrap_or_default()).await;
    let claim = claims(&client, NS).await.remove("web-0").expect("web-0's claim");
    assert_eq!(claim.spec.pod_uid, second.uid().unwrap_or_default(), "{claim:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adopt_takes_over_the_stale_claim_of_an_older_pod_of_the_same_name_and_says_so() {
    let (ipwarden, _switched) = host_local_cluster(1).await;
    let client = ipwarden.client();
    support::create_statefulset(&client, NS, "web", json!({})).await;
    let web = wait_pods_with_ips(&client, NS, "app=web", 1).await.remove("web-0").expect("web-0");
    let (ip, uid) = (ip_of(&web), web.uid().unwrap_or_default());
    // The claim an older web-0 left when the StatefulSet ran on ipwarden before its pods were
    // recreated under host-local: bound to a UID no pod has now, with that pod's IP.
    let older = json!({
        "apiVersion": "ipwarden.io/v1alpha1", "kind": "IPClaim",
        "metadata": {"name": "web-0", "namespace": NS},
        "spec": {"podUid": "older-web-0", "node": "node-0", "sticky": true, "boundAt": "2026-01-01T00:00:00Z",
                 "interfaces": [{"interface": "eth0", "ips": [{"ip": "10.244.0.200", "pool": "pool", "block": "pool-10-244-0-0-24"}]}]}
    });
    let older: IPClaim = serde_json::from_value(older).expect("an IPClaim");
    Api::<IPClaim>::namespaced(client.clone(), NS)
        .create(&Default::default(), &older)
        .await
        .expect("create the older pod's claim");
    let action = |report: &Value| {
        let line = report["claims"].as_array().and_then(|c| c.first()).cloned().unwrap_or_default();
        assert_eq!(line["claim"], "default/web-0", "{report:#}");
        line["action"].as_str().unwrap_or_default().to_string()
    };

    let (ok, dry) = adopt(&ipwarden, true, &[]);
    assert!(ok, "{dry:#}");
    assert!(action(&dry).starts_with("would take over from pod UID older-web-0"), "the dry run says so: {dry:#}");
    let (ok, report) = adopt(&ipwarden, false, &[]);
    assert!(ok, "{report:#}");
    assert_eq!(ips(&report, "adopt"), std::slice::from_ref(&ip), "the record is adopted: {report:#}");
    assert!(action(&report).starts_with("take over from pod UID older-web-0"), "adopt says whose it was: {report:#}");
    let claim = claims(&client, NS).await.remove("web-0").expect("web-0's claim");
    assert_eq!(claim.spec.pod_uid, uid, "the claim is the adopted pod's now: {claim:?}");
    let claimed: Vec<&str> = claim.spec.interfaces.iter().flat_map(|i| &i.ips).map(|i| i.ip.as_str()).collect();
    assert_eq!(claimed, [ip.as_str()], "it binds the adopted IP, not the older pod's: {claim:?}");
    // A later run finds the claim as it would write it.
    let (ok, again) = adopt(&ipwarden, true, &[]);
    assert!(ok && action(&again).starts_with("unchanged"), "{again:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ip_that_is_a_nodes_spare_is_adopted_and_no_new_pod_gets_it() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pool = json!({"cidr": "10.94.0.0/24", "blockSize": 26, "default": true});
    let ipwarden = Ipwarden::start(1, &[("pool", pool)], &["--spare-ips=4"]).await;
    let client = ipwarden.client();
    let spares = wait::until("node-0's spares", TIMEOUT, || async {
        let blocks = Api::<IPBlock>::all(client.clone()).list(&Default::default()).await.expect("list blocks").items;
        let spares: BTreeSet<String> = blocks.into_iter().flat_map(|b| b.spec.spares).collect();
        Ok(if spares.len() == 4 { Probe::Done(spares) } else { Probe::Pending(format!("{spares:?}")) })
    })
    .await
    .expect("spares reserved");
    // A pod of the old IPAM reports one of them (it got the address before ipwarden ran).
    let taken = spares.iter().next().expect("a spare").clone();
    ghost_pod(&ipwarden, "old-ipam", &taken).await;

    let (ok, report) = adopt(&ipwarden, false, &[]);
    assert!(ok, "adopt records the IP: {report:#}");
    assert_eq!(ips(&report, "adopt"), std::slice::from_ref(&taken), "{report:#}");
    let recorded = records(&client).await;
    let uid = Api::<Pod>::namespaced(client.clone(), NS).get("old-ipam").await.expect("pod").uid();
    assert_eq!(recorded.get(&taken).map(|r| r.pod.uid.clone()), uid, "{taken} recorded for the old IPAM's pod");
    let blocks = Api::<IPBlock>::all(client.clone()).list(&Default::default()).await.expect("list blocks").items;
    assert!(blocks.iter().all(|b| !b.spec.spares.contains(&taken)), "{taken} is no spare any more");
    // The agent binds spares from its copy of the block, so a pod created before that copy has
    // adopt's write may still get the IP (docs/operations.md, "Moving from another IPAM"). The agent reserving a
    // spare in place of the adopted one is a compare-and-swap write of that block, which only
    // goes through on a copy that has adopt's write: wait for it.
    let block =
        blocks.iter().find(|b| b.spec.allocations.contains_key(&taken)).expect("the adopted IP's block").name_any();
    wait::until("node-0 to reserve a spare in place of the adopted one", TIMEOUT, || async {
        let now = Api::<IPBlock>::all(client.clone()).get(&block).await.expect("get the block").spec.spares;
        Ok(if now.iter().any(|ip| !spares.contains(ip)) { Probe::Done(()) } else { Probe::Pending(format!("{now:?}")) })
    })
    .await
    .expect("a new spare");

    for index in 0..6 {
        create_pod(&client, NS, &format!("new-{index}"), "node-0", json!({"app": "new"})).await;
    }
    let new = wait_pods_with_ips(&client, NS, "app=new", 6).await;
    assert!(new.values().all(|p| ip_of(p) != taken), "no new pod got the adopted {taken}");
}
