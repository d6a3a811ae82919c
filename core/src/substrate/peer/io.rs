//! What goes in and out of a [`Peer`](super::Peer): app commands and their replies, the
//! store's and the dialer's answers, the outputs the shell executes, and admission.

use std::sync::Arc;

use bytes::Bytes;

use crate::substrate::finality::Code;
use crate::substrate::handshake::{Channel, Negotiated};
use crate::substrate::link::LinkClose;
use crate::substrate::machine::{CommandError, Event};
use crate::substrate::{Address, ObjName, OpId, PersistBatch, Seq};
use crate::time::Time;
use crate::wire::envelope::{ObjKind, Verb};

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
        obj: ObjName,
        /// A capability token to present.
        cap: Option<String>,
    },
    /// Send on an object.
    Send {
        /// The object.
        obj: ObjName,
        /// The body.
        body: Bytes,
        /// Wait for outbox room (`send`) rather than fail with `QueueFull` (`try_send`).
        wait: bool,
    },
    /// Make a request on an object.
    Req {
        /// The object.
        obj: ObjName,
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
        obj: ObjName,
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
    pub(super) fn waits_for_room(&self) -> bool {
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
    /// [`SUBSTRATE_REPLY_PART_OVERHEAD_BYTES`](crate::limits::SUBSTRATE_REPLY_PART_OVERHEAD_BYTES)
    /// a part): the rest of the answer is dropped.
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

/// A peer's timers, by reason ([`Peer::timers`](super::Peer::timers));
/// [`Peer::poll_timeout`](super::Peer::poll_timeout) is the earliest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timers {
    /// The link's: handshake, keepalive, dead-after, retransmits, TTLs.
    pub link: Option<Time>,
    /// The next dial.
    pub redial: Option<Time>,
    /// The next try of a failing store (a load or a commit).
    pub store_retry: Option<Time>,
    /// The end of the wait for the inbound link a peer was started for
    /// ([`Peer::awaiting_link`](super::Peer::awaiting_link)).
    pub adopt: Option<Time>,
    /// The commit of batches held back because nothing waits on them
    /// ([`LAZY_COMMIT`](super::LAZY_COMMIT)).
    pub commit: Option<Time>,
}

/// What the shell must do, or may report.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Output {
    /// Load the peer's durable state; answer with
    /// [`Peer::handle_loaded`](super::Peer::handle_loaded).
    Load,
    /// Commit these batches in one transaction; answer with
    /// [`Peer::handle_committed`](super::Peer::handle_committed). One
    /// commit at a time: the next is asked for only after the answer.
    Commit(Arc<Vec<PersistBatch>>),
    /// Dial the peer; answer with [`Peer::handle_dialed`](super::Peer::handle_dialed).
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
    /// Publish the peer's counters ([`Peer::machine`](super::Peer::machine)) now.
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
    /// Start the peer's work (its [`Peer`](super::Peer) loads its state first).
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
