//! A small payments API protected by idem. Run with: `cargo run -p payments`
//!
//! The contract (stable; also in `examples/payments/README.md`):
//!
//! - **Environment.** `PORT` (default 3000; listens on 127.0.0.1; `0` picks a free port).
//!   `DATABASE_URL` (default `sqlite://payments.db?mode=rwc`, a file in the working directory;
//!   `sqlite://some/dir/payments.db?mode=rwc` works too, the directory is created;
//!   `postgres://user@host/db` for many instances) holds the ledger and, by default, the idempotency
//!   records. `IDEM_STORE_URL` optionally puts the idempotency records elsewhere: `redis://host:port`
//!   (with `?prefix=name` for the key prefix, default `idem`), `redis-cluster://host:port[,…]` (a
//!   Redis Cluster's seed nodes, same `prefix`), `postgres://...`, `sqlite:...` or
//!   `memory` (see [`store`]). `PAYMENT_LATENCY_MS` (default 0) simulates a slow card network.
//!   `HEADER_TIMEOUT_MS` (10000), `MAX_CONNECTIONS` (4096) and `SHUTDOWN_GRACE_MS` (25000) bound
//!   the server (see [`serve`](mod@serve)).
//! - **Start-up.** An unsupported URL, or a database or store that cannot be reached, stops the
//!   binary at start-up with a message naming the variable. Once it accepts connections, the binary
//!   prints one line to stdout, `payments listening on http://127.0.0.1:<port>` (logs go to stderr).
//! - **Auth.** `Authorization: Bearer <user-id>` (demo auth: the token is the user id); without it, 401.
//! - `POST /payments` with `{"amount": 1000, "currency": "KRW"}` → 201
//!   `{"id", "amount", "currency", "status": "captured"}` and `Location: /payments/{id}`.
//!   Idempotent, scoped to the user, `Idempotency-Key` required.
//! - `GET /payments`: the caller's payments, a JSON array, oldest first.
//! - `GET /payments/{id}`: the payment's current state; 404 for another user's payment.
//! - `POST /payments/{id}/refund` → 200 with `"status": "refunded"`. Idempotent, key required
//!   (through `IdempotencyLayer` rather than the attribute: the two behave alike).
//! - `POST /legacy/payments`: as `POST /payments`, for old app versions that send no key: without a
//!   key, identical requests within 10 s count as one (`missing_key = "derive"`).
//! - `POST /webhooks/card-network`: the card network's webhooks, Standard Webhooks deliveries
//!   signed with `WEBHOOK_SECRET` (default `whsec_cGF5bWVudHMtZXhhbXBsZS1zZWNyZXQ=`); no
//!   `Authorization`. `{"type": "charge.disputed", "data": {"payment_id": "<id>"}}` counts a
//!   dispute on the payment (`disputes` in `GET /payments/{id}`), once per `webhook-id`;
//!   redeliveries replay the stored 200. A bad or missing signature, or a timestamp more than 5
//!   minutes off: 401, no key claimed. An unknown payment: 404, stored. See [`webhooks`].
//! - `GET /charges`: what the (simulated) card network did for the caller, one element per charge:
//!   `{"id", "amount", "currency", "attempts", "refunded"}` (see [`card`]).
//! - `GET /metrics`: the metrics in Prometheus's text format, idem's `idem_requests_total`,
//!   `idem_store_duration_seconds` and `idem_wait_duration_seconds` among them (see [`metrics`]).
//! - `GET /openapi.json`: the OpenAPI 3.1 document of this API ([`ApiDoc`]), no auth needed. Each
//!   idempotent operation documents its `Idempotency-Key` header (required or not, ttl and
//!   retention), `Idempotency-Replayed` and `Idempotency-Expires`, and idem's problem responses.
//! - **Stopping.** SIGTERM or Ctrl-C: no new connections, the requests in progress answered, the
//!   payments still running finished and stored, exit 0, within `SHUTDOWN_GRACE_MS`.
//! - **Charge consumer.** `cargo run -p payments --bin charge-consumer`: the same payments, requested
//!   as RabbitMQ messages. `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`),
//!   `CHARGE_QUEUE` (default `charges`, declared durable if missing), `CHARGE_LEASE_MS` (10000),
//!   and the variables above for the ledger, the records and the card network. A message's body is
//!   `{"user": "<id>", "amount": 1000, "currency": "KRW"}` and its AMQP `message_id` its idempotency
//!   key (scoped to the user, apart from HTTP keys): one payment and one charge per `message_id`,
//!   acked once its outcome is stored; requeued while it runs elsewhere or a store is down;
//!   dead-lettered to `<queue>.dead` (reason in `x-dead-reason`) without a `message_id`, with a bad
//!   body, or with a `message_id` used for another body or expired. Prints `charge-consumer ready`
//!   once it consumes; SIGTERM or Ctrl-C drains: no new messages, those in progress finished and
//!   acked, exit 0 within `SHUTDOWN_GRACE_MS`. See [`consumer`].
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
pub mod card;
pub mod consumer;
pub mod ledger;
pub mod logs;
pub mod metrics;
mod problem;
pub mod serve;
pub mod store;
pub mod webhooks;

