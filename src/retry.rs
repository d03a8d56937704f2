//! The one retry schedule for compare-and-swap writes that lost a resourceVersion race:
//! exponential with jitter, bounded (backon; the `backoff` crate is unmaintained).

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// Delays between attempts: from `min` doubling up to `max`, at most `times` of them.
pub fn conflict_delays(min: Duration, max: Duration, times: usize) -> impl Iterator<Item = Duration> {
    ExponentialBuilder::default().with_min_delay(min).with_max_delay(max).with_max_times(times).with_jitter().build()
}

#[cfg(test)]
mod test {
    #[test]
    fn the_schedule_is_bounded_and_capped() {
        let delays: Vec<_> =
            super::conflict_delays(std::time::Duration::from_millis(5), std::time::Duration::from_millis(40), 6)
                .collect();
        assert_eq!(delays.len(), 6);
        // Jitter adds up to one more delay on top of the cap.
        assert!(delays.iter().all(|d| *d <= std::time::Duration::from_millis(80)), "{delays:?}");
    }
}
