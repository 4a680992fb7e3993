// Each excluded member is a JSON Pointer: the error is on the entry that is not one.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", fingerprint_exclude = ["/sent_at", "trace_id"])]
async fn receive(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(receive);
}
