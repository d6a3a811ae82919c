//! One remote peer's whole life, sans-IO: its durable state being loaded, its [`PeerLink`],
//! dials and redials, commits to the store and their retries, app commands waiting for room,
//! and when the peer's work is over. A shell executes what this decides: it loads and commits
//! when asked, dials when asked, binds connections under the generation it is given, moves
//! bytes, and answers the app under the tickets it chose.
//!
//! ```text
//!   new ─▶ Loading ──(loaded)──▶ Ready ──(shutdown, settled / idle)──▶ finished
//!            │  ▲                  │
//!            └──┘ load failed:     ├─ link: Dial ─▶ handle_dialed ─▶ Bind{generation} ─▶ bytes…
//!               Load again after   │          lost ─▶ Unbind, Dial again after REDIAL backoff
//!               STORE_RETRY        └─ store: Commit ─▶ handle_committed; failed ─▶ the same
//!                                           batches again after STORE_RETRY backoff
//! ```
//!
//! The shape is the one every tether machine has (see `docs/machines.md`): inputs by
//! `handle_*`, outputs by [`Peer::poll_output`] and [`Peer::poll_transmit`] until empty, time
//! by [`Peer::poll_timeout`] and [`Peer::handle_timeout`]. Queries ([`Peer::reads_link`],
//! [`Peer::accepts_commands`], [`Peer::finished`]) tell the shell what it may wait on.
//!
//! Timers, by reason: the link's (handshake, keepalive, dead-after, retransmits), the redial
//! ([`REDIAL`]) and the store retry ([`STORE_RETRY`], for loads and commits). Counters are
//! published at most once per [`STATS_EVERY`], on the next input after it passed.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use super::finality::Code;
use super::handshake::{Channel, Negotiated, Role};
use super::link::{LinkClose, PeerLink};
use super::machine::{CommandError, Event, Machine};
use super::{Address, OpId, PeerId, PersistBatch, Seq};
use crate::limits::{
    SUBSTRATE_ADOPT_WAIT_MS, SUBSTRATE_REDIAL_BASE_MS, SUBSTRATE_REDIAL_CAP_MS,
    SUBSTRATE_REPLY_BYTES_MAX, SUBSTRATE_REPLY_PART_OVERHEAD_BYTES, SUBSTRATE_STATS_EVERY_MS,
    SUBSTRATE_STORE_RETRY_BASE_MS, SUBSTRATE_STORE_RETRY_CAP_MS, SUBSTRATE_UNCOMMITTED_BATCHES_MAX,
    SUBSTRATE_WAITING_SENDS_MAX,
};
use crate::retry::{Backoff, Jitter, Retry};
use crate::time::Time;
use crate::wire::envelope::{ObjKind, Verb};

/// When to redial a lost link (the one retry policy, [`crate::retry`]).
pub const REDIAL: Backoff = Backoff::new(
    Duration::from_millis(SUBSTRATE_REDIAL_BASE_MS),
    Duration::from_millis(SUBSTRATE_REDIAL_CAP_MS),
);

/// When to try a failing store again (a load or a commit).
pub const STORE_RETRY: Backoff = Backoff::new(
    Duration::from_millis(SUBSTRATE_STORE_RETRY_BASE_MS),
    Duration::from_millis(SUBSTRATE_STORE_RETRY_CAP_MS),
);

/// How often a peer's counters are published ([`Output::PublishStats`]).
pub const STATS_EVERY: Duration = Duration::from_millis(SUBSTRATE_STATS_EVERY_MS);

/// The shell's name for one app command, chosen by the shell; every answer to the command
/// ([`Output::Reply`]) carries it.
pub type Ticket = u64;

/// An app command for this peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Open an object.
    Open {
        /// Session or queue.
        kind: ObjKind,
        /// Its address.
        obj: String,
        /// A capability token to present.
        cap: Option<String>,
    },
    /// Send on an object.
    Send {
        /// The object.
        obj: String,
        /// The body.
        body: Bytes,
        /// Wait for outbox room (`send`) rather than fail with `QueueFull` (`try_send`).
        wait: bool,
    },
    /// Make a request on an object.
    Req {
        /// The object.
        obj: String,
        /// The body.
        body: Bytes,
        /// Wait for outbox room rather than fail with `QueueFull`.
        wait: bool,
    },
    /// Answer a request the remote made (res, end or err); always waits for room.
    Answer {
        /// The object.
        obj: Address,
        /// The request's op id.
        req_id: OpId,
        /// Res, End or Err.
        verb: Verb,
        /// The body.
        body: Option<Bytes>,
        /// The code (err).
        code: Option<String>,
    },
    /// Accept (`reject: None`) or reject an open the remote asked for.
    Decide {
        /// The object.
        obj: Address,
        /// The reject code.
        reject: Option<String>,
    },
    /// Close an object.
    Close {
        /// The object.
        obj: String,
        /// Why.
        reason: String,
    },
    /// The app is done with a delivery (no reply).
    Consume {
        /// The object.
        obj: Address,
        /// The delivery's seq.
        seq: Seq,
    },
}

impl Command {
    /// The object the command is about.
    pub fn object(&self) -> &str {
        match self {
            Command::Open { obj, .. }
            | Command::Send { obj, .. }
            | Command::Req { obj, .. }
            | Command::Close { obj, .. } => obj,
            Command::Answer { obj, .. }
            | Command::Decide { obj, .. }
            | Command::Consume { obj, .. } => obj,
        }
    }

    /// Whether a refusal for want of outbox room waits for room instead.
    fn waits_for_room(&self) -> bool {
        match self {
            Command::Send { wait, .. } | Command::Req { wait, .. } => *wait,
            Command::Answer { .. } => true,
            _ => false,
        }
    }
}

/// Why a command failed, or how an op ended without effect.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Failure {
    /// The machine refused the command (nothing changed).
    #[error(transparent)]
    Command(#[from] CommandError),
    /// The op ended without effect; the code says why.
    #[error("futile: {0}")]
    Futile(Code),
    /// The remote rejected the open, with this code.
    #[error("rejected: {0}")]
    Rejected(Code),
    /// The remote answered the request with an error code.
    #[error("remote error: {0}")]
    Remote(Code),
    /// The object was closed before the open completed, with this code.
    #[error("closed: {0}")]
    Closed(Code),
    /// The peer's durable state is not loaded (the store is failing); nothing was done.
    #[error("the peer's state cannot be loaded from the store")]
    StoreUnavailable,
    /// The peer's work ended (shutdown).
    #[error("shut down")]
    Shutdown,
    /// The app left more than this many bytes of a request's `res` parts unread (bodies plus
    /// [`SUBSTRATE_REPLY_PART_OVERHEAD_BYTES`] a part): the rest of the answer is dropped.
    #[error("the reply held more than {0} bytes unread")]
    ReplyTooLarge(usize),
}

