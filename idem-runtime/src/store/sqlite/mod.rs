//! The SQLite store: the embedded default. Durable across restarts, safe under many concurrent
//! tasks, for a service that runs as **one instance** (use PostgreSQL or Redis for several).
//!
//! ```
//! use idem_runtime::{Engine, store::sqlite::SqliteStore};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), idem_runtime::StoreError> {
//! // A file: `sqlite://path/to/idem.db?mode=rwc` (`rwc` creates it). Here, a database in memory.
//! let store = SqliteStore::connect("sqlite::memory:").await?;
//! let engine = Engine::new(store);
//! # let _ = engine;
//! # Ok(())
//! # }
//! ```
//!
//! # How the contract is kept
//!
//! - **Claim**: one `INSERT … ON CONFLICT (scope, key) DO UPDATE … WHERE <replace, take over or
//!   resume> RETURNING …, claimed_by, created_at, expires_at` applies [`Claim::decide`]'s rule
//!   atomically. A returned row means this claim won (`claimed_by` tells a takeover from a fresh or
//!   resumed record, and the times are the record's); no row means the record stays as it is, and
//!   the same call reads it by primary key, in the same transaction, for the answer. So a new key
//!   costs one trip to the database.
//!
//!   A key this process claimed lately (a retry, a waiting duplicate) is likely to stand, so its
//!   claim reads first: a record the claim keeps (completed, in flight under a live lease, another
//!   fingerprint, expired but retained) is returned from that read, which takes no write lock.
//!   Which path a key takes is only a guess, from a fixed table of the hashes of recent keys (64k
//!   slots, 512 KiB per database file); the claim statement is the check either relies on. A retry
//!   the table does not know (after a restart, or a key claimed by another process) gets the same
//!   answer from the claim's call, but waits for the write lock like a new key: behind a
//!   transactional-mode transaction, or another connection's write for up to `busy_timeout`.
//!
//!   There is no select-then-insert anywhere, and writes run as single statements in autocommit
//!   mode or in `BEGIN IMMEDIATE` transactions, which both ask for the write lock up front, so they
//!   never hit the read-to-write upgrade that makes deferred transactions fail with `SQLITE_BUSY`
//!   regardless of the busy timeout.
//! - **Complete / release / renew**: one `UPDATE` guarded by `token = ? AND state = 'in_flight'`;
//!   no row affected means [`StoreErrorKind::Fenced`](super::StoreErrorKind::Fenced). A release
//!   keeps the record, as `released` with its times, for its request's retry to resume.
//! - **Get** hides records past retention; **purge** deletes at most a batch per statement through
//!   an index on `retain_until`, so the sweeper never holds the write lock for long.
//! - **Time** is the store's: this process's clock, or the one given to
//!   [`with_clock`](SqliteStore::with_clock). Each call reads it once and sets and judges every
//!   instant by it; the engine sends durations only.
//! - **The operator's operations**: `forget` is one `DELETE` guarded by token and state;
//!   `erase_scope` deletes a batch of a scope's records through the primary key (whose first
//!   column is the scope); `list_in_flight` reads the oldest claims in flight through an index of
//!   in-flight records by creation; `stats` counts every record in one pass over the table.
//!   Forgetting and erasing wake the keys' waiters.
//!
//! # Concurrency
//!
//! SQLite has one writer at a time, and sqlx runs each statement on its connection's own thread, a
//! hand-off that costs far more than a small write. So a store's writes (claims, completions,
//! releases, renewals) go to one writer task with a connection of its own (besides the pool's),
//! which takes everything queued and applies the writes of each kind with one statement in one
//! transaction: one multi-row upsert for the claims, one `UPDATE … FROM (VALUES …)` for the
//! completions, and so on (a write alone is one statement in autocommit mode). Only once it
//! committed is each caller answered. A write that finds no record to apply to (fenced, or a claim
//! that lost) is just that write's answer. If the statement fails on one write's data (a trigger of
//! yours, a constraint), the transaction is rolled back and its writes run again one by one, so
//! that only that one fails. Two writes to one record under one token (a completion sent twice) go
//! in turn, in queue order. Before it takes a batch, the writer lets the tasks that are ready run,
//! so that writes sent at nearly the same moment share it. Under load a write waits for the batch
//! before it; alone it runs at once. Durability is unchanged: a caller told `Ok` has its write
//! committed, and a transaction that did not commit (a crash, an I/O error) answered nobody `Ok`. A
//! caller that stops waiting (a timeout) is simply not answered; its write is skipped if its batch
//! has not started, and otherwise commits or not with the others.
//!
//! Within a process, every store handle on the same database file shares one write gate (a fair
//! async mutex), taken by the writer for each batch and by [transactional
//! mode](crate::transaction) for each of the application's transactions, so idem's writes queue in
//! order instead of contending for the file lock and sleeping in SQLite's busy handler. Writes from
//! elsewhere (the application's own statements, another process) are waited out with
//! `busy_timeout` (5 s by default, see [`SqliteStore::options`]).
//!
//! Neither the writer nor the purge checkpoints the write-ahead log itself: SQLite's automatic
//! checkpoint would run inside the commit that crosses its threshold, flushing the log and the
//! database to disk while every write queued behind it waits. A checkpointer task, on a connection
//! of its own, runs a passive checkpoint every 100 ms that either wrote, beside the writer and the
//! readers. The purge turns the automatic checkpoint off on its pool connection for its statement
//! only; the pool's connections otherwise keep it, for the application's own writes.
//!
//! Reads (lookups, and the claims of keys claimed lately) go to one reader task, likewise with a
//! connection of its own, which answers everything queued with one `SELECT … WHERE (scope = ? AND
//! key = ?) OR …`. sqlx runs each statement on its connection's thread, and that hand-off, not the
//! lookup, is most of a read's cost; shared, it is paid once per batch. That hand-off is also why a
//! new key's claim skips the read: the claim's own call reads the record if the claim loses. Reads
//! never wait for the writer: under WAL they do not block on it. The pool serves transactional
//! mode, the purge, the operator's operations and the application.
//!
//! The batcher is a front end, not the store: the store's methods hand it a lookup or a write and
//! get back what the same statement run alone would answer. A store made
//! [`unbatched`](SqliteStore::unbatched) runs each of them alone on the pool.
//!
//! # Wake-ups
//!
//! A completion or release wakes the key's waiters in this process, including waiters of other
//! [`SqliteStore`] handles on the same file (they share one registry, found by the file's canonical
//! path). **Two processes on one SQLite file do not notify each other**: a waiter in another
//! process wakes when the holder's lease runs out or at its wait deadline, whichever is first, and
//! then reads the record. The claim itself stays atomic across processes; only the wake-up is late.
//! SQLite is the single-instance store.
//!
//! # Migrations
//!
//! The schema is embedded (`migrations/sqlite/` in this crate, as `sqlx::migrate!` would) and applied by
//! the constructors. sqlx 0.8 keeps every migrator's history in the one `_sqlx_migrations` table
//! (a custom table name only arrives in sqlx 0.9), so idem's migrator
//! ([`SqliteStore::migrator`]) ignores versions it does not know, and an application that keeps its
//! own tables in the same file must do the same with its migrator:
//!
//! ```no_run
//! use idem_runtime::{sqlx, store::sqlite::SqliteStore};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::connect("sqlite://app.db?mode=rwc").await?;
//! // Or `sqlx::migrate!("./migrations")` (the macro expands to `::sqlx`, so it needs a direct
//! // `sqlx = "0.8"` dependency), followed by `set_ignore_missing(true)`.
//! let mut app = sqlx::migrate::Migrator::new(std::path::Path::new("./migrations")).await?;
//! app.set_ignore_missing(true); // idem's version is in the same table
//! app.run(store.pool()).await?;
//! # Ok(())
//! # }
//! ```
//!
//! A migration that changes a constraint rebuilds `idem_records` (SQLite cannot alter one in
//! place): the records are kept, and triggers of your own on the table must be created again.

