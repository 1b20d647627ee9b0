//! Where the time comes from: the system's monotonic clock, or a hand-moved one for tests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A monotonic clock: the time since some fixed start.
pub trait Clock: Send + Sync + 'static {
    /// The time since this clock's start.
    fn now(&self) -> Duration;
}

/// The system's monotonic clock, started when created.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock {
    start: Instant,
}

impl SystemClock {
    /// A clock whose zero is now.
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.start.elapsed()
    }
}

/// A clock that stands still until moved, to the millisecond (tests).
#[derive(Debug, Default)]
pub struct ManualClock {
    millis: AtomicU64,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn at(start: Duration) -> Self {
        let clock = Self::default();
        clock.set(start);
        clock
    }

    /// Moves the clock to `now`.
    pub fn set(&self, now: Duration) {
        let millis = u64::try_from(now.as_millis()).unwrap_or(u64::MAX);
        self.millis.store(millis, Ordering::SeqCst);
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let millis = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.millis.fetch_add(millis, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_millis(self.millis.load(Ordering::SeqCst))
    }
}
