//! Garbage collection of the standard `host-local` IPAM plugin's reservations, for nodes that
//! run it beside (or before) ipwarden. Its store is a directory per network holding one file
//! per reserved IP (content: the container ID, and since plugins 1.0 a `\r\n` and the interface
//! name), plus `lock` and `last_reserved_ip.*`. Collection takes the plugin's own lock (flock
//! on `lock`), so it never races an ADD or DEL of the plugin.

use std::collections::HashSet;
use std::fs::File;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use nix::fcntl::{Flock, FlockArg};

/// Why the store could not be collected.
#[derive(Debug, thiserror::Error)]
pub enum HostLocalError {
    /// A file operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// The operation.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The plugin's lock could not be taken.
    #[error("locking {path}: {source}")]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// The OS error.
        source: nix::errno::Errno,
    },
}

/// One reservation file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// The reserved IP (the file's name).
    pub ip: IpAddr,
    /// The container ID the file holds.
    pub container_id: String,
    /// The interface name, when the file holds one (plugins 1.0 and later).
    pub ifname: Option<String>,
    /// The file.
    pub path: PathBuf,
    /// When it was written.
    pub modified: SystemTime,
}

/// Parses a reservation file's content: `<container ID>[\r\n<ifname>]`.
pub fn parse_content(content: &str) -> (String, Option<String>) {
    let mut lines = content.split(['\r', '\n']).filter(|l| !l.trim().is_empty());
    let container = lines.next().unwrap_or_default().trim().to_string();
    let ifname = lines.next().map(|l| l.trim().to_string());
    (container, ifname)
}

/// The reservations that may go: not reported by any live pod of the node, and older than
/// `min_age` (an ADD in flight has reserved its IP before the pod's status shows it).
pub fn stale<'a>(
    reservations: &'a [Reservation],
    live: &HashSet<IpAddr>,
    now: SystemTime,
    min_age: Duration,
) -> Vec<&'a Reservation> {
    reservations
        .iter()
        .filter(|r| !live.contains(&r.ip))
        .filter(|r| now.duration_since(r.modified).is_ok_and(|age| age >= min_age))
        .collect()
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> HostLocalError + 'a {
    move |source| HostLocalError::Io { what, path: path.to_path_buf(), source }
}

/// Reads every reservation of the network directory `dir`, skipping `lock`,
/// `last_reserved_ip.*` and anything not named like an IP.
pub fn read(dir: &Path) -> Result<Vec<Reservation>, HostLocalError> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io("reading the host-local store", dir))? {
        let entry = entry.map_err(io("reading the host-local store", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Ok(ip) = name.parse::<IpAddr>() else { continue };
        let path = entry.path();
        let content = std::fs::read_to_string(&path).map_err(io("reading", &path))?;
        let modified = entry.metadata().and_then(|m| m.modified()).map_err(io("reading the time of", &path))?;
        let (container_id, ifname) = parse_content(&content);
        found.push(Reservation { ip, container_id, ifname, path, modified });
    }
    found.sort_by_key(|r| r.ip);
    Ok(found)
}

/// Collects the store of network `network` under `data_dir`: under the plugin's lock,
/// removes (unless `dry_run`) and returns the stale reservations.
pub fn collect(
    data_dir: &Path,
    network: &str,
    live: &HashSet<IpAddr>,
    min_age: Duration,
    dry_run: bool,
) -> Result<Vec<Reservation>, HostLocalError> {
    let dir = data_dir.join(network);
    let lock_path = dir.join("lock");
    let lock_file = File::options().create(true).append(true).open(&lock_path).map_err(io("opening", &lock_path))?;
    let _lock = Flock::lock(lock_file, FlockArg::LockExclusive)
        .map_err(|(_, source)| HostLocalError::Lock { path: lock_path.clone(), source })?;
    let reservations = read(&dir)?;
    let doomed: Vec<Reservation> =
        stale(&reservations, live, SystemTime::now(), min_age).into_iter().cloned().collect();
    if !dry_run {
        for reservation in &doomed {
            std::fs::remove_file(&reservation.path).map_err(io("removing", &reservation.path))?;
        }
    }
    Ok(doomed)
}

/// The IPs the pods of `node` report that have not finished, terminating or not (a
/// draining pod still serves from its IP).
pub async fn live_ips_on_node(client: &kube::Client, node: &str) -> Result<HashSet<IpAddr>, kube::Error> {
    let params = kube::api::ListParams::default().fields(&format!("spec.nodeName={node}"));
    let pods = kube::Api::<k8s_openapi::api::core::v1::Pod>::all(client.clone()).list(&params).await?;
    Ok(pods
        .items
        .iter()
        .map(crate::gc::index::PodFacts::of)
        .filter(|facts| !facts.finished())
        .flat_map(|facts| facts.ips)
        .filter_map(|ip| ip.parse().ok())
        .collect())
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn both_file_formats_parse() {
        assert_eq!(parse_content("abc\r\neth0"), ("abc".to_string(), Some("eth0".to_string())));
        assert_eq!(parse_content("abc"), ("abc".to_string(), None), "files of old plugins hold only the container ID");
        assert_eq!(parse_content("abc\n"), ("abc".to_string(), None));
    }

    #[test]
    fn only_old_reservations_no_live_pod_reports_are_stale() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(10_000);
        let at = |secs_ago| now - Duration::from_secs(secs_ago);
        let reservation = |ip: &str, age| Reservation {
            ip: ip.parse().expect("ip"),
            container_id: "c".into(),
            ifname: None,
            path: PathBuf::from(ip),
            modified: at(age),
        };
        let all = [reservation("10.0.0.2", 600), reservation("10.0.0.3", 600), reservation("10.0.0.4", 10)];
        let live: HashSet<IpAddr> = ["10.0.0.2".parse().expect("ip")].into_iter().collect();
        let stale: Vec<String> =
            stale(&all, &live, now, Duration::from_secs(300)).iter().map(|r| r.ip.to_string()).collect();
        assert_eq!(stale, ["10.0.0.3"], "live and young reservations stay");
    }
}
