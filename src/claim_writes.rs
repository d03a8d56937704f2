//! The one way an IPClaim is written for a sticky pod's IPs by an ADD, and by `ipwarden adopt`
//! for a pod another IPAM started (never over a live newer pod's); a stateless pod has none
//! (docs/decisions/0015). Also the one way a claim is deleted by ipwarden, and the one way it
//! is rebound to another pod outside an ADD: deleted and rebound only while it is still bound
//! to the pod UID the decision was made for (a recreated pod may have taken it over meanwhile).

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::{Client, ResourceExt};

use crate::block_store::{CasError, CasStore};
use crate::crd::{ClaimedInterface, IPClaim, IPClaimSpec, OwnerRef};
use crate::gc::index::PodFacts;
use crate::ipam::workload;

/// A sticky pod's IPs of one interface, as its IPClaim records them.
#[derive(Clone, Debug)]
pub struct Binding<'a> {
    /// The pod's namespace.
    pub namespace: &'a str,
    /// The pod's name.
    pub pod: &'a str,
    /// The pod's UID, which the claim is bound to.
    pub uid: &'a str,
    /// The pod's node.
    pub node: &'a str,
    /// The pod's controller, which names the claim of a KubeVirt VM's pods.
    pub owner: Option<&'a OwnerRef>,
    /// The interface and its IPs.
    pub interface: ClaimedInterface,
}

/// Writes `binding` into the sticky pod's IPClaim (created, or taken over from a previous pod of
/// the same name, keeping a sticky predecessor's other interfaces ([`workload::claim_interfaces`]))
/// with compare-and-swap under `field_manager`. Returns the claim's name and the spec it
/// replaced (`None`: the claim was created).
pub async fn bind(
    client: &Client,
    field_manager: String,
    binding: &Binding<'_>,
) -> Result<(String, Option<IPClaimSpec>), CasError> {
    let name = workload::claim_name(binding.pod, binding.owner);
    let spec_over = |existing: Option<&IPClaimSpec>| IPClaimSpec {
        pod_uid: binding.uid.to_string(),
        node: binding.node.to_string(),
        owner: binding.owner.cloned(),
        sticky: true,
        interfaces: workload::claim_interfaces(existing, binding.uid, binding.interface.clone()),
        bound_at: Time(Timestamp::now()),
    };
    let create = || {
        let mut claim = IPClaim::new(&name, spec_over(None));
        claim.metadata.namespace = Some(binding.namespace.to_string());
        claim
    };
    let store = CasStore::new(Api::<IPClaim>::namespaced(client.clone(), binding.namespace), field_manager, None);
    // A sticky pod's claim usually exists: read it first. `None`: created (an object not yet
    // stored has no resourceVersion).
    let before = store
        .update(&name, Some(&create), |claim| {
            let stored = claim.metadata.resource_version.is_some();
            let spec = spec_over(stored.then_some(&claim.spec));
            let before = std::mem::replace(&mut claim.spec, spec);
            Some(stored.then_some(before))
        })
        .await?
        .written()
        .flatten();
    Ok((name, before))
}

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
/// resourceVersion; returns whether it was deleted. With `even_witnessed` false (an agent),
/// a claim the controller witnessed (`status.witnessed`) is left for the controller to delete
/// once its workload is gone (rule C-2, decision 0022): its pod may be on its way to another
/// node, whose ADD takes the witnessed IPs back.
pub async fn delete_if_bound_to(
    client: &Client,
    namespace: &str,
    name: &str,
    pod_uid: &str,
    even_witnessed: bool,
) -> Result<bool, kube::Error> {
    let api: Api<IPClaim> = Api::namespaced(client.clone(), namespace);
    let Some(claim) = bound_claim(&api, name, pod_uid).await? else { return Ok(false) };
    if !even_witnessed && claim.status.as_ref().is_some_and(|s| s.witnessed.is_some()) {
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
