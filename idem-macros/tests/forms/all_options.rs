// Every option at once.
#![deny(warnings)]
use crate::support;

use axum::Json;
use idem_runtime::idempotent;
use support::{AuthUser, NewPayment};

// Kept as written: the trailing comma after the last option is part of the form.
#[rustfmt::skip]
#[idempotent(
    scope = "user",
    ttl = "12h",
    retain = "30d",
    lease = "1500ms",
    wait = "0s",
    missing_key = "derive",
    derive_window = "30s",
    replay = "minimal",
    server_errors = "store",
    client_errors = "release",
    key_header = "X-Request-Id",
    fingerprint_exclude = ["/sent_at", "/meta/trace_id", "/a~1b~0c"],
    max_body = "256KiB",
)]
async fn create(user: AuthUser, Json(req): Json<NewPayment>) -> Json<NewPayment> {
    let _ = user.id;
    Json(req)
}

#[idempotent(
    scope = "user",
    missing_key = "pass",
    reject_after = "2028-02-29",
    wait = "250ms",
    max_body = "2MiB"
)]
async fn migrate(user: AuthUser, body: axum::body::Bytes) -> String {
    format!("{} {}", user.id, body.len())
}

// The key in the body, and only some members fingerprinted.
#[idempotent(scope = "user", key_field = "/data/request_id", fingerprint_only = ["/amount", "/currency"])]
async fn from_the_body(user: AuthUser, Json(req): Json<NewPayment>) -> Json<NewPayment> {
    let _ = user.id;
    Json(req)
}

#[test]
fn routes() {
    let _ = support::route(create);
    let _ = support::route(migrate);
    let _ = support::route(from_the_body);
}
