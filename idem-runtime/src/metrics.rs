//! Counters of idem's decisions, for an application to export to its metrics system.
//!
//! Every [`Engine`](crate::Engine) owns a [`Metrics`]; read it with
//! [`Engine::metrics`](crate::Engine::metrics) and [`Metrics::snapshot`]. The counters only grow.
//!
//! With the `metrics` feature, every count also goes to the [`metrics`](https://docs.rs/metrics)
//! facade, so any exporter (Prometheus, StatsD, ...) sees it, with store calls and waits timed:
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `idem_requests_total` | counter | `handler`, `outcome` | every decision: an [`Outcome`], by its [name](Outcome::as_str) (table below) |
//! | `idem_store_duration_seconds` | histogram | `store`, `op` | each store call, failed and timed-out ones included; `store` is the [store's kind](crate::Store::kind) (`memory`, `sqlite`, `postgres`, `redis`), `op` one of `claim`, `complete`, `release`, `renew`, `get`, `announce` |
//! | `idem_wait_duration_seconds` | histogram | `handler` | how long a duplicate waited for the identical request in flight before it replayed, answered 409, or took the key over |
//!
//! `handler` is the handler's name (the function's, or [`Policy::handler`](crate::Policy::handler)
//! for the layer). The `outcome` values:
//!
//! | `outcome` | counted when |
//! |---|---|
//! | `executed` | a fresh key was claimed for the handler (a body its extractor refuses is then `released`) |
//! | `taken_over` | the handler ran after taking over a claim whose lease ran out |
//! | `replayed` | a stored response was replayed (waited duplicates included) |
//! | `waited` | a duplicate waited for the original, then replayed |
//! | `mismatch` | the key was used for a different request (422) |
//! | `conflict` | the original was still running at the end of the wait (409) |
//! | `expired` | the key was past its ttl (410) |
//! | `unavailable`, `busy` | the store failed, timed out, or had no free connection (503) |
//! | `released` | a claim was given up after a 5xx, a panic or a refused body, so that a retry runs again |
//! | `renewed` | a running claim's lease was renewed |
//! | `completion_failed` | an attempt to store a response failed (it is retried until it lands) |
//! | `missing_key_passed` | a request without a key ran unprotected (`missing_key = "pass"`) |
//! | `missing_key_rejected` | a request without a key was refused (400) |
//! | `key_derived` | a key was derived from a request without one (`missing_key = "derive"`) |
//! | `malformed_key` | the key was malformed or repeated (400) |
//!
//! `describe()` (feature `metrics`) gives each metric its help text in the installed recorder.

// Without the `metrics` feature, the labels and durations are only for the facade.
#![cfg_attr(not(feature = "metrics"), allow(unused_variables))]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Declares [`Outcome`] with each variant's name, and [`Outcome::ALL`], from one list.
macro_rules! outcomes {
    ($($(#[doc = $doc:literal])* $variant:ident => $name:literal,)*) => {
        /// What happened to a request (or to its claim).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Outcome {
            $($(#[doc = $doc])* $variant,)*
        }

        impl Outcome {
            /// Every outcome, in [`Metrics::snapshot`]'s order.
            pub const ALL: &'static [Outcome] = &[$(Outcome::$variant,)*];

            /// The name used in logs, snapshots and the `outcome` label.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(Outcome::$variant => $name,)*
                }
            }
        }
    };
}

outcomes! {
    /// A fresh key was claimed for the handler (a body its extractor refuses is then `Released`).
    Executed => "executed",
    /// The handler ran after taking over a claim whose lease ran out.
    TakenOver => "taken_over",
    /// A stored response was replayed.
    Replayed => "replayed",
    /// A duplicate waited for the original and then replayed (also counted as `Replayed`).
    Waited => "waited",
    /// The key was used for a different request (422).
    Mismatch => "mismatch",
    /// The original was still running at the end of the wait (409).
    Conflict => "conflict",
    /// The key was past its ttl (410).
    Expired => "expired",
    /// The store failed or timed out; the handler did not run (503).
    Unavailable => "unavailable",
    /// The store had no free connection; the handler did not run (503).
    Busy => "busy",
    /// A claim was given up (a 5xx, a panic or a refused body) so that a retry runs again.
    Released => "released",
    /// A running claim's lease was renewed.
    Renewed => "renewed",
    /// An attempt to store a response failed (it is retried until it lands).
    CompletionFailed => "completion_failed",
    /// A request without a key ran unprotected (`missing_key = "pass"`).
    MissingKeyPassed => "missing_key_passed",
    /// A request without a key was refused (400).
    MissingKeyRejected => "missing_key_rejected",
    /// A key was derived from the request (`missing_key = "derive"`).
    KeyDerived => "key_derived",
    /// The key was malformed (400).
    MalformedKey => "malformed_key",
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
    }

    /// Records how long one call to a store of kind `store` took.
    pub(crate) fn store_call(&self, store: &'static str, op: &'static str, took: Duration) {
        #[cfg(feature = "metrics")]
        ::metrics::histogram!("idem_store_duration_seconds", "store" => store, "op" => op)
            .record(took.as_secs_f64());
    }

    /// Records how long a duplicate waited for the original in flight.
    pub(crate) fn waited(&self, handler: &'static str, took: Duration) {
        #[cfg(feature = "metrics")]
        ::metrics::histogram!("idem_wait_duration_seconds", "handler" => handler)
            .record(took.as_secs_f64());
    }

    /// How many times `outcome` was counted.
    pub fn get(&self, outcome: Outcome) -> u64 {
        self.counts[outcome as usize].load(Ordering::Relaxed)
    }

    /// Every counter by name, in [`Outcome::ALL`]'s order.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let count = |o: &Outcome| (o.as_str(), self.get(*o));
        Outcome::ALL.iter().map(count).collect()
    }
}

/// Registers the help text of idem's metrics with the `metrics` recorder installed now (exporters
/// print it, as Prometheus's `# HELP` lines). Call it once, after installing the recorder.
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub fn describe() {
    use ::metrics::{describe_counter, describe_histogram, Unit::Seconds};
    let help = "Idempotency decisions, by handler and outcome.";
    describe_counter!("idem_requests_total", help);
    let help = "Duration of idempotency store calls, by store kind and operation.";
    describe_histogram!("idem_store_duration_seconds", Seconds, help);
    let help = "Time a duplicate waited for the identical request in flight, by handler.";
    describe_histogram!("idem_wait_duration_seconds", Seconds, help);
}
