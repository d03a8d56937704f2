//! The harness's one error type: every variant names what failed and where to look.

use std::path::PathBuf;
use std::time::Duration;

/// Why the harness could not build, start, drive or stop a cluster.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A build script (control plane, Helm) failed or printed nothing.
    #[error("building with {script} failed: {reason}")]
    Build {
        /// The script that was run.
        script: PathBuf,
        /// Its exit status and the end of its output.
        reason: String,
    },
    /// A binary the harness needs is not where it was looked for.
    #[error("{what} not found at {path}; {hint}")]
    MissingBinary {
        /// What was looked for.
        what: String,
        /// Where.
        path: PathBuf,
        /// How to get it.
        hint: String,
    },
    /// A component process could not be spawned.
    #[error("starting {component} from {binary} failed: {source}")]
    Spawn {
        /// The component's name (etcd, kube-apiserver, ...).
        component: String,
        /// The binary that was executed.
        binary: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A component process exited while it should have been running.
    #[error("{component} exited ({status}); its log is {log}")]
    Exited {
        /// The component's name.
        component: String,
        /// How it exited.
        status: String,
        /// Its log file.
        log: PathBuf,
    },
    /// A component never reported ready within its bound.
    #[error("{component} did not become ready within {timeout:?} (last answer: {last}); its log is {log}")]
    NotReady {
        /// The component's name.
        component: String,
        /// How long the harness waited.
        timeout: Duration,
        /// The last probe answer or error.
        last: String,
        /// Its log file.
        log: PathBuf,
    },
    /// A bounded wait on a condition ran out.
    #[error("timed out after {timeout:?} waiting for {what} (last seen: {last})")]
    Timeout {
        /// The condition waited on.
        what: String,
        /// The bound.
        timeout: Duration,
        /// The last observation, to tell how far it got.
        last: String,
    },
    /// A file-system operation failed.
    #[error("{what} ({path}): {source}")]
    Io {
        /// The operation.
        what: String,
        /// The path it was applied to.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A Kubernetes API call failed.
    #[error("{what}: {source}")]
    Kube {
        /// The call and its object.
        what: String,
        /// The client's error.
        source: kube::Error,
    },
    /// The generated kubeconfig could not be loaded into a client.
    #[error("loading kubeconfig {path}: {reason}")]
    Kubeconfig {
        /// The kubeconfig file.
        path: PathBuf,
        /// The client's complaint.
        reason: String,
    },
    /// Certificate or key generation failed.
    #[error("generating {what}: {source}")]
    Pki {
        /// Which certificate or key.
        what: String,
        /// The generator's error.
        source: rcgen::Error,
    },
    /// A CNI plugin invocation failed or returned something unusable.
    #[error("CNI {command} of container {container_id} with {plugin} failed: {reason}")]
    Cni {
        /// ADD, DEL, CHECK, GC, ...
        command: String,
        /// The sandbox's container ID.
        container_id: String,
        /// The plugin binary.
        plugin: PathBuf,
        /// Exit status, error object or parse failure.
        reason: String,
    },
    /// A `/metrics` endpoint returned text that is not Prometheus or OpenMetrics exposition.
    #[error("reading the metrics of {what}: {source}")]
    Scrape {
        /// Whose metrics.
        what: String,
        /// The line that could not be read.
        source: crate::exposition::BadLine,
    },
    /// The churn benchmark was asked for something it cannot do.
    #[error("the churn benchmark cannot run: {0}")]
    Churn(String),
    /// The scale benchmark was asked for something it cannot do, or its cluster did not
    /// reach a state it waits for.
    #[error("the scale benchmark: {0}")]
    Scale(String),
    /// An external tool (helm, kubectl, promtool) failed.
    #[error("{command} failed: {reason}")]
    Tool {
        /// The command line, shortened to the program and its first arguments.
        command: String,
        /// Its exit status and error output.
        reason: String,
    },
    /// Prometheus answered a query with an error or something unexpected.
    #[error("Prometheus query {query}: {reason}")]
    Prometheus {
        /// The PromQL expression or API path.
        query: String,
        /// What went wrong.
        reason: String,
    },
    /// No free loopback port could be reserved.
    #[error("reserving a free loopback port: {0}")]
    Port(std::io::Error),
}

/// The harness's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps a kube error with what the harness was doing.
    pub fn kube(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let what = what.into();
        move |source| Error::Kube { what, source }
    }

    /// Wraps an I/O error with the operation and the path.
    pub fn io(what: impl Into<String>, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let (what, path) = (what.into(), path.into());
        move |source| Error::Io { what, path, source }
    }
}
