//! The `CNI_*` environment variables the runtime sets for each plugin call.
//!
//! Parsing is pure (it reads a map, not the process environment) so every case is unit tested.
//! An empty variable counts as missing. `CNI_PATH` is never required: ipwarden delegates to no
//! other plugin, so it only records it.

use std::collections::HashMap;

use crate::protocol::CniError;

/// The CNI verb the runtime asked for (`CNI_COMMAND`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Set up an attachment.
    Add,
    /// Tear down an attachment.
    Del,
    /// Verify an attachment.
    Check,
    /// Collect resources of attachments the runtime no longer knows (CNI 1.1).
    Gc,
    /// Report readiness (CNI 1.1).
    Status,
    /// Report the supported spec versions.
    Version,
}

impl Command {
    /// Parses the value of `CNI_COMMAND`; verbs are upper case as in the spec.
    pub fn parse(value: &str) -> Result<Self, CniError> {
        match value {
            "ADD" => Ok(Self::Add),
            "DEL" => Ok(Self::Del),
            "CHECK" => Ok(Self::Check),
            "GC" => Ok(Self::Gc),
            "STATUS" => Ok(Self::Status),
            "VERSION" => Ok(Self::Version),
            other => Err(CniError::invalid_environment(format!("unknown CNI_COMMAND {other:?}"))),
        }
    }

    /// The verb as the runtime spells it, for messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Add => "ADD",
            Self::Del => "DEL",
            Self::Check => "CHECK",
            Self::Gc => "GC",
            Self::Status => "STATUS",
            Self::Version => "VERSION",
        }
    }
}

/// The validated CNI environment of one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniEnv {
    /// `CNI_COMMAND`.
    pub command: Command,
    /// `CNI_CONTAINERID`; always present for ADD, DEL and CHECK.
    pub container_id: Option<String>,
    /// `CNI_NETNS`; always present for ADD and CHECK, optional for DEL.
    pub netns: Option<String>,
    /// `CNI_IFNAME`; always present for ADD, DEL and CHECK.
    pub ifname: Option<String>,
    /// `CNI_PATH`, recorded but unused: ipwarden calls no other plugin.
    pub path: Option<String>,
    /// `CNI_ARGS`, raw; see [`super::args`] for its parser.
    pub args: Option<String>,
}

/// Reads one variable, treating an empty value as absent.
fn optional(vars: &HashMap<String, String>, name: &str) -> Option<String> {
    vars.get(name).filter(|value| !value.is_empty()).cloned()
}

/// Reads one variable that `command` requires, failing with code 4 naming it.
fn required(vars: &HashMap<String, String>, name: &str, command: Command) -> Result<Option<String>, CniError> {
    match optional(vars, name) {
        Some(value) => Ok(Some(value)),
        None => Err(CniError::invalid_environment(format!(
            "missing or empty environment variable {name} required by {}",
            command.as_str()
        ))),
    }
}

/// Parses and validates the CNI environment; missing or bad variables are code 4.
pub fn parse_env(vars: &HashMap<String, String>) -> Result<CniEnv, CniError> {
    let command = match optional(vars, "CNI_COMMAND") {
        Some(value) => Command::parse(&value)?,
        None => return Err(CniError::invalid_environment("missing or empty environment variable CNI_COMMAND")),
    };
    let attachment = matches!(command, Command::Add | Command::Del | Command::Check);
    let (container_id, ifname) = if attachment {
        (required(vars, "CNI_CONTAINERID", command)?, required(vars, "CNI_IFNAME", command)?)
    } else {
        (None, None)
    };
    let netns = match command {
        Command::Add | Command::Check => required(vars, "CNI_NETNS", command)?,
        Command::Del => optional(vars, "CNI_NETNS"),
        Command::Gc | Command::Status | Command::Version => None,
    };
    let args = if attachment { optional(vars, "CNI_ARGS") } else { None };
    Ok(CniEnv { command, container_id, netns, ifname, path: optional(vars, "CNI_PATH"), args })
}

#[cfg(test)]
mod test {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    const FULL: &[(&str, &str)] = &[
        ("CNI_CONTAINERID", "abc"),
        ("CNI_NETNS", "/var/run/netns/abc"),
        ("CNI_IFNAME", "eth0"),
        ("CNI_PATH", "/opt/cni/bin"),
        ("CNI_ARGS", "K8S_POD_NAME=web-0"),
    ];

    fn with_command(command: &str, without: Option<&str>, empty: Option<&str>) -> HashMap<String, String> {
        let mut map = vars(FULL);
        map.insert("CNI_COMMAND".into(), command.into());
        if let Some(name) = without {
            map.remove(name);
        }
        if let Some(name) = empty {
            map.insert(name.into(), String::new());
        }
        map
    }

    #[test]
    fn add_with_every_variable_is_parsed_whole() {
        let env = parse_env(&with_command("ADD", None, None)).unwrap();
        assert_eq!(
            env,
            CniEnv {
                command: Command::Add,
                container_id: Some("abc".into()),
                netns: Some("/var/run/netns/abc".into()),
                ifname: Some("eth0".into()),
                path: Some("/opt/cni/bin".into()),
                args: Some("K8S_POD_NAME=web-0".into()),
            }
        );
    }

    #[test]
    fn missing_or_empty_required_variables_are_code_4_naming_the_variable() {
        let cases = [
            ("ADD", "CNI_CONTAINERID"),
            ("ADD", "CNI_NETNS"),
            ("ADD", "CNI_IFNAME"),
            ("CHECK", "CNI_CONTAINERID"),
            ("CHECK", "CNI_NETNS"),
            ("CHECK", "CNI_IFNAME"),
            ("DEL", "CNI_CONTAINERID"),
            ("DEL", "CNI_IFNAME"),
        ];
        for (command, name) in cases {
            for map in [with_command(command, Some(name), None), with_command(command, None, Some(name))] {
                let error = parse_env(&map).unwrap_err();
                assert_eq!(error.code, 4, "{command} without {name}");
                assert!(error.msg.contains(name), "{command} without {name}: {}", error.msg);
            }
        }
    }

    #[test]
    fn del_without_netns_is_accepted() {
        let env = parse_env(&with_command("DEL", Some("CNI_NETNS"), None)).unwrap();
        assert_eq!(env.netns, None);
        assert_eq!(env.container_id.as_deref(), Some("abc"));
    }

    #[test]
    fn gc_status_and_version_need_only_the_command() {
        for (command, expected) in [("GC", Command::Gc), ("STATUS", Command::Status), ("VERSION", Command::Version)] {
            let env = parse_env(&vars(&[("CNI_COMMAND", command)])).unwrap();
            assert_eq!(env.command, expected);
            assert_eq!((env.container_id, env.ifname, env.netns, env.args), (None, None, None, None));
        }
    }

    #[test]
    fn missing_empty_or_unknown_command_is_code_4() {
        for map in
            [vars(&[]), vars(&[("CNI_COMMAND", "")]), vars(&[("CNI_COMMAND", "add")]), vars(&[("CNI_COMMAND", "UP")])]
        {
            let error = parse_env(&map).unwrap_err();
            assert_eq!(error.code, 4);
            assert!(error.msg.contains("CNI_COMMAND"), "{}", error.msg);
        }
    }
}
