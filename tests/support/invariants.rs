//! The chaos suites' invariant checker: polls the cluster every second with the code of
//! `ipwarden check` while a suite runs, and waits for a clean report once it settles.
//!
//! During a run, at every poll: no IP is held by two live pods, every live pod's IP is
//! recorded under its UID, no record names another UID than the live pod reporting its IP,
//! and a recreated StatefulSet pod comes back with the IP its ordinal had once the controller
//! witnessed its claim holding it (before that, a recreated pod starts on new IPs: decision
//! 0022), as long as the ordinal stayed wanted (every StatefulSet change is seen
//! through a watch, so a let-go ordinal is never missed between two polls; terminating pods
//! are not remembered). A report is not one atomic read (pods, then blocks), so a problem
//! counts only when a second report, read right after, shows it too. After the run, [`wait_settled`]: no problem of any kind (leaks,
//! claims without records, count drift included) within a bound.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ipwarden::crd::IPClaim;
use ipwarden::gc::check::{Problem, ProblemKind};
use ipwarden::gc::index::PodFacts;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use e2e::wait::{self, Probe};

/// How often the checker polls.
const POLL: Duration = Duration::from_secs(1);

/// Problems that may never be seen, not even for one poll.
const ALWAYS: [ProblemKind; 3] = [ProblemKind::Conflict, ProblemKind::UnrecordedPodIp, ProblemKind::WrongUid];

/// A running checker; [`InvariantChecker::finish`] stops it and returns what it saw.
pub struct InvariantChecker {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    violations: Arc<Mutex<Vec<String>>>,
    polls: Arc<AtomicU64>,
}

/// The IP a StatefulSet pod name had, and the UID it had it with.
pub type StickyMemory = BTreeMap<(String, String), (String, String)>;

impl InvariantChecker {
    /// Starts polling the cluster behind `client`.
    pub fn start(client: Client) -> Self {
        let (stop, mut stopped) = watch::channel(false);
        let violations = Arc::new(Mutex::new(Vec::new()));
        let polls = Arc::new(AtomicU64::new(0));
        let (seen, count) = (violations.clone(), polls.clone());
        // The ordinals a StatefulSet stops wanting are forgotten from its watch, so a scale to 0
        // and back between two polls (a poll takes seconds on a loaded machine) is never missed.
        let sticky = Arc::new(Mutex::new(StickyMemory::new()));
        let forgetting = tokio::spawn(forget_let_go_ordinals(client.clone(), sticky.clone()));
        let task = tokio::spawn(async move {
            let _forgetting = AbortOnDrop(forgetting);
            let mut ticker = tokio::time::interval(POLL);
            loop {
                tokio::select! {
                    _ = ticker.tick() => {}
                    _ = stopped.changed() => return,
                }
                // A poll that cannot read the cluster (an apiserver restart) checks nothing.
                let Ok(found) = poll(&client, &sticky).await else { continue };
                count.fetch_add(1, Ordering::Relaxed);
                if !found.is_empty() {
                    seen.lock().unwrap_or_else(|e| e.into_inner()).extend(found);
                }
            }
        });
        Self { stop, task, violations, polls }
    }

    /// Stops the checker and panics with every violation it saw (or when it never managed
    /// to poll).
    pub async fn finish(self) {
        let _ = self.stop.send(true);
        self.task.await.expect("the checker task");
        let polls = self.polls.load(Ordering::Relaxed);
        assert!(polls > 0, "the invariant checker never read the cluster");
        let violations = self.violations.lock().unwrap_or_else(|e| e.into_inner()).clone();
        assert!(violations.is_empty(), "invariants broken during the run ({polls} polls):\n{}", violations.join("\n"));
    }
}

/// The problems of [`ALWAYS`]'s kinds in one report.
async fn always_problems(client: &Client) -> anyhow::Result<BTreeSet<String>> {
    let problems = ipwarden::cli::check::problems(client).await?;
    Ok(problems
        .iter()
        .filter(|p| ALWAYS.contains(&p.kind))
        .map(|p| format!("{:?} {}: {}", p.kind, p.subject, p.detail))
        .collect())
}

/// Aborts the task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Forgets, at every StatefulSet change the watch shows, the ordinals it no longer wants.
async fn forget_let_go_ordinals(client: Client, sticky: Arc<Mutex<StickyMemory>>) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let events =
        watcher(Api::<StatefulSet>::all(client), watcher::Config::default()).default_backoff().touched_objects();
    let mut events = std::pin::pin!(events);
    while let Some(event) = events.next().await {
        let Ok(statefulset) = event else { continue };
        let mut memory = sticky.lock().unwrap_or_else(|e| e.into_inner());
        forget_unwanted(&mut memory, std::slice::from_ref(&statefulset), Some(&statefulset));
    }
}