/// An answer to the command with that ticket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Done (open accepted, answer enqueued, decision or close made).
    Done,
    /// The send is durable at the remote (hop ack): its op id.
    Sent(OpId),
    /// A `res` part of the request's answer (more follow).
    Res(Bytes),
    /// The request's answer ended, with a last body.
    End(Option<Bytes>),
    /// The command failed, or its op ended without effect. Nothing more follows.
    Failed(Failure),
}

/// Which store call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreCall {
    /// Loading a peer's durable state (the peer's links are refused until it succeeds).
    Load,
    /// Committing a peer's batches (nothing they cover is acknowledged until it succeeds).
    Commit,
}

impl StoreCall {
    /// The name in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreCall::Load => "load",
            StoreCall::Commit => "commit",
        }
    }
}

/// A store call failed (the shell keeps the error itself, to report).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreFault;

/// A dial failed (the shell keeps the error itself, to report).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DialFailed;

/// A connection the shell dialed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dialed {
    /// What the handshake binds its proof to.
    pub channel: Channel,
    /// Fresh random bytes (at least 16) for the handshake.
    pub nonce: Vec<u8>,
}

/// A peer's timers, by reason ([`Peer::timers`]); [`Peer::poll_timeout`] is the earliest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timers {
    /// The link's: handshake, keepalive, dead-after, retransmits, TTLs.
    pub link: Option<Time>,
    /// The next dial.
    pub redial: Option<Time>,
    /// The next try of a failing store (a load or a commit).
    pub store_retry: Option<Time>,
    /// The end of the wait for the inbound link a peer was started for
    /// ([`Peer::awaiting_link`]).
    pub adopt: Option<Time>,
}

/// What the shell must do, or may report.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Output {
    /// Load the peer's durable state; answer with [`Peer::handle_loaded`].
    Load,
    /// Commit these batches in one transaction; answer with [`Peer::handle_committed`]. One
    /// commit at a time: the next is asked for only after the answer.
    Commit(Arc<Vec<PersistBatch>>),
    /// Dial the peer; answer with [`Peer::handle_dialed`].
    Dial {
        /// Dials that failed in a row before this one.
        attempt: u32,
    },
    /// Bind the connection just handed in (dialed or adopted) under `generation`: its bytes
    /// and its end come back tagged with it. Any connection bound before is dropped.
    Bind {
        /// The connection's generation.
        generation: u64,
    },
    /// Drop the connection bound now (the link is down).
    Unbind,
    /// Answer the command `ticket`.
    Reply {
        /// The command's ticket.
        ticket: Ticket,
        /// The answer.
        reply: Reply,
    },
    /// Tell the app: an open the remote asked for, a delivery, or an object the remote
    /// closed ([`Event::OpenRequested`], [`Event::Delivered`], [`Event::Closed`]).
    App(Event),
    /// The link is up (its handshake verified).
    LinkUp(Negotiated),
    /// The link was dropped, and why.
    LinkDropped(LinkClose),
    /// A store call failed; `failures` in a row so far. It is retried after a backoff.
    StoreFailed {
        /// Which call.
        call: StoreCall,
        /// Failures in a row.
        failures: u32,
    },
    /// A store call succeeded after failing.
    StoreRecovered {
        /// Which call.
        call: StoreCall,
    },
    /// Publish the peer's counters ([`Peer::machine`]) now.
    PublishStats,
}

/// Who asks for a peer's work to run ([`admit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The app named the peer (it opens, sends or asks to reach it).
    App,
    /// A link from the peer finished its handshake.
    Link,
}

/// Why an inbound link starts no peer ([`admit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The node is shutting down.
    Closing,
    /// As many peers run as the node allows (`Config::max_peers`): a link may not add one.
    PeerCap,
}

impl Refusal {
    /// The name in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Closing => "closing",
            Refusal::PeerCap => "peer_cap",
        }
    }
}

/// Whether a peer's work runs, and where ([`admit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// The peer's work already runs: hand it the link or the app's reach.
    Running,
    /// Start the peer's work (its [`Peer`] loads its state first).
    Start,
    /// Start nothing; an inbound link is closed.
    Refused(Refusal),
}

/// Who runs a peer's work, asked when `origin` wants it: a peer whose work runs is handed what
/// came; the app may always start one (it named the peer, and what it asks for is bounded by
/// its own calls); a link from a peer with no work running starts one only while the node is
/// not closing and fewer than `max_peers` of the `peers` it knows run, so that peers nobody
/// named cannot grow the node without bound.
pub fn admit(
    origin: Origin,
    closing: bool,
    running: bool,
    peers: usize,
    max_peers: usize,
) -> Admission {
    match origin {
        Origin::Link if closing => Admission::Refused(Refusal::Closing),
        _ if running => Admission::Running,
        Origin::App => Admission::Start,
        Origin::Link if peers >= max_peers => Admission::Refused(Refusal::PeerCap),
        Origin::Link => Admission::Start,
    }
}

/// What a command in flight waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiter {
    /// A send: its hop ack.
    Send(Ticket),
    /// A req: its answer.
    Req(Ticket),
}

#[derive(Debug)]
enum Stage {
    Loading { retry: Retry, loading: bool },
    Ready(Box<PeerLink>),
}

/// One remote peer. See the module docs.
#[derive(Debug)]
pub struct Peer {
    id: PeerId,
    stage: Stage,
    jitter: Jitter,
    /// The app named this peer (it is kept while it has nothing to do).
    named: bool,
    /// The shell knows an address to dial.
    dialable: bool,
    generation: u64,
    /// A connection is bound.
    bound: bool,
    dialing: bool,
    redial: Retry,
    was_up: bool,
    /// Batches not handed to the store yet: they collect while a commit is in flight and go
    /// in the next one (a failed commit puts its batches back in front for the retry).
    uncommitted: Vec<PersistBatch>,
    committing: Option<Arc<Vec<PersistBatch>>>,
    store_retry: Retry,
    /// Commands waiting for room in their object's outbox, in arrival order per object.
    parked: BTreeMap<String, VecDeque<(Ticket, Command)>>,
    /// Objects whose outbox may have room again (an op left it).
    freed: BTreeSet<Address>,
    /// Sends and reqs in flight, by op id.
    waiters: BTreeMap<OpId, Waiter>,
    /// Opens in flight, by object: the open's op id and ticket.
    opens: BTreeMap<String, (OpId, Ticket)>,
    /// Bytes of `res` parts handed to the app and not read yet, by the req's ticket.
    unread: BTreeMap<Ticket, usize>,
    /// Started for an inbound link not handed in yet ([`Peer::awaiting_link`]).
    awaiting_link: bool,
    /// Once loaded: when the wait for that link ends.
    adopt_by: Option<Time>,
    stopping: bool,
    stats_due: Option<Time>,
    outputs: VecDeque<Output>,
}

