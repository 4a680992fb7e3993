//! Wall-clock time as the engine and the stores see it.
//!
//! Records carry absolute times (milliseconds since the Unix epoch) because they are shared between
//! processes and machines. The clock is injectable so that tests can drive expiry, lease takeover and
//! purging by moving a [`ManualClock`] instead of sleeping.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in time: milliseconds since the Unix epoch, UTC.
///
/// ```
/// use idem_runtime::clock::Timestamp;
/// use std::time::Duration;
/// let t = Timestamp::from_millis(1_000);
/// assert_eq!(t + Duration::from_secs(2), Timestamp::from_millis(3_000));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(i64);

impl Timestamp {
    /// The timestamp `ms` milliseconds after the Unix epoch.
    pub const fn from_millis(ms: i64) -> Self {
        Self(ms)
    }

    /// Milliseconds since the Unix epoch.
    pub const fn as_millis(self) -> i64 {
        self.0
    }

    /// How long from `self` until `later`; zero if `later` is not after `self`.
    pub fn until(self, later: Timestamp) -> Duration {
        Duration::from_millis(u64::try_from(later.0.saturating_sub(self.0)).unwrap_or(0))
    }

    /// This timestamp as a [`SystemTime`] (for HTTP dates).
    pub fn to_system_time(self) -> SystemTime {
        match u64::try_from(self.0) {
            Ok(ms) => UNIX_EPOCH + Duration::from_millis(ms),
            Err(_) => UNIX_EPOCH,
        }
    }
}

impl std::ops::Add<Duration> for Timestamp {
    type Output = Timestamp;
    fn add(self, rhs: Duration) -> Timestamp {
        let ms = i64::try_from(rhs.as_millis()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_add(ms))
    }
}

/// A source of the current time.
pub trait Clock: std::fmt::Debug + Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Timestamp {
        (**self).now()
    }
}

/// The system's real-time clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        Timestamp(ms)
    }
}

/// A clock that only moves when told to; clones share the same time.
///
/// ```
/// use idem_runtime::clock::{Clock, ManualClock, Timestamp};
/// use std::time::Duration;
/// let clock = ManualClock::new(Timestamp::from_millis(0));
/// clock.advance(Duration::from_secs(90));
/// assert_eq!(clock.now().as_millis(), 90_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: Timestamp) -> Self {
        Self(Arc::new(AtomicI64::new(start.0)))
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let ms = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        self.0.fetch_add(ms, Ordering::SeqCst);
    }

    /// Sets the clock to `to` (it may move backwards: clocks on different machines disagree).
    pub fn set(&self, to: Timestamp) {
        self.0.store(to.0, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.load(Ordering::SeqCst))
    }
}

/// Record time that follows tokio's clock (paused in tests), so that a store's lease expiry and
/// tokio's sleeps agree.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct TokioClock {
    base: Timestamp,
    start: tokio::time::Instant,
}

#[cfg(test)]
impl TokioClock {
    pub(crate) fn new() -> Self {
        Self {
            base: Timestamp::from_millis(1_000_000),
            start: tokio::time::Instant::now(),
        }
    }
}

#[cfg(test)]
impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        self.base + self.start.elapsed()
    }
}
