//! axum integration: the HTTP behaviour of `#[idempotent]` handlers.
//!
//! # Router state
//!
//! An idempotent handler takes the [`Engine`](crate::Engine) from the router state through axum's
//! [`FromRef`](::axum::extract::FromRef). Put the engine in your state struct and derive `FromRef`;
//! a router whose state holds no engine does not compile (the handler is "not a `Handler`"), so the
//! mistake never reaches a request.
//!
//! ```
//! use axum::extract::{FromRef, State};
//! use axum::routing::post;
//! use axum::Router;
//! use idem_runtime::store::memory::MemoryStore;
//! use idem_runtime::{idempotent, Engine};
//!
//! #[derive(Clone, FromRef)]
//! struct App {
//!     engine: Engine,
//!     // ... your own state: a database pool, configuration, ...
//!     greeting: &'static str,
//! }
//!
//! #[idempotent(scope = "global", ttl = "1h")]
//! async fn create(State(greeting): State<&'static str>, body: String) -> String {
//!     format!("{greeting}, {body}")
//! }
//!
//! let app = App { engine: Engine::new(MemoryStore::new()), greeting: "hello" };
//! let router: Router = Router::new().route("/things", post(create)).with_state(app);
//! # let _ = router;
//! ```
//!
//! Without the engine in the state, the router does not compile (`create` "is not a `Handler`"):
//!
//! ```compile_fail
//! # use axum::{extract::State, routing::post, Router};
//! # use idem_runtime::idempotent;
//! # #[idempotent(scope = "global")]
//! # async fn create(State(greeting): State<&'static str>, body: String) -> String { body }
//! let router: Router = Router::new().route("/things", post(create)).with_state("hello");
//! ```
//!
//! A router whose whole state is the engine works too: `Router::new().with_state(engine)`.
//!
//! # Without the attribute
//!
//! [`IdempotencyLayer`] gives plain handlers the same protection as a tower layer:
//! `post(refund).route_layer(IdempotencyLayer::new(engine, POLICY).scope::<AuthUser>())`. It
//! behaves as described below, except that all the handler's own extractors run after the key is
//! claimed and their rejections are stored, and it has no transactional mode (see its
//! documentation).
//!
//! # What a request goes through
//!
//! 1. **Body and extractors.** The body is read once (up to the handler's limit, else 413), and
//!    the handler's extractors of the request head run (auth, path, state). Their rejections
//!    (missing auth, say) are axum's own responses and come before any key is claimed. The last
//!    parameter's extractor, the one that reads the body (`Json<T>`, say), runs once the key is
//!    claimed: a replay answers with the stored response without it, even if the handler's body
//!    type has changed since (a retry across a deploy). Its rejection (bad JSON) is axum's own
//!    response, is not stored and releases the key, so a corrected retry with the same key still
//!    runs. A check that must refuse a request before its key is touched and needs the body (a
//!    webhook's signature, say) belongs in a middleware on the route. When the last parameter is the
//!    `scope` parameter, it is extracted first, as the key needs it. axum's own [`DefaultBodyLimit`](::axum::extract::DefaultBodyLimit) (2 MiB unless changed)
//!    still applies to the handler's body extractor: for a `max_body` above it, raise it on the
//!    route too.
//! 2. **The key.** One `Idempotency-Key` header of 1–255 visible ASCII characters, bare or as a
//!    structured-field string (`"abc"` is the key `abc`). Two headers or a malformed value: 400.
//!    A policy may read it from another header instead (`key_header`, a webhook's `webhook-id`) or
//!    from a JSON body field (`key_field`, by JSON Pointer); each source's keys are kept apart
//!    from every other source's (see [`source`](crate::source)).
//!    Without a key, the policy decides: `reject` (400), `pass` (run unprotected and count
//!    [`Outcome::MissingKeyPassed`](crate::metrics::Outcome::MissingKeyPassed); from `reject_after`
//!    on, 400), or `derive` (a key from the request's fingerprint, remembered for `derive_window`:
//!    double taps of the same request within the window run once).
//! 3. **The decision.** The key is scoped to the caller and bound to the request's fingerprint
//!    (method, path with query, canonical body; a policy may leave JSON members out of it or
//!    name the only ones that count, see [`Coverage`](crate::fingerprint::Coverage)). The [`Engine`](crate::Engine) answers execute,
//!    replay, or one of the problems below. A duplicate of a request still running waits for it (up
//!    to the policy's `wait`) and then replays its response.
//! 4. **Execute.** The handler runs in a task of its own, its claim renewed, so a client that hangs
//!    up cancels nothing. A 5xx response releases the key (unless the policy's `server_errors` stores
//!    it) and a panic releases it too: a retry runs the handler again. A 4xx is stored unless the
//!    policy's `client_errors` releases it (then the corrected retry with the same key runs). Any
//!    other status of the handler's (2xx and 3xx always) is stored, retried until the store takes
//!    it, and replayed to every retry; a rejection by the body's extractor (step 1) releases the key.
//!
//! Every response carries what idem did with its request, a [`RequestOutcome`], in its
//! extensions: the application's own middleware can count, log or alter replays with it.
//!
//! # Transactional mode
//!
//! With `#[idempotent(transaction = "tx")]` and a handler parameter `tx: Tx<Postgres>` (or
//! `Tx<Sqlite>`), the handler's writes through `tx.conn()` and its stored response commit together
//! after it returns. A 5xx or a panic rolls them back; a failed commit answers 503
//! (`store-unavailable`) instead of the handler's response. The router state provides the store's
//! [`Transactional`](crate::transaction::Transactional) engine through `FromRef`. See
//! [`transaction`](crate::transaction) for the guarantees.
//!
//! # Headers
//!
//! | header | on | value |
//! |---|---|---|
//! | `Idempotency-Replayed` | replays only | `true` |
//! | `Idempotency-Expires` | fresh and replayed responses, 422 problems | IMF-fixdate until which the key is remembered and bound to its request |
//! | `Retry-After` | 409 and 503 problems | seconds |
//!
//! A fresh response carries `Idempotency-Expires` only if it was stored; if the store failed to
//! record it (logged and counted as
//! [`Outcome::CompletionFailed`](crate::metrics::Outcome::CompletionFailed)), the client still gets
//! the response, without the promise.
//!
//! # What is stored and replayed
//!
//! In [`ReplayMode::Full`](crate::policy::ReplayMode::Full): the status, `Content-Type`,
//! `Content-Language`, `Location`, the policy's [`replay_headers`](crate::Policy::replay_headers),
//! and the body up to [`max_stored_body`](crate::Policy::max_stored_body). `Set-Cookie` and
//! hop-by-hop headers are never stored. In [`ReplayMode::Minimal`](crate::policy::ReplayMode::Minimal):
//! the status, `Location`, and `{"id": …}` when the body is a JSON object with a top-level `id`.
//!
//! Two cases fall back to minimal storage (status and `Location`, no id) whatever the mode: a body
//! larger than `max_stored_body` (it is still streamed whole to the first client), and a body whose
//! stream fails midway (the handler did run, so the key must not run it again; the first client gets
//! the stream error).
//!
//! # Problems
//!
//! Errors are RFC 9457 `application/problem+json` documents with a stable `type`: see
//! [`problem`] for the table of types, statuses and what a client should do.
//!
//! # Observability
//!
//! Every decision is a `tracing` event with target `idem` and fields `outcome`, `handler`, `scope`
//! and `key` (never bodies; a malformed key's value is not logged). The counters are in
//! [`Engine::metrics`](crate::Engine::metrics), and with the `metrics` feature in the
//! [`metrics`](crate::metrics) facade.

mod attempt;
pub mod layer;
mod outcome;
#[doc(hidden)]
pub mod private;
pub mod problem;
mod request;
mod respond;
mod run;
pub mod scope;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod transactional;

pub use attempt::Attempt;
pub use layer::IdempotencyLayer;
pub use outcome::RequestOutcome;
pub use problem::ProblemType;
pub use scope::Scope;

/// The header carrying the client's key (`Idempotency-Key`), as HTTP/2 and `http` spell names.
pub const KEY_HEADER: &str = crate::key::HEADER;

/// The header marking a replayed response (value `true`). Fresh responses do not carry it.
pub const REPLAYED_HEADER: &str = "idempotency-replayed";

/// The header telling until when the key is remembered (an IMF-fixdate, as in `Expires`).
pub const EXPIRES_HEADER: &str = "idempotency-expires";
