//! Backends for the model-based and fault-injection tests: the same four stores the conformance suite
//! runs on, set up the same way (a temporary SQLite file, a PostgreSQL database of its own, a Redis key
//! prefix of its own), each cleaned up when dropped.
//!
//! These tests open a backend once per test and give every generated case scopes of its own, so that
//! hundreds of cases cost one database, not hundreds.

#![allow(dead_code)] // each test file uses part of this module

use idem_runtime::sqlx::postgres::PgConnectOptions;
use idem_runtime::sqlx::{self, ConnectOptions};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::sqlite::SqliteStore;
use idem_tests::conformance::Backend;
use idem_tests::services;
use std::time::{SystemTime, UNIX_EPOCH};

/// The in-memory store. Not shared between handles: every `open` is a new store, so a test that
/// wants two instances over one memory store clones an `Arc` instead.
pub struct Memory;

#[async_trait::async_trait]
impl Backend for Memory {
    type Store = MemoryStore;
    async fn open(&self) -> MemoryStore {
        MemoryStore::new()
    }
    fn durable(&self) -> bool {
        false
    }
    async fn unreachable(&self) -> Option<MemoryStore> {
        None
    }
}

/// The in-memory backend (always there).
pub async fn memory() -> Option<Memory> {
    Some(Memory)
}

/// A SQLite database file in a temporary directory; every `open` is a new pool on it.
pub struct Sqlite {
    url: String,
    _dir: tempfile::TempDir,
}

#[async_trait::async_trait]
impl Backend for Sqlite {
    type Store = SqliteStore;
    async fn open(&self) -> SqliteStore {
        SqliteStore::connect(&self.url).await.expect("open sqlite")
    }
    fn durable(&self) -> bool {
        true
    }
    async fn unreachable(&self) -> Option<SqliteStore> {
        let store = self.open().await;
        store.pool().close().await;
        Some(store)
    }
}

/// A fresh SQLite database.
pub async fn sqlite() -> Option<Sqlite> {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("idem.db").display());
    Some(Sqlite { url, _dir: dir })
}

/// A PostgreSQL database of its own (named like the conformance suite's, so that a killed run's
/// leftovers are dropped by the next conformance run), dropped with this value.
pub struct Postgres {
    server: PgConnectOptions,
    name: String,
}

impl Postgres {
    /// Connection options for this database.
    pub fn options(&self) -> PgConnectOptions {
        self.server.clone().database(&self.name)
    }
}

#[async_trait::async_trait]
impl Backend for Postgres {
    type Store = PostgresStore;
    async fn open(&self) -> PostgresStore {
        let pool = PostgresStore::pool_options()
            .max_connections(4)
            .connect_with(self.options())
            .await
            .expect("connect to the test database");
        PostgresStore::from_pool(pool).await.expect("migrate")
    }
    fn durable(&self) -> bool {
        true
    }
    async fn unreachable(&self) -> Option<PostgresStore> {
        None
    }
}

/// A fresh PostgreSQL database, or `None` (skipped) when the server is unreachable outside CI.
pub async fn postgres() -> Option<Postgres> {
    let server: PgConnectOptions = match services::postgres_url().parse() {
        Ok(options) => options,
        Err(e) => return services::unreachable_service("PostgreSQL", &e),
    };
    let mut admin = match server.clone().database("postgres").connect().await {
        Ok(conn) => conn,
        Err(e) => return services::unreachable_service("PostgreSQL", &e),
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs();
    let name = format!("idem_test_{now}_{}", uuid::Uuid::new_v4().simple());
    sqlx::raw_sql(&format!(r#"CREATE DATABASE "{name}""#))
        .execute(&mut admin)
        .await
        .expect("create test database");
    Some(Postgres { server, name })
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let admin = self.server.clone().database("postgres");
        let name = self.name.clone();
        // Drop may run inside a runtime: do the blocking work on a thread of its own.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async {
                if let Ok(mut conn) = admin.connect().await {
                    let _ =
                        sqlx::raw_sql(&format!(r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#))
                            .execute(&mut conn)
                            .await;
                }
            })
        })
        .join();
    }
}

/// A Redis key prefix of its own; its keys are deleted when dropped.
pub struct Redis {
    /// The server URL.
    pub url: String,
    /// The prefix every store opened here uses.
    pub prefix: String,
}

#[async_trait::async_trait]
impl Backend for Redis {
    type Store = RedisStore;
    /// These tests check what the store does, not how fast: a response timeout far above the
    /// default 2 s keeps a machine starved of CPU from failing a case (a long model run saw a purge
    /// call exceed 2 s while two cores were shared with fuzzers and builds).
    async fn open(&self) -> RedisStore {
        RedisStore::builder(&self.url)
            .prefix(&self.prefix)
            .response_timeout(std::time::Duration::from_secs(30))
            .connect()
            .await
            .expect("connect to redis")
    }
    fn durable(&self) -> bool {
        true
    }
    async fn unreachable(&self) -> Option<RedisStore> {
        None
    }
}

/// A fresh Redis prefix, or `None` (skipped) when the server is unreachable outside CI.
pub async fn redis() -> Option<Redis> {
    let url = services::redis_url();
    match RedisStore::builder(&url).connect().await {
        Ok(_) => Some(Redis {
            url,
            prefix: format!("idem-test-{}", uuid::Uuid::new_v4()),
        }),
        Err(e) => services::unreachable_service("Redis", &e),
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let cleanup = || -> redis::RedisResult<()> {
            let client = redis::Client::open(self.url.as_str())?;
            let mut conn = client.get_connection()?;
            let keys: Vec<String> =
                redis::Commands::scan_match::<_, String>(&mut conn, format!("{}:*", self.prefix))?
                    .collect();
            for chunk in keys.chunks(500) {
                redis::cmd("DEL").arg(chunk).query::<()>(&mut conn)?;
            }
            Ok(())
        };
        if let Err(e) = cleanup() {
            eprintln!("could not delete the test keys under {}: {e}", self.prefix);
        }
    }
}
