//! `Sweeper` (gc-all): on a timer, on gaining leadership and on an operator's request, walks
//! every record of every pool against the index (no API read per record) and sends the
//! verdicts to the pool actors. Only the leader sweeps.

use super::leader::Leadership;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::{
    Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, ResponseActFuture, StreamHandler, WrapFuture,
};
use jiff::Timestamp;
use kube::ResourceExt;
use kube::runtime::watcher;

use super::leader::LeadershipChanged;
use super::metrics::ControllerMetrics;
use super::pool::{ApplyChanges, ApplyOutcome, PoolSupervisor, Trigger, apply_in_background};
use super::watches::SharedIndex;
use crate::crd::IPBlock;
use crate::gc::handshake::actionable;
use crate::gc::manual::{DryRunPlan, SweepReport};
use crate::gc::rules::RuleSettings;
use crate::gc::sweep;

/// Ask for a sweep now; answers with its report, or why it could not run.
#[derive(Message)]
#[rtype(result = "Result<SweepReport, String>")]
pub struct SweepNow(pub Trigger);

/// Ask for the plan a sweep would carry out now, made with this replica's rule settings and
/// index; nothing is written. Answers why not when this replica does not lead.
#[derive(Message)]
#[rtype(result = "Result<DryRunPlan, String>")]
pub struct PlanNow;

/// Why a standby answers no manual request.
const NOT_LEADER: &str = "this controller replica is not the leader";

/// The sweeper actor.
pub struct Sweeper {
    index: SharedIndex,
    supervisor: Addr<PoolSupervisor>,
    leading: Leadership,
    settings: RuleSettings,
    metrics: ControllerMetrics,
    interval: Duration,
    /// Blocks to plan again when the NotReady policy lets the controller answer a sticky
    /// takeover mark for a node's agent.
    answer_timers: BTreeSet<String>,
}

impl Sweeper {
    /// A sweeper running every `interval`.
    pub fn new(
        index: SharedIndex,
        supervisor: Addr<PoolSupervisor>,
        leading: Leadership,
        settings: RuleSettings,
        metrics: ControllerMetrics,
        interval: Duration,
    ) -> Self {
        Self { index, supervisor, leading, settings, metrics, interval, answer_timers: BTreeSet::new() }
    }

    fn sweep(&self, trigger: Trigger) -> impl Future<Output = SweepReport> + 'static {
        let started = Instant::now();
        let plan = self.plan_all();
        let metrics = self.metrics.clone();
        metrics.records_scanned.inc_by(u64::try_from(plan.scanned).unwrap_or(u64::MAX));
        for (reason, count) in &plan.kept {
            metrics.skip(reason, u64::try_from(*count).unwrap_or(u64::MAX));
        }
        let mut report = SweepReport {
            scanned: plan.scanned,
            planned: plan.changes.len(),
            traced: plan.traced.len(),
            kept: plan.kept.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            ..SweepReport::default()
        };
        let send = (!plan.changes.is_empty())
            .then(|| self.supervisor.send(ApplyChanges { changes: plan.changes, trigger, since: None }));
        async move {
            let outcome = match send {
                Some(send) => send.await.unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "the pool supervisor did not answer");
                    ApplyOutcome { failed: report.planned, ..ApplyOutcome::default() }
                }),
                None => ApplyOutcome::default(),
            };
            report.released = outcome.released;
            report.repaired = outcome.repaired;
            report.marked = outcome.marked;
            report.aborted = outcome.aborted;
            report.answered = outcome.answered;
            report.detached = outcome.detached;
            report.skipped = outcome.skipped;
            report.failed = outcome.failed;
            let elapsed = started.elapsed();
            report.duration_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
            metrics.sweep_duration.observe(elapsed.as_secs_f64());
            tracing::info!(trigger = trigger.label(), ?report, "sweep done");
            report
        }
    }

    /// What a sweep of every block would do now.
    fn plan_all(&self) -> sweep::SweepPlan {
        let index = self.index.read();
        sweep::plan(&index, index.blocks_by_name().values(), Timestamp::now(), &self.settings)
    }

    fn sweep_if_leading(&mut self, trigger: Trigger, ctx: &mut Context<Self>) {
        if self.leading.is_leading() {
            ctx.spawn(self.sweep(trigger).into_actor(self).map(|_, _, _| ()));
        }
    }
}

