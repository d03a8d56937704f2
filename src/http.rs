//! The HTTP endpoint every ipwarden process serves: `/metrics` (OpenMetrics text to clients
//! that accept it, as Prometheus does; the classic text format 0.0.4 to the rest, e.g. curl
//! and `promtool check metrics`), `/healthz` (the process is up) and `/readyz` (it has synced
//! and may serve).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;

/// The content type of OpenMetrics text exposition.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of the classic Prometheus text format.
const CLASSIC_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Parses the address an endpoint listens on: `IPv4:port`, `[IPv6]:port`, or `[IPv4]:port`,
/// which is what a pod spec's `[$(HOST_IP)]:<port>` gives on an IPv4 node (the same text gives
/// `[IPv6]:port` on an IPv6 one, so one chart line serves both families).
pub fn parse_listen_address(text: &str) -> Result<SocketAddr, String> {
    if let Ok(address) = text.parse() {
        return Ok(address);
    }
    let bracketed = text.strip_prefix('[').and_then(|rest| rest.split_once("]:")).and_then(|(ip, port)| {
        let ip: std::net::Ipv4Addr = ip.parse().ok()?;
        let port: u16 = port.bytes().all(|b| b.is_ascii_digit()).then(|| port.parse().ok())??;
        Some(SocketAddr::from((ip, port)))
    });
    bracketed.ok_or_else(|| format!("{text:?} is not an address to listen on (IPv4:port, [IPv6]:port or [IPv4]:port)"))
}

/// What the endpoint reports on.
#[derive(Clone)]
pub struct Endpoint {
    /// The metrics to expose.
    pub registry: Arc<Registry>,
    /// Set once the process is ready to serve.
    pub ready: Arc<AtomicBool>,
}

/// Binds `address` and returns the bound address (port 0 picks a free one) and the server.
pub async fn bind(
    address: SocketAddr,
    endpoint: Endpoint,
) -> std::io::Result<(SocketAddr, impl Future<Output = std::io::Result<()>>)> {
    let listener = tokio::net::TcpListener::bind(address).await?;
    let local = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(endpoint);
    Ok((local, async move { axum::serve(listener, app).await }))
}

/// Binds `address` and serves the endpoint on a background task; returns the bound address.
pub async fn spawn(address: SocketAddr, endpoint: Endpoint) -> std::io::Result<SocketAddr> {
    let (local, server) = bind(address, endpoint).await?;
    tokio::spawn(async move {
        if let Err(e) = server.await {
            tracing::error!(error = %e, "the metrics and health endpoint stopped");
        }
    });
    tracing::info!(address = %local, "serving /metrics, /healthz and /readyz");
    Ok(local)
}

async fn metrics(State(endpoint): State<Endpoint>, headers: HeaderMap) -> impl IntoResponse {
    let mut body = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut body, &endpoint.registry) {
        return (StatusCode::INTERNAL_SERVER_ERROR, [(header::CONTENT_TYPE, "text/plain")], e.to_string());
    }
    let accepts_openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .any(|v| v.to_str().is_ok_and(|v| v.contains("application/openmetrics-text")));
    if accepts_openmetrics {
        (StatusCode::OK, [(header::CONTENT_TYPE, OPENMETRICS)], body)
    } else {
        (StatusCode::OK, [(header::CONTENT_TYPE, CLASSIC_TEXT)], classic_text(&body))
    }
}

/// Rewrites OpenMetrics text as the classic text format: a counter family is named after its
/// `_total` samples there (OpenMetrics names the family without the suffix), and there is no
/// `# EOF` or `# UNIT` line. Parsers of the classic format (promtool) otherwise see samples
/// without HELP or TYPE.
fn classic_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> =
        openmetrics.lines().filter_map(|line| line.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.contains(name).then(|| format!("{prefix}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

async fn readyz(State(endpoint): State<Endpoint>) -> impl IntoResponse {
    if endpoint.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}

#[cfg(test)]
mod test {
    use super::{classic_text, parse_listen_address};

    #[test]
    fn listen_addresses_take_ipv4_also_in_brackets() {
        for (text, want) in [
            ("0.0.0.0:9612", Some("0.0.0.0:9612")),
            ("192.0.2.10:9612", Some("192.0.2.10:9612")),
            ("[fd00::1]:9612", Some("[fd00::1]:9612")),
            ("[192.0.2.10]:9612", Some("192.0.2.10:9612")),
            ("fd00::1:9612", None),
            ("fd00::1:2", None),
            ("[192.0.2.10]:+80", None),
            ("[192.0.2.10]", None),
            ("192.0.2.10", None),
            ("fd00::1", None),
            ("[$(HOST_IP)]:9612", None),
            ("192.0.2.10:70000", None),
            ("", None),
        ] {
            let got = parse_listen_address(text).ok().map(|a| a.to_string());
            assert_eq!(got.as_deref(), want, "{text}");
        }
    }

    #[test]
    fn counter_families_take_their_samples_total_name_and_eof_goes() {
        let openmetrics = "# HELP x_releases Records released.\n# TYPE x_releases counter\n\
                           x_releases_total{pool=\"a\"} 1\n# HELP x_leader 1 while leading.\n\
                           # TYPE x_leader gauge\nx_leader 1\n# UNIT x_leader none\n# EOF\n";
        assert_eq!(
            classic_text(openmetrics),
            "# HELP x_releases_total Records released.\n# TYPE x_releases_total counter\n\
             x_releases_total{pool=\"a\"} 1\n# HELP x_leader 1 while leading.\n# TYPE x_leader gauge\nx_leader 1\n"
        );
    }

    #[test]
    fn histograms_and_gauges_are_unchanged() {
        let text = "# HELP d_seconds Duration.\n# TYPE d_seconds histogram\nd_seconds_sum 0.0\n\
                    d_seconds_count 0\nd_seconds_bucket{le=\"+Inf\"} 0\n";
        assert_eq!(classic_text(&format!("{text}# EOF\n")), text);
    }
}
