//! The agent's allocation core: its state (caches, checkpoint, client, block store) and the
//! reads every flow shares. Each flow has its own file: the CNI verbs (`add`, `cni_verbs`),
//! the release of a sandbox's records (`block_writes`), the answers to the controller's
//! release marks (`release_marks`) and the start-up recovery (`startup`). Decisions come from
//! the pure modules (`ipam`, `gc`); these files read, write and retry.

use std::sync::Arc;
use std::time::Duration;

use kube::api::Api;
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use tokio::sync::Mutex;

use super::checkpoint::{AttachmentKey, Checkpoint, CheckpointIp};
use super::metrics::AgentMetrics;
use crate::block_store::BlockStore;
use crate::crd::{IPBlock, IPPool};
use crate::ipam::PoolLayout;
use crate::ipam::blocks;
use crate::ipam::pools;
use crate::protocol::{AttachmentRequest, IpConfig, IpamResult, Route};

/// The agent's settings that shape allocation.
#[derive(Clone, Debug)]
pub struct Settings {
    /// This node's name.
    pub node: String,
    /// How long a released IP is not handed out again.
    pub cooldown: Duration,
    /// Owner kinds whose pods keep their IPs between pods.
    pub sticky_kinds: Vec<String>,
    /// How long a sandbox still attached on the node holds a record marked for release
    /// before its DEL counts as lost.
    pub sandbox_grace: Duration,
}

/// The agent's state: caches, the checkpoint, and the client.
pub struct Core {
    pub(super) client: Client,
    pub(super) settings: Settings,
    pub(super) pools: Store<IPPool>,
    pub(super) blocks: Store<IPBlock>,
    pub(super) checkpoint: Mutex<Checkpoint>,
    pub(super) metrics: Arc<AgentMetrics>,
    pub(super) store: BlockStore,
}

/// A pool resolved for allocation.
pub(super) struct ResolvedPool {
    pub(super) name: String,
    pub(super) layout: PoolLayout,
    pub(super) gateway: Option<String>,
    /// Being deleted: it hands out nothing, and a sticky pod does not get its IP back.
    pub(super) deleting: bool,
}

/// The field manager of this node's agent on the objects it writes.
pub(super) fn field_manager(node: &str) -> String {
    format!("ipwarden-agent-{node}")
}

pub(super) fn attachment_key(request: &AttachmentRequest) -> AttachmentKey {
    AttachmentKey {
        network: request.network.clone(),
        container_id: request.container_id.clone(),
        ifname: request.ifname.clone(),
    }
}

/// The CNI result for `ips`: each address with its pool's prefix length and gateway, and a
/// default route via the gateway when the pool has one.
pub fn result_of(ips: &[CheckpointIp]) -> IpamResult {
    let routes = ips
        .iter()
        .filter_map(|ip| {
            let gateway = ip.gateway.clone()?;
            let dst = if ip.ip.contains(':') { "::/0" } else { "0.0.0.0/0" };
            Some(Route { dst: dst.to_string(), gw: Some(gateway) })
        })
        .collect();
    IpamResult {
        ips: ips
            .iter()
            .map(|ip| IpConfig {
                address: format!("{}/{}", ip.ip, ip.prefix_len),
                gateway: ip.gateway.clone(),
                interface: None,
            })
            .collect(),
        routes,
        dns: None,
    }
}

impl Core {
    /// Creates the core over synced caches and a restored checkpoint.
    pub fn new(
        client: Client,
        settings: Settings,
        pools: Store<IPPool>,
        blocks: Store<IPBlock>,
        checkpoint: Checkpoint,
        metrics: Arc<AgentMetrics>,
    ) -> Self {
        let store = BlockStore::new(
            Api::all(client.clone()),
            field_manager(&settings.node),
            Some(metrics.conflict_retries.clone()),
        );
        Self { client, settings, pools, blocks, checkpoint: Mutex::new(checkpoint), metrics, store }
    }

    pub(super) fn resolve_pool(&self, name: &str) -> Option<ResolvedPool> {
        let pool = self.pools.state().into_iter().find(|p| p.name_any() == name)?;
        let layout = pools::layout(&pool.spec).ok()?;
        Some(ResolvedPool {
            name: name.to_string(),
            layout,
            gateway: pool.spec.gateway.clone(),
            deleting: pool.metadata.deletion_timestamp.is_some(),
        })
    }

    pub(super) fn checkpoint_ips(&self, found: Vec<(String, String, String)>) -> Vec<CheckpointIp> {
        found
            .into_iter()
            .map(|(pool, block, ip)| {
                let resolved = self.resolve_pool(&pool);
                CheckpointIp {
                    prefix_len: resolved.as_ref().map(|p| p.layout.cidr().prefix_len()).unwrap_or(32),
                    gateway: resolved.and_then(|p| p.gateway),
                    ip,
                    pool,
                    block,
                }
            })
            .collect()
    }

    /// (block name, ip, pool) of every record of this node's sandbox, from the cache.
    pub(super) fn records_of_sandbox(&self, container_id: &str, ifname: &str) -> Vec<(String, String, String)> {
        let node = &self.settings.node;
        self.blocks
            .state()
            .iter()
            .flat_map(|block| {
                blocks::find_attachment(&block.spec, container_id, ifname)
                    .into_iter()
                    .filter(|ip| {
                        block.spec.allocations.get(ip).is_some_and(|a| {
                            a.node == *node || a.migration_target.as_ref().is_some_and(|t| t.node == *node)
                        })
                    })
                    .map(|ip| (block.name_any(), ip, block.spec.pool.clone()))
                    .collect::<Vec<_>>()
            })
            .collect()
    }
}

#[cfg(test)]
mod test {
    use super::*;

    fn ip(ip: &str, gateway: Option<&str>) -> CheckpointIp {
        CheckpointIp {
            ip: ip.into(),
            prefix_len: 24,
            gateway: gateway.map(Into::into),
            pool: "p".into(),
            block: "b".into(),
        }
    }

    #[test]
    fn a_result_carries_prefix_lengths_and_a_default_route_per_gateway() {
        let result = result_of(&[ip("10.0.0.5", Some("10.0.0.1")), ip("fd00::5", None)]);
        assert_eq!(result.ips[0].address, "10.0.0.5/24");
        assert_eq!(result.ips[0].gateway.as_deref(), Some("10.0.0.1"));
        assert_eq!(result.routes.len(), 1);
        assert_eq!(result.routes[0].dst, "0.0.0.0/0");
    }
}
