//! A real Prometheus server (Debian's package) scraping processes on loopback, with its own
//! configuration, rule files and storage in a directory of the test; queried over its HTTP API.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};

use crate::binaries;
use crate::error::{Error, Result};
use crate::ipwarden::get;
use crate::process::{Component, free_port};
use crate::wait::{self, Probe};

/// How often the test server scrapes and evaluates rules: fast, so tests wait little.
const INTERVAL: &str = "1s";

/// One series of a query's result.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The series' labels (`__name__` included when the result keeps it).
    pub labels: BTreeMap<String, String>,
    /// Its value.
    pub value: f64,
}

/// One alert of the rules loaded, as the server's alerts API reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct Alert {
    /// The alert's labels (`alertname` included).
    pub labels: BTreeMap<String, String>,
    /// `pending` (condition true, `for` not over yet) or `firing`.
    pub state: String,
}

/// A running Prometheus server on 127.0.0.1.
pub struct Prometheus {
    process: Component,
    port: u16,
}

impl Prometheus {
    /// Starts Prometheus in `dir` scraping each job's 127.0.0.1 ports every second and
    /// evaluating `rule_files`, and waits (at most `timeout`) until it is ready.
    pub async fn start(
        dir: &Path,
        jobs: &[(&str, Vec<u16>)],
        rule_files: &[PathBuf],
        timeout: Duration,
    ) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(Error::io("creating the Prometheus directory", dir))?;
        let scrape_configs: Vec<Value> = jobs
            .iter()
            .map(|(job, ports)| {
                let targets: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
                json!({"job_name": job, "static_configs": [{"targets": targets}]})
            })
            .collect();
        let config = json!({
            "global": {"scrape_interval": INTERVAL, "scrape_timeout": INTERVAL, "evaluation_interval": INTERVAL},
            "rule_files": rule_files,
            "scrape_configs": scrape_configs,
        });
        // JSON is YAML, which is what Prometheus reads.
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config.to_string())
            .map_err(Error::io("writing the Prometheus config", &config_path))?;
        let port = free_port()?;
        let args = vec![
            format!("--config.file={}", config_path.display()),
            format!("--storage.tsdb.path={}", dir.join("data").display()),
            format!("--web.listen-address=127.0.0.1:{port}"),
        ];
        let binary = binaries::prometheus_tool("prometheus")?;
        let mut process = Component::start("prometheus", &binary, args, dir.join("prometheus.log"))?;
        let what = format!("Prometheus ready (log {})", process.log().display());
        wait::until(&what, timeout, || {
            let running = process.ensure_running();
            async move {
                running?;
                Ok(match get(port, "/-/ready").await {
                    Ok(_) => Probe::Done(()),
                    Err(e) => Probe::Pending(e.to_string()),
                })
            }
        })
        .await?;
        Ok(Self { process, port })
    }

    /// The server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Fails when the server has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        self.process.ensure_running()
    }

    /// Evaluates the instant query `expr` now.
    pub async fn query(&self, expr: &str) -> Result<Vec<Sample>> {
        let data = self.api(&format!("/api/v1/query?query={}", encode(expr)), expr).await?;
        let fail = |reason: &str| Error::Prometheus { query: expr.to_string(), reason: reason.to_string() };
        let result = data.get("result").and_then(Value::as_array).ok_or_else(|| fail("no result vector"))?;
        result
            .iter()
            .map(|series| {
                let value =
                    series.pointer("/value/1").and_then(Value::as_str).ok_or_else(|| fail("no sample value"))?;
                Ok(Sample {
                    labels: string_map(series.get("metric")),
                    value: value.parse().map_err(|_| fail(&format!("value {value} is not a number")))?,
                })
            })
            .collect()
    }

    /// The alerts that are pending or firing now.
    pub async fn alerts(&self) -> Result<Vec<Alert>> {
        let data = self.api("/api/v1/alerts", "alerts").await?;
        Ok(data
            .get("alerts")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|alert| Alert {
                labels: string_map(alert.get("labels")),
                state: alert.get("state").and_then(Value::as_str).unwrap_or_default().to_string(),
            })
            .collect())
    }

    /// GETs an API path and returns its `data`, failing on an error status.
    async fn api(&self, path: &str, what: &str) -> Result<Value> {
        let body = get(self.port, path).await?;
        let fail = |reason: String| Error::Prometheus { query: what.to_string(), reason };
        let answer: Value = serde_json::from_str(&body).map_err(|e| fail(format!("{e}: {body}")))?;
        if answer.get("status").and_then(Value::as_str) != Some("success") {
            return Err(fail(body));
        }
        answer.get("data").cloned().ok_or_else(|| fail("no data".to_string()))
    }
}

fn string_map(value: Option<&Value>) -> BTreeMap<String, String> {
    value
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
        .collect()
}

/// Percent-encodes a query parameter (everything but RFC 3986's unreserved characters).
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => char::from(b).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod test {
    #[test]
    fn a_query_is_percent_encoded() {
        assert_eq!(super::encode(r#"up{job="a b"} == 1"#), "up%7Bjob%3D%22a%20b%22%7D%20%3D%3D%201");
    }
}
