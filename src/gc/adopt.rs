//! The plan of `ipwarden adopt`: which IPs that running pods report (attached by another
//! IPAM, such as host-local, before the cluster moved to ipwarden) get an ipwarden record, so
//! that ipwarden never hands them out again. Pure: the CLI lists pods, pools and blocks, asks
//! [`plan`], and writes what it returns.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use serde::Serialize;

use super::index::PodFacts;
use crate::crd::{Allocation, ClaimedInterface, ClaimedIp, IPBlock, IPClaimSpec, IPPool, PodRef};
use crate::ipam::blocks::{self, Adopter};
use crate::ipam::free::{self, Asker};
use crate::ipam::{PoolLayout, fixed, pools, workload};

/// The network name adopted records carry unless told otherwise: the chart's
/// `cni.networkName`, the `name` of the netconf it installs.
pub const DEFAULT_NETWORK: &str = "ipwarden";

/// One IP to record for the pod that reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Adoption {
    /// The IP.
    pub ip: String,
    /// The pool whose layout hands it out.
    pub pool: String,
    /// The IPBlock that holds its record (created if it does not exist).
    pub block: String,
    /// That block's CIDR.
    pub block_cidr: String,
    /// The pod reporting it.
    pub pod: PodRef,
    /// The pod's node.
    pub node: String,
    /// Who the record names: the pod, its node and its controller.
    #[serde(skip)]
    pub adopter: Adopter,
    /// Every IP the pod reports: a sticky pod's IPClaim is written only once all of them are
    /// adopted ([`sticky_claims`]).
    #[serde(skip)]
    pub pod_ips: Vec<IpAddr>,
    /// The pool's layout the plan was made with, which [`apply`] checks the IP against again.
    #[serde(skip)]
    pub layout: PoolLayout,
}

/// An IP left alone, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Skipped {
    /// The IP.
    pub ip: String,
    /// The pod reporting it (`namespace/name`).
    pub pod: String,
    /// Why nothing is written for it.
    pub reason: String,
}

/// An IP that cannot be adopted because more than one pod claims it: two live pods report it,
/// or ipwarden already records it for another pod. The operator must look.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Refused {
    /// The IP.
    pub ip: String,
    /// Every pod involved (`namespace/name (uid)`).
    pub pods: Vec<String>,
    /// What the conflict is.
    pub reason: String,
}

/// What `ipwarden adopt` would do.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// The records to write.
    pub adopt: Vec<Adoption>,
    /// IPs needing nothing or outside ipwarden.
    pub skipped: Vec<Skipped>,
    /// IPs in conflict, written for nobody.
    pub refused: Vec<Refused>,
    /// IPs already adopted for the sticky pod that reports them (also in `skipped`): no
    /// record to write, but the pod's IPClaim is written again with them, in case the run
    /// that recorded them stopped before the claim.
    #[serde(skip)]
    pub recorded: Vec<Adoption>,
    /// The IPClaims of the sticky pods among `adopt` and `recorded`, and what is done with
    /// each (filled by the writer, which reads the claims).
    pub claims: Vec<ClaimLine>,
}

/// `namespace/name (uid)` of a pod, as the plan names it in a conflict.
fn named(pod: &PodRef) -> String {
    format!("{}/{} ({})", pod.namespace, pod.name, pod.uid)
}

