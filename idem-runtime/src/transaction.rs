//! Transactional mode: the claim, the handler's own writes and the stored response commit together,
//! in one database transaction (PostgreSQL or SQLite).
//!
//! Without it, a request costs the application's commit plus idem's own (the claim, then the
//! completion), and a crash between the application's commit and idem's completion leaves an effect
//! without its stored response: the key's lease runs out and a retry runs the handler **again**
//! (idem's guarantee is then *at most once per lease*). In transactional mode:
//!
//! 1. The key is first looked up outside any transaction (one primary-key read). A completed,
//!    mismatched or expired key is answered from that read: **replays and rejections never open a
//!    transaction nor take a write lock.**
//! 2. Otherwise, once no identical request of this process has a transaction open (below), a
//!    transaction is opened and the key is claimed *inside it*: an uncommitted in-flight record.
//! 3. The handler writes through the same transaction ([`Tx`]).
//! 4. The response is stored into the record in the same transaction, which then commits.
//!
//! A 5xx response, a panic, a cancelled request, a crash or a lost connection anywhere before the
//! commit rolls everything back: the claim, the business writes and the response vanish together,
//! and a retry runs the handler as if for the first time. After the commit, both exist, and a retry
//! replays. **The effect happens exactly once**, whatever fails. For PostgreSQL it costs the
//! business transaction one round trip (the completion's `UPDATE`) and no extra commit, plus one
//! plain read before the transaction opens (which is all a replay costs): a fresh key's claim is
//! made by the message that opens the transaction (its `INSERT`, then the `BEGIN`). Counted on the
//! wire by `cargo run --release -p idem-bench -- roundtrips`.
//!
//! # Duplicates wait for the key's turn, then on the unique index
//!
//! The in-flight record is uncommitted, so nobody else can see it: an identical request that
//! arrives meanwhile finds nothing in its look-up.
//!
//! **In the same process**, it then finds the key's *turn* taken: a request takes it before it
//! opens a transaction and keeps it until its claim commits or rolls back (the turns are the
//! store's, shared by every `Transactional` on it). The duplicate waits for that turn to end,
//! bounded by the policy's `wait`, holding no database connection, and reads the key again: it
//! replays the committed response, or after a rollback claims the key itself. So a burst of
//! retries of one slow request holds one connection, not the pool (measured: `cargo run --release
//! -p idem-bench -- contention`, and `a_duplicate_storm_leaves_the_pool_to_other_keys` in the
//! PostgreSQL tests).
//!
//! **In another process** (or through another `PostgresStore` on the same database), it opens its
//! own transaction and tries to insert the same key, one request per process and key at a time:
//!
//! - **PostgreSQL** blocks that insert on the primary key until the first transaction ends. If it
//!   commits, the insert fails on the key, and a claim in a transaction of its own reads the
//!   completed record: the duplicate replays. If it rolls back, the duplicate's insert succeeds and
//!   it runs the handler. The wait is
//!   bounded by the policy's `wait` through `SET LOCAL lock_timeout` (sent in the message that opens
//!   the transaction), which the claim itself restores to the session's value once it holds the key,
//!   so the application's own statements in the transaction keep their usual lock timeout. The commit
//!   itself releases blocked inserts in every instance: no notification is needed.
//! - **SQLite** has one writer per database, so the transaction is `BEGIN IMMEDIATE`: it takes the
//!   write lock up front (never the read-to-write upgrade that fails with `SQLITE_BUSY` whatever the
//!   busy timeout). In this process, transactional claims queue on the store's fair write gate,
//!   bounded by `wait`; another process is waited out with the connection's busy timeout. Every
//!   other write to the file waits for the transaction too: that is SQLite.
//!
//! A duplicate still waiting, for the turn or on the index, when `wait` runs out gets
//! [`Rejection::InFlight`] (HTTP 409 with `Retry-After`).
//!
//! # No leases, no takeover
//!
//! A transactional claim is never visible as in flight: a dead worker's transaction is rolled back
//! by the database (its connection closes), which releases the waiting duplicates. There is nothing
//! to take over, and the lease is irrelevant. (A committed in-flight record can only come from a
//! non-transactional claim on the same store, such as a handler before it was switched to
//! transactional mode; it is waited for, or taken over once its lease runs out, as usual.)
//!
//! # Isolation
//!
//! The transaction uses the database's default isolation level (READ COMMITTED on PostgreSQL unless
//! configured otherwise). Under REPEATABLE READ or SERIALIZABLE, a duplicate from another process
//! blocked on the key fails once the original commits (on the key, or with a serialization error);
//! the claim then starts over with a new transaction and replays. (A duplicate in the same process waits for the
//! turn instead, and its fresh look-up sees the commit.)
//!
//! # Use by hand
//!
//! ```no_run
//! // The same with `store::postgres::PostgresStore` (feature `postgres`).
//! use idem_runtime::store::sqlite::SqliteStore;
//! use idem_runtime::transaction::{Transactional, TxBegin};
//! use idem_runtime::{sqlx, Engine, Fingerprint, Policy, RecordKey, StoredResponse};
//! use std::sync::Arc;
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = Arc::new(SqliteStore::connect("sqlite://app.db?mode=rwc").await?);
//! let txn = Transactional::new(Engine::from_arc(store.clone()), store)?;
//!
//! let key = RecordKey::new("user-7", "order-42");
//! let fp = Fingerprint::of_request("POST", "/orders", None, b"two apples");
//! match txn.begin(key, fp, &Policy::new()).await? {
//!     TxBegin::Execute(mut claim) => {
//!         sqlx::query("INSERT INTO orders (item, qty) VALUES ('apple', 2)")
//!             .execute(&mut **claim.tx())
//!             .await?;
//!         let response = StoredResponse { status: 201, headers: vec![], body: "created".into() };
//!         claim.complete(&response).await?; // stores the response and commits
//!     }
//!     TxBegin::Replay(replay) => println!("already done: {}", replay.response.status),
//! }
//! # Ok(())
//! # }
//! ```

