//! Sticky IPs of StatefulSet pods on the real control plane, with real agents and the real
//! plugin: a recreated pod taking its IP over from a sandbox still attached (late DEL, lost
//! node) and from a detached one (ordinary restart), a late DEL of a superseded sandbox, pods
//! with several interfaces, and IPClaims edited by hand or by another node's agent. The two-node cases run as the chart
//! installs ipwarden, each agent on a token bound to its node under the node-bound write
//! policies, so every cross-node mark, answer and take is one the apiserver lets a node make.

mod support;

use e2e::cni::{Invocation, NodeInfo, PodArgs};
use e2e::ipwarden::ReleaseHold;
use e2e::kubelet::{EXTRA_INTERFACES_ANNOTATION, Sandbox};
use e2e::wait::{self, Probe};
use ipwarden::crd::{Allocation, HandshakeState, IPBlock, IPClaim};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::{Ipwarden, TIMEOUT, claims, cordon, ip_of, metric, pod_template, records};

const NS: &str = "default";
const POOL: &str = "pool";
const CIDR: &str = "10.74.0.0/24";

/// Creates StatefulSet `web` with one replica whose pods carry `annotations` and `spec`.
async fn create_web(client: &kube::Client, annotations: serde_json::Value, spec: serde_json::Value) {
    let mut template = pod_template("web", spec);
    template["metadata"]["annotations"] = annotations;
    let sts: StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 1, "serviceName": "web", "selector": {"matchLabels": {"app": "web"}},
                 "template": template},
    }))
    .expect("sts");
    Api::<StatefulSet>::namespaced(client.clone(), NS).create(&PostParams::default(), &sts).await.expect("create web");
}

/// Waits for a web-0 that reports an IP and whose UID is not `not_uid`.
async fn wait_web0(client: &kube::Client, not_uid: &str, what: &str) -> Pod {
    wait::until(what, TIMEOUT, || async {
        let pods = support::pods_with_ips(client, NS, "app=web").await?;
        Ok(match pods.get("web-0") {
            Some(pod) if pod.uid().unwrap_or_default() != not_uid => Probe::Done(pod.clone()),
            _ => Probe::Pending(format!("web-0: {:?}", pods.get("web-0").map(|p| p.uid()))),
        })
    })
    .await
    .expect("web-0 runs")
}

/// Deletes web-0 the ordinary way and waits for its successor.
async fn restart_web0(client: &kube::Client, pod: &Pod) -> Pod {
    let uid = pod.uid().unwrap_or_default();
    Api::<Pod>::namespaced(client.clone(), NS).delete("web-0", &DeleteParams::default()).await.expect("delete web-0");
    wait_web0(client, &uid, "web-0 recreated after an ordinary restart").await
}

/// The IP of the record of `uid`'s interface `ifname`.
fn record_ip(records: &std::collections::BTreeMap<String, Allocation>, uid: &str, ifname: &str) -> Option<String> {
    records.iter().find(|(_, r)| r.pod.uid == uid && r.interface == ifname).map(|(ip, _)| ip.clone())
}

/// web-0 of a new StatefulSet `web`, started on node-0 (node-1 cordoned meanwhile).
async fn web0_on_node0(client: &kube::Client) -> Pod {
    cordon(client, "node-1", true).await;
    create_web(client, json!({}), json!({})).await;
    wait_web0(client, "", "web-0 on node-0").await
}

/// Two nodes as the chart installs ipwarden (agents with `agent_args` on node-bound tokens),
/// a leading controller with `controller_args`, and web-0 running on node-0, its claim
/// witnessed (so its IP follows it to node-1: decision 0022): the cluster, the controller's
/// index and web-0.
async fn web0_on_node0_of_two(agent_args: &[&str], controller_args: &[&str]) -> (Ipwarden, usize, Pod) {
    let mut ipwarden =
        Ipwarden::start_node_bound(2, &[(POOL, json!({"cidr": CIDR, "default": true}))], agent_args).await;
    let controller = ipwarden.start_controller("controller", controller_args);
    ipwarden.wait_leader(controller).await;
    let first = web0_on_node0(&ipwarden.client()).await;
    wait_witnessed(&ipwarden.client(), &first.uid().unwrap_or_default()).await;
    (ipwarden, controller, first)
}

/// Force-deletes `web0` on node-0 while node-0's runtime holds its DEL back, with node-0
/// cordoned and node-1 open, so the StatefulSet recreates it on node-1; returns the sandbox
/// still attached on node-0.
async fn move_web0_to_node1_holding_del(ipwarden: &Ipwarden, web0: &Pod) -> Sandbox {
    let client = ipwarden.client();
    cordon(&client, "node-0", true).await;
    cordon(&client, "node-1", false).await;
    force_delete_holding_del(ipwarden, 0, web0).await
}

