//! The garbage collector's pure core: the rule table, the index of the cluster it reads, and
//! the sweep plan. The controller's actors (src/actors/) feed it and carry its verdicts out.

pub mod check;
pub mod claims;
pub mod index;
pub mod rules;
pub mod sweep;
