// The scope parameter's type implements `Scope` but is no extractor. Whether a type extracts
// depends on the router's state, which only the router knows: the router reports the handler,
// listing its parameters as written (the engine idem adds is not among them).
#[path = "../support.rs"]
mod support;

use idem_runtime::axum::Scope;
use idem_runtime::idempotent;
use std::borrow::Cow;

struct TenantId(String);

impl Scope for TenantId {
    fn scope_id(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

#[idempotent(scope = "tenant")]
async fn create(tenant: TenantId, body: String) -> String {
    format!("{} {body}", tenant.0)
}

fn main() {
    let _ = support::route(create);
}