/// Forgets the ordinals of `memory` that none of `statefulsets` wants; with `only`, just those
/// of that StatefulSet (a watch event shows one at a time).
fn forget_unwanted(memory: &mut StickyMemory, statefulsets: &[StatefulSet], only: Option<&StatefulSet>) {
    memory.retain(|(namespace, name), _| {
        if let Some(one) = only {
            let of_it = one.namespace().as_deref() == Some(namespace.as_str())
                && name.strip_prefix(&format!("{}-", one.name_any())).is_some_and(|o| o.parse::<i32>().is_ok());
            if !of_it {
                return true;
            }
        }
        statefulsets.iter().any(|s| {
            let ordinal = name.strip_prefix(&format!("{}-", s.name_any())).and_then(|o| o.parse::<i32>().ok());
            let replicas = s.spec.replicas.unwrap_or(1);
            s.namespace().as_deref() == Some(namespace.as_str())
                && s.metadata.deletion_timestamp.is_none()
                && ordinal.is_some_and(|o| o < replicas)
        })
    });
}

async fn poll(client: &Client, sticky: &Mutex<StickyMemory>) -> anyhow::Result<Vec<String>> {
    // A report reads pods, then blocks: a pod deleted in between (its DEL releasing the record)
    // or created in between looks inconsistent without being so. A violation must show in a
    // second report too, read right after the first.
    let first = always_problems(client).await?;
    let mut found: Vec<String> = if first.is_empty() {
        Vec::new()
    } else {
        let second = always_problems(client).await?;
        first.intersection(&second).cloned().collect()
    };
    let pods = Api::<Pod>::all(client.clone()).list(&ListParams::default()).await?;
    let statefulsets = Api::<StatefulSet>::all(client.clone()).list(&ListParams::default()).await?;
    let claims = Api::<IPClaim>::all(client.clone()).list(&ListParams::default()).await?;
    let witnessed: Witnessed = claims
        .items
        .iter()
        .flat_map(|claim| {
            let key = (claim.namespace().unwrap_or_default(), claim.name_any());
            let seen = claim.status.as_ref().and_then(|s| s.witnessed.as_ref());
            seen.into_iter().flat_map(|w| &w.interfaces).flat_map(|i| &i.ips).map(move |c| (key.clone(), c.ip.clone()))
        })
        .collect();
    let mut memory = sticky.lock().unwrap_or_else(|e| e.into_inner());
    found.extend(sticky_changes(&pods.items, &statefulsets.items, &witnessed, &mut memory));
    Ok(found)
}

/// The IPs each claim's `status.witnessed` lists, by claim (namespace, name).
pub type Witnessed = BTreeSet<((String, String), String)>;

/// The StatefulSet pods recreated with another IP than their ordinal had; updates `memory`
/// with each pod's IP once `witnessed` lists it for the pod's claim.
pub fn sticky_changes(
    pods: &[Pod],
    statefulsets: &[StatefulSet],
    witnessed: &Witnessed,
    memory: &mut StickyMemory,
) -> Vec<String> {
    // Forget ordinals their StatefulSet stopped wanting: they may come back with any IP.
    forget_unwanted(memory, statefulsets, None);
    let mut changed = Vec::new();
    for pod in pods {
        let owned = pod.owner_references().iter().any(|o| o.kind == "StatefulSet" && o.controller == Some(true));
        let host_network = pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false);
        let facts = PodFacts::of(pod);
        // A terminating pod is on its way out: seen after its ordinal was let go, it would be
        // remembered again for an ordinal that no longer keeps its IP.
        let terminating = pod.metadata.deletion_timestamp.is_some();
        let Some(ip) = facts.ips.first().filter(|_| owned && !host_network && !facts.terminal() && !terminating) else {
            continue;
        };
        let key = (pod.namespace().unwrap_or_default(), pod.name_any());
        match memory.get(&key) {
            Some((old_ip, old_uid)) if *old_uid != facts.uid && old_ip != ip => {
                changed.push(format!("{}/{} came back with {ip}, its ordinal had {old_ip}", key.0, key.1))
            }
            _ => {}
        }
        if witnessed.contains(&(key.clone(), ip.clone())) {
            memory.insert(key, (ip.clone(), facts.uid.clone()));
        }
    }
    changed
}

/// Waits (bounded by `timeout`) until `ipwarden check` finds no problem at all.
pub async fn wait_settled(client: &Client, timeout: Duration) {
    wait::until("the cluster settling with no problem left", timeout, || async {
        let problems: Vec<Problem> = match ipwarden::cli::check::problems(client).await {
            Ok(problems) => problems,
            Err(e) => return Ok(Probe::Pending(format!("cannot read the cluster: {e:#}"))),
        };
        Ok(if problems.is_empty() {
            Probe::Done(())
        } else {
            let listed: Vec<String> =
                problems.iter().map(|p| format!("{:?} {}: {}", p.kind, p.subject, p.detail)).collect();
            Probe::Pending(listed.join("; "))
        })
    })
    .await
    .expect("no problem left after the run");
}
