//! The store conformance suite on the PostgreSQL store, plus what only a shared database shows:
//! instances woken through LISTEN/NOTIFY, replays that write nothing, and migrations that coexist
//! with the application's own.
//!
//! Every backend instance (each case) gets a fresh database on the server at
//! `IDEM_TEST_POSTGRES_URL` ([`TestDb`]), dropped when the case ends.

use idem_runtime::clock::{Clock, ManualClock, Timestamp};
use idem_runtime::sqlx::postgres::{PgConnectOptions, PgPool};
use idem_runtime::sqlx::{self, ConnectOptions, Row};
use idem_runtime::store::postgres::testing::{bind_claim, CLAIM_STATEMENT};
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::store::Purge;
use idem_runtime::store::{Claim, ClaimOutcome, Claimed, Found};
use idem_runtime::{Begin, Engine, FencingToken, RecordState, Rejection, Store, StoreErrorKind};
use idem_tests::conformance::{fp, fresh_key, policy, response, Backend, T0};
use idem_tests::services::TestDb;
use std::sync::Arc;
use std::time::Duration;

/// Bounds a failure only: every wait below ends as soon as its event happens.
const GENEROUS: Duration = Duration::from_secs(30);

/// What these cases open on their fresh database.
trait Open {
    /// A new store instance (a pool of its own) on this database.
    async fn store(&self) -> PostgresStore;
    /// A small pool on this database.
    async fn pool(&self) -> PgPool;
}

impl Open for TestDb {
    async fn store(&self) -> PostgresStore {
        let pool = PostgresStore::pool_options()
            .max_connections(5)
            .connect_with(self.options())
            .await
            .expect("connect to the test database");
        PostgresStore::from_pool(pool).await.expect("migrate")
    }

    async fn pool(&self) -> PgPool {
        PostgresStore::pool_options()
            .max_connections(2)
            .connect_with(self.options())
            .await
            .expect("connect to the test database")
    }
}

struct Postgres {
    db: TestDb,
}

#[async_trait::async_trait]
impl Backend for Postgres {
    type Store = PostgresStore;

    async fn open(&self, clock: Arc<dyn Clock>) -> PostgresStore {
        self.db.store().await.with_clock(clock)
    }

    fn durable(&self) -> bool {
        true
    }

    async fn unreachable(&self) -> Option<PostgresStore> {
        // Nothing listens on port 1; the lazy pool only fails when used, after the acquire timeout.
        let nowhere = PgConnectOptions::new()
            .host("127.0.0.1")
            .port(1)
            .username("postgres")
            .database("idem");
        let pool = PostgresStore::pool_options()
            .acquire_timeout(Duration::from_secs(2))
            .connect_lazy_with(nowhere);
        Some(PostgresStore::from_pool_unmigrated(pool))
    }
}

async fn postgres() -> Postgres {
    Postgres {
        db: TestDb::create().await,
    }
}

idem_tests::conformance_suite!(
    postgres,
    #[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
);

fn claim_of<'a>(key: &'a idem_runtime::RecordKey, token: FencingToken) -> Claim<'a> {
    Claim {
        key,
        fingerprint: fp("a"),
        token,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        retain: Duration::from_secs(4 * 3600),
    }
}

