//! One control-plane component process: spawned with its output in a log file, checked for
//! early exit, stopped (or killed for chaos tests) and started again with the same command.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::error::{Error, Result};

/// How long a component gets to exit after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// A running (or stopped) component and the command that starts it.
#[derive(Debug)]
pub struct Component {
    name: String,
    binary: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log: PathBuf,
    child: Option<Child>,
}

impl Component {
    /// Spawns `binary args...`, appending its stdout and stderr to `log`.
    pub fn start(name: &str, binary: &Path, args: Vec<String>, log: PathBuf) -> Result<Self> {
        Self::start_with_env(name, binary, args, Vec::new(), log)
    }

    /// Like [`Component::start`], with extra environment variables.
    pub fn start_with_env(
        name: &str,
        binary: &Path,
        args: Vec<String>,
        env: Vec<(String, String)>,
        log: PathBuf,
    ) -> Result<Self> {
        let mut component = Self { name: name.to_string(), binary: binary.to_path_buf(), args, env, log, child: None };
        component.spawn()?;
        Ok(component)
    }

    fn spawn(&mut self) -> Result<()> {
        let open = || {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.log)
                .map_err(Error::io(format!("opening the log of {}", self.name), &self.log))
        };
        let (stdout, stderr) = (open()?, open()?);
        let child = Command::new(&self.binary)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .map_err(|source| Error::Spawn { component: self.name.clone(), binary: self.binary.clone(), source })?;
        tracing::debug!(component = %self.name, pid = child.id(), log = %self.log.display(), "started");
        self.child = Some(child);
        Ok(())
    }

    /// The component's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The component's log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// The process ID while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Fails with [`Error::Exited`] when the process has exited (or was never running).
    pub fn ensure_running(&mut self) -> Result<()> {
        let status = match self.child.as_mut() {
            None => "not running".to_string(),
            Some(child) => match child.try_wait() {
                Ok(None) => return Ok(()),
                Ok(Some(status)) => status.to_string(),
                Err(e) => format!("unknown: {e}"),
            },
        };
        Err(Error::Exited { component: self.name.clone(), status, log: self.log.clone() })
    }

    /// Sends SIGKILL and reaps the process: a crash, for chaos tests.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(&child, Signal::SIGKILL);
            let _reaped = child.wait();
        }
    }

    /// Freezes the process with SIGSTOP (a hung process: connections stay open, nothing is
    /// answered) until [`Component::resume`].
    pub fn pause(&self) {
        if let Some(child) = self.child.as_ref() {
            signal(child, Signal::SIGSTOP);
        }
    }

    /// Lets a process frozen by [`Component::pause`] run again (SIGCONT).
    pub fn resume(&self) {
        if let Some(child) = self.child.as_ref() {
            signal(child, Signal::SIGCONT);
        }
    }

    /// Starts the same command again after [`Component::kill`] or [`Component::stop`].
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.spawn()
    }

    /// Sends SIGTERM, waits up to [`STOP_GRACE`], then SIGKILL; always reaps the process.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        signal(&child, Signal::SIGTERM);
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        tracing::warn!(component = %self.name, "did not exit on SIGTERM; killing it");
        signal(&child, Signal::SIGKILL);
        let _reaped = child.wait();
    }
}

fn signal(child: &Child, signal: Signal) {
    let Ok(pid) = i32::try_from(child.id()) else { return };
    if let Err(e) = kill(Pid::from_raw(pid), signal) {
        tracing::debug!(pid, %signal, error = %e, "signal not delivered (process already gone?)");
    }
}

impl Drop for Component {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Where [`free_port`] picks ports: below Linux's default ephemeral range (32768-60999), so
/// the source port of an outgoing connection (of which a test cluster makes many) never takes
/// a port between its reservation and its component binding it.
const PORT_RANGE: std::ops::Range<u16> = 20000..32768;

/// How many ports this process has handed out: each is handed out once.
static PORTS_HANDED_OUT: AtomicU32 = AtomicU32::new(0);

/// Reserves a free TCP port on 127.0.0.1 for a component to bind: the next port of
/// [`PORT_RANGE`] (from a per-process starting point) that binds now. A port is never handed
/// out twice by one process. Should another process still take it first, the component exits
/// with "address already in use" in its log, which [`Component::ensure_running`] reports.
pub fn free_port() -> Result<u16> {
    static START: OnceLock<u32> = OnceLock::new();
    let span = u32::from(PORT_RANGE.end - PORT_RANGE.start);
    let start = *START.get_or_init(|| {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        std::process::id().wrapping_mul(7919).wrapping_add(nanos) % span
    });
    for _ in 0..span {
        let offset = (start + PORTS_HANDED_OUT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = PORT_RANGE.start + u16::try_from(offset).unwrap_or(0);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(Error::Port(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("no free port left in 127.0.0.1:{}-{}", PORT_RANGE.start, PORT_RANGE.end - 1),
    )))
}

/// Runs a short-lived tool (helm, kubectl, promtool) to completion with `stdin` as its input
/// and returns its standard output; a non-zero exit fails with its error output.
pub async fn run_tool(program: &Path, args: &[String], stdin: Option<&[u8]>) -> Result<String> {
    use tokio::io::AsyncWriteExt;
    let name = program.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let command = std::iter::once(name.as_str()).chain(args.iter().take(3).map(String::as_str)).collect::<Vec<_>>();
    let command = command.join(" ");
    let mut child = tokio::process::Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| Error::Spawn { component: name.clone(), binary: program.to_path_buf(), source })?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input).await.map_err(|e| Error::Tool { command: command.clone(), reason: e.to_string() })?;
    }
    let output =
        child.wait_with_output().await.map_err(|e| Error::Tool { command: command.clone(), reason: e.to_string() })?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if output.status.success() {
        Ok(stdout)
    } else {
        let stderr = String::from_utf8_lossy(&output.stderr);
        Err(Error::Tool { command, reason: format!("{}: {}{}", output.status, stderr.trim(), stdout.trim()) })
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| free_port().expect("a free port")).collect();
        let distinct: std::collections::BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "no port handed out twice: {ports:?}");
        for port in ports {
            assert!(PORT_RANGE.contains(&port), "{port} is below the ephemeral range");
            std::net::TcpListener::bind(("127.0.0.1", port)).expect("the reserved port binds");
        }
    }
}
