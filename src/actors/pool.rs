//! `PoolSupervisor` and `PoolActor`: one actor per IPPool, the only writer of that pool's
//! blocks in the controller. Changes are batched for a short window into one
//! compare-and-swap write per block; right before writing, each change is re-checked: the
//! record must still name the UID decided on, no live pod may report the IP, a pod
//! believed gone is confirmed gone by a live read, and a sticky record's owner believed done
//! with it is re-read too.

use super::leader::Leadership;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::{Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, ResponseFuture, WrapFuture};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::Api;
use kube::{Client, ResourceExt};
use tokio::sync::oneshot;

use super::events::EventWriter;
use super::metrics::{ControllerMetrics, FailureLabels, PoolLabels, ReleaseLabels};
use super::watches::SharedIndex;
use crate::block_store::{BlockStore, CasOutcome};
use crate::crd::{Allocation, HandshakeState, IPBlock, IPBlockSpec, IPPool, MigrationTarget, ReleaseHandshake};
use crate::gc::events::{RecordEvent, RecordEventKind};
use crate::gc::handshake::{ControllerStep, controller_step, mark_settles_release, takeover_marked};
use crate::gc::index::PodFacts;
use crate::gc::rules::recheck_release;
use crate::gc::sweep::{AWAITING_AGENT, ChangeAction, RecordChange, STICKY_TAKEOVER};
use crate::own_writes::OwnWrites;

/// Why a release is dropped when the re-read owner still wants the sticky record.
const OWNER_WANTS: &str = "owner_wants";

/// What started a change: the metric's `trigger` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// A traced pod reached its deadline or disappeared.
    Trace,
    /// A full sweep (timer or leadership gain).
    Sweep,
    /// A sweep an operator asked for.
    Manual,
    /// A node agent answered a release handshake.
    Handshake,
}

impl Trigger {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Trace => "trace",
            Self::Sweep => "sweep",
            Self::Manual => "manual",
            Self::Handshake => "handshake",
        }
    }
}

/// What happened to one change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChangeOutcome {
    /// The record was removed; carries when its pod ended, if a release handshake kept it.
    Released(Option<Timestamp>),
    /// The record was adopted by the pod reporting the IP.
    Repaired,
    /// The record was marked for release; its node's agent answers next.
    Marked,
    /// The record's release handshake was cleared.
    Aborted,
    /// A sticky takeover mark was answered for a node whose agent cannot answer.
    Answered,
    /// A KubeVirt migration target no pod backs was detached.
    Detached,
    /// The re-check dropped the change; the reason says why.
    Skipped(&'static str),
    /// The write failed.
    Failed(String),
}

/// Totals of a set of changes.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ApplyOutcome {
    /// Records released.
    pub released: usize,
    /// Records repaired.
    pub repaired: usize,
    /// Records marked for release, waiting for their node's agent.
    pub marked: usize,
    /// Release handshakes cleared.
    pub aborted: usize,
    /// Sticky takeover marks answered for a node whose agent cannot answer.
    pub answered: usize,
    /// Migration targets detached because no pod backs them.
    pub detached: usize,
    /// Changes dropped by the re-check.
    pub skipped: usize,
    /// Changes that failed.
    pub failed: usize,
}

impl ChangeOutcome {
    /// Whether the outcome changed the block, so that it must be written.
    fn writes(&self) -> bool {
        matches!(
            self,
            Self::Released(_) | Self::Repaired | Self::Marked | Self::Aborted | Self::Answered | Self::Detached
        )
    }
}

impl ApplyOutcome {
    fn add(&mut self, outcome: &ChangeOutcome) {
        match outcome {
            ChangeOutcome::Released(_) => self.released += 1,
            ChangeOutcome::Repaired => self.repaired += 1,
            ChangeOutcome::Marked => self.marked += 1,
            ChangeOutcome::Aborted => self.aborted += 1,
            ChangeOutcome::Answered => self.answered += 1,
            ChangeOutcome::Detached => self.detached += 1,
            ChangeOutcome::Skipped(_) => self.skipped += 1,
            ChangeOutcome::Failed(_) => self.failed += 1,
        }
    }
}

/// Changes to carry out, from the tracer or a sweep.
#[derive(Message)]
#[rtype(result = "ApplyOutcome")]
pub struct ApplyChanges {
    /// The changes.
    pub changes: Vec<RecordChange>,
    /// Who asked.
    pub trigger: Trigger,
    /// When the pod ended, for the reclaim latency (traced changes only).
    pub since: Option<Timestamp>,
}

/// Everything pool actors share.
#[derive(Clone)]
pub struct PoolContext {
    /// The API client.
    pub client: Client,
    /// The controller's index of the cluster.
    pub index: SharedIndex,
    /// Whether this replica leads (checked right before every write).
    pub leading: Leadership,
    /// Metrics.
    pub metrics: ControllerMetrics,
    /// The IPBlock writer, with this replica's field manager.
    pub store: BlockStore,
    /// What this replica's block writes stored, until the index shows them: each batch
    /// decides from, and writes on, the newer of the two.
    pub own_writes: Arc<OwnWrites<IPBlock>>,
    /// How long changes are collected before one write per block.
    pub batch_window: Duration,
    /// The writer of release and repair Events.
    pub events: EventWriter,
    /// Tests only (`--test-release-hold`): while this file exists, every release the pool
    /// actor is about to write (an answered mark's, or one no agent can answer), every
    /// migration target it is about to detach and every takeover it is about to answer waits
    /// before its live re-reads (before its write, for an answer), with `<file>.held` present to
    /// say it does.
    pub test_release_hold: Option<std::path::PathBuf>,
}

/// Starts and stops pool actors and routes changes to them.
pub struct PoolSupervisor {
    context: PoolContext,
    pools: HashMap<String, Addr<PoolActor>>,
}

