//! The retry budget: a token bucket shared by every request of a client.
//!
//! Each retry (never a first attempt) takes one token; an empty bucket means "don't retry, fail
//! now". Tokens come back two ways: with time (`refill_per_second`, a floor that lets a quiet client
//! still retry) and with traffic (`deposit_per_request`, so retries stay a fixed fraction of
//! requests). When a dependency goes down, every caller's retries drain the bucket and the extra load
//! they add is bounded by that fraction plus the floor, instead of multiplying by the maximum number
//! of attempts (a retry storm). Time is read from tokio's clock, so tests can drive it.

use std::sync::{Arc, Mutex, MutexGuard};
use tokio::time::Instant;

/// Thousandths of a token: integer arithmetic, so fractions (0.1 per request) add up exactly.
const MILLI: u64 = 1000;

/// A token bucket that limits retries across all requests of one [`Client`](super::Client).
///
/// Configure it, then hand it to [`ClientBuilder::budget`](super::ClientBuilder::budget); clones share
/// one bucket, so several clients can share a budget for one dependency.
///
/// ```
/// use idem_runtime::client::RetryBudget;
///
/// // At most 20 retries in a burst, then one per second plus one per ten requests.
/// let budget = RetryBudget::new(20).refill_per_second(1.0).deposit_per_request(0.1);
/// assert_eq!(budget.available(), 20.0);
/// ```
#[derive(Debug, Clone)]
pub struct RetryBudget {
    inner: Option<Arc<Inner>>,
}

#[derive(Debug)]
struct Inner {
    capacity: u64,
    refill_per_sec: u64,
    deposit: u64,
    bucket: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    tokens: u64,
    refilled_at: Option<Instant>,
}

impl RetryBudget {
    /// A full bucket of `capacity` retries that refills only as configured (by default: never).
    pub fn new(capacity: u32) -> Self {
        Self::build(u64::from(capacity) * MILLI, 0, 0)
    }

    /// No limit: every retry the policy asks for is allowed.
    pub fn unlimited() -> Self {
        Self { inner: None }
    }

    /// Adds `tokens` per second of (tokio) time, up to the capacity.
    pub fn refill_per_second(self, tokens: f64) -> Self {
        match self.inner {
            Some(i) => Self::build(i.capacity, milli(tokens), i.deposit),
            None => self,
        }
    }

    /// Adds `tokens` for every request the client sends (once per request, not per attempt).
    pub fn deposit_per_request(self, tokens: f64) -> Self {
        match self.inner {
            Some(i) => Self::build(i.capacity, i.refill_per_sec, milli(tokens)),
            None => self,
        }
    }

    /// The retries available now (`f64::INFINITY` when unlimited).
    pub fn available(&self) -> f64 {
        match &self.inner {
            Some(inner) => inner.refilled().tokens as f64 / MILLI as f64,
            None => f64::INFINITY,
        }
    }

    /// A new request: deposit its share.
    pub(crate) fn on_request(&self) {
        if let Some(inner) = &self.inner {
            let mut bucket = inner.refilled();
            bucket.tokens = (bucket.tokens + inner.deposit).min(inner.capacity);
        }
    }

    /// Takes one retry's token; `false` if the bucket holds less than one.
    pub(crate) fn try_withdraw(&self) -> bool {
        let Some(inner) = &self.inner else {
            return true;
        };
        let mut bucket = inner.refilled();
        match bucket.tokens.checked_sub(MILLI) {
            Some(rest) => {
                bucket.tokens = rest;
                true
            }
            None => false,
        }
    }

    fn build(capacity: u64, refill_per_sec: u64, deposit: u64) -> Self {
        Self {
            inner: Some(Arc::new(Inner {
                capacity,
                refill_per_sec,
                deposit,
                bucket: Mutex::new(Bucket {
                    tokens: capacity,
                    refilled_at: None,
                }),
            })),
        }
    }
}

