//! Masters: slots, the handshake and identity check, health, cuts and what a master's
//! death ends.

use super::*;

/// Why a registration failed.
pub(super) enum RegisterFailure {
    Duplicate,
    Full,
    Violation(ProtocolViolation),
}

// Handshake and master lifecycle.
impl Switch {
    pub(super) fn new_slot(&mut self, id: &str) -> SlotId {
        self.masters.push(Master {
            id: id.to_owned(),
            generation: 0,
            stage: Stage::Detached,
            limits: None,
            caps: Vec::new(),
            connected_at: Time::ZERO,
            last_error: None,
            heartbeat_at: None,
            heartbeat: None,
            echoes_heartbeats: false,
            policy_sent: 0,
            host_stats: None,
        });
        SlotId(self.masters.len() as u32 - 1)
    }

    pub(super) fn is_current(&self, conn: ConnId) -> bool {
        self.masters
            .get(conn.slot.0 as usize)
            .is_some_and(|master| master.generation == conn.generation)
    }

    /// The master's first frame, which must be its RELAY_NOTIFY: the limits are met, the
    /// policy goes out before anything else, and the identity check follows when the manifest
    /// names caps (a capless master joins at once).
    pub(super) fn on_first_notify(
        &mut self,
        now: Time,
        slot: SlotId,
        frame: &Frame,
        nonce: [u8; IDENTITY_NONCE_BYTES],
    ) -> Result<(), CutReason> {
        if frame.frame_type != FrameType::RelayNotify {
            return Err(HandshakeError::Malformed("the first frame must be RELAY_NOTIFY").into());
        }
        let notify = RelayNotify::from_meta(frame.meta.as_ref())?;
        let limits = self.config.limits.negotiate(&notify.limits)?;
        if notify.limits.initial_credit != self.config.limits.initial_credit {
            return Err(HandshakeError::WindowMismatch {
                theirs: notify.limits.initial_credit,
                ours: self.config.limits.initial_credit,
            }
            .into());
        }
        let caps = manifest_caps(&notify.manifest)?;
        let Stage::Notify { deadline, .. } = self.masters[slot.0 as usize].stage else {
            unreachable!("called in the notify stage");
        };
        let generation = self.masters[slot.0 as usize].generation;
        let master = &mut self.masters[slot.0 as usize];
        master.limits = Some(limits);
        master.caps = caps;
        // The policy goes before anything else reaches the host.
        self.push_policy(slot);
        if self.masters[slot.0 as usize].caps.is_empty() {
            self.become_live(now, slot);
            return Ok(());
        }
        let rid = identity_rid(generation, slot, false);
        for frame in identity_request(rid, None, IDENTITY_STREAM, payload_item(&nonce)) {
            self.send(Peer::Master(slot), frame);
        }
        self.masters[slot.0 as usize].stage =
            Stage::Identity(Check::new(rid, nonce.to_vec(), true, deadline));
        Ok(())
    }

    /// The master is verified (or joined capless): routable, heartbeated.
    fn become_live(&mut self, now: Time, slot: SlotId) {
        let master = &mut self.masters[slot.0 as usize];
        master.stage = Stage::Live { probe: None };
        master.heartbeat_at = Some(now.saturating_add(self.config.heartbeat_interval));
        master.last_error = None;
        self.rebuild_caps();
        self.events.push_back(Event::MasterReady { slot });
        if self.init_pending.remove(&slot) {
            self.check_init();
        }
    }

    /// Starts the runtime identity probe of a live master whose caps appeared after it joined:
    /// it is unroutable until the echo passes.
    fn start_probe(&mut self, now: Time, slot: SlotId) {
        let xid = MessageId::Uint(self.next_xid);
        self.next_xid += 1;
        let master = &mut self.masters[slot.0 as usize];
        let rid = identity_rid(master.generation, slot, true);
        let deadline = now.saturating_add(Duration::from_millis(SWITCH_IDENTITY_PROBE_TIMEOUT_MS));
        master.stage = Stage::Live {
            probe: Some(Check::new(
                rid,
                IDENTITY_PROBE_NONCE.to_vec(),
                false,
                deadline,
            )),
        };
        let payload = Bytes::from_static(IDENTITY_PROBE_NONCE);
        for frame in identity_request(rid, Some(xid), IDENTITY_PROBE_STREAM, payload) {
            self.send(Peer::Master(slot), frame);
        }
    }

