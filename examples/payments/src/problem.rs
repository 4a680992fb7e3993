//! The example's own errors as RFC 9457 problem documents (`application/problem+json`), the form
//! idem answers in, so that a client reads every error of this API one way.
//!
//! [`Json`] is the request-body extractor of the payment handlers: axum's `Json`, whose rejections
//! (a body that is not JSON, JSON of the wrong shape, a missing `Content-Type: application/json`)
//! axum answers in `text/plain`, answered here as problems instead. With `#[idempotent]` the body's
//! extractor runs once the key is claimed, and its rejection releases the key: the corrected
//! request may use it.

use axum::extract::rejection::JsonRejection;
use axum::extract::FromRequest;
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// A JSON request body; its rejection is a [`Problem`] (see the [module](self)).
#[derive(Debug, FromRequest)]
#[from_request(via(axum::Json), rejection(Problem))]
pub(crate) struct Json<T>(pub(crate) T);

/// An RFC 9457 problem document. In the API document it is idem's `ProblemDetails` schema, which
/// idem's problems share.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = ProblemDetails)]
pub(crate) struct Problem {
    /// A URI identifying the problem type, such as `urn:payments:problem:malformed-body`.
    #[serde(rename = "type")]
    kind: &'static str,
    /// A short summary of the problem type.
    title: &'static str,
    /// The HTTP status code.
    status: u16,
    /// What happened in this occurrence, and what to do.
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
    /// A URI identifying this occurrence.
    #[serde(skip_serializing_if = "Option::is_none")]
    instance: Option<String>,
    /// `Retry-After`, in seconds, for a problem that a retry may fix.
    #[serde(skip)]
    retry_after: Option<u32>,
}

impl Problem {
    /// A problem of type `urn:payments:problem:<kind>`.
    pub(crate) fn new(status: StatusCode, kind: &'static str, title: &'static str) -> Self {
        Self {
            kind,
            title,
            status: status.as_u16(),
            detail: None,
            instance: None,
            retry_after: None,
        }
    }

    /// Says what happened, and what to do.
    pub(crate) fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Adds `Retry-After: <seconds>`.
    pub(crate) fn retry_after(mut self, seconds: u32) -> Self {
        self.retry_after = Some(seconds);
        self
    }
}

/// `urn:payments:problem:unsupported-media-type`: a body sent without `Content-Type: application/json`.
pub(crate) const UNSUPPORTED_MEDIA_TYPE: &str = "urn:payments:problem:unsupported-media-type";
/// `urn:payments:problem:malformed-body`: a body that is not JSON.
pub(crate) const MALFORMED_BODY: &str = "urn:payments:problem:malformed-body";
/// `urn:payments:problem:invalid-body`: JSON that is not the request the endpoint takes.
pub(crate) const INVALID_BODY: &str = "urn:payments:problem:invalid-body";
/// `urn:payments:problem:unreadable-body`: a body that could not be read.
pub(crate) const UNREADABLE_BODY: &str = "urn:payments:problem:unreadable-body";

impl From<JsonRejection> for Problem {
    fn from(rejection: JsonRejection) -> Self {
        let (kind, title) = match &rejection {
            JsonRejection::MissingJsonContentType(_) => {
                (UNSUPPORTED_MEDIA_TYPE, "Unsupported media type")
            }
            JsonRejection::JsonSyntaxError(_) => (MALFORMED_BODY, "Malformed JSON body"),
            JsonRejection::JsonDataError(_) => (INVALID_BODY, "Invalid request body"),
            _ => (UNREADABLE_BODY, "Unreadable request body"),
        };
        Self::new(rejection.status(), kind, title).detail(rejection.body_text())
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_REQUEST);
        let body = serde_json::to_string(&self).unwrap_or_default();
        let mut response =
            (status, [(CONTENT_TYPE, "application/problem+json")], body).into_response();
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert(RETRY_AFTER, seconds.into());
        }
        response
    }
}
