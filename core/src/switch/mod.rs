//! The request switch (docs/spec/switch.md): routes requests from an engine, and peer requests from
//! one master's cartridges, to the master whose caps serve them best, and carries every later frame
//! of each request between its two sides.
//!
//! [`Switch`] is one sans-IO machine with the substrate's shape: inputs are `handle_*` calls
//! with `now` first (a master connection attached, a frame from a master or from the engine,
//! a connection closed, a timeout, the engine-facing commands `handle_cancel` and
//! `handle_stop_feeds`), and `set_policy`; outputs are drained with [`Switch::poll_transmit`]
//! (frames to write, each to a master or to the engine), [`Switch::poll_event`] (what the shell
//! must act on or may report) and [`Switch::poll_timeout`]. The shell decides nothing.
//!
//! What the machine owns:
//! - **Master slots** with stable caller-chosen ids; a slot's index is the routing key and
//!   never changes. Attaching an attached slot is refused; a detached one is reattached in
//!   place with a new generation, and frames or closes of an older generation are ignored.
//! - **The handshake** per connection, as seed 001 and capdag 1.524.58 make it
//!   (docs/spec/capdag-v6.md §11): the master speaks first with a RELAY_NOTIFY (its manifest and
//!   limits; the minimum of each is used, a zero refused, and a master's credit window must be
//!   the switch's, so that every side of every request uses the same window); the
//!   switch answers with its POLICY before anything else; then, when the manifest names caps,
//!   the identity check (a REQ for `cap:effect=none` with 32 random bytes from the shell, to
//!   be echoed), all within [`SWITCH_HANDSHAKE_TIMEOUT_MS`]. A master with no caps joins
//!   healthy and capless, and is probed (the runtime identity probe, within
//!   [`SWITCH_IDENTITY_PROBE_TIMEOUT_MS`]) when a later RELAY_NOTIFY brings caps. A master that
//!   fails a check stays attached but unhealthy (never routed to, its slot refusing another
//!   attach until it disconnects). Then a HEARTBEAT every [`SWITCH_HEARTBEAT_INTERVAL_MS`]; a
//!   master that has echoed one must echo each within [`SWITCH_HEARTBEAT_TIMEOUT_MS`], and one
//!   that never echoes (capdag's own hosts may not) is not cut for it.
//! - **Init phases**: masters named at construction are all verified (or failed) before routing
//!   starts; [`Switch::handle_attach`] adds masters at runtime.
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
//!   from the receiving side refills it, and the switch neither creates nor absorbs any. What a
//!   sender writes past its window (capdag's in-process host does) is held in order and let go
//!   as credit arrives, so no receiver gets more than its window; past the sender's byte share
//!   ([`crate::limits::SWITCH_PEER_OVERRUN_HELD_BYTES_MAX`]) it is a `CREDIT_VIOLATION`.
//! - **Misbehaving masters** (garbage handshake, credit past the share, frames for requests they are
//!   not part of, reorder overflow, order violations) are cut off with a typed reason, counted,
//!   and their requests end `MasterDied`; nothing they send reaches another master's request.
//! - **Cancel** (terminate as cancelled, CANCEL with `force_kill` to the destination, the same
//!   for every child peer request, an ERR to the origin in the reason's words) versus
//!   **stop-feeds** (CLOSE_STREAM only; the request ends on its own).
//! - **Policy** ([`NetworkPolicy`], in POLICY frames): pushed to every master before anything
//!   else, never resent unchanged.
//! - **The cap table and graph**: rebuilt on every manifest change, health change or death;
//!   [`Switch::reachable_targets`] and [`Switch::paths_to`] walk cap edges.
//! - [`Switch::protocol_stats`]: a serde snapshot of all of it.
//!
//! Drain order after any input: `poll_transmit` until `None`, then `poll_event` until `None`,
//! then `poll_timeout`.