impl Peer {
    /// Peer `id`: it asks for its durable state first ([`Output::Load`]). `named`:
    /// the app named it (an inbound link's peer is not); `dialable`: the shell knows an
    /// address; `seed`: entropy for the backoffs' jitter.
    pub fn new(id: PeerId, named: bool, dialable: bool, seed: u64) -> Self {
        let mut peer = Self {
            id,
            stage: Stage::Loading {
                retry: Retry::new(STORE_RETRY),
                loading: true,
            },
            jitter: Jitter::new(seed),
            named,
            dialable,
            generation: 0,
            bound: false,
            dialing: false,
            redial: Retry::new(REDIAL),
            was_up: false,
            uncommitted: Vec::new(),
            committing: None,
            store_retry: Retry::new(STORE_RETRY),
            parked: BTreeMap::new(),
            freed: BTreeSet::new(),
            waiters: BTreeMap::new(),
            opens: BTreeMap::new(),
            unread: BTreeMap::new(),
            awaiting_link: false,
            adopt_by: None,
            stopping: false,
            stats_due: None,
            outputs: VecDeque::new(),
        };
        peer.outputs.push_back(Output::Load);
        peer
    }

    /// The same peer, started for an inbound link that the shell hands in
    /// ([`Peer::handle_adopt`]) once the state is loaded: until it does, or
    /// [`SUBSTRATE_ADOPT_WAIT_MS`] after the load, the peer is not idle
    /// ([`Peer::finished`]), so it can never end between loading and the link's arrival.
    pub fn awaiting_link(mut self) -> Self {
        self.awaiting_link = true;
        self
    }

    /// The peer.
    pub fn id(&self) -> &PeerId {
        &self.id
    }

    /// The machine, once the peer's state is loaded (read only: commands go through
    /// [`Peer::handle_command`]).
    pub fn machine(&self) -> Option<&Machine> {
        match &self.stage {
            Stage::Ready(link) => Some(link.machine()),
            Stage::Loading { .. } => None,
        }
    }

    /// The link, once the peer's state is loaded.
    pub fn link(&self) -> Option<&PeerLink> {
        match &self.stage {
            Stage::Ready(link) => Some(link),
            Stage::Loading { .. } => None,
        }
    }

    /// The generation of the connection bound now (0 before the first).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The next output; `None` once drained.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// Appends the next frame for the bound connection to `out`; `false` when there is none.
    /// Ask only while the connection's writer has room: frames wait here meanwhile (bounded
    /// by the machine's windows and credit).
    pub fn poll_transmit(&mut self, out: &mut BytesMut) -> bool {
        match &mut self.stage {
            Stage::Ready(link) if self.bound => link.poll_transmit(out),
            _ => false,
        }
    }

    /// The peer's timers, by reason.
    pub fn timers(&self) -> Timers {
        let (link, load_retry) = match &self.stage {
            Stage::Ready(link) => (link.poll_timeout(), None),
            Stage::Loading { retry, .. } => (None, retry.due()),
        };
        Timers {
            link,
            redial: self.redial.due(),
            store_retry: load_retry.or(self.store_retry.due()),
            adopt: self.adopt_by,
        }
    }

    /// When [`Peer::handle_timeout`] is due.
    pub fn poll_timeout(&self) -> Option<Time> {
        let Timers {
            link,
            redial,
            store_retry,
            adopt,
        } = self.timers();
        [link, redial, store_retry, adopt]
            .into_iter()
            .flatten()
            .min()
    }

    /// Whether the shell hands in commands at all now: not while a load is in flight (they
    /// wait for it in the shell's lanes, as a link from the peer does; while a failed load
    /// waits to be retried they are heard and refused).
    pub fn hears_commands(&self) -> bool {
        !matches!(self.stage, Stage::Loading { loading: true, .. })
    }

    /// Whether new app commands may be taken now: not while an object has
    /// [`SUBSTRATE_WAITING_SENDS_MAX`] commands waiting for outbox room, nor while half of
    /// [`SUBSTRATE_UNCOMMITTED_BATCHES_MAX`] batches wait for the store (they then wait in the
    /// shell's command lane, then in the callers). An app issuing sends faster than the disk
    /// takes them stops here first, so the link (whose acks and credit free what the sends
    /// wait for) goes on being read.
    pub fn accepts_commands(&self) -> bool {
        !self.stopping
            && self.uncommitted.len() < SUBSTRATE_UNCOMMITTED_BATCHES_MAX / 2
            && self
                .parked
                .values()
                .all(|queue| queue.len() < SUBSTRATE_WAITING_SENDS_MAX)
    }

    /// Whether link input may be handled now: not while [`SUBSTRATE_UNCOMMITTED_BATCHES_MAX`]
    /// batches wait for the store. The commit in flight does not count: its batches are the
    /// disk's, and reading on while it syncs lets the next commit carry the acks that arrived
    /// meanwhile. A failed commit's batches wait again, so during an outage the bound trips
    /// and the peer's writes back up instead of this memory.
    pub fn reads_link(&self) -> bool {
        self.uncommitted.len() < SUBSTRATE_UNCOMMITTED_BATCHES_MAX
    }

    /// Whether the peer's work is over: after [`Peer::handle_shutdown`], once nothing is left
    /// to commit (or the store failed it: what was not committed was never acknowledged);
    /// otherwise once it is idle (no link, no way to dial, not named by the app, nothing in
    /// memory that is not durable, nobody waiting). The shell then calls [`Peer::finish`].
    pub fn finished(&self) -> bool {
        if self.stopping {
            return self.committing.is_none()
                && (self.uncommitted.is_empty() || self.store_retry.due().is_some());
        }
        let Stage::Ready(link) = &self.stage else {
            return false;
        };
        !self.bound
            && !self.awaiting_link
            && !self.named
            && !self.dialing
            && !self.dialable
            && self.waiters.is_empty()
            && self.opens.is_empty()
            && self.parked.is_empty()
            && self.uncommitted.is_empty()
            && self.committing.is_none()
            && link.machine().is_idle()
    }

    /// What the shell knows of the peer now: whether the app named it and whether an
    /// address is known to dial. Given before the wake's outputs are drained.
    pub fn handle_reachability(&mut self, named: bool, dialable: bool) {
        self.named = named;
        self.dialable = dialable;
    }

    /// The app named the peer: with no link, no dial in flight and none scheduled, and an
    /// address known, it dials now.
    pub fn handle_reach(&mut self, now: Time) {
        self.named = true;
        if matches!(self.stage, Stage::Ready(_))
            && !self.bound
            && !self.dialing
            && self.redial.due().is_none()
            && self.dialable
        {
            self.redial.schedule(now);
        }
    }

