//! A deterministic in-memory world for the switch: one [`Switch`], scripted masters that
//! answer the handshake and the identity check, and an engine whose frames are recorded. Time
//! moves only when told. Used by the switch's tests, the model replay, the stateful fuzz
//! target and the benchmarks.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use bytes::Bytes;

use super::ask::Ask;
use super::{
    manifest_json, ConnId, CutReason, EngineError, Event, Limits, RelayNotify, SlotId, Switch,
    SwitchConfig,
};
use crate::cap::CapUrn;
use crate::request::RequestKey;
use crate::time::Time;
use crate::wire::bifaci::{Frame, FrameType, MessageId};

/// How a scripted master answers the identity check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Identity {
    /// Echoes the nonce.
    Echo,
    /// Echoes something else.
    Wrong,
    /// Never answers.
    Silent,
}

/// The world.
#[derive(Debug)]
pub struct Harness {
    /// The machine under test.
    pub switch: Switch,
    /// Virtual time.
    pub now: Time,
    /// Frames the engine received, in order.
    pub engine: Vec<Frame>,
    /// Frames each master received (handshake frames included), in order.
    pub masters: BTreeMap<SlotId, Vec<Frame>>,
    /// Events, in order.
    pub events: Vec<Event>,
    /// Connections the switch asked to close.
    pub disconnected: Vec<(ConnId, CutReason)>,
    /// How each connection answers the identity check.
    identity: BTreeMap<ConnId, Identity>,
    /// The identity CHUNK payloads each connection received, to echo.
    nonces: BTreeMap<ConnId, Bytes>,
    /// Attachments so far (each gets its own nonce).
    attaches: u8,
}

impl Harness {
    /// A switch with `config`, routing once the masters `initial` are verified.
    pub fn new(config: SwitchConfig, initial: &[&str]) -> Self {
        let mut harness = Self {
            switch: Switch::new(config, initial),
            now: Time::from_millis(1_000),
            engine: Vec::new(),
            masters: BTreeMap::new(),
            events: Vec::new(),
            disconnected: Vec::new(),
            identity: BTreeMap::new(),
            nonces: BTreeMap::new(),
            attaches: 0,
        };
        harness.drain();
        harness
    }

    /// Connects master `id` serving `caps` (the identity cap is added) with `limits`, and
    /// plays its side of the handshake; `identity` says how it answers the identity check.
    pub fn connect_with(
        &mut self,
        id: &str,
        caps: &[&str],
        limits: Limits,
        identity: Identity,
    ) -> ConnId {
        self.attaches = self.attaches.wrapping_add(1);
        let conn = self
            .switch
            .ask_attach(self.now, id, [self.attaches; super::IDENTITY_NONCE_BYTES])
            .expect("the slot accepts an attach");
        self.identity.insert(conn, identity);
        self.drain();
        let mut advertised: Vec<String> = caps.iter().map(|cap| (*cap).to_owned()).collect();
        advertised.push(crate::cap::CAP_IDENTITY.to_owned());
        let notify = RelayNotify {
            limits,
            manifest: Bytes::from(manifest_json(id, &advertised)),
        };
        self.from_master(conn, notify.to_frame());
        conn
    }

    /// Connects master `id` serving `caps` with default limits and the switch's credit window;
    /// it passes the identity check.
    pub fn connect(&mut self, id: &str, caps: &[&str]) -> ConnId {
        let limits = Limits {
            initial_credit: self.switch.window(),
            ..Limits::default()
        };
        self.connect_with(id, caps, limits, Identity::Echo)
    }

    /// Master `conn` sends `frame`.
    pub fn from_master(&mut self, conn: ConnId, frame: Frame) {
        self.switch.handle_master_frame(self.now, conn, frame);
        self.drain();
    }

    /// The engine makes a request for `cap` with request id `rid` (a bare REQ).
    pub fn engine_request(&mut self, rid: u64, cap: &str) -> Result<RequestKey, EngineError> {
        let mut frame = Frame::new(FrameType::Req, MessageId::Uint(rid));
        frame.cap = Some(cap.to_owned());
        self.engine_request_frame(frame, None)
    }

    /// The engine sends a REQ frame, preferring `preferred`.
    pub fn engine_request_frame(
        &mut self,
        frame: Frame,
        preferred: Option<&CapUrn>,
    ) -> Result<RequestKey, EngineError> {
        let result = self.switch.ask_engine_request(self.now, frame, preferred);
        self.drain();
        result
    }

