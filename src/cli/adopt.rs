//! `ipwarden adopt`: records the IPs that running pods got from another IPAM (host-local, or
//! any other) and that fall inside an ipwarden pool, so a cluster moves to ipwarden without
//! restarting pods and ipwarden never hands those IPs out again. The plan is
//! [`crate::gc::adopt::plan`]; each block is written through the one compare-and-swap path,
//! then each sticky pod's IPClaim, taking over an older pod's stale claim but never a live
//! newer pod's ([`crate::claim_writes::bind_adopted`]).

use anyhow::Context;
use jiff::Timestamp;
use kube::ResourceExt;
use kube::api::Api;

use super::connect::{ClusterArgs, connect};
use super::{Output, list, table};
use crate::block_store::BlockStore;
use crate::claim_writes::bind_adopted;
use crate::crd::{IPBlock, IPClaim, IPPool};
use crate::gc::adopt::{Adoption, DEFAULT_NETWORK, Plan, Writer, apply, by_block, live_uids, plan, sticky_claims};
use crate::gc::index::PodFacts;
use crate::ipam::blocks::new_block;
use crate::ipam::workload::DEFAULT_STICKY_KINDS;

/// The field manager of `ipwarden adopt`'s block and claim writes.
const FIELD_MANAGER: &str = "ipwarden-adopt";

/// `ipwarden adopt` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct AdoptArgs {
    /// How to reach the cluster.
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Only print the plan; write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// The name of the CNI network (the netconf's `name`) the adopted pods' IPs belong to,
    /// which their records carry as an ADD's do: the chart's `cni.networkName`.
    #[arg(long, env = "IPWARDEN_ADOPT_NETWORK", default_value = DEFAULT_NETWORK)]
    pub network: String,
    /// Owner kinds whose pods keep their IPs (comma-separated; empty: none), as the agents'
    /// and the controller's flag: their pods get sticky records and an IPClaim.
    #[arg(long, env = "IPWARDEN_STICKY_OWNER_KINDS", value_delimiter = ',', default_values_t = DEFAULT_STICKY_KINDS.map(String::from))]
    pub sticky_owner_kinds: Vec<String>,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// Runs `ipwarden adopt`; returns false when an IP was refused (or lost to a race), so the
/// exit status tells scripts. A failed claim write is reported after the plan, which shows
/// what was written before it.
pub async fn run(args: AdoptArgs) -> anyhow::Result<bool> {
    let client = connect(&args.cluster).await?.client;
    let pods: Vec<PodFacts> = list(&client).await?.iter().map(|p| PodFacts::of(p)).collect();
    let (pools, blocks) = (list::<IPPool>(&client).await?, list::<IPBlock>(&client).await?);
    let sticky_kinds: Vec<String> =
        args.sticky_owner_kinds.iter().map(|k| k.trim().to_string()).filter(|k| !k.is_empty()).collect();
    let mut plan = plan(&pods, &pools, &blocks, &sticky_kinds);
    let mut written = Vec::new();
    if !args.dry_run {
        let store = BlockStore::new(Api::all(client.clone()), FIELD_MANAGER.to_string(), None);
        for (name, adoptions) in by_block(&plan.adopt) {
            let first = adoptions[0];
            let cidr = first.block_cidr.parse().with_context(|| format!("block CIDR {}", first.block_cidr))?;
            let create = || new_block(name, &first.pool, cidr);
            let outcome = store
                .update(name, Some(&create), |block| {
                    let ips = apply(&mut block.spec, &adoptions, &args.network, Timestamp::now(), Writer::Operator);
                    (!ips.is_empty()).then_some(ips)
                })
                .await
                .with_context(|| format!("writing the adopted records into IPBlock {name}"))?;
            written.extend(outcome.written().unwrap_or_default());
        }
        let lost = lost_races(&mut plan, &written);
        plan.refused.extend(lost);
        let mut claims = Vec::new();
        let bound = bind_adopted(&client, FIELD_MANAGER, plan.adopt.iter().chain(&plan.recorded), &mut claims).await;
        plan.claims = claims;
        print(&plan, args.dry_run, args.output)?;
        bound.context("writing the IPClaims of adopted sticky pods")?;
    } else {
        let stored = list::<IPClaim>(&client).await?;
        let now = Timestamp::now();
        plan.claims = sticky_claims(plan.adopt.iter().chain(&plan.recorded))
            .iter()
            .map(|claim| {
                let name = (claim.first.pod.namespace.as_str(), claim.name());
                let existing =
                    stored.iter().find(|c| (c.namespace().as_deref().unwrap_or_default(), c.name_any()) == name);
                let live = live_uids(&pods, name.0, &name.1);
                claim.line(&claim.decide(existing.map(|c| &c.spec), &live, now), true)
            })
            .collect();
        print(&plan, args.dry_run, args.output)?;
    }
    Ok(plan.refused.is_empty())
}

/// Moves the planned adoptions that were not written (a record appeared for the IP between
/// the plan and the write) out of `plan.adopt`, as refusals.
fn lost_races(plan: &mut Plan, written: &[String]) -> Vec<crate::gc::adopt::Refused> {
    let (kept, lost): (Vec<Adoption>, Vec<Adoption>) =
        std::mem::take(&mut plan.adopt).into_iter().partition(|a| written.contains(&a.ip));
    plan.adopt = kept;
    lost.into_iter()
        .map(|a| crate::gc::adopt::Refused {
            ip: a.ip,
            pods: vec![format!("{}/{} ({})", a.pod.namespace, a.pod.name, a.pod.uid)],
            reason: format!("recorded in {} meanwhile: run adopt again to see by whom", a.block),
        })
        .collect()
}

fn print(plan: &Plan, dry_run: bool, output: Output) -> anyhow::Result<()> {
    if output == Output::Json {
        let mut value = serde_json::to_value(plan)?;
        value["dryRun"] = serde_json::Value::Bool(dry_run);
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    let verb = if dry_run { "would adopt" } else { "adopted" };
    let mut rows: Vec<Vec<String>> = plan
        .adopt
        .iter()
        .map(|a| {
            let pod = format!("{}/{}", a.pod.namespace, a.pod.name);
            vec![a.ip.clone(), pod, a.node.clone(), a.block.clone(), verb.to_string()]
        })
        .collect();
    rows.extend(
        plan.skipped
            .iter()
            .map(|s| vec![s.ip.clone(), s.pod.clone(), String::new(), String::new(), format!("skipped: {}", s.reason)]),
    );
    rows.extend(plan.refused.iter().map(|r| {
        vec![r.ip.clone(), r.pods.join(", "), String::new(), String::new(), format!("REFUSED: {}", r.reason)]
    }));
    print!("{}", table(&["IP", "POD", "NODE", "BLOCK", "ACTION"], &rows));
    if !plan.claims.is_empty() {
        let rows: Vec<Vec<String>> = plan
            .claims
            .iter()
            .map(|c| vec![c.claim.clone(), c.pod.clone(), c.ips.join(","), format!("claim {}", c.action)])
            .collect();
        print!("{}", table(&["IPCLAIM", "POD", "IPS", "ACTION"], &rows));
    }
    let tail = if dry_run { " (dry run: nothing written)" } else { "" };
    println!("{verb} {}, skipped {}, refused {}{tail}", plan.adopt.len(), plan.skipped.len(), plan.refused.len());
    for refused in &plan.refused {
        eprintln!("refused {}: {} ({})", refused.ip, refused.reason, refused.pods.join(", "));
    }
    Ok(())
}
