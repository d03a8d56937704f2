//! A plain in-memory index of the cluster, built from cached objects, that every GC decision
//! reads: pods by name, the IPs live pods report, claims, StatefulSets and nodes. Built once
//! per sweep (or per traced pod), it answers each record's questions without an API call.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use jiff::Timestamp;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;

use super::handshake::{TakeoverStep, controller_takeover_step};
use super::rules::{Facts, IpHolder, NodeState, Phase, PodView, RecordView, RuleSettings, Verdict, decide};
use crate::crd::{Allocation, IPClaim, OwnerRef, PodRef};
use crate::ipam::blocks::Adopter;
pub use crate::ipam::workload::StatefulSetFacts;
use crate::ipam::workload::{self, KUBEVIRT_VMI_KIND, OwnerFacts, Presence};

/// What the rules need of one pod.
#[derive(Clone, Debug)]
pub struct PodFacts {
    /// Its UID.
    pub uid: String,
    /// Its phase.
    pub phase: Phase,
    /// Its deletionTimestamp.
    pub deletion: Option<Timestamp>,
    /// Its `status.podIPs`.
    pub ips: Vec<String>,
}

impl PodFacts {
    /// Extracts the facts of a pod object.
    pub fn of(pod: &Pod) -> Self {
        let status = pod.status.as_ref();
        let phase = match status.and_then(|s| s.phase.as_deref()) {
            Some("Succeeded" | "Failed") => Phase::Completed,
            _ => Phase::Active,
        };
        let ips = status
            .and_then(|s| s.pod_ips.as_ref())
            .map(|ips| ips.iter().map(|ip| ip.ip.clone()).collect())
            .unwrap_or_default();
        Self {
            uid: pod.uid().unwrap_or_default(),
            phase,
            deletion: pod.metadata.deletion_timestamp.as_ref().map(|t| t.0),
            ips,
        }
    }

    /// Whether the pod no longer protects its IPs (terminating or completed).
    pub fn terminal(&self) -> bool {
        self.deletion.is_some() || self.phase == Phase::Completed
    }

    /// Whether the pod's containers are done (Succeeded or Failed). Until then the pod uses
    /// its IPs, terminating or not: a draining pod still serves, and its sandbox's DEL frees
    /// the IP (the node agent's start-up GC, `ipwarden check`'s conflicts).
    pub fn finished(&self) -> bool {
        self.phase == Phase::Completed
    }
}

type Key = (String, String);

/// A pod reporting an IP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    /// The pod.
    pub pod: PodRef,
    /// Whether it is terminating or completed.
    pub terminal: bool,
    /// Its node (`spec.nodeName`), which a repair writes into the record it adopts.
    pub node: String,
    /// Its controller, which a repair writes into the record it adopts.
    pub owner: Option<OwnerRef>,
}

/// The index.
#[derive(Clone, Debug, Default)]
pub struct ClusterIndex {
    /// Pods by (namespace, name).
    pub pods: HashMap<Key, PodFacts>,
    /// The pod reporting each IP; a non-terminal holder wins over a terminal one.
    pub live_ips: HashMap<String, Holder>,
    /// Claim UID by (namespace, claim name).
    pub claims: HashMap<Key, String>,
    /// StatefulSets by (namespace, name).
    pub statefulsets: HashMap<Key, StatefulSetFacts>,
    /// KubeVirt's VMs, once the controller watches them; `None` while it does not (KubeVirt
    /// not installed, caches not synced yet): then a VM's reservation is kept.
    pub kubevirt: Option<KubeVirtIndex>,
    /// Node states by name.
    pub nodes: HashMap<String, NodeState>,
    /// Owner kinds whose records count as sticky; a record of another kind is not, so an
    /// owner kind removed from the list leaves ipwarden's stickiness.
    pub sticky_kinds: Vec<String>,
    /// Blocks whose records no pool keeps ([`crate::ipam::pools::PoolSet::retired`]): orphaned
    /// blocks and the blocks of pools being deleted.
    pub retired_blocks: BTreeSet<String>,
}

/// KubeVirt objects by (namespace, name): whether each is being deleted.
#[derive(Clone, Debug, Default)]
pub struct KubeVirtIndex {
    /// VirtualMachineInstances.
    pub instances: HashMap<Key, bool>,
    /// VirtualMachines.
    pub vms: HashMap<Key, bool>,
}

