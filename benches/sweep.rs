//! Sweep cost: 100k records in 1000 pools against a realistic pod set (80% of records
//! belong to live pods, 10% to completed or replaced pods, 10% to pods that are gone),
//! applied once to the controller's incremental index as its watches would. Reports the time
//! of one sweep plan over the index, the cost of one pod event and one block event applied to
//! it, the time to index the whole cluster at start, and how much the process's RSS grows
//! when the index is built over the objects (what the index itself keeps beyond the shared
//! blocks). Run: `cargo bench --bench sweep`.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::Criterion;
use ipwarden::crd::{Allocation, IPBlock, IPBlockSpec, IPPool, IPPoolSpec, PodRef};
use ipwarden::gc::index::{ClusterIndex, Kind, Watched};
use ipwarden::gc::rules::{NotReadyPolicy, RuleSettings};
use ipwarden::gc::sweep;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, NodeCondition, NodeStatus, Pod, PodIP, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

const POOLS: usize = 1000;
const RECORDS_PER_POOL: usize = 100;
const NODES: usize = 100;

struct Cluster {
    pools: Vec<Arc<IPPool>>,
    blocks: Vec<Arc<IPBlock>>,
    pods: Vec<Arc<Pod>>,
    nodes: Vec<Arc<Node>>,
}

fn cluster() -> Cluster {
    let mut blocks = Vec::new();
    let mut pods = Vec::new();
    let mut pools = Vec::new();
    for p in 0..POOLS {
        let (a, b) = (p / 250, p % 250);
        let spec: IPPoolSpec =
            serde_json::from_value(serde_json::json!({"cidr": format!("10.{a}.{b}.0/24"), "blockSize": 24}))
                .expect("pool spec");
        pools.push(Arc::new(IPPool::new(&format!("pool-{p}"), spec)));
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
                    held_for: None,
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
                affinity: None,
                ..IPBlockSpec::default()
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
    Cluster { pools, blocks, pods, nodes }
}

fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| l.strip_prefix("VmHWM:")?.trim().strip_suffix("kB")?.trim().parse().ok())
}

fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok())
}

/// The index of `cluster`, listed as the controller's watches list it.
fn index_of(cluster: &Cluster, sticky: &[String]) -> ClusterIndex {
    let mut index = ClusterIndex::new(sticky, Duration::from_secs(20));
    for kind in [Kind::Pool, Kind::Node, Kind::Pod, Kind::Block] {
        index.relist_started(kind);
    }
    cluster.pools.iter().for_each(|o| index.apply(Watched::Pool(o)));
    cluster.nodes.iter().for_each(|o| index.apply(Watched::Node(o)));
    cluster.pods.iter().for_each(|o| index.apply(Watched::Pod(o)));
    cluster.blocks.iter().for_each(|o| index.apply(Watched::Block(o)));
    for kind in [Kind::Pool, Kind::Node, Kind::Pod, Kind::Block] {
        index.relist_done(kind);
    }
    index
}

fn main() {
    let cluster = cluster();
    let settings = RuleSettings { additional_delay: Duration::from_secs(5), not_ready: NotReadyPolicy::Keep };
    let sticky = vec!["StatefulSet".to_string()];
    let records = POOLS * RECORDS_PER_POOL;
    let objects = rss_kib();
    let mut index = index_of(&cluster, &sticky);
    if let (Some(objects), Some(indexed)) = (objects, rss_kib()) {
        println!(
            "RSS with the pod objects and blocks: {} MiB; grown by the index ({} pods trimmed, blocks shared): {} MiB",
            objects / 1024,
            index.pod_count(),
            indexed.saturating_sub(objects) / 1024
        );
    }
    let plan = sweep::plan(&index, index.blocks_by_name().values(), Timestamp::now(), &settings);
    assert_eq!(plan.scanned, records);
    println!("sweep plan over {records} records: {} changes, kept {:?}", plan.changes.len(), plan.kept);

    let mut criterion =
        Criterion::default().sample_size(10).measurement_time(Duration::from_secs(20)).configure_from_args();
    criterion.bench_function("sweep_100k_records_1000_pools", |b| {
        b.iter(|| black_box(sweep::plan(&index, index.blocks_by_name().values(), Timestamp::now(), &settings)))
    });
    criterion
        .bench_function("index_90k_pods_100k_records_at_start", |b| b.iter(|| black_box(index_of(&cluster, &sticky))));
    let mut criterion = Criterion::default().configure_from_args();
    // One pod event at 100k pods: a live pod starts terminating, then is running again.
    let pod = (*cluster.pods[cluster.pods.len() / 2]).clone();
    let mut terminating = pod.clone();
    terminating.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
    let mut flip = false;
    criterion.bench_function("one_pod_event_at_90k_pods", |b| {
        b.iter(|| {
            flip = !flip;
            index.apply(Watched::Pod(if flip { &terminating } else { &pod }));
        })
    });
    // One block event: an agent's write to a block of 100 records.
    let block = cluster.blocks[POOLS / 2].clone();
    criterion.bench_function("one_block_event_of_100_records", |b| b.iter(|| index.apply(Watched::Block(&block))));
    criterion.final_summary();
    if let Some(kib) = peak_rss_kib() {
        println!("peak RSS of the benchmark process: {} MiB", kib / 1024);
    }
}
