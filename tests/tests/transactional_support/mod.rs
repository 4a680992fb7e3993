//! Transactional mode over HTTP, the same cases for PostgreSQL and SQLite: a ledger table written
//! through the handler's `Tx`, next to idem's records in the same database.
//!
//! Each backend's test file builds its app with [`transactional_app!`] and implements [`Backend`];
//! the cases below are written once.

#![allow(dead_code)]

use axum::body::{Body, Bytes};
use axum::extract::{FromRef, FromRequestParts};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use idem_runtime::axum::Scope;
use idem_runtime::clock::ManualClock;
use idem_runtime::metrics::Outcome;
use idem_runtime::{Engine, Record, RecordState};
use serde_json::{json, Value};
use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

/// 2026-11-30T00:00:00Z, where every test clock starts.
pub const START_MS: i64 = 1_795_996_800_000;

/// The ledger the handlers write, in the same database as idem's records.
pub const LEDGER: &str =
    "CREATE TABLE ledger (id TEXT PRIMARY KEY, owner TEXT NOT NULL, amount BIGINT NOT NULL)";

/// What the test drives in the handlers.
#[derive(Clone)]
pub struct Controls {
    /// How many requests got past their extractors (before idem decides anything).
    pub arrived: watch::Sender<usize>,
    /// How many times a handler body ran its business write.
    pub entered: watch::Sender<usize>,
    /// Held requests wait for a permit here.
    pub release: Arc<Semaphore>,
    /// How many of the next handler runs answer 500 after their write (and after their hold).
    pub fail_next: Arc<AtomicUsize>,
}

impl Default for Controls {
    fn default() -> Self {
        Self {
            arrived: watch::Sender::new(0),
            entered: watch::Sender::new(0),
            release: Arc::new(Semaphore::new(0)),
            fail_next: Arc::default(),
        }
    }
}

impl Controls {
    pub async fn until_entered(&self, n: usize) {
        let mut rx = self.entered.subscribe();
        rx.wait_for(|v| *v >= n).await.expect("controls alive");
    }

    pub async fn until_arrived(&self, n: usize) {
        let mut rx = self.arrived.subscribe();
        rx.wait_for(|v| *v >= n).await.expect("controls alive");
    }
}

/// Demo auth: `Authorization: Bearer <user>`; counts arrivals.
pub struct User(pub String);

impl<S> FromRequestParts<S> for User
where
    Controls: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, StatusCode> {
        let user = parts
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|id| User(id.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)?;
        Controls::from_ref(state).arrived.send_modify(|n| *n += 1);
        Ok(user)
    }
}

