//! What README.md's examples share and do not show: a caller, a request and a response type, a
//! policy and a card network. README.md is compiled as this crate's doctests (see `Readme`),
//! so each of its Rust blocks imports these in one hidden line.

use axum::extract::FromRequestParts;
use axum::http::{request::Parts, StatusCode};
use idem_runtime::axum::Scope;
use idem_runtime::Policy;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::time::Duration;

/// README.md, whose Rust blocks `cargo test --workspace` compiles (and runs, unless `no_run`).
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct Readme;

/// The caller, from `Authorization: Bearer <user-id>` (as in the Quick start).
#[derive(Debug)]
pub struct User(pub String);

impl<S: Send + Sync> FromRequestParts<S> for User {
    type Rejection = StatusCode;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let header = parts
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        let token = header.and_then(|v| v.strip_prefix("Bearer "));
        token
            .map(|t| User(t.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

impl Scope for User {
    fn scope_id(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

/// A payment request.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NewPayment {
    /// In minor units.
    pub amount: i64,
    /// ISO 4217.
    pub currency: String,
}

/// A payment.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Payment {
    /// Its id.
    pub id: String,
    /// In minor units.
    pub amount: i64,
    /// ISO 4217.
    pub currency: String,
}

/// The payment endpoints' policy.
pub const PAYMENTS: Policy = Policy::new()
    .ttl(Duration::from_secs(24 * 3600))
    .lease(Duration::from_secs(10));

/// A card network that deduplicates charges by the key it is given.
#[derive(Debug, Clone, Copy)]
pub struct CardNetwork;

impl CardNetwork {
    /// Charges `payment` under `key`; a repeat of a key charges nothing more. Returns the charge id.
    pub async fn charge(&self, payment: &NewPayment, key: Option<&str>) -> String {
        format!("ch_{}_{}", key.unwrap_or("none"), payment.amount)
    }
}

/// The card network.
pub fn card_network() -> CardNetwork {
    CardNetwork
}