impl PoolSupervisor {
    /// A supervisor over `context`.
    pub fn new(context: PoolContext) -> Self {
        Self { context, pools: HashMap::new() }
    }

    fn prune(&mut self) {
        // A pool that is gone keeps its actor while blocks name it: orphaned records are
        // still released through it.
        let index = self.context.index.read();
        self.pools.retain(|name, _| {
            let keep = index.pool(name).is_some() || index.has_blocks_of(name);
            if !keep {
                tracing::info!(pool = %name, "pool is gone; stopping its actor");
            }
            keep
        });
    }

    fn actor(&mut self, pool: &str) -> Addr<PoolActor> {
        let context = self.context.clone();
        self.pools.entry(pool.to_string()).or_insert_with(|| PoolActor::new(pool.to_string(), context).start()).clone()
    }
}

impl Actor for PoolSupervisor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(POOL_STATUS_INTERVAL, |act, ctx| {
            act.prune();
            let counts = act.update_pool_gauges();
            if act.context.leading.is_leading() {
                ctx.spawn(write_pool_counts(act.context.clone(), counts).into_actor(act));
                ctx.spawn(super::finalizer::reconcile(act.context.clone()).into_actor(act));
                ctx.spawn(super::affinity::reconcile(act.context.clone()).into_actor(act));
                ctx.spawn(super::pool_conditions::reconcile(act.context.clone()).into_actor(act));
            }
        });
    }
}

/// How often pool gauges, IPPool status counts and conditions are refreshed.
const POOL_STATUS_INTERVAL: Duration = Duration::from_secs(10);

/// One pool's status counts and the blocks they were taken from.
struct PoolCounts {
    pool: String,
    total: i64,
    allocated: i64,
    sticky: i64,
    spares: i64,
    /// [`crate::ipam::blocks::fingerprint`] of the pool's blocks in the cache the counts came from.
    counted_blocks: String,
}

