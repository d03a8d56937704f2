//! Block writes of the agent: every compare-and-swap through [`crate::block_store`], and
//! the release of a sandbox's records that DEL, node GC and start-up recovery share.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use jiff::Timestamp;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;

use super::checkpoint::{AttachmentKey, CheckpointEntry};
use super::core::{Base, Core, new_block};
use super::error::Error;
use crate::block_store::CasOutcome;
use crate::crd::{Allocation, IPBlock, IPBlockSpec, MigrationTarget};
use crate::ipam::blocks::{self, ReleaseOutcome};
use crate::ipam::pools;
use crate::ipam::spares;
use crate::ipam::workload::Handover;

/// What releasing a sandbox's IPs did.
#[derive(Default)]
pub(super) struct ReleaseSummary {
    /// The IPs this release freed.
    released: BTreeSet<IpAddr>,
    /// Why an IP was left as it was for the release to be tried again: a VM source's
    /// handover its VM instance has not settled, or could not be asked about.
    pub(super) waiting: Option<Error>,
}

/// What made the agent release a sandbox's IPs: the `trigger` and `rule` of the info line
/// each release logs (docs/agent.md, "Releases"), the agent's counterpart of the controller's
/// release Events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ReleaseTrigger {
    /// The runtime's CNI DEL.
    Del,
    /// The runtime's CNI GC did not list the sandbox.
    CniGc,
    /// The start-up GC found no local pod holding the record (also after a lost checkpoint,
    /// whose rebuilt entries it checks the same way).
    StartupGc,
    /// The agent answered the controller's release mark: no sandbox holds the IP.
    ReleaseMark,
    /// A new sandbox of the same pod on the same interface was ADDed: the older one's DEL
    /// never came (kubelet stops a pod's sandbox before it makes another, so it is gone).
    Superseded,
    /// The runtime, asked over CRI, no longer has the sandbox (module `runtime_sandboxes`).
    RuntimeGone,
}

impl ReleaseTrigger {
    /// The log line's `trigger`.
    pub(super) fn label(self) -> &'static str {
        match self {
            Self::Del => "del",
            Self::CniGc => "cni_gc",
            Self::StartupGc => "startup_gc",
            Self::ReleaseMark => "release_mark",
            Self::Superseded => "superseded",
            Self::RuntimeGone => "runtime",
        }
    }

    /// The log line's `rule`: why the IP is free.
    fn rule(self) -> &'static str {
        match self {
            Self::Del => "sandbox_deleted",
            Self::CniGc => "sandbox_not_listed",
            Self::StartupGc => "no_local_pod",
            Self::ReleaseMark => "no_sandbox_holds_it",
            Self::Superseded => "sandbox_replaced",
            Self::RuntimeGone => "sandbox_gone_from_runtime",
        }
    }

    /// Logs, at info, that `ip` of block `block`, held by `pod` on `node`, was released.
    fn log_released(self, block: &str, ip: &str, pod: &crate::crd::PodRef, node: &str) {
        tracing::info!(
            %ip,
            %block,
            pod = %format!("{}/{}", pod.namespace, pod.name),
            uid = %pod.uid,
            %node,
            rule = self.rule(),
            trigger = self.label(),
            "released"
        );
    }
}

/// Where a record to release lives.
pub(super) struct RecordAt {
    /// The IPBlock.
    pub(super) block: String,
    /// The record's IP.
    pub(super) ip: String,
}

impl Core {
    /// Applies `mutate` to the newest copy of block `name` this agent holds in one
    /// compare-and-swap (creating the block, of `pool` and `cidr`, when it knows none).
    /// `mutate` returning `None` means nothing to write.
    pub(super) async fn write_block<T>(
        &self,
        name: &str,
        pool: &str,
        cidr: IpNet,
        mut mutate: impl FnMut(&mut IPBlockSpec) -> Option<T>,
    ) -> Result<Option<T>, Error> {
        let create = || new_block(name, pool, cidr);
        Ok(self.cas_block(name, Base::Newest, Some(&create), |block| mutate(&mut block.spec)).await?.written())
    }

