//! The controller's one index of the cluster ([`ClusterIndex`]), shared by its actors and
//! fed by its watches: every watch event is applied to the index as it arrives (a relist
//! through [`ClusterIndex::relist_started`] / [`ClusterIndex::relist_done`]), so no actor
//! ever rebuilds it and only the trimmed facts the rules need are kept.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use jiff::Timestamp;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::Notify;

use crate::gc::index::{ClusterIndex, Kind, Watched};

/// The index, a signal for each kind's first list and a count of the events applied; cheap
/// to clone.
#[derive(Clone)]
pub struct SharedIndex {
    index: Arc<RwLock<ClusterIndex>>,
    listed: Arc<Notify>,
    changes: Arc<AtomicU64>,
}

impl SharedIndex {
    /// An empty index judging stickiness by `sticky_kinds` and agent Leases without a
    /// duration by `default_agent_lease`.
    pub fn new(sticky_kinds: &[String], default_agent_lease: Duration) -> Self {
        Self {
            index: Arc::new(RwLock::new(ClusterIndex::new(sticky_kinds, default_agent_lease))),
            listed: Arc::default(),
            changes: Arc::default(),
        }
    }

    /// How many watch events the index has taken so far: an actor that decides only when
    /// something changed compares it with the count of its last decision.
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::SeqCst)
    }

    /// The index as of now. Hold the guard only for a decision: watch events wait on it.
    pub fn read(&self) -> RwLockReadGuard<'_, ClusterIndex> {
        self.index.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies one watch event of `kind`; `watched` says what each object is to the index.
    pub fn apply<K>(&self, kind: Kind, event: &watcher::Event<K>, watched: impl Fn(&K) -> Watched<'_>) {
        let mut index = self.index.write().unwrap_or_else(PoisonError::into_inner);
        match event {
            watcher::Event::Apply(object) | watcher::Event::InitApply(object) => index.apply(watched(object)),
            watcher::Event::Delete(object) => index.delete(watched(object)),
            watcher::Event::Init => index.relist_started(kind),
            watcher::Event::InitDone => {
                index.relist_done(kind);
                self.listed.notify_waiters();
            }
        }
        self.changes.fetch_add(1, Ordering::SeqCst);
    }

    /// Judges the agents every second from now on ([`ClusterIndex::judge_agents`]), on this
    /// controller's monotonic clock.
    pub fn judge_agents_every_second(&self) {
        let index = self.index.clone();
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(Duration::from_secs(1));
            loop {
                ticks.tick().await;
                let mut index = index.write().unwrap_or_else(PoisonError::into_inner);
                index.judge_agents(Instant::now(), Timestamp::now());
            }
        });
    }

    /// Waits until every kind of `kinds` has been listed once.
    pub async fn wait_listed(&self, kinds: &[Kind]) {
        loop {
            let listed = self.listed.notified();
            if self.read().synced(kinds) {
                return;
            }
            listed.await;
        }
    }
}

/// Events of `api`'s objects with `config`, each applied to `index` (as `kind`) before it is
/// passed on; watch errors are retried with backoff.
pub fn watch_into<K>(
    index: SharedIndex,
    kind: Kind,
    api: Api<K>,
    config: watcher::Config,
    watched: fn(&K) -> Watched<'_>,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    watcher(api, config).default_backoff().map(move |event| {
        if let Ok(event) = &event {
            index.apply(kind, event, watched);
        }
        event
    })
}

/// The same watch event over a shared object: the index keeps blocks and pools as they
/// arrive, without a copy.
pub fn shared<K>(event: watcher::Event<K>) -> watcher::Event<Arc<K>> {
    match event {
        watcher::Event::Apply(o) => watcher::Event::Apply(Arc::new(o)),
        watcher::Event::InitApply(o) => watcher::Event::InitApply(Arc::new(o)),
        watcher::Event::Delete(o) => watcher::Event::Delete(Arc::new(o)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

/// Events of `api`'s objects, as shared objects without their managedFields (a block's are
/// as large as its records, and nothing decides by them; a write of a copy without them
/// leaves the stored ones as they are), each applied to `index` before it is passed on.
pub fn watch_shared_into<K>(
    index: SharedIndex,
    kind: Kind,
    api: Api<K>,
    watched: fn(&Arc<K>) -> Watched<'_>,
) -> impl Stream<Item = Result<watcher::Event<Arc<K>>, watcher::Error>> + Send + 'static
where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
{
    let trimmed = watcher(api, watcher::Config::default()).modify(|object| object.meta_mut().managed_fields = None);
    trimmed.default_backoff().map(move |event| {
        let event = event.map(shared);
        if let Ok(event) = &event {
            index.apply(kind, event, watched);
        }
        event
    })
}

/// Runs `stream` to its end in the background, logging its watch errors.
pub fn drain<S, K>(stream: S, kind: Kind)
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    K: Send + 'static,
{
    tokio::spawn(stream.for_each(move |event| async move {
        if let Err(e) = event {
            tracing::warn!(?kind, error = %e, "watch error; retrying with backoff");
        }
    }));
}