use crate::clock::Timestamp;
use crate::engine::{classify, Engine, Found, Rejection, Replay, IN_FLIGHT_RETRY_AFTER};
use crate::fingerprint::Fingerprint;
use crate::metrics::Outcome;
use crate::policy::Policy;
use crate::record::{FencingToken, Record, RecordKey, StoredResponse};
use crate::store::{Claim, ClaimOutcome, Store, StoreError};
use crate::wait::{DuplicateWait, Timers};
use sqlx::{Database, Transaction};
use std::error::Error as _;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;
use turns::{Turn, Waited};

mod turns;
#[doc(hidden)]
pub use turns::Turns;

/// How often a claim starts over after a serialization failure (each one means a concurrent
/// transaction committed the key, so the next look-up settles it; the bound rules out a loop).
const MAX_RETRIES: usize = 16;

/// The `Retry-After` hint when a duplicate is still blocked at the end of its wait: the original's
/// transaction is running, and how long it will take is unknown.
const BLOCKED_RETRY_AFTER: Duration = Duration::from_secs(1);

pub(crate) mod sealed {
    #[allow(unreachable_pub)]
    pub trait Sealed {}
}

/// Why a transactional step did not go through.
#[doc(hidden)]
#[derive(Debug)]
pub enum TxFailure {
    /// Still blocked on another transaction when the wait ran out.
    Busy,
    /// A serialization failure: start over with a new transaction.
    Retry,
    /// The store failed.
    Store(StoreError),
}

/// An open transaction, and on SQLite the write gate it holds.
#[doc(hidden)]
#[derive(Debug)]
pub struct OpenTx<DB: Database> {
    pub(crate) tx: Transaction<'static, DB>,
    pub(crate) gate: Option<OwnedMutexGuard<()>>,
}

/// A store whose records can be claimed inside the application's own transaction: the
/// PostgreSQL (`store::postgres::PostgresStore`, feature `postgres`) and SQLite
/// (`store::sqlite::SqliteStore`, feature `sqlite`) stores. Sealed: its methods are idem's
/// internals; use it through [`Transactional`].
#[async_trait::async_trait]
pub trait TransactionalStore: Store + sealed::Sealed {
    /// The sqlx database the store lives in.
    type Database: Database;

