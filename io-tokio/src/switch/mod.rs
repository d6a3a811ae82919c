//! The request switch from async Rust: masters attached over any byte stream (Unix socket,
//! TCP, an iroh bi-stream), an engine-facing request API with credit backpressure both ways,
//! and ([`host`]) the master side for programs that serve caps.
//!
//! ```no_run
//! # async fn demo() -> Result<(), tether::switch::SwitchError> {
//! use tether::switch::Switch;
//! let switch = Switch::builder().start();
//! switch.connect_unix("cartridges", "/run/host.sock").await?; // verified when this returns
//! let mut call = switch.request("cap:in=media:text;out=media:upper").await?;
//! call.send_stream("input", "media:text", [b"hello".to_vec()]).await?;
//! call.finish().await?;
//! let answer = call.collect().await?;
//! # Ok(()) }
//! ```
//!
//! One task owns a [`tether_core::switch::Switch`] and does what it says: it moves frames
//! between the masters' connections and the engine's calls and passes time in. Every decision
//! (routing, handshake, credit, cancel, death) is the core machine's.

mod conn;
pub mod host;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;
use tether_core::limits::{SWITCH_ENGINE_COMMANDS_MAX, SWITCH_WRITER_FRAMES_MAX};

use bytes::Bytes;
use tether_core::cap::{CapUrn, MediaUrn, ParseError};
use tether_core::request::{CancelReason, Credits};
use tether_core::switch::side::{stream_frames, HeldWrites, RequestSide, WriteError};
use tether_core::switch::{
    Answer, AttachError, ConnId, CutReason, EngineError, Event, HandshakeError, Peer, SlotId,
    Switch as Machine, SwitchConfig, SwitchStats,
};
use tether_core::time::Time;
use tether_core::wire::bifaci::{Frame, FrameType, MessageId};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub use tether_core::request::ErrorClass;
pub use tether_core::switch::ErrCode;
pub use tether_core::switch::{payload_content, payload_item, Limits, NetworkPolicy};

/// 32 bytes of the OS's randomness: a connection's identity-check nonce.
fn identity_nonce() -> [u8; tether_core::switch::IDENTITY_NONCE_BYTES] {
    use rand::TryRng;
    let mut nonce = [0; tether_core::switch::IDENTITY_NONCE_BYTES];
    rand::rngs::SysRng
        .try_fill_bytes(&mut nonce)
        .expect("the OS provides randomness");
    nonce
}

use conn::{FrameReader, FrameWriter, Incoming};
use tether_core::switch::side::pass_logs;
use tokio_stream::{StreamExt, StreamMap};

