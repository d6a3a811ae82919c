//! The conformance script format (docs/conformance/README.md), parsed strictly: every key of every
//! object is required (`null` where a value can be nothing), no extra keys, integers exact.

use serde::{Deserialize, Deserializer, Serialize};

/// The sections: the ten from the clean-room reference, in docs/conformance/README.md's order,
/// then tether's own.
pub const SECTIONS: [&str; 16] = [
    "frame_types",
    "ledger",
    "negotiate",
    "grant_target",
    "gate",
    "window",
    "reorder",
    "writer",
    "table",
    "emission",
    "substrate",
    "driver",
    "join",
    "routing",
    "switch",
    "peer",
];

/// A nullable key that must still be present (serde would otherwise default a missing
/// `Option` to `None`).
pub(crate) fn required<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    deserializer: D,
) -> Result<Option<T>, D::Error> {
    Option::<T>::deserialize(deserializer)
}

/// A script file: `{"section": ..., "cases": [...]}`. Cases stay raw JSON until the section
/// is known, so one malformed case is reported as such without losing the others.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptFile {
    /// The section name.
    pub section: String,
    /// The cases.
    pub cases: Vec<serde_json::Value>,
}

/// A `frame_types` case.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FrameTypesCase {
    pub code: u8,
    pub known: bool,
    #[serde(deserialize_with = "required")]
    pub flow: Option<bool>,
    #[serde(deserialize_with = "required")]
    pub terminal: Option<bool>,
    #[serde(deserialize_with = "required")]
    pub ends: Option<Ending>,
}

/// How a frame ends its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ending {
    Finished,
    Failed,
}

/// A `ledger` case.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LedgerCase {
    pub remaining: u64,
    pub frame: u8,
    pub granted: u64,
    pub after: i64,
}

/// A `negotiate` case.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NegotiateCase {
    pub ours: u64,
    pub theirs: u64,
    #[serde(deserialize_with = "required")]
    pub window: Option<u64>,
}

/// A `grant_target` case.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantTargetCase {
    pub streams: Vec<Option<String>>,
    #[serde(deserialize_with = "required")]
    pub named: Option<String>,
    pub matched: bool,
    #[serde(deserialize_with = "required")]
    pub target: Option<String>,
}

/// `gate` operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase", deny_unknown_fields)]
pub enum GateOp {
    Acquire { n: u64 },
    Grant { n: u64 },
    Close { reason: String },
}

/// `gate` observation after one op.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GateStep {
    #[serde(deserialize_with = "required")]
    pub answer: Option<String>,
    pub available: u64,
    #[serde(deserialize_with = "required")]
    pub closed: Option<String>,
}

/// A `gate` case.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GateCase {
    pub window: u64,
    pub ops: Vec<GateOp>,
    pub steps: Vec<GateStep>,
}

/// `window` operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WindowOp {
    Arrive,
    Continuation,
    Consume,
    Flush,
}

/// `window` observation after one op.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowStep {
    pub violation: bool,
    pub grant: u64,
    pub remaining: u64,
    pub pending: u64,
}

/// A `window` case.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowCase {
    pub window: u64,
    pub ops: Vec<WindowOp>,
    pub steps: Vec<WindowStep>,
}

/// `reorder` refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReorderError {
    Stale,
    Duplicate,
    Overflow,
}

/// `reorder` step: exactly one key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum ReorderStep {
    Deliver(Vec<u64>),
    Hold(HoldTrue),
    Error(ReorderError),
}

/// The literal `true` of `{"hold": true}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldTrue;

impl Serialize for HoldTrue {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bool(true)
    }
}

impl<'de> Deserialize<'de> for HoldTrue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        if bool::deserialize(deserializer)? {
            Ok(HoldTrue)
        } else {
            Err(serde::de::Error::custom("\"hold\" must be true"))
        }
    }
}

/// A `reorder` case.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReorderCase {
    pub limit: u64,
    pub arrivals: Vec<u64>,
    pub steps: Vec<ReorderStep>,
}

/// A `writer` case.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriterCase {
    pub frames: Vec<u8>,
    pub written: Vec<bool>,
    pub seqs: Vec<Option<u64>>,
}

/// `table` xid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Xid {
    X1,
    X2,
}