    /// Releases sandbox `key`'s attachment ([`Core::release_attachment`]) as `trigger` says,
    /// then drops its checkpoint entry `entry`: what a DEL does, and what the runtime's CNI GC
    /// and a sandbox superseded by its pod's new one do in place of a DEL that never came.
    /// Returns the IPs it freed (not those kept for a sticky owner or handed over).
    pub(super) async fn detach(
        &self,
        key: &AttachmentKey,
        entry: Option<&CheckpointEntry>,
        uid: Option<&str>,
        trigger: ReleaseTrigger,
    ) -> Result<BTreeSet<IpAddr>, Error> {
        let released = self.release_attachment(entry, &key.container_id, &key.ifname, uid, trigger).await?;
        self.checkpoint.remove(key).await?;
        Ok(released)
    }

    /// Releases the IPs of a sandbox (`entry`, when the checkpoint holds it, and every record
    /// naming the sandbox), for `trigger`; returns the IPs it freed.
    pub(super) async fn release_attachment(
        &self,
        entry: Option<&CheckpointEntry>,
        container_id: &str,
        ifname: &str,
        uid: Option<&str>,
        trigger: ReleaseTrigger,
    ) -> Result<BTreeSet<IpAddr>, Error> {
        let mut targets: BTreeSet<(String, String)> =
            entry.iter().flat_map(|e| e.ips.iter()).map(|ip| (ip.block.clone(), ip.ip.clone())).collect();
        let mut released = BTreeSet::new();
        for (spare, freed) in self.release_bound_spares(entry, container_id, ifname, uid, trigger).await? {
            if freed {
                released.extend(spare.1.parse::<IpAddr>().ok());
            }
            targets.remove(&spare);
        }
        targets.extend(self.records_of_sandbox(container_id, ifname).into_iter().map(|(block, ip, _)| (block, ip)));
        let ips: Vec<RecordAt> = targets.into_iter().map(|(block, ip)| RecordAt { block, ip }).collect();
        let summary = self.release_ips(&ips, container_id, ifname, uid, trigger).await;
        if let Some(waiting) = summary.waiting {
            return Err(waiting);
        }
        released.extend(summary.released);
        Ok(released)
    }

    /// Releases the spares of checkpoint entry `entry` whose records are not written yet
    /// ([`Core::release_bound_spare`]): before the entry goes, whatever removes it (a DEL, the
    /// node's GC, a release mark answered for a sandbox counted as gone, the start-up GC).
    /// Returns them as (block, IP), each with whether this call freed it.
    pub(super) async fn release_bound_spares(
        &self,
        entry: Option<&CheckpointEntry>,
        container_id: &str,
        ifname: &str,
        uid: Option<&str>,
        trigger: ReleaseTrigger,
    ) -> Result<Vec<((String, String), bool)>, Error> {
        let node = self.settings.node.as_str();
        let bound: Vec<(String, String)> = entry
            .iter()
            .filter(|e| e.spare_record.is_some())
            .flat_map(|e| e.ips.iter())
            .filter(|i| self.newest_block(&i.block).is_some_and(|b| spares::is_bindable_for(&b.spec, node, &i.ip)))
            .map(|i| (i.block.clone(), i.ip.clone()))
            .collect();
        let mut released = Vec::new();
        for (block, ip) in bound {
            let freed = self.release_bound_spare(&block, &ip, container_id, ifname, uid).await?;
            if freed && let Some(entry) = entry {
                trigger.log_released(&block, &ip, &entry.pod, node);
            }
            released.push(((block, ip), freed));
        }
        Ok(released)
    }

