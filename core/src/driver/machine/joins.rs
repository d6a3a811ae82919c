//! Dials and joins: attempts, backoff and the join schedule per seed.

use super::*;

impl<C: Clone> Driver<C> {
    /// Dial attempt to `peer` ended: connected (cached; the returned generation) or failed.
    ///
    /// Answered by [`Answer::Cached`] ([`Driver::poll_answer`]).
    pub fn handle_dialed(&mut self, now: Time, peer: NodeId, result: Result<C, DialFailure>) {
        let answer = self.answer_dialed(now, peer, result);
        self.answer = Some(Answer::Cached(answer));
    }

    /// What [`Driver::handle_dialed`] answers.
    pub(super) fn answer_dialed(
        &mut self,
        now: Time,
        peer: NodeId,
        result: Result<C, DialFailure>,
    ) -> Option<Generation> {
        let attempt = match self.dials.get(&peer) {
            Some(DialState::InFlight(attempt)) => Some(*attempt),
            _ => None,
        };
        match result {
            Ok(conn) => {
                if attempt.is_some() {
                    self.dials.remove(&peer);
                }
                self.answer_connected(now, peer, Channel::Actor, conn)
            }
            Err(_) => {
                self.counters.dial_failures += 1;
                self.bump();
                let attempt = attempt?;
                match dial_retry_after(attempt).filter(|_| !self.closed) {
                    Some(wait) => {
                        let at = now.saturating_add(wait);
                        self.dials.insert(peer, DialState::Waiting(attempt + 1, at));
                        self.timers.insert((at, Timer::Dial(peer)));
                    }
                    None => {
                        self.dials.remove(&peer);
                    }
                }
                None
            }
        }
    }

    /// The application records `relays` seen in an address of `peer`.
    pub fn handle_relays_seen(&mut self, _now: Time, peer: NodeId, relays: Vec<String>) {
        self.relay_hints.record(peer, relays);
    }

    /// Joins through seed `peer` (its address has a relay, and `direct_addresses`): refused
    /// (counted) off the allow-list; a join already running for the seed goes on.
    ///
    /// Answered by [`Answer::Admitted`] ([`Driver::poll_answer`]).
    pub fn handle_join(
        &mut self,
        now: Time,
        peer: NodeId,
        has_relay: bool,
        direct_addresses: usize,
    ) {
        let answer = self.answer_join(now, peer, has_relay, direct_addresses);
        self.answer = Some(Answer::Admitted(answer));
    }

    /// What [`Driver::handle_join`] answers.
    pub(super) fn answer_join(
        &mut self,
        now: Time,
        peer: NodeId,
        has_relay: bool,
        direct_addresses: usize,
    ) -> Result<(), Refused> {
        self.answer_admit(now, &peer, Path::Join, Direction::Outbound)?;
        if self.closed
            || self
                .joins
                .get(&peer)
                .is_some_and(|state| state.next != JoinStep::Done)
        {
            return Ok(());
        }
        let (join, next) = Join::start(now, has_relay, direct_addresses);
        self.joins.insert(
            peer,
            JoinState {
                join,
                next: JoinStep::Done,
            },
        );
        self.join_next(now, peer, next);
        self.bump();
        Ok(())
    }

    /// The join attempt to `peer` connected; the request is being written.
    pub fn handle_join_connected(&mut self, now: Time, peer: NodeId) {
        if let Some(state) = self.join_in_flight(&peer) {
            state.join.connected(now);
            self.bump();
        }
    }

    /// The join request to `peer` was written on `conn`, which is cached (the generation).
    ///
    /// Answered by [`Answer::Cached`] ([`Driver::poll_answer`]).
    pub fn handle_join_sent(&mut self, now: Time, peer: NodeId, conn: C) {
        let answer = self.answer_join_sent(now, peer, conn);
        self.answer = Some(Answer::Cached(answer));
    }

    /// What [`Driver::handle_join_sent`] answers.
    pub(super) fn answer_join_sent(
        &mut self,
        now: Time,
        peer: NodeId,
        conn: C,
    ) -> Option<Generation> {
        if let Some(state) = self.join_in_flight(&peer) {
            // Written implies connected, reported or not.
            state.join.connected(now);
            let next = state.join.sent(now);
            self.join_next(now, peer, next);
            self.bump();
        }
        self.answer_connected(now, peer, Channel::Actor, conn)
    }

    /// The join attempt to `peer` failed (dial, timeout or write).
    pub fn handle_join_failed(&mut self, now: Time, peer: NodeId, error: impl Into<String>) {
        if let Some(state) = self.join_in_flight(&peer) {
            let next = state.join.failed(now, error);
            self.join_next(now, peer, next);
            self.bump();
        }
    }

    /// Starts a background dial of `peer` unless one is in progress.
    pub(super) fn dial(&mut self, peer: NodeId) {
        if self.dials.contains_key(&peer) || !(self.config.valid_peer)(&peer) {
            return;
        }
        self.counters.dials_started += 1;
        self.start_dial_attempt(peer, 1);
    }

    pub(super) fn start_dial_attempt(&mut self, peer: NodeId, attempt: u32) {
        self.dials.insert(peer, DialState::InFlight(attempt));
        self.actions.push_back(Action::Dial {
            peer,
            attempt,
            timeout: self.config.dial_attempt_timeout,
        });
        self.bump();
    }

    pub(super) fn join_in_flight(&mut self, peer: &NodeId) -> Option<&mut JoinState> {
        self.joins
            .get_mut(peer)
            .filter(|state| matches!(state.next, JoinStep::InFlight(_)))
    }

    pub(super) fn join_next(&mut self, now: Time, peer: NodeId, next: JoinNext) {
        let Some(state) = self.joins.get_mut(&peer) else {
            return;
        };
        state.next = match next {
            JoinNext::Done => JoinStep::Done,
            JoinNext::Attempt { attempt, at } if at <= now => {
                self.actions.push_back(Action::JoinAttempt {
                    peer,
                    attempt,
                    timeout: self.config.join_attempt_timeout,
                });
                JoinStep::InFlight(attempt)
            }
            JoinNext::Attempt { attempt, at } => {
                let wait = at.saturating_since(now) / self.config.join_delay_divisor.max(1);
                let at = now.saturating_add(wait);
                self.timers.insert((at, Timer::Join(peer)));
                JoinStep::Waiting(attempt, at)
            }
        };
    }
}
