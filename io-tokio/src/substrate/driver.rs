//! The per-peer task: owns one [`PeerLink`], feeds it link bytes, time and persistence
//! results, drains its outputs. No protocol decision is made here.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tether_core::substrate::handshake::Role;
use tether_core::substrate::{Event, Machine, PeerId, PeerLink, PersistBatch};
use tether_core::time::Time;
use tether_core::wire::envelope::{ObjKind, Verb};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn, Instrument};

use super::transport::Link;
use super::{Delivery, Error, Inbound, OpenRequest, Reply, Request, Shared};

/// Commands handled per wake before outputs are drained (bounds one wake's work).
const COMMANDS_PER_WAKE: usize = 256;
/// Link reads handled per wake.
const READS_PER_WAKE: usize = 64;
/// Bytes read per socket read.
const READ_CHUNK: usize = 64 * 1024;
/// Bytes of frames coalesced into one write.
const WRITE_CHUNK: usize = 256 * 1024;
/// How often a peer's counters are published to `metrics`.
const STATS_EVERY: Duration = Duration::from_secs(1);
/// First redial delay and its cap (full jitter over the doubling delay).
const REDIAL_BASE: Duration = Duration::from_millis(100);
const REDIAL_CAP: Duration = Duration::from_secs(10);

pub(super) type Reply1<T> = oneshot::Sender<Result<T, Error>>;

/// What the app and the accept loop ask of a peer's task.
pub(super) enum Command {
    Open {
        kind: ObjKind,
        obj: String,
        cap: Option<String>,
        reply: Reply1<()>,
    },
    Send {
        obj: String,
        body: Bytes,
        reply: Reply1<String>,
    },
    Req {
        obj: String,
        body: Bytes,
        reply: Reply1<Reply>,
    },
    Answer {
        obj: String,
        req_id: String,
        verb: Verb,
        body: Option<Bytes>,
        code: Option<String>,
        reply: Reply1<()>,
    },
    Decide {
        obj: String,
        reject: Option<String>,
        reply: Reply1<()>,
    },
    Close {
        obj: String,
        reason: String,
        reply: Reply1<()>,
    },
    Consume {
        obj: String,
        seq: u64,
    },
    Attach(Link),
    Shutdown(oneshot::Sender<()>),
}

/// What woke the task.
enum Wake {
    Link(LinkMsg),
    Command(Command),
    Timer,
}

impl Command {
    /// The object a command is about.
    fn object(&self) -> Option<&str> {
        match self {
            Command::Open { obj, .. }
            | Command::Send { obj, .. }
            | Command::Req { obj, .. }
            | Command::Answer { obj, .. }
            | Command::Decide { obj, .. }
            | Command::Close { obj, .. }
            | Command::Consume { obj, .. } => Some(obj),
            Command::Attach(_) | Command::Shutdown(_) => None,
        }
    }
}

enum LinkMsg {
    Bytes(u64, Bytes),
    Closed(u64),
    Dialed(std::io::Result<Link>),
}

enum Waiter {
    Send(Reply1<String>),
    Req {
        res: Vec<Bytes>,
        reply: Reply1<Reply>,
    },
}

pub(super) struct Driver {
    peer: PeerId,
    link: PeerLink,
    shared: Arc<Shared>,
    commands: mpsc::UnboundedReceiver<Command>,
    handle: mpsc::UnboundedSender<Command>,
    link_tx: mpsc::Sender<LinkMsg>,
    link_rx: mpsc::Receiver<LinkMsg>,
    writer: Option<mpsc::UnboundedSender<Bytes>>,
    generation: u64,
    dialing: bool,
    redial_at: Option<Time>,
    attempt: u32,
    was_up: bool,
    waiters: HashMap<String, Waiter>,
    opens: HashMap<String, (String, Reply1<()>)>,
    pinned: Arc<AtomicBool>,
    stats_published: Option<Time>,
}

