//! What real nodes change on the machine, and undoing it. kubelet sets kernel sysctls and adds
//! iptables chains (one drops non-loopback traffic to 127/8), portmap adds its own, and each
//! node's kubelet needs a non-loopback node IP on an interface. Only one set of real nodes may
//! run on a machine at a time: [`HostGuard`] holds a machine-wide lock, records the host's
//! state before the first node starts (in a file, so a run killed before its teardown is
//! undone by the next one) and puts it back when the last node is gone, also after a panic.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The machine-wide lock of real nodes: held while any run has real nodes.
const LOCK_PATH: &str = "/run/ipwarden-e2e-real-nodes.lock";

/// The host state recorded before real nodes started, removed once it is put back.
const STATE_PATH: &str = "/run/ipwarden-e2e-real-nodes.state.json";

/// The sysctls kubelet (and the pod network) may change, by their /proc/sys paths.
const SYSCTLS: [&str; 7] = [
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "net/ipv4/ip_forward",
];

/// The interface the real nodes' node IPs are added to (kubelet refuses a loopback node IP and
/// one no interface holds).
const NODE_IP_DEVICE: &str = "lo";

/// The node IP of real node `index`: from TEST-NET-1 (RFC 5737), which no network routes.
pub fn node_ip(index: usize) -> String {
    format!("192.0.2.{}", 10 + index % 240)
}

/// The machine's state that real nodes change.
#[derive(Debug, Default, Serialize, Deserialize)]
struct HostState {
    /// `/proc/sys` path -> value.
    sysctls: Vec<(String, String)>,
    /// `iptables-save` and `ip6tables-save` output.
    iptables: String,
    ip6tables: String,
    /// Node IPs added to [`NODE_IP_DEVICE`].
    node_ips: Vec<String>,
}

/// Held while real nodes run: the machine-wide lock and the recorded host state, put back on
/// drop.
#[derive(Debug)]
pub struct HostGuard {
    _lock: nix::fcntl::Flock<File>,
    state: HostState,
}

impl HostGuard {
    /// Takes the machine-wide lock (waiting for another run's real nodes to finish), undoes what
    /// a run killed before its teardown left, and records the host's state.
    pub fn acquire() -> Result<Self> {
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(LOCK_PATH)
            .map_err(Error::io("opening the real nodes' lock", LOCK_PATH))?;
        // Held while the guard lives: dropped, its file closes and the lock goes with it (also
        // for a waiting test of the same process, whose own open of the file is another lock).
        let lock = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| Error::io("locking the real nodes' lock", LOCK_PATH)(e.into()))?;
        if let Ok(text) = std::fs::read_to_string(STATE_PATH) {
            match serde_json::from_str::<HostState>(&text) {
                Ok(left) => {
                    eprintln!("ipwarden-e2e: a run with real nodes ended without its teardown; putting the host back");
                    left.restore();
                }
                Err(e) => eprintln!("ipwarden-e2e: ignoring unreadable {STATE_PATH}: {e}"),
            }
        }
        let state = HostState {
            sysctls: SYSCTLS
                .iter()
                .filter_map(|key| {
                    let value = std::fs::read_to_string(Path::new("/proc/sys").join(key)).ok()?;
                    Some((key.to_string(), value.trim().to_string()))
                })
                .collect(),
            iptables: command_output("iptables-save", &[])?,
            ip6tables: command_output("ip6tables-save", &[]).unwrap_or_default(),
            node_ips: Vec::new(),
        };
        let guard = Self { _lock: lock, state };
        guard.save()?;
        Ok(guard)
    }

    /// Adds node IP `ip` to the host, to be removed at teardown.
    pub fn add_node_ip(&mut self, ip: &str) -> Result<()> {
        let cidr = format!("{ip}/32");
        // A leftover of a run killed before its teardown: replace it.
        let _absent = command_output("ip", &["addr", "del", &cidr, "dev", NODE_IP_DEVICE]);
        command_output("ip", &["addr", "add", &cidr, "dev", NODE_IP_DEVICE])?;
        self.state.node_ips.push(ip.to_string());
        self.save()
    }

    fn save(&self) -> Result<()> {
        let text = serde_json::to_string(&self.state)
            .map_err(|e| Error::io("serializing the host state", STATE_PATH)(e.into()))?;
        std::fs::write(STATE_PATH, text).map_err(Error::io("recording the host state", STATE_PATH))
    }
}

impl Drop for HostGuard {
    fn drop(&mut self) {
        self.state.restore();
        let _gone = std::fs::remove_file(STATE_PATH);
    }
}

impl HostState {
    /// Puts the recorded state back; reports what fails and goes on.
    fn restore(&self) {
        for (key, value) in &self.sysctls {
            let path = Path::new("/proc/sys").join(key);
            if let Err(e) = std::fs::write(&path, value) {
                eprintln!("ipwarden-e2e: could not restore {}: {e}", path.display());
            }
        }
        for (tool, saved) in [("iptables-restore", &self.iptables), ("ip6tables-restore", &self.ip6tables)] {
            if saved.is_empty() {
                continue;
            }
            if let Err(e) = command_with_input(tool, &with_empty_tables(saved)) {
                eprintln!("ipwarden-e2e: could not restore the firewall rules: {e}");
            }
        }
        for ip in &self.node_ips {
            let _gone = command_output("ip", &["addr", "del", &format!("{ip}/32"), "dev", NODE_IP_DEVICE]);
        }
    }
}

