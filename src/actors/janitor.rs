//! `ClaimJanitor`: deletes IPClaims whose workload is gone for good (completed Job pods
//! included), on a timer while the GC is on, and writes down the binding of each claim it sees in effect (its
//! spec, then `status.witnessed`, [`witness`]) soon after the index changes, creating the
//! claim a live sticky pod lacks ([`missing`]) first, all on the leader only. The only writer
//! of claims besides `ipwarden adopt` (decision 0022).

use super::leader::Leadership;
use std::collections::HashSet;
use std::time::Duration;

use actix::{Actor, ActorFutureExt, AsyncContext, Context, WrapFuture};
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Client;
use kube::api::{Api, PostParams};

use super::metrics::ControllerMetrics;
use super::watches::SharedIndex;
use crate::crd::{IPClaim, IPClaimSpec, WitnessedBinding};
use crate::gc::claims::{claimants, gone_for_good, missing, spec_lags, witness};
use crate::gc::index::ClaimBinding;

/// A claim whose binding the janitor writes down as witnessed.
struct Witnessed {
    namespace: String,
    name: String,
    /// The claim object's UID: the write goes to this object only. `None`: no claim exists,
    /// the janitor creates it with the binding as its spec.
    object_uid: Option<String>,
    binding: ClaimBinding,
    /// Whether the spec is written (the stored one says otherwise, [`spec_lags`]).
    spec: bool,
    /// Whether `status.witnessed` is written (it differs from the binding).
    status: bool,
}

/// The janitor actor.
pub struct ClaimJanitor {
    client: Client,
    index: SharedIndex,
    leading: Leadership,
    metrics: ControllerMetrics,
    interval: Duration,
    witness_interval: Duration,
    /// Whether the timed pass deletes claims (the GC is on: `--gc-enabled`).
    deletes: bool,
    /// The index's change count when the witnesses were last decided ([`SharedIndex::changes`]).
    decided_at: Option<u64>,
    /// Whether witness writes of the last decision still run.
    witnessing: bool,
    /// Claims (namespace, name) whose last witness write failed: decided again only on the
    /// timed pass, not on every change (a CRD without the status subresource, or missing
    /// RBAC, would otherwise cost a read and a write per claim every decision).
    held_back: HashSet<(String, String)>,
}

