//! `IPClaim`: the IPs a sticky workload holds, named after the pod (or `vm.<VM>` for a KubeVirt
//! VM). It is what gives a recreated StatefulSet pod its IP back; a stateless pod has none
//! (docs/decisions/0015-no-claim-for-stateless-pods.md), only claims older versions wrote
//! have `sticky: false`.

// Several printcolumn(...) entries share `type_ = "string"`; that is not a mistake.
#![allow(clippy::duplicated_attributes)]

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::OwnerRef;

/// A workload's current IPs and where they were last bound.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "ipwarden.io",
    version = "v1alpha1",
    kind = "IPClaim",
    plural = "ipclaims",
    shortname = "ipc",
    namespaced,
    status = "IPClaimStatus",
    printcolumn(name = "IP", type_ = "string", json_path = ".spec.interfaces[0].ips[0].ip"),
    printcolumn(name = "Node", type_ = "string", json_path = ".spec.node"),
    printcolumn(name = "Sticky", type_ = "boolean", json_path = ".spec.sticky"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct IPClaimSpec {
    /// The UID of the pod the IPs were last bound to.
    pub pod_uid: String,
    /// The node that pod ran on.
    pub node: String,
    /// The workload's controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<OwnerRef>,
    /// Whether the IPs stay reserved for the workload between pods.
    #[serde(default)]
    pub sticky: bool,
    /// The IPs per interface.
    pub interfaces: Vec<ClaimedInterface>,
    /// When the claim was last bound to a pod.
    pub bound_at: Time,
}

/// The IPs of one interface.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClaimedInterface {
    /// The interface name inside the sandbox.
    pub interface: String,
    /// Its IPs, one per pool.
    pub ips: Vec<ClaimedIp>,
}

/// One claimed IP and where its record lives.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClaimedIp {
    /// The IP address.
    pub ip: String,
    /// The pool it came from.
    pub pool: String,
    /// The IPBlock holding its record.
    pub block: String,
}

/// What the controller has seen of the claim: kept in the status subresource, which no
/// agent may write (decision 0022), so another node's agent cannot change it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IPClaimStatus {
    /// The last binding the controller saw in effect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub witnessed: Option<WitnessedBinding>,
}

/// A binding of the claim the controller saw in effect: its pod, with that UID, live on that
/// node and controlled by the claim's owner, and every IP of it recorded in its block for
/// that pod and node. A sticky ADD takes these IPs back when the claim's spec names others
/// (another node's agent may have rewritten the spec; it cannot forge this).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WitnessedBinding {
    /// The UID of the pod.
    pub pod_uid: String,
    /// The pod's node.
    pub node: String,
    /// The pod's controller, as the controller saw it: what the claim janitor judges the
    /// claim's workload by (absent in witnesses an earlier version wrote).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<OwnerRef>,
    /// The IPs per interface its records held.
    pub interfaces: Vec<ClaimedInterface>,
    /// When the controller saw it.
    pub at: Time,
}
