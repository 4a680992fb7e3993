//! Exponential backoff with full jitter.
//!
//! The ceiling doubles with every retry (`base`, `2 × base`, `4 × base`, ... up to `max`) and the
//! actual wait is uniform between zero and the ceiling ("full jitter", as in the AWS Architecture Blog's
//! "Exponential Backoff And Jitter"): clients that failed together don't retry together.

use std::time::Duration;

/// Exponential backoff with full jitter.
///
/// ```
/// use idem_runtime::client::ExponentialBackoff;
/// use std::time::Duration;
///
/// let backoff = ExponentialBackoff::new(Duration::from_millis(100), Duration::from_secs(1));
/// assert_eq!(backoff.ceiling(1), Duration::from_millis(100));
/// assert_eq!(backoff.ceiling(3), Duration::from_millis(400));
/// assert_eq!(backoff.ceiling(10), Duration::from_secs(1)); // capped
/// // The wait is a fraction of the ceiling, drawn at random by the client.
/// assert_eq!(backoff.jittered(3, 0.5), Duration::from_millis(200));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExponentialBackoff {
    base: Duration,
    max: Duration,
}

impl ExponentialBackoff {
    /// Backoff whose ceiling starts at `base` and doubles per retry up to `max`.
    pub const fn new(base: Duration, max: Duration) -> Self {
        Self { base, max }
    }

    /// The ceiling before retry number `retry` (1 for the first retry): `base × 2^(retry − 1)`, at
    /// most `max`.
    pub fn ceiling(&self, retry: u32) -> Duration {
        let doublings = retry.saturating_sub(1).min(63);
        self.base
            .checked_mul(1u32.checked_shl(doublings).unwrap_or(u32::MAX))
            .unwrap_or(Duration::MAX)
            .min(self.max)
    }

    /// The wait before retry `retry` for a random `fraction` in `[0, 1]` (clamped).
    pub fn jittered(&self, retry: u32, fraction: f64) -> Duration {
        let fraction = if fraction.is_nan() {
            0.0
        } else {
            fraction.clamp(0.0, 1.0)
        };
        let ceiling = self.ceiling(retry);
        // `mul_f64` panics when the float rounds above `Duration::MAX`; saturate instead.
        Duration::try_from_secs_f64(ceiling.as_secs_f64() * fraction)
            .map_or(ceiling, |d| d.min(ceiling))
    }
}

impl Default for ExponentialBackoff {
    /// 100 ms, doubling up to 5 s.
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(5))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_doubles_then_caps_without_overflow() {
        let b = ExponentialBackoff::new(Duration::from_millis(10), Duration::from_secs(60));
        let ceilings: Vec<_> = (1..=5).map(|r| b.ceiling(r).as_millis()).collect();
        assert_eq!(ceilings, [10, 20, 40, 80, 160]);
        assert_eq!(b.ceiling(0), Duration::from_millis(10));
        assert_eq!(b.ceiling(40), Duration::from_secs(60));
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(60));
        let huge = ExponentialBackoff::new(Duration::MAX, Duration::MAX);
        assert_eq!(huge.ceiling(5), Duration::MAX);
        assert_eq!(huge.jittered(5, 1.0), Duration::MAX);
    }

    #[test]
    fn jitter_stays_between_zero_and_the_ceiling() {
        let b = ExponentialBackoff::default();
        assert_eq!(b.jittered(2, 0.0), Duration::ZERO);
        assert_eq!(b.jittered(2, 1.0), b.ceiling(2));
        assert_eq!(b.jittered(2, 7.0), b.ceiling(2));
        assert_eq!(b.jittered(2, -1.0), Duration::ZERO);
        assert_eq!(b.jittered(2, f64::NAN), Duration::ZERO);
        for _ in 0..1000 {
            assert!(b.jittered(3, rand::random()) <= b.ceiling(3));
        }
    }
}