/// Writes each pool's status counts where they (or the blocks they count) differ from what
/// the pool shows.
async fn write_pool_counts(context: PoolContext, counts: Vec<PoolCounts>) {
    let api: Api<IPPool> = Api::all(context.client.clone());
    for PoolCounts { pool: name, total, allocated, sticky, spares, counted_blocks } in counts {
        let current = context.index.read().pool(&name).cloned();
        let shown = current.and_then(|p| p.status.clone()).unwrap_or_default();
        if (shown.total, shown.allocated, shown.sticky_reserved, shown.spares, shown.counted_blocks.as_deref())
            == (total, allocated, sticky, spares, Some(counted_blocks.as_str()))
        {
            continue;
        }
        let patch = serde_json::json!({"status": {"total": total, "allocated": allocated, "stickyReserved": sticky,
            "spares": spares, "countedBlocks": counted_blocks}});
        if !context.leading.is_leading() {
            return;
        }
        if let Err(e) =
            api.patch_status(&name, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await
        {
            tracing::warn!(pool = %name, error = %e, "updating the pool's status counts failed");
        }
    }
}

impl PoolSupervisor {
    /// Refreshes the pool gauges (and the IP conflict gauge) from the index and returns the
    /// counts per pool.
    fn update_pool_gauges(&self) -> Vec<PoolCounts> {
        let mut counts = Vec::new();
        let mut allocated: BTreeMap<String, (i64, i64, i64)> = BTreeMap::new();
        let mut spares: BTreeMap<String, i64> = BTreeMap::new();
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let index = self.context.index.read();
        let blocks = index.blocks();
        for block in &blocks {
            let entry = allocated.entry(block.spec.pool.clone()).or_default();
            let records = block.spec.allocations.values();
            entry.0 += count(records.len());
            entry.1 += count(records.clone().filter(|a| crate::ipam::blocks::counts_as_sticky(a)).count());
            entry.2 += count(records.filter(|a| a.release_handshake.is_some()).count());
            *spares.entry(block.spec.pool.clone()).or_default() +=
                count(crate::ipam::spares::bindable(&block.spec).len());
        }
        // Only pools that still exist: a deleted pool's series must not stay at 1.
        self.context.metrics.pool_deleting.clear();
        let pools = index.pools();
        for pool in &pools {
            let name = pool.name_any();
            let labels = PoolLabels { pool: name.clone() };
            let total = crate::ipam::pools::layout(&pool.spec).map(|l| l.capacity()).unwrap_or(0);
            self.context.metrics.pool_total.get_or_create(&labels).set(i64::try_from(total).unwrap_or(i64::MAX));
            let (used, sticky, handshaking) = allocated.get(&name).copied().unwrap_or_default();
            self.context.metrics.pool_allocated.get_or_create(&labels).set(used);
            self.context.metrics.pool_sticky.get_or_create(&labels).set(sticky);
            self.context.metrics.pool_handshaking.get_or_create(&labels).set(handshaking);
            let deleting = i64::from(pool.metadata.deletion_timestamp.is_some());
            self.context.metrics.pool_deleting.get_or_create(&labels).set(deleting);
            let counted_blocks = crate::ipam::blocks::pool_fingerprint(&blocks, &name);
            let spares = spares.get(&name).copied().unwrap_or_default();
            counts.push(PoolCounts {
                pool: name,
                total: i64::try_from(total).unwrap_or(i64::MAX),
                allocated: used,
                sticky,
                spares,
                counted_blocks,
            });
        }
        let pools = crate::ipam::pools::PoolSet::of(&pools, &blocks);
        let orphaned: usize = pools.orphans().iter().map(|o| o.records).sum();
        self.context.metrics.orphaned_records.set(count(orphaned));
        let conflicts = crate::gc::check::conflicts(index.pods(), &blocks).len();
        self.context.metrics.ip_conflicts.set(count(conflicts));
        let without_agent = index.nodes_without_live_agent();
        self.context.metrics.nodes_without_live_agent.set(count(without_agent));
        self.context.metrics.unlisted_workload_kinds.set(count(index.unlisted_workload_kinds()));
        counts
    }
}

impl Handler<ApplyChanges> for PoolSupervisor {
    type Result = ResponseFuture<ApplyOutcome>;

    fn handle(&mut self, msg: ApplyChanges, _ctx: &mut Context<Self>) -> Self::Result {
        self.prune();
        let mut by_pool: BTreeMap<String, Vec<RecordChange>> = BTreeMap::new();
        for change in msg.changes {
            by_pool.entry(change.pool.clone()).or_default().push(change);
        }
        let sends: Vec<_> = by_pool
            .into_iter()
            .map(|(pool, changes)| self.actor(&pool).send(Batch { changes, trigger: msg.trigger, since: msg.since }))
            .collect();
        Box::pin(async move {
            let mut total = ApplyOutcome::default();
            for send in sends {
                match send.await {
                    Ok(outcomes) => outcomes.iter().for_each(|o| total.add(o)),
                    Err(e) => {
                        tracing::warn!(error = %e, "a pool actor did not answer");
                        total.failed += 1;
                    }
                }
            }
            total
        })
    }
}

/// Sends `request` to the supervisor for a caller that does not wait for the outcome (the
/// pool actors count and log it); only a supervisor that is gone is logged here.
pub async fn apply_in_background(supervisor: Addr<PoolSupervisor>, request: ApplyChanges) {
    if let Err(e) = supervisor.send(request).await {
        tracing::warn!(error = %e, "the pool supervisor did not answer");
    }
}

/// Changes for one pool.
#[derive(Message)]
#[rtype(result = "Vec<ChangeOutcome>")]
struct Batch {
    changes: Vec<RecordChange>,
    trigger: Trigger,
    since: Option<Timestamp>,
}

struct Pending {
    change: RecordChange,
    trigger: Trigger,
    since: Option<Timestamp>,
    reply: oneshot::Sender<ChangeOutcome>,
}

/// The writer of one pool's blocks.
pub struct PoolActor {
    pool: String,
    context: PoolContext,
    pending: Vec<Pending>,
    flush_scheduled: bool,
}

impl PoolActor {
    fn new(pool: String, context: PoolContext) -> Self {
        Self { pool, context, pending: Vec::new(), flush_scheduled: false }
    }

    fn flush(&mut self, ctx: &mut Context<Self>) {
        self.flush_scheduled = false;
        let batch = std::mem::take(&mut self.pending);
        let (context, pool) = (self.context.clone(), self.pool.clone());
        // `wait`: no other message is handled until this pool's writes are done.
        ctx.wait(write_batch(context, pool, batch).into_actor(self).map(|(), _, _| ()));
    }
}

impl Actor for PoolActor {
    type Context = Context<Self>;
}

impl Handler<Batch> for PoolActor {
    type Result = ResponseFuture<Vec<ChangeOutcome>>;

    fn handle(&mut self, msg: Batch, ctx: &mut Context<Self>) -> Self::Result {
        let mut replies = Vec::new();
        for change in msg.changes {
            let (reply, receiver) = oneshot::channel();
            self.pending.push(Pending { change, trigger: msg.trigger, since: msg.since, reply });
            replies.push(receiver);
        }
        if !self.flush_scheduled {
            self.flush_scheduled = true;
            ctx.run_later(self.context.batch_window, |act, ctx| act.flush(ctx));
        }
        Box::pin(async move {
            let mut outcomes = Vec::new();
            for receiver in replies {
                outcomes.push(receiver.await.unwrap_or_else(|_| ChangeOutcome::Failed("pool actor stopped".into())));
            }
            outcomes
        })
    }
}

async fn write_batch(context: PoolContext, pool: String, batch: Vec<Pending>) {
    let mut by_block: BTreeMap<String, Vec<Pending>> = BTreeMap::new();
    for pending in batch {
        by_block.entry(pending.change.block.clone()).or_default().push(pending);
    }
    for (block, items) in by_block {
        let changes: Vec<(&RecordChange, Option<Timestamp>)> = items.iter().map(|p| (&p.change, p.since)).collect();
        let outcomes = write_block(&context, &block, &changes).await;
        for (pending, outcome) in items.into_iter().zip(outcomes) {
            after_write(&context, &pool, &pending, &outcome).await;
            let _receiver_gone = pending.reply.send(outcome);
        }
    }
}

/// Metrics, Events and claim deletion after one change.
async fn after_write(context: &PoolContext, pool: &str, pending: &Pending, outcome: &ChangeOutcome) {
    let change = &pending.change;
    let metrics = &context.metrics;
    match (outcome, &change.action) {
        (ChangeOutcome::Released(ended), ChangeAction::Release { reason, delete_claim }) => {
            let labels = ReleaseLabels {
                pool: pool.to_string(),
                reason: reason.label().to_string(),
                trigger: pending.trigger.label().to_string(),
            };
            metrics.releases.get_or_create(&labels).inc();
            if let Some(since) = pending.since.or(*ended) {
                let seconds = Timestamp::now().duration_since(since).as_secs_f64().max(0.0);
                metrics.reclaim_latency.observe(seconds);
            }
            if *delete_claim {
                let deleted = crate::claim_writes::delete_if_bound_to(
                    &context.client,
                    &change.pod.namespace,
                    &change.claim,
                    &change.pod.uid,
                )
                .await;
                if let Err(e) = deleted {
                    tracing::warn!(claim = %change.claim, error = %e, "deleting the claim failed; the janitor will retry");
                }
            }
            let event =
                record_event(context, pool, change, (&change.pod, &change.node), reason.label(), pending.trigger);
            context.events.write(&event(RecordEventKind::Released)).await;
            tracing::info!(pool, ip = %change.ip, pod = %format!("{}/{}", change.pod.namespace, change.pod.name), uid = %change.pod.uid, node = %change.node, reason = reason.label(), trigger = pending.trigger.label(), "released");
        }
        (ChangeOutcome::Repaired, ChangeAction::Repair { adopter }) => {
            let pod = &adopter.pod;
            metrics.repairs.get_or_create(&FailureLabels { pool: pool.to_string() }).inc();
            let event =
                record_event(context, pool, change, (&adopter.pod, &adopter.node), REPAIR_RULE, pending.trigger);
            let kind = RecordEventKind::Repaired { former: change.pod.clone(), former_node: change.node.clone() };
            context.events.write(&event(kind)).await;
            tracing::info!(pool, ip = %change.ip, pod = %format!("{}/{}", pod.namespace, pod.name), uid = %pod.uid, node = %adopter.node, former = %format!("{}/{}", change.pod.namespace, change.pod.name), former_uid = %change.pod.uid, trigger = pending.trigger.label(), "repaired");
        }
        (ChangeOutcome::Marked, ChangeAction::Release { reason, .. }) => {
            metrics.handshake(pool, "marked");
            tracing::info!(pool, ip = %change.ip, pod = %format!("{}/{}", change.pod.namespace, change.pod.name), reason = reason.label(), "marked for release; asking the node's agent");
        }
        (ChangeOutcome::Answered, _) => {
            metrics.handshake(pool, "answered_for_agent");
            tracing::info!(pool, ip = %change.ip, pod = %format!("{}/{}", change.pod.namespace, change.pod.name), "sticky takeover answered for a node whose agent cannot answer");
        }
        (ChangeOutcome::Detached, ChangeAction::DetachTarget { target, why }) => {
            metrics.targets_detached.get_or_create(&PoolLabels { pool: pool.to_string() }).inc();
            tracing::info!(pool, ip = %change.ip, pod = %format!("{}/{}", change.pod.namespace, change.pod.name), target = %format!("{}/{}", target.pod.namespace, target.pod.name), target_uid = %target.pod.uid, target_node = %target.node, why, "migration target detached: no live launcher pod of the VM backs it");
        }
        (ChangeOutcome::Aborted, _) => {
            metrics.handshake(pool, "aborted");
            tracing::info!(pool, ip = %change.ip, "release handshake aborted: no longer a candidate, or the agent refused");
        }
        (ChangeOutcome::Skipped(reason), _) => metrics.skip(reason, 1),
        (ChangeOutcome::Failed(e), _) => {
            metrics.release_failures.get_or_create(&FailureLabels { pool: pool.to_string() }).inc();
            tracing::warn!(pool, ip = %change.ip, error = %e, "GC change failed");
        }
        _ => {}
    }
}

/// The rule label of a repair's Event (gc-rules.md, row 11: the IP is in another pod's `podIPs`).
const REPAIR_RULE: &str = "repair";

/// The Event of `change` regarding `(pod, node)` (the released record's pod, or the pod a
/// repair moved the record to), for the kind of change the caller passes.
fn record_event(
    context: &PoolContext,
    pool: &str,
    change: &RecordChange,
    (pod, node): (&crate::crd::PodRef, &str),
    rule: &str,
    trigger: Trigger,
) -> impl FnOnce(RecordEventKind) -> RecordEvent {
    let index = context.index.read();
    let pool_uid = index.pool(pool).and_then(|p| p.metadata.uid.clone());
    // A static pod's mirror carries a UID of its own beside the config hash the record names.
    let pod_object_uid = index
        .pod(&pod.namespace, &pod.name)
        .filter(|facts| facts.uid == pod.uid && facts.object_uid != pod.uid && !facts.object_uid.is_empty())
        .map(|facts| facts.object_uid.clone());
    drop(index);
    let (ip, pool, pod, node) = (change.ip.clone(), pool.to_string(), pod.clone(), node.to_string());
    let (rule, trigger) = (rule.to_string(), trigger.label().to_string());
    move |kind| RecordEvent { ip, pool, pool_uid, pod, pod_object_uid, node, rule, trigger, kind }
}

/// The non-terminal pod reporting each of `ips`, from the index.
fn live_holders(context: &PoolContext, ips: &[&str]) -> HashMap<String, String> {
    let index = context.index.read();
    ips.iter()
        .filter_map(|ip| Some((ip.to_string(), index.live_holder(ip).filter(|h| !h.terminal)?.pod.uid.clone())))
        .collect()
}

/// Why a release must not be written after all, from a live read of the record's pod (not
/// the cache): see [`recheck_release`].
async fn live_recheck(client: &Client, change: &RecordChange) -> Result<Option<&'static str>, kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &change.pod.namespace);
    let live = pods.get_opt(&change.pod.name).await?.map(|p| PodFacts::of(&p));
    Ok(recheck_release(
        &change.pod.uid,
        &change.ip,
        live.as_ref().map(|f| (f.uid.as_str(), f.terminal(), f.ips.as_slice())),
    ))
}

