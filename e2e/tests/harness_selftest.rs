//! Self-test of the harness on the real control plane with the real `host-local` CNI plugin:
//! the StatefulSet, Job and Deployment controllers drive pods through the simulated kubelet,
//! and every step is checked against the apiserver and the plugin's own state.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use e2e::wait::{self, Probe};
use e2e::{Cluster, ClusterOptions, Error};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

const NS: &str = "default";
const STEP_TIMEOUT: Duration = Duration::from_secs(120);

fn labels(app: &str) -> serde_json::Value {
    json!({"matchLabels": {"app": app}})
}

fn pod_template(app: &str, annotations: serde_json::Value, restart: &str) -> serde_json::Value {
    json!({
        "metadata": {"labels": {"app": app}, "annotations": annotations},
        "spec": {
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "app", "image": "registry.invalid/ipwarden-e2e/app:1"}],
        },
    })
}

fn object<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> T {
    serde_json::from_value(value).expect("test object is valid")
}

/// Running pods of `app` by name, with their IP.
async fn running_pods(client: &Client, app: &str) -> Result<BTreeMap<String, Pod>, Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let list = pods
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await
        .map_err(Error::kube(format!("listing pods of {app}")))?;
    Ok(list
        .items
        .into_iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| (p.name_any(), p))
        .collect())
}

fn pod_ip(pod: &Pod) -> String {
    pod.status.as_ref().and_then(|s| s.pod_ip.clone()).unwrap_or_default()
}

/// Waits until exactly `count` pods of `app` run, and returns name -> IP.
async fn wait_running(client: &Client, app: &str, count: usize) -> BTreeMap<String, String> {
    wait::until(&format!("{count} running pods of {app}"), STEP_TIMEOUT, || async {
        let pods = running_pods(client, app).await?;
        let all: Api<Pod> = Api::namespaced(client.clone(), NS);
        let total = all
            .list(&ListParams::default().labels(&format!("app={app}")))
            .await
            .map_err(Error::kube("listing pods"))?
            .items
            .len();
        Ok(if pods.len() == count && total == count {
            Probe::Done(pods.iter().map(|(name, pod)| (name.clone(), pod_ip(pod))).collect())
        } else {
            Probe::Pending(format!("{} running of {total}", pods.len()))
        })
    })
    .await
    .expect("pods reach Running")
}

/// Every IP the nodes' host-local stores hold, read from the plugin's own files.
fn host_local_reservations(cluster: &Cluster) -> BTreeSet<String> {
    cluster
        .nodes()
        .iter()
        .filter_map(|node| std::fs::read_dir(node.dir().join("host-local/e2e-host-local")).ok())
        .flatten()
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.parse::<std::net::IpAddr>().is_ok())
        .collect()
}

