//! Drives the payments example in process.

#![allow(dead_code)]

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use std::path::Path;
use std::time::Duration;
use tower::ServiceExt;

/// The example on a fresh SQLite file under `dir` (in a subdirectory that does not exist yet, as in
/// `sqlite://some/dir/payments.db?mode=rwc`).
pub async fn start(dir: &Path) -> Router {
    start_with_latency(dir, Duration::ZERO).await
}

pub async fn start_with_latency(dir: &Path, latency: Duration) -> Router {
    let config = payments::Config {
        database_url: database_url(dir),
        payment_latency: latency,
        ..payments::Config::default()
    };
    payments::app(&config).await.unwrap()
}

pub fn database_url(dir: &Path) -> String {
    format!("sqlite://{}/data/payments.db?mode=rwc", dir.display())
}

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
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(&self.body)))
    }
    pub fn replayed(&self) -> bool {
        self.header("idempotency-replayed") == Some("true")
    }
    #[track_caller]
    pub fn assert_problem(&self, status: u16, type_uri: &str) {
        assert_eq!(self.status.as_u16(), status, "{:?}", self.body);
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(self.json()["type"], type_uri);
    }
}

pub async fn send(router: &Router, request: Request<Body>) -> Reply {
    let response = router.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
    }
}

/// `POST path` as `user` (None: no Authorization) with an optional key and a JSON body.
pub fn post(path: &str, user: Option<&str>, key: Option<&str>, body: &str) -> Request<Body> {
    let mut builder = Request::post(path).header(header::CONTENT_TYPE, "application/json");
    if let Some(user) = user {
        builder = builder.header(header::AUTHORIZATION, format!("Bearer {user}"));
    }
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Body::from(body.to_owned())).unwrap()
}

pub fn get(path: &str, user: Option<&str>) -> Request<Body> {
    let mut builder = Request::get(path);
    if let Some(user) = user {
        builder = builder.header(header::AUTHORIZATION, format!("Bearer {user}"));
    }
    builder.body(Body::empty()).unwrap()
}

pub const KRW_1000: &str = r#"{"amount": 1000, "currency": "KRW"}"#;
pub const KRW_1000_REORDERED: &str = r#"{"currency":"KRW","amount":1000}"#;
pub const KRW_2000: &str = r#"{"amount": 2000, "currency": "KRW"}"#;

/// The caller's payments, from `GET /payments`.
pub async fn list(router: &Router, user: &str) -> Vec<serde_json::Value> {
    let reply = send(router, get("/payments", Some(user))).await;
    assert_eq!(reply.status, 200);
    reply.json().as_array().unwrap().clone()
}

/// The charges the card network made for the caller, from `GET /charges`.
pub async fn charges(router: &Router, user: &str) -> Vec<serde_json::Value> {
    let reply = send(router, get("/charges", Some(user))).await;
    assert_eq!(reply.status, 200);
    reply.json().as_array().unwrap().clone()
}

/// The example on a fresh SQLite ledger under `dir`, its records in a memory store that judges time
/// by `clock`.
pub async fn start_on_clock(dir: &Path, clock: idem_runtime::clock::ManualClock) -> Router {
    let ledger = payments::ledger::Ledger::open(&database_url(dir))
        .await
        .unwrap();
    let store = idem_runtime::store::memory::MemoryStore::new().with_clock(clock);
    let card = payments::card::CardNetwork::new(ledger.database().clone(), Duration::ZERO);
    payments::router(payments::AppState {
        engine: idem_runtime::Engine::new(store),
        ledger,
        card,
        webhook_secret: payments::webhooks::WebhookSecret::new(
            payments::webhooks::DEFAULT_WEBHOOK_SECRET,
        )
        .unwrap(),
        background: payments::Background::default(),
        transactional: None,
    })
}
