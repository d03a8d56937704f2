//! What the agent serialises, and on what: ADDs and DELs of different pods run concurrently,
//! those of one pod (and the ADDs of one sticky workload) one at a time, writes to one IPBlock
//! one at a time, and node GC and the answers to release marks alone (docs/decisions/0011-concurrent-adds.md says which
//! interleavings each lock rules out).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// One async lock per key (a pod, a block), made on first use and dropped when no one holds
/// or waits for it, so the map holds only the keys in use.
#[derive(Default)]
pub struct KeyedLocks {
    locks: Mutex<HashMap<String, Arc<AsyncMutex<()>>>>,
}

/// A held key of [`KeyedLocks`]; unlocks (and forgets the key if no one waits) on drop.
pub struct KeyGuard<'a> {
    locks: &'a KeyedLocks,
    key: String,
    guard: Option<OwnedMutexGuard<()>>,
}

impl KeyedLocks {
    /// Waits for `key` and holds it until the guard is dropped.
    pub async fn lock(&self, key: &str) -> KeyGuard<'_> {
        let lock = {
            let mut locks = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
            locks.entry(key.to_string()).or_default().clone()
        };
        KeyGuard { locks: self, key: key.to_string(), guard: Some(lock.lock_owned().await) }
    }

    /// How many keys are held or waited for.
    #[cfg(test)]
    fn in_use(&self) -> usize {
        self.locks.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

impl Drop for KeyGuard<'_> {
    fn drop(&mut self) {
        // The guard holds one reference to the key's lock; once it is gone, the map's is the
        // only one left unless another caller has taken one (under the map's lock) to wait.
        self.guard.take();
        let mut locks = self.locks.locks.lock().unwrap_or_else(PoisonError::into_inner);
        if locks.get(&self.key).is_some_and(|lock| Arc::strong_count(lock) == 1) {
            locks.remove(&self.key);
        }
    }
}

/// The node's locks: the gate that node GC and release-mark answers take alone and the CNI
/// verbs and the spares' tending share, one lock per pod, and one per sticky workload (taken after the pod's).
#[derive(Default)]
pub struct Serial {
    gate: RwLock<()>,
    pods: KeyedLocks,
    workloads: KeyedLocks,
}

/// A pod's turn: the shared gate and the pod's own lock.
pub struct PodTurn<'a> {
    _gate: RwLockReadGuard<'a, ()>,
    _pod: KeyGuard<'a>,
}

impl Serial {
    /// Waits until no node GC or mark answer runs and no other call of pod `pod`
    /// (`namespace/name`) is under way. Writers queue ahead of later readers, so a GC is not
    /// starved by a stream of ADDs.
    pub async fn pod(&self, pod: &str) -> PodTurn<'_> {
        let gate = self.gate.read().await;
        PodTurn { _gate: gate, _pod: self.pods.lock(pod).await }
    }

    /// Within a pod's turn, waits until no other ADD of sticky workload `workload`
    /// (`namespace/claim name`) is under way: two launcher pods of one VM have different
    /// names but share the VM's IPs.
    pub async fn workload(&self, workload: &str) -> KeyGuard<'_> {
        self.workloads.lock(workload).await
    }

    /// Waits until no node GC or mark answer runs, and keeps them out until dropped, beside
    /// the CNI verbs: the spares' tending, whose block edits go through the same block writers
    /// as the verbs' (decision 0016).
    pub async fn beside_verbs(&self) -> RwLockReadGuard<'_, ()> {
        self.gate.read().await
    }

    /// Waits until no CNI verb and no tending pass runs, and keeps them out until dropped;
    /// while it waits, new verbs wait behind it (a tending pass under way delays them so).
    pub async fn alone(&self) -> RwLockWriteGuard<'_, ()> {
        self.gate.write().await
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn one_key_is_held_once_other_keys_are_free_and_unused_keys_are_forgotten() {
        let locks = KeyedLocks::default();
        let first = locks.lock("a").await;
        let other = tokio::time::timeout(Duration::from_secs(1), locks.lock("b")).await;
        assert!(other.is_ok(), "another key waits for a held one");
        drop(other);
        let same = tokio::time::timeout(Duration::from_millis(50), locks.lock("a")).await;
        assert!(same.is_err(), "a held key is taken twice");
        assert_eq!(locks.in_use(), 1);
        drop(first);
        assert_eq!(locks.in_use(), 0, "a key no one holds is kept");
        let _again = locks.lock("a").await;
        assert_eq!(locks.in_use(), 1);
    }

    #[tokio::test]
    async fn a_waiter_keeps_the_key_known_after_the_holder_lets_go() {
        let locks = Arc::new(KeyedLocks::default());
        let first = locks.lock("a").await;
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move {
                let _turn = locks.lock("a").await;
            })
        };
        // The waiter has cloned the key's lock once the map shows a second reference.
        tokio::time::timeout(Duration::from_secs(5), async {
            while locks.locks.lock().unwrap().get("a").map(Arc::strong_count) != Some(3) {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the waiter queues on the key");
        drop(first);
        waiter.await.expect("the waiter gets the key");
        assert_eq!(locks.in_use(), 0);
    }

    #[tokio::test]
    async fn the_gate_keeps_pods_out_while_held_alone_and_lets_different_pods_in_together() {
        let serial = Serial::default();
        let a = serial.pod("ns/a").await;
        let b = tokio::time::timeout(Duration::from_secs(1), serial.pod("ns/b")).await;
        assert!(b.is_ok(), "two pods wait for each other");
        drop((a, b));
        let alone = serial.alone().await;
        let blocked = tokio::time::timeout(Duration::from_millis(50), serial.pod("ns/a")).await;
        assert!(blocked.is_err(), "a pod's call runs during a GC");
        drop(alone);
        assert!(tokio::time::timeout(Duration::from_secs(1), serial.pod("ns/a")).await.is_ok());
    }
}
