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

use super::Runtime;
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

/// The machine's state that real nodes change, and the nodes themselves (so that a later run
/// can stop what a killed run left running).
#[derive(Debug, Default, Serialize, Deserialize)]
struct HostState {
    /// `/proc/sys` path -> value.
    sysctls: Vec<(String, String)>,
    /// `iptables-save` and `ip6tables-save` output: the chains there were before.
    iptables: String,
    ip6tables: String,
    /// Node IPs added to [`NODE_IP_DEVICE`].
    node_ips: Vec<String>,
    /// The real nodes started: (directory, runtime marker (`NodePaths::runtime_marker`),
    /// cgroup root).
    nodes: Vec<(PathBuf, String, String)>,
    /// The cgroup v1 hierarchies mounted for the nodes, by their mount points.
    #[serde(default)]
    cgroup_mounts: Vec<PathBuf>,
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
                    left.stop_nodes();
                    left.restore();
                }
                Err(e) => eprintln!("ipwarden-e2e: ignoring unreadable {STATE_PATH}: {e}"),
            }
            let _gone = std::fs::remove_file(STATE_PATH);
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
            nodes: Vec::new(),
            cgroup_mounts: Vec::new(),
        };
        let guard = Self { _lock: lock, state };
        guard.save()?;
        Ok(guard)
    }

    /// Records a node (its directory, runtime marker and cgroup root) about to start, for a
    /// later run to stop should this one be killed.
    pub fn add_node(&mut self, dir: &Path, marker: &str, cgroup_root: &str) -> Result<()> {
        self.state.nodes.push((dir.to_path_buf(), marker.to_string(), cgroup_root.to_string()));
        self.save()
    }

    /// Adds node IP `ip` to the host, to be removed at teardown. Fails when the host has it
    /// already (someone else's: a killed run's is removed by the next one's recovery).
    pub fn add_node_ip(&mut self, ip: &str) -> Result<()> {
        let cidr = format!("{ip}/32");
        let present = command_output("ip", &["-o", "addr", "show", "dev", NODE_IP_DEVICE])?;
        if present.split_whitespace().any(|word| word == cidr) {
            return Err(Error::Tool {
                command: format!("ip addr add {cidr} dev {NODE_IP_DEVICE}"),
                reason: format!("{NODE_IP_DEVICE} has {cidr} already, not added by the harness: remove it or free it"),
            });
        }
        command_output("ip", &["addr", "add", &cidr, "dev", NODE_IP_DEVICE])?;
        self.state.node_ips.push(ip.to_string());
        self.save()
    }

    /// On a cgroup v1 (or hybrid) host, mounts a cgroup v1 hierarchy of each of `controllers`
    /// that the kernel has but no mounted v1 hierarchy holds (this machine's hybrid layout
    /// leaves `hugetlb` to the unused cgroup v2 hierarchy), at `/sys/fs/cgroup/<controller>`,
    /// to be unmounted at teardown. CRI-O needs
    /// it: it reads the controllers from `/proc/cgroups` and sets hugetlb limits, which runc
    /// then fails to apply ("cannot set hugetlb limit: container could not join or create
    /// cgroup"); containerd drops them instead (`tolerate_missing_hugetlb_controller`). A real
    /// cgroup v1 machine mounts every controller.
    pub fn mount_cgroup_v1_controllers(&mut self, controllers: &[&str]) -> Result<()> {
        let table = std::fs::read_to_string("/proc/cgroups").map_err(Error::io("reading", "/proc/cgroups"))?;
        let mounts =
            std::fs::read_to_string("/proc/self/mountinfo").map_err(Error::io("reading", "/proc/self/mountinfo"))?;
        for controller in unmounted_v1_controllers(&table, &mounts, controllers) {
            let point = Path::new("/sys/fs/cgroup").join(&controller);
            std::fs::create_dir(&point).map_err(Error::io("making a cgroup mount point", &point))?;
            let flags = nix::mount::MsFlags::empty();
            if let Err(e) = nix::mount::mount(Some("cgroup"), &point, Some("cgroup"), flags, Some(controller.as_str()))
            {
                let _gone = std::fs::remove_dir(&point);
                return Err(Error::Tool {
                    command: format!("mount -t cgroup -o {controller} cgroup {}", point.display()),
                    reason: e.to_string(),
                });
            }
            self.state.cgroup_mounts.push(point);
            self.save()?;
        }
        Ok(())
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
    /// Stops what the recorded nodes left running: their containers and cgroups, the processes
    /// naming their runtime marker (shims, conmons) or a path in their directory (kubelet, the
    /// runtime, whose configuration is there, and agents), their mounts.
    fn stop_nodes(&self) {
        for (dir, marker, cgroup_root) in &self.nodes {
            remove_cgroups(cgroup_root);
            kill_processes_naming(marker);
            kill_processes_naming(&format!("{}/", dir.display()));
            unmount_under(dir);
        }
    }

    /// Puts the recorded state back: the sysctls that changed, the node IPs gone, and the
    /// chains kubelet and the CNI plugins added (`KUBE-*`, `CNI-*`, with the rules jumping to
    /// them) removed; nothing else of the firewall is touched. Reports what fails and goes on.
    fn restore(&self) {
        for (key, value) in &self.sysctls {
            let path = Path::new("/proc/sys").join(key);
            let now = std::fs::read_to_string(&path).unwrap_or_default();
            if now.trim() != value
                && let Err(e) = std::fs::write(&path, value)
            {
                eprintln!("ipwarden-e2e: could not restore {}: {e}", path.display());
            }
        }
        for (family, saved) in [("iptables", &self.iptables), ("ip6tables", &self.ip6tables)] {
            let Ok(now) = command_output(&format!("{family}-save"), &[]) else { continue };
            let removal = removal_of_added_chains(saved, &now);
            if removal.is_empty() {
                continue;
            }
            if let Err(e) = command_with_input(&format!("{family}-restore"), &["--noflush"], &removal) {
                eprintln!("ipwarden-e2e: could not remove the chains real nodes added ({family}): {e}");
            }
        }
        for ip in &self.node_ips {
            let _gone = command_output("ip", &["addr", "del", &format!("{ip}/32"), "dev", NODE_IP_DEVICE]);
        }
        for point in &self.cgroup_mounts {
            if let Err(e) = nix::mount::umount2(point, nix::mount::MntFlags::MNT_DETACH) {
                eprintln!("ipwarden-e2e: could not unmount {}: {e}", point.display());
            }
            let _gone = std::fs::remove_dir(point);
        }
    }
}

