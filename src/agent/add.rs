//! CNI ADD: the sandbox's IPs, allocated once, a sticky pod's witnessed IPs reclaimed. Order:
//! block record, then checkpoint, so a crash leaves at worst a record that the next ADD or DEL
//! of the same sandbox finds; a step that fails rolls back the block records this ADD wrote
//! (`blocks::roll_back`). An ADD writes no IPClaim: the controller writes a sticky pod's claim
//! from the records it holds (decision 0022), and the ADD reads only what the controller
//! witnessed there. Each ADD makes one apiserver write.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use ipnet::IpNet;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};

use super::batch::{Taken, Wish};
use super::block_writes::ReleaseTrigger;
use super::checkpoint::{CheckpointEntry, CheckpointIp};
use super::core::{Base, Core, ResolvedPool, attachment_key, new_block, result_of};
use super::error::Error;
use super::metrics::PoolLabels;
use crate::crd::{
    Allocation, ClaimedInterface, ClaimedIp, HandshakeState, IPBlockSpec, IPClaim, IPPool, MigrationTarget, OwnerRef,
    POOL_ANNOTATION, POOLS_ANNOTATION, PodRef, ReleaseHandshake, Takeover,
};
use crate::gc::handshake::{ClaimedRecord, ReclaimStep, reclaim_step};
use crate::ipam::affinity::{self, KnownBlock};
use crate::ipam::blocks;
use crate::ipam::fixed;
use crate::ipam::free;
use crate::ipam::pools::{self, PodPlacement, PoolSet};
use crate::ipam::workload::{self, KUBEVIRT_VMI_KIND};
use crate::protocol::{AttachmentRequest, IpamResult};

/// How many not-yet-created blocks of a pool one ADD may try.
const NEW_BLOCK_PROBES: usize = 8;

/// A record this ADD wrote, and what its IP held before, so that a failed ADD can undo it.
struct Written {
    /// The IP as the CNI result and the checkpoint carry it.
    ip: CheckpointIp,
    /// What the IP held before the write; `None` for a spare of the node (module `spares`),
    /// whose record is written only once the checkpoint holds the sandbox.
    prior: Option<blocks::Prior>,
}

/// What [`fixed::take`] answered: what the IP held before, `None` when the sandbox holds it
/// already, or why it cannot be had.
type FixedTake = Result<Option<blocks::Prior>, fixed::FixedError>;

/// What pool selection reads about a pod besides the pools ([`Core::placement_facts`]).
struct PlacementFacts {
    interface_annotation: Option<String>,
    pod_annotation: Option<String>,
    namespace_annotation: Option<String>,
    namespace_labels: BTreeMap<String, String>,
    node_labels: BTreeMap<String, String>,
}

impl PlacementFacts {
    /// The placement of `request`'s interface.
    fn placement<'a>(&'a self, request: &'a AttachmentRequest) -> PodPlacement<'a> {
        PodPlacement {
            interface: &request.ifname,
            interface_annotation: self.interface_annotation.as_deref(),
            network: (&request.network, &request.pools),
            pod_annotation: self.pod_annotation.as_deref(),
            namespace_annotation: self.namespace_annotation.as_deref(),
            namespace_labels: &self.namespace_labels,
            node_labels: &self.node_labels,
        }
    }
}

/// What one claimed IP's compare-and-swap did in [`Core::reclaim_sticky`].
enum Reclaim {
    /// Taken over (or free and taken), with what the IP held before, for a rollback.
    Taken(blocks::Prior),
    /// Attached as a running live migration's target; the source keeps the record.
    Attached,
    /// Marked for a sticky takeover: the ADD waits for the holder's node.
    Marked,
}

/// What [`Core::reclaim_sticky`] got back for a recreated sticky pod.
struct Reclaimed {
    /// Every IP of the claimed interface, in the claim's order.
    ips: Vec<CheckpointIp>,
    /// The records taken over (undone if the ADD fails later).
    written: Vec<Written>,
}

/// The mark a recreated sticky pod's ADD writes on its predecessor's record: the record's
/// node answers it like a release mark (docs/gc-rules.md, "Sticky takeover").
fn takeover_mark(claimant: &Allocation) -> ReleaseHandshake {
    ReleaseHandshake {
        state: HandshakeState::MarkedForRelease,
        marked_at: Time(Timestamp::now()),
        reason: format!(
            "sticky takeover by pod {}/{} on node {}",
            claimant.pod.namespace, claimant.pod.name, claimant.node
        ),
        detail: None,
        pod_ended_at: None,
        takeover: Some(Takeover { pod: claimant.pod.clone(), node: claimant.node.clone() }),
    }
}

/// Whether record `a` and the new record `b` belong to the same sticky workload: the same
/// KubeVirt VM, or the same StatefulSet pod name (its ordinal).
fn same_workload(a: &Allocation, b: &Allocation) -> bool {
    let same_namespace = a.pod.namespace == b.pod.namespace;
    match b.owner.as_ref() {
        Some(owner) if owner.kind == KUBEVIRT_VMI_KIND => same_namespace && a.owner.as_ref() == Some(owner),
        _ => same_namespace && a.pod.name == b.pod.name,
    }
}

/// Whether the new record `b` of a live migration's target attaches to record `a` as its
/// migration target rather than taking it over: `a` is the same VM instance's and another
/// pod's sandbox (the migration's source) still holds it. A reservation with no sandbox is
/// simply taken over.
fn shares_with_source(a: &Allocation, b: &Allocation) -> bool {
    a.pod.uid != b.pod.uid && blocks::may_be_attached(a) && same_workload(a, b)
}

/// Whether checkpoint entry `entry` is an older sandbox of the pod that `request` makes a new
/// sandbox for: the same pod (by the UID the runtime gave, which the request must carry: a
/// UID read from the API by name could be a successor's, whose live entry a late ADD of a
/// deleted predecessor must not take) under the same namespace and name (so within the pod's
/// turn), the same network and interface, another sandbox.
fn superseded_by(entry: &CheckpointEntry, request: &AttachmentRequest) -> bool {
    let Some(pod) = request.pod.as_ref() else { return false };
    pod.uid.as_deref().is_some_and(|uid| !uid.is_empty() && entry.pod.uid == uid)
        && entry.pod.namespace == pod.namespace
        && entry.pod.name == pod.name
        && entry.key.network == request.network
        && entry.key.ifname == request.ifname
        && entry.key.container_id != request.container_id
}

