//! A request being built, and the choice of its key.

use super::error::{chain, CauseKind, Failures, StopReason};
use super::policy::is_idempotent;
use super::{Client, Error, Response, IDEMPOTENCY_KEY};
use crate::IdempotencyKey;
use http::header::{HeaderName, HeaderValue};
use http::Method;

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
    key: Option<KeyChoice>,
}

impl RequestBuilder {
    pub(super) fn new(client: Client, method: Method, inner: reqwest::RequestBuilder) -> Self {
        Self {
            client,
            method,
            inner,
            key: None,
        }
    }

    /// Sends this key on every attempt (for example a key stored with the business object, so that
    /// a retry after a restart of this process is still recognised).
    pub fn idempotency_key(mut self, key: IdempotencyKey) -> Self {
        self.key = Some(KeyChoice::Given(key));
        self
    }

    /// Sends a fresh key on every attempt, whatever the method: the default for POST and PATCH;
    /// ask for it on a PUT or DELETE whose server deduplicates by key. See [`KeyChoice`].
    pub fn with_idempotency_key(mut self) -> Self {
        self.key = Some(KeyChoice::Generate);
        self
    }

    /// Sends no `Idempotency-Key` (the default for GET, HEAD, OPTIONS, TRACE, PUT and DELETE).
    /// POST and PATCH requests are then never retried by the
    /// [`DefaultPolicy`](super::DefaultPolicy): a second attempt could be a second effect.
    pub fn without_idempotency_key(mut self) -> Self {
        self.key = Some(KeyChoice::Omit);
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
    ///     .with_reqwest(|b| b.version(idem_runtime::http::Version::HTTP_11))
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
        match inner.build() {
            Ok(request) => {
                let mut http = &client.http;
                let sent = client.retrier.send(&mut http, request, key).await;
                sent.map(Response::from)
            }
            Err(e) => {
                let mut failures = Failures::new(method, None, None);
                failures.transport(CauseKind::Invalid, chain(&e), Some(Box::new(e)));
                Err(failures.into_error(0, StopReason::InvalidRequest))
            }
        }
    }
}

/// Which `Idempotency-Key` a request carries.
///
/// Without a choice, requests whose method is not idempotent by itself (POST, PATCH, and methods
/// HTTP does not define) get a fresh key, and GET, HEAD, OPTIONS, TRACE, PUT and DELETE get none:
/// they mean the same thing sent twice, so the [`DefaultPolicy`](super::DefaultPolicy) retries
/// them without one. Ask for a key on a PUT or DELETE whose server deduplicates by key. A key set
/// as a header by hand is the request's key unless [`Given`](Self::Given) replaces it.
///
/// On the [`Client`], choose with [`RequestBuilder::idempotency_key`],
/// [`with_idempotency_key`](RequestBuilder::with_idempotency_key) and
/// [`without_idempotency_key`](RequestBuilder::without_idempotency_key); through the
/// `RetryMiddleware`, put a `KeyChoice` in the request's extensions (reqwest-middleware's
/// `RequestBuilder::with_extension`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyChoice {
    /// A fresh UUID v4 key.
    Generate,
    /// This key (for example one stored with the business object, so that a retry after a
    /// restart of this process is still recognised).
    Given(IdempotencyKey),
    /// No key.
    Omit,
}

/// The key the request will carry, written into its headers. Precedence: a key
/// [`Given`](KeyChoice::Given), then one set as a header by hand, then the choice or the method's
/// default.
pub(crate) fn resolve_key(
    request: &mut reqwest::Request,
    choice: Option<KeyChoice>,
    format: super::KeyFormat,
) -> Result<Option<IdempotencyKey>, String> {
    let by_hand = request.headers().get(IDEMPOTENCY_KEY).map(|v| {
        IdempotencyKey::parse(v.as_bytes())
            .map_err(|e| format!("the Idempotency-Key header set on the request is invalid: {e}"))
    });
    let choice = choice.unwrap_or(if is_idempotent(request.method()) {
        KeyChoice::Omit
    } else {
        KeyChoice::Generate
    });
    let key = match (choice, by_hand) {
        (KeyChoice::Given(key), _) => key,
        (_, Some(parsed)) => parsed?,
        (KeyChoice::Omit, None) => return Ok(None),
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