    /// Opens a transaction on the store's pool, waiting at most `wait` for the right to write.
    #[doc(hidden)]
    async fn open(&self, wait: Duration) -> Result<OpenTx<Self::Database>, TxFailure>;

    /// Opens a transaction that already holds a fresh claim of `claim.key`, made by the message that
    /// opens it (blocking at most `wait` on a concurrent claim of the same key), so the claim costs
    /// the business transaction no round trip of its own. `Ok(None)` if the key has a record, which
    /// [`open`](Self::open) and [`claim_in`](Self::claim_in) then settle with the record in view;
    /// also what a store that cannot do this returns, without a round trip (the default).
    #[doc(hidden)]
    async fn open_claimed(
        &self,
        wait: Duration,
        claim: &Claim<'_>,
    ) -> Result<Option<OpenTx<Self::Database>>, TxFailure> {
        let _ = (wait, claim);
        Ok(None)
    }

    /// Claims inside `tx`, blocking at most as long as `open` was told on a concurrent claim of the
    /// same key.
    #[doc(hidden)]
    async fn claim_in(
        &self,
        tx: &mut Transaction<'static, Self::Database>,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome, TxFailure>;

    /// Stores the response in `tx` (not committed yet).
    #[doc(hidden)]
    async fn complete_in(
        &self,
        tx: &mut Transaction<'static, Self::Database>,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError>;

    /// Wakes this process's waiters after a commit.
    #[doc(hidden)]
    fn committed(&self, key: &RecordKey);

    /// Which keys have a transactional claim open in this process (see the module documentation):
    /// one set per store, shared by every [`Transactional`] on it (on SQLite, by every handle on the
    /// same file).
    #[doc(hidden)]
    fn turns(&self) -> &Arc<Turns>;
}

/// The database error code behind a store error, if any (`55P03`, `40001`, `5`, ...).
pub(crate) fn db_code(error: &StoreError) -> Option<String> {
    let sqlx_error = error.source()?.downcast_ref::<sqlx::Error>()?;
    Some(sqlx_error.as_database_error()?.code()?.into_owned())
}

/// The engine's store was not the one given to [`Transactional::new`].
#[derive(Debug, thiserror::Error)]
#[error("the engine runs on another store: build it with `Engine::from_arc(store.clone())` from the store given to `Transactional::new`")]
pub struct StoreMismatch;

/// An [`Engine`] whose claims can run inside the application's transaction. Cheap to clone. Put it in
/// the router state (`FromRef`) for handlers declared `#[idempotent(transaction = "tx")]`.
pub struct Transactional<S: TransactionalStore> {
    engine: Engine,
    store: Arc<S>,
}

impl<S: TransactionalStore> Clone for Transactional<S> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            store: self.store.clone(),
        }
    }
}

impl<S: TransactionalStore> std::fmt::Debug for Transactional<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transactional")
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

/// What to do with a request in transactional mode.
#[derive(Debug)]
pub enum TxBegin<S: TransactionalStore> {
    /// This request holds the key in an open transaction: write through [`TxClaim::tx`], then
    /// [`TxClaim::complete`] (which commits) or [`TxClaim::rollback`].
    Execute(TxClaim<S>),
    /// The key was completed (committed) by an earlier identical request: answer with this.
    Replay(Replay),
}

enum Next<S: TransactionalStore> {
    Done(Result<TxBegin<S>, Rejection>),
    Wait { lease_until: Timestamp },
}

impl<S: TransactionalStore> Transactional<S> {
    /// Transactional claims on `store`, with `engine`'s clock, timeouts and counters. The engine
    /// must run on this very store (`Engine::from_arc(store.clone())`), so that non-transactional
    /// handlers and transactional ones share their records.
    pub fn new(engine: Engine, store: Arc<S>) -> Result<Self, StoreMismatch> {
        let engine_store = Arc::as_ptr(engine.store()).cast::<u8>();
        if !std::ptr::eq(engine_store, Arc::as_ptr(&store).cast::<u8>()) {
            return Err(StoreMismatch);
        }
        Ok(Self { engine, store })
    }

