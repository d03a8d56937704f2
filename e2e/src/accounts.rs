//! Running a process as a ServiceAccount: a kubeconfig holding a token the apiserver issued
//! for that account through the TokenRequest API, so the process is authenticated and
//! authorised exactly as a pod of that account would be (RBAC included, no admin rights).

use std::path::PathBuf;

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, PostParams};

use crate::cluster::Cluster;
use crate::error::{Error, Result};

/// How long the issued tokens live: longer than any test.
const TOKEN_SECONDS: i64 = 4 * 3600;

/// Writes a kubeconfig for ServiceAccount `namespace/name` (which must exist) into the run
/// directory and returns its path.
pub async fn kubeconfig_for(cluster: &Cluster, namespace: &str, name: &str) -> Result<PathBuf> {
    let accounts: Api<ServiceAccount> = Api::namespaced(cluster.client(), namespace);
    let request = TokenRequest {
        spec: Some(TokenRequestSpec { expiration_seconds: Some(TOKEN_SECONDS), ..TokenRequestSpec::default() }),
        ..TokenRequest::default()
    };
    let issued = accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .map_err(Error::kube(format!("requesting a token for ServiceAccount {namespace}/{name}")))?;
    let token = issued.status.and_then(|s| s.token).unwrap_or_default();
    let path = cluster.dir().join(format!("sa-{namespace}-{name}.kubeconfig"));
    let user = format!("system:serviceaccount:{namespace}:{name}");
    cluster.pki().write_kubeconfig(&path, cluster.server(), &user, serde_json::json!({"token": token}))?;
    Ok(path)
}
