//! CNI DEL, CHECK, GC and STATUS (ADD has its own file, `add`).

use std::collections::BTreeSet;
use std::time::Instant;

use kube::api::Api;

use super::block_writes::ReleaseTrigger;
use super::checkpoint::{AttachmentKey, CheckpointEntry, Listing};
use super::core::{Core, attachment_key};
use super::error::Error;
use crate::crd::IPBlock;
use crate::cri::sandboxes::RuntimeSandboxes;
use crate::ipam::{blocks, spares};
use crate::protocol::{AttachmentRequest, GcRequest, StatusRequest};

impl Core {
    /// CNI DEL: releases the sandbox's IPs (keeping a wanted sticky reservation). Unknown
    /// sandboxes and repeated DELs succeed; a live migration's source fails (the runtime
    /// retries) while its VM instance has not recorded how the migration ended.
    pub async fn del(&self, request: &AttachmentRequest) -> Result<(), Error> {
        let started = std::time::Instant::now();
        let key = attachment_key(request);
        let entry = self.checkpoint.read(|c| c.get(&key).cloned());
        let uid =
            request.pod.as_ref().and_then(|p| p.uid.clone()).or_else(|| entry.as_ref().map(|e| e.pod.uid.clone()));
        let outcome = self.detach(&key, entry.as_ref(), uid.as_deref(), ReleaseTrigger::Del).await.map(drop);
        self.metrics.release_duration.observe(started.elapsed().as_secs_f64());
        outcome
    }

    /// CNI CHECK: the sandbox's records still exist (read fresh from the blocks) and hold
    /// the IPs the runtime has.
    pub async fn check(&self, request: &AttachmentRequest) -> Result<(), Error> {
        let entry = self.checkpoint.read(|c| c.get(&attachment_key(request)).cloned());
        let mut targets: BTreeSet<(String, String)> =
            entry.iter().flat_map(|e| e.ips.iter()).map(|ip| (ip.block.clone(), ip.ip.clone())).collect();
        targets.extend(
            self.records_of_sandbox(&request.container_id, &request.ifname).into_iter().map(|(b, ip, _)| (b, ip)),
        );
        let api: Api<IPBlock> = Api::all(self.client.clone());
        let mut found = BTreeSet::new();
        for (block, ip) in targets {
            let fresh = api.get_opt(&block).await.map_err(Error::api(format!("reading IPBlock {block}")))?;
            // A spare the sandbox got, whose record the agent is about to write (module `spares`).
            let bound_spare = entry.as_ref().is_some_and(|e| e.spare_record.is_some())
                && fresh.as_ref().is_some_and(|b| spares::is_bindable_for(&b.spec, &self.settings.node, &ip));
            let held = fresh.and_then(|b| b.spec.allocations.get(&ip).cloned());
            let uid = entry.as_ref().map(|e| e.pod.uid.as_str());
            if bound_spare
                || held.is_some_and(|r| {
                    blocks::holds_sandbox(&r, &request.container_id, &request.ifname) || blocks::adopted_by(&r, uid)
                })
            {
                found.insert(ip);
            }
        }
        if found.is_empty() {
            return Err(Error::UnknownAttachment {
                container_id: request.container_id.clone(),
                ifname: request.ifname.clone(),
            });
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
            return Err(Error::PrevResultMismatch { container_id: request.container_id.clone(), found, expected });
        }
        Ok(())
    }

    /// CNI GC: releases every attachment of the network that the runtime no longer lists,
    /// and notes when it listed the others: a release mark waits for a sandbox the runtime
    /// still has, however long its DEL takes (`release_marks`).
    /// `runtime`: the runtime's answer over CRI, asked before the node was taken alone.
    pub async fn gc(&self, request: &GcRequest, runtime: Option<&RuntimeSandboxes>) -> Result<(), Error> {
        let valid: BTreeSet<(&str, &str)> =
            request.valid_attachments.iter().map(|a| (a.container_id.as_str(), a.ifname.as_str())).collect();
        let listed: Vec<AttachmentKey> = request
            .valid_attachments
            .iter()
            .map(|a| AttachmentKey {
                network: request.network.clone(),
                container_id: a.container_id.clone(),
                ifname: a.ifname.clone(),
            })
            .collect();
        self.checkpoint.note_listed(&listed, Instant::now(), Listing::Returned);
        self.runtime_gc_called();
        let stale: Vec<CheckpointEntry> = self.checkpoint.read(|c| {
            c.entries()
                .filter(|e| e.key.network == request.network)
                .filter(|e| !valid.contains(&(e.key.container_id.as_str(), e.key.ifname.as_str())))
                .cloned()
                .collect()
        });
        // A sandbox the runtime's CRI showed live when asked just before is never released,
        // whatever GC says.
        let stale: Vec<CheckpointEntry> =
            stale.into_iter().filter(|e| !runtime.is_some_and(|r| r.is_live(&e.key.container_id))).collect();
        for entry in &stale {
            tracing::info!(container_id = %entry.key.container_id, pod = %entry.pod.name, "GC: releasing a stale attachment");
        }
        self.release_stale(stale, ReleaseTrigger::CniGc).await
    }

    /// CNI STATUS: ready once any IPPool exists. STATUS gates the node's readiness
    /// (containerd reports the network not ready on an error, and kubelet marks the node
    /// NotReady, whose pods are evicted), so a pool that is full, disabled or being deleted
    /// fails the ADDs that would use it, one by one, and never the node (decision 0008).
    pub async fn status(&self, _request: &StatusRequest) -> Result<(), Error> {
        if self.pools.state().is_empty() {
            return Err(Error::NoPool);
        }
        Ok(())
    }
}
