//! Keeps each IPPool's conditions true to the pools and blocks that exist: `Overlapping` (an
//! orphaned block still holding records counts as an overlap) and `GatewayInRanges` (its
//! ranges name the defaulted gateway, which is never handed out). Every agent computes the
//! same answer and writes only when a stored condition differs, so the writes are idempotent
//! and rare.

use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::crd::{IPBlock, IPPool};
use crate::ipam::pools::{self, GATEWAY_IN_RANGES_CONDITION, OVERLAPPING_CONDITION, PoolSet};

/// The conditions pool `current` should have, given whether it overlaps (and the message
/// saying with what), or `None` when it has them already (status, message and the generation
/// they were judged at): what [`reconcile`] writes, computed without I/O. A condition that keeps
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

/// Brings every pool's conditions in line with the current pools and `blocks` (as the agent
/// knows them: its cache and its own writes, the same view its ADDs choose pools by).
pub async fn reconcile(client: &Client, pools: &Store<IPPool>, blocks: &[Arc<IPBlock>]) {
    let snapshot: Vec<Arc<IPPool>> = pools.state();
    let pool_set = PoolSet::of(&snapshot, blocks);
    let views = pool_set.views();
    let api: Api<IPPool> = Api::all(client.clone());
    for (pool, (overlapping, message)) in pools::overlap_conditions(&views, pool_set.orphans()) {
        let Some(current) = snapshot.iter().find(|p| p.name_any() == pool) else { continue };
        let Some(conditions) = conditions_to_write(current, overlapping, message, Timestamp::now()) else { continue };
        let patch = json!({
            "apiVersion": "ipwarden.io/v1alpha1",
            "kind": "IPPool",
            "status": {"conditions": conditions},
        });
        let params = PatchParams::apply("ipwarden-agent-pool-conditions").force();
        if let Err(e) = api.patch_status(&pool, &params, &Patch::Apply(&patch)).await {
            tracing::warn!(pool = %pool, error = %e, "updating the pool's conditions failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
