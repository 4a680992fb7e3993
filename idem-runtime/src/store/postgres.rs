//! The PostgreSQL store: one database shared by every instance of a service.
//!
//! ```no_run
//! use idem_runtime::store::postgres::PostgresStore;
//! use idem_runtime::{sweeper::Sweeper, Engine};
//! use std::sync::Arc;
//! # async fn run() -> Result<(), idem_runtime::StoreError> {
//! // Creates the `idem` schema and its table if needed, and starts the LISTEN task.
//! let store = Arc::new(PostgresStore::connect("postgres://app@db.internal/app").await?);
//! let engine = Engine::from_arc(store.clone());
//! tokio::spawn(Sweeper::new(store).run());
//! # let _ = engine;
//! # Ok(())
//! # }
//! ```
//!
//! # Schema and migrations
//!
//! Records live in `idem.records` (primary key `(scope, key)`, times as BIGINT milliseconds, an
//! index on `retain_until`). The embedded migrations (`migrations/postgres/`) run at start-up with
//! `search_path = idem`, so their history stays apart from the application's own
//! `_sqlx_migrations`. Creating the schema needs the `CREATE` privilege the first time. Migrations
//! only add, and an instance ignores versions it does not know, so two versions can share the
//! database during a rolling deploy.
//!
//! # Statements
//!
//! - **Claim**: one round trip, new key or replay: a primary-key read, `UNION ALL` a call of
//!   `idem.insert_claim` that PostgreSQL runs only when the read found nothing (`INSERT … ON CONFLICT
//!   DO NOTHING`, returning the concurrent winner's record if there was one). A replay is a plain
//!   read that writes nothing. A takeover, or the replacement of a record past retention, is a
//!   second, conditional `UPDATE` that re-checks the token it read. The statements assume READ
//!   COMMITTED.
//! - **Complete**, **release**, **renew**: one statement each, fenced by the token and the
//!   in-flight state. Completion and release call `pg_notify` in the same statement only if a
//!   duplicate announced itself (the `watched` flag): a notifying commit takes a database-wide lock,
//!   which would otherwise serialise every completion.
//! - **Purge**: one `DELETE` of at most a batch of rows past retention, skipping locked rows.
//!
//! # Waking waiters across instances
//!
//! Completions and releases of awaited records notify the channel [`CHANNEL`] with `[scope, key]`
//! as JSON. Each store keeps one [`PgListener`] on a connection of its own and wakes that key's
//! local waiters; after it (re)connects, it wakes every local waiter to re-read its record. While it
//! cannot connect, waiters still wake at the lease's end or their deadline.
//!
//! # Outages
//!
//! A database error is [`Unavailable`](super::StoreErrorKind::Unavailable) (503); a pool whose
//! connections are all in use is [`Busy`](super::StoreErrorKind::Busy) (503 `busy`); an
//! undecodable row is [`Corrupt`](super::StoreErrorKind::Corrupt). Pools from
//! [`PostgresStore::pool_options`] give up acquiring after [`DEFAULT_ACQUIRE_TIMEOUT`], and the store
//! resumes by itself when the server returns.

use super::tx::{OpenTx, TransactionalStore, Tx, TxHandle};
use super::{Claim, ClaimOutcome, Found, Purge, Stamped, Store, StoreError, Subscription, Waiters};
use crate::clock::{Clock, SystemClock, Timestamp};
use crate::fingerprint::Fingerprint;
use crate::record::{FencingToken, Record, RecordKey, RecordState, StoredResponse};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnection, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::Row;
use std::sync::Arc;
use std::time::Duration;

/// The `LISTEN`/`NOTIFY` channel on which completions and releases are announced.
pub const CHANNEL: &str = "idem_records";

