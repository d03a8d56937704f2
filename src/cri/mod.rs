//! Sandbox truth from the container runtime (issue 25): the agent asks the runtime over the
//! CRI API which sandboxes it still has, so that a sandbox whose DEL was lost frees its IPs
//! in seconds, and one the runtime still runs is never released for lack of a DEL.
//! docs/agent.md, "Sandbox truth from the runtime"; docs/decisions/0020-cri-client.md.

pub mod client;
pub mod sandboxes;
