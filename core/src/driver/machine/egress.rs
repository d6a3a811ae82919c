//! Egress: whether a frame is queued, what each writer batch goes on, failed writes, idle writers, and streams that cannot be read.

use super::*;

impl<C: Clone> Driver<C> {
    /// A frame for `peer`, which has no egress queue (a peer with a queue was admitted when
    /// its queue started; the allow-list is fixed for the node's life).
    ///
    /// Answered by [`Answer::Send`] ([`Driver::poll_answer`]).
    pub fn handle_send(&mut self, now: Time, peer: NodeId) {
        let answer = self.answer_send(now, peer);
        self.answer = Some(Answer::Send(answer));
    }

    /// What [`Driver::handle_send`] answers.
    pub(super) fn answer_send(&mut self, now: Time, peer: NodeId) -> SendVerdict {
        if self
            .answer_admit(now, &peer, Path::Actor, Direction::Outbound)
            .is_err()
        {
            return self.dropped(DropReason::Unauthorized);
        }
        if self.closed {
            return self.dropped(DropReason::CacheMiss);
        }
        if self.cache.peek(&(peer, Channel::Actor)).is_some() {
            return SendVerdict::Enqueue;
        }
        if !(self.config.valid_peer)(&peer) {
            return self.dropped(DropReason::InvalidNodeId);
        }
        self.dial(peer);
        self.dropped(DropReason::CacheMiss)
    }

    /// `peer`'s writer has a batch of `frames` (`swim` when one carries a SWIM tag) and a
    /// stream open on the connection of generation `stream`, if any: the connection to write
    /// the batch on and whether to open a stream there first, or `None` (the batch is
    /// dropped, counted, and a dial starts).
    ///
    /// Answered by [`Answer::Batch`] ([`Driver::poll_answer`]).
    pub fn handle_batch(
        &mut self,
        now: Time,
        peer: NodeId,
        frames: u64,
        swim: bool,
        stream: Option<Generation>,
    ) {
        let answer = self.answer_batch(now, peer, frames, swim, stream);
        self.answer = Some(Answer::Batch(answer));
    }

    /// What [`Driver::handle_batch`] answers.
    pub(super) fn answer_batch(
        &mut self,
        now: Time,
        peer: NodeId,
        frames: u64,
        swim: bool,
        stream: Option<Generation>,
    ) -> Option<Batch<C>> {
        self.set_writer(now, peer, None);
        if let Some(writer) = self.writers.get_mut(&peer) {
            writer.swim = swim;
        }
        match self.connection(&peer, Channel::Actor) {
            // One stream per connection: a stream on an older one is left.
            Some((generation, conn)) => Some(Batch {
                generation,
                conn,
                open_stream: stream != Some(generation),
            }),
            None => {
                self.drops.add(DropReason::CacheMiss, frames);
                self.bump();
                if !self.closed {
                    self.dial(peer);
                }
                None
            }
        }
    }

    /// `peer`'s writer dropped `frames` it could not encode.
    pub fn handle_unencodable(&mut self, _now: Time, frames: u64) {
        self.drops.add(DropReason::WriteFailed, frames);
    }

    /// A write of `frames` on `peer`'s connection of `generation` failed; `swim` when one of
    /// them carried a SWIM tag.
    pub fn handle_write_failed(
        &mut self,
        _now: Time,
        peer: NodeId,
        generation: Generation,
        frames: u64,
        swim: bool,
    ) {
        self.drops.add(DropReason::WriteFailed, frames);
        match self.cache.fail(&(peer, Channel::Actor), generation) {
            Eviction::Evicted => {
                self.conn_ended(peer, Channel::Actor, generation, ConnEndCause::WriteFailed);
                self.counters.evictions += 1;
                if !self.closed {
                    self.dial(peer);
                }
            }
            Eviction::Stale => self.counters.stale_failures += 1,
        }
        if swim {
            self.actions.push_back(Action::SendFailed { peer });
        }
        self.bump();
    }

    /// The peer stopped the stream `peer`'s writer had open on the connection of `generation`,
    /// while the writer had nothing to write (the writer drops the stream). Which frames the
    /// peer read before it stopped is unknown: none are counted again, but a SWIM frame in
    /// the writer's last batch is reported as not sent, and the generation fails as a failed
    /// write's does (stale if a newer connection is cached).
    pub fn handle_stream_stopped(&mut self, now: Time, peer: NodeId, generation: Generation) {
        let swim = self.writers.get(&peer).is_some_and(|writer| writer.swim);
        self.handle_write_failed(now, peer, generation, 0, swim);
    }

