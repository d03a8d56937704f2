//! Pure edits of an IPBlock's allocation records. Every write to a block is one of these,
//! applied to a freshly read copy and sent with its resourceVersion (compare-and-swap).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::crd::{Allocation, IPBlock, IPBlockSpec, MigrationTarget, OwnerRef, PodRef};

/// The taken IPs (records and spares) and the release times of a block, as the chooser wants
/// them. Keys that do not parse as IPs (hand-edited objects) are left out and so never handed
/// out again.
pub fn usage(spec: &IPBlockSpec) -> (BTreeSet<IpAddr>, BTreeMap<IpAddr, Timestamp>) {
    let allocated = spec.allocations.keys().chain(&spec.spares).filter_map(|ip| ip.parse().ok()).collect();
    let released = spec.released.iter().filter_map(|(ip, at)| Some((ip.parse().ok()?, at.0))).collect();
    (allocated, released)
}

/// What an IP held before an ADD wrote its record there: what undoing that write puts back.
#[derive(Clone, Debug, PartialEq)]
pub enum Prior {
    /// The IP was free, released at this time if ever.
    Free(Option<Time>),
    /// The IP held this record, which the ADD took over: a sticky reservation, or the record
    /// of the previous pod of the same StatefulSet ordinal or VM.
    Held(Box<Allocation>),
    /// The ADD attached its sandbox to the record as a live migration's target; the record
    /// itself stays the source's.
    Attached,
}

/// Records `allocation` for `ip`, forgets its release time, and returns what the IP held
/// before (for [`roll_back`]).
pub fn allocate(spec: &mut IPBlockSpec, ip: IpAddr, allocation: Allocation) -> Prior {
    let key = ip.to_string();
    let released = spec.released.remove(&key);
    match spec.allocations.insert(key, allocation) {
        Some(held) => Prior::Held(Box::new(held)),
        None => Prior::Free(released),
    }
}

/// How many addresses the block holds: its records, and its spares no record holds. The one
/// count of "what is in a block" that its node's affinity, its pool's deletion and the pools
/// that overlap it go by.
pub fn held(spec: &IPBlockSpec) -> usize {
    spec.allocations.len() + spec.spares.iter().filter(|ip| !spec.allocations.contains_key(*ip)).count()
}

/// Whether the block holds nothing ([`held`]): no record and no spare. Only then may its
/// node's affinity go, or its pool's deletion remove it.
pub fn holds_nothing(spec: &IPBlockSpec) -> bool {
    held(spec) == 0
}

/// Whether `record` still names the sandbox `container_id` / `ifname` (and, when given, the
/// pod UID) a decision was made for. An empty container ID (a reservation) names no sandbox.
fn names_sandbox(record: &Allocation, container_id: &str, ifname: &str, pod_uid: Option<&str>) -> bool {
    !container_id.is_empty()
        && record.container_id == container_id
        && record.interface == ifname
        && pod_uid.is_none_or(|uid| record.pod.uid == uid)
}

/// Undoes a failed ADD's record at `ip` if it still names that ADD's sandbox and pod UID: the
/// IP gets back exactly what `prior` says it held. Unlike a release, an IP the ADD took
/// fresh is free again with no new cooldown and no sticky reservation (the runtime never got
/// it, and its retry is a new sandbox), while one it reclaimed goes back to the record it
/// took over (another node's, as this node's reservation of the same pod), and a migration
/// target the ADD attached is detached from the source's record.
/// Returns whether the block changed.
pub fn roll_back(
    spec: &mut IPBlockSpec,
    ip: &str,
    container_id: &str,
    ifname: &str,
    pod_uid: &str,
    prior: &Prior,
) -> bool {
    if let Prior::Attached = prior {
        let Some(record) = spec.allocations.get_mut(ip) else { return false };
        let ours = record.migration_target.as_ref().is_some_and(|t| {
            !container_id.is_empty() && t.container_id == container_id && t.interface == ifname && t.pod.uid == pod_uid
        });
        if ours {
            record.migration_target = None;
        }
        return ours;
    }
    if !spec.allocations.get(ip).is_some_and(|r| names_sandbox(r, container_id, ifname, Some(pod_uid))) {
        return false;
    }
    match prior {
        Prior::Attached => {}
        Prior::Free(released) => {
            spec.allocations.remove(ip);
            if let Some(at) = released {
                spec.released.insert(ip.to_string(), at.clone());
            }
        }
        Prior::Held(record) => {
            let mut restored = Allocation::clone(record);
            // A take of another node's record comes back as this node's reservation for the
            // same pod, not as that node's record: a node writes no other node's record
            // (decision 0022), and the ADD's retry takes its own reservation at once.
            if let Some(taker) = spec.allocations.get(ip)
                && taker.node != restored.node
            {
                restored.node = taker.node.clone();
                restored.container_id.clear();
                restored.interface.clear();
                restored.repaired_at = None;
                restored.release_handshake = None;
                restored.migration_target = None;
            }
            spec.allocations.insert(ip.to_string(), restored);
        }
    }
    true
}

