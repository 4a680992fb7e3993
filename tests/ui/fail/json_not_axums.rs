// A last parameter written `Json<T>` is read as axum's `Json` (parsed once for the handler and
// the fingerprint); another crate's type named `Json` is reported at the type, with the way out
// (the router's "not a handler" error follows from it).
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;
use support::other::Json;

#[idempotent(scope = "global")]
async fn create(Json(body): Json<String>) -> String {
    body
}

fn main() {
    let _ = support::route(create);
}
