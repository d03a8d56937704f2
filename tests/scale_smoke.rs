//! The scale benchmark (`ipwarden-e2e scale`, docs/benchmarks.md "Scale") through its own code
//! at a small size, so it cannot rot between the runs that measure: Node objects without
//! kubelets, pods and records written in bulk, the controller pair, the quiet window and the
//! injected leaks answered by the simulated agents.

use std::path::Path;
use std::time::Duration;

use e2e::scale::{self, ScaleOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scale_benchmark_fills_a_small_cluster_and_the_controller_reclaims_every_injected_leak() {
    let mut cluster = e2e::Cluster::start(scale::cluster_options()).await.expect("control plane");
    let options = ScaleOptions {
        nodes: 10,
        pods: 150,
        pools: 3,
        leaks: 10,
        quiet: Duration::from_secs(2),
        ..ScaleOptions::default()
    };
    let report =
        scale::run(&mut cluster, Path::new(env!("CARGO_BIN_EXE_ipwarden")), &options).await.expect("benchmark run");
    assert_eq!(report.startup.first_sweep_scanned, Some(150), "{report}");
    assert!(report.startup.leadership_to_first_sweep_seconds.is_some(), "{report}");
    assert_eq!(report.quiet.controller_per_record_gets, 0, "no per-record reads while nothing changes: {report}");
    assert_eq!((report.leaks.injected, report.leaks.reclaimed), (10, 10), "{report}");
    assert!(report.leaks.unreclaimed.is_empty(), "{report}");
    assert_eq!(report.leaks.answered, 10, "each leak went through the release handshake: {report}");
    assert_eq!(report.controllers.iter().filter(|c| c.leader).count(), 1, "{report}");
    cluster.stop();
}