async fn claim_and_complete(store: &PostgresStore, key: &idem_runtime::RecordKey) {
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

/// A completion or release on instance A wakes a waiter on instance B, which shares nothing with A
/// but the database: the wake-up can only come through NOTIFY (`from_pool` returns once the
/// listener listens).
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_on_one_instance_wakes_a_waiter_on_another() {
    let db = TestDb::create().await;
    idem_tests::conformance::a_completion_or_release_wakes_its_key_on_another_instance(
        &db.store().await,
        &db.store().await,
    )
    .await;
}

/// Through the engine, woken through LISTEN/NOTIFY (the shared case in `idem_tests::conformance`).
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_on_another_instance_is_woken_through_the_database() {
    let db = TestDb::create().await;
    idem_tests::conformance::a_waiting_duplicate_on_another_instance_is_woken(
        db.store().await,
        db.store().await,
    )
    .await;
}

/// Completions and releases notify only records a waiter announced: PostgreSQL serialises the
/// commits of notifying transactions, so a NOTIFY per completion would cap a busy service's
/// completion rate. Observed by a raw listener on the channel; a sentinel notification sent after
/// each operation proves that nothing came before it.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_awaited_records_are_notified() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let pool = db.pool().await;
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool)
        .await
        .expect("listener");
    listener
        .listen(idem_runtime::store::postgres::CHANNEL)
        .await
        .expect("listen");
    let mut next = async || {
        tokio::time::timeout(GENEROUS, listener.recv())
            .await
            .expect("a notification arrives")
            .expect("listener")
            .payload()
            .to_owned()
    };
    let sentinel = async |pool: &PgPool| {
        sqlx::query("SELECT pg_notify($1, 'sentinel')")
            .bind(idem_runtime::store::postgres::CHANNEL)
            .execute(pool)
            .await
            .expect("sentinel");
    };

    // Nobody waits: completion and release send nothing before the sentinel.
    claim_and_complete(&store, &fresh_key()).await;
    let released = fresh_key();
    let token = FencingToken::generate();
    store
        .claim(&claim_of(&released, token))
        .await
        .expect("claim");
    store.release(&released, token).await.expect("release");
    sentinel(&pool).await;
    assert_eq!(next().await, "sentinel");

    // Announced: each sends its key's notification, then the sentinel follows.
    for release in [false, true] {
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
        sentinel(&pool).await;
        let named: (String, String) =
            serde_json::from_str(&next().await).expect("the key's payload");
        assert_eq!(named, (key.scope().to_owned(), key.key().to_owned()));
        assert_eq!(next().await, "sentinel", "one notification per change");
    }
}

/// A replay reads the record without writing it: the row's version (xmin, ctid) stays the same, so
/// no `DO UPDATE` or other write happened.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_do_not_write() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let key = fresh_key();
    claim_and_complete(&store, &key).await;
    let version = |pool: PgPool, key: idem_runtime::RecordKey| async move {
        let row = sqlx::query(
            "SELECT xmin::text AS xmin, ctid::text AS ctid FROM idem.records \
             WHERE scope = $1 AND key = $2",
        )
        .bind(key.scope())
        .bind(key.key())
        .fetch_one(&pool)
        .await
        .expect("row version");
        (row.get::<String, _>("xmin"), row.get::<String, _>("ctid"))
    };
    let before = version(store.pool().clone(), key.clone()).await;
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
    assert_eq!(version(store.pool().clone(), key.clone()).await, before);
    // The control: a write does change the version.
    let in_flight = fresh_key();
    let token = FencingToken::generate();
    store
        .claim(&claim_of(&in_flight, token))
        .await
        .expect("claim");
    let claimed = version(store.pool().clone(), in_flight.clone()).await;
    store
        .complete(&in_flight, token, &response("b"))
        .await
        .expect("complete");
    assert_ne!(version(store.pool().clone(), in_flight).await, claimed);
}

/// A replay's claim statement is a primary-key read: PostgreSQL never executes its write branch
/// (`idem.claim`), whose cost a replay would otherwise pay. A new key does execute it, once.
/// Read from `EXPLAIN ANALYZE` of the statement the store issues, with the store's binds.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_never_execute_the_insert() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let existing = fresh_key();
    claim_and_complete(&store, &existing).await;
    let plan = |key: idem_runtime::RecordKey| {
        let pool = store.pool().clone();
        async move {
            let claim = claim_of(&key, FencingToken::generate());
            let explain = format!("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) {CLAIM_STATEMENT}");
            let rows = bind_claim(&explain, &claim, None)
                .fetch_all(&pool)
                .await
                .expect("explain the claim statement");
            rows.iter()
                .map(|row| row.get::<String, _>(0))
                .find(|line| line.contains("Function Scan on claim"))
                .unwrap_or_else(|| panic!("no idem.claim node in the plan of {key}"))
        }
    };
    let replay = plan(existing.clone()).await;
    assert!(replay.contains("never executed"), "replay: {replay}");
    let fresh = plan(fresh_key()).await;
    assert!(fresh.contains("loops=1"), "new key: {fresh}");
    assert!(!fresh.contains("never executed"), "new key: {fresh}");
}