/// Why detaching `target` from `record` must not be written after all, from a live read of the
/// target's pod: a pod that backs it ([`crate::ipam::workload::target_unbacked`]) may have
/// appeared since the cache was read.
async fn live_target_recheck(
    client: &Client,
    record: &Allocation,
    target: &MigrationTarget,
) -> Result<Option<&'static str>, kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &target.pod.namespace);
    let live = pods.get_opt(&target.pod.name).await?.map(|p| PodFacts::of(&p));
    let unbacked =
        crate::ipam::workload::target_unbacked(record.owner.as_ref(), target, live.as_ref().map(PodFacts::as_target));
    Ok(unbacked.is_none().then_some("target_backed"))
}

/// What one change needs from outside its block, read once per batch before the
/// compare-and-swap (so a retry after a conflict repeats no API call): the live re-check of
/// the record's pod, and whether the re-read owner still wants a sticky record. `None`: not
/// read, because the newest known record showed the change stops before them (a handshake
/// to await or abort, a takeover mark, a live holder), or that its answered mark settles it
/// ([`mark_settles_release`]); if the fresh record says otherwise the change is dropped as
/// `record_changed` and decided again from the index.
#[derive(Default)]
struct LiveFacts {
    /// Why the live read of the record's pod forbids the release, or why the read failed.
    recheck: Option<Result<Option<&'static str>, String>>,
    /// The record's answered release mark made the pod read unnecessary.
    settled_by_mark: bool,
    /// The re-read owner still wants the sticky record, or the re-read workload still holds
    /// the list-bound one.
    owner_wants: bool,
}

