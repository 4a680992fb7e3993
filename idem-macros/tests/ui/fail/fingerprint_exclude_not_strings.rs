// Pointers are string literals: a number in the list is an error on it.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", fingerprint_exclude = ["/sent_at", 3])]
async fn receive(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(receive);
}
