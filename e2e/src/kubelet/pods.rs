//! The pod side of the simulated kubelet: one watcher per node dispatches pod snapshots to
//! one worker per pod UID, which converges the sandbox and the pod status on what the pod
//! asks for, level-triggered, like a kubelet's pod worker.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::{Faults, NODE_ADDRESS, Sandbox};
use crate::cni::{self, Attachment, CniNetwork, Invocation, NodeInfo, POD_IFNAME, PodArgs};

/// Pod annotation: the pod's containers exit this many seconds after it started Running
/// (Job pods); without it a pod runs until deleted.
pub const RUN_SECONDS_ANNOTATION: &str = "e2e.ipwarden.io/run-seconds";

/// Pod annotation: the exit code of a completing pod (default 0 = Succeeded; non-zero =
/// Failed).
pub const EXIT_CODE_ANNOTATION: &str = "e2e.ipwarden.io/exit-code";

/// How often the runtime asks the network plugin for its STATUS: about every 5 s, as
/// containerd 2.4 does (observed on a real node, issue 24).
const STATUS_INTERVAL: Duration = Duration::from_secs(5);

/// What a node's runtime asked its network plugin, for tests of the runtime's behaviour.
#[derive(Debug, Default)]
pub struct RuntimeCalls {
    /// Whether the last CNI STATUS call succeeded ([`NodeRuntime::status_loop`]).
    pub ready: AtomicBool,
    /// How many STATUS calls were made.
    pub status: AtomicU64,
    /// How many DEL calls succeeded.
    pub dels: AtomicU64,
    /// How many CRI `ListPodSandbox` calls were made.
    pub cri_listings: AtomicU64,
    /// How many CRI `GetContainerEvents` streams were opened.
    pub cri_event_streams: AtomicU64,
}

