//! The chart's node-bound write policies on the real control plane (decision 0022,
//! docs/rbac.md "What an agent on node N may write"): with tokens bound to pods on named
//! nodes, as kubelet mints for the chart's DaemonSet pods, node A's agent is refused every
//! write to node B's state that B (or the controller) did not agree to, each refusal naming
//! its rule, while every shape of write an agent makes, and the controller's writes, pass.
//! One exception is asserted as such: taking over a claim of a pod on B for a pod on A passes
//! (a claim policy cannot read the records; decision 0022 moves the claims to the controller).
//!
//! Every write is a dry run: it goes through admission (the policies) and stores nothing, so
//! each row starts from the same blocks.

mod support;

use std::path::Path;

use e2e::wait::{self, Probe};
use ipwarden::crd::{IPBlock, IPBlockSpec, IPClaim};
use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use support::{Ipwarden, record_json};

const SYSTEM: &str = "ipwarden-system";
const NS: &str = "default";
const A: &str = "node-0";
const B: &str = "node-1";
const POOL: &str = "bound";
const A_BLOCK: &str = "bound-10-74-0-0-26";
const B_BLOCK: &str = "bound-10-74-0-64-26";
/// An empty block of the pool that no node holds.
const FREE_BLOCK: &str = "bound-10-74-0-192-26";
const STAMP: &str = "2026-01-01T00:00:00Z";

/// A record of pod `name` (uid `<name>-uid`) on `node`, attached to a sandbox.
fn record(name: &str, node: &str, owner: Option<(&str, &str)>, sticky: bool) -> Value {
    record_json(NS, name, &format!("{name}-uid"), node, owner, sticky)
}

fn set_of_statefulset(name: &str, node: &str) -> Value {
    record(name, node, Some(("StatefulSet", "web")), true)
}

/// A handshake on a record: `state`, with a takeover by pod `claimant` (uid `uid`) on `node`.
fn handshake(state: &str, takeover: Option<(&str, &str, &str)>) -> Value {
    let mut handshake = json!({"state": state, "markedAt": STAMP, "reason": "test"});
    if let Some((claimant, uid, node)) = takeover {
        handshake["takeover"] = json!({"pod": {"namespace": NS, "name": claimant, "uid": uid}, "node": node});
    }
    handshake
}

/// The blocks every row starts from.
fn blocks() -> Vec<(&'static str, Value)> {
    let mut b = serde_json::Map::new();
    // B's live StatefulSet pod.
    b.insert("10.74.0.65".into(), set_of_statefulset("web-1", B));
    // B's reservation: web-2's pod is gone and B's DEL kept the IP for its next pod.
    let mut reservation = set_of_statefulset("web-2", B);
    reservation["containerId"] = json!("");
    b.insert("10.74.0.66".into(), reservation);
    // B answered ready-for-release to web-3's takeover from A.
    let mut answered = set_of_statefulset("web-3", B);
    answered["releaseHandshake"] = handshake("ready-for-release", Some(("web-3", "web-3-new-uid", A)));
    b.insert("10.74.0.67".into(), answered);
    // B answered ready-for-release to another pod's takeover.
    let mut other = set_of_statefulset("web-4", B);
    other["releaseHandshake"] = handshake("ready-for-release", Some(("web-4", "web-4-other-uid", A)));
    b.insert("10.74.0.68".into(), other);
    // The controller marked B's record; B has not answered.
    let mut marked = set_of_statefulset("web-5", B);
    marked["releaseHandshake"] = handshake("marked-for-release", None);
    b.insert("10.74.0.69".into(), marked);
    // A KubeVirt VM running on B.
    b.insert("10.74.0.70".into(), record("virt-launcher-vm-src", B, Some(("VirtualMachineInstance", "vm")), true));
    // A VM's reservation on B whose live migration to a third node is under way.
    let mut migrating = record("virt-launcher-vm2-src", B, Some(("VirtualMachineInstance", "vm2")), true);
    migrating["containerId"] = json!("");
    migrating["migrationTarget"] = json!({"migrationUid": "m2", "node": "node-2", "containerId": "t2", "interface": "eth0",
                                          "pod": {"namespace": NS, "name": "virt-launcher-vm2-dst", "uid": "vm2-dst-uid"}});
    b.insert("10.74.0.71".into(), migrating);
    // B's reservation of an IP from Deployment api's ipwarden.io/ip-list, held for the workload.
    let mut listed = record("api-old", B, Some(("ReplicaSet", "api-1")), false);
    listed["containerId"] = json!("");
    listed["heldFor"] = json!({"kind": "Deployment", "name": "api"});
    b.insert("10.74.0.72".into(), listed);
    let mut a = serde_json::Map::new();
    a.insert("10.74.0.5".into(), record("app-a", A, None, false));
    vec![
        (A_BLOCK, json!({"pool": POOL, "cidr": "10.74.0.0/26", "affinity": A, "allocations": a})),
        (
            B_BLOCK,
            json!({"pool": POOL, "cidr": "10.74.0.64/26", "affinity": B, "allocations": b, "spares": ["10.74.0.80"]}),
        ),
        (FREE_BLOCK, json!({"pool": POOL, "cidr": "10.74.0.192/26"})),
    ]
}