/// Whether `ip` is an IPv4 address (a claimed IP that does not parse counts as IPv6).
fn is_v4(ip: &str) -> bool {
    ip.parse::<IpAddr>().is_ok_and(|ip| ip.is_ipv4())
}

/// The IP families (`true`: IPv4) a sticky pod keeps no claimed IP of: given up, or never
/// claimed; those it gets afresh from its pools, as a new pod does.
fn missing_families<T>(slots: &[Result<T, bool>], v4: impl Fn(&T) -> bool) -> Vec<bool> {
    let kept = |family: bool| slots.iter().any(|slot| slot.as_ref().is_ok_and(|ip| v4(ip) == family));
    [true, false].into_iter().filter(|family| !kept(*family)).collect()
}

/// A sticky pod's IPs in its claim's order: each kept IP (`Ok`) in its place, each IP given
/// up (`Err`, with whether it is IPv4) replaced by the fresh IP of its family, or left out
/// when no pool of that family was chosen; a fresh IP of a family the claim did not hold
/// comes after them.
fn fill_given_up<T>(slots: Vec<Result<T, bool>>, fresh: Vec<T>, v4: impl Fn(&T) -> bool) -> Vec<T> {
    let (fresh_v4, fresh_v6): (Vec<T>, Vec<T>) = fresh.into_iter().partition(|ip| v4(ip));
    let (mut fresh_v4, mut fresh_v6) = (fresh_v4.into_iter(), fresh_v6.into_iter());
    let mut ips: Vec<T> = slots
        .into_iter()
        .filter_map(|slot| match slot {
            Ok(kept) => Some(kept),
            Err(true) => fresh_v4.next(),
            Err(false) => fresh_v6.next(),
        })
        .collect();
    ips.extend(fresh_v4.chain(fresh_v6));
    ips
}

impl Core {
    /// CNI ADD: the sandbox's IPs, allocated once (idempotent for the same attachment).
    pub async fn add(&self, request: &AttachmentRequest) -> Result<IpamResult, Error> {
        let started = Instant::now();
        let outcome = self.add_inner(request).await;
        self.metrics.allocation_duration.observe(started.elapsed().as_secs_f64());
        self.metrics.allocation(outcome.as_ref().map_or_else(Error::label, |_| "success"));
        if let Err(e) = &outcome {
            tracing::warn!(container_id = %request.container_id, result = e.label(), error = %e, "ADD failed");
        }
        outcome
    }

    async fn add_inner(&self, request: &AttachmentRequest) -> Result<IpamResult, Error> {
        let key = attachment_key(request);
        // The pod's calls are serialised (module `serial`), so no other ADD of this sandbox
        // can insert it between this check and the insert below.
        if let Some(done) = self.checkpoint.read(|c| c.get(&key).map(|entry| result_of(&entry.ips))) {
            return Ok(done);
        }
        let pod_ref = request.pod.as_ref().ok_or(Error::NoPodInRequest)?;
        let pod = self
            .pod(pod_ref)
            .await?
            .ok_or_else(|| Error::PodMissing { pod: format!("{}/{}", pod_ref.namespace, pod_ref.name) })?;
        // A static pod runs under its config hash, not its mirror's metadata.uid.
        let uid = workload::runtime_uid(&pod).unwrap_or_default().to_string();
        if let Some(expected) = pod_ref.uid.as_deref()
            && expected != uid
        {
            return Err(Error::StaleSandbox {
                pod: format!("{}/{}", pod_ref.namespace, pod_ref.name),
                uid,
                expected: expected.to_string(),
            });
        }
        let owner = workload::controller_of(&pod);
        let sticky = workload::is_sticky(owner.as_ref(), &self.settings.sticky_kinds);
        // Two pods of one sticky workload (a VM's launcher pods) may share its IPs: their ADDs
        // on this node take turns, so neither decides on a checkpoint the other is changing.
        let _workload = match sticky {
            true => {
                let claim = workload::claim_name(&pod_ref.name, owner.as_ref());
                Some(self.serial.workload(&format!("{}/{claim}", pod_ref.namespace)).await)
            }
            false => None,
        };
        let (ips_annotation, list_annotation) = fixed::annotations_for(
            &request.ifname,
            pod.annotations().get(fixed::IPS_ANNOTATION).map(String::as_str),
            pod.annotations().get(fixed::IP_LIST_ANNOTATION).map(String::as_str),
        );
        let fixed = fixed::requested(
            request.runtime_config_ips.as_deref(),
            request.args_ips.as_deref(),
            ips_annotation,
            list_annotation,
        )
        .map_err(|cause| Error::FixedIp { pod: format!("{}/{}", pod_ref.namespace, pod_ref.name), cause })?;
        let returning = self.release_superseded(request, &uid).await.map_err(|e| Error::Superseded {
            pod: format!("{}/{}", pod_ref.namespace, pod_ref.name),
            source: Box::new(e),
        })?;
        let found = self.records_of_sandbox(&request.container_id, &request.ifname);
        let migration = if sticky { self.active_migration(&pod, owner.as_ref()).await? } else { None };
        let (ips, written) = if !found.is_empty() {
            // Written before a crash that lost the answer: the same sandbox adopts them. They
            // are not this call's writes, so a failure below leaves them to the sandbox's DEL.
            let ips = self.checkpoint_ips(found.into_iter().map(|(block, ip, pool)| (pool, block, ip)).collect());
            (ips, Vec::new())
        } else {
            let mut reclaimed = if sticky {
                let held_here: BTreeSet<String> =
                    self.checkpoint.read(|c| c.entries().flat_map(|e| e.ips.iter().map(|i| i.ip.clone())).collect());
                self.reclaim_sticky(&pod, owner.as_ref(), migration.as_deref(), request, &held_here, fixed.as_ref())
                    .await?
            } else {
                None
            };
            // Fixed IPs win over a sticky claim's other IPs (a changed annotation): those go
            // back, and the fixed path takes the pod's own reservation (`fixed::check_free`).
            if let (Some(fixed), Some(back)) = (&fixed, &reclaimed) {
                let claimed: Vec<IpAddr> = back.ips.iter().filter_map(|i| i.ip.parse().ok()).collect();
                if !fixed.satisfied_by(&claimed) {
                    self.roll_back(&back.written, request, &uid).await;
                    reclaimed = None;
                }
            }
            match reclaimed {
                Some(reclaimed) => (reclaimed.ips, reclaimed.written),
                None => {
                    let written = match &fixed {
                        Some(fixed) => {
                            self.allocate_fixed(&pod, owner.as_ref(), sticky, request, fixed, &returning).await?
                        }
                        None => self.allocate(&pod, owner.as_ref(), sticky, request, None, &returning).await?,
                    };
                    (written.iter().map(|w| w.ip.clone()).collect(), written)
                }
            }
        };
        let picked: Vec<CheckpointIp> = written.iter().filter(|w| w.prior.is_none()).map(|w| w.ip.clone()).collect();
        let entry = CheckpointEntry {
            key,
            pod: PodRef { namespace: pod_ref.namespace.clone(), name: pod_ref.name.clone(), uid: uid.clone() },
            ips: ips.clone(),
            spare_record: (!picked.is_empty())
                .then(|| Box::new(self.record_for(&pod, owner.as_ref(), sticky, request))),
        };
        let inserted = self.checkpoint.insert(entry).await;
        self.spares_saved(&picked, inserted.is_ok());
        if let Err(e) = inserted {
            self.roll_back(&written, request, &uid).await;
            return Err(e.into());
        }
        tracing::info!(pod = %format!("{}/{}", pod_ref.namespace, pod_ref.name), container_id = %request.container_id,
            ips = ?ips.iter().map(|i| i.ip.as_str()).collect::<Vec<_>>(), "allocated");
        Ok(result_of(&ips))
    }