/// The IPs of `spec` recorded for the sandbox `container_id` / `ifname`.
pub fn find_attachment(spec: &IPBlockSpec, container_id: &str, ifname: &str) -> Vec<String> {
    spec.allocations.iter().filter(|(_, a)| holds_sandbox(a, container_id, ifname)).map(|(ip, _)| ip.clone()).collect()
}

/// Whether `record` is attached to the sandbox `container_id` / `ifname`: its own, or that of
/// a live migration's target.
pub fn holds_sandbox(record: &Allocation, container_id: &str, ifname: &str) -> bool {
    let target = record.migration_target.as_ref();
    !container_id.is_empty()
        && ((record.container_id == container_id && record.interface == ifname)
            || target.is_some_and(|t| t.container_id == container_id && t.interface == ifname))
}

/// Whether a sandbox may hold `record`'s IP: the record names one, or a repair adopted it
/// for a pod whose sandbox is unknown. Only a sticky reservation between two pods holds none.
pub fn may_be_attached(record: &Allocation) -> bool {
    !record.container_id.is_empty() || record.repaired_at.is_some()
}

/// Whether `record` counts in the STICKY columns of `kubectl get ippools` (the pool's
/// `status.stickyReserved`) and `ipwarden status`: it was written for a sticky workload
/// (StatefulSet ordinal, KubeVirt VM), whether a pod holds it now or it waits between two
/// pods. One definition, so that the two columns agree.
pub fn counts_as_sticky(record: &Allocation) -> bool {
    record.sticky
}

/// Whether sandbox `container_id` / `ifname` (of pod `pod_uid`, when given) leaving is
/// `record`'s own: the record names that sandbox, or was repaired for that pod
/// ([`adopted_by`]). Only then does the sandbox's release change the record.
pub fn left_by(record: &Allocation, container_id: &str, ifname: &str, pod_uid: Option<&str>) -> bool {
    names_sandbox(record, container_id, ifname, pod_uid) || adopted_by(record, pod_uid)
}

/// Whether `record` was repaired for pod `pod_uid`: the IP is held by a sandbox of that pod
/// on the record's node, the one its agent's checkpoint pairs with the IP.
pub fn adopted_by(record: &Allocation, pod_uid: Option<&str>) -> bool {
    record.repaired_at.is_some() && pod_uid == Some(record.pod.uid.as_str())
}

/// The live pod that reports a record's IP and adopts the record, as the controller sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adopter {
    /// The pod.
    pub pod: PodRef,
    /// Its node (`spec.nodeName`).
    pub node: String,
    /// Its controller.
    pub owner: Option<OwnerRef>,
    /// Whether its owner's kind is sticky.
    pub sticky: bool,
}

/// Rewrites `record` as the whole attachment of `adopter`, the live pod reporting its IP:
/// its pod, node and workload, with the sandbox marked unknown (`repairedAt`), so the
/// adopter's node takes it as its pod's and no other node as a leftover of its own.
pub fn repair(record: &mut Allocation, adopter: &Adopter, now: Timestamp) {
    record.pod = adopter.pod.clone();
    record.node = adopter.node.clone();
    record.owner = adopter.owner.clone();
    record.sticky = adopter.sticky;
    record.held_for = None;
    record.container_id.clear();
    record.interface.clear();
    record.release_handshake = None;
    record.migration_target = None;
    record.repaired_at = Some(Time(now));
}

/// The record `ipwarden adopt` writes for an IP another IPAM attached to `adopter` on
/// `network` (the netconf name the pod's ADD would have named): a repaired record
/// ([`repair`]) from the start, since no sandbox of ipwarden's holds it.
pub fn adopted_record(adopter: &Adopter, network: &str, now: Timestamp) -> Allocation {
    let mut record = Allocation {
        pod: adopter.pod.clone(),
        node: adopter.node.clone(),
        network: network.to_string(),
        container_id: String::new(),
        interface: String::new(),
        owner: None,
        sticky: false,
        held_for: None,
        allocated_at: Time(now),
        release_handshake: None,
        migration_target: None,
        repaired_at: None,
    };
    repair(&mut record, adopter, now);
    record
}

