//! The Helm chart (`charts/ipwarden`): `helm lint` and `helm template` with the pinned Helm
//! built from its Go module, the alert rules checked by promtool, the values schema, and
//! `helm install` / `upgrade` / `uninstall` on the real test control plane.

mod support;

use std::collections::BTreeSet;
use std::path::Path;

use e2e::helm::{Helm, chart};
use e2e::wait::{self, Probe};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, Role};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams};
use serde_json::Value;
use support::TIMEOUT;

const NAMESPACE: &str = "ipwarden-system";

/// The alerts the PrometheusRule must hold, each with a section in docs/alerts.md.
const ALERTS: [&str; 10] = [
    "IpwardenPoolNearlyExhausted",
    "IpwardenPoolExhausted",
    "IpwardenLeakCandidatesGrowing",
    "IpwardenReleaseFailures",
    "IpwardenAgentReleaseErrors",
    "IpwardenNoLeader",
    "IpwardenNodesWithoutLiveAgent",
    "IpwardenIpConflicts",
    "IpwardenRecordConflictsFound",
    "IpwardenClaimWitnessFailing",
];

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found = of_kind(docs, kind);
    assert_eq!(found.len(), 1, "exactly one {kind} rendered");
    found[0]
}

/// Asserts a container runs with the restricted profile: no privilege escalation, no
/// capabilities, a read-only root and the runtime's seccomp profile.
fn assert_restricted(container: &Value) {
    let name = &container["name"];
    let security = &container["securityContext"];
    assert_eq!(security["allowPrivilegeEscalation"], false, "{name}: no privilege escalation");
    assert_eq!(security["readOnlyRootFilesystem"], true, "{name}: read-only root");
    assert_eq!(security["capabilities"]["drop"], serde_json::json!(["ALL"]), "{name}: drops every capability");
    assert_eq!(security["seccompProfile"]["type"], "RuntimeDefault", "{name}: seccomp");
    assert!(container["resources"]["requests"].is_object(), "{name}: resource requests");
    assert!(container["resources"]["limits"]["memory"].is_string(), "{name}: a memory limit");
}