/// Whether this process has CAP_SYS_RESOURCE (which lowering a process's `oom_score_adj`
/// needs): bit 24 of `CapEff` in `/proc/self/status`.
pub fn has_sys_resource() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    effective_caps_have(&status, 24)
}

/// Whether the `CapEff` line of `status` (`/proc/<pid>/status`) has capability `bit`.
fn effective_caps_have(status: &str, bit: u32) -> bool {
    status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << bit) != 0)
}

/// Which of `wanted` the kernel has enabled (`/proc/cgroups`, `table`) and no mounted cgroup
/// v1 hierarchy holds (`/proc/self/mountinfo`, `mounts`); none on a host whose
/// `/sys/fs/cgroup` is not the tmpfs of cgroup v1 (a cgroup v2 host).
fn unmounted_v1_controllers(table: &str, mounts: &str, wanted: &[&str]) -> Vec<String> {
    // A mountinfo line: ID, parent, device, root, mount point, options, optional fields, "-",
    // file system type, source, super options.
    let mounted: Vec<(&str, &str, &str)> = mounts
        .lines()
        .filter_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let point = before.split(' ').nth(4)?;
            let mut after = after.split(' ');
            Some((point, after.next()?, after.nth(1)?))
        })
        .collect();
    if !mounted.iter().any(|(point, fstype, _)| *point == "/sys/fs/cgroup" && *fstype == "tmpfs") {
        return Vec::new();
    }
    let in_v1 = |controller: &str| {
        mounted.iter().any(|(_, fstype, options)| *fstype == "cgroup" && options.split(',').any(|o| o == controller))
    };
    table
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| match line.split_whitespace().collect::<Vec<_>>()[..] {
            [name, _, _, "1"] if wanted.contains(&name) && !in_v1(name) => Some(name.to_string()),
            _ => None,
        })
        .collect()
}

/// The prefixes of the chains kubelet (`KUBE-`) and the CNI plugins (`CNI-`: portmap, ptp's
/// masquerading) add.
const ADDED_CHAIN_PREFIXES: [&str; 2] = ["KUBE-", "CNI-"];

