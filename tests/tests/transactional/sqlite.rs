//! Transactional mode on SQLite: the ledger and idem's records in one file (a temporary one per
//! test). The cases are in `transactional_support`.

use crate::transactional_support::*;
use axum::Router;
use idem_runtime::clock::{ManualClock, Timestamp};
use idem_runtime::sqlx::{self, sqlite::SqlitePool, sqlite::SqlitePoolOptions};
use idem_runtime::store::sqlite::SqliteStore;
use idem_runtime::{Record, RecordKey, Store, Transactional};
use std::sync::Arc;

transactional_app!(idem_runtime::sqlx::Sqlite, SqliteStore);

struct Sqlite {
    _dir: tempfile::TempDir,
    url: String,
    store: Arc<SqliteStore>,
    clock: ManualClock,
    controls: Controls,
    txn: Transactional<SqliteStore>,
    router: Router,
}

/// The app on a fresh file, its pool capped at `connections` if given.
async fn setup(connections: Option<u32>) -> Sqlite {
    count_waits();
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("app.db").display());
    let options = SqliteStore::options(&url).expect("options");
    let store = match connections {
        None => SqliteStore::connect_with(options).await,
        Some(n) => {
            let pool = SqlitePoolOptions::new()
                .max_connections(n)
                .connect_with(options)
                .await
                .expect("pool");
            SqliteStore::from_pool(pool).await
        }
    };
    let store = store.expect("open");
    for ddl in SCHEMA {
        sqlx::query(ddl)
            .execute(store.pool())
            .await
            .expect("ledger");
    }
    let clock = ManualClock::new(Timestamp::from_millis(START_MS));
    let controls = Controls::default();
    let (txn, router) = instance(store, &clock, &controls);
    let store = txn.store().clone();
    Sqlite {
        _dir: dir,
        url,
        controls,
        store,
        clock,
        txn,
        router,
    }
}

/// The app on `store`, with `clock` and `controls`.
fn instance(
    store: SqliteStore,
    clock: &ManualClock,
    controls: &Controls,
) -> (Transactional<SqliteStore>, Router) {
    // The store judges the records' times by `clock`; the engine's clock decides nothing here.
    let txn = Transactional::new(store.with_clock(clock.clone()));
    let router = router(App {
        txn: txn.clone(),
        controls: controls.clone(),
    });
    (txn, router)
}

fn in_use(pool: &SqlitePool) -> usize {
    usize::try_from(pool.size()).expect("small") - pool.num_idle()
}

/// The connection holding the lock, and its pool (kept open while the lock is held).
struct Locked {
    conn: sqlx::pool::PoolConnection<sqlx::Sqlite>,
    _pool: SqlitePool,
}

#[async_trait::async_trait]
impl WriteLock for Locked {
    async fn release(mut self: Box<Self>) {
        sqlx::query("COMMIT")
            .execute(&mut *self.conn)
            .await
            .expect("unlock");
    }
}

#[async_trait::async_trait]
impl Backend for Sqlite {
    type Store = SqliteStore;
    fn router(&self) -> Router {
        self.router.clone()
    }
    fn controls(&self) -> &Controls {
        &self.controls
    }
    fn clock(&self) -> &ManualClock {
        &self.clock
    }
    fn txn(&self) -> &Transactional<SqliteStore> {
        &self.txn
    }
    fn in_use(&self) -> usize {
        in_use(self.store.pool())
    }
    async fn ledger_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ledger")
            .fetch_one(self.store.pool())
            .await
            .expect("count")
    }
    async fn record(&self, user: &str, key: &str) -> Option<Record> {
        let found = self.store.get(&RecordKey::new(user, key)).await;
        found.expect("get").map(|found| found.record)
    }
    async fn lock_writes(&self) -> Box<dyn WriteLock> {
        let pool = SqlitePool::connect_with(SqliteStore::options(&self.url).expect("options"))
            .await
            .expect("another pool");
        let mut conn = pool.acquire().await.expect("acquire");
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut *conn)
            .await
            .expect("write lock");
        Box::new(Locked { conn, _pool: pool })
    }
    /// A second store handle on the file: a pool of its own; in this process it shares the file's
    /// wake-ups and write gate, as SQLite's single instance does.
    async fn another_instance(&self) -> Instance {
        let store = SqliteStore::connect(&self.url)
            .await
            .expect("second handle");
        let (txn, router) = instance(store, &self.clock, &self.controls);
        let store = txn.store().clone();
        Instance {
            router,
            engine: txn.engine().clone(),
            in_use: Box::new(move || in_use(store.pool())),
        }
    }
}

transactional_cases!(setup = setup(None), small = setup(Some(2)));
