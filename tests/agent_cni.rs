//! The real `ipwarden-cni` binary against a real agent: ADD is idempotent, DEL of an unknown
//! or already deleted sandbox succeeds, CHECK, VERSION and STATUS work, an unreachable agent
//! is "try again later" (11) and STATUS 50; and the agent's checkpoint handling at start: a corrupt file is
//! moved aside and rebuilt, an unknown version refuses to start.

mod support;

use e2e::cni::{Invocation, PodArgs};
use e2e::wait::{self, Probe};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::Api;
use serde_json::{Value, json};
use support::{Ipwarden, TIMEOUT, create_pod, records};

const NS: &str = "default";

fn netconf(socket: &std::path::Path) -> Value {
    json!({"cniVersion": "1.1.0", "name": "ipwarden", "type": "ipwarden-cni", "socket": socket})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_binary_speaks_cni_through_the_agent() {
    let ipwarden =
        Ipwarden::start(1, &[("pool", json!({"cidr": "10.60.0.0/24", "gateway": "10.60.0.1", "default": true}))], &[])
            .await;
    let client = ipwarden.client();
    // A pod bound to a node no kubelet runs, so only this test wires it.
    create_pod(&client, NS, "manual", "elsewhere", json!({"app": "manual"})).await;
    let pod = Api::<Pod>::namespaced(client.clone(), NS).get("manual").await.expect("pod");
    let args = PodArgs { namespace: NS.into(), name: "manual".into(), uid: pod.uid().unwrap_or_default() };
    let network = support::network();
    let socket = ipwarden.cluster.nodes()[0].dir().join("agent.sock");
    let conf = netconf(&socket);
    let call = |command: &'static str, conf: Value| {
        let network = network.clone();
        let args = args.clone();
        async move {
            network
                .invoke(&Invocation {
                    command,
                    container_id: "c0ffee",
                    ifname: "eth0",
                    pod: Some(&args),
                    netconf: &conf,
                })
                .await
        }
    };

    let first = call("ADD", conf.clone()).await.expect("ADD").expect("a result");
    assert_eq!(first["cniVersion"], "1.1.0");
    assert_eq!(first["ips"][0]["gateway"], "10.60.0.1");
    let address = first["ips"][0]["address"].as_str().expect("address").to_string();
    assert!(address.starts_with("10.60.0.") && address.ends_with("/24"), "{address}");
    let again = call("ADD", conf.clone()).await.expect("ADD again").expect("a result");
    assert_eq!(again["ips"], first["ips"], "ADD is idempotent for the same container and interface");
    assert_eq!(records(&client).await.len(), 1, "one record, not two");

    let mut with_prev = conf.clone();
    with_prev["prevResult"] = first.clone();
    call("CHECK", with_prev.clone()).await.expect("CHECK passes while the record exists");
    call("DEL", with_prev.clone()).await.expect("DEL");
    assert!(records(&client).await.is_empty(), "DEL releases the record");
    call("DEL", with_prev.clone()).await.expect("a second DEL succeeds");
    let err = call("CHECK", with_prev).await.expect_err("CHECK fails once released");
    assert!(err.to_string().contains("code 3"), "{err}");

    let version = network
        .invoke(&Invocation { command: "VERSION", container_id: "", ifname: "", pod: None, netconf: &conf })
        .await
        .expect("VERSION")
        .expect("versions");
    assert_eq!(version["supportedVersions"], json!(["1.0.0", "1.1.0"]));

    let status = |conf: Value| {
        let network = network.clone();
        async move {
            network
                .invoke(&Invocation { command: "STATUS", container_id: "", ifname: "", pod: None, netconf: &conf })
                .await
        }
    };
    assert_eq!(status(conf.clone()).await.expect("STATUS: agent up, pool has free IPs"), None);

    let nowhere = netconf(&ipwarden.cluster.dir().join("no-agent.sock"));
    let err = call("ADD", nowhere.clone()).await.expect_err("no agent");
    assert!(err.to_string().contains("code 11"), "an unreachable agent is try-again-later: {err}");
    let err = status(nowhere).await.expect_err("STATUS without an agent");
    assert!(err.to_string().contains("code 50"), "STATUS without an agent is code 50: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_checkpoint_is_moved_aside_and_rebuilt_and_an_unknown_version_refuses_to_start() {
    let mut ipwarden = Ipwarden::start(1, &[("pool", json!({"cidr": "10.61.0.0/24", "default": true}))], &[]).await;
    let client = ipwarden.client();
    for i in 0..3 {
        create_pod(&client, NS, &format!("cp-{i}"), "node-0", json!({"app": "cp"})).await;
    }
    support::wait_pods_with_ips(&client, NS, "app=cp", 3).await;
    let dir = ipwarden.cluster.nodes()[0].dir().to_path_buf();
    let path = dir.join("checkpoint.json");

    ipwarden.agents[0].stop();
    std::fs::write(&path, b"{\"version\": 1, \"entries\": [{\"trunc").expect("corrupt it");
    ipwarden.agents[0].restart().expect("restart");
    ipwarden.wait_agent_serving(0).await;
    let aside: Vec<_> = std::fs::read_dir(&dir)
        .expect("node dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("checkpoint.json.corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1, "the corrupt file is kept aside");
    let rebuilt: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("rebuilt")).expect("json");
    assert_eq!(rebuilt["entries"].as_array().map(Vec::len), Some(3), "rebuilt from the IPBlocks");

    ipwarden.agents[0].stop();
    std::fs::write(&path, br#"{"version": 9, "entries": []}"#).expect("future version");
    ipwarden.agents[0].restart().expect("restart");
    let agent = &mut ipwarden.agents[0];
    let log = agent.log().to_path_buf();
    wait::until("the agent refusing to start", TIMEOUT, || {
        let running = agent.ensure_running();
        async move { Ok(if running.is_err() { Probe::Done(()) } else { Probe::Pending("still running".into()) }) }
    })
    .await
    .expect("an unknown version stops the agent");
    let text = std::fs::read_to_string(log).expect("agent log");
    assert!(text.contains("has version 9, this agent reads version 1"), "the log says why");
}

/// CNI STATUS gates a node's readiness (containerd reports the network not ready on a STATUS
/// error, and kubelet then marks the node NotReady, whose pods are evicted after five minutes):
/// a pool that is full, disabled or being deleted makes ADDs fail one by one, never the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_stays_ready_while_the_only_pool_is_full_or_disabled_so_no_node_goes_not_ready() {
    let one_ip =
        json!({"cidr": "10.62.0.0/24", "default": true, "ranges": [{"start": "10.62.0.9", "end": "10.62.0.9"}]});
    let ipwarden = Ipwarden::start(1, &[("only", one_ip)], &[]).await;
    let client = ipwarden.client();
    create_pod(&client, NS, "filler", "node-0", json!({"app": "filler"})).await;
    support::wait_pods_with_ips(&client, NS, "app=filler", 1).await;

    create_pod(&client, NS, "manual", "elsewhere", json!({"app": "manual"})).await;
    let pod = Api::<Pod>::namespaced(client.clone(), NS).get("manual").await.expect("pod");
    let args = PodArgs { namespace: NS.into(), name: "manual".into(), uid: pod.uid().unwrap_or_default() };
    let network = support::network();
    let conf = netconf(&ipwarden.cluster.nodes()[0].dir().join("agent.sock"));
    let call = |command: &'static str| {
        let (network, args, conf) = (network.clone(), args.clone(), conf.clone());
        async move {
            let pod = (command == "ADD").then_some(&args);
            let (container_id, ifname) = if command == "ADD" { ("c0ffee", "eth0") } else { ("", "") };
            network.invoke(&Invocation { command, container_id, ifname, pod, netconf: &conf }).await
        }
    };

    let err = call("ADD").await.expect_err("the only IP is taken");
    assert!(err.to_string().contains("exhausted"), "the ADD says the pool is full: {err}");
    assert_eq!(call("STATUS").await.expect("STATUS: a full pool leaves the node ready"), None);

    let pools: Api<ipwarden::crd::IPPool> = Api::all(client.clone());
    let disable = json!({"spec": {"disabled": true}});
    pools.patch("only", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&disable)).await.expect("disable");
    wait::until("the agent refusing ADDs from the disabled pool", TIMEOUT, || async {
        let refused = call("ADD").await.err().map(|e| e.to_string()).unwrap_or_default();
        Ok(if refused.contains("disabled") { Probe::Done(()) } else { Probe::Pending(refused) })
    })
    .await
    .expect("the agent sees the pool disabled");
    assert_eq!(call("STATUS").await.expect("STATUS: a disabled pool leaves the node ready"), None);
}
