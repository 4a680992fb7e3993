// The layer, like the attribute, needs a scope: without one it is no layer, with the attribute's
// message for a missing `scope`.
use axum::routing::post;
use idem_runtime::axum::IdempotencyLayer;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::{Engine, Policy};

async fn create(body: String) -> String {
    body
}

fn main() {
    let engine = Engine::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(engine, Policy::new().handler("create"));
    let _: axum::Router = axum::Router::new().route("/", post(create).route_layer(layer));
}