/// How long [`PostgresStore::pool_options`] pools wait for a connection before failing.
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// The embedded migrations (`migrations/postgres/`), run with `search_path = idem`. Versions applied
/// by a later idem are ignored (see the [module documentation](self)).
pub(crate) fn migrator() -> Migrator {
    super::migrations::migrator(&[
        (
            20261130000001,
            "idem records",
            include_str!("../../migrations/postgres/20261130000001_idem_records.sql"),
        ),
        (
            20261201000000,
            "idem records watched",
            include_str!("../../migrations/postgres/20261201000000_idem_records_watched.sql"),
        ),
        (
            20261202000000,
            "idem insert claim",
            include_str!("../../migrations/postgres/20261202000000_idem_insert_claim.sql"),
        ),
    ])
}

/// How often a claim re-runs its statement when concurrent changes keep it from settling. Each retry
/// means another request changed the key in between, so a few suffice; the bound only guards against
/// a pathological loop.
const MAX_CLAIM_ATTEMPTS: usize = 16;

/// Serialises schema creation between processes starting at once (an arbitrary constant).
const SCHEMA_LOCK: i64 = 0x6964_656d_5f73_6368; // "idem_sch"

const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The claim's statement and binds, for the project's own tests and benchmarks (which inspect its
/// plan and time it alone). Not a stable API.
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing {
    use super::Claim;
    use crate::clock::Timestamp;

    /// Claim-or-fetch: the existing record, or the fresh one inserted when there is none.
    pub const CLAIM_STATEMENT: &str = super::CLAIM;

    /// `sql` (the claim statement, or a statement around it such as an `EXPLAIN`) with the eight
    /// binds of `claim` at `now`.
    pub fn bind_claim<'q>(
        sql: &'q str,
        claim: &Claim<'q>,
        now: Timestamp,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        super::bind_claim(sql, claim.stamped(now))
    }
}

/// Claim-or-fetch: the existing record, or the fresh one inserted when there is none.
const CLAIM: &str = "
(SELECT false AS inserted, fingerprint, token, created_at, expires_at, retain_until, state,
        lease_until, status, headers, body
 FROM idem.records
 WHERE scope = $1 AND key = $2)
UNION ALL
(SELECT * FROM idem.insert_claim($1, $2, $3, $4, $5, $6, $7, $8))
LIMIT 1";

/// `sql` (the claim statement, the replacement of a forgotten record, or a statement around one of
/// them, such as an `EXPLAIN`) with a claim's eight binds, in the order those statements number
/// them (`$1` to `$8`; the replacement adds the token it saw as `$9`).
pub(crate) fn bind_claim<'q>(
    sql: &'q str,
    claim: Stamped<'q>,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(claim.key.scope())
        .bind(claim.key.key())
        .bind(claim.fingerprint.0.to_vec())
        .bind(claim.token.0)
        .bind(claim.now.as_millis())
        .bind(claim.expires_at.as_millis())
        .bind(claim.retain_until.as_millis())
        .bind(claim.lease_until.as_millis())
}

/// Replaces a record past retention, if it is still the one seen (`$9`) and still past retention.
const REPLACE_FORGOTTEN: &str = "
UPDATE idem.records
SET fingerprint = $3, token = $4, created_at = $5, expires_at = $6, retain_until = $7,
    state = 'in_flight', lease_until = $8, status = NULL, headers = NULL, body = NULL
WHERE scope = $1 AND key = $2 AND token = $9 AND retain_until <= $5";

/// `Claim::can_take_over` in SQL, re-checked on the row's latest version, plus the token seen (`$5`).
const TAKE_OVER: &str = "
UPDATE idem.records
SET token = $3, lease_until = $4
WHERE scope = $1 AND key = $2 AND token = $5 AND state = 'in_flight'
  AND lease_until <= $6 AND fingerprint = $7 AND $6 < expires_at AND $6 < retain_until";

const COMPLETE: &str = "
WITH completed AS (
    UPDATE idem.records
    SET state = 'completed', lease_until = NULL, status = $4, headers = $5, body = $6
    WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_flight'
    RETURNING watched
)
SELECT CASE WHEN watched THEN pg_notify('idem_records', $7) END FROM completed";