/// Whether a network configured for CNI `version` gets STATUS calls: 1.1.0 and later.
fn speaks_status(version: &str) -> bool {
    let mut parts = version.split('.').map(|p| p.parse::<u64>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (1, 1)
}

/// How many times the runtime tears a deleted pod's sandbox down with CNI DEL: containerd 2.4
/// under kubelet 1.37 calls it at the sandbox's stop and again at its removal, up to three
/// times in all (observed on a real node, issue 24); an IPAM must answer every one alike. The
/// first comes before kubelet lets the pod go, the others once it is gone.
const DELS_PER_DELETION: usize = 3;

/// How many times the runtime calls CNI DEL for a sandbox whose ADD failed: containerd's own
/// clean-up, then kubelet's removal of the sandbox (observed on a real node, issue 24).
const DELS_PER_FAILED_ADD: usize = 2;

/// Pod annotation: when "true", the runtime loses this pod's CNI DEL, as the node-wide
/// [`Faults::set_skip_del`] does for every pod: the IP leaks for the GC to find.
pub const SKIP_DEL_ANNOTATION: &str = "e2e.ipwarden.io/skip-del";

/// Pod annotation: the pod's containers exit this many seconds after SIGTERM (default 0:
/// at once, as most do). Until then a deleted pod keeps its sandbox, its Running status and
/// its IPs, as it drains; the grace period still caps it (SIGKILL).
pub const STOP_SECONDS_ANNOTATION: &str = "e2e.ipwarden.io/stop-seconds";

/// The grace period a pod gets when neither its deletion nor its spec names one (the
/// apiserver's default for `terminationGracePeriodSeconds`).
const DEFAULT_GRACE_SECONDS: i64 = 30;

/// Pod annotation: more interfaces of the sandbox, comma-separated (e.g. "net1"), each ADDed
/// after the pod's own interface with its own `CNI_IFNAME` and DELed before it, as Multus
/// does for secondary networks.
pub const EXTRA_INTERFACES_ANNOTATION: &str = "e2e.ipwarden.io/extra-interfaces";

/// Pod annotation: per secondary interface, netconf fields that replace the node's for that
/// interface's calls (a JSON map interface -> object, e.g. `{"net1": {"name": "net-b"}}`), as
/// Multus gives each attachment the config of its own NetworkAttachmentDefinition.
pub const EXTRA_NETCONF_ANNOTATION: &str = "e2e.ipwarden.io/extra-netconf";

/// How long a worker waits before retrying a failed CNI call or API write.
const RETRY_DELAY: Duration = Duration::from_secs(1);

/// Everything a node's pod workers share.
#[derive(Clone)]
pub(super) struct NodeRuntime {
    pub(super) client: Client,
    pub(super) node: NodeInfo,
    pub(super) network: CniNetwork,
    pub(super) faults: Arc<Faults>,
    pub(super) alive: watch::Receiver<bool>,
    pub(super) sandboxes: Arc<Mutex<HashMap<String, Sandbox>>>,
    /// Sandboxes whose ADD is in flight, with their interfaces: they exist for the runtime,
    /// so GC lists them.
    pub(super) pending: Arc<Mutex<HashMap<String, Vec<String>>>>,
    /// GC takes it for writing while it lists and calls; an ADD takes it for reading only to
    /// register as pending, so no ADD starts between the list and the GC call.
    pub(super) gc_gate: Arc<tokio::sync::RwLock<()>>,
    /// What the runtime asked the plugin.
    pub(super) calls: Arc<RuntimeCalls>,
    /// The runtime's container events (module `cri`).
    pub(super) events: super::cri::Events,
}

impl NodeRuntime {
    /// Watches the pods bound to this node and keeps one worker per pod UID.
    pub(super) async fn run(self) {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let config = watcher::Config::default().fields(&format!("spec.nodeName={}", self.node.name));
        let mut events = watcher(pods, config).default_backoff().boxed();
        let mut workers: HashMap<String, watch::Sender<Option<Pod>>> = HashMap::new();
        let mut listed: HashSet<String> = HashSet::new();
        let mut tasks = JoinSet::new();
        while let Some(event) = events.next().await {
            while tasks.try_join_next().is_some() {}
            match event {
                Ok(watcher::Event::Init) => listed.clear(),
                Ok(watcher::Event::InitApply(pod)) => {
                    listed.insert(pod.uid().unwrap_or_default());
                    self.dispatch(&mut workers, &mut tasks, pod);
                }
                Ok(watcher::Event::Apply(pod)) => self.dispatch(&mut workers, &mut tasks, pod),
                Ok(watcher::Event::InitDone) => {
                    // Pods that vanished while the watch was down are gone now.
                    workers.retain(|uid, sender| {
                        let keep = listed.contains(uid);
                        if !keep {
                            sender.send_replace(None);
                        }
                        keep
                    });
                }
                Ok(watcher::Event::Delete(pod)) => {
                    if let Some(sender) = workers.remove(&pod.uid().unwrap_or_default()) {
                        sender.send_replace(None);
                    }
                }
                Err(e) => tracing::warn!(node = %self.node.name, error = %e, "pod watch error; retrying with backoff"),
            }
        }
    }

    fn dispatch(&self, workers: &mut HashMap<String, watch::Sender<Option<Pod>>>, tasks: &mut JoinSet<()>, pod: Pod) {
        let uid = pod.uid().unwrap_or_default();
        if let Some(sender) = workers.get(&uid) {
            sender.send_replace(Some(pod));
            return;
        }
        let (sender, receiver) = watch::channel(Some(pod));
        workers.insert(uid.clone(), sender);
        tasks.spawn(self.clone().work(uid, receiver));
    }

    /// Calls the CNI 1.1 STATUS verb every [`STATUS_INTERVAL`] while the node is alive, as
    /// containerd 2.4 does (containerd 1.6 never did; a network configured for CNI before 1.1
    /// gets no STATUS), and keeps the last answer and the number of calls in `calls`. The simulated kubelet does not turn the Node NotReady on a failure, as a real
    /// one does: the harness's clusters start their nodes before the IPAM under test.
    pub(super) async fn status_loop(self) {
        let netconf = (self.network.netconf)(&self.node);
        let version = netconf.get("cniVersion").and_then(Value::as_str).unwrap_or("");
        if !speaks_status(version) {
            return;
        }
        let mut alive = self.alive.clone();
        loop {
            tokio::time::sleep(STATUS_INTERVAL).await;
            if alive.wait_for(|up| *up).await.is_err() {
                return;
            }
            let call = Invocation { command: "STATUS", container_id: "", ifname: "", pod: None, netconf: &netconf };
            let ready = match self.network.invoke_on(&self.node, &call).await {
                Ok(_) => true,
                Err(e) => {
                    tracing::debug!(node = %self.node.name, error = %e, "CNI STATUS: the network is not ready");
                    false
                }
            };
            self.calls.status.fetch_add(1, Ordering::Relaxed);
            if self.calls.ready.swap(ready, Ordering::Relaxed) != ready {
                tracing::info!(node = %self.node.name, ready, "CNI STATUS: the network's readiness changed");
            }
        }
    }

    /// Calls the CNI GC verb every `interval` with the node's live attachments; with `once`,
    /// only until a call succeeds (CRI-O's one call at its start). Until a call first succeeds
    /// the plugin's IPAM may not serve yet (the node registers before its agent starts), so
    /// failures until then are logged at debug, later ones as warnings.
    pub(super) async fn gc_loop(self, interval: Duration, once: bool) {
        let mut alive = self.alive.clone();
        let mut served = false;
        loop {
            tokio::time::sleep(interval).await;
            if alive.wait_for(|up| *up).await.is_err() {
                return;
            }
            let _gate = self.gc_gate.write().await;
            let mut valid: Vec<Attachment> = self
                .live_sandboxes()
                .into_values()
                .flat_map(|s| {
                    let ifnames = std::iter::once(s.ifname).chain(s.extra.into_iter().map(|(ifname, _)| ifname));
                    let container_id = s.container_id;
                    ifnames.map(move |ifname| Attachment { container_id: container_id.clone(), ifname })
                })
                .collect();
            let pending: Vec<(String, Vec<String>)> =
                self.pending.lock().map(|p| p.clone().into_iter().collect()).unwrap_or_default();
            valid.extend(pending.into_iter().flat_map(|(container_id, ifnames)| {
                ifnames.into_iter().map(move |ifname| Attachment { container_id: container_id.clone(), ifname })
            }));
            let netconf = cni::with_valid_attachments(&(self.network.netconf)(&self.node), &valid);
            let call = Invocation { command: "GC", container_id: "", ifname: "", pod: None, netconf: &netconf };
            match self.network.invoke_on(&self.node, &call).await {
                Ok(_) if once => return,
                Ok(_) => served = true,
                Err(e) if served => tracing::warn!(node = %self.node.name, error = %e, "CNI GC failed"),
                Err(e) => tracing::debug!(node = %self.node.name, error = %e, "CNI GC failed; not served yet"),
            }
        }
    }

    fn live_sandboxes(&self) -> HashMap<String, Sandbox> {
        self.sandboxes.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// The netconf of interface `ifname`: the node's, with the fields `netconfs` names for it.
    fn netconf_for(&self, netconfs: &NetconfOverrides, ifname: &str) -> Value {
        let mut netconf = (self.network.netconf)(&self.node);
        if let (Some(conf), Some(Value::Object(fields))) = (netconf.as_object_mut(), netconfs.get(ifname)) {
            conf.extend(fields.clone());
        }
        netconf
    }

    /// Puts the pod's sandbox into the runtime's store, or takes it out, with its events.
    fn record_sandbox(&self, uid: &str, sandbox: Option<Sandbox>) {
        let Ok(mut sandboxes) = self.sandboxes.lock() else { return };
        match sandbox {
            Some(sandbox) => {
                let id = sandbox.container_id.clone();
                if sandboxes.insert(uid.to_string(), sandbox).is_none_or(|old| old.container_id != id) {
                    self.faults.hide_if_asked(&id);
                    if !self.faults.hidden_from_cri(&id) {
                        super::cri::publish(&self.events, &id, true);
                    }
                }
            }
            None => {
                if let Some(old) = sandboxes.remove(uid)
                    && !self.faults.hidden_from_cri(&old.container_id)
                {
                    super::cri::publish(&self.events, &old.container_id, false);
                }
            }
        }
    }

    /// One pod's worker: converges until the pod is gone and its sandbox torn down.
    async fn work(self, uid: String, mut pod: watch::Receiver<Option<Pod>>) {
        let mut state = PodState::default();
        let mut alive = self.alive.clone();
        loop {
            if alive.wait_for(|up| *up).await.is_err() {
                return;
            }
            let current = pod.borrow_and_update().clone();
            let next = match current {
                None => self.pod_gone(&uid, &mut state).await,
                Some(current) => self.converge(&uid, &current, &mut state).await,
            };
            let until = match next {
                Next::Done => return,
                Next::OnChange => None,
                Next::At(when) => Some(when),
                Next::Retry => Some(Instant::now() + RETRY_DELAY),
            };
            let changed = async {
                if pod.changed().await.is_err() {
                    // The dispatcher dropped this pod after sending its last state.
                    std::future::pending::<()>().await;
                }
            };
            match until {
                Some(when) => tokio::select! {
                    _ = changed => {}
                    _ = tokio::time::sleep_until(when) => {}
                },
                None => changed.await,
            }
        }
    }

    async fn pod_gone(&self, uid: &str, state: &mut PodState) -> Next {
        if self.teardown_orphans(uid, state).await
            && self.teardown(uid, state).await
            && self.remove_sandbox(uid, state).await
        {
            Next::Done
        } else {
            Next::Retry
        }
    }

    /// DELs the sandboxes whose ADD failed, as a runtime cleans up a sandbox it could not
    /// set up; until that succeeds the pod gets no new sandbox.
    async fn teardown_orphans(&self, uid: &str, state: &mut PodState) -> bool {
        if self.faults.skip_del() || state.skip_del {
            state.orphans.clear();
        }
        while let Some(container_id) = state.orphans.last() {
            for _ in 0..DELS_PER_FAILED_ADD {
                for ifname in state.ifnames.iter().rev() {
                    let netconf = self.netconf_for(&state.netconfs, ifname);
                    let pod = state.args.as_ref();
                    let call = Invocation { command: "DEL", container_id, ifname, pod, netconf: &netconf };
                    if let Err(e) = self.network.invoke_on(&self.node, &call).await {
                        tracing::warn!(node = %self.node.name, pod_uid = %uid, error = %e, "CNI DEL of a failed sandbox failed; retrying");
                        return false;
                    }
                    self.calls.dels.fetch_add(1, Ordering::Relaxed);
                }
            }
            state.orphans.pop();
        }
        true
    }

    async fn converge(&self, uid: &str, pod: &Pod, state: &mut PodState) -> Next {
        if !self.teardown_orphans(uid, state).await {
            return Next::Retry;
        }
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref()).unwrap_or("Pending");
        if let Some(deletion) = pod.metadata.deletion_timestamp.as_ref() {
            if state.sandbox.is_some() {
                let stop_seconds = annotation_u64(pod, STOP_SECONDS_ANNOTATION).unwrap_or(0);
                let stopped = containers_stopped_at(deletion.0, grace_seconds(pod), stop_seconds);
                if let Ok(left) = Duration::try_from(stopped.duration_since(Timestamp::now())) {
                    // Draining: the containers still run, so the sandbox and its IPs stay.
                    return Next::At(Instant::now() + left);
                }
            }
            if !self.teardown(uid, state).await {
                return Next::Retry;
            }
            return match self.delete_pod(pod, uid).await {
                true => Next::OnChange,
                false => Next::Retry,
            };
        }
        if phase == "Succeeded" || phase == "Failed" {
            return if self.teardown(uid, state).await { Next::OnChange } else { Next::Retry };
        }
        let host_network = pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false);
        if state.sandbox.is_none() && !host_network {
            return self.add(uid, pod, state).await;
        }
        let started = *state.started.get_or_insert_with(|| (Instant::now(), Timestamp::now()));
        if !state.running_posted {
            let due = started.0 + self.faults.status_delay();
            if Instant::now() < due {
                return Next::At(due);
            }
            let ips = state.sandbox.as_ref().map(|s| s.ips.clone()).unwrap_or_else(|| vec![NODE_ADDRESS.to_string()]);
            let annotations = match &self.network.network_status {
                Some(network) => {
                    json!({cni::NETWORK_STATUS_ANNOTATION: cni::network_status(network, POD_IFNAME, &ips)})
                }
                None => json!({}),
            };
            if !self.patch_status(pod, uid, annotations, running_status(pod, uid, &ips, started.1)).await {
                return Next::Retry;
            }
            state.running_posted = true;
        }
        let Some(run_for) = annotation_u64(pod, RUN_SECONDS_ANNOTATION) else { return Next::OnChange };
        let finish = started.0 + Duration::from_secs(run_for);
        if Instant::now() < finish {
            return Next::At(finish);
        }
        let exit_code = annotation_u64(pod, EXIT_CODE_ANNOTATION).unwrap_or(0);
        if !self.patch_status(pod, uid, json!({}), terminated_status(pod, uid, exit_code, started.1)).await {
            return Next::Retry;
        }
        // The runtime stops a finished pod's sandbox, which releases its network.
        if self.teardown(uid, state).await { Next::OnChange } else { Next::Retry }
    }

    async fn add(&self, uid: &str, pod: &Pod, state: &mut PodState) -> Next {
        state.attempt += 1;
        let container_id = format!("{}{:032x}", uid.replace('-', ""), state.attempt);
        let args = pod_args(pod, uid);
        state.args = Some(args.clone());
        state.skip_del = pod.annotations().get(SKIP_DEL_ANNOTATION).is_some_and(|v| v == "true");
        state.ifnames = interfaces(pod);
        state.netconfs = netconf_overrides(pod);
        let netconf = (self.network.netconf)(&self.node);
        let call = Invocation {
            command: "ADD",
            container_id: &container_id,
            ifname: POD_IFNAME,
            pod: Some(&args),
            netconf: &netconf,
        };
        {
            let _gate = self.gc_gate.read().await;
            if let Ok(mut pending) = self.pending.lock() {
                pending.insert(container_id.clone(), state.ifnames.clone());
            }
        }
        let primary = self.network.invoke_on(&self.node, &call).await;
        let extra = match &primary {
            Ok(Some(_)) => self.add_extra_interfaces(&container_id, &args, &state.ifnames[1..], &state.netconfs).await,
            _ => Ok(Vec::new()),
        };
        let next = self.finish_add(uid, pod, state, container_id.clone(), primary.and_then(|r| Ok((r, extra?))));
        // Only now is the sandbox either recorded as live or given up: until then GC lists it.
        if let Ok(mut pending) = self.pending.lock() {
            pending.remove(&container_id);
        }
        next
    }

    /// ADDs the sandbox's secondary interfaces one by one; their results by interface.
    async fn add_extra_interfaces(
        &self,
        container_id: &str,
        args: &PodArgs,
        ifnames: &[String],
        netconfs: &NetconfOverrides,
    ) -> crate::error::Result<ExtraResults> {
        let mut results = Vec::new();
        for ifname in ifnames {
            let netconf = self.netconf_for(netconfs, ifname);
            let call = Invocation { command: "ADD", container_id, ifname, pod: Some(args), netconf: &netconf };
            let result = self.network.invoke_on(&self.node, &call).await?.unwrap_or(Value::Null);
            results.push((ifname.clone(), result));
        }
        Ok(results)
    }

    fn finish_add(
        &self,
        uid: &str,
        pod: &Pod,
        state: &mut PodState,
        container_id: String,
        outcome: crate::error::Result<(Option<Value>, ExtraResults)>,
    ) -> Next {
        let (result, extra) = match outcome {
            Ok((Some(result), extra)) => (result, extra),
            Ok((None, _)) => {
                tracing::warn!(node = %self.node.name, pod = %pod_key(pod), "CNI ADD printed no result; retrying");
                state.orphans.push(container_id);
                return Next::Retry;
            }
            Err(e) => {
                tracing::warn!(node = %self.node.name, pod = %pod_key(pod), error = %e, "CNI ADD failed; retrying");
                state.orphans.push(container_id);
                return Next::Retry;
            }
        };
        if self.faults.take_add_crash() {
            tracing::info!(node = %self.node.name, pod = %pod_key(pod), %container_id, "fault: runtime crashed after ADD; result lost");
            return Next::Retry;
        }
        let sandbox = Sandbox {
            pod: pod_key(pod),
            container_id,
            ifname: POD_IFNAME.to_string(),
            ips: cni::result_ips(&result),
            result,
            extra,
        };
        self.record_sandbox(uid, Some(sandbox.clone()));
        state.sandbox = Some(sandbox);
        state.started = Some((Instant::now(), Timestamp::now()));
        Next::At(Instant::now())
    }

    /// Tears the pod's sandbox down with CNI DEL (or skips DEL when the fault is on): the
    /// sandbox's stop; the DELs of its removal follow once the pod is gone
    /// ([`NodeRuntime::remove_sandbox`]). False when DEL failed and must be retried.
    async fn teardown(&self, uid: &str, state: &mut PodState) -> bool {
        let Some(sandbox) = state.sandbox.clone() else { return true };
        if self.faults.hold_teardowns() {
            return false;
        }
        if self.faults.skip_del() || state.skip_del {
            tracing::info!(node = %self.node.name, pod = %sandbox.pod, container_id = %sandbox.container_id, "fault: CNI DEL skipped");
        } else {
            if !self.del_sandbox(uid, &sandbox, &state.netconfs).await {
                return false;
            }
            state.removals = DELS_PER_DELETION - 1;
            state.removed = Some(sandbox);
        }
        self.record_sandbox(uid, None);
        state.sandbox = None;
        true
    }

    /// The DELs of a stopped sandbox's removal, once its pod is gone, as containerd's
    /// RemovePodSandbox repeats the teardown after kubelet let the pod go (issue 24); false
    /// when one failed and must be retried.
    async fn remove_sandbox(&self, uid: &str, state: &mut PodState) -> bool {
        let Some(sandbox) = state.removed.clone() else { return true };
        while state.removals > 0 {
            if !self.del_sandbox(uid, &sandbox, &state.netconfs).await {
                return false;
            }
            state.removals -= 1;
        }
        state.removed = None;
        true
    }

    /// One CNI DEL of each of `sandbox`'s interfaces (with its `prevResult`): the secondary ones
    /// first, the pod's own last, as Multus tears them down. False when one failed.
    async fn del_sandbox(&self, uid: &str, sandbox: &Sandbox, netconfs: &NetconfOverrides) -> bool {
        let (namespace, name) = sandbox.pod.split_once('/').unwrap_or(("", &sandbox.pod));
        let args = PodArgs { namespace: namespace.to_string(), name: name.to_string(), uid: uid.to_string() };
        let own = (sandbox.ifname.clone(), sandbox.result.clone());
        for (ifname, result) in sandbox.extra.iter().rev().chain(std::iter::once(&own)) {
            let netconf = cni::with_prev_result(&self.netconf_for(netconfs, ifname), result);
            let call = Invocation {
                command: "DEL",
                container_id: &sandbox.container_id,
                ifname,
                pod: Some(&args),
                netconf: &netconf,
            };
            if let Err(e) = self.network.invoke_on(&self.node, &call).await {
                tracing::warn!(node = %self.node.name, pod = %sandbox.pod, %ifname, error = %e, "CNI DEL failed; retrying");
                return false;
            }
            self.calls.dels.fetch_add(1, Ordering::Relaxed);
        }
        true
    }

    /// Removes a terminating pod for good: grace 0, only if it is still the same pod.
    async fn delete_pod(&self, pod: &Pod, uid: &str) -> bool {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions { uid: Some(uid.to_string()), resource_version: None }),
            ..DeleteParams::default()
        };
        match api.delete(&pod.name_any(), &params).await {
            Ok(_) => true,
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => true,
            Err(e) => {
                tracing::warn!(node = %self.node.name, pod = %pod_key(pod), error = %e, "deleting pod failed; retrying");
                false
            }
        }
    }

    /// Patches the pod's status, and `annotations` (an object) into its metadata.
    async fn patch_status(&self, pod: &Pod, uid: &str, annotations: Value, status: Value) -> bool {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &pod.namespace().unwrap_or_default());
        let patch = json!({"metadata": {"uid": uid, "annotations": annotations}, "status": status});
        match api.patch_status(&pod.name_any(), &PatchParams::default(), &Patch::Strategic(&patch)).await {
            Ok(_) => true,
            // Gone or replaced by a pod with another UID: the next snapshot says what to do.
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => true,
            Err(e) => {
                tracing::warn!(node = %self.node.name, pod = %pod_key(pod), error = %e, "pod status patch failed; retrying");
                false
            }
        }
    }
}

