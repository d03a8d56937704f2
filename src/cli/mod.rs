//! The operator CLI: commands that read (and, for `gc`, ask the leader to change; for
//! `adopt`, write records into) the cluster with the user's kubeconfig. Tables for people,
//! `-o json` for scripts.

pub mod adopt;
pub mod check;
pub mod connect;
pub mod gc;
pub mod status;

use std::sync::Arc;

use anyhow::Context;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use kube::{Client, Resource};

use crate::crd::{IPBlock, IPClaim, IPPool};
use crate::gc::index::{ClusterIndex, Watched};
use crate::ipam::workload::DEFAULT_STICKY_KINDS;

/// Lists every object of kind `K` in the cluster.
pub async fn list<K>(client: &Client) -> anyhow::Result<Vec<Arc<K>>>
where
    K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    let api: Api<K> = Api::all(client.clone());
    let items = api.list(&ListParams::default()).await.with_context(|| format!("listing {}", K::plural(&())))?;
    Ok(items.items.into_iter().map(Arc::new).collect())
}

/// The cluster's IPAM state as listed now, with the controller's index of it.
pub struct Listed {
    /// Every pod.
    pub pods: Vec<Arc<Pod>>,
    /// Every claim.
    pub claims: Vec<Arc<IPClaim>>,
    /// Every pool.
    pub pools: Vec<Arc<IPPool>>,
    /// Every block.
    pub blocks: Vec<Arc<IPBlock>>,
    /// The index the controller would hold of these objects (with the default sticky kinds).
    pub index: ClusterIndex,
}

/// Lists the cluster's pods, nodes, claims, StatefulSets, pools and blocks and indexes them.
pub async fn list_cluster(client: &Client) -> anyhow::Result<Listed> {
    let (pods, nodes) = (list::<Pod>(client).await?, list::<Node>(client).await?);
    let (claims, statefulsets) = (list::<IPClaim>(client).await?, list::<StatefulSet>(client).await?);
    let (pools, blocks) = (list::<IPPool>(client).await?, list::<IPBlock>(client).await?);
    let sticky: Vec<String> = DEFAULT_STICKY_KINDS.iter().map(|k| k.to_string()).collect();
    let objects = pods
        .iter()
        .map(|o| Watched::Pod(o))
        .chain(nodes.iter().map(|o| Watched::Node(o)))
        .chain(claims.iter().map(|o| Watched::Claim(o)))
        .chain(statefulsets.iter().map(|o| Watched::StatefulSet(o)))
        .chain(pools.iter().map(Watched::Pool))
        .chain(blocks.iter().map(Watched::Block));
    let index = ClusterIndex::from_objects(&sticky, objects);
    Ok(Listed { pods, claims, pools, blocks, index })
}

/// The operator commands, the same under `ipwarden` and `kubectl ipwarden`.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum Command {
    /// Ask the leading controller for a full sweep (or, with --dry-run, list what it would do).
    Gc(gc::GcArgs),
    /// Used, reserved, sticky, cooling and leak-candidate IPs per pool and node.
    Status(status::StatusArgs),
    /// Consistency report; exit status 1 when a problem is found.
    Check(check::CheckArgs),
    /// Record the IPs that running pods got from another IPAM inside ipwarden's pools;
    /// exit status 1 when an IP was refused.
    Adopt(adopt::AdoptArgs),
}

impl Command {
    /// Runs the command; returns whether it found the cluster consistent (only `check` can
    /// say it did not, and `adopt` when it refused an IP).
    pub async fn run(self) -> anyhow::Result<bool> {
        match self {
            Command::Gc(args) => gc::run(args).await.map(|()| true),
            Command::Status(args) => status::run(args).await.map(|()| true),
            Command::Check(args) => check::run(args).await,
            Command::Adopt(args) => adopt::run(args).await,
        }
    }
}

/// Output format of CLI commands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// Aligned columns for people.
    Table,
    /// JSON for scripts.
    Json,
}

/// Renders rows as aligned columns under `headers`.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.len());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        padded.join("  ").trim_end().to_string()
    };
    let mut out = line(headers.to_vec());
    out.push('\n');
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod test {
    #[test]
    fn tables_align_columns_to_the_widest_cell() {
        let text =
            super::table(&["IP", "POD"], &[vec!["10.0.0.10".into(), "a".into()], vec!["1.1".into(), "bb".into()]]);
        assert_eq!(text, "IP         POD\n10.0.0.10  a\n1.1        bb\n");
    }
}
