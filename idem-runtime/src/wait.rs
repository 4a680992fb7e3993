//! How a duplicate waits for the identical request in flight: subscribe, announce, read again, sleep.
//!
//! A duplicate that finds its key in flight must not miss the completion that may land while it
//! prepares to wait, and must not poll. So, in this order, before it first sleeps (and again whenever
//! it wakes to find the key still in flight, since the record may have been released and claimed anew
//! meanwhile):
//!
//! 1. it [subscribes](crate::Store::subscribe) to the key, which arms the local wake-up;
//! 2. it [announces](crate::Store::announce_waiter) itself, so that stores which notify only awaited keys
//!    (PostgreSQL, Redis) will notify this one;
//! 3. it claims (reads) the key again: a completion that landed before step 2 is seen here, and one
//!    that lands after sees the announcement and wakes the subscription.
//!
//! Only then does it sleep, until the subscription fires, the lease runs out (a takeover may be due)
//! or the caller's deadline passes, whichever is first. The engine and transactional mode share this.

use crate::store::{StoreError, Subscription};
use std::future::Future;
use tokio::time::Instant;

/// One duplicate's wait; see the [module documentation](self).
#[derive(Debug, Default)]
pub(crate) struct DuplicateWait {
    subscription: Option<Subscription>,
    /// When it first subscribed: the start of its wait.
    since: Option<Instant>,
    /// Subscribed and announced since the record was last found in flight, so the next "in flight"
    /// means sleep.
    armed: bool,
}

impl DuplicateWait {
    /// Called each time a claim finds the key in flight (and the deadline has not passed). Either arms
    /// the wait (`subscribe`, then `announce`; the caller then claims again at once) or sleeps until
    /// woken or `wake`. The caller claims again after it returns `Ok`.
    pub(crate) async fn step<A: Future<Output = Result<(), StoreError>>>(
        &mut self,
        subscribe: impl FnOnce() -> Subscription,
        announce: impl FnOnce() -> A,
        wake: Instant,
        timers: Timers,
    ) -> Result<(), StoreError> {
        if !self.armed {
            if self.subscription.is_none() {
                self.subscription = Some(subscribe());
                self.since = Some(timers.now());
            }
            announce().await?;
            self.armed = true;
            return Ok(());
        }
        self.armed = false;
        if let Some(subscription) = &mut self.subscription {
            tracing::debug!(target: "idem", "waiting for the identical request in flight");
            tokio::select! {
                _ = subscription.changed() => {}
                _ = timers.sleep_until(wake) => {}
            }
        }
        Ok(())
    }

    /// Whether this request has waited (subscribed) at all.
    pub(crate) fn waited(&self) -> bool {
        self.since.is_some()
    }

    /// How long this request has waited, if it has.
    pub(crate) fn waited_for(&self, timers: Timers) -> Option<std::time::Duration> {
        self.since.map(|since| timers.now() - since)
    }
}

/// The time a duplicate's wait is bounded with.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Timers {
    /// tokio's clock and timers (paused in tests that ask for it).
    Tokio,
    /// Time stands still at this instant and no timer ever fires (the loom models).
    #[cfg(loom)]
    Frozen(Instant),
}

impl Timers {
    /// The current instant.
    pub(crate) fn now(self) -> Instant {
        match self {
            Self::Tokio => Instant::now(),
            #[cfg(loom)]
            Self::Frozen(at) => at,
        }
    }

    async fn sleep_until(self, wake: Instant) {
        match self {
            Self::Tokio => tokio::time::sleep_until(wake).await,
            #[cfg(loom)]
            Self::Frozen(_) => std::future::pending().await,
        }
    }
}