/// Block `name` of `pool` at `cidr` as a write that finds it missing creates it: no record
/// yet, no affinity (the write's edit claims it).
pub fn new_block(name: &str, pool: &str, cidr: ipnet::IpNet) -> IPBlock {
    IPBlock::new(name, IPBlockSpec { pool: pool.to_string(), cidr: cidr.to_string(), ..Default::default() })
}

/// Whether `record` names pod `uid`: as its pod, or as a live migration's target.
pub fn names_pod(record: &Allocation, uid: &str) -> bool {
    record.pod.uid == uid || record.migration_target.as_ref().is_some_and(|t| t.pod.uid == uid)
}

/// Attaches a live migration's target sandbox to the record of `ip`, whose own sandbox (the
/// migration's source) keeps it too. `None` when `ip` has no record.
pub fn attach_migration_target(spec: &mut IPBlockSpec, ip: &str, target: MigrationTarget) -> Option<()> {
    spec.allocations.get_mut(ip)?.migration_target = Some(target);
    Some(())
}

/// What [`release_attachment`] did to one IP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The record was removed and the IP is free (after the cooldown).
    Released,
    /// The record stays as a sticky reservation with no sandbox (with its live migration
    /// target still attached when the source left without a confirmed handover).
    Reserved,
    /// The record no longer names this sandbox (or pod UID): left alone.
    NotOurs,
    /// The sandbox was the record's own and a live migration's target was attached: the
    /// target now holds the record (the migration's source left).
    HandedOver,
    /// The sandbox was a live migration's target: it is detached and the record's own
    /// sandbox (the source, after an aborted migration) keeps the IP.
    Detached,
}

/// What a sandbox leaving its record does with it ([`release_attachment`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Leaving {
    /// Keep the record as a sticky reservation rather than free it.
    pub keep_reservation: bool,
    /// Hand the record to the live migration target attached to it: its VM instance says
    /// that migration completed ([`crate::ipam::workload::handover_check`]). Otherwise the
    /// source only detaches: the record stays its reservation with the target still attached
    /// (only the target's DEL, its node, or the controller once no pod backs it removes it), so
    /// the IP is never freed under it.
    pub hand_over: bool,
}

/// How a stateless pod's sandbox leaves its record: freed (it has no VM to migrate).
pub const STATELESS: Leaving = Leaving { keep_reservation: false, hand_over: false };

/// Releases `ip` if its record still names the sandbox (and, when given, the pod UID) the
/// caller decided on, or was repaired for that pod UID ([`adopted_by`]): removed, or kept as
/// a reservation when `leaving` says so. During a live migration the IP is never freed: the
/// target leaving detaches; the source leaving hands the record to the target when `leaving`
/// confirms the migration completed, and otherwise detaches only, leaving the target attached
/// to the source's reservation (a target the VM instance does not name, such as one another
/// node attached on its own, never gets the record).
pub fn release_attachment(
    spec: &mut IPBlockSpec,
    ip: &str,
    container_id: &str,
    ifname: &str,
    pod_uid: Option<&str>,
    leaving: Leaving,
    now: Timestamp,
) -> ReleaseOutcome {
    let Some(record) = spec.allocations.get_mut(ip) else { return ReleaseOutcome::NotOurs };
    let target_leaves = record.migration_target.as_ref().is_some_and(|t| {
        t.container_id == container_id && t.interface == ifname && pod_uid.is_none_or(|uid| t.pod.uid == uid)
    });
    if target_leaves && !container_id.is_empty() {
        record.migration_target = None;
        return ReleaseOutcome::Detached;
    }
    if !left_by(record, container_id, ifname, pod_uid) {
        return ReleaseOutcome::NotOurs;
    }
    if record.migration_target.is_some() && !leaving.hand_over {
        record.container_id.clear();
        record.repaired_at = None;
        return ReleaseOutcome::Reserved;
    }
    if let Some(target) = record.migration_target.take() {
        record.pod = target.pod;
        record.node = target.node;
        record.container_id = target.container_id;
        record.interface = target.interface;
        record.allocated_at = Time(now);
        record.release_handshake = None;
        return ReleaseOutcome::HandedOver;
    }
    if leaving.keep_reservation {
        record.container_id.clear();
        record.repaired_at = None;
        return ReleaseOutcome::Reserved;
    }
    let ended = record.release_handshake.as_ref().and_then(|h| h.pod_ended_at.as_ref()).map(|t| t.0);
    free(spec, ip, ended, now);
    ReleaseOutcome::Released
}

