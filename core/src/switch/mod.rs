//! The request switch (docs/spec/switch.md): routes requests from an engine, and peer requests from
//! one master's cartridges, to the master whose caps serve them best, and carries every later frame
//! of each request between its two sides.
//!
//! [`Switch`] is one sans-IO machine with the substrate's shape: inputs are `handle_*` calls
//! with `now` first (a master connection attached, a frame from a master or from the engine,
//! a connection closed, a timeout) and the engine-facing commands (`cancel`, `stop_feeds`,
//! `set_policy`); outputs are drained with [`Switch::poll_transmit`] (frames to write, each to
//! a master or to the engine), [`Switch::poll_event`] (what the shell must act on or may
//! report) and [`Switch::poll_timeout`]. The shell decides nothing.
//!
//! What the machine owns:
//! - **Master slots** with stable caller-chosen ids; a slot's index is the routing key and
//!   never changes. Attaching an attached slot is refused; a detached one is reattached in
//!   place with a new generation, and frames or closes of an older generation are ignored.
//! - **The handshake** per connection (docs/spec/switch.md §3.4, which says how it departs from
//!   capdag's): HELLO with limits (the minimum of each, a zero refused; a master's credit window
//!   may not be below the switch's, so that every side of every request uses the same window), the
//!   master's HELLO with its manifest (which must hold the identity cap), the policy pushed before
//!   anything else, then the identity check (the nonce echoed), all within
//!   [`SWITCH_HANDSHAKE_TIMEOUT_MS`]; a master that fails the identity check stays attached but
//!   unhealthy (never routed to, its slot refusing another attach until it disconnects); then a
//!   HEARTBEAT every [`SWITCH_HEARTBEAT_INTERVAL_MS`] that must be echoed within
//!   [`SWITCH_HEARTBEAT_TIMEOUT_MS`].
//! - **Init phases**: masters named at construction are all verified (or failed) before routing
//!   starts; [`Switch::attach`] adds masters at runtime.
//! - **Routing**: a REQ's cap is matched against every routable master's caps with
//!   [`crate::cap::rank`] (most specific first, a preferred cap wins among equivalents); the
//!   switch assigns the XID; a REQ that already carries one is a counted violation. No handler
//!   is answered with an ERR `NO_HANDLER` (or a typed error to the engine), never dropped.
//! - **The request table** ([`crate::request::RequestTable`]): each request registered once,
//!   terminated once (END or ERR from its destination, cancel, master death), leaving nothing;
//!   a frame with no routing state is a straggler when its request ended lately, otherwise a
//!   counted `no_route` drop.
//! - **Flows**: each request has two legs (origin → destination and back). Flow frames are
//!   reordered by the sender's seq (at most the negotiated `max_reorder_buffer` early frames),
//!   checked by an [`EmissionChecker`], renumbered by a [`WriteGate`] (nothing after the leg's
//!   END/ERR) and forwarded. Credit is forwarded end to end: CHUNKs spend a leg's window, CREDIT
//!   from the receiving side refills it, and the switch neither creates nor absorbs any; a
//!   sender past its window is a `CREDIT_VIOLATION`.
//! - **Misbehaving masters** (garbage handshake, credit violations, frames for requests they are
//!   not part of, reorder overflow, order violations) are cut off with a typed reason, counted,
//!   and their requests end `MasterDied`; nothing they send reaches another master's request.
//! - **Cancel** (terminate as cancelled, CANCEL with `force_kill` to the destination, the same
//!   for every child peer request, an ERR to the origin in the reason's words) versus
//!   **stop-feeds** (CLOSE_STREAM only; the request ends on its own).
//! - **Policy**: pushed to every master before anything else, never resent unchanged.
//! - **The cap table and graph**: rebuilt on every manifest change, health change or death;
//!   [`Switch::reachable_targets`] and [`Switch::paths_to`] walk cap edges.
//! - [`Switch::protocol_stats`]: a serde snapshot of all of it.
//!
//! Drain order after any input: `poll_transmit` until `None`, then `poll_event` until `None`,
//! then `poll_timeout`.

mod graph;
#[cfg(any(test, feature = "harness"))]
pub mod harness;
mod hello;
pub mod host;
pub mod side;
mod stats;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;

pub use hello::{
    manifest_caps, manifest_json, HandshakeError, Hello, Limits, IDENTITY_NONCE, IDENTITY_STREAM,
};
pub use stats::{MasterHealth, RequestView, SwitchStats};

use crate::cap::{self, CapUrn, MediaUrn, ParseError};
use crate::limits::{
    STREAMS_PER_REQUEST_COUNT_MAX, SWITCH_HANDSHAKE_TIMEOUT_MS, SWITCH_HEARTBEAT_INTERVAL_MS,
    SWITCH_HEARTBEAT_TIMEOUT_MS, SWITCH_IDENTITY_ECHO_BYTES_MAX, SWITCH_MASTERS_MAX,
    SWITCH_POLICY_BYTES_MAX,
};
use crate::request::{
    CancelCode, CancelReason, Direction, Emission, EmissionChecker, Observed, RefusalKind,
    ReorderBuffer, RequestKey, RequestTable, RequestTableConfig, Seq, Terminated, Termination,
    TerminationKind, WriteGate, Written,
};
use crate::time::Time;
use crate::wire::bifaci::{Frame, FrameType, MessageId, Meta};
use crate::wire::cbor::{self, Reader};

/// A master slot's index: the routing key, stable across reattachment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct SlotId(pub u32);

/// One connection to a master: its slot and the attachment generation. Inputs about an older
/// generation of the slot are ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ConnId {
    /// The slot.
    pub slot: SlotId,
    /// Which attachment of the slot.
    pub generation: u64,
}

/// One side of a request: the engine or a master.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Peer {
    /// The engine the switch serves.
    Engine,
    /// A master, by slot.
    Master(SlotId),
}

/// A frame to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// To whom (a master's current connection, or the engine's response path for the frame's
    /// request id).
    pub to: Peer,
    /// The frame, with its seq and (towards masters) its XID set.
    pub frame: Frame,
}