    /// The load asked for ended: the peer's link (its machine recovered from the loaded
    /// state), or a fault (retried after a backoff; commands are refused meanwhile).
    pub fn handle_loaded(&mut self, now: Time, result: Result<PeerLink, StoreFault>) {
        let Stage::Loading { retry, loading } = &mut self.stage else {
            return;
        };
        *loading = false;
        match result {
            Ok(link) => {
                if retry.failures() > 0 {
                    self.outputs.push_back(Output::StoreRecovered {
                        call: StoreCall::Load,
                    });
                }
                self.stage = Stage::Ready(Box::new(link));
                if self.awaiting_link {
                    self.adopt_by =
                        Some(now.saturating_add(Duration::from_millis(SUBSTRATE_ADOPT_WAIT_MS)));
                }
                if self.dialable {
                    self.redial.schedule(now);
                }
                self.drain(now);
            }
            Err(StoreFault) => {
                retry.fail(now, self.jitter.next_u64());
                let failures = retry.failures();
                self.outputs.push_back(Output::StoreFailed {
                    call: StoreCall::Load,
                    failures,
                });
            }
        }
    }

    /// The commit asked for ended. On success the machine learns what is durable; on a
    /// fault the same batches go again, first, after a backoff (a store applies all of a
    /// commit or none), and nothing they cover is acknowledged or reported meanwhile.
    pub fn handle_committed(&mut self, now: Time, result: Result<(), StoreFault>) {
        let Some(batches) = self.committing.take() else {
            return;
        };
        match result {
            Ok(()) => {
                if self.store_retry.failures() > 0 {
                    self.outputs.push_back(Output::StoreRecovered {
                        call: StoreCall::Commit,
                    });
                }
                self.store_retry.succeed();
                let last = batches.last().expect("a commit has batches").id;
                if let Stage::Ready(link) = &mut self.stage {
                    link.machine_mut().handle_persisted(now, last);
                }
            }
            Err(StoreFault) => {
                let mut batches =
                    Arc::try_unwrap(batches).unwrap_or_else(|shared| (*shared).clone());
                batches.append(&mut self.uncommitted);
                self.uncommitted = batches;
                self.store_retry.fail(now, self.jitter.next_u64());
                self.outputs.push_back(Output::StoreFailed {
                    call: StoreCall::Commit,
                    failures: self.store_retry.failures(),
                });
            }
        }
        self.drain(now);
    }

    /// An app command, answered under `ticket` ([`Output::Reply`]). A command for an object
    /// with commands already waiting for room waits behind them (per-object order); one
    /// refused for want of room waits if it may (`send`, `req`, answers), else fails
    /// `QueueFull`. Before the peer's state is loaded every command fails `StoreUnavailable`.
    pub fn handle_command(&mut self, now: Time, ticket: Ticket, command: Command) {
        if self.stopping {
            return self.reply(ticket, Reply::Failed(Failure::Shutdown));
        }
        if matches!(self.stage, Stage::Loading { .. }) {
            if !matches!(command, Command::Consume { .. }) {
                self.reply(ticket, Reply::Failed(Failure::StoreUnavailable));
            }
            return;
        }
        if let Some(queue) = self.parked.get_mut(command.object()) {
            if command.waits_for_room() || matches!(command, Command::Close { .. }) {
                // Behind the commands waiting for room, in issue order (bounded: at
                // SUBSTRATE_WAITING_SENDS_MAX the peer stops taking commands). A close
                // waits too: ops sent before it go first.
                queue.push_back((ticket, command));
                return;
            }
            if matches!(command, Command::Send { .. } | Command::Req { .. }) {
                // A `try_send` or `try_req` may not pass them, nor wait: the object is full.
                return self.reply(ticket, Reply::Failed(CommandError::QueueFull.into()));
            }
        }
        self.try_command(now, ticket, command);
        self.drain(now);
    }

    /// Drop the link as a network cut would.
    pub fn handle_disconnect(&mut self, now: Time) {
        self.handle_link_closed(now, self.generation);
    }

    /// The dial asked for ended: a connection to bind (then [`Output::Bind`] follows and the
    /// handshake starts), or a failure (redialled after a backoff).
    pub fn handle_dialed(&mut self, now: Time, result: Result<Dialed, DialFailed>) {
        self.dialing = false;
        if self.stopping || !matches!(self.stage, Stage::Ready(_)) {
            return;
        }
        match result {
            Ok(Dialed { channel, nonce }) => {
                self.bind(now);
                if let Stage::Ready(link) = &mut self.stage {
                    link.link_up(now, Role::Dialer, channel, nonce);
                }
            }
            Err(DialFailed) => self.schedule_redial(now),
        }
        self.drain(now);
    }

    /// An inbound connection whose handshake the shell ran and verified replaces the bound
    /// one ([`Output::Bind`] follows); `rest`, the bytes that followed its handshake, are
    /// read first. Before the peer's state is loaded it is refused (not bound: the shell
    /// drops it).
    pub fn handle_adopt(&mut self, now: Time, negotiated: Negotiated, rest: Bytes) {
        if self.stopping || !matches!(self.stage, Stage::Ready(_)) {
            return;
        }
        self.awaiting_link = false;
        self.adopt_by = None;
        self.bind(now);
        if let Stage::Ready(link) = &mut self.stage {
            link.adopt(now, negotiated);
            if !rest.is_empty() {
                link.handle_bytes(now, rest);
            }
        }
        self.drain(now);
    }

    /// Bytes read from the connection bound under `generation` (stale ones are ignored).
    pub fn handle_link_bytes(&mut self, now: Time, generation: u64, bytes: Bytes) {
        if generation != self.generation || !self.bound {
            return;
        }
        if let Stage::Ready(link) = &mut self.stage {
            link.handle_bytes(now, bytes);
        }
        self.drain(now);
    }

    /// The connection bound under `generation` ended (stale ends are ignored): the link is
    /// down and a redial is scheduled.
    pub fn handle_link_closed(&mut self, now: Time, generation: u64) {
        if generation != self.generation || !self.bound {
            return;
        }
        if let Stage::Ready(link) = &mut self.stage {
            link.handle_eof(now);
        }
        self.detach(now);
        self.drain(now);
    }

    /// Time passed: a due load or dial is asked for, the link's timers fire.
    pub fn handle_timeout(&mut self, now: Time) {
        match &mut self.stage {
            Stage::Loading { retry, loading } => {
                if !*loading && retry.take_due(now) {
                    *loading = true;
                    self.outputs.push_back(Output::Load);
                }
            }
            Stage::Ready(link) => {
                if self.adopt_by.is_some_and(|by| by <= now) {
                    // The link the peer was started for never came.
                    self.awaiting_link = false;
                    self.adopt_by = None;
                }
                // A due store retry needs nothing more: the drain below commits.
                self.store_retry.take_due(now);
                link.handle_timeout(now);
                if self.redial.due().is_some_and(|at| at <= now) && !self.dialing && !self.bound {
                    self.redial.take_due(now);
                    if !self.stopping {
                        self.dialing = true;
                        self.outputs.push_back(Output::Dial {
                            attempt: self.redial.failures(),
                        });
                    }
                }
                self.drain(now);
            }
        }
    }