/// `table` rid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Rid {
    R1,
    R2,
    R3,
}

impl Xid {
    /// Both xids.
    pub const ALL: [Xid; 2] = [Xid::X1, Xid::X2];

    /// The spelling in scripts.
    pub fn name(self) -> &'static str {
        match self {
            Xid::X1 => "x1",
            Xid::X2 => "x2",
        }
    }
}

impl Rid {
    /// The three rids, in the order `frames` reports them.
    pub const ALL: [Rid; 3] = [Rid::R1, Rid::R2, Rid::R3];

    /// The spelling in scripts.
    pub fn name(self) -> &'static str {
        match self {
            Rid::R1 => "r1",
            Rid::R2 => "r2",
            Rid::R3 => "r3",
        }
    }
}

/// `table` operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableOp {
    pub op: TableOpKind,
    pub xid: Xid,
    pub rid: Rid,
}

/// register or terminate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TableOpKind {
    Register,
    Terminate,
}

/// A disposition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Disposition {
    Route,
    Straggler,
    NoRoute,
}

/// `table` observation after one op.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableStep {
    pub ok: bool,
    pub frames: [Disposition; 3],
}

/// A `table` case.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableCase {
    pub keep: u64,
    pub ops: Vec<TableOp>,
    pub steps: Vec<TableStep>,
    pub live: u64,
    pub registered: u64,
}

/// One emission of an `emission` case.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase", deny_unknown_fields)]
pub enum Emission {
    StreamStart {
        stream: String,
    },
    Chunk {
        stream: String,
        index: u64,
    },
    StreamEnd {
        stream: String,
        #[serde(deserialize_with = "required")]
        count: Option<u64>,
    },
    // Empty struct variants, not unit variants: serde lets a unit variant of an internally
    // tagged enum ignore extra keys, an empty struct variant with `deny_unknown_fields` does not.
    End {},
    Err {},
    Other {},
}

/// `emission` violation names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ViolationName {
    AfterEnd,
    StreamRestarted,
    StreamNotOpen,
    ChunkOutOfPlace,
    ChunkCountWrong,
    EndWithOpenStream,
}

/// An `emission` case.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmissionCase {
    pub emitted: Vec<Emission>,
    #[serde(deserialize_with = "required")]
    pub violation: Option<ViolationName>,
    #[serde(deserialize_with = "required")]
    pub at: Option<u64>,
    #[serde(deserialize_with = "required")]
    pub stream: Option<String>,
    #[serde(deserialize_with = "required")]
    pub expected: Option<u64>,
    #[serde(deserialize_with = "required")]
    pub got: Option<u64>,
}

/// Which substrate node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Node {
    A,
    B,
}

/// One environment action of a substrate trace (see `crate::substrate::Action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "do", rename_all = "lowercase", deny_unknown_fields)]
pub enum SubstrateAction {
    /// A sends on the queue (`n = 0`) or makes a req on the session (`n = 1`).
    Send { n: u8 },
    /// B answers its oldest req.
    Answer {},
    /// A node commits its oldest batch.
    Commit { node: Node },
    /// The link delivers frame `index` towards `to`.
    Deliver { to: Node, index: u8 },
    /// ... and keeps a copy in flight.
    Duplicate { to: Node, index: u8 },
    /// The link loses frame `index` towards `to`.
    Drop { to: Node, index: u8 },
    /// New connection.
    Reconnect {},
    /// A node crashes.
    Crash { node: Node },
    /// 31 s pass.
    Wait {},
    /// A stray op reaches B.
    Stray {},
    /// B closes the queue.
    Close {},
}

/// The model's verdict on a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Every promise held at every step and after healing.
    Ok,
    /// Some promise broke.
    Broken,
}

/// A substrate trace (tether's own section, docs/conformance/README.md#substrate): the actions run
/// from two nodes with a queue and a session open, judged by the model after every step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubstrateCase {
    pub window: u8,
    pub actions: Vec<SubstrateAction>,
    pub verdict: Verdict,
}

