//! The client's policy as a reqwest-middleware `Middleware`, over the same attempt loop.

use super::retry::{NoAnswer, Transport};
use super::{ClientBuilder, KeyChoice, Retrier};
use http::Extensions;
use reqwest_middleware::Next;
use std::future::Future;
use std::sync::Arc;

/// idem's retry policy, keys, limits and budget as a `reqwest_middleware::Middleware`, for a
/// service whose requests already go through a `reqwest_middleware::ClientWithMiddleware`.
///
/// Build it from a [`ClientBuilder`] ([`build_middleware`](ClientBuilder::build_middleware)) and
/// add it to the stack. It behaves as the [`Client`](super::Client) does: the same key on every
/// attempt (POST and PATCH get one unless the request has one or a [`KeyChoice`] extension says
/// otherwise), bodies read inside the retry loop, `Retry-After` honoured, the budget shared by
/// every request through this middleware and its clones.
///
/// What it returns: a `reqwest::Response` to read as a [`Response`](super::Response) with
/// [`Response::from`](super::Response::from) (key, attempts, replayed, dead key), or, when every
/// attempt failed, a `reqwest_middleware::Error` holding this module's [`Error`](super::Error)
/// ([`Error::from_middleware`](super::Error::from_middleware)).
///
/// Middlewares added after it run once per attempt (a tracing middleware there gives a span per
/// attempt); those before it see one logical request.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use idem_runtime::client::{reqwest, reqwest_middleware, Client, KeyChoice, Response};
///
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(Client::builder().max_attempts(4).build_middleware())
///     .build();
/// // A PUT gets no key by default; this one's server deduplicates by key.
/// let answer = client
///     .put("http://127.0.0.1:3000/payments/7/capture")
///     .with_extension(KeyChoice::Generate)
///     .send()
///     .await?;
/// let answer = Response::from(answer);
/// println!("{} after {} attempts", answer.status(), answer.attempts());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct RetryMiddleware {
    retrier: Arc<Retrier>,
}

impl RetryMiddleware {
    pub(super) fn new(retrier: Arc<Retrier>) -> Self {
        Self { retrier }
    }
}

impl Default for RetryMiddleware {
    /// The defaults of [`Client::builder`](super::Client::builder).
    fn default() -> Self {
        ClientBuilder::default().build_middleware()
    }
}

#[async_trait::async_trait]
impl reqwest_middleware::Middleware for RetryMiddleware {
    async fn handle(
        &self,
        request: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let choice = extensions.get::<KeyChoice>().cloned();
        let mut rest = Rest { next, extensions };
        self.retrier
            .send(&mut rest, request, choice)
            .await
            .map_err(reqwest_middleware::Error::middleware)
    }
}

/// The rest of the stack, run once per attempt.
struct Rest<'a, 'e> {
    next: Next<'a>,
    extensions: &'e mut Extensions,
}

impl Transport for Rest<'_, '_> {
    fn send(
        &mut self,
        request: reqwest::Request,
    ) -> impl Future<Output = Result<reqwest::Response, NoAnswer>> + Send {
        let sent = self.next.clone().run(request, self.extensions);
        async move { sent.await.map_err(NoAnswer::from) }
    }
}