    /// Releases, as their DELs would have, the checkpoint entries of pod `uid` on the
    /// request's network and interface under another sandbox. A pod has one sandbox at a time:
    /// kubelet makes a new one only after stopping the old one (whose teardown is the CNI DEL),
    /// so an older entry left is a sandbox whose DEL never came because the runtime lost it (a
    /// node rebooted, containerd's state wiped): nothing else would free its IPs while the pod
    /// lives on. The pod's calls take turns (module `serial`), so no DEL or ADD of the older
    /// sandbox runs meanwhile; a late DEL of it then finds nothing to release. Returns the
    /// IPs it freed (a sticky pod's reserved ones stay reserved and come back through its
    /// claim), which the new sandbox takes back first and at once ([`free::Asker::RECLAIM`]):
    /// they were the pod's own, so no other pod's traffic can reach it through them, and its
    /// IP stays the same across a node's reboot.
    async fn release_superseded(&self, request: &AttachmentRequest, uid: &str) -> Result<BTreeSet<IpAddr>, Error> {
        let superseded: Vec<CheckpointEntry> =
            self.checkpoint.read(|c| c.entries().filter(|e| superseded_by(e, request)).cloned().collect());
        let mut returning = BTreeSet::new();
        for entry in superseded {
            tracing::info!(pod = %format!("{}/{}", entry.pod.namespace, entry.pod.name),
                old_container_id = %entry.key.container_id, container_id = %request.container_id,
                "a new sandbox of the pod replaces one whose DEL never came: releasing the old one's IPs");
            returning.extend(self.detach(&entry.key, Some(&entry), Some(uid), ReleaseTrigger::Superseded).await?);
        }
        Ok(returning)
    }

    fn record_for(&self, pod: &Pod, owner: Option<&OwnerRef>, sticky: bool, request: &AttachmentRequest) -> Allocation {
        Allocation {
            pod: PodRef {
                namespace: pod.namespace().unwrap_or_default(),
                name: pod.name_any(),
                uid: workload::runtime_uid(pod).unwrap_or_default().to_string(),
            },
            node: self.settings.node.clone(),
            network: request.network.clone(),
            container_id: request.container_id.clone(),
            interface: request.ifname.clone(),
            owner: owner.cloned(),
            sticky,
            held_for: None,
            allocated_at: Time(Timestamp::now()),
            release_handshake: None,
            migration_target: None,
            repaired_at: None,
        }
    }

