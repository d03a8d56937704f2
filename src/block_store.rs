//! The one write path for IPBlocks: every compare-and-swap of the agent and the controller
//! goes through [`BlockStore::update`]. It reads the block fresh, applies a pure edit (the
//! record edits of `ipam::blocks`), writes with the read resourceVersion under the
//! component's field manager, and on a 409 only reads and edits again on one backoff
//! schedule. Why one helper and this schedule: docs/decisions/0009-one-ipblock-write-path.md.

use std::time::Duration;

use ipnet::IpNet;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use prometheus_client::metrics::counter::Counter;

use crate::crd::{IPBlock, IPBlockSpec};

/// The first delay after a conflict; it doubles (with jitter) up to [`MAX_DELAY`].
const MIN_DELAY: Duration = Duration::from_millis(5);

/// The longest delay between two attempts.
const MAX_DELAY: Duration = Duration::from_millis(250);

/// How many conflicts one update absorbs before it gives up.
const MAX_CONFLICTS: usize = 40;

/// Why an IPBlock compare-and-swap failed.
#[derive(Debug, thiserror::Error)]
#[error("IPBlock {block}: {cause} (attempt {attempts})")]
pub struct CasError {
    /// The block's name.
    pub block: String,
    /// How many reads the update made before it failed.
    pub attempts: usize,
    /// What failed.
    #[source]
    pub cause: CasCause,
}

/// What failed in a [`CasError`].
#[derive(Debug, thiserror::Error)]
pub enum CasCause {
    /// Reading the block failed.
    #[error("reading it failed: {0}")]
    Read(#[source] kube::Error),
    /// Writing the block failed with something other than a conflict.
    #[error("writing it failed: {0}")]
    Write(#[source] kube::Error),
    /// Every write lost a resourceVersion race.
    #[error("it kept changing under {MAX_CONFLICTS} writes; try again")]
    Conflicts,
}

/// What an update did.
#[derive(Debug, PartialEq, Eq)]
pub enum CasOutcome<T> {
    /// The edit's result, written.
    Written(T),
    /// The edit found nothing to change; nothing was written.
    Unchanged,
    /// The block does not exist and was not to be created.
    Absent,
}

impl<T> CasOutcome<T> {
    /// The edit's result if it was written.
    pub fn written(self) -> Option<T> {
        match self {
            Self::Written(out) => Some(out),
            Self::Unchanged | Self::Absent => None,
        }
    }
}

/// A component's handle for IPBlock writes.
#[derive(Clone)]
pub struct BlockStore {
    api: Api<IPBlock>,
    params: PostParams,
    conflicts: Counter,
}

impl BlockStore {
    /// Writes as `field_manager` (one per component: `ipwarden-agent-<node>`,
    /// `ipwarden-controller-<identity>`), counting each conflict in `conflicts`.
    pub fn new(client: Client, field_manager: String, conflicts: Counter) -> Self {
        let params = PostParams { field_manager: Some(field_manager), ..PostParams::default() };
        Self { api: Api::all(client), params, conflicts }
    }

    /// Applies `edit` to a fresh copy of block `name` and writes it with its
    /// resourceVersion; retried on conflict only, with a fresh read and edit each time. A
    /// missing block is created from `create` (its pool and CIDR) when given, else the
    /// update is [`CasOutcome::Absent`]. `edit` returning `None` means nothing to write.
    pub async fn update<T>(
        &self,
        name: &str,
        create: Option<(&str, IpNet)>,
        mut edit: impl FnMut(&mut IPBlockSpec) -> Option<T>,
    ) -> Result<CasOutcome<T>, CasError> {
        let mut delays = crate::retry::conflict_delays(MIN_DELAY, MAX_DELAY, MAX_CONFLICTS);
        let mut attempts = 0;
        loop {
            attempts += 1;
            let failed = |cause| CasError { block: name.to_string(), attempts, cause };
            let current = self.api.get_opt(name).await.map_err(|e| failed(CasCause::Read(e)))?;
            let written = match (current, create) {
                (None, None) => return Ok(CasOutcome::Absent),
                (None, Some((pool, cidr))) => {
                    let mut spec =
                        IPBlockSpec { pool: pool.to_string(), cidr: cidr.to_string(), ..IPBlockSpec::default() };
                    let Some(out) = edit(&mut spec) else { return Ok(CasOutcome::Unchanged) };
                    self.api.create(&self.params, &IPBlock::new(name, spec)).await.map(|_| out)
                }
                (Some(mut block), _) => {
                    let Some(out) = edit(&mut block.spec) else { return Ok(CasOutcome::Unchanged) };
                    self.api.replace(&block.name_any(), &self.params, &block).await.map(|_| out)
                }
            };
            match written {
                Ok(out) => return Ok(CasOutcome::Written(out)),
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    self.conflicts.inc();
                    let Some(delay) = delays.next() else { return Err(failed(CasCause::Conflicts)) };
                    tokio::time::sleep(delay).await;
                }
                Err(e) => return Err(failed(CasCause::Write(e))),
            }
        }
    }
}
