//! The driver machine (docs/spec/driver.md §6.1: the driver's core is pumpable): every
//! decision of a node's transport, with no I/O. The shell reports what happened through
//! `handle_*` (time first) and executes what [`Driver::poll_action`] yields; it decides
//! nothing itself.
//!
//! What the machine decides:
//! - **Admission** ([`super::admit`]) on every path, both directions, counted by path.
//! - **ALPN dispatch** of accepted connections ([`Dispatch`]).
//! - **One connection cache** for every ALPN the node reuses connections on ([`Channel`]),
//!   each insert under a fresh generation; a failure or close is scoped to its generation.
//! - **Egress**: whether a frame for a peer without a queue is queued or dropped (and why),
//!   the connection each write batch goes on, what a failed write does (evict that
//!   generation only, redial, SWIM send-failure feedback).
//! - **Dials**: at most one per peer, attempts and backoff ([`super::schedule`]).
//! - **Joins**: the join schedule per seed and its status.
//! - **Idle writers**: a peer's writer that reported idle for the idle period is retired.
//! - **Malformed streams**: counted; a fatal fault stops the stream, the connection stays.
//!
//! Writers register themselves: a writer reports each batch ([`Driver::handle_batch`]) and
//! each time it runs dry ([`Driver::handle_writer_idle`]). A queue the shell keeps because a
//! frame raced the retirement reports again when it drains.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use super::admission::{admit, Direction, Path, Refusals, Refused};
use super::cache::{ConnectionCache, Eviction, Generation};
use super::directory::{
    CheckedClaim, ClaimAuthorizer, ClaimVerdict, Directory, Handoff, HostClaim, HOST_CLAIM_TAG,
};
use super::relay::RelayHints;
use super::routing::{resolve_egress, ActorAddr, DropReason, Drops, Egress, NodeId, PeerAuth};
use super::schedule::{
    dial_retry_after, Join, JoinNext, JoinStatus, DIAL_ATTEMPT_TIMEOUT, JOIN_ATTEMPT_TIMEOUT,
};
use super::subscriptions::{
    ControlVerdict, Publisher, Subscription, Subscriptions, TELEMETRY_CONTROL_TAG,
};
use crate::limits::{
    ANNOUNCE_CLAIMS_BATCH_MAX, CLAIM_GENERATION_MAX, CLAIM_GENERATION_STEP_MAX,
    DRIVER_CONN_EVENTS_QUEUED_MAX, EGRESS_IDLE_TEARDOWN_MS_DEFAULT, FAILED_OPENS_MAX,
    LOCAL_CLAIMS_MAX, QUIC_CONNECTIONS_INBOUND_MAX, RELAY_HINT_PEERS_MAX,
};
use crate::time::Time;

/// Close code of a connection refused by the allow-list.
pub const CLOSE_UNAUTHORIZED: u32 = 403;
/// Close code of a connection closed on shutdown, by `disconnect`, or for lack of an adapter.
pub const CLOSE_SHUTDOWN: u32 = 0;
/// Close code of a connection refused because the node keeps as many as it may
/// ([`Config::inbound_connections_max`]).
pub const CLOSE_FULL: u32 = 503;
/// Close code of a connection replaced in the cache by a newer one dialed the same way (the
/// peer dialed again, or this node did): the older is closed, so that a peer cannot hold
/// more than one connection of each direction per channel.
pub const CLOSE_REPLACED: u32 = 409;
/// Close code of a connection evicted because what ran over it stopped answering (a switch
/// master whose heartbeat went unechoed): HTTP's "request timeout".
pub const CLOSE_UNRESPONSIVE: u32 = 408;
/// Stop code of a stream dropped as malformed.
pub const STOP_MALFORMED: u32 = 1;
/// Stop code of an inbound stream whose local consumer went away (nothing reads it); not 0,
/// which QUIC stacks send for a stream dropped unread, so the peer can tell the decision.
pub const STOP_UNREAD: u32 = 2;

/// The ALPNs whose connections the node caches and reuses (one per peer each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Channel {
    /// The actor ALPN: frames both ways, joins.
    Actor,
    /// The telemetry ALPN.
    Telemetry,
    /// The protocol binding at this index.
    Protocol(u16),
    /// The request switch's ALPN: each stream is one switch-to-host connection.
    Switch,
    /// The substrate's ALPN: each stream is one link (either side may open one).
    Substrate,
}

impl Channel {
    /// The path its admission is counted under.
    pub fn path(self) -> Path {
        match self {
            Channel::Actor => Path::Actor,
            Channel::Telemetry => Path::Telemetry,
            Channel::Protocol(_) => Path::Protocol,
            Channel::Switch => Path::Switch,
            Channel::Substrate => Path::Substrate,
        }
    }
}

/// The ALPNs a node speaks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Alpns {
    /// The actor ALPN.
    pub actor: Vec<u8>,
    /// The telemetry ALPN.
    pub telemetry: Vec<u8>,
    /// Whether inbound telemetry is collected (a sink is installed).
    pub telemetry_collect: bool,
    /// The wire ALPN of each protocol binding, by index.
    pub protocols: Vec<Vec<u8>>,
    /// The switch ALPN, when the node hosts switch connections.
    pub switch: Option<Vec<u8>>,
    /// The substrate ALPN, when the node runs the substrate.
    pub substrate: Option<Vec<u8>>,
}

/// The machine's settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// The allow-list.
    pub auth: PeerAuth,
    /// The ALPN table.
    pub alpns: Alpns,
    /// How long a writer may sit idle before it is retired.
    pub idle_peer_timeout: Duration,
    /// Time allowed to one dial attempt.
    pub dial_attempt_timeout: Duration,
    /// Time allowed to one join attempt.
    pub join_attempt_timeout: Duration,
    /// Join waits are divided by this (≥ 1; tests shorten the schedule with it).
    pub join_delay_divisor: u32,
    /// Whether a peer id names a valid key (the shell's curve check; a pure function).
    pub valid_peer: fn(&NodeId) -> bool,
    /// Most failed dials remembered for their waiting opens ([`FAILED_OPENS_MAX`]).
    pub failed_opens_max: usize,
    /// Most peers whose relays are remembered ([`RELAY_HINT_PEERS_MAX`]).
    pub relay_hint_peers_max: usize,
    /// Most connections peers dialed kept at once ([`QUIC_CONNECTIONS_INBOUND_MAX`]).
    pub inbound_connections_max: usize,
    /// Claims announced to a peer per batch ([`ANNOUNCE_CLAIMS_BATCH_MAX`], at least 1).
    pub announce_batch: usize,
    /// The application's rule for first host claims and moves without the holder's consent
    /// (`None`: first claims are taken, such moves refused; see [`super::directory`]).
    pub claim_authorizer: Option<ClaimAuthorizer>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            auth: PeerAuth::open(),
            alpns: Alpns::default(),
            idle_peer_timeout: Duration::from_millis(EGRESS_IDLE_TEARDOWN_MS_DEFAULT),
            dial_attempt_timeout: DIAL_ATTEMPT_TIMEOUT,
            join_attempt_timeout: JOIN_ATTEMPT_TIMEOUT,
            join_delay_divisor: 1,
            valid_peer: |_| true,
            failed_opens_max: FAILED_OPENS_MAX,
            relay_hint_peers_max: RELAY_HINT_PEERS_MAX,
            inbound_connections_max: QUIC_CONNECTIONS_INBOUND_MAX,
            announce_batch: ANNOUNCE_CLAIMS_BATCH_MAX,
            claim_authorizer: None,
        }
    }
}

