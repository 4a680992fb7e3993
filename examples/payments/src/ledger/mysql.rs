//! The ledger's statements on MySQL/MariaDB. Each takes any executor: the ledger's pool, a
//! connection, or a transaction (`tx.conn().await?`) that also holds other writes.
//!
//! Text columns are `utf8mb4_bin` (compared byte for byte), which sqlx reports as binary: each is
//! read through `CAST(… AS CHAR)` to decode as a `String`.

use super::{payment, Payment};
use sqlx::migrate::Migrator;
use sqlx::{Executor, MySql};

/// The ledger's migrations (`migrations/mysql/`). MySQL keeps one migration history per database,
/// shared with idem's store: each migrator ignores the other's versions.
pub fn migrator() -> Migrator {
    let mut migrator = sqlx::migrate!("./migrations/mysql");
    migrator.set_ignore_missing(true);
    migrator
}

/// Runs [`migrator`] under the named lock idem's `MySqlStore::migrate` takes: sqlx's own lock does
/// nothing on MariaDB, and the two migrators share the database's history, where one's migration
/// in progress would look "dirty" to the other.
pub async fn migrate(pool: &sqlx::MySqlPool) -> Result<(), sqlx::Error> {
    const LOCK: &str = "SHA1(CONCAT('idem migrations ', DATABASE()))";
    let mut conn = pool.acquire().await?;
    let locked: Option<i64> = sqlx::query_scalar(&format!("SELECT GET_LOCK({LOCK}, 60)"))
        .fetch_one(&mut *conn)
        .await?;
    if locked != Some(1) {
        return Err(sqlx::Error::Protocol(
            "another instance held the migration lock for too long".into(),
        ));
    }
    let migrated = migrator().run_direct(&mut *conn).await;
    sqlx::query(&format!("SELECT RELEASE_LOCK({LOCK})"))
        .execute(&mut *conn)
        .await?;
    migrated.map_err(|e| sqlx::Error::Migrate(Box::new(e)))
}

/// Records `payment` for `owner`, made by the card network's charge `charge_id`, once per charge
/// (see [`super::sqlite::insert`]).
pub async fn insert(
    db: &mut sqlx::MySqlConnection,
    owner: &str,
    payment: &Payment,
    charge_id: &str,
) -> Result<Payment, sqlx::Error> {
    // A charge already recorded keeps its payment: the update changes nothing.
    sqlx::query(
        "INSERT INTO payments (id, owner, amount, currency, status, charge_id)
         VALUES (?, ?, ?, ?, ?, ?) ON DUPLICATE KEY UPDATE charge_id = charge_id",
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
        "SELECT CAST(id AS CHAR) AS id, amount, CAST(currency AS CHAR) AS currency,
                CAST(status AS CHAR) AS status, disputes
         FROM payments WHERE charge_id = ?",
    )
    .bind(charge_id)
    .fetch_one(db)
    .await?;
    super::payment(&row)
}

/// The card network's charge behind one of `owner`'s payments, if it is theirs.
pub async fn charge_of<'e>(
    db: impl Executor<'e, Database = MySql>,
    owner: &str,
    id: &str,
) -> Result<Option<Option<String>>, sqlx::Error> {
    sqlx::query_scalar("SELECT CAST(charge_id AS CHAR) FROM payments WHERE owner = ? AND id = ?")
        .bind(owner)
        .bind(id)
        .fetch_optional(db)
        .await
}

/// `owner`'s payments, oldest first.
pub async fn list<'e>(
    db: impl Executor<'e, Database = MySql>,
    owner: &str,
) -> Result<Vec<Payment>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT CAST(id AS CHAR) AS id, amount, CAST(currency AS CHAR) AS currency,
                CAST(status AS CHAR) AS status, disputes
         FROM payments WHERE owner = ? ORDER BY seq",
    )
    .bind(owner)
    .fetch_all(db)
    .await?;
    rows.iter().map(payment).collect()
}

/// One of `owner`'s payments.
pub async fn get<'e>(
    db: impl Executor<'e, Database = MySql>,
    owner: &str,
    id: &str,
) -> Result<Option<Payment>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT CAST(id AS CHAR) AS id, amount, CAST(currency AS CHAR) AS currency,
                CAST(status AS CHAR) AS status, disputes
         FROM payments WHERE owner = ? AND id = ?",
    )
    .bind(owner)
    .bind(id)
    .fetch_optional(db)
    .await?;
    row.as_ref().map(payment).transpose()
}

/// Marks one of `owner`'s payments refunded: the business write of a refund (MySQL has no
/// `RETURNING`: the update, then the read, in one transaction).
pub async fn refund(
    pool: &sqlx::MySqlPool,
    owner: &str,
    id: &str,
) -> Result<Option<Payment>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("UPDATE payments SET status = 'refunded' WHERE owner = ? AND id = ?")
        .bind(owner)
        .bind(id)
        .execute(&mut *tx)
        .await?;
    let found = get(&mut *tx, owner, id).await?;
    tx.commit().await?;
    Ok(found)
}

/// Counts a dispute for the payment `id`, whoever owns it (see [`super::Ledger::dispute`]): the
/// update, then the read, in one transaction.
pub async fn dispute(pool: &sqlx::MySqlPool, id: &str) -> Result<Option<Payment>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("UPDATE payments SET disputes = disputes + 1 WHERE id = ?")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    let row = sqlx::query(
        "SELECT CAST(id AS CHAR) AS id, amount, CAST(currency AS CHAR) AS currency,
                CAST(status AS CHAR) AS status, disputes
         FROM payments WHERE id = ?",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    tx.commit().await?;
    row.as_ref().map(payment).transpose()
}
