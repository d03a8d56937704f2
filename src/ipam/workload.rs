//! Pure rules about the workload behind a pod: the UID the runtime knows it by, its
//! controller, whether its IPs are sticky,
//! the name of its IPClaim and the interfaces it lists, whether the records hold a claim's
//! binding and which of a claim's IPs a recreated pod takes back, whether a sticky owner (a
//! StatefulSet's ordinal, a KubeVirt VM) still wants its IPs, and which workload holds the
//! IPs its pods draw from an `ipwarden.io/ip-list`, for as long as it lives.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

use crate::crd::{Allocation, ClaimedInterface, ClaimedIp, IPClaimSpec, MigrationTarget, OwnerRef};
use crate::ipam::{blocks, fixed};

/// The owner kind of KubeVirt's running VM instances, whose claim is named `vm.<VM>`.
pub const KUBEVIRT_VMI_KIND: &str = "VirtualMachineInstance";

/// The prefix of a KubeVirt VM's IPClaim name. The dot keeps it apart from the claims named
/// after StatefulSet pods: the apiserver allows no dot in a StatefulSet's name (a DNS label),
/// so none in its pods' names either.
pub const VM_CLAIM_PREFIX: &str = "vm.";

/// The label virt-controller puts on a migration target's virt-launcher pod: the UID of the
/// VirtualMachineInstanceMigration it was created for.
pub const MIGRATION_JOB_LABEL: &str = "kubevirt.io/migrationJobUID";

/// The owner kinds whose pods keep their IPs across restarts unless configured otherwise.
pub const DEFAULT_STICKY_KINDS: [&str; 2] = ["StatefulSet", KUBEVIRT_VMI_KIND];

/// The annotation kubelet puts on a static pod's mirror pod (the copy of a manifest-file pod
/// it posts to the API): the static pod's config hash (`kubernetes.io/config.hash`).
pub const MIRROR_POD_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// A pod's UID as the runtime knows it (`K8S_POD_UID`), which is the UID ipwarden records,
/// claims and compares: for a static pod's mirror, the [`MIRROR_POD_ANNOTATION`] when present
/// and non-empty, else `metadata.uid`. Kubelet runs a static pod under its config hash, and the
/// mirror's own `metadata.uid` changes whenever kubelet deletes and recreates the mirror while
/// the static pod runs on; the hash is what stays. Every comparison of a pod's UID with the
/// runtime's, a record's, a checkpoint entry's or a claim's reads it through here, in the
/// agent and the controller alike, or a live static pod's record would look stale.
pub fn runtime_uid(pod: &Pod) -> Option<&str> {
    let mirrored = pod.metadata.annotations.as_ref().and_then(|a| a.get(MIRROR_POD_ANNOTATION));
    mirrored.map(String::as_str).filter(|hash| !hash.is_empty()).or(pod.metadata.uid.as_deref())
}

/// The pod's controller, from its `controller: true` ownerReference.
pub fn controller_of(pod: &Pod) -> Option<OwnerRef> {
    controller_in(pod.metadata.owner_references.as_deref())
}

/// The controller among an object's ownerReferences: the one marked `controller: true`.
pub fn controller_in(references: Option<&[OwnerReference]>) -> Option<OwnerRef> {
    references
        .into_iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .map(|o| OwnerRef { kind: o.kind.clone(), name: o.name.clone() })
}

/// Whether pods of `owner` keep their IPs between pods.
pub fn is_sticky(owner: Option<&OwnerRef>, sticky_kinds: &[String]) -> bool {
    owner.is_some_and(|o| sticky_kinds.contains(&o.kind))
}

/// Whether the pod of `record` has an IPClaim to release with it: only a sticky pod's ADD
/// writes one (docs/decisions/0015-no-claim-for-stateless-pods.md), and the record keeps
/// `sticky` as written even where the rules stop treating it as sticky (a retired block, an
/// owner kind taken off the list).
pub fn has_claim(record: &Allocation) -> bool {
    record.sticky
}

/// Whether `record` is a sticky reservation: written as one, and its owner kind still among
/// `sticky_kinds` (an owner kind removed from the list leaves ipwarden's stickiness).
pub fn record_is_sticky(record: &Allocation, sticky_kinds: &[String]) -> bool {
    record.sticky && is_sticky(record.owner.as_ref(), sticky_kinds)
}

/// The IPClaim name of a pod: `vm.<VM>` for a KubeVirt VM instance (its launcher pods change
/// names; the prefix keeps VM `web-0` apart from StatefulSet pod `web-0`), the pod's own
/// otherwise (a StatefulSet pod's name is its identity).
pub fn claim_name(pod_name: &str, owner: Option<&OwnerRef>) -> String {
    match owner {
        Some(o) if o.kind == KUBEVIRT_VMI_KIND => format!("{VM_CLAIM_PREFIX}{}", o.name),
        _ => pod_name.to_string(),
    }
}

/// The migration a virt-launcher pod was created as the target of, from its
/// [`MIGRATION_JOB_LABEL`].
pub fn migration_job_of(pod: &Pod) -> Option<&str> {
    pod.metadata.labels.as_ref()?.get(MIGRATION_JOB_LABEL).map(String::as_str)
}

/// What deciding on a live migration needs of a VirtualMachineInstanceMigration.
#[derive(Clone, Copy, Debug)]
pub struct MigrationFacts<'a> {
    /// Its UID.
    pub uid: &'a str,
    /// `spec.vmiName`: the VM instance it migrates.
    pub vmi_name: &'a str,
    /// `status.phase` (empty before virt-controller sets one).
    pub phase: &'a str,
    /// Whether it is being deleted.
    pub deleting: bool,
}

