//! Where the idempotency records live, chosen by URL (parsed by
//! [`idem_runtime::store::open`], the same parser the `idem` tool uses).
//!
//! | `IDEM_STORE_URL` | store | for |
//! |---|---|---|
//! | unset | the ledger's database: [`SqliteStore`], [`PostgresStore`] or [`MySqlStore`] on the ledger's pool | the default |
//! | `sqlite:...` | [`SqliteStore`] on that file | one instance |
//! | `postgres://...` | [`PostgresStore`] on that database (tables in its `idem` schema) | many instances |
//! | `mysql://...` | `MySqlStore` on that MySQL or MariaDB database (tables `idem_…`) | many instances |
//! | `redis://host:port[/db][?prefix=name]` | `RedisStore`, keys under `prefix` (default `idem`) | many instances |
//! | `redis-cluster://host:port[,host:port…][?prefix=name]` | `RedisClusterStore` on the cluster of those seed nodes | many instances, past one Redis |
//! | `memory` | `MemoryStore`: forgotten on restart; each key held in memory (about 1 KiB here) until its retention ends | tests, one process |

use crate::ledger::{Database, Ledger};
use crate::StartError;
use idem_runtime::store::mysql::MySqlStore;
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::store::sqlite::SqliteStore;
use idem_runtime::store::{OpenError, OpenOptions, Purge};
use idem_runtime::sweeper::Sweeper;
use idem_runtime::Store;
use std::sync::Arc;
use std::time::Duration;

/// How often records past retention are purged.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Redis expires records by itself (each carries a TTL); the sweeper there only catches records whose
/// TTL outlived their retention, and each sweep scans the keyspace, so it runs rarely.
const REDIS_SWEEP_EVERY: Duration = Duration::from_secs(3600);

/// The idempotency store, and the sweeper that purges it.
pub struct Records {
    /// The store the engine runs on.
    pub store: Arc<dyn Store>,
    /// Purges records past retention; [`spawn`](Sweeper::run) it.
    pub sweeper: Sweeper,
    /// A short description for the start-up log (never a password).
    pub describe: String,
    /// Whether the records live in the ledger's database, on the ledger's pool (`IDEM_STORE_URL`
    /// unset): then a handler can write its ledger rows and the record in one transaction.
    pub shares_ledger_database: bool,
    /// The store itself when it shares the ledger's database, for transactional mode.
    pub shared: Option<SharedStore>,
}

/// The idempotency store in the ledger's own database, by type: `POST /payments` then claims its
/// key in the transaction that writes the payment (see `idem_runtime::transaction`).
#[derive(Debug, Clone)]
pub enum SharedStore {
    /// Both in one SQLite file.
    Sqlite(Arc<SqliteStore>),
    /// Both in one PostgreSQL database.
    Postgres(Arc<PostgresStore>),
    /// Both in one MySQL or MariaDB database.
    MySql(Arc<MySqlStore>),
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records")
            .field("describe", &self.describe)
            .finish_non_exhaustive()
    }
}

/// Opens the idempotency store: at `idem_store_url` if given, otherwise in the ledger's database,
/// on the ledger's pool.
pub async fn open(idem_store_url: Option<&str>, ledger: &Ledger) -> Result<Records, StartError> {
    let Some(url) = idem_store_url else {
        let (mut records, shared) = match ledger.database() {
            Database::Sqlite(pool) => {
                let store = Arc::new(
                    SqliteStore::from_pool(pool.clone())
                        .await
                        .map_err(|e| shared_error("SQLite", e))?,
                );
                (
                    records_arc(store.clone(), "SQLite, in the ledger's database"),
                    SharedStore::Sqlite(store),
                )
            }
            Database::Postgres(pool) => {
                let store = Arc::new(
                    PostgresStore::from_pool(pool.clone())
                        .await
                        .map_err(|e| shared_error("PostgreSQL", e))?,
                );
                (
                    records_arc(store.clone(), "PostgreSQL, in the ledger's database"),
                    SharedStore::Postgres(store),
                )
            }
            Database::MySql(pool) => {
                let store = Arc::new(
                    MySqlStore::from_pool(pool.clone())
                        .await
                        .map_err(|e| shared_error("MySQL", e))?,
                );
                (
                    records_arc(store.clone(), "MySQL/MariaDB, in the ledger's database"),
                    SharedStore::MySql(store),
                )
            }
        };
        records.shares_ledger_database = true;
        records.shared = Some(shared);
        return Ok(records);
    };
    if crate::scheme(url) == "memory" {
        tracing::warn!("idempotency records in memory: a restart forgets them");
    }
    // The one parser of store URLs, idem's own (the `idem` tool reads the same URLs).
    let opened = idem_runtime::store::open_with(url, OpenOptions::default().creating())
        .await
        .map_err(|e| match e {
            OpenError::Unsupported(why) => StartError::Unsupported(format!(
                "IDEM_STORE_URL: {why}; or leave it unset to keep the records in DATABASE_URL"
            )),
            other => StartError::Store(format!("IDEM_STORE_URL ({other})")),
        })?;
    let redis = opened.store.kind().starts_with("redis");
    let mut records = Records {
        sweeper: Sweeper::new(opened.purge).interval(SWEEP_EVERY),
        store: opened.store,
        describe: opened.describe,
        shares_ledger_database: false,
        shared: None,
    };
    if redis {
        records.sweeper = records.sweeper.interval(REDIS_SWEEP_EVERY);
    }
    Ok(records)
}

fn records_arc<S: Store + Purge>(store: Arc<S>, describe: &str) -> Records {
    Records {
        sweeper: Sweeper::new(store.clone()).interval(SWEEP_EVERY),
        store,
        describe: describe.to_owned(),
        shares_ledger_database: false,
        shared: None,
    }
}

fn shared_error(backend: &str, error: impl std::fmt::Display) -> StartError {
    StartError::Store(format!(
        "the idempotency records in DATABASE_URL ({backend}): {error}"
    ))
}
