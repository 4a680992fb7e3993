//! One parser for store URLs, shared by applications (the payments example's `IDEM_STORE_URL`) and
//! the `idem` command-line tool.
//!
//! | URL | store | feature |
//! |---|---|---|
//! | `sqlite:path`, `sqlite://path[?mode=rwc]`, `sqlite::memory:` | [`SqliteStore`](super::sqlite::SqliteStore) | `sqlite` |
//! | `postgres://…`, `postgresql://…` (sqlx's `DATABASE_URL` forms) | [`PostgresStore`](super::postgres::PostgresStore), tables in the `idem` schema | `postgres` |
//! | `mysql://…`, `mariadb://…` (sqlx's `DATABASE_URL` form) | [`MySqlStore`](super::mysql::MySqlStore), tables `idem_…` in that database | `mysql` |
//! | `redis://host:port[/db][?prefix=name]`, `redis+unix://…` | [`RedisStore`](super::redis::RedisStore), keys under `prefix` (default `idem`) | `redis` |
//! | `redis-cluster://host:port[,host:port…][?prefix=name]` (or `redis+cluster://`) | [`RedisClusterStore`](super::redis::RedisClusterStore) from those seed nodes | `redis-cluster` |
//! | `memory` | [`MemoryStore`](super::memory::MemoryStore): this process only | always |

use super::{Purge, Store};
use std::error::Error as StdError;
use std::sync::Arc;

/// A store opened from a URL by [`open`].
#[derive(Clone)]
pub struct Opened {
    /// The store.
    pub store: Arc<dyn Store>,
    /// The same store, for a [`Sweeper`](crate::sweeper::Sweeper).
    pub purge: Arc<dyn Purge>,
    /// A short description for logs and tools (never a password), such as "SQLite" or "Redis,
    /// prefix `idem`".
    pub describe: String,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("kind", &self.store.kind())
            .field("describe", &self.describe)
            .finish_non_exhaustive()
    }
}

/// Why [`open`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The URL names no store this build has (an unknown scheme, or a backend whose feature is
    /// off).
    #[error("{0}")]
    Unsupported(String),
    /// The store was named correctly but could not be opened (unreachable, refused, bad URL
    /// parameters).
    #[error("{backend}: {source}")]
    Connect {
        /// `SQLite`, `PostgreSQL`, `Redis` or `Redis Cluster`.
        backend: &'static str,
        /// What the client library said.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
}

/// What [`open_with`] does besides opening.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OpenOptions {
    /// Create a SQLite file (and its directory) that does not exist yet. Off by default: a tool
    /// pointed at a misspelt path should say so, not open an empty store.
    pub create_sqlite: bool,
}

impl OpenOptions {
    /// Creates missing SQLite files and their directories.
    pub fn creating(mut self) -> Self {
        self.create_sqlite = true;
        self
    }
}

/// Opens the store `url` names (see the [module documentation](self)); a SQLite file must exist,
/// unless the URL says `mode=rwc`.
pub async fn open(url: &str) -> Result<Opened, OpenError> {
    open_with(url, OpenOptions::default()).await
}

