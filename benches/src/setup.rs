//! The stores under test, the in-process server and its handler (plain, annotated, and with the
//! memory floor's claim and completion written around it by hand).

use crate::floors::{self, MemoryMap};
use axum::body::Body;
use axum::extract::{FromRequestParts, State};
use axum::http::header::{HeaderValue, CONTENT_TYPE, LOCATION};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use http_body_util::BodyExt;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::sqlite::SqliteStore;
use idem_runtime::store::{Purge, Store};
use idem_runtime::FencingToken;
use idem_runtime::{idempotent, Engine};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The request both handlers take.
#[derive(Debug, Deserialize)]
pub(crate) struct NewPayment {
    amount: i64,
    currency: String,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// What both handlers do: a 201 with a JSON body and a `Location`, like the payments example minus
/// its ledger, so that the difference between the two routes is idem alone.
fn created(req: NewPayment) -> Response {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    (
        StatusCode::CREATED,
        [(LOCATION, format!("/payments/{id}"))],
        Json(serde_json::json!({
            "id": id, "amount": req.amount, "currency": req.currency, "status": "captured"
        })),
    )
        .into_response()
}

pub(crate) async fn plain(Json(req): Json<NewPayment>) -> Response {
    created(req)
}

#[idempotent(scope = "global", ttl = "24h")]
pub(crate) async fn annotated(Json(req): Json<NewPayment>) -> Response {
    created(req)
}

/// The memory store's HTTP floor: the plain handler with the memory floor's claim and completion
/// (`floors::memory_claim`, `floors::memory_complete`: a `Mutex<HashMap>`) written around it by
/// hand, what an `Idempotency-Key` costs with no framework. A key already claimed answers the
/// stored body (a replay) or 409 while in flight; no fingerprint is computed or compared (the
/// record holds a constant one), nothing expires, and no header is added.
pub(crate) async fn floor(
    State(map): State<Arc<MemoryMap>>,
    KeyHeader(key): KeyHeader,
    Json(req): Json<NewPayment>,
) -> Response {
    let Some(key) = key.as_ref().and_then(|v| v.to_str().ok()) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let token = FencingToken::generate().0;
    if !floors::memory_claim(&map, key, *FLOOR_FINGERPRINT, token) {
        return match floors::memory_stored(&map, key) {
            Some(body) => {
                (StatusCode::CREATED, [(CONTENT_TYPE, JSON.clone())], body).into_response()
            }
            None => StatusCode::CONFLICT.into_response(),
        };
    }
    let (parts, mut body) = created(req).into_parts();
    // The handler's body is one frame (axum's `Json`): kept as it is, no copy.
    let body = match body.frame().await {
        Some(Ok(frame)) => frame.into_data().unwrap_or_default(),
        _ => Bytes::new(),
    };
    floors::memory_complete(&map, key, token, body.clone());
    Response::from_parts(parts, Body::from(body))
}

/// The `Idempotency-Key` header alone (axum's `HeaderMap` extractor would copy every header).
pub(crate) struct KeyHeader(Option<HeaderValue>);

impl<S: Send + Sync> FromRequestParts<S> for KeyHeader {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(KeyHeader(parts.headers.get("idempotency-key").cloned()))
    }
}

static JSON: HeaderValue = HeaderValue::from_static("application/json");
static FLOOR_FINGERPRINT: std::sync::LazyLock<[u8; 32]> =
    std::sync::LazyLock::new(|| floors::fingerprint().0);

/// `/plain` and `/idem`: the same handler without and with `#[idempotent]` (on `engine`); `/floor`:
/// the same handler with the memory floor's claim and completion written by hand (on `floor`).
pub(crate) fn router(engine: Engine, floor_map: Arc<MemoryMap>) -> Router {
    Router::new()
        .route("/plain", post(plain))
        .route("/idem", post(annotated))
        .with_state(engine)
        .merge(
            Router::new()
                .route("/floor", post(floor))
                .with_state(floor_map),
        )
}

/// Serves `router` on an ephemeral 127.0.0.1 port in this process, for as long as the process runs.
pub(crate) async fn serve(router: Router) -> SocketAddr {
    Served::start(router).await.detach()
}

