//! The master side for programs that serve caps: [`Host`] runs a
//! [`tether_core::switch::host::Host`] machine over one connection to a switch (the machine
//! answers HELLO, the identity check and heartbeats) and runs one handler task per request,
//! with streaming input and output under credit.
//!
//! ```no_run
//! # async fn demo(stream: tokio::net::UnixStream) {
//! use tether::switch::host::Host;
//! Host::new("upper")
//!     .handler("cap:in=media:text;out=media:upper", |mut request| async move {
//!         let input = request.read_all().await;
//!         let _ = request.respond("output", "media:upper", [input.to_ascii_uppercase()]).await;
//!         let _ = request.end().await;
//!     })
//!     .serve(stream)
//!     .await
//!     .ok();
//! # }
//! ```

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;

use bytes::Bytes;
use tether_core::cap::{CapUrn, ParseError};
use tether_core::limits::{SWITCH_HOST_COMMANDS_MAX, SWITCH_HOST_WRITER_FRAMES_MAX};
use tether_core::request::RequestKey;
use tether_core::switch::host::{Host as Machine, HostError, HostEvent, HostWriteError};
use tether_core::switch::side::{stream_frames, HeldWrites, WriteError};
use tether_core::switch::ErrCode;
use tether_core::time::Time;
use tether_core::wire::bifaci::{BifaciError, Frame, FrameType, MessageId};
use tether_core::wire::DecodeError;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, Instant};

pub use tether_core::switch::host::{HostConfig, HostStats};
pub use tether_core::switch::Limits;

use super::conn::{FrameReader, FrameWriter, Incoming};
use super::{gather, FlowReader, FlowSender};
use tokio_stream::StreamExt;

