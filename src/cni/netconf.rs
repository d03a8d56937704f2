//! Parser for the network configuration the runtime writes on the plugin's stdin.
//!
//! Error codes: bytes that are not a JSON object, or a known field of the wrong JSON type,
//! are code 6; a required field missing or a value out of range is code 7; a `cniVersion`
//! other than `1.0.0` or `1.1.0` is code 1. ipwarden's own settings (`socket`,
//! `timeoutSeconds`) come from the `ipam` section when its `type` is `ipwarden` or
//! `ipwarden-cni` (ipwarden as the IPAM plugin of bridge, ptp, ...), otherwise from the top
//! level (ipwarden invoked directly), and so do the network's pools (`pools`, docs/data-model.md,
//! "Per-interface pools").

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::protocol::{Attachment, CniError};

/// The spec versions this plugin speaks, oldest first.
pub const SUPPORTED_VERSIONS: [&str; 2] = ["1.0.0", "1.1.0"];

/// The newest supported version, used where no configuration says otherwise.
pub const LATEST_VERSION: &str = "1.1.0";

/// Agent socket used when the configuration names none.
pub const DEFAULT_SOCKET: &str = "/run/ipwarden/agent.sock";

/// Agent call timeout used when the configuration sets none.
pub const DEFAULT_TIMEOUT_SECONDS: u64 = 30;

/// Allowed range of `timeoutSeconds`.
pub const TIMEOUT_SECONDS_RANGE: std::ops::RangeInclusive<u64> = 1..=300;

/// `type` values of an `ipam` section that hold ipwarden's settings.
const IPAM_TYPES: [&str; 2] = ["ipwarden", "ipwarden-cni"];

/// A validated network configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct NetConf {
    /// `cniVersion`, one of [`SUPPORTED_VERSIONS`].
    pub cni_version: String,
    /// `name`: the network name, the key of every allocation on the agent.
    pub name: String,
    /// `type`: the plugin the runtime invoked (ipwarden itself or the plugin it serves as IPAM).
    pub plugin_type: Option<String>,
    /// The `ipam` section as given.
    pub ipam: Option<Map<String, Value>>,
    /// `prevResult`, passed through to the agent untouched.
    pub prev_result: Option<Map<String, Value>>,
    /// The GC keep-list from `cni.dev/valid-attachments`, or from the older `cni.dev/attachments`
    /// when the former is absent; `None` (absent) differs from `Some(vec![])` (keep nothing).
    pub valid_attachments: Option<Vec<Attachment>>,
    /// `runtimeConfig`, the runtime's per-call capabilities.
    pub runtime_config: Option<Map<String, Value>>,
    /// Where and how patiently to reach the agent.
    pub agent: AgentSettings,
    /// The pools this network's interfaces draw from (`ipam.pools`), one per IP family; empty
    /// when the netconf names none (the pod's own rules then apply).
    pub pools: Vec<String>,
}

impl NetConf {
    /// The fixed IPs of `runtimeConfig.ips` (the CNI "ips" capability), as given: a list of
    /// strings (addresses or CIDRs, which the agent parses), else code 6.
    pub fn runtime_config_ips(&self) -> Result<Option<Vec<String>>, CniError> {
        let Some(value) = self.runtime_config.as_ref().and_then(|rc| rc.get("ips")) else { return Ok(None) };
        let ips = match value {
            Value::Null => return Ok(None),
            Value::Array(items) => items.iter().map(|item| item.as_str().map(str::to_string)).collect(),
            _ => None,
        };
        ips.map(Some).ok_or_else(|| {
            CniError::decoding_failure(format!("runtimeConfig.ips must be a list of strings, got {value}"))
        })
    }
}

/// ipwarden's own settings: how to reach the node agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentSettings {
    /// Path of the agent's unix socket (`socket`).
    pub socket: PathBuf,
    /// Budget for one agent call: connect, write and read together (`timeoutSeconds`).
    pub timeout: Duration,
}

