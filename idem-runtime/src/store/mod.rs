//! The storage contract every backend implements, and the backends.
//!
//! A store keeps one [`Record`] per [`RecordKey`]. The contract is small and each method states its
//! atomicity; the engine builds all of idem's behaviour on it:
//!
//! - [`Store::claim`] is **one atomic step**: insert a fresh in-flight record, or take over a record
//!   whose lease ran out (same fingerprint, not expired), or return the existing record untouched. Never
//!   read-then-insert; never overwrite an in-flight or completed record any other way.
//! - [`Store::complete`], [`Store::release`] and [`Store::renew`] apply only if the record is in
//!   flight under the caller's [`FencingToken`]; otherwise they fail with
//!   [`StoreErrorKind::Fenced`] and change nothing.
//! - Records whose `retain_until` has passed count as absent everywhere (claim replaces them, get
//!   hides them) whether or not a sweeper has deleted them yet.
//! - [`Store::subscribe`] wakes waiters when a key is completed or released, in this process and, for
//!   shared stores, in every process that has [announced](Store::announce_waiter) a waiter.
//!
//! Purging is a separate capability, [`Purge`], used by the [`Sweeper`](crate::sweeper::Sweeper).

use crate::clock::Timestamp;
use crate::fingerprint::Fingerprint;
use crate::record::{FencingToken, Record, RecordKey, StoredResponse};
use std::error::Error as StdError;
use std::fmt;

pub use crate::waiters::{Subscription, Waiters};

pub mod memory;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod migrations;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub mod sqlite;

/// One claim attempt, with every instant already computed by the engine's clock so that stores never
/// read a clock of their own.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The key to claim.
    pub key: &'a RecordKey,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The token this claim will carry if it wins.
    pub token: FencingToken,
    /// The engine's current time.
    pub now: Timestamp,
    /// When the claim may be taken over if not completed.
    pub lease_until: Timestamp,
    /// When the key expires (only used for a fresh record; a takeover keeps the original's).
    pub expires_at: Timestamp,
    /// When the record may be purged (idem).
    pub retain_until: Timestamp,
}

impl<'a> Claim<'a> {
    /// A claim of `key` at `now` under `policy`, with a fresh fencing token: the lease, expiry and
    /// retention follow from the policy's durations.
    pub fn fresh(
        key: &'a RecordKey,
        fingerprint: Fingerprint,
        now: Timestamp,
        policy: &crate::policy::Policy,
    ) -> Self {
        Self {
            key,
            fingerprint,
            token: FencingToken::generate(),
            now,
            lease_until: now + policy.lease,
            expires_at: now + policy.ttl,
            retain_until: now + policy.retain,
        }
    }
}

impl Claim<'_> {
    /// The fresh in-flight record this claim inserts.
    pub fn record(&self) -> Record {
        Record {
            fingerprint: self.fingerprint,
            token: self.token,
            created_at: self.now,
            expires_at: self.expires_at,
            retain_until: self.retain_until,
            state: crate::record::RecordState::InFlight {
                lease_until: self.lease_until,
            },
        }
    }

    /// Whether this claim may take `record` over: in flight, lease run out, same request, not
    /// expired. Every store applies exactly this rule (in SQL, in Lua, or in Rust).
    pub fn can_take_over(&self, record: &Record) -> bool {
        matches!(record.state, crate::record::RecordState::InFlight { lease_until } if lease_until <= self.now)
            && record.fingerprint == self.fingerprint
            && self.now < record.expires_at
    }
}

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller now holds the key with `claim.token`; `taken_over` if it replaced a dead worker's claim.
    Claimed {
        /// Whether an earlier claim's lease had run out and was taken over.
        taken_over: bool,
    },
    /// Another request holds or held the key; the record as it stands (never past retention).
    Existing(Record),
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
#[cfg(any(feature = "sqlite", feature = "postgres"))]
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

/// The storage contract. See the [module documentation](self) for the rules every backend keeps.
#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// Atomically claims `claim.key`. In one step: if there is no record (or only one past
    /// retention), insert an in-flight record carrying `claim`'s token, lease, expiry and retention and
    /// return [`ClaimOutcome::Claimed`]; if the record [can be taken over](Claim::can_take_over),
    /// replace its token and lease (keeping its `created_at`, `expires_at` and `retain_until`) and return
    /// `Claimed { taken_over: true }`; otherwise return the record unchanged.
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError>;

    /// Stores `response` and marks the record completed, if it is in flight under `token`; otherwise
    /// fails with [`StoreErrorKind::Fenced`]. Wakes the key's subscribers.
    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError>;

    /// Deletes the record if it is in flight under `token` (the handler failed and a retry should run
    /// it again); otherwise fails with [`StoreErrorKind::Fenced`]. Wakes the key's subscribers.
    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError>;

    /// Moves the lease of the claim in flight under `token` to `lease_until`, so that a handler
    /// still running is not taken over; otherwise (no record, another token, completed) fails with
    /// [`StoreErrorKind::Fenced`] and changes nothing. A claim that was taken over is never renewed.
    async fn renew(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease_until: Timestamp,
    ) -> Result<(), StoreError>;

    /// The record for `key`, if any and not past retention at `now`.
    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, StoreError>;

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
    /// What kind of store this is (`memory`, `sqlite`, `postgres`, `redis`), for the `store` label
    /// of idem's [metrics](crate::metrics). A store that wraps another forwards it.
    fn kind(&self) -> &'static str {
        "custom"
    }
}

/// Deleting records past retention, in batches.
#[async_trait::async_trait]
pub trait Purge: Send + Sync + 'static {
    /// Deletes at most `batch` records whose `retain_until` is at or before `now`; returns how many.
    /// Fewer than `batch` means none was left to delete. Each call is short (one statement, or a few
    /// short critical sections), so it never holds long locks.
    async fn purge_expired(&self, now: Timestamp, batch: usize) -> Result<u64, StoreError>;
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
        lease_until: Timestamp,
    ) -> Result<(), StoreError> {
        (**self).renew(key, token, lease_until).await
    }
    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, StoreError> {
        (**self).get(key, now).await
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
}

#[async_trait::async_trait]
impl<P: Purge + ?Sized> Purge for std::sync::Arc<P> {
    async fn purge_expired(&self, now: Timestamp, batch: usize) -> Result<u64, StoreError> {
        (**self).purge_expired(now, batch).await
    }
}
