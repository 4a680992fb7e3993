// `transaction` names a parameter the handler does not have: the message shows how to add it.
#[path = "../support.rs"]
mod support;
#[path = "../tx_support.rs"]
mod tx_support;

use idem_runtime::idempotent;
use support::AuthUser;

#[idempotent(scope = "user", transaction = "tx")]
async fn create(user: AuthUser, body: String) -> String {
    format!("{} {body}", user.id)
}

fn main() {
    let _ = tx_support::route_tx(create);
}
