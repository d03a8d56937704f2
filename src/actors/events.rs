//! `EventWriter`: writes the controller's release and repair Events, one create per record
//! changed ([`crate::gc::events`] builds them), and says so at warn, at most once a minute,
//! when the apiserver does not take them.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::api::events::v1::Event;
use kube::Client;
use kube::api::{Api, PostParams};
use prometheus_client::metrics::counter::Counter;

use crate::gc::events::{EventNames, EventSource, RecordEvent, event_name};

/// How often a failed Event write is logged at warn; the failures in between are counted in
/// the next line (and in `ipwarden_gc_event_failures_total`).
const WARN_EVERY: Duration = Duration::from_secs(60);

/// The longest `reportingInstance` the apiserver takes.
const REPORTING_INSTANCE_LIMIT: usize = 128;

/// Writes release and repair Events as this controller replica.
#[derive(Clone)]
pub struct EventWriter {
    client: Client,
    source: EventSource,
    names: Arc<EventNames>,
    warnings: Arc<WarnLimit>,
    failures: Counter,
}

impl EventWriter {
    /// A writer reporting as `controller`, instance `instance` (cut to the apiserver's 128
    /// characters: a pod name may be longer); failures counted in `failures`.
    pub fn new(client: Client, controller: &str, instance: &str, failures: Counter) -> Self {
        let instance: String = instance.chars().take(REPORTING_INSTANCE_LIMIT).collect();
        Self {
            client,
            source: EventSource { controller: controller.into(), instance },
            names: Arc::default(),
            warnings: Arc::new(WarnLimit::new(WARN_EVERY)),
            failures,
        }
    }

    /// Creates the Event of `record` in its pod's namespace. A failure is counted and logged
    /// (rate-limited), never returned: the release it reports is done either way.
    pub async fn write(&self, record: &RecordEvent) {
        let now = Timestamp::now();
        let nanos = u64::try_from(now.as_nanosecond()).unwrap_or_default();
        let name = event_name(&record.pod.name, self.names.next(nanos));
        let event = record.to_event(&self.source, name, now);
        let api: Api<Event> = Api::namespaced(self.client.clone(), &record.pod.namespace);
        if let Err(e) = api.create(&PostParams::default(), &event).await {
            self.failures.inc();
            if let Some(suppressed) = self.warnings.allow(Instant::now()) {
                tracing::warn!(
                    reason = record.reason(),
                    ip = %record.ip,
                    pod = %format!("{}/{}", record.pod.namespace, record.pod.name),
                    suppressed,
                    error = %e,
                    "writing an Event failed; `suppressed` more failed since the last such line"
                );
            }
        }
    }
}

/// Lets a line through at most once per `every`, counting the ones held back.
#[derive(Debug)]
struct WarnLimit {
    every: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl WarnLimit {
    fn new(every: Duration) -> Self {
        Self { every, state: Mutex::new((None, 0)) }
    }

    /// Whether a line may be logged at `now`; if so, how many were held back since the last.
    fn allow(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (last, held) = &mut *state;
        match last {
            Some(at) if now.saturating_duration_since(*at) < self.every => {
                *held += 1;
                None
            }
            _ => {
                *last = Some(now);
                Some(std::mem::take(held))
            }
        }
    }
}

#[cfg(test)]
mod test {
    use super::*;

    #[test]
    fn a_warning_goes_through_once_per_period_and_counts_the_ones_held_back() {
        let limit = WarnLimit::new(Duration::from_secs(60));
        let start = Instant::now();
        assert_eq!(limit.allow(start), Some(0), "the first");
        assert_eq!(limit.allow(start + Duration::from_secs(1)), None);
        assert_eq!(limit.allow(start + Duration::from_secs(59)), None);
        assert_eq!(limit.allow(start + Duration::from_secs(60)), Some(2), "two held back");
        assert_eq!(limit.allow(start + Duration::from_secs(61)), None);
        assert_eq!(limit.allow(start + Duration::from_secs(200)), Some(1));
    }
}
