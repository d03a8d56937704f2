//! Block write batches (group commit): the edits of a node's calls that want to write the
//! same block while another write of it is under way are applied together and written in one
//! compare-and-swap, so a burst of N pods (or N DELs after a drain) on a node costs about two
//! writes of its block, not N writes one after the other. Each call queues its edit, then
//! waits for the block's writer; whoever gets it takes every edit queued so far, applies them
//! in queue order to one copy, writes once and tells each call. A call whose batch could not be
//! written is told so and writes alone, so each failure reaches its own call typed.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ipnet::IpNet;
use jiff::Timestamp;
use tokio::sync::oneshot;

use super::core::{Base, Core, new_block};
use super::error::Error;
use super::serial::KeyGuard;
use crate::block_store::CasOutcome;
use crate::crd::{Allocation, IPBlock, IPBlockSpec};
use crate::ipam::affinity::{self, Use};
use crate::ipam::free::{self, Asker};
use crate::ipam::{BlockUsage, ChooseError, PoolLayout, blocks, choose_ip};

/// What one ADD got from a block.
#[derive(Debug)]
pub(super) enum Taken {
    /// This IP, and what it held before (for a rollback).
    Ip(IpAddr, blocks::Prior),
    /// Nothing ready: `cooling` free IPs cool down, the first until `next_free_at`.
    Cooling {
        /// How many.
        cooling: usize,
        /// When the first is ready.
        next_free_at: Timestamp,
    },
    /// Nothing for this node here (full, or claimed by another node meanwhile).
    Nothing,
    /// The batch's write failed; write alone to learn why.
    Retry,
}

/// One ADD's wish for an IP of a block.
#[derive(Clone)]
pub(super) struct Wish {
    /// The pool's layout.
    pub(super) layout: PoolLayout,
    /// The block's CIDR.
    pub(super) net: IpNet,
    /// How the node may use the block.
    pub(super) how: Use,
    /// The record to write for the IP.
    pub(super) record: Allocation,
    /// IPs the pod held under a sandbox the runtime lost ([`Asker::RECLAIM`]): one of them
    /// free in this block is granted before any other, cooling or not.
    pub(super) returning: BTreeSet<IpAddr>,
}

/// A queued edit: applies itself to the batch's copy, keeps its own result, and says whether
/// it changed the copy. Run again on a fresh copy after a conflict.
type Edit = Box<dyn FnMut(&mut IPBlockSpec) -> bool + Send>;

/// What a batch's write did, as each of its calls is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Batched {
    /// Written, or nothing to write: the edit's last result stands.
    Done,
    /// Not written (the read or the write failed): the call writes alone.
    Failed,
}

/// The edits queued for one block, with the block to create if it does not exist.
#[derive(Default)]
struct Queue {
    edits: Vec<(Edit, oneshot::Sender<Batched>)>,
    create: Option<(String, IpNet)>,
}

/// The edits queued per block.
#[derive(Default)]
pub(super) struct Batches {
    queued: Mutex<HashMap<String, Queue>>,
}

impl Batches {
    fn push(&self, block: &str, edit: Edit, create: Option<(String, IpNet)>) -> oneshot::Receiver<Batched> {
        let (reply, answer) = oneshot::channel();
        let mut queued = self.queued.lock().unwrap_or_else(PoisonError::into_inner);
        let queue = queued.entry(block.to_string()).or_default();
        queue.edits.push((edit, reply));
        queue.create = queue.create.take().or(create);
        answer
    }

    fn take(&self, block: &str) -> Queue {
        self.queued.lock().unwrap_or_else(PoisonError::into_inner).remove(block).unwrap_or_default()
    }
}

/// Grants `wishes` on `spec` in queue order for `node`: each an IP of its own (pure).
pub(super) fn grant(
    spec: &mut IPBlockSpec,
    node: &str,
    wishes: &[&Wish],
    now: Timestamp,
    cooldown: Duration,
) -> Vec<Taken> {
    wishes
        .iter()
        .map(|wish| {
            // A write whose answer was lost (a timeout after the apiserver stored it) is
            // found again, not doubled: the sandbox keeps the IP it already has here.
            let record = &wish.record;
            let mine = blocks::find_attachment(spec, &record.container_id, &record.interface)
                .into_iter()
                .find(|ip| spec.allocations.get(ip).is_some_and(|r| r.pod.uid == record.pod.uid));
            if let Some(ip) = mine.and_then(|ip| ip.parse().ok()) {
                return Taken::Ip(ip, blocks::Prior::Free(None));
            }
            let back = wish.returning.iter().copied().find(|ip| {
                wish.net.contains(ip) && free::hold(spec, &wish.layout, *ip, &Asker::RECLAIM, now).is_none()
            });
            let (allocated, released) = blocks::usage(spec);
            let usage = BlockUsage { allocated: &allocated, released: &released };
            match back.map_or_else(|| choose_ip(&wish.layout, wish.net, usage, now, cooldown), Ok) {
                Ok(ip) if affinity::take_for(spec, node, wish.how) => {
                    Taken::Ip(ip, blocks::allocate(spec, ip, wish.record.clone()))
                }
                Ok(_) => Taken::Nothing,
                Err(ChooseError::Cooling { cooling, next_free_at, .. }) => Taken::Cooling { cooling, next_free_at },
                Err(_) => Taken::Nothing,
            }
        })
        .collect()
}

