//! The configuration files of a real node's containerd and kubelet, as plain text from plain
//! data: what this machine needs of them is written down here, once (docs/testing.md, "Real
//! nodes").

use std::path::{Path, PathBuf};

/// The image every sandbox runs, imported from the archive `e2e/cluster/node/images.sh` makes
/// (there is no registry to pull from); pinned in containerd so its image GC keeps it.
pub const PAUSE_IMAGE: &str = "localhost/ipwarden-e2e/pause:1";

/// The workload image of real-node pods (busybox: `sh`, `sleep`, `ip`), imported likewise; pods
/// use it with `imagePullPolicy: Never`.
pub const BUSYBOX_IMAGE: &str = "localhost/ipwarden-e2e/busybox:1";

/// The container runtime a real node runs: containerd (with its runc shim) or CRI-O (with
/// conmon), both with Debian's runc (docs/testing.md, "Real nodes").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Runtime {
    /// containerd 2, the default of most distributions.
    #[default]
    Containerd,
    /// CRI-O, OpenShift's runtime, the one that calls CNI GC (at its start).
    Crio,
}

impl Runtime {
    /// The runtime's name, as its process and log are named.
    pub fn name(self) -> &'static str {
        match self {
            Self::Containerd => "containerd",
            Self::Crio => "crio",
        }
    }
}

/// The path at which each real node's kubelet and runtime see the node's own directory (bound
/// there in their mount namespace): one host path naming a different directory on each node, as
/// `/etc/cni/net.d` does on real machines, so that one DaemonSet's hostPaths serve every node
/// ([`NodePaths::seen_by_node`]).
pub const NODE_VIEW: &str = "/run/ipwarden-e2e-node";

/// Where one real node keeps its state, all under its own directory.
#[derive(Clone, Debug)]
pub struct NodePaths {
    /// The node's directory.
    pub dir: PathBuf,
    /// The runtime the node runs, whose paths these are.
    pub runtime: Runtime,
}

impl NodePaths {
    /// `path` (under the node's directory) as the node's kubelet, runtime and their containers
    /// see it, under [`NODE_VIEW`]; a path outside the directory is returned as it is.
    pub fn seen_by_node(&self, path: &Path) -> PathBuf {
        match path.strip_prefix(&self.dir) {
            Ok(rest) => Path::new(NODE_VIEW).join(rest),
            Err(_) => path.to_path_buf(),
        }
    }

    /// The runtime's CRI socket, which kubelet and the agent dial.
    pub fn runtime_socket(&self) -> PathBuf {
        match self.runtime {
            Runtime::Containerd => self.containerd_socket(),
            Runtime::Crio => self.crio_dir().join("crio.sock"),
        }
    }

    /// A text on the command line of every process of the node's runtime: containerd and its
    /// shims name its socket, CRI-O and its conmons paths in the CRI-O directory (an agent
    /// asking the runtime over CRI names it too).
    pub fn runtime_marker(&self) -> String {
        match self.runtime {
            Runtime::Containerd => self.containerd_socket().display().to_string(),
            Runtime::Crio => format!("{}/", self.crio_dir().display()),
        }
    }

    /// The runtime's log file.
    pub fn runtime_log(&self) -> PathBuf {
        self.dir.join(format!("{}.log", self.runtime.name()))
    }

    /// The directory of everything the runtime keeps (configuration, socket, storage, state).
    pub fn runtime_dir(&self) -> PathBuf {
        self.dir.join(self.runtime.name())
    }

    /// What [`super::RealNode::power_off`] wipes. containerd: its state and its root
    /// (sandboxes, containers, images; the images are imported again at boot). CRI-O: what a
    /// reboot loses, its run directories (on tmpfs on a real machine: runroot, the version
    /// file, exit files, network namespaces, runc's state), so its restart is a real one
    /// after a reboot; its storage and the clean-shutdown marker stay, as on disk.
    pub fn wiped_at_power_off(&self) -> Vec<PathBuf> {
        match self.runtime {
            Runtime::Containerd => vec![self.containerd_state(), self.containerd_root()],
            Runtime::Crio => ["runroot", "run", "ns", "runc"].map(|d| self.crio_dir().join(d)).to_vec(),
        }
    }

