//! The retry budget: the AWS SDKs' retry quota, shared by every request of a client.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// A retry quota shared by all requests of one [`Client`](super::Client) (or one
/// `RetryMiddleware`): when a dependency is down, retries stop and requests fail fast instead of
/// multiplying its load.
///
/// The arithmetic is the AWS SDKs' `standard` retry mode, exactly (the AWS SDKs and Tools
/// reference guide, "Retry behavior"; botocore's `RetryQuotaChecker`, the JavaScript SDK's
/// `defaultRetryQuota`, the Rust SDK's `TokenBucket`):
///
/// - the bucket starts full (500 tokens by default) and never holds more than that;
/// - a retry takes its cost, 5 tokens, or 10 when the attempt before it timed out, and is refused
///   (the request fails with [`StopReason::BudgetExhausted`](super::StopReason::BudgetExhausted))
///   when fewer remain; a first attempt never costs anything;
/// - a request that ends with a 2xx answer gives back the cost of its last retry, or earns 1
///   token if it needed no retry.
///
/// Nothing refills with time. A storm of failing calls from a full bucket gets 100 retries
/// (50 after timeouts) in all, whatever their number, then only first attempts until successes
/// earn tokens back. gRPC's retry throttling (gRFC A6: every failed attempt, first ones
/// included, takes a token, and retries stop below half the bucket) is the other common model;
/// idem follows the AWS one.
///
/// Hand it to [`ClientBuilder::budget`](super::ClientBuilder::budget); clones share one bucket, so
/// several clients can share a budget for one dependency.
///
/// ```
/// use idem_runtime::client::RetryBudget;
///
/// // The default: 500 tokens, so 100 retries in a storm (a retry costs 5, 10 after a timeout).
/// let budget = RetryBudget::default();
/// assert_eq!(budget.available(), Some(500));
/// // A smaller bucket for a fragile dependency: 10 retries, 5 after timeouts.
/// let small = RetryBudget::new(50);
/// # let _ = small;
/// ```
#[derive(Debug, Clone)]
pub struct RetryBudget {
    /// `None`: unlimited.
    tokens: Option<Arc<AtomicU32>>,
    capacity: u32,
}

// The AWS SDKs' own constants, under their names.
const RETRY_COST: u32 = 5;
const TIMEOUT_RETRY_COST: u32 = 10;
const NO_RETRY_INCREMENT: u32 = 1;

impl RetryBudget {
    /// A full bucket of `capacity` tokens: `capacity / 5` retries in a storm.
    pub fn new(capacity: u32) -> Self {
        Self {
            tokens: Some(Arc::new(AtomicU32::new(capacity))),
            capacity,
        }
    }

    /// No limit: every retry the policy asks for is allowed.
    pub fn unlimited() -> Self {
        Self {
            tokens: None,
            capacity: 0,
        }
    }

    /// The tokens in the bucket now (`None` when unlimited).
    pub fn available(&self) -> Option<u32> {
        self.tokens.as_ref().map(|t| t.load(Ordering::Acquire))
    }

    /// Takes one retry's cost; the cost taken, or `None` if the bucket holds less.
    pub(crate) fn try_withdraw(&self, after_timeout: bool) -> Option<u32> {
        let Some(tokens) = &self.tokens else {
            return Some(0);
        };
        let cost = if after_timeout {
            TIMEOUT_RETRY_COST
        } else {
            RETRY_COST
        };
        tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| t.checked_sub(cost))
            .ok()
            .map(|_| cost)
    }

    /// A request ended in success: its last retry's cost comes back, or the no-retry increment.
    pub(crate) fn on_success(&self, last_retry_cost: Option<u32>) {
        if let Some(tokens) = &self.tokens {
            let earned = last_retry_cost.unwrap_or(NO_RETRY_INCREMENT);
            let _ = tokens.fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(t.saturating_add(earned).min(self.capacity))
            });
        }
    }
}

impl Default for RetryBudget {
    /// The AWS SDKs' default quota: 500 tokens.
    fn default() -> Self {
        Self::new(500)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_storm_from_a_full_bucket_gets_capacity_over_cost_retries() {
        let budget = RetryBudget::default();
        let retries = std::iter::from_fn(|| budget.try_withdraw(false)).count();
        assert_eq!(retries, 100);
        assert_eq!(budget.available(), Some(0));
        let budget = RetryBudget::default();
        let after_timeouts = std::iter::from_fn(|| budget.try_withdraw(true)).count();
        assert_eq!(after_timeouts, 50);
    }

    #[test]
    fn successes_refund_the_last_retry_or_earn_the_increment_up_to_capacity() {
        let budget = RetryBudget::new(12);
        assert_eq!(budget.try_withdraw(true), Some(10));
        assert_eq!(
            budget.try_withdraw(false),
            None,
            "2 tokens left, a retry costs 5"
        );
        budget.on_success(Some(10));
        assert_eq!(budget.available(), Some(12));
        budget.on_success(None);
        assert_eq!(budget.available(), Some(12), "never above capacity");
        assert_eq!(budget.try_withdraw(false), Some(5));
        for _ in 0..3 {
            budget.on_success(None);
        }
        assert_eq!(budget.available(), Some(10));
    }

    #[test]
    fn clones_share_the_bucket() {
        let budget = RetryBudget::new(11);
        let other = budget.clone();
        assert_eq!(other.try_withdraw(false), Some(5));
        assert_eq!(budget.try_withdraw(false), Some(5));
        assert_eq!(other.try_withdraw(false), None);
        budget.on_success(None);
        assert_eq!(other.available(), Some(2));
    }

    #[test]
    fn unlimited_never_refuses() {
        let budget = RetryBudget::unlimited();
        for _ in 0..10_000 {
            assert_eq!(budget.try_withdraw(true), Some(0));
        }
        budget.on_success(None);
        assert_eq!(budget.available(), None);
    }
}
