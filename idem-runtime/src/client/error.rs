//! The one error a request returns when no attempt succeeded.
//!
//! Three attempts that each failed with "503 Service Unavailable" are one cause seen three times, not
//! three errors: causes are collapsed by kind and message, in the order first seen, with a count.

use super::policy::TransportFailure;
use crate::IdempotencyKey;
use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use std::borrow::Cow;
use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

/// Why the client stopped trying.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// Every allowed attempt was made.
    AttemptsExhausted {
        /// The limit (at least 1).
        max_attempts: u32,
    },
    /// The overall deadline passed, or the next wait would have passed it.
    Deadline {
        /// The configured deadline.
        deadline: Duration,
        /// The server's `Retry-After`, when waiting for it is what would have passed the deadline.
        retry_after: Option<Duration>,
    },
    /// The shared retry budget is empty: failing fast instead of adding load to a failing server.
    BudgetExhausted,
    /// The server asked to wait (`Retry-After`) longer than the client's cap.
    RetryAfterTooLong {
        /// What the server asked for.
        requested: Duration,
        /// The cap ([`ClientBuilder::max_retry_after`](super::ClientBuilder::max_retry_after)).
        cap: Duration,
    },
    /// The policy judged the failure not worth retrying.
    NotRetryable {
        /// The policy's reason.
        reason: Cow<'static, str>,
    },
    /// The body is a stream that cannot be sent twice.
    BodyNotReplayable,
    /// The request could not be built (a bad URL or header); nothing was sent.
    InvalidRequest,
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AttemptsExhausted { max_attempts } => {
                let plural = if *max_attempts == 1 { "" } else { "s" };
                write!(
                    f,
                    "gave up after the maximum of {max_attempts} attempt{plural}"
                )
            }
            Self::Deadline {
                deadline,
                retry_after: Some(wait),
            } => write!(
                f,
                "the server asked to wait {wait:?} (Retry-After), past the deadline of {deadline:?}"
            ),
            Self::Deadline { deadline, .. } => {
                write!(f, "no time left before the deadline of {deadline:?}")
            }
            Self::BudgetExhausted => f.write_str("the retry budget is exhausted (failing fast)"),
            Self::RetryAfterTooLong { requested, cap } => write!(
                f,
                "the server asked to wait {requested:?}, more than the cap of {cap:?}"
            ),
            Self::NotRetryable { reason } => write!(f, "not retried: {reason}"),
            Self::BodyNotReplayable => {
                f.write_str("not retried: the body is a stream and cannot be sent again")
            }
            Self::InvalidRequest => f.write_str("the request could not be built"),
        }
    }
}

/// What kind of failure a [`Cause`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CauseKind {
    /// No (complete) answer.
    Transport(TransportFailure),
    /// An answer with this status.
    Status(StatusCode),
    /// The request was invalid before any attempt.
    Invalid,
}

/// One distinct failure, and how many attempts ended with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cause {
    kind: CauseKind,
    message: String,
    count: u32,
}

impl Cause {
    /// The kind of failure.
    pub fn kind(&self) -> CauseKind {
        self.kind
    }

    /// What went wrong, e.g. `503 Service Unavailable` or `connection closed before message completed`.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// How many attempts ended this way.
    pub fn count(&self) -> u32 {
        self.count
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (x{})", self.message, self.count)
    }
}

/// The last answer a failed request got: what the server said, for logs and for a person to read
/// (an RFC 9457 problem document, typically).
///
/// The body is kept when it fit in the client's buffer
/// ([`ClientBuilder::max_buffered_body`](super::ClientBuilder::max_buffered_body), 1 MiB by
/// default); a longer one is not kept (the body is then empty).
#[derive(Debug, Clone)]
pub struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    pub(crate) problem_type: Option<String>,
}

impl Answer {
    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The headers.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The `type` of an `application/problem+json` body, if the answer is one.
    pub fn problem_type(&self) -> Option<&str> {
        self.problem_type.as_deref()
    }
}

/// Every attempt of a request failed (or none could be made).
///
/// It names the request, the `Idempotency-Key` (log it: a later retry with the same key is safe),
/// the number of attempts, why the client stopped, and the distinct causes with their counts:
///
/// ```text
/// POST http://127.0.0.1:3000/payments failed after 3 attempts (Idempotency-Key 5b3c…): gave up
/// after the maximum of 3 attempts; causes: connection closed before message completed (x1),
/// 503 Service Unavailable (x2)
/// ```
///
/// [`last_answer`](Self::last_answer) keeps the last answer's status, headers and body (the
/// problem detail); [`source`](StdError::source) is the last transport error, if the last attempt
/// ended without an answer.
///
/// ```no_run
/// # async fn run() {
/// use idem_runtime::client::{Client, StopReason};
///
/// let client = Client::builder().build().unwrap();
/// match client.post("http://127.0.0.1:3000/payments").send().await {
///     Ok(response) => println!("{} after {} attempts", response.status(), response.attempts()),
///     Err(error) => {
///         eprintln!("{error}");
///         if let Some(answer) = error.last_answer() {
///             eprintln!("the server said: {}", String::from_utf8_lossy(answer.body()));
///         }
///         if matches!(error.stop_reason(), StopReason::BudgetExhausted) {
///             // the dependency is down: degrade instead of queueing more work
///         }
///     }
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct Error {
    method: Method,
    url: Option<reqwest::Url>,
    key: Option<IdempotencyKey>,
    attempts: u32,
    stop: StopReason,
    causes: Vec<Cause>,
    last_status: Option<StatusCode>,
    last_answer: Option<Box<Answer>>,
    source: Option<Box<dyn StdError + Send + Sync>>,
}

