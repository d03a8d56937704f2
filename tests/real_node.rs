//! ipwarden on real nodes: a real kubelet and runtime (containerd, or CRI-O where a test says
//! so, both with runc) joined to the test control plane, running real containers in real
//! network namespaces through the chart's CNI chain (`ptp` + `portmap`, `ipwarden-cni` as
//! IPAM). What a real runtime does here (when it calls which CNI verb, with what) is its own,
//! not the harness's simulation of it (docs/testing.md, "Real nodes"). The lost DEL, the
//! READY sandbox whose pod is gone, the frozen runtime and the reboot run on both runtimes.
//! Real nodes take a machine-wide lock, so these tests run one at a time.

mod support;

use std::collections::{BTreeMap, BTreeSet};

use e2e::realnode::chain_hold::ChainHold;
use e2e::realnode::cri_proxy::CriProxy;
use e2e::realnode::{BUSYBOX_IMAGE, RealNode, Runtime};
use e2e::wait::{self, Probe};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use support::realnode::netns_ips;
use support::{Ipwarden, TIMEOUT};

/// The pool docs/install.md shows: no gateway.
fn documented_pool() -> serde_json::Value {
    json!({"cidr": "10.244.0.0/16", "default": true})
}

/// A bare pod named `name` (label `app=<name>`) of [`real_spec`].
fn real_pod(name: &str) -> Pod {
    serde_json::from_value(
        json!({"metadata": {"name": name, "labels": {"app": name}}, "spec": e2e::realnode::workload_spec()}),
    )
    .expect("pod")
}

/// Waits until pod `name` runs with an IP; returns it.
async fn wait_running(client: &Client, name: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    wait::until(&format!("pod {name} Running with an IP"), TIMEOUT, || async {
        let pod = pods.get_opt(name).await.map_err(e2e::Error::kube(format!("reading pod {name}")))?;
        let status = pod.as_ref().and_then(|p| p.status.clone()).unwrap_or_default();
        Ok(match (status.phase.as_deref(), &status.pod_ip) {
            (Some("Running"), Some(_)) => Probe::Done(pod.expect("read above")),
            _ => Probe::Pending(format!(
                "phase {:?}, conditions {:?}",
                status.phase,
                status
                    .conditions
                    .unwrap_or_default()
                    .iter()
                    .map(|c| (c.type_.clone(), c.message.clone()))
                    .collect::<Vec<_>>()
            )),
        })
    })
    .await
    .expect("the pod runs with an IP")
}

/// The records of the node's IPs: IP -> (pod name, pod UID).
async fn node_records(client: &Client) -> BTreeMap<String, (String, String)> {
    support::records(client).await.into_iter().map(|(ip, r)| (ip, (r.pod.name.clone(), r.pod.uid.clone()))).collect()
}

/// IPs released by the agent's DELs and GCs so far.
async fn released(ipwarden: &Ipwarden) -> f64 {
    support::metric(&ipwarden.scrape_agent(0).await, RELEASED)
}

/// Waits until the runtime holds no sandbox of pod `name` (kubelet removed it: every DEL of
/// the deletion has run).
async fn wait_sandbox_removed(node: &RealNode, name: &str) {
    wait::until(&format!("pod {name}'s sandbox removed by the runtime"), TIMEOUT, || async {
        Ok(match node.pod_containers(name).await?.len() {
            0 => Probe::Done(()),
            left => Probe::Pending(format!("{left} containers left")),
        })
    })
    .await
    .expect("the sandbox is removed");
}

/// The IDs of every sandbox the node's runtime holds.
async fn sandboxes(node: &RealNode) -> BTreeSet<String> {
    node.sandboxes(None).await.expect("the runtime lists its sandboxes")
}

/// Waits until the node is Ready, then until a new pod `name` runs on it: kubelet and
/// containerd serve again. (What a restart did to the older pods the caller checks against
/// containerd's sandboxes, which a re-created sandbox would change.)
async fn wait_node_synced(ipwarden: &mut Ipwarden, name: &str) {
    ipwarden.cluster.wait_real_nodes_ready().await.expect("the node turns Ready again");
    let client = ipwarden.client();
    Api::<Pod>::namespaced(client.clone(), "default")
        .create(&PostParams::default(), &real_pod(name))
        .await
        .expect("create pod");
    wait_running(&client, name).await;
}

