//! Demo authentication: `Authorization: Bearer <user-id>`, where the token is the user id.
//!
//! Real services verify a token here; what idem needs from this type is only [`Scope`]: the caller's
//! id, so that one user's key never returns another user's payment.

use axum::extract::FromRequestParts;
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem_runtime::axum::Scope;
use std::borrow::Cow;

/// The authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthUser {
    /// The user id (the bearer token, in this demo).
    pub id: String,
}

impl<S: Send + Sync> FromRequestParts<S> for AuthUser {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Response> {
        let id = parts
            .headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_graphic()));
        match id {
            Some(id) => Ok(Self { id: id.to_owned() }),
            None => Err((
                StatusCode::UNAUTHORIZED,
                [(WWW_AUTHENTICATE, "Bearer")],
                "send Authorization: Bearer <user-id>",
            )
                .into_response()),
        }
    }
}

impl Scope for AuthUser {
    fn scope_id(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.id)
    }
}
