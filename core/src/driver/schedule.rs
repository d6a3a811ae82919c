//! Dial and join schedules (docs/spec/driver.md §4.2, §4.3), as pure policy and trackers.
//!
//! - Dial: at most one dial per peer in flight; 3 attempts of 10 s each, 200 ms then 600 ms
//!   between them. A frame that meets a cache miss is dropped (counted) while the dial runs.
//! - Join: up to 5 attempts of 10 s each; 2 s before the second, doubling to a 30 s cap.
//!   Status `Connecting{attempt, max}` → `Sending` → `Sent` | `Failed`.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::time::Time;

/// Dial attempts per background dial.
pub const DIAL_ATTEMPTS: u32 = 3;
/// Time allowed to one dial attempt.
pub const DIAL_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// Waits before the second and third dial attempts.
pub const DIAL_BACKOFF: [Duration; 2] = [Duration::from_millis(200), Duration::from_millis(600)];
/// Join attempts per seed.
pub const JOIN_ATTEMPTS: u32 = 5;
/// Wait before the second join attempt; it doubles after each failure.
pub const JOIN_FIRST_DELAY: Duration = Duration::from_secs(2);
/// Longest wait between join attempts.
pub const JOIN_DELAY_CAP: Duration = Duration::from_secs(30);
/// Time allowed to one join attempt.
pub const JOIN_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// What to do after dial attempt `attempt` (1-based) failed: wait and retry, or give up.
pub fn dial_retry_after(attempt: u32) -> Option<Duration> {
    if attempt >= DIAL_ATTEMPTS {
        return None;
    }
    DIAL_BACKOFF.get(attempt as usize - 1).copied()
}

/// What to do after join attempt `attempt` (1-based) failed.
pub fn join_retry_after(attempt: u32) -> Option<Duration> {
    if attempt >= JOIN_ATTEMPTS {
        return None;
    }
    let doubled = JOIN_FIRST_DELAY.saturating_mul(1u32 << (attempt - 1).min(16));
    Some(doubled.min(JOIN_DELAY_CAP))
}

/// Peers with a background dial in flight: at most one each.
#[derive(Debug, Clone)]
pub struct DialTracker<P> {
    dialing: BTreeSet<P>,
}

impl<P: Ord + Clone> Default for DialTracker<P> {
    fn default() -> Self {
        Self {
            dialing: BTreeSet::new(),
        }
    }
}

impl<P: Ord + Clone> DialTracker<P> {
    /// Whether a dial to `peer` should start now (false: one is already running).
    pub fn start(&mut self, peer: &P) -> bool {
        self.dialing.insert(peer.clone())
    }

    /// The dial to `peer` ended (connected or gave up).
    pub fn finish(&mut self, peer: &P) {
        self.dialing.remove(peer);
    }

    /// Whether a dial to `peer` is running.
    pub fn is_dialing(&self, peer: &P) -> bool {
        self.dialing.contains(peer)
    }
}

/// Where a join to one seed stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "phase")]
pub enum JoinPhase {
    /// Connecting, attempt `attempt` of `max`.
    Connecting {
        /// 1-based.
        attempt: u32,
        /// Attempts allowed.
        max: u32,
    },
    /// Connected; the join request is being written.
    Sending,
    /// The join request was written (membership converges elsewhere).
    Sent,
    /// Every attempt failed.
    Failed,
}

/// A join's status as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct JoinStatus {
    /// The phase.
    pub phase: JoinPhase,
    /// The seed address carries a relay URL.
    pub has_relay: bool,
    /// The seed address carries direct addresses.
    pub has_direct: bool,
    /// How many direct addresses.
    pub direct_addresses: usize,
    /// The last error, when an attempt failed.
    pub last_error: Option<String>,
    /// When the status last changed.
    pub updated_at: Time,
}

/// The next step of a join after an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinNext {
    /// Start attempt `attempt` at `at`.
    Attempt {
        /// 1-based.
        attempt: u32,
        /// When.
        at: Time,
    },
    /// Nothing more to do.
    Done,
}

/// One join to one seed.
#[derive(Debug, Clone)]
pub struct Join {
    status: JoinStatus,
    attempt: u32,
}

impl Join {
    /// A join starting now with attempt 1; describe the seed address.
    pub fn start(now: Time, has_relay: bool, direct_addresses: usize) -> (Self, JoinNext) {
        let join = Self {
            status: JoinStatus {
                phase: JoinPhase::Connecting {
                    attempt: 1,
                    max: JOIN_ATTEMPTS,
                },
                has_relay,
                has_direct: direct_addresses > 0,
                direct_addresses,
                last_error: None,
                updated_at: now,
            },
            attempt: 1,
        };
        (
            join,
            JoinNext::Attempt {
                attempt: 1,
                at: now,
            },
        )
    }