/// Plans the adoption of every IP that a pod of `pods` reports: pods in the host's network
/// and finished pods are ignored (their IPs are not theirs, or no longer in use); an IP two
/// pods report, or that a record names for another pod, is refused; one outside every pool's
/// allocatable addresses, or already recorded for the same pod, is skipped; the rest are
/// adopted into the first pool (by name) that hands them out. Pools being deleted take no
/// adoption; disabled pools do (a pool is disabled while a cluster moves onto it). A pod
/// whose owner's kind is among `sticky_kinds` gets sticky records, as its ADD would have
/// written, so that it keeps its IPs when it is recreated.
pub fn plan(
    pods: &[PodFacts],
    pool_objects: &[Arc<IPPool>],
    block_objects: &[Arc<IPBlock>],
    sticky_kinds: &[String],
) -> Plan {
    let mut reporters: BTreeMap<IpAddr, Vec<&PodFacts>> = BTreeMap::new();
    for pod in pods.iter().filter(|p| !p.host_network && !p.finished() && !p.node.is_empty()) {
        for ip in pod.ips.iter().filter_map(|ip| ip.parse::<IpAddr>().ok()) {
            let holders = reporters.entry(ip).or_default();
            if !holders.iter().any(|h| h.uid == pod.uid) {
                holders.push(pod);
            }
        }
    }
    let mut layouts: Vec<(String, crate::ipam::PoolLayout)> = pool_objects
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| Some((p.name_any(), pools::layout(&p.spec).ok()?)))
        .collect();
    layouts.sort_by(|a, b| a.0.cmp(&b.0));
    let records: BTreeMap<(&str, &str), &Allocation> = block_objects
        .iter()
        .flat_map(|b| {
            let name = b.metadata.name.as_deref().unwrap_or_default();
            b.spec.allocations.iter().map(move |(ip, r)| ((name, ip.as_str()), r))
        })
        .collect();
    let mut out = Plan::default();
    for (ip, holders) in reporters {
        let text = ip.to_string();
        let [pod] = holders.as_slice() else {
            let pods = holders.iter().map(|p| named(&p.pod_ref())).collect();
            out.refused.push(Refused { ip: text, pods, reason: "reported by more than one live pod".into() });
            continue;
        };
        let skip =
            |reason: String| Skipped { ip: text.clone(), pod: format!("{}/{}", pod.namespace, pod.name), reason };
        let Some((pool, layout)) = layouts.iter().find(|(_, l)| l.contains(ip)) else {
            out.skipped.push(skip("outside every pool: not ipwarden's to record".into()));
            continue;
        };
        let Some(net) = layout.block_of(ip).filter(|_| layout.is_allocatable(ip)) else {
            out.skipped
                .push(skip(format!("in pool {pool}'s CIDR but never handed out (its network, broadcast or gateway address, excluded, or outside its ranges)")));
            continue;
        };
        let block = pools::block_name(pool, net);
        match records.get(&(block.as_str(), text.as_str())) {
            Some(record) if record.pod.uid == pod.uid => {
                out.skipped.push(skip(format!("already recorded for this pod in {block}")));
                let adoption = adoption(pod, (pool, layout), &block, net, text.clone(), sticky_kinds);
                if adoption.adopter.sticky && blocks::adopted_by(record, Some(&pod.uid)) {
                    out.recorded.push(adoption);
                }
            }
            Some(record) => out.refused.push(Refused {
                ip: text.clone(),
                pods: vec![named(&pod.pod_ref()), named(&record.pod)],
                reason: format!("recorded in {block} for another pod"),
            }),
            None => out.adopt.push(adoption(pod, (pool, layout), &block, net, text.clone(), sticky_kinds)),
        }
    }
    out
}

fn adoption(
    pod: &PodFacts,
    (pool, layout): (&str, &PoolLayout),
    block: &str,
    net: IpNet,
    ip: String,
    sticky_kinds: &[String],
) -> Adoption {
    let sticky = workload::is_sticky(pod.owner.as_ref(), sticky_kinds);
    let adopter = Adopter { pod: pod.pod_ref(), node: pod.node.clone(), owner: pod.owner.clone(), sticky };
    let mut pod_ips: Vec<IpAddr> = pod.ips.iter().filter_map(|ip| ip.parse().ok()).collect();
    pod_ips.sort();
    pod_ips.dedup();
    Adoption {
        ip,
        pool: pool.to_string(),
        block: block.to_string(),
        block_cidr: net.to_string(),
        pod: pod.pod_ref(),
        node: pod.node.clone(),
        adopter,
        pod_ips,
        layout: layout.clone(),
    }
}

/// `adoptions` grouped by the block that holds their records: one compare-and-swap each.
pub fn by_block<'a>(adoptions: impl IntoIterator<Item = &'a Adoption>) -> BTreeMap<&'a str, Vec<&'a Adoption>> {
    let mut blocks: BTreeMap<&str, Vec<&Adoption>> = BTreeMap::new();
    for adoption in adoptions {
        blocks.entry(adoption.block.as_str()).or_default().push(adoption);
    }
    blocks
}

/// Who writes an adoption, which bounds what it may change in a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writer {
    /// `ipwarden adopt`, run by an operator: may change any node's state.
    Operator,
    /// A node's agent (`--adopt-on-start`): writes only its own node's state (decision 0022),
    /// so it leaves another node's spares alone and claims only a block that holds nothing.
    Agent,
}

/// Writes `adoptions` (all of one block) into `spec` as repaired records of `network`
/// ([`blocks::adopted_record`]), each only while no record holds its IP there; gives the block
/// the first adopter's node as affinity when it has none (for an [`Writer::Agent`], only when
/// the block held nothing). Returns the IPs written.
///
/// An IP that is a node's spare is adopted too, and leaves the spares: the pod of the old IPAM
/// reporting it holds it, so no ADD may bind it (issue 26, F5: skipping it left the spare to be
/// handed to a new pod while the old one still used it). Should the spare's agent have bound it
/// to a pod that has not posted its IP yet, that pod and the adopted one share the IP whatever
/// adopt does; the agent's record write then finds the adopted record and says so (an error
/// line, and `ipwarden check` reports the conflict) instead of overwriting it. An agent skips
/// a spare of another node instead (it may not change that node's spares): the IP is not
/// written, and the caller tells the operator to run `ipwarden adopt`.
pub fn apply(
    spec: &mut crate::crd::IPBlockSpec,
    adoptions: &[&Adoption],
    network: &str,
    now: Timestamp,
    writer: Writer,
) -> Vec<String> {
    let claimable = writer == Writer::Operator || blocks::holds_nothing(spec);
    let mut written = Vec::new();
    for adoption in adoptions {
        let others_spare = spec.spares.contains(&adoption.ip) && spec.affinity.as_ref() != Some(&adoption.node);
        if writer == Writer::Agent && others_spare {
            continue;
        }
        let Ok(ip) = adoption.ip.parse::<IpAddr>() else { continue };
        // A live pod uses the IP: only a record (another pod's, or one written since the plan)
        // keeps it from the adopted record; the layout is the plan's, which left out what the
        // pool does not hand out.
        if free::hold(spec, &adoption.layout, ip, &Asker::ADOPT, now).is_some() {
            continue;
        }
        spec.spares.remove(&adoption.ip);
        blocks::allocate(spec, ip, blocks::adopted_record(&adoption.adopter, network, now));
        if spec.affinity.is_none() && claimable {
            spec.affinity = Some(adoption.node.clone());
        }
        written.push(adoption.ip.clone());
    }
    written
}

