//! RFC 9457 problem details: how idem tells a client what went wrong and what to do next.
//!
//! Every error idem answers itself is an `application/problem+json` document with a stable `type`
//! URI, a `title` (the same for every occurrence of the type), the `status`, and a `detail` about
//! this occurrence. Clients should branch on `type`, never on `title` or `detail`:
//!
//! | `type` | status | meaning | what the client should do |
//! |---|---|---|---|
//! | `urn:idem:problem:missing-key` | 400 | the endpoint requires an `Idempotency-Key` | send one |
//! | `urn:idem:problem:malformed-key` | 400 | not 1–255 visible ASCII characters, or the header was sent twice | fix the key |
//! | `urn:idem:problem:unreadable-body` | 400 | the request body could not be read | send the request again |
//! | `urn:idem:problem:body-too-large` | 413 | the body is over the endpoint's limit; no key was used | send a smaller body |
//! | `urn:idem:problem:key-mismatch` | 422 | the key was used for a different request (another body, method or endpoint) | never retry with this key |
//! | `urn:idem:problem:in-flight` | 409 | an identical request with this key is still running | retry the same key after `Retry-After` |
//! | `urn:idem:problem:key-expired` | 410 | the key is past its ttl; its result is no longer known | decide whether to send again under a new key |
//! | `urn:idem:problem:store-unavailable` | 503 | the idempotency store could not be reached (or the service is shutting down); nothing ran | retry the same key after `Retry-After` |
//! | `urn:idem:problem:busy` | 503 | the store is up but every pooled connection is in use; nothing ran | retry the same key after `Retry-After` |
//!
//! ```
//! use idem_runtime::axum::problem::ProblemType;
//! assert_eq!(ProblemType::KeyMismatch.uri(), "urn:idem:problem:key-mismatch");
//! assert_eq!(ProblemType::KeyMismatch.status(), 422);
//! ```

use crate::clock::Timestamp;
use ::axum::http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use ::axum::http::StatusCode;
use ::axum::response::{IntoResponse, Response};
use std::time::Duration;

/// The media type of problem documents.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The kinds of problem idem answers, each with a stable `type` URI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemType {
    /// 400: the endpoint requires an `Idempotency-Key` and none was sent.
    MissingKey,
    /// 400: the `Idempotency-Key` is not a valid key, or was sent more than once.
    MalformedKey,
    /// 400: the request body could not be read.
    UnreadableBody,
    /// 413: the request body is larger than the endpoint accepts.
    BodyTooLarge,
    /// 422: the key was already used for a different request. Never retry with this key.
    KeyMismatch,
    /// 409: an identical request holds the key. Retry with the same key after `Retry-After`.
    InFlight,
    /// 410: the key expired. Send again under a new key if the operation should happen again.
    KeyExpired,
    /// 503: the idempotency store is unavailable and the request did not run. Retry later.
    StoreUnavailable,
    /// 503: the store is up but had no free connection, and the request did not run. Retry later.
    Busy,
}

impl ProblemType {
    /// Every problem type, in a stable order.
    pub const ALL: [ProblemType; 9] = [
        ProblemType::MissingKey,
        ProblemType::MalformedKey,
        ProblemType::UnreadableBody,
        ProblemType::BodyTooLarge,
        ProblemType::KeyMismatch,
        ProblemType::InFlight,
        ProblemType::KeyExpired,
        ProblemType::StoreUnavailable,
        ProblemType::Busy,
    ];

    /// The stable `type` URI.
    pub const fn uri(self) -> &'static str {
        match self {
            ProblemType::MissingKey => "urn:idem:problem:missing-key",
            ProblemType::MalformedKey => "urn:idem:problem:malformed-key",
            ProblemType::UnreadableBody => "urn:idem:problem:unreadable-body",
            ProblemType::BodyTooLarge => "urn:idem:problem:body-too-large",
            ProblemType::KeyMismatch => "urn:idem:problem:key-mismatch",
            ProblemType::InFlight => "urn:idem:problem:in-flight",
            ProblemType::KeyExpired => "urn:idem:problem:key-expired",
            ProblemType::StoreUnavailable => "urn:idem:problem:store-unavailable",
            ProblemType::Busy => "urn:idem:problem:busy",
        }
    }

    /// The HTTP status code.
    pub const fn status(self) -> u16 {
        match self {
            ProblemType::MissingKey | ProblemType::MalformedKey | ProblemType::UnreadableBody => {
                400
            }
            ProblemType::BodyTooLarge => 413,
            ProblemType::KeyMismatch => 422,
            ProblemType::InFlight => 409,
            ProblemType::KeyExpired => 410,
            ProblemType::StoreUnavailable | ProblemType::Busy => 503,
        }
    }

    /// The short, occurrence-independent summary.
    pub const fn title(self) -> &'static str {
        match self {
            ProblemType::MissingKey => "Idempotency-Key required",
            ProblemType::MalformedKey => "Malformed Idempotency-Key",
            ProblemType::UnreadableBody => "Request body could not be read",
            ProblemType::BodyTooLarge => "Request body too large",
            ProblemType::KeyMismatch => "Idempotency-Key reused for a different request",
            ProblemType::InFlight => "Request with this Idempotency-Key still in progress",
            ProblemType::KeyExpired => "Idempotency-Key expired",
            ProblemType::StoreUnavailable => "Idempotency store unavailable",
            ProblemType::Busy => "Server busy",
        }
    }

    /// The problem type whose URI is `uri`, if any (for clients that branch on `type`).
    pub fn from_uri(uri: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.uri() == uri)
    }
}

/// One problem occurrence, ready to become a response.
#[derive(Debug, Clone)]
pub(crate) struct Problem {
    kind: ProblemType,
    detail: String,
    retry_after: Option<Duration>,
    expires_at: Option<Timestamp>,
}

impl Problem {
    pub(crate) fn new(kind: ProblemType, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            retry_after: None,
            expires_at: None,
        }
    }

    /// Adds `Retry-After` (whole seconds, rounded up, at least 1).
    pub(crate) fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// Adds the `Idempotency-Expires` header: until when the key stays bound to its first request.
    pub(crate) fn expires_at(mut self, at: Timestamp) -> Self {
        self.expires_at = Some(at);
        self
    }
}

/// `Retry-After` in whole seconds: rounded up, so a client never comes back before the hint, and at
/// least one.
pub(crate) fn retry_after_secs(after: Duration) -> u64 {
    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    secs.max(1)
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = self.kind.status();
        // A struct rather than `json!`, so the members come out in RFC 9457's order.
        #[derive(serde::Serialize)]
        struct Document<'a> {
            r#type: &'static str,
            title: &'static str,
            status: u16,
            detail: &'a str,
        }
        let body = serde_json::to_string(&Document {
            r#type: self.kind.uri(),
            title: self.kind.title(),
            status,
            detail: &self.detail,
        })
        .unwrap_or_default();
        let mut response = (
            StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            body,
        )
            .into_response();
        response
            .extensions_mut()
            .insert(super::RequestOutcome::Rejected(self.kind));
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(after) = self.retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        }
        if let Some(at) = self.expires_at {
            super::respond::set_expires(headers, at);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_are_distinct_and_round_trip() {
        for t in ProblemType::ALL {
            assert_eq!(ProblemType::from_uri(t.uri()), Some(t));
            assert!(t.uri().starts_with("urn:idem:problem:"));
        }
        let uris: std::collections::HashSet<_> = ProblemType::ALL.iter().map(|t| t.uri()).collect();
        assert_eq!(uris.len(), ProblemType::ALL.len());
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(30)), 30);
    }
}
