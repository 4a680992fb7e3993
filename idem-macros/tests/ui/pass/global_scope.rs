// `scope = "global"`: no caller parameter needed.
#![deny(warnings)]
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", ttl = "7d")]
async fn receive_webhook(body: String) -> String {
    format!("received {} bytes", body.len())
}

fn main() {
    let _ = support::route(receive_webhook);
}
