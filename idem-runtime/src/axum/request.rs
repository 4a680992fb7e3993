//! Reading the request once: the body, buffered up to the endpoint's limit, and what the fingerprint
//! and the key need from the head.
//!
//! This runs while axum extracts the handler's last parameter, before any key is claimed: a body over
//! the limit or an unreadable body ends the request without touching the store, so the client's key
//! stays unused. The handler's own extractor of the body runs later, once the key is claimed
//! ([`Deferred`]): a replay answers without it, and its rejection releases the key.

use super::problem::{Problem, ProblemType};
use crate::fingerprint::{parse_json, Fingerprint};
use crate::key::{IdempotencyKey, KeyError};
use crate::source::KeySource;
use ::axum::body::Body;
use ::axum::extract::{OriginalUri, Request};
use ::axum::http::header::CONTENT_TYPE;
use ::axum::http::request::Parts;
use ::axum::http::{HeaderMap, HeaderName, HeaderValue};
use ::axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use std::future::Future;
use std::pin::Pin;

/// What the engine needs from the request, taken while extracting the last parameter: what the
/// fingerprint and the key are made of. The fingerprint and the key are worked out from it once
/// the handler's policy is known (`resolve`), as the policy says where the key
/// is and what the fingerprint covers. Small on purpose: it is moved through every layer of the
/// request's future.
#[derive(Debug, Clone)]
pub struct RequestContext {
    head: Box<Head>,
    /// The body, as read (shared with the handler's extractor, not copied).
    body: Bytes,
    /// GET, HEAD, OPTIONS or TRACE: safe by definition, passed through untouched.
    pub safe_method: bool,
    /// The handler's [`Attempt`](super::Attempt) extractor, if it has one, to fill in on claiming.
    pub attempt: Option<super::Attempt>,
}

/// The request head, as the fingerprint and the key take it.
#[derive(Debug, Clone)]
struct Head {
    method: String,
    path: String,
    content_type: Option<String>,
    headers: HeaderMap,
}

impl RequestContext {
    /// The request's fingerprint and its key, as `policy` takes them.
    pub(crate) fn resolve(&self, policy: &crate::Policy) -> (Fingerprint, KeyHeader) {
        let head = &self.head;
        let json = parse_json(head.content_type.as_deref(), &self.body);
        let key = match policy.key_source {
            KeySource::Header(name) => header_key(&head.headers, name),
            KeySource::BodyField(pointer) => body_key(json.as_ref(), pointer),
            _ => header_key(&head.headers, &IDEMPOTENCY_KEY),
        };
        let fingerprint = Fingerprint::of_covered(
            &head.method,
            &head.path,
            json,
            &self.body,
            &policy.fingerprint,
            &policy.key_source,
        );
        (fingerprint, key)
    }
}

/// The request's key, as read from the policy's [`KeySource`].
#[derive(Debug, Clone)]
pub enum KeyHeader {
    /// None.
    Missing,
    /// Exactly one, well-formed.
    Valid(crate::IdempotencyKey),
    /// Malformed, or sent more than once: the request is refused.
    Invalid(crate::KeyError),
}

/// The handler's last parameter, not yet extracted: an extractor of the body runs once the key is
/// claimed, so that a replay answers without it, whatever it would say of the request now. An
/// extractor of the request head is extracted at once.
pub struct Deferred<T>(Later<T>);

enum Later<T> {
    Ready(T),
    // One allocation: the extractor's future, which owns the request and a clone of the state.
    Extract(Pin<Box<dyn Future<Output = Result<T, Response>> + Send>>),
}

impl<T> Deferred<T> {
    /// A value to extract, when `extract` runs.
    pub(crate) fn later(
        extract: impl Future<Output = Result<T, Response>> + Send + 'static,
    ) -> Self {
        Self(Later::Extract(Box::pin(extract)))
    }

    /// A value extracted already.
    pub fn ready(value: T) -> Self {
        Self(Later::Ready(value))
    }

    /// The value, or the extractor's rejection as a response.
    pub async fn now(self) -> Result<T, Response> {
        match self.0 {
            Later::Ready(value) => Ok(value),
            Later::Extract(extract) => extract.await,
        }
    }
}

impl<T> std::fmt::Debug for Deferred<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.0 {
            Later::Ready(_) => "ready",
            Later::Extract(_) => "to extract",
        };
        f.debug_tuple("Deferred").field(&state).finish()
    }
}