/// Whether a pod controlled by `owner` and labelled as the target of migration
/// `pod_migration_uid` is the target of `migration`, which still runs: only such a pod may
/// attach to the IP its VM instance's source pod still holds. Keyed on the migration object so
/// that no other pod of the VM, and no target of a finished migration, shares an IP.
pub fn is_active_migration_target(
    owner: Option<&OwnerRef>,
    pod_migration_uid: &str,
    migration: &MigrationFacts<'_>,
) -> bool {
    let finished = matches!(migration.phase, "Succeeded" | "Failed");
    owner.is_some_and(|o| o.kind == KUBEVIRT_VMI_KIND && o.name == migration.vmi_name)
        && !pod_migration_uid.is_empty()
        && migration.uid == pod_migration_uid
        && !migration.deleting
        && !finished
}

/// What a source's DEL needs of its VirtualMachineInstance's `status.migrationState`, as
/// KubeVirt keeps it (kubevirt.io/api v1.6.0, `VirtualMachineInstanceMigrationState`:
/// virt-controller names the migration, its target node and pod; virt-handler sets
/// `completed` once the VM runs on the target, or `failed`).
#[derive(Clone, Copy, Debug, Default)]
pub struct MigrationState<'a> {
    /// `migrationUid`: the VirtualMachineInstanceMigration.
    pub migration_uid: &'a str,
    /// `targetNode`.
    pub target_node: &'a str,
    /// `targetPod`: the target virt-launcher pod's name.
    pub target_pod: &'a str,
    /// `sourceNode`: where the migration started.
    pub source_node: &'a str,
    /// `sourcePod`: the source virt-launcher pod's name.
    pub source_pod: &'a str,
    /// `completed`.
    pub completed: bool,
    /// `failed`.
    pub failed: bool,
    /// The VM instance itself has ended (`status.phase` Succeeded or Failed) or is being
    /// deleted: no migration of it will record an end any more.
    pub instance_ended: bool,
}

/// What a VM's source sandbox, leaving, does with the migration target attached to its
/// record ([`handover_check`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Handover {
    /// The VM instance says that very migration completed to that node and pod: hand over.
    Confirmed,
    /// The VM instance names that migration, neither completed nor failed yet: the source's
    /// DEL waits (fails, and the runtime retries it) until KubeVirt records the end.
    Pending(String),
    /// The VM instance names no such migration, another one, or that one failed: no handover.
    /// The source detaches and the target stays attached, so the IP is never freed under it.
    Refused(String),
}

/// What the source's DEL does with `target` given the VM instance's migration state
/// (`None`: the VMI has none, or is gone). Any node may attach its own target to a VM's
/// record (the policy cannot read the migration), so the source is where a forged target
/// stops (decision 0022).
pub fn handover_check(target: &MigrationTarget, state: Option<&MigrationState<'_>>) -> Handover {
    let what = format!("migration {} to pod {} on node {}", target.migration_uid, target.pod.name, target.node);
    match state {
        None => Handover::Refused(format!("the VM instance records no {what}")),
        // A later migration started from the target: the VM ran there, so this one completed.
        Some(s)
            if s.migration_uid != target.migration_uid
                && (s.source_node, s.source_pod) == (target.node.as_str(), target.pod.name.as_str()) =>
        {
            Handover::Confirmed
        }
        Some(s) if s.migration_uid != target.migration_uid => {
            Handover::Refused(format!("the VM instance records migration {:?}, not {what}", s.migration_uid))
        }
        Some(s) if s.target_node != target.node || s.target_pod != target.pod.name => Handover::Refused(format!(
            "the VM instance's migration goes to pod {:?} on node {:?}, not as its {what} says",
            s.target_pod, s.target_node
        )),
        Some(s) if s.failed => Handover::Refused(format!("the VM instance's {what} failed")),
        Some(s) if !s.completed && s.instance_ended => {
            Handover::Refused(format!("the VM instance ended without recording the end of its {what}"))
        }
        Some(s) if !s.completed => Handover::Pending(format!("the VM instance's {what} has not completed yet")),
        Some(_) => Handover::Confirmed,
    }
}

/// A migration target's pod as the controller reads it ([`target_unbacked`]).
#[derive(Clone, Copy, Debug)]
pub struct TargetPod<'a> {
    /// Its UID as the runtime knows it.
    pub uid: &'a str,
    /// Its node.
    pub node: &'a str,
    /// Its controller.
    pub owner: Option<&'a OwnerRef>,
    /// Its phase is Succeeded or Failed.
    pub ended: bool,
}

/// Why the migration target attached to a VM's record `record_owner` is backed by no pod
/// (`None`: it is), given the pod of the target's name (`None`: no such pod). A real target is
/// a live virt-launcher pod of the same VM instance, with the target's UID, on the target's
/// node. Any node may attach a target of its own (the policy cannot read the migration), so a
/// target no pod backs is detached by the controller: left there, it would block the VM's
/// restart on its own node and its next migration (decision 0022).
pub fn target_unbacked(
    record_owner: Option<&OwnerRef>,
    target: &MigrationTarget,
    pod: Option<TargetPod<'_>>,
) -> Option<&'static str> {
    match pod {
        None => Some("target_pod_gone"),
        Some(p) if p.uid != target.pod.uid => Some("target_pod_gone"),
        Some(p) if p.ended => Some("target_pod_ended"),
        Some(p) if p.node != target.node => Some("target_pod_elsewhere"),
        Some(p) if record_owner.is_none_or(|o| o.kind != KUBEVIRT_VMI_KIND) || p.owner != record_owner => {
            Some("target_pod_not_the_vms")
        }
        Some(_) => None,
    }
}