/// Force-deletes web-0 on node `index` while that node's runtime holds its DEL back;
/// returns the sandbox left behind.
async fn force_delete_holding_del(ipwarden: &Ipwarden, index: usize, pod: &Pod) -> Sandbox {
    let client = ipwarden.client();
    let node = &ipwarden.cluster.nodes()[index];
    let uid = pod.uid().unwrap_or_default();
    let sandbox = node.sandboxes().remove(&uid).expect("web-0's sandbox");
    node.faults().set_skip_del(true);
    let force = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    Api::<Pod>::namespaced(client.clone(), NS).delete("web-0", &force).await.expect("force delete");
    wait::until("the runtime dropping web-0's sandbox without DEL", TIMEOUT, || async {
        Ok(if node.sandboxes().contains_key(&uid) { Probe::Pending("still up".into()) } else { Probe::Done(()) })
    })
    .await
    .expect("sandbox dropped");
    node.faults().set_skip_del(false);
    sandbox
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_del_of_a_superseded_sandbox_leaves_the_new_owners_claim_and_the_ip_stays_sticky() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let agent_args = ["--release-sandbox-grace-seconds=2", "--reuse-cooldown-seconds=0"];
    let (ipwarden, _controller, first) = web0_on_node0_of_two(&agent_args, &[]).await;
    let client = ipwarden.client();
    let (ip, first_uid) = (ip_of(&first), first.uid().unwrap_or_default());

    // web-0 is force-deleted on node-0, whose runtime holds the DEL back, and comes back on
    // node-1 with a new UID, taking the sticky IP and the claim over.
    let sandbox = move_web0_to_node1_holding_del(&ipwarden, &first).await;
    let second = wait_web0(&client, &first_uid, "web-0 recreated on node-1").await;
    let second_uid = second.uid().unwrap_or_default();
    assert_eq!(ip_of(&second), ip, "the recreated web-0 keeps its IP");
    wait_witnessed(&client, &second_uid).await;
    assert_eq!(claims(&client, NS).await.get("web-0").map(|c| c.spec.pod_uid.clone()), Some(second_uid.clone()));

    // The old sandbox's DEL arrives late on node-0: it must not touch the new owner's claim.
    support::late_del(&ipwarden, 0, NS, "web-0", &first_uid, &sandbox).await;
    let claim = claims(&client, NS).await.remove("web-0");
    assert_eq!(claim.map(|c| c.spec.pod_uid), Some(second_uid.clone()), "the late DEL left the new owner's claim");
    let held = records(&client).await.get(&ip).map(|r| r.pod.uid.clone());
    assert_eq!(held, Some(second_uid.clone()), "and its record");

    // Another ordinary restart: web-0 still gets its IP back.
    let third = restart_web0(&client, &second).await;
    assert_eq!(ip_of(&third), ip, "the IP stays sticky after the late DEL");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_interface_of_a_sticky_pod_keeps_its_ip_across_a_restart() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let ipwarden = Ipwarden::start(1, &[(POOL, json!({"cidr": CIDR, "default": true}))], &[]).await;
    let client = ipwarden.client();
    let mut ipwarden = ipwarden;
    let controller = ipwarden.start_controller("controller", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(controller).await;
    create_web(&client, json!({EXTRA_INTERFACES_ANNOTATION: "net1"}), json!({"nodeName": "node-0"})).await;
    let first = wait_web0(&client, "", "web-0 with eth0 and net1").await;
    let first_uid = first.uid().unwrap_or_default();
    let before = records(&client).await;
    let eth0 = record_ip(&before, &first_uid, "eth0").expect("eth0 record");
    let net1 = record_ip(&before, &first_uid, "net1").expect("net1 record");
    assert_ne!(eth0, net1);
    // The claim's IPs are what the controller saw web-0 hold: both interfaces, before the restart.
    wait_witnessed_ips(&client, &first_uid, 2).await;

    let second = restart_web0(&client, &first).await;
    let second_uid = second.uid().unwrap_or_default();
    let net1_of_second = wait::until("the new web-0's net1 attached", TIMEOUT, || async {
        Ok(match record_ip(&records(&client).await, &second_uid, "net1") {
            Some(ip) => Probe::Done(ip),
            None => Probe::Pending("no net1 record of the new web-0".into()),
        })
    })
    .await
    .expect("net1 attached");
    assert_eq!(ip_of(&second), eth0, "eth0 keeps its IP");
    assert_eq!(net1_of_second, net1, "net1 keeps its IP");
    wait_witnessed_ips(&client, &second_uid, 2).await;
    let claim = claims(&client, NS).await.remove("web-0").expect("claim");
    let claimed: Vec<(String, String)> = claim
        .spec
        .interfaces
        .iter()
        .flat_map(|i| i.ips.iter().map(move |ip| (i.interface.clone(), ip.ip.clone())))
        .collect();
    assert_eq!(claimed.len(), 2, "the claim lists both interfaces: {claimed:?}");
    assert!(claimed.contains(&("net1".to_string(), net1.clone())), "{claimed:?}");

    // The controller's sweeps leave both records with the new pod.
    ipwarden.wait_sweeps(controller, 2).await;
    let after = records(&client).await;
    assert_eq!(record_ip(&after, &second_uid, "eth0"), Some(eth0));
    assert_eq!(record_ip(&after, &second_uid, "net1"), Some(net1));
    assert_eq!(after.len(), 2, "no other record: {:?}", after.keys().collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_naming_another_block_is_refused_and_never_makes_the_agent_write_that_object() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &[(POOL, json!({"cidr": CIDR, "default": true}))], &[]).await;
    let client = ipwarden.client();
    create_web(&client, json!({}), json!({"nodeName": "node-0"})).await;
    let first = wait_web0(&client, "", "web-0 running").await;
    let ip = ip_of(&first);
    let controller = witnessed_by_a_controller(&mut ipwarden, &first).await;
    // Stopped, so that it does not write the tampered witness right again before the ADD.
    ipwarden.controllers[controller].kill();
    let claims_api: Api<IPClaim> = Api::namespaced(client.clone(), NS);
    let canonical = witnessed_block(&mut claims_api.get("web-0").await.expect("claim")).clone();

    // Someone who may write the claim's status points it at another object; web-0 restarts.
    let tampered = "kube-system-evil";
    let mut claim = claims_api.get("web-0").await.expect("claim");
    *witnessed_block(&mut claim) = tampered.to_string();
    claims_api.replace_status("web-0", &PostParams::default(), &claim).await.expect("tamper with the claim");
    let first_uid = first.uid().unwrap_or_default();
    Api::<Pod>::namespaced(client.clone(), NS).delete("web-0", &DeleteParams::default()).await.expect("delete web-0");
    let refused = wait::until("the agent refusing the tampered claim (or using it)", TIMEOUT, || async {
        let text = ipwarden.scrape_agent(0).await;
        let refused = metric(&text, r#"ipwarden_agent_allocations_total{result="invalid_claim"}"#);
        let running = support::pods_with_ips(&client, NS, "app=web").await?;
        let recreated = running.get("web-0").is_some_and(|p| p.uid().unwrap_or_default() != first_uid);
        Ok(if refused >= 1.0 || recreated {
            Probe::Done(refused)
        } else {
            Probe::Pending("web-0 not added yet".into())
        })
    })
    .await
    .expect("the ADD is answered");
    let blocks: Vec<String> = Api::<IPBlock>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("blocks")
        .items
        .iter()
        .map(|b| b.name_any())
        .collect();
    assert_eq!(blocks, std::slice::from_ref(&canonical), "no object named by the claim was written");
    assert!(refused >= 1.0, "the ADD was refused as an invalid claim");
    let held = records(&client).await.get(&ip).map(|r| r.pod.uid.clone());
    assert_eq!(held, Some(first_uid.clone()), "the reservation stays with the old pod meanwhile");

    // The claim is put right: web-0 gets its sticky IP back.
    let mut claim = claims_api.get("web-0").await.expect("claim");
    *witnessed_block(&mut claim) = canonical;
    claims_api.replace_status("web-0", &PostParams::default(), &claim).await.expect("repair the claim");
    let second = wait_web0(&client, &first_uid, "web-0 running again").await;
    assert_eq!(ip_of(&second), ip);
}

/// The block the first witnessed IP of `claim` names.
fn witnessed_block(claim: &mut IPClaim) -> &mut String {
    let witnessed = claim.status.as_mut().and_then(|s| s.witnessed.as_mut()).expect("witnessed");
    &mut witnessed.interfaces[0].ips[0].block
}

/// Waits until the controller has witnessed web-0's claim for pod `uid`; returns its IPs.
async fn wait_witnessed(client: &kube::Client, uid: &str) -> Vec<String> {
    support::wait_witnessed(client, NS, "web-0", uid).await
}

/// Waits until the controller has witnessed web-0's claim for pod `uid` holding `count` IPs: a
/// pod's interfaces are added one after the other, and a witness may come in between.
async fn wait_witnessed_ips(client: &kube::Client, uid: &str, count: usize) {
    wait::until(&format!("web-0's claim witnessed for {uid} with {count} IPs"), TIMEOUT, || async {
        let witnessed = claims(client, NS).await.remove("web-0").and_then(|c| c.status).and_then(|s| s.witnessed);
        let ips: Vec<String> = witnessed
            .filter(|w| w.pod_uid == uid)
            .map(|w| w.interfaces.iter().flat_map(|i| &i.ips).map(|c| c.ip.clone()).collect())
            .unwrap_or_default();
        Ok(if ips.len() == count { Probe::Done(()) } else { Probe::Pending(format!("{ips:?}")) })
    })
    .await
    .expect("witnessed");
}

/// Starts a controller on `ipwarden` and waits until it has witnessed web-0's claim for `pod`:
/// a sticky pod's next life takes back the IPs the controller saw it hold (decision 0022).
/// Returns the controller's index.
async fn witnessed_by_a_controller(ipwarden: &mut Ipwarden, pod: &Pod) -> usize {
    let controller = ipwarden.start_controller("controller", &[]);
    ipwarden.wait_leader(controller).await;
    wait_witnessed(&ipwarden.client(), &pod.uid().unwrap_or_default()).await;
    controller
}

/// node-1's agent client (node-1's credentials, as its root reads them) on web-0's IPClaim,
/// after it took the claim over for a pod of its own as far as rule C-1 lets it, pointed at
/// `other`; returns that client.
async fn node1_takes_web0_claim_over(ipwarden: &Ipwarden, other: &str) -> Api<IPClaim> {
    node1_rewrites_web0_claim(ipwarden, |spec| spec.interfaces[0].ips[0].ip = other.to_string()).await
}

/// node-1's agent client on web-0's IPClaim, after it took the claim over for a pod of its own
/// (rule C-1) with `edit` applied to the spec; returns that client.
async fn node1_rewrites_web0_claim(
    ipwarden: &Ipwarden,
    edit: impl Fn(&mut ipwarden::crd::IPClaimSpec),
) -> Api<IPClaim> {
    let rogue: Api<IPClaim> = Api::namespaced(node1_agent(ipwarden).await, NS);
    // The controller may write the status meanwhile: a conflict, read again.
    wait::until("node-1 taking web-0's claim over", TIMEOUT, || async {
        let mut claim = rogue.get("web-0").await.expect("node-1 reads web-0's claim");
        claim.spec.pod_uid = "node-1-pod".to_string();
        claim.spec.node = "node-1".to_string();
        edit(&mut claim.spec);
        Ok(match rogue.replace("web-0", &PostParams::default(), &claim).await {
            Ok(_) => Probe::Done(()),
            Err(kube::Error::Api(status)) if status.code == 409 => Probe::Pending("a conflict".into()),
            Err(e) => panic!("rule C-1 lets node-1 take it over: {e}"),
        })
    })
    .await
    .expect("taken over");
    rogue
}

/// Creates web-0's IPClaim with `rogue`, node-1's agent client, as rule C-1 lets it: bound to
/// a pod on node-1 and naming `ip` of the pool's block.
async fn node1_creates_web0_claim(rogue: kube::Client, ip: &str) {
    let claim: IPClaim = serde_json::from_value(json!({
        "apiVersion": "ipwarden.io/v1alpha1", "kind": "IPClaim", "metadata": {"name": "web-0", "namespace": NS},
        "spec": {"podUid": "node-1-pod", "node": "node-1", "sticky": true, "boundAt": "2026-01-01T00:00:00Z",
                 "owner": {"kind": "StatefulSet", "name": "web"},
                 "interfaces": [{"interface": "eth0", "ips": [{"ip": ip, "pool": POOL, "block": "pool-10-74-0-0-24"}]}]},
    }))
    .expect("a claim");
    Api::<IPClaim>::namespaced(rogue, NS)
        .create(&PostParams::default(), &claim)
        .await
        .expect("C-1 lets node-1 create it");
}

/// Another free IP of web-0's block, five above `ip`.
fn five_above(ip: &str) -> String {
    std::net::Ipv4Addr::from(u32::from(ip.parse::<std::net::Ipv4Addr>().expect("an IPv4")) + 5).to_string()
}

/// Waits until the controller has written web-0's claim's spec back to what `pod`'s records
/// on node-0 hold, `ip`, after another node rewrote it.
async fn wait_spec_written_back(client: &kube::Client, pod: &Pod, ip: &str) {
    let uid = pod.uid().unwrap_or_default();
    wait::until("the controller writing web-0's claim's spec back", TIMEOUT, || async {
        let spec = claims(client, NS).await.remove("web-0").map(|c| c.spec);
        let said = spec.as_ref().map(|s| (s.pod_uid.as_str(), s.node.as_str(), s.interfaces[0].ips[0].ip.as_str()));
        Ok(if said == Some((uid.as_str(), "node-0", ip)) {
            Probe::Done(())
        } else {
            Probe::Pending(format!("{said:?}"))
        })
    })
    .await
    .expect("the spec written back");
}

/// Checks that web-0's restart took its own IP `ip` back on node-0 although its claim's spec
/// had named `other` and a pod on node-1, and that the controller witnesses it for the new pod
/// and writes the spec as its records bind it.
async fn web0_restarts_with_its_own_ip(client: &kube::Client, first: &Pod, ip: &str, other: &str) {
    let second = restart_web0(client, first).await;
    assert_eq!(ip_of(&second), ip, "web-0 keeps its IP after another node pointed its claim's spec at {other}");
    assert_eq!(wait_witnessed(client, &second.uid().unwrap_or_default()).await, [ip]);
    let claim = claims(client, NS).await.remove("web-0").expect("web-0's claim");
    assert_eq!(
        (claim.spec.pod_uid.as_str(), claim.spec.node.as_str(), claim.spec.interfaces[0].ips[0].ip.as_str()),
        (second.uid().unwrap_or_default().as_str(), "node-0", ip),
        "the controller wrote the claim's spec right"
    );
}

/// Another node's agent (node-1's credentials) takes web-0's IPClaim over as far as rule C-1
/// lets it, pointing it at another IP, and then tries to delete it. web-0 lives on node-0: its
/// restart takes back the IP the controller saw it hold (`status.witnessed`, which no agent
/// may write), and the delete is refused by rule C-2. The janitor's timed pass never runs
/// here: the controller witnesses each binding soon after its index changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_another_node_took_over_moves_no_statefulset_pods_ip_and_cannot_be_deleted_by_it() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let janitor = ["--claim-janitor-interval-seconds=3600"];
    let (ipwarden, _controller, first) = web0_on_node0_of_two(&[], &janitor).await;
    let client = ipwarden.client();
    let ip = ip_of(&first);
    assert_eq!(wait_witnessed(&client, &first.uid().unwrap_or_default()).await, std::slice::from_ref(&ip));

    let other = five_above(&ip);
    let rogue = node1_takes_web0_claim_over(&ipwarden, &other).await;
    let refused = rogue.delete("web-0", &DeleteParams::default()).await.expect_err("rule C-2 refuses the delete");
    assert!(refused.to_string().contains("ipwarden C-2"), "{refused}");
    let stored = claims(&client, NS).await.remove("web-0").expect("the claim");
    assert!(stored.status.and_then(|s| s.witnessed).is_some(), "the witnessed binding survived the rewrite");
    wait_spec_written_back(&client, &first, &ip).await;

    web0_restarts_with_its_own_ip(&client, &first, &ip, &other).await;
}

/// node-1 writes web-0's claim, which no agent writes any more, before any controller has
/// seen web-0 (staged: the controller starts only after the write), naming another IP and a
/// pod on node-1. The controller then witnesses what web-0's records on node-0 hold, not the
/// spec, and writes the spec back (as the chart's ServiceAccount, so under the chart's RBAC);
/// web-0's restart takes its own IP back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_another_node_wrote_before_the_controller_saw_it_moves_no_statefulset_pods_ip() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start_node_bound(2, &[(POOL, json!({"cidr": CIDR, "default": true}))], &[]).await;
    let client = ipwarden.client();
    let first = web0_on_node0(&client).await;
    let ip = ip_of(&first);
    let other = five_above(&ip);
    assert!(claims(&client, NS).await.is_empty(), "web-0's ADD wrote no claim");
    node1_creates_web0_claim(node1_agent(&ipwarden).await, &other).await;

    let namespace = support::NODE_BOUND_NAMESPACE;
    let kubeconfig =
        e2e::accounts::kubeconfig_for(&ipwarden.cluster, namespace, "ipwarden-controller").await.expect("token");
    ipwarden.controller_run_as = Some(e2e::ipwarden::RunAs { kubeconfig, namespace: namespace.into() });
    let controller = ipwarden.start_controller("controller", &["--claim-janitor-interval-seconds=3600"]);
    ipwarden.wait_leader(controller).await;
    assert_eq!(
        wait_witnessed(&client, &first.uid().unwrap_or_default()).await,
        std::slice::from_ref(&ip),
        "the witness is what web-0's records hold"
    );
    wait_spec_written_back(&client, &first, &ip).await;

    web0_restarts_with_its_own_ip(&client, &first, &ip, &other).await;
}

