//! Requests: routing by cap, forwarding between the engine and masters under credit, and
//! ending each request once.

use super::*;

// Requests: routing, forwarding, termination.
impl Switch {
    pub(super) fn route(&self, cap: &CapUrn, preferred: Option<&CapUrn>) -> Option<SlotId> {
        // A specific output can only be served by caps whose output names every key the
        // request's output requires (a candidate lacking one does not conform): rank only
        // the shortest such list. Requests for any output (`media:`) rank every cap.
        let mut narrowest: Option<&[usize]> = None;
        if !cap.output().is_top() {
            for (key, constraint) in cap.output().as_tagged().tags() {
                if cap::Constraint::matches(None, Some(constraint)) {
                    continue;
                }
                let list = self.output_keys.get(key).map_or(&[][..], Vec::as_slice);
                if narrowest.is_none_or(|best| list.len() < best.len()) {
                    narrowest = Some(list);
                }
            }
        }
        let ranked = match narrowest {
            Some(among) => cap::rank_among(cap, &self.cap_table, among.iter().copied(), preferred),
            None => cap::rank(cap, &self.cap_table, preferred),
        };
        ranked.first().map(|index| self.cap_slots[*index])
    }

    pub(super) fn on_live_frame(
        &mut self,
        now: Time,
        slot: SlotId,
        frame: Frame,
    ) -> Result<(), CutReason> {
        match frame.frame_type {
            FrameType::Heartbeat | FrameType::RelayNotify => {
                self.on_control_frame(now, slot, frame)
            }
            FrameType::Hello | FrameType::RelayState => {
                Err(ProtocolViolation::Unexpected(frame.frame_type.name()).into())
            }
            FrameType::Req => {
                self.on_peer_request(now, slot, frame);
                Ok(())
            }
            _ => self.on_request_frame(now, slot, frame),
        }
    }

    /// A master's REQ: a peer request from one of its cartridges.
    pub(super) fn on_peer_request(&mut self, now: Time, slot: SlotId, frame: Frame) {
        let rid = frame.id;
        let refuse = |switch: &mut Switch, code: &str, class: ErrorClass, message: String| {
            let mut err = Frame::new(FrameType::Err, rid);
            err.meta = Some(error_meta(code, class, &message));
            switch.send(Peer::Master(slot), err);
        };
        if frame.routing_id.is_some() {
            *self
                .counters
                .violations
                .entry(ProtocolViolation::XidOnReq.name())
                .or_default() += 1;
            return refuse(
                self,
                "PROTOCOL_VIOLATION",
                ErrorClass::Internal,
                "a REQ may not carry an XID".into(),
            );
        }
        let cap = match parse_cap(&frame) {
            Ok(cap) => cap,
            Err(error) => {
                let message = match error {
                    EngineError::BadCap(error) => error.to_string(),
                    error => error.to_string(),
                };
                return refuse(self, "BAD_CAP", ErrorClass::Input, message);
            }
        };
        let Some(dest) = self.route(&cap, None) else {
            self.counters.no_handler += 1;
            return refuse(
                self,
                "NO_HANDLER",
                ErrorClass::Input,
                format!("no handler for {cap}"),
            );
        };
        if self.peer_requests.get(&slot).copied().unwrap_or(0)
            >= crate::limits::SWITCH_PEER_REQUESTS_PER_MASTER_MAX
        {
            self.counters.quota_refused += 1;
            return refuse(
                self,
                "QUOTA",
                ErrorClass::Resource,
                "this master has its share of live requests".into(),
            );
        }
        let parent = parent_rid(frame.meta.as_ref()).and_then(|rid| self.table.key_of(rid));
        match self.register(now, Peer::Master(slot), dest, frame) {
            Ok(child) => {
                let parent = parent.filter(|key| {
                    self.table
                        .get(*key)
                        .is_some_and(|state| state.data.dest == slot)
                });
                if let Some(parent) = parent {
                    self.table.add_child(parent, child);
                }
            }
            Err(RegisterFailure::Duplicate) => {
                refuse(
                    self,
                    "DUPLICATE_REQUEST",
                    ErrorClass::Internal,
                    "request id already live".into(),
                );
            }
            Err(RegisterFailure::Full) => {
                refuse(
                    self,
                    "TABLE_FULL",
                    ErrorClass::Resource,
                    "too many live requests".into(),
                );
            }
            Err(RegisterFailure::Violation(violation)) => {
                refuse(
                    self,
                    "PROTOCOL_VIOLATION",
                    ErrorClass::Internal,
                    violation.to_string(),
                );
            }
        }
    }

