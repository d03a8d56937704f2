//! Reading what a `/metrics` endpoint returns (Prometheus text or OpenMetrics): the samples
//! with their labels, sums over some of them, and histograms, whose quantiles are estimated
//! from the buckets as PromQL's `histogram_quantile` does.

use std::collections::BTreeMap;

/// A sample's labels, by name.
pub type Labels = BTreeMap<String, String>;

/// One sample: a metric name, its labels and its value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The sample's name as written (`..._total`, `..._bucket`, ...).
    pub name: String,
    /// Its labels, by name.
    pub labels: Labels,
    /// Its value.
    pub value: f64,
}

/// A line of exposition text that could not be read.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct BadLine {
    /// The line number, from 1.
    pub line: usize,
    /// What was wrong with it.
    pub reason: String,
}

/// Every sample of one scrape.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scrape {
    /// The samples in the order they were exposed.
    pub samples: Vec<Sample>,
}

impl Scrape {
    /// Reads exposition text; comments (`# HELP`, `# TYPE`, `# EOF`) and blank lines are skipped.
    pub fn parse(text: &str) -> Result<Self, BadLine> {
        let mut samples = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            samples.push(parse_sample(line).map_err(|reason| BadLine { line: index + 1, reason })?);
        }
        Ok(Self { samples })
    }

    /// The sum of the samples named `name` whose labels satisfy `select`.
    pub fn sum_where(&self, name: &str, select: impl Fn(&Labels) -> bool) -> f64 {
        self.samples.iter().filter(|s| s.name == name && select(&s.labels)).map(|s| s.value).sum()
    }

    /// The sum of every sample named `name`.
    pub fn sum(&self, name: &str) -> f64 {
        self.sum_where(name, |_| true)
    }

    /// The histogram `name` (its `name_bucket` samples), with the buckets of all label sets
    /// other than `le` added together.
    pub fn histogram(&self, name: &str) -> Histogram {
        self.histogram_where(name, |_| true)
    }

    /// The histogram `name` over the label sets `select` accepts, their buckets added.
    pub fn histogram_where(&self, name: &str, select: impl Fn(&Labels) -> bool) -> Histogram {
        let bucket = format!("{name}_bucket");
        let mut histogram = Histogram::default();
        for sample in self.samples.iter().filter(|s| s.name == bucket && select(&s.labels)) {
            let Some(le) = sample.labels.get("le").and_then(|le| parse_value(le).ok()) else { continue };
            histogram.add_bucket(le, sample.value);
        }
        histogram
    }
}

/// Cumulative bucket counts of a histogram, by upper bound.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    /// `(upper bound, observations at or below it)`, sorted by bound; the last bound is +Inf
    /// in a complete histogram.
    pub buckets: Vec<(f64, f64)>,
}

impl Histogram {
    fn add_bucket(&mut self, le: f64, count: f64) {
        match self.buckets.iter_mut().find(|(bound, _)| *bound == le) {
            Some((_, total)) => *total += count,
            None => {
                let at = self.buckets.partition_point(|(bound, _)| *bound < le);
                self.buckets.insert(at, (le, count));
            }
        }
    }

    /// Adds another histogram's buckets to these (both from processes with the same buckets).
    pub fn merge(&mut self, other: &Histogram) {
        for &(le, count) in &other.buckets {
            self.add_bucket(le, count);
        }
    }

    /// What was observed since `earlier`, a scrape of the same histogram.
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let mut delta = self.clone();
        for &(le, count) in &earlier.buckets {
            delta.add_bucket(le, -count);
        }
        delta
    }

    /// How many observations there are (the +Inf bucket's count).
    pub fn count(&self) -> f64 {
        self.buckets.last().filter(|(bound, _)| *bound == f64::INFINITY).map_or(0.0, |(_, count)| *count)
    }

    /// The `q` quantile (0 ≤ q ≤ 1) estimated as PromQL's `histogram_quantile` does: find the
    /// bucket holding the rank `q * count` and interpolate linearly inside it, the lowest
    /// bucket starting at 0; a rank in the +Inf bucket gives the highest finite bound. `None`
    /// without observations, without a +Inf bucket, or for a `q` outside [0, 1].
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if !(0.0..=1.0).contains(&q) || self.buckets.len() < 2 || self.count() <= 0.0 {
            return None;
        }
        let rank = q * self.count();
        let index = self.buckets.iter().position(|(_, count)| *count >= rank)?;
        if index == self.buckets.len() - 1 {
            return Some(self.buckets[index - 1].0);
        }
        let (end, count) = self.buckets[index];
        if index == 0 && end <= 0.0 {
            return Some(end);
        }
        let (start, below) = if index == 0 { (0.0, 0.0) } else { self.buckets[index - 1] };
        let inside = count - below;
        if inside <= 0.0 {
            return Some(end);
        }
        Some(start + (end - start) * (rank - below) / inside)
    }
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace()).ok_or("no value after the name")?;
    let name = &line[..name_end];
    if name.is_empty() {
        return Err("no metric name".into());
    }
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(inner) = rest.strip_prefix('{') {
        rest = parse_labels(inner, &mut labels)?;
    }
    // After the value may come a timestamp and, in OpenMetrics, an exemplar: not needed.
    let value = rest.split_whitespace().next().ok_or("no value")?;
    Ok(Sample { name: name.to_string(), labels, value: parse_value(value)? })
}

