// In a plain function, `scope` is an expression: a string naming a parameter is the handler form.
#[path = "../fn_support.rs"]
mod fn_support;

use fn_support::{ChargeError, ChargeMessage, Receipt};
use idem_runtime::{idempotent, Engine};

#[idempotent(engine = engine, scope = "user", key = msg.id, input = msg)]
async fn charge(engine: &Engine, user: u64, msg: ChargeMessage) -> Result<Receipt, ChargeError> {
    Ok(Receipt { amount: msg.amount + user as u32 })
}

fn main() {}
