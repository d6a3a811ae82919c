//! The substrate from async Rust: named queues and sessions to peers with exactly-once,
//! per-object FIFO delivery across disconnects and restarts.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use tether::store::SqliteStore;
//! use tether::substrate::{Auth, Authorizer, Inbound, PeerId, ScopeAuthorizer, Substrate, TcpTransport};
//!
//! let transport = TcpTransport::bind(PeerId::new("alice"), "127.0.0.1:0".parse()?).await?;
//! transport.add_peer(PeerId::new("bob"), "127.0.0.1:7000".parse()?);
//! // bob may open and send on anything; every other peer is refused.
//! let scopes = ScopeAuthorizer::new(
//!     |peer| (peer.as_str() == "bob").then(|| vec!["worker".to_owned()]),
//!     [("worker".to_owned(), vec!["open".to_owned(), "send".to_owned()])],
//! );
//! let substrate = Substrate::builder(PeerId::new("alice"), transport)
//!     .auth(Auth::SharedKey(b"a key both sides hold".to_vec()))
//!     .authorize(Authorizer::new(scopes))
//!     .store(Arc::new(SqliteStore::open("alice.db")?))
//!     .start()?;
//! let queue = substrate.peer(&PeerId::new("bob")).open_queue("jobs/resize").await?;
//! queue.send(b"photo-1".to_vec()).await?; // durable at bob when this returns
//! let mut inbound = substrate.inbound().expect("taken once");
//! while let Some(item) = inbound.recv().await {
//!     if let Inbound::Message(message) = item {
//!         println!("{} bytes on {}", message.body.len(), message.obj);
//!         message.done(); // not redelivered after a restart
//!     }
//! }
//! substrate.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! The shell is thin: each peer has one task that owns a [`tether_core::substrate::PeerLink`]
//! and only moves bytes, time and persistence results; every decision is the core machine's.
//! Persist batches are group-committed (all batches emitted up to a commit point in one store
//! transaction) before anything they cover is transmitted or acknowledged.

mod answers;
mod commands;
mod driver;
mod preauth;
pub mod transport;

pub use preauth::{LinkCounts, SUBSTRATE_HANDSHAKES_IN_PROGRESS_MAX};

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use tether_core::limits::SUBSTRATE_PEERS_DEFAULT;

use bytes::Bytes;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{Rng, SeedableRng, TryRng};
use tether_core::time::Time;
use tether_core::wire::envelope::{ObjName, Verb};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{info, warn};

pub use tether_core::substrate::handshake::{Auth, PeerKeys};
pub use tether_core::substrate::{
    AllowAll, Authorizer, Code, CommandError, Config, Denial, Interceptor, PeerId, ScopeAuthorizer,
    Seq,
};
pub use tether_core::wire::envelope::{Address, ObjKind, OpId};
pub use transport::{Link, LinkStream, TcpTransport, Transport};

use crate::store::{MemoryStore, Store, StoreError, StoreFailure};
use commands::{Answer, Command};
use commands::{CommandTx, Issued, Slot};
use driver::PeerExecutor;
use tether_core::substrate::peer::{self, Admission, Origin};

/// Why an operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The machine refused the command (nothing changed).
    #[error(transparent)]
    Command(#[from] CommandError),
    /// The op ended without effect (terminal error from the peer, close, TTL expiry): the
    /// code says why.
    #[error("futile: {0}")]
    Futile(Code),
    /// The peer rejected the open, with this code.
    #[error("rejected: {0}")]
    Rejected(Code),
    /// The peer answered the request with an error code.
    #[error("remote error: {0}")]
    Remote(Code),
    /// The object was closed before the open completed, with this code.
    #[error("closed: {0}")]
    Closed(Code),
    /// The substrate is shutting down.
    #[error("shut down")]
    Shutdown,
    /// The answer's `res` parts exceeded this many bytes: the request ends here and the rest
    /// of its answer is dropped.
    #[error("reply larger than {0} bytes")]
    ReplyTooLarge(usize),
    /// The peer's durable state cannot be loaded from the store right now; nothing was done.
    /// The load is retried with backoff; try again later.
    #[error("store unavailable: {0}")]
    Store(#[source] StoreFailure),
}

/// Which store call failed (core's [`StoreCall`](tether_core::substrate::peer::StoreCall)).
pub use tether_core::substrate::peer::StoreCall as StoreOp;

/// Why the substrate could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// No authentication method was chosen (use `Auth::None` to opt out explicitly).
    #[error("an auth method is required")]
    AuthRequired,
    /// No authorize chain was given (use `AllowAll` to opt out explicitly).
    #[error("an authorize chain is required")]
    AuthorizeRequired,
    /// The store could not load what it holds.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The answer to a request: the `res` parts in order, then the `end` body.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Reply {
    /// Bodies of `res` answers, in order.
    pub res: Vec<Bytes>,
    /// Body of the final `end`.
    pub end: Option<Bytes>,
}

/// One part of an answer as it arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyPart {
    /// A partial answer (`res`); more follow.
    Res(Bytes),
    /// The final answer (`end`); nothing follows.
    End(Option<Bytes>),
}