/// Reads `name="value",...}` into `labels`, returning what follows the closing brace.
fn parse_labels<'a>(mut text: &'a str, labels: &mut Labels) -> Result<&'a str, String> {
    loop {
        text = text.trim_start_matches([' ', ',']);
        if let Some(rest) = text.strip_prefix('}') {
            return Ok(rest);
        }
        let (name, after) = text.split_once("=\"").ok_or("a label without =\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, escaped)) => value.push(escaped),
                    None => return Err("an escape at the end of the line".into()),
                },
                Some((at, '"')) => break at,
                Some((_, c)) => value.push(c),
                None => return Err(format!("label {} has no closing quote", name.trim())),
            }
        };
        labels.insert(name.trim().to_string(), value);
        text = &after[end + 1..];
    }
}

fn parse_value(text: &str) -> Result<f64, String> {
    match text {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        _ => text.parse().map_err(|e| format!("value {text:?}: {e}")),
    }
}

#[cfg(test)]
mod test {
    use super::*;

    const OPENMETRICS: &str = r#"# HELP ipwarden_agent_releases IPs released
# TYPE ipwarden_agent_releases counter
ipwarden_agent_releases_total{result="released"} 7
ipwarden_agent_releases_total{result="reserved"} 2
# TYPE ipwarden_agent_allocation_duration_seconds histogram
ipwarden_agent_allocation_duration_seconds_sum 1.5
ipwarden_agent_allocation_duration_seconds_count 4
ipwarden_agent_allocation_duration_seconds_bucket{le="0.001"} 0
ipwarden_agent_allocation_duration_seconds_bucket{le="0.002"} 3
ipwarden_agent_allocation_duration_seconds_bucket{le="+Inf"} 4
ipwarden_controller_leader 1
# EOF
"#;

    #[test]
    fn counters_are_summed_over_the_selected_label_sets() {
        let scrape = Scrape::parse(OPENMETRICS).expect("valid text");
        assert_eq!(scrape.sum("ipwarden_agent_releases_total"), 9.0);
        assert_eq!(scrape.sum_where("ipwarden_agent_releases_total", |l| l["result"] == "released"), 7.0);
        assert_eq!(scrape.sum("ipwarden_controller_leader"), 1.0);
        assert_eq!(scrape.sum("absent_total"), 0.0);
    }

    #[test]
    fn label_values_keep_escaped_quotes_commas_and_braces_and_the_timestamp_is_ignored() {
        let line = r#"apiserver_request_total{code="201",resource="ipblocks",note="a \"b\", {c}\\d",verb="POST"} 12 1700000000000"#;
        let scrape = Scrape::parse(line).expect("valid line");
        let sample = &scrape.samples[0];
        assert_eq!(sample.labels["note"], r#"a "b", {c}\d"#);
        assert_eq!(sample.labels["verb"], "POST");
        assert_eq!(sample.labels.len(), 4);
        assert_eq!(sample.value, 12.0);
    }

    #[test]
    fn a_line_without_a_value_is_reported_with_its_number() {
        let error = Scrape::parse("# TYPE x counter\nx_total{a=\"1\"}\n").expect_err("no value");
        assert_eq!(error.line, 2);
        assert!(Scrape::parse("x_total{a=\"1} 3").is_err(), "unterminated label value");
        assert!(Scrape::parse("x_total three").is_err(), "not a number");
    }

    #[test]
    fn histogram_buckets_of_several_processes_add_up_by_bound() {
        let mut histogram =
            Scrape::parse(OPENMETRICS).expect("valid").histogram("ipwarden_agent_allocation_duration_seconds");
        histogram.merge(&histogram.clone());
        assert_eq!(histogram.buckets, vec![(0.001, 0.0), (0.002, 6.0), (f64::INFINITY, 8.0)]);
        assert_eq!(histogram.count(), 8.0);
    }

    fn histogram(buckets: &[(f64, f64)]) -> Histogram {
        Histogram { buckets: buckets.to_vec() }
    }

    #[test]
    fn quantile_interpolates_inside_the_bucket_holding_the_rank() {
        // 10 observations in (0, 1], 10 in (1, 2], none above.
        let h = histogram(&[(1.0, 10.0), (2.0, 20.0), (4.0, 20.0), (f64::INFINITY, 20.0)]);
        assert_eq!(h.quantile(0.5), Some(1.0));
        assert_eq!(h.quantile(0.25), Some(0.5));
        let p99 = h.quantile(0.99).expect("observations");
        assert!((p99 - 1.98).abs() < 1e-9, "p99 {p99}");
    }

    #[test]
    fn quantile_in_the_infinite_bucket_is_the_highest_finite_bound() {
        let h = histogram(&[(1.0, 1.0), (2.0, 2.0), (f64::INFINITY, 10.0)]);
        assert_eq!(h.quantile(0.9), Some(2.0));
    }

    #[test]
    fn quantile_needs_observations_an_infinite_bucket_and_a_valid_q() {
        assert_eq!(histogram(&[(1.0, 0.0), (f64::INFINITY, 0.0)]).quantile(0.5), None);
        assert_eq!(histogram(&[(1.0, 3.0), (2.0, 4.0)]).quantile(0.5), None);
        assert_eq!(histogram(&[(1.0, 3.0), (f64::INFINITY, 4.0)]).quantile(1.5), None);
    }

    #[test]
    fn since_subtracts_an_earlier_scrape_bucket_by_bucket() {
        let before = histogram(&[(1.0, 2.0), (2.0, 3.0), (f64::INFINITY, 3.0)]);
        let after = histogram(&[(1.0, 2.0), (2.0, 7.0), (f64::INFINITY, 9.0)]);
        let delta = after.since(&before);
        assert_eq!(delta.buckets, vec![(1.0, 0.0), (2.0, 4.0), (f64::INFINITY, 6.0)]);
        // All new observations lie above 1: the median is inside (1, 2].
        assert_eq!(delta.quantile(0.5), Some(1.75));
    }
}