impl Scope for User {
    fn scope_id(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

/// A request body: `amount`, and what the handler should do after its write.
#[derive(Debug, serde::Deserialize)]
pub struct Entry {
    pub amount: i64,
    /// Wait for a permit on `Controls::release` after the write.
    #[serde(default)]
    pub hold: bool,
    /// `"500"`: answer 500 after the write; `"panic"`: panic after it.
    #[serde(default)]
    pub fail: Option<String>,
}

/// Defines `App` (state: the `Transactional` engine and the `Controls`), three handlers in
/// transactional mode (`POST /entries` waits up to 60 s for an identical request, `POST /quick` not
/// at all, `POST /optional` runs requests without a key unprotected) and `router(app)`, for the
/// database type `$db` and its store `$store`.
#[macro_export]
macro_rules! transactional_app {
    ($db:ty, $store:ty) => {
        #[derive(Clone, axum::extract::FromRef)]
        pub struct App {
            pub txn: idem_runtime::Transactional<$store>,
            pub controls: transactional_support::Controls,
        }

        async fn entry(
            controls: transactional_support::Controls,
            user: transactional_support::User,
            tx: &mut idem_runtime::Tx<$db>,
            req: transactional_support::Entry,
        ) -> axum::response::Response {
            use axum::response::IntoResponse;
            let id = format!("e_{}", uuid::Uuid::new_v4().simple());
            idem_runtime::sqlx::query("INSERT INTO ledger (id, owner, amount) VALUES ($1, $2, $3)")
                .bind(&id)
                .bind(&user.0)
                .bind(req.amount)
                .execute(&mut **tx)
                .await
                .expect("ledger insert");
            controls.entered.send_modify(|n| *n += 1);
            if req.hold {
                controls.release.acquire().await.expect("semaphore open").forget();
            }
            let fail_now = controls
                .fail_next
                .fetch_update(
                    std::sync::atomic::Ordering::Relaxed,
                    std::sync::atomic::Ordering::Relaxed,
                    |n| n.checked_sub(1),
                )
                .is_ok();
            match req.fail.as_deref().or(fail_now.then_some("500")) {
                Some("500") => {
                    return (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "failed after writing")
                        .into_response()
                }
                Some("panic") => panic!("the handler panics after its write"),
                _ => {}
            }
            (
                axum::http::StatusCode::CREATED,
                axum::Json(serde_json::json!({ "id": id, "amount": req.amount })),
            )
                .into_response()
        }

        #[idem_runtime::idempotent(scope = "user", transaction = "tx", wait = "60s")]
        async fn create(
            axum::extract::State(controls): axum::extract::State<transactional_support::Controls>,
            user: transactional_support::User,
            mut tx: idem_runtime::Tx<$db>,
            axum::Json(req): axum::Json<transactional_support::Entry>,
        ) -> axum::response::Response {
            entry(controls, user, &mut tx, req).await
        }

        #[idem_runtime::idempotent(scope = "user", transaction = "tx", wait = "0s")]
        async fn quick(
            axum::extract::State(controls): axum::extract::State<transactional_support::Controls>,
            user: transactional_support::User,
            mut tx: idem_runtime::Tx<$db>,
            axum::Json(req): axum::Json<transactional_support::Entry>,
        ) -> axum::response::Response {
            entry(controls, user, &mut tx, req).await
        }

        #[idem_runtime::idempotent(scope = "user", transaction = "tx", missing_key = "pass")]
        async fn optional(
            axum::extract::State(controls): axum::extract::State<transactional_support::Controls>,
            user: transactional_support::User,
            mut tx: idem_runtime::Tx<$db>,
            axum::Json(req): axum::Json<transactional_support::Entry>,
        ) -> axum::response::Response {
            entry(controls, user, &mut tx, req).await
        }

        pub fn router(app: App) -> axum::Router {
            axum::Router::new()
                .route("/entries", axum::routing::post(create))
                .route("/quick", axum::routing::post(quick))
                .route("/optional", axum::routing::post(optional))
                .with_state(app)
        }
    };
}

/// What the shared cases need from a backend.
#[async_trait::async_trait]
pub trait Backend: Send + Sync {
    fn router(&self) -> Router;
    fn controls(&self) -> &Controls;
    fn clock(&self) -> &ManualClock;
    fn engine(&self) -> &Engine;
    async fn ledger_rows(&self) -> i64;
    /// idem's record for (`user`, `key`), committed, read on another connection.
    async fn record(&self, user: &str, key: &str) -> Option<Record>;
    /// Holds the database's write lock for idem's records from another connection until dropped
    /// (after it is released with `release`).
    async fn lock_writes(&self) -> Box<dyn WriteLock>;
    /// How many requests wait for an identical request's transaction to end, in this process.
    fn waiting_for_turns(&self) -> usize;
}

/// Returns once `n` requests wait for an identical request's transaction in this process. They
/// wait without a timer, so this yields until the count is reached; the bound only turns a hang
/// into a failure.
pub async fn until_waiting(b: &impl Backend, n: usize) {
    until_counted(|| b.waiting_for_turns(), n).await;
}

/// Returns once `waiting` (a count of requests waiting for a turn) reaches `n`, as
/// [`until_waiting`] does for a backend's own app.
pub async fn until_counted(waiting: impl Fn() -> usize, n: usize) {
    tokio::time::timeout(Duration::from_secs(60), async {
        while waiting() < n {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the duplicates wait for the original");
}

/// `request` sent to `router`, as a future of its own to spawn.
pub fn sent(
    router: &Router,
    request: Request<Body>,
) -> impl std::future::Future<Output = Reply> + Send + 'static {
    let router = router.clone();
    async move { send(&router, request).await }
}

#[async_trait::async_trait]
pub trait WriteLock: Send {
    async fn release(self: Box<Self>);
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

fn completed_status(record: &Record) -> Option<u16> {
    match &record.state {
        RecordState::Completed { response } => Some(response.status),
        RecordState::InFlight { .. } => None,
    }
}

// ---- The cases ----

/// The business row and the record commit together; the retry replays and writes nothing.
pub async fn write_and_record_commit_together(b: &impl Backend) {
    let router = b.router();
    let first = send(
        &router,
        post("/entries", "alice", "k1", json!({"amount": 1000})),
    )
    .await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());
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
    assert_eq!(*b.controls().entered.borrow(), 1);
}

/// A 500 after the business write rolls both back; the retry runs as new.
pub async fn a_server_error_leaves_neither_row_nor_record(b: &impl Backend) {
    let router = b.router();
    let failed = send(
        &router,
        post(
            "/entries",
            "alice",
            "k2",
            json!({"amount": 5, "fail": "500"}),
        ),
    )
    .await;
    assert_eq!(failed.status, 500);
    assert_eq!(
        b.ledger_rows().await,
        0,
        "the business write was rolled back"
    );
    assert!(b.record("alice", "k2").await.is_none(), "no claim left");
    assert_eq!(b.engine().metrics().get(Outcome::Released), 1);

    let retry = send(
        &router,
        post("/entries", "alice", "k2", json!({"amount": 5})),
    )
    .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(b.ledger_rows().await, 1);
}

/// A panic after the business write rolls both back; the retry runs as new.
pub async fn a_panic_leaves_neither_row_nor_record(b: &impl Backend) {
    let router = b.router();
    let request = post(
        "/entries",
        "alice",
        "k3",
        json!({"amount": 5, "fail": "panic"}),
    );
    let panicked = tokio::spawn({
        let router = router.clone();
        async move { send(&router, request).await }
    })
    .await;
    assert!(panicked.expect_err("the handler panicked").is_panic());
    assert_eq!(b.ledger_rows().await, 0);
    assert!(b.record("alice", "k3").await.is_none());

    let retry = send(
        &router,
        post("/entries", "alice", "k3", json!({"amount": 5})),
    )
    .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(b.ledger_rows().await, 1);
}

/// 16 identical requests at once: one business row; every reply is the same 201, one of them
/// fresh. The original is held after its write until the other 15 wait for its transaction to end
/// (in this process they wait for the key's turn, holding no connection: `transaction::turns`).
pub async fn sixteen_identical_requests_write_once(b: &impl Backend) {
    let router = b.router();
    let body = json!({"amount": 700, "hold": true});
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let router = router.clone();
        let body = body.clone();
        tasks.spawn(async move { send(&router, post("/entries", "bob", "same", body)).await });
    }
    b.controls().until_arrived(16).await;
    b.controls().until_entered(1).await;
    until_waiting(b, 15).await;
    // Enough permits for every request: if more than one ever ran, none would hang, and the row
    // count below would show it.
    b.controls().release.add_permits(16);
    let mut replies = Vec::new();
    while let Some(reply) = tasks.join_next().await {
        replies.push(reply.expect("request task"));
    }
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(*b.controls().entered.borrow(), 1);
    let id = replies[0].json()["id"].clone();
    for reply in &replies {
        assert_eq!(reply.status, 201, "{reply:?}");
        assert_eq!(reply.json()["id"], id);
    }
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
}

/// A duplicate that waits for an original which then fails (500: its transaction rolls back) runs
/// the handler itself once the original's transaction has ended, and only its write remains.
pub async fn a_duplicate_runs_once_the_original_rolls_back(b: &impl Backend) {
    b.controls().fail_next.store(1, Ordering::Relaxed);
    let router = b.router();
    let body = json!({"amount": 2, "hold": true});
    let original = tokio::spawn(sent(
        &router,
        post("/entries", "ivy", "again", body.clone()),
    ));
    b.controls().until_entered(1).await;
    let duplicate = tokio::spawn(sent(
        &router,
        post("/entries", "ivy", "again", body.clone()),
    ));
    until_waiting(b, 1).await;
    b.controls().release.add_permits(2);
    let original = original.await.expect("original");
    assert_eq!(original.status, 500, "{original:?}");
    let duplicate = duplicate.await.expect("duplicate");
    assert_eq!(duplicate.status, 201, "{duplicate:?}");
    assert!(!duplicate.replayed(), "it ran: {duplicate:?}");
    assert_eq!(*b.controls().entered.borrow(), 2);
    assert_eq!(
        b.ledger_rows().await,
        1,
        "the failed run's write was rolled back"
    );
}

/// A duplicate still blocked when the policy's wait ends gets 409 + Retry-After; once the original
/// commits, the next retry replays.
pub async fn a_duplicate_blocked_past_the_wait_gets_409(b: &impl Backend) {
    let router = b.router();
    let body = json!({"amount": 9, "hold": true});
    let original = tokio::spawn(sent(&router, post("/quick", "carol", "q", body.clone())));
    b.controls().until_entered(1).await;
    // Bounded: a duplicate that ignored its `wait` would otherwise hang here, the original being
    // held until after this answer.
    let blocked = tokio::time::timeout(
        Duration::from_secs(30),
        send(&router, post("/quick", "carol", "q", body.clone())),
    )
    .await
    .expect("the duplicate answers at the end of its wait");
    assert_eq!(blocked.status, 409, "{blocked:?}");
    assert!(blocked.headers.get("retry-after").is_some());
    assert_eq!(b.engine().metrics().get(Outcome::Conflict), 1);
    b.controls().release.add_permits(1);
    let original = original.await.expect("original");
    assert_eq!(original.status, 201);
    let retry = send(&router, post("/quick", "carol", "q", body)).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(b.ledger_rows().await, 1);
}

/// Mismatch (422) and expiry (410) work as in the default mode.
pub async fn mismatch_and_expired_still_work(b: &impl Backend) {
    let router = b.router();
    let first = send(&router, post("/entries", "dave", "m", json!({"amount": 1}))).await;
    assert_eq!(first.status, 201);
    let other = send(&router, post("/entries", "dave", "m", json!({"amount": 2}))).await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(
        other.json()["type"],
        "urn:idem:problem:key-mismatch",
        "{other:?}"
    );
    b.clock().advance(Duration::from_secs(24 * 3600 + 1));
    let late = send(&router, post("/entries", "dave", "m", json!({"amount": 1}))).await;
    assert_eq!(late.status, 410, "{late:?}");
    assert_eq!(late.json()["type"], "urn:idem:problem:key-expired");
    assert_eq!(b.ledger_rows().await, 1);
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
