//! The controller's metrics, documented in docs/metrics.md.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of a release.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReleaseLabels {
    /// The pool.
    pub pool: String,
    /// The rule row (e.g. `pod_gone`).
    pub reason: String,
    /// `trace`, `sweep`, `manual` or `handshake`.
    pub trigger: String,
}

/// Labels of a failed change.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    /// The pool.
    pub pool: String,
}

/// Labels of a skip.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SkipLabels {
    /// Why the record was kept or a change dropped (e.g. `in_use`, `record_changed`).
    pub reason: String,
}

/// Labels of a release-handshake step.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HandshakeLabels {
    /// The pool.
    pub pool: String,
    /// `marked`, `aborted` or `answered_for_agent`.
    pub step: String,
}

/// Labels of a claim witness write.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WitnessLabels {
    /// `written`, `created` (a claim created before its witness write), `conflict`,
    /// `no_status_subresource` or `failed`.
    pub result: String,
}

/// Labels of a pool gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// The pool.
    pub pool: String,
}

/// Everything the controller counts.
#[derive(Clone)]
pub struct ControllerMetrics {
    /// Records released, by pool, reason and trigger.
    pub releases: Family<ReleaseLabels, Counter>,
    /// Records repaired (adopted by the pod reporting the IP), by pool.
    pub repairs: Family<FailureLabels, Counter>,
    /// Releases or repairs that failed to be written, by pool.
    pub release_failures: Family<FailureLabels, Counter>,
    /// Release and repair Events the apiserver did not take.
    pub event_failures: Counter,
    /// Records of terminating pods being traced until their deadline.
    pub candidates: Gauge,
    /// How long a full sweep took.
    pub sweep_duration: Histogram,
    /// Records looked at by sweeps.
    pub records_scanned: Counter,
    /// Records kept by sweeps and changes dropped at write time, by reason.
    pub skips: Family<SkipLabels, Counter>,
    /// IPs a pool can hand out.
    pub pool_total: Family<PoolLabels, Gauge>,
    /// IPs allocated in a pool.
    pub pool_allocated: Family<PoolLabels, Gauge>,
    /// Sticky reservations in a pool.
    pub pool_sticky: Family<PoolLabels, Gauge>,
    /// Records of a pool in a release handshake (marked, or answered and not yet released).
    pub pool_handshaking: Family<PoolLabels, Gauge>,
    /// Release-handshake steps the controller wrote, by pool and step.
    pub handshakes: Family<HandshakeLabels, Counter>,
    /// KubeVirt migration targets detached because no pod backs them, by pool.
    pub targets_detached: Family<PoolLabels, Counter>,
    /// Claim witness writes (`status.witnessed`), by result.
    pub witness_writes: Family<WitnessLabels, Counter>,
    /// 1 while this replica leads.
    pub leader: Gauge,
    /// From the pod's end (deletion or completion) to its IP being free.
    pub reclaim_latency: Histogram,
    /// IPBlock writes retried after a resourceVersion conflict.
    pub conflict_retries: Counter,
    /// IPs that more than one live pod reports (invariant 1 broken; `ipwarden check` names them).
    pub ip_conflicts: Gauge,
    /// Nodes whose agent Lease is stale or missing.
    pub nodes_without_live_agent: Gauge,
    /// Workload kinds not listed yet, whose list reservations are all kept meanwhile.
    pub unlisted_workload_kinds: Gauge,
    /// 1 while a pool is being deleted and waits for its records to go, else 0.
    pub pool_deleting: Family<PoolLabels, Gauge>,
    /// Records in orphaned blocks (their pool is gone or no longer has the block).
    pub orphaned_records: Gauge,
}

