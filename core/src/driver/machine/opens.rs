//! Connections and opens: the cache's inserts and evictions, where an open goes, and the dials opens share.

use super::*;

impl<C: Clone> Driver<C> {
    /// An outbound connection to `peer` on `channel` was established (a `connect`, or the
    /// dial an [`Open::Dial`] ordered for a protocol, telemetry, switch or substrate stream):
    /// it is cached under the returned generation, and an open's dial in flight for the pair
    /// ends (whatever its ticket: its waiters take this connection), and a failure kept for
    /// the pair's waiters goes. Admission was asked before dialing.
    ///
    /// Answered by [`Answer::Cached`] ([`Driver::poll_answer`]).
    pub fn handle_connected(&mut self, now: Time, peer: NodeId, channel: Channel, conn: C) {
        let answer = self.answer_connected(now, peer, channel, conn);
        self.answer = Some(Answer::Cached(answer));
    }

    /// What [`Driver::handle_connected`] answers.
    pub(super) fn answer_connected(
        &mut self,
        _now: Time,
        peer: NodeId,
        channel: Channel,
        conn: C,
    ) -> Option<Generation> {
        if self.opening.remove(&(peer, channel)).is_some() {
            self.bump();
        }
        if self.closed {
            self.actions.push_back(Action::Close {
                conn,
                code: CLOSE_SHUTDOWN,
            });
            return None;
        }
        Some(self.cache(peer, channel, conn, false))
    }

    /// The cached connection to `peer` on `channel`, if any.
    pub fn connection(&self, peer: &NodeId, channel: Channel) -> Option<(Generation, C)> {
        self.cache
            .peek(&(*peer, channel))
            .map(|entry| (entry.generation, entry.conn.clone()))
    }

    /// The connection of `generation` to `peer` on `channel` ended (its reader saw it
    /// close). Removed only if still current.
    pub fn handle_connection_closed(
        &mut self,
        _now: Time,
        peer: NodeId,
        channel: Channel,
        generation: Generation,
    ) {
        if self.cache.fail(&(peer, channel), generation) == Eviction::Evicted {
            self.conn_ended(peer, channel, generation, ConnEndCause::Closed);
            self.bump();
        }
    }

    /// What ran over the connection of `generation` to `peer` on `channel` stopped answering
    /// (a liveness cut): if that generation is still cached it is evicted and closed with
    /// [`CLOSE_UNRESPONSIVE`], so that the next stream dials afresh instead of queueing
    /// behind a peer that no longer reads (and its stream credit). A newer connection stays.
    pub fn handle_unresponsive(
        &mut self,
        _now: Time,
        peer: NodeId,
        channel: Channel,
        generation: Generation,
    ) {
        if let Some(entry) = self.cache.evict(&(peer, channel), generation) {
            self.conn_ended(peer, channel, generation, ConnEndCause::Unresponsive);
            self.counters.evictions += 1;
            self.actions.push_back(Action::Close {
                conn: entry.conn,
                code: CLOSE_UNRESPONSIVE,
            });
            self.bump();
        }
    }

    /// The application opens a stream to `peer` on `channel` (a protocol stream, or a record
    /// that must reach the peer, such as a subscription): the allow-list for `path` first
    /// (refused: counted, nothing else changes), then the cache decides where it goes.
    ///
    /// Answered by [`Answer::Open`] ([`Driver::poll_answer`]).
    pub fn handle_open(&mut self, now: Time, peer: NodeId, path: Path, channel: Channel) {
        let answer = self.answer_open(now, peer, path, channel);
        self.answer = Some(Answer::Open(answer));
    }

    /// What [`Driver::handle_open`] answers.
    pub(super) fn answer_open(
        &mut self,
        now: Time,
        peer: NodeId,
        path: Path,
        channel: Channel,
    ) -> Result<Open<C>, Refused> {
        self.answer_admit(now, &peer, path, Direction::Outbound)?;
        Ok(self.open_on(peer, channel))
    }

    /// An open told [`Open::Wait`] with `ticket` asks again (the machine's state moved): it
    /// takes a connection cached meanwhile, fails if that dial failed, waits on if it is still
    /// in flight, and otherwise goes where an open would now go.
    ///
    /// Answered by [`Answer::Open`] ([`Driver::poll_answer`]).
    pub fn handle_open_waited(
        &mut self,
        now: Time,
        peer: NodeId,
        channel: Channel,
        ticket: DialTicket,
    ) {
        let answer = self.answer_open_waited(now, peer, channel, ticket);
        self.answer = Some(Answer::Open(Ok(answer)));
    }

    /// What [`Driver::handle_open_waited`] answers.
    pub(super) fn answer_open_waited(
        &mut self,
        _now: Time,
        peer: NodeId,
        channel: Channel,
        ticket: DialTicket,
    ) -> Open<C> {
        if self.closed {
            return Open::Closed;
        }
        let key = (peer, channel);
        if let Some((generation, conn)) = self.connection(&peer, channel) {
            self.forget_waiter(key, ticket);
            return Open::Cached(generation, conn);
        }
        if self
            .failed_opens
            .get(&key)
            .is_some_and(|failed| failed.ticket == ticket)
        {
            self.forget_waiter(key, ticket);
            return Open::Failed;
        }
        match self.opening.get(&key) {
            Some(opening) if opening.ticket == ticket => Open::Wait(ticket),
            _ => self.open_on(peer, channel),
        }
    }

    /// An open told [`Open::Wait`] with `ticket` went away before it was placed (its caller
    /// dropped it): it no longer counts among the dial's waiters.
    pub fn handle_open_wait_abandoned(
        &mut self,
        _now: Time,
        peer: NodeId,
        channel: Channel,
        ticket: DialTicket,
    ) {
        self.forget_waiter((peer, channel), ticket);
    }

