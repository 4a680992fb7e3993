// The last parameter reads only the request head (no body extractor), including when it is the
// scope parameter itself, bound `mut`.
#![deny(warnings)]
use crate::support;

use axum::extract::{Path, State};
use idem_runtime::idempotent;
use support::{App, AuthUser};

#[idempotent(scope = "user")]
async fn refund(State(app): State<App>, Path(id): Path<u64>, mut user: AuthUser) -> String {
    user.id.push_str("-refund");
    format!("{} {id} {}", app.name, user.id)
}

#[idempotent(scope = "user")]
async fn refund_by_path(user: AuthUser, Path(id): Path<u64>) -> String {
    format!("{} {id}", user.id)
}

#[test]
fn routes() {
    let _ = support::route(refund);
    let _ = support::route(refund_by_path);
}
