// An empty list of exclusions excludes nothing: the error says to name one or leave the option out.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", fingerprint_exclude = [])]
async fn receive(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(receive);
}
