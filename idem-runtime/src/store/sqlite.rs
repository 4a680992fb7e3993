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
//!   `erase_scope` deletes a batch of a scope's records through the primary key (whose first column
//!   is the scope); `list_in_flight` reads the oldest claims in flight through an index of in-flight
//!   records by creation; `stats` counts every record in one pass over the table. Forgetting and
//!   erasing wake the keys' waiters.
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
//! Reads (lookups, and the claims of keys claimed lately) go to one reader task, likewise with a
//! connection of its own, which answers everything queued with one `SELECT … WHERE (scope = ? AND
//! key = ?) OR …`. sqlx runs each statement on its connection's thread, and that hand-off, not the
//! lookup, is most of a read's cost; shared, it is paid once per batch. That hand-off is also why a
//! new key's claim skips the read: the claim's own call reads the record if the claim loses. Reads
//! never wait for the writer: under WAL they do not block on it. The pool serves transactional
//! mode, the purge and the application.
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

use super::tx::{OpenTx, TransactionalStore, Tx, TxHandle};
use super::{
    Claim, ClaimOutcome, ClaimRule, Claimed, Found as Seen, Listed, Purge, StateKind, Stats, Store,
    StoreError, Subscription, Waiters,
};
use crate::clock::{Clock, SystemClock, Timestamp};
use crate::fingerprint::Fingerprint;
use crate::record::{FencingToken, Record, RecordKey, RecordState, StoredResponse};
use sqlx::migrate::Migrator;
use sqlx::query::Query;
use sqlx::sqlite::{
    SqliteArguments, SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool,
    SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};
use sqlx::{ConnectOptions, Row};
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError, Weak};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// How long a statement waits for another connection's write lock before failing.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// How many times a claim is retried when the record it lost to vanishes or changes before it can
/// be read (forgotten by an operator, or released, in between). Each retry needs another such
/// write to race it, so this is never reached in practice; it only rules out an unbounded loop.
const CLAIM_ATTEMPTS: usize = 8;

/// The claim, for each `(scope, key, token, fingerprint, now, expires_at, retain_until, lease_until)`
/// row: [`Claim::decide`] in SQL. A row's `now` is stored as `created_at`, so `excluded.created_at`
/// is the claim's `now`. The `DO UPDATE` applies to a record the claim replaces ([`FRESH`]: past
/// retention, or released by another request; every column from the claim, as a fresh record), to
/// one it takes over (in flight past its lease, the same request, not expired) and to one it
/// resumes (released by the same request, not expired): those two get the new token and lease and
/// keep `created_at`, `expires_at` and `retain_until`. `claimed_by` says which, for the answer. All
/// `SET` expressions read the row as it was before the update. A second claim of a key within one
/// statement finds the first's fresh record, which it takes only as it would in a statement of its
/// own (past that record's lease or retention at its own `now`).
const CLAIM: &str = r#"
INSERT INTO idem_records
    (scope, key, token, fingerprint, created_at, expires_at, retain_until, state, lease_until,
     takeovers, claimed_by)
VALUES {rows}
ON CONFLICT (scope, key) DO UPDATE SET
    claimed_by   = CASE WHEN {fresh} THEN 'insert'
                        WHEN idem_records.state = 'released' THEN 'resume'
                        ELSE 'take_over' END,
    takeovers    = CASE WHEN {fresh} THEN 0
                        WHEN idem_records.state = 'released' THEN idem_records.takeovers
                        ELSE idem_records.takeovers + 1 END,
    fingerprint  = excluded.fingerprint,
    token        = excluded.token,
    state        = 'in_flight',
    lease_until  = excluded.lease_until,
    created_at   = CASE WHEN {fresh} THEN excluded.created_at ELSE idem_records.created_at END,
    expires_at   = CASE WHEN {fresh} THEN excluded.expires_at ELSE idem_records.expires_at END,
    retain_until = CASE WHEN {fresh} THEN excluded.retain_until ELSE idem_records.retain_until END,
    status       = NULL,
    headers      = NULL,
    body         = NULL
WHERE {fresh}
   OR ({same} AND (idem_records.state = 'released'
                   OR (idem_records.state = 'in_flight'
                       AND idem_records.lease_until <= excluded.created_at)))
RETURNING scope, key, token, claimed_by, created_at, expires_at
"#;

/// The record a claim finds is the same request's, and not expired at the claim's `now`.
const SAME: &str = "(idem_records.fingerprint = excluded.fingerprint
        AND excluded.created_at < idem_records.expires_at)";

/// The record a claim finds counts as absent: past retention, or released by another request
/// ([`ClaimRule::Insert`]).
const FRESH: &str = "(idem_records.retain_until <= excluded.created_at
        OR (idem_records.state = 'released' AND NOT {same}))";

/// The completion of each in-flight record still held by the row's token.
const COMPLETE: &str = r#"
WITH v (scope, key, token, status, headers, body) AS (VALUES {rows})
UPDATE idem_records
SET state = 'completed', lease_until = NULL, status = v.status, headers = v.headers, body = v.body
FROM v
WHERE idem_records.scope = v.scope AND idem_records.key = v.key AND idem_records.token = v.token
  AND idem_records.state = 'in_flight'
RETURNING scope, key, token
"#;

const RENEW: &str = r#"
WITH v (scope, key, token, lease_until) AS (VALUES {rows})
UPDATE idem_records SET lease_until = v.lease_until
FROM v
WHERE idem_records.scope = v.scope AND idem_records.key = v.key AND idem_records.token = v.token
  AND idem_records.state = 'in_flight'
