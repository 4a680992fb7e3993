//! Transactional mode over HTTP, the same cases for PostgreSQL and SQLite: a ledger table written
//! through the handler's `Tx`, next to idem's records in the same database.
//!
//! Each backend's test file builds its app with [`transactional_app!`] and implements [`Backend`];
//! the cases below are written once. The handlers model the "atomic phases" a transactional
//! handler goes through: a foreign call first (held by the test, outside any transaction), then the
//! ledger write through `tx.conn()`, which idem commits with the stored response.

use axum::body::{Body, Bytes};
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body_util::BodyExt;
use idem_runtime::axum::{Attempt, Scope};
use idem_runtime::clock::ManualClock;
use idem_runtime::metrics::Outcome;
use idem_runtime::sqlx::{self, Postgres, Sqlite};
use idem_runtime::transaction::{TransactionalStore, TxBegin};
use idem_runtime::{
    Engine, Fingerprint, Policy, Record, RecordKey, RecordState, StoredResponse, Transactional, Tx,
};
use serde_json::{json, Value};
use std::borrow::Cow;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::Poll;
use std::time::Duration;
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;
use tracing::Instrument;

/// 2026-11-30T00:00:00Z, where every test clock starts.
pub const START_MS: i64 = 1_795_996_800_000;

/// How long a test waits for something that must happen before it counts as hung.
pub const HANG: Duration = Duration::from_secs(60);

/// The ledger the handlers write, in the same database as idem's records. A row may reference a
/// parent, checked only at commit: a row pointing at a missing one makes the `COMMIT` fail.
pub const SCHEMA: [&str; 2] = [
    "CREATE TABLE parents (id TEXT PRIMARY KEY)",
    "CREATE TABLE ledger (id TEXT PRIMARY KEY, owner TEXT NOT NULL, amount BIGINT NOT NULL,
         parent TEXT REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED)",
];

const INSERT: &str = "INSERT INTO ledger (id, owner, amount, parent) VALUES ($1, $2, $3, $4)";

/// One ledger row to write.
pub struct Row<'a> {
    pub id: &'a str,
    pub owner: &'a str,
    pub amount: i64,
    /// `Some` for a row whose commit must fail (the parent does not exist).
    pub parent: Option<&'a str>,
}

/// Writing a ledger row through a handler's transaction, for either database.
#[async_trait::async_trait]
pub trait Ledger: Send {
    async fn insert(&mut self, row: &Row<'_>) -> Result<(), sqlx::Error>;
}

#[async_trait::async_trait]
impl Ledger for Tx<Sqlite> {
    async fn insert(&mut self, row: &Row<'_>) -> Result<(), sqlx::Error> {
        let query = sqlx::query(INSERT)
            .bind(row.id)
            .bind(row.owner)
            .bind(row.amount)
            .bind(row.parent);
        query.execute(self.conn().await?).await.map(drop)
    }
}

#[async_trait::async_trait]
impl Ledger for Tx<Postgres> {
    async fn insert(&mut self, row: &Row<'_>) -> Result<(), sqlx::Error> {
        let query = sqlx::query(INSERT)
            .bind(row.id)
            .bind(row.owner)
            .bind(row.amount)
            .bind(row.parent);
        query.execute(self.conn().await?).await.map(drop)
    }
}

/// MySQL's placeholders are `?`, not `$n`.
#[async_trait::async_trait]
impl Ledger for Tx<sqlx::MySql> {
    async fn insert(&mut self, row: &Row<'_>) -> Result<(), sqlx::Error> {
        let query =
            sqlx::query("INSERT INTO ledger (id, owner, amount, parent) VALUES (?, ?, ?, ?)")
                .bind(row.id)
                .bind(row.owner)
                .bind(row.amount)
                .bind(row.parent);
        query.execute(self.conn().await?).await.map(drop)
    }
}

/// What a handler run saw of its attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    pub taken_over: bool,
    pub downstream_key: Option<String>,
}

/// What the test drives and observes in the handlers.
#[derive(Clone)]
pub struct Controls {
    /// How many handler bodies started (executions).
    pub runs: Arc<AtomicUsize>,
    /// How many handlers are held right now (in their foreign call, or after their write).
    pub held: watch::Sender<usize>,
    /// Held handlers wait for a permit here (first held, first released).
    pub release: Arc<Semaphore>,
    /// How many of the next runs answer 500 after their write.
    pub fail_next: Arc<AtomicUsize>,
    /// How many of the next runs write a row whose commit fails.
    pub orphan_next: Arc<AtomicUsize>,
    /// Every run's attempt, in the order the runs started.
    pub attempts: Arc<Mutex<Vec<Run>>>,
}

impl Default for Controls {
    fn default() -> Self {
        Self {
            runs: Arc::default(),
            held: watch::Sender::new(0),
            release: Arc::new(Semaphore::new(0)),
            fail_next: Arc::default(),
            orphan_next: Arc::default(),
            attempts: Arc::default(),
        }
    }
}

/// Takes one from `counter` if it is above zero.
fn take_one(counter: &AtomicUsize) -> bool {
    counter
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
}

impl Controls {
    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// Returns once `n` handlers are held at the same time.
    pub async fn until_held(&self, n: usize) {
        let mut held = self.held.subscribe();
        tokio::time::timeout(HANG, held.wait_for(|h| *h >= n))
            .await
            .unwrap_or_else(|_| panic!("{n} handlers were never held at once"))
            .expect("controls alive");
    }

    pub fn attempts(&self) -> Vec<Run> {
        self.attempts.lock().expect("attempts").clone()
    }

    /// Waits for a permit. The handler queues for it before it counts as held, so that permits go
    /// out in the order `until_held` saw handlers held, however the threads are scheduled.
    async fn hold(&self) {
        let mut acquire = std::pin::pin!(self.release.acquire());
        let queued = std::future::poll_fn(|cx| Poll::Ready(acquire.as_mut().poll(cx))).await;
        self.held.send_modify(|n| *n += 1);
        let permit = match queued {
            Poll::Ready(permit) => permit,
            Poll::Pending => acquire.await,
        };
        permit.expect("semaphore open").forget();
        self.held.send_modify(|n| *n -= 1);
    }
}