mod batch;
mod statements;

use super::tx::{OpenTx, TransactionalStore, Tx, TxHandle};
use super::{
    Claim, ClaimOutcome, ClaimRule, Found as Seen, Listed, Purge, StateKind, Stats, Store,
    StoreError, Subscription, Waiters,
};
use crate::clock::{Clock, SystemClock, Timestamp};
use crate::fingerprint::Fingerprint;
use crate::record::{FencingToken, Record, RecordKey, RecordState, StoredResponse};
use batch::Batcher;
use sqlx::migrate::Migrator;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::Row;
use statements::{
    apply, roll_back, select_many, select_where, Answer, Change, Kind, Values, Written, ERASE,
    FORGET, IN_FLIGHT, PURGE, STATS,
};
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError, Weak};
use std::time::Duration;
/// How long a statement waits for another connection's write lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// How many times a claim is retried when the record it lost to vanishes or changes before it can
/// be read (forgotten by an operator, or released, in between). Each retry needs another such
/// write to race it, so this is never reached in practice; it only rules out an unbounded loop.
const CLAIM_ATTEMPTS: usize = 8;

/// `duration` in whole milliseconds, saturating.
fn duration_millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// Every file of `migrations/sqlite/`, in order.
const MIGRATIONS: &[super::migrations::Embedded] = &[
    (
        20261130000000,
        "idem records",
        include_str!("../../../migrations/sqlite/20261130000000_idem_records.sql"),
    ),
    (
        20261207000000,
        "idem records released",
        include_str!("../../../migrations/sqlite/20261207000000_idem_records_released.sql"),
    ),
];

/// A [`Store`] on a SQLite database through sqlx. Cheap to share behind an `Arc`. Reads share
/// statements in the store's [batched lookups](self#concurrency), and writes of a kind queued
/// together share one statement.
///
/// ```
/// use idem_runtime::store::sqlite::SqliteStore;
/// use idem_runtime::sweeper::Sweeper;
/// use std::sync::Arc;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), idem_runtime::StoreError> {
/// let store = Arc::new(SqliteStore::connect("sqlite::memory:").await?);
/// let engine = idem_runtime::Engine::from_arc(store.clone());
/// // Records past retention are deleted by a sweeper the application spawns.
/// let sweeper = Sweeper::new(store.clone());
/// # let _ = (engine, sweeper);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct SqliteStore {
    pool: SqlitePool,
    shared: Arc<Shared>,
    /// The batching front end: the reader and writer tasks every lookup and write goes through,
    /// unless the store was made [`unbatched`](Self::unbatched).
    batcher: Option<Batcher>,
    /// The store's time: this process's clock.
    clock: Arc<dyn Clock>,
}

/// What every handle on one database file in this process shares.
#[derive(Debug, Default)]
struct Shared {
    waiters: Waiters,
    /// Serialises idem's writes in this process, fairly, instead of letting them race for SQLite's
    /// lock and back off in its busy handler (which sleeps in growing steps).
    /// Shared (`Arc`) so that a transaction can hold it until it ends.
    write_gate: Arc<tokio::sync::Mutex<()>>,
    /// The keys claimed lately, for [`SqliteStore::claim`] to guess which path a claim takes.
    recent: Recent,
}

/// How many keys [`Recent`] holds at most (8 bytes each).
const RECENT_SLOTS: usize = 1 << 16;

/// The keys claimed lately in this process, as hashes in a fixed table of slots: a key is forgotten
/// when another key that falls in its slot is claimed. Only a guess of whether a key's record
/// stands, so a wrong answer costs time, never correctness.
#[derive(Debug)]
struct Recent {
    hasher: RandomState,
    slots: Box<[AtomicU64]>,
}

impl Default for Recent {
    fn default() -> Self {
        Recent {
            hasher: RandomState::new(),
            slots: (0..RECENT_SLOTS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl Recent {
    /// Remembers `key`; says whether it was remembered already.
    fn insert(&self, key: &RecordKey) -> bool {
        let hash = self.hasher.hash_one((key.scope(), key.key()));
        let slot = &self.slots[hash as usize % RECENT_SLOTS];
        slot.swap(hash, Ordering::Relaxed) == hash
    }
}

/// The shared state of each open database file, by canonical path (in-memory databases by their
/// unique name). Entries go when their last store does.
static SHARED: LazyLock<Mutex<HashMap<PathBuf, Weak<Shared>>>> = LazyLock::new(Default::default);

fn shared_for(pool: &SqlitePool) -> Arc<Shared> {
    let options = pool.connect_options();
    let name = options.get_filename();
    let path = std::fs::canonicalize(name).unwrap_or_else(|_| name.to_path_buf());
    let mut map = SHARED.lock().unwrap_or_else(PoisonError::into_inner);
    map.retain(|_, shared| shared.strong_count() > 0);
    if let Some(shared) = map.get(&path).and_then(Weak::upgrade) {
        return shared;
    }
    let shared = Arc::new(Shared::default());
    map.insert(path, Arc::downgrade(&shared));
    shared
}

impl SqliteStore {
    /// Connection options for `url` with idem's settings, for [`connect_with`](Self::connect_with)
    /// after any changes of your own:
    ///
    /// - `journal_mode = WAL`: reads (lookups, replays of keys claimed lately) never block on the
    ///   writer, and a commit
    ///   appends to the log instead of rewriting pages.
    /// - `synchronous = NORMAL`: in WAL mode a commit is then not flushed to disk on its own; the
    ///   log is flushed at each checkpoint (every 100 ms that idem's writer wrote, see
    ///   [Concurrency](self#concurrency)). The database cannot be corrupted, and an application
    ///   crash loses nothing; only a power loss or OS crash may lose the last commits (each commit
    ///   holds the concurrent writes of one kind, see [Concurrency](self#concurrency)). `FULL` makes
    ///   each commit wait for an fsync (several times slower; batching shares one fsync among the
    ///   writes of a commit). If a lost record after a power cut is worse than that cost for you
    ///   (the handler's effect lives outside this file and must never run twice), set
    ///   `.synchronous(SqliteSynchronous::Full)`.
    /// - `busy_timeout = 5 s`: a statement that finds another connection writing waits for it
    ///   instead of failing with "database is locked".
    ///
    /// ```
    /// use idem_runtime::sqlx::sqlite::SqliteSynchronous;
    /// use idem_runtime::store::sqlite::SqliteStore;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idem_runtime::StoreError> {
    /// let options = SqliteStore::options("sqlite::memory:")?.synchronous(SqliteSynchronous::Full);
    /// let store = SqliteStore::connect_with(options).await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn options(url: &str) -> Result<SqliteConnectOptions, StoreError> {
        let options = SqliteConnectOptions::from_str(url)?;
        Ok(options
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT))
    }

    /// Opens the database at `url` (e.g. `sqlite://data/idem.db?mode=rwc`, or `sqlite::memory:`)
    /// with [`options`](Self::options), and applies idem's migrations.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(Self::options(url)?).await
    }

    /// Opens a pool with `options` as given, and applies idem's migrations.
    ///
    /// Connections are kept open rather than recycled on idle or age, so that an in-memory
    /// database (which lives as long as one of its connections) is never dropped under the store.
    pub async fn connect_with(options: SqliteConnectOptions) -> Result<Self, StoreError> {
        let pool = SqlitePoolOptions::new()
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options)
            .await?;
        Self::from_pool(pool).await
    }