RETURNING scope, key, token
"#;

/// The release of each in-flight record still held by the row's token: kept, as released, with its
/// times, for its request's retry to resume.
const RELEASE: &str = r#"
WITH v (scope, key, token) AS (VALUES {rows})
UPDATE idem_records SET state = 'released', lease_until = NULL
FROM v
WHERE idem_records.scope = v.scope AND idem_records.key = v.key AND idem_records.token = v.token
  AND idem_records.state = 'in_flight'
RETURNING scope, key, token
"#;

/// At most `?2` records past retention at `?1`, oldest first, found through the `retain_until` index.
const PURGE: &str = r#"
DELETE FROM idem_records
WHERE rowid IN (
    SELECT rowid FROM idem_records WHERE retain_until <= ?1 ORDER BY retain_until LIMIT ?2
)
"#;

/// The record of `(?1, ?2)` if it still carries token `?3` in state `?4`.
const FORGET: &str =
    "DELETE FROM idem_records WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = ?4";

/// At most `?2` records of scope `?1`, found through the primary key; their keys.
const ERASE: &str = r#"
DELETE FROM idem_records
WHERE rowid IN (SELECT rowid FROM idem_records WHERE scope = ?1 LIMIT ?2)
RETURNING key
"#;

/// In-flight records not past retention at `?1` created at or before `?2`, oldest first, at most
/// `?3`, through the in-flight index.
const IN_FLIGHT: &str = "state = 'in_flight' AND retain_until > ?1 AND created_at <= ?2
    ORDER BY created_at, scope, key LIMIT ?3";

/// The records by state at `?1`, as [`Stats::count`] counts them.
const STATS: &str = r#"
SELECT
    sum(retain_until <= ?1) AS forgotten,
    sum(retain_until > ?1 AND state = 'released') AS released,
    sum(retain_until > ?1 AND state <> 'released' AND ?1 >= expires_at) AS expired,
    sum(retain_until > ?1 AND state = 'completed' AND ?1 < expires_at) AS completed,
    sum(retain_until > ?1 AND state = 'in_flight' AND ?1 < expires_at) AS in_flight,
    min(CASE WHEN retain_until > ?1 AND state = 'in_flight' AND ?1 < expires_at
             THEN created_at END) AS oldest
FROM idem_records
"#;

/// `duration` in whole milliseconds, saturating.
fn duration_millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// Every file of `migrations/sqlite/`, in order.
const MIGRATIONS: &[super::migrations::Embedded] = &[
    (
        20261130000000,
        "idem records",
        include_str!("../../migrations/sqlite/20261130000000_idem_records.sql"),
    ),
    (
        20261207000000,
        "idem records released",
        include_str!("../../migrations/sqlite/20261207000000_idem_records_released.sql"),
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
    /// The queue of the store's writer task, which ends when the store is dropped.
    writes: mpsc::UnboundedSender<Write>,
    /// The queue of the store's reader task, likewise.
    reads: mpsc::UnboundedSender<Read>,
    /// The store's time: this process's clock.
    clock: Arc<dyn Clock>,
}

/// At most this many lookups share one statement.
const MAX_READS: usize = 64;

type Found = Result<Option<Record>, StoreError>;

/// One lookup by primary key for the reader, and where to send the record found.
struct Read {
    scope: String,
    key: String,
    reply: oneshot::Sender<Found>,
}

/// The reader task: on a connection of its own, takes every lookup queued (up to [`MAX_READS`]) and
/// answers them all with one `SELECT`. sqlx runs each statement on its connection's own thread, so
/// lookups sent one by one would each pay that hand-off, which costs far more than the lookup. Ends
/// when the store (the queue's sender) is gone.
async fn read_batches(pool: SqlitePool, mut queue: mpsc::UnboundedReceiver<Read>) {
    let mut conn: Option<SqliteConnection> = None;
    let mut batch = Vec::with_capacity(MAX_READS);
    // The statement for n lookups at index n - 1, made when first needed (sqlx keeps it prepared).
    let mut statements: Vec<String> = Vec::new();
    while queue.recv_many(&mut batch, MAX_READS).await > 0 {
        // Let the tasks that are ready run first (requests whose sockets have data): their
        // lookups join this batch instead of waiting for the next one.
        tokio::task::yield_now().await;
        take_queued(&mut queue, &mut batch, MAX_READS);
        batch.retain(|read| !read.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        while statements.len() < batch.len() {
            statements.push(select_many(statements.len() + 1));
        }
        let mut query = sqlx::query(&statements[batch.len() - 1]);
        for read in &batch {
            query = query.bind(read.scope.as_str()).bind(read.key.as_str());
        }
        let rows = match own_connection(&pool, &mut conn).await {
            Ok(conn) => query.fetch_all(conn).await,
            Err(error) => Err(error),
        };
        let rows = match rows {
            Ok(rows) => rows,
            Err(error) => {
                let error = Arc::new(error);
                for Read { reply, .. } in batch.drain(..) {
                    let _ = reply.send(Err(StoreError::unavailable(error.clone())));
                }
                conn = None;
                continue;
            }
        };
        for Read { scope, key, reply } in batch.drain(..) {
            let row = record_of(rows.iter(), &scope, &key);
            let _ = reply.send(row.map(decode).transpose());
        }
    }
}

/// The row of record (`scope`, `key`) among rows that start with `scope, key`. Rows match a lookup's
/// text exactly (the statement compared them), so a row whose scope or key does not read as text is
/// no lookup's.
fn record_of<'r>(
    mut rows: impl Iterator<Item = &'r SqliteRow>,
    scope: &str,
    key: &str,
) -> Option<&'r SqliteRow> {
    rows.find(|row| {
        row.try_get::<&str, _>(0).is_ok_and(|s| s == scope)
            && row.try_get::<&str, _>(1).is_ok_and(|k| k == key)
    })
}

