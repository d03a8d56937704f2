//! The garbage collector's pure core: the rule table, the index of the cluster it reads, the
//! sweep plan, both sides of the release handshake, and the plan of `ipwarden adopt`. The
//! controller's actors (src/actors/), the agent and the CLI feed it and carry its verdicts out.

pub mod adopt;
pub mod agents;
pub mod check;
pub mod claims;
pub mod events;
pub mod handshake;
pub mod index;
pub mod manual;
pub mod rules;
pub mod sweep;