async fn create_blocks(client: &Client) {
    let api: Api<IPBlock> = Api::all(client.clone());
    for (name, spec) in blocks() {
        let spec: IPBlockSpec = serde_json::from_value(spec).expect("block spec");
        api.create(&PostParams::default(), &IPBlock::new(name, spec)).await.expect("create block");
    }
}

/// A write to a block: `block` read by the admin, changed by `edit`, replaced (a dry run)
/// with `client`'s identity, as the agent's compare-and-swap does.
async fn update(
    admin: &Client,
    client: &Client,
    block: &str,
    edit: impl FnOnce(&mut Value),
) -> Result<(), kube::Error> {
    let current = Api::<IPBlock>::all(admin.clone()).get(block).await.expect("read block");
    let mut object = serde_json::to_value(&current).expect("block JSON");
    edit(&mut object["spec"]);
    let edited: IPBlock = serde_json::from_value(object).expect("edited block");
    let dry_run = PostParams { dry_run: true, ..PostParams::default() };
    Api::<IPBlock>::all(client.clone()).replace(block, &dry_run, &edited).await.map(drop)
}

/// A dry-run creation by `client` of block `name` of `cidr` in the test's pool.
async fn create(
    client: &Client,
    name: &str,
    cidr: &str,
    affinity: Option<&str>,
    allocations: Value,
) -> Result<(), kube::Error> {
    let spec = json!({"pool": POOL, "cidr": cidr, "affinity": affinity, "allocations": allocations});
    dry_run_create(client, name, spec).await
}

/// A dry-run creation by `client` of a block of `cidr` in pool `pool`, under its canonical name.
async fn create_in(client: &Client, pool: &str, cidr: &str, allocations: Value) -> Result<(), kube::Error> {
    let name = format!("{pool}-{}", cidr.replace(['.', '/'], "-"));
    dry_run_create(client, &name, json!({"pool": pool, "cidr": cidr, "allocations": allocations})).await
}

async fn dry_run_create(client: &Client, name: &str, spec: Value) -> Result<(), kube::Error> {
    let spec: IPBlockSpec = serde_json::from_value(spec).expect("block spec");
    let dry_run = PostParams { dry_run: true, ..PostParams::default() };
    Api::<IPBlock>::all(client.clone()).create(&dry_run, &IPBlock::new(name, spec)).await.map(drop)
}

/// A dry-run heartbeat renewal of Lease `name` labelled for `node`, by server-side apply as
/// the agent writes it.
async fn renew(client: &Client, name: &str, node: &str) -> Result<(), kube::Error> {
    let lease = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                       "metadata": {"name": name, "labels": {"ipwarden.io/agent-node": node}},
                       "spec": {"holderIdentity": node, "leaseDurationSeconds": 20}});
    let params = PatchParams { dry_run: true, ..PatchParams::apply("ipwarden-agent").force() };
    Api::<Lease>::namespaced(client.clone(), SYSTEM).patch(name, &params, &Patch::Apply(&lease)).await.map(drop)
}

/// Writes, as `client`, a takeover mark on B's record at `ip` for pod `claimant` (UID `uid`)
/// on `node` (a dry run).
async fn mark_for(
    admin: &Client,
    client: &Client,
    ip: &str,
    claimant: &str,
    uid: &str,
    node: &str,
) -> Result<(), kube::Error> {
    update(admin, client, B_BLOCK, |s| {
        allocations(s)[ip]["releaseHandshake"] = handshake("marked-for-release", Some((claimant, uid, node)));
    })
    .await
}

/// The IPClaim `name` of namespace [`NS`], bound to pod UID `uid` on `node`.
fn claim(name: &str, uid: &str, node: &str) -> IPClaim {
    serde_json::from_value(json!({
        "apiVersion": "ipwarden.io/v1alpha1", "kind": "IPClaim", "metadata": {"name": name, "namespace": NS},
        "spec": {"podUid": uid, "node": node, "sticky": true, "boundAt": STAMP, "interfaces": []},
    }))
    .expect("claim")
}

/// Writes, as `admin` (standing in for the controller), that claim `name` was seen in effect
/// for its pod on `node` (`status.witnessed`).
async fn witness_claim(admin: &Client, name: &str, node: &str) {
    let api: Api<IPClaim> = Api::namespaced(admin.clone(), NS);
    let mut stored = api.get(name).await.expect("read the claim");
    stored.status = serde_json::from_value(json!({"witnessed": {"podUid": stored.spec.pod_uid, "node": node,
        "interfaces": [], "at": STAMP}}))
    .expect("a status");
    api.replace_status(name, &PostParams::default(), &stored).await.expect("write the status");
}

/// Creates `claim` as `client` (a dry run).
async fn create_claim(client: &Client, claim: IPClaim) -> Result<(), kube::Error> {
    let dry_run = PostParams { dry_run: true, ..PostParams::default() };
    Api::namespaced(client.clone(), NS).create(&dry_run, &claim).await.map(drop)
}

/// Deletes claim `name` as `client` (a dry run).
async fn delete_claim(client: &Client, name: &str) -> Result<(), kube::Error> {
    let dry_run = kube::api::DeleteParams { dry_run: true, ..Default::default() };
    Api::<IPClaim>::namespaced(client.clone(), NS).delete(name, &dry_run).await.map(drop)
}