    /// The UID of the live migration `pod` is the target of, if that migration of its VM
    /// instance exists and still runs ([`workload::is_active_migration_target`]).
    async fn active_migration(&self, pod: &Pod, owner: Option<&OwnerRef>) -> Result<Option<String>, Error> {
        let Some(job) = workload::migration_job_of(pod) else { return Ok(None) };
        let namespace = pod.namespace().unwrap_or_default();
        let resource =
            ApiResource::from_gvk(&GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstanceMigration"));
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), &namespace, &resource);
        let migrations = match api.list(&ListParams::default()).await {
            Ok(list) => list.items,
            Err(kube::Error::Api(status)) if status.code == 404 => Vec::new(),
            Err(e) => return Err(Error::api(format!("listing VirtualMachineInstanceMigrations in {namespace}"))(e)),
        };
        let active = migrations.iter().any(|m| {
            let text = |path: &str| m.data.pointer(path).and_then(|v| v.as_str()).unwrap_or_default();
            let facts = workload::MigrationFacts {
                uid: m.metadata.uid.as_deref().unwrap_or_default(),
                vmi_name: text("/spec/vmiName"),
                phase: text("/status/phase"),
                deleting: m.metadata.deletion_timestamp.is_some(),
            };
            workload::is_active_migration_target(owner, job, &facts)
        });
        Ok(active.then(|| job.to_string()))
    }

    /// Gives a recreated sticky pod its claim's IPs back; `None` when it has none to reclaim.
    /// The target of the running live migration `migration` attaches to the IPs its source
    /// still holds instead of taking them over (`shared`). Any other claimed IP whose record
    /// is another node's (attached, or a reservation) or still in `held_here` (the IPs of this
    /// node's checkpoint) is not shared: the record is marked for a sticky takeover and the
    /// ADD fails with "try again later" until the record's node, or the controller for a node
    /// that cannot answer, has let go of it ([`reclaim_step`]). The IPs are those the
    /// controller witnessed for the claim (`status.witnessed`): what the workload's pod held by
    /// its node's records. The spec, which any node's agent of an older version may write
    /// (rule C-1), chooses nothing (decision 0022). Unless the pod has fixed IPs (it gets those
    /// alone), an IP family the witness holds no IP of is allocated afresh.
    async fn reclaim_sticky(
        &self,
        pod: &Pod,
        owner: Option<&OwnerRef>,
        migration: Option<&str>,
        request: &AttachmentRequest,
        held_here: &BTreeSet<String>,
        fixed: Option<&fixed::Requested>,
    ) -> Result<Option<Reclaimed>, Error> {
        let namespace = pod.namespace().unwrap_or_default();
        let claim_name = workload::claim_name(&pod.name_any(), owner);
        let claims: Api<IPClaim> = Api::namespaced(self.client.clone(), &namespace);
        let claim = claims
            .get_opt(&claim_name)
            .await
            .map_err(Error::api(format!("reading IPClaim {namespace}/{claim_name}")))?;
        let witnessed = claim.as_ref().and_then(|c| c.status.as_ref()).and_then(|s| s.witnessed.as_ref());
        let witnessed = witnessed.and_then(|w| w.interfaces.iter().find(|i| i.interface == request.ifname)).cloned();
        // Pinned: the pod's own fixed IPs stand for a witness (`pinned_interface`); only its
        // workload's records of them are taken back here, anything else is the fixed path's.
        let pinned = witnessed.is_none();
        let Some(interface) = witnessed.or_else(|| self.pinned_interface(fixed, &request.ifname)) else {
            return Ok(None);
        };
        let interface = &interface;
        // Checked before anything is written: the claim is user-writable, the blocks are not.
        for claimed in &interface.ips {
            let (Some(pool), Ok(ip)) = (self.resolve_pool(&claimed.pool), claimed.ip.parse::<IpAddr>()) else {
                continue;
            };
            let Some(block) = pool.layout.block_of(ip) else { continue };
            pools::check_claimed_block(&pool.name, block, ip, &claimed.block).map_err(|cause| Error::InvalidClaim {
                claim: format!("{namespace}/{claim_name}"),
                pod: pod.name_any(),
                cause,
            })?;
        }
        let record = self.record_for(pod, owner, true, request);
        let target = migration.map(|uid| MigrationTarget {
            migration_uid: uid.to_string(),
            pod: record.pod.clone(),
            node: record.node.clone(),
            container_id: record.container_id.clone(),
            interface: record.interface.clone(),
        });
        let fill_families = fixed.is_none();
        // One slot per IP taken back, in the claim's order; `Err(is IPv4)`: given up,
        // allocated afresh.
        let (mut slots, mut taken, mut shared) = (Vec::new(), Vec::new(), false);
        for claimed in &interface.ips {
            let (Some(pool), Ok(ip)) = (self.resolve_pool(&claimed.pool), claimed.ip.parse::<IpAddr>()) else {
                break;
            };
            // A pool being deleted hands out no new IP, so a restarted pod gives up its IP
            // there (only that family's); a live migration's target still attaches to the IP
            // its source holds, which is not a new one.
            if pool.deleting && target.is_none() {
                if pinned {
                    break;
                }
                slots.push(Err(is_v4(&claimed.ip)));
                continue;
            }
            let Some(block) = pool.layout.block_of(ip) else {
                break;
            };
            let key = ip.to_string();
            let mut waiting_for = None;
            let took = self
                .write_block(&claimed.block, &pool.name, block, |spec| {
                    waiting_for = None;
                    if let (Some(r), Some(target)) = (spec.allocations.get(&key), target.as_ref())
                        && shares_with_source(r, &record)
                    {
                        return blocks::attach_migration_target(spec, &key, target.clone()).map(|()| Reclaim::Attached);
                    }
                    if pool.deleting {
                        return None;
                    }
                    let Some(current) = spec.allocations.get_mut(&key) else {
                        // A pinned IP with no record is no IP of the workload's: the fixed path
                        // takes it, with the pool's checks and the reuse cooldown.
                        if pinned {
                            return None;
                        }
                        // No record: free unless the pool's layout no longer hands it out or it
                        // is a node's spare (maybe bound, its record not written yet).
                        let free =
                            free::hold(spec, &pool.layout, ip, &free::Asker::RECLAIM, Timestamp::now()).is_none();
                        return free.then(|| Reclaim::Taken(blocks::allocate(spec, ip, record.clone())));
                    };
                    let step = reclaim_step(ClaimedRecord {
                        same_pod: current.pod.uid == record.pod.uid,
                        same_workload: same_workload(current, &record),
                        own_node: current.node == self.settings.node,
                        detached_here: current.node == self.settings.node && !held_here.contains(&key),
                        handshake: current.release_handshake.as_ref().map(|h| h.state),
                        asked_for_another: current
                            .release_handshake
                            .as_ref()
                            .and_then(|h| h.takeover.as_ref())
                            .is_some_and(|t| t.pod.uid != record.pod.uid || t.node != record.node),
                    });
                    match step {
                        ReclaimStep::NotOurs => None,
                        ReclaimStep::Take => Some(Reclaim::Taken(blocks::allocate(spec, ip, record.clone()))),
                        ReclaimStep::Wait => {
                            waiting_for = Some(current.clone());
                            None
                        }
                        ReclaimStep::Mark => {
                            current.release_handshake = Some(takeover_mark(&record));
                            waiting_for = Some(current.clone());
                            Some(Reclaim::Marked)
                        }
                    }
                })
                .await;
            let took = match took {
                Ok(took) => took,
                Err(e) => {
                    self.roll_back(&taken, request, &record.pod.uid).await;
                    return Err(e);
                }
            };
            if let Some(holder) = waiting_for {
                self.roll_back(&taken, request, &record.pod.uid).await;
                return Err(Error::AwaitingTakeover {
                    ip: ip.to_string(),
                    pod: format!("{namespace}/{}", pod.name_any()),
                    container_id: holder.container_id,
                    holder: format!("{}/{}", holder.pod.namespace, holder.pod.name),
                    holder_uid: holder.pod.uid,
                    node: holder.node,
                });
            }
            let Some(took) = took else {
                if !pinned {
                    tracing::warn!(claim = %claim_name, ip = %claimed.ip, "witnessed IP is held by another pod; allocating afresh");
                }
                break;
            };
            let ip = pool.checkpoint_ip(claimed.ip.clone(), claimed.block.clone());
            match took {
                Reclaim::Taken(prior) => taken.push(Written { ip: ip.clone(), prior: Some(prior) }),
                Reclaim::Attached => {
                    shared = true;
                    taken.push(Written { ip: ip.clone(), prior: Some(blocks::Prior::Attached) });
                }
                // A mark always sets `waiting_for`, which returned above.
                Reclaim::Marked => break,
            }
            slots.push(Ok(ip));
        }
        let given_up = slots.iter().filter(|slot| slot.is_err()).count();
        // Unless every IP was given up (or a claimed one could not be taken back): then the pod
        // is allocated afresh, as a new pod is.
        if slots.len() == interface.ips.len() && given_up < slots.len() {
            let given_up_families: Vec<bool> = slots.iter().filter_map(|slot| slot.as_ref().err().copied()).collect();
            // A family the witness holds no IP of (its pool created since, or a witness
            // written between a first ADD's two families' writes) is allocated as a new pod's is, unless no pool gives one
            // now: the pod then starts with what it claimed, as it ran. A migration target
            // only attaches to what its source holds, and a pod with fixed IPs gets those
            // alone.
            let unclaimed: Vec<bool> = missing_families(&slots, |ip| is_v4(&ip.ip))
                .into_iter()
                .filter(|family| fill_families && target.is_none() && !given_up_families.contains(family))
                .collect();
            let mut fresh = Vec::new();
            for (families, required) in [(given_up_families, true), (unclaimed, false)] {
                if families.is_empty() {
                    continue;
                }
                match self.allocate(pod, owner, true, request, Some(&families), &BTreeSet::new()).await {
                    Ok(written) => {
                        fresh.extend(written.iter().map(|w| w.ip.clone()));
                        taken.extend(written);
                    }
                    Err(e) if !required && e.is_pool_shortage() => {
                        tracing::warn!(claim = %claim_name, error = %e, "no IP of a family the claim never held: the pod starts with its claimed IPs");
                    }
                    Err(e) => {
                        self.roll_back(&taken, request, &record.pod.uid).await;
                        return Err(e);
                    }
                }
            }
            let ips = fill_given_up(slots, fresh, |ip| is_v4(&ip.ip));
            tracing::info!(claim = %claim_name, migration_target = shared, given_up, "sticky IPs reclaimed for the pod");
            return Ok(Some(Reclaimed { ips, written: taken }));
        }
        // The IPs already taken go back to the records they were taken from.
        self.roll_back(&taken, request, &record.pod.uid).await;
        Ok(None)
    }

    /// Allocates one IP from each pool the pod should use, all or none: when one pool has
    /// no IP, the IPs already taken from the others are rolled back. `families` (`true`:
    /// IPv4) limits it to the pools of those IP families: a sticky pod's IPs given up in a
    /// pool being deleted. `returning`: IPs of a sandbox of the pod the runtime lost, taken
    /// back first where a chosen pool holds them.
    async fn allocate(
        &self,
        pod: &Pod,
        owner: Option<&OwnerRef>,
        sticky: bool,
        request: &AttachmentRequest,
        families: Option<&[bool]>,
        returning: &BTreeSet<IpAddr>,
    ) -> Result<Vec<Written>, Error> {
        let namespace_name = pod.namespace().unwrap_or_default();
        let pools_snapshot = self.pools.state();
        let pool_set = PoolSet::of(&pools_snapshot, &self.known_blocks());
        let views = pool_set.views();
        let facts = self.placement_facts(pod, &pools_snapshot).await?;
        let placement = facts.placement(request);
        let chosen = pools::select(&views, pool_set.orphans(), &placement).map_err(|cause| Error::NoPoolFits {
            pod: format!("{namespace_name}/{}", pod.name_any()),
            interface: request.ifname.clone(),
            cause,
        })?;
        let record = self.record_for(pod, owner, sticky, request);
        let mut written = Vec::new();
        for view in chosen {
            let Ok(layout) = view.layout else { continue };
            if families.is_some_and(|f| !f.contains(&layout.family_is_v4())) {
                continue;
            }
            let pool = ResolvedPool::new(view.name, view.spec, layout.clone(), view.deleting);
            // A pod whose workload keeps no IP may take one of the node's spares on its own
            // network's interface (the one its status reports, which a lost checkpoint's
            // recovery reads), unless it takes its own IP of this pool back.
            let taking_back = returning.iter().any(|ip| layout.cidr().contains(ip));
            let spare = !sticky && request.ifname == fixed::POD_INTERFACE && !taking_back;
            if let Some(ip) = spare.then(|| self.pick_spare(&pool)).flatten() {
                written.push(Written { ip, prior: None });
                continue;
            }
            match self.allocate_in_pool(&pool, &record, returning).await {
                Ok(ip) => written.push(ip),
                Err(e) => {
                    self.roll_back(&written, request, &record.pod.uid).await;
                    return Err(e);
                }
            }
        }
        Ok(written)
    }

    /// What pool selection reads about `pod` besides the pools: its namespace's annotation
    /// and labels, and the node's labels when a pool of `pools` selects nodes.
    async fn placement_facts(&self, pod: &Pod, pools: &[Arc<IPPool>]) -> Result<PlacementFacts, Error> {
        let namespace = self.namespace(&pod.namespace().unwrap_or_default()).await?;
        let node_labels = if pools.iter().any(|p| p.spec.node_selector.is_some()) {
            self.node_labels().await?
        } else {
            BTreeMap::new()
        };
        Ok(PlacementFacts {
            interface_annotation: pod.annotations().get(POOLS_ANNOTATION).cloned(),
            pod_annotation: pod.annotations().get(POOL_ANNOTATION).cloned(),
            namespace_annotation: namespace.as_ref().and_then(|n| n.annotations().get(POOL_ANNOTATION)).cloned(),
            namespace_labels: namespace.as_ref().map(|n| n.labels().clone()).unwrap_or_default(),
            node_labels,
        })
    }

    /// Allocates exactly the `fixed` IPs, each in the pool holding it ([`fixed::pool_of`]),
    /// all or none, written like any other allocation (module `batch`): of each group of
    /// [`fixed::Requested::choices`], the first IP that can be had; a group none of whose IPs
    /// can be had fails the ADD saying why for each. One of `returning` (IPs of a sandbox of
    /// the pod the runtime lost) is the pod's own, so its cooldown does not hold it back.
    async fn allocate_fixed(
        &self,
        pod: &Pod,
        owner: Option<&OwnerRef>,
        sticky: bool,
        request: &AttachmentRequest,
        fixed: &fixed::Requested,
        returning: &BTreeSet<IpAddr>,
    ) -> Result<Vec<Written>, Error> {
        let pod_name = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
        let pools_snapshot = self.pools.state();
        let pool_set = PoolSet::of(&pools_snapshot, &self.known_blocks());
        let views = pool_set.views();
        let facts = self.placement_facts(pod, &pools_snapshot).await?;
        let mut record = self.record_for(pod, owner, sticky, request);
        // An IP drawn from a workload's list stays the workload's between its pods.
        if fixed.source == fixed::Source::List {
            let namespace = pod.namespace().unwrap_or_default();
            let controller = owner.map_or_else(String::new, |o| format!("{} {namespace}/{}, ", o.kind, o.name));
            record.held_for =
                crate::owners::list_workload(&self.client, &namespace, owner).await.map_err(Error::api(format!(
                    "reading {controller}the controller of pod {pod_name}, for the workload of its {}",
                    fixed::Source::List
                )))?;
        }
        let mut written = Vec::new();
        for choice in fixed.choices() {
            let mut refused = Vec::new();
            for &ip in &choice {
                let taken = match fixed::pool_of(&views, pool_set.orphans(), &facts.placement(request), ip) {
                    Ok(place) => self.take_fixed(&place, &record, ip, returning.contains(&ip)).await,
                    Err(cause) => Ok(Err(cause)),
                };
                match taken {
                    Ok(Ok(ip)) => {
                        written.push(ip);
                        break;
                    }
                    Ok(Err(cause)) => refused.push(cause),
                    Err(e) => {
                        self.roll_back(&written, request, &record.pod.uid).await;
                        return Err(e);
                    }
                }
            }
            if refused.len() == choice.len() {
                self.roll_back(&written, request, &record.pod.uid).await;
                let v4 = choice.first().is_some_and(IpAddr::is_ipv4);
                return Err(Error::FixedIp { pod: pod_name, cause: fixed::none_of(fixed.source, refused, v4) });
            }
        }
        Ok(written)
    }

    /// Fixed IP `ip` of `place` for `record`: from the copy held, in one write with the
    /// node's other edits of the block; alone when that batch was not written; and, before
    /// refusing, once more from a fresh read (a held copy may be behind a release). The inner
    /// error says why the IP cannot be had; the outer one, that a write failed. `own`: the IP
    /// was the pod's under a sandbox the runtime lost, so it takes it back with no cooldown.
    async fn take_fixed(
        &self,
        place: &fixed::FixedIn<'_>,
        record: &Allocation,
        ip: IpAddr,
        own: bool,
    ) -> Result<Result<Written, fixed::FixedError>, Error> {
        let (pool, net) = (place.pool.name.to_string(), place.block);
        let block = pools::block_name(&pool, net);
        let cooldown = if own { free::Asker::RECLAIM.cooldown } else { self.settings.cooldown };
        let (node, owned) = (self.settings.node.clone(), record.clone());
        let resolved = ResolvedPool::new(&pool, place.pool.spec, place.layout.clone(), place.pool.deleting);
        let layout = resolved.layout.clone();
        // The node's own spare is kept from its other calls while this write takes it.
        let withdrawn = self.withdraw_spare(&block, ip);
        let take = move |spec: &mut IPBlockSpec| {
            let asker = fixed::asker(&node, withdrawn, cooldown);
            let taken = fixed::take(spec, &node, &layout, ip, &owned, &asker, Timestamp::now());
            (matches!(taken, Ok(Some(_))), taken)
        };
        let taken = self.take_fixed_written(&block, &pool, net, take).await;
        if withdrawn {
            self.spare_write_done(ip);
        }
        let prior = match taken? {
            Ok(prior) => prior,
            Err(cause) => return Ok(Err(cause)),
        };
        let ip = resolved.checkpoint_ip(ip.to_string(), block);
        Ok(Ok(Written { ip, prior: Some(prior.unwrap_or(blocks::Prior::Free(None))) }))
    }

    /// [`Core::take_fixed`]'s writes: batched, alone when the batch was not written, and
    /// from a fresh read before refusing.
    async fn take_fixed_written(
        &self,
        block: &str,
        pool: &str,
        net: IpNet,
        take: impl Fn(&mut IPBlockSpec) -> (bool, FixedTake) + Clone + Send + 'static,
    ) -> Result<FixedTake, Error> {
        let mut taken = match self.edit_in_batch(block, Some((pool.to_string(), net)), take.clone()).await {
            Some(taken) => taken,
            None => self.take_fixed_alone(block, pool, net, Base::Newest, &take).await?,
        };
        if taken.is_err() {
            taken = self.take_fixed_alone(block, pool, net, Base::Fresh, &take).await?;
        }
        Ok(taken)
    }

    /// [`Core::take_fixed`]'s write of its own, starting from `base`.
    async fn take_fixed_alone(
        &self,
        block: &str,
        pool: &str,
        net: IpNet,
        base: Base,
        take: &impl Fn(&mut IPBlockSpec) -> (bool, FixedTake),
    ) -> Result<FixedTake, Error> {
        let create = || new_block(block, pool, net);
        // The edit always runs: the block is made when it does not exist.
        let mut got = Ok(None);
        self.cas_block(block, base, Some(&create), |b| {
            let (changed, taken) = take(&mut b.spec);
            got = taken;
            changed.then_some(())
        })
        .await?;
        Ok(got)
    }

    /// One IP of `pool` for `record`: from this node's own blocks, else from a free block it
    /// claims in the same write, else borrowed from another node's block
    /// ([`affinity::plan`]). Every block is edited from the newest copy the agent holds, so
    /// a block with no ready IP costs no request, and the ADDs of the node waiting for the
    /// same block share one write (module `batch`); one of `returning` that a block holds
    /// free goes first ([`Wish::returning`]).
    async fn allocate_in_pool(
        &self,
        pool: &ResolvedPool,
        record: &Allocation,
        returning: &BTreeSet<IpAddr>,
    ) -> Result<Written, Error> {
        let node = self.settings.node.as_str();
        let blocks = self.newest_blocks_of(&pool.name);
        let known: Vec<KnownBlock<'_>> = blocks.iter().filter_map(KnownBlock::of).collect();
        let planned = affinity::plan(node, &pool.name, &pool.layout, &known, NEW_BLOCK_PROBES);
        let candidates = affinity::holding_first(planned, returning);
        let (mut cooling, mut next_free) = (0usize, None::<Timestamp>);
        // First from the copies held (batched with the node's other ADDs); before saying the
        // pool has nothing, once more from fresh reads: a held copy may be behind a release.
        for fresh in [false, true] {
            (cooling, next_free) = (0, None);
            for candidate in &candidates {
                let wish = Wish {
                    layout: pool.layout.clone(),
                    net: candidate.net,
                    how: candidate.how,
                    record: record.clone(),
                    returning: returning.clone(),
                };
                let taken = match fresh {
                    false => match self.take_from_block(&candidate.name, &pool.name, wish.clone()).await {
                        // The batch's write failed: write alone, for this ADD's own error.
                        Taken::Retry => self.take_alone(&candidate.name, &pool.name, &wish, Base::Newest).await?,
                        taken => taken,
                    },
                    true => self.take_alone(&candidate.name, &pool.name, &wish, Base::Fresh).await?,
                };
                match taken {
                    Taken::Ip(ip, prior) => {
                        let ip = pool.checkpoint_ip(ip.to_string(), candidate.name.clone());
                        return Ok(Written { ip, prior: Some(prior) });
                    }
                    Taken::Cooling { cooling: count, next_free_at } => {
                        cooling += count;
                        next_free = Some(next_free.map_or(next_free_at, |t| t.min(next_free_at)));
                    }
                    Taken::Nothing | Taken::Retry => {}
                }
            }
        }
        self.metrics.pool_exhausted.get_or_create(&PoolLabels { pool: pool.name.clone() }).inc();
        if cooling > 0 {
            let next_free = next_free.map(|t| t.to_string()).unwrap_or_default();
            let withheld_gateway = pool.withheld_gateway.clone();
            return Err(Error::Cooling { pool: pool.name.clone(), cooling, next_free, withheld_gateway });
        }
        Err(Error::PoolExhausted { pool: pool.name.clone(), withheld_gateway: pool.withheld_gateway.clone() })
    }

    /// The IPs the pod itself names as fixed (not a list to choose from) as the interface to
    /// take back, for a pod whose claim the controller has not witnessed for `ifname` (no
    /// controller ran since its predecessor's ADD, or it was recreated within the second
    /// after it): the pod's spec names them, not a node, so its workload's record of one on
    /// another node is asked for through the takeover handshake as a witnessed IP is. Without
    /// this, the fixed path would refuse that record as held by another pod for as long as it
    /// stays reserved. Only such records are taken back through it: a pinned IP with no
    /// record, or in a pool being deleted, goes to the fixed path with all its checks. `None`
    /// without such IPs, or when one lies in no pool.
    fn pinned_interface(&self, fixed: Option<&fixed::Requested>, ifname: &str) -> Option<ClaimedInterface> {
        let fixed = fixed.filter(|f| f.source != fixed::Source::List)?;
        let pools = self.pools.state();
        let ips = fixed.ips.iter().map(|&ip| {
            pools.iter().find_map(|pool| {
                let block = pools::layout(&pool.spec).ok()?.block_of(ip)?;
                let name = pool.name_any();
                Some(ClaimedIp { ip: ip.to_string(), block: pools::block_name(&name, block), pool: name })
            })
        });
        Some(ClaimedInterface { interface: ifname.to_string(), ips: ips.collect::<Option<Vec<_>>>()? })
    }

    /// Undoes this ADD's block writes after a later step failed ([`blocks::roll_back`]):
    /// the runtime got no IP, and its retry is a new sandbox, so nothing may stay behind. A
    /// rollback that cannot be written is left to the sandbox's DEL and the GC.
    async fn roll_back(&self, written: &[Written], request: &AttachmentRequest, uid: &str) {
        for Written { ip, prior } in written {
            let Some(prior) = prior else {
                // A spare picked, nothing written: free for the node's next ADD again.
                self.spares_saved(std::slice::from_ref(ip), false);
                continue;
            };
            let Some(pool) = self.resolve_pool(&ip.pool) else { continue };
            let Some(net) = ip.ip.parse().ok().and_then(|addr| pool.layout.block_of(addr)) else { continue };
            let undone = self
                .write_block(&ip.block, &pool.name, net, |spec| {
                    blocks::roll_back(spec, &ip.ip, &request.container_id, &request.ifname, uid, prior).then_some(())
                })
                .await;
            match undone {
                Ok(Some(())) => {
                    self.metrics.release("rolled_back");
                    tracing::info!(ip = %ip.ip, container_id = %request.container_id, "rolled back the record of a failed ADD");
                }
                Ok(None) => {}
                Err(e) => {
                    self.metrics.release("error");
                    tracing::warn!(ip = %ip.ip, error = %e, "rolling back a failed ADD failed; the sandbox's DEL or the GC will release it");
                }
            }
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn an_ip_given_up_or_a_family_never_claimed_is_allocated_afresh() {
        let v4 = |ip: &&str| is_v4(ip);
        // (slots, fresh IPs, the pod's IPs)
        type Case = (Vec<Result<&'static str, bool>>, Vec<&'static str>, Vec<&'static str>);
        let cases: [Case; 7] = [
            (vec![Err(true), Ok("fd00::1")], vec!["10.1.0.9"], vec!["10.1.0.9", "fd00::1"]),
            (vec![Ok("10.0.0.1"), Err(false)], vec!["fd01::9"], vec!["10.0.0.1", "fd01::9"]),
            (vec![Ok("fd00::1"), Err(true)], vec!["10.1.0.9"], vec!["fd00::1", "10.1.0.9"]),
            // No pool of the family chosen: the pod goes without, as a new pod would.
            (vec![Err(true), Ok("fd00::1")], vec![], vec!["fd00::1"]),
            (vec![Ok("10.0.0.1"), Ok("fd00::1")], vec![], vec!["10.0.0.1", "fd00::1"]),
            // A family the claim did not hold comes after the claimed IPs.
            (vec![Ok("fd00::1")], vec!["10.1.0.9"], vec!["fd00::1", "10.1.0.9"]),
            (vec![Err(false), Ok("10.0.0.1")], vec!["fd01::9"], vec!["fd01::9", "10.0.0.1"]),
        ];
        for (slots, fresh, want) in cases {
            assert_eq!(fill_given_up(slots.clone(), fresh.clone(), v4), want, "{slots:?} + {fresh:?}");
        }
        // (slots, the families to allocate afresh: `true` IPv4)
        type Missing = (Vec<Result<&'static str, bool>>, Vec<bool>);
        let missing: [Missing; 5] = [
            (vec![Ok("10.0.0.1"), Ok("fd00::1")], vec![]),
            (vec![Ok("10.0.0.1")], vec![false]),
            (vec![Ok("fd00::1")], vec![true]),
            (vec![Err(true), Ok("fd00::1")], vec![true]),
            (vec![Err(true), Err(false)], vec![true, false]),
        ];
        for (slots, want) in missing {
            assert_eq!(missing_families(&slots, v4), want, "{slots:?}");
        }
        assert!(is_v4("10.0.0.1") && !is_v4("fd00::1"));
    }

    #[test]
    fn an_entry_is_superseded_only_by_another_sandbox_of_its_pod_on_its_interface() {
        let request = |container: &str, ifname: &str, network: &str, name: &str, uid: Option<&str>| AttachmentRequest {
            container_id: container.to_string(),
            ifname: ifname.to_string(),
            network: network.to_string(),
            cni_version: "1.1.0".to_string(),
            netns: None,
            pod: Some(crate::protocol::PodRef {
                namespace: "ns".to_string(),
                name: name.to_string(),
                uid: uid.map(String::from),
            }),
            prev_result: None,
            runtime_config_ips: None,
            args_ips: None,
            pools: Vec::new(),
        };
        let entry = CheckpointEntry {
            key: super::super::checkpoint::AttachmentKey {
                network: "net".into(),
                container_id: "old".into(),
                ifname: "eth0".into(),
            },
            pod: PodRef { namespace: "ns".into(), name: "web".into(), uid: "u1".into() },
            ips: Vec::new(),
            spare_record: None,
        };
        let cases = [
            // (request, superseded)
            (request("new", "eth0", "net", "web", Some("u1")), true),
            (request("old", "eth0", "net", "web", Some("u1")), false),
            (request("new", "net1", "net", "web", Some("u1")), false),
            (request("new", "eth0", "other", "web", Some("u1")), false),
            (request("new", "eth0", "net", "web", Some("u2")), false),
            (request("new", "eth0", "net", "other", Some("u1")), false),
            (request("new", "eth0", "net", "web", None), false),
            (request("new", "eth0", "net", "web", Some("")), false),
        ];
        for (request, expected) in cases {
            assert_eq!(superseded_by(&entry, &request), expected, "{request:?}");
        }
    }

    #[test]
    fn the_same_statefulset_ordinal_or_vm_is_the_same_workload() {
        let record = |name: &str, owner: Option<(&str, &str)>| Allocation {
            pod: PodRef { namespace: "ns".into(), name: name.into(), uid: "u".into() },
            node: "n".into(),
            network: "ipwarden".into(),
            container_id: "c".into(),
            interface: "eth0".into(),
            owner: owner.map(|(kind, name)| OwnerRef { kind: kind.into(), name: name.into() }),
            sticky: true,
            held_for: None,
            allocated_at: Time(Timestamp::UNIX_EPOCH),
            release_handshake: None,
            migration_target: None,
            repaired_at: None,
        };
        let sts = Some(("StatefulSet", "web"));
        assert!(same_workload(&record("web-0", sts), &record("web-0", sts)));
        assert!(!same_workload(&record("web-1", sts), &record("web-0", sts)));
        let vm = Some((KUBEVIRT_VMI_KIND, "vm1"));
        assert!(same_workload(&record("virt-launcher-vm1-a", vm), &record("virt-launcher-vm1-b", vm)));
        assert!(!same_workload(&record("virt-launcher-vm2-a", Some((KUBEVIRT_VMI_KIND, "vm2"))), &record("x", vm)));
    }
}
