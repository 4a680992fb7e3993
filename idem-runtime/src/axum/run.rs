//! One protected request, from the `Idempotency-Key` header to the response.
//!
//! 1. Safe methods (GET, HEAD, OPTIONS, TRACE) pass through untouched: they have no effect to
//!    protect, and a repeated GET must read the current state, not a stored one.
//! 2. The key: every `Idempotency-Key` header value is read; one valid value is the key, two headers
//!    or a malformed value answer 400. Without a key the policy's
//!    [`missing_key`](crate::Policy::missing_key) decides: reject (400), pass (run unprotected, counted,
//!    until `reject_after`), or derive a key from the request, valid for `derive_window`.
//! 3. The engine decides with the request's fingerprint: execute, replay, or a problem
//!    (422 / 409 / 410 / 503, see [`problem`](super::problem)).
//! 4. Execute: the handler's last parameter is extracted from the buffered body (its rejection
//!    releases the key and is the answer; a replay never runs it), and the handler runs **in a
//!    task of its own** ([`Engine::spawn`]), with the claim's lease renewed, so that a client
//!    hanging up, or a handler slower than the lease, never cuts it half-way or lets a duplicate
//!    run it again. A 5xx releases the key (unless the policy stores
//!    server errors); anything else is stored, retried until the store takes it, and replayed. A
//!    panic releases the key and answers 500.
//!
//! Each run ends with a [`Finish`] step: the default stores the response; in transactional mode
//! ([`super::transactional`]) the handler's transaction, if it began one, is committed with the
//! stored response, a 5xx or a panic rolls it back, and a failed commit answers 503 instead of the
//! handler's response.

use super::problem::{Problem, ProblemType};
use super::request::{Deferred, KeyHeader, RequestContext};
use super::respond;
use super::Attempt;
use super::RequestOutcome;
use crate::clock::Timestamp;
use crate::engine::{Begin, ClaimGuard, Engine, Rejection};
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, KeyError};
use crate::metrics::Outcome;
use crate::policy::{ClientErrors, MissingKey, Policy, ServerErrors};
use crate::record::{RecordKey, StoredResponse};
use crate::source::KeySource;
use crate::store::StoreErrorKind;
use ::axum::http::StatusCode;
use ::axum::response::{IntoResponse, Response};
use futures_util::FutureExt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use tokio::sync::oneshot;

/// What the request's headers and the policy say about the key.
enum KeyDecision {
    /// The client's key.
    Given(IdempotencyKey),
    /// No key; one derived from the request (its fingerprint, in hex), under the derive-window
    /// policy.
    Derived(String),
    /// No key; run unprotected.
    Pass,
}

/// The policy a request runs under: the attribute's constant, or one shared by reference count
/// (the layer's, or a derived key's derive-window variant of the handler's).
pub(crate) enum KeyPolicy {
    Static(&'static Policy),
    Shared(Arc<Policy>),
}

impl std::ops::Deref for KeyPolicy {
    type Target = Policy;

