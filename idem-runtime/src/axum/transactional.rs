//! The finishing step of transactional mode: the handler writes through a transaction it was lent,
//! and its stored response commits in that transaction (see [`crate::transaction`]).

use super::problem::{Problem, ProblemType};
use super::respond;
use super::run::{Finish, Settled};
use crate::engine::ClaimGuard;
use crate::record::StoredResponse;
use crate::store::tx::{Lent, TransactionalStore, Tx, TxHandle};
use crate::transaction::{Transactional, TxClaim};
use ::axum::response::{IntoResponse, Response};
use sqlx::Database;
use std::time::Duration;

/// A transaction lent to the handler, taken back and committed (or rolled back) once it answers.
pub(crate) struct TxFinish<DB: Database> {
    tx: Tx<DB>,
    lent: Option<Lent<DB>>,
    /// The `Retry-After` of a commit that failed.
    retry_after: Duration,
    handler: &'static str,
}

/// The handle for the handler and the finishing step that takes it back, on `txn`'s store.
pub(crate) fn lend<T: TxHandle>(
    txn: &Transactional<T::Store>,
    handler: &'static str,
) -> (T, TxFinish<<T::Store as TransactionalStore>::Database>) {
    let mut tx = txn.tx();
    let (handle, lent) = tx.lend();
    let finish = TxFinish {
        tx,
        lent: Some(lent),
        retry_after: txn.engine().unavailable_retry_after(),
        handler,
    };
    (T::from_tx(handle), finish)
}

impl<DB: Database> Finish for TxFinish<DB> {
    fn take_back(&mut self) -> bool {
        let back = self
            .lent
            .take()
            .is_none_or(|lent| lent.restore(&mut self.tx));
        if !back {
            tracing::error!(target: "idem", handler = self.handler,
                "the handler kept its idem transaction past its end; nothing was committed");
        }
        back
    }

    /// Dropping the transaction rolls it back.
    fn discard(self) {}

    async fn pass(self, response: Response) -> Response {
        if response.status().is_server_error() || !self.tx.is_begun() {
            return response; // dropping the transaction rolls back
        }
        match self.tx.commit().await {
            Ok(()) => response,
            Err(error) => {
                tracing::warn!(target: "idem", handler = self.handler, %error,
                    "could not commit a request without a key");
                not_committed(self.retry_after)
            }
        }
    }

    async fn settle(
        self,
        guard: ClaimGuard,
        stored: StoredResponse,
        mut response: Response,
    ) -> Settled {
        if !self.tx.is_begun() {
            return Settled::Later(Box::new((guard, stored, response)));
        }
        let expires_at = guard.expires_at();
        Settled::Now(
            match (TxClaim { guard, tx: self.tx }).complete(&stored).await {
                Ok(()) => {
                    respond::set_expires(response.headers_mut(), expires_at);
                    response
                }
                // Nothing was committed: the client must not see the handler's success.
                Err(_) => not_committed(self.retry_after),
            },
        )
    }
}

fn not_committed(retry_after: Duration) -> Response {
    Problem::new(
        ProblemType::StoreUnavailable,
        "The request's changes could not be committed, so nothing was done. Retry with the same key after Retry-After seconds.",
    )
    .retry_after(retry_after)
    .into_response()
}
