// A handler without parameters, and one without a return type.
#![deny(warnings)]
use crate::support;

use idem_runtime::idempotent;

#[idempotent(scope = "global")]
async fn ping() -> &'static str {
    "pong"
}

#[idempotent(scope = "global")]
async fn fire_and_forget() {}

#[test]
fn routes() {
    let _ = support::route(ping);
    let _ = support::route(fire_and_forget);
}
