//! Time as core sees it: a point on the caller's monotonic clock, passed in.
//!
//! Core never reads a clock (docs/architecture.md §1). Shells convert their own clock
//! (`tokio::time::Instant`, turmoil's simulated clock) into a [`Time`] by counting milliseconds
//! from an epoch of their choosing; only differences between two `Time`s carry meaning.

use std::time::Duration;

/// A point in time, in milliseconds since the caller's epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize)]
#[serde(transparent)]
pub struct Time(u64);

impl Time {
    /// The caller's epoch.
    pub const ZERO: Time = Time(0);

    /// `millis` milliseconds after the epoch.
    pub const fn from_millis(millis: u64) -> Self {
        Self(millis)
    }

    /// Milliseconds since the epoch.
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// Time elapsed from `earlier` to `self`, zero when `earlier` is later (a caller whose clock
    /// went backwards never makes core see a negative duration).
    pub fn saturating_since(self, earlier: Time) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }

    /// `self + duration`, saturating at the end of time.
    pub fn saturating_add(self, duration: Duration) -> Time {
        let millis = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        Time(self.0.saturating_add(millis))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_saturate() {
        let early = Time::from_millis(10);
        let late = Time::from_millis(25);
        assert_eq!(late.saturating_since(early), Duration::from_millis(15));
        assert_eq!(early.saturating_since(late), Duration::ZERO);
        assert_eq!(
            Time::from_millis(u64::MAX)
                .saturating_add(Duration::from_secs(1))
                .as_millis(),
            u64::MAX
        );
    }
}
