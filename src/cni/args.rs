//! Parser for `CNI_ARGS`, the runtime's `KEY=VALUE;KEY=VALUE` extra arguments.
//!
//! Kubernetes runtimes put the pod identity there (`K8S_POD_NAMESPACE`, `K8S_POD_NAME`,
//! `K8S_POD_UID`, `K8S_POD_INFRA_CONTAINER_ID`); `IP` names fixed IPs (comma-separated, the
//! agent parses them: `ipam::fixed`). Rules, chosen where the spec leaves room:
//! - empty segments (`;;`, a leading or trailing `;`) are skipped;
//! - a value is everything after the first `=`, so values may contain `=`;
//! - unknown keys are ignored whether or not `IgnoreUnknown` is set: runtimes add keys for
//!   other plugins, and ipwarden only reads the `K8S_*` ones and `IP`;
//! - a segment without `=`, with an empty key, or a `K8S_*` or `IP` key given twice is code 4,
//!   since the pod identity must not be guessed;
//! - an empty `K8S_*` value counts as absent, and a pod is only reported when both its
//!   namespace and name are present (one without the other is code 4).

use crate::protocol::{CniError, PodRef};

/// The parts of `CNI_ARGS` that ipwarden uses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CniArgs {
    /// `K8S_POD_NAMESPACE`.
    pub pod_namespace: Option<String>,
    /// `K8S_POD_NAME`.
    pub pod_name: Option<String>,
    /// `K8S_POD_UID`.
    pub pod_uid: Option<String>,
    /// `K8S_POD_INFRA_CONTAINER_ID`: the sandbox container id as Kubernetes sees it.
    pub pod_infra_container_id: Option<String>,
    /// `IP`: the fixed IPs the runtime asks for, as given.
    pub ip: Option<String>,
}

impl CniArgs {
    /// The pod these arguments name, when the runtime sent both namespace and name.
    pub fn pod(&self) -> Option<PodRef> {
        match (&self.pod_namespace, &self.pod_name) {
            (Some(namespace), Some(name)) => {
                Some(PodRef { namespace: namespace.clone(), name: name.clone(), uid: self.pod_uid.clone() })
            }
            _ => None,
        }
    }
}

/// Longest prefix of a bad segment quoted in an error message, so huge inputs stay readable.
const QUOTE_LIMIT: usize = 64;

/// Shortens `text` to at most [`QUOTE_LIMIT`] characters for an error message.
fn quote(text: &str) -> String {
    match text.char_indices().nth(QUOTE_LIMIT) {
        Some((cut, _)) => format!("{:?}...", &text[..cut]),
        None => format!("{text:?}"),
    }
}

/// Parses `CNI_ARGS`; see the module docs for the rules. Never panics.
pub fn parse_args(raw: &str) -> Result<CniArgs, CniError> {
    let mut args = CniArgs::default();
    for segment in raw.split(';').filter(|segment| !segment.is_empty()) {
        let Some((key, value)) = segment.split_once('=') else {
            return Err(CniError::invalid_environment(format!(
                "invalid CNI_ARGS pair {} (expected KEY=VALUE)",
                quote(segment)
            )));
        };
        if key.is_empty() {
            return Err(CniError::invalid_environment(format!("invalid CNI_ARGS pair {} (empty key)", quote(segment))));
        }
        let slot = match key {
            "K8S_POD_NAMESPACE" => &mut args.pod_namespace,
            "K8S_POD_NAME" => &mut args.pod_name,
            "K8S_POD_UID" => &mut args.pod_uid,
            "K8S_POD_INFRA_CONTAINER_ID" => &mut args.pod_infra_container_id,
            "IP" => &mut args.ip,
            _ => continue,
        };
        if slot.is_some() {
            return Err(CniError::invalid_environment(format!("CNI_ARGS key {key} is given more than once")));
        }
        *slot = Some(value.to_owned()).filter(|value| !value.is_empty());
    }
    if args.pod_namespace.is_some() != args.pod_name.is_some() {
        return Err(CniError::invalid_environment(format!(
            "CNI_ARGS has only one of K8S_POD_NAMESPACE and K8S_POD_NAME in {}",
            quote(raw)
        )));
    }
    Ok(args)
}

#[cfg(test)]
mod test {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn kubernetes_args_are_parsed_into_a_pod() {
        let args = parse_args(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=123;IP=10.0.0.7,fd00::7",
        )
        .unwrap();
        assert_eq!(
            args,
            CniArgs {
                pod_namespace: Some("default".into()),
                pod_name: Some("web-0".into()),
                pod_uid: Some("123".into()),
                pod_infra_container_id: Some("abc".into()),
                ip: Some("10.0.0.7,fd00::7".into()),
            }
        );
        assert_eq!(
            args.pod(),
            Some(PodRef { namespace: "default".into(), name: "web-0".into(), uid: Some("123".into()) })
        );
    }

    #[test]
    fn accepted_inputs_parse_as_expected() {
        let cases: &[(&str, Option<(&str, &str)>)] = &[
            ("", None),
            (";", None),
            (";;", None),
            ("IgnoreUnknown=1", None),
            ("Other=x;;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=n;", Some(("ns", "n"))),
            ("K8S_POD_NAMESPACE=ns;K8S_POD_NAME=a=b", Some(("ns", "a=b"))),
            ("K8S_POD_NAMESPACE=;K8S_POD_NAME=", None),
            ("K8S_POD_NAMESPACE=名前;K8S_POD_NAME=ü", Some(("名前", "ü"))),
            ("k8s_pod_name=lowercase-is-unknown", None),
        ];
        for (raw, pod) in cases {
            let args = parse_args(raw).unwrap_or_else(|e| panic!("{raw:?}: {e}"));
            assert_eq!(args.pod().map(|p| (p.namespace, p.name)), pod.map(|(a, b)| (a.into(), b.into())), "{raw:?}");
        }
    }

    #[test]
    fn pod_without_uid_is_reported_with_no_uid() {
        let pod = parse_args("K8S_POD_NAMESPACE=ns;K8S_POD_NAME=n").unwrap().pod().unwrap();
        assert_eq!(pod.uid, None);
    }

    #[test]
    fn malformed_args_are_invalid_env_code_4() {
        let cases = [
            "=",
            "=value",
            "novalue",
            "K8S_POD_NAME",
            "IgnoreUnknown=1;garbage",
            "K8S_POD_NAME=a;K8S_POD_NAME=b",
            "IP=10.0.0.1;IP=10.0.0.2",
            "K8S_POD_NAME=only-name",
            "K8S_POD_NAMESPACE=only-namespace",
        ];
        for raw in cases {
            let error = parse_args(raw).unwrap_err();
            assert_eq!(error.code, 4, "{raw:?}");
            assert!(error.msg.contains("CNI_ARGS"), "{raw:?}: {}", error.msg);
        }
    }

    #[test]
    fn very_long_malformed_args_give_a_short_message() {
        let raw = "x".repeat(1_000_000);
        let error = parse_args(&raw).unwrap_err();
        assert!(error.msg.len() < 200, "{}", error.msg.len());
    }

    proptest! {
        #[test]
        fn parser_never_panics_on_arbitrary_strings(raw in any::<String>()) {
            let _ = parse_args(&raw);
        }

        #[test]
        fn parser_never_panics_on_args_like_strings(raw in "[A-Za-z0-9_=;ü]{0,64}") {
            let _ = parse_args(&raw);
        }
    }
}