/// Why a switch operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SwitchError {
    /// The switch refused the engine's frame or request.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A master could not be attached.
    #[error("attach refused: {0}")]
    Attach(#[source] AttachError),
    /// The master's connection was cut (handshake, protocol) or closed.
    #[error("master cut off: {0}")]
    Cut(#[source] CutReason),
    /// The master failed its identity check: its connection stays open but it is never
    /// routed to, and its slot refuses another attach until that connection goes.
    #[error("master unhealthy: {0}")]
    Unhealthy(#[source] HandshakeError),
    /// The request ended with an ERR (its code).
    #[error("request failed: {0}")]
    Failed(ErrCode),
    /// [`Call::collect`] would hold more than this many bytes
    /// ([`tether_core::limits::SWITCH_COLLECT_BYTES_MAX`]): read a longer answer frame by
    /// frame with [`Call::next`].
    #[error("the answer is longer than {0} bytes")]
    TooLarge(usize),
    /// This side may not write the frame (the request's input already ended).
    #[error(transparent)]
    Write(#[from] WriteError),
    /// A cap or media URN did not parse.
    #[error("bad URN: {0}")]
    BadUrn(#[source] ParseError),
    /// Connecting to the master failed.
    #[error("connect: {0}")]
    Connect(#[source] ConnectError),
    /// The switch is closed.
    #[error("the switch is closed")]
    Closed,
}

/// Why connecting to a master failed: the transport's own error (an `io::Error` for Unix and
/// TCP, a [`crate::node::NodeError`] over iroh), shared so that [`SwitchError`] stays `Clone`.
/// Two are equal when they are the same failure.
#[derive(Debug, Clone)]
pub struct ConnectError(Arc<dyn std::error::Error + Send + Sync>);

impl ConnectError {
    fn new(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Arc::new(error))
    }

    /// The transport's error.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for ConnectError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

impl PartialEq for ConnectError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for ConnectError {}

type Reply<T> = oneshot::Sender<T>;
/// Called when a master is cut for a reason that implicates its connection.
type Unresponsive = Box<dyn FnOnce() + Send>;
/// Who waits for a write's outcome (no one for a [`Switch::call`]'s input frames).
type WriteReply = Option<Reply<Result<(), SwitchError>>>;

enum Command {
    Attach {
        id: String,
        reader: Box<dyn AsyncRead + Send + Unpin>,
        writer: Box<dyn AsyncWrite + Send + Unpin>,
        unresponsive: Option<Unresponsive>,
        reply: Reply<Result<(), SwitchError>>,
    },
    SlotAccepts(String, Reply<bool>),
    Request {
        cap: String,
        preferred: Option<CapUrn>,
        /// With the whole input: written (as credit allows) and ended by the task.
        input: Option<Vec<Input>>,
        reply: Reply<Result<Call, SwitchError>>,
    },
    Write {
        rid: MessageId,
        frame: Frame,
        reply: Reply<Result<(), SwitchError>>,
    },
    Consume {
        rid: MessageId,
        stream: Option<String>,
    },
    ConsumeLog {
        rid: MessageId,
        bytes: usize,
    },
    Cancel(MessageId, CancelReason, Reply<bool>),
    StopFeeds(MessageId, Reply<bool>),
    SetPolicy(NetworkPolicy),
    Capabilities(Reply<Vec<String>>),
    PathsTo(MediaUrn, MediaUrn, Reply<Vec<Vec<String>>>),
    Stats(Reply<SwitchStats>),
    Close(Reply<()>),
}

/// Builds a [`Switch`].
#[derive(Debug, Default)]
pub struct SwitchBuilder {
    config: SwitchConfig,
    initial: Vec<String>,
}

impl SwitchBuilder {
    /// The limits this switch accepts at most (each master's are met at the minimum; its
    /// credit window must equal the switch's).
    pub fn limits(mut self, limits: Limits) -> Self {
        self.config.limits = limits;
        self
    }

    /// The policy every master is told before anything else (default `full`).
    pub fn policy(mut self, policy: NetworkPolicy) -> Self {
        self.config.policy = policy;
        self
    }

    /// How often each master is sent a heartbeat, and how long it has to echo it before it
    /// is cut off (defaults: `SWITCH_HEARTBEAT_INTERVAL_MS`, `SWITCH_HEARTBEAT_TIMEOUT_MS`).
    pub fn heartbeat(
        mut self,
        interval: std::time::Duration,
        timeout: std::time::Duration,
    ) -> Self {
        self.config.heartbeat_interval = interval;
        self.config.heartbeat_timeout = timeout;
        self
    }

    /// Masters that must all be verified (or have failed) before any request is routed.
    pub fn initial_masters(mut self, ids: &[&str]) -> Self {
        self.initial = ids.iter().map(|id| (*id).to_owned()).collect();
        self
    }

    /// Starts the switch's task. Must be called inside a tokio runtime.
    pub fn start(self) -> Switch {
        let initial: Vec<&str> = self.initial.iter().map(String::as_str).collect();
        let machine = Machine::new(self.config, &initial);
        let (tx, rx) = mpsc::channel(SWITCH_ENGINE_COMMANDS_MAX);
        let task = Task {
            window: machine.window(),
            machine,
            epoch: Instant::now(),
            commands: rx,
            readers: StreamMap::new(),
            masters: BTreeMap::new(),
            attaching: BTreeMap::new(),
            calls: BTreeMap::new(),
            log_unread_total: 0,
            logs_dropped: 0,
            next_rid: 0,
            tx: tx.clone(),
        };
        let handle = tokio::spawn(task.run());
        Switch {
            tx,
            task: Arc::new(Mutex::new(Some(handle))),
        }
    }
}

/// The engine's handle on a running switch. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Switch {
    tx: mpsc::Sender<Command>,
    task: Arc<Mutex<Option<JoinHandle<()>>>>,
}

impl Switch {
    /// Starts building a switch.
    pub fn builder() -> SwitchBuilder {
        SwitchBuilder::default()
    }

    async fn ask<T>(&self, command: impl FnOnce(Reply<T>) -> Command) -> Result<T, SwitchError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(command(reply))
            .await
            .map_err(|_| SwitchError::Closed)?;
        rx.await.map_err(|_| SwitchError::Closed)
    }

    /// Attaches the master `id` over `stream` and waits until it passed the handshake and the
    /// identity check (or was refused). Reattaches a slot whose connection died, in place.
    pub async fn add_master<S>(&self, id: &str, stream: S) -> Result<(), SwitchError>
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        self.attach(id, stream, None).await
    }

    /// Attaches `stream`; `unresponsive` is called if the master is cut for a reason that
    /// implicates the connection under it ([`CutReason::implicates_connection`]).
    async fn attach<S>(
        &self,
        id: &str,
        stream: S,
        unresponsive: Option<Unresponsive>,
    ) -> Result<(), SwitchError>
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (reader, writer) = tokio::io::split(stream);
        self.ask(|reply| Command::Attach {
            id: id.to_owned(),
            reader: Box::new(reader),
            writer: Box::new(writer),
            unresponsive,
            reply,
        })
        .await?
    }

    /// Opens a stream to the switch host at `addr` over `node` (its one cached connection
    /// to that peer, [`crate::node::Node::dial_switch_host`]) and attaches it as `id`. A cut
    /// that implicates the connection (the master went silent: its heartbeat was not echoed) reports
    /// it unresponsive: the node evicts and closes it, so reattaching dials afresh instead of
    /// opening another stream behind a peer that no longer answers.
    #[cfg(feature = "iroh")]
    pub async fn connect_iroh(
        &self,
        id: &str,
        node: &crate::node::Node,
        addr: iroh::EndpointAddr,
    ) -> Result<(), SwitchError> {
        let stream = node
            .dial_switch_host(addr)
            .await
            .map_err(|error| SwitchError::Connect(ConnectError::new(error)))?;
        let unresponsive = stream
            .connection_cut()
            .map(|cut| Box::new(move || cut.unresponsive()) as Unresponsive);
        self.attach(id, stream, unresponsive).await
    }

    /// Connects to a master listening on the Unix socket `path` and attaches it as `id`.
    #[cfg(unix)]
    pub async fn connect_unix(
        &self,
        id: &str,
        path: impl AsRef<std::path::Path>,
    ) -> Result<(), SwitchError> {
        let stream = tokio::net::UnixStream::connect(path)
            .await
            .map_err(|error| SwitchError::Connect(ConnectError::new(error)))?;
        self.add_master(id, stream).await
    }

    /// Connects to a master listening on TCP `addr` and attaches it as `id`.
    pub async fn connect_tcp(
        &self,
        id: &str,
        addr: std::net::SocketAddr,
    ) -> Result<(), SwitchError> {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|error| SwitchError::Connect(ConnectError::new(error)))?;
        let _ = stream.set_nodelay(true);
        self.add_master(id, stream).await
    }

    /// Whether a connection for slot `id` would be accepted now (ask before dialling).
    pub async fn slot_accepts_attach(&self, id: &str) -> bool {
        self.ask(|reply| Command::SlotAccepts(id.to_owned(), reply))
            .await
            .unwrap_or(false)
    }

    /// Makes a request for `cap`: routed to the best healthy master.
    pub async fn request(&self, cap: &str) -> Result<Call, SwitchError> {
        self.request_preferring(cap, None).await
    }

    /// Makes a request for `cap`, preferring `preferred` when an equivalent cap is served.
    pub async fn request_preferring(
        &self,
        cap: &str,
        preferred: Option<&str>,
    ) -> Result<Call, SwitchError> {
        let preferred = preferred
            .map(CapUrn::parse)
            .transpose()
            .map_err(SwitchError::BadUrn)?;
        self.ask(|reply| Command::Request {
            cap: cap.to_owned(),
            preferred,
            input: None,
            reply,
        })
        .await?
    }

    /// Makes a request for `cap` with its whole input: the switch writes every stream (each
    /// CHUNK as credit allows) and the END itself, so the returned [`Call`] only reads the
    /// answer. One exchange with the switch's task instead of one per frame.
    pub async fn call(
        &self,
        cap: &str,
        input: impl IntoIterator<Item = Input>,
    ) -> Result<Call, SwitchError> {
        let input = input.into_iter().collect();
        self.ask(|reply| Command::Request {
            cap: cap.to_owned(),
            preferred: None,
            input: Some(input),
            reply,
        })
        .await?
    }

    /// Cancels request `rid` and its children with `reason`; `false` when it is not live.
    pub async fn cancel_request(&self, rid: MessageId, reason: CancelReason) -> bool {
        self.ask(|reply| Command::Cancel(rid, reason, reply))
            .await
            .unwrap_or(false)
    }

    /// Stops the feeds of request `rid` (CLOSE_STREAM); it ends on its own. `false` when it is
    /// not live.
    pub async fn stop_request_feeds(&self, rid: MessageId) -> bool {
        self.ask(|reply| Command::StopFeeds(rid, reply))
            .await
            .unwrap_or(false)
    }

    /// Replaces the policy (sent to every master when it changed).
    pub async fn set_policy(&self, policy: NetworkPolicy) {
        let _ = self.tx.send(Command::SetPolicy(policy)).await;
    }

    /// Every routable master's caps.
    pub async fn capabilities(&self) -> Vec<String> {
        self.ask(Command::Capabilities).await.unwrap_or_default()
    }

    /// Chains of caps turning `input` media into `output` media.
    pub async fn paths_to(
        &self,
        input: &str,
        output: &str,
    ) -> Result<Vec<Vec<String>>, SwitchError> {
        let parse = |text: &str| MediaUrn::parse(text).map_err(SwitchError::BadUrn);
        let (input, output) = (parse(input)?, parse(output)?);
        self.ask(|reply| Command::PathsTo(input, output, reply))
            .await
    }

    /// The switch's protocol stats.
    pub async fn protocol_stats(&self) -> Result<SwitchStats, SwitchError> {
        self.ask(Command::Stats).await
    }

    /// Closes every master connection and stops the task; calls end with `Closed`.
    pub async fn close(&self) {
        let _ = self.ask(Command::Close).await;
        let task = self
            .task
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

/// One request's frames from the other side, in order. Each CHUNK handed out is consumed
/// (its credit granted back) when the next frame is asked for, so a slow reader holds the
/// sender back; [`FlowReader::due`] says which stream is owed that grant. Serves the engine's
/// calls, a host's requests and its peer calls alike.
#[derive(Debug)]
pub(crate) struct FlowReader {
    frames: mpsc::UnboundedReceiver<Box<Frame>>,
    unconsumed: Option<Option<String>>,
    /// Bytes of the LOG frames handed out since [`FlowReader::due_log`] was asked.
    log_read: usize,
}

/// Where one request's frames for a [`FlowReader`] are sent. Frames travel boxed: a channel
/// allocates its slots in blocks of 32, and one request's block of boxes is a small
/// allocation, where a block of frames would be ten kilobytes per request.
pub(crate) type FlowSender = mpsc::UnboundedSender<Box<Frame>>;

impl FlowReader {
    /// A reader and the sender feeding it.
    pub(crate) fn channel() -> (FlowSender, Self) {
        let (tx, frames) = mpsc::unbounded_channel();
        (
            tx,
            Self {
                frames,
                unconsumed: None,
                log_read: 0,
            },
        )
    }

    /// The stream of the CHUNK handed out last, once: its credit is due now.
    pub(crate) fn due(&mut self) -> Option<Option<String>> {
        self.unconsumed.take()
    }

    /// Bytes of LOG frames read since the last call (their room is due back), once.
    pub(crate) fn due_log(&mut self) -> usize {
        std::mem::take(&mut self.log_read)
    }

    /// The next frame (call [`FlowReader::due`] and [`FlowReader::due_log`] first).
    pub(crate) async fn recv(&mut self) -> Option<Frame> {
        let frame = *self.frames.recv().await?;
        match frame.frame_type {
            FrameType::Chunk => self.unconsumed = Some(frame.stream_id.clone()),
            FrameType::Log => self.log_read = self.log_read.saturating_add(frame.held_bytes()),
            _ => {}
        }
        Some(frame)
    }
}

/// How a whole answer (or input) ended without a body to return.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unfinished {
    /// It ended with an ERR with this code.
    Err(ErrCode),
    /// The body would pass [`tether_core::limits::SWITCH_COLLECT_BYTES_MAX`].
    TooLarge,
}

impl From<Unfinished> for SwitchError {
    fn from(end: Unfinished) -> Self {
        match end {
            Unfinished::Err(code) => Self::Failed(code),
            Unfinished::TooLarge => Self::TooLarge(tether_core::limits::SWITCH_COLLECT_BYTES_MAX),
        }
    }
}

/// Adds `frame` to a whole answer's `body`: `Some` once the answer ended, with why when it
/// has no body to return.
pub(crate) fn gather(body: &mut Vec<u8>, frame: &Frame) -> Option<Result<(), Unfinished>> {
    match frame.frame_type {
        FrameType::Chunk => {
            let payload = frame.payload.as_deref().unwrap_or(&[]);
            if body.len().saturating_add(payload.len())
                > tether_core::limits::SWITCH_COLLECT_BYTES_MAX
            {
                return Some(Err(Unfinished::TooLarge));
            }
            body.extend_from_slice(payload);
            None
        }
        FrameType::End => Some(Ok(())),
        FrameType::Err => Some(Err(Unfinished::Err(ErrCode::of_meta(
            tether_core::switch::error_code(frame).as_deref(),
        )))),
        _ => None,
    }
}

/// One input stream of a request made with [`Switch::call`].
#[derive(Debug, Clone)]
pub struct Input {
    stream: String,
    media: String,
    chunks: Vec<Bytes>,
}

impl Input {
    /// Stream `stream` of media `media`, one CHUNK per item.
    pub fn new<I, B>(stream: &str, media: &str, chunks: I) -> Self
    where
        I: IntoIterator<Item = B>,
        B: Into<Bytes>,
    {
        Self {
            stream: stream.to_owned(),
            media: media.to_owned(),
            chunks: chunks.into_iter().map(Into::into).collect(),
        }
    }
}

/// One request the engine made: write its input, read its answer.
#[derive(Debug)]
pub struct Call {
    rid: MessageId,
    tx: mpsc::Sender<Command>,
    answers: FlowReader,
}

impl Call {
    /// The request id.
    pub fn id(&self) -> MessageId {
        self.rid
    }

    /// Writes one input frame (STREAM_START, CHUNK, STREAM_END, LOG, END, ERR): numbered by the
    /// switch's engine side; a CHUNK waits for credit from the serving master.
    pub async fn send(&self, frame: Frame) -> Result<(), SwitchError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Write {
                rid: self.rid,
                frame,
                reply,
            })
            .await
            .map_err(|_| SwitchError::Closed)?;
        rx.await.map_err(|_| SwitchError::Closed)?
    }

    /// Writes a whole input stream: STREAM_START, one CHUNK per item (each waiting for
    /// credit), STREAM_END with the count.
    pub async fn send_stream<I, B>(
        &self,
        stream: &str,
        media: &str,
        chunks: I,
    ) -> Result<(), SwitchError>
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
    pub async fn finish(&self) -> Result<(), SwitchError> {
        self.send(Frame::new(FrameType::End, self.rid)).await
    }

    /// Writes the whole input, one stream of `chunks` and END, for a caller that reads the
    /// answer next. A master may answer before it takes the input (an ERR for a request it
    /// declines): the request is then over, the rest of the input is moot, and this is `Ok`;
    /// the answer says how it ended.
    pub async fn send_input<I, B>(
        &self,
        stream: &str,
        media: &str,
        chunks: I,
    ) -> Result<(), SwitchError>
    where
        I: IntoIterator<Item = B>,
        B: Into<Bytes>,
    {
        let written = match self.send_stream(stream, media, chunks).await {
            Ok(()) => self.finish().await,
            error => error,
        };
        match written {
            Err(SwitchError::Engine(EngineError::NotLive)) => Ok(()),
            written => written,
        }
    }

    /// The next frame of the answer, in order; `None` after END or ERR. Each CHUNK is
    /// consumed (its credit granted back) when the next frame is asked for, so a slow reader
    /// holds the master back.
    pub async fn next(&mut self) -> Option<Frame> {
        let rid = self.rid;
        if let Some(stream) = self.answers.due() {
            let _ = self.tx.send(Command::Consume { rid, stream }).await;
        }
        let bytes = self.answers.due_log();
        if bytes > 0 {
            let _ = self.tx.send(Command::ConsumeLog { rid, bytes }).await;
        }
        self.answers.recv().await
    }

    /// Reads the whole answer: the payloads of its CHUNKs concatenated, or the ERR's code
    /// ([`SwitchError::TooLarge`] past [`tether_core::limits::SWITCH_COLLECT_BYTES_MAX`]: read
    /// a longer answer frame by frame with `next`).
    pub async fn collect(mut self) -> Result<Vec<u8>, SwitchError> {
        let mut body = Vec::new();
        while let Some(frame) = self.next().await {
            if let Some(end) = gather(&mut body, &frame) {
                return end.map(|()| body).map_err(SwitchError::from);
            }
        }
        Err(SwitchError::Closed)
    }
}

