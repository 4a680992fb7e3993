// The input is fingerprinted as JSON: it must be `Serialize`.
#[path = "../fn_support.rs"]
mod fn_support;

use fn_support::{ChargeError, Receipt};
use idem_runtime::{idempotent, Engine};

pub struct Order {
    pub id: u64,
}

#[idempotent(engine = engine, scope = "orders", key = order.id, input = order)]
async fn place(engine: &Engine, order: Order) -> Result<Receipt, ChargeError> {
    Ok(Receipt { amount: order.id as u32 })
}

fn main() {}
