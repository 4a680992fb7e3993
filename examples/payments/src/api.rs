//! The HTTP handlers.
//!
//! The idempotent handlers are written out in the form `#[idempotent(...)]` expands to, with the
//! attribute each stands for above it.
// TODO(integrator): once the `#[idempotent]` macro lands, replace each expanded handler by the
// attribute shown in its comment over the same signature without `__idem_*` parameters, e.g.
//
//     #[idempotent(scope = "user", ttl = "24h", missing_key = "reject")]
//     async fn create_payment(State(app): State<AppState>, user: AuthUser, Json(req): Json<NewPayment>) -> Response {
//         capture(&app, &user, req).await
//     }

use crate::auth::AuthUser;
use crate::ledger::{Ledger, Payment};
use crate::AppState;
use axum::extract::{Path, State};
use axum::http::header::LOCATION;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_runtime::__private::{run, scope_id, EngineState, MissingKey, Policy, WithBody};
use serde::Deserialize;
use std::time::Duration;

/// The largest request body the idempotent handlers read.
const MAX_BODY: usize = 64 * 1024;

/// A payment request.
#[derive(Debug, Deserialize)]
pub(crate) struct NewPayment {
    amount: i64,
    currency: String,
}

// #[idempotent(scope = "user", ttl = "24h", missing_key = "reject", max_body = "64KiB")]
pub(crate) async fn create_payment(
    __idem_engine: EngineState,
    State(app): State<AppState>,
    user: AuthUser,
    WithBody(Json(req), __idem_request): WithBody<Json<NewPayment>, MAX_BODY>,
) -> Response {
    const __IDEM_POLICY: Policy = Policy::new()
        .ttl(Duration::from_secs(24 * 3600))
        .missing_key(MissingKey::Reject)
        .max_request_body(MAX_BODY)
        .handler("create_payment")
        .checked();
    let __idem_scope = scope_id(&user);
    run(__idem_engine, &__IDEM_POLICY, __idem_scope, __idem_request, async move {
        capture(&app, &user, req).await
    })
    .await
}

// #[idempotent(scope = "user", ttl = "24h", missing_key = "derive", derive_window = "10s", max_body = "64KiB")]
pub(crate) async fn create_legacy_payment(
    __idem_engine: EngineState,
    State(app): State<AppState>,
    user: AuthUser,
    WithBody(Json(req), __idem_request): WithBody<Json<NewPayment>, MAX_BODY>,
) -> Response {
    const __IDEM_POLICY: Policy = Policy::new()
        .ttl(Duration::from_secs(24 * 3600))
        .missing_key(MissingKey::Derive)
        .derive_window(Duration::from_secs(10))
        .max_request_body(MAX_BODY)
        .handler("create_legacy_payment")
        .checked();
    let __idem_scope = scope_id(&user);
    run(__idem_engine, &__IDEM_POLICY, __idem_scope, __idem_request, async move {
        capture(&app, &user, req).await
    })
    .await
}

// #[idempotent(scope = "user", ttl = "24h", missing_key = "reject", max_body = "64KiB")]
pub(crate) async fn refund_payment(
    __idem_engine: EngineState,
    State(app): State<AppState>,
    user: AuthUser,
    WithBody(Path(id), __idem_request): WithBody<Path<String>, MAX_BODY>,
) -> Response {
    const __IDEM_POLICY: Policy = Policy::new()
        .ttl(Duration::from_secs(24 * 3600))
        .missing_key(MissingKey::Reject)
        .max_request_body(MAX_BODY)
        .handler("refund_payment")
        .checked();
    let __idem_scope = scope_id(&user);
    run(__idem_engine, &__IDEM_POLICY, __idem_scope, __idem_request, async move {
        refund(&app, &user, &id).await
    })
    .await
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
    match app.ledger.capture(&user.id, req.amount, &req.currency).await {
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
