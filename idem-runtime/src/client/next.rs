//! What follows an attempt: the wait before the next one, or why the request stops.
//!
//! [`decide_next`] is the whole retry decision, apart from the loop that sends and sleeps (as in
//! tower's retry `Policy` and reqwest-retry's `RetryPolicy`). The policy says whether another
//! attempt can help; then the client's limits, in this order, say whether the request can afford
//! one: attempts left, a body that can be sent again, the `Retry-After` cap, the deadline, the retry
//! budget. It reads only a [`Progress`], which carries the instant and the jitter too, so a test
//! pins them. Its one effect is the last step: taking the retry's cost from the shared budget, once
//! every other check has passed (a read of the budget, then a take, would race with other requests).

use super::error::StopReason;
use super::policy::{Attempt, Decision, Outcome, TransportFailure};
use super::Retrier;
use std::borrow::Cow;
use std::time::Duration;
use tokio::time::Instant;

/// A read-only view of a request whose attempt just ended.
#[derive(Debug, Clone, Copy)]
pub(super) struct Progress<'a> {
    /// The attempt, as the policy sees it.
    pub(super) attempt: Attempt<'a>,
    /// The deadline cut the attempt off.
    pub(super) cut_at_deadline: bool,
    /// A copy of the request is ready for another attempt (never for a streaming body).
    pub(super) replayable: bool,
    /// When the request's deadline passes (`None`: no deadline, or one too far to represent).
    pub(super) deadline_at: Option<Instant>,
    /// Now, on tokio's clock.
    pub(super) now: Instant,
    /// Where in its range the backoff falls: a fraction in `[0, 1]`, drawn at random by the loop.
    pub(super) jitter: f64,
}

/// What the loop does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Next {
    /// Wait, then send again; `cost` tokens were taken from the retry budget.
    Retry { wait: Duration, cost: u32 },
    /// The policy's stop: an answer goes back to the caller as it is; without one, the request
    /// fails with [`StopReason::NotRetryable`] and this reason.
    Final { reason: Cow<'static, str> },
    /// The request fails: the deadline cut the attempt off, or a retry the policy asked for is
    /// beyond the client's limits.
    Stop(StopReason),
}

