//! # idem: make retried HTTP requests safe
//!
//! A client that sends "charge 1000" and hears nothing cannot know whether the request or only the
//! answer was lost, so it retries with the same `Idempotency-Key`. idem recognises the retry: the
//! handler runs once, its response is stored, and every retry gets the stored response.
//!
//! A complete service (with the default features, `axum` and `sqlite`):
//!
//! ```no_run
//! use axum::{extract::FromRef, http::StatusCode, routing::post, Json, Router};
//! use idem_runtime::{idempotent, store::sqlite::SqliteStore, Engine};
//! use serde_json::Value;
//!
//! /// The router state: `#[idempotent]` takes the engine from it.
//! #[derive(Clone, FromRef)]
//! struct App {
//!     engine: Engine,
//! }
//!
//! /// Runs once per `Idempotency-Key`: every retry gets this 201 back, marked
//! /// `Idempotency-Replayed: true`. (`"global"`: one caller; a service with users names the
//! /// parameter that identifies the caller: see `idem_runtime::axum::Scope`.)
//! #[idempotent(scope = "global")]
//! async fn create_order(Json(order): Json<Value>) -> (StatusCode, Json<Value>) {
//!     (StatusCode::CREATED, Json(order))
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let engine = Engine::new(SqliteStore::connect("sqlite://idem.db?mode=rwc").await?);
//!     let app = Router::new()
//!         .route("/orders", post(create_order))
//!         .with_state(App { engine });
//!     let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//!     axum::serve(listener, app).await?;
//!     Ok(())
//! }
//! ```
//!
//! What is in the crate:
//!
//! - [`Engine`] is the claim / replay state machine, usable by hand.
//! - [`store`] holds the storage contract and its backends (memory, SQLite, PostgreSQL, Redis).
//! - [`Policy`] states ttl, lease, wait, what to do without a key, and what a replay returns.
//! - `axum` (feature `axum`) protects handlers with the `#[idempotent]` attribute, or with
//!   `IdempotencyLayer` for handlers that stay plain.
//! - [`metrics`] counts every decision, also through the `metrics` facade (feature `metrics`).
//! - [`sweeper::Sweeper`] purges records past retention in batches.
//! - [`transaction`] (PostgreSQL, SQLite) claims inside the application's own transaction, so that
//!   the effect and its stored response commit together: exactly once, even across crashes.
//! - `openapi` (feature `utoipa`) documents each idempotent handler's key header, replay headers
//!   and problem responses in the application's OpenAPI document.
//! - `testkit` (feature `testkit`) checks idem's contract on an application's own handlers, from
//!   its own tests.
//! - `client` (feature `client`) is the caller's half: a retrying reqwest client that sends one key
//!   per logical request and retries only where a retry can help.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![cfg_attr(not(test), warn(clippy::unwrap_used))]

pub mod admin;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub mod axum;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
pub mod clock;
mod coverage;
pub mod engine;
pub mod fingerprint;
pub mod function;
pub mod key;
pub mod metrics;
#[cfg(feature = "utoipa")]
#[cfg_attr(docsrs, doc(cfg(feature = "utoipa")))]
pub mod openapi;
pub mod policy;
pub mod record;
pub mod source;
pub mod store;
pub mod sweeper;
mod sync;
#[cfg(feature = "testkit")]
#[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
pub mod testkit;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
pub mod transaction;
mod wait;
mod waiters;

pub use engine::{Begin, ClaimGuard, Engine, Rejection, Replay};
pub use fingerprint::Fingerprint;
pub use key::{IdempotencyKey, KeyError};
pub use policy::Policy;
pub use record::{FencingToken, Record, RecordKey, RecordState, StoredResponse};
pub use store::{Store, StoreError, StoreErrorKind};
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
pub use transaction::{Transactional, Tx};

/// The sqlx that idem's SQL stores are built on, so that an application names the same version
/// (for its pool, its migrator and its queries).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
pub use sqlx;

/// The `http` crate whose header types a [`StoredResponse`] holds, so that code building or reading
/// one names the same version.
pub use http;

/// The `redis` crate this version of idem uses, so that applications name the same version.
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use redis;

#[cfg(feature = "axum")]
#[doc(hidden)]
pub use crate::axum::private as __private;

/// Makes an axum handler (feature `axum`), or any async function returning `Result` (with
/// `key = ...`, see [`function`]), idempotent. See [`idem_macros::idempotent`] for every option.
#[cfg(feature = "macros")]
#[cfg_attr(docsrs, doc(cfg(feature = "macros")))]
#[doc(inline)]
pub use idem_macros::idempotent;
