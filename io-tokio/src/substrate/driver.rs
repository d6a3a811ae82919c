//! The per-peer task: owns one [`PeerLink`], feeds it link bytes, time and persistence
//! results, drains its outputs. No protocol decision is made here.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tether_core::limits::{
    SUBSTRATE_REDIAL_BASE_MS, SUBSTRATE_REDIAL_CAP_MS, SUBSTRATE_STORE_RETRY_BASE_MS,
    SUBSTRATE_STORE_RETRY_CAP_MS, SUBSTRATE_UNCOMMITTED_BATCHES_MAX, SUBSTRATE_WAITING_SENDS_MAX,
    SUBSTRATE_WRITE_CHUNKS_MAX,
};
use tether_core::retry::{Backoff, Retry};
use tether_core::substrate::handshake::Role;
use tether_core::substrate::{CommandError, Event, Machine, PeerId, PeerLink, PersistBatch};
use tether_core::time::Time;
use tether_core::wire::envelope::{ObjKind, Verb};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, Instrument};

use super::commands::{CommandRx, CommandTx};
use super::transport::Link;
use super::{Delivery, Error, Inbound, OpenRequest, ReplySink, Request, Shared, StoreOp};
use crate::store::StoreError;

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
/// When to redial a lost link (the one retry policy, `tether_core::retry`).
const REDIAL: Backoff = Backoff::new(
    Duration::from_millis(SUBSTRATE_REDIAL_BASE_MS),
    Duration::from_millis(SUBSTRATE_REDIAL_CAP_MS),
);
/// When to try a failing store again.
const STORE_RETRY: Backoff = Backoff::new(
    Duration::from_millis(SUBSTRATE_STORE_RETRY_BASE_MS),
    Duration::from_millis(SUBSTRATE_STORE_RETRY_CAP_MS),
);

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
        /// Wait for outbox room (`send`) rather than fail with `QueueFull` (`try_send`).
        wait: bool,
        reply: Reply1<String>,
    },
    Req {
        obj: String,
        body: Bytes,
        wait: bool,
        reply: ReplySink,
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
    /// An inbound link whose handshake verified (it replaces the live link).
    Attach(Box<super::preauth::Verified>),
    /// The app named this peer: a task without a link, a dial in flight or one scheduled
    /// dials now if it has an address (it may have learned one since it started, as a peer
    /// loaded from the store before the app said how to reach it).
    Reach,
    /// Drop the current link as a network cut would.
    Disconnect,
    Shutdown(oneshot::Sender<()>),
}

/// What woke the task.
enum Wake {
    Committed(Result<(), StoreError>),
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
            Command::Attach(_) | Command::Reach | Command::Disconnect | Command::Shutdown(_) => {
                None
            }
        }
    }

    /// Answers the command with `error` without doing it (a peer whose state cannot load).
    fn refuse(self, error: Error) {
        match self {
            Command::Open { reply, .. }
            | Command::Answer { reply, .. }
            | Command::Decide { reply, .. }
            | Command::Close { reply, .. } => drop(reply.send(Err(error))),
            Command::Send { reply, .. } => drop(reply.send(Err(error))),
            Command::Req { reply, .. } => reply.fail(error),
            // A link from a peer whose state cannot load is refused: dropping it closes it.
            Command::Attach(verified) => drop(verified),
            Command::Consume { .. }
            | Command::Reach
            | Command::Disconnect
            | Command::Shutdown(_) => {}
        }
    }

    /// Whether a refusal for want of outbox room should wait for room instead.
    fn waits_for_room(&self) -> bool {
        match self {
            Command::Send { wait, .. } | Command::Req { wait, .. } => *wait,
            Command::Answer { .. } => true,
            _ => false,
        }
    }
}