/// The ADD results of a sandbox's secondary interfaces, by interface.
type ExtraResults = Vec<(String, Value)>;

/// What a worker does after one convergence step.
enum Next {
    /// The pod is gone and its sandbox torn down.
    Done,
    /// Wait for the next pod snapshot.
    OnChange,
    /// Step again at this instant (or on a new snapshot, whichever comes first).
    At(Instant),
    /// Step again after [`RETRY_DELAY`].
    Retry,
}

/// What a worker remembers of its pod between steps.
#[derive(Default)]
struct PodState {
    sandbox: Option<Sandbox>,
    /// When the pod's containers "started", monotonic and wall-clock.
    started: Option<(Instant, Timestamp)>,
    running_posted: bool,
    attempt: u32,
    /// Sandboxes whose ADD failed and still need their DEL.
    orphans: Vec<String>,
    /// The pod's CNI_ARGS, for those DELs.
    args: Option<PodArgs>,
    /// The pod asks for its DEL to be lost ([`SKIP_DEL_ANNOTATION`]).
    skip_del: bool,
    /// The sandbox's interfaces: the pod's own first, then [`EXTRA_INTERFACES_ANNOTATION`]'s.
    ifnames: Vec<String>,
    /// The pod's [`EXTRA_NETCONF_ANNOTATION`], for the calls of its secondary interfaces.
    netconfs: NetconfOverrides,
    /// A stopped sandbox whose removal DELs are still due once the pod is gone, and how many.
    removed: Option<Sandbox>,
    removals: usize,
}

