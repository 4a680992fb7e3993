// Only an `Ok` output is stored, so the function returns `Result`.
#[path = "../fn_support.rs"]
mod fn_support;

use fn_support::ChargeMessage;
use idem_runtime::{idempotent, Engine};

#[idempotent(engine = engine, scope = msg.user, key = msg.id, input = msg)]
async fn charge(engine: &Engine, msg: ChargeMessage) {
    let _ = msg.amount;
}

fn main() {}
