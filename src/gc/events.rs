//! The Kubernetes Events of the controller's releases and repairs, as plain data: one Event per
//! record changed, regarding the pod the record names (so `kubectl describe pod` and a field
//! selector on the pod's name find it, in the pod's namespace), related to the IPPool, and
//! labelled with the pool and the node (so `kubectl get events -A -l ipwarden.io/pool=<pool>`
//! finds a pool's). Decision 0017 says why an Event is written per record rather than through
//! kube's `Recorder`, which folds them into one series per regarded object.

use jiff::Timestamp;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};

use crate::crd::PodRef;

/// The label naming the IPPool of a release's or repair's record.
pub const POOL_LABEL: &str = "ipwarden.io/pool";
/// The label naming the node of a release's or repair's record.
pub const NODE_LABEL: &str = "ipwarden.io/node";

/// The Event reason of a release.
pub const RELEASED: &str = "IPReleased";
/// The Event reason of a repair.
pub const REPAIRED: &str = "IPRecordRepaired";

/// The most a note may hold (the apiserver refuses a longer one).
const NOTE_LIMIT: usize = 1024;
/// The longest Event name the apiserver takes (a DNS subdomain).
const NAME_LIMIT: usize = 253;

/// What one Event tells: a record of `ip` in `pool` released or repaired.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordEvent {
    /// The record's IP.
    pub ip: String,
    /// The record's IPPool.
    pub pool: String,
    /// The pool's UID, when it still exists.
    pub pool_uid: Option<String>,
    /// The pod the Event regards: the released record's pod, or the pod adopting a repaired
    /// record.
    pub pod: PodRef,
    /// The regarded pod object's own `metadata.uid`, when it differs from the record's UID (a
    /// static pod's mirror: the record names the config hash) and the pod is known: `kubectl
    /// describe pod` lists an Event only under the object's UID.
    pub pod_object_uid: Option<String>,
    /// The regarded pod's node.
    pub node: String,
    /// Why: the rule's label.
    pub rule: String,
    /// What started it: the trigger's label.
    pub trigger: String,
    /// What happened.
    pub kind: RecordEventKind,
}

/// Which change an Event reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordEventKind {
    /// The record was removed.
    Released,
    /// The record was moved to the pod reporting its IP; it named `former` on `former_node`.
    Repaired {
        /// The pod the record named before.
        former: PodRef,
        /// That pod's node.
        former_node: String,
    },
}

/// Who writes the Events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventSource {
    /// `reportingController`.
    pub controller: String,
    /// `reportingInstance`: the replica's identity.
    pub instance: String,
}

impl RecordEvent {
    /// The Event's reason.
    pub fn reason(&self) -> &'static str {
        match self.kind {
            RecordEventKind::Released => RELEASED,
            RecordEventKind::Repaired { .. } => REPAIRED,
        }
    }

    /// The human-readable note: every field an operator looks for after an incident.
    pub fn note(&self) -> String {
        let pod = &self.pod;
        let note = match &self.kind {
            RecordEventKind::Released => format!(
                "released {} of pod {}/{} (uid {}) on node {} in pool {}: rule {}, trigger {}",
                self.ip, pod.namespace, pod.name, pod.uid, self.node, self.pool, self.rule, self.trigger
            ),
            RecordEventKind::Repaired { former, former_node } => format!(
                "record of {} in pool {} adopted by pod {}/{} (uid {}) on node {}, which reports it; it named pod {}/{} (uid {}) on node {}: rule {}, trigger {}",
                self.ip,
                self.pool,
                pod.namespace,
                pod.name,
                pod.uid,
                self.node,
                former.namespace,
                former.name,
                former.uid,
                former_node,
                self.rule,
                self.trigger
            ),
        };
        truncate(note, NOTE_LIMIT)
    }

    /// The Event to create, named `name` ([`event_name`]), observed at `at`.
    pub fn to_event(&self, source: &EventSource, name: String, at: Timestamp) -> Event {
        let labels = [(POOL_LABEL, &self.pool), (NODE_LABEL, &self.node)]
            .into_iter()
            .filter(|(_, value)| is_label_value(value))
            .map(|(key, value)| (key.to_string(), value.clone()))
            .collect();
        Event {
            metadata: ObjectMeta {
                name: Some(name),
                namespace: Some(self.pod.namespace.clone()),
                labels: Some(labels),
                ..ObjectMeta::default()
            },
            action: Some("GarbageCollect".into()),
            reason: Some(self.reason().into()),
            note: Some(self.note()),
            type_: Some("Normal".into()),
            event_time: Some(MicroTime(at)),
            reporting_controller: Some(source.controller.clone()),
            reporting_instance: Some(source.instance.clone()),
            regarding: Some(ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                namespace: Some(self.pod.namespace.clone()),
                name: Some(self.pod.name.clone()),
                uid: self.pod_object_uid.clone().or_else(|| Some(self.pod.uid.clone())).filter(|u| !u.is_empty()),
                ..ObjectReference::default()
            }),
            related: Some(ObjectReference {
                api_version: Some("ipwarden.io/v1alpha1".into()),
                kind: Some("IPPool".into()),
                name: Some(self.pool.clone()),
                uid: self.pool_uid.clone(),
                ..ObjectReference::default()
            }),
            ..Event::default()
        }
    }
}

