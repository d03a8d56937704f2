//! The agent's node-local record of what it handed out, keyed by (network, container ID,
//! interface): written atomically (temp file, fsync, rename, fsync of the directory) after
//! every change and restored at start. An unknown version refuses to start; a missing file
//! is rebuilt from the apiserver, and so is a corrupt one after it is moved aside (kept for
//! inspection).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::crd::PodRef;

/// The checkpoint format this agent writes and reads.
pub const VERSION: u32 = 1;

/// Why the checkpoint could not be read or written.
#[derive(Debug, thiserror::Error)]
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
        source: std::io::Error,
    },
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
    /// The pool.
    pub pool: String,
    /// The IPBlock holding the record.
    pub block: String,
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
    /// When the runtime's CNI GC last listed each recorded attachment as valid. In memory
    /// only: after a restart, the runtime's next GC call says it again.
    listed: BTreeMap<AttachmentKey, Instant>,
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
        let mut checkpoint = Self { path: path.to_path_buf(), entries: BTreeMap::new(), listed: BTreeMap::new() };
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((checkpoint, Restored::Fresh)),
            Err(source) => return Err(CheckpointError::Io { what: "reading", path: path.to_path_buf(), source }),
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
                Ok((checkpoint, Restored::Loaded))
            }
            Err(_) => {
                let aside = moved_aside_path(path);
                std::fs::rename(path, &aside).map_err(|source| CheckpointError::Io {
                    what: "moving aside corrupt",
                    path: path.to_path_buf(),
                    source,
                })?;
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

    /// Records an attachment and saves; when saving fails the attachment is not recorded
    /// in memory either, so a failed ADD is never answered from the checkpoint later.
    pub fn insert(&mut self, entry: CheckpointEntry) -> Result<(), CheckpointError> {
        let key = entry.key.clone();
        self.listed.remove(&key);
        let replaced = self.entries.insert(key.clone(), entry);
        self.save().inspect_err(|_| match replaced {
            Some(previous) => {
                self.entries.insert(key, previous);
            }
            None => {
                self.entries.remove(&key);
            }
        })
    }

    /// Forgets an attachment and saves (saving nothing when it was unknown).
    pub fn remove(&mut self, key: &AttachmentKey) -> Result<Option<CheckpointEntry>, CheckpointError> {
        let removed = self.entries.remove(key);
        self.listed.remove(key);
        if removed.is_some() {
            self.save()?;
        }
        Ok(removed)
    }

    /// Forgets every attachment not in `recorded` (the attachments that records in the
    /// blocks name) and saves; returns what it forgot. At start, an entry no record names
    /// holds nothing any more (its records were released while the agent was down, or the
    /// node was deleted and registered again), so it must not live on as a sandbox.
    pub fn retain_recorded(
        &mut self,
        recorded: &std::collections::BTreeSet<AttachmentKey>,
    ) -> Result<Vec<CheckpointEntry>, CheckpointError> {
        let (kept, dropped) = std::mem::take(&mut self.entries).into_iter().partition(|(k, _)| recorded.contains(k));
        self.entries = kept;
        self.listed.retain(|k, _| recorded.contains(k));
        let dropped: BTreeMap<AttachmentKey, CheckpointEntry> = dropped;
        if !dropped.is_empty() {
            self.save()?;
        }
        Ok(dropped.into_values().collect())
    }

    /// Replaces every entry (after rebuilding from the apiserver) and saves.
    pub fn replace_all(&mut self, entries: Vec<CheckpointEntry>) -> Result<(), CheckpointError> {
        self.entries = entries.into_iter().map(|e| (e.key.clone(), e)).collect();
        self.listed.clear();
        self.save()
    }

    /// Notes that the runtime's CNI GC listed `keys` as valid attachments at `at` (keys
    /// not recorded are ignored): the runtime still has those sandboxes.
    pub fn note_listed<'a>(&mut self, keys: impl IntoIterator<Item = &'a AttachmentKey>, at: Instant) {
        for key in keys.into_iter().filter(|k| self.entries.contains_key(*k)) {
            self.listed.insert(key.clone(), at);
        }
    }

    /// When the runtime's CNI GC last listed a recorded attachment, if it has since the
    /// attachment was recorded (and since this agent started).
    pub fn listed_at(&self, key: &AttachmentKey) -> Option<Instant> {
        self.listed.get(key).copied()
    }

    /// Writes the file atomically: a crash leaves either the old or the new checkpoint.
    fn save(&self) -> Result<(), CheckpointError> {
        let io = |what: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| CheckpointError::Io { what, path, source }
        };
        let file = File { version: VERSION, entries: self.entries.values().cloned().collect() };
        let bytes = serde_json::to_vec_pretty(&file).map_err(|e| CheckpointError::Io {
            what: "encoding",
            path: self.path.clone(),
            source: e.into(),
        })?;
        let dir = self.path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(io("creating the directory of", &self.path))?;
        let temp = self.path.with_extension("tmp");
        let mut out = std::fs::File::create(&temp).map_err(io("creating", &temp))?;
        out.write_all(&bytes).map_err(io("writing", &temp))?;
        out.sync_all().map_err(io("syncing", &temp))?;
        std::fs::rename(&temp, &self.path).map_err(io("renaming into place", &self.path))?;
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io("syncing the directory of", &self.path))
    }
}

