// The function face runs futures: the function must be `async fn`.
#[path = "../fn_support.rs"]
mod fn_support;

use fn_support::{ChargeError, ChargeMessage, Receipt};
use idem_runtime::{idempotent, Engine};

#[idempotent(engine = engine, scope = msg.user, key = msg.id, input = msg)]
fn charge(engine: &Engine, msg: ChargeMessage) -> Result<Receipt, ChargeError> {
    Ok(Receipt { amount: msg.amount })
}

fn main() {}
