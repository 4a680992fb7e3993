//! A request being built, and the attempt loop that sends it.

use super::error::{CauseKind, Failures, StopReason};
use super::policy::{Attempt, Decision, Outcome, TransportFailure, REQUEST_IN_FLIGHT};
use super::{Client, Error, Response, IDEMPOTENCY_KEY};
use crate::IdempotencyKey;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use http::{Method, StatusCode};
use std::error::Error as StdError;
use std::time::Duration;
use tokio::time::Instant;

/// The largest problem document read to tell an in-flight 409 from a final one. idem's are a few
/// hundred bytes; a larger body is not read (the 409 is then taken as final).
const MAX_PROBLEM_BYTES: u64 = 16 * 1024;

#[derive(Debug)]
enum KeyChoice {
    Generate,
    Given(IdempotencyKey),
    Disabled,
}

/// A request being built: reqwest's builder plus the choice of key. Finish with [`send`](Self::send).
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_runtime::client::Client;
/// use idem_runtime::IdempotencyKey;
///
/// let client = Client::builder().build()?;
/// // A key stored with the order survives a restart of this process: the retry after the restart
/// // is still recognised by the server.
/// let key = IdempotencyKey::new("order-7731-charge")?;
/// let response = client
///     .post("http://127.0.0.1:3000/payments")
///     .bearer_auth("alice")
///     .idempotency_key(key)
///     .json(&serde_json::json!({ "amount": 1000, "currency": "KRW" }))
///     .send()
///     .await?;
/// # let _ = response;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
#[must_use = "a request does nothing until it is sent"]
pub struct RequestBuilder {
    client: Client,
    method: Method,
    inner: reqwest::RequestBuilder,
    key: KeyChoice,
}

impl RequestBuilder {
    pub(super) fn new(client: Client, method: Method, inner: reqwest::RequestBuilder) -> Self {
        Self {
            client,
            method,
            inner,
            key: KeyChoice::Generate,
        }
    }

    /// Sends this key instead of a generated one (for example a key stored with the business object,
    /// so that a retry after a restart of this process is still recognised).
    pub fn idempotency_key(mut self, key: IdempotencyKey) -> Self {
        self.key = KeyChoice::Given(key);
        self
    }

    /// Sends no `Idempotency-Key`. POST and PATCH requests are then never retried by the
    /// [`DefaultPolicy`](super::DefaultPolicy): a second attempt could be a second effect.
    pub fn without_idempotency_key(mut self) -> Self {
        self.key = KeyChoice::Disabled;
        self
    }

    /// Adds a header. An `Idempotency-Key` set this way is used as the request's key.
    pub fn header<K, V>(self, key: K, value: V) -> Self
    where
        HeaderName: TryFrom<K>,
        <HeaderName as TryFrom<K>>::Error: Into<http::Error>,
        HeaderValue: TryFrom<V>,
        <HeaderValue as TryFrom<V>>::Error: Into<http::Error>,
    {
        self.with_reqwest(|b| b.header(key, value))
    }

    /// Adds headers.
    pub fn headers(self, headers: http::HeaderMap) -> Self {
        self.with_reqwest(|b| b.headers(headers))
    }

    /// Sets `Authorization: Bearer <token>`.
    pub fn bearer_auth<T: std::fmt::Display>(self, token: T) -> Self {
        self.with_reqwest(|b| b.bearer_auth(token))
    }

    /// Sets `Authorization: Basic ...`.
    pub fn basic_auth<U: std::fmt::Display, P: std::fmt::Display>(
        self,
        username: U,
        password: Option<P>,
    ) -> Self {
        self.with_reqwest(|b| b.basic_auth(username, password))
    }

    /// Sets the body. A streaming body cannot be sent twice, so such a request gets one attempt.
    pub fn body(self, body: impl Into<reqwest::Body>) -> Self {
        self.with_reqwest(|b| b.body(body))
    }

    /// Sets a JSON body (and `Content-Type: application/json`).
    pub fn json<T: serde::Serialize + ?Sized>(self, json: &T) -> Self {
        self.with_reqwest(|b| b.json(json))
    }

    /// Appends query parameters.
    pub fn query<T: serde::Serialize + ?Sized>(self, query: &T) -> Self {
        self.with_reqwest(|b| b.query(query))
    }

    /// Sets a form body.
    pub fn form<T: serde::Serialize + ?Sized>(self, form: &T) -> Self {
        self.with_reqwest(|b| b.form(form))
    }

