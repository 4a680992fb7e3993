// Keys shared by every caller, derived from the body: two callers sending the same body would share
// one execution and one response.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;

#[idempotent(scope = "global", missing_key = "derive")]
async fn create(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(create);
}