/// Why a master's connection was cut.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CutReason {
    /// The handshake failed.
    #[error("handshake: {0}")]
    Handshake(#[from] HandshakeError),
    /// A HEARTBEAT was not echoed in time.
    #[error("no heartbeat echo within the timeout")]
    HeartbeatTimeout,
    /// The connection closed or failed (reported by the shell).
    #[error("connection closed")]
    Closed,
    /// The master broke the protocol.
    #[error("protocol violation: {0}")]
    Violation(#[from] ProtocolViolation),
    /// The master's bytes are not frames (garbage, an oversized frame, a wrong version).
    #[error("undecodable bytes: {0}")]
    Undecodable(String),
    /// The master stopped reading: its socket's queue reached the shell's bound.
    #[error("not reading its socket")]
    Backlogged,
}

impl CutReason {
    /// Whether the cut says the connection under the master's stream is suspect, not just the
    /// stream: the master went silent (its heartbeat was not echoed), which from this side
    /// cannot be told from a dead or hung peer. The transport should then drop that
    /// connection rather than open the next stream on it behind a peer that no longer
    /// answers. A master that stops reading (`Backlogged`) is its stream's fault where each
    /// stream has its own flow control, as on QUIC; a handshake failure, a protocol violation
    /// or undecodable bytes are the stream's fault too; a closed connection is gone already.
    pub fn implicates_connection(&self) -> bool {
        matches!(self, Self::HeartbeatTimeout)
    }
}

/// How a peer broke the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolViolation {
    /// A REQ from a master already carried an XID (only the switch assigns them).
    #[error("REQ carried an XID")]
    XidOnReq,
    /// A CHUNK beyond the stream's credit window.
    #[error("CREDIT_VIOLATION on stream {stream:?}")]
    CreditViolation {
        /// The stream.
        stream: Option<String>,
    },
    /// A frame for a request the sender is not a side of.
    #[error("frame for another master's request")]
    ForeignRequest,
    /// A flow frame further ahead than the reorder buffer holds, or one seen already.
    #[error("flow frame out of the reorder window ({0:?})")]
    Reorder(RefusalKind),
    /// The flow frames break the emission order.
    #[error("emission order: {0}")]
    Emission(crate::request::Violation),
    /// A frame this side may not send now.
    #[error("unexpected {0} frame")]
    Unexpected(&'static str),
    /// A manifest update that does not parse.
    #[error("bad manifest update: {0}")]
    Manifest(HandshakeError),
}

impl ProtocolViolation {
    /// A stable name for counters.
    pub fn name(&self) -> &'static str {
        match self {
            ProtocolViolation::XidOnReq => "xid_on_req",
            ProtocolViolation::CreditViolation { .. } => "credit_violation",
            ProtocolViolation::ForeignRequest => "foreign_request",
            ProtocolViolation::Reorder(_) => "reorder",
            ProtocolViolation::Emission(_) => "emission",
            ProtocolViolation::Unexpected(_) => "unexpected_frame",
            ProtocolViolation::Manifest(_) => "manifest",
        }
    }
}

/// What the shell must act on, or may report.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// Close this connection (the switch has already detached it).
    Disconnect {
        /// The connection.
        conn: ConnId,
        /// Why.
        reason: CutReason,
    },
    /// A master passed the identity check and is routable.
    MasterReady {
        /// The slot.
        slot: SlotId,
    },
    /// A master failed its identity check: attached but unhealthy, never routed to.
    MasterUnhealthy {
        /// The slot.
        slot: SlotId,
        /// Why.
        reason: HandshakeError,
    },
    /// A master's connection is gone; its requests ended `MasterDied`.
    MasterDied {
        /// The slot.
        slot: SlotId,
        /// Why.
        reason: CutReason,
    },
    /// Every master named at construction is verified or failed: routing has started.
    RoutingStarted,
    /// The aggregate cap table changed.
    CapsChanged,
    /// A request ended (whatever its origin), with how.
    RequestEnded {
        /// Its key.
        key: RequestKey,
        /// Who made it.
        origin: Peer,
        /// How it ended.
        termination: Termination,
    },
}

/// Why [`Switch::attach`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AttachError {
    /// The slot's connection is alive (healthy or not): the same master must not be attached
    /// twice.
    #[error("slot {0:?} is already attached")]
    AlreadyAttached(String),
    /// [`SWITCH_MASTERS_MAX`] slots exist.
    #[error("too many master slots")]
    TooManySlots,
}

/// Why the engine's frame was refused (nothing changed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// Routing has not started (a master named at construction is still being verified).
    #[error("the switch is still verifying its masters")]
    NotReady,
    /// The REQ carries no cap, or one that does not parse.
    #[error("bad cap: {0}")]
    BadCap(String),
    /// No healthy master serves the cap.
    #[error("no handler for {0}")]
    NoHandler(String),
    /// The request id is live already.
    #[error("request id already live")]
    DuplicateRequest,
    /// The table holds its limit of live requests.
    #[error("too many live requests")]
    TableFull,
    /// No live request of the engine has this id (a straggler or unknown; counted).
    #[error("no live request with this id")]
    NotLive,
    /// The frame breaks the protocol (credit, order, reorder window).
    #[error(transparent)]
    Violation(ProtocolViolation),
    /// A frame type the engine does not send.
    #[error("the engine does not send {0}")]
    Unexpected(&'static str),
}

/// Switch settings.
#[derive(Debug, Clone)]
pub struct SwitchConfig {
    /// The limits this side proposes in HELLO.
    pub limits: Limits,
    /// The policy pushed to every master (at most [`SWITCH_POLICY_BYTES_MAX`] bytes).
    pub policy: Bytes,
    /// Request table settings.
    pub table: RequestTableConfig,
    /// HELLO plus identity budget.
    pub handshake_timeout: Duration,
    /// Heartbeat period.
    pub heartbeat_interval: Duration,
    /// Heartbeat echo budget.
    pub heartbeat_timeout: Duration,
}

impl Default for SwitchConfig {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            policy: Bytes::new(),
            table: RequestTableConfig::default(),
            handshake_timeout: Duration::from_millis(SWITCH_HANDSHAKE_TIMEOUT_MS),
            heartbeat_interval: Duration::from_millis(SWITCH_HEARTBEAT_INTERVAL_MS),
            heartbeat_timeout: Duration::from_millis(SWITCH_HEARTBEAT_TIMEOUT_MS),
        }
    }
}

/// Where a master's connection is in its lifecycle.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
    /// No connection.
    Detached,
    /// HELLO sent; waiting for the master's.
    Hello { deadline: Time },
    /// Identity request sent; gathering the echo.
    Identity { deadline: Time, echo: Vec<u8> },
    /// Verified.
    Live,
    /// The identity check failed (or never answered): the connection stays attached but the
    /// master is unhealthy and never routed to (docs/spec/switch.md §9.2).
    Failed,
}

impl Stage {
    fn name(&self) -> &'static str {
        match self {
            Stage::Detached => "detached",
            Stage::Hello { .. } => "hello",
            Stage::Identity { .. } => "identity",
            Stage::Live => "live",
            Stage::Failed => "failed",
        }
    }
}

