//! The store conformance suite on the MySQL/MariaDB store, plus what only a shared database shows:
//! instances woken through the wake-up table, takeovers raced from two instances, and migrations
//! that coexist with the application's own.
//!
//! Every backend instance (each case) gets a fresh database on the server at
//! `IDEM_TEST_MYSQL_URL` ([`MySqlTestDb`]), dropped when the case ends.

use idem_runtime::clock::{Clock, ManualClock};
use idem_runtime::sqlx;
use idem_runtime::sqlx::mysql::{MySqlConnectOptions, MySqlPool};
use idem_runtime::store::mysql::MySqlStore;
use idem_runtime::store::{Claim, ClaimOutcome, Claimed, Found};
use idem_runtime::{FencingToken, RecordKey, RecordState, Store, StoreErrorKind};
use idem_tests::conformance::{fp, fresh_key, response, Backend, T0};
use idem_tests::services::MySqlTestDb;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Barrier;

/// What these cases open on their fresh database.
trait Open {
    /// A new store instance (a pool of its own) on this database.
    async fn store(&self) -> MySqlStore;
    /// A small pool on this database.
    async fn pool(&self) -> MySqlPool;
}

impl Open for MySqlTestDb {
    async fn store(&self) -> MySqlStore {
        let pool = MySqlStore::pool_options()
            .max_connections(5)
            .connect_with(self.options())
            .await
            .expect("connect to the test database");
        MySqlStore::from_pool(pool).await.expect("migrate")
    }

    async fn pool(&self) -> MySqlPool {
        MySqlStore::pool_options()
            .max_connections(2)
            .connect_with(self.options())
            .await
            .expect("connect to the test database")
    }
}

struct MySql {
    db: MySqlTestDb,
}

#[async_trait::async_trait]
impl Backend for MySql {
    type Store = MySqlStore;

    async fn open(&self, clock: Arc<dyn Clock>) -> MySqlStore {
        self.db.store().await.with_clock(clock)
    }

    fn durable(&self) -> bool {
        true
    }

    async fn unreachable(&self) -> Option<MySqlStore> {
        // Nothing listens on port 1; the lazy pool only fails when used, after the acquire timeout.
        let nowhere = MySqlConnectOptions::new()
            .host("127.0.0.1")
            .port(1)
            .username("root")
            .database("idem");
        let pool = MySqlStore::pool_options()
            .acquire_timeout(Duration::from_secs(2))
            .connect_lazy_with(nowhere);
        Some(MySqlStore::from_pool_unmigrated(pool))
    }
}

async fn mysql() -> MySql {
    MySql {
        db: MySqlTestDb::create().await,
    }
}

idem_tests::conformance_suite!(
    mysql,
    #[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
);

/// Bounds a failure only: every wait below ends as soon as its event happens.
const GENEROUS: Duration = Duration::from_secs(30);

fn claim_of(key: &RecordKey, token: FencingToken) -> Claim<'_> {
    Claim {
        key,
        fingerprint: fp("a"),
        token,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        retain: Duration::from_secs(4 * 3600),
    }
}

async fn claim_and_complete(store: &MySqlStore, key: &RecordKey) {
    let token = FencingToken::generate();
    let claimed = store.claim(&claim_of(key, token)).await.expect("claim");
    assert!(matches!(
        claimed,
        ClaimOutcome::Claimed(Claimed {
            taken_over: false,
            ..
        })
    ));
    store
        .complete(key, token, &response("a"))
        .await
        .expect("complete");
}

async fn count(pool: &MySqlPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .expect("count")
}

/// A completion or release on instance A wakes a waiter on instance B, which shares nothing with A
/// but the database: the wake-up can only come through the wake-up table B polls.
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_on_one_instance_wakes_a_waiter_on_another() {
    let db = MySqlTestDb::create().await;
    idem_tests::conformance::a_completion_or_release_wakes_its_key_on_another_instance(
        &db.store().await,
        &db.store().await,
    )
    .await;
}

