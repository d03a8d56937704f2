//! The garbage collector's pure core: the rule table, the index of the cluster it reads, the
//! sweep plan and both sides of the release handshake. The controller's actors (src/actors/)
//! and the agent feed it and carry its verdicts out.

pub mod agents;
pub mod check;
pub mod claims;
pub mod handshake;
pub mod index;
pub mod manual;
pub mod rules;
pub mod sweep;
