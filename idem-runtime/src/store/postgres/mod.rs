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
//! Records live in `idem.records` (primary key `(scope, key)`, times as BIGINT milliseconds since
//! the Unix epoch, an index on `retain_until`). The embedded migrations (`migrations/postgres/`)
//! run at start-up with `search_path = idem`, so their history stays apart from the application's
//! own `_sqlx_migrations`. Creating the schema needs the `CREATE` privilege the first time.
//! Migrations only add, and an instance ignores versions it does not know, so two versions can
//! share the database during a rolling deploy; an instance older than released records (state
//! `released`) reads one as [`Corrupt`](super::StoreErrorKind::Corrupt) until it is replaced.
//!
//! # Time
//!
//! Every instant is the server's: each statement computes `clock_timestamp()` once and both
//! stamps and judges by it (the engine sends durations), so instances whose clocks disagree still
//! agree on who owns a key, when it expires and when it may be purged. A store given a clock
//! ([`PostgresStore::with_clock`], for tests) sends that clock's time instead.
//!
//! # Statements
//!
//! - **Claim**: one statement, one round trip. A primary-key read returns the record when
//!   [`Claim::decide`] keeps it (a replay, or a live claim: nothing is written); otherwise, and
//!   only then, PostgreSQL calls `idem.claim`, which inserts a fresh record or locks the latest
//!   version of the key's record, decides again, and inserts over it, takes it over or resumes it
//!   in place. The statements assume READ COMMITTED.
//! - **Complete**, **release**, **renew**: one statement each, fenced by the token and the
//!   in-flight state. A release keeps the record, [released](crate::record::RecordState::Released). Completion and
//!   release call `pg_notify` in the same statement only if a duplicate announced itself (the
//!   `watched` flag): a notifying commit takes a database-wide lock, which would otherwise
//!   serialise every completion.
//! - **Purge**: one `DELETE` of at most a batch of rows past retention, skipping locked rows.
//! - **The operator's operations**: `forget` and `erase_scope` delete (fenced by token and state,
//!   or a batch of a scope through the primary key's prefix) and notify awaited records;
//!   `list_in_flight` and `stats` scan the table (no index on the state, which would keep
//!   completions from being HOT updates).
//! - **Lock waits** are bounded ([`DEFAULT_LOCK_TIMEOUT`], [`PostgresStore::with_lock_timeout`]):
//!   a statement that meets a row held by a stalled transaction fails as
//!   [`Unavailable`](super::StoreErrorKind::Unavailable) instead of waiting for it. The setting is
//!   local to the statement's transaction and never changes the session.
//!
//! # Waking waiters across instances
//!
//! Completions and releases of awaited records notify the channel [`CHANNEL`] with `[scope, key]`
//! as JSON. Each store keeps one [`PgListener`](sqlx::postgres::PgListener) on a connection of its own and wakes that key's
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
use super::{
    Claim, ClaimOutcome, Found, Listed, Purge, StateKind, Stats, Store, StoreError, Subscription,
    Waiters,
};
use crate::clock::{Clock, Timestamp};
use crate::record::{FencingToken, RecordKey, StoredResponse};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::Row;
use std::sync::Arc;
use std::time::Duration;

/// The `LISTEN`/`NOTIFY` channel on which completions and releases are announced.
pub const CHANNEL: &str = "idem_records";

/// How long [`PostgresStore::pool_options`] pools wait for a connection before failing.
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// How long one of the store's statements waits for a row lock (a record held by a transaction
/// that stalled, such as a business transaction in [transactional mode](crate::transaction)
/// that neither commits nor rolls back) before it fails as
/// [`Unavailable`](super::StoreErrorKind::Unavailable), which callers retry. Below the engine's
/// store timeout, so that the server gives up first and the connection returns to the pool clean.
/// Change it with [`PostgresStore::with_lock_timeout`].
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// The embedded migrations (`migrations/postgres/`), run with `search_path = idem`. Versions applied
/// by a later idem are ignored (see the [module documentation](self)).
pub(crate) fn migrator() -> Migrator {
    super::migrations::migrator(&[
        (
            20261130000001,
            "idem records",
            include_str!("../../../migrations/postgres/20261130000001_idem_records.sql"),
        ),
        (
            20261201000000,
            "idem records watched",
            include_str!("../../../migrations/postgres/20261201000000_idem_records_watched.sql"),
        ),
        (
            20261202000000,
            "idem insert claim",
            include_str!("../../../migrations/postgres/20261202000000_idem_insert_claim.sql"),
        ),
        (
            20261207120000,
            "idem claim on server time",
            include_str!(
                "../../../migrations/postgres/20261207120000_idem_claim_on_server_time.sql"
            ),
        ),
    ])
}

