// Another crate's type named `Json`, named through an alias, is extracted as any other last
// parameter (its own extractor, after idem has buffered and fingerprinted the body).
#![deny(warnings)]
#[path = "../support.rs"]
mod support;

use idem_runtime::idempotent;
use support::other;

type Text<T> = other::Json<T>;

#[idempotent(scope = "global")]
async fn create(other::Json(body): Text<String>) -> String {
    body
}

fn main() {
    let _ = support::route(create);
}