/// The store's migrations keep their own history (`idem._sqlx_migrations`), so an application's
/// migrator in the same database neither sees them nor needs `set_ignore_missing`, and both can run
/// on every start.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_coexist_with_the_applications() {
    let db = TestDb::create().await;
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("1_ledger.sql"),
        "CREATE TABLE ledger (id BIGINT PRIMARY KEY);",
    )
    .expect("write migration");
    let app = sqlx::migrate::Migrator::new(dir.path())
        .await
        .expect("app migrator");
    let pool = db.pool().await;
    app.run(&pool).await.expect("app migrations");
    PostgresStore::migrate(&pool)
        .await
        .expect("idem migrations");
    // Both again, in the other order, as on a restart: neither trips over the other's versions.
    app.run(&pool).await.expect("app migrations again");
    PostgresStore::migrate(&pool).await.expect("idem again");
    let app_versions: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM public._sqlx_migrations ORDER BY version")
            .fetch_all(&pool)
            .await
            .expect("app history");
    assert_eq!(app_versions, vec![1]);
    let idem_versions: i64 = sqlx::query_scalar("SELECT count(*) FROM idem._sqlx_migrations")
        .fetch_one(&pool)
        .await
        .expect("idem history");
    assert!(idem_versions >= 1);
    // The migration connection's search_path did not leak into the pool.
    let search_path: String = sqlx::query_scalar("SHOW search_path")
        .fetch_one(&pool)
        .await
        .expect("search_path");
    assert!(!search_path.starts_with("idem"), "{search_path}");
}

/// A rolling deploy or a rollback: an instance whose idem is older than the database's schema (the
/// history holds a version it does not know) still starts and works, since idem's migrations only
/// add. Without `ignore_missing` sqlx refuses with "previously applied but is missing".
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_version_starts_after_a_later_one_migrated() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    PostgresStore::migrate(&pool).await.expect("migrate");
    sqlx::query(
        "INSERT INTO idem._sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (29991231000000, 'added by a later idem', true, '\\x00', 0)",
    )
    .execute(&pool)
    .await
    .expect("a version from the future");
    PostgresStore::migrate(&pool)
        .await
        .expect("a version this build does not know is ignored");
    let store = db.store().await;
    let key = fresh_key();
    claim_and_complete(&store, &key).await;
}

/// Several instances starting at once all migrate successfully.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_starting_together_migrate_once() {
    let db = TestDb::create().await;
    let db = std::sync::Arc::new(db);
    let starts: Vec<_> = (0..4)
        .map(|_| {
            let db = db.clone();
            tokio::spawn(async move {
                let pool = db.pool().await;
                PostgresStore::migrate(&pool).await
            })
        })
        .collect();
    for start in starts {
        start.await.expect("join").expect("migrate");
    }
}

/// A record with an undecodable state is reported as corrupt, not as a missing or new key.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_record_is_corrupt() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let key = fresh_key();
    sqlx::query(
        "INSERT INTO idem.records \
         (scope, key, fingerprint, token, created_at, expires_at, retain_until, state, lease_until) \
         VALUES ($1, $2, $3, 1, 0, $4, $4, 'in_flight', 0)",
    )
    .bind(key.scope())
    .bind(key.key())
    .bind(&[1u8, 2, 3][..])
    .bind(T0.as_millis() + 1)
    .execute(store.pool())
    .await
    .expect("insert a bad row");
    let err = store
        .get(&key)
        .await
        .map(|found| found.map(|f| f.record))
        .expect_err("corrupt");
    assert_eq!(err.kind(), StoreErrorKind::Corrupt);
    let err = store
        .claim(&claim_of(&key, FencingToken::generate()))
        .await
        .expect_err("corrupt");
    assert_eq!(err.kind(), StoreErrorKind::Corrupt);
}