const RELEASE: &str = "
WITH released AS (
    DELETE FROM idem.records
    WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_flight'
    RETURNING watched
)
SELECT CASE WHEN watched THEN pg_notify('idem_records', $4) END FROM released";

const RENEW: &str = "
UPDATE idem.records SET lease_until = $4
WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_flight'";

/// Marks an in-flight record as awaited. Only the first waiter writes (and commits a change); later
/// ones find the flag set and write nothing. The row lock orders this against the completing `UPDATE`,
/// which reads the row's latest version: either it sees the flag and notifies, or it committed first
/// and the waiter's next read sees the completion.
const ANNOUNCE: &str = "
UPDATE idem.records SET watched = true
WHERE scope = $1 AND key = $2 AND state = 'in_flight' AND NOT watched";

const GET: &str = "
SELECT fingerprint, token, created_at, expires_at, retain_until, state,
       lease_until, status, headers, body
FROM idem.records
WHERE scope = $1 AND key = $2 AND retain_until > $3";

/// The rows are picked oldest first through the `retain_until` index and locked by the same statement
/// (skipping rows a claim holds), so their `ctid`s stay valid for the delete: a TID scan whatever the
/// backlog, where a join back on the key may scan every expired row for each batch.
const PURGE: &str = "
DELETE FROM idem.records
WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM idem.records
    WHERE retain_until <= $1
    ORDER BY retain_until
    LIMIT $2
    FOR UPDATE SKIP LOCKED
))
AND retain_until <= $1";

/// A [`Store`] in PostgreSQL, shared by every instance of a service. See the
/// [module documentation](self) for its statements and guarantees.
///
/// ```no_run
/// use idem_runtime::store::postgres::PostgresStore;
/// use idem_runtime::Engine;
/// # async fn run() -> Result<(), idem_runtime::StoreError> {
/// let store = PostgresStore::connect("postgres://app@db.internal/app").await?;
/// let engine = Engine::new(store);
/// # let _ = engine;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct PostgresStore {
    pool: PgPool,
    waiters: Arc<Waiters>,
    clock: Arc<dyn Clock>,
    _listener: ListenerTask,
}

/// Stops the listener task when the store is dropped.
#[derive(Debug)]
struct ListenerTask(tokio::task::JoinHandle<()>);

