//! Transactional mode on PostgreSQL: the ledger and idem's records in one database (a fresh one per
//! test, see `idem_tests::services::TestDb`). The cases are in `transactional_support`.

mod transactional_support;

use axum::Router;
use idem_runtime::clock::{Clock, ManualClock, Timestamp};
use idem_runtime::sqlx::{self, postgres::PgPool};
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::transaction::TxBegin;
use idem_runtime::{Engine, Fingerprint, Policy, Record, RecordKey, Store, Transactional};
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
    txn: Transactional<PostgresStore>,
    router: Router,
    // Dropped last: the pools above close first.
    _db: TestDb,
}

async fn setup() -> Postgres {
    // 16 concurrent requests.
    setup_with(PostgresStore::pool_options().max_connections(24)).await
}

/// The app on a pool made with `options`.
async fn setup_with(options: sqlx::postgres::PgPoolOptions) -> Postgres {
    let db = TestDb::create().await;
    let pool = options.connect_with(db.options()).await.expect("connect");
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
        txn: txn.clone(),
        controls: controls.clone(),
    });
    Postgres {
        store,
        checks,
        engine,
        clock,
        controls,
        txn,
        router,
        _db: db,
    }
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
    fn waiting_for_turns(&self) -> usize {
        self.txn.waiting_for_turns()
    }
}

/// The original answers 201 as new, and every duplicate replays that answer.
async fn the_original_then_replays(
    original: tokio::task::JoinHandle<Reply>,
    mut duplicates: tokio::task::JoinSet<Reply>,
) {
    let original = original.await.expect("original");
    assert_eq!(original.status, 201, "{original:?}");
    assert!(!original.replayed(), "{original:?}");
    while let Some(reply) = duplicates.join_next().await {
        let reply = reply.expect("duplicate");
        assert_eq!(reply.status, 201, "{reply:?}");
        assert!(reply.replayed(), "{reply:?}");
        assert_eq!(reply.json(), original.json());
    }
}

impl Postgres {
    /// A second instance of the app on the same database, as another process would run it: a
    /// store and pool of its own (so turns of its own), the same clock and controls.
    async fn another_instance(&self) -> (Transactional<PostgresStore>, Router) {
        let pool = PostgresStore::pool_options()
            .max_connections(8)
            .connect_with(self._db.options())
            .await
            .expect("second pool");
        let store = Arc::new(PostgresStore::from_pool(pool).await.expect("migrated"));
        let engine = Engine::from_arc(store.clone()).with_clock(self.clock.clone());
        let txn = Transactional::new(engine, store).expect("same store");
        let router = router(App {
            txn: txn.clone(),
            controls: self.controls.clone(),
        });
        (txn, router)
    }

    /// Returns once `n` transactions of this database are blocked on a lock. PostgreSQL announces
    /// no lock waits, so this polls pg_locks; the bound only turns a hang into a failure.
    async fn until_blocked(&self, n: usize) {
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
        #[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
        #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
        async fn $name() {
            let backend = setup().await;
            transactional_support::$name(&backend).await;
        }
    )*};
}

cases!(
    write_and_record_commit_together,
    a_server_error_leaves_neither_row_nor_record,
    a_panic_leaves_neither_row_nor_record,
    sixteen_identical_requests_write_once,
    a_duplicate_runs_once_the_original_rolls_back,
    a_duplicate_blocked_past_the_wait_gets_409,
    mismatch_and_expired_still_work,
    a_replay_opens_no_write,
    a_passed_request_still_gets_a_transaction,
);