/// Reads the [`LiveFacts`] of each release in `changes`, deciding from `newest`, the newest
/// copy of their block this replica knows, which releases get that far.
async fn read_live_facts(
    context: &PoolContext,
    newest: Option<&IPBlock>,
    changes: &[(&RecordChange, Option<Timestamp>)],
    holders: &HashMap<String, String>,
) -> Vec<LiveFacts> {
    let mut facts = Vec::new();
    // Two triggers can queue releases of one record in one batch (a deleted pod's
    // `terminating_past_deadline` and `pod_gone`): its pod and owner are read once.
    let mut pods_read: HashMap<(&str, &str), Result<Option<&'static str>, String>> = HashMap::new();
    let mut owners_read: HashMap<(&str, &str, bool), bool> = HashMap::new();
    for (change, _) in changes {
        let record = newest.and_then(|b| b.spec.allocations.get(&change.ip)).filter(|r| r.pod.uid == change.pod.uid);
        if let (Some(record), ChangeAction::DetachTarget { target: decided, .. }) = (record, &change.action) {
            let target = record.migration_target.as_ref().filter(|t| *t == decided);
            let recheck = match target {
                None => None,
                Some(target) => {
                    if let Some(hold) = &context.test_release_hold {
                        wait_while_held(hold).await;
                    }
                    let read = live_target_recheck(&context.client, record, target).await.map_err(|e| {
                        format!("reading migration target pod {}/{}: {e}", target.pod.namespace, target.pod.name)
                    });
                    Some(read)
                }
            };
            facts.push(LiveFacts { recheck, ..LiveFacts::default() });
            continue;
        }
        if let (Some(_), ChangeAction::AnswerTakeover { .. }) = (record, &change.action) {
            // An answer reads nothing live (the decision checked its claimant); the hold only
            // lets a test change the mark between the decision and the write.
            if let Some(hold) = &context.test_release_hold {
                wait_while_held(hold).await;
            }
            facts.push(LiveFacts::default());
            continue;
        }
        let (Some(record), ChangeAction::Release { reason, .. }) = (record, &change.action) else {
            facts.push(LiveFacts::default());
            continue;
        };
        let step = controller_step(record.release_handshake.as_ref().map(|h| h.state), change.via_agent);
        let reaches_reads = matches!(step, ControllerStep::Mark | ControllerStep::Release)
            && !takeover_marked(record)
            && !holders.contains_key(&change.ip);
        if !reaches_reads {
            facts.push(LiveFacts::default());
            continue;
        }
        let owner_sticky = crate::ipam::workload::record_is_sticky(record, context.index.read().sticky_kinds());
        if step == ControllerStep::Release && mark_settles_release(record, owner_sticky) {
            facts.push(LiveFacts { settled_by_mark: true, ..LiveFacts::default() });
            continue;
        }
        if step == ControllerStep::Release
            && let Some(hold) = &context.test_release_hold
        {
            wait_while_held(hold).await;
        }
        let key = (change.ip.as_str(), change.pod.uid.as_str());
        let recheck = match pods_read.get(&key) {
            Some(known) => known.clone(),
            None => {
                let read = live_recheck(&context.client, change)
                    .await
                    .map_err(|e| format!("reading pod {}/{}: {e}", change.pod.namespace, change.pod.name));
                pods_read.insert(key, read.clone());
                read
            }
        };
        // The decision's owner cache may be stale (a fast scale down and up): re-read it, and
        // the workload a list-bound record is held for. A retired block keeps no
        // reservation, so its owner has no say.
        let sticky = owner_sticky && reason.rests_on_owner();
        let owner_key = (key.0, key.1, sticky);
        let owner_wants = match owners_read.get(&owner_key) {
            _ if !matches!(recheck, Ok(None)) || change.retired => false,
            Some(&held) => held,
            None => {
                let held = crate::owners::record_held(&context.client, record, sticky, false).await;
                owners_read.insert(owner_key, held);
                held
            }
        };
        facts.push(LiveFacts { recheck: Some(recheck), settled_by_mark: false, owner_wants });
    }
    facts
}

/// How often a held release looks whether its hold is gone.
const HOLD_POLL: Duration = Duration::from_millis(50);

/// Tests only: while `hold` exists, waits, with `<hold>.held` present so the test knows a
/// release, a detach or an answer is held (`--test-release-hold`).
async fn wait_while_held(hold: &std::path::Path) {
    if !hold.exists() {
        return;
    }
    let held = held_marker(hold);
    if let Err(e) = std::fs::write(&held, b"") {
        tracing::warn!(path = %held.display(), error = %e, "test hold: cannot say that a release is held");
    }
    tracing::warn!(path = %hold.display(), "test hold: a release, a detach or an answer waits before its live re-reads");
    while hold.exists() {
        tokio::time::sleep(HOLD_POLL).await;
    }
    let _gone = std::fs::remove_file(&held);
}