/// The interfaces a sticky pod's IPClaim lists once interface `interface` of pod `uid` holds
/// its IPs. The other interfaces stay when the claim is that pod's, and also when the pod takes
/// over a sticky claim of its predecessor: they are the workload's reservations, which the
/// new pod's ADDs of those interfaces (one per interface, as Multus calls) take back. A
/// stateless claim an older version left keeps nothing.
pub fn claim_interfaces(
    existing: Option<&IPClaimSpec>,
    uid: &str,
    interface: ClaimedInterface,
) -> Vec<ClaimedInterface> {
    let keeps_others = |claim: &&IPClaimSpec| claim.pod_uid == uid || claim.sticky;
    let mut interfaces: Vec<ClaimedInterface> =
        existing.filter(keeps_others).map(|c| c.interfaces.clone()).unwrap_or_default();
    match interfaces.iter_mut().find(|i| i.interface == interface.interface) {
        Some(slot) => *slot = interface,
        None => interfaces.push(interface),
    }
    interfaces
}

/// A live pod of a claim, whose records the controller writes down as the claim's witness.
#[derive(Clone, Copy, Debug)]
pub struct Claimant<'a> {
    /// The claim's and the pod's namespace.
    pub namespace: &'a str,
    /// The claim's name, which is the pod's claim name ([`claim_name`]).
    pub claim: &'a str,
    /// The pod's UID.
    pub uid: &'a str,
    /// The node the scheduler put it on.
    pub node: &'a str,
    /// Its controller.
    pub owner: &'a OwnerRef,
}

/// The interfaces and IPs the block records give `pod` of its claim, as the controller writes
/// them down as witnessed: its sticky records of that claim on its node under its owner, by
/// interface, plus what the binding witnessed before (`before`) has that the pod has no record
/// for yet: whole interfaces, and IP families of an interface (a recreated pod takes its
/// predecessor's IPs back one ADD an interface, one block write a family), each IP only while
/// the records still reserve it for the claim (`reserved`: an IP whose pool is gone, or that
/// another pod took, is not offered again on every restart). `None` when it
/// holds no such record. A record naming no interface (repaired or adopted: the pod's own
/// network) goes under the interface `before` lists it in, else [`fixed::POD_INTERFACE`]. Only
/// the pod's node's agent and the controller write records naming that node, and the
/// scheduler put the pod there (decision 0022): no other node can make IPs look recorded for
/// it, whatever it wrote into the claim's spec (`spec`), which only orders each interface's
/// IPs where it lists the same ones (else `before` does, else IPv4 first). `records`: the
/// records naming the pod's UID, each with its IP, pool and block.
pub fn recorded_interfaces<'a>(
    pod: Claimant<'_>,
    records: impl IntoIterator<Item = (ClaimedIp, &'a Allocation)>,
    spec: &[ClaimedInterface],
    before: &[ClaimedInterface],
    reserved: impl Fn(&ClaimedIp) -> bool,
) -> Option<Vec<ClaimedInterface>> {
    let placed = |c: &ClaimedIp| {
        let lists = |i: &&ClaimedInterface| i.ips.iter().any(|x| x.ip == c.ip && x.block == c.block);
        before.iter().find(lists).map_or_else(|| fixed::POD_INTERFACE.to_string(), |i| i.interface.clone())
    };
    let mut by_interface: BTreeMap<String, Vec<ClaimedIp>> = BTreeMap::new();
    for (ip, record) in records {
        let of_claim = record.sticky
            && record.pod.uid == pod.uid
            && record.pod.namespace == pod.namespace
            && record.node == pod.node
            && record.owner.as_ref() == Some(pod.owner)
            && claim_name(&record.pod.name, record.owner.as_ref()) == pod.claim;
        if of_claim {
            let interface = if record.interface.is_empty() { placed(&ip) } else { record.interface.clone() };
            by_interface.entry(interface).or_default().push(ip);
        }
    }
    if by_interface.is_empty() {
        return None;
    }
    let is_v6 = |c: &ClaimedIp| c.ip.contains(':');
    for earlier in before {
        if let Some(ips) = by_interface.get_mut(&earlier.interface) {
            let missing: Vec<ClaimedIp> = earlier
                .ips
                .iter()
                .filter(|e| !ips.iter().any(|c| is_v6(c) == is_v6(e)) && reserved(e))
                .cloned()
                .collect();
            ips.extend(missing);
        }
    }
    let key = |c: &ClaimedIp| (c.ip.clone(), c.pool.clone(), c.block.clone());
    let same_ips = |a: &[ClaimedIp], b: &[ClaimedIp]| {
        let (mut a, mut b): (Vec<_>, Vec<_>) = (a.iter().map(key).collect(), b.iter().map(key).collect());
        a.sort_unstable();
        b.sort_unstable();
        a == b
    };
    let ordered = |interface: String, mut ips: Vec<ClaimedIp>| {
        let listed = spec.iter().chain(before).find(|i| i.interface == interface && same_ips(&i.ips, &ips));
        match listed {
            Some(listed) => listed.clone(),
            None => {
                ips.sort_by_key(|c| (is_v6(c), c.ip.clone()));
                ClaimedInterface { interface, ips }
            }
        }
    };
    let rank = |name: &str| spec.iter().chain(before).position(|i| i.interface == name).unwrap_or(usize::MAX);
    let carried: Vec<ClaimedInterface> = before
        .iter()
        .filter(|b| !by_interface.contains_key(&b.interface))
        .map(|b| ClaimedInterface {
            interface: b.interface.clone(),
            ips: b.ips.iter().filter(|c| reserved(c)).cloned().collect(),
        })
        .filter(|b| !b.ips.is_empty())
        .collect();
    let mut interfaces: Vec<ClaimedInterface> =
        by_interface.into_iter().map(|(interface, ips)| ordered(interface, ips)).chain(carried).collect();
    interfaces.sort_by_key(|i| rank(&i.interface));
    Some(interfaces)
}