/// The path of an HTTP probe.
fn probe_path(container: &Value, probe: &str) -> String {
    container[probe]["httpGet"]["path"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_lints_and_renders_restricted_workloads_least_privilege_rbac_and_checked_alerts() {
    let helm = Helm::locate().expect("helm builds");
    let chart_dir = chart().display().to_string();
    helm.run(&["lint", &chart_dir, "--strict"]).await.expect("helm lint passes with the defaults");
    let monitoring = ["monitoring.serviceMonitor.enabled=true", "monitoring.prometheusRule.enabled=true"];
    helm.run(&["lint", &chart_dir, "--strict", "--set", &monitoring.join(",")])
        .await
        .expect("helm lint passes with monitoring on");

    let docs = helm.template("ipwarden", NAMESPACE, &[], &[]).await.expect("helm template renders");
    let kinds: BTreeSet<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    for kind in ["Deployment", "DaemonSet", "PodDisruptionBudget", "ServiceAccount", "ClusterRole", "Role", "Service"] {
        assert!(kinds.contains(kind), "a {kind} is rendered ({kinds:?})");
    }
    assert!(!kinds.contains("ServiceMonitor") && !kinds.contains("PrometheusRule"), "monitoring CRs are opt-in");
    let accounts: BTreeSet<&str> =
        of_kind(&docs, "ServiceAccount").iter().filter_map(|a| a["metadata"]["name"].as_str()).collect();
    assert_eq!(accounts, BTreeSet::from(["ipwarden-agent", "ipwarden-controller"]), "one ServiceAccount per component");

    let deployment = one(&docs, "Deployment");
    assert_eq!(deployment["spec"]["replicas"], 2, "two controller replicas");
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "ipwarden-controller");
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "the controller runs as non-root");
    let controller = &pod["containers"][0];
    assert_restricted(controller);
    assert_eq!(probe_path(controller, "livenessProbe"), "/healthz");
    assert_eq!(probe_path(controller, "readinessProbe"), "/readyz");
    let pdb = one(&docs, "PodDisruptionBudget");
    assert_eq!(pdb["spec"]["selector"], deployment["spec"]["selector"], "the PDB covers the controller pods");

    let daemonset = one(&docs, "DaemonSet");
    let pod = &daemonset["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "ipwarden-agent");
    assert_eq!(pod["tolerations"], serde_json::json!([{"operator": "Exists"}]), "the agent tolerates every taint");
    let agent = &pod["containers"][0];
    assert_restricted(agent);
    assert_eq!(probe_path(agent, "readinessProbe"), "/readyz");
    let host_paths: BTreeSet<&str> =
        pod["volumes"].as_array().into_iter().flatten().filter_map(|v| v["hostPath"]["path"].as_str()).collect();
    for path in ["/run/ipwarden", "/var/lib/ipwarden", "/opt/cni/bin", "/etc/cni/net.d", "/run/containerd", "/run/crio"]
    {
        assert!(host_paths.contains(path), "{path} is a hostPath volume ({host_paths:?})");
    }
    let init = &pod["initContainers"][0];
    assert_eq!(init["name"], "install-cni");
    assert_restricted(init);
    let conflist = of_kind(&docs, "ConfigMap")
        .into_iter()
        .find_map(|c| c["data"]["conflist"].as_str())
        .expect("the conflist ConfigMap");
    let conflist: Value = serde_json::from_str(conflist).expect("the conflist is JSON");
    let ipam = &conflist["plugins"][0]["ipam"];
    assert_eq!(ipam["type"], "ipwarden-cni", "ipwarden is the network's IPAM");
    assert!(ipam.get("pools").is_none(), "no pools named by default: the pods' own rules choose");
    let socket_flag = format!("--socket={}", ipam["socket"].as_str().unwrap_or_default());
    assert!(
        agent["args"].as_array().into_iter().flatten().any(|a| *a == socket_flag.as_str()),
        "plugin and agent share the socket"
    );
    // The runtime's sockets: their host directories mounted read-only, the first that exists used.
    let cri_flag = "--cri-socket=/host/cri/0/containerd.sock,/host/cri/1/crio.sock";
    assert!(agent["args"].as_array().into_iter().flatten().any(|a| *a == cri_flag), "{cri_flag} in {}", agent["args"]);
    let cri_mounts: Vec<&Value> = agent["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["mountPath"].as_str().is_some_and(|p| p.starts_with("/host/cri/")))
        .collect();
    assert_eq!(cri_mounts.len(), 2, "one mount per socket directory");
    assert!(
        cri_mounts.iter().all(|m| m["readOnly"] == true && m["mountPropagation"] == "HostToContainer"),
        "the runtime's directories are read-only and follow the host's mounts: {cri_mounts:?}"
    );
    let without_cri =
        helm.template("ipwarden", NAMESPACE, &["agent.cri.enabled=false"], &[]).await.expect("renders without CRI");
    let args = one(&without_cri, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
    assert!(!args.contains("--cri-"), "no CRI flag when off: {args}");
    let adopting = helm
        .template("ipwarden", NAMESPACE, &["agent.adoptOnStart=true", "cni.networkName=pods"], &[])
        .await
        .expect("renders with start-up adoption");
    let args = one(&adopting, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"].clone();
    for flag in ["--adopt-on-start", "--adopt-network=pods"] {
        assert!(args.as_array().into_iter().flatten().any(|a| *a == flag), "{flag} in the agent's args: {args}");
    }

    let dashboard = of_kind(&docs, "ConfigMap")
        .into_iter()
        .find_map(|c| c["data"]["ipwarden.json"].as_str())
        .expect("the Grafana dashboard ConfigMap");
    let dashboard: Value = serde_json::from_str(dashboard).expect("the dashboard is JSON");
    let metrics_doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/metrics.md"))
        .expect("docs/metrics.md");
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().unwrap_or_default();
            let metric = expr.split(|c: char| !(c.is_alphanumeric() || c == '_')).find(|w| w.starts_with("ipwarden_"));
            let metric = metric.unwrap_or_else(|| panic!("panel {} queries an ipwarden metric", panel["title"]));
            let family = ["_bucket", "_total"].iter().fold(metric, |m, s| m.strip_suffix(s).unwrap_or(m));
            assert!(metrics_doc.contains(family), "{metric} of panel {} is documented", panel["title"]);
        }
    }

    let with_monitoring =
        helm.template("ipwarden", NAMESPACE, &monitoring, &[]).await.expect("renders with monitoring");
    let monitor = one(&with_monitoring, "ServiceMonitor");
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], "metrics");
    let services = of_kind(&with_monitoring, "Service");
    assert_eq!(services.len(), 2, "a metrics Service per component");
    for service in services {
        for (key, value) in monitor["spec"]["selector"]["matchLabels"].as_object().expect("selector") {
            assert_eq!(
                &service["metadata"]["labels"][key], value,
                "the ServiceMonitor selects {}",
                service["metadata"]["name"]
            );
        }
    }
    let rule = one(&with_monitoring, "PrometheusRule");
    let names: Vec<&str> = rule["spec"]["groups"][0]["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .filter_map(|r| r["alert"].as_str())
        .collect();
    assert_eq!(names, ALERTS, "the PrometheusRule's alerts");
    let alerts_doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/alerts.md")).expect("docs/alerts.md");
    for name in ALERTS {
        assert!(alerts_doc.contains(&format!("## {name}")), "docs/alerts.md has a section for {name}");
    }
    let rules_file = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ipwarden-rules-{}.json", std::process::id()));
    std::fs::write(&rules_file, rule["spec"].to_string()).expect("write the rule file");
    let promtool = e2e::binaries::prometheus_tool("promtool").expect("promtool");
    let checked =
        e2e::process::run_tool(&promtool, &["check".into(), "rules".into(), rules_file.display().to_string()], None)
            .await
            .expect("promtool check rules accepts the alerts");
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", ALERTS.len())),
        "promtool found every rule: {checked}"
    );

    let pools = ["cni.pools={pods-v4,pods-v6}"];
    let docs = helm.template("ipwarden", NAMESPACE, &pools, &[]).await.expect("renders with pools");
    let conflist =
        of_kind(&docs, "ConfigMap").into_iter().find_map(|c| c["data"]["conflist"].as_str()).expect("conflist");
    let conflist: Value = serde_json::from_str(conflist).expect("the conflist is JSON");
    assert_eq!(conflist["plugins"][0]["ipam"]["pools"], serde_json::json!(["pods-v4", "pods-v6"]), "cni.pools");
    let refused = helm.template("ipwarden", NAMESPACE, &["cni.pools={a,b,c}"], &[]).await;
    let message = refused.expect_err("the schema refuses a third pool").to_string();
    assert!(message.contains("/cni/pools"), "the schema names the bad value: {message}");

    let refused = helm.template("ipwarden", NAMESPACE, &["controller.replicas=0"], &[]).await;
    let message = refused.expect_err("the schema refuses zero controller replicas").to_string();
    assert!(message.contains("/controller/replicas"), "the schema names the bad value: {message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_installs_upgrades_and_uninstalls_the_chart_on_the_real_control_plane() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let options = e2e::ClusterOptions { nodes: 1, ..e2e::ClusterOptions::default() };
    let cluster = e2e::Cluster::start(options).await.expect("cluster starts");
    let client = cluster.client();
    let helm = Helm::locate().expect("helm builds").for_cluster(cluster.kubeconfig());
    let chart_dir = chart().display().to_string();
    helm.run(&["install", "ipwarden", &chart_dir, "--namespace", NAMESPACE, "--create-namespace"])
        .await
        .expect("helm install succeeds");

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in ["ippools.ipwarden.io", "ipblocks.ipwarden.io", "ipclaims.ipwarden.io"] {
        let crd = crds.get(name).await.unwrap_or_else(|e| panic!("CRD {name} installed from the chart: {e}"));
        assert_eq!(crd.spec.group, "ipwarden.io");
    }
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), NAMESPACE);
    for name in ["ipwarden-controller", "ipwarden-agent"] {
        accounts.get(name).await.unwrap_or_else(|e| panic!("ServiceAccount {name}: {e}"));
        Api::<ClusterRole>::all(client.clone()).get(name).await.unwrap_or_else(|e| panic!("ClusterRole {name}: {e}"));
    }
    Api::<Role>::namespaced(client.clone(), NAMESPACE).get("ipwarden-controller").await.expect("the controller's Role");
    let pdb = Api::<PodDisruptionBudget>::namespaced(client.clone(), NAMESPACE)
        .get("ipwarden-controller")
        .await
        .expect("the PodDisruptionBudget");
    assert!(pdb.spec.and_then(|s| s.max_unavailable).is_some(), "the PDB bounds disruptions");

    // The real Deployment, ReplicaSet and DaemonSet controllers create the pods (they do not
    // run an image: the nodes are simulated), bound to the chart's ServiceAccounts.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let by_account = wait::until("the controller and agent pods created", TIMEOUT, || async {
        let list = pods.list(&ListParams::default()).await.map_err(e2e::Error::kube("listing pods"))?;
        let accounts: Vec<(String, String)> = list
            .items
            .iter()
            .filter_map(|p| p.spec.as_ref())
            .map(|s| (s.service_account_name.clone().unwrap_or_default(), s.node_name.clone().unwrap_or_default()))
            .collect();
        let controllers = accounts.iter().filter(|(a, _)| a == "ipwarden-controller").count();
        let agents = accounts.iter().filter(|(a, node)| a == "ipwarden-agent" && node == "node-0").count();
        Ok(if controllers == 2 && agents == 1 {
            Probe::Done(accounts)
        } else {
            Probe::Pending(format!("{accounts:?}"))
        })
    })
    .await
    .expect("pods created");
    assert_eq!(by_account.len(), 3, "two controller pods and one agent pod");
    let daemonset =
        Api::<DaemonSet>::namespaced(client.clone(), NAMESPACE).get("ipwarden-agent").await.expect("the DaemonSet");
    assert_eq!(daemonset.status.map(|s| s.desired_number_scheduled), Some(1), "one agent per node");

    helm.run(&[
        "upgrade",
        "ipwarden",
        &chart_dir,
        "--namespace",
        NAMESPACE,
        "--reuse-values",
        "--set",
        "controller.gc.fullScanIntervalSeconds=60",
    ])
    .await
    .expect("helm upgrade succeeds");
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    let deployment = deployments.get("ipwarden-controller").await.expect("the Deployment");
    assert_eq!(deployment.spec.replicas, Some(2), "two controller replicas");
    let args = deployment
        .spec
        .template
        .spec
        .and_then(|s| s.containers.into_iter().next())
        .and_then(|c| c.args)
        .unwrap_or_default();
    assert!(args.contains(&"--full-scan-interval-seconds=60".to_string()), "the upgrade changed the flag: {args:?}");
    let status = helm.run(&["status", "ipwarden", "--namespace", NAMESPACE, "-o", "json"]).await.expect("helm status");
    let status: Value = serde_json::from_str(&status).expect("status JSON");
    assert_eq!(status["info"]["status"], "deployed");
    assert_eq!(status["version"], 2, "the upgrade is revision 2");

    helm.run(&["uninstall", "ipwarden", "--namespace", NAMESPACE]).await.expect("helm uninstall succeeds");
    assert!(deployments.get_opt("ipwarden-controller").await.expect("read").is_none(), "the Deployment is gone");
    assert!(crds.get_opt("ippools.ipwarden.io").await.expect("read").is_some(), "CRDs (and pools) outlive the release");
    cluster.stop();
}

