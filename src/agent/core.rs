//! What the agent does for each CNI call, against the apiserver. Decisions come from the
//! pure modules (`pools`, `blocks`, `workload`, `ipam`); this file reads, writes and retries.
//!
//! Every block write is a compare-and-swap on a freshly read IPBlock, retried on conflict
//! with backon (bounded). Order on ADD: block record, then IPClaim, then checkpoint, so a
//! crash leaves at worst a record that the next ADD or DEL of the same sandbox finds; a step
//! that fails rolls back the block records this ADD wrote (`blocks::roll_back`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ipnet::IpNet;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, PostParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt};
use tokio::sync::Mutex;

use super::checkpoint::{AttachmentKey, Checkpoint, CheckpointEntry, CheckpointIp};
use super::metrics::{AgentMetrics, PoolLabels};
use crate::crd::{
    Allocation, ClaimedInterface, ClaimedIp, HandshakeState, IPBlock, IPBlockSpec, IPClaim, IPClaimSpec, IPPool,
    MigrationTarget, OwnerRef, POOL_ANNOTATION, PodRef, ReleaseHandshake, Takeover,
};
use crate::gc::handshake::{AgentAnswer, ClaimedRecord, PodOnNode, ReclaimStep, agent_answer, reclaim_step};
use crate::ipam::blocks::{self, ReleaseOutcome};
use crate::ipam::pools::{self, PodPlacement, PoolSet};
use crate::ipam::workload::{self, KUBEVIRT_VMI_KIND};
use crate::ipam::{BlockUsage, ChooseError, PoolLayout, choose_ip};
use crate::protocol::{AttachmentRequest, CniError, GcRequest, IpConfig, IpamResult, Route, StatusRequest};

/// ipwarden's own CNI error code: no pool fits the pod.
pub const NO_POOL_FITS: u32 = 100;

/// ipwarden's own CNI error code: every IP of the chosen pool is taken.
pub const POOL_EXHAUSTED: u32 = 101;

/// ipwarden's own CNI error code: the pod's IPClaim names an object that does not hold the
/// claimed IP's record (a hand-edited claim); the claim must be fixed or deleted.
pub const INVALID_CLAIM: u32 = 102;

/// What the message of an ADD waiting for a sticky takeover starts with (and its metric
/// label is found by).
const AWAITING_TAKEOVER: &str = "awaiting a sticky takeover";

/// How many times a block write is retried after resourceVersion conflicts.
const MAX_CONFLICT_RETRIES: usize = 40;

/// How many not-yet-created blocks of a pool one ADD may try.
const NEW_BLOCK_PROBES: usize = 8;

/// The agent's settings that shape allocation.
#[derive(Clone, Debug)]
pub struct Settings {
    /// This node's name.
    pub node: String,
    /// How long a released IP is not handed out again.
    pub cooldown: Duration,
    /// Owner kinds whose pods keep their IPs between pods.
    pub sticky_kinds: Vec<String>,
    /// How long a sandbox still attached on the node holds a record marked for release
    /// before its DEL counts as lost.
    pub sandbox_grace: Duration,
}

/// The agent's state: caches, the checkpoint, and the client.
pub struct Core {
    client: Client,
    settings: Settings,
    pools: Store<IPPool>,
    blocks: Store<IPBlock>,
    checkpoint: Mutex<Checkpoint>,
    metrics: Arc<AgentMetrics>,
}

fn api_error(what: String) -> impl FnOnce(kube::Error) -> CniError {
    move |e| CniError::try_again_later(format!("{what}: {e}"))
}

fn checkpoint_error(e: super::checkpoint::CheckpointError) -> CniError {
    CniError::io_failure(e.to_string())
}

/// A record this ADD wrote, and what its IP held before, so that a failed ADD can undo it.
struct Written {
    /// The IP as the CNI result and the checkpoint carry it.
    ip: CheckpointIp,
    /// What the IP held before the write.
    prior: blocks::Prior,
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
    /// Attached as a live migration's target instead of taken over (the claim stays as is).
    shared: bool,
}

/// An IPClaim as an ADD wrote it, and the spec it replaced (`None`: the ADD created it).
struct ClaimWrite {
    namespace: String,
    name: String,
    before: Option<IPClaimSpec>,
}

/// A pool resolved for allocation.
struct ResolvedPool {
    name: String,
    layout: PoolLayout,
    gateway: Option<String>,
    /// Being deleted: it hands out nothing, and a sticky pod does not get its IP back.
    deleting: bool,
}

impl Core {
    /// Creates the core over synced caches and a restored checkpoint.
    pub fn new(
        client: Client,
        settings: Settings,
        pools: Store<IPPool>,
        blocks: Store<IPBlock>,
        checkpoint: Checkpoint,
        metrics: Arc<AgentMetrics>,
    ) -> Self {
        Self { client, settings, pools, blocks, checkpoint: Mutex::new(checkpoint), metrics }
    }

    /// CNI ADD: the sandbox's IPs, allocated once (idempotent for the same attachment).
    pub async fn add(&self, request: &AttachmentRequest) -> Result<IpamResult, CniError> {
        let started = Instant::now();
        let outcome = self.add_inner(request).await;
        self.metrics.allocation_duration.observe(started.elapsed().as_secs_f64());
        let label = match &outcome {
            Ok(_) => "success",
            Err(e) if e.code == POOL_EXHAUSTED => "exhausted",
            Err(e) if e.code == NO_POOL_FITS => "no_pool",
            Err(e) if e.code == INVALID_CLAIM => "invalid_claim",
            // Before "cooling": the takeover message names pods and nodes, which may contain it.
            Err(e) if e.code == CniError::TRY_AGAIN_LATER && e.msg.starts_with(AWAITING_TAKEOVER) => {
                "awaiting_takeover"
            }
            Err(e) if e.code == CniError::TRY_AGAIN_LATER && e.msg.contains("cooling") => "cooling",
            Err(_) => "error",
        };
        self.metrics.allocation(label);
        if let Err(e) = &outcome {
            tracing::warn!(container_id = %request.container_id, code = e.code, error = %e.msg, "ADD failed");
        }
        outcome
    }