    /// containerd's CRI and API socket.
    pub fn containerd_socket(&self) -> PathBuf {
        self.dir.join("containerd/containerd.sock")
    }

    /// containerd's persistent root (images, snapshots, sandbox metadata).
    pub fn containerd_root(&self) -> PathBuf {
        self.dir.join("containerd/root")
    }

    /// containerd's state (sockets, running tasks, and the pods' network namespaces).
    pub fn containerd_state(&self) -> PathBuf {
        self.dir.join("containerd/state")
    }

    /// Where the runtime mounts the pods' network namespaces: containerd's CRI plugin under its
    /// state (`netns_mounts_under_state_dir`), CRI-O's pinns under `namespaces_dir`.
    pub fn netns_dir(&self) -> PathBuf {
        match self.runtime {
            Runtime::Containerd => self.containerd_state().join("io.containerd.grpc.v1.cri/netns"),
            Runtime::Crio => self.crio_dir().join("ns/netns"),
        }
    }

    /// CRI-O's directory: its configuration, socket, storage and state.
    pub fn crio_dir(&self) -> PathBuf {
        self.dir.join(Runtime::Crio.name())
    }

    /// CRI-O's configuration file.
    pub fn crio_config(&self) -> PathBuf {
        self.crio_dir().join("crio.conf")
    }

    /// CRI-O's drop-in configuration directory, empty (so nothing of the host's
    /// `/etc/crio/crio.conf.d` applies).
    pub fn crio_config_dir(&self) -> PathBuf {
        self.crio_dir().join("crio.conf.d")
    }

    /// The image signature policy of CRI-O and of the image copier: accept the local images.
    pub fn crio_policy(&self) -> PathBuf {
        self.crio_dir().join("policy.json")
    }

    /// The node's own libcni result cache, bound over `/var/lib/cni` in CRI-O's mount
    /// namespace ([`super::RealNode`]): CRI-O's start-up CNI GC deletes every cached attachment
    /// of its network that it did not restore, so with the host-wide cache it would delete
    /// the other real nodes' pods (containernetworking/cni issue 1086).
    pub fn crio_cni_cache(&self) -> PathBuf {
        self.crio_dir().join("cni-cache")
    }

    /// containerd's configuration file.
    pub fn containerd_config(&self) -> PathBuf {
        self.dir.join("containerd/config.toml")
    }

    /// The CNI configuration directory containerd reads (the chart's conflist goes there).
    pub fn cni_conf_dir(&self) -> PathBuf {
        self.dir.join("cni/net.d")
    }

    /// The CNI plugin directory containerd searches (ptp, portmap, loopback, ipwarden-cni).
    pub fn cni_bin_dir(&self) -> PathBuf {
        self.dir.join("cni/bin")
    }

    /// kubelet's root directory (`--root-dir`).
    pub fn kubelet_root(&self) -> PathBuf {
        self.dir.join("kubelet")
    }

    /// kubelet's configuration file.
    pub fn kubelet_config(&self) -> PathBuf {
        self.dir.join("kubelet-config.yaml")
    }

    /// The directory kubelet reads static pod manifests from.
    pub fn static_pods(&self) -> PathBuf {
        self.dir.join("manifests")
    }

    /// The agent's socket, which the conflist names.
    pub fn agent_socket(&self) -> PathBuf {
        self.dir.join("agent.sock")
    }
}