impl ClaimJanitor {
    /// A janitor deleting claims every `interval` and deciding the witnesses every
    /// `witness_interval` while the index changed since, and on each deletion pass (which
    /// retries writes that failed); deleting none unless `deletes` (the GC is on).
    pub fn new(
        client: Client,
        index: SharedIndex,
        leading: Leadership,
        metrics: ControllerMetrics,
        interval: Duration,
        witness_interval: Duration,
        deletes: bool,
    ) -> Self {
        Self {
            client,
            index,
            leading,
            metrics,
            interval,
            witness_interval,
            deletes,
            decided_at: None,
            witnessing: false,
            held_back: HashSet::new(),
        }
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        if !self.leading.is_leading() {
            return;
        }
        self.decided_at = None;
        self.held_back.clear();
        self.witness(ctx);
        if !self.deletes {
            return;
        }
        let doomed: Vec<(String, String, String)> = {
            let index = self.index.read();
            index
                .claims()
                .filter(|(namespace, name, claim)| gone_for_good(&index, namespace, name, claim))
                .map(|(namespace, name, claim)| (namespace.to_string(), name.to_string(), claim.pod_uid.clone()))
                .collect()
        };
        if doomed.is_empty() {
            return;
        }
        let (client, leading) = (self.client.clone(), self.leading.clone());
        ctx.spawn(
            async move {
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

    /// Decides which claims to write down as witnessed, and which to create, unless nothing
    /// changed since the last decision or its writes still run, and writes them one after the
    /// other.
    fn witness(&mut self, ctx: &mut Context<Self>) {
        if !self.leading.is_leading() {
            self.decided_at = None;
            return;
        }
        // Read before the index: an event applied after this read is decided again next time.
        let changes = self.index.changes();
        if self.witnessing || self.decided_at == Some(changes) {
            return;
        }
        self.decided_at = Some(changes);
        let due: Vec<Witnessed> = {
            let index = self.index.read();
            let claimants = claimants(&index);
            index
                .claims()
                .filter_map(|(namespace, name, claim)| {
                    let binding = witness(&index, &claimants, namespace, name, claim)?;
                    Some(Witnessed {
                        spec: spec_lags(claim, &binding),
                        status: claim.witnessed.as_ref() != Some(&binding),
                        binding,
                        namespace: namespace.to_string(),
                        name: name.to_string(),
                        object_uid: Some(claim.object_uid.clone()),
                    })
                })
                .chain(missing(&index, &claimants).into_iter().map(|(namespace, name, binding)| Witnessed {
                    namespace,
                    name,
                    object_uid: None,
                    binding,
                    spec: true,
                    status: true,
                }))
                .filter(|claim| {
                    self.held_back.is_empty()
                        || !self.held_back.contains(&(claim.namespace.clone(), claim.name.clone()))
                })
                .collect()
        };
        if due.is_empty() {
            return;
        }
        self.witnessing = true;
        let (client, leading, metrics) = (self.client.clone(), self.leading.clone(), self.metrics.clone());
        ctx.spawn(
            async move {
                let mut failed = Vec::new();
                for claim in due {
                    if !leading.is_leading() {
                        break;
                    }
                    let result = write_witnessed(&client, &metrics, &claim).await.unwrap_or_else(|e| {
                        tracing::warn!(claim = %format!("{}/{}", claim.namespace, claim.name), error = %e,
                            "writing the claim's witnessed binding failed; the next timed pass retries");
                        Some("failed")
                    });
                    if let Some(result) = result {
                        metrics.witness_write(result);
                    }
                    if matches!(result, Some("failed" | "no_status_subresource")) {
                        failed.push((claim.namespace, claim.name));
                    }
                }
                failed
            }
            .into_actor(self)
            .map(|failed, act, _| {
                act.witnessing = false;
                act.held_back.extend(failed);
            }),
        );
    }
}

/// Writes `claim`'s binding into its spec (when due, keeping `boundAt` while the pod is the
/// same) and then its `status.witnessed` (when due), each read first and replaced with the
/// resourceVersion read, on the object of the claim's UID only (a claim deleted and created
/// again since is another object; a conflict is decided again on the next change). The spec
/// goes first, so that a reader seeing the witness sees the spec saying the same. A claim to
/// create is created with the binding as its spec (counted as `created` in `metrics`); one
/// created since (by `ipwarden adopt`, or an older version's agent) is a conflict. Returns the
/// result to count, `None` when the claim is gone or another object.
async fn write_witnessed(
    client: &Client,
    metrics: &ControllerMetrics,
    claim: &Witnessed,
) -> Result<Option<&'static str>, kube::Error> {
    let (namespace, name, binding) = (&claim.namespace, &claim.name, &claim.binding);
    let api: Api<IPClaim> = Api::namespaced(client.clone(), namespace);
    let spec = |bound_at: Option<&Time>| IPClaimSpec {
        pod_uid: binding.pod_uid.clone(),
        node: binding.node.clone(),
        owner: binding.owner.clone(),
        sticky: true,
        interfaces: binding.interfaces.clone(),
        bound_at: bound_at.cloned().unwrap_or_else(|| Time(Timestamp::now())),
    };
    let mut stored = match &claim.object_uid {
        Some(uid) => {
            let Some(mut stored) = api.get_opt(name).await? else { return Ok(None) };
            if stored.metadata.uid.as_deref() != Some(uid.as_str()) {
                return Ok(None);
            }
            if claim.spec {
                let same_pod = stored.spec.pod_uid == binding.pod_uid;
                stored.spec = spec(same_pod.then_some(&stored.spec.bound_at));
                stored = match api.replace(name, &PostParams::default(), &stored).await {
                    Ok(written) => written,
                    Err(kube::Error::Api(status)) if status.code == 404 => return Ok(None),
                    Err(kube::Error::Api(status)) if status.code == 409 => return Ok(Some("conflict")),
                    Err(e) => return Err(e),
                };
                tracing::debug!(claim = %format!("{namespace}/{name}"), pod_uid = %binding.pod_uid, node = %binding.node,
                    "wrote the claim's spec as its records bind it");
            }
            if !claim.status {
                return Ok(Some("written"));
            }
            stored
        }
        None => {
            let mut fresh = IPClaim::new(name, spec(None));
            fresh.metadata.namespace = Some(namespace.clone());
            match api.create(&PostParams::default(), &fresh).await {
                Ok(created) => {
                    tracing::info!(claim = %format!("{namespace}/{name}"), pod_uid = %binding.pod_uid, node = %binding.node,
                        "created the claim of a live sticky pod that had none, from its records");
                    metrics.witness_write("created");
                    created
                }
                Err(kube::Error::Api(status)) if status.code == 409 => return Ok(Some("conflict")),
                Err(e) => return Err(e),
            }
        }
    };
    stored.status.get_or_insert_default().witnessed = Some(WitnessedBinding {
        pod_uid: binding.pod_uid.clone(),
        node: binding.node.clone(),
        owner: binding.owner.clone(),
        interfaces: binding.interfaces.clone(),
        at: Time(Timestamp::now()),
    });
    match api.replace_status(name, &PostParams::default(), &stored).await {
        Ok(_) => {
            tracing::debug!(claim = %format!("{namespace}/{name}"), "wrote the claim's witnessed binding");
            Ok(Some("written"))
        }
        // Deleted since it was read (an unwitnessed claim's agent may delete it), or, while it
        // is still there, a CRD without the status subresource (installed by an older version
        // and not upgraded: install.md, "Upgrade").
        Err(kube::Error::Api(status)) if status.code == 404 => {
            if api.get_opt(name).await?.is_none_or(|c| c.metadata.uid != stored.metadata.uid) {
                return Ok(None);
            }
            tracing::warn!(claim = %format!("{namespace}/{name}"), "the IPClaim has no status subresource to write the witnessed binding to: apply this version's CRDs");
            Ok(Some("no_status_subresource"))
        }
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(Some("conflict")),
        Err(e) => Err(e),
    }
}

impl Actor for ClaimJanitor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(self.interval, |act, ctx| act.tick(ctx));
        ctx.run_interval(self.witness_interval, |act, ctx| act.witness(ctx));
    }
}