/// The answers to one request, read as they arrive (see [`Session::request`]). Unread parts
/// are bounded: past [`SUBSTRATE_REPLY_BYTES_MAX`] bytes held (bodies plus 64 bytes a part)
/// the request ends with [`Error::ReplyTooLarge`], counted as
/// `tether_substrate_replies_too_large`. The peer's machine keeps that count and decides
/// (`tether_core::substrate::peer`): each part read here is reported back to it.
///
/// [`SUBSTRATE_REPLY_BYTES_MAX`]: tether_core::limits::SUBSTRATE_REPLY_BYTES_MAX
pub struct ReplyStream {
    /// The request while it waits for room in the command lane.
    slot: Option<Arc<Slot>>,
    /// When the request was issued (its answer's latency is measured from here).
    issued: std::time::Instant,
    parts: mpsc::UnboundedReceiver<Part>,
    /// The peer's task, told of every `res` part read.
    handle: CommandTx,
    done: bool,
}

/// What a peer's task hands a [`ReplyStream`]: a `res` part comes with the request's ticket,
/// under which the stream reports reading it.
enum Part {
    Res(peer::Ticket, Bytes),
    End(Option<Bytes>),
    Failed(Error),
}

impl std::fmt::Debug for ReplyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplyStream")
            .field("waiting_for_room", &self.slot.is_some())
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl ReplyStream {
    /// The next part; `None` after the `end` part or an error.
    pub async fn next(&mut self) -> Option<Result<ReplyPart, Error>> {
        if self.done {
            return None;
        }
        let part = match self
            .parts
            .recv()
            .await
            .unwrap_or(Part::Failed(Error::Shutdown))
        {
            Part::Res(ticket, body) => {
                self.handle.control(Command::ReplyRead(ticket, body.len()));
                return Some(Ok(ReplyPart::Res(body)));
            }
            Part::End(body) => {
                metrics::histogram!(metric::ANSWER_LATENCY_MS)
                    .record(self.issued.elapsed().as_secs_f64() * 1e3);
                Ok(ReplyPart::End(body))
            }
            Part::Failed(error) => Err(error),
        };
        self.done = true;
        self.slot = None;
        Some(part)
    }

    /// Reads every part: the whole answer, or the error that ended it. Gathers at most
    /// [`SUBSTRATE_REPLY_BYTES_MAX`] bytes of `res` bodies; past it the request ends with
    /// [`Error::ReplyTooLarge`] (read a longer answer with [`ReplyStream::next`]).
    ///
    /// [`SUBSTRATE_REPLY_BYTES_MAX`]: tether_core::limits::SUBSTRATE_REPLY_BYTES_MAX
    pub async fn collect(mut self) -> Result<Reply, Error> {
        use tether_core::limits::SUBSTRATE_REPLY_BYTES_MAX;
        let mut reply = Reply::default();
        let mut gathered = 0usize;
        while let Some(part) = self.next().await {
            match part? {
                ReplyPart::Res(body) => {
                    gathered += body.len();
                    if gathered > SUBSTRATE_REPLY_BYTES_MAX {
                        metrics::counter!("tether_substrate_replies_too_large").increment(1);
                        return Err(Error::ReplyTooLarge(SUBSTRATE_REPLY_BYTES_MAX));
                    }
                    reply.res.push(body);
                }
                ReplyPart::End(end) => reply.end = end,
            }
        }
        Ok(reply)
    }
}

/// The shell's end of a [`ReplyStream`].
pub(crate) struct ReplySink {
    parts: mpsc::UnboundedSender<Part>,
}

impl ReplySink {
    /// Hands the `res` part of the request `ticket` to the reader.
    fn res(&self, ticket: peer::Ticket, body: Bytes) {
        let _ = self.parts.send(Part::Res(ticket, body));
    }

    fn end(self, body: Option<Bytes>) {
        let _ = self.parts.send(Part::End(body));
    }

    fn fail(&self, error: Error) {
        let _ = self.parts.send(Part::Failed(error));
    }
}

fn reply_stream(handle: CommandTx) -> (ReplySink, ReplyStream) {
    let (tx, rx) = mpsc::unbounded_channel();
    let sink = ReplySink { parts: tx };
    let stream = ReplyStream {
        slot: None,
        issued: std::time::Instant::now(),
        parts: rx,
        handle,
        done: false,
    };
    (sink, stream)
}

/// What peers send this node (and what the app must know about them). Non-exhaustive: match
/// with a wildcard arm.
#[derive(Debug)]
#[non_exhaustive]
pub enum Inbound {
    /// A peer opened an object: accept or reject it.
    Open(OpenRequest),
    /// A message on a queue (or a send on a session).
    Message(Delivery),
    /// A request on a session: answer it.
    Request(Request),
    /// A peer closed an object.
    Closed {
        /// The peer.
        peer: PeerId,
        /// The object.
        obj: Address,
        /// The reason given.
        reason: Option<String>,
    },
    /// The store failed for a peer (once per outage; it is retried with backoff) or
    /// recovered. While a load fails the peer's links are refused; while commits fail
    /// nothing is acknowledged. Also counted as `tether_substrate_store_failures`.
    Store {
        /// The peer.
        peer: PeerId,
        /// The call that failed or recovered.
        op: StoreOp,
        /// The error, or `None` when the store recovered.
        error: Option<StoreFailure>,
    },
}

