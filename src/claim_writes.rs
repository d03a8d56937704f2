//! The one way `ipwarden adopt` writes an IPClaim for a pod another IPAM started (never over
//! a live newer pod's); a stateless pod has none (docs/decisions/0015). Also the one way the
//! controller deletes a claim: only while it is still bound to the pod UID the decision was
//! made for (a recreated pod may have taken it over meanwhile). Agents write no claim: the
//! controller creates a sticky pod's claim and writes what it holds (decision 0022).

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Preconditions};
use kube::{Client, ResourceExt};

use crate::block_store::{CasError, CasStore};
use crate::crd::IPClaim;
use crate::gc::index::PodFacts;

/// Why [`bind_adopted`] failed.
#[derive(Debug, thiserror::Error)]
pub enum AdoptedClaimError {
    /// The claim's compare-and-swap failed.
    #[error(transparent)]
    Write(#[from] CasError),
    /// Reading the claim, or the pods that tell whether its pod lives, failed.
    #[error("{what}: {source}")]
    Read {
        /// What was being read, naming the claim.
        what: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
}

/// Writes the IPClaim of each sticky pod among `adopted`, the adoptions whose records are
/// written ([`crate::gc::adopt::sticky_claims`]): after the records, for `ipwarden adopt` and
/// the agent's start-up adoption alike. Unlike [`bind`], it creates a claim, updates one bound
/// to the adopted pod, or takes over one whose pod no longer runs while the adopted pod does,
/// with compare-and-swap ([`crate::gc::adopt::StickyClaim::decide`]); a claim already as it
/// would be written is not written. Appends each claim's line to `done` as it is handled, so
/// that a caller shows what was done before an error.
pub async fn bind_adopted<'a>(
    client: &Client,
    field_manager: &str,
    adopted: impl IntoIterator<Item = &'a crate::gc::adopt::Adoption>,
    done: &mut Vec<crate::gc::adopt::ClaimLine>,
) -> Result<(), AdoptedClaimError> {
    use crate::gc::adopt::ClaimWrite;
    for claim in crate::gc::adopt::sticky_claims(adopted) {
        let now = Timestamp::now();
        let fresh = match claim.decide(None, &[], now) {
            ClaimWrite::Create(spec) => spec,
            other => {
                done.push(claim.line(&other, false));
                continue;
            }
        };
        let (namespace, name) = (&claim.first.pod.namespace, claim.name());
        let create = || {
            let mut stored = IPClaim::new(&name, fresh.clone());
            stored.metadata.namespace = Some(namespace.clone());
            stored
        };
        let api = Api::<IPClaim>::namespaced(client.clone(), namespace);
        let store = CasStore::new(api.clone(), field_manager.to_string(), None);
        let read = |what: String| move |source| AdoptedClaimError::Read { what, source };
        // The pods are read after the claim, and the claim is written only while bound to the
        // UID it had before: a pod that bound it since ran after that read. Each round needs
        // another pod's ADD to bind the claim between two reads.
        let decision = loop {
            let stored = api.get_opt(&name).await.map_err(read(format!("reading IPClaim {namespace}/{name}")))?;
            let bound = stored.as_ref().map(|c| c.spec.pod_uid.clone());
            let live = match &bound {
                Some(uid) if *uid != claim.first.pod.uid => {
                    let what = format!("listing the pods of {namespace} for IPClaim {name}, bound to pod UID {uid}");
                    let pods = Api::<Pod>::namespaced(client.clone(), namespace)
                        .list(&ListParams::default())
                        .await
                        .map_err(read(what))?;
                    let pods: Vec<PodFacts> = pods.items.iter().map(PodFacts::of).collect();
                    crate::gc::adopt::live_uids(&pods, namespace, &name)
                }
                _ => Vec::new(),
            };
            let mut decision = None;
            store
                .update_from(&name, stored, Some(&create), |stored| {
                    // Not yet stored (no resourceVersion): being created.
                    let existing = stored.metadata.resource_version.is_some().then_some(&stored.spec);
                    decision =
                        (existing.map(|c| &c.pod_uid) == bound.as_ref()).then(|| claim.decide(existing, &live, now));
                    match decision.as_ref()? {
                        ClaimWrite::Create(spec) | ClaimWrite::Update(spec) | ClaimWrite::TakeOver { spec, .. } => {
                            stored.spec = spec.clone();
                            Some(())
                        }
                        _ => None,
                    }
                })
                .await?;
            if let Some(decision) = decision {
                break decision;
            }
        };
        done.push(claim.line(&decision, false));
    }
    Ok(())
}

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

/// Claim `name`, if it exists and is bound to `pod_uid`.
async fn bound_claim(api: &Api<IPClaim>, name: &str, pod_uid: &str) -> Result<Option<IPClaim>, kube::Error> {
    Ok(api.get_opt(name).await?.filter(|c| c.spec.pod_uid == pod_uid))
}
