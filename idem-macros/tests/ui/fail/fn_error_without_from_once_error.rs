// The engine's own errors (a mismatch, an unavailable store) reach the caller through the function's error type.
#[path = "../fn_support.rs"]
mod fn_support;

use fn_support::{ChargeMessage, Receipt};
use idem_runtime::{idempotent, Engine};

#[derive(Debug)]
pub struct PlainError;

#[idempotent(engine = engine, scope = msg.user, key = msg.id, input = msg)]
async fn charge(engine: &Engine, msg: ChargeMessage) -> Result<Receipt, PlainError> {
    Ok(Receipt { amount: msg.amount })
}

fn main() {}