/// A peer's `open`, awaiting this side's decision.
#[derive(Debug)]
pub struct OpenRequest {
    /// The peer.
    pub peer: PeerId,
    /// The object.
    pub obj: Address,
    /// Session or queue.
    pub kind: ObjKind,
    /// The capability token presented.
    pub cap: Option<String>,
    handle: CommandTx,
}

impl OpenRequest {
    /// Accepts: the object is live on both sides.
    pub async fn accept(self) -> Result<(), Error> {
        let obj = self.obj;
        send_control(&self.handle, |reply| {
            let decide = peer::Command::Decide { obj, reject: None };
            Command::App(decide, Some(Answer::Unit(reply)))
        })
        .await
    }

    /// Rejects with `code` (e.g. `approval_denied`).
    pub async fn reject(self, code: &str) -> Result<(), Error> {
        let obj = self.obj;
        send_control(&self.handle, |reply| {
            let reject = Some(code.to_owned());
            Command::App(
                peer::Command::Decide { obj, reject },
                Some(Answer::Unit(reply)),
            )
        })
        .await
    }
}

/// A delivered message, durable here. Call [`Delivery::done`] once it is processed: until
/// then it is delivered again after a restart (with the same `peer`, `obj`, `seq` and
/// `op_id`, which identify it).
#[derive(Debug)]
pub struct Delivery {
    /// The sender.
    pub peer: PeerId,
    /// The object.
    pub obj: Address,
    /// Its seq in the object's direction (strictly increasing per object).
    pub seq: Seq,
    /// The sender's op id.
    pub op_id: OpId,
    /// The body.
    pub body: Bytes,
    handle: CommandTx,
}

impl Delivery {
    /// The app is done with it: its durable copy is dropped.
    pub fn done(self) {
        let consume = peer::Command::Consume {
            obj: self.obj,
            seq: self.seq,
        };
        self.handle.control(Command::App(consume, None));
    }
}

/// A request from a peer; answer with [`Request::respond`] (any number of times) then
/// [`Request::end`] or [`Request::fail`]. Until it is ended it is delivered again after a
/// restart.
#[derive(Debug)]
pub struct Request {
    /// The requester.
    pub peer: PeerId,
    /// The session.
    pub obj: Address,
    /// Its seq.
    pub seq: Seq,
    /// The req's op id.
    pub req_id: OpId,
    /// The body.
    pub body: Bytes,
    handle: CommandTx,
}

impl Request {
    /// A partial answer (`res`).
    pub async fn respond(&self, body: impl Into<Bytes>) -> Result<(), Error> {
        self.answer(Verb::Res, Some(body.into()), None).await
    }

    /// The final answer (`end`); the request is consumed with it, atomically.
    pub async fn end(self, body: impl Into<Bytes>) -> Result<(), Error> {
        self.answer(Verb::End, Some(body.into()), None).await
    }

    /// A final error answer with `code`.
    pub async fn fail(self, code: &str) -> Result<(), Error> {
        self.answer(Verb::Err, None, Some(code.to_owned())).await
    }

    async fn answer(
        &self,
        verb: Verb,
        body: Option<Bytes>,
        code: Option<String>,
    ) -> Result<(), Error> {
        let (obj, req_id) = (self.obj.clone(), self.req_id.clone());
        send_control(&self.handle, |reply| {
            let answer = peer::Command::Answer {
                obj,
                req_id,
                verb,
                body,
                code,
            };
            Command::App(answer, Some(Answer::Unit(reply)))
        })
        .await
    }
}

/// Resolves when the peer's task answers. The command is issued when the `Pending` is
/// created, so several can be in flight at once and keep their order; when the peer's command
/// lane is full ([`SUBSTRATE_COMMANDS_MAX`]) the command waits inside the `Pending`, behind
/// the ones issued before it, and dropping the `Pending` then withdraws it.
///
/// [`SUBSTRATE_COMMANDS_MAX`]: tether_core::limits::SUBSTRATE_COMMANDS_MAX
pub struct Pending<T> {
    /// The command while it waits for room in the lane.
    slot: Option<Arc<Slot>>,
    rx: oneshot::Receiver<Result<T, Error>>,
    /// When it was issued and the histogram its latency goes to, once it succeeds.
    latency: Option<(std::time::Instant, &'static str)>,
}

impl<T> std::fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("waiting_for_room", &self.slot.is_some())
            .finish()
    }
}

impl<T> Future for Pending<T> {
    type Output = Result<T, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let result = Pin::new(&mut self.rx)
            .poll(cx)
            .map(|result| result.unwrap_or(Err(Error::Shutdown)));
        if let Poll::Ready(outcome) = &result {
            self.slot = None;
            if let (Ok(_), Some((issued, metric))) = (outcome, self.latency.take()) {
                metrics::histogram!(metric).record(issued.elapsed().as_secs_f64() * 1e3);
            }
        }
        result
    }
}

