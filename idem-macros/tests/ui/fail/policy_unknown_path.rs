// A misspelled policy name is reported by the compiler at the name, with the likely one. (Twice:
// the name is used for the policy and for the request-body limit in the signature.)
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;
use idem_runtime::policy::Policy;
use support::AuthUser;

const PAYMENTS: Policy = Policy::new();

#[idempotent(scope = "user", policy = PAYMENT)]
async fn create(user: AuthUser, body: String) -> String {
    format!("{} {body}", user.id)
}

fn main() {
    let _ = support::route(create);
}
