//! `ClaimJanitor`: deletes IPClaims whose workload is gone for good (completed Job pods
//! included), and writes down the binding of each claim it sees in effect
//! (`status.witnessed`, [`witness`]), on the leader only, on a timer.

use super::leader::Leadership;
use std::time::Duration;

use actix::{Actor, AsyncContext, Context, WrapFuture};
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Client;
use kube::api::{Api, PostParams};

use super::watches::SharedIndex;
use crate::crd::{ClaimedInterface, IPClaim, WitnessedBinding};
use crate::gc::claims::{gone_for_good, witness};

/// A claim's binding the janitor writes down as witnessed: namespace, name, the claim
/// object's UID, and pod UID, node and IPs per interface.
type Witnessed = (String, String, String, (String, String, Vec<ClaimedInterface>));

/// The janitor actor.
pub struct ClaimJanitor {
    client: Client,
    index: SharedIndex,
    leading: Leadership,
    interval: Duration,
}

impl ClaimJanitor {
    /// A janitor running every `interval`.
    pub fn new(client: Client, index: SharedIndex, leading: Leadership, interval: Duration) -> Self {
        Self { client, index, leading, interval }
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        if !self.leading.is_leading() {
            return;
        }
        let (doomed, witnessed): (Vec<(String, String, String)>, Vec<Witnessed>) = {
            let index = self.index.read();
            let doomed = index
                .claims()
                .filter(|(namespace, name, claim)| gone_for_good(&index, namespace, name, claim))
                .map(|(namespace, name, claim)| (namespace.to_string(), name.to_string(), claim.pod_uid.clone()))
                .collect();
            let witnessed = index
                .claims()
                .filter_map(|(namespace, name, claim)| {
                    let binding = witness(&index, namespace, name, claim)?;
                    Some((namespace.to_string(), name.to_string(), claim.object_uid.clone(), binding))
                })
                .collect();
            (doomed, witnessed)
        };
        if doomed.is_empty() && witnessed.is_empty() {
            return;
        }
        let (client, leading) = (self.client.clone(), self.leading.clone());
        ctx.spawn(
            async move {
                for (namespace, name, object_uid, (pod_uid, node, interfaces)) in witnessed {
                    if !leading.is_leading() {
                        return;
                    }
                    let binding = WitnessedBinding { pod_uid, node, interfaces, at: Time(Timestamp::now()) };
                    if let Err(e) = write_witnessed(&client, &namespace, &name, &object_uid, binding).await {
                        tracing::warn!(claim = %format!("{namespace}/{name}"), error = %e, "writing the claim's witnessed binding failed; the next pass retries");
                    }
                }
                for (namespace, name, uid) in doomed {
                    // Checked right before each write: leadership may lapse mid-pass.
                    if !leading.is_leading() {
                        return;
                    }
                    match crate::claim_writes::delete_if_bound_to(&client, &namespace, &name, &uid).await {
                        Ok(true) => tracing::info!(claim = %format!("{namespace}/{name}"), "deleted a claim whose workload is gone"),
                        Ok(false) => {}
                        Err(e) => tracing::warn!(claim = %format!("{namespace}/{name}"), error = %e, "deleting a claim failed"),
                    }
                }
            }
            .into_actor(self),
        );
    }
}

/// Writes `binding` into claim `namespace/name`'s `status.witnessed`, read first and replaced
/// with the resourceVersion read, on the object of UID `object_uid` only and while its spec
/// still names that binding (a claim deleted and created again since is another object, a spec
/// changed since is decided again; a conflict waits for the next pass).
async fn write_witnessed(
    client: &Client,
    namespace: &str,
    name: &str,
    object_uid: &str,
    binding: WitnessedBinding,
) -> Result<(), kube::Error> {
    let api: Api<IPClaim> = Api::namespaced(client.clone(), namespace);
    let Some(mut claim) = api.get_opt(name).await? else { return Ok(()) };
    let spec = &claim.spec;
    let same_spec =
        spec.pod_uid == binding.pod_uid && spec.node == binding.node && spec.interfaces == binding.interfaces;
    if claim.metadata.uid.as_deref() != Some(object_uid) || !same_spec {
        return Ok(());
    }
    claim.status.get_or_insert_default().witnessed = Some(binding);
    match api.replace_status(name, &PostParams::default(), &claim).await {
        Ok(_) => tracing::debug!(claim = %format!("{namespace}/{name}"), "wrote the claim's witnessed binding"),
        // Just read, so most likely a CRD without the status subresource (installed by an
        // older version and not upgraded: install.md, "Upgrade").
        Err(kube::Error::Api(status)) if status.code == 404 => {
            tracing::warn!(claim = %format!("{namespace}/{name}"), "the IPClaim has no status subresource to write the witnessed binding to: apply this version's CRDs");
        }
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(e) => return Err(e),
    }
    Ok(())
}

impl Actor for ClaimJanitor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(self.interval, |act, ctx| act.tick(ctx));
    }
}
