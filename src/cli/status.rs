//! `ipwarden status`: per pool and node, how many IPs are used, sticky-reserved, cooling
//! down and leak candidates, and how many of the pool's blocks are affine to the node; `-a`
//! lists the IPs.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;
use jiff::Timestamp;
use kube::{Client, ResourceExt};
use serde::Serialize;

use super::{Listed, Output, list_cluster, table};
use crate::gc::rules::{NotReadyPolicy, RuleSettings, Verdict};

/// `ipwarden status` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct StatusArgs {
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
    pod: String,
}

/// Counts of one pool on one node.
#[derive(Clone, Debug, Default, Serialize)]
#[serde(rename_all = "camelCase")]
struct Counts {
    used: usize,
    sticky_reserved: usize,
    cooling: usize,
    leak_candidates: usize,
    /// Blocks of the pool affine to the node (its agent allocates from them first).
    affine_blocks: usize,
}

/// Runs `ipwarden status`.
pub async fn run(args: StatusArgs) -> anyhow::Result<()> {
    let client = Client::try_default().await.context("building the Kubernetes client from the kubeconfig")?;
    let Listed { blocks, index, .. } = list_cluster(&client).await?;
    let settings = RuleSettings { additional_delay: Duration::from_secs(5), not_ready: NotReadyPolicy::Keep };
    let now = Timestamp::now();
    let cooldown = Duration::from_secs(args.cooldown_seconds);
    let mut rows = Vec::new();
    for block in blocks.iter().filter(|b| args.pool.as_ref().is_none_or(|p| *p == b.spec.pool)) {
        for (ip, record) in &block.spec.allocations {
            let state = match index.evaluate(&block.name_any(), ip, record, now, &settings) {
                Verdict::Release { .. } | Verdict::Repair { .. } => "leak-candidate",
                _ if !crate::ipam::blocks::may_be_attached(record) => "sticky-reserved",
                _ => "used",
            };
            let pod = format!("{}/{}", record.pod.namespace, record.pod.name);
            rows.push(IpRow { ip: ip.clone(), pool: block.spec.pool.clone(), node: record.node.clone(), state, pod });
        }
        for (ip, at) in &block.spec.released {
            let cooling = at.0.saturating_add(cooldown).is_ok_and(|free| free > now);
            if cooling {
                let row = IpRow {
                    ip: ip.clone(),
                    pool: block.spec.pool.clone(),
                    node: String::new(),
                    state: "cooling",
                    pod: String::new(),
                };
                rows.push(row);
            }
        }
    }
    rows.retain(|r| args.node.as_ref().is_none_or(|n| *n == r.node || r.node.is_empty()));
    let mut counts: BTreeMap<(String, String), Counts> = BTreeMap::new();
    for row in &rows {
        let entry = counts.entry((row.pool.clone(), row.node.clone())).or_default();
        match row.state {
            "used" => entry.used += 1,
            "sticky-reserved" => entry.sticky_reserved += 1,
            "cooling" => entry.cooling += 1,
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
                c.sticky_reserved.to_string(),
                c.cooling.to_string(),
                c.leak_candidates.to_string(),
                c.affine_blocks.to_string(),
            ]
        })
        .collect();
    print!("{}", table(&["POOL", "NODE", "USED", "STICKY", "COOLING", "LEAK CANDIDATES", "BLOCKS"], &summary));
    if args.all {
        println!();
        let list: Vec<Vec<String>> = rows
            .iter()
            .map(|r| vec![r.ip.clone(), r.pool.clone(), r.node.clone(), r.state.to_string(), r.pod.clone()])
            .collect();
        print!("{}", table(&["IP", "POOL", "NODE", "STATE", "POD"], &list));
    }
    Ok(())
}