    /// The engine (for non-transactional handlers on the same store, and the counters).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The store.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// How many requests on this store in this process wait right now for an identical request's
    /// open transaction to end before they read the key again.
    ///
    /// Public, hidden, for the tests that synchronise on it; not a stable API.
    #[doc(hidden)]
    pub fn waiting_for_turns(&self) -> usize {
        self.store.turns().waiting()
    }

    /// Bounds a step that may legitimately block for `wait`: by `wait` plus the engine's store
    /// timeout, so a hung connection still ends.
    async fn bounded<T>(
        &self,
        wait: Duration,
        fut: impl Future<Output = Result<T, TxFailure>>,
    ) -> Result<T, TxFailure> {
        match self.engine.store_timeout() {
            Some(limit) => match tokio::time::timeout(limit.saturating_add(wait), fut).await {
                Ok(result) => result,
                Err(elapsed) => Err(TxFailure::Store(StoreError::unavailable(elapsed))),
            },
            None => fut.await,
        }
    }

    /// Decides what to do with one request (see the [module documentation](self)): replay or reject
    /// from a plain read, or claim the key in a new transaction, waiting up to `policy.wait` for an
    /// identical request's transaction to end.
    pub async fn begin(
        &self,
        key: RecordKey,
        fingerprint: Fingerprint,
        policy: &Policy,
    ) -> Result<TxBegin<S>, Rejection> {
        let engine = &self.engine;
        let deadline = Instant::now() + policy.wait;
        let mut wait = DuplicateWait::default();
        let mut waited_for_turn = false;
        let mut retries = 0;
        loop {
            let now = engine.now();
            let claim = Claim::fresh(&key, fingerprint, now, policy);
            // 1. A plain read: replays and rejections never open a transaction.
            let found = match engine.call(self.store.get(&key, now)).await {
                Ok(found) => found,
                Err(e) => return Err(engine.unavailable(e, &key, policy)),
            };
            // Nothing the read can see: the key is fresh unless a record past retention, or an
            // identical request's uncommitted claim, stands in the way.
            let fresh = found.is_none();
            let next = match found {
                Some(record) if !record.can_take_over(&claim) => Some(self.decide(
                    record,
                    fingerprint,
                    now,
                    &key,
                    policy,
                    wait.waited() || waited_for_turn,
                )),
                _ => None,
            };
            let next = match next {
                Some(next) => next,
                None => {
                    // 2. This process's turn for the key: an identical request's transaction is
                    // waited out here, without a connection.
                    let turns = self.store.turns();
                    let turn = match turns.take(&key) {
                        Ok(turn) => turn,
                        Err(held) => {
                            waited_for_turn = true;
                            if turns.wait(held, deadline).await == Waited::TimedOut {
                                engine.record(Outcome::Conflict, &key, policy);
                                return Err(Rejection::InFlight {
                                    retry_after: BLOCKED_RETRY_AFTER,
                                });
                            }
                            continue;
                        }
                    };
                    // 3. A fresh key, claimed by the message that opens the transaction.
                    if fresh {
                        let wait = deadline.saturating_duration_since(Instant::now());
                        match self
                            .bounded(wait, self.store.open_claimed(wait, &claim))
                            .await
                        {
                            Ok(Some(open)) => {
                                engine.record(Outcome::of_claim(false), &key, policy);
                                let made = (claim.token, claim.expires_at);
                                return Ok(self.execute(open, key, made, false, turn, policy));
                            }
                            Ok(None) => {}
                            Err(failure) => {
                                match self.failed(failure, &key, policy, &mut retries) {
                                    Some(rejection) => return Err(rejection),
                                    None => continue,
                                }
                            }
                        }
                    }
                    // 4. A record to take over, or one the opening message met (or a store that
                    // claims apart from opening): claim inside a new transaction with the record
                    // in view, in what is left of the wait.
                    let wait = deadline.saturating_duration_since(Instant::now());
                    let mut open = match self.bounded(wait, self.store.open(wait)).await {
                        Ok(open) => open,
                        Err(failure) => match self.failed(failure, &key, policy, &mut retries) {
                            Some(rejection) => return Err(rejection),
                            None => continue,
                        },
                    };
                    match self
                        .bounded(wait, self.store.claim_in(&mut open.tx, &claim))
                        .await
                    {
                        Ok(ClaimOutcome::Claimed { taken_over }) => {
                            engine.record(Outcome::of_claim(taken_over), &key, policy);
                            let made = (claim.token, claim.expires_at);
                            return Ok(self.execute(open, key, made, taken_over, turn, policy));
                        }
                        Ok(ClaimOutcome::Existing(record)) => {
                            // Read-only so far: ending it undoes nothing, and frees SQLite's writer.
                            rollback(open).await;
                            self.decide(record, fingerprint, now, &key, policy, true)
                        }
                        Err(failure) => {
                            rollback(open).await;
                            match self.failed(failure, &key, policy, &mut retries) {
                                Some(rejection) => return Err(rejection),
                                None => continue,
                            }
                        }
                    }
                }
            };
            match next {
                Next::Done(result) => return result,
                Next::Wait { lease_until } => {
                    // A committed in-flight record: a non-transactional claim on the same store.
                    let lease_left = now.until(lease_until);
                    if Instant::now() >= deadline {
                        engine.record(Outcome::Conflict, &key, policy);
                        // As in the default mode: a short hint, never the lease's end, which can
                        // exceed a client's whole retry deadline.
                        return Err(Rejection::InFlight {
                            retry_after: IN_FLIGHT_RETRY_AFTER,
                        });
                    }
                    let wake = deadline.min(Instant::now() + lease_left);
                    if let Err(e) = wait
                        .step(engine, self.store.as_ref(), &key, wake, Timers::Tokio)
                        .await
                    {
                        return Err(engine.unavailable(e, &key, policy));
                    }
                }
            }
        }
    }

