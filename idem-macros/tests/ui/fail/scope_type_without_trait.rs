// The scope parameter's type must implement `idem_runtime::axum::Scope`; the error points at it.
#[path = "../support.rs"]
mod support;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use idem_runtime::idempotent;

struct ApiClient {
    name: String,
}

impl<S: Send + Sync> FromRequestParts<S> for ApiClient {
    type Rejection = ();

    async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, ()> {
        Ok(ApiClient { name: "demo".into() })
    }
}

#[idempotent(scope = "client")]
async fn create(client: ApiClient, body: String) -> String {
    format!("{} {body}", client.name)
}

fn main() {
    let _ = support::route(create);
}
