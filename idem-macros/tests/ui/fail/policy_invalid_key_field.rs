// A named policy whose key field is no JSON Pointer fails the build where the handler names it,
// via the const evaluation of `Policy::checked`, with the runtime's message.
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;
use idem_runtime::policy::Policy;

const WEBHOOKS: Policy = Policy::new().key_field("id");

#[idempotent(scope = "global", policy = WEBHOOKS)]
async fn receive(body: String) -> String {
    body
}

fn main() {
    let _ = support::route(receive);
}
