//! The node benchmark (`ipwarden-e2e node-bench`, docs/benchmarks.md, "Real nodes") through
//! its own code at a small size, so it cannot rot between the runs that measure: one real node,
//! one Deployment of 4 pods, every phase (create, re-create, recover, delete), host-local (the
//! floor) then ipwarden from its chart with a pool of exactly as many IPs as the 4 pods and the
//! 2 controller pods, where every re-created or recovered pod can only get an IP an old one
//! freed.

use std::path::Path;
use std::time::Duration;

use e2e::nodebench::{BenchIpam, NodeBenchOptions, Phase};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_phase_of_the_node_benchmark_completes_and_ipwarden_with_an_exact_pool_settles_after_each() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let options = NodeBenchOptions {
        nodes: 1,
        deployments: 1,
        replicas: 4,
        runs: vec![BenchIpam::HostLocal, BenchIpam::IpwardenExact],
        ipwarden: Path::new(env!("CARGO_BIN_EXE_ipwarden")).to_path_buf(),
        phase_timeout: Duration::from_secs(240),
        settle_timeout: Duration::from_secs(60),
    };
    let report = e2e::nodebench::run(&options).await.expect("the node benchmark runs");
    println!("{report}");
    assert!(report.all_completed(), "{report}");
    assert!(report.ipwarden_consistent(), "{report}");
    let phases = |ipam: BenchIpam| -> Vec<Phase> {
        report.runs.iter().filter(|r| r.ipam == ipam).flat_map(|r| r.phases.iter().map(|p| p.phase)).collect()
    };
    let all = vec![Phase::Create, Phase::Recreate, Phase::Recover, Phase::Delete];
    assert_eq!(phases(BenchIpam::HostLocal), all);
    assert_eq!(phases(BenchIpam::IpwardenExact), all);
    for run in &report.runs {
        for phase in run.phases.iter().filter(|p| p.phase != Phase::Delete) {
            assert_eq!(phase.pod_running.samples, 4, "{}: every pod's time measured: {report}", run.ipam);
            assert!(phase.apiserver_writes > 0, "{report}");
        }
    }
    let ipwarden = report.runs.iter().find(|r| r.ipam == BenchIpam::IpwardenExact).expect("the ipwarden run");
    let create = &ipwarden.phases[0];
    assert!(create.ipam_adds.is_some_and(|a| a.samples >= 4), "the agents' ADD histogram counted the ADDs: {report}");
    let json = serde_json::to_value(&report).expect("the report as JSON");
    assert_eq!(json["runs"][1]["ipam"], "ipwarden-exact");
    assert_eq!(json["runs"][1]["phases"][2]["phase"], "recover");
}
