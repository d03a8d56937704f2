//! `ipwarden status`: per pool and node, how many IPs are used, reserved between two pods,
//! sticky, cooling down and leak candidates, and how many of the pool's blocks are affine to
//! the node; `-a` lists the IPs in numeric order.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use jiff::Timestamp;
use kube::ResourceExt;
use serde::Serialize;

use super::connect::{ClusterArgs, connect};
use super::{Listed, Output, list_cluster, table};
use crate::gc::rules::{NotReadyPolicy, RuleSettings, Verdict};
use crate::ipam::blocks::{counts_as_sticky, may_be_attached};
use crate::ipam::spares;

/// `ipwarden status` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct StatusArgs {
    /// How to reach the cluster.
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Only the IPs of pods in this namespace (free IPs cooling down belong to none, so they
    /// are left out).
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,
    /// Only this pool.
    #[arg(long)]
    pub pool: Option<String>,
    /// Only this node.
    #[arg(long)]
    pub node: Option<String>,
    /// List every IP, not only the counts.
    #[arg(short = 'a', long = "all")]
    pub all: bool,
    /// The agents' reuse cooldown, to tell which free IPs are still cooling.
    #[arg(long, default_value_t = 30)]
    pub cooldown_seconds: u64,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// One IP's state.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct IpRow {
    ip: String,
    pool: String,
    node: String,
    state: &'static str,
    /// Whether the record is a sticky workload's (see [`counts_as_sticky`]).
    sticky: bool,
    pod: String,
    /// The pod's interface holding the IP (`eth0`, Multus' `net1`, ...); empty for a free IP.
    interface: String,
    /// The network (netconf name) of that interface; empty for a free IP.
    network: String,
}

/// Counts of one pool on one node.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
struct Counts {
    /// Records a sandbox holds (or may hold).
    used: usize,
    /// Records no sandbox holds: kept for a sticky workload's next pod.
    reserved: usize,
    /// Records of sticky workloads, used or reserved or leak candidates: what the STICKY
    /// column of `kubectl get ippools` counts.
    sticky: usize,
    cooling: usize,
    /// Spare IPs the node holds ready (`--spare-ips`).
    spares: usize,
    leak_candidates: usize,
    /// Blocks of the pool affine to the node (its agent allocates from them first).
    affine_blocks: usize,
}

