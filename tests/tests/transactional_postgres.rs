//! Transactional mode on PostgreSQL: the ledger and idem's records in one database (a fresh one per
//! test, see `idem_tests::services::TestDb`). The cases are in `transactional_support`.

mod transactional_support;

use axum::Router;
use idem_runtime::clock::{Clock, ManualClock, Timestamp};
use idem_runtime::sqlx::{self, postgres::PgPool};
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::{Engine, Record, RecordKey, Store, Transactional};
use idem_tests::services::TestDb;
use std::sync::Arc;
use std::time::Duration;
use transactional_support::*;

transactional_app!(idem_runtime::sqlx::Postgres, PostgresStore);

struct Postgres {
    store: Arc<PostgresStore>,
    /// For the tests' own reads, apart from the app's pool.
    checks: PgPool,
    engine: Engine,
    clock: ManualClock,
    controls: Controls,
    router: Router,
    // Dropped last: the pools above close first.
    _db: TestDb,
}

async fn setup() -> Option<Postgres> {
    let db = TestDb::create().await?;
    // 16 concurrent transactions, plus look-ups.
    let pool = PostgresStore::pool_options()
        .max_connections(24)
        .connect_with(db.options())
        .await
        .expect("connect");
    sqlx::query(LEDGER)
        .execute(&pool)
        .await
        .expect("ledger table");
    let store = Arc::new(PostgresStore::from_pool(pool).await.expect("migrate"));
    let checks = PgPool::connect_with(db.options()).await.expect("checks");
    let clock = ManualClock::new(Timestamp::from_millis(START_MS));
    let engine = Engine::from_arc(store.clone()).with_clock(clock.clone());
    let txn = Transactional::new(engine.clone(), store.clone()).expect("same store");
    let controls = Controls::default();
    let router = router(App {
        txn,
        controls: controls.clone(),
    });
    Some(Postgres {
        store,
        checks,
        engine,
        clock,
        controls,
        router,
        _db: db,
    })
}

struct Locked(sqlx::Transaction<'static, sqlx::Postgres>);

#[async_trait::async_trait]
impl WriteLock for Locked {
    async fn release(self: Box<Self>) {
        self.0.commit().await.expect("unlock");
    }
}

#[async_trait::async_trait]
impl Backend for Postgres {
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
            .fetch_one(&self.checks)
            .await
            .expect("count")
    }
    async fn record(&self, user: &str, key: &str) -> Option<Record> {
        self.store
            .get(&RecordKey::new(user, key), self.clock.now())
            .await
            .expect("get")
    }
    /// EXCLUSIVE mode lets plain reads through and blocks every insert, update and delete.
    async fn lock_writes(&self) -> Box<dyn WriteLock> {
        let mut tx = self.checks.begin().await.expect("begin");
        sqlx::query("LOCK TABLE idem.records IN EXCLUSIVE MODE")
            .execute(&mut *tx)
            .await
            .expect("lock");
        Box::new(Locked(tx))
    }
    async fn until_blocked(&self, n: usize) {
        // PostgreSQL announces no lock waits, so this polls pg_locks; the bound only turns a hang
        // into a failure.
        tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                     WHERE NOT l.granted AND a.datname = current_database()",
                )
                .fetch_one(&self.checks)
                .await
                .expect("pg_locks");
                if waiting >= i64::try_from(n).expect("small") {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the duplicates block on the key");
    }
}

macro_rules! cases {
    ($($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            let Some(backend) = setup().await else { return };
            transactional_support::$name(&backend).await;
        }
    )*};
}

cases!(
    write_and_record_commit_together,
    a_server_error_leaves_neither_row_nor_record,
    a_panic_leaves_neither_row_nor_record,
    sixteen_identical_requests_write_once,
    a_duplicate_blocked_past_the_wait_gets_409,
    mismatch_and_expired_still_work,
    a_replay_opens_no_write,
    a_passed_request_still_gets_a_transaction,
);
