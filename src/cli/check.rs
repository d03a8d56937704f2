//! `ipwarden check`: the consistency report. Exit status 1 when it finds a problem.

use std::time::Duration;

use jiff::Timestamp;
use kube::Client;

use super::connect::{ClusterArgs, connect};
use super::{Output, list_cluster, table};
use crate::gc::check::{Problem, Snapshot, check};
use crate::gc::rules::{NotReadyPolicy, RuleSettings};

/// `ipwarden check` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct CheckArgs {
    /// How to reach the cluster.
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// Reads the cluster's IPAM state with `client` and returns every problem in it: the report
/// of `ipwarden check`, also what the chaos suites' invariant checker polls.
pub async fn problems(client: &Client) -> anyhow::Result<Vec<Problem>> {
    let listed = list_cluster(client).await?;
    let snapshot = Snapshot {
        pods: &listed.pods,
        pools: &listed.pools,
        blocks: &listed.blocks,
        claims: &listed.claims,
        index: &listed.index,
    };
    let settings = RuleSettings { additional_delay: Duration::from_secs(5), not_ready: NotReadyPolicy::Keep };
    Ok(check(&snapshot, Timestamp::now(), &settings))
}

/// Runs `ipwarden check`; returns whether the cluster is consistent.
pub async fn run(args: CheckArgs) -> anyhow::Result<bool> {
    let problems = problems(&connect(&args.cluster).await?.client).await?;
    match args.output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&serde_json::json!({"problems": problems}))?),
        Output::Table if problems.is_empty() => println!("no problem found"),
        Output::Table => {
            let rows: Vec<Vec<String>> = problems
                .iter()
                .map(|p| {
                    vec![
                        serde_json::to_value(p.kind)
                            .map(|v| v.as_str().unwrap_or_default().to_string())
                            .unwrap_or_default(),
                        p.subject.clone(),
                        p.detail.clone(),
                    ]
                })
                .collect();
            print!("{}", table(&["PROBLEM", "SUBJECT", "DETAIL"], &rows));
        }
    }
    Ok(problems.is_empty())
}
