//! The transactional contract: a store whose records can be completed inside the application's
//! own transaction ([`TransactionalStore`]), and the handler's handle on that transaction ([`Tx`]).
//! The engine-level half, which claims, runs and commits, is [`crate::transaction`].

use super::{Store, StoreError};
use crate::record::{FencingToken, RecordKey, StoredResponse};
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
/// PostgreSQL (`store::postgres::PostgresStore`, feature `postgres`), MySQL/MariaDB
/// (`store::mysql::MySqlStore`, feature `mysql`) and SQLite (`store::sqlite::SqliteStore`, feature
/// `sqlite`) stores. Sealed: use it through
/// [`Transactional`](crate::transaction::Transactional).
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

type Home<DB> = Arc<Mutex<Option<OpenTx<DB>>>>;

/// The handler's transaction in transactional mode: the parameter named by
/// `#[idempotent(transaction = "...")]`, or [`TxClaim::tx`](crate::transaction::TxClaim::tx) by hand. [`conn`](Self::conn) begins
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
    /// A handle on `store` whose transaction begins at its first use.
    pub(crate) fn new(store: Arc<dyn TransactionalStore<Database = DB>>) -> Self {
        Self {
            store,
            open: None,
            home: None,
        }
    }

    /// The transaction, if it began, with the store that completes records in it.
    pub(crate) fn into_open(
        mut self,
    ) -> Option<(Arc<dyn TransactionalStore<Database = DB>>, OpenTx<DB>)> {
        let open = self.open.take()?;
        Some((self.store.clone(), open))
    }

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
pub(crate) struct Lent<DB: Database> {
    home: Home<DB>,
}

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
    note = "write the parameter as `tx: idem_runtime::Tx<idem_runtime::sqlx::Postgres>` (or `Sqlite`, `MySql`) and run queries on `tx.conn().await?`"
)]
pub trait TxHandle: sealed::Sealed + Send + 'static {
    /// The store whose transactions this handle carries.
    type Store: TransactionalStore;

    /// The handle itself (the identity: `Self` is `Tx` of the store's database).
    #[doc(hidden)]
    fn from_tx(tx: Tx<<Self::Store as TransactionalStore>::Database>) -> Self;
}
