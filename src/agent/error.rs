//! The agent's failures, typed: each flow returns [`Error`], and only the socket server
//! turns one into the CNI wire error (`server::to_cni`). The ADD metric's label comes from
//! the variant ([`Error::label`]), never from a message's text.

use std::collections::BTreeSet;

use super::checkpoint::CheckpointError;
use crate::ipam::fixed::{FixedError, Refusal};
use crate::ipam::pools::{ForeignBlock, SelectError};

/// Why a CNI call, the start-up recovery or a release-mark answer failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// ADD without the pod's namespace and name in `CNI_ARGS`.
    #[error("ADD needs the pod: CNI_ARGS must carry K8S_POD_NAMESPACE and K8S_POD_NAME")]
    NoPodInRequest,
    /// The pod of an ADD is not (yet) in the apiserver.
    #[error("pod {pod} does not exist (yet)")]
    PodMissing {
        /// `namespace/name`.
        pod: String,
    },
    /// Releasing the IPs of an older sandbox of the pod, whose DEL never came, failed before
    /// the ADD of its new sandbox; the runtime retries the ADD.
    #[error("releasing the IPs of an earlier sandbox of pod {pod} (its DEL never came) failed: {source}")]
    Superseded {
        /// `namespace/name`.
        pod: String,
        /// What failed.
        source: Box<Error>,
    },
    /// The pod was recreated since the runtime made the sandbox.
    #[error("pod {pod} now has uid {uid}, the runtime asked for {expected}: the sandbox is stale")]
    StaleSandbox {
        /// `namespace/name`.
        pod: String,
        /// The pod's UID now.
        uid: String,
        /// The UID the runtime asked for.
        expected: String,
    },
    /// No pool may serve the pod's interface.
    #[error("no pool for pod {pod} interface {interface}: {cause}")]
    NoPoolFits {
        /// `namespace/name`.
        pod: String,
        /// The interface being added (`CNI_IFNAME`).
        interface: String,
        /// Why each pool was refused.
        #[source]
        cause: SelectError,
    },
    /// Every IP of the chosen pool is allocated.
    #[error("pool {pool} is exhausted: every IP is allocated{}", note(.withheld_gateway))]
    PoolExhausted {
        /// The pool.
        pool: String,
        /// Why the pool holds one IP fewer than its ranges say, when it does
        /// ([`crate::ipam::pools::gateway_withheld_from_ranges`]).
        withheld_gateway: Option<String>,
    },
    /// The chosen pool's free IPs are all cooling down after release.
    #[error(
        "pool {pool} has no free IP now: {cooling} released IPs are cooling down before reuse; the first is free at {next_free}{}",
        note(.withheld_gateway)
    )]
    Cooling {
        /// The pool.
        pool: String,
        /// How many free IPs are cooling down.
        cooling: usize,
        /// When the first of them is free.
        next_free: String,
        /// As [`Error::PoolExhausted`]'s.
        withheld_gateway: Option<String>,
    },
    /// A hand-edited IPClaim names a block that does not hold its IP's record.
    #[error("IPClaim {claim} of pod {pod} is refused: {cause}; fix or delete the claim")]
    InvalidClaim {
        /// `namespace/name` of the claim.
        claim: String,
        /// The pod's name.
        pod: String,
        /// What the claim names wrongly.
        #[source]
        cause: ForeignBlock,
    },
    /// A recreated sticky pod's IP is still attached to a sandbox elsewhere; the ADD waits
    /// for that sandbox's node to let go of it (docs/gc-rules.md, "Sticky takeover").
    #[error(
        "awaiting a sticky takeover: sticky IP {ip} of pod {pod} is still {} pod {holder} (uid {holder_uid}) on node {node}; it is taken over once that node's agent (or the controller, for a node that cannot answer) lets go of it",
        held_by(.container_id)
    )]
    AwaitingTakeover {
        /// The sticky IP.
        ip: String,
        /// `namespace/name` of the pod waiting for it.
        pod: String,
        /// The holder's sandbox.
        container_id: String,
        /// `namespace/name` of the holder's pod.
        holder: String,
        /// The holder's pod UID.
        holder_uid: String,
        /// The holder's node.
        node: String,
    },
    /// A KubeVirt VM's source sandbox left before its VM instance recorded the end of the
    /// live migration to the target attached to its record: the DEL fails, and the runtime
    /// retries it, until KubeVirt says whether the target has the VM.
    #[error("releasing sandbox {container_id} of VM {vm} waits for its live migration's end: {why}; retried")]
    HandoverPending {
        /// The source sandbox.
        container_id: String,
        /// `namespace/name` of the VM instance.
        vm: String,
        /// What the VM instance says.
        why: String,
    },
    /// The pod's fixed IPs cannot be had (`ipam::fixed`): no fallback to another IP.
    #[error("fixed IP for pod {pod} refused: {cause}")]
    FixedIp {
        /// `namespace/name`.
        pod: String,
        /// Why.
        #[source]
        cause: FixedError,
    },
    /// An apiserver call failed.
    #[error("{what}: {source}")]
    Api {
        /// What was being read or written, naming the object.
        what: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// A compare-and-swap of an IPBlock or IPClaim failed (conflicts past the retry budget,
    /// the read, or the write).
    #[error(transparent)]
    Write(#[from] crate::block_store::CasError),
    /// The node-local checkpoint could not be read or written.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// CHECK of an attachment no record names.
    #[error("no IP is recorded for container {container_id} interface {ifname}")]
    UnknownAttachment {
        /// The sandbox.
        container_id: String,
        /// The interface.
        ifname: String,
    },
    /// CHECK found other IPs than the runtime's prevResult.
    #[error("container {container_id} holds {found:?} but its prevResult says {expected:?}")]
    PrevResultMismatch {
        /// The sandbox.
        container_id: String,
        /// The IPs its records hold.
        found: BTreeSet<String>,
        /// The IPs of the prevResult.
        expected: BTreeSet<String>,
    },
    /// STATUS before any pool exists.
    #[error("no IPPool exists: create one (docs/operations.md)")]
    NoPool,
}

impl Error {
    /// Whether no pool can give the pod an IP now, short of someone changing the pools: none
    /// fits, or the chosen one is full. A cooldown passes on its own, so it is not one.
    pub fn is_pool_shortage(&self) -> bool {
        matches!(self, Self::NoPoolFits { .. } | Self::PoolExhausted { .. } | Self::NoPool)
    }

    /// A failed apiserver call, saying `what` it was doing.
    pub fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Self {
        let what = what.into();
        move |source| Self::Api { what, source }
    }

    /// The ADD metric's `result` label.
    pub fn label(&self) -> &'static str {
        match self {
            Self::PoolExhausted { .. } => "exhausted",
            Self::NoPoolFits { .. } => "no_pool",
            Self::InvalidClaim { .. } => "invalid_claim",
            Self::AwaitingTakeover { .. } => "awaiting_takeover",
            Self::Cooling { .. } => "cooling",
            Self::FixedIp { cause, .. } => match cause.refusal() {
                Refusal::Cooling => "cooling",
                Refusal::InUse => "fixed_ip_in_use",
                Refusal::Never => "fixed_ip_refused",
            },
            _ => "error",
        }
    }
}

/// How a sticky takeover's holder holds the IP: by a sandbox, or as a reservation.
fn held_by(container_id: &str) -> String {
    match container_id {
        "" => "the reservation of".to_string(),
        id => format!("attached to sandbox {id} of"),
    }
}

/// The tail of [`Error::PoolExhausted`]'s and [`Error::Cooling`]'s messages: why the pool holds
/// one IP fewer, when it does.
fn note(withheld_gateway: &Option<String>) -> String {
    withheld_gateway.as_deref().map(|why| format!("; {why}")).unwrap_or_default()
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn a_takeover_wait_names_the_sandbox_or_the_reservation_that_holds_the_ip() {
        let waiting = |container_id: &str| Error::AwaitingTakeover {
            ip: "10.0.0.7".into(),
            pod: "ns/web-0".into(),
            container_id: container_id.into(),
            holder: "ns/web-0".into(),
            holder_uid: "u-old".into(),
            node: "node-1".into(),
        };
        assert!(
            waiting("c1")
                .to_string()
                .contains("is still attached to sandbox c1 of pod ns/web-0 (uid u-old) on node node-1")
        );
        assert!(
            waiting("").to_string().contains("is still the reservation of pod ns/web-0 (uid u-old) on node node-1")
        );
    }
}
