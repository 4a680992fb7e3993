//! The HTTP handlers. The two creates and the refund are idempotent; the reads need not be.

use crate::auth::AuthUser;
use crate::ledger::{Ledger, Payment};
use crate::AppState;
use axum::extract::{Path, State};
use axum::http::header::LOCATION;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_runtime::sqlx::{Postgres, Sqlite};
use idem_runtime::{idempotent, Policy, Tx};
use serde::Deserialize;
use std::time::Duration;

/// A payment request.
#[derive(Debug, Deserialize)]
pub(crate) struct NewPayment {
    amount: i64,
    currency: String,
}

/// The payment endpoints' policy, stated once and checked at compile time: keys are remembered
/// for 24 h (tombstones for 7 d), required (400 without), and request bodies are capped at 64 KiB.
const PAYMENTS: Policy = Policy::new()
    .ttl(Duration::from_secs(24 * 3600))
    .max_request_body(64 * 1024);

/// `POST /payments`: a client that heard nothing retries with the same key and gets this
/// payment's 201 again, never a second charge.
#[idempotent(scope = "user", policy = PAYMENTS)]
pub(crate) async fn create_payment(
    State(app): State<AppState>,
    user: AuthUser,
    Json(req): Json<NewPayment>,
) -> Response {
    capture(&app, &user, req).await
}

/// `POST /payments` in transactional mode, when the records share the ledger's SQLite file: the
/// key is claimed in the transaction that inserts the payment and stores the 201, so a crash at any
/// point leaves either all three or none (a retry then charges once, or replays).
#[idempotent(scope = "user", policy = PAYMENTS, transaction = "tx")]
pub(crate) async fn create_payment_in_sqlite(
    State(app): State<AppState>,
    user: AuthUser,
    mut tx: Tx<Sqlite>,
    Json(req): Json<NewPayment>,
) -> Response {
    let payment = match prepare(&app, req).await {
        Ok(payment) => payment,
        Err(response) => return response,
    };
    match crate::ledger::sqlite::insert(&mut *tx, &user.id, &payment).await {
        Ok(()) => created(payment),
        Err(e) => internal(&e),
    }
}

/// `POST /payments` in transactional mode on PostgreSQL (see [`create_payment_in_sqlite`]).
#[idempotent(scope = "user", policy = PAYMENTS, transaction = "tx")]
pub(crate) async fn create_payment_in_postgres(
    State(app): State<AppState>,
    user: AuthUser,
    mut tx: Tx<Postgres>,
    Json(req): Json<NewPayment>,
) -> Response {
    let payment = match prepare(&app, req).await {
        Ok(payment) => payment,
        Err(response) => return response,
    };
    match crate::ledger::postgres::insert(&mut *tx, &user.id, &payment).await {
        Ok(()) => created(payment),
        Err(e) => internal(&e),
    }
}

/// Validates the request and charges the card (simulated): the payment to record.
async fn prepare(app: &AppState, req: NewPayment) -> Result<Payment, Response> {
    if req.amount <= 0 {
        return Err(invalid("`amount` must be a positive number of minor units"));
    }
    if req.currency.len() != 3 || !req.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(invalid(
            "`currency` must be an ISO 4217 code such as \"KRW\"",
        ));
    }
    card_network(app).await;
    Ok(Payment::captured(req.amount, &req.currency))
}

/// `POST /legacy/payments`: old app versions send no key; a double tap (the same request within
/// 10 s) still charges once.
#[idempotent(scope = "user", policy = PAYMENTS, missing_key = "derive", derive_window = "10s")]
pub(crate) async fn create_legacy_payment(
    State(app): State<AppState>,
    user: AuthUser,
    Json(req): Json<NewPayment>,
) -> Response {
    capture(&app, &user, req).await
}

/// `POST /payments/{id}/refund`.
#[idempotent(scope = "user", policy = PAYMENTS)]
pub(crate) async fn refund_payment(
    State(app): State<AppState>,
    user: AuthUser,
    Path(id): Path<String>,
) -> Response {
    refund(&app, &user, &id).await
}

pub(crate) async fn list_payments(State(ledger): State<Ledger>, user: AuthUser) -> Response {
    match ledger.list(&user.id).await {
        Ok(payments) => Json(payments).into_response(),
        Err(e) => internal(&e),
    }
}

pub(crate) async fn get_payment(
    State(ledger): State<Ledger>,
    user: AuthUser,
    Path(id): Path<String>,
) -> Response {
    match ledger.get(&user.id, &id).await {
        Ok(Some(payment)) => Json(payment).into_response(),
        Ok(None) => not_found(),
        Err(e) => internal(&e),
    }
}

/// Charges the card (simulated by `PAYMENT_LATENCY_MS`) and records the payment.
async fn capture(app: &AppState, user: &AuthUser, req: NewPayment) -> Response {
    if req.amount <= 0 {
        return invalid("`amount` must be a positive number of minor units");
    }
    if req.currency.len() != 3 || !req.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return invalid("`currency` must be an ISO 4217 code such as \"KRW\"");
    }
    card_network(app).await;
    // The business write, one statement. `ledger::{sqlite, postgres}::insert` take any executor, so
    // a transactional mode can run it in the transaction that also writes the idempotency record.
    match app
        .ledger
        .capture(&user.id, req.amount, &req.currency)
        .await
    {
        Ok(payment) => created(payment),
        Err(e) => internal(&e),
    }
}

async fn refund(app: &AppState, user: &AuthUser, id: &str) -> Response {
    card_network(app).await;
    match app.ledger.refund(&user.id, id).await {
        Ok(Some(payment)) => Json(payment).into_response(),
        Ok(None) => not_found(),
        Err(e) => internal(&e),
    }
}

async fn card_network(app: &AppState) {
    if !app.latency.is_zero() {
        tokio::time::sleep(app.latency).await;
    }
}

fn created(payment: Payment) -> Response {
    let location = format!("/payments/{}", payment.id);
    (StatusCode::CREATED, [(LOCATION, location)], Json(payment)).into_response()
}

fn invalid(message: &str) -> Response {
    (
        StatusCode::UNPROCESSABLE_ENTITY,
        Json(serde_json::json!({ "error": message })),
    )
        .into_response()
}

fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(serde_json::json!({ "error": "payment not found" })),
    )
        .into_response()
}

/// A 500 releases the idempotency key, so the client's retry runs again: safe here because every
/// handler writes the ledger in its last step.
fn internal(error: &sqlx::Error) -> Response {
    tracing::error!(%error, "ledger error");
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        Json(serde_json::json!({ "error": "internal error" })),
    )
        .into_response()
}