/// web-0's IPClaim, deleted by hand while web-0 runs, is created again by the controller (as
/// the chart's ServiceAccount, so under the chart's RBAC) from the records web-0 holds, and
/// witnessed: web-0's next life on the same node takes its IP back instead of starting on a
/// new one (decision 0022: the controller writes the claims).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_deleted_while_its_pod_runs_is_created_again_by_the_controller_and_the_ip_stays_sticky() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start_node_bound(2, &[(POOL, json!({"cidr": CIDR, "default": true}))], &[]).await;
    let client = ipwarden.client();
    let namespace = support::NODE_BOUND_NAMESPACE;
    let kubeconfig =
        e2e::accounts::kubeconfig_for(&ipwarden.cluster, namespace, "ipwarden-controller").await.expect("token");
    ipwarden.controller_run_as = Some(e2e::ipwarden::RunAs { kubeconfig, namespace: namespace.into() });
    // The janitor's timed pass (every 2 s here) retries a write that failed.
    let controller = ipwarden.start_controller("controller", &[]);
    ipwarden.wait_leader(controller).await;
    let first = web0_on_node0(&client).await;
    let (uid, ip) = (first.uid().unwrap_or_default(), ip_of(&first));
    assert_eq!(wait_witnessed(&client, &uid).await, std::slice::from_ref(&ip));

    let claims_api: Api<IPClaim> = Api::namespaced(client.clone(), NS);
    let deleted = claims_api.get("web-0").await.expect("web-0's claim").uid().unwrap_or_default();
    claims_api.delete("web-0", &DeleteParams::default()).await.expect("delete web-0's claim by hand");
    let created = wait::until("the controller creating web-0's claim again", TIMEOUT, || async {
        let claim = claims(&client, NS).await.remove("web-0");
        Ok(match claim {
            Some(c)
                if c.uid().unwrap_or_default() != deleted
                    && c.status.as_ref().and_then(|s| s.witnessed.as_ref()).is_some_and(|w| w.pod_uid == uid) =>
            {
                Probe::Done(c)
            }
            other => Probe::Pending(format!("{:?}", other.map(|c| (c.uid(), c.status)))),
        })
    })
    .await
    .expect("the claim is created again");
    let spec = &created.spec;
    assert_eq!(
        (spec.pod_uid.as_str(), spec.node.as_str(), spec.sticky, spec.owner.as_ref().map(|o| o.name.as_str())),
        (uid.as_str(), "node-0", true, Some("web")),
        "{created:?}"
    );
    let claimed: Vec<(&str, &str)> =
        spec.interfaces.iter().flat_map(|i| i.ips.iter().map(|c| (i.interface.as_str(), c.ip.as_str()))).collect();
    assert_eq!(claimed, [("eth0", ip.as_str())], "{created:?}");

    let second = restart_web0(&client, &first).await;
    assert_eq!(ip_of(&second), ip, "web-0's next life takes back the IP of the claim the controller wrote");
}

