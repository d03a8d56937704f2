//! Start-up recovery, before the agent serves CNI: the checkpoint rebuilt when it was lost,
//! and this node's records that no local pod holds released.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::Api;

use super::block_writes::{RecordAt, ReleaseTrigger};
use super::checkpoint::{AttachmentKey, CheckpointEntry};
use super::core::Core;
use super::error::Error;
use crate::crd::{Allocation, IPBlock};
use crate::gc::adopt::{Writer, by_block};
use crate::gc::index::PodFacts;
use crate::ipam::{blocks, spares};

impl Core {
    /// Start-up GC, before the agent serves CNI: releases this node's records that no local
    /// pod holds. A record is in use when its pod exists on this node with the record's UID
    /// and has not finished (Succeeded or Failed), terminating or not (a draining pod still
    /// serves; its DEL frees the IP), whatever its `status.podIPs` say yet (pod status lags
    /// the CNI result; the record and the checkpoint are the node's own word). Releases are
    /// conditional on the sandbox and UID, and a sticky record its owner wants stays reserved.
    /// With `--cri-socket`, a record whose sandbox the runtime still has stays, pod or no pod:
    /// its DEL frees it (module `runtime_sandboxes`).
    pub async fn startup_gc(&self) -> Result<usize, Error> {
        // Spares bound before a stop get their records first, so the releases below see them.
        self.write_bound_spares().await;
        let node = &self.settings.node;
        let params = kube::api::ListParams::default().fields(&format!("spec.nodeName={node}"));
        let pods = Api::<Pod>::all(self.client.clone())
            .list(&params)
            .await
            .map_err(Error::api(format!("listing the pods of node {node}")))?;
        // By the runtime's UID (`PodFacts::uid`): a static pod's records name its config hash.
        let live: BTreeMap<(String, String), String> = pods
            .items
            .iter()
            .map(crate::gc::index::PodFacts::of)
            .filter(|p| !p.finished())
            .map(|p| ((p.namespace, p.name), p.uid))
            .collect();
        let blocks = Api::<IPBlock>::all(self.client.clone())
            .list(&kube::api::ListParams::default())
            .await
            .map_err(Error::api("listing IPBlocks".to_string()))?;
        let runtime = self.ask_runtime(true).await;
        let lives_here = |r: &Allocation| live.get(&(r.pod.namespace.clone(), r.pod.name.clone())) == Some(&r.pod.uid);
        let mut stale = Vec::new();
        for block in &blocks.items {
            for (ip, record) in &block.spec.allocations {
                if record.node != *node || !blocks::may_be_attached(record) {
                    continue;
                }
                if lives_here(record) {
                    continue;
                }
                if runtime.as_ref().is_some_and(|r| r.is_live(&record.container_id)) {
                    tracing::info!(%ip, pod = %format!("{}/{}", record.pod.namespace, record.pod.name), container_id = %record.container_id, "start-up GC: no local pod holds it, but the runtime still has its sandbox; its DEL frees it");
                    continue;
                }
                // A failed status call says nothing of the sandbox, which may still be starting.
                if runtime.as_ref().is_some_and(|r| r.is_unknown(&record.container_id)) {
                    tracing::info!(%ip, pod = %format!("{}/{}", record.pod.namespace, record.pod.name), container_id = %record.container_id, "start-up GC: no local pod holds it, but the runtime could not say whether it has its sandbox; kept for the release handshake");
                    continue;
                }
                stale.push((block.name_any(), ip.clone(), record.clone()));
            }
        }
        for (block, ip, record) in &stale {
            tracing::info!(%ip, pod = %format!("{}/{}", record.pod.namespace, record.pod.name), "start-up GC: no local pod holds it");
            let target = RecordAt { block: block.clone(), ip: ip.clone() };
            let trigger = ReleaseTrigger::StartupGc;
            let summary = self
                .release_ips(&[target], &record.container_id, &record.interface, Some(&record.pod.uid), trigger)
                .await;
            // A migrating VM's source whose VM instance has not said how the migration ended:
            // its checkpoint entry stays, so the runtime's GC tries again.
            if summary.waiting.is_some() {
                continue;
            }
            let key = AttachmentKey {
                network: record.network.clone(),
                container_id: record.container_id.clone(),
                ifname: record.interface.clone(),
            };
            let entry = self.checkpoint.read(|c| c.get(&key).cloned());
            let uid = Some(record.pod.uid.as_str());
            self.release_bound_spares(entry.as_ref(), &record.container_id, &record.interface, uid, trigger).await?;
            self.checkpoint.remove(&key).await?;
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
        let mut recorded: BTreeSet<AttachmentKey> = self.checkpoint.read(|c| {
            c.entries()
                .filter(|e| e.ips.iter().any(|i| adopted.contains(&(e.pod.uid.as_str(), i.ip.as_str()))))
                .map(|e| e.key.clone())
                .collect()
        });
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
        // A sandbox holding a spare whose record could not be written yet keeps its entry:
        // the next pass of the spares' tending writes the record.
        recorded.extend(self.checkpoint.read(|c| {
            c.entries()
                .filter(|e| e.spare_record.is_some())
                .filter(|e| {
                    e.ips.iter().any(|i| {
                        blocks.items.iter().any(|b| {
                            b.name_any() == i.block && spares::is_bindable_for(&b.spec, &self.settings.node, &i.ip)
                        })
                    })
                })
                .map(|e| e.key.clone())
                .collect::<Vec<_>>()
        }));
        for entry in self.checkpoint.retain_recorded(recorded).await? {
            tracing::info!(container_id = %entry.key.container_id, pod = %format!("{}/{}", entry.pod.namespace, entry.pod.name), "start-up GC: no record names this checkpoint entry any more");
        }
        Ok(stale.len())
    }

    /// `--adopt-on-start`: the plan of `ipwarden adopt` ([`crate::gc::adopt::plan`]) over
    /// every pod (so that a pod of another node reporting the same IP is seen), of which this
    /// node's adoptions are written block by block before the agent serves: it never hands
    /// out an IP another IPAM gave a pod that still runs here. A refused IP of a pod of this
    /// node is logged with the pods it names and left alone. A sticky pod's IPClaim is the
    /// controller's to create from those records (decision 0022). The records name `network`. Returns how many records were written.
    pub async fn adopt_local_pods(&self, network: &str) -> Result<usize, Error> {
        let node = &self.settings.node;
        let pods = Api::<Pod>::all(self.client.clone())
            .list(&kube::api::ListParams::default())
            .await
            .map_err(Error::api("listing every pod for the start-up adoption".to_string()))?;
        let pods: Vec<PodFacts> = pods.items.iter().map(PodFacts::of).collect();
        let plan =
            crate::gc::adopt::plan(&pods, &self.pools.state(), &self.blocks.state(), &self.settings.sticky_kinds);
        let local_ips: BTreeSet<&String> = pods.iter().filter(|p| p.node == *node).flat_map(|p| &p.ips).collect();
        for refused in plan.refused.iter().filter(|r| local_ips.contains(&r.ip)) {
            tracing::warn!(ip = %refused.ip, pods = %refused.pods.join(", "), reason = %refused.reason, "start-up adoption: refused");
        }
        // An IP this node's checkpoint holds is its own sandbox's (a spare bound whose record
        // the start-up could not write yet): the tending writes its record, adoption does not.
        let attached: BTreeSet<String> =
            self.checkpoint.read(|c| c.entries().flat_map(|e| e.ips.iter().map(|i| i.ip.clone())).collect());
        let mut written = BTreeSet::new();
        let local = plan.adopt.iter().filter(|a| a.node == *node && !attached.contains(&a.ip));
        for (name, adoptions) in by_block(local) {
            let first = adoptions[0];
            let Ok(cidr) = first.block_cidr.parse() else { continue };
            let ips = self
                .write_block(name, &first.pool, cidr, |spec| {
                    let now = jiff::Timestamp::now();
                    let ips = crate::gc::adopt::apply(spec, &adoptions, network, now, Writer::Agent);
                    (!ips.is_empty()).then_some(ips)
                })
                .await?;
            for ip in ips.unwrap_or_default() {
                tracing::info!(%ip, block = %name, "start-up adoption: recorded an IP another IPAM attached");
                written.insert(ip);
            }
        }
        for left in
            plan.adopt.iter().filter(|a| a.node == *node && !attached.contains(&a.ip) && !written.contains(&a.ip))
        {
            tracing::warn!(
                ip = %left.ip, block = %left.block,
                "start-up adoption: not recorded, a record or another node's spare holds the IP (an agent changes no other node's spares); `ipwarden adopt` run by an operator records it"
            );
        }
        Ok(written.len())
    }

    /// Rebuilds the checkpoint from this node's records in the blocks (when the file was
    /// missing, or corrupt and moved aside).
    pub async fn rebuild_checkpoint(&self) -> Result<usize, Error> {
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
                entries
                    .entry(key.clone())
                    .or_insert_with(|| CheckpointEntry {
                        key,
                        pod: record.pod.clone(),
                        ips: Vec::new(),
                        spare_record: None,
                    })
                    .ips
                    .push(self.checkpoint_ip(block.spec.pool.clone(), block.name_any(), ip.clone()));
            }
        }
        let count = entries.len();
        self.checkpoint.replace_all(entries.into_values().collect()).await?;
        Ok(count)
    }
}