/// Demo auth: `Authorization: Bearer <user>`.
pub struct User(pub String);

impl<S: Send + Sync> FromRequestParts<S> for User {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        parts
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|id| User(id.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl Scope for User {
    fn scope_id(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

/// Where a handler waits for the test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Hold {
    /// In its foreign call, before it touches the transaction.
    Call,
    /// After its write, with its transaction open.
    Tx,
}

/// A request body: `amount` (not above zero: 422 without writing), and what the handler should do.
#[derive(Debug, serde::Deserialize)]
pub struct Entry {
    pub amount: i64,
    #[serde(default)]
    pub hold: Option<Hold>,
    /// `"500"`: answer 500 after the write; `"panic"`: panic after it.
    #[serde(default)]
    pub fail: Option<String>,
}

/// The handlers' body: the foreign call, the ledger write through `tx`, the answer (201 with the
/// row's id and the attempt's takeover flag and downstream key).
pub async fn entry<T: Ledger>(
    controls: Controls,
    attempt: Attempt,
    user: User,
    mut tx: T,
    req: Entry,
) -> Response {
    controls.runs.fetch_add(1, Ordering::SeqCst);
    let run = Run {
        taken_over: attempt.taken_over(),
        downstream_key: attempt.downstream_key().map(str::to_owned),
    };
    controls
        .attempts
        .lock()
        .expect("attempts")
        .push(run.clone());
    if req.hold == Some(Hold::Call) {
        controls.hold().await;
    }
    if req.amount <= 0 {
        let problem = json!({ "error": "amount must be positive" });
        return (StatusCode::UNPROCESSABLE_ENTITY, axum::Json(problem)).into_response();
    }
    let id = format!("e_{}", uuid::Uuid::new_v4().simple());
    let parent = take_one(&controls.orphan_next).then_some("missing");
    let row = Row {
        id: &id,
        owner: &user.0,
        amount: req.amount,
        parent,
    };
    if let Err(e) = tx.insert(&row).await {
        return (StatusCode::SERVICE_UNAVAILABLE, format!("ledger: {e}")).into_response();
    }
    if req.hold == Some(Hold::Tx) {
        controls.hold().await;
    }
    let fail = take_one(&controls.fail_next).then_some("500");
    match req.fail.as_deref().or(fail) {
        Some("500") => {
            return (StatusCode::INTERNAL_SERVER_ERROR, "failed after writing").into_response()
        }
        Some("panic") => panic!("the handler panics after its write"),
        Some("422") => {
            return (StatusCode::UNPROCESSABLE_ENTITY, "refused after writing").into_response()
        }
        _ => {}
    }
    let body = json!({
        "id": id,
        "amount": req.amount,
        "taken_over": run.taken_over,
        "downstream_key": run.downstream_key,
    });
    (StatusCode::CREATED, axum::Json(body)).into_response()
}

/// Defines `App` (state: the `Transactional` engine and the `Controls`), three handlers in
/// transactional mode and `router(app)`, for the database type `$db` and its store `$store`:
/// `POST /entries` waits up to 60 s for an identical request, `POST /quick` not at all,
/// `POST /optional` runs requests without a key unprotected. Their lease (300 s) is renewed every
/// 100 s of real time, so renewals never happen in a test: only the test's manual clock decides
/// when a claim can be taken over.
#[macro_export]
macro_rules! transactional_app {
    ($db:ty, $store:ty) => {
        #[derive(Clone, axum::extract::FromRef)]
        pub struct App {
            pub txn: idem_runtime::Transactional<$store>,
            pub controls: $crate::transactional_support::Controls,
        }

        #[idem_runtime::idempotent(
            scope = "user",
            transaction = "tx",
            wait = "60s",
            lease = "300s"
        )]
        async fn create(
            axum::extract::State(controls): axum::extract::State<
                $crate::transactional_support::Controls,
            >,
            attempt: idem_runtime::axum::Attempt,
            user: $crate::transactional_support::User,
            tx: idem_runtime::Tx<$db>,
            axum::Json(req): axum::Json<$crate::transactional_support::Entry>,
        ) -> axum::response::Response {
            $crate::transactional_support::entry(controls, attempt, user, tx, req).await
        }

        #[idem_runtime::idempotent(scope = "user", transaction = "tx", wait = "0s", lease = "300s")]
        async fn quick(
            axum::extract::State(controls): axum::extract::State<
                $crate::transactional_support::Controls,
            >,
            attempt: idem_runtime::axum::Attempt,
            user: $crate::transactional_support::User,
            tx: idem_runtime::Tx<$db>,
            axum::Json(req): axum::Json<$crate::transactional_support::Entry>,
        ) -> axum::response::Response {
            $crate::transactional_support::entry(controls, attempt, user, tx, req).await
        }

        #[idem_runtime::idempotent(scope = "user", transaction = "tx", missing_key = "pass")]
        async fn optional(
            axum::extract::State(controls): axum::extract::State<
                $crate::transactional_support::Controls,
            >,
            attempt: idem_runtime::axum::Attempt,
            user: $crate::transactional_support::User,
            tx: idem_runtime::Tx<$db>,
            axum::Json(req): axum::Json<$crate::transactional_support::Entry>,
        ) -> axum::response::Response {
            $crate::transactional_support::entry(controls, attempt, user, tx, req).await
        }

        #[idem_runtime::idempotent(scope = "user", transaction = "tx", client_errors = "release")]
        async fn corrected(
            axum::extract::State(controls): axum::extract::State<
                $crate::transactional_support::Controls,
            >,
            attempt: idem_runtime::axum::Attempt,
            user: $crate::transactional_support::User,
            tx: idem_runtime::Tx<$db>,
            axum::Json(req): axum::Json<$crate::transactional_support::Entry>,
        ) -> axum::response::Response {
            $crate::transactional_support::entry(controls, attempt, user, tx, req).await
        }

        pub fn router(app: App) -> axum::Router {
            axum::Router::new()
                .route("/entries", axum::routing::post(create))
                .route("/corrected", axum::routing::post(corrected))
                .route("/quick", axum::routing::post(quick))
                .route("/optional", axum::routing::post(optional))
                .with_state(app)
        }
    };
}

/// Another instance of the app on the same database, as another process would run it: a store and
/// pool of its own, the same clock and controls.
pub struct Instance {
    pub router: Router,
    pub engine: Engine,
    /// Connections taken out of this instance's pool right now.
    pub in_use: Box<dyn Fn() -> usize + Send + Sync>,
}

/// The database type of a backend's store.
pub type Db<B> = <<B as Backend>::Store as TransactionalStore>::Database;

/// What the shared cases need from a backend.
#[async_trait::async_trait]
pub trait Backend: Send + Sync {
    type Store: TransactionalStore;
    fn router(&self) -> Router;
    fn controls(&self) -> &Controls;
    fn clock(&self) -> &ManualClock;
    fn txn(&self) -> &Transactional<Self::Store>;
    fn engine(&self) -> &Engine {
        self.txn().engine()
    }
    /// Connections taken out of the app's pool right now.
    fn in_use(&self) -> usize;
    async fn ledger_rows(&self) -> i64;
    /// idem's record for (`user`, `key`), committed, read on another connection.
    async fn record(&self, user: &str, key: &str) -> Option<Record>;
    /// Holds the database's write lock for idem's records from another connection until released.
    async fn lock_writes(&self) -> Box<dyn WriteLock>;
    async fn another_instance(&self) -> Instance;
}

#[async_trait::async_trait]
pub trait WriteLock: Send {
    async fn release(self: Box<Self>);
}

/// Returns once `done()` holds; yields in between. The bound only turns a hang into a failure.
pub async fn until(what: &str, done: impl Fn() -> bool) {
    tokio::time::timeout(HANG, async {
        while !done() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("never happened: {what}"));
}

pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    pub fn replayed(&self) -> bool {
        self.headers.get("idempotency-replayed").is_some()
    }
    pub fn problem_type(&self) -> Value {
        self.json()["type"].clone()
    }
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {:?} {}",
            self.status,
            self.headers,
            String::from_utf8_lossy(&self.body)
        )
    }
}

