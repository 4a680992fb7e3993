// The output is stored as JSON: its type must be `Serialize` and `Deserialize`.
#[path = "../fn_support.rs"]
mod fn_support;

use fn_support::{ChargeError, ChargeMessage};
use idem_runtime::{idempotent, Engine};

pub struct Opaque(u32);

#[idempotent(engine = engine, scope = msg.user, key = msg.id, input = msg)]
async fn charge(engine: &Engine, msg: ChargeMessage) -> Result<Opaque, ChargeError> {
    Ok(Opaque(msg.amount))
}

fn main() {}