/// The claim waits under idem's `lock_timeout` (the policy's `wait`), but the handler's statements run
/// under the session's own: a fresh claim restores it in the message that opens the transaction (its
/// `INSERT`'s `RETURNING`), a takeover of a dead non-transactional claim with a statement of its own.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_runs_under_the_sessions_lock_timeout() {
    use idem_runtime::engine::Begin;

    let db = TestDb::create().await;
    let pool = PostgresStore::pool_options()
        .max_connections(2)
        .connect_with(db.options().options([("lock_timeout", "7s")]))
        .await
        .expect("connect");
    let store = Arc::new(PostgresStore::from_pool(pool).await.expect("migrate"));
    let clock = ManualClock::new(Timestamp::from_millis(START_MS));
    let engine = Engine::from_arc(store.clone()).with_clock(clock.clone());
    let txn = Transactional::new(engine.clone(), store).expect("same store");
    let policy = Policy::new()
        .lease(Duration::from_secs(30))
        .wait(Duration::from_secs(2))
        .handler("lock-timeout");
    let fp = Fingerprint::of_request("POST", "/t", None, b"");
    async fn shown(claim: &mut idem_runtime::transaction::TxClaim<PostgresStore>) -> String {
        let conn: &mut sqlx::PgConnection = claim.tx();
        sqlx::query_scalar("SHOW lock_timeout")
            .fetch_one(conn)
            .await
            .expect("show")
    }

    // A fresh key: restored by the opening message's INSERT.
    let fresh = RecordKey::new("u", "fresh");
    let Ok(TxBegin::Execute(mut claim)) = txn.begin(fresh, fp, &policy).await else {
        panic!("a fresh key executes");
    };
    assert_eq!(shown(&mut claim).await, "7s");
    claim.rollback().await.expect("rollback");

    // A takeover: a non-transactional claim whose lease ran out.
    let dead = RecordKey::new("u", "dead");
    let Ok(Begin::Execute(orphan)) = engine.begin(dead.clone(), fp, &policy).await else {
        panic!("the first claim executes");
    };
    std::mem::forget(orphan); // its worker died: no release
    clock.advance(Duration::from_secs(31));
    let Ok(TxBegin::Execute(mut claim)) = txn.begin(dead, fp, &policy).await else {
        panic!("the dead claim is taken over");
    };
    assert!(claim.taken_over());
    assert_eq!(shown(&mut claim).await, "7s");
    claim.rollback().await.expect("rollback");
}

/// Twenty duplicates of a held request wait for its transaction without a connection of their own:
/// on a pool of three, a request on another key still gets one and answers as new, and once the
/// original commits every duplicate replays it. (Blocked on the key's unique index instead, two of
/// them held the pool's other connections and the other key's request failed with 503 when its
/// acquire timed out.)
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_storm_leaves_the_pool_to_other_keys() {
    let options = PostgresStore::pool_options()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(2));
    let b = setup_with(options).await;
    let router = b.router();
    let body = serde_json::json!({"amount": 5, "hold": true});
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..21 {
        tasks.spawn(sent(
            &router,
            post("/entries", "gail", "storm", body.clone()),
        ));
    }
    b.controls().until_entered(1).await;
    until_waiting(&b, 20).await;

    let other = send(
        &router,
        post("/entries", "gail", "calm", serde_json::json!({"amount": 6})),
    )
    .await;
    assert_eq!(other.status, 201, "{other:?}");
    assert!(!other.replayed());
    assert_eq!(b.waiting_for_turns(), 20, "the duplicates still wait");

    // A permit for every request: if a duplicate ever ran, it would not hang, and the rows would
    // show it.
    b.controls().release.add_permits(21);
    let mut replies = Vec::new();
    while let Some(reply) = tasks.join_next().await {
        replies.push(reply.expect("request task"));
    }
    assert_eq!(
        b.ledger_rows().await,
        2,
        "the storm's row and the other key's"
    );
    let id = replies[0].json()["id"].clone();
    for reply in &replies {
        assert_eq!(reply.status, 201, "{reply:?}");
        assert_eq!(reply.json()["id"], id);
    }
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
    let metrics = b.engine().metrics();
    assert_eq!(metrics.get(idem_runtime::metrics::Outcome::Waited), 20);
}

/// Turns are per process: duplicates sent to a second instance (its own store and pool on the same
/// database) do not see the first instance's turn. One of them opens a transaction and blocks on
/// the key's unique index, the others wait for that one's turn; at the commit all of them replay.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_on_another_instance_wait_on_the_unique_index() {
    let a = setup().await;
    let (other_txn, other_instance) = a.another_instance().await;

    let body = serde_json::json!({"amount": 8, "hold": true});
    let original = tokio::spawn(sent(
        &a.router(),
        post("/entries", "hank", "twice", body.clone()),
    ));
    a.controls().until_entered(1).await;
    let mut duplicates = tokio::task::JoinSet::new();
    for _ in 0..4 {
        duplicates.spawn(sent(
            &other_instance,
            post("/entries", "hank", "twice", body.clone()),
        ));
    }
    a.until_blocked(1).await;
    // Three wait for the one that blocks.
    until_counted(|| other_txn.waiting_for_turns(), 3).await;
    assert_eq!(
        a.waiting_for_turns(),
        0,
        "the first instance has no duplicate"
    );

    a.controls().release.add_permits(5);
    the_original_then_replays(original, duplicates).await;
    assert_eq!(a.ledger_rows().await, 1);
}