    /// The app read a `res` part of `body_len` bytes of the req `ticket`: that much of the
    /// reply is no longer held unread ([`Failure::ReplyTooLarge`]).
    pub fn handle_reply_read(&mut self, ticket: Ticket, body_len: usize) {
        if let Some(unread) = self.unread.get_mut(&ticket) {
            *unread =
                unread.saturating_sub(body_len.saturating_add(SUBSTRATE_REPLY_PART_OVERHEAD_BYTES));
        }
    }

    /// Bytes of the req `ticket`'s `res` parts the app has not read.
    pub fn reply_unread(&self, ticket: Ticket) -> usize {
        self.unread.get(&ticket).copied().unwrap_or(0)
    }

    /// The app shuts the peer down: no more commands or links; what is uncommitted is
    /// committed (once: a failure is not retried) until [`Peer::finished`].
    pub fn handle_shutdown(&mut self, now: Time) {
        self.stopping = true;
        self.redial.succeed();
        self.drain(now);
    }

    /// The peer's work is over ([`Peer::finished`], or the shell gives up on it): every
    /// command still waiting fails `Shutdown`, the connection is dropped, the counters are
    /// published a last time.
    pub fn finish(&mut self, now: Time) {
        self.stopping = true;
        if self.bound {
            self.bound = false;
            self.generation += 1;
            if let Stage::Ready(link) = &mut self.stage {
                link.link_down(now);
            }
            self.outputs.push_back(Output::Unbind);
        }
        self.unread.clear();
        let waiters = std::mem::take(&mut self.waiters);
        for waiter in waiters.into_values() {
            let (Waiter::Send(ticket) | Waiter::Req(ticket)) = waiter;
            self.reply(ticket, Reply::Failed(Failure::Shutdown));
        }
        for (_, (_, ticket)) in std::mem::take(&mut self.opens) {
            self.reply(ticket, Reply::Failed(Failure::Shutdown));
        }
        for (_, queue) in std::mem::take(&mut self.parked) {
            for (ticket, command) in queue {
                if !matches!(command, Command::Consume { .. }) {
                    self.reply(ticket, Reply::Failed(Failure::Shutdown));
                }
            }
        }
        self.outputs.push_back(Output::PublishStats);
    }

    fn reply(&mut self, ticket: Ticket, reply: Reply) {
        self.outputs.push_back(Output::Reply { ticket, reply });
    }

    /// A new connection replaces the bound one: the shell binds it under a new generation.
    fn bind(&mut self, now: Time) {
        self.unbind_quietly(now);
        self.generation += 1;
        self.bound = true;
        self.outputs.push_back(Output::Bind {
            generation: self.generation,
        });
    }

    fn unbind_quietly(&mut self, now: Time) {
        if self.bound {
            self.outputs.push_back(Output::Unbind);
        }
        self.bound = false;
        self.generation += 1;
        if let Stage::Ready(link) = &mut self.stage {
            link.link_down(now);
        }
    }

    /// The link is lost: unbind, and redial after a backoff.
    fn detach(&mut self, now: Time) {
        self.unbind_quietly(now);
        self.was_up = false;
        self.schedule_redial(now);
    }

    fn schedule_redial(&mut self, now: Time) {
        if !self.dialable || self.dialing || self.stopping {
            return;
        }
        self.redial.fail(now, self.jitter.next_u64());
    }

    /// Does one command.
    fn try_command(&mut self, now: Time, ticket: Ticket, command: Command) -> Parked {
        let Stage::Ready(link) = &mut self.stage else {
            unreachable!("commands reach a loaded peer only")
        };
        let machine = link.machine_mut();
        let refused = match command {
            Command::Open { kind, obj, cap } => {
                match machine.open(now, kind, &obj, cap.as_deref()) {
                    Ok(open_id) => {
                        self.opens.insert(obj, (open_id, ticket));
                    }
                    Err(error) => self.reply(ticket, Reply::Failed(error.into())),
                }
                None
            }
            Command::Send { obj, body, wait } => match machine.send(now, &obj, body.clone()) {
                Ok(id) => {
                    self.waiters.insert(id, Waiter::Send(ticket));
                    None
                }
                Err(error) => Some((Command::Send { obj, body, wait }, error)),
            },
            Command::Req { obj, body, wait } => match machine.req(now, &obj, body.clone()) {
                Ok(id) => {
                    self.waiters.insert(id, Waiter::Req(ticket));
                    None
                }
                Err(error) => Some((Command::Req { obj, body, wait }, error)),
            },
            Command::Answer {
                obj,
                req_id,
                verb,
                body,
                code,
            } => match machine.answer(now, &obj, &req_id, verb, body.clone(), code.as_deref()) {
                Ok(()) => {
                    self.reply(ticket, Reply::Done);
                    None
                }
                Err(error) => {
                    let command = Command::Answer {
                        obj,
                        req_id,
                        verb,
                        body,
                        code,
                    };
                    Some((command, error))
                }
            },
            Command::Decide { obj, reject } => {
                let result = match reject {
                    None => machine.accept(now, &obj),
                    Some(code) => machine.reject(now, &obj, &code),
                };
                self.reply(ticket, done_or_failed(result));
                None
            }
            Command::Close { obj, reason } => {
                let result = machine.close(now, &obj, &reason);
                self.reply(ticket, done_or_failed(result));
                None
            }
            Command::Consume { obj, seq } => {
                machine.consume(now, &obj, seq);
                None
            }
        };
        match refused {
            None => Parked::No,
            Some((command, CommandError::QueueFull)) if command.waits_for_room() => {
                let obj = command.object().to_owned();
                self.parked
                    .entry(obj)
                    .or_default()
                    .push_front((ticket, command));
                Parked::Again
            }
            Some((_, error)) => {
                // A refused command that was parked lets the next one try.
                self.reply(ticket, Reply::Failed(error.into()));
                Parked::No
            }
        }
    }

    /// Retries the commands waiting for room in the objects that freed some, in order, until
    /// one is refused again.
    fn unpark(&mut self, now: Time) {
        for obj in std::mem::take(&mut self.freed) {
            while let Some((ticket, command)) = self
                .parked
                .get_mut(obj.as_str())
                .and_then(VecDeque::pop_front)
            {
                if self.try_command(now, ticket, command) == Parked::Again {
                    break;
                }
            }
            if self
                .parked
                .get(obj.as_str())
                .is_some_and(VecDeque::is_empty)
            {
                self.parked.remove(obj.as_str());
            }
        }
    }

