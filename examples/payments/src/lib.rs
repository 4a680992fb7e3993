//! A small payments API protected by idem. Run with: `cargo run -p payments`
//!
//! The contract (stable; also in `examples/payments/README.md`):
//!
//! - **Environment.** `PORT` (default 3000; listens on 127.0.0.1). `DATABASE_URL` (default
//!   `sqlite://payments.db?mode=rwc`, a file in the working directory; `sqlite://some/dir/payments.db?mode=rwc`
//!   works too, the directory is created) holds the ledger and the idempotency records.
//!   `IDEM_STORE_URL` optionally puts the idempotency records elsewhere. `PAYMENT_LATENCY_MS`
//!   (default 0) simulates a slow card network.
//! - **Auth.** `Authorization: Bearer <user-id>` (demo auth: the token is the user id); without it, 401.
//! - `POST /payments` with `{"amount": 1000, "currency": "KRW"}` → 201
//!   `{"id", "amount", "currency", "status": "captured"}` and `Location: /payments/{id}`.
//!   Idempotent, scoped to the user, `Idempotency-Key` required.
//! - `GET /payments`: the caller's payments, a JSON array, oldest first.
//! - `GET /payments/{id}`: the payment's current state; 404 for another user's payment.
//! - `POST /payments/{id}/refund` → 200 with `"status": "refunded"`. Idempotent, key required.
//! - `POST /legacy/payments`: as `POST /payments`, for old app versions that send no key: without a
//!   key, identical requests within 10 s count as one (`missing_key = "derive"`).
//!
//! A replay is the request's result, not the resource's current state: replaying the create after a
//! refund still answers 201 with its `Location`, and `GET` on that `Location` shows `"refunded"`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), payments::StartError> {
//! let router = payments::app(&payments::Config::default()).await?;
//! # let _ = router; Ok(()) }
//! ```

mod api;
pub mod auth;
pub mod ledger;
pub mod store;

use axum::extract::FromRef;
use axum::routing::{get, post};
use axum::Router;
use idem_runtime::Engine;
use ledger::Ledger;
use std::net::Ipv4Addr;
use std::time::Duration;

/// The default `DATABASE_URL`: `payments.db` in the working directory.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://payments.db?mode=rwc";

/// The example's configuration, read from the environment by [`Config::from_env`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `PORT`: the port on 127.0.0.1.
    pub port: u16,
    /// `DATABASE_URL`: the ledger (and, by default, the idempotency records).
    pub database_url: String,
    /// `IDEM_STORE_URL`: the idempotency records, if not in `database_url`.
    pub idem_store_url: Option<String>,
    /// `PAYMENT_LATENCY_MS`: how long the simulated card network takes.
    pub payment_latency: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            port: 3000,
            database_url: DEFAULT_DATABASE_URL.to_owned(),
            idem_store_url: None,
            payment_latency: Duration::ZERO,
        }
    }
}

impl Config {
    /// Reads `PORT`, `DATABASE_URL`, `IDEM_STORE_URL` and `PAYMENT_LATENCY_MS`.
    pub fn from_env() -> Result<Self, StartError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the variables through `lookup` (for tests); unset and empty variables take defaults.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, StartError> {
        let var = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        let defaults = Self::default();
        Ok(Self {
            port: match var("PORT") {
                Some(v) => v.trim().parse().map_err(|_| {
                    StartError::Config(format!("PORT must be a port number, not `{v}`"))
                })?,
                None => defaults.port,
            },
            database_url: var("DATABASE_URL").unwrap_or(defaults.database_url),
            idem_store_url: var("IDEM_STORE_URL"),
            payment_latency: match var("PAYMENT_LATENCY_MS") {
                Some(v) => Duration::from_millis(v.trim().parse().map_err(|_| {
                    StartError::Config(format!(
                        "PAYMENT_LATENCY_MS must be a whole number of milliseconds, not `{v}`"
                    ))
                })?),
                None => defaults.payment_latency,
            },
        })
    }
}

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A malformed environment variable.
    #[error("configuration: {0}")]
    Config(String),
    /// A URL scheme this build cannot serve yet.
    #[error("{0}")]
    Unsupported(String),
    /// The ledger database could not be opened.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The listener could not be bound, or serving failed.
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
}

/// The router state. Deriving `FromRef` hands each handler its part: the idempotent handlers take
/// the [`Engine`], the others the [`Ledger`].
#[derive(Debug, Clone, FromRef)]
pub struct AppState {
    /// The idempotency engine.
    pub engine: Engine,
    /// The payments ledger.
    pub ledger: Ledger,
    /// The simulated card network's latency.
    pub latency: Duration,
}

/// Opens the ledger and the idempotency store named by `config` and builds the router.
pub async fn app(config: &Config) -> Result<Router, StartError> {
    if !config.database_url.starts_with("sqlite:") {
        // TODO(integrator): a PostgreSQL ledger for `postgres://` once the PostgreSQL store lands.
        return Err(StartError::Unsupported(
            "DATABASE_URL: only sqlite: URLs are supported for the ledger so far".to_owned(),
        ));
    }
    let ledger = Ledger::open(&config.database_url).await?;
    let store_url = config
        .idem_store_url
        .as_deref()
        .unwrap_or(&config.database_url);
    let engine = Engine::from_arc(store::store_from_url(store_url).await?);
    Ok(router(AppState {
        engine,
        ledger,
        latency: config.payment_latency,
    }))
}

/// The routes over `state`.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route(
            "/payments",
            post(api::create_payment).get(api::list_payments),
        )
        .route("/payments/{id}", get(api::get_payment))
        .route("/payments/{id}/refund", post(api::refund_payment))
        .route("/legacy/payments", post(api::create_legacy_payment))
        .with_state(state)
}

/// Serves [`app`] on 127.0.0.1:`config.port` until Ctrl-C.
pub async fn serve(config: Config) -> Result<(), StartError> {
    let router = app(&config).await?;
    let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, config.port)).await?;
    tracing::info!("payments listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
