//! Settling the node's spares after a lost checkpoint: which were bound is unknown.

use std::collections::BTreeMap;

use jiff::Timestamp;
use kube::ResourceExt;

use crate::agent::core::Core;
use crate::agent::error::Error;
use crate::ipam::{blocks, spares};

impl Core {
    /// After the checkpoint was rebuilt from the records (lost or corrupt), no one knows which
    /// of this node's spares were bound: each one a pod of this node reports becomes that
    /// pod's record (as a repair writes it: its sandbox unknown), and the others leave the
    /// spares and cool down, as a released IP does. Only a pod's own network's interface
    /// ([`crate::ipam::fixed::POD_INTERFACE`], the one its status reports) takes spares. Written before the
    /// agent serves.
    pub async fn settle_spares_after_rebuild(&self, network: &str) -> Result<usize, Error> {
        let node = self.settings.node.clone();
        let reported: BTreeMap<String, blocks::Adopter> = self
            .pods
            .state()
            .iter()
            .map(|p| crate::gc::index::PodFacts::of(p))
            .filter(|facts| !facts.finished())
            .flat_map(|facts| {
                let adopter = blocks::Adopter {
                    pod: crate::crd::PodRef { namespace: facts.namespace, name: facts.name, uid: facts.uid },
                    node: node.clone(),
                    owner: facts.owner,
                    sticky: false,
                };
                facts.ips.into_iter().map(move |ip| (ip, adopter.clone()))
            })
            .collect();
        let mut settled = 0;
        for block in self.blocks.state().iter().filter(|b| b.spec.affinity.as_deref() == Some(node.as_str())) {
            if block.spec.spares.is_empty() {
                continue;
            }
            let Ok(net) = block.spec.cidr.parse() else { continue };
            let (reported, network, node) = (reported.clone(), network.to_string(), node.clone());
            let changed = self
                .write_block(&block.name_any(), &block.spec.pool, net, move |spec| {
                    let changed = spares::settle_unknown(spec, &node, &reported, &network, Timestamp::now());
                    (changed > 0).then_some(changed)
                })
                .await?;
            settled += changed.unwrap_or(0);
        }
        Ok(settled)
    }
}
