//! Shared by the UI cases: an application state that holds the idem engine, an authenticated-user
//! extractor that is a scope, a request body type, and a check that a handler routes.
#![allow(dead_code)]

use axum::extract::{FromRef, FromRequestParts};
use axum::http::request::Parts;
use axum::http::StatusCode;
use idem_runtime::axum::Scope;
use idem_runtime::Engine;
use std::borrow::Cow;

#[derive(Clone)]
pub struct App {
    pub engine: Engine,
    pub name: String,
}

impl FromRef<App> for Engine {
    fn from_ref(app: &App) -> Engine {
        app.engine.clone()
    }
}

/// Demo auth: the bearer token is the user id.
pub struct AuthUser {
    pub id: String,
}

impl<S: Send + Sync> FromRequestParts<S> for AuthUser {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        parts
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|id| AuthUser { id: id.to_owned() })
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl Scope for AuthUser {
    fn scope_id(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.id)
    }
}

#[derive(serde::Deserialize, serde::Serialize)]
pub struct NewPayment {
    pub amount: u64,
    pub currency: String,
}

/// Compiles only if `handler` is an axum handler for a router whose state is `App`.
pub fn route<H, T>(handler: H) -> axum::Router<App>
where
    H: axum::handler::Handler<T, App>,
    T: 'static,
{
    axum::Router::new().route("/", axum::routing::post(handler))
}
