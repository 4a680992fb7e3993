//! Counters of idem's decisions, for an application to export to its metrics system.
//!
//! Every [`Engine`](crate::Engine) owns a [`Metrics`]; read it with
//! [`Engine::metrics`](crate::Engine::metrics) and [`Metrics::snapshot`]. The counters only grow.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// One kind of decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// A new key: the handler ran.
    Executed,
    /// A dead worker's claim was taken over and the handler ran again.
    TakenOver,
    /// A stored response was replayed.
    Replayed,
    /// A duplicate waited for the in-flight original (it then replayed or got a conflict).
    Waited,
    /// Same key, different request: 422.
    Mismatch,
    /// Still in flight when the wait ran out: 409.
    Conflict,
    /// The key expired: 410.
    Expired,
    /// The store could not be reached: 503.
    Unavailable,
    /// The handler failed (5xx, panic, cancellation) and the claim was released.
    Released,
    /// The response could not be stored (the claim stays until its lease runs out).
    CompletionFailed,
    /// No key, and the policy let the request through unprotected.
    MissingKeyPassed,
    /// No key, and the policy rejected the request: 400.
    MissingKeyRejected,
    /// No key, and the policy derived one from the request.
    KeyDerived,
    /// A malformed key: 400.
    MalformedKey,
}

impl Outcome {
    /// The outcome of a successful claim: a fresh execution, or a takeover of a dead worker's claim.
    pub(crate) fn of_claim(taken_over: bool) -> Self {
        if taken_over {
            Outcome::TakenOver
        } else {
            Outcome::Executed
        }
    }

    /// Every outcome, in a stable order.
    pub const ALL: [Outcome; 14] = [
        Outcome::Executed,
        Outcome::TakenOver,
        Outcome::Replayed,
        Outcome::Waited,
        Outcome::Mismatch,
        Outcome::Conflict,
        Outcome::Expired,
        Outcome::Unavailable,
        Outcome::Released,
        Outcome::CompletionFailed,
        Outcome::MissingKeyPassed,
        Outcome::MissingKeyRejected,
        Outcome::KeyDerived,
        Outcome::MalformedKey,
    ];

    /// A stable snake_case name, for metric labels and log fields.
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::TakenOver => "taken_over",
            Outcome::Replayed => "replayed",
            Outcome::Waited => "waited",
            Outcome::Mismatch => "mismatch",
            Outcome::Conflict => "conflict",
            Outcome::Expired => "expired",
            Outcome::Unavailable => "unavailable",
            Outcome::Released => "released",
            Outcome::CompletionFailed => "completion_failed",
            Outcome::MissingKeyPassed => "missing_key_passed",
            Outcome::MissingKeyRejected => "missing_key_rejected",
            Outcome::KeyDerived => "key_derived",
            Outcome::MalformedKey => "malformed_key",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

/// Decision counters.
///
/// Every request of every handler on an engine counts once, so one counter per outcome would be
/// a cache line that each core takes from the others on each request. The counts are split into a
/// fixed number of lines instead, a thread writing to its own (chosen once per thread, round robin),
/// and a read sums them.
#[derive(Debug, Default)]
pub struct Metrics {
    stripes: [Stripe; STRIPES],
}

/// How many lines the counters are split into: threads beyond this many share lines.
const STRIPES: usize = 8;

/// One thread's share of the counters, on cache lines of its own (128 bytes: the adjacent-line
/// prefetcher pairs 64-byte lines).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Stripe([AtomicU64; Outcome::ALL.len()]);

/// The stripe this thread counts in.
fn stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
    }
    // A thread being torn down (a counter bumped from a thread-local's destructor) uses the first.
    STRIPE.try_with(|s| *s).unwrap_or(0)
}

impl Metrics {
    /// Counts one `outcome`.
    pub fn record(&self, outcome: Outcome) {
        self.stripes[stripe()].0[outcome.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// How many times `outcome` was counted.
    pub fn get(&self, outcome: Outcome) -> u64 {
        self.stripes
            .iter()
            .map(|s| s.0[outcome.index()].load(Ordering::Relaxed))
            .sum()
    }

    /// Every counter, with its name.
    ///
    /// ```
    /// use idem_runtime::metrics::{Metrics, Outcome};
    /// let m = Metrics::default();
    /// m.record(Outcome::Replayed);
    /// assert!(m.snapshot().contains(&("replayed", 1)));
    /// ```
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        Outcome::ALL
            .iter()
            .map(|o| (o.as_str(), self.get(*o)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_from_more_threads_than_stripes_add_up() {
        let metrics = Metrics::default();
        let threads = 3 * STRIPES + 1;
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    for _ in 0..100 {
                        metrics.record(Outcome::Executed);
                    }
                    metrics.record(Outcome::Replayed);
                });
            }
        });
        assert_eq!(metrics.get(Outcome::Executed), 100 * threads as u64);
        assert_eq!(metrics.get(Outcome::Replayed), threads as u64);
        assert_eq!(metrics.get(Outcome::Mismatch), 0);
    }
}
