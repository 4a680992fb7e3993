//! A tiny service in transactional mode, for the crash tests (`tests/tests/transactional_crash.rs`):
//! they start it as a real process, let it abort at a chosen point, restart it and retry.
//!
//! - `DATABASE_URL`: `sqlite://...` or `postgres://...`; the ledger and idem's records live there.
//! - `IDEM_CRASH_AT`: `before_commit` aborts the process right after the handler's business write,
//!   before idem stores the response and commits; `after_commit` aborts once the transaction has
//!   committed, before the response reaches the client. Unset: no crash.
//! - Listens on an ephemeral port of 127.0.0.1 and prints `listening on <addr>` once it accepts.
//!
//! `POST /entries` (`Authorization: Bearer <user>`, `Idempotency-Key`, `{"amount": n}`) inserts one
//! ledger row through the request's transaction and answers 201 `{"id", "amount"}`.
//!
//! The crash points need no hook inside idem: the first is in the handler (after its write, before
//! it returns), the second in a middleware around the handler, which sees the response only after
//! idem committed.

use axum::extract::{FromRef, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem_runtime::axum::Scope;
use idem_runtime::sqlx::{self, Postgres, Sqlite};
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::store::sqlite::SqliteStore;
use idem_runtime::{idempotent, Engine, Transactional, Tx};
use std::borrow::Cow;
use std::io::Write;
use std::sync::Arc;

#[derive(Clone, Copy, PartialEq, Eq)]
enum CrashAt {
    Never,
    BeforeCommit,
    AfterCommit,
}

#[derive(Clone, FromRef)]
struct PgApp {
    txn: Transactional<PostgresStore>,
    crash: CrashAt,
}

#[derive(Clone, FromRef)]
struct SqliteApp {
    txn: Transactional<SqliteStore>,
    crash: CrashAt,
}

struct User(String);

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

#[derive(serde::Deserialize)]
struct NewEntry {
    amount: i64,
}

const INSERT: &str = "INSERT INTO ledger (id, owner, amount) VALUES ($1, $2, $3)";

fn new_id() -> String {
    format!("e_{}", uuid::Uuid::new_v4().simple())
}

fn created(id: String, amount: i64) -> Response {
    (
        StatusCode::CREATED,
        Json(serde_json::json!({ "id": id, "amount": amount })),
    )
        .into_response()
}

fn crash_if(crash: CrashAt, here: CrashAt) {
    if crash == here {
        eprintln!("txn_crash_server: aborting as asked");
        std::process::abort();
    }
}

// A wait longer than PostgreSQL takes to roll back a dead process's transaction.
#[idempotent(scope = "user", transaction = "tx", wait = "30s")]
async fn create_pg(
    State(crash): State<CrashAt>,
    user: User,
    mut tx: Tx<Postgres>,
    Json(req): Json<NewEntry>,
) -> Response {
    let id = new_id();
    let conn = match tx.conn().await {
        Ok(conn) => conn,
        Err(e) => {
            eprintln!("ledger: {e}");
            return StatusCode::SERVICE_UNAVAILABLE.into_response();
        }
    };
    if let Err(e) = sqlx::query(INSERT)
        .bind(&id)
        .bind(&user.0)
        .bind(req.amount)
        .execute(conn)
        .await
    {
        eprintln!("ledger: {e}");
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    crash_if(crash, CrashAt::BeforeCommit);
    created(id, req.amount)
}

#[idempotent(scope = "user", transaction = "tx", wait = "30s")]
async fn create_sqlite(
    State(crash): State<CrashAt>,
    user: User,
    mut tx: Tx<Sqlite>,
    Json(req): Json<NewEntry>,
) -> Response {
    let id = new_id();
    let conn = match tx.conn().await {
        Ok(conn) => conn,
        Err(e) => {
            eprintln!("ledger: {e}");
            return StatusCode::SERVICE_UNAVAILABLE.into_response();
        }
    };
    if let Err(e) = sqlx::query(INSERT)
        .bind(&id)
        .bind(&user.0)
        .bind(req.amount)
        .execute(conn)
        .await
    {
        eprintln!("ledger: {e}");
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    crash_if(crash, CrashAt::BeforeCommit);
    created(id, req.amount)
}

/// Runs after the handler's response came back through idem, i.e. after the commit.
async fn after_commit(State(crash): State<CrashAt>, request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    crash_if(crash, CrashAt::AfterCommit);
    response
}

const LEDGER: &str = "CREATE TABLE IF NOT EXISTS ledger (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, amount BIGINT NOT NULL)";

async fn app(url: &str, crash: CrashAt) -> Result<Router, Box<dyn std::error::Error>> {
    if url.starts_with("postgres:") {
        let store = Arc::new(PostgresStore::connect(url).await?);
        sqlx::query(LEDGER).execute(store.pool()).await?;
        let txn = Transactional::new(Engine::from_arc(store.clone()), store)?;
        Ok(Router::new()
            .route("/entries", post(create_pg))
            .route_layer(middleware::from_fn_with_state(crash, after_commit))
            .with_state(PgApp { txn, crash }))
    } else {
        let store = Arc::new(SqliteStore::connect(url).await?);
        sqlx::query(LEDGER).execute(store.pool()).await?;
        let txn = Transactional::new(Engine::from_arc(store.clone()), store)?;
        Ok(Router::new()
            .route("/entries", post(create_sqlite))
            .route_layer(middleware::from_fn_with_state(crash, after_commit))
            .with_state(SqliteApp { txn, crash }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is required")?;
    let crash = match std::env::var("IDEM_CRASH_AT").as_deref() {
        Ok("before_commit") => CrashAt::BeforeCommit,
        Ok("after_commit") => CrashAt::AfterCommit,
        Ok("") | Err(_) => CrashAt::Never,
        Ok(other) => return Err(format!("IDEM_CRASH_AT: unknown point `{other}`").into()),
    };
    let router = app(&url, crash).await?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
    println!("listening on {}", listener.local_addr()?);
    std::io::stdout().flush()?;
    axum::serve(listener, router).await?;
    Ok(())
}