use axum::body::Bytes;
use axum::extract::FromRef;
use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::routing::{get, post, MethodRouter};
use axum::Router;
use idem_runtime::axum::IdempotencyLayer;
use idem_runtime::openapi::Idempotency;
use idem_runtime::store::mysql::MySqlStore;
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::store::sqlite::SqliteStore;
use idem_runtime::transaction::TransactionalStore;
use idem_runtime::{Engine, Transactional};
use ledger::Ledger;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

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
    /// `HEADER_TIMEOUT_MS`, `MAX_CONNECTIONS`, `SHUTDOWN_GRACE_MS`: the server's bounds.
    pub limits: serve::Limits,
    /// `WEBHOOK_SECRET`: the card network's Standard Webhooks secret (`whsec_` and base64).
    pub webhook_secret: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            port: 3000,
            database_url: DEFAULT_DATABASE_URL.to_owned(),
            idem_store_url: None,
            payment_latency: Duration::ZERO,
            limits: serve::Limits::default(),
            webhook_secret: webhooks::DEFAULT_WEBHOOK_SECRET.to_owned(),
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
        let millis = |name: &str, default: Duration| match var(name) {
            Some(v) => v.trim().parse().map(Duration::from_millis).map_err(|_| {
                StartError::Config(format!(
                    "{name} must be a whole number of milliseconds, not `{v}`"
                ))
            }),
            None => Ok(default),
        };
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
            payment_latency: millis("PAYMENT_LATENCY_MS", defaults.payment_latency)?,
            limits: serve::Limits {
                header_timeout: millis("HEADER_TIMEOUT_MS", defaults.limits.header_timeout)?,
                max_connections: match var("MAX_CONNECTIONS") {
                    Some(v) => v.trim().parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                        StartError::Config(format!(
                            "MAX_CONNECTIONS must be a positive whole number, not `{v}`"
                        ))
                    })?,
                    None => defaults.limits.max_connections,
                },
                shutdown_grace: millis("SHUTDOWN_GRACE_MS", defaults.limits.shutdown_grace)?,
            },
            webhook_secret: var("WEBHOOK_SECRET").unwrap_or(defaults.webhook_secret),
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
    /// A URL scheme this build cannot serve.
    #[error("{0}")]
    Unsupported(String),
    /// The ledger database (`DATABASE_URL`) could not be opened.
    #[error("DATABASE_URL: {0}")]
    Database(#[from] sqlx::Error),
    /// The idempotency store could not be opened.
    #[error("{0}")]
    Store(String),
    /// The listener could not be bound, or serving failed.
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
    /// The charge consumer could not connect to the broker (`AMQP_URL`), or declare or consume its
    /// queue.
    #[error("{0}")]
    Broker(String),
}

/// The router state. Deriving `FromRef` hands each handler its part: the idempotent handlers take
/// the [`Engine`], the others the [`Ledger`].
#[derive(Debug, Clone, FromRef)]
pub struct AppState {
    /// The idempotency engine.
    pub engine: Engine,
    /// The payments ledger.
    pub ledger: Ledger,
    /// The (simulated) card network.
    pub card: card::CardNetwork,
    /// The card network's webhook secret.
    pub webhook_secret: webhooks::WebhookSecret,
    /// The background tasks (the sweeper); they stop when the last clone of the state is dropped.
    #[from_ref(skip)]
    pub background: Background,
    /// Set when the records share the ledger's database: `POST /payments` then runs in
    /// transactional mode (the payment, the claim and the stored response commit together).
    #[from_ref(skip)]
    pub transactional: Option<Txn>,
}

/// The transactional engine over the store that shares the ledger's database.
#[derive(Debug, Clone)]
pub enum Txn {
    /// Ledger and records in one SQLite file.
    Sqlite(Transactional<SqliteStore>),
    /// Ledger and records in one PostgreSQL database.
    Postgres(Transactional<PostgresStore>),
    /// Ledger and records in one MySQL or MariaDB database.
    MySql(Transactional<MySqlStore>),
}

