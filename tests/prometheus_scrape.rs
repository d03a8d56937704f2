//! A real Prometheus (Debian's package) scrapes a real controller and agent through a scripted
//! scenario, evaluating the chart's alert rules: both targets are up, the key series carry the
//! values the scenario implies, the alerts the scenario should raise are active and the others
//! are not (then a pod reporting another pod's IP raises IpwardenIpConflicts), and
//! `promtool check metrics` has nothing to say about either exposition. Apart: claims the
//! controller cannot witness (an IPClaim CRD without its status subresource) raise
//! IpwardenClaimWitnessFailing.

mod support;

use std::collections::BTreeMap;
use std::path::PathBuf;

use e2e::prometheus::Prometheus;
use e2e::wait::{self, Probe};
use ipwarden::crd::IPClaim;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use support::{Ipwarden, TIMEOUT, create_pod, inject_record, ip_of, record_json, wait_pods_with_ips};

const NS: &str = "default";
const POOL: &str = "scrape";
const BLOCK: &str = "scrape-10-70-0-0-28";

/// The chart's alert rules as a Prometheus rule file, with a pool-fill threshold the scenario
/// crosses (3 of 10 IPs).
async fn rule_file(dir: &std::path::Path) -> PathBuf {
    let helm = e2e::helm::Helm::locate().expect("helm builds");
    let chart = e2e::helm::chart().display().to_string();
    let rendered = helm
        .run(&[
            "template",
            "ipwarden",
            &chart,
            "--show-only=templates/prometheusrule.yaml",
            "--set=monitoring.prometheusRule.enabled=true",
            // --set would make the ratio a string, which the values schema refuses.
            "--set-json=monitoring.prometheusRule.poolFullRatio=0.25",
        ])
        .await
        .expect("the PrometheusRule renders");
    let rule = e2e::helm::documents(&rendered).expect("YAML").pop().expect("one PrometheusRule");
    let path = dir.join("ipwarden-rules.json");
    std::fs::write(&path, rule["spec"].to_string()).expect("write the rule file");
    path
}

/// The value of the single series `expr` returns, if exactly one.
async fn single(prometheus: &Prometheus, expr: &str) -> Option<f64> {
    match prometheus.query(expr).await.expect("query").as_slice() {
        [sample] => Some(sample.value),
        _ => None,
    }
}

