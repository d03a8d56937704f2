//! What a component's own compare-and-swap writes stored, kept until its watch shows them. A
//! watch delivers a write's event after the write's answer, late under load (seconds, even
//! tens of seconds, on a busy apiserver), so a component deciding from its cache alone would
//! act on objects older than its own writes: the agent would miss records it wrote in an
//! orphaned block, the controller would re-read pods for releases it already wrote.
//! [`OwnWrites::newest`] and [`OwnWrites::overlay`] give the newer of the two; the watch's
//! events ([`OwnWrites::observe`]) end each copy.

use std::borrow::Borrow;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kube::Resource;
use kube::runtime::watcher;

/// How long an own copy counts at most when no watch event ends it: far longer than any watch
/// lag, for the copies whose end the watch cannot show (an object deleted while the watch was
/// down and relisting, or whose deletion event arrived before the write's answer).
const OWN_COPY_LIFETIME: Duration = Duration::from_secs(600);

/// One stored copy, and when it was stored.
#[derive(Debug)]
struct OwnCopy<K> {
    object: Arc<K>,
    at: Instant,
}

/// The copies a component's writes stored, by object name.
#[derive(Debug)]
pub struct OwnWrites<K> {
    copies: Mutex<HashMap<String, OwnCopy<K>>>,
}

impl<K> Default for OwnWrites<K> {
    fn default() -> Self {
        Self { copies: Mutex::new(HashMap::new()) }
    }
}

/// Whether `own` (what a write stored) is newer than `cached` (the watch cache's copy): the
/// same object (UID) at a higher `metadata.generation`, which the apiserver raises on every
/// change of a custom resource's spec; or the cache does not have the object.
fn own_copy_is_newer<K: Resource>(cached: Option<&K>, own: Option<&K>) -> bool {
    match (cached, own) {
        (_, None) => false,
        (None, Some(_)) => true,
        (Some(cached), Some(own)) => {
            cached.meta().uid == own.meta().uid
                && own.meta().generation.unwrap_or(0) > cached.meta().generation.unwrap_or(0)
        }
    }
}

/// Whether the watch event of `seen` (`deleted`: a deletion) ends the own copy `own` of the
/// same name: the watch shows the write (same UID, generation at least the copy's), the
/// object's deletion, or another object of that name.
fn seen_ends_copy<K: Resource>(own: &K, seen: &K, deleted: bool) -> bool {
    let same = own.meta().uid == seen.meta().uid;
    match (same, deleted) {
        (true, true) => true,
        (true, false) => seen.meta().generation.unwrap_or(0) >= own.meta().generation.unwrap_or(0),
        (false, false) => true,
        // An earlier object of the name going: the copy is of a later one.
        (false, true) => false,
    }
}

