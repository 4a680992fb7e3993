//! The payments ledger: one SQLite table, runtime-checked queries.

use serde::Serialize;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::Row;
use std::str::FromStr;
use std::time::Duration;

/// A payment as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Payment {
    /// `pay_` and 32 hex digits.
    pub id: String,
    /// In the currency's minor unit.
    pub amount: i64,
    /// ISO 4217 code.
    pub currency: String,
    /// `captured` or `refunded`.
    pub status: String,
}

/// The ledger over a SQLite pool.
#[derive(Debug, Clone)]
pub struct Ledger {
    pool: SqlitePool,
}

impl Ledger {
    /// Opens (creating if needed) the SQLite database at `url` and its table. The file's directory is
    /// created too, so `sqlite://some/dir/payments.db?mode=rwc` works on a fresh checkout.
    pub async fn open(url: &str) -> Result<Self, sqlx::Error> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            // WAL lets readers run beside the writer; the busy timeout makes concurrent writers queue
            // instead of failing with "database is locked".
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(5));
        if let Some(dir) = options.get_filename().parent() {
            if !dir.as_os_str().is_empty() {
                std::fs::create_dir_all(dir).map_err(sqlx::Error::Io)?;
            }
        }
        let pool = SqlitePoolOptions::new().connect_with(options).await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS payments (
                seq      INTEGER PRIMARY KEY AUTOINCREMENT,
                id       TEXT NOT NULL UNIQUE,
                owner    TEXT NOT NULL,
                amount   INTEGER NOT NULL,
                currency TEXT NOT NULL,
                status   TEXT NOT NULL
            )",
        )
        .execute(&pool)
        .await?;
        sqlx::query("CREATE INDEX IF NOT EXISTS payments_owner ON payments (owner, seq)")
            .execute(&pool)
            .await?;
        Ok(Self { pool })
    }

    /// The pool, for sharing the database with the idempotency store.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Records a captured payment for `owner`.
    pub async fn capture(
        &self,
        owner: &str,
        amount: i64,
        currency: &str,
    ) -> Result<Payment, sqlx::Error> {
        let payment = Payment {
            id: format!("pay_{}", uuid::Uuid::new_v4().simple()),
            amount,
            currency: currency.to_owned(),
            status: "captured".to_owned(),
        };
        sqlx::query(
            "INSERT INTO payments (id, owner, amount, currency, status) VALUES (?, ?, ?, ?, ?)",
        )
        .bind(&payment.id)
        .bind(owner)
        .bind(payment.amount)
        .bind(&payment.currency)
        .bind(&payment.status)
        .execute(&self.pool)
        .await?;
        Ok(payment)
    }

    /// `owner`'s payments, oldest first.
    pub async fn list(&self, owner: &str) -> Result<Vec<Payment>, sqlx::Error> {
        let rows = sqlx::query(
            "SELECT id, amount, currency, status FROM payments WHERE owner = ? ORDER BY seq",
        )
        .bind(owner)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(payment).collect()
    }

    /// One of `owner`'s payments; `None` for an unknown id or another owner's payment.
    pub async fn get(&self, owner: &str, id: &str) -> Result<Option<Payment>, sqlx::Error> {
        let row = sqlx::query(
            "SELECT id, amount, currency, status FROM payments WHERE owner = ? AND id = ?",
        )
        .bind(owner)
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(payment).transpose()
    }

    /// Marks one of `owner`'s payments refunded (a refunded payment stays refunded); `None` if it is
    /// not theirs.
    pub async fn refund(&self, owner: &str, id: &str) -> Result<Option<Payment>, sqlx::Error> {
        let row = sqlx::query(
            "UPDATE payments SET status = 'refunded' WHERE owner = ? AND id = ?
             RETURNING id, amount, currency, status",
        )
        .bind(owner)
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(payment).transpose()
    }
}

fn payment(row: &sqlx::sqlite::SqliteRow) -> Result<Payment, sqlx::Error> {
    Ok(Payment {
        id: row.try_get("id")?,
        amount: row.try_get("amount")?,
        currency: row.try_get("currency")?,
        status: row.try_get("status")?,
    })
}
