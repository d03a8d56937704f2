//! The harness fails fast, names the failing component and its log, and leaves no process
//! behind. Fake binaries stand in for the components here because the failures are the
//! point; every other test runs the real ones.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use e2e::Error;
use e2e::binaries::ControlPlaneBinaries;
use e2e::controlplane::{ControlPlane, ControlPlaneOptions};

fn script(dir: &Path, name: &str, body: &str) {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write fake binary");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod fake binary");
}

/// Body of a fake binary that records its PID beside itself, then runs `then`.
fn recording_pid(name: &str, then: &str) -> String {
    format!("echo $$ > \"$(dirname \"$0\")/{name}.pid\"\n{then}")
}

/// Asserts that every fake binary that recorded a PID in `bin` is gone.
fn assert_no_process_left(bin: &Path) {
    let mut checked = 0;
    for entry in std::fs::read_dir(bin).expect("bin dir").flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "pid") {
            let pid = std::fs::read_to_string(&path).expect("pid file");
            let proc_dir = Path::new("/proc").join(pid.trim());
            assert!(!proc_dir.exists(), "{} (pid {}) outlived the failed start", path.display(), pid.trim());
            checked += 1;
        }
    }
    assert!(checked >= 1, "the fake etcd must have recorded its PID in {}", bin.display());
}

fn fake_control_plane(apiserver_body: &str) -> (tempdir::Dir, ControlPlaneBinaries) {
    let dir = tempdir::Dir::new();
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).expect("bin dir");
    script(&bin, "etcd", &recording_pid("etcd", "exec sleep 600"));
    script(&bin, "kube-apiserver", &recording_pid("kube-apiserver", apiserver_body));
    (dir, ControlPlaneBinaries { dir: bin })
}

#[tokio::test]
async fn an_apiserver_that_exits_fails_start_up_naming_it_and_its_log_and_leaves_no_process() {
    let (dir, binaries) = fake_control_plane("echo 'flag provided but not defined' >&2; exit 3");
    let run = dir.path().join("run");
    let err =
        ControlPlane::start(&run, binaries, &ControlPlaneOptions::default()).await.err().expect("start-up must fail");
    match &err {
        Error::Exited { component, log, .. } => {
            assert_eq!(component, "kube-apiserver");
            let text = std::fs::read_to_string(log).expect("the named log exists");
            assert!(text.contains("flag provided but not defined"), "log holds the component's output: {text}");
        }
        other => panic!("expected Exited, got {other}"),
    }
    assert!(err.to_string().contains("kube-apiserver.log"), "message names the log: {err}");
    assert_no_process_left(&dir.path().join("bin"));
}

#[tokio::test]
async fn an_apiserver_that_never_gets_ready_times_out_naming_it_and_leaves_no_process() {
    let (dir, binaries) = fake_control_plane("exec sleep 600");
    let run = dir.path().join("run");
    let options = ControlPlaneOptions { ready_timeout: Duration::from_secs(2), ..ControlPlaneOptions::default() };
    let err = ControlPlane::start(&run, binaries, &options).await.err().expect("start-up must fail");
    match &err {
        Error::NotReady { component, log, .. } => {
            assert_eq!(component, "kube-apiserver");
            assert!(log.ends_with("kube-apiserver.log"));
        }
        other => panic!("expected NotReady, got {other}"),
    }
    assert_no_process_left(&dir.path().join("bin"));
}

#[tokio::test]
async fn a_missing_binary_fails_start_up_naming_the_component() {
    let binaries = ControlPlaneBinaries { dir: "/nonexistent/ipwarden-k8s".into() };
    let dir = tempdir::Dir::new();
    let err = ControlPlane::start(&dir.path().join("run"), binaries, &ControlPlaneOptions::default())
        .await
        .err()
        .expect("start-up must fail");
    assert!(matches!(&err, Error::Spawn { component, .. } if component == "etcd"), "got {err}");
}

/// A scratch directory removed on drop.
mod tempdir {
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicUsize, Ordering};

    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new() -> Self {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let path = std::env::temp_dir().join(format!(
                "ipwarden-e2e-failure-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&path).expect("scratch dir");
            Self(path)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _removed = std::fs::remove_dir_all(&self.0);
        }
    }
}
