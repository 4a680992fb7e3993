//! Where the idempotency records live, chosen by URL.
//!
//! | `IDEM_STORE_URL` | store | for |
//! |---|---|---|
//! | unset | the ledger's database: [`SqliteStore`], [`PostgresStore`] or [`MySqlStore`] on the ledger's pool | the default |
//! | `sqlite:...` | [`SqliteStore`] on that file | one instance |
//! | `postgres://...` | [`PostgresStore`] on that database (tables in its `idem` schema) | many instances |
//! | `mysql://...` | [`MySqlStore`] on that MySQL or MariaDB database (tables `idem_…`) | many instances |
//! | `redis://host:port[/db][?prefix=name]` | [`RedisStore`], keys under `prefix` (default `idem`) | many instances |
//! | `redis-cluster://host:port[,host:port…][?prefix=name]` | [`RedisClusterStore`] on the cluster of those seed nodes | many instances, past one Redis |
//! | `memory` | [`MemoryStore`]: forgotten on restart; each key held in memory (about 1 KiB here) until its retention ends | tests, one process |

use crate::ledger::{Database, Ledger};
use crate::StartError;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::mysql::MySqlStore;
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::store::redis::{RedisClusterStore, RedisStore};
use idem_runtime::store::sqlite::SqliteStore;
use idem_runtime::store::Purge;
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
    match crate::scheme(url) {
        "memory" => {
            tracing::warn!("idempotency records in memory: a restart forgets them");
            Ok(records(MemoryStore::new(), "memory"))
        }
        "sqlite" => {
            let options = SqliteStore::options(url)
                .map_err(|e| store_error("SQLite", e))?
                .create_if_missing(true);
            if let Some(dir) = options.get_filename().parent() {
                if !dir.as_os_str().is_empty() {
                    std::fs::create_dir_all(dir)?;
                }
            }
            let store = SqliteStore::connect_with(options)
                .await
                .map_err(|e| store_error("SQLite", e))?;
            Ok(records(store, "SQLite"))
        }
        "postgres" | "postgresql" => {
            let store = PostgresStore::connect(url)
                .await
                .map_err(|e| store_error("PostgreSQL", e))?;
            Ok(records(store, "PostgreSQL"))
        }
        "mysql" | "mariadb" => {
            // sqlx names both `mysql://`; `mariadb://` is accepted as the same.
            let url = url.replacen("mariadb://", "mysql://", 1);
            let store = MySqlStore::connect(&url)
                .await
                .map_err(|e| store_error("MySQL", e))?;
            Ok(records(store, "MySQL/MariaDB"))
        }
        "redis" | "redis+unix" => {
            let (url, prefix) = split_prefix(url);
            let mut builder = RedisStore::builder(url);
            if let Some(prefix) = prefix {
                builder = builder.prefix(prefix);
            }
            let store = builder
                .connect()
                .await
                .map_err(|e| store_error("Redis", e))?;
            let describe = format!("Redis, prefix `{}`", store.prefix());
            let mut records = records(store, &describe);
            records.sweeper = records.sweeper.interval(REDIS_SWEEP_EVERY);
            Ok(records)
        }
        "redis-cluster" => {
            let (nodes, prefix) = split_prefix(url);
            let seeds = nodes
                .trim_start_matches("redis-cluster://")
                .split(',')
                .filter(|node| !node.is_empty())
                .map(|node| format!("redis://{node}"));
            let mut builder = RedisClusterStore::builder(seeds);
            if let Some(prefix) = prefix {
                builder = builder.prefix(prefix);
            }
            let store = builder
                .connect()
                .await
                .map_err(|e| store_error("Redis Cluster", e))?;
            let describe = format!("Redis Cluster, prefix `{}`", store.prefix());
            let mut records = records(store, &describe);
            records.sweeper = records.sweeper.interval(REDIS_SWEEP_EVERY);
            Ok(records)
        }
        other => Err(StartError::Unsupported(format!(
            "IDEM_STORE_URL: no idempotency store for `{other}:` URLs; use postgres://..., mysql://..., \
             redis://... (no TLS in this build), redis-cluster://host:port,host:port..., \
             sqlite:... or memory, or leave it unset to keep the records in DATABASE_URL"
        ))),
    }
}

fn records<S: Store + Purge>(store: S, describe: &str) -> Records {
    records_arc(Arc::new(store), describe)
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

fn store_error(backend: &str, error: impl std::fmt::Display) -> StartError {
    StartError::Store(format!("IDEM_STORE_URL ({backend}): {error}"))
}

fn shared_error(backend: &str, error: impl std::fmt::Display) -> StartError {
    StartError::Store(format!(
        "the idempotency records in DATABASE_URL ({backend}): {error}"
    ))
}

/// Takes the `prefix` query parameter (this example's, not the Redis client's) out of a Redis URL.
fn split_prefix(url: &str) -> (String, Option<String>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), None);
    };
    let mut prefix = None;
    let rest: Vec<&str> = query
        .split('&')
        .filter(|pair| match pair.strip_prefix("prefix=") {
            Some(value) => {
                prefix = Some(value.to_owned());
                false
            }
            None => !pair.is_empty(),
        })
        .collect();
    let url = if rest.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    (url, prefix)
}

#[cfg(test)]
mod tests {
    use super::split_prefix;

    #[test]
    fn the_prefix_parameter_is_taken_out_of_the_redis_url() {
        assert_eq!(
            split_prefix("redis://127.0.0.1:6379"),
            ("redis://127.0.0.1:6379".to_owned(), None)
        );
        assert_eq!(
            split_prefix("redis://127.0.0.1:6379/2?prefix=pay"),
            (
                "redis://127.0.0.1:6379/2".to_owned(),
                Some("pay".to_owned())
            )
        );
        assert_eq!(
            split_prefix("redis://h/0?protocol=resp3&prefix=p&x=1"),
            (
                "redis://h/0?protocol=resp3&x=1".to_owned(),
                Some("p".to_owned())
            )
        );
    }
}