/// The file that says a release waits on `hold`: `<hold>.held`.
fn held_marker(hold: &std::path::Path) -> std::path::PathBuf {
    let mut held = hold.as_os_str().to_owned();
    held.push(".held");
    held.into()
}

/// Applies `changes` to block `name` in one compare-and-swap write
/// ([`BlockStore::update_from`]), starting from the newest copy this replica knows (the
/// index's, or its own last write's while the index lags): a stale copy that leads to a
/// write costs a conflict and a fresh read; one that leads to nothing drops the changes,
/// which the block's next watch event brings back. The live facts are read once; each attempt
/// applies the pure [`apply_one`]. `changes` pairs each change with when its pod ended, if
/// known (kept in a release mark for the reclaim latency).
async fn write_block(
    context: &PoolContext,
    name: &str,
    changes: &[(&RecordChange, Option<Timestamp>)],
) -> Vec<ChangeOutcome> {
    let ips: Vec<&str> = changes.iter().map(|(c, _)| c.ip.as_str()).collect();
    let holders = live_holders(context, &ips);
    let cached = context.index.read().block(name).cloned();
    let newest = context.own_writes.newest(name, cached, Instant::now());
    let facts = read_live_facts(context, newest.as_deref(), changes, &holders).await;
    let mut outcomes = Vec::new();
    let base = newest.map(|block| (*block).clone());
    let written = context
        .store
        .update_from(name, base, None, |block| {
            let spec = &mut block.spec;
            let now = Timestamp::now();
            outcomes = changes
                .iter()
                .zip(&facts)
                .map(|((change, ended), facts)| apply_one(spec, change, *ended, facts, &holders, now))
                .collect();
            if !outcomes.iter().any(ChangeOutcome::writes) {
                return None;
            }
            if !context.leading.is_leading() {
                outcomes = changes.iter().map(|_| ChangeOutcome::Skipped("not_leader")).collect();
                return None;
            }
            Some(())
        })
        .await;
    match written {
        Ok((outcome, stored)) => {
            context.own_writes.remember(name, stored, Instant::now());
            match outcome {
                CasOutcome::Absent => changes.iter().map(|_| ChangeOutcome::Skipped("block_gone")).collect(),
                _ => outcomes,
            }
        }
        Err(e) => {
            context.own_writes.remember(name, None, Instant::now());
            changes.iter().map(|_| ChangeOutcome::Failed(e.to_string())).collect()
        }
    }
}

