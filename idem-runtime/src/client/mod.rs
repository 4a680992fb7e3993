//! The retrying client: one key per logical request, retries only where they can help.
//!
//! A service that charges through an idempotent API must retry when it hears nothing, and must
//! retry *safely*: with the same `Idempotency-Key` on every attempt, only on failures that may go
//! away, never faster than the server asks, and never so much that a struggling dependency is
//! buried under retries. [`Client`] does that on top of reqwest, and `RetryMiddleware` does the
//! same inside an existing reqwest-middleware stack (feature `client-middleware`):
//!
//! - **One key per logical request** with effects: POST and PATCH get a UUID v4 unless you give
//!   one ([`RequestBuilder::idempotency_key`], e.g. one stored with the order so it survives a
//!   restart), sent on every attempt and available on the [`Response`] and the [`Error`]. GET,
//!   HEAD, OPTIONS, PUT and DELETE go without one and are still retried: they mean the same thing
//!   sent twice. Ask for a key on a PUT or DELETE with
//!   [`with_idempotency_key`](RequestBuilder::with_idempotency_key) ([`KeyChoice`]).
//! - **Retries only what may succeed later** ([`DefaultPolicy`]): no connection, timeouts, a
//!   connection lost before the whole answer arrived, 500, 502, 503, 504, 408, 429 and idem's 409
//!   [`REQUEST_IN_FLIGHT`]; never 400, 401, 403, 404, 410, 422 or any other 4xx. A POST or PATCH
//!   is retried only with a key.
//! - **Reads the answer inside the retry loop**: a body up to
//!   [`max_buffered_body`](ClientBuilder::max_buffered_body) (1 MiB) is read whole before the
//!   client returns, so a connection cut mid-body is retried with the same key (the server
//!   replays) instead of surfacing later as "error decoding response body". Problem documents
//!   (`application/problem+json`) are read whatever their framing, chunked included.
//! - **Waits**: exponential backoff with full jitter ([`ExponentialBackoff`]), at least the answer's
//!   `Retry-After` (seconds or HTTP date) up to a cap ([`ClientBuilder::max_retry_after`]).
//! - **Limits**: a maximum number of attempts (0 still makes one), an overall deadline, and a retry
//!   budget shared by all requests of the client, with the AWS SDKs' retry-quota arithmetic
//!   ([`RetryBudget`]): when a dependency is down, retries stop and requests fail fast instead of
//!   multiplying its load.
//! - **Answers keep their evidence.** [`Response::replayed`] reads `Idempotency-Replayed`;
//!   [`Response::dead_key`] turns idem's 422 (key mismatch) and 410 (key expired) into a
//!   [`DeadKey`] to match on. When every attempt failed, the one [`Error`] names the distinct
//!   causes with their counts, the attempts, the key, why the client stopped ([`StopReason`],
//!   e.g. a `Retry-After` past the deadline) and the last answer with its headers and body
//!   ([`Error::last_answer`]: the problem detail a person needs).
//!
//! ```no_run
//! use idem_runtime::client::Client;
//! use std::time::Duration;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let client = Client::builder()
//!     .max_attempts(4)
//!     .deadline(Some(Duration::from_secs(20)))
//!     .build()?;
//! let response = client
//!     .post("http://127.0.0.1:3000/payments")
//!     .bearer_auth("alice")
//!     .json(&serde_json::json!({ "amount": 1000, "currency": "KRW" }))
//!     .send()
//!     .await?;
//! println!("{} with key {:?}", response.status(), response.key().map(|k| k.as_str()));
//! # Ok(())
//! # }
//! ```
//!
//! `StatusCode`, `Method`, `HeaderMap` and the other `http` types in this API are re-exported as
//! [`idem_runtime::http`](crate::http) (reqwest re-exports the same ones, e.g.
//! [`client::reqwest::StatusCode`](reqwest::StatusCode)): no `http` dependency of your own is needed.
//!
//! # Two forms: the client, or a middleware in your stack
//!
//! [`Client`] is a wrapper type: the key belongs to the logical request, so it is created once in
//! [`RequestBuilder::send`] and returned on both outcomes, with typed results ([`Response`],
//! [`Error`]). Bring your own configured `reqwest::Client` ([`ClientBuilder::http_client`]: TLS,
//! proxies, pools), adjust any request with [`RequestBuilder::with_reqwest`], and take the plain
//! response with [`Response::into_inner`].
//!
//! A service that already sends through a `reqwest_middleware::ClientWithMiddleware` adds
//! `RetryMiddleware` (feature `client-middleware`) to its stack instead: the same policy, keys,
//! limits and budget, from the same [`ClientBuilder`]. reqwest-retry, the usual retry middleware,
//! still ignores `Retry-After` (its issue 146); idem's honours it. Use one retry middleware, not
//! both, or each retries the other's attempts.
//!
//! ```no_run
//! # #[cfg(feature = "client-middleware")]
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_runtime::client::{reqwest, reqwest_middleware, Client, Error, Response};
//!
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(Client::builder().max_attempts(4).build_middleware())
//!     .build();
//! match client.post("http://127.0.0.1:3000/payments").body("{}").send().await {
//!     // The same view as the plain client's: key, attempts, replayed, dead_key.
//!     Ok(answer) => println!("replayed: {}", Response::from(answer).replayed()),
//!     Err(e) => match Error::from_middleware(e) {
//!         Ok(failed) => eprintln!("{failed}"),
//!         Err(other) => eprintln!("another middleware failed: {other}"),
//!     },
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Tracing
//!
//! Each attempt runs in an `attempt` span (target `idem::client`) with OpenTelemetry's HTTP
//! attributes `http.request.method`, `http.response.status_code` and, on resends,
//! `http.request.resend_count`; the resend count is also recorded on the span the request runs in
//! (reqwest-tracing's, or your own) when that span declares the field. A `retrying` event at
//! debug level names the key, the cause and the wait.
//!
//! # Time, and testing it
//!
//! All waiting and all time measurement go through `tokio::time` (sleeps, the deadline, the
//! per-attempt timeout), never `std::time::Instant` or a blocking sleep, so tests run on tokio's
//! paused clock and a 30-second backoff takes no wall time.
//!
//! A paused clock auto-advances to the next timer whenever the runtime has nothing to run. Tokio
//! first polls for I/O without blocking and only advances if that woke no task, so a server in the
//! **same** runtime, on loopback, answers before any timer fires: idem's own tests run their
//! fault-injecting axum server inside the `#[tokio::test(start_paused = true)]` runtime. A server
//! in another thread or process would look "idle" to the paused runtime, and the deadline or
//! attempt timeout would fire at once; for such tests turn them off
//! ([`deadline(None)`](ClientBuilder::deadline), [`attempt_timeout(None)`](ClientBuilder::attempt_timeout)).
//! Only the `Retry-After` date form reads the wall clock, since it names a wall-clock instant.
//!
//! # Dependencies
//!
//! The client lives behind the `client` feature and needs neither axum nor sqlx: a service that only
//! calls idempotent APIs depends on
//! `idem-runtime = { version = "0.1", default-features = false, features = ["client"] }`, and
//! `cargo tree -p idem-runtime --no-default-features --features client | grep -E 'axum|sqlx'` prints
//! nothing. The `client-middleware` feature adds reqwest-middleware 0.4 (the line built on
//! reqwest 0.12), re-exported as [`reqwest_middleware`](self#reexports).