    /// A store on an existing pool (for example the application's own, so that its tables and
    /// idem's share one file), after applying idem's migrations to it.
    ///
    /// The pool is used as configured: build it from [`options`](Self::options) to get WAL and a
    /// busy timeout. idem's reads and writes go through two more connections, which its reader
    /// and writer tasks open with the pool's connect options (see [Concurrency](self#concurrency)).
    ///
    /// Migrating in the constructor means a store that exists has its schema; the migrator only
    /// reads `_sqlx_migrations` when there is nothing to do, and its statements are idempotent.
    pub async fn from_pool(pool: SqlitePool) -> Result<Self, StoreError> {
        Self::migrator()
            .run(&pool)
            .await
            .map_err(StoreError::unavailable)?;
        let shared = shared_for(&pool);
        let batcher = Batcher::spawn(&pool, shared.write_gate.clone());
        Ok(Self {
            shared,
            pool,
            batcher: Some(batcher),
            clock: Arc::new(SystemClock),
        })
    }

    /// Runs each lookup and write as a statement of its own on the pool (writes under the write
    /// gate), instead of through the batching reader and writer (see
    /// [Concurrency](self#concurrency)): the same statements and answers, one call each, and none
    /// of the batcher's connections. Under concurrent requests this is slower; it is there to
    /// compare against, and to find whether a fault lies in the batcher.
    ///
    /// ```
    /// use idem_runtime::store::sqlite::SqliteStore;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), idem_runtime::StoreError> {
    /// let store = SqliteStore::connect("sqlite::memory:").await?.unbatched();
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn unbatched(mut self) -> Self {
        self.batcher = None;
        self
    }

    /// Judges every time by `clock` instead of the system clock (tests move a
    /// [`ManualClock`](crate::clock::ManualClock) to expire keys and leases).
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// idem's migrations, with `ignore_missing` set so that an application's migrations recorded in
    /// the same `_sqlx_migrations` table do not make it fail. The constructors run it; it is public
    /// for applications that want to list or check it.
    pub fn migrator() -> Migrator {
        super::migrations::migrator(MIGRATIONS)
    }

    /// The pool, to share with the application or to close on shutdown; closing it closes the store
    /// (its reader and writer too).
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The record of `key` (by the batcher's reader, or alone), unless past retention at `now`.
    async fn fetch(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, StoreError> {
        let found = match &self.batcher {
            Some(batcher) => batcher.read(key).await?,
            None => {
                let row = sqlx::query(&select_many(1))
                    .bind(key.scope())
                    .bind(key.key())
                    .fetch_optional(&self.pool)
                    .await?;
                row.as_ref().map(decode).transpose()?
            }
        };
        Ok(found.filter(|record| !record.is_forgotten(now)))
    }

    /// Applies `values` to `key`'s record under `token` (by the batcher's writer, or alone); its
    /// answer, once committed.
    async fn write(&self, key: &RecordKey, token: FencingToken, values: Values) -> Written {
        if let Some(batcher) = &self.batcher {
            return batcher.write(key, token, values).await;
        }
        let change = Change {
            scope: key.scope().to_owned(),
            key: key.key().to_owned(),
            token: token.0,
            values,
        };
        let sql = change.kind().transaction(1);
        let _gate = self.shared.write_gate.lock().await;
        let mut conn = self.pool.acquire().await?;
        match apply(&mut conn, &sql, &[&change]).await {
            Ok(rows) => change.answer(&rows),
            Err(error) => {
                // A claim's transaction the failed statement left open is ended; a connection
                // that cannot end it is not given back to the pool.
                if roll_back(&mut conn).await.is_err() {
                    conn.close_on_drop();
                }
                Err(error.into())
            }
        }
    }

    /// A guarded write (`token = ? AND state = 'in_flight'`): fenced if it applied to no record.
    async fn write_guarded(
        &self,
        key: &RecordKey,
        token: FencingToken,
        values: Values,
    ) -> Result<(), StoreError> {
        match self.write(key, token, values).await? {
            Answer::Applied => Ok(()),
            Answer::Won(_) | Answer::Stood(_) => Err(StoreError::fenced()),
        }
    }
}

fn corrupt(what: &str) -> StoreError {
    StoreError::corrupt(format!("idem_records: {what}"))
}

fn decode(row: &SqliteRow) -> Result<Record, StoreError> {
    let fingerprint: &[u8] = row.try_get("fingerprint").map_err(StoreError::corrupt)?;
    let fingerprint = <[u8; 32]>::try_from(fingerprint)
        .map(Fingerprint)
        .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
    let millis = |column: &str| -> Result<Timestamp, StoreError> {
        row.try_get::<i64, _>(column)
            .map(Timestamp::from_millis)
            .map_err(StoreError::corrupt)
    };
    let state: &str = row.try_get("state").map_err(StoreError::corrupt)?;
    let state = match state {
        "in_flight" => {
            let lease_until: Option<i64> =
                row.try_get("lease_until").map_err(StoreError::corrupt)?;
            RecordState::InFlight {
                lease_until: Timestamp::from_millis(
                    lease_until.ok_or_else(|| corrupt("in-flight record without lease_until"))?,
                ),
            }
        }
        "released" => RecordState::Released,
        "completed" => {
            let status: Option<i64> = row.try_get("status").map_err(StoreError::corrupt)?;
            let status = status.ok_or_else(|| corrupt("completed record without status"))?;
            let status =
                u16::try_from(status).map_err(|_| corrupt("status is not an HTTP status"))?;
            let headers: Option<&str> = row.try_get("headers").map_err(StoreError::corrupt)?;
            let headers = StoredResponse::decode_headers(headers.unwrap_or("[]"))
                .map_err(StoreError::corrupt)?;
            let body: Option<&[u8]> = row.try_get("body").map_err(StoreError::corrupt)?;
            RecordState::Completed {
                response: StoredResponse {
                    status,
                    headers,
                    body: bytes::Bytes::copy_from_slice(body.unwrap_or_default()),
                },
            }
        }
        other => return Err(corrupt(&format!("unknown state {other:?}"))),
    };
    Ok(Record {
        fingerprint,
        token: FencingToken(row.try_get("token").map_err(StoreError::corrupt)?),
        created_at: millis("created_at")?,
        expires_at: millis("expires_at")?,
        retain_until: millis("retain_until")?,
        state,
    })
}

#[async_trait::async_trait]
impl Store for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        let now = self.clock.now();
        let existing = |record| Ok(ClaimOutcome::Existing(Seen { record, now }));
        let kept = |record: &Record| claim.decide(Some(record), now) == ClaimRule::Keep;
        // A key claimed lately in this process is likely to stand (a retry, a duplicate): it is
        // read first, which under WAL takes neither the write gate nor the file's write lock, and
        // goes on to the claim statement only if the claim would change it. Any other key goes
        // straight to the claim statement. Either way that statement decides.
        if self.shared.recent.insert(claim.key) {
            if let Some(record) = self.fetch(claim.key, now).await? {
                if kept(&record) {
                    return existing(record);
                }
            }
        }
        for _ in 0..CLAIM_ATTEMPTS {
            match self
                .write(claim.key, claim.token, Values::claim(claim, now))
                .await?
            {
                Answer::Won(claimed) => return Ok(ClaimOutcome::Claimed(claimed)),
                Answer::Applied => return Err(corrupt("a claim returned no claim")),
                // Read in the upsert's transaction: a record the claim keeps, or the upsert would
                // have taken it.
                Answer::Stood(Some(record)) => return existing(record),
                // The read left the record out: it is in flight under this claim's own token (a
                // claim sent again, as the engine does after losing an answer). Read it as a
                // lookup would; claim again if it went or changed meanwhile.
                Answer::Stood(None) => match self.fetch(claim.key, now).await? {
                    Some(record) if kept(&record) => return existing(record),
                    _ => continue,
                },
            }
        }
        Err(StoreError::unavailable(format!(
            "claim of {} lost {CLAIM_ATTEMPTS} times to records deleted before they could be read",
            claim.key
        )))
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let values = Values::Complete {
            status: i64::from(response.status),
            headers: response.encode_headers(),
            body: response.body.clone(),
        };
        self.write_guarded(key, token, values).await?;
        self.shared.waiters.notify(key);
        Ok(())
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.write_guarded(key, token, Values::Release).await?;
        self.shared.waiters.notify(key);
        Ok(())
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let lease_until = self.clock.now() + lease;
        self.write_guarded(
            key,
            token,
            Values::Renew {
                lease_until: lease_until.as_millis(),
            },
        )
        .await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Seen>, StoreError> {
        let now = self.clock.now();
        let found = self.fetch(key, now).await?;
        Ok(found.map(|record| Seen { record, now }))
    }

    /// Wakes on completions and releases made through any [`SqliteStore`] on the same file in this
    /// process; not on those of another process (see the [module documentation](self)).
    fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.shared.waiters.subscribe(key)
    }

