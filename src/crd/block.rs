//! `IPBlock`: the allocation records of one block of a pool. Blocks keep each etcd object
//! small (at most 4096 addresses), let large pools exist, and spread write contention;
//! every change is a compare-and-swap on the block's resourceVersion.

// Several printcolumn(...) entries share `type_ = "string"`; that is not a mistake.
#![allow(clippy::duplicated_attributes)]

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{OwnerRef, PodRef};

/// One block of a pool and who holds each of its IPs.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "ipwarden.io",
    version = "v1alpha1",
    kind = "IPBlock",
    plural = "ipblocks",
    shortname = "ipb",
    printcolumn(name = "Pool", type_ = "string", json_path = ".spec.pool"),
    printcolumn(name = "CIDR", type_ = "string", json_path = ".spec.cidr"),
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.affinity"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct IPBlockSpec {
    /// The IPPool this block belongs to.
    pub pool: String,
    /// The block's CIDR, a sub-network of the pool's.
    pub cidr: String,
    /// The node this block is affine to: that node's agent allocates from it first, and other
    /// nodes borrow single IPs from it only when the pool has no free block left. Unset: a
    /// block no node has claimed yet, or whose node is gone and left it empty (the controller
    /// then clears it), which any node may claim while it holds no record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<String>,
    /// Allocation records by IP address.
    #[serde(default)]
    pub allocations: BTreeMap<String, Allocation>,
    /// IPs the node of `affinity` holds ready in this block (`--spare-ips`): its agent hands
    /// one to a pod and answers the CNI ADD before the pod's record is written here, which
    /// happens right after. No other node and no other pod takes a spare; an IP that has a
    /// record is not a spare, whatever this set says.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub spares: BTreeSet<String>,
    /// When each free IP's last use ended (its pod's end where known, else its release), so
    /// the longest-free is reused first and the reuse cooldown counts from there.
    #[serde(default)]
    pub released: BTreeMap<String, Time>,
}

/// Who holds one IP.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Allocation {
    /// The pod holding (or, for a sticky reservation, last holding) the IP.
    pub pod: PodRef,
    /// The node the pod ran on.
    pub node: String,
    /// The CNI network (netconf name) the attachment belongs to.
    #[serde(default)]
    pub network: String,
    /// The sandbox's container ID; empty for a sticky reservation between two pods, and for
    /// a repaired record (`repairedAt`), whose sandbox the controller cannot know.
    pub container_id: String,
    /// The interface inside the sandbox (empty when `containerId` is).
    pub interface: String,
    /// The pod's controller, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<OwnerRef>,
    /// Whether the IP stays reserved for the workload (StatefulSet ordinal, KubeVirt VM)
    /// between pods.
    #[serde(default)]
    pub sticky: bool,
    /// The workload the IP is held for between its pods, set when the pod drew it from its
    /// `ipwarden.io/ip-list`: a Deployment (its ReplicaSets change every rollout), a bare
    /// ReplicaSet, a CronJob or a bare Job. While that workload exists and is not being
    /// deleted, the record outlives its pod as a reservation only the workload's pods take.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_for: Option<OwnerRef>,
    /// When the IP was handed to this pod.
    pub allocated_at: Time,
    /// The release handshake under way for this record, if the controller wants it released
    /// and the record's node has a live agent to ask.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_handshake: Option<ReleaseHandshake>,
    /// The target pod of a KubeVirt live migration of the record's VM instance, attached to
    /// the same IP on its own node while the migration runs: two sandboxes hold one IP by
    /// design, and whichever DEL comes first leaves the IP to the other.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_target: Option<MigrationTarget>,
    /// Set when the controller repaired the record for the live pod that reports its IP, or
    /// `ipwarden adopt` wrote it for an IP another IPAM attached: a sandbox of that pod on the
    /// record's node holds the IP, but which one is unknown (the Kubernetes API shows no
    /// container IDs). Unlike an empty `containerId` alone (a sticky reservation), the IP may
    /// be attached; the node's agent takes the record as its pod's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repaired_at: Option<Time>,
}

/// The second attachment of a record during a KubeVirt live migration: the target
/// virt-launcher pod's sandbox, which inherits the IP when the source's sandbox goes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigrationTarget {
    /// The UID of the VirtualMachineInstanceMigration the target pod was created for.
    pub migration_uid: String,
    /// The target pod.
    pub pod: PodRef,
    /// The target pod's node.
    pub node: String,
    /// The target sandbox's container ID.
    pub container_id: String,
    /// The interface inside the target sandbox.
    pub interface: String,
}

/// Where a release handshake stands. The controller writes `marked-for-release`; the node's
/// agent answers, under its allocation lock, with one of the other two.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum HandshakeState {
    /// The controller wants the record released and waits for the agent.
    MarkedForRelease,
    /// The agent holds no sandbox with the IP and will not hand it out or adopt it: the
    /// controller may release it.
    ReadyForRelease,
    /// The agent says the IP is in use on the node: the controller must not release it.
    DoNotRelease,
}

/// A release handshake between the controller and the record's node agent, kept in the
/// record itself so that it survives a restart of either side.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReleaseHandshake {
    /// Where it stands.
    pub state: HandshakeState,
    /// When the controller marked the record.
    pub marked_at: Time,
    /// The GC rule row the controller decided by; for a sticky takeover, which pod on which
    /// node waits for the record.
    pub reason: String,
    /// The agent's explanation of its answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// When the record's pod ended, as the controller saw it, for the reclaim latency.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_ended_at: Option<Time>,
    /// Set when an agent marked the record, not the controller: a recreated sticky pod
    /// waits to take the record over once the record's node has let go of its sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub takeover: Option<Takeover>,
}

/// The recreated sticky pod waiting to take a record over, and the node it runs on.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Takeover {
    /// The waiting pod.
    pub pod: PodRef,
    /// Its node.
    pub node: String,
}
