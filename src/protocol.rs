//! Wire protocol between the CNI plugin (`ipwarden cni`) and the node agent.
//!
//! The plugin connects to the agent's unix socket, writes exactly one [`AgentRequest`] as a
//! single line of JSON, shuts down its write half, and reads exactly one [`AgentResponse`]
//! line back. Field names are camelCase on the wire. [`IpamResult`] and [`CniError`] are
//! shaped like the CNI 1.x result and error objects, so the plugin prints them after adding
//! the `cniVersion` field.

use serde::{Deserialize, Serialize};

/// One call from the plugin to the agent; the `command` field names the CNI verb.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "command")]
pub enum AgentRequest {
    /// Allocate addresses for a new attachment (CNI `ADD`).
    #[serde(rename = "ADD")]
    Add(AttachmentRequest),
    /// Release the addresses of an attachment (CNI `DEL`); must be idempotent on the agent.
    #[serde(rename = "DEL")]
    Del(AttachmentRequest),
    /// Verify that an attachment still holds the addresses in `prev_result` (CNI `CHECK`).
    #[serde(rename = "CHECK")]
    Check(AttachmentRequest),
    /// Release every allocation of `network` that is not in the valid list (CNI 1.1 `GC`).
    #[serde(rename = "GC")]
    Gc(GcRequest),
    /// Ask whether the agent can serve `ADD` for `network` right now (CNI 1.1 `STATUS`).
    #[serde(rename = "STATUS")]
    Status(StatusRequest),
}

/// The identity of one attachment plus everything the agent needs to allocate or release it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AttachmentRequest {
    /// The `name` of the network configuration the runtime invoked the plugin with.
    pub network: String,
    /// The `cniVersion` of that configuration (`1.0.0` or `1.1.0`).
    pub cni_version: String,
    /// `CNI_CONTAINERID`: the runtime's id of the sandbox container.
    pub container_id: String,
    /// `CNI_IFNAME`: the interface name inside the container.
    pub ifname: String,
    /// `CNI_NETNS`: path of the network namespace; absent on a `DEL` where it is already gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
    /// The Kubernetes pod owning the sandbox, from the `K8S_POD_*` entries of `CNI_ARGS`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodRef>,
    /// The `prevResult` of the configuration, passed through untouched (required for `CHECK`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prev_result: Option<serde_json::Value>,
    /// The fixed IPs of the netconf's `runtimeConfig.ips` (the CNI "ips" capability), as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_config_ips: Option<Vec<String>>,
    /// The fixed IPs of `IP=` in `CNI_ARGS` (comma-separated), as given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args_ips: Option<String>,
    /// The pools the netconf names for this network (`ipam.pools`); empty when it names none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<String>,
}

/// The Kubernetes pod an attachment belongs to, so the agent can tie IPs to pod identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodRef {
    /// `K8S_POD_NAMESPACE`.
    pub namespace: String,
    /// `K8S_POD_NAME`.
    pub name: String,
    /// `K8S_POD_UID`; absent when the runtime does not send it (older runtimes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

/// Arguments of a `GC` call: the runtime's complete list of attachments still in use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GcRequest {
    /// The network configuration name whose allocations are being collected.
    pub network: String,
    /// The `cniVersion` of that configuration (always `1.1.0`).
    pub cni_version: String,
    /// Attachments that must be kept; an empty list means every allocation may be released.
    pub valid_attachments: Vec<Attachment>,
}

/// One attachment the runtime still knows about, as listed in a `GC` call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Attachment {
    /// The sandbox container id (`containerID` in the CNI network configuration).
    #[serde(alias = "containerID")]
    pub container_id: String,
    /// The interface name inside that container.
    pub ifname: String,
}

/// Arguments of a `STATUS` call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusRequest {
    /// The network configuration name whose readiness is asked for.
    pub network: String,
    /// The `cniVersion` of that configuration (always `1.1.0`).
    pub cni_version: String,
}

/// The agent's single reply to an [`AgentRequest`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum AgentResponse {
    /// The call succeeded; `result` is required for `ADD` and ignored for the other verbs.
    Ok {
        /// The allocated addresses, for `ADD`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<IpamResult>,
    },
    /// The call failed; the plugin prints this error to the runtime as is.
    Error(CniError),
}

/// The addresses, routes and DNS settings of an attachment, shaped as a CNI 1.x IPAM result.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IpamResult {
    /// Allocated addresses.
    pub ips: Vec<IpConfig>,
    /// Routes to install in the container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<Route>,
    /// DNS settings for the container, when the agent has any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<Dns>,
}

/// One allocated address (an entry of the CNI result's `ips`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IpConfig {
    /// The address with its prefix length, e.g. `10.0.0.5/24`.
    pub address: String,
    /// The default gateway of that subnet, e.g. `10.0.0.1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// Index into the result's `interfaces`; IPAM results leave it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<u32>,
}

