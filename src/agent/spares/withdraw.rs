//! Withdrawing spares (given back, or taken as a fixed IP) and settling them once the node's
//! own copy of their block shows them gone.

use std::net::IpAddr;

use super::Withdrawn;
use crate::agent::core::Core;
use crate::ipam::spares;

impl Core {
    /// Withdraws `ip` if it is a ready spare of this node's block `block` (a fixed IP the pod
    /// asks for): says whether it did; the caller then takes it in a write of the block and
    /// calls [`Core::spare_write_done`].
    pub(in crate::agent) fn withdraw_spare(&self, block: &str, ip: IpAddr) -> bool {
        let node = self.settings.node.as_str();
        let spare = self.newest_block(block).is_some_and(|b| spares::is_bindable_for(&b.spec, node, &ip.to_string()));
        let mut held = self.spares.held();
        if !spare || held.holds(&ip) || self.held_in_checkpoint().contains(&ip) {
            return false;
        }
        held.withdrawn.insert(ip, Withdrawn { block: block.to_string(), busy: true });
        true
    }

    /// After the write that took the withdrawn spare `ip` as a fixed IP (or failed to): lets
    /// go of it if the node's newest copy shows it settled (the write stored), and otherwise
    /// wakes the tending, which gives it back.
    pub(in crate::agent) fn spare_write_done(&self, ip: IpAddr) {
        if let Some(withdrawn) = self.spares.held().withdrawn.get_mut(&ip) {
            withdrawn.busy = false;
        }
        self.settle_from_copies();
        if !self.spares.held().withdrawn.is_empty() {
            self.spares.wake.notify_one();
        }
    }

    /// The withdrawn spares no call is writing, by what the node's newest copy of their block
    /// shows: still its spares ((IP, block)), and no spares any more.
    pub(super) fn withdrawn_by_copy(&self) -> (Vec<(IpAddr, String)>, Vec<IpAddr>) {
        let node = self.settings.node.as_str();
        let withdrawn: Vec<(IpAddr, String)> = self
            .spares
            .held()
            .withdrawn
            .iter()
            .filter(|(_, w)| !w.busy)
            .map(|(ip, w)| (*ip, w.block.clone()))
            .collect();
        let (still, gone): (Vec<_>, Vec<_>) = withdrawn.into_iter().partition(|(ip, block)| {
            self.newest_block(block).is_some_and(|b| spares::is_bindable_for(&b.spec, node, &ip.to_string()))
        });
        (still, gone.into_iter().map(|(ip, _)| ip).collect())
    }

    /// Lets go of the withdrawn spares that the node's newest copy of their block no longer
    /// shows as its spares: what withdrew them was written.
    pub(super) fn settle_from_copies(&self) {
        let settled = self.withdrawn_by_copy().1;
        let mut held = self.spares.held();
        for ip in settled {
            held.withdrawn.remove(&ip);
        }
    }
}