/// Replaces claim `name`, as read by `admin`, bound to pod UID `uid` on `node`, as `client`
/// (a dry run).
async fn rebind_claim(admin: &Client, client: &Client, name: &str, uid: &str, node: &str) -> Result<(), kube::Error> {
    let mut stored = Api::<IPClaim>::namespaced(admin.clone(), NS).get(name).await.expect("read the claim");
    stored.spec.pod_uid = uid.to_string();
    stored.spec.node = node.to_string();
    let dry_run = PostParams { dry_run: true, ..PostParams::default() };
    Api::namespaced(client.clone(), NS).replace(name, &dry_run, &stored).await.map(drop)
}

fn allocations(spec: &mut Value) -> &mut serde_json::Map<String, Value> {
    spec["allocations"].as_object_mut().expect("allocations")
}

async fn client(kubeconfig: &Path) -> Client {
    e2e::controlplane::client_for(kubeconfig).await.expect("client")
}

/// Two simulated nodes (no agent runs: the test writes as each), pool `pool`, and the chart's
/// accounts, RBAC and node-bound write policies, in force.
async fn start(pool: &str, spec: Value) -> Ipwarden {
    let ipwarden = Ipwarden::without_agents(2, &[(pool, spec)], support::network()).await;
    support::apply_chart_rbac(&ipwarden, SYSTEM).await;
    ipwarden
}

/// A client of the agent's ServiceAccount with a token bound to a pod on `node`.
async fn agent_on(ipwarden: &Ipwarden, node: &str) -> Client {
    let kubeconfig = e2e::accounts::node_bound_kubeconfig_for(&ipwarden.cluster, SYSTEM, "ipwarden-agent", node).await;
    client(&kubeconfig.expect("a token bound to a pod on the node")).await
}

/// Waits until the apiserver has type-checked every policy against the schemas of the kinds
/// it matches (the CRDs' and the Lease's), and asserts it found nothing to warn of: an
/// expression that reads a field the schema lacks, or compares mismatched types, would fail
/// only when a write reaches it.
async fn assert_well_typed(admin: &Client) {
    let policies: Api<ValidatingAdmissionPolicy> = Api::all(admin.clone());
    let checked = wait::until("the policies are type-checked", support::TIMEOUT, || async {
        let list = policies.list(&Default::default()).await.map_err(e2e::Error::kube("listing the policies"))?;
        let ours: Vec<_> =
            list.items.into_iter().filter(|p| p.name_any().starts_with("ipwarden-agent-node-bound")).collect();
        let pending = ours.iter().filter(|p| {
            let status = p.status.as_ref();
            status.and_then(|s| s.observed_generation) != p.metadata.generation
                || status.and_then(|s| s.type_checking.as_ref()).is_none()
        });
        Ok(match (ours.len(), pending.count()) {
            (4, 0) => Probe::Done(ours),
            (found, waiting) => Probe::Pending(format!("{found} policies, {waiting} not checked yet")),
        })
    })
    .await
    .expect("type-checked");
    for policy in checked {
        let warnings =
            policy.status.and_then(|s| s.type_checking).and_then(|t| t.expression_warnings).unwrap_or_default();
        let warnings: Vec<String> = warnings.into_iter().map(|w| format!("{}: {}", w.field_ref, w.warning)).collect();
        assert!(warnings.is_empty(), "{}: {warnings:#?}", policy.metadata.name.unwrap_or_default());
    }
}

/// Asserts that `result` is the policies' refusal by rule `rule`.
fn assert_refused(row: &str, rule: &str, result: Result<(), kube::Error>) {
    match result {
        Err(kube::Error::Api(status))
            if status.code == 403 && status.message.contains(&format!("ipwarden {rule}:")) => {}
        other => panic!("{row}: expected a 403 by rule {rule}, got {other:?}"),
    }
}