    /// The right to run the handler, for `key` claimed in `open` with `(token, expires_at)`.
    fn execute(
        &self,
        open: OpenTx<S::Database>,
        key: RecordKey,
        (token, expires_at): (FencingToken, Timestamp),
        taken_over: bool,
        turn: Turn,
        policy: &Policy,
    ) -> TxBegin<S> {
        TxBegin::Execute(TxClaim {
            tx: Tx::owned(open.tx),
            gate: open.gate,
            store: self.store.clone(),
            engine: self.engine.clone(),
            expires_at,
            token,
            key,
            taken_over,
            armed: true,
            handler: policy.handler,
            _turn: turn,
        })
    }

    /// A rejection for `failure`, or `None` to start over.
    fn failed(
        &self,
        failure: TxFailure,
        key: &RecordKey,
        policy: &Policy,
        retries: &mut usize,
    ) -> Option<Rejection> {
        match failure {
            TxFailure::Busy => {
                self.engine.record(Outcome::Conflict, key, policy);
                Some(Rejection::InFlight {
                    retry_after: BLOCKED_RETRY_AFTER,
                })
            }
            TxFailure::Retry if *retries < MAX_RETRIES => {
                *retries += 1;
                None
            }
            TxFailure::Retry => Some(self.engine.unavailable(
                StoreError::unavailable(format!(
                    "claim of {key} did not settle after {MAX_RETRIES} serialization failures"
                )),
                key,
                policy,
            )),
            TxFailure::Store(e) => Some(self.engine.unavailable(e, key, policy)),
        }
    }

    fn decide(
        &self,
        record: Record,
        fingerprint: Fingerprint,
        now: Timestamp,
        key: &RecordKey,
        policy: &Policy,
        waited: bool,
    ) -> Next<S> {
        let engine = &self.engine;
        match classify(record, fingerprint, now) {
            Found::Expired { expires_at } => {
                engine.record(Outcome::Expired, key, policy);
                Next::Done(Err(Rejection::Expired {
                    expired_at: expires_at,
                }))
            }
            Found::Mismatch { expires_at } => {
                engine.record(Outcome::Mismatch, key, policy);
                Next::Done(Err(Rejection::Mismatch { expires_at }))
            }
            Found::Completed {
                response,
                expires_at,
            } => {
                if waited {
                    engine.record(Outcome::Waited, key, policy);
                }
                engine.record(Outcome::Replayed, key, policy);
                Next::Done(Ok(TxBegin::Replay(Replay {
                    response,
                    expires_at,
                })))
            }
            Found::InFlight { lease_until } => Next::Wait { lease_until },
        }
    }