#[derive(Debug, Clone)]
struct Master {
    id: String,
    generation: u64,
    stage: Stage,
    limits: Option<Limits>,
    caps: Vec<CapUrn>,
    connected_at: Time,
    last_error: Option<String>,
    /// When the next HEARTBEAT goes out (Live only).
    heartbeat_at: Option<Time>,
    /// The outstanding HEARTBEAT: its id and echo deadline.
    heartbeat: Option<(u64, Time)>,
    /// The policy version last sent on this connection.
    policy_sent: u64,
    /// Host stats the master advertised (JSON text), kept for `protocol_stats`.
    host_stats: Option<String>,
}

impl Master {
    fn attached(&self) -> bool {
        self.stage != Stage::Detached
    }

    fn routable(&self) -> bool {
        self.stage == Stage::Live
    }

    fn conn(&self, slot: SlotId) -> ConnId {
        ConnId {
            slot,
            generation: self.generation,
        }
    }
}

/// Which side of a request a frame came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Origin,
    Dest,
}

/// One direction of a request: frames from one side, reordered, checked, renumbered.
#[derive(Debug, Clone)]
struct Leg {
    reorder: ReorderBuffer<Frame>,
    gate: WriteGate,
    checker: EmissionChecker,
    /// Remaining chunks per stream this leg's sender may still send.
    credit: BTreeMap<Option<String>, i64>,
}

impl Leg {
    fn new(reorder_limit: u64) -> Self {
        Self {
            reorder: ReorderBuffer::new(reorder_limit)
                .with_bytes_limit(crate::limits::SWITCH_REORDER_HELD_BYTES_MAX),
            gate: WriteGate::new(),
            checker: EmissionChecker::new(),
            credit: BTreeMap::new(),
        }
    }
}

/// A live request's routing.
#[derive(Debug, Clone)]
struct Route {
    origin: Peer,
    /// The origin master's generation (peer requests).
    origin_generation: u64,
    dest: SlotId,
    dest_generation: u64,
    /// Per-stream window, in chunks (the smaller of both sides' negotiated credit).
    window: u64,
    /// Frames from the origin towards the destination.
    to_dest: Leg,
    /// Frames from the destination back to the origin.
    to_origin: Leg,
}

impl Route {
    fn leg(&mut self, from: Side) -> &mut Leg {
        match from {
            Side::Origin => &mut self.to_dest,
            Side::Dest => &mut self.to_origin,
        }
    }
}

/// Counted outcomes that are not request terminations.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SwitchCounters {
    /// Requests answered `NO_HANDLER`.
    pub no_handler: u64,
    /// Peer requests answered `QUOTA`: their master had its share of the table live
    /// ([`crate::limits::SWITCH_PEER_REQUESTS_PER_MASTER_MAX`]).
    pub quota_refused: u64,
    /// Violations by name (each also cut the master, except `xid_on_req`).
    pub violations: BTreeMap<&'static str, u64>,
    /// Masters cut off, by reason.
    pub cuts: BTreeMap<String, u64>,
    /// Policies sent.
    pub policies_sent: u64,
    /// HEARTBEATs sent.
    pub heartbeats_sent: u64,
    /// Flow frames suppressed after their leg ended (benign stragglers).
    pub suppressed: u64,
    /// Frames from a master with no request (neither routable nor control), dropped.
    pub dropped: u64,
    /// LOG frames for the engine's calls dropped because the engine had not read as many LOG
    /// bytes as the bounds allow ([`crate::limits::SWITCH_LOG_UNREAD_BYTES_PER_REQUEST_MAX`]
    /// a call, [`crate::limits::SWITCH_HOST_LOG_UNREAD_BYTES_MAX`] over them). Counted where
    /// the engine's calls are read: the shell fills it in.
    pub engine_logs_dropped: u64,
}

/// The request switch machine. See the module docs.
#[derive(Debug)]
pub struct Switch {
    config: SwitchConfig,
    masters: Vec<Master>,
    /// Routable caps in slot order then manifest order, beside the slot serving each.
    cap_table: Vec<CapUrn>,
    cap_slots: Vec<SlotId>,
    /// For each tag key, the caps in `cap_table` whose output names it (ascending): a request
    /// whose output requires a key can only be served by these.
    output_keys: BTreeMap<String, Vec<usize>>,
    table: RequestTable<Route>,
    /// Live peer requests by the master that made them (its share of the table).
    peer_requests: BTreeMap<SlotId, usize>,
    /// Bytes of early flow frames held in the legs of live requests, by the peer that sent
    /// them (its share: [`crate::limits::SWITCH_PEER_REORDER_HELD_BYTES_MAX`]). A peer with
    /// nothing held has no entry.
    held_by: BTreeMap<Peer, usize>,
    next_xid: u64,
    next_heartbeat: u64,
    policy: Bytes,
    policy_version: u64,
    /// Slots named at construction not verified or failed yet.
    init_pending: BTreeSet<SlotId>,
    routing: bool,
    transmits: VecDeque<Transmit>,
    events: VecDeque<Event>,
    counters: SwitchCounters,
}

impl Switch {
    /// A switch whose routing starts once every master in `initial` (slot ids, in slot order)
    /// is attached and verified, or has failed. With no initial masters it routes at once.
    pub fn new(config: SwitchConfig, initial: &[&str]) -> Self {
        let mut policy = config.policy.clone();
        policy.truncate(SWITCH_POLICY_BYTES_MAX);
        let mut switch = Self {
            table: RequestTable::new(config.table),
            peer_requests: BTreeMap::new(),
            held_by: BTreeMap::new(),
            config,
            masters: Vec::new(),
            cap_table: Vec::new(),
            cap_slots: Vec::new(),
            output_keys: BTreeMap::new(),
            next_xid: 1,
            next_heartbeat: 1,
            policy,
            policy_version: 1,
            init_pending: BTreeSet::new(),
            routing: false,
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            counters: SwitchCounters::default(),
        };
        for id in initial.iter().take(SWITCH_MASTERS_MAX) {
            let slot = switch.slot_of(id).unwrap_or_else(|| switch.new_slot(id));
            switch.init_pending.insert(slot);
        }
        switch.check_init();
        switch
    }

    /// Whether a connection for slot `id` would be accepted (the slot is new or detached).
    /// Ask before dialling: a socket dialled into an attached slot is a duplicate.
    pub fn slot_accepts_attach(&self, id: &str) -> bool {
        match self.slot_of(id) {
            Some(slot) => !self.masters[slot.0 as usize].attached(),
            None => self.masters.len() < SWITCH_MASTERS_MAX,
        }
    }

