// The handler's `Json` after another body extractor: axum gives the body to the last parameter
// only, so the `String` before it is reported at its type, with what to do.
#[path = "../support.rs"]
mod support;

use axum::Json;
use idem_runtime::idempotent;
use support::{AuthUser, NewPayment};

#[idempotent(scope = "user")]
async fn create(user: AuthUser, note: String, Json(req): Json<NewPayment>) -> String {
    format!("{} {note} {}", user.id, req.amount)
}

fn main() {
    let _ = support::route(create);
}
