// As `scope_not_an_extractor.rs`, with axum's `#[debug_handler]` below `#[idempotent]` (what the
// router's note suggests): the mistake is reported at the parameter's type.
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
#[axum::debug_handler(state = support::App)]
async fn create(tenant: TenantId, body: String) -> String {
    format!("{} {body}", tenant.0)
}

fn main() {
    let _ = support::route(create);
}