    async fn add_inner(&self, request: &AttachmentRequest) -> Result<IpamResult, CniError> {
        let key = attachment_key(request);
        let mut checkpoint = self.checkpoint.lock().await;
        if let Some(entry) = checkpoint.get(&key) {
            return Ok(result_of(&entry.ips));
        }
        let pod_ref = request.pod.as_ref().ok_or_else(|| {
            CniError::invalid_environment("ADD needs the pod: CNI_ARGS must carry K8S_POD_NAMESPACE and K8S_POD_NAME")
        })?;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &pod_ref.namespace);
        let pod = pods
            .get_opt(&pod_ref.name)
            .await
            .map_err(api_error(format!("reading pod {}/{}", pod_ref.namespace, pod_ref.name)))?
            .ok_or_else(|| {
                CniError::try_again_later(format!("pod {}/{} does not exist (yet)", pod_ref.namespace, pod_ref.name))
            })?;
        let uid = pod.uid().unwrap_or_default();
        if let Some(expected) = pod_ref.uid.as_deref()
            && expected != uid
        {
            return Err(CniError::unknown_container(format!(
                "pod {}/{} now has uid {uid}, the runtime asked for {expected}: the sandbox is stale",
                pod_ref.namespace, pod_ref.name
            )));
        }
        let owner = workload::controller_of(&pod);
        let sticky = workload::is_sticky(owner.as_ref(), &self.settings.sticky_kinds);
        let found = self.records_of_sandbox(&request.container_id, &request.ifname);
        let migration = if sticky { self.active_migration(&pod, owner.as_ref()).await? } else { None };
        let (ips, written, shares) = if !found.is_empty() {
            // Written before a crash that lost the answer: the same sandbox adopts them. They
            // are not this call's writes, so a failure below leaves them to the sandbox's DEL.
            let ips = self.checkpoint_ips(found.into_iter().map(|(block, ip, pool)| (pool, block, ip)).collect());
            (ips, Vec::new(), migration.is_some())
        } else {
            let reclaimed = if sticky {
                let held_here: BTreeSet<String> =
                    checkpoint.entries().flat_map(|e| e.ips.iter().map(|i| i.ip.clone())).collect();
                self.reclaim_sticky(&pod, owner.as_ref(), migration.as_deref(), request, &held_here).await?
            } else {
                None
            };
            match reclaimed {
                Some(reclaimed) => (reclaimed.ips, reclaimed.written, reclaimed.shared),
                None => {
                    let written = self.allocate(&pod, owner.as_ref(), sticky, request, None).await?;
                    (written.iter().map(|w| w.ip.clone()).collect(), written, false)
                }
            }
        };
        // A live migration's target shares the source's IPs; the claim stays bound to the
        // source until the source's sandbox leaves them to the target.
        let claim = if shares {
            None
        } else {
            match self.write_claim(&pod, owner.as_ref(), sticky, &request.ifname, &ips).await {
                Ok(claim) => Some(claim),
                Err(e) => {
                    self.roll_back(&written, request, &uid).await;
                    return Err(e);
                }
            }
        };
        let entry = CheckpointEntry {
            key,
            pod: PodRef { namespace: pod_ref.namespace.clone(), name: pod_ref.name.clone(), uid: uid.clone() },
            ips: ips.clone(),
        };
        if let Err(e) = checkpoint.insert(entry) {
            if let Some(claim) = claim.as_ref().filter(|_| !written.is_empty()) {
                self.restore_claim(claim, &uid).await;
            }
            self.roll_back(&written, request, &uid).await;
            return Err(checkpoint_error(e));
        }
        tracing::info!(pod = %format!("{}/{}", pod_ref.namespace, pod_ref.name), container_id = %request.container_id,
            ips = ?ips.iter().map(|i| i.ip.as_str()).collect::<Vec<_>>(), "allocated");
        Ok(result_of(&ips))
    }

    fn resolve_pool(&self, name: &str) -> Option<ResolvedPool> {
        let pool = self.pools.state().into_iter().find(|p| p.name_any() == name)?;
        let layout = pools::layout(&pool.spec).ok()?;
        Some(ResolvedPool {
            name: name.to_string(),
            layout,
            gateway: pool.spec.gateway.clone(),
            deleting: pool.metadata.deletion_timestamp.is_some(),
        })
    }

    fn checkpoint_ips(&self, found: Vec<(String, String, String)>) -> Vec<CheckpointIp> {
        found
            .into_iter()
            .map(|(pool, block, ip)| {
                let resolved = self.resolve_pool(&pool);
                CheckpointIp {
                    prefix_len: resolved.as_ref().map(|p| p.layout.cidr().prefix_len()).unwrap_or(32),
                    gateway: resolved.and_then(|p| p.gateway),
                    ip,
                    pool,
                    block,
                }
            })
            .collect()
    }

    /// (block name, ip, pool) of every record of this node's sandbox, from the cache.
    fn records_of_sandbox(&self, container_id: &str, ifname: &str) -> Vec<(String, String, String)> {
        let node = &self.settings.node;
        self.blocks
            .state()
            .iter()
            .flat_map(|block| {
                blocks::find_attachment(&block.spec, container_id, ifname)
                    .into_iter()
                    .filter(|ip| {
                        block.spec.allocations.get(ip).is_some_and(|a| {
                            a.node == *node || a.migration_target.as_ref().is_some_and(|t| t.node == *node)
                        })
                    })
                    .map(|ip| (block.name_any(), ip, block.spec.pool.clone()))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    fn record_for(&self, pod: &Pod, owner: Option<&OwnerRef>, sticky: bool, request: &AttachmentRequest) -> Allocation {
        Allocation {
            pod: PodRef {
                namespace: pod.namespace().unwrap_or_default(),
                name: pod.name_any(),
                uid: pod.uid().unwrap_or_default(),
            },
            node: self.settings.node.clone(),
            network: request.network.clone(),
            container_id: request.container_id.clone(),
            interface: request.ifname.clone(),
            owner: owner.cloned(),
            sticky,
            allocated_at: Time(Timestamp::now()),
            release_handshake: None,
            migration_target: None,
            repaired_at: None,
        }
    }

    /// The UID of the live migration `pod` is the target of, if that migration of its VM
    /// instance exists and still runs ([`workload::is_active_migration_target`]).
    async fn active_migration(&self, pod: &Pod, owner: Option<&OwnerRef>) -> Result<Option<String>, CniError> {
        let Some(job) = workload::migration_job_of(pod) else { return Ok(None) };
        let namespace = pod.namespace().unwrap_or_default();
        let resource =
            ApiResource::from_gvk(&GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstanceMigration"));
        let api: Api<DynamicObject> = Api::namespaced_with(self.client.clone(), &namespace, &resource);
        let migrations = match api.list(&ListParams::default()).await {
            Ok(list) => list.items,
            Err(kube::Error::Api(status)) if status.code == 404 => Vec::new(),
            Err(e) => return Err(api_error(format!("listing VirtualMachineInstanceMigrations in {namespace}"))(e)),
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
    /// still names a sandbox that may be attached (on another node, or in `held_here`, the IPs
    /// of this node's checkpoint) is not shared: the record is marked for a sticky takeover and
    /// the ADD fails with "try again later" until the record's node has let go of it
    /// ([`reclaim_step`]).
    async fn reclaim_sticky(
        &self,
        pod: &Pod,
        owner: Option<&OwnerRef>,
        migration: Option<&str>,
        request: &AttachmentRequest,
        held_here: &BTreeSet<String>,
    ) -> Result<Option<Reclaimed>, CniError> {
        let namespace = pod.namespace().unwrap_or_default();
        let claim_name = workload::claim_name(&pod.name_any(), owner);
        let claims: Api<IPClaim> = Api::namespaced(self.client.clone(), &namespace);
        let Some(claim) = claims
            .get_opt(&claim_name)
            .await
            .map_err(api_error(format!("reading IPClaim {namespace}/{claim_name}")))?
        else {
            return Ok(None);
        };
        let Some(interface) = claim.spec.interfaces.iter().find(|i| i.interface == request.ifname) else {
            return Ok(None);
        };
        // Checked before anything is written: the claim is user-writable, the blocks are not.
        for claimed in &interface.ips {
            let (Some(pool), Ok(ip)) = (self.resolve_pool(&claimed.pool), claimed.ip.parse::<IpAddr>()) else {
                continue;
            };
            let Some(block) = pool.layout.block_of(ip) else { continue };
            pools::check_claimed_block(&pool.name, block, ip, &claimed.block).map_err(|e| {
                CniError::new(
                    INVALID_CLAIM,
                    format!(
                        "IPClaim {namespace}/{claim_name} of pod {} is refused: {e}; fix or delete the claim",
                        pod.name_any()
                    ),
                )
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
        // One slot per claimed IP, in the claim's order; `Err(is IPv4)`: given up, allocated
        // afresh.
        let (mut slots, mut taken, mut shared) = (Vec::new(), Vec::new(), false);
        for claimed in &interface.ips {
            let (Some(pool), Ok(ip)) = (self.resolve_pool(&claimed.pool), claimed.ip.parse::<IpAddr>()) else {
                break;
            };
            // A pool being deleted hands out no new IP, so a restarted pod gives up its IP
            // there (only that family's); a live migration's target still attaches to the IP
            // its source holds, which is not a new one.
            if pool.deleting && target.is_none() {
                slots.push(Err(is_v4(&claimed.ip)));
                continue;
            }
            let Some(block) = pool.layout.block_of(ip) else { break };
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
                        let free = pool.layout.is_allocatable(ip);
                        return free.then(|| Reclaim::Taken(blocks::allocate(spec, ip, record.clone())));
                    };
                    let step = reclaim_step(ClaimedRecord {
                        same_pod: current.pod.uid == record.pod.uid,
                        same_workload: same_workload(current, &record),
                        attached: blocks::may_be_attached(current),
                        detached_here: current.node == self.settings.node && !held_here.contains(&key),
                        handshake: current.release_handshake.as_ref().map(|h| h.state),
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
                return Err(CniError::try_again_later(format!(
                    "{AWAITING_TAKEOVER}: sticky IP {ip} of pod {namespace}/{} is still attached to sandbox {} of pod {}/{} (uid {}) on node {}; it is taken over once that node's agent lets go of it",
                    pod.name_any(),
                    holder.container_id,
                    holder.pod.namespace,
                    holder.pod.name,
                    holder.pod.uid,
                    holder.node
                )));
            }
            let Some(took) = took else {
                tracing::warn!(claim = %claim_name, ip = %claimed.ip, "claimed IP is held by another pod; allocating afresh");
                break;
            };
            let ip = CheckpointIp {
                ip: claimed.ip.clone(),
                prefix_len: pool.layout.cidr().prefix_len(),
                gateway: pool.gateway.clone(),
                pool: pool.name.clone(),
                block: claimed.block.clone(),
            };
            match took {
                Reclaim::Taken(prior) => taken.push(Written { ip: ip.clone(), prior }),
                Reclaim::Attached => {
                    shared = true;
                    taken.push(Written { ip: ip.clone(), prior: blocks::Prior::Attached });
                }
                // A mark always sets `waiting_for`, which returned above.
                Reclaim::Marked => break,
            }
            slots.push(Ok(ip));
        }
        let given_up: Vec<bool> = slots.iter().filter_map(|slot| slot.as_ref().err().copied()).collect();
        // Unless every IP was given up (or one could not be taken back): then the pod is
        // allocated afresh, as a new pod is.
        if slots.len() == interface.ips.len() && given_up.len() < slots.len() {
            let mut fresh = Vec::new();
            if !given_up.is_empty() {
                match self.allocate(pod, owner, true, request, Some(&given_up)).await {
                    Ok(written) => {
                        fresh = written.iter().map(|w| w.ip.clone()).collect();
                        taken.extend(written);
                    }
                    Err(e) => {
                        self.roll_back(&taken, request, &record.pod.uid).await;
                        return Err(e);
                    }
                }
            }
            let ips = fill_given_up(slots, fresh, |ip| is_v4(&ip.ip));
            let given_up = given_up.len();
            tracing::info!(claim = %claim_name, migration_target = shared, given_up, "sticky IPs reclaimed for the pod");
            return Ok(Some(Reclaimed { ips, written: taken, shared }));
        }
        // The IPs already taken go back to the records they were taken from.
        self.roll_back(&taken, request, &record.pod.uid).await;
        Ok(None)
    }

    /// Allocates one IP from each pool the pod should use, all or none: when one pool has
    /// no IP, the IPs already taken from the others are rolled back. `families` (`true`:
    /// IPv4) limits it to the pools of those IP families: a sticky pod's IPs given up in a
    /// pool being deleted.
    async fn allocate(
        &self,
        pod: &Pod,
        owner: Option<&OwnerRef>,
        sticky: bool,
        request: &AttachmentRequest,
        families: Option<&[bool]>,
    ) -> Result<Vec<Written>, CniError> {
        let namespace_name = pod.namespace().unwrap_or_default();
        let pools_snapshot = self.pools.state();
        let pool_set = PoolSet::of(&pools_snapshot, &self.blocks.state());
        let views = pool_set.views();
        let namespace = Api::<Namespace>::all(self.client.clone())
            .get_opt(&namespace_name)
            .await
            .map_err(api_error(format!("reading namespace {namespace_name}")))?;
        let namespace_labels = namespace.as_ref().map(|n| n.labels().clone()).unwrap_or_default();
        let node_labels = if pools_snapshot.iter().any(|p| p.spec.node_selector.is_some()) {
            Api::<Node>::all(self.client.clone())
                .get_opt(&self.settings.node)
                .await
                .map_err(api_error(format!("reading node {}", self.settings.node)))?
                .map(|n| n.labels().clone())
                .unwrap_or_default()
        } else {
            BTreeMap::new()
        };
        let placement = PodPlacement {
            pod_annotation: pod.annotations().get(POOL_ANNOTATION).map(String::as_str),
            namespace_annotation: namespace
                .as_ref()
                .and_then(|n| n.annotations().get(POOL_ANNOTATION))
                .map(String::as_str),
            namespace_labels: &namespace_labels,
            node_labels: &node_labels,
        };
        let chosen = pools::select(&views, pool_set.orphans(), &placement).map_err(|e| {
            CniError::new(NO_POOL_FITS, format!("no pool for pod {namespace_name}/{}: {e}", pod.name_any()))
        })?;
        let record = self.record_for(pod, owner, sticky, request);
        let mut written = Vec::new();
        for view in chosen {
            let Ok(layout) = view.layout else { continue };
            if families.is_some_and(|f| !f.contains(&layout.family_is_v4())) {
                continue;
            }
            let pool = ResolvedPool {
                name: view.name.to_string(),
                layout: layout.clone(),
                gateway: view.spec.gateway.clone(),
                deleting: view.deleting,
            };
            match self.allocate_in_pool(&pool, &record).await {
                Ok(ip) => written.push(ip),
                Err(e) => {
                    self.roll_back(&written, request, &record.pod.uid).await;
                    return Err(e);
                }
            }
        }
        Ok(written)
    }

    async fn allocate_in_pool(&self, pool: &ResolvedPool, record: &Allocation) -> Result<Written, CniError> {
        let mut known: Vec<(String, IpNet)> = self
            .blocks
            .state()
            .iter()
            .filter(|b| b.spec.pool == pool.name)
            .filter_map(|b| Some((b.name_any(), b.spec.cidr.parse().ok()?)))
            // A block written under an earlier layout of a pool of this name is orphaned.
            .filter(|(_, net)| pool.layout.is_block(*net))
            .collect();
        known.sort();
        // Agents start at different blocks so they rarely write the same one.
        if !known.is_empty() {
            let offset = node_hash(&self.settings.node) % known.len();
            known.rotate_left(offset);
        }
        let known_nets: BTreeSet<IpNet> = known.iter().map(|(_, net)| *net).collect();
        let fresh = pool
            .layout
            .blocks()
            .filter(|net| !known_nets.contains(net))
            .take(NEW_BLOCK_PROBES)
            .map(|net| (pools::block_name(&pool.name, net), net));
        let candidates: Vec<(String, IpNet)> = known.into_iter().chain(fresh).collect();
        let mut cooling = 0usize;
        let mut next_free: Option<Timestamp> = None;
        for (name, net) in candidates {
            let now = Timestamp::now();
            let chosen = self
                .write_block(&name, &pool.name, net, |spec| {
                    let (allocated, released) = blocks::usage(spec);
                    let usage = BlockUsage { allocated: &allocated, released: &released };
                    match choose_ip(&pool.layout, net, usage, now, self.settings.cooldown) {
                        Ok(ip) => Some((ip, blocks::allocate(spec, ip, record.clone()))),
                        Err(ChooseError::Cooling { cooling: count, next_free_at, .. }) => {
                            cooling += count;
                            next_free = Some(next_free.map_or(next_free_at, |t| t.min(next_free_at)));
                            None
                        }
                        Err(_) => None,
                    }
                })
                .await?;
            if let Some((ip, prior)) = chosen {
                let ip = CheckpointIp {
                    ip: ip.to_string(),
                    prefix_len: pool.layout.cidr().prefix_len(),
                    gateway: pool.gateway.clone(),
                    pool: pool.name.clone(),
                    block: name,
                };
                return Ok(Written { ip, prior });
            }
        }
        self.metrics.pool_exhausted.get_or_create(&PoolLabels { pool: pool.name.clone() }).inc();
        if cooling > 0 {
            let when = next_free.map(|t| t.to_string()).unwrap_or_default();
            return Err(CniError::try_again_later(format!(
                "pool {} has no free IP now: {cooling} released IPs are cooling down before reuse; the first is free at {when}",
                pool.name
            )));
        }
        Err(CniError::new(POOL_EXHAUSTED, format!("pool {} is exhausted: every IP is allocated", pool.name)))
    }

    /// Applies `mutate` to a fresh copy of block `name` and writes it with its
    /// resourceVersion (creating the block when it does not exist), retrying on conflict.
    /// `mutate` returning `None` means nothing to write.
    async fn write_block<T>(
        &self,
        name: &str,
        pool: &str,
        cidr: IpNet,
        mut mutate: impl FnMut(&mut IPBlockSpec) -> Option<T>,
    ) -> Result<Option<T>, CniError> {
        let api: Api<IPBlock> = Api::all(self.client.clone());
        let mut delays =
            crate::retry::conflict_delays(Duration::from_millis(5), Duration::from_millis(250), MAX_CONFLICT_RETRIES);
        loop {
            let current = api.get_opt(name).await.map_err(api_error(format!("reading IPBlock {name}")))?;
            let written = match current {
                None => {
                    let mut spec =
                        IPBlockSpec { pool: pool.to_string(), cidr: cidr.to_string(), ..IPBlockSpec::default() };
                    let Some(out) = mutate(&mut spec) else { return Ok(None) };
                    api.create(&PostParams::default(), &IPBlock::new(name, spec)).await.map(|_| out)
                }
                Some(mut block) => {
                    let Some(out) = mutate(&mut block.spec) else { return Ok(None) };
                    api.replace(name, &PostParams::default(), &block).await.map(|_| out)
                }
            };
            match written {
                Ok(out) => return Ok(Some(out)),
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    self.metrics.conflict_retries.inc();
                    let Some(delay) = delays.next() else {
                        return Err(CniError::try_again_later(format!(
                            "IPBlock {name} kept changing under {MAX_CONFLICT_RETRIES} writes; try again"
                        )));
                    };
                    tokio::time::sleep(delay).await;
                }
                Err(e) => return Err(api_error(format!("writing IPBlock {name}"))(e)),
            }
        }
    }

    /// Records the pod's IPs of `ifname` in its IPClaim (created, or taken over from a
    /// previous pod of the same name, keeping a sticky predecessor's other interfaces);
    /// returns what it replaced, for [`Core::restore_claim`].
    async fn write_claim(
        &self,
        pod: &Pod,
        owner: Option<&OwnerRef>,
        sticky: bool,
        ifname: &str,
        ips: &[CheckpointIp],
    ) -> Result<ClaimWrite, CniError> {
        let namespace = pod.namespace().unwrap_or_default();
        let uid = pod.uid().unwrap_or_default();
        let name = workload::claim_name(&pod.name_any(), owner);
        let api: Api<IPClaim> = Api::namespaced(self.client.clone(), &namespace);
        let what = format!("writing IPClaim {namespace}/{name}");
        for _ in 0..MAX_CONFLICT_RETRIES {
            let existing = api.get_opt(&name).await.map_err(api_error(what.clone()))?;
            let interface = ClaimedInterface {
                interface: ifname.to_string(),
                ips: ips
                    .iter()
                    .map(|i| ClaimedIp { ip: i.ip.clone(), pool: i.pool.clone(), block: i.block.clone() })
                    .collect(),
            };
            let interfaces = workload::claim_interfaces(existing.as_ref().map(|c| &c.spec), &uid, sticky, interface);
            let spec = IPClaimSpec {
                pod_uid: uid.clone(),
                node: self.settings.node.clone(),
                owner: owner.cloned(),
                sticky,
                interfaces,
                bound_at: Time(Timestamp::now()),
            };
            let written = match existing {
                Some(mut claim) => {
                    let before = std::mem::replace(&mut claim.spec, spec);
                    api.replace(&name, &PostParams::default(), &claim).await.map(|_| Some(before))
                }
                None => {
                    let mut claim = IPClaim::new(&name, spec);
                    claim.metadata.namespace = Some(namespace.clone());
                    api.create(&PostParams::default(), &claim).await.map(|_| None)
                }
            };
            match written {
                Ok(before) => return Ok(ClaimWrite { namespace, name, before }),
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                Err(e) => return Err(api_error(what)(e)),
            }
        }
        Err(CniError::try_again_later(format!("{what}: it kept changing")))
    }

    /// Undoes this ADD's block writes after a later step failed ([`blocks::roll_back`]):
    /// the runtime got no IP, and its retry is a new sandbox, so nothing may stay behind. A
    /// rollback that cannot be written is left to the sandbox's DEL and the GC.
    async fn roll_back(&self, written: &[Written], request: &AttachmentRequest, uid: &str) {
        for Written { ip, prior } in written {
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
                    tracing::warn!(ip = %ip.ip, error = %e.msg, "rolling back a failed ADD failed; the sandbox's DEL or the GC will release it");
                }
            }
        }
    }

    /// Puts the IPClaim an ADD wrote back as it was (deleted when the ADD created it), if it
    /// still names `uid`. A restore that fails is logged: the claim janitor, and the next
    /// ADD of the pod, mend the claim.
    async fn restore_claim(&self, claim: &ClaimWrite, uid: &str) {
        let api: Api<IPClaim> = Api::namespaced(self.client.clone(), &claim.namespace);
        let restored = match &claim.before {
            None => crate::claim_writes::delete_if_bound_to(&self.client, &claim.namespace, &claim.name, uid)
                .await
                .map(drop),
            Some(before) => match api.get_opt(&claim.name).await {
                Ok(Some(mut current)) if current.spec.pod_uid == uid => {
                    current.spec = before.clone();
                    api.replace(&claim.name, &PostParams::default(), &current).await.map(drop)
                }
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            },
        };
        if let Err(e) = restored {
            tracing::warn!(claim = %format!("{}/{}", claim.namespace, claim.name), error = %e, "restoring the claim of a failed ADD failed");
        }
    }

    /// CNI DEL: releases the sandbox's IPs (keeping a wanted sticky reservation). Unknown
    /// sandboxes and repeated DELs succeed.
    pub async fn del(&self, request: &AttachmentRequest) -> Result<(), CniError> {
        let key = attachment_key(request);
        let mut checkpoint = self.checkpoint.lock().await;
        let entry = checkpoint.get(&key).cloned();
        let uid =
            request.pod.as_ref().and_then(|p| p.uid.clone()).or_else(|| entry.as_ref().map(|e| e.pod.uid.clone()));
        self.release_attachment(entry.as_ref(), &request.container_id, &request.ifname, uid.as_deref()).await?;
        checkpoint.remove(&key).map_err(checkpoint_error)?;
        Ok(())
    }

    async fn release_attachment(
        &self,
        entry: Option<&CheckpointEntry>,
        container_id: &str,
        ifname: &str,
        uid: Option<&str>,
    ) -> Result<(), CniError> {
        let mut targets: BTreeMap<(String, String), String> = BTreeMap::new();
        for ip in entry.iter().flat_map(|e| e.ips.iter()) {
            targets.insert((ip.block.clone(), ip.ip.clone()), ip.pool.clone());
        }
        for (block, ip, pool) in self.records_of_sandbox(container_id, ifname) {
            targets.insert((block, ip), pool);
        }
        let ips: Vec<CheckpointIp> = targets
            .into_iter()
            .map(|((block, ip), pool)| CheckpointIp { ip, prefix_len: 0, gateway: None, pool, block })
            .collect();
        let summary = self.release_ips(&ips, container_id, ifname, uid).await;
        // Only the claim of a record this sandbox really released: a superseded sandbox's
        // records and claim belong to the new pod now (leftover claims are the janitor's).
        if let (false, Some(claim)) = (summary.kept, summary.claim) {
            self.delete_claim_of(&claim).await;
        }
        Ok(())
    }

    /// Releases `ips` of a sandbox; says whether any was kept as a sticky reservation and
    /// which claim (namespace, claim name, pod UID) the released records belong to, taken
    /// from the record the compare-and-swap actually released, never from an earlier read.
    async fn release_ips(
        &self,
        ips: &[CheckpointIp],
        container_id: &str,
        ifname: &str,
        uid: Option<&str>,
    ) -> ReleaseSummary {
        let mut summary = ReleaseSummary::default();
        for target in ips {
            let found = match Api::<IPBlock>::all(self.client.clone()).get_opt(&target.block).await {
                Ok(Some(block)) => block
                    .spec
                    .cidr
                    .parse::<IpNet>()
                    .ok()
                    .zip(block.spec.allocations.get(&target.ip).cloned().map(|r| (r, self.retired(&block.spec)))),
                Ok(None) => None,
                Err(e) => {
                    tracing::warn!(block = %target.block, error = %e, "reading block for release failed");
                    None
                }
            };
            let Some((net, (record, retired))) = found else { continue };
            // The records of a pool being deleted, or of an orphaned block, are released at
            // once: no sticky reservation outlives its pod there.
            let keep = record.sticky && !retired && self.owner_wants(&record).await;
            let now = Timestamp::now();
            let outcome = self
                .write_block(&target.block, &target.pool, net, |spec| {
                    let claim = spec.allocations.get(&target.ip).map(|r| PodRef {
                        namespace: r.pod.namespace.clone(),
                        name: workload::claim_name(&r.pod.name, r.owner.as_ref()),
                        uid: r.pod.uid.clone(),
                    });
                    match blocks::release_attachment(spec, &target.ip, container_id, ifname, uid, keep, now) {
                        ReleaseOutcome::NotOurs => None,
                        outcome => Some((outcome, claim, spec.allocations.get(&target.ip).cloned())),
                    }
                })
                .await;
            match outcome {
                Ok(Some((ReleaseOutcome::Released, claim, _))) => {
                    summary.claim = claim;
                    self.metrics.release("released");
                }
                Ok(Some((ReleaseOutcome::Reserved, _, _))) => {
                    summary.kept = true;
                    self.metrics.release("reserved");
                }
                Ok(Some((ReleaseOutcome::HandedOver, claim, holder))) => {
                    summary.kept = true;
                    if let (Some(claim), Some(holder)) = (claim, holder) {
                        self.rebind_claim(&claim, &holder).await;
                    }
                    self.metrics.release("handed_over");
                }
                Ok(Some((ReleaseOutcome::Detached, _, _))) => {
                    summary.kept = true;
                    self.metrics.release("handed_over");
                }
                Ok(_) => {}
                Err(e) => {
                    self.metrics.release("error");
                    tracing::warn!(ip = %target.ip, error = %e.msg, "release failed; the GC will reclaim it");
                }
            }
        }
        summary
    }

    /// Whether `block`'s records are retired ([`pools::block_is_retired`]), by the cached pool
    /// it names.
    fn retired(&self, block: &IPBlockSpec) -> bool {
        let pool = self.pools.get(&ObjectRef::new(&block.pool));
        pools::block_is_retired(
            pool.as_deref().map(|p| (&p.spec, p.metadata.deletion_timestamp.is_some())),
            &block.cidr,
        )
    }

    /// Whether the workload of a sticky record still wants its IP, read live
    /// ([`crate::owners`]). Unknown answers (API errors) count as "wants": keeping a
    /// reservation is safe, freeing one is not.
    async fn owner_wants(&self, record: &Allocation) -> bool {
        crate::owners::record_owner_wants(&self.client, record).await
    }

    /// Binds claim `claim.name`, while still bound to `claim.uid`, to the pod and node of
    /// `holder`: the live migration's target that inherited the VM's IPs.
    async fn rebind_claim(&self, claim: &PodRef, holder: &Allocation) {
        let rebound = crate::claim_writes::rebind_if_bound_to(
            &self.client,
            &claim.namespace,
            &claim.name,
            &claim.uid,
            &holder.pod.uid,
            &holder.node,
        )
        .await;
        if let Err(e) = rebound {
            tracing::warn!(claim = %claim.name, error = %e, "claim not rebound to the migration's target");
        }
    }

    /// Deletes claim `claim.name` in `claim.namespace` if it is still bound to `claim.uid`.
    async fn delete_claim_of(&self, claim: &PodRef) {
        let deleted =
            crate::claim_writes::delete_if_bound_to(&self.client, &claim.namespace, &claim.name, &claim.uid).await;
        if let Err(e) = deleted {
            tracing::debug!(claim = %claim.name, error = %e, "claim not deleted; the claim janitor will");
        }
    }

    /// CNI CHECK: the sandbox's records still exist (read fresh from the blocks) and hold
    /// the IPs the runtime has.
    pub async fn check(&self, request: &AttachmentRequest) -> Result<(), CniError> {
        let entry = self.checkpoint.lock().await.get(&attachment_key(request)).cloned();
        let mut targets: BTreeSet<(String, String)> =
            entry.iter().flat_map(|e| e.ips.iter()).map(|ip| (ip.block.clone(), ip.ip.clone())).collect();
        targets.extend(
            self.records_of_sandbox(&request.container_id, &request.ifname).into_iter().map(|(b, ip, _)| (b, ip)),
        );
        let api: Api<IPBlock> = Api::all(self.client.clone());
        let mut found = BTreeSet::new();
        for (block, ip) in targets {
            let fresh = api.get_opt(&block).await.map_err(api_error(format!("reading IPBlock {block}")))?;
            let held = fresh.and_then(|b| b.spec.allocations.get(&ip).cloned());
            let uid = entry.as_ref().map(|e| e.pod.uid.as_str());
            if held.is_some_and(|r| {
                blocks::holds_sandbox(&r, &request.container_id, &request.ifname) || blocks::adopted_by(&r, uid)
            }) {
                found.insert(ip);
            }
        }
        if found.is_empty() {
            return Err(CniError::unknown_container(format!(
                "no IP is recorded for container {} interface {}",
                request.container_id, request.ifname
            )));
        }
        let expected: BTreeSet<String> = request
            .prev_result
            .as_ref()
            .and_then(|r| r.get("ips"))
            .and_then(|ips| ips.as_array())
            .into_iter()
            .flatten()
            .filter_map(|ip| ip.get("address").and_then(|a| a.as_str()))
            .map(|cidr| cidr.split('/').next().unwrap_or(cidr).to_string())
            .collect();
        if expected != found {
            return Err(CniError::new(
                CniError::INVALID_NETWORK_CONFIG,
                format!("container {} holds {found:?} but its prevResult says {expected:?}", request.container_id),
            ));
        }
        Ok(())
    }

    /// CNI GC: releases every attachment of the network that the runtime no longer lists.
    pub async fn gc(&self, request: &GcRequest) -> Result<(), CniError> {
        let valid: BTreeSet<(&str, &str)> =
            request.valid_attachments.iter().map(|a| (a.container_id.as_str(), a.ifname.as_str())).collect();
        let mut checkpoint = self.checkpoint.lock().await;
        let stale: Vec<CheckpointEntry> = checkpoint
            .entries()
            .filter(|e| e.key.network == request.network)
            .filter(|e| !valid.contains(&(e.key.container_id.as_str(), e.key.ifname.as_str())))
            .cloned()
            .collect();
        for entry in stale {
            tracing::info!(container_id = %entry.key.container_id, pod = %entry.pod.name, "GC: releasing a stale attachment");
            self.release_attachment(Some(&entry), &entry.key.container_id, &entry.key.ifname, Some(&entry.pod.uid))
                .await?;
            checkpoint.remove(&entry.key).map_err(checkpoint_error)?;
        }
        Ok(())
    }

    /// CNI STATUS: ready once any IPPool exists. STATUS gates the node's readiness
    /// (containerd reports the network not ready on an error, and kubelet marks the node
    /// NotReady, whose pods are evicted), so a pool that is full, disabled or being deleted
    /// fails the ADDs that would use it, one by one, and never the node (decision 0008).
    pub async fn status(&self, _request: &StatusRequest) -> Result<(), CniError> {
        if self.pools.state().is_empty() {
            return Err(CniError::plugin_not_available("no IPPool exists: create one (docs/operations.md)"));
        }
        Ok(())
    }

    /// Start-up GC, before the agent serves CNI: releases this node's records that no local
    /// pod holds. A record is in use when its pod exists on this node with the record's UID
    /// and has not finished (Succeeded or Failed), terminating or not (a draining pod still
    /// serves; its DEL frees the IP), whatever its `status.podIPs` say yet (pod status lags
    /// the CNI result; the record and the checkpoint are the node's own word). Releases are
    /// conditional on the sandbox and UID, and a sticky record its owner wants stays reserved.
    pub async fn startup_gc(&self) -> Result<usize, CniError> {
        let node = &self.settings.node;
        let params = kube::api::ListParams::default().fields(&format!("spec.nodeName={node}"));
        let pods = Api::<Pod>::all(self.client.clone())
            .list(&params)
            .await
            .map_err(api_error(format!("listing the pods of node {node}")))?;
        let live: BTreeMap<(String, String), String> = pods
            .items
            .iter()
            .filter(|p| !crate::gc::index::PodFacts::of(p).finished())
            .map(|p| ((p.namespace().unwrap_or_default(), p.name_any()), p.uid().unwrap_or_default()))
            .collect();
        let blocks = Api::<IPBlock>::all(self.client.clone())
            .list(&kube::api::ListParams::default())
            .await
            .map_err(api_error("listing IPBlocks".to_string()))?;
        let lives_here = |r: &Allocation| live.get(&(r.pod.namespace.clone(), r.pod.name.clone())) == Some(&r.pod.uid);
        let mut stale = Vec::new();
        for block in &blocks.items {
            for (ip, record) in &block.spec.allocations {
                if record.node != *node || !blocks::may_be_attached(record) {
                    continue;
                }
                if !lives_here(record) {
                    stale.push((block.name_any(), block.spec.pool.clone(), ip.clone(), record.clone()));
                }
            }
        }
        let mut checkpoint = self.checkpoint.lock().await;
        for (block, pool, ip, record) in &stale {
            tracing::info!(%ip, pod = %format!("{}/{}", record.pod.namespace, record.pod.name), "start-up GC: no local pod holds it");
            let target =
                CheckpointIp { ip: ip.clone(), prefix_len: 0, gateway: None, pool: pool.clone(), block: block.clone() };
            self.release_ips(&[target], &record.container_id, &record.interface, Some(&record.pod.uid)).await;
            let key = AttachmentKey {
                network: record.network.clone(),
                container_id: record.container_id.clone(),
                ifname: record.interface.clone(),
            };
            checkpoint.remove(&key).map_err(checkpoint_error)?;
        }
        // The attachments that records name on this node: a record's own sandbox, a live
        // migration's target sandbox, and the sandboxes of a repaired record's pod that hold
        // its IP (the record cannot name them) while that pod lives here.
        let adopted: BTreeSet<(&str, &str)> = blocks
            .items
            .iter()
            .flat_map(|b| b.spec.allocations.iter())
            .filter(|(_, r)| r.node == *node && r.repaired_at.is_some() && lives_here(r))
            .map(|(ip, r)| (r.pod.uid.as_str(), ip.as_str()))
            .collect();
        let mut recorded: BTreeSet<AttachmentKey> = checkpoint
            .entries()
            .filter(|e| e.ips.iter().any(|i| adopted.contains(&(e.pod.uid.as_str(), i.ip.as_str()))))
            .map(|e| e.key.clone())
            .collect();
        recorded.extend(blocks.items.iter().flat_map(|b| b.spec.allocations.values()).flat_map(|r| {
            let own = (r.node == *node).then_some((&r.container_id, &r.interface));
            let target =
                r.migration_target.as_ref().filter(|t| t.node == *node).map(|t| (&t.container_id, &t.interface));
            own.into_iter().chain(target).map(|(container_id, ifname)| AttachmentKey {
                network: r.network.clone(),
                container_id: container_id.clone(),
                ifname: ifname.clone(),
            })
        }));
        for entry in checkpoint.retain_recorded(&recorded).map_err(checkpoint_error)? {
            tracing::info!(container_id = %entry.key.container_id, pod = %format!("{}/{}", entry.pod.namespace, entry.pod.name), "start-up GC: no record names this checkpoint entry any more");
        }
        Ok(stale.len())
    }

    /// Answers the controller's release marks on this node's records
    /// ([`crate::gc::handshake`]). Runs inside the allocation actor, so no ADD, DEL or GC
    /// interleaves: after `ready-for-release` the IP is in no checkpoint entry, and only a
    /// new record (which clears the mark) could hand it out again. Returns how many marks
    /// were answered; marks that must wait are left for the next pass.
    pub async fn answer_marks(&self) -> Result<usize, CniError> {
        let node = &self.settings.node;
        let marked: Vec<(String, String, IpNet, String, Allocation)> = self
            .blocks
            .state()
            .iter()
            .filter_map(|b| b.spec.cidr.parse::<IpNet>().ok().map(|cidr| (b, cidr)))
            .flat_map(|(b, cidr)| {
                b.spec
                    .allocations
                    .iter()
                    .filter(|(_, r)| r.node == *node && marked_for_release(r))
                    .map(move |(ip, r)| (b.name_any(), b.spec.pool.clone(), cidr, ip.clone(), r.clone()))
            })
            .collect();
        if marked.is_empty() {
            return Ok(0);
        }
        let mut checkpoint = self.checkpoint.lock().await;
        let mut answered = 0;
        for (block, pool, cidr, ip, record) in marked {
            let pod = self.pod_on_node(&record).await?;
            let attached: Vec<AttachmentKey> =
                checkpoint.entries().filter(|e| e.ips.iter().any(|i| i.ip == ip)).map(|e| e.key.clone()).collect();
            let marked_at = record.release_handshake.as_ref().map_or(Timestamp::UNIX_EPOCH, |h| h.marked_at.0);
            let marked_for = Duration::try_from(Timestamp::now().duration_since(marked_at)).unwrap_or(Duration::ZERO);
            let answer = agent_answer(pod, !attached.is_empty(), marked_for, self.settings.sandbox_grace);
            let Some(state) = answer.state() else { continue };
            let detail = match (answer, attached.is_empty()) {
                (AgentAnswer::DoNotRelease, _) => "the pod is running on this node".to_string(),
                (_, true) => "no sandbox on this node holds the IP".to_string(),
                (_, false) => format!(
                    "its sandbox got no DEL within {} s of the mark; counted as lost",
                    self.settings.sandbox_grace.as_secs()
                ),
            };
            let written = self
                .write_block(&block, &pool, cidr, |spec| {
                    let current = spec.allocations.get_mut(&ip).filter(|r| r.pod.uid == record.pod.uid)?;
                    let handshake =
                        current.release_handshake.as_mut().filter(|h| h.state == HandshakeState::MarkedForRelease)?;
                    handshake.state = state;
                    handshake.detail = Some(detail.clone());
                    Some(())
                })
                .await?;
            if written.is_none() {
                continue;
            }
            if answer == AgentAnswer::Ready {
                for key in &attached {
                    checkpoint.remove(key).map_err(checkpoint_error)?;
                }
            }
            self.metrics.handshake_answer(answer.label());
            tracing::info!(%ip, pod = %format!("{}/{}", record.pod.namespace, record.pod.name), answer = answer.label(), %detail, "answered a release mark");
            answered += 1;
        }
        Ok(answered)
    }

    /// The record's pod as the handshake needs it, from a live read (not the cache). A
    /// terminating pod counts as ending here, unlike in start-up GC: the controller marks
    /// its record only once `deletionTimestamp` (the end of the grace period, when the
    /// kubelet kills what still runs) has passed, and its attached sandbox still waits
    /// `sandbox_grace` for the DEL.
    async fn pod_on_node(&self, record: &Allocation) -> Result<PodOnNode, CniError> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &record.pod.namespace);
        let pod = pods
            .get_opt(&record.pod.name)
            .await
            .map_err(api_error(format!("reading pod {}/{}", record.pod.namespace, record.pod.name)))?;
        Ok(match pod.map(|p| crate::gc::index::PodFacts::of(&p)) {
            Some(facts) if facts.uid == record.pod.uid && !facts.terminal() => PodOnNode::Active,
            Some(facts) if facts.uid == record.pod.uid => PodOnNode::Ending,
            _ => PodOnNode::Gone,
        })
    }

    /// Rebuilds the checkpoint from this node's records in the blocks (when the file was
    /// missing, or corrupt and moved aside).
    pub async fn rebuild_checkpoint(&self) -> Result<usize, CniError> {
        let mut entries: BTreeMap<AttachmentKey, CheckpointEntry> = BTreeMap::new();
        for block in self.blocks.state() {
            for (ip, record) in &block.spec.allocations {
                if record.node != self.settings.node || record.container_id.is_empty() {
                    continue;
                }
                let key = AttachmentKey {
                    network: record.network.clone(),
                    container_id: record.container_id.clone(),
                    ifname: record.interface.clone(),
                };
                let resolved = self.resolve_pool(&block.spec.pool);
                entries
                    .entry(key.clone())
                    .or_insert_with(|| CheckpointEntry { key, pod: record.pod.clone(), ips: Vec::new() })
                    .ips
                    .push(CheckpointIp {
                        ip: ip.clone(),
                        prefix_len: resolved.as_ref().map(|p| p.layout.cidr().prefix_len()).unwrap_or(32),
                        gateway: resolved.and_then(|p| p.gateway),
                        pool: block.spec.pool.clone(),
                        block: block.name_any(),
                    });
            }
        }
        let count = entries.len();
        self.checkpoint.lock().await.replace_all(entries.into_values().collect()).map_err(checkpoint_error)?;
        Ok(count)
    }
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

/// Whether the controller has marked `record` for release and waits for this agent.
pub fn marked_for_release(record: &Allocation) -> bool {
    record.release_handshake.as_ref().is_some_and(|h| h.state == HandshakeState::MarkedForRelease)
}

/// What releasing a sandbox's IPs did.
#[derive(Default)]
struct ReleaseSummary {
    /// Some IP stayed as a sticky reservation (the claim stays too).
    kept: bool,
    /// The claim of the released records: namespace, claim name (the VM's for KubeVirt), UID.
    claim: Option<PodRef>,
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

/// Whether `ip` is an IPv4 address (a claimed IP that does not parse counts as IPv6).
fn is_v4(ip: &str) -> bool {
    ip.parse::<IpAddr>().is_ok_and(|ip| ip.is_ipv4())
}

/// A sticky pod's IPs in its claim's order: each kept IP (`Ok`) in its place, each IP given
/// up (`Err`, with whether it is IPv4) replaced by the fresh IP of its family, or left out
/// when no pool of that family was chosen.
fn fill_given_up<T>(slots: Vec<Result<T, bool>>, fresh: Vec<T>, v4: impl Fn(&T) -> bool) -> Vec<T> {
    let (fresh_v4, fresh_v6): (Vec<T>, Vec<T>) = fresh.into_iter().partition(|ip| v4(ip));
    let (mut fresh_v4, mut fresh_v6) = (fresh_v4.into_iter(), fresh_v6.into_iter());
    slots
        .into_iter()
        .filter_map(|slot| match slot {
            Ok(kept) => Some(kept),
            Err(true) => fresh_v4.next(),
            Err(false) => fresh_v6.next(),
        })
        .collect()
}

fn attachment_key(request: &AttachmentRequest) -> AttachmentKey {
    AttachmentKey {
        network: request.network.clone(),
        container_id: request.container_id.clone(),
        ifname: request.ifname.clone(),
    }
}

/// A stable hash of the node name, so each node starts its block scan at its own offset.
fn node_hash(node: &str) -> usize {
    node.bytes().fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(usize::from(b)))
}

/// The CNI result for `ips`: each address with its pool's prefix length and gateway, and a
/// default route via the gateway when the pool has one.
pub fn result_of(ips: &[CheckpointIp]) -> IpamResult {
    let routes = ips
        .iter()
        .filter_map(|ip| {
            let gateway = ip.gateway.clone()?;
            let dst = if ip.ip.contains(':') { "::/0" } else { "0.0.0.0/0" };
            Some(Route { dst: dst.to_string(), gw: Some(gateway) })
        })
        .collect();
    IpamResult {
        ips: ips
            .iter()
            .map(|ip| IpConfig {
                address: format!("{}/{}", ip.ip, ip.prefix_len),
                gateway: ip.gateway.clone(),
                interface: None,
            })
            .collect(),
        routes,
        dns: None,
    }
}

#[cfg(test)]
mod test {
    use super::*;

    fn ip(ip: &str, gateway: Option<&str>) -> CheckpointIp {
        CheckpointIp {
            ip: ip.into(),
            prefix_len: 24,
            gateway: gateway.map(Into::into),
            pool: "p".into(),
            block: "b".into(),
        }
    }

    #[test]
    fn a_result_carries_prefix_lengths_and_a_default_route_per_gateway() {
        let result = result_of(&[ip("10.0.0.5", Some("10.0.0.1")), ip("fd00::5", None)]);
        assert_eq!(result.ips[0].address, "10.0.0.5/24");
        assert_eq!(result.ips[0].gateway.as_deref(), Some("10.0.0.1"));
        assert_eq!(result.routes.len(), 1);
        assert_eq!(result.routes[0].dst, "0.0.0.0/0");
    }

    #[test]
    fn an_ip_given_up_is_replaced_in_its_place_by_the_fresh_ip_of_its_family() {
        let v4 = |ip: &&str| is_v4(ip);
        // (slots, fresh IPs, the pod's IPs)
        type Case = (Vec<Result<&'static str, bool>>, Vec<&'static str>, Vec<&'static str>);
        let cases: [Case; 5] = [
            (vec![Err(true), Ok("fd00::1")], vec!["10.1.0.9"], vec!["10.1.0.9", "fd00::1"]),
            (vec![Ok("10.0.0.1"), Err(false)], vec!["fd01::9"], vec!["10.0.0.1", "fd01::9"]),
            (vec![Ok("fd00::1"), Err(true)], vec!["10.1.0.9"], vec!["fd00::1", "10.1.0.9"]),
            // No pool of the family chosen: the pod goes without, as a new pod would.
            (vec![Err(true), Ok("fd00::1")], vec![], vec!["fd00::1"]),
            (vec![Ok("10.0.0.1"), Ok("fd00::1")], vec![], vec!["10.0.0.1", "fd00::1"]),
        ];
        for (slots, fresh, want) in cases {
            assert_eq!(fill_given_up(slots.clone(), fresh.clone(), v4), want, "{slots:?} + {fresh:?}");
        }
        assert!(is_v4("10.0.0.1") && !is_v4("fd00::1"));
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
