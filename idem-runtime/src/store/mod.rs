//! The storage contract every backend implements, and the backends.
//!
//! A store keeps one [`Record`] per [`RecordKey`]. The contract is small and each method states its
//! atomicity; the engine builds all of idem's behaviour on it:
//!
//! - [`Store::claim`] is **one atomic step**: insert a fresh in-flight record, take over a record
//!   whose lease ran out, resume a record its own request released, or return the existing record
//!   untouched, as [`Claim::decide`] rules. Never read-then-insert; never overwrite an in-flight or
//!   completed record any other way.
//! - [`Store::complete`], [`Store::release`] and [`Store::renew`] apply only if the record is in
//!   flight under the caller's [`FencingToken`]; otherwise they fail with
//!   [`StoreErrorKind::Fenced`] and change nothing.
//! - Records whose `retain_until` has passed count as absent everywhere (claim replaces them, get
//!   hides them) whether or not a sweeper has deleted them yet.
//! - [`Store::subscribe`] wakes waiters when a key is completed or released, in this process and, for
//!   shared stores, in every process that has [announced](Store::announce_waiter) a waiter.
//!
//! # Time is the store's
//!
//! Every instant a record carries (its creation, the lease's end, the expiry, the end of retention)
//! is set **and judged** by the store's own clock: PostgreSQL's `clock_timestamp()`, MySQL's and
//! MariaDB's `UTC_TIMESTAMP(6)`, Redis's `TIME`
//! inside the script that decides (each Redis Cluster node its own, and a record lives on one node),
//! and the process's clock for the memory and SQLite stores, which live in one machine. The engine
//! sends durations ([`Claim::lease`], [`Claim::ttl`], [`Claim::retain`]) and reads instants back
//! with the store's time of the read ([`Found::now`]), so instances whose clocks disagree by
//! minutes or days still agree on who owns a key, when it expires and when it may be purged. Each
//! backend can be given a [`Clock`](crate::clock::Clock) of its own to judge by instead
//! (`with_clock`), which is how tests move a store's time.
//!
//! Purging is a separate capability, [`Purge`], used by the [`Sweeper`](crate::sweeper::Sweeper).

use crate::clock::Timestamp;
use crate::fingerprint::Fingerprint;
use crate::record::{FencingToken, Record, RecordKey, RecordState, StoredResponse};
use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

pub use crate::waiters::{Subscription, Waiters};

pub mod memory;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod migrations;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub mod sqlite;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
pub mod tx;
pub mod url;

pub use url::{open, open_with, OpenError, OpenOptions, Opened};

/// One claim attempt: the key, the request's fingerprint, the token the claim will carry, and the
/// policy's durations. The store turns the durations into instants on **its own clock** (see the
/// [module documentation](self)), so that no instance's clock decides who owns a key.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The key to claim.
    pub key: &'a RecordKey,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The token this claim will carry if it wins.
    pub token: FencingToken,
    /// How long the claim holds the key before a duplicate may take it over, unless renewed.
    pub lease: Duration,
    /// How long a fresh record answers with its replay (then "expired").
    pub ttl: Duration,
    /// How long a fresh record is kept at all; at least `ttl`.
    pub retain: Duration,
}

/// What a claim does to the record it finds: every store applies exactly this rule, in SQL, in
/// Lua or in Rust ([`Claim::decide`]), judged at the store's own time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimRule {
    /// No record, one past retention, or one released by another request (another fingerprint, or
    /// past its expiry): insert a fresh in-flight record ([`Claim::record`]).
    Insert,
    /// In flight, its lease run out, the same request, not expired: take it over (new token and
    /// lease; its `created_at`, `expires_at` and `retain_until` kept).
    TakeOver,
    /// Released by a run of the same request, not expired: claim it again as the same record (new
    /// token and lease; its times kept, so its downstream key stays the same).
    Resume,
    /// Anything else: leave it as it is and return it.
    Keep,
}

