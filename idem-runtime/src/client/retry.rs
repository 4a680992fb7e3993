//! The attempt loop, shared by the [`Client`](super::Client) and the middleware: send, read the
//! answer, ask [`decide_next`] (the policy, then the limits), wait, send again with the same key.

use super::error::{chain, Answer, CauseKind, Failures, StopReason};
use super::next::{decide_next, Next, Progress};
use super::policy::{Attempt, Outcome, TransportFailure};
use super::request::{resolve_key, KeyChoice};
use super::response::Receipt;
use super::{Error, Retrier};
use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http_body_util::{BodyExt as _, BodyStream, Full, StreamBody};
use std::error::Error as StdError;
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;
use tracing::Instrument as _;

/// The least read of a problem document whatever the buffer limit: enough for idem's (a few
/// hundred bytes), so an in-flight 409 is recognised however it is framed.
const MAX_PROBLEM_BYTES: usize = 16 * 1024;

/// Where an attempt goes: reqwest's client for the plain form, the rest of a middleware stack for
/// the middleware.
pub(crate) trait Transport: Send {
    fn send(
        &mut self,
        request: reqwest::Request,
    ) -> impl Future<Output = Result<reqwest::Response, NoAnswer>> + Send;
}

impl Transport for &reqwest::Client {
    fn send(
        &mut self,
        request: reqwest::Request,
    ) -> impl Future<Output = Result<reqwest::Response, NoAnswer>> + Send {
        let sent = self.execute(request);
        async move { sent.await.map_err(NoAnswer::from) }
    }
}

impl Retrier {
    /// Gives the request its key, then runs the attempt loop.
    pub(crate) async fn send(
        &self,
        transport: &mut impl Transport,
        mut request: reqwest::Request,
        choice: Option<KeyChoice>,
    ) -> Result<reqwest::Response, Error> {
        let method = request.method().clone();
        let url = request.url().clone();
        match resolve_key(&mut request, choice, self.config.key_format) {
            Ok(key) => {
                run(
                    self,
                    transport,
                    request,
                    Failures::new(method, Some(url), key),
                )
                .await
            }
            Err(message) => {
                let mut failures = Failures::new(method, Some(url), None);
                failures.transport(CauseKind::Invalid, message, None);
                Err(failures.into_error(0, StopReason::InvalidRequest))
            }
        }
    }
}

/// What bounds an attempt in time, and which limit it was.
#[derive(Debug, Clone, Copy)]
enum Bound {
    AttemptTimeout(Instant, Duration),
    Deadline(Instant),
}

impl Bound {
    /// The nearer of the attempt timeout, from now, and the deadline.
    ///
    /// The attempt is bounded by a tokio timer, not a socket timeout, so that it runs on the same
    /// clock as everything else. Under a paused test clock that timer fires as soon as the runtime
    /// idles, which is right only if an idle runtime means "no answer is coming": true when the
    /// server runs in the same runtime (its bytes are always ready on loopback), false for a server
    /// elsewhere; hence both bounds can be turned off (`None`).
    fn nearest(attempt_timeout: Option<Duration>, deadline_at: Option<Instant>) -> Option<Self> {
        let timeout_at = attempt_timeout.and_then(|t| Some((Instant::now().checked_add(t)?, t)));
        match (timeout_at, deadline_at) {
            (Some((at, t)), Some(d)) if at < d => Some(Self::AttemptTimeout(at, t)),
            (Some((at, t)), None) => Some(Self::AttemptTimeout(at, t)),
            (_, Some(d)) => Some(Self::Deadline(d)),
            (None, None) => None,
        }
    }
}

/// How one attempt ended.
enum Ended {
    Answered(Answered),
    NoAnswer(NoAnswer),
}

impl Ended {
    /// What the policy is shown.
    fn outcome(&self) -> Outcome<'_> {
        match self {
            Self::Answered(answered) => Outcome::Answered {
                status: answered.response.status(),
                headers: answered.response.headers(),
                problem_type: answered.problem_type.as_deref(),
            },
            Self::NoAnswer(no_answer) => Outcome::NoAnswer(no_answer.failure),
        }
    }
}

/// An answer whose body was read whole inside the attempt, when it fit.
struct Answered {
    /// The answer, its body put back (the bytes read, or those and the unread rest).
    response: reqwest::Response,
    /// The whole body, if it fit in the buffer.
    body: Option<Bytes>,
    problem_type: Option<String>,
}

impl Answered {
    fn into_answer(mut self) -> Answer {
        Answer {
            status: self.response.status(),
            headers: std::mem::take(self.response.headers_mut()),
            body: self.body.unwrap_or_default(),
            problem_type: self.problem_type,
        }
    }
}