impl Drop for ListenerTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl PostgresStore {
    /// Connects to `url` with [`pool_options`](Self::pool_options), then does what
    /// [`from_pool`](Self::from_pool) does: migrations, and the listener for other instances'
    /// completions.
    ///
    /// ```no_run
    /// # use idem_runtime::store::postgres::PostgresStore;
    /// # async fn run() -> Result<(), idem_runtime::StoreError> {
    /// let store = PostgresStore::connect("postgres://app@127.0.0.1:5432/app").await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = Self::pool_options().connect(url).await?;
        Self::from_pool(pool).await
    }

    /// The pool settings [`connect`](Self::connect) uses: sqlx's defaults, except that
    ///
    /// - acquiring a connection fails after [`DEFAULT_ACQUIRE_TIMEOUT`], so that an outage answers
    ///   promptly (503) instead of holding requests;
    /// - an idle connection is not pinged before each use (`test_before_acquire(false)`), so that a
    ///   claim or a replay is one round trip, not two. sqlx already pings every connection when it
    ///   returns to the pool; a connection that died while idle (a server restart) fails its next
    ///   statement with [`Unavailable`](super::StoreErrorKind::Unavailable) and is discarded, so
    ///   after a restart up to one request per idle connection gets a 503 and a `Retry-After`.
    ///   Set `test_before_acquire(true)` to trade that for a ping on every operation.
    ///
    /// Start from these to tune the pool, then use [`from_pool`](Self::from_pool).
    ///
    /// ```no_run
    /// # use idem_runtime::store::postgres::PostgresStore;
    /// # use std::time::Duration;
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = PostgresStore::pool_options()
    ///     .max_connections(32)
    ///     .acquire_timeout(Duration::from_secs(2))
    ///     .connect("postgres://app@127.0.0.1:5432/app")
    ///     .await?;
    /// let store = PostgresStore::from_pool(pool).await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn pool_options() -> PgPoolOptions {
        PgPoolOptions::new()
            .acquire_timeout(DEFAULT_ACQUIRE_TIMEOUT)
            .test_before_acquire(false)
    }

    /// A store on an existing pool (for instance the application's own): runs the migrations, starts
    /// listening for other instances' completions, and returns once the listener listens (or, if it
    /// cannot yet, after the pool's acquire timeout, leaving it to retry in the background).
    ///
    /// ```no_run
    /// # use idem_runtime::store::postgres::PostgresStore;
    /// # async fn run(pool: idem_runtime::sqlx::PgPool) -> Result<(), idem_runtime::StoreError> {
    /// let store = PostgresStore::from_pool(pool.clone()).await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn from_pool(pool: PgPool) -> Result<Self, StoreError> {
        Self::migrate(&pool).await?;
        let wait = pool.options().get_acquire_timeout();
        let (store, listening) = Self::start(pool);
        // Return once the listener listens, so that no waiter can subscribe before it does (and the
        // listener need not wake everyone when it starts). If it cannot within the acquire timeout,
        // the store still works: the task keeps trying and wakes every waiter once it listens.
        if tokio::time::timeout(wait, listening).await.is_err() {
            tracing::warn!(
                target: "idem",
                "idempotency store listener not ready yet; waiters wake at lease end until it is"
            );
        }
        Ok(store)
    }

    /// A store on `pool` without running the migrations (when they run separately, through
    /// [`migrate`](Self::migrate)). Returns at once: it sends nothing to the server itself, so this
    /// never fails, and with a lazy pool an unreachable server shows up as
    /// [`Unavailable`](super::StoreErrorKind::Unavailable) errors from the operations. The listener
    /// connects in the background and, once it listens, wakes any waiter that subscribed before.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime, as it spawns the listener task.
    ///
    /// ```no_run
    /// # use idem_runtime::store::postgres::PostgresStore;
    /// # async fn run(pool: idem_runtime::sqlx::PgPool) -> Result<(), idem_runtime::StoreError> {
    /// PostgresStore::migrate(&pool).await?;
    /// let store = PostgresStore::from_pool_unmigrated(pool);
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn from_pool_unmigrated(pool: PgPool) -> Self {
        Self::start(pool).0
    }

    /// The store, and a receiver that resolves once the listener first listens. Dropping the receiver
    /// before then tells the listener that waiters may already exist.
    fn start(pool: PgPool) -> (Self, tokio::sync::oneshot::Receiver<()>) {
        let (listening, ready) = tokio::sync::oneshot::channel();
        let waiters = Arc::new(Waiters::new());
        // The listener holds its connection for good: give it a pool of its own (same server and
        // credentials) rather than taking one from the application's pool.
        let listener_pool = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .max_lifetime(None)
            .idle_timeout(None)
            .acquire_timeout(pool.options().get_acquire_timeout())
            .connect_lazy_with((*pool.connect_options()).clone());
        let task = tokio::spawn(listen(listener_pool, waiters.clone(), listening));
        let store = Self {
            pool,
            waiters,
            clock: Arc::new(SystemClock),
            _listener: ListenerTask(task),
        };
        (store, ready)
    }

    /// Creates the `idem` schema if it is missing and runs the embedded migrations, keeping their
    /// history in `idem._sqlx_migrations` (see the [module documentation](self)). Safe to call from
    /// many processes at once and on every start.
    ///
    /// ```no_run
    /// # use idem_runtime::store::postgres::PostgresStore;
    /// # async fn run(pool: idem_runtime::sqlx::PgPool) -> Result<(), idem_runtime::StoreError> {
    /// PostgresStore::migrate(&pool).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn migrate(pool: &PgPool) -> Result<(), StoreError> {
        // One connection of its own, with `search_path = idem` from its start so that the migration
        // history goes to `idem._sqlx_migrations`; never shared with the application's pool.
        let options = (*pool.connect_options())
            .clone()
            .options([("search_path", "idem")]);
        let own = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(pool.options().get_acquire_timeout())
            .connect_with(options)
            .await?;
        let result = migrate_on(&own).await;
        // Closing releases the session's advisory lock even if the migration failed half-way.
        own.close().await;
        result
    }

    /// Judges every time by `clock` (tests move a [`ManualClock`](crate::clock::ManualClock) to
    /// expire keys and leases).
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// The pool the store runs its statements on.
    ///
    /// ```no_run
    /// # use idem_runtime::store::postgres::PostgresStore;
    /// # async fn run(store: PostgresStore) -> Result<(), idem_runtime::sqlx::Error> {
    /// let open: i64 = idem_runtime::sqlx::query_scalar("SELECT count(*) FROM idem.records")
    ///     .fetch_one(store.pool())
    ///     .await?;
    /// # let _ = open;
    /// # Ok(())
    /// # }
    /// ```
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// A pooled connection. A pool that times out with every connection open and in use is
    /// [busy](super::StoreErrorKind::Busy); one that could not open the connections it lacks is
    /// [unavailable](super::StoreErrorKind::Unavailable): the database is down or unreachable.
    async fn acquire(&self) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, StoreError> {
        self.pool.acquire().await.map_err(|e| match e {
            sqlx::Error::PoolTimedOut
                if self.pool.size() < self.pool.options().get_max_connections() =>
            {
                StoreError::unavailable(e)
            }
            e => StoreError::from(e),
        })
    }
}