    /// One waiter of the dial `ticket` to the pair is done with it: taken off the dial in
    /// flight, or off its kept failure (which goes with its last waiter).
    pub(super) fn forget_waiter(&mut self, key: (NodeId, Channel), ticket: DialTicket) {
        if let Some(opening) = self.opening.get_mut(&key) {
            if opening.ticket == ticket {
                opening.waiters = opening.waiters.saturating_sub(1);
                return;
            }
        }
        if let Some(failed) = self.failed_opens.get_mut(&key) {
            if failed.ticket == ticket {
                failed.waiters = failed.waiters.saturating_sub(1);
                if failed.waiters == 0 {
                    self.failed_opens.remove(&key);
                }
            }
        }
    }

    /// Where an open to `peer` on `channel` goes: nowhere once closed, the cached connection,
    /// a dial (now in flight, under a new ticket), or a wait on the dial in flight.
    pub(super) fn open_on(&mut self, peer: NodeId, channel: Channel) -> Open<C> {
        if self.closed {
            return Open::Closed;
        }
        if let Some((generation, conn)) = self.connection(&peer, channel) {
            return Open::Cached(generation, conn);
        }
        match self.opening.entry((peer, channel)) {
            Entry::Occupied(mut opening) => {
                let opening = opening.get_mut();
                opening.waiters = opening.waiters.saturating_add(1);
                Open::Wait(opening.ticket)
            }
            Entry::Vacant(vacant) => {
                self.tickets += 1;
                let ticket = DialTicket(self.tickets);
                vacant.insert(Opening { ticket, waiters: 0 });
                Open::Dial {
                    ticket,
                    timeout: self.config.dial_attempt_timeout,
                }
            }
        }
    }

    /// The dial an [`Open::Dial`] ordered under `ticket` did not connect. A failure is kept
    /// for the opens that wait on it (each hears it once, from
    /// [`Driver::handle_open_waited`]), unless the pair has a connection by now (they take
    /// it); after an abandoned dial they ask again and the first dials. A ticket that is no
    /// longer the pair's dial in flight changes nothing.
    pub fn handle_open_dial_failed(
        &mut self,
        _now: Time,
        peer: NodeId,
        channel: Channel,
        ticket: DialTicket,
        end: DialEnd,
    ) {
        let key = (peer, channel);
        if self.opening.get(&key).map(|opening| opening.ticket) != Some(ticket) {
            return;
        }
        let Some(opening) = self.opening.remove(&key) else {
            return;
        };
        let cached = self.cache.peek(&key).is_some();
        if end == DialEnd::Failed && opening.waiters > 0 && !cached {
            self.failed_opens.insert(key, opening);
            if self.failed_opens.len() > self.config.failed_opens_max {
                let oldest = self
                    .failed_opens
                    .iter()
                    .min_by_key(|(_, failed)| failed.ticket)
                    .map(|(key, _)| *key);
                if let Some(oldest) = oldest {
                    self.failed_opens.remove(&oldest);
                }
            }
        }
        self.bump();
    }

    /// Opening a stream on the cached connection of `generation` failed: the connection is
    /// dead. That generation is evicted (a newer one stays) and the stream goes where an open
    /// would now go: a newer cached connection, a fresh dial (once: a failure there is the
    /// caller's error), or a wait for another open's dial.
    ///
    /// Answered by [`Answer::Open`] ([`Driver::poll_answer`]).
    pub fn handle_open_failed(
        &mut self,
        now: Time,
        peer: NodeId,
        channel: Channel,
        generation: Generation,
    ) {
        let answer = self.answer_open_failed(now, peer, channel, generation);
        self.answer = Some(Answer::Open(Ok(answer)));
    }

    /// What [`Driver::handle_open_failed`] answers.
    pub(super) fn answer_open_failed(
        &mut self,
        _now: Time,
        peer: NodeId,
        channel: Channel,
        generation: Generation,
    ) -> Open<C> {
        self.open_failed(peer, channel, generation);
        self.open_on(peer, channel)
    }

    /// Opening a stream on the connection this open's own dial just made failed: the
    /// connection is dead, and that generation is evicted (a newer one stays). The open fails
    /// with the error it met; it does not dial again (a cached connection that fails gets one
    /// fresh dial, [`Driver::handle_open_failed`]; a fresh one that fails is the caller's).
    pub fn handle_fresh_open_failed(
        &mut self,
        _now: Time,
        peer: NodeId,
        channel: Channel,
        generation: Generation,
    ) {
        self.open_failed(peer, channel, generation);
    }

    pub(super) fn open_failed(&mut self, peer: NodeId, channel: Channel, generation: Generation) {
        if self.cache.fail(&(peer, channel), generation) == Eviction::Evicted {
            self.conn_ended(peer, channel, generation, ConnEndCause::OpenFailed);
            self.bump();
        }
    }

    /// How long opening a stream on a connection an open was placed on may take (cached or
    /// freshly dialed): past it the open has failed, as if the connection were dead. The same
    /// bound as a dial's ([`Config::dial_attempt_timeout`]): a peer that connects but never
    /// lets a stream open holds an open no longer than one that never connects.
    pub fn stream_open_timeout(&self) -> Duration {
        self.config.dial_attempt_timeout
    }

    /// The application asked to close the connection to `peer` on `channel`.
    pub fn handle_disconnect(&mut self, _now: Time, peer: NodeId, channel: Channel) {
        if let Some(entry) = self.cache.remove(&(peer, channel)) {
            self.conn_ended(peer, channel, entry.generation, ConnEndCause::Disconnected);
            self.actions.push_back(Action::Close {
                conn: entry.conn,
                code: CLOSE_SHUTDOWN,
            });
            self.bump();
        }
    }
}