/// A duplicate from another instance blocks on the key's unique index under idem's `lock_timeout`:
/// with `wait = "0s"` the lock wait fails at once (55P03) and the duplicate gets 409 +
/// `Retry-After`, counted as a conflict; the original still commits and the next retry replays.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_on_another_instance_blocked_past_the_wait_gets_409() {
    let a = setup().await;
    let (other_txn, other_instance) = a.another_instance().await;
    let body = serde_json::json!({"amount": 9, "hold": true});
    let original = tokio::spawn(sent(&a.router(), post("/quick", "ivan", "q", body.clone())));
    a.controls().until_entered(1).await;
    let blocked = tokio::time::timeout(
        Duration::from_secs(30),
        send(&other_instance, post("/quick", "ivan", "q", body.clone())),
    )
    .await
    .expect("the duplicate answers at the end of its wait");
    assert_eq!(blocked.status, 409, "{blocked:?}");
    assert_eq!(
        blocked.headers.get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    let conflicts = other_txn.engine().metrics();
    assert_eq!(conflicts.get(idem_runtime::metrics::Outcome::Conflict), 1);
    assert_eq!(
        other_txn.waiting_for_turns(),
        0,
        "it was blocked on the index, not on a turn"
    );
    a.controls().release.add_permits(1);
    let original = original.await.expect("original");
    assert_eq!(original.status, 201, "{original:?}");
    let retry = send(&other_instance, post("/quick", "ivan", "q", body)).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(a.ledger_rows().await, 1);
}

/// The turn is released only once the transaction has committed: with the original's `COMMIT` held
/// up (a deferred trigger on the ledger waits for an advisory lock the test holds), duplicates sent
/// meanwhile find the turn still taken and wait for it, rather than opening transactions of their
/// own to block on the key's index, and replay once the commit goes through.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_turn_outlasts_the_commit() {
    let b = setup().await;
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
    let body = serde_json::json!({"amount": 12});
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
    until_waiting(&b, 5).await;

    sqlx::query("SELECT pg_advisory_unlock(4242)")
        .execute(&mut *gate)
        .await
        .expect("open the gate");
    the_original_then_replays(original, duplicates).await;
    assert_eq!(b.ledger_rows().await, 1);
}

/// Turns belong to the store: a second `Transactional` built on the same store object (another
/// router's state, say) shares them, so its duplicate waits for the turn, not on the index.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_transactional_on_one_store_shares_its_turns() {
    let b = setup().await;
    let second = Transactional::new(
        Engine::from_arc(b.store.clone()).with_clock(b.clock.clone()),
        b.store.clone(),
    )
    .expect("same store");
    let second_router = router(App {
        txn: second,
        controls: b.controls.clone(),
    });
    let body = serde_json::json!({"amount": 3, "hold": true});
    let original = tokio::spawn(sent(
        &b.router(),
        post("/entries", "kate", "shared", body.clone()),
    ));
    b.controls().until_entered(1).await;
    let duplicate = tokio::spawn(sent(
        &second_router,
        post("/entries", "kate", "shared", body.clone()),
    ));
    until_waiting(&b, 1).await;
    b.controls().release.add_permits(2);
    let original = original.await.expect("original");
    let duplicate = duplicate.await.expect("duplicate");
    assert_eq!(original.status, 201, "{original:?}");
    assert!(duplicate.replayed(), "{duplicate:?}");
    assert_eq!(duplicate.json(), original.json());
}

/// A pool of `connections` on a fresh database, the store on it and a `Transactional` on the
/// manual clock, for the tests that drive claims by hand.
async fn by_hand(
    db: &TestDb,
    connections: u32,
) -> (Arc<PostgresStore>, Transactional<PostgresStore>, PgPool) {
    by_hand_with(db, db.options(), connections).await
}

