// Excluding members and naming the only ones that count cannot be combined.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", fingerprint_exclude = ["/sent_at"], fingerprint_only = ["/amount"])]
async fn receive(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(receive);
}