/// One attempt that got no (complete) answer.
pub(crate) struct NoAnswer {
    failure: TransportFailure,
    message: String,
    source: Option<Box<dyn StdError + Send + Sync>>,
    at_deadline: bool,
}

impl From<reqwest::Error> for NoAnswer {
    fn from(e: reqwest::Error) -> Self {
        // A connect timeout is both: it is a connect failure (nothing was sent).
        let failure = if e.is_connect() {
            TransportFailure::Connect
        } else if e.is_timeout() {
            TransportFailure::Timeout
        } else if e.is_request() {
            TransportFailure::Interrupted
        } else {
            TransportFailure::Other
        };
        Self {
            failure,
            message: chain(&e),
            source: Some(Box::new(e)),
            at_deadline: false,
        }
    }
}

#[cfg(feature = "client-middleware")]
impl From<reqwest_middleware::Error> for NoAnswer {
    fn from(e: reqwest_middleware::Error) -> Self {
        match e {
            reqwest_middleware::Error::Reqwest(e) => e.into(),
            // Another middleware's own failure: nothing says a retry would help.
            reqwest_middleware::Error::Middleware(e) => Self {
                failure: TransportFailure::Other,
                message: format!("{e:#}"),
                source: Some(e.into()),
                at_deadline: false,
            },
        }
    }
}

/// The attempt loop: it sends, records and sleeps; [`decide_next`] decides. Every wait is a
/// `tokio::time` sleep and every instant a `tokio::time::Instant`, so the loop runs on tokio's
/// clock (see the module docs on paused-clock tests).
async fn run(
    retrier: &Retrier,
    transport: &mut impl Transport,
    request: reqwest::Request,
    mut failures: Failures,
) -> Result<reqwest::Response, Error> {
    let config = &retrier.config;
    let method = request.method().clone();
    let has_key = failures.key().is_some();
    // Checked: a deadline of `Duration::MAX` means "never", not a panic.
    let deadline_at = config.deadline.and_then(|d| Instant::now().checked_add(d));
    let mut last_retry_cost = None;

    let mut this = request;
    let mut number = 0u32;
    loop {
        number += 1;
        // Cloned before sending, since reqwest consumes the request; `None` for a streaming body.
        let again = if number < config.max_attempts.max(1) {
            this.try_clone()
        } else {
            None
        };
        let bound = Bound::nearest(config.attempt_timeout, deadline_at);
        let span = attempt_span(&method, number);
        let ended = attempt(transport, this, bound, config.max_buffered_body)
            .instrument(span.clone())
            .await;
        let outcome = ended.outcome();
        if let Outcome::Answered { status, .. } = outcome {
            span.record("http.response.status_code", status.as_u16());
        }
        let next = decide_next(
            retrier,
            &Progress {
                attempt: Attempt::new(&method, number, has_key, outcome),
                cut_at_deadline: matches!(&ended, Ended::NoAnswer(n) if n.at_deadline),
                replayable: again.is_some(),
                deadline_at,
                now: Instant::now(),
                jitter: rand::random(),
            },
        );

        match ended {
            Ended::Answered(answered) if matches!(next, Next::Final { .. }) => {
                return Ok(deliver(
                    retrier,
                    answered,
                    &failures,
                    number,
                    last_retry_cost,
                ));
            }
            Ended::Answered(answered) => failures.answered(answered.into_answer()),
            Ended::NoAnswer(no_answer) => failures.transport(
                CauseKind::Transport(no_answer.failure),
                no_answer.message,
                no_answer.source,
            ),
        }
        let (wait, again) = match (next, again) {
            (Next::Retry { wait, cost }, Some(again)) => {
                last_retry_cost = Some(cost);
                (wait, again)
            }
            (Next::Final { reason }, _) => {
                let stop = StopReason::NotRetryable { reason };
                return Err(failures.into_error(number, stop));
            }
            (Next::Stop(stop), _) => return Err(failures.into_error(number, stop)),
            // `decide_next` retries only a replayable request; this arm only spares an `expect`.
            (Next::Retry { .. }, None) => {
                return Err(failures.into_error(number, StopReason::BodyNotReplayable));
            }
        };
        tracing::debug!(
            target: "idem::client",
            method = %method,
            key = failures.key().map(|k| k.as_str()).unwrap_or("none"),
            attempt = number,
            cause = failures.last_cause().unwrap_or(""),
            delay_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            "retrying",
        );
        tokio::time::sleep(wait).await;
        this = again;
    }
}

