//! One protected request, from the `Idempotency-Key` header to the response.
//!
//! 1. The key: every `Idempotency-Key` header value is read; one valid value is the key, two headers
//!    or a malformed value answer 400. Without a key the policy's
//!    [`missing_key`](crate::Policy::missing_key) decides: reject (400), pass (run unprotected, counted,
//!    until `reject_after`), or derive a key from the request, valid for `derive_window`.
//! 2. The engine decides with the request's fingerprint: execute, replay, or a problem
//!    (422 / 409 / 410 / 503, see [`problem`](super::problem)).
//! 3. Execute: the handler runs. A 5xx releases the key so that a retry runs again; anything else is
//!    stored and the key completed. If the handler panics or the request is cancelled, the claim's
//!    guard releases the key as it is dropped.

use super::private::RequestContext;
use super::problem::{Problem, ProblemType};
use super::respond;
use crate::clock::Timestamp;
use crate::engine::{Begin, ClaimGuard, Engine, Rejection};
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, KeyError};
use crate::metrics::Outcome;
use crate::policy::{MissingKey, Policy};
use crate::record::RecordKey;
use crate::store::StoreErrorKind;
use ::axum::http::HeaderValue;
use ::axum::response::{IntoResponse, Response};
use std::future::Future;

/// What the request's headers and the policy say about the key.
enum KeyDecision {
    /// The client's key.
    Given(IdempotencyKey),
    /// No key; one derived from the request, under the derive-window policy.
    Derived(String),
    /// No key; run unprotected.
    Pass,
}

pub(crate) async fn run<F, R>(
    engine: &Engine,
    policy: &'static Policy,
    scope: String,
    request: RequestContext,
    handler: F,
) -> Response
where
    F: Future<Output = R>,
    R: IntoResponse,
{
    let fingerprint = Fingerprint::of_request(
        request.method.as_str(),
        &request.path,
        request.content_type.as_deref(),
        &request.body,
    );
    // The handler holds its own reference to the body; the fingerprint was all this copy was for.
    drop(request.body);
    let derived_policy;
    let (key, policy) = match decide_key(engine, policy, &scope, &request.keys, fingerprint) {
        Ok(KeyDecision::Given(key)) => (key.as_str().to_owned(), policy),
        Ok(KeyDecision::Derived(key)) => {
            // The derived key lives for the window only and leaves no tombstone: after the window,
            // the same request is a new request, not an expired key.
            derived_policy = policy
                .ttl(policy.derive_window)
                .retain(policy.derive_window);
            (key, &derived_policy)
        }
        Ok(KeyDecision::Pass) => return handler.await.into_response(),
        Err(problem) => return problem.into_response(),
    };
    match engine
        .begin(RecordKey::new(scope, key), fingerprint, policy)
        .await
    {
        Ok(Begin::Execute(claim)) => execute(claim, policy, handler).await,
        Ok(Begin::Replay(replay)) => respond::replay(&replay.response, replay.expires_at),
        Err(rejection) => problem_for(rejection).into_response(),
    }
}

fn decide_key(
    engine: &Engine,
    policy: &Policy,
    scope: &str,
    values: &[HeaderValue],
    fingerprint: Fingerprint,
) -> Result<KeyDecision, Problem> {
    let raw = match values {
        [] => return missing_key(engine, policy, scope, fingerprint),
        [one] => one.as_bytes(),
        _ => return Err(malformed(engine, policy, scope, &KeyError::Repeated)),
    };
    IdempotencyKey::parse(raw)
        .map(KeyDecision::Given)
        .map_err(|e| malformed(engine, policy, scope, &e))
}

fn malformed(engine: &Engine, policy: &Policy, scope: &str, error: &KeyError) -> Problem {
    engine.metrics().record(Outcome::MalformedKey);
    // The value itself is not logged: it is client-controlled and, being malformed, possibly huge.
    tracing::info!(target: "idem", outcome = Outcome::MalformedKey.as_str(),
        handler = policy.handler, %scope, %error, "idempotency decision");
    Problem::new(
        ProblemType::MalformedKey,
        format!("{error}. A key is 1 to 255 visible ASCII characters, sent in one Idempotency-Key header, bare or as a quoted string."),
    )
}

