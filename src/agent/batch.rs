//! Allocation batches: the ADDs of a node that want an IP of the same block while another
//! write of that block is under way are served by one compare-and-swap together, so a burst
//! of N pods on a node costs about two block writes, not N writes one after the other (group
//! commit). Each ADD queues its wish, then waits for the block's writer; whoever gets it takes
//! every wish queued so far, chooses an IP for each in one edit, writes once and answers all.
//! A wish whose batch could not be written is answered [`Taken::Retry`] and its ADD writes
//! alone, so each failure reaches its own ADD typed.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use ipnet::IpNet;
use jiff::Timestamp;
use tokio::sync::oneshot;

use super::core::{Base, Core};
use super::error::Error;
use crate::crd::{Allocation, IPBlock, IPBlockSpec};
use crate::ipam::affinity::{self, Use};
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
}

/// A queued wish and where its answer goes.
type Queued = (Wish, oneshot::Sender<Taken>);

/// The wishes queued per block.
#[derive(Default)]
pub(super) struct Batches {
    queued: Mutex<HashMap<String, Vec<Queued>>>,
}

impl Batches {
    fn push(&self, block: &str, wish: Wish) -> oneshot::Receiver<Taken> {
        let (reply, answer) = oneshot::channel();
        self.queued
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(block.to_string())
            .or_default()
            .push((wish, reply));
        answer
    }

    fn take(&self, block: &str) -> Vec<Queued> {
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
            let (allocated, released) = blocks::usage(spec);
            let usage = BlockUsage { allocated: &allocated, released: &released };
            match choose_ip(&wish.layout, wish.net, usage, now, cooldown) {
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
    /// An IP of block `name` (of `pool`) for `wish`, written in one batch with the other
    /// ADDs of this node that want one of the same block meanwhile.
    pub(super) async fn take_from_block(&self, name: &str, pool: &str, wish: Wish) -> Taken {
        let net = wish.net;
        let mut answer = self.batches.push(name, wish);
        let writer = self.block_writer(name).await;
        if let Ok(taken) = answer.try_recv() {
            return taken;
        }
        let batch = self.batches.take(name);
        let create = || {
            IPBlock::new(name, IPBlockSpec { pool: pool.to_string(), cidr: net.to_string(), ..IPBlockSpec::default() })
        };
        let wishes: Vec<&Wish> = batch.iter().map(|(wish, _)| wish).collect();
        let mut granted = Vec::new();
        let written = self
            .cas_block_held(&writer, name, Base::Newest, Some(&create), |block| {
                granted =
                    grant(&mut block.spec, &self.settings.node, &wishes, Timestamp::now(), self.settings.cooldown);
                granted.iter().any(|t| matches!(t, Taken::Ip(..))).then_some(())
            })
            .await;
        if let Err(e) = &written {
            tracing::debug!(block = %name, wishes = batch.len(), error = %e, "a batch of allocations was not written; each ADD writes alone");
            granted.clear();
        }
        let mut granted = granted.into_iter();
        for (_, reply) in batch {
            // An ADD that is gone (its caller cancelled) leaves its IP to the rollback-free
            // path of a lost answer: the sandbox's DEL, or the GC.
            let _gone = reply.send(granted.next().unwrap_or(Taken::Retry));
        }
        drop(writer);
        answer.try_recv().unwrap_or(Taken::Retry)
    }
}

impl Core {
    /// An IP of block `name` (of `pool`) for `wish` in a write of its own, starting from
    /// `base`: after a batch failed, and for the last look with fresh reads before an ADD
    /// says the pool has nothing.
    pub(super) async fn take_alone(&self, name: &str, pool: &str, wish: &Wish, base: Base) -> Result<Taken, Error> {
        let net = wish.net;
        let create = || {
            IPBlock::new(name, IPBlockSpec { pool: pool.to_string(), cidr: net.to_string(), ..IPBlockSpec::default() })
        };
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
                allocated_at: Time(Timestamp::UNIX_EPOCH),
                release_handshake: None,
                migration_target: None,
                repaired_at: None,
            },
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
}
