//! Serving HTTP/1.1 with bounds a service on the internet needs, and a graceful stop.
//!
//! `axum::serve` keeps every connection for as long as its client holds it: connections that never
//! send a request, or sit idle between requests, pile up until the process runs out of file
//! descriptors and no one else is served. Here:
//!
//! - a connection must send a request's whole head within [`Limits::header_timeout`] of opening
//!   or of its previous response, or it is closed (hyper's header-read timeout, which also bounds an
//!   idle keep-alive connection);
//! - at most [`Limits::max_connections`] connections are served at once; one more is answered
//!   `503 Service Unavailable` with `Retry-After: 1` and closed, so the refusal is clear and the
//!   process keeps descriptors for the connections it serves;
//! - on shutdown, the listener closes, each connection finishes the request it is serving and
//!   closes, for at most the grace period.

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// The bounds the server keeps (environment: `HEADER_TIMEOUT_MS`, `MAX_CONNECTIONS`,
/// `SHUTDOWN_GRACE_MS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// How long a connection may take to send a request head, or stay idle between requests.
    pub header_timeout: Duration,
    /// How many connections are served at once; more are refused with a 503.
    pub max_connections: usize,
    /// How long a shutdown waits for the requests in progress.
    pub shutdown_grace: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            max_connections: 4096,
            shutdown_grace: Duration::from_secs(25),
        }
    }
}

/// The answer to a connection over the limit.
const REFUSAL: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\nContent-Type: text/plain\r\nContent-Length: 36\r\n\r\ntoo many connections; retry shortly\n";

/// Serves `router` on `listener` within `limits` until `stop` resolves, then stops gracefully;
/// returns when the stop began, so that the caller spends only what is left of the grace period.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    stop: impl Future<Output = ()>,
) -> tokio::time::Instant {
    let mut builder = Builder::new(TokioExecutor::new()).http1_only();
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut stop = std::pin::pin!(stop);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of descriptors, most likely: let connections close before accepting more.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tokio::spawn(async move {
                let mut stream = stream;
                let _ = stream.write_all(REFUSAL).await;
                let _ = stream.shutdown().await;
            });
            continue;
        };
        let service = TowerToHyperService::new(router.clone());
        // Not `serve_connection_with_upgrades`: it reads the first bytes to tell HTTP versions
        // apart before hyper's header-read timer starts, so an idle connection would never close.
        let connection = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "connection ended with an error");
            }
            drop(slot);
        });
    }
    let stopped_at = tokio::time::Instant::now();
    drop(listener);
    if tokio::time::timeout(limits.shutdown_grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open at the end of the shutdown grace period");
    }
    stopped_at
}