/// Netconf fields by interface ([`EXTRA_NETCONF_ANNOTATION`]).
type NetconfOverrides = serde_json::Map<String, Value>;

/// The pod's [`EXTRA_NETCONF_ANNOTATION`]; none when it is absent or not a JSON object.
fn netconf_overrides(pod: &Pod) -> NetconfOverrides {
    let text = pod.annotations().get(EXTRA_NETCONF_ANNOTATION).map(String::as_str).unwrap_or("{}");
    serde_json::from_str(text).unwrap_or_default()
}

fn pod_key(pod: &Pod) -> String {
    format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any())
}

fn pod_args(pod: &Pod, uid: &str) -> PodArgs {
    PodArgs { namespace: pod.namespace().unwrap_or_default(), name: pod.name_any(), uid: uid.to_string() }
}

/// The sandbox's interfaces: [`POD_IFNAME`], then those the pod's
/// [`EXTRA_INTERFACES_ANNOTATION`] lists.
fn interfaces(pod: &Pod) -> Vec<String> {
    let extra = pod.annotations().get(EXTRA_INTERFACES_ANNOTATION).map(String::as_str).unwrap_or_default();
    std::iter::once(POD_IFNAME.to_string())
        .chain(extra.split(',').map(str::trim).filter(|i| !i.is_empty()).map(str::to_string))
        .collect()
}

