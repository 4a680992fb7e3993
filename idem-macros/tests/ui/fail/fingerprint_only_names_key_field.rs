// The body field the key is read from is never part of its own fingerprint.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", key_field = "/id", fingerprint_only = ["/amount", "/id"])]
async fn receive(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(receive);
}