/// Issues an op command (bounded lane).
fn send_command<T>(
    handle: &CommandTx,
    command: impl FnOnce(commands::Reply1<T>) -> Command,
) -> Pending<T> {
    let (reply, rx) = oneshot::channel();
    let slot = match handle.issue(command(reply)) {
        Issued::Queued => None,
        Issued::Waiting(slot) => Some(slot),
    };
    Pending {
        slot,
        rx,
        latency: None,
    }
}

/// Sends a control command (answers to deliveries; never held back).
fn send_control<T>(
    handle: &CommandTx,
    command: impl FnOnce(commands::Reply1<T>) -> Command,
) -> Pending<T> {
    let (reply, rx) = oneshot::channel();
    handle.control(command(reply));
    Pending {
        slot: None,
        rx,
        latency: None,
    }
}

/// App commands waiting for a peer's task (see [`Peer::backlog`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Backlog {
    /// Commands in the peer's op lane.
    pub queued: usize,
    /// Commands held in callers' futures until the lane has room.
    pub waiting: usize,
}

/// A remote peer.
#[derive(Debug, Clone)]
pub struct Peer {
    id: PeerId,
    handle: CommandTx,
}

impl Peer {
    /// Its id.
    pub fn id(&self) -> &PeerId {
        &self.id
    }

    /// Drops the current link to this peer as a network cut would (nothing is lost: ops not
    /// yet acknowledged are resent on the next link, which the dialing side makes with its
    /// backoff). For tests and demos of what a disconnect does.
    pub fn disconnect(&self) {
        self.handle.control(Command::Disconnect);
    }

    /// Opens a queue at `obj`; resolves when the peer accepts it.
    pub async fn open_queue(&self, obj: &str) -> Result<Queue, Error> {
        self.open(ObjKind::Queue, obj, None).await?;
        Ok(Queue(self.object(obj)))
    }

    /// Opens a session at `obj`; resolves when the peer accepts it.
    pub async fn open_session(&self, obj: &str) -> Result<Session, Error> {
        self.open(ObjKind::Session, obj, None).await?;
        Ok(Session(self.object(obj)))
    }

    /// Opens an object of `kind` presenting capability token `cap`.
    pub async fn open(&self, kind: ObjKind, obj: &str, cap: Option<&str>) -> Result<(), Error> {
        let (obj, cap) = (ObjName::new(obj), cap.map(str::to_owned));
        send_command(&self.handle, |reply| {
            let open = peer::Command::Open { kind, obj, cap };
            Command::App(open, Some(Answer::Unit(reply)))
        })
        .await
    }

    /// A handle on queue `obj`, already open (e.g. recovered after a restart).
    pub fn queue(&self, obj: &str) -> Queue {
        Queue(self.object(obj))
    }

    /// A handle on session `obj`, already open.
    pub fn session(&self, obj: &str) -> Session {
        Session(self.object(obj))
    }

    /// How many app commands wait for this peer's task: `queued` in its op lane (at most
    /// [`SUBSTRATE_COMMANDS_MAX`]) and `waiting` in callers' futures for room in it.
    ///
    /// [`SUBSTRATE_COMMANDS_MAX`]: tether_core::limits::SUBSTRATE_COMMANDS_MAX
    pub fn backlog(&self) -> Backlog {
        let (queued, waiting) = self.handle.backlog();
        Backlog { queued, waiting }
    }

    fn object(&self, obj: &str) -> Object {
        Object {
            obj: ObjName::new(obj),
            handle: self.handle.clone(),
        }
    }
}

#[derive(Debug, Clone)]
struct Object {
    /// Held in place when short: a send copies it rather than allocating.
    obj: ObjName,
    handle: CommandTx,
}

impl Object {
    fn send(&self, body: Bytes, wait: bool) -> Pending<OpId> {
        let obj = self.obj.clone();
        let mut pending = send_command(&self.handle, |reply| {
            let send = peer::Command::Send { obj, body, wait };
            Command::App(send, Some(Answer::Sent(reply)))
        });
        pending.latency = Some((std::time::Instant::now(), metric::ACK_LATENCY_MS));
        pending
    }

    fn request(&self, body: Bytes, wait: bool) -> ReplyStream {
        let obj = self.obj.clone();
        let (reply, mut stream) = reply_stream(self.handle.clone());
        let command = Command::App(
            peer::Command::Req { obj, body, wait },
            Some(Answer::Req(reply)),
        );
        if let Issued::Waiting(slot) = self.handle.issue(command) {
            stream.slot = Some(slot);
        }
        stream
    }

    fn close(&self, reason: &str) -> Pending<()> {
        let (obj, reason) = (self.obj.clone(), reason.to_owned());
        send_command(&self.handle, |reply| {
            let close = peer::Command::Close { obj, reason };
            Command::App(close, Some(Answer::Unit(reply)))
        })
    }
}

/// A queue: one-way durable messages, in order.
#[derive(Debug, Clone)]
pub struct Queue(Object);

