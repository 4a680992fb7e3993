//! Transactional mode on PostgreSQL: the ledger and idem's records in one database (a fresh one per
//! test, see `idem_tests::services::TestDb`). The shared cases are in `transactional_support`; the
//! ones below need PostgreSQL's own views (pool errors, lock waits).

use crate::transactional_support::*;
use axum::Router;
use idem_runtime::clock::{ManualClock, Timestamp};
use idem_runtime::metrics::Outcome;
use idem_runtime::sqlx::{self, postgres::PgPool, postgres::PgPoolOptions};
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::{Record, RecordKey, RecordState, Store, Transactional};
use idem_tests::services::TestDb;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

transactional_app!(idem_runtime::sqlx::Postgres, PostgresStore);

struct Postgres {
    store: Arc<PostgresStore>,
    /// For the tests' own reads, apart from the app's pool.
    checks: PgPool,
    clock: ManualClock,
    controls: Controls,
    txn: Transactional<PostgresStore>,
    router: Router,
    // Dropped last: the pools above close first.
    db: TestDb,
}

/// The app on a fresh database; a pool of 24 connections (16 concurrent requests) unless `options`
/// say otherwise.
async fn setup(options: Option<PgPoolOptions>) -> Postgres {
    count_waits();
    let db = TestDb::create().await;
    let options = options.unwrap_or_else(|| PostgresStore::pool_options().max_connections(24));
    let pool = options.connect_with(db.options()).await.expect("connect");
    for ddl in SCHEMA {
        sqlx::query(ddl).execute(&pool).await.expect("ledger");
    }
    let store = PostgresStore::from_pool(pool).await.expect("migrate");
    let checks = PgPool::connect_with(db.options()).await.expect("checks");
    let clock = ManualClock::new(Timestamp::from_millis(START_MS));
    let controls = Controls::default();
    let (txn, router) = instance(store, &clock, &controls);
    let store = txn.store().clone();
    Postgres {
        store,
        checks,
        clock,
        controls,
        txn,
        router,
        db,
    }
}

/// A pool of two connections, waiting for one as long as the test may need (never reached: a
/// timed-out wait would answer 503 and fail the test).
fn two_connections() -> Option<PgPoolOptions> {
    let options = PostgresStore::pool_options()
        .max_connections(2)
        .acquire_timeout(HANG);
    Some(options)
}

/// The app on `store`, with `clock` and `controls`.
fn instance(
    store: PostgresStore,
    clock: &ManualClock,
    controls: &Controls,
) -> (Transactional<PostgresStore>, Router) {
    // The store judges the records' times by `clock`; the engine's clock decides nothing here.
    let txn = Transactional::new(store.with_clock(clock.clone()));
    let router = router(App {
        txn: txn.clone(),
        controls: controls.clone(),
    });
    (txn, router)
}

fn in_use(pool: &PgPool) -> usize {
    usize::try_from(pool.size()).expect("small") - pool.num_idle()
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
    type Store = PostgresStore;
    fn router(&self) -> Router {
        self.router.clone()
    }
    fn controls(&self) -> &Controls {
        &self.controls
    }
    fn clock(&self) -> &ManualClock {
        &self.clock
    }
    fn txn(&self) -> &Transactional<PostgresStore> {
        &self.txn
    }
    fn in_use(&self) -> usize {
        in_use(self.store.pool())
    }
    async fn ledger_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM ledger")
            .fetch_one(&self.checks)
            .await
            .expect("count")
    }
    /// A released record counts as none, as the suite means it: the key is free, with neither a
    /// claim nor a response (the store keeps it for its request to resume; see
    /// `a_rolled_back_claim_is_kept_released` for the row itself).
    async fn record(&self, user: &str, key: &str) -> Option<Record> {
        let found = self.store.get(&RecordKey::new(user, key)).await;
        found
            .expect("get")
            .map(|found| found.record)
            .filter(|record| record.state != RecordState::Released)
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
    async fn another_instance(&self) -> Instance {
        let pool = PostgresStore::pool_options()
            .max_connections(8)
            .connect_with(self.db.options())
            .await
            .expect("second pool");
        let store = PostgresStore::from_pool(pool).await.expect("migrated");
        let (txn, router) = instance(store, &self.clock, &self.controls);
        let store = txn.store().clone();
        Instance {
            router,
            engine: txn.engine().clone(),
            in_use: Box::new(move || in_use(store.pool())),
        }
    }
}