impl<K: Resource> OwnWrites<K> {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, OwnCopy<K>>> {
        self.copies.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Remembers what a write of `name` stored at `now`; `None` (the object is gone, or
    /// nothing is known of it) forgets it. A copy stored again unchanged (same
    /// resourceVersion) keeps its age; copies past [`OWN_COPY_LIFETIME`] go.
    pub fn remember(&self, name: &str, stored: Option<K>, now: Instant) {
        let mut copies = self.lock();
        copies.retain(|_, copy| now.saturating_duration_since(copy.at) < OWN_COPY_LIFETIME);
        let Some(mut object) = stored else {
            copies.remove(name);
            return;
        };
        // Kept without managedFields (as large as a block's records): nothing decides by them,
        // and a write of a copy without them leaves the stored ones as they are.
        object.meta_mut().managed_fields = None;
        let at = match copies.get(name) {
            Some(copy) if copy.object.meta().resource_version == object.meta().resource_version => copy.at,
            _ => now,
        };
        copies.insert(name.to_string(), OwnCopy { object: Arc::new(object), at });
    }

    /// Ends the own copy an event of the component's watch shows ([`OwnWrites::observe`]).
    pub fn observe_event<O: Borrow<K>>(&self, event: &watcher::Event<O>) {
        match event {
            watcher::Event::Apply(seen) | watcher::Event::InitApply(seen) => self.observe(seen.borrow(), false),
            watcher::Event::Delete(seen) => self.observe(seen.borrow(), true),
            watcher::Event::Init | watcher::Event::InitDone => {}
        }
    }

    /// Ends the own copy of `seen`'s name when its watch event shows it ([`seen_ends_copy`]).
    fn observe(&self, seen: &K, deleted: bool) {
        let Some(name) = seen.meta().name.as_deref() else { return };
        let mut copies = self.lock();
        if copies.get(name).is_some_and(|copy| seen_ends_copy(copy.object.as_ref(), seen, deleted)) {
            copies.remove(name);
        }
    }

    /// The newer of `cached` and the own copy of `name` ([`own_copy_is_newer`]) at `now`; an
    /// own copy the cache has caught up with, or past its lifetime, is forgotten.
    pub fn newest(&self, name: &str, cached: Option<Arc<K>>, now: Instant) -> Option<Arc<K>> {
        let mut copies = self.lock();
        let own = copies.get(name).filter(|copy| copy.counts_at(now)).map(|copy| copy.object.clone());
        if own_copy_is_newer(cached.as_deref(), own.as_deref()) {
            return own;
        }
        copies.remove(name);
        cached
    }

    /// The names of the own copies `keep` accepts that count at `now`.
    pub fn names_where(&self, keep: impl Fn(&K) -> bool, now: Instant) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|(_, copy)| copy.counts_at(now) && keep(&copy.object))
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Every object as the component knows it at `now`: `cached`, each replaced by its newer
    /// own copy, and the own copies the cache does not show; copies past their lifetime do
    /// not count.
    pub fn overlay(&self, cached: Vec<Arc<K>>, now: Instant) -> Vec<Arc<K>> {
        let copies = self.lock();
        if copies.is_empty() {
            return cached;
        }
        let mut unseen: BTreeMap<&str, &OwnCopy<K>> =
            copies.iter().filter(|(_, copy)| copy.counts_at(now)).map(|(name, copy)| (name.as_str(), copy)).collect();
        let mut known: Vec<Arc<K>> = cached
            .into_iter()
            .map(|object| match unseen.remove(object.meta().name.as_deref().unwrap_or_default()) {
                Some(copy) if own_copy_is_newer(Some(object.as_ref()), Some(copy.object.as_ref())) => {
                    copy.object.clone()
                }
                _ => object,
            })
            .collect();
        known.extend(unseen.into_values().map(|copy| copy.object.clone()));
        known
    }
}

impl<K> OwnCopy<K> {
    /// Whether the copy still counts at `now` ([`OWN_COPY_LIFETIME`]).
    fn counts_at(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.at) < OWN_COPY_LIFETIME
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::crd::{IPBlock, IPBlockSpec};
    use kube::ResourceExt;

    fn block(name: &str, uid: &str, generation: i64, records: usize) -> IPBlock {
        let mut spec = IPBlockSpec::default();
        for i in 0..records {
            spec.allocations.insert(format!("10.0.0.{i}"), crate::ipam::blocks::test::record("u", "c"));
        }
        let mut block = IPBlock::new(name, spec);
        block.metadata.uid = Some(uid.into());
        block.metadata.generation = Some(generation);
        block
    }

    #[test]
    fn the_own_copy_of_an_object_wins_only_while_the_cache_has_not_caught_up_with_it() {
        // (cached, own, own is newer)
        let cases = [
            (None, None, false),
            (Some(block("b", "u", 3, 0)), None, false),
            (None, Some(block("b", "u", 3, 0)), true),
            (Some(block("b", "u", 3, 0)), Some(block("b", "u", 4, 0)), true),
            (Some(block("b", "u", 4, 0)), Some(block("b", "u", 4, 0)), false),
            (Some(block("b", "u", 5, 0)), Some(block("b", "u", 4, 0)), false),
            // Deleted and made anew: the cache's object is another one.
            (Some(block("b", "v", 1, 0)), Some(block("b", "u", 4, 0)), false),
        ];
        for (cached, own, want) in cases {
            assert_eq!(own_copy_is_newer(cached.as_ref(), own.as_ref()), want, "{cached:?} vs {own:?}");
        }
    }