/// [`by_hand`], the app's pool connecting with `app` (the tests' own reads still with the
/// database's plain options).
async fn by_hand_with(
    db: &TestDb,
    app: sqlx::postgres::PgConnectOptions,
    connections: u32,
) -> (Arc<PostgresStore>, Transactional<PostgresStore>, PgPool) {
    let pool = PostgresStore::pool_options()
        .max_connections(connections)
        .connect_with(app)
        .await
        .expect("connect");
    let store = Arc::new(PostgresStore::from_pool(pool).await.expect("migrate"));
    let clock = ManualClock::new(Timestamp::from_millis(START_MS));
    let engine = Engine::from_arc(store.clone()).with_clock(clock);
    let txn = Transactional::new(engine, store.clone()).expect("same store");
    let checks = PgPool::connect_with(db.options()).await.expect("checks");
    (store, txn, checks)
}

/// The state and last message of the one client connection of this database that holds a
/// transaction id (a claim's, which has written).
async fn claiming_connection(checks: &PgPool) -> (String, String) {
    sqlx::query_as(
        "SELECT state, query FROM pg_stat_activity
         WHERE datname = current_database() AND backend_type = 'client backend'
           AND backend_xid IS NOT NULL",
    )
    .fetch_one(checks)
    .await
    .expect("the claim's connection")
}

/// Whether `query` is the message that opens a transaction with a fresh claim in it.
fn is_opening_message(query: &str) -> bool {
    query.contains("INSERT INTO idem.records") && query.trim_end().ends_with("BEGIN")
}

/// A fresh key's claim is made by the message that opens the transaction: before the handler sends
/// anything, the claim's connection is idle in a transaction whose one message inserted the
/// in-flight record and ended with the `BEGIN`, and the record is visible inside it only.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_claim_rides_in_the_message_that_opens_the_transaction() {
    let db = TestDb::create().await;
    let (_store, txn, checks) = by_hand(&db, 2).await;
    let fp = Fingerprint::of_request("POST", "/t", None, b"");
    let key = RecordKey::new("lena", "one-message");
    let Ok(TxBegin::Execute(mut claim)) = txn.begin(key, fp, &Policy::new()).await else {
        panic!("a fresh key executes");
    };
    let (state, query) = claiming_connection(&checks).await;
    assert_eq!(state, "idle in transaction");
    assert!(is_opening_message(&query), "{query}");

    let count = "SELECT count(*) FROM idem.records WHERE scope = 'lena' AND key = 'one-message'";
    let inside: i64 = sqlx::query_scalar(count)
        .fetch_one(&mut **claim.tx())
        .await
        .expect("inside");
    let outside: i64 = sqlx::query_scalar(count)
        .fetch_one(&checks)
        .await
        .expect("outside");
    assert_eq!((inside, outside), (1, 0));
    claim.rollback().await.expect("rollback");
}

/// The claim's values are written into that message's text: a scope and key made of quotes,
/// backslashes, semicolons, dollar quotes and non-ASCII characters are stored exactly as given and
/// run nothing.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_reach_the_opening_message_as_data_only() {
    use idem_runtime::StoredResponse;

    let db = TestDb::create().await;
    let (_store, txn, checks) = by_hand(&db, 2).await;
    let fp = Fingerprint::of_request("POST", "/t", None, b"");
    let scope = "o'brien\\'; $$";
    let key = "'); DROP TABLE idem.records; -- ключ 🔑 $q$";
    let Ok(TxBegin::Execute(claim)) = txn
        .begin(RecordKey::new(scope, key), fp, &Policy::new())
        .await
    else {
        panic!("a fresh key executes");
    };
    let (_, query) = claiming_connection(&checks).await;
    assert!(
        is_opening_message(&query),
        "claimed by the opening message: {query}"
    );
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: "made".into(),
    };
    claim.complete(&response).await.expect("commit");
    let stored: Vec<(String, String)> = sqlx::query_as("SELECT scope, key FROM idem.records")
        .fetch_all(&checks)
        .await
        .expect("records");
    assert_eq!(stored, vec![(scope.to_owned(), key.to_owned())]);
    match txn
        .begin(RecordKey::new(scope, key), fp, &Policy::new())
        .await
    {
        Ok(TxBegin::Replay(replay)) => assert_eq!(replay.response.body, "made"),
        _ => panic!("the stored key replays"),
    }
}