/// Re-checks one change against the fresh block `spec` and applies it there in memory; pure.
fn apply_one(
    spec: &mut IPBlockSpec,
    change: &RecordChange,
    ended: Option<Timestamp>,
    facts: &LiveFacts,
    holders: &HashMap<String, String>,
    now: Timestamp,
) -> ChangeOutcome {
    let Some(record) = spec.allocations.get_mut(&change.ip) else { return ChangeOutcome::Skipped("record_gone") };
    if record.pod.uid != change.pod.uid {
        return ChangeOutcome::Skipped("record_changed");
    }
    match &change.action {
        ChangeAction::Release { reason, .. } => {
            // An agent's takeover mark appeared since the decision: the agents settle it.
            if takeover_marked(record) {
                return ChangeOutcome::Skipped(STICKY_TAKEOVER);
            }
            let handshake = record.release_handshake.as_ref().map(|h| h.state);
            let step = controller_step(handshake, change.via_agent);
            match step {
                ControllerStep::Await => return ChangeOutcome::Skipped(AWAITING_AGENT),
                ControllerStep::Abort => {
                    record.release_handshake = None;
                    return ChangeOutcome::Aborted;
                }
                ControllerStep::Mark | ControllerStep::Release => {}
            }
            if holders.contains_key(&change.ip) {
                return ChangeOutcome::Skipped("in_use");
            }
            match &facts.recheck {
                // Settled by the answered mark the newest copy showed, if the fresh record still
                // carries it (a record of the same IP and UID keeps its owner and heldFor, so it
                // is as little sticky as the copy's was).
                None if facts.settled_by_mark && mark_settles_release(record, false) => {}
                None => return ChangeOutcome::Skipped("record_changed"),
                Some(Ok(None)) => {}
                Some(Ok(Some(reason))) => return ChangeOutcome::Skipped(reason),
                Some(Err(e)) => return ChangeOutcome::Failed(e.clone()),
            }
            if facts.owner_wants {
                return ChangeOutcome::Skipped(OWNER_WANTS);
            }
            if step == ControllerStep::Mark {
                record.release_handshake = Some(ReleaseHandshake {
                    state: HandshakeState::MarkedForRelease,
                    marked_at: Time(now),
                    reason: reason.label().to_string(),
                    detail: None,
                    pod_ended_at: ended.map(Time),
                    takeover: None,
                });
                return ChangeOutcome::Marked;
            }
            let marked = record.release_handshake.as_ref().and_then(|h| h.pod_ended_at.as_ref()).map(|t| t.0);
            crate::ipam::blocks::free(spec, &change.ip, marked.or(ended), now);
            ChangeOutcome::Released(marked)
        }
        ChangeAction::Repair { adopter } => {
            if holders.get(&change.ip) != Some(&adopter.pod.uid) {
                return ChangeOutcome::Skipped("holder_changed");
            }
            crate::ipam::blocks::repair(record, adopter, now);
            ChangeOutcome::Repaired
        }
        ChangeAction::AnswerTakeover { detached, mark } => {
            // Decided for a reservation, whose node's NotReady policy did not count: a sandbox
            // attached since waits for the policy again. A mark written since, for a claimant
            // the decision did not check, is decided again.
            if (*detached && crate::ipam::blocks::may_be_attached(record)) || !mark.still_on(record) {
                return ChangeOutcome::Skipped("record_changed");
            }
            let node = record.node.clone();
            let marked = record
                .release_handshake
                .as_mut()
                .filter(|h| h.takeover.is_some() && h.state == HandshakeState::MarkedForRelease);
            let Some(handshake) = marked else { return ChangeOutcome::Skipped("no_takeover_mark") };
            handshake.state = HandshakeState::ReadyForRelease;
            handshake.detail = Some(match detached {
                true => format!(
                    "answered by the controller: node {node} is deleted or NotReady, so its agent cannot, and no sandbox holds the reservation"
                ),
                false => format!(
                    "answered by the controller: node {node} is deleted or NotReady past the NotReady policy, so its agent cannot"
                ),
            });
            ChangeOutcome::Answered
        }
        ChangeAction::DetachTarget { target, .. } => {
            if record.migration_target.as_ref() != Some(target) {
                return ChangeOutcome::Skipped("record_changed");
            }
            match &facts.recheck {
                Some(Ok(None)) => {}
                Some(Ok(Some(reason))) => return ChangeOutcome::Skipped(reason),
                Some(Err(e)) => return ChangeOutcome::Failed(e.clone()),
                None => return ChangeOutcome::Skipped("record_changed"),
            }
            record.migration_target = None;
            ChangeOutcome::Detached
        }
        // Each abort clears only the kind of mark it was decided for: an agent's takeover mark
        // written after a sweep decided to clear a controller mark stays, and the reverse.
        ChangeAction::AbortHandshake | ChangeAction::AbortTakeover => {
            let takeover = matches!(change.action, ChangeAction::AbortTakeover);
            match record.release_handshake.as_ref() {
                None => return ChangeOutcome::Skipped("no_handshake"),
                Some(h) if h.takeover.is_some() != takeover => return ChangeOutcome::Skipped("record_changed"),
                Some(_) => record.release_handshake = None,
            }
            ChangeOutcome::Aborted
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::crd::{Allocation, PodRef, Takeover};
    use crate::gc::handshake::marked_for_release;
    use crate::gc::rules::ReleaseReason;

    const IP: &str = "10.0.0.5";

    fn record(uid: &str) -> Allocation {
        crate::ipam::blocks::test::record(uid, "c")
    }

    fn release(via_agent: bool) -> RecordChange {
        RecordChange {
            pool: "pool".into(),
            block: "b".into(),
            ip: IP.into(),
            pod: PodRef { namespace: "default".into(), name: "web-0".into(), uid: "u1".into() },
            node: "node-0".into(),
            claim: "web-0".into(),
            via_agent,
            retired: false,
            action: ChangeAction::Release { reason: ReleaseReason::PodGone, delete_claim: true },
        }
    }

    fn facts(recheck: Option<Option<&'static str>>, owner_wants: bool) -> LiveFacts {
        LiveFacts { recheck: recheck.map(Ok), settled_by_mark: false, owner_wants }
    }

    fn settled() -> LiveFacts {
        LiveFacts { recheck: None, settled_by_mark: true, owner_wants: false }
    }

    #[test]
    fn a_release_is_applied_to_the_fresh_block_only_when_every_live_fact_read_before_allows_it() {
        let takeover = ReleaseHandshake {
            state: HandshakeState::MarkedForRelease,
            marked_at: Time(Timestamp::UNIX_EPOCH),
            reason: "sticky takeover".into(),
            detail: None,
            pod_ended_at: None,
            takeover: Some(Takeover { pod: record("u2").pod, node: "m".into() }),
        };
        let with_takeover = Allocation { release_handshake: Some(takeover.clone()), ..record("u1") };
        let marked = |state| Allocation {
            release_handshake: Some(ReleaseHandshake {
                state,
                reason: "pod_gone".into(),
                takeover: None,
                ..takeover.clone()
            }),
            ..record("u1")
        };
        let mut uid_mismatch_answered = marked(HandshakeState::ReadyForRelease);
        if let Some(h) = uid_mismatch_answered.release_handshake.as_mut() {
            h.reason = "uid_mismatch".into();
        }
        let holder: HashMap<String, String> = [(IP.to_string(), "u3".to_string())].into();
        let none = HashMap::new();
        // (fresh record, via agent, facts, live holders, outcome)
        type Case<'a> = (Option<Allocation>, bool, LiveFacts, &'a HashMap<String, String>, ChangeOutcome);
        let table: [Case<'_>; 13] = [
            (None, false, facts(Some(None), false), &none, ChangeOutcome::Skipped("record_gone")),
            (Some(record("u2")), false, facts(Some(None), false), &none, ChangeOutcome::Skipped("record_changed")),
            (Some(with_takeover), false, facts(Some(None), false), &none, ChangeOutcome::Skipped(STICKY_TAKEOVER)),
            (Some(record("u1")), false, facts(Some(None), false), &holder, ChangeOutcome::Skipped("in_use")),
            // The cached record stopped before the reads; the fresh one would not: decide again.
            (Some(record("u1")), false, facts(None, false), &none, ChangeOutcome::Skipped("record_changed")),
            (
                Some(record("u1")),
                false,
                facts(Some(Some("pod_alive")), false),
                &none,
                ChangeOutcome::Skipped("pod_alive"),
            ),
            (Some(record("u1")), false, facts(Some(None), true), &none, ChangeOutcome::Skipped(OWNER_WANTS)),
            (Some(record("u1")), true, facts(Some(None), false), &none, ChangeOutcome::Marked),
            (Some(record("u1")), false, facts(Some(None), false), &none, ChangeOutcome::Released(None)),
            // Settled by the answered mark, without a pod read: only while the fresh record
            // still carries that answer.
            (Some(marked(HandshakeState::ReadyForRelease)), true, settled(), &none, ChangeOutcome::Released(None)),
            (Some(record("u1")), false, settled(), &none, ChangeOutcome::Skipped("record_changed")),
            (Some(uid_mismatch_answered), true, settled(), &none, ChangeOutcome::Skipped("record_changed")),
            (
                Some(marked(HandshakeState::MarkedForRelease)),
                true,
                settled(),
                &none,
                ChangeOutcome::Skipped(AWAITING_AGENT),
            ),
        ];
        for (fresh, via_agent, facts, holders, want) in table {
            let mut spec = IPBlockSpec::default();
            if let Some(fresh) = fresh.clone() {
                spec.allocations.insert(IP.into(), fresh);
            }
            let now = Timestamp::UNIX_EPOCH;
            let outcome = apply_one(&mut spec, &release(via_agent), None, &facts, holders, now);
            assert_eq!(outcome, want, "fresh {fresh:?}, via agent {via_agent}");
            match want {
                ChangeOutcome::Released(_) => {
                    assert!(!spec.allocations.contains_key(IP) && spec.released.contains_key(IP))
                }
                ChangeOutcome::Marked => assert!(marked_for_release(&spec.allocations[IP])),
                _ => {
                    assert_eq!(spec.allocations.get(IP), fresh.as_ref(), "a dropped change leaves the record as it was")
                }
            }
            assert_eq!(outcome.writes(), matches!(want, ChangeOutcome::Released(_) | ChangeOutcome::Marked));
        }
    }

    #[test]
    fn the_controller_answers_a_takeover_only_for_the_mark_its_decision_checked() {
        use crate::gc::sweep::MarkSeen;
        let mark = |claimant: &str, at: i64| ReleaseHandshake {
            state: HandshakeState::MarkedForRelease,
            marked_at: Time(Timestamp::from_second(at).expect("time")),
            reason: "sticky takeover".into(),
            detail: None,
            pod_ended_at: None,
            takeover: Some(Takeover { pod: record(claimant).pod, node: "m".into() }),
        };
        let with = |handshake| Allocation { release_handshake: Some(handshake), ..record("u1") };
        let seen = MarkSeen::of(&with(mark("u2", 10))).expect("a takeover mark");
        let answer =
            RecordChange { action: ChangeAction::AnswerTakeover { detached: false, mark: seen }, ..release(false) };
        let cases = [
            (with(mark("u2", 10)), ChangeOutcome::Answered),
            // Re-marked since the decision: another claimant, or the same one marked again.
            (with(mark("u3", 10)), ChangeOutcome::Skipped("record_changed")),
            (with(mark("u2", 11)), ChangeOutcome::Skipped("record_changed")),
            (record("u1"), ChangeOutcome::Skipped("record_changed")),
        ];
        for (fresh, want) in cases {
            let mut spec = IPBlockSpec::default();
            spec.allocations.insert(IP.into(), fresh.clone());
            let outcome =
                apply_one(&mut spec, &answer, None, &LiveFacts::default(), &HashMap::new(), Timestamp::UNIX_EPOCH);
            assert_eq!(outcome, want, "{fresh:?}");
            let state = spec.allocations[IP].release_handshake.as_ref().map(|h| h.state);
            let answered = matches!(want, ChangeOutcome::Answered);
            assert_eq!(state == Some(HandshakeState::ReadyForRelease), answered, "{fresh:?}");
        }
    }

    #[test]
    fn a_migration_target_is_detached_only_while_it_is_the_one_decided_on_and_the_live_read_finds_no_backing() {
        use crate::crd::MigrationTarget;
        let target = |uid: &str| MigrationTarget {
            migration_uid: "m1".into(),
            pod: PodRef { namespace: "default".into(), name: "virt-launcher-vm-dst".into(), uid: uid.into() },
            node: "node-1".into(),
            container_id: "c2".into(),
            interface: "eth0".into(),
        };
        let with = |uid: &str| Allocation { migration_target: Some(target(uid)), ..record("u1") };
        let action = ChangeAction::DetachTarget { target: target("t1"), why: "target_pod_gone" };
        let detach = RecordChange { action, ..release(false) };
        let failed = LiveFacts { recheck: Some(Err("reading pod: boom".into())), ..LiveFacts::default() };
        let cases = [
            (with("t1"), facts(Some(None), false), ChangeOutcome::Detached),
            (with("t1"), facts(Some(Some("target_backed")), false), ChangeOutcome::Skipped("target_backed")),
            (with("t1"), facts(None, false), ChangeOutcome::Skipped("record_changed")),
            (with("t1"), failed, ChangeOutcome::Failed("reading pod: boom".into())),
            (with("t2"), facts(Some(None), false), ChangeOutcome::Skipped("record_changed")),
            (
                Allocation {
                    migration_target: Some(MigrationTarget { node: "node-2".into(), ..target("t1") }),
                    ..record("u1")
                },
                facts(Some(None), false),
                ChangeOutcome::Skipped("record_changed"),
            ),
            (record("u1"), facts(Some(None), false), ChangeOutcome::Skipped("record_changed")),
            (
                Allocation { migration_target: Some(target("t1")), ..record("u9") },
                facts(Some(None), false),
                ChangeOutcome::Skipped("record_changed"),
            ),
        ];
        for (fresh, facts, want) in cases {
            let mut spec = IPBlockSpec::default();
            spec.allocations.insert(IP.into(), fresh.clone());
            let outcome = apply_one(&mut spec, &detach, None, &facts, &HashMap::new(), Timestamp::UNIX_EPOCH);
            assert_eq!(outcome, want, "{fresh:?}");
            let left = &spec.allocations[IP];
            match want {
                ChangeOutcome::Detached => {
                    assert_eq!(left, &Allocation { migration_target: None, ..fresh }, "only the target goes")
                }
                _ => assert_eq!(left, &fresh, "a dropped change leaves the record as it was"),
            }
            assert_eq!(outcome.writes(), matches!(want, ChangeOutcome::Detached));
        }
    }
}