/// Moves what is queued now into `batch`, up to `max` in all, without waiting.
fn take_queued<T>(queue: &mut mpsc::UnboundedReceiver<T>, batch: &mut Vec<T>, max: usize) {
    while batch.len() < max {
        match queue.try_recv() {
            Ok(item) => batch.push(item),
            Err(_) => break,
        }
    }
}

/// The reader's or the writer's connection, opened with the pool's options when first needed.
/// Closing the pool closes the store: the connection is then dropped and every call fails.
async fn own_connection<'c>(
    pool: &SqlitePool,
    conn: &'c mut Option<SqliteConnection>,
) -> Result<&'c mut SqliteConnection, sqlx::Error> {
    if pool.is_closed() {
        *conn = None;
        return Err(sqlx::Error::PoolClosed);
    }
    if conn.is_none() {
        *conn = Some(pool.connect_options().connect().await?);
    }
    conn.as_mut().ok_or(sqlx::Error::PoolClosed)
}

/// The lookup of `n` records by primary key, bound as `scope, key` pairs in order. Records past
/// retention are returned too; [`SqliteStore::fetch`] hides them by the caller's clock.
fn select_many(n: usize) -> String {
    select_where(&repeat(n, "(scope = ? AND key = ?)", " OR "))
}

/// How many columns [`select_where`] reads.
const RECORD_COLUMNS: usize = 12;

/// The records that match `condition`, every column.
fn select_where(condition: &str) -> String {
    format!(
        "SELECT scope, key, fingerprint, token, created_at, expires_at, retain_until, state,
                lease_until, status, headers, body
         FROM idem_records WHERE {condition}"
    )
}

/// `n` copies of `item`, joined by `separator`.
fn repeat(n: usize, item: &str, separator: &str) -> String {
    vec![item; n].join(separator)
}

/// At most this many writes are taken from the queue at once.
const MAX_BATCH: usize = 128;

/// A write's answer, once its statement committed.
type Written = Result<Answer, StoreError>;

/// What a write's statement did.
#[derive(Debug)]
enum Answer {
    /// A completion, release or renewal applied to its record.
    Applied,
    /// A claim won its record (inserted, took it over or resumed it).
    Won(Claimed),
    /// It found nothing to apply to. For a claim, the record that stood, read in the same call
    /// (none if it was gone by then).
    Stood(Option<Record>),
}

/// One write for the writer, and where to send its answer once it committed.
struct Write {
    row: Change,
    reply: oneshot::Sender<Written>,
}

/// A write's row in its kind's statement: the record it applies to, the token it holds or claims
/// with, and its values.
struct Change {
    scope: String,
    key: String,
    token: i64,
    values: Values,
}

enum Values {
    Claim {
        fingerprint: [u8; 32],
        now: i64,
        expires_at: i64,
        retain_until: i64,
        lease_until: i64,
    },
    Complete {
        status: i64,
        headers: String,
        body: bytes::Bytes,
    },
    Renew {
        lease_until: i64,
    },
    Release,
}

impl Values {
    /// The row of `claim` made at the store's time `now`: the fresh record's instants.
    fn claim(claim: &Claim<'_>, now: Timestamp) -> Self {
        let fresh = claim.record(now);
        Values::Claim {
            fingerprint: claim.fingerprint.0,
            now: now.as_millis(),
            expires_at: fresh.expires_at.as_millis(),
            retain_until: fresh.retain_until.as_millis(),
            lease_until: (now + claim.lease).as_millis(),
        }
    }
}

/// The kinds of write, in the order a batch applies them.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
enum Kind {
    Release,
    Complete,
    Renew,
    Claim,
}

impl Kind {
    /// What the writer sends for `n` writes of this kind: [`statement`](Self::statement), in a
    /// transaction if it is several writes (a statement that fails part-way, as a trigger's
    /// `RAISE(FAIL)` can make it, keeps its earlier rows) or a claim (whose read must not fail
    /// after its upsert committed, or a claim that won would be told it failed).
    fn transaction(self, n: usize) -> String {
        let statement = self.statement(n);
        match (self, n) {
            (Kind::Claim, _) | (_, 2..) => format!("BEGIN IMMEDIATE;{statement};COMMIT"),
            _ => statement,
        }
    }

    /// The statement that applies `n` writes of this kind.
    fn statement(self, n: usize) -> String {
        let (sql, tuple, separator) = match self {
            Kind::Claim => (
                CLAIM,
                "(?, ?, ?, ?, ?, ?, ?, 'in_flight', ?, 0, 'insert')",
                ", ",
            ),
            Kind::Complete => (COMPLETE, "(?, ?, ?, ?, ?, ?)", ", "),
            Kind::Renew => (RENEW, "(?, ?, ?, ?)", ", "),
            Kind::Release => (RELEASE, "(?, ?, ?)", ", "),
        };
        let statement = sql
            .replace("{rows}", &repeat(n, tuple, separator))
            .replace("{fresh}", FRESH)
            .replace("{same}", SAME);
        match self {
            // In the same call, each claim's record unless it is the claim's own in-flight one
            // (a claim that won), for the claims that did not win.
            Kind::Claim => {
                let record = "(scope = ? AND key = ? AND (token <> ? OR state <> 'in_flight'))";
                let lost = repeat(n, record, " OR ");
                format!("{statement};{}", select_where(&lost))
            }
            _ => statement,
        }
    }
}