    /// Releases the spare `ip` of block `block` that the sandbox got before its record was
    /// written ([`spares::release_bound`]); if the record was written meanwhile, releases the
    /// record as any stateless pod's (a spare's pod keeps no IP). A failure fails the call
    /// (the runtime retries its DEL): a spare left behind would be handed out again without
    /// its cooldown once the checkpoint entry is gone. Says whether it released the IP.
    async fn release_bound_spare(
        &self,
        block: &str,
        ip: &str,
        container_id: &str,
        ifname: &str,
        uid: Option<&str>,
    ) -> Result<bool, Error> {
        let (ip, sandbox, interface, pod_uid) =
            (ip.to_string(), container_id.to_string(), ifname.to_string(), uid.map(str::to_string));
        let node = self.settings.node.clone();
        let release = move |spec: &mut IPBlockSpec| {
            let now = Timestamp::now();
            if spares::release_bound(spec, &node, &ip, now) {
                return Some(ReleaseOutcome::Released);
            }
            match blocks::release_attachment(
                spec,
                &ip,
                &sandbox,
                &interface,
                pod_uid.as_deref(),
                blocks::STATELESS,
                now,
            ) {
                ReleaseOutcome::NotOurs => None,
                outcome => Some(outcome),
            }
        };
        let batched = self
            .edit_in_batch(block, None, {
                let release = release.clone();
                move |spec| {
                    let out = release(spec);
                    (out.is_some(), out)
                }
            })
            .await;
        let outcome = match batched {
            Some(done) => Ok(done),
            None => self
                .cas_block(block, Base::Fresh, None, |b| release.clone()(&mut b.spec))
                .await
                .map(CasOutcome::written),
        };
        match outcome {
            Ok(Some(outcome)) => {
                self.metrics.release("released");
                Ok(outcome == ReleaseOutcome::Released)
            }
            Ok(None) => Ok(false),
            Err(e) => {
                self.metrics.release("error");
                Err(e.into())
            }
        }
    }

    /// The migration target of `record` that its source sandbox `container_id` / `ifname`
    /// (of pod `uid`), leaving, hands the record to: the one attached, when the VM instance
    /// says that migration completed ([`crate::owners::migration_handover`]). `None` when the
    /// sandbox is not the record's own (the target's, or another's), no target is attached,
    /// or the VM instance names no such migration (logged: the source only detaches). An error while the migration has not ended in the VM
    /// instance's status, or the VMI cannot be read: the release waits for a retry.
    async fn confirmed_target(
        &self,
        record: &Allocation,
        container_id: &str,
        ifname: &str,
        uid: Option<&str>,
    ) -> Result<Option<MigrationTarget>, Error> {
        // Only the record's own sandbox leaving asks: any other DEL leaves the record alone.
        if !blocks::left_by(record, container_id, ifname, uid) {
            return Ok(None);
        }
        let Some(target) = record.migration_target.as_ref() else { return Ok(None) };
        let vm = format!("{}/{}", record.pod.namespace, record.owner.as_ref().map_or("", |o| o.name.as_str()));
        let handover = crate::owners::migration_handover(&self.client, record, target)
            .await
            .map_err(Error::api(format!("reading VM instance {vm} for its live migration's state")))?;
        match handover {
            Handover::Confirmed => Ok(Some(target.clone())),
            Handover::Pending(why) => Err(Error::HandoverPending { container_id: container_id.to_string(), vm, why }),
            Handover::Refused(why) => {
                tracing::warn!(%vm, target = %target.pod.name, target_node = %target.node, %why, "not handing the VM's IP to the migration target attached to its record; the source detaches and the target stays attached");
                Ok(None)
            }
        }
    }