/// When the last use of an IP ended, which its release stamps into `spec.released` and the
/// reuse cooldown counts from: the cooldown keeps peers' conntrack and ARP caches from
/// sending the old pod's traffic to a new one, and that traffic stops when the pod stops.
/// So: when its pod ended (its deletion, or its end), where known; never before its record
/// was written (the IP was in use from then) nor after the release (`now`); the release
/// otherwise.
pub fn last_use(pod_ended: Option<Timestamp>, allocated_at: Timestamp, now: Timestamp) -> Timestamp {
    pod_ended.map_or(now, |ended| ended.max(allocated_at).min(now))
}

/// Frees `ip`: removes its record and stamps its release with the end of its last use
/// ([`last_use`]; `pod_ended` is when the record's pod ended, if known). Returns the record.
pub fn free(spec: &mut IPBlockSpec, ip: &str, pod_ended: Option<Timestamp>, now: Timestamp) -> Option<Allocation> {
    let record = spec.allocations.remove(ip)?;
    spec.released.insert(ip.to_string(), Time(last_use(pod_ended, record.allocated_at.0, now)));
    Some(record)
}

/// A fingerprint of a pool's blocks as they are now: their names and resourceVersions.
/// The controller stores the fingerprint its status counts were taken from, so a reader
/// compares those counts only with the very blocks they counted (a status is always written
/// after the records it counts, never at the same instant).
pub fn fingerprint<'a>(blocks: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    use std::hash::Hasher;
    let mut sorted: Vec<(&str, &str)> = blocks.into_iter().collect();
    sorted.sort_unstable();
    let mut hasher = fnv::FnvHasher::default();
    for (name, version) in sorted {
        hasher.write(name.as_bytes());
        hasher.write_u8(0);
        hasher.write(version.as_bytes());
        hasher.write_u8(0);
    }
    format!("{:016x}", hasher.finish())
}

/// [`fingerprint`] of the blocks of `pool` among `blocks`.
pub fn pool_fingerprint(blocks: &[std::sync::Arc<IPBlock>], pool: &str) -> String {
    fingerprint(blocks.iter().filter(|b| b.spec.pool == pool).map(|b| {
        (b.metadata.name.as_deref().unwrap_or_default(), b.metadata.resource_version.as_deref().unwrap_or_default())
    }))
}

#[cfg(test)]
pub(crate) mod test {
    use super::*;
    use crate::crd::{HandshakeState, PodRef, ReleaseHandshake};
    use proptest::prelude::*;

    /// Keep a reservation; no migration confirmed.
    const KEEP: Leaving = Leaving { keep_reservation: true, hand_over: false };
    /// Free the record, or hand it to a target whose migration completed.
    const HAND_OVER: Leaving = Leaving { keep_reservation: false, hand_over: true };

    /// A plain record of pod default/web-0 on node-0, for tests.
    pub(crate) fn record(uid: &str, container: &str) -> Allocation {
        Allocation {
            pod: PodRef { namespace: "default".into(), name: "web-0".into(), uid: uid.into() },
            node: "node-0".into(),
            network: "ipwarden".into(),
            container_id: container.into(),
            interface: "eth0".into(),
            owner: None,
            sticky: false,
            held_for: None,
            allocated_at: Time(Timestamp::UNIX_EPOCH),
            release_handshake: None,
            migration_target: None,
            repaired_at: None,
        }
    }

    fn migrating(uid: &str, container: &str) -> IPBlockSpec {
        let mut spec = block_with("10.0.0.5", record("u1", "c1"));
        let target = MigrationTarget {
            migration_uid: "m1".into(),
            pod: PodRef { namespace: "default".into(), name: "virt-launcher-b".into(), uid: uid.into() },
            node: "node-1".into(),
            container_id: container.into(),
            interface: "eth0".into(),
        };
        attach_migration_target(&mut spec, "10.0.0.5", target).expect("record exists");
        spec
    }

    fn block_with(ip: &str, allocation: Allocation) -> IPBlockSpec {
        let mut spec = IPBlockSpec { pool: "p".into(), cidr: "10.0.0.0/24".into(), ..IPBlockSpec::default() };
        spec.allocations.insert(ip.into(), allocation);
        spec
    }