impl KubeVirtIndex {
    fn presence(objects: &HashMap<Key, bool>, key: &Key) -> Presence {
        match objects.get(key) {
            None => Presence::Absent,
            Some(true) => Presence::Deleting,
            Some(false) => Presence::Live,
        }
    }
}

fn node_state(node: &Node) -> NodeState {
    let ready =
        node.status.as_ref().and_then(|s| s.conditions.as_ref()).and_then(|c| c.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) if c.status == "True" => NodeState::Ready,
        Some(c) => NodeState::NotReady(c.last_transition_time.as_ref().map_or(Timestamp::UNIX_EPOCH, |t| t.0)),
        // A node that never reported is not yet trusted to run anything; treat as NotReady.
        None => NodeState::NotReady(node.creation_timestamp().map_or(Timestamp::UNIX_EPOCH, |t| t.0)),
    }
}

impl ClusterIndex {
    /// Builds the index from cached objects.
    pub fn build(
        pods: &[Arc<Pod>],
        nodes: &[Arc<Node>],
        claims: &[Arc<IPClaim>],
        statefulsets: &[Arc<StatefulSet>],
        sticky_kinds: &[String],
    ) -> Self {
        let mut index = Self { sticky_kinds: sticky_kinds.to_vec(), ..Self::default() };
        for pod in pods {
            let facts = PodFacts::of(pod);
            let holder = Holder {
                pod: PodRef {
                    namespace: pod.namespace().unwrap_or_default(),
                    name: pod.name_any(),
                    uid: facts.uid.clone(),
                },
                terminal: facts.terminal(),
                node: pod.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default(),
                owner: workload::controller_of(pod),
            };
            for ip in &facts.ips {
                let entry = index.live_ips.entry(ip.clone()).or_insert_with(|| holder.clone());
                if entry.terminal && !holder.terminal {
                    *entry = holder.clone();
                }
            }
            index.pods.insert((pod.namespace().unwrap_or_default(), pod.name_any()), facts);
        }
        for claim in claims {
            index.claims.insert((claim.namespace().unwrap_or_default(), claim.name_any()), claim.spec.pod_uid.clone());
        }
        for sts in statefulsets {
            let facts = crate::owners::statefulset_facts(sts);
            index.statefulsets.insert((sts.namespace().unwrap_or_default(), sts.name_any()), facts);
        }
        for node in nodes {
            index.nodes.insert(node.name_any(), node_state(node));
        }
        index
    }

    /// Takes each Ready node in `stale_agents` (node -> when its agent Lease went stale) as
    /// NotReady since then: its agent cannot answer the release handshake, so the NotReady
    /// policy applies to its records as to those of a node that stopped reporting.
    pub fn with_stale_agents(mut self, stale_agents: &HashMap<String, Timestamp>) -> Self {
        for (node, since) in stale_agents {
            if let Some(state) = self.nodes.get_mut(node).filter(|s| **s == NodeState::Ready) {
                *state = NodeState::NotReady(*since);
            }
        }
        self
    }

    /// Marks `blocks` as retired: no sticky reservation is kept in them, since no pool will
    /// hand their IPs out again (a pool being deleted must empty, an orphaned block has none).
    pub fn with_retired_blocks(mut self, blocks: &BTreeSet<String>) -> Self {
        self.retired_blocks = blocks.clone();
        self
    }

    /// Takes KubeVirt's VMs and VM instances as watched (see [`ClusterIndex::kubevirt`]).
    pub fn with_kubevirt(mut self, kubevirt: Option<KubeVirtIndex>) -> Self {
        self.kubevirt = kubevirt;
        self
    }

    /// Whether a sticky record's owner still wants it, by [`workload::owner_wants`] on the
    /// cached owner.
    pub fn owner_wants(&self, record: &Allocation) -> bool {
        let Some(owner) = record.owner.as_ref() else { return false };
        self.wants(&record.pod.namespace, owner, &record.pod.name)
    }

    /// Whether `owner` (in `namespace`) still wants the IPs of its pod `pod_name`, by
    /// [`workload::owner_wants`] on the cached owner.
    pub fn wants(&self, namespace: &str, owner: &OwnerRef, pod_name: &str) -> bool {
        let key = (namespace.to_string(), owner.name.clone());
        let facts = match owner.kind.as_str() {
            "StatefulSet" => OwnerFacts::StatefulSet(self.statefulsets.get(&key).copied()),
            KUBEVIRT_VMI_KIND => self.kubevirt.as_ref().map_or(OwnerFacts::Unknown, |k| OwnerFacts::VirtualMachine {
                instance: KubeVirtIndex::presence(&k.instances, &key),
                vm: KubeVirtIndex::presence(&k.vms, &key),
            }),
            _ => OwnerFacts::Unknown,
        };
        workload::owner_wants(&owner.name, pod_name, facts)
    }