/// The ordinal of StatefulSet pod `pod_name` of StatefulSet `statefulset`, if it is one.
pub fn ordinal(statefulset: &str, pod_name: &str) -> Option<i32> {
    pod_name.strip_prefix(statefulset)?.strip_prefix('-')?.parse().ok().filter(|n: &i32| *n >= 0)
}

/// Whether a StatefulSet (`replicas`, `ordinals.start`, deleting or not) still wants the
/// ordinal of `pod_name`: scale-down below it or deletion ends the reservation.
pub fn statefulset_wants(statefulset: &str, replicas: i32, start: i32, deleting: bool, pod_name: &str) -> bool {
    match ordinal(statefulset, pod_name) {
        Some(n) => !deleting && n >= start && n < start.saturating_add(replicas),
        None => false,
    }
}

/// What "owner still wants" needs of a StatefulSet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatefulSetFacts {
    /// `spec.replicas`.
    pub replicas: i32,
    /// `spec.ordinals.start`.
    pub start: i32,
    /// Whether it is being deleted.
    pub deleting: bool,
}

/// Whether a KubeVirt object (a VirtualMachine or its instance) is there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Presence {
    /// It does not exist.
    Absent,
    /// It exists with a deletionTimestamp.
    Deleting,
    /// It exists and is not being deleted.
    Live,
}

/// The owner kinds an IP drawn from a pod's `ipwarden.io/ip-list` is held for between pods:
/// each has a rule for whether it still exists ([`workload_lives`]), and the controller
/// watches each. A pod of another controller (a DaemonSet, a VM, none) holds its list IP only
/// while it runs; a StatefulSet's pods keep theirs by their ordinal's stickiness (the list
/// only chose it), which a scale-down below the ordinal ends as for any StatefulSet IP.
/// The one place these kinds are named.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkloadKind {
    /// apps/v1 Deployment.
    Deployment,
    /// apps/v1 ReplicaSet.
    ReplicaSet,
    /// batch/v1 CronJob.
    CronJob,
    /// batch/v1 Job.
    Job,
}

impl WorkloadKind {
    /// Every one.
    pub const ALL: [Self; 4] = [Self::Deployment, Self::ReplicaSet, Self::CronJob, Self::Job];

    /// The one of owner kind `kind`.
    pub fn of(kind: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == kind)
    }

    /// Its Kubernetes kind.
    pub fn name(self) -> &'static str {
        match self {
            Self::Deployment => "Deployment",
            Self::ReplicaSet => "ReplicaSet",
            Self::CronJob => "CronJob",
            Self::Job => "Job",
        }
    }

    /// The kind of the controller that stands for a pod's controller of this kind as the
    /// workload of its list: a ReplicaSet's Deployment (the ReplicaSet changes every
    /// rollout), a Job's CronJob (a new Job every run).
    pub fn parent(self) -> Option<Self> {
        match self {
            Self::ReplicaSet => Some(Self::Deployment),
            Self::Job => Some(Self::CronJob),
            Self::Deployment | Self::CronJob => None,
        }
    }
}

/// The workload a pod's list-drawn IPs are held for, from its `controller` and that
/// controller's own controller `parent` (read only when [`WorkloadKind::parent`] names a
/// kind): the parent when it is of that kind, else the controller when it is a
/// [`WorkloadKind`], else none.
pub fn list_workload(controller: Option<&OwnerRef>, parent: Option<&OwnerRef>) -> Option<OwnerRef> {
    let controller = controller?;
    let kind = WorkloadKind::of(&controller.kind)?;
    let parent = parent.filter(|p| kind.parent().is_some_and(|k| k.name() == p.kind));
    Some(parent.unwrap_or(controller).clone())
}

/// The workload whose life keeps list-drawn `record` reserved between its pods: its
/// `heldFor`, only while no sandbox may hold the record ([`blocks::may_be_attached`]), or
/// when the caller's write detaches it (`detaching`: its pod's DEL). An attached record
/// whose pod is done lost its DEL: no pod of the workload could take it
/// ([`crate::ipam::fixed::check_free`]), so it goes by the usual rules (release handshake,
/// then release) and the workload's next pod draws it from the list after the cooldown.
pub fn list_reservation_for(record: &Allocation, detaching: bool) -> Option<&OwnerRef> {
    record.held_for.as_ref().filter(|_| detaching || !blocks::may_be_attached(record))
}

/// What is known of a record's owner or list workload, however it was learnt (the agent's
/// and the pool actor's live reads, the controller's watched caches): the input of
/// [`owner_wants`] and [`workload_lives`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnerFacts {
    /// A StatefulSet; `None` when it does not exist.
    StatefulSet(Option<StatefulSetFacts>),
    /// A Deployment, ReplicaSet, CronJob or Job: only whether it is there counts.
    Workload(Presence),
    /// A KubeVirt VM: its VirtualMachineInstance and its VirtualMachine (same name).
    VirtualMachine {
        /// The VM instance.
        instance: Presence,
        /// The VirtualMachine.
        vm: Presence,
    },
    /// Nothing could be learnt (an API error, an owner kind without a rule, KubeVirt's API
    /// not watched yet).
    Unknown,
}

