//! KubeVirt's own CRDs (VirtualMachine, VirtualMachineInstance,
//! VirtualMachineInstanceMigration), built from the pinned `kubevirt.io/kubevirt` Go module by
//! `e2e/cluster/build-kubevirt-crds.sh`, installed into a test cluster so tests create VMs,
//! VM instances and migrations exactly as the apiserver of a KubeVirt cluster accepts them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;

use crate::cluster::Cluster;
use crate::error::{Error, Result};
use crate::process::run_tool;
use crate::wait::{self, Probe};

/// The CRDs the build script prints, by name.
pub const CRD_NAMES: [&str; 3] = [
    "virtualmachines.kubevirt.io",
    "virtualmachineinstances.kubevirt.io",
    "virtualmachineinstancemigrations.kubevirt.io",
];

/// The CRD YAML of the pinned KubeVirt, built on first use and then returned at once from
/// the cache.
pub fn crds_yaml() -> Result<PathBuf> {
    crate::binaries::run_build_script(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("cluster/build-kubevirt-crds.sh"),
        "CRD file",
    )
}

/// Installs KubeVirt's CRDs into `cluster` (server-side apply with the cluster's kubectl: the
/// schemas are too big for client-side apply's annotation) and waits until each is
/// Established.
pub async fn install_crds(cluster: &Cluster, timeout: Duration) -> Result<()> {
    let file = crds_yaml()?;
    let args = [
        "apply".to_string(),
        "--server-side".to_string(),
        "--field-manager=ipwarden-e2e".to_string(),
        format!("--kubeconfig={}", cluster.kubeconfig().display()),
        "-f".to_string(),
        file.display().to_string(),
    ];
    run_tool(&cluster.kubectl(), &args, None).await?;
    let api: Api<CustomResourceDefinition> = Api::all(cluster.client());
    for name in CRD_NAMES {
        wait::until(&format!("CRD {name} Established"), timeout, || async {
            let crd = api.get_opt(name).await.map_err(Error::kube(format!("reading CRD {name}")))?;
            let established = crd
                .and_then(|c| c.status)
                .and_then(|s| s.conditions)
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Established" && c.status == "True"));
            Ok(if established { Probe::Done(()) } else { Probe::Pending("not Established".into()) })
        })
        .await?;
    }
    Ok(())
}
