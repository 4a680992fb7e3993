//! Purging records past retention, in batches, from a task the application spawns.
//!
//! ```no_run
//! use idem_runtime::{store::memory::MemoryStore, sweeper::Sweeper};
//! use std::{sync::Arc, time::Duration};
//! # #[tokio::main] async fn main() {
//! let store = Arc::new(MemoryStore::new());
//! let sweeper = Sweeper::new(store.clone()).interval(Duration::from_secs(60)).batch_size(200);
//! tokio::spawn(sweeper.run());
//! # }
//! ```

use crate::store::{Purge, StoreError};
use std::sync::Arc;
use std::time::Duration;

/// After each full batch the sweeper pauses this many times as long as the batch took: it then
/// takes at most a quarter of the store's time, whatever the backlog.
pub const PAUSE_PER_BATCH: u32 = 3;

/// How many records one batch deletes by default: small enough that a request's write waiting
/// behind a batch waits little longer than it would behind another request's.
const DEFAULT_BATCH: usize = 200;

/// Deletes records past retention: `batch_size` at a time, pausing after each batch three times as
/// long as it took, so that a backlog is purged with at most a quarter of the store's time and
/// requests that arrive meanwhile wait for at most one batch; then sleeps `interval`.
pub struct Sweeper {
    store: Arc<dyn Purge>,
    interval: Duration,
    batch_size: usize,
}

impl std::fmt::Debug for Sweeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sweeper")
            .field("interval", &self.interval)
            .field("batch_size", &self.batch_size)
            .finish_non_exhaustive()
    }
}

impl Sweeper {
    /// A sweeper for `store`: every 60 s, batches of 200. What is past retention is the store's
    /// to judge, by its own clock, so an instance whose clock runs ahead purges nothing early.
    pub fn new(store: impl Purge) -> Self {
        Self {
            store: Arc::new(store),
            interval: Duration::from_secs(60),
            batch_size: DEFAULT_BATCH,
        }
    }

    /// How long to sleep between sweeps.
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// How many records one statement deletes at most (at least 1).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// One sweep: deletes batches until a batch comes back short, pausing after each full one
    /// [`PAUSE_PER_BATCH`] times as long as it took. Returns how many were deleted.
    pub async fn sweep_once(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let started = tokio::time::Instant::now();
            let n = self.store.purge_expired(self.batch_size).await?;
            total += n;
            if n < self.batch_size as u64 {
                return Ok(total);
            }
            // A batch holds the store's write lock (SQLite) or its I/O: left alone, a backlog's
            // batches would follow each other and starve the requests' writes.
            tokio::time::sleep(started.elapsed() * PAUSE_PER_BATCH).await;
            tokio::task::yield_now().await;
        }
    }

    /// Sweeps forever, every `interval`. Errors are logged and the next sweep tries again.
    pub async fn run(self) {
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            match self.sweep_once().await {
                Ok(n) if n > 0 => tracing::debug!(target: "idem", purged = n, "sweep"),
                Ok(_) => {}
                Err(e) => tracing::warn!(target: "idem", error = %e, "sweep failed"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A backlog of `left` records, each batch taking `per_batch` of the store's time.
    struct Backlog {
        left: AtomicU64,
        per_batch: Duration,
    }

    #[async_trait::async_trait]
    impl Purge for Backlog {
        async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
            tokio::time::sleep(self.per_batch).await;
            let left = self.left.load(Ordering::Relaxed);
            let n = left.min(batch as u64);
            self.left.store(left - n, Ordering::Relaxed);
            Ok(n)
        }
    }

    /// On the paused clock: after each full batch the sweeper leaves the store alone three times
    /// as long as the batch took, and after the last, short one it returns at once.
    #[tokio::test(start_paused = true)]
    async fn a_sweep_pauses_after_each_full_batch() {
        let per_batch = Duration::from_millis(10);
        let store = Arc::new(Backlog {
            left: AtomicU64::new(2_500),
            per_batch,
        });
        let sweeper = Sweeper::new(store.clone()).batch_size(1_000);
        let start = tokio::time::Instant::now();
        assert_eq!(sweeper.sweep_once().await.expect("sweep"), 2_500);
        assert_eq!(store.left.load(Ordering::Relaxed), 0);
        // Two full batches, each followed by its pause, then the short one.
        assert_eq!(
            start.elapsed(),
            2 * per_batch * (1 + PAUSE_PER_BATCH) + per_batch
        );
    }
}
