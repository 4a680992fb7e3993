// The transaction parameter is a reference: idem hands the handler the transaction by value.
#[path = "../support.rs"]
mod support;
#[path = "../tx_support.rs"]
mod tx_support;

use idem_runtime::sqlx::Sqlite;
use idem_runtime::{idempotent, Tx};
use support::AuthUser;

#[idempotent(scope = "user", transaction = "tx")]
async fn create(user: AuthUser, tx: &mut Tx<Sqlite>, body: String) -> String {
    let _ = tx;
    format!("{} {body}", user.id)
}

fn main() {}
