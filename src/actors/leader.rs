//! `Leader`: Lease-based election. Only the leader writes; standbys keep warm caches, report
//! ready and never write. Every write is gated by [`Leadership::is_leading`], which checks the
//! last renewal's validity on the monotonic clock right before the write, so a leader whose
//! apiserver hangs, or whose process was paused, stops writing before another can lead.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::{Actor, ActorFutureExt, AsyncContext, Context, Message, Recipient, WrapFuture};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, PostParams};

use super::metrics::ControllerMetrics;
use crate::lease::{self, LeaseAction, LeaseState, Observation, decide};

/// Sent to subscribers whenever leadership is gained or lost.
#[derive(Message, Clone, Copy, Debug)]
#[rtype(result = "()")]
pub struct LeadershipChanged(pub bool);

/// Whether this replica may write now: shared by the elector (which extends it on each
/// renewal) and every writer (which asks right before each write).
#[derive(Clone, Debug, Default)]
pub struct Leadership(Arc<Mutex<Option<Instant>>>);

impl Leadership {
    /// True while the last successful renewal is still valid on the monotonic clock.
    pub fn is_leading(&self) -> bool {
        self.0.lock().is_ok_and(|until| until.is_some_and(|until| Instant::now() < until))
    }

    fn hold_until(&self, until: Instant) {
        if let Ok(mut held) = self.0.lock() {
            *held = Some(until);
        }
    }

    fn release(&self) {
        if let Ok(mut held) = self.0.lock() {
            *held = None;
        }
    }
}

/// Why an election round did not complete.
#[derive(Debug, thiserror::Error)]
enum RoundError {
    /// A Lease call failed.
    #[error("lease {name}: {source}")]
    Api {
        /// The Lease's name.
        name: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// The apiserver did not answer within [`lease::call_timeout`].
    #[error("lease {name}: no answer within {timeout:?}")]
    TimedOut {
        /// The Lease's name.
        name: String,
        /// The bound.
        timeout: Duration,
    },
}

/// What one round saw and did.
struct Round {
    /// This replica holds the lease now.
    leading: bool,
    /// The record as seen, for the next round's expiry judgement.
    observed: Option<Observation<String>>,
}

/// Which Lease to hold, as whom, and how long a renewal lasts.
#[derive(Clone)]
pub struct Election {
    /// The Lease's namespace, through the API.
    pub api: Api<Lease>,
    /// The Lease's name.
    pub name: String,
    /// This replica's identity in the Lease.
    pub identity: String,
    /// The lease duration.
    pub duration: Duration,
    /// Shifts the wall clock this replica writes into the Lease (tests only).
    pub clock_offset: SignedDuration,
}

/// The election actor.
pub struct Leader {
    election: Election,
    leadership: Leadership,
    announced: bool,
    observed: Option<Observation<String>>,
    subscribers: Vec<Recipient<LeadershipChanged>>,
    busy: bool,
    metrics: ControllerMetrics,
}

impl Leader {
    /// An elector for `election` that extends `leadership` on each renewal.
    pub fn new(
        election: Election,
        leadership: Leadership,
        subscribers: Vec<Recipient<LeadershipChanged>>,
        metrics: ControllerMetrics,
    ) -> Self {
        Self { election, leadership, announced: false, observed: None, subscribers, busy: false, metrics }
    }

    /// Tells the metric and the subscribers when leadership changed since the last call.
    fn announce(&mut self) {
        let leading = self.leadership.is_leading();
        if self.announced != leading {
            self.announced = leading;
            tracing::info!(identity = %self.election.identity, leading, "leadership changed");
            self.metrics.leader.set(i64::from(leading));
            for subscriber in &self.subscribers {
                subscriber.do_send(LeadershipChanged(leading));
            }
        }
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        // A renewal that ran out while a round hangs is announced at once.
        self.announce();
        if self.busy {
            return;
        }
        self.busy = true;
        let started = Instant::now();
        let timeout = lease::call_timeout(self.election.duration);
        let round = try_lease(self.election.clone(), self.observed.clone());
        let name = self.election.name.clone();
        let bounded = async move {
            tokio::time::timeout(timeout, round).await.unwrap_or(Err(RoundError::TimedOut { name, timeout }))
        };
        ctx.spawn(bounded.into_actor(self).map(move |result, act, _| {
            act.busy = false;
            match result {
                Ok(round) => {
                    act.observed = round.observed;
                    if round.leading {
                        act.leadership.hold_until(lease::valid_until(started, act.election.duration));
                    } else {
                        act.leadership.release();
                    }
                }
                // Leadership lapses by itself when the renewal's validity runs out.
                Err(e) => tracing::warn!(error = %e, "lease round failed"),
            }
            act.announce();
        }));
    }
}

impl Actor for Leader {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.tick(ctx);
        ctx.run_interval(self.election.duration / 4, |act, ctx| act.tick(ctx));
    }
}

/// One election round: reads the Lease, judges it by local observation (`observed`, from
/// earlier rounds), and acquires or renews it when [`decide`] says so.
async fn try_lease(election: Election, mut observed: Option<Observation<String>>) -> Result<Round, RoundError> {
    let Election { api, name, identity, duration, clock_offset } = election;
    let api_error = |source| RoundError::Api { name: name.clone(), source };
    let current = api.get_opt(&name).await.map_err(api_error)?;
    let version = current.as_ref().and_then(|l| l.metadata.resource_version.clone()).unwrap_or_default();
    let unchanged_for = Observation::observe(&mut observed, version, Instant::now());
    let spec = current.as_ref().map(|l| l.spec.clone().unwrap_or_default());
    let state = LeaseState {
        holder: spec.as_ref().and_then(|s| s.holder_identity.as_deref()),
        duration: spec
            .as_ref()
            .and_then(|s| s.lease_duration_seconds)
            .map(|s| Duration::from_secs(u64::try_from(s).unwrap_or(0))),
    };
    let action = decide(&state, &identity, unchanged_for, duration);
    if action == LeaseAction::Standby {
        return Ok(Round { leading: false, observed });
    }
    // Wall-clock times are only written, for people reading the Lease; no decision uses them.
    let now = Timestamp::now().saturating_add(clock_offset).unwrap_or_else(|_| Timestamp::now());
    let mut lease = current.clone().unwrap_or_default();
    lease.metadata.name = Some(name.clone());
    let spec = lease.spec.get_or_insert_with(Default::default);
    if action == LeaseAction::Acquire {
        spec.acquire_time = Some(MicroTime(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.holder_identity = Some(identity.clone());
    spec.renew_time = Some(MicroTime(now));
    spec.lease_duration_seconds = Some(i32::try_from(duration.as_secs()).unwrap_or(i32::MAX));
    // The replica's own field manager, as on its IPBlock writes: managedFields show who wrote.
    let params = PostParams { field_manager: Some(format!("ipwarden-controller-{identity}")), ..PostParams::default() };
    let written = match current {
        Some(_) => api.replace(&name, &params, &lease).await,
        None => api.create(&params, &lease).await,
    };
    match written {
        Ok(_) => Ok(Round { leading: true, observed }),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(Round { leading: false, observed }),
        Err(source) => Err(RoundError::Api { name, source }),
    }
}
