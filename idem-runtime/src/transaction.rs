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

use crate::engine::{Begin, ClaimGuard, Engine, Rejection, Replay};
use crate::fingerprint::Fingerprint;
use crate::policy::Policy;
use crate::record::{FencingToken, RecordKey, StoredResponse};
use crate::store::{Store, StoreError};
use sqlx::{Database, Transaction};
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::OwnedMutexGuard;

pub(crate) mod sealed {
    #[allow(unreachable_pub)]
    pub trait Sealed {}
}

/// An open transaction, and on SQLite the store's write gate, held until it ends.
#[doc(hidden)]
#[derive(Debug)]
pub struct OpenTx<DB: Database> {
    pub(crate) tx: Transaction<'static, DB>,
    pub(crate) _gate: Option<OwnedMutexGuard<()>>,
}

/// A store whose records can be completed inside the application's own transaction: the
/// PostgreSQL (`store::postgres::PostgresStore`, feature `postgres`) and SQLite
/// (`store::sqlite::SqliteStore`, feature `sqlite`) stores. Sealed: use it through
/// [`Transactional`].
#[async_trait::async_trait]
pub trait TransactionalStore: Store + sealed::Sealed {
    /// The sqlx database the store lives in.
    type Database: Database;

    /// Begins a transaction on the store's pool (on SQLite, `BEGIN IMMEDIATE`).
    #[doc(hidden)]
    async fn begin_tx(&self) -> Result<OpenTx<Self::Database>, sqlx::Error>;

    /// Stores the response of the claim in flight under `token` in `tx` (not committed yet);
    /// [`StoreErrorKind::Fenced`](crate::StoreErrorKind::Fenced) if the claim is not current.
    #[doc(hidden)]
    async fn complete_in(
        &self,
        tx: &mut Transaction<'static, Self::Database>,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError>;

    /// Wakes this process's waiters for `key` after a commit.
    #[doc(hidden)]
    fn committed(&self, key: &RecordKey);
}

/// The engine's store was not the one given to [`Transactional::new`].
#[derive(Debug, thiserror::Error)]
#[error("the engine runs on another store: build it with `Engine::from_arc(store.clone())` from the store given to `Transactional::new`")]
pub struct StoreMismatch;

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
    /// Transactional handlers on `store`, with `engine`'s clock, timeouts and counters. The engine
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

    /// A transaction handle on this store that begins at its first use.
    pub fn tx(&self) -> Tx<S::Database> {
        Tx {
            store: self.store.clone(),
            open: None,
            home: None,
        }
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
        let TxClaim { guard, mut tx } = self;
        let store = tx.store.clone();
        let Some(OpenTx { mut tx, _gate }) = tx.open.take() else {
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

type Home<DB> = Arc<Mutex<Option<OpenTx<DB>>>>;

/// The handler's transaction in transactional mode: the parameter named by
/// `#[idempotent(transaction = "...")]`, or [`TxClaim::tx`] by hand. [`conn`](Self::conn) begins
/// the transaction on first use and gives its connection:
///
/// ```no_run
/// # use idem_runtime::{sqlx, Tx};
/// # async fn write(mut tx: Tx<sqlx::Sqlite>) -> Result<(), sqlx::Error> {
/// // ... the card network's answer first, outside any transaction ...
/// sqlx::query("INSERT INTO payments (amount) VALUES (?)")
///     .bind(1000_i64)
///     .execute(tx.conn().await?)
///     .await?;
/// # Ok(())
/// # }
/// ```
///
/// idem commits it after the handler returns (with the stored response) or rolls it back (5xx,
/// panic). Do not `COMMIT` or `ROLLBACK` on it yourself, and do not keep it past the handler (in a
/// spawned task): the request then fails with a 500 and the transaction rolls back.
pub struct Tx<DB: Database> {
    store: Arc<dyn TransactionalStore<Database = DB>>,
    open: Option<OpenTx<DB>>,
    /// Where the transaction goes when this handle is dropped, for idem to commit it.
    home: Option<Home<DB>>,
}

impl<DB: Database> std::fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx")
            .field("begun", &self.open.is_some())
            .finish_non_exhaustive()
    }
}

impl<DB: Database> Tx<DB> {
    /// The transaction's connection, beginning the transaction if this is its first use. On
    /// SQLite the transaction takes the database's write lock (`BEGIN IMMEDIATE`) until idem
    /// commits it. A pool with no free connection answers [`sqlx::Error::PoolTimedOut`].
    pub async fn conn(&mut self) -> Result<&mut DB::Connection, sqlx::Error> {
        let open = match &mut self.open {
            Some(open) => open,
            open => open.insert(self.store.begin_tx().await?),
        };
        Ok(&mut *open.tx)
    }

    /// Whether the transaction has begun.
    pub fn is_begun(&self) -> bool {
        self.open.is_some()
    }

    /// Commits the transaction, if it began.
    #[cfg(feature = "axum")]
    pub(crate) async fn commit(mut self) -> Result<(), sqlx::Error> {
        match self.open.take() {
            Some(open) => open.tx.commit().await,
            None => Ok(()),
        }
    }

    /// A handle for the handler that sends the transaction back here when dropped, and the way
    /// back ([`Lent::restore`]).
    #[cfg(feature = "axum")]
    pub(crate) fn lend(&mut self) -> (Tx<DB>, Lent<DB>) {
        let home: Home<DB> = Arc::new(Mutex::new(None));
        let lent = Tx {
            store: self.store.clone(),
            open: self.open.take(),
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
    /// Puts the transaction (if the handler began one) back into `tx`; false if the handler kept
    /// the handle past its end.
    pub(crate) fn restore(self, tx: &mut Tx<DB>) -> bool {
        // The handle's drop left the only other reference to `home`.
        match Arc::try_unwrap(self.home) {
            Ok(home) => {
                tx.open = home.into_inner().unwrap_or_else(PoisonError::into_inner);
                true
            }
            Err(_) => false,
        }
    }
}

impl<DB: Database> Drop for Tx<DB> {
    fn drop(&mut self) {
        if let Some(home) = &self.home {
            *home.lock().unwrap_or_else(PoisonError::into_inner) = self.open.take();
        }
        // Otherwise the transaction (if any) drops here, and sqlx rolls it back.
    }
}

/// A type that `#[idempotent(transaction = "...")]` accepts for its transaction parameter.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not an idem transaction type",
    label = "the `transaction` parameter must be `idem_runtime::Tx<Postgres>` or `idem_runtime::Tx<Sqlite>`",
    note = "write the parameter as `tx: idem_runtime::Tx<idem_runtime::sqlx::Postgres>` (or `Sqlite`) and run queries on `tx.conn().await?`"
)]
pub trait TxHandle: sealed::Sealed + Send + 'static {
    /// The store whose transactions this handle carries.
    type Store: TransactionalStore;

    /// The handle itself (the identity: `Self` is `Tx` of the store's database).
    #[doc(hidden)]
    fn from_tx(tx: Tx<<Self::Store as TransactionalStore>::Database>) -> Self;
}