type Handler = Arc<dyn Fn(HostRequest) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// Why serving ended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HostServeError {
    /// The switch broke the protocol (or the bytes were not frames).
    #[error("protocol: {0}")]
    Protocol(#[source] ProtocolFault),
    /// The request is gone (ended, cancelled) or the connection closed.
    #[error("the request is no longer live")]
    Gone,
    /// This side may not write the frame now.
    #[error(transparent)]
    Write(#[from] WriteError),
    /// The switch stopped reading until the frames queued for it reached
    /// [`SWITCH_HOST_WRITER_FRAMES_MAX`]: the connection was dropped.
    #[error("the switch stopped reading")]
    Backlogged,
    /// A cap given to [`HostHandle::add_handler`] does not parse.
    #[error("bad cap: {0}")]
    BadCap(#[source] ParseError),
    /// A peer request was answered with ERR carrying this code.
    #[error("answered with error {0}")]
    Failed(ErrCode),
    /// [`PeerCall::collect`] would hold more than this many bytes
    /// ([`tether_core::limits::SWITCH_COLLECT_BYTES_MAX`]).
    #[error("the answer is longer than {0} bytes")]
    TooLarge(usize),
}

impl From<super::Unfinished> for HostServeError {
    fn from(end: super::Unfinished) -> Self {
        match end {
            super::Unfinished::Err(code) => Self::Failed(code),
            super::Unfinished::TooLarge => {
                Self::TooLarge(tether_core::limits::SWITCH_COLLECT_BYTES_MAX)
            }
        }
    }
}

/// How the switch broke the protocol ([`HostServeError::Protocol`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolFault {
    /// The bytes were not frames (the stream offset says where).
    #[error(transparent)]
    Undecodable(#[from] DecodeError<BifaciError>),
    /// The frames broke the host's side of the protocol (core's verdict).
    #[error(transparent)]
    Broken(#[from] HostError),
}

/// A program serving caps to a switch.
pub struct Host {
    config: HostConfig,
    /// One per cap of `config.caps`, in the same order.
    handlers: Vec<(CapUrn, Handler)>,
    tx: mpsc::Sender<Command>,
    commands: mpsc::Receiver<Command>,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("name", &self.config.name)
            .field("caps", &self.config.caps)
            .finish_non_exhaustive()
    }
}

impl Host {
    /// A host named `name` with default limits and no caps yet.
    pub fn new(name: &str) -> Self {
        let mut prefix = [0u8; 8];
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        prefix.copy_from_slice(&(nanos ^ u64::from(std::process::id())).to_be_bytes());
        let (tx, commands) = mpsc::channel(SWITCH_HOST_COMMANDS_MAX);
        Self {
            config: HostConfig::new(name, Vec::new(), prefix),
            handlers: Vec::new(),
            tx,
            commands,
        }
    }

    /// A handle that changes this host's handlers while it serves; the switch learns the new
    /// manifest at once (RELAY_NOTIFY).
    pub fn handle(&self) -> HostHandle {
        HostHandle {
            tx: self.tx.clone(),
        }
    }

    /// The limits proposed to the switch.
    pub fn limits(mut self, limits: Limits) -> Self {
        self.config.limits = limits;
        self
    }

    /// Serves `cap` with `handler`, run once per request routed here. A cap that does not
    /// parse is ignored (and not advertised).
    pub fn handler<F, Fut>(mut self, cap: &str, handler: F) -> Self
    where
        F: Fn(HostRequest) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        if let Ok(parsed) = CapUrn::parse(cap) {
            set_handler(&mut self.handlers, parsed, Some(boxed(handler)));
            self.config.caps = caps_of(&self.handlers);
        }
        self
    }

    /// Serves requests arriving over `stream` (a connection to a switch) until it closes.
    pub async fn serve<S>(self, stream: S) -> Result<(), HostServeError>
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (reader, writer) = tokio::io::split(stream);
        let (done_tx, done) = mpsc::unbounded_channel();
        let mut task = HostTask {
            machine: Machine::new(self.config, Time::ZERO),
            handlers: self.handlers,
            epoch: Instant::now(),
            writer: FrameWriter::new(Box::new(writer), SWITCH_HOST_WRITER_FRAMES_MAX),
            tx: self.tx,
            commands: self.commands,
            served: BTreeMap::new(),
            done_tx,
            done,
            next_serial: 0,
            calls: BTreeMap::new(),
            parked: BTreeMap::new(),
        };
        let result = task.run(FrameReader::new(reader)).await;
        for (_, served) in std::mem::take(&mut task.served) {
            served.task.abort();
        }
        if result.is_ok() {
            // The switch hung up: what is queued goes out (or fails), then the write half
            // closes. A switch that broke the protocol or stopped reading is not owed the rest.
            task.writer.finish().await;
        }
        result
    }
}

/// Changes a serving [`Host`]'s handlers (see [`Host::handle`]). Cheap to clone.
#[derive(Debug, Clone)]
pub struct HostHandle {
    tx: mpsc::Sender<Command>,
}

impl HostHandle {
    /// Serves `cap` with `handler` from now on (replacing the handler of an equal cap). When
    /// this returns, the new manifest is queued for the switch ahead of anything the host
    /// writes later.
    pub async fn add_handler<F, Fut>(&self, cap: &str, handler: F) -> Result<(), HostServeError>
    where
        F: Fn(HostRequest) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let cap = CapUrn::parse(cap).map_err(HostServeError::BadCap)?;
        self.set(cap, Some(boxed(handler))).await.map(drop)
    }

    /// Stops serving `cap` (requests already running finish); `false` when no handler served
    /// it. The new manifest is queued as with [`HostHandle::add_handler`].
    pub async fn remove_handler(&self, cap: &str) -> Result<bool, HostServeError> {
        let cap = CapUrn::parse(cap).map_err(HostServeError::BadCap)?;
        self.set(cap, None).await
    }

    /// What the host holds and has counted; `Gone` once it stopped serving.
    pub async fn state(&self) -> Result<HostState, HostServeError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::State { reply })
            .await
            .map_err(|_| HostServeError::Gone)?;
        rx.await.map_err(|_| HostServeError::Gone)
    }

    async fn set(&self, cap: CapUrn, handler: Option<Handler>) -> Result<bool, HostServeError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::SetHandler {
                cap,
                handler,
                reply,
            })
            .await
            .map_err(|_| HostServeError::Gone)?;
        rx.await.map_err(|_| HostServeError::Gone)
    }
}

