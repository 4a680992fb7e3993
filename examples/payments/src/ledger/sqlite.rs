//! The ledger's statements on SQLite. Each takes any executor: the ledger's pool, a connection, or a
//! transaction (`&mut *tx`) that also holds other writes.

use super::{payment, Payment};
use sqlx::migrate::Migrator;
use sqlx::{Executor, Sqlite};

/// The ledger's migrations (`migrations/sqlite/`), with `ignore_missing` set: sqlx 0.8 keeps every
/// migrator's history in one `_sqlx_migrations` table, which the idempotency store's migrator shares
/// when its records live in the same file.
pub fn migrator() -> Migrator {
    let mut migrator = sqlx::migrate!("./migrations/sqlite");
    migrator.set_ignore_missing(true);
    migrator
}

/// Records `payment` for `owner`: the business write of a capture.
pub async fn insert<'e>(
    db: impl Executor<'e, Database = Sqlite>,
    owner: &str,
    payment: &Payment,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO payments (id, owner, amount, currency, status) VALUES (?, ?, ?, ?, ?)",
    )
    .bind(&payment.id)
    .bind(owner)
    .bind(payment.amount)
    .bind(&payment.currency)
    .bind(&payment.status)
    .execute(db)
    .await?;
    Ok(())
}

/// `owner`'s payments, oldest first.
pub async fn list<'e>(
    db: impl Executor<'e, Database = Sqlite>,
    owner: &str,
) -> Result<Vec<Payment>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, amount, currency, status FROM payments WHERE owner = ? ORDER BY seq",
    )
    .bind(owner)
    .fetch_all(db)
    .await?;
    rows.iter().map(payment).collect()
}

/// One of `owner`'s payments.
pub async fn get<'e>(
    db: impl Executor<'e, Database = Sqlite>,
    owner: &str,
    id: &str,
) -> Result<Option<Payment>, sqlx::Error> {
    let row =
        sqlx::query("SELECT id, amount, currency, status FROM payments WHERE owner = ? AND id = ?")
            .bind(owner)
            .bind(id)
            .fetch_optional(db)
            .await?;
    row.as_ref().map(payment).transpose()
}

/// Marks one of `owner`'s payments refunded: the business write of a refund.
pub async fn refund<'e>(
    db: impl Executor<'e, Database = Sqlite>,
    owner: &str,
    id: &str,
) -> Result<Option<Payment>, sqlx::Error> {
    let row = sqlx::query(
        "UPDATE payments SET status = 'refunded' WHERE owner = ? AND id = ?
         RETURNING id, amount, currency, status",
    )
    .bind(owner)
    .bind(id)
    .fetch_optional(db)
    .await?;
    row.as_ref().map(payment).transpose()
}