impl Core {
    /// Applies `edit` to block `name` in one write with the edits of the node's other calls
    /// queued for the same block meanwhile, starting from the newest copy held; `create`
    /// (pool, CIDR) makes the block when it does not exist. `edit` returns whether it changed
    /// the block and its result, and may run more than once (on a fresh copy after a
    /// conflict): its last result is returned. `None`: the batch was not written (or the block
    /// does not exist and was not to be made); write alone to learn why.
    pub(super) async fn edit_in_batch<T: Send + 'static>(
        &self,
        name: &str,
        create: Option<(String, IpNet)>,
        mut edit: impl FnMut(&mut IPBlockSpec) -> (bool, T) + Send + 'static,
    ) -> Option<T> {
        let result = Arc::new(Mutex::new(None));
        let slot = result.clone();
        let boxed: Edit = Box::new(move |spec| {
            let (changed, out) = edit(spec);
            *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(out);
            changed
        });
        let mut answer = self.batches.push(name, boxed, create);
        let writer = self.block_writer(name).await;
        // Written by the writer before: its answer is here. Else this call writes the batch.
        let told = match answer.try_recv() {
            Ok(told) => told,
            Err(_) => {
                self.write_batch(&writer, name).await;
                answer.try_recv().unwrap_or(Batched::Failed)
            }
        };
        drop(writer);
        let done = told == Batched::Done;
        let out = result.lock().unwrap_or_else(PoisonError::into_inner).take();
        out.filter(|_| done)
    }

    /// Writes every edit queued for block `name`, whose writer the caller is, in one
    /// compare-and-swap, and tells each edit's call how it went.
    async fn write_batch(&self, writer: &KeyGuard<'_>, name: &str) {
        let Queue { mut edits, create } = self.batches.take(name);
        let create_block = create.map(|(pool, net)| move || new_block(name, &pool, net));
        let create_ref: Option<&dyn Fn() -> IPBlock> = create_block.as_ref().map(|c| c as &dyn Fn() -> IPBlock);
        let written = self
            .cas_block_held(writer, name, Base::Newest, create_ref, |block| {
                let mut changed = false;
                for (edit, _) in edits.iter_mut() {
                    changed |= edit(&mut block.spec);
                }
                changed.then_some(())
            })
            .await;
        let told = match &written {
            Ok(CasOutcome::Written(())) | Ok(CasOutcome::Unchanged) => Batched::Done,
            Ok(CasOutcome::Absent) => Batched::Failed,
            Err(e) => {
                tracing::debug!(block = %name, edits = edits.len(), error = %e, "a batch of block edits was not written; each call writes alone");
                Batched::Failed
            }
        };
        for (_, reply) in edits {
            // A call that is gone (never, today: the actor runs each call to its end) leaves
            // its edit's effect to the sandbox's DEL or the GC.
            let _gone = reply.send(told);
        }
    }

    /// An IP of block `name` (of `pool`) for `wish`, written in one batch with the other
    /// edits of this node's calls for the same block meanwhile; [`Taken::Retry`] when the
    /// batch was not written.
    pub(super) async fn take_from_block(&self, name: &str, pool: &str, wish: Wish) -> Taken {
        let (node, cooldown) = (self.settings.node.clone(), self.settings.cooldown);
        let create = Some((pool.to_string(), wish.net));
        let taken = self
            .edit_in_batch(name, create, move |spec| {
                let taken = grant(spec, &node, &[&wish], Timestamp::now(), cooldown).into_iter().next();
                let taken = taken.unwrap_or(Taken::Nothing);
                (matches!(taken, Taken::Ip(..)), taken)
            })
            .await;
        taken.unwrap_or(Taken::Retry)
    }
}

