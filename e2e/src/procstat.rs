//! A process's CPU time and peak resident memory, read from `/proc/<pid>/stat` and
//! `/proc/<pid>/status` (Linux).

use std::path::PathBuf;

use serde::Serialize;

use crate::error::{Error, Result};

/// What a process has used so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Usage {
    /// User plus system CPU time, in seconds.
    pub cpu_seconds: f64,
    /// The peak resident set size (`VmHWM`), in bytes.
    pub peak_rss_bytes: u64,
}

/// Reads the usage of process `pid`.
pub fn usage(pid: u32) -> Result<Usage> {
    let read = |file: &str| {
        let path = PathBuf::from(format!("/proc/{pid}/{file}"));
        std::fs::read_to_string(&path).map_err(Error::io("reading process usage", &path))
    };
    let malformed = |file: &str| Error::Io {
        what: "reading process usage".into(),
        path: PathBuf::from(format!("/proc/{pid}/{file}")),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, "unexpected format"),
    };
    let ticks = cpu_ticks(&read("stat")?).ok_or_else(|| malformed("stat"))?;
    let peak_kib = peak_rss_kib(&read("status")?).ok_or_else(|| malformed("status"))?;
    Ok(Usage { cpu_seconds: ticks as f64 / clock_ticks_per_second()?, peak_rss_bytes: peak_kib * 1024 })
}

/// The kernel's accounting unit for CPU time in `/proc/<pid>/stat` (`CLK_TCK`).
fn clock_ticks_per_second() -> Result<f64> {
    use nix::unistd::{SysconfVar, sysconf};
    match sysconf(SysconfVar::CLK_TCK) {
        Ok(Some(ticks)) if ticks > 0 => Ok(ticks as f64),
        other => Err(Error::Io {
            what: "reading CLK_TCK".into(),
            path: PathBuf::from("sysconf"),
            source: std::io::Error::other(format!("{other:?}")),
        }),
    }
}

/// `utime + stime` (fields 14 and 15) of a `/proc/<pid>/stat` line, in clock ticks. The
/// command name (field 2) is in parentheses and may itself hold spaces and parentheses, so
/// fields are counted from the last `)`.
fn cpu_ticks(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    // After the name: state (field 3) is index 0, so utime (14) is index 11, stime (15) 12.
    let mut fields = after_name.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// `VmHWM` of a `/proc/<pid>/status` file, in KiB.
fn peak_rss_kib(status: &str) -> Option<u64> {
    let line = status.lines().find_map(|line| line.strip_prefix("VmHWM:"))?;
    let mut parts = line.split_whitespace();
    let value = parts.next()?.parse().ok()?;
    (parts.next() == Some("kB")).then_some(value)
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn cpu_ticks_add_utime_and_stime_even_when_the_name_holds_spaces_and_parentheses() {
        let stat = "4242 (ipw (x) d) S 1 4242 4242 0 -1 4194560 1500 0 3 0 731 269 0 0 20 0 9 0 1234 0 0";
        assert_eq!(cpu_ticks(stat), Some(1000));
    }

    #[test]
    fn a_truncated_stat_line_gives_nothing() {
        assert_eq!(cpu_ticks("4242 (ipwarden) S 1 4242"), None);
        assert_eq!(cpu_ticks("no parentheses here"), None);
    }

    #[test]
    fn peak_rss_is_vmhwm_in_kib() {
        let status = "Name:\tipwarden\nVmPeak:\t  900000 kB\nVmHWM:\t   51234 kB\nVmRSS:\t   40000 kB\n";
        assert_eq!(peak_rss_kib(status), Some(51234));
        assert_eq!(peak_rss_kib("Name:\tipwarden\nVmRSS:\t 4 kB\n"), None);
    }

    #[test]
    fn this_process_has_used_some_cpu_and_memory() {
        let usage = usage(std::process::id()).expect("own /proc entry");
        assert!(usage.peak_rss_bytes > 0);
        assert!(usage.cpu_seconds >= 0.0);
    }
}
