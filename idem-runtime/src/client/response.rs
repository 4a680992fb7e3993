//! The answer to a request, with the key it was sent under and whether it was a replay.

use super::policy::DeadKey;
use crate::IdempotencyKey;
use http::{HeaderMap, StatusCode};

/// The header idem servers set on a replayed answer.
pub const IDEMPOTENCY_REPLAYED: &str = "idempotency-replayed";
/// Stripe's spelling of the same marker, also recognised.
const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The final answer to a request: the answer the retry policy did not retry (a success, or a final
/// error status such as 422), with the key it was sent under and how many attempts it took.
///
/// An HTTP error status is still an answer: check [`status`](Self::status), as with reqwest, and
/// [`dead_key`](Self::dead_key) for idem's 422 and 410.
///
/// A body that fit in the client's buffer
/// ([`ClientBuilder::max_buffered_body`](super::ClientBuilder::max_buffered_body)) was read whole
/// before the client returned, so reading it here cannot fail on a cut connection (that attempt
/// was retried).
///
/// Through the `RetryMiddleware` (feature `client-middleware`), the same view of a
/// `reqwest::Response` is [`Response::from`] it.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_runtime::client::Client;
///
/// let client = Client::builder().build()?;
/// let response = client.post("http://127.0.0.1:3000/payments").send().await?;
/// println!(
///     "{} (key {:?}, {} attempts, replayed: {})",
///     response.status(),
///     response.key().map(|k| k.as_str()),
///     response.attempts(),
///     response.replayed(),
/// );
/// let body: serde_json::Value = response.json().await?;
/// # let _ = body;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Response {
    inner: reqwest::Response,
    receipt: Receipt,
}

/// What the attempt loop knows about the answer it returns, carried in the `reqwest::Response`'s
/// extensions so that the middleware form keeps it too.
#[derive(Debug, Clone)]
pub(crate) struct Receipt {
    pub(crate) key: Option<IdempotencyKey>,
    pub(crate) attempts: u32,
    pub(crate) problem_type: Option<String>,
}

impl From<reqwest::Response> for Response {
    /// The view of a response returned through the `RetryMiddleware`:
    /// its key, attempts and problem type. A response that did not pass through it reads as one
    /// attempt without a key.
    fn from(mut inner: reqwest::Response) -> Self {
        let receipt = inner.extensions_mut().remove::<Receipt>();
        Self {
            inner,
            receipt: receipt.unwrap_or(Receipt {
                key: None,
                attempts: 1,
                problem_type: None,
            }),
        }
    }
}

impl Response {
    /// The `Idempotency-Key` every attempt carried (`None` if the request had none).
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.receipt.key.as_ref()
    }

    /// How many attempts it took (1 if the first one was answered for good).
    pub fn attempts(&self) -> u32 {
        self.receipt.attempts
    }

    /// The `type` of an `application/problem+json` body (RFC 9457), if the answer is one.
    pub fn problem_type(&self) -> Option<&str> {
        self.receipt.problem_type.as_deref()
    }

    /// Whether this is idem's answer that the key can no longer be used (422 key mismatch, 410 key
    /// expired): see [`DeadKey`] for what to do.
    pub fn dead_key(&self) -> Option<DeadKey> {
        DeadKey::from_answer(self.status(), self.problem_type())
    }

    /// Whether the server replayed a stored answer instead of running the request again
    /// (`Idempotency-Replayed: true`, or Stripe's `Idempotent-Replayed: true`).
    pub fn replayed(&self) -> bool {
        [IDEMPOTENCY_REPLAYED, IDEMPOTENT_REPLAYED]
            .iter()
            .any(|name| {
                self.inner
                    .headers()
                    .get(*name)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
            })
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.inner.status()
    }

    /// The headers.
    pub fn headers(&self) -> &HeaderMap {
        self.inner.headers()
    }

    /// The final URL (after redirects).
    pub fn url(&self) -> &reqwest::Url {
        self.inner.url()
    }

    /// Deserializes the body as JSON.
    pub async fn json<T: serde::de::DeserializeOwned>(self) -> reqwest::Result<T> {
        self.inner.json().await
    }

    /// The body as text.
    pub async fn text(self) -> reqwest::Result<String> {
        self.inner.text().await
    }

    /// The body as bytes.
    pub async fn bytes(self) -> reqwest::Result<bytes::Bytes> {
        self.inner.bytes().await
    }

    /// The reqwest response, for everything else (streaming the body, extensions, ...).
    pub fn into_inner(self) -> reqwest::Response {
        self.inner
    }
}