    /// Whether the record's node has an agent that can answer the release handshake: the
    /// record names a node, and that node exists, is Ready and (see
    /// [`ClusterIndex::with_stale_agents`]) has a live agent Lease.
    pub fn agent_can_answer(&self, record: &Allocation) -> bool {
        !record.node.is_empty() && self.nodes.get(&record.node) == Some(&NodeState::Ready)
    }

    /// The live pod reporting `ip`, as a repair writes it into the record it adopts.
    pub fn adopter(&self, ip: &str) -> Option<Adopter> {
        let holder = self.live_ips.get(ip)?;
        Some(Adopter {
            pod: holder.pod.clone(),
            node: holder.node.clone(),
            owner: holder.owner.clone(),
            sticky: workload::is_sticky(holder.owner.as_ref(), &self.sticky_kinds),
        })
    }

    /// The state of the record's node (Ready when the record names none).
    fn node_of(&self, record: &Allocation) -> NodeState {
        if record.node.is_empty() {
            return NodeState::Ready;
        }
        self.nodes.get(&record.node).copied().unwrap_or(NodeState::Deleted)
    }

    /// The controller's step for a record an agent marked for a sticky takeover; `None`
    /// when the record carries no such mark.
    pub fn takeover_step(&self, record: &Allocation, now: Timestamp, settings: &RuleSettings) -> Option<TakeoverStep> {
        let handshake = record.release_handshake.as_ref()?;
        let claimant = &handshake.takeover.as_ref()?.pod;
        let waiting = self
            .pods
            .get(&(claimant.namespace.clone(), claimant.name.clone()))
            .is_some_and(|p| p.uid == claimant.uid && !p.terminal() && p.ips.is_empty());
        Some(controller_takeover_step(handshake.state, waiting, self.node_of(record), settings.not_ready, now))
    }

