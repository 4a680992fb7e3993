// `?` in the body converts errors into the handler's declared error type, and an early `return`
// returns from the handler, as without the attribute.
#![deny(warnings)]
use crate::support;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use idem_runtime::idempotent;
use support::{AuthUser, NewPayment};

struct AppError(String);

impl From<std::num::ParseIntError> for AppError {
    fn from(e: std::num::ParseIntError) -> Self {
        AppError(e.to_string())
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        (StatusCode::BAD_REQUEST, self.0).into_response()
    }
}

#[idempotent(scope = "user")]
async fn create_payment(
    user: AuthUser,
    Json(req): Json<NewPayment>,
) -> Result<Json<u64>, AppError> {
    if req.currency.is_empty() {
        return Err(AppError("currency required".into()));
    }
    let factor: u64 = user.id.parse()?;
    Ok(Json(req.amount * factor))
}

#[idempotent(scope = "user")]
async fn with_impl_in_result(user: AuthUser, body: String) -> Result<impl IntoResponse, AppError> {
    let n: u64 = body.parse()?;
    Ok((StatusCode::CREATED, format!("{n} for {}", user.id)))
}

#[test]
fn routes() {
    let _ = support::route(create_payment);
    let _ = support::route(with_impl_in_result);
}
