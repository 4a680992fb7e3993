//! Demo authentication: `Authorization: Bearer <user-id>`, where the token is the user id: 1 to 4096
//! lowercase letters, digits, `-` and `_` (`alice`, `user-1`). Any other token names no user and
//! is refused (401), as a real service refuses a token it cannot verify.
//!
//! Real services verify a token here; what idem needs from this type is only [`Scope`]: the caller's
//! id, so that one user's key never returns another user's payment.

use crate::problem::Problem;
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
            .filter(|id| is_user_id(id));
        match id {
            Some(id) => Ok(Self { id: id.to_owned() }),
            None => {
                let problem = Problem::new(
                    StatusCode::UNAUTHORIZED,
                    "urn:payments:problem:unauthorized",
                    "Unauthorized",
                )
                .detail("Send Authorization: Bearer <user-id>, a user id being 1 to 4096 of a-z, 0-9, - and _.");
                Err(([(WWW_AUTHENTICATE, "Bearer")], problem).into_response())
            }
        }
    }
}

/// The demo's user ids: 1 to 4096 lowercase ASCII letters, digits, `-` and `_`.
pub fn is_user_id(id: &str) -> bool {
    (1..=4096).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

impl Scope for AuthUser {
    fn scope_id(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.id)
    }
}