/// A sticky pod's IPClaim as adopt would write it: what its ADD would have claimed.
#[derive(Clone, Debug, PartialEq)]
pub struct StickyClaim<'a> {
    /// The pod's first adoption: its pod, node and owner.
    pub first: &'a Adoption,
    /// The pod's own network's interface ([`fixed::POD_INTERFACE`]) with its adopted IPs.
    pub interface: ClaimedInterface,
    /// The IPs the pod reports that are not adopted (skipped, refused, or lost to a race):
    /// while there are any, no claim is written, since a recreated pod takes back only the
    /// families its claim lists and would come back without these.
    pub missing: Vec<IpAddr>,
}

/// What adopt does with a sticky pod's IPClaim, given the claim as stored.
#[derive(Clone, Debug, PartialEq)]
pub enum ClaimWrite {
    /// No claim exists: create it with this spec.
    Create(IPClaimSpec),
    /// The pod's own claim says something else: replace its spec with this one.
    Update(IPClaimSpec),
    /// The pod's own claim already says this: no write.
    Unchanged,
    /// The claim is bound to another pod UID, no live pod's, while the adopted pod lives: a
    /// stale claim of an older pod of that name (say, of the StatefulSet's ipwarden days), which
    /// would give the adopted pod's successor the old IPs. Replaced by this spec.
    TakeOver {
        /// The stale claim's pod UID.
        stale: String,
        /// The adopted pod's claim.
        spec: IPClaimSpec,
    },
    /// The claim is bound to another pod UID that lives: a newer pod of that name, recreated
    /// on ipwarden since the pods were listed, whose ADD wrote it. Left alone.
    BoundToLive(String),
    /// The claim is bound to another pod UID and the adopted pod is gone: no pod of that
    /// name exists now, or only `live` (neither of them). Left alone: the pod that comes
    /// next takes the claim at its ADD.
    AdoptedPodGone {
        /// The claim's pod UID.
        bound: String,
        /// The UIDs of the pods of that name now.
        live: Vec<String>,
    },
    /// Not every IP the pod reports is adopted ([`StickyClaim::missing`]): nothing written.
    NotAdopted(Vec<IpAddr>),
}

impl ClaimWrite {
    /// The report's words for this decision, done or (`dry_run`) planned.
    pub fn describe(&self, dry_run: bool) -> String {
        let (would, not_written) = if dry_run { ("would ", "would not write") } else { ("", "not written") };
        match self {
            Self::Create(_) => format!("{would}create"),
            Self::Update(_) => format!("{would}update"),
            Self::Unchanged => "unchanged: it already binds these IPs".into(),
            Self::TakeOver { stale, .. } => {
                format!("{would}take over from pod UID {stale}: a stale claim, no pod of that name has that UID now")
            }
            Self::BoundToLive(uid) => {
                format!("left alone: bound to pod UID {uid}, a newer pod of that name, which exists")
            }
            Self::AdoptedPodGone { bound, live } if live.is_empty() => {
                format!("left alone: bound to pod UID {bound}, and no pod of that name exists now")
            }
            Self::AdoptedPodGone { bound, live } => format!(
                "left alone: bound to pod UID {bound}, and the pod of that name is now UID {}, not the adopted one",
                live.join(", ")
            ),
            Self::NotAdopted(ips) => {
                let ips: Vec<String> = ips.iter().map(ToString::to_string).collect();
                format!("{not_written}: {} not adopted, so the pod would come back without them", ips.join(", "))
            }
        }
    }
}

