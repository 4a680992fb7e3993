// The same mistake through a named policy: its `missing_key` is only known when the constant is
// evaluated, so the check runs there, at compile time.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;
use idem_runtime::policy::{MissingKey, Policy};

const DOUBLE_TAPS: Policy = Policy::new().missing_key(MissingKey::Derive);

#[idempotent(scope = "global", policy = DOUBLE_TAPS)]
async fn create(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(create);
}