    /// The engine sends a later frame of one of its requests.
    pub fn from_engine(&mut self, frame: Frame) -> Result<(), EngineError> {
        let result = self.switch.ask_engine_frame(self.now, frame);
        self.drain();
        result
    }

    /// The connection closes.
    pub fn close(&mut self, conn: ConnId) {
        self.switch.handle_closed(self.now, conn);
        self.drain();
    }

    /// Time passes by `by`, firing every timer due on the way.
    pub fn advance(&mut self, by: Duration) {
        let until = self.now.saturating_add(by);
        while let Some(due) = self.switch.poll_timeout().filter(|due| *due <= until) {
            self.now = self.now.max(due);
            self.switch.handle_timeout(self.now);
            self.drain();
        }
        self.now = until;
        self.switch.handle_timeout(self.now);
        self.drain();
    }

    /// Takes what master `slot` received so far.
    pub fn take_master(&mut self, slot: SlotId) -> Vec<Frame> {
        std::mem::take(self.masters.entry(slot).or_default())
    }

    /// Takes what the engine received so far.
    pub fn take_engine(&mut self) -> Vec<Frame> {
        std::mem::take(&mut self.engine)
    }

    /// Moves every output of the switch into the world, letting scripted masters answer the
    /// identity check.
    pub fn drain(&mut self) {
        loop {
            let mut progressed = false;
            while let Some(transmit) = self.switch.poll_transmit() {
                progressed = true;
                match transmit.to {
                    super::Peer::Engine => self.engine.push(transmit.frame),
                    super::Peer::Master(slot) => self.deliver_to_master(slot, transmit.frame),
                }
            }
            while let Some(event) = self.switch.poll_event() {
                progressed = true;
                if let Event::Disconnect { conn, reason } = &event {
                    self.disconnected.push((*conn, reason.clone()));
                }
                self.events.push(event);
            }
            if !progressed {
                assert!(
                    self.switch.held_bytes_balance(),
                    "early-frame bytes counted per sender match what the legs hold"
                );
                return;
            }
        }
    }

    fn deliver_to_master(&mut self, slot: SlotId, frame: Frame) {
        let conn = self.switch.conn_of(slot);
        self.masters.entry(slot).or_default().push(frame.clone());
        let Some(conn) = conn else { return };
        let is_identity = frame.id == super::identity_rid(conn.generation, slot, false)
            || frame.id == super::identity_rid(conn.generation, slot, true);
        if !is_identity {
            return;
        }
        if frame.frame_type == FrameType::Chunk {
            self.nonces
                .insert(conn, frame.payload.clone().unwrap_or_default());
        }
        if frame.frame_type != FrameType::End {
            return;
        }
        // The identity request is complete: answer it as scripted.
        let echo = match self.identity.get(&conn).copied().unwrap_or(Identity::Echo) {
            Identity::Echo => self.nonces.get(&conn).cloned().unwrap_or_default(),
            Identity::Wrong => Bytes::from_static(b"\x45wrong"),
            Identity::Silent => return,
        };
        for (seq, mut reply) in identity_reply(frame.id, frame.routing_id, &echo)
            .into_iter()
            .enumerate()
        {
            reply.seq = seq as u64;
            self.switch.handle_master_frame(self.now, conn, reply);
        }
    }
}

fn identity_reply(rid: MessageId, xid: Option<MessageId>, echo: &[u8]) -> Vec<Frame> {
    let mut start = Frame::new(FrameType::StreamStart, rid);
    start.stream_id = Some(super::IDENTITY_ECHO_STREAM.to_owned());
    let mut chunk = Frame::new(FrameType::Chunk, rid);
    chunk.stream_id = Some(super::IDENTITY_ECHO_STREAM.to_owned());
    chunk.chunk_index = Some(0);
    chunk.payload = Some(Bytes::copy_from_slice(echo));
    let mut end_stream = Frame::new(FrameType::StreamEnd, rid);
    end_stream.stream_id = Some(super::IDENTITY_ECHO_STREAM.to_owned());
    end_stream.chunk_count = Some(1);
    let mut frames = vec![start, chunk, end_stream, Frame::new(FrameType::End, rid)];
    for frame in &mut frames {
        frame.routing_id = xid;
    }
    frames
}

/// A flow frame of request `key` as its destination master sends it: XID set, seq given.
pub fn response(key: RequestKey, frame_type: FrameType, seq: u64) -> Frame {
    let mut frame = Frame::new(frame_type, key.rid);
    frame.routing_id = Some(key.xid);
    frame.seq = seq;
    frame
}

