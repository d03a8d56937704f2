//! The agent's metrics (prefix `ipwarden_agent_`), documented in docs/metrics.md.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of allocation and release outcomes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `success`, or the failure class (`exhausted`, `cooling`, `no_pool`, `error`).
    pub result: String,
}

/// Labels of an answer to a release mark.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AnswerLabels {
    /// `ready_for_release` or `do_not_release`.
    pub answer: String,
}

/// Labels naming a pool.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// The IPPool.
    pub pool: String,
}

/// Everything the agent counts.
pub struct AgentMetrics {
    /// CNI ADDs by outcome.
    pub allocations: Family<ResultLabels, Counter>,
    /// IPs released by DEL or GC, by outcome (`released`, `reserved` for sticky).
    pub releases: Family<ResultLabels, Counter>,
    /// How long a CNI ADD took in the agent.
    pub allocation_duration: Histogram,
    /// How long a CNI DEL took in the agent.
    pub release_duration: Histogram,
    /// IPBlock writes retried after a resourceVersion conflict.
    pub conflict_retries: Counter,
    /// ADDs that found a pool without a free IP.
    pub pool_exhausted: Family<PoolLabels, Counter>,
    /// Answers to the controller's release marks.
    pub handshake_answers: Family<AnswerLabels, Counter>,
    /// Where ADDs read their pod: `cache` (the node's pod watch) or `apiserver`.
    pub pod_reads: Family<SourceLabels, Counter>,
    /// Spare IPs the node holds ready and has not handed out, by pool (`--spare-ips`).
    pub spare_ips: Family<PoolLabels, Gauge>,
    /// IPs CNI ADDs got from the node's spares (answered before their record was written).
    pub spare_ips_bound: Counter,
    /// Questions to the runtime over CRI (`--cri-socket`), by result (`ok`, `error`).
    pub runtime_queries: Family<ResultLabels, Counter>,
}

/// Labels of where a read was served from.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    /// `cache` or `apiserver`.
    pub source: String,
}

impl AgentMetrics {
    /// Creates the metrics and registers them under `ipwarden_agent`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self {
            allocations: Family::default(),
            releases: Family::default(),
            allocation_duration: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            release_duration: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            conflict_retries: Counter::default(),
            pool_exhausted: Family::default(),
            handshake_answers: Family::default(),
            pod_reads: Family::default(),
            spare_ips: Family::default(),
            spare_ips_bound: Counter::default(),
            runtime_queries: Family::default(),
        };
        let agent = registry.sub_registry_with_prefix("ipwarden_agent");
        agent.register("allocations", "CNI ADD requests by result", metrics.allocations.clone());
        agent.register("releases", "IPs released by CNI DEL or GC, by result", metrics.releases.clone());
        agent.register(
            "allocation_duration_seconds",
            "Time to serve one CNI ADD in the agent",
            metrics.allocation_duration.clone(),
        );
        agent.register(
            "release_duration_seconds",
            "Time to serve one CNI DEL in the agent",
            metrics.release_duration.clone(),
        );
        agent.register(
            "conflict_retries",
            "IPBlock writes retried after a resourceVersion conflict",
            metrics.conflict_retries.clone(),
        );
        agent.register("pool_exhausted", "CNI ADDs that found no free IP in a pool", metrics.pool_exhausted.clone());
        agent.register(
            "release_handshake_answers",
            "Answers to the controller's release marks, by answer",
            metrics.handshake_answers.clone(),
        );
        agent.register("pod_reads", "Pods read by CNI ADDs, by source (cache or apiserver)", metrics.pod_reads.clone());
        agent.register("spare_ips", "Spare IPs the node holds ready, by pool", metrics.spare_ips.clone());
        agent.register(
            "spare_ips_bound",
            "IPs CNI ADDs got from the node's spares, before their records were written",
            metrics.spare_ips_bound.clone(),
        );
        agent.register(
            "runtime_queries",
            "Questions to the container runtime over CRI about the node's sandboxes, by result (ok or error)",
            metrics.runtime_queries.clone(),
        );
        metrics
    }

    /// Counts one question to the runtime over CRI.
    pub fn runtime_query(&self, result: &str) {
        self.runtime_queries.get_or_create(&ResultLabels { result: result.to_string() }).inc();
    }

    /// Counts one pod read of an ADD.
    pub fn pod_read(&self, source: &str) {
        self.pod_reads.get_or_create(&SourceLabels { source: source.to_string() }).inc();
    }

    /// Counts one ADD outcome.
    pub fn allocation(&self, result: &str) {
        self.allocations.get_or_create(&ResultLabels { result: result.to_string() }).inc();
    }

    /// Counts one answer to a release mark.
    pub fn handshake_answer(&self, answer: &str) {
        self.handshake_answers.get_or_create(&AnswerLabels { answer: answer.to_string() }).inc();
    }

    /// Counts one released or reserved IP.
    pub fn release(&self, result: &str) {
        self.releases.get_or_create(&ResultLabels { result: result.to_string() }).inc();
    }
}