/// One span per attempt, as OpenTelemetry's HTTP client conventions ask, with the resend count on
/// resends; recorded on the caller's span too, if it declares the field.
fn attempt_span(method: &http::Method, number: u32) -> tracing::Span {
    let span = tracing::info_span!(
        target: "idem::client",
        "attempt",
        http.request.method = %method,
        http.request.resend_count = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    if number > 1 {
        span.record("http.request.resend_count", number - 1);
        tracing::Span::current().record("http.request.resend_count", number - 1);
    }
    span
}

/// The answer the policy called final, as the caller receives it: marked with its receipt, and
/// a success earns the retry budget back.
fn deliver(
    retrier: &Retrier,
    answered: Answered,
    failures: &Failures,
    attempts: u32,
    last_retry_cost: Option<u32>,
) -> reqwest::Response {
    let mut response = answered.response;
    if response.status().is_success() {
        retrier.budget.on_success(last_retry_cost);
    }
    response.extensions_mut().insert(Receipt {
        key: failures.key().cloned(),
        attempts,
        problem_type: answered.problem_type,
    });
    response
}

/// Sends one attempt and reads its answer, bounded by the attempt timeout or the deadline.
async fn attempt(
    transport: &mut impl Transport,
    request: reqwest::Request,
    bound: Option<Bound>,
    limit: usize,
) -> Ended {
    let sent = async {
        match transport.send(request).await {
            Ok(response) => match read(response, limit).await {
                Ok(answered) => Ended::Answered(answered),
                Err(no_answer) => Ended::NoAnswer(no_answer),
            },
            Err(no_answer) => Ended::NoAnswer(no_answer),
        }
    };
    let Some(bound) = bound else {
        return sent.await;
    };
    let (at, message, at_deadline) = match bound {
        Bound::AttemptTimeout(at, limit) => (
            at,
            format!("no answer within the attempt timeout of {limit:?}"),
            false,
        ),
        Bound::Deadline(at) => (at, "no answer before the deadline".to_owned(), true),
    };
    tokio::time::timeout_at(at, sent).await.unwrap_or_else(|_| {
        Ended::NoAnswer(NoAnswer {
            failure: TransportFailure::Timeout,
            message,
            source: None,
            at_deadline,
        })
    })
}

/// Reads the body inside the attempt when it fits in `limit` bytes (a problem document: at least
/// [`MAX_PROBLEM_BYTES`], whatever its framing), so that a connection cut mid-body is a failed
/// attempt, retried like one cut before the answer. A longer body is handed back as a stream, the
/// bytes already read first.
async fn read(response: reqwest::Response, limit: usize) -> Result<Answered, NoAnswer> {
    let is_problem = response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/problem+json"));
    let limit = if is_problem {
        limit.max(MAX_PROBLEM_BYTES)
    } else {
        limit
    };
    if response.content_length().is_some_and(|n| n > limit as u64) {
        return Ok(Answered {
            response,
            body: None,
            problem_type: None,
        });
    }
    let url = response.url().clone();
    let (parts, mut body) = http::Response::from(response).into_parts();
    let mut read = Vec::new();
    while let Some(frame) = body.frame().await {
        let data = match frame {
            Ok(frame) => frame.into_data().unwrap_or_default(),
            Err(e) => {
                // The status line arrived but the body was cut: no complete answer.
                let mut no_answer = NoAnswer::from(e);
                if no_answer.failure != TransportFailure::Timeout {
                    no_answer.failure = TransportFailure::Interrupted;
                }
                return Err(no_answer);
            }
        };
        read.extend_from_slice(&data);
        if read.len() > limit {
            let first = Full::new(Bytes::from(read)).map_err(|never| match never {});
            let all = futures_util::StreamExt::chain(BodyStream::new(first), BodyStream::new(body));
            return Ok(Answered {
                response: rebuild(parts, url, reqwest::Body::wrap(StreamBody::new(all))),
                body: None,
                problem_type: None,
            });
        }
    }
    let body = Bytes::from(read);
    #[derive(serde::Deserialize)]
    struct Problem {
        #[serde(rename = "type")]
        kind: Option<String>,
    }
    let problem_type = is_problem
        .then(|| serde_json::from_slice::<Problem>(&body).ok()?.kind)
        .flatten();
    Ok(Answered {
        response: rebuild(parts, url, body.clone().into()),
        body: Some(body),
        problem_type,
    })
}

/// A reqwest response again, around a body read (or partly read) by the client.
fn rebuild(
    mut parts: http::response::Parts,
    url: reqwest::Url,
    body: reqwest::Body,
) -> reqwest::Response {
    use reqwest::ResponseBuilderExt as _;
    // The builder is the one public way to set the URL that `reqwest::Response::url` reports.
    let mut marked = http::Response::builder()
        .url(url)
        .body(())
        .unwrap_or_default();
    parts
        .extensions
        .extend(std::mem::take(marked.extensions_mut()));
    reqwest::Response::from(http::Response::from_parts(parts, body))
}