/// The READ COMMITTED case: a claim whose insert waits on another transaction's uncommitted insert of
/// the same key finds, once that commits, neither its own row (conflict) nor, under the snapshot its
/// read took, the other's. It must read again and return the other's record, never claim it too.
/// The claim statement itself does that read (inside `idem.claim`, under a new snapshot, locked):
/// one row, kept, their token, rather than nothing and a second run of the statement.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_racing_an_uncommitted_insert_returns_it_once_committed() {
    let db = TestDb::create().await;
    let store = std::sync::Arc::new(db.store().await);
    let pool = db.pool().await;
    let key = fresh_key();
    let theirs = FencingToken::generate();
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO idem.records \
         (scope, key, fingerprint, token, created_at, expires_at, retain_until, state, lease_until) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, 'in_flight', $8)",
    )
    .bind(key.scope())
    .bind(key.key())
    .bind(fp("a").0.as_slice())
    .bind(theirs.0)
    .bind(T0.as_millis())
    .bind((T0 + Duration::from_secs(3600)).as_millis())
    .bind((T0 + Duration::from_secs(4 * 3600)).as_millis())
    .bind((T0 + Duration::from_secs(30)).as_millis())
    .execute(&mut *tx)
    .await
    .expect("insert, uncommitted");

    let claiming = tokio::spawn({
        let (store, key) = (store.clone(), key.clone());
        async move { store.claim(&claim_of(&key, FencingToken::generate())).await }
    });
    let statement = tokio::spawn({
        let (options, key) = (db.options(), key.clone());
        async move {
            let mut conn = options.connect().await.expect("a connection of its own");
            let claim = claim_of(&key, FencingToken::generate());
            bind_claim(CLAIM_STATEMENT, &claim, Some(T0))
                .fetch_all(&mut conn)
                .await
                .expect("the claim statement")
                .iter()
                .map(|row| (row.get::<String, _>("rule"), row.get::<i64, _>("token")))
                .collect::<Vec<_>>()
        }
    });
    // Commit only once the claim is blocked on our row: an observable server state, polled, with a
    // bound that only limits a failure.
    let blocked = async {
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock' \
                 AND query LIKE '%idem.claim(%'",
            )
            .fetch_one(&pool)
            .await
            .expect("pg_stat_activity");
            if waiting == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(GENEROUS, blocked)
        .await
        .expect("both claims block on the uncommitted row");
    tx.commit().await.expect("commit");

    assert_eq!(
        statement.await.expect("join"),
        vec![("keep".to_owned(), theirs.0)],
        "the statement returns their record, read inside the function"
    );

    match claiming.await.expect("join").expect("claim") {
        ClaimOutcome::Existing(Found { record, .. }) => {
            assert_eq!(record.token, theirs);
            assert_eq!(
                record.state,
                RecordState::InFlight {
                    lease_until: T0 + Duration::from_secs(30)
                }
            );
        }
        other => panic!("expected their record, got {other:?}"),
    }
}

/// What a server restart does to the store: every connection is cut. Each stale pooled connection
/// costs at most one failed (Unavailable) operation, then the store works again by itself; the
/// listener reconnects, wakes its waiters (their notifications may have been lost), and hears
/// completions again.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_recovers_when_its_connections_are_cut() {
    let db = TestDb::create().await;
    let a = db.store().await;
    let b = db.store().await;
    let admin = db.pool().await;
    let probe = fresh_key();
    let probe_token = FencingToken::generate();
    a.claim(&claim_of(&probe, probe_token))
        .await
        .expect("claim");
    let mut probe_sub = b.subscribe(&probe);
    b.announce_waiter(&probe).await.expect("announce");
    a.complete(&probe, probe_token, &response("a"))
        .await
        .expect("complete");
    tokio::time::timeout(GENEROUS, probe_sub.changed())
        .await
        .expect("B's listener is up");

    let key = fresh_key();
    let token = FencingToken::generate();
    a.claim(&claim_of(&key, token)).await.expect("claim");
    let mut waiting = b.subscribe(&key);
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .execute(&admin)
    .await
    .expect("cut every other connection");

    // B's listener lost its connection: once it listens again it wakes its waiters to re-read.
    tokio::time::timeout(GENEROUS, waiting.changed())
        .await
        .expect("waiter woken when B's listener reconnects");

    // Stale connections fail once each at most (nothing was written by a failed attempt).
    let done = response("a");
    after_stale_connections(|| a.complete(&key, token, &done)).await;
    let record = after_stale_connections(|| b.get(&key)).await;
    assert!(matches!(
        record.expect("record").record.state,
        RecordState::Completed { .. }
    ));
    // And B's listener hears completions again.
    let key2 = fresh_key();
    let token2 = FencingToken::generate();
    a.claim(&claim_of(&key2, token2)).await.expect("claim");
    let mut sub2 = b.subscribe(&key2);
    after_stale_connections(|| b.announce_waiter(&key2)).await;
    a.complete(&key2, token2, &response("b"))
        .await
        .expect("complete");
    tokio::time::timeout(GENEROUS, sub2.changed())
        .await
        .expect("B woken by A's completion after the reconnect");
}