    /// The status.
    pub fn status(&self) -> &JoinStatus {
        &self.status
    }

    /// The current attempt connected; the request is being written. Ignored unless
    /// connecting.
    pub fn connected(&mut self, now: Time) {
        if matches!(self.status.phase, JoinPhase::Connecting { .. }) {
            self.set(now, JoinPhase::Sending);
        }
    }

    /// The request was written. Ignored unless sending.
    pub fn sent(&mut self, now: Time) -> JoinNext {
        if self.status.phase == JoinPhase::Sending {
            self.set(now, JoinPhase::Sent);
        }
        JoinNext::Done
    }

    /// The current attempt failed (dial, timeout or write). Ignored once the join ended.
    pub fn failed(&mut self, now: Time, error: impl Into<String>) -> JoinNext {
        if matches!(self.status.phase, JoinPhase::Sent | JoinPhase::Failed) {
            return JoinNext::Done;
        }
        self.status.last_error = Some(error.into());
        match join_retry_after(self.attempt) {
            Some(wait) => {
                self.attempt += 1;
                self.set(
                    now,
                    JoinPhase::Connecting {
                        attempt: self.attempt,
                        max: JOIN_ATTEMPTS,
                    },
                );
                JoinNext::Attempt {
                    attempt: self.attempt,
                    at: now.saturating_add(wait),
                }
            }
            None => {
                self.set(now, JoinPhase::Failed);
                JoinNext::Done
            }
        }
    }

    fn set(&mut self, now: Time, phase: JoinPhase) {
        self.status.phase = phase;
        self.status.updated_at = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dial_backoff_is_200_then_600_then_give_up() {
        assert_eq!(dial_retry_after(1), Some(Duration::from_millis(200)));
        assert_eq!(dial_retry_after(2), Some(Duration::from_millis(600)));
        assert_eq!(dial_retry_after(3), None);
    }

    #[test]
    fn join_delays_double_from_two_seconds_and_five_attempts_end_failed() {
        let delays: Vec<_> = (1..=5).map(join_retry_after).collect();
        assert_eq!(
            delays,
            vec![
                Some(Duration::from_secs(2)),
                Some(Duration::from_secs(4)),
                Some(Duration::from_secs(8)),
                Some(Duration::from_secs(16)),
                None
            ]
        );
        let (mut join, next) = Join::start(Time::ZERO, false, 1);
        assert_eq!(
            next,
            JoinNext::Attempt {
                attempt: 1,
                at: Time::ZERO
            }
        );
        let mut now = Time::ZERO;
        for attempt in 2..=5 {
            match join.failed(now, "refused") {
                JoinNext::Attempt { attempt: a, at } => {
                    assert_eq!(a, attempt);
                    assert_eq!(
                        join.status().phase,
                        JoinPhase::Connecting { attempt, max: 5 }
                    );
                    now = at;
                }
                JoinNext::Done => panic!("gave up early"),
            }
        }
        assert_eq!(join.failed(now, "refused"), JoinNext::Done);
        assert_eq!(join.status().phase, JoinPhase::Failed);
        assert_eq!(join.status().last_error.as_deref(), Some("refused"));
        assert_eq!(now, Time::from_millis(2_000 + 4_000 + 8_000 + 16_000));
    }

    #[test]
    fn the_delay_caps_at_thirty_seconds() {
        // With the cap, a longer schedule never waits more than 30 s.
        assert!((1..5).all(|a| join_retry_after(a).unwrap() <= JOIN_DELAY_CAP));
    }

    #[test]
    fn a_join_that_connects_goes_sending_then_sent() {
        let (mut join, _) = Join::start(Time::ZERO, true, 0);
        join.connected(Time::from_millis(5));
        assert_eq!(join.status().phase, JoinPhase::Sending);
        assert_eq!(join.sent(Time::from_millis(6)), JoinNext::Done);
        assert_eq!(join.status().phase, JoinPhase::Sent);
        assert!(join.status().has_relay && !join.status().has_direct);
        assert_eq!(join.status().updated_at, Time::from_millis(6));
    }

    #[test]
    fn at_most_one_dial_per_peer() {
        let mut dials = DialTracker::default();
        assert!(dials.start(&1));
        assert!(!dials.start(&1));
        assert!(dials.start(&2));
        dials.finish(&1);
        assert!(dials.start(&1));
    }
}
