//! `IdempotencyLayer` checks its policy and its scope when it is built, with the messages
//! `#[idempotent]` gives at compile time: a named policy's (`policy = NAME`, which
//! `Policy::checked` judges), a global scope's, a missing scope's. The attribute's messages are
//! read from idem-macros' committed UI snapshots.

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

/// The compile error of idem-macros' UI case `name`, as committed.
fn compile_error(name: &str) -> String {
    let path = format!(
        "{}/../idem-macros/tests/ui/fail/{name}.stderr",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
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
    // The named policy of the UI case `policy_invalid_const`, and its committed compile error.
    let error = IdempotencyLayer::try_new(engine(), Policy::new().ttl(48 * HOUR).retain(HOUR))
        .expect_err("retain shorter than ttl");
    assert_eq!(error, PolicyError::RetainShorterThanTtl);
    let attribute = compile_error("policy_invalid_const");
    assert!(
        attribute.contains(&format!("evaluation panicked: {error}\n")),
        "{error}\n{attribute}"
    );
}

#[test]
fn a_global_scope_refuses_derived_keys_with_the_attributes_message() {
    let derive = Policy::new().missing_key(MissingKey::Derive);
    let layer = IdempotencyLayer::new(engine(), derive);
    let message = panic_message(|| {
        layer.global_scope();
    });
    assert_eq!(message, PolicyError::DeriveWithGlobalScope.to_string());
    let attribute = compile_error("policy_derive_with_global_scope");
    assert!(
        attribute.contains(&format!("evaluation panicked: {message}\n")),
        "{message}\n{attribute}"
    );
    // Scoped to its caller, the same policy is fine.
    let _ = IdempotencyLayer::new(engine(), derive)
        .scope_fn(|_| Ok::<_, StatusCode>("alice".to_owned()));
}

#[test]
fn a_layer_without_a_scope_fails_as_the_attribute_without_one() {
    // Both fail to compile: the attribute at the attribute, the layer where it is applied.
    let opening = "missing `scope`: keys are unique per caller, so name";
    let closing = "to share keys between all callers";
    for case in ["scope_missing", "layer_without_scope"] {
        let stderr = compile_error(case);
        let first = stderr.lines().next().unwrap_or_default();
        assert!(
            first.contains(opening) && first.contains(closing),
            "{case}: {stderr}"
        );
    }
}