    /// Registers a routed REQ and forwards it to `dest`.
    pub(super) fn register(
        &mut self,
        now: Time,
        origin: Peer,
        dest: SlotId,
        frame: Frame,
    ) -> Result<RequestKey, RegisterFailure> {
        let dest_master = &self.masters[dest.0 as usize];
        let dest_limits = dest_master.limits.expect("routable masters have limits");
        let (origin_generation, origin_limits) = match origin {
            Peer::Engine => (0, self.config.limits),
            Peer::Master(slot) => {
                let master = &self.masters[slot.0 as usize];
                (
                    master.generation,
                    master.limits.expect("live masters have limits"),
                )
            }
        };
        let window = dest_limits.initial_credit.min(origin_limits.initial_credit);
        let reorder = dest_limits
            .max_reorder_buffer
            .min(origin_limits.max_reorder_buffer);
        let key = RequestKey {
            xid: MessageId::Uint(self.next_xid),
            rid: frame.id,
        };
        let route = Route {
            origin,
            origin_generation,
            dest,
            dest_generation: dest_master.generation,
            window,
            to_dest: Leg::new(reorder),
            to_origin: Leg::new(reorder),
        };
        let credits = crate::request::Credits::new(window);
        if let Err(error) = self.table.register(key, route, credits, now) {
            return Err(match error {
                crate::request::RegisterError::RidLive { .. } => RegisterFailure::Duplicate,
                _ => RegisterFailure::Full,
            });
        }
        self.next_xid += 1;
        if let Peer::Master(slot) = origin {
            *self.peer_requests.entry(slot).or_default() += 1;
        }
        if let Err(violation) = self.forward(now, key, Side::Origin, frame) {
            // A REQ the checker refuses (it never is: REQ is the first emission) ends at once.
            if let Some(terminated) = self.table.terminate(key, TerminationKind::Err, now) {
                self.request_left(&terminated.state.data);
            }
            return Err(RegisterFailure::Violation(violation));
        }
        Ok(key)
    }

    /// A frame of a request from a master: routed by (XID, RID), or by RID alone.
    pub(super) fn on_request_frame(
        &mut self,
        now: Time,
        slot: SlotId,
        frame: Frame,
    ) -> Result<(), CutReason> {
        let key = match frame.routing_id {
            Some(xid) => {
                Some(RequestKey { xid, rid: frame.id }).filter(|key| self.table.get(*key).is_some())
            }
            None => self.table.key_of(frame.id),
        };
        let generation = self.masters[slot.0 as usize].generation;
        let side = key.and_then(|key| {
            let route = &self.table.get(key).expect("filtered live").data;
            let dest = route.dest == slot && route.dest_generation == generation;
            let origin =
                route.origin == Peer::Master(slot) && route.origin_generation == generation;
            match (dest, origin) {
                // A peer request a master made to itself: its answer carries the XID, its
                // continuation does not (as capdag tells them apart).
                (true, true) if frame.routing_id.is_some() => Some(Side::Dest),
                (true, true) => Some(Side::Origin),
                (true, false) => Some(Side::Dest),
                (false, true) => Some(Side::Origin),
                (false, false) => None,
            }
        });
        match (key, side) {
            (Some(key), Some(side)) => {
                if side == Side::Origin
                    && matches!(frame.frame_type, FrameType::Cancel | FrameType::CloseStream)
                {
                    return self.origin_control(now, key, frame);
                }
                self.forward(now, key, side, frame).map_err(CutReason::from)
            }
            (Some(_), None) => Err(ProtocolViolation::ForeignRequest.into()),
            (None, _) => {
                let site =
                    if frame.frame_type == FrameType::End || frame.frame_type == FrameType::Err {
                        crate::request::NoRouteSite::DuplicateTerminal
                    } else {
                        crate::request::NoRouteSite::Response
                    };
                self.table
                    .account_unrouted(frame.id, frame.frame_type, site);
                Ok(())
            }
        }
    }

