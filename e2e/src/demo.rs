//! The demo workload of `make demo`: a StatefulSet and a Deployment whose pods are deleted
//! one at a time, round robin, so IPs are handed out and returned continuously.

use std::time::Duration;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use crate::error::{Error, Result};

/// The namespace the demo runs in.
pub const NAMESPACE: &str = "default";

/// The label every demo pod carries, with its workload's name as value.
const APP_LABEL: &str = "ipwarden-demo";

fn template(app: &str) -> serde_json::Value {
    json!({
        "metadata": {"labels": {APP_LABEL: app}},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "containers": [{"name": "app", "image": "registry.invalid/ipwarden-demo/app:1"}],
        },
    })
}

/// Creates the demo StatefulSet `web` and Deployment `api`, 3 replicas each.
pub async fn create(client: &Client) -> Result<()> {
    let statefulset: StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"replicas": 3, "serviceName": "web", "selector": {"matchLabels": {APP_LABEL: "web"}},
                 "template": template("web")},
    }))
    .map_err(|e| Error::Kube { what: "building the demo StatefulSet".into(), source: kube::Error::SerdeError(e) })?;
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "api"},
        "spec": {"replicas": 3, "selector": {"matchLabels": {APP_LABEL: "api"}}, "template": template("api")},
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

/// Deletes one running demo pod every `interval`, alternating between the workloads,
/// until the future is dropped. Errors are logged, not fatal: churn goes on.
pub async fn churn(client: Client, interval: Duration) {
    let selectors = ["web", "api"].map(|app| format!("{APP_LABEL}={app}"));
    churn_selected(client, NAMESPACE, &selectors, interval).await;
}

/// Deletes the oldest running pod matching `selector` in `namespace` every `interval`, until
/// the future is dropped: the churn of the chaos suites.
pub async fn churn_pods(client: Client, namespace: &str, selector: &str, interval: Duration) {
    churn_selected(client, namespace, &[selector.to_string()], interval).await;
}

async fn churn_selected(client: Client, namespace: &str, selectors: &[String], interval: Duration) {
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
            tracing::info!(pod = %pod.name_any(), "churn: deleting pod");
            if let Err(e) = pods.delete(&pod.name_any(), &DeleteParams::default()).await {
                tracing::warn!(pod = %pod.name_any(), error = %e, "churn: deleting pod failed");
            }
        }
    }
}