/// The next step after the attempt `progress` describes.
pub(super) fn decide_next(retrier: &Retrier, progress: &Progress<'_>) -> Next {
    let config = &retrier.config;
    let attempt = &progress.attempt;
    let at_deadline = |retry_after| {
        Next::Stop(StopReason::Deadline {
            deadline: config.deadline.unwrap_or_default(),
            retry_after,
        })
    };
    // Asked even about an attempt the deadline cut off, so a policy sees every attempt.
    let decision = retrier.policy.decide(attempt);
    if progress.cut_at_deadline {
        return at_deadline(None);
    }
    let not_before = match decision {
        Decision::Retry { not_before } => not_before,
        Decision::Stop { reason } => return Next::Final { reason },
    };

    // The policy says another attempt may succeed; can this request afford one?
    let max_attempts = config.max_attempts.max(1);
    if attempt.number() >= max_attempts {
        return Next::Stop(StopReason::AttemptsExhausted { max_attempts });
    }
    if !progress.replayable {
        return Next::Stop(StopReason::BodyNotReplayable);
    }
    let cap = config.max_retry_after;
    if let Some(requested) = not_before.filter(|w| *w > cap) {
        return Next::Stop(StopReason::RetryAfterTooLong { requested, cap });
    }
    let wait = config
        .backoff
        .jittered(attempt.number(), progress.jitter)
        .max(not_before.unwrap_or_default());
    // A wait that ends at or past the deadline would only lead to an attempt cut off at once.
    // Checked additions: a huge wait means "past any deadline", not a panic.
    let past = |wait: Duration| {
        progress
            .deadline_at
            .is_some_and(|d| progress.now.checked_add(wait).is_none_or(|t| t >= d))
    };
    if past(wait) {
        return at_deadline(not_before.filter(|w| past(*w)));
    }
    let timed_out = matches!(
        attempt.outcome(),
        Outcome::NoAnswer(TransportFailure::Timeout)
    );
    match retrier.budget.try_withdraw(timed_out) {
        Some(cost) => Next::Retry { wait, cost },
        None => Next::Stop(StopReason::BudgetExhausted),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{Config, DefaultPolicy, ExponentialBackoff, RetryBudget};
    use http::{HeaderMap, Method, StatusCode};
    use std::time::UNIX_EPOCH;

    const SECOND: Duration = Duration::from_secs(1);

    /// Three attempts, a 10 s deadline, backoff from 1 s doubling to 4 s, `Retry-After` up to 30 s,
    /// the default policy, and a budget of `tokens`.
    fn retrier(tokens: u32) -> Retrier {
        Retrier {
            config: Config {
                max_attempts: 3,
                deadline: Some(10 * SECOND),
                backoff: ExponentialBackoff::new(SECOND, 4 * SECOND),
                max_retry_after: 30 * SECOND,
                ..Config::default()
            },
            policy: Box::new(DefaultPolicy),
            budget: RetryBudget::new(tokens),
        }
    }

    /// Attempt `number` of a keyed POST, `elapsed` into a request whose deadline is 10 s, with the
    /// backoff at the top of its range; replayable and not cut off unless a test says otherwise.
    fn progress(outcome: Outcome<'_>, number: u32, elapsed: Duration) -> Progress<'_> {
        let started = Instant::now();
        Progress {
            attempt: Attempt::new(&Method::POST, number, true, outcome).at(UNIX_EPOCH),
            cut_at_deadline: false,
            replayable: true,
            deadline_at: Some(started + 10 * SECOND),
            now: started + elapsed,
            jitter: 1.0,
        }
    }

    fn answered(headers: &HeaderMap, status: u16) -> Outcome<'_> {
        Outcome::Answered {
            status: StatusCode::from_u16(status).expect("a status"),
            headers,
            problem_type: None,
        }
    }

    fn retry_after(seconds: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert("retry-after", seconds.parse().expect("a header value"));
        headers
    }

    const TIMEOUT: Outcome<'static> = Outcome::NoAnswer(TransportFailure::Timeout);

    #[test]
    fn a_retry_waits_the_longer_of_the_backoff_and_retry_after_and_pays_its_cost() {
        let r = retrier(100);
        let none = HeaderMap::new();
        let mut at_half = progress(answered(&none, 503), 2, SECOND);
        at_half.jitter = 0.5;
        assert_eq!(
            decide_next(&r, &at_half),
            Next::Retry {
                wait: SECOND,
                cost: 5
            },
            "half of the second retry's 2 s ceiling"
        );
        let asked = retry_after("3");
        assert_eq!(
            decide_next(&r, &progress(answered(&asked, 503), 1, SECOND)),
            Next::Retry {
                wait: 3 * SECOND,
                cost: 5
            },
            "Retry-After above the 1 s backoff"
        );
        assert_eq!(
            decide_next(&r, &progress(TIMEOUT, 1, SECOND)),
            Next::Retry {
                wait: SECOND,
                cost: 10
            },
            "a retry after a timeout costs more"
        );
        assert_eq!(r.budget.available(), Some(80));
    }

    #[test]
    fn the_policys_stop_is_final_and_costs_nothing() {
        let r = retrier(100);
        let none = HeaderMap::new();
        assert!(matches!(
            decide_next(&r, &progress(answered(&none, 201), 1, SECOND)),
            Next::Final { .. }
        ));
        // Even on the last attempt, with an empty budget, or past the deadline: the answer is final.
        let mut last = progress(answered(&none, 422), 3, 20 * SECOND);
        last.replayable = false;
        assert!(matches!(
            decide_next(&retrier(0), &last),
            Next::Final { .. }
        ));
        let mut keyless = progress(Outcome::NoAnswer(TransportFailure::Interrupted), 1, SECOND);
        keyless.attempt = Attempt::new(&Method::POST, 1, false, keyless.attempt.outcome());
        let Next::Final { reason } = decide_next(&r, &keyless) else {
            panic!("a keyless POST is not retried");
        };
        assert!(reason.contains("Idempotency-Key"), "{reason}");
        assert_eq!(r.budget.available(), Some(100));
    }

    #[test]
    fn an_attempt_cut_off_at_the_deadline_ends_the_request() {
        let r = retrier(100);
        let mut cut = progress(TIMEOUT, 1, 10 * SECOND);
        cut.cut_at_deadline = true;
        assert_eq!(
            decide_next(&r, &cut),
            Next::Stop(StopReason::Deadline {
                deadline: 10 * SECOND,
                retry_after: None
            })
        );
        assert_eq!(r.budget.available(), Some(100));
    }

    #[test]
    fn the_last_attempt_exhausts_the_attempts() {
        let r = retrier(100);
        assert_eq!(
            decide_next(&r, &progress(TIMEOUT, 3, SECOND)),
            Next::Stop(StopReason::AttemptsExhausted { max_attempts: 3 })
        );
        let mut once = retrier(100);
        once.config.max_attempts = 0;
        assert_eq!(
            decide_next(&once, &progress(TIMEOUT, 1, SECOND)),
            Next::Stop(StopReason::AttemptsExhausted { max_attempts: 1 }),
            "0 attempts is taken as 1"
        );
        assert_eq!(r.budget.available(), Some(100));
    }

    #[test]
    fn a_body_that_cannot_be_sent_again_ends_the_request() {
        let r = retrier(100);
        let mut streamed = progress(TIMEOUT, 1, SECOND);
        streamed.replayable = false;
        assert_eq!(
            decide_next(&r, &streamed),
            Next::Stop(StopReason::BodyNotReplayable)
        );
        assert_eq!(r.budget.available(), Some(100));
    }

    #[test]
    fn a_retry_after_above_the_cap_ends_the_request() {
        let r = retrier(100);
        let asked = retry_after("31");
        assert_eq!(
            decide_next(&r, &progress(answered(&asked, 429), 1, SECOND)),
            Next::Stop(StopReason::RetryAfterTooLong {
                requested: 31 * SECOND,
                cap: 30 * SECOND
            })
        );
        let at_cap = retry_after("30");
        assert!(
            matches!(
                decide_next(&r, &progress(answered(&at_cap, 429), 1, SECOND)),
                Next::Stop(StopReason::Deadline { .. })
            ),
            "the cap itself is allowed (here the deadline stops it)"
        );
        assert_eq!(r.budget.available(), Some(100));
    }

    #[test]
    fn a_wait_that_ends_at_the_deadline_ends_the_request_and_names_retry_after_if_to_blame() {
        let r = retrier(100);
        let deadline = |retry_after| {
            Next::Stop(StopReason::Deadline {
                deadline: 10 * SECOND,
                retry_after,
            })
        };
        // The backoff's 1 s from 9 s ends exactly at the deadline.
        assert_eq!(
            decide_next(&r, &progress(TIMEOUT, 1, 9 * SECOND)),
            deadline(None)
        );
        let asked = retry_after("5");
        assert_eq!(
            decide_next(&r, &progress(answered(&asked, 503), 1, 6 * SECOND)),
            deadline(Some(5 * SECOND))
        );
        // The backoff (2 s), not the server's 1 s, is what reaches the deadline.
        let short = retry_after("1");
        assert_eq!(
            decide_next(&r, &progress(answered(&short, 503), 2, 8 * SECOND)),
            deadline(None)
        );
        let mut tomorrow = retrier(100);
        tomorrow.config.max_retry_after = Duration::MAX;
        let huge = retry_after("99999999999999999999999");
        assert_eq!(
            decide_next(&tomorrow, &progress(answered(&huge, 503), 1, SECOND)),
            deadline(Some(Duration::from_secs(u64::MAX))),
            "a wait past the end of time is past the deadline, not a panic"
        );
        assert_eq!(r.budget.available(), Some(100));

        let mut no_deadline = progress(TIMEOUT, 1, 9 * SECOND);
        no_deadline.deadline_at = None;
        assert!(matches!(decide_next(&r, &no_deadline), Next::Retry { .. }));
    }

    #[test]
    fn an_empty_budget_ends_the_request() {
        let r = retrier(9);
        assert_eq!(
            decide_next(&r, &progress(TIMEOUT, 1, SECOND)),
            Next::Stop(StopReason::BudgetExhausted),
            "a retry after a timeout costs 10"
        );
        assert_eq!(r.budget.available(), Some(9));
        let none = HeaderMap::new();
        assert!(matches!(
            decide_next(&r, &progress(answered(&none, 503), 1, SECOND)),
            Next::Retry { cost: 5, .. }
        ));
        assert_eq!(r.budget.available(), Some(4));
    }
}