    /// Releases `ips` of a sandbox; says whether any was kept as a sticky reservation and
    /// which claim (namespace, claim name, pod UID) the released records belong to, taken
    /// from the record the compare-and-swap actually released, never from an earlier read.
    pub(super) async fn release_ips(
        &self,
        ips: &[RecordAt],
        container_id: &str,
        ifname: &str,
        uid: Option<&str>,
        trigger: ReleaseTrigger,
    ) -> ReleaseSummary {
        let mut summary = ReleaseSummary::default();
        for target in ips {
            let record_in = |block: IPBlock| {
                let record = block.spec.allocations.get(&target.ip).cloned();
                record.map(|r| (r, self.retired(&block.spec)))
            };
            // The newest copy held, else (a record the cache does not show yet) a fresh read,
            // which the write then starts from too.
            let (found, base) = match self.newest_block(&target.block).and_then(record_in) {
                Some(found) => (Some(found), Base::Newest),
                None => match Api::<IPBlock>::all(self.client.clone()).get_opt(&target.block).await {
                    Ok(block) => (block.and_then(record_in), Base::Fresh),
                    Err(e) => {
                        tracing::warn!(block = %target.block, error = %e, "reading block for release failed");
                        (None, Base::Fresh)
                    }
                },
            };
            let Some((record, retired)) = found else { continue };
            // The records of a pool being deleted, or of an orphaned block, are released at
            // once: no reservation outlives its pod there. The owner (or the workload of a
            // list-bound record, which this DEL detaches) is read live; an unknown answer counts
            // as "wants" (keeping a reservation is safe, freeing is not).
            let keep = !retired && crate::owners::record_held(&self.client, &record, record.sticky, true).await;
            // A VM's source leaving hands the record only to the target its VM instance says
            // the migration completed to, read live; until KubeVirt says how the migration
            // ended (or while the VMI cannot be read) the record is left as it is and the
            // release is tried again.
            let confirmed = match self.confirmed_target(&record, container_id, ifname, uid).await {
                Ok(confirmed) => confirmed,
                Err(e) => {
                    tracing::info!(ip = %target.ip, error = %e, "release of a migrating VM's IP waits");
                    self.metrics.release("waiting");
                    summary.waiting.get_or_insert(e);
                    continue;
                }
            };
            let now = Timestamp::now();
            let (ip, sandbox, interface) = (target.ip.clone(), container_id.to_string(), ifname.to_string());
            let pod_uid = uid.map(str::to_string);
            let release = move |spec: &mut IPBlockSpec| {
                let attached = spec.allocations.get(&ip).and_then(|r| r.migration_target.as_ref());
                let hand_over = confirmed.is_some() && attached == confirmed.as_ref();
                let leaving = blocks::Leaving { keep_reservation: keep, hand_over };
                match blocks::release_attachment(spec, &ip, &sandbox, &interface, pod_uid.as_deref(), leaving, now) {
                    ReleaseOutcome::NotOurs => None,
                    outcome => Some(outcome),
                }
            };
            // From the copy held, with the node's other writes of the block (a drain's DELs);
            // alone from a fresh read when the copy did not show the record, or the batch was
            // not written, or it found the record not this sandbox's on a copy not read.
            let batched = match base {
                Base::Newest => {
                    let release = release.clone();
                    self.edit_in_batch(&target.block, None, move |spec| {
                        let out = release(spec);
                        (out.is_some(), out)
                    })
                    .await
                    .flatten()
                }
                Base::Fresh => None,
            };
            let outcome = match batched {
                Some(done) => Ok(Some(done)),
                None => self
                    .cas_block(&target.block, Base::Fresh, None, |block| release.clone()(&mut block.spec))
                    .await
                    .map(CasOutcome::written),
            };
            match outcome {
                Ok(Some(ReleaseOutcome::Released)) => {
                    summary.released.extend(target.ip.parse::<IpAddr>().ok());
                    self.metrics.release("released");
                    trigger.log_released(&target.block, &target.ip, &record.pod, &record.node);
                }
                Ok(Some(ReleaseOutcome::Reserved)) => self.metrics.release("reserved"),
                Ok(Some(ReleaseOutcome::HandedOver | ReleaseOutcome::Detached)) => self.metrics.release("handed_over"),
                Ok(_) => {}
                Err(e) => {
                    self.metrics.release("error");
                    tracing::warn!(ip = %target.ip, error = %e, "release failed; the GC will reclaim it");
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
}
