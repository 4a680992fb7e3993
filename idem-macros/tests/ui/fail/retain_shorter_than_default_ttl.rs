// The default ttl (24h) counts too.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;
use support::AuthUser;

#[idempotent(scope = "user", retain = "1h")]
async fn create(user: AuthUser, body: String) -> String {
    format!("{} {body}", user.id)
}

fn main() {
    // The handler is still emitted as written: the router does not add a second error.
    let _ = support::route(create);
}
