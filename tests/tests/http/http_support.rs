//! A test service for the HTTP behaviour of idem on axum, driven in process with `oneshot`.
//!
//! Every route exists twice: in [`router`], whose handlers use the `#[idempotent]` attribute
//! (except one written by hand in the form the attribute expands to, see `idem_runtime::__private`,
//! which pins that expansion contract), and in [`layered_router`], whose plain handlers sit under
//! an `IdempotencyLayer` with the same policy. [`http_test!`] runs each test case against both.

#![allow(dead_code)]

use axum::body::{Body, Bytes};
use axum::extract::{FromRef, FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use http_body_util::BodyExt;
use idem_runtime::__private::{run, scope_id, Policy, WithBody};
use idem_runtime::axum::{Attempt, IdempotencyLayer, Scope};
use idem_runtime::clock::{ManualClock, Timestamp};
use idem_runtime::idempotent;
use idem_runtime::policy::{MissingKey, ReplayMode};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::{Claim, ClaimOutcome, Found, Store, StoreError, Subscription};
use idem_runtime::{Engine, FencingToken, Record, RecordKey, StoredResponse};
use serde::Deserialize;
use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tower::ServiceExt;

/// 2026-11-30T00:00:00Z, where every test clock starts.
pub const START_MS: i64 = 1_795_996_800_000;
/// `START_MS` + 24 h as an IMF-fixdate: the default policy's expiry of a key claimed at the start.
pub const START_PLUS_DAY: &str = "Tue, 01 Dec 2026 00:00:00 GMT";

/// A memory store that counts subscriptions (each duplicate that waits for an in-flight original
/// subscribes once) and can be switched to fail every claim.
#[derive(Default)]
pub struct TestStore {
    pub inner: MemoryStore,
    pub fail: AtomicBool,
    /// Fail every completion (the response cannot be stored).
    pub fail_complete: AtomicBool,
    pub subscriptions: watch::Sender<usize>,
    pub claims: AtomicUsize,
    pub releases: AtomicUsize,
}

#[async_trait::async_trait]
impl Store for TestStore {
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        if self.fail.load(Ordering::SeqCst) {
            return Err(StoreError::unavailable("connection refused (test)"));
        }
        self.inner.claim(claim).await
    }
    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        if self.fail_complete.load(Ordering::SeqCst) {
            return Err(StoreError::unavailable("connection reset (test)"));
        }
        self.inner.complete(key, token, response).await
    }
    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        self.inner.release(key, token).await
    }
    async fn renew(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.inner.renew(key, token, lease).await
    }
    async fn get(&self, key: &RecordKey) -> Result<Option<Found>, StoreError> {
        self.inner.get(key).await
    }
    fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.subscriptions.send_modify(|n| *n += 1);
        self.inner.subscribe(key)
    }
    async fn announce_waiter(&self, key: &RecordKey) -> Result<(), StoreError> {
        self.inner.announce_waiter(key).await
    }
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
}

/// The router state: the engine (through `FromRef`) and what the tests observe.
#[derive(Clone, FromRef)]
pub struct App {
    pub engine: Engine,
    pub probe: Probe,
}

/// Counters and gates shared by the handlers and the test.
#[derive(Clone)]
pub struct Probe {
    /// Handler executions.
    pub calls: Arc<AtomicUsize>,
    /// How many gated handlers have started.
    pub started: watch::Sender<usize>,
    /// Gated handlers wait until this is true.
    pub open: watch::Sender<bool>,
}