impl Driver {
    pub(super) fn new(
        peer: PeerId,
        machine: Machine,
        shared: Arc<Shared>,
        commands: mpsc::UnboundedReceiver<Command>,
        handle: mpsc::UnboundedSender<Command>,
        pinned: Arc<AtomicBool>,
    ) -> Self {
        let link = PeerLink::new(machine, shared.auth.clone(), shared.features.clone());
        let (link_tx, link_rx) = mpsc::channel(16);
        Self {
            peer,
            link,
            shared,
            commands,
            handle,
            link_tx,
            link_rx,
            writer: None,
            generation: 0,
            dialing: false,
            redial_at: None,
            attempt: 0,
            was_up: false,
            waiters: HashMap::new(),
            opens: HashMap::new(),
            pinned,
            stats_published: None,
        }
    }

    pub(super) async fn run(mut self) {
        let span = tracing::info_span!("peer", peer = %self.peer.as_str());
        async move {
            if self.shared.transport.can_dial(&self.peer) {
                self.redial_at = Some(self.now());
            }
            if let Err(error) = self.flush().await {
                warn!(%error, "store failed; the peer's task stops");
                return self.stop();
            }
            loop {
                let due = self.next_due();
                let sleep = self.sleep_for(due);
                // `biased`: the branch order is fixed, so a run replays exactly under a
                // simulator. Fairness comes from draining both channels on every wake.
                let wake = tokio::select! {
                    biased;
                    message = self.link_rx.recv() => {
                        Wake::Link(message.expect("the driver holds a sender"))
                    }
                    command = self.commands.recv() => match command {
                        Some(command) => Wake::Command(command),
                        None => return self.stop(),
                    },
                    () = sleep => Wake::Timer,
                };
                let mut first_command = None;
                match wake {
                    Wake::Link(message) => self.link_message(message),
                    Wake::Command(command) => first_command = Some(command),
                    Wake::Timer => self.timeout(),
                }
                for _ in 0..READS_PER_WAKE {
                    let Ok(message) = self.link_rx.try_recv() else {
                        break;
                    };
                    self.link_message(message);
                }
                let commands = first_command
                    .into_iter()
                    .chain(std::iter::from_fn(|| self.commands.try_recv().ok()));
                let mut stop = None;
                for command in commands.take(COMMANDS_PER_WAKE).collect::<Vec<_>>() {
                    if let Some(done) = self.command(command) {
                        stop = Some(done);
                        break;
                    }
                }
                if let Some(done) = stop {
                    let _ = self.flush().await;
                    self.stop();
                    let _ = done.send(());
                    return;
                }
                if let Err(error) = self.flush().await {
                    warn!(%error, "store failed; the peer's task stops");
                    return self.stop();
                }
                if self.idle() {
                    debug!("no link, no state: the peer's task ends");
                    return self.stop();
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Nothing to keep the task for: no link, no way to dial, nothing in memory that is not
    /// durable, nobody waiting. A link that failed its handshake under a made-up id ends here.
    fn idle(&self) -> bool {
        self.writer.is_none()
            && !self.pinned.load(Ordering::SeqCst)
            && !self.dialing
            && !self.shared.transport.can_dial(&self.peer)
            && self.waiters.is_empty()
            && self.opens.is_empty()
            && self.link.machine().is_idle()
    }

    /// Publishes the machine's counters through the `metrics` facade at most once per
    /// [`STATS_EVERY`]: serializing them on every wake would tax the hot path.
    fn publish_stats(&mut self) {
        let now = self.now();
        if self
            .stats_published
            .is_some_and(|at| now.saturating_since(at) < STATS_EVERY)
        {
            return;
        }
        self.stats_published = Some(now);
        self.shared.publish(&self.peer, self.link.machine());
    }

    fn now(&self) -> Time {
        (self.shared.clock)()
    }

    fn next_due(&self) -> Option<Time> {
        match (self.link.poll_timeout(), self.redial_at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn sleep_for(&self, due: Option<Time>) -> tokio::time::Sleep {
        let wait = match due {
            Some(due) => {
                Duration::from_millis(due.as_millis().saturating_sub(self.now().as_millis()))
            }
            None => Duration::from_secs(3600),
        };
        tokio::time::sleep(wait)
    }

    fn timeout(&mut self) {
        let now = self.now();
        if self.redial_at.is_some_and(|at| at <= now) && !self.dialing && self.writer.is_none() {
            self.redial_at = None;
            self.dial();
        }
        self.link.handle_timeout(now);
    }

    fn dial(&mut self) {
        self.dialing = true;
        let shared = self.shared.clone();
        let peer = self.peer.clone();
        let tx = self.link_tx.clone();
        let nonce = shared.random_bytes();
        debug!(attempt = self.attempt, "dialing");
        tokio::spawn(async move {
            let result = shared.transport.dial(&peer, nonce).await;
            let _ = tx.send(LinkMsg::Dialed(result)).await;
        });
    }

    fn schedule_redial(&mut self) {
        if !self.shared.transport.can_dial(&self.peer) || self.dialing {
            return;
        }
        let ceiling = REDIAL_BASE
            .saturating_mul(1u32 << self.attempt.min(16))
            .min(REDIAL_CAP);
        let jitter = self.shared.random_u64() % (ceiling.as_millis() as u64 + 1);
        self.attempt = self.attempt.saturating_add(1);
        self.redial_at = Some(self.now().saturating_add(Duration::from_millis(jitter)));
    }

    /// Handles one command; `Some` when it asks the task to stop.
    fn command(&mut self, command: Command) -> Option<oneshot::Sender<()>> {
        let _span = command
            .object()
            .map(|obj| tracing::debug_span!("object", obj = %obj).entered());
        let now = self.now();
        let machine = self.link.machine_mut();
        match command {
            Command::Open {
                kind,
                obj,
                cap,
                reply,
            } => match machine.open(now, kind, &obj, cap.as_deref()) {
                Ok(open_id) => {
                    debug!(op_id = %open_id, kind = kind.as_str(), "open enqueued");
                    self.opens.insert(obj, (open_id, reply));
                }
                Err(error) => drop(reply.send(Err(error.into()))),
            },
            Command::Send { obj, body, reply } => match machine.send(now, &obj, body) {
                Ok(id) => {
                    debug!(op_id = %id, "send enqueued");
                    self.waiters.insert(id, Waiter::Send(reply));
                }
                Err(error) => drop(reply.send(Err(error.into()))),
            },
            Command::Req { obj, body, reply } => match machine.req(now, &obj, body) {
                Ok(id) => {
                    debug!(op_id = %id, "req enqueued");
                    let waiter = Waiter::Req {
                        res: Vec::new(),
                        reply,
                    };
                    self.waiters.insert(id, waiter);
                }
                Err(error) => drop(reply.send(Err(error.into()))),
            },
            Command::Answer {
                obj,
                req_id,
                verb,
                body,
                code,
                reply,
            } => {
                let result = machine.answer(now, &obj, &req_id, verb, body, code.as_deref());
                let _ = reply.send(result.map_err(Error::from));
            }
            Command::Decide { obj, reject, reply } => {
                let result = match reject {
                    None => machine.accept(now, &obj),
                    Some(code) => machine.reject(now, &obj, &code),
                };
                let _ = reply.send(result.map_err(Error::from));
            }
            Command::Close { obj, reason, reply } => {
                let _ = reply.send(machine.close(now, &obj, &reason).map_err(Error::from));
            }
            Command::Consume { obj, seq } => {
                machine.consume(now, &obj, seq);
            }
            Command::Attach(link) => self.attach(link, Role::Listener),
            Command::Shutdown(done) => return Some(done),
        }
        None
    }

    fn link_message(&mut self, message: LinkMsg) {
        let now = self.now();
        match message {
            LinkMsg::Bytes(generation, bytes) if generation == self.generation => {
                self.link.handle_bytes(now, bytes);
            }
            LinkMsg::Closed(generation) if generation == self.generation => {
                debug!("link closed");
                self.link.handle_eof(now);
                self.detach();
            }
            LinkMsg::Bytes(..) | LinkMsg::Closed(_) => {}
            LinkMsg::Dialed(result) => {
                self.dialing = false;
                match result {
                    Ok(link) => self.attach(link, Role::Dialer),
                    Err(error) => {
                        debug!(%error, "dial failed");
                        self.schedule_redial();
                    }
                }
            }
        }
    }

    /// Binds a new connection (replacing any current one) and starts its handshake.
    fn attach(&mut self, link: Link, role: Role) {
        self.detach_quietly();
        self.generation += 1;
        let generation = self.generation;
        let (mut reader, mut writer) = tokio::io::split(link.stream);
        let tx = self.link_tx.clone();
        tokio::spawn(async move {
            loop {
                let mut buf = BytesMut::with_capacity(READ_CHUNK);
                match reader.read_buf(&mut buf).await {
                    Ok(n) if n > 0 => {
                        if tx
                            .send(LinkMsg::Bytes(generation, buf.freeze()))
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                    _ => {
                        let _ = tx.send(LinkMsg::Closed(generation)).await;
                        return;
                    }
                }
            }
        });
        let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Bytes>();
        tokio::spawn(async move {
            while let Some(bytes) = out_rx.recv().await {
                if writer.write_all(&bytes).await.is_err() {
                    return;
                }
            }
            let _ = writer.shutdown().await;
        });
        self.writer = Some(out_tx);
        let nonce = self.shared.random_bytes().to_vec();
        self.link.link_up(self.now(), role, link.channel, nonce);
    }

    fn detach_quietly(&mut self) {
        self.writer = None;
        self.generation += 1;
        self.link.link_down(self.now());
    }

    fn detach(&mut self) {
        self.detach_quietly();
        self.was_up = false;
        self.schedule_redial();
    }

    /// Drains the link until it has nothing more: persist (one transaction for every batch
    /// so far), then events, then frames.
    async fn flush(&mut self) -> Result<(), crate::store::StoreError> {
        loop {
            let mut progress = false;
            let batches: Vec<PersistBatch> =
                std::iter::from_fn(|| self.link.machine_mut().poll_persist()).collect();
            if let Some(last) = batches.last().map(|batch| batch.id) {
                self.commit(batches).await?;
                let now = self.now();
                self.link.machine_mut().handle_persisted(now, last);
                progress = true;
            }
            while let Some(event) = self.link.poll_event() {
                self.event(event);
                progress = true;
            }
            if let Some(close) = self.link.poll_close() {
                info!(%close, "dropping the link");
                self.detach();
                progress = true;
            }
            if self.link.is_up() && !self.was_up {
                self.was_up = true;
                self.attempt = 0;
                info!(negotiated = ?self.link.negotiated(), "link up");
            }
            let mut out = BytesMut::new();
            while out.len() < WRITE_CHUNK && self.link.poll_transmit(&mut out) {}
            if !out.is_empty() {
                if let Some(writer) = &self.writer {
                    let _ = writer.send(out.freeze());
                }
                progress = true;
            }
            if !progress {
                self.publish_stats();
                return Ok(());
            }
        }
    }

    async fn commit(&self, batches: Vec<PersistBatch>) -> Result<(), crate::store::StoreError> {
        let store = self.shared.store.clone();
        let peer = self.peer.clone();
        if store.is_blocking() {
            tokio::task::spawn_blocking(move || store.commit(&peer, &batches))
                .await
                .unwrap_or_else(|join| Err(crate::store::StoreError::Unavailable(join.to_string())))
        } else {
            store.commit(&peer, &batches)
        }
    }

    fn event(&mut self, event: Event) {
        let _span = match &event {
            Event::Acked { obj, op_id } | Event::Futile { obj, op_id, .. } => {
                Some(tracing::debug_span!("op", %obj, %op_id).entered())
            }
            Event::Answered { obj, req_id, .. } => {
                Some(tracing::debug_span!("op", %obj, op_id = %req_id).entered())
            }
            Event::Delivered(op) => {
                Some(tracing::debug_span!("op", obj = %op.obj, op_id = %op.id).entered())
            }
            _ => None,
        };
        match event {
            Event::Acked { op_id, .. } => {
                debug!("acked");
                // A req's hop ack is not its outcome: it keeps waiting for the answer.
                if matches!(self.waiters.get(&op_id), Some(Waiter::Send(_))) {
                    if let Some(Waiter::Send(reply)) = self.waiters.remove(&op_id) {
                        let _ = reply.send(Ok(op_id));
                    }
                }
            }
            Event::Futile { obj, op_id, code } => {
                debug!(%code, "op futile");
                match self.waiters.remove(&op_id) {
                    Some(Waiter::Send(reply)) => drop(reply.send(Err(Error::Futile(code)))),
                    Some(Waiter::Req { reply, .. }) => drop(reply.send(Err(Error::Futile(code)))),
                    None => {
                        if self.opens.get(&obj).is_some_and(|(id, _)| *id == op_id) {
                            let (_, reply) = self.opens.remove(&obj).expect("checked");
                            let _ = reply.send(Err(Error::Futile(code)));
                        }
                    }
                }
            }
            Event::Opened { obj } => {
                if let Some((_, reply)) = self.opens.remove(&obj) {
                    let _ = reply.send(Ok(()));
                }
            }
            Event::Rejected { obj, code } => {
                if let Some((_, reply)) = self.opens.remove(&obj) {
                    let _ = reply.send(Err(Error::Rejected(code.unwrap_or_default())));
                }
            }
            Event::Answered {
                req_id,
                verb,
                body,
                code,
                ..
            } => {
                let Some(Waiter::Req { mut res, reply }) = self.waiters.remove(&req_id) else {
                    return;
                };
                match verb {
                    Verb::Res => {
                        res.extend(body);
                        self.waiters.insert(req_id, Waiter::Req { res, reply });
                    }
                    Verb::End => drop(reply.send(Ok(Reply { res, end: body }))),
                    _ => drop(reply.send(Err(Error::Remote(code.unwrap_or_default())))),
                }
            }
            Event::OpenRequested { obj, kind, cap, .. } => {
                self.inbound(Inbound::Open(OpenRequest {
                    peer: self.peer.clone(),
                    obj,
                    kind,
                    cap,
                    handle: self.handle.clone(),
                }));
            }
            Event::Delivered(op) => {
                let handle = self.handle.clone();
                let peer = self.peer.clone();
                let body = op.body.unwrap_or_default();
                let item = match op.verb {
                    Verb::Req => Inbound::Request(Request {
                        peer,
                        obj: op.obj,
                        seq: op.seq,
                        req_id: op.id,
                        body,
                        handle,
                    }),
                    _ => Inbound::Message(Delivery {
                        peer,
                        obj: op.obj,
                        seq: op.seq,
                        op_id: op.id,
                        body,
                        handle,
                    }),
                };
                self.inbound(item);
            }
            Event::Closed {
                obj,
                reason,
                by_remote,
            } => {
                if let Some((_, reply)) = self.opens.remove(&obj) {
                    let _ = reply.send(Err(Error::Closed(reason.clone().unwrap_or_default())));
                }
                if by_remote {
                    self.inbound(Inbound::Closed {
                        peer: self.peer.clone(),
                        obj,
                        reason,
                    });
                }
            }
            Event::LinkDead => info!("no traffic within the dead-after interval"),
        }
    }

    fn inbound(&self, item: Inbound) {
        let _ = self.shared.inbound_tx.send(item);
    }

    fn stop(&mut self) {
        self.stats_published = None;
        self.publish_stats();
        self.shared.forget(&self.peer, &self.handle);
        self.detach_quietly();
        for (_, waiter) in self.waiters.drain() {
            match waiter {
                Waiter::Send(reply) => drop(reply.send(Err(Error::Shutdown))),
                Waiter::Req { reply, .. } => drop(reply.send(Err(Error::Shutdown))),
            }
        }
        for (_, (_, reply)) in self.opens.drain() {
            let _ = reply.send(Err(Error::Shutdown));
        }
    }
}
