//! Transactional mode on MySQL/MariaDB: the ledger and idem's records in one database (a fresh one
//! per test, see `idem_tests::services::MySqlTestDb`). The shared cases are in
//! `transactional_support`, all but the failed commit: MySQL checks foreign keys at once, never at
//! `COMMIT`, so the shared way of making a commit fail does not exist here.

use crate::transactional_support::*;
use axum::Router;
use idem_runtime::clock::{ManualClock, Timestamp};
use idem_runtime::sqlx::{self, mysql::MySqlPool, mysql::MySqlPoolOptions};
use idem_runtime::store::mysql::MySqlStore;
use idem_runtime::{Record, RecordKey, RecordState, Store, Transactional};
use idem_tests::services::MySqlTestDb;
use serde_json::json;
use std::sync::Arc;

transactional_app!(idem_runtime::sqlx::MySql, MySqlStore);

/// The ledger, as `SCHEMA` on the other databases; the foreign key is checked at once.
const MYSQL_SCHEMA: [&str; 2] = [
    "CREATE TABLE parents (id VARCHAR(64) PRIMARY KEY) ENGINE = InnoDB",
    "CREATE TABLE ledger (id VARCHAR(64) PRIMARY KEY, owner VARCHAR(255) NOT NULL,
         amount BIGINT NOT NULL, parent VARCHAR(64) NULL,
         FOREIGN KEY (parent) REFERENCES parents (id)) ENGINE = InnoDB",
];

struct MySql {
    store: Arc<MySqlStore>,
    /// For the tests' own reads, apart from the app's pool.
    checks: MySqlPool,
    clock: ManualClock,
    controls: Controls,
    txn: Transactional<MySqlStore>,
    router: Router,
    // Dropped last: the pools above close first.
    db: MySqlTestDb,
}

/// The app on a fresh database; a pool of 24 connections (16 concurrent requests) unless `options`
/// say otherwise.
async fn setup(options: Option<MySqlPoolOptions>) -> MySql {
    count_waits();
    let db = MySqlTestDb::create().await;
    let options = options.unwrap_or_else(|| MySqlStore::pool_options().max_connections(24));
    let pool = options.connect_with(db.options()).await.expect("connect");
    for ddl in MYSQL_SCHEMA {
        sqlx::query(ddl).execute(&pool).await.expect("ledger");
    }
    let store = MySqlStore::from_pool(pool).await.expect("migrate");
    let checks = MySqlPool::connect_with(db.options()).await.expect("checks");
    let clock = ManualClock::new(Timestamp::from_millis(START_MS));
    let controls = Controls::default();
    let (txn, router) = instance(store, &clock, &controls);
    let store = txn.store().clone();
    MySql {
        store,
        checks,
        clock,
        controls,
        txn,
        router,
        db,
    }
}

/// A pool of two connections, waiting for one as long as the test may need.
fn two_connections() -> Option<MySqlPoolOptions> {
    let options = MySqlStore::pool_options()
        .max_connections(2)
        .acquire_timeout(HANG);
    Some(options)
}

/// The app on `store`, with `clock` and `controls`.
fn instance(
    store: MySqlStore,
    clock: &ManualClock,
    controls: &Controls,
) -> (Transactional<MySqlStore>, Router) {
    let txn = Transactional::new(store.with_clock(clock.clone()));
    let router = router(App {
        txn: txn.clone(),
        controls: controls.clone(),
    });
    (txn, router)
}

fn in_use(pool: &MySqlPool) -> usize {
    usize::try_from(pool.size()).expect("small") - pool.num_idle()
}

struct Locked(sqlx::Transaction<'static, sqlx::MySql>);

#[async_trait::async_trait]
impl WriteLock for Locked {
    async fn release(self: Box<Self>) {
        self.0.commit().await.expect("unlock");
    }
}

#[async_trait::async_trait]
impl Backend for MySql {
    type Store = MySqlStore;
    fn router(&self) -> Router {
        self.router.clone()
    }
    fn controls(&self) -> &Controls {
        &self.controls
    }
    fn clock(&self) -> &ManualClock {
        &self.clock
    }
    fn txn(&self) -> &Transactional<MySqlStore> {
        &self.txn
    }
    fn in_use(&self) -> usize {
        in_use(self.store.pool())
    }
    async fn ledger_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM ledger")
            .fetch_one(&self.checks)
            .await
            .expect("count")
    }
    /// A released record is no claim: the shared cases say "no record" for it, as they were written
    /// when a release deleted the record; this store keeps it, `Released`, as the contract says.
    async fn record(&self, user: &str, key: &str) -> Option<Record> {
        let found = self.store.get(&RecordKey::new(user, key)).await;
        found
            .expect("get")
            .map(|found| found.record)
            .filter(|record| record.state != RecordState::Released)
    }
    /// Every row and every gap of `idem_records` locked (a locking full scan under REPEATABLE
    /// READ): inserts, updates and deletes wait; plain (consistent) reads go through.
    async fn lock_writes(&self) -> Box<dyn WriteLock> {
        let mut tx = self.checks.begin().await.expect("begin");
        sqlx::query("SELECT COUNT(*) FROM (SELECT token FROM idem_records FOR UPDATE) AS locked")
            .execute(&mut *tx)
            .await
            .expect("lock");
        Box::new(Locked(tx))
    }
    async fn another_instance(&self) -> Instance {
        let pool = MySqlStore::pool_options()
            .max_connections(8)
            .connect_with(self.db.options())
            .await
            .expect("second pool");
        let store = MySqlStore::from_pool(pool).await.expect("migrated");
        let (txn, router) = instance(store, &self.clock, &self.controls);
        let store = txn.store().clone();
        Instance {
            router,
            engine: txn.engine().clone(),
            in_use: Box::new(move || in_use(store.pool())),
        }
    }
}