fn assert_allowed(row: &str, result: Result<(), kube::Error>) {
    if let Err(e) = result {
        panic!("{row}: expected the write to pass, got {e:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_writes_only_what_its_own_node_may_write() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let ipwarden = start(POOL, json!({"cidr": "10.74.0.0/24", "blockSize": 26})).await;
    let admin = ipwarden.client();
    let cluster = &ipwarden.cluster;
    assert_well_typed(&admin).await;
    let (on_a, on_b) = (agent_on(&ipwarden, A).await, agent_on(&ipwarden, B).await);
    let unbound = client(&e2e::accounts::kubeconfig_for(cluster, SYSTEM, "ipwarden-agent").await.expect("token")).await;
    let controller =
        client(&e2e::accounts::kubeconfig_for(cluster, SYSTEM, "ipwarden-controller").await.expect("token")).await;
    create_blocks(&admin).await;
    // web-2's claim: as node A leaves it after taking it over from web-2's pod on B, which the
    // controller saw in effect there.
    // web-3's: a claim of A's pod the controller has not seen in effect yet.
    for (name, node, seen_on) in
        [("web-0", A, Some(A)), ("web-1", B, Some(B)), ("web-2", A, Some(B)), ("web-3", A, None)]
    {
        let stored = claim(name, &format!("{name}-uid"), node);
        Api::namespaced(admin.clone(), NS).create(&PostParams::default(), &stored).await.expect("create the claim");
        if let Some(seen_on) = seen_on {
            witness_claim(&admin, name, seen_on).await;
        }
    }
    let a = &on_a;

    // Forbidden: node A's agent against node B's state.
    let row = "mark B's record for release";
    let result = update(&admin, a, B_BLOCK, |s| {
        allocations(s)["10.74.0.65"]["releaseHandshake"] = handshake("marked-for-release", None);
    })
    .await;
    assert_refused(row, "B-U5", result);
    let row = "answer the controller's mark on B's record";
    let result = update(&admin, a, B_BLOCK, |s| {
        allocations(s)["10.74.0.69"]["releaseHandshake"]["state"] = json!("ready-for-release");
    })
    .await;
    assert_refused(row, "B-U5", result);
    let row = "release B's record";
    let result = update(&admin, a, B_BLOCK, |s| drop(allocations(s).remove("10.74.0.65"))).await;
    assert_refused(row, "B-U4", result);
    let row = "rewrite B's record to name A's pod";
    let result = update(&admin, a, B_BLOCK, |s| {
        allocations(s)["10.74.0.65"]["pod"] = json!({"namespace": NS, "name": "attacker", "uid": "attacker-uid"});
    })
    .await;
    assert_refused(row, "B-U5", result);
    let row = "take B's live record, unasked";
    let result = update(&admin, a, B_BLOCK, |s| allocations(s)["10.74.0.65"] = set_of_statefulset("web-1", A)).await;
    assert_refused(row, "B-U5", result);
    let row = "take B's record whose handshake B has not answered";
    let result = update(&admin, a, B_BLOCK, |s| allocations(s)["10.74.0.69"] = set_of_statefulset("web-5", A)).await;
    assert_refused(row, "B-U5", result);
    let row = "take B's record answered for another pod";
    let result = update(&admin, a, B_BLOCK, |s| {
        let mut mine = set_of_statefulset("web-4", A);
        mine["pod"]["uid"] = json!("web-4-mine-uid");
        allocations(s)["10.74.0.68"] = mine;
    })
    .await;
    assert_refused(row, "B-U5", result);
    let row = "add a record naming node B";
    let result =
        update(&admin, a, A_BLOCK, |s| drop(allocations(s).insert("10.74.0.6".into(), record("x", B, None, false))))
            .await;
    assert_refused(row, "B-U3", result);
    let row = "add a record already marked";
    let result = update(&admin, a, A_BLOCK, |s| {
        let mut marked = record("x", A, None, false);
        marked["releaseHandshake"] = handshake("ready-for-release", None);
        allocations(s).insert("10.74.0.6".into(), marked);
    })
    .await;
    assert_refused(row, "B-U3", result);
    let row = "add a record outside the block";
    let result =
        update(&admin, a, A_BLOCK, |s| drop(allocations(s).insert("10.74.0.100".into(), record("x", A, None, false))))
            .await;
    assert_refused(row, "B-U3", result);
    let row = "take B's spare";
    let result =
        update(&admin, a, B_BLOCK, |s| drop(allocations(s).insert("10.74.0.80".into(), record("x", A, None, false))))
            .await;
    assert_refused(row, "B-U3", result);
    let row = "move A's own record to node B";
    let result = update(&admin, a, A_BLOCK, |s| allocations(s)["10.74.0.5"]["node"] = json!(B)).await;
    assert_refused(row, "B-U5", result);
    let row = "change B's block's affinity to A";
    let result = update(&admin, a, B_BLOCK, |s| s["affinity"] = json!(A)).await;
    assert_refused(row, "B-U1", result);
    let row = "change B's spares";
    let result = update(&admin, a, B_BLOCK, |s| s["spares"] = json!([])).await;
    assert_refused(row, "B-U2", result);
    let row = "change a block's CIDR";
    let result = update(&admin, a, A_BLOCK, |s| s["cidr"] = json!("10.74.0.64/26")).await;
    assert_refused(row, "B-U0", result);
    let row = "give B's block an owner, so that the garbage collector deletes it with its owner";
    let result = update(&admin, a, B_BLOCK, |_| {}).await;
    assert_allowed("an unchanged block", result);
    let owned = Api::<IPBlock>::all(admin.clone()).get(B_BLOCK).await.expect("read");
    let mut owned = serde_json::to_value(owned).expect("JSON");
    owned["metadata"]["ownerReferences"] =
        json!([{"apiVersion": "v1", "kind": "ConfigMap", "name": "doomed", "uid": "doomed-uid"}]);
    let owned: IPBlock = serde_json::from_value(owned).expect("block");
    let dry_run = PostParams { dry_run: true, ..PostParams::default() };
    assert_refused(row, "B-U0", Api::<IPBlock>::all(a.clone()).replace(B_BLOCK, &dry_run, &owned).await.map(drop));
    let row = "create a block with a record naming B";
    let result =
        create(a, "bound-10-74-0-128-26", "10.74.0.128/26", None, json!({"10.74.0.130": record("x", B, None, false)}))
            .await;
    assert_refused(row, "B-U3", result);
    let row = "create a second block object over B's CIDR";
    let result =
        create(a, "bound-shadow", "10.74.0.64/26", Some(A), json!({"10.74.0.65": record("x", A, None, false)})).await;
    assert_refused(row, "B-C", result);
    let row = "create a block of another size over B's IPs";
    let result =
        create(a, "bound-10-74-0-64-27", "10.74.0.64/27", Some(A), json!({"10.74.0.65": record("x", A, None, false)}))
            .await;
    assert_refused(row, "B-C2", result);
    let row = "create a block of another pool over this pool's IPs";
    assert_refused(row, "B-C2", create_in(a, "ghost", "10.74.0.128/26", json!({})).await);
    let row = "create a block affine to B";
    let result = create(a, "bound-10-74-0-128-26", "10.74.0.128/26", Some(B), json!({})).await;
    assert_refused(row, "B-C", result);
    let row = "attach a migration target on node B to B's VM";
    let result = update(&admin, a, B_BLOCK, |s| {
        allocations(s)["10.74.0.70"]["migrationTarget"] = json!({"migrationUid": "m", "node": B, "containerId": "t",
            "interface": "eth0", "pod": {"namespace": NS, "name": "virt-launcher-vm-dst", "uid": "dst-uid"}});
    })
    .await;
    assert_refused(row, "B-U5", result);
    let row = "attach a migration target to B's record of a StatefulSet pod";
    let result = update(&admin, a, B_BLOCK, |s| {
        allocations(s)["10.74.0.65"]["migrationTarget"] = json!({"migrationUid": "m", "node": A, "containerId": "t",
            "interface": "eth0", "pod": {"namespace": NS, "name": "web-1-dst", "uid": "dst-uid"}});
    })
    .await;
    assert_refused(row, "B-U5", result);
    let row = "take B's VM reservation while a migration target on another node shares it";
    let result = update(&admin, a, B_BLOCK, |s| {
        allocations(s)["10.74.0.71"] =
            record("virt-launcher-vm2-new", A, Some(("VirtualMachineInstance", "vm2")), true);
    })
    .await;
    assert_refused(row, "B-U5", result);
    let row = "take B's reservation for web-2's next pod without B's answer";
    let result = update(&admin, a, B_BLOCK, |s| allocations(s)["10.74.0.66"] = set_of_statefulset("web-2", A)).await;
    assert_refused(row, "B-U5", result);
    let row = "mark B's record for a takeover by a pod on another node";
    assert_refused(row, "B-U5", mark_for(&admin, a, "10.74.0.65", "web-1", "w", "node-2").await);
    let row = "mark B's record with an answer's detail";
    let result = update(&admin, a, B_BLOCK, |s| {
        let mut mark = handshake("marked-for-release", Some(("web-1", "w", A)));
        mark["detail"] = json!("no sandbox holds it");
        allocations(s)["10.74.0.65"]["releaseHandshake"] = mark;
    })
    .await;
    assert_refused(row, "B-U5", result);
    let row = "create a block under a CIDR with host bits";
    assert_refused(row, "B-C", create(a, "bound-10-74-0-129-26", "10.74.0.129/26", Some(A), json!({})).await);
    let row = "create a block with spares that is not its own";
    let spec = json!({"pool": POOL, "cidr": "10.74.0.128/26", "spares": ["10.74.0.130"]});
    assert_refused(row, "B-C", dry_run_create(a, "bound-10-74-0-128-26", spec).await);
    let row = "a token that names no node writes a claim";
    assert_refused(row, "T0", create_claim(&unbound, claim("web-7", "web-7-uid", A)).await);
    let row = "create a claim bound to a pod on B";
    assert_refused(row, "C-1", create_claim(a, claim("web-7", "web-7-uid", B)).await);
    let row = "delete the claim of a pod on B";
    assert_refused(row, "C-1", delete_claim(a, "web-1").await);
    let row = "rebind the claim of a pod on B to another pod on B";
    assert_refused(row, "C-1", rebind_claim(&admin, a, "web-1", "forged-uid", B).await);
    let row = "rebind the claim of a pod on B to a pod on a third node";
    assert_refused(row, "C-1", rebind_claim(&admin, a, "web-1", "forged-uid", "node-2").await);
    let row = "delete a claim taken over from a pod on B, which the controller saw in effect on B";
    assert_refused(row, "C-2", delete_claim(a, "web-2").await);
    // The witness still names A while A's pod is on its way to another node; deleting the
    // claim then would cost the pod its IPs there.
    let row = "delete the claim of A's own pod, which the controller saw in effect on A";
    assert_refused(row, "C-2", delete_claim(a, "web-0").await);
    let row = "renew B's Lease";
    assert_refused(row, "L-1", renew(a, &format!("ipwarden-agent-{B}"), B).await);
    let row = "renew a decoy Lease labelled for B";
    assert_refused(row, "L-1", renew(a, "decoy", B).await);
    let row = "renew A's own Lease labelled for B";
    assert_refused(row, "L-1", renew(a, &format!("ipwarden-agent-{A}"), B).await);
    let row = "a token that names no node writes a block";
    let result = update(&admin, &unbound, A_BLOCK, |s| {
        drop(allocations(s).insert("10.74.0.6".into(), record("x", A, None, false)))
    })
    .await;
    assert_refused(row, "T0", result);
    let row = "a token that names no node renews a Lease";
    assert_refused(row, "T0", renew(&unbound, &format!("ipwarden-agent-{A}"), A).await);

    // Allowed: every shape of write an agent makes.
    let row = "create the claim of a sticky pod on A";
    assert_allowed(row, create_claim(a, claim("web-7", "web-7-uid", A)).await);
    let row = "delete the claim of A's own pod the controller has not witnessed yet (a failed ADD's)";
    assert_allowed(row, delete_claim(a, "web-3").await);
    let row = "rebind A's own claim to A's next pod, or hand it to a migration target on B";
    assert_allowed(row, rebind_claim(&admin, a, "web-0", "web-0-next", A).await);
    assert_allowed(row, rebind_claim(&admin, a, "web-0", "target-uid", B).await);
    // Not checked yet (decision 0022): a claim policy cannot read the records' handshake, so
    // a take of B's claim for a pod on A passes, after which A may rebind it (the row above),
    // but not delete it (C-2); B's pod's next ADD takes back what the controller witnessed.
    let row = "take the claim of a pod on B over for a pod on A";
    assert_allowed(row, rebind_claim(&admin, a, "web-1", "web-1-on-a", A).await);
    let row = "allocate in A's own block";
    assert_allowed(
        row,
        update(&admin, a, A_BLOCK, |s| drop(allocations(s).insert("10.74.0.6".into(), record("x", A, None, false))))
            .await,
    );
    let row = "release A's own record";
    assert_allowed(row, update(&admin, a, A_BLOCK, |s| drop(allocations(s).remove("10.74.0.5"))).await);
    let row = "keep A's own record as a reservation";
    assert_allowed(row, update(&admin, a, A_BLOCK, |s| allocations(s)["10.74.0.5"]["containerId"] = json!("")).await);
    let row = "reserve spares in A's own block";
    assert_allowed(row, update(&admin, a, A_BLOCK, |s| s["spares"] = json!(["10.74.0.7", "10.74.0.8"])).await);
    let row = "borrow a free IP of B's block";
    assert_allowed(
        row,
        update(&admin, a, B_BLOCK, |s| drop(allocations(s).insert("10.74.0.90".into(), record("x", A, None, false))))
            .await,
    );
    let row = "claim a free block and allocate in it";
    assert_allowed(
        row,
        update(&admin, a, FREE_BLOCK, |s| {
            s["affinity"] = json!(A);
            allocations(s).insert("10.74.0.193".into(), record("x", A, None, false));
        })
        .await,
    );
    let row = "create a block affine to A";
    assert_allowed(
        row,
        create(
            a,
            "bound-10-74-0-128-26",
            "10.74.0.128/26",
            Some(A),
            json!({"10.74.0.130": record("x", A, None, false)}),
        )
        .await,
    );
    let row = "mark B's live record for web-1's takeover on A";
    assert_allowed(row, mark_for(&admin, a, "10.74.0.65", "web-1", "web-1-new-uid", A).await);
    let row = "ask B again for web-4, whose answer was for an earlier pod";
    assert_allowed(row, mark_for(&admin, a, "10.74.0.68", "web-4", "web-4-mine-uid", A).await);
    let row = "ask B for its reservation for web-2's next pod";
    assert_allowed(row, mark_for(&admin, a, "10.74.0.66", "web-2", "web-2-new-uid", A).await);
    let row = "take B's list reservation for a pod of the workload it is held for";
    assert_allowed(
        row,
        update(&admin, a, B_BLOCK, |s| {
            let mut mine = record("api-new", A, Some(("ReplicaSet", "api-1")), false);
            mine["heldFor"] = json!({"kind": "Deployment", "name": "api"});
            allocations(s)["10.74.0.72"] = mine;
        })
        .await,
    );
    let row = "take B's record answered ready-for-release for web-3's pod on A";
    assert_allowed(
        row,
        update(&admin, a, B_BLOCK, |s| {
            let mut mine = set_of_statefulset("web-3", A);
            mine["pod"]["uid"] = json!("web-3-new-uid");
            allocations(s)["10.74.0.67"] = mine;
        })
        .await,
    );
    let target = json!({"migrationUid": "m", "node": A, "containerId": "t", "interface": "eth0",
                        "pod": {"namespace": NS, "name": "virt-launcher-vm-dst", "uid": "dst-uid"}});
    let row = "attach A's migration target to B's VM record";
    let attached = target.clone();
    assert_allowed(
        row,
        update(&admin, a, B_BLOCK, |s| allocations(s)["10.74.0.70"]["migrationTarget"] = attached).await,
    );
    let row = "renew A's own Lease";
    assert_allowed(row, renew(a, &format!("ipwarden-agent-{A}"), A).await);
    let row = "B answers the controller's mark on its own record";
    assert_allowed(
        row,
        update(&admin, &on_b, B_BLOCK, |s| {
            allocations(s)["10.74.0.69"]["releaseHandshake"]["state"] = json!("ready-for-release")
        })
        .await,
    );

    // The migration's two ends, once the target is attached: A detaches its own target
    // (an aborted migration); B hands its record over to it (the source left).
    let attached = target.clone();
    let mut block = Api::<IPBlock>::all(admin.clone()).get(B_BLOCK).await.expect("read");
    let mut source = block.spec.allocations["10.74.0.70"].clone();
    source.migration_target = Some(serde_json::from_value(attached).expect("target"));
    block.spec.allocations.insert("10.74.0.70".into(), source);
    Api::<IPBlock>::all(admin.clone()).replace(B_BLOCK, &PostParams::default(), &block).await.expect("attach as admin");
    let row = "A detaches its own migration target from B's VM record";
    assert_allowed(
        row,
        update(&admin, a, B_BLOCK, |s| {
            drop(allocations(s)["10.74.0.70"].as_object_mut().map(|r| r.remove("migrationTarget")))
        })
        .await,
    );
    let row = "B hands its VM record over to A's migration target";
    let result = update(&admin, &on_b, B_BLOCK, |s| {
        let record = allocations(s)["10.74.0.70"].as_object_mut().expect("record");
        let target = record.remove("migrationTarget").expect("target");
        for field in ["pod", "node", "containerId", "interface"] {
            record.insert(field.into(), target[field].clone());
        }
        record.insert("allocatedAt".into(), json!("2026-01-02T00:00:00Z"));
    })
    .await;
    assert_allowed(row, result);
    let row = "B may not release its VM record while A's target shares it";
    assert_refused(row, "B-U4", update(&admin, &on_b, B_BLOCK, |s| drop(allocations(s).remove("10.74.0.70"))).await);
    let row = "B detaches its own sandbox from its VM record, A's target its VM instance does not confirm staying";
    let result = update(&admin, &on_b, B_BLOCK, |s| allocations(s)["10.74.0.70"]["containerId"] = json!("")).await;
    assert_allowed(row, result);
    let row = "B may not drop A's target from its VM record";
    let result = update(&admin, &on_b, B_BLOCK, |s| {
        drop(allocations(s)["10.74.0.70"].as_object_mut().map(|r| r.remove("migrationTarget")))
    })
    .await;
    assert_refused(row, "B-U5", result);
    let row = "B may not drop A's target even into a reservation (then B-U4 would let it free the IP)";
    let result = update(&admin, &on_b, B_BLOCK, |s| {
        let record = allocations(s)["10.74.0.70"].as_object_mut().expect("record");
        record.remove("migrationTarget");
        record.insert("containerId".into(), json!(""));
    })
    .await;
    assert_refused(row, "B-U5", result);
    let row = "B may not hand its VM record to a pod other than the target";
    let result = update(&admin, &on_b, B_BLOCK, |s| {
        let record = allocations(s)["10.74.0.70"].as_object_mut().expect("record");
        let mut target = record.remove("migrationTarget").expect("target");
        target["pod"]["uid"] = json!("someone-else");
        for field in ["pod", "node", "containerId", "interface"] {
            record.insert(field.into(), target[field].clone());
        }
    })
    .await;
    assert_refused(row, "B-U5", result);
    let row = "A may not detach its target by rewriting B's VM record";
    let result = update(&admin, a, B_BLOCK, |s| {
        let record = allocations(s)["10.74.0.70"].as_object_mut().expect("record");
        record.remove("migrationTarget");
        record.insert("sticky".into(), json!(false));
    })
    .await;
    assert_refused(row, "B-U5", result);

    // The controller is not bound to a node: it marks, answers for a node gone and releases
    // anywhere.
    let row = "the controller marks B's record";
    assert_allowed(
        row,
        update(&admin, &controller, B_BLOCK, |s| {
            allocations(s)["10.74.0.65"]["releaseHandshake"] = handshake("marked-for-release", None);
        })
        .await,
    );
    let row = "the controller answers a takeover for B";
    assert_allowed(
        row,
        update(&admin, &controller, B_BLOCK, |s| {
            allocations(s)["10.74.0.68"]["releaseHandshake"]["state"] = json!("ready-for-release");
        })
        .await,
    );
    let row = "the controller releases B's record";
    assert_allowed(row, update(&admin, &controller, B_BLOCK, |s| drop(allocations(s).remove("10.74.0.69"))).await);
    let row = "the controller repairs a record of B's pod in A's block";
    let result = update(&admin, &controller, A_BLOCK, |s| {
        let mut repaired = record("web-9", B, None, false);
        repaired["containerId"] = json!("");
        repaired["interface"] = json!("");
        repaired["repairedAt"] = json!(STAMP);
        allocations(s).insert("10.74.0.9".into(), repaired);
    })
    .await;
    assert_allowed(row, result);
    let row = "the controller deletes the empty block";
    let dry_run = kube::api::DeleteParams { dry_run: true, ..Default::default() };
    assert_allowed(row, Api::<IPBlock>::all(controller.clone()).delete(FREE_BLOCK, &dry_run).await.map(drop));
    let row = "add a finalizer to B's block";
    let mut held =
        serde_json::to_value(Api::<IPBlock>::all(admin.clone()).get(B_BLOCK).await.expect("read")).expect("JSON");
    held["metadata"]["finalizers"] = json!(["example.com/hold"]);
    let held: IPBlock = serde_json::from_value(held).expect("block");
    let dry_create = PostParams { dry_run: true, ..PostParams::default() };
    assert_refused(row, "B-U0", Api::<IPBlock>::all(a.clone()).replace(B_BLOCK, &dry_create, &held).await.map(drop));
    let row = "an agent deletes the empty block";
    let result = Api::<IPBlock>::all(a.clone()).delete(FREE_BLOCK, &dry_run).await.map(drop);
    assert!(matches!(result, Err(kube::Error::Api(ref s)) if s.code == 403), "{row}: {result:?}");
    let row = "claim a block no node holds while it holds B's record";
    let mut unaffined = Api::<IPBlock>::all(admin.clone()).get(FREE_BLOCK).await.expect("read");
    let theirs = serde_json::from_value(record("b-pod", B, None, false)).expect("record");
    unaffined.spec.allocations.insert("10.74.0.200".into(), theirs);
    Api::<IPBlock>::all(admin.clone())
        .replace(FREE_BLOCK, &PostParams::default(), &unaffined)
        .await
        .expect("B borrows");
    let result = update(&admin, a, FREE_BLOCK, |s| {
        s["affinity"] = json!(A);
        allocations(s).insert("10.74.0.201".into(), record("x", A, None, false));
    })
    .await;
    assert_refused(row, "B-U1", result);
    let blocks = Api::<IPBlock>::all(admin.clone()).list(&Default::default()).await.expect("list");
    assert_eq!(
        blocks.items.len(),
        3,
        "dry runs stored nothing: {:?}",
        blocks.items.iter().map(|b| b.name_any()).collect::<Vec<_>>()
    );
}

/// The largest block a pool allows (a /20: 4,096 addresses) with a record at every address,
/// `node`'s, each a sticky pod of `namespace` attached to a sandbox and, when `marked`, marked
/// for release by the controller.
fn full_block(node: &str, marked: bool, base: std::net::Ipv4Addr) -> Value {
    let mut allocations = serde_json::Map::new();
    for i in 0..4096u32 {
        let ip = std::net::Ipv4Addr::from(u32::from(base) + i);
        let mut record = json!({"pod": {"namespace": NS, "name": format!("p-{i}"), "uid": format!("u-{i}")}, "node": node,
                                "containerId": format!("c-{i}"), "interface": "eth0", "sticky": true, "allocatedAt": STAMP});
        if marked {
            record["releaseHandshake"] = json!({"state": "marked-for-release", "markedAt": STAMP, "reason": "r"});
        }
        allocations.insert(ip.to_string(), record);
    }
    Value::Object(allocations)
}

/// The policies' cost on the largest block a pool allows stays within the apiserver's CEL
/// limits (1,000,000 per expression, 10,000,000 per policy evaluation): a write that changes
/// every one of 4,096 records passes, both the heaviest an agent makes (answering a mark on
/// each of its records in one write) and the heaviest shape the rule allows on another node's
/// records (a takeover mark on each); one refused record among them is still found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policies_judge_a_write_to_every_record_of_the_largest_block() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let ipwarden = start("wide", json!({"cidr": "10.80.0.0/16", "blockSize": 20})).await;
    let admin = ipwarden.client();
    let a = agent_on(&ipwarden, A).await;
    let api: Api<IPBlock> = Api::all(admin.clone());
    let block = |node: &str, marked: bool, base: std::net::Ipv4Addr| {
        let spec: IPBlockSpec =
            serde_json::from_value(json!({"pool": "wide", "cidr": format!("{base}/20"), "affinity": node,
                                                              "allocations": full_block(node, marked, base)}))
            .expect("block spec");
        IPBlock::new(&format!("wide-{}-20", base.to_string().replace('.', "-")), spec)
    };

    api.create(&PostParams::default(), &block(A, true, std::net::Ipv4Addr::new(10, 80, 0, 0)))
        .await
        .expect("a full block of A's marked records");
    let row = "A answers the marks on all 4,096 of its records in one write";
    let result = update(&admin, &a, "wide-10-80-0-0-20", |s| {
        for record in allocations(s).values_mut() {
            record["releaseHandshake"]["state"] = json!("ready-for-release");
        }
    })
    .await;
    assert_allowed(row, result);

    api.create(&PostParams::default(), &block(B, false, std::net::Ipv4Addr::new(10, 80, 16, 0)))
        .await
        .expect("a full block of B's records");
    let mark = |s: &mut Value, skip: Option<&str>| {
        for (ip, record) in allocations(s).iter_mut() {
            let name = record["pod"]["name"].clone();
            let claimant = if Some(ip.as_str()) == skip { "someone-else".into() } else { name };
            record["releaseHandshake"] = json!({"state": "marked-for-release", "markedAt": STAMP, "reason": "takeover",
                "takeover": {"pod": {"namespace": NS, "name": claimant, "uid": "new"}, "node": A}});
        }
    };
    let row = "A marks all 4,096 of B's records for takeovers in one write";
    assert_allowed(row, update(&admin, &a, "wide-10-80-16-0-20", |s| mark(s, None)).await);
    let row = "one of 4,096 takeover marks names another pod";
    assert_refused(row, "B-U5", update(&admin, &a, "wide-10-80-16-0-20", |s| mark(s, Some("10.80.31.255"))).await);
}
