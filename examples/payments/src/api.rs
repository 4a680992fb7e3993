//! The HTTP handlers. The creates (through `#[idempotent]`) and the refund (through
//! `IdempotencyLayer`, see [`crate::router`]) are idempotent; the reads need not be.

use crate::auth::AuthUser;
use crate::card::{CardNetwork, Charge};
use crate::ledger::{Database, Ledger, Payment};
use crate::problem::{self, Problem};
use crate::AppState;
use axum::extract::{Path, State};
use axum::http::header::LOCATION;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_runtime::axum::Attempt;
use idem_runtime::sqlx::{MySql, Postgres, Sqlite};
use idem_runtime::{idempotent, Policy, Tx};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// A payment request: a JSON object `{"amount": 1000, "currency": "KRW"}`. Other members are
/// ignored.
#[derive(Debug, utoipa::ToSchema)]
pub(crate) struct NewPayment {
    /// In the currency's minor unit: a whole number from 1 to 2^53 - 1 (the integers every JSON
    /// parser reads exactly).
    #[schema(minimum = 1, maximum = 9007199254740991_i64)]
    amount: i64,
    /// ISO 4217 code: three capital letters, such as `KRW`.
    #[schema(pattern = "^[A-Z]{3}$", min_length = 3, max_length = 3)]
    currency: String,
}

/// The largest amount taken: 2^53 - 1, the largest integer that every JSON parser reads exactly
/// (RFC 7493).
const MAX_AMOUNT: i64 = (1 << 53) - 1;

/// An error the API answers itself: `{"error": "..."}`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct ApiError {
    /// What is wrong.
    error: String,
}

/// Only the object form. serde's derive would also take the sequence form, `[1000, "KRW"]`, which
/// no client of this API means to send: it is refused (422) like any other malformed body.
///
/// `amount` is a JSON integer as JSON Schema counts them, which the API document promises: `1000`,
/// and also `1000.0` or `1e3`, a number whose fraction is zero. An integral number beyond `i64`
/// saturates, so that it is refused as out of range like any amount above the maximum.
impl<'de> Deserialize<'de> for NewPayment {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Fields {
            amount: serde_json::Number,
            currency: String,
        }
        let object = serde_json::Map::deserialize(deserializer)?;
        let Fields { amount, currency } = Fields::deserialize(serde_json::Value::Object(object))
            .map_err(serde::de::Error::custom)?;
        let amount = match (amount.as_i64(), amount.as_f64()) {
            (Some(whole), _) => whole,
            // `as` saturates at i64's bounds.
            (None, Some(number)) if number.fract() == 0.0 => number as i64,
            _ => {
                return Err(serde::de::Error::custom(format!(
                    "invalid type: `amount` must be a whole number, not {amount}"
                )))
            }
        };
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
        (status = 400, description = BAD_BODY, body = Problem, content_type = "application/problem+json"),
        (status = 401, description = UNAUTHORIZED, body = Problem, content_type = "application/problem+json",
            headers(("WWW-Authenticate" = String, description = "`Bearer`"))),
        (status = 415, description = UNSUPPORTED, body = Problem, content_type = "application/problem+json"),
        (status = 422, description = INVALID, content(
            (ApiError = "application/json"),
            (Problem = "application/problem+json"))),
        (status = 500, description = INTERNAL, body = ApiError),
        (status = 503, description = DATABASE_DOWN, body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u32, description = "Seconds to wait before retrying with the same key."))),
    ),
)]
pub(crate) async fn create_payment(
    State(app): State<AppState>,
    user: AuthUser,
    attempt: Attempt,
    problem::Json(req): problem::Json<NewPayment>,
) -> Response {
    capture(&app, &user, &attempt, &req).await
}

/// The descriptions of the responses the payment endpoints share.
const BAD_BODY: &str = "The body is not JSON (`urn:payments:problem:malformed-body`), or could not be read (`urn:payments:problem:unreadable-body`)";
const UNAUTHORIZED: &str =
    "No bearer token, or one that names no user (`urn:payments:problem:unauthorized`)";
const UNSUPPORTED: &str = "The body was sent without `Content-Type: application/json` (`urn:payments:problem:unsupported-media-type`)";
const INVALID: &str = "The body is JSON but not a payment request (`urn:payments:problem:invalid-body`, as a problem), or its amount or currency is out of range (`{\"error\": ...}`, stored and replayed like a 201)";
const INTERNAL: &str = "The payments database failed in a way a retry cannot fix";
const DATABASE_DOWN_READ: &str = "The payments database could not be reached (`urn:payments:problem:database-unavailable`), or its pool had no free connection (`urn:payments:problem:database-busy`): retry after `Retry-After`";
const DATABASE_DOWN: &str = "The payments database could not be reached (`urn:payments:problem:database-unavailable`), or its pool had no free connection (`urn:payments:problem:database-busy`): retry with the same key after `Retry-After`";

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
    problem::Json(req): problem::Json<NewPayment>,
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
    problem::Json(req): problem::Json<NewPayment>,
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