    /// `peer`'s writer ran dry and sleeps.
    pub fn handle_writer_idle(&mut self, now: Time, peer: NodeId) {
        self.set_writer(now, peer, Some(now));
        if !self.closed {
            self.announce_more(peer);
        }
    }

    /// An inbound stream from `peer` on `channel` could not be decoded; `fatal` when the
    /// stream cannot be read further. An actor stream counts the malformed record and reads
    /// on past one it could skip. A telemetry or protocol stream has no record boundary to
    /// resume at: it stops (its consumer hears of the fault from the shell).
    ///
    /// Answered by [`Answer::Stream`] ([`Driver::poll_answer`]).
    pub fn handle_stream_fault(&mut self, now: Time, peer: NodeId, channel: Channel, fatal: bool) {
        let answer = self.answer_stream_fault(now, peer, channel, fatal);
        self.answer = Some(Answer::Stream(answer));
    }

    /// What [`Driver::handle_stream_fault`] answers.
    pub(super) fn answer_stream_fault(
        &mut self,
        _now: Time,
        _peer: NodeId,
        channel: Channel,
        fatal: bool,
    ) -> StreamVerdict {
        if channel != Channel::Actor {
            return StreamVerdict::Stop(STOP_MALFORMED);
        }
        self.drops.count(DropReason::MalformedStream);
        self.bump();
        if fatal {
            StreamVerdict::Stop(STOP_MALFORMED)
        } else {
            StreamVerdict::Continue
        }
    }

    /// The local consumer of an inbound stream from `peer` on `channel` went away (a protocol
    /// dropped its ingress ring, every telemetry sink closed): the peer is told to stop
    /// sending with [`STOP_UNREAD`]; the connection and its other streams stay.
    ///
    /// Answered by [`Answer::Stream`] ([`Driver::poll_answer`]).
    pub fn handle_stream_unread(&mut self, now: Time, peer: NodeId, channel: Channel) {
        let answer = self.answer_stream_unread(now, peer, channel);
        self.answer = Some(Answer::Stream(answer));
    }

    /// What [`Driver::handle_stream_unread`] answers.
    pub(super) fn answer_stream_unread(
        &mut self,
        _now: Time,
        _peer: NodeId,
        _channel: Channel,
    ) -> StreamVerdict {
        StreamVerdict::Stop(STOP_UNREAD)
    }

    /// The first bytes `peer` sent on a stream it opened on `channel`, read within
    /// [`Driver::stream_open_timeout`] (`None`: fewer came in time). A stream on the switch
    /// channel is taken only when they announce a switch stream
    /// ([`crate::wire::bifaci::announces_switch_stream`]); any other is stopped as a stream
    /// nobody reads. Streams on other channels announce nothing and are taken.
    ///
    /// Answered by [`Answer::Stream`]: [`StreamVerdict::Continue`] hands the stream to what
    /// serves the channel.
    pub fn handle_stream_opener(
        &mut self,
        now: Time,
        peer: NodeId,
        channel: Channel,
        first: Option<&[u8]>,
    ) {
        let announced = first.is_some_and(crate::wire::bifaci::announces_switch_stream);
        let answer = match channel {
            Channel::Switch if !announced => self.answer_stream_unread(now, peer, channel),
            _ => StreamVerdict::Continue,
        };
        self.answer = Some(Answer::Stream(answer));
    }

    /// Inbound records dropped by routing (core's `Routes`), counted.
    pub fn handle_inbound_drop(&mut self, _now: Time, reason: DropReason) {
        self.drops.count(reason);
    }

    /// Frames dropped because `peer`'s queue was full.
    pub fn handle_egress_full(&mut self, _now: Time, frames: u64) {
        self.drops.add(DropReason::EgressFull, frames);
    }

    /// Records `peer`'s writer as busy (`None`) or idle since a time, re-arming its timer.
    pub(super) fn set_writer(&mut self, _now: Time, peer: NodeId, idle_since: Option<Time>) {
        if self.closed {
            return;
        }
        let writer = self.writers.entry(peer).or_default();
        if let Some(since) = writer.idle_since {
            let due = since.saturating_add(self.config.idle_peer_timeout);
            self.timers.remove(&(due, Timer::Idle(peer)));
        }
        writer.idle_since = idle_since;
        if let Some(since) = idle_since {
            let due = since.saturating_add(self.config.idle_peer_timeout);
            self.timers.insert((due, Timer::Idle(peer)));
        }
    }
}