/// Whether the owner `owner_name` of sticky pod `pod_name` still wants the pod's IPs: a
/// StatefulSet while the ordinal is within its replicas and it is not being deleted; a VM
/// while its instance or the VirtualMachine exists and is not being deleted (a stopped VM
/// keeps its IP for its next start). What is unknown is wanted: keeping a reservation is
/// safe, freeing a wanted one is not.
pub fn owner_wants(owner_name: &str, pod_name: &str, facts: OwnerFacts) -> bool {
    match facts {
        OwnerFacts::StatefulSet(Some(s)) => statefulset_wants(owner_name, s.replicas, s.start, s.deleting, pod_name),
        _ => workload_lives(facts),
    }
}

/// Whether a workload exists and is not being deleted: what keeps a list-bound record
/// (`heldFor`) reserved between its pods, whatever its replicas (scaled to zero, a
/// Deployment still holds its list's IPs). A VM lives while its instance or the
/// VirtualMachine does. What is unknown lives.
pub fn workload_lives(facts: OwnerFacts) -> bool {
    match facts {
        OwnerFacts::StatefulSet(s) => s.is_some_and(|s| !s.deleting),
        OwnerFacts::Workload(presence) => presence == Presence::Live,
        OwnerFacts::VirtualMachine { instance, vm } => instance == Presence::Live || vm == Presence::Live,
        OwnerFacts::Unknown => true,
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_static_pod_is_known_by_its_config_hash_and_any_other_pod_by_its_uid() {
        let cases = [
            // (metadata.uid, the mirror annotation, the runtime's UID)
            (Some("u1"), None, Some("u1")),
            (Some("mirror-uid"), Some("6f1c0a8e3b"), Some("6f1c0a8e3b")),
            (Some("mirror-uid"), Some(""), Some("mirror-uid")),
            (None, Some("6f1c0a8e3b"), Some("6f1c0a8e3b")),
            (None, None, None),
        ];
        for (uid, mirror, expected) in cases {
            let annotations = mirror.map(|hash| json!({MIRROR_POD_ANNOTATION: hash, "other": "x"}));
            let pod: Pod = serde_json::from_value(json!({"metadata": {"namespace": "kube-system",
                "name": "etcd-node-1", "uid": uid, "annotations": annotations}}))
            .expect("pod");
            assert_eq!(runtime_uid(&pod), expected, "uid {uid:?}, mirror annotation {mirror:?}");
        }
    }

    fn interface(name: &str, ip: &str) -> ClaimedInterface {
        ClaimedInterface {
            interface: name.into(),
            ips: vec![crate::crd::ClaimedIp { ip: ip.into(), pool: "p".into(), block: "b".into() }],
        }
    }

    fn claim(uid: &str, sticky: bool) -> IPClaimSpec {
        IPClaimSpec {
            pod_uid: uid.into(),
            node: "n".into(),
            owner: None,
            sticky,
            interfaces: vec![interface("eth0", "10.0.0.1"), interface("net1", "10.1.0.1")],
            bound_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
        }
    }

    #[test]
    fn a_claim_keeps_every_interface_of_its_pod_and_of_a_sticky_predecessor() {
        let names = |interfaces: Vec<ClaimedInterface>| -> Vec<(String, String)> {
            interfaces.into_iter().map(|i| (i.interface, i.ips[0].ip.clone())).collect()
        };
        let pair = |i: &str, ip: &str| (i.to_string(), ip.to_string());
        let table = [
            // (existing claim, the sticky pod's uid, expected interfaces)
            (Some(claim("u1", true)), "u2", vec![pair("eth0", "10.0.0.9"), pair("net1", "10.1.0.1")]),
            (Some(claim("u1", true)), "u1", vec![pair("eth0", "10.0.0.9"), pair("net1", "10.1.0.1")]),
            // A stateless claim an older version wrote for a pod of the same name.
            (Some(claim("u1", false)), "u2", vec![pair("eth0", "10.0.0.9")]),
            (None, "u2", vec![pair("eth0", "10.0.0.9")]),
        ];
        for (existing, uid, expected) in table {
            let got = names(claim_interfaces(existing.as_ref(), uid, interface("eth0", "10.0.0.9")));
            assert_eq!(got, expected, "claim of {:?}, pod {uid}", existing.map(|c| c.pod_uid));
        }
    }

    #[test]
    fn the_controller_owner_reference_is_the_owner() {
        let pod: Pod = serde_json::from_value(json!({"metadata": {"name": "web-0", "ownerReferences": [
            {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "1"},
            {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "web", "uid": "2", "controller": true}
        ]}}))
        .expect("pod");
        assert_eq!(controller_of(&pod), Some(OwnerRef { kind: "StatefulSet".into(), name: "web".into() }));
    }

    #[test]
    fn stickiness_follows_the_configured_owner_kinds() {
        let kinds: Vec<String> = DEFAULT_STICKY_KINDS.iter().map(|k| k.to_string()).collect();
        let sts = OwnerRef { kind: "StatefulSet".into(), name: "web".into() };
        let rs = OwnerRef { kind: "ReplicaSet".into(), name: "api-1".into() };
        assert!(is_sticky(Some(&sts), &kinds));
        assert!(!is_sticky(Some(&rs), &kinds));
        assert!(!is_sticky(None, &kinds));
        assert!(!is_sticky(Some(&sts), &[]), "an empty list turns stickiness off");
    }

    #[test]
    fn a_kubevirt_claim_is_named_after_the_vm_and_others_after_the_pod() {
        let vmi = OwnerRef { kind: KUBEVIRT_VMI_KIND.into(), name: "vm1".into() };
        assert_eq!(claim_name("virt-launcher-vm1-abcde", Some(&vmi)), "vm.vm1");
        assert_eq!(claim_name("web-0", None), "web-0");
    }

    #[test]
    fn a_vm_and_a_statefulset_pod_of_the_same_name_have_different_claims() {
        let vmi = OwnerRef { kind: KUBEVIRT_VMI_KIND.into(), name: "web-0".into() };
        let sts = OwnerRef { kind: "StatefulSet".into(), name: "web".into() };
        assert_ne!(claim_name("virt-launcher-web-0-x", Some(&vmi)), claim_name("web-0", Some(&sts)));
    }

    #[test]
    fn only_the_target_of_a_running_migration_of_its_own_vm_instance_may_share() {
        let vmi = OwnerRef { kind: KUBEVIRT_VMI_KIND.into(), name: "vm1".into() };
        let sts = OwnerRef { kind: "StatefulSet".into(), name: "vm1".into() };
        let running = MigrationFacts { uid: "m1", vmi_name: "vm1", phase: "Running", deleting: false };
        let cases = [
            (Some(&vmi), "m1", running, true),
            (Some(&vmi), "m1", MigrationFacts { phase: "", ..running }, true),
            (Some(&vmi), "m1", MigrationFacts { phase: "Scheduling", ..running }, true),
            (Some(&vmi), "m2", running, false),
            (Some(&vmi), "", MigrationFacts { uid: "", ..running }, false),
            (Some(&vmi), "m1", MigrationFacts { vmi_name: "vm2", ..running }, false),
            (Some(&vmi), "m1", MigrationFacts { phase: "Succeeded", ..running }, false),
            (Some(&vmi), "m1", MigrationFacts { phase: "Failed", ..running }, false),
            (Some(&vmi), "m1", MigrationFacts { deleting: true, ..running }, false),
            (Some(&sts), "m1", running, false),
            (None, "m1", running, false),
        ];
        for (owner, label, migration, may) in cases {
            assert_eq!(is_active_migration_target(owner, label, &migration), may, "{owner:?} {label} {migration:?}");
        }
    }

    /// VM vm1's target pod `virt-launcher-vm1-dst` (UID `dst`) on node-1, for migration m1.
    fn migration_target() -> MigrationTarget {
        MigrationTarget {
            migration_uid: "m1".into(),
            pod: crate::crd::PodRef { namespace: "ns".into(), name: "virt-launcher-vm1-dst".into(), uid: "dst".into() },
            node: "node-1".into(),
            container_id: "c".into(),
            interface: "eth0".into(),
        }
    }

    #[test]
    fn a_migration_target_is_backed_only_by_a_live_launcher_of_the_same_vm_on_its_node() {
        let target = migration_target();
        let vmi = OwnerRef { kind: KUBEVIRT_VMI_KIND.into(), name: "vm1".into() };
        let other_vmi = OwnerRef { name: "vm2".into(), ..vmi.clone() };
        let sts = OwnerRef { kind: "StatefulSet".into(), name: "vm1".into() };
        let live = TargetPod { uid: "dst", node: "node-1", owner: Some(&vmi), ended: false };
        let cases = [
            (Some(&vmi), Some(live), None),
            (Some(&vmi), None, Some("target_pod_gone")),
            (Some(&vmi), Some(TargetPod { uid: "other", ..live }), Some("target_pod_gone")),
            (Some(&vmi), Some(TargetPod { ended: true, ..live }), Some("target_pod_ended")),
            (Some(&vmi), Some(TargetPod { node: "node-2", ..live }), Some("target_pod_elsewhere")),
            (Some(&vmi), Some(TargetPod { owner: Some(&other_vmi), ..live }), Some("target_pod_not_the_vms")),
            (Some(&vmi), Some(TargetPod { owner: None, ..live }), Some("target_pod_not_the_vms")),
            // Only a VM's record has a migration target; a target on any other record is forged.
            (Some(&sts), Some(TargetPod { owner: Some(&sts), ..live }), Some("target_pod_not_the_vms")),
            (None, Some(TargetPod { owner: None, ..live }), Some("target_pod_not_the_vms")),
        ];
        for (owner, pod, expected) in cases {
            assert_eq!(target_unbacked(owner, &target, pod), expected, "{owner:?} {pod:?}");
        }
    }

    #[test]
    fn a_source_hands_its_record_over_only_to_the_target_of_the_migration_its_vm_completed() {
        let target = migration_target();
        let done = MigrationState {
            migration_uid: "m1",
            target_node: "node-1",
            target_pod: "virt-launcher-vm1-dst",
            source_node: "node-0",
            source_pod: "virt-launcher-vm1-src",
            completed: true,
            failed: false,
            instance_ended: false,
        };
        let later = MigrationState {
            migration_uid: "m2",
            target_node: "node-2",
            target_pod: "virt-launcher-vm1-next",
            source_node: "node-1",
            source_pod: "virt-launcher-vm1-dst",
            completed: false,
            ..done
        };
        let refused = |why: &str| Handover::Refused(why.to_string());
        let cases = [
            (Some(done), Handover::Confirmed),
            (None, refused("records no migration m1")),
            (Some(MigrationState { migration_uid: "m0", ..done }), refused("records migration \"m0\"")),
            (Some(MigrationState { target_node: "node-2", ..done }), refused("on node \"node-2\"")),
            (
                Some(MigrationState { target_pod: "virt-launcher-vm1-x", ..done }),
                refused("to pod \"virt-launcher-vm1-x\""),
            ),
            (Some(MigrationState { failed: true, ..done }), refused("failed")),
            (Some(MigrationState { completed: false, ..done }), Handover::Pending("has not completed".into())),
            (
                Some(MigrationState { completed: false, instance_ended: true, ..done }),
                refused("ended without recording"),
            ),
            // A later migration from the target shows this one completed to it.
            (Some(later), Handover::Confirmed),
            (
                Some(MigrationState { source_pod: "virt-launcher-vm1-src", ..later }),
                refused("records migration \"m2\""),
            ),
        ];
        for (state, expected) in cases {
            let got = handover_check(&target, state.as_ref());
            match (&expected, &got) {
                (Handover::Confirmed, Handover::Confirmed) => {}
                (Handover::Refused(want), Handover::Refused(why))
                | (Handover::Pending(want), Handover::Pending(why))
                    if why.contains(want.as_str()) => {}
                _ => panic!("{state:?}: expected {expected:?}, got {got:?}"),
            }
        }
    }

    #[test]
    fn ordinals_parse_only_from_the_statefulsets_own_pods() {
        assert_eq!(ordinal("web", "web-3"), Some(3));
        assert_eq!(ordinal("web", "web-x"), None);
        assert_eq!(ordinal("web", "webby-3"), None);
        assert_eq!(ordinal("web", "web--1"), None);
    }

    #[test]
    fn an_owner_wants_its_ip_while_it_exists_and_keeps_what_is_unknown() {
        use Presence::{Absent, Deleting, Live};
        let sts = |replicas| OwnerFacts::StatefulSet(Some(StatefulSetFacts { replicas, start: 0, deleting: false }));
        let vm = |instance, vm| OwnerFacts::VirtualMachine { instance, vm };
        let cases = [
            ("web", "web-1", sts(2), true),
            ("web", "web-1", sts(1), false),
            ("web", "web-1", OwnerFacts::StatefulSet(None), false),
            ("vm1", "virt-launcher-vm1-x", vm(Live, Live), true),
            ("vm1", "virt-launcher-vm1-x", vm(Absent, Live), true),
            ("vm1", "virt-launcher-vm1-x", vm(Live, Absent), true),
            ("vm1", "virt-launcher-vm1-x", vm(Deleting, Deleting), false),
            ("vm1", "virt-launcher-vm1-x", vm(Absent, Deleting), false),
            ("vm1", "virt-launcher-vm1-x", vm(Absent, Absent), false),
            ("x", "x-0", OwnerFacts::Unknown, true),
        ];
        for (owner, pod, facts, wanted) in cases {
            assert_eq!(owner_wants(owner, pod, facts), wanted, "{owner} {pod} {facts:?}");
        }
    }

    #[test]
    fn a_list_workload_lives_while_it_exists_whatever_its_replicas() {
        use Presence::{Absent, Deleting, Live};
        let sts = |replicas, deleting| OwnerFacts::StatefulSet(Some(StatefulSetFacts { replicas, start: 0, deleting }));
        let cases = [
            (OwnerFacts::Workload(Live), true),
            (OwnerFacts::Workload(Deleting), false),
            (OwnerFacts::Workload(Absent), false),
            (sts(0, false), true),
            (sts(3, true), false),
            (OwnerFacts::StatefulSet(None), false),
            (OwnerFacts::VirtualMachine { instance: Absent, vm: Live }, true),
            (OwnerFacts::Unknown, true),
        ];
        for (facts, lives) in cases {
            assert_eq!(workload_lives(facts), lives, "{facts:?}");
        }
    }

    #[test]
    fn a_list_ip_is_held_for_the_deployment_or_cronjob_above_the_pods_controller() {
        let owner = |kind: &str, name: &str| OwnerRef { kind: kind.into(), name: name.into() };
        let (rs, job) = (owner("ReplicaSet", "api-5d8f"), owner("Job", "nightly-28"));
        let cases = [
            (Some(&rs), Some(owner("Deployment", "api")), Some(owner("Deployment", "api"))),
            (Some(&rs), None, Some(rs.clone())),
            (Some(&rs), Some(owner("Rollout", "api")), Some(rs.clone())),
            (Some(&job), Some(owner("CronJob", "nightly")), Some(owner("CronJob", "nightly"))),
            (Some(&job), None, Some(job.clone())),
            (Some(&owner("StatefulSet", "db")), None, None),
            (Some(&owner("DaemonSet", "agent")), None, None),
            (Some(&owner(KUBEVIRT_VMI_KIND, "vm1")), None, None),
            (None, None, None),
        ];
        for (controller, parent, held_for) in cases {
            assert_eq!(list_workload(controller, parent.as_ref()), held_for, "{controller:?} under {parent:?}");
        }
    }

    #[test]
    fn a_statefulset_wants_ordinals_inside_its_replica_range_until_deleted() {
        let cases = [
            (3, 0, false, "web-2", true),
            (3, 0, false, "web-3", false),
            (2, 5, false, "web-5", true),
            (2, 5, false, "web-4", false),
            (3, 0, true, "web-0", false),
            (0, 0, false, "web-0", false),
        ];
        for (replicas, start, deleting, pod, wanted) in cases {
            assert_eq!(statefulset_wants("web", replicas, start, deleting, pod), wanted, "{pod} of {replicas}@{start}");
        }
    }

    /// What the rows of [`recorded_interfaces`] vary, each from web-0's pod `u1` on node-0
    /// holding 10.0.0.6 and 10.0.0.5 on eth0.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum RecordChange {
        None,
        NotSticky,
        AnotherPod,
        AnotherNode,
        AnotherNamespace,
        AnotherOwner,
        AnotherClaim,
        NoInterface,
    }

    fn recorded_with(
        change: RecordChange,
        spec: &[ClaimedInterface],
        before: &[ClaimedInterface],
    ) -> Option<Vec<(String, Vec<String>)>> {
        let owner = OwnerRef { kind: "StatefulSet".into(), name: "web".into() };
        let records: Vec<(crate::crd::ClaimedIp, Allocation)> = ["10.0.0.6", "10.0.0.5"]
            .into_iter()
            .map(|ip| {
                let mut r = blocks::test::record("u1", "c1");
                (r.sticky, r.owner) = (true, Some(owner.clone()));
                match change {
                    RecordChange::None => {}
                    RecordChange::NotSticky => r.sticky = false,
                    RecordChange::AnotherPod => r.pod.uid = "u2".into(),
                    RecordChange::AnotherNode => r.node = "node-1".into(),
                    RecordChange::AnotherNamespace => r.pod.namespace = "other".into(),
                    RecordChange::AnotherOwner => {
                        r.owner = Some(OwnerRef { kind: "StatefulSet".into(), name: "db".into() })
                    }
                    RecordChange::AnotherClaim => r.pod.name = "web-1".into(),
                    RecordChange::NoInterface => r.interface.clear(),
                }
                (crate::crd::ClaimedIp { ip: ip.into(), pool: "p".into(), block: "b".into() }, r)
            })
            .collect();
        let pod = Claimant { namespace: "default", claim: "web-0", uid: "u1", node: "node-0", owner: &owner };
        let reserved = |c: &crate::crd::ClaimedIp| c.ip != "fd00::9";
        let found = recorded_interfaces(pod, records.iter().map(|(ip, r)| (ip.clone(), r)), spec, before, reserved)?;
        Some(found.into_iter().map(|i| (i.interface, i.ips.into_iter().map(|c| c.ip).collect())).collect())
    }

    #[test]
    fn a_witness_is_what_the_records_of_the_claims_pod_on_its_node_hold() {
        let interface = |name: &str, ips: &[&str]| ClaimedInterface {
            interface: name.into(),
            ips: ips
                .iter()
                .map(|ip| crate::crd::ClaimedIp { ip: (*ip).into(), pool: "p".into(), block: "b".into() })
                .collect(),
        };
        let owned = |rows: &[(&str, &[&str])]| -> Option<Vec<(String, Vec<String>)>> {
            Some(rows.iter().map(|(i, ips)| (i.to_string(), ips.iter().map(|s| s.to_string()).collect())).collect())
        };
        let eth0 = owned(&[("eth0", &["10.0.0.5", "10.0.0.6"])]);
        assert_eq!(recorded_with(RecordChange::None, &[], &[]), eth0, "IPv4 in order without a spec");
        let forged = [interface("eth0", &["10.0.0.9"])];
        assert_eq!(recorded_with(RecordChange::None, &forged, &[]), eth0, "a spec naming other IPs changes nothing");
        let reversed = [interface("eth0", &["10.0.0.6", "10.0.0.5"])];
        assert_eq!(
            recorded_with(RecordChange::None, &reversed, &[]),
            owned(&[("eth0", &["10.0.0.6", "10.0.0.5"])]),
            "the spec's order where it names the same IPs"
        );
        let net1 = [interface("net1", &["10.1.0.5"])];
        assert_eq!(
            recorded_with(RecordChange::None, &[], &[interface("eth0", &["10.0.0.7"]), net1[0].clone()]),
            owned(&[("eth0", &["10.0.0.5", "10.0.0.6"]), ("net1", &["10.1.0.5"])]),
            "an interface witnessed before and not recorded yet stays, in the order seen before"
        );
        assert_eq!(
            recorded_with(RecordChange::NoInterface, &[], &[interface("net1", &["10.0.0.5", "10.0.0.6"])]),
            owned(&[("net1", &["10.0.0.5", "10.0.0.6"])]),
            "a record naming no interface goes where the earlier witness lists it"
        );
        assert_eq!(
            recorded_with(RecordChange::NoInterface, &[interface("net1", &["10.0.0.5", "10.0.0.6"])], &[]),
            eth0,
            "else on the pod's own network, whatever the spec says"
        );
        assert_eq!(
            recorded_with(RecordChange::None, &[], &[interface("eth0", &["10.0.0.5", "fd00::5"])]),
            owned(&[("eth0", &["10.0.0.5", "10.0.0.6", "fd00::5"])]),
            "a family witnessed before and not recorded yet stays"
        );
        assert_eq!(
            recorded_with(
                RecordChange::None,
                &[],
                &[interface("eth0", &["10.0.0.5", "fd00::9"]), interface("net1", &["fd00::9"])]
            ),
            eth0,
            "no longer reserved (fd00::9 here): neither a family nor an interface stays"
        );
        let none = [
            RecordChange::NotSticky,
            RecordChange::AnotherPod,
            RecordChange::AnotherNode,
            RecordChange::AnotherNamespace,
            RecordChange::AnotherOwner,
            RecordChange::AnotherClaim,
        ];
        for change in none {
            assert_eq!(recorded_with(change, &[], &[]), None, "{change:?}");
        }
    }
}
