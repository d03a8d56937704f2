//! The agent's node-local record of what it handed out, keyed by (network, container ID,
//! interface): written atomically (temp file, fsync, rename, fsync of the directory) after
//! every change and restored at start. An unknown version refuses to start; a missing file
//! is rebuilt from the apiserver, and so is a corrupt one after it is moved aside (kept for
//! inspection). This module holds the data, its changes and the file; the agent saves
//! changes through [`super::checkpoint_store`], which writes concurrent ones together.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::crd::PodRef;

/// The checkpoint format this agent writes and reads.
pub const VERSION: u32 = 1;

/// Why the checkpoint could not be read or written. Clone, because one failed write fails
/// every change saved with it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CheckpointError {
    /// The file is of a format this agent does not know: refuse rather than guess.
    #[error(
        "checkpoint {path} has version {found}, this agent reads version {VERSION}; \
         move it aside to let the agent rebuild it from the apiserver"
    )]
    UnknownVersion {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u64,
    },
    /// Reading, writing, syncing or renaming failed.
    #[error("{what} checkpoint {path}: {source}")]
    Io {
        /// The operation.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: Arc<std::io::Error>,
    },
    /// The task writing the file ended without an answer (it panicked): the change may or may
    /// not be in the file.
    #[error("checkpoint {path}: the writer stopped before saving the change")]
    WriterStopped {
        /// The file.
        path: PathBuf,
    },
}

impl CheckpointError {
    fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_path_buf();
        move |source| Self::Io { what, path, source: Arc::new(source) }
    }
}

/// Identifies one network attachment of one sandbox.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "camelCase")]
pub struct AttachmentKey {
    /// The CNI network name.
    pub network: String,
    /// The sandbox's container ID.
    pub container_id: String,
    /// The interface name.
    pub ifname: String,
}

/// One IP handed to an attachment, with where its record lives.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointIp {
    /// The address.
    pub ip: String,
    /// The pool's prefix length, for the CNI result.
    pub prefix_len: u8,
    /// The pool's gateway, for the CNI result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// Whether the CNI result carries a default route via `gateway` (the pool's
    /// `spec.defaultRoute`). Written only when false: an entry of an older agent, which has
    /// no such field, routes via its gateway when it has one, as that agent's results did.
    #[serde(default = "routes_by_default", skip_serializing_if = "is_true")]
    pub default_route: bool,
    /// The pool.
    pub pool: String,
    /// The IPBlock holding the record.
    pub block: String,
}

/// [`CheckpointIp::default_route`] of an entry that does not say.
fn routes_by_default() -> bool {
    true
}

/// Whether [`CheckpointIp::default_route`] is left out of the file (it is the default).
fn is_true(value: &bool) -> bool {
    *value
}

/// What one attachment holds.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointEntry {
    /// The attachment.
    #[serde(flatten)]
    pub key: AttachmentKey,
    /// The pod.
    pub pod: PodRef,
    /// Its IPs.
    pub ips: Vec<CheckpointIp>,
    /// The record of the sandbox, kept when one of its IPs was a spare of the node (module
    /// `spares`): the block gets it in place of the spare right after the answer, or at the
    /// agent's next start if it stopped first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spare_record: Option<Box<crate::crd::Allocation>>,
}

#[derive(Serialize, Deserialize)]
struct File {
    version: u32,
    entries: Vec<CheckpointEntry>,
}

/// The in-memory checkpoint and the file it is saved to.
#[derive(Debug)]
pub struct Checkpoint {
    path: PathBuf,
    entries: BTreeMap<AttachmentKey, CheckpointEntry>,
    /// When the newest answer (CRI or CNI GC) came that had each recorded attachment's
    /// sandbox, or could not deny having it: a release mark waits for its DEL. In memory
    /// only: after a restart, the runtime's next answer says it again.
    listed: BTreeMap<AttachmentKey, Instant>,
    /// When the newest answer came that returned each recorded attachment's sandbox: the
    /// runtime had it before then, so an answer to a later question without it means it is
    /// gone. In memory only.
    seen: BTreeMap<AttachmentKey, Instant>,
    /// When each entry was recorded by this agent, or loaded at its start: the runtime may
    /// not list a sandbox whose ADD has just returned (module `crate::cri::sandboxes`). In
    /// memory only.
    recorded: BTreeMap<AttachmentKey, Instant>,
}

/// How the checkpoint was found at start.
#[derive(Debug, PartialEq, Eq)]
pub enum Restored {
    /// No file (a first start, a new disk, a changed path): the state must be rebuilt.
    Fresh,
    /// The file was read.
    Loaded,
    /// The file was unreadable and moved to this path; the state must be rebuilt.
    MovedAside(PathBuf),
}