pub fn post(path: &str, user: &str, key: &str, body: Value) -> Request<Body> {
    Request::post(path)
        .header("authorization", format!("Bearer {user}"))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request")
}

pub fn post_without_key(path: &str, user: &str, body: Value) -> Request<Body> {
    Request::post(path)
        .header("authorization", format!("Bearer {user}"))
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request")
}

pub async fn send(router: &Router, request: Request<Body>) -> Reply {
    let response = router.clone().oneshot(request).await.expect("infallible");
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: body.collect().await.expect("body").to_bytes(),
    }
}

/// `request` sent to `router`, as a future of its own to spawn.
pub fn sent(
    router: &Router,
    request: Request<Body>,
) -> impl Future<Output = Reply> + Send + 'static {
    let router = router.clone();
    async move { send(&router, request).await }
}

/// Gathers the replies of a set of requests.
pub async fn replies(mut tasks: tokio::task::JoinSet<Reply>) -> Vec<Reply> {
    let mut replies = Vec::new();
    while let Some(reply) = tasks.join_next().await {
        replies.push(reply.expect("request task"));
    }
    replies
}

fn completed_status(record: &Record) -> Option<u16> {
    match &record.state {
        RecordState::Completed { response } => Some(response.status),
        RecordState::InFlight { .. } | RecordState::Released => None,
    }
}

// ---- Which duplicates wait ----
//
// A duplicate waits for the original holding neither a connection nor a lock, so the database
// cannot show it waiting. idem's log can: each time a duplicate goes to sleep until the original
// ends, the engine logs "waiting for the identical request in flight" (target `idem`, debug) in the
// span of the request that sent it.

/// A group of requests whose waits a test counts.
#[derive(Clone)]
pub struct Waits(Arc<watch::Sender<usize>>);

/// Whether a request has waited yet, kept in its span, and the group it counts in.
struct Waited {
    yet: AtomicBool,
    group: Arc<watch::Sender<usize>>,
}

const REQUEST_SPAN: &str = "idem_tests::request";

/// What the engine logs as a duplicate goes to sleep.
const WAITING: &str = "waiting for the identical request in flight";

/// Groups of requests announced by [`Waits::sent`], taken by their span when it opens.
fn pending() -> &'static Mutex<HashMap<u64, Arc<watch::Sender<usize>>>> {
    static PENDING: OnceLock<Mutex<HashMap<u64, Arc<watch::Sender<usize>>>>> = OnceLock::new();
    PENDING.get_or_init(Default::default)
}

struct CountWaits;

#[derive(Default)]
struct Fields {
    id: Option<u64>,
    message: String,
}

impl tracing::field::Visit for Fields {
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        if field.name() == "id" {
            self.id = Some(value);
        }
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        }
    }
}

impl<S> tracing_subscriber::Layer<S> for CountWaits
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        let group = fields
            .id
            .and_then(|n| pending().lock().expect("pending").remove(&n));
        if let (Some(span), Some(group)) = (ctx.span(id), group) {
            span.extensions_mut().insert(Waited {
                yet: AtomicBool::new(false),
                group,
            });
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: tracing_subscriber::layer::Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        if fields.message != WAITING {
            return;
        }
        let Some(scope) = ctx.event_scope(event) else {
            return;
        };
        for span in scope {
            if let Some(waited) = span.extensions().get::<Waited>() {
                if !waited.yet.swap(true, Ordering::SeqCst) {
                    waited.group.send_modify(|n| *n += 1);
                }
                return;
            }
        }
    }
}

