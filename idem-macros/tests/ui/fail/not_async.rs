// axum handlers are async; the attribute says so at the `fn`.
use idem_runtime::idempotent;

#[idempotent(scope = "global")]
fn create(body: String) -> String {
    body
}

fn main() {}