impl Checkpoint {
    /// Restores the checkpoint from `path`.
    pub fn load(path: &Path) -> Result<(Self, Restored), CheckpointError> {
        let mut checkpoint = Self {
            path: path.to_path_buf(),
            entries: BTreeMap::new(),
            listed: BTreeMap::new(),
            seen: BTreeMap::new(),
            recorded: BTreeMap::new(),
        };
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((checkpoint, Restored::Fresh)),
            Err(source) => return Err(CheckpointError::io("reading", path)(source)),
        };
        let version = serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|v| v.get("version").and_then(serde_json::Value::as_u64));
        if let Some(found) = version
            && found != u64::from(VERSION)
        {
            return Err(CheckpointError::UnknownVersion { path: path.to_path_buf(), found });
        }
        match serde_json::from_slice::<File>(&bytes) {
            Ok(file) => {
                checkpoint.entries = file.entries.into_iter().map(|e| (e.key.clone(), e)).collect();
                let now = Instant::now();
                checkpoint.recorded = checkpoint.entries.keys().map(|k| (k.clone(), now)).collect();
                Ok((checkpoint, Restored::Loaded))
            }
            Err(_) => {
                let aside = moved_aside_path(path);
                std::fs::rename(path, &aside).map_err(CheckpointError::io("moving aside corrupt", path))?;
                Ok((checkpoint, Restored::MovedAside(aside)))
            }
        }
    }

    /// The entry of an attachment.
    pub fn get(&self, key: &AttachmentKey) -> Option<&CheckpointEntry> {
        self.entries.get(key)
    }

    /// Every entry.
    pub fn entries(&self) -> impl Iterator<Item = &CheckpointEntry> {
        self.entries.values()
    }

    /// The file the checkpoint is saved to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The entries as they stand, to apply changes to a copy before it is saved.
    pub(super) fn entries_copy(&self) -> BTreeMap<AttachmentKey, CheckpointEntry> {
        self.entries.clone()
    }

    /// Applies a change that is saved; a changed or forgotten attachment's listing goes with
    /// it (a new record of the attachment was not listed yet), and a changed or new one is
    /// recorded now.
    pub(super) fn apply(&mut self, change: &Change) -> Applied {
        let (applied, touched) = change.apply_to(&mut self.entries);
        let now = Instant::now();
        match touched {
            Touched::Keys(keys) => {
                for key in keys {
                    self.listed.remove(&key);
                    self.seen.remove(&key);
                    match self.entries.contains_key(&key) {
                        true => self.recorded.insert(key, now),
                        false => self.recorded.remove(&key),
                    };
                }
            }
            Touched::All => {
                self.listed.retain(|k, _| self.entries.contains_key(k));
                self.seen.retain(|k, _| self.entries.contains_key(k));
                self.recorded.retain(|k, _| self.entries.contains_key(k));
                for key in self.entries.keys() {
                    self.recorded.entry(key.clone()).or_insert(now);
                }
            }
        }
        applied
    }

    /// Notes what the runtime's answer that came at `at` said of the sandboxes of `keys` (keys
    /// not recorded are ignored). Each time only moves forward: an answer noted after a newer
    /// one changes nothing.
    pub fn note_listed<'a>(
        &mut self,
        keys: impl IntoIterator<Item = &'a AttachmentKey>,
        at: Instant,
        listing: Listing,
    ) {
        let newer = |map: &mut BTreeMap<AttachmentKey, Instant>, key: &AttachmentKey| {
            let kept = map.entry(key.clone()).or_insert(at);
            *kept = (*kept).max(at);
        };
        for key in keys.into_iter().filter(|k| self.entries.contains_key(*k)) {
            newer(&mut self.listed, key);
            if listing == Listing::Returned {
                newer(&mut self.seen, key);
            }
        }
    }

    /// When this agent recorded the attachment (or loaded it at its start).
    pub fn recorded_at(&self, key: &AttachmentKey) -> Option<Instant> {
        self.recorded.get(key).copied()
    }

    /// When the newest answer came that had a recorded attachment's sandbox or could not deny
    /// having it, if one has since the attachment was recorded (and since this agent started).
    pub fn listed_at(&self, key: &AttachmentKey) -> Option<Instant> {
        self.listed.get(key).copied()
    }

    /// When the newest answer came that returned a recorded attachment's sandbox
    /// ([`Listing::Returned`]), if one has since the attachment was recorded (and since this
    /// agent started).
    pub fn seen_at(&self, key: &AttachmentKey) -> Option<Instant> {
        self.seen.get(key).copied()
    }
}