impl StickyClaim<'_> {
    /// The claim's name ([`workload::claim_name`]).
    pub fn name(&self) -> String {
        workload::claim_name(&self.first.pod.name, self.first.adopter.owner.as_ref())
    }

    /// Adopt's write of this claim over the claim as stored (`existing`; `None`: none yet),
    /// given `live`, the UIDs of the pods that the claim belongs to now ([`live_uids`], read
    /// after the claim). Unlike an ADD, which takes a claim over from any earlier pod of the
    /// same name, adopt takes over a claim bound to another UID only while that UID is no live
    /// pod's and the adopted pod lives (an older pod's stale claim): rebinding a newer pod's
    /// claim to the adopted one (gone by then) would let the GC release the newer pod's IPs
    /// with it. The same pod's claim keeps its `boundAt`, so a run that finds it as it would
    /// write it writes nothing.
    pub fn decide(&self, existing: Option<&IPClaimSpec>, live: &[String], now: Timestamp) -> ClaimWrite {
        if !self.missing.is_empty() {
            return ClaimWrite::NotAdopted(self.missing.clone());
        }
        let uid = &self.first.pod.uid;
        let stale = match existing.filter(|c| c.pod_uid != *uid) {
            None => None,
            Some(claim) if live.contains(&claim.pod_uid) => return ClaimWrite::BoundToLive(claim.pod_uid.clone()),
            Some(claim) if !live.contains(uid) => {
                return ClaimWrite::AdoptedPodGone { bound: claim.pod_uid.clone(), live: live.to_vec() };
            }
            Some(claim) => Some(claim.pod_uid.clone()),
        };
        let spec = IPClaimSpec {
            pod_uid: uid.clone(),
            node: self.first.node.clone(),
            owner: self.first.adopter.owner.clone(),
            sticky: true,
            interfaces: workload::claim_interfaces(existing, uid, self.interface.clone()),
            bound_at: existing.filter(|_| stale.is_none()).map_or(Time(now), |c| c.bound_at.clone()),
        };
        match (existing, stale) {
            (None, _) => ClaimWrite::Create(spec),
            (Some(_), Some(stale)) => ClaimWrite::TakeOver { stale, spec },
            (Some(claim), None) if *claim == spec => ClaimWrite::Unchanged,
            (Some(_), None) => ClaimWrite::Update(spec),
        }
    }

    /// The report's line for this claim and `write`, done or (`dry_run`) planned.
    pub fn line(&self, write: &ClaimWrite, dry_run: bool) -> ClaimLine {
        let pod = &self.first.pod;
        ClaimLine {
            claim: format!("{}/{}", pod.namespace, self.name()),
            pod: named(pod),
            ips: self.interface.ips.iter().map(|i| i.ip.clone()).collect(),
            action: write.describe(dry_run),
        }
    }
}

/// The UIDs of the pods of `pods` that IPClaim `namespace/claim` belongs to
/// ([`workload::claim_name`]): the pod of that name, or a KubeVirt VM's launcher pods.
pub fn live_uids(pods: &[PodFacts], namespace: &str, claim: &str) -> Vec<String> {
    pods.iter()
        .filter(|p| p.namespace == namespace && workload::claim_name(&p.name, p.owner.as_ref()) == claim)
        .map(|p| p.uid.clone())
        .collect()
}

/// A sticky pod's IPClaim in adopt's report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimLine {
    /// The claim (`namespace/name`).
    pub claim: String,
    /// The pod (`namespace/name (uid)`).
    pub pod: String,
    /// The pod's adopted IPs, which the claim binds.
    pub ips: Vec<String>,
    /// What was done with it, or would be, and why.
    pub action: String,
}

/// The IPClaim of each sticky pod among `adopted` (the adoptions written, and those an
/// earlier run wrote: [`Plan::recorded`]), with the IPs the pod reports that are not among
/// them.
pub fn sticky_claims<'a>(adopted: impl IntoIterator<Item = &'a Adoption>) -> Vec<StickyClaim<'a>> {
    let mut claims: BTreeMap<&str, StickyClaim<'a>> = BTreeMap::new();
    for adoption in adopted.into_iter().filter(|a| a.adopter.sticky) {
        let claim = claims.entry(adoption.pod.uid.as_str()).or_insert_with(|| StickyClaim {
            first: adoption,
            interface: ClaimedInterface { interface: fixed::POD_INTERFACE.into(), ips: Vec::new() },
            missing: adoption.pod_ips.clone(),
        });
        claim.missing.retain(|ip| adoption.ip.parse() != Ok(*ip));
        if !claim.interface.ips.iter().any(|i| i.ip == adoption.ip) {
            let ip = ClaimedIp { ip: adoption.ip.clone(), pool: adoption.pool.clone(), block: adoption.block.clone() };
            claim.interface.ips.push(ip);
        }
    }
    claims.into_values().collect()
}

#[cfg(test)]
mod test {
    use super::*;
    use crate::crd::{IPBlockSpec, IPPoolSpec};
    use crate::gc::rules::Phase;
    use std::collections::BTreeSet;

    fn pod(name: &str, uid: &str, ips: &[&str]) -> PodFacts {
        PodFacts {
            namespace: "default".into(),
            name: name.into(),
            uid: uid.into(),
            object_uid: uid.into(),
            phase: Phase::Active,
            deletion: None,
            ips: ips.iter().map(|s| s.to_string()).collect(),
            node: "node-0".into(),
            owner: None,
            host_network: false,
        }
    }

    fn pool(name: &str, cidr: &str) -> Arc<IPPool> {
        let spec: IPPoolSpec = serde_json::from_value(serde_json::json!({"cidr": cidr})).expect("pool spec");
        Arc::new(IPPool::new(name, spec))
    }

