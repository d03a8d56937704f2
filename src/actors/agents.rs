//! `AgentLeases`: the cached agent Leases and this controller's observations of them, from
//! which each index learns which nodes have no live agent (src/gc/agents.rs decides).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::runtime::reflector::Store;
use prometheus_client::metrics::gauge::Gauge;

use crate::agent::heartbeat::{DEFAULT_LEASE_DURATION, NODE_LABEL};
use crate::gc::agents::{AgentLease, Observations, stale_agents};

/// The agent Leases (label-selected, in the controller's namespace) and when each was last
/// seen changing.
#[derive(Clone)]
pub struct AgentLeases {
    leases: Store<Lease>,
    observed: Arc<Mutex<Observations>>,
    gauge: Gauge,
}

impl AgentLeases {
    /// Judges the Leases in `leases` and reports the count of nodes without a live agent on
    /// `gauge`.
    pub fn new(leases: Store<Lease>, gauge: Gauge) -> Self {
        Self { leases, observed: Arc::default(), gauge }
    }

    /// The nodes among `nodes` whose agent is gone, with when its Lease went stale.
    pub fn stale(&self, nodes: &[Arc<Node>]) -> HashMap<String, Timestamp> {
        let leases = self
            .leases
            .state()
            .iter()
            .filter_map(|lease| {
                let node = lease.labels().get(NODE_LABEL)?.clone();
                let duration = lease
                    .spec
                    .as_ref()
                    .and_then(|s| s.lease_duration_seconds)
                    .and_then(|s| u64::try_from(s).ok())
                    .map(Duration::from_secs);
                Some((node, AgentLease { version: lease.resource_version().unwrap_or_default(), duration }))
            })
            .collect();
        let names: Vec<String> = nodes.iter().map(|n| n.name_any()).collect();
        let mut observed = self.observed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let stale = stale_agents(
            names.iter().map(String::as_str),
            &leases,
            &mut observed,
            DEFAULT_LEASE_DURATION,
            Instant::now(),
            Timestamp::now(),
        );
        self.gauge.set(i64::try_from(stale.len()).unwrap_or(i64::MAX));
        stale
    }
}