    async fn forget(
        &self,
        key: &RecordKey,
        token: FencingToken,
        state: StateKind,
    ) -> Result<bool, StoreError> {
        let done = {
            let _gate = self.shared.write_gate.lock().await;
            sqlx::query(FORGET)
                .bind(key.scope())
                .bind(key.key())
                .bind(token.0)
                .bind(state.as_str())
                .execute(&self.pool)
                .await?
        };
        let deleted = done.rows_affected() > 0;
        if deleted {
            self.shared.waiters.notify(key);
        }
        Ok(deleted)
    }

    async fn erase_scope(&self, scope: &str, batch: usize) -> Result<u64, StoreError> {
        let limit = i64::try_from(batch).unwrap_or(i64::MAX);
        let keys: Vec<String> = {
            let _gate = self.shared.write_gate.lock().await;
            sqlx::query_scalar(ERASE)
                .bind(scope)
                .bind(limit)
                .fetch_all(&self.pool)
                .await?
        };
        for key in &keys {
            let key = RecordKey::stored(scope.to_owned(), key.clone());
            self.shared.waiters.notify(&key);
        }
        Ok(keys.len() as u64)
    }

    async fn list_in_flight(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> Result<(Vec<Listed>, Timestamp), StoreError> {
        let now = self.clock.now();
        // Created at or before `now - older_than`; any age at all when it is zero, as a record
        // created after `now` (on another clock) counts as being zero old.
        let before = match older_than.is_zero() {
            true => i64::MAX,
            false => now.as_millis().saturating_sub(duration_millis(older_than)),
        };
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = sqlx::query(&select_where(IN_FLIGHT))
            .bind(now.as_millis())
            .bind(before)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        let listed = rows
            .iter()
            .map(|row| {
                let scope: String = row.try_get("scope").map_err(StoreError::corrupt)?;
                let key: String = row.try_get("key").map_err(StoreError::corrupt)?;
                Ok(Listed {
                    key: RecordKey::stored(scope, key),
                    record: decode(row)?,
                })
            })
            .collect::<Result<_, StoreError>>()?;
        Ok((listed, now))
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let now = self.clock.now();
        let row = sqlx::query(STATS)
            .bind(now.as_millis())
            .fetch_one(&self.pool)
            .await?;
        let count = |column: &str| -> Result<u64, StoreError> {
            let n: Option<i64> = row.try_get(column).map_err(StoreError::corrupt)?;
            Ok(u64::try_from(n.unwrap_or(0)).unwrap_or(0))
        };
        let oldest: Option<i64> = row.try_get("oldest").map_err(StoreError::corrupt)?;
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

impl super::tx::sealed::Sealed for SqliteStore {}
impl super::tx::sealed::Sealed for Tx<sqlx::Sqlite> {}

impl TxHandle for Tx<sqlx::Sqlite> {
    type Store = SqliteStore;

    fn from_tx(tx: Self) -> Self {
        tx
    }
}

/// Transactional mode (see [`crate::transaction`]): `BEGIN IMMEDIATE` after the store's write gate,
/// which the transaction holds until it ends, so that idem's own writes in this process queue
/// behind it instead of sleeping in SQLite's busy handler.
#[async_trait::async_trait]
impl TransactionalStore for SqliteStore {
    type Database = sqlx::Sqlite;

    async fn begin_tx(&self) -> Result<OpenTx<sqlx::Sqlite>, sqlx::Error> {
        let gate = tokio::time::timeout(BUSY_TIMEOUT, self.shared.write_gate.clone().lock_owned())
            .await
            .map_err(|_| sqlx::Error::PoolTimedOut)?;
        let tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        Ok(OpenTx {
            tx,
            _gate: Some(gate),
        })
    }

    async fn complete_in(
        &self,
        tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let row = Change {
            scope: key.scope().to_owned(),
            key: key.key().to_owned(),
            token: token.0,
            values: Values::Complete {
                status: i64::from(response.status),
                headers: response.encode_headers(),
                body: response.body.clone(),
            },
        };
        let sql = Kind::Complete.statement(1);
        let done = row
            .bind(sqlx::query(&sql))
            .fetch_optional(&mut **tx)
            .await?;
        match done {
            Some(_) => Ok(()),
            None => Err(StoreError::fenced()),
        }
    }

    fn committed(&self, key: &RecordKey) {
        self.shared.waiters.notify(key);
    }
}

#[async_trait::async_trait]
impl Purge for SqliteStore {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        let now = self.clock.now();
        let limit = i64::try_from(batch).unwrap_or(i64::MAX);
        let _gate = self.shared.write_gate.lock().await;
        let purge = sqlx::query(PURGE).bind(now.as_millis()).bind(limit);
        let Some(batcher) = &self.batcher else {
            return Ok(purge.execute(&self.pool).await?.rows_affected());
        };
        // A batch deletes rows all over the key index, so its commit is the one that crosses
        // SQLite's automatic checkpoint threshold, and would flush the log while the requests'
        // writes wait for the gate. As for the writer, the checkpointer does that instead.
        let mut conn = self.pool.acquire().await?;
        let before: i64 = sqlx::query_scalar("PRAGMA wal_autocheckpoint")
            .fetch_one(&mut *conn)
            .await?;
        sqlx::query("PRAGMA wal_autocheckpoint = 0")
            .execute(&mut *conn)
            .await?;
        let done = purge.execute(&mut *conn).await;
        let restored = sqlx::query(&format!("PRAGMA wal_autocheckpoint = {before}"))
            .execute(&mut *conn)
            .await;
        if restored.is_err() {
            // Not back in the pool with its checkpoints off.
            conn.close_on_drop();
        }
        batcher.wrote();
        Ok(done?.rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Claimed;
    use std::future::Future;
    use std::sync::atomic::{AtomicUsize, Ordering};

    pub(super) const NOW: Timestamp = Timestamp::from_millis(1_000_000);

    pub(super) async fn temp_store() -> (tempfile::TempDir, String, SqliteStore) {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("idem.db").display());
        let store = SqliteStore::connect(&url)
            .await
            .expect("connect")
            .with_clock(crate::clock::ManualClock::new(NOW));
        (
            dir,
            url,
            store.with_clock(crate::clock::ManualClock::new(NOW)),
        )
    }

    pub(super) fn claim<'a>(key: &'a RecordKey, fingerprint: u8) -> Claim<'a> {
        Claim {
            key,
            fingerprint: Fingerprint([fingerprint; 32]),
            token: FencingToken::generate(),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
            retain: Duration::from_secs(7200),
        }
    }

    async fn plan(store: &SqliteStore, sql: &str, binds: usize) -> String {
        // EXPLAIN QUERY PLAN rows are (id, parent, notused, detail).
        let explain = format!("EXPLAIN QUERY PLAN {sql}");
        let mut q = sqlx::query(&explain);
        for i in 0..binds {
            q = q.bind(i as i64);
        }
        let rows = q.fetch_all(store.pool()).await.expect("explain");
        rows.iter()
            .map(|r| r.get::<String, _>(3))
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[tokio::test]
    async fn connections_use_wal_normal_sync_and_a_busy_timeout() {
        let (_dir, _url, store) = temp_store().await;
        let mut conn = store.pool().acquire().await.expect("acquire");
        let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(&mut *conn)
            .await
            .expect("journal_mode");
        assert_eq!(mode, "wal");
        let sync: i64 = sqlx::query_scalar("PRAGMA synchronous")
            .fetch_one(&mut *conn)
            .await
            .expect("synchronous");
        assert_eq!(sync, 1, "NORMAL");
        let busy: i64 = sqlx::query_scalar("PRAGMA busy_timeout")
            .fetch_one(&mut *conn)
            .await
            .expect("busy_timeout");
        assert_eq!(busy, 5000);
    }

    /// The purge turns its connection's automatic checkpoints off for its statement only: every
    /// connection the pool hands out afterwards checkpoints as it did before.
    #[tokio::test]
    async fn a_purge_gives_its_connection_back_as_it_found_it() {
        let (_dir, _url, store) = temp_store().await;
        sqlx::query(
            r#"
            WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 2499)
            INSERT INTO idem_records
                (scope, key, fingerprint, token, created_at, expires_at, retain_until, state)
            SELECT 'old', 'k' || i, zeroblob(32), i, 0, 10, 20, 'completed' FROM n
            "#,
        )
        .execute(store.pool())
        .await
        .expect("bulk insert");
        let mut purged = 0;
        for _ in 0..3 {
            purged += store.purge_expired(1_000).await.expect("purge");
        }
        assert_eq!(purged, 2_500);
        let size = store.pool().size() as usize;
        let mut held = Vec::new();
        for _ in 0..size {
            held.push(store.pool().acquire().await.expect("acquire"));
        }
        for conn in &mut held {
            let every: i64 = sqlx::query_scalar("PRAGMA wal_autocheckpoint")
                .fetch_one(&mut **conn)
                .await
                .expect("wal_autocheckpoint");
            assert_eq!(every, 1_000, "SQLite's default, as the pool opened it");
        }
    }

    /// With 10k rows, the purge finds its batch through the retain_until index and lookups go by
    /// primary key; neither scans the table.
    #[tokio::test]
    async fn purge_and_lookups_use_indexes() {
        let (_dir, _url, store) = temp_store().await;
        // 10,000 rows: even ones past retention at NOW, odd ones live.
        sqlx::query(
            r#"
            WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 9999)
            INSERT INTO idem_records
                (scope, key, fingerprint, token, created_at, expires_at, retain_until, state, lease_until)
            SELECT 'bulk', 'k' || i, zeroblob(32), i, 0, 10, CASE i % 2 WHEN 0 THEN 20 ELSE ?1 END,
                   'in_flight', 5
            FROM n
            "#,
        )
        .bind(NOW.as_millis() * 2)
        .execute(store.pool())
        .await
        .expect("bulk insert");

        // With statistics, as `ANALYZE` or `PRAGMA optimize` leave them, whose row counts the
        // planner weighs against the statement's.
        sqlx::query("ANALYZE")
            .execute(store.pool())
            .await
            .expect("analyze");
        let purge = plan(&store, PURGE, 2).await;
        assert!(purge.contains("idem_records_retain_until"), "{purge}");
        // The operator's statements: by the primary key, or the in-flight index, never a scan.
        let in_flight = plan(&store, &select_where(IN_FLIGHT), 3).await;
        assert!(
            in_flight.contains("USING INDEX idem_records_in_flight")
                && !in_flight.contains("SCAN idem_records")
                && !in_flight.contains("TEMP B-TREE"),
            "{in_flight}"
        );
        for sql in [ERASE, FORGET] {
            let found = plan(&store, sql, sql.matches('?').count()).await;
            assert!(
                found.contains("INDEX sqlite_autoindex_idem_records_1 (scope=?")
                    && !found.contains("SCAN idem_records"),
                "{found}"
            );
        }
        for n in [1, 8] {
            let select = plan(&store, &select_many(n), 2 * n).await;
            assert!(
                select.contains("SEARCH idem_records USING INDEX sqlite_autoindex_idem_records_1")
                    && !select.contains("SCAN idem_records"),
                "{select}"
            );
            // Each kind of write finds its records by primary key. (The claim's conflict check
            // goes through the primary key's index too, but an upsert has no plan rows of its own;
            // the index is checked to be (scope, key) below.)
            // As many placeholders as `apply` binds (sqlx would bind a missing one as NULL).
            for (kind, binds) in [(Kind::Claim, 11), (Kind::Complete, 6), (Kind::Renew, 4)] {
                assert_eq!(
                    kind.transaction(n).matches('?').count(),
                    binds * n,
                    "{kind:?}"
                );
            }
            assert_eq!(Kind::Release.transaction(n).matches('?').count(), 3 * n);
            for kind in [Kind::Claim, Kind::Complete, Kind::Renew, Kind::Release] {
                let statement = kind.statement(n);
                // A claim's call goes on to read the records of the claims that lost.
                let (sql, read) = statement.split_once(';').unwrap_or((&statement, ""));
                if !read.is_empty() {
                    let read = plan(&store, read, read.matches('?').count()).await;
                    assert!(
                        read.contains("idem_records USING INDEX sqlite_autoindex_idem_records_1")
                            && !read.contains("SCAN idem_records"),
                        "{kind:?} read: {read}"
                    );
                }
                let write = plan(&store, sql, sql.matches('?').count()).await;
                assert!(!write.contains("SCAN idem_records"), "{kind:?}: {write}");
                if kind != Kind::Claim {
                    assert!(
                        write.contains("idem_records USING INDEX sqlite_autoindex_idem_records_1"),
                        "{kind:?}: {write}"
                    );
                }
            }
        }
        let pk: Vec<String> = sqlx::query_scalar(
            "SELECT name FROM pragma_index_info('sqlite_autoindex_idem_records_1') ORDER BY seqno",
        )
        .fetch_all(store.pool())
        .await
        .expect("index info");
        assert_eq!(pk, ["scope", "key"]);

        let mut purged = 0;
        loop {
            let n = store.purge_expired(1_000).await.expect("purge");
            assert!(n <= 1_000, "a batch is capped");
            if n == 0 {
                break;
            }
            purged += n;
        }
        assert_eq!(purged, 5_000);
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_records")
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(left, 5_000);
    }

