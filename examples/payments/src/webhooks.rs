//! `POST /webhooks/card-network`: the card network's webhooks, delivered as Standard Webhooks
//! (<https://www.standardwebhooks.com>): headers `webhook-id`, `webhook-timestamp` and
//! `webhook-signature` (`v1,` and the base64 HMAC-SHA256 of `{id}.{timestamp}.{body}` under the
//! secret `WEBHOOK_SECRET`), verified by the `standardwebhooks` crate.
//!
//! - `verify`, a middleware on the route, checks the signature and the timestamp (at most five
//!   minutes off) over the raw body before anything else: a bad delivery is a 401 and claims no
//!   key, so a forged or stale delivery burns nothing.
//! - The handler is idempotent on the delivery's `webhook-id` (`key_header`), scoped to the
//!   sender ([`CardNetworkSender`]), not to a user: each delivery id has its effect once, and the
//!   network's redeliveries get the stored answer with `Idempotency-Replayed: true`.
//! - `charge.disputed` counts a dispute on the payment (`disputes` in `GET /payments/{id}`); an
//!   unknown payment is a 404, stored like any 4xx (a redelivery is told the same).

use crate::api::{api_error, database_error, ApiError};
use crate::ledger::Ledger;
use crate::problem::{Json, Problem};
use crate::StartError;
use axum::body::Body;
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idem_runtime::axum::Scope;
use idem_runtime::idempotent;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::sync::Arc;

/// The default `WEBHOOK_SECRET`, in Standard Webhooks' `whsec_` + base64 form.
pub const DEFAULT_WEBHOOK_SECRET: &str = "whsec_cGF5bWVudHMtZXhhbXBsZS1zZWNyZXQ=";

/// The largest delivery read: card network events are small.
const MAX_DELIVERY: usize = 64 * 1024;

/// Verifies the card network's signatures with the shared secret.
#[derive(Clone)]
pub struct WebhookSecret(Arc<standardwebhooks::Webhook>);

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSecret(..)") // never the secret
    }
}

impl WebhookSecret {
    /// The secret `whsec_<base64>` (or bare base64); a malformed one stops the start-up.
    pub fn new(secret: &str) -> Result<Self, StartError> {
        let webhook = standardwebhooks::Webhook::new(secret.trim()).map_err(|e| {
            StartError::Config(format!("WEBHOOK_SECRET must be `whsec_` and base64: {e}"))
        })?;
        Ok(Self(Arc::new(webhook)))
    }

    /// Signs a delivery as the card network does: the `webhook-signature` value. For tests and
    /// demos.
    pub fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> Option<String> {
        self.0.sign(id, timestamp, body).ok()
    }
}

/// Who sent a verified delivery: the card network. Present only after `verify` accepted the
/// signature; the idempotency records of its deliveries are scoped to it.
#[derive(Debug, Clone, Copy)]
pub struct CardNetworkSender;

impl Scope for CardNetworkSender {
    fn scope_id(&self) -> Cow<'_, str> {
        Cow::Borrowed("card-network")
    }
}

impl<S: Send + Sync> FromRequestParts<S> for CardNetworkSender {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        parts
            .extensions
            .get::<CardNetworkSender>()
            .copied()
            .ok_or_else(|| unsigned("the delivery was not verified"))
    }
}

fn unsigned(detail: &str) -> Response {
    Problem::new(StatusCode::UNAUTHORIZED, "urn:payments:problem:bad-signature", "Bad webhook signature")
        .detail(format!("{detail}: sign `{{webhook-id}}.{{webhook-timestamp}}.{{body}}` with the shared secret (HMAC-SHA256, `v1,<base64>`), with a timestamp within 5 minutes of now."))
        .into_response()
}

/// The route's middleware: verifies the delivery's signature and timestamp over its raw body,
/// then lets it through to the idempotent handler, marked as sent by the card network. A bad one
/// is a 401 before any idempotency key is claimed.
pub(crate) async fn verify(
    State(secret): State<WebhookSecret>,
    request: Request,
    next: Next,
) -> Response {
    let (mut parts, body) = request.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_DELIVERY).await {
        Ok(bytes) => bytes,
        Err(_) => {
            let problem = Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "urn:payments:problem:body-too-large",
                "Delivery too large",
            );
            return problem
                .detail("The delivery is over 64 KiB, or could not be read.")
                .into_response();
        }
    };
    // Judged here with checked arithmetic before the crate sees it: a timestamp far outside any
    // clock's range (`i64::MIN`, say) must be a 401, never an overflow.
    if !timestamp_is_recent(&parts.headers, std::time::SystemTime::now()) {
        return unsigned(
            "the delivery's timestamp is missing, malformed or more than 5 minutes off",
        );
    }
    if let Err(error) = secret.0.verify(&bytes, &parts.headers) {
        tracing::info!(%error, "webhook refused");
        return unsigned(&format!("the delivery's {error}"));
    }
    parts.extensions.insert(CardNetworkSender);
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// How far a delivery's `webhook-timestamp` may be from now, as the Standard Webhooks spec advises.
const TIMESTAMP_TOLERANCE_SECS: u64 = 5 * 60;

