//! `ipwarden gc`: ask the leader for a full sweep and print its report, or with `--dry-run`
//! ask it what a sweep would release and by which rule row, planned with its own flags and
//! index, changing nothing. The request travels through [`crate::gc::manual`]'s ConfigMap.

use std::time::Duration;

use anyhow::{Context, bail};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};

use super::connect::{ClusterArgs, connect};
use super::{Output, table};
use crate::gc::manual::{
    DryRunPlan, ERROR_KEY, HANDLED_KEY, MODE_KEY, Mode, REQUEST_KEY, RESULT_KEY, SweepReport, TRIGGER_CONFIGMAP,
};

/// `ipwarden gc` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct GcArgs {
    /// How to reach the cluster.
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Only list what a sweep would release or repair, and by which rule; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// The controller's namespace (where its Lease and the trigger ConfigMap live)
    /// [default: the kubeconfig context's namespace, else `default`].
    #[arg(long, short = 'n', env = "IPWARDEN_NAMESPACE")]
    pub namespace: Option<String>,
    /// Seconds to wait for the leader's report.
    #[arg(long, default_value_t = 120)]
    pub timeout_seconds: u64,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// Collect another IPAM's leftovers instead.
    #[command(subcommand)]
    pub target: Option<GcTarget>,
}

/// What else `ipwarden gc` can collect.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum GcTarget {
    /// Release the standard host-local plugin's reservations that no live pod of the node holds.
    HostLocal(HostLocalArgs),
}

/// `ipwarden gc host-local` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct HostLocalArgs {
    /// host-local's data directory (its `dataDir`, default /var/lib/cni/networks).
    #[arg(long, default_value = "/var/lib/cni/networks")]
    pub data_dir: std::path::PathBuf,
    /// The network name (the netconf `name`; a directory under the data directory).
    #[arg(long)]
    pub network: String,
    /// The node whose pods hold the live IPs.
    #[arg(long, env = "NODE_NAME")]
    pub node: String,
    /// Only reservations written at least this long ago are collected (an ADD in flight has
    /// reserved its IP before its pod's status shows it).
    #[arg(long, default_value_t = 300)]
    pub min_age_seconds: u64,
    /// List what would be released; remove nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// Runs `ipwarden gc`.
pub async fn run(args: GcArgs) -> anyhow::Result<()> {
    let connection = connect(&args.cluster).await?;
    let (client, namespace) = (connection.client, args.namespace.clone().unwrap_or(connection.namespace));
    match &args.target {
        Some(GcTarget::HostLocal(host_local)) => collect_host_local(&client, host_local, args.output).await,
        None if args.dry_run => {
            let plan = serde_json::from_str(&ask_leader(&client, &namespace, &args, Mode::DryRun).await?)
                .context("decoding the dry-run plan")?;
            print_plan(&plan, args.output)
        }
        None => {
            let report = serde_json::from_str(&ask_leader(&client, &namespace, &args, Mode::Sweep).await?)
                .context("decoding the sweep report")?;
            print_report(&report, args.output)
        }
    }
}

async fn collect_host_local(client: &Client, args: &HostLocalArgs, output: Output) -> anyhow::Result<()> {
    let live = crate::hostlocal::live_ips_on_node(client, &args.node)
        .await
        .with_context(|| format!("listing the pods of node {}", args.node))?;
    let min_age = Duration::from_secs(args.min_age_seconds);
    let released = crate::hostlocal::collect(&args.data_dir, &args.network, &live, min_age, args.dry_run)?;
    let verb = if args.dry_run { "would release" } else { "released" };
    if output == Output::Json {
        let items: Vec<serde_json::Value> = released
            .iter()
            .map(|r| serde_json::json!({"ip": r.ip.to_string(), "containerId": r.container_id, "ifname": r.ifname}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({"dryRun": args.dry_run, "released": items}))?);
        return Ok(());
    }
    let rows: Vec<Vec<String>> = released
        .iter()
        .map(|r| vec![r.ip.to_string(), r.container_id.clone(), r.ifname.clone().unwrap_or_default()])
        .collect();
    print!("{}", table(&["IP", "CONTAINER", "IFNAME"], &rows));
    println!("{verb} {} host-local reservations of network {}", released.len(), args.network);
    Ok(())
}

