// derive_window only means something with missing_key = "derive".
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;
use support::AuthUser;

#[idempotent(scope = "user", derive_window = "10s")]
async fn create(user: AuthUser, body: String) -> String {
    format!("{} {body}", user.id)
}

fn main() {
    // The handler is still emitted as written: the router does not add a second error.
    let _ = support::route(create);
}