/// Whether `webhook-timestamp` is whole seconds since the epoch within the tolerance of `now`.
fn timestamp_is_recent(headers: &axum::http::HeaderMap, now: std::time::SystemTime) -> bool {
    let Some(sent) = headers
        .get("webhook-timestamp")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<i64>().ok())
    else {
        return false;
    };
    let Ok(now) = now.duration_since(std::time::UNIX_EPOCH) else {
        return false;
    };
    let now = i64::try_from(now.as_secs()).unwrap_or(i64::MAX);
    now.checked_sub(sent)
        .is_some_and(|skew| skew.unsigned_abs() <= TIMESTAMP_TOLERANCE_SECS)
}

/// A card network event: `{"type": "charge.disputed", "data": {"payment_id": "pay_..."}}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct Event {
    /// The event type; `charge.disputed` is the one handled.
    #[serde(rename = "type")]
    kind: String,
    /// What the event is about.
    data: EventData,
}

/// The payment an event is about.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct EventData {
    /// The payment's id, `pay_...`.
    payment_id: String,
}

/// What the handler made of a delivery.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct Received {
    /// The event type.
    received: String,
    /// The payment.
    payment_id: String,
    /// The payment's disputes after this one.
    disputes: i64,
}

/// A card network webhook (Standard Webhooks)
///
/// Authenticated by its signature, not by `Authorization`. Each `webhook-id` takes effect once;
/// redeliveries get the stored answer.
#[idempotent(scope = "sender", key_header = "webhook-id", ttl = "7d")]
#[utoipa::path(
    post,
    path = "/webhooks/card-network",
    tag = "webhooks",
    security(()),
    request_body = Event,
    params(
        ("webhook-timestamp" = i64, Header, description = "Seconds since the Unix epoch; at most 5 minutes off."),
        ("webhook-signature" = String, Header, description = "`v1,` and the base64 HMAC-SHA256 of `{webhook-id}.{webhook-timestamp}.{body}`."),
    ),
    responses(
        (status = 200, description = "The event, received", body = Received),
        (status = 401, description = "A missing or bad signature, or a timestamp more than 5 minutes off: nothing was done", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such payment (stored: a redelivery gets it again)", body = ApiError),
        (status = 422, description = "An event type this service does not handle", body = ApiError),
    ),
)]
pub(crate) async fn card_network_webhook(
    State(ledger): State<Ledger>,
    sender: CardNetworkSender,
    Json(event): Json<Event>,
) -> Response {
    let _ = sender;
    if event.kind != "charge.disputed" {
        let message = format!("unhandled event type `{}`", event.kind);
        return api_error(StatusCode::UNPROCESSABLE_ENTITY, &message);
    }
    match ledger.dispute(&event.data.payment_id).await {
        Ok(Some(payment)) => axum::Json(Received {
            received: event.kind,
            payment_id: payment.id,
            disputes: payment.disputes,
        })
        .into_response(),
        Ok(None) => api_error(StatusCode::NOT_FOUND, "payment not found"),
        Err(e) => database_error(&e, ledger.database()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    fn at(timestamp: &str) -> axum::http::HeaderMap {
        let mut headers = axum::http::HeaderMap::new();
        headers.insert(
            "webhook-timestamp",
            timestamp.parse().expect("a header value"),
        );
        headers
    }

    #[test]
    fn timestamps_out_of_any_range_are_refused_without_overflow() {
        let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert!(timestamp_is_recent(&at("1800000000"), now));
        assert!(timestamp_is_recent(&at("1799999700"), now));
        assert!(!timestamp_is_recent(&at("1799999699"), now));
        assert!(!timestamp_is_recent(&at("1800000301"), now));
        for extreme in [
            "-9223372036854775808",
            "9223372036854775807",
            "",
            "1.5",
            "x",
        ] {
            assert!(!timestamp_is_recent(&at(extreme), now), "{extreme:?}");
        }
        assert!(!timestamp_is_recent(&axum::http::HeaderMap::new(), now));
    }
}
