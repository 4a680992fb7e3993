//! The retry decision: could another attempt succeed, and not before when?
//!
//! A [`RetryPolicy`] sees a read-only [`Attempt`] (the method, whether a key was sent, which attempt
//! this was, and what happened) and returns a [`Decision`]. It decides only whether a retry *can*
//! help; whether the client can *afford* one (attempts left, the deadline, the retry budget, the
//! `Retry-After` cap) is the client's business, so a custom policy never re-implements those limits.

use http::{HeaderMap, Method, StatusCode};
use std::borrow::Cow;
use std::time::{Duration, SystemTime};

/// The problem type idem servers answer with `409 Conflict` while the original request with the same
/// key is still running: the same key will succeed later, so the client retries it (after the
/// answer's `Retry-After`, if any). Any other 409 is final.
pub const REQUEST_IN_FLIGHT: &str = "urn:idem:problem:in-flight";
/// The problem type of idem's `422`: the key was already used for a different request.
pub const KEY_MISMATCH: &str = "urn:idem:problem:key-mismatch";
/// The problem type of idem's `410`: the key is past its retention; its result is no longer known.
pub const KEY_EXPIRED: &str = "urn:idem:problem:key-expired";

/// An idem server's answer that the request's key can no longer be used: sending the same request
/// again under this key is refused every time, so the client returns it at once. Read it with
/// [`Response::dead_key`](super::Response::dead_key); no JSON to parse.
///
/// Both mean "decide whether to send again under a **new** key", and neither is decided by the
/// client, because only the caller knows whether the effect may already have happened:
///
/// ```no_run
/// # async fn run(client: idem_runtime::client::Client, order: u64) -> Result<(), Box<dyn std::error::Error>> {
/// use idem_runtime::client::DeadKey;
///
/// let response = client.post("http://127.0.0.1:3000/payments").send().await?;
/// match response.dead_key() {
///     // The key was reused for another body, method or path: a bug in how keys are made.
///     // The first request under it may have been charged: fix the key, don't resend blindly.
///     Some(DeadKey::Mismatch) => return Err(format!("order {order}: key reused").into()),
///     // The server no longer knows what happened under this key. Look (GET the order's
///     // payments); send again under a new key only if the payment is not there.
///     Some(DeadKey::Expired) => { /* reconcile, then maybe resend with a new key */ }
///     _ => { /* any other answer: read the status as usual */ }
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadKey {
    /// `422` [`KEY_MISMATCH`]: the key was used for a different request (another body, method or
    /// path). Retrying it never succeeds; the request first sent under it may have taken effect.
    Mismatch,
    /// `410` [`KEY_EXPIRED`]: the key outlived the server's retention, so whether the request
    /// first sent under it took effect is no longer known.
    Expired,
}

impl DeadKey {
    /// Recognises idem's answer by status and problem type.
    pub(crate) fn from_answer(status: StatusCode, problem_type: Option<&str>) -> Option<Self> {
        match (status, problem_type?) {
            (StatusCode::UNPROCESSABLE_ENTITY, KEY_MISMATCH) => Some(Self::Mismatch),
            (StatusCode::GONE, KEY_EXPIRED) => Some(Self::Expired),
            _ => None,
        }
    }
}

/// Why an attempt got no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TransportFailure {
    /// The connection could not be made: the request never left.
    Connect,
    /// No answer in time (the attempt timeout, or a timeout inside reqwest).
    Timeout,
    /// The request was sent (perhaps processed) but the connection ended before a complete answer.
    Interrupted,
    /// Anything else (a redirect loop, a body that failed to stream, ...): not worth retrying.
    Other,
}

/// What one attempt ended with.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Outcome<'a> {
    /// The server answered with a status line and headers.
    Answered {
        /// The answer's status.
        status: StatusCode,
        /// The answer's headers.
        headers: &'a HeaderMap,
        /// The `type` of an `application/problem+json` body (RFC 9457), if the answer is one.
        problem_type: Option<&'a str>,
    },
    /// No (complete) answer.
    NoAnswer(TransportFailure),
}

/// A read-only view of the attempt that just ended, handed to [`RetryPolicy::decide`].
///
/// ```
/// use idem_runtime::client::{Attempt, Outcome, TransportFailure};
/// use idem_runtime::http::Method;
///
/// let attempt = Attempt::new(&Method::POST, 1, true, Outcome::NoAnswer(TransportFailure::Timeout));
/// assert_eq!(attempt.number(), 1);
/// assert!(attempt.has_key());
/// assert_eq!(attempt.status(), None);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Attempt<'a> {
    method: &'a Method,
    number: u32,
    has_key: bool,
    outcome: Outcome<'a>,
    received_at: SystemTime,
}

