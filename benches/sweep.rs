//! Sweep cost: 100k records in 1000 pools against a realistic pod cache (80% of records
//! belong to live pods, 10% to completed or replaced pods, 10% to pods that are gone).
//! Reports time per sweep (index build + plan) and, at the end, the process's peak RSS.
//! Run: `cargo bench --bench sweep`.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::Criterion;
use ipwarden::crd::{Allocation, IPBlock, IPBlockSpec, PodRef};
use ipwarden::gc::index::ClusterIndex;
use ipwarden::gc::rules::{NotReadyPolicy, RuleSettings};
use ipwarden::gc::sweep;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, NodeCondition, NodeStatus, Pod, PodIP, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

const POOLS: usize = 1000;
const RECORDS_PER_POOL: usize = 100;
const NODES: usize = 100;

struct Cluster {
    blocks: Vec<Arc<IPBlock>>,
    pods: Vec<Arc<Pod>>,
    nodes: Vec<Arc<Node>>,
}

fn cluster() -> Cluster {
    let mut blocks = Vec::new();
    let mut pods = Vec::new();
    for p in 0..POOLS {
        let (a, b) = (p / 250, p % 250);
        let mut allocations = BTreeMap::new();
        for r in 0..RECORDS_PER_POOL {
            let ip = format!("10.{a}.{b}.{}", r + 1);
            let name = format!("pod-{p}-{r}");
            let uid = format!("uid-{p}-{r}");
            let node = format!("node-{}", (p * RECORDS_PER_POOL + r) % NODES);
            allocations.insert(
                ip.clone(),
                Allocation {
                    pod: PodRef { namespace: "bench".into(), name: name.clone(), uid: uid.clone() },
                    node: node.clone(),
                    network: "ipwarden".into(),
                    container_id: format!("c-{p}-{r}"),
                    interface: "eth0".into(),
                    owner: None,
                    sticky: false,
                    allocated_at: Time(Timestamp::UNIX_EPOCH),
                    release_handshake: None,
                    migration_target: None,
                    repaired_at: None,
                },
            );
            let (phase, pod_uid) = match r % 10 {
                0 => continue, // gone
                1 if r % 20 == 1 => ("Succeeded", uid),
                1 => ("Running", format!("{uid}-replaced")),
                _ => ("Running", uid),
            };
            pods.push(Arc::new(Pod {
                metadata: ObjectMeta {
                    name: Some(name),
                    namespace: Some("bench".into()),
                    uid: Some(pod_uid),
                    ..ObjectMeta::default()
                },
                status: Some(PodStatus {
                    phase: Some(phase.into()),
                    pod_ips: Some(vec![PodIP { ip: ip.clone() }]),
                    ..PodStatus::default()
                }),
                ..Pod::default()
            }));
        }
        blocks.push(Arc::new(IPBlock::new(
            &format!("pool-{p}-10-{a}-{b}-0-24"),
            IPBlockSpec {
                pool: format!("pool-{p}"),
                cidr: format!("10.{a}.{b}.0/24"),
                allocations,
                released: BTreeMap::new(),
            },
        )));
    }
    let nodes = (0..NODES)
        .map(|n| {
            Arc::new(Node {
                metadata: ObjectMeta { name: Some(format!("node-{n}")), ..ObjectMeta::default() },
                status: Some(NodeStatus {
                    conditions: Some(vec![NodeCondition {
                        type_: "Ready".into(),
                        status: "True".into(),
                        ..NodeCondition::default()
                    }]),
                    ..NodeStatus::default()
                }),
                ..Node::default()
            })
        })
        .collect();
    Cluster { blocks, pods, nodes }
}

fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| l.strip_prefix("VmHWM:")?.trim().strip_suffix("kB")?.trim().parse().ok())
}

fn main() {
    let cluster = cluster();
    let settings = RuleSettings { additional_delay: Duration::from_secs(5), not_ready: NotReadyPolicy::Keep };
    let sticky = vec!["StatefulSet".to_string()];
    let records = POOLS * RECORDS_PER_POOL;
    let plan = sweep::plan(
        &ClusterIndex::build(&cluster.pods, &cluster.nodes, &[], &[], &sticky),
        &cluster.blocks,
        Timestamp::now(),
        &settings,
    );
    assert_eq!(plan.scanned, records);
    println!("sweep plan over {records} records: {} changes, kept {:?}", plan.changes.len(), plan.kept);

    let mut criterion =
        Criterion::default().sample_size(10).measurement_time(Duration::from_secs(20)).configure_from_args();
    criterion.bench_function("sweep_100k_records_1000_pools", |b| {
        b.iter(|| {
            let index = ClusterIndex::build(&cluster.pods, &cluster.nodes, &[], &[], &sticky);
            black_box(sweep::plan(&index, &cluster.blocks, Timestamp::now(), &settings))
        })
    });
    criterion.final_summary();
    if let Some(kib) = peak_rss_kib() {
        println!("peak RSS of the benchmark process: {} MiB", kib / 1024);
    }
}