/// A client of node-1's agent (node-1's credentials, as its root reads them).
async fn node1_agent(ipwarden: &Ipwarden) -> kube::Client {
    let kubeconfig = e2e::accounts::node_bound_kubeconfig_for(
        &ipwarden.cluster,
        support::NODE_BOUND_NAMESPACE,
        "ipwarden-agent",
        "node-1",
    )
    .await
    .expect("a token of node-1's agent");
    e2e::controlplane::client_for(&kubeconfig).await.expect("node-1's client")
}

/// Before StatefulSet `web` exists, node-1 (its agent's credentials, under the node-bound
/// policies) forges a reservation of web-0 in the pool's one block, which it creates, and creates web-0's IPClaim
/// naming it, bound to node-1, as rules B-U3 and C-1 let it. web-0 then starts on node-0 while
/// no controller has witnessed the claim: its ADD takes no other node's record the claim's
/// spec names (any node may have written that spec), so node-1 neither chooses web-0's IP nor
/// holds its start back by never answering the takeover mark; web-0 gets a fresh IP and the
/// forged record stays node-1's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_another_node_created_before_its_pod_chooses_none_of_its_ips() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start_node_bound(2, &[(POOL, json!({"cidr": CIDR, "default": true}))], &[]).await;
    let client = ipwarden.client();
    let rogue = node1_agent(&ipwarden).await;
    let (forged, block) = ("10.74.0.200", "pool-10-74-0-0-24");
    let mut reservation = support::record_json(NS, "web-0", "node-1-pod", "node-1", Some(("StatefulSet", "web")), true);
    reservation["containerId"] = json!("");
    reservation["interface"] = json!("");
    let forged_block: IPBlock = serde_json::from_value(json!({
        "apiVersion": "ipwarden.io/v1alpha1", "kind": "IPBlock", "metadata": {"name": block},
        "spec": {"pool": POOL, "cidr": CIDR, "affinity": "node-1", "allocations": {forged: reservation}},
    }))
    .expect("a block");
    Api::<IPBlock>::all(rogue.clone())
        .create(&PostParams::default(), &forged_block)
        .await
        .expect("B-U3 lets node-1 forge it");
    node1_creates_web0_claim(rogue, forged).await;

    let web0 = web0_on_node0(&client).await;
    assert_ne!(ip_of(&web0), forged, "web-0 took the reservation node-1 forged and named in the claim");
    let kept = records(&client).await.remove(forged).expect("the forged record");
    assert_eq!(
        (kept.node.as_str(), kept.pod.uid.as_str()),
        ("node-1", "node-1-pod"),
        "node-1's record is left as it was"
    );
    // A controller, started once that is checked (its GC would release the forged record as
    // stale), writes the claim as web-0's records bind it.
    let controller = ipwarden.start_controller("controller", &[]);
    ipwarden.wait_leader(controller).await;
    assert_eq!(wait_witnessed(&client, &web0.uid().unwrap_or_default()).await, [ip_of(&web0)]);
    let claim = claims(&client, NS).await.remove("web-0").expect("web-0's claim");
    assert_eq!(
        (claim.spec.node.as_str(), claim.spec.interfaces[0].ips[0].ip.as_str()),
        ("node-0", ip_of(&web0).as_str()),
        "the controller bound the claim's spec to what web-0 got"
    );
}

/// node-1 rewrites web-0's witnessed claim so that, judged by its spec, its workload looks
/// gone (another pod's UID, stateless, another owner). The claim janitor, passing every
/// second, judges it by the witness and keeps it (and writes the spec right again); web-1's
/// claim, whose ordinal a scale-down ends, shows a pass ran after the rewrite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_janitor_keeps_a_witnessed_claim_another_node_made_look_gone() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let janitor = ["--claim-janitor-interval-seconds=1"];
    let (ipwarden, _controller, first) = web0_on_node0_of_two(&[], &janitor).await;
    let client = ipwarden.client();
    scale_web(&client, 2).await;
    let pods = support::wait_pods_with_ips(&client, NS, "app=web", 2).await;
    let web1 = pods["web-1"].uid().unwrap_or_default();
    support::wait_witnessed(&client, NS, "web-1", &web1).await;

    node1_rewrites_web0_claim(&ipwarden, |spec| {
        spec.sticky = false;
        spec.owner = Some(ipwarden::crd::OwnerRef { kind: "StatefulSet".into(), name: "gone".into() });
    })
    .await;
    scale_web(&client, 1).await;
    wait::until("the janitor deleting web-1's claim", TIMEOUT, || async {
        let names: Vec<String> = claims(&client, NS).await.into_keys().collect();
        Ok(if names.iter().any(|n| n == "web-1") { Probe::Pending(format!("{names:?}")) } else { Probe::Done(()) })
    })
    .await
    .expect("web-1's claim deleted");
    let kept = claims(&client, NS).await.remove("web-0").expect("web-0's claim is kept");
    assert_eq!(kept.status.and_then(|s| s.witnessed).map(|w| w.pod_uid), first.uid());
}

