//! The demo workload of `make demo`: a StatefulSet and a Deployment whose pods are deleted
//! one at a time, round robin, so IPs are handed out and returned continuously; and its
//! narration, one line per notable change of the IPBlocks ([`notable`] decides which).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde::Deserialize;
use serde_json::json;

use crate::error::{Error, Result};
use crate::up::Say;
use crate::wait::{self, Probe};

/// The namespace the demo runs in.
pub const NAMESPACE: &str = "default";

/// The label every demo pod carries, with its workload's name as value.
const APP_LABEL: &str = "ipwarden-demo";

/// A demo pod template of workload `app`: for the simulated nodes (whose runtime pulls
/// nothing), or for the real nodes (their workload image: [`crate::realnode::workload_spec`]).
fn template(app: &str, on_real_nodes: bool) -> serde_json::Value {
    let spec = match on_real_nodes {
        true => crate::realnode::workload_spec(),
        false => json!({
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "app", "image": "registry.invalid/ipwarden-demo/app:1"}],
        }),
    };
    json!({"metadata": {"labels": {APP_LABEL: app}}, "spec": spec})
}

/// Creates the demo StatefulSet `web` and Deployment `api`, 3 replicas each, on the real nodes
/// when `on_real_nodes`.
pub async fn create(client: &Client, on_real_nodes: bool) -> Result<()> {
    let statefulset: StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 3, "serviceName": "web", "selector": {"matchLabels": {APP_LABEL: "web"}},
                 "template": template("web", on_real_nodes)},
    }))
    .map_err(|e| Error::Kube { what: "building the demo StatefulSet".into(), source: kube::Error::SerdeError(e) })?;
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "api"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {APP_LABEL: "api"}}, "template": template("api", on_real_nodes)},
    }))
    .map_err(|e| Error::Kube { what: "building the demo Deployment".into(), source: kube::Error::SerdeError(e) })?;
    Api::<StatefulSet>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &statefulset)
        .await
        .map_err(Error::kube("creating StatefulSet default/web"))?;
    Api::<Deployment>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &deployment)
        .await
        .map_err(Error::kube("creating Deployment default/api"))?;
    Ok(())
}

/// How many pods the demo workload runs: 3 of the StatefulSet, 3 of the Deployment.
const DEMO_PODS: usize = 6;

/// Waits until every demo pod runs with an IP (the summary is said after that).
pub async fn wait_running(client: &Client, timeout: Duration) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    wait::until("the demo pods running with their IPs", timeout, || {
        let pods = pods.clone();
        async move {
            let list = pods
                .list(&ListParams::default().labels(APP_LABEL))
                .await
                .map_err(Error::kube("listing the demo pods"))?;
            let running = list
                .items
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .filter(|p| {
                    p.status.as_ref().is_some_and(|s| s.phase.as_deref() == Some("Running") && s.pod_ip.is_some())
                })
                .count();
            Ok(if running >= DEMO_PODS {
                Probe::Done(())
            } else {
                Probe::Pending(format!("{running}/{DEMO_PODS} running"))
            })
        }
    })
    .await
}

/// Deletes one running demo pod every `interval`, alternating between the workloads, saying
/// each deletion, until the future is dropped. Errors are logged, not fatal: churn goes on.
pub async fn churn(client: Client, interval: Duration, say: Say) {
    let selectors = ["web", "api"].map(|app| format!("{APP_LABEL}={app}"));
    churn_selected(client, NAMESPACE, &selectors, interval, |pod| {
        say(&format!("{} pod {NAMESPACE}/{pod} deleted", clock()));
    })
    .await;
}

/// Deletes the oldest running pod matching `selector` in `namespace` every `interval`, until
/// the future is dropped: the churn of the chaos suites.
pub async fn churn_pods(client: Client, namespace: &str, selector: &str, interval: Duration) {
    churn_selected(client, namespace, &[selector.to_string()], interval, |pod| {
        tracing::info!(pod, "churn: deleted pod");
    })
    .await;
}

