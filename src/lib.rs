//! ipwarden: a Kubernetes IPAM whose heart is a StatefulSet-aware IP garbage collector.
//!
//! The crate is being built issue by issue (see `docs/`); today it pins the Kubernetes
//! API version shared with the end-to-end harness in `e2e/`.

/// The Kubernetes minor version ipwarden is built and tested against; it must match the
/// `k8s-openapi` feature in `Cargo.toml` and the control plane the e2e harness builds.
pub const KUBERNETES_VERSION: &str = "v1.37";

/// The pure allocation engine: pool layout and the choice of an IP within a block.
pub mod ipam;
