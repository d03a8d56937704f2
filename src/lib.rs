//! ipwarden: a Kubernetes IPAM whose heart is a StatefulSet-aware IP garbage collector.
//!
//! Layers, with arrows pointing one way: `crd` (types) <- pure logic <- I/O (agent, CNI
//! plugin, controller actors) <- `main.rs` (wiring).

pub mod actors;
pub mod agent;
pub mod block_store;
pub mod claim_writes;
pub mod cli;
pub mod cni;
pub mod crd;
pub mod cri;
pub mod gc;
pub mod hostlocal;
pub mod http;
pub mod ipam;
pub mod lease;
pub mod own_writes;
pub mod owners;
pub mod protocol;
pub mod retry;