fn boxed<F, Fut>(handler: F) -> Handler
where
    F: Fn(HostRequest) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    Arc::new(move |request| Box::pin(handler(request)))
}

/// Sets (or with `None` removes) the handler of `cap`: `true` when one was there.
fn set_handler(
    handlers: &mut Vec<(CapUrn, Handler)>,
    cap: CapUrn,
    handler: Option<Handler>,
) -> bool {
    let existing = handlers.iter().position(|(served, _)| *served == cap);
    match (existing, handler) {
        (Some(index), Some(handler)) => {
            handlers[index].1 = handler;
            true
        }
        (Some(index), None) => {
            handlers.remove(index);
            true
        }
        (None, Some(handler)) => {
            handlers.push((cap, handler));
            false
        }
        (None, None) => false,
    }
}

fn caps_of(handlers: &[(CapUrn, Handler)]) -> Vec<String> {
    handlers.iter().map(|(cap, _)| cap.to_string()).collect()
}

enum Command {
    SetHandler {
        cap: CapUrn,
        handler: Option<Handler>,
        reply: oneshot::Sender<bool>,
    },
    Write {
        key: RequestKey,
        frame: Frame,
        reply: oneshot::Sender<Result<(), HostServeError>>,
    },
    Consume {
        key: RequestKey,
        stream: Option<String>,
    },
    ConsumeLog {
        key: RequestKey,
        bytes: usize,
    },
    PeerRequest {
        cap: String,
        parent: Option<MessageId>,
        reply: oneshot::Sender<Result<PeerCall, HostServeError>>,
    },
    PeerWrite {
        rid: MessageId,
        frame: Frame,
        reply: oneshot::Sender<Result<(), HostServeError>>,
    },
    PeerConsume {
        rid: MessageId,
        stream: Option<String>,
    },
    PeerConsumeLog {
        rid: MessageId,
        bytes: usize,
    },
    State {
        reply: oneshot::Sender<HostState>,
    },
}

/// What a serving [`Host`] holds and has counted ([`HostHandle::state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostState {
    /// The machine's counters.
    pub stats: HostStats,
    /// Requests the machine holds (served, not yet ended or cancelled).
    pub machine_requests: usize,
    /// Requests the host holds a handler's state for.
    pub handlers_running: usize,
    /// Peer requests waiting for their answer.
    pub peer_calls: usize,
    /// Writes of handlers waiting for credit.
    pub parked_writes: usize,
}

/// One request routed to this host, handed to its handler.
#[derive(Debug)]
pub struct HostRequest {
    key: RequestKey,
    cap: String,
    policy: NetworkPolicy,
    input: FlowReader,
    tx: mpsc::Sender<Command>,
    cancelled: Arc<AtomicBool>,
}

impl HostRequest {
    /// The cap the requester asked for.
    pub fn cap(&self) -> &str {
        &self.cap
    }

    /// The switch's network policy when the request arrived (the switch tells it before any
    /// request; a handler honours it, e.g. no network under `offline`).
    pub fn policy(&self) -> NetworkPolicy {
        self.policy
    }

    /// The request's id.
    pub fn id(&self) -> MessageId {
        self.key.rid
    }

    /// Whether the switch cancelled it (then its input ends and writes fail `Gone`).
    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    /// The next input frame in order; `None` after the input's END, a cancel, or a stop of
    /// the request's feeds (then the handler should end the request). Each CHUNK is consumed
    /// (credit granted back) when the next frame is asked for.
    pub async fn next_input(&mut self) -> Option<Frame> {
        let key = self.key;
        if let Some(stream) = self.input.due() {
            let _ = self.tx.send(Command::Consume { key, stream }).await;
        }
        let bytes = self.input.due_log();
        if bytes > 0 {
            let _ = self.tx.send(Command::ConsumeLog { key, bytes }).await;
        }
        self.input.recv().await
    }