/// Runs `ipwarden status`.
pub async fn run(args: StatusArgs) -> anyhow::Result<()> {
    let Listed { blocks, index, .. } = list_cluster(&connect(&args.cluster).await?.client).await?;
    let settings = RuleSettings { additional_delay: Duration::from_secs(5), not_ready: NotReadyPolicy::Keep };
    let now = Timestamp::now();
    let cooldown = Duration::from_secs(args.cooldown_seconds);
    let mut rows = Vec::new();
    for block in blocks.iter().filter(|b| args.pool.as_ref().is_none_or(|p| *p == b.spec.pool)) {
        let in_namespace = |ns: &str| args.namespace.as_ref().is_none_or(|want| want == ns);
        for (ip, record) in block.spec.allocations.iter().filter(|(_, r)| in_namespace(&r.pod.namespace)) {
            let state = match index.evaluate(&block.name_any(), ip, record, now, &settings) {
                Verdict::Release { .. } | Verdict::Repair { .. } => "leak-candidate",
                _ if !may_be_attached(record) => "reserved",
                _ => "used",
            };
            let pod = format!("{}/{}", record.pod.namespace, record.pod.name);
            let sticky = counts_as_sticky(record);
            let (pool, node) = (block.spec.pool.clone(), record.node.clone());
            let (interface, network) = (record.interface.clone(), record.network.clone());
            rows.push(IpRow { ip: ip.clone(), pool, node, state, sticky, pod, interface, network });
        }
        let spare_of = block.spec.affinity.clone().filter(|_| args.namespace.is_none());
        for (ip, node) in
            spare_of.iter().flat_map(|node| spares::bindable(&block.spec).into_iter().map(move |ip| (ip, node)))
        {
            let row = IpRow {
                ip: ip.to_string(),
                pool: block.spec.pool.clone(),
                node: node.clone(),
                state: "spare",
                sticky: false,
                pod: String::new(),
                interface: String::new(),
                network: String::new(),
            };
            rows.push(row);
        }
        let released = block.spec.released.iter().filter(|_| args.namespace.is_none());
        for (ip, at) in released {
            let cooling = at.0.saturating_add(cooldown).is_ok_and(|free| free > now);
            if cooling {
                let row = IpRow {
                    ip: ip.clone(),
                    pool: block.spec.pool.clone(),
                    node: String::new(),
                    state: "cooling",
                    sticky: false,
                    pod: String::new(),
                    interface: String::new(),
                    network: String::new(),
                };
                rows.push(row);
            }
        }
    }
    rows.retain(|r| args.node.as_ref().is_none_or(|n| *n == r.node || r.node.is_empty()));
    rows.sort_by(|a, b| ip_order(&a.ip).cmp(&ip_order(&b.ip)));
    let mut counts: BTreeMap<(String, String), Counts> = BTreeMap::new();
    for row in &rows {
        let entry = counts.entry((row.pool.clone(), row.node.clone())).or_default();
        entry.sticky += usize::from(row.sticky);
        match row.state {
            "used" => entry.used += 1,
            "reserved" => entry.reserved += 1,
            "cooling" => entry.cooling += 1,
            "spare" => entry.spares += 1,
            _ => entry.leak_candidates += 1,
        }
    }
    let shown = |b: &&std::sync::Arc<crate::crd::IPBlock>| args.pool.as_ref().is_none_or(|p| *p == b.spec.pool);
    for block in blocks.iter().filter(shown) {
        let Some(node) = block.spec.affinity.as_ref().filter(|n| args.node.as_ref().is_none_or(|want| want == *n))
        else {
            continue;
        };
        counts.entry((block.spec.pool.clone(), node.clone())).or_default().affine_blocks += 1;
    }
    if args.output == Output::Json {
        let summary: Vec<serde_json::Value> = counts
            .iter()
            .map(|((pool, node), c)| serde_json::json!({"pool": pool, "node": node, "counts": c}))
            .collect();
        let ips = if args.all { serde_json::to_value(&rows)? } else { serde_json::Value::Null };
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({"summary": summary, "ips": ips}))?);
        return Ok(());
    }
    let summary: Vec<Vec<String>> = counts
        .iter()
        .map(|((pool, node), c)| {
            let node = if node.is_empty() { "-".to_string() } else { node.clone() };
            vec![
                pool.clone(),
                node,
                c.used.to_string(),
                c.reserved.to_string(),
                c.sticky.to_string(),
                c.cooling.to_string(),
                c.spares.to_string(),
                c.leak_candidates.to_string(),
                c.affine_blocks.to_string(),
            ]
        })
        .collect();
    let headers = ["POOL", "NODE", "USED", "RESERVED", "STICKY", "COOLING", "SPARE", "LEAK CANDIDATES", "BLOCKS"];
    print!("{}", table(&headers, &summary));
    if args.all {
        println!();
        let list: Vec<Vec<String>> = rows
            .iter()
            .map(|r| {
                let sticky = if r.sticky { "yes" } else { "" };
                let (ip, pool, node, state) = (r.ip.clone(), r.pool.clone(), r.node.clone(), r.state.to_string());
                vec![ip, pool, node, state, sticky.into(), r.pod.clone(), r.interface.clone(), r.network.clone()]
            })
            .collect();
        let headers = ["IP", "POOL", "NODE", "STATE", "STICKY", "POD", "INTERFACE", "NETWORK"];
        print!("{}", table(&headers, &list));
    }
    Ok(())
}

/// The order `status -a` lists IPs in: numeric, IPv4 before IPv6 (10.0.0.9 before
/// 10.0.0.10, which text order reverses); text that is no IP last, in text order.
fn ip_order(ip: &str) -> Result<IpAddr, &str> {
    ip.parse().map_err(|_| ip)
}

#[cfg(test)]
mod test {
    use super::ip_order;

    #[test]
    fn ips_are_ordered_numerically_ipv4_before_ipv6_and_non_ips_last() {
        let cases: [(&[&str], &[&str]); 4] = [
            (&["10.0.0.10", "10.0.0.9", "10.0.0.100"], &["10.0.0.9", "10.0.0.10", "10.0.0.100"]),
            (
                &["fd00::a", "10.0.0.2", "fd00::9", "9.255.255.255"],
                &["9.255.255.255", "10.0.0.2", "fd00::9", "fd00::a"],
            ),
            (&["fd00::10", "fd00::f"], &["fd00::f", "fd00::10"]),
            (&["not-an-ip", "10.0.0.1", "also-not"], &["10.0.0.1", "also-not", "not-an-ip"]),
        ];
        for (input, want) in cases {
            let mut ips = input.to_vec();
            ips.sort_by(|a, b| ip_order(a).cmp(&ip_order(b)));
            assert_eq!(ips, want, "{input:?}");
        }
    }
}
