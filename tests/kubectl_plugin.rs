//! `kubectl ipwarden`: the real kubectl (built with the control plane) finds the binary on
//! PATH as `kubectl-ipwarden` and runs `status`, `check` and `gc` with kubectl's usual
//! `--kubeconfig`, `--context` and `-n` flags, which the plugin itself must honour (kubectl
//! passes everything after the plugin name through).

mod support;

use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::{Value, json};
use support::{Ipwarden, create_pod, wait_pods_with_ips};

/// Runs `kubectl ipwarden <args>` with `dir` (holding the `kubectl-ipwarden` link) first on
/// PATH and `kubeconfig_env` as KUBECONFIG (or none).
fn kubectl_ipwarden(ipwarden: &Ipwarden, dir: &Path, kubeconfig_env: Option<&Path>, args: &[&str]) -> Output {
    let path = format!("{}:{}", dir.display(), std::env::var("PATH").unwrap_or_default());
    let mut command = std::process::Command::new(ipwarden.cluster.kubectl());
    command.arg("ipwarden").args(args).env("PATH", path).env_remove("IPWARDEN_NAMESPACE");
    match kubeconfig_env {
        Some(file) => command.env("KUBECONFIG", file),
        None => command.env_remove("KUBECONFIG"),
    };
    command.output().expect("kubectl runs")
}

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// A kubeconfig with two contexts on the cluster's admin credentials: `live` (the cluster,
/// default namespace `elsewhere`) and `dead` (a port nothing listens on), which is current.
fn two_context_kubeconfig(ipwarden: &Ipwarden) -> PathBuf {
    let admin: Value =
        serde_json::from_str(&std::fs::read_to_string(ipwarden.cluster.kubeconfig()).expect("admin kubeconfig"))
            .expect("kubeconfig JSON");
    let cluster = admin["clusters"][0]["cluster"].clone();
    let user = admin["users"][0].clone();
    let dead_port = e2e::process::free_port().expect("free port");
    let mut dead = cluster.clone();
    dead["server"] = json!(format!("https://127.0.0.1:{dead_port}"));
    let kubeconfig = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "live", "cluster": cluster}, {"name": "dead", "cluster": dead}],
        "users": [user.clone()],
        "contexts": [
            {"name": "live", "context": {"cluster": "live", "user": user["name"], "namespace": "elsewhere"}},
            {"name": "dead", "context": {"cluster": "dead", "user": user["name"]}},
        ],
        "current-context": "dead",
    });
    let path = ipwarden.cluster.dir().join("two-contexts.kubeconfig");
    std::fs::write(&path, serde_json::to_string_pretty(&kubeconfig).expect("kubeconfig")).expect("write kubeconfig");
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_ipwarden_status_check_and_gc_use_the_kubeconfig_context_and_namespace_given_to_kubectl() {
    let mut ipwarden = Ipwarden::start(1, &[("pool", json!({"cidr": "10.95.0.0/24", "default": true}))], &[]).await;
    let client = ipwarden.client();
    let controller = ipwarden.start_controller("plugin", &["--full-scan-interval-seconds=3600"]);
    ipwarden.wait_leader(controller).await;
    create_pod(&client, "default", "a", "node-0", json!({"app": "plugin"})).await;
    wait_pods_with_ips(&client, "default", "app=plugin", 1).await;
    let plugins = ipwarden.cluster.dir().join("plugins");
    std::fs::create_dir_all(&plugins).expect("plugin dir");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_ipwarden"), plugins.join("kubectl-ipwarden")).expect("link");
    let file = two_context_kubeconfig(&ipwarden);
    let file_flag = format!("--kubeconfig={}", file.display());
    let run = |env: Option<&Path>, args: &[&str]| kubectl_ipwarden(&ipwarden, &plugins, env, args);

    let help = run(None, &["--help"]);
    assert!(
        help.status.success() && text(&help).contains("kubectl ipwarden"),
        "help names the plugin: {}",
        text(&help)
    );

    let status = run(None, &["status", &file_flag, "--context", "live", "-o", "json"]);
    assert!(status.status.success(), "status on context live: {}", text(&status));
    let status: Value = serde_json::from_slice(&status.stdout).expect("status JSON");
    assert_eq!(status["summary"][0]["counts"]["used"], 1, "the live cluster's pod: {status}");

    let check = run(None, &[&file_flag, "--context=live", "check"]);
    assert!(check.status.success(), "flags before the subcommand work too: {}", text(&check));
    assert!(text(&check).contains("no problem found"));

    let from_env = run(Some(&file), &["status", "--context", "live"]);
    assert!(from_env.status.success(), "KUBECONFIG is honoured: {}", text(&from_env));

    let current = run(None, &["status", &file_flag]);
    assert!(!current.status.success(), "the current context (dead) is used without --context: {}", text(&current));

    let unknown = run(None, &["status", &file_flag, "--context", "nope"]);
    let message = text(&unknown);
    assert!(!unknown.status.success(), "an unknown context fails");
    assert!(
        message.contains("\"nope\"") && message.contains(&file.display().to_string()),
        "the error names the context and the file: {message}"
    );

    let wrong_namespace = run(None, &["gc", "--dry-run", &file_flag, "--context", "live", "--timeout-seconds", "5"]);
    let message = text(&wrong_namespace);
    assert!(!wrong_namespace.status.success(), "the context's namespace has no controller");
    assert!(message.contains("elsewhere"), "without -n, gc uses the context's namespace: {message}");
    let dry_run = run(None, &["gc", "--dry-run", &file_flag, "--context", "live", "-n", "default", "-o", "json"]);
    assert!(dry_run.status.success(), "-n names the controller's namespace: {}", text(&dry_run));
    let plan: Value = serde_json::from_slice(&dry_run.stdout).expect("dry-run JSON");
    assert_eq!(plan["changes"], json!([]), "nothing to change: {plan}");
}
