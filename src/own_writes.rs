//! What a component's own compare-and-swap writes stored, kept until its watch cache shows
//! them. A watch delivers a write's event after the write's answer, late under load (seconds
//! on a busy apiserver), so a component deciding from its cache alone would act on objects
//! older than its own writes: the agent would miss records it wrote in an orphaned block, the
//! controller would re-read pods for releases it already wrote. [`OwnWrites::newest`] and
//! [`OwnWrites::overlay`] give the newer of the two.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use kube::Resource;

/// How long an own copy is kept at most: far longer than a watch lags, and short enough that
/// a copy of an object deleted since (whose deletion the writer never sees) stops counting
/// soon. An own copy dropped early costs a fresh read or a conflict, never a wrong write:
/// every write is a compare-and-swap.
pub const OWN_COPY_LIFETIME: Duration = Duration::from_secs(60);

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
pub fn own_copy_is_newer<K: Resource>(cached: Option<&K>, own: Option<&K>) -> bool {
    match (cached, own) {
        (_, None) => false,
        (None, Some(_)) => true,
        (Some(cached), Some(own)) => {
            cached.meta().uid == own.meta().uid
                && own.meta().generation.unwrap_or(0) > cached.meta().generation.unwrap_or(0)
        }
    }
}

impl<K: Resource> OwnWrites<K> {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, OwnCopy<K>>> {
        self.copies.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Remembers what a write of `name` stored at `now`; `None` (the object is gone, or
    /// nothing is known of it) forgets it. Copies older than [`OWN_COPY_LIFETIME`] go.
    pub fn remember(&self, name: &str, stored: Option<K>, now: Instant) {
        let mut copies = self.lock();
        copies.retain(|_, copy| now.saturating_duration_since(copy.at) < OWN_COPY_LIFETIME);
        match stored {
            Some(object) => copies.insert(name.to_string(), OwnCopy { object: Arc::new(object), at: now }),
            None => copies.remove(name),
        };
    }

    /// The newer of `cached` and the own copy of `name` ([`own_copy_is_newer`]); an own copy
    /// the cache has caught up with is forgotten.
    pub fn newest(&self, name: &str, cached: Option<Arc<K>>) -> Option<Arc<K>> {
        let mut copies = self.lock();
        let own = copies.get(name).map(|copy| copy.object.clone());
        if own_copy_is_newer(cached.as_deref(), own.as_deref()) {
            return own;
        }
        copies.remove(name);
        cached
    }

    /// The names of the own copies `keep` accepts.
    pub fn names_where(&self, keep: impl Fn(&K) -> bool) -> Vec<String> {
        self.lock().iter().filter(|(_, copy)| keep(&copy.object)).map(|(name, _)| name.clone()).collect()
    }

    /// Every object as the component knows it at `now`: `cached`, each replaced by its newer
    /// own copy, and the own copies the cache does not show, stored less than
    /// [`OWN_COPY_LIFETIME`] ago.
    pub fn overlay(&self, cached: Vec<Arc<K>>, now: Instant) -> Vec<Arc<K>> {
        let copies = self.lock();
        if copies.is_empty() {
            return cached;
        }
        let mut unseen: BTreeMap<&str, &OwnCopy<K>> = copies.iter().map(|(name, copy)| (name.as_str(), copy)).collect();
        let mut known: Vec<Arc<K>> = cached
            .into_iter()
            .map(|object| match unseen.remove(object.meta().name.as_deref().unwrap_or_default()) {
                Some(copy) if own_copy_is_newer(Some(object.as_ref()), Some(copy.object.as_ref())) => {
                    copy.object.clone()
                }
                _ => object,
            })
            .collect();
        known.extend(
            unseen
                .into_values()
                .filter(|copy| now.saturating_duration_since(copy.at) < OWN_COPY_LIFETIME)
                .map(|copy| copy.object.clone()),
        );
        known
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
        let newest = writes.newest("b", Some(Arc::new(block("b", "u", 3, 1))));
        assert_eq!(newest.map(|b| b.spec.allocations.len()), Some(2), "the cache lags: the own copy");
        let newest = writes.newest("b", Some(Arc::new(block("b", "u", 4, 2))));
        assert_eq!(newest.map(|b| b.metadata.generation), Some(Some(4)));
        assert!(writes.names_where(|_| true).is_empty(), "caught up: forgotten");
        writes.remember("gone", Some(block("gone", "u", 1, 0)), now);
        writes.remember("gone", None, now);
        assert!(writes.newest("gone", None).is_none(), "a deleted object is forgotten");
    }

    #[test]
    fn copies_older_than_their_lifetime_are_dropped_at_the_next_write() {
        let writes = OwnWrites::default();
        let then = Instant::now();
        writes.remember("old", Some(block("old", "u", 1, 0)), then);
        writes.remember("new", Some(block("new", "v", 1, 0)), then + OWN_COPY_LIFETIME);
        assert_eq!(writes.names_where(|_| true), ["new"]);
    }

    #[test]
    fn the_overlay_shows_own_writes_the_cache_lacks_and_forgets_unseen_ones_after_their_lifetime() {
        let now = Instant::now();
        let writes = OwnWrites::default();
        let ago = |seconds: u64| now - Duration::from_secs(seconds);
        writes.remember("behind", Some(block("behind", "u1", 4, 4)), ago(100));
        writes.remember("ahead", Some(block("ahead", "u2", 4, 3)), ago(1));
        writes.remember("unseen", Some(block("unseen", "u4", 1, 1)), ago(1));
        writes.remember("deleted", Some(block("deleted", "u5", 2, 2)), ago(61));
        // "behind" was dropped by the later writes (older than the lifetime); set it again
        // within it to see a newer own copy replace the cache's.
        writes.remember("behind", Some(block("behind", "u1", 4, 4)), ago(30));
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
