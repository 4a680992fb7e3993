//! Purging records past retention, in batches, from a task the application spawns.
//!
//! ```no_run
//! use idem_runtime::{store::memory::MemoryStore, sweeper::Sweeper};
//! use std::{sync::Arc, time::Duration};
//! # #[tokio::main] async fn main() {
//! let store = Arc::new(MemoryStore::new());
//! let sweeper = Sweeper::new(store.clone()).interval(Duration::from_secs(60)).batch_size(1_000);
//! tokio::spawn(sweeper.run());
//! # }
//! ```

use crate::store::{Purge, StoreError};
use std::sync::Arc;
use std::time::Duration;

/// Deletes records past retention: `batch_size` at a time, yielding between batches so that it never
/// holds a store's write lock for long, then sleeps `interval`.
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
    /// A sweeper for `store`: every 60 s, batches of 1,000. What is past retention is the store's
    /// to judge, by its own clock, so an instance whose clock runs ahead purges nothing early.
    pub fn new(store: impl Purge) -> Self {
        Self {
            store: Arc::new(store),
            interval: Duration::from_secs(60),
            batch_size: 1_000,
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

    /// One sweep: deletes batches until a batch comes back short. Returns how many were deleted.
    pub async fn sweep_once(&self) -> Result<u64, StoreError> {
        let mut total = 0;
        loop {
            let n = self.store.purge_expired(self.batch_size).await?;
            total += n;
            if n < self.batch_size as u64 {
                return Ok(total);
            }
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