async fn churn_selected(
    client: Client,
    namespace: &str,
    selectors: &[String],
    interval: Duration,
    deleted: impl Fn(&str),
) {
    let pods: Api<Pod> = Api::namespaced(client, namespace);
    for selector in selectors.iter().cycle() {
        tokio::time::sleep(interval).await;
        let victim = match pods.list(&ListParams::default().labels(selector)).await {
            Ok(list) => list
                .items
                .into_iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .min_by_key(|p| p.creation_timestamp().map(|t| t.0)),
            Err(e) => {
                tracing::warn!(error = %e, "churn: listing pods failed");
                continue;
            }
        };
        if let Some(pod) = victim {
            match pods.delete(&pod.name_any(), &DeleteParams::default()).await {
                Ok(_) => deleted(&pod.name_any()),
                Err(e) => tracing::warn!(pod = %pod.name_any(), error = %e, "churn: deleting pod failed"),
            }
        }
    }
}

/// The wall-clock time of day the narration's lines start with.
fn clock() -> String {
    jiff::Zoned::now().strftime("%H:%M:%S").to_string()
}

/// One allocation record of an IPBlock (`spec.allocations.<ip>`): the fields the narration
/// reads (the harness does not depend on the ipwarden crate, so it has its own view).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// The pod the IP is recorded for.
    pub pod: PodRef,
    /// The node of the pod's sandbox.
    #[serde(default)]
    pub node: String,
    /// The sandbox holding the IP; empty while a sticky pod is away (its reservation).
    #[serde(default)]
    pub container_id: String,
    /// The pod's controller.
    #[serde(default)]
    pub owner: Option<Owner>,
    /// Whether the IP stays with the pod's name across restarts.
    #[serde(default)]
    pub sticky: bool,
    /// The release handshake under way, if the controller (or a sticky takeover) marked it.
    #[serde(default)]
    pub release_handshake: Option<Mark>,
}

/// The pod a record names.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct PodRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its UID: a recreated pod of the same name has another.
    pub uid: String,
}

/// A record's owner, as the agent found it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Owner {
    /// StatefulSet, ReplicaSet, ...
    pub kind: String,
    /// The owner's name.
    pub name: String,
}

/// A record's release handshake: the rule row that marked it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Mark {
    /// The rule row's reason (`pod_gone`, ...).
    #[serde(default)]
    pub reason: String,
}

impl PodRef {
    fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

impl Record {
    fn owner_text(&self) -> String {
        match &self.owner {
            Some(owner) => format!("{} {}", owner.kind, owner.name),
            None => "no owner".to_string(),
        }
    }
}

/// A change of an IPBlock worth a line of the demo's narration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Notable {
    /// A pod got an IP that no pod of its name held.
    Allocated {
        /// The IP.
        ip: String,
        /// The pod, `namespace/name`.
        pod: String,
        /// Its node.
        node: String,
    },
    /// An IP became free.
    Released {
        /// The IP.
        ip: String,
        /// The pod it was recorded for.
        pod: String,
        /// That pod's node.
        node: String,
        /// The rule row of the controller's mark, when the record was marked for release.
        rule: Option<String>,
    },
    /// A sticky pod's sandbox went and its IP stays reserved for the pod's return.
    Kept {
        /// The IP.
        ip: String,
        /// The pod it is kept for.
        pod: String,
        /// The pod's owner, `kind name`.
        owner: String,
    },
    /// A recreated sticky pod took its predecessor's IP back.
    Back {
        /// The IP.
        ip: String,
        /// The pod, `namespace/name`.
        pod: String,
        /// Its owner, `kind name`.
        owner: String,
    },
}

impl fmt::Display for Notable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Notable::Allocated { ip, pod, node } => write!(f, "pod {pod} got {ip} on {node}"),
            Notable::Released { ip, pod, node, rule: None } => write!(f, "{ip} of pod {pod} on {node} released"),
            Notable::Released { ip, pod, node, rule: Some(rule) } => {
                write!(f, "{ip} of pod {pod} on {node} released, marked by the controller's rule {rule}")
            }
            Notable::Kept { ip, pod, owner } => write!(f, "{ip} kept for pod {pod} ({owner}) while it is away"),
            Notable::Back { ip, pod, owner } => write!(f, "pod {pod} back with its IP {ip} ({owner})"),
        }
    }
}

