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
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClaimedInterface {
    /// The interface name inside the sandbox.
    pub interface: String,
    /// Its IPs, one per pool.
    pub ips: Vec<ClaimedIp>,
}

/// One claimed IP and where its record lives.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClaimedIp {
    /// The IP address.
    pub ip: String,
    /// The pool it came from.
    pub pool: String,
    /// The IPBlock holding its record.
    pub block: String,
}