/// A record the look-up cannot see (past retention, not yet purged) makes the opening message's
/// insert fail; that message's implicit transaction then rolls back by itself, so on a pool of one
/// connection the claim that follows (which replaces the old record) gets a clean connection, and
/// the handler runs.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_opening_message_leaves_its_connection_clean() {
    let db = TestDb::create().await;
    let (store, txn, checks) = by_hand(&db, 1).await;
    sqlx::query(
        "INSERT INTO idem.records (scope, key, fingerprint, token, created_at, expires_at,
                                   retain_until, state, lease_until, status, headers, body)
         VALUES ('mia', 'old', decode(repeat('00', 32), 'hex'), 1, $1, $1, $1, 'completed', NULL, 200,
                 '[]', '')",
    )
    .bind(START_MS - 1)
    .execute(&checks)
    .await
    .expect("a record past retention");
    let now = Timestamp::from_millis(START_MS);
    let key = RecordKey::new("mia", "old");
    assert!(store.get(&key, now).await.expect("get").is_none());

    let fp = Fingerprint::of_request("POST", "/t", None, b"");
    let begun = txn.begin(key, fp, &Policy::new()).await;
    let Ok(TxBegin::Execute(mut claim)) = begun else {
        panic!("the forgotten key is claimed anew: {begun:?}");
    };
    assert!(!claim.taken_over());
    let (_, query) = claiming_connection(&checks).await;
    assert!(
        !is_opening_message(&query),
        "claimed after the opening message failed: {query}"
    );
    let in_tx: bool = sqlx::query_scalar("SELECT txid_current_if_assigned() IS NOT NULL")
        .fetch_one(&mut **claim.tx())
        .await
        .expect("the pool's one connection answers");
    assert!(in_tx, "the replacement wrote in the claim's transaction");
    claim.rollback().await.expect("rollback");
}

/// A claim whose request goes away while its opening message waits behind another instance's
/// uncommitted claim of the key still ends cleanly: when that message completes on the server, its
/// transaction is rolled back, and the pool's one connection goes back idle, not inside it (sqlx
/// queues no rollback for a `BEGIN` dropped before it answered).
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_claim_leaves_no_transaction_in_the_pool() {
    let db = TestDb::create().await;
    let app = "idem-cancelled";
    let (_store, txn, checks) = by_hand_with(&db, db.options().application_name(app), 1).await;

    let mut other = checks.begin().await.expect("begin");
    sqlx::query(
        "INSERT INTO idem.records (scope, key, fingerprint, token, created_at, expires_at,
                                   retain_until, state, lease_until)
         VALUES ('nia', 'gone', decode(repeat('00', 32), 'hex'), 1, $1, $2, $2, 'in_flight', $2)",
    )
    .bind(START_MS)
    .bind(START_MS + 86_400_000)
    .execute(&mut *other)
    .await
    .expect("another instance's claim, uncommitted");
    let fp = Fingerprint::of_request("POST", "/t", None, b"");
    // The store and its pool outlive the request, as a server's do (dropped, the pool would close
    // its connection, and the server end the transaction with it).
    let request = tokio::spawn({
        let txn = txn.clone();
        async move {
            let policy = Policy::new().wait(Duration::from_secs(30));
            let begun = txn.begin(RecordKey::new("nia", "gone"), fp, &policy).await;
            begun.is_ok()
        }
    });
    let count = |sql: &'static str| {
        let checks = checks.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .bind(app)
                .fetch_one(&checks)
                .await
                .expect("pg_stat_activity")
        }
    };
    let blocked = "SELECT count(*) FROM pg_stat_activity
                   WHERE application_name = $1 AND wait_event_type = 'Lock'";
    tokio::time::timeout(Duration::from_secs(60), async {
        while count(blocked).await < 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the opening message waits on the key");
    request.abort();
    assert!(request.await.is_err(), "the request was cancelled");
    other.rollback().await.expect("rollback");

    let busy = "SELECT count(*) FILTER (WHERE state <> 'idle') FROM pg_stat_activity
                WHERE application_name = $1";
    let settled = tokio::time::timeout(Duration::from_secs(10), async {
        while count(busy).await > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(
        settled.is_ok(),
        "the pool's connection stayed in the cancelled claim's transaction"
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idem.records")
        .fetch_one(&checks)
        .await
        .expect("records");
    assert_eq!(rows, 0);
}