    fn block_holding(name: &str, ip: &str, uid: &str) -> Arc<IPBlock> {
        let mut spec = IPBlockSpec { pool: "v4".into(), cidr: "10.9.0.0/24".into(), ..IPBlockSpec::default() };
        let mut record = blocks::test::record(uid, "c1");
        record.pod.name = format!("holder-{uid}");
        spec.allocations.insert(ip.into(), record);
        Arc::new(IPBlock::new(name, spec))
    }

    fn pools() -> Vec<Arc<IPPool>> {
        vec![pool("v4", "10.9.0.0/24"), pool("v6", "fd00:9::/120")]
    }

    #[test]
    fn ips_of_running_pods_inside_a_pool_are_adopted_into_their_block_both_families() {
        let plan = plan(&[pod("a", "ua", &["10.9.0.7", "fd00:9::7"])], &pools(), &[], &[]);
        let adopted: Vec<(&str, &str, &str)> =
            plan.adopt.iter().map(|a| (a.ip.as_str(), a.pool.as_str(), a.block.as_str())).collect();
        assert_eq!(adopted, [("10.9.0.7", "v4", "v4-10-9-0-0-24"), ("fd00:9::7", "v6", "v6-fd00-9---120")]);
        assert!(plan.skipped.is_empty() && plan.refused.is_empty(), "{plan:?}");
        assert_eq!(plan.adopt[0].adopter.pod.uid, "ua");
        assert!(!plan.adopt[0].adopter.sticky, "an adopted record holds no sticky reservation");
    }

    #[test]
    fn a_statefulset_pods_ips_are_adopted_sticky_and_claimed_on_its_own_interface() {
        let mut web = pod("web-0", "uw", &["10.9.0.7", "fd00:9::7"]);
        web.owner = Some(crate::crd::OwnerRef { kind: "StatefulSet".into(), name: "web".into() });
        let kinds = ["StatefulSet".to_string()];
        let planned = plan(&[web.clone(), pod("a", "ua", &["10.9.0.8"])], &pools(), &[], &kinds);
        let sticky: Vec<(&str, bool)> = planned.adopt.iter().map(|a| (a.ip.as_str(), a.adopter.sticky)).collect();
        assert_eq!(sticky, [("10.9.0.7", true), ("10.9.0.8", false), ("fd00:9::7", true)]);
        let claims = sticky_claims(&planned.adopt);
        assert_eq!(claims.len(), 1, "only the StatefulSet pod gets a claim: {claims:?}");
        let (first, interface) = (claims[0].first, &claims[0].interface);
        assert_eq!((first.pod.name.as_str(), interface.interface.as_str()), ("web-0", "eth0"));
        let claimed: Vec<(&str, &str)> = interface.ips.iter().map(|i| (i.ip.as_str(), i.block.as_str())).collect();
        assert_eq!(claimed, [("10.9.0.7", "v4-10-9-0-0-24"), ("fd00:9::7", "v6-fd00-9---120")]);
        let mut launcher = pod("virt-launcher-vm1-abcde", "ul", &["10.9.0.9"]);
        launcher.owner = Some(crate::crd::OwnerRef { kind: workload::KUBEVIRT_VMI_KIND.into(), name: "vm1".into() });
        let vm = plan(&[launcher], &pools(), &[], &workload::DEFAULT_STICKY_KINDS.map(String::from));
        let vm_claims = sticky_claims(&vm.adopt);
        assert_eq!(vm_claims.len(), 1, "a KubeVirt VM's pod is sticky by default: {vm:?}");
        let claim = vm_claims[0].name();
        assert!(
            claim.ends_with("vm1") && !claim.starts_with("virt-launcher"),
            "the VM's claim, not the pod's: {claim}"
        );
        let unlisted = plan(&[web], &pools(), &[], &[]);
        assert!(unlisted.adopt.iter().all(|a| !a.adopter.sticky), "a kind not listed as sticky: {unlisted:?}");
        assert!(sticky_claims(&unlisted.adopt).is_empty());
    }

    #[test]
    fn a_sticky_pods_ips_adopted_earlier_are_skipped_and_its_claim_written_again() {
        let mut web = pod("web-0", "uw", &["10.9.0.7", "10.9.0.8"]);
        web.owner = Some(crate::crd::OwnerRef { kind: "StatefulSet".into(), name: "web".into() });
        let kinds = ["StatefulSet".to_string()];
        let first = plan(&[web.clone()], &pools(), &[], &kinds);
        let mut spec = IPBlockSpec { pool: "v4".into(), cidr: "10.9.0.0/24".into(), ..IPBlockSpec::default() };
        apply(&mut spec, &first.adopt.iter().collect::<Vec<_>>(), "pods", Timestamp::UNIX_EPOCH, Writer::Operator);
        let adopted = Arc::new(IPBlock::new("v4-10-9-0-0-24", spec.clone()));
        let again = plan(std::slice::from_ref(&web), &pools(), &[adopted], &kinds);
        assert!(again.adopt.is_empty() && again.skipped.len() == 2, "{again:?}");
        let claims = sticky_claims(&again.recorded);
        let claimed: Vec<&str> = claims[0].interface.ips.iter().map(|i| i.ip.as_str()).collect();
        assert_eq!((claimed, claims[0].missing.len()), (vec!["10.9.0.7", "10.9.0.8"], 0), "{claims:?}");
        // An ADD's record of the pod's other IP: not adopted, so no claim of adopt's.
        let mut added = blocks::test::record("uw", "c1");
        added.pod.name = "web-0".into();
        spec.allocations.insert("10.9.0.8".into(), added);
        let mixed = plan(&[web], &pools(), &[Arc::new(IPBlock::new("v4-10-9-0-0-24", spec))], &kinds);
        let recorded: Vec<&str> = mixed.recorded.iter().map(|a| a.ip.as_str()).collect();
        assert_eq!(recorded, ["10.9.0.7"], "only the adopted record is adopt's");
        let missing = &sticky_claims(&mixed.recorded)[0].missing;
        assert_eq!(missing, &["10.9.0.8".parse::<IpAddr>().expect("ip")]);
    }