/// A master connection's write half (its reader is in [`Task::readers`]).
struct MasterIo {
    conn: ConnId,
    /// At most [`SWITCH_WRITER_FRAMES_MAX`] frames queued: a master that stops reading is cut
    /// off.
    writer: FrameWriter<Box<dyn AsyncWrite + Send + Unpin>>,
    /// Told when the master is cut for a reason that implicates its connection.
    unresponsive: Option<Unresponsive>,
}

/// Writes what every master's socket takes now; the first connection whose write failed.
fn write_masters(
    masters: &mut BTreeMap<SlotId, MasterIo>,
    cx: &mut std::task::Context<'_>,
) -> Option<ConnId> {
    masters.values_mut().find_map(|io| {
        let failed =
            !io.writer.is_idle() && matches!(io.writer.poll_write_queued(cx), Poll::Ready(Err(_)));
        failed.then_some(io.conn)
    })
}

/// The engine side of one call.
struct CallState {
    side: RequestSide,
    answers: FlowSender,
    /// Writes waiting for credit, in order (those of [`Switch::call`]'s input have no reply).
    parked: HeldWrites<WriteReply>,
}

struct Task {
    machine: Machine,
    window: u64,
    epoch: Instant,
    commands: mpsc::Receiver<Command>,
    /// Every attached master's incoming frames, read only as fast as this task handles them
    /// (so a flood backs up into that master's socket).
    readers: StreamMap<ConnId, FrameReader<Box<dyn AsyncRead + Send + Unpin>>>,
    masters: BTreeMap<SlotId, MasterIo>,
    attaching: BTreeMap<ConnId, Reply<Result<(), SwitchError>>>,
    calls: BTreeMap<MessageId, CallState>,
    /// Bytes of LOG frames handed to the engine's calls and not read yet, over every call.
    log_unread_total: usize,
    /// LOG frames for the engine's calls dropped past the bounds.
    logs_dropped: u64,
    next_rid: u64,
    tx: mpsc::Sender<Command>,
}