/// Installs the wait counter [`Waits`] reads, as the process's tracing subscriber. Call it before
/// the first request: a callsite first used while no subscriber was set may keep that answer.
pub fn count_waits() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::Layer;
        let only = tracing_subscriber::filter::Targets::new()
            .with_target("idem", tracing::Level::DEBUG)
            .with_target(REQUEST_SPAN, tracing::Level::INFO);
        let subscriber = tracing_subscriber::registry().with(CountWaits.with_filter(only));
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
    });
}

impl Waits {
    pub fn new() -> Self {
        count_waits();
        Self(Arc::new(watch::Sender::new(0)))
    }

    /// `request` sent to `router` as a request of this group, as a future of its own to spawn.
    pub fn sent(
        &self,
        router: &Router,
        request: Request<Body>,
    ) -> impl Future<Output = Reply> + Send + 'static {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        pending()
            .lock()
            .expect("pending")
            .insert(id, self.0.clone());
        let span = tracing::info_span!(target: REQUEST_SPAN, "request", id);
        sent(router, request).instrument(span)
    }

    /// Returns once `n` requests of the group wait for an identical one.
    pub async fn until(&self, n: usize) {
        let mut waiting = self.0.subscribe();
        tokio::time::timeout(HANG, waiting.wait_for(|w| *w >= n))
            .await
            .unwrap_or_else(|_| panic!("{n} duplicates never waited at once"))
            .expect("group alive");
    }
}

// ---- The cases ----

/// The business row and the stored response commit together; the retry replays and writes nothing.
pub async fn write_and_record_commit_together(b: &impl Backend) {
    let router = b.router();
    let first = send(
        &router,
        post("/entries", "alice", "k1", json!({"amount": 1000})),
    )
    .await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());
    assert_eq!(first.json()["taken_over"], false);
    assert!(first.headers.get("idempotency-expires").is_some());
    assert_eq!(b.ledger_rows().await, 1);
    let record = b.record("alice", "k1").await.expect("record committed");
    assert_eq!(completed_status(&record), Some(201));

    let retry = send(
        &router,
        post("/entries", "alice", "k1", json!({"amount": 1000})),
    )
    .await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.json(), first.json());
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(b.controls().runs(), 1);
}

/// Whether a key's claim was given back: its record kept as released (for the request's retry to
/// resume, as the store contract keeps it) or, in a store that deletes it, gone.
fn released(record: Option<Record>) -> bool {
    record.is_none_or(|record| record.state == RecordState::Released)
}

/// A 500 after the business write rolls it back and releases the key; the retry runs once more,
/// and its row is the only one.
pub async fn a_server_error_leaves_neither_row_nor_record(b: &impl Backend) {
    let router = b.router();
    let body = json!({"amount": 5});
    b.controls().fail_next.store(1, Ordering::Relaxed);
    let failed = send(&router, post("/entries", "alice", "k2", body.clone())).await;
    assert_eq!(failed.status, 500, "{failed:?}");
    assert_eq!(
        b.ledger_rows().await,
        0,
        "the business write was rolled back"
    );
    assert!(released(b.record("alice", "k2").await), "no claim left");
    assert_eq!(b.engine().metrics().get(Outcome::Released), 1);

    let retry = send(&router, post("/entries", "alice", "k2", body.clone())).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    let again = send(&router, post("/entries", "alice", "k2", body)).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(b.controls().runs(), 2, "the failed run and the retry");
}

/// Under `client_errors = "release"`, a 4xx after the business write rolls it back and releases
/// the key, as a 5xx does; the corrected retry with the same key runs, and is kept.
pub async fn a_released_4xx_leaves_neither_row_nor_record(b: &impl Backend) {
    let router = b.router();
    let refused = send(
        &router,
        post(
            "/corrected",
            "alice",
            "k4",
            json!({"amount": 5, "fail": "422"}),
        ),
    )
    .await;
    assert_eq!(refused.status, 422, "{refused:?}");
    assert_eq!(
        b.ledger_rows().await,
        0,
        "the business write was rolled back"
    );
    assert!(
        released(b.record("alice", "k4").await),
        "the claim was given back"
    );
    let corrected = send(
        &router,
        post("/corrected", "alice", "k4", json!({"amount": 5})),
    )
    .await;
    assert_eq!(
        (corrected.status, corrected.replayed()),
        (201, false),
        "{corrected:?}"
    );
    let again = send(
        &router,
        post("/corrected", "alice", "k4", json!({"amount": 5})),
    )
    .await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(
        b.controls().runs(),
        2,
        "the refused run and the corrected one"
    );
}

/// A panic after the business write answers 500, rolls the write back and releases the key; the
/// retry runs as new.
pub async fn a_panic_leaves_neither_row_nor_record(b: &impl Backend) {
    let router = b.router();
    let panicked = send(
        &router,
        post(
            "/entries",
            "alice",
            "k3",
            json!({"amount": 5, "fail": "panic"}),
        ),
    )
    .await;
    assert_eq!(panicked.status, 500, "{panicked:?}");
    assert_eq!(b.ledger_rows().await, 0);
    assert!(released(b.record("alice", "k3").await));

    // The key is free again: the retry (without the panic) runs as new.
    let retry = send(
        &router,
        post("/entries", "alice", "k3", json!({"amount": 5})),
    )
    .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(b.controls().runs(), 2);
}

