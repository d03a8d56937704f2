//! Invoking a CNI plugin exactly as a container runtime does: the `CNI_*` environment,
//! the network configuration on stdin, the result or an error object on stdout.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;

use crate::error::{Error, Result};

/// How long one plugin invocation may take before the runtime gives up on it.
const PLUGIN_TIMEOUT: Duration = Duration::from_secs(60);

/// The interface name the simulated runtime gives every pod's network attachment.
pub const POD_IFNAME: &str = "eth0";

/// What a node's network configuration may depend on.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    /// The Node's name.
    pub name: String,
    /// The node's position in the cluster, from 0.
    pub index: usize,
    /// A directory private to this node (plugin state such as host-local's data dir).
    pub dir: PathBuf,
}

/// Builds the netconf for one node.
pub type NetconfFn = Arc<dyn Fn(&NodeInfo) -> Value + Send + Sync>;

/// Builds the extra environment variables of the plugin on one node.
pub type NodeEnvFn = Arc<dyn Fn(&NodeInfo) -> Vec<(String, String)> + Send + Sync>;

/// A CNI network as the simulated runtime sees it.
#[derive(Clone)]
pub struct CniNetwork {
    /// The `CNI_PATH` directories, searched for the plugin named by the netconf's `type`.
    pub plugin_dirs: Vec<PathBuf>,
    /// The network configuration given to the plugin on each node.
    pub netconf: NetconfFn,
    /// When each node's runtime calls the CNI 1.1 GC verb with its live attachments.
    pub runtime_gc: RuntimeGc,
    /// When set, the NetworkAttachmentDefinition (`namespace/name`) each Running pod's
    /// [`NETWORK_STATUS_ANNOTATION`] names with the pod's IPs, as Multus writes it: IPAMs
    /// whose controllers read that annotation (Whereabouts) need it to see which IPs are used.
    pub network_status: Option<String>,
    /// When set, environment variables the plugin gets on each node besides the `CNI_*` ones,
    /// as its host would give them: simulated nodes share one host, so a plugin that names its
    /// node by the host (Whereabouts' node slices: `NODENAME` or `/etc/hostname`) needs it.
    pub node_env: Option<NodeEnvFn>,
}

/// When a simulated node's runtime calls the CNI 1.1 GC verb, as the real runtimes do
/// (docs/testing.md, "Simulated nodes"). `never`, `startup` or a number of seconds on the
/// command line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RuntimeGc {
    /// Never: containerd, which calls CNI GC in no release up to 2.4 (containerd/go-cni PR
    /// #131, open since 2025-10), the runtime of kubeadm, kind, EKS, GKE and AKS.
    #[default]
    Never,
    /// Once when the node's runtime starts, listing the sandboxes it has then: CRI-O 1.32 and
    /// later. Here: once the plugin first answers it, since the harness starts its nodes before
    /// the IPAM under test.
    Startup,
    /// Every so often: no runtime does; the harness's only way before issue 24, kept for the
    /// tests of the GC verb itself.
    Every(Duration),
}

impl std::str::FromStr for RuntimeGc {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<Self, Self::Err> {
        match text {
            "never" => Ok(Self::Never),
            "startup" => Ok(Self::Startup),
            seconds => match seconds.parse::<u64>() {
                Ok(n) if n > 0 => Ok(Self::Every(Duration::from_secs(n))),
                _ => Err(format!(
                    "runtime GC {text:?}: expected never (containerd), startup (CRI-O) or a number of seconds above 0"
                )),
            },
        }
    }
}

impl std::fmt::Display for RuntimeGc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Never => write!(f, "never"),
            Self::Startup => write!(f, "startup"),
            Self::Every(interval) => write!(f, "{}", interval.as_secs()),
        }
    }
}

/// The pod annotation Multus writes with each attachment's network and IPs.
pub const NETWORK_STATUS_ANNOTATION: &str = "k8s.v1.cni.cncf.io/network-status";

/// The [`NETWORK_STATUS_ANNOTATION`] value of a pod attached to `network` on `ifname` with
/// `ips`, as a secondary (non-default) network, the way Multus records it.
pub fn network_status(network: &str, ifname: &str, ips: &[String]) -> String {
    json!([{"name": network, "interface": ifname, "ips": ips, "default": false}]).to_string()
}

impl std::fmt::Debug for CniNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CniNetwork")
            .field("plugin_dirs", &self.plugin_dirs)
            .field("runtime_gc", &self.runtime_gc)
            .field("network_status", &self.network_status)
            .field("node_env", &self.node_env.is_some())
            .finish_non_exhaustive()
    }
}

impl CniNetwork {
    /// The standard `host-local` IPAM plugin called directly, each node with its own /24
    /// of 10.244.0.0/16 and its own data directory, as with per-node pod CIDRs.
    pub fn host_local(plugins_dir: &Path) -> Self {
        Self {
            plugin_dirs: vec![plugins_dir.to_path_buf()],
            netconf: Arc::new(|node: &NodeInfo| {
                json!({
                    "cniVersion": "1.0.0",
                    "name": "e2e-host-local",
                    "type": "host-local",
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": format!("10.244.{}.0/24", node.index)}]],
                        "dataDir": node.dir.join("host-local"),
                    },
                })
            }),
            runtime_gc: RuntimeGc::Never,
            network_status: None,
            node_env: None,
        }
    }
}

