// A derived key cannot outlive its record.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;
use support::AuthUser;

#[idempotent(scope = "user", ttl = "1m", missing_key = "derive", derive_window = "5m")]
async fn create(user: AuthUser, body: String) -> String {
    format!("{} {body}", user.id)
}

fn main() {
    // The handler is still emitted as written: the router does not add a second error.
    let _ = support::route(create);
}