    #[test]
    fn the_last_use_of_an_ip_ends_when_its_pod_ended_but_within_its_record_and_never_in_the_future() {
        let at = |s| Timestamp::from_second(s).expect("ts");
        // (pod ended, allocated at, now (the release), last use)
        let table = [
            (Some(at(1_040)), at(1_000), at(1_100), at(1_040)),
            (None, at(1_000), at(1_100), at(1_100)),
            (Some(at(1_200)), at(1_000), at(1_100), at(1_100)),
            (Some(at(900)), at(1_000), at(1_100), at(1_000)),
            (Some(at(1_100)), at(1_000), at(1_100), at(1_100)),
        ];
        for (ended, allocated, now, last) in table {
            assert_eq!(last_use(ended, allocated, now), last, "ended {ended:?}, allocated {allocated}, now {now}");
        }
    }

    #[test]
    fn a_release_under_a_mark_counts_the_cooldown_from_the_pods_end() {
        let (allocated, ended, now) =
            (Timestamp::from_second(1_000), Timestamp::from_second(1_010), Timestamp::from_second(1_070));
        let (allocated, ended, now) = (allocated.expect("ts"), ended.expect("ts"), now.expect("ts"));
        let mut marked = record("u1", "c1");
        marked.allocated_at = Time(allocated);
        marked.release_handshake = Some(crate::crd::ReleaseHandshake {
            state: crate::crd::HandshakeState::MarkedForRelease,
            marked_at: Time(ended),
            reason: "pod_gone".into(),
            detail: None,
            pod_ended_at: Some(Time(ended)),
            takeover: None,
        });
        let mut unmarked = record("u1", "c1");
        unmarked.allocated_at = Time(allocated);
        for (record, stamp) in [(marked, ended), (unmarked, now)] {
            let mut spec = block_with("10.0.0.5", record);
            let outcome = release_attachment(&mut spec, "10.0.0.5", "c1", "eth0", Some("u1"), STATELESS, now);
            assert_eq!(outcome, ReleaseOutcome::Released);
            assert_eq!(spec.released["10.0.0.5"], Time(stamp));
        }
    }

    #[test]
    fn allocating_an_ip_clears_its_release_time() {
        let mut spec = IPBlockSpec::default();
        spec.released.insert("10.0.0.5".into(), Time(Timestamp::UNIX_EPOCH));
        let prior = allocate(&mut spec, "10.0.0.5".parse().expect("ip"), record("u1", "c1"));
        assert!(spec.released.is_empty());
        assert_eq!(spec.allocations["10.0.0.5"].pod.uid, "u1");
        assert_eq!(prior, Prior::Free(Some(Time(Timestamp::UNIX_EPOCH))));
    }

    #[test]
    fn rolling_back_puts_back_exactly_what_the_ip_held_before_the_add() {
        let ip = "10.0.0.5";
        let never = IPBlockSpec::default();
        let mut cooled = IPBlockSpec::default();
        cooled.released.insert(ip.into(), Time(Timestamp::from_second(1_000).expect("ts")));
        // A sticky reservation of the previous pod of the ordinal, which the ADD reclaimed.
        let reserved = block_with(ip, record("old-uid", ""));
        for (case, before) in [("never used", never), ("released", cooled), ("reserved", reserved)] {
            let mut spec = before.clone();
            let prior = allocate(&mut spec, ip.parse().expect("ip"), record("u1", "c1"));
            assert!(roll_back(&mut spec, ip, "c1", "eth0", "u1", &prior), "{case}");
            assert_eq!(spec, before, "{case}: the block is as it was before the ADD");
        }
    }

    #[test]
    fn rolling_back_a_take_of_another_nodes_record_leaves_this_nodes_reservation() {
        let ip = "10.0.0.5";
        let mut theirs = record("old-uid", "c0");
        theirs.node = "node-1".into();
        theirs.release_handshake = Some(ReleaseHandshake {
            state: HandshakeState::ReadyForRelease,
            marked_at: Time(Timestamp::UNIX_EPOCH),
            reason: "sticky takeover".into(),
            detail: None,
            pod_ended_at: None,
            takeover: None,
        });
        let mut spec = block_with(ip, theirs.clone());
        let prior = allocate(&mut spec, ip.parse().expect("ip"), record("u1", "c1"));
        assert!(roll_back(&mut spec, ip, "c1", "eth0", "u1", &prior));
        let reservation = &spec.allocations[ip];
        assert_eq!(reservation.node, "node-0", "node-0 writes no record of node-1 (decision 0022)");
        assert!(reservation.container_id.is_empty() && reservation.interface.is_empty(), "{reservation:?}");
        assert_eq!((&reservation.pod, reservation.release_handshake.as_ref()), (&theirs.pod, None));
        assert!(!may_be_attached(reservation), "the retry takes it back at once: {reservation:?}");
    }

