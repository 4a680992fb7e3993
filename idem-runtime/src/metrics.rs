//! Counters of idem's decisions, for an application to export to its metrics system.
//!
//! Every [`Engine`](crate::Engine) owns a [`Metrics`]; read it with
//! [`Engine::metrics`](crate::Engine::metrics) and [`Metrics::snapshot`]. The counters only grow.
//!
//! With the `metrics` feature, every count also goes to the [`metrics`](https://docs.rs/metrics)
//! facade, so any exporter (Prometheus, StatsD, ...) sees it:
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `idem_requests_total` | counter | `handler`, `outcome` | every [`Outcome`], by its [name](Outcome::as_str) |
//! | `idem_store_duration_seconds` | histogram | `op` | each store call: `claim`, `complete`, `release`, `renew`, `get`, `announce` |

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What happened to a request (or to its claim).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran for a fresh key.
    Executed,
    /// The handler ran after taking over a claim whose lease ran out.
    TakenOver,
    /// A stored response was replayed.
    Replayed,
    /// A duplicate waited for the original and then replayed (also counted as `Replayed`).
    Waited,
    /// The key was used for a different request (422).
    Mismatch,
    /// The original was still running at the end of the wait (409).
    Conflict,
    /// The key was past its ttl (410).
    Expired,
    /// The store failed or timed out; the handler did not run (503).
    Unavailable,
    /// The store had no free connection; the handler did not run (503).
    Busy,
    /// A claim was given up (a 5xx or a panic) so that a retry runs again.
    Released,
    /// A running claim's lease was renewed.
    Renewed,
    /// An attempt to store a response failed (it is retried until it lands).
    CompletionFailed,
    /// A request without a key ran unprotected (`missing_key = "pass"`).
    MissingKeyPassed,
    /// A request without a key was refused (400).
    MissingKeyRejected,
    /// A key was derived from the request (`missing_key = "derive"`).
    KeyDerived,
    /// The key was malformed (400).
    MalformedKey,
}

impl Outcome {
    pub(crate) fn of_claim(taken_over: bool) -> Self {
        if taken_over {
            Outcome::TakenOver
        } else {
            Outcome::Executed
        }
    }

    /// Every outcome, in [`Metrics::snapshot`]'s order.
    pub const ALL: [Outcome; 16] = [
        Outcome::Executed,
        Outcome::TakenOver,
        Outcome::Replayed,
        Outcome::Waited,
        Outcome::Mismatch,
        Outcome::Conflict,
        Outcome::Expired,
        Outcome::Unavailable,
        Outcome::Busy,
        Outcome::Released,
        Outcome::Renewed,
        Outcome::CompletionFailed,
        Outcome::MissingKeyPassed,
        Outcome::MissingKeyRejected,
        Outcome::KeyDerived,
        Outcome::MalformedKey,
    ];

    /// The name used in logs, snapshots and the `outcome` label.
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
            Outcome::Busy => "busy",
            Outcome::Released => "released",
            Outcome::Renewed => "renewed",
            Outcome::CompletionFailed => "completion_failed",
            Outcome::MissingKeyPassed => "missing_key_passed",
            Outcome::MissingKeyRejected => "missing_key_rejected",
            Outcome::KeyDerived => "key_derived",
            Outcome::MalformedKey => "malformed_key",
        }
    }
}

/// The decision counters of one engine.
#[derive(Debug, Default)]
pub struct Metrics {
    counts: [AtomicU64; Outcome::ALL.len()],
}

impl Metrics {
    /// Counts `outcome` for the handler named `handler`.
    pub fn record(&self, outcome: Outcome, handler: &'static str) {
        self.counts[outcome as usize].fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        ::metrics::counter!("idem_requests_total", "handler" => handler, "outcome" => outcome.as_str())
            .increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = handler;
    }

    /// Records how long one store call took.
    pub(crate) fn store_call(&self, op: &'static str, took: Duration) {
        #[cfg(feature = "metrics")]
        ::metrics::histogram!("idem_store_duration_seconds", "op" => op).record(took.as_secs_f64());
        #[cfg(not(feature = "metrics"))]
        let _ = (op, took);
    }

    /// How many times `outcome` was counted.
    pub fn get(&self, outcome: Outcome) -> u64 {
        self.counts[outcome as usize].load(Ordering::Relaxed)
    }

    /// Every counter by name, in [`Outcome::ALL`]'s order.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        Outcome::ALL
            .iter()
            .map(|o| (o.as_str(), self.get(*o)))
            .collect()
    }
}
