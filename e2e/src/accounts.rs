//! Running a process as a ServiceAccount: a kubeconfig holding a token the apiserver issued
//! for that account through the TokenRequest API, so the process is authenticated and
//! authorised exactly as a pod of that account would be (RBAC included, no admin rights).

use std::path::{Path, PathBuf};

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};

use crate::cluster::Cluster;
use crate::error::{Error, Result};

/// How long the issued tokens live: longer than any test.
const TOKEN_SECONDS: i64 = 4 * 3600;

/// Writes a kubeconfig for ServiceAccount `namespace/name` (which must exist) into the run
/// directory and returns its path.
pub async fn kubeconfig_for(cluster: &Cluster, namespace: &str, name: &str) -> Result<PathBuf> {
    let spec = TokenRequestSpec { expiration_seconds: Some(TOKEN_SECONDS), ..TokenRequestSpec::default() };
    let path = cluster.dir().join(format!("sa-{namespace}-{name}.kubeconfig"));
    write_kubeconfig(cluster, namespace, name, spec, &path).await?;
    Ok(path)
}

/// Requests a token for ServiceAccount `namespace/name` as `spec` says and writes a
/// kubeconfig holding it at `path`.
async fn write_kubeconfig(
    cluster: &Cluster,
    namespace: &str,
    name: &str,
    spec: TokenRequestSpec,
    path: &Path,
) -> Result<()> {
    let accounts: Api<ServiceAccount> = Api::namespaced(cluster.client(), namespace);
    let request = TokenRequest { spec: Some(spec), ..TokenRequest::default() };
    let issued = accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .map_err(Error::kube(format!("requesting a token for ServiceAccount {namespace}/{name}")))?;
    let token = issued.status.and_then(|s| s.token).unwrap_or_default();
    let user = format!("system:serviceaccount:{namespace}:{name}");
    cluster.pki().write_kubeconfig(path, cluster.server(), &user, serde_json::json!({"token": token}))
}

/// Like [`kubeconfig_for`], with a token bound to a pod of that ServiceAccount on `node`, as
/// kubelet mints for a DaemonSet's pod: since Kubernetes 1.32 such a token names the pod's
/// node in the user's extra `authentication.kubernetes.io/node-name`, which the chart's
/// node-bound write policies read. Creates the pod (`<name>-<node>`, host network, so no CNI
/// runs for it) unless it exists; the token stays valid while the pod does.
pub async fn node_bound_kubeconfig_for(cluster: &Cluster, namespace: &str, name: &str, node: &str) -> Result<PathBuf> {
    let pod_name = format!("{name}-{node}");
    let pods: Api<Pod> = Api::namespaced(cluster.client(), namespace);
    let pod = match pods.get_opt(&pod_name).await.map_err(Error::kube(format!("reading pod {namespace}/{pod_name}")))? {
        Some(pod) => pod,
        None => {
            let pod = Pod {
                metadata: ObjectMeta {
                    name: Some(pod_name.clone()),
                    namespace: Some(namespace.to_string()),
                    ..ObjectMeta::default()
                },
                spec: Some(PodSpec {
                    node_name: Some(node.to_string()),
                    service_account_name: Some(name.to_string()),
                    host_network: Some(true),
                    containers: vec![Container {
                        name: "identity".to_string(),
                        image: Some("identity".to_string()),
                        ..Container::default()
                    }],
                    ..PodSpec::default()
                }),
                ..Pod::default()
            };
            pods.create(&PostParams::default(), &pod)
                .await
                .map_err(Error::kube(format!("creating the identity pod {namespace}/{pod_name} on {node}")))?
        }
    };
    let bound = BoundObjectReference {
        api_version: Some("v1".to_string()),
        kind: Some("Pod".to_string()),
        name: Some(pod_name.clone()),
        uid: pod.metadata.uid.clone(),
    };
    let spec = TokenRequestSpec {
        expiration_seconds: Some(TOKEN_SECONDS),
        bound_object_ref: Some(bound),
        ..TokenRequestSpec::default()
    };
    let path = cluster.dir().join(format!("sa-{namespace}-{name}-{node}.kubeconfig"));
    write_kubeconfig(cluster, namespace, name, spec, &path).await?;
    Ok(path)
}
