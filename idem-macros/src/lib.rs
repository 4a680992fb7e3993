//! The `#[idempotent]` attribute. Use it through `idem-runtime`, which re-exports it as
//! `idem_runtime::idempotent`; this crate has no other API.
//!
//! Internals: `options.rs` lists the options, `attr.rs` parses the arguments, `config.rs`
//! validates them against the handler, `values.rs` reads durations, dates, sizes and enum values,
//! `names.rs` reads header names and JSON Pointers, `expand.rs` rewrites the handler, `policy.rs`
//! builds the policy constant of both modes, and `function.rs` validates and rewrites a plain
//! async function (`key = ...`).

#[macro_use]
mod options;
mod attr;
mod config;
mod expand;
mod function;
mod names;
mod policy;
mod values;

use proc_macro::TokenStream;

/// Makes an axum handler idempotent: a retried request (same `Idempotency-Key`, same caller, same
/// request) gets the stored response of the first one instead of running the handler again.
/// With `key = ...`, it makes any `async fn` returning `Result` run once per key instead: see
/// [On plain async functions](#on-plain-async-functions).
///
/// ```
/// # use axum::{extract::{FromRef, FromRequestParts, State}, http::{request::Parts, StatusCode}, Json};
/// # use idem_runtime::axum::Scope;
/// # use std::borrow::Cow;
/// # #[derive(serde::Deserialize)] struct NewPayment { amount: u64 }
/// # struct AuthUser { id: String }
/// # impl<S: Send + Sync> FromRequestParts<S> for AuthUser {
/// #     type Rejection = StatusCode;
/// #     async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> { Ok(AuthUser { id: "u1".into() }) }
/// # }
/// use idem_runtime::{idempotent, Engine};
///
/// #[derive(Clone)]
/// struct App {
///     idem: Engine,
///     // ... the application's own state
/// }
///
/// // The generated code takes the engine from the router state: a router whose state has no
/// // `Engine` does not compile.
/// impl FromRef<App> for Engine {
///     fn from_ref(app: &App) -> Engine {
///         app.idem.clone()
///     }
/// }
///
/// // Keys are unique per caller: the `scope` parameter's type says who is asking.
/// impl Scope for AuthUser {
///     fn scope_id(&self) -> Cow<'_, str> {
///         Cow::Borrowed(&self.id)
///     }
/// }
///
/// #[idempotent(scope = "user", ttl = "24h")]
/// async fn create_payment(
///     State(app): State<App>,
///     user: AuthUser,
///     Json(req): Json<NewPayment>,
/// ) -> (StatusCode, String) {
///     (StatusCode::CREATED, format!("{} paid {}", user.id, req.amount))
/// }
///
/// let router: axum::Router<App> = axum::Router::new()
///     .route("/payments", axum::routing::post(create_payment));
/// ```
///
/// The handler keeps its extractors, its body and its return type (anything that implements
/// `IntoResponse`, including `Result` with `?` in the body). Extractor rejections never burn the
/// key: those of the request head (no credentials) come before the key is claimed, and the last
/// parameter's (bad JSON) after it, releasing it. That last extractor, which reads the body, runs
/// only for a request that claimed its key, so a replay answers without it.
///
/// # Options
///
/// Every option is checked at compile time; a mistake is an error on the literal you wrote, with
/// the accepted forms and, for a near miss, the probable meaning (`"24 hours"` → `"24h"`). The
/// defaults are [`Policy::new`]'s: an option left out is not set by the attribute. The last
/// column says where an option applies: to axum handlers, to plain async functions (`key = ...`),
/// or to both; an option written where it does not apply is an error that says why.
///
#[doc = options_table!()]
///
/// **Durations** are one whole number and one unit, no spaces: `s`, `m`, `h`, `d` (`"90s"`,
/// `"15m"`, `"24h"`, `"7d"`). `lease` and `wait` also take `ms` (`"250ms"`), as sub-second values
/// make sense only for them.
///
/// ## `scope = "<parameter>"` (required)
///
/// Names the handler parameter that identifies the caller. It must be a parameter bound to a plain
/// name (`user: AuthUser` or `mut user: AuthUser`, not `Extension(user): Extension<AuthUser>`),
/// and its type must implement [`Scope`]; if not, the error points at the type. One caller's key
/// never returns another caller's response. (On a plain async function, `scope` is an expression:
/// see [below](#on-plain-async-functions).)
///
/// `scope = "global"` opts out: all callers share one key space. Use it for endpoints without
/// callers to tell apart (a webhook receiver that dedupes on the sender's event id), never for
/// per-user data. `"global"` always means this, even if a parameter is called `global`. It cannot be
/// combined with `missing_key = "derive"`, under which two callers sending the same body would share
/// one execution: that is a compile error.
///
/// ## `ttl`, `retain`, `lease`, `wait`
///
/// - `ttl`: how long a completed key is replayed. After it, the key answers 410 *expired*.
/// - `retain`: how long, counted from the claim, the record is kept as a tombstone so a late
///   retry gets *expired* instead of running again. At least `ttl`.
/// - `lease`: how long a claim may stay in flight before another request may take it over (the
///   original worker is presumed dead). Longer than the handler's slowest run.
/// - `wait`: how long a duplicate waits for the in-flight original before answering 409 with
///   `Retry-After`; `"0s"` answers 409 at once.
///
/// ```
/// # use idem_runtime::idempotent; use axum::extract::State;
/// # #[derive(Clone)] struct App; impl axum::extract::FromRef<App> for idem_runtime::Engine { fn from_ref(_: &App) -> Self { unimplemented!() } }
/// #[idempotent(scope = "global", ttl = "1h", retain = "30d", lease = "45s", wait = "500ms")]
/// async fn receive_webhook(State(app): State<App>, body: String) -> &'static str {
///     "ok"
/// }
/// # let _: axum::Router<App> = axum::Router::new().route("/", axum::routing::post(receive_webhook));
/// ```
///
/// ## `missing_key`, `derive_window`, `reject_after`
///
/// What to do with a request that carries no `Idempotency-Key`:
///
/// - `"reject"` (default): 400; the endpoint requires a key.
/// - `"pass"`: run the handler unprotected and count it, so operators see when clients are ready
///   for `"reject"`. Add `reject_after = "2027-03-01"` to pass until that date and reject from its
///   midnight UTC on: a migration with a deadline, stated in code.
/// - `"derive"`: derive the key from the scope, method, path and canonical body, valid for
///   `derive_window` (default `"10s"`, at most `ttl`): a stop-gap against double taps from clients
///   that cannot be updated yet. Identical requests inside the window are treated as one.
///
/// ```
/// # use idem_runtime::idempotent; use axum::extract::State;
/// # #[derive(Clone)] struct App; impl axum::extract::FromRef<App> for idem_runtime::Engine { fn from_ref(_: &App) -> Self { unimplemented!() } }
/// # struct AuthUser; impl idem_runtime::axum::Scope for AuthUser { fn scope_id(&self) -> std::borrow::Cow<'_, str> { "u".into() } }
/// # impl<S: Send + Sync> axum::extract::FromRequestParts<S> for AuthUser { type Rejection = (); async fn from_request_parts(_: &mut axum::http::request::Parts, _: &S) -> Result<Self, ()> { Ok(AuthUser) } }
/// #[idempotent(scope = "user", missing_key = "derive", derive_window = "5s")]
/// async fn legacy_create(user: AuthUser, body: String) -> &'static str {
///     "created"
/// }
///
/// #[idempotent(scope = "user", missing_key = "pass", reject_after = "2027-03-01")]
/// async fn refund(user: AuthUser, body: String) -> &'static str {
///     "refunded"
/// }
/// # let _: axum::Router<App> = axum::Router::new().route("/a", axum::routing::post(legacy_create)).route("/b", axum::routing::post(refund));
/// ```
///
/// The adoption path for an existing endpoint: `"pass"` (watch the counter), then `"pass"` with
/// `reject_after`, then `"reject"`.
///
/// ## `replay`
///
/// - `"full"` (default): a replay returns the stored status, replayable headers and body.
/// - `"minimal"`: only the status, `Location` and the resource id; keeps the store small and sends
///   clients to the current state behind `Location`.
///
/// ## `server_errors`
///
/// What a 5xx response from the handler does to the key:
///
/// - `"release"` (default): the response is not stored and the key is released, so a retry runs
///   the handler again. Right when a 5xx means the effect did not happen.
/// - `"store"`: the response is stored and replayed like any other status. Right when a 5xx may
///   come after the effect happened (a timeout from a payment provider after the charge went
///   through), where running the handler again could repeat it.
///
/// ## `client_errors`
///
/// What a 4xx response from the handler does to the key (2xx and 3xx are always stored):
///
/// - `"store"` (default): stored and replayed to every retry with the key; a client that corrects
///   its request must send it under a new key (with the same key and another body it gets 422).
///   Right when a 4xx is that request's final answer (a card declined, an unknown account).
/// - `"release"`: not stored; the key is released, so the corrected retry with the same key runs
///   the handler. Right when a 4xx means nothing happened (a validation error). In transactional
///   mode the handler's writes are rolled back, as for a 5xx.
///
/// ## `key_header`, `key_field`: where the key comes from
///
/// By default the key is the `Idempotency-Key` header. `key_header = "webhook-id"` reads it from
/// another header (Standard Webhooks' `webhook-id`, GitHub's `X-GitHub-Delivery`; any case, read
/// as the `Idempotency-Key` is: sent once, 1 to 255 visible ASCII characters).
/// `key_field = "/data/request_id"` reads it from the JSON body, by JSON Pointer (RFC 6901:
/// `/` before each member's name, `~0` for `~` and `~1` for `/` inside a name): a string of 1 to
/// 255 visible ASCII characters, or an integer. A request without it (no such header, no such
/// member, `null`, or a body that is not JSON) follows `missing_key`. A malformed header name or
/// pointer is a compile error on the literal (`"data.request_id"` suggests
/// `"/data/request_id"`); naming both options is one too.
///
/// Keys from different sources never meet: a `webhook-id` of `abc`, a body field `abc` and an
/// `Idempotency-Key: abc` are three keys, each apart from derived keys too. The body field a key
/// is read from is never part of the request's fingerprint.
///
/// ## `fingerprint_exclude`, `fingerprint_only`: what makes a retry the same request
///
/// By default the fingerprint is the method, the path with its query and the whole body (JSON
/// compared by meaning). `fingerprint_exclude = ["/sent_at", "/meta/trace_id"]` leaves JSON
/// members out, nested ones included, so a retry whose timestamp or trace id changed is still the
/// same request; `fingerprint_only = ["/amount", "/currency"]` counts only the members named (a
/// member sent as `null` differs from one left out). Each entry is a JSON Pointer checked at
/// compile time; an array element is blanked, not removed, so later elements keep their places.
/// A body that is not JSON is compared whole. The two cannot be combined, and `fingerprint_only`
/// cannot name the `key_field`.
///
/// A retry that differs only in excluded members gets the stored response **as it was**: what
/// the first request's excluded members produced (an echoed `sent_at`, say) is replayed, and the
/// retry's own values are never seen.
///
/// ```
/// # use idem_runtime::idempotent; use axum::extract::State;
/// # #[derive(Clone)] struct App; impl axum::extract::FromRef<App> for idem_runtime::Engine { fn from_ref(_: &App) -> Self { unimplemented!() } }
/// // A provider redelivers until it gets a 2xx, with a new `sent_at` and `trace_id` each time.
/// #[idempotent(scope = "global", key_header = "webhook-id", fingerprint_exclude = ["/sent_at", "/meta/trace_id"])]
/// async fn receive_event(body: String) -> &'static str {
///     "received"
/// }
///
/// // Google's AIP-155: the request id is in the body.
/// #[idempotent(scope = "global", key_field = "/request_id", client_errors = "release")]
/// async fn create_book(body: String) -> axum::http::StatusCode {
///     axum::http::StatusCode::CREATED
/// }
/// # let _: axum::Router<App> = axum::Router::new().route("/a", axum::routing::post(receive_event)).route("/b", axum::routing::post(create_book));
/// ```
///
/// ## `max_body`
///
/// The largest request body accepted (413 beyond). The body is buffered once to fingerprint it
/// and then handed to the handler's own body extractor. Units `B`, `KiB`, `MiB`, `GiB`
/// (`"1MB"` is refused as ambiguous, with the `MiB` spelling suggested).
///
/// ```
/// # use idem_runtime::idempotent; use axum::extract::State;
/// # #[derive(Clone)] struct App; impl axum::extract::FromRef<App> for idem_runtime::Engine { fn from_ref(_: &App) -> Self { unimplemented!() } }
/// # struct AuthUser; impl idem_runtime::axum::Scope for AuthUser { fn scope_id(&self) -> std::borrow::Cow<'_, str> { "u".into() } }
/// # impl<S: Send + Sync> axum::extract::FromRequestParts<S> for AuthUser { type Rejection = (); async fn from_request_parts(_: &mut axum::http::request::Parts, _: &S) -> Result<Self, ()> { Ok(AuthUser) } }
/// use axum::http::{header::LOCATION, StatusCode};
///
/// #[idempotent(scope = "user", replay = "minimal", max_body = "64KiB")]
/// async fn upload_receipt(user: AuthUser, body: axum::body::Bytes) -> (StatusCode, [(axum::http::HeaderName, String); 1]) {
///     (StatusCode::CREATED, [(LOCATION, format!("/receipts/{}", body.len()))])
/// }
/// # let _: axum::Router<App> = axum::Router::new().route("/", axum::routing::post(upload_receipt));
/// ```
///
/// ## `policy = PATH`: one policy for many handlers
///
/// A service states its payment policy once, as a `const` built with [`Policy`]'s `const fn`s,
/// and names it in each handler. Options written in the attribute override the named policy's
/// values:
///
/// ```
/// # use idem_runtime::idempotent; use axum::extract::State;
/// # #[derive(Clone)] struct App; impl axum::extract::FromRef<App> for idem_runtime::Engine { fn from_ref(_: &App) -> Self { unimplemented!() } }
/// # struct AuthUser; impl idem_runtime::axum::Scope for AuthUser { fn scope_id(&self) -> std::borrow::Cow<'_, str> { "u".into() } }
/// # impl<S: Send + Sync> axum::extract::FromRequestParts<S> for AuthUser { type Rejection = (); async fn from_request_parts(_: &mut axum::http::request::Parts, _: &S) -> Result<Self, ()> { Ok(AuthUser) } }
/// use idem_runtime::policy::{Policy, ReplayMode};
/// use std::time::Duration;
///
/// pub const PAYMENTS: Policy = Policy::new()
///     .ttl(Duration::from_secs(24 * 3600))
///     .retain(Duration::from_secs(30 * 24 * 3600))
///     .replay(ReplayMode::Minimal);
///
/// #[idempotent(scope = "user", policy = PAYMENTS)]
/// async fn create_payment(user: AuthUser, body: String) -> &'static str {
///     "created"
/// }
///
/// #[idempotent(scope = "user", policy = PAYMENTS, replay = "full")] // overrides `replay`
/// async fn refund_payment(user: AuthUser, body: String) -> &'static str {
///     "refunded"
/// }
/// # let _: axum::Router<App> = axum::Router::new().route("/a", axum::routing::post(create_payment)).route("/b", axum::routing::post(refund_payment));
/// ```
///
/// The named policy is still checked at compile time: each handler's policy is a `const` ending in
/// [`Policy::checked`], so a contradiction (say `retain` shorter than `ttl`, or a `derive_window`
/// longer than `ttl`) stops the build with an "evaluation panicked: idem policy: …" error
/// pointing at `policy = PAYMENTS`. Without `policy`, unset options take [`Policy::new`]'s
/// defaults.
///
/// A rule between two options is checked on the handler's final policy, written options and
/// defaults (or the named policy's values) together, when that `const` is evaluated: a `retain`
/// shorter than the policy's `ttl`, a `derive_window` longer than it, a `reject_after` where
/// `missing_key` is not `"pass"`. The error ("evaluation panicked: …") points at the option you
/// wrote and says what to change.
///
/// ## `transaction = "<parameter>"`: exactly once, in the application's transaction
///
/// Names a parameter of type `idem_runtime::Tx<Postgres>` or `Tx<Sqlite>` (from
/// `idem_runtime::sqlx`). That parameter is no extractor: it is a transaction on the store's pool
/// that begins at its first use (`tx.conn().await?`). After the handler returns, idem stores the
/// response in that transaction and commits: the handler's writes and the stored response commit
/// together or not at all. The key is claimed first, in a commit of its own, so that duplicates
/// wait for it without holding a connection, and nothing holds a database lock while the handler
/// calls other services: make those calls before the first `tx.conn()`, passing them the
/// `Attempt` extractor's downstream key. A crash before the commit leaves no write behind and the
/// retry takes the key over once its lease runs out; after it, the retry replays. A 5xx or a
/// panic rolls the transaction back and releases the key; a failed commit answers 503 instead of
/// the handler's response. See `idem_runtime::transaction`.
///
/// The router state must provide the store's `idem_runtime::Transactional` engine (`FromRef`),
/// which the application's tables share with idem's records (same database). A state without it
/// does not compile: the route reports that the handler, whose last parameter is then
/// `WithBody<_, _, TxState<Tx<...>>>`, is not a `Handler` for that state. A `Tx` parameter without the
/// `transaction` option does not compile either (`Tx` is no extractor), and a parameter of
/// another type is reported at its type: "`...` is not an idem transaction type".
///
/// ```
/// # use idem_runtime::idempotent;
/// # struct AuthUser { id: String } impl idem_runtime::axum::Scope for AuthUser { fn scope_id(&self) -> std::borrow::Cow<'_, str> { std::borrow::Cow::Borrowed(&self.id) } }
/// # impl<S: Send + Sync> axum::extract::FromRequestParts<S> for AuthUser { type Rejection = (); async fn from_request_parts(_: &mut axum::http::request::Parts, _: &S) -> Result<Self, ()> { Ok(AuthUser { id: "u".into() }) } }
/// use axum::extract::FromRef;
/// use axum::http::StatusCode;
/// use idem_runtime::sqlx::{self, Sqlite};
/// use idem_runtime::store::sqlite::SqliteStore;
/// use idem_runtime::{Engine, Transactional, Tx};
///
/// #[derive(Clone, FromRef)]
/// struct App {
///     engine: Engine,                      // for the other idempotent handlers
///     txn: Transactional<SqliteStore>,     // for the transactional ones
/// }
///
/// #[idempotent(scope = "user", transaction = "tx")]
/// async fn create_payment(user: AuthUser, mut tx: Tx<Sqlite>, body: String) -> StatusCode {
///     // Calls to other services first, outside the transaction; then the writes.
///     let written = match tx.conn().await {
///         Ok(conn) => sqlx::query("INSERT INTO payments (owner, body) VALUES (?, ?)")
///             .bind(&user.id)
///             .bind(&body)
///             .execute(conn)
///             .await,
///         Err(e) => Err(e),
///     };
///     match written {
///         Ok(_) => StatusCode::CREATED,
///         Err(_) => StatusCode::INTERNAL_SERVER_ERROR, // 5xx: rolled back, a retry runs again
///     }
/// }
/// # let _: axum::Router<App> = axum::Router::new().route("/", axum::routing::post(create_payment));
/// ```
///
/// # On plain async functions
///
/// A queue consumer, a job or a call to another service hears the same retries as an HTTP
/// server: a message redelivered, a job run again. `key = <expression>` makes any `async fn`
/// returning `Result<T, E>` run once per key, through [`Engine::once`]: the first call runs the
/// body and stores its `Ok` output (as JSON); every later call with the key gets that output
/// without running the body, and a call made while the first one runs waits for it.
///
/// ```
/// use idem_runtime::function::OnceError;
/// use idem_runtime::store::memory::MemoryStore;
/// use idem_runtime::{idempotent, Engine};
///
/// #[derive(serde::Serialize)]
/// struct ChargeMessage { id: String, user: u64, amount: u64 }
///
/// /// A declined card is a final answer: an `Ok` output, stored and returned to every retry.
/// #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
/// enum Charge { Captured { receipt: String }, Declined }
///
/// #[derive(Debug)]
/// enum ChargeError { Network, Idem(OnceError) }
///
/// // The engine's own errors (another input under the same key, a store down) reach the caller
/// // through the function's error type.
/// impl From<OnceError> for ChargeError {
///     fn from(e: OnceError) -> Self { ChargeError::Idem(e) }
/// }
///
/// struct Consumer { engine: Engine }
///
/// impl Consumer {
///     #[idempotent(engine = self.engine, scope = msg.user, key = msg.id, input = msg,
///                  attempt = attempt, ttl = "24h", lease = "30s")]
///     async fn charge(&self, msg: ChargeMessage) -> Result<Charge, ChargeError> {
///         if msg.amount == 0 {
///             return Ok(Charge::Declined);
///         }
///         // Pass `attempt.downstream_key()` to the card network: it is the same on every attempt
///         // at this key, a takeover after a crash included, so the card is charged once.
///         let receipt = format!("{} under {}", msg.amount, attempt.downstream_key());
///         Ok(Charge::Captured { receipt })
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), ChargeError> {
/// let consumer = Consumer { engine: Engine::new(MemoryStore::new()) };
/// let message = || ChargeMessage { id: "msg-7f3a".into(), user: 42, amount: 1000 };
/// let first = consumer.charge(message()).await?;
/// // The redelivery gets the stored output; the body does not run again.
/// assert_eq!(consumer.charge(message()).await?, first);
/// # Ok(()) }
/// ```
///
/// The options that name code are expressions here, evaluated in this order when the function is
/// called, before its body (they may borrow the parameters, which the body then takes):
///
/// - `engine` (required): an [`Engine`], `&Engine` or `Arc<Engine>`, like `engine = self.engine`.
/// - `scope` (required): whose call this is, any `Display` (`scope = msg.user`); keys are unique
///   per scope. A string literal is a fixed scope (`scope = "billing"`), shared by every call;
///   a string that names a parameter is refused, as it is the handler form (write the name
///   without quotes).
/// - `key` (required, and what selects this mode): the call's idempotency key, any `Display`
///   (`key = msg.id`, `key = format!("{}-{}", order.id, line)`).
/// - `input` (required): any `Serialize`, whose fingerprint tells a retry of this call from
///   another call that reuses its key; the latter gets [`OnceError`]'s `Rejected(Mismatch)`
///   through `E` instead of the first call's output. `input = ()` opts out of the check: every
///   call with the key then gets the first call's output, whatever its input.
/// - `attempt = <name>` (optional): binds the [`Attempt`] in the body, for its `downstream_key()`
///   and `taken_over()`.
///
/// `ttl`, `retain`, `lease`, `wait` and `policy` apply as for handlers, with the same compile-time
/// checks; the policy's `handler` name is the function's. The options of HTTP requests
/// (`missing_key`, `derive_window`, `reject_after`, `replay`, `server_errors`, `client_errors`,
/// `key_header`, `key_field`, `fingerprint_exclude`, `fingerprint_only`, `max_body`,
/// `transaction`) are errors here.
///
/// **An `Err` releases the key**: the next call with it runs the body again, with the same
/// downstream key. A failure that is the final answer (a card declined) belongs in the `Ok`
/// type, as above, and is then stored like any other output. The function must be `async fn`
/// and return `Result<T, E>` (or an alias named `Result`, like `io::Result<T>`), where `T` is
/// `Serialize` and `DeserializeOwned` and `E: From<OnceError>`; each is reported at the return
/// type if not. Receivers (`&self`, `&mut self`, `self`), generics, `?` and `return` in the body,
/// the visibility, doc comments and other attributes are kept as written. This mode needs no
/// feature of idem-runtime: `axum` is only for handlers.
///
/// # OpenAPI (`utoipa`)
///
/// A `#[utoipa::path(...)]` written *below* `#[idempotent]` gets the handler's `Idempotency-Key`
/// header (or its `key_header`; a `key_field` is described in the operation) added to its
/// `params(...)`, described from the handler's final policy (required or not, syntax, `ttl` and
/// `retain`, fingerprint exclusions). `idem_runtime::openapi::Idempotency`, added once to the API's
/// modifiers, adds the `Idempotency-Replayed` and `Idempotency-Expires` response headers and idem's
/// problem responses. Written *above*, utoipa would run first and document the handler without
/// any of this, so that order is a compile error that says to move the path attribute below. This
/// needs idem-runtime's `utoipa` feature; without it, the path attribute is a compile error.
/// Declare the request body (`request_body = ...`) and a path parameter that is the
/// handler's last parameter (`params(("id" = String, Path))`) in the attribute: utoipa sees the
/// rewritten handler, whose last parameter is wrapped. See the `idem_runtime::openapi` module.
///
/// # What the handler becomes
///
/// The attribute wraps the last parameter in `idem_runtime::__private::WithBody<T, LIMIT>`, which
/// takes the [`Engine`] from the router state (so the state must provide one), buffers and
/// fingerprints the body, and prepares `T`'s extractor on it; the engine runs that extractor once
/// the key is claimed (a replay never runs it), then the original body. The response type becomes `axum::response::Response`. With `transaction`, the
/// transaction parameter leaves the extractors and `WithBody` takes the store's `Transactional`
/// engine instead.
///
/// Mistakes are reported at the code that makes them:
///
/// - A parameter before the last one that reads the request body (`String`, `Bytes`, `Json<T>`,
///   `Form<T>`, ...) is an error at its type: axum gives the body to the last parameter only.
/// - A router whose state has no `Engine` fails to compile, never on the first request. As the
///   only state type the compiler can see providing an `Engine` is `Engine` itself, the error names
///   it: "expected `Engine`, found `AppState`" at `.with_state(...)`, or "expected
///   `MethodRouter<AppState>`, found `MethodRouter<Engine>`" at `.route(...)` when the router's
///   type is written out. The fix is a field `engine: Engine` in the state with
///   `#[derive(FromRef)]` on it (axum's `macros` feature, which your crate turns on), or
///   `impl FromRef<AppState> for Engine`.
/// - Any other parameter that is no extractor for the router's state (a `scope` parameter whose
///   type implements `Scope` but not `FromRequestParts`, say) makes the router report that the
///   handler "is not a `Handler`", listing the handler's parameters as written, the last one in
///   `WithBody`. Whether a type extracts from a state only the router knows, so the attribute
///   cannot tell sooner; `#[axum::debug_handler(state = AppState)]`, written below
///   `#[idempotent]`, reports each parameter at its type.
///
/// Handlers must be `async fn`, must not take `self`, must not be generic and take at most 16
/// parameters (axum's limit). Other attributes (doc comments, `#[tracing::instrument]`, lints) and
/// the visibility are kept.
///
/// If the attribute reports an error, it leaves the handler as written, so the code naming it
/// keeps compiling and only the attribute's own errors show.
///
/// # Seeing the expansion
///
/// [`cargo expand`](https://github.com/dtolnay/cargo-expand) shows what a handler becomes.
///
/// [`Scope`]: ../idem_runtime/axum/trait.Scope.html
/// [`Policy`]: ../idem_runtime/policy/struct.Policy.html
/// [`Policy::checked`]: ../idem_runtime/policy/struct.Policy.html#method.checked
/// [`Policy::new`]: ../idem_runtime/policy/struct.Policy.html#method.new
/// [`Engine`]: ../idem_runtime/engine/struct.Engine.html
/// [`Engine::once`]: ../idem_runtime/engine/struct.Engine.html#method.once
/// [`OnceError`]: ../idem_runtime/function/enum.OnceError.html
/// [`Attempt`]: ../idem_runtime/function/struct.Attempt.html
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let item = proc_macro2::TokenStream::from(item);
    let args = attr::parse(args.into());
    // A handler never has a `key`: it reads its key from the request.
    let function = args.get(options::Opt::Key).is_some();
    let expanded = match function {
        true => function::build(args, item.clone()).map(function::expand),
        false => config::build_parsed(args, item.clone()).map(expand::expand),
    };
    match expanded {
        Ok(tokens) => tokens,
        // Never expand to nothing: the function as written, plus every error. A plain function's
        // parameters may be used only by the attribute (`engine = engine`): not reported unused.
        Err(errors) => {
            let errors = errors.to_compile_error();
            let allow = function.then(|| quote::quote!(#[allow(unused_variables)]));
            quote::quote!(#allow #item #errors)
        }
    }
    .into()
}
