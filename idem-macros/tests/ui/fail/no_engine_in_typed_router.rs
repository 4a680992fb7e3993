// As `no_engine_in_state.rs`, with the router's state type written out: axum infers the handler's
// state as the only one it can see providing an `Engine` (`Engine` itself), so the error is
// "expected `MethodRouter<AppWithoutEngine>`, found `MethodRouter<Engine>`" at `.route(...)`.
use axum::routing::post;
use axum::Router;
use idem_runtime::idempotent;

#[derive(Clone)]
struct AppWithoutEngine {
    name: String,
}

#[idempotent(scope = "global")]
async fn create(body: String) -> String {
    body
}

fn main() {
    let _router: Router<AppWithoutEngine> = Router::new().route("/payments", post(create));
}