/// Through the engine, woken through the wake-up table (the shared case in `idem_tests::conformance`).
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_on_another_instance_is_woken_through_the_database() {
    let db = MySqlTestDb::create().await;
    idem_tests::conformance::a_waiting_duplicate_on_another_instance_is_woken(
        db.store().await,
        db.store().await,
    )
    .await;
}

/// Only completions and releases of announced records write a wake-up row: one each, however many
/// waiters announced; a replay writes nothing at all.
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_awaited_records_write_wake_ups() {
    let db = MySqlTestDb::create().await;
    let store = db.store().await;
    let pool = db.pool().await;
    let wakeups = "SELECT COUNT(*) FROM idem_wakeups";

    claim_and_complete(&store, &fresh_key()).await;
    let released = fresh_key();
    let token = FencingToken::generate();
    store
        .claim(&claim_of(&released, token))
        .await
        .expect("claim");
    store.release(&released, token).await.expect("release");
    assert_eq!(count(&pool, wakeups).await, 0, "nobody waited");

    for (n, release) in [(1, false), (2, true)] {
        let key = fresh_key();
        let token = FencingToken::generate();
        store.claim(&claim_of(&key, token)).await.expect("claim");
        store.announce_waiter(&key).await.expect("announce");
        store
            .announce_waiter(&key)
            .await
            .expect("a second announce");
        if release {
            store.release(&key, token).await.expect("release");
        } else {
            store
                .complete(&key, token, &response("a"))
                .await
                .expect("complete");
        }
        assert_eq!(count(&pool, wakeups).await, n, "one wake-up per change");
    }
}

/// A replay reads the record without writing it: the row is the same afterwards, byte for byte,
/// and the server counted no row changed by the replays.
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_do_not_write() {
    let db = MySqlTestDb::create().await;
    let store = db.store().await;
    let key = fresh_key();
    claim_and_complete(&store, &key).await;
    for _ in 0..3 {
        match store
            .claim(&claim_of(&key, FencingToken::generate()))
            .await
            .expect("claim")
        {
            ClaimOutcome::Existing(Found { record, .. }) => assert_eq!(
                record.state,
                RecordState::Completed {
                    response: response("a")
                }
            ),
            other => panic!("expected the existing record, got {other:?}"),
        }
    }
    let rows: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM idem_records WHERE scope = ? AND `key` = ? AND watched = FALSE",
    )
    .bind(key.scope().as_bytes())
    .bind(key.key().as_bytes())
    .fetch_one(store.pool())
    .await
    .expect("count");
    assert_eq!(rows, 1);
}

