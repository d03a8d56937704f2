//! `IPPool`: a cluster-wide range of pod IPs, split into blocks.

// Several printcolumn(...) entries share `type_ = "string"`; that is not a mistake.
#![allow(clippy::duplicated_attributes)]

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The finalizer the controller keeps on every pool while a block of the pool holds a
/// record, so that a pool deleted in use neither vanishes under its pods' IPs nor lets a
/// recreated pool hand them out again (docs/data-model.md, "Deleting a pool").
pub const POOL_FINALIZER: &str = "ipwarden.io/pool-in-use";

/// A pool of pod IPs. The apiserver refuses a malformed CIDR, a range or gateway outside
/// the CIDR, and a block size that does not fit, with the messages below.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "ipwarden.io",
    version = "v1alpha1",
    kind = "IPPool",
    plural = "ippools",
    shortname = "ipp",
    status = "IPPoolStatus",
    printcolumn(name = "CIDR", type_ = "string", json_path = ".spec.cidr"),
    printcolumn(name = "Default", type_ = "boolean", json_path = ".spec.default"),
    printcolumn(name = "Disabled", type_ = "boolean", json_path = ".spec.disabled"),
    printcolumn(name = "Total", type_ = "integer", json_path = ".status.total"),
    printcolumn(name = "Allocated", type_ = "integer", json_path = ".status.allocated"),
    printcolumn(name = "Sticky", type_ = "integer", json_path = ".status.stickyReserved"),
    printcolumn(name = "Spare", type_ = "integer", json_path = ".status.spares"),
    printcolumn(name = "Deleting", type_ = "date", json_path = ".metadata.deletionTimestamp"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new(
        "!isCIDR(self.cidr) || !has(self.ranges) || self.ranges.all(r, !isIP(r.start) || !isIP(r.end) || \
         (cidr(self.cidr).containsIP(r.start) && cidr(self.cidr).containsIP(r.end)))"
    ).message("every range must lie inside cidr").field_path(".ranges"),
    validation = Rule::new(
        "!has(self.gateway) || !isCIDR(self.cidr) || !isIP(self.gateway) || cidr(self.cidr).containsIP(self.gateway)"
    ).message("gateway must lie inside cidr").field_path(".gateway"),
    validation = Rule::new(
        "!has(self.exclude) || !isCIDR(self.cidr) || self.exclude.all(e, \
         (isIP(e) && ip(e).family() == cidr(self.cidr).ip().family()) || \
         (isCIDR(e) && cidr(e).ip().family() == cidr(self.cidr).ip().family()))"
    ).message("exclude entries must be IPs or CIDRs of the same family as cidr").field_path(".exclude"),
    validation = Rule::new(
        "!has(self.blockSize) || !isCIDR(self.cidr) || (self.blockSize >= cidr(self.cidr).prefixLength() && \
         (cidr(self.cidr).ip().family() == 4 ? self.blockSize >= 20 && self.blockSize <= 32 \
                                             : self.blockSize >= 116 && self.blockSize <= 128))"
    ).message(
        "blockSize is a prefix length no shorter than cidr's, from 20 to 32 for IPv4 and 116 to 128 for IPv6 \
         (a block holds at most 4096 addresses)"
    ).field_path(".blockSize"),
    validation = Rule::new("has(self.blockSize) == has(oldSelf.blockSize) && (!has(self.blockSize) || self.blockSize == oldSelf.blockSize)")
        .message("blockSize is immutable: existing blocks were split with it")
)]
pub struct IPPoolSpec {
    /// The pool's network, e.g. 10.244.0.0/16 or fd00:10:244::/64; immutable.
    #[x_kube(
        validation = Rule::new("isCIDR(self)").message("cidr must be a CIDR such as 10.244.0.0/16"),
        validation = Rule::new("!isCIDR(self) || cidr(self) == cidr(self).masked()")
            .message("cidr must not have host bits set: use its network address"),
        validation = Rule::new("self == oldSelf").message("cidr is immutable")
    )]
    #[schemars(length(max = 64))]
    pub cidr: String,
    /// Inclusive ranges inside `cidr` to allocate from; all of `cidr` when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub ranges: Vec<IpRange>,
    /// IPs or CIDRs never handed out (e.g. addresses used by infrastructure).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256), inner(length(max = 64)))]
    pub exclude: Vec<String>,
    /// The pods' gateway, returned in CNI results and never handed out; when unset, the
    /// CIDR's first address after its network address (10.244.0.1 for 10.244.0.0/16, fd00::1
    /// for fd00::/64), and none for an IPv4 /31 or /32 or an IPv6 /127 or /128.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("isIP(self)").message("gateway must be an IP address"))]
    #[schemars(length(max = 64))]
    pub gateway: Option<String>,
    /// Whether CNI results carry a default route via the pool's gateway (true when unset);
    /// false for a pool of a secondary network, e.g. a Multus attachment, whose pods' default
    /// route is the primary network's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_route: Option<bool>,
    /// Prefix length of each IPBlock (default: /24 for IPv4, /120 for IPv6, or cidr's own
    /// when it is smaller); immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u8>,
    /// Namespaces whose pods may use the pool; all when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// Nodes whose pods may use the pool; all when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
    /// Whether pods without a pool annotation use this pool (one default per IP family).
    #[serde(default)]
    pub default: bool,
    /// Drains the pool for a migration: it hands out no new IP (a sticky pod still gets its
    /// reserved one back), and the IPs it has handed out stay until their pods go.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub disabled: bool,
}

/// An inclusive range of IPs.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct IpRange {
    /// The first IP of the range.
    #[x_kube(validation = Rule::new("isIP(self)").message("range start must be an IP address"))]
    #[schemars(length(max = 64))]
    pub start: String,
    /// The last IP of the range (inclusive).
    #[x_kube(validation = Rule::new("isIP(self)").message("range end must be an IP address"))]
    #[schemars(length(max = 64))]
    pub end: String,
}

/// What the pool holds now; kept by ipwarden, shown by `kubectl get ippools`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IPPoolStatus {
    /// How many IPs the pool can hand out (saturating at i64::MAX for huge IPv6 pools).
    #[serde(default)]
    pub total: i64,
    /// How many IPs are allocated (sticky reservations included).
    #[serde(default)]
    pub allocated: i64,
    /// How many of those are sticky reservations of StatefulSet or KubeVirt workloads.
    #[serde(default)]
    pub sticky_reserved: i64,
    /// How many IPs nodes hold ready as spares (the agents' `--spare-ips`): not allocated,
    /// and not free for anyone but their node.
    #[serde(default)]
    pub spares: i64,
    /// The blocks (names and resourceVersions, as [`crate::ipam::blocks::fingerprint`]) the counts
    /// were taken from: `ipwarden check` compares the counts only with those same blocks, so
    /// a status not yet rewritten after a change (or a leader change) is not called drift.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counted_blocks: Option<String>,
    /// Conditions such as `Overlapping` (the pool overlaps another and is not used).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}
