//! `IPBlock`: the allocation records of one block of a pool. Blocks keep each etcd object
//! small (at most 4096 addresses), let large pools exist, and spread write contention;
//! every change is a compare-and-swap on the block's resourceVersion.

// Several printcolumn(...) entries share `type_ = "string"`; that is not a mistake.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

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
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct IPBlockSpec {
    /// The IPPool this block belongs to.
    pub pool: String,
    /// The block's CIDR, a sub-network of the pool's.
    pub cidr: String,
    /// Allocation records by IP address.
    #[serde(default)]
    pub allocations: BTreeMap<String, Allocation>,
    /// When each free IP was last released, so the longest-released is reused first and a
    /// just-released one cools down before reuse.
    #[serde(default)]
    pub released: BTreeMap<String, Time>,
}

/// Who holds one IP.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Allocation {
    /// The pod holding (or, for a sticky reservation, last holding) the IP.
    pub pod: PodRef,
    /// The node the pod ran on.
    pub node: String,
    /// The CNI network (netconf name) the attachment belongs to.
    #[serde(default)]
    pub network: String,
    /// The sandbox's container ID; empty for a sticky reservation between two pods.
    pub container_id: String,
    /// The interface inside the sandbox.
    pub interface: String,
    /// The pod's controller, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<OwnerRef>,
    /// Whether the IP stays reserved for the workload (StatefulSet ordinal, KubeVirt VM)
    /// between pods.
    #[serde(default)]
    pub sticky: bool,
    /// When the IP was handed to this pod.
    pub allocated_at: Time,
}