impl Core {
    /// An IP of block `name` (of `pool`) for `wish` in a write of its own, starting from
    /// `base`: after a batch failed, and for the last look with fresh reads before an ADD
    /// says the pool has nothing.
    pub(super) async fn take_alone(&self, name: &str, pool: &str, wish: &Wish, base: Base) -> Result<Taken, Error> {
        let create = || new_block(name, pool, wish.net);
        let mut got = Taken::Nothing;
        self.cas_block(name, base, Some(&create), |block| {
            let taken = grant(&mut block.spec, &self.settings.node, &[wish], Timestamp::now(), self.settings.cooldown);
            got = taken.into_iter().next().unwrap_or(Taken::Nothing);
            matches!(got, Taken::Ip(..)).then_some(())
        })
        .await?;
        Ok(got)
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::crd::PodRef;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn wish(layout: &PoolLayout, net: &str, how: Use, pod: &str) -> Wish {
        Wish {
            layout: layout.clone(),
            net: net.parse().unwrap(),
            how,
            record: Allocation {
                pod: PodRef { namespace: "ns".into(), name: pod.into(), uid: pod.into() },
                node: "a".into(),
                network: "ipwarden".into(),
                container_id: pod.into(),
                interface: "eth0".into(),
                owner: None,
                sticky: false,
                held_for: None,
                allocated_at: Time(Timestamp::UNIX_EPOCH),
                release_handshake: None,
                migration_target: None,
                repaired_at: None,
            },
            returning: BTreeSet::new(),
        }
    }

    #[test]
    fn a_batch_grants_each_wish_its_own_ip_until_the_block_is_full() {
        // A /29 pool in one block: 6 allocatable addresses.
        let layout = PoolLayout::new("10.0.0.0/29", &[], &[], None, None).unwrap();
        let wishes: Vec<Wish> = (0..8).map(|i| wish(&layout, "10.0.0.0/29", Use::Claim, &format!("p{i}"))).collect();
        let mut spec = IPBlockSpec::default();
        let granted = grant(&mut spec, "a", &wishes.iter().collect::<Vec<_>>(), Timestamp::now(), Duration::ZERO);
        let ips: Vec<IpAddr> =
            granted.iter().filter_map(|t| if let Taken::Ip(ip, _) = t { Some(*ip) } else { None }).collect();
        assert_eq!(ips.len(), 6, "{granted:?}");
        assert_eq!(ips.iter().collect::<std::collections::BTreeSet<_>>().len(), 6, "distinct IPs");
        assert!(matches!(granted[6], Taken::Nothing) && matches!(granted[7], Taken::Nothing));
        assert_eq!(spec.allocations.len(), 6);
        assert_eq!(spec.affinity.as_deref(), Some("a"), "the first grant claimed the block");
    }

    #[test]
    fn a_sandbox_whose_record_is_already_in_the_block_gets_the_same_ip_again() {
        let layout = PoolLayout::new("10.0.0.0/29", &[], &[], None, None).unwrap();
        let mut spec = IPBlockSpec::default();
        let first =
            grant(&mut spec, "a", &[&wish(&layout, "10.0.0.0/29", Use::Claim, "p")], Timestamp::now(), Duration::ZERO);
        let again =
            grant(&mut spec, "a", &[&wish(&layout, "10.0.0.0/29", Use::Claim, "p")], Timestamp::now(), Duration::ZERO);
        match (&first[0], &again[0]) {
            (Taken::Ip(a, _), Taken::Ip(b, blocks::Prior::Free(None))) => assert_eq!(a, b),
            other => panic!("{other:?}"),
        }
        assert_eq!(spec.allocations.len(), 1, "one record for the sandbox");
    }

    #[test]
    fn a_claim_of_a_block_another_node_took_is_granted_nothing() {
        let layout = PoolLayout::new("10.0.0.0/29", &[], &[], None, None).unwrap();
        let mut spec = IPBlockSpec { affinity: Some("b".into()), ..IPBlockSpec::default() };
        let wishes = [wish(&layout, "10.0.0.0/29", Use::Claim, "p"), wish(&layout, "10.0.0.0/29", Use::Borrow, "q")];
        let granted = grant(&mut spec, "a", &wishes.iter().collect::<Vec<_>>(), Timestamp::now(), Duration::ZERO);
        assert!(matches!(granted[0], Taken::Nothing), "{granted:?}");
        assert!(matches!(granted[1], Taken::Ip(..)), "a borrower still gets one: {granted:?}");
    }

    #[test]
    fn a_pod_taking_back_the_ips_of_its_lost_sandbox_gets_one_free_in_the_block_first_cooling_or_not() {
        let layout = PoolLayout::new("10.0.0.0/29", &[], &[], None, None).unwrap();
        let now = Timestamp::now();
        let cooldown = Duration::from_secs(60);
        // .2 and .3 released just now (cooling), .4 held by another pod, .1, .5 and .6 never used.
        let base = || {
            let mut spec = IPBlockSpec { affinity: Some("a".into()), ..IPBlockSpec::default() };
            for released in ["10.0.0.2", "10.0.0.3"] {
                spec.released.insert(released.into(), Time(now));
            }
            spec.allocations.insert("10.0.0.4".into(), wish(&layout, "10.0.0.0/29", Use::Own, "other").record);
            spec
        };
        // (its IPs to take back, what it is granted)
        let cases: [(&[&str], Option<&str>); 5] = [
            (&[], Some("10.0.0.1")),
            (&["10.0.0.3"], Some("10.0.0.3")),
            (&["10.0.0.4", "10.0.0.3"], Some("10.0.0.3")),
            (&["10.0.0.4"], Some("10.0.0.1")),
            (&["10.0.1.3"], Some("10.0.0.1")),
        ];
        for (returning, expected) in cases {
            let mut spec = base();
            let mut asking = wish(&layout, "10.0.0.0/29", Use::Own, "p");
            asking.returning = returning.iter().map(|ip| ip.parse().unwrap()).collect();
            let granted = grant(&mut spec, "a", &[&asking], now, cooldown);
            let got = match &granted[0] {
                Taken::Ip(ip, _) => Some(ip.to_string()),
                _ => None,
            };
            assert_eq!(got.as_deref(), expected, "taking back {returning:?}: {granted:?}");
        }
    }
}