/// The tables kubelet and the CNI plugins add chains to.
const TABLES: [&str; 4] = ["filter", "nat", "mangle", "raw"];

/// `iptables-save` output plus an empty section for each of [`TABLES`] it lacks: restored, an
/// empty section empties that table, which was empty (unloaded) when the state was recorded.
fn with_empty_tables(saved: &str) -> String {
    let mut text = saved.to_string();
    for table in TABLES {
        if !saved.lines().any(|line| line == format!("*{table}")) {
            text.push_str(&format!("*{table}\nCOMMIT\n"));
        }
    }
    text
}

/// Runs `program args` to completion; its standard output, or an error naming it.
pub fn command_output(program: &str, args: &[&str]) -> Result<String> {
    let output = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| Error::Tool { command: format!("{program} {}", args.join(" ")), reason: e.to_string() })?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(Error::Tool {
            command: format!("{program} {}", args.join(" ")),
            reason: format!("{}: {}", output.status, String::from_utf8_lossy(&output.stderr).trim()),
        })
    }
}

fn command_with_input(program: &str, input: &str) -> Result<()> {
    use std::io::Write;
    let mut child = Command::new(program)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| Error::Tool { command: program.to_string(), reason: e.to_string() })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input.as_bytes())
            .map_err(|e| Error::Tool { command: program.to_string(), reason: e.to_string() })?;
    }
    let output =
        child.wait_with_output().map_err(|e| Error::Tool { command: program.to_string(), reason: e.to_string() })?;
    if output.status.success() {
        Ok(())
    } else {
        Err(Error::Tool {
            command: program.to_string(),
            reason: format!("{}: {}", output.status, String::from_utf8_lossy(&output.stderr).trim()),
        })
    }
}

/// Unmounts every mount point under `dir`, deepest first (kubelet's bind mount of its root
/// directory, pod volumes, container root filesystems, network namespaces, shm).
pub fn unmount_under(dir: &Path) {
    let Ok(table) = std::fs::read_to_string("/proc/self/mountinfo") else { return };
    let mut points: Vec<PathBuf> = table
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|point| PathBuf::from(point.replace("\\040", " ")))
        .filter(|point| point.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for point in points {
        if let Err(e) = nix::mount::umount2(&point, nix::mount::MntFlags::MNT_DETACH) {
            eprintln!("ipwarden-e2e: could not unmount {}: {e}", point.display());
        }
    }
}

/// Makes cgroup `root` (`/name`) in every cgroup hierarchy: kubelet refuses a `cgroupRoot` that
/// does not exist. A new cgroup v1 cpuset has no CPUs or memory nodes: it gets its parent's.
pub fn create_cgroups(root: &str) -> Result<()> {
    let hierarchies =
        std::fs::read_dir("/sys/fs/cgroup").map_err(Error::io("listing cgroup hierarchies", "/sys/fs/cgroup"))?;
    for hierarchy in hierarchies.flatten() {
        if !hierarchy.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let dir = hierarchy.path().join(root.trim_start_matches('/'));
        std::fs::create_dir_all(&dir).map_err(Error::io("making a real node's cgroup", &dir))?;
        for file in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(value) = std::fs::read_to_string(hierarchy.path().join(file)) {
                std::fs::write(dir.join(file), value.trim())
                    .map_err(Error::io("setting a real node's cpuset", dir.join(file)))?;
            }
        }
    }
    Ok(())
}

/// Removes cgroup `root` (`/name`) and everything under it in every cgroup hierarchy, after
/// killing what still runs there.
pub fn remove_cgroups(root: &str) {
    let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") else { return };
    for hierarchy in hierarchies.flatten() {
        let top = hierarchy.path().join(root.trim_start_matches('/'));
        if top.is_dir() {
            kill_and_remove(&top);
        }
    }
}

fn kill_and_remove(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                kill_and_remove(&entry.path());
            }
        }
    }
    if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            let _gone = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
    for _ in 0..50 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
        }
    }
    eprintln!("ipwarden-e2e: could not remove cgroup {}", dir.display());
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn tables_missing_from_the_saved_rules_are_restored_empty() {
        let saved = "*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n";
        let text = with_empty_tables(saved);
        assert!(text.starts_with(saved));
        assert!(text.contains("*nat\nCOMMIT\n") && text.contains("*mangle\nCOMMIT\n"));
        assert_eq!(text.matches("*filter").count(), 1);
    }

    #[test]
    fn node_ips_are_documentation_addresses_and_distinct() {
        assert_eq!(node_ip(0), "192.0.2.10");
        assert_ne!(node_ip(1), node_ip(2));
    }
}
