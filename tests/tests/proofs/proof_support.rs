//! Backends for the model-based and fault-injection tests: the same stores the conformance suite
//! runs on, set up the same way (a temporary SQLite file, a PostgreSQL or MySQL database of its own, a Redis
//! or Redis Cluster key prefix of its own), each cleaned up when dropped.
//!
//! These tests open a backend once per test and give every generated case scopes of its own, so that
//! hundreds of cases cost one database, not hundreds.

#![allow(dead_code)] // each test file uses part of this module

use idem_runtime::clock::{Clock, ManualClock};
use idem_runtime::sqlx::postgres::PgConnectOptions;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::mysql::MySqlStore;
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::store::redis::{RedisClusterStore, RedisStore};
use idem_runtime::store::sqlite::SqliteStore;
use idem_tests::conformance::Backend;
use idem_tests::services;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use std::sync::Arc;

/// The in-memory store. Not shared between handles: every `open` is a new store, so a test that
/// wants two instances over one memory store clones an `Arc` instead.
pub struct Memory;

#[async_trait::async_trait]
impl Backend for Memory {
    type Store = MemoryStore;
    async fn open(&self, clock: Arc<dyn Clock>) -> MemoryStore {
        MemoryStore::new().with_clock(clock)
    }
    fn durable(&self) -> bool {
        false
    }
    async fn unreachable(&self) -> Option<MemoryStore> {
        None
    }
}

/// The in-memory backend (always there).
pub async fn memory() -> Memory {
    Memory
}

/// A SQLite database file in a temporary directory; every `open` is a new pool on it.
pub struct Sqlite {
    url: String,
    _dir: tempfile::TempDir,
}

#[async_trait::async_trait]
impl Backend for Sqlite {
    type Store = SqliteStore;
    async fn open(&self, clock: Arc<dyn Clock>) -> SqliteStore {
        let store = SqliteStore::connect(&self.url).await.expect("open sqlite");
        store.with_clock(clock)
    }
    fn durable(&self) -> bool {
        true
    }
    async fn unreachable(&self) -> Option<SqliteStore> {
        let store = SqliteStore::connect(&self.url).await.expect("open sqlite");
        store.pool().close().await;
        Some(store)
    }
}

/// A fresh SQLite database.
pub async fn sqlite() -> Sqlite {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("idem.db").display());
    Sqlite { url, _dir: dir }
}

/// A PostgreSQL database of its own (`services::TestDb`: named like every test database, dropped
/// with this value).
pub struct Postgres {
    db: services::TestDb,
}

impl Postgres {
    /// Connection options for this database.
    pub fn options(&self) -> PgConnectOptions {
        self.db.options()
    }
}

#[async_trait::async_trait]
impl Backend for Postgres {
    type Store = PostgresStore;
    async fn open(&self, clock: Arc<dyn Clock>) -> PostgresStore {
        let pool = PostgresStore::pool_options()
            .max_connections(4)
            .connect_with(self.options())
            .await
            .expect("connect to the test database");
        let store = PostgresStore::from_pool(pool).await.expect("migrate");
        store.with_clock(clock)
    }
    fn durable(&self) -> bool {
        true
    }
    async fn unreachable(&self) -> Option<PostgresStore> {
        None
    }
}

/// A fresh PostgreSQL database.
pub async fn postgres() -> Postgres {
    Postgres {
        db: services::TestDb::create().await,
    }
}

/// A MySQL/MariaDB database of its own (`services::MySqlTestDb`: named like every test database,
/// dropped with this value).
pub struct MySql {
    db: services::MySqlTestDb,
}

#[async_trait::async_trait]
impl Backend for MySql {
    type Store = MySqlStore;
    async fn open(&self, clock: Arc<dyn Clock>) -> MySqlStore {
        let pool = MySqlStore::pool_options()
            .max_connections(4)
            .connect_with(self.db.options())
            .await
            .expect("connect to the test database");
        let store = MySqlStore::from_pool(pool).await.expect("migrate");
        store.with_clock(clock)
    }
    fn durable(&self) -> bool {
        true
    }
    async fn unreachable(&self) -> Option<MySqlStore> {
        None
    }
}

