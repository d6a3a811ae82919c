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

use bytes::Bytes;
use tether_core::cap::CapUrn;
use tether_core::request::RequestKey;
use tether_core::switch::host::{Host as Machine, HostEvent, HostWriteError};
use tether_core::switch::side::{stream_frames, WriteError};
use tether_core::time::Time;
use tether_core::wire::bifaci::{Frame, FrameType, MessageId};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub use tether_core::switch::host::HostConfig;
pub use tether_core::switch::Limits;

use super::conn::{spawn_writer, FrameReader, Incoming};
use super::{gather, FlowReader, FlowSender};
use tokio_stream::StreamExt;

type Handler = Arc<dyn Fn(HostRequest) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync>;

/// Why serving ended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HostServeError {
    /// The switch broke the protocol (or the bytes were not frames).
    #[error("protocol: {0}")]
    Protocol(String),
    /// The request is gone (ended, cancelled) or the connection closed.
    #[error("the request is no longer live")]
    Gone,
    /// This side may not write the frame now.
    #[error(transparent)]
    Write(#[from] WriteError),
}

/// A program serving caps to a switch.
pub struct Host {
    config: HostConfig,
    handlers: Vec<(CapUrn, Handler)>,
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
        Self {
            config: HostConfig {
                name: name.to_owned(),
                caps: Vec::new(),
                limits: Limits::default(),
                rid_prefix: prefix,
            },
            handlers: Vec::new(),
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
            self.config.caps.push(parsed.to_string());
            self.handlers
                .push((parsed, Arc::new(move |request| Box::pin(handler(request)))));
        }
        self
    }

    /// Serves requests arriving over `stream` (a connection to a switch) until it closes.
    pub async fn serve<S>(self, stream: S) -> Result<(), HostServeError>
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (reader, writer) = tokio::io::split(stream);
        let (writer_tx, writer_rx) = mpsc::unbounded_channel();
        let writer = spawn_writer(writer, writer_rx);
        let (tx, commands) = mpsc::unbounded_channel();
        let mut task = HostTask {
            machine: Machine::new(self.config),
            handlers: self.handlers,
            epoch: Instant::now(),
            writer: writer_tx,
            tx,
            commands,
            served: BTreeMap::new(),
            calls: BTreeMap::new(),
            parked: Vec::new(),
        };
        let result = task.run(FrameReader::new(reader)).await;
        for (_, served) in std::mem::take(&mut task.served) {
            served.task.abort();
        }
        drop(task);
        let _ = writer.await;
        result
    }
}

enum Command {
    Write {
        key: RequestKey,
        frame: Frame,
        reply: oneshot::Sender<Result<(), HostServeError>>,
    },
    Consume {
        key: RequestKey,
        stream: Option<String>,
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
}

/// One request routed to this host, handed to its handler.
#[derive(Debug)]
pub struct HostRequest {
    key: RequestKey,
    cap: String,
    input: FlowReader,
    tx: mpsc::UnboundedSender<Command>,
    cancelled: Arc<AtomicBool>,
}

impl HostRequest {
    /// The cap the requester asked for.
    pub fn cap(&self) -> &str {
        &self.cap
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
        if let Some(stream) = self.input.due() {
            let key = self.key;
            let _ = self.tx.send(Command::Consume { key, stream });
        }
        self.input.recv().await
    }