/// One input to the driver machine (tether's own section, docs/spec/driver.md; format and semantics
/// in `docs/conformance/driver.md`). Peers are 0–255; `at` is milliseconds, never decreasing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum DriverOp {
    Accept {
        at: u64,
        peer: u8,
        alpn: String,
        conn: u64,
    },
    Connected {
        at: u64,
        peer: u8,
        channel: String,
        conn: u64,
    },
    Closed {
        at: u64,
        peer: u8,
        channel: String,
        generation: u64,
    },
    Disconnect {
        at: u64,
        peer: u8,
        channel: String,
    },
    Admit {
        at: u64,
        peer: u8,
        path: String,
        direction: String,
    },
    Send {
        at: u64,
        peer: u8,
    },
    Batch {
        at: u64,
        peer: u8,
        frames: u64,
        /// One of the frames carries a SWIM tag (absent: false).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        swim: bool,
        /// The generation the writer's open stream is on (absent: none).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        stream: Option<u64>,
    },
    Stopped {
        at: u64,
        peer: u8,
        generation: u64,
    },
    Open {
        at: u64,
        peer: u8,
        path: String,
        channel: String,
    },
    OpenFailed {
        at: u64,
        peer: u8,
        channel: String,
        generation: u64,
    },
    RelaysSeen {
        at: u64,
        peer: u8,
        relays: Vec<String>,
    },
    RelaysFor {
        at: u64,
        peer: u8,
        given: Vec<String>,
    },
    Unresponsive {
        at: u64,
        peer: u8,
        channel: String,
        generation: u64,
    },
    OpenWaited {
        at: u64,
        peer: u8,
        channel: String,
        ticket: u64,
    },
    OpenWaitAbandoned {
        at: u64,
        peer: u8,
        channel: String,
        ticket: u64,
    },
    OpenDialFailed {
        at: u64,
        peer: u8,
        channel: String,
        ticket: u64,
        abandoned: bool,
    },
    WriteFailed {
        at: u64,
        peer: u8,
        generation: u64,
        frames: u64,
        swim: bool,
    },
    Idle {
        at: u64,
        peer: u8,
    },
    Dialed {
        at: u64,
        peer: u8,
        #[serde(deserialize_with = "required")]
        conn: Option<u64>,
    },
    Join {
        at: u64,
        peer: u8,
        relay: bool,
        direct: u64,
    },
    JoinConnected {
        at: u64,
        peer: u8,
    },
    JoinSent {
        at: u64,
        peer: u8,
        conn: u64,
    },
    JoinFailed {
        at: u64,
        peer: u8,
    },
    Fault {
        at: u64,
        peer: u8,
        fatal: bool,
        /// The stream's channel (absent: `actor`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        channel: Option<String>,
    },
    Unread {
        at: u64,
        peer: u8,
        channel: String,
    },
    EgressFull {
        at: u64,
        frames: u64,
    },
    Register {
        at: u64,
        actor: u8,
        generation: u64,
        forged: bool,
    },
    HandOff {
        at: u64,
        actor: u8,
        to: u8,
        generation: u64,
        forged: bool,
    },
    Stream {
        at: u64,
        name: String,
    },
    Control {
        at: u64,
        peer: u8,
        /// The record's bytes, lowercase hex.
        payload: String,
    },
    Ended {
        at: u64,
        peer: u8,
        name: String,
        /// 16 bytes, lowercase hex.
        flow: String,
        /// The publisher's number.
        publisher: u64,
    },
    Timeout {
        at: u64,
    },
    Close {
        at: u64,
    },
}

impl DriverOp {
    /// The op's time.
    pub fn at(&self) -> u64 {
        match self {
            Self::Accept { at, .. }
            | Self::Connected { at, .. }
            | Self::Closed { at, .. }
            | Self::Disconnect { at, .. }
            | Self::Admit { at, .. }
            | Self::Send { at, .. }
            | Self::Batch { at, .. }
            | Self::WriteFailed { at, .. }
            | Self::Stopped { at, .. }
            | Self::Open { at, .. }
            | Self::OpenFailed { at, .. }
            | Self::RelaysSeen { at, .. }
            | Self::RelaysFor { at, .. }
            | Self::Unresponsive { at, .. }
            | Self::OpenWaited { at, .. }
            | Self::OpenWaitAbandoned { at, .. }
            | Self::OpenDialFailed { at, .. }
            | Self::Idle { at, .. }
            | Self::Dialed { at, .. }
            | Self::Join { at, .. }
            | Self::JoinConnected { at, .. }
            | Self::JoinSent { at, .. }
            | Self::JoinFailed { at, .. }
            | Self::Fault { at, .. }
            | Self::Unread { at, .. }
            | Self::EgressFull { at, .. }
            | Self::Register { at, .. }
            | Self::HandOff { at, .. }
            | Self::Stream { at, .. }
            | Self::Control { at, .. }
            | Self::Ended { at, .. }
            | Self::Timeout { at }
            | Self::Close { at } => *at,
        }
    }
}

