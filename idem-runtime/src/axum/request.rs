//! Reading the request once: the body, buffered up to the endpoint's limit, and what the fingerprint
//! and the key need from the head.
//!
//! This runs while axum extracts the handler's last parameter, before any key is claimed: a body over
//! the limit, an unreadable body, or a rejection by the handler's own extractor ends the request
//! without touching the store, so the client's key stays unused.

use super::private::RequestContext;
use super::problem::{Problem, ProblemType};
use ::axum::body::Body;
use ::axum::extract::OriginalUri;
use ::axum::http::request::Parts;
use ::axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};

/// The body, whole, or a 413 / 400 problem.
pub(crate) async fn read_body(body: Body, limit: usize) -> Result<Bytes, Response> {
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
            tracing::debug!(target: "idem", limit, "request body over the limit");
            Err(Problem::new(
                ProblemType::BodyTooLarge,
                format!("The request body is larger than this endpoint accepts ({limit} bytes). The Idempotency-Key was not used."),
            )
            .into_response())
        }
        Err(error) => {
            tracing::debug!(target: "idem", %error, "request body could not be read");
            Err(Problem::new(
                ProblemType::UnreadableBody,
                "The request body could not be read. The Idempotency-Key was not used; send the request again.",
            )
            .into_response())
        }
    }
}

/// What the engine needs from the request head, plus the body.
///
/// The path is the one the client sent (before any `Router::nest` stripped a prefix), so that two
/// nested endpoints never share a fingerprint.
pub(crate) fn context(parts: &Parts, body: Bytes) -> RequestContext {
    let uri = parts
        .extensions
        .get::<OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    RequestContext {
        method: parts.method.clone(),
        path: uri
            .path_and_query()
            .map_or_else(|| uri.path().to_owned(), |pq| pq.as_str().to_owned()),
        content_type: parts
            .headers
            .get(::axum::http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned),
        keys: parts
            .headers
            .get_all("idempotency-key")
            .iter()
            .cloned()
            .collect(),
        body,
    }
}