/// A server in this process that stops accepting when dropped or [stopped](Self::stop). Each
/// connection is served on a task of its own with its own handle on the router, which it lets go of
/// when the connection closes.
pub(crate) struct Served {
    pub(crate) addr: SocketAddr,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Served {
    /// Serves `router` on an ephemeral 127.0.0.1 port.
    pub(crate) async fn start(router: Router) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Self {
            addr,
            task: Some(task),
        }
    }

    /// Stops accepting, and returns once the accepting task (and its handle on the router) is gone.
    pub(crate) async fn stop(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }

    /// Keeps serving after this value is gone.
    fn detach(mut self) -> SocketAddr {
        self.task = None;
        self.addr
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// The four backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    Memory,
    Sqlite,
    Postgres,
    Redis,
}

impl Backend {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Sqlite => "SQLite",
            Backend::Postgres => "PostgreSQL",
            Backend::Redis => "Redis",
        }
    }
}

/// One backend's store, with what the floors and bulk loads need to reach it directly.
#[derive(Clone)]
pub(crate) enum Handle {
    Memory(Arc<MemoryStore>),
    Sqlite(Arc<SqliteStore>),
    Postgres(Arc<PostgresStore>),
    Redis(Arc<RedisStore>, redis::aio::ConnectionManager),
}

impl Handle {
    pub(crate) fn store(&self) -> Arc<dyn Store> {
        match self {
            Handle::Memory(s) => s.clone(),
            Handle::Sqlite(s) => s.clone(),
            Handle::Postgres(s) => s.clone(),
            Handle::Redis(s, _) => s.clone(),
        }
    }

    pub(crate) fn purge(&self) -> Arc<dyn Purge> {
        match self {
            Handle::Memory(s) => s.clone(),
            Handle::Sqlite(s) => s.clone(),
            Handle::Postgres(s) => s.clone(),
            Handle::Redis(s, _) => s.clone(),
        }
    }
}

