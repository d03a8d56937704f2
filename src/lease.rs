//! Pure leader-election decisions over a coordination.k8s.io Lease: whether this replica
//! should acquire, renew, or stand by.

use std::time::Duration;

use jiff::Timestamp;

/// What the lease holds now.
#[derive(Clone, Debug, Default)]
pub struct LeaseState<'a> {
    /// `spec.holderIdentity`.
    pub holder: Option<&'a str>,
    /// `spec.renewTime` (or `acquireTime` when never renewed).
    pub renewed: Option<Timestamp>,
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

/// Decides for replica `me` at `now`; `default_duration` applies when the lease names none.
pub fn decide(state: &LeaseState<'_>, me: &str, now: Timestamp, default_duration: Duration) -> LeaseAction {
    match state.holder.filter(|h| !h.is_empty()) {
        None => LeaseAction::Acquire,
        Some(holder) if holder == me => LeaseAction::Renew,
        Some(_) => {
            let duration = state.duration.unwrap_or(default_duration);
            let expired = state.renewed.is_none_or(|at| at.saturating_add(duration).is_ok_and(|end| end <= now));
            if expired { LeaseAction::Acquire } else { LeaseAction::Standby }
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(s).expect("ts")
    }

    #[test]
    fn a_free_lease_is_acquired_and_our_own_is_renewed() {
        let d = Duration::from_secs(15);
        assert_eq!(decide(&LeaseState::default(), "me", at(100), d), LeaseAction::Acquire);
        let empty = LeaseState { holder: Some(""), ..LeaseState::default() };
        assert_eq!(decide(&empty, "me", at(100), d), LeaseAction::Acquire);
        let ours = LeaseState { holder: Some("me"), renewed: Some(at(10)), duration: Some(d) };
        assert_eq!(decide(&ours, "me", at(100), d), LeaseAction::Renew, "even when late, our own lease is renewed");
    }

    #[test]
    fn another_holders_lease_is_respected_until_it_expires() {
        let d = Duration::from_secs(15);
        let theirs = |renewed| LeaseState { holder: Some("other"), renewed: Some(at(renewed)), duration: Some(d) };
        assert_eq!(decide(&theirs(90), "me", at(100), d), LeaseAction::Standby);
        assert_eq!(decide(&theirs(85), "me", at(100), d), LeaseAction::Acquire, "renewed + duration <= now: expired");
        let never = LeaseState { holder: Some("other"), renewed: None, duration: None };
        assert_eq!(decide(&never, "me", at(100), d), LeaseAction::Acquire);
    }
}