impl Probe {
    fn new() -> Self {
        Self {
            calls: Arc::new(AtomicUsize::new(0)),
            started: watch::Sender::new(0),
            open: watch::Sender::new(false),
        }
    }

    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Counts a call and returns its number (1-based).
    pub fn call(&self) -> usize {
        self.calls.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Waits (as a handler) until the test opens the gate.
    async fn gate(&self) {
        self.started.send_modify(|n| *n += 1);
        let mut open = self.open.subscribe();
        let _ = open.wait_for(|open| *open).await;
    }

    /// Waits (as the test) until `n` gated handlers have started.
    pub async fn wait_started(&self, n: usize) {
        let mut started = self.started.subscribe();
        let _ = started.wait_for(|s| *s >= n).await;
    }

    pub fn open_gate(&self) {
        self.open.send_replace(true);
    }
}

/// Defines the test `$name` twice: `$name::attribute` runs its body against [`router`] (the
/// `#[idempotent]` handlers), `$name::layer` against [`layered_router`] (`IdempotencyLayer`).
#[allow(unused_macros)] // not every test file uses it
macro_rules! http_test {
    ($(#[$attr:meta])* async fn $name:ident($h:ident) $body:block) => {
        mod $name {
            use super::*;

            async fn case($h: Harness) $body

            $(#[$attr])*
            async fn attribute() {
                case(Harness::new()).await
            }

            $(#[$attr])*
            async fn layer() {
                case(Harness::layered()).await
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use http_test;

pub struct Harness {
    pub router: Router,
    /// How the router was built from its state: [`router`] or [`layered_router`].
    pub build: fn(App) -> Router,
    /// Whether the routes are protected by `IdempotencyLayer` (else by the attribute).
    pub layered: bool,
    pub store: Arc<TestStore>,
    pub clock: ManualClock,
    pub engine: Engine,
    pub probe: Probe,
}

impl Harness {
    /// Over [`router`]: the `#[idempotent]` handlers.
    pub fn new() -> Self {
        Self::with(router, false)
    }

    /// Over [`layered_router`]: the plain handlers under `IdempotencyLayer`.
    pub fn layered() -> Self {
        Self::with(layered_router, true)
    }

    fn with(build: fn(App) -> Router, layered: bool) -> Self {
        let clock = ManualClock::new(Timestamp::from_millis(START_MS));
        let store = Arc::new(TestStore {
            inner: MemoryStore::new().with_clock(clock.clone()),
            ..TestStore::default()
        });
        // The store judges the records' times; the engine's clock decides `reject_after` only.
        let engine = Engine::from_arc(store.clone()).with_clock(clock.clone());
        let probe = Probe::new();
        let router = build(App {
            engine: engine.clone(),
            probe: probe.clone(),
        });
        Self {
            router,
            build,
            layered,
            store,
            clock,
            engine,
            probe,
        }
    }

    pub async fn send(&self, request: Request<Body>) -> Reply {
        send(self.router.clone(), request).await
    }

    pub fn count(&self, outcome: idem_runtime::metrics::Outcome) -> u64 {
        self.engine.metrics().get(outcome)
    }

    /// The record for `key` in `scope` unless it was released: what a retry would meet (a released
    /// record is resumed by the same request, replaced by any other).
    pub async fn kept(&self, scope: &str, key: &str) -> Option<Record> {
        let record = self.record(scope, key).await;
        record.filter(|record| record.state != idem_runtime::RecordState::Released)
    }

    /// The record stored for `key` in `scope`, if any.
    pub async fn record(&self, scope: &str, key: &str) -> Option<Record> {
        let found = self.store.get(&RecordKey::new(scope, key)).await;
        found.unwrap().map(|found| found.record)
    }
}

impl Default for Harness {
    fn default() -> Self {
        Self::new()
    }
}

/// A response, read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotency-replayed") == Some("true")
    }

    /// Asserts an RFC 9457 problem of `type_uri` with `status`.
    #[track_caller]
    pub fn assert_problem(&self, status: u16, type_uri: &str) {
        assert_eq!(self.status.as_u16(), status, "body: {:?}", self.body);
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let problem = self.json();
        assert_eq!(problem["type"], type_uri, "{problem}");
        assert_eq!(problem["status"], status);
        assert!(!problem["title"].as_str().unwrap().is_empty());
        assert!(!problem["detail"].as_str().unwrap().is_empty());
        assert!(!self.replayed());
    }
}

pub async fn send(router: Router, request: Request<Body>) -> Reply {
    let response = router.oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

/// A JSON POST as `user` with the given `Idempotency-Key` values.
pub fn json_post(path: &str, user: &str, keys: &[&str], body: &str) -> Request<Body> {
    let mut builder = Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-user", user);
    for key in keys {
        builder = builder.header("idempotency-key", *key);
    }
    builder.body(Body::from(body.to_owned())).unwrap()
}

/// A JSON POST whose key header carries raw bytes (for non-ASCII keys).
pub fn post_raw_key(path: &str, user: &str, key: &[u8], body: &str) -> Request<Body> {
    Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-user", user)
        .header("idempotency-key", HeaderValue::from_bytes(key).unwrap())
        .body(Body::from(body.to_owned()))
        .unwrap()
}

pub const PAY_1000: &str = r#"{"amount":1000,"currency":"KRW"}"#;
pub const PAY_1000_REORDERED: &str = "{ \"currency\": \"KRW\",\n  \"amount\": 1000 }";
pub const PAY_2000: &str = r#"{"amount":2000,"currency":"KRW"}"#;

/// The caller, from `x-user` (demo auth); 401 without it.
pub struct User(pub String);

impl<S: Send + Sync> FromRequestParts<S> for User {
    type Rejection = StatusCode;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        parts
            .headers
            .get("x-user")
            .and_then(|v| v.to_str().ok())
            .map(|u| User(u.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl Scope for User {
    fn scope_id(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

#[derive(Deserialize)]
pub struct NewPayment {
    pub amount: i64,
    pub currency: String,
}

pub fn created(n: usize, user: &User, req: &NewPayment) -> Response {
    (
        StatusCode::CREATED,
        [
            (header::LOCATION, format!("/payments/pay_{n}")),
            (header::SET_COOKIE, format!("session=s{n}; HttpOnly")),
            (
                header::HeaderName::from_static("x-request-ref"),
                format!("ref-{n}"),
            ),
            (
                header::HeaderName::from_static("x-not-replayed"),
                "yes".to_owned(),
            ),
        ],
        Json(serde_json::json!({
            "id": format!("pay_{n}"),
            "owner": user.0,
            "amount": req.amount,
            "currency": req.currency,
            "status": "captured",
        })),
    )
        .into_response()
}

// ---------------------------------------------------------------------------------------------
// Handlers. All but one go through the real `#[idempotent]` attribute, so these tests check what
// users get. `create_payment` is written by hand in the form the attribute expands to, so the
// expansion contract with `idem_runtime::__private` is pinned independently of the macro.

/// Replays `x-request-ref` besides the default headers (`replay_headers` is a `Policy` field).
const WITH_REQUEST_REF: idem_runtime::Policy =
    idem_runtime::Policy::new().replay_headers(&["x-request-ref"]);

/// What `#[idempotent(scope = "user", policy = WITH_REQUEST_REF)]` on
/// `async fn create_payment(State(probe): State<Probe>, user: User, Json(req): Json<NewPayment>)`
/// expands to.
async fn create_payment(
    State(probe): State<Probe>,
    user: User,
    WithBody(__idem_last, __idem_request, __idem_engine): WithBody<Json<NewPayment>, 1048576>,
) -> Response {
    const __IDEM_POLICY: Policy = WITH_REQUEST_REF.handler("create_payment").checked();
    let __idem_scope = scope_id(&user);
    run(
        __idem_engine,
        &__IDEM_POLICY,
        __idem_scope,
        __idem_request,
        __idem_last,
        move |Json(req): Json<NewPayment>| async move {
            let n = probe.call();
            created(n, &user, &req)
        },
    )
    .await
}

/// Full mode, but the stored-body cap (8 bytes) is smaller than the response.
const TINY_STORED_BODY: idem_runtime::Policy = idem_runtime::Policy::new().max_stored_body(8);

/// `reject_after` one hour after the test clock's start (not a midnight, so a named policy).
pub const DEADLINE_MS: i64 = START_MS + 3_600_000;
const PASS_UNTIL_DEADLINE: idem_runtime::Policy = idem_runtime::Policy::new()
    .missing_key(MissingKey::Pass)
    .reject_after_ms(DEADLINE_MS);

/// What `/orders` takes: an enum of each of serde_json's two forms, a nested struct and fields
/// the type does not know.
#[derive(Debug, Deserialize, serde::Serialize)]
pub struct NewOrder {
    pub currency: Currency,
    pub items: Vec<Item>,
    pub delivery: Delivery,
}

#[derive(Debug, Deserialize, serde::Serialize)]
pub enum Currency {
    #[serde(rename = "KRW")]
    Won,
    #[serde(rename = "EUR")]
    Euro,
}

#[derive(Debug, Deserialize, serde::Serialize)]
pub struct Item {
    pub sku: String,
    pub quantity: u32,
}

#[derive(Debug, Deserialize, serde::Serialize)]
pub enum Delivery {
    Pickup,
    Courier { address: String },
}

/// What `/readings` takes: an `f32`, which serde_json parses at single precision, so its
/// fingerprint comes from a second parse of the body.
#[derive(Debug, Deserialize)]
pub struct Reading {
    pub celsius: f32,
}

/// Under the router's `DefaultBodyLimit` of this many bytes (`/limited`), or under a middleware
/// that limits the body to as many (`/outer-limited`, as tower-http's `RequestBodyLimit` does).
pub const ROUTER_LIMIT: usize = 48;

/// What `/lenient` takes: a field that keeps what deserializes and drops the rest, so bodies that
/// differ can deserialize to the same value.
#[derive(Debug, Deserialize)]
pub struct LenientPayment {
    pub amount: i64,
    #[serde(default, deserialize_with = "lenient_number")]
    pub note: Option<u32>,
}

fn lenient_number<'de, D: serde::Deserializer<'de>>(de: D) -> Result<Option<u32>, D::Error> {
    Ok(Option::<u32>::deserialize(de).ok().flatten())
}

/// Wraps the body in a limit, as body-limiting middleware does (tower-http's `RequestBodyLimit`).
async fn limit_the_body(request: Request<Body>) -> Request<Body> {
    request.map(|body| Body::new(http_body_util::Limited::new(body, ROUTER_LIMIT)))
}

/// Defines each handler twice: in `attr` under its `#[idempotent(...)]`, and in `plain` as written
/// without it (for [`layered_router`], which states the same policy to `IdempotencyLayer`).
macro_rules! handlers {
    ($($(#[doc = $doc:literal])* #[idempotent($($args:tt)*)]
       async fn $name:ident($($params:tt)*) -> $ret:ty $body:block)*) => {
        mod attr {
            use super::*;
            $($(#[doc = $doc])* #[idempotent($($args)*)]
              pub(super) async fn $name($($params)*) -> $ret $body)*
        }
        #[allow(unused_variables)] // the `user` parameter is the attribute's scope
        mod plain {
            use super::*;
            $($(#[doc = $doc])* pub(super) async fn $name($($params)*) -> $ret $body)*
        }
    };
}

handlers! {
/// Another endpoint with the same body shape.
#[idempotent(scope = "user")]
async fn create_refund(
    State(probe): State<Probe>,
    user: User,
    Json(req): Json<NewPayment>,
) -> Response {
    created(probe.call(), &user, &req)
}

#[idempotent(scope = "user", replay = "minimal")]
async fn minimal_payment(
    State(probe): State<Probe>,
    user: User,
    Json(req): Json<NewPayment>,
) -> Response {
    created(probe.call(), &user, &req)
}

#[idempotent(scope = "user", policy = TINY_STORED_BODY)]
async fn big_response(
    State(probe): State<Probe>,
    user: User,
    Json(req): Json<NewPayment>,
) -> Response {
    created(probe.call(), &user, &req)
}

/// A body that fails after its first chunk.
#[idempotent(scope = "user")]
async fn broken_stream(
    State(probe): State<Probe>,
    user: User,
    Json(_req): Json<NewPayment>,
) -> impl IntoResponse {
    probe.call();
    let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
        Ok(Bytes::from_static(b"{\"id\":")),
        Err(std::io::Error::other("connection to the card network lost")),
    ];
    (
        StatusCode::CREATED,
        [(header::LOCATION, "/payments/pay_stream")],
        Body::from_stream(futures_util::stream::iter(chunks)),
    )
}

/// 502 on the first call, 201 after.
#[idempotent(scope = "user")]
async fn flaky(State(probe): State<Probe>, user: User, Json(req): Json<NewPayment>) -> Response {
    let n = probe.call();
    if n == 1 {
        return (StatusCode::BAD_GATEWAY, "card network down").into_response();
    }
    created(n, &user, &req)
}

/// 502 on the first call, 201 after; its policy stores server errors instead of releasing the key.
#[idempotent(scope = "user", server_errors = "store")]
async fn flaky_stored(
    State(probe): State<Probe>,
    user: User,
    Json(req): Json<NewPayment>,
) -> Response {
    let n = probe.call();
    if n == 1 {
        return (StatusCode::GATEWAY_TIMEOUT, "the card network timed out").into_response();
    }
    created(n, &user, &req)
}

/// A 4xx decided by the handler itself: stored like any other result.
#[idempotent(scope = "user")]
async fn declined(
    State(probe): State<Probe>,
    user: User,
    Json(_req): Json<NewPayment>,
) -> impl IntoResponse {
    let n = probe.call();
    (
        StatusCode::PAYMENT_REQUIRED,
        Json(serde_json::json!({ "error": "card declined", "attempt": n })),
    )
}

/// Panics on the first call.
#[idempotent(scope = "user")]
async fn panicking(
    State(probe): State<Probe>,
    user: User,
    Json(req): Json<NewPayment>,
) -> Response {
    let n = probe.call();
    if n == 1 {
        panic!("handler bug (test)");
    }
    created(n, &user, &req)
}

/// Waits at the gate; duplicates wait for it (default `wait`).
#[idempotent(scope = "user")]
async fn gated(State(probe): State<Probe>, user: User, Json(req): Json<NewPayment>) -> Response {
    let n = probe.call();
    probe.gate().await;
    created(n, &user, &req)
}

/// Waits at the gate; duplicates do not wait (`wait = 0`): 409 at once.
#[idempotent(scope = "user", wait = "0s", lease = "30s")]
async fn gated_no_wait(
    State(probe): State<Probe>,
    user: User,
    Json(req): Json<NewPayment>,
) -> Response {
    let n = probe.call();
    probe.gate().await;
    created(n, &user, &req)
}

/// ttl 60 s, so that moving the clock makes the key expire.
#[idempotent(scope = "user", ttl = "60s")]
async fn short_ttl(
    State(probe): State<Probe>,
    user: User,
    Json(req): Json<NewPayment>,
) -> Response {
    created(probe.call(), &user, &req)
}

/// Bodies over 40 bytes are refused.
#[idempotent(scope = "user", max_body = "40B")]
async fn small_body(
    State(probe): State<Probe>,
    user: User,
    Json(req): Json<NewPayment>,
) -> Response {
    created(probe.call(), &user, &req)
}

#[idempotent(scope = "user", missing_key = "pass")]
async fn pass_missing(
    State(probe): State<Probe>,
    user: User,
    Json(req): Json<NewPayment>,
) -> Response {
    created(probe.call(), &user, &req)
}

#[idempotent(scope = "user", policy = PASS_UNTIL_DEADLINE)]
async fn pass_until_deadline(
    State(probe): State<Probe>,
    user: User,
    Json(req): Json<NewPayment>,
) -> Response {
    created(probe.call(), &user, &req)
}

#[idempotent(scope = "user", missing_key = "derive", derive_window = "10s")]
async fn derive_missing(
    State(probe): State<Probe>,
    user: User,
    Json(req): Json<NewPayment>,
) -> Response {
    created(probe.call(), &user, &req)
}

/// Echoes the order as the handler received it.
#[idempotent(scope = "user")]
async fn create_order(
    State(probe): State<Probe>,
    user: User,
    Json(order): Json<NewOrder>,
) -> impl IntoResponse {
    let n = probe.call();
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/orders/{n}"))],
        Json(serde_json::json!({
            "n": n,
            "owner": user.0,
            "variants": format!("{:?} {:?}", order.currency, order.delivery),
            "order": order,
        })),
    )
}

#[idempotent(scope = "user")]
async fn record_reading(
    State(probe): State<Probe>,
    user: User,
    Json(reading): Json<Reading>,
) -> impl IntoResponse {
    let n = probe.call();
    (
        StatusCode::CREATED,
        format!("reading {n} by {}: {}", user.0, reading.celsius),
    )
}

#[idempotent(scope = "user")]
async fn lenient_payment(
    State(probe): State<Probe>,
    user: User,
    Json(req): Json<LenientPayment>,
) -> impl IntoResponse {
    let n = probe.call();
    (
        StatusCode::CREATED,
        format!("payment {n} by {}: {} ({:?})", user.0, req.amount, req.note),
    )
}

/// Answers with the downstream key of its run (the `Attempt` extractor).
#[idempotent(scope = "user")]
async fn downstream(State(probe): State<Probe>, user: User, attempt: Attempt) -> impl IntoResponse {
    probe.call();
    let key = attempt.downstream_key().unwrap_or("none").to_owned();
    (StatusCode::CREATED, format!("{key} taken over: {}", attempt.taken_over()))
}

/// `scope = "global"`, with a head-only last extractor (the `ViaPartsExtractor` impl).
#[idempotent(scope = "global")]
async fn global_ping(State(probe): State<Probe>, user: User) -> impl IntoResponse {
    let n = probe.call();
    (StatusCode::OK, format!("pong {n} for {}", user.0))
}
}

/// `create_payment` as a plain handler.
async fn plain_create_payment(
    State(probe): State<Probe>,
    user: User,
    Json(req): Json<NewPayment>,
) -> Response {
    created(probe.call(), &user, &req)
}

/// The routes, with the `#[idempotent]` handlers.
pub fn router(app: App) -> Router {
    use attr::*;
    Router::new()
        .route("/payments", post(create_payment))
        .route("/refunds", post(create_refund))
        .route("/minimal", post(minimal_payment))
        .route("/big", post(big_response))
        .route("/broken-stream", post(broken_stream))
        .route("/flaky", post(flaky))
        .route("/flaky-stored", post(flaky_stored))
        .route("/declined", post(declined))
        .route("/panicking", post(panicking))
        .route("/gated", post(gated))
        .route("/gated-no-wait", post(gated_no_wait))
        .route("/short-ttl", post(short_ttl))
        .route("/small", post(small_body))
        .route("/pass", post(pass_missing))
        .route("/deadline", post(pass_until_deadline))
        .route("/derive", post(derive_missing))
        .route("/ping", post(global_ping))
        .route("/orders", post(create_order))
        .route("/readings", post(record_reading))
        .route(
            "/limited",
            post(create_refund).layer(axum::extract::DefaultBodyLimit::max(ROUTER_LIMIT)),
        )
        .route(
            "/outer-limited",
            post(create_payment).layer(axum::middleware::map_request(limit_the_body)),
        )
        .route("/lenient", post(lenient_payment))
        .route("/downstream", post(downstream))
        .with_state(app)
}

/// The same routes, with the plain handlers under `IdempotencyLayer`, each with the policy its
/// attribute states in [`router`].
pub fn layered_router(app: App) -> Router {
    use plain::*;
    let engine = app.engine.clone();
    let idem = |name: &'static str, policy: Policy| {
        IdempotencyLayer::new(engine.clone(), policy.handler(name)).scope::<User>()
    };
    let default = Policy::new();
    Router::new()
        .route(
            "/payments",
            post(plain_create_payment).route_layer(idem("create_payment", WITH_REQUEST_REF)),
        )
        .route(
            "/refunds",
            post(create_refund).route_layer(idem("create_refund", default)),
        )
        .route(
            "/minimal",
            post(minimal_payment)
                .route_layer(idem("minimal_payment", default.replay(ReplayMode::Minimal))),
        )
        .route(
            "/big",
            post(big_response).route_layer(idem("big_response", TINY_STORED_BODY)),
        )
        .route(
            "/broken-stream",
            post(broken_stream).route_layer(idem("broken_stream", default)),
        )
        .route("/flaky", post(flaky).route_layer(idem("flaky", default)))
        .route(
            "/flaky-stored",
            post(flaky_stored).route_layer(idem(
                "flaky_stored",
                default.server_errors(idem_runtime::policy::ServerErrors::Store),
            )),
        )
        .route(
            "/declined",
            post(declined).route_layer(idem("declined", default)),
        )
        .route(
            "/panicking",
            post(panicking).route_layer(idem("panicking", default)),
        )
        .route("/gated", post(gated).route_layer(idem("gated", default)))
        .route(
            "/gated-no-wait",
            post(gated_no_wait).route_layer(idem(
                "gated_no_wait",
                default.wait(Duration::ZERO).lease(Duration::from_secs(30)),
            )),
        )
        .route(
            "/short-ttl",
            post(short_ttl).route_layer(idem("short_ttl", default.ttl(Duration::from_secs(60)))),
        )
        .route(
            "/small",
            post(small_body).route_layer(idem("small_body", default.max_request_body(40))),
        )
        .route(
            "/pass",
            post(pass_missing)
                .route_layer(idem("pass_missing", default.missing_key(MissingKey::Pass))),
        )
        .route(
            "/deadline",
            post(pass_until_deadline).route_layer(idem("pass_until_deadline", PASS_UNTIL_DEADLINE)),
        )
        .route(
            "/derive",
            post(derive_missing).route_layer(idem(
                "derive_missing",
                default
                    .missing_key(MissingKey::Derive)
                    .derive_window(Duration::from_secs(10)),
            )),
        )
        .route(
            "/ping",
            post(global_ping).route_layer(
                IdempotencyLayer::new(engine.clone(), default.handler("global_ping"))
                    .global_scope(),
            ),
        )
        .route(
            "/orders",
            post(create_order).route_layer(idem("create_order", default)),
        )
        .route(
            "/readings",
            post(record_reading).route_layer(idem("record_reading", default)),
        )
        .route(
            "/limited",
            post(create_refund)
                .route_layer(idem("create_refund", default))
                .layer(axum::extract::DefaultBodyLimit::max(ROUTER_LIMIT)),
        )
        .route(
            "/outer-limited",
            post(plain_create_payment)
                .route_layer(idem("create_payment", WITH_REQUEST_REF))
                .layer(axum::middleware::map_request(limit_the_body)),
        )
        .route(
            "/lenient",
            post(lenient_payment).route_layer(idem("lenient_payment", default)),
        )
        .route(
            "/downstream",
            post(downstream).route_layer(idem("downstream", default)),
        )
        .with_state(app)
}
