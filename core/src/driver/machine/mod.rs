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

mod claims;
mod egress;
mod joins;
mod opens;
mod state;

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
pub enum SendVerdict {
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

/// Why a dial attempt ([`Action::Dial`]) did not connect, as [`Driver::handle_dialed`] is
/// told. Each cause is retried on the same schedule and counted as a dial failure; the
/// shell traces the transport's own error beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DialFailure {
    /// No address is known for the peer, and its id is not a key to dial by.
    NoAddress,
    /// The connection attempt failed: refused, unreachable, or its handshake failed.
    Connect,
    /// The attempt did not connect within its timeout.
    TimedOut,
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

/// What an inbound stream gets: a malformed one, one nobody reads, a switch stream that was
/// not announced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamVerdict {
    /// Keep reading (the bad record was skipped), or take the stream.
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
    Send(SendVerdict),
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

answer_picks! {
    Answer<C>, C;
    /// An [`Answer::Admitted`].
    admitted: Admitted => Result<(), Refused>;
    /// An [`Answer::Cached`].
    cached: Cached => Option<Generation>;
    /// An [`Answer::Open`].
    open: Open => Result<Open<C>, Refused>;
    /// An [`Answer::Send`].
    send: Send => SendVerdict;
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

    // ----------------------------------------------------------------------------------

    fn bump(&mut self) {
        self.version = self.version.wrapping_add(1);
    }

    fn dropped(&mut self, reason: DropReason) -> SendVerdict {
        self.drops.count(reason);
        self.bump();
        SendVerdict::Dropped(reason)
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
}

#[cfg(test)]
#[path = "../machine_tests.rs"]
mod tests;