/// The agent's hostPath directories may coincide (a socket and checkpoint in one directory, as
/// the real-node test has them): the DaemonSet then mounts that directory once, since the
/// apiserver refuses two volumeMounts at one path (found installing the chart on a real node).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_mounts_each_host_directory_once_when_its_socket_and_checkpoint_share_one() {
    let helm = Helm::locate().expect("helm builds");
    for values in [&[][..], &["agent.socketDir=/var/lib/ipwarden", "agent.checkpointDir=/var/lib/ipwarden"][..]] {
        let docs =
            helm.template("ipwarden", NAMESPACE, values, &["templates/agent-daemonset.yaml"]).await.expect("renders");
        let pod = &one(&docs, "DaemonSet")["spec"]["template"]["spec"];
        for container in pod["containers"].as_array().into_iter().chain(pod["initContainers"].as_array()).flatten() {
            let paths: Vec<&str> = container["volumeMounts"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["mountPath"].as_str())
                .collect();
            let unique: BTreeSet<&str> = paths.iter().copied().collect();
            assert_eq!(unique.len(), paths.len(), "{values:?}: {} mounts a path twice: {paths:?}", container["name"]);
        }
        let volumes: Vec<&str> =
            pod["volumes"].as_array().into_iter().flatten().filter_map(|v| v["name"].as_str()).collect();
        let mounted: BTreeSet<&str> = pod["containers"]
            .as_array()
            .into_iter()
            .chain(pod["initContainers"].as_array())
            .flatten()
            .flat_map(|c| c["volumeMounts"].as_array().into_iter().flatten().filter_map(|m| m["name"].as_str()))
            .collect();
        assert_eq!(
            volumes.iter().copied().collect::<BTreeSet<_>>(),
            mounted,
            "{values:?}: every volume mounted, none missing"
        );
    }
}