/// The record of `ip`: its pod UID, and its handshake's state and waiting pod, if any.
async fn record_of(client: &kube::Client, ip: &str) -> Option<(String, Option<HandshakeState>, Option<String>)> {
    records(client).await.get(ip).map(|r| {
        let handshake = r.release_handshake.as_ref();
        (
            r.pod.uid.clone(),
            handshake.map(|h| h.state),
            handshake.and_then(|h| h.takeover.as_ref()).map(|t| t.pod.uid.clone()),
        )
    })
}

/// The pod named web-0 right now (running or not).
async fn web0(client: &kube::Client) -> Option<Pod> {
    Api::<Pod>::namespaced(client.clone(), NS).get_opt("web-0").await.expect("read web-0")
}

/// Waits for a web-0 whose UID is not `not_uid` (it need not run yet).
async fn wait_new_web0(client: &kube::Client, not_uid: &str) -> Pod {
    wait::until("web-0 recreated", TIMEOUT, || async {
        Ok(match web0(client).await {
            Some(pod) if pod.uid().unwrap_or_default() != not_uid => Probe::Done(pod),
            other => Probe::Pending(format!("{:?}", other.map(|p| p.uid()))),
        })
    })
    .await
    .expect("web-0 recreated")
}

/// Agent `index`'s count of ADDs that waited for a sticky takeover.
async fn takeover_waits(ipwarden: &Ipwarden, index: usize) -> f64 {
    metric(&ipwarden.scrape_agent(index).await, r#"ipwarden_agent_allocations_total{result="awaiting_takeover"}"#)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recreated_sticky_pod_waits_while_its_old_sandbox_is_attached_and_takes_the_ip_after_the_late_del() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    // The old node's agent never gives up on the sandbox by itself here: only its DEL frees it.
    let agent_args = ["--release-sandbox-grace-seconds=3600", "--reuse-cooldown-seconds=0"];
    let (ipwarden, controller, first) = web0_on_node0_of_two(&agent_args, &["--full-scan-interval-seconds=2"]).await;
    let client = ipwarden.client();
    let (ip, first_uid) = (ip_of(&first), first.uid().unwrap_or_default());

    // web-0 is force-deleted while node-0's runtime holds its DEL back (a partitioned or
    // slow node): the sandbox still has the IP when web-0 comes back on node-1.
    let sandbox = move_web0_to_node1_holding_del(&ipwarden, &first).await;
    let second = wait_new_web0(&client, &first_uid).await;
    let second_uid = second.uid().unwrap_or_default();
    wait::until("node-1's ADDs of web-0 waiting for the takeover (or web-0 running)", TIMEOUT, || async {
        let waits = takeover_waits(&ipwarden, 1).await;
        let running = web0(&client).await.is_some_and(|p| !ip_of(&p).is_empty());
        Ok(if waits >= 3.0 || running { Probe::Done(()) } else { Probe::Pending(format!("{waits} waits")) })
    })
    .await
    .expect("ADD answered");
    let waiting = web0(&client).await.expect("web-0");
    assert_eq!(ip_of(&waiting), "", "the new web-0 has no IP while the old sandbox holds it");
    // The controller's sweeps leave the agent's takeover mark alone.
    ipwarden.wait_sweeps(controller, 2).await;
    let held = record_of(&client, &ip).await;
    let marked = Some((first_uid.clone(), Some(HandshakeState::MarkedForRelease), Some(second_uid.clone())));
    assert_eq!(held, marked, "the old sandbox's record is marked for web-0's takeover, not taken");
    assert_eq!(ip_of(&web0(&client).await.expect("web-0")), "", "still waiting");

    // What the runtime hears: a retryable error naming the pod, the node and the IP.
    let node = &ipwarden.cluster.nodes()[1];
    let info = NodeInfo { name: node.name().to_string(), index: 1, dir: node.dir().to_path_buf() };
    let network = support::network();
    let netconf = (network.netconf)(&info);
    let args = PodArgs { namespace: NS.into(), name: "web-0".into(), uid: second_uid.clone() };
    let add = Invocation { command: "ADD", container_id: "probe", ifname: "eth0", pod: Some(&args), netconf: &netconf };
    let refused = network.invoke(&add).await.expect_err("ADD must wait").to_string();
    for part in ["code 11", "web-0", "node-0", ip.as_str()] {
        assert!(refused.contains(part), "{part:?} missing from {refused}");
    }

    // The late DEL detaches the old sandbox: web-0 takes its IP over at once.
    support::late_del(&ipwarden, 0, NS, "web-0", &first_uid, &sandbox).await;
    let running = wait_web0(&client, &first_uid, "web-0 running on node-1").await;
    assert_eq!(ip_of(&running), ip, "the sticky IP, once no other sandbox holds it");
    assert_eq!(record_of(&client, &ip).await, Some((second_uid.clone(), None, None)));
    wait_witnessed(&client, &second_uid).await;
    assert_eq!(claims(&client, NS).await.get("web-0").map(|c| c.spec.pod_uid.clone()), Some(second_uid));
}

/// A StatefulSet pod pinned to a fixed IP (`ipwarden.io/ips`) is sticky as any: recreated
/// while its old sandbox still holds the IP, it waits for the sticky takeover (the old
/// record marked, code 11), not refused as if another pod held it (code 104), which would
/// never end on a lost node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statefulset_pod_with_a_fixed_ip_takes_it_over_from_its_old_sandbox_like_any_sticky_ip() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let agent_args = ["--release-sandbox-grace-seconds=3600", "--reuse-cooldown-seconds=0"];
    let ipwarden = Ipwarden::start_node_bound(2, &[(POOL, json!({"cidr": CIDR, "default": true}))], &agent_args).await;
    let client = ipwarden.client();
    cordon(&client, "node-1", true).await;
    create_web(&client, json!({"ipwarden.io/ips": "10.74.0.77"}), json!({})).await;
    let first = wait_web0(&client, "", "web-0 on node-0").await;
    let first_uid = first.uid().unwrap_or_default();
    assert_eq!(ip_of(&first), "10.74.0.77", "the fixed IP");
    // No controller runs, so no claim is witnessed: the IP the pod names is asked for as a
    // witnessed one would be (it is the pod's word, not a node's).

    let sandbox = move_web0_to_node1_holding_del(&ipwarden, &first).await;
    let second_uid = wait_new_web0(&client, &first_uid).await.uid().unwrap_or_default();
    let refusals = |text: String| {
        let waits = metric(&text, r#"ipwarden_agent_allocations_total{result="awaiting_takeover"}"#);
        (waits, metric(&text, r#"ipwarden_agent_allocations_total{result="fixed_ip_in_use"}"#))
    };
    let (waits, in_use) = wait::until("node-1's ADDs of web-0 refused three times", TIMEOUT, || async {
        let (waits, in_use) = refusals(ipwarden.scrape_agent(1).await);
        Ok(if waits + in_use >= 3.0 { Probe::Done((waits, in_use)) } else { Probe::Pending(format!("{waits}")) })
    })
    .await
    .expect("ADDs answered");
    assert_eq!((in_use, waits >= 3.0), (0.0, true), "a sticky takeover, not a fixed IP held by another pod");
    let held = record_of(&client, "10.74.0.77").await;
    let marked = Some((first_uid.clone(), Some(HandshakeState::MarkedForRelease), Some(second_uid.clone())));
    assert_eq!(held, marked, "the old sandbox's record is marked for web-0's takeover");

    support::late_del(&ipwarden, 0, NS, "web-0", &first_uid, &sandbox).await;
    let running = wait_web0(&client, &first_uid, "web-0 running on node-1").await;
    assert_eq!(ip_of(&running), "10.74.0.77", "the fixed IP, once no other sandbox holds it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sticky_pod_takes_its_ip_over_from_a_lost_node_only_under_the_not_ready_policy() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let agent_args = ["--release-sandbox-grace-seconds=3600", "--reuse-cooldown-seconds=0"];
    let after = 20;
    let policy = format!("--not-ready-release-after-seconds={after}");
    let args = ["--full-scan-interval-seconds=300", "--not-ready-policy=release", policy.as_str()];
    let (ipwarden, controller, first) = web0_on_node0_of_two(&agent_args, &args).await;
    let client = ipwarden.client();
    let (ip, first_uid) = (ip_of(&first), first.uid().unwrap_or_default());

    // node-0 is lost with web-0's sandbox on it; web-0 is force-deleted and comes back on node-1.
    ipwarden.cluster.nodes()[0].lose();
    let since = wait::until("node-0 NotReady", TIMEOUT, || async {
        let node = Api::<Node>::all(client.clone()).get("node-0").await.map_err(e2e::Error::kube("get node"))?;
        let ready = node.status.and_then(|s| s.conditions).and_then(|c| c.into_iter().find(|c| c.type_ == "Ready"));
        Ok(match ready {
            Some(c) if c.status != "True" => Probe::Done(c.last_transition_time.map(|t| t.0).expect("transition")),
            _ => Probe::Pending("still Ready".into()),
        })
    })
    .await
    .expect("node-0 NotReady");
    cordon(&client, "node-0", true).await;
    cordon(&client, "node-1", false).await;
    let force = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    Api::<Pod>::namespaced(client.clone(), NS).delete("web-0", &force).await.expect("force delete");
    let running = wait_web0(&client, &first_uid, "web-0 running on node-1").await;
    let second_uid = running.uid().unwrap_or_default();
    assert_eq!(ip_of(&running), ip, "web-0 keeps its IP");
    wait_witnessed(&client, &second_uid).await;
    let claim = claims(&client, NS).await.remove("web-0").expect("claim");
    let due = since.checked_add(jiff::SignedDuration::from_secs(after)).expect("due");
    assert!(claim.spec.bound_at.0 >= due, "taken over at {} before the policy's bound {due}", claim.spec.bound_at.0);
    assert!(takeover_waits(&ipwarden, 1).await >= 1.0, "the ADD waited for the takeover");
    let text = ipwarden.scrape_controller(controller).await.unwrap_or_default();
    let answered = support::metric_sum(&text, "ipwarden_gc_release_handshakes_total", &["step=\"answered_for_agent\""]);
    assert_eq!(answered, 1.0, "the controller answered for node-0's agent");

    // node-0 comes back and its runtime finally DELs the old sandbox: that DEL touches
    // neither the new owner's record nor its claim.
    ipwarden.cluster.nodes()[0].recover();
    let node = &ipwarden.cluster.nodes()[0];
    wait::until("node-0's runtime tearing the old sandbox down", TIMEOUT, || async {
        Ok(if node.sandboxes().is_empty() { Probe::Done(()) } else { Probe::Pending("still up".into()) })
    })
    .await
    .expect("old sandbox torn down");
    assert_eq!(record_of(&client, &ip).await, Some((second_uid.clone(), None, None)));
    assert_eq!(claims(&client, NS).await.get("web-0").map(|c| c.spec.pod_uid.clone()), Some(second_uid));
}

/// The claims are the controller's (decision 0022) whether or not its GC runs: with
/// `--gc-enabled=false`, which releases and deletes nothing, web-0 still keeps its IP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_with_its_gc_turned_off_still_writes_the_claims_that_keep_sticky_ips() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &[(POOL, json!({"cidr": CIDR, "default": true}))], &[]).await;
    let client = ipwarden.client();
    let controller = ipwarden.start_controller("controller", &["--gc-enabled=false"]);
    ipwarden.wait_leader(controller).await;
    create_web(&client, json!({}), json!({"nodeName": "node-0"})).await;
    let first = wait_web0(&client, "", "web-0 running").await;
    let ip = ip_of(&first);
    assert_eq!(wait_witnessed(&client, &first.uid().unwrap_or_default()).await, std::slice::from_ref(&ip));
    let second = restart_web0(&client, &first).await;
    assert_eq!(ip_of(&second), ip, "the restart keeps the IP");
    assert_eq!(wait_witnessed(&client, &second.uid().unwrap_or_default()).await, [ip]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordinary_sticky_restart_takes_its_ip_back_without_waiting() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &[(POOL, json!({"cidr": CIDR, "default": true}))], &[]).await;
    let client = ipwarden.client();
    create_web(&client, json!({}), json!({"nodeName": "node-0"})).await;
    let mut pod = wait_web0(&client, "", "web-0 running").await;
    let ip = ip_of(&pod);
    witnessed_by_a_controller(&mut ipwarden, &pod).await;
    let mut took = Vec::new();
    for _ in 0..3 {
        let started = std::time::Instant::now();
        pod = restart_web0(&client, &pod).await;
        took.push(started.elapsed().as_millis());
        assert_eq!(ip_of(&pod), ip, "an ordinary restart keeps the IP");
    }
    println!("ordinary sticky restart, delete to new web-0 running with its IP (ms): {took:?}");
    assert_eq!(takeover_waits(&ipwarden, 0).await, 0.0, "a detached sandbox is taken over without a handshake");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sticky_pod_recreated_on_the_same_node_waits_for_its_old_sandbox_too() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let agent_args = ["--release-sandbox-grace-seconds=3600", "--reuse-cooldown-seconds=0"];
    let mut ipwarden = Ipwarden::start(1, &[(POOL, json!({"cidr": CIDR, "default": true}))], &agent_args).await;
    let client = ipwarden.client();
    create_web(&client, json!({}), json!({"nodeName": "node-0"})).await;
    let first = wait_web0(&client, "", "web-0 on node-0").await;
    let (ip, first_uid) = (ip_of(&first), first.uid().unwrap_or_default());
    witnessed_by_a_controller(&mut ipwarden, &first).await;

    // The old sandbox is still in node-0's own checkpoint when web-0 comes back there.
    let sandbox = force_delete_holding_del(&ipwarden, 0, &first).await;
    let second_uid = wait_new_web0(&client, &first_uid).await.uid().unwrap_or_default();
    wait::until("node-0's ADDs of web-0 waiting for the takeover", TIMEOUT, || async {
        let waits = takeover_waits(&ipwarden, 0).await;
        Ok(if waits >= 2.0 { Probe::Done(()) } else { Probe::Pending(format!("{waits} waits")) })
    })
    .await
    .expect("ADD waits");
    assert_eq!(ip_of(&web0(&client).await.expect("web-0")), "", "no IP while the old sandbox holds it");
    assert_eq!(record_of(&client, &ip).await.map(|r| r.0), Some(first_uid.clone()), "not taken yet");

    support::late_del(&ipwarden, 0, NS, "web-0", &first_uid, &sandbox).await;
    let running = wait_web0(&client, &first_uid, "web-0 running again").await;
    assert_eq!(ip_of(&running), ip);
    assert_eq!(record_of(&client, &ip).await, Some((second_uid, None, None)));
}

/// Scales StatefulSet `web` to `replicas`.
async fn scale_web(client: &kube::Client, replicas: i32) {
    let patch = json!({"spec": {"replicas": replicas}});
    Api::<StatefulSet>::namespaced(client.clone(), NS)
        .patch("web", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("scale web");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_statefulset_scale_down_and_up_keeps_the_reservation_a_sweep_decided_to_release_on_the_stale_state() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let agent_args = ["--release-sandbox-grace-seconds=1", "--reuse-cooldown-seconds=0"];
    let mut ipwarden = Ipwarden::start(1, &[(POOL, json!({"cidr": CIDR, "default": true}))], &agent_args).await;
    let client = ipwarden.client();
    // The hold keeps the release of web-1's answered mark, decided from the caches, from its
    // live re-reads until the test has scaled the set back up; the slow janitor leaves web-1's
    // claim while the set is scaled down.
    let hold = ReleaseHold::start(&ipwarden.cluster.dir().join("release-hold")).expect("release hold");
    let hold_flag = hold.flag();
    let args = ["--full-scan-interval-seconds=1", "--claim-janitor-interval-seconds=600", &hold_flag];
    let controller = ipwarden.start_controller("controller", &args);
    ipwarden.wait_leader(controller).await;
    let sts: StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 2, "serviceName": "web", "podManagementPolicy": "Parallel",
                 "selector": {"matchLabels": {"app": "web"}}, "template": pod_template("web", json!({}))},
    }))
    .expect("sts");
    Api::<StatefulSet>::namespaced(client.clone(), NS).create(&PostParams::default(), &sts).await.expect("create web");
    let pods = support::wait_pods_with_ips(&client, NS, "app=web", 2).await;
    let (ip, first_uid) = (ip_of(&pods["web-1"]), pods["web-1"].uid().unwrap_or_default());
    support::wait_witnessed(&client, NS, "web-1", &first_uid).await;

    // Scale down with web-1's DEL lost: its record stays for the controller to decide on.
    let node = &ipwarden.cluster.nodes()[0];
    node.faults().set_skip_del(true);
    scale_web(&client, 1).await;
    wait::until("web-1's sandbox dropped without DEL", TIMEOUT, || async {
        Ok(if node.sandboxes().contains_key(&first_uid) { Probe::Pending("up".into()) } else { Probe::Done(()) })
    })
    .await
    .expect("sandbox dropped");
    node.faults().set_skip_del(false);

    // The agent answers the controller's mark; the controller decides to release (the set
    // wants one replica), and the release waits on the hold before its live re-reads.
    wait::until("web-1's record answered ready-for-release", TIMEOUT, || async {
        let state = record_of(&client, &ip).await;
        Ok(match state {
            Some((_, Some(HandshakeState::ReadyForRelease), None)) => Probe::Done(()),
            other => Probe::Pending(format!("{other:?}")),
        })
    })
    .await
    .expect("the agent answers");
    wait::until("the release decided on the scaled-down state held", TIMEOUT, || async {
        Ok(if hold.holds_a_release() { Probe::Done(()) } else { Probe::Pending("not held yet".into()) })
    })
    .await
    .expect("a release held");

    // Scaled back up before the write; web-1 stays Pending (node cordoned) so no ADD interferes.
    cordon(&client, "node-0", true).await;
    scale_web(&client, 2).await;
    let replicas = Api::<StatefulSet>::namespaced(client.clone(), NS).get("web").await.expect("read web");
    assert_eq!(replicas.spec.replicas, Some(2), "the scale-up landed before the write");
    drop(hold);
    let outcome = wait::until("the stale release written or dropped (the mark cleared)", TIMEOUT, || async {
        Ok(match record_of(&client, &ip).await {
            Some((_, Some(_), _)) => Probe::Pending("still marked".into()),
            other => Probe::Done(other),
        })
    })
    .await
    .expect("the controller writes");
    assert_eq!(outcome, Some((first_uid.clone(), None, None)), "the wanted reservation of web-1 is kept");
    let text = ipwarden.scrape_controller(controller).await.unwrap_or_default();
    let dropped = metric(&text, r#"ipwarden_gc_skips_total{reason="owner_wants"}"#);
    assert!(dropped >= 1.0, "the pool actor's re-read of the StatefulSet dropped the release: {dropped}");

    cordon(&client, "node-0", false).await;
    let web1 = wait::until("web-1 running again", TIMEOUT, || async {
        let pods = support::pods_with_ips(&client, NS, "app=web").await?;
        Ok(match pods.get("web-1") {
            Some(pod) if pod.uid().unwrap_or_default() != first_uid => Probe::Done(pod.clone()),
            _ => Probe::Pending("not yet".into()),
        })
    })
    .await
    .expect("web-1 runs");
    assert_eq!(ip_of(&web1), ip, "web-1 has its sticky IP back");
}

/// Informed consent (decision 0022): the record's node answers a takeover mark
/// `ready-for-release` only for a claimant that is a live pod of the record's workload on the
/// node that asked; a mark naming a pod that does not exist gets `do-not-release`, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_is_consented_to_only_for_a_real_pod_on_the_node_that_asked() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let ipwarden = Ipwarden::start_node_bound(2, &[(POOL, json!({"cidr": CIDR, "default": true}))], &[]).await;
    let client = ipwarden.client();
    // web-8's new pod runs on node-1; its old record, and web-9's, are node-0's (their DELs
    // came: no sandbox on node-0 holds them).
    support::create_pod(&client, NS, "web-8", "node-1", json!({})).await;
    let claimant = wait::until("web-8 running", TIMEOUT, || async {
        let pods = support::pods_with_ips(&client, NS, "").await?;
        Ok(match pods.get("web-8") {
            Some(pod) => Probe::Done(pod.uid().unwrap_or_default()),
            None => Probe::Pending("no IP yet".into()),
        })
    })
    .await
    .expect("web-8 running");
    let block = format!("{POOL}-{}", CIDR.replace(['.', '/'], "-"));
    for (ip, name, uid) in [("10.74.0.208", "web-8", claimant.as_str()), ("10.74.0.209", "web-9", "made-up-uid")] {
        let mut record =
            support::record_json(NS, name, &format!("{name}-old-uid"), "node-0", Some(("StatefulSet", "web")), true);
        record["releaseHandshake"] = json!({"state": "marked-for-release", "markedAt": "2026-01-01T00:00:00Z",
            "reason": format!("sticky takeover by pod {NS}/{name} on node node-1"),
            "takeover": {"pod": {"namespace": NS, "name": name, "uid": uid}, "node": "node-1"}});
        support::inject_record(&client, POOL, &block, CIDR, ip, record).await;
    }
    let answers = wait::until("node-0 answers both takeovers", TIMEOUT, || async {
        let records = records(&client).await;
        let answer = |ip: &str| {
            let handshake = records.get(ip).and_then(|r| r.release_handshake.clone());
            handshake
                .filter(|h| h.state != HandshakeState::MarkedForRelease)
                .map(|h| (h.state, h.detail.unwrap_or_default()))
        };
        Ok(match (answer("10.74.0.208"), answer("10.74.0.209")) {
            (Some(real), Some(made_up)) => Probe::Done((real, made_up)),
            other => Probe::Pending(format!("{other:?}")),
        })
    })
    .await
    .expect("answers");
    assert_eq!(answers.0.0, HandshakeState::ReadyForRelease, "the real claimant gets the record: {answers:?}");
    assert_eq!(answers.1.0, HandshakeState::DoNotRelease, "a made-up claimant does not: {answers:?}");
    assert!(
        answers.1.1.contains("web-9") && answers.1.1.contains("does not exist"),
        "the answer says why: {answers:?}"
    );
}