/// One route of a CNI result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Route {
    /// Destination prefix, e.g. `0.0.0.0/0`.
    pub dst: String,
    /// Next hop; when absent the gateway of the matching address is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gw: Option<String>,
}

/// DNS settings of a CNI result.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Dns {
    /// Name server addresses, in priority order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nameservers: Vec<String>,
    /// Local domain used for short host name lookups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// Search domains, in priority order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub search: Vec<String>,
    /// Resolver options.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

/// The longest request line the agent reads from the plugin. The plugin refuses to send a
/// longer one (a permanent error), so the agent never drops a connection mid-request.
pub const MAX_REQUEST_BYTES: usize = 1024 * 1024;

/// A CNI error: the spec's error object without `cniVersion`, which is added when printed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "camelCase")]
#[error("cni error {code}: {msg}")]
pub struct CniError {
    /// The spec's error code (1-99 are reserved by the spec, 100+ are plugin specific).
    pub code: u32,
    /// A short, human-readable description of what failed.
    pub msg: String,
    /// Longer context, e.g. the underlying error; may be empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub details: String,
}

impl CniError {
    /// Code 1: the configuration's `cniVersion` is not one this plugin speaks.
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    /// Code 2: the configuration has a field whose value the plugin does not support.
    pub const UNSUPPORTED_FIELD: u32 = 2;
    /// Code 3: the container does not exist or is unknown to the plugin.
    pub const UNKNOWN_CONTAINER: u32 = 3;
    /// Code 4: a required `CNI_*` environment variable is missing or invalid.
    pub const INVALID_ENVIRONMENT: u32 = 4;
    /// Code 5: reading or writing something failed.
    pub const IO_FAILURE: u32 = 5;
    /// Code 6: the network configuration could not be decoded.
    pub const DECODING_FAILURE: u32 = 6;
    /// Code 7: the network configuration decoded but is semantically invalid.
    pub const INVALID_NETWORK_CONFIG: u32 = 7;
    /// Code 11: a transient failure; the runtime should retry later.
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// Code 50 (`STATUS`): the plugin cannot serve `ADD` at all right now.
    pub const PLUGIN_NOT_AVAILABLE: u32 = 50;
    /// Code 51 (`STATUS`): the plugin is up but out of a resource, e.g. free addresses.
    pub const LIMITED_RESOURCES: u32 = 51;

    /// Builds an error with any code and no details.
    pub fn new(code: u32, msg: impl Into<String>) -> Self {
        Self { code, msg: msg.into(), details: String::new() }
    }

    /// Returns the same error with `details` set, for context that does not fit in `msg`.
    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    /// Code 1 error, see [`CniError::INCOMPATIBLE_VERSION`].
    pub fn incompatible_version(msg: impl Into<String>) -> Self {
        Self::new(Self::INCOMPATIBLE_VERSION, msg)
    }

    /// Code 2 error, see [`CniError::UNSUPPORTED_FIELD`].
    pub fn unsupported_field(msg: impl Into<String>) -> Self {
        Self::new(Self::UNSUPPORTED_FIELD, msg)
    }

    /// Code 3 error, see [`CniError::UNKNOWN_CONTAINER`].
    pub fn unknown_container(msg: impl Into<String>) -> Self {
        Self::new(Self::UNKNOWN_CONTAINER, msg)
    }

    /// Code 4 error, see [`CniError::INVALID_ENVIRONMENT`].
    pub fn invalid_environment(msg: impl Into<String>) -> Self {
        Self::new(Self::INVALID_ENVIRONMENT, msg)
    }

    /// Code 5 error, see [`CniError::IO_FAILURE`].
    pub fn io_failure(msg: impl Into<String>) -> Self {
        Self::new(Self::IO_FAILURE, msg)
    }

    /// Code 6 error, see [`CniError::DECODING_FAILURE`].
    pub fn decoding_failure(msg: impl Into<String>) -> Self {
        Self::new(Self::DECODING_FAILURE, msg)
    }

    /// Code 7 error, see [`CniError::INVALID_NETWORK_CONFIG`].
    pub fn invalid_network_config(msg: impl Into<String>) -> Self {
        Self::new(Self::INVALID_NETWORK_CONFIG, msg)
    }

    /// Code 11 error, see [`CniError::TRY_AGAIN_LATER`].
    pub fn try_again_later(msg: impl Into<String>) -> Self {
        Self::new(Self::TRY_AGAIN_LATER, msg)
    }

    /// Code 50 error, see [`CniError::PLUGIN_NOT_AVAILABLE`].
    pub fn plugin_not_available(msg: impl Into<String>) -> Self {
        Self::new(Self::PLUGIN_NOT_AVAILABLE, msg)
    }
}

#[cfg(test)]
mod test {
    use super::*;
    use serde_json::json;