/// The state of `POST /payments` in transactional mode: the app's, plus the transactional engine.
pub(crate) struct TxState<S: TransactionalStore> {
    txn: Transactional<S>,
    app: AppState,
}

impl<S: TransactionalStore> Clone for TxState<S> {
    fn clone(&self) -> Self {
        Self {
            txn: self.txn.clone(),
            app: self.app.clone(),
        }
    }
}

impl<S: TransactionalStore> FromRef<TxState<S>> for Transactional<S> {
    fn from_ref(state: &TxState<S>) -> Self {
        state.txn.clone()
    }
}

impl<S: TransactionalStore> FromRef<TxState<S>> for AppState {
    fn from_ref(state: &TxState<S>) -> Self {
        state.app.clone()
    }
}

/// Background tasks owned by the state: aborted when the last clone is dropped, so that a router
/// dropped in a test (or a server that stops) leaves no sweeper running on its store.
#[derive(Debug, Clone, Default)]
pub struct Background {
    _tasks: Arc<Vec<AbortOnDrop>>,
}

impl Background {
    /// Owns the spawned `tasks`: they are aborted when the last clone is dropped.
    pub fn own(tasks: impl IntoIterator<Item = tokio::task::JoinHandle<()>>) -> Self {
        Self {
            _tasks: Arc::new(tasks.into_iter().map(AbortOnDrop).collect()),
        }
    }
}

#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The scheme of a URL: what comes before the first `:` (`sqlite`, `postgres`, `redis`, `memory`).
pub(crate) fn scheme(url: &str) -> &str {
    url.split(':').next().unwrap_or_default()
}

/// Opens the ledger and the idempotency store named by `config` and builds the router. The records
/// go to `IDEM_STORE_URL` if set, else into the ledger's database on the ledger's pool; a sweeper
/// purging records past retention runs as long as the router lives.
pub async fn app(config: &Config) -> Result<Router, StartError> {
    Ok(router(state(config).await?))
}

/// Opens the ledger, the card network and the idempotency store named by `config`: the router's
/// state.
pub async fn state(config: &Config) -> Result<AppState, StartError> {
    let ledger = Ledger::open(&config.database_url).await?;
    let records = store::open(config.idem_store_url.as_deref(), &ledger).await?;
    tracing::info!(records = %records.describe, "idempotency store ready");
    // Installed before the engine decides anything, so that `GET /metrics` counts every decision.
    let upkeep = metrics::prometheus().map(|handle| tokio::spawn(metrics::upkeep(handle)));
    let background = Background::own(
        [tokio::spawn(records.sweeper.run())]
            .into_iter()
            .chain(upkeep),
    );
    // With the records in the ledger's database, one engine serves both kinds of handler: the
    // transactional one's.
    let (engine, transactional) = match records.shared {
        Some(store::SharedStore::Sqlite(store)) => {
            let txn = Transactional::new(store);
            (txn.engine().clone(), Some(Txn::Sqlite(txn)))
        }
        Some(store::SharedStore::Postgres(store)) => {
            let txn = Transactional::new(store);
            (txn.engine().clone(), Some(Txn::Postgres(txn)))
        }
        Some(store::SharedStore::MySql(store)) => {
            let txn = Transactional::new(store);
            (txn.engine().clone(), Some(Txn::MySql(txn)))
        }
        None => (Engine::from_arc(records.store), None),
    };
    let card = card::CardNetwork::new(ledger.database().clone(), config.payment_latency);
    let webhook_secret = webhooks::WebhookSecret::new(&config.webhook_secret)?;
    Ok(AppState {
        engine,
        ledger,
        card,
        webhook_secret,
        background,
        transactional,
    })
}

/// The routes over `state`.
pub fn router(state: AppState) -> Router {
    // With the records in the ledger's database, the create claims its key in the transaction that
    // writes the payment; otherwise (IDEM_STORE_URL elsewhere) it is idempotent the default way.
    let create = match &state.transactional {
        Some(Txn::Sqlite(txn)) => post(api::create_payment_in_sqlite).with_state(TxState {
            txn: txn.clone(),
            app: state.clone(),
        }),
        Some(Txn::Postgres(txn)) => post(api::create_payment_in_postgres).with_state(TxState {
            txn: txn.clone(),
            app: state.clone(),
        }),
        Some(Txn::MySql(txn)) => post(api::create_payment_in_mysql).with_state(TxState {
            txn: txn.clone(),
            app: state.clone(),
        }),
        None => post(api::create_payment),
    };
    // The refund's handler is plain: the layer protects it as the attribute protects the creates.
    let refunds =
        IdempotencyLayer::new(state.engine.clone(), api::REFUNDS).scope::<auth::AuthUser>();
    Router::new()
        .route("/payments", create.get(api::list_payments))
        .route("/payments/{id}", get(api::get_payment))
        .route(
            "/payments/{id}/refund",
            post(api::refund_payment).route_layer(refunds),
        )
        .route("/legacy/payments", post(api::create_legacy_payment))
        .route("/charges", get(api::list_charges))
        .route(
            "/webhooks/card-network",
            post(webhooks::card_network_webhook).route_layer(axum::middleware::from_fn_with_state(
                state.clone(),
                webhooks::verify,
            )),
        )
        .route("/metrics", get(metrics::render))
        .route("/openapi.json", openapi_json())
        .with_state(state)
}