    #[test]
    fn adopt_takes_over_a_stale_claim_of_an_older_pod_and_leaves_a_live_pods_alone() {
        let mut web = pod("web-0", "uw", &["10.9.0.7"]);
        web.owner = Some(crate::crd::OwnerRef { kind: "StatefulSet".into(), name: "web".into() });
        let planned = plan(&[web], &pools(), &[], &["StatefulSet".to_string()]);
        let claim = &sticky_claims(&planned.adopt)[0];
        let (then, now) = (Timestamp::UNIX_EPOCH, Timestamp::now());
        let adopted = ["uw".to_string()];
        let ClaimWrite::Create(written) = claim.decide(None, &adopted, then) else {
            panic!("a missing claim is created")
        };
        let mut other_interface = written.clone();
        other_interface.interfaces[0].ips[0].ip = "10.9.0.99".into();
        let other = IPClaimSpec { pod_uid: "other".into(), ..other_interface.clone() };
        let taken_over = IPClaimSpec { bound_at: Time(now), ..written.clone() };
        let mut incomplete = claim.clone();
        incomplete.missing = vec!["fd00:9::7".parse().expect("ip")];
        let live = |uids: &[&str]| uids.iter().map(|u| u.to_string()).collect::<Vec<_>>();
        // (case, claim, stored claim, UIDs of the live pods of the claim's name, decision)
        let cases = [
            ("the pod's claim as adopt wrote it", claim, Some(&written), live(&["uw"]), ClaimWrite::Unchanged),
            (
                "the pod's claim with other IPs",
                claim,
                Some(&other_interface),
                live(&["uw"]),
                ClaimWrite::Update(written.clone()),
            ),
            (
                "another UID's claim, the adopted pod live: an older pod's, stale",
                claim,
                Some(&other),
                live(&["uw"]),
                ClaimWrite::TakeOver { stale: "other".into(), spec: taken_over.clone() },
            ),
            (
                "another UID's claim, that pod live: a newer pod's",
                claim,
                Some(&other),
                live(&["other"]),
                ClaimWrite::BoundToLive("other".into()),
            ),
            (
                "another UID's claim, a newer pod live while the adopted one terminates",
                claim,
                Some(&other),
                live(&["uw", "other"]),
                ClaimWrite::BoundToLive("other".into()),
            ),
            (
                "another UID's claim, no pod of that name now",
                claim,
                Some(&other),
                live(&[]),
                ClaimWrite::AdoptedPodGone { bound: "other".into(), live: Vec::new() },
            ),
            (
                "another UID's claim, a third pod of that name now",
                claim,
                Some(&other),
                live(&["third"]),
                ClaimWrite::AdoptedPodGone { bound: "other".into(), live: live(&["third"]) },
            ),
            (
                "a pod not fully adopted",
                &incomplete,
                None,
                live(&["uw"]),
                ClaimWrite::NotAdopted(incomplete.missing.clone()),
            ),
        ];
        let mut actions = BTreeSet::new();
        for (case, claim, stored, live, expected) in cases {
            let decided = claim.decide(stored, &live, now);
            actions.insert(claim.line(&decided, false).action);
            assert_eq!(decided, expected, "{case}");
        }
        assert_eq!(actions.len(), 7, "each of the 7 decisions is said its own way: {actions:#?}");
    }

    #[test]
    fn a_claims_live_pods_are_the_pod_of_its_name_or_its_vms_launcher_pods() {
        let vmi = |name: &str, uid: &str| PodFacts {
            owner: Some(crate::crd::OwnerRef { kind: workload::KUBEVIRT_VMI_KIND.into(), name: "vm1".into() }),
            ..pod(name, uid, &[])
        };
        let other_namespace = PodFacts { namespace: "other".into(), ..pod("web-0", "u-other-ns", &[]) };
        let pods = [
            pod("web-0", "uw", &[]),
            pod("web-1", "u1", &[]),
            other_namespace,
            vmi("virt-launcher-vm1-a", "ua"),
            vmi("virt-launcher-vm1-b", "ub"),
        ];
        assert_eq!(live_uids(&pods, "default", "web-0"), ["uw"]);
        let vm_claim = workload::claim_name("virt-launcher-vm1-a", pods[3].owner.as_ref());
        assert_eq!(live_uids(&pods, "default", &vm_claim), ["ua", "ub"]);
        assert!(live_uids(&pods, "default", "web-2").is_empty());
    }