impl Change {
    fn kind(&self) -> Kind {
        match self.values {
            Values::Claim { .. } => Kind::Claim,
            Values::Complete { .. } => Kind::Complete,
            Values::Renew { .. } => Kind::Renew,
            Values::Release => Kind::Release,
        }
    }

    fn bind<'q>(&'q self, query: SqliteQuery<'q>) -> SqliteQuery<'q> {
        let query = query.bind(&self.scope).bind(&self.key).bind(self.token);
        match &self.values {
            Values::Claim {
                fingerprint,
                now,
                expires_at,
                retain_until,
                lease_until,
            } => query
                .bind(&fingerprint[..])
                .bind(now)
                .bind(expires_at)
                .bind(retain_until)
                .bind(lease_until),
            Values::Complete {
                status,
                headers,
                body,
            } => query.bind(status).bind(headers).bind(&body[..]),
            Values::Renew { lease_until } => query.bind(lease_until),
            Values::Release => query,
        }
    }

    /// This write's answer in the rows its statement returned (`scope, key, token`, and for claims
    /// `claimed_by, created_at, expires_at`), followed for claims by the rows of the records read
    /// after it.
    fn answer(&self, rows: &[SqliteRow]) -> Written {
        // Returned rows have at most six columns, records read all of theirs.
        let mut returned = rows.iter().filter(|row| row.len() < RECORD_COLUMNS);
        let row = returned.find(|row| {
            row.try_get::<i64, _>(2)
                .is_ok_and(|token| token == self.token)
                && row.try_get::<&str, _>(1).is_ok_and(|key| key == self.key)
                && row
                    .try_get::<&str, _>(0)
                    .is_ok_and(|scope| scope == self.scope)
        });
        match row {
            Some(row) if self.kind() == Kind::Claim => won(row).map(Answer::Won),
            Some(_) => Ok(Answer::Applied),
            None => {
                let read = rows.iter().filter(|row| row.len() >= RECORD_COLUMNS);
                let stood = record_of(read, &self.scope, &self.key);
                stood.map(decode).transpose().map(Answer::Stood)
            }
        }
    }

    /// Whether `other` is a write to the same record under the same token.
    fn repeats(&self, other: &Change) -> bool {
        self.token == other.token && self.key == other.key && self.scope == other.scope
    }
}

/// A won claim's returned row (`scope, key, token, claimed_by, created_at, expires_at`).
fn won(row: &SqliteRow) -> Result<Claimed, StoreError> {
    let claimed_by: &str = row.try_get(3).map_err(StoreError::corrupt)?;
    let millis = |i: usize| -> Result<Timestamp, StoreError> {
        row.try_get::<i64, _>(i)
            .map(Timestamp::from_millis)
            .map_err(StoreError::corrupt)
    };
    Ok(Claimed {
        taken_over: claimed_by == "take_over",
        created_at: millis(4)?,
        expires_at: millis(5)?,
    })
}

type SqliteQuery<'q> = Query<'q, sqlx::Sqlite, SqliteArguments<'q>>;

/// Runs `sql` for `rows` and returns the rows it returned.
async fn apply(
    conn: &mut SqliteConnection,
    sql: &str,
    rows: &[&Change],
) -> Result<Vec<SqliteRow>, sqlx::Error> {
    let mut query = sqlx::query(sql);
    for row in rows {
        query = row.bind(query);
    }
    // Claims are followed by the read of the records they did not win.
    if rows.first().is_some_and(|row| row.kind() == Kind::Claim) {
        for row in rows {
            query = query.bind(&row.scope).bind(&row.key).bind(row.token);
        }
    }
    query.fetch_all(conn).await
}

/// The writer task: on a connection of its own and under the write gate, takes every write queued
/// (up to [`MAX_BATCH`]) and applies those of each kind together, answering each caller once they
/// committed. Ends when the store (the queue's sender) is gone.
async fn write_batches(
    pool: SqlitePool,
    gate: Arc<tokio::sync::Mutex<()>>,
    mut queue: mpsc::UnboundedReceiver<Write>,
) {
    let mut conn: Option<SqliteConnection> = None;
    // Each kind's statement for n writes, made when first needed; sqlx keeps the statements it
    // used last prepared.
    let mut statements: HashMap<(Kind, usize), String> = HashMap::new();
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut next = Vec::new();
    loop {
        batch.append(&mut next);
        if batch.is_empty() && queue.recv_many(&mut batch, MAX_BATCH).await == 0 {
            return;
        }
        // As for lookups: the writes of tasks that are ready join this batch.
        tokio::task::yield_now().await;
        let _gate = gate.lock().await;
        // Whatever was queued while waiting for the gate joins this batch.
        take_queued(&mut queue, &mut batch, MAX_BATCH);
        // A write whose caller has gone is skipped.
        batch.retain(|write| !write.reply.is_closed());
        // A second write to one record under one token waits for the next batch, so that it sees
        // the first's effect (a second completion is fenced), as in queue order.
        let mut i = 0;
        while i < batch.len() {
            if batch[..i].iter().any(|w| w.row.repeats(&batch[i].row)) {
                next.push(batch.remove(i));
            } else {
                i += 1;
            }
        }
        let mut healthy = true;
        // By kind; releases and completions first, so that claims queued beside them find their
        // records released (to resume or replace) or completed.
        batch.sort_by_key(|write| write.row.kind());
        while let Some(kind) = batch.first().map(|write| write.row.kind()) {
            let n = batch.iter().take_while(|w| w.row.kind() == kind).count();
            let group: Vec<Write> = batch.drain(..n).collect();
            healthy &= match own_connection(&pool, &mut conn).await {
                Ok(conn) => run_group(conn, &mut statements, kind, group).await,
                Err(error) => answer_all(group, error),
            };
        }
        if !healthy {
            // A fresh connection for the next batch, in case this one is broken.
            conn = None;
        }
    }
}

