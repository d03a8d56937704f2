//! Bounded waits on conditions: the only way the harness and its tests wait.

use std::future::Future;
use std::time::Duration;

use tracing::instrument::WithSubscriber;

use crate::error::{Error, Result};

/// How often a condition is probed.
const PROBE_INTERVAL: Duration = Duration::from_millis(200);

/// What one probe of a condition found.
pub enum Probe<T> {
    /// The condition holds; the wait returns this value.
    Done(T),
    /// Not yet; the text says what was seen, for the timeout message.
    Pending(String),
}

/// Probes `check` until it reports [`Probe::Done`], failing with [`Error::Timeout`] after
/// `timeout`. Errors from the probe are returned at once, since retrying cannot fix them.
pub async fn until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Probe<T>>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match check().await? {
            Probe::Done(value) => return Ok(value),
            Probe::Pending(last) => last,
        };
        tracing::debug!(what, last = %last, "waiting");
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Timeout { what: what.to_string(), timeout, last });
        }
        tokio::time::sleep(PROBE_INTERVAL).await;
    }
}

/// Runs `probe` (one request of a readiness wait) with tracing off. The Kubernetes client logs
/// every refused connection and every 5xx answer as an error, but while a component starts
/// those are the expected answers, not errors: the probe reports them as pending, [`until`]
/// logs them at debug, and its timeout names the last one.
pub async fn quietly<F: Future>(probe: F) -> F::Output {
    probe.with_subscriber(tracing::subscriber::NoSubscriber::default()).await
}