/// Loads `peer`'s durable state, retrying with backoff while the store fails. Meanwhile links
/// from the peer are refused and app commands answered [`Error::Store`] at once (nothing is
/// enqueued, so nothing is lost); the app hears of the outage on its inbound channel. `None`
/// when the substrate shuts down first.
pub(super) async fn load(
    peer: &PeerId,
    shared: &Arc<Shared>,
    commands: &mut CommandRx,
) -> Option<Machine> {
    let mut retry = Retry::new(STORE_RETRY);
    loop {
        match blocking(shared, {
            let (store, peer) = (shared.store.clone(), peer.clone());
            move || store.load(&peer)
        })
        .await
        {
            Ok(state) => {
                if retry.failures() > 0 {
                    shared.store_recovered(peer, StoreOp::Load);
                }
                let boot = shared.random_u64();
                let (config, authorizer) = (shared.config.clone(), shared.authorizer.clone());
                let machine = Machine::recover(peer.clone(), config, authorizer, boot, &state);
                return Some(machine);
            }
            Err(error) => {
                let now = (shared.clock)();
                let at = retry.fail(now, shared.random_u64());
                shared.store_failed(peer, StoreOp::Load, &error, retry.failures());
                let message = error.to_string();
                let sleep = tokio::time::sleep(until(shared, at));
                tokio::pin!(sleep);
                loop {
                    tokio::select! {
                        biased;
                        command = commands.recv(true) => match command {
                            Command::Shutdown(done) => {
                                let _ = done.send(());
                                return None;
                            }
                            command => command.refuse(Error::Store(message.clone())),
                        },
                        () = &mut sleep => break,
                    }
                }
            }
        }
    }
}

/// Resolves when a full `writer` has room again; never when there is no writer or it has room
/// now (then nothing waits on it).
async fn writable(
    writer: Option<&mpsc::Sender<Bytes>>,
) -> Result<mpsc::Permit<'_, Bytes>, mpsc::error::SendError<()>> {
    match writer {
        Some(writer) if writer.capacity() == 0 => writer.reserve().await,
        _ => std::future::pending().await,
    }
}

/// Runs a store call off the async workers when the store blocks.
async fn blocking<T: Send + 'static>(
    shared: &Shared,
    call: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    if shared.store.is_blocking() {
        tokio::task::spawn_blocking(call)
            .await
            .unwrap_or_else(|join| Err(StoreError::Unavailable(join.to_string())))
    } else {
        call()
    }
}

/// Starts a commit of `batches` without waiting for it: on a blocking store's thread, or as a
/// task of its own (so even a store that does not block finishes while the driver goes on,
/// and the simulator sees commits overlap input exactly as a disk does).
fn start_commit(shared: &Shared, peer: &PeerId, batches: Arc<Vec<PersistBatch>>) -> InFlight {
    let (store, peer) = (shared.store.clone(), peer.clone());
    let commit = {
        let batches = batches.clone();
        move || store.commit(&peer, &batches)
    };
    let task = if shared.store.is_blocking() {
        tokio::task::spawn_blocking(commit)
    } else {
        tokio::spawn(async move { commit() })
    };
    InFlight { batches, task }
}

/// The commit in flight: its batches (kept for a retry if it fails) and its task.
struct InFlight {
    batches: Arc<Vec<PersistBatch>>,
    task: tokio::task::JoinHandle<Result<(), StoreError>>,
}

/// Resolves when the commit in flight ends; never when there is none.
async fn committed(in_flight: Option<&mut InFlight>) -> Result<(), StoreError> {
    match in_flight {
        Some(in_flight) => (&mut in_flight.task)
            .await
            .unwrap_or_else(|join| Err(StoreError::Unavailable(join.to_string()))),
        None => std::future::pending().await,
    }
}

/// How long from now until `at` on the shell's clock.
fn until(shared: &Shared, at: Time) -> Duration {
    let now = (shared.clock)();
    Duration::from_millis(at.as_millis().saturating_sub(now.as_millis()))
}

enum LinkMsg {
    Bytes(u64, Bytes),
    Closed(u64),
    Dialed(std::io::Result<Link>),
}

enum Waiter {
    Send(Reply1<String>),
    Req(ReplySink),
}