/// Where the services are. Defaults: the test services.
pub(crate) fn postgres_base() -> String {
    std::env::var("IDEM_BENCH_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

pub(crate) fn redis_url() -> String {
    // Database 7, flushed by the bench: never the tests' database 0.
    std::env::var("IDEM_BENCH_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/7".to_owned())
}

/// A fresh scratch directory for SQLite files.
pub(crate) fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("idem-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A new SQLite store in a new file (WAL, synchronous=NORMAL: the store's defaults).
pub(crate) async fn sqlite(name: &str) -> Arc<SqliteStore> {
    let path = scratch().join(format!("{name}.db"));
    let _ = std::fs::remove_file(&path);
    let url = format!("sqlite://{}?mode=rwc", path.display());
    Arc::new(SqliteStore::connect(&url).await.expect("open SQLite"))
}

/// The bench's own PostgreSQL database (`idem_bench`, created if missing, emptied), so bulk loads
/// never meet the tests' records. `via` replaces the host:port (the counting proxy).
pub(crate) async fn postgres(via: Option<SocketAddr>) -> Result<Arc<PostgresStore>, String> {
    let base = postgres_base();
    let admin = sqlx::PgPool::connect(&format!("{base}/postgres?sslmode=disable"))
        .await
        .map_err(|e| format!("PostgreSQL unreachable at {base}: {e}"))?;
    if let Err(e) = sqlx::query("CREATE DATABASE idem_bench")
        .execute(&admin)
        .await
    {
        if !e.to_string().contains("already exists") {
            return Err(format!("CREATE DATABASE idem_bench: {e}"));
        }
    }
    admin.close().await;
    let url = match via {
        Some(addr) => format!("postgres://postgres@{addr}/idem_bench?sslmode=disable"),
        None => format!("{base}/idem_bench?sslmode=disable"),
    };
    let store = PostgresStore::connect(&url)
        .await
        .map_err(|e| format!("PostgresStore::connect: {e}"))?;
    if via.is_none() {
        sqlx::query("TRUNCATE idem.records")
            .execute(store.pool())
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(Arc::new(store))
}

/// The Redis store on the bench's database (flushed), and a plain connection for floors and loads.
pub(crate) async fn redis(
    via: Option<SocketAddr>,
) -> Result<(Arc<RedisStore>, redis::aio::ConnectionManager), String> {
    let url = match via {
        Some(addr) => format!("redis://{addr}/7"),
        None => redis_url(),
    };
    let client = redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
    let mut conn = redis::aio::ConnectionManager::new(client)
        .await
        .map_err(|e| format!("Redis unreachable at {url}: {e}"))?;
    if via.is_none() {
        redis::cmd("FLUSHDB")
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
    }
    let store = RedisStore::builder(url)
        .prefix("bench")
        .connect()
        .await
        .map_err(|e| format!("RedisStore::connect: {e}"))?;
    Ok((Arc::new(store), conn))
}

/// Whether `IDEM_BENCH_STORES` (a comma-separated list of `memory`, `sqlite`, `postgres`, `redis`;
/// unset or empty: all) selects `backend`.
fn selected(backend: Backend) -> bool {
    let list = std::env::var("IDEM_BENCH_STORES").unwrap_or_default();
    let name = match backend {
        Backend::Memory => "memory",
        Backend::Sqlite => "sqlite",
        Backend::Postgres => "postgres",
        Backend::Redis => "redis",
    };
    list.trim().is_empty() || list.split(',').any(|s| s.trim().eq_ignore_ascii_case(name))
}

/// Every selected backend that can be reached, each empty: a new memory store, a new SQLite file
/// `<sqlite>.db`, the bench's PostgreSQL table truncated, its Redis database flushed. The
/// unreachable ones are reported and skipped.
pub(crate) async fn handles(sqlite_name: &str) -> Vec<(Backend, Handle)> {
    let mut out = Vec::new();
    if selected(Backend::Memory) {
        out.push((
            Backend::Memory,
            Handle::Memory(Arc::new(MemoryStore::new())),
        ));
    }
    if selected(Backend::Sqlite) {
        out.push((Backend::Sqlite, Handle::Sqlite(sqlite(sqlite_name).await)));
    }
    if selected(Backend::Postgres) {
        match postgres(None).await {
            Ok(s) => out.push((Backend::Postgres, Handle::Postgres(s))),
            Err(e) => eprintln!("skipping PostgreSQL: {e}"),
        }
    }
    if selected(Backend::Redis) {
        match redis(None).await {
            Ok((s, c)) => out.push((Backend::Redis, Handle::Redis(s, c))),
            Err(e) => eprintln!("skipping Redis: {e}"),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    async fn post(router: &Router, key: Option<&str>) -> (StatusCode, Bytes) {
        let mut request = Request::post("/floor").header("content-type", "application/json");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        let request = request
            .body(Body::from(crate::load::BODY))
            .expect("a valid request");
        let response = router.clone().oneshot(request).await.expect("infallible");
        let status = response.status();
        let body = response.into_body().collect().await.expect("body");
        (status, body.to_bytes())
    }

    /// The floor does what an `Idempotency-Key` must at its least: the handler runs once per key
    /// and a repeat gets the stored body; without a key, 400. Otherwise its cells would not be the
    /// floor of idem's.
    #[tokio::test]
    async fn the_floor_by_hand_runs_once_per_key_and_replays_the_stored_body() {
        let map = Arc::<MemoryMap>::default();
        let router = router(Engine::new(MemoryStore::new()), map.clone());
        let (status, first) = post(&router, Some("k1")).await;
        assert_eq!(status, StatusCode::CREATED);
        let (status, again) = post(&router, Some("k1")).await;
        assert_eq!((status, &again), (StatusCode::CREATED, &first), "replayed");
        let (status, other) = post(&router, Some("k2")).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_ne!(other, first, "a new key runs the handler (a new id)");
        assert_eq!(post(&router, None).await.0, StatusCode::BAD_REQUEST);
        assert_eq!(map.lock().expect("floor map").len(), 2);
    }

    /// The held floor's records are each a completed record with a body of its own, as the
    /// store's held records are.
    #[test]
    fn the_held_floor_holds_completed_records_with_their_own_bodies() {
        let map = MemoryMap::default();
        floors::memory_hold(&map, 3);
        let map = map.lock().expect("floor map");
        assert_eq!(map.len(), 3);
        let bodies: Vec<&Bytes> = (0..3)
            .map(|i| {
                map[&format!("held-{i}")]
                    .response
                    .as_ref()
                    .expect("completed")
            })
            .collect();
        assert!(bodies.iter().all(|b| **b == floors::response().body));
        assert_ne!(bodies[0].as_ptr(), bodies[1].as_ptr(), "one copy each");
    }
}