/// containerd 2.4's configuration (version 4, as `containerd config default` prints it) for a
/// node at `paths`, running runc from
/// `runc`. What this machine needs: `restrict_oom_score_adj` (root here lacks
/// CAP_SYS_RESOURCE, without it every sandbox fails in runc with "can't get final child's PID
/// from pipe"), the sandbox image pinned and never pulled, network namespaces under the node's
/// own state directory instead of the host-wide /var/run/netns, no streaming server beyond
/// loopback, and nothing host-wide of containerd's defaults (NRI's socket, /opt/containerd,
/// /etc/containerd imports, runc's state in /run/containerd/runc). Still host-wide: libcni's
/// result cache in /var/lib/cni/results (the node's teardown removes its files) and the shims'
/// sockets in /run/containerd/s, which containerd does not let move.
pub fn containerd_toml(paths: &NodePaths, runc: &Path) -> String {
    let q = |p: PathBuf| toml_string(&p.display().to_string());
    format!(
        r#"version = 4
root = {root}
state = {state}
imports = []

[plugins.'io.containerd.server.v1.grpc']
  address = {socket}

[plugins.'io.containerd.server.v1.ttrpc']
  address = {ttrpc}

[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.internal.v1.opt']
  path = {opt}

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = {pause}

[plugins.'io.containerd.cri.v1.runtime']
  enable_selinux = false
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = [{cni_bin}]
    conf_dir = {cni_conf}
    max_conf_num = 1
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = {runc}
        Root = {runc_root}
        SystemdCgroup = false

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'
"#,
        root = q(paths.containerd_root()),
        state = q(paths.containerd_state()),
        socket = q(paths.containerd_socket()),
        ttrpc = q(paths.dir.join("containerd/containerd.sock.ttrpc")),
        opt = q(paths.dir.join("containerd/opt")),
        pause = toml_string(PAUSE_IMAGE),
        cni_bin = q(paths.cni_bin_dir()),
        cni_conf = q(paths.cni_conf_dir()),
        runc = toml_string(&runc.display().to_string()),
        runc_root = q(paths.dir.join("containerd/runc")),
    )
}

/// The signature policy of a CRI-O node ([`NodePaths::crio_policy`]): its images are made on
/// this machine and never pulled.
pub const CRIO_POLICY: &str = r#"{"default": [{"type": "insecureAcceptAnything"}]}"#;

/// CRI-O 1.36's configuration (the keys `crio config` prints) for a node at `paths`, with
/// `pinns` from the CRI-O build, conmon and runc from Debian. What this machine needs: the
/// cgroupfs driver (no systemd), conmon in the pod's cgroup, runc as the one runtime, NRI off,
/// the local pause image pinned (`pause_command` empty: the image's own command), and its
/// storage, state, logs and network namespaces under the node's directory instead of
/// /var/lib/containers/storage, /run/containers, /var/run/crio, /var/log/crio and
/// /var/run/netns (containers/image's blob-info cache stays host-wide, in
/// /var/lib/containers/cache, for CRI-O and the image copier alike). Pod events stay off, as
/// CRI-O ships them (`enable_pod_events = false`: its event stream ends at once).
pub fn crio_conf(paths: &NodePaths, pinns: &Path, conmon: &Path, runc: &Path) -> String {
    let crio = paths.crio_dir();
    let q = |p: PathBuf| toml_string(&p.display().to_string());
    let sub = |d: &str| q(crio.join(d));
    format!(
        r#"[crio]
root = {root}
runroot = {runroot}
storage_driver = "overlay"
log_dir = {log_dir}
version_file = {version}
version_file_persist = {version_persist}
clean_shutdown_file = {clean_shutdown}

[crio.api]
listen = {socket}
stream_address = "127.0.0.1"
stream_port = "0"

[crio.runtime]
default_runtime = "runc"
cgroup_manager = "cgroupfs"
container_exits_dir = {exits}
container_attach_socket_dir = {attach}
namespaces_dir = {namespaces}
pinns_path = {pinns}
hooks_dir = [{hooks}]
enable_pod_events = false

[crio.runtime.runtimes.runc]
runtime_path = {runc}
runtime_type = "oci"
runtime_root = {runc_root}
monitor_path = {conmon}
monitor_cgroup = "pod"

[crio.image]
pause_image = {pause}
pause_command = ""
pinned_images = [{pause}]
signature_policy = {policy}

[crio.network]
network_dir = {cni_conf}
plugin_dirs = [{cni_bin}]

[crio.nri]
enable_nri = false
"#,
        root = sub("root"),
        runroot = sub("runroot"),
        log_dir = sub("pods"),
        version = sub("run/version"),
        version_persist = sub("lib/version"),
        clean_shutdown = sub("lib/clean.shutdown"),
        socket = q(paths.runtime_socket()),
        exits = sub("run/exits"),
        attach = sub("run"),
        namespaces = sub("ns"),
        pinns = toml_string(&pinns.display().to_string()),
        hooks = sub("hooks.d"),
        runc = toml_string(&runc.display().to_string()),
        runc_root = sub("runc"),
        conmon = toml_string(&conmon.display().to_string()),
        pause = toml_string(PAUSE_IMAGE),
        policy = q(paths.crio_policy()),
        cni_conf = q(paths.cni_conf_dir()),
        cni_bin = q(paths.cni_bin_dir()),
    )
}

/// What a kubelet's configuration depends on besides its paths.
#[derive(Clone, Debug)]
pub struct KubeletSettings {
    /// The port of kubelet's API, on 127.0.0.1.
    pub port: u16,
    /// The port of kubelet's health endpoint, on 127.0.0.1.
    pub healthz_port: u16,
    /// The cgroup under which kubelet puts its pods (`cgroupRoot`): one per node, so several
    /// real nodes on one machine do not share `kubepods`.
    pub cgroup_root: String,
    /// The cluster CA, which kubelet trusts for client certificates.
    pub client_ca: PathBuf,
}

/// kubelet's KubeletConfiguration (JSON, which kubelet reads as YAML). What this machine
/// needs: cgroup v1 allowed (`failCgroupV1: false`) with the cgroupfs driver; servers on
/// loopback only; no image GC (the images cannot be pulled again) and no eviction for disk
/// space (the node's filesystem is the test machine's, shared with every build on it: a CI run
/// saw its kubelet evict the chart's controller pods when that disk fell under 1 % free, `0%`
/// switches a threshold off); static pods read every second.
pub fn kubelet_config(paths: &NodePaths, settings: &KubeletSettings) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": "127.0.0.1",
        "port": settings.port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": settings.healthz_port,
        "authentication": {
            "anonymous": {"enabled": false},
            "webhook": {"enabled": false},
            "x509": {"clientCAFile": settings.client_ca},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": settings.cgroup_root,
        "failCgroupV1": false,
        "failSwapOn": false,
        "containerRuntimeEndpoint": format!("unix://{}", paths.runtime_socket().display()),
        "staticPodPath": paths.static_pods(),
        "volumePluginDir": paths.kubelet_root().join("volume-plugins"),
        "fileCheckFrequency": "1s",
        "podLogsDir": paths.dir.join("pod-logs"),
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "mergeDefaultEvictionSettings": false,
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "0%",
            "nodefs.inodesFree": "0%",
            "imagefs.available": "0%",
            "imagefs.inodesFree": "0%",
        },
        "resolvConf": "",
        "maxPods": 110,
        "serializeImagePulls": false,
    })
}