    /// Adjusts the underlying reqwest builder (anything not mirrored here). Its per-request
    /// `timeout` applies to each attempt.
    ///
    /// ```no_run
    /// # async fn run(client: idem_runtime::client::Client) {
    /// let response = client
    ///     .get("http://127.0.0.1:3000/payments")
    ///     .with_reqwest(|b| b.version(http::Version::HTTP_11))
    ///     .send()
    ///     .await;
    /// # let _ = response;
    /// # }
    /// ```
    pub fn with_reqwest(
        mut self,
        f: impl FnOnce(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
    ) -> Self {
        self.inner = f(self.inner);
        self
    }

    /// Sends the request, retrying as the client's policy and limits allow.
    ///
    /// # Errors
    /// When no attempt got a final answer: see [`Error`].
    pub async fn send(self) -> Result<Response, Error> {
        let Self {
            client,
            method,
            inner,
            key,
        } = self;
        let mut request = match inner.build() {
            Ok(request) => request,
            Err(e) => {
                let mut failures = Failures::new(method, None, None);
                failures.transport(CauseKind::Invalid, chain(&e), Some(Box::new(e)));
                return Err(failures.into_error(0, StopReason::InvalidRequest));
            }
        };
        let url = request.url().clone();
        let key = match resolve_key(&mut request, key, client.shared.config.key_format) {
            Ok(key) => key,
            Err(message) => {
                let mut failures = Failures::new(method, Some(url), None);
                failures.transport(CauseKind::Invalid, message, None);
                return Err(failures.into_error(0, StopReason::InvalidRequest));
            }
        };
        let failures = Failures::new(method, Some(url), key);
        run(&client, request, failures).await
    }
}

/// The key the request will carry, written into its headers. Precedence: a key given with
/// [`RequestBuilder::idempotency_key`], then one set as a header by hand, then a fresh UUID v4
/// (unless disabled).
fn resolve_key(
    request: &mut reqwest::Request,
    choice: KeyChoice,
    format: super::KeyFormat,
) -> Result<Option<IdempotencyKey>, String> {
    let by_hand = request.headers().get(IDEMPOTENCY_KEY).map(|v| {
        IdempotencyKey::parse(v.as_bytes())
            .map_err(|e| format!("the Idempotency-Key header set on the request is invalid: {e}"))
    });
    let key = match (choice, by_hand) {
        (KeyChoice::Given(key), _) => key,
        (_, Some(parsed)) => parsed?,
        (KeyChoice::Disabled, None) => return Ok(None),
        (KeyChoice::Generate, None) => {
            IdempotencyKey::new(uuid::Uuid::new_v4().hyphenated().to_string())
                .map_err(|e| format!("generated key rejected: {e}"))?
        }
    };
    let value = HeaderValue::from_str(&format.render(key.as_str()))
        .map_err(|e| format!("the key is not a valid header value: {e}"))?;
    request.headers_mut().insert(IDEMPOTENCY_KEY, value);
    Ok(Some(key))
}

/// What bounds an attempt in time, and which limit it was.
#[derive(Debug, Clone, Copy)]
enum Bound {
    AttemptTimeout(Instant, Duration),
    Deadline(Instant),
}

/// How one attempt ended.
enum Ended {
    Answered {
        response: reqwest::Response,
        problem_type: Option<String>,
    },
    NoAnswer(NoAnswer),
}

/// One attempt that got no (complete) answer.
struct NoAnswer {
    failure: TransportFailure,
    message: String,
    source: Option<Box<dyn StdError + Send + Sync>>,
    at_deadline: bool,
}

/// The attempt loop. Every wait is a `tokio::time` sleep and every instant a `tokio::time::Instant`,
/// so the loop runs on tokio's clock (see the module docs on paused-clock tests).
async fn run(
    client: &Client,
    request: reqwest::Request,
    mut failures: Failures,
) -> Result<Response, Error> {
    let shared = &*client.shared;
    let config = &shared.config;
    let method = request.method().clone();
    let has_key = failures.key().is_some();
    let started = Instant::now();
    // Checked additions throughout: a limit of `Duration::MAX` (or a huge `Retry-After` under a
    // huge cap) means "never", not a panic.
    let deadline_at = config.deadline.and_then(|d| started.checked_add(d));
    let max_attempts = config.max_attempts.max(1);
    shared.budget.on_request();

    let mut this = request;
    let mut number = 0u32;
    loop {
        number += 1;
        // Cloned before sending, since reqwest consumes the request; `None` for a streaming body.
        let next = if number < max_attempts {
            this.try_clone()
        } else {
            None
        };
        // The attempt is bounded by a tokio timer, not a socket timeout, so that it runs on the
        // same clock as everything else. Under a paused test clock that timer fires as soon as the
        // runtime idles, which is right only if an idle runtime means "no answer is coming": true
        // when the server runs in the same runtime (its bytes are always ready on loopback), false
        // for a server elsewhere; hence both bounds can be turned off (`None`).
        let now = Instant::now();
        let timeout_at = config
            .attempt_timeout
            .and_then(|t| Some((now.checked_add(t)?, t)));
        let bound = match (timeout_at, deadline_at) {
            (Some((at, t)), Some(d)) if at < d => Some(Bound::AttemptTimeout(at, t)),
            (Some((at, t)), None) => Some(Bound::AttemptTimeout(at, t)),
            (_, Some(d)) => Some(Bound::Deadline(d)),
            (None, None) => None,
        };
        let ended = attempt(&shared.http, this, bound).await;

        let decision = {
            let outcome = match &ended {
                Ended::Answered {
                    response,
                    problem_type,
                } => Outcome::Answered {
                    status: response.status(),
                    headers: response.headers(),
                    problem_type: problem_type.as_deref(),
                },
                Ended::NoAnswer(no_answer) => Outcome::NoAnswer(no_answer.failure),
            };
            shared
                .policy
                .decide(&Attempt::new(&method, number, has_key, outcome))
        };
        let not_before = match (ended, decision) {
            (Ended::Answered { response, .. }, Decision::Stop { .. }) => {
                return Ok(Response::new(response, failures.key().cloned(), number));
            }
            (
                Ended::Answered {
                    response,
                    problem_type,
                },
                Decision::Retry { not_before },
            ) => {
                let status = response.status();
                failures.answered(status, status_message(status, problem_type.as_deref()));
                not_before
            }
            (Ended::NoAnswer(no_answer), decision) => {
                failures.transport(
                    CauseKind::Transport(no_answer.failure),
                    no_answer.message,
                    no_answer.source,
                );
                if no_answer.at_deadline {
                    return Err(stop(failures, number, config.deadline));
                }
                match decision {
                    Decision::Stop { reason } => {
                        return Err(
                            failures.into_error(number, StopReason::NotRetryable { reason })
                        );
                    }
                    Decision::Retry { not_before } => not_before,
                }
            }
        };

        // The policy says another attempt may succeed; can this request afford one?
        if number >= max_attempts {
            return Err(failures.into_error(number, StopReason::AttemptsExhausted { max_attempts }));
        }
        let Some(next) = next else {
            return Err(failures.into_error(number, StopReason::BodyNotReplayable));
        };
        if let Some(requested) = not_before.filter(|w| *w > config.max_retry_after) {
            let cap = config.max_retry_after;
            return Err(
                failures.into_error(number, StopReason::RetryAfterTooLong { requested, cap })
            );
        }
        let delay = config
            .backoff
            .sample(number)
            .max(not_before.unwrap_or_default());
        // A wait that ends at or past the deadline would only lead to an attempt cut off at once.
        if deadline_at.is_some_and(|d| Instant::now().checked_add(delay).is_none_or(|t| t >= d)) {
            return Err(stop(failures, number, config.deadline));
        }
        if !shared.budget.try_withdraw() {
            return Err(failures.into_error(number, StopReason::BudgetExhausted));
        }
        tracing::debug!(
            target: "idem::client",
            method = %method,
            key = failures.key().map(IdempotencyKey::as_str).unwrap_or("none"),
            attempt = number,
            cause = failures.last_cause().unwrap_or(""),
            delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            "retrying",
        );
        tokio::time::sleep(delay).await;
        this = next;
    }
}

fn stop(failures: Failures, attempts: u32, deadline: Option<Duration>) -> Error {
    let deadline = deadline.unwrap_or_default();
    failures.into_error(attempts, StopReason::Deadline { deadline })
}

fn status_message(status: StatusCode, problem_type: Option<&str>) -> String {
    if status == StatusCode::CONFLICT && problem_type == Some(REQUEST_IN_FLIGHT) {
        format!("{status} (request in flight)")
    } else {
        status.to_string()
    }
}

/// Sends one attempt, bounded by the attempt timeout or the deadline, and reads the problem type
/// of a 409.
async fn attempt(http: &reqwest::Client, request: reqwest::Request, bound: Option<Bound>) -> Ended {
    let sent = async {
        match http.execute(request).await {
            Ok(response) => read_problem_type(response).await,
            Err(e) => Ended::NoAnswer(from_reqwest(e)),
        }
    };
    let Some(bound) = bound else {
        return sent.await;
    };
    let (at, timed_out) = match bound {
        Bound::AttemptTimeout(at, limit) => (
            at,
            NoAnswer {
                failure: TransportFailure::Timeout,
                message: format!("no answer within the attempt timeout of {limit:?}"),
                source: None,
                at_deadline: false,
            },
        ),
        Bound::Deadline(at) => (
            at,
            NoAnswer {
                failure: TransportFailure::Timeout,
                message: "no answer before the deadline".to_owned(),
                source: None,
                at_deadline: true,
            },
        ),
    };
    tokio::time::timeout_at(at, sent)
        .await
        .unwrap_or(Ended::NoAnswer(timed_out))
}

/// For a 409 problem document, reads its `type` (the body is put back, so the caller still gets the
/// whole answer); any other answer passes untouched.
async fn read_problem_type(response: reqwest::Response) -> Ended {
    let is_problem = response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("application/problem+json")
        });
    let small = response
        .content_length()
        .is_some_and(|n| n <= MAX_PROBLEM_BYTES);
    if response.status() != StatusCode::CONFLICT || !is_problem || !small {
        return Ended::Answered {
            response,
            problem_type: None,
        };
    }
    let status = response.status();
    let version = response.version();
    let headers = response.headers().clone();
    let url = response.url().clone();
    let body = match read_capped(response).await {
        Ok(body) => body,
        Err(no_answer) => return Ended::NoAnswer(no_answer),
    };
    #[derive(serde::Deserialize)]
    struct Problem {
        #[serde(rename = "type")]
        kind: Option<String>,
    }
    let problem_type = serde_json::from_slice::<Problem>(&body)
        .ok()
        .and_then(|p| p.kind);
    // Rebuild the response around the bytes read, keeping its URL.
    use reqwest::ResponseBuilderExt as _;
    let mut rebuilt = http::Response::builder()
        .url(url)
        .body(body.clone())
        .unwrap_or_else(|_| http::Response::new(body));
    *rebuilt.status_mut() = status;
    *rebuilt.version_mut() = version;
    *rebuilt.headers_mut() = headers;
    Ended::Answered {
        response: reqwest::Response::from(rebuilt),
        problem_type,
    }
}

