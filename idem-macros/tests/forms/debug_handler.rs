// axum's `#[debug_handler]`, written below `#[idempotent]`, checks the rewritten handler against
// the state (what the router's "not a `Handler`" note suggests).
#![deny(warnings)]
use crate::support;

use axum::extract::State;
use axum::Json;
use idem_runtime::idempotent;
use support::{App, AuthUser, NewPayment};

#[idempotent(scope = "user")]
#[axum::debug_handler(state = App)]
async fn create(State(app): State<App>, user: AuthUser, Json(req): Json<NewPayment>) -> String {
    format!("{} {} {}", app.name, user.id, req.amount)
}

#[test]
fn routes() {
    let _ = support::route(create);
}