    /// CANCEL or CLOSE_STREAM from the master that made a peer request.
    pub(super) fn origin_control(
        &mut self,
        now: Time,
        key: RequestKey,
        frame: Frame,
    ) -> Result<(), CutReason> {
        if frame.frame_type == FrameType::Cancel {
            let reason = CancelReason {
                code: CancelCode::Aborted,
                class: None,
                message: "cancelled by the requesting master".to_owned(),
            };
            self.answer_cancel(now, key.rid, &reason);
        } else {
            self.answer_stop_feeds(key.rid);
        }
        Ok(())
    }

    /// Carries one frame of request `key` from side `from` to the other side.
    pub(super) fn forward(
        &mut self,
        now: Time,
        key: RequestKey,
        from: Side,
        frame: Frame,
    ) -> Result<(), ProtocolViolation> {
        let direction = match from {
            Side::Origin => Direction::Out,
            Side::Dest => Direction::In,
        };
        let observed = Observed {
            frame_type: frame.frame_type,
            stream: frame.stream_id.as_deref(),
            direction,
            payload_bytes: frame.payload.as_ref().map_or(0, |p| p.len() as u64),
            granted: frame.credit.unwrap_or(0),
        };
        self.table.observe(key, observed, now);
        if !crate::request::is_flow(frame.frame_type) {
            return self.forward_control(now, key, from, frame);
        }
        let state = self
            .table
            .get_mut(key)
            .expect("forward is called for live keys");
        let sender = match from {
            Side::Origin => state.data.origin,
            Side::Dest => Peer::Master(state.data.dest),
        };
        let mut ready = side::delivered();
        let seq = Seq(frame.seq);
        let bytes = frame.held_bytes();
        let leg = state.data.leg(from);
        let before = leg.reorder.held_bytes();
        let accepted = leg
            .reorder
            .accept_sized(seq, frame, bytes, |_, frame| ready.push(frame));
        let after = leg.reorder.held_bytes();
        // Counted before anything below can end the request (which releases what it holds).
        self.release_held(sender, before);
        let mut held = 0;
        if after > 0 {
            let entry = self.held_by.entry(sender).or_default();
            *entry += after;
            held = *entry;
        }
        if let Err(refusal) = accepted {
            return Err(ProtocolViolation::Reorder(refusal.kind));
        }
        if held > crate::limits::SWITCH_PEER_REORDER_HELD_BYTES_MAX {
            return Err(ProtocolViolation::Reorder(RefusalKind::Overflow));
        }
        for frame in ready {
            if !self.emit(now, key, from, frame)? {
                break;
            }
        }
        Ok(())
    }