    /// Every input CHUNK's payload, concatenated, up to the input's END (or ERR).
    pub async fn read_all(&mut self) -> Vec<u8> {
        let mut body = Vec::new();
        while let Some(frame) = self.next_input().await {
            if gather(&mut body, &frame).is_some() {
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

    /// Ends the answer (END).
    pub async fn end(&self) -> Result<(), HostServeError> {
        self.write(Frame::new(FrameType::End, self.key.rid)).await
    }

    /// Ends the answer with an ERR carrying `code` and `message`.
    pub async fn fail(&self, code: &str, message: &str) -> Result<(), HostServeError> {
        let mut err = Frame::new(FrameType::Err, self.key.rid);
        err.meta = Some(error_meta(code, message));
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
            .map_err(|_| HostServeError::Gone)?;
        rx.await.map_err(|_| HostServeError::Gone)?
    }
}

/// A peer request this host made.
#[derive(Debug)]
pub struct PeerCall {
    rid: MessageId,
    answers: FlowReader,
    tx: mpsc::UnboundedSender<Command>,
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
        if let Some(stream) = self.answers.due() {
            let rid = self.rid;
            let _ = self.tx.send(Command::PeerConsume { rid, stream });
        }
        self.answers.recv().await
    }

    /// The answer's CHUNK payloads concatenated, or the ERR's code.
    pub async fn collect(mut self) -> Result<Vec<u8>, String> {
        let mut body = Vec::new();
        while let Some(frame) = self.next().await {
            if let Some(end) = gather(&mut body, &frame) {
                return end.map(|()| body);
            }
        }
        Err("closed".to_owned())
    }
}

struct Served {
    /// `None` once the switch stopped the request's feeds (CLOSE_STREAM): its input ends.
    input: Option<FlowSender>,
    cancelled: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

enum Parked {
    Served(
        RequestKey,
        Frame,
        oneshot::Sender<Result<(), HostServeError>>,
    ),
    Peer(
        MessageId,
        Frame,
        oneshot::Sender<Result<(), HostServeError>>,
    ),
}

struct HostTask {
    machine: Machine,
    handlers: Vec<(CapUrn, Handler)>,
    epoch: Instant,
    writer: mpsc::UnboundedSender<Frame>,
    tx: mpsc::UnboundedSender<Command>,
    commands: mpsc::UnboundedReceiver<Command>,
    served: BTreeMap<RequestKey, Served>,
    calls: BTreeMap<MessageId, FlowSender>,
    /// Writes waiting for credit, oldest first.
    parked: Vec<Parked>,
}

impl HostTask {
    fn now(&self) -> Time {
        Time::from_millis(self.epoch.elapsed().as_millis() as u64)
    }

    async fn run<R: AsyncRead + Unpin>(
        &mut self,
        mut incoming: FrameReader<R>,
    ) -> Result<(), HostServeError> {
        loop {
            tokio::select! {
                message = incoming.next() => match message {
                    Some(Incoming::Frame(frame)) => {
                        let now = self.now();
                        self.machine
                            .handle_frame(now, frame)
                            .map_err(|error| HostServeError::Protocol(error.to_string()))?;
                        // Credit may have arrived: give parked writes another try.
                        self.retry_parked();
                    }
                    Some(Incoming::Undecodable(error)) => {
                        return Err(HostServeError::Protocol(error));
                    }
                    Some(Incoming::Closed) | None => return Ok(()),
                },
                Some(command) = self.commands.recv() => self.command(command),
            }
            self.drain();
        }
    }

    fn command(&mut self, command: Command) {
        match command {
            Command::Write { key, frame, reply } => {
                if let Some(parked) = self.write(Parked::Served(key, frame, reply)) {
                    self.parked.push(parked);
                }
            }
            Command::Consume { key, stream } => self.machine.consume(key, stream.as_deref()),
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
                if let Some(parked) = self.write(Parked::Peer(rid, frame, reply)) {
                    self.parked.push(parked);
                }
            }
            Command::PeerConsume { rid, stream } => {
                self.machine.peer_consume(rid, stream.as_deref())
            }
        }
    }

    /// Writes, or hands the write back when it must wait for credit.
    fn write(&mut self, parked: Parked) -> Option<Parked> {
        let (result, parked) = match parked {
            Parked::Served(key, frame, reply) => match self.machine.write(key, frame.clone()) {
                Err(HostWriteError::Flow(WriteError::NoCredit(_))) => {
                    return Some(Parked::Served(key, frame, reply))
                }
                result => (result, reply),
            },
            Parked::Peer(rid, frame, reply) => match self.machine.peer_write(rid, frame.clone()) {
                Err(HostWriteError::Flow(WriteError::NoCredit(_))) => {
                    return Some(Parked::Peer(rid, frame, reply))
                }
                result => (result, reply),
            },
        };
        let _ = parked.send(result.map_err(host_write_error));
        None
    }

    fn retry_parked(&mut self) {
        let parked = std::mem::take(&mut self.parked);
        // Keep order per request: once one of a request's writes waits, its later ones do.
        let mut waiting = std::collections::BTreeSet::new();
        for write in parked {
            let request = match &write {
                Parked::Served(key, ..) => (Some(key.xid), key.rid),
                Parked::Peer(rid, ..) => (None, *rid),
            };
            if waiting.contains(&request) {
                self.parked.push(write);
                continue;
            }
            if let Some(write) = self.write(write) {
                waiting.insert(request);
                self.parked.push(write);
            }
        }
    }

    fn drain(&mut self) {
        while let Some(frame) = self.machine.poll_transmit() {
            let _ = self.writer.send(frame);
        }
        while let Some(event) = self.machine.poll_event() {
            self.event(event);
        }
        while let Some(frame) = self.machine.poll_transmit() {
            let _ = self.writer.send(frame);
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
            HostEvent::Cancelled { key, force_kill } => {
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
            return;
        };
        let handler = handler.clone();
        let (input_tx, input) = FlowReader::channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        let request = HostRequest {
            key,
            cap,
            input,
            tx: self.tx.clone(),
            cancelled: cancelled.clone(),
        };
        let task = tokio::spawn(handler(request));
        self.served.insert(
            key,
            Served {
                input: Some(input_tx),
                cancelled,
                task,
            },
        );
    }
}

fn host_write_error(error: HostWriteError) -> HostServeError {
    match error {
        HostWriteError::Flow(error) => HostServeError::Write(error),
        _ => HostServeError::Gone,
    }
}

use tether_core::switch::error_meta;