impl Default for RetryBudget {
    /// 10 retries in a burst, refilled at 1 per second and 0.1 per request: when everything fails,
    /// retries add about 10% to the load (plus one per second).
    fn default() -> Self {
        Self::new(10)
            .refill_per_second(1.0)
            .deposit_per_request(0.1)
    }
}

impl Inner {
    /// The bucket, topped up for the time since the last look (lazily: no timer runs).
    fn refilled(&self) -> MutexGuard<'_, Bucket> {
        // A panic while holding this lock leaves consistent integers behind: keep going.
        let mut bucket = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let Some(then) = bucket.refilled_at else {
            bucket.refilled_at = Some(now);
            return bucket;
        };
        if self.refill_per_sec == 0 || bucket.tokens >= self.capacity {
            // Nothing to add: time spent full (or without refill) is not banked.
            bucket.refilled_at = Some(now);
            return bucket;
        }
        let elapsed_ns = now.saturating_duration_since(then).as_nanos();
        let rate = u128::from(self.refill_per_sec);
        let added = elapsed_ns.saturating_mul(rate) / 1_000_000_000;
        if added == 0 {
            return bucket;
        }
        let room = u128::from(self.capacity - bucket.tokens);
        if added >= room {
            bucket.tokens = self.capacity;
            bucket.refilled_at = Some(now);
        } else {
            bucket.tokens += added as u64; // `added < room <= u64::MAX`
                                           // Move the refill instant only by the time those whole milli-tokens took, so the
                                           // remainder is kept for the next look however often the bucket is read.
            let used_ns = added * 1_000_000_000 / rate;
            let used = std::time::Duration::from_nanos(u64::try_from(used_ns).unwrap_or(u64::MAX));
            bucket.refilled_at = Some(then + used);
        }
        bucket
    }
}

fn milli(tokens: f64) -> u64 {
    if tokens.is_finite() && tokens > 0.0 {
        // Saturating float-to-int conversion; a budget of 1.8e16 tokens is "unlimited" anyway.
        (tokens * MILLI as f64).round() as u64
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn withdraws_until_empty_then_refills_with_time() {
        let budget = RetryBudget::new(2).refill_per_second(0.5);
        assert!(budget.try_withdraw());
        assert!(budget.try_withdraw());
        assert!(!budget.try_withdraw());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!budget.try_withdraw(), "half a token is not a retry");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(budget.try_withdraw());
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert_eq!(budget.available(), 2.0, "never above capacity");
    }

    #[tokio::test(start_paused = true)]
    async fn slow_refill_is_not_lost_to_rounding() {
        // 0.3 tokens per second, looked at every 3 ms: each look adds 0.9 milli-tokens. Rounding
        // each look down would refill nothing; the remainder must carry over.
        let budget = RetryBudget::new(1).refill_per_second(0.3);
        assert!(budget.try_withdraw());
        for _ in 0..1000 {
            tokio::time::advance(Duration::from_millis(3)).await;
            let _ = budget.available();
        }
        // 3 s at 0.3 per second.
        assert_eq!(budget.available(), 0.9);
    }

    #[tokio::test(start_paused = true)]
    async fn requests_deposit_their_share_and_clones_share_the_bucket() {
        let budget = RetryBudget::new(3).deposit_per_request(0.25);
        let other = budget.clone();
        for _ in 0..3 {
            assert!(other.try_withdraw());
        }
        assert!(!budget.try_withdraw());
        for _ in 0..4 {
            budget.on_request();
        }
        assert!(other.try_withdraw());
        assert!(!budget.try_withdraw());
    }

    #[test]
    fn unlimited_never_refuses() {
        let budget = RetryBudget::unlimited().refill_per_second(1.0);
        for _ in 0..10_000 {
            assert!(budget.try_withdraw());
        }
        assert_eq!(budget.available(), f64::INFINITY);
    }
}