    /// A transaction without a claim, for requests the policy lets through without a key.
    #[cfg(feature = "axum")]
    pub(crate) async fn open_unprotected(
        &self,
        policy: &Policy,
    ) -> Result<Unprotected<S::Database>, StoreError> {
        match self
            .bounded(policy.wait, self.store.open(policy.wait))
            .await
        {
            Ok(open) => Ok(Unprotected {
                tx: Tx::owned(open.tx),
                _gate: open.gate,
            }),
            Err(TxFailure::Store(e)) => Err(e),
            Err(TxFailure::Busy | TxFailure::Retry) => Err(StoreError::unavailable(
                "the database stayed busy for the policy's whole wait",
            )),
        }
    }
}

async fn rollback<DB: Database>(open: OpenTx<DB>) {
    if let Err(e) = open.tx.rollback().await {
        tracing::debug!(target: "idem", error = %e, "rollback failed; the connection is discarded");
    }
}

/// The right to run the handler for one key, inside an open transaction. Write through
/// [`tx`](Self::tx); then [`complete`](Self::complete) stores the response and commits, or
/// [`rollback`](Self::rollback) (also what dropping it does) leaves no trace: no claim, no writes.
pub struct TxClaim<S: TransactionalStore> {
    // Dropped first: the transaction's rollback is queued before SQLite's write gate opens.
    tx: Tx<S::Database>,
    gate: Option<OwnedMutexGuard<()>>,
    store: Arc<S>,
    engine: Engine,
    key: RecordKey,
    token: FencingToken,
    expires_at: Timestamp,
    taken_over: bool,
    armed: bool,
    handler: &'static str,
    /// Dropped last, when the transaction has committed or rolled back; a local duplicate then
    /// reads the key again. When the claim is dropped instead (a cancelled request, a panic),
    /// sqlx has only queued the rollback, which it runs as the connection returns to the pool: a
    /// duplicate woken meanwhile waits for it on the unique index (PostgreSQL) or for the write
    /// lock (SQLite), as one from another process would.
    _turn: Turn,
}

impl<S: TransactionalStore> std::fmt::Debug for TxClaim<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxClaim")
            .field("key", &self.key)
            .field("token", &self.token)
            .field("expires_at", &self.expires_at)
            .finish_non_exhaustive()
    }
}

impl<S: TransactionalStore> TxClaim<S> {
    /// The claimed key.
    pub fn key(&self) -> &RecordKey {
        &self.key
    }

    /// This claim's fencing token.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// Until when the key will be remembered, once committed.
    pub fn expires_at(&self) -> Timestamp {
        self.expires_at
    }

    /// Whether this claim took over a non-transactional claim whose lease had run out.
    pub fn taken_over(&self) -> bool {
        self.taken_over
    }

    /// The transaction, for the handler's writes.
    pub fn tx(&mut self) -> &mut Tx<S::Database> {
        &mut self.tx
    }

    /// Stores `response` in the record and commits: the claim, every write made through
    /// [`tx`](Self::tx) and the response become durable together. On an error nothing is committed
    /// (or, if the connection died during the commit, the outcome is unknown and the next request
    /// with the key finds out): the caller must not report success.
    pub async fn complete(mut self, response: &StoredResponse) -> Result<(), StoreError> {
        self.armed = false;
        let result = self.finish(response).await;
        if let Err(e) = &result {
            self.engine.metrics().record(Outcome::CompletionFailed);
            tracing::warn!(target: "idem", handler = self.handler, scope = %self.key.scope,
                key = %self.key.key, error = %e, "transaction could not be completed; nothing was committed");
        }
        result
    }