impl Error {
    /// The request's method.
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The request's URL, if it was valid.
    pub fn url(&self) -> Option<&reqwest::Url> {
        self.url.as_ref()
    }

    /// The key sent on every attempt (`None` if keys were disabled for this request).
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }

    /// How many attempts were made (0 if the request could not be built).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Why the client stopped.
    pub fn stop_reason(&self) -> &StopReason {
        &self.stop
    }

    /// The distinct causes, in the order first seen; the counts add up to [`attempts`](Self::attempts).
    pub fn causes(&self) -> &[Cause] {
        &self.causes
    }

    /// The status of the last attempt's answer, if the last attempt got one.
    pub fn last_status(&self) -> Option<StatusCode> {
        self.last_status
    }

    /// The latest answer any attempt got, with its headers and body (later attempts may have
    /// ended without one: see [`causes`](Self::causes)).
    pub fn last_answer(&self) -> Option<&Answer> {
        self.last_answer.as_deref()
    }

    /// This client's error inside an error of a `reqwest_middleware` client stack, when the
    /// [`RetryMiddleware`](super::RetryMiddleware) returned it; the error as it was otherwise.
    #[cfg(feature = "client-middleware")]
    #[cfg_attr(docsrs, doc(cfg(feature = "client-middleware")))]
    pub fn from_middleware(
        error: reqwest_middleware::Error,
    ) -> Result<Self, reqwest_middleware::Error> {
        match error {
            reqwest_middleware::Error::Middleware(e) => e
                .downcast::<Self>()
                .map_err(reqwest_middleware::Error::Middleware),
            other => Err(other),
        }
    }

    /// Whether the client stopped at the deadline.
    pub fn is_deadline(&self) -> bool {
        matches!(self.stop, StopReason::Deadline { .. })
    }

    /// Whether the client stopped because the retry budget was empty.
    pub fn is_budget_exhausted(&self) -> bool {
        matches!(self.stop, StopReason::BudgetExhausted)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.method)?;
        if let Some(url) = &self.url {
            // The query may carry secrets; the path is enough to find the call.
            let mut shown = url.clone();
            shown.set_query(None);
            shown.set_fragment(None);
            let _ = shown.set_password(None);
            write!(f, " {shown}")?;
        }
        let plural = if self.attempts == 1 { "" } else { "s" };
        write!(f, " failed after {} attempt{plural}", self.attempts)?;
        match &self.key {
            Some(key) => write!(f, " (Idempotency-Key {key})")?,
            None => f.write_str(" (no Idempotency-Key)")?,
        }
        write!(f, ": {}", self.stop)?;
        for (i, cause) in self.causes.iter().enumerate() {
            f.write_str(if i == 0 { "; causes: " } else { ", " })?;
            write!(f, "{cause}")?;
        }
        Ok(())
    }
}

impl StdError for Error {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

/// Collects the failures of one request while it is retried, then becomes the [`Error`].
#[derive(Debug)]
pub(crate) struct Failures {
    method: Method,
    url: Option<reqwest::Url>,
    key: Option<IdempotencyKey>,
    causes: Vec<Cause>,
    /// Index in `causes` of the latest failure.
    last: Option<usize>,
    last_status: Option<StatusCode>,
    last_answer: Option<Box<Answer>>,
    source: Option<Box<dyn StdError + Send + Sync>>,
}

impl Failures {
    pub(crate) fn new(
        method: Method,
        url: Option<reqwest::Url>,
        key: Option<IdempotencyKey>,
    ) -> Self {
        Self {
            method,
            url,
            key,
            causes: Vec::new(),
            last: None,
            last_status: None,
            last_answer: None,
            source: None,
        }
    }

    /// Records an attempt that ended with an answer the policy wants retried.
    pub(crate) fn answered(&mut self, answer: Answer) {
        let status = answer.status;
        let message = match &answer.problem_type {
            Some(kind) => format!("{status} ({kind})"),
            None => status.to_string(),
        };
        self.last_status = Some(status);
        self.last_answer = Some(Box::new(answer));
        self.source = None;
        self.push(CauseKind::Status(status), message);
    }

