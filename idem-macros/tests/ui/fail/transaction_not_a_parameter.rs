// `transaction` names a parameter that does not exist; one with a close name does.
#[path = "../support.rs"]
mod support;
#[path = "../tx_support.rs"]
mod tx_support;

use idem_runtime::sqlx::Sqlite;
use idem_runtime::{idempotent, Tx};
use support::AuthUser;

#[idempotent(scope = "user", transaction = "txn")]
async fn create(user: AuthUser, tx: Tx<Sqlite>, body: String) -> String {
    drop(tx);
    format!("{} {body}", user.id)
}

fn main() {
    let _ = tx_support::route_tx(create);
}
