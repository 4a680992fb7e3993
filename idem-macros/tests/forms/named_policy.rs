// A policy stated once as a `const` (here in a module, named by path), shared by handlers, with
// attribute options overriding it.
#![deny(warnings)]
use crate::support;

use axum::extract::Path;
use idem_runtime::idempotent;
use support::AuthUser;

mod policies {
    use idem_runtime::policy::{MissingKey, Policy, ReplayMode};
    use std::time::Duration;

    pub const PAYMENTS: Policy = Policy::new()
        .ttl(Duration::from_secs(24 * 3600))
        .retain(Duration::from_secs(30 * 24 * 3600))
        .missing_key(MissingKey::Reject)
        .replay(ReplayMode::Minimal)
        .max_request_body(64 * 1024);
}

use policies::PAYMENTS;

#[idempotent(scope = "user", policy = PAYMENTS)]
async fn create_payment(user: AuthUser, body: String) -> String {
    format!("{}: {body}", user.id)
}

#[idempotent(scope = "user", policy = policies::PAYMENTS, ttl = "48h", replay = "full", max_body = "16KiB")]
async fn refund_payment(user: AuthUser, Path(id): Path<u64>) -> String {
    format!("{} refunds {id}", user.id)
}

#[idempotent(scope = "user", policy = self::policies::PAYMENTS, missing_key = "pass", reject_after = "2027-03-01")]
async fn legacy(user: AuthUser) -> String {
    user.id
}

#[test]
fn routes() {
    let _ = support::route(create_payment);
    let _ = support::route(refund_payment);
    let _ = support::route(legacy);
}
