//! The HTTP handlers. The creates (through `#[idempotent]`) and the refund (through
//! `IdempotencyLayer`, see [`crate::router`]) are idempotent; the reads need not be.

use crate::auth::AuthUser;
use crate::card::{CardNetwork, Charge};
use crate::ledger::{Database, Ledger, Payment};
use crate::AppState;
use axum::extract::{Path, State};
use axum::http::header::LOCATION;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_runtime::axum::Attempt;
use idem_runtime::sqlx::{Postgres, Sqlite};
use idem_runtime::{idempotent, Policy, Tx};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// A payment request: a JSON object `{"amount": 1000, "currency": "KRW"}`.
#[derive(Debug, utoipa::ToSchema)]
pub(crate) struct NewPayment {
    /// In the currency's minor unit; positive.
    amount: i64,
    /// ISO 4217 code, such as `KRW`.
    currency: String,
}

/// An error the API answers itself: `{"error": "..."}`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct ApiError {
    /// What is wrong.
    error: String,
}

/// Only the object form. serde's derive would also take the sequence form, `[1000, "KRW"]`, which
/// no client of this API means to send: it is refused (422) like any other malformed body.
impl<'de> Deserialize<'de> for NewPayment {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Fields {
            amount: i64,
            currency: String,
        }
        let object = serde_json::Map::deserialize(deserializer)?;
        let Fields { amount, currency } = Fields::deserialize(serde_json::Value::Object(object))
            .map_err(serde::de::Error::custom)?;
        Ok(Self { amount, currency })
    }
}

/// The payment endpoints' policy, stated once and checked at compile time: keys are remembered
/// for 24 h (tombstones for 7 d), required (400 without), and request bodies are capped at 64 KiB.
/// The lease is short because idem renews it while a handler runs: it only bounds how long a
/// crashed instance's claims wait before a retry takes them over.
const PAYMENTS: Policy = Policy::new()
    .ttl(Duration::from_secs(24 * 3600))
    .lease(Duration::from_secs(10))
    .max_request_body(64 * 1024);

/// Create a payment
///
/// Charges the card and records the payment. A client that heard nothing retries with the same
/// `Idempotency-Key` and gets this payment's 201 again, never a second charge.
///
/// The transactional variants below serve this route with the same policy and responses.
#[idempotent(scope = "user", policy = PAYMENTS)]
#[utoipa::path(
    post,
    path = "/payments",
    tag = "payments",
    request_body = NewPayment,
    responses(
        (status = 201, description = "The payment, captured", body = Payment,
            headers(("Location" = String, description = "`/payments/{id}`"))),
        (status = 401, description = "No bearer token"),
        (status = 422, description = "The amount or the currency is invalid", body = ApiError),
        (status = 503, description = "The payments database could not be reached (`urn:payments:problem:database-unavailable`), or its pool had no free connection (`urn:payments:problem:database-busy`): retry with the same key after `Retry-After`"),
    ),
)]
pub(crate) async fn create_payment(
    State(app): State<AppState>,
    user: AuthUser,
    attempt: Attempt,
    Json(req): Json<NewPayment>,
) -> Response {
    capture(&app, &user, &attempt, &req).await
}

/// Charges the card, then records the payment (once per charge).
async fn capture(app: &AppState, user: &AuthUser, attempt: &Attempt, req: &NewPayment) -> Response {
    let charge_id = match charge(app, user, attempt, req).await {
        Ok(charge_id) => charge_id,
        Err(response) => return response,
    };
    match app
        .ledger
        .capture(&user.id, req.amount, &req.currency, &charge_id)
        .await
    {
        Ok(payment) => created(payment),
        Err(e) => database_error(&e, app.ledger.database()),
    }
}

/// `POST /payments` in transactional mode, when the records share the ledger's SQLite file: the
/// card is charged first, outside any transaction; then the payment and the stored 201 commit
/// together. A crash before that commit leaves neither, and the retry that takes the key over
/// charges under the same downstream key (the network deduplicates it) and records the payment once.
#[idempotent(scope = "user", policy = PAYMENTS, transaction = "tx")]
pub(crate) async fn create_payment_in_sqlite(
    State(app): State<AppState>,
    user: AuthUser,
    attempt: Attempt,
    mut tx: Tx<Sqlite>,
    Json(req): Json<NewPayment>,
) -> Response {
    let charge_id = match charge(&app, &user, &attempt, &req).await {
        Ok(charge_id) => charge_id,
        Err(response) => return response,
    };
    let payment = Payment::captured(req.amount, &req.currency);
    let recorded = match tx.conn().await {
        Ok(conn) => crate::ledger::sqlite::insert(conn, &user.id, &payment, &charge_id).await,
        Err(e) => Err(e),
    };
    match recorded {
        Ok(payment) => created(payment),
        Err(e) => database_error(&e, app.ledger.database()),
    }
}

