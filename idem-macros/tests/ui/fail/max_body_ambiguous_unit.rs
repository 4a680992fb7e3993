// MB is ambiguous (10^6 or 2^20): the binary spelling is suggested.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;
use support::AuthUser;

#[idempotent(scope = "user", max_body = "1MB")]
async fn create(user: AuthUser, body: String) -> String {
    format!("{} {body}", user.id)
}

fn main() {
    // The handler is still emitted as written: the router does not add a second error.
    let _ = support::route(create);
}