    async fn finish(&mut self, response: &StoredResponse) -> Result<(), StoreError> {
        let Some(mut tx) = self.tx.inner.take() else {
            return Err(StoreError::unavailable(
                "the transaction handle was not returned by the handler",
            ));
        };
        self.engine
            .call(
                self.store
                    .complete_in(&mut tx, &self.key, self.token, response),
            )
            .await?;
        self.engine
            .call(async { tx.commit().await.map_err(StoreError::unavailable) })
            .await?;
        drop(self.gate.take());
        self.store.committed(&self.key);
        Ok(())
    }

    /// Rolls back: the claim and the handler's writes vanish, and the next request with the key runs
    /// as new.
    pub async fn rollback(mut self) -> Result<(), StoreError> {
        self.armed = false;
        self.engine.metrics().record(Outcome::Released);
        let Some(tx) = self.tx.inner.take() else {
            return Ok(());
        };
        let result = self
            .engine
            .call(async { tx.rollback().await.map_err(StoreError::unavailable) })
            .await;
        drop(self.gate.take());
        result
    }
}

impl<S: TransactionalStore> Drop for TxClaim<S> {
    fn drop(&mut self) {
        if self.armed {
            // The transaction rolls back as it is dropped (sqlx queues the ROLLBACK).
            self.engine.metrics().record(Outcome::Released);
        }
    }
}

/// A transaction without a claim (requests passed through without a key).
#[cfg(feature = "axum")]
pub(crate) struct Unprotected<DB: Database> {
    pub(crate) tx: Tx<DB>,
    _gate: Option<OwnedMutexGuard<()>>,
}

#[cfg(feature = "axum")]
impl<DB: Database> Unprotected<DB> {
    pub(crate) async fn commit(mut self) -> Result<(), StoreError> {
        match self.tx.inner.take() {
            Some(tx) => tx.commit().await.map_err(StoreError::unavailable),
            None => Err(StoreError::unavailable(
                "the transaction handle was not returned by the handler",
            )),
        }
    }
}

type Home<DB> = Arc<Mutex<Option<Transaction<'static, DB>>>>;

/// The handler's transaction in transactional mode: the parameter named by
/// `#[idempotent(transaction = "...")]`, or [`TxClaim::tx`] by hand. It dereferences to the
/// database connection, so queries run on it with `&mut *tx`:
///
/// ```no_run
/// # use idem_runtime::{sqlx, Tx};
/// # async fn write(mut tx: Tx<sqlx::Sqlite>) -> Result<(), sqlx::Error> {
/// sqlx::query("INSERT INTO payments (amount) VALUES (?)")
///     .bind(1000_i64)
///     .execute(&mut *tx)
///     .await?;
/// # Ok(())
/// # }
/// ```
///
/// idem commits it after the handler returns (with the stored response) or rolls it back (5xx,
/// panic, cancellation). Do not `COMMIT` or `ROLLBACK` on it yourself, and do not keep it past the
/// handler (in a spawned task): the request then fails with a 500 and the transaction rolls back.
pub struct Tx<DB: Database> {
    inner: Option<Transaction<'static, DB>>,
    /// Where the transaction goes when this handle is dropped, for idem to complete it.
    home: Option<Home<DB>>,
}

impl<DB: Database> std::fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx")
            .field("open", &self.inner.is_some())
            .finish_non_exhaustive()
    }
}

impl<DB: Database> Tx<DB> {
    fn owned(tx: Transaction<'static, DB>) -> Self {
        Self {
            inner: Some(tx),
            home: None,
        }
    }

    /// Moves the transaction into a new handle that sends it back here when dropped (the handler's
    /// parameter); [`Lent::restore`] takes it back.
    #[cfg(feature = "axum")]
    pub(crate) fn lend(&mut self) -> (Tx<DB>, Lent<DB>) {
        let home: Home<DB> = Arc::new(Mutex::new(None));
        let lent = Tx {
            inner: self.inner.take(),
            home: Some(home.clone()),
        };
        (lent, Lent { home })
    }
}

/// A transaction lent to a handler.
#[cfg(feature = "axum")]
pub(crate) struct Lent<DB: Database> {
    home: Home<DB>,
}

