//! `ClaimJanitor`: deletes IPClaims whose workload is gone for good (completed Job pods
//! included), on the leader only, on a timer.

use super::leader::Leadership;
use std::time::Duration;

use actix::{Actor, AsyncContext, Context, WrapFuture};
use kube::Client;

use super::watches::SharedIndex;
use crate::gc::claims::gone_for_good;

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
}

impl Actor for ClaimJanitor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(self.interval, |act, ctx| act.tick(ctx));
    }
}
