//! The payments ledger: one table, on SQLite, PostgreSQL or MySQL/MariaDB, through runtime-checked
//! queries.
//!
//! [`Ledger`] is what the handlers use: it holds a pool and runs each operation on it. The two
//! backends, [`sqlite`] and [`postgres`], hold the statements as functions over any sqlx executor
//! (a pool, a connection, a transaction), so that a handler can also run the business write inside
//! a transaction of its own, e.g. one that also writes the idempotency record.

use crate::StartError;
use idem_runtime::store::mysql::MySqlStore;
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::store::sqlite::SqliteStore;
use serde::Serialize;
use sqlx::mysql::MySqlPool;
use sqlx::postgres::PgPool;
use sqlx::sqlite::{SqlitePool, SqlitePoolOptions};

pub mod mysql;
pub mod postgres;
pub mod sqlite;

/// A payment as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Payment {
    /// `pay_` and 32 hex digits.
    pub id: String,
    /// In the currency's minor unit.
    pub amount: i64,
    /// ISO 4217 code.
    pub currency: String,
    /// `captured` or `refunded`.
    pub status: String,
    /// How many disputes the card network reported for it (`POST /webhooks/card-network`).
    pub disputes: i64,
}

impl Payment {
    /// A new captured payment with a fresh id (not yet recorded).
    pub fn captured(amount: i64, currency: &str) -> Self {
        Self {
            id: format!("pay_{}", uuid::Uuid::new_v4().simple()),
            amount,
            currency: currency.to_owned(),
            status: "captured".to_owned(),
            disputes: 0,
        }
    }
}

/// The database a [`Ledger`] lives in.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Database {
    /// A SQLite file (or `sqlite::memory:`).
    Sqlite(SqlitePool),
    /// A PostgreSQL database.
    Postgres(PgPool),
    /// A MySQL or MariaDB database.
    MySql(MySqlPool),
}

impl Database {
    /// Whether the pool has every connection it may open: a request that then times out waiting
    /// for one met a busy database; one that times out below that met a database the pool could
    /// not reach.
    pub fn is_full(&self) -> bool {
        match self {
            Database::Sqlite(pool) => pool.size() >= pool.options().get_max_connections(),
            Database::Postgres(pool) => pool.size() >= pool.options().get_max_connections(),
            Database::MySql(pool) => pool.size() >= pool.options().get_max_connections(),
        }
    }
}

/// The ledger over a pool.
#[derive(Debug, Clone)]
pub struct Ledger {
    db: Database,
}

impl Ledger {
    /// Opens the database at `url` (`sqlite:...` or `postgres://...`/`postgresql://...`) and applies
    /// the ledger's migrations.
    pub async fn open(url: &str) -> Result<Self, StartError> {
        match crate::scheme(url) {
            "sqlite" => Ok(Self::open_sqlite(url).await?),
            "postgres" | "postgresql" => Ok(Self::open_postgres(url).await?),
            "mysql" | "mariadb" => Ok(Self::open_mysql(url).await?),
            other => Err(StartError::Unsupported(format!(
                "DATABASE_URL: the ledger needs a `sqlite:`, `postgres://` or `mysql://` URL, not \
                 `{other}:` (e.g. sqlite://payments.db?mode=rwc or postgres://user@host/db)"
            ))),
        }
    }