#[cfg(feature = "axum")]
impl<DB: Database> Lent<DB> {
    /// Puts the transaction back into `tx`; false if the handler kept it.
    pub(crate) fn restore(self, tx: &mut Tx<DB>) -> bool {
        let back = self
            .home
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let returned = back.is_some();
        tx.inner = back;
        returned
    }
}

impl<DB: Database> Drop for Tx<DB> {
    fn drop(&mut self) {
        if let (Some(tx), Some(home)) = (self.inner.take(), &self.home) {
            *home.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
        }
        // Otherwise the transaction (if any) drops here, and sqlx rolls it back.
    }
}

impl<DB: Database> Deref for Tx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        self.inner
            .as_deref()
            .expect("an idem Tx holds its transaction until dropped")
    }
}

impl<DB: Database> DerefMut for Tx<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.inner
            .as_deref_mut()
            .expect("an idem Tx holds its transaction until dropped")
    }
}

/// A type that `#[idempotent(transaction = "...")]` accepts for its transaction parameter.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idem transaction type",
    label = "the `transaction` parameter must be `idem_runtime::Tx<Postgres>` or `idem_runtime::Tx<Sqlite>`",
    note = "write the parameter as `tx: idem_runtime::Tx<idem_runtime::sqlx::Postgres>` (or `Sqlite`) and run queries on it with `&mut *tx`"
)]
pub trait TxHandle: sealed::Sealed + Send + 'static {
    /// The store whose transactions this handle carries.
    type Store: TransactionalStore;

    /// The handle itself (the identity: `Self` is `Tx` of the store's database).
    #[doc(hidden)]
    fn from_tx(tx: Tx<<Self::Store as TransactionalStore>::Database>) -> Self;
}

#[cfg(feature = "postgres")]
impl sealed::Sealed for Tx<sqlx::Postgres> {}
#[cfg(feature = "postgres")]
impl TxHandle for Tx<sqlx::Postgres> {
    type Store = crate::store::postgres::PostgresStore;

    fn from_tx(tx: Self) -> Self {
        tx
    }
}

#[cfg(feature = "sqlite")]
impl sealed::Sealed for Tx<sqlx::Sqlite> {}
#[cfg(feature = "sqlite")]
impl TxHandle for Tx<sqlx::Sqlite> {
    type Store = crate::store::sqlite::SqliteStore;

    fn from_tx(tx: Self) -> Self {
        tx
    }
}

#[cfg(all(test, feature = "sqlite", feature = "axum"))]
mod tests {
    use super::*;
    use sqlx::sqlite::SqlitePool;

    async fn open_tx() -> Tx<sqlx::Sqlite> {
        let pool = SqlitePool::connect("sqlite::memory:").await.expect("pool");
        Tx::owned(pool.begin().await.expect("begin"))
    }

    /// The handler's `async move` block owns the lent handle; it comes back when the block ends,
    /// whether the body used it or not.
    #[tokio::test]
    async fn a_lent_transaction_comes_back_when_the_body_ends() {
        let mut tx = open_tx().await;
        let (lent, back) = tx.lend();
        let body = |mut tx: Tx<sqlx::Sqlite>| async move {
            sqlx::query("SELECT 1")
                .execute(&mut *tx)
                .await
                .expect("query");
        };
        body(lent).await;
        assert!(back.restore(&mut tx));
        assert!(tx.inner.is_some());

        let (lent, back) = tx.lend();
        let ignores_it = |_tx: Tx<sqlx::Sqlite>| async move {};
        ignores_it(lent).await;
        assert!(back.restore(&mut tx));
    }

    /// A body that moves the handle somewhere that outlives it leaves nothing to commit.
    #[tokio::test]
    async fn a_kept_transaction_is_reported() {
        let mut tx = open_tx().await;
        let (lent, back) = tx.lend();
        let kept = std::sync::Mutex::new(Vec::new());
        let body = |tx: Tx<sqlx::Sqlite>| {
            kept.lock().expect("lock").push(tx);
            async move {}
        };
        body(lent).await;
        assert!(!back.restore(&mut tx));
        assert!(tx.inner.is_none());
    }
}