/// `agent.listenOnHostIP` binds the agent's metrics and probe port to the node's IP from the
/// downward API (several real nodes of the harness share one host's network); by default it
/// listens on every address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_listens_on_every_address_or_on_the_nodes_ip_only() {
    let helm = Helm::locate().expect("helm builds");
    for (values, address, host_ip) in [
        (&[][..], "--metrics-address=0.0.0.0:9612", false),
        (&["agent.listenOnHostIP=true"][..], "--metrics-address=[$(HOST_IP)]:9612", true),
    ] {
        let docs =
            helm.template("ipwarden", NAMESPACE, values, &["templates/agent-daemonset.yaml"]).await.expect("renders");
        let agent = &one(&docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0];
        let args: Vec<&str> = agent["args"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        assert!(args.contains(&address), "{values:?}: {args:?}");
        let env = agent["env"].as_array().into_iter().flatten();
        let from_host_ip: Vec<&Value> = env
            .filter(|e| e["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP" && e["name"] == "HOST_IP")
            .collect();
        assert_eq!(from_host_ip.len() == 1, host_ip, "{values:?}: {:?}", agent["env"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_bound_write_policies_match_only_the_agent_and_need_kubernetes_1_32() {
    let helm = Helm::locate().expect("helm builds");
    let docs = helm.template("ipwarden", NAMESPACE, &[], &[]).await.expect("helm template renders");
    let policies = of_kind(&docs, "ValidatingAdmissionPolicy");
    let resources: BTreeSet<String> = policies
        .iter()
        .flat_map(|p| {
            p["spec"]["matchConstraints"]["resourceRules"][0]["resources"].as_array().cloned().unwrap_or_default()
        })
        .filter_map(|r| r.as_str().map(String::from))
        .collect();
    assert_eq!(
        resources,
        ["ipblocks", "ipclaims", "leases"].map(String::from).into(),
        "one policy per kind the agent writes"
    );
    for policy in &policies {
        let name = &policy["metadata"]["name"];
        assert_eq!(
            policy["spec"]["matchConditions"][0]["expression"],
            "request.userInfo.username == 'system:serviceaccount:ipwarden-system:ipwarden-agent'",
            "{name} matches the agent's ServiceAccount only"
        );
        assert_eq!(policy["spec"]["failurePolicy"], "Fail", "{name} fails closed");
        let bound = of_kind(&docs, "ValidatingAdmissionPolicyBinding")
            .into_iter()
            .filter(|b| {
                b["spec"]["policyName"] == *name && b["spec"]["validationActions"] == serde_json::json!(["Deny"])
            })
            .count();
        assert_eq!(bound, 1, "{name} has one denying binding");
    }
    let off =
        helm.template("ipwarden", NAMESPACE, &["agent.nodeBoundWrites.enabled=false"], &[]).await.expect("renders");
    assert!(of_kind(&off, "ValidatingAdmissionPolicy").is_empty(), "no policy when turned off");
    let chart = chart().display().to_string();
    let old = helm.run(&["template", "ipwarden", chart.as_str(), "--kube-version", "1.31.0"]).await;
    assert!(
        matches!(&old, Err(e) if e.to_string().contains("needs Kubernetes 1.32 or later")),
        "an older cluster is told to turn the policies off: {old:?}"
    );
    let off = helm
        .run(&[
            "template",
            "ipwarden",
            chart.as_str(),
            "--kube-version",
            "1.31.0",
            "--set",
            "agent.nodeBoundWrites.enabled=false",
        ])
        .await;
    assert!(off.is_ok(), "renders for 1.31 with the policies off: {off:?}");
}