fn assert_distinct_and_reserved(cluster: &Cluster, ips: &BTreeMap<String, String>) {
    let distinct: BTreeSet<_> = ips.values().collect();
    assert_eq!(distinct.len(), ips.len(), "every pod has its own IP: {ips:?}");
    assert!(ips.values().all(|ip| ip.starts_with("10.244.")), "IPs come from host-local: {ips:?}");
    let reserved = host_local_reservations(cluster);
    for ip in ips.values() {
        assert!(reserved.contains(ip), "host-local holds a reservation for {ip}: {reserved:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_runs_statefulsets_jobs_and_deployments_through_a_real_cni_plugin() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info").try_init();
    let cluster = Cluster::start(ClusterOptions::default()).await.expect("cluster starts");
    let client = cluster.client();

    let version = client.apiserver_version().await.expect("/version");
    assert_eq!(version.git_version, "v1.37.2", "the apiserver reports the pinned release");

    // kubectl built with the control plane sees Ready nodes through the admin kubeconfig.
    let output = std::process::Command::new(cluster.kubectl())
        .args(["--kubeconfig"])
        .arg(cluster.kubeconfig())
        .args(["get", "nodes", "--no-headers"])
        .output()
        .expect("kubectl runs");
    let text = String::from_utf8_lossy(&output.stdout);
    assert_eq!(text.lines().filter(|l| l.contains(" Ready ")).count(), 3, "kubectl lists 3 Ready nodes: {text}");

    // StatefulSet of 3: Running with distinct IPs that host-local really reserved.
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), NS);
    statefulsets
        .create(
            &PostParams::default(),
            &object(json!({
                "metadata": {"name": "web"},
                "spec": {"replicas": 3, "serviceName": "web", "selector": labels("web"),
                         "template": pod_template("web", json!({}), "Always")},
            })),
        )
        .await
        .expect("create StatefulSet");
    let first = wait_running(&client, "web", 3).await;
    assert_eq!(first.keys().cloned().collect::<Vec<_>>(), ["web-0", "web-1", "web-2"]);
    assert_distinct_and_reserved(&cluster, &first);

    // Scaled to 0: every pod goes, and CNI DEL released every reservation.
    let scale = |replicas: i32| json!({"spec": {"replicas": replicas}});
    statefulsets.patch("web", &PatchParams::default(), &Patch::Merge(scale(0))).await.expect("scale to 0");
    wait_running(&client, "web", 0).await;
    wait::until("host-local reservations released by CNI DEL", STEP_TIMEOUT, || async {
        let left = host_local_reservations(&cluster);
        let sandboxes: usize = cluster.nodes().iter().map(|n| n.sandboxes().len()).sum();
        Ok(if left.is_empty() && sandboxes == 0 {
            Probe::Done(())
        } else {
            Probe::Pending(format!("{left:?}, {sandboxes} sandboxes"))
        })
    })
    .await
    .expect("DEL releases every IP");

    // And back to 3.
    statefulsets.patch("web", &PatchParams::default(), &Patch::Merge(scale(3))).await.expect("scale to 3");
    let again = wait_running(&client, "web", 3).await;
    assert_distinct_and_reserved(&cluster, &again);

    // A Job of 2 completions: pods run, exit 0, the Job completes, their sandboxes go.
    let jobs: Api<Job> = Api::namespaced(client.clone(), NS);
    jobs.create(
        &PostParams::default(),
        &object(json!({
            "metadata": {"name": "batch"},
            "spec": {"completions": 2, "parallelism": 2, "backoffLimit": 0,
                     "template": pod_template("batch", json!({e2e::kubelet::RUN_SECONDS_ANNOTATION: "1"}), "Never")},
        })),
    )
    .await
    .expect("create Job");
    wait::until("Job batch Complete", STEP_TIMEOUT, || async {
        let job = jobs.get("batch").await.map_err(Error::kube("reading Job batch"))?;
        let status = job.status.unwrap_or_default();
        let complete = status.conditions.iter().flatten().any(|c| c.type_ == "Complete" && c.status == "True");
        Ok(if complete { Probe::Done(()) } else { Probe::Pending(format!("succeeded {:?}", status.succeeded)) })
    })
    .await
    .expect("Job completes");
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let job_pods = pods.list(&ListParams::default().labels("app=batch")).await.expect("list Job pods").items;
    assert_eq!(job_pods.len(), 2);
    for pod in &job_pods {
        assert_eq!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded"));
        let uid = pod.uid().unwrap_or_default();
        assert!(
            cluster.nodes().iter().all(|n| !n.sandboxes().contains_key(&uid)),
            "a finished pod's sandbox is torn down"
        );
    }

    // A Deployment rolls out a new revision: new pods replace the old ones.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    deployments
        .create(
            &PostParams::default(),
            &object(json!({
                "metadata": {"name": "api"},
                "spec": {"replicas": 2, "selector": labels("api"),
                         "template": pod_template("api", json!({"revision": "1"}), "Always")},
            })),
        )
        .await
        .expect("create Deployment");
    let v1 = wait_running(&client, "api", 2).await;
    let bump = json!({"spec": {"template": {"metadata": {"annotations": {"revision": "2"}}}}});
    deployments.patch("api", &PatchParams::default(), &Patch::Merge(bump)).await.expect("new revision");
    wait::until("Deployment api rolled out", STEP_TIMEOUT, || async {
        let d = deployments.get("api").await.map_err(Error::kube("reading Deployment api"))?;
        let generation = d.metadata.generation.unwrap_or_default();
        let s = d.status.unwrap_or_default();
        let done = s.observed_generation.unwrap_or_default() >= generation
            && s.updated_replicas == Some(2)
            && s.available_replicas == Some(2)
            && s.replicas == Some(2);
        Ok(if done { Probe::Done(()) } else { Probe::Pending(format!("{s:?}")) })
    })
    .await
    .expect("rollout completes");
    let v2 = wait_running(&client, "api", 2).await;
    assert!(v1.keys().all(|old| !v2.contains_key(old)), "the old revision's pods are gone: {v1:?} -> {v2:?}");
    assert_distinct_and_reserved(&cluster, &v2);

    let dir = cluster.dir().to_path_buf();
    cluster.stop();
    assert!(!dir.exists(), "a clean stop removes the run directory");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pod_keeps_its_sandbox_and_ip_while_its_containers_stop() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info").try_init();
    let cluster =
        Cluster::start(ClusterOptions { nodes: 1, ..ClusterOptions::default() }).await.expect("cluster starts");
    let client = cluster.client();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    // A 60 s grace, containers that exit 5 s after SIGTERM.
    let stop_seconds = 5;
    let mut template =
        pod_template("drain", json!({e2e::kubelet::STOP_SECONDS_ANNOTATION: stop_seconds.to_string()}), "Always");
    template["metadata"]["name"] = json!("drain");
    template["spec"]["nodeName"] = json!("node-0");
    template["spec"]["terminationGracePeriodSeconds"] = json!(60);
    pods.create(&PostParams::default(), &object(template)).await.expect("create pod");
    let ip = wait_running(&client, "drain", 1).await.remove("drain").expect("drain runs");
    let uid = pods.get("drain").await.expect("pod").uid().unwrap_or_default();

    let deleting = std::time::Instant::now();
    pods.delete("drain", &Default::default()).await.expect("delete");
    let deleted = std::time::Instant::now();
    let node = &cluster.nodes()[0];
    let drained = wait::until("the draining pod's sandbox torn down", STEP_TIMEOUT, || async {
        // The kubelet starts the DEL no earlier than the containers' stop, `stop_seconds` after
        // deletion began (whole seconds, so up to 1 s early), and deletion began after
        // `deleting`: reads begun within `stop_seconds - 1` of it see the pod still draining.
        let draining = deleting.elapsed() < Duration::from_secs(stop_seconds - 1);
        let pod = pods.get_opt("drain").await.map_err(Error::kube("reading pod drain"))?;
        let reserved = host_local_reservations(&cluster).contains(&ip);
        if !node.sandboxes().contains_key(&uid) {
            return Ok(Probe::Done(deleted.elapsed()));
        }
        if !draining {
            return Ok(Probe::Pending("the containers stopping".into()));
        }
        // While the sandbox is up the pod still runs with its IP, and host-local holds it.
        let phase = pod.as_ref().and_then(|p| p.status.as_ref()).and_then(|s| s.phase.clone());
        assert_eq!(phase.as_deref(), Some("Running"), "a draining pod keeps Running");
        assert_eq!(pod.as_ref().map(pod_ip), Some(ip.clone()), "a draining pod keeps its IP");
        assert!(reserved, "the draining pod's IP stays reserved");
        Ok(Probe::Pending("draining".into()))
    })
    .await
    .expect("the sandbox goes once the containers stopped");
    // deletionTimestamp has whole seconds, so deletion may seem to have begun up to 1 s early.
    assert!(
        drained >= Duration::from_secs(stop_seconds - 1),
        "the sandbox stayed while the containers stopped: {drained:?}"
    );
    assert!(
        drained < Duration::from_secs(30),
        "the sandbox went when the containers stopped, not at the grace's end: {drained:?}"
    );
    wait::until("the pod removed and its reservation released", STEP_TIMEOUT, || async {
        let gone = pods.get_opt("drain").await.map_err(Error::kube("reading pod drain"))?.is_none();
        let released = !host_local_reservations(&cluster).contains(&ip);
        Ok(if gone && released { Probe::Done(()) } else { Probe::Pending(format!("gone {gone}, released {released}")) })
    })
    .await
    .expect("DEL, then the pod is deleted");
}
