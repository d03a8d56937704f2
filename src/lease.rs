//! Pure leader-election decisions over a coordination.k8s.io Lease: whether this replica
//! should acquire, renew, or stand by, and until when a renewal lets it write.
//!
//! Nothing here compares another replica's wall clock with ours: a lease counts as expired
//! when this replica has seen it unchanged for a whole lease duration, measured on its own
//! monotonic clock (client-go's rule). A replica whose clock runs ahead or behind therefore
//! never takes a live lease, and a paused process cannot write past its lease.

use std::time::{Duration, Instant};

/// What the lease holds now.
#[derive(Clone, Debug, Default)]
pub struct LeaseState<'a> {
    /// `spec.holderIdentity`.
    pub holder: Option<&'a str>,
    /// `spec.leaseDurationSeconds`.
    pub duration: Option<Duration>,
}

/// What this replica should do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseAction {
    /// Take the lease (free or expired).
    Acquire,
    /// Renew our own lease.
    Renew,
    /// Another replica holds a live lease.
    Standby,
}

/// Decides for replica `me`, which has seen the lease record unchanged for `unchanged_for`
/// (its own monotonic time since it first saw this version of the record);
/// `default_duration` applies when the lease names none.
pub fn decide(state: &LeaseState<'_>, me: &str, unchanged_for: Duration, default_duration: Duration) -> LeaseAction {
    match state.holder.filter(|h| !h.is_empty()) {
        None => LeaseAction::Acquire,
        Some(holder) if holder == me => LeaseAction::Renew,
        Some(_) if expired_for(unchanged_for, state.duration.unwrap_or(default_duration)).is_some() => {
            LeaseAction::Acquire
        }
        Some(_) => LeaseAction::Standby,
    }
}

/// How long ago a lease of `duration`, seen unchanged for `unchanged_for`, expired; None
/// while it is live. The one staleness rule for every Lease ipwarden judges.
pub fn expired_for(unchanged_for: Duration, duration: Duration) -> Option<Duration> {
    unchanged_for.checked_sub(duration)
}

/// When this replica last saw the lease record change, on its own monotonic clock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observation<R> {
    /// The record as last seen (any comparable form of it, e.g. its resourceVersion).
    pub record: R,
    /// When that version was first seen.
    pub since: Instant,
}

impl<R: PartialEq> Observation<R> {
    /// Records that `record` was seen at `now`; returns how long it has been unchanged.
    pub fn observe(observed: &mut Option<Self>, record: R, now: Instant) -> Duration {
        match observed {
            Some(seen) if seen.record == record => now.saturating_duration_since(seen.since),
            _ => {
                *observed = Some(Self { record, since: now });
                Duration::ZERO
            }
        }
    }
}

/// How long after a renewal attempt *started* its success lets this replica write: two
/// thirds of the lease, so it stops writing well before another replica may acquire (a
/// whole duration after it last saw the record change).
pub fn renew_deadline(duration: Duration) -> Duration {
    duration * 2 / 3
}

/// The bound on one election round's Lease calls: well under [`renew_deadline`], so a hung
/// apiserver makes the leader step down in time instead of waiting for the client's timeout.
pub fn call_timeout(duration: Duration) -> Duration {
    duration / 4
}

/// Until when a renewal that started at `attempt_started` lets this replica write.
pub fn valid_until(attempt_started: Instant, duration: Duration) -> Instant {
    attempt_started + renew_deadline(duration)
}

#[cfg(test)]
mod test {
    use super::*;

    const D: Duration = Duration::from_secs(15);

    #[test]
    fn a_free_lease_is_acquired_and_our_own_is_renewed() {
        assert_eq!(decide(&LeaseState::default(), "me", Duration::ZERO, D), LeaseAction::Acquire);
        let empty = LeaseState { holder: Some(""), ..LeaseState::default() };
        assert_eq!(decide(&empty, "me", Duration::ZERO, D), LeaseAction::Acquire);
        let ours = LeaseState { holder: Some("me"), duration: Some(D) };
        assert_eq!(decide(&ours, "me", D * 10, D), LeaseAction::Renew, "even when late, our own lease is renewed");
    }

    #[test]
    fn another_holders_lease_is_respected_until_seen_unchanged_for_its_duration() {
        let theirs = LeaseState { holder: Some("other"), duration: Some(D) };
        assert_eq!(decide(&theirs, "me", Duration::ZERO, D), LeaseAction::Standby, "just seen: live");
        assert_eq!(decide(&theirs, "me", D - Duration::from_millis(1), D), LeaseAction::Standby);
        assert_eq!(decide(&theirs, "me", D, D), LeaseAction::Acquire, "unchanged for a whole duration: expired");
        let short = LeaseState { holder: Some("other"), duration: Some(Duration::from_secs(4)) };
        assert_eq!(decide(&short, "me", Duration::from_secs(4), D), LeaseAction::Acquire, "the lease's own duration");
        let unnamed = LeaseState { holder: Some("other"), duration: None };
        assert_eq!(decide(&unnamed, "me", Duration::from_secs(4), D), LeaseAction::Standby, "else the default");
    }

    #[test]
    fn unchanged_time_restarts_whenever_the_record_changes() {
        let start = Instant::now();
        let mut observed = None;
        assert_eq!(Observation::observe(&mut observed, "rv1", start), Duration::ZERO, "first sight");
        let later = start + Duration::from_secs(5);
        assert_eq!(Observation::observe(&mut observed, "rv1", later), Duration::from_secs(5));
        assert_eq!(Observation::observe(&mut observed, "rv2", later), Duration::ZERO, "a renewal resets it");
        assert_eq!(Observation::observe(&mut observed, "rv2", later + D), D);
    }

    #[test]
    fn a_renewal_lets_the_leader_write_for_less_than_a_standby_waits() {
        let started = Instant::now();
        let until = valid_until(started, D);
        assert_eq!(until - started, Duration::from_secs(10));
        assert!(until - started < D, "the leader stops writing before any standby may acquire");
        assert!(call_timeout(D) < renew_deadline(D), "a hung call ends before the deadline");
    }
}
