// A transactional handler on a router whose state has an `Engine` but no `Transactional` engine
// for the handler's database: it does not compile (never a failure on the first request).
#[path = "../support.rs"]
mod support;

use idem_runtime::sqlx::Sqlite;
use idem_runtime::{idempotent, Tx};
use support::AuthUser;

#[idempotent(scope = "user", transaction = "tx")]
async fn create(user: AuthUser, tx: Tx<Sqlite>, body: String) -> String {
    drop(tx);
    format!("{} {body}", user.id)
}

fn main() {
    let _ = support::route(create);
}