/// `POST /payments` in transactional mode on PostgreSQL (see [`create_payment_in_sqlite`]).
#[idempotent(scope = "user", policy = PAYMENTS, transaction = "tx")]
pub(crate) async fn create_payment_in_postgres(
    State(app): State<AppState>,
    user: AuthUser,
    attempt: Attempt,
    mut tx: Tx<Postgres>,
    Json(req): Json<NewPayment>,
) -> Response {
    let charge_id = match charge(&app, &user, &attempt, &req).await {
        Ok(charge_id) => charge_id,
        Err(response) => return response,
    };
    let payment = Payment::captured(req.amount, &req.currency);
    let recorded = match tx.conn().await {
        Ok(conn) => crate::ledger::postgres::insert(conn, &user.id, &payment, &charge_id).await,
        Err(e) => Err(e),
    };
    match recorded {
        Ok(payment) => created(payment),
        Err(e) => database_error(&e, app.ledger.database()),
    }
}

/// Validates the request and charges the card under the request's downstream key, the same on
/// every attempt: the charge's id.
async fn charge(
    app: &AppState,
    user: &AuthUser,
    attempt: &Attempt,
    req: &NewPayment,
) -> Result<String, Response> {
    if req.amount <= 0 {
        return Err(invalid("`amount` must be a positive number of minor units"));
    }
    if req.currency.len() != 3 || !req.currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(invalid(
            "`currency` must be an ISO 4217 code such as \"KRW\"",
        ));
    }
    // Every payment endpoint requires or derives a key, so there is always a downstream key.
    let key = attempt
        .downstream_key()
        .map_or_else(|| uuid::Uuid::new_v4().to_string(), str::to_owned);
    if attempt.taken_over() {
        tracing::warn!(user = %user.id, "taking over a payment whose first run stopped; the card network deduplicates its charge");
    }
    app.card
        .charge(&user.id, req.amount, &req.currency, &key)
        .await
        .map_err(|e| database_error(&e, app.ledger.database()))
}

/// Create a payment, for old app versions
///
/// As `POST /payments`, for old app versions that send no `Idempotency-Key`: a double tap (the
/// same request within 10 s) still charges once.
#[idempotent(scope = "user", policy = PAYMENTS, missing_key = "derive", derive_window = "10s")]
#[utoipa::path(
    post,
    path = "/legacy/payments",
    tag = "payments",
    request_body = NewPayment,
    responses(
        (status = 201, description = "The payment, captured", body = Payment,
            headers(("Location" = String, description = "`/payments/{id}`"))),
        (status = 401, description = "No bearer token"),
        (status = 422, description = "The amount or the currency is invalid", body = ApiError),
        (status = 503, description = "The payments database could not be reached: retry after `Retry-After`"),
    ),
)]
pub(crate) async fn create_legacy_payment(
    State(app): State<AppState>,
    user: AuthUser,
    attempt: Attempt,
    Json(req): Json<NewPayment>,
) -> Response {
    capture(&app, &user, &attempt, &req).await
}

/// The refund's policy: the payments' one, named for logs and metrics (the attribute names its
/// handlers itself; `IdempotencyLayer` takes the name from the policy).
pub(crate) const REFUNDS: Policy = PAYMENTS.handler("refund_payment");

/// The refund's `Idempotency-Key` header in the API document. The refund runs under
/// `IdempotencyLayer`, which has no attribute to document it, so its path names the header itself
/// (and [`Idempotency`](idem_runtime::openapi::Idempotency) then adds the replay headers and
/// problems, as for the attribute's handlers).
pub(crate) struct RefundKey;

impl utoipa::IntoParams for RefundKey {
    fn into_params(
        _: impl Fn() -> Option<utoipa::openapi::path::ParameterIn>,
    ) -> Vec<utoipa::openapi::path::Parameter> {
        vec![idem_runtime::openapi::key_parameter(&REFUNDS)]
    }
}

/// Refund a payment
///
/// Refunds the charge and marks the payment refunded. A retry with the same key answers the same.
/// A plain handler: [`crate::router`] puts it under `IdempotencyLayer` with [`REFUNDS`], scoped to
/// the [`AuthUser`].
#[utoipa::path(
    post,
    path = "/payments/{id}/refund",
    tag = "payments",
    params(("id" = String, Path, description = "The payment's id"), RefundKey),
    responses(
        (status = 200, description = "The payment, refunded", body = Payment),
        (status = 401, description = "No bearer token"),
        (status = 404, description = "No such payment of the caller's", body = ApiError),
        (status = 503, description = "The payments database could not be reached: retry with the same key after `Retry-After`"),
    ),
)]
pub(crate) async fn refund_payment(
    State(app): State<AppState>,
    user: AuthUser,
    Path(id): Path<String>,
) -> Response {
    let charge_id = match app.ledger.charge_of(&user.id, &id).await {
        Ok(Some(charge_id)) => charge_id,
        Ok(None) => return not_found(),
        Err(e) => return database_error(&e, app.ledger.database()),
    };
    if let Some(charge_id) = charge_id {
        if let Err(e) = app.card.refund(&charge_id).await {
            return database_error(&e, app.ledger.database());
        }
    }
    match app.ledger.refund(&user.id, &id).await {
        Ok(Some(payment)) => Json(payment).into_response(),
        Ok(None) => not_found(),
        Err(e) => database_error(&e, app.ledger.database()),
    }
}

