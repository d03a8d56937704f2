//! Fixed IPs: the pod annotation `ipwarden.io/ips`, the netconf's `runtimeConfig.ips` and
//! `IP=` in `CNI_ARGS` pin the IPs an ADD allocates, through the real plugin binary and agent;
//! a workload's `ipwarden.io/ip-list` keeps its pods to the listed IPs.
//! An IP that cannot be had fails the ADD naming why (held by whom, in no pool, excluded,
//! cooling down), and nothing else is allocated instead.

mod support;

use e2e::cni::{Invocation, PodArgs};
use e2e::wait::{self, Probe};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use support::{Ipwarden, TIMEOUT, records};

const NS: &str = "default";

/// Creates pod `name` (label `app=<name>`) bound to `node`, with `annotations`.
async fn create_annotated_pod(client: &kube::Client, name: &str, node: &str, annotations: Value) {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NS, "labels": {"app": name}, "annotations": annotations},
        "spec": {"nodeName": node, "terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "app", "image": "registry.invalid/ipwarden-test/app:1"}]},
    }))
    .expect("pod");
    Api::<Pod>::namespaced(client.clone(), NS).create(&PostParams::default(), &pod).await.expect("create pod");
}

/// The `CNI_ARGS` pod of `name`, with its UID.
async fn pod_args(client: &kube::Client, name: &str) -> PodArgs {
    let pod = Api::<Pod>::namespaced(client.clone(), NS).get(name).await.expect("pod");
    PodArgs { namespace: NS.into(), name: name.into(), uid: pod.uid().unwrap_or_default() }
}