transactional_cases!(
    #[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
    setup = setup(None),
    small = setup(two_connections())
);

impl Postgres {
    /// Returns once `n` sessions of this database wait for a lock. PostgreSQL announces no lock
    /// waits, so this polls `pg_locks`; the bound only turns a hang into a failure.
    async fn until_blocked(&self, n: i64) {
        tokio::time::timeout(HANG, async {
            loop {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(DISTINCT l.pid) FROM pg_locks l
                     JOIN pg_stat_activity a ON a.pid = l.pid
                     WHERE NOT l.granted AND a.datname = current_database()",
                )
                .fetch_one(&self.checks)
                .await
                .expect("pg_locks");
                if waiting >= n {
                    return;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{n} sessions never waited for a lock"));
    }
}

/// Every connection of the pool held by the test itself: a request gets the distinct
/// `urn:idem:problem:busy` 503 with `Retry-After` (the store is up, it has no capacity), counted
/// as busy, and nothing runs; with the connections back, the retry runs.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_pool_answers_busy_not_unavailable() {
    let options = PostgresStore::pool_options()
        .max_connections(2)
        .acquire_timeout(Duration::from_millis(200));
    let b = setup(Some(options)).await;
    let pool = b.store.pool();
    let held = [
        pool.acquire().await.expect("first"),
        pool.acquire().await.expect("second"),
    ];
    let body = json!({"amount": 4});
    let busy = send(&b.router(), post("/entries", "nora", "full", body.clone())).await;
    assert_eq!(busy.status, 503, "{busy:?}");
    assert_eq!(busy.problem_type(), "urn:idem:problem:busy");
    assert!(busy.headers.get("retry-after").is_some());
    let metrics = b.engine().metrics();
    assert_eq!(
        (
            metrics.get(Outcome::Busy),
            metrics.get(Outcome::Unavailable)
        ),
        (1, 0)
    );
    assert_eq!(b.controls().runs(), 0);

    drop(held);
    let retry = send(&b.router(), post("/entries", "nora", "full", body)).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(b.ledger_rows().await, 1);
}

/// A database that cannot be reached (nothing listens on its port) is `store-unavailable`, not
/// busy, and nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_down_database_answers_store_unavailable() {
    count_waits();
    // A port that was just free: nothing listens on it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    let options = sqlx::postgres::PgConnectOptions::new()
        .host("127.0.0.1")
        .port(port)
        .username("postgres")
        .database("idem");
    let pool = PostgresStore::pool_options()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy_with(options);
    let store = PostgresStore::from_pool_unmigrated(pool);
    let controls = Controls::default();
    let clock = ManualClock::new(Timestamp::from_millis(START_MS));
    let (txn, router) = instance(store, &clock, &controls);
    let down = send(
        &router,
        post("/entries", "otto", "down", json!({"amount": 1})),
    )
    .await;
    assert_eq!(down.status, 503, "{down:?}");
    assert_eq!(down.problem_type(), "urn:idem:problem:store-unavailable");
    assert!(down.headers.get("retry-after").is_some());
    let metrics = txn.engine().metrics();
    assert_eq!(
        (
            metrics.get(Outcome::Unavailable),
            metrics.get(Outcome::Busy)
        ),
        (1, 0)
    );
    assert_eq!(controls.runs(), 0);
}

/// Duplicates that arrive while the original's `COMMIT` is held up (a deferred trigger on the
/// ledger waits for an advisory lock the test holds) never run the handler: the record is still in
/// flight for them (its completion is not committed), they wait, and they replay once the commit
/// goes through. Meanwhile nothing of the original is visible from outside.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_during_a_slow_commit_replay_it() {
    let b = setup(None).await;
    for ddl in [
        "CREATE FUNCTION commit_gate() RETURNS trigger LANGUAGE plpgsql AS
         $$ BEGIN PERFORM pg_advisory_xact_lock_shared(4242); RETURN NULL; END $$",
        "CREATE CONSTRAINT TRIGGER commit_gate AFTER INSERT ON ledger
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION commit_gate()",
    ] {
        sqlx::query(ddl)
            .execute(&b.checks)
            .await
            .expect("commit gate");
    }
    let mut gate = b.checks.acquire().await.expect("gate connection");
    sqlx::query("SELECT pg_advisory_lock(4242)")
        .execute(&mut *gate)
        .await
        .expect("hold the gate");