fn toml_string(text: &str) -> String {
    let escaped = text.replace('\\', "\\\\").replace('"', "\\\"");
    format!("\"{escaped}\"")
}

#[cfg(test)]
mod test {
    use super::*;

    fn paths() -> NodePaths {
        NodePaths { dir: PathBuf::from("/tmp/run/real-node-0"), runtime: Runtime::Containerd }
    }

    #[test]
    fn crio_keeps_everything_under_the_node_directory_with_cgroupfs_and_conmon_in_the_pod() {
        let paths = NodePaths { runtime: Runtime::Crio, ..paths() };
        let text = crio_conf(&paths, Path::new("/b/pinns"), Path::new("/usr/bin/conmon"), Path::new("/usr/sbin/runc"));
        for line in [
            "root = \"/tmp/run/real-node-0/crio/root\"",
            "runroot = \"/tmp/run/real-node-0/crio/runroot\"",
            "listen = \"/tmp/run/real-node-0/crio/crio.sock\"",
            "namespaces_dir = \"/tmp/run/real-node-0/crio/ns\"",
            "cgroup_manager = \"cgroupfs\"",
            "monitor_cgroup = \"pod\"",
            "network_dir = \"/tmp/run/real-node-0/cni/net.d\"",
            "pause_image = \"localhost/ipwarden-e2e/pause:1\"",
            "enable_nri = false",
        ] {
            assert!(text.contains(line), "{line} in:\n{text}");
        }
        assert_eq!(paths.netns_dir(), Path::new("/tmp/run/real-node-0/crio/ns/netns"));
        assert_eq!(paths.runtime_log(), Path::new("/tmp/run/real-node-0/crio.log"));
        let settings =
            KubeletSettings { port: 1, healthz_port: 2, cgroup_root: "/e2e-0".into(), client_ca: "/ca.crt".into() };
        assert_eq!(
            kubelet_config(&paths, &settings)["containerRuntimeEndpoint"],
            "unix:///tmp/run/real-node-0/crio/crio.sock"
        );
    }