mod backoff;
mod budget;
mod error;
#[cfg(feature = "client-middleware")]
mod middleware;
mod next;
mod policy;
mod request;
mod response;
mod retry;

pub use backoff::ExponentialBackoff;
pub use budget::RetryBudget;
pub use error::{Answer, Cause, CauseKind, Error, StopReason};
#[cfg(feature = "client-middleware")]
#[cfg_attr(docsrs, doc(cfg(feature = "client-middleware")))]
pub use middleware::RetryMiddleware;
pub use policy::{
    parse_retry_after, Attempt, DeadKey, Decision, DefaultPolicy, Outcome, RetryPolicy,
    TransportFailure, KEY_EXPIRED, KEY_MISMATCH, REQUEST_IN_FLIGHT,
};
pub use request::{KeyChoice, RequestBuilder};
pub use response::{Response, IDEMPOTENCY_REPLAYED};

/// The reqwest this client is built on, so callers name the same version.
pub use reqwest;
/// The reqwest-middleware [`RetryMiddleware`] plugs into, so callers name the same version.
#[cfg(feature = "client-middleware")]
#[cfg_attr(docsrs, doc(cfg(feature = "client-middleware")))]
pub use reqwest_middleware;

use std::sync::Arc;
use std::time::Duration;

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: &str = crate::key::HEADER;

/// How the key is written in the `Idempotency-Key` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeyFormat {
    /// `Idempotency-Key: 5b3c…`: what Stripe and most APIs expect. idem servers accept both forms.
    #[default]
    Bare,
    /// `Idempotency-Key: "5b3c…"`: the IETF draft's structured-field string.
    Quoted,
}

