//! `ipwarden-e2e up` as `make demo` and `make cluster-up` run it, through its own code
//! (`e2e::up`): what a newcomer reads while the demo starts and runs, and flags passed through
//! to ipwarden's processes.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use e2e::up::{Say, UpOptions};
use e2e::wait::{self, Probe};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;

/// The bound on every wait of these tests.
const TIMEOUT: Duration = Duration::from_secs(180);

fn options(name: &str) -> UpOptions {
    UpOptions {
        nodes: 2,
        kubeconfig: PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("up-{name}-{}", std::process::id()))
            .join("kubeconfig"),
        ipwarden: Some(Path::new(env!("CARGO_BIN_EXE_ipwarden")).to_path_buf()),
        agent_args: Vec::new(),
        controller_args: Vec::new(),
        demo: None,
        runtime_gc: e2e::cni::RuntimeGc::default(),
        real_nodes: 0,
        runtime: e2e::realnode::Runtime::default(),
        install: e2e::up::Install::default(),
    }
}

/// A [`Say`] that keeps the lines, and the lines kept.
fn kept_lines() -> (Say, Arc<Mutex<Vec<String>>>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let kept = lines.clone();
    (Arc::new(move |line: &str| kept.lock().expect("lines lock").push(line.to_string())), lines)
}

/// Everything the test's thread logs at ERROR, as text.
#[derive(Clone, Default)]
struct ErrorLog(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for ErrorLog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("error log lock").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ErrorLog {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("error log lock")).into_owned()
    }
}

// One thread: the ERROR capture below is this thread's subscriber, and every task of the test
// (the harness's probes, watches and kubelets) runs on it.
#[tokio::test(flavor = "current_thread")]
async fn the_demo_starts_without_error_lines_then_prints_a_summary_a_release_and_a_statefulset_pod_back_with_its_ip() {
    let errors = ErrorLog::default();
    let writer = errors.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::ERROR)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _capture = tracing::subscriber::set_default(subscriber);
    let (say, lines) = kept_lines();
    let up = e2e::up::start(&UpOptions { demo: Some(Duration::from_secs(2)), ..options("demo") }, say)
        .await
        .expect("the demo starts");
    let started = lines.lock().expect("lines lock").clone();
    assert_eq!(errors.text(), "", "ERROR lines while the demo started; it printed:\n{}", started.join("\n"));
    assert!(started.iter().any(|l| l.starts_with("cluster ready")), "no summary:\n{}", started.join("\n"));

    let seen = wait::until("a release and a StatefulSet pod back with its IP", TIMEOUT, || {
        let lines = lines.lock().expect("lines lock").clone();
        async move {
            let released = lines.iter().any(|l| l.contains(" released"));
            let back = lines.iter().any(|l| l.contains(" back with its IP ") && l.contains("(StatefulSet web)"));
            Ok(if released && back { Probe::Done(lines) } else { Probe::Pending(lines.join("\n")) })
        }
    })
    .await
    .expect("the demo narrates");
    let deleted = seen.iter().filter(|l| l.contains(" deleted")).count();
    assert!(deleted >= 1, "no pod deletion line:\n{}", seen.join("\n"));
    assert_eq!(errors.text(), "", "ERROR lines while the demo ran; it printed:\n{}", seen.join("\n"));
    up.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_passes_agent_and_controller_flags_to_every_agent_and_controller() {
    let (say, _lines) = kept_lines();
    let options = UpOptions {
        agent_args: vec!["--lease-duration-seconds=17".to_string()],
        controller_args: vec!["--lease-duration-seconds=13".to_string()],
        ..options("flags")
    };
    let up = e2e::up::start(&options, say).await.expect("the cluster starts");
    let cluster = up.cluster();
    let leases: Api<Lease> = Api::namespaced(cluster.client(), "default");
    let mut names: Vec<String> = cluster.nodes().iter().map(|n| format!("ipwarden-agent-{}", n.name())).collect();
    names.push("ipwarden-controller".to_string());
    let durations = wait::until("every agent Lease and the leader Lease written", TIMEOUT, || {
        let leases = leases.clone();
        let names = names.clone();
        async move {
            let mut durations = Vec::new();
            for name in &names {
                let lease = leases.get_opt(name).await.map_err(e2e::Error::kube(format!("reading Lease {name}")))?;
                match lease.and_then(|l| l.spec).and_then(|s| s.lease_duration_seconds) {
                    Some(seconds) => durations.push(seconds),
                    None => return Ok(Probe::Pending(format!("Lease {name} not written yet"))),
                }
            }
            Ok(Probe::Done(durations))
        }
    })
    .await
    .expect("the Leases");
    assert_eq!(durations, [17, 17, 13], "agent Leases of node-0 and node-1, then the controller's");
    up.stop();
}

/// `make demo DEMO_ARGS="--nodes 0 --real-nodes 1 --install chart"`: ipwarden from its chart on
/// a real node, the demo's pods there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_on_the_chart_installed_on_a_real_node_narrates_a_release_and_a_statefulset_pod_back_with_its_ip() {
    let (say, lines) = kept_lines();
    let options = UpOptions {
        nodes: 0,
        real_nodes: 1,
        install: e2e::up::Install::Chart,
        demo: Some(Duration::from_secs(2)),
        ..options("chart")
    };
    let up = e2e::up::start(&options, say).await.expect("the demo starts on the chart");
    let started = lines.lock().expect("lines lock").clone();
    assert!(
        started
            .iter()
            .any(|l| l.starts_with("cluster ready: real node real-node-0 running ipwarden from its Helm chart")),
        "no summary of the chart:\n{}",
        started.join("\n")
    );
    wait::until("a release and a StatefulSet pod back with its IP", TIMEOUT, || {
        let lines = lines.lock().expect("lines lock").clone();
        async move {
            let released = lines.iter().any(|l| l.contains(" released"));
            let back = lines.iter().any(|l| l.contains(" back with its IP ") && l.contains("(StatefulSet web)"));
            Ok(if released && back { Probe::Done(()) } else { Probe::Pending(lines.join("\n")) })
        }
    })
    .await
    .expect("the demo narrates");
    up.stop();
}

#[test]
fn up_refuses_the_chart_without_real_nodes_or_with_simulated_ones() {
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    let (say, _lines) = kept_lines();
    let options = UpOptions { install: e2e::up::Install::Chart, ..options("chart-refused") };
    let refused = runtime.block_on(e2e::up::start(&options, say)).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(refused.contains("--nodes 0 --real-nodes N"), "{refused}");
}
