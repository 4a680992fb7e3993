//! The ledger's statements on PostgreSQL. Each takes any executor: the ledger's pool, a connection, or a
//! transaction (`tx.conn().await?`) that also holds other writes.

use super::{payment, Payment};
use sqlx::migrate::Migrator;
use sqlx::{Executor, Postgres};

/// The ledger's migrations (`migrations/postgres/`), in the connection's default schema. The
/// PostgreSQL store keeps its own history in the `idem` schema, so neither migrator sees the other's
/// versions and this one stays strict.
pub fn migrator() -> Migrator {
    sqlx::migrate!("./migrations/postgres")
}

/// Records `payment` for `owner`, made by the card network's charge `charge_id`: the business
/// write of a capture. A charge is recorded once: if it already has a payment (a run that took over a
/// crashed one), that payment is returned and nothing is written.
pub async fn insert(
    db: &mut sqlx::PgConnection,
    owner: &str,
    payment: &Payment,
    charge_id: &str,
) -> Result<Payment, sqlx::Error> {
    sqlx::query(
        "INSERT INTO payments (id, owner, amount, currency, status, charge_id)
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (charge_id) DO NOTHING",
    )
    .bind(&payment.id)
    .bind(owner)
    .bind(payment.amount)
    .bind(&payment.currency)
    .bind(&payment.status)
    .bind(charge_id)
    .execute(&mut *db)
    .await?;
    let row = sqlx::query(
        "SELECT id, amount, currency, status, disputes FROM payments WHERE charge_id = $1",
    )
    .bind(charge_id)
    .fetch_one(db)
    .await?;
    super::payment(&row)
}

/// The card network's charge behind one of `owner`'s payments, if it is theirs.
pub async fn charge_of<'e>(
    db: impl Executor<'e, Database = Postgres>,
    owner: &str,
    id: &str,
) -> Result<Option<Option<String>>, sqlx::Error> {
    sqlx::query_scalar("SELECT charge_id FROM payments WHERE owner = $1 AND id = $2")
        .bind(owner)
        .bind(id)
        .fetch_optional(db)
        .await
}

/// `owner`'s payments, oldest first.
pub async fn list<'e>(
    db: impl Executor<'e, Database = Postgres>,
    owner: &str,
) -> Result<Vec<Payment>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, amount, currency, status, disputes FROM payments WHERE owner = $1 ORDER BY seq",
    )
    .bind(owner)
    .fetch_all(db)
    .await?;
    rows.iter().map(payment).collect()
}

/// One of `owner`'s payments.
pub async fn get<'e>(
    db: impl Executor<'e, Database = Postgres>,
    owner: &str,
    id: &str,
) -> Result<Option<Payment>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT id, amount, currency, status, disputes FROM payments WHERE owner = $1 AND id = $2",
    )
    .bind(owner)
    .bind(id)
    .fetch_optional(db)
    .await?;
    row.as_ref().map(payment).transpose()
}

/// Marks one of `owner`'s payments refunded: the business write of a refund.
pub async fn refund<'e>(
    db: impl Executor<'e, Database = Postgres>,
    owner: &str,
    id: &str,
) -> Result<Option<Payment>, sqlx::Error> {
    let row = sqlx::query(
        "UPDATE payments SET status = 'refunded' WHERE owner = $1 AND id = $2
         RETURNING id, amount, currency, status, disputes",
    )
    .bind(owner)
    .bind(id)
    .fetch_optional(db)
    .await?;
    row.as_ref().map(payment).transpose()
}