    /// Every input CHUNK's payload, concatenated, up to the input's END (or ERR), and at most
    /// [`tether_core::limits::SWITCH_COLLECT_BYTES_MAX`] of them: past it the rest of the
    /// input is drained unread and what was gathered is returned (read a longer input frame by
    /// frame with `next_input`).
    pub async fn read_all(&mut self) -> Vec<u8> {
        let mut body = Vec::new();
        while let Some(frame) = self.next_input().await {
            if let Some(end) = gather(&mut body, &frame) {
                if end == Err(super::Unfinished::TooLarge) {
                    // Past the bound: the rest is drained unread (its credit flows back).
                    while self.next_input().await.is_some() {}
                }
                break;
            }
        }
        body
    }

    /// Writes one answer frame; a CHUNK waits for the requester's credit.
    pub async fn write(&self, frame: Frame) -> Result<(), HostServeError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Write {
                key: self.key,
                frame,
                reply,
            })
            .await
            .map_err(|_| HostServeError::Gone)?;
        rx.await.map_err(|_| HostServeError::Gone)?
    }

    /// Writes a whole answer stream: STREAM_START, one CHUNK per item, STREAM_END.
    pub async fn respond<I, B>(
        &self,
        stream: &str,
        media: &str,
        chunks: I,
    ) -> Result<(), HostServeError>
    where
        I: IntoIterator<Item = B>,
        B: Into<Bytes>,
    {
        for frame in stream_frames(self.key.rid, stream, media, chunks) {
            self.write(frame).await?;
        }
        Ok(())
    }

    /// Ends the answer (END with `exit_code` 0, which capdag's readers require of success).
    pub async fn end(&self) -> Result<(), HostServeError> {
        let mut end = Frame::new(FrameType::End, self.key.rid);
        end.eof = Some(true);
        end.meta = Some(end_ok_meta());
        self.write(end).await
    }

    /// Ends the answer with an ERR carrying `code`, the failure's `class` (capdag's
    /// `attribution_class`: `input` is permanent, the others retryable) and `message`.
    pub async fn fail(
        &self,
        code: &str,
        class: ErrorClass,
        message: &str,
    ) -> Result<(), HostServeError> {
        let mut err = Frame::new(FrameType::Err, self.key.rid);
        err.meta = Some(error_meta(code, class, message));
        self.write(err).await
    }

    /// Calls another master's cap through the switch, on behalf of this request (cancelling
    /// this request cancels the call).
    pub async fn peer_request(&self, cap: &str) -> Result<PeerCall, HostServeError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::PeerRequest {
                cap: cap.to_owned(),
                parent: Some(self.key.rid),
                reply,
            })
            .await
            .map_err(|_| HostServeError::Gone)?;
        rx.await.map_err(|_| HostServeError::Gone)?
    }
}

/// A peer request this host made.
#[derive(Debug)]
pub struct PeerCall {
    rid: MessageId,
    answers: FlowReader,
    tx: mpsc::Sender<Command>,
}

impl PeerCall {
    /// Writes one input frame (a CHUNK waits for credit).
    pub async fn send(&self, frame: Frame) -> Result<(), HostServeError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::PeerWrite {
                rid: self.rid,
                frame,
                reply,
            })
            .await
            .map_err(|_| HostServeError::Gone)?;
        rx.await.map_err(|_| HostServeError::Gone)?
    }

    /// Writes a whole input stream: STREAM_START, one CHUNK per item, STREAM_END.
    pub async fn send_stream<I, B>(
        &self,
        stream: &str,
        media: &str,
        chunks: I,
    ) -> Result<(), HostServeError>
    where
        I: IntoIterator<Item = B>,
        B: Into<Bytes>,
    {
        for frame in stream_frames(self.rid, stream, media, chunks) {
            self.send(frame).await?;
        }
        Ok(())
    }

    /// Ends the input (END).
    pub async fn finish(&self) -> Result<(), HostServeError> {
        self.send(Frame::new(FrameType::End, self.rid)).await
    }

    /// The next answer frame in order; `None` after END or ERR.
    pub async fn next(&mut self) -> Option<Frame> {
        let rid = self.rid;
        if let Some(stream) = self.answers.due() {
            let _ = self.tx.send(Command::PeerConsume { rid, stream }).await;
        }
        let bytes = self.answers.due_log();
        if bytes > 0 {
            let _ = self.tx.send(Command::PeerConsumeLog { rid, bytes }).await;
        }
        self.answers.recv().await
    }

    /// The answer's CHUNK payloads concatenated; [`HostServeError::Failed`] with the ERR's
    /// code, [`HostServeError::TooLarge`] past
    /// [`tether_core::limits::SWITCH_COLLECT_BYTES_MAX`], or
    /// [`HostServeError::Gone`] when the answer ended without END or ERR.
    pub async fn collect(mut self) -> Result<Vec<u8>, HostServeError> {
        let mut body = Vec::new();
        while let Some(frame) = self.next().await {
            if let Some(end) = gather(&mut body, &frame) {
                return end.map(|()| body).map_err(HostServeError::from);
            }
        }
        Err(HostServeError::Gone)
    }
}