#[cfg(any(test, feature = "harness"))]
pub mod ask;
mod codes;
mod forwarding;
mod graph;
#[cfg(any(test, feature = "harness"))]
pub mod harness;
mod hello;
pub mod host;
mod masters;
mod meta;
pub mod side;
mod stats;

use masters::RegisterFailure;
use meta::*;
pub use meta::{
    end_ok_meta, error_code, error_meta, notify_meta, parent_meta, payload_content, payload_item,
};

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;

pub use codes::ErrCode;
pub use hello::{
    manifest_caps, manifest_json, HandshakeError, Limits, ManifestError, RelayNotify,
    IDENTITY_ECHO_STREAM, IDENTITY_NONCE_BYTES, IDENTITY_PROBE_NONCE, IDENTITY_PROBE_STREAM,
    IDENTITY_STREAM,
};
pub use stats::{MasterHealth, RequestView, SwitchStats};

use crate::cap::{self, CapUrn, MediaUrn, ParseError};
use crate::limits::{
    STREAMS_PER_REQUEST_COUNT_MAX, SWITCH_HANDSHAKE_TIMEOUT_MS, SWITCH_HEARTBEAT_INTERVAL_MS,
    SWITCH_HEARTBEAT_TIMEOUT_MS, SWITCH_IDENTITY_ECHO_BYTES_MAX, SWITCH_IDENTITY_PROBE_TIMEOUT_MS,
    SWITCH_MASTERS_MAX,
};
use crate::request::{
    CancelCode, CancelReason, Direction, Emission, EmissionChecker, ErrorClass, Observed,
    RefusalKind, ReorderBuffer, RequestKey, RequestTable, RequestTableConfig, Seq, Terminated,
    Termination, TerminationKind, WriteGate, Written,
};
use crate::time::Time;
pub use crate::wire::bifaci::NetworkPolicy;
use crate::wire::bifaci::{BifaciError, Frame, FrameType, MessageId, Meta};
use crate::wire::cbor::{self, Reader};
use crate::wire::DecodeError;

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

/// The switch's answer to an input whose caller waits on it ([`Switch::poll_answer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Answer {
    /// [`Switch::handle_attach`]: the connection's name, or why its slot refused it.
    Attached(Result<ConnId, AttachError>),
    /// [`Switch::handle_engine_request`]: the request's key in the table, or its refusal.
    Request(Result<RequestKey, EngineError>),
    /// [`Switch::handle_engine_frame`]: forwarded, or refused.
    Frame(Result<(), EngineError>),
    /// [`Switch::handle_cancel`]: whether the request was live.
    Cancelled(bool),
    /// [`Switch::handle_stop_feeds`]: whether the request was live and the stop was sent.
    FeedsStopped(bool),
}

answer_picks! {
    Answer;
    /// An [`Answer::Attached`].
    attached: Attached => Result<ConnId, AttachError>;
    /// An [`Answer::Request`].
    request: Request => Result<RequestKey, EngineError>;
    /// An [`Answer::Frame`].
    frame: Frame => Result<(), EngineError>;
    /// An [`Answer::Cancelled`] or [`Answer::FeedsStopped`]: whether the request was live.
    live: Cancelled | FeedsStopped => bool;
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
    /// The master's bytes are not frames (garbage, an oversized frame, a wrong version, a
    /// CHUNK whose checksum is wrong): the decoder's error, with the offset it stopped at.
    #[error("undecodable bytes: {0}")]
    Undecodable(DecodeError<BifaciError>),
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

/// Why [`Switch::handle_attach`] refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AttachError {
    /// The slot's connection is alive (healthy or not): the same master must not be attached
    /// twice.
    #[error("slot {0:?} is already attached")]
    AlreadyAttached(SlotId),
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
    /// The REQ carries no cap.
    #[error("REQ without a cap")]
    NoCap,
    /// The REQ's cap does not parse.
    #[error("bad cap: {0}")]
    BadCap(#[source] ParseError),
    /// No healthy master serves the cap.
    #[error("no handler for {0}")]
    NoHandler(Box<CapUrn>),
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
    /// The limits this side accepts at most (each master's are met at the minimum).
    pub limits: Limits,
    /// The policy every master is told before anything else.
    pub policy: NetworkPolicy,
    /// Request table settings.
    pub table: RequestTableConfig,
    /// Budget for the RELAY_NOTIFY and the identity check.
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
            policy: NetworkPolicy::default(),
            table: RequestTableConfig::default(),
            handshake_timeout: Duration::from_millis(SWITCH_HANDSHAKE_TIMEOUT_MS),
            heartbeat_interval: Duration::from_millis(SWITCH_HEARTBEAT_INTERVAL_MS),
            heartbeat_timeout: Duration::from_millis(SWITCH_HEARTBEAT_TIMEOUT_MS),
        }
    }
}