    #[test]
    fn containerd_keeps_everything_under_the_node_directory_and_restricts_oom_score_adj() {
        let text = containerd_toml(&paths(), Path::new("/usr/sbin/runc"));
        for line in [
            "root = \"/tmp/run/real-node-0/containerd/root\"",
            "address = \"/tmp/run/real-node-0/containerd/containerd.sock\"",
            "restrict_oom_score_adj = true",
            "netns_mounts_under_state_dir = true",
            "conf_dir = \"/tmp/run/real-node-0/cni/net.d\"",
            "sandbox = \"localhost/ipwarden-e2e/pause:1\"",
            "BinaryName = \"/usr/sbin/runc\"",
        ] {
            assert!(text.contains(line), "{line} in:\n{text}");
        }
    }

    #[test]
    fn kubelet_serves_on_loopback_with_cgroup_v1_allowed() {
        let settings =
            KubeletSettings { port: 1, healthz_port: 2, cgroup_root: "/e2e-0".into(), client_ca: "/ca.crt".into() };
        let config = kubelet_config(&paths(), &settings);
        assert_eq!(config["address"], "127.0.0.1");
        assert_eq!(config["failCgroupV1"], false);
        assert_eq!(config["cgroupRoot"], "/e2e-0");
        assert_eq!(config["containerRuntimeEndpoint"], "unix:///tmp/run/real-node-0/containerd/containerd.sock");
    }

    #[test]
    fn kubelet_never_evicts_for_the_shared_disk() {
        let settings =
            KubeletSettings { port: 1, healthz_port: 2, cgroup_root: "/e2e-0".into(), client_ca: "/ca.crt".into() };
        let config = kubelet_config(&paths(), &settings);
        assert_eq!(config["mergeDefaultEvictionSettings"], false);
        for signal in ["nodefs.available", "nodefs.inodesFree", "imagefs.available", "imagefs.inodesFree"] {
            assert_eq!(config["evictionHard"][signal], "0%", "{signal} is off");
        }
    }

    #[test]
    fn the_node_sees_its_directory_at_one_path_shared_by_every_node() {
        let cni = paths().cni_conf_dir();
        assert_eq!(paths().seen_by_node(&cni), Path::new("/run/ipwarden-e2e-node/cni/net.d"));
        let other = NodePaths { dir: PathBuf::from("/tmp/run/real-node-1"), ..paths() };
        assert_eq!(other.seen_by_node(&other.cni_conf_dir()), paths().seen_by_node(&cni));
        assert_eq!(paths().seen_by_node(Path::new("/usr/sbin/runc")), Path::new("/usr/sbin/runc"));
    }

    #[test]
    fn toml_strings_are_quoted_and_escaped() {
        assert_eq!(toml_string(r#"a"b\c"#), r#""a\"b\\c""#);
    }
}