/// A body the handler's `Json` refuses is axum's 422, after the key was claimed: nothing runs or
/// is written, the key is released (not stored), and the corrected retry with the same key runs.
/// Without a key (`missing_key = "pass"`) the refusal is the same.
pub async fn a_body_the_extractor_refuses_releases_the_key(b: &impl Backend) {
    let router = b.router();
    let wrong = json!({"amount": "a thousand"});
    let refused = send(&router, post("/entries", "alice", "k8", wrong.clone())).await;
    assert_eq!(refused.status, 422, "{refused:?}");
    assert!(!refused.replayed());
    assert!(released(b.record("alice", "k8").await), "released");
    assert_eq!(b.engine().metrics().get(Outcome::Released), 1);
    let passed = send(&router, post_without_key("/optional", "alice", wrong)).await;
    assert_eq!(passed.status, 422, "{passed:?}");
    assert_eq!((b.ledger_rows().await, b.controls().runs()), (0, 0));

    let corrected = send(
        &router,
        post("/entries", "alice", "k8", json!({"amount": 8})),
    )
    .await;
    assert_eq!(corrected.status, 201, "{corrected:?}");
    assert!(!corrected.replayed());
    assert_eq!((b.ledger_rows().await, b.controls().runs()), (1, 1));
}

/// A handler that answers without touching its transaction (here a validation error) has its
/// response stored as in the default mode: the retry replays it and the handler ran once.
pub async fn a_handler_that_never_writes_has_its_response_stored(b: &impl Backend) {
    let router = b.router();
    let refused = send(
        &router,
        post("/entries", "uma", "zero", json!({"amount": 0})),
    )
    .await;
    assert_eq!(refused.status, 422, "{refused:?}");
    assert!(refused.headers.get("idempotency-expires").is_some());
    let record = b.record("uma", "zero").await.expect("stored");
    assert_eq!(completed_status(&record), Some(422));

    let retry = send(
        &router,
        post("/entries", "uma", "zero", json!({"amount": 0})),
    )
    .await;
    assert_eq!(retry.status, 422);
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.json(), refused.json());
    assert_eq!(b.controls().runs(), 1);
    assert_eq!(b.ledger_rows().await, 0);
}

/// A commit that fails (a deferred constraint checked at `COMMIT`) stores nothing: the client gets
/// 503 `store-unavailable` instead of the handler's 201, the key is released, and the retry runs
/// the handler again and commits once.
pub async fn a_failed_commit_answers_503_and_releases_the_key(b: &impl Backend) {
    let router = b.router();
    b.controls().orphan_next.store(1, Ordering::Relaxed);
    let failed = send(
        &router,
        post("/entries", "vic", "orphan", json!({"amount": 8})),
    )
    .await;
    assert_eq!(failed.status, 503, "{failed:?}");
    assert_eq!(failed.problem_type(), "urn:idem:problem:store-unavailable");
    assert!(failed.headers.get("retry-after").is_some());
    assert_eq!(b.ledger_rows().await, 0);
    assert!(released(b.record("vic", "orphan").await), "released");

    let retry = send(
        &router,
        post("/entries", "vic", "orphan", json!({"amount": 8})),
    )
    .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(b.controls().runs(), 2);
}

/// 16 identical requests at once: one business row; every reply is the same 201, one of them
/// fresh. The original is held in its foreign call until the other 15 wait for it. (Held after its
/// write instead, on SQLite its open transaction would hold the write gate that a duplicate which
/// found no record yet needs for its claim statement; duplicates that arrive after the claim wait
/// for an open transaction in the cases below.)
pub async fn sixteen_identical_requests_write_once(b: &impl Backend) {
    let router = b.router();
    let waits = Waits::new();
    let body = json!({"amount": 700, "hold": "call"});
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        tasks.spawn(waits.sent(&router, post("/entries", "bob", "same", body.clone())));
    }
    b.controls().until_held(1).await;
    waits.until(15).await;
    // Enough permits for every request: if more than one ever ran, none would hang, and the row
    // count below would show it.
    b.controls().release.add_permits(16);
    let replies = replies(tasks).await;
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(b.controls().runs(), 1);
    let id = replies[0].json()["id"].clone();
    for reply in &replies {
        assert_eq!(reply.status, 201, "{reply:?}");
        assert_eq!(reply.json()["id"], id);
    }
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
    assert_eq!(b.engine().metrics().get(Outcome::Waited), 15);
}

/// Duplicates sent to another instance (its own store and pool on the same database) wait for the
/// original without a connection of their own, are woken by its commit and replay it.
pub async fn duplicates_on_another_instance_wait_without_a_connection(b: &impl Backend) {
    let other = b.another_instance().await;
    let waits = Waits::new();
    let body = json!({"amount": 8, "hold": "tx"});
    let original = tokio::spawn(sent(
        &b.router(),
        post("/entries", "hank", "twice", body.clone()),
    ));
    b.controls().until_held(1).await;
    let mut duplicates = tokio::task::JoinSet::new();
    for _ in 0..4 {
        duplicates.spawn(waits.sent(
            &other.router,
            post("/entries", "hank", "twice", body.clone()),
        ));
    }
    waits.until(4).await;
    // While the original is held they can only wait: this is their waiting state.
    until("the other instance's pool is idle", || {
        (other.in_use)() == 0
    })
    .await;

    b.controls().release.add_permits(5);
    let original = original.await.expect("original");
    assert_eq!(original.status, 201, "{original:?}");
    for reply in replies(duplicates).await {
        assert_eq!(reply.status, 201, "{reply:?}");
        assert!(reply.replayed(), "{reply:?}");
        assert_eq!(reply.json(), original.json());
    }
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(b.controls().runs(), 1);
    assert_eq!(other.engine.metrics().get(Outcome::Waited), 4);
}