    /// The verdict for one record at `now`.
    pub fn evaluate<'a>(
        &'a self,
        ip: &'a str,
        record: &'a Allocation,
        now: Timestamp,
        settings: &RuleSettings,
    ) -> Verdict<'a> {
        let key = (record.pod.namespace.clone(), record.pod.name.clone());
        let claim_name = workload::claim_name(&record.pod.name, record.owner.as_ref());
        let node = self.node_of(record);
        let sticky = workload::record_is_sticky(record, &self.sticky_kinds);
        let facts = Facts {
            record: RecordView { ip, pod_uid: &record.pod.uid, node: &record.node, sticky },
            pod: self.pods.get(&key).map(|p| PodView {
                uid: &p.uid,
                phase: p.phase,
                deletion: p.deletion,
                ips: &p.ips,
            }),
            claim_uid: self.claims.get(&(record.pod.namespace.clone(), claim_name)).map(String::as_str),
            owner_wants: sticky && self.owner_wants(record),
            node,
            // A live migration's target reporting the IP holds it for the record, as its source does.
            holder: self.live_ips.get(ip).map(|h| IpHolder {
                uid: if crate::ipam::blocks::names_pod(record, &h.pod.uid) { &record.pod.uid } else { &h.pod.uid },
                terminal: h.terminal,
            }),
            now,
        };
        decide(&facts, settings)
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::gc::rules::{KeepReason, NotReadyPolicy, ReleaseReason};

    #[test]
    fn a_ready_node_whose_agent_is_gone_follows_the_not_ready_policy_from_when_its_lease_went_stale() {
        let record = |node: &str| -> Allocation {
            serde_json::from_value(serde_json::json!({
                "pod": {"namespace": "ns", "name": "gone", "uid": "u"}, "node": node, "network": "n",
                "containerId": "c", "interface": "eth0", "allocatedAt": "2026-01-01T00:00:00Z",
            }))
            .expect("record")
        };
        let now = Timestamp::from_second(1_780_000_000).expect("now");
        let stale_since = now - jiff::SignedDuration::from_secs(30);
        let mut index = ClusterIndex::default();
        for node in ["dead-agent", "live-agent", "not-ready"] {
            index.nodes.insert(node.to_string(), NodeState::Ready);
        }
        index.nodes.insert("not-ready".to_string(), NodeState::NotReady(now));
        let stale = HashMap::from([
            ("dead-agent".to_string(), stale_since),
            ("not-ready".to_string(), stale_since),
            ("deleted".to_string(), stale_since),
        ]);
        let index = index.with_stale_agents(&stale);
        assert!(index.agent_can_answer(&record("live-agent")));
        assert!(!index.agent_can_answer(&record("dead-agent")), "no handshake with a gone agent");
        assert_eq!(index.nodes.get("not-ready"), Some(&NodeState::NotReady(now)), "NotReady keeps its own since");
        assert_eq!(index.nodes.get("deleted"), None, "a deleted node stays deleted");

        let keep = RuleSettings { additional_delay: std::time::Duration::ZERO, not_ready: NotReadyPolicy::Keep };
        let dead = record("dead-agent");
        assert_eq!(index.evaluate("10.0.0.1", &dead, now, &keep), Verdict::Keep(KeepReason::NodeNotReady));
        let release = |secs| RuleSettings {
            not_ready: NotReadyPolicy::ReleaseAfter(std::time::Duration::from_secs(secs)),
            ..keep
        };
        let verdict = index.evaluate("10.0.0.1", &dead, now, &release(10));
        assert!(matches!(verdict, Verdict::Release { reason: ReleaseReason::NodeNotReady, .. }), "{verdict:?}");
        let verdict = index.evaluate("10.0.0.1", &dead, now, &release(60));
        assert_eq!(verdict, Verdict::TraceUntil(stale_since + jiff::SignedDuration::from_secs(60)));
    }

    #[test]
    fn a_vm_record_is_kept_while_its_vm_is_there_or_kubevirt_unwatched_and_released_once_the_vm_is_gone() {
        let record: Allocation = serde_json::from_value(serde_json::json!({
            "pod": {"namespace": "ns", "name": "virt-launcher-vm1-x", "uid": "u"}, "node": "n", "network": "n",
            "containerId": "c", "interface": "eth0", "allocatedAt": "2026-01-01T00:00:00Z", "sticky": true,
            "owner": {"kind": KUBEVIRT_VMI_KIND, "name": "vm1"},
        }))
        .expect("record");
        let now = Timestamp::from_second(1_780_000_000).expect("now");
        let settings = RuleSettings { additional_delay: std::time::Duration::ZERO, not_ready: NotReadyPolicy::Keep };
        let index = |kubevirt: Option<KubeVirtIndex>| {
            let mut index =
                ClusterIndex { sticky_kinds: vec![KUBEVIRT_VMI_KIND.to_string()], ..ClusterIndex::default() };
            index.nodes.insert("n".to_string(), NodeState::Ready);
            index.with_kubevirt(kubevirt)
        };
        let vm = ("ns".to_string(), "vm1".to_string());
        let stopped = KubeVirtIndex { vms: HashMap::from([(vm.clone(), false)]), ..KubeVirtIndex::default() };
        let deleting = KubeVirtIndex { vms: HashMap::from([(vm, true)]), ..KubeVirtIndex::default() };
        let kept = Verdict::Keep(KeepReason::StickyReservation);
        assert_eq!(index(None).evaluate("10.0.0.1", &record, now, &settings), kept, "KubeVirt not watched");
        assert_eq!(index(Some(stopped)).evaluate("10.0.0.1", &record, now, &settings), kept, "a stopped VM");
        for gone in [KubeVirtIndex::default(), deleting] {
            let watched = index(Some(gone));
            let verdict = watched.evaluate("10.0.0.1", &record, now, &settings);
            assert!(matches!(verdict, Verdict::Release { reason: ReleaseReason::PodGone, .. }), "{verdict:?}");
        }
    }

    #[test]
    fn a_terminating_pod_is_terminal_but_only_a_succeeded_or_failed_one_is_finished() {
        // (phase, terminating, terminal, finished)
        let table = [
            ("Running", false, false, false),
            ("Running", true, true, false),
            ("Pending", true, true, false),
            ("Succeeded", false, true, true),
            ("Failed", true, true, true),
        ];
        for (phase, terminating, terminal, finished) in table {
            let mut pod: Pod = serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "uid": "u"},
                "status": {"phase": phase},
            }))
            .expect("pod");
            if terminating {
                pod.metadata.deletion_timestamp =
                    Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now()));
            }
            let facts = PodFacts::of(&pod);
            assert_eq!(
                (facts.terminal(), facts.finished()),
                (terminal, finished),
                "{phase}, terminating {terminating}"
            );
        }
    }
}