impl Queue {
    /// Sends `body`; resolves to its op id once it is durable at the peer (hop ack). The op
    /// is queued when this is called, so sends issued one after another keep their order
    /// and can be awaited together. When the object's outbox is full (the peer's app is
    /// behind) it waits for room: backpressure reaches the caller, nothing is dropped.
    pub fn send(&self, body: impl Into<Bytes>) -> Pending<OpId> {
        self.0.send(body.into(), true)
    }

    /// Like [`Queue::send`], but resolves at once to
    /// `Err(Error::Command(CommandError::QueueFull))` when the object's outbox is full.
    pub fn try_send(&self, body: impl Into<Bytes>) -> Pending<OpId> {
        self.0.send(body.into(), false)
    }

    /// Closes the queue; ops sent before still go first.
    pub fn close(&self, reason: &str) -> Pending<()> {
        self.0.close(reason)
    }
}

/// A session: requests with answers, in order.
#[derive(Debug, Clone)]
pub struct Session(Object);

impl Session {
    /// Sends a request; resolves to the peer's whole answer (its `res` parts gathered, at most
    /// [`SUBSTRATE_REPLY_BYTES_MAX`] bytes). Issued when called, like [`Queue::send`]; waits
    /// for outbox room when full. Use [`Session::request`] to read a long answer as it comes.
    ///
    /// [`SUBSTRATE_REPLY_BYTES_MAX`]: tether_core::limits::SUBSTRATE_REPLY_BYTES_MAX
    pub fn req(
        &self,
        body: impl Into<Bytes>,
    ) -> impl Future<Output = Result<Reply, Error>> + Send + 'static {
        self.request(body).collect()
    }

    /// Like [`Session::req`], but fails at once with `CommandError::QueueFull` when full.
    pub fn try_req(
        &self,
        body: impl Into<Bytes>,
    ) -> impl Future<Output = Result<Reply, Error>> + Send + 'static {
        self.0.request(body.into(), false).collect()
    }

    /// Sends a request whose answer is read part by part as it arrives (a stream of `res`
    /// parts, then `end`); unread parts are bounded (see [`ReplyStream`]).
    pub fn request(&self, body: impl Into<Bytes>) -> ReplyStream {
        self.0.request(body.into(), true)
    }

    /// A one-way message on the session; resolves at the hop ack. Waits for room when full.
    pub fn send(&self, body: impl Into<Bytes>) -> Pending<OpId> {
        self.0.send(body.into(), true)
    }

    /// Like [`Session::send`], but fails at once with `CommandError::QueueFull` when full.
    pub fn try_send(&self, body: impl Into<Bytes>) -> Pending<OpId> {
        self.0.send(body.into(), false)
    }

    /// Closes the session.
    pub fn close(&self, reason: &str) -> Pending<()> {
        self.0.close(reason)
    }
}

/// What the substrate shell publishes through the `metrics` facade besides each machine's
/// counters (`tether_substrate_<counter>`, labelled by peer): docs/spec/substrate.md's signals
/// under Prometheus-style names.
pub mod metric {
    use tether_core::substrate::LinkClose;

    /// Histogram: from a send to its hop ack (`substrate.ack.latency_ms`), in milliseconds.
    pub const ACK_LATENCY_MS: &str = "tether_substrate_ack_latency_ms";
    /// Histogram: from a request to its answer's end (`substrate.answer.latency_ms`).
    pub const ANSWER_LATENCY_MS: &str = "tether_substrate_answer_latency_ms";
    /// Histogram: one store commit, its sync included when the store syncs.
    pub const STORE_COMMIT_MS: &str = "tether_store_commit_ms";
    /// Counter: links that came up (`substrate.conn.ready`), labelled by peer.
    pub const CONN_READY: &str = "tether_substrate_conn_ready";
    /// Counter: links that ended (`substrate.conn.ended`), labelled by peer and cause
    /// (`closed` by the transport, or core's `handshake`, `decode`, `dead`, `violation`).
    pub const CONN_ENDED: &str = "tether_substrate_conn_ended";

    /// The cause label of a link core dropped.
    pub fn close_cause(close: &LinkClose) -> &'static str {
        match close {
            LinkClose::Handshake { .. } => "handshake",
            LinkClose::Decode(_) => "decode",
            LinkClose::Dead => "dead",
            LinkClose::Violation(_) => "violation",
            _ => "other",
        }
    }
}

/// Reads the time the machines run on, in milliseconds (wall clock by default, so that TTLs
/// and retention survive restarts).
pub type Clock = Arc<dyn Fn() -> Time + Send + Sync>;

enum Entropy {
    Os,
    Seeded(Xoshiro256PlusPlus),
}

