//! The one way an IPClaim is deleted by ipwarden: only while it is still bound to the pod
//! UID the decision was made for (a recreated pod may have taken it over meanwhile).

use kube::api::{Api, DeleteParams, Preconditions};
use kube::{Client, ResourceExt};

use crate::crd::IPClaim;

/// Deletes claim `namespace/name` if it names `pod_uid`, with a precondition on its UID and
/// resourceVersion; returns whether it was deleted.
pub async fn delete_if_bound_to(
    client: &Client,
    namespace: &str,
    name: &str,
    pod_uid: &str,
) -> Result<bool, kube::Error> {
    let api: Api<IPClaim> = Api::namespaced(client.clone(), namespace);
    let Some(claim) = api.get_opt(name).await? else { return Ok(false) };
    if claim.spec.pod_uid != pod_uid {
        return Ok(false);
    }
    let params = DeleteParams {
        preconditions: Some(Preconditions { uid: claim.uid(), resource_version: claim.resource_version() }),
        ..DeleteParams::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}
