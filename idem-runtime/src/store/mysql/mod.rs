//! The MySQL and MariaDB store: one database shared by every instance of a service.
//!
//! ```no_run
//! use idem_runtime::store::mysql::MySqlStore;
//! use idem_runtime::{sweeper::Sweeper, Engine};
//! use std::sync::Arc;
//! # async fn run() -> Result<(), idem_runtime::StoreError> {
//! // Creates idem's tables if needed, and starts the task that wakes waiters across instances.
//! let store = Arc::new(MySqlStore::connect("mysql://app@db.internal:3306/app").await?);
//! let engine = Engine::from_arc(store.clone());
//! tokio::spawn(Sweeper::new(store).run());
//! # let _ = engine;
//! # Ok(())
//! # }
//! ```
//!
//! Written for MySQL 8 and MariaDB 10.11 (InnoDB), through sqlx's `mysql` driver.
//!
//! # Schema and migrations
//!
//! Records live in `idem_records` in the pool's own database (primary key `(scope, key)` as
//! `VARBINARY`, compared byte for byte; times as BIGINT milliseconds; an index on `retain_until`),
//! completions that waiters on other instances await in `idem_wakeups`. Every table idem creates is
//! named `idem_…`. The embedded migrations (`migrations/mysql/`) run through sqlx's migrator, whose
//! history on MySQL is always the database's `_sqlx_migrations` (MySQL has no schemas apart from
//! databases): an application whose own sqlx migrator runs on the same database must call
//! `set_ignore_missing(true)` on it, or give idem a database of its own. idem's migrator ignores
//! the application's versions, and migrations only add, so two versions of idem can share the
//! database during a rolling deploy.
//!
//! # Time
//!
//! Every instant is the server's: `UTC_TIMESTAMP(6)` in milliseconds since the epoch, which does
//! not depend on the session's time zone (sqlx pins it to UTC anyway). Statements take durations
//! and compute instants themselves. A store given a clock ([`MySqlStore::with_clock`]) sends that
//! clock's time in their place.
//!
//! # Statements
//!
//! - **Claim**: a primary-key read (a consistent read, no lock) with the server's time. A replay,
//!   or a claim in flight, ends there: one round trip that writes nothing. A new key is one
//!   `INSERT` that computes the record's instants from the server's time and hands the creation
//!   back through `LAST_INSERT_ID(expr)` (in the statement's OK packet, no second round trip); a
//!   duplicate-key error means another claim inserted first, and the claim looks again. A takeover,
//!   a resume, or the replacement of a record past retention or released by another request is a
//!   short transaction: the row read `FOR UPDATE` with the server's time, [`Claim::decide`] applied
//!   in Rust, one `UPDATE`. Deadlocks (1213) and lock wait timeouts (1205) are retried a bounded
//!   number of times, then [`Unavailable`](super::StoreErrorKind::Unavailable); no claim is ever
//!   granted twice, since every grant is an insert of the key or an update under its row lock.
//! - **Complete**, **release**, **renew**: one `UPDATE` each, fenced by the token and the in-flight
//!   state. Release keeps the record, [released](crate::record::RecordState::Released).
//! - **Purge**: one `DELETE … ORDER BY retain_until LIMIT n` through the `retain_until` index.
//!
//! # Waking waiters across instances
//!
//! MySQL has no LISTEN/NOTIFY. A duplicate about to wait [announces](Store::announce_waiter) itself
//! by setting the record's `watched` flag; completing or releasing a watched record (the
//! completing `UPDATE` returns the flag through `LAST_INSERT_ID`) then inserts one row into
//! `idem_wakeups`, so completions nobody waits for cost nothing more. Each store instance that has
//! local waiters polls that table every [`POLL_INTERVAL`] (one indexed range read) and wakes the
//! keys named there; an instance without waiters does not poll. A waiter on another instance
//! therefore learns of a completion within about one poll interval (its local waiters at once), and
//! in any case at its lease's end or its wait's bound. The purge deletes wake-up rows older than
//! [`WAKEUP_RETENTION`].
//!
//! # Transactional mode
//!
//! [`Transactional`](crate::transaction::Transactional) works on this store as on PostgreSQL: the
//! claim commits first, the handler's writes go through `Tx<MySql>`, and the completion (with its
//! wake-up row, if awaited) commits with them. See [`TransactionalStore`] for InnoDB's locks and
//! deadlocks there.
//!
//! # Outages
//!
//! A database error is [`Unavailable`](super::StoreErrorKind::Unavailable) (503); a pool whose
//! connections are all in use is [`Busy`](super::StoreErrorKind::Busy) (503 `busy`); an
//! undecodable row is [`Corrupt`](super::StoreErrorKind::Corrupt). Pools from
//! [`MySqlStore::pool_options`] give up acquiring after [`DEFAULT_ACQUIRE_TIMEOUT`], and the store
//! resumes by itself when the server returns.