/// What every peer task shares.
struct Shared {
    local: PeerId,
    transport: Arc<dyn Transport>,
    store: Arc<dyn Store>,
    auth: Auth,
    authorizer: Arc<Authorizer>,
    features: Vec<String>,
    config: Config,
    clock: Clock,
    entropy: Mutex<Entropy>,
    inbound_tx: mpsc::UnboundedSender<Inbound>,
    peers: Mutex<HashMap<PeerId, PeerTask>>,
    /// Bumped each time a peer task ends and leaves the table.
    tasks_ended: tokio::sync::watch::Sender<u64>,
    /// Peer tasks an inbound link may create at most (a hostile dialer claiming ever new ids
    /// cannot exhaust memory).
    max_peers: usize,
    /// Set by [`Substrate::shutdown`]: no peer task starts after it.
    closing: AtomicBool,
    /// Inbound handshakes in progress, under [`SUBSTRATE_HANDSHAKES_IN_PROGRESS_MAX`].
    handshakes: crate::handshakes::SharedHandshakes,
    /// What became of inbound links.
    preauth: preauth::Counters,
}

impl Shared {
    fn random_bytes(&self) -> [u8; 16] {
        let mut bytes = [0u8; 16];
        match &mut *self.entropy.lock().unwrap_or_else(PoisonError::into_inner) {
            Entropy::Os => rand::rngs::SysRng
                .try_fill_bytes(&mut bytes)
                .expect("the OS provides randomness"),
            Entropy::Seeded(rng) => rng.fill_bytes(&mut bytes),
        }
        bytes
    }

    fn random_u64(&self) -> u64 {
        let bytes = self.random_bytes();
        u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"))
    }

    /// Publishes a machine's counters through the `metrics` facade.
    fn publish(&self, peer: &PeerId, machine: &tether_core::substrate::Machine) {
        let Ok(serde_json::Value::Object(stats)) = serde_json::to_value(machine.stats()) else {
            return;
        };
        for (name, value) in stats {
            let metric = format!("tether_substrate_{name}");
            match value {
                serde_json::Value::Number(n) => {
                    metrics::counter!(metric, "peer" => peer.as_str().to_owned())
                        .absolute(n.as_u64().unwrap_or(0));
                }
                serde_json::Value::Object(by_key) => {
                    for (key, n) in by_key {
                        metrics::gauge!(metric.clone(), "peer" => peer.as_str().to_owned(), "key" => key)
                            .set(n.as_u64().unwrap_or(0) as f64);
                    }
                }
                _ => {}
            }
        }
    }
}

/// A peer's task, the sender of its commands, and whether the app named the peer (then the
/// task never ends for being idle).
struct PeerTask {
    handle: CommandTx,
    task: JoinHandle<()>,
    pinned: Arc<AtomicBool>,
}

struct Inner {
    shared: Arc<Shared>,
    inbound_rx: Mutex<Option<mpsc::UnboundedReceiver<Inbound>>>,
    accept: Mutex<Option<JoinHandle<()>>>,
}

