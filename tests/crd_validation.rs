//! The CRDs as the real apiserver enforces them: a malformed CIDR, host bits, a range or
//! gateway outside the CIDR, a block size that does not fit, and changing an immutable
//! field are refused with a clear message; a well-formed pool is accepted.

use std::time::Duration;

use e2e::{Cluster, ClusterOptions};
use ipwarden::crd::{IPPool, IPPoolSpec};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

fn pool(name: &str, spec: serde_json::Value) -> IPPool {
    serde_json::from_value(json!({
        "apiVersion": "ipwarden.io/v1alpha1",
        "kind": "IPPool",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .expect("test pool is well-typed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_apiserver_refuses_malformed_pools_with_clear_messages() {
    let cluster = Cluster::start(ClusterOptions { nodes: 0, ..ClusterOptions::default() }).await.expect("cluster");
    let client = cluster.client();
    ipwarden::crd::install(&client, Duration::from_secs(60)).await.expect("CRDs install");
    let pools: Api<IPPool> = Api::all(client);

    let good = pool(
        "good",
        json!({"cidr": "10.10.0.0/16", "ranges": [{"start": "10.10.1.0", "end": "10.10.1.255"}],
               "exclude": ["10.10.1.7", "10.10.1.128/30"], "gateway": "10.10.0.1", "blockSize": 24, "default": true}),
    );
    let created = pools.create(&PostParams::default(), &good).await.expect("a well-formed pool is accepted");
    assert_eq!(created.spec, good.spec);
    let v6 = pool("v6", json!({"cidr": "fd00:10::/64", "blockSize": 120}));
    pools.create(&PostParams::default(), &v6).await.expect("an IPv6 pool is accepted");

    let cases = [
        ("not-a-cidr", json!({"cidr": "10.0.0.0/33"}), "cidr must be a CIDR"),
        ("host-bits", json!({"cidr": "10.0.0.1/24"}), "must not have host bits set"),
        (
            "range-outside",
            json!({"cidr": "10.0.0.0/24", "ranges": [{"start": "10.0.0.10", "end": "10.0.1.10"}]}),
            "every range must lie inside cidr",
        ),
        (
            "range-not-ip",
            json!({"cidr": "10.0.0.0/24", "ranges": [{"start": "x", "end": "10.0.0.9"}]}),
            "range start must be an IP",
        ),
        ("gateway-outside", json!({"cidr": "10.0.0.0/24", "gateway": "10.0.9.1"}), "gateway must lie inside cidr"),
        ("block-too-big", json!({"cidr": "10.0.0.0/16", "blockSize": 16}), "blockSize is a prefix length"),
        ("block-shorter-than-pool", json!({"cidr": "10.0.0.0/26", "blockSize": 24}), "blockSize is a prefix length"),
        ("v6-block-too-big", json!({"cidr": "fd00::/64", "blockSize": 64}), "blockSize is a prefix length"),
        ("exclude-wrong-family", json!({"cidr": "10.0.0.0/24", "exclude": ["fd00::1"]}), "same family as cidr"),
    ];
    for (name, spec, message) in cases {
        let err = pools.create(&PostParams::default(), &pool(name, spec)).await.err();
        let text = err.map(|e| e.to_string()).unwrap_or_else(|| "accepted".to_string());
        assert!(text.contains(message), "pool {name}: expected a refusal saying {message:?}, got: {text}");
    }

    let change_cidr = json!({"spec": {"cidr": "10.11.0.0/16"}});
    let err = pools.patch("good", &PatchParams::default(), &Patch::Merge(change_cidr)).await.err();
    assert!(err.is_some_and(|e| e.to_string().contains("cidr is immutable")), "cidr cannot change");
    let change_block = json!({"spec": {"blockSize": 25}});
    let err = pools.patch("good", &PatchParams::default(), &Patch::Merge(change_block)).await.err();
    assert!(err.is_some_and(|e| e.to_string().contains("blockSize is immutable")), "blockSize cannot change");
    let _: IPPoolSpec = pools.get("good").await.expect("still there").spec;
}