    #[test]
    fn a_sticky_pod_gets_a_claim_only_when_every_ip_it_reports_is_adopted() {
        let mut web = pod("web-0", "uw", &["10.9.0.7", "fd00:9::7"]);
        web.owner = Some(crate::crd::OwnerRef { kind: "StatefulSet".into(), name: "web".into() });
        let kinds = ["StatefulSet".to_string()];
        let v6_taken = block_holding("v6-fd00-9---120", "fd00:9::7", "ub");
        // (pods, blocks, adoptions kept as written (by IP; None: all), claim written)
        let cases = [
            ("both families adopted", vec![web.clone()], vec![], None, true),
            ("one family refused: recorded for another pod", vec![web.clone()], vec![v6_taken], None, false),
            ("one family lost to a race", vec![web.clone()], vec![], Some("10.9.0.7"), false),
            ("one family outside every pool", vec![pod_like(&web, &["10.9.0.7", "fd00:77::7"])], vec![], None, false),
            (
                "one family reported by another live pod too",
                vec![web.clone(), pod("other", "uo", &["fd00:9::7"])],
                vec![],
                None,
                false,
            ),
        ];
        for (case, pods, blocks, kept, claimed) in cases {
            let planned = plan(&pods, &pools(), &blocks, &kinds);
            let written: Vec<&Adoption> =
                planned.adopt.iter().filter(|a| kept.is_none_or(|ip| a.ip == ip) && a.pod.uid == "uw").collect();
            let claims = sticky_claims(written);
            let created: Vec<bool> = claims
                .iter()
                .map(|c| matches!(c.decide(None, &[], Timestamp::UNIX_EPOCH), ClaimWrite::Create(_)))
                .collect();
            assert_eq!(created, [claimed], "{case}: {claims:?}");
        }
    }

    fn pod_like(pod: &PodFacts, ips: &[&str]) -> PodFacts {
        PodFacts { ips: ips.iter().map(|s| s.to_string()).collect(), ..pod.clone() }
    }

    #[test]
    fn an_ip_outside_every_pool_is_skipped_and_says_so() {
        let plan = plan(&[pod("a", "ua", &["192.168.1.1"])], &pools(), &[], &[]);
        assert!(plan.adopt.is_empty());
        assert_eq!(plan.skipped.len(), 1);
        assert!(plan.skipped[0].reason.contains("outside every pool"), "{:?}", plan.skipped);
    }

    #[test]
    fn an_ip_already_recorded_for_the_same_pod_needs_nothing() {
        let plan =
            plan(&[pod("a", "ua", &["10.9.0.7"])], &pools(), &[block_holding("v4-10-9-0-0-24", "10.9.0.7", "ua")], &[]);
        assert!(plan.adopt.is_empty() && plan.refused.is_empty());
        assert!(plan.skipped[0].reason.contains("already recorded"), "{:?}", plan.skipped);
    }

    #[test]
    fn an_ip_recorded_for_another_pod_is_refused_naming_both() {
        let plan =
            plan(&[pod("a", "ua", &["10.9.0.7"])], &pools(), &[block_holding("v4-10-9-0-0-24", "10.9.0.7", "ub")], &[]);
        assert!(plan.adopt.is_empty());
        assert_eq!(plan.refused.len(), 1);
        assert_eq!(plan.refused[0].pods, ["default/a (ua)", "default/holder-ub (ub)"]);
    }

    #[test]
    fn an_ip_two_live_pods_report_is_refused_naming_both() {
        let plan =
            plan(&[pod("a", "ua", &["10.9.0.7"]), pod("b", "ub", &["10.9.0.7", "10.9.0.8"])], &pools(), &[], &[]);
        assert_eq!(plan.refused.len(), 1, "{plan:?}");
        assert_eq!(plan.refused[0].pods, ["default/a (ua)", "default/b (ub)"]);
        let adopted: Vec<&str> = plan.adopt.iter().map(|a| a.ip.as_str()).collect();
        assert_eq!(adopted, ["10.9.0.8"], "the other IPs are still adopted");
    }

    #[test]
    fn host_network_finished_and_unscheduled_pods_are_ignored() {
        let mut host = pod("host", "uh", &["10.9.0.7"]);
        host.host_network = true;
        let mut done = pod("done", "ud", &["10.9.0.7"]);
        done.phase = Phase::Completed;
        let mut nowhere = pod("nowhere", "un", &["10.9.0.7"]);
        nowhere.node.clear();
        let plan = plan(&[host, done, nowhere, pod("a", "ua", &["10.9.0.7"])], &pools(), &[], &[]);
        let adopted: Vec<&str> = plan.adopt.iter().map(|a| a.pod.name.as_str()).collect();
        assert_eq!(adopted, ["a"], "{plan:?}");
        assert!(plan.refused.is_empty());
    }

