// The scope must be a whole parameter, not a name bound inside a destructuring pattern.
#[path = "../support.rs"]
mod support;

use axum::Extension;
use idem_runtime::idempotent;

#[idempotent(scope = "user")]
async fn create(Extension(user): Extension<String>, body: String) -> String {
    format!("{user} {body}")
}

fn main() {
    let _ = support::route(create);
}
