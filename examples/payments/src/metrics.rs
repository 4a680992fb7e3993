//! `GET /metrics`: idem's metrics, and any others sent through the `metrics` facade, in
//! Prometheus's text format (see `idem_runtime::metrics` for what each one counts).
//!
//! The recorder is process-wide (the facade has one global recorder): it is installed the first
//! time a state is opened, and every router in the process renders it. Expose the route to your
//! scraper only, as usual for `/metrics`.

use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;
use std::time::Duration;

/// Histogram buckets for the `_seconds` metrics: store calls take milliseconds; waits, seconds.
const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// How often the recorder drops the histogram samples it no longer needs.
const UPKEEP: Duration = Duration::from_secs(5);

/// The process's Prometheus recorder, installed as the facade's global recorder on first use;
/// `None` if the process had installed another one already (then that one gets idem's metrics).
pub fn prometheus() -> Option<&'static PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let installed = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), BUCKETS)
                .and_then(PrometheusBuilder::install_recorder);
            match installed {
                Ok(handle) => {
                    idem_runtime::metrics::describe();
                    Some(handle)
                }
                Err(error) => {
                    tracing::warn!(%error, "GET /metrics is off: no Prometheus recorder");
                    None
                }
            }
        })
        .as_ref()
}

/// Keeps the recorder's histograms small; runs as long as the state that spawned it.
pub(crate) async fn upkeep(handle: &'static PrometheusHandle) {
    let mut every = tokio::time::interval(UPKEEP);
    loop {
        every.tick().await;
        handle.run_upkeep();
    }
}

/// `GET /metrics`.
pub(crate) async fn render() -> Response {
    match prometheus() {
        Some(handle) => (
            [(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
            handle.render(),
        )
            .into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}
