//! The StatefulSet scale storm of the churn benchmark (`ipwarden-e2e churn --storm-cycles`,
//! docs/benchmarks.md) through its own code at a small size, so it cannot rot between the runs
//! that measure: two StatefulSets of 5 pods take turns on a pool of exactly 5 IPs, every
//! handover completes and no IP is on two live pods. (Which IP a returning pod gets is a figure
//! of the benchmark, not a goal: with every IP handed to the other set, none stays reserved.)
//! Before issue 35 the storm's pool held one IP fewer than its pods (its ranges named the
//! defaulted gateway) and the first handover never completed.

use std::path::Path;
use std::time::Duration;

use e2e::storm::{self, StormOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_handovers_of_the_storm_complete_with_no_ip_on_two_live_pods() {
    let binary = Path::new(env!("CARGO_BIN_EXE_ipwarden"));
    let plugin_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("storm-cni-bin");
    let network = e2e::ipwarden::network(binary, &plugin_dir).expect("the CNI network");
    let (cluster, installation) = storm::start_ipwarden(2, binary, network).await.expect("the storm's cluster");
    let options = StormOptions { cycles: 2, handover_timeout: Duration::from_secs(120) };
    let report = storm::run(&cluster, &options).await.expect("the storm runs");
    assert!(report.completed, "{report:?}");
    assert_eq!(report.cycles, 2, "{report:?}");
    assert_eq!(report.ip_conflicts, 0, "{report:?}");
    drop(installation);
    cluster.stop();
}