/// Applies `group` (writes of one `kind`) and answers each write; returns whether the connection is
/// still sound. The writes share one statement ([`Kind::transaction`]). If that fails on one
/// write's data (a trigger, a constraint), it is rolled back and each write runs alone, so that
/// only the failing one fails.
async fn run_group(
    conn: &mut SqliteConnection,
    statements: &mut HashMap<(Kind, usize), String>,
    kind: Kind,
    group: Vec<Write>,
) -> bool {
    let n = group.len();
    let rows: Vec<&Change> = group.iter().map(|write| &write.row).collect();
    let sql = statements
        .entry((kind, n))
        .or_insert_with(|| kind.transaction(n));
    let error = match apply(conn, sql, &rows).await {
        Ok(applied) => {
            for Write { row, reply } in group {
                let _ = reply.send(row.answer(&applied));
            }
            return true;
        }
        Err(error) => error,
    };
    if roll_back(conn).await.is_err() {
        answer_all(group, error);
        return false;
    }
    match error {
        sqlx::Error::Database(e) if n > 1 && !is_busy(&*e) => {
            let sql = statements
                .entry((kind, 1))
                .or_insert_with(|| kind.transaction(1));
            let mut writes = group.into_iter();
            while let Some(write) = writes.next() {
                match apply(conn, sql, &[&write.row]).await {
                    Ok(applied) => {
                        let answer = write.row.answer(&applied);
                        let _ = write.reply.send(answer);
                    }
                    Err(sqlx::Error::Database(e)) if !is_busy(&*e) => {
                        let _ = write.reply.send(Err(sqlx::Error::Database(e).into()));
                        if let Err(error) = roll_back(conn).await {
                            return answer_all(writes.collect(), error);
                        }
                    }
                    // Another connection's lock, or a broken connection: the writes left would
                    // each meet it too.
                    Err(error) => {
                        return answer_all(std::iter::once(write).chain(writes).collect(), error)
                    }
                }
            }
            true
        }
        error => answer_all(group, error),
    }
}

/// Ends the transaction a failed statement may have left open (with none open, `ROLLBACK` fails
/// harmlessly). An error means the connection could not, and is not to be used again.
async fn roll_back(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    match sqlx::query("ROLLBACK").execute(conn).await {
        Ok(_) | Err(sqlx::Error::Database(_)) => Ok(()),
        Err(error) => Err(error),
    }
}

/// Answers every write of `group` with `error` (nothing of theirs committed); returns whether the
/// connection is still sound, which it is after an error of the statement itself.
fn answer_all(group: Vec<Write>, error: sqlx::Error) -> bool {
    let sound = matches!(error, sqlx::Error::Database(_));
    let error = Arc::new(error);
    for Write { reply, .. } in group {
        let _ = reply.send(Err(StoreError::unavailable(error.clone())));
    }
    sound
}