/// Where an accepted connection goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatch {
    /// Refused by the allow-list: close it with [`CLOSE_UNAUTHORIZED`].
    Refused(Refused),
    /// The actor plane: cached under `generation`; read its streams.
    Actor(Generation),
    /// A telemetry publisher: cached under `generation`; collect its streams.
    Telemetry(Generation),
    /// Protocol binding `index`: cached under `generation`; serve its streams.
    Protocol(u16, Generation),
    /// The request switch (this node hosts caps): cached under `generation`; each stream it
    /// accepts goes to the switch host's queue.
    Switch(Generation),
    /// The substrate: cached under `generation`; each stream it accepts is a link.
    Substrate(Generation),
    /// No adapter for this ALPN (or the node is closing): close it with [`CLOSE_SHUTDOWN`].
    NoAdapter,
    /// As many connections as [`Config::inbound_connections_max`] are kept already, none of
    /// them this peer's on this channel: close it with [`CLOSE_FULL`] (counted).
    Full,
}

impl Dispatch {
    /// How the connection is closed when it is not kept: the QUIC close code and the reason
    /// sent with it. `None` when it is kept and served.
    pub fn close(&self) -> Option<(u32, &'static [u8])> {
        match self {
            Dispatch::Refused(_) => Some((CLOSE_UNAUTHORIZED, b"unauthorized")),
            Dispatch::NoAdapter => Some((CLOSE_SHUTDOWN, b"no adapter")),
            Dispatch::Full => Some((CLOSE_FULL, b"full")),
            Dispatch::Actor(_)
            | Dispatch::Telemetry(_)
            | Dispatch::Protocol(..)
            | Dispatch::Switch(_)
            | Dispatch::Substrate(_) => None,
        }
    }
}

/// What happens to a frame sent to a peer that has no egress queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Send {
    /// Queue it (the shell starts the peer's queue and writer).
    Enqueue,
    /// Dropped, counted under this reason.
    Dropped(DropReason),
}

/// What a peer's writer writes its batch on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch<C> {
    /// The generation of `conn`.
    pub generation: Generation,
    /// The cached connection to write on.
    pub conn: C,
    /// Open a new stream on `conn` first: the writer has none on this generation (its first
    /// batch, a newer connection, or its last stream failed or was stopped).
    pub open_stream: bool,
}

/// A peer's writer as the machine knows it.
#[derive(Debug, Clone, Copy, Default)]
struct Writer {
    /// Idle since then (`None`: busy).
    idle_since: Option<Time>,
    /// Whether the batch last given to it carried a SWIM-tagged frame.
    swim: bool,
}

/// Names the dial an open ordered, for the opens that wait on it and for its end's report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DialTicket(u64);

impl DialTicket {
    /// The ticket's number (the first dial an open orders is 1).
    pub fn get(self) -> u64 {
        self.0
    }
}

impl From<u64> for DialTicket {
    /// The ticket numbered `n` (a replay names tickets by number).
    fn from(n: u64) -> Self {
        Self(n)
    }
}

/// How the dial an [`Open::Dial`] ordered ended, when it did not connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DialEnd {
    /// The dial failed: the opens waiting on it fail too ([`Open::Failed`]).
    Failed,
    /// Its caller went away before it ended: the opens waiting on it ask again, and the first
    /// of them dials.
    Abandoned,
}

/// Where a stream to a peer goes: on the cached connection, or on a fresh one the shell dials
/// (and reports with [`Driver::handle_connected`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Open<C> {
    /// Open it on this cached connection; a failure goes to [`Driver::handle_open_failed`].
    Cached(Generation, C),
    /// Dial the peer on the channel's ALPN and open it there; report the dial's end with
    /// [`Driver::handle_connected`] or [`Driver::handle_open_dial_failed`] with this ticket.
    /// A dial not connected within `timeout` has failed ([`DialEnd::Failed`]).
    Dial {
        /// The dial's ticket.
        ticket: DialTicket,
        /// Give up on the dial after this long ([`Config::dial_attempt_timeout`]).
        timeout: Duration,
    },
    /// Another open's dial to the peer on this channel is in flight: ask again with
    /// [`Driver::handle_open_waited`] once the machine's state moved, so that concurrent
    /// opens share one connection (or one failure).
    Wait(DialTicket),
    /// The dial this open waited on failed: the open fails with it (the shell reports that
    /// it waited on a dial that failed; the dial's own error went to its caller).
    Failed,
    /// The node is closing: nothing opens.
    Closed,
}

/// What a malformed inbound stream gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamVerdict {
    /// Keep reading (the bad record was skipped).
    Continue,
    /// Stop the stream with this code; the connection stays.
    Stop(u32),
}

/// The machine's answer to an input whose caller waits on it ([`Driver::poll_answer`]): where
/// an open goes, whether a frame is queued, what a writer writes on, what becomes of an
/// unreadable stream, whether an app command was taken.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Answer<C> {
    /// [`Driver::handle_admit`], [`Driver::handle_join`]: admitted, or refused and counted.
    Admitted(Result<(), Refused>),
    /// [`Driver::handle_connected`], [`Driver::handle_dialed`], [`Driver::handle_join_sent`]:
    /// the generation the connection is cached under, or `None` (a failed dial, or the node
    /// closing: the connection is closed).
    Cached(Option<Generation>),
    /// [`Driver::handle_open`], [`Driver::handle_open_waited`], [`Driver::handle_open_failed`]:
    /// where the open goes, or its refusal.
    Open(Result<Open<C>, Refused>),
    /// [`Driver::handle_send`]: queue the frame, or it was dropped.
    Send(Send),
    /// [`Driver::handle_batch`]: the connection to write the batch on, or `None` (dropped).
    Batch(Option<Batch<C>>),
    /// [`Driver::handle_stream_fault`], [`Driver::handle_stream_unread`].
    Stream(StreamVerdict),
    /// [`Driver::handle_register`], [`Driver::handle_hand_off`].
    Registered(Result<(), RegisterError>),
    /// [`Driver::handle_telemetry_control`].
    Control(Option<ControlVerdict>),
    /// [`Driver::handle_claim`], [`Driver::handle_checked_claim`].
    Claim(ClaimVerdict),
    /// [`Driver::handle_send_to_actor`]: the peer hosting the actor, or why the frame was
    /// dropped.
    Route(Result<NodeId, DropReason>),
}