    #[test]
    fn newest_gives_the_own_copy_until_the_cache_catches_up_then_forgets_it() {
        let writes = OwnWrites::default();
        let now = Instant::now();
        writes.remember("b", Some(block("b", "u", 4, 2)), now);
        let newest = writes.newest("b", Some(Arc::new(block("b", "u", 3, 1))), now);
        assert_eq!(newest.map(|b| b.spec.allocations.len()), Some(2), "the cache lags: the own copy");
        let newest = writes.newest("b", Some(Arc::new(block("b", "u", 4, 2))), now);
        assert_eq!(newest.map(|b| b.metadata.generation), Some(Some(4)));
        assert!(writes.names_where(|_| true, now).is_empty(), "caught up: forgotten");
        writes.remember("gone", Some(block("gone", "u", 1, 0)), now);
        writes.remember("gone", None, now);
        assert!(writes.newest("gone", None, now).is_none(), "a deleted object is forgotten");
    }

    #[test]
    fn a_watch_event_ends_the_copy_it_shows_and_nothing_else() {
        let now = Instant::now();
        // (own copy, event's object, deletion, copy left)
        let cases = [
            (block("b", "u", 4, 0), block("b", "u", 3, 0), false, true),
            (block("b", "u", 4, 0), block("b", "u", 4, 0), false, false),
            (block("b", "u", 4, 0), block("b", "u", 5, 0), false, false),
            (block("b", "u", 4, 0), block("b", "u", 3, 0), true, false),
            (block("b", "u", 4, 0), block("b", "v", 9, 0), false, false),
            // The deletion of an earlier object of the name: the copy is of a later one.
            (block("b", "u", 4, 0), block("b", "v", 9, 0), true, true),
            (block("b", "u", 4, 0), block("c", "u", 9, 0), true, true),
        ];
        for (own, seen, deleted, left) in cases {
            let writes = OwnWrites::default();
            writes.remember("b", Some(own.clone()), now);
            writes.observe(&seen, deleted);
            assert_eq!(!writes.names_where(|_| true, now).is_empty(), left, "{own:?} then {seen:?} deleted {deleted}");
        }
    }

    #[test]
    fn copies_count_for_their_lifetime_only_and_an_unchanged_copy_keeps_its_age() {
        let writes = OwnWrites::default();
        let then = Instant::now();
        let later = then + OWN_COPY_LIFETIME / 2;
        let mut old = block("old", "u", 1, 0);
        old.metadata.resource_version = Some("7".into());
        writes.remember("old", Some(old.clone()), then);
        writes.remember("old", Some(old), later);
        let expired = then + OWN_COPY_LIFETIME;
        assert!(writes.names_where(|_| true, expired).is_empty(), "stored again unchanged: still as old");
        assert!(writes.newest("old", None, expired).is_none(), "past its lifetime: not given");
        writes.remember("new", Some(block("new", "v", 1, 0)), expired);
        assert_eq!(writes.names_where(|_| true, expired), ["new"], "the next write dropped the expired copy");
    }

    #[test]
    fn the_overlay_shows_own_writes_the_cache_lacks_and_only_copies_within_their_lifetime() {
        let now = Instant::now();
        let writes = OwnWrites::default();
        let ago = |seconds: u64| now - Duration::from_secs(seconds);
        writes.remember("deleted", Some(block("deleted", "u5", 2, 2)), now - OWN_COPY_LIFETIME);
        writes.remember("behind", Some(block("behind", "u1", 4, 4)), ago(30));
        writes.remember("ahead", Some(block("ahead", "u2", 4, 3)), ago(1));
        writes.remember("unseen", Some(block("unseen", "u4", 1, 1)), ago(1));
        let cached = vec![
            Arc::new(block("behind", "u1", 1, 1)),
            Arc::new(block("ahead", "u2", 5, 0)),
            Arc::new(block("other", "u3", 1, 2)),
        ];
        let mut known: Vec<(String, usize)> =
            writes.overlay(cached.clone(), now).iter().map(|b| (b.name_any(), b.spec.allocations.len())).collect();
        known.sort();
        let want = [("ahead", 0), ("behind", 4), ("other", 2), ("unseen", 1)];
        assert_eq!(known, want.map(|(name, records)| (name.to_string(), records)));
        assert_eq!(OwnWrites::default().overlay(cached, now).len(), 3, "nothing written: the cache as is");
    }
}
