//! The StatefulSet scale storm of the peer benchmark (`ipwarden-e2e churn --storm-cycles`):
//! two StatefulSets of [`REPLICAS`] pods compete for a pool of exactly [`REPLICAS`] IPs. Each
//! cycle scales the running one to 0 and the other to [`REPLICAS`] at once, and waits until
//! the other runs with IPs and no pod of the first is left. Measured per IPAM: how long each
//! handover took, IPs seen on two live pods at once, and how many pods came back with the IP
//! their name had the last time it ran (sticky IPs kept).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde::Serialize;
use serde_json::json;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::CniNetwork;
use crate::churn::{Latency, watch_conflicts};
use crate::cluster::{Cluster, ClusterOptions};
use crate::error::{Error, Result};
use crate::wait::{self, Probe};

/// Pods per StatefulSet, and IPs in the pool.
pub const REPLICAS: i32 = 5;

/// The pool's CIDR: [`REPLICAS`] of its addresses, [`FIRST_IP`] to [`LAST_IP`], are handed out;
/// its first address after the network address, 10.60.0.1, is ipwarden's defaulted gateway
/// (decision 0019, as host-local's), so the range starts after it, for every IPAM alike.
pub const CIDR: &str = "10.60.0.0/29";

/// The first IP handed out.
pub const FIRST_IP: &str = "10.60.0.2";

/// The last IP handed out.
pub const LAST_IP: &str = "10.60.0.6";

/// ipwarden's agent flags in the storm: the chart's default of asking the node's runtime over
/// CRI, and a released IP may be reused after 1 s instead of 30 s, as in the storm test
/// (tests/rbac_scale_storm.rs); with 5 IPs handed over at once, the default cooldown would be
/// most of every handover.
pub const AGENT_ARGS: [&str; 2] = [crate::ipwarden::WITH_CRI, "--reuse-cooldown-seconds=1"];

/// The namespace of the StatefulSets.
const NAMESPACE: &str = "default";

/// The label every storm pod carries.
const STORM_LABEL: &str = "e2e.ipwarden.io/storm";

/// The two StatefulSets; cycle `n` hands the pool from `SETS[n % 2]` to the other.
const SETS: [&str; 2] = ["alpha", "beta"];

/// How the storm runs.
#[derive(Clone, Debug)]
pub struct StormOptions {
    /// Handovers from one StatefulSet to the other.
    pub cycles: u32,
    /// How long one handover may take before the storm is given up.
    pub handover_timeout: Duration,
}

/// What the storm measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StormReport {
    /// Handovers completed.
    pub cycles: u32,
    /// From the scale calls to the incoming set running with IPs and the outgoing one gone.
    pub handover: Latency,
    /// Distinct (IP, pods) pairs whose pods' sandboxes held the IP at once.
    pub ip_conflicts: usize,
    /// Up to ten of them.
    pub examples: Vec<String>,
    /// Distinct IPs an outgoing pod still showed after its sandbox let go of them, while an
    /// incoming pod had them (not conflicts).
    pub lingering: usize,
    /// Up to ten of them.
    pub lingering_examples: Vec<String>,
    /// Pods that ran again under a name that had run before (every incoming pod after the
    /// first two cycles).
    pub returned: u64,
    /// Of those, with the IP their name had the last time it ran.
    pub sticky_kept: u64,
    /// Whether every cycle completed; when not, why in `failure`.
    pub completed: bool,
    /// Why the storm stopped early; empty when it completed.
    pub failure: String,
}

/// ipwarden's pool in the storm: [`FIRST_IP`] to [`LAST_IP`] of [`CIDR`], the default pool.
pub fn pool() -> serde_json::Value {
    json!({"cidr": CIDR, "ranges": [{"start": FIRST_IP, "end": LAST_IP}], "default": true})
}

/// Starts a cluster of `nodes` simulated nodes (`network`: ipwarden's, from
/// [`crate::ipwarden::network`]) running `binary`'s agents and controllers on the storm's pool.
pub async fn start_ipwarden(
    nodes: usize,
    binary: &Path,
    network: CniNetwork,
) -> Result<(Cluster, crate::ipwarden::Installation)> {
    let options = ClusterOptions { nodes, network: Some(network), ..ClusterOptions::default() };
    let cluster = Cluster::start(options).await?;
    match crate::ipwarden::install_with(&cluster, binary, pool(), &AGENT_ARGS, &[]).await {
        Ok(installation) => Ok((cluster, installation)),
        Err(e) => {
            cluster.stop_after_failure();
            Err(e)
        }
    }
}

/// Of the pods `now` (name -> IP), how many ran before under the same name (in `last`) and how
/// many of those have the IP they had then.
pub fn returned_and_kept(last: &BTreeMap<String, String>, now: &BTreeMap<String, String>) -> (u64, u64) {
    now.iter().fold((0, 0), |(returned, kept), (name, ip)| match last.get(name) {
        Some(before) => (returned + 1, kept + u64::from(before == ip)),
        None => (returned, kept),
    })
}

