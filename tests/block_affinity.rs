//! Block affinity on the real control plane, with small blocks (/28 in a /26 pool) so that
//! nodes cross block boundaries: each node fills its own blocks, claims a free one when they
//! are full, borrows single IPs from other nodes' blocks once no block is free (so every
//! address of the pool is used), and the leader frees the empty blocks of a node that is gone.

mod support;

use std::collections::{BTreeMap, BTreeSet};

use e2e::wait::{self, Probe};
use futures::StreamExt;
use ipwarden::crd::IPBlock;
use ipwarden::ipam::PoolLayout;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams};
use serde_json::json;
use support::{Ipwarden, TIMEOUT, create_pod, ip_of, records, wait_pods_with_ips};

const NS: &str = "default";
const CIDR: &str = "10.93.0.0/26";

/// Each block's CIDR and affinity.
async fn affinities(client: &kube::Client) -> BTreeMap<String, Option<String>> {
    let blocks = Api::<IPBlock>::all(client.clone()).list(&ListParams::default()).await.expect("list blocks");
    blocks.items.into_iter().map(|b| (b.spec.cidr, b.spec.affinity)).collect()
}

/// The block (CIDR) holding `ip`.
fn block_of(layout: &PoolLayout, ip: &str) -> String {
    layout.block_of(ip.parse().expect("an IP")).expect("in the pool").to_string()
}

/// Creates `count` pods named `<prefix>-<n>` on `node`, eight at a time.
async fn create_pods(client: &kube::Client, prefix: &str, node: &str, count: usize) {
    let creations = (0..count).map(|i| {
        let client = client.clone();
        let (name, node) = (format!("{prefix}-{i}"), node.to_string());
        async move { create_pod(&client, NS, &name, &node, json!({"app": "affinity", "node": node})).await }
    });
    futures::stream::iter(creations).buffer_unordered(8).collect::<Vec<()>>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_fill_their_own_blocks_claim_free_ones_borrow_when_none_is_left_and_a_gone_nodes_empty_block_is_freed() {
    let _ = tracing_subscriber::fmt().with_test_writer().with_env_filter("info,kube_client=off").try_init();
    let pool = json!({"cidr": CIDR, "blockSize": 28, "default": true});
    // The pool's own layout: its first address is its gateway, which no pod gets.
    let spec: ipwarden::crd::IPPoolSpec = serde_json::from_value(pool.clone()).expect("the pool's spec");
    let layout = ipwarden::ipam::pools::layout(&spec).expect("the pool's layout");
    let mut ipwarden = Ipwarden::start(3, &[("pool", pool)], &["--reuse-cooldown-seconds=0"]).await;
    let client = ipwarden.client();
    let controller = ipwarden.start_controller("only", &[]);
    ipwarden.wait_leader(controller).await;
    let blocks: Vec<_> = layout.blocks().collect();
    assert_eq!(blocks.len(), 4);
    // More than the fullest block holds, whichever block node-0 starts in.
    let fullest_block = blocks.iter().map(|b| layout.allocatable_in(*b).count()).max().expect("blocks");
    let capacity = usize::try_from(layout.capacity()).expect("a small pool");

    // node-0 fills its first block and claims a second one for the rest.
    create_pods(&client, "a", "node-0", fullest_block + 2).await;
    let node0 = wait_pods_with_ips(&client, NS, "node=node-0", fullest_block + 2).await;
    let owned = affinities(&client).await;
    let node0_blocks: BTreeSet<String> = node0.values().map(|p| block_of(&layout, &ip_of(p))).collect();
    assert_eq!(node0_blocks.len(), 2, "node-0's pods span two blocks: {node0_blocks:?}");
    for block in &node0_blocks {
        assert_eq!(owned.get(block), Some(&Some("node-0".to_string())), "{block} is node-0's: {owned:?}");
    }

    // node-1 and node-2 each claim one of the two blocks left.
    create_pods(&client, "b", "node-1", 1).await;
    create_pods(&client, "c", "node-2", 1).await;
    let node1 = wait_pods_with_ips(&client, NS, "node=node-1", 1).await;
    let node2 = wait_pods_with_ips(&client, NS, "node=node-2", 1).await;
    let owned = affinities(&client).await;
    let node2_block = block_of(&layout, &ip_of(&node2["c-0"]));
    assert_eq!(owned.get(&block_of(&layout, &ip_of(&node1["b-0"]))), Some(&Some("node-1".to_string())));
    assert_eq!(owned.get(&node2_block), Some(&Some("node-2".to_string())));
    assert_eq!(owned.len(), 4, "every block is claimed: {owned:?}");

    // No block is free: node-1 fills its own block, then borrows until every address is used.
    let used = node0.len() + 2;
    create_pods(&client, "d", "node-1", capacity - used).await;
    let all = wait_pods_with_ips(&client, NS, "app=affinity", capacity).await;
    let ips: BTreeSet<String> = all.values().map(ip_of).collect();
    assert_eq!(ips.len(), capacity, "every address of the pool is used, each once");
    assert_eq!(records(&client).await.len(), capacity, "one record per address");
    let owned_after = affinities(&client).await;
    assert_eq!(owned_after, owned, "borrowing claims no block");
    let borrowed: Vec<&Pod> = all
        .values()
        .filter(|p| p.metadata.labels.as_ref().and_then(|l| l.get("node")).is_some_and(|n| n == "node-1"))
        .filter(|p| owned[&block_of(&layout, &ip_of(p))].as_deref() != Some("node-1"))
        .collect();
    assert!(!borrowed.is_empty(), "node-1 borrowed from another node's block");

    // node-2 leaves: the pods in its block go (with their DELs), then the node.
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let in_node2_block: Vec<String> =
        all.iter().filter(|(_, p)| block_of(&layout, &ip_of(p)) == node2_block).map(|(name, _)| name.clone()).collect();
    for name in &in_node2_block {
        pods.delete(name, &DeleteParams::default()).await.expect("delete");
    }
    wait::until("node-2's block empty", TIMEOUT, || async {
        let left = records(&client).await.keys().filter(|ip| block_of(&layout, ip) == node2_block).count();
        Ok(if left == 0 { Probe::Done(()) } else { Probe::Pending(format!("{left} records")) })
    })
    .await
    .expect("the block empties");
    ipwarden.agents[2].kill();
    ipwarden.cluster.delete_node(2).await.expect("node-2 deleted");
    wait::until("the gone node's block freed", TIMEOUT, || async {
        let affinity = affinities(&client).await.get(&node2_block).cloned();
        Ok(match affinity {
            Some(None) => Probe::Done(()),
            other => Probe::Pending(format!("affinity {other:?}")),
        })
    })
    .await
    .expect("the leader releases the affinity");

    // node-1's own block is still full: the freed block is claimed before anything is
    // borrowed.
    create_pods(&client, "e", "node-1", 1).await;
    let claimed = wait_pods_with_ips(&client, NS, "app=affinity", capacity - in_node2_block.len() + 1).await;
    let new_ip = ip_of(&claimed["e-0"]);
    assert_eq!(block_of(&layout, &new_ip), node2_block, "the new pod's IP comes from the freed block");
    assert_eq!(affinities(&client).await.get(&node2_block), Some(&Some("node-1".to_string())), "node-1 claimed it");
}