impl Claim<'_> {
    /// The fresh in-flight record this claim inserts when the store's time is `now`.
    pub fn record(&self, now: Timestamp) -> Record {
        Record {
            fingerprint: self.fingerprint,
            token: self.token,
            created_at: now,
            expires_at: now + self.ttl,
            retain_until: now + self.retain.max(self.ttl),
            state: RecordState::InFlight {
                lease_until: now + self.lease,
            },
        }
    }

    /// What this claim does to `found` (the key's record, if any) at the store's time `now`.
    pub fn decide(&self, found: Option<&Record>, now: Timestamp) -> ClaimRule {
        let Some(record) = found.filter(|r| !r.is_forgotten(now)) else {
            return ClaimRule::Insert;
        };
        let same = record.fingerprint == self.fingerprint && now < record.expires_at;
        match record.state {
            RecordState::Released if same => ClaimRule::Resume,
            RecordState::Released => ClaimRule::Insert,
            RecordState::InFlight { lease_until } if same && lease_until <= now => {
                ClaimRule::TakeOver
            }
            _ => ClaimRule::Keep,
        }
    }

    /// Applies `rule` ([`decide`](Self::decide)'s answer for `record`) to `record` at `now`; the
    /// outcome to return. For stores that hold records as Rust values.
    pub fn apply(&self, rule: ClaimRule, record: &mut Record, now: Timestamp) -> ClaimOutcome {
        match rule {
            ClaimRule::Insert => *record = self.record(now),
            ClaimRule::TakeOver | ClaimRule::Resume => {
                record.token = self.token;
                record.state = RecordState::InFlight {
                    lease_until: now + self.lease,
                };
            }
            ClaimRule::Keep => {
                return ClaimOutcome::Existing(Found {
                    record: record.clone(),
                    now,
                })
            }
        }
        ClaimOutcome::Claimed(Claimed {
            taken_over: rule == ClaimRule::TakeOver,
            created_at: record.created_at,
            expires_at: record.expires_at,
        })
    }
}

/// A claim that won: the caller holds the key under its token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claimed {
    /// Whether an earlier claim's lease had run out and was taken over.
    pub taken_over: bool,
    /// When the record was first claimed, on the store's clock (kept by a takeover or a resume):
    /// with the key and fingerprint it names the record, for its downstream key.
    pub created_at: Timestamp,
    /// When the record stops being replayed, on the store's clock.
    pub expires_at: Timestamp,
}

/// A record as the store read it, with the store's time at that read: everything the engine judges
/// (expiry, the lease's end) it judges against `now`, never against its own clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// The record (never past retention at `now`).
    pub record: Record,
    /// The store's time when it read the record.
    pub now: Timestamp,
}

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller now holds the key with `claim.token`.
    Claimed(Claimed),
    /// Another request holds or held the key: the record as it stands (never past retention), and
    /// the store's time.
    Existing(Found),
}

/// A store operation failed.
#[derive(Debug)]
pub struct StoreError {
    kind: StoreErrorKind,
    source: Option<Box<dyn StdError + Send + Sync>>,
}

/// The kinds of [`StoreError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The store could not be reached or did not answer in time; try again later (HTTP 503).
    Unavailable,
    /// The caller's claim is no longer current (its lease ran out and another request took over, or it
    /// was released); nothing was written.
    Fenced,
    /// A stored record could not be decoded.
    Corrupt,
    /// The store is up but has no capacity for this call right now (every pooled connection is in
    /// use); try again shortly (HTTP 503 with its own problem type).
    Busy,
    /// The store does not offer this operation (a custom store without the operator's operations).
    Unsupported,
}

impl StoreError {
    /// An error of `kind` caused by `source`.
    pub fn new(kind: StoreErrorKind, source: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        Self {
            kind,
            source: Some(source.into()),
        }
    }

    /// The store is unreachable; `source` says why.
    pub fn unavailable(source: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        Self::new(StoreErrorKind::Unavailable, source)
    }

    /// A stored record is unreadable; `source` says why.
    pub fn corrupt(source: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        Self::new(StoreErrorKind::Corrupt, source)
    }

    /// The store does not offer `operation`.
    pub fn unsupported(operation: &'static str) -> Self {
        Self::new(
            StoreErrorKind::Unsupported,
            format!("this store does not offer `{operation}`"),
        )
    }

    /// The caller's token is not the record's.
    pub fn fenced() -> Self {
        Self {
            kind: StoreErrorKind::Fenced,
            source: None,
        }
    }

    /// What went wrong.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }
}

/// A pool that gave no connection within its acquire timeout is [busy](StoreErrorKind::Busy): the
/// database is up, the service is short of connections. Every other error is
/// [unavailable](StoreErrorKind::Unavailable).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        let kind = match error {
            sqlx::Error::PoolTimedOut => StoreErrorKind::Busy,
            _ => StoreErrorKind::Unavailable,
        };
        Self::new(kind, error)
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            StoreErrorKind::Unavailable => f.write_str("idempotency store unavailable")?,
            StoreErrorKind::Fenced => {
                f.write_str("claim is no longer held (lease taken over or released)")?
            }
            StoreErrorKind::Corrupt => f.write_str("idempotency record could not be decoded")?,
            StoreErrorKind::Busy => f.write_str("idempotency store busy (no free connection)")?,
            StoreErrorKind::Unsupported => f.write_str("operation not supported by this store")?,
        }
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl StdError for StoreError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