async fn promtool_check(port: u16, what: &str) {
    // No Accept header: the classic text format, which promtool parses.
    let text = e2e::ipwarden::get(port, "/metrics").await.expect("scrape /metrics");
    assert!(text.contains("# TYPE"), "{what} exposes metrics");
    let promtool = e2e::binaries::prometheus_tool("promtool").expect("promtool");
    let args = ["check".to_string(), "metrics".to_string()];
    let report = e2e::process::run_tool(&promtool, &args, Some(text.as_bytes()))
        .await
        .unwrap_or_else(|e| panic!("promtool check metrics on the {what}'s metrics: {e}"));
    assert_eq!(report.trim(), "", "promtool reports nothing on the {what}'s metrics");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_controller_and_an_agent_and_sees_the_scenario() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let spec =
        json!({"cidr": "10.70.0.0/28", "ranges": [{"start": "10.70.0.1", "end": "10.70.0.10"}], "default": true});
    let mut ipwarden = Ipwarden::start(1, &[(POOL, spec)], &[]).await;
    let client = ipwarden.client();
    let controller = ipwarden.start_controller("scrape-0", &["--full-scan-interval-seconds=2"]);
    ipwarden.wait_leader(controller).await;
    let rules = rule_file(ipwarden.cluster.dir()).await;
    let prometheus = Prometheus::start(
        &ipwarden.cluster.dir().join("prometheus"),
        &[
            ("ipwarden-controller", vec![ipwarden.controller_ports[controller]]),
            ("ipwarden-agent", vec![ipwarden.metrics_ports[0]]),
        ],
        &[rules],
        TIMEOUT,
    )
    .await
    .expect("Prometheus starts");

    // The scenario: three pods get IPs; a record whose pod never existed is a leak the sweep
    // releases; a record naming a stale UID for a live pod's IP is repaired.
    for i in 0..3 {
        create_pod(&client, NS, &format!("web-{i}"), "node-0", json!({"app": "web"})).await;
    }
    let pods = wait_pods_with_ips(&client, NS, "app=web", 3).await;
    let used: Vec<String> = pods.values().map(ip_of).collect();
    let free = (1..=10).map(|n| format!("10.70.0.{n}")).rfind(|ip| !used.contains(ip)).expect("a free IP");
    inject_record(
        &client,
        POOL,
        BLOCK,
        "10.70.0.0/28",
        &free,
        record_json(NS, "ghost", "ghost-uid", "node-0", None, false),
    )
    .await;
    let web0 = &pods["web-0"];
    let stale = record_json(NS, "web-0", "stale-uid", "node-0", None, false);
    inject_record(&client, POOL, BLOCK, "10.70.0.0/28", &ip_of(web0), stale).await;

    let expected: BTreeMap<&str, f64> = BTreeMap::from([
        (r#"ipwarden_controller_leader{job="ipwarden-controller"}"#, 1.0),
        // 10.70.0.1 is in the range but is the pool's (defaulted) gateway.
        (r#"ipwarden_pool_total_ips{pool="scrape"}"#, 9.0),
        (r#"ipwarden_pool_allocated_ips{pool="scrape"}"#, 3.0),
        (r#"sum(ipwarden_gc_releases_total{pool="scrape",reason="pod_gone"})"#, 1.0),
        (r#"sum(ipwarden_gc_repairs_total{pool="scrape"})"#, 1.0),
        // A loaded machine may make the runtime retry an ADD (and DEL the first sandbox), so
        // count the allocations that stayed.
        (
            r#"sum(ipwarden_agent_allocations_total{result="success",job="ipwarden-agent"})
               - (sum(ipwarden_agent_releases_total{result="released",job="ipwarden-agent"}) or vector(0))"#,
            3.0,
        ),
        (r#"ipwarden_agent_allocation_duration_seconds_count{job="ipwarden-agent"} >= bool 3"#, 1.0),
        (r#"sum(ipwarden_gc_release_failures_total)"#, 0.0),
    ]);
    let seen = wait::until("Prometheus sees the scenario's values", TIMEOUT, || async {
        let mut seen = BTreeMap::new();
        for expr in expected.keys() {
            seen.insert(*expr, single(&prometheus, expr).await.unwrap_or(f64::NAN));
        }
        let matches = expected.iter().all(|(expr, value)| {
            let got = seen[expr];
            got == *value || (value == &0.0 && got.is_nan())
        });
        Ok(if matches { Probe::Done(seen) } else { Probe::Pending(format!("{seen:?}")) })
    })
    .await
    .expect("the series reach the scenario's values");
    assert_eq!(seen.len(), expected.len());

    let up = prometheus.query("up").await.expect("query up");
    let mut jobs: Vec<(String, f64)> = up.iter().map(|s| (s.labels["job"].clone(), s.value)).collect();
    jobs.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        jobs,
        [("ipwarden-agent".to_string(), 1.0), ("ipwarden-controller".to_string(), 1.0)],
        "both targets up"
    );
    let sweeps = single(&prometheus, "ipwarden_gc_sweep_duration_seconds_count").await.unwrap_or_default();
    assert!(sweeps >= 1.0, "sweeps are timed ({sweeps})");

    // The alerts: the repair and the 30 % fill (threshold 25 % here) are active, nothing else.
    let active = wait::until("the scenario's alerts active", TIMEOUT, || async {
        let alerts = prometheus.alerts().await?;
        let names: BTreeMap<String, String> =
            alerts.iter().map(|a| (a.labels.get("alertname").cloned().unwrap_or_default(), a.state.clone())).collect();
        Ok(if names.contains_key("IpwardenRecordConflictsFound") && names.contains_key("IpwardenPoolNearlyExhausted") {
            Probe::Done(alerts)
        } else {
            Probe::Pending(format!("{names:?}"))
        })
    })
    .await
    .expect("alerts raised");
    for alert in &active {
        let name = alert.labels.get("alertname").map(String::as_str).unwrap_or_default();
        assert!(
            ["IpwardenRecordConflictsFound", "IpwardenPoolNearlyExhausted"].contains(&name),
            "only the scenario's alerts are active, not {name} ({})",
            alert.state
        );
        assert_eq!(alert.labels.get("pool").map(String::as_str), Some(POOL), "{name} names the pool");
    }
    let conflict = active.iter().find(|a| a.labels["alertname"] == "IpwardenRecordConflictsFound").expect("conflict");
    assert_eq!(conflict.state, "firing", "a repair alerts at once");
    let fill = active.iter().find(|a| a.labels["alertname"] == "IpwardenPoolNearlyExhausted").expect("fill");
    assert_eq!(fill.state, "pending", "pool fill waits its 10 minutes");

    // A conflict: a pod no kubelet runs (its node does not exist) reports web-2's IP.
    create_pod(&client, NS, "impostor", "node-absent", json!({"app": "impostor"})).await;
    let status = json!({"status": {"phase": "Running", "podIP": ip_of(&pods["web-2"]), "podIPs": [{"ip": ip_of(&pods["web-2"])}]}});
    Api::<Pod>::namespaced(client.clone(), NS)
        .patch_status("impostor", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("the impostor reports web-2's IP");
    wait::until("the conflict counted and alerting", TIMEOUT, || async {
        let conflicts = single(&prometheus, "max(ipwarden_ip_conflicts)").await;
        let alerts = prometheus.alerts().await?;
        let alerting =
            alerts.iter().any(|a| a.labels.get("alertname").map(String::as_str) == Some("IpwardenIpConflicts"));
        Ok(if conflicts == Some(1.0) && alerting {
            Probe::Done(())
        } else {
            Probe::Pending(format!("conflicts {conflicts:?}, alerting {alerting}"))
        })
    })
    .await
    .expect("Prometheus sees the conflict");

    promtool_check(ipwarden.controller_ports[controller], "controller").await;
    promtool_check(ipwarden.metrics_ports[0], "agent").await;
}

/// An IPClaim CRD without its status subresource (installed by an older version and not
/// upgraded): the controller cannot write a StatefulSet pod's witnessed binding, counts
/// `no_status_subresource` on each retry, and IpwardenClaimWitnessFailing is pending (its
/// `for` is 15 minutes) with that result; nothing else is active.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_the_controller_cannot_witness_raise_ipwarden_claim_witness_failing() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let mut ipwarden = Ipwarden::start(1, &[(POOL, json!({"cidr": "10.70.0.0/28", "default": true}))], &[]).await;
    let client = ipwarden.client();
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut crd = crds.get("ipclaims.ipwarden.io").await.expect("the IPClaim CRD");
    for version in &mut crd.spec.versions {
        if let Some(subresources) = version.subresources.as_mut() {
            subresources.status = None;
        }
    }
    crds.replace("ipclaims.ipwarden.io", &PostParams::default(), &crd).await.expect("drop the status subresource");
    // Served without it once a status write on a claim is refused as not found.
    let claims: Api<IPClaim> = Api::namespaced(client.clone(), NS);
    let probe: IPClaim = serde_json::from_value(json!({"apiVersion": "ipwarden.io/v1alpha1", "kind": "IPClaim",
        "metadata": {"name": "probe"}, "spec": {"podUid": "probe", "node": "node-0", "interfaces": [],
            "boundAt": "2026-01-01T00:00:00Z"}}))
    .expect("claim");
    claims.create(&PostParams::default(), &probe).await.expect("create the probe claim");
    wait::until("the IPClaim status subresource gone", TIMEOUT, || async {
        let stored = claims.get("probe").await.expect("the probe claim");
        Ok(match claims.replace_status("probe", &PostParams::default(), &stored).await {
            Err(kube::Error::Api(status)) if status.code == 404 => Probe::Done(()),
            other => Probe::Pending(format!("{:?}", other.map(|c| c.status))),
        })
    })
    .await
    .expect("the subresource is no longer served");
    claims.delete("probe", &Default::default()).await.expect("delete the probe claim");

    let controller = ipwarden.start_controller("scrape-0", &[]);
    ipwarden.wait_leader(controller).await;
    let rules = rule_file(ipwarden.cluster.dir()).await;
    let prometheus = Prometheus::start(
        &ipwarden.cluster.dir().join("prometheus"),
        &[("ipwarden-controller", vec![ipwarden.controller_ports[controller]])],
        &[rules],
        TIMEOUT,
    )
    .await
    .expect("Prometheus starts");
    support::create_statefulset(&client, NS, "web", json!({})).await;
    wait_pods_with_ips(&client, NS, "app=web", 1).await;

    let alert = wait::until("IpwardenClaimWitnessFailing pending", TIMEOUT, || async {
        let alerts = prometheus.alerts().await?;
        Ok(
            match alerts
                .iter()
                .find(|a| a.labels.get("alertname").map(String::as_str) == Some("IpwardenClaimWitnessFailing"))
            {
                Some(alert) => Probe::Done(alert.clone()),
                None => Probe::Pending(format!("{alerts:?}")),
            },
        )
    })
    .await
    .expect("the alert is raised");
    assert_eq!(alert.state, "pending", "it waits its 15 minutes");
    assert_eq!(alert.labels.get("result").map(String::as_str), Some("no_status_subresource"));
    let alerts = prometheus.alerts().await.expect("alerts");
    // One alert a result: a transient error may add `failed` beside it.
    let names: std::collections::BTreeSet<&str> =
        alerts.iter().filter_map(|a| a.labels.get("alertname").map(String::as_str)).collect();
    assert_eq!(names, ["IpwardenClaimWitnessFailing"].into(), "nothing else is active");
    let failed =
        single(&prometheus, r#"sum(ipwarden_claim_witness_writes_total{result="no_status_subresource"})"#).await;
    assert!(failed.is_some_and(|n| n >= 1.0), "counted: {failed:?}");
}
