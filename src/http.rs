//! The HTTP endpoint every ipwarden process serves: `/metrics` (OpenMetrics text),
//! `/healthz` (the process is up) and `/readyz` (it has synced and may serve).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;

/// The content type of OpenMetrics text exposition.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

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

async fn metrics(State(endpoint): State<Endpoint>) -> impl IntoResponse {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &endpoint.registry) {
        Ok(()) => (StatusCode::OK, [(header::CONTENT_TYPE, OPENMETRICS)], body),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, [(header::CONTENT_TYPE, "text/plain")], e.to_string()),
    }
}

async fn readyz(State(endpoint): State<Endpoint>) -> impl IntoResponse {
    if endpoint.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}
