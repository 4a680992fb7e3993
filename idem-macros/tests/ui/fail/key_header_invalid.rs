// A header name with a space is no header name: the error is on the literal.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", key_header = "webhook id")]
async fn receive(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(receive);
}