/// An `iptables-restore --noflush` input that removes, from the rules `now` (`iptables-save`
/// output), every chain named with [`ADDED_CHAIN_PREFIXES`] that `saved` did not have, and
/// every rule of another chain jumping to one; empty when there is none.
fn removal_of_added_chains(saved: &str, now: &str) -> String {
    let chains_of = |text: &str| -> std::collections::BTreeSet<(String, String)> {
        let mut table = String::new();
        let mut chains = std::collections::BTreeSet::new();
        for line in text.lines() {
            if let Some(name) = line.strip_prefix('*') {
                table = name.to_string();
            } else if let Some(rest) = line.strip_prefix(':') {
                let chain = rest.split_whitespace().next().unwrap_or_default();
                chains.insert((table.clone(), chain.to_string()));
            }
        }
        chains
    };
    let before = chains_of(saved);
    let added: std::collections::BTreeSet<(String, String)> = chains_of(now)
        .into_iter()
        .filter(|(_, chain)| ADDED_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p)))
        .filter(|key| !before.contains(key))
        .collect();
    let mut out = String::new();
    let mut table = String::new();
    let mut jumps: Vec<String> = Vec::new();
    let flush = |table: &str, jumps: &mut Vec<String>, out: &mut String| {
        let chains: Vec<&String> = added.iter().filter(|(t, _)| t == table).map(|(_, c)| c).collect();
        if chains.is_empty() && jumps.is_empty() {
            return;
        }
        out.push_str(&format!("*{table}\n"));
        for rule in jumps.drain(..) {
            out.push_str(&rule);
            out.push('\n');
        }
        for chain in &chains {
            out.push_str(&format!("-F {chain}\n"));
        }
        for chain in &chains {
            out.push_str(&format!("-X {chain}\n"));
        }
        out.push_str("COMMIT\n");
    };
    for line in now.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = name.to_string();
        } else if line == "COMMIT" {
            flush(&table, &mut jumps, &mut out);
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let from = rule.split_whitespace().next().unwrap_or_default();
            let target = rule.split_whitespace().skip_while(|w| *w != "-j" && *w != "-g").nth(1).unwrap_or_default();
            let is_added = |chain: &str| added.contains(&(table.clone(), chain.to_string()));
            if !is_added(from) && is_added(target) {
                jumps.push(format!("-D {rule}"));
            }
        }
    }
    out
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