/// Runs `op` until it succeeds, allowing one Unavailable failure per stale pooled connection.
async fn after_stale_connections<T, F, Fut>(mut op: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, idem_runtime::StoreError>>,
{
    const POOL: usize = 5; // TestDb::store's max_connections
    let mut failures = 0;
    loop {
        match op().await {
            Ok(value) => return value,
            Err(e) => {
                assert_eq!(e.kind(), StoreErrorKind::Unavailable, "{e}");
                failures += 1;
                assert!(
                    failures <= POOL,
                    "still failing after {failures} attempts: {e}"
                );
            }
        }
    }
}

/// The server's clock, in milliseconds since the Unix epoch, as the store's statements read it.
async fn server_now(pool: &PgPool) -> Timestamp {
    let ms: i64 =
        sqlx::query_scalar("SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint")
            .fetch_one(pool)
            .await
            .expect("the server's clock");
    Timestamp::from_millis(ms)
}

/// Two instances on stores that judge by the server's clock (no `with_clock`: the path a service
/// runs), whose own clocks are a day ahead and a day behind: every instant comes from the server,
/// neither takes over the other's live claim, a lease the server sees ended is taken over whatever
/// either clock says, and a sweep from either deletes nothing retained.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_clock_decides_whatever_the_instances_clocks_say() {
    let db = TestDb::create().await;
    let (a, b) = (Arc::new(db.store().await), Arc::new(db.store().await));
    let day = Duration::from_secs(24 * 3600);
    let start = server_now(a.pool()).await;
    let ahead = Engine::from_arc(a.clone()).with_clock(ManualClock::new(start + day));
    let behind_at = Timestamp::from_millis(start.as_millis() - day.as_millis() as i64);
    let behind = Engine::from_arc(b.clone()).with_clock(ManualClock::new(behind_at));
    let policy = policy();

    // A live claim from the instance ahead: stamped by the server, held against the one behind.
    let key = fresh_key();
    let Ok(Begin::Execute(guard)) = ahead.begin(key.clone(), fp("a"), &policy).await else {
        panic!("a new key executes");
    };
    let found = b.get(&key).await.expect("get").expect("the record");
    let end = server_now(a.pool()).await;
    let record = &found.record;
    assert!(
        start <= record.created_at && record.created_at <= end,
        "{record:?} not within the server's [{start:?}, {end:?}]"
    );
    assert!(start <= found.now && found.now <= end, "{found:?}");
    assert_eq!(
        record.expires_at,
        record.created_at + Duration::from_secs(3600)
    );
    assert_eq!(guard.expires_at(), record.expires_at);
    let held = behind.begin(key.clone(), fp("a"), &policy).await;
    assert!(matches!(held, Err(Rejection::InFlight { .. })), "{held:?}");
    // Neither instance's sweep deletes it.
    for store in [&a, &b] {
        assert_eq!(store.purge_expired(100).await.expect("purge"), 0);
    }
    guard.complete(&response("a")).await.expect("complete");
    match behind.begin(key.clone(), fp("a"), &policy).await {
        Ok(Begin::Replay(replay)) => assert_eq!(replay.response, response("a")),
        other => panic!("the instance behind replays: {other:?}"),
    }

    // A lease the server sees ended (zero long) is taken over, by either instance.
    for (store, other) in [(&a, &b), (&b, &a)] {
        let key = fresh_key();
        let dead = Claim {
            lease: Duration::ZERO,
            ..claim_of(&key, FencingToken::generate())
        };
        assert!(matches!(
            store.claim(&dead).await.expect("claim"),
            ClaimOutcome::Claimed(_)
        ));
        let heir = claim_of(&key, FencingToken::generate());
        match other.claim(&heir).await.expect("claim") {
            ClaimOutcome::Claimed(claimed) => assert!(claimed.taken_over, "{claimed:?}"),
            other => panic!("the ended lease is taken over: {other:?}"),
        }
        // And the heir's live lease is held against the first.
        let again = claim_of(&key, FencingToken::generate());
        assert!(matches!(
            store.claim(&again).await.expect("claim"),
            ClaimOutcome::Existing(Found { .. })
        ));
    }
}

