// Each handler gets one constant policy: generic handlers are not supported.
use idem_runtime::idempotent;

#[idempotent(scope = "global")]
async fn create<T: Default>(body: String) -> String {
    let _ = T::default();
    body
}

fn main() {}
