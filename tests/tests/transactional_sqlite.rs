//! Transactional mode on SQLite: the ledger and idem's records in one file (a temporary one per
//! test). The cases are in `transactional_support`.

mod transactional_support;

use axum::Router;
use idem_runtime::clock::{Clock, ManualClock, Timestamp};
use idem_runtime::sqlx::{self, sqlite::SqlitePool};
use idem_runtime::store::sqlite::SqliteStore;
use idem_runtime::{Engine, Record, RecordKey, Store, Transactional};
use std::sync::Arc;
use transactional_support::*;

transactional_app!(idem_runtime::sqlx::Sqlite, SqliteStore);

struct Sqlite {
    _dir: tempfile::TempDir,
    url: String,
    store: Arc<SqliteStore>,
    engine: Engine,
    clock: ManualClock,
    controls: Controls,
    txn: Transactional<SqliteStore>,
    router: Router,
}

async fn setup() -> Sqlite {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("app.db").display());
    let store = Arc::new(SqliteStore::connect(&url).await.expect("open"));
    sqlx::query(LEDGER)
        .execute(store.pool())
        .await
        .expect("ledger table");
    let clock = ManualClock::new(Timestamp::from_millis(START_MS));
    let engine = Engine::from_arc(store.clone()).with_clock(clock.clone());
    let txn = Transactional::new(engine.clone(), store.clone()).expect("same store");
    let controls = Controls::default();
    let router = router(App {
        txn: txn.clone(),
        controls: controls.clone(),
    });
    Sqlite {
        _dir: dir,
        url,
        store,
        engine,
        clock,
        controls,
        txn,
        router,
    }
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
    fn router(&self) -> Router {
        self.router.clone()
    }
    fn controls(&self) -> &Controls {
        &self.controls
    }
    fn clock(&self) -> &ManualClock {
        &self.clock
    }
    fn engine(&self) -> &Engine {
        &self.engine
    }
    async fn ledger_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ledger")
            .fetch_one(self.store.pool())
            .await
            .expect("count")
    }
    async fn record(&self, user: &str, key: &str) -> Option<Record> {
        self.store
            .get(&RecordKey::new(user, key), self.clock.now())
            .await
            .expect("get")
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
    fn waiting_for_turns(&self) -> usize {
        self.txn.waiting_for_turns()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_and_record_commit_together() {
    transactional_support::write_and_record_commit_together(&setup().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_error_leaves_neither_row_nor_record() {
    transactional_support::a_server_error_leaves_neither_row_nor_record(&setup().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_leaves_neither_row_nor_record() {
    transactional_support::a_panic_leaves_neither_row_nor_record(&setup().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_identical_requests_write_once() {
    transactional_support::sixteen_identical_requests_write_once(&setup().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_runs_once_the_original_rolls_back() {
    transactional_support::a_duplicate_runs_once_the_original_rolls_back(&setup().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_blocked_past_the_wait_gets_409() {
    transactional_support::a_duplicate_blocked_past_the_wait_gets_409(&setup().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatch_and_expired_still_work() {
    transactional_support::mismatch_and_expired_still_work(&setup().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_opens_no_write() {
    transactional_support::a_replay_opens_no_write(&setup().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passed_request_still_gets_a_transaction() {
    transactional_support::a_passed_request_still_gets_a_transaction(&setup().await).await;
}