/// The API's OpenAPI document, served at `GET /openapi.json`.
///
/// Each idempotent handler carries `#[utoipa::path]` below `#[idempotent]`, which adds the
/// handler's `Idempotency-Key` header from its policy; the [`Idempotency`] modifier, once here,
/// adds the replay headers and idem's problem responses to those operations.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(title = "payments", description = "A small payments API protected by idem."),
    paths(
        api::create_payment,
        api::list_payments,
        api::get_payment,
        api::refund_payment,
        api::create_legacy_payment,
        api::list_charges,
        webhooks::card_network_webhook,
    ),
    security(("bearer" = [])),
    modifiers(&Idempotency, &BearerAuth),
)]
pub struct ApiDoc;

/// The demo's bearer scheme: the token is the user id.
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        let bearer = HttpBuilder::new()
            .scheme(HttpAuthScheme::Bearer)
            .bearer_format("user id")
            .description(Some(
                "Demo auth: the token is the user id, 1 to 4096 of a-z, 0-9, - and _.",
            ));
        let components = api.components.get_or_insert_with(Default::default);
        components.add_security_scheme("bearer", SecurityScheme::Http(bearer.build()));
    }
}

/// `GET /openapi.json`: [`ApiDoc`], serialised once, when the router is built.
fn openapi_json() -> MethodRouter<AppState> {
    let document = match ApiDoc::openapi().to_json() {
        Ok(json) => Ok(Bytes::from(json)),
        Err(e) => {
            tracing::error!(error = %e, "the OpenAPI document could not be serialised");
            Err(StatusCode::INTERNAL_SERVER_ERROR)
        }
    };
    get(move || {
        let document = document.clone();
        async move { document.map(|json| ([(CONTENT_TYPE, "application/json")], json)) }
    })
}

/// The service, bound to its port and ready to [`run`](Self::run).
#[derive(Debug)]
pub struct Server {
    listener: tokio::net::TcpListener,
    state: AppState,
    limits: serve::Limits,
}

impl Server {
    /// Opens the stores ([`state`]) and binds 127.0.0.1:`config.port` (`0`: a free port).
    pub async fn bind(config: &Config) -> Result<Self, StartError> {
        let state = state(config).await?;
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, config.port)).await?;
        Ok(Self {
            listener,
            state,
            limits: config.limits,
        })
    }

    /// The address the service listens on.
    pub fn local_addr(&self) -> Result<SocketAddr, StartError> {
        Ok(self.listener.local_addr()?)
    }

    /// Serves until SIGTERM or Ctrl-C, then stops gracefully: no new connections, the requests in
    /// progress answered, and the handlers idem still runs for clients that left (and their stored
    /// responses) finished, all within the shutdown grace period.
    pub async fn run(self) -> Result<(), StartError> {
        let engine = self.state.engine.clone();
        let grace = self.limits.shutdown_grace;
        let stopped_at = serve::serve(
            self.listener,
            router(self.state),
            self.limits,
            stop_signal(),
        )
        .await;
        tracing::info!("stopped accepting; finishing the handlers still running");
        let left = grace.saturating_sub(stopped_at.elapsed());
        if !engine.shutdown(left).await {
            tracing::warn!("handlers still running at the end of the shutdown grace period; their keys are taken over once their lease runs out");
        }
        Ok(())
    }
}

/// Resolves on SIGTERM (what a deploy sends) or Ctrl-C.
pub async fn stop_signal() {
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                term.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
    tracing::info!("stop signal received");
}

/// Serves [`app`] on 127.0.0.1:`config.port` until SIGTERM or Ctrl-C.
pub async fn serve(config: Config) -> Result<(), StartError> {
    let server = Server::bind(&config).await?;
    tracing::info!("payments listening on http://{}", server.local_addr()?);
    server.run().await
}
