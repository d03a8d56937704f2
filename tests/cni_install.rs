//! The chart's CNI installer (the agent DaemonSet's init container `install-cni`), run as the
//! chart renders it, with Debian's shell and tools as the image has them, while ADDs execute
//! the plugin it replaces: a runtime never runs a half-written plugin, an ADD never fails
//! because the plugin is being replaced ("text file busy"), the conflist is the chart's, and a
//! second run changes nothing and leaves no temporary file behind.

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use e2e::cni::{Invocation, PodArgs};
use e2e::helm::Helm;
use serde_json::json;
use support::Ipwarden;

/// The init container's script and the conflist, as `helm template` renders them.
async fn rendered_installer() -> (String, String) {
    let helm = Helm::locate().expect("helm builds");
    let shown = ["templates/agent-daemonset.yaml", "templates/cni-configmap.yaml"];
    let documents = helm.template("ipwarden", "ipwarden-system", &[], &shown).await.expect("helm template");
    let daemonset = documents.iter().find(|d| d["kind"] == "DaemonSet").expect("the agent DaemonSet");
    let init = &daemonset["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(init["name"], "install-cni", "{init:#}");
    assert_eq!(init["command"], json!(["/bin/sh", "-ec"]), "{init:#}");
    let script = init["args"][0].as_str().expect("the script").to_string();
    let configmap = documents.iter().find(|d| d["kind"] == "ConfigMap").expect("the conflist's ConfigMap");
    let conflist = configmap["data"]["conflist"].as_str().expect("the conflist").to_string();
    (script, conflist)
}

/// A root for the installer: this Debian host's `/usr` (the image's base is the same Debian
/// release, whose coreutils and dash the script runs with) and the init container's mounts,
/// bound in a mount namespace of its own for each run.
struct InstallerRoot {
    /// The directory the runs chroot into.
    root: PathBuf,
    /// What `/usr/local/bin` holds in the container: `ipwarden`, the plugin to install.
    image_bin: PathBuf,
    /// The conflist's ConfigMap, mounted at `/etc/ipwarden/cni`.
    conflist_dir: PathBuf,
}

impl InstallerRoot {
    fn new(dir: &Path, conflist: &str) -> Self {
        let root = dir.join("root");
        for path in
            ["usr/bin", "usr/lib", "usr/lib64", "usr/local/bin", "host/cni-bin", "host/cni-conf", "etc/ipwarden/cni"]
        {
            std::fs::create_dir_all(root.join(path)).expect("a directory of the root");
        }
        for (link, target) in [("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")] {
            std::os::unix::fs::symlink(target, root.join(link)).expect("a merged-/usr link");
        }
        let (image_bin, conflist_dir) = (dir.join("image-bin"), dir.join("conflist"));
        std::fs::create_dir_all(&image_bin).expect("the image's bin");
        std::fs::create_dir_all(&conflist_dir).expect("the ConfigMap's directory");
        std::fs::write(conflist_dir.join("conflist"), conflist).expect("the conflist");
        Self { root, image_bin, conflist_dir }
    }

    /// Runs `script` as the init container does, installing into `bin_dir` and `conf_dir`.
    fn run(&self, script: &str, bin_dir: &Path, conf_dir: &Path) -> Result<(), String> {
        let root = self.root.display();
        let binds = [
            ("/usr/bin".into(), "usr/bin"),
            ("/usr/lib".into(), "usr/lib"),
            ("/usr/lib64".into(), "usr/lib64"),
            (self.image_bin.clone(), "usr/local/bin"),
            (self.conflist_dir.clone(), "etc/ipwarden/cni"),
            (bin_dir.to_path_buf(), "host/cni-bin"),
            (conf_dir.to_path_buf(), "host/cni-conf"),
        ];
        let mounts: Vec<String> =
            binds.iter().map(|(from, to)| format!("mount --bind '{}' '{root}/{to}'", from.display())).collect();
        let inner = format!("set -e; {}; exec chroot '{root}' /bin/sh -ec \"$INSTALLER\"", mounts.join("; "));
        let output = std::process::Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--fork", "/bin/sh", "-c", &inner])
            .env("INSTALLER", script)
            .output()
            .map_err(|e| format!("running unshare: {e}"))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(format!("{}: {}", output.status, String::from_utf8_lossy(&output.stderr)))
        }
    }
}

/// `binary`, with `padding` bytes after it: a different file that runs the same (the ELF
/// loader reads only what the program headers name).
fn plugin_version(binary: &Path, padding: usize) -> Vec<u8> {
    let mut bytes = std::fs::read(binary).expect("the ipwarden binary");
    bytes.extend(std::iter::repeat_n(0u8, padding));
    bytes
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("read the directory")
        .map(|e| e.expect("an entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_installer_swaps_the_plugin_under_concurrent_adds_with_none_failing_and_runs_again_idempotently() {
    let (script, conflist) = rendered_installer().await;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("cni-install-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (bin_dir, conf_dir) = (dir.join("cni-bin"), dir.join("cni-conf"));
    std::fs::create_dir_all(&bin_dir).expect("bin dir");
    std::fs::create_dir_all(&conf_dir).expect("conf dir");
    let installer = InstallerRoot::new(&dir, &conflist);
    let binary = Path::new(env!("CARGO_BIN_EXE_ipwarden"));
    let ipwarden_in_image = installer.image_bin.join("ipwarden");
    std::fs::write(&ipwarden_in_image, plugin_version(binary, 0)).expect("the image's ipwarden");
    std::fs::set_permissions(&ipwarden_in_image, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("mode");

    installer.run(&script, &bin_dir, &conf_dir).expect("the first install");
    assert_eq!(entries(&bin_dir), ["ipwarden-cni"], "only the plugin, no temporary file");
    assert_eq!(entries(&conf_dir), ["10-ipwarden.conflist"], "only the conflist, no temporary file");
    let installed_conflist = std::fs::read_to_string(conf_dir.join("10-ipwarden.conflist")).expect("conflist");
    assert_eq!(installed_conflist, conflist, "the chart's conflist");

    // ADDs (and DELs) through the installed plugin, two at a time, while the installer replaces it.
    let pool = json!({"cidr": "10.87.0.0/24", "default": true});
    let ipwarden = Ipwarden::start(1, &[("pool", pool)], &[]).await;
    let client = ipwarden.client();
    let mut network = support::network();
    network.plugin_dirs = vec![bin_dir.clone()];
    let conf = json!({"cniVersion": "1.1.0", "name": "ipwarden", "type": "ipwarden-cni",
                      "socket": e2e::ipwarden::agent_socket(&ipwarden.cluster, 0)});
    let pods = ["swap-a", "swap-b"];
    let mut args = Vec::new();
    for name in pods {
        support::create_pod(&client, "default", name, "elsewhere", json!({"app": "swap"})).await;
        let pod = kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), "default")
            .get(name)
            .await
            .expect("pod");
        args.push(PodArgs {
            namespace: "default".into(),
            name: name.into(),
            uid: kube::ResourceExt::uid(&pod).unwrap_or_default(),
        });
    }
    let stop = Arc::new(AtomicBool::new(false));
    let adds = Arc::new(AtomicUsize::new(0));
    let mut callers = Vec::new();
    for pod in args {
        let (network, conf, stop, adds) = (network.clone(), conf.clone(), stop.clone(), adds.clone());
        callers.push(tokio::spawn(async move {
            let mut failures: Vec<String> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                for command in ["ADD", "DEL"] {
                    let call = Invocation {
                        command,
                        container_id: &pod.name,
                        ifname: "eth0",
                        pod: Some(&pod),
                        netconf: &conf,
                    };
                    match network.invoke(&call).await {
                        Ok(result) if command == "ADD" => {
                            let ip = result.as_ref().and_then(|r| r["ips"][0]["address"].as_str().map(str::to_string));
                            if ip.is_none() {
                                failures.push(format!("ADD of {} answered no IP: {result:?}", pod.name));
                            }
                            adds.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(_) => {}
                        Err(e) => failures.push(format!("{command} of {}: {e}", pod.name)),
                    }
                }
            }
            failures
        }));
    }
    let before = adds.load(Ordering::Relaxed);
    let rounds = 20;
    let installer = Arc::new(installer);
    for round in 1..=rounds {
        // Each round installs a plugin that differs from the one installed, so it is replaced.
        std::fs::write(&ipwarden_in_image, plugin_version(binary, round * 4096)).expect("the image's new ipwarden");
        let (run_installer, run_script, run_bin, run_conf) =
            (installer.clone(), script.clone(), bin_dir.clone(), conf_dir.clone());
        tokio::task::spawn_blocking(move || run_installer.run(&run_script, &run_bin, &run_conf))
            .await
            .expect("the installer's task")
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        let installed = std::fs::metadata(bin_dir.join("ipwarden-cni")).expect("the plugin").len();
        assert_eq!(
            installed,
            std::fs::metadata(binary).expect("binary").len() + (round * 4096) as u64,
            "round {round}"
        );
    }
    let during = adds.load(Ordering::Relaxed) - before;
    stop.store(true, Ordering::Relaxed);
    let mut failures = Vec::new();
    for caller in callers {
        failures.extend(caller.await.expect("a caller"));
    }
    assert!(failures.is_empty(), "{} calls failed while the plugin was replaced: {failures:#?}", failures.len());
    assert!(during >= rounds, "the ADDs ran while the installer did: {during} in {rounds} rounds");

    // Run again with nothing changed: nothing is rewritten.
    let inode = |path: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(path).expect("metadata"));
    let (plugin, conflist_file) = (bin_dir.join("ipwarden-cni"), conf_dir.join("10-ipwarden.conflist"));
    let (plugin_inode, conflist_inode) = (inode(&plugin), inode(&conflist_file));
    installer.run(&script, &bin_dir, &conf_dir).expect("a second run");
    assert_eq!((inode(&plugin), inode(&conflist_file)), (plugin_inode, conflist_inode), "nothing rewritten");
    assert_eq!(entries(&bin_dir), ["ipwarden-cni"]);
    assert_eq!(entries(&conf_dir), ["10-ipwarden.conflist"]);
    drop(ipwarden);
    std::fs::remove_dir_all(&dir).expect("remove the test's directory");
}