impl Task {
    fn now(&self) -> Time {
        Time::from_millis(self.epoch.elapsed().as_millis() as u64)
    }

    async fn run(mut self) {
        // One timer, moved only when the machine's deadline moves (not rebuilt per wake-up).
        let timer = tokio::time::sleep(Duration::from_secs(3600));
        tokio::pin!(timer);
        let mut armed = None;
        loop {
            let due = self.machine.poll_timeout();
            if due != armed {
                armed = due;
                let wait = due.map_or(Duration::from_secs(3600), |due| {
                    Duration::from_millis(due.as_millis().saturating_sub(self.now().as_millis()))
                });
                timer.as_mut().reset(Instant::now() + wait);
            }
            tokio::select! {
                command = self.commands.recv() => match command {
                    Some(Command::Close(reply)) => {
                        self.shutdown();
                        let _ = reply.send(());
                        return;
                    }
                    None => return self.shutdown(),
                    Some(command) => self.command(command),
                },
                Some((conn, incoming)) = self.readers.next() => self.incoming(conn, incoming),
                // Sockets that were full took more (and were written), or a write failed.
                conn = std::future::poll_fn(|cx| match write_masters(&mut self.masters, cx) {
                    Some(conn) => Poll::Ready(conn),
                    None => Poll::Pending,
                }) => self.incoming(conn, Incoming::Closed),
                () = &mut timer => {
                    armed = None;
                    let now = self.now();
                    self.machine.handle_timeout(now);
                }
            }
            self.drain();
            // Whatever the machine queued goes to the sockets now, from this task.
            while let Some(conn) =
                std::future::poll_fn(|cx| Poll::Ready(write_masters(&mut self.masters, cx))).await
            {
                self.incoming(conn, Incoming::Closed);
                self.drain();
            }
        }
    }

