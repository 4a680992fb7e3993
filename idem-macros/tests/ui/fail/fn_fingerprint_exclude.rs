// A function's fingerprint is its `input`: a body's JSON Pointers do not apply.
#[path = "../fn_support.rs"]
mod fn_support;

use fn_support::{ChargeError, ChargeMessage, Receipt};
use idem_runtime::{idempotent, Engine};

#[idempotent(engine = engine, scope = msg.user, key = msg.id, input = msg, fingerprint_exclude = ["/sent_at"])]
async fn charge(engine: &Engine, msg: ChargeMessage) -> Result<Receipt, ChargeError> {
    Ok(Receipt { amount: msg.amount })
}

fn main() {}