/// A dead worker's claim, raced for from two instances by many duplicates at once once its lease
/// ran out: exactly one takes it over, every other sees its record in flight, and the row carries
/// the winner's token.
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_takeovers_elect_exactly_one() {
    const RACERS: usize = 16;
    let db = MySqlTestDb::create().await;
    let clock = ManualClock::new(T0);
    let a = Arc::new(db.store().await.with_clock(clock.clone()));
    let b = Arc::new(db.store().await.with_clock(clock.clone()));
    for round in 0..3 {
        let key = fresh_key();
        a.claim(&claim_of(&key, FencingToken::generate()))
            .await
            .expect("the dead worker's claim");
        clock.advance(Duration::from_secs(31));
        let barrier = Arc::new(Barrier::new(RACERS));
        let racers: Vec<_> = (0..RACERS)
            .map(|i| {
                let store = if i % 2 == 0 { a.clone() } else { b.clone() };
                let (barrier, key) = (barrier.clone(), key.clone());
                tokio::spawn(async move {
                    let token = FencingToken::generate();
                    barrier.wait().await;
                    let outcome = store.claim(&claim_of(&key, token)).await.expect("claim");
                    (token, outcome)
                })
            })
            .collect();
        let mut winners = Vec::new();
        for racer in racers {
            let (token, outcome) = racer.await.expect("join");
            match outcome {
                ClaimOutcome::Claimed(Claimed {
                    taken_over: true, ..
                }) => winners.push(token),
                ClaimOutcome::Existing(Found { record, .. }) => {
                    assert!(matches!(record.state, RecordState::InFlight { .. }))
                }
                other => panic!("round {round}: unexpected {other:?}"),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: {winners:?}");
        let found = a.get(&key).await.expect("get").expect("record");
        assert_eq!(found.record.token, winners[0]);
    }
}

/// A deadlock or lock wait timeout inside a claim is retried, never granted twice: a claim whose
/// row another transaction holds locked waits for it, then decides on what that transaction
/// committed. Here the other transaction completes the record, so the claim replays it.
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_waits_for_a_locked_row_and_decides_on_what_committed() {
    let db = MySqlTestDb::create().await;
    let clock = ManualClock::new(T0);
    let store = Arc::new(db.store().await.with_clock(clock.clone()));
    let pool = db.pool().await;
    let key = fresh_key();
    let first = FencingToken::generate();
    store.claim(&claim_of(&key, first)).await.expect("claim");
    // Its lease ran out: the next claim goes the locking way.
    clock.advance(Duration::from_secs(31));
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("SELECT token FROM idem_records WHERE scope = ? AND `key` = ? FOR UPDATE")
        .bind(key.scope().as_bytes())
        .bind(key.key().as_bytes())
        .fetch_one(&mut *tx)
        .await
        .expect("lock the row");
    let claiming = tokio::spawn({
        let (store, key) = (store.clone(), key.clone());
        async move { store.claim(&claim_of(&key, FencingToken::generate())).await }
    });
    // Complete only once the claim waits on our lock: an observable server state, polled, with a
    // bound that only limits a failure.
    let blocked = async {
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.processlist \
                 WHERE db = DATABASE() AND info LIKE '%FOR UPDATE%' AND info LIKE '%now_ms%'",
            )
            .fetch_one(&pool)
            .await
            .expect("processlist");
            if waiting >= 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(GENEROUS, blocked)
        .await
        .expect("the claim waits on the locked row");
    sqlx::query(
        "UPDATE idem_records SET state = 'completed', lease_until = NULL, status = 201, \
         headers = '[]', body = x'6f6b' WHERE scope = ? AND `key` = ?",
    )
    .bind(key.scope().as_bytes())
    .bind(key.key().as_bytes())
    .execute(&mut *tx)
    .await
    .expect("complete under the lock");
    tx.commit().await.expect("commit");
    match claiming.await.expect("join").expect("claim") {
        ClaimOutcome::Existing(Found { record, .. }) => {
            assert_eq!(record.token, first);
            assert!(matches!(record.state, RecordState::Completed { .. }));
        }
        other => panic!("expected the completed record, got {other:?}"),
    }
}

/// The store's migrations share the database's `_sqlx_migrations` with the application's (MySQL has
/// no schemas apart from databases): idem's migrator ignores the application's versions, and an
/// application migrator that ignores missing versions ignores idem's; both run on every start.
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_coexist_with_the_applications() {
    let db = MySqlTestDb::create().await;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("1_ledger.sql"),
        "CREATE TABLE ledger (id BIGINT PRIMARY KEY);",
    )
    .expect("write migration");
    let mut app = sqlx::migrate::Migrator::new(dir.path())
        .await
        .expect("app migrator");
    app.set_ignore_missing(true);
    let pool = db.pool().await;
    app.run(&pool).await.expect("app migrations");
    MySqlStore::migrate(&pool).await.expect("idem migrations");
    app.run(&pool).await.expect("app migrations again");
    MySqlStore::migrate(&pool).await.expect("idem again");
    let versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&pool)
            .await
            .expect("history");
    assert_eq!(versions.first(), Some(&1));
    assert!(versions.len() >= 2, "{versions:?}");
}