/// A record's state without its contents, for operations that must find a record as it was seen
/// ([`Store::forget`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StateKind {
    /// [`RecordState::InFlight`].
    InFlight,
    /// [`RecordState::Completed`].
    Completed,
    /// [`RecordState::Released`].
    Released,
}

impl StateKind {
    /// The kind of `state`.
    pub fn of(state: &RecordState) -> Self {
        match state {
            RecordState::InFlight { .. } => Self::InFlight,
            RecordState::Completed { .. } => Self::Completed,
            RecordState::Released => Self::Released,
        }
    }

    /// `in_flight`, `completed` or `released`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InFlight => "in_flight",
            Self::Completed => "completed",
            Self::Released => "released",
        }
    }
}

/// One record of a listing ([`Store::list_in_flight`]): its key as stored, and the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The record's key (each part as stored: bounded, see [`RecordKey`]).
    pub key: RecordKey,
    /// The record.
    pub record: Record,
}

/// What a store holds right now ([`Store::stats`]), counted at the store's time `now`. Records past
/// retention that no sweep deleted yet count as `forgotten`, not in their state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// In flight (a handler running, or a dead worker's claim until its lease ends).
    pub in_flight: u64,
    /// Completed, before `expires_at`: replayed.
    pub completed: u64,
    /// Released, waiting for their request's retry.
    pub released: u64,
    /// Past `expires_at`, within retention: answering 410.
    pub expired: u64,
    /// Past retention, not purged yet.
    pub forgotten: u64,
    /// The oldest in-flight record's creation, if any.
    pub oldest_in_flight: Option<Timestamp>,
    /// The store's time of the count.
    pub now: Timestamp,
}

impl Stats {
    /// Counts `records` at the store's time `now`: for stores that hold records as Rust values.
    pub fn count<'a>(records: impl IntoIterator<Item = &'a Record>, now: Timestamp) -> Self {
        let mut stats = Stats {
            now,
            ..Stats::default()
        };
        for record in records {
            if record.is_forgotten(now) {
                stats.forgotten += 1;
                continue;
            }
            match &record.state {
                RecordState::Released => stats.released += 1,
                _ if now >= record.expires_at => stats.expired += 1,
                RecordState::Completed { .. } => stats.completed += 1,
                RecordState::InFlight { .. } => {
                    stats.in_flight += 1;
                    let oldest = stats.oldest_in_flight.get_or_insert(record.created_at);
                    *oldest = (*oldest).min(record.created_at);
                }
            }
        }
        stats
    }
}

