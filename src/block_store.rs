//! The one compare-and-swap write path: every IPBlock write of the agent and the controller
//! (and the agent's IPClaim writes) goes through [`CasStore::update`]. It reads the object
//! fresh, applies a pure edit (for blocks, the record edits of `ipam::blocks`), writes with
//! the read resourceVersion under the component's field manager, and on a 409 only reads and
//! edits again on one backoff schedule. Why one helper and this schedule:
//! docs/decisions/0009-one-ipblock-write-path.md.

use std::fmt::Debug;
use std::time::Duration;

use kube::api::{Api, PostParams};
use kube::{Resource, ResourceExt};
use prometheus_client::metrics::counter::Counter;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::crd::IPBlock;

/// The store of IPBlock writes.
pub type BlockStore = CasStore<IPBlock>;

/// The first delay after a conflict; it doubles (with jitter) up to [`MAX_DELAY`].
const MIN_DELAY: Duration = Duration::from_millis(5);

/// The longest delay between two attempts.
const MAX_DELAY: Duration = Duration::from_millis(250);

/// How many conflicts one update absorbs before it gives up.
const MAX_CONFLICTS: usize = 40;

/// Why a compare-and-swap failed.
#[derive(Debug, thiserror::Error)]
#[error("{kind} {name}: {cause} (attempt {attempts})")]
pub struct CasError {
    /// The object's kind.
    pub kind: String,
    /// The object's name (`namespace/name` for a namespaced kind).
    pub name: String,
    /// How many reads the update made before it failed.
    pub attempts: usize,
    /// What failed.
    #[source]
    pub cause: CasCause,
}

/// What failed in a [`CasError`].
#[derive(Debug, thiserror::Error)]
pub enum CasCause {
    /// Reading the object failed.
    #[error("reading it failed: {0}")]
    Read(#[source] kube::Error),
    /// Writing the object failed with something other than a conflict.
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
    /// The object does not exist and was not to be created.
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

/// A component's handle for compare-and-swap writes of one kind of object.
#[derive(Clone)]
pub struct CasStore<K: Resource<DynamicType = ()>> {
    api: Api<K>,
    params: PostParams,
    conflicts: Option<Counter>,
}

impl<K> CasStore<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + Serialize + DeserializeOwned,
{
    /// Writes through `api` as `field_manager` (one per component: `ipwarden-agent-<node>`,
    /// `ipwarden-controller-<identity>`), counting each conflict in `conflicts` if given.
    pub fn new(api: Api<K>, field_manager: String, conflicts: Option<Counter>) -> Self {
        let params = PostParams { field_manager: Some(field_manager), ..PostParams::default() };
        Self { api, params, conflicts }
    }

    /// `namespace/name` of object `name` of a namespaced store, `name` otherwise: how errors
    /// name it.
    fn path(&self, name: &str) -> String {
        self.api.namespace().map_or_else(|| name.to_string(), |namespace| format!("{namespace}/{name}"))
    }

    /// Applies `edit` to a fresh copy of object `name` and writes it with its
    /// resourceVersion; retried on conflict only, with a fresh read and edit each time. A
    /// missing object is created from `create` (then edited; it has no resourceVersion yet)
    /// when given, else the update is [`CasOutcome::Absent`]. `edit` returning `None` means
    /// nothing to write.
    pub async fn update<T>(
        &self,
        name: &str,
        create: Option<&dyn Fn() -> K>,
        edit: impl FnMut(&mut K) -> Option<T>,
    ) -> Result<CasOutcome<T>, CasError> {
        Ok(self.update_from(name, None, create, edit).await?.0)
    }

    /// [`CasStore::update`] whose first attempt edits `base` (a copy the caller holds, such
    /// as the one its last write returned) instead of reading the object: a stale `base`
    /// costs one conflict and a fresh read, never a lost write. Also returns the object as
    /// stored after the update (written, or as read when nothing was to change), for the
    /// caller's next `base`.
    pub async fn update_from<T>(
        &self,
        name: &str,
        mut base: Option<K>,
        create: Option<&dyn Fn() -> K>,
        mut edit: impl FnMut(&mut K) -> Option<T>,
    ) -> Result<(CasOutcome<T>, Option<K>), CasError> {
        let mut delays = crate::retry::conflict_delays(MIN_DELAY, MAX_DELAY, MAX_CONFLICTS);
        let mut attempts = 0;
        loop {
            attempts += 1;
            let failed = |cause| CasError { kind: K::kind(&()).to_string(), name: self.path(name), attempts, cause };
            let held = base.is_some();
            let current = match base.take() {
                Some(held) => Some(held),
                None => self.api.get_opt(name).await.map_err(|e| failed(CasCause::Read(e)))?,
            };
            let Some(read) = current.or_else(|| create.map(|create| create())) else {
                return Ok((CasOutcome::Absent, None));
            };
            // An edit that finds nothing to write may have changed its copy before deciding
            // so: what is stored is the object as read.
            let mut object = read.clone();
            let Some(out) = edit(&mut object) else {
                let stored = read.resource_version().is_some().then_some(read);
                return Ok((CasOutcome::Unchanged, stored));
            };
            let written = if object.resource_version().is_none() {
                self.api.create(&self.params, &object).await
            } else {
                self.api.replace(&object.name_any(), &self.params, &object).await
            };
            match written {
                Ok(stored) => return Ok((CasOutcome::Written(out), Some(stored))),
                // A create that finds the object made meanwhile is a lost race like a 409 on a
                // replace (the apiserver answers it with 409 AlreadyExists).
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    if let Some(conflicts) = &self.conflicts {
                        conflicts.inc();
                    }
                    let Some(delay) = delays.next() else { return Err(failed(CasCause::Conflicts)) };
                    tokio::time::sleep(delay).await;
                }
                // The held copy's object is gone (deleted, or deleted and made anew): read.
                Err(kube::Error::Api(status)) if status.code == 404 && held => {}
                Err(e) => return Err(failed(CasCause::Write(e))),
            }
        }
    }
}