struct Served {
    /// Which start of the key this is (a handler's end names it, so that a late one never
    /// touches a later request of the same key).
    serial: u64,
    /// `None` once the switch stopped the request's feeds (CLOSE_STREAM): its input ends.
    input: Option<FlowSender>,
    cancelled: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

/// A request this host writes frames of: one it serves (the switch's XID and the request
/// id) or one of its own peer requests (no XID).
type Flow = (Option<MessageId>, MessageId);

type WriteReply = oneshot::Sender<Result<(), HostServeError>>;

struct HostTask {
    machine: Machine,
    handlers: Vec<(CapUrn, Handler)>,
    epoch: Instant,
    /// At most [`SWITCH_HOST_WRITER_FRAMES_MAX`] frames: a switch that stops reading gets its
    /// connection dropped.
    writer: FrameWriter<Box<dyn AsyncWrite + Send + Unpin>>,
    tx: mpsc::Sender<Command>,
    commands: mpsc::Receiver<Command>,
    served: BTreeMap<RequestKey, Served>,
    /// Handlers that ended (returned, panicked or were aborted), by key and serial: at most
    /// one per served request, so bounded by the served table.
    done_tx: mpsc::UnboundedSender<(RequestKey, u64)>,
    done: mpsc::UnboundedReceiver<(RequestKey, u64)>,
    next_serial: u64,
    calls: BTreeMap<MessageId, FlowSender>,
    /// Writes waiting for credit, per request, oldest first. Each is awaited by its handler,
    /// so a request has at most one per stream it writes.
    parked: BTreeMap<Flow, HeldWrites<WriteReply>>,
}

impl HostTask {
    fn now(&self) -> Time {
        Time::from_millis(self.epoch.elapsed().as_millis() as u64)
    }

    async fn run<R: AsyncRead + Unpin>(
        &mut self,
        mut incoming: FrameReader<R>,
    ) -> Result<(), HostServeError> {
        // The host speaks first: its RELAY_NOTIFY goes out before anything is read.
        self.drain()?;
        let written = std::future::poll_fn(|cx| Poll::Ready(self.writer.poll_write_queued(cx)));
        if let Poll::Ready(Err(_)) = written.await {
            return Ok(());
        }
        loop {
            let deadline = self.machine.poll_timeout().map_or_else(
                || self.epoch + std::time::Duration::from_secs(365 * 24 * 3600),
                |at| self.epoch + std::time::Duration::from_millis(at.as_millis()),
            );
            tokio::select! {
                message = incoming.next() => match message {
                    Some(Incoming::Frame(frame)) => {
                        let flows = [(frame.routing_id, frame.id), (None, frame.id)];
                        let now = self.now();
                        self.machine.handle_frame(now, frame);
                        self.failed()?;
                        // A frame of a request (its credit, say) may let its parked writes go.
                        for flow in flows {
                            self.retry_parked(flow);
                        }
                    }
                    Some(Incoming::Undecodable(error)) => {
                        return Err(HostServeError::Protocol(error.into()));
                    }
                    Some(Incoming::Closed) | None => return Ok(()),
                },
                Some(command) = self.commands.recv() => self.command(command),
                Some((key, serial)) = self.done.recv() => {
                    if self.served.get(&key).is_some_and(|served| served.serial == serial) {
                        self.served.remove(&key);
                        // Still live in the machine only if the handler never ended it.
                        self.machine.abandon(key);
                    }
                }
                // The HELLO's deadline, or the switch's silence: the machine decides.
                () = sleep_until(deadline) => {
                    let now = self.now();
                    self.machine.handle_timeout(now);
                    self.failed()?;
                }
                // The socket was full and took more, or a write failed (the switch is gone).
                Err(_) = std::future::poll_fn(|cx| match self.writer.poll_write_queued(cx) {
                    Poll::Ready(Ok(())) => Poll::Pending,
                    other => other,
                }) => return Ok(()),
            }
            self.drain()?;
            // Whatever the machine queued goes to the socket now, from this task.
            let written = std::future::poll_fn(|cx| Poll::Ready(self.writer.poll_write_queued(cx)));
            if let Poll::Ready(Err(_)) = written.await {
                return Ok(());
            }
        }
    }

