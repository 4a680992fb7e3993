// A named policy that contradicts itself (retain shorter than ttl) fails the build where the
// handler names it, via the const evaluation of `Policy::checked`.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;
use idem_runtime::policy::Policy;
use std::time::Duration;
use support::AuthUser;

const PAYMENTS: Policy = Policy::new()
    .ttl(Duration::from_secs(48 * 3600))
    .retain(Duration::from_secs(3600));

#[idempotent(scope = "user", policy = PAYMENTS)]
async fn create(user: AuthUser, body: String) -> String {
    format!("{} {body}", user.id)
}

fn main() {
    let _ = support::route(create);
}
