// The transaction parameter has sqlx's own transaction type, not idem's.
#[path = "../support.rs"]
mod support;
#[path = "../tx_support.rs"]
mod tx_support;

use idem_runtime::idempotent;
use idem_runtime::sqlx::{Sqlite, Transaction};
use support::AuthUser;

#[idempotent(scope = "user", transaction = "tx")]
async fn create(user: AuthUser, tx: Transaction<'static, Sqlite>, body: String) -> String {
    drop(tx);
    format!("{} {body}", user.id)
}

fn main() {}