    proptest! {
        #[test]
        fn allocating_then_rolling_back_leaves_any_block_as_it_was(
            held in prop::collection::btree_map(0u8..8, any::<bool>(), 0..8),
            released in prop::collection::btree_map(0u8..8, 0i64..10_000, 0..8),
            target in 0u8..8,
        ) {
            let mut before = IPBlockSpec::default();
            for (host, reserved) in held {
                let container = if reserved { "" } else { "c0" };
                before.allocations.insert(format!("10.0.0.{host}"), record("u0", container));
            }
            for (host, at) in released {
                let ip = format!("10.0.0.{host}");
                if !before.allocations.contains_key(&ip) {
                    before.released.insert(ip, Time(Timestamp::from_second(at).expect("ts")));
                }
            }
            let ip = format!("10.0.0.{target}");
            let mut spec = before.clone();
            let prior = allocate(&mut spec, ip.parse().expect("ip"), record("u1", "c1"));
            prop_assert!(roll_back(&mut spec, &ip, "c1", "eth0", "u1", &prior));
            prop_assert_eq!(spec, before);
        }
    }

    #[test]
    fn rolling_back_never_touches_a_record_another_sandbox_or_pod_wrote_since() {
        let prior = Prior::Free(None);
        for (container, uid) in [("c2", "u1"), ("c1", "u2"), ("", "u1")] {
            let mut spec = block_with("10.0.0.5", record("u1", "c1"));
            assert!(!roll_back(&mut spec, "10.0.0.5", container, "eth0", uid, &prior), "{container:?} {uid:?}");
            assert_eq!(spec.allocations["10.0.0.5"], record("u1", "c1"));
        }
        let mut empty = IPBlockSpec::default();
        assert!(!roll_back(&mut empty, "10.0.0.5", "c1", "eth0", "u1", &prior), "a record already gone stays gone");
    }

    #[test]
    fn release_removes_the_record_and_remembers_when() {
        let mut spec = block_with("10.0.0.5", record("u1", "c1"));
        let now = Timestamp::from_second(1_000).expect("ts");
        let outcome = release_attachment(&mut spec, "10.0.0.5", "c1", "eth0", Some("u1"), STATELESS, now);
        assert_eq!(outcome, ReleaseOutcome::Released);
        assert!(spec.allocations.is_empty());
        assert_eq!(spec.released["10.0.0.5"].0, now);
    }

    #[test]
    fn release_never_touches_a_record_of_another_sandbox_or_pod() {
        let now = Timestamp::UNIX_EPOCH;
        for (container, uid) in [("c2", Some("u1")), ("c1", Some("u2")), ("", None)] {
            let mut spec = block_with("10.0.0.5", record("u1", "c1"));
            let outcome = release_attachment(&mut spec, "10.0.0.5", container, "eth0", uid, STATELESS, now);
            assert_eq!(outcome, ReleaseOutcome::NotOurs, "container {container:?} uid {uid:?}");
            assert_eq!(spec.allocations.len(), 1);
        }
    }

    #[test]
    fn a_kept_sticky_reservation_loses_its_sandbox_but_keeps_its_pod() {
        let mut spec = block_with("10.0.0.5", record("u1", "c1"));
        let outcome = release_attachment(&mut spec, "10.0.0.5", "c1", "eth0", None, KEEP, Timestamp::UNIX_EPOCH);
        assert_eq!(outcome, ReleaseOutcome::Reserved);
        assert_eq!(spec.allocations["10.0.0.5"].container_id, "");
        assert_eq!(spec.allocations["10.0.0.5"].pod.uid, "u1");
        assert!(spec.released.is_empty());
    }

    fn repaired() -> Allocation {
        let mut old = record("u-old", "c-old");
        old.migration_target = migrating("u2", "c2").allocations["10.0.0.5"].migration_target.clone();
        let adopter = Adopter {
            pod: PodRef { namespace: "default".into(), name: "adopter".into(), uid: "u-new".into() },
            node: "node-1".into(),
            owner: Some(OwnerRef { kind: "StatefulSet".into(), name: "db".into() }),
            sticky: true,
        };
        repair(&mut old, &adopter, Timestamp::UNIX_EPOCH);
        old
    }