/// A unique Event name for pod `pod` and the per-process sequence number `sequence`
/// ([`EventNames`]): the pod's name cut to fit, then the number in hex, as kubelet names its
/// Events (`<object>.<hex>`), and always a valid DNS subdomain.
pub fn event_name(pod: &str, sequence: u64) -> String {
    let suffix = format!(".{sequence:x}");
    let room = NAME_LIMIT - suffix.len();
    let mut stem: String = pod.chars().take(room).collect();
    // A DNS subdomain's labels end in an alphanumeric character.
    while stem.ends_with(['-', '.']) {
        stem.pop();
    }
    if stem.is_empty() {
        stem.push_str("pod");
    }
    stem + &suffix
}

/// The sequence numbers of one process's Event names: strictly increasing, starting from the
/// clock, so names never repeat within a process nor (in practice) across its restarts.
#[derive(Debug, Default)]
pub struct EventNames {
    last: std::sync::atomic::AtomicU64,
}

impl EventNames {
    /// The next number: the clock's nanoseconds `now_nanos`, or one past the last number
    /// when the clock has not moved past it.
    pub fn next(&self, now_nanos: u64) -> u64 {
        use std::sync::atomic::Ordering;
        let mut last = self.last.load(Ordering::Relaxed);
        loop {
            let next = now_nanos.max(last.saturating_add(1));
            match self.last.compare_exchange_weak(last, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return next,
                Err(seen) => last = seen,
            }
        }
    }
}

/// Whether `value` is a valid label value (at most 63 characters of alphanumerics, `-`, `_`
/// and `.`, starting and ending with an alphanumeric), so a long pool or node name is left
/// out of the labels rather than failing the Event.
fn is_label_value(value: &str) -> bool {
    let edge_ok = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    !value.is_empty()
        && value.len() <= 63
        && value.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && edge_ok(value.chars().next())
        && edge_ok(value.chars().last())
}