    fn command(&mut self, command: Command) {
        let now = self.now();
        match command {
            Command::Attach {
                id,
                reader,
                writer,
                unresponsive,
                reply,
            } => match self.ask(
                |machine| machine.handle_attach(now, &id, identity_nonce()),
                Answer::attached,
            ) {
                Ok(conn) => {
                    self.readers.insert(conn, FrameReader::new(reader));
                    self.masters.insert(
                        conn.slot,
                        MasterIo {
                            conn,
                            writer: FrameWriter::new(writer, SWITCH_WRITER_FRAMES_MAX),
                            unresponsive,
                        },
                    );
                    self.attaching.insert(conn, reply);
                }
                Err(error) => drop(reply.send(Err(SwitchError::Attach(error)))),
            },
            Command::SlotAccepts(id, reply) => {
                let _ = reply.send(self.machine.slot_accepts_attach(&id));
            }
            Command::Request {
                cap,
                preferred,
                input,
                reply,
            } => {
                let call = self.request(now, &cap, preferred.as_ref());
                if let (Ok(call), Some(input)) = (&call, input) {
                    self.write_input(now, call.rid, input);
                }
                let _ = reply.send(call);
            }
            Command::Write { rid, frame, reply } => self.write(now, rid, frame, Some(reply)),
            Command::Consume { rid, stream } => {
                let credit = self
                    .calls
                    .get_mut(&rid)
                    .and_then(|call| call.side.consume(stream.as_deref()));
                if let Some(credit) = credit {
                    self.machine.handle_engine_frame(now, credit);
                }
            }
            Command::Cancel(rid, reason, reply) => {
                let live = self.ask(
                    |machine| machine.handle_cancel(now, rid, &reason),
                    Answer::live,
                );
                let _ = reply.send(live);
            }
            Command::StopFeeds(rid, reply) => {
                let live = self.ask(|machine| machine.handle_stop_feeds(now, rid), Answer::live);
                let _ = reply.send(live);
            }
            Command::SetPolicy(policy) => self.machine.set_policy(policy),
            Command::Capabilities(reply) => {
                let _ = reply.send(self.machine.capabilities());
            }
            Command::PathsTo(input, output, reply) => {
                let paths = self
                    .machine
                    .paths_to(&input, &output)
                    .into_iter()
                    .map(|path| path.iter().map(ToString::to_string).collect())
                    .collect();
                let _ = reply.send(paths);
            }
            Command::Stats(reply) => {
                let mut stats = self.machine.protocol_stats(now);
                stats.switch.engine_logs_dropped = self.logs_dropped;
                let _ = reply.send(stats);
            }
            Command::ConsumeLog { rid, bytes } => {
                if let Some(call) = self.calls.get_mut(&rid) {
                    self.log_unread_total -= call.side.log_read(bytes);
                }
            }
            Command::Close(_) => unreachable!("handled by run"),
        }
    }