/// On a pool of two connections: sixteen duplicates wait for an original held in its foreign call,
/// and meanwhile requests on three other keys still get connections and answer as new; once the
/// original commits, every duplicate replays it. Waiting duplicates hold no connection.
pub async fn a_duplicate_storm_leaves_the_pool_to_other_keys(b: &impl Backend) {
    let router = b.router();
    let waits = Waits::new();
    let body = json!({"amount": 5, "hold": "call"});
    let original = tokio::spawn(sent(
        &router,
        post("/entries", "gail", "storm", body.clone()),
    ));
    b.controls().until_held(1).await;
    let mut duplicates = tokio::task::JoinSet::new();
    for _ in 0..16 {
        duplicates.spawn(waits.sent(&router, post("/entries", "gail", "storm", body.clone())));
    }
    waits.until(16).await;
    until("the pool is idle", || b.in_use() == 0).await;

    for key in ["calm-1", "calm-2", "calm-3"] {
        let other = send(&router, post("/entries", "gail", key, json!({"amount": 6}))).await;
        assert_eq!(other.status, 201, "{other:?}");
        assert!(!other.replayed());
    }
    assert!(!original.is_finished(), "the original is still held");

    // A permit for every request: if a duplicate ever ran, it would not hang, and the rows would
    // show it.
    b.controls().release.add_permits(17);
    let original = original.await.expect("original");
    assert_eq!(original.status, 201, "{original:?}");
    for reply in replies(duplicates).await {
        assert_eq!(reply.status, 201, "{reply:?}");
        assert!(reply.replayed(), "{reply:?}");
        assert_eq!(reply.json(), original.json());
    }
    assert_eq!(b.ledger_rows().await, 4, "the storm's row and three others");
    assert_eq!(b.controls().runs(), 4);
    assert_eq!(b.engine().metrics().get(Outcome::Waited), 16);
}

/// On a pool of two connections, eight requests on distinct keys are all in their foreign call at
/// once: none holds a connection or, on SQLite, the write lock while it waits (they would queue
/// behind one another). Released, each writes and commits; none gets a 503.
pub async fn distinct_keys_make_their_foreign_calls_together(b: &impl Backend) {
    const K: usize = 8;
    let router = b.router();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..K {
        let request = post(
            "/entries",
            "ivy",
            &format!("key-{i}"),
            json!({"amount": 1, "hold": "call"}),
        );
        tasks.spawn(sent(&router, request));
    }
    b.controls().until_held(K).await;
    until("the pool is idle", || b.in_use() == 0).await;
    b.controls().release.add_permits(K);
    for reply in replies(tasks).await {
        assert_eq!(reply.status, 201, "{reply:?}");
        assert!(!reply.replayed());
    }
    assert_eq!(b.ledger_rows().await, i64::try_from(K).expect("small"));
    assert_eq!(b.controls().runs(), K);
}

/// A duplicate that waits for an original which then fails (500: its transaction rolls back and the
/// key is released) is woken, runs the handler itself, and only its write remains.
pub async fn a_duplicate_runs_once_the_original_rolls_back(b: &impl Backend) {
    b.controls().fail_next.store(1, Ordering::Relaxed);
    let router = b.router();
    let waits = Waits::new();
    let body = json!({"amount": 2, "hold": "tx"});
    let original = tokio::spawn(sent(
        &router,
        post("/entries", "ivy", "again", body.clone()),
    ));
    b.controls().until_held(1).await;
    let duplicate = tokio::spawn(waits.sent(&router, post("/entries", "ivy", "again", body)));
    waits.until(1).await;
    b.controls().release.add_permits(2);
    let original = original.await.expect("original");
    assert_eq!(original.status, 500, "{original:?}");
    let duplicate = duplicate.await.expect("duplicate");
    assert_eq!(duplicate.status, 201, "{duplicate:?}");
    assert!(!duplicate.replayed(), "it ran: {duplicate:?}");
    assert_eq!(b.controls().runs(), 2);
    assert_eq!(
        b.ledger_rows().await,
        1,
        "the failed run's write was rolled back"
    );
}

/// A duplicate still blocked when the policy's wait ends (`wait = "0s"`) gets 409 + Retry-After,
/// from this instance or another one; once the original commits, the next retry replays.
pub async fn a_duplicate_blocked_past_the_wait_gets_409(b: &impl Backend) {
    let router = b.router();
    let other = b.another_instance().await;
    let body = json!({"amount": 9, "hold": "tx"});
    let original = tokio::spawn(sent(&router, post("/quick", "carol", "q", body.clone())));
    b.controls().until_held(1).await;
    for (instance, engine) in [(&router, b.engine()), (&other.router, &other.engine)] {
        // Bounded: a duplicate that ignored its `wait` would otherwise hang here, the original being
        // held until after this answer.
        let blocked = tokio::time::timeout(
            HANG,
            send(instance, post("/quick", "carol", "q", body.clone())),
        )
        .await
        .expect("the duplicate answers at the end of its wait");
        assert_eq!(blocked.status, 409, "{blocked:?}");
        assert_eq!(blocked.problem_type(), "urn:idem:problem:in-flight");
        assert_eq!(
            blocked.headers.get("retry-after").map(|v| v.as_bytes()),
            Some(&b"1"[..])
        );
        assert_eq!(engine.metrics().get(Outcome::Conflict), 1);
    }
    b.controls().release.add_permits(1);
    let original = original.await.expect("original");
    assert_eq!(original.status, 201);
    let retry = send(&other.router, post("/quick", "carol", "q", body)).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(b.controls().runs(), 1);
}

/// Mismatch (422) and expiry (410) work as in the default mode.
pub async fn mismatch_and_expired_still_work(b: &impl Backend) {
    let router = b.router();
    let first = send(&router, post("/entries", "dave", "m", json!({"amount": 1}))).await;
    assert_eq!(first.status, 201);
    let other = send(&router, post("/entries", "dave", "m", json!({"amount": 2}))).await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(other.problem_type(), "urn:idem:problem:key-mismatch");
    b.clock().advance(Duration::from_secs(24 * 3600 + 1));
    let late = send(&router, post("/entries", "dave", "m", json!({"amount": 1}))).await;
    assert_eq!(late.status, 410, "{late:?}");
    assert_eq!(late.problem_type(), "urn:idem:problem:key-expired");
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(b.controls().runs(), 1);
}

/// A replay reads the record and answers: it takes no write lock, so it answers while another
/// connection holds the database's write lock (a replay that opened a write would block on it).
pub async fn a_replay_opens_no_write(b: &impl Backend) {
    let router = b.router();
    let first = send(&router, post("/entries", "erin", "r", json!({"amount": 3}))).await;
    assert_eq!(first.status, 201);
    let lock = b.lock_writes().await;
    let replay = send(&router, post("/entries", "erin", "r", json!({"amount": 3}))).await;
    lock.release().await;
    assert_eq!(replay.status, 201, "{replay:?}");
    assert!(replay.replayed());
    assert_eq!(replay.json(), first.json());
}