/// A node's substrate: one task per peer, an accept loop, a store.
#[derive(Clone)]
pub struct Substrate {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Substrate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Substrate")
            .field("local", &self.inner.shared.local)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Substrate`]. Authentication and the authorize chain are required choices.
pub struct SubstrateBuilder {
    local: PeerId,
    transport: Arc<dyn Transport>,
    auth: Option<Auth>,
    authorizer: Option<Authorizer>,
    store: Arc<dyn Store>,
    config: Config,
    features: Vec<String>,
    clock: Option<Clock>,
    seed: Option<u64>,
    max_peers: usize,
}

impl std::fmt::Debug for SubstrateBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubstrateBuilder")
            .field("local", &self.local)
            .field("auth", &self.auth)
            .finish_non_exhaustive()
    }
}

impl Substrate {
    /// Starts building the substrate of node `local` over `transport`.
    pub fn builder(local: PeerId, transport: impl Transport) -> SubstrateBuilder {
        SubstrateBuilder {
            local,
            transport: Arc::new(transport),
            auth: None,
            authorizer: None,
            store: Arc::new(MemoryStore::new()),
            config: Config::default(),
            features: Vec::new(),
            clock: None,
            seed: None,
            max_peers: SUBSTRATE_PEERS_DEFAULT,
        }
    }

    /// The peer `id` (its task starts on first use; it dials if the transport can reach it).
    pub fn peer(&self, id: &PeerId) -> Peer {
        Peer {
            id: id.clone(),
            handle: self
                .inner
                .shared
                .handle(id, false)
                .expect("the app's peers are never capped"),
        }
    }

    /// What peers send this node. Taken once; later calls return `None`.
    pub fn inbound(&self) -> Option<mpsc::UnboundedReceiver<Inbound>> {
        self.inner
            .inbound_rx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Peers with a running task (a link, durable state, or named by the app).
    pub fn peers(&self) -> Vec<PeerId> {
        let peers = self
            .inner
            .shared
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut ids: Vec<PeerId> = peers
            .iter()
            .filter(|(_, entry)| !entry.task.is_finished())
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }

    /// What became of inbound links: verified, bound to a task, dropped and why.
    pub fn link_counts(&self) -> LinkCounts {
        let (busy, in_progress) = {
            let handshakes = self.inner.shared.handshakes.lock();
            (handshakes.refused(), handshakes.in_progress())
        };
        self.inner.shared.preauth.snapshot(busy, in_progress)
    }

    /// Inbound links settled (bound to a peer's task, or dropped for any reason), counted:
    /// wait on it to know the substrate has judged every link handed to it so far.
    pub fn links_settled(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.shared.preauth.settled.subscribe()
    }

    /// Changes each time a peer task ends (its link gone and nothing left to do) and leaves
    /// the table: wait on it instead of polling [`Substrate::peers`].
    pub fn peer_tasks_ended(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.shared.tasks_ended.subscribe()
    }

    /// This node's id.
    pub fn local(&self) -> &PeerId {
        &self.inner.shared.local
    }

    /// Stops accepting, commits what each peer task has pending, drops every link and waits
    /// for every task. Pending operations resolve with [`Error::Shutdown`].
    pub async fn shutdown(&self) {
        {
            // Under the peers lock: a handshake finishing now starts no task after the drain.
            let _peers = self
                .inner
                .shared
                .peers
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            self.inner.shared.closing.store(true, Ordering::SeqCst);
        }
        let accept = self
            .inner
            .accept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(accept) = accept {
            accept.abort();
            // Its clone of the shared state (and so of the store) is gone once it has ended.
            let _ = accept.await;
        }
        let peers: Vec<_> = self
            .inner
            .shared
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .collect();
        for (_, PeerTask { handle, task, .. }) in peers {
            let (done, wait) = oneshot::channel();
            handle.control(Command::Shutdown(done));
            let _ = wait.await;
            let _ = task.await;
        }
    }
}

impl Shared {
    /// The command sender of `id`'s task, starting it (from the peer's durable state) when
    /// there is none. `None` when an inbound link would exceed the peer cap.
    fn handle(self: &Arc<Self>, id: &PeerId, inbound: bool) -> Option<CommandTx> {
        self.handle_with(id, inbound, None)
    }

    /// As [`Shared::handle`], with `first` in the task's lanes before a new task starts: a
    /// task started for an inbound link finds the link there the moment its state is loaded,
    /// so it can never judge itself idle and end before the link arrives. `first` is dropped
    /// (closing an inbound link) when `None` is returned.
    fn handle_with(
        self: &Arc<Self>,
        id: &PeerId,
        inbound: bool,
        first: Option<Command>,
    ) -> Option<CommandTx> {
        let mut peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        let running = peers.get(id).filter(|entry| !entry.task.is_finished());
        let admission = peer::admit(
            if inbound { Origin::Link } else { Origin::App },
            self.closing.load(Ordering::SeqCst),
            running.is_some(),
            peers.len(),
            self.max_peers,
        );
        match (admission, running) {
            (Admission::Running, Some(entry)) => {
                if !inbound {
                    entry.pinned.store(true, Ordering::SeqCst);
                    entry.handle.control(Command::Reach);
                }
                if let Some(first) = first {
                    entry.handle.control(first);
                }
                return Some(entry.handle.clone());
            }
            (Admission::Refused(reason), _) => {
                warn!(
                    peer = id.as_str(),
                    max = self.max_peers,
                    reason = reason.as_str(),
                    "inbound link refused"
                );
                return None;
            }
            // Running is only said of a peer whose task runs.
            (Admission::Start | Admission::Running, _) => {}
        }
        let (tx, rx) = commands::channel();
        if let Some(first) = first {
            tx.control(first);
        }
        let pinned = Arc::new(AtomicBool::new(!inbound));
        // The task loads the peer's state itself (its peer retries while the store fails), so
        // a failing store never starts a peer empty and never blocks this lock.
        let task = tokio::spawn({
            let (shared, peer, handle, pinned) =
                (self.clone(), id.clone(), tx.clone(), pinned.clone());
            async move {
                PeerExecutor::new(peer, shared, rx, handle, pinned, inbound)
                    .run()
                    .await
            }
        });
        let entry = PeerTask {
            handle: tx.clone(),
            task,
            pinned,
        };
        peers.insert(id.clone(), entry);
        Some(tx)
    }

    /// The store failed for `peer`: logged and counted on every failure, told to the app on the
    /// first of an outage.
    fn store_failed(&self, peer: &PeerId, op: StoreOp, error: &StoreFailure, failures: u32) {
        warn!(%error, peer = peer.as_str(), op = op.as_str(), failures, "store failed; retrying");
        metrics::counter!("tether_substrate_store_failures", "peer" => peer.as_str().to_owned(), "op" => op.as_str())
            .increment(1);
        if failures == 1 {
            let error = Some(error.clone());
            let _ = self.inbound_tx.send(Inbound::Store {
                peer: peer.clone(),
                op,
                error,
            });
        }
    }

    /// The store works again for `peer` after failing.
    fn store_recovered(&self, peer: &PeerId, op: StoreOp) {
        info!(peer = peer.as_str(), op = op.as_str(), "store recovered");
        let _ = self.inbound_tx.send(Inbound::Store {
            peer: peer.clone(),
            op,
            error: None,
        });
    }

    /// A peer task ended on its own: forget it (unless a newer task took its place).
    fn forget(&self, id: &PeerId, handle: &CommandTx) {
        let mut peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        if peers
            .get(id)
            .is_some_and(|entry| entry.handle.same_channel(handle))
        {
            peers.remove(id);
            drop(peers);
            self.tasks_ended
                .send_modify(|ended| *ended = ended.wrapping_add(1));
        }
    }
}

impl SubstrateBuilder {
    /// How links are authenticated (required; `Auth::None` is an explicit opt-out).
    pub fn auth(mut self, auth: Auth) -> Self {
        self.auth = Some(auth);
        self
    }

    /// The authorize chain every inbound op passes (required; `AllowAll` is an explicit
    /// opt-out).
    pub fn authorize(mut self, authorizer: Authorizer) -> Self {
        self.authorizer = Some(authorizer);
        self
    }

    /// Where durable state lives (default: [`MemoryStore`], lost on restart).
    pub fn store(mut self, store: Arc<dyn Store>) -> Self {
        self.store = store;
        self
    }

    /// Machine settings.
    pub fn config(mut self, config: Config) -> Self {
        self.config = config;
        self
    }

    /// Optional features offered in the handshake.
    pub fn features(mut self, features: Vec<String>) -> Self {
        self.features = features;
        self
    }

    /// The clock (default: wall-clock milliseconds since the Unix epoch).
    pub fn clock(mut self, clock: Clock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Most peer tasks inbound links may create (default 1,024); peers with durable state
    /// and peers the app names are always served.
    pub fn max_peers(mut self, max: usize) -> Self {
        self.max_peers = max;
        self
    }

    /// Draws nonces, op-id prefixes and redial jitter from a seeded generator instead of the
    /// OS: for deterministic simulation and tests only.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Starts the accept loop and a task for every peer with persisted state. Must be
    /// called inside a tokio runtime.
    pub fn start(self) -> Result<Substrate, BuildError> {
        let auth = self.auth.ok_or(BuildError::AuthRequired)?;
        let authorizer = self.authorizer.ok_or(BuildError::AuthorizeRequired)?;
        if auth == Auth::None {
            warn!(
                local = self.local.as_str(),
                "authentication is off (Auth::None)"
            );
        }
        let (inbound_tx, inbound_rx) = mpsc::unbounded_channel();
        let entropy = match self.seed {
            Some(seed) => Entropy::Seeded(Xoshiro256PlusPlus::seed_from_u64(seed)),
            None => Entropy::Os,
        };
        let shared = Arc::new(Shared {
            local: self.local,
            transport: self.transport,
            store: self.store,
            auth,
            authorizer: Arc::new(authorizer),
            features: self.features,
            config: self.config,
            clock: self.clock.unwrap_or_else(|| Arc::new(wall_clock)),
            entropy: Mutex::new(entropy),
            inbound_tx,
            peers: Mutex::default(),
            tasks_ended: tokio::sync::watch::channel(0).0,
            max_peers: self.max_peers,
            closing: AtomicBool::new(false),
            handshakes: crate::handshakes::SharedHandshakes::new(
                SUBSTRATE_HANDSHAKES_IN_PROGRESS_MAX,
            ),
            preauth: preauth::Counters::default(),
        });
        let inner = Arc::new(Inner {
            shared: shared.clone(),
            inbound_rx: Mutex::new(Some(inbound_rx)),
            accept: Mutex::default(),
        });
        let mut recovered = shared.store.peers()?;
        recovered.sort();
        for peer in recovered {
            shared.handle(&peer, false);
        }
        let weak = Arc::downgrade(&inner);
        let accept = tokio::spawn(async move {
            // Each inbound link's handshake runs here, before any peer state is touched; they
            // are aborted with this task (at shutdown).
            let mut handshakes = tokio::task::JoinSet::new();
            loop {
                let transport = match weak.upgrade() {
                    Some(inner) => inner.shared.transport.clone(),
                    None => return,
                };
                let Ok((peer, link)) = transport.accept().await else {
                    return;
                };
                while handshakes.try_join_next().is_some() {}
                let Some(inner) = weak.upgrade() else { return };
                let shared = inner.shared.clone();
                let source = link.source;
                if !shared.handshakes.lock().begin_from(source) {
                    warn!(
                        peer = peer.as_str(),
                        "too many inbound handshakes; link dropped"
                    );
                    shared.preauth.settle();
                    continue;
                }
                handshakes.spawn(async move {
                    // The slot is given back however the task ends (a panic included).
                    let slot = preauth::Slot(&shared, source);
                    let verified = preauth::verify(&shared, &peer, link).await;
                    drop(slot);
                    if let Some(verified) = verified {
                        let attach = Command::Attach(Box::new(verified));
                        match shared.handle_with(&peer, true, Some(attach)) {
                            Some(_) => {
                                shared.preauth.bound.fetch_add(1, Ordering::Relaxed);
                            }
                            None => {
                                shared.preauth.at_cap.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    shared.preauth.settle();
                });
            }
        });
        *inner.accept.lock().unwrap_or_else(PoisonError::into_inner) = Some(accept);
        Ok(Substrate { inner })
    }
}

fn wall_clock() -> Time {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    Time::from_millis(since_epoch.as_millis() as u64)
}