    fn attachment_request() -> AttachmentRequest {
        AttachmentRequest {
            network: "pods".into(),
            cni_version: "1.1.0".into(),
            container_id: "abc".into(),
            ifname: "eth0".into(),
            netns: Some("/var/run/netns/x".into()),
            pod: Some(PodRef { namespace: "default".into(), name: "web-0".into(), uid: Some("123".into()) }),
            prev_result: None,
            runtime_config_ips: None,
            args_ips: None,
            pools: Vec::new(),
        }
    }

    #[test]
    fn add_request_is_tagged_by_command_in_camel_case() {
        let wire = serde_json::to_value(AgentRequest::Add(attachment_request())).unwrap();
        assert_eq!(
            wire,
            json!({
                "command": "ADD",
                "network": "pods",
                "cniVersion": "1.1.0",
                "containerId": "abc",
                "ifname": "eth0",
                "netns": "/var/run/netns/x",
                "pod": {"namespace": "default", "name": "web-0", "uid": "123"}
            })
        );
    }

    #[test]
    fn every_request_round_trips_through_json() {
        let requests = [
            AgentRequest::Add(attachment_request()),
            AgentRequest::Add(AttachmentRequest {
                runtime_config_ips: Some(vec!["10.0.0.7/24".into()]),
                args_ips: Some("10.0.0.8,fd00::8".into()),
                ..attachment_request()
            }),
            AgentRequest::Del(AttachmentRequest { netns: None, pod: None, ..attachment_request() }),
            AgentRequest::Check(AttachmentRequest {
                prev_result: Some(json!({"ips": [{"address": "10.0.0.5/24"}]})),
                ..attachment_request()
            }),
            AgentRequest::Gc(GcRequest {
                network: "pods".into(),
                cni_version: "1.1.0".into(),
                valid_attachments: vec![Attachment { container_id: "a".into(), ifname: "eth0".into() }],
            }),
            AgentRequest::Status(StatusRequest { network: "pods".into(), cni_version: "1.1.0".into() }),
        ];
        for request in requests {
            let line = serde_json::to_string(&request).unwrap();
            assert!(!line.contains('\n'));
            assert_eq!(serde_json::from_str::<AgentRequest>(&line).unwrap(), request);
        }
    }

    #[test]
    fn gc_request_with_empty_valid_attachments_keeps_the_empty_list_on_the_wire() {
        let wire = serde_json::to_value(AgentRequest::Gc(GcRequest {
            network: "pods".into(),
            cni_version: "1.1.0".into(),
            valid_attachments: vec![],
        }))
        .unwrap();
        assert_eq!(wire, json!({"command": "GC", "network": "pods", "cniVersion": "1.1.0", "validAttachments": []}));
    }

    #[test]
    fn attachment_accepts_the_cni_spelling_container_id_upper_case() {
        let a: Attachment = serde_json::from_value(json!({"containerID": "c1", "ifname": "eth0"})).unwrap();
        assert_eq!(a, Attachment { container_id: "c1".into(), ifname: "eth0".into() });
    }

    #[test]
    fn responses_round_trip_and_are_externally_tagged() {
        let ok = AgentResponse::Ok {
            result: Some(IpamResult {
                ips: vec![IpConfig {
                    address: "10.0.0.5/24".into(),
                    gateway: Some("10.0.0.1".into()),
                    interface: None,
                }],
                routes: vec![Route { dst: "0.0.0.0/0".into(), gw: None }],
                dns: None,
            }),
        };
        let err = AgentResponse::Error(CniError::new(CniError::LIMITED_RESOURCES, "no free addresses in 10.0.0.0/24"));
        assert_eq!(
            serde_json::to_value(&ok).unwrap(),
            json!({"ok": {"result": {"ips": [{"address": "10.0.0.5/24", "gateway": "10.0.0.1"}],
                                     "routes": [{"dst": "0.0.0.0/0"}]}}})
        );
        assert_eq!(
            serde_json::to_value(&err).unwrap(),
            json!({"error": {"code": 51, "msg": "no free addresses in 10.0.0.0/24"}})
        );
        for response in [ok, err, AgentResponse::Ok { result: None }] {
            let line = serde_json::to_string(&response).unwrap();
            assert_eq!(serde_json::from_str::<AgentResponse>(&line).unwrap(), response);
        }
    }

    #[test]
    fn error_constructors_carry_the_spec_codes() {
        let cases = [
            (CniError::incompatible_version("x"), 1),
            (CniError::unsupported_field("x"), 2),
            (CniError::unknown_container("x"), 3),
            (CniError::invalid_environment("x"), 4),
            (CniError::io_failure("x"), 5),
            (CniError::decoding_failure("x"), 6),
            (CniError::invalid_network_config("x"), 7),
            (CniError::try_again_later("x"), 11),
            (CniError::plugin_not_available("x"), 50),
            (CniError::new(CniError::LIMITED_RESOURCES, "x"), 51),
        ];
        for (error, code) in cases {
            assert_eq!(error.code, code, "{error}");
        }
    }
}