impl<'a> Attempt<'a> {
    /// A view of attempt `number` (1 for the first) of a `method` request, sent with or without an
    /// `Idempotency-Key`. The wall-clock time of the answer (used for `Retry-After` dates) is now;
    /// see [`at`](Self::at).
    pub fn new(method: &'a Method, number: u32, has_key: bool, outcome: Outcome<'a>) -> Self {
        Self {
            method,
            number,
            has_key,
            outcome,
            received_at: SystemTime::now(),
        }
    }

    /// The same view with the answer received at `when` (for `Retry-After` given as an HTTP date).
    pub fn at(mut self, when: SystemTime) -> Self {
        self.received_at = when;
        self
    }

    /// The request's method.
    pub fn method(&self) -> &Method {
        self.method
    }

    /// Which attempt this was: 1 for the first.
    pub fn number(&self) -> u32 {
        self.number
    }

    /// Whether the request carried an `Idempotency-Key`.
    pub fn has_key(&self) -> bool {
        self.has_key
    }

    /// What happened.
    pub fn outcome(&self) -> Outcome<'a> {
        self.outcome
    }

    /// The answer's status, if there was an answer.
    pub fn status(&self) -> Option<StatusCode> {
        match self.outcome {
            Outcome::Answered { status, .. } => Some(status),
            Outcome::NoAnswer(_) => None,
        }
    }

    /// The answer's problem type, if it is a problem document.
    pub fn problem_type(&self) -> Option<&'a str> {
        match self.outcome {
            Outcome::Answered { problem_type, .. } => problem_type,
            Outcome::NoAnswer(_) => None,
        }
    }

    /// The answer's `Retry-After`, as a wait from when the answer arrived; `None` without an answer,
    /// without the header, or if it is neither seconds nor an HTTP date.
    pub fn retry_after(&self) -> Option<Duration> {
        match self.outcome {
            Outcome::Answered { headers, .. } => {
                let value = headers.get(http::header::RETRY_AFTER)?;
                parse_retry_after(value.to_str().ok()?, self.received_at)
            }
            Outcome::NoAnswer(_) => None,
        }
    }
}

/// Whether to try again.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
    /// Another attempt may succeed; wait at least `not_before` (the server's `Retry-After`) before it.
    /// The client adds its own backoff and checks its limits first.
    Retry {
        /// The least the server asked the client to wait, if it said.
        not_before: Option<Duration>,
    },
    /// Final: an answer goes back to the caller as is; a missing answer becomes an [`Error`](super::Error)
    /// that carries `reason`.
    Stop {
        /// Why no retry (shown in the error when there was no answer).
        reason: Cow<'static, str>,
    },
}

impl Decision {
    /// A stop with a fixed reason.
    pub const fn stop(reason: &'static str) -> Self {
        Self::Stop {
            reason: Cow::Borrowed(reason),
        }
    }
}

/// Decides whether an attempt is worth repeating. Implement it for a custom rule, or pass a closure
/// `Fn(&Attempt<'_>) -> Decision`.
///
/// ```
/// use idem_runtime::client::{Attempt, Client, Decision, DefaultPolicy, RetryPolicy};
/// use idem_runtime::http::StatusCode;
///
/// // Also retry 425 Too Early; otherwise the default rules.
/// let policy = |attempt: &Attempt<'_>| match attempt.status() {
///     Some(StatusCode::TOO_EARLY) => Decision::Retry { not_before: attempt.retry_after() },
///     _ => DefaultPolicy.decide(attempt),
/// };
/// let client = Client::builder().policy(policy).build()?;
/// # let _ = client;
/// # Ok::<(), idem_runtime::client::reqwest::Error>(())
/// ```
pub trait RetryPolicy: Send + Sync + 'static {
    /// The decision for the attempt that just ended.
    fn decide(&self, attempt: &Attempt<'_>) -> Decision;
}

