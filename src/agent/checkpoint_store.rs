//! The checkpoint's writer. Each change a CNI call makes is in the file before the call
//! answers, but one file write costs two fsyncs (milliseconds each), and a node's burst of
//! ADDs and DELs used to wait for them one after the other. Changes that arrive while a
//! write runs are saved together by the next write (a group commit), on a blocking thread
//! so the async runtime's threads never wait on the disk. Readers see only what the file
//! holds: a change is applied in memory once its write succeeded, and a change whose write
//! failed is in neither.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use tokio::sync::oneshot;

use super::checkpoint::{
    Applied, AttachmentKey, Change, Checkpoint, CheckpointEntry, CheckpointError, Listing, write_file,
};

/// The checkpoint, shared by the agent's concurrent calls.
pub struct CheckpointStore {
    inner: Arc<Inner>,
}

struct Inner {
    /// What the file holds (and the runtime's listings, in memory only).
    saved: Mutex<Checkpoint>,
    /// The changes waiting for the next write, and whether a writer task runs.
    queue: Mutex<Queue>,
    /// The file writes made, for tests.
    #[cfg(test)]
    writes: std::sync::atomic::AtomicUsize,
}

#[derive(Default)]
struct Queue {
    pending: Vec<Pending>,
    writing: bool,
}