/// A CHUNK of `stream` numbered `index` (flow seq `seq`) of request `key`, from a master.
pub fn chunk(key: RequestKey, stream: &str, index: u64, seq: u64, payload: &[u8]) -> Frame {
    let mut frame = response(key, FrameType::Chunk, seq);
    frame.stream_id = Some(stream.to_owned());
    frame.chunk_index = Some(index);
    frame.payload = Some(Bytes::copy_from_slice(payload));
    frame
}

/// A STREAM_START or STREAM_END of `stream` (flow seq `seq`) of request `key`, from a master.
pub fn stream(key: RequestKey, frame_type: FrameType, stream: &str, seq: u64) -> Frame {
    let mut frame = response(key, frame_type, seq);
    frame.stream_id = Some(stream.to_owned());
    frame
}

/// Drives a harness with three masters (`a` and `b` serving overlapping caps, `c` another)
/// by an arbitrary op sequence, one op per byte (with operands from the following bytes), and
/// checks the switch's laws after every op. `Err` names the first law broken. Used by the
/// stateful fuzz target and a property test.
///
/// Laws: no panic; every flow frame written to each peer, per request, passes the
/// [`crate::request::EmissionChecker`]; no request that ended is still in the table;
/// `live_requests` equals what `protocol_stats` lists.
pub fn run_ops(data: &[u8]) -> Result<(), String> {
    const CAPS: [&str; 3] = [
        "cap:in=media:text;out=media:upper",
        "cap:in=media:text;out=media:lower",
        "cap:in=media:pdf;out=media:text",
    ];
    let config = super::SwitchConfig {
        limits: Limits {
            initial_credit: 3,
            ..Limits::default()
        },
        ..super::SwitchConfig::default()
    };
    let mut h = Harness::new(config, &["a", "b", "c"]);
    let small = Limits {
        max_reorder_buffer: 4,
        ..Limits::default()
    };
    let mut conns = [
        h.connect("a", &[CAPS[0], CAPS[1]]),
        h.connect_with("b", &[CAPS[0]], small, Identity::Echo),
        h.connect("c", &[CAPS[2]]),
    ];
    let mut checkers: BTreeMap<
        (super::Peer, Option<MessageId>, MessageId),
        crate::request::EmissionChecker,
    > = BTreeMap::new();
    // The master that sent each peer request (by rid), to tell a peer request a master made to
    // itself: both of its legs reach that master under the same XID and rid (capdag's switch
    // keeps the XID on the way back too), so their frames cannot be told apart as one flow.
    let mut peer_origins: BTreeMap<MessageId, SlotId> = BTreeMap::new();
    let mut two_legged: BTreeSet<Flow> = BTreeSet::new();
    let mut ops = data.iter().copied();
    while let Some(op) = ops.next() {
        let mut arg = || ops.next().unwrap_or(0);
        let rid = MessageId::Uint(u64::from(arg() % 8));
        let who = usize::from(op >> 4) % 3;
        match op % 11 {
            0 => {
                let mut req = Frame::new(FrameType::Req, rid);
                req.cap = Some(CAPS[usize::from(arg()) % 3].to_owned());
                // Only a registered REQ starts a new flow towards the engine: one refused (its
                // rid is live) leaves the live request's flow as it was.
                peer_origins.remove(&rid);
                if h.engine_request_frame(req, None).is_ok() {
                    checkers.remove(&(super::Peer::Engine, None, rid));
                }
            }
            1 => {
                // A peer request from a master, sometimes naming a parent, sometimes with an XID.
                let mut req = Frame::new(FrameType::Req, rid);
                req.cap = Some(CAPS[usize::from(arg()) % 3].to_owned());
                let extra = arg();
                if extra & 1 == 1 {
                    req.meta = Some(super::parent_meta(MessageId::Uint(
                        u64::from(extra >> 1) % 8,
                    )));
                }
                if extra & 0x80 != 0 {
                    req.routing_id = Some(MessageId::Uint(u64::from(extra)));
                }
                // Whatever answers this REQ starts a new flow towards its sender.
                checkers.remove(&(super::Peer::Master(conns[who].slot), None, rid));
                peer_origins.insert(rid, conns[who].slot);
                h.from_master(conns[who], req);
            }
            2..=5 => {
                // A request frame from a master with an XID that may or may not be right.
                let frame_type = [
                    FrameType::StreamStart,
                    FrameType::Chunk,
                    FrameType::StreamEnd,
                    FrameType::End,
                    FrameType::Err,
                    FrameType::Log,
                    FrameType::Credit,
                    FrameType::Cancel,
                ][usize::from(arg()) % 8];
                let mut frame = Frame::new(frame_type, rid);
                let xid = arg();
                frame.routing_id = (xid % 4 != 0).then(|| MessageId::Uint(u64::from(xid % 16)));
                frame.seq = u64::from(arg() % 6);
                frame.stream_id = Some(["s", "t"][usize::from(xid >> 7)].to_owned());
                frame.chunk_index = Some(u64::from(arg() % 4));
                frame.chunk_count = Some(u64::from(arg() % 4));
                frame.credit = Some(u64::from(arg() % 3));
                h.from_master(conns[who], frame);
            }
            6 => {
                // A later frame from the engine.
                let frame_type = [
                    FrameType::StreamStart,
                    FrameType::Chunk,
                    FrameType::StreamEnd,
                    FrameType::End,
                    FrameType::Credit,
                ][usize::from(arg()) % 5];
                let mut frame = Frame::new(frame_type, rid);
                frame.seq = u64::from(arg() % 6);
                frame.stream_id = Some("s".to_owned());
                frame.chunk_index = Some(u64::from(arg() % 4));
                frame.credit = Some(1);
                let _ = h.from_engine(frame);
            }
            7 => {
                let reason = crate::request::CancelReason::operator("fuzz");
                h.switch.ask_cancel(h.now, rid, &reason);
                h.drain();
            }
            8 => {
                h.switch.ask_stop_feeds(h.now, rid);
                h.drain();
            }
            9 => {
                let conn = conns[who];
                if h.switch.conn_of(conn.slot) == Some(conn) {
                    h.close(conn);
                } else if h.switch.slot_accepts_attach(["a", "b", "c"][who]) {
                    let caps: &[&str] = match who {
                        0 => &[CAPS[0], CAPS[1]],
                        1 => &[CAPS[0]],
                        _ => &[CAPS[2]],
                    };
                    conns[who] = h.connect(["a", "b", "c"][who], caps);
                }
            }
            _ => h.advance(Duration::from_millis(u64::from(arg()) * 500)),
        }
        check_laws(&mut h, &mut checkers, &peer_origins, &mut two_legged)?;
    }
    Ok(())
}

