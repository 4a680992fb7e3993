//! The answer to a request, with the key it was sent under and whether it was a replay.

use crate::IdempotencyKey;
use http::{HeaderMap, StatusCode};

/// The header idem servers set on a replayed answer.
pub const IDEMPOTENCY_REPLAYED: &str = "idempotency-replayed";
/// Stripe's spelling of the same marker, also recognised.
const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The final answer to a request: the answer the retry policy did not retry (a success, or a final
/// error status such as 422), with the key it was sent under and how many attempts it took.
///
/// An HTTP error status is still an answer: check [`status`](Self::status), as with reqwest.
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
    key: Option<IdempotencyKey>,
    attempts: u32,
}

impl Response {
    pub(crate) fn new(
        inner: reqwest::Response,
        key: Option<IdempotencyKey>,
        attempts: u32,
    ) -> Self {
        Self {
            inner,
            key,
            attempts,
        }
    }

    /// The `Idempotency-Key` every attempt carried (`None` if keys were disabled for this request).
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }

    /// How many attempts it took (1 if the first one was answered for good).
    pub fn attempts(&self) -> u32 {
        self.attempts
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