/// List the caller's payments, oldest first
#[utoipa::path(
    get,
    path = "/payments",
    tag = "payments",
    responses(
        (status = 200, description = "The caller's payments", body = Vec<Payment>),
        (status = 401, description = "No bearer token"),
    ),
)]
pub(crate) async fn list_payments(State(ledger): State<Ledger>, user: AuthUser) -> Response {
    match ledger.list(&user.id).await {
        Ok(payments) => Json(payments).into_response(),
        Err(e) => database_error(&e, ledger.database()),
    }
}

/// A payment's current state
#[utoipa::path(
    get,
    path = "/payments/{id}",
    tag = "payments",
    params(("id" = String, Path, description = "The payment's id")),
    responses(
        (status = 200, description = "The payment", body = Payment),
        (status = 401, description = "No bearer token"),
        (status = 404, description = "No such payment of the caller's", body = ApiError),
    ),
)]
pub(crate) async fn get_payment(
    State(ledger): State<Ledger>,
    user: AuthUser,
    Path(id): Path<String>,
) -> Response {
    match ledger.get(&user.id, &id).await {
        Ok(Some(payment)) => Json(payment).into_response(),
        Ok(None) => not_found(),
        Err(e) => database_error(&e, ledger.database()),
    }
}

/// What the card network did for the caller
///
/// One element per charge, oldest first; `attempts` counts the calls the network received for it.
#[utoipa::path(
    get,
    path = "/charges",
    tag = "card network",
    responses(
        (status = 200, description = "The caller's charges", body = Vec<Charge>),
        (status = 401, description = "No bearer token"),
    ),
)]
pub(crate) async fn list_charges(State(card): State<CardNetwork>, user: AuthUser) -> Response {
    match card.charges(&user.id).await {
        Ok(charges) => Json(charges).into_response(),
        Err(e) => database_error(&e, card.database()),
    }
}

fn created(payment: Payment) -> Response {
    let location = format!("/payments/{}", payment.id);
    (StatusCode::CREATED, [(LOCATION, location)], Json(payment)).into_response()
}

fn api_error(status: StatusCode, message: &str) -> Response {
    let error = message.to_owned();
    (status, Json(ApiError { error })).into_response()
}

fn invalid(message: &str) -> Response {
    api_error(StatusCode::UNPROCESSABLE_ENTITY, message)
}

fn not_found() -> Response {
    api_error(StatusCode::NOT_FOUND, "payment not found")
}

/// A database error. One a retry can fix (the database unreachable, restarting or out of
/// connections) is a 503 with `Retry-After`, like idem's own `store-unavailable`; any other is a 500.
/// Both release the idempotency key, so the client's retry runs again: safe here because the charge
/// is deduplicated by the network and the payment by its charge. `db` tells a busy pool (every
/// connection open and in use) from an unreachable database (a pool that could not open one).
fn database_error(error: &sqlx::Error, db: &Database) -> Response {
    use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
    let transient = match error {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        // PostgreSQL's connection exceptions and shutdowns; SQLite's busy and locked.
        sqlx::Error::Database(e) => e
            .code()
            .is_some_and(|c| c.starts_with("08") || c.starts_with("57P") || c == "5" || c == "6"),
        _ => false,
    };
    tracing::error!(%error, transient, "database error");
    if transient {
        // A pool with every connection in use is busy, not down: the database answers, later.
        let (kind, title, detail) = match error {
            sqlx::Error::PoolTimedOut if db.is_full() => (
                "database-busy",
                "Database busy",
                "Every connection to the payments database is in use.",
            ),
            _ => (
                "database-unavailable",
                "Database unavailable",
                "The payments database could not be reached.",
            ),
        };
        let problem = serde_json::json!({
            "type": format!("urn:payments:problem:{kind}"),
            "title": title,
            "status": 503,
            "detail": format!("{detail} Retry with the same Idempotency-Key after Retry-After seconds."),
        });
        let headers = [
            (CONTENT_TYPE, "application/problem+json"),
            (RETRY_AFTER, "1"),
        ];
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            headers,
            problem.to_string(),
        )
            .into_response();
    }
    api_error(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
}
