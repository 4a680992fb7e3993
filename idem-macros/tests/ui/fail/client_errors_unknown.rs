// `client_errors` is "store" or "release"; a near miss gets the probable meaning.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", client_errors = "keep")]
async fn receive(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(receive);
}