/// Takes the one kind of answer an input gives out of an [`Answer`] (`None` for another kind).
macro_rules! answer_of {
    ($($(#[$doc:meta])* $name:ident: $variant:ident => $ty:ty;)*) => {
        impl<C> Answer<C> {
            $(
                $(#[$doc])*
                pub fn $name(self) -> Option<$ty> {
                    match self {
                        Answer::$variant(answer) => Some(answer),
                        _ => None,
                    }
                }
            )*
        }
    };
}

answer_of! {
    /// An [`Answer::Admitted`].
    admitted: Admitted => Result<(), Refused>;
    /// An [`Answer::Cached`].
    cached: Cached => Option<Generation>;
    /// An [`Answer::Open`].
    open: Open => Result<Open<C>, Refused>;
    /// An [`Answer::Send`].
    send: Send => Send;
    /// An [`Answer::Batch`].
    batch: Batch => Option<Batch<C>>;
    /// An [`Answer::Stream`].
    stream: Stream => StreamVerdict;
    /// An [`Answer::Registered`].
    registered: Registered => Result<(), RegisterError>;
    /// An [`Answer::Control`].
    control: Control => Option<ControlVerdict>;
    /// An [`Answer::Claim`].
    claim: Claim => ClaimVerdict;
    /// An [`Answer::Route`].
    route: Route => Result<NodeId, DropReason>;
}

/// What the shell must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action<C> {
    /// Dial `peer` on the actor ALPN; report with [`Driver::handle_dialed`].
    Dial {
        /// The peer.
        peer: NodeId,
        /// 1-based.
        attempt: u32,
        /// Give up on the attempt after this long.
        timeout: Duration,
    },
    /// Connect to join seed `peer` and write a `JoinRequest` to its mailbox; report with
    /// [`Driver::handle_join_connected`], then `_sent` or `_failed`.
    JoinAttempt {
        /// The seed.
        peer: NodeId,
        /// 1-based.
        attempt: u32,
        /// Give up on the attempt after this long.
        timeout: Duration,
    },
    /// A new actor connection to `peer`: its writer should look again.
    KickWriter {
        /// The peer.
        peer: NodeId,
    },
    /// Retire `peer`'s writer and queue, unless a frame is queued (then the writer reports
    /// again when it drains).
    RetireWriter {
        /// The peer.
        peer: NodeId,
    },
    /// Tell the SWIM actor its frame to `peer` was not written (`SendFailed { to }`).
    SendFailed {
        /// The peer.
        peer: NodeId,
    },
    /// Send this node's host claim to `peer`'s mailbox (tagged
    /// [`super::directory::HOST_CLAIM_TAG`], payload [`HostClaim::encode`]).
    Announce {
        /// The peer.
        peer: NodeId,
        /// The claim.
        claim: HostClaim,
    },
    /// Start publishing local telemetry stream `stream` to `collector` as flow `flow_id`:
    /// dial it on the telemetry ALPN, write the header, then events; report the end with
    /// [`Driver::handle_publisher_ended`].
    StartPublisher {
        /// The collector.
        collector: NodeId,
        /// The local stream.
        stream: String,
        /// The flow.
        flow_id: [u8; 16],
        /// This publisher's number (its end is reported with it).
        publisher: Publisher,
    },
    /// Stop that publisher (it ends its stream; its end is reported all the same).
    StopPublisher {
        /// The collector.
        collector: NodeId,
        /// The local stream.
        stream: String,
        /// The flow.
        flow_id: [u8; 16],
        /// The publisher's number.
        publisher: Publisher,
    },
    /// Close this connection with `code`.
    Close {
        /// The connection.
        conn: C,
        /// The close code.
        code: u32,
    },
    /// An accepted connection from `peer` goes where `dispatch` says (closed with
    /// [`Dispatch::close`] when it is not kept): the answer to [`Driver::handle_accepted`].
    Dispatch {
        /// The peer that connected.
        peer: NodeId,
        /// The connection.
        conn: C,
        /// Where it goes.
        dispatch: Dispatch,
    },
}

/// What happened to a cached connection, for operators (the shell reports these as the
/// `node.conn.ready` and `node.conn.ended` events and their counters): the machine names the
/// cause; no decision depends on them. Polled with [`Driver::poll_conn_event`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnEvent {
    /// A connection was cached under a new generation.
    Ready {
        /// The peer.
        peer: NodeId,
        /// The channel.
        channel: Channel,
        /// Its generation.
        generation: Generation,
        /// Whether the peer dialed it.
        inbound: bool,
    },
    /// A cached connection left the cache.
    Ended {
        /// The peer.
        peer: NodeId,
        /// The channel.
        channel: Channel,
        /// Its generation.
        generation: Generation,
        /// Why.
        cause: ConnEndCause,
    },
}

/// Why a cached connection left the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConnEndCause {
    /// Its reader saw it close (the peer closed it, or the transport gave up on it).
    Closed,
    /// A write on it failed.
    WriteFailed,
    /// A stream could not be opened on it (in time).
    OpenFailed,
    /// What ran over it stopped answering (a liveness cut; closed [`CLOSE_UNRESPONSIVE`]).
    Unresponsive,
    /// A newer connection to the peer took its place.
    Replaced,
    /// The application disconnected the peer.
    Disconnected,
    /// The node closed.
    Shutdown,
}

impl ConnEndCause {
    /// Its name in events and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            ConnEndCause::Closed => "closed",
            ConnEndCause::WriteFailed => "write_failed",
            ConnEndCause::OpenFailed => "open_failed",
            ConnEndCause::Unresponsive => "unresponsive",
            ConnEndCause::Replaced => "replaced",
            ConnEndCause::Disconnected => "disconnected",
            ConnEndCause::Shutdown => "shutdown",
        }
    }
}