    fn command(&mut self, command: Command) {
        match command {
            Command::SetHandler {
                cap,
                handler,
                reply,
            } => {
                let had = set_handler(&mut self.handlers, cap, handler);
                self.machine.set_caps(caps_of(&self.handlers));
                let _ = reply.send(had);
            }
            Command::Write { key, frame, reply } => {
                self.write_in_order((Some(key.xid), key.rid), frame, reply);
            }
            Command::Consume { key, stream } => self.machine.consume(key, stream.as_deref()),
            Command::ConsumeLog { key, bytes } => self.machine.consume_log(key, bytes),
            Command::PeerRequest { cap, parent, reply } => {
                let result = self
                    .machine
                    .peer_request(&cap, parent)
                    .map_err(host_write_error)
                    .map(|rid| {
                        let (answers_tx, answers) = FlowReader::channel();
                        self.calls.insert(rid, answers_tx);
                        PeerCall {
                            rid,
                            answers,
                            tx: self.tx.clone(),
                        }
                    });
                let _ = reply.send(result);
            }
            Command::PeerWrite { rid, frame, reply } => {
                self.write_in_order((None, rid), frame, reply);
            }
            Command::PeerConsume { rid, stream } => {
                self.machine.peer_consume(rid, stream.as_deref())
            }
            Command::PeerConsumeLog { rid, bytes } => self.machine.peer_consume_log(rid, bytes),
            Command::State { reply } => {
                let _ = reply.send(HostState {
                    stats: self.machine.stats(),
                    machine_requests: self.machine.served_len(),
                    handlers_running: self.served.len(),
                    peer_calls: self.calls.len(),
                    parked_writes: self.parked.values().map(HeldWrites::len).sum(),
                });
            }
        }
    }

    /// Writes behind the request's held writes (core's [`HeldWrites`] decides which go now).
    fn write_in_order(&mut self, flow: Flow, frame: Frame, reply: WriteReply) {
        self.parked.entry(flow).or_default().push(frame, reply);
        self.retry_parked(flow);
    }

    /// Writes of `key` still waiting for credit when it ended: answered `Gone`, not kept.
    fn drop_parked(&mut self, key: RequestKey) {
        if let Some(mut held) = self.parked.remove(&(Some(key.xid), key.rid)) {
            for (_, reply) in held.drain() {
                let _ = reply.send(Err(HostServeError::Gone));
            }
        }
    }

    /// Writes the held writes of `flow` in order until one waits for credit again.
    fn retry_parked(&mut self, flow: Flow) {
        let Some(mut held) = self.parked.remove(&flow) else {
            return;
        };
        let machine = &mut self.machine;
        while let Some((written, reply)) = held.pop_ready(
            |frame| match flow {
                (Some(xid), rid) => machine.write(RequestKey { xid, rid }, frame.clone()),
                (None, rid) => machine.peer_write(rid, frame.clone()),
            },
            |error| matches!(error, HostWriteError::Flow(WriteError::NoCredit(_))),
        ) {
            let _ = reply.send(written.map(drop).map_err(host_write_error));
        }
        if !held.is_empty() {
            self.parked.insert(flow, held);
        }
    }