/// Runs on a pool of one connection, so the advisory lock and the migrations share a session.
async fn migrate_on(own: &PgPool) -> Result<(), StoreError> {
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(SCHEMA_LOCK)
        .execute(own)
        .await?;
    // Checked first so that a role without CREATE on the database can start once the schema exists.
    sqlx::raw_sql(
        "DO $$ BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = 'idem') THEN
                CREATE SCHEMA idem;
            END IF;
        END $$",
    )
    .execute(own)
    .await?;
    migrator().run(own).await.map_err(StoreError::unavailable)
}

#[async_trait::async_trait]
impl Store for PostgresStore {
    fn kind(&self) -> &'static str {
        "postgres"
    }
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        let claim = claim.stamped(self.clock.now());
        let mut conn = self.acquire().await?;
        ops::claim(&mut conn, &claim).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let mut conn = self.acquire().await?;
        ops::complete(&mut conn, key, token, response).await?;
        drop(conn);
        // The listener will hear the notification too; this wakes local waiters without waiting for it.
        self.waiters.notify(key);
        Ok(())
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        let mut conn = self.acquire().await?;
        ops::release(&mut conn, key, token).await?;
        drop(conn);
        self.waiters.notify(key);
        Ok(())
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let lease_until = self.clock.now() + lease;
        let done = sqlx::query(RENEW)
            .bind(key.scope())
            .bind(key.key())
            .bind(token.0)
            .bind(lease_until.as_millis())
            .execute(&mut *self.acquire().await?)
            .await?;
        ops::fenced_unless_one(done.rows_affected())
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Found>, StoreError> {
        let now = self.clock.now();
        let mut conn = self.acquire().await?;
        let found = ops::get(&mut conn, key, now).await?;
        Ok(found.map(|record| Found { record, now }))
    }

    fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.waiters.subscribe(key)
    }

    async fn announce_waiter(&self, key: &RecordKey) -> Result<(), StoreError> {
        let mut conn = self.acquire().await?;
        ops::announce(&mut conn, key).await
    }
}

