// A plain function names the expression that gives its engine.
#[path = "../fn_support.rs"]
mod fn_support;

use fn_support::{ChargeError, ChargeMessage, Receipt};
use idem_runtime::idempotent;

#[idempotent(scope = msg.user, key = msg.id, input = msg)]
async fn charge(msg: ChargeMessage) -> Result<Receipt, ChargeError> {
    Ok(Receipt { amount: msg.amount })
}

fn main() {}
