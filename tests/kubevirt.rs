//! KubeVirt VMs on the real control plane with KubeVirt's real CRDs: a VM keeps its IP across
//! a restart and a live migration (the target inherits it; the source's late DEL neither frees
//! it nor deletes the claim), an aborted migration leaves it with the source, a target no
//! migration backs gets nothing and is detached by the controller, and a VM and a
//! StatefulSet pod of the same name never share a claim. The test plays virt-controller:
//! it creates the VMIs, migrations and virt-launcher pods as KubeVirt shapes them.

mod support;

use e2e::ipwarden::ReleaseHold;
use e2e::wait::{self, Probe};
use ipwarden::crd::{Allocation, IPBlock};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::kubevirt::{
    claims_of_vmi, complete_migration, create_launcher, create_migration, create_vm, create_vmi,
    record_migration_state, set_migration_phase, wait_running_with_ip,
};
use support::{Ipwarden, TIMEOUT, claims, ip_of, records, wait_pods_with_ips};

const NS: &str = "default";

/// Two nodes with agents on node-bound tokens under the chart's policies (so every migration
/// write below is one the apiserver lets a node make), a controller, one pool, and KubeVirt's
/// CRDs.
async fn start(cidr: &str) -> Ipwarden {
    start_with(cidr, &[]).await
}

/// [`start`], with `controller_args` added to the controller's.
async fn start_with(cidr: &str, controller_args: &[&str]) -> Ipwarden {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start_node_bound(2, &[("pool", json!({"cidr": cidr, "default": true}))], &[]).await;
    e2e::kubevirt::install_crds(&ipwarden.cluster, TIMEOUT).await.expect("KubeVirt CRDs install");
    let args: Vec<&str> =
        ["--full-scan-interval-seconds=2"].into_iter().chain(controller_args.iter().copied()).collect();
    let controller = ipwarden.start_controller("controller-0", &args);
    ipwarden.wait_leader(controller).await;
    ipwarden
}

/// The record of `ip`.
async fn record_of(client: &Client, ip: &str) -> Allocation {
    records(client).await.remove(ip).unwrap_or_else(|| panic!("{ip} has a record"))
}

/// Whether `ip` is on some block's released list (freed).
async fn released(client: &Client, ip: &str) -> bool {
    Api::<IPBlock>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("list blocks")
        .items
        .iter()
        .any(|b| b.spec.released.contains_key(ip))
}

/// Deletes pod `name` and waits until it is gone (its sandbox torn down, DEL done).
async fn delete_pod_and_wait(client: &Client, name: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.delete(name, &DeleteParams::default()).await.expect("delete pod");
    wait::until(&format!("pod {name} gone"), TIMEOUT, || async {
        let pod = pods.get_opt(name).await.map_err(e2e::Error::kube(format!("reading pod {name}")))?;
        Ok(if pod.is_none() { Probe::Done(()) } else { Probe::Pending("still there".into()) })
    })
    .await
    .expect("pod goes");
}

/// Virt-launcher `pod` exits (the VM stopped, or a migration's source finished): kubelet
/// records the phase, and the pod's DEL follows.
async fn launcher_exits(client: &Client, pod: &Pod) {
    Api::<Pod>::namespaced(client.clone(), NS)
        .patch_status(
            &pod.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
        )
        .await
        .expect("the launcher exits");
}

/// Waits until node `node`'s runtime has torn down pod `uid`'s sandbox (its CNI DEL ran).
async fn wait_sandbox_gone(ipwarden: &Ipwarden, node: usize, uid: &str) {
    let handle = &ipwarden.cluster.nodes()[node];
    wait::until(&format!("sandbox of {uid} torn down"), TIMEOUT, || async {
        Ok(if handle.sandboxes().contains_key(uid) { Probe::Pending("up".into()) } else { Probe::Done(()) })
    })
    .await
    .expect("sandbox torn down");
}

/// What `ipwarden check` reports now.
async fn problems(client: &Client) -> Vec<String> {
    let found = ipwarden::cli::check::problems(client).await.expect("check runs");
    found.into_iter().map(|p| format!("{:?} {}: {}", p.kind, p.subject, p.detail)).collect()
}

