//! The allocation speed benchmark (`ipwarden-e2e churn --burst`, docs/benchmarks.md
//! "Allocation speed") through its own code at a small size, so it cannot rot between the
//! runs that measure: pods created at once on each node, every one Running with its own IP,
//! then deleted at once and every record released, with the report's counts; release marks
//! staged on a node before each burst answered and released.

use std::path::Path;
use std::time::Duration;

use e2e::burst::{self, BurstOptions};
use e2e::peers::Installed;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_small_bursts_on_two_nodes_run_every_pod_with_its_own_ip_and_release_every_record() {
    let binary = Path::new(env!("CARGO_BIN_EXE_ipwarden"));
    let plugin_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("burst-cni-bin");
    let network = e2e::ipwarden::network(binary, &plugin_dir).expect("the CNI network");
    let options = e2e::ClusterOptions { nodes: 2, network: Some(network), ..e2e::ClusterOptions::default() };
    let cluster = e2e::Cluster::start(options).await.expect("control plane and nodes");
    let installation = e2e::ipwarden::install(&cluster, binary).await.expect("ipwarden's agents and controllers");
    let installed = Installed::Ipwarden(installation);
    let options = BurstOptions {
        per_node: 8,
        bursts: 2,
        running_timeout: Duration::from_secs(120),
        release_timeout: Duration::from_secs(120),
        marks: 20,
    };
    let report = burst::run(&cluster, &installed, &options).await.expect("the bursts run");
    assert!(report.completed, "{report}");
    assert_eq!((report.summary.pods, report.summary.running, report.summary.released), (32, 32, 32), "{report}");
    assert_eq!(report.ip_conflicts, 0, "{report}");
    assert!(report.summary.adds_per_second.is_some_and(|rate| rate > 0.0), "{report}");
    assert!(report.summary.writes_per_pod_life.is_some(), "{report}");
    drop(installed);
    cluster.stop();
}
