// A handler reads its key from one place: naming a header and a body field is an error at the second.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", key_header = "webhook-id", key_field = "/id")]
async fn receive(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(receive);
}
