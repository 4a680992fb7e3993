// The typical handler: router state, the caller as scope, a JSON body; the body uses (and moves)
// the scope parameter. No warnings from the expansion.
#![deny(warnings)]
use crate::support;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use idem_runtime::idempotent;
use support::{App, AuthUser, NewPayment};

#[idempotent(scope = "user", ttl = "24h", missing_key = "reject")]
async fn create_payment(
    State(app): State<App>,
    user: AuthUser,
    Json(req): Json<NewPayment>,
) -> impl IntoResponse {
    let owner: String = user.id; // moves out of the scope parameter
    (
        StatusCode::CREATED,
        format!("{} {} {} for {owner}", app.name, req.amount, req.currency),
    )
}

#[test]
fn routes() {
    let _ = support::route(create_payment);
}