/// The observation after one driver op: its answer (`null` for ops without one), the actions
/// it queued, in order, and when the machine next wants a `timeout`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriverStep {
    #[serde(deserialize_with = "required")]
    pub result: Option<String>,
    pub actions: Vec<String>,
    #[serde(deserialize_with = "required")]
    pub timeout: Option<u64>,
}

/// The machine's counters at the end of a case.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriverCounters {
    pub accepted: u64,
    pub dials_started: u64,
    pub dial_failures: u64,
    pub evictions: u64,
    pub stale_failures: u64,
    pub writers_retired: u64,
    /// Inbound connections refused at the bound (left out while 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub refused_full: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The machine's state after the last op.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriverEnd {
    pub drops: std::collections::BTreeMap<String, u64>,
    pub refusals: std::collections::BTreeMap<String, u64>,
    pub counters: DriverCounters,
    /// (peer, channel, generation), sorted by peer then channel.
    pub cache: Vec<(u8, String, u64)>,
    /// Phase by seed (decimal).
    pub joins: std::collections::BTreeMap<String, String>,
    /// This node's own host claims: (actor, generation), sorted by actor.
    pub claims: Vec<(u8, u64)>,
    /// Live telemetry subscriptions: (collector, stream, flow hex), sorted.
    pub subscriptions: Vec<(u8, String, String)>,
    /// Control verdicts above 0, by name.
    pub controls: std::collections::BTreeMap<String, u64>,
    /// The opens' dials in flight: (peer, channel, ticket, waiters), sorted by peer then
    /// channel.
    pub opening: Vec<(u8, String, u64, u64)>,
    /// Failed dials whose waiters have not all heard it: (peer, channel, ticket, waiters),
    /// sorted by peer then channel.
    pub failed_opens: Vec<(u8, String, u64, u64)>,
    /// Each peer's relay hint, sorted by peer.
    pub relays: Vec<(u8, Vec<String>)>,
}

/// A driver case.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DriverCase {
    #[serde(deserialize_with = "required")]
    pub allow: Option<Vec<u8>>,
    pub ops: Vec<DriverOp>,
    pub steps: Vec<DriverStep>,
    pub end: DriverEnd,
}

/// One event of a join to one seed (tether's own section): at `at` ms, the current attempt
/// connected, the request was written, or the attempt failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinEvent {
    pub at: u64,
    pub event: JoinEventKind,
}

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JoinEventKind {
    Connected,
    Sent,
    Failed,
}

/// The status after one event: the phase, the attempt while connecting (else `null`), and
/// when the next attempt is due if the event scheduled one (else `null`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinStep {
    pub phase: String,
    #[serde(deserialize_with = "required")]
    pub attempt: Option<u32>,
    #[serde(deserialize_with = "required")]
    pub next_at: Option<u64>,
}

/// A join case: the join starts at 0 ms.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinCase {
    pub events: Vec<JoinEvent>,
    pub steps: Vec<JoinStep>,
}

/// One op on the actor plane's routing decisions (tether's own section, docs/spec/driver.md
/// §2.4, §3.2–§3.6). Node ids and actor addresses are small integers `n` (the 32 bytes `[n; 32]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum RoutingOp {
    /// The codec registry knows `tag`.
    Know { tag: String },
    /// Gossip tagged `tag` goes to local protocol actor `to` (the tag becomes known).
    Route { tag: String, to: u8 },
    /// `actor` is hosted here.
    Host { actor: u8 },
    /// `actor` is no longer hosted here.
    Unhost { actor: u8 },
    /// A host claim arrived from peer `from` (default: `host` itself): `host` signed that it
    /// hosts `actor` at `generation` (`forged`: the signature is not the host's); `handoff`:
    /// the claim carries peer `handoff`'s consent to the move.
    Claim {
        actor: u8,
        host: u8,
        generation: u64,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        forged: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        from: Option<u8>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        handoff: Option<u8>,
    },
    /// An inbound record for `dest` tagged `tag`.
    Inbound { dest: u8, tag: String },
    /// An outbound frame to the mailbox of `peer`.
    EgressMailbox { peer: u8 },
    /// An outbound frame to the remote actor `actor`.
    EgressActor { actor: u8 },
    /// A write of a frame tagged `tag` failed.
    WriteFailed { tag: String },
}