/// What an answer of the runtime said of a sandbox it did not deny having
/// ([`Checkpoint::note_listed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listing {
    /// The answer returned the sandbox (CRI listed it or gave its status, CNI GC named it a
    /// valid attachment): the runtime had it, and sandbox IDs never come back, so a later
    /// answer without it means it is gone.
    Returned,
    /// The runtime could not say (its status call failed): a release mark keeps waiting for
    /// the sandbox's DEL, but nothing is proven of it.
    Undenied,
}

/// A change to the checkpoint, saved before its caller hears back.
#[derive(Debug, Clone)]
pub(super) enum Change {
    /// Records an attachment (replacing its entry).
    Insert(CheckpointEntry),
    /// Forgets an attachment.
    Remove(AttachmentKey),
    /// Forgets every attachment not in the set (the attachments that records in the blocks
    /// name). At start, an entry no record names holds nothing any more (its records were
    /// released while the agent was down, or the node was deleted and registered again), so
    /// it must not live on as a sandbox.
    RetainRecorded(BTreeSet<AttachmentKey>),
    /// Replaces every entry (after rebuilding from the apiserver).
    ReplaceAll(Vec<CheckpointEntry>),
}

/// What a [`Change`] did.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Applied {
    /// `Insert` and `ReplaceAll` wrote their entries.
    Written,
    /// The entry `Remove` forgot, if it knew the attachment.
    Removed(Option<CheckpointEntry>),
    /// The entries `RetainRecorded` forgot.
    Dropped(Vec<CheckpointEntry>),
}

/// Which attachments a change touched.
enum Touched {
    Keys(Vec<AttachmentKey>),
    All,
}

impl Change {
    /// Applies the change to `entries`: what it did, and which attachments it touched.
    fn apply_to(&self, entries: &mut BTreeMap<AttachmentKey, CheckpointEntry>) -> (Applied, Touched) {
        match self {
            Change::Insert(entry) => {
                entries.insert(entry.key.clone(), entry.clone());
                (Applied::Written, Touched::Keys(vec![entry.key.clone()]))
            }
            Change::Remove(key) => (Applied::Removed(entries.remove(key)), Touched::Keys(vec![key.clone()])),
            Change::RetainRecorded(recorded) => {
                let (kept, dropped) = std::mem::take(entries).into_iter().partition(|(k, _)| recorded.contains(k));
                *entries = kept;
                let dropped: BTreeMap<AttachmentKey, CheckpointEntry> = dropped;
                (Applied::Dropped(dropped.into_values().collect()), Touched::All)
            }
            Change::ReplaceAll(all) => {
                *entries = all.iter().map(|e| (e.key.clone(), e.clone())).collect();
                (Applied::Written, Touched::All)
            }
        }
    }

    /// Applies the changes to `entries`; whether the file must be written (a change that
    /// forgets nothing writes nothing, as before there were batches).
    pub(super) fn apply_all(changes: &[&Change], entries: &mut BTreeMap<AttachmentKey, CheckpointEntry>) -> bool {
        changes.iter().fold(false, |write, change| {
            let (applied, _) = change.apply_to(entries);
            write
                || match applied {
                    Applied::Written => true,
                    Applied::Removed(removed) => removed.is_some(),
                    Applied::Dropped(dropped) => !dropped.is_empty(),
                }
        })
    }
}

/// Writes `entries` to `path` atomically: a crash leaves either the old or the new
/// checkpoint. Blocking (fsync): call it off the async runtime's threads.
pub(super) fn write_file(
    path: &Path,
    entries: &BTreeMap<AttachmentKey, CheckpointEntry>,
) -> Result<(), CheckpointError> {
    let io = CheckpointError::io;
    let file = File { version: VERSION, entries: entries.values().cloned().collect() };
    let bytes = serde_json::to_vec_pretty(&file).map_err(|e| io("encoding", path)(e.into()))?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io("creating the directory of", path))?;
    let temp = path.with_extension("tmp");
    let mut out = std::fs::File::create(&temp).map_err(io("creating", &temp))?;
    out.write_all(&bytes).map_err(io("writing", &temp))?;
    out.sync_all().map_err(io("syncing", &temp))?;
    std::fs::rename(&temp, path).map_err(io("renaming into place", path))?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io("syncing the directory of", path))
}

fn moved_aside_path(path: &Path) -> PathBuf {
    let stamp = jiff::Timestamp::now().as_second();
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".corrupt-{stamp}"));
    path.with_file_name(name)
}