pub(super) struct Driver {
    peer: PeerId,
    link: PeerLink,
    shared: Arc<Shared>,
    commands: CommandRx,
    handle: CommandTx,
    link_tx: mpsc::Sender<LinkMsg>,
    link_rx: mpsc::Receiver<LinkMsg>,
    /// The link's writer: at most [`SUBSTRATE_WRITE_CHUNKS_MAX`] chunks queued; when it is
    /// full, frames wait in the machine (bounded by windows and credit) for the socket.
    writer: Option<mpsc::Sender<Bytes>>,
    generation: u64,
    dialing: bool,
    redial: Retry,
    was_up: bool,
    /// Batches not handed to the store yet: they collect while a commit is in flight and go
    /// in the next one (a failed commit puts its batches back in front for the retry).
    uncommitted: Vec<PersistBatch>,
    /// The one commit in flight: the machine goes on taking input while the disk syncs.
    committing: Option<InFlight>,
    store_retry: Retry,
    /// Commands waiting for room in their object's outbox, in arrival order per object.
    parked: HashMap<String, VecDeque<Command>>,
    /// Objects whose outbox may have room again (an op left it).
    freed: BTreeSet<String>,
    /// The last command tried was parked again (its object is still full).
    parked_again: bool,
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
        commands: CommandRx,
        handle: CommandTx,
        pinned: Arc<AtomicBool>,
    ) -> Self {
        // Under per-peer keys this peer's own key (a peer without a record gets an auth that
        // proves nothing: its links fail their handshake).
        let auth = shared
            .auth
            .for_peer(peer.as_str())
            .unwrap_or_else(|| shared.auth.clone());
        let link = PeerLink::new(machine, auth, shared.features.clone());
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
            redial: Retry::new(REDIAL),
            was_up: false,
            uncommitted: Vec::new(),
            committing: None,
            store_retry: Retry::new(STORE_RETRY),
            parked: HashMap::new(),
            freed: BTreeSet::new(),
            parked_again: false,
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
                self.redial.schedule(self.now());
            }
            self.flush().await;
            loop {
                let due = self.next_due();
                let sleep = self.sleep_for(due);
                let take_ops = self.takes_ops();
                // `biased`: the branch order is fixed, so a run replays exactly under a
                // simulator. Fairness comes from draining both channels on every wake.
                let wake = tokio::select! {
                    biased;
                    result = committed(self.committing.as_mut()) => Wake::Committed(result),
                    // While the store is failing, batches pile up; past the bound the link is
                    // not read, and the peer's socket backs up instead of this memory.
                    message = self.link_rx.recv(), if self.reads_link() => {
                        Wake::Link(message.expect("the driver holds a sender"))
                    }
                    command = self.commands.recv(take_ops) => Wake::Command(command),
                    // The writer was full: it has room again for the frames that wait.
                    Ok(permit) = writable(self.writer.as_ref()) => {
                        drop(permit);
                        Wake::Timer
                    }
                    () = sleep => Wake::Timer,
                };
                let mut first_command = None;
                match wake {
                    Wake::Committed(result) => self.committed(result),
                    Wake::Link(message) => self.link_message(message),
                    Wake::Command(command) => first_command = Some(command),
                    Wake::Timer => self.timeout(),
                }
                for _ in 0..READS_PER_WAKE {
                    if !self.reads_link() {
                        break;
                    }
                    let Ok(message) = self.link_rx.try_recv() else {
                        break;
                    };
                    self.link_message(message);
                }
                let mut stop = None;
                for _ in 0..COMMANDS_PER_WAKE {
                    let command = match first_command.take() {
                        Some(command) => command,
                        None => match self.commands.try_recv(self.takes_ops()) {
                            Some(command) => command,
                            None => break,
                        },
                    };
                    if let Some(done) = self.command(command) {
                        stop = Some(done);
                        break;
                    }
                }
                if let Some(done) = stop {
                    self.settle().await;
                    self.stop();
                    let _ = done.send(());
                    return;
                }
                self.flush().await;
                if self.idle() {
                    debug!("no link, no state: the peer's task ends");
                    return self.stop();
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Whether new op commands may be taken: not while an object has
    /// [`SUBSTRATE_WAITING_SENDS_MAX`] commands waiting for outbox room, nor while half of
    /// [`SUBSTRATE_UNCOMMITTED_BATCHES_MAX`] batches wait for the store (they then wait in the
    /// op lane, then in the callers). An app issuing sends faster than the disk takes them
    /// stops here first, so the link (whose acks and credit free what the sends wait for)
    /// goes on being read.
    fn takes_ops(&self) -> bool {
        self.uncommitted.len() < SUBSTRATE_UNCOMMITTED_BATCHES_MAX / 2
            && self
                .parked
                .values()
                .all(|queue| queue.len() < SUBSTRATE_WAITING_SENDS_MAX)
    }

    /// Whether link input may be handled: not while [`SUBSTRATE_UNCOMMITTED_BATCHES_MAX`]
    /// batches wait for the store. The commit in flight does not count: its batches are the
    /// disk's, however many, and reading on while it syncs is what lets the next commit carry
    /// the acks that arrived meanwhile. A failed commit's batches wait again, so during an
    /// outage the bound trips and the peer's writes back up instead of this memory.
    fn reads_link(&self) -> bool {
        self.uncommitted.len() < SUBSTRATE_UNCOMMITTED_BATCHES_MAX
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
            && self.parked.is_empty()
            && self.uncommitted.is_empty()
            && self.committing.is_none()
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
        [
            self.link.poll_timeout(),
            self.redial.due(),
            self.store_retry.due(),
        ]
        .into_iter()
        .flatten()
        .min()
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
        // A due store retry needs nothing here: the flush after this wake commits.
        self.store_retry.take_due(now);
        if self.redial.due().is_some_and(|at| at <= now) && !self.dialing && self.writer.is_none() {
            self.redial.take_due(now);
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
        debug!(attempt = self.redial.failures(), "dialing");
        tokio::spawn(async move {
            let result = shared.transport.dial(&peer, nonce).await;
            let _ = tx.send(LinkMsg::Dialed(result)).await;
        });
    }

    fn schedule_redial(&mut self) {
        if !self.shared.transport.can_dial(&self.peer) || self.dialing {
            return;
        }
        let entropy = self.shared.random_u64();
        self.redial.fail(self.now(), entropy);
    }

    /// Handles one command; `Some` when it asks the task to stop. A command for an object
    /// with commands already waiting for room waits behind them (per-object order).
    fn command(&mut self, command: Command) -> Option<oneshot::Sender<()>> {
        if let Some(queue) = command.object().and_then(|obj| self.parked.get_mut(obj)) {
            if command.waits_for_room() || matches!(command, Command::Close { .. }) {
                // Behind the commands waiting for room, in issue order (bounded: at
                // SUBSTRATE_WAITING_SENDS_MAX the task stops taking op commands). A close
                // waits too: ops sent before it go first.
                queue.push_back(command);
                return None;
            }
            if matches!(command, Command::Send { .. } | Command::Req { .. }) {
                // A `try_send` or `try_req` may not pass them, nor wait: the object is full.
                command.refuse(CommandError::QueueFull.into());
                return None;
            }
        }
        self.try_command(command).err().flatten()
    }

    /// Retries the commands waiting for room in the objects that freed some, in order, until
    /// one is refused again.
    fn unpark(&mut self) {
        for obj in std::mem::take(&mut self.freed) {
            while let Some(command) = self.parked.get_mut(&obj).and_then(VecDeque::pop_front) {
                // Parked commands are app commands, never a shutdown.
                let _ = self.try_command(command);
                if self.parked_again {
                    break;
                }
            }
            if self.parked.get(&obj).is_some_and(VecDeque::is_empty) {
                self.parked.remove(&obj);
            }
        }
    }

    /// Parks `command` (refused for want of room) at the front of its object's queue when it
    /// waits for room; otherwise answers it with the refusal.
    fn park_or_refuse(&mut self, command: Command, error: CommandError) {
        if error == CommandError::QueueFull && command.waits_for_room() {
            let obj = command.object().expect("room is per object").to_owned();
            self.parked.entry(obj).or_default().push_front(command);
            self.parked_again = true;
        } else {
            // A refused command that was parked lets the next one try.
            command.refuse(error.into());
        }
    }

    /// Does one command; `Err(Some(done))` when it asks the task to stop.
    fn try_command(&mut self, command: Command) -> Result<(), Option<oneshot::Sender<()>>> {
        self.parked_again = false;
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
            Command::Send {
                obj,
                body,
                wait,
                reply,
            } => match machine.send(now, &obj, body.clone()) {
                Ok(id) => {
                    debug!(op_id = %id, "send enqueued");
                    self.waiters.insert(id, Waiter::Send(reply));
                }
                Err(error) => {
                    let command = Command::Send {
                        obj,
                        body,
                        wait,
                        reply,
                    };
                    self.park_or_refuse(command, error);
                }
            },
            Command::Req {
                obj,
                body,
                wait,
                reply,
            } => match machine.req(now, &obj, body.clone()) {
                Ok(id) => {
                    debug!(op_id = %id, "req enqueued");
                    self.waiters.insert(id, Waiter::Req(reply));
                }
                Err(error) => {
                    let command = Command::Req {
                        obj,
                        body,
                        wait,
                        reply,
                    };
                    self.park_or_refuse(command, error);
                }
            },
            Command::Answer {
                obj,
                req_id,
                verb,
                body,
                code,
                reply,
            } => {
                let result =
                    machine.answer(now, &obj, &req_id, verb, body.clone(), code.as_deref());
                match result {
                    Ok(()) => drop(reply.send(Ok(()))),
                    Err(error) => {
                        let command = Command::Answer {
                            obj,
                            req_id,
                            verb,
                            body,
                            code,
                            reply,
                        };
                        self.park_or_refuse(command, error);
                    }
                }
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
            Command::Attach(verified) => self.adopt(*verified),
            Command::Reach => {
                if self.writer.is_none()
                    && !self.dialing
                    && self.redial.due().is_none()
                    && self.shared.transport.can_dial(&self.peer)
                {
                    self.redial.schedule(now);
                }
            }
            Command::Disconnect => self.link_message(LinkMsg::Closed(self.generation)),
            Command::Shutdown(done) => return Err(Some(done)),
        }
        Ok(())
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

    /// Binds an inbound connection whose handshake verified (replacing any current one): it
    /// is up at once; the bytes that followed its handshake are read first.
    fn adopt(&mut self, verified: super::preauth::Verified) {
        let super::preauth::Verified {
            link,
            negotiated,
            rest,
        } = verified;
        self.bind(link.stream);
        let now = self.now();
        self.link.adopt(now, negotiated);
        if !rest.is_empty() {
            self.link.handle_bytes(now, rest);
        }
    }

    /// Binds a new connection (replacing any current one) and starts its handshake.
    fn attach(&mut self, link: Link, role: Role) {
        self.bind(link.stream);
        let nonce = self.shared.random_bytes().to_vec();
        self.link.link_up(self.now(), role, link.channel, nonce);
    }

    /// Replaces the current connection's reader and writer with `stream`'s.
    fn bind(&mut self, stream: Box<dyn super::transport::LinkStream>) {
        self.detach_quietly();
        self.generation += 1;
        let generation = self.generation;
        let (mut reader, mut writer) = tokio::io::split(stream);
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
        let (out_tx, mut out_rx) = mpsc::channel::<Bytes>(SUBSTRATE_WRITE_CHUNKS_MAX);
        tokio::spawn(async move {
            while let Some(bytes) = out_rx.recv().await {
                if writer.write_all(&bytes).await.is_err() {
                    return;
                }
            }
            let _ = writer.shutdown().await;
        });
        self.writer = Some(out_tx);
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

    /// Drains the link until it has nothing more: persist (every batch so far in one
    /// transaction, started here and finished while the driver goes on; batches emitted
    /// meanwhile go in the next), then events, then frames. A failed commit keeps its batches
    /// for a retry with backoff: nothing they cover is acknowledged or reported meanwhile.
    async fn flush(&mut self) {
        loop {
            let mut progress = false;
            self.uncommitted.extend(std::iter::from_fn(|| {
                self.link.machine_mut().poll_persist()
            }));
            if self.committing.is_none()
                && !self.uncommitted.is_empty()
                && self.store_retry.due().is_none()
            {
                let batches = Arc::new(std::mem::take(&mut self.uncommitted));
                self.committing = Some(start_commit(&self.shared, &self.peer, batches));
            }
            while let Some(event) = self.link.poll_event() {
                self.event(event);
                progress = true;
            }
            if !self.freed.is_empty() {
                self.unpark();
            }
            if let Some(close) = self.link.poll_close() {
                info!(%close, "dropping the link");
                self.detach();
                progress = true;
            }
            if self.link.is_up() && !self.was_up {
                self.was_up = true;
                self.redial.succeed();
                info!(negotiated = ?self.link.negotiated(), "link up");
            }
            let mut out = BytesMut::new();
            // Frames leave the machine only when the writer has room for them: a slow socket
            // holds them there instead of in an ever longer queue.
            let room = self.writer.as_ref().is_none_or(|w| w.capacity() > 0);
            while room && out.len() < WRITE_CHUNK && self.link.poll_transmit(&mut out) {}
            if !out.is_empty() {
                if let Some(writer) = &self.writer {
                    // Room was checked before the frames were taken.
                    let _ = writer.try_send(out.freeze());
                }
                progress = true;
            }
            if !progress {
                self.publish_stats();
                return;
            }
        }
    }

    /// The commit in flight ended: the machine learns what is durable, or its batches go
    /// back in front of the ones that collected meanwhile, for a retry with backoff.
    fn committed(&mut self, result: Result<(), StoreError>) {
        let Some(InFlight { batches, .. }) = self.committing.take() else {
            return;
        };
        let now = self.now();
        match result {
            Ok(()) => {
                if self.store_retry.failures() > 0 {
                    self.shared.store_recovered(&self.peer, StoreOp::Commit);
                }
                self.store_retry.succeed();
                let last = batches.last().expect("a commit has batches").id;
                self.link.machine_mut().handle_persisted(now, last);
            }
            Err(error) => {
                // A store applies all of a commit or none: the same batches go again, first.
                let mut batches =
                    Arc::try_unwrap(batches).unwrap_or_else(|shared| (*shared).clone());
                batches.append(&mut self.uncommitted);
                self.uncommitted = batches;
                self.store_retry.fail(now, self.shared.random_u64());
                let failures = self.store_retry.failures();
                self.shared
                    .store_failed(&self.peer, StoreOp::Commit, &error, failures);
            }
        }
    }

    /// Before the task ends: waits for the commit in flight and commits what is left, until
    /// nothing is uncommitted or the store fails (what it failed to commit was never
    /// acknowledged, and a restart recovers from what it did commit).
    async fn settle(&mut self) {
        loop {
            self.flush().await;
            let Some(in_flight) = self.committing.as_mut() else {
                return;
            };
            let result = committed(Some(in_flight)).await;
            self.committed(result);
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
            Event::Acked { obj, op_id } => {
                debug!("acked");
                self.freed.insert(obj);
                // A req's hop ack is not its outcome: it keeps waiting for the answer.
                if matches!(self.waiters.get(&op_id), Some(Waiter::Send(_))) {
                    if let Some(Waiter::Send(reply)) = self.waiters.remove(&op_id) {
                        let _ = reply.send(Ok(op_id));
                    }
                }
            }
            Event::Futile { obj, op_id, code } => {
                debug!(%code, "op futile");
                self.freed.insert(obj.clone());
                match self.waiters.remove(&op_id) {
                    Some(Waiter::Send(reply)) => drop(reply.send(Err(Error::Futile(code)))),
                    Some(Waiter::Req(reply)) => reply.fail(Error::Futile(code)),
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
                obj,
                req_id,
                verb,
                body,
                code,
            } => {
                self.freed.insert(obj);
                let Some(Waiter::Req(reply)) = self.waiters.remove(&req_id) else {
                    return;
                };
                match verb {
                    Verb::Res => {
                        // Past the bound the rest of this reply is dropped (the waiter is
                        // gone) and the reader learns why.
                        if reply.res(body.unwrap_or_default()) {
                            self.waiters.insert(req_id, Waiter::Req(reply));
                        }
                    }
                    Verb::End => reply.end(body),
                    _ => reply.fail(Error::Remote(code.unwrap_or_default())),
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
            Event::Violation { what } => {
                tracing::warn!(what, "the peer sent a frame no honest peer sends: link cut")
            }
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
                Waiter::Req(reply) => reply.fail(Error::Shutdown),
            }
        }
        for (_, (_, reply)) in self.opens.drain() {
            let _ = reply.send(Err(Error::Shutdown));
        }
        for command in self.parked.drain().flat_map(|(_, queue)| queue) {
            command.refuse(Error::Shutdown);
        }
    }
}