/// Counters the machine keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    /// Connections admitted (inbound).
    pub accepted: u64,
    /// Background dials started.
    pub dials_started: u64,
    /// Dial attempts that failed.
    pub dial_failures: u64,
    /// Current generations evicted after a write failure or a liveness cut.
    pub evictions: u64,
    /// Failures reported for a generation already replaced.
    pub stale_failures: u64,
    /// Writers retired after sitting idle.
    pub writers_retired: u64,
    /// Inbound connections refused at [`Config::inbound_connections_max`].
    pub refused_full: u64,
}

/// A dial an open ordered, and how many opens wait on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Opening {
    ticket: DialTicket,
    waiters: u64,
}

/// A dial in progress: an attempt in flight, or waiting to start one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DialState {
    InFlight(u32),
    Waiting(u32, Time),
}

/// A join to one seed.
#[derive(Debug, Clone)]
struct JoinState {
    join: Join,
    /// The attempt in flight, or the one waiting for its time.
    next: JoinStep,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JoinStep {
    InFlight(u32),
    Waiting(u32, Time),
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    Dial(NodeId),
    Join(NodeId),
    Idle(NodeId),
}

/// Why a local claim was not registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// The claim's signature is not its host's.
    #[error("the claim is not signed by its host")]
    BadSignature,
    /// Not newer than the claim this node holds for the actor.
    #[error("a claim of this generation or newer is already held")]
    Stale,
    /// [`LOCAL_CLAIMS_MAX`] actors are registered already.
    #[error("too many local claims")]
    Full,
    /// A generation past [`CLAIM_GENERATION_MAX`], or more than [`CLAIM_GENERATION_STEP_MAX`]
    /// past the one held (peers would refuse it).
    #[error("the generation jumps too far")]
    Jump,
    /// A handoff of an actor this node does not host.
    #[error("this node does not host the actor")]
    NotHosted,
}

/// A record the driver owns ([`super::Inbound::Driver`]), its signatures checked: built by
/// [`DriverRecord::check`], a pure function the shell calls before it takes the node's lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DriverRecord<'a> {
    /// A host claim.
    Claim(CheckedClaim),
    /// A telemetry subscription control.
    Control(&'a [u8]),
    /// Any other tag: ignored.
    Other,
}

impl<'a> DriverRecord<'a> {
    /// Sorts a record by tag and checks a claim's signatures.
    pub fn check(tag: &str, payload: &'a [u8]) -> Self {
        if tag == HOST_CLAIM_TAG {
            Self::Claim(CheckedClaim::check(payload))
        } else if tag == TELEMETRY_CONTROL_TAG {
            Self::Control(payload)
        } else {
            Self::Other
        }
    }
}

/// The driver of one node. `C` is the shell's connection handle.
#[derive(Debug)]
pub struct Driver<C> {
    config: Config,
    /// The route view and location cache, fed by verified claims.
    directory: Directory,
    /// Claims this node signed for its own actors, announced to every actor peer.
    local_claims: BTreeMap<ActorAddr, HostClaim>,
    /// Peers learning this node's claims batch by batch: the last actor announced (`None`:
    /// none yet). The next batch follows when the peer's writer goes idle.
    announcing: BTreeMap<NodeId, Option<ActorAddr>>,
    /// Local telemetry streams and the collectors subscribed to them.
    subscriptions: Subscriptions,
    cache: ConnectionCache<(NodeId, Channel), C>,
    dials: BTreeMap<NodeId, DialState>,
    /// Dials for opens in flight (at most one per peer and channel), with their waiters.
    opening: BTreeMap<(NodeId, Channel), Opening>,
    /// Dials for opens that failed while opens waited on them, with the waiters that have not
    /// asked again yet (at most [`Config::failed_opens_max`]).
    failed_opens: BTreeMap<(NodeId, Channel), Opening>,
    /// The last ticket given to a dial.
    tickets: u64,
    joins: BTreeMap<NodeId, JoinState>,
    /// Writers that reported: when each went idle, and whether its last batch carried SWIM.
    writers: BTreeMap<NodeId, Writer>,
    timers: BTreeSet<(Time, Timer)>,
    relay_hints: RelayHints,
    actions: VecDeque<Action<C>>,
    conn_events: VecDeque<ConnEvent>,
    /// The answer to the input just handled, until [`Driver::poll_answer`] takes it.
    answer: Option<Answer<C>>,
    conn_events_dropped: u64,
    drops: Drops,
    refusals: Refusals,
    counters: Counters,
    version: u64,
    closed: bool,
}

/// Whether a claim at `generation` jumps too far past `held` (or past the ceiling).
fn jumps(held: Option<u64>, generation: u64) -> bool {
    generation > CLAIM_GENERATION_MAX
        || held.is_some_and(|held| generation.saturating_sub(held) > CLAIM_GENERATION_STEP_MAX)
}

impl<C: Clone> Driver<C> {
    /// A driver with `config`.
    pub fn new(config: Config) -> Self {
        let relay_hints = RelayHints::with_bound(config.relay_hint_peers_max);
        let directory = Directory::new(config.claim_authorizer.clone());
        Self {
            config,
            directory,
            local_claims: BTreeMap::new(),
            announcing: BTreeMap::new(),
            subscriptions: Subscriptions::default(),
            cache: ConnectionCache::new(),
            dials: BTreeMap::new(),
            opening: BTreeMap::new(),
            failed_opens: BTreeMap::new(),
            tickets: 0,
            joins: BTreeMap::new(),
            writers: BTreeMap::new(),
            timers: BTreeSet::new(),
            relay_hints,
            actions: VecDeque::new(),
            conn_events: VecDeque::new(),
            answer: None,
            conn_events_dropped: 0,
            drops: Drops::default(),
            refusals: Refusals::default(),
            counters: Counters::default(),
            version: 0,
            closed: false,
        }
    }

    // ----------------------------------------------------------------------------------
    // Outputs

    /// The next thing to do.
    pub fn poll_action(&mut self) -> Option<Action<C>> {
        self.actions.pop_front()
    }

    /// The answer to the input just handled, for the inputs a caller waits on (each says which
    /// [`Answer`] it gives); `None` after any other input. Poll it before the next input: the
    /// next one's answer replaces it.
    pub fn poll_answer(&mut self) -> Option<Answer<C>> {
        self.answer.take()
    }

    /// The next connection event to report.
    pub fn poll_conn_event(&mut self) -> Option<ConnEvent> {
        self.conn_events.pop_front()
    }

    /// Connection events dropped unpolled past [`DRIVER_CONN_EVENTS_QUEUED_MAX`].
    pub fn conn_events_dropped(&self) -> u64 {
        self.conn_events_dropped
    }