/// An identity check in progress: the connect-time check or the runtime probe
/// (docs/spec/capdag-v6.md §11.3–§11.4).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Check {
    rid: MessageId,
    /// What the echo's bytes must be.
    nonce: Vec<u8>,
    /// Connect-time: each CHUNK's payload is a CBOR byte string, its content appended; the
    /// runtime probe appends payloads as they are.
    decode: bool,
    echo: Vec<u8>,
    started: bool,
    stream_ended: bool,
    deadline: Time,
}

impl Check {
    fn new(rid: MessageId, nonce: Vec<u8>, decode: bool, deadline: Time) -> Self {
        Self {
            rid,
            nonce,
            decode,
            echo: Vec::new(),
            started: false,
            stream_ended: false,
            deadline,
        }
    }
}

/// Where a master's connection is in its lifecycle.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
    /// No connection.
    Detached,
    /// Attached; waiting for the master's first RELAY_NOTIFY. The nonce is the shell's, for
    /// the identity check.
    Notify {
        deadline: Time,
        nonce: [u8; IDENTITY_NONCE_BYTES],
    },
    /// Policy and identity request sent; gathering the echo.
    Identity(Check),
    /// Verified (or capless); `probe` while the runtime probe of caps that appeared later runs
    /// (unroutable until it passes).
    Live { probe: Option<Check> },
    /// An identity check failed (or never answered): the connection stays attached but the
    /// master is unhealthy and never routed to (docs/spec/switch.md §9.2).
    Failed,
}

