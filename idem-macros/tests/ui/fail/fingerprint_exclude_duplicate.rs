// A pointer listed twice is an error on the second.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", fingerprint_exclude = ["/sent_at", "/sent_at"])]
async fn receive(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(receive);
}
