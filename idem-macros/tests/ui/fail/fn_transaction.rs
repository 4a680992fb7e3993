// `transaction` names a handler's transaction parameter; a plain function's transactional form is
// `Transactional::once`, called by hand.
#[path = "../fn_support.rs"]
mod fn_support;

use fn_support::{ChargeError, ChargeMessage, Receipt};
use idem_runtime::{idempotent, Engine};

#[idempotent(engine = engine, scope = msg.user, key = msg.id, input = msg, transaction = "tx")]
async fn charge(engine: &Engine, msg: ChargeMessage) -> Result<Receipt, ChargeError> {
    Ok(Receipt { amount: msg.amount })
}

fn main() {}