/// Whether SQLite failed for another connection's lock (`SQLITE_BUSY`, `SQLITE_LOCKED`) after
/// `busy_timeout`: running the writes one by one would wait that long for each.
fn is_busy(error: &dyn sqlx::error::DatabaseError) -> bool {
    let code = error.code().and_then(|code| code.parse::<i32>().ok());
    matches!(code.map(|code| code & 0xff), Some(5 | 6))
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
    ///   log is flushed at each checkpoint. The database cannot be corrupted, and an application
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
        let (writes, queue) = mpsc::unbounded_channel();
        let gate = shared.write_gate.clone();
        tokio::spawn(write_batches(pool.clone(), gate, queue));
        let (reads, queue) = mpsc::unbounded_channel();
        tokio::spawn(read_batches(pool.clone(), queue));
        Ok(Self {
            shared,
            pool,
            writes,
            reads,
            clock: Arc::new(SystemClock),
        })
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

    async fn fetch(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, StoreError> {
        let stopped = || StoreError::unavailable("the SQLite store's reader has stopped");
        let (reply, answer) = oneshot::channel();
        let read = Read {
            scope: key.scope().to_owned(),
            key: key.key().to_owned(),
            reply,
        };
        self.reads.send(read).map_err(|_| stopped())?;
        let found = answer.await.map_err(|_| stopped())??;
        Ok(found.filter(|record| !record.is_forgotten(now)))
    }

    /// Queues `row` for the writer; its answer, once committed.
    async fn write(&self, key: &RecordKey, token: FencingToken, values: Values) -> Written {
        let stopped = || StoreError::unavailable("the SQLite store's writer has stopped");
        let (reply, answer) = oneshot::channel();
        let row = Change {
            scope: key.scope().to_owned(),
            key: key.key().to_owned(),
            token: token.0,
            values,
        };
        self.writes
            .send(Write { row, reply })
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
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
        let done = sqlx::query(PURGE)
            .bind(now.as_millis())
            .bind(limit)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Claimed;
    use std::future::Future;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const NOW: Timestamp = Timestamp::from_millis(1_000_000);

    async fn temp_store() -> (tempfile::TempDir, String, SqliteStore) {
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

    fn claim<'a>(key: &'a RecordKey, fingerprint: u8) -> Claim<'a> {
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

    type Boxed<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;
    type Pending<'a> = Boxed<'a, Result<(), StoreError>>;

    /// Polls each write once, which queues it for the writer (still waiting for the gate).
    fn queue<T>(writes: &mut [Boxed<'_, T>]) {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        for write in writes {
            assert!(
                write.as_mut().poll(&mut cx).is_pending(),
                "answered before its commit"
            );
        }
    }

    async fn claimed(store: &SqliteStore, keys: &[RecordKey]) -> Vec<FencingToken> {
        let mut tokens = Vec::new();
        for key in keys {
            let c = claim(key, 1);
            store.claim(&c).await.expect("claim");
            tokens.push(c.token);
        }
        tokens
    }

    fn response() -> StoredResponse {
        StoredResponse {
            status: 200,
            headers: vec![],
            body: bytes::Bytes::from_static(b"done"),
        }
    }

    async fn is_completed(store: &SqliteStore, key: &RecordKey) -> bool {
        let record = store
            .get(key)
            .await
            .map(|found| found.map(|f| f.record))
            .expect("get")
            .expect("record");
        matches!(record.state, RecordState::Completed { .. })
    }

    /// Writes queued while the writer waits share one statement: 16 completions commit together
    /// (the log grows by a page or two, not by a commit each), a fenced one among them is only its
    /// own answer, a caller that stopped waiting has its write skipped, and reads go on meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_writes_share_one_statement() {
        let (_dir, _url, store) = temp_store().await;
        let keys: Vec<RecordKey> = (0..17)
            .map(|i| RecordKey::new("batch", format!("k{i}")))
            .collect();
        let tokens = claimed(&store, &keys).await;
        // An empty log, so that its size afterwards counts this batch's pages alone.
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(store.pool())
            .await
            .expect("checkpoint");
        let response = response();
        let gate = store.shared.write_gate.lock().await;
        let mut writes: Vec<Pending<'_>> = (0..16)
            .map(|i| store.complete(&keys[i], tokens[i], &response))
            .collect();
        writes.push(store.complete(&keys[0], FencingToken::generate(), &response));
        let mut gone = vec![store.release(&keys[16], tokens[16])];
        queue(&mut writes);
        queue(&mut gone);
        drop(gone);
        assert!(!is_completed(&store, &keys[1]).await, "read while queued");
        drop(gate);

        let fenced = writes
            .pop()
            .expect("fenced write")
            .await
            .expect_err("fenced");
        assert_eq!(fenced.kind(), super::super::StoreErrorKind::Fenced);
        for write in writes {
            write.await.expect("completed");
        }
        for key in &keys[..16] {
            assert!(is_completed(&store, key).await, "{key}");
        }
        let skipped = store
            .get(&keys[16])
            .await
            .map(|found| found.map(|f| f.record))
            .expect("get");
        assert!(
            skipped.is_some(),
            "the dropped caller's release was skipped"
        );
        let (_, frames, _): (i64, i64, i64) = sqlx::query_as("PRAGMA wal_checkpoint(PASSIVE)")
            .fetch_one(store.pool())
            .await
            .expect("checkpoint");
        assert!((1..16).contains(&frames), "{frames} pages logged");
    }

    /// Claims queued together share one statement: of three on one key exactly one wins and the
    /// others are answered with its record, read in the same call; a claim of another key beside
    /// them wins its own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_queued_together_on_one_key_have_one_winner() {
        let (_dir, _url, store) = temp_store().await;
        let (shared, other) = (
            RecordKey::new("batch", "shared"),
            RecordKey::new("batch", "other"),
        );
        let claims: Vec<Claim<'_>> = [&shared, &shared, &shared, &other]
            .into_iter()
            .map(|key| claim(key, 1))
            .collect();
        let gate = store.shared.write_gate.lock().await;
        let mut writes: Vec<Boxed<'_, Written>> = claims
            .iter()
            .map(|c| {
                Box::pin(store.write(c.key, c.token, Values::claim(c, NOW))) as Boxed<'_, Written>
            })
            .collect();
        queue(&mut writes);
        drop(gate);
        let mut answers = Vec::new();
        for write in writes {
            answers.push(write.await.expect("claim"));
        }
        let won: Vec<bool> = answers
            .iter()
            .map(|answer| {
                matches!(
                    answer,
                    Answer::Won(Claimed {
                        taken_over: false,
                        created_at: NOW,
                        ..
                    })
                )
            })
            .collect();
        assert_eq!(won.iter().filter(|&&w| w).count(), 2, "{answers:?}");
        assert!(won[3], "the other key's claim won");
        let winner = won[..3].iter().position(|&w| w).expect("a winner");
        let record = store
            .get(&shared)
            .await
            .map(|found| found.map(|f| f.record))
            .expect("get")
            .expect("record");
        assert_eq!(record.token, claims[winner].token);
        assert!(matches!(record.state, RecordState::InFlight { .. }));
        for (i, answer) in answers[..3].iter().enumerate() {
            if i != winner {
                assert!(
                    matches!(answer, Answer::Stood(Some(stood)) if *stood == record),
                    "{answer:?}"
                );
            }
        }
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

    /// A write whose data fails its batch's statement (a trigger here) gets the error alone: the
    /// others queued with it are applied one by one and told so. With `RAISE(FAIL)`, which keeps
    /// what a statement changed before failing, the batch's transaction is what keeps them from
    /// being applied twice (and then told they were fenced).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failing_write_fails_alone() {
        for action in ["ABORT", "FAIL"] {
            let (_dir, _url, store) = temp_store().await;
            let keys: Vec<RecordKey> = (0..9)
                .map(|i| RecordKey::new("batch", format!("k{i}")))
                .collect();
            let tokens = claimed(&store, &keys).await;
            sqlx::query(&format!(
                "CREATE TRIGGER poison BEFORE UPDATE ON idem_records WHEN NEW.key = 'k4'
                 BEGIN SELECT RAISE({action}, 'poisoned'); END"
            ))
            .execute(store.pool())
            .await
            .expect("trigger");
            let response = response();
            let gate = store.shared.write_gate.lock().await;
            let mut writes: Vec<Pending<'_>> = keys
                .iter()
                .zip(&tokens)
                .map(|(key, token)| store.complete(key, *token, &response))
                .collect();
            queue(&mut writes);
            drop(gate);
            for (i, write) in writes.into_iter().enumerate() {
                match write.await {
                    Ok(()) => assert_ne!(i, 4, "{action}"),
                    Err(e) => {
                        assert_eq!(i, 4, "{action}: {e}");
                        assert_eq!(e.kind(), super::super::StoreErrorKind::Unavailable);
                    }
                }
            }
            for (i, key) in keys.iter().enumerate() {
                assert_eq!(is_completed(&store, key).await, i != 4, "{action}: {key}");
            }
        }
    }

    /// Likewise for claims, which run in a transaction even alone (their read follows the upsert):
    /// a claim that fails alone is rolled back, and the writer's next transaction starts cleanly.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failing_claim_fails_alone() {
        let (_dir, _url, store) = temp_store().await;
        sqlx::query(
            "CREATE TRIGGER poison BEFORE INSERT ON idem_records WHEN NEW.key = 'k4'
             BEGIN SELECT RAISE(ABORT, 'poisoned'); END",
        )
        .execute(store.pool())
        .await
        .expect("trigger");
        let keys: Vec<RecordKey> = (0..10)
            .map(|i| RecordKey::new("batch", format!("k{i}")))
            .collect();
        let claims: Vec<Claim<'_>> = keys[..9].iter().map(|key| claim(key, 1)).collect();
        let gate = store.shared.write_gate.lock().await;
        let mut writes: Vec<Boxed<'_, Result<ClaimOutcome, StoreError>>> = claims
            .iter()
            .map(|c| Box::pin(store.claim(c)) as Boxed<'_, _>)
            .collect();
        queue(&mut writes);
        drop(gate);
        for (i, write) in writes.into_iter().enumerate() {
            match write.await {
                Ok(outcome) => {
                    assert_ne!(i, 4);
                    assert!(matches!(
                        outcome,
                        ClaimOutcome::Claimed(Claimed {
                            taken_over: false,
                            ..
                        })
                    ));
                }
                Err(e) => assert_eq!(i, 4, "{e}"),
            }
        }
        // Alone, then a claim of another key on the same connection.
        assert!(store.claim(&claim(&keys[4], 1)).await.is_err());
        let last = store.claim(&claim(&keys[9], 1)).await.expect("claim");
        assert!(matches!(
            last,
            ClaimOutcome::Claimed(Claimed {
                taken_over: false,
                ..
            })
        ));
        let stored: Vec<String> = sqlx::query_scalar("SELECT key FROM idem_records ORDER BY key")
            .fetch_all(store.pool())
            .await
            .expect("keys");
        assert_eq!(
            stored,
            ["k0", "k1", "k2", "k3", "k5", "k6", "k7", "k8", "k9"]
        );
    }

    /// Two writes to one record under one token queued together go in turn, as in queue order:
    /// the first completion is stored and the second is fenced, not both told `Ok`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_repeated_write_waits_for_the_next_batch() {
        let (_dir, _url, store) = temp_store().await;
        let keys = [RecordKey::new("batch", "k0"), RecordKey::new("batch", "k1")];
        let tokens = claimed(&store, &keys).await;
        let response = response();
        let gate = store.shared.write_gate.lock().await;
        let mut writes: Vec<Pending<'_>> = vec![
            store.complete(&keys[0], tokens[0], &response),
            store.complete(&keys[0], tokens[0], &response),
            store.complete(&keys[1], tokens[1], &response),
        ];
        queue(&mut writes);
        drop(gate);
        let mut outcomes = Vec::new();
        for write in writes {
            outcomes.push(write.await);
        }
        assert!(outcomes[0].is_ok(), "{:?}", outcomes[0]);
        let fenced = outcomes[1].as_ref().expect_err("the repeat is fenced");
        assert_eq!(fenced.kind(), super::super::StoreErrorKind::Fenced);
        assert!(outcomes[2].is_ok(), "{:?}", outcomes[2]);
        for key in &keys {
            assert!(is_completed(&store, key).await, "{key}");
        }
    }

    /// Lookups made together share the reader's statements, and each gets its own key's record:
    /// completed and in-flight ones as stored, absent ones none, a key asked twice the same record
    /// twice, and a record past retention at the caller's clock none, though its row is still there.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lookups_made_together_each_get_their_own_record() {
        let (_dir, _url, store) = temp_store().await;
        let keys: Vec<RecordKey> = (0..12)
            .map(|i| RecordKey::new("read", format!("k{i}")))
            .collect();
        let tokens = claimed(&store, &keys[..8]).await;
        for (i, key) in keys[..4].iter().enumerate() {
            let response = StoredResponse {
                status: 200 + i as u16,
                headers: vec![],
                body: bytes::Bytes::from(format!("body {i}")),
            };
            store
                .complete(key, tokens[i], &response)
                .await
                .expect("complete");
        }
        let mut asked: Vec<&RecordKey> = keys.iter().collect();
        asked.push(&keys[2]);
        // Each lookup polled once, which queues it for the reader, before any is awaited.
        let mut lookups: Vec<_> = asked
            .iter()
            .map(|key| Box::pin(store.fetch(key, NOW)))
            .collect();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        for lookup in &mut lookups {
            let _ = lookup.as_mut().poll(&mut cx);
        }
        let mut found = Vec::new();
        for lookup in lookups {
            found.push(lookup.await);
        }
        for (key, found) in asked.iter().zip(found) {
            let found = found.expect("read");
            let i: usize = key.key()[1..].parse().expect("k<i>");
            match (i, found) {
                (0..4, Some(record)) => assert_eq!(
                    record.state,
                    RecordState::Completed {
                        response: StoredResponse {
                            status: 200 + i as u16,
                            headers: vec![],
                            body: bytes::Bytes::from(format!("body {i}")),
                        }
                    },
                    "{key}"
                ),
                (4..8, Some(record)) => {
                    assert_eq!(record.token, tokens[i], "{key}");
                    assert!(
                        matches!(record.state, RecordState::InFlight { .. }),
                        "{key}"
                    );
                }
                (8.., None) => {}
                (_, other) => panic!("{key}: {other:?}"),
            }
        }
        let later = NOW + Duration::from_secs(7200);
        assert!(store.fetch(&keys[0], later).await.expect("read").is_none());
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_records")
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(rows, 8, "hidden, not deleted");
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

    /// A release and a claim of its request queued together: the release goes first, and the
    /// claim resumes the record in the same batch (not a takeover, its times kept); another
    /// request's claim beside a release replaces the record. A record taken over, released and
    /// resumed is not told a takeover again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_queued_beside_a_release_resume_or_replace_it() {
        let clock = crate::clock::ManualClock::new(NOW);
        let (_dir, _url, store) = temp_store().await;
        let store = store.with_clock(clock.clone());
        let (same, other) = (RecordKey::new("q", "same"), RecordKey::new("q", "other"));
        let tokens = claimed(&store, &[same.clone(), other.clone()]).await;
        clock.advance(Duration::from_secs(1));
        let later = clock.now();
        let resume = claim(&same, 1);
        let replace = claim(&other, 2);
        let gate = store.shared.write_gate.lock().await;
        let mut releases: Vec<Pending<'_>> = vec![
            store.release(&same, tokens[0]),
            store.release(&other, tokens[1]),
        ];
        let mut claims: Vec<Boxed<'_, Result<ClaimOutcome, StoreError>>> = vec![
            Box::pin(store.claim(&resume)),
            Box::pin(store.claim(&replace)),
        ];
        queue(&mut releases);
        queue(&mut claims);
        drop(gate);
        for release in releases {
            release.await.expect("release");
        }
        let outcomes: Vec<ClaimOutcome> = {
            let mut outcomes = Vec::new();
            for claim in claims {
                outcomes.push(claim.await.expect("claim"));
            }
            outcomes
        };
        let hour = Duration::from_secs(3600);
        assert_eq!(
            outcomes,
            [
                ClaimOutcome::Claimed(Claimed {
                    taken_over: false,
                    created_at: NOW,
                    expires_at: NOW + hour,
                }),
                ClaimOutcome::Claimed(Claimed {
                    taken_over: false,
                    created_at: later,
                    expires_at: later + hour,
                }),
            ]
        );
        let record = store.get(&other).await.expect("get").expect("record");
        assert_eq!(
            (record.record.fingerprint, record.record.token),
            (Fingerprint([2; 32]), replace.token)
        );

        // Taken over past its lease, released, resumed: the resumption is no takeover.
        clock.advance(Duration::from_secs(31));
        let heir = claim(&same, 1);
        match store.claim(&heir).await.expect("claim") {
            ClaimOutcome::Claimed(c) => assert!(c.taken_over && c.created_at == NOW),
            other => panic!("{other:?}"),
        }
        store.release(&same, heir.token).await.expect("release");
        match store.claim(&claim(&same, 1)).await.expect("claim") {
            ClaimOutcome::Claimed(c) => assert!(!c.taken_over && c.created_at == NOW),
            other => panic!("{other:?}"),
        }
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_records")
            .fetch_one(store.pool())
            .await
            .expect("count");
        assert_eq!(rows, 2, "resumed and replaced in place");
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