    /// Records an attempt without an answer.
    pub(crate) fn transport(
        &mut self,
        kind: CauseKind,
        message: String,
        source: Option<Box<dyn StdError + Send + Sync>>,
    ) {
        self.last_status = None;
        self.source = source;
        self.push(kind, message);
    }

    fn push(&mut self, kind: CauseKind, message: String) {
        match self
            .causes
            .iter()
            .position(|c| c.kind == kind && c.message == message)
        {
            Some(i) => {
                self.causes[i].count = self.causes[i].count.saturating_add(1);
                self.last = Some(i);
            }
            None => {
                self.causes.push(Cause {
                    kind,
                    message,
                    count: 1,
                });
                self.last = Some(self.causes.len() - 1);
            }
        }
    }

    /// The message of the latest failure (for logs).
    pub(crate) fn last_cause(&self) -> Option<&str> {
        self.last
            .and_then(|i| self.causes.get(i))
            .map(|c| c.message.as_str())
    }

    pub(crate) fn key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }

    pub(crate) fn into_error(self, attempts: u32, stop: StopReason) -> Error {
        Error {
            method: self.method,
            url: self.url,
            key: self.key,
            attempts,
            stop,
            causes: self.causes,
            last_status: self.last_status,
            last_answer: self.last_answer,
            source: self.source,
        }
    }
}

/// The error's causes, innermost last, without reqwest's "error sending request for url (...)"
/// wrapper (the URL is in [`Error`] already, once): "client error (Connect): tcp connect error:
/// Connection refused (os error 111)". Equal messages make equal causes, so they collapse.
pub(crate) fn chain(e: &reqwest::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = std::error::Error::source(e);
    while let Some(cause) = next {
        let text = cause.to_string();
        if parts.last() != Some(&text) {
            parts.push(text);
        }
        next = cause.source();
    }
    if parts.is_empty() {
        e.to_string()
    } else {
        parts.join(": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: StatusCode) -> Answer {
        Answer {
            status,
            headers: HeaderMap::new(),
            body: Bytes::new(),
            problem_type: None,
        }
    }

    #[test]
    fn same_kind_and_message_collapse_with_a_count() {
        let url = reqwest::Url::parse("http://user:pw@example.test/pay?token=secret#x").unwrap();
        let key = IdempotencyKey::new("k-1").unwrap();
        let mut f = Failures::new(Method::POST, Some(url), Some(key));
        let lost = CauseKind::Transport(TransportFailure::Interrupted);
        f.transport(lost, "connection closed".into(), None);
        f.answered(answer(StatusCode::SERVICE_UNAVAILABLE));
        f.transport(lost, "connection closed".into(), None);
        f.answered(answer(StatusCode::SERVICE_UNAVAILABLE));
        f.answered(answer(StatusCode::BAD_GATEWAY));
        assert_eq!(f.last_cause(), Some("502 Bad Gateway"));
        f.transport(lost, "connection closed".into(), None);
        assert_eq!(f.last_cause(), Some("connection closed"));
        let e = f.into_error(6, StopReason::AttemptsExhausted { max_attempts: 6 });
        assert_eq!(
            e.causes().iter().map(Cause::count).collect::<Vec<_>>(),
            [3, 2, 1]
        );
        assert_eq!(e.last_status(), None, "the last attempt got no answer");
        assert_eq!(
            e.last_answer().map(Answer::status),
            Some(StatusCode::BAD_GATEWAY),
            "the latest answer is kept"
        );
        assert_eq!(
            e.to_string(),
            "POST http://user@example.test/pay failed after 6 attempts (Idempotency-Key k-1): \
             gave up after the maximum of 6 attempts; causes: connection closed (x3), \
             503 Service Unavailable (x2), 502 Bad Gateway (x1)"
        );
    }

    #[test]
    fn stop_reasons_say_what_stopped_the_request() {
        let one = StopReason::AttemptsExhausted { max_attempts: 1 };
        assert_eq!(one.to_string(), "gave up after the maximum of 1 attempt");
        let asked = StopReason::Deadline {
            deadline: Duration::from_secs(3),
            retry_after: Some(Duration::from_secs(10)),
        };
        assert_eq!(
            asked.to_string(),
            "the server asked to wait 10s (Retry-After), past the deadline of 3s"
        );
    }

    #[test]
    fn a_status_and_a_transport_failure_with_one_message_stay_apart() {
        let mut f = Failures::new(Method::GET, None, None);
        f.transport(CauseKind::Invalid, "502 Bad Gateway".into(), None);
        f.answered(answer(StatusCode::BAD_GATEWAY));
        let e = f.into_error(1, StopReason::InvalidRequest);
        assert_eq!(e.causes().len(), 2);
        assert!(e
            .to_string()
            .starts_with("GET failed after 1 attempt (no Idempotency-Key)"));
    }
}