/// One network attachment of a sandbox, as CNI GC's `cni.dev/valid-attachments` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    /// The sandbox's container ID.
    pub container_id: String,
    /// The interface name inside the sandbox.
    pub ifname: String,
}

/// The pod a sandbox belongs to, passed to the plugin in `CNI_ARGS`.
#[derive(Clone, Debug)]
pub struct PodArgs {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The pod's UID.
    pub uid: String,
}

/// One plugin call.
#[derive(Debug)]
pub struct Invocation<'a> {
    /// ADD, DEL, CHECK, GC, STATUS or VERSION.
    pub command: &'a str,
    /// The sandbox's container ID (empty for GC, STATUS and VERSION).
    pub container_id: &'a str,
    /// The interface name.
    pub ifname: &'a str,
    /// The pod, for ADD, DEL and CHECK.
    pub pod: Option<&'a PodArgs>,
    /// The full netconf, including `prevResult` or `cni.dev/valid-attachments` as needed.
    pub netconf: &'a Value,
}

impl CniNetwork {
    /// Runs the plugin named by `netconf.type`, returning its parsed stdout (if any).
    pub async fn invoke(&self, call: &Invocation<'_>) -> Result<Option<Value>> {
        self.invoke_with_env(call, Vec::new(), "").await
    }

    /// [`CniNetwork::invoke`] with `extra_args` (`KEY=VALUE;...`, such as `IP=10.0.0.7`)
    /// appended to the pod's `CNI_ARGS`, as a runtime passing arguments to the plugin does.
    pub async fn invoke_with_args(&self, call: &Invocation<'_>, extra_args: &str) -> Result<Option<Value>> {
        self.invoke_with_env(call, Vec::new(), extra_args).await
    }

    /// [`CniNetwork::invoke`] as the runtime of `node` does it: with the plugin's
    /// [`CniNetwork::node_env`] of that node.
    pub async fn invoke_on(&self, node: &NodeInfo, call: &Invocation<'_>) -> Result<Option<Value>> {
        let env = self.node_env.as_ref().map(|env| env(node)).unwrap_or_default();
        self.invoke_with_env(call, env, "").await
    }

    async fn invoke_with_env(
        &self,
        call: &Invocation<'_>,
        env: Vec<(String, String)>,
        extra_args: &str,
    ) -> Result<Option<Value>> {
        let plugin = self.plugin_path(call)?;
        let fail = |reason: String| Error::Cni {
            command: call.command.to_string(),
            container_id: call.container_id.to_string(),
            plugin: plugin.clone(),
            reason,
        };
        let cni_path = std::env::join_paths(&self.plugin_dirs).map_err(|e| fail(e.to_string()))?;
        let mut command = tokio::process::Command::new(&plugin);
        command
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("CNI_COMMAND", call.command)
            .env("CNI_PATH", cni_path)
            .envs(env)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if !call.container_id.is_empty() {
            command
                .env("CNI_CONTAINERID", call.container_id)
                .env("CNI_NETNS", format!("/var/run/netns/cni-{}", call.container_id))
                .env("CNI_IFNAME", call.ifname);
        }
        if let Some(pod) = call.pod {
            command.env(
                "CNI_ARGS",
                format!(
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={}{}{extra_args}",
                    pod.namespace,
                    pod.name,
                    call.container_id,
                    pod.uid,
                    if extra_args.is_empty() { "" } else { ";" }
                ),
            );
        }
        let mut child = command.spawn().map_err(|e| fail(format!("spawn: {e}")))?;
        let stdin_bytes = serde_json::to_vec(call.netconf).map_err(|e| fail(format!("encoding netconf: {e}")))?;
        if let Some(mut stdin) = child.stdin.take() {
            // A plugin may answer without reading all of its input (it refuses oversized input):
            // like Go's os/exec, which runtimes use, a closed pipe is not an error; the plugin's
            // answer is.
            match stdin.write_all(&stdin_bytes).await {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    return Err(fail(format!("writing netconf to stdin: {e}")));
                }
                _ => {}
            }
        }
        let output = tokio::time::timeout(PLUGIN_TIMEOUT, child.wait_with_output())
            .await
            .map_err(|_| fail(format!("no answer within {PLUGIN_TIMEOUT:?}")))?
            .map_err(|e| fail(format!("waiting for the plugin: {e}")))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            return Err(fail(describe_failure(&output.status.to_string(), &stdout, &stderr)));
        }
        if stdout.trim().is_empty() {
            return Ok(None);
        }
        serde_json::from_str(&stdout).map(Some).map_err(|e| fail(format!("result is not JSON ({e}): {stdout}")))
    }

    fn plugin_path(&self, call: &Invocation<'_>) -> Result<PathBuf> {
        let kind = call.netconf.get("type").and_then(Value::as_str).unwrap_or_default();
        self.plugin_dirs.iter().map(|dir| dir.join(kind)).find(|path| !kind.is_empty() && path.is_file()).ok_or_else(
            || Error::MissingBinary {
                what: format!("CNI plugin {kind:?} (netconf type)"),
                path: self.plugin_dirs.first().cloned().unwrap_or_default(),
                hint: "check the CniNetwork's plugin_dirs".to_string(),
            },
        )
    }
}