/// The observation after one routing op, each key set by its op and `null` otherwise:
/// `inbound` is `protocol:R`, `actor:A` or `drop:<reason>`; `egress` is `peer:P` or
/// `drop:<reason>`; `send_failed` says whether the failure is reported to SWIM; `claim` is
/// `accepted`, `stale` or `forged`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingStep {
    #[serde(deserialize_with = "required")]
    pub inbound: Option<String>,
    #[serde(deserialize_with = "required")]
    pub egress: Option<String>,
    #[serde(deserialize_with = "required")]
    pub send_failed: Option<bool>,
    #[serde(deserialize_with = "required")]
    pub claim: Option<String>,
}

/// A routing case: the node's mailbox, its allow-list (`null` admits every peer), the ops,
/// one step per op, and the drops counted by reason at the end (reasons never counted are
/// absent).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingCase {
    pub mailbox: u8,
    #[serde(deserialize_with = "required")]
    pub allow: Option<Vec<u8>>,
    /// The claim authorizer: the (actor, host) pairs it allows (absent: none configured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authorize: Option<Vec<(u8, u8)>>,
    pub ops: Vec<RoutingOp>,
    pub steps: Vec<RoutingStep>,
    pub drops: std::collections::BTreeMap<String, u64>,
}

// ---------------------------------------------------------------------------------------------
// switch (tether's own section, docs/spec/switch.md)

/// One master of a switch case, attached and put through the handshake before the first op,
/// in slot order (the first master of the list fills slot 0).
///
/// - `id`: the slot's stable id (any name but `"engine"`, unique in the case).
/// - `caps`: the caps its manifest advertises, in manifest order; the identity cap
///   `cap:effect=none` is added by the handshake, so every master also serves it.
/// - `initial_credit`: the per-stream window it offers in HELLO (≥ 1); the switch offers 32 and
///   each side keeps the smaller.
/// - `identity`: `"echo"` (the identity check passes, the master is routable) or `"wrong"`
///   (its echo is wrong: attached but unhealthy, never routed to).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchMaster {
    pub id: String,
    pub caps: Vec<String>,
    pub initial_credit: u64,
    pub identity: SwitchIdentity,
}

/// How a master answers the identity check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SwitchIdentity {
    Echo,
    Wrong,
}

/// A flow frame a party sends for a request (`respond`, `continue`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SwitchFrame {
    StreamStart,
    Chunk,
    StreamEnd,
    End,
    Err,
    Log,
}

impl SwitchFrame {
    /// Whether the frame names a stream (the op's `stream` is then a string, else `null`).
    pub fn has_stream(self) -> bool {
        matches!(
            self,
            SwitchFrame::StreamStart | SwitchFrame::Chunk | SwitchFrame::StreamEnd
        )
    }

    /// The wire name of its frame type (docs/spec/switch.md §2.3).
    pub fn wire_name(self) -> &'static str {
        match self {
            SwitchFrame::StreamStart => "STREAM_START",
            SwitchFrame::Chunk => "CHUNK",
            SwitchFrame::StreamEnd => "STREAM_END",
            SwitchFrame::End => "END",
            SwitchFrame::Err => "ERR",
            SwitchFrame::Log => "LOG",
        }
    }
}

/// The cancel reason's code (docs/spec/switch.md §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SwitchCancelCode {
    Cancelled,
    Aborted,
    AbortedCollateral,
}

impl SwitchCancelCode {
    /// The code as it appears in an ERR's meta.
    pub fn as_str(self) -> &'static str {
        match self {
            SwitchCancelCode::Cancelled => "CANCELLED",
            SwitchCancelCode::Aborted => "ABORTED",
            SwitchCancelCode::AbortedCollateral => "ABORTED_COLLATERAL",
        }
    }
}