transactional_cases!(@each [
    #[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
] setup(None) =>
    write_and_record_commit_together,
    a_server_error_leaves_neither_row_nor_record,
    a_panic_leaves_neither_row_nor_record,
    a_body_the_extractor_refuses_releases_the_key,
    a_handler_that_never_writes_has_its_response_stored,
    sixteen_identical_requests_write_once,
    duplicates_on_another_instance_wait_without_a_connection,
    a_duplicate_runs_once_the_original_rolls_back,
    a_duplicate_blocked_past_the_wait_gets_409,
    mismatch_and_expired_still_work,
    a_replay_opens_no_write,
    a_passed_request_still_gets_a_transaction,
    a_takeover_fences_the_first_attempts_commit,
    a_request_dropped_mid_handler_still_commits,
    the_claim_commits_alone_and_the_transaction_begins_at_first_use,
    a_function_call_commits_its_writes_with_its_output,
);
transactional_cases!(@each [
    #[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
] setup(two_connections()) =>
    a_duplicate_storm_leaves_the_pool_to_other_keys,
    distinct_keys_make_their_foreign_calls_together,
);

/// A write the database refuses inside the handler's transaction (here a foreign key MySQL checks
/// at once) fails the handler's statement; the handler answers 503, the transaction rolls back and
/// the key is released: no row, and the retry runs again and writes once.
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_write_rolls_back_and_the_retry_runs() {
    let b = setup(None).await;
    b.controls()
        .orphan_next
        .store(1, std::sync::atomic::Ordering::Relaxed);
    let body = json!({"amount": 5});
    let refused = send(&b.router(), post("/entries", "ivy", "fk", body.clone())).await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(b.ledger_rows().await, 0);
    let retry = send(&b.router(), post("/entries", "ivy", "fk", body)).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(b.controls().runs(), 2);
}

/// The deadlock path: the handler's transaction has written its ledger row and idem's completion
/// is next, while another transaction (heavier, so InnoDB rolls back the handler's instead) holds a
/// shared lock on the record's row and waits for the handler's uncommitted ledger row. The
/// completion's `UPDATE` closes the cycle; InnoDB answers 1213 and rolls the handler's transaction
/// back. The request answers 503, nothing of it is stored, the key is released, and the retry runs
/// again and writes once.
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deadlock_at_the_completion_rolls_back_and_the_retry_runs() {
    let b = setup(None).await;
    let body = json!({"amount": 7, "hold": "tx"});
    let original = tokio::spawn(sent(
        &b.router(),
        post("/entries", "dora", "deadlock", body),
    ));
    b.controls().until_held(1).await;

    let mut other = b.checks.begin().await.expect("begin");
    for i in 0..50 {
        sqlx::query("INSERT INTO parents (id) VALUES (?)")
            .bind(format!("p{i}"))
            .execute(&mut *other)
            .await
            .expect("weigh the other transaction");
    }
    let key = RecordKey::new("dora", "deadlock");
    sqlx::query("SELECT token FROM idem_records WHERE scope = ? AND `key` = ? LOCK IN SHARE MODE")
        .bind(key.scope().as_bytes())
        .bind(key.key().as_bytes())
        .fetch_one(&mut *other)
        .await
        .expect("share-lock the record's row");
    let waiting = tokio::spawn(async move {
        sqlx::query("SELECT COUNT(*) FROM (SELECT id FROM ledger FOR UPDATE) AS rows_locked")
            .execute(&mut *other)
            .await
            .expect("the other transaction is not the victim");
        other
    });
    until_lock_waits(&b.checks, 1).await;
    b.controls().release.add_permits(1);

    let original = original.await.expect("original");
    assert_eq!(original.status, 503, "{original:?}");
    waiting.await.expect("join").commit().await.expect("commit");
    assert_eq!(b.ledger_rows().await, 0, "the handler's write rolled back");
    assert!(b.record("dora", "deadlock").await.is_none(), "released");

    let retry = send(
        &b.router(),
        post("/entries", "dora", "deadlock", json!({"amount": 7})),
    )
    .await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(b.controls().runs(), 2);
}

/// Returns once `n` InnoDB transactions wait for a lock; the bound only turns a hang into a failure.
async fn until_lock_waits(checks: &MySqlPool, n: i64) {
    tokio::time::timeout(HANG, async {
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'",
            )
            .fetch_one(checks)
            .await
            .expect("innodb_trx");
            if waiting >= n {
                return;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{n} transactions never waited for a lock"));
}