    /// A new connection for slot `id` (new, or a detached slot reattached in place): the
    /// switch sends its HELLO and starts the handshake clock.
    pub fn attach(&mut self, now: Time, id: &str) -> Result<ConnId, AttachError> {
        let slot = match self.slot_of(id) {
            Some(slot) if self.masters[slot.0 as usize].attached() => {
                return Err(AttachError::AlreadyAttached(id.to_owned()));
            }
            Some(slot) => slot,
            None if self.masters.len() >= SWITCH_MASTERS_MAX => {
                return Err(AttachError::TooManySlots)
            }
            None => self.new_slot(id),
        };
        let deadline = now.saturating_add(self.config.handshake_timeout);
        let master = &mut self.masters[slot.0 as usize];
        master.generation += 1;
        master.stage = Stage::Hello { deadline };
        master.connected_at = now;
        master.limits = None;
        master.caps.clear();
        master.heartbeat = None;
        master.heartbeat_at = None;
        master.policy_sent = 0;
        let conn = master.conn(slot);
        let hello = Hello {
            limits: self.config.limits,
            manifest: None,
        };
        self.send(Peer::Master(slot), hello.to_frame());
        Ok(conn)
    }

    /// A frame arrived from a master's connection.
    pub fn handle_master_frame(&mut self, now: Time, conn: ConnId, frame: Frame) {
        if !self.is_current(conn) {
            return;
        }
        let slot = conn.slot;
        let stage = self.masters[slot.0 as usize].stage.clone();
        let result = match stage {
            Stage::Detached => Ok(()),
            Stage::Hello { .. } => self.on_hello(now, slot, &frame),
            Stage::Identity { .. } => self.on_identity_frame(now, slot, frame),
            Stage::Live => self.on_live_frame(now, slot, frame),
            Stage::Failed => self.on_control_frame(now, slot, frame),
        };
        if let Err(reason) = result {
            self.cut(now, slot, reason);
        }
    }

    /// A master's bytes did not decode into frames (garbage, a frame over the limit, a wrong
    /// version): the master is cut off with [`CutReason::Undecodable`] and counted.
    pub fn handle_undecodable(&mut self, now: Time, conn: ConnId, error: &str) {
        if self.is_current(conn) && self.masters[conn.slot.0 as usize].attached() {
            self.cut(now, conn.slot, CutReason::Undecodable(error.to_owned()));
        }
    }

    /// The shell's queue of frames for a master's socket is full
    /// ([`crate::limits::SWITCH_WRITER_FRAMES_MAX`]): the master stopped reading, and is cut
    /// off with [`CutReason::Backlogged`].
    pub fn handle_backlogged(&mut self, now: Time, conn: ConnId) {
        if self.is_current(conn) && self.masters[conn.slot.0 as usize].attached() {
            self.cut(now, conn.slot, CutReason::Backlogged);
        }
    }

    /// A master's connection closed or failed (EOF, I/O error).
    pub fn handle_closed(&mut self, now: Time, conn: ConnId) {
        if self.is_current(conn) && self.masters[conn.slot.0 as usize].attached() {
            self.detach(now, conn.slot, CutReason::Closed);
        } else if self.init_pending.remove(&conn.slot) {
            self.check_init();
        }
    }

    /// The per-stream credit window every side of every request uses (the switch's; masters
    /// may not propose less).
    pub fn window(&self) -> u64 {
        self.config.limits.initial_credit
    }

    /// The engine's REQ: routed to the best healthy master (`preferred` wins when an
    /// equivalent cap is served). The REQ's id is the request id; its XID is assigned here.
    pub fn handle_engine_request(
        &mut self,
        now: Time,
        frame: Frame,
        preferred: Option<&CapUrn>,
    ) -> Result<RequestKey, EngineError> {
        if frame.frame_type != FrameType::Req {
            return Err(EngineError::Unexpected(frame.frame_type.name()));
        }
        if !self.routing {
            return Err(EngineError::NotReady);
        }
        let cap = parse_cap(&frame).map_err(EngineError::BadCap)?;
        let Some(dest) = self.route(&cap, preferred) else {
            self.counters.no_handler += 1;
            return Err(EngineError::NoHandler(cap.to_string()));
        };
        self.register(now, Peer::Engine, dest, frame)
            .map_err(|error| match error {
                RegisterFailure::Duplicate => EngineError::DuplicateRequest,
                RegisterFailure::Full => EngineError::TableFull,
                RegisterFailure::Violation(violation) => EngineError::Violation(violation),
            })
    }

    /// A later frame of one of the engine's requests (STREAM_START, CHUNK, STREAM_END, END,
    /// ERR, LOG, CREDIT), found by its request id.
    pub fn handle_engine_frame(&mut self, now: Time, frame: Frame) -> Result<(), EngineError> {
        if matches!(
            frame.frame_type,
            FrameType::Req
                | FrameType::Hello
                | FrameType::Heartbeat
                | FrameType::RelayNotify
                | FrameType::RelayState
        ) {
            return Err(EngineError::Unexpected(frame.frame_type.name()));
        }
        let live = self.table.key_of(frame.id).filter(|key| {
            self.table
                .get(*key)
                .is_some_and(|s| s.data.origin == Peer::Engine)
        });
        let Some(key) = live else {
            self.table.account_unrouted(
                frame.id,
                frame.frame_type,
                crate::request::NoRouteSite::Continuation,
            );
            return Err(EngineError::NotLive);
        };
        self.forward(now, key, Side::Origin, frame)
            .map_err(EngineError::Violation)
    }

    /// Cancels request `rid` and every child peer request under the same `reason`: each ends
    /// cancelled, its destination gets CANCEL (`force_kill` unless the code is
    /// `ABORTED_COLLATERAL`), its origin an ERR in the reason's words. `false` when `rid` is
    /// not live.
    pub fn cancel(&mut self, now: Time, rid: MessageId, reason: &CancelReason) -> bool {
        let Some(key) = self.table.key_of(rid) else {
            return false;
        };
        let ended = self.table.cancel_cascade(key, reason, now);
        for terminated in ended {
            let Terminated { state, .. } = terminated;
            let route = state.data;
            self.request_left(&route);
            let (dest, dest_generation) = (route.dest, route.dest_generation);
            let mut cancel = Frame::new(FrameType::Cancel, state.key.rid);
            cancel.routing_id = Some(state.key.xid);
            cancel.force_kill = Some(reason.code != CancelCode::AbortedCollateral);
            cancel.meta = Some(attribution(reason));
            self.send_to_slot(dest, dest_generation, cancel);
            self.end_origin(state.key, route.clone(), attribution(reason));
            self.events.push_back(Event::RequestEnded {
                key: state.key,
                origin: route.origin,
                termination: Termination::Cancelled(reason.clone()),
            });
        }
        true
    }

    /// Sends CLOSE_STREAM for request `rid` to its destination without touching its state:
    /// the request ends on its own once its feeds drain. `true` when it was live and the
    /// stop was sent.
    pub fn stop_feeds(&mut self, rid: MessageId) -> bool {
        let Some(key) = self.table.key_of(rid) else {
            return false;
        };
        let route = &self.table.get(key).expect("indexed keys are live").data;
        let (dest, generation) = (route.dest, route.dest_generation);
        let mut close = Frame::new(FrameType::CloseStream, rid);
        close.routing_id = Some(key.xid);
        self.send_to_slot(dest, generation, close);
        true
    }