async fn read_capped(mut response: reqwest::Response) -> Result<bytes::Bytes, NoAnswer> {
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                body.extend_from_slice(&chunk);
                if body.len() as u64 > MAX_PROBLEM_BYTES {
                    return Err(NoAnswer {
                        failure: TransportFailure::Other,
                        message: "the 409 problem document is longer than announced".to_owned(),
                        source: None,
                        at_deadline: false,
                    });
                }
            }
            Ok(None) => return Ok(body.into()),
            Err(e) => {
                // The status line arrived but the body was cut: no complete answer.
                let mut no_answer = from_reqwest(e);
                no_answer.failure = TransportFailure::Interrupted;
                return Err(no_answer);
            }
        }
    }
}

fn from_reqwest(e: reqwest::Error) -> NoAnswer {
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
    NoAnswer {
        failure,
        message: chain(&e),
        source: Some(Box::new(e)),
        at_deadline: false,
    }
}

/// The error's causes, innermost last, without reqwest's "error sending request for url (...)"
/// wrapper (the URL is in [`Error`] already, once): "client error (Connect): tcp connect error:
/// Connection refused (os error 111)". Equal messages make equal causes, so they collapse.
fn chain(e: &reqwest::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = e.source();
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

    fn assert_send<T: Send>(_: &T) {}
    fn assert_send_sync_static<T: Send + Sync + 'static>() {}

    #[test]
    fn futures_and_results_cross_threads() {
        assert_send_sync_static::<Error>();
        assert_send_sync_static::<Response>();
        assert_send_sync_static::<Client>();
        let client = Client::builder().build().unwrap();
        let send = client.post("http://127.0.0.1:9/").send();
        assert_send(&send);
    }
}