fn command_with_input(program: &str, args: &[&str], input: &str) -> Result<()> {
    use std::io::Write;
    let mut child = Command::new(program)
        .args(args)
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

/// Makes `dir` a shared mount point (bound onto itself, then shared recursively), as kubelet
/// does with its root directory: a pod mounting a host path under it with `HostToContainer`
/// propagation (the chart's agent, the runtime's socket directory) needs it on a shared or
/// slave mount, which a systemd host's `/` is and this machine's is not ("path ... is mounted
/// on / but it is not a shared or slave mount"). [`unmount_under`] of `dir` undoes it.
pub fn share_mounts_under(dir: &Path) -> Result<()> {
    use nix::mount::{MsFlags, mount};
    let fail = |what: &str| {
        let what = format!("{what} {}", dir.display());
        move |e: nix::Error| Error::Tool { command: what.clone(), reason: e.to_string() }
    };
    mount(Some(dir), dir, None::<&str>, MsFlags::MS_BIND | MsFlags::MS_REC, None::<&str>)
        .map_err(fail("mount --rbind onto itself"))?;
    mount(None::<&str>, dir, None::<&str>, MsFlags::MS_SHARED | MsFlags::MS_REC, None::<&str>)
        .map_err(fail("mount --make-rshared"))
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

/// Removes the symbolic links in `dir` that point into `target` (kubelet's container log links
/// of a node that is gone).
pub fn remove_links_into(dir: &Path, target: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        if std::fs::read_link(entry.path()).is_ok_and(|to| to.starts_with(target)) {
            let _gone = std::fs::remove_file(entry.path());
        }
    }
}

/// Removes the files in `dir` whose content names `target` (libcni's cached results of a
/// node's sandboxes, which name their network namespace under the node's directory).
pub fn remove_files_naming(dir: &Path, target: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let needle = target.display().to_string();
    for entry in entries.flatten() {
        if std::fs::read_to_string(entry.path()).is_ok_and(|text| text.contains(&needle)) {
            let _gone = std::fs::remove_file(entry.path());
        }
    }
}

/// SIGKILLs every process whose command line contains `text` (a node's runtime marker, which
/// its runtime, its shims or conmons and an agent asking it over CRI name; its kubelet's
/// configuration file): the leftovers of a killed run.
pub fn kill_processes_naming(text: &str) {
    kill_processes(text, None);
}

/// SIGKILLs the container monitors of a node's `runtime` whose command line names `marker`
/// (`NodePaths::runtime_marker`): containerd's shims, CRI-O's conmons; no other process naming
/// it (an agent asking the runtime over CRI lives on).
pub fn kill_monitors_of(runtime: Runtime, marker: &str) {
    let monitor = match runtime {
        Runtime::Containerd => "containerd-shim-runc-v2",
        Runtime::Crio => "conmon",
    };
    kill_processes(marker, Some(monitor));
}

/// SIGKILLs every process but this one whose command line contains `text` and, with
/// `program`, whose executable's file name is `program`.
fn kill_processes(text: &str, program: Option<&str>) {
    let Ok(entries) = std::fs::read_dir("/proc") else { return };
    let me = std::process::id().to_string();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().filter(|p| *p != me).and_then(|p| p.parse::<i32>().ok()) else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let argv0 = cmdline.split(|b| *b == 0).next().map(String::from_utf8_lossy).unwrap_or_default();
        let runs_program = program.is_none_or(|p| Path::new(argv0.as_ref()).file_name().is_some_and(|f| f == p));
        if runs_program && String::from_utf8_lossy(&cmdline).replace('\0', " ").contains(text) {
            let _gone = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
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
    fn only_the_chains_real_nodes_added_and_the_jumps_to_them_are_removed() {
        let saved = "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-OLD - [0:0]\n:DOCKER - [0:0]\nCOMMIT\n";
        let now = "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-OLD - [0:0]\n:DOCKER - [0:0]\n:KUBE-FIREWALL - [0:0]\n\
            -A INPUT -j KUBE-FIREWALL\n-A INPUT -j DOCKER\n-A INPUT -j KUBE-OLD\n\
            -A KUBE-FIREWALL ! -s 127.0.0.0/8 -m comment --comment \"block it\" -j DROP\nCOMMIT\n\
            *nat\n:POSTROUTING ACCEPT [0:0]\n:CNI-abc - [0:0]\n-A POSTROUTING -s 10.0.0.2/32 -j CNI-abc\nCOMMIT\n";
        assert_eq!(
            removal_of_added_chains(saved, now),
            "*filter\n-D INPUT -j KUBE-FIREWALL\n-F KUBE-FIREWALL\n-X KUBE-FIREWALL\nCOMMIT\n\
             *nat\n-D POSTROUTING -s 10.0.0.2/32 -j CNI-abc\n-F CNI-abc\n-X CNI-abc\nCOMMIT\n"
        );
        assert_eq!(removal_of_added_chains(now, now), "");
    }

    #[test]
    fn only_enabled_controllers_no_mounted_v1_hierarchy_holds_are_mounted_and_only_on_v1_hosts() {
        let table = "#subsys_name\thierarchy\tnum_cgroups\tenabled\ncpu\t1\t13\t1\nhugetlb\t0\t13\t1\n\
                     net_cls\t0\t13\t1\npids\t0\t1\t0\n";
        let hybrid = "25 21 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n\
                      26 25 0:23 / /sys/fs/cgroup/cpu rw,relatime shared:7 - cgroup cgroup rw,cpu\n\
                      27 25 0:24 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n";
        let wanted = ["hugetlb", "cpu", "pids"];
        assert_eq!(unmounted_v1_controllers(table, hybrid, &wanted), vec!["hugetlb".to_string()]);
        // A lingering hierarchy (non-zero ID, no mount) is mounted again.
        let lingering = "hugetlb\t10\t1\t1\n";
        assert_eq!(unmounted_v1_controllers(lingering, hybrid, &["hugetlb"]), vec!["hugetlb".to_string()]);
        let with_hugetlb = format!("{hybrid}28 25 0:25 / /sys/fs/cgroup/hugetlb rw - cgroup cgroup rw,hugetlb\n");
        assert!(unmounted_v1_controllers(table, &with_hugetlb, &["hugetlb"]).is_empty());
        let v2 = "25 21 0:22 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert!(unmounted_v1_controllers(table, v2, &["hugetlb"]).is_empty());
    }

    #[test]
    fn capabilities_are_read_from_the_effective_set() {
        let without = "CapInh:\t0000000000000000\nCapEff:\t00000000a80425fb\n";
        assert!(!effective_caps_have(without, 24));
        assert!(effective_caps_have(without, 0));
        assert!(effective_caps_have("CapEff:\t000001ffffffffff\n", 24));
        assert!(!effective_caps_have("no such line", 0));
    }

    #[test]
    fn node_ips_are_documentation_addresses_and_distinct() {
        assert_eq!(node_ip(0), "192.0.2.10");
        assert_ne!(node_ip(1), node_ip(2));
    }
}
