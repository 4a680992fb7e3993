//! Turns: in one process, at most one transactional claim per key holds a database connection.
//!
//! A transactional claim is uncommitted, so an identical request cannot see it: left alone it opens
//! a transaction of its own and blocks on the key's unique index, holding a pooled connection for
//! as long as the original's handler runs. A burst of retries of one slow request would then hold
//! the whole pool: requests on every other key wait for a connection, and duplicates past the
//! pool's acquire timeout get 503 instead of the replay they were waiting for.
//!
//! So a request takes its key's turn before it opens a transaction, and keeps it until its claim
//! commits or rolls back. A local duplicate finds the turn taken and waits for it to end, holding
//! nothing but a channel receiver, then reads the record again: the committed response is replayed,
//! and after a rollback the first to take the turn again claims. The turns are the store's (one set
//! per `PostgresStore`, one per SQLite file in a process), so every `Transactional` on it shares
//! them. Duplicates in other processes still wait on the unique index, one connection per process
//! and key.

use crate::record::RecordKey;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::watch;
use tokio::time::Instant;

/// The keys whose turn is taken in this process, for one store. Public only to be named by the
/// sealed `TransactionalStore`; not a stable API.
#[derive(Debug, Default)]
pub struct Turns {
    /// A receiver of each taken turn's channel; the turn holds the sender, and dropping it is what
    /// wakes the waiters.
    taken: Mutex<HashMap<RecordKey, watch::Receiver<()>>>,
    /// Requests waiting for a turn right now.
    waiting: AtomicUsize,
}

/// A key's turn, held from before its transaction opens until the claim ends.
#[derive(Debug)]
pub(crate) struct Turn {
    turns: Arc<Turns>,
    key: RecordKey,
    /// Never sent on: dropped with the turn (after `Drop::drop` has taken the entry out of the
    /// map), which is what wakes the waiters.
    _ended: watch::Sender<()>,
}

/// Whether the turn a request waited for ended before its deadline.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Waited {
    /// It ended: read the record again.
    Ended,
    /// The deadline came first.
    TimedOut,
}

impl Turns {
    /// Takes `key`'s turn, or, if another request of this process holds it, the receiver that
    /// tells when it ends.
    pub(crate) fn take(self: &Arc<Self>, key: &RecordKey) -> Result<Turn, watch::Receiver<()>> {
        let mut taken = self.taken.lock().unwrap_or_else(PoisonError::into_inner);
        // A turn removes its entry before it drops its sender, so a closed entry is never seen;
        // were one ever left, it would count as free rather than send waiters round for nothing.
        if let Some(held) = taken.get(key).filter(|held| held.has_changed().is_ok()) {
            return Err(held.clone());
        }
        let (ended, receiver) = watch::channel(());
        taken.insert(key.clone(), receiver);
        Ok(Turn {
            turns: self.clone(),
            key: key.clone(),
            _ended: ended,
        })
    }

    /// Waits until the turn behind `receiver` ends, or `deadline`.
    pub(crate) async fn wait(
        &self,
        mut receiver: watch::Receiver<()>,
        deadline: Instant,
    ) -> Waited {
        let _counted = Counted::new(&self.waiting);
        // The sender is only ever dropped, never used to send: `changed` returns once it is gone
        // (at once if it is already gone).
        match tokio::time::timeout_at(deadline, receiver.changed()).await {
            Ok(_) => Waited::Ended,
            Err(_) => Waited::TimedOut,
        }
    }

    /// How many requests wait for a turn right now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }
}

/// One in `count` for as long as it lives: a wait cancelled with its request is uncounted too.
struct Counted<'a>(&'a AtomicUsize);

impl<'a> Counted<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Counted(count)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        // Out of the map before the sender goes (fields drop after this), so that a waiter it
        // wakes finds the turn free.
        self.turns
            .taken
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn key(k: &str) -> RecordKey {
        RecordKey::new("u", k)
    }

    /// A task waiting on `receiver` for up to a minute, returned once it is counted.
    async fn waiting(
        turns: &Arc<Turns>,
        receiver: watch::Receiver<()>,
    ) -> tokio::task::JoinHandle<Waited> {
        let waiter = tokio::spawn({
            let turns = turns.clone();
            async move {
                turns
                    .wait(receiver, Instant::now() + Duration::from_secs(60))
                    .await
            }
        });
        while turns.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        waiter
    }

    #[tokio::test(start_paused = true)]
    async fn a_taken_turn_makes_the_next_request_wait_until_it_ends() {
        let turns = Arc::new(Turns::default());
        let turn = turns.take(&key("a")).expect("free");
        let receiver = turns.take(&key("a")).expect_err("taken");
        assert!(turns.take(&key("b")).is_ok(), "other keys are free");
        let waiter = waiting(&turns, receiver).await;
        let before = Instant::now();
        drop(turn);
        assert_eq!(waiter.await.expect("waiter"), Waited::Ended);
        assert_eq!(Instant::now(), before, "woken by the end, not by a timer");
        assert_eq!(turns.waiting(), 0);
        assert!(turns.take(&key("a")).is_ok(), "free again");
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_at_the_deadline_if_the_turn_does_not() {
        let turns = Arc::new(Turns::default());
        let _turn = turns.take(&key("a")).expect("free");
        let receiver = turns.take(&key("a")).expect_err("taken");
        let deadline = Instant::now() + Duration::from_secs(2);
        assert_eq!(turns.wait(receiver, deadline).await, Waited::TimedOut);
        assert_eq!(Instant::now(), deadline);
    }

    #[tokio::test(start_paused = true)]
    async fn a_receiver_of_an_ended_turn_returns_at_once() {
        let turns = Arc::new(Turns::default());
        let turn = turns.take(&key("a")).expect("free");
        let receiver = turns.take(&key("a")).expect_err("taken");
        drop(turn);
        let before = Instant::now();
        let far = before + Duration::from_secs(60);
        assert_eq!(turns.wait(receiver, far).await, Waited::Ended);
        assert_eq!(Instant::now(), before);
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_wait_is_no_longer_counted() {
        let turns = Arc::new(Turns::default());
        let _turn = turns.take(&key("a")).expect("free");
        let receiver = turns.take(&key("a")).expect_err("taken");
        let waiter = waiting(&turns, receiver).await;
        waiter.abort();
        assert!(waiter.await.expect_err("aborted").is_cancelled());
        assert_eq!(turns.waiting(), 0);
    }

    #[test]
    fn an_ended_turn_leaves_nothing_behind() {
        let turns = Arc::new(Turns::default());
        for i in 0..100 {
            drop(turns.take(&key(&i.to_string())).expect("free"));
        }
        assert!(turns.taken.lock().expect("lock").is_empty());
    }
}