impl Actor for Sweeper {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(self.interval, |act, ctx| act.sweep_if_leading(Trigger::Sweep, ctx));
    }
}

impl Handler<LeadershipChanged> for Sweeper {
    type Result = ();

    fn handle(&mut self, msg: LeadershipChanged, ctx: &mut Context<Self>) {
        if msg.0 {
            // A new leader sweeps at once: whatever its predecessor left is caught now.
            self.sweep_if_leading(Trigger::Sweep, ctx);
        }
    }
}

impl Sweeper {
    /// Plans one block whose handshakes changed and carries out what concerns them; a
    /// takeover mark the NotReady policy lets the controller answer later is planned again
    /// then.
    fn plan_block(&mut self, block: Arc<IPBlock>, ctx: &mut Context<Self>) {
        let now = Timestamp::now();
        let plan = sweep::plan(&self.index.read(), [&block], now, &self.settings);
        let concerns = |ip: &str| block.spec.allocations.get(ip).is_some_and(actionable);
        let name = block.name_any();
        let answer_at = plan.traced.iter().filter(|(change, _)| concerns(&change.ip)).map(|(_, at)| *at).min();
        if let Some(at) = answer_at.filter(|_| self.answer_timers.insert(name.clone())) {
            let delay = Duration::try_from(at.duration_since(now)).unwrap_or(Duration::ZERO);
            ctx.run_later(delay, move |act, ctx| {
                act.answer_timers.remove(&name);
                let fresh = act.index.read().block(&name).cloned();
                if let Some(fresh) = fresh.filter(|_| act.leading.is_leading()) {
                    act.plan_block(fresh, ctx);
                }
            });
        }
        let changes: Vec<_> = plan.changes.into_iter().filter(|change| concerns(&change.ip)).collect();
        if changes.is_empty() {
            return;
        }
        let request = ApplyChanges { changes, trigger: Trigger::Handshake, since: None };
        ctx.spawn(apply_in_background(self.supervisor.clone(), request).into_actor(self));
    }
}

/// Block changes: an agent's answer to a release handshake, and an agent's sticky takeover
/// mark, are acted on at once, not at the next sweep.
impl StreamHandler<Result<Arc<IPBlock>, watcher::Error>> for Sweeper {
    fn handle(&mut self, event: Result<Arc<IPBlock>, watcher::Error>, ctx: &mut Context<Self>) {
        let block = match event {
            Ok(block) if block.spec.allocations.values().any(actionable) => block,
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(error = %e, "IPBlock watch error; retrying with backoff");
                return;
            }
        };
        if self.leading.is_leading() {
            self.plan_block(block, ctx);
        }
    }

    fn finished(&mut self, _ctx: &mut Context<Self>) {
        tracing::error!("the IPBlock watch ended; answered handshakes wait for the next sweep");
    }
}

impl Handler<SweepNow> for Sweeper {
    type Result = ResponseActFuture<Self, Result<SweepReport, String>>;

    fn handle(&mut self, SweepNow(trigger): SweepNow, _ctx: &mut Context<Self>) -> Self::Result {
        if !self.leading.is_leading() {
            return Box::pin(actix::fut::ready(Err(NOT_LEADER.to_string())));
        }
        Box::pin(self.sweep(trigger).into_actor(self).map(|report, _, _| Ok(report)))
    }
}

impl Handler<PlanNow> for Sweeper {
    type Result = Result<DryRunPlan, String>;

    fn handle(&mut self, _msg: PlanNow, _ctx: &mut Context<Self>) -> Self::Result {
        if !self.leading.is_leading() {
            return Err(NOT_LEADER.to_string());
        }
        Ok(DryRunPlan::of(&self.plan_all()))
    }
}