    /// Replaces the policy and sends it to every master past HELLO; the same policy again
    /// sends nothing.
    pub fn set_policy(&mut self, mut policy: Bytes) {
        policy.truncate(SWITCH_POLICY_BYTES_MAX);
        if policy == self.policy {
            return;
        }
        self.policy = policy;
        self.policy_version += 1;
        for index in 0..self.masters.len() {
            if matches!(
                self.masters[index].stage,
                Stage::Identity { .. } | Stage::Live | Stage::Failed
            ) {
                self.push_policy(SlotId(index as u32));
            }
        }
    }

    /// Timers: handshake budgets, heartbeats to send, heartbeat echoes overdue. A call with
    /// nothing due does nothing.
    pub fn handle_timeout(&mut self, now: Time) {
        for index in 0..self.masters.len() {
            let slot = SlotId(index as u32);
            let master = &self.masters[index];
            match &master.stage {
                Stage::Hello { deadline } if *deadline <= now => {
                    self.cut(now, slot, HandshakeError::Timeout.into());
                    continue;
                }
                Stage::Identity { deadline, .. } if *deadline <= now => {
                    self.fail_identity(slot, HandshakeError::Identity("no echo in time"));
                    continue;
                }
                _ => {}
            }
            if master
                .heartbeat
                .is_some_and(|(_, deadline)| deadline <= now)
            {
                self.cut(now, slot, CutReason::HeartbeatTimeout);
                continue;
            }
            if master.heartbeat_at.is_some_and(|at| at <= now) && master.heartbeat.is_none() {
                let id = self.next_heartbeat;
                self.next_heartbeat += 1;
                let master = &mut self.masters[index];
                master.heartbeat = Some((id, now.saturating_add(self.config.heartbeat_timeout)));
                master.heartbeat_at = Some(now.saturating_add(self.config.heartbeat_interval));
                self.counters.heartbeats_sent += 1;
                self.send(
                    Peer::Master(slot),
                    Frame::new(FrameType::Heartbeat, MessageId::Uint(id)),
                );
            }
        }
    }

    /// The next frame to write.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When [`Switch::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Time> {
        self.masters
            .iter()
            .flat_map(|master| {
                let stage = match &master.stage {
                    Stage::Hello { deadline } | Stage::Identity { deadline, .. } => Some(*deadline),
                    _ => None,
                };
                let beat = match master.heartbeat {
                    Some((_, deadline)) => Some(deadline),
                    None => master.heartbeat_at,
                };
                [stage, beat]
            })
            .flatten()
            .min()
    }

    /// The slot a request for `cap` would be routed to now (the best-ranked routable master;
    /// `preferred` wins among equivalents), without routing anything.
    pub fn route_for(&self, cap: &CapUrn, preferred: Option<&CapUrn>) -> Option<SlotId> {
        self.route(cap, preferred)
    }

    /// Whether routing has started.
    pub fn is_routing(&self) -> bool {
        self.routing
    }

    /// The slot of master `id`, if it has one.
    pub fn slot_of(&self, id: &str) -> Option<SlotId> {
        self.masters
            .iter()
            .position(|master| master.id == id)
            .map(|index| SlotId(index as u32))
    }

    /// The current connection of `slot`, when attached.
    pub fn conn_of(&self, slot: SlotId) -> Option<ConnId> {
        let master = self.masters.get(slot.0 as usize)?;
        master.attached().then(|| master.conn(slot))
    }

    /// The union of every routable master's caps, in routing order (canonical forms).
    pub fn capabilities(&self) -> Vec<String> {
        let mut seen = BTreeSet::new();
        self.cap_table
            .iter()
            .map(ToString::to_string)
            .filter(|cap| seen.insert(cap.clone()))
            .collect()
    }

    /// Output media reachable from `input` over routable caps (the identity cap excluded).
    pub fn reachable_targets(&self, input: &MediaUrn) -> Vec<MediaUrn> {
        graph::reachable(&self.graph_caps(), input)
    }

    /// Chains of routable caps that turn `input` into something conforming to `output`,
    /// shortest first, bounded by [`crate::limits::SWITCH_PATH_CAPS_MAX`] caps a path and
    /// [`crate::limits::SWITCH_PATHS_MAX`] paths.
    pub fn paths_to(&self, input: &MediaUrn, output: &MediaUrn) -> Vec<Vec<CapUrn>> {
        graph::paths(&self.graph_caps(), input, output)
    }

    /// Live requests.
    pub fn live_requests(&self) -> usize {
        self.table.live_len()
    }

    /// The request table's counters: registrations, terminations by kind, stragglers by
    /// frame type, `no_route` drops by site.
    pub fn table_counters(&self) -> &crate::request::Counters {
        self.table.counters()
    }

    /// Counters outside the request table.
    pub fn counters(&self) -> &SwitchCounters {
        &self.counters
    }

    /// A serializable snapshot: live requests, the terminated ring, totals, drops and
    /// stragglers, per-master health, limits and host stats.
    pub fn protocol_stats(&self, now: Time) -> SwitchStats {
        stats::snapshot(self, now)
    }
}

/// Why a registration failed.
enum RegisterFailure {
    Duplicate,
    Full,
    Violation(ProtocolViolation),
}