/// What changed between two versions of one IPBlock's records (IP to record), in IP order:
/// records gone are releases; a record passed to a new pod of the same name is a sticky pod
/// back with its IP, to another pod a release and an allocation; a sticky record whose
/// sandbox went is kept; new records are allocations. Other changes (marks, answers) are not
/// notable.
pub fn notable(before: &BTreeMap<String, Record>, after: &BTreeMap<String, Record>) -> Vec<Notable> {
    let released = |ip: &str, old: &Record| Notable::Released {
        ip: ip.to_string(),
        pod: old.pod.key(),
        node: old.node.clone(),
        rule: old.release_handshake.as_ref().map(|m| m.reason.clone()),
    };
    let allocated =
        |ip: &str, new: &Record| Notable::Allocated { ip: ip.to_string(), pod: new.pod.key(), node: new.node.clone() };
    let ips: BTreeSet<&String> = before.keys().chain(after.keys()).collect();
    let mut changes = Vec::new();
    for ip in ips {
        match (before.get(ip), after.get(ip)) {
            (Some(old), None) => changes.push(released(ip, old)),
            (None, Some(new)) => changes.push(allocated(ip, new)),
            (Some(old), Some(new)) if old.pod.uid != new.pod.uid => {
                if new.sticky && old.pod.key() == new.pod.key() {
                    changes.push(Notable::Back { ip: ip.clone(), pod: new.pod.key(), owner: new.owner_text() });
                } else {
                    changes.push(released(ip, old));
                    changes.push(allocated(ip, new));
                }
            }
            (Some(old), Some(new)) if new.sticky && !old.container_id.is_empty() && new.container_id.is_empty() => {
                changes.push(Notable::Kept { ip: ip.clone(), pod: new.pod.key(), owner: new.owner_text() });
            }
            _ => {}
        }
    }
    changes
}

/// The records of an IPBlock object.
fn records(block: &DynamicObject) -> Result<BTreeMap<String, Record>, serde_json::Error> {
    match block.data.pointer("/spec/allocations") {
        Some(allocations) => serde_json::from_value(allocations.clone()),
        None => Ok(BTreeMap::new()),
    }
}