#[cfg(test)]
pub(super) mod test {
    use super::*;

    /// A checkpoint path in a fresh scratch directory.
    pub(in crate::agent) fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ipwarden-checkpoint-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir.join("checkpoint.json")
    }

    /// An entry of sandbox `container`.
    pub(in crate::agent) fn entry(container: &str) -> CheckpointEntry {
        CheckpointEntry {
            key: AttachmentKey { network: "ipwarden".into(), container_id: container.into(), ifname: "eth0".into() },
            pod: PodRef { namespace: "default".into(), name: "web-0".into(), uid: "u1".into() },
            ips: vec![CheckpointIp {
                ip: "10.0.0.5".into(),
                prefix_len: 24,
                gateway: None,
                default_route: true,
                pool: "p".into(),
                block: "p-10-0-0-0-24".into(),
            }],
            spare_record: None,
        }
    }

    #[test]
    fn an_older_agents_entry_routes_via_its_gateway_and_a_default_route_is_not_written() {
        // Entries as agents before `defaultRoute` wrote them: with a gateway, and without.
        let path = scratch("older");
        let older = r#"{"version": 1, "entries": [
            {"network": "ipwarden", "containerId": "c1", "ifname": "eth0",
             "pod": {"namespace": "default", "name": "a", "uid": "u1"},
             "ips": [{"ip": "10.0.0.5", "prefixLen": 24, "gateway": "10.0.0.1", "pool": "p", "block": "b"}]},
            {"network": "ipwarden", "containerId": "c2", "ifname": "eth0",
             "pod": {"namespace": "default", "name": "b", "uid": "u2"},
             "ips": [{"ip": "10.0.0.6", "prefixLen": 24, "pool": "p", "block": "b"}]}]}"#;
        std::fs::write(&path, older).expect("write");
        let (checkpoint, restored) = Checkpoint::load(&path).expect("load");
        assert_eq!(restored, Restored::Loaded);
        let ips: Vec<(Option<&str>, bool)> =
            checkpoint.entries().flat_map(|e| &e.ips).map(|i| (i.gateway.as_deref(), i.default_route)).collect();
        assert_eq!(ips, [(Some("10.0.0.1"), true), (None, true)]);
        let routes: Vec<usize> =
            checkpoint.entries().map(|e| crate::agent::core::result_of(&e.ips).routes.len()).collect();
        assert_eq!(routes, [1, 0], "the gateway's entry routes, the other has nothing to route via");

        // Written back: `defaultRoute` only where it is false.
        let mut entries = checkpoint.entries_copy();
        if let Some(entry) = entries.values_mut().next() {
            entry.ips[0].default_route = false;
        }
        write_file(&path, &entries).expect("write");
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(text.matches("defaultRoute").count(), 1, "{text}");
        let (reloaded, _) = Checkpoint::load(&path).expect("reload");
        let flags: Vec<bool> = reloaded.entries().flat_map(|e| &e.ips).map(|i| i.default_route).collect();
        assert_eq!(flags, [false, true]);
    }

    #[test]
    fn a_missing_file_is_a_fresh_start() {
        let (checkpoint, restored) = Checkpoint::load(&scratch("fresh")).expect("load");
        assert_eq!(restored, Restored::Fresh);
        assert_eq!(checkpoint.entries().count(), 0);
    }

    #[test]
    fn an_unknown_version_refuses_to_start_and_leaves_the_file() {
        let path = scratch("version");
        std::fs::write(&path, r#"{"version": 7, "entries": []}"#).expect("write");
        let err = Checkpoint::load(&path).expect_err("unknown version refused");
        assert!(err.to_string().contains("has version 7, this agent reads version 1"), "{err}");
        assert!(path.exists(), "the file is left as it was");
    }

    #[test]
    fn a_corrupt_file_is_moved_aside_not_dropped() {
        for (name, garbage) in [("truncated", &br#"{"version": 1, "entr"#[..]), ("binary", &[0xff, 0x00, 0x13][..])] {
            let path = scratch(name);
            std::fs::write(&path, garbage).expect("write");
            let (checkpoint, restored) = Checkpoint::load(&path).expect("corrupt file is survivable");
            let Restored::MovedAside(aside) = restored else { panic!("{name}: expected MovedAside, got {restored:?}") };
            assert_eq!(std::fs::read(&aside).expect("kept"), garbage, "{name}: the corrupt bytes are kept");
            assert!(!path.exists());
            assert_eq!(checkpoint.entries().count(), 0);
        }
    }
}
