// `scope = "global"`: no caller parameter needed.
#![deny(warnings)]
use crate::support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", ttl = "7d")]
async fn receive_webhook(body: String) -> String {
    format!("received {} bytes", body.len())
}

#[test]
fn routes() {
    let _ = support::route(receive_webhook);
}