    #[test]
    fn an_excluded_ip_is_skipped_and_a_pool_being_deleted_takes_none() {
        let spec: IPPoolSpec =
            serde_json::from_value(serde_json::json!({"cidr": "10.9.0.0/24", "exclude": ["10.9.0.7/32"]}))
                .expect("spec");
        let excluding = Arc::new(IPPool::new("v4", spec));
        let plan_excluded = plan(&[pod("a", "ua", &["10.9.0.7"])], &[excluding], &[], &[]);
        assert!(plan_excluded.skipped[0].reason.contains("never handed out"), "{plan_excluded:?}");
        let mut deleting = IPPool::new("v4", pool("v4", "10.9.0.0/24").spec.clone());
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::UNIX_EPOCH));
        let plan_deleting = plan(&[pod("a", "ua", &["10.9.0.7"])], &[Arc::new(deleting)], &[], &[]);
        assert!(plan_deleting.skipped[0].reason.contains("outside every pool"), "{plan_deleting:?}");
    }

    #[test]
    fn applying_writes_repaired_records_only_on_free_ips_and_claims_a_free_block() {
        let plan = plan(&[pod("a", "ua", &["10.9.0.7", "10.9.0.8"])], &pools(), &[], &[]);
        let mut spec = IPBlockSpec { pool: "v4".into(), cidr: "10.9.0.0/24".into(), ..IPBlockSpec::default() };
        spec.allocations.insert("10.9.0.8".into(), blocks::test::record("raced", "c9"));
        let all: Vec<&Adoption> = plan.adopt.iter().collect();
        let now = Timestamp::UNIX_EPOCH;
        assert_eq!(
            apply(&mut spec, &all, "pods", now, Writer::Operator),
            ["10.9.0.7"],
            "an IP taken since the plan is not overwritten"
        );
        let record = &spec.allocations["10.9.0.7"];
        assert!(blocks::adopted_by(record, Some("ua")) && record.container_id.is_empty(), "{record:?}");
        assert_eq!(record.network, "pods");
        assert_eq!(spec.affinity.as_deref(), Some("node-0"));
        spec.affinity = Some("node-1".into());
        spec.allocations.remove("10.9.0.7");
        apply(&mut spec, &all, "pods", now, Writer::Operator);
        assert_eq!(spec.affinity.as_deref(), Some("node-1"), "a block another node holds keeps its affinity");
    }

    #[test]
    fn an_ip_that_is_a_nodes_spare_is_adopted_and_leaves_the_spares() {
        let plan = plan(&[pod("a", "ua", &["10.9.0.7"])], &pools(), &[], &[]);
        let mut spec = IPBlockSpec { pool: "v4".into(), cidr: "10.9.0.0/24".into(), ..IPBlockSpec::default() };
        spec.affinity = Some("node-1".into());
        spec.spares = ["10.9.0.7", "10.9.0.9"].map(String::from).into();
        let all: Vec<&Adoption> = plan.adopt.iter().collect();
        assert_eq!(apply(&mut spec, &all, "pods", Timestamp::UNIX_EPOCH, Writer::Operator), ["10.9.0.7"]);
        assert!(blocks::adopted_by(&spec.allocations["10.9.0.7"], Some("ua")));
        assert_eq!(spec.spares, ["10.9.0.9".to_string()].into(), "only the adopted IP left the spares");
        assert!(crate::ipam::spares::bindable(&spec).iter().all(|ip| ip.to_string() != "10.9.0.7"));
    }

    #[test]
    fn an_agent_adopting_leaves_another_nodes_spares_and_claims_only_an_empty_block() {
        let plan = plan(&[pod("a", "ua", &["10.9.0.7", "10.9.0.8"])], &pools(), &[], &[]);
        let all: Vec<&Adoption> = plan.adopt.iter().collect();
        let now = Timestamp::UNIX_EPOCH;
        let mut lent = IPBlockSpec { pool: "v4".into(), cidr: "10.9.0.0/24".into(), ..IPBlockSpec::default() };
        lent.affinity = Some("node-1".into());
        lent.spares = ["10.9.0.7".to_string()].into();
        assert_eq!(apply(&mut lent, &all, "pods", now, Writer::Agent), ["10.9.0.8"], "node-1's spare is left to it");
        assert_eq!(lent.spares, ["10.9.0.7".to_string()].into());
        let mut shared = IPBlockSpec { pool: "v4".into(), cidr: "10.9.0.0/24".into(), ..IPBlockSpec::default() };
        let mut theirs = blocks::test::record("theirs", "c9");
        theirs.node = "node-1".into();
        shared.allocations.insert("10.9.0.200".into(), theirs);
        assert_eq!(apply(&mut shared, &all, "pods", now, Writer::Agent).len(), 2);
        assert_eq!(shared.affinity, None, "a block holding node-1's record is not claimed by node-0's agent");
        let mut empty = IPBlockSpec { pool: "v4".into(), cidr: "10.9.0.0/24".into(), ..IPBlockSpec::default() };
        apply(&mut empty, &all, "pods", now, Writer::Agent);
        assert_eq!(empty.affinity.as_deref(), Some("node-0"), "an empty block is claimed");
    }
}