    fn deref(&self) -> &Policy {
        match self {
            KeyPolicy::Static(policy) => policy,
            KeyPolicy::Shared(policy) => policy,
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
fn keyed(engine: &Engine, policy: KeyPolicy, scope: String, request: &RequestContext) -> Keyed {
    if request.safe_method {
        return Keyed::Pass;
    }
    let (fingerprint, header) = request.resolve(&policy);
    match decide_key(engine, &policy, &scope, &header, fingerprint) {
        Ok(KeyDecision::Given(key)) => Keyed::Key(
            RecordKey::sourced(scope, &policy.key_source, key.as_str()),
            fingerprint,
            policy,
        ),
        // The derived key lives for the window only and leaves no tombstone: after the window,
        // the same request is a new request, not an expired key.
        Ok(KeyDecision::Derived(key)) => Keyed::Key(
            RecordKey::derived(scope, &key),
            fingerprint,
            KeyPolicy::Shared(Arc::new(
                policy
                    .ttl(policy.derive_window)
                    .retain(policy.derive_window),
            )),
        ),
        Ok(KeyDecision::Pass) => Keyed::Pass,
        Err(problem) => Keyed::Answered(problem.into_response()),
    }
}

/// How a claimed run ends once its handler has answered. The default ([`()`]) stores the response
/// after the client has it, retrying until the store takes it; transactional mode commits it with
/// the handler's writes ([`super::transactional`]).
pub(crate) trait Finish: Send + Sized + 'static {
    /// Takes back what the handler was lent (its transaction); false (and logged) if the handler
    /// kept it past its end, which fails the request.
    fn take_back(&mut self) -> bool {
        true
    }

    /// Throws away what the handler wrote (a 5xx, a refused body, a panic).
    fn discard(self) {}

    /// The response of a request that ran unprotected (no key, `missing_key = "pass"`).
    fn pass(self, response: Response) -> impl Future<Output = Response> + Send {
        std::future::ready(response)
    }

    /// Settles a response to store: by default, stored once the client has it.
    fn settle(
        self,
        guard: ClaimGuard,
        stored: StoredResponse,
        response: Response,
    ) -> impl Future<Output = Settled> + Send {
        std::future::ready(Settled::Later(Box::new((guard, stored, response))))
    }
}

impl Finish for () {}

/// Claims the key, then extracts the handler's last parameter and runs `handler` with it, detached
/// from the request, and ends with `finish` (see the module documentation).
pub(crate) async fn run<B, F, Fut, R, Fin>(
    engine: Engine,
    policy: KeyPolicy,
    scope: String,
    request: RequestContext,
    last: Deferred<B>,
    handler: F,
    finish: Fin,
) -> Response
where
    B: Send + 'static,
    F: FnOnce(B) -> Fut + Send + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoResponse,
    Fin: Finish,
{
    let (key, fingerprint, policy) = match keyed(&engine, policy, scope, &request) {
        Keyed::Key(key, fingerprint, policy) => (key, fingerprint, policy),
        Keyed::Pass => {
            let response = unprotected(last, handler, finish).await;
            return RequestOutcome::Unprotected.mark(response);
        }
        Keyed::Answered(response) => return response,
    };
    let guard = match claim(&engine, key, fingerprint, &policy, request.attempt).await {
        Ok(guard) => guard,
        Err(answer) => return answer,
    };
    detached(&engine, async move {
        let mut finish = finish;
        let run = AssertUnwindSafe(async move {
            let last = last.now().await?;
            Ok(handler(last).await.into_response())
        });
        let response = match guard.keep_alive(run.catch_unwind()).await {
            Ok(Ok(response)) => response,
            Ok(Err(rejection)) => {
                finish.discard();
                return Settled::Now(released(guard, &policy, rejection).await);
            }
            Err(_) => {
                // Rolled back (on SQLite, the write gate freed) before the release, which needs it.
                finish.discard();
                return Settled::Now(panicked(guard, &policy).await);
            }
        };
        if !finish.take_back() {
            return Settled::Now(panicked(guard, &policy).await);
        }
        let status = response.status();
        if status.is_client_error() && policy.client_errors == ClientErrors::Release {
            finish.discard();
            return Settled::Now(released(guard, &policy, response).await);
        }
        if status.is_server_error() {
            finish.discard();
            if policy.server_errors == ServerErrors::Release {
                return Settled::Now(released(guard, &policy, response).await);
            }
            let (stored, response) = guard.keep_alive(respond::capture(response, &policy)).await;
            return Settled::Later(Box::new((guard, stored, response)));
        }
        let (stored, response) = guard.keep_alive(respond::capture(response, &policy)).await;
        finish.settle(guard, stored, response).await
    })
    .await
}

/// A request run without a key: the handler, then `finish`'s pass step.
async fn unprotected<B, F, Fut, R, Fin>(last: Deferred<B>, handler: F, mut finish: Fin) -> Response
where
    F: FnOnce(B) -> Fut,
    Fut: Future<Output = R>,
    R: IntoResponse,
    Fin: Finish,
{
    let last = match last.now().await {
        Ok(last) => last,
        Err(rejection) => return rejection,
    };
    let response = handler(last).await.into_response();
    if !finish.take_back() {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    finish.pass(response).await
}

/// How a detached run ends: with its response settled, or with a response still to store.
pub(crate) enum Settled {
    Now(Response),
    Later(Box<(ClaimGuard, StoredResponse, Response)>),
}

/// Runs `work` on the engine's task set and answers with its response. A response still to be
/// stored is sent to the client once the first attempt to store it is over, landed or not: the
/// effect happened, so the client learns of it, and the task keeps storing it for the retry.
async fn detached<W>(engine: &Engine, work: W) -> Response
where
    W: Future<Output = Settled> + Send + 'static,
{
    let (reply, answer) = oneshot::channel();
    // Boxed: the task then holds a pointer, not the handler's whole state, which spawning would
    // copy several times over.
    engine.spawn(Box::pin(async move {
        let (guard, stored, response) = match work.await {
            Settled::Now(response) => {
                return drop(reply.send(RequestOutcome::Executed.mark(response)))
            }
            Settled::Later(later) => *later,
        };
        let mut response = RequestOutcome::Executed.mark(response);
        match guard.try_complete(&stored).await {
            Ok(()) => {
                respond::set_expires(response.headers_mut(), guard.expires_at());
                guard.settle();
                let _ = reply.send(response);
            }
            Err(e) if matches!(e.kind(), StoreErrorKind::Unavailable | StoreErrorKind::Busy) => {
                let _ = reply.send(response);
                let key = guard.key().clone();
                if let Err(error) = guard.complete(&stored).await {
                    tracing::error!(target: "idem", scope = %key.scope(), key = %key.key(), %error,
                        "the response was never stored");
                }
            }
            // Taken over or corrupt: nothing to retry; the client still gets what happened.
            Err(_) => {
                guard.settle();
                let _ = reply.send(response);
            }
        }
    }));
    // The task answers unless the runtime shuts down under it.
    answer
        .await
        .unwrap_or_else(|_| StatusCode::SERVICE_UNAVAILABLE.into_response())
}

/// The engine's decision: a claim to run, or the answer (a replay or a problem).
async fn claim(
    engine: &Engine,
    key: RecordKey,
    fingerprint: Fingerprint,
    policy: &Policy,
    attempt: Option<Attempt>,
) -> Result<ClaimGuard, Response> {
    match engine.begin(key, fingerprint, policy).await {
        Ok(Begin::Execute(guard)) => {
            if let Some(attempt) = attempt {
                attempt.set(&guard);
            }
            Ok(guard)
        }
        Ok(Begin::Replay(replay)) => Err(respond::replay(replay.response, replay.expires_at)),
        Err(rejection) => Err(problem_for(rejection).into_response()),
    }
}

/// A handler that panicked (or kept its transaction): the key is released and the client gets a
/// plain 500, as from any handler that panics.
async fn panicked(guard: ClaimGuard, policy: &Policy) -> Response {
    let key = guard.key().clone();
    if let Err(error) = guard.release().await {
        tracing::warn!(target: "idem", handler = policy.handler, scope = %key.scope(),
            key = %key.key(), %error, "could not release the key after a panic; a retry can run once its lease runs out");
    }
    RequestOutcome::Released.mark(StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn decide_key(
    engine: &Engine,
    policy: &Policy,
    scope: &str,
    header: &KeyHeader,
    fingerprint: Fingerprint,
) -> Result<KeyDecision, Problem> {
    match header {
        KeyHeader::Valid(key) => Ok(KeyDecision::Given(key.clone())),
        KeyHeader::Missing => missing_key(engine, policy, scope, fingerprint),
        KeyHeader::Invalid(error) => Err(malformed(engine, policy, scope, error)),
    }
}

fn malformed(engine: &Engine, policy: &Policy, scope: &str, error: &KeyError) -> Problem {
    engine
        .metrics()
        .record(Outcome::MalformedKey, policy.handler);
    // The value itself is not logged: it is client-controlled and, being malformed, possibly huge.
    tracing::info!(target: "idem", outcome = Outcome::MalformedKey.as_str(),
        handler = policy.handler, %scope, %error, "idempotency decision");
    let detail = match policy.key_source {
        KeySource::IdempotencyKey => format!("{error}. A key is 1 to 255 visible ASCII characters, sent in one Idempotency-Key header, bare or as a quoted string."),
        KeySource::BodyField(_) => {
            let source = policy.key_source.describe();
            let error = error.to_string().replacen("the Idempotency-Key", &format!("the key in {source}"), 1);
            format!("{error}. This endpoint reads its key from {source}: a string of 1 to 255 visible ASCII characters, or an integer.")
        }
        _ => {
            let source = policy.key_source.describe();
            let error = error.to_string().replacen("the Idempotency-Key", &format!("the key in {source}"), 1);
            format!("{error}. This endpoint reads its key from {source}: 1 to 255 visible ASCII characters, sent once, bare or as a quoted string.")
        }
    };
    Problem::new(ProblemType::MalformedKey, detail)
}

fn missing_key(
    engine: &Engine,
    policy: &Policy,
    scope: &str,
    fingerprint: Fingerprint,
) -> Result<KeyDecision, Problem> {
    let note = |outcome: Outcome| {
        engine.metrics().record(outcome, policy.handler);
        tracing::info!(target: "idem", outcome = outcome.as_str(), handler = policy.handler,
            %scope, "idempotency decision");
    };
    let deadline = policy
        .reject_after_ms
        .filter(|at| engine.now().as_millis() >= *at);
    match (policy.missing_key, deadline) {
        (MissingKey::Derive, _) => {
            note(Outcome::KeyDerived);
            Ok(KeyDecision::Derived(fingerprint.to_hex()))
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
        (MissingKey::Reject, _) if policy.key_source != KeySource::IdempotencyKey => {
            note(Outcome::MissingKeyRejected);
            Err(Problem::new(
                ProblemType::MissingKey,
                format!("This endpoint reads its idempotency key from {}, which this request lacks: send it, and keep it the same when retrying the same request.", policy.key_source.describe()),
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

/// A 5xx, or a rejection by the handler's last extractor, releases the key, so that a retry runs
/// the handler again; `response` is the answer.
async fn released(claim: ClaimGuard, policy: &Policy, response: Response) -> Response {
    let key = claim.key().clone();
    match claim.release().await {
        Ok(()) => {}
        // Another request took the key over after this one's lease ran out: it is theirs now.
        Err(error) if error.kind() == StoreErrorKind::Fenced => {
            tracing::debug!(target: "idem", handler = policy.handler, scope = %key.scope(),
                key = %key.key(), "the key was taken over before it could be released");
        }
        Err(error) => {
            tracing::warn!(target: "idem", handler = policy.handler, scope = %key.scope(),
                key = %key.key(), %error, status = response.status().as_u16(), "could not release the key; a retry can run once its lease runs out");
        }
    }
    RequestOutcome::Released.mark(response)
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
        Rejection::Unavailable {
            retry_after,
            source,
        } if source.kind() == StoreErrorKind::Busy => Problem::new(
            ProblemType::Busy,
            "The server has no capacity for this request right now, so it was not processed. Retry with the same key after Retry-After seconds.",
        )
        .retry_after(retry_after),
        Rejection::Unavailable { retry_after, .. } => Problem::new(
            ProblemType::StoreUnavailable,
            "The idempotency store could not be reached, so the request was not processed. Retry with the same key after Retry-After seconds.",
        )
        .retry_after(retry_after),
    }
}
