// Not a calendar date.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;
use support::AuthUser;

#[idempotent(scope = "user", missing_key = "pass", reject_after = "2027-02-30")]
async fn create(user: AuthUser, body: String) -> String {
    format!("{} {body}", user.id)
}

fn main() {
    // The handler is still emitted as written: the router does not add a second error.
    let _ = support::route(create);
}