impl<F> RetryPolicy for F
where
    F: Fn(&Attempt<'_>) -> Decision + Send + Sync + 'static,
{
    fn decide(&self, attempt: &Attempt<'_>) -> Decision {
        self(attempt)
    }
}

/// The rules of idem's client, which retry only what may succeed later:
///
/// | what happened                                              | decision |
/// |------------------------------------------------------------|----------|
/// | a method other than GET, HEAD, OPTIONS, TRACE, PUT, DELETE sent **without** a key (POST, PATCH) | stop: it may have run, and a second run is a second effect |
/// | no connection, a timeout, or the connection lost before a complete answer (the body included, when the client reads it: see [`ClientBuilder::max_buffered_body`](super::ClientBuilder::max_buffered_body)) | retry |
/// | any other transport error (redirect loop, a request body that failed to stream) | stop |
/// | 500, 502, 503, 504, 408                                    | retry after `Retry-After` if given |
/// | 429                                                        | retry after `Retry-After` if given |
/// | 409 with problem type [`REQUEST_IN_FLIGHT`]                | retry after `Retry-After` if given (the original is still running) |
/// | any other answer: 2xx, 3xx, 400, 401, 403, 404, 409 otherwise, 410, 422, other 4xx and 5xx | stop: the answer is final (idem's 422 and 410 as a [`DeadKey`]) |
///
/// A keyless POST is stopped even on a connect error (which did not send it) to keep one simple
/// rule; a custom policy can relax that.
///
/// ```
/// use idem_runtime::client::{Attempt, Decision, DefaultPolicy, Outcome, RetryPolicy};
/// use idem_runtime::http::{HeaderMap, Method, StatusCode};
///
/// let mut headers = HeaderMap::new();
/// headers.insert("retry-after", "2".parse().unwrap());
/// let answered = |status| Outcome::Answered { status, headers: &headers, problem_type: None };
///
/// let busy = Attempt::new(&Method::POST, 1, true, answered(StatusCode::SERVICE_UNAVAILABLE));
/// assert_eq!(
///     DefaultPolicy.decide(&busy),
///     Decision::Retry { not_before: Some(std::time::Duration::from_secs(2)) }
/// );
/// let invalid = Attempt::new(&Method::POST, 1, true, answered(StatusCode::UNPROCESSABLE_ENTITY));
/// assert!(matches!(DefaultPolicy.decide(&invalid), Decision::Stop { .. }));
/// let keyless = Attempt::new(&Method::POST, 1, false, answered(StatusCode::SERVICE_UNAVAILABLE));
/// assert!(matches!(DefaultPolicy.decide(&keyless), Decision::Stop { .. }));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultPolicy;

impl RetryPolicy for DefaultPolicy {
    fn decide(&self, attempt: &Attempt<'_>) -> Decision {
        if !attempt.has_key() && !is_idempotent(attempt.method()) {
            return Decision::stop(
                "a request that is not idempotent by its method (POST, PATCH) is retried only with an Idempotency-Key",
            );
        }
        match attempt.outcome() {
            Outcome::NoAnswer(
                TransportFailure::Connect
                | TransportFailure::Timeout
                | TransportFailure::Interrupted,
            ) => Decision::Retry { not_before: None },
            Outcome::NoAnswer(_) => Decision::stop("the request could not be sent"),
            Outcome::Answered {
                status,
                problem_type,
                ..
            } => {
                let retry = match status {
                    StatusCode::INTERNAL_SERVER_ERROR
                    | StatusCode::BAD_GATEWAY
                    | StatusCode::SERVICE_UNAVAILABLE
                    | StatusCode::GATEWAY_TIMEOUT
                    | StatusCode::REQUEST_TIMEOUT
                    | StatusCode::TOO_MANY_REQUESTS => true,
                    StatusCode::CONFLICT => problem_type == Some(REQUEST_IN_FLIGHT),
                    _ => false,
                };
                if retry {
                    Decision::Retry {
                        not_before: attempt.retry_after(),
                    }
                } else {
                    Decision::stop("the answer is final")
                }
            }
        }
    }
}

/// Methods that mean the same thing sent twice (RFC 9110 §9.2.2), so they are retried without a key.
pub(crate) fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Parses a `Retry-After` value: delay-seconds (`"120"`) or an HTTP date, which counts from `now`
/// (a date in the past means "now"). `None` for anything else.
///
/// ```
/// use idem_runtime::client::parse_retry_after;
/// use std::time::{Duration, SystemTime, UNIX_EPOCH};
///
/// let now = UNIX_EPOCH + Duration::from_secs(784_111_777); // Sun, 06 Nov 1994 08:49:37 GMT
/// assert_eq!(parse_retry_after("1", now), Some(Duration::from_secs(1)));
/// assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:49:47 GMT", now), Some(Duration::from_secs(10)));
/// assert_eq!(parse_retry_after("soon", now), None);
/// ```
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // More digits than a u64 holds is still "a very long time": saturate, the cap decides.
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    fn decide(method: Method, has_key: bool, outcome: Outcome<'_>) -> Decision {
        DefaultPolicy.decide(&Attempt::new(&method, 1, has_key, outcome))
    }

    fn answered(status: u16, headers: &HeaderMap, problem: Option<&str>) -> Decision {
        let status = StatusCode::from_u16(status).unwrap();
        decide(
            Method::POST,
            true,
            Outcome::Answered {
                status,
                headers,
                problem_type: problem,
            },
        )
    }

    fn is_retry(d: &Decision) -> bool {
        matches!(d, Decision::Retry { .. })
    }

    #[test]
    fn retries_only_answers_that_may_change() {
        let h = HeaderMap::new();
        for s in [500, 502, 503, 504, 408, 429] {
            assert!(is_retry(&answered(s, &h, None)), "{s} is retried");
        }
        for s in [
            200, 201, 204, 301, 400, 401, 403, 404, 405, 410, 413, 422, 501, 505,
        ] {
            assert!(!is_retry(&answered(s, &h, None)), "{s} is final");
        }
    }

    #[test]
    fn a_conflict_is_retried_only_while_in_flight() {
        let h = HeaderMap::new();
        assert!(is_retry(&answered(409, &h, Some(REQUEST_IN_FLIGHT))));
        assert!(!is_retry(&answered(409, &h, None)));
        assert!(!is_retry(&answered(
            409,
            &h,
            Some("urn:idem:problem:key-mismatch")
        )));
    }

    #[test]
    fn dead_keys_need_idems_status_and_problem_type() {
        let dead = DeadKey::from_answer;
        assert_eq!(
            dead(StatusCode::UNPROCESSABLE_ENTITY, Some(KEY_MISMATCH)),
            Some(DeadKey::Mismatch)
        );
        assert_eq!(
            dead(StatusCode::GONE, Some(KEY_EXPIRED)),
            Some(DeadKey::Expired)
        );
        assert_eq!(dead(StatusCode::UNPROCESSABLE_ENTITY, None), None);
        assert_eq!(dead(StatusCode::GONE, Some(KEY_MISMATCH)), None);
        assert_eq!(
            dead(StatusCode::UNPROCESSABLE_ENTITY, Some("about:blank")),
            None
        );
    }

    #[test]
    fn retry_after_is_passed_on() {
        let mut h = HeaderMap::new();
        h.insert("retry-after", "7".parse().unwrap());
        assert_eq!(
            answered(429, &h, None),
            Decision::Retry {
                not_before: Some(Duration::from_secs(7))
            }
        );
        assert_eq!(
            answered(409, &h, Some(REQUEST_IN_FLIGHT)),
            Decision::Retry {
                not_before: Some(Duration::from_secs(7))
            }
        );
    }

    #[test]
    fn keyless_requests_are_retried_only_for_idempotent_methods() {
        let failure = Outcome::NoAnswer(TransportFailure::Interrupted);
        for m in [Method::POST, Method::PATCH] {
            assert!(!is_retry(&decide(m.clone(), false, failure)), "{m}");
            assert!(is_retry(&decide(m, true, failure)));
        }
        for m in [
            Method::GET,
            Method::HEAD,
            Method::OPTIONS,
            Method::PUT,
            Method::DELETE,
        ] {
            assert!(is_retry(&decide(m.clone(), false, failure)), "{m}");
        }
    }

    #[test]
    fn transport_failures() {
        for f in [
            TransportFailure::Connect,
            TransportFailure::Timeout,
            TransportFailure::Interrupted,
        ] {
            assert!(is_retry(&decide(Method::GET, false, Outcome::NoAnswer(f))));
        }
        assert!(!is_retry(&decide(
            Method::GET,
            false,
            Outcome::NoAnswer(TransportFailure::Other)
        )));
    }

    #[test]
    fn retry_after_forms() {
        let now = UNIX_EPOCH + Duration::from_secs(784_111_777);
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(
            parse_retry_after("99999999999999999999999", now),
            Some(Duration::from_secs(u64::MAX))
        );
        // Past dates mean "now"; all three HTTP date forms are accepted.
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:27 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(
            parse_retry_after("Sunday, 06-Nov-94 08:49:47 GMT", now),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            parse_retry_after("Sun Nov  6 08:49:47 1994", now),
            Some(Duration::from_secs(10))
        );
        for bad in ["", "-1", "1.5", "tomorrow"] {
            assert_eq!(parse_retry_after(bad, now), None, "{bad:?}");
        }
    }
}