/// One op of a switch case. `from` names a master by id, or `"engine"` where the engine may
/// send; `rid` is the request id (a small integer, global: engine and peer requests share it).
///
/// - `request {rid, cap, preferred}`: the engine sends a REQ for `cap`, optionally preferring a
///   cap (`null`: none).
/// - `peer_request {from, rid, cap, parent}`: master `from` sends a REQ without XID (a peer
///   call), made on behalf of request `parent` (`null`: none; else `parent` is live and
///   routed to `from`).
/// - `respond {from, rid, frame, stream}`: master `from` sends a frame for `rid` as a
///   destination does (with the request's XID). `stream` is a string for `stream_start`,
///   `chunk` and `stream_end`, `null` otherwise.
/// - `continue {from, rid, frame, stream}`: the engine or master `from` sends a frame for `rid`
///   as an origin does (no XID): the request's input after its REQ. `err` is not an origin's
///   frame.
/// - `credit {from, rid, stream, n}`: the engine or master `from` grants `n` (1 ≤ n ≤ 2^32)
///   chunks on stream `stream` of the leg it receives (the destination credits what the origin
///   sends, the origin credits what the destination sends).
/// - `cancel {rid, code}`: the host cancels `rid` with a reason carrying `code`.
/// - `stop_feeds {rid}`: the host stops the feeds of `rid`.
/// - `close {master}`: the master's connection dies.
/// - `reattach {master}`: the master dials again with the same caps, credit and a good echo.
///
/// The runner plays the frames in order: flow frames of one sender for one request carry
/// seqs 0, 1, 2, … (an origin's continuation continues after its REQ's 0), chunks carry their
/// index within their stream, STREAM_END the number of chunks sent on the stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum SwitchOp {
    Request {
        rid: u64,
        cap: String,
        #[serde(deserialize_with = "required")]
        preferred: Option<String>,
    },
    PeerRequest {
        from: String,
        rid: u64,
        cap: String,
        #[serde(deserialize_with = "required")]
        parent: Option<u64>,
    },
    Respond {
        from: String,
        rid: u64,
        frame: SwitchFrame,
        #[serde(deserialize_with = "required")]
        stream: Option<String>,
    },
    Continue {
        from: String,
        rid: u64,
        frame: SwitchFrame,
        #[serde(deserialize_with = "required")]
        stream: Option<String>,
    },
    Credit {
        from: String,
        rid: u64,
        stream: String,
        n: u64,
    },
    Cancel {
        rid: u64,
        code: SwitchCancelCode,
    },
    StopFeeds {
        rid: u64,
    },
    Close {
        master: String,
    },
    Reattach {
        master: String,
    },
}

/// A frame the switch wrote on its own account during one op (not one it forwarded): a
/// terminal ERR, a CANCEL, a CLOSE_STREAM, or anything else core writes that the model does not
/// expect. `frame` is the wire name of its type, `code` the ERR's code (`null` for other types),
/// `seq` the sequence number it carries.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchNotice {
    pub rid: u64,
    pub to: String,
    pub frame: String,
    #[serde(deserialize_with = "required")]
    pub code: Option<String>,
    pub seq: u64,
}

/// The code of the ERR a destination's `err` op carries (the runner writes it; the model
/// reports it where it sees the frame written, as in a `credit` op's `released`).
pub const SWITCH_HANDLER_ERR_CODE: &str = "HANDLER_FAILED";