    /// The connection's end, if the last input ended it (the machine's output).
    fn failed(&mut self) -> Result<(), HostServeError> {
        match self.machine.poll_failure() {
            None => Ok(()),
            Some(HostError::Backlogged) => Err(HostServeError::Backlogged),
            Some(error) => Err(HostServeError::Protocol(error.into())),
        }
    }

    /// Queues what the machine sends and handles what it reports; `Err` when the switch
    /// stopped reading (the connection is dropped).
    fn drain(&mut self) -> Result<(), HostServeError> {
        loop {
            while let Some(frame) = self.machine.poll_transmit() {
                if !self.writer.push(frame) {
                    let now = self.now();
                    self.machine.handle_backlogged(now);
                    self.failed()?;
                }
            }
            let Some(event) = self.machine.poll_event() else {
                return Ok(());
            };
            self.event(event);
        }
    }

    fn event(&mut self, event: HostEvent) {
        match event {
            HostEvent::Request {
                key, cap, serves, ..
            } => self.start(key, cap, serves),
            HostEvent::Input { key, frame } => {
                if let Some(input) = self.served.get(&key).and_then(|s| s.input.as_ref()) {
                    let _ = input.send(Box::new(frame));
                }
            }
            HostEvent::CloseStream { key } => {
                // Stop-feeds: the handler's input ends; it winds the request down itself.
                if let Some(served) = self.served.get_mut(&key) {
                    served.input = None;
                }
            }
            HostEvent::Ended { key } => {
                // The handler wrote END or ERR: it is finishing; nothing of it is kept.
                self.served.remove(&key);
                self.drop_parked(key);
            }
            HostEvent::Cancelled { key, force_kill } => {
                self.drop_parked(key);
                if let Some(served) = self.served.remove(&key) {
                    served.cancelled.store(true, Ordering::SeqCst);
                    if force_kill {
                        served.task.abort();
                    }
                }
            }
            HostEvent::PeerAnswer { rid, frame } => {
                let ended = matches!(frame.frame_type, FrameType::End | FrameType::Err);
                if let Some(answers) = self.calls.get(&rid) {
                    let _ = answers.send(Box::new(frame));
                }
                if ended {
                    self.calls.remove(&rid);
                }
            }
            _ => {}
        }
    }

    /// Runs the handler of the cap core chose for a request (`serves`, an index into the
    /// host's caps, which are the handlers' caps in order).
    fn start(&mut self, key: RequestKey, cap: String, serves: usize) {
        let Some((_, handler)) = self.handlers.get(serves) else {
            self.machine.abandon(key);
            return;
        };
        let handler = handler.clone();
        let (input_tx, input) = FlowReader::channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        let request = HostRequest {
            key,
            cap,
            policy: self.machine.policy().unwrap_or_default(),
            input,
            tx: self.tx.clone(),
            cancelled: cancelled.clone(),
        };
        self.next_serial += 1;
        let serial = self.next_serial;
        let done = HandlerDone {
            key,
            serial,
            tx: self.done_tx.clone(),
        };
        let work = handler(request);
        let task = tokio::spawn(async move {
            // Dropped when the handler returns, panics or is aborted.
            let _done = done;
            work.await;
        });
        self.served.insert(
            key,
            Served {
                serial,
                input: Some(input_tx),
                cancelled,
                task,
            },
        );
    }
}

/// Tells the host task a handler ended, however it ended.
struct HandlerDone {
    key: RequestKey,
    serial: u64,
    tx: mpsc::UnboundedSender<(RequestKey, u64)>,
}

impl Drop for HandlerDone {
    fn drop(&mut self) {
        let _ = self.tx.send((self.key, self.serial));
    }
}

fn host_write_error(error: HostWriteError) -> HostServeError {
    match error {
        HostWriteError::Flow(error) => HostServeError::Write(error),
        _ => HostServeError::Gone,
    }
}

use tether_core::request::ErrorClass;
use tether_core::switch::{end_ok_meta, error_meta, NetworkPolicy};