    fn conn_event(&mut self, event: ConnEvent) {
        if self.conn_events.len() >= DRIVER_CONN_EVENTS_QUEUED_MAX {
            self.conn_events.pop_front();
            self.conn_events_dropped += 1;
        }
        self.conn_events.push_back(event);
    }

    fn conn_ended(
        &mut self,
        peer: NodeId,
        channel: Channel,
        generation: Generation,
        cause: ConnEndCause,
    ) {
        self.conn_event(ConnEvent::Ended {
            peer,
            channel,
            generation,
            cause,
        });
    }

    /// When [`Driver::handle_timeout`] is next due.
    pub fn poll_timeout(&self) -> Option<Time> {
        self.timers.first().map(|(at, _)| *at)
    }

    // ----------------------------------------------------------------------------------
    // Inputs

    /// The allow-list check of `path` alone (a path whose other decisions are not the
    /// machine's: the substrate's peer book); counted when refused.
    ///
    /// Answered by [`Answer::Admitted`] ([`Driver::poll_answer`]).
    pub fn handle_admit(&mut self, now: Time, peer: &NodeId, path: Path, direction: Direction) {
        let answer = self.answer_admit(now, peer, path, direction);
        self.answer = Some(Answer::Admitted(answer));
    }

    /// What [`Driver::handle_admit`] answers.
    fn answer_admit(
        &mut self,
        _now: Time,
        peer: &NodeId,
        path: Path,
        direction: Direction,
    ) -> Result<(), Refused> {
        admit(&self.config.auth, peer, path, direction).inspect_err(|refused| {
            self.refusals.count(*refused);
            self.bump();
        })
    }

    /// A connection was accepted from `peer` on `alpn`: where it goes is the
    /// [`Action::Dispatch`] it queues (after whatever caching it displaced queued).
    pub fn handle_accepted(&mut self, now: Time, peer: NodeId, alpn: &[u8], conn: C) {
        let dispatch = self.dispatch(now, peer, alpn, conn.clone());
        self.actions.push_back(Action::Dispatch {
            peer,
            conn,
            dispatch,
        });
    }

    /// Takes the [`Action::Dispatch`] an accept queued out of the actions (the rest stay in
    /// order): for harnesses and tests that follow an accept's answer at once.
    #[cfg(any(test, feature = "harness"))]
    pub fn take_dispatch(&mut self) -> Option<Dispatch> {
        let at = self
            .actions
            .iter()
            .position(|action| matches!(action, Action::Dispatch { .. }))?;
        match self.actions.remove(at)? {
            Action::Dispatch { dispatch, .. } => Some(dispatch),
            _ => None,
        }
    }

