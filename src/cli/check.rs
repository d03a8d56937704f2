//! `ipwarden check`: the consistency report. Exit status 1 when it finds a problem.

use std::time::Duration;

use anyhow::Context;
use jiff::Timestamp;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;

use super::{Output, list, table};
use crate::crd::{IPBlock, IPClaim, IPPool};
use crate::gc::check::{Problem, Snapshot, check};
use crate::gc::index::ClusterIndex;
use crate::gc::rules::{NotReadyPolicy, RuleSettings};
use crate::ipam::workload::DEFAULT_STICKY_KINDS;

/// `ipwarden check` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct CheckArgs {
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// Reads the cluster's IPAM state with `client` and returns every problem in it: the report
/// of `ipwarden check`, also what the chaos suites' invariant checker polls.
pub async fn problems(client: &Client) -> anyhow::Result<Vec<Problem>> {
    let (pods, nodes) = (list::<Pod>(client).await?, list::<Node>(client).await?);
    let (claims, statefulsets) = (list::<IPClaim>(client).await?, list::<StatefulSet>(client).await?);
    let (pools, blocks) = (list::<IPPool>(client).await?, list::<IPBlock>(client).await?);
    let sticky: Vec<String> = DEFAULT_STICKY_KINDS.iter().map(|k| k.to_string()).collect();
    let index = ClusterIndex::build(&pods, &nodes, &claims, &statefulsets, &sticky);
    let snapshot = Snapshot { pods: &pods, pools: &pools, blocks: &blocks, claims: &claims, index: &index };
    let settings = RuleSettings { additional_delay: Duration::from_secs(5), not_ready: NotReadyPolicy::Keep };
    Ok(check(&snapshot, Timestamp::now(), &settings))
}

/// Runs `ipwarden check`; returns whether the cluster is consistent.
pub async fn run(args: CheckArgs) -> anyhow::Result<bool> {
    let client = Client::try_default().await.context("building the Kubernetes client from the kubeconfig")?;
    let problems = problems(&client).await?;
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
