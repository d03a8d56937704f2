//! `Leader`: Lease-based election. Only the leader writes; standbys keep warm caches, report
//! ready and never write. A leader that cannot renew steps down before its lease expires.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use actix::{Actor, ActorFutureExt, AsyncContext, Context, Message, Recipient, WrapFuture};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, PostParams};

use super::metrics::ControllerMetrics;
use crate::lease::{LeaseAction, LeaseState, decide};

/// Sent to subscribers whenever leadership is gained or lost.
#[derive(Message, Clone, Copy, Debug)]
#[rtype(result = "()")]
pub struct LeadershipChanged(pub bool);

/// The election actor.
pub struct Leader {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
    clock_offset: SignedDuration,
    leading: Arc<AtomicBool>,
    subscribers: Vec<Recipient<LeadershipChanged>>,
    last_renewal: Option<Instant>,
    busy: bool,
    metrics: ControllerMetrics,
}

impl Leader {
    /// An elector for Lease `namespace/name` as `identity`.
    pub fn new(
        api: Api<Lease>,
        name: String,
        identity: String,
        duration: Duration,
        clock_offset: SignedDuration,
        leading: Arc<AtomicBool>,
        subscribers: Vec<Recipient<LeadershipChanged>>,
        metrics: ControllerMetrics,
    ) -> Self {
        Self {
            api,
            name,
            identity,
            duration,
            clock_offset,
            leading,
            subscribers,
            last_renewal: None,
            busy: false,
            metrics,
        }
    }

    fn set_leading(&mut self, leading: bool) {
        if self.leading.swap(leading, Ordering::SeqCst) != leading {
            tracing::info!(identity = %self.identity, leading, "leadership changed");
            self.metrics.leader.set(i64::from(leading));
            for subscriber in &self.subscribers {
                subscriber.do_send(LeadershipChanged(leading));
            }
        }
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        if self.busy {
            return;
        }
        self.busy = true;
        let attempt =
            try_lease(self.api.clone(), self.name.clone(), self.identity.clone(), self.duration, self.clock_offset);
        ctx.spawn(attempt.into_actor(self).map(|result, act, _| {
            act.busy = false;
            match result {
                Ok(true) => {
                    act.last_renewal = Some(Instant::now());
                    act.set_leading(true);
                }
                Ok(false) => act.set_leading(false),
                Err(e) => {
                    tracing::warn!(error = %e, "lease renewal failed");
                    // Step down well before the lease could be taken by another replica.
                    let deadline = act.duration * 2 / 3;
                    if act.last_renewal.is_none_or(|at| at.elapsed() > deadline) {
                        act.set_leading(false);
                    }
                }
            }
        }));
    }
}

impl Actor for Leader {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.tick(ctx);
        ctx.run_interval(self.duration / 4, |act, ctx| act.tick(ctx));
    }
}

/// One election round: true when this replica holds the lease afterwards.
async fn try_lease(
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
    clock_offset: SignedDuration,
) -> Result<bool, kube::Error> {
    let current = api.get_opt(&name).await?;
    let now = Timestamp::now().saturating_add(clock_offset).unwrap_or_else(|_| Timestamp::now());
    let spec = current.as_ref().map(|l| l.spec.clone().unwrap_or_default());
    let state = LeaseState {
        holder: spec.as_ref().and_then(|s| s.holder_identity.as_deref()),
        renewed: spec.as_ref().and_then(|s| s.renew_time.as_ref().or(s.acquire_time.as_ref())).map(|t| t.0),
        duration: spec
            .as_ref()
            .and_then(|s| s.lease_duration_seconds)
            .map(|s| Duration::from_secs(u64::try_from(s).unwrap_or(0))),
    };
    let action = decide(&state, &identity, now, duration);
    if action == LeaseAction::Standby {
        return Ok(false);
    }
    let mut lease = current.clone().unwrap_or_default();
    lease.metadata.name = Some(name.clone());
    let spec = lease.spec.get_or_insert_with(Default::default);
    if action == LeaseAction::Acquire {
        spec.acquire_time = Some(MicroTime(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.holder_identity = Some(identity);
    spec.renew_time = Some(MicroTime(now));
    spec.lease_duration_seconds = Some(i32::try_from(duration.as_secs()).unwrap_or(i32::MAX));
    let written = match current {
        Some(_) => api.replace(&name, &PostParams::default(), &lease).await,
        None => api.create(&PostParams::default(), &lease).await,
    };
    match written {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}
