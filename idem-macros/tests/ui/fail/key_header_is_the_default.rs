// `key_header = "Idempotency-Key"` names the default source: the error says to remove it.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", key_header = "Idempotency-Key")]
async fn receive(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(receive);
}