impl Stage {
    fn name(&self) -> &'static str {
        match self {
            Stage::Detached => "detached",
            Stage::Notify { .. } => "notify",
            Stage::Identity { .. } => "identity",
            Stage::Live { probe: None } => "live",
            Stage::Live { probe: Some(_) } => "probing",
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
    /// Whether the master has echoed a HEARTBEAT on this connection: from then on a missing
    /// echo cuts it (one that never echoes is not held to it).
    echoes_heartbeats: bool,
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
        self.stage == Stage::Live { probe: None }
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
    /// Checked in-order frames the sender sent past a stream's window (and every frame after
    /// the first of them), waiting for credit: see `Switch::emit`.
    overrun: VecDeque<Frame>,
    /// Bytes of `overrun` ([`Frame::held_bytes`]).
    overrun_bytes: usize,
}

impl Leg {
    fn new(reorder_limit: u64) -> Self {
        Self {
            reorder: ReorderBuffer::new(reorder_limit)
                .with_bytes_limit(crate::limits::SWITCH_REORDER_HELD_BYTES_MAX),
            gate: WriteGate::new(),
            checker: EmissionChecker::new(),
            credit: BTreeMap::new(),
            overrun: VecDeque::new(),
            overrun_bytes: 0,
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
    /// The peer that sends on the leg from side `from`.
    fn sender(&self, from: Side) -> Peer {
        match from {
            Side::Origin => self.origin,
            Side::Dest => Peer::Master(self.dest),
        }
    }

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
    /// Flow frames held because their sender wrote past a stream's credit window (or behind
    /// such a frame), each written once the receiver granted the credit. capdag's in-process
    /// cartridge host does this: it writes without waiting for CREDIT.
    pub overrun_held: u64,
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
    /// Bytes of frames sent past their window held in the legs of live requests, by the peer
    /// that sent them (its share: [`crate::limits::SWITCH_PEER_OVERRUN_HELD_BYTES_MAX`]). A
    /// peer with nothing held has no entry.
    overrun_by: BTreeMap<Peer, usize>,
    next_xid: u64,
    next_heartbeat: u64,
    policy: NetworkPolicy,
    policy_version: u64,
    /// Slots named at construction not verified or failed yet.
    init_pending: BTreeSet<SlotId>,
    routing: bool,
    transmits: VecDeque<Transmit>,
    events: VecDeque<Event>,
    /// The answer to the input just handled, until [`Switch::poll_answer`] takes it.
    answer: Option<Answer>,
    counters: SwitchCounters,
}

impl Switch {
    /// A switch whose routing starts once every master in `initial` (slot ids, in slot order)
    /// is attached and verified, or has failed. With no initial masters it routes at once.
    pub fn new(config: SwitchConfig, initial: &[&str]) -> Self {
        let policy = config.policy;
        let mut switch = Self {
            table: RequestTable::new(config.table),
            peer_requests: BTreeMap::new(),
            held_by: BTreeMap::new(),
            overrun_by: BTreeMap::new(),
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
            answer: None,
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
    /// handshake clock starts, and the switch waits for the master's RELAY_NOTIFY. `nonce` is
    /// 32 random bytes from the shell, for this connection's identity check.
    ///
    /// Answered by [`Answer::Attached`] ([`Switch::poll_answer`]).
    pub fn handle_attach(&mut self, now: Time, id: &str, nonce: [u8; IDENTITY_NONCE_BYTES]) {
        let answer = self.answer_attach(now, id, nonce);
        self.answer = Some(Answer::Attached(answer));
    }

    /// What [`Switch::handle_attach`] answers.
    fn answer_attach(
        &mut self,
        now: Time,
        id: &str,
        nonce: [u8; IDENTITY_NONCE_BYTES],
    ) -> Result<ConnId, AttachError> {
        let slot = match self.slot_of(id) {
            Some(slot) if self.masters[slot.0 as usize].attached() => {
                return Err(AttachError::AlreadyAttached(slot));
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
        master.stage = Stage::Notify { deadline, nonce };
        master.connected_at = now;
        master.limits = None;
        master.caps.clear();
        master.heartbeat = None;
        master.heartbeat_at = None;
        master.echoes_heartbeats = false;
        master.policy_sent = 0;
        Ok(master.conn(slot))
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
            Stage::Notify { nonce, .. } => self.on_first_notify(now, slot, &frame, nonce),
            Stage::Identity(check) if check.rid == frame.id => {
                self.on_check_frame(now, slot, frame)
            }
            Stage::Identity(_) | Stage::Failed => self.on_control_frame(now, slot, frame),
            Stage::Live { probe: Some(check) } if check.rid == frame.id => {
                self.on_check_frame(now, slot, frame)
            }
            Stage::Live { .. } => self.on_live_frame(now, slot, frame),
        };
        if let Err(reason) = result {
            self.cut(now, slot, reason);
        }
    }

    /// A master's bytes did not decode into frames (garbage, a frame over the limit, a wrong
    /// version, a CHUNK whose checksum is wrong): the master is cut off with [`CutReason::Undecodable`] and counted.
    pub fn handle_undecodable(&mut self, now: Time, conn: ConnId, error: DecodeError<BifaciError>) {
        if self.is_current(conn) && self.masters[conn.slot.0 as usize].attached() {
            self.cut(now, conn.slot, CutReason::Undecodable(error));
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
    ///
    /// Answered by [`Answer::Request`] ([`Switch::poll_answer`]).
    pub fn handle_engine_request(&mut self, now: Time, frame: Frame, preferred: Option<&CapUrn>) {
        let answer = self.answer_engine_request(now, frame, preferred);
        self.answer = Some(Answer::Request(answer));
    }

    /// What [`Switch::handle_engine_request`] answers.
    fn answer_engine_request(
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
        let cap = parse_cap(&frame)?;
        let Some(dest) = self.route(&cap, preferred) else {
            self.counters.no_handler += 1;
            return Err(EngineError::NoHandler(Box::new(cap)));
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
    ///
    /// Answered by [`Answer::Frame`] ([`Switch::poll_answer`]).
    pub fn handle_engine_frame(&mut self, now: Time, frame: Frame) {
        let answer = self.answer_engine_frame(now, frame);
        self.answer = Some(Answer::Frame(answer));
    }

    /// What [`Switch::handle_engine_frame`] answers.
    fn answer_engine_frame(&mut self, now: Time, frame: Frame) -> Result<(), EngineError> {
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
    ///
    /// Answered by [`Answer::Cancelled`] ([`Switch::poll_answer`]).
    pub fn handle_cancel(&mut self, now: Time, rid: MessageId, reason: &CancelReason) {
        let answer = self.answer_cancel(now, rid, reason);
        self.answer = Some(Answer::Cancelled(answer));
    }

    /// What [`Switch::handle_cancel`] answers.
    fn answer_cancel(&mut self, now: Time, rid: MessageId, reason: &CancelReason) -> bool {
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
            cancel.meta = Some(cancel_meta(reason));
            self.send_to_slot(dest, dest_generation, cancel);
            self.end_origin(state.key, route.clone(), cancel_error_meta(reason));
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
    ///
    /// Answered by [`Answer::FeedsStopped`] ([`Switch::poll_answer`]).
    pub fn handle_stop_feeds(&mut self, _now: Time, rid: MessageId) {
        let answer = self.answer_stop_feeds(rid);
        self.answer = Some(Answer::FeedsStopped(answer));
    }

    /// What [`Switch::handle_stop_feeds`] answers.
    fn answer_stop_feeds(&mut self, rid: MessageId) -> bool {
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

    /// Replaces the policy and sends it to every master past its RELAY_NOTIFY; the same
    /// policy again sends nothing.
    pub fn set_policy(&mut self, policy: NetworkPolicy) {
        if policy == self.policy {
            return;
        }
        self.policy = policy;
        self.policy_version += 1;
        for index in 0..self.masters.len() {
            if matches!(
                self.masters[index].stage,
                Stage::Identity(_) | Stage::Live { .. } | Stage::Failed
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
                Stage::Notify { deadline, .. } if *deadline <= now => {
                    self.cut(now, slot, HandshakeError::Timeout.into());
                    continue;
                }
                Stage::Identity(check) | Stage::Live { probe: Some(check) }
                    if check.deadline <= now =>
                {
                    self.fail_identity(slot, HandshakeError::Identity("no echo in time"));
                    continue;
                }
                _ => {}
            }
            if master
                .heartbeat
                .is_some_and(|(_, deadline)| deadline <= now)
            {
                if master.echoes_heartbeats {
                    self.cut(now, slot, CutReason::HeartbeatTimeout);
                    continue;
                }
                // A master that never echoed is not held to it (capdag's own hosts may not).
                self.masters[index].heartbeat = None;
            }
            let master = &self.masters[index];
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

    /// The answer to the input just handled, for the inputs a caller waits on (each says which
    /// [`Answer`] it gives); `None` after any other input. Poll it before the next input: the
    /// next one's answer replaces it.
    pub fn poll_answer(&mut self) -> Option<Answer> {
        self.answer.take()
    }

    /// When [`Switch::handle_timeout`] must next be called.
    pub fn poll_timeout(&self) -> Option<Time> {
        self.masters
            .iter()
            .flat_map(|master| {
                let stage = match &master.stage {
                    Stage::Notify { deadline, .. } => Some(*deadline),
                    Stage::Identity(check) | Stage::Live { probe: Some(check) } => {
                        Some(check.deadline)
                    }
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

#[cfg(test)]
mod tests;
