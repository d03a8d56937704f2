//! The custom resources of group `ipwarden.io`, version `v1alpha1`: pools, the blocks that
//! hold allocation records, and the claims that pin a workload to its IPs.
//!
//! The CRD YAML under `crds/` is generated from these types (`ipwarden crd`); a test fails
//! when the committed YAML drifts from them.

mod block;
mod claim;
mod pool;

use kube::CustomResourceExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use block::{Allocation, HandshakeState, IPBlock, IPBlockSpec, MigrationTarget, ReleaseHandshake, Takeover};
pub use claim::{ClaimedInterface, ClaimedIp, IPClaim, IPClaimSpec, IPClaimStatus, WitnessedBinding};
pub use pool::{IPPool, IPPoolSpec, IPPoolStatus, IpRange, POOL_FINALIZER};

/// The API group of every ipwarden resource.
pub const GROUP: &str = "ipwarden.io";

/// Pod or namespace annotation naming the pool(s) to allocate from (comma-separated, one
/// per IP family); without it the default pool(s) are used.
pub const POOL_ANNOTATION: &str = "ipwarden.io/pool";

/// Pod annotation naming the pools of each interface (Multus attachments): a JSON map of
/// interface name to pool names, one per IP family, e.g. `{"net1": ["net1-v4"]}`. It wins
/// over the network's netconf `ipam.pools` and [`POOL_ANNOTATION`] for the interfaces it names.
pub const POOLS_ANNOTATION: &str = "ipwarden.io/pools";

/// The pod an allocation or claim belongs to.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodRef {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The pod's UID: a recreated pod with the same name has another one.
    pub uid: String,
}

/// The controller that owns a pod (from its controller ownerReference).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OwnerRef {
    /// The owner's kind, e.g. StatefulSet, ReplicaSet, Job, VirtualMachineInstance.
    pub kind: String,
    /// The owner's name.
    pub name: String,
}

/// Every CRD of ipwarden, in the order they are printed and applied.
pub fn all() -> Vec<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> {
    vec![IPPool::crd(), IPBlock::crd(), IPClaim::crd()]
}

/// The CRDs as one multi-document YAML stream, as `ipwarden crd` prints it and `crds/`
/// holds it.
pub fn yaml() -> Result<String, serde_saphyr::ser::Error> {
    let mut out = String::new();
    for crd in all() {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(&crd)?);
    }
    Ok(out)
}

/// Why the CRDs could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// The server-side apply of a CRD failed.
    #[error("applying CRD {name}: {source}")]
    Apply {
        /// The CRD's name.
        name: String,
        /// The apiserver's answer.
        source: kube::Error,
    },
    /// Watching for the CRD's Established condition failed.
    #[error("waiting for CRD {name} to be established: {source}")]
    Wait {
        /// The CRD's name.
        name: String,
        /// The watch error.
        source: kube::runtime::wait::Error,
    },
    /// The CRD did not become Established in time.
    #[error("CRD {name} was not established within {timeout:?}")]
    Timeout {
        /// The CRD's name.
        name: String,
        /// How long was waited.
        timeout: std::time::Duration,
    },
}

/// Applies every CRD with server-side apply and waits (bounded) until the apiserver serves
/// them; used by `--install-crds` and by tests.
pub async fn install(client: &kube::Client, timeout: std::time::Duration) -> Result<(), InstallError> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    use kube::api::{Api, Patch, PatchParams};
    use kube::runtime::wait::{await_condition, conditions};

    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in all() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        api.patch(&name, &PatchParams::apply("ipwarden").force(), &Patch::Apply(&crd))
            .await
            .map_err(|source| InstallError::Apply { name: name.clone(), source })?;
        let established = await_condition(api.clone(), &name, conditions::is_crd_established());
        match tokio::time::timeout(timeout, established).await {
            Ok(Ok(_)) => {}
            Ok(Err(source)) => return Err(InstallError::Wait { name, source }),
            Err(_) => return Err(InstallError::Timeout { name, timeout }),
        }
    }
    Ok(())
}

#[cfg(test)]
mod test {
    #[test]
    fn committed_crd_yaml_matches_the_rust_types() {
        let generated = super::yaml().expect("CRDs render as YAML");
        // crds/ for `kubectl apply`, and the chart's copy that `helm install` applies.
        for file in ["crds/ipwarden.io.yaml", "charts/ipwarden/crds/ipwarden.io.yaml"] {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
            let committed = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                committed == generated,
                "{} is out of date: regenerate it with `cargo run -- crd > {file}`",
                path.display()
            );
        }
    }
}