/// The observation after one switch op. Every key is present; the ones an op does not set are
/// `null` (or `[]` for the lists).
///
/// - `to`: `request`/`peer_request`: the master the REQ was routed to; `respond`/`continue`/
///   `credit`: where the frame was forwarded (`"engine"` or a master id). `null` otherwise or
///   when nothing was forwarded.
/// - `seq`: the sequence number of that routed or forwarded frame (flow frames are numbered per
///   outgoing flow 0, 1, 2, …; CREDIT is a non-flow frame and carries 0).
/// - `error`: `request`/`peer_request` refused: `"no_handler"`, `"duplicate"` (the rid is live),
///   `"bad_cap"` (the cap does not parse; engine only); for a peer request it is what the ERR
///   back to `from` says.
/// - `outcome`: frame ops: `"routed"` (live request, forwarded), `"straggler"` (the rid ended
///   within the recently-terminated ring: counted, benign), `"no_route"` (never known within
///   the ring: counted drop), `"cut"` (the sender's connection was cut), `"held"` (a CHUNK
///   past its stream's window, or a frame behind one: kept until the receiver's credit lets
///   it go, see `released`).
/// - `cut`: the violation a master was cut for by this op: `"foreign_request"` (a frame for a
///   live request it is no side of). (`"credit_violation"`, a sender holding more past its
///   windows than its byte share, needs megabytes of held chunks: no case reaches it.)
/// - `ok`: `cancel`: the rid was live and is cancelled; `stop_feeds`: the rid was live and its
///   feeds were stopped; `reattach`: the attach was accepted.
/// - `force_kill`: `cancel`: whether the CANCEL frames it wrote ask for a kill (`null` when it
///   wrote none).
/// - `ended`: the rids this op terminated, ascending.
/// - `notices`: the frames the switch wrote on its own account, sorted by (rid, to, frame).
/// - `released`: `credit`: the frames the grant let go that their sender had written past its
///   window (and held behind them), in the order written, each with the seq of its outgoing
///   flow (absent from cases written before the rule: read as `[]`).
/// - `live`: the live rids after the op, ascending.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchStep {
    #[serde(deserialize_with = "required")]
    pub to: Option<String>,
    #[serde(deserialize_with = "required")]
    pub seq: Option<u64>,
    #[serde(deserialize_with = "required")]
    pub error: Option<String>,
    #[serde(deserialize_with = "required")]
    pub outcome: Option<String>,
    #[serde(deserialize_with = "required")]
    pub cut: Option<String>,
    #[serde(deserialize_with = "required")]
    pub ok: Option<bool>,
    #[serde(deserialize_with = "required")]
    pub force_kill: Option<bool>,
    pub ended: Vec<u64>,
    pub notices: Vec<SwitchNotice>,
    #[serde(default)]
    pub released: Vec<SwitchNotice>,
    pub live: Vec<u64>,
}

/// How requests ended, by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchTerminated {
    pub end: u64,
    pub err: u64,
    pub cancelled: u64,
    pub master_died: u64,
}

/// The switch's counters after the last op: successful registrations, routing refusals for
/// want of a handler (engine and peer), cuts, no_route drops (all sites), stragglers by wire
/// frame-type name (types never counted are absent), terminations by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchCounters {
    pub registered: u64,
    pub no_handler: u64,
    pub cuts: u64,
    pub no_route: u64,
    pub stragglers: std::collections::BTreeMap<String, u64>,
    pub terminated: SwitchTerminated,
}

/// A switch case (tether's own section, docs/spec/switch.md): one switch whose
/// recently-terminated ring keeps `ring` (≥ 1) endings, the masters attached and verified in
/// slot order, the ops, one step per op, and the counters after the last op.
///
/// ```json
/// {"ring": 64,
///  "masters": [{"id": "a", "caps": ["cap:in=media:x;out=media:y"], "initial_credit": 32,
///               "identity": "echo"}],
///  "ops": [{"op": "request", "rid": 1, "cap": "cap:in=media:x;out=media:y", "preferred": null}],
///  "steps": [{"to": "a", "seq": 0, "error": null, "outcome": null, "cut": null, "ok": null,
///             "force_kill": null, "ended": [], "notices": [], "live": [1]}],
///  "counters": {"registered": 1, "no_handler": 0, "cuts": 0, "no_route": 0, "stragglers": {},
///               "terminated": {"end": 0, "err": 0, "cancelled": 0, "master_died": 0}}}
/// ```
///
/// The semantics are those of `crate::switch_model` (its module doc lists every rule and how
/// each ambiguity was resolved). Ops outside the section's domain (listed there too: a frame
/// from a closed master, a stream frame out of stream order, a peer request routed back to its
/// own origin, …) make a case malformed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchCase {
    pub ring: u64,
    pub masters: Vec<SwitchMaster>,
    pub ops: Vec<SwitchOp>,
    pub steps: Vec<SwitchStep>,
    pub counters: SwitchCounters,
}

/// Bytes as lowercase hex, how the `driver` section writes payloads and flows.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len().saturating_mul(2));
    for &byte in bytes {
        text.push(char::from(DIGITS[usize::from(byte >> 4)]));
        text.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
    text
}
