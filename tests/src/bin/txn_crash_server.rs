//! A tiny service in transactional mode, for the crash tests (`tests/tests/transactional/crash.rs`):
//! they start it as a real process, kill it (or let it abort) at a chosen point, restart it and
//! retry.
//!
//! - `DATABASE_URL`: `sqlite://...` or `postgres://...`; the ledger, the charges and idem's records
//!   live there.
//! - `IDEM_CRASH_AT`: where the process dies while serving a request. `in_call`: it stops in the
//!   foreign call (after the charge, before the handler touches its transaction) and waits there
//!   for the test to kill it; `before_commit` aborts right after the ledger write, before idem
//!   stores the response and commits; `after_commit` aborts once the transaction has committed,
//!   before the response reaches the client. Unset: no crash.
//! - Listens on an ephemeral port of 127.0.0.1 and prints `listening on <addr>` once it accepts;
//!   prints `in call <downstream key>` when a handler is in its foreign call.
//!
//! `POST /entries` (`Authorization: Bearer <user>`, `Idempotency-Key`, `{"amount": n, "hold":
//! bool}`) runs in three phases: the foreign call, a charge recorded under the attempt's downstream
//! key in the `charges` table, outside any transaction (a card network that deduplicates by
//! idempotency key: a second attempt with the same key counts an attempt, not a charge); with
//! `"hold": true`, a wait until `POST /release`; then one ledger row through the request's
//! transaction. It answers 201 `{"id", "amount", "taken_over", "downstream_key"}`. Its lease is
//! 2 s, so that a dead process's claim is taken over soon.
//!
//! The crash points need no hook inside idem: the first two are in the handler, the third in a
//! middleware around it, which sees the response only after idem committed.

use axum::extract::{FromRef, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem_runtime::axum::{Attempt, Scope};
use idem_runtime::sqlx::{self, Postgres, Sqlite};
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::store::sqlite::SqliteStore;
use idem_runtime::{idempotent, Transactional, Tx};
use std::borrow::Cow;
use std::io::Write;
use std::sync::Arc;
use tokio::sync::watch;

#[derive(Clone, Copy, PartialEq, Eq)]
enum CrashAt {
    Never,
    InCall,
    BeforeCommit,
    AfterCommit,
}

/// Held requests wait until `POST /release` opens it.
#[derive(Clone)]
struct Gate(Arc<watch::Sender<bool>>);

#[derive(Clone, FromRef)]
struct PgApp {
    txn: Transactional<PostgresStore>,
    crash: CrashAt,
    gate: Gate,
}

#[derive(Clone, FromRef)]
struct SqliteApp {
    txn: Transactional<SqliteStore>,
    crash: CrashAt,
    gate: Gate,
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
    #[serde(default)]
    hold: bool,
}

const CHARGE: &str = "INSERT INTO charges (downstream_key, attempts) VALUES ($1, 1)
    ON CONFLICT (downstream_key) DO UPDATE SET attempts = charges.attempts + 1";
const INSERT: &str = "INSERT INTO ledger (id, owner, amount) VALUES ($1, $2, $3)";

fn crash_if(crash: CrashAt, here: CrashAt) {
    if crash == here {
        eprintln!("txn_crash_server: aborting as asked");
        std::process::abort();
    }
}

fn failed(what: &str, error: sqlx::Error) -> Response {
    eprintln!("{what}: {error}");
    (StatusCode::SERVICE_UNAVAILABLE, format!("{what} failed")).into_response()
}

/// The rest of the foreign call, once the charge is made: the crash point, or the wait the
/// request asks for.
async fn after_charge(attempt: &Attempt, crash: CrashAt, gate: &Gate, hold: bool) {
    println!("in call {}", attempt.downstream_key().unwrap_or("none"));
    let _ = std::io::stdout().flush();
    if crash == CrashAt::InCall {
        std::future::pending::<()>().await;
    }
    if hold {
        let _ = gate.0.subscribe().wait_for(|open| *open).await;
    }
}

fn created(id: String, amount: i64, attempt: &Attempt) -> Response {
    let body = serde_json::json!({
        "id": id,
        "amount": amount,
        "taken_over": attempt.taken_over(),
        "downstream_key": attempt.downstream_key(),
    });
    (StatusCode::CREATED, Json(body)).into_response()
}

/// `POST /entries` for the database `$db`, whose app state is `$app`.
macro_rules! entries_handler {
    ($name:ident, $db:ty, $store:ty) => {
        #[idempotent(scope = "user", transaction = "tx", lease = "2s", wait = "30s")]
        async fn $name(
            State(crash): State<CrashAt>,
            State(gate): State<Gate>,
            State(txn): State<Transactional<$store>>,
            attempt: Attempt,
            user: User,
            mut tx: Tx<$db>,
            Json(req): Json<NewEntry>,
        ) -> Response {
            let charge = sqlx::query(CHARGE).bind(attempt.downstream_key().unwrap_or("none"));
            if let Err(e) = charge.execute(txn.store().pool()).await {
                return failed("charge", e);
            }
            after_charge(&attempt, crash, &gate, req.hold).await;
            let id = format!("e_{}", uuid::Uuid::new_v4().simple());
            let conn = match tx.conn().await {
                Ok(conn) => conn,
                Err(e) => return failed("begin", e),
            };
            let insert = sqlx::query(INSERT).bind(&id).bind(&user.0).bind(req.amount);
            if let Err(e) = insert.execute(conn).await {
                return failed("ledger", e);
            }
            crash_if(crash, CrashAt::BeforeCommit);
            created(id, req.amount, &attempt)
        }
    };
}

entries_handler!(create_pg, Postgres, PostgresStore);
entries_handler!(create_sqlite, Sqlite, SqliteStore);

/// Lets every held request go on, and those to come.
async fn release(State(gate): State<Gate>) -> StatusCode {
    gate.0.send_replace(true);
    StatusCode::NO_CONTENT
}

/// Runs after the handler's response came back through idem, i.e. after the commit.
async fn after_commit(State(crash): State<CrashAt>, request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    crash_if(crash, CrashAt::AfterCommit);
    response
}

const SCHEMA: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS ledger (id TEXT PRIMARY KEY, owner TEXT NOT NULL, amount BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS charges (downstream_key TEXT PRIMARY KEY, attempts BIGINT NOT NULL)",
];

async fn app(url: &str, crash: CrashAt) -> Result<Router, Box<dyn std::error::Error>> {
    let gate = Gate(Arc::new(watch::Sender::new(false)));
    let after = middleware::from_fn_with_state(crash, after_commit);
    if url.starts_with("postgres:") {
        let store = Arc::new(PostgresStore::connect(url).await?);
        for ddl in SCHEMA {
            sqlx::query(ddl).execute(store.pool()).await?;
        }
        let txn = Transactional::new(store);
        Ok(Router::new()
            .route("/entries", post(create_pg))
            .route_layer(after)
            .route("/release", post(release))
            .with_state(PgApp { txn, crash, gate }))
    } else {
        let store = Arc::new(SqliteStore::connect(url).await?);
        for ddl in SCHEMA {
            sqlx::query(ddl).execute(store.pool()).await?;
        }
        let txn = Transactional::new(store);
        Ok(Router::new()
            .route("/entries", post(create_sqlite))
            .route_layer(after)
            .route("/release", post(release))
            .with_state(SqliteApp { txn, crash, gate }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is required")?;
    let crash = match std::env::var("IDEM_CRASH_AT").as_deref() {
        Ok("in_call") => CrashAt::InCall,
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