/// A row lock held by a transaction that stalled (it neither commits nor rolls back) never holds
/// the store's statements: a claim that must lock the record (here, to take over an ended lease),
/// a renewal, a completion and a release each fail as Unavailable after the lock timeout and change
/// nothing; the timeout never leaks into the pooled session; once the transaction ends, the claim
/// goes through.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_transactions_row_lock_fails_statements_as_unavailable() {
    let db = TestDb::create().await;
    // One connection, so that the session checked below is the one the statements ran on.
    let pool = PostgresStore::pool_options()
        .max_connections(1)
        .connect_with(db.options())
        .await
        .expect("connect");
    let store = PostgresStore::from_pool(pool)
        .await
        .expect("migrate")
        .with_lock_timeout(Duration::from_millis(100));
    let show = async || -> String {
        sqlx::query_scalar("SHOW lock_timeout")
            .fetch_one(store.pool())
            .await
            .expect("the session's lock timeout")
    };
    let configured = show().await;
    let key = fresh_key();
    let first = FencingToken::generate();
    let dead = Claim {
        lease: Duration::ZERO,
        ..claim_of(&key, first)
    };
    store.claim(&dead).await.expect("claim");

    let stalled_pool = db.pool().await;
    let mut stalled = stalled_pool.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM idem.records WHERE scope = $1 AND key = $2 FOR UPDATE")
        .bind(key.scope())
        .bind(key.key())
        .execute(&mut *stalled)
        .await
        .expect("lock the record");

    let heir = claim_of(&key, FencingToken::generate());
    let unavailable = |result: Result<(), idem_runtime::StoreError>, what: &str| {
        let error = result.expect_err(what);
        assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{what}: {error}");
    };
    let claim = tokio::time::timeout(GENEROUS, store.claim(&heir))
        .await
        .expect("the claim does not wait on the lock");
    unavailable(claim.map(drop), "claim");
    let renew = tokio::time::timeout(GENEROUS, store.renew(&key, first, Duration::ZERO))
        .await
        .expect("the renewal does not wait on the lock");
    unavailable(renew, "renew");
    let complete = tokio::time::timeout(GENEROUS, store.complete(&key, first, &response("a")))
        .await
        .expect("the completion does not wait on the lock");
    unavailable(complete, "complete");
    let release = tokio::time::timeout(GENEROUS, store.release(&key, first))
        .await
        .expect("the release does not wait on the lock");
    unavailable(release, "release");

    assert_eq!(
        show().await,
        configured,
        "the statements' timeout stays local to them"
    );
    let (token, state): (i64, String) =
        sqlx::query_as("SELECT token, state FROM idem.records WHERE scope = $1 AND key = $2")
            .bind(key.scope())
            .bind(key.key())
            .fetch_one(&stalled_pool)
            .await
            .expect("the record");
    assert_eq!(
        (token, state.as_str()),
        (first.0, "in_flight"),
        "nothing changed"
    );

    stalled.rollback().await.expect("rollback");
    match store.claim(&heir).await.expect("claim") {
        ClaimOutcome::Claimed(claimed) => assert!(claimed.taken_over),
        other => panic!("taken over once the lock is gone: {other:?}"),
    }
}

