// A plain function states whose call it is, as for handlers.
#[path = "../fn_support.rs"]
mod fn_support;

use fn_support::{ChargeError, ChargeMessage, Receipt};
use idem_runtime::{idempotent, Engine};

#[idempotent(engine = engine, key = msg.id, input = msg)]
async fn charge(engine: &Engine, msg: ChargeMessage) -> Result<Receipt, ChargeError> {
    Ok(Receipt { amount: msg.amount })
}

fn main() {}
