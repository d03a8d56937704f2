//! The agent's heartbeat: one coordination.k8s.io Lease per node, renewed every few seconds
//! (as kubelet renews its node lease), so the controller can tell a Ready node whose agent
//! answers the release handshake from one whose agent crashloops or never started.

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use kube::api::{Patch, PatchParams};
use kube::{Api, Resource};

/// The label carrying the node's name on every agent Lease; the controller watches the
/// Leases that have it.
pub const NODE_LABEL: &str = "ipwarden.io/agent-node";

/// The agent Lease's duration unless `--lease-duration-seconds` says otherwise; the
/// controller assumes it for a node that has no Lease yet.
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(20);

/// The agent Lease of `node`.
pub fn lease_name(node: &str) -> String {
    format!("ipwarden-agent-{node}")
}

/// A heartbeat that could not be written.
#[derive(Debug, thiserror::Error)]
pub enum HeartbeatError {
    /// The Node (the Lease's owner) could not be read.
    #[error("reading Node {node} to own its agent Lease: {source}")]
    Node {
        /// The node.
        node: String,
        /// The API error.
        source: kube::Error,
    },
    /// The Lease could not be written.
    #[error("renewing the agent Lease {name}: {source}")]
    Lease {
        /// The Lease's name.
        name: String,
        /// The API error.
        source: kube::Error,
    },
}

/// Where and how this node's agent Lease is written.
#[derive(Clone)]
pub struct Heartbeat {
    /// The Leases of the agent namespace.
    pub leases: Api<Lease>,
    /// The Nodes, to own the Lease (it goes with its Node).
    pub nodes: Api<Node>,
    /// This agent's node.
    pub node: String,
    /// The Lease's duration: how long the controller waits, seeing it unchanged, before it
    /// takes the agent as gone.
    pub duration: Duration,
}

impl Heartbeat {
    /// Creates or renews the Lease, owned by the Node as it exists now (a re-registered
    /// node's new incarnation included).
    pub async fn renew(&self) -> Result<(), HeartbeatError> {
        let node = self
            .nodes
            .get(&self.node)
            .await
            .map_err(|source| HeartbeatError::Node { node: self.node.clone(), source })?;
        let owner = OwnerReference {
            api_version: Node::api_version(&()).into_owned(),
            kind: Node::kind(&()).into_owned(),
            name: self.node.clone(),
            uid: node.metadata.uid.unwrap_or_default(),
            ..OwnerReference::default()
        };
        let name = lease_name(&self.node);
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(BTreeMap::from([(NODE_LABEL.to_string(), self.node.clone())])),
                owner_references: Some(vec![owner]),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.node.clone()),
                lease_duration_seconds: Some(i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX)),
                // For people reading the Lease; the controller judges it by local observation.
                renew_time: Some(MicroTime(Timestamp::now())),
                ..LeaseSpec::default()
            }),
        };
        let params = PatchParams::apply("ipwarden-agent").force();
        self.leases
            .patch(&name, &params, &Patch::Apply(&lease))
            .await
            .map(drop)
            .map_err(|source| HeartbeatError::Lease { name, source })
    }

    /// Renews the Lease every `interval` until the process stops; a failed renewal is
    /// logged and retried at the next tick.
    pub async fn run(self, interval: Duration) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            if let Err(e) = self.renew().await {
                tracing::warn!(error = %e, "agent heartbeat");
            }
        }
    }
}
