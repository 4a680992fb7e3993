// A method taking `self` cannot be a handler.
use idem_runtime::idempotent;

struct Payments;

impl Payments {
    #[idempotent(scope = "global")]
    async fn create(&self, body: String) -> String {
        body
    }
}

fn main() {}