    fn request(
        &mut self,
        now: Time,
        cap: &str,
        preferred: Option<&CapUrn>,
    ) -> Result<Call, SwitchError> {
        self.next_rid += 1;
        let rid = MessageId::Uint(self.next_rid);
        let mut side = RequestSide::new(
            rid,
            None,
            Credits::new(self.window),
            tether_core::limits::REORDER_HELD_COUNT_DEFAULT as u64,
        );
        let mut req = side.frame(FrameType::Req);
        req.cap = Some(cap.to_owned());
        side.write(&mut req)?;
        self.ask(
            |machine| machine.handle_engine_request(now, req, preferred),
            Answer::request,
        )?;
        let (answers_tx, answers) = FlowReader::channel();
        self.calls.insert(
            rid,
            CallState {
                side,
                answers: answers_tx,
                parked: HeldWrites::new(),
            },
        );
        Ok(Call {
            rid,
            tx: self.tx.clone(),
            answers,
        })
    }

    /// Queues a whole input and its END behind the call's other writes, then writes what
    /// credit allows.
    fn write_input(&mut self, now: Time, rid: MessageId, input: Vec<Input>) {
        let Some(call) = self.calls.get_mut(&rid) else {
            return;
        };
        for Input {
            stream,
            media,
            chunks,
        } in input
        {
            for frame in stream_frames(rid, &stream, &media, chunks) {
                call.parked.push(frame, None);
            }
        }
        call.parked.push(Frame::new(FrameType::End, rid), None);
        self.unpark(now, rid);
    }