#[async_trait::async_trait]
impl Purge for PostgresStore {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        let now = self.clock.now();
        let mut conn = self.acquire().await?;
        ops::purge(&mut conn, now, batch).await
    }
}

impl super::tx::sealed::Sealed for PostgresStore {}
impl super::tx::sealed::Sealed for Tx<sqlx::Postgres> {}

impl TxHandle for Tx<sqlx::Postgres> {
    type Store = PostgresStore;

    fn from_tx(tx: Self) -> Self {
        tx
    }
}

/// Transactional mode (see [`crate::transaction`]): the business transaction is a plain one on the
/// store's pool, and the completion is the `COMPLETE` statement inside it (with its `pg_notify`, sent
/// when the transaction commits).
#[async_trait::async_trait]
impl TransactionalStore for PostgresStore {
    type Database = sqlx::Postgres;

    async fn begin_tx(&self) -> Result<OpenTx<sqlx::Postgres>, sqlx::Error> {
        Ok(OpenTx {
            tx: self.pool.begin().await?,
            _gate: None,
        })
    }

    async fn complete_in(
        &self,
        tx: &mut sqlx::Transaction<'static, sqlx::Postgres>,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        ops::complete(tx, key, token, response).await
    }

    fn committed(&self, key: &RecordKey) {
        self.waiters.notify(key);
    }
}

mod ops {
    use super::*;

    /// What one run of the claim statement found.
    enum Fetched {
        Inserted,
        Existing(Record),
        /// An identical claim's record was deleted (released or purged) between its insert and our
        /// read of it.
        Nothing,
    }

    /// Claims with [`CLAIM`] as the claim-or-fetch statement, then a takeover or replacement if the
    /// record found allows one.
    pub(super) async fn claim(
        conn: &mut PgConnection,
        claim: &Stamped<'_>,
    ) -> Result<ClaimOutcome, StoreError> {
        for _ in 0..MAX_CLAIM_ATTEMPTS {
            let record = match claim_or_fetch(conn, claim).await? {
                Fetched::Inserted => return Ok(claim.won(None)),
                Fetched::Nothing => continue,
                Fetched::Existing(record) => record,
            };
            if record.is_forgotten(claim.now) {
                if replace_forgotten(conn, claim, record.token).await? {
                    return Ok(claim.won(None));
                }
            } else if claim.can_take_over(&record) {
                if take_over(conn, claim, record.token).await? {
                    return Ok(claim.won(Some(&record)));
                }
            } else {
                return Ok(claim.existing(record));
            }
            // Someone changed the record between our read and our update: look again.
        }
        Err(StoreError::unavailable(format!(
            "claim of {} did not settle after {MAX_CLAIM_ATTEMPTS} attempts under concurrent changes",
            claim.key
        )))
    }

    async fn claim_or_fetch(
        conn: &mut PgConnection,
        claim: &Stamped<'_>,
    ) -> Result<Fetched, StoreError> {
        let row = bind_claim(CLAIM, *claim).fetch_optional(&mut *conn).await?;
        let Some(row) = row else {
            return Ok(Fetched::Nothing);
        };
        let inserted: bool = row.try_get("inserted").map_err(StoreError::corrupt)?;
        if inserted {
            Ok(Fetched::Inserted)
        } else {
            decode(&row).map(Fetched::Existing)
        }
    }

