//! `IdempotencyLayer` checks its policy and its scope when it is built, with the messages
//! `#[idempotent]` gives at compile time: the attribute's policy constant ends in
//! `Policy::checked()` (`checked_for_global_scope()` with `scope = "global"`), whose const panic is
//! its compile error, so the layer must panic, or return the error, with the same text. (That the
//! attribute and the layer word a missing scope alike is a compile-time matter: idem-macros' UI
//! tests check it, on their own snapshots.)

use axum::http::StatusCode;
use idem_runtime::axum::IdempotencyLayer;
use idem_runtime::policy::{MissingKey, Policy, PolicyError};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::Engine;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

fn engine() -> Engine {
    Engine::new(MemoryStore::new())
}

/// What `f` panicked with.
fn panic_message(f: impl FnOnce()) -> String {
    let payload = catch_unwind(AssertUnwindSafe(f)).expect_err("a panic");
    match payload.downcast::<String>() {
        Ok(message) => *message,
        Err(payload) => payload
            .downcast::<&str>()
            .map(|m| m.to_string())
            .expect("a message"),
    }
}

const HOUR: Duration = Duration::from_secs(3600);

#[test]
fn an_invalid_policy_is_refused_with_the_attributes_message() {
    let derive = Policy::new().missing_key(MissingKey::Derive);
    for policy in [
        Policy::new().ttl(Duration::ZERO),
        Policy::new().lease(Duration::ZERO),
        Policy::new().ttl(400 * 24 * HOUR),
        Policy::new().ttl(48 * HOUR).retain(HOUR),
        derive.derive_window(Duration::ZERO),
        derive
            .ttl(Duration::from_secs(5))
            .derive_window(Duration::from_secs(6)),
        Policy::new().reject_after_ms(0),
    ] {
        let error = IdempotencyLayer::try_new(engine(), policy)
            .expect_err("invalid")
            .to_string();
        // What `#[idempotent(policy = P)]` reports at compile time for the same policy.
        let checked = panic_message(|| {
            policy.checked();
        });
        assert_eq!(error, checked);
        let built = panic_message(|| {
            IdempotencyLayer::new(engine(), policy);
        });
        assert_eq!(error, built);
    }
    let error = IdempotencyLayer::try_new(engine(), Policy::new().ttl(48 * HOUR).retain(HOUR))
        .expect_err("retain shorter than ttl");
    assert_eq!(error, PolicyError::RetainShorterThanTtl);
}

#[test]
fn a_global_scope_refuses_derived_keys_with_the_attributes_message() {
    let derive = Policy::new().missing_key(MissingKey::Derive);
    let layer = IdempotencyLayer::new(engine(), derive);
    let message = panic_message(|| {
        layer.global_scope();
    });
    assert_eq!(message, PolicyError::DeriveWithGlobalScope.to_string());
    // What `#[idempotent(scope = "global", policy = P)]` reports at compile time for it.
    let checked = panic_message(|| {
        derive.checked_for_global_scope();
    });
    assert_eq!(message, checked);
    // Scoped to its caller, the same policy is fine.
    let _ = IdempotencyLayer::new(engine(), derive)
        .scope_fn(|_| Ok::<_, StatusCode>("alice".to_owned()));
}