/// A static pod: a manifest in the node's static pod directory, run by kubelet itself. The
/// runtime knows it by its config hash (`K8S_POD_UID`); its mirror pod in the API has another
/// UID and the hash in `kubernetes.io/config.mirror`.
fn write_static_pod(node: &RealNode, name: &str) {
    let manifest = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": name}},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                            "command": ["/bin/sleep", "3600"]}],
        },
    });
    let path = node.paths().static_pods().join(format!("{name}.yaml"));
    std::fs::write(&path, manifest.to_string()).expect("write the static pod's manifest");
}

#[tokio::test(flavor = "multi_thread")]
async fn pods_on_a_real_node_run_with_their_ips_keep_them_through_runtime_restarts_and_are_released_once() {
    let mut ipwarden = Ipwarden::with_real_nodes(1, &[("default", documented_pool())], &[]).await;
    ipwarden.start_controller("controller-a", &[]);
    let client = ipwarden.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");

    // The chart's ptp with the documented pool (no gateway): failed every ADD before the
    // gateway was defaulted.
    pods.create(&PostParams::default(), &real_pod("web")).await.expect("create pod");
    let web = wait_running(&client, "web").await;
    let web_ip = support::ip_of(&web);
    let node = &ipwarden.cluster.real_nodes()[0];
    assert_eq!(netns_ips(node), BTreeSet::from([web_ip.clone()]), "the IP in the pod's network namespace is its podIP");
    assert_ne!(web_ip, "10.244.0.1", "the pool's first address is the pods' gateway, never a pod's");

    // A static pod: answered "the sandbox is stale" for ever before.
    write_static_pod(node, "static-web");
    let mirror_name = format!("static-web-{}", node.name());
    let mirror = wait_running(&client, &mirror_name).await;
    let hash =
        mirror.annotations().get("kubernetes.io/config.mirror").cloned().expect("a mirror pod names its config hash");
    let static_ip = support::ip_of(&mirror);
    assert_eq!(
        node_records(&client).await.get(&static_ip),
        Some(&(mirror_name.clone(), hash.clone())),
        "the static pod's record names it by its config hash, the UID its runtime knows"
    );

    // A StatefulSet's pod recreated keeps its IP.
    support::create_statefulset(&client, "default", "db", e2e::realnode::workload_spec()).await;
    let db = wait_running(&client, "db-0").await;
    let db_ip = support::ip_of(&db);
    // The controller witnesses db-0's claim while the pod runs: once only the controller writes
    // claims (decision 0022), the recreated pod's ADD takes back only the witnessed IPs.
    support::wait_witnessed(&client, "default", "db-0", &db.uid().unwrap_or_default()).await;
    pods.delete("db-0", &Default::default()).await.expect("delete db-0");
    let db_again = wait::until("db-0 recreated and Running", TIMEOUT, || async {
        let pod = pods.get_opt("db-0").await.map_err(e2e::Error::kube("reading db-0"))?;
        Ok(match pod {
            Some(pod) if pod.uid() != db.uid() && !support::ip_of(&pod).is_empty() => Probe::Done(pod),
            _ => Probe::Pending("not recreated with an IP yet".to_string()),
        })
    })
    .await
    .expect("db-0 comes back");
    assert_eq!(support::ip_of(&db_again), db_ip, "the StatefulSet's pod keeps its IP");

    // kubelet and containerd restarted with pods running: no CNI call, nothing released.
    let node = &ipwarden.cluster.real_nodes()[0];
    let ips_before = netns_ips(node);
    let records_before = node_records(&client).await;
    let released_before = released(&ipwarden).await;
    let sandboxes_before = sandboxes(node).await;
    ipwarden.cluster.real_node(0).stop_kubelet();
    ipwarden.cluster.real_node(0).restart_kubelet().expect("kubelet starts again");
    wait_node_synced(&mut ipwarden, "after-kubelet").await;
    ipwarden.cluster.real_node(0).restart_runtime().await.expect("containerd starts again");
    wait_node_synced(&mut ipwarden, "after-containerd").await;
    let records_after = node_records(&client).await;
    for (ip, record) in &records_before {
        assert_eq!(records_after.get(ip), Some(record), "{ip} kept its record through the restarts");
    }
    assert!(netns_ips(&ipwarden.cluster.real_nodes()[0]).is_superset(&ips_before), "no pod lost its IP");
    let sandboxes_after = sandboxes(&ipwarden.cluster.real_nodes()[0]).await;
    assert!(sandboxes_after.is_superset(&sandboxes_before), "every sandbox survived the restarts");
    assert_eq!(
        sandboxes_after.len(),
        sandboxes_before.len() + 2,
        "no new sandbox but the two probe pods': {sandboxes_before:?} -> {sandboxes_after:?}"
    );
    assert_eq!(released(&ipwarden).await, released_before, "the restarts released nothing");

    // A deletion: kubelet's DELs (one at the sandbox's stop, more at its removal) release the
    // IP once.
    let released_before = released(&ipwarden).await;
    assert!(
        !ipwarden.cluster.real_nodes()[0].pod_containers("web").await.expect("the runtime lists").is_empty(),
        "containerd lists web's sandbox"
    );
    pods.delete("web", &Default::default()).await.expect("delete web");
    wait_sandbox_removed(&ipwarden.cluster.real_nodes()[0], "web").await;
    assert!(!node_records(&client).await.contains_key(&web_ip), "the deleted pod's record is gone");
    let text = ipwarden.scrape_agent(0).await;
    assert_eq!(support::metric(&text, RELEASED) - released_before, 1.0, "released once");
    assert_eq!(support::metric(&text, "ipwarden_agent_releases_total{result=\"error\"}"), 0.0);

    // An agent that starts before its node's kubelet has registered the Node (a DaemonSet pod
    // on a joining node) waits for it, saying so, then serves: it exited before.
    let node_name = ipwarden.cluster.real_nodes()[0].name().to_string();
    ipwarden.cluster.real_node(0).stop_kubelet();
    let nodes: Api<Node> = Api::all(client.clone());
    nodes.delete(&node_name, &Default::default()).await.expect("delete the Node");
    wait::until("the Node gone", TIMEOUT, || async {
        Ok(match nodes.get_opt(&node_name).await.map_err(e2e::Error::kube("reading the Node"))? {
            Some(_) => Probe::Pending("still there".to_string()),
            None => Probe::Done(()),
        })
    })
    .await
    .expect("the Node is deleted");
    ipwarden.agents[0].kill();
    ipwarden.agents[0].restart().expect("the agent starts again");
    let log = ipwarden.agents[0].log().to_path_buf();
    let agent = &mut ipwarden.agents[0];
    wait::until("the agent saying it waits for its Node", TIMEOUT, || {
        let running = agent.ensure_running();
        let log = log.clone();
        async move {
            running?;
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            Ok(if text.contains("waiting for its Node") {
                Probe::Done(())
            } else {
                Probe::Pending("no such line yet".to_string())
            })
        }
    })
    .await
    .expect("the agent waits for its Node, and says so");
    ipwarden.cluster.real_node(0).restart_kubelet().expect("kubelet starts again");
    ipwarden.wait_agent_serving(0).await;
    wait_node_synced(&mut ipwarden, "joined").await;
}

