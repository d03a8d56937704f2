//! The one way an IPClaim is deleted by ipwarden, and the one way it is rebound to another
//! pod outside an ADD: only while it is still bound to the pod UID the decision was made for
//! (a recreated pod may have taken it over meanwhile).

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
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
    let Some(claim) = bound_claim(&api, name, pod_uid).await? else { return Ok(false) };
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

/// Binds claim `namespace/name` to pod `to_uid` on `node` if it names `from_uid` (a live
/// migration's target inheriting its VM's claim), with the resourceVersion read; returns
/// whether it was rebound. A conflict means someone else changed it: not rebound.
pub async fn rebind_if_bound_to(
    client: &Client,
    namespace: &str,
    name: &str,
    from_uid: &str,
    to_uid: &str,
    node: &str,
) -> Result<bool, kube::Error> {
    let api: Api<IPClaim> = Api::namespaced(client.clone(), namespace);
    let Some(mut claim) = bound_claim(&api, name, from_uid).await? else { return Ok(false) };
    claim.spec.pod_uid = to_uid.to_string();
    claim.spec.node = node.to_string();
    claim.spec.bound_at = Time(Timestamp::now());
    match api.replace(name, &PostParams::default(), &claim).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Claim `name`, if it exists and is bound to `pod_uid`.
async fn bound_claim(api: &Api<IPClaim>, name: &str, pod_uid: &str) -> Result<Option<IPClaim>, kube::Error> {
    Ok(api.get_opt(name).await?.filter(|c| c.spec.pod_uid == pod_uid))
}