    /// A frame of the identity echo (its id is the check's). What passes, as capdag checks it:
    /// a STREAM_START, the CHUNKs' bytes equal to the nonce, a STREAM_END, then END. An ERR, a
    /// wrong echo or a frame of another kind fails the check; LOG, CREDIT and HEARTBEAT are
    /// skipped.
    pub(super) fn on_check_frame(
        &mut self,
        now: Time,
        slot: SlotId,
        frame: Frame,
    ) -> Result<(), CutReason> {
        let master = &mut self.masters[slot.0 as usize];
        let (Stage::Identity(check) | Stage::Live { probe: Some(check) }) = &mut master.stage
        else {
            unreachable!("called with a check running");
        };
        let verdict = match frame.frame_type {
            FrameType::StreamStart => {
                check.started = true;
                None
            }
            FrameType::StreamEnd => {
                check.stream_ended = true;
                None
            }
            FrameType::Log | FrameType::Credit | FrameType::Heartbeat => None,
            FrameType::Chunk => {
                let payload = frame.payload.unwrap_or_default();
                let bytes = if check.decode {
                    cbor_bytes_content(&payload)
                } else {
                    Some(&payload[..])
                };
                match bytes {
                    Some(bytes)
                        if check.echo.len() + bytes.len() <= SWITCH_IDENTITY_ECHO_BYTES_MAX =>
                    {
                        check.echo.extend_from_slice(bytes);
                        None
                    }
                    Some(_) => Some(Err("echo too long")),
                    None => Some(Err("echo is not a CBOR byte string")),
                }
            }
            FrameType::End if check.started && check.stream_ended && check.echo == check.nonce => {
                Some(Ok(()))
            }
            FrameType::End => Some(Err("wrong echo")),
            FrameType::Err => Some(Err("answered with ERR")),
            _ => Some(Err("unexpected frame in the echo")),
        };
        match verdict {
            None => {}
            Some(Ok(())) if matches!(master.stage, Stage::Identity(_)) => {
                self.become_live(now, slot);
            }
            Some(Ok(())) => {
                master.stage = Stage::Live { probe: None };
                self.rebuild_caps();
            }
            Some(Err(why)) => self.fail_identity(slot, HandshakeError::Identity(why)),
        }
        Ok(())
    }

    /// The identity check failed: the master stays attached (its socket is open) but is
    /// unhealthy, so it is never routed to and its slot refuses another attach until the
    /// connection goes (docs/spec/switch.md §9.1).
    pub(super) fn fail_identity(&mut self, slot: SlotId, reason: HandshakeError) {
        let master = &mut self.masters[slot.0 as usize];
        let was_routable = master.routable();
        master.stage = Stage::Failed;
        master.heartbeat = None;
        master.heartbeat_at = None;
        master.last_error = Some(reason.to_string());
        if was_routable {
            self.rebuild_caps();
        }
        self.events
            .push_back(Event::MasterUnhealthy { slot, reason });
        if self.init_pending.remove(&slot) {
            self.check_init();
        }
    }

    /// Frames that are not part of a request: HEARTBEAT, RELAY_NOTIFY; anything else here is
    /// unexpected.
    pub(super) fn on_control_frame(
        &mut self,
        now: Time,
        slot: SlotId,
        frame: Frame,
    ) -> Result<(), CutReason> {
        match frame.frame_type {
            FrameType::Heartbeat => {
                let master = &mut self.masters[slot.0 as usize];
                match (master.heartbeat, frame.id) {
                    (Some((id, _)), MessageId::Uint(echo)) if id == echo => {
                        master.heartbeat = None;
                        master.echoes_heartbeats = true;
                    }
                    // The master's own heartbeat: echoed.
                    _ => self.send(Peer::Master(slot), frame),
                }
                Ok(())
            }
            FrameType::RelayNotify => self.on_notify(now, slot, &frame),
            other => Err(ProtocolViolation::Unexpected(other.name()).into()),
        }
    }

