//! Transactional mode: the handler's database writes and its stored response commit together, in
//! one transaction of the database that also holds the records (PostgreSQL or SQLite).
//!
//! It follows the "atomic phases" design (Brandur Leach's, for Stripe-like APIs):
//!
//! 1. **Claim**, committed on its own: an in-flight record that every instance sees, as in the
//!    default mode. Duplicates wait for it without holding a connection; its lease is renewed while
//!    the handler runs; a dead worker's claim is taken over once its lease runs out.
//! 2. **Foreign calls** (a card network, an e-mail) outside any transaction: nothing holds a
//!    database lock or a pooled connection while they wait. Pass
//!    [`ClaimGuard::downstream_key`](crate::ClaimGuard::downstream_key) to every service that takes
//!    an idempotency key, so that an attempt after a crash repeats nothing there.
//! 3. **Business writes and the stored response**, in one transaction: [`Tx::conn`] begins it at its
//!    first use, and idem stores the response in it and commits after the handler returns.
//!
//! A crash before that commit leaves the claim in flight: its lease runs out, the retry takes it
//! over and runs the handler again, and none of the first run's writes exist (they were never
//! committed). After the commit, the writes and the response exist together and the retry
//! replays. So **database effects happen exactly once**, whatever fails and wherever; foreign
//! effects happen once per downstream key, as far as the service behind it deduplicates.
//!
//! A 5xx response, a panic or a failed commit rolls the transaction back and releases the key: the
//! retry runs as if for the first time. A handler that never calls [`Tx::conn`] (a validation
//! error, say) has its response stored as in the default mode.
//!
//! Write through the transaction after the foreign calls, not before: a transaction begun before a
//! slow call holds its connection, and on SQLite the database's one write lock, while it waits.
//!
//! # Use by hand
//!
//! ```no_run
//! // The same with `store::postgres::PostgresStore` (feature `postgres`).
//! use idem_runtime::store::sqlite::SqliteStore;
//! use idem_runtime::transaction::{Transactional, TxBegin};
//! use idem_runtime::{sqlx, Fingerprint, Policy, RecordKey, StoredResponse};
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let txn = Transactional::new(SqliteStore::connect("sqlite://app.db?mode=rwc").await?);
//!
//! let key = RecordKey::new("user-7", "order-42");
//! let fp = Fingerprint::of_request("POST", "/orders", None, b"two apples");
//! match txn.begin(key, fp, &Policy::new()).await? {
//!     TxBegin::Execute(mut claim) => {
//!         sqlx::query("INSERT INTO orders (item, qty) VALUES ('apple', 2)")
//!             .execute(claim.tx.conn().await?)
//!             .await?;
//!         let response = StoredResponse { status: 201, headers: vec![], body: "created".into() };
//!         claim.complete(&response).await?; // stores the response and commits
//!     }
//!     TxBegin::Replay(replay) => println!("already done: {}", replay.response.status),
//! }
//! # Ok(())
//! # }
//! ```

use crate::clock::Clock;
use crate::engine::{Begin, ClaimGuard, Engine, Rejection, Replay};
use crate::fingerprint::Fingerprint;
use crate::policy::Policy;
use crate::record::{RecordKey, StoredResponse};
use crate::store::StoreError;
use sqlx::Database;
use std::sync::Arc;
use std::time::Duration;

#[doc(hidden)]
pub use crate::store::tx::OpenTx;
pub use crate::store::tx::{TransactionalStore, Tx, TxHandle};

/// An [`Engine`] whose handlers can write in the transaction that stores their response. Cheap to
/// clone. Put it in the router state (`FromRef`) for handlers declared
/// `#[idempotent(transaction = "tx")]`.
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
pub enum TxBegin<DB: Database> {
    /// This request holds the key: write through [`TxClaim::tx`], then [`TxClaim::complete`].
    Execute(TxClaim<DB>),
    /// The key was completed by an earlier identical request: answer with this.
    Replay(Replay),
}