/// `missing_key = "pass"`: a request without a key still runs in a transaction of its own,
/// committed on success and rolled back on a 5xx; nothing is recorded for it.
pub async fn a_passed_request_still_gets_a_transaction(b: &impl Backend) {
    let router = b.router();
    let ok = send(
        &router,
        post_without_key("/optional", "frank", json!({"amount": 4})),
    )
    .await;
    assert_eq!(ok.status, 201, "{ok:?}");
    assert!(ok.headers.get("idempotency-expires").is_none());
    assert_eq!(b.ledger_rows().await, 1, "committed");
    let failed = send(
        &router,
        post_without_key("/optional", "frank", json!({"amount": 4, "fail": "500"})),
    )
    .await;
    assert_eq!(failed.status, 500);
    assert_eq!(b.ledger_rows().await, 1, "rolled back");
    assert_eq!(b.engine().metrics().get(Outcome::MissingKeyPassed), 2);
}

/// A worker cut off for longer than its lease (here: the clock moves past it while the handler is
/// in its foreign call) is taken over. The heir sees `taken_over` and the same downstream key. The
/// first worker, released first, finds its claim gone when it commits: its write rolls back and
/// its client gets 503. The heir's write is the one row, and the retry replays the heir's answer.
pub async fn a_takeover_fences_the_first_attempts_commit(b: &impl Backend) {
    let router = b.router();
    let body = json!({"amount": 7, "hold": "call"});
    let first = tokio::spawn(sent(
        &router,
        post("/entries", "olga", "slow", body.clone()),
    ));
    b.controls().until_held(1).await;
    b.clock().advance(Duration::from_secs(301));
    let heir = tokio::spawn(sent(
        &router,
        post("/entries", "olga", "slow", body.clone()),
    ));
    b.controls().until_held(2).await;
    let attempts = b.controls().attempts();
    assert_eq!(attempts.len(), 2);
    assert!(!attempts[0].taken_over);
    assert!(attempts[1].taken_over, "the second run took over");
    let downstream = attempts[0].downstream_key.clone().expect("a keyed run");
    assert_eq!(attempts[1].downstream_key.as_deref(), Some(&*downstream));

    b.controls().release.add_permits(1); // the first attempt, held first
    let first = first.await.expect("first attempt");
    assert_eq!(first.status, 503, "{first:?}");
    assert_eq!(first.problem_type(), "urn:idem:problem:store-unavailable");
    assert_eq!(b.ledger_rows().await, 0, "the fenced write rolled back");

    b.controls().release.add_permits(1);
    let heir = heir.await.expect("heir");
    assert_eq!(heir.status, 201, "{heir:?}");
    assert_eq!(heir.json()["taken_over"], true);
    assert_eq!(heir.json()["downstream_key"], downstream);
    let retry = send(&router, post("/entries", "olga", "slow", body)).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.json(), heir.json());
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(b.controls().runs(), 2);
    assert_eq!(b.engine().metrics().get(Outcome::TakenOver), 1);
}

/// A client that hangs up while its handler runs does not stop it: the handler writes and commits,
/// and the retry replays its answer.
pub async fn a_request_dropped_mid_handler_still_commits(b: &impl Backend) {
    let router = b.router();
    let body = json!({"amount": 3, "hold": "call"});
    let gone = tokio::spawn(sent(&router, post("/entries", "pia", "gone", body.clone())));
    b.controls().until_held(1).await;
    gone.abort();
    assert!(gone.await.expect_err("cancelled").is_cancelled());
    b.controls().release.add_permits(1);
    // Waits for the original if it is still running, then replays it.
    let retry = send(&router, post("/entries", "pia", "gone", body)).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(b.controls().runs(), 1);
}

/// By hand: the claim is committed on its own before the handler writes anything (another
/// connection sees it in flight, and can take the write lock: nothing is held), the transaction
/// begins at the first `conn()`, and `complete` commits the write with the response. `rollback`
/// drops the write and frees the key.
pub async fn the_claim_commits_alone_and_the_transaction_begins_at_first_use<B>(b: &B)
where
    B: Backend,
    idem_runtime::Tx<Db<B>>: Ledger,
{
    let txn = b.txn();
    let policy = Policy::new();
    let fp = Fingerprint::of_request("POST", "/by-hand", None, b"x");
    let key = RecordKey::new("hana", "by-hand");
    let Ok(TxBegin::Execute(mut claim)) = txn.begin(key.clone(), fp, &policy).await else {
        panic!("a fresh key executes");
    };
    assert!(!claim.tx.is_begun());
    let record = b.record("hana", "by-hand").await.expect("committed");
    assert_eq!(record.token, claim.guard.token());
    assert!(matches!(record.state, RecordState::InFlight { .. }));
    let lock = tokio::time::timeout(HANG, b.lock_writes())
        .await
        .expect("nothing holds the write lock before the first write");
    lock.release().await;

    let row = Row {
        id: "hand-1",
        owner: "hana",
        amount: 10,
        parent: None,
    };
    claim.tx.insert(&row).await.expect("write");
    assert!(claim.tx.is_begun());
    assert_eq!(b.ledger_rows().await, 0, "not visible before the commit");
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: "made".into(),
    };
    claim.complete(&response).await.expect("commit");
    assert_eq!(b.ledger_rows().await, 1);
    match txn.begin(key, fp, &policy).await {
        Ok(TxBegin::Replay(replay)) => assert_eq!(replay.response, response),
        other => panic!("the key replays: {other:?}"),
    }

    let key = RecordKey::new("hana", "undone");
    let Ok(TxBegin::Execute(mut claim)) = txn.begin(key.clone(), fp, &policy).await else {
        panic!("a fresh key executes");
    };
    let row = Row {
        id: "hand-2",
        ..row
    };
    claim.tx.insert(&row).await.expect("write");
    claim.rollback().await.expect("rollback");
    assert_eq!(b.ledger_rows().await, 1, "the rolled back row is gone");
    assert!(released(b.record("hana", "undone").await), "released");
    assert!(matches!(
        txn.begin(key, fp, &policy).await,
        Ok(TxBegin::Execute(_))
    ));
}

