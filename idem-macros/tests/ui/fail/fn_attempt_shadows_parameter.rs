// The `Attempt` binding would hide a parameter of the same name from the body.
#[path = "../fn_support.rs"]
mod fn_support;

use fn_support::{ChargeError, ChargeMessage, Receipt};
use idem_runtime::{idempotent, Engine};

#[idempotent(engine = engine, scope = msg.user, key = msg.id, input = msg, attempt = msg)]
async fn charge(engine: &Engine, msg: ChargeMessage) -> Result<Receipt, ChargeError> {
    Ok(Receipt { amount: msg.amount })
}

fn main() {}