fn annotation_u64(pod: &Pod, key: &str) -> Option<u64> {
    pod.annotations().get(key).and_then(|v| v.trim().parse().ok())
}

/// The grace period the apiserver applied to a deleted pod: the deletion's own, else the
/// pod spec's, else the default.
fn grace_seconds(pod: &Pod) -> i64 {
    pod.metadata
        .deletion_grace_period_seconds
        .or_else(|| pod.spec.as_ref().and_then(|s| s.termination_grace_period_seconds))
        .unwrap_or(DEFAULT_GRACE_SECONDS)
}

/// When a deleted pod's containers have stopped, so its sandbox goes: `stop_seconds` after
/// SIGTERM, but no later than SIGKILL at the end of the grace period. Deletion (SIGTERM)
/// began at `deletionTimestamp` minus the grace period, as the apiserver sets it to the
/// moment the grace runs out.
fn containers_stopped_at(deletion: Timestamp, grace_seconds: i64, stop_seconds: u64) -> Timestamp {
    let grace = grace_seconds.max(0);
    let stop = i64::try_from(stop_seconds).unwrap_or(i64::MAX).min(grace);
    deletion.checked_sub(jiff::SignedDuration::from_secs(grace - stop)).unwrap_or(Timestamp::MIN)
}

fn containers(pod: &Pod) -> Vec<(String, String)> {
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
        .collect()
}