/// `POST /payments` in transactional mode on MySQL/MariaDB (see [`create_payment_in_sqlite`]).
#[idempotent(scope = "user", policy = PAYMENTS, transaction = "tx")]
pub(crate) async fn create_payment_in_mysql(
    State(app): State<AppState>,
    user: AuthUser,
    attempt: Attempt,
    mut tx: Tx<MySql>,
    problem::Json(req): problem::Json<NewPayment>,
) -> Response {
    let charge_id = match charge(&app, &user, &attempt, &req).await {
        Ok(charge_id) => charge_id,
        Err(response) => return response,
    };
    let payment = Payment::captured(req.amount, &req.currency);
    let recorded = match tx.conn().await {
        Ok(conn) => crate::ledger::mysql::insert(conn, &user.id, &payment, &charge_id).await,
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
    if !(1..=MAX_AMOUNT).contains(&req.amount) {
        return Err(invalid(
            "`amount` must be a whole number of minor units from 1 to 2^53 - 1",
        ));
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
        (status = 400, description = BAD_BODY, body = Problem, content_type = "application/problem+json"),
        (status = 401, description = UNAUTHORIZED, body = Problem, content_type = "application/problem+json",
            headers(("WWW-Authenticate" = String, description = "`Bearer`"))),
        (status = 415, description = UNSUPPORTED, body = Problem, content_type = "application/problem+json"),
        (status = 422, description = INVALID, content(
            (ApiError = "application/json"),
            (Problem = "application/problem+json"))),
        (status = 500, description = INTERNAL, body = ApiError),
        (status = 503, description = DATABASE_DOWN, body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u32, description = "Seconds to wait before retrying with the same key."))),
    ),
)]
pub(crate) async fn create_legacy_payment(
    State(app): State<AppState>,
    user: AuthUser,
    attempt: Attempt,
    problem::Json(req): problem::Json<NewPayment>,
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
        (status = 401, description = UNAUTHORIZED, body = Problem, content_type = "application/problem+json",
            headers(("WWW-Authenticate" = String, description = "`Bearer`"))),
        (status = 404, description = "No such payment of the caller's", body = ApiError),
        (status = 500, description = INTERNAL, body = ApiError),
        (status = 503, description = DATABASE_DOWN, body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u32, description = "Seconds to wait before retrying with the same key."))),
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
        (status = 401, description = UNAUTHORIZED, body = Problem, content_type = "application/problem+json",
            headers(("WWW-Authenticate" = String, description = "`Bearer`"))),
        (status = 500, description = INTERNAL, body = ApiError),
        (status = 503, description = DATABASE_DOWN_READ, body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u32, description = "Seconds to wait before retrying."))),
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
        (status = 401, description = UNAUTHORIZED, body = Problem, content_type = "application/problem+json",
            headers(("WWW-Authenticate" = String, description = "`Bearer`"))),
        (status = 404, description = "No such payment of the caller's", body = ApiError),
        (status = 500, description = INTERNAL, body = ApiError),
        (status = 503, description = DATABASE_DOWN_READ, body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u32, description = "Seconds to wait before retrying."))),
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
        (status = 401, description = UNAUTHORIZED, body = Problem, content_type = "application/problem+json",
            headers(("WWW-Authenticate" = String, description = "`Bearer`"))),
        (status = 500, description = INTERNAL, body = ApiError),
        (status = 503, description = DATABASE_DOWN_READ, body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = u32, description = "Seconds to wait before retrying."))),
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

pub(crate) fn api_error(status: StatusCode, message: &str) -> Response {
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
pub(crate) fn database_error(error: &sqlx::Error, db: &Database) -> Response {
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
                "urn:payments:problem:database-busy",
                "Database busy",
                "Every connection to the payments database is in use.",
            ),
            _ => (
                "urn:payments:problem:database-unavailable",
                "Database unavailable",
                "The payments database could not be reached.",
            ),
        };
        return Problem::new(StatusCode::SERVICE_UNAVAILABLE, kind, title)
            .detail(format!(
                "{detail} Retry with the same Idempotency-Key after Retry-After seconds."
            ))
            .retry_after(1)
            .into_response();
    }
    api_error(StatusCode::INTERNAL_SERVER_ERROR, "internal error")
}