fn statefulset(name: &str, replicas: i32) -> Result<StatefulSet> {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "serviceName": name, "podManagementPolicy": "Parallel",
                 "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name, STORM_LABEL: "true"}},
                              "spec": {"terminationGracePeriodSeconds": 1,
                                       "containers": [{"name": "app", "image": "registry.invalid/storm:1"}]}}},
    }))
    .map_err(|e| Error::Kube { what: format!("building StatefulSet {name}"), source: kube::Error::SerdeError(e) })
}

async fn scale(sets: &Api<StatefulSet>, name: &str, replicas: i32) -> Result<()> {
    let patch = json!({"spec": {"replicas": replicas}});
    sets.patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .map(drop)
        .map_err(Error::kube(format!("scaling StatefulSet {name} to {replicas}")))
}

/// Waits until `incoming` runs [`REPLICAS`] pods with IPs and no pod of `outgoing` exists;
/// returns the incoming pods' IPs by name.
async fn wait_handover(
    pods: &Api<Pod>,
    incoming: &str,
    outgoing: &str,
    timeout: Duration,
) -> Result<BTreeMap<String, String>> {
    wait::until(&format!("{REPLICAS} pods of {incoming} with IPs, none of {outgoing} left"), timeout, || async {
        let list = pods
            .list(&ListParams::default().labels(&format!("{STORM_LABEL}=true")))
            .await
            .map_err(Error::kube("listing storm pods"))?;
        let of = |set: &str| {
            list.items.iter().filter(move |p| p.labels().get("app").is_some_and(|app| app == set)).collect::<Vec<_>>()
        };
        let running: BTreeMap<String, String> = of(incoming)
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| Some((p.name_any(), p.status.as_ref()?.pod_ip.clone()?)))
            .collect();
        let left = of(outgoing).len();
        Ok(if running.len() == REPLICAS as usize && left == 0 {
            Probe::Done(running)
        } else {
            Probe::Pending(format!("{incoming}: {} with IPs, {outgoing}: {left} left", running.len()))
        })
    })
    .await
}

/// Runs the storm on `cluster`, whose IPAM hands out exactly [`REPLICAS`] IPs, and reports.
pub async fn run(cluster: &Cluster, options: &StormOptions) -> Result<StormReport> {
    let client: Client = cluster.client();
    let (store, writer) = reflector::store::<Pod>();
    let mut background = JoinSet::new();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let config = watcher::Config::default().labels(&format!("{STORM_LABEL}=true"));
    let reflected = watcher(pods.clone(), config).default_backoff().reflect(writer).applied_objects();
    background.spawn(reflected.for_each(|_| async {}));
    let sandboxes = crate::kubelet::SandboxSource::of(cluster.nodes());
    let seen = watch_conflicts(store, sandboxes, &mut background, "the storm's pod watch").await?;

    let sets: Api<StatefulSet> = Api::namespaced(client, NAMESPACE);
    for (name, replicas) in [(SETS[0], REPLICAS), (SETS[1], 0)] {
        sets.create(&PostParams::default(), &statefulset(name, replicas)?)
            .await
            .map_err(Error::kube(format!("creating StatefulSet {name}")))?;
    }
    let mut report = StormReport::default();
    let mut last: BTreeMap<String, String> = BTreeMap::new();
    let mut handovers = Vec::new();
    let outcome = async {
        last = wait_handover(&pods, SETS[0], SETS[1], options.handover_timeout).await?;
        for cycle in 0..options.cycles {
            let (outgoing, incoming) = (SETS[cycle as usize % 2], SETS[(cycle as usize + 1) % 2]);
            let started = Instant::now();
            scale(&sets, outgoing, 0).await?;
            scale(&sets, incoming, REPLICAS).await?;
            let now = wait_handover(&pods, incoming, outgoing, options.handover_timeout).await?;
            handovers.push(started.elapsed().as_secs_f64());
            let (returned, kept) = returned_and_kept(&last, &now);
            report.returned += returned;
            report.sticky_kept += kept;
            report.cycles += 1;
            last.extend(now);
        }
        Result::Ok(())
    }
    .await;
    background.abort_all();
    match outcome {
        Ok(()) => report.completed = true,
        Err(Error::Timeout { what, last, .. }) => report.failure = format!("{what}: {last}"),
        Err(e) => return Err(e),
    }
    report.handover = Latency::of_samples(handovers);
    let seen = crate::churn::with(&seen, |seen| seen.clone());
    report.ip_conflicts = seen.conflicts.len();
    report.examples = seen.conflicts.into_iter().take(10).collect();
    report.lingering = seen.lingering.len();
    report.lingering_examples = seen.lingering.into_iter().take(10).collect();
    Ok(report)
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn only_names_that_ran_before_count_and_kept_means_the_same_ip() {
        let map = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs.iter().map(|(n, ip)| (n.to_string(), ip.to_string())).collect()
        };
        let last = map(&[("alpha-0", "10.60.0.1"), ("alpha-1", "10.60.0.2")]);
        let now = map(&[("alpha-0", "10.60.0.1"), ("alpha-1", "10.60.0.3"), ("alpha-2", "10.60.0.2")]);
        assert_eq!(returned_and_kept(&last, &now), (2, 1));
        assert_eq!(returned_and_kept(&BTreeMap::new(), &now), (0, 0));
    }
}