    /// Checks one in-order flow frame, then writes it, or holds it when it is a CHUNK past its
    /// stream's window (or queued behind one): `false` once the request ended.
    ///
    /// A sender past its window is not cut at once. capdag's in-process cartridge host writes
    /// its answers without waiting for CREDIT, and capdag's own switch passes them on; tether's
    /// switch holds the excess in the leg, in order, and lets it go as the receiver grants
    /// credit, so a receiver never gets more than its window. What one sender has held this way
    /// over all its requests is bounded in bytes
    /// ([`crate::limits::SWITCH_PEER_OVERRUN_HELD_BYTES_MAX`]); past it the sender is cut
    /// (`credit_violation`).
    pub(super) fn emit(
        &mut self,
        now: Time,
        key: RequestKey,
        from: Side,
        frame: Frame,
    ) -> Result<bool, ProtocolViolation> {
        let Some(state) = self.table.get_mut(key) else {
            return Ok(false);
        };
        let window = state.data.window as i64;
        let sender = state.data.sender(from);
        let leg = state.data.leg(from);
        if from == Side::Dest
            && leg
                .overrun
                .back()
                .is_some_and(|held| crate::request::is_terminal(held.frame_type))
        {
            // The destination's END or ERR is held: what it wrote after it is the straggler it
            // would be had the terminal gone through at once.
            self.table.account_straggler(frame.frame_type);
            return Ok(true);
        }
        let mut spent = false;
        if frame.frame_type == FrameType::Chunk {
            let stream = &frame.stream_id;
            if !leg.credit.contains_key(stream) && leg.credit.len() >= STREAMS_PER_REQUEST_COUNT_MAX
            {
                return Err(ProtocolViolation::Emission(
                    crate::request::Violation::TooManyStreams,
                ));
            }
            spent = *leg.credit.entry(stream.clone()).or_insert(window) <= 0;
        }
        if let Some(emission) = Emission::of_frame(&frame) {
            if let Err((_, violation)) = leg.checker.step(emission) {
                return Err(ProtocolViolation::Emission(violation.clone()));
            }
        }
        if spent || !leg.overrun.is_empty() {
            let stream = frame.stream_id.clone();
            let bytes = frame.held_bytes();
            leg.overrun.push_back(frame);
            leg.overrun_bytes += bytes;
            let held = self.overrun_by.entry(sender).or_default();
            *held += bytes;
            self.counters.overrun_held += 1;
            if *held > crate::limits::SWITCH_PEER_OVERRUN_HELD_BYTES_MAX {
                return Err(ProtocolViolation::CreditViolation { stream });
            }
            return Ok(true);
        }
        Ok(self.write_flow(now, key, from, frame))
    }

    /// Writes frames a sender sent past its window, oldest first, as far as the credit its
    /// receiver granted since allows.
    fn release_overrun(&mut self, now: Time, key: RequestKey, from: Side) {
        loop {
            let Some(state) = self.table.get_mut(key) else {
                return;
            };
            let sender = state.data.sender(from);
            let leg = state.data.leg(from);
            let Some(front) = leg.overrun.front() else {
                return;
            };
            if front.frame_type == FrameType::Chunk
                && leg
                    .credit
                    .get(&front.stream_id)
                    .is_some_and(|remaining| *remaining <= 0)
            {
                return;
            }
            let frame = leg.overrun.pop_front().expect("a front");
            let bytes = frame.held_bytes();
            leg.overrun_bytes -= bytes;
            self.release_overrun_bytes(sender, bytes);
            if !self.write_flow(now, key, from, frame) {
                return;
            }
        }
    }

    /// Spends the credit of a checked in-order flow frame, renumbers it and writes it: `false`
    /// once the request ended.
    fn write_flow(&mut self, now: Time, key: RequestKey, from: Side, mut frame: Frame) -> bool {
        let Some(state) = self.table.get_mut(key) else {
            return false;
        };
        let window = state.data.window as i64;
        let leg = state.data.leg(from);
        if frame.frame_type == FrameType::Chunk {
            let remaining = leg.credit.entry(frame.stream_id.clone()).or_insert(window);
            debug_assert!(*remaining > 0, "a chunk is written only with credit");
            *remaining -= 1;
        }
        match leg.gate.write(frame.frame_type) {
            Written::Suppressed => {
                self.counters.suppressed += 1;
                return true;
            }
            Written::Sent { seq, .. } => frame.seq = seq.0,
        }
        let route = &state.data;
        let ends = from == Side::Dest && crate::request::is_terminal(frame.frame_type);
        match from {
            Side::Origin => {
                let (dest, generation) = (route.dest, route.dest_generation);
                frame.routing_id = Some(key.xid);
                self.send_to_slot(dest, generation, frame);
            }
            Side::Dest => {
                let route = route.clone();
                if ends {
                    let kind = if frame.frame_type == FrameType::End {
                        TerminationKind::End
                    } else {
                        TerminationKind::Err
                    };
                    let terminated = self
                        .table
                        .terminate(key, kind, now)
                        .expect("the request is live");
                    self.request_left(&terminated.state.data);
                    self.events.push_back(Event::RequestEnded {
                        key,
                        origin: route.origin,
                        termination: terminated.summary.termination,
                    });
                }
                self.answer_origin(key, &route, frame);
                return !ends;
            }
        }
        true
    }