use super::tx::{OpenTx, TransactionalStore, Tx, TxHandle};
use super::{
    Claim, ClaimOutcome, ClaimRule, Found, Listed, Purge, StateKind, Stats, Store, StoreError,
    Subscription, Waiters,
};
use crate::clock::{Clock, Timestamp};
use crate::record::{FencingToken, RecordKey, StoredResponse};
use sqlx::migrate::Migrator;
use sqlx::mysql::{MySqlConnection, MySqlPool, MySqlPoolOptions};
use sqlx::Row;
use std::sync::Arc;
use std::time::Duration;

// The statements' macros (`now_ms!`, `record_columns!`…) also build the statements assembled here.
#[macro_use]
mod statements;
mod wakeups;

use statements::*;

/// How long [`MySqlStore::pool_options`] pools wait for a connection before failing.
pub const DEFAULT_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(3);

/// How often an instance with local waiters reads `idem_wakeups` for completions on other
/// instances (see the [module documentation](self)).
pub const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// How long wake-up rows are kept before the purge deletes them: far longer than any poll lags.
pub const WAKEUP_RETENTION: Duration = Duration::from_secs(600);

/// How far back each poll reads wake-ups before the latest it saw: a row's `at` is taken when its
/// statement runs, and it becomes visible when it commits, an instant later.
const POLL_OVERLAP_MS: i64 = 2_000;

/// At most this many wake-up rows per poll: more than the overlap window holds at any plausible
/// rate of awaited completions, so that each poll moves past the rows it read.
const POLL_BATCH: i64 = 10_000;

/// How long [`MySqlStore::migrate`] waits for another instance's migrations to finish.
const MIGRATION_LOCK_WAIT: Duration = Duration::from_secs(60);

/// How often a claim runs again when concurrent changes (another claim's insert, a deadlock, a
/// lock wait timeout) keep it from settling; the bound only guards against a pathological loop.
const MAX_CLAIM_ATTEMPTS: usize = 16;

/// MySQL's error numbers the claim retries.
const ER_DUP_ENTRY: u16 = 1062;
const ER_LOCK_WAIT_TIMEOUT: u16 = 1205;
const ER_LOCK_DEADLOCK: u16 = 1213;