/// The body, whole, or a 413 / 400 problem. A body already limited further out (by a middleware)
/// answers 413 over either limit.
pub(crate) async fn read_body(body: Body, limit: usize) -> Result<Bytes, Response> {
    match collect(Limited::new(body, limit)).await {
        Ok(bytes) => Ok(bytes),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
            tracing::debug!(target: "idem", limit, "request body over the limit");
            Err(Problem::new(
                ProblemType::BodyTooLarge,
                format!("The request body is larger than this endpoint accepts ({limit} bytes). The Idempotency-Key was not used."),
            )
            .into_response())
        }
        // A limit further out, inside idem's: its error arrives wrapped by the body around it.
        Err(error)
            if std::iter::successors(
                Some(&*error as &(dyn std::error::Error + 'static)),
                |e| e.source(),
            )
            .any(|e| e.is::<LengthLimitError>()) =>
        {
            tracing::debug!(target: "idem", "request body over a limit further out");
            Err(Problem::new(
                ProblemType::BodyTooLarge,
                "The request body is larger than this server accepts. The Idempotency-Key was not used.",
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

/// The body's data frames, joined. A body that arrives in one frame (any small request) is kept as
/// that frame, without a copy or a buffer list; only a body in several frames is copied into one.
async fn collect(
    mut body: Limited<Body>,
) -> Result<Bytes, Box<dyn std::error::Error + Send + Sync>> {
    let mut first = Bytes::new();
    let mut joined: Option<BytesMut> = None;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue; // trailers
        };
        match &mut joined {
            Some(buf) => buf.extend_from_slice(&data),
            None if first.is_empty() => first = data,
            None => {
                let mut buf = BytesMut::with_capacity(first.len() + data.len());
                buf.extend_from_slice(&first);
                buf.extend_from_slice(&data);
                joined = Some(buf);
            }
        }
    }
    Ok(joined.map_or(first, BytesMut::freeze))
}

/// The key's header, as a name: looking a header up by a `&str` parses and validates the name on
/// every request.
static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static(super::KEY_HEADER);

/// What the engine needs from the request: what its fingerprint and its key are made of.
pub(crate) fn context(parts: &Parts, body: &Bytes) -> RequestContext {
    let (method, path, content_type) = head(parts);
    RequestContext {
        head: Box::new(Head {
            method: method.to_owned(),
            path: path.to_owned(),
            content_type: content_type.map(str::to_owned),
            headers: parts.headers.clone(),
        }),
        body: body.clone(),
        safe_method: parts.method.is_safe(),
        attempt: parts.extensions.get::<super::Attempt>().cloned(),
    }
}

/// The request again, with the bytes read as its body, for the handler's own extractor.
pub(crate) fn rebuilt(mut parts: Parts, bytes: Bytes) -> Request {
    tidy_media_type(&mut parts.headers);
    Request::from_parts(parts, Body::from(bytes))
}

/// HTTP allows whitespace before a media type's parameters (`application/json ; charset=utf-8`),
/// which axum's `Json` refuses with a 415: the handler's extractor sees the type without it.
fn tidy_media_type(headers: &mut HeaderMap) {
    let Some(Ok(value)) = headers.get(CONTENT_TYPE).map(|v| v.to_str()) else {
        return;
    };
    if !value.contains([' ', '\t']) {
        return;
    }
    let tidy: Vec<&str> = value.split(';').map(str::trim).collect();
    if let Ok(tidy) = HeaderValue::from_str(&tidy.join(";")) {
        headers.insert(CONTENT_TYPE, tidy);
    }
}

/// The method, the path and the content type, as the fingerprint takes them. The path is the one
/// the client sent (before any `Router::nest` stripped a prefix), so that two nested endpoints
/// never share a fingerprint. A content type that is not visible ASCII is no JSON media type: the
/// body is then compared as bytes.
fn head(parts: &Parts) -> (&str, &str, Option<&str>) {
    let uri = parts
        .extensions
        .get::<OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    (
        parts.method.as_str(),
        uri.path_and_query().map_or(uri.path(), |pq| pq.as_str()),
        parts
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
    )
}

/// The key in the header `name`: sent once, and well-formed.
fn header_key<K: ::axum::http::header::AsHeaderName>(headers: &HeaderMap, name: K) -> KeyHeader {
    let mut keys = headers.get_all(name).iter();
    match (keys.next(), keys.next()) {
        (None, _) => KeyHeader::Missing,
        (Some(one), None) => match IdempotencyKey::parse(one.as_bytes()) {
            Ok(key) => KeyHeader::Valid(key),
            Err(error) => KeyHeader::Invalid(error),
        },
        (Some(_), Some(_)) => KeyHeader::Invalid(KeyError::Repeated),
    }
}

/// The key in the JSON body's member at `pointer`: a string of visible ASCII, or an integer. No
/// JSON body, no such member, or `null`: no key.
fn body_key(json: Option<&serde_json::Value>, pointer: &str) -> KeyHeader {
    use serde_json::Value;
    let text = match json.and_then(|v| v.pointer(pointer)) {
        None | Some(Value::Null) => return KeyHeader::Missing,
        Some(Value::String(text)) => text.clone(),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
        Some(_) => return KeyHeader::Invalid(KeyError::NotText),
    };
    match IdempotencyKey::from_text(&text) {
        Ok(key) => KeyHeader::Valid(key),
        Err(error) => KeyHeader::Invalid(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::axum::http::StatusCode;

    fn in_frames(frames: &[&'static str]) -> Body {
        let chunks: Vec<Result<Bytes, std::io::Error>> = frames
            .iter()
            .map(|f| Ok(Bytes::from_static(f.as_bytes())))
            .collect();
        Body::from_stream(futures_util::stream::iter(chunks))
    }

    #[tokio::test]
    async fn a_body_in_several_frames_is_read_whole_and_in_order() {
        let bytes = read_body(in_frames(&["{\"a\":", "", "1,\"b\":", "2}"]), 1024)
            .await
            .expect("within the limit");
        assert_eq!(&bytes[..], b"{\"a\":1,\"b\":2}");
        let single = read_body(in_frames(&["only"]), 1024)
            .await
            .expect("one frame");
        assert_eq!(&single[..], b"only");
        let empty = read_body(in_frames(&[]), 1024).await.expect("no frame");
        assert!(empty.is_empty());
    }

    #[tokio::test]
    async fn a_body_over_the_limit_across_frames_is_refused() {
        let refused = read_body(in_frames(&["12345", "67890", "x"]), 10)
            .await
            .expect_err("11 bytes over a 10-byte limit");
        assert_eq!(refused.status(), StatusCode::PAYLOAD_TOO_LARGE);
    }
}