    async fn replace_forgotten(
        conn: &mut PgConnection,
        claim: &Stamped<'_>,
        seen: FencingToken,
    ) -> Result<bool, StoreError> {
        let done = bind_claim(REPLACE_FORGOTTEN, *claim)
            .bind(seen.0)
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn take_over(
        conn: &mut PgConnection,
        claim: &Stamped<'_>,
        seen: FencingToken,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(TAKE_OVER)
            .bind(claim.key.scope())
            .bind(claim.key.key())
            .bind(claim.token.0)
            .bind(claim.lease_until.as_millis())
            .bind(seen.0)
            .bind(claim.now.as_millis())
            .bind(claim.fingerprint.0.as_slice())
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    pub(super) async fn complete(
        conn: &mut PgConnection,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        // `SELECT CASE … pg_notify(...) END FROM completed` returns one row per completed record,
        // notified or not.
        let done = sqlx::query(COMPLETE)
            .bind(key.scope())
            .bind(key.key())
            .bind(token.0)
            .bind(i32::from(response.status))
            .bind(response.encode_headers())
            .bind(response.body.as_ref())
            .bind(payload(key))
            .execute(&mut *conn)
            .await?;
        fenced_unless_one(done.rows_affected())
    }

    pub(super) async fn announce(
        conn: &mut PgConnection,
        key: &RecordKey,
    ) -> Result<(), StoreError> {
        sqlx::query(ANNOUNCE)
            .bind(key.scope())
            .bind(key.key())
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    pub(super) async fn release(
        conn: &mut PgConnection,
        key: &RecordKey,
        token: FencingToken,
    ) -> Result<(), StoreError> {
        let done = sqlx::query(RELEASE)
            .bind(key.scope())
            .bind(key.key())
            .bind(token.0)
            .bind(payload(key))
            .execute(&mut *conn)
            .await?;
        fenced_unless_one(done.rows_affected())
    }

    pub(super) async fn get(
        conn: &mut PgConnection,
        key: &RecordKey,
        now: Timestamp,
    ) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(GET)
            .bind(key.scope())
            .bind(key.key())
            .bind(now.as_millis())
            .fetch_optional(&mut *conn)
            .await?;
        row.as_ref().map(decode).transpose()
    }

    pub(super) async fn purge(
        conn: &mut PgConnection,
        now: Timestamp,
        batch: usize,
    ) -> Result<u64, StoreError> {
        let done = sqlx::query(PURGE)
            .bind(now.as_millis())
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected())
    }

    pub(super) fn fenced_unless_one(rows: u64) -> Result<(), StoreError> {
        if rows == 1 {
            Ok(())
        } else {
            Err(StoreError::fenced())
        }
    }
}

/// The notification payload for `key`: `[scope, key]` as JSON. Both parts are bounded
/// ([`RecordKey::MAX_PART`]), so it stays far below PostgreSQL's 8000-byte limit.
fn payload(key: &RecordKey) -> String {
    serde_json::to_string(&(key.scope(), key.key())).unwrap_or_default()
}

/// Wakes the waiters a notification payload names.
fn deliver(waiters: &Waiters, payload: &str) {
    match serde_json::from_str::<(String, String)>(payload) {
        Ok((scope, key)) => waiters.notify(&RecordKey::stored(scope, key)),
        Err(e) => tracing::debug!(
            target: "idem", error = %e, "ignoring a malformed notification on {CHANNEL}"
        ),
    }
}

/// The listener task: forwards notifications on [`CHANNEL`] to `waiters`, reconnecting with backoff.
///
/// `listening` is told when the listener first listens. If nobody receives that (the constructor did
/// not wait, or gave up), waiters may have subscribed before, and they are woken to re-read their
/// records; so they are after every reconnection.
async fn listen(pool: PgPool, waiters: Arc<Waiters>, listening: tokio::sync::oneshot::Sender<()>) {
    let mut listening = Some(listening);
    let mut backoff = MIN_BACKOFF;
    loop {
        match PgListener::connect_with(&pool).await {
            Ok(mut listener) => match listener.listen(CHANNEL).await {
                Ok(()) => {
                    backoff = MIN_BACKOFF;
                    // Unless the constructor is still waiting for this (no subscriber can exist
                    // yet), anything announced before now may have been missed: every waiter
                    // re-reads its record.
                    let awaited = listening.take().is_some_and(|tx| tx.send(()).is_ok());
                    if !awaited {
                        waiters.notify_all();
                    }
                    loop {
                        match listener.try_recv().await {
                            Ok(Some(notification)) => deliver(&waiters, notification.payload()),
                            // The connection dropped and was re-established: some may be lost.
                            Ok(None) => waiters.notify_all(),
                            Err(e) => {
                                tracing::warn!(
                                    target: "idem", error = %e,
                                    "idempotency store listener lost its connection; reconnecting"
                                );
                                break;
                            }
                        }
                    }
                }
                Err(e) => tracing::warn!(
                    target: "idem", error = %e, "idempotency store listener could not LISTEN"
                ),
            },
            Err(e) => tracing::warn!(
                target: "idem", error = %e, "idempotency store listener could not connect"
            ),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Decodes a row of the record columns.
fn decode(row: &PgRow) -> Result<Record, StoreError> {
    let get_i64 = |column: &str| -> Result<i64, StoreError> {
        row.try_get::<i64, _>(column).map_err(StoreError::corrupt)
    };
    // Borrowed where the row's own bytes do (fingerprint, state, headers): no copy to drop again.
    let fingerprint: &[u8] = row.try_get("fingerprint").map_err(StoreError::corrupt)?;
    let fingerprint = <[u8; 32]>::try_from(fingerprint)
        .map(Fingerprint)
        .map_err(|_| {
            StoreError::corrupt(format!(
                "fingerprint of {} bytes, expected 32",
                fingerprint.len()
            ))
        })?;
    let state: &str = row.try_get("state").map_err(StoreError::corrupt)?;
    let state = match state {
        "in_flight" => RecordState::InFlight {
            lease_until: Timestamp::from_millis(get_i64("lease_until")?),
        },
        "completed" => {
            let status: i32 = row.try_get("status").map_err(StoreError::corrupt)?;
            let headers: &str = row.try_get("headers").map_err(StoreError::corrupt)?;
            let body: Vec<u8> = row.try_get("body").map_err(StoreError::corrupt)?;
            RecordState::Completed {
                response: StoredResponse {
                    status: u16::try_from(status).map_err(StoreError::corrupt)?,
                    headers: StoredResponse::decode_headers(headers)
                        .map_err(StoreError::corrupt)?,
                    body: body.into(),
                },
            }
        }
        other => return Err(StoreError::corrupt(format!("unknown state {other:?}"))),
    };
    Ok(Record {
        fingerprint,
        token: FencingToken(get_i64("token")?),
        created_at: Timestamp::from_millis(get_i64("created_at")?),
        expires_at: Timestamp::from_millis(get_i64("expires_at")?),
        retain_until: Timestamp::from_millis(get_i64("retain_until")?),
        state,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_names_the_key_or_wakes_all_when_too_long() {
        let key = RecordKey::new("tenant \"7\"", "k/1");
        let p = payload(&key);
        assert_eq!(
            serde_json::from_str::<(String, String)>(&p).unwrap(),
            (key.scope().to_owned(), key.key().to_owned())
        );
        // The longest parts, each character escaped as six bytes, are still far below the limit.
        let huge = RecordKey::new("\u{1}".repeat(10_000), "\u{1}".repeat(10_000));
        assert!(payload(&huge).len() < 8000);
    }

    #[test]
    fn completion_and_release_notify_on_the_listened_channel() {
        for sql in [COMPLETE, RELEASE] {
            assert!(sql.contains(&format!("pg_notify('{CHANNEL}'")), "{sql}");
        }
    }

    #[tokio::test]
    async fn deliver_wakes_the_named_key_only() {
        let waiters = Waiters::new();
        let a = RecordKey::new("s", "a");
        let b = RecordKey::new("s", "b");
        let mut sub_a = waiters.subscribe(&a);
        let mut sub_b = waiters.subscribe(&b);
        deliver(&waiters, &payload(&a));
        sub_a.changed().await;
        let b_woken = tokio::time::timeout(Duration::ZERO, sub_b.changed()).await;
        assert!(b_woken.is_err(), "only a was named");
        deliver(&waiters, "not json");
        deliver(&waiters, &payload(&b));
        sub_b.changed().await;
    }
}
