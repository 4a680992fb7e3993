//! The test kit on handlers that keep idem's contract and on three that break it, each of which it
//! must name by the rule broken.

use axum::body::Body;
use axum::extract::{FromRef, FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use axum::Router;
use idem_runtime::axum::Scope;
use idem_runtime::clock::{ManualClock, Timestamp};
use idem_runtime::policy::MissingKey;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::testkit::{Caller, Contract, Rule, Verdict};
use idem_runtime::{idempotent, Engine};
use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Clone, FromRef)]
struct App {
    engine: Engine,
    charges: Charges,
}

/// The handlers' effect, counted.
#[derive(Clone, Default)]
struct Charges(Arc<AtomicU64>);

impl Charges {
    fn charge(&self) -> u64 {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// The caller, from `x-user`.
struct User(String);

impl<S: Send + Sync> FromRequestParts<S> for User {
    type Rejection = StatusCode;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let user = parts.headers.get("x-user").and_then(|v| v.to_str().ok());
        user.map(|u| User(u.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl Scope for User {
    fn scope_id(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

#[idempotent(scope = "user")]
async fn charge(State(charges): State<Charges>, user: User, body: String) -> (StatusCode, String) {
    let n = charges.charge();
    (
        StatusCode::CREATED,
        format!("charge {n} for {}: {body}", user.0),
    )
}

/// Broken: no attribute, so every retry charges again.
async fn charge_unprotected(
    State(charges): State<Charges>,
    user: User,
    body: String,
) -> (StatusCode, String) {
    let n = charges.charge();
    (
        StatusCode::CREATED,
        format!("charge {n} for {}: {body}", user.0),
    )
}

/// Broken: a per-user endpoint whose keys are global, so two users' keys meet.
#[idempotent(scope = "global")]
async fn charge_global(
    State(charges): State<Charges>,
    user: User,
    body: String,
) -> (StatusCode, String) {
    let n = charges.charge();
    (
        StatusCode::CREATED,
        format!("charge {n} for {}: {body}", user.0),
    )
}

/// Broken for an endpoint that must require a key: requests without one run unprotected.
#[idempotent(scope = "user", missing_key = "pass")]
async fn charge_keyless(
    State(charges): State<Charges>,
    user: User,
    body: String,
) -> (StatusCode, String) {
    let n = charges.charge();
    (
        StatusCode::CREATED,
        format!("charge {n} for {}: {body}", user.0),
    )
}

/// The contract on the route `/charges` served by `route`, counting charges.
fn contract(route: axum::routing::MethodRouter<App>) -> Contract {
    let clock = ManualClock::new(Timestamp::from_millis(1_795_996_800_000));
    let engine = Engine::new(MemoryStore::new().with_clock(clock.clone()));
    let charges = Charges::default();
    let router = Router::new().route("/charges", route).with_state(App {
        engine: engine.clone(),
        charges: charges.clone(),
    });
    Contract::new(router, engine)
        .clock(clock)
        .executions(move || {
            let n = charges.0.load(Ordering::SeqCst);
            async move { n }
        })
}

fn request(caller: Caller) -> Request<Body> {
    Request::post("/charges")
        .header("x-user", caller.name())
        .header("content-type", "application/json")
        .body(Body::from(r#"{"amount": 1000, "currency": "KRW"}"#))
        .expect("a valid request")
}

#[tokio::test]
async fn a_protected_handler_keeps_every_rule() {
    let report = contract(post(charge)).check(request).await;
    report.assert();
    for (rule, verdict) in &report.verdicts {
        assert_eq!(verdict, &Verdict::Passed, "{rule}");
    }
}

#[tokio::test]
async fn a_handler_without_the_attribute_fails_the_replay_and_run_once_rules() {
    let report = contract(post(charge_unprotected)).check(request).await;
    let failed = report.failed();
    for rule in [
        Rule::RetryReplays,
        Rule::ConcurrentRunOnce,
        Rule::OtherBodyRefused,
        Rule::MissingKeyPolicy,
        Rule::HangUpRunsOnce,
        Rule::ExpiredKeyGone,
    ] {
        assert!(failed.contains(&rule), "{rule} not named in:\n{report}");
    }
    let text = report.to_string();
    assert!(
        text.contains("FAILED  a retry with the same key replays the first response"),
        "{text}"
    );
    assert!(
        text.contains("is the handler missing `#[idempotent]`"),
        "{text}"
    );
}

#[tokio::test]
async fn a_global_scope_on_a_per_user_endpoint_fails_the_callers_rule() {
    let report = contract(post(charge_global)).check(request).await;
    assert_eq!(report.failed(), vec![Rule::CallersSeparate], "{report}");
    let text = report.to_string();
    assert!(
        text.contains("FAILED  two callers' keys never meet"),
        "{text}"
    );
    assert!(
        text.contains("replay of the first caller's response"),
        "{text}"
    );
}

#[tokio::test]
async fn missing_key_pass_on_an_endpoint_that_requires_a_key_fails_the_policy_rule() {
    let report = contract(post(charge_keyless))
        .missing_key(MissingKey::Reject)
        .check(request)
        .await;
    assert_eq!(report.failed(), vec![Rule::MissingKeyPolicy], "{report}");
    let text = report.to_string();
    assert!(text.contains("declared to require a key"), "{text}");
    assert!(text.contains("instead of 400"), "{text}");
}

#[tokio::test]
async fn the_same_handler_passes_when_pass_is_what_it_declares() {
    let report = contract(post(charge_keyless))
        .missing_key(MissingKey::Pass)
        .check(request)
        .await;
    report.assert();
}

#[tokio::test]
#[should_panic(expected = "FAILED  two callers' keys never meet")]
async fn as_an_assertion_it_panics_naming_the_rule() {
    contract(post(charge_global)).check(request).await.assert();
}

#[tokio::test]
async fn without_a_clock_the_expiry_rule_is_skipped_not_passed() {
    let clock = ManualClock::new(Timestamp::from_millis(1_795_996_800_000));
    let engine = Engine::new(MemoryStore::new().with_clock(clock));
    let router = Router::new()
        .route("/charges", post(charge))
        .with_state(App {
            engine: engine.clone(),
            charges: Charges::default(),
        });
    let report = Contract::new(router, engine).check(request).await;
    assert!(report.passed(), "{report}");
    assert!(matches!(
        report.verdict(Rule::ExpiredKeyGone),
        Some(Verdict::Skipped(_))
    ));
}