impl<S: TransactionalStore> Transactional<S> {
    /// Transactional handlers on `store`, with an [`Engine`] of their own on the same store (the
    /// system clock, a 5 s store timeout): [`engine`](Self::engine) serves the non-transactional
    /// handlers, so that both kinds share their records and counters. Configure that engine through
    /// [`with_store_timeout`](Self::with_store_timeout) and its siblings.
    ///
    /// ```no_run
    /// # use idem_runtime::{store::sqlite::SqliteStore, Transactional};
    /// # async fn run() -> Result<(), idem_runtime::StoreError> {
    /// let txn = Transactional::new(SqliteStore::connect("sqlite://app.db?mode=rwc").await?);
    /// let engine = txn.engine().clone(); // for the handlers without a transaction
    /// # let _ = engine;
    /// # Ok(())
    /// # }
    /// ```
    pub fn new(store: impl Into<Arc<S>>) -> Self {
        let store = store.into();
        let engine = Engine::from_arc(store.clone());
        Self { engine, store }
    }

    fn with_engine(mut self, f: impl FnOnce(Engine) -> Engine) -> Self {
        self.engine = f(self.engine);
        self
    }

    /// [`Engine::with_clock`] on this engine.
    pub fn with_clock(self, clock: impl Clock) -> Self {
        self.with_engine(|engine| engine.with_clock(clock))
    }

    /// [`Engine::with_store_timeout`] on this engine.
    pub fn with_store_timeout(self, timeout: Option<Duration>) -> Self {
        self.with_engine(|engine| engine.with_store_timeout(timeout))
    }

    /// [`Engine::with_unavailable_retry_after`] on this engine.
    pub fn with_unavailable_retry_after(self, after: Duration) -> Self {
        self.with_engine(|engine| engine.with_unavailable_retry_after(after))
    }

    /// The engine (for non-transactional handlers on the same store, and the counters).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The store.
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// A transaction handle on this store that begins at its first use.
    pub fn tx(&self) -> Tx<S::Database> {
        Tx::new(self.store.clone())
    }

    /// Decides what to do with one request, as [`Engine::begin`] does; an executing request gets a
    /// transaction handle besides its claim.
    pub async fn begin(
        &self,
        key: RecordKey,
        fingerprint: Fingerprint,
        policy: &Policy,
    ) -> Result<TxBegin<S::Database>, Rejection> {
        Ok(match self.engine.begin(key, fingerprint, policy).await? {
            Begin::Execute(guard) => TxBegin::Execute(TxClaim {
                guard,
                tx: self.tx(),
            }),
            Begin::Replay(replay) => TxBegin::Replay(replay),
        })
    }
}

/// The right to run the handler for one key, with the transaction its writes go to.
#[derive(Debug)]
pub struct TxClaim<DB: Database> {
    /// The claim: its key, its downstream key, [`keep_alive`](ClaimGuard::keep_alive).
    pub guard: ClaimGuard,
    /// The transaction, begun by its first [`Tx::conn`].
    pub tx: Tx<DB>,
}

impl<DB: Database> TxClaim<DB> {
    /// Stores `response` and commits: every write made through [`tx`](Self::tx) and the response
    /// become durable together. If the transaction never began, stores the response as
    /// [`ClaimGuard::complete`] does. If the commit fails, nothing was written and the key is
    /// released (a retry runs the handler again): the caller must not report success.
    pub async fn complete(self, response: &StoredResponse) -> Result<(), StoreError> {
        let TxClaim { guard, tx } = self;
        let Some((store, OpenTx { mut tx, _gate })) = tx.into_open() else {
            return guard.complete(response).await;
        };
        let committed = guard
            .keep_alive(async {
                store
                    .complete_in(&mut tx, guard.key(), guard.token(), response)
                    .await?;
                tx.commit().await.map_err(StoreError::from)
            })
            .await;
        drop(_gate);
        match committed {
            Ok(()) => {
                store.committed(guard.key());
                guard.settle();
                Ok(())
            }
            Err(error) => {
                tracing::warn!(target: "idem", key = %guard.key(), %error,
                    "the transaction could not commit; nothing was stored, releasing the key");
                // Fenced if the commit did land after all (the record is then completed).
                let _ = guard.release().await;
                Err(error)
            }
        }
    }

    /// Rolls the transaction back and releases the key: the next request with it runs as new.
    pub async fn rollback(self) -> Result<(), StoreError> {
        drop(self.tx);
        self.guard.release().await
    }
}
