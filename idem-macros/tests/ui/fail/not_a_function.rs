// The attribute goes on handlers only.
use idem_runtime::idempotent;

#[idempotent(scope = "global")]
struct Payment {
    amount: u64,
}

fn main() {
    let _ = Payment { amount: 1 }.amount;
}
