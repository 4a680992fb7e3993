// Transactional mode: the `tx` parameter (anywhere in the list) is no extractor; the body writes
// through it with `tx.conn().await?`, and uses the other parameters as usual. No warnings.
#![deny(warnings)]
use crate::support;
use crate::tx_support;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use idem_runtime::sqlx::{self, Sqlite};
use idem_runtime::{idempotent, Tx};
use support::{AuthUser, NewPayment};

#[idempotent(scope = "user", transaction = "tx", ttl = "24h")]
async fn create_payment(
    State(name): State<String>,
    user: AuthUser,
    mut tx: Tx<Sqlite>,
    Json(req): Json<NewPayment>,
) -> Result<(StatusCode, String), StatusCode> {
    sqlx::query("INSERT INTO payments (owner, amount) VALUES (?, ?)")
        .bind(&user.id)
        .bind(req.amount as i64)
        .execute(
            tx.conn()
                .await
                .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?,
        )
        .await
        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    Ok((
        StatusCode::CREATED,
        format!("{name}: {} {}", req.amount, req.currency),
    ))
}

#[test]
fn routes() {
    let _ = tx_support::route_tx(create_payment);
}