/// How often a claim re-runs its statement when concurrent changes keep it from settling. Each retry
/// means another request deleted the key's record in between, so a few suffice; the bound only
/// guards against a pathological loop.
const MAX_CLAIM_ATTEMPTS: usize = 16;

/// Serialises schema creation between processes starting at once (an arbitrary constant).
const SCHEMA_LOCK: i64 = 0x6964_656d_5f73_6368; // "idem_sch"

const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

mod listen;
mod statements;

use listen::payload;
use statements::{
    decode, millis, ANNOUNCE, ERASE, FORGET, GET, LIST_IN_FLIGHT, PURGE, RELEASE, RENEW, STATS,
};

/// The claim's statement and binds, for the project's own tests and benchmarks (which inspect its
/// plan and time it alone). Not a stable API.
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing {
    use super::Claim;
    use crate::clock::Timestamp;

    /// Claim-or-fetch: the record to keep, or what `idem.claim` made of the key.
    pub const CLAIM_STATEMENT: &str = super::statements::CLAIM;

    /// `sql` (the claim statement, or a statement around it such as an `EXPLAIN`) with the nine
    /// binds of `claim` judged at `now` (`None`: the server's clock), with the default lock timeout.
    pub fn bind_claim<'q>(
        sql: &'q str,
        claim: &Claim<'q>,
        now: Option<Timestamp>,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        super::statements::bind_claim(
            sql,
            claim,
            now,
            super::statements::millis(super::DEFAULT_LOCK_TIMEOUT),
        )
    }
}

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
    /// The clock the store judges by instead of the server's (tests), if any.
    clock: Option<Arc<dyn Clock>>,
    /// [`DEFAULT_LOCK_TIMEOUT`] unless set, in milliseconds.
    lock_timeout_ms: i64,
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
        let task = tokio::spawn(listen::listen(listener_pool, waiters.clone(), listening));
        let store = Self {
            pool,
            waiters,
            clock: None,
            lock_timeout_ms: millis(DEFAULT_LOCK_TIMEOUT),
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

    /// Judges every time by `clock` instead of the server's `clock_timestamp()` (tests move a
    /// [`ManualClock`](crate::clock::ManualClock) to expire keys and leases). Its time is sent with
    /// each statement, which still decides alone. Every instance sharing the database must then
    /// share that clock: in production, leave the server's.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// How long each of the store's statements waits for a row lock before it fails as
    /// [`Unavailable`](super::StoreErrorKind::Unavailable) ([`DEFAULT_LOCK_TIMEOUT`] unless set;
    /// rounded to whole milliseconds, at least one).
    ///
    /// ```no_run
    /// # use idem_runtime::store::postgres::PostgresStore;
    /// # use std::time::Duration;
    /// # async fn run() -> Result<(), idem_runtime::StoreError> {
    /// let store = PostgresStore::connect("postgres://app@127.0.0.1:5432/app")
    ///     .await?
    ///     .with_lock_timeout(Duration::from_millis(500));
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn with_lock_timeout(mut self, timeout: Duration) -> Self {
        // Zero would mean "wait forever" to PostgreSQL.
        self.lock_timeout_ms = millis(timeout).max(1);
        self
    }

    /// The store's time to send with a statement: the given clock's, or `None` for the server's.
    fn now(&self) -> Option<Timestamp> {
        self.clock.as_ref().map(|clock| clock.now())
    }

    fn lock_timeout_ms(&self) -> i64 {
        self.lock_timeout_ms
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
        let mut conn = self.acquire().await?;
        statements::claim(&mut conn, claim, self.now(), self.lock_timeout_ms()).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let mut conn = self.acquire().await?;
        statements::complete(&mut conn, key, token, response, self.lock_timeout_ms()).await?;
        drop(conn);
        // The listener will hear the notification too; this wakes local waiters without waiting for it.
        self.waiters.notify(key);
        Ok(())
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        let done = sqlx::query(RELEASE)
            .bind(key.scope())
            .bind(key.key())
            .bind(token.0)
            .bind(payload(key))
            .bind(self.lock_timeout_ms())
            .execute(&mut *self.acquire().await?)
            .await?;
        statements::fenced_unless_one(done.rows_affected())?;
        self.waiters.notify(key);
        Ok(())
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let done = sqlx::query(RENEW)
            .bind(key.scope())
            .bind(key.key())
            .bind(token.0)
            .bind(millis(lease))
            .bind(self.now().map(Timestamp::as_millis))
            .bind(self.lock_timeout_ms())
            .execute(&mut *self.acquire().await?)
            .await?;
        statements::fenced_unless_one(done.rows_affected())
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Found>, StoreError> {
        let row = sqlx::query(GET)
            .bind(key.scope())
            .bind(key.key())
            .bind(self.now().map(Timestamp::as_millis))
            .fetch_optional(&mut *self.acquire().await?)
            .await?;
        row.as_ref().map(statements::found).transpose()
    }

    fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.waiters.subscribe(key)
    }

    async fn announce_waiter(&self, key: &RecordKey) -> Result<(), StoreError> {
        sqlx::query(ANNOUNCE)
            .bind(key.scope())
            .bind(key.key())
            .bind(self.lock_timeout_ms())
            .execute(&mut *self.acquire().await?)
            .await?;
        Ok(())
    }

    async fn forget(
        &self,
        key: &RecordKey,
        token: FencingToken,
        state: StateKind,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(FORGET)
            .bind(key.scope())
            .bind(key.key())
            .bind(token.0)
            .bind(state.as_str())
            .bind(payload(key))
            .bind(self.lock_timeout_ms())
            .execute(&mut *self.acquire().await?)
            .await?;
        let deleted = done.rows_affected() == 1;
        if deleted {
            self.waiters.notify(key);
        }
        Ok(deleted)
    }

    async fn erase_scope(&self, scope: &str, batch: usize) -> Result<u64, StoreError> {
        let keys: Vec<String> = sqlx::query_scalar(ERASE)
            .bind(scope)
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .bind(self.lock_timeout_ms())
            .fetch_all(&mut *self.acquire().await?)
            .await?;
        let erased = keys.len() as u64;
        for key in keys {
            self.waiters
                .notify(&RecordKey::stored(scope.to_owned(), key));
        }
        Ok(erased)
    }

    async fn list_in_flight(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> Result<(Vec<Listed>, Timestamp), StoreError> {
        let rows = sqlx::query(LIST_IN_FLIGHT)
            .bind(millis(older_than))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(self.now().map(Timestamp::as_millis))
            .fetch_all(&mut *self.acquire().await?)
            .await?;
        let mut now = None;
        let mut listed = Vec::with_capacity(rows.len());
        for row in &rows {
            now = Some(statements::store_now(row)?);
            let scope: Option<String> = row.try_get("scope").map_err(StoreError::corrupt)?;
            let Some(scope) = scope else { continue };
            let key: String = row.try_get("key").map_err(StoreError::corrupt)?;
            listed.push(Listed {
                key: RecordKey::stored(scope, key),
                record: decode(row)?,
            });
        }
        let now = now.ok_or_else(|| StoreError::corrupt("the listing returned no time"))?;
        Ok((listed, now))
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let row = sqlx::query(STATS)
            .bind(self.now().map(Timestamp::as_millis))
            .fetch_one(&mut *self.acquire().await?)
            .await?;
        let count = |column: &str| -> Result<u64, StoreError> {
            let n: i64 = row.try_get(column).map_err(StoreError::corrupt)?;
            u64::try_from(n).map_err(StoreError::corrupt)
        };
        let oldest: Option<i64> = row
            .try_get("oldest_in_flight")
            .map_err(StoreError::corrupt)?;
        Ok(Stats {
            in_flight: count("in_flight")?,
            completed: count("completed")?,
            released: count("released")?,
            expired: count("expired")?,
            forgotten: count("forgotten")?,
            oldest_in_flight: oldest.map(Timestamp::from_millis),
            now: statements::store_now(&row)?,
        })
    }
}

#[async_trait::async_trait]
impl Purge for PostgresStore {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        let done = sqlx::query(PURGE)
            .bind(self.now().map(Timestamp::as_millis))
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .execute(&mut *self.acquire().await?)
            .await?;
        Ok(done.rows_affected())
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
        statements::complete(tx, key, token, response, self.lock_timeout_ms()).await
    }

    fn committed(&self, key: &RecordKey) {
        self.waiters.notify(key);
    }
}
