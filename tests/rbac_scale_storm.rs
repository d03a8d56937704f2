//! RBAC proven under load: agents and two controller replicas run as the chart's
//! ServiceAccounts (tokens the apiserver issued, bound only by the chart's rendered RBAC)
//! through a StatefulSet scale storm on a pool of exactly 5 IPs. Two StatefulSets of 5
//! compete: one is scaled to 0 and the other created (later: scaled up) while the first's pods
//! still terminate, then the first is scaled back; the chaos suites' invariant checker (the
//! code of `ipwarden check`, every second) runs all along, and the cluster must settle with
//! no problem left. Leaks injected in another pool (a pod's, and a deleted KubeVirt VM's with
//! KubeVirt's CRDs installed) must be reclaimed too. A missing rule shows up as a 403 in a
//! log, a process that exits, or a storm that never settles.

mod support;

use std::collections::{BTreeMap, BTreeSet};

use e2e::ipwarden::RunAs;
use e2e::wait::{self, Probe};
use ipwarden::crd::{IPBlock, IPPool};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::invariants::{InvariantChecker, wait_settled};
use support::{Ipwarden, TIMEOUT, claims, inject_record, ip_of, network, pods_with_ips, record_json};

/// The chart's release namespace in this test.
const SYSTEM: &str = "ipwarden-system";
/// Where the StatefulSets run.
const NS: &str = "default";
/// Storm rounds (each: alpha 5 -> 0 with beta 0 -> 5, then beta 5 -> 0 with alpha 0 -> 5).
const ROUNDS: usize = 2;
const REPLICAS: i32 = 5;

fn statefulset(name: &str, replicas: i32) -> StatefulSet {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "serviceName": name, "podManagementPolicy": "Parallel",
                 "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name, "storm": "true"}},
                              "spec": {"terminationGracePeriodSeconds": 1,
                                       "containers": [{"name": "app", "image": "registry.invalid/storm:1"}]}}},
    }))
    .expect("statefulset")
}

async fn scale(client: &Client, name: &str, replicas: i32) {
    let patch = json!({"spec": {"replicas": replicas}});
    Api::<StatefulSet>::namespaced(client.clone(), NS)
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap_or_else(|e| panic!("scaling {name} to {replicas}: {e}"));
}

/// Waits until `name` runs `count` pods with IPs, and no pod of the other set runs.
async fn wait_running(client: &Client, name: &str, other: &str) {
    wait::until(&format!("{REPLICAS} pods of {name} with IPs, none of {other}"), TIMEOUT, || async {
        let running = pods_with_ips(client, NS, &format!("app={name}")).await?.len();
        let others = pods_with_ips(client, NS, &format!("app={other}")).await?.len();
        Ok(if running == REPLICAS as usize && others == 0 {
            Probe::Done(())
        } else {
            Probe::Pending(format!("{name}: {running}, {other}: {others}"))
        })
    })
    .await
    .expect("the storm round completes");
}

/// How many pods of `name` exist (terminating or not).
async fn existing(client: &Client, name: &str) -> usize {
    let pods = Api::<Pod>::namespaced(client.clone(), NS);
    pods.list(&ListParams::default().labels(&format!("app={name}"))).await.expect("list pods").items.len()
}

