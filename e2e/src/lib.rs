//! A real Kubernetes control plane, built from its Go modules, plus simulated nodes, for
//! ipwarden's integration, e2e and chaos tests.
//!
//! [`Cluster::start`] builds (or reuses from the cache) etcd, kube-apiserver,
//! kube-controller-manager and kube-scheduler, starts them on loopback with their own
//! directory, PKI and free ports, and registers simulated nodes whose fake kubelet runs pods
//! by invoking a real CNI plugin binary exactly as a container runtime does. Nothing here
//! imitates the apiserver: every object goes through the real one.

pub mod accounts;
pub mod binaries;
pub mod burst;
pub mod churn;
pub mod cluster;
pub mod cni;
pub mod controlplane;
pub mod demo;
pub mod error;
pub mod exposition;
pub mod helm;
pub mod ipwarden;
pub mod kubelet;
pub mod kubevirt;
pub mod nodebench;
pub mod peers;
pub mod pki;
pub mod process;
pub mod procstat;
pub mod prometheus;
pub mod realnode;
pub mod scale;
pub mod storm;
pub mod up;
pub mod wait;

pub use cluster::{Cluster, ClusterOptions};
pub use cni::CniNetwork;
pub use error::Error;
pub use kubelet::{Faults, NodeHandle};