/// Watches the IPBlocks and says one line per [`Notable`] change, stamped with the time,
/// until the future is dropped. The first listing is the baseline and says nothing; `synced`
/// is sent once it is read, so nothing done after that goes unsaid.
pub async fn narrate(client: Client, say: Say, synced: tokio::sync::oneshot::Sender<()>) {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk("ipwarden.io", "v1alpha1", "IPBlock"));
    let api: Api<DynamicObject> = Api::all_with(client, &resource);
    let mut events = watcher(api, watcher::Config::default()).default_backoff().boxed();
    let mut blocks: HashMap<String, BTreeMap<String, Record>> = HashMap::new();
    let mut listed: Option<BTreeSet<String>> = None;
    let mut synced = Some(synced);
    let empty = BTreeMap::new();
    while let Some(event) = events.next().await {
        let mut changes = Vec::new();
        match event {
            Ok(watcher::Event::Init) => listed = Some(BTreeSet::new()),
            Ok(watcher::Event::InitApply(block) | watcher::Event::Apply(block)) => {
                let name = block.name_any();
                let new = match records(&block) {
                    Ok(records) => records,
                    Err(e) => {
                        tracing::warn!(block = %name, error = %e, "demo: reading the block's records failed");
                        continue;
                    }
                };
                if let Some(listed) = &mut listed {
                    listed.insert(name.clone());
                }
                // A block first seen in the first listing is the baseline; any later one is news.
                let baseline = synced.is_some() && listed.is_some();
                if !baseline {
                    changes = notable(blocks.get(&name).unwrap_or(&empty), &new);
                }
                blocks.insert(name, new);
            }
            Ok(watcher::Event::Delete(block)) => {
                if let Some(old) = blocks.remove(&block.name_any()) {
                    changes = notable(&old, &empty);
                }
            }
            Ok(watcher::Event::InitDone) => {
                // Blocks deleted while the watch was down.
                let seen = listed.take().unwrap_or_default();
                let gone: Vec<String> = blocks.keys().filter(|name| !seen.contains(*name)).cloned().collect();
                for name in gone {
                    if let Some(old) = blocks.remove(&name) {
                        changes.extend(notable(&old, &empty));
                    }
                }
                if let Some(synced) = synced.take() {
                    let _nobody_waits = synced.send(());
                }
            }
            Err(e) => tracing::warn!(error = %e, "demo: watching IPBlocks failed; retrying"),
        }
        for change in changes {
            say(&format!("{} {change}", clock()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, uid: &str, container_id: &str, sticky: bool) -> Record {
        let kind = if sticky { "StatefulSet" } else { "ReplicaSet" };
        Record {
            pod: PodRef { namespace: "default".into(), name: name.into(), uid: uid.into() },
            node: "node-1".into(),
            container_id: container_id.into(),
            owner: Some(Owner { kind: kind.into(), name: "web".into() }),
            sticky,
            release_handshake: None,
        }
    }

    fn block(records: &[(&str, Record)]) -> BTreeMap<String, Record> {
        records.iter().map(|(ip, r)| (ip.to_string(), r.clone())).collect()
    }

    #[test]
    fn each_kind_of_change_of_a_block_gives_its_line() {
        let web = record("web-1", "u1", "c1", true);
        let api = record("api-x", "u2", "c2", false);
        let marked = Record { release_handshake: Some(Mark { reason: "pod_gone".into() }), ..api.clone() };
        let kept = Record { container_id: String::new(), ..web.clone() };
        let back = record("web-1", "u3", "c3", true);
        let other = record("api-y", "u4", "c4", false);
        let cases: Vec<(&str, BTreeMap<_, _>, BTreeMap<_, _>, Vec<&str>)> = vec![
            (
                "new record",
                block(&[]),
                block(&[("10.0.0.1", api.clone())]),
                vec!["pod default/api-x got 10.0.0.1 on node-1"],
            ),
            (
                "record gone",
                block(&[("10.0.0.1", api.clone())]),
                block(&[]),
                vec!["10.0.0.1 of pod default/api-x on node-1 released"],
            ),
            (
                "marked record gone",
                block(&[("10.0.0.1", marked)]),
                block(&[]),
                vec!["10.0.0.1 of pod default/api-x on node-1 released, marked by the controller's rule pod_gone"],
            ),
            (
                "sticky sandbox gone",
                block(&[("10.0.0.2", web.clone())]),
                block(&[("10.0.0.2", kept.clone())]),
                vec!["10.0.0.2 kept for pod default/web-1 (StatefulSet web) while it is away"],
            ),
            (
                "sticky pod back",
                block(&[("10.0.0.2", kept)]),
                block(&[("10.0.0.2", back)]),
                vec!["pod default/web-1 back with its IP 10.0.0.2 (StatefulSet web)"],
            ),
            (
                "record passed to another pod",
                block(&[("10.0.0.1", api.clone())]),
                block(&[("10.0.0.1", other)]),
                vec!["10.0.0.1 of pod default/api-x on node-1 released", "pod default/api-y got 10.0.0.1 on node-1"],
            ),
            (
                "a mark written is not news",
                block(&[("10.0.0.1", api.clone())]),
                block(&[(
                    "10.0.0.1",
                    Record { release_handshake: Some(Mark { reason: "pod_gone".into() }), ..api.clone() },
                )]),
                vec![],
            ),
            (
                "a stateless pod of the same name again is a new allocation",
                block(&[("10.0.0.1", api.clone())]),
                block(&[("10.0.0.1", Record { pod: PodRef { uid: "u9".into(), ..api.pod.clone() }, ..api.clone() })]),
                vec!["10.0.0.1 of pod default/api-x on node-1 released", "pod default/api-x got 10.0.0.1 on node-1"],
            ),
            ("unchanged", block(&[("10.0.0.2", web.clone())]), block(&[("10.0.0.2", web)]), vec![]),
        ];
        for (case, before, after, expected) in cases {
            let lines: Vec<String> = notable(&before, &after).iter().map(ToString::to_string).collect();
            assert_eq!(lines, expected, "{case}");
        }
    }

    #[test]
    fn a_record_as_the_apiserver_stores_it_is_read() {
        let block: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "ipwarden.io/v1alpha1", "kind": "IPBlock", "metadata": {"name": "default-10-244-0-0-24"},
            "spec": {"pool": "default", "cidr": "10.244.0.0/24", "allocations": {"10.244.0.5": {
                "pod": {"namespace": "default", "name": "web-0", "uid": "u1"}, "node": "node-0", "network": "ipwarden",
                "containerId": "", "interface": "eth0", "owner": {"kind": "StatefulSet", "name": "web"},
                "sticky": true, "allocatedAt": "2026-01-01T00:00:00Z",
                "releaseHandshake": {"state": "marked-for-release", "markedAt": "2026-01-01T00:00:00Z", "reason": "pod_gone"}}}},
        }))
        .expect("an IPBlock");
        let records = records(&block).expect("its records");
        let record = &records["10.244.0.5"];
        assert_eq!((record.pod.name.as_str(), record.sticky, record.container_id.as_str()), ("web-0", true, ""));
        assert_eq!(record.release_handshake.as_ref().map(|m| m.reason.as_str()), Some("pod_gone"));
    }
}