    fn dispatch(&mut self, now: Time, peer: NodeId, alpn: &[u8], conn: C) -> Dispatch {
        let (path, channel) = self.classify(alpn);
        if let Err(refused) = self.answer_admit(now, &peer, path, Direction::Inbound) {
            return Dispatch::Refused(refused);
        }
        if self.closed {
            return Dispatch::NoAdapter;
        }
        // A connection from a new (peer, channel) past the bound; one that replaces the
        // pair's entry adds nothing.
        let fresh = channel.is_some_and(|channel| !self.cache.contains(&(peer, channel)));
        if fresh && self.cache.inbound() >= self.config.inbound_connections_max {
            self.counters.refused_full += 1;
            self.bump();
            return Dispatch::Full;
        }
        self.counters.accepted += 1;
        self.bump();
        match (path, channel) {
            (Path::Actor, _) => Dispatch::Actor(self.cache(peer, Channel::Actor, conn, true)),
            (Path::Telemetry, Some(channel)) => {
                Dispatch::Telemetry(self.cache(peer, channel, conn, true))
            }
            (Path::Protocol, Some(channel @ Channel::Protocol(index))) => {
                Dispatch::Protocol(index, self.cache(peer, channel, conn, true))
            }
            (Path::Switch, Some(channel)) => {
                Dispatch::Switch(self.cache(peer, channel, conn, true))
            }
            (Path::Substrate, Some(channel)) => {
                Dispatch::Substrate(self.cache(peer, channel, conn, true))
            }
            _ => Dispatch::NoAdapter,
        }
    }

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
    fn answer_connected(
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
    fn answer_open(
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
    fn answer_open_waited(
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
    fn forget_waiter(&mut self, key: (NodeId, Channel), ticket: DialTicket) {
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
    fn open_on(&mut self, peer: NodeId, channel: Channel) -> Open<C> {
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
    fn answer_open_failed(
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

    fn open_failed(&mut self, peer: NodeId, channel: Channel, generation: Generation) {
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

    /// A frame for `peer`, which has no egress queue (a peer with a queue was admitted when
    /// its queue started; the allow-list is fixed for the node's life).
    ///
    /// Answered by [`Answer::Send`] ([`Driver::poll_answer`]).
    pub fn handle_send(&mut self, now: Time, peer: NodeId) {
        let answer = self.answer_send(now, peer);
        self.answer = Some(Answer::Send(answer));
    }

    /// What [`Driver::handle_send`] answers.
    fn answer_send(&mut self, now: Time, peer: NodeId) -> Send {
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
            return Send::Enqueue;
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
    fn answer_batch(
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
    fn answer_stream_fault(
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
    fn answer_stream_unread(
        &mut self,
        _now: Time,
        _peer: NodeId,
        _channel: Channel,
    ) -> StreamVerdict {
        StreamVerdict::Stop(STOP_UNREAD)
    }

    /// Inbound records dropped by routing (core's `Routes`), counted.
    pub fn handle_inbound_drop(&mut self, _now: Time, reason: DropReason) {
        self.drops.count(reason);
    }

    /// Frames dropped because `peer`'s queue was full.
    pub fn handle_egress_full(&mut self, _now: Time, frames: u64) {
        self.drops.add(DropReason::EgressFull, frames);
    }

    /// Dial attempt to `peer` ended: connected (cached; the returned generation) or failed.
    ///
    /// Answered by [`Answer::Cached`] ([`Driver::poll_answer`]).
    pub fn handle_dialed(&mut self, now: Time, peer: NodeId, result: Result<C, String>) {
        let answer = self.answer_dialed(now, peer, result);
        self.answer = Some(Answer::Cached(answer));
    }

    /// What [`Driver::handle_dialed`] answers.
    fn answer_dialed(
        &mut self,
        now: Time,
        peer: NodeId,
        result: Result<C, String>,
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
    fn answer_join(
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
    fn answer_join_sent(&mut self, now: Time, peer: NodeId, conn: C) -> Option<Generation> {
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

    /// This node hosts `claim.actor` (a claim it signed with its key; a [`Handoff`] it
    /// carries is the previous holder's consent): the claim is announced to every peer with an
    /// actor connection now, and to every peer connected later.
    ///
    /// Answered by [`Answer::Registered`] ([`Driver::poll_answer`]).
    pub fn handle_register(&mut self, now: Time, claim: HostClaim) {
        let answer = self.answer_register(now, claim);
        self.answer = Some(Answer::Registered(answer));
    }

    /// What [`Driver::handle_register`] answers.
    fn answer_register(&mut self, _now: Time, claim: HostClaim) -> Result<(), RegisterError> {
        if !claim.verify() {
            return Err(RegisterError::BadSignature);
        }
        let held = self.local_claims.get(&claim.actor).map(|c| c.generation);
        match held {
            Some(held) if held >= claim.generation => return Err(RegisterError::Stale),
            None if self.local_claims.len() >= LOCAL_CLAIMS_MAX => return Err(RegisterError::Full),
            _ => {}
        }
        if jumps(held, claim.generation) {
            return Err(RegisterError::Jump);
        }
        self.local_claims.insert(claim.actor, claim);
        self.directory.apply_local(&claim);
        let peers: Vec<NodeId> = self
            .cache
            .generations()
            .filter(|((_, channel), _)| *channel == Channel::Actor)
            .map(|((peer, _), _)| *peer)
            .collect();
        for peer in peers {
            self.actions.push_back(Action::Announce { peer, claim });
        }
        self.bump();
        Ok(())
    }

    /// This node consents (`handoff`, signed with its key) that `actor`, which it hosts, move
    /// to `to` at `generation`: it hosts the actor no more (nothing more is announced for it)
    /// and its own route names `to`. `to` registers the actor with the handoff attached; peers
    /// that hold this node's route take it.
    ///
    /// Answered by [`Answer::Registered`] ([`Driver::poll_answer`]).
    pub fn handle_hand_off(
        &mut self,
        now: Time,
        actor: ActorAddr,
        to: NodeId,
        generation: u64,
        handoff: Handoff,
    ) {
        let answer = self.answer_hand_off(now, actor, to, generation, handoff);
        self.answer = Some(Answer::Registered(answer));
    }

    /// What [`Driver::handle_hand_off`] answers.
    fn answer_hand_off(
        &mut self,
        _now: Time,
        actor: ActorAddr,
        to: NodeId,
        generation: u64,
        handoff: Handoff,
    ) -> Result<(), RegisterError> {
        let Some(held) = self.local_claims.get(&actor) else {
            return Err(RegisterError::NotHosted);
        };
        if handoff.from != held.host || !handoff.verify(&actor, &to, generation) {
            return Err(RegisterError::BadSignature);
        }
        if generation <= held.generation {
            return Err(RegisterError::Stale);
        }
        if jumps(Some(held.generation), generation) {
            return Err(RegisterError::Jump);
        }
        self.local_claims.remove(&actor);
        self.directory.hand_off(actor, to, generation);
        self.bump();
        Ok(())
    }

    /// A record the driver owns arrived from `peer` (routing said
    /// [`super::Inbound::Driver`]): a host claim or a telemetry subscription control.
    pub fn handle_record(&mut self, now: Time, peer: NodeId, tag: &str, payload: &[u8]) {
        self.handle_checked_record(now, peer, DriverRecord::check(tag, payload));
    }

    /// [`Driver::handle_record`] on a record the shell checked before taking its lock.
    pub fn handle_checked_record(&mut self, now: Time, peer: NodeId, record: DriverRecord<'_>) {
        match record {
            DriverRecord::Claim(claim) => {
                self.answer_checked_claim(now, peer, claim);
            }
            DriverRecord::Control(payload) => {
                self.answer_telemetry_control(now, peer, payload);
            }
            DriverRecord::Other => {}
        }
    }

    /// This node publishes telemetry stream `name` (collectors may subscribe to it).
    pub fn handle_telemetry_stream(&mut self, _now: Time, name: &str) {
        self.subscriptions.add_stream(name);
    }

    /// A subscription control record from `collector`: a publisher starts or stops. The
    /// collector must be admitted on the telemetry path (the publisher dials it).
    ///
    /// Answered by [`Answer::Control`] ([`Driver::poll_answer`]).
    pub fn handle_telemetry_control(&mut self, now: Time, collector: NodeId, payload: &[u8]) {
        let answer = self.answer_telemetry_control(now, collector, payload);
        self.answer = Some(Answer::Control(answer));
    }

    /// What [`Driver::handle_telemetry_control`] answers.
    fn answer_telemetry_control(
        &mut self,
        now: Time,
        collector: NodeId,
        payload: &[u8],
    ) -> Option<ControlVerdict> {
        self.answer_admit(now, &collector, Path::Telemetry, Direction::Outbound)
            .ok()?;
        let (verdict, subscription) = self.subscriptions.apply(collector, payload);
        if let Some(((collector, stream, flow_id), publisher)) = subscription {
            self.actions.push_back(match verdict {
                ControlVerdict::Started => Action::StartPublisher {
                    collector,
                    stream,
                    flow_id,
                    publisher,
                },
                _ => Action::StopPublisher {
                    collector,
                    stream,
                    flow_id,
                    publisher,
                },
            });
        }
        self.bump();
        Some(verdict)
    }

    /// Publisher `publisher` of `subscription` ended (stopped, or its collector went away):
    /// the subscription is gone, unless it was stopped and started again under a newer
    /// publisher meanwhile (which goes on).
    pub fn handle_publisher_ended(
        &mut self,
        _now: Time,
        subscription: &Subscription,
        publisher: Publisher,
    ) {
        if self.subscriptions.ended(subscription, publisher) {
            self.bump();
        }
    }

    /// A host claim arrived from `peer` (the payload of a record tagged
    /// [`super::directory::HOST_CLAIM_TAG`] to this node's mailbox): the ownership rule of
    /// [`super::directory`] says whether it is taken.
    ///
    /// Answered by [`Answer::Claim`] ([`Driver::poll_answer`]).
    pub fn handle_claim(&mut self, now: Time, peer: NodeId, bytes: &[u8]) {
        let answer = self.answer_claim(now, peer, bytes);
        self.answer = Some(Answer::Claim(answer));
    }

    /// What [`Driver::handle_claim`] answers.
    fn answer_claim(&mut self, now: Time, peer: NodeId, bytes: &[u8]) -> ClaimVerdict {
        self.answer_checked_claim(now, peer, CheckedClaim::check(bytes))
    }

    /// [`Driver::handle_claim`] on claim bytes the shell checked before taking its lock.
    ///
    /// Answered by [`Answer::Claim`] ([`Driver::poll_answer`]).
    pub fn handle_checked_claim(&mut self, now: Time, peer: NodeId, claim: CheckedClaim) {
        let answer = self.answer_checked_claim(now, peer, claim);
        self.answer = Some(Answer::Claim(answer));
    }

    /// What [`Driver::handle_checked_claim`] answers.
    fn answer_checked_claim(
        &mut self,
        _now: Time,
        peer: NodeId,
        claim: CheckedClaim,
    ) -> ClaimVerdict {
        let verdict = self.directory.apply_checked(&peer, claim);
        // Every verdict is counted, so every one is a change.
        self.bump();
        verdict
    }

    /// Where a frame for `actor` (hosted elsewhere) goes: the peer the route view names
    /// (through the location cache), admitted; else dropped, counted (`no_route` or
    /// `unauthorized`).
    ///
    /// Answered by [`Answer::Route`] ([`Driver::poll_answer`]).
    pub fn handle_send_to_actor(&mut self, now: Time, actor: ActorAddr) {
        let answer = self.answer_send_to_actor(now, actor);
        self.answer = Some(Answer::Route(answer));
    }

    /// What [`Driver::handle_send_to_actor`] answers.
    fn answer_send_to_actor(&mut self, _now: Time, actor: ActorAddr) -> Result<NodeId, DropReason> {
        let directory = &mut self.directory;
        let resolved = resolve_egress(
            Egress::Actor(actor),
            |a| directory.locate(a),
            &self.config.auth,
        );
        if let Err(reason) = resolved {
            if reason == DropReason::Unauthorized {
                self.refusals.count(Refused {
                    path: Path::Actor,
                    direction: Direction::Outbound,
                });
            }
            self.dropped(reason);
        }
        resolved
    }

    /// Time passed: due dial retries, join attempts and idle retirements happen.
    pub fn handle_timeout(&mut self, now: Time) {
        while let Some(&(at, timer)) = self.timers.first() {
            if at > now {
                break;
            }
            self.timers.remove(&(at, timer));
            match timer {
                Timer::Dial(peer) => {
                    if let Some(DialState::Waiting(attempt, due)) = self.dials.get(&peer).copied() {
                        if due == at {
                            self.start_dial_attempt(peer, attempt);
                        }
                    }
                }
                Timer::Join(peer) => {
                    let Some(state) = self.joins.get_mut(&peer) else {
                        continue;
                    };
                    if let JoinStep::Waiting(attempt, due) = state.next {
                        if due == at {
                            state.next = JoinStep::InFlight(attempt);
                            self.actions.push_back(Action::JoinAttempt {
                                peer,
                                attempt,
                                timeout: self.config.join_attempt_timeout,
                            });
                        }
                    }
                }
                Timer::Idle(peer) => {
                    let idle = self.config.idle_peer_timeout;
                    let due = self
                        .writers
                        .get(&peer)
                        .and_then(|writer| writer.idle_since)
                        .map(|since| since.saturating_add(idle));
                    if due == Some(at) {
                        self.writers.remove(&peer);
                        self.counters.writers_retired += 1;
                        self.actions.push_back(Action::RetireWriter { peer });
                        self.bump();
                    }
                }
            }
        }
    }

    /// The node closes: every cached connection is closed, nothing new starts.
    pub fn handle_close(&mut self, _now: Time) {
        self.closed = true;
        self.timers.clear();
        self.dials.clear();
        self.announcing.clear();
        self.opening.clear();
        self.failed_opens.clear();
        for ((peer, channel), entry) in self.cache.take_all() {
            self.conn_ended(peer, channel, entry.generation, ConnEndCause::Shutdown);
            self.actions.push_back(Action::Close {
                conn: entry.conn,
                code: CLOSE_SHUTDOWN,
            });
        }
        for state in self.joins.values_mut() {
            state.next = JoinStep::Done;
        }
        self.writers.clear();
        self.bump();
    }

    // ----------------------------------------------------------------------------------
    // State

    /// Drops by reason.
    pub fn drops(&self) -> &Drops {
        &self.drops
    }

    /// Refusals by path and direction.
    pub fn refusals(&self) -> &Refusals {
        &self.refusals
    }

    /// The counters.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Bumped whenever connection state moves (cache, dials, an open's dial ending, joins,
    /// drops, refusals): the shell waits on it (an [`Open::Wait`] asks again then).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Every cached connection: (peer, channel, generation).
    pub fn connections(&self) -> impl Iterator<Item = (NodeId, Channel, Generation)> + '_ {
        self.cache
            .generations()
            .map(|((peer, channel), generation)| (*peer, *channel, generation))
    }

    /// Each join's status, by seed.
    pub fn join_statuses(&self) -> impl Iterator<Item = (&NodeId, &JoinStatus)> {
        self.joins
            .iter()
            .map(|(peer, state)| (peer, state.join.status()))
    }

    /// Whether a dial to `peer` is in progress (in flight or waiting to retry).
    pub fn is_dialing(&self, peer: &NodeId) -> bool {
        self.dials.contains_key(peer)
    }

    /// Writers the machine knows of (reported a batch or idleness, not retired).
    pub fn writers(&self) -> usize {
        self.writers.len()
    }

    /// The relays to reach `peer` by: those `given`, or else the last seen.
    pub fn relays_for(&self, peer: &NodeId, given: &[String]) -> Vec<String> {
        self.relay_hints.normalize(peer, given)
    }

    /// Every peer with a relay hint and the relays last seen for it, by peer.
    pub fn relay_hints(&self) -> impl Iterator<Item = (&NodeId, &[String])> {
        self.relay_hints.iter()
    }

    /// Where the route view sends `actor`'s frames: the host and generation of the newest
    /// valid claim received (or registered here).
    pub fn route(&self, actor: &ActorAddr) -> Option<super::directory::Route> {
        self.directory.route(actor)
    }

    /// Actors in the route view.
    pub fn directory_route_count(&self) -> usize {
        self.directory.route_count()
    }

    /// Locations cached for egress.
    pub fn location_cache_entries(&self) -> usize {
        self.directory.location_cache_entries()
    }

    /// Live telemetry subscriptions this node publishes to.
    pub fn telemetry_subscriptions(&self) -> usize {
        self.subscriptions.live()
    }

    /// The live telemetry subscriptions: (collector, stream, flow), in that order.
    pub fn subscriptions(&self) -> impl Iterator<Item = &Subscription> {
        self.subscriptions.iter()
    }

    /// The live telemetry subscriptions with the number of the publisher started for each.
    pub fn publishers(&self) -> impl Iterator<Item = (&Subscription, Publisher)> {
        self.subscriptions.publishers()
    }

    /// This node's own host claims, by actor.
    pub fn local_claims(&self) -> impl Iterator<Item = &HostClaim> {
        self.local_claims.values()
    }

    /// Subscription control records by verdict.
    pub fn control_verdicts(&self) -> &BTreeMap<ControlVerdict, u64> {
        self.subscriptions.verdicts()
    }

    /// Received claims by verdict.
    pub fn claim_verdicts(&self) -> &BTreeMap<ClaimVerdict, u64> {
        self.directory.verdicts()
    }

    /// The opens' dials in flight: peer, channel, ticket and the opens waiting on it.
    pub fn opening(&self) -> impl Iterator<Item = (NodeId, Channel, DialTicket, u64)> + '_ {
        self.opening
            .iter()
            .map(|((peer, channel), opening)| (*peer, *channel, opening.ticket, opening.waiters))
    }

    /// Failed dials whose waiting opens have not all heard it: peer, channel, ticket and the
    /// waiters still to ask.
    pub fn failed_opens(&self) -> impl Iterator<Item = (NodeId, Channel, DialTicket, u64)> + '_ {
        self.failed_opens
            .iter()
            .map(|((peer, channel), failed)| (*peer, *channel, failed.ticket, failed.waiters))
    }

    /// Whether the node is closed.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    // ----------------------------------------------------------------------------------

    fn bump(&mut self) {
        self.version = self.version.wrapping_add(1);
    }

    fn dropped(&mut self, reason: DropReason) -> Send {
        self.drops.count(reason);
        self.bump();
        Send::Dropped(reason)
    }

    /// The path and cache channel of an ALPN.
    fn classify(&self, alpn: &[u8]) -> (Path, Option<Channel>) {
        let alpns = &self.config.alpns;
        if alpn == alpns.actor.as_slice() {
            (Path::Actor, Some(Channel::Actor))
        } else if alpn == alpns.telemetry.as_slice() {
            let channel = alpns.telemetry_collect.then_some(Channel::Telemetry);
            (Path::Telemetry, channel)
        } else if alpns.switch.as_deref() == Some(alpn) {
            (Path::Switch, Some(Channel::Switch))
        } else if alpns.substrate.as_deref() == Some(alpn) {
            (Path::Substrate, Some(Channel::Substrate))
        } else if let Some(index) = alpns.protocols.iter().position(|known| known == alpn) {
            let index = u16::try_from(index).ok();
            (Path::Protocol, index.map(Channel::Protocol))
        } else {
            (Path::Unknown, None)
        }
    }

    /// Caches `conn` for the pair under a new generation (`inbound`: the peer dialed it); a
    /// failure kept for the pair's waiters goes (they take this connection). A connection it
    /// replaces that was dialed the same way is closed ([`CLOSE_REPLACED`]); one dialed the
    /// other way (both sides dialed at once) is left to end on its own, so that the two sides
    /// never close each other's only connection. On `actor`, a writer waiting for a
    /// connection looks again, and the peer learns this node's actors.
    fn cache(&mut self, peer: NodeId, channel: Channel, conn: C, inbound: bool) -> Generation {
        self.bump();
        self.failed_opens.remove(&(peer, channel));
        let (generation, replaced) = self.cache.insert((peer, channel), conn, inbound);
        if let Some(old) = &replaced {
            self.conn_ended(peer, channel, old.generation, ConnEndCause::Replaced);
        }
        self.conn_event(ConnEvent::Ready {
            peer,
            channel,
            generation,
            inbound,
        });
        if let Some(old) = replaced.filter(|old| old.inbound == inbound) {
            self.actions.push_back(Action::Close {
                conn: old.conn,
                code: CLOSE_REPLACED,
            });
        }
        if channel == Channel::Actor {
            if self.writers.contains_key(&peer) {
                self.actions.push_back(Action::KickWriter { peer });
            }
            self.announcing.insert(peer, None);
            self.announce_more(peer);
        }
        generation
    }

    /// The next batch of this node's claims for `peer` (by actor, after the last announced),
    /// over its cached actor connection; a batch shorter than [`Config::announce_batch`] is
    /// the last. Nothing once the peer has no actor connection.
    fn announce_more(&mut self, peer: NodeId) {
        let Some(&after) = self.announcing.get(&peer) else {
            return;
        };
        if self.cache.peek(&(peer, Channel::Actor)).is_none() {
            self.announcing.remove(&peer);
            return;
        }
        let batch_max = self.config.announce_batch.max(1);
        let from = match after {
            None => std::ops::Bound::Unbounded,
            Some(actor) => std::ops::Bound::Excluded(actor),
        };
        let batch: Vec<HostClaim> = self
            .local_claims
            .range((from, std::ops::Bound::Unbounded))
            .take(batch_max)
            .map(|(_, claim)| *claim)
            .collect();
        match batch.last() {
            Some(last) if batch.len() == batch_max => {
                self.announcing.insert(peer, Some(last.actor));
            }
            _ => {
                self.announcing.remove(&peer);
            }
        }
        for claim in batch {
            self.actions.push_back(Action::Announce { peer, claim });
        }
    }

    /// Starts a background dial of `peer` unless one is in progress.
    fn dial(&mut self, peer: NodeId) {
        if self.dials.contains_key(&peer) || !(self.config.valid_peer)(&peer) {
            return;
        }
        self.counters.dials_started += 1;
        self.start_dial_attempt(peer, 1);
    }

    fn start_dial_attempt(&mut self, peer: NodeId, attempt: u32) {
        self.dials.insert(peer, DialState::InFlight(attempt));
        self.actions.push_back(Action::Dial {
            peer,
            attempt,
            timeout: self.config.dial_attempt_timeout,
        });
        self.bump();
    }

    fn join_in_flight(&mut self, peer: &NodeId) -> Option<&mut JoinState> {
        self.joins
            .get_mut(peer)
            .filter(|state| matches!(state.next, JoinStep::InFlight(_)))
    }

    fn join_next(&mut self, now: Time, peer: NodeId, next: JoinNext) {
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

    /// Records `peer`'s writer as busy (`None`) or idle since a time, re-arming its timer.
    fn set_writer(&mut self, _now: Time, peer: NodeId, idle_since: Option<Time>) {
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

#[cfg(test)]
#[path = "machine_tests.rs"]
mod tests;