fn moved_aside_path(path: &Path) -> PathBuf {
    let stamp = jiff::Timestamp::now().as_second();
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".corrupt-{stamp}"));
    path.with_file_name(name)
}

#[cfg(test)]
mod test {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ipwarden-checkpoint-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir.join("checkpoint.json")
    }

    fn entry(container: &str) -> CheckpointEntry {
        CheckpointEntry {
            key: AttachmentKey { network: "ipwarden".into(), container_id: container.into(), ifname: "eth0".into() },
            pod: PodRef { namespace: "default".into(), name: "web-0".into(), uid: "u1".into() },
            ips: vec![CheckpointIp {
                ip: "10.0.0.5".into(),
                prefix_len: 24,
                gateway: None,
                pool: "p".into(),
                block: "p-10-0-0-0-24".into(),
            }],
        }
    }

    #[test]
    fn only_entries_that_a_record_names_are_retained() {
        let path = scratch("retain");
        let (mut checkpoint, _) = Checkpoint::load(&path).expect("load");
        checkpoint.insert(entry("recorded")).expect("insert");
        checkpoint.insert(entry("released")).expect("insert");
        let recorded = std::collections::BTreeSet::from([entry("recorded").key]);
        let dropped = checkpoint.retain_recorded(&recorded).expect("retain");
        assert_eq!(dropped, vec![entry("released")]);
        let (reloaded, _) = Checkpoint::load(&path).expect("reload");
        assert_eq!(reloaded.entries().cloned().collect::<Vec<_>>(), vec![entry("recorded")], "saved");
    }

    #[test]
    fn a_runtime_listing_lasts_as_long_as_the_attachment_it_names() {
        let (mut checkpoint, _) = Checkpoint::load(&scratch("listed")).expect("load");
        checkpoint.insert(entry("c1")).expect("insert");
        checkpoint.insert(entry("c2")).expect("insert");
        let at = Instant::now();
        checkpoint.note_listed([&entry("c1").key, &entry("c2").key, &entry("unknown").key], at);
        assert_eq!(checkpoint.listed_at(&entry("c1").key), Some(at));
        assert_eq!(checkpoint.listed_at(&entry("unknown").key), None, "an unrecorded attachment is not noted");
        checkpoint.remove(&entry("c1").key).expect("remove");
        checkpoint.insert(entry("c1")).expect("insert");
        assert_eq!(checkpoint.listed_at(&entry("c1").key), None, "a new record of the attachment was not listed yet");
        checkpoint.retain_recorded(&std::collections::BTreeSet::new()).expect("retain");
        assert_eq!(checkpoint.listed_at(&entry("c2").key), None, "a dropped attachment's listing goes with it");
    }

    #[test]
    fn a_missing_file_is_a_fresh_start() {
        let (checkpoint, restored) = Checkpoint::load(&scratch("fresh")).expect("load");
        assert_eq!(restored, Restored::Fresh);
        assert_eq!(checkpoint.entries().count(), 0);
    }

    #[test]
    fn entries_survive_a_save_and_a_reload() {
        let path = scratch("roundtrip");
        let (mut checkpoint, _) = Checkpoint::load(&path).expect("load");
        checkpoint.insert(entry("c1")).expect("insert");
        checkpoint.insert(entry("c2")).expect("insert");
        checkpoint.remove(&entry("c1").key).expect("remove");
        let (reloaded, restored) = Checkpoint::load(&path).expect("reload");
        assert_eq!(restored, Restored::Loaded);
        assert_eq!(reloaded.entries().cloned().collect::<Vec<_>>(), vec![entry("c2")]);
        assert!(!path.with_extension("tmp").exists(), "no temp file is left behind");
    }

    #[test]
    fn an_insert_that_cannot_be_saved_is_not_kept_in_memory() {
        let path = scratch("unsaved");
        let (mut checkpoint, _) = Checkpoint::load(&path).expect("load");
        checkpoint.insert(entry("c1")).expect("insert");
        // A directory where the temp file goes: creating it fails, even for root.
        std::fs::create_dir(path.with_extension("tmp")).expect("block the temp file");
        let mut replacement = entry("c1");
        replacement.ips.clear();
        checkpoint.insert(entry("c2")).expect_err("the save fails");
        checkpoint.insert(replacement).expect_err("the save fails");
        assert_eq!(checkpoint.entries().cloned().collect::<Vec<_>>(), vec![entry("c1")], "memory matches the file");
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