/// A fresh MySQL/MariaDB database.
pub async fn mysql() -> MySql {
    MySql {
        db: services::MySqlTestDb::create().await,
    }
}

/// A Redis key prefix of its own (`services::RedisPrefix`); its keys are deleted when dropped.
pub struct Redis {
    space: services::RedisPrefix,
}

impl Redis {
    /// The server URL.
    pub fn url(&self) -> &str {
        self.space.url()
    }

    /// The prefix every store opened here uses.
    pub fn prefix(&self) -> &str {
        self.space.prefix()
    }
}

#[async_trait::async_trait]
impl Backend for Redis {
    type Store = RedisStore;
    /// These tests check what the store does, not how fast: a response timeout far above the
    /// default 2 s keeps a machine starved of CPU from failing a case (a long model run saw a purge
    /// call exceed 2 s while two cores were shared with fuzzers and builds).
    async fn open(&self, clock: Arc<dyn Clock>) -> RedisStore {
        RedisStore::builder(self.url())
            .prefix(self.prefix())
            .clock(clock)
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

/// A fresh Redis prefix.
pub async fn redis() -> Redis {
    Redis {
        space: services::RedisPrefix::create().await,
    }
}

/// A Redis Cluster key prefix of its own (`services::RedisClusterPrefix`); its keys are deleted when
/// dropped.
pub struct RedisCluster {
    space: services::RedisClusterPrefix,
}

#[async_trait::async_trait]
impl Backend for RedisCluster {
    type Store = RedisClusterStore;
    /// A long response timeout, as for [`Redis`].
    async fn open(&self, clock: Arc<dyn Clock>) -> RedisClusterStore {
        RedisClusterStore::builder(self.space.seeds())
            .prefix(self.space.prefix())
            .clock(clock)
            .response_timeout(std::time::Duration::from_secs(30))
            .connect()
            .await
            .expect("connect to the cluster")
    }
    fn durable(&self) -> bool {
        true
    }
    async fn unreachable(&self) -> Option<RedisClusterStore> {
        None
    }
}

/// A fresh Redis Cluster prefix.
pub async fn redis_cluster() -> RedisCluster {
    RedisCluster {
        space: services::RedisClusterPrefix::create().await,
    }
}

// ---------------------------------------------------------------------------------------------
// What the property tests share: their case budget, their seeded runner, two instances per backend
// ---------------------------------------------------------------------------------------------

/// The case budget: `PROPTEST_CASES`, else 64.
pub fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

/// A runner on a fixed seed (`IDEM_MODEL_SEED` picks another), so that CI runs the same cases
/// every time and a failure reproduces.
pub fn runner() -> TestRunner {
    let seed: u64 = std::env::var("IDEM_MODEL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x01de_5eed);
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Config {
        cases: cases(),
        failure_persistence: None,
        max_shrink_iters: 2_000,
        ..Config::default()
    };
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
}

/// Opens two instances over one backend's records (one shared store where the backend is memory),
/// both judging time by `clock`.
pub async fn instances<B: Backend>(backend: &B, clock: &ManualClock) -> Vec<Arc<B::Store>> {
    let first = Arc::new(backend.open(Arc::new(clock.clone())).await);
    let second = if backend.durable() {
        Arc::new(backend.open(Arc::new(clock.clone())).await)
    } else {
        first.clone()
    };
    vec![first, second]
}

/// A runner for racing cases: a quarter of the budget (they cost real time in tasks and round
/// trips), on the same seed.
pub fn racing_runner() -> TestRunner {
    let runner = runner();
    let mut config = runner.config().clone();
    config.cases = (cases() / 4).max(1);
    let mut seeded = runner;
    TestRunner::new_with_rng(config, seeded.new_rng())
}

/// An engine over each instance, with a store timeout long enough for a loaded machine.
pub fn engines<S: idem_runtime::Store>(instances: &[Arc<S>]) -> Vec<idem_runtime::Engine> {
    instances
        .iter()
        .map(|s| {
            idem_runtime::Engine::from_arc(s.clone())
                .with_store_timeout(Some(std::time::Duration::from_secs(30)))
        })
        .collect()
}