/// Every record of the storm pool: IP -> pod UID.
async fn storm_records(client: &Client) -> Result<BTreeMap<String, String>, kube::Error> {
    let blocks = Api::<IPBlock>::all(client.clone()).list(&ListParams::default()).await?;
    Ok(blocks
        .items
        .into_iter()
        .filter(|b| b.spec.pool == "storm")
        .flat_map(|b| b.spec.allocations.into_iter().map(|(ip, a)| (ip, a.pod.uid)))
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_and_controllers_with_the_charts_rbac_survive_a_statefulset_scale_storm_on_five_ips() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pools = [
        (
            "storm",
            // The churn benchmark's storm pool: five IPs.
            e2e::storm::pool(),
        ),
        ("spare", json!({"cidr": "10.61.0.0/24"})),
    ];
    let mut ipwarden = Ipwarden::without_agents(3, &pools, network()).await;
    let client = ipwarden.client();
    support::apply_chart_rbac(&ipwarden, SYSTEM).await;
    e2e::kubevirt::install_crds(&ipwarden.cluster, TIMEOUT).await.expect("KubeVirt CRDs install");
    let agent_kubeconfig =
        e2e::accounts::kubeconfig_for(&ipwarden.cluster, SYSTEM, "ipwarden-agent").await.expect("token");
    let controller_kubeconfig =
        e2e::accounts::kubeconfig_for(&ipwarden.cluster, SYSTEM, "ipwarden-controller").await.expect("token");

    // The identities are really limited: nothing outside the chart's rules is allowed.
    let agent_client = e2e::controlplane::client_for(&agent_kubeconfig).await.expect("agent client");
    let denied = Api::<Secret>::all(agent_client.clone()).list(&ListParams::default()).await;
    assert!(
        matches!(denied, Err(kube::Error::Api(ref s)) if s.code == 403),
        "the agent cannot list Secrets: {denied:?}"
    );
    // Pool conditions are the controller's to write (decision 0022): no node's agent sets them.
    let conditions = json!({"apiVersion": "ipwarden.io/v1alpha1", "kind": "IPPool", "status": {"conditions": []}});
    let denied = Api::<IPPool>::all(agent_client)
        .patch_status("storm", &PatchParams::apply("decoy").force(), &Patch::Apply(&conditions))
        .await;
    assert!(
        matches!(denied, Err(kube::Error::Api(ref s)) if s.code == 403),
        "the agent cannot write a pool's status: {denied:?}"
    );
    let controller_client = e2e::controlplane::client_for(&controller_kubeconfig).await.expect("controller client");
    let block = IPBlock::new("forbidden", ipwarden::crd::IPBlockSpec { pool: "storm".into(), ..Default::default() });
    let denied = Api::<IPBlock>::all(controller_client).create(&PostParams::default(), &block).await;
    assert!(
        matches!(denied, Err(kube::Error::Api(ref s)) if s.code == 403),
        "the controller cannot create blocks: {denied:?}"
    );

    // Each agent on a token bound to a pod on its node, as the chart's DaemonSet pods get, so
    // the chart's node-bound write policies apply to every write of the storm.
    ipwarden.run_agents_as_chart_account(SYSTEM).await;
    ipwarden.start_agents(&["--reuse-cooldown-seconds=1"]).await;
    ipwarden.controller_run_as = Some(RunAs { kubeconfig: controller_kubeconfig, namespace: SYSTEM.into() });
    for identity in ["storm-a", "storm-b"] {
        ipwarden.start_controller(identity, &["--full-scan-interval-seconds=5", "--claim-janitor-interval-seconds=2"]);
    }
    let leases: Api<Lease> = Api::namespaced(client.clone(), SYSTEM);
    let holder = wait::until("a controller holds the Lease", TIMEOUT, || async {
        let lease = leases.get_opt("ipwarden-controller").await.map_err(e2e::Error::kube("reading the Lease"))?;
        Ok(match lease.and_then(|l| l.spec).and_then(|s| s.holder_identity) {
            Some(holder) => Probe::Done(holder),
            None => Probe::Pending("no holder".into()),
        })
    })
    .await
    .expect("a leader is elected");
    assert!(holder.starts_with("storm-"), "one of the two replicas leads: {holder}");

    // A leak in another pool, found by a sweep: the controller's release, Event and status
    // writes all go through its RBAC.
    let ghost = record_json(NS, "ghost", "ghost-uid", "node-0", None, false);
    inject_record(&client, "spare", "spare-10-61-0-0-24", "10.61.0.0/24", "10.61.0.9", ghost).await;
    // A deleted VM's reservation: freed only through the KubeVirt cache and the live re-read of
    // the VM before the release.
    let gone_vm = record_json(
        NS,
        "virt-launcher-gone-vm-x",
        "gone-vm-uid",
        "node-0",
        Some(("VirtualMachineInstance", "gone-vm")),
        true,
    );
    inject_record(&client, "spare", "spare-10-61-0-0-24", "10.61.0.0/24", "10.61.0.10", gone_vm).await;

    let checker = InvariantChecker::start(client.clone());

    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), NS);
    statefulsets.create(&PostParams::default(), &statefulset("alpha", REPLICAS)).await.expect("create alpha");
    wait_running(&client, "alpha", "beta").await;
    for round in 0..ROUNDS {
        scale(&client, "alpha", 0).await;
        if round == 0 {
            statefulsets.create(&PostParams::default(), &statefulset("beta", REPLICAS)).await.expect("create beta");
        } else {
            scale(&client, "beta", REPLICAS).await;
        }
        assert!(existing(&client, "alpha").await > 0, "round {round}: beta starts while alpha's pods still exist");
        wait_running(&client, "beta", "alpha").await;
        scale(&client, "beta", 0).await;
        scale(&client, "alpha", REPLICAS).await;
        assert!(existing(&client, "beta").await > 0, "round {round}: alpha comes back while beta's pods still exist");
        wait_running(&client, "alpha", "beta").await;
    }

    // Settled: the records are exactly the running pods, and only their claims are left, each
    // witnessed for its pod by the controller (a status write its chart account must be let
    // make).
    let settled = wait::until("records == running pods, claims only theirs and witnessed, the leak reclaimed", TIMEOUT, || async {
        let running = pods_with_ips(&client, NS, "storm=true").await?;
        let expected: BTreeMap<String, String> =
            running.values().map(|p| (ip_of(p), p.uid().unwrap_or_default())).collect();
        let records = storm_records(&client).await.map_err(e2e::Error::kube("listing blocks"))?;
        let all_claims = claims(&client, NS).await;
        let claimed: BTreeSet<String> = all_claims.keys().cloned().collect();
        let witnessed = running.iter().all(|(name, pod)| {
            let seen = all_claims.get(name).and_then(|c| c.status.as_ref()).and_then(|s| s.witnessed.as_ref());
            seen.is_some_and(|w| Some(w.pod_uid.as_str()) == pod.uid().as_deref())
        });
        let running_names: BTreeSet<String> = running.keys().cloned().collect();
        let spare = support::records(&client).await.keys().any(|ip| ip == "10.61.0.9" || ip == "10.61.0.10");
        Ok(if records == expected && claimed == running_names && witnessed && running.len() == REPLICAS as usize && !spare {
            Probe::Done(running_names)
        } else {
            Probe::Pending(format!("records {records:?}, running {expected:?}, claims {claimed:?} (witnessed {witnessed}), leak held {spare}"))
        })
    })
    .await
    .expect("the storm settles");
    assert_eq!(settled, (0..REPLICAS).map(|i| format!("alpha-{i}")).collect(), "alpha runs, beta is gone");

    checker.finish().await;
    wait_settled(&client, TIMEOUT).await;

    // Writes only the controller's identity makes: the release Event and the pool's counts.
    let events = Api::<Event>::namespaced(client.clone(), NS).list(&ListParams::default()).await.expect("events");
    assert!(
        events.items.iter().any(|e| e.reason.as_deref() == Some("IPReleased")
            && e.reporting_controller.as_deref() == Some("ipwarden-controller")),
        "the controller published the release Event"
    );
    wait::until("the storm pool's status counts", TIMEOUT, || async {
        let pool = Api::<IPPool>::all(client.clone()).get("storm").await.map_err(e2e::Error::kube("reading pool"))?;
        let counts = pool.status.map(|s| (s.total, s.allocated));
        Ok(if counts == Some((5, 5)) { Probe::Done(()) } else { Probe::Pending(format!("{counts:?}")) })
    })
    .await
    .expect("the controller writes pool status");

    // The pool-in-use finalizer: put on by the controller, and taken off the emptied spare
    // pool after its blocks are deleted, all through the chart's RBAC.
    let pools: Api<IPPool> = Api::all(client.clone());
    wait::until("the finalizer on the spare pool", TIMEOUT, || async {
        let pool = pools.get("spare").await.map_err(e2e::Error::kube("reading pool"))?;
        let finalizers = pool.finalizers().to_vec();
        Ok(if finalizers.iter().any(|f| f == ipwarden::crd::POOL_FINALIZER) {
            Probe::Done(())
        } else {
            Probe::Pending(format!("{finalizers:?}"))
        })
    })
    .await
    .expect("the controller puts its finalizer on");
    pools.delete("spare", &Default::default()).await.expect("delete the spare pool");
    wait::until("the spare pool and its blocks gone", TIMEOUT, || async {
        let pool = pools.get_opt("spare").await.map_err(e2e::Error::kube("reading pool"))?.is_some();
        let block = Api::<IPBlock>::all(client.clone())
            .get_opt("spare-10-61-0-0-24")
            .await
            .map_err(e2e::Error::kube("reading block"))?
            .is_some();
        Ok(if !pool && !block { Probe::Done(()) } else { Probe::Pending(format!("pool {pool}, block {block}")) })
    })
    .await
    .expect("the controller releases the finalizer");

    // Each agent's heartbeat Lease, written under the agent's ServiceAccount.
    for node in ipwarden.cluster.nodes() {
        let name = ipwarden::agent::heartbeat::lease_name(node.name());
        let holder = leases.get_opt(&name).await.expect("read agent Lease").and_then(|l| l.spec?.holder_identity);
        assert!(holder.is_some(), "the agent of {} renews its Lease {SYSTEM}/{name}", node.name());
    }
    for component in ipwarden.agents.iter_mut().chain(ipwarden.controllers.iter_mut()) {
        component.ensure_running().expect("every agent and controller still runs");
        let log = std::fs::read_to_string(component.log()).expect("read log");
        let denied: Vec<&str> = log.lines().filter(|l| l.to_lowercase().contains("forbidden")).take(3).collect();
        assert!(denied.is_empty(), "{} was never denied by RBAC: {denied:#?}", component.name());
    }
}