fn netconf(ipwarden: &Ipwarden, extra: Value) -> Value {
    let socket = ipwarden.cluster.nodes()[0].dir().join("agent.sock");
    let mut conf = json!({"cniVersion": "1.1.0", "name": "ipwarden", "type": "ipwarden-cni", "socket": socket});
    if let (Some(conf), Some(extra)) = (conf.as_object_mut(), extra.as_object()) {
        conf.extend(extra.clone());
    }
    conf
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_gets_its_annotated_ip_and_another_pod_asking_for_it_fails_naming_the_holder_until_it_is_gone() {
    let pools = [
        ("main", json!({"cidr": "10.70.0.0/24", "gateway": "10.70.0.1", "default": true})),
        ("pinned", json!({"cidr": "10.71.0.0/24", "gateway": "10.71.0.1"})),
    ];
    let ipwarden = Ipwarden::start(1, &pools, &["--reuse-cooldown-seconds=10"]).await;
    let client = ipwarden.client();
    create_annotated_pod(&client, "first", "node-0", json!({"ipwarden.io/ips": "10.71.0.7"})).await;
    let pods = support::wait_pods_with_ips(&client, NS, "app=first", 1).await;
    assert_eq!(support::ip_of(&pods["first"]), "10.71.0.7", "the annotated IP, from a pool that is not a default");

    // A pod bound to a node no kubelet runs, so the test sees its ADD's answer.
    create_annotated_pod(&client, "second", "elsewhere", json!({"ipwarden.io/ips": "10.71.0.7"})).await;
    let args = pod_args(&client, "second").await;
    let (network, conf) = (support::network(), netconf(&ipwarden, json!({})));
    let add = || {
        let call =
            Invocation { command: "ADD", container_id: "second", ifname: "eth0", pod: Some(&args), netconf: &conf };
        let network = network.clone();
        async move { network.invoke(&call).await }
    };
    let err = add().await.expect_err("the IP is held by the first pod").to_string();
    assert!(err.contains("code 104"), "{err}");
    assert!(err.contains("fixed IP 10.71.0.7 is held by pod default/first on node node-0"), "{err}");
    assert!(!records(&client).await.values().any(|r| r.pod.name == "second"), "no other IP instead");

    Api::<Pod>::namespaced(client.clone(), NS).delete("first", &DeleteParams::default()).await.expect("delete");
    wait::until("the first pod's IP released", TIMEOUT, || async {
        let held = records(&client).await.contains_key("10.71.0.7");
        Ok(if held { Probe::Pending("still recorded".into()) } else { Probe::Done(()) })
    })
    .await
    .expect("the kubelet's DEL releases it");
    let err = add().await.expect_err("the released IP cools down").to_string();
    assert!(err.contains("code 11") && err.contains("cools down before reuse until"), "{err}");

    let result = wait::until("the second pod taking the cooled-down IP", TIMEOUT, || async {
        Ok(match add().await {
            Ok(Some(result)) => Probe::Done(result),
            Ok(None) => Probe::Pending("no result".into()),
            Err(e) => Probe::Pending(e.to_string()),
        })
    })
    .await
    .expect("the IP is free after its cooldown");
    assert_eq!(result["ips"], json!([{"address": "10.71.0.7/24", "gateway": "10.71.0.1"}]));
    let again = add().await.expect("ADD again").expect("a result");
    assert_eq!(again["ips"], result["ips"], "ADD is idempotent for the same sandbox");
    let held: Vec<String> =
        records(&client).await.into_iter().filter(|(_, r)| r.pod.name == "second").map(|(ip, _)| ip).collect();
    assert_eq!(held, ["10.71.0.7"], "one record, the fixed IP");

    // A second interface of the same sandbox (Multus' `net1`): the annotation speaks for the
    // pod's own network (`eth0`) only, so `net1` gets an IP as any pod would.
    let second_interface =
        Invocation { command: "ADD", container_id: "second", ifname: "net1", pod: Some(&args), netconf: &conf };
    let net1 = network.invoke(&second_interface).await.expect("net1 is not pinned").expect("a result");
    let address = net1["ips"][0]["address"].as_str().unwrap_or_default().to_string();
    assert!(address.starts_with("10.70.0."), "net1 draws from the default pool: {address}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_config_ips_win_over_cni_args_ip_over_the_annotation_and_an_ip_that_cannot_be_had_fails_naming_why() {
    let pools = [
        (
            "main",
            json!({"cidr": "10.72.0.0/24", "gateway": "10.72.0.1", "exclude": ["10.72.0.64/28"], "default": true}),
        ),
        ("off", json!({"cidr": "10.73.0.0/24", "disabled": true})),
    ];
    let ipwarden = Ipwarden::start(1, &pools, &["--reuse-cooldown-seconds=0"]).await;
    let client = ipwarden.client();
    create_annotated_pod(&client, "pinned", "elsewhere", json!({"ipwarden.io/ips": "10.72.0.9"})).await;
    let args = pod_args(&client, "pinned").await;
    let network = support::network();
    let call = |command: &'static str, extra: Value, cni_args: &'static str| {
        let (network, args, conf) = (network.clone(), args.clone(), netconf(&ipwarden, extra));
        async move {
            let call = Invocation { command, container_id: "pinned", ifname: "eth0", pod: Some(&args), netconf: &conf };
            network.invoke_with_args(&call, cni_args).await
        }
    };
    let runtime_config = json!({"runtimeConfig": {"ips": ["10.72.0.7/24"]}});
    let sources = [
        (runtime_config, "IP=10.72.0.8", "10.72.0.7/24"),
        (json!({}), "IP=10.72.0.8", "10.72.0.8/24"),
        (json!({}), "", "10.72.0.9/24"),
    ];
    for (extra, cni_args, want) in sources {
        let result = call("ADD", extra.clone(), cni_args).await.expect("ADD").expect("a result");
        assert_eq!(result["ips"], json!([{"address": want, "gateway": "10.72.0.1"}]), "{extra} {cni_args:?}");
        call("DEL", extra, cni_args).await.expect("DEL");
    }

    let refused = [
        (
            "IP=192.168.9.9",
            "code 103",
            "fixed IP 192.168.9.9 lies in no pool (pools: main (10.72.0.0/24), off (10.73.0.0/24))",
        ),
        ("IP=10.72.0.1", "code 103", "fixed IP 10.72.0.1 of pool main is never handed out: it is the pool's gateway"),
        ("IP=10.72.0.70", "code 103", "it is excluded by spec.exclude entry 10.72.0.64/28"),
        ("IP=10.73.0.7", "code 103", "fixed IP 10.73.0.7 is in pool off, which cannot be used: it is disabled"),
        ("IP=10.72.0.x", "code 103", "CNI_ARGS IP \"10.72.0.x\" is malformed"),
        ("IP=10.72.0.7,10.72.0.8", "code 103", "10.72.0.7 and 10.72.0.8 are both IPv4"),
    ];
    for (cni_args, code, why) in refused {
        let err = call("ADD", json!({}), cni_args).await.expect_err(cni_args).to_string();
        assert!(err.contains(code) && err.contains(why), "{cni_args}: {err}");
    }
    assert!(records(&client).await.is_empty(), "a refused fixed IP allocates nothing instead");

    // A StatefulSet's pod, whose claim nothing has witnessed yet, goes by the same checks: its
    // own fixed IPs stand for a witness only where its workload holds their records.
    support::create_statefulset(&client, NS, "sticky", json!({"nodeName": "elsewhere"})).await;
    let sticky = wait::until("sticky-0 created", TIMEOUT, || async {
        let pod = Api::<Pod>::namespaced(client.clone(), NS).get_opt("sticky-0").await;
        Ok(match pod.map_err(e2e::Error::kube("get sticky-0"))? {
            Some(pod) => {
                Probe::Done(PodArgs { namespace: NS.into(), name: pod.name_any(), uid: pod.uid().unwrap_or_default() })
            }
            None => Probe::Pending("not yet".into()),
        })
    })
    .await
    .expect("sticky-0");
    let conf = netconf(&ipwarden, json!({}));
    let add = Invocation { command: "ADD", container_id: "sticky", ifname: "eth0", pod: Some(&sticky), netconf: &conf };
    let err = network.invoke_with_args(&add, "IP=10.73.0.7").await.expect_err("a disabled pool's IP").to_string();
    assert!(err.contains("code 103") && err.contains("it is disabled"), "{err}");
    assert!(records(&client).await.is_empty(), "nothing allocated for the StatefulSet's pod either");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployment_of_three_keeps_to_its_listed_ips_across_a_rollout_and_a_fourth_replica_is_refused_naming_the_list()
 {
    let pools = [
        ("main", json!({"cidr": "10.74.0.0/24", "default": true})),
        ("listed", json!({"cidr": "10.75.0.0/24", "gateway": "10.75.0.1"})),
    ];
    let ipwarden = Ipwarden::start(1, &pools, &["--reuse-cooldown-seconds=1"]).await;
    let client = ipwarden.client();
    let list = ["10.75.0.7", "10.75.0.8", "10.75.0.9"];
    let strategy = json!({"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}});
    let deployments = create_listed_deployment(&client, "web", 3, &list.join(","), Some(strategy)).await;
    let first = support::wait_pods_with_ips(&client, NS, "app=web", 3).await;
    assert_eq!(listed_ips(&first), list, "the three pods hold the three listed IPs");

    // Every pod deleted at once: the replacements draw from the list as their IPs come free.
    let pods = Api::<Pod>::namespaced(client.clone(), NS);
    for name in first.keys() {
        pods.delete(name, &DeleteParams::default()).await.expect("delete pod");
    }
    let second = wait::until("three new pods with IPs", TIMEOUT, || async {
        let now = support::pods_with_ips(&client, NS, "app=web").await?;
        let fresh = now.len() == 3 && now.keys().all(|name| !first.contains_key(name));
        Ok(if fresh { Probe::Done(now) } else { Probe::Pending(format!("{:?}", now.keys())) })
    })
    .await
    .expect("the replacements get IPs");
    assert_eq!(listed_ips(&second), list, "the replacements hold the same three IPs");

    // The replacements were refused while the IPs were held: count from here.
    let in_use =
        |text: String| support::metric_sum(&text, "ipwarden_agent_allocations_total", &["result=\"fixed_ip_in_use\""]);
    let before = in_use(ipwarden.scrape_agent(0).await);
    let scale = json!({"spec": {"replicas": 4}});
    deployments
        .patch("web", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&scale))
        .await
        .expect("scale");
    wait::until("the fourth replica refused", TIMEOUT, || async {
        let refused = in_use(ipwarden.scrape_agent(0).await);
        Ok(if refused > before { Probe::Done(()) } else { Probe::Pending("no refusal yet".into()) })
    })
    .await
    .expect("the agent refuses the fourth replica");
    let now = support::pods_with_ips(&client, NS, "app=web").await.expect("pods");
    assert_eq!(listed_ips(&now), list, "no fourth IP, from the list or elsewhere");

    // The refusal as the runtime sees it, through the plugin, for a pod of the same template.
    create_annotated_pod(&client, "extra", "elsewhere", json!({"ipwarden.io/ip-list": list.join(",")})).await;
    let args = pod_args(&client, "extra").await;
    let conf = netconf(&ipwarden, json!({}));
    let call = Invocation { command: "ADD", container_id: "extra", ifname: "eth0", pod: Some(&args), netconf: &conf };
    let err = support::network().invoke(&call).await.expect_err("every listed IP is held").to_string();
    assert!(err.contains("code 104"), "{err}");
    assert!(err.contains("no IPv4 address of annotation ipwarden.io/ip-list can be had"), "{err}");
    for ip in list {
        assert!(err.contains(&format!("fixed IP {ip} is held by pod default/web-")), "{ip}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deployments_listed_ips_stay_reserved_for_it_between_its_pods_refused_to_others_naming_it_until_it_is_deleted()
 {
    const SYSTEM: &str = "ipwarden-system";
    let pools =
        [("main", json!({"cidr": "10.76.0.0/24", "default": true})), ("listed", json!({"cidr": "10.77.0.0/24"}))];
    let mut ipwarden = Ipwarden::without_agents(1, &pools, support::network()).await;
    let client = ipwarden.client();
    // The agent and the controller run as the chart's ServiceAccounts: its RBAC must cover
    // the workloads they read.
    support::apply_chart_rbac(&ipwarden, SYSTEM).await;
    ipwarden.run_agents_as_chart_account(SYSTEM).await;
    let kubeconfig =
        e2e::accounts::kubeconfig_for(&ipwarden.cluster, SYSTEM, "ipwarden-controller").await.expect("token");
    ipwarden.controller_run_as = Some(e2e::ipwarden::RunAs { kubeconfig, namespace: SYSTEM.into() });
    ipwarden.start_agents(&["--reuse-cooldown-seconds=0"]).await;
    let controller = ipwarden.start_controller("gc", &["--full-scan-interval-seconds=1"]);
    ipwarden.wait_leader(controller).await;

    let list = ["10.77.0.7", "10.77.0.8"];
    let deployments = create_listed_deployment(&client, "api", 2, &list.join(","), None).await;
    let first = support::wait_pods_with_ips(&client, NS, "app=api", 2).await;
    assert_eq!(listed_ips(&first), list, "the two pods hold the two listed IPs");

    // Scaled to zero: no pod holds the IPs, yet the Deployment does.
    let patch = |body: Value| {
        let deployments = deployments.clone();
        async move {
            let params = kube::api::PatchParams::default();
            deployments.patch("api", &params, &kube::api::Patch::Merge(&body)).await.expect("patch deployment");
        }
    };
    patch(json!({"spec": {"replicas": 0}})).await;
    let pods = Api::<Pod>::namespaced(client.clone(), NS);
    wait::until("the deployment's pods gone", TIMEOUT, || async {
        let left = pods.list(&kube::api::ListParams::default().labels("app=api")).await.expect("pods").items.len();
        Ok(if left == 0 { Probe::Done(()) } else { Probe::Pending(format!("{left} pods left")) })
    })
    .await
    .expect("the pods go");
    ipwarden.wait_sweeps(controller, 2).await;

    // A pod of no workload naming a listed IP is refused, naming the Deployment.
    create_annotated_pod(&client, "intruder", "elsewhere", json!({"ipwarden.io/ips": list[0]})).await;
    let args = pod_args(&client, "intruder").await;
    let conf = netconf(&ipwarden, json!({}));
    let call =
        Invocation { command: "ADD", container_id: "intruder", ifname: "eth0", pod: Some(&args), netconf: &conf };
    let err = support::network().invoke(&call).await.expect_err("the IP is the Deployment's").to_string();
    assert!(err.contains("code 104"), "{err}");
    assert!(err.contains("fixed IP 10.77.0.7 is reserved for Deployment default/api"), "{err}");
    let held = records(&client).await;
    for ip in list {
        let record = held.get(ip).unwrap_or_else(|| panic!("{ip} still recorded: {held:#?}"));
        assert!(record.container_id.is_empty(), "{ip} is a reservation, attached nowhere: {record:?}");
    }

    // A rollout (a new ReplicaSet) scaled back up: its pods take the reserved IPs back.
    patch(json!({"spec": {"replicas": 2, "template": {"metadata": {"labels": {"rev": "2"}}}}})).await;
    let second = wait::until("two pods of the new ReplicaSet with IPs", TIMEOUT, || async {
        let now = support::pods_with_ips(&client, NS, "app=api,rev=2").await?;
        Ok(if now.len() == 2 { Probe::Done(now) } else { Probe::Pending(format!("{:?}", now.keys())) })
    })
    .await
    .expect("the new pods get IPs");
    assert_eq!(listed_ips(&second), list, "the new ReplicaSet's pods hold the same two IPs");

    // Deleted: the controller releases what the Deployment held.
    patch(json!({"spec": {"replicas": 0}})).await;
    wait::until("the reservations kept after the pods", TIMEOUT, || async {
        let held = records(&client).await;
        let reserved = list.iter().all(|ip| held.get(*ip).is_some_and(|r| r.container_id.is_empty()));
        Ok(if reserved { Probe::Done(()) } else { Probe::Pending(format!("{held:?}")) })
    })
    .await
    .expect("the DELs keep the reservations");
    deployments.delete("api", &DeleteParams::default()).await.expect("delete deployment");
    wait::until("the reservations released", TIMEOUT, || async {
        let held = records(&client).await;
        let left: Vec<&String> = held.keys().filter(|ip| list.contains(&ip.as_str())).collect();
        Ok(if left.is_empty() { Probe::Done(()) } else { Probe::Pending(format!("{left:?}")) })
    })
    .await
    .expect("the controller releases the deleted Deployment's reservations");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_ip_whose_pods_del_was_lost_goes_to_the_deployments_replacement_pod_after_the_release_handshake() {
    let pools =
        [("main", json!({"cidr": "10.78.0.0/24", "default": true})), ("listed", json!({"cidr": "10.79.0.0/24"}))];
    let agent_args = ["--release-sandbox-grace-seconds=2", "--reuse-cooldown-seconds=1"];
    let mut ipwarden = Ipwarden::start(1, &pools, &agent_args).await;
    let client = ipwarden.client();
    let controller = ipwarden.start_controller("gc", &["--full-scan-interval-seconds=1"]);
    ipwarden.wait_leader(controller).await;

    create_listed_deployment(&client, "api", 1, "10.79.0.7", None).await;
    let first = support::wait_pods_with_ips(&client, NS, "app=api", 1).await;
    let (name, pod) = first.into_iter().next().expect("the pod");
    assert_eq!(support::ip_of(&pod), "10.79.0.7", "the listed IP");

    // The runtime loses the pod's DEL: its record stays attached to a sandbox gone.
    let node = &ipwarden.cluster.nodes()[0];
    let uid = pod.uid().unwrap_or_default();
    node.faults().set_skip_del(true);
    Api::<Pod>::namespaced(client.clone(), NS).delete(&name, &DeleteParams::default()).await.expect("delete pod");
    wait::until("the runtime dropping the pod's sandbox without DEL", TIMEOUT, || async {
        Ok(if node.sandboxes().contains_key(&uid) { Probe::Pending("still up".into()) } else { Probe::Done(()) })
    })
    .await
    .expect("sandbox dropped");
    node.faults().set_skip_del(false);

    // The controller releases it through the node's agent; the replacement takes it.
    let replacement = wait::until("the replacement pod holding the listed IP", TIMEOUT, || async {
        let pods = support::pods_with_ips(&client, NS, "app=api").await?;
        let holder = pods.into_iter().find(|(other, _)| *other != name);
        Ok(match holder {
            Some((_, pod)) => Probe::Done(pod),
            None => Probe::Pending(format!("10.79.0.7: {:?}", records(&client).await.get("10.79.0.7"))),
        })
    })
    .await
    .expect("the replacement gets the listed IP");
    assert_eq!(support::ip_of(&replacement), "10.79.0.7", "the listed IP, not another");
}

/// Creates Deployment `name` (pods labelled `app=name`) of `replicas` whose pod template lists
/// `list` in `ipwarden.io/ip-list`, with `strategy` if given; returns the Deployments' API.
async fn create_listed_deployment(
    client: &kube::Client,
    name: &str,
    replicas: i32,
    list: &str,
    strategy: Option<Value>,
) -> Api<Deployment> {
    let mut template = support::pod_template(name, json!({}));
    template["metadata"]["annotations"] = json!({"ipwarden.io/ip-list": list});
    let mut spec = json!({"replicas": replicas, "selector": {"matchLabels": {"app": name}}, "template": template});
    if let Some(strategy) = strategy {
        spec["strategy"] = strategy;
    }
    let deployment: Deployment =
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).expect("deployment");
    let deployments = Api::<Deployment>::namespaced(client.clone(), NS);
    deployments.create(&PostParams::default(), &deployment).await.expect("create deployment");
    deployments
}

/// The pods' IPs, sorted.
fn listed_ips(pods: &std::collections::BTreeMap<String, Pod>) -> Vec<String> {
    let mut ips: Vec<String> = pods.values().map(support::ip_of).collect();
    ips.sort();
    ips
}