/// [`open`] with `options`.
pub async fn open_with(url: &str, options: OpenOptions) -> Result<Opened, OpenError> {
    let _ = options;
    match scheme(url) {
        "memory" => Ok(opened(
            super::memory::MemoryStore::new(),
            "memory".to_owned(),
        )),
        #[cfg(feature = "sqlite")]
        "sqlite" => {
            use super::sqlite::SqliteStore;
            let connect = |e: super::StoreError| connect_error("SQLite", e);
            let mut sqlite = SqliteStore::options(url).map_err(connect)?;
            if options.create_sqlite {
                sqlite = sqlite.create_if_missing(true);
                if let Some(dir) = sqlite.get_filename().parent() {
                    if !dir.as_os_str().is_empty() {
                        std::fs::create_dir_all(dir).map_err(|e| connect_error("SQLite", e))?;
                    }
                }
            }
            let store = SqliteStore::connect_with(sqlite).await.map_err(connect)?;
            Ok(opened(store, "SQLite".to_owned()))
        }
        #[cfg(feature = "postgres")]
        "postgres" | "postgresql" => {
            let store = super::postgres::PostgresStore::connect(url)
                .await
                .map_err(|e| connect_error("PostgreSQL", e))?;
            Ok(opened(store, "PostgreSQL".to_owned()))
        }
        #[cfg(feature = "mysql")]
        "mysql" | "mariadb" => {
            // sqlx names both `mysql://`; `mariadb://` is accepted as the same.
            let url = url.replacen("mariadb://", "mysql://", 1);
            let store = super::mysql::MySqlStore::connect(&url)
                .await
                .map_err(|e| connect_error("MySQL", e))?;
            Ok(opened(store, "MySQL/MariaDB".to_owned()))
        }
        #[cfg(feature = "redis")]
        "redis" | "redis+unix" => {
            let (url, prefix) = split_prefix(url);
            let mut builder = super::redis::RedisStore::builder(url);
            if let Some(prefix) = prefix {
                builder = builder.prefix(prefix);
            }
            let store = builder
                .connect()
                .await
                .map_err(|e| connect_error("Redis", e))?;
            let describe = format!("Redis, prefix `{}`", store.prefix());
            Ok(opened(store, describe))
        }
        #[cfg(feature = "redis-cluster")]
        "redis-cluster" | "redis+cluster" => {
            let (nodes, prefix) = split_prefix(url);
            let nodes = nodes.split_once("://").map_or("", |(_, nodes)| nodes);
            let seeds = nodes
                .split(',')
                .filter(|node| !node.is_empty())
                .map(|node| format!("redis://{node}"));
            let mut builder = super::redis::RedisClusterStore::builder(seeds);
            if let Some(prefix) = prefix {
                builder = builder.prefix(prefix);
            }
            let store = builder
                .connect()
                .await
                .map_err(|e| connect_error("Redis Cluster", e))?;
            let describe = format!("Redis Cluster, prefix `{}`", store.prefix());
            Ok(opened(store, describe))
        }
        other => Err(OpenError::Unsupported(unsupported(other))),
    }
}

/// The scheme of a URL: what comes before the first `:` (`sqlite`, `postgres`, `redis`, `memory`).
pub fn scheme(url: &str) -> &str {
    url.split(':').next().unwrap_or_default()
}

fn unsupported(scheme: &str) -> String {
    let feature = match scheme {
        "sqlite" => Some("sqlite"),
        "postgres" | "postgresql" => Some("postgres"),
        "mysql" | "mariadb" => Some("mysql"),
        "redis" | "redis+unix" => Some("redis"),
        "redis-cluster" | "redis+cluster" => Some("redis-cluster"),
        _ => None,
    };
    match feature {
        Some(feature) => format!(
            "`{scheme}:` stores need idem-runtime's `{feature}` feature, which this build lacks"
        ),
        None => format!(
            "no idempotency store for `{scheme}:` URLs; use sqlite:path, postgres://..., mysql://..., \
             redis://host:port[/db][?prefix=name] (no TLS), \
             redis-cluster://host:port,host:port...[?prefix=name] or memory"
        ),
    }
}

fn opened<S: Store + Purge>(store: S, describe: String) -> Opened {
    let store = Arc::new(store);
    Opened {
        store: store.clone(),
        purge: store,
        describe,
    }
}

#[cfg_attr(
    not(any(
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql",
        feature = "redis"
    )),
    allow(dead_code)
)]
fn connect_error(
    backend: &'static str,
    error: impl Into<Box<dyn StdError + Send + Sync>>,
) -> OpenError {
    OpenError::Connect {
        backend,
        source: error.into(),
    }
}

/// Takes the `prefix` query parameter (idem's, not the Redis client's) out of a Redis URL.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
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
    use super::{open, split_prefix, OpenError};

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

    #[tokio::test]
    async fn an_unknown_scheme_is_named_in_the_error() {
        let err = open("ftp://example.com").await.err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("`ftp:`")));
    }

    #[tokio::test]
    async fn memory_opens() {
        let opened = open("memory").await.map_err(|e: OpenError| e.to_string());
        assert_eq!(opened.map(|o| o.store.kind()), Ok("memory"));
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_missing_sqlite_file_is_an_error_unless_asked_to_create_it() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let url = format!("sqlite://{}", dir.path().join("sub/idem.db").display());
        assert!(matches!(
            open(&url).await,
            Err(OpenError::Connect {
                backend: "SQLite",
                ..
            })
        ));
        let opened = super::open_with(&url, super::OpenOptions::default().creating()).await;
        assert_eq!(opened.map(|o| o.store.kind()).ok(), Some("sqlite"));
    }
}