    #[test]
    fn a_repair_writes_the_adopters_whole_attachment_with_its_sandbox_unknown() {
        let adopted = repaired();
        assert_eq!(
            (adopted.pod.name.as_str(), adopted.pod.uid.as_str(), adopted.node.as_str()),
            ("adopter", "u-new", "node-1")
        );
        assert_eq!(adopted.owner.as_ref().map(|o| o.name.as_str()), Some("db"));
        assert!(adopted.sticky);
        assert_eq!((adopted.container_id.as_str(), adopted.interface.as_str()), ("", ""));
        assert!(adopted.migration_target.is_none(), "no other sandbox shares it");
        assert!(may_be_attached(&adopted), "not a reservation: the adopter's sandbox holds it");
        assert!(!may_be_attached(&record("u1", "")), "a reservation holds no sandbox");
    }

    #[test]
    fn a_repaired_record_is_released_by_its_pods_sandbox_and_by_no_other_pod() {
        let now = Timestamp::UNIX_EPOCH;
        for (container, uid) in [("c-old", Some("u-old")), ("c-new", None), ("c-new", Some("u-other"))] {
            let mut spec = block_with("10.0.0.5", repaired());
            let outcome = release_attachment(&mut spec, "10.0.0.5", container, "eth0", uid, STATELESS, now);
            assert_eq!(outcome, ReleaseOutcome::NotOurs, "container {container:?} uid {uid:?}");
        }
        for container in ["c-new", ""] {
            let mut spec = block_with("10.0.0.5", repaired());
            let outcome = release_attachment(&mut spec, "10.0.0.5", container, "eth0", Some("u-new"), STATELESS, now);
            assert_eq!(outcome, ReleaseOutcome::Released, "container {container:?}");
            assert!(spec.allocations.is_empty());
        }
        let mut spec = block_with("10.0.0.5", repaired());
        let kept = release_attachment(&mut spec, "10.0.0.5", "c-new", "eth0", Some("u-new"), KEEP, now);
        assert_eq!(kept, ReleaseOutcome::Reserved);
        let reservation = &spec.allocations["10.0.0.5"];
        assert!(!may_be_attached(reservation), "the sandbox left: an ordinary reservation now");
        assert_eq!(reservation.pod.uid, "u-new");
    }

    #[test]
    fn the_source_leaving_a_live_migration_hands_the_ip_to_the_target() {
        let mut spec = migrating("u2", "c2");
        let now = Timestamp::from_second(1_000).expect("ts");
        for keep in [false, true] {
            let mut spec = spec.clone();
            let outcome = release_attachment(
                &mut spec,
                "10.0.0.5",
                "c1",
                "eth0",
                Some("u1"),
                Leaving { keep_reservation: keep, hand_over: true },
                now,
            );
            assert_eq!(outcome, ReleaseOutcome::HandedOver);
            let record = &spec.allocations["10.0.0.5"];
            assert_eq!(
                (record.pod.uid.as_str(), record.container_id.as_str(), record.node.as_str()),
                ("u2", "c2", "node-1")
            );
            assert!(record.migration_target.is_none());
            assert!(spec.released.is_empty(), "never freed");
        }
        let late = release_attachment(&mut spec, "10.0.0.5", "c1", "eth0", Some("u1"), HAND_OVER, now);
        assert_eq!(late, ReleaseOutcome::HandedOver);
        let again = release_attachment(&mut spec, "10.0.0.5", "c1", "eth0", Some("u1"), HAND_OVER, now);
        assert_eq!(again, ReleaseOutcome::NotOurs, "a repeated source DEL touches the target's record not");
    }

    #[test]
    fn the_source_leaving_a_migration_its_vm_does_not_confirm_keeps_the_ip_as_its_reservation() {
        for leaving in [STATELESS, KEEP] {
            let mut spec = migrating("u2", "c2");
            let outcome =
                release_attachment(&mut spec, "10.0.0.5", "c1", "eth0", Some("u1"), leaving, Timestamp::UNIX_EPOCH);
            assert_eq!(outcome, ReleaseOutcome::Reserved, "{leaving:?}");
            let record = &spec.allocations["10.0.0.5"];
            assert_eq!((record.pod.uid.as_str(), record.node.as_str()), ("u1", "node-0"), "still the source's");
            assert!(!may_be_attached(record), "a reservation");
            assert_eq!(
                record.migration_target.as_ref().map(|t| t.pod.uid.as_str()),
                Some("u2"),
                "the unconfirmed target gets nothing, and stays attached: its own DEL detaches it"
            );
            assert!(spec.released.is_empty(), "never freed while a target may hold it");
        }
    }

