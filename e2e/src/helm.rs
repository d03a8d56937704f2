//! Helm, built from its Go module by `e2e/cluster/build-helm.sh`, run against the chart in
//! `charts/ipwarden` and, for installs, a test cluster.

use std::path::{Path, PathBuf};

use crate::binaries;
use crate::error::{Error, Result};
use crate::process::run_tool;

/// The repository's chart.
pub fn chart() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/ipwarden")
}

/// A helm binary, optionally bound to a cluster's kubeconfig.
#[derive(Clone, Debug)]
pub struct Helm {
    binary: PathBuf,
    kubeconfig: Option<PathBuf>,
}

impl Helm {
    /// Finds (or builds) the pinned helm.
    pub fn locate() -> Result<Self> {
        Ok(Self { binary: binaries::helm()?, kubeconfig: None })
    }

    /// Runs against the cluster of `kubeconfig`.
    pub fn for_cluster(mut self, kubeconfig: &Path) -> Self {
        self.kubeconfig = Some(kubeconfig.to_path_buf());
        self
    }

    /// Runs `helm args...` and returns its output.
    pub async fn run(&self, args: &[&str]) -> Result<String> {
        let mut full: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        if let Some(kubeconfig) = &self.kubeconfig {
            full.push(format!("--kubeconfig={}", kubeconfig.display()));
        }
        run_tool(&self.binary, &full, None).await
    }

    /// `helm template` of the chart as release `release` in `namespace`, with `--set`
    /// `values` and only the templates in `show_only` (all when empty); the rendered documents.
    pub async fn template(
        &self,
        release: &str,
        namespace: &str,
        values: &[&str],
        show_only: &[&str],
    ) -> Result<Vec<serde_json::Value>> {
        let chart = chart().display().to_string();
        let mut args = vec!["template", release, chart.as_str(), "--namespace", namespace];
        for value in values {
            args.extend(["--set", value]);
        }
        for template in show_only {
            args.extend(["--show-only", template]);
        }
        documents(&self.run(&args).await?)
    }
}

/// The objects of a multi-document YAML stream (empty documents dropped).
pub fn documents(yaml: &str) -> Result<Vec<serde_json::Value>> {
    let docs: Vec<serde_json::Value> = serde_saphyr::from_multiple(yaml)
        .map_err(|e| Error::Tool { command: "parsing helm's output".to_string(), reason: e.to_string() })?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}