/// Waits until the records are exactly the IPs of the live pods (IP -> pod name, pod UID as
/// the runtime knows it), and those are exactly the IPs in the node's network namespaces:
/// nothing leaked, nothing missing, and the API shows what really runs (after a reboot, the
/// pods' new sandboxes, not the IPs they had). Returns them.
async fn wait_settled(client: &Client, node: &RealNode) -> BTreeMap<String, (String, String)> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    wait::until("the records to be the live pods' IPs", TIMEOUT, || async {
        let listed = pods.list(&Default::default()).await.map_err(e2e::Error::kube("listing pods"))?.items;
        let listed: Vec<Pod> = listed.into_iter().filter(|p| p.metadata.deletion_timestamp.is_none()).collect();
        // Every pod runs with an IP: after a reboot the pods' statuses lose their IPs until
        // their new sandboxes run, and an empty cluster would look settled meanwhile.
        let starting: Vec<String> = listed
            .iter()
            .filter(|p| {
                support::ip_of(p).is_empty() || p.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Running")
            })
            .map(|p| p.name_any())
            .collect();
        if !starting.is_empty() {
            return Ok(Probe::Pending(format!("pods not Running with an IP: {starting:?}")));
        }
        let live: BTreeMap<String, (String, String)> = listed
            .into_iter()
            .map(|p| {
                let uid = ipwarden::ipam::workload::runtime_uid(&p).unwrap_or_default().to_string();
                (support::ip_of(&p), (p.name_any(), uid))
            })
            .collect();
        let records = node_records(client).await;
        let in_netns = netns_ips(node);
        let recorded: BTreeSet<String> = records.keys().cloned().collect();
        Ok(if records == live && recorded == in_netns {
            Probe::Done(records)
        } else {
            Probe::Pending(format!("records {records:?}, live pods {live:?}, in network namespaces {in_netns:?}"))
        })
    })
    .await
    .expect("the records settle to the live pods' IPs")
}