fn missing_key(
    engine: &Engine,
    policy: &Policy,
    scope: &str,
    fingerprint: Fingerprint,
) -> Result<KeyDecision, Problem> {
    let note = |outcome: Outcome| {
        engine.metrics().record(outcome);
        tracing::info!(target: "idem", outcome = outcome.as_str(), handler = policy.handler,
            %scope, "idempotency decision");
    };
    let deadline = policy
        .reject_after_ms
        .filter(|at| engine.now().as_millis() >= *at);
    match (policy.missing_key, deadline) {
        (MissingKey::Derive, _) => {
            note(Outcome::KeyDerived);
            Ok(KeyDecision::Derived(format!(
                "derived-{}",
                fingerprint.to_hex()
            )))
        }
        (MissingKey::Pass, None) => {
            note(Outcome::MissingKeyPassed);
            Ok(KeyDecision::Pass)
        }
        (MissingKey::Pass, Some(at)) => {
            note(Outcome::MissingKeyRejected);
            Err(Problem::new(
                ProblemType::MissingKey,
                format!(
                    "Requests without an Idempotency-Key are no longer accepted here since {}: send a unique key (for example a UUID) and reuse it when retrying the same request.",
                    httpdate::fmt_http_date(Timestamp::from_millis(at).to_system_time())
                ),
            ))
        }
        (MissingKey::Reject, _) => {
            note(Outcome::MissingKeyRejected);
            Err(Problem::new(
                ProblemType::MissingKey,
                "This endpoint requires an Idempotency-Key header: send a unique key (for example a UUID) and reuse it when retrying the same request.",
            ))
        }
    }
}

async fn execute<F, R>(claim: ClaimGuard, policy: &Policy, handler: F) -> Response
where
    F: Future<Output = R>,
    R: IntoResponse,
{
    // A panic or a cancellation here drops `claim`, whose guard releases the key.
    let response = handler.await.into_response();
    if response.status().is_server_error() {
        let key = claim.key().clone();
        match claim.release().await {
            Ok(()) => {}
            // Another request took the key over after this one's lease ran out: it is theirs now.
            Err(error) if error.kind() == StoreErrorKind::Fenced => {
                tracing::debug!(target: "idem", handler = policy.handler, scope = %key.scope,
                    key = %key.key, "the key was taken over before it could be released");
            }
            Err(error) => {
                tracing::warn!(target: "idem", handler = policy.handler, scope = %key.scope,
                    key = %key.key, %error, "could not release the key after a server error; a retry can run once its lease runs out");
            }
        }
        return response;
    }
    let expires_at = claim.expires_at();
    let (stored, mut response) = respond::capture(response, policy).await;
    // A failed completion is logged and counted by the engine; the client still gets the fresh
    // response, only without a promise that the key is remembered.
    if claim.complete(&stored).await.is_ok() {
        respond::set_expires(response.headers_mut(), expires_at);
    }
    response
}

fn problem_for(rejection: Rejection) -> Problem {
    match rejection {
        Rejection::Mismatch { expires_at } => Problem::new(
            ProblemType::KeyMismatch,
            "This Idempotency-Key was already used for a different request (another body, method or endpoint). Do not retry with this key; use a new key for a new request.",
        )
        .expires_at(expires_at),
        Rejection::InFlight { retry_after } => Problem::new(
            ProblemType::InFlight,
            "A request with this Idempotency-Key is still being processed. Retry with the same key after Retry-After seconds.",
        )
        .retry_after(retry_after),
        Rejection::Expired { expired_at } => Problem::new(
            ProblemType::KeyExpired,
            format!(
                "This Idempotency-Key expired at {} and its result is no longer replayed. Send the request again under a new key only if it should take effect again.",
                httpdate::fmt_http_date(expired_at.to_system_time())
            ),
        ),
        Rejection::Unavailable { retry_after, .. } => Problem::new(
            ProblemType::StoreUnavailable,
            "The idempotency store could not be reached, so the request was not processed. Retry with the same key after Retry-After seconds.",
        )
        .retry_after(retry_after),
    }
}