    /// 64 tasks on 64 keys and 64 tasks on one key, over two handles on one file: every claim
    /// succeeds (no "database is locked"), and the shared key has exactly one winner.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_claims_never_fail_with_busy() {
        let (_dir, url, first) = temp_store().await;
        let second = SqliteStore::connect(&url)
            .await
            .expect("second handle")
            .with_clock(crate::clock::ManualClock::new(NOW));
        let stores = [Arc::new(first), Arc::new(second)];
        let barrier = Arc::new(tokio::sync::Barrier::new(128));
        let winners = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for i in 0..128 {
            let store = stores[i % 2].clone();
            let (barrier, winners) = (barrier.clone(), winners.clone());
            tasks.push(tokio::spawn(async move {
                let key = if i < 64 {
                    RecordKey::new("distinct", format!("k{i}"))
                } else {
                    RecordKey::new("shared", "one")
                };
                barrier.wait().await;
                let outcome = store.claim(&claim(&key, 1)).await;
                match outcome {
                    Ok(ClaimOutcome::Claimed(Claimed { taken_over, .. })) => {
                        assert!(!taken_over);
                        if i >= 64 {
                            winners.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    Ok(ClaimOutcome::Existing(Seen { record, .. })) => {
                        assert!(i >= 64, "distinct key {i} found {record:?}")
                    }
                    Err(e) => panic!("claim {i} failed: {e}"),
                }
            }));
        }
        for task in tasks {
            task.await.expect("join");
        }
        assert_eq!(winners.load(Ordering::SeqCst), 1);
    }

    /// Another connection holding the write lock (the application's own transaction, or another
    /// process) makes a claim wait for it, not fail.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_wait_out_another_writer() {
        let (_dir, url, store) = temp_store().await;
        let store = Arc::new(store);
        let other = SqlitePool::connect_with(SqliteStore::options(&url).expect("options"))
            .await
            .expect("other pool");
        let mut writer = other.acquire().await.expect("acquire");
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut *writer)
            .await
            .expect("lock");
        let mut tasks = Vec::new();
        for i in 0..8 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                let key = RecordKey::new("blocked", format!("k{i}"));
                store.claim(&claim(&key, 1)).await
            }));
        }
        // Wait until a claim holds the write gate, i.e. is inside its statement, blocked on the lock.
        // (The timeout only turns a hang into a failure if no claim ever gets there.)
        tokio::time::timeout(Duration::from_secs(60), async {
            while store.shared.write_gate.try_lock().is_ok() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("a claim reached the locked database");
        // None has finished: none failed fast with SQLITE_BUSY, none got past the lock.
        assert!(tasks.iter().all(|task| !task.is_finished()));
        sqlx::query("COMMIT")
            .execute(&mut *writer)
            .await
            .expect("unlock");
        for task in tasks {
            let outcome = task.await.expect("join").expect("claim waited, not failed");
            assert!(matches!(
                outcome,
                ClaimOutcome::Claimed(Claimed {
                    taken_over: false,
                    ..
                })
            ));
        }
    }

    pub(super) type Boxed<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;
    pub(super) type Pending<'a> = Boxed<'a, Result<(), StoreError>>;

    /// Polls each write once, which queues it for the writer (still waiting for the gate).
    pub(super) fn queue<T>(writes: &mut [Boxed<'_, T>]) {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        for write in writes {
            assert!(
                write.as_mut().poll(&mut cx).is_pending(),
                "answered before its commit"
            );
        }
    }

    pub(super) async fn claimed(store: &SqliteStore, keys: &[RecordKey]) -> Vec<FencingToken> {
        let mut tokens = Vec::new();
        for key in keys {
            let c = claim(key, 1);
            store.claim(&c).await.expect("claim");
            tokens.push(c.token);
        }
        tokens
    }

    pub(super) fn response() -> StoredResponse {
        StoredResponse {
            status: 200,
            headers: vec![],
            body: bytes::Bytes::from_static(b"done"),
        }
    }

    pub(super) async fn is_completed(store: &SqliteStore, key: &RecordKey) -> bool {
        let record = store
            .get(key)
            .await
            .map(|found| found.map(|f| f.record))
            .expect("get")
            .expect("record");
        matches!(record.state, RecordState::Completed { .. })
    }

    /// A key this process has not claimed goes straight to the claim statement: one the database
    /// already holds (from before a restart) is answered with its record, untouched, whether the
    /// request is the same or another, and even to a claim under the record's own token (an engine
    /// claiming again after an answer it lost), completed or in flight.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_after_a_restart_finds_the_record() {
        let (_dir, url, store) = temp_store().await;
        let key = RecordKey::new("restart", "k");
        let first = claim(&key, 1);
        assert!(matches!(
            store.claim(&first).await.expect("claim"),
            ClaimOutcome::Claimed(_)
        ));
        store
            .complete(&key, first.token, &response())
            .await
            .expect("complete");
        let before = store
            .get(&key)
            .await
            .map(|found| found.map(|f| f.record))
            .expect("get")
            .expect("record");
        drop(store);
        let store = SqliteStore::connect(&url)
            .await
            .expect("reopen")
            .with_clock(crate::clock::ManualClock::new(NOW));
        let same_token = Claim { ..first };
        for retry in [same_token, claim(&key, 1), claim(&key, 2)] {
            match store.claim(&retry).await.expect("claim") {
                ClaimOutcome::Existing(Seen { record, .. }) => assert_eq!(record, before),
                other => panic!("{other:?}"),
            }
        }
        // A record in flight under the claim's own token, which the claim's read leaves out.
        let running = RecordKey::new("restart", "running");
        let held = claim(&running, 1);
        let reopened = SqliteStore::connect(&url)
            .await
            .expect("another handle")
            .with_clock(crate::clock::ManualClock::new(NOW));
        sqlx::query(
            "INSERT INTO idem_records (scope, key, token, fingerprint, created_at, expires_at,
                 retain_until, state, lease_until)
             VALUES (?, ?, ?, ?, ?, ?, ?, 'in_flight', ?)",
        )
        .bind(running.scope())
        .bind(running.key())
        .bind(held.token.0)
        .bind(&held.fingerprint.0[..])
        .bind(NOW.as_millis())
        .bind((NOW + held.ttl).as_millis())
        .bind((NOW + held.retain).as_millis())
        .bind((NOW + held.lease).as_millis())
        .execute(reopened.pool())
        .await
        .expect("insert");
        match store.claim(&Claim { ..held }).await.expect("claim") {
            ClaimOutcome::Existing(Seen { record, .. }) => assert_eq!(record.token, held.token),
            other => panic!("{other:?}"),
        }
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_records")
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(rows, 2);
        assert_eq!(
            store
                .get(&key)
                .await
                .map(|found| found.map(|f| f.record))
                .expect("get"),
            Some(before)
        );
    }

    /// A replay of a key claimed lately (and any such record that stands) is answered while another
    /// connection holds the write lock: it is a plain read, so it neither takes the write gate nor
    /// waits for the writer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replays_are_read_past_a_writer() {
        let (_dir, url, store) = temp_store().await;
        let key = RecordKey::new("s", "done");
        let first = claim(&key, 1);
        store.claim(&first).await.expect("claim");
        let response = StoredResponse {
            status: 201,
            headers: vec![],
            body: bytes::Bytes::from_static(b"ok"),
        };
        store
            .complete(&key, first.token, &response)
            .await
            .expect("complete");
        let other = SqlitePool::connect_with(SqliteStore::options(&url).expect("options"))
            .await
            .expect("other pool");
        let mut writer = other.acquire().await.expect("acquire");
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut *writer)
            .await
            .expect("lock");
        // Held throughout: a claim that needed the lock would wait out the busy timeout and fail.
        match store.claim(&claim(&key, 1)).await.expect("answered") {
            ClaimOutcome::Existing(Seen { record, .. }) => {
                assert_eq!(record.state, RecordState::Completed { response })
            }
            other => panic!("expected the completed record, got {other:?}"),
        }
        sqlx::query("COMMIT")
            .execute(&mut *writer)
            .await
            .expect("unlock");
    }

    /// The operator's operations judge by the store's clock: a record past retention that no sweep
    /// deleted counts as forgotten and is not listed, one past its expiry counts as expired; erasing
    /// a scope wakes its keys' waiters, and forgetting a record that changed since it was read
    /// deletes nothing.
    #[tokio::test]
    async fn operators_count_list_erase_and_forget_at_the_stores_time() {
        let clock = crate::clock::ManualClock::new(NOW);
        let (_dir, _url, store) = temp_store().await;
        let store = store.with_clock(clock.clone());
        let short = |key| Claim {
            ttl: Duration::from_secs(10),
            retain: Duration::from_secs(20),
            ..claim(key, 1)
        };
        let (gone, stale, live) = (
            RecordKey::new("a", "gone"),
            RecordKey::new("a", "stale"),
            RecordKey::new("b", "live"),
        );
        store.claim(&short(&gone)).await.expect("claim");
        clock.advance(Duration::from_secs(5));
        let stale_claim = short(&stale);
        store.claim(&stale_claim).await.expect("claim");
        store.claim(&claim(&live, 1)).await.expect("claim");
        // `gone` is past retention, `stale` past its expiry, `live` in flight.
        clock.advance(Duration::from_secs(16));
        let stats = store.stats().await.expect("stats");
        assert_eq!(
            stats,
            Stats {
                in_flight: 1,
                completed: 0,
                released: 0,
                expired: 1,
                forgotten: 1,
                oldest_in_flight: Some(NOW + Duration::from_secs(5)),
                now: clock.now(),
            }
        );
        let (listed, now) = store
            .list_in_flight(Duration::ZERO, 10)
            .await
            .expect("list");
        assert_eq!(now, clock.now());
        let keys: Vec<&RecordKey> = listed.iter().map(|l| &l.key).collect();
        assert_eq!(keys, [&stale, &live], "the forgotten record is not listed");

        let forgot = store
            .forget(&stale, stale_claim.token, StateKind::Completed)
            .await
            .expect("forget");
        assert!(!forgot, "the record is in flight, not completed");
        let mut woken = store.subscribe(&gone);
        assert_eq!(store.erase_scope("a", 1).await.expect("erase"), 1);
        assert_eq!(store.erase_scope("a", 10).await.expect("erase"), 1);
        assert_eq!(store.erase_scope("a", 10).await.expect("erase"), 0);
        woken.changed().await;
        let rows: Vec<String> = sqlx::query_scalar("SELECT scope FROM idem_records")
            .fetch_all(store.pool())
            .await
            .expect("rows");
        assert_eq!(rows, ["b"], "another scope's record kept");
    }

    /// Unbatched, a claim whose statement fails (a trigger here) fails alone and its transaction is
    /// ended: the pool's one connection serves the next claim, and the store's answers are those of
    /// the batched path.
    #[tokio::test]
    async fn unbatched_a_failing_claim_ends_its_transaction() {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("idem.db").display());
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(SqliteStore::options(&url).expect("options"))
            .await
            .expect("pool");
        let store = SqliteStore::from_pool(pool)
            .await
            .expect("store")
            .with_clock(crate::clock::ManualClock::new(NOW))
            .unbatched();
        sqlx::query(
            "CREATE TRIGGER poison BEFORE INSERT ON idem_records WHEN NEW.key = 'bad'
             BEGIN SELECT RAISE(ABORT, 'poisoned'); END",
        )
        .execute(store.pool())
        .await
        .expect("trigger");
        let bad = RecordKey::new("s", "bad");
        let failed = store.claim(&claim(&bad, 1)).await.expect_err("poisoned");
        assert_eq!(failed.kind(), super::super::StoreErrorKind::Unavailable);
        let good = RecordKey::new("s", "good");
        let first = claim(&good, 1);
        assert!(matches!(
            store.claim(&first).await.expect("claim"),
            ClaimOutcome::Claimed(Claimed {
                taken_over: false,
                created_at: NOW,
                ..
            })
        ));
        match store.claim(&claim(&good, 1)).await.expect("claim") {
            ClaimOutcome::Existing(Seen { record, now }) => {
                assert_eq!((record.token, now), (first.token, NOW))
            }
            other => panic!("{other:?}"),
        }
        store
            .complete(&good, first.token, &response())
            .await
            .expect("complete");
        assert!(is_completed(&store, &good).await);
        let fenced = store.release(&good, first.token).await.expect_err("done");
        assert_eq!(fenced.kind(), super::super::StoreErrorKind::Fenced);
    }

    /// A database made by the first migration alone (idem before released records) upgrades when
    /// a store opens it: its records are kept as they were, the table then holds released records,
    /// and its indexes are there under their names.
    #[tokio::test]
    async fn an_existing_database_upgrades_and_keeps_its_records() {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("old.db").display());
        let pool = SqlitePool::connect_with(SqliteStore::options(&url).expect("options"))
            .await
            .expect("pool");
        super::super::migrations::migrator(&MIGRATIONS[..1])
            .run(&pool)
            .await
            .expect("the first migration");
        let fp = [9u8; 32];
        for (key, state, lease, status, takeovers) in [
            (
                "running",
                "in_flight",
                Some(NOW.as_millis() + 30_000),
                None,
                2,
            ),
            ("done", "completed", None, Some(201), 0),
        ] {
            sqlx::query(
                "INSERT INTO idem_records (scope, key, fingerprint, token, created_at, expires_at,
                     retain_until, state, lease_until, takeovers, status, headers, body)
                 VALUES ('old', ?, ?, 7, ?, ?, ?, ?, ?, ?, ?, '[]', x'6f6b')",
            )
            .bind(key)
            .bind(&fp[..])
            .bind(NOW.as_millis())
            .bind(NOW.as_millis() + 3_600_000)
            .bind(NOW.as_millis() + 7_200_000)
            .bind(state)
            .bind(lease)
            .bind(takeovers)
            .bind(status)
            .execute(&pool)
            .await
            .expect("old row");
        }
        // A released record cannot be stored before the upgrade.
        let refused = sqlx::query("UPDATE idem_records SET state = 'released' WHERE key = 'done'")
            .execute(&pool)
            .await;
        assert!(refused.is_err(), "the old table's check");

        let store = SqliteStore::from_pool(pool.clone())
            .await
            .expect("upgraded")
            .with_clock(crate::clock::ManualClock::new(NOW));
        let running = RecordKey::new("old", "running");
        let found = store.get(&running).await.expect("get").expect("kept");
        assert_eq!(
            found.record,
            Record {
                fingerprint: Fingerprint(fp),
                token: FencingToken(7),
                created_at: NOW,
                expires_at: NOW + Duration::from_secs(3600),
                retain_until: NOW + Duration::from_secs(7200),
                state: RecordState::InFlight {
                    lease_until: NOW + Duration::from_secs(30)
                },
            }
        );
        let done = store
            .get(&RecordKey::new("old", "done"))
            .await
            .expect("get")
            .expect("kept");
        assert_eq!(
            done.record.state,
            RecordState::Completed {
                response: StoredResponse {
                    status: 201,
                    headers: vec![],
                    body: bytes::Bytes::from_static(b"ok"),
                }
            }
        );
        store
            .release(&running, FencingToken(7))
            .await
            .expect("release");
        let found = store.get(&running).await.expect("get").expect("kept");
        assert_eq!(found.record.state, RecordState::Released);
        // The old record's takeovers do not make its resumption one.
        let resumed = Claim {
            fingerprint: Fingerprint(fp),
            ..claim(&running, 1)
        };
        match store.claim(&resumed).await.expect("claim") {
            ClaimOutcome::Claimed(claimed) => assert_eq!(
                claimed,
                Claimed {
                    taken_over: false,
                    created_at: NOW,
                    expires_at: NOW + Duration::from_secs(3600),
                }
            ),
            other => panic!("{other:?}"),
        }
        let indexes: Vec<String> = sqlx::query_scalar(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'idem_records'
             ORDER BY name",
        )
        .fetch_all(&pool)
        .await
        .expect("indexes");
        assert_eq!(
            indexes,
            [
                "idem_records_in_flight",
                "idem_records_retain_until",
                "sqlite_autoindex_idem_records_1"
            ]
        );
        let versions: Vec<i64> =
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations ORDER BY version")
                .fetch_all(&pool)
                .await
                .expect("versions");
        assert_eq!(versions, [20261130000000, 20261207000000]);
        let tables: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name LIKE 'idem_records%'",
        )
        .fetch_one(&pool)
        .await
        .expect("tables");
        assert_eq!(tables, 1, "no table left over from the rebuild");
    }

    /// An application's migrator and idem's share `_sqlx_migrations`; with `ignore_missing` on both
    /// sides they run in any order, any number of times.
    #[tokio::test]
    async fn migrations_coexist_with_the_applications() {
        let dir = tempfile::tempdir().expect("temp dir");
        let migrations = dir.path().join("migrations");
        std::fs::create_dir(&migrations).expect("mkdir");
        std::fs::write(
            migrations.join("20200101000000_ledger.sql"),
            "CREATE TABLE ledger (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL);",
        )
        .expect("write migration");
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("app.db").display());
        let pool = SqlitePool::connect_with(SqliteStore::options(&url).expect("options"))
            .await
            .expect("pool");

        let mut app = Migrator::new(migrations.as_path())
            .await
            .expect("app migrator");
        app.run(&pool).await.expect("app first");
        let store = SqliteStore::from_pool(pool.clone())
            .await
            .expect("idem ignores the app's version");
        // Without ignore_missing the application's migrator refuses idem's version...
        assert!(matches!(
            app.run(&pool).await,
            Err(sqlx::migrate::MigrateError::VersionMissing(_))
        ));
        // ...and with it, both run again.
        app.set_ignore_missing(true);
        app.run(&pool).await.expect("app again");
        SqliteStore::from_pool(pool.clone())
            .await
            .expect("idem again");
        let key = RecordKey::new("s", "k");
        assert!(matches!(
            store.claim(&claim(&key, 1)).await.expect("claim"),
            ClaimOutcome::Claimed(Claimed {
                taken_over: false,
                ..
            })
        ));
        sqlx::query("INSERT INTO ledger (amount) VALUES (1000)")
            .execute(&pool)
            .await
            .expect("ledger");
    }

    #[tokio::test]
    async fn undecodable_rows_are_corrupt_not_unavailable() {
        let (_dir, _url, store) = temp_store().await;
        let key = RecordKey::new("s", "k");
        store.claim(&claim(&key, 1)).await.expect("claim");
        sqlx::query("UPDATE idem_records SET fingerprint = x'00'")
            .execute(store.pool())
            .await
            .expect("damage");
        let err = store
            .get(&key)
            .await
            .map(|found| found.map(|f| f.record))
            .expect_err("corrupt");
        assert_eq!(err.kind(), super::super::StoreErrorKind::Corrupt);
        let err = store.claim(&claim(&key, 1)).await.expect_err("corrupt");
        assert_eq!(err.kind(), super::super::StoreErrorKind::Corrupt);
    }

    #[tokio::test]
    async fn in_memory_databases_work_and_stay_apart() {
        let a = SqliteStore::connect("sqlite::memory:").await.expect("a");
        let b = SqliteStore::connect("sqlite::memory:").await.expect("b");
        let key = RecordKey::new("s", "k");
        assert!(matches!(
            a.claim(&claim(&key, 1)).await.expect("claim a"),
            ClaimOutcome::Claimed(Claimed {
                taken_over: false,
                ..
            })
        ));
        assert!(matches!(
            b.claim(&claim(&key, 1)).await.expect("claim b"),
            ClaimOutcome::Claimed(Claimed {
                taken_over: false,
                ..
            })
        ));
        assert!(!Arc::ptr_eq(&a.shared, &b.shared));
    }
}

