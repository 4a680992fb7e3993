//! The handler of `idem-bench`'s HTTP section under `#[idempotent]`, on `/idem`, served on the
//! store and address its arguments name:
//! `idem-before-after-server (memory | sqlite:URL | postgres:URL | redis:URL) HOST:PORT`.

use axum::http::header::LOCATION;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idem_runtime::store::{memory, postgres, redis, sqlite};
use idem_runtime::{idempotent, Engine};
use std::sync::atomic::{AtomicU64, Ordering};

static EXECUTIONS: AtomicU64 = AtomicU64::new(0);

#[derive(serde::Deserialize)]
struct NewPayment {
    amount: i64,
    currency: String,
}

#[idempotent(scope = "global", ttl = "24h")]
async fn create(Json(req): Json<NewPayment>) -> Response {
    let id = EXECUTIONS.fetch_add(1, Ordering::Relaxed) + 1;
    let body = serde_json::json!({
        "id": id, "amount": req.amount, "currency": req.currency, "status": "captured"
    });
    let location = [(LOCATION, format!("/payments/{id}"))];
    (StatusCode::CREATED, location, Json(body)).into_response()
}

async fn engine(store: &str) -> Result<Engine, String> {
    let error = |e: &dyn std::fmt::Display| format!("{store}: {e}");
    Ok(match store.split_once(':') {
        None if store == "memory" => Engine::new(memory::MemoryStore::new()),
        Some(("sqlite", url)) => Engine::new(
            sqlite::SqliteStore::connect(url)
                .await
                .map_err(|e| error(&e))?,
        ),
        Some(("postgres", url)) => Engine::new(
            postgres::PostgresStore::connect(url)
                .await
                .map_err(|e| error(&e))?,
        ),
        Some(("redis", url)) => Engine::new(
            redis::RedisStore::connect(url)
                .await
                .map_err(|e| error(&e))?,
        ),
        _ => return Err(format!("unknown store `{store}`")),
    })
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [store, addr] = &args[..] else {
        return Err("usage: idem-before-after-server STORE HOST:PORT".into());
    };
    let router = Router::new()
        .route("/idem", post(create))
        .with_state(engine(store).await?);
    let listener = tokio::net::TcpListener::bind(addr.as_str())
        .await
        .map_err(|e| format!("bind {addr}: {e}"))?;
    axum::serve(listener, router)
        .await
        .map_err(|e| e.to_string())
}