    /// Opens (creating if needed) the SQLite database at `url`. The file's directory is created too,
    /// so `sqlite://some/dir/payments.db?mode=rwc` works on a fresh checkout.
    ///
    /// The connection settings are the SQLite store's ([`SqliteStore::options`]: WAL, a busy
    /// timeout), so the idempotency records can share this pool.
    pub async fn open_sqlite(url: &str) -> Result<Self, sqlx::Error> {
        let options = SqliteStore::options(url)
            .map_err(|e| sqlx::Error::Configuration(e.into()))?
            .create_if_missing(true);
        if let Some(dir) = options.get_filename().parent() {
            if !dir.as_os_str().is_empty() {
                std::fs::create_dir_all(dir).map_err(sqlx::Error::Io)?;
            }
        }
        // Connections are kept rather than recycled, so that `sqlite::memory:` (which lives as long
        // as one of its connections) is never dropped under the ledger.
        let pool = SqlitePoolOptions::new()
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options)
            .await?;
        sqlite::migrator().run(&pool).await?;
        Ok(Self {
            db: Database::Sqlite(pool),
        })
    }

    /// Connects to the PostgreSQL database at `url` with the PostgreSQL store's pool settings
    /// ([`PostgresStore::pool_options`]: a prompt acquire timeout), so the idempotency records can
    /// share this pool.
    pub async fn open_postgres(url: &str) -> Result<Self, sqlx::Error> {
        let pool = PostgresStore::pool_options().connect(url).await?;
        postgres::migrator().run(&pool).await?;
        Ok(Self {
            db: Database::Postgres(pool),
        })
    }

    /// Connects to the MySQL or MariaDB database at `url` with the MySQL store's pool settings
    /// ([`MySqlStore::pool_options`]), so the idempotency records can share this pool.
    pub async fn open_mysql(url: &str) -> Result<Self, sqlx::Error> {
        let url = url.replacen("mariadb://", "mysql://", 1);
        let pool = MySqlStore::pool_options().connect(&url).await?;
        mysql::migrate(&pool).await?;
        Ok(Self {
            db: Database::MySql(pool),
        })
    }

    /// The database, for sharing it with the idempotency store.
    pub fn database(&self) -> &Database {
        &self.db
    }

    /// Records the payment of the card network's charge `charge_id` for `owner`, once per charge
    /// (see [`sqlite::insert`]).
    pub async fn capture(
        &self,
        owner: &str,
        amount: i64,
        currency: &str,
        charge_id: &str,
    ) -> Result<Payment, sqlx::Error> {
        let payment = Payment::captured(amount, currency);
        match &self.db {
            Database::Sqlite(pool) => {
                sqlite::insert(&mut *pool.acquire().await?, owner, &payment, charge_id).await
            }
            Database::Postgres(pool) => {
                postgres::insert(&mut *pool.acquire().await?, owner, &payment, charge_id).await
            }
            Database::MySql(pool) => {
                mysql::insert(&mut *pool.acquire().await?, owner, &payment, charge_id).await
            }
        }
    }

    /// The card network's charge behind one of `owner`'s payments: `None` if the payment is not
    /// theirs, `Some(None)` for a payment recorded without one.
    pub async fn charge_of(
        &self,
        owner: &str,
        id: &str,
    ) -> Result<Option<Option<String>>, sqlx::Error> {
        match &self.db {
            Database::Sqlite(pool) => sqlite::charge_of(pool, owner, id).await,
            Database::Postgres(pool) => postgres::charge_of(pool, owner, id).await,
            Database::MySql(pool) => mysql::charge_of(pool, owner, id).await,
        }
    }

    /// `owner`'s payments, oldest first.
    pub async fn list(&self, owner: &str) -> Result<Vec<Payment>, sqlx::Error> {
        match &self.db {
            Database::Sqlite(pool) => sqlite::list(pool, owner).await,
            Database::Postgres(pool) => postgres::list(pool, owner).await,
            Database::MySql(pool) => mysql::list(pool, owner).await,
        }
    }

    /// One of `owner`'s payments; `None` for an unknown id or another owner's payment.
    pub async fn get(&self, owner: &str, id: &str) -> Result<Option<Payment>, sqlx::Error> {
        match &self.db {
            Database::Sqlite(pool) => sqlite::get(pool, owner, id).await,
            Database::Postgres(pool) => postgres::get(pool, owner, id).await,
            Database::MySql(pool) => mysql::get(pool, owner, id).await,
        }
    }

    /// Counts a dispute the card network reported for the payment `id`, whoever owns it; `None`
    /// for an unknown payment. Runs once per webhook delivery: idem replays redeliveries.
    pub async fn dispute(&self, id: &str) -> Result<Option<Payment>, sqlx::Error> {
        const SQLITE: &str = "UPDATE payments SET disputes = disputes + 1 WHERE id = ?
             RETURNING id, amount, currency, status, disputes";
        const POSTGRES: &str = "UPDATE payments SET disputes = disputes + 1 WHERE id = $1
             RETURNING id, amount, currency, status, disputes";
        let row = match &self.db {
            Database::Sqlite(pool) => {
                let row = sqlx::query(SQLITE).bind(id).fetch_optional(pool).await?;
                row.as_ref().map(payment).transpose()
            }
            Database::Postgres(pool) => {
                let row = sqlx::query(POSTGRES).bind(id).fetch_optional(pool).await?;
                row.as_ref().map(payment).transpose()
            }
            Database::MySql(pool) => mysql::dispute(pool, id).await,
        };
        row
    }

    /// Marks one of `owner`'s payments refunded (a refunded payment stays refunded); `None` if it is
    /// not theirs.
    pub async fn refund(&self, owner: &str, id: &str) -> Result<Option<Payment>, sqlx::Error> {
        match &self.db {
            Database::Sqlite(pool) => sqlite::refund(pool, owner, id).await,
            Database::Postgres(pool) => postgres::refund(pool, owner, id).await,
            Database::MySql(pool) => mysql::refund(pool, owner, id).await,
        }
    }
}

/// Reads a payment from a row of `SELECT id, amount, currency, status, disputes`.
fn payment<R: sqlx::Row>(row: &R) -> Result<Payment, sqlx::Error>
where
    for<'r> &'r str: sqlx::ColumnIndex<R>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    Ok(Payment {
        id: row.try_get("id")?,
        amount: row.try_get("amount")?,
        currency: row.try_get("currency")?,
        status: row.try_get("status")?,
        disputes: row.try_get("disputes")?,
    })
}

#[cfg(test)]
mod tests {
    use super::{Database, Ledger};

    /// What SQLite keeps in this process is bounded by the page cache of each pooled connection; the
    /// README's "Memory" section states both numbers, so raising either should update it.
    #[tokio::test]
    async fn sqlite_memory_is_bounded_by_the_page_cache_and_the_pool() {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("payments.db").display()
        );
        let ledger = Ledger::open_sqlite(&url).await.expect("open");
        let Database::Sqlite(pool) = ledger.database() else {
            panic!("a sqlite: URL opens a SQLite ledger")
        };
        assert_eq!(pool.options().get_max_connections(), 10);
        // Negative: KiB, so about 2 MiB per connection (SQLite's default).
        let cache: i64 = sqlx::query_scalar("PRAGMA cache_size")
            .fetch_one(pool)
            .await
            .expect("cache_size");
        assert_eq!(cache, -2000);
    }
}