/// VM `name` started as virt-controller starts it: its VMI and a virt-launcher pod on `node`,
/// running with an IP, with its claim (`vm.<name>`) witnessed for that pod. Returns the VM and
/// the launcher pod. Every test here runs a controller, and once only the controller writes
/// claims (decision 0022) it creates the VM's a moment after the pod reports its IP, and a
/// later launcher's ADD (a restart's, a migration target's) takes back only witnessed IPs.
async fn run_vm(client: &Client, name: &str, node: &str) -> (DynamicObject, Pod) {
    let vm = create_vm(client, NS, name).await;
    let vmi = create_vmi(client, NS, &vm).await;
    let launcher = create_launcher(client, NS, &vmi, node, None).await;
    let launcher = wait_running_with_ip(client, NS, &launcher.name_any()).await;
    support::wait_witnessed(client, NS, &format!("vm.{name}"), &launcher.uid().unwrap_or_default()).await;
    (vm, launcher)
}

/// A VM started on node-0 (its claim witnessed for the source, [`run_vm`]) and then
/// live-migrating to node-1: returns (source, target, IP).
async fn vm_migrating(ipwarden: &Ipwarden, vm_name: &str) -> (Pod, Pod, String) {
    let client = ipwarden.client();
    let (_, source) = run_vm(&client, vm_name, "node-0").await;
    let ip = ip_of(&source);
    let migration = create_migration(&client, NS, &format!("{vm_name}-migration"), vm_name, "Scheduling").await;
    let vmi = support::kubevirt::api(&client, NS, "VirtualMachineInstance").get(vm_name).await.expect("read VMI");
    let target = create_launcher(&client, NS, &vmi, "node-1", migration.uid().as_deref()).await;
    let target = wait_running_with_ip(&client, NS, &target.name_any()).await;
    (source, target, ip)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_vm_gets_its_ip_back_on_a_new_launcher_pod() {
    let ipwarden = start("10.60.0.0/24").await;
    let client = ipwarden.client();
    let (vm, first) = run_vm(&client, "vm-r", "node-0").await;
    let ip = ip_of(&first);
    // The controller witnessed the VM's claim (a VM claim's witness in a real cluster).
    let seen = support::wait_witnessed(&client, NS, "vm.vm-r", &first.uid().unwrap_or_default()).await;
    assert_eq!(seen, std::slice::from_ref(&ip));

    // A restart: the launcher stops, virt-controller replaces the VMI (new UID, same name).
    delete_pod_and_wait(&client, &first.name_any()).await;
    let vmis = support::kubevirt::api(&client, NS, "VirtualMachineInstance");
    vmis.delete("vm-r", &DeleteParams::default()).await.expect("delete VMI");
    wait::until("old VMI gone", TIMEOUT, || async {
        let vmi = vmis.get_opt("vm-r").await.map_err(e2e::Error::kube("reading VMI vm-r"))?;
        Ok(if vmi.is_none() { Probe::Done(()) } else { Probe::Pending("still there".into()) })
    })
    .await
    .expect("VMI goes");
    assert!(!released(&client, &ip).await, "the VM's IP stays reserved while the VM exists");
    let vmi = create_vmi(&client, NS, &vm).await;
    let second = create_launcher(&client, NS, &vmi, "node-1", None).await;
    let second = wait_running_with_ip(&client, NS, &second.name_any()).await;

    assert_eq!(ip_of(&second), ip, "the restarted VM has its IP back");
    let uid = second.uid().unwrap_or_default();
    assert_eq!(record_of(&client, &ip).await.pod.uid, uid, "the record names the new launcher");
    // The claim is read once the controller has written down the new launcher's binding, a
    // moment after its ADD (decision 0022: the controller writes the claims).
    support::wait_witnessed(&client, NS, "vm.vm-r", &uid).await;
    let vm_claims = claims_of_vmi(&client, NS, "vm-r").await;
    assert_eq!(vm_claims.len(), 1, "one claim for the VM");
    assert_eq!(vm_claims[0].spec.pod_uid, uid, "the VM's claim is bound to the new launcher");
    assert_eq!(problems(&client).await, Vec::<String>::new(), "ipwarden check is clean");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_migration_target_inherits_the_vm_ip_and_the_source_late_del_frees_nothing() {
    let ipwarden = start("10.61.0.0/24").await;
    let client = ipwarden.client();
    let (source, target, ip) = vm_migrating(&ipwarden, "vm-m").await;
    let (source_uid, target_uid) = (source.uid().unwrap_or_default(), target.uid().unwrap_or_default());
    assert_eq!(ip_of(&target), ip, "the migration target gets the VM's IP");

    // During the migration both launchers hold the IP by design: nothing flags or frees it.
    ipwarden.wait_sweeps(0, 2).await;
    assert_eq!(problems(&client).await, Vec::<String>::new(), "ipwarden check is clean during the migration");
    let during = record_of(&client, &ip).await;
    assert_eq!(during.pod.uid, source_uid, "the source stays the record's pod while it runs");
    let attached = during.migration_target.as_ref().map(|t| (t.pod.uid.as_str(), t.node.as_str()));
    assert_eq!(attached, Some((target_uid.as_str(), "node-1")), "the target is attached as the migration's target");

    // The source's virt-launcher exits before KubeVirt has recorded the migration's end in the
    // VMI: the source's DEL waits (fails, and the runtime retries it), handing nothing over.
    record_migration_state(&client, NS, "vm-m-migration", "vm-m", &target, false).await;
    launcher_exits(&client, &source).await;
    wait::until("the source's DEL waiting for the migration's end", TIMEOUT, || async {
        let waiting =
            support::metric(&ipwarden.scrape_agent(0).await, r#"ipwarden_agent_releases_total{result="waiting"}"#);
        Ok(if waiting >= 1.0 { Probe::Done(()) } else { Probe::Pending(format!("{waiting} waits")) })
    })
    .await
    .expect("DEL waits");
    let waiting = record_of(&client, &ip).await;
    assert_eq!(waiting.pod.uid, source_uid, "nothing handed over before KubeVirt says the migration completed");
    assert!(!waiting.container_id.is_empty(), "the source's record is left as it was");

    // KubeVirt records the end: the retried DEL hands the record to the target.
    complete_migration(&client, NS, "vm-m-migration", "vm-m", &target).await;
    wait_sandbox_gone(&ipwarden, 0, &source_uid).await;
    let after = record_of(&client, &ip).await;
    assert_eq!((after.pod.uid.as_str(), after.node.as_str()), (target_uid.as_str(), "node-1"), "the target holds it");
    assert!(!after.container_id.is_empty(), "the target's sandbox is the record's");
    assert!(after.migration_target.is_none(), "no second attachment once the source left");
    assert!(!released(&client, &ip).await, "the source's DEL did not free the IP");
    // The source has exited and holds no record since the handover: the target is the one
    // launcher pod holding the VM's, so the controller's witness follows it, and the claim is
    // read once it did (decision 0022: the controller writes the claims).
    support::wait_witnessed(&client, NS, "vm.vm-m", &target_uid).await;
    let vm_claims = claims_of_vmi(&client, NS, "vm-m").await;
    assert_eq!(vm_claims.len(), 1, "the source's DEL did not delete the VM's claim");
    assert_eq!(vm_claims[0].spec.pod_uid, target_uid, "the claim follows the target");

    delete_pod_and_wait(&client, &source.name_any()).await;
    ipwarden.wait_sweeps(0, 2).await;
    assert_eq!(record_of(&client, &ip).await.pod.uid, target_uid, "the IP stays with the target");
    assert_eq!(problems(&client).await, Vec::<String>::new(), "ipwarden check is clean after the migration");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_migration_in_a_pool_being_deleted_keeps_the_vms_ip() {
    let ipwarden = start("10.63.0.0/24").await;
    let client = ipwarden.client();
    let (_, source) = run_vm(&client, "vm-d", "node-0").await;
    let ip = ip_of(&source);
    // The VM's record holds the pool; another pool now takes the new pods.
    support::delete_pool_in_use(&client, "pool").await;
    e2e::ipwarden::create_pool(&client, "spare", json!({"cidr": "10.64.0.0/24", "default": true}))
        .await
        .expect("create pool spare");

    let migration = create_migration(&client, NS, "vm-d-migration", "vm-d", "Scheduling").await;
    let vmi = support::kubevirt::api(&client, NS, "VirtualMachineInstance").get("vm-d").await.expect("read VMI");
    let target = create_launcher(&client, NS, &vmi, "node-1", migration.uid().as_deref()).await;
    let target = wait_running_with_ip(&client, NS, &target.name_any()).await;
    assert_eq!(ip_of(&target), ip, "a migration is not a new IP: the target shares the source's");
    let record = record_of(&client, &ip).await;
    let attached = record.migration_target.as_ref().map(|t| t.pod.uid.clone());
    assert_eq!(attached, target.uid(), "the target is attached to the source's record");
    let vm_claims = claims_of_vmi(&client, NS, "vm-d").await;
    let claimed: Vec<&str> =
        vm_claims.iter().flat_map(|c| &c.spec.interfaces).flat_map(|i| &i.ips).map(|i| i.ip.as_str()).collect();
    assert_eq!(claimed, [ip.as_str()], "the VM's claim still names its IP");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_migration_leaves_the_ip_with_the_source_and_the_target_del_frees_nothing() {
    let ipwarden = start("10.62.0.0/24").await;
    let client = ipwarden.client();
    let before_ip = {
        let (source, target, ip) = vm_migrating(&ipwarden, "vm-a").await;
        let source_uid = source.uid().unwrap_or_default();
        let source_container = ipwarden.cluster.nodes()[0].sandboxes()[&source_uid].container_id.clone();
        assert_eq!(ip_of(&target), ip, "the migration target gets the VM's IP");

        // The migration fails: virt-controller deletes the target pod, whose DEL follows.
        set_migration_phase(&client, NS, "vm-a-migration", "Failed").await;
        delete_pod_and_wait(&client, &target.name_any()).await;
        let after = record_of(&client, &ip).await;
        assert_eq!(after.pod.uid, source_uid, "the source keeps the IP");
        assert_eq!(after.container_id, source_container, "the source's sandbox still holds it");
        assert_eq!(after.node, "node-0", "on the source's node");
        assert!(after.migration_target.is_none(), "the aborted target is detached");
        assert!(!released(&client, &ip).await, "the target's DEL did not free the IP");
        let vm_claims = claims_of_vmi(&client, NS, "vm-a").await;
        assert_eq!(vm_claims.len(), 1, "the VM's claim stays");
        assert_eq!(vm_claims[0].spec.pod_uid, source_uid, "bound to the source");
        ip
    };
    ipwarden.wait_sweeps(0, 2).await;
    assert!(!released(&client, &before_ip).await, "the controller does not free it either");
    assert_eq!(problems(&client).await, Vec::<String>::new(), "ipwarden check is clean after the abort");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_and_a_statefulset_pod_both_named_web_0_get_separate_claims_and_distinct_ips() {
    let ipwarden = start("10.63.0.0/24").await;
    let client = ipwarden.client();
    let (_, launcher) = run_vm(&client, "web-0", "node-1").await;
    let sts: StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 1, "serviceName": "web", "selector": {"matchLabels": {"app": "web"}},
                 "template": support::pod_template("web", json!({}))},
    }))
    .expect("statefulset");
    Api::<StatefulSet>::namespaced(client.clone(), NS).create(&PostParams::default(), &sts).await.expect("create sts");
    let pods = wait_pods_with_ips(&client, NS, "app=web", 1).await;
    let web = &pods["web-0"];
    // The claims are read once the controller witnessed each for its pod (the VM's in
    // [`run_vm`]): it creates them a moment after the pods report their IPs (decision 0022).
    support::wait_witnessed(&client, NS, "web-0", &web.uid().unwrap_or_default()).await;

    assert_ne!(ip_of(web), ip_of(&launcher), "distinct IPs");
    let vm_claims = claims_of_vmi(&client, NS, "web-0").await;
    assert_eq!(vm_claims.len(), 1, "the VM has its own claim");
    assert_eq!(vm_claims[0].spec.pod_uid, launcher.uid().unwrap_or_default(), "bound to the launcher");
    assert_eq!(vm_claims[0].spec.interfaces[0].ips[0].ip, ip_of(&launcher), "with the VM's IP");
    let all = claims(&client, NS).await;
    let web_claim = all.get("web-0").expect("the StatefulSet pod's claim is named after it");
    assert_eq!(web_claim.spec.pod_uid, web.uid().unwrap_or_default(), "bound to the StatefulSet pod");
    assert_eq!(web_claim.spec.interfaces[0].ips[0].ip, ip_of(web), "with the pod's IP");
    assert_ne!(vm_claims[0].name_any(), "web-0", "the VM's claim is not the pod's");
    assert_eq!(problems(&client).await, Vec::<String>::new(), "ipwarden check is clean");
}

/// Deletes KubeVirt object `kind`/`name` and waits until it is gone.
async fn delete_kubevirt_and_wait(client: &Client, kind: &str, name: &str) {
    let api = support::kubevirt::api(client, NS, kind);
    api.delete(name, &DeleteParams::default()).await.expect("delete KubeVirt object");
    wait::until(&format!("{kind} {name} gone"), TIMEOUT, || async {
        let object = api.get_opt(name).await.map_err(e2e::Error::kube(format!("reading {kind} {name}")))?;
        Ok(if object.is_none() { Probe::Done(()) } else { Probe::Pending("still there".into()) })
    })
    .await
    .expect("KubeVirt object goes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_deleted_while_its_del_was_lost_has_its_record_and_claim_reclaimed_by_the_controller() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &[("pool", json!({"cidr": "10.64.0.0/24", "default": true}))], &[]).await;
    // The controller starts before KubeVirt is installed and notices its API later.
    let controller = ipwarden.start_controller("controller-0", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(controller).await;
    e2e::kubevirt::install_crds(&ipwarden.cluster, TIMEOUT).await.expect("KubeVirt CRDs install");
    let client = ipwarden.client();
    let (_, launcher) = run_vm(&client, "vm-gone", "node-0").await;
    let ip = ip_of(&launcher);
    assert_eq!(claims_of_vmi(&client, NS, "vm-gone").await.len(), 1, "the VM has a claim");

    // The VM is deleted; its launcher's sandbox goes without a DEL reaching ipwarden.
    let node = &ipwarden.cluster.nodes()[0];
    node.faults().set_skip_del(true);
    delete_pod_and_wait(&client, &launcher.name_any()).await;
    wait_sandbox_gone(&ipwarden, 0, &launcher.uid().unwrap_or_default()).await;
    node.faults().set_skip_del(false);
    delete_kubevirt_and_wait(&client, "VirtualMachineInstance", "vm-gone").await;
    delete_kubevirt_and_wait(&client, "VirtualMachine", "vm-gone").await;

    wait::until("the gone VM's record and claim reclaimed", TIMEOUT, || async {
        let record = support::records(&client).await.contains_key(&ip);
        let claimed = claims_of_vmi(&client, NS, "vm-gone").await.len();
        Ok(if !record && claimed == 0 {
            Probe::Done(())
        } else {
            Probe::Pending(format!("record held {record}, {claimed} claims"))
        })
    })
    .await
    .expect("the controller reclaims a gone VM's IP and claim");
    assert!(released(&client, &ip).await, "the IP is free again");
    assert_eq!(problems(&client).await, Vec::<String>::new(), "ipwarden check is clean");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_vm_whose_instance_stopped_keeps_its_reservation_and_claim() {
    let ipwarden = start("10.65.0.0/24").await;
    let client = ipwarden.client();
    let (_, launcher) = run_vm(&client, "vm-stopped", "node-0").await;
    let ip = ip_of(&launcher);
    let uid = launcher.uid().unwrap_or_default();

    // The VM is stopped: its instance and launcher go, the VirtualMachine stays.
    delete_pod_and_wait(&client, &launcher.name_any()).await;
    delete_kubevirt_and_wait(&client, "VirtualMachineInstance", "vm-stopped").await;
    ipwarden.wait_sweeps(0, 3).await;

    let record = record_of(&client, &ip).await;
    assert_eq!((record.pod.uid.as_str(), record.sticky), (uid.as_str(), true), "the reservation stays");
    let vm_claims = claims_of_vmi(&client, NS, "vm-stopped").await;
    assert_eq!(vm_claims.len(), 1, "the VM's claim stays");
    assert!(!released(&client, &ip).await, "the IP is not freed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_migration_target_gets_nothing_from_the_source_and_the_controller_detaches_it() {
    // The hold keeps the controller from detaching the forged target until the source has left,
    // so that the source's DEL meets it.
    let hold_path = std::env::temp_dir().join(format!("ipwarden-kubevirt-hold-{}", std::process::id()));
    let hold = ReleaseHold::start(&hold_path).expect("controller hold");
    let ipwarden = start_with("10.65.0.0/24", &[&hold.flag()]).await;
    let client = ipwarden.client();
    let (_, source) = run_vm(&client, "vm-f", "node-0").await;
    let (ip, source_uid) = (ip_of(&source), source.uid().unwrap_or_default());

    // node-1 attaches a target of its own to the VM's record, for no migration KubeVirt runs and
    // no pod (a write the node-bound policy lets a node make: it cannot read the migration).
    let blocks: Api<IPBlock> = Api::all(client.clone());
    let mut block = blocks
        .list(&ListParams::default())
        .await
        .expect("list blocks")
        .items
        .into_iter()
        .find(|b| b.spec.allocations.contains_key(&ip))
        .expect("the VM's block");
    let forged = json!({"migrationUid": "no-such-migration", "node": "node-1", "containerId": "forged", "interface": "eth0",
                        "pod": {"namespace": NS, "name": "virt-launcher-vm-f-forged", "uid": "forged-uid"}});
    if let Some(record) = block.spec.allocations.get_mut(&ip) {
        record.migration_target = Some(serde_json::from_value(forged).expect("target"));
    }
    blocks.replace(&block.name_any(), &PostParams::default(), &block).await.expect("attach the forged target");
    wait::until("the controller's detach of the forged target held", TIMEOUT, || async {
        Ok(if hold.holds_a_release() { Probe::Done(()) } else { Probe::Pending("not held yet".into()) })
    })
    .await
    .expect("the controller decides to detach a target no pod backs");

    // The VM stops: its launcher exits and the source's DEL comes.
    launcher_exits(&client, &source).await;
    wait_sandbox_gone(&ipwarden, 0, &source_uid).await;
    let after = record_of(&client, &ip).await;
    assert_eq!(
        (after.pod.uid.as_str(), after.node.as_str()),
        (source_uid.as_str(), "node-0"),
        "the record stays the VM's, on its node: {after:?}"
    );
    assert!(after.container_id.is_empty(), "kept as the VM's reservation");
    assert_eq!(
        after.migration_target.map(|t| t.pod.uid),
        Some("forged-uid".to_string()),
        "the forged target gets nothing; the source leaves it attached, so no node can free the IP under a real one"
    );

    // The controller re-reads the target's pod live, finds none, and detaches the target, so
    // that it blocks neither the VM's restart nor its next migration.
    drop(hold);
    wait::until("the forged target detached", TIMEOUT, || async {
        let record = record_of(&client, &ip).await;
        Ok(match record.migration_target {
            None => Probe::Done(record),
            Some(target) => Probe::Pending(format!("still attached: {}", target.pod.uid)),
        })
    })
    .await
    .map(|record| {
        assert_eq!(record.pod.uid, source_uid, "detaching the target leaves the VM's reservation: {record:?}");
        assert!(record.container_id.is_empty() && record.node == "node-0", "{record:?}");
    })
    .expect("the controller detaches a target no pod backs");
    let detached = support::metric(
        &ipwarden.scrape_controller(0).await.unwrap_or_default(),
        r#"ipwarden_gc_migration_targets_detached_total{pool="pool"}"#,
    );
    assert_eq!(detached, 1.0, "counted once");
    assert!(!released(&client, &ip).await, "not freed: the VM lives");
}
