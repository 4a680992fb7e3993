// In a JSON Pointer, `~` is written `~0`: a bare `~` is an error on the literal.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", key_field = "/data/a~b")]
async fn receive(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(receive);
}
