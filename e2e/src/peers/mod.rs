//! The IPAMs the churn benchmark compares on the same harness: ipwarden and its peers, each
//! built from its own pinned Go module (e2e/cluster/peers/, docs/decisions/0010). What the
//! benchmark must know of each is plain data here: which objects hold its allocation records
//! (the release signal: a pod's record leaving them), and which resources its writes go to.

pub mod whereabouts;

use std::collections::HashSet;

use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use serde::Serialize;

use crate::process::Component;

/// An IPAM the churn benchmark can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Ipam {
    /// ipwarden itself: IPBlocks and IPClaims, agents and controllers.
    Ipwarden,
    /// Whereabouts: IPPools (and OverlappingRangeIPReservations), a cluster-wide Lease per
    /// ADD and DEL, an ip-control-loop and reconciler per node.
    Whereabouts,
    /// Whereabouts with node slices: each node allocates from a slice of the range of its own
    /// (assigned by the node slice controller) under a Lease per slice.
    WhereaboutsNodeSlices,
}

impl std::str::FromStr for Ipam {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "ipwarden" => Ok(Self::Ipwarden),
            "whereabouts" => Ok(Self::Whereabouts),
            "whereabouts-nodeslices" => Ok(Self::WhereaboutsNodeSlices),
            other => Err(format!("unknown IPAM {other:?}: expected ipwarden, whereabouts or whereabouts-nodeslices")),
        }
    }
}

impl std::fmt::Display for Ipam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Ipwarden => "ipwarden",
            Self::Whereabouts => "whereabouts",
            Self::WhereaboutsNodeSlices => "whereabouts-nodeslices",
        })
    }
}

impl Ipam {
    /// The kind whose objects hold the allocation records.
    pub fn records(self) -> ApiResource {
        match self {
            Self::Ipwarden => ApiResource::from_gvk(&GroupVersionKind::gvk("ipwarden.io", "v1alpha1", "IPBlock")),
            Self::Whereabouts | Self::WhereaboutsNodeSlices => {
                ApiResource::from_gvk(&GroupVersionKind::gvk("whereabouts.cni.cncf.io", "v1alpha1", "IPPool"))
            }
        }
    }

    /// The pods (`namespace/name`) that one of [`Ipam::records`]'s objects holds an IP for.
    pub fn held_pods(self, object: &DynamicObject) -> HashSet<String> {
        let allocations = object.data["spec"]["allocations"].as_object().into_iter().flat_map(|a| a.values());
        match self {
            Self::Ipwarden => allocations
                .filter_map(|record| {
                    let pod = &record["pod"];
                    Some(format!("{}/{}", pod["namespace"].as_str()?, pod["name"].as_str()?))
                })
                .collect(),
            Self::Whereabouts | Self::WhereaboutsNodeSlices => {
                allocations.filter_map(|record| record["podref"].as_str().map(str::to_string)).collect()
            }
        }
    }

    /// The apiserver resources (as `apiserver_request_total` labels them) whose writes the IPAM
    /// pays for allocating and releasing, Leases aside (counted apart, by watch).
    pub fn write_resources(self) -> &'static [&'static str] {
        match self {
            Self::Ipwarden => &["ipblocks", "ipclaims"],
            Self::Whereabouts => &["ippools", "overlappingrangeipreservations"],
            Self::WhereaboutsNodeSlices => &["ippools", "overlappingrangeipreservations", "nodeslicepools"],
        }
    }
}

/// One long-running process of an installed IPAM, as the benchmark measures it.
pub struct Measured<'a> {
    /// What it is (`controller-a`, `whereabouts-controller node-0`, ...).
    pub name: &'a str,
    /// Its Prometheus `/metrics` port on 127.0.0.1, when it serves ipwarden's metrics.
    pub metrics_port: Option<u16>,
    /// The process.
    pub component: &'a Component,
}

/// An IPAM running on a test cluster. Dropping it stops its processes.
pub enum Installed {
    /// ipwarden's agents and controllers.
    Ipwarden(crate::ipwarden::Installation),
    /// Whereabouts' per-node controllers (and node slice controller).
    Whereabouts(whereabouts::Installation),
}

impl Installed {
    /// Which IPAM this is.
    pub fn ipam(&self) -> Ipam {
        match self {
            Self::Ipwarden(_) => Ipam::Ipwarden,
            Self::Whereabouts(installation) if installation.node_slices => Ipam::WhereaboutsNodeSlices,
            Self::Whereabouts(_) => Ipam::Whereabouts,
        }
    }

    /// The node-side processes that serve ipwarden's agent metrics (none for a peer, whose node
    /// side is the CNI binary alone).
    pub fn agents(&self) -> Vec<Measured<'_>> {
        match self {
            Self::Ipwarden(installation) => installation
                .agents
                .iter()
                .map(|a| Measured { name: &a.name, metrics_port: Some(a.metrics_port), component: &a.component })
                .collect(),
            Self::Whereabouts(_) => Vec::new(),
        }
    }

    /// The controller processes, whose CPU and memory the benchmark reports.
    pub fn controllers(&self) -> Vec<Measured<'_>> {
        match self {
            Self::Ipwarden(installation) => installation
                .controllers
                .iter()
                .map(|c| Measured { name: &c.name, metrics_port: Some(c.metrics_port), component: &c.component })
                .collect(),
            Self::Whereabouts(installation) => installation
                .controllers
                .iter()
                .map(|(name, component)| Measured { name, metrics_port: None, component })
                .collect(),
        }
    }
}

#[cfg(test)]
mod test {
    use serde_json::json;

    use super::*;

    fn object(resource: &ApiResource, spec: serde_json::Value) -> DynamicObject {
        let mut object = DynamicObject::new("o", resource);
        object.data = json!({"spec": spec});
        object
    }

    #[test]
    fn held_pods_are_read_from_each_ipams_own_records() {
        let block = object(
            &Ipam::Ipwarden.records(),
            json!({"allocations": {
                "10.244.0.1": {"pod": {"namespace": "default", "name": "x", "uid": "u1"}},
                "10.244.0.2": {"pod": {"namespace": "default", "name": "y", "uid": "u2"}},
            }}),
        );
        assert_eq!(Ipam::Ipwarden.held_pods(&block), HashSet::from(["default/x".into(), "default/y".into()]));
        let pool = object(
            &Ipam::Whereabouts.records(),
            json!({"range": "10.244.0.0/16", "allocations": {"5": {"id": "c1", "podref": "default/z", "ifname": "eth0"}}}),
        );
        assert_eq!(Ipam::Whereabouts.held_pods(&pool), HashSet::from(["default/z".into()]));
        assert!(Ipam::Whereabouts.held_pods(&object(&Ipam::Whereabouts.records(), json!({}))).is_empty());
    }

    #[test]
    fn ipam_names_round_trip_and_unknown_names_are_refused() {
        for ipam in [Ipam::Ipwarden, Ipam::Whereabouts, Ipam::WhereaboutsNodeSlices] {
            assert_eq!(ipam.to_string().parse::<Ipam>(), Ok(ipam));
        }
        assert!("calico".parse::<Ipam>().unwrap_err().contains("unknown IPAM"));
    }
}
