//! How the operator commands reach the cluster: kubectl's `--kubeconfig` and `--context`
//! flags (kubectl hands them, with everything after the plugin name, to `kubectl ipwarden`),
//! then `KUBECONFIG`, `~/.kube/config` and the in-cluster service account, as kubectl reads them.

use std::path::PathBuf;

use kube::Client;
use kube::config::{Config, KubeConfigOptions, Kubeconfig, KubeconfigError};

/// The connection flags every operator command takes, before or after its name.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ClusterArgs {
    /// The kubeconfig file [default: $KUBECONFIG, else ~/.kube/config, else the in-cluster
    /// service account].
    #[arg(long, global = true, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use [default: the kubeconfig's current context].
    #[arg(long, global = true, value_name = "NAME")]
    pub context: Option<String>,
}

/// Why no client could be built from the connection flags.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The kubeconfig could not be read or parsed.
    #[error("reading the kubeconfig {file}")]
    Read {
        /// Where it was read from.
        file: String,
        /// The reason.
        source: KubeconfigError,
    },
    /// `--context` names a context the kubeconfig does not have.
    #[error("context {context:?} is not in the kubeconfig {file} (its contexts: {known})")]
    UnknownContext {
        /// The context asked for.
        context: String,
        /// Where the kubeconfig was read from.
        file: String,
        /// The contexts it has.
        known: String,
    },
    /// The context's cluster or user could not be loaded.
    #[error("loading context {context} of the kubeconfig {file}")]
    Load {
        /// The context (or `current-context`).
        context: String,
        /// Where the kubeconfig was read from.
        file: String,
        /// The reason.
        source: KubeconfigError,
    },
    /// Neither a kubeconfig nor an in-cluster service account was found.
    #[error("finding a kubeconfig or an in-cluster service account")]
    Infer(#[from] kube::config::InferConfigError),
    /// The client could not be built from the configuration.
    #[error("building the Kubernetes client for {server}")]
    Client {
        /// The apiserver address.
        server: String,
        /// The reason.
        source: kube::Error,
    },
}

/// A client and the namespace kubectl would use with the same flags (the context's, else
/// `default`).
pub struct Connection {
    /// The client.
    pub client: Client,
    /// The context's namespace, or `default`.
    pub namespace: String,
}

/// Connects as kubectl would with `args`.
pub async fn connect(args: &ClusterArgs) -> Result<Connection, ConnectError> {
    let config = match (&args.kubeconfig, &args.context) {
        (None, None) => Config::infer().await?,
        (file, context) => {
            let (read, source) = match file {
                Some(path) => (Kubeconfig::read_from(path), path.display().to_string()),
                None => (Kubeconfig::read(), default_source()),
            };
            let kubeconfig =
                read.map_err(|source_error| ConnectError::Read { file: source.clone(), source: source_error })?;
            if let Some(context) = context.as_ref().filter(|c| !kubeconfig.contexts.iter().any(|n| n.name == **c)) {
                let known: Vec<&str> = kubeconfig.contexts.iter().map(|c| c.name.as_str()).collect();
                return Err(ConnectError::UnknownContext {
                    context: context.clone(),
                    file: source,
                    known: known.join(", "),
                });
            }
            let options = KubeConfigOptions { context: context.clone(), ..KubeConfigOptions::default() };
            Config::from_custom_kubeconfig(kubeconfig, &options).await.map_err(|e| ConnectError::Load {
                context: context.clone().unwrap_or_else(|| "current-context".into()),
                file: source,
                source: e,
            })?
        }
    };
    let namespace = config.default_namespace.clone();
    let server = config.cluster_url.to_string();
    let client = Client::try_from(config).map_err(|source| ConnectError::Client { server, source })?;
    Ok(Connection { client, namespace })
}

/// Where kube reads a kubeconfig from without `--kubeconfig`, for error messages.
fn default_source() -> String {
    match std::env::var("KUBECONFIG") {
        Ok(files) if !files.is_empty() => format!("KUBECONFIG={files}"),
        _ => "~/.kube/config".to_string(),
    }
}