    let router = b.router();
    let body = json!({"amount": 12});
    let original = tokio::spawn(sent(
        &router,
        post("/entries", "judy", "slow-commit", body.clone()),
    ));
    b.until_blocked(1).await; // the original's COMMIT, in the deferred trigger
    let mut duplicates = tokio::task::JoinSet::new();
    for _ in 0..5 {
        duplicates.spawn(sent(
            &router,
            post("/entries", "judy", "slow-commit", body.clone()),
        ));
    }
    // Each duplicate's announcement waits for the record's row, which the commit holds.
    b.until_blocked(6).await;
    let record = b.record("judy", "slow-commit").await.expect("claimed");
    assert!(matches!(record.state, RecordState::InFlight { .. }));
    assert_eq!(b.ledger_rows().await, 0);

    sqlx::query("SELECT pg_advisory_unlock(4242)")
        .execute(&mut *gate)
        .await
        .expect("open the gate");
    let original = original.await.expect("original");
    assert_eq!(original.status, 201, "{original:?}");
    for reply in replies(duplicates).await {
        assert_eq!(reply.status, 201, "{reply:?}");
        assert!(reply.replayed(), "{reply:?}");
        assert_eq!(reply.json(), original.json());
    }
    assert_eq!(b.ledger_rows().await, 1);
    assert_eq!(b.controls().runs(), 1);
}

/// A transactional claim rolled back (by hand here; a 5xx or a panic does the same) rolls the
/// business write back and keeps idem's record as released, its times kept (one row, no lease, no
/// response): the retry of the same request resumes it as the same record, with the same
/// downstream key, and completes it.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_claim_is_kept_released() {
    use idem_runtime::transaction::TxBegin;
    use idem_runtime::{Fingerprint, Policy, StoredResponse};
    let b = setup(None).await;
    let policy = Policy::new();
    let fp = Fingerprint::of_request("POST", "/by-hand", None, b"x");
    let key = RecordKey::new("ines", "undone");
    let Ok(TxBegin::Execute(mut claim)) = b.txn.begin(key.clone(), fp, &policy).await else {
        panic!("a fresh key executes");
    };
    let downstream = claim.guard.downstream_key();
    let row = Row {
        id: "kept-1",
        owner: "ines",
        amount: 3,
        parent: None,
    };
    claim.tx.insert(&row).await.expect("write");
    claim.rollback().await.expect("rollback");
    assert_eq!(b.ledger_rows().await, 0, "the write is rolled back");
    let rows: Vec<(String, Option<i64>, Option<i32>, i64)> = sqlx::query_as(
        "SELECT state, lease_until, status, created_at FROM idem.records \
         WHERE scope = $1 AND key = $2",
    )
    .bind(key.scope())
    .bind(key.key())
    .fetch_all(&b.checks)
    .await
    .expect("the record's row");
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(
        (rows[0].0.as_str(), rows[0].1, rows[0].2),
        ("released", None, None)
    );
    assert_eq!(rows[0].3, START_MS, "its creation kept");

    b.clock.advance(Duration::from_secs(1));
    let Ok(TxBegin::Execute(mut again)) = b.txn.begin(key.clone(), fp, &policy).await else {
        panic!("the retry executes");
    };
    assert!(!again.guard.taken_over(), "resumed, not taken over");
    assert_eq!(again.guard.downstream_key(), downstream, "the same record");
    again.tx.insert(&row).await.expect("write");
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: "made".into(),
    };
    again.complete(&response).await.expect("commit");
    assert_eq!(b.ledger_rows().await, 1);
    let record = b.record("ines", "undone").await.expect("completed");
    assert_eq!(record.created_at, Timestamp::from_millis(START_MS));
    assert!(matches!(record.state, RecordState::Completed { .. }));
}