/// The handler's transaction handle, lent and given back (`transaction.rs`).
#[cfg(all(test, feature = "axum"))]
mod lent_transactions {
    use super::SqliteStore;
    use crate::transaction::{Transactional, Tx};
    async fn handle() -> Tx<sqlx::Sqlite> {
        let store = SqliteStore::connect("sqlite::memory:")
            .await
            .expect("store");
        Transactional::new(store).tx()
    }

    /// The handler's `async move` block owns the lent handle; the transaction comes back when the
    /// block ends, begun or not.
    #[tokio::test]
    async fn a_lent_transaction_comes_back_when_the_body_ends() {
        let mut tx = handle().await;
        let (lent, back) = tx.lend();
        let body = |mut tx: Tx<sqlx::Sqlite>| async move {
            sqlx::query("SELECT 1")
                .execute(tx.conn().await.expect("begin"))
                .await
                .expect("query");
        };
        body(lent).await;
        assert!(back.restore(&mut tx));
        assert!(tx.is_begun());

        let mut tx = handle().await;
        let (lent, back) = tx.lend();
        let ignores_it = |_tx: Tx<sqlx::Sqlite>| async move {};
        ignores_it(lent).await;
        assert!(back.restore(&mut tx));
        assert!(!tx.is_begun(), "a handler that never wrote began nothing");
    }

    /// A body that moves the handle somewhere that outlives it leaves nothing to commit.
    #[tokio::test]
    async fn a_kept_transaction_is_reported() {
        let mut tx = handle().await;
        let (lent, back) = tx.lend();
        let kept = std::sync::Mutex::new(Vec::new());
        let body = |tx: Tx<sqlx::Sqlite>| {
            kept.lock().expect("lock").push(tx);
            async move {}
        };
        body(lent).await;
        assert!(!back.restore(&mut tx));
    }
}