impl KeyFormat {
    fn render(self, key: &str) -> String {
        match self {
            Self::Bare => key.to_owned(),
            Self::Quoted => {
                let mut out = String::with_capacity(key.len() + 2);
                out.push('"');
                for c in key.chars() {
                    if matches!(c, '"' | '\\') {
                        out.push('\\');
                    }
                    out.push(c);
                }
                out.push('"');
                out
            }
        }
    }
}

#[derive(Debug, Clone)]
struct Config {
    max_attempts: u32,
    deadline: Option<Duration>,
    attempt_timeout: Option<Duration>,
    backoff: ExponentialBackoff,
    max_retry_after: Duration,
    key_format: KeyFormat,
    max_buffered_body: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            deadline: Some(Duration::from_secs(30)),
            attempt_timeout: Some(Duration::from_secs(10)),
            backoff: ExponentialBackoff::default(),
            max_retry_after: Duration::from_secs(30),
            key_format: KeyFormat::Bare,
            max_buffered_body: 1024 * 1024,
        }
    }
}

/// Everything the attempt loop needs besides a way to send: shared by a client and its clones, or
/// by a middleware.
struct Retrier {
    config: Config,
    policy: Box<dyn RetryPolicy>,
    budget: RetryBudget,
}

impl std::fmt::Debug for Retrier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Retrier")
            .field("config", &self.config)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

/// A retrying HTTP client for idempotent APIs. Cheap to clone; clones share the connection pool
/// and the retry budget.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_runtime::client::Client;
///
/// let client = Client::builder().build()?;
/// let payments = client.get("http://127.0.0.1:3000/payments").bearer_auth("alice").send().await?;
/// assert!(payments.status().is_success());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    retrier: Arc<Retrier>,
}

impl Client {
    /// A builder with the defaults: 3 attempts, a 30 s deadline, a 10 s attempt timeout, backoff
    /// from 100 ms doubling to 5 s, `Retry-After` honoured up to 30 s, bodies up to 1 MiB read
    /// inside the retry loop, [`RetryBudget::default`], [`DefaultPolicy`], bare keys.
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    /// A client with the defaults over an existing reqwest client.
    pub fn from_reqwest(http: reqwest::Client) -> Self {
        ClientBuilder::default().build_with(http)
    }

    /// Starts a request.
    pub fn request(&self, method: reqwest::Method, url: impl reqwest::IntoUrl) -> RequestBuilder {
        RequestBuilder::new(self.clone(), method.clone(), self.http.request(method, url))
    }

    /// Starts a GET request.
    pub fn get(&self, url: impl reqwest::IntoUrl) -> RequestBuilder {
        self.request(reqwest::Method::GET, url)
    }

    /// Starts a POST request.
    pub fn post(&self, url: impl reqwest::IntoUrl) -> RequestBuilder {
        self.request(reqwest::Method::POST, url)
    }

    /// Starts a PUT request.
    pub fn put(&self, url: impl reqwest::IntoUrl) -> RequestBuilder {
        self.request(reqwest::Method::PUT, url)
    }

    /// Starts a PATCH request.
    pub fn patch(&self, url: impl reqwest::IntoUrl) -> RequestBuilder {
        self.request(reqwest::Method::PATCH, url)
    }

    /// Starts a DELETE request.
    pub fn delete(&self, url: impl reqwest::IntoUrl) -> RequestBuilder {
        self.request(reqwest::Method::DELETE, url)
    }

    /// Starts a HEAD request.
    pub fn head(&self, url: impl reqwest::IntoUrl) -> RequestBuilder {
        self.request(reqwest::Method::HEAD, url)
    }

    /// The retry budget this client draws from (for metrics: [`RetryBudget::available`]).
    pub fn budget(&self) -> &RetryBudget {
        &self.retrier.budget
    }
}

/// Configures a [`Client`]. Every setting has a default (see [`Client::builder`]).
///
/// ```
/// use idem_runtime::client::{Client, ExponentialBackoff, KeyFormat, RetryBudget};
/// use std::time::Duration;
///
/// let client = Client::builder()
///     .max_attempts(5)
///     .deadline(Some(Duration::from_secs(60)))
///     .attempt_timeout(Some(Duration::from_secs(5)))
///     .backoff(ExponentialBackoff::new(Duration::from_millis(200), Duration::from_secs(10)))
///     .max_retry_after(Duration::from_secs(60))
///     .budget(RetryBudget::new(100))
///     .key_format(KeyFormat::Quoted)
///     .max_buffered_body(256 * 1024)
///     .build()?;
/// # let _ = client;
/// # Ok::<(), idem_runtime::client::reqwest::Error>(())
/// ```
#[must_use]
pub struct ClientBuilder {
    http: Option<reqwest::Client>,
    config: Config,
    policy: Box<dyn RetryPolicy>,
    budget: RetryBudget,
}

