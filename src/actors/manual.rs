//! `ManualTrigger`: how an operator's `ipwarden gc` reaches the leader. The CLI writes a
//! request ID (and its mode) into the ConfigMap [`TRIGGER_CONFIGMAP`] in the controller's
//! namespace; the leader sees it, sweeps (or plans a dry run with its own settings), and
//! writes the answer back under the same ID. Only kubeconfig access is needed, no route to
//! the controller's pods. The contract is [`crate::gc::manual`].

use super::leader::Leadership;
use std::collections::BTreeMap;
use std::time::Duration;

use actix::{Actor, ActorFutureExt, Addr, AsyncContext, Context, WrapFuture};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};

use super::pool::Trigger;
use super::sweeper::{PlanNow, SweepNow, Sweeper};
use crate::gc::manual::{ERROR_KEY, HANDLED_KEY, MODE_KEY, Mode, REQUEST_KEY, RESULT_KEY, TRIGGER_CONFIGMAP};

/// How often the leader looks for a request.
const POLL_INTERVAL: Duration = Duration::from_secs(1);

/// The trigger actor.
pub struct ManualTrigger {
    api: Api<ConfigMap>,
    sweeper: Addr<Sweeper>,
    leading: Leadership,
    busy: bool,
}

impl ManualTrigger {
    /// A trigger watching the ConfigMap through `api` (namespaced to the controller's).
    pub fn new(api: Api<ConfigMap>, sweeper: Addr<Sweeper>, leading: Leadership) -> Self {
        Self { api, sweeper, leading, busy: false }
    }

    fn poll(&mut self, ctx: &mut Context<Self>) {
        if self.busy || !self.leading.is_leading() {
            return;
        }
        self.busy = true;
        let (api, sweeper, leading) = (self.api.clone(), self.sweeper.clone(), self.leading.clone());
        let work = async move {
            let Some(map) = api.get_opt(TRIGGER_CONFIGMAP).await? else { return Ok(()) };
            let data = map.data.unwrap_or_default();
            let Some(request) = data.get(REQUEST_KEY).filter(|r| data.get(HANDLED_KEY) != Some(*r)).cloned() else {
                return Ok(());
            };
            let mode = Mode::of(data.get(MODE_KEY).map(String::as_str));
            tracing::info!(%request, mode = mode.value(), "manual GC requested");
            let answer = match mode {
                Mode::Sweep => encode(sweeper.send(SweepNow(Trigger::Manual)).await),
                Mode::DryRun => encode(sweeper.send(PlanNow).await),
            };
            let (result, error) = match answer {
                Ok(result) => (result, String::new()),
                Err(e) => (String::new(), e),
            };
            let answer: BTreeMap<&str, String> =
                [(HANDLED_KEY, request), (RESULT_KEY, result), (ERROR_KEY, error)].into_iter().collect();
            let patch = serde_json::json!({"data": answer});
            if !leading.is_leading() {
                tracing::info!("leadership lapsed during a manual GC; the next leader answers the request");
                return Ok(());
            }
            api.patch(TRIGGER_CONFIGMAP, &PatchParams::default(), &Patch::Merge(&patch)).await.map(drop)
        };
        ctx.spawn(work.into_actor(self).map(|result: Result<(), kube::Error>, act, _| {
            act.busy = false;
            if let Err(e) = result {
                tracing::warn!(error = %e, "serving a manual GC request failed");
            }
        }));
    }
}

/// The sweeper's answer as the text under [`RESULT_KEY`], or the error for [`ERROR_KEY`].
fn encode<T: serde::Serialize>(answer: Result<Result<T, String>, actix::MailboxError>) -> Result<String, String> {
    let value = answer.map_err(|e| format!("the sweeper did not answer: {e}"))??;
    serde_json::to_string(&value).map_err(|e| format!("encoding the answer: {e}"))
}

impl Actor for ManualTrigger {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(POLL_INTERVAL, |act, ctx| act.poll(ctx));
    }
}