impl ControllerMetrics {
    /// Creates the metrics and registers them under `ipwarden`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            releases: Family::default(),
            repairs: Family::default(),
            release_failures: Family::default(),
            event_failures: Counter::default(),
            candidates: Gauge::default(),
            sweep_duration: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            records_scanned: Counter::default(),
            skips: Family::default(),
            pool_total: Family::default(),
            pool_allocated: Family::default(),
            pool_sticky: Family::default(),
            pool_handshaking: Family::default(),
            handshakes: Family::default(),
            targets_detached: Family::default(),
            witness_writes: Family::default(),
            leader: Gauge::default(),
            reclaim_latency: Histogram::new(exponential_buckets(0.1, 2.0, 14)),
            conflict_retries: Counter::default(),
            ip_conflicts: Gauge::default(),
            nodes_without_live_agent: Gauge::default(),
            unlisted_workload_kinds: Gauge::default(),
            pool_deleting: Family::default(),
            orphaned_records: Gauge::default(),
        };
        let r = registry.sub_registry_with_prefix("ipwarden");
        r.register("gc_releases", "Records released by the GC, by pool, rule and trigger", m.releases.clone());
        r.register("gc_repairs", "Records adopted by the pod that reports their IP", m.repairs.clone());
        r.register("gc_release_failures", "GC changes that could not be written", m.release_failures.clone());
        r.register(
            "gc_event_failures",
            "Release and repair Events the apiserver did not take",
            m.event_failures.clone(),
        );
        r.register("gc_candidates", "Records of terminating pods traced until their deadline", m.candidates.clone());
        r.register("gc_sweep_duration_seconds", "Duration of full sweeps", m.sweep_duration.clone());
        r.register("gc_sweep_records_scanned", "Records looked at by full sweeps", m.records_scanned.clone());
        r.register("gc_skips", "Records kept by sweeps and changes dropped at write time, by reason", m.skips.clone());
        r.register("pool_total_ips", "IPs a pool can hand out", m.pool_total.clone());
        r.register("pool_allocated_ips", "IPs allocated in a pool", m.pool_allocated.clone());
        r.register("pool_sticky_ips", "Sticky reservations in a pool", m.pool_sticky.clone());
        r.register(
            "pool_deleting",
            "1 while a pool is being deleted and waits for its records to go",
            m.pool_deleting.clone(),
        );
        r.register(
            "orphaned_block_records",
            "Records in IPBlocks that no pool owns (pool gone, or recreated without that block)",
            m.orphaned_records.clone(),
        );
        r.register(
            "pool_handshaking_ips",
            "Records of a pool in a release handshake with their node's agent",
            m.pool_handshaking.clone(),
        );
        r.register(
            "gc_release_handshakes",
            "Release-handshake steps written by the controller, by pool and step (marked, aborted, answered_for_agent)",
            m.handshakes.clone(),
        );
        r.register(
            "gc_migration_targets_detached",
            "KubeVirt migration targets detached from a VM's record because no live launcher pod of the VM backs them",
            m.targets_detached.clone(),
        );
        r.register(
            "claim_witness_writes",
            "Writes of a claim's witnessed binding (status.witnessed), by result",
            m.witness_writes.clone(),
        );
        r.register("controller_leader", "1 while this controller replica leads", m.leader.clone());
        r.register(
            "gc_reclaim_latency_seconds",
            "Time from a pod's deletion or completion to its IP being free",
            m.reclaim_latency.clone(),
        );
        r.register("gc_conflict_retries", "IPBlock writes retried after a conflict", m.conflict_retries.clone());
        r.register("ip_conflicts", "IPs that more than one live pod reports", m.ip_conflicts.clone());
        r.register(
            "nodes_without_live_agent",
            "Nodes whose agent Lease is stale or missing (their records follow the NotReady policy)",
            m.nodes_without_live_agent.clone(),
        );
        r.register(
            "unlisted_workload_kinds",
            "Workload kinds (Deployment, ReplicaSet, CronJob, Job) not listed yet: their list reservations are all kept",
            m.unlisted_workload_kinds.clone(),
        );
        m
    }

    /// Counts a release-handshake step.
    pub fn handshake(&self, pool: &str, step: &str) {
        self.handshakes.get_or_create(&HandshakeLabels { pool: pool.to_string(), step: step.to_string() }).inc();
    }

    /// Counts a claim witness write's result.
    pub fn witness_write(&self, result: &str) {
        self.witness_writes.get_or_create(&WitnessLabels { result: result.to_string() }).inc();
    }

    /// Counts a skip.
    pub fn skip(&self, reason: &str, count: u64) {
        self.skips.get_or_create(&SkipLabels { reason: reason.to_string() }).inc_by(count);
    }
}