/// Turns a failed plugin's output into one line: the CNI error object's code, msg and
/// details when it printed one, its raw output otherwise.
fn describe_failure(status: &str, stdout: &str, stderr: &str) -> String {
    match serde_json::from_str::<Value>(stdout) {
        Ok(error) if error.get("code").is_some() => format!(
            "{status}: code {} {}: {}",
            error["code"],
            error.get("msg").and_then(Value::as_str).unwrap_or_default(),
            error.get("details").and_then(Value::as_str).unwrap_or_default()
        ),
        _ => format!("{status}: stdout {:?} stderr {:?}", stdout.trim(), stderr.trim()),
    }
}

/// The IP addresses (without prefix length) of a CNI result.
pub fn result_ips(result: &Value) -> Vec<String> {
    result
        .get("ips")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|ip| ip.get("address").and_then(Value::as_str))
        .map(|cidr| cidr.split('/').next().unwrap_or(cidr).to_string())
        .collect()
}

/// The netconf for DEL or CHECK: the network's netconf with the ADD result as `prevResult`.
pub fn with_prev_result(netconf: &Value, prev: &Value) -> Value {
    let mut conf = netconf.clone();
    if let Some(map) = conf.as_object_mut() {
        map.insert("prevResult".to_string(), prev.clone());
    }
    conf
}

/// The netconf for GC: cniVersion 1.1.0 and the attachments still in use.
pub fn with_valid_attachments(netconf: &Value, valid: &[Attachment]) -> Value {
    let mut conf = netconf.clone();
    if let Some(map) = conf.as_object_mut() {
        map.insert("cniVersion".to_string(), json!("1.1.0"));
        let list: Vec<Value> =
            valid.iter().map(|a| json!({"containerID": a.container_id, "ifname": a.ifname})).collect();
        map.insert("cni.dev/valid-attachments".to_string(), Value::Array(list));
    }
    conf
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn runtime_gc_reads_never_startup_or_seconds_and_writes_them_back() {
        for (text, mode) in [
            ("never", RuntimeGc::Never),
            ("startup", RuntimeGc::Startup),
            ("5", RuntimeGc::Every(Duration::from_secs(5))),
        ] {
            assert_eq!(text.parse::<RuntimeGc>(), Ok(mode));
            assert_eq!(mode.to_string(), text);
        }
        for bad in ["0", "-1", "often", ""] {
            let err = bad.parse::<RuntimeGc>().expect_err(bad);
            assert!(err.contains(&format!("{bad:?}")) && err.contains("never"), "{err}");
        }
        assert_eq!(RuntimeGc::default(), RuntimeGc::Never, "containerd's behaviour by default");
    }

    #[test]
    fn result_ips_strips_prefix_lengths_of_v4_and_v6() {
        let result = json!({"ips": [{"address": "10.244.0.7/24"}, {"address": "fd00::7/64"}]});
        assert_eq!(result_ips(&result), vec!["10.244.0.7", "fd00::7"]);
    }

    #[test]
    fn result_ips_of_a_result_without_ips_is_empty() {
        assert!(result_ips(&json!({"cniVersion": "1.0.0"})).is_empty());
    }

    #[test]
    fn failure_description_prefers_the_cni_error_object() {
        let text =
            describe_failure("exit status: 1", r#"{"code": 11, "msg": "try again", "details": "agent down"}"#, "");
        assert_eq!(text, "exit status: 1: code 11 try again: agent down");
    }

    #[test]
    fn network_status_names_the_network_and_every_ip_as_a_secondary_attachment() {
        let status: Value =
            serde_json::from_str(&network_status("kube-system/wb", "eth0", &["10.245.0.3".into()])).expect("JSON");
        assert_eq!(
            status,
            json!([{"name": "kube-system/wb", "interface": "eth0", "ips": ["10.245.0.3"], "default": false}])
        );
    }

    #[test]
    fn gc_netconf_lists_valid_attachments_and_is_cni_1_1() {
        let conf = with_valid_attachments(
            &json!({"cniVersion": "1.0.0", "name": "n"}),
            &[Attachment { container_id: "abc".into(), ifname: "eth0".into() }],
        );
        assert_eq!(conf["cniVersion"], "1.1.0");
        assert_eq!(conf["cni.dev/valid-attachments"], json!([{"containerID": "abc", "ifname": "eth0"}]));
    }
}
