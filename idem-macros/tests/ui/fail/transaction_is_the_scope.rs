// The same parameter named as scope and as transaction.
#[path = "../support.rs"]
mod support;
#[path = "../tx_support.rs"]
mod tx_support;

use idem_runtime::idempotent;
use support::AuthUser;

#[idempotent(scope = "user", transaction = "user")]
async fn create(user: AuthUser, body: String) -> String {
    format!("{} {body}", user.id)
}

fn main() {}