const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The embedded migrations (`migrations/mysql/`). Versions it does not list (the application's, or
/// a later idem's) are ignored.
pub(crate) fn migrator() -> Migrator {
    super::migrations::migrator(&[(
        20261207000000,
        "idem records",
        include_str!("../../../migrations/mysql/20261207000000_idem_records.sql"),
    )])
}

/// Why a claim attempt did not settle.
enum Failed {
    /// A concurrent change (another claim's insert, a deadlock, a lock wait timeout): run again.
    Again,
    /// Anything else: the claim fails with it.
    Error(StoreError),
}

impl From<sqlx::Error> for Failed {
    fn from(e: sqlx::Error) -> Self {
        match retried(&e) {
            true => Self::Again,
            false => Self::Error(e.into()),
        }
    }
}

impl From<StoreError> for Failed {
    fn from(e: StoreError) -> Self {
        Self::Error(e)
    }
}

/// A [`Store`] in MySQL or MariaDB, shared by every instance of a service. See the
/// [module documentation](self) for its statements and guarantees.
///
/// ```no_run
/// use idem_runtime::store::mysql::MySqlStore;
/// use idem_runtime::Engine;
/// # async fn run() -> Result<(), idem_runtime::StoreError> {
/// let store = MySqlStore::connect("mysql://root@127.0.0.1:3306/test").await?;
/// let engine = Engine::new(store);
/// # let _ = engine;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct MySqlStore {
    pool: MySqlPool,
    waiters: Arc<Waiters>,
    /// The clock the store judges by instead of the server's, if any (tests).
    clock: Option<Arc<dyn Clock>>,
    _poller: PollerTask,
}

/// Stops the poller task when the store is dropped.
#[derive(Debug)]
struct PollerTask(tokio::task::JoinHandle<()>);

