//! One agent per node: an exclusive lock on a file beside the checkpoint, taken before the
//! agent touches its socket or checkpoint. A second agent for the node (a DaemonSet update
//! with `maxSurge`, or one started by hand) refuses to start and names the holder, instead
//! of taking over the socket and rewriting the checkpoint and records the first one wrote.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

/// Why the agent lock was not taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another live process holds the lock.
    #[error(
        "the agent lock {path} is held by {holder}: another agent serves this node's socket and \
         checkpoint; stop it before starting this one"
    )]
    Held {
        /// The lock file.
        path: PathBuf,
        /// Who holds it, as the holder wrote it into the file.
        holder: String,
    },
    /// Opening, locking or writing the lock file failed.
    #[error("{what} the agent lock {path}: {source}")]
    Io {
        /// The operation.
        what: &'static str,
        /// The lock file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

/// The held lock. The kernel releases it when the process exits, however it exits, so a
/// crashed agent never blocks the next one.
#[derive(Debug)]
pub struct AgentLock {
    _file: Flock<File>,
}

/// The lock file of the checkpoint at `checkpoint`: the same name with `.lock` appended.
pub fn lock_path(checkpoint: &Path) -> PathBuf {
    let mut name = checkpoint.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".lock");
    checkpoint.with_file_name(name)
}

impl AgentLock {
    /// Takes the lock of the checkpoint at `checkpoint` without waiting and writes this
    /// process's pid and `node` into it, for the error a second agent reports.
    pub fn acquire(checkpoint: &Path, node: &str) -> Result<Self, LockError> {
        let path = lock_path(checkpoint);
        let io = |what: &'static str| {
            let path = path.clone();
            move |source| LockError::Io { what, path, source }
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io("creating the directory of"))?;
        }
        let file =
            File::options().read(true).write(true).create(true).truncate(false).open(&path).map_err(io("opening"))?;
        let mut file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(locked) => locked,
            Err((mut file, Errno::EWOULDBLOCK)) => {
                let mut written = String::new();
                file.read_to_string(&mut written).map_err(io("reading the holder of"))?;
                let holder = match written.trim() {
                    "" => "an agent that has not written its pid yet".to_string(),
                    holder => holder.to_string(),
                };
                return Err(LockError::Held { path, holder });
            }
            Err((_, errno)) => return Err(io("locking")(errno.into())),
        };
        file.set_len(0).map_err(io("truncating"))?;
        file.rewind().map_err(io("rewinding"))?;
        writeln!(file, "pid {} on node {node}", std::process::id()).map_err(io("writing"))?;
        file.sync_all().map_err(io("syncing"))?;
        Ok(Self { _file: file })
    }
}

#[cfg(test)]
mod test {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ipwarden-lock-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir.join("checkpoint.json")
    }

    #[test]
    fn the_lock_file_sits_beside_the_checkpoint() {
        assert_eq!(
            lock_path(Path::new("/var/lib/ipwarden/checkpoint.json")),
            Path::new("/var/lib/ipwarden/checkpoint.json.lock")
        );
    }

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_pid_and_node_until_it_lets_go() {
        let checkpoint = scratch("second");
        let first = AgentLock::acquire(&checkpoint, "node-0").expect("the first agent locks");
        let err = AgentLock::acquire(&checkpoint, "node-0").expect_err("a second agent is refused");
        let text = err.to_string();
        assert!(text.contains(&format!("is held by pid {} on node node-0", std::process::id())), "{text}");
        drop(first);
        AgentLock::acquire(&checkpoint, "node-0").expect("free again once the holder is gone");
    }
}