/// A database an earlier idem migrated (the migrations before released records and the server's
/// time), holding its records, upgrades in place when this idem starts: the records it held are
/// read, completed and released as before, and a release now keeps the record.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_of_an_earlier_version_upgrades_in_place() {
    const EARLIER: [&str; 3] = [
        "20261130000001_idem_records.sql",
        "20261201000000_idem_records_watched.sql",
        "20261202000000_idem_insert_claim.sql",
    ];
    let db = TestDb::create().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../idem-runtime/migrations/postgres");
    for file in EARLIER {
        std::fs::copy(source.join(file), dir.path().join(file)).expect("copy a migration");
    }
    // As the earlier idem ran them: in the `idem` schema, with their history there.
    let earlier = PostgresStore::pool_options()
        .max_connections(1)
        .connect_with(db.options().options([("search_path", "idem")]))
        .await
        .expect("connect");
    sqlx::query("CREATE SCHEMA idem")
        .execute(&earlier)
        .await
        .expect("schema");
    sqlx::migrate::Migrator::new(dir.path())
        .await
        .expect("the earlier migrator")
        .run(&earlier)
        .await
        .expect("the earlier migrations");
    // Two claims in flight, as the earlier idem wrote them (times on an instance's clock).
    let (done, undone) = (fresh_key(), fresh_key());
    for key in [&done, &undone] {
        sqlx::query(
            "INSERT INTO idem.records \
             (scope, key, fingerprint, token, created_at, expires_at, retain_until, state, lease_until) \
             VALUES ($1, $2, $3, 7, $4, $5, $6, 'in_flight', $7)",
        )
        .bind(key.scope())
        .bind(key.key())
        .bind(fp("a").0.as_slice())
        .bind(T0.as_millis())
        .bind((T0 + Duration::from_secs(3600)).as_millis())
        .bind((T0 + Duration::from_secs(4 * 3600)).as_millis())
        .bind((T0 + Duration::from_secs(30)).as_millis())
        .execute(&earlier)
        .await
        .expect("an earlier record");
    }
    earlier.close().await;

    let store = db.store().await.with_clock(ManualClock::new(T0));
    let versions: i64 = sqlx::query_scalar("SELECT count(*) FROM idem._sqlx_migrations")
        .fetch_one(store.pool())
        .await
        .expect("history");
    assert_eq!(versions, 4, "the earlier three and this one");
    store
        .complete(&done, FencingToken(7), &response("a"))
        .await
        .expect("an earlier claim completes");
    store
        .release(&undone, FencingToken(7))
        .await
        .expect("an earlier claim is released");
    let released = store.get(&undone).await.expect("get").expect("kept");
    assert_eq!(released.record.state, RecordState::Released);
    assert_eq!(released.record.created_at, T0);
    match store
        .claim(&claim_of(&undone, FencingToken::generate()))
        .await
        .expect("claim")
    {
        ClaimOutcome::Claimed(claimed) => {
            assert_eq!((claimed.created_at, claimed.taken_over), (T0, false));
        }
        other => panic!("the same request resumes its record: {other:?}"),
    }
    let stats = store.stats().await.expect("stats");
    assert_eq!((stats.in_flight, stats.completed), (1, 1), "{stats:?}");
}

/// The operator's deletions wake waiters on other instances too (through NOTIFY, for records a
/// waiter announced): a forgotten record's, and each of an erased scope's.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forget_and_erase_wake_waiters_on_another_instance() {
    use idem_runtime::store::StateKind;
    let db = TestDb::create().await;
    let (a, b) = (db.store().await, db.store().await);

    let forgotten = fresh_key();
    let token = FencingToken::generate();
    a.claim(&claim_of(&forgotten, token)).await.expect("claim");
    let mut waiting = b.subscribe(&forgotten);
    b.announce_waiter(&forgotten).await.expect("announce");
    assert!(a
        .forget(&forgotten, token, StateKind::InFlight)
        .await
        .expect("forget"));
    tokio::time::timeout(GENEROUS, waiting.changed())
        .await
        .expect("B's waiter woken by A's forget");

    let scope = format!("erased-{}", uuid::Uuid::new_v4());
    let keys: Vec<idem_runtime::RecordKey> = (0..3)
        .map(|i| idem_runtime::RecordKey::new(scope.clone(), format!("k{i}")))
        .collect();
    let mut subscriptions = Vec::new();
    for key in &keys {
        a.claim(&claim_of(key, FencingToken::generate()))
            .await
            .expect("claim");
        subscriptions.push(b.subscribe(key));
        b.announce_waiter(key).await.expect("announce");
    }
    assert_eq!(a.erase_scope(&scope, 2).await.expect("erase"), 2);
    assert_eq!(a.erase_scope(&scope, 2).await.expect("erase"), 1);
    for mut subscription in subscriptions {
        tokio::time::timeout(GENEROUS, subscription.changed())
            .await
            .expect("B's waiter woken by A's erase");
    }
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idem.records WHERE scope = $1")
        .bind(&scope)
        .fetch_one(a.pool())
        .await
        .expect("count");
    assert_eq!(left, 0);
}