/// The configuration as decoded, before validation; every field is optional here so that a
/// missing field is reported as code 7 rather than a decoding failure.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawNetConf {
    cni_version: Option<String>,
    name: Option<String>,
    #[serde(rename = "type")]
    plugin_type: Option<String>,
    ipam: Option<Map<String, Value>>,
    prev_result: Option<Map<String, Value>>,
    #[serde(rename = "cni.dev/valid-attachments")]
    valid_attachments: Option<Vec<Attachment>>,
    #[serde(rename = "cni.dev/attachments")]
    legacy_attachments: Option<Vec<Attachment>>,
    runtime_config: Option<Map<String, Value>>,
    socket: Option<Value>,
    timeout_seconds: Option<Value>,
    pools: Option<Value>,
}

/// The most the plugin reads from stdin: a network configuration is a few KiB, and a runtime
/// that sends more sends something that can never succeed.
pub const MAX_NETCONF_BYTES: usize = 1024 * 1024;

/// The longest network name accepted (a DNS subdomain's length): the name is stored in every
/// allocation record and checkpoint entry, which must stay small.
pub const MAX_NAME_BYTES: usize = 253;

/// Whether `name` follows the spec's network name rule (alphanumeric, then alphanumerics,
/// `_`, `.`, `-`) and is at most [`MAX_NAME_BYTES`] long.
fn is_valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    name.len() <= MAX_NAME_BYTES
        && chars.next().is_some_and(|first| first.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// Checks that `version` is one of [`SUPPORTED_VERSIONS`], else code 1.
pub fn check_version(version: &str) -> Result<(), CniError> {
    if SUPPORTED_VERSIONS.contains(&version) {
        Ok(())
    } else {
        Err(CniError::incompatible_version(format!(
            "unsupported cniVersion {version:?} (supported: {})",
            SUPPORTED_VERSIONS.join(", ")
        ))
        .with_details(format!("supportedVersions: {SUPPORTED_VERSIONS:?}")))
    }
}

/// Reads `socket` and `timeoutSeconds` from one section; JSON `null` counts as absent.
fn agent_settings(section: &str, socket: Option<&Value>, timeout: Option<&Value>) -> Result<AgentSettings, CniError> {
    let socket = match socket {
        None | Some(Value::Null) => PathBuf::from(DEFAULT_SOCKET),
        Some(Value::String(path)) if path.starts_with('/') => PathBuf::from(path),
        Some(Value::String(path)) => {
            return Err(CniError::invalid_network_config(format!(
                "{section}socket must be an absolute path, got {path:?}"
            )));
        }
        Some(other) => {
            return Err(CniError::decoding_failure(format!("{section}socket must be a string, got {other}")));
        }
    };
    let seconds = match timeout {
        None | Some(Value::Null) => DEFAULT_TIMEOUT_SECONDS,
        Some(Value::Number(number)) if number.is_u64() || number.is_i64() => {
            match number.as_u64().filter(|seconds| TIMEOUT_SECONDS_RANGE.contains(seconds)) {
                Some(seconds) => seconds,
                None => {
                    return Err(CniError::invalid_network_config(format!(
                        "{section}timeoutSeconds must be between {} and {}, got {number}",
                        TIMEOUT_SECONDS_RANGE.start(),
                        TIMEOUT_SECONDS_RANGE.end()
                    )));
                }
            }
        }
        Some(other) => {
            return Err(CniError::decoding_failure(format!(
                "{section}timeoutSeconds must be a whole number of seconds, got {other}"
            )));
        }
    };
    Ok(AgentSettings { socket, timeout: Duration::from_secs(seconds) })
}

/// The most pools a netconf names: one per IP family.
const MAX_POOLS: usize = 2;

/// The pool names of network `network`'s `{section}pools`: a list of strings (else code 6),
/// each non-blank, at most [`MAX_POOLS`] and none twice (else code 7). Whether the pools
/// exist, and are of two families, only the agent knows.
fn pool_names(network: &str, section: &str, pools: Option<&Value>) -> Result<Vec<String>, CniError> {
    let names: Vec<String> = match pools {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(|item| item.as_str().map(str::to_string)).collect::<Option<_>>(),
        Some(_) => None,
    }
    .ok_or_else(|| {
        let shown = pools.map(Value::to_string).unwrap_or_default();
        CniError::decoding_failure(format!(
            "network {network:?}: {section}pools must be a list of pool names, got {shown}"
        ))
    })?;
    let invalid = |why: &str| {
        Err(CniError::invalid_network_config(format!("network {network:?}: {section}pools {names:?} {why}")))
    };
    if names.iter().any(|name| name.trim().is_empty()) {
        return invalid("has an empty pool name");
    }
    if names.len() > MAX_POOLS {
        return invalid("names more than one pool per IP family (at most 2)");
    }
    if names.iter().enumerate().any(|(i, name)| names[..i].contains(name)) {
        return invalid("names a pool twice");
    }
    Ok(names)
}

/// Rejects attachments with an empty container id or interface name (code 7).
fn check_attachments(key: &str, attachments: &[Attachment]) -> Result<(), CniError> {
    match attachments.iter().find(|a| a.container_id.is_empty() || a.ifname.is_empty()) {
        Some(bad) => Err(CniError::invalid_network_config(format!(
            "{key} entry has an empty containerID or ifname: containerID={:?} ifname={:?}",
            bad.container_id, bad.ifname
        ))),
        None => Ok(()),
    }
}

/// Parses and validates a network configuration; see the module docs for the error codes.
pub fn parse_netconf(bytes: &[u8]) -> Result<NetConf, CniError> {
    if bytes.len() > MAX_NETCONF_BYTES {
        return Err(oversized_netconf());
    }
    let raw: RawNetConf = serde_json::from_slice(bytes).map_err(|e| {
        CniError::decoding_failure(format!("failed to decode network configuration: {e}"))
            .with_details(format!("stdin is {} bytes", bytes.len()))
    })?;
    let cni_version = match raw.cni_version {
        Some(version) if !version.is_empty() => version,
        _ => return Err(CniError::invalid_network_config("network configuration has no cniVersion")),
    };
    check_version(&cni_version)?;
    let name = match raw.name {
        Some(name) if is_valid_name(&name) => name,
        Some(name) => {
            let shown: String = name.chars().take(64).collect();
            return Err(CniError::invalid_network_config(format!(
                "invalid network name {shown:?} ({} bytes): it must be at most {MAX_NAME_BYTES} bytes, start \
                 with a letter or digit and contain only letters, digits, '_', '.' and '-'",
                name.len()
            )));
        }
        None => return Err(CniError::invalid_network_config("network configuration has no name")),
    };
    let ipwarden_ipam = raw
        .ipam
        .as_ref()
        .filter(|ipam| ipam.get("type").and_then(Value::as_str).is_some_and(|plugin| IPAM_TYPES.contains(&plugin)));
    let (agent, pools) = match ipwarden_ipam {
        Some(ipam) => (
            agent_settings("ipam.", ipam.get("socket"), ipam.get("timeoutSeconds"))?,
            pool_names(&name, "ipam.", ipam.get("pools"))?,
        ),
        None => (
            agent_settings("", raw.socket.as_ref(), raw.timeout_seconds.as_ref())?,
            pool_names(&name, "", raw.pools.as_ref())?,
        ),
    };
    let valid_attachments = match (raw.valid_attachments, raw.legacy_attachments) {
        (Some(list), _) => {
            check_attachments("cni.dev/valid-attachments", &list)?;
            Some(list)
        }
        (None, Some(list)) => {
            check_attachments("cni.dev/attachments", &list)?;
            Some(list)
        }
        (None, None) => None,
    };
    Ok(NetConf {
        cni_version,
        name,
        plugin_type: raw.plugin_type,
        ipam: raw.ipam,
        prev_result: raw.prev_result,
        valid_attachments,
        runtime_config: raw.runtime_config,
        agent,
        pools,
    })
}

/// The error for stdin longer than [`MAX_NETCONF_BYTES`] (code 7: no retry can fix it).
pub fn oversized_netconf() -> CniError {
    CniError::invalid_network_config(format!(
        "the network configuration on stdin is larger than the limit of {MAX_NETCONF_BYTES} bytes"
    ))
}

#[cfg(test)]
mod test {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn parse(value: Value) -> Result<NetConf, CniError> {
        parse_netconf(value.to_string().as_bytes())
    }

    #[test]
    fn runtime_config_ips_are_a_list_of_strings_or_code_6() {
        let ips = |rc: Value| {
            parse(json!({"cniVersion": "1.1.0", "name": "pods", "type": "ipwarden", "runtimeConfig": rc}))
                .unwrap()
                .runtime_config_ips()
        };
        assert_eq!(
            ips(json!({"ips": ["10.0.0.7/24", "fd00::7"]})).unwrap(),
            Some(vec!["10.0.0.7/24".into(), "fd00::7".into()])
        );
        assert_eq!(ips(json!({"portMappings": []})).unwrap(), None);
        assert_eq!(ips(json!({"ips": null})).unwrap(), None);
        for bad in [json!({"ips": "10.0.0.7"}), json!({"ips": [7]})] {
            let err = ips(bad.clone()).unwrap_err();
            assert_eq!(err.code, 6, "{bad}");
            assert!(err.msg.contains("runtimeConfig.ips"), "{}", err.msg);
        }
    }

    #[test]
    fn minimal_top_level_config_uses_the_defaults() {
        let conf = parse(json!({"cniVersion": "1.0.0", "name": "pods", "type": "ipwarden"})).unwrap();
        assert_eq!(conf.cni_version, "1.0.0");
        assert_eq!(conf.name, "pods");
        assert_eq!(conf.plugin_type.as_deref(), Some("ipwarden"));
        assert_eq!(conf.agent, AgentSettings { socket: DEFAULT_SOCKET.into(), timeout: Duration::from_secs(30) });
        assert_eq!(
            (conf.ipam, conf.prev_result, conf.valid_attachments, conf.runtime_config),
            (None, None, None, None)
        );
    }

    #[test]
    fn settings_come_from_the_ipam_section_when_its_type_is_ipwarden() {
        for ipam_type in ["ipwarden", "ipwarden-cni"] {
            let conf = parse(json!({
                "cniVersion": "1.1.0", "name": "pods", "type": "bridge",
                "socket": "/top/level.sock", "timeoutSeconds": 99,
                "ipam": {"type": ipam_type, "socket": "/run/custom.sock", "timeoutSeconds": 5}
            }))
            .unwrap();
            assert_eq!(
                conf.agent,
                AgentSettings { socket: "/run/custom.sock".into(), timeout: Duration::from_secs(5) }
            );
        }
    }

    #[test]
    fn pools_come_from_the_ipwarden_ipam_section_else_the_top_level() {
        let pools = |value: Value| parse(value).unwrap().pools;
        let ipam = json!({"cniVersion": "1.1.0", "name": "net-b", "type": "macvlan", "pools": ["top"],
                          "ipam": {"type": "ipwarden", "pools": ["b-v4", "b-v6"]}});
        assert_eq!(pools(ipam), ["b-v4", "b-v6"]);
        let direct = json!({"cniVersion": "1.1.0", "name": "net-b", "type": "ipwarden", "pools": ["b-v4"]});
        assert_eq!(pools(direct), ["b-v4"]);
        let other = json!({"cniVersion": "1.1.0", "name": "n", "ipam": {"type": "host-local", "pools": ["x"]}});
        assert!(pools(other).is_empty(), "another IPAM's section is not ours");
        let none = json!({"cniVersion": "1.1.0", "name": "n", "ipam": {"type": "ipwarden", "pools": null}});
        assert!(pools(none).is_empty());
    }

    #[test]
    fn bad_pools_give_code_6_or_7_naming_the_network() {
        let cases = [
            (json!("b-v4"), 6, "must be a list of pool names"),
            (json!(["b-v4", 4]), 6, "must be a list of pool names"),
            (json!(["b-v4", " "]), 7, "empty pool name"),
            (json!(["a", "b", "c"]), 7, "more than one pool per IP family"),
            (json!(["a", "a"]), 7, "twice"),
        ];
        for (pools, code, needle) in cases {
            let conf = json!({"cniVersion": "1.1.0", "name": "net-b", "ipam": {"type": "ipwarden", "pools": pools}});
            let error = parse(conf).unwrap_err();
            assert_eq!(error.code, code, "{pools}: {error:?}");
            assert!(error.msg.contains(needle) && error.msg.contains("network \"net-b\": ipam.pools"), "{}", error.msg);
        }
    }

    #[test]
    fn ipwarden_ipam_section_without_settings_uses_defaults_not_the_top_level() {
        let conf = parse(json!({
            "cniVersion": "1.1.0", "name": "pods", "type": "bridge", "socket": "/top/level.sock",
            "ipam": {"type": "ipwarden"}
        }))
        .unwrap();
        assert_eq!(conf.agent.socket, PathBuf::from(DEFAULT_SOCKET));
    }

    #[test]
    fn settings_come_from_the_top_level_when_the_ipam_section_is_another_plugin() {
        let conf = parse(json!({
            "cniVersion": "1.1.0", "name": "pods", "type": "ipwarden",
            "socket": "/top/level.sock", "timeoutSeconds": 300,
            "ipam": {"type": "host-local", "socket": "/ignored.sock"}
        }))
        .unwrap();
        assert_eq!(conf.agent, AgentSettings { socket: "/top/level.sock".into(), timeout: Duration::from_secs(300) });
    }

    #[test]
    fn optional_sections_are_kept() {
        let conf = parse(json!({
            "cniVersion": "1.1.0", "name": "pods", "type": "ipwarden",
            "prevResult": {"ips": [{"address": "10.0.0.5/24"}]},
            "runtimeConfig": {"portMappings": []},
            "cni.dev/valid-attachments": [{"containerID": "c1", "ifname": "eth0"}]
        }))
        .unwrap();
        assert_eq!(Value::Object(conf.prev_result.unwrap()), json!({"ips": [{"address": "10.0.0.5/24"}]}));
        assert_eq!(Value::Object(conf.runtime_config.unwrap()), json!({"portMappings": []}));
        assert_eq!(conf.valid_attachments, Some(vec![Attachment { container_id: "c1".into(), ifname: "eth0".into() }]));
    }

    #[test]
    fn attachments_are_read_from_both_keys_preferring_valid_attachments() {
        let a = |id: &str| Attachment { container_id: id.into(), ifname: "eth0".into() };
        let cases = [
            (json!({"cni.dev/attachments": [{"containerID": "old", "ifname": "eth0"}]}), Some(vec![a("old")])),
            (json!({"cni.dev/valid-attachments": [{"containerID": "new", "ifname": "eth0"}]}), Some(vec![a("new")])),
            (
                json!({"cni.dev/valid-attachments": [{"containerID": "new", "ifname": "eth0"}],
                       "cni.dev/attachments": [{"containerID": "old", "ifname": "eth0"}]}),
                Some(vec![a("new")]),
            ),
            (json!({"cni.dev/valid-attachments": []}), Some(vec![])),
            (json!({"cni.dev/attachments": []}), Some(vec![])),
            (json!({"cni.dev/valid-attachments": null}), None),
            (json!({}), None),
        ];
        for (extra, expected) in cases {
            let mut value = json!({"cniVersion": "1.1.0", "name": "pods"});
            value.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            assert_eq!(parse(value.clone()).unwrap().valid_attachments, expected, "{value}");
        }
    }

    #[test]
    fn oversized_input_and_overlong_names_are_code_7_naming_the_limit() {
        let long_name = json!({"cniVersion": "1.1.0", "name": "n".repeat(MAX_NAME_BYTES + 1)});
        let error = parse(long_name).unwrap_err();
        assert_eq!(error.code, 7);
        assert!(error.msg.contains("254 bytes") && error.msg.contains("253"), "{}", error.msg);
        assert!(error.msg.len() < 300, "the message shows a prefix of the name, not all of it");
        assert!(parse(json!({"cniVersion": "1.1.0", "name": "n".repeat(MAX_NAME_BYTES)})).is_ok());

        let padded = format!(r#"{{"cniVersion": "1.1.0", "name": "pods"{}}}"#, " ".repeat(MAX_NETCONF_BYTES));
        let error = parse_netconf(padded.as_bytes()).unwrap_err();
        assert_eq!(error.code, 7);
        assert!(error.msg.contains(&MAX_NETCONF_BYTES.to_string()), "{}", error.msg);
    }

    #[test]
    fn bad_configs_give_the_spec_error_codes() {
        let cases: Vec<(&[u8], u32, &str)> = vec![
            (b"", 6, "decode"),
            (b"not json", 6, "decode"),
            (b"[]", 6, "decode"),
            (b"\"1.0.0\"", 6, "decode"),
            (br#"{"cniVersion": 1, "name": "pods"}"#, 6, "decode"),
            (br#"{"cniVersion": "1.0.0", "name": ["pods"]}"#, 6, "decode"),
            (br#"{"cniVersion": "1.0.0", "name": "pods", "ipam": "ipwarden"}"#, 6, "decode"),
            (br#"{"cniVersion": "1.0.0", "name": "pods", "prevResult": []}"#, 6, "decode"),
            (br#"{"cniVersion": "1.0.0", "name": "pods", "cni.dev/valid-attachments": {}}"#, 6, "decode"),
            (br#"{"cniVersion": "1.0.0", "name": "pods", "cni.dev/attachments": [{"ifname": "e"}]}"#, 6, "decode"),
            (br#"{"cniVersion": "1.0.0", "name": "pods", "socket": 7}"#, 6, "socket"),
            (br#"{"cniVersion": "1.0.0", "name": "pods", "timeoutSeconds": "30"}"#, 6, "timeoutSeconds"),
            (br#"{"cniVersion": "1.0.0", "name": "pods", "timeoutSeconds": 1.5}"#, 6, "timeoutSeconds"),
            (br#"{"cniVersion": "1.0.0", "name": "pods", "cniVersion": "1.0.0"}"#, 6, "decode"),
            (br#"{"name": "pods"}"#, 7, "cniVersion"),
            (br#"{"cniVersion": "", "name": "pods"}"#, 7, "cniVersion"),
            (br#"{"cniVersion": "1.0.0"}"#, 7, "name"),
            (br#"{"cniVersion": "1.0.0", "name": ""}"#, 7, "name"),
            (br#"{"cniVersion": "1.0.0", "name": "-pods"}"#, 7, "name"),
            (br#"{"cniVersion": "1.0.0", "name": "po ds"}"#, 7, "name"),
            (br#"{"cniVersion": "1.0.0", "name": "pods", "socket": "relative.sock"}"#, 7, "socket"),
            (br#"{"cniVersion": "1.0.0", "name": "pods", "timeoutSeconds": 0}"#, 7, "timeoutSeconds"),
            (br#"{"cniVersion": "1.0.0", "name": "pods", "timeoutSeconds": 301}"#, 7, "timeoutSeconds"),
            (br#"{"cniVersion": "1.0.0", "name": "pods", "timeoutSeconds": -1}"#, 7, "timeoutSeconds"),
            (br#"{"cniVersion": "1.0.0", "name": "p", "ipam": {"type": "ipwarden", "timeoutSeconds": 0}}"#, 7, "ipam."),
            (
                br#"{"cniVersion": "1.0.0", "name": "p", "cni.dev/valid-attachments": [{"containerID": "", "ifname": "e"}]}"#,
                7,
                "containerID",
            ),
            (br#"{"cniVersion": "0.4.0", "name": "pods"}"#, 1, "0.4.0"),
            (br#"{"cniVersion": "1.2.0", "name": "pods"}"#, 1, "1.2.0"),
            (br#"{"cniVersion": "banana", "name": "pods"}"#, 1, "banana"),
        ];
        for (bytes, code, needle) in cases {
            let text = String::from_utf8_lossy(bytes);
            let error = parse_netconf(bytes).unwrap_err();
            assert_eq!(error.code, code, "{text}: {error:?}");
            assert!(error.msg.contains(needle), "{text}: {} lacks {needle}", error.msg);
        }
    }

    proptest! {
        #[test]
        fn parser_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_netconf(&bytes);
        }

        #[test]
        fn parser_never_panics_on_json_like_input(
            version in prop_oneof![Just("1.0.0".to_string()), Just("1.1.0".to_string()), any::<String>()],
            name in any::<String>(),
            timeout in any::<i64>(),
            socket in any::<String>(),
        ) {
            let value = json!({
                "cniVersion": version, "name": name, "timeoutSeconds": timeout, "socket": socket,
                "ipam": {"type": "ipwarden", "timeoutSeconds": timeout}
            });
            let _ = parse(value);
        }
    }
}
