// `engine` gives an `Engine` (or a reference to one, or an `Arc<Engine>`), not a store.
#[path = "../fn_support.rs"]
mod fn_support;

use fn_support::{ChargeError, ChargeMessage, Receipt};
use idem_runtime::idempotent;

pub struct Service {
    pub store: idem_runtime::store::memory::MemoryStore,
}

impl Service {
    #[idempotent(engine = self.store, scope = msg.user, key = msg.id, input = msg)]
    async fn charge(&self, msg: ChargeMessage) -> Result<Receipt, ChargeError> {
        Ok(Receipt { amount: msg.amount })
    }
}

fn main() {}