    fn write(&mut self, now: Time, rid: MessageId, frame: Frame, reply: WriteReply) {
        let Some(call) = self.calls.get_mut(&rid) else {
            // The call ended: the machine tells a straggler of a request that ended lately
            // from a frame for no request, counts it, and refuses it.
            let result = self.ask(
                |machine| machine.handle_engine_frame(now, frame),
                Answer::frame,
            );
            answer(reply, result.map_err(SwitchError::from));
            return;
        };
        call.parked.push(frame, reply);
        self.unpark(now, rid);
    }

    /// Writes the held writes of `rid` in order until one waits for credit again (core's
    /// [`HeldWrites`] decides which go).
    fn unpark(&mut self, now: Time, rid: MessageId) {
        loop {
            let Some(call) = self.calls.get_mut(&rid) else {
                return;
            };
            let Some((written, reply)) = call.parked.pop_ready(
                |frame| call.side.write(frame),
                |error| matches!(error, WriteError::NoCredit(_)),
            ) else {
                return;
            };
            let result = match written {
                Ok(frame) => self
                    .ask(
                        |machine| machine.handle_engine_frame(now, frame),
                        Answer::frame,
                    )
                    .map_err(SwitchError::from),
                Err(error) => Err(error.into()),
            };
            answer(reply, result);
        }
    }

    /// Runs one input whose caller waits on the machine's answer (`pick` takes its kind out
    /// of the [`Answer`]).
    fn ask<T>(
        &mut self,
        input: impl FnOnce(&mut Machine),
        pick: impl FnOnce(Answer) -> Option<T>,
    ) -> T {
        input(&mut self.machine);
        self.machine
            .poll_answer()
            .and_then(pick)
            .expect("each input that asks is answered, with its own kind of answer")
    }

    fn incoming(&mut self, conn: ConnId, incoming: Incoming) {
        let now = self.now();
        match incoming {
            Incoming::Frame(frame) => self.machine.handle_master_frame(now, conn, frame),
            Incoming::Undecodable(error) => {
                self.machine.handle_undecodable(now, conn, error);
            }
            Incoming::Closed => self.machine.handle_closed(now, conn),
        }
    }

    /// Does what the machine asks until it asks nothing more.
    fn drain(&mut self) {
        let now = self.now();
        loop {
            let mut moved = false;
            while let Some(transmit) = self.machine.poll_transmit() {
                moved = true;
                match transmit.to {
                    Peer::Master(slot) => {
                        let full = self
                            .masters
                            .get_mut(&slot)
                            .and_then(|io| (!io.writer.push(transmit.frame)).then_some(io.conn));
                        if let Some(conn) = full {
                            self.machine.handle_backlogged(now, conn);
                        }
                    }
                    Peer::Engine => self.answer_engine(now, transmit.frame),
                }
            }
            while let Some(event) = self.machine.poll_event() {
                moved = true;
                self.event(event);
            }
            if !moved {
                return;
            }
        }
    }