impl Drop for PollerTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl MySqlStore {
    /// Connects to `url` with [`pool_options`](Self::pool_options), then does what
    /// [`from_pool`](Self::from_pool) does.
    ///
    /// ```no_run
    /// # use idem_runtime::store::mysql::MySqlStore;
    /// # async fn run() -> Result<(), idem_runtime::StoreError> {
    /// let store = MySqlStore::connect("mysql://root@127.0.0.1:3306/test").await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = Self::pool_options().connect(url).await?;
        Self::from_pool(pool).await
    }

    /// The pool settings [`connect`](Self::connect) uses: sqlx's defaults, except that acquiring a
    /// connection fails after [`DEFAULT_ACQUIRE_TIMEOUT`] (an outage answers 503 promptly), and an
    /// idle connection is not pinged before each use (one round trip per replay, not two; a
    /// connection that died while idle fails one operation with
    /// [`Unavailable`](super::StoreErrorKind::Unavailable) and is discarded).
    pub fn pool_options() -> MySqlPoolOptions {
        MySqlPoolOptions::new()
            .acquire_timeout(DEFAULT_ACQUIRE_TIMEOUT)
            .test_before_acquire(false)
    }

    /// A store on an existing pool (for instance the application's own): runs the migrations and
    /// starts the poller that wakes waiters across instances.
    ///
    /// ```no_run
    /// # use idem_runtime::store::mysql::MySqlStore;
    /// # async fn run(pool: idem_runtime::sqlx::MySqlPool) -> Result<(), idem_runtime::StoreError> {
    /// let store = MySqlStore::from_pool(pool.clone()).await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn from_pool(pool: MySqlPool) -> Result<Self, StoreError> {
        Self::migrate(&pool).await?;
        Ok(Self::from_pool_unmigrated(pool))
    }

    /// A store on `pool` without running the migrations (when they run separately, through
    /// [`migrate`](Self::migrate)). Sends nothing to the server itself, so it never fails.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime, as it spawns the poller task.
    pub fn from_pool_unmigrated(pool: MySqlPool) -> Self {
        let waiters = Arc::new(Waiters::new());
        let task = tokio::spawn(wakeups::poll(pool.clone(), waiters.clone()));
        Self {
            pool,
            waiters,
            clock: None,
            _poller: PollerTask(task),
        }
    }

    /// Runs the embedded migrations (see the [module documentation](self)): creates idem's tables
    /// if they are missing. Safe to call from many processes at once (sqlx takes a named lock) and
    /// on every start.
    ///
    /// ```no_run
    /// # use idem_runtime::store::mysql::MySqlStore;
    /// # async fn run(pool: idem_runtime::sqlx::MySqlPool) -> Result<(), idem_runtime::StoreError> {
    /// MySqlStore::migrate(&pool).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn migrate(pool: &MySqlPool) -> Result<(), StoreError> {
        // sqlx's own migration lock is `GET_LOCK(name, -1)`, which MariaDB answers with NULL at once
        // (a negative timeout is not "forever" there): take a named lock of our own, per database,
        // on the connection the migrations run on.
        let mut conn = pool.acquire().await?;
        let locked: Option<i64> =
            sqlx::query_scalar("SELECT GET_LOCK(SHA1(CONCAT('idem migrations ', DATABASE())), ?)")
                .bind(MIGRATION_LOCK_WAIT.as_secs())
                .fetch_one(&mut *conn)
                .await?;
        if locked != Some(1) {
            return Err(StoreError::unavailable(
                "another instance held idem's migration lock for too long",
            ));
        }
        let migrated = migrator()
            .run_direct(&mut *conn)
            .await
            .map_err(StoreError::unavailable);
        let unlocked =
            sqlx::query("SELECT RELEASE_LOCK(SHA1(CONCAT('idem migrations ', DATABASE())))")
                .execute(&mut *conn)
                .await;
        migrated?;
        unlocked?;
        Ok(())
    }

    /// Judges every time by `clock` instead of the server's clock (tests move a
    /// [`ManualClock`](crate::clock::ManualClock) to expire keys and leases). Wake-ups across
    /// instances stay on the server's clock.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// The pool the store runs its statements on.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The clock's time to bind in place of the server's, if the store has a clock.
    fn clock_ms(&self) -> Option<i64> {
        self.clock.as_ref().map(|clock| clock.now().as_millis())
    }

    /// A pooled connection. A pool that times out with every connection open and in use is
    /// [busy](super::StoreErrorKind::Busy); one that could not open the connections it lacks is
    /// [unavailable](super::StoreErrorKind::Unavailable).
    async fn acquire(&self) -> Result<sqlx::pool::PoolConnection<sqlx::MySql>, StoreError> {
        self.pool.acquire().await.map_err(|e| match e {
            sqlx::Error::PoolTimedOut
                if self.pool.size() < self.pool.options().get_max_connections() =>
            {
                StoreError::unavailable(e)
            }
            e => StoreError::from(e),
        })
    }

    /// The store's time now.
    async fn now(&self, conn: &mut MySqlConnection) -> Result<Timestamp, StoreError> {
        let now: i64 = sqlx::query_scalar(NOW)
            .bind(self.clock_ms())
            .fetch_one(&mut *conn)
            .await?;
        Ok(Timestamp::from_millis(now))
    }

    /// One attempt at the claim.
    async fn try_claim(
        &self,
        conn: &mut MySqlConnection,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome, Failed> {
        let (found, now) = read(conn, READ, claim.key, self.clock_ms()).await?;
        match found {
            None => {
                let done = sqlx::query(INSERT)
                    .bind(claim.key.scope().as_bytes())
                    .bind(claim.key.key().as_bytes())
                    .bind(claim.fingerprint.0.as_slice())
                    .bind(claim.token.0)
                    .bind(millis(claim.ttl))
                    .bind(millis(claim.retain.max(claim.ttl)))
                    .bind(millis(claim.lease))
                    .bind(self.clock_ms())
                    .execute(&mut *conn)
                    .await?;
                // `LAST_INSERT_ID(n)`: the creation, as the server computed it (the cast gives back a
                // negative time, which the protocol carries as unsigned).
                let created_at = Timestamp::from_millis(done.last_insert_id() as i64);
                Ok(ClaimOutcome::Claimed(super::Claimed {
                    taken_over: false,
                    created_at,
                    expires_at: created_at + claim.ttl,
                }))
            }
            Some(record) if claim.decide(Some(&record), now) == ClaimRule::Keep => {
                Ok(ClaimOutcome::Existing(Found { record, now }))
            }
            Some(_) => self.claim_locked(conn, claim).await,
        }
    }

    /// The takeover, resume or replacement: the row locked, [`Claim::decide`] at the server's time of
    /// the lock, one `UPDATE`. [`Failed::Again`] if the row went away meanwhile (the insert applies).
    async fn claim_locked(
        &self,
        conn: &mut MySqlConnection,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome, Failed> {
        use sqlx::Connection;
        let mut tx = conn.begin().await?;
        let (found, now) = read(&mut tx, READ_FOR_UPDATE, claim.key, self.clock_ms()).await?;
        let Some(mut record) = found else {
            tx.rollback().await?;
            return Err(Failed::Again);
        };
        let rule = claim.decide(Some(&record), now);
        let outcome = claim.apply(rule, &mut record, now);
        if rule != ClaimRule::Keep {
            sqlx::query(WRITE_CLAIM)
                .bind(record.fingerprint.0.as_slice())
                .bind(record.token.0)
                .bind(record.created_at.as_millis())
                .bind(record.expires_at.as_millis())
                .bind(record.retain_until.as_millis())
                .bind((now + claim.lease).as_millis())
                .bind(claim.key.scope().as_bytes())
                .bind(claim.key.key().as_bytes())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(outcome)
    }

    /// Writes a wake-up row for `keys`, for waiters on other instances.
    async fn wake_others(
        conn: &mut MySqlConnection,
        keys: &[(Vec<u8>, Vec<u8>)],
    ) -> Result<(), StoreError> {
        if keys.is_empty() {
            return Ok(());
        }
        let mut insert =
            sqlx::QueryBuilder::<sqlx::MySql>::new("INSERT INTO idem_wakeups (scope, `key`, at) ");
        insert.push_values(keys, |mut row, (scope, key)| {
            row.push_bind(scope.as_slice())
                .push_bind(key.as_slice())
                .push(server_now_ms!());
        });
        insert.build().execute(&mut *conn).await?;
        Ok(())
    }

    /// Judges what `COMPLETE` or `RELEASE` did (`done`): fenced unless it changed the record, and a
    /// wake-up row if the record was watched (`LAST_INSERT_ID(watched)` came back as 1).
    async fn finish(
        conn: &mut MySqlConnection,
        key: &RecordKey,
        done: sqlx::mysql::MySqlQueryResult,
    ) -> Result<(), StoreError> {
        if done.rows_affected() != 1 {
            return Err(StoreError::fenced());
        }
        if done.last_insert_id() == 1 {
            let named = (
                key.scope().as_bytes().to_vec(),
                key.key().as_bytes().to_vec(),
            );
            Self::wake_others(conn, &[named]).await?;
        }
        Ok(())
    }

    /// Completes `key` under `token` on `conn` (a pooled connection or the handler's transaction).
    async fn complete_on(
        conn: &mut MySqlConnection,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let done = sqlx::query(COMPLETE)
            .bind(i32::from(response.status))
            .bind(response.encode_headers())
            .bind(response.body.as_ref())
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(token.0)
            .execute(&mut *conn)
            .await?;
        Self::finish(conn, key, done).await
    }
}

#[async_trait::async_trait]
impl Store for MySqlStore {
    fn kind(&self) -> &'static str {
        "mysql"
    }

    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        let mut conn = self.acquire().await?;
        for _ in 0..MAX_CLAIM_ATTEMPTS {
            match self.try_claim(&mut conn, claim).await {
                Ok(outcome) => return Ok(outcome),
                Err(Failed::Again) => continue,
                Err(Failed::Error(e)) => return Err(e),
            }
        }
        Err(StoreError::unavailable(format!(
            "claim of {} did not settle after {MAX_CLAIM_ATTEMPTS} attempts under concurrent changes",
            claim.key
        )))
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let mut conn = self.acquire().await?;
        Self::complete_on(&mut conn, key, token, response).await?;
        drop(conn);
        self.waiters.notify(key);
        Ok(())
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        let mut conn = self.acquire().await?;
        let done = sqlx::query(RELEASE)
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(token.0)
            .execute(&mut *conn)
            .await?;
        Self::finish(&mut conn, key, done).await?;
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
        let done = sqlx::query(RENEW)
            .bind(self.clock_ms())
            .bind(millis(lease))
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(token.0)
            .execute(&mut *self.acquire().await?)
            .await?;
        // sqlx asks for CLIENT_FOUND_ROWS: the rows matched, even if the lease did not move.
        match done.rows_affected() {
            1 => Ok(()),
            _ => Err(StoreError::fenced()),
        }
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Found>, StoreError> {
        let mut conn = self.acquire().await?;
        let (found, now) = read(&mut conn, READ, key, self.clock_ms()).await?;
        Ok(found
            .filter(|record| !record.is_forgotten(now))
            .map(|record| Found { record, now }))
    }

    fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.waiters.subscribe(key)
    }

    async fn announce_waiter(&self, key: &RecordKey) -> Result<(), StoreError> {
        sqlx::query(ANNOUNCE)
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
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
        let mut conn = self.acquire().await?;
        let done = sqlx::query(FORGET)
            .bind(key.scope().as_bytes())
            .bind(key.key().as_bytes())
            .bind(token.0)
            .bind(state.as_str())
            .execute(&mut *conn)
            .await?;
        if done.rows_affected() != 1 {
            return Ok(false);
        }
        let named = (
            key.scope().as_bytes().to_vec(),
            key.key().as_bytes().to_vec(),
        );
        Self::wake_others(&mut conn, &[named]).await?;
        drop(conn);
        self.waiters.notify(key);
        Ok(true)
    }

    async fn erase_scope(&self, scope: &str, batch: usize) -> Result<u64, StoreError> {
        use sqlx::Connection;
        let mut conn = self.acquire().await?;
        let mut tx = conn.begin().await?;
        let keys: Vec<Vec<u8>> = sqlx::query_scalar(
            "SELECT `key` FROM idem_records WHERE scope = ? ORDER BY `key` LIMIT ? FOR UPDATE",
        )
        .bind(scope.as_bytes())
        .bind(i64::try_from(batch).unwrap_or(i64::MAX))
        .fetch_all(&mut *tx)
        .await?;
        if keys.is_empty() {
            tx.rollback().await?;
            return Ok(0);
        }
        let mut delete =
            sqlx::QueryBuilder::<sqlx::MySql>::new("DELETE FROM idem_records WHERE scope = ");
        delete.push_bind(scope.as_bytes()).push(" AND `key` IN (");
        let mut list = delete.separated(", ");
        for key in &keys {
            list.push_bind(key.as_slice());
        }
        delete.push(")");
        let erased = delete.build().execute(&mut *tx).await?.rows_affected();
        let named: Vec<(Vec<u8>, Vec<u8>)> = keys
            .iter()
            .map(|key| (scope.as_bytes().to_vec(), key.clone()))
            .collect();
        Self::wake_others(&mut tx, &named).await?;
        tx.commit().await?;
        drop(conn);
        for key in keys {
            if let Ok(key) = String::from_utf8(key) {
                self.waiters
                    .notify(&RecordKey::stored(scope.to_owned(), key));
            }
        }
        Ok(erased)
    }

    async fn list_in_flight(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> Result<(Vec<Listed>, Timestamp), StoreError> {
        let mut conn = self.acquire().await?;
        let now = self.now(&mut conn).await?;
        let rows = sqlx::query(concat!(
            "SELECT r.scope, r.`key`, ",
            record_columns!(),
            " FROM idem_records AS r WHERE r.state = 'in_flight' AND r.retain_until > ? \
             AND r.created_at <= ? ORDER BY r.created_at, r.scope, r.`key` LIMIT ?"
        ))
        .bind(now.as_millis())
        .bind(now.as_millis().saturating_sub(millis(older_than)))
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&mut *conn)
        .await?;
        let listed = rows
            .iter()
            .map(|row| {
                let part = |column: &str| -> Result<String, StoreError> {
                    let bytes: Vec<u8> = row.try_get(column).map_err(StoreError::corrupt)?;
                    String::from_utf8(bytes).map_err(StoreError::corrupt)
                };
                Ok(Listed {
                    key: RecordKey::stored(part("scope")?, part("key")?),
                    record: decode(row)?,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok((listed, now))
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let mut conn = self.acquire().await?;
        let now = self.now(&mut conn).await?;
        let row = sqlx::query(
            "SELECT
               CAST(COALESCE(SUM(retain_until <= t.n), 0) AS SIGNED) AS forgotten,
               CAST(COALESCE(SUM(retain_until > t.n AND state = 'released'), 0) AS SIGNED)
                 AS released,
               CAST(COALESCE(SUM(retain_until > t.n AND state <> 'released'
                 AND t.n >= expires_at), 0) AS SIGNED) AS expired,
               CAST(COALESCE(SUM(retain_until > t.n AND state = 'completed'
                 AND t.n < expires_at), 0) AS SIGNED) AS completed,
               CAST(COALESCE(SUM(retain_until > t.n AND state = 'in_flight'
                 AND t.n < expires_at), 0) AS SIGNED) AS in_flight,
               MIN(CASE WHEN retain_until > t.n AND state = 'in_flight' AND t.n < expires_at
                 THEN created_at END) AS oldest_in_flight
             FROM idem_records CROSS JOIN (SELECT CAST(? AS SIGNED) AS n) AS t",
        )
        .bind(now.as_millis())
        .fetch_one(&mut *conn)
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
            now,
        })
    }
}

#[async_trait::async_trait]
impl Purge for MySqlStore {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        let mut conn = self.acquire().await?;
        let batch = i64::try_from(batch).unwrap_or(i64::MAX);
        let done = sqlx::query(PURGE)
            .bind(self.clock_ms())
            .bind(batch)
            .execute(&mut *conn)
            .await?;
        // Wake-ups no poller can still need, on the server's clock (pollers read by it).
        sqlx::query(PURGE_WAKEUPS)
            .bind(millis(WAKEUP_RETENTION))
            .bind(batch)
            .execute(&mut *conn)
            .await?;
        Ok(done.rows_affected())
    }
}

impl super::tx::sealed::Sealed for MySqlStore {}
impl super::tx::sealed::Sealed for Tx<sqlx::MySql> {}

impl TxHandle for Tx<sqlx::MySql> {
    type Store = MySqlStore;

    fn from_tx(tx: Self) -> Self {
        tx
    }
}

/// Transactional mode (see [`crate::transaction`]): the business transaction is a plain one on the
/// store's pool, at the session's isolation (InnoDB's default, REPEATABLE READ, unless the
/// application sets another), and the completion is the `COMPLETE` statement inside it, with its
/// wake-up row if the record is awaited, both committed with the application's writes.
///
/// The claim commits on its own before the handler runs, so the completion updates a row that
/// exists, by its primary key: a record lock, never a gap lock, and it holds no lock the
/// application's statements could wait for before the handler's own writes. A deadlock (1213) or a
/// lock wait timeout (1205) among those writes fails the handler's statement; if the handler then
/// answers 5xx (or the commit fails), the transaction rolls back and the key is released, so the
/// retry runs again as the same record.
#[async_trait::async_trait]
impl TransactionalStore for MySqlStore {
    type Database = sqlx::MySql;

    async fn begin_tx(&self) -> Result<OpenTx<sqlx::MySql>, sqlx::Error> {
        Ok(OpenTx {
            tx: self.pool.begin().await?,
            _gate: None,
        })
    }

    async fn complete_in(
        &self,
        tx: &mut sqlx::Transaction<'static, sqlx::MySql>,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        Self::complete_on(tx, key, token, response).await
    }

    fn committed(&self, key: &RecordKey) {
        self.waiters.notify(key);
    }
}
