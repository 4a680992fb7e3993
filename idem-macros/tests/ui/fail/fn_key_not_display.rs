// The key is text: its expression must be `Display`.
#[path = "../fn_support.rs"]
mod fn_support;

use fn_support::{ChargeError, Receipt};
use idem_runtime::{idempotent, Engine};

#[derive(Debug, serde::Serialize)]
pub struct MessageId(u64);

#[idempotent(engine = engine, scope = "charges", key = id, input = amount)]
async fn charge(engine: &Engine, id: MessageId, amount: u32) -> Result<Receipt, ChargeError> {
    Ok(Receipt { amount })
}

fn main() {}