/// `text` cut to at most `limit` bytes, on a character boundary.
fn truncate(mut text: String, limit: usize) -> String {
    if text.len() > limit {
        let mut end = limit;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

#[cfg(test)]
mod test {
    use super::*;

    fn pod(name: &str, uid: &str) -> PodRef {
        PodRef { namespace: "apps".into(), name: name.into(), uid: uid.into() }
    }

    fn released(ip: &str, name: &str) -> RecordEvent {
        RecordEvent {
            ip: ip.into(),
            pool: "default".into(),
            pool_uid: Some("pool-uid".into()),
            pod: pod(name, &format!("uid-{name}")),
            pod_object_uid: None,
            node: "node-1".into(),
            rule: "pod_gone".into(),
            trigger: "trace".into(),
            kind: RecordEventKind::Released,
        }
    }

    fn source() -> EventSource {
        EventSource { controller: "ipwarden-controller".into(), instance: "a".into() }
    }

    #[test]
    fn a_release_regards_its_pod_in_the_pods_namespace_and_relates_to_the_pool() {
        let event = released("10.0.0.5", "web-1").to_event(&source(), "web-1.1f".into(), Timestamp::UNIX_EPOCH);
        assert_eq!(event.metadata.namespace.as_deref(), Some("apps"));
        let regarding = event.regarding.expect("regarding");
        assert_eq!(
            (
                regarding.kind.as_deref(),
                regarding.namespace.as_deref(),
                regarding.name.as_deref(),
                regarding.uid.as_deref()
            ),
            (Some("Pod"), Some("apps"), Some("web-1"), Some("uid-web-1"))
        );
        let related = event.related.expect("related");
        assert_eq!((related.kind.as_deref(), related.name.as_deref()), (Some("IPPool"), Some("default")));
        assert_eq!(event.reason.as_deref(), Some(RELEASED));
        let labels = event.metadata.labels.expect("labels");
        assert_eq!(labels.get(POOL_LABEL).map(String::as_str), Some("default"));
        assert_eq!(labels.get(NODE_LABEL).map(String::as_str), Some("node-1"));
    }

    #[test]
    fn a_static_pods_release_regards_its_mirror_pod_object_and_its_note_names_the_config_hash() {
        let mirror = RecordEvent {
            pod: pod("static-web", "config-hash"),
            pod_object_uid: Some("mirror-uid".into()),
            ..released("10.0.0.5", "static-web")
        };
        let event = mirror.to_event(&source(), "static-web.1".into(), Timestamp::UNIX_EPOCH);
        assert_eq!(event.regarding.and_then(|r| r.uid).as_deref(), Some("mirror-uid"));
        assert!(event.note.unwrap_or_default().contains("config-hash"));
    }

    #[test]
    fn a_note_names_the_ip_pod_uid_node_pool_rule_and_trigger() {
        let note = released("10.0.0.5", "web-1").note();
        for part in ["10.0.0.5", "apps/web-1", "uid-web-1", "node-1", "default", "pod_gone", "trace"] {
            assert!(note.contains(part), "{part} in {note}");
        }
        let repaired = RecordEvent {
            kind: RecordEventKind::Repaired { former: pod("web-1", "old-uid"), former_node: "node-2".into() },
            ..released("10.0.0.5", "web-1")
        };
        let note = repaired.note();
        for part in ["10.0.0.5", "uid-web-1", "node-1", "old-uid", "node-2", "trace"] {
            assert!(note.contains(part), "{part} in {note}");
        }
        assert_eq!(repaired.reason(), REPAIRED);
    }

    #[test]
    fn releases_of_different_ips_make_different_events() {
        let a = released("10.0.0.5", "web-1").to_event(&source(), event_name("web-1", 1), Timestamp::UNIX_EPOCH);
        let b = released("10.0.0.6", "web-1").to_event(&source(), event_name("web-1", 2), Timestamp::UNIX_EPOCH);
        assert_ne!(a.metadata.name, b.metadata.name);
        assert_ne!(a.note, b.note);
    }

    #[test]
    fn event_names_are_dns_subdomains_whatever_the_pod_name() {
        let long = "a".repeat(300);
        let dashed = format!("{}-b", "a".repeat(238));
        for (pod, sequence) in [("web-1", 0x1f_u64), (long.as_str(), u64::MAX), (dashed.as_str(), 1), ("", 5)] {
            let name = event_name(pod, sequence);
            assert!(name.len() <= NAME_LIMIT, "{name}");
            assert!(name.ends_with(&format!(".{sequence:x}")), "{name}");
            // Kubernetes' DNS-1123 subdomain: labels of lowercase alphanumerics and `-`, each
            // starting and ending with an alphanumeric (no per-label length limit there).
            let label_ok = |label: &str| {
                let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
                edge(label.chars().next())
                    && edge(label.chars().last())
                    && label.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            };
            assert!(name.split('.').all(label_ok), "{name}");
        }
        assert_eq!(event_name("web-1", 0x1f), "web-1.1f");
    }

    #[test]
    fn sequence_numbers_follow_the_clock_and_never_repeat() {
        let names = EventNames::default();
        assert_eq!(names.next(100), 100);
        assert_eq!(names.next(100), 101, "the same instant");
        assert_eq!(names.next(50), 102, "a clock that went back");
        assert_eq!(names.next(500), 500);
    }

    #[test]
    fn a_name_that_is_no_label_value_is_left_out_of_the_labels() {
        let mut event = released("10.0.0.5", "web-1");
        event.pool = "p".repeat(64);
        event.node = "node_".into();
        let labels = event.to_event(&source(), "x.1".into(), Timestamp::UNIX_EPOCH).metadata.labels.expect("labels");
        assert!(labels.is_empty(), "{labels:?}");
    }

    #[test]
    fn a_long_note_is_cut_to_the_apiservers_limit_on_a_character_boundary() {
        let mut event = released("10.0.0.5", &"é".repeat(700));
        event.pod.namespace = "apps".into();
        let note = event.note();
        assert!(note.len() <= NOTE_LIMIT && note.starts_with("released 10.0.0.5"), "{}", note.len());
    }
}
