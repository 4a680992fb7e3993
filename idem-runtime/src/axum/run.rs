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
//!
//! In transactional mode ([`run_transactional`]) step 3 runs inside the transaction the key was
//! claimed in: a 5xx, panic or cancellation rolls it back, anything else is stored in it and
//! committed, and a failed commit answers 503 instead of the handler's response.

use super::private::{KeyHeader, RequestContext};
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
#[cfg(any(feature = "sqlite", feature = "postgres"))]
use crate::transaction::{Transactional, TxBegin, TxClaim, TxHandle};
use ::axum::response::{IntoResponse, Response};
use futures_util::future::Either;
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

/// The policy a keyed request runs under: the handler's own, or, for a derived key, its
/// derive-window variant (boxed: that path is rare, and the policy is held for the whole request).
enum KeyPolicy {
    Handler(&'static Policy),
    Derived(Box<Policy>),
}

impl std::ops::Deref for KeyPolicy {
    type Target = Policy;

    fn deref(&self) -> &Policy {
        match self {
            KeyPolicy::Handler(policy) => policy,
            KeyPolicy::Derived(policy) => policy,
        }
    }
}

/// What a request amounts to once its key is read.
enum Keyed {
    /// Protected under this record key, with this policy.
    Key(RecordKey, Fingerprint, KeyPolicy),
    /// Run unprotected.
    Pass,
    /// Answered already: a malformed key, or none where one is required.
    Answered(Response),
}

/// Fingerprints the request and reads its key; answers with a problem if the key is malformed or
/// missing where required.
fn keyed(
    engine: &Engine,
    policy: &'static Policy,
    scope: String,
    request: RequestContext,
) -> Keyed {
    let fingerprint = request.fingerprint;
    match decide_key(engine, policy, &scope, request.key, fingerprint) {
        Ok(KeyDecision::Given(key)) => Keyed::Key(
            RecordKey::new(scope, key.into_string()),
            fingerprint,
            KeyPolicy::Handler(policy),
        ),
        // The derived key lives for the window only and leaves no tombstone: after the window,
        // the same request is a new request, not an expired key.
        Ok(KeyDecision::Derived(key)) => Keyed::Key(
            RecordKey::new(scope, key),
            fingerprint,
            KeyPolicy::Derived(Box::new(
                policy
                    .ttl(policy.derive_window)
                    .retain(policy.derive_window),
            )),
        ),
        Ok(KeyDecision::Pass) => Keyed::Pass,
        Err(problem) => Keyed::Answered(problem.into_response()),
    }
}

/// Reads the key before the returned future exists, so that the request's context is not carried
/// through it (every byte of this future is part of the allocation axum boxes each request in).
pub(crate) fn run<F, R>(
    engine: Engine,
    policy: &'static Policy,
    scope: String,
    request: RequestContext,
    handler: F,
) -> impl Future<Output = Response>
where
    F: Future<Output = R>,
    R: IntoResponse,
{
    let (key, fingerprint, policy) = match keyed(&engine, policy, scope, request) {
        Keyed::Key(key, fingerprint, policy) => (key, fingerprint, policy),
        Keyed::Pass => {
            return Either::Left(Either::Left(async move { handler.await.into_response() }))
        }
        Keyed::Answered(response) => {
            return Either::Left(Either::Right(std::future::ready(response)))
        }
    };
    // Step 3 is written out here rather than in a function of its own: `claim` is then a local of
    // this future, not a capture of a second one kept beside the completion's (which holds it too).
    Either::Right(async move {
        let claim = match engine.begin_owned(key, fingerprint, &policy).await {
            Ok(Begin::Execute(claim)) => claim,
            Ok(Begin::Replay(replay)) => {
                return respond::replay(replay.response, replay.expires_at)
            }
            Err(rejection) => return problem_for(rejection).into_response(),
        };
        // A panic or a cancellation from here on drops `claim`, whose guard releases the key.
        let capturing = {
            // Scoped so that this response's storage ends before the next await.
            let response = handler.await.into_response();
            if response.status().is_server_error() {
                // Boxed: a server error is the rare path, and its future would enlarge every
                // request's.
                return Box::pin(release_after_server_error(claim, &policy, response)).await;
            }
            respond::capture(response, &policy)
        };
        let (stored, mut response) = capturing.await;
        let expires_at = claim.expires_at();
        // A failed completion is logged and counted by the engine; the client still gets the fresh
        // response, only without a promise that the key is remembered.
        if claim.complete(&stored).await.is_ok() {
            respond::set_expires(response.headers_mut(), expires_at);
        }
        response
    })
}

/// [`run`] in transactional mode: the handler gets the transaction the key is claimed in, and the
/// response is stored in it before it commits. See [`crate::transaction`].
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) async fn run_transactional<T, F, Fut, R>(
    txn: &Transactional<T::Store>,
    policy: &'static Policy,
    scope: String,
    request: RequestContext,
    handler: F,
) -> Response
where
    T: TxHandle,
    F: FnOnce(T) -> Fut,
    Fut: Future<Output = R>,
    R: IntoResponse,
{
    let engine = txn.engine();
    let (key, fingerprint, policy) = match keyed(engine, policy, scope, request) {
        Keyed::Key(key, fingerprint, policy) => (key, fingerprint, policy),
        Keyed::Pass => return pass_transactional(txn, policy, handler).await,
        Keyed::Answered(response) => return response,
    };
    match txn.begin(key, fingerprint, &policy).await {
        Ok(TxBegin::Execute(claim)) => execute_transactional(engine, claim, &policy, handler).await,
        Ok(TxBegin::Replay(replay)) => respond::replay(replay.response, replay.expires_at),
        Err(rejection) => problem_for(rejection).into_response(),
    }
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
async fn execute_transactional<T, F, Fut, R>(
    engine: &Engine,
    mut claim: TxClaim<T::Store>,
    policy: &Policy,
    handler: F,
) -> Response
where
    T: TxHandle,
    F: FnOnce(T) -> Fut,
    Fut: Future<Output = R>,
    R: IntoResponse,
{
    // A panic or a cancellation drops `claim` and the lent transaction: both roll back.
    let (tx, lent) = claim.tx().lend();
    let response = handler(T::from_tx(tx)).await.into_response();
    if !lent.restore(claim.tx()) {
        return kept_transaction(policy);
    }
    if response.status().is_server_error() {
        if let Err(error) = claim.rollback().await {
            tracing::debug!(target: "idem", handler = policy.handler, %error,
                "rollback after a server error failed; the connection is discarded");
        }
        return response;
    }
    let expires_at = claim.expires_at();
    let (stored, mut response) = respond::capture(response, policy).await;
    match claim.complete(&stored).await {
        Ok(()) => {
            respond::set_expires(response.headers_mut(), expires_at);
            response
        }
        // Nothing was committed: the client must not see the handler's success.
        Err(_) => not_committed(engine),
    }
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
async fn pass_transactional<T, F, Fut, R>(
    txn: &Transactional<T::Store>,
    policy: &'static Policy,
    handler: F,
) -> Response
where
    T: TxHandle,
    F: FnOnce(T) -> Fut,
    Fut: Future<Output = R>,
    R: IntoResponse,
{
    let mut open = match txn.open_unprotected(policy).await {
        Ok(open) => open,
        Err(error) => {
            tracing::warn!(target: "idem", handler = policy.handler, %error,
                "could not open a transaction for a request without a key");
            return not_committed(txn.engine());
        }
    };
    let (tx, lent) = open.tx.lend();
    let response = handler(T::from_tx(tx)).await.into_response();
    if !lent.restore(&mut open.tx) {
        return kept_transaction(policy);
    }
    if response.status().is_server_error() {
        return response; // dropping `open` rolls back
    }
    match open.commit().await {
        Ok(()) => response,
        Err(error) => {
            tracing::warn!(target: "idem", handler = policy.handler, %error,
                "could not commit a request without a key");
            not_committed(txn.engine())
        }
    }
}

/// The handler moved its transaction somewhere that outlives it (a spawned task): idem cannot
/// commit what it does not hold, so the request fails and the transaction rolls back when dropped.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
fn kept_transaction(policy: &Policy) -> Response {
    tracing::error!(target: "idem", handler = policy.handler,
        "the handler kept its idem transaction past its end; nothing was committed");
    ::axum::http::StatusCode::INTERNAL_SERVER_ERROR.into_response()
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
fn not_committed(engine: &Engine) -> Response {
    Problem::new(
        ProblemType::StoreUnavailable,
        "The request's changes could not be committed, so nothing was done. Retry with the same key after Retry-After seconds.",
    )
    .retry_after(engine.unavailable_retry_after())
    .into_response()
}

fn decide_key(
    engine: &Engine,
    policy: &Policy,
    scope: &str,
    header: KeyHeader,
    fingerprint: Fingerprint,
) -> Result<KeyDecision, Problem> {
    match header {
        KeyHeader::Valid(key) => Ok(KeyDecision::Given(key)),
        KeyHeader::Missing => missing_key(engine, policy, scope, fingerprint),
        KeyHeader::Invalid(error) => Err(malformed(engine, policy, scope, &error)),
    }
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

/// A 5xx releases the key, so that a retry runs the handler again.
async fn release_after_server_error(
    claim: ClaimGuard,
    policy: &Policy,
    response: Response,
) -> Response {
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
