// A dotted path is no JSON Pointer: the error suggests the pointer it probably meant.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", key_field = "data.request_id")]
async fn receive(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(receive);
}