    #[test]
    fn the_target_leaving_an_aborted_migration_leaves_the_ip_with_the_source() {
        let mut spec = migrating("u2", "c2");
        let outcome =
            release_attachment(&mut spec, "10.0.0.5", "c2", "eth0", Some("u2"), STATELESS, Timestamp::UNIX_EPOCH);
        assert_eq!(outcome, ReleaseOutcome::Detached);
        let record = &spec.allocations["10.0.0.5"];
        assert_eq!((record.pod.uid.as_str(), record.container_id.as_str()), ("u1", "c1"));
        assert!(record.migration_target.is_none());
        assert!(spec.released.is_empty());
    }

    #[test]
    fn a_migration_target_is_found_as_an_attachment_and_names_its_pod() {
        let spec = migrating("u2", "c2");
        assert_eq!(find_attachment(&spec, "c2", "eth0"), ["10.0.0.5"]);
        assert_eq!(find_attachment(&spec, "c1", "eth0"), ["10.0.0.5"]);
        let record = &spec.allocations["10.0.0.5"];
        assert!(names_pod(record, "u1") && names_pod(record, "u2") && !names_pod(record, "u3"));
        let other = release_attachment(
            &mut spec.clone(),
            "10.0.0.5",
            "c2",
            "eth0",
            Some("u3"),
            STATELESS,
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(other, ReleaseOutcome::NotOurs, "the target's sandbox under another pod UID is not ours");
    }

    #[test]
    fn a_block_holds_its_records_and_the_spares_no_record_holds_each_once() {
        let mut spec = IPBlockSpec::default();
        assert_eq!((held(&spec), holds_nothing(&spec)), (0, true));
        spec.spares.insert("10.0.0.4".into());
        assert_eq!((held(&spec), holds_nothing(&spec)), (1, false), "a spare alone");
        spec.allocations.insert("10.0.0.4".into(), record("u1", "c1"));
        spec.allocations.insert("10.0.0.5".into(), record("u2", "c2"));
        spec.spares.insert("10.0.0.6".into());
        assert_eq!(held(&spec), 3, "a recorded spare counts once");
    }

    #[test]
    fn usage_skips_keys_that_are_not_ips() {
        let mut spec = block_with("10.0.0.5", record("u1", "c1"));
        spec.allocations.insert("garbage".into(), record("u2", "c2"));
        let (allocated, _) = usage(&spec);
        assert_eq!(allocated.len(), 1);
    }

    #[test]
    fn find_attachment_matches_container_and_interface_only() {
        let spec = block_with("10.0.0.5", record("u1", "c1"));
        assert_eq!(find_attachment(&spec, "c1", "eth0"), ["10.0.0.5"]);
        assert!(find_attachment(&spec, "c1", "net1").is_empty());
        assert!(find_attachment(&spec, "", "eth0").is_empty());
    }

    #[test]
    fn a_fingerprint_names_the_block_versions_in_any_order() {
        let a = fingerprint([("p-0", "10"), ("p-1", "11")]);
        assert_eq!(a, fingerprint([("p-1", "11"), ("p-0", "10")]), "order does not matter");
        assert_ne!(a, fingerprint([("p-0", "10"), ("p-1", "12")]), "a new version is another fingerprint");
        assert_ne!(a, fingerprint([("p-0", "10")]), "a missing block too");
        assert_ne!(
            fingerprint([("p-0", "1"), ("p-1", "0")]),
            fingerprint([("p-0", "10"), ("p-1", "")]),
            "fields are delimited"
        );
        assert_eq!(a.len(), 16);
    }

    #[test]
    fn rolling_back_an_attached_migration_target_detaches_only_that_target() {
        let mut spec = migrating("u2", "c2");
        assert!(!roll_back(&mut spec, "10.0.0.5", "c9", "eth0", "u2", &Prior::Attached), "another sandbox");
        assert!(!roll_back(&mut spec, "10.0.0.5", "c2", "eth0", "u9", &Prior::Attached), "another pod");
        assert!(roll_back(&mut spec, "10.0.0.5", "c2", "eth0", "u2", &Prior::Attached));
        let record = &spec.allocations["10.0.0.5"];
        assert_eq!((record.pod.uid.as_str(), record.container_id.as_str()), ("u1", "c1"), "the source keeps it");
        assert!(record.migration_target.is_none());
        assert!(!roll_back(&mut spec, "10.0.0.5", "c1", "eth0", "u1", &Prior::Attached), "the source is no target");
    }
}
