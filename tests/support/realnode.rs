//! What tests on real nodes look at.

use std::collections::BTreeSet;

use e2e::realnode::RealNode;

/// The IPv4 addresses of `eth0` in every network namespace of the node's runtime: the
/// IPs its pods really have.
/// Panics when two namespaces hold one IP: a set would hide it.
pub fn netns_ips(node: &RealNode) -> BTreeSet<String> {
    let ips = node.netns_ips();
    let unique: BTreeSet<String> = ips.iter().cloned().collect();
    assert_eq!(unique.len(), ips.len(), "an IP in two of the node's network namespaces: {ips:?}");
    unique
}