/// The storage contract. See the [module documentation](self) for the rules every backend keeps.
#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// Atomically claims `claim.key` as [`Claim::decide`] rules at the store's time: inserts a fresh
    /// in-flight record ([`Claim::record`]), takes over or resumes the record (new token and lease,
    /// its times kept), or returns it unchanged with the store's time ([`ClaimOutcome::Existing`]).
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError>;

    /// Stores `response` and marks the record completed, if it is in flight under `token`; otherwise
    /// fails with [`StoreErrorKind::Fenced`]. Wakes the key's subscribers.
    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError>;

    /// Marks the record [released](RecordState::Released) if it is in flight under `token` (the
    /// handler failed and a retry should run it again); otherwise fails with
    /// [`StoreErrorKind::Fenced`]. The next claim of the same request resumes it as the same record,
    /// and any other request's claim replaces it. Wakes the key's subscribers.
    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError>;

    /// Moves the lease of the claim in flight under `token` to `lease` from the store's time now, so
    /// that a handler still running is not taken over; otherwise (no record, another token,
    /// completed) fails with [`StoreErrorKind::Fenced`] and changes nothing. A claim that was taken
    /// over is never renewed.
    async fn renew(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError>;

    /// The record for `key`, if any and not past retention, with the store's time of the read.
    async fn get(&self, key: &RecordKey) -> Result<Option<Found>, StoreError>;

    /// A subscription that resolves once `key` may have been completed or released, by any process
    /// sharing the store. Subscribe before reading the record, so that no completion is missed.
    fn subscribe(&self, key: &RecordKey) -> Subscription;

    /// Tells the store that a duplicate is about to wait for `key`, so that completing or releasing it
    /// must wake waiters in every process. The engine calls it after [`subscribe`](Self::subscribe)
    /// and before it reads the record again, each time it is about to wait.
    ///
    /// Stores whose cross-process wake-up costs something on every completion (PostgreSQL's `NOTIFY`
    /// takes a lock held until commit, which serialises committing transactions) announce only keys
    /// that someone waits for. The order makes it safe: a completion either lands before the
    /// announcement, and the re-read sees it, or after, and sees the announcement. Stores that wake
    /// waiters without it keep the default, which does nothing. A store that wraps another must forward
    /// this call.
    async fn announce_waiter(&self, key: &RecordKey) -> Result<(), StoreError> {
        let _ = key;
        Ok(())
    }
    /// What kind of store this is (`memory`, `sqlite`, `postgres`, `mysql`, `redis`), for the `store` label
    /// of idem's [metrics](crate::metrics). A store that wraps another forwards it.
    fn kind(&self) -> &'static str {
        "custom"
    }

    // The operator's operations (see `Engine`'s `inspect`, `forget`, `erase`, `in_flight` and
    // `stats`). Every built-in store implements them; a custom store may leave them out, and they
    // then fail with `StoreErrorKind::Unsupported`. A store that wraps another forwards them.

    /// Deletes the record of `key` if it still carries `token` in a state of kind `state` (as the
    /// caller read it), so that a record claimed, completed or released since is left alone; wakes
    /// the key's waiters. Returns whether it deleted.
    async fn forget(
        &self,
        key: &RecordKey,
        token: FencingToken,
        state: StateKind,
    ) -> Result<bool, StoreError> {
        let _ = (key, token, state);
        Err(StoreError::unsupported("forget"))
    }

    /// Deletes at most `batch` records of `scope` (as stored: bounded, see [`RecordKey`]), whatever
    /// their state, bodies included; returns how many. Fewer than `batch` means none is left. Wakes
    /// their waiters.
    async fn erase_scope(&self, scope: &str, batch: usize) -> Result<u64, StoreError> {
        let _ = (scope, batch);
        Err(StoreError::unsupported("erase"))
    }

    /// At most `limit` in-flight records created at least `older_than` ago (at the store's time),
    /// oldest first, with the store's time.
    async fn list_in_flight(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> Result<(Vec<Listed>, Timestamp), StoreError> {
        let _ = (older_than, limit);
        Err(StoreError::unsupported("in-flight"))
    }

    /// What the store holds right now.
    async fn stats(&self) -> Result<Stats, StoreError> {
        Err(StoreError::unsupported("stats"))
    }
}

/// Deleting records past retention, in batches.
#[async_trait::async_trait]
pub trait Purge: Send + Sync + 'static {
    /// Deletes at most `batch` records whose `retain_until` is at or before the store's time now;
    /// returns how many. Fewer than `batch` means none was left to delete. Each call is short (one
    /// statement, or a few short critical sections), so it never holds long locks.
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError>;
}

#[async_trait::async_trait]
impl<S: Store + ?Sized> Store for std::sync::Arc<S> {
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        (**self).claim(claim).await
    }
    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        (**self).complete(key, token, response).await
    }
    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        (**self).release(key, token).await
    }
    async fn renew(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        (**self).renew(key, token, lease).await
    }
    async fn get(&self, key: &RecordKey) -> Result<Option<Found>, StoreError> {
        (**self).get(key).await
    }
    fn subscribe(&self, key: &RecordKey) -> Subscription {
        (**self).subscribe(key)
    }
    async fn announce_waiter(&self, key: &RecordKey) -> Result<(), StoreError> {
        (**self).announce_waiter(key).await
    }
    fn kind(&self) -> &'static str {
        (**self).kind()
    }
    async fn forget(
        &self,
        key: &RecordKey,
        token: FencingToken,
        state: StateKind,
    ) -> Result<bool, StoreError> {
        (**self).forget(key, token, state).await
    }
    async fn erase_scope(&self, scope: &str, batch: usize) -> Result<u64, StoreError> {
        (**self).erase_scope(scope, batch).await
    }
    async fn list_in_flight(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> Result<(Vec<Listed>, Timestamp), StoreError> {
        (**self).list_in_flight(older_than, limit).await
    }
    async fn stats(&self) -> Result<Stats, StoreError> {
        (**self).stats().await
    }
}

#[async_trait::async_trait]
impl<P: Purge + ?Sized> Purge for std::sync::Arc<P> {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        (**self).purge_expired(batch).await
    }
}
