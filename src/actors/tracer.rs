//! `PodTracer`: follows pod events. A pod that terminates, completes or disappears has its
//! records (found by its UID in the cached blocks) evaluated at its deadline,
//! `deletionTimestamp` plus the additional delay (the timestamp already includes the grace
//! period), and the verdicts go to the pool actors.

use super::leader::Leadership;
use std::collections::HashMap;
use std::time::Duration;

use actix::{Actor, Addr, AsyncContext, Context, SpawnHandle, StreamHandler, WrapFuture};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::runtime::watcher;

use super::metrics::ControllerMetrics;
use super::pool::{ApplyChanges, PoolSupervisor, Trigger, apply_in_background};
use super::watches::SharedIndex;
use crate::crd::PodRef;
use crate::gc::index::PodFacts;
use crate::gc::rules::RuleSettings;
use crate::gc::sweep::{ChangeAction, Planned, RecordChange, next_step};

/// A traced pod: who it was and when it ended.
#[derive(Clone, Debug)]
struct Traced {
    pod: PodRef,
    since: Timestamp,
}

/// The tracer actor.
pub struct PodTracer {
    index: SharedIndex,
    supervisor: Addr<PoolSupervisor>,
    leading: Leadership,
    settings: RuleSettings,
    metrics: ControllerMetrics,
    timers: HashMap<String, SpawnHandle>,
}

impl PodTracer {
    /// A tracer over the index, sending changes to `supervisor`.
    pub fn new(
        index: SharedIndex,
        supervisor: Addr<PoolSupervisor>,
        leading: Leadership,
        settings: RuleSettings,
        metrics: ControllerMetrics,
    ) -> Self {
        Self { index, supervisor, leading, settings, metrics, timers: HashMap::new() }
    }

    fn schedule(&mut self, traced: Traced, at: Timestamp, ctx: &mut Context<Self>) {
        let key = traced.pod.uid.clone();
        if let Some(previous) = self.timers.remove(&key) {
            ctx.cancel_future(previous);
        }
        let delay = Duration::try_from(at.duration_since(Timestamp::now())).unwrap_or(Duration::ZERO);
        let handle = ctx.run_later(delay, move |act, ctx| act.evaluate(traced, ctx));
        self.timers.insert(key, handle);
        self.metrics.candidates.set(i64::try_from(self.timers.len()).unwrap_or(i64::MAX));
    }

    fn evaluate(&mut self, traced: Traced, ctx: &mut Context<Self>) {
        self.timers.remove(&traced.pod.uid);
        self.metrics.candidates.set(i64::try_from(self.timers.len()).unwrap_or(i64::MAX));
        if !self.leading.is_leading() {
            return;
        }
        let index = self.index.read();
        let now = Timestamp::now();
        let mut changes = Vec::new();
        let mut again: Option<Timestamp> = None;
        // The records are found by the pod's UID, not through its IPClaim: the claim janitor
        // may have deleted the claim of a pod that is gone before its deadline came.
        for (block, ip, record) in index.records_of(&traced.pod.uid) {
            let verdict = index.evaluate(&block.name_any(), ip, record, now, &self.settings);
            let takeover = index.takeover_step(record, now, &self.settings);
            let unbacked = index.target_unbacked(record, now, &self.settings);
            match next_step(verdict, record, index.agent_can_answer(record), takeover, unbacked) {
                Planned::Change(
                    action @ (ChangeAction::Release { .. }
                    | ChangeAction::AbortHandshake
                    | ChangeAction::AbortTakeover
                    | ChangeAction::AnswerTakeover { .. }
                    | ChangeAction::DetachTarget { .. }),
                ) => changes.push(RecordChange::of(&index, block, ip, record, action)),
                Planned::Trace(at) => again = Some(again.map_or(at, |a| a.min(at))),
                // Repairs are the sweep's: it resolves the adopting pod from the IP index.
                Planned::Repair | Planned::Change(ChangeAction::Repair { .. }) | Planned::Keep(_) => {}
            }
        }
        drop(index);
        if let Some(at) = again {
            self.schedule(traced.clone(), at, ctx);
        }
        if changes.is_empty() {
            return;
        }
        let request = ApplyChanges { changes, trigger: Trigger::Trace, since: Some(traced.since) };
        ctx.spawn(apply_in_background(self.supervisor.clone(), request).into_actor(self));
    }

    fn traced(&self, pod: &Pod) -> Traced {
        let facts = PodFacts::of(pod);
        let ended = facts.deletion.unwrap_or_else(Timestamp::now);
        Traced {
            pod: PodRef { namespace: pod.namespace().unwrap_or_default(), name: pod.name_any(), uid: facts.uid },
            since: ended,
        }
    }

    fn deadline(&self, pod: &Pod) -> Timestamp {
        let base = pod.metadata.deletion_timestamp.as_ref().map_or_else(Timestamp::now, |t| t.0);
        base.saturating_add(self.settings.additional_delay).unwrap_or(Timestamp::MAX)
    }
}

impl Actor for PodTracer {
    type Context = Context<Self>;
}

impl StreamHandler<Result<watcher::Event<Pod>, watcher::Error>> for PodTracer {
    fn handle(&mut self, event: Result<watcher::Event<Pod>, watcher::Error>, ctx: &mut Context<Self>) {
        match event {
            Ok(watcher::Event::Delete(pod)) => {
                let at = self.deadline(&pod);
                self.schedule(self.traced(&pod), at, ctx);
            }
            Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => {
                let facts = PodFacts::of(&pod);
                if facts.terminal() {
                    let at = if facts.deletion.is_some() { self.deadline(&pod) } else { Timestamp::now() };
                    self.schedule(self.traced(&pod), at, ctx);
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "pod watch error; retrying with backoff"),
        }
    }

    fn finished(&mut self, _ctx: &mut Context<Self>) {
        tracing::error!("the pod watch ended; the tracer stops (sweeps still run)");
    }
}