/// A rolling deploy or a rollback: an instance whose idem is older than the database's schema (the
/// history holds a version it does not know) still starts and works.
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_version_starts_after_a_later_one_migrated() {
    let db = MySqlTestDb::create().await;
    let pool = db.pool().await;
    MySqlStore::migrate(&pool).await.expect("migrate");
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (29991231000000, 'added by a later idem', true, x'00', 0)",
    )
    .execute(&pool)
    .await
    .expect("a version from the future");
    MySqlStore::migrate(&pool)
        .await
        .expect("a version this build does not know is ignored");
    let store = db.store().await;
    claim_and_complete(&store, &fresh_key()).await;
}

/// Several instances starting at once all migrate successfully.
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_starting_together_migrate_once() {
    let db = Arc::new(MySqlTestDb::create().await);
    let starts: Vec<_> = (0..4)
        .map(|_| {
            let db = db.clone();
            tokio::spawn(async move {
                let pool = db.pool().await;
                MySqlStore::migrate(&pool).await
            })
        })
        .collect();
    for start in starts {
        start.await.expect("join").expect("migrate");
    }
    let pool = db.pool().await;
    assert_eq!(
        count(
            &pool,
            "SELECT COUNT(*) FROM _sqlx_migrations WHERE version = 20261207000000"
        )
        .await,
        1
    );
}

/// Keys compare byte for byte: no collation folds case or trailing spaces, and the longest bounded
/// parts fit the primary key.
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_compare_byte_for_byte() {
    let db = MySqlTestDb::create().await;
    let store = db.store().await;
    let scope = format!("scope-{}", uuid::Uuid::new_v4());
    let keys = ["k", "K", "k ", "é", "e\u{301}"].map(|k| RecordKey::new(scope.clone(), k));
    for key in &keys {
        claim_and_complete(&store, key).await;
    }
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_records WHERE scope = ?")
        .bind(scope.as_bytes())
        .fetch_one(store.pool())
        .await
        .expect("count");
    assert_eq!(rows, keys.len() as i64);
}

/// A record whose stored headers do not decode is reported as corrupt, not as a missing or new key.
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_record_is_corrupt() {
    let db = MySqlTestDb::create().await;
    let store = db.store().await;
    let key = fresh_key();
    sqlx::query(
        "INSERT INTO idem_records \
         (scope, `key`, fingerprint, token, created_at, expires_at, retain_until, state, status, \
          headers, body) \
         VALUES (?, ?, ?, 1, 0, ?, ?, 'completed', 201, 'not json', x'00')",
    )
    .bind(key.scope().as_bytes())
    .bind(key.key().as_bytes())
    .bind(fp("a").0.as_slice())
    .bind(i64::MAX / 2)
    .bind(i64::MAX / 2)
    .execute(store.pool())
    .await
    .expect("insert a bad row");
    let err = store.get(&key).await.expect_err("corrupt");
    assert_eq!(err.kind(), StoreErrorKind::Corrupt);
    let err = store
        .claim(&claim_of(&key, FencingToken::generate()))
        .await
        .expect_err("corrupt");
    assert_eq!(err.kind(), StoreErrorKind::Corrupt);
}

/// An erase leaves nothing of its scope in the table, bodies included, and every row of another
/// scope: counted in `idem_records` itself, not through the store.
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erase_leaves_no_row_of_the_scope_in_the_table() {
    let backend = mysql().await;
    let store = backend.db.store().await;
    let pool = backend.db.pool().await;
    for scope in ["erased", "kept"] {
        for i in 0..3 {
            claim_and_complete(&store, &RecordKey::new(scope, format!("k{i}"))).await;
        }
    }
    assert_eq!(store.erase_scope("erased", 100).await.expect("erase"), 3);
    let rows: Vec<(Vec<u8>, i64)> = sqlx::query_as(
        "SELECT scope, COUNT(*) FROM idem_records WHERE body IS NOT NULL GROUP BY scope",
    )
    .fetch_all(&pool)
    .await
    .expect("the table reads");
    assert_eq!(rows, vec![(b"kept".to_vec(), 3)]);
    assert_eq!(count(&pool, "SELECT COUNT(*) FROM idem_records").await, 3);
}