    /// A later RELAY_NOTIFY: the manifest (and host stats) replace the master's. Caps that
    /// appear on a live master that joined without any start the runtime identity probe.
    pub(super) fn on_notify(
        &mut self,
        now: Time,
        slot: SlotId,
        frame: &Frame,
    ) -> Result<(), CutReason> {
        let (manifest, host_stats) = notify_fields(frame.meta.as_ref())
            .map_err(|what| ProtocolViolation::Manifest(HandshakeError::Malformed(what)))?;
        let master = &mut self.masters[slot.0 as usize];
        if let Some(stats) = host_stats {
            master.host_stats = Some(String::from_utf8_lossy(&stats).into_owned());
        }
        if let Some(manifest) = manifest {
            let caps = manifest_caps(&manifest).map_err(ProtocolViolation::Manifest)?;
            let appeared = master.caps.is_empty() && !caps.is_empty();
            master.caps = caps;
            if appeared && master.stage == (Stage::Live { probe: None }) {
                self.start_probe(now, slot);
            }
            // A probed master's caps reach the table when its echo passes.
            if self.masters[slot.0 as usize].routable() {
                self.rebuild_caps();
            }
        }
        Ok(())
    }

    pub(super) fn push_policy(&mut self, slot: SlotId) {
        let master = &mut self.masters[slot.0 as usize];
        if master.policy_sent == self.policy_version {
            return;
        }
        master.policy_sent = self.policy_version;
        self.counters.policies_sent += 1;
        self.send(Peer::Master(slot), self.policy.to_frame());
    }

    pub(super) fn check_init(&mut self) {
        if !self.routing && self.init_pending.is_empty() {
            self.routing = true;
            self.events.push_back(Event::RoutingStarted);
        }
    }

    /// Cuts a misbehaving or failing master: the shell closes the connection.
    pub(super) fn cut(&mut self, now: Time, slot: SlotId, reason: CutReason) {
        if let CutReason::Violation(violation) = &reason {
            *self
                .counters
                .violations
                .entry(violation.name())
                .or_default() += 1;
        }
        let conn = self.masters[slot.0 as usize].conn(slot);
        self.events.push_back(Event::Disconnect {
            conn,
            reason: reason.clone(),
        });
        self.detach(now, slot, reason);
    }

    /// The master's connection is gone: every request it is a side of ends `MasterDied`.
    pub(super) fn detach(&mut self, now: Time, slot: SlotId, reason: CutReason) {
        let key = match &reason {
            CutReason::Handshake(_) => "handshake",
            CutReason::HeartbeatTimeout => "heartbeat_timeout",
            CutReason::Closed => "closed",
            CutReason::Undecodable(_) => "undecodable",
            CutReason::Backlogged => "backlogged",
            CutReason::Violation(violation) => violation.name(),
        };
        *self.counters.cuts.entry(key.to_owned()).or_default() += 1;
        let master = &mut self.masters[slot.0 as usize];
        let was_routable = master.routable();
        master.stage = Stage::Detached;
        master.heartbeat = None;
        master.heartbeat_at = None;
        master.last_error = Some(reason.to_string());
        let generation = master.generation;
        let dying: Vec<RequestKey> = self
            .table
            .live_keys()
            .filter(|key| {
                let route = &self.table.get(*key).expect("live").data;
                (route.dest == slot && route.dest_generation == generation)
                    || (route.origin == Peer::Master(slot) && route.origin_generation == generation)
            })
            .collect();
        for key in dying {
            self.end_master_died(now, key, slot);
        }
        if was_routable {
            self.rebuild_caps();
        }
        if self.init_pending.remove(&slot) {
            self.check_init();
        }
        self.events.push_back(Event::MasterDied { slot, reason });
    }

    /// A request left the table (it ended, however it ended): its origin's share of the table
    /// and the early frames its legs held come back.
    pub(super) fn request_left(&mut self, route: &Route) {
        self.release_held(route.origin, route.to_dest.reorder.held_bytes());
        self.release_held(
            Peer::Master(route.dest),
            route.to_origin.reorder.held_bytes(),
        );
        self.release_overrun_bytes(route.origin, route.to_dest.overrun_bytes);
        self.release_overrun_bytes(Peer::Master(route.dest), route.to_origin.overrun_bytes);
        if let Peer::Master(slot) = route.origin {
            if let Some(live) = self.peer_requests.get_mut(&slot) {
                *live -= 1;
                if *live == 0 {
                    self.peer_requests.remove(&slot);
                }
            }
        }
    }