/// The node's CNI ADDs under way now: its `ipwarden-cni` processes run with `CNI_COMMAND=ADD`.
fn adds_under_way(node: &RealNode) -> usize {
    let plugin = node.paths().cni_bin_dir().join("ipwarden-cni").display().to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| {
            std::fs::read(entry.path().join("cmdline")).is_ok_and(|c| String::from_utf8_lossy(&c).starts_with(&plugin))
        })
        .filter_map(|entry| std::fs::read(entry.path().join("environ")).ok())
        .filter(|environ| environ.split(|b| *b == 0).any(|var| var == b"CNI_COMMAND=ADD"))
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_real_node_leaks_no_ip_when_containerd_dies_during_adds_a_del_is_lost_or_the_node_reboots() {
    no_leak_when_the_runtime_dies_during_adds_a_del_is_lost_or_the_node_reboots(Runtime::Containerd).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_crio_node_leaks_no_ip_when_a_del_is_lost_or_the_node_reboots() {
    no_leak_when_the_runtime_dies_during_adds_a_del_is_lost_or_the_node_reboots(Runtime::Crio).await;
}

/// The runtime SIGKILLed under ADDs (containerd only: CRI-O 1.36 killed under a sandbox's ADD
/// forgets the sandbox at its restart without a DEL, and its pinned network namespace keeps
/// the interface, the address and ptp's host route; docs/testing.md, "Real nodes"), a lost DEL,
/// a reboot, on a node running `runtime`.
async fn no_leak_when_the_runtime_dies_during_adds_a_del_is_lost_or_the_node_reboots(runtime: Runtime) {
    const GRACE_SECONDS: u64 = 10;
    // The handshake's round trips after the grace (the controller's mark, the agent's answer,
    // the controller's release), generous for a loaded machine.
    const LOST_DEL_SLACK_SECONDS: u64 = 50;
    let grace = format!("--release-sandbox-grace-seconds={GRACE_SECONDS}");
    let control_plane = e2e::controlplane::ControlPlaneOptions::default();
    let mut ipwarden =
        Ipwarden::with_real_nodes_in(1, runtime, &[("default", documented_pool())], &[&grace], control_plane).await;
    ipwarden.start_controller("controller-a", &[]);
    let client = ipwarden.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");

    // containerd SIGKILLed while ADDs are under way: the agent is held (SIGSTOP) so the ADDs
    // wait on it in the plugin, containerd is killed under them, then both go on. kubelet
    // stops the sandboxes containerd lost at its restart; their DELs release what the held
    // ADDs got.
    let kill_under_adds = runtime == Runtime::Containerd;
    if kill_under_adds {
        ipwarden.agents[0].pause();
    }
    for index in 0..4 {
        pods.create(&PostParams::default(), &real_pod(&format!("burst-{index}"))).await.expect("create pod");
    }
    if kill_under_adds {
        let node = &ipwarden.cluster.real_nodes()[0];
        wait::until("ADDs waiting on the held agent", TIMEOUT, || async {
            Ok(match adds_under_way(node) {
                0 => Probe::Pending("no ADD under way yet".to_string()),
                adds => Probe::Done(adds),
            })
        })
        .await
        .expect("kubelet's ADDs reach the plugin");
        ipwarden.cluster.real_node(0).kill_runtime();
        ipwarden.agents[0].resume();
        ipwarden.cluster.real_node(0).restart_runtime().await.expect("the runtime starts again");
    }
    for index in 0..4 {
        wait_running(&client, &format!("burst-{index}")).await;
    }
    let settled = wait_settled(&client, &ipwarden.cluster.real_nodes()[0]).await;
    assert_eq!(settled.len(), 4, "one IP per pod, none on two: {settled:?}");

    // A lost DEL: the runtime's state of a pod's sandbox is gone (containerd's disk wiped under
    // it, CRI-O's run directories lost in a reboot) and the pod is deleted: no DEL ever comes.
    // containerd never calls CNI GC: the release handshake frees the IP once the sandbox grace
    // has passed. CRI-O's start-up CNI GC frees it when CRI-O starts again.
    pods.create(&PostParams::default(), &real_pod("lost")).await.expect("create pod");
    let lost_ip = support::ip_of(&wait_running(&client, "lost").await);
    ipwarden.cluster.real_node(0).power_off();
    pods.delete("lost", &kube::api::DeleteParams { grace_period_seconds: Some(0), ..Default::default() })
        .await
        .expect("force-delete the pod");
    let deleted = std::time::Instant::now();
    ipwarden.cluster.real_node(0).boot().await.expect("the node boots");
    support::wait_record_gone(&client, &lost_ip, TIMEOUT, "the lost DEL's IP is released").await;
    let took = deleted.elapsed();
    assert!(
        took.as_secs() <= GRACE_SECONDS + LOST_DEL_SLACK_SECONDS,
        "a lost DEL is released within the sandbox grace and the handshake's round trips: took {took:?}"
    );
    for index in 0..4 {
        wait_running(&client, &format!("burst-{index}")).await;
    }
    wait_settled(&client, &ipwarden.cluster.real_nodes()[0]).await;

    // A reboot: kubelet, the runtime and the agent killed, the runtime's state and network
    // namespaces wiped, the agent's checkpoint kept. The pods' old sandboxes are dead; their
    // IPs are freed, and no other. On containerd each pod's new sandbox supersedes the old one
    // and takes its IP back; CRI-O DELs every old attachment at its start, so there the IPs
    // are released before the new sandboxes ask, and cool down like any other.
    let before = wait_settled(&client, &ipwarden.cluster.real_nodes()[0]).await;
    ipwarden.agents[0].kill();
    ipwarden.cluster.real_node(0).power_off();
    ipwarden.agents[0].restart().expect("the agent starts again");
    ipwarden.wait_agent_serving(0).await;
    ipwarden.cluster.real_node(0).boot().await.expect("the node boots");
    ipwarden.cluster.wait_real_nodes_ready().await.expect("the node turns Ready");
    for index in 0..4 {
        wait_running(&client, &format!("burst-{index}")).await;
    }
    let after = wait_settled(&client, &ipwarden.cluster.real_nodes()[0]).await;
    match runtime {
        Runtime::Containerd => assert_eq!(after, before, "every pod runs again with the IP it had"),
        Runtime::Crio => {
            let pods = |m: &BTreeMap<String, (String, String)>| m.values().cloned().collect::<BTreeSet<_>>();
            assert_eq!(pods(&after), pods(&before), "every pod runs again with one IP: {after:?}");
        }
    }
}

/// The agent's count of the questions the runtime answered over CRI.
const QUERIES_OK: &str = "ipwarden_agent_runtime_queries_total{result=\"ok\"}";

/// The agent's count of the questions the runtime did not answer.
const QUERIES_FAILED: &str = "ipwarden_agent_runtime_queries_total{result=\"error\"}";

/// Waits until the record of `ip` on the real node carries a release mark not yet answered.
async fn wait_marked(client: &Client, ip: &str) {
    wait::until(&format!("the record of {ip} marked for release"), TIMEOUT, || async {
        Ok(match support::records(client).await.get(ip).and_then(|r| r.release_handshake.clone()) {
            Some(h) if h.state == ipwarden::crd::HandshakeState::MarkedForRelease => Probe::Done(()),
            other => Probe::Pending(format!("{other:?}")),
        })
    })
    .await
    .expect("the controller marks the record");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_asking_containerd_keeps_a_ready_sandboxs_ip_falls_back_to_the_grace_when_it_is_silent_and_frees_a_lost_del_at_once()
 {
    asking_the_runtime_keeps_a_ready_sandbox_falls_back_when_silent_and_frees_a_lost_del(Runtime::Containerd).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_asking_crio_keeps_a_ready_sandboxs_ip_falls_back_to_the_grace_when_it_is_silent_and_frees_a_lost_del_at_once()
 {
    asking_the_runtime_keeps_a_ready_sandbox_falls_back_when_silent_and_frees_a_lost_del(Runtime::Crio).await;
}

/// An agent asking `runtime` over CRI: a READY sandbox whose pod is gone keeps its IP, a
/// frozen runtime falls back to the sandbox grace, a lost DEL is freed by the runtime's word.
async fn asking_the_runtime_keeps_a_ready_sandbox_falls_back_when_silent_and_frees_a_lost_del(runtime: Runtime) {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    const SHORT_GRACE_SECONDS: u64 = 10;
    const LONG_GRACE_SECONDS: u64 = 150;
    let short = format!("--release-sandbox-grace-seconds={SHORT_GRACE_SECONDS}");
    let cri = [e2e::ipwarden::WITH_CRI, "--cri-poll-interval-seconds=1"];
    // kubelet is stopped below for longer than the test control plane's default node monitor
    // grace (20 s): its Node must stay Ready, or the NotReady policy would hold the IP instead.
    let control_plane = e2e::controlplane::ControlPlaneOptions {
        node_monitor_grace_period: std::time::Duration::from_secs(300),
        ..Default::default()
    };
    let mut ipwarden = Ipwarden::with_real_nodes_in(
        1,
        runtime,
        &[("default", documented_pool())],
        &[cri[0], cri[1], &short],
        control_plane,
    )
    .await;
    ipwarden.start_controller("controller-a", &[]);
    let client = ipwarden.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let force = kube::api::DeleteParams { grace_period_seconds: Some(0), ..Default::default() };

    // kubelet stops, and the pod is force-deleted: the runtime still runs its sandbox, READY.
    // The controller marks its record; the agent, asking the runtime, leaves the mark
    // unanswered for three sandbox graces.
    pods.create(&PostParams::default(), &real_pod("held")).await.expect("create pod");
    let held_ip = support::ip_of(&wait_running(&client, "held").await);
    ipwarden.cluster.real_node(0).stop_kubelet();
    pods.delete("held", &force).await.expect("force-delete the pod");
    wait_marked(&client, &held_ip).await;
    let marked = std::time::Instant::now();
    let asked = || async { support::metric(&ipwarden.scrape_agent(0).await, QUERIES_OK) };
    let asked_at_mark = asked().await;
    while marked.elapsed().as_secs() < 3 * SHORT_GRACE_SECONDS {
        let record = support::records(&client).await.remove(&held_ip);
        let state = record.as_ref().and_then(|r| r.release_handshake.as_ref()).map(|h| h.state);
        assert_eq!(
            state,
            Some(ipwarden::crd::HandshakeState::MarkedForRelease),
            "the IP of a sandbox the runtime runs stays marked and held {:?} after the mark",
            marked.elapsed()
        );
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    assert!(asked().await > asked_at_mark, "the runtime answered the agent's questions meanwhile");
    // The runtime stops answering (frozen: its socket stays, every call hangs): the agent falls
    // back to the sandbox grace, counts the failures, and the IP is released.
    ipwarden.cluster.real_node(0).freeze_runtime();
    let frozen = std::time::Instant::now();
    support::wait_record_gone(&client, &held_ip, TIMEOUT, "the grace frees the IP once the runtime is silent").await;
    let failed = support::metric(&ipwarden.scrape_agent(0).await, QUERIES_FAILED);
    assert!(failed > 0.0, "the questions the runtime did not answer are counted");
    tracing::info!(seconds = frozen.elapsed().as_secs_f64(), "released by the grace after the runtime froze");
    // The runtime and kubelet back: kubelet stops the orphaned sandbox; its DEL finds nothing.
    ipwarden.cluster.real_node(0).thaw_runtime();
    ipwarden.cluster.real_node(0).restart_kubelet().expect("kubelet starts again");
    wait_sandbox_removed(&ipwarden.cluster.real_nodes()[0], "held").await;

    // The agent again, with a sandbox grace far longer than the test waits: a lost DEL
    // (the runtime's state wiped under the pod, the pod force-deleted) is freed before it, by
    // the runtime no longer having the sandbox (or, on CRI-O, by its start-up CNI GC).
    ipwarden.agents[0].kill();
    let long = format!("--release-sandbox-grace-seconds={LONG_GRACE_SECONDS}");
    ipwarden.start_agent(0, &[cri[0], cri[1], &long]).await;
    ipwarden.cluster.wait_real_nodes_ready().await.expect("the node is Ready");
    pods.create(&PostParams::default(), &real_pod("lost")).await.expect("create pod");
    let lost_ip = support::ip_of(&wait_running(&client, "lost").await);
    // The runtime has the sandbox and has said so to the agent (two more questions answered):
    // a sandbox the runtime never returned may be one still being made, and only the settle
    // time or the grace may free its IP.
    wait_questions(&ipwarden, ipwarden.agents.len() - 1, 2).await;
    ipwarden.cluster.real_node(0).power_off();
    pods.delete("lost", &force).await.expect("force-delete the pod");
    let deleted = std::time::Instant::now();
    ipwarden.cluster.real_node(0).boot().await.expect("the node boots");
    support::wait_record_gone(&client, &lost_ip, TIMEOUT, "the lost DEL's IP is released").await;
    let took = deleted.elapsed();
    tracing::info!(seconds = took.as_secs_f64(), "lost DEL released on the real node");
    assert!(
        took.as_secs() < LONG_GRACE_SECONDS / 2,
        "a lost DEL is released by the runtime's word, long before the sandbox grace: took {took:?}"
    );
}

/// Waits until agent `agent` (its index among the started agents) has had `count` more
/// questions answered by the runtime than now.
async fn wait_questions(ipwarden: &Ipwarden, agent: usize, count: u32) {
    let asked = support::metric(&ipwarden.scrape_agent(agent).await, QUERIES_OK);
    wait::until(&format!("{count} more questions answered by the runtime"), TIMEOUT, || async {
        let now = support::metric(&ipwarden.scrape_agent(agent).await, QUERIES_OK);
        Ok(if now >= asked + f64::from(count) { Probe::Done(()) } else { Probe::Pending(format!("{now} questions")) })
    })
    .await
    .expect("questions");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_containerd_is_still_making_keeps_its_ip_when_a_status_call_fails() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::with_real_nodes(1, &[("default", documented_pool())], &[]).await;
    let client = ipwarden.client();
    let (node_dir, containerd, cni_bin) = {
        let node = &ipwarden.cluster.real_nodes()[0];
        (node.dir().to_path_buf(), node.paths().runtime_socket(), node.paths().cni_bin_dir())
    };
    // The agent asks containerd through a proxy that can fail a call; no controller runs, so
    // only the agent could release an IP, and absence alone never counts (settle time an hour).
    let proxy = CriProxy::start(&containerd, &node_dir.join("cri-proxy.sock")).await.expect("CRI proxy");
    ipwarden.agents[0].kill();
    let cri = format!("--cri-socket={}", proxy.socket().display());
    ipwarden.start_agent(0, &[&cri, "--cri-poll-interval-seconds=1", "--cri-sandbox-settle-seconds=3600"]).await;
    let agent = ipwarden.agents.len() - 1;

    // The chain's last plugin holds the ADD after ipwarden returned: the agent has recorded the
    // sandbox's IP, and containerd, still making the sandbox, does not list it.
    let hold = ChainHold::start(&cni_bin, &node_dir).expect("chain hold");
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    pods.create(&PostParams::default(), &real_pod("starting")).await.expect("create pod");
    wait::until("the pod's ADD held after ipwarden", TIMEOUT, || async {
        Ok(if hold.holds_an_add() { Probe::Done(()) } else { Probe::Pending("no ADD held yet".into()) })
    })
    .await
    .expect("ADD held");
    let (ip, uid) = node_records(&client)
        .await
        .into_iter()
        .find(|(_, (name, _))| name == "starting")
        .map(|(ip, (_, uid))| (ip, uid))
        .expect("ipwarden recorded the held ADD's IP");
    wait_questions(&ipwarden, agent, 2).await;

    // One status call fails (containerd restarting, or a call past the agent's timeout): it
    // says nothing of the sandbox, so containerd's next NotFound proves nothing either.
    proxy.fail_next_status_calls(1);
    wait::until("the failing status call made", TIMEOUT, || async {
        Ok(match proxy.status_calls_to_fail() {
            0 => Probe::Done(()),
            n => Probe::Pending(format!("{n} to fail")),
        })
    })
    .await
    .expect("status call");
    wait_questions(&ipwarden, agent, 3).await;
    assert_eq!(
        node_records(&client).await.get(&ip),
        Some(&("starting".to_string(), uid.clone())),
        "the IP of a sandbox containerd is still making stays recorded for its pod"
    );

    // The chain goes on: the pod runs with that IP, and it is the one in its network namespace.
    drop(hold);
    let pod = wait_running(&client, "starting").await;
    assert_eq!(support::ip_of(&pod), ip, "the pod runs with the IP recorded for it");
    let settled = wait_settled(&client, &ipwarden.cluster.real_nodes()[0]).await;
    assert_eq!(settled, BTreeMap::from([(ip, ("starting".to_string(), uid))]), "one IP, the pod's, none leaked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crio_asks_at_the_agents_interval_and_its_start_up_cni_gc_frees_exactly_the_ip_of_a_sandbox_it_lost() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    const INTERVAL_SECONDS: u64 = 5;
    const WINDOW_SECONDS: u64 = 30;
    let interval = format!("--cri-poll-interval-seconds={INTERVAL_SECONDS}");
    let control_plane = e2e::controlplane::ControlPlaneOptions {
        node_monitor_grace_period: std::time::Duration::from_secs(300),
        ..Default::default()
    };
    let mut ipwarden = Ipwarden::with_real_nodes_in(
        1,
        Runtime::Crio,
        &[("default", documented_pool())],
        &[e2e::ipwarden::WITH_CRI, &interval],
        control_plane,
    )
    .await;
    let client = ipwarden.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    for name in ["keep", "lost"] {
        pods.create(&PostParams::default(), &real_pod(name)).await.expect("create pod");
    }
    let keep_ip = support::ip_of(&wait_running(&client, "keep").await);
    let lost = wait_running(&client, "lost").await;
    let lost_ip = support::ip_of(&lost);

    // CRI-O, with pod events off as it ships, ends the agent's event stream at once: the agent
    // still asks it at its interval, not at every reopening of the stream (once a second).
    let window = std::time::Instant::now();
    let asked_before = support::metric(&ipwarden.scrape_agent(0).await, QUERIES_OK);
    tokio::time::sleep(std::time::Duration::from_secs(WINDOW_SECONDS)).await;
    let asked = support::metric(&ipwarden.scrape_agent(0).await, QUERIES_OK) - asked_before;
    let most = (window.elapsed().as_secs() / INTERVAL_SECONDS + 3) as f64;
    tracing::info!(asked, seconds = window.elapsed().as_secs_f64(), "questions CRI-O answered");
    assert!(asked >= 1.0, "the agent asks CRI-O: {asked} questions in {:?}", window.elapsed());
    assert!(asked <= most, "the agent asks CRI-O at its interval: {asked} questions in {:?}", window.elapsed());

    // The agent again, without asking CRI-O and with no controller running: only the runtime's
    // CNI calls can release an IP now. kubelet stops; pod `lost` is force-deleted (its DEL
    // never comes); CRI-O is killed, `lost`'s processes die, and its sandbox's state is lost.
    ipwarden.agents[0].kill();
    ipwarden.start_agent(0, &[]).await;
    let agent = ipwarden.agents.len() - 1;
    let released_before = support::metric(&ipwarden.scrape_agent(agent).await, RELEASED);
    let sandbox = {
        let node = &ipwarden.cluster.real_nodes()[0];
        let ids = node.sandboxes(Some("lost")).await.expect("CRI-O lists lost's sandbox");
        assert_eq!(ids.len(), 1, "one sandbox of lost: {ids:?}");
        ids.into_iter().next().expect("checked above")
    };
    ipwarden.cluster.real_node(0).stop_kubelet();
    let force = kube::api::DeleteParams { grace_period_seconds: Some(0), ..Default::default() };
    pods.delete("lost", &force).await.expect("force-delete lost");
    ipwarden.cluster.real_node(0).kill_runtime();
    let node = &ipwarden.cluster.real_nodes()[0];
    node.kill_pod(&lost.uid().expect("a pod has a UID"));
    node.forget_sandbox(&sandbox).expect("CRI-O's state of lost's sandbox removed");
    assert!(node_records(&client).await.contains_key(&lost_ip), "lost's IP is still recorded before CRI-O starts");

    // CRI-O starts: it restores keep, cannot restore lost, and its start-up CNI GC (the DEL of
    // every cached attachment it did not restore, then GC with the ones it did) frees lost's
    // IP, and only that one.
    ipwarden.cluster.real_node(0).restart_runtime().await.expect("CRI-O starts again");
    support::wait_record_gone(&client, &lost_ip, TIMEOUT, "CRI-O's start-up GC frees the lost sandbox's IP").await;
    // The agent counts a release once its write returned, which may be after the record is seen
    // gone.
    let counted = wait::until("the release counted", TIMEOUT, || async {
        let now = support::metric(&ipwarden.scrape_agent(agent).await, RELEASED) - released_before;
        Ok(if now >= 1.0 { Probe::Done(now) } else { Probe::Pending(format!("{now} released")) })
    })
    .await
    .expect("the release is counted");
    assert_eq!(counted, 1.0, "one IP released, lost's");
    assert_eq!(
        node_records(&client).await.get(&keep_ip).map(|(name, _)| name.as_str()),
        Some("keep"),
        "the restored pod keeps its IP"
    );
    assert!(netns_ips(&ipwarden.cluster.real_nodes()[0]).contains(&keep_ip), "keep's network namespace keeps its IP");
    ipwarden.cluster.real_node(0).restart_kubelet().expect("kubelet starts again");
    let settled = wait_settled(&client, &ipwarden.cluster.real_nodes()[0]).await;
    assert_eq!(settled.keys().collect::<Vec<_>>(), vec![&keep_ip], "keep's IP and nothing else: {settled:?}");
}

/// The agent's count of the IPs its DELs, GCs and answers released.
const RELEASED: &str = "ipwarden_agent_releases_total{result=\"released\"}";