    fn answer_engine(&mut self, now: Time, frame: Frame) {
        let rid = frame.id;
        let is_credit = frame.frame_type == FrameType::Credit;
        let Some(call) = self.calls.get_mut(&rid) else {
            return;
        };
        // A broken answer flow is the switch's bug, not the master's: the switch checks every
        // frame it forwards. End the call rather than deliver it.
        let mut delivered = Vec::new();
        let result = call.side.read(frame, |frame| delivered.push(frame));
        // LOG frames pass within their unread bytes (core's rule); the rest are dropped, counted.
        let passed = pass_logs(
            &mut call.side,
            delivered,
            &mut self.log_unread_total,
            &mut self.logs_dropped,
        );
        for frame in passed {
            drop(call.answers.send(Box::new(frame)));
        }
        let ended = call.side.read_end() || result.is_err();
        if is_credit {
            self.unpark(now, rid);
        }
        if ended {
            if let Some(mut call) = self.calls.remove(&rid) {
                self.log_unread_total -= call.side.log_unread();
                for (_, reply) in call.parked.drain() {
                    answer(reply, Err(SwitchError::Closed));
                }
            }
        }
    }

    fn event(&mut self, event: Event) {
        match event {
            Event::MasterReady { slot } => {
                if let Some(io) = self.masters.get(&slot) {
                    if let Some(reply) = self.attaching.remove(&io.conn) {
                        let _ = reply.send(Ok(()));
                    }
                }
            }
            Event::MasterUnhealthy { slot, reason } => {
                if let Some(io) = self.masters.get(&slot) {
                    if let Some(reply) = self.attaching.remove(&io.conn) {
                        let _ = reply.send(Err(SwitchError::Unhealthy(reason)));
                    }
                }
            }
            Event::Disconnect { conn, reason } => self.detach(conn, &reason),
            Event::MasterDied { slot, reason } => {
                if let Some(conn) = self.masters.get(&slot).map(|io| io.conn) {
                    self.detach(conn, &reason);
                }
            }
            _ => {}
        }
    }

    /// The machine let go of `conn`: its reader stops and its writer closes the stream.
    /// A cut that implicates the connection under the stream is reported to its transport.
    fn detach(&mut self, conn: ConnId, reason: &CutReason) {
        if self
            .masters
            .get(&conn.slot)
            .is_some_and(|io| io.conn == conn)
        {
            let unresponsive = self
                .masters
                .remove(&conn.slot)
                .and_then(|io| io.unresponsive);
            if let Some(unresponsive) = unresponsive.filter(|_| reason.implicates_connection()) {
                unresponsive();
            }
        }
        self.readers.remove(&conn);
        if let Some(reply) = self.attaching.remove(&conn) {
            let _ = reply.send(Err(SwitchError::Cut(reason.clone())));
        }
    }

    fn shutdown(&mut self) {
        for (_, io) in std::mem::take(&mut self.masters) {
            // What is queued still goes out before the connection closes.
            tokio::spawn(io.writer.finish());
        }
        self.readers.clear();
        for (_, reply) in std::mem::take(&mut self.attaching) {
            let _ = reply.send(Err(SwitchError::Closed));
        }
        for (_, mut call) in std::mem::take(&mut self.calls) {
            for (_, reply) in call.parked.drain() {
                answer(reply, Err(SwitchError::Closed));
            }
        }
    }
}

/// Tells a waiting writer how its write went (a [`Switch::call`] input frame has no one
/// waiting: its outcome shows in the answer).
fn answer(reply: WriteReply, result: Result<(), SwitchError>) {
    if let Some(reply) = reply {
        let _ = reply.send(result);
    }
}

#[cfg(test)]
mod gather_tests {
    use super::*;

    /// Gathering stops at the bound: a chunk that would take the body past
    /// `SWITCH_COLLECT_BYTES_MAX` ends it `TOO_LARGE` and is not appended; one that reaches it
    /// exactly is taken.
    #[test]
    fn a_body_past_the_collect_bound_is_refused_not_grown() {
        let max = tether_core::limits::SWITCH_COLLECT_BYTES_MAX;
        let chunk = |len: usize| {
            let mut frame = Frame::new(
                FrameType::Chunk,
                tether_core::wire::bifaci::MessageId::Uint(1),
            );
            frame.payload = Some(bytes::Bytes::from(vec![1; len]));
            frame
        };
        let mut body = vec![0; max - 10];
        assert_eq!(gather(&mut body, &chunk(10)), None);
        assert_eq!(body.len(), max);
        assert_eq!(
            gather(&mut body, &chunk(1)),
            Some(Err(Unfinished::TooLarge))
        );
        assert_eq!(body.len(), max, "nothing past the bound was appended");
    }
}
