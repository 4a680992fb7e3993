// The router state must provide the idem engine (`Engine: FromRef<State>`): forgetting it fails
// to compile where the state is given, never on the first request. (axum infers the state type
// from the handler; the only state that provides an `Engine` it can see is `Engine` itself, hence
// "expected `Engine`".)
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
    let app = AppWithoutEngine { name: "demo".into() };
    let _router: Router = Router::new()
        .route("/payments", post(create))
        .with_state(app);
}