impl Default for ClientBuilder {
    fn default() -> Self {
        Self {
            http: None,
            config: Config::default(),
            policy: Box::new(DefaultPolicy),
            budget: RetryBudget::default(),
        }
    }
}

impl std::fmt::Debug for ClientBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientBuilder")
            .field("config", &self.config)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

impl ClientBuilder {
    /// Sends through this reqwest client (its TLS, proxy, pool and connect-timeout settings apply to
    /// every attempt). Default: `reqwest::Client::builder().build()`.
    pub fn http_client(mut self, http: reqwest::Client) -> Self {
        self.http = Some(http);
        self
    }

    /// The most attempts per request, the first included. 0 is taken as 1: a request is always sent.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.config.max_attempts = attempts;
        self
    }

    /// The time a request may take from `send` to its result, waits and attempts included
    /// (`None`: no limit). No attempt starts and no wait is begun that would end past it, and an
    /// attempt still running at the deadline is cut off.
    pub fn deadline(mut self, deadline: Option<Duration>) -> Self {
        self.config.deadline = deadline;
        self
    }

    /// The time one attempt may wait for its answer before it counts as a timeout and may be retried
    /// (`None`: only the deadline bounds it).
    pub fn attempt_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.config.attempt_timeout = timeout;
        self
    }

    /// The backoff between attempts.
    pub fn backoff(mut self, backoff: ExponentialBackoff) -> Self {
        self.config.backoff = backoff;
        self
    }

    /// The longest `Retry-After` honoured. A server asking for more ends the request with
    /// [`StopReason::RetryAfterTooLong`] rather than retrying early (which it would refuse again).
    pub fn max_retry_after(mut self, cap: Duration) -> Self {
        self.config.max_retry_after = cap;
        self
    }

    /// The retry budget. Pass a clone of one budget to several clients to share it.
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.budget = budget;
        self
    }

    /// The retry decision (default [`DefaultPolicy`]).
    pub fn policy(mut self, policy: impl RetryPolicy) -> Self {
        self.policy = Box::new(policy);
        self
    }

    /// How the key is written in the header (default [`KeyFormat::Bare`]).
    pub fn key_format(mut self, format: KeyFormat) -> Self {
        self.config.key_format = format;
        self
    }

    /// The longest body read inside the retry loop (default 1 MiB). An answer up to this size is
    /// read whole within its attempt (and its attempt timeout), so a connection cut mid-body is a
    /// failed attempt, retried like one cut before the answer, and the body is kept on the
    /// [`Error`] when the answer was retried. A longer one is handed back unread beyond this
    /// size: reading it may then fail like any reqwest body. 0 reads only problem documents
    /// (up to 16 KiB, to tell idem's in-flight 409 from a final one).
    pub fn max_buffered_body(mut self, bytes: usize) -> Self {
        self.config.max_buffered_body = bytes;
        self
    }

    /// Builds the client, creating a reqwest client if none was given.
    ///
    /// # Errors
    /// When reqwest cannot create its client (its TLS backend or system configuration failed).
    pub fn build(mut self) -> Result<Client, reqwest::Error> {
        let http = match self.http.take() {
            Some(http) => http,
            None => reqwest::Client::builder().build()?,
        };
        Ok(self.build_with(http))
    }

    /// The same policy, limits and budget as a reqwest-middleware [`RetryMiddleware`]
    /// ([`http_client`](Self::http_client) does not apply: the stack has its own client).
    #[cfg(feature = "client-middleware")]
    #[cfg_attr(docsrs, doc(cfg(feature = "client-middleware")))]
    pub fn build_middleware(self) -> RetryMiddleware {
        RetryMiddleware::new(self.retrier())
    }

    fn build_with(self, http: reqwest::Client) -> Client {
        Client {
            http,
            retrier: self.retrier(),
        }
    }

    fn retrier(self) -> Arc<Retrier> {
        Arc::new(Retrier {
            config: self.config,
            policy: self.policy,
            budget: self.budget,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_keys_are_structured_field_strings() {
        assert_eq!(KeyFormat::Bare.render("a\"b"), "a\"b");
        assert_eq!(KeyFormat::Quoted.render("abc"), "\"abc\"");
        let quoted = KeyFormat::Quoted.render(r#"a"b\c"#);
        assert_eq!(quoted, r#""a\"b\\c""#);
        // idem's own parser reads it back as the same key.
        assert_eq!(
            crate::IdempotencyKey::parse(quoted.as_bytes())
                .unwrap()
                .as_str(),
            r#"a"b\c"#
        );
    }
}