struct Pending {
    change: Change,
    reply: oneshot::Sender<Result<Applied, CheckpointError>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl CheckpointStore {
    /// Shares a restored checkpoint.
    pub fn new(checkpoint: Checkpoint) -> Self {
        Self {
            inner: Arc::new(Inner {
                saved: Mutex::new(checkpoint),
                queue: Mutex::new(Queue::default()),
                #[cfg(test)]
                writes: std::sync::atomic::AtomicUsize::new(0),
            }),
        }
    }

    /// Reads the saved checkpoint (briefly: no await inside).
    pub fn read<R>(&self, f: impl FnOnce(&Checkpoint) -> R) -> R {
        f(&lock(&self.inner.saved))
    }

    /// Notes what the runtime's answer that came at `at` said of the sandboxes of `keys`
    /// ([`Checkpoint::note_listed`]).
    pub fn note_listed(&self, keys: &[AttachmentKey], at: Instant, listing: Listing) {
        lock(&self.inner.saved).note_listed(keys, at, listing);
    }

    /// Records an attachment once the file holds it.
    pub async fn insert(&self, entry: CheckpointEntry) -> Result<(), CheckpointError> {
        self.commit(Change::Insert(entry)).await.map(drop)
    }

    /// Forgets an attachment once the file no longer holds it; what it forgot.
    pub async fn remove(&self, key: &AttachmentKey) -> Result<Option<CheckpointEntry>, CheckpointError> {
        match self.commit(Change::Remove(key.clone())).await? {
            Applied::Removed(removed) => Ok(removed),
            _ => Ok(None),
        }
    }

    /// Forgets every attachment not in `recorded` ([`Change::RetainRecorded`]); what it
    /// forgot.
    pub async fn retain_recorded(
        &self,
        recorded: BTreeSet<AttachmentKey>,
    ) -> Result<Vec<CheckpointEntry>, CheckpointError> {
        match self.commit(Change::RetainRecorded(recorded)).await? {
            Applied::Dropped(dropped) => Ok(dropped),
            _ => Ok(Vec::new()),
        }
    }

    /// Replaces every entry (after rebuilding from the apiserver).
    pub async fn replace_all(&self, entries: Vec<CheckpointEntry>) -> Result<(), CheckpointError> {
        self.commit(Change::ReplaceAll(entries)).await.map(drop)
    }

    /// Queues `change` for the next write (starting the writer if none runs) and waits for
    /// its outcome. The writer is a task of its own, so a caller that stops waiting leaves
    /// the other callers' writes running.
    async fn commit(&self, change: Change) -> Result<Applied, CheckpointError> {
        let (reply, answer) = oneshot::channel();
        let start = {
            let mut queue = lock(&self.inner.queue);
            queue.pending.push(Pending { change, reply });
            !std::mem::replace(&mut queue.writing, true)
        };
        if start {
            tokio::spawn(write_pending(self.inner.clone()));
        }
        let path = || lock(&self.inner.saved).path().to_path_buf();
        answer.await.unwrap_or_else(|_| Err(CheckpointError::WriterStopped { path: path() }))
    }

    /// How many times the file was written.
    #[cfg(test)]
    fn writes(&self) -> usize {
        self.inner.writes.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Writes the queued changes, all that arrived since the last write at once, until none
/// is left.
async fn write_pending(inner: Arc<Inner>) {
    loop {
        let batch = {
            let mut queue = lock(&inner.queue);
            if queue.pending.is_empty() {
                queue.writing = false;
                return;
            }
            std::mem::take(&mut queue.pending)
        };
        // Only this task changes the entries, so the copy is what the file holds.
        let (path, mut entries) = {
            let saved = lock(&inner.saved);
            (saved.path().to_path_buf(), saved.entries_copy())
        };
        let changes: Vec<&Change> = batch.iter().map(|p| &p.change).collect();
        let written = match Change::apply_all(&changes, &mut entries) {
            true => {
                #[cfg(test)]
                inner.writes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let target = path.clone();
                tokio::task::spawn_blocking(move || write_file(&target, &entries))
                    .await
                    .unwrap_or(Err(CheckpointError::WriterStopped { path }))
            }
            false => Ok(()),
        };
        match written {
            Ok(()) => {
                let mut saved = lock(&inner.saved);
                for pending in batch {
                    let applied = saved.apply(&pending.change);
                    let _ = pending.reply.send(Ok(applied));
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, changes = batch.len(), "saving the checkpoint failed");
                for pending in batch {
                    let _ = pending.reply.send(Err(e.clone()));
                }
            }
        }
    }
}

#[cfg(test)]
mod test {
    use std::collections::BTreeSet;
    use std::time::{Duration, Instant};

    use super::CheckpointStore;
    use crate::agent::checkpoint::test::{entry, scratch};
    use crate::agent::checkpoint::{Checkpoint, Listing};

    fn store(name: &str) -> (CheckpointStore, std::path::PathBuf) {
        let path = scratch(name);
        let (checkpoint, _) = Checkpoint::load(&path).expect("load");
        (CheckpointStore::new(checkpoint), path)
    }

    fn saved(path: &std::path::Path) -> Vec<String> {
        let (reloaded, _) = Checkpoint::load(path).expect("reload");
        reloaded.entries().map(|e| e.key.container_id.clone()).collect()
    }

    #[tokio::test]
    async fn entries_survive_a_save_and_a_reload() {
        let (store, path) = store("roundtrip");
        store.insert(entry("c1")).await.expect("insert");
        store.insert(entry("c2")).await.expect("insert");
        assert_eq!(store.remove(&entry("c1").key).await.expect("remove"), Some(entry("c1")));
        assert_eq!(store.remove(&entry("c1").key).await.expect("remove again"), None);
        assert_eq!(saved(&path), ["c2"]);
        assert!(!path.with_extension("tmp").exists(), "no temp file is left behind");
    }

    #[tokio::test]
    async fn only_entries_that_a_record_names_are_retained() {
        let (store, path) = store("retain");
        store.insert(entry("recorded")).await.expect("insert");
        store.insert(entry("released")).await.expect("insert");
        let dropped = store.retain_recorded(BTreeSet::from([entry("recorded").key])).await.expect("retain");
        assert_eq!(dropped, vec![entry("released")]);
        assert_eq!(saved(&path), ["recorded"]);
    }

    #[tokio::test]
    async fn a_runtime_listing_lasts_as_long_as_the_attachment_it_names() {
        let (store, _) = store("listed");
        store.insert(entry("c1")).await.expect("insert");
        store.insert(entry("c2")).await.expect("insert");
        let at = Instant::now();
        store.note_listed(&[entry("c1").key, entry("c2").key, entry("unknown").key], at, Listing::Returned);
        let listed = |name: &str| store.read(|c| c.listed_at(&entry(name).key));
        let seen = |name: &str| store.read(|c| c.seen_at(&entry(name).key));
        assert_eq!((listed("c1"), seen("c1")), (Some(at), Some(at)));
        assert_eq!(listed("unknown"), None, "an unrecorded attachment is not noted");
        store.remove(&entry("c1").key).await.expect("remove");
        store.insert(entry("c1")).await.expect("insert");
        assert_eq!((listed("c1"), seen("c1")), (None, None), "a new record of the attachment was not listed yet");
        store.retain_recorded(BTreeSet::new()).await.expect("retain");
        assert_eq!((listed("c2"), seen("c2")), (None, None), "a dropped attachment's listing goes with it");
    }

    #[tokio::test]
    async fn only_an_answer_that_returned_the_sandbox_makes_it_seen_and_no_older_answer_moves_a_time_back() {
        let (store, _) = store("seen");
        store.insert(entry("c1")).await.expect("insert");
        let listed = || store.read(|c| (c.listed_at(&entry("c1").key), c.seen_at(&entry("c1").key)));
        let first = Instant::now();
        let (second, third) = (first + Duration::from_secs(1), first + Duration::from_secs(2));
        store.note_listed(&[entry("c1").key], first, Listing::Undenied);
        assert_eq!(
            listed(),
            (Some(first), None),
            "a status the runtime could not give keeps a mark waiting, proves nothing"
        );
        store.note_listed(&[entry("c1").key], second, Listing::Returned);
        assert_eq!(listed(), (Some(second), Some(second)));
        store.note_listed(&[entry("c1").key], third, Listing::Undenied);
        assert_eq!(listed(), (Some(third), Some(second)));
        store.note_listed(&[entry("c1").key], first, Listing::Returned);
        assert_eq!(listed(), (Some(third), Some(second)), "a slower answer to an older question moves nothing back");
    }

    #[tokio::test]
    async fn a_change_that_cannot_be_saved_is_not_kept_in_memory() {
        let (store, path) = store("unsaved");
        store.insert(entry("c1")).await.expect("insert");
        // A directory where the temp file goes: creating it fails, even for root.
        std::fs::create_dir(path.with_extension("tmp")).expect("block the temp file");
        let mut replacement = entry("c1");
        replacement.ips.clear();
        let err = store.insert(entry("c2")).await.expect_err("the save fails");
        assert!(err.to_string().contains("creating checkpoint"), "{err}");
        store.insert(replacement).await.expect_err("the save fails");
        store.remove(&entry("c1").key).await.expect_err("the save fails");
        let in_memory: Vec<_> = store.read(|c| c.entries().cloned().collect());
        assert_eq!(in_memory, vec![entry("c1")], "memory matches the file");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_changes_are_saved_together_and_each_caller_hears_once_its_change_is_in_the_file() {
        let (store, path) = store("group");
        let store = std::sync::Arc::new(store);
        let names: Vec<String> = (0..64).map(|i| format!("c{i:02}")).collect();
        let inserts = names.iter().map(|name| {
            let (store, path, name) = (store.clone(), path.clone(), name.clone());
            tokio::spawn(async move {
                store.insert(entry(&name)).await.expect("insert");
                assert!(saved(&path).contains(&name), "{name} answered before the file held it");
            })
        });
        for insert in futures::future::join_all(inserts).await {
            insert.expect("insert task");
        }
        assert_eq!(saved(&path), names);
        assert!(store.writes() < names.len(), "{} writes for {} concurrent inserts", store.writes(), names.len());
    }
}
