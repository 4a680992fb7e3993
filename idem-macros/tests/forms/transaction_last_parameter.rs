// The transaction as the last parameter (the body is then read by the unit extractor), on
// SQLite, with a global scope, `impl IntoResponse` and a helper taking `&mut Tx`.
#![deny(warnings)]
use crate::tx_support;

use axum::extract::Path;
use axum::response::IntoResponse;
use idem_runtime::sqlx::{self, Sqlite};
use idem_runtime::{idempotent, Tx};

async fn refund(tx: &mut Tx<Sqlite>, id: &str) -> Result<u64, sqlx::Error> {
    let done = sqlx::query("UPDATE payments SET status = 'refunded' WHERE id = ?")
        .bind(id)
        .execute(tx.conn().await?)
        .await?;
    Ok(done.rows_affected())
}

#[idempotent(scope = "global", transaction = "tx")]
async fn refund_payment(Path(id): Path<String>, mut tx: Tx<Sqlite>) -> impl IntoResponse {
    match refund(&mut tx, &id).await {
        Ok(1) => "refunded",
        _ => "not found",
    }
}

#[test]
fn routes() {
    let _ = tx_support::route_tx(refund_payment);
}