    /// Drains the machine until it has nothing more: persist (every batch so far in one
    /// commit when none is in flight and no retry waits), then events, then the link's end.
    fn drain(&mut self, now: Time) {
        loop {
            let Stage::Ready(link) = &mut self.stage else {
                return;
            };
            self.uncommitted
                .extend(std::iter::from_fn(|| link.machine_mut().poll_persist()));
            if self.committing.is_none()
                && !self.uncommitted.is_empty()
                && self.store_retry.due().is_none()
            {
                let batches = Arc::new(std::mem::take(&mut self.uncommitted));
                self.committing = Some(batches.clone());
                self.outputs.push_back(Output::Commit(batches));
            }
            let mut progress = false;
            while let Some(event) = self.poll_link_event() {
                progress = true;
                self.event(event);
            }
            if !self.freed.is_empty() {
                self.unpark(now);
            }
            let Stage::Ready(link) = &mut self.stage else {
                return;
            };
            if let Some(close) = link.poll_close() {
                self.outputs.push_back(Output::LinkDropped(close));
                self.detach(now);
                progress = true;
            }
            let Stage::Ready(link) = &mut self.stage else {
                return;
            };
            if link.is_up() && !self.was_up {
                self.was_up = true;
                self.redial.succeed();
                let negotiated = link.negotiated().cloned().expect("an up link negotiated");
                self.outputs.push_back(Output::LinkUp(negotiated));
            }
            if !progress {
                break;
            }
        }
        // Counters are published at most once per STATS_EVERY: serializing them on every
        // input would tax the hot path.
        if self.stats_due.is_none_or(|due| due <= now) {
            self.stats_due = Some(now.saturating_add(STATS_EVERY));
            self.outputs.push_back(Output::PublishStats);
        }
    }

    fn poll_link_event(&mut self) -> Option<Event> {
        match &mut self.stage {
            Stage::Ready(link) => link.poll_event(),
            Stage::Loading { .. } => None,
        }
    }

