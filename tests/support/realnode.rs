//! What tests on real nodes look at.

use std::collections::BTreeSet;
use std::path::Path;

use e2e::realnode::RealNode;

/// The IPv4 addresses of `eth0` in every network namespace of the node's runtime: the
/// IPs its pods really have.
/// Panics when two namespaces hold one IP: a set would hide it.
pub fn netns_ips(node: &RealNode) -> BTreeSet<String> {
    let dir = node.paths().netns_dir();
    let Ok(entries) = std::fs::read_dir(&dir) else { return BTreeSet::new() };
    let ips: Vec<String> = entries.flatten().filter_map(|entry| eth0_ipv4(&entry.path())).collect();
    let unique: BTreeSet<String> = ips.iter().cloned().collect();
    assert_eq!(unique.len(), ips.len(), "an IP in two of the node's network namespaces: {ips:?}");
    unique
}

fn eth0_ipv4(netns: &Path) -> Option<String> {
    let output = std::process::Command::new("nsenter")
        .arg(format!("--net={}", netns.display()))
        .args(["ip", "-o", "-4", "addr", "show", "dev", "eth0"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let word = text.split_whitespace().skip_while(|w| *w != "inet").nth(1)?;
    Some(word.split('/').next()?.to_string())
}
