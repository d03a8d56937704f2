//! KubeVirt's own CRDs (VirtualMachine, VirtualMachineInstance,
//! VirtualMachineInstanceMigration), built from the pinned `kubevirt.io/kubevirt` Go module by
//! `e2e/cluster/build-kubevirt-crds.sh`, installed into a test cluster so tests create VMs,
//! VM instances and migrations exactly as the apiserver of a KubeVirt cluster accepts them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cluster::Cluster;
use crate::error::Result;

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

/// Installs KubeVirt's CRDs into `cluster` and waits until each is Established.
pub async fn install_crds(cluster: &Cluster, timeout: Duration) -> Result<()> {
    cluster.apply_crds(&crds_yaml()?, &CRD_NAMES, timeout).await
}