/// The function face in transactional mode (`Transactional::once`): the work's write commits with
/// its stored output, and a retry returns the output without writing; a failed work's write is
/// rolled back and its key freed; a call dropped mid-work (its worker died) commits nothing and
/// leaves its key in flight.
pub async fn a_function_call_commits_its_writes_with_its_output<B>(b: &B)
where
    B: Backend,
    idem_runtime::Tx<Db<B>>: Ledger,
{
    use idem_runtime::function::{CallError, OnceError};
    let txn = b.txn();
    let policy = Policy::new().wait(Duration::ZERO);
    let input = json!({"amount": 10});
    let fp = Fingerprint::of_input(&input).expect("JSON");
    let write = |id: &'static str, fail: bool| {
        move |_, mut tx: idem_runtime::Tx<Db<B>>| async move {
            let row = Row {
                id,
                owner: "fay",
                amount: 10,
                parent: None,
            };
            tx.insert(&row).await.map_err(|e| e.to_string())?;
            if fail {
                return Err("the work failed after writing".to_owned());
            }
            Ok(format!("wrote {id}"))
        }
    };
    let key = RecordKey::new("fn-fay", "m-1");
    let first = txn
        .once(key.clone(), fp, &policy, write("fn-1", false))
        .await;
    assert_eq!(first.expect("runs"), "wrote fn-1");
    assert_eq!(b.ledger_rows().await, 1);
    let again = txn.once(key, fp, &policy, write("fn-1b", false)).await;
    assert_eq!(again.expect("returns the stored output"), "wrote fn-1");
    assert_eq!(b.ledger_rows().await, 1, "the retry wrote nothing");

    let key = RecordKey::new("fn-fay", "m-2");
    let failed = txn
        .once(key.clone(), fp, &policy, write("fn-2", true))
        .await;
    assert!(matches!(failed, Err(CallError::Failed(_))), "{failed:?}");
    assert_eq!(
        b.ledger_rows().await,
        1,
        "the failed work's write was rolled back"
    );
    assert!(
        released(b.record("fn-fay", "m-2").await),
        "its key was freed"
    );
    let retried = txn.once(key, fp, &policy, write("fn-2", false)).await;
    assert_eq!(retried.expect("the retry runs"), "wrote fn-2");
    assert_eq!(b.ledger_rows().await, 2);

    let key = RecordKey::new("fn-fay", "m-3");
    let wrote = tokio::sync::Notify::new();
    let dying = txn.once(
        key.clone(),
        fp,
        &policy,
        |_, mut tx: idem_runtime::Tx<Db<B>>| {
            let wrote = &wrote;
            async move {
                let row = Row {
                    id: "fn-3",
                    owner: "fay",
                    amount: 10,
                    parent: None,
                };
                tx.insert(&row).await.map_err(|e| e.to_string())?;
                wrote.notify_one();
                std::future::pending::<Result<String, String>>().await
            }
        },
    );
    tokio::select! {
        _ = dying => unreachable!("the work never ends"),
        () = wrote.notified() => {}
    }
    assert_eq!(
        b.ledger_rows().await,
        2,
        "the dead worker's write never committed"
    );
    let duplicate = txn.once(key, fp, &policy, write("fn-3b", false)).await;
    assert!(
        matches!(
            duplicate,
            Err(CallError::Once(OnceError::Rejected(
                idem_runtime::Rejection::InFlight { .. }
            )))
        ),
        "the key waits for the dead worker's lease: {duplicate:?}"
    );
    assert_eq!(b.ledger_rows().await, 2);
}

/// Every shared case, for a backend's test file to instantiate: `$setup` for most, `$small` (a pool
/// of two connections) for the cases about the pool; `$attr`s go on every test.
#[macro_export]
macro_rules! transactional_cases {
    ($(#[$attr:meta])* setup = $setup:expr, small = $small:expr) => {
        $crate::transactional_cases!(@each [$(#[$attr])*] $setup =>
            write_and_record_commit_together,
            a_server_error_leaves_neither_row_nor_record,
            a_released_4xx_leaves_neither_row_nor_record,
            a_panic_leaves_neither_row_nor_record,
            a_body_the_extractor_refuses_releases_the_key,
            a_handler_that_never_writes_has_its_response_stored,
            a_failed_commit_answers_503_and_releases_the_key,
            sixteen_identical_requests_write_once,
            duplicates_on_another_instance_wait_without_a_connection,
            a_duplicate_runs_once_the_original_rolls_back,
            a_duplicate_blocked_past_the_wait_gets_409,
            mismatch_and_expired_still_work,
            a_replay_opens_no_write,
            a_passed_request_still_gets_a_transaction,
            a_takeover_fences_the_first_attempts_commit,
            a_request_dropped_mid_handler_still_commits,
            the_claim_commits_alone_and_the_transaction_begins_at_first_use,
            a_function_call_commits_its_writes_with_its_output,
        );
        $crate::transactional_cases!(@each [$(#[$attr])*] $small =>
            a_duplicate_storm_leaves_the_pool_to_other_keys,
            distinct_keys_make_their_foreign_calls_together,
        );
    };
    (@each [$($attrs:tt)*] $setup:expr => $name:ident, $($rest:ident,)*) => {
        $($attrs)*
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            let backend = $setup.await;
            $crate::transactional_support::$name(&backend).await;
        }
        $crate::transactional_cases!(@each [$($attrs)*] $setup => $($rest,)*);
    };
    (@each [$($attrs:tt)*] $setup:expr =>) => {};
}
