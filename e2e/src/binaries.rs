//! Where the harness finds its binaries: the control plane and Helm built from Go modules by
//! `e2e/cluster/build-controlplane.sh` and `build-helm.sh` (cached outside the repo), CNI
//! plugins, and Debian's Prometheus.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Error, Result};

/// Environment variable naming a directory that already holds the control-plane binaries
/// (skips the build script, e.g. when a human points the harness at their own build).
pub const BIN_DIR_ENV: &str = "IPWARDEN_K8S_BIN_DIR";

/// Environment variable naming a helm binary to use instead of building the pinned one.
pub const HELM_ENV: &str = "IPWARDEN_HELM";

/// Environment variable naming the directory holding `prometheus` and `promtool` (default:
/// where Debian's prometheus package installs them).
pub const PROMETHEUS_DIR_ENV: &str = "IPWARDEN_PROMETHEUS_DIR";

/// Environment variable naming the directory of the standard CNI plugins (host-local, ...).
pub const CNI_PLUGINS_ENV: &str = "IPWARDEN_CNI_PLUGINS_DIR";

/// Directories where distributions install the standard CNI plugins: Debian's
/// containernetworking-plugins package first, then the upstream convention.
const CNI_PLUGIN_DIRS: [&str; 2] = ["/usr/lib/cni", "/opt/cni/bin"];

/// The control-plane binaries of one pinned Kubernetes release.
#[derive(Clone, Debug)]
pub struct ControlPlaneBinaries {
    /// The directory holding etcd, kube-apiserver, kube-controller-manager, kube-scheduler
    /// and kubectl.
    pub dir: PathBuf,
}

impl ControlPlaneBinaries {
    /// Finds the binaries: from [`BIN_DIR_ENV`] when set, otherwise by running the build
    /// script, which returns at once when the pinned build is already cached.
    pub fn locate() -> Result<Self> {
        let dir = match std::env::var_os(BIN_DIR_ENV) {
            Some(dir) => PathBuf::from(dir),
            None => build()?,
        };
        let found = Self { dir };
        for name in ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"] {
            let path = found.path(name);
            if !path.is_file() {
                return Err(Error::MissingBinary {
                    what: name.to_string(),
                    path,
                    hint: format!("run e2e/cluster/build-controlplane.sh or unset {BIN_DIR_ENV}"),
                });
            }
        }
        Ok(found)
    }

    /// The path of one of the binaries.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// The build script, found relative to this crate so tests work from any directory.
pub fn build_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/build-controlplane.sh")
}

fn build() -> Result<PathBuf> {
    run_build_script(&build_script(), "binary directory")
}

/// The helm binary: [`HELM_ENV`] when set, otherwise the pinned build of
/// `e2e/cluster/build-helm.sh` (built on first use, then returned at once from the cache).
pub fn helm() -> Result<PathBuf> {
    let path = match std::env::var_os(HELM_ENV) {
        Some(path) => PathBuf::from(path),
        None => run_build_script(&Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/build-helm.sh"), "helm path")?,
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::MissingBinary {
            what: "helm".to_string(),
            path,
            hint: format!("run e2e/cluster/build-helm.sh or unset {HELM_ENV}"),
        })
    }
}

/// A binary of Debian's prometheus package (`prometheus` or `promtool`).
pub fn prometheus_tool(name: &str) -> Result<PathBuf> {
    let dir = std::env::var_os(PROMETHEUS_DIR_ENV).map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/usr/bin"));
    let path = dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::MissingBinary {
            what: name.to_string(),
            path,
            hint: format!(
                "install Debian's prometheus package (e2e/cluster/install-deps.sh) or set {PROMETHEUS_DIR_ENV}"
            ),
        })
    }
}

/// Runs a build script and returns the last line it printed (what it built), failing with
/// the script's name when it fails or prints nothing.
pub(crate) fn run_build_script(script: &Path, what: &str) -> Result<PathBuf> {
    let output = Command::new("bash")
        .arg(script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| Error::Build { script: script.to_path_buf(), reason: e.to_string() })?;
    if !output.status.success() {
        return Err(Error::Build {
            script: script.to_path_buf(),
            reason: format!("{} (its output is above)", output.status),
        });
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    match stdout.lines().last().map(str::trim) {
        Some(line) if !line.is_empty() => Ok(PathBuf::from(line)),
        _ => Err(Error::Build { script: script.to_path_buf(), reason: format!("it printed no {what}") }),
    }
}

/// The directory holding the standard CNI plugins, from [`CNI_PLUGINS_ENV`] or the usual
/// install locations; the error says how to install them.
pub fn standard_cni_plugins() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os(CNI_PLUGINS_ENV) {
        return Ok(PathBuf::from(dir));
    }
    CNI_PLUGIN_DIRS.iter().map(PathBuf::from).find(|dir| dir.join("host-local").is_file()).ok_or_else(|| {
        Error::MissingBinary {
            what: "the host-local CNI plugin".to_string(),
            path: PathBuf::from(CNI_PLUGIN_DIRS[0]),
            hint: format!(
                "install Debian's containernetworking-plugins (e2e/cluster/install-deps.sh) or set {CNI_PLUGINS_ENV}"
            ),
        }
    })
}