/// Waits (bounded) until the takeover mark on `ip` is no longer waiting, and asserts that it
/// was not answered `ready-for-release` (`what`: the consent that would have been wrong).
async fn assert_takeover_not_consented(client: &kube::Client, ip: &str, what: &str) {
    let settled = wait::until("the controller settling the mark", TIMEOUT, || async {
        Ok(match record_of(client, ip).await {
            Some((_, Some(HandshakeState::MarkedForRelease), Some(_))) => Probe::Pending("still marked".into()),
            other => Probe::Done(other),
        })
    })
    .await
    .expect("settled");
    assert!(
        !matches!(settled, Some((_, Some(HandshakeState::ReadyForRelease), _))),
        "the controller consented to {what}: {settled:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_answers_a_takeover_for_a_lost_node_only_for_a_claimant_on_the_node_that_asked() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &[(POOL, json!({"cidr": CIDR, "default": true}))], &[]).await;
    let controller = ipwarden.start_controller("controller", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(controller).await;
    let client = ipwarden.client();
    // web-7's new pod exists and waits for its IPs, but no node runs it (nothing matches its
    // selector); its old record is node-7's, a node that is gone, so its agent cannot answer.
    // node-0 asks for the record for web-7 as if web-7 ran there.
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web-7", "namespace": NS},
        "spec": {"nodeSelector": {"ipwarden.io/test": "no-such-node"},
                 "containers": [{"name": "app", "image": "registry.invalid/ipwarden-test/app:1"}]},
    }))
    .expect("pod");
    let claimant =
        Api::<Pod>::namespaced(client.clone(), NS).create(&PostParams::default(), &pod).await.expect("web-7");
    let block = format!("{POOL}-{}", CIDR.replace(['.', '/'], "-"));
    let mut record = support::record_json(NS, "web-7", "web-7-old-uid", "node-7", Some(("StatefulSet", "web")), true);
    record["releaseHandshake"] = json!({"state": "marked-for-release", "markedAt": "2026-01-01T00:00:00Z",
        "reason": format!("sticky takeover by pod {NS}/web-7 on node node-0"),
        "takeover": {"pod": {"namespace": NS, "name": "web-7", "uid": claimant.uid().unwrap_or_default()},
                     "node": "node-0"}});
    support::inject_record(&client, POOL, &block, CIDR, "10.74.0.207", record).await;

    assert_takeover_not_consented(&client, "10.74.0.207", "node-0 taking web-7's IP for a pod that does not run there")
        .await;
    let text = ipwarden.scrape_controller(controller).await.unwrap_or_default();
    let aborted = support::metric_sum(&text, "ipwarden_gc_release_handshakes_total", &["step=\"aborted\""]);
    assert!(aborted >= 1.0, "the controller cleared the mark: {aborted}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_answers_only_the_takeover_mark_it_checked_not_one_written_since() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &[(POOL, json!({"cidr": CIDR, "default": true}))], &[]).await;
    // The hold keeps the controller's answer, decided on the first mark, from its write until
    // the mark has been written again for another claimant.
    let hold = ReleaseHold::start(&ipwarden.cluster.dir().join("answer-hold")).expect("answer hold");
    let hold_flag = hold.flag();
    let controller = ipwarden.start_controller("controller", &["--full-scan-interval-seconds=2", &hold_flag]);
    ipwarden.wait_leader(controller).await;
    let client = ipwarden.client();
    // web-8's new pod is bound to node-9, which runs no kubelet: a real claimant that waits for
    // its IPs. Its old record is node-8's, a node that is gone, so the controller answers. The
    // Node object keeps Kubernetes' pod GC from deleting a pod bound to a node that is not there.
    let node: Node = serde_json::from_value(json!({"metadata": {"name": "node-9"}})).expect("node");
    Api::<Node>::all(client.clone()).create(&PostParams::default(), &node).await.expect("node-9");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web-8", "namespace": NS},
        "spec": {"nodeName": "node-9", "containers": [{"name": "app", "image": "registry.invalid/ipwarden-test/app:1"}]},
    }))
    .expect("pod");
    let claimant =
        Api::<Pod>::namespaced(client.clone(), NS).create(&PostParams::default(), &pod).await.expect("web-8");
    let block = format!("{POOL}-{}", CIDR.replace(['.', '/'], "-"));
    let mark = |uid: &str, node: &str, at: &str| {
        json!({"state": "marked-for-release", "markedAt": at,
               "reason": format!("sticky takeover by pod {NS}/web-8 on node {node}"),
               "takeover": {"pod": {"namespace": NS, "name": "web-8", "uid": uid}, "node": node}})
    };
    let mut record = support::record_json(NS, "web-8", "web-8-old-uid", "node-8", Some(("StatefulSet", "web")), true);
    record["releaseHandshake"] = mark(&claimant.uid().unwrap_or_default(), "node-9", "2026-01-01T00:00:00Z");
    support::inject_record(&client, POOL, &block, CIDR, "10.74.0.208", record.clone()).await;
    wait::until("the controller's answer to the checked mark held", TIMEOUT, || async {
        if hold.holds_a_release() {
            return Ok(Probe::Done(()));
        }
        // A controller whose pod cache had not seen web-8 yet cleared the mark: ask again.
        if !matches!(record_of(&client, "10.74.0.208").await, Some((_, Some(HandshakeState::MarkedForRelease), _))) {
            support::inject_record(&client, POOL, &block, CIDR, "10.74.0.208", record.clone()).await;
        }
        Ok(Probe::Pending("not held yet".into()))
    })
    .await
    .expect("an answer held");

    // Marked again before the write, for a pod that does not exist (node-0 asking).
    record["releaseHandshake"] = mark("made-up-uid", "node-0", "2026-01-01T00:00:05Z");
    support::inject_record(&client, POOL, &block, CIDR, "10.74.0.208", record).await;
    drop(hold);
    assert_takeover_not_consented(&client, "10.74.0.208", "a claimant it never checked").await;
    let text = ipwarden.scrape_controller(controller).await.unwrap_or_default();
    let answered = support::metric_sum(&text, "ipwarden_gc_release_handshakes_total", &["step=\"answered_for_agent\""]);
    assert_eq!(answered, 0.0, "nothing answered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sticky_pod_takes_its_reservation_over_from_a_node_whose_agent_is_down_whatever_the_not_ready_policy() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let agent_args = ["--lease-duration-seconds=5", "--reuse-cooldown-seconds=0"];
    // The default NotReady policy, keep: an attached record of a node without a live agent
    // waits for that node; a reservation has no sandbox to wait for.
    let (mut ipwarden, controller, first) =
        web0_on_node0_of_two(&agent_args, &["--full-scan-interval-seconds=2"]).await;
    let client = ipwarden.client();
    let (ip, first_uid) = (ip_of(&first), first.uid().unwrap_or_default());

    // web-0 is deleted the ordinary way while no node may run its successor: its DEL leaves
    // node-0 a reservation. Then node-0's agent goes down, and node-1 opens.
    cordon(&client, "node-0", true).await;
    Api::<Pod>::namespaced(client.clone(), NS).delete("web-0", &DeleteParams::default()).await.expect("delete web-0");
    wait::until("web-0's DEL leaving a reservation on node-0", TIMEOUT, || async {
        let records = records(&client).await;
        Ok(match records.get(&ip) {
            Some(r) if r.pod.uid == first_uid && r.container_id.is_empty() => Probe::Done(()),
            other => Probe::Pending(format!("{:?}", other.map(|r| (&r.pod.uid, &r.container_id)))),
        })
    })
    .await
    .expect("reservation");
    ipwarden.agents[0].kill();
    cordon(&client, "node-1", false).await;

    let running = wait_web0(&client, &first_uid, "web-0 running on node-1").await;
    assert_eq!(ip_of(&running), ip, "web-0 keeps its IP");
    assert_eq!(running.spec.as_ref().and_then(|s| s.node_name.clone()).as_deref(), Some("node-1"));
    let text = ipwarden.scrape_controller(controller).await.unwrap_or_default();
    let answered = support::metric_sum(&text, "ipwarden_gc_release_handshakes_total", &["step=\"answered_for_agent\""]);
    assert!(answered >= 1.0, "the controller answered for node-0's agent: {answered}");
}
