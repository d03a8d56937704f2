//! Which nodes have no live agent: judged from each node's agent Lease by local observation
//! (src/lease.rs), never by comparing the Lease's renewTime with our wall clock. A node whose
//! agent Lease this controller has seen unchanged (or missing) for a whole duration has an
//! agent that cannot answer the release handshake.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use jiff::{SignedDuration, Timestamp};

use crate::lease::{self, Observation};

/// What a node's agent Lease holds now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentLease {
    /// Its resourceVersion: any renewal changes it.
    pub version: String,
    /// Its `spec.leaseDurationSeconds`.
    pub duration: Option<Duration>,
}

/// The controller's observations of the agent Leases, by node; the record is None while a
/// node has no Lease.
pub type Observations = HashMap<String, Observation<Option<String>>>;

/// Observes the agent Lease of every node in `nodes` at `now` (monotonic) and returns the
/// nodes whose agent is gone, each with the wall-clock time (`wall`, read at `now`) its
/// Lease went stale. `default_duration` applies to a missing Lease or one without a
/// duration. Observations of nodes that no longer exist are dropped.
pub fn stale_agents<'a>(
    nodes: impl IntoIterator<Item = &'a str>,
    leases: &HashMap<String, AgentLease>,
    observed: &mut Observations,
    default_duration: Duration,
    now: Instant,
    wall: Timestamp,
) -> HashMap<String, Timestamp> {
    let mut seen = Observations::new();
    let mut stale = HashMap::new();
    for node in nodes {
        let lease = leases.get(node);
        let mut observation = observed.remove(node);
        let unchanged_for = Observation::observe(&mut observation, lease.map(|l| l.version.clone()), now);
        let duration = lease.and_then(|l| l.duration).unwrap_or(default_duration);
        if let Some(ago) = lease::expired_for(unchanged_for, duration) {
            let since = SignedDuration::try_from(ago).ok().and_then(|ago| wall.checked_sub(ago).ok());
            stale.insert(node.to_string(), since.unwrap_or(wall));
        }
        if let Some(observation) = observation {
            seen.insert(node.to_string(), observation);
        }
    }
    *observed = seen;
    stale
}

#[cfg(test)]
mod test {
    use super::*;

    const D: Duration = Duration::from_secs(20);

    fn lease(version: &str) -> AgentLease {
        AgentLease { version: version.into(), duration: Some(D) }
    }

    #[test]
    fn an_agent_is_gone_once_its_lease_is_seen_unchanged_or_missing_for_a_whole_duration() {
        let start = Instant::now();
        let wall = Timestamp::from_second(1_000_000).expect("wall");
        let mut observed = Observations::new();
        let leases = HashMap::from([("a".to_string(), lease("1")), ("b".to_string(), lease("1"))]);
        let nodes = ["a", "b", "c"];
        let first = stale_agents(nodes, &leases, &mut observed, D, start, wall);
        assert!(first.is_empty(), "just seen, even missing: live (a controller that just started)");

        let later = start + D + Duration::from_secs(5);
        let wall_later = wall + SignedDuration::from_secs(25);
        let renewed = HashMap::from([("a".to_string(), lease("2")), ("b".to_string(), lease("1"))]);
        let stale = stale_agents(nodes, &renewed, &mut observed, D, later, wall_later);
        let expected = wall + SignedDuration::from_secs(20);
        assert_eq!(stale, HashMap::from([("b".to_string(), expected), ("c".to_string(), expected)]));

        let gone = stale_agents(["a"], &renewed, &mut observed, D, later, wall_later);
        assert!(gone.is_empty());
        assert_eq!(observed.len(), 1, "observations of deleted nodes are dropped");
    }
}
