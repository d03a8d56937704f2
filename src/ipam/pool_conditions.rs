//! Each IPPool's conditions, judged from the pools and blocks that exist: `Overlapping` (an
//! orphaned block still holding records counts as an overlap) and `GatewayInRanges` (its
//! ranges name the defaulted gateway, which is never handed out). Pure: the controller's leader
//! writes what [`to_write`] returns (`actors::pool_conditions`).

use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;

use crate::crd::{IPBlock, IPPool};
use crate::ipam::pools::{self, GATEWAY_IN_RANGES_CONDITION, OVERLAPPING_CONDITION, PoolSet};

/// The pools among `pools` whose conditions differ from what `pools` and `blocks` say, each
/// with its conditions to write (both of them), judged at `now`.
pub fn to_write(pools: &[Arc<IPPool>], blocks: &[Arc<IPBlock>], now: Timestamp) -> Vec<(String, Vec<Condition>)> {
    let pool_set = PoolSet::of(pools, blocks);
    let views = pool_set.views();
    pools::overlap_conditions(&views, pool_set.orphans())
        .into_iter()
        .filter_map(|(name, (overlapping, message))| {
            let current = pools.iter().find(|p| p.name_any() == name)?;
            Some((name, conditions_to_write(current, overlapping, message, now)?))
        })
        .collect()
}

/// The conditions pool `current` should have, given whether it overlaps (and the message
/// saying with what), or `None` when it has them already (status, message and the generation
/// they were judged at), computed without I/O. A condition that keeps
/// its status keeps its `lastTransitionTime`; one that changes it takes `now`.
fn conditions_to_write(
    current: &IPPool,
    overlapping: bool,
    overlap_message: String,
    now: Timestamp,
) -> Option<Vec<Condition>> {
    let wanted = [
        (OVERLAPPING_CONDITION, overlapping, if overlapping { "CidrOverlap" } else { "NoOverlap" }, overlap_message),
        match pools::gateway_withheld_from_ranges(&current.spec) {
            Some(why) => (GATEWAY_IN_RANGES_CONDITION, true, "DefaultedGatewayInRanges", why),
            None => (
                GATEWAY_IN_RANGES_CONDITION,
                false,
                "GatewayNotWithheld",
                "every address of spec.ranges can be handed out".to_string(),
            ),
        },
    ];
    let stored = |type_: &str| current.status.as_ref().and_then(|s| s.conditions.iter().find(|c| c.type_ == type_));
    let status = |on: bool| if on { "True" } else { "False" };
    let generation = current.metadata.generation;
    let unchanged = wanted.iter().all(|(type_, on, _, message)| {
        stored(type_)
            .is_some_and(|c| c.status == status(*on) && c.message == *message && c.observed_generation == generation)
    });
    if unchanged {
        return None;
    }
    let conditions = wanted
        .into_iter()
        .map(|(type_, on, reason, message)| Condition {
            type_: type_.to_string(),
            status: status(on).to_string(),
            reason: reason.to_string(),
            message,
            last_transition_time: stored(type_)
                .filter(|c| c.status == status(on))
                .map_or(Time(now), |c| c.last_transition_time.clone()),
            observed_generation: generation,
        })
        .collect();
    Some(conditions)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pool(spec: serde_json::Value, generation: i64, conditions: Vec<Condition>) -> IPPool {
        let mut pool = IPPool::new("p", serde_json::from_value(spec).expect("a pool spec"));
        pool.metadata.generation = Some(generation);
        pool.status = Some(crate::crd::IPPoolStatus { conditions, ..Default::default() });
        pool
    }

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(seconds).expect("a time")
    }

    #[test]
    fn only_pools_whose_conditions_differ_are_written_and_overlapping_pools_say_with_what() {
        let named = |name: &str, cidr: &str| {
            let mut pool = IPPool::new(name, serde_json::from_value(json!({"cidr": cidr})).expect("a pool spec"));
            pool.metadata.generation = Some(1);
            Arc::new(pool)
        };
        let pools = [named("a", "10.60.0.0/24"), named("b", "10.60.0.0/25"), named("c", "10.61.0.0/24")];
        let written = to_write(&pools, &[], at(100));
        let overlapping: Vec<(&str, &str)> = written.iter().map(|(n, c)| (n.as_str(), c[0].status.as_str())).collect();
        assert_eq!(overlapping, [("a", "True"), ("b", "True"), ("c", "False")]);
        assert!(written[0].1[0].message.contains("overlaps b"), "{:?}", written[0].1[0]);

        let mut shown = (*pools[2]).clone();
        shown.status = Some(crate::crd::IPPoolStatus { conditions: written[2].1.clone(), ..Default::default() });
        let again = to_write(&[pools[0].clone(), pools[1].clone(), Arc::new(shown)], &[], at(200));
        let names: Vec<&str> = again.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "b"], "c shows its conditions already");
    }

    #[test]
    fn conditions_are_written_only_when_a_status_message_or_generation_changed_and_keep_their_time_otherwise() {
        let sized = json!({"cidr": "10.60.0.0/29", "ranges": [{"start": "10.60.0.1", "end": "10.60.0.5"}]});
        let first = conditions_to_write(&pool(sized.clone(), 1, vec![]), false, "no overlap".into(), at(100))
            .expect("a pool without conditions gets both");
        let types: Vec<(&str, &str)> = first.iter().map(|c| (c.type_.as_str(), c.status.as_str())).collect();
        assert_eq!(types, [("Overlapping", "False"), ("GatewayInRanges", "True")]);
        assert!(first[1].message.contains("10.60.0.1"), "{:?}", first[1]);
        assert!(first.iter().all(|c| c.last_transition_time == Time(at(100)) && c.observed_generation == Some(1)));

        let stored = pool(sized.clone(), 1, first.clone());
        assert_eq!(conditions_to_write(&stored, false, "no overlap".into(), at(200)), None, "nothing changed");

        // A new generation with the same verdicts: written again, the times kept.
        let edited = pool(sized.clone(), 2, first.clone());
        let again = conditions_to_write(&edited, false, "no overlap".into(), at(300)).expect("a new generation");
        assert!(again.iter().all(|c| c.last_transition_time == Time(at(100)) && c.observed_generation == Some(2)));

        // A new message, same status: the time kept; a status flip: the new time.
        let moved = conditions_to_write(&stored, false, "other message".into(), at(400)).expect("a new message");
        assert_eq!(moved[0].last_transition_time, Time(at(100)));
        let fixed = json!({"cidr": "10.60.0.0/29", "gateway": "10.60.0.1",
                           "ranges": [{"start": "10.60.0.1", "end": "10.60.0.5"}]});
        let cleared = conditions_to_write(&pool(fixed, 2, first), false, "no overlap".into(), at(500))
            .expect("the gateway set clears the condition");
        assert_eq!((cleared[1].status.as_str(), cleared[1].last_transition_time.clone()), ("False", Time(at(500))));
        assert_eq!(cleared[0].last_transition_time, Time(at(100)), "Overlapping kept its status and time");
    }
}