// Handshake and master lifecycle.
impl Switch {
    fn new_slot(&mut self, id: &str) -> SlotId {
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
            policy_sent: 0,
            host_stats: None,
        });
        SlotId(self.masters.len() as u32 - 1)
    }

    fn is_current(&self, conn: ConnId) -> bool {
        self.masters
            .get(conn.slot.0 as usize)
            .is_some_and(|master| master.generation == conn.generation)
    }

    fn on_hello(&mut self, now: Time, slot: SlotId, frame: &Frame) -> Result<(), CutReason> {
        if frame.frame_type != FrameType::Hello {
            return Err(HandshakeError::Malformed("the first frame must be HELLO").into());
        }
        let hello = Hello::from_meta(frame.meta.as_ref())?;
        let limits = self.config.limits.negotiate(&hello.limits)?;
        if limits.initial_credit < self.config.limits.initial_credit {
            return Err(HandshakeError::WindowBelowSwitch {
                theirs: hello.limits.initial_credit,
                ours: self.config.limits.initial_credit,
            }
            .into());
        }
        let manifest = hello.manifest.ok_or(HandshakeError::NoManifest)?;
        let caps = manifest_caps(&manifest)?;
        let deadline = match self.masters[slot.0 as usize].stage {
            Stage::Hello { deadline } => deadline,
            _ => now.saturating_add(self.config.handshake_timeout),
        };
        let master = &mut self.masters[slot.0 as usize];
        master.limits = Some(limits);
        master.caps = caps;
        master.stage = Stage::Identity {
            deadline,
            echo: Vec::new(),
        };
        // The policy goes before anything else reaches the host.
        self.push_policy(slot);
        for frame in identity_request(self.masters[slot.0 as usize].generation, slot) {
            self.send(Peer::Master(slot), frame);
        }
        Ok(())
    }

    fn on_identity_frame(
        &mut self,
        now: Time,
        slot: SlotId,
        frame: Frame,
    ) -> Result<(), CutReason> {
        let generation = self.masters[slot.0 as usize].generation;
        if frame.id != identity_rid(generation, slot) {
            return self.on_control_frame(now, slot, frame);
        }
        let Stage::Identity { echo, .. } = &mut self.masters[slot.0 as usize].stage else {
            unreachable!("called in the identity stage");
        };
        match frame.frame_type {
            FrameType::StreamStart | FrameType::StreamEnd | FrameType::Log => Ok(()),
            FrameType::Chunk => {
                let payload = frame.payload.unwrap_or_default();
                if echo.len() + payload.len() > SWITCH_IDENTITY_ECHO_BYTES_MAX {
                    return Err(HandshakeError::Identity("echo too long").into());
                }
                echo.extend_from_slice(&payload);
                Ok(())
            }
            FrameType::End if echo.as_slice() == IDENTITY_NONCE => {
                let master = &mut self.masters[slot.0 as usize];
                master.stage = Stage::Live;
                master.heartbeat_at = Some(now.saturating_add(self.config.heartbeat_interval));
                master.last_error = None;
                self.rebuild_caps();
                self.events.push_back(Event::MasterReady { slot });
                if self.init_pending.remove(&slot) {
                    self.check_init();
                }
                Ok(())
            }
            FrameType::End => {
                self.fail_identity(slot, HandshakeError::Identity("wrong echo"));
                Ok(())
            }
            FrameType::Err => {
                self.fail_identity(slot, HandshakeError::Identity("answered with ERR"));
                Ok(())
            }
            other => Err(ProtocolViolation::Unexpected(other.name()).into()),
        }
    }

    /// The identity check failed: the master stays attached (its socket is open) but is
    /// unhealthy, so it is never routed to and its slot refuses another attach until the
    /// connection goes (docs/spec/switch.md §9.1).
    fn fail_identity(&mut self, slot: SlotId, reason: HandshakeError) {
        let master = &mut self.masters[slot.0 as usize];
        master.stage = Stage::Failed;
        master.last_error = Some(reason.to_string());
        self.events
            .push_back(Event::MasterUnhealthy { slot, reason });
        if self.init_pending.remove(&slot) {
            self.check_init();
        }
    }

    /// Frames that are not part of a request: HEARTBEAT, RELAY_NOTIFY; anything else here is
    /// unexpected.
    fn on_control_frame(&mut self, now: Time, slot: SlotId, frame: Frame) -> Result<(), CutReason> {
        match frame.frame_type {
            FrameType::Heartbeat => {
                let master = &mut self.masters[slot.0 as usize];
                match (master.heartbeat, frame.id) {
                    (Some((id, _)), MessageId::Uint(echo)) if id == echo => {
                        master.heartbeat = None;
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

    fn on_notify(&mut self, _now: Time, slot: SlotId, frame: &Frame) -> Result<(), CutReason> {
        let (manifest, host_stats) = notify_fields(frame.meta.as_ref())
            .map_err(|what| ProtocolViolation::Manifest(HandshakeError::Malformed(what)))?;
        let master = &mut self.masters[slot.0 as usize];
        if let Some(stats) = host_stats {
            master.host_stats = Some(String::from_utf8_lossy(&stats).into_owned());
        }
        if let Some(manifest) = manifest {
            master.caps = manifest_caps(&manifest).map_err(ProtocolViolation::Manifest)?;
            if master.routable() {
                self.rebuild_caps();
            }
        }
        Ok(())
    }

    fn push_policy(&mut self, slot: SlotId) {
        let master = &mut self.masters[slot.0 as usize];
        if master.policy_sent == self.policy_version {
            return;
        }
        master.policy_sent = self.policy_version;
        self.counters.policies_sent += 1;
        let mut frame = Frame::new(FrameType::RelayState, MessageId::Uint(0));
        frame.payload = Some(self.policy.clone());
        self.send(Peer::Master(slot), frame);
    }

    fn check_init(&mut self) {
        if !self.routing && self.init_pending.is_empty() {
            self.routing = true;
            self.events.push_back(Event::RoutingStarted);
        }
    }

    /// Cuts a misbehaving or failing master: the shell closes the connection.
    fn cut(&mut self, now: Time, slot: SlotId, reason: CutReason) {
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
    fn detach(&mut self, now: Time, slot: SlotId, reason: CutReason) {
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
    fn request_left(&mut self, route: &Route) {
        self.release_held(route.origin, route.to_dest.reorder.held_bytes());
        self.release_held(
            Peer::Master(route.dest),
            route.to_origin.reorder.held_bytes(),
        );
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
    fn release_held(&mut self, sender: Peer, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let held = self
            .held_by
            .get_mut(&sender)
            .expect("a leg's held bytes are counted under its sender");
        *held -= bytes;
        if *held == 0 {
            self.held_by.remove(&sender);
        }
    }

    /// Whether the early-frame bytes counted per sender are exactly what the live requests'
    /// legs hold (a check for harnesses and fuzzers; it walks every live request).
    pub fn held_bytes_balance(&self) -> bool {
        let mut held: BTreeMap<Peer, usize> = BTreeMap::new();
        for key in self.table.live_keys() {
            let route = &self.table.get(key).expect("live").data;
            for (sender, leg) in [
                (route.origin, &route.to_dest),
                (Peer::Master(route.dest), &route.to_origin),
            ] {
                if leg.reorder.held_bytes() > 0 {
                    *held.entry(sender).or_default() += leg.reorder.held_bytes();
                }
            }
        }
        held == self.held_by
    }

    /// Bytes of early flow frames held on behalf of `sender` over its live requests.
    pub fn held_bytes_of(&self, sender: Peer) -> usize {
        self.held_by.get(&sender).copied().unwrap_or(0)
    }

    /// Live peer requests `slot` made.
    pub fn peer_requests_of(&self, slot: SlotId) -> usize {
        self.peer_requests.get(&slot).copied().unwrap_or(0)
    }

    fn end_master_died(&mut self, now: Time, key: RequestKey, dead: SlotId) {
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
                error_meta("MASTER_DIED", "the serving master died"),
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

    fn rebuild_caps(&mut self) {
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

    fn graph_caps(&self) -> Vec<&CapUrn> {
        let identity = cap::identity();
        self.cap_table
            .iter()
            .filter(|cap| !cap.is_equivalent(&identity))
            .collect()
    }
}

// Requests: routing, forwarding, termination.
impl Switch {
    fn route(&self, cap: &CapUrn, preferred: Option<&CapUrn>) -> Option<SlotId> {
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

    fn on_live_frame(&mut self, now: Time, slot: SlotId, frame: Frame) -> Result<(), CutReason> {
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
    fn on_peer_request(&mut self, now: Time, slot: SlotId, frame: Frame) {
        let rid = frame.id;
        let refuse = |switch: &mut Switch, code: &str, message: String| {
            let mut err = Frame::new(FrameType::Err, rid);
            err.meta = Some(error_meta(code, &message));
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
                "a REQ may not carry an XID".into(),
            );
        }
        let cap = match parse_cap(&frame) {
            Ok(cap) => cap,
            Err(message) => return refuse(self, "BAD_CAP", message),
        };
        let Some(dest) = self.route(&cap, None) else {
            self.counters.no_handler += 1;
            return refuse(self, "NO_HANDLER", format!("no handler for {cap}"));
        };
        if self.peer_requests.get(&slot).copied().unwrap_or(0)
            >= crate::limits::SWITCH_PEER_REQUESTS_PER_MASTER_MAX
        {
            self.counters.quota_refused += 1;
            return refuse(
                self,
                "QUOTA",
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
                refuse(self, "DUPLICATE_REQUEST", "request id already live".into());
            }
            Err(RegisterFailure::Full) => {
                refuse(self, "TABLE_FULL", "too many live requests".into());
            }
            Err(RegisterFailure::Violation(violation)) => {
                refuse(self, "PROTOCOL_VIOLATION", violation.to_string());
            }
        }
    }

    /// Registers a routed REQ and forwards it to `dest`.
    fn register(
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
    fn on_request_frame(&mut self, now: Time, slot: SlotId, frame: Frame) -> Result<(), CutReason> {
        let key = match frame.routing_id {
            Some(xid) => {
                Some(RequestKey { xid, rid: frame.id }).filter(|key| self.table.get(*key).is_some())
            }
            None => self.table.key_of(frame.id),
        };
        let generation = self.masters[slot.0 as usize].generation;
        let side = key.and_then(|key| {
            let route = &self.table.get(key).expect("filtered live").data;
            if route.dest == slot && route.dest_generation == generation {
                Some(Side::Dest)
            } else if route.origin == Peer::Master(slot) && route.origin_generation == generation {
                Some(Side::Origin)
            } else {
                None
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
    fn origin_control(
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
            self.cancel(now, key.rid, &reason);
        } else {
            self.stop_feeds(key.rid);
        }
        Ok(())
    }

    /// Carries one frame of request `key` from side `from` to the other side.
    fn forward(
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
            return self.forward_control(key, from, frame);
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

    /// Checks, renumbers and writes one in-order flow frame; `false` once the request ended.
    fn emit(
        &mut self,
        now: Time,
        key: RequestKey,
        from: Side,
        mut frame: Frame,
    ) -> Result<bool, ProtocolViolation> {
        let Some(state) = self.table.get_mut(key) else {
            return Ok(false);
        };
        let window = state.data.window as i64;
        let leg = state.data.leg(from);
        if frame.frame_type == FrameType::Chunk {
            let stream = frame.stream_id.clone();
            if !leg.credit.contains_key(&stream)
                && leg.credit.len() >= STREAMS_PER_REQUEST_COUNT_MAX
            {
                return Err(ProtocolViolation::Emission(
                    crate::request::Violation::TooManyStreams,
                ));
            }
            let remaining = leg.credit.entry(stream.clone()).or_insert(window);
            if *remaining <= 0 {
                return Err(ProtocolViolation::CreditViolation { stream });
            }
            *remaining -= 1;
        }
        if let Some(emission) = Emission::of_frame(&frame) {
            if let Err((_, violation)) = leg.checker.step(emission) {
                return Err(ProtocolViolation::Emission(violation.clone()));
            }
        }
        match leg.gate.write(frame.frame_type) {
            Written::Suppressed => {
                self.counters.suppressed += 1;
                return Ok(true);
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
                return Ok(!ends);
            }
        }
        Ok(true)
    }

    /// CREDIT (and other non-flow frames of a request) go straight across. A CREDIT from one
    /// side refills the window of the leg that sends towards it.
    fn forward_control(
        &mut self,
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
        frame.seq = 0;
        let route = state.data.clone();
        match from {
            Side::Origin => {
                frame.routing_id = Some(key.xid);
                self.send_to_slot(route.dest, route.dest_generation, frame);
            }
            Side::Dest => self.answer_origin(key, &route, frame),
        }
        Ok(())
    }

    /// Ends a terminated request's flow towards its origin with an ERR carrying `meta`,
    /// numbered after the frames that flow already carried (a receiver's reorder buffer would
    /// refuse a restarted seq).
    fn end_origin(&mut self, key: RequestKey, mut route: Route, meta: Meta) {
        let mut err = Frame::new(FrameType::Err, key.rid);
        err.meta = Some(meta);
        match route.to_origin.gate.write(FrameType::Err) {
            Written::Sent { seq, .. } => err.seq = seq.0,
            Written::Suppressed => return,
        }
        self.answer_origin(key, &route, err);
    }

    /// Sends a frame of request `key` to its origin (the engine gets it without the XID).
    fn answer_origin(&mut self, key: RequestKey, route: &Route, mut frame: Frame) {
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
    fn send_to_slot(&mut self, slot: SlotId, generation: u64, frame: Frame) {
        let master = &self.masters[slot.0 as usize];
        if master.generation == generation && master.attached() {
            self.send(Peer::Master(slot), frame);
        }
    }

    fn send(&mut self, to: Peer, frame: Frame) {
        self.transmits.push_back(Transmit { to, frame });
    }
}

/// The identity request's id on generation `generation` of `slot` (distinct per connection,
/// so a late echo of an older attempt is not mistaken for this one).
fn identity_rid(generation: u64, slot: SlotId) -> MessageId {
    let mut id = [0u8; 16];
    id[..4].copy_from_slice(b"idty");
    id[4..8].copy_from_slice(&slot.0.to_be_bytes());
    id[8..].copy_from_slice(&generation.to_be_bytes());
    MessageId::Uuid(id)
}

/// The identity check's frames: REQ, STREAM_START, CHUNK(nonce), STREAM_END, END.
fn identity_request(generation: u64, slot: SlotId) -> Vec<Frame> {
    let rid = identity_rid(generation, slot);
    let mut req = Frame::new(FrameType::Req, rid);
    req.cap = Some(cap::CAP_IDENTITY.to_owned());
    let mut start = Frame::new(FrameType::StreamStart, rid);
    start.stream_id = Some(IDENTITY_STREAM.to_owned());
    start.media_urn = Some("media:".to_owned());
    let mut chunk = Frame::new(FrameType::Chunk, rid);
    chunk.stream_id = Some(IDENTITY_STREAM.to_owned());
    chunk.chunk_index = Some(0);
    chunk.payload = Some(Bytes::from_static(IDENTITY_NONCE));
    let mut end_stream = Frame::new(FrameType::StreamEnd, rid);
    end_stream.stream_id = Some(IDENTITY_STREAM.to_owned());
    end_stream.chunk_count = Some(1);
    let end = Frame::new(FrameType::End, rid);
    let mut frames = [req, start, chunk, end_stream, end];
    for (seq, frame) in frames.iter_mut().enumerate() {
        frame.seq = seq as u64;
        // Like every REQ the switch writes, it carries an XID (0: the switch's own request).
        frame.routing_id = Some(MessageId::Uint(0));
    }
    frames.into()
}

fn parse_cap(frame: &Frame) -> Result<CapUrn, String> {
    let text = frame.cap.as_deref().ok_or("REQ without a cap")?;
    CapUrn::parse(text).map_err(|error: ParseError| error.to_string())
}

/// An ERR's `meta`: `code` and `message`.
pub fn error_meta(code: &str, message: &str) -> Meta {
    let mut out = Vec::new();
    cbor::write_map(&mut out, 2);
    cbor::write_text(&mut out, "code");
    cbor::write_text(&mut out, code);
    cbor::write_text(&mut out, "message");
    cbor::write_text(&mut out, message);
    Meta::from_cbor(Bytes::from(out)).expect("a map with text keys is a valid meta")
}

/// A cancel's attribution as `meta`: `code`, `class` (when attributed) and `message`.
fn attribution(reason: &CancelReason) -> Meta {
    let code = match reason.code {
        CancelCode::Cancelled => "CANCELLED",
        CancelCode::AbortedCollateral => "ABORTED_COLLATERAL",
        CancelCode::Aborted => "ABORTED",
    };
    let class = reason.class.map(|class| match class {
        crate::request::ErrorClass::User => "user",
        crate::request::ErrorClass::Input => "input",
        crate::request::ErrorClass::Resource => "resource",
        crate::request::ErrorClass::Environment => "environment",
        crate::request::ErrorClass::Internal => "internal",
    });
    let mut out = Vec::new();
    cbor::write_map(&mut out, 2 + usize::from(class.is_some()));
    cbor::write_text(&mut out, "code");
    cbor::write_text(&mut out, code);
    if let Some(class) = class {
        cbor::write_text(&mut out, "class");
        cbor::write_text(&mut out, class);
    }
    cbor::write_text(&mut out, "message");
    cbor::write_text(&mut out, &reason.message);
    Meta::from_cbor(Bytes::from(out)).expect("a map with text keys is a valid meta")
}

/// A RELAY_NOTIFY's `manifest` and `stats` (both byte strings, both optional).
fn notify_fields(meta: Option<&Meta>) -> Result<(Option<Bytes>, Option<Bytes>), &'static str> {
    let Some(meta) = meta else {
        return Ok((None, None));
    };
    let mut reader = Reader::new(meta.as_cbor());
    let pairs = reader.map().map_err(|_| "meta is not a map")?;
    let (mut manifest, mut stats) = (None, None);
    for _ in 0..pairs {
        let key = reader.text().map_err(|_| "meta key")?;
        match key {
            "manifest" => {
                manifest = Some(Bytes::copy_from_slice(
                    reader.bytes().map_err(|_| "manifest")?,
                ));
            }
            "stats" => {
                stats = Some(Bytes::copy_from_slice(reader.bytes().map_err(|_| "stats")?));
            }
            _ => {
                reader.skip().map_err(|_| "meta value")?;
            }
        }
    }
    Ok((manifest, stats))
}

/// The `parent_rid` a peer REQ names in its `meta` (the request it is made on behalf of), as
/// an unsigned integer or 16 bytes.
fn parent_rid(meta: Option<&Meta>) -> Option<MessageId> {
    let mut reader = Reader::new(meta?.as_cbor());
    let pairs = reader.map().ok()?;
    for _ in 0..pairs {
        let key = reader.text().ok()?;
        if key != "parent_rid" {
            reader.skip().ok()?;
            continue;
        }
        return match reader.peek_major()? {
            cbor::MAJOR_UINT => reader.uint().ok().map(MessageId::Uint),
            cbor::MAJOR_BYTES => reader
                .bytes()
                .ok()
                .and_then(|bytes| <[u8; 16]>::try_from(bytes).ok())
                .map(MessageId::Uuid),
            _ => None,
        };
    }
    None
}

/// A peer REQ's `meta` naming its parent request.
pub fn parent_meta(parent: MessageId) -> Meta {
    let mut out = Vec::new();
    cbor::write_map(&mut out, 1);
    cbor::write_text(&mut out, "parent_rid");
    match parent {
        MessageId::Uint(value) => cbor::write_uint(&mut out, value),
        MessageId::Uuid(bytes) => cbor::write_bytes(&mut out, &bytes),
    }
    Meta::from_cbor(Bytes::from(out)).expect("a map with text keys is a valid meta")
}

/// A RELAY_NOTIFY's `meta` carrying a new manifest and/or host stats.
pub fn notify_meta(manifest: Option<&[u8]>, stats: Option<&[u8]>) -> Meta {
    let mut out = Vec::new();
    cbor::write_map(
        &mut out,
        usize::from(manifest.is_some()) + usize::from(stats.is_some()),
    );
    if let Some(manifest) = manifest {
        cbor::write_text(&mut out, "manifest");
        cbor::write_bytes(&mut out, manifest);
    }
    if let Some(stats) = stats {
        cbor::write_text(&mut out, "stats");
        cbor::write_bytes(&mut out, stats);
    }
    Meta::from_cbor(Bytes::from(out)).expect("a map with text keys is a valid meta")
}

/// An ERR's `code` from its `meta`, if it has one.
pub fn error_code(frame: &Frame) -> Option<String> {
    let mut reader = Reader::new(frame.meta.as_ref()?.as_cbor());
    let pairs = reader.map().ok()?;
    for _ in 0..pairs {
        let key = reader.text().ok()?;
        if key == "code" {
            return reader.text().ok().map(str::to_owned);
        }
        reader.skip().ok()?;
    }
    None
}

#[cfg(test)]
mod tests;