    /// `bytes` of early frames `sender` sent are no longer held.
    pub(super) fn release_held(&mut self, sender: Peer, bytes: usize) {
        release_share(&mut self.held_by, sender, bytes);
    }

    /// `bytes` of frames `sender` sent past its window are no longer held.
    pub(super) fn release_overrun_bytes(&mut self, sender: Peer, bytes: usize) {
        release_share(&mut self.overrun_by, sender, bytes);
    }

    /// Whether the early-frame bytes counted per sender are exactly what the live requests'
    /// legs hold (a check for harnesses and fuzzers; it walks every live request).
    pub fn held_bytes_balance(&self) -> bool {
        let mut held: BTreeMap<Peer, usize> = BTreeMap::new();
        let mut overrun: BTreeMap<Peer, usize> = BTreeMap::new();
        for key in self.table.live_keys() {
            let route = &self.table.get(key).expect("live").data;
            for (sender, leg) in [
                (route.origin, &route.to_dest),
                (Peer::Master(route.dest), &route.to_origin),
            ] {
                if leg.reorder.held_bytes() > 0 {
                    *held.entry(sender).or_default() += leg.reorder.held_bytes();
                }
                if leg.overrun_bytes > 0 {
                    *overrun.entry(sender).or_default() += leg.overrun_bytes;
                }
            }
        }
        held == self.held_by && overrun == self.overrun_by
    }

    /// Bytes of frames `sender` wrote past their window, held over its live requests.
    pub fn overrun_bytes_of(&self, sender: Peer) -> usize {
        self.overrun_by.get(&sender).copied().unwrap_or(0)
    }

    /// Bytes of early flow frames held on behalf of `sender` over its live requests.
    pub fn held_bytes_of(&self, sender: Peer) -> usize {
        self.held_by.get(&sender).copied().unwrap_or(0)
    }

    /// Live peer requests `slot` made.
    pub fn peer_requests_of(&self, slot: SlotId) -> usize {
        self.peer_requests.get(&slot).copied().unwrap_or(0)
    }

    pub(super) fn end_master_died(&mut self, now: Time, key: RequestKey, dead: SlotId) {
        let Some(terminated) = self.table.terminate(key, TerminationKind::MasterDied, now) else {
            return;
        };
        let route = terminated.state.data;
        self.request_left(&route);
        let origin = route.origin;
        if route.dest == dead {
            self.end_origin(
                key,
                route,
                error_meta(
                    "MASTER_DIED",
                    ErrorClass::Environment,
                    "the serving master died",
                ),
            );
        } else {
            // The origin died: its peer request is cancelled at the destination.
            let mut cancel = Frame::new(FrameType::Cancel, key.rid);
            cancel.routing_id = Some(key.xid);
            cancel.force_kill = Some(true);
            self.send_to_slot(route.dest, route.dest_generation, cancel);
        }
        self.events.push_back(Event::RequestEnded {
            key,
            origin,
            termination: Termination::MasterDied,
        });
    }

    pub(super) fn rebuild_caps(&mut self) {
        self.cap_table.clear();
        self.cap_slots.clear();
        self.output_keys.clear();
        for (index, master) in self.masters.iter().enumerate() {
            if master.routable() {
                for cap in &master.caps {
                    for (key, _) in cap.output().as_tagged().tags() {
                        self.output_keys
                            .entry(key.to_owned())
                            .or_default()
                            .push(self.cap_table.len());
                    }
                    self.cap_table.push(cap.clone());
                    self.cap_slots.push(SlotId(index as u32));
                }
            }
        }
        self.events.push_back(Event::CapsChanged);
    }

    pub(super) fn graph_caps(&self) -> Vec<&CapUrn> {
        let identity = cap::identity();
        self.cap_table
            .iter()
            .filter(|cap| !cap.is_equivalent(&identity))
            .collect()
    }
}

/// Takes `bytes` off `sender`'s count in `shares` (a peer with nothing counted has no entry).
fn release_share(shares: &mut BTreeMap<Peer, usize>, sender: Peer, bytes: usize) {
    if bytes == 0 {
        return;
    }
    let held = shares
        .get_mut(&sender)
        .expect("a leg's held bytes are counted under its sender");
    *held -= bytes;
    if *held == 0 {
        shares.remove(&sender);
    }
}
