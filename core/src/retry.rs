//! Capped exponential backoff with jitter, pure and seeded: the policy of every retry tether
//! chooses itself.
//!
//! The substrate's retries go through a [`Backoff`]: its transient retries (an op answered
//! `rate_limited`, `quota`, `busy`, ...), and a peer's redials of a lost link and retries of a
//! failing store (`substrate::peer`). The one other schedule is the node driver's: its dials and
//! joins follow fixed tables that the transport driver's specification gives
//! (`driver::schedule`), and they stay there.
//!
//! Jitter comes from entropy the caller passes in (core reads no OS randomness), so a run
//! replays exactly from its seed.

use std::time::Duration;

use crate::time::Time;

/// Capped exponential backoff: attempt `n` (from 0) waits a random duration in
/// `[ceiling/2, ceiling]` where `ceiling = min(cap, base · 2ⁿ)` ("equal jitter": never zero, so
/// a retry storm cannot spin, and never in lockstep with another retrier).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The ceiling of the first wait.
    pub base: Duration,
    /// The largest ceiling.
    pub cap: Duration,
}

impl Backoff {
    /// A policy from `base` doubling to `cap`.
    pub const fn new(base: Duration, cap: Duration) -> Self {
        Self { base, cap }
    }

    /// The ceiling of attempt `attempt` (0-based).
    pub fn ceiling(&self, attempt: u32) -> Duration {
        self.base
            .saturating_mul(1u32 << attempt.min(20))
            .min(self.cap)
            .max(Duration::from_millis(1))
    }

    /// How long attempt `attempt` (0-based) waits, jittered by `entropy`.
    pub fn delay(&self, attempt: u32, entropy: u64) -> Duration {
        let ceiling = u64::try_from(self.ceiling(attempt).as_millis()).unwrap_or(u64::MAX);
        let half = ceiling / 2;
        let spread = ceiling - half;
        Duration::from_millis(half + entropy % (spread + 1))
    }
}

/// A retrier's state: how many attempts have failed in a row, and when to try next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    policy: Backoff,
    failures: u32,
    due: Option<Time>,
}

impl Retry {
    /// A retrier with nothing failed yet.
    pub const fn new(policy: Backoff) -> Self {
        Self {
            policy,
            failures: 0,
            due: None,
        }
    }

    /// An attempt failed at `now`: the next one is due after the backoff. Returns when.
    pub fn fail(&mut self, now: Time, entropy: u64) -> Time {
        let at = now.saturating_add(self.policy.delay(self.failures, entropy));
        self.failures = self.failures.saturating_add(1);
        self.due = Some(at);
        at
    }

    /// An attempt succeeded: the next failure starts from the base again.
    pub fn succeed(&mut self) {
        self.failures = 0;
        self.due = None;
    }

    /// Attempts failed in a row.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// When the next attempt is due, if one is scheduled.
    pub fn due(&self) -> Option<Time> {
        self.due
    }

    /// Whether an attempt is due at `now`; taking it clears the schedule.
    pub fn take_due(&mut self, now: Time) -> bool {
        if self.due.is_some_and(|at| at <= now) {
            self.due = None;
            return true;
        }
        false
    }

    /// Schedules an attempt at `at` without counting a failure (a first attempt).
    pub fn schedule(&mut self, at: Time) {
        self.due = Some(at);
    }
}

/// A small deterministic generator (SplitMix64) for jitter inside machines, seeded by the
/// shell. Not for secrets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Jitter(u64);

impl Jitter {
    /// A generator seeded with `seed`.
    pub const fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ceilings_double_to_the_cap() {
        let policy = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let ceilings: Vec<u64> = (0..6)
            .map(|n| policy.ceiling(n).as_millis() as u64)
            .collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(policy.ceiling(u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn a_retrier_backs_off_and_resets_on_success() {
        let policy = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
        let mut retry = Retry::new(policy);
        let now = Time::from_millis(1_000);
        let first = retry.fail(now, 0);
        assert_eq!(first, Time::from_millis(1_050));
        let second = retry.fail(now, u64::MAX);
        assert!(second > first && second <= Time::from_millis(1_200));
        assert_eq!(retry.failures(), 2);
        assert!(!retry.take_due(Time::from_millis(1_000)));
        assert!(retry.take_due(second));
        assert_eq!(retry.due(), None);
        retry.succeed();
        assert_eq!(retry.failures(), 0);
    }

    #[test]
    fn jitter_is_deterministic_per_seed() {
        let (mut a, mut b) = (Jitter::new(7), Jitter::new(7));
        let left: Vec<u64> = (0..4).map(|_| a.next_u64()).collect();
        let right: Vec<u64> = (0..4).map(|_| b.next_u64()).collect();
        assert_eq!(left, right);
        assert_ne!(left[0], Jitter::new(8).next_u64());
    }

    proptest! {
        #[test]
        fn every_delay_lies_in_the_upper_half_of_its_ceiling(
            base in 1u64..10_000, cap in 1u64..100_000, attempt in 0u32..64, entropy in any::<u64>(),
        ) {
            let policy = Backoff::new(Duration::from_millis(base), Duration::from_millis(cap));
            let ceiling = policy.ceiling(attempt);
            let delay = policy.delay(attempt, entropy);
            prop_assert!(delay <= ceiling);
            // Delays are whole milliseconds: the upper half of an odd ceiling starts at its
            // half rounded down (a ceiling of 799 ms waits 399 ms at least).
            prop_assert!(delay.as_millis() >= ceiling.as_millis() / 2);
            prop_assert!(delay > Duration::ZERO);
        }
    }
}