    fn event(&mut self, event: Event) {
        match event {
            Event::Acked { obj, op_id } => {
                self.freed.insert(obj);
                // A req's hop ack is not its outcome: it keeps waiting for the answer.
                if let Some(Waiter::Send(ticket)) = self.waiters.get(&op_id).copied() {
                    self.waiters.remove(&op_id);
                    self.reply(ticket, Reply::Sent(op_id));
                }
            }
            Event::Futile { obj, op_id, code } => {
                self.freed.insert(obj.clone());
                match self.waiters.remove(&op_id) {
                    Some(Waiter::Send(ticket) | Waiter::Req(ticket)) => {
                        self.unread.remove(&ticket);
                        self.reply(ticket, Reply::Failed(Failure::Futile(Code::parse(&code))));
                    }
                    None => {
                        let its_open = self
                            .opens
                            .get(obj.as_str())
                            .is_some_and(|(id, _)| *id == op_id);
                        if let Some((_, ticket)) =
                            its_open.then(|| self.opens.remove(obj.as_str())).flatten()
                        {
                            self.reply(ticket, Reply::Failed(Failure::Futile(Code::parse(&code))));
                        }
                    }
                }
            }
            Event::Opened { obj } => {
                if let Some((_, ticket)) = self.opens.remove(obj.as_str()) {
                    self.reply(ticket, Reply::Done);
                }
            }
            Event::Rejected { obj, code } => {
                if let Some((_, ticket)) = self.opens.remove(obj.as_str()) {
                    let failure = Failure::Rejected(Code::of(code.as_deref()));
                    self.reply(ticket, Reply::Failed(failure));
                }
            }
            Event::Answered {
                obj,
                req_id,
                verb,
                body,
                code,
            } => {
                self.freed.insert(obj);
                let Some(Waiter::Req(ticket)) = self.waiters.get(&req_id).copied() else {
                    return;
                };
                let reply = match verb {
                    Verb::Res => {
                        let body = body.unwrap_or_default();
                        let unread = self.unread.entry(ticket).or_default();
                        *unread = unread
                            .saturating_add(body.len())
                            .saturating_add(SUBSTRATE_REPLY_PART_OVERHEAD_BYTES);
                        if *unread > SUBSTRATE_REPLY_BYTES_MAX {
                            // The app is not reading: the rest of this answer is dropped.
                            Reply::Failed(Failure::ReplyTooLarge(SUBSTRATE_REPLY_BYTES_MAX))
                        } else {
                            Reply::Res(body)
                        }
                    }
                    Verb::End => Reply::End(body),
                    _ => Reply::Failed(Failure::Remote(Code::of(code.as_deref()))),
                };
                if !matches!(reply, Reply::Res(_)) {
                    self.waiters.remove(&req_id);
                    self.unread.remove(&ticket);
                }
                self.reply(ticket, reply);
            }
            Event::Closed {
                obj,
                reason,
                by_remote,
            } => {
                if let Some((_, ticket)) = self.opens.remove(obj.as_str()) {
                    let failure = Failure::Closed(Code::of(reason.as_deref()));
                    self.reply(ticket, Reply::Failed(failure));
                }
                if by_remote {
                    self.outputs.push_back(Output::App(Event::Closed {
                        obj,
                        reason,
                        by_remote,
                    }));
                }
            }
            event @ (Event::OpenRequested { .. }
            | Event::Delivered(_)
            | Event::LinkDead
            | Event::Violation { .. }) => self.outputs.push_back(Output::App(event)),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parked {
    No,
    Again,
}

fn done_or_failed(result: Result<(), CommandError>) -> Reply {
    match result {
        Ok(()) => Reply::Done,
        Err(error) => Reply::Failed(error.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::substrate::handshake::Auth;
    use crate::substrate::{AllowAll, Authorizer, Config};

    const T0: Time = Time::from_millis(1_000);

    fn link(id: &str) -> PeerLink {
        let authorizer = Arc::new(Authorizer::new(AllowAll));
        let machine = Machine::new(PeerId::new(id), Config::default(), authorizer, 7);
        PeerLink::new(machine, Auth::None, Vec::new())
    }

    fn outputs(peer: &mut Peer) -> Vec<Output> {
        std::iter::from_fn(|| peer.poll_output()).collect()
    }

    fn without_stats(outputs: Vec<Output>) -> Vec<Output> {
        outputs
            .into_iter()
            .filter(|output| *output != Output::PublishStats)
            .collect()
    }

    fn loaded(named: bool, dialable: bool) -> Peer {
        let mut peer = Peer::new(PeerId::new("b"), named, dialable, 42);
        assert_eq!(outputs(&mut peer), [Output::Load]);
        peer.handle_loaded(T0, Ok(link("b")));
        peer
    }

    fn channel() -> Channel {
        Channel {
            conn_id: b"a-b".to_vec(),
            binding: Vec::new(),
        }
    }

    fn open(obj: &str) -> Command {
        Command::Open {
            kind: ObjKind::Queue,
            obj: obj.to_owned(),
            cap: None,
        }
    }

    fn dials(outputs: &[Output]) -> Vec<u32> {
        outputs
            .iter()
            .filter_map(|output| match output {
                Output::Dial { attempt } => Some(*attempt),
                _ => None,
            })
            .collect()
    }

    /// Moves frames both ways between `peer` (bound under `generation`) and a listener's
    /// link until neither has more.
    fn pump(peer: &mut Peer, listener: &mut PeerLink, now: Time, generation: u64) {
        loop {
            let (mut out, mut back) = (BytesMut::new(), BytesMut::new());
            while peer.poll_transmit(&mut out) {}
            if !out.is_empty() {
                listener.handle_bytes(now, out.freeze());
            }
            while listener.poll_transmit(&mut back) {}
            if back.is_empty() {
                return;
            }
            peer.handle_link_bytes(now, generation, back.freeze());
        }
    }

    #[test]
    fn a_failing_load_is_retried_with_backoff_and_commands_fail_meanwhile() {
        let mut peer = Peer::new(PeerId::new("b"), true, true, 42);
        assert_eq!(outputs(&mut peer), [Output::Load]);
        assert!(!peer.finished(), "a peer loading is not idle");
        assert!(
            !peer.hears_commands(),
            "commands wait for the load in flight"
        );
        let mut now = T0;
        for failures in 1..=5 {
            peer.handle_loaded(now, Err(StoreFault));
            let failed = Output::StoreFailed {
                call: StoreCall::Load,
                failures,
            };
            assert_eq!(outputs(&mut peer), [failed]);
            assert!(
                peer.hears_commands(),
                "while the retry waits, commands are refused"
            );
            peer.handle_command(now, 9, open("q"));
            let refused = Output::Reply {
                ticket: 9,
                reply: Reply::Failed(Failure::StoreUnavailable),
            };
            assert_eq!(outputs(&mut peer), [refused]);
            let due = peer.poll_timeout().expect("a load retry is scheduled");
            let ceiling = STORE_RETRY.ceiling(failures - 1);
            let wait = due.saturating_since(now);
            assert!(
                wait >= ceiling / 2 && wait <= ceiling,
                "{wait:?} vs {ceiling:?}"
            );
            peer.handle_timeout(Time::from_millis(due.as_millis() - 1));
            assert!(outputs(&mut peer).is_empty(), "not before it is due");
            peer.handle_timeout(due);
            assert_eq!(outputs(&mut peer), [Output::Load]);
            assert_eq!(peer.poll_timeout(), None, "one load at a time");
            now = due;
        }
        peer.handle_loaded(now, Ok(link("b")));
        let out = outputs(&mut peer);
        assert_eq!(
            out[0],
            Output::StoreRecovered {
                call: StoreCall::Load
            }
        );
        // Loaded with an address known: it dials at once.
        assert_eq!(peer.poll_timeout(), Some(now));
        peer.handle_timeout(now);
        assert_eq!(dials(&outputs(&mut peer)), [0]);
    }

    #[test]
    fn failed_dials_back_off_and_a_link_that_comes_up_resets_the_backoff() {
        let mut peer = loaded(true, true);
        for attempt in 0..6 {
            let now = peer.poll_timeout().expect("a dial is scheduled");
            peer.handle_timeout(now);
            assert_eq!(dials(&outputs(&mut peer)), [attempt]);
            peer.handle_timeout(now);
            assert!(dials(&outputs(&mut peer)).is_empty(), "one dial at a time");
            assert_eq!(peer.poll_timeout(), None, "nothing due while it dials");
            peer.handle_dialed(now, Err(DialFailed));
            let ceiling = REDIAL.ceiling(attempt);
            let wait = peer.poll_timeout().expect("redial").saturating_since(now);
            assert!(
                wait >= ceiling / 2 && wait <= ceiling,
                "{wait:?} vs {ceiling:?}"
            );
        }
        let due = peer.poll_timeout().expect("a dial is scheduled");
        peer.handle_timeout(due);
        assert_eq!(dials(&outputs(&mut peer)), [6]);
        let dialed = Dialed {
            channel: channel(),
            nonce: vec![1; 16],
        };
        peer.handle_dialed(due, Ok(dialed));
        let generation = peer.generation();
        assert!(outputs(&mut peer).contains(&Output::Bind { generation }));
        let mut listener = link("a");
        listener.link_up(due, Role::Listener, channel(), vec![2; 16]);
        pump(&mut peer, &mut listener, due, generation);
        assert!(listener.is_up());
        assert!(outputs(&mut peer)
            .iter()
            .any(|output| matches!(output, Output::LinkUp(_))));
        // Bytes of an older connection are not this link's.
        peer.handle_link_bytes(due, generation - 1, Bytes::from_static(b"\xff\xff\xff"));
        assert!(peer.link().is_some_and(PeerLink::is_up));

        // The link is lost: the redial starts from the base again.
        peer.handle_link_closed(due, generation);
        assert_eq!(without_stats(outputs(&mut peer)), [Output::Unbind]);
        let wait = peer.poll_timeout().expect("redial").saturating_since(due);
        assert!(wait <= REDIAL.ceiling(0));
        // Its end reported twice changes nothing.
        peer.handle_link_closed(due, generation);
        assert!(without_stats(outputs(&mut peer)).is_empty());
    }

    #[test]
    fn a_failed_commit_goes_again_first_after_a_backoff_and_commits_take_turns() {
        let mut peer = loaded(true, false);
        let _ = outputs(&mut peer);
        let commits = |outputs: &[Output]| -> Vec<Vec<BatchIdOf>> {
            outputs
                .iter()
                .filter_map(|output| match output {
                    Output::Commit(batches) => Some(batches.iter().map(|b| b.id).collect()),
                    _ => None,
                })
                .collect()
        };
        peer.handle_command(T0, 1, open("q"));
        let first = commits(&outputs(&mut peer));
        assert_eq!(first.len(), 1, "the open is persisted before it is sent");
        // While that commit is in flight, the next batch waits for it.
        peer.handle_command(T0, 2, open("r"));
        assert_eq!(commits(&outputs(&mut peer)), Vec::<Vec<BatchIdOf>>::new());
        assert!(!peer.finished());

        peer.handle_committed(T0, Err(StoreFault));
        let failed = Output::StoreFailed {
            call: StoreCall::Commit,
            failures: 1,
        };
        assert_eq!(without_stats(outputs(&mut peer)), [failed]);
        let due = peer.poll_timeout().expect("a store retry");
        let wait = due.saturating_since(T0);
        assert!(wait <= STORE_RETRY.ceiling(0) && wait >= STORE_RETRY.ceiling(0) / 2);
        peer.handle_timeout(due);
        let again = commits(&outputs(&mut peer));
        assert_eq!(again.len(), 1);
        assert_eq!(
            again[0][..first[0].len()],
            first[0][..],
            "the failed batches first"
        );
        assert!(again[0].len() > first[0].len(), "then the ones that waited");
        peer.handle_committed(due, Ok(()));
        let recovered = Output::StoreRecovered {
            call: StoreCall::Commit,
        };
        assert!(outputs(&mut peer).contains(&recovered));
    }

    #[test]
    fn a_reply_the_app_leaves_unread_past_its_bound_fails_and_the_rest_is_dropped() {
        let mut peer = loaded(true, false);
        let _ = outputs(&mut peer);
        let answered = |verb: Verb, body: &[u8]| Event::Answered {
            obj: Address::parse("s").expect("an address"),
            req_id: "r1".into(),
            verb,
            body: Some(Bytes::copy_from_slice(body)),
            code: None,
        };
        let replies = |peer: &mut Peer| -> Vec<Reply> {
            outputs(peer)
                .into_iter()
                .filter_map(|output| match output {
                    Output::Reply { ticket: 7, reply } => Some(reply),
                    _ => None,
                })
                .collect()
        };
        peer.waiters.insert("r1".into(), Waiter::Req(7));
        let part = vec![0u8; 64 * 1024];
        let size = part.len() + SUBSTRATE_REPLY_PART_OVERHEAD_BYTES;
        let fit = SUBSTRATE_REPLY_BYTES_MAX / size;
        // A reader that keeps up is never cut off, however long the answer.
        for _ in 0..fit * 3 {
            peer.event(answered(Verb::Res, &part));
            assert_eq!(replies(&mut peer), [Reply::Res(Bytes::from(part.clone()))]);
            peer.handle_reply_read(7, part.len());
            assert_eq!(peer.reply_unread(7), 0);
        }
        // The reader stops: parts are handed out up to the bound, and the one past it ends
        // the request with a typed failure.
        for held in 1..=fit {
            peer.event(answered(Verb::Res, &part));
            assert_eq!(replies(&mut peer).len(), 1);
            assert_eq!(peer.reply_unread(7), held * size);
        }
        peer.event(answered(Verb::Res, &part));
        assert_eq!(
            replies(&mut peer),
            [Reply::Failed(Failure::ReplyTooLarge(
                SUBSTRATE_REPLY_BYTES_MAX
            ))]
        );
        assert_eq!(peer.reply_unread(7), 0, "nothing is held for it any more");
        // The rest of that answer, its end included, reaches nobody.
        peer.event(answered(Verb::Res, &part));
        peer.event(answered(Verb::End, b"end"));
        assert!(replies(&mut peer).is_empty());
        // A late read of a part the app had already taken changes nothing.
        peer.handle_reply_read(7, part.len());
        assert_eq!(peer.reply_unread(7), 0);
    }

    #[test]
    fn links_from_peers_nobody_named_start_work_only_under_the_cap_and_never_while_closing() {
        use Admission::{Refused, Running, Start};
        // (origin, closing, running, peers, max) -> admission
        let cases = [
            (Origin::Link, false, false, 3, 4, Start),
            (Origin::Link, false, false, 4, 4, Refused(Refusal::PeerCap)),
            (Origin::Link, false, false, 9, 4, Refused(Refusal::PeerCap)),
            (Origin::Link, false, true, 4, 4, Running),
            (Origin::Link, true, true, 1, 4, Refused(Refusal::Closing)),
            (Origin::Link, true, false, 0, 4, Refused(Refusal::Closing)),
            (Origin::App, false, false, 4, 4, Start),
            (Origin::App, true, false, 9, 4, Start),
            (Origin::App, false, true, 4, 4, Running),
            (Origin::Link, false, false, 0, 0, Refused(Refusal::PeerCap)),
        ];
        for (origin, closing, running, peers, max, want) in cases {
            assert_eq!(
                admit(origin, closing, running, peers, max),
                want,
                "{origin:?} closing={closing} running={running} {peers}/{max}"
            );
        }
    }

    #[test]
    fn a_peer_started_for_a_link_waits_for_it_after_loading_and_ends_if_it_never_comes() {
        let mut peer = Peer::new(PeerId::new("b"), false, false, 42).awaiting_link();
        assert_eq!(outputs(&mut peer), [Output::Load]);
        peer.handle_loaded(T0, Ok(link("b")));
        assert!(
            !peer.finished(),
            "loaded and idle, but the link it was started for is on its way"
        );
        let by = T0.saturating_add(Duration::from_millis(SUBSTRATE_ADOPT_WAIT_MS));
        assert_eq!(peer.timers().adopt, Some(by));
        assert_eq!(peer.poll_timeout(), Some(by));
        peer.handle_timeout(Time::from_millis(by.as_millis() - 1));
        assert!(!peer.finished(), "not before the wait ends");
        peer.handle_timeout(by);
        assert!(peer.finished(), "the link never came: the peer is idle");
        assert_eq!(peer.timers().adopt, None);
        // A peer the app started (or one the shell did not mark) is idle once loaded.
        assert!(loaded(false, false).finished());
    }

    type BatchIdOf = crate::substrate::BatchId;

    #[test]
    fn an_address_learned_while_loading_is_dialed_once_loaded_and_a_reach_dials_now() {
        // Started for a peer found in the store: nobody named it, no address yet.
        let mut peer = Peer::new(PeerId::new("b"), false, false, 42);
        assert_eq!(outputs(&mut peer), [Output::Load]);
        // The app adds the address and names the peer while the load is in flight.
        peer.handle_reachability(true, true);
        peer.handle_loaded(T0, Ok(link("b")));
        assert_eq!(peer.timers().redial, Some(T0));
        peer.handle_timeout(T0);
        assert_eq!(dials(&outputs(&mut peer)), [0]);

        // Loaded first, the address learned after: the app's reach dials at once.
        let mut peer = loaded(false, false);
        assert_eq!(peer.timers().redial, None);
        peer.handle_reachability(true, true);
        peer.handle_reach(T0);
        assert_eq!(peer.timers().redial, Some(T0));
    }

    #[test]
    fn a_peer_ends_when_idle_and_shutdown_commits_once_then_fails_what_waits() {
        // Named by nobody, no address, nothing to do: its work is over.
        let peer = loaded(false, false);
        assert!(peer.finished());
        let mut peer = loaded(true, false);
        assert!(!peer.finished(), "the app named it");
        peer.handle_reachability(false, true);
        assert!(!peer.finished(), "it can be dialed");
        peer.handle_reachability(false, false);
        assert!(peer.finished());

        let mut peer = loaded(true, false);
        let _ = outputs(&mut peer);
        peer.handle_command(T0, 1, open("q"));
        let _ = outputs(&mut peer);
        peer.handle_command(T0, 2, open("r"));
        peer.handle_shutdown(T0);
        assert!(!peer.accepts_commands());
        assert!(!peer.finished(), "a commit is in flight");
        peer.handle_command(T0, 3, open("s"));
        let refused = Output::Reply {
            ticket: 3,
            reply: Reply::Failed(Failure::Shutdown),
        };
        assert!(outputs(&mut peer).contains(&refused));
        peer.handle_committed(T0, Ok(()));
        let next = outputs(&mut peer);
        assert!(
            next.iter().any(|o| matches!(o, Output::Commit(_))),
            "what waited"
        );
        peer.handle_committed(T0, Err(StoreFault));
        assert!(peer.finished(), "a failure at shutdown is not retried");
        peer.finish(T0);
        let out = outputs(&mut peer);
        for ticket in [1, 2] {
            let failed = Output::Reply {
                ticket,
                reply: Reply::Failed(Failure::Shutdown),
            };
            assert!(out.contains(&failed), "open {ticket} fails: {out:?}");
        }
    }
}