/// A flow the harness checks: frames of one request to one peer, by (peer, XID, rid).
type Flow = (super::Peer, Option<MessageId>, MessageId);

fn check_laws(
    h: &mut Harness,
    checkers: &mut BTreeMap<Flow, crate::request::EmissionChecker>,
    peer_origins: &BTreeMap<MessageId, SlotId>,
    two_legged: &mut BTreeSet<Flow>,
) -> Result<(), String> {
    let mut written: Vec<(super::Peer, Frame)> = h
        .take_engine()
        .into_iter()
        .map(|frame| (super::Peer::Engine, frame))
        .collect();
    let slots: Vec<SlotId> = h.masters.keys().copied().collect();
    for slot in slots {
        written.extend(
            h.take_master(slot)
                .into_iter()
                .map(|frame| (super::Peer::Master(slot), frame)),
        );
    }
    for (to, frame) in written {
        if matches!(frame.id, MessageId::Uuid(_)) {
            continue; // the identity check
        }
        // Per flow: a request's frames to one peer (the XID tells a request routed to a master
        // from an answer to a REQ it sent under the same id).
        let flow = (to, frame.routing_id, frame.id);
        if frame.frame_type == FrameType::Req {
            checkers.remove(&flow);
            two_legged.remove(&flow);
            if matches!(to, super::Peer::Master(slot) if peer_origins.get(&frame.id) == Some(&slot))
            {
                // A peer request routed back to the master that made it: its request leg and
                // its answer share this flow's key, so their order is not checked here (the
                // switch checks each leg itself; core's unit test covers the case).
                two_legged.insert(flow);
            }
        }
        if two_legged.contains(&flow) {
            continue;
        }
        let Some(emission) = crate::request::Emission::of_frame(&frame) else {
            continue;
        };
        let checker = checkers.entry(flow).or_default();
        if let Err((at, violation)) = checker.step(emission) {
            return Err(format!(
                "the switch wrote {} for {:?} to {to:?} out of order (#{at}): {violation}",
                frame.frame_type.name(),
                frame.id
            ));
        }
    }
    let stats = h.switch.protocol_stats(h.now);
    if stats.requests.len() != h.switch.live_requests() {
        return Err("protocol_stats disagrees with the table".to_owned());
    }
    for event in h.events.drain(..) {
        if let Event::RequestEnded { key, .. } = event {
            if stats.requests.iter().any(|view| view.key == key) {
                return Err(format!("{key:?} ended but is still in the table"));
            }
        }
    }
    Ok(())
}