fn condition(kind: &str, status: &str, at: &str) -> Value {
    json!({"type": kind, "status": status, "lastTransitionTime": at})
}

/// The status of a pod whose sandbox is up with `ips` and whose containers run.
fn running_status(pod: &Pod, uid: &str, ips: &[String], started: Timestamp) -> Value {
    let at = started.to_string();
    let statuses: Vec<Value> = containers(pod)
        .into_iter()
        .map(|(name, image)| {
            json!({"name": name, "image": image, "imageID": format!("e2e://{image}"),
                   "containerID": format!("e2e://{uid}/{name}"), "ready": true, "started": true,
                   "restartCount": 0, "state": {"running": {"startedAt": at}}})
        })
        .collect();
    let conditions: Vec<Value> =
        ["PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready", "PodScheduled"]
            .iter()
            .map(|kind| condition(kind, "True", &at))
            .collect();
    json!({
        "phase": "Running",
        "hostIP": NODE_ADDRESS,
        "hostIPs": [{"ip": NODE_ADDRESS}],
        "podIP": ips.first(),
        "podIPs": ips.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>(),
        "startTime": at,
        "conditions": conditions,
        "containerStatuses": statuses,
    })
}

/// The status of a pod whose containers exited with `exit_code`.
fn terminated_status(pod: &Pod, uid: &str, exit_code: u64, started: Timestamp) -> Value {
    let (started, finished) = (started.to_string(), Timestamp::now().to_string());
    let (phase, reason) = if exit_code == 0 { ("Succeeded", "Completed") } else { ("Failed", "Error") };
    let statuses: Vec<Value> = containers(pod)
        .into_iter()
        .map(|(name, image)| {
            json!({"name": name, "image": image, "imageID": format!("e2e://{image}"),
                   "containerID": format!("e2e://{uid}/{name}"), "ready": false, "started": false,
                   "restartCount": 0, "state": {"terminated": {"exitCode": exit_code, "reason": reason,
                   "startedAt": started, "finishedAt": finished, "containerID": format!("e2e://{uid}/{name}")}}})
        })
        .collect();
    json!({
        "phase": phase,
        "conditions": [
            json!({"type": "Ready", "status": "False", "reason": "PodCompleted", "lastTransitionTime": finished}),
            json!({"type": "ContainersReady", "status": "False", "reason": "PodCompleted", "lastTransitionTime": finished}),
        ],
        "containerStatuses": statuses,
    })
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn only_networks_configured_for_cni_1_1_or_later_get_status_calls() {
        for (version, speaks) in
            [("1.1.0", true), ("1.2.0", true), ("2.0.0", true), ("1.0.0", false), ("0.4.0", false), ("", false)]
        {
            assert_eq!(speaks_status(version), speaks, "{version}");
        }
    }

    fn pod(annotations: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "web-0", "namespace": "default", "uid": "u1", "annotations": annotations},
            "spec": {"containers": [{"name": "app", "image": "nginx"}, {"name": "sidecar", "image": "envoy"}]},
        }))
        .expect("valid pod")
    }

    #[test]
    fn running_status_reports_every_cni_ip_and_every_container_ready() {
        let status = running_status(&pod(json!({})), "u1", &["10.244.0.5".into(), "fd00::5".into()], Timestamp::now());
        assert_eq!(status["podIP"], "10.244.0.5");
        assert_eq!(status["podIPs"], json!([{"ip": "10.244.0.5"}, {"ip": "fd00::5"}]));
        assert_eq!(status["containerStatuses"].as_array().map(Vec::len), Some(2));
        assert!(status["containerStatuses"].as_array().into_iter().flatten().all(|c| c["ready"] == true));
    }

    #[test]
    fn terminated_status_is_failed_for_a_non_zero_exit_code() {
        let status = terminated_status(&pod(json!({})), "u1", 3, Timestamp::now());
        assert_eq!(status["phase"], "Failed");
        assert_eq!(status["containerStatuses"][0]["state"]["terminated"]["exitCode"], 3);
    }

    #[test]
    fn terminated_status_is_succeeded_for_exit_code_zero() {
        assert_eq!(terminated_status(&pod(json!({})), "u1", 0, Timestamp::now())["phase"], "Succeeded");
    }

    #[test]
    fn a_deleted_pods_containers_stop_after_stop_seconds_but_no_later_than_its_grace() {
        let deletion: Timestamp = "2026-01-01T00:01:00Z".parse().expect("timestamp");
        let at = |s: &str| s.parse::<Timestamp>().expect("timestamp");
        // (grace, stop seconds, stopped at): deletion began at 00:00:00 for a 60 s grace.
        let table = [
            (60, 0, at("2026-01-01T00:00:00Z")),
            (60, 40, at("2026-01-01T00:00:40Z")),
            (60, 60, at("2026-01-01T00:01:00Z")),
            (60, 90, at("2026-01-01T00:01:00Z")),
            (0, 40, at("2026-01-01T00:01:00Z")),
            (-5, 40, at("2026-01-01T00:01:00Z")),
            (60, u64::MAX, at("2026-01-01T00:01:00Z")),
        ];
        for (grace, stop, stopped) in table {
            assert_eq!(containers_stopped_at(deletion, grace, stop), stopped, "grace {grace}, stop {stop}");
        }
    }

    #[test]
    fn the_grace_period_is_the_deletions_then_the_specs_then_the_default() {
        let mut deleted = pod(json!({}));
        assert_eq!(grace_seconds(&deleted), DEFAULT_GRACE_SECONDS);
        deleted.spec.as_mut().expect("spec").termination_grace_period_seconds = Some(60);
        assert_eq!(grace_seconds(&deleted), 60);
        deleted.metadata.deletion_grace_period_seconds = Some(5);
        assert_eq!(grace_seconds(&deleted), 5, "a delete with its own grace overrides the spec");
    }

    #[test]
    fn extra_interfaces_follow_the_pods_own_in_the_annotations_order() {
        assert_eq!(interfaces(&pod(json!({}))), ["eth0"]);
        assert_eq!(interfaces(&pod(json!({EXTRA_INTERFACES_ANNOTATION: "net1, net2,"}))), ["eth0", "net1", "net2"]);
    }

    #[test]
    fn run_seconds_annotation_is_parsed_and_garbage_ignored() {
        assert_eq!(annotation_u64(&pod(json!({RUN_SECONDS_ANNOTATION: " 2 "})), RUN_SECONDS_ANNOTATION), Some(2));
        assert_eq!(annotation_u64(&pod(json!({RUN_SECONDS_ANNOTATION: "soon"})), RUN_SECONDS_ANNOTATION), None);
    }
}