fn print_plan(plan: &DryRunPlan, output: Output) -> anyhow::Result<()> {
    if output == Output::Json {
        println!("{}", serde_json::to_string_pretty(plan)?);
        return Ok(());
    }
    let rows: Vec<Vec<String>> = plan
        .changes
        .iter()
        .map(|c| vec![c.ip.clone(), c.pool.clone(), c.pod.clone(), c.action.clone(), c.rule.clone()])
        .collect();
    print!("{}", table(&["IP", "POOL", "POD", "ACTION", "RULE"], &rows));
    println!(
        "{} records scanned, {} would change, {} traced until their deadline (dry run: nothing changed)",
        plan.scanned,
        plan.changes.len(),
        plan.traced
    );
    Ok(())
}

/// Writes a request of `mode` into the trigger ConfigMap in `namespace` and returns the
/// leader's answer (the JSON under [`RESULT_KEY`]) once it has one.
async fn ask_leader(client: &Client, namespace: &str, args: &GcArgs, mode: Mode) -> anyhow::Result<String> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let request = format!("{}", Timestamp::now().as_nanosecond());
    let data = serde_json::json!({REQUEST_KEY: request, MODE_KEY: mode.value()});
    let patch = serde_json::json!({"data": data});
    match api.patch(TRIGGER_CONFIGMAP, &PatchParams::default(), &Patch::Merge(&patch)).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 404 => {
            let map: ConfigMap = serde_json::from_value(serde_json::json!({
                "metadata": {"name": TRIGGER_CONFIGMAP, "namespace": namespace}, "data": data,
            }))?;
            api.create(&PostParams::default(), &map)
                .await
                .with_context(|| format!("creating the GC trigger ConfigMap {namespace}/{TRIGGER_CONFIGMAP}"))?;
        }
        Err(e) => return Err(e).context(format!("writing the GC request into {namespace}/{TRIGGER_CONFIGMAP}")),
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(args.timeout_seconds);
    loop {
        let data = api.get(TRIGGER_CONFIGMAP).await.context("reading the GC report")?.data.unwrap_or_default();
        if data.get(HANDLED_KEY) == Some(&request) {
            if let Some(error) = data.get(ERROR_KEY).filter(|e| !e.is_empty()) {
                bail!("the controller could not answer the {} request: {error}", mode.value());
            }
            return Ok(data.get(RESULT_KEY).cloned().unwrap_or_default());
        }
        if std::time::Instant::now() >= deadline {
            bail!(
                "no report within {} s: is an ipwarden controller leading in namespace {}?",
                args.timeout_seconds,
                namespace
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn print_report(report: &SweepReport, output: Output) -> anyhow::Result<()> {
    if output == Output::Json {
        println!("{}", serde_json::to_string_pretty(report)?);
        return Ok(());
    }
    let rows = vec![
        vec!["scanned".into(), report.scanned.to_string()],
        vec!["released".into(), report.released.to_string()],
        vec!["repaired".into(), report.repaired.to_string()],
        vec!["marked for release".into(), report.marked.to_string()],
        vec!["handshakes aborted".into(), report.aborted.to_string()],
        vec!["takeovers answered".into(), report.answered.to_string()],
        vec!["migration targets detached".into(), report.detached.to_string()],
        vec!["skipped at write".into(), report.skipped.to_string()],
        vec!["failed".into(), report.failed.to_string()],
        vec!["traced".into(), report.traced.to_string()],
    ];
    print!("{}", table(&["SWEEP", "RECORDS"], &rows));
    for (reason, count) in &report.kept {
        println!("kept {count} ({reason})");
    }
    println!("took {} ms", report.duration_ms);
    Ok(())
}
