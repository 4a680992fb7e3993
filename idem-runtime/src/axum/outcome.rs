//! What idem did with a request, carried in its response's extensions, so that the application's
//! own middleware can count, log or alter replays without a hook API of idem's.

use super::ProblemType;

/// What idem did with a request: in the extensions of every response an idempotent handler (or
/// [`IdempotencyLayer`](super::IdempotencyLayer)) answers with.
///
/// ```
/// use axum::{extract::Request, middleware::{self, Next}, response::Response};
/// use idem_runtime::axum::RequestOutcome;
///
/// // Counts replays and marks them for the client, in the application's own middleware.
/// async fn count_replays(request: Request, next: Next) -> Response {
///     let mut response = next.run(request).await;
///     if response.extensions().get::<RequestOutcome>() == Some(&RequestOutcome::Replayed) {
///         response.headers_mut().insert("x-served-from", "idempotency-store".parse().unwrap());
///     }
///     response
/// }
/// # let _: axum::Router = axum::Router::new().layer(middleware::from_fn(count_replays));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequestOutcome {
    /// The handler ran under a claimed key, and its response is stored for retries.
    Executed,
    /// The stored response of an earlier request with the key, replayed.
    Replayed,
    /// The handler ran (or its body extractor refused the request, or it panicked), and the key
    /// was released without storing the response: a retry runs it again. A 5xx (unless
    /// `server_errors` stores it), a 4xx under `client_errors = "release"`.
    Released,
    /// idem answered with this problem, and the handler did not run (a missing or malformed key,
    /// a mismatch, a request in flight, an expired key, an unavailable store, a body too large).
    Rejected(ProblemType),
    /// The handler ran without protection: a safe method, or no key under `missing_key = "pass"`.
    Unprotected,
}

impl RequestOutcome {
    /// Puts `self` in `response`'s extensions, unless an outcome is there already.
    pub(crate) fn mark(
        self,
        mut response: ::axum::response::Response,
    ) -> ::axum::response::Response {
        if response.extensions().get::<Self>().is_none() {
            response.extensions_mut().insert(self);
        }
        response
    }
}