    /// CREDIT (and other non-flow frames of a request) go straight across. A CREDIT from one
    /// side refills the window of the leg that sends towards it.
    pub(super) fn forward_control(
        &mut self,
        now: Time,
        key: RequestKey,
        from: Side,
        mut frame: Frame,
    ) -> Result<(), ProtocolViolation> {
        let state = self.table.get_mut(key).expect("live");
        if frame.frame_type == FrameType::Credit {
            let window = state.data.window as i64;
            // Credit from the destination opens the origin's leg, and the other way round.
            let leg = match from {
                Side::Origin => &mut state.data.to_origin,
                Side::Dest => &mut state.data.to_dest,
            };
            let stream = frame.stream_id.clone();
            if leg.credit.contains_key(&stream) || leg.credit.len() < STREAMS_PER_REQUEST_COUNT_MAX
            {
                let remaining = leg.credit.entry(stream).or_insert(window);
                let granted = i64::try_from(frame.credit.unwrap_or(0)).unwrap_or(i64::MAX);
                *remaining = remaining.saturating_add(granted);
            }
        }
        let credit = frame.frame_type == FrameType::Credit;
        frame.seq = 0;
        let route = state.data.clone();
        match from {
            Side::Origin => {
                frame.routing_id = Some(key.xid);
                self.send_to_slot(route.dest, route.dest_generation, frame);
            }
            Side::Dest => self.answer_origin(key, &route, frame),
        }
        if credit {
            // What the credited side's counterpart sent past its window may go now.
            let held_from = match from {
                Side::Origin => Side::Dest,
                Side::Dest => Side::Origin,
            };
            self.release_overrun(now, key, held_from);
        }
        Ok(())
    }

    /// Ends a terminated request's flow towards its origin with an ERR carrying `meta`,
    /// numbered after the frames that flow already carried (a receiver's reorder buffer would
    /// refuse a restarted seq).
    pub(super) fn end_origin(&mut self, key: RequestKey, mut route: Route, meta: Meta) {
        let mut err = Frame::new(FrameType::Err, key.rid);
        err.meta = Some(meta);
        match route.to_origin.gate.write(FrameType::Err) {
            Written::Sent { seq, .. } => err.seq = seq.0,
            Written::Suppressed => return,
        }
        self.answer_origin(key, &route, err);
    }

    /// Sends a frame of request `key` to its origin (the engine gets it without the XID).
    pub(super) fn answer_origin(&mut self, key: RequestKey, route: &Route, mut frame: Frame) {
        match route.origin {
            Peer::Engine => {
                frame.routing_id = None;
                self.send(Peer::Engine, frame);
            }
            Peer::Master(slot) => {
                frame.routing_id = Some(key.xid);
                self.send_to_slot(slot, route.origin_generation, frame);
            }
        }
    }

    /// Sends to a master's connection when it is still the one a request was routed over.
    pub(super) fn send_to_slot(&mut self, slot: SlotId, generation: u64, frame: Frame) {
        let master = &self.masters[slot.0 as usize];
        if master.generation == generation && master.attached() {
            self.send(Peer::Master(slot), frame);
        }
    }

    pub(super) fn send(&mut self, to: Peer, frame: Frame) {
        self.transmits.push_back(Transmit { to, frame });
    }
}
