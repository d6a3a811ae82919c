//! The per-peer task: the executor of one core [`Peer`]. It feeds the peer app commands, link
//! bytes, dial, load and commit results and time, and does what the peer's outputs say: load,
//! commit, dial, bind a connection, answer a command, tell the app. When to redial, when to
//! retry the store, when to hold commands or stop reading the link and when the task ends are
//! the peer's decisions (`tether_core::substrate::peer`), not this task's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tether_core::limits::{
    SUBSTRATE_COMMANDS_PER_WAKE, SUBSTRATE_INLINE_COMMIT_RECORDS_MAX, SUBSTRATE_READS_PER_WAKE,
    SUBSTRATE_READ_CHUNK_BYTES, SUBSTRATE_READ_ROOM_MIN_BYTES, SUBSTRATE_WRITE_CHUNKS_MAX,
    SUBSTRATE_WRITE_CHUNK_BYTES, SUBSTRATE_WRITE_RESERVE_BYTES,
};

use bytes::{Bytes, BytesMut};
use tether_core::substrate::peer::{
    DialFailed, Dialed, Failure, Output, Peer, Reply, StoreFault, Ticket,
};
use tether_core::substrate::{DurableState, Event, Machine, PeerId, PeerLink, PersistBatch};
use tether_core::time::Time;
use tether_core::wire::envelope::{FrameChunks, Verb};
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{debug, info, Instrument};

use super::answers::{answers, Answers};
use super::commands::{Answer, Command, CommandRx, CommandTx};
use super::transport::Link;
use super::{Delivery, Error, Inbound, OpenRequest, Request, Shared};
use crate::store::{StoreError, StoreFailure};

/// What woke the task.
enum Wake {
    Loaded(Result<DurableState, StoreError>),
    Committed(Result<(), StoreError>),
    Link(LinkMsg),
    Command(Command),
    Timer,
}

/// Runs a store call off the async workers when the store blocks, or as a task of its own
/// (so even a store that does not block finishes while the driver goes on, and the simulator
/// sees store calls overlap input exactly as a disk does).
fn start<T: Send + 'static>(
    shared: &Shared,
    call: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> JoinHandle<Result<T, StoreError>> {
    if shared.store.is_blocking() {
        tokio::task::spawn_blocking(call)
    } else {
        tokio::spawn(async move { call() })
    }
}

/// Resolves when the store call in flight ends; never when there is none.
async fn finished<T>(
    call: Option<&mut JoinHandle<Result<T, StoreError>>>,
) -> Result<T, StoreError> {
    match call {
        Some(task) => task.await.unwrap_or_else(|_| Err(StoreError::TaskFailed)),
        None => std::future::pending().await,
    }
}

/// Resolves when a full `writer` has room again; never when there is no writer or it has room
/// now (then nothing waits on it).
async fn writable(
    writer: Option<&mpsc::Sender<Vec<Bytes>>>,
) -> Result<mpsc::Permit<'_, Vec<Bytes>>, mpsc::error::SendError<()>> {
    match writer {
        Some(writer) if writer.capacity() == 0 => writer.reserve().await,
        _ => std::future::pending().await,
    }
}

enum LinkMsg {
    Bytes(u64, Bytes),
    Closed(u64),
    Dialed(std::io::Result<Link>),
}

pub(super) struct PeerExecutor {
    id: PeerId,
    peer: Peer,
    shared: Arc<Shared>,
    /// This peer's own auth (under per-peer keys).
    auth: tether_core::substrate::handshake::Auth,
    commands: CommandRx,
    handle: CommandTx,
    link_tx: mpsc::Sender<LinkMsg>,
    link_rx: mpsc::Receiver<LinkMsg>,
    /// The bound connection's writer: at most [`SUBSTRATE_WRITE_CHUNKS_MAX`] chunks queued;
    /// when it is full, frames wait in the peer (bounded by windows and credit).
    writer: Option<mpsc::Sender<Vec<Bytes>>>,
    /// Where frames are encoded: each batch handed to the writer is split off it, and its
    /// space is used again once the writer drops the batch (no allocation per wake). Bodies
    /// go by reference when the bound stream takes owned chunks (QUIC).
    out: FrameChunks,
    /// A connection handed to the peer and not bound yet: bound on [`Output::Bind`], dropped
    /// otherwise once the outputs are drained.
    pending: Option<Box<dyn super::transport::LinkStream>>,
    loading: Option<JoinHandle<Result<DurableState, StoreError>>>,
    committing: Option<JoinHandle<Result<(), StoreError>>>,
    /// A small commit to try in place on this task's worker at the top of the next turn,
    /// once what this turn handed on (frames to the writer) has run.
    in_place: Option<Arc<Vec<PersistBatch>>>,
    /// The last store error, reported with the peer's [`Output::StoreFailed`].
    store_error: Option<StoreFailure>,
    /// The last load error, for commands refused while the state cannot load.
    load_error: Option<StoreFailure>,
    answers: Answers,
    next_ticket: Ticket,
    pinned: Arc<AtomicBool>,
    /// Who waits for the task to end (a shutdown).
    done: Option<oneshot::Sender<()>>,
}

impl PeerExecutor {
    pub(super) fn new(
        id: PeerId,
        shared: Arc<Shared>,
        commands: CommandRx,
        handle: CommandTx,
        pinned: Arc<AtomicBool>,
        for_link: bool,
    ) -> Self {
        // Under per-peer keys this peer's own key (a peer without a record gets an auth that
        // proves nothing: its links fail their handshake).
        let auth = shared
            .auth
            .for_peer(id.as_str())
            .unwrap_or_else(|| shared.auth.clone());
        let named = pinned.load(Ordering::SeqCst);
        let peer = Peer::new(
            id.clone(),
            named,
            shared.transport.can_dial(&id),
            shared.random_u64(),
        );
        // Started for an inbound link: the link waits in the lanes until the state is loaded.
        let peer = if for_link { peer.awaiting_link() } else { peer };
        let (link_tx, link_rx) = mpsc::channel(16);
        Self {
            id,
            peer,
            shared,
            auth,
            commands,
            handle,
            link_tx,
            link_rx,
            writer: None,
            out: FrameChunks::new(usize::MAX),
            pending: None,
            loading: None,
            committing: None,
            in_place: None,
            store_error: None,
            load_error: None,
            answers: answers(),
            next_ticket: 0,
            pinned,
            done: None,
        }
    }

    pub(super) async fn run(mut self) {
        let span = tracing::info_span!("peer", peer = %self.id.as_str());
        async move {
            self.execute();
            while !self.peer.finished() {
                let sleep = self.sleep_for(self.peer.poll_timeout());
                let reads = self.peer.reads_link();
                let hears = self.done.is_none() && self.peer.hears_commands();
                let takes = self.peer.accepts_commands();
                // `biased`: the branch order is fixed, so a run replays exactly under a
                // simulator. Fairness comes from draining both channels on every wake.
                let in_place = match self.in_place.take() {
                    Some(batches) => {
                        // Every task this turn woke (the writer with the frames just taken,
                        // the connection behind it) runs first: the sync then holds the worker.
                        tokio::task::yield_now().await;
                        if self.nothing_waits() {
                            self.commit_in_place(batches)
                        } else {
                            // Input came while they ran: the peer is busy, and a sync held
                            // here would hold that input and everything queued on this
                            // worker. It runs off the workers, as any commit under load.
                            self.commit_off_workers(batches);
                            None
                        }
                    }
                    None => None,
                };
                let wake = if let Some(result) = in_place {
                    Wake::Committed(result)
                } else {
                    tokio::select! {
                    biased;
                    result = finished(self.loading.as_mut()) => Wake::Loaded(result),
                    result = finished(self.committing.as_mut()) => Wake::Committed(result),
                    message = self.link_rx.recv(), if reads => {
                        Wake::Link(message.expect("the driver holds a sender"))
                    }
                    command = self.commands.recv(takes), if hears => {
                        Wake::Command(command)
                    }
                    // The writer was full: it has room again for the frames that wait.
                    Ok(permit) = writable(self.writer.as_ref()) => {
                        drop(permit);
                        Wake::Timer
                    }
                    () = sleep => Wake::Timer,
                    }
                };
                self.wake(wake);
            }
            if self.done.is_none() {
                debug!("no link, no state: the peer's task ends");
            }
            let now = self.now();
            self.peer.finish(now);
            self.execute();
            if let Some(batches) = self.in_place.take() {
                // As a commit handed to the blocking pool would, it still runs.
                let _ = self.shared.store.commit(&self.id, &batches);
            }
            self.shared.forget(&self.id, &self.handle);
            // Answers the peer never reached (commands refused while loading, ...) are
            // dropped: their callers see the substrate shut down.
            self.answers.clear();
            if let Some(done) = self.done.take() {
                let _ = done.send(());
            }
        }
        .instrument(span)
        .await
    }

    /// Hands the peer what woke the task, then what else waits (link bytes and commands, up
    /// to their per-wake shares), and carries out its outputs.
    fn wake(&mut self, wake: Wake) {
        // What the app and the transport know now (an address added, the peer named)
        // is the peer's before anything of this wake reaches it.
        self.reachability();
        // One reading of the clock for everything this wake hands the peer: nothing
        // in it waits, so the inputs are as good as simultaneous.
        let now = self.now();
        let mut first_command = None;
        match wake {
            Wake::Loaded(result) => self.loaded(now, result),
            Wake::Committed(result) => self.committed(now, result),
            Wake::Link(message) => self.link_message(now, message),
            Wake::Command(command) => first_command = Some(command),
            Wake::Timer => self.peer.handle_timeout(now),
        }
        for _ in 0..SUBSTRATE_READS_PER_WAKE {
            if !self.peer.reads_link() {
                break;
            }
            let Ok(message) = self.link_rx.try_recv() else {
                break;
            };
            self.link_message(now, message);
        }
        for _ in 0..SUBSTRATE_COMMANDS_PER_WAKE {
            if self.done.is_some() || !self.peer.hears_commands() {
                break;
            }
            let command = match first_command.take() {
                Some(command) => command,
                None => match self.commands.try_recv(self.peer.accepts_commands()) {
                    Some(command) => command,
                    None => break,
                },
            };
            self.command(now, command);
        }
        self.reachability();
        self.execute();
    }

    /// Tells the peer whether the app named it and whether the transport knows an address.
    fn reachability(&mut self) {
        let named = self.pinned.load(Ordering::SeqCst);
        let dialable = self.shared.transport.can_dial(&self.id);
        self.peer.handle_reachability(named, dialable);
    }

    fn now(&self) -> Time {
        (self.shared.clock)()
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

    /// Hands one command to the peer.
    fn command(&mut self, now: Time, command: Command) {
        match command {
            Command::App(command, answer) => {
                let _span = tracing::debug_span!("object", obj = %command.object()).entered();
                let ticket = self.next_ticket;
                self.next_ticket += 1;
                if let Some(answer) = answer {
                    self.answers.insert(ticket, answer);
                }
                self.peer.handle_command(now, ticket, command);
            }
            Command::Attach(verified) => {
                let super::preauth::Verified {
                    link,
                    negotiated,
                    rest,
                } = *verified;
                self.pending = Some(link.stream);
                self.peer.handle_adopt(now, negotiated, rest);
                // Its `Bind` goes out now, with this connection: another handed over in
                // the same wake (a dial that ended) must not take its place.
                self.execute();
            }
            Command::Reach => {
                // The app added the address before it named the peer.
                self.reachability();
                self.peer.handle_reach(now);
            }
            Command::ReplyRead(ticket, body_len) => self.peer.handle_reply_read(ticket, body_len),
            Command::Disconnect => self.peer.handle_disconnect(now),
            Command::Shutdown(done) => {
                self.done = Some(done);
                self.peer.handle_shutdown(now);
            }
        }
    }

    fn link_message(&mut self, now: Time, message: LinkMsg) {
        match message {
            LinkMsg::Bytes(generation, bytes) => {
                self.peer.handle_link_bytes(now, generation, bytes);
            }
            LinkMsg::Closed(generation) => {
                if generation == self.peer.generation() {
                    metrics::counter!(super::metric::CONN_ENDED, "peer" => self.id.as_str().to_owned(), "cause" => "closed")
                        .increment(1);
                    info!(
                        event = "substrate.conn.ended",
                        cause = "closed",
                        "link closed"
                    );
                }
                self.peer.handle_link_closed(now, generation);
            }
            LinkMsg::Dialed(Ok(link)) => {
                self.pending = Some(link.stream);
                let nonce = self.shared.random_bytes().to_vec();
                let dialed = Dialed {
                    channel: link.channel,
                    nonce,
                };
                self.peer.handle_dialed(now, Ok(dialed));
                // As for an adopted connection: bound (or dropped) before the next input.
                self.execute();
            }
            LinkMsg::Dialed(Err(error)) => {
                debug!(%error, "dial failed");
                self.peer.handle_dialed(now, Err(DialFailed));
            }
        }
    }

    /// The load ended: the peer's machine is recovered from the state, or the failure is the
    /// peer's to retry.
    fn loaded(&mut self, now: Time, result: Result<DurableState, StoreError>) {
        self.loading = None;
        match result {
            Ok(state) => {
                let boot = self.shared.random_u64();
                let (config, authorizer) =
                    (self.shared.config.clone(), self.shared.authorizer.clone());
                let machine = Machine::recover(self.id.clone(), config, authorizer, boot, &state);
                let link = PeerLink::new(machine, self.auth.clone(), self.shared.features.clone());
                self.peer.handle_loaded(now, Ok(link));
            }
            Err(error) => {
                let error = StoreFailure::from(error);
                self.load_error = Some(error.clone());
                self.store_error = Some(error);
                self.peer.handle_loaded(now, Err(StoreFault));
            }
        }
    }

    /// The commit in flight ended.
    fn committed(&mut self, now: Time, result: Result<(), StoreError>) {
        self.committing = None;
        let result = result.map_err(|error| {
            self.store_error = Some(error.into());
            StoreFault
        });
        self.peer.handle_committed(now, result);
    }

    /// Hands `batches` to the store off the async workers (or as a task of its own).
    fn commit_off_workers(&mut self, batches: Arc<Vec<PersistBatch>>) {
        let (store, id) = (self.shared.store.clone(), self.id.clone());
        let commit = move || {
            // A commit includes its sync when the store syncs (the store's promise).
            let began = std::time::Instant::now();
            let committed = store.commit(&id, &batches);
            metrics::histogram!(super::metric::STORE_COMMIT_MS)
                .record(began.elapsed().as_secs_f64() * 1e3);
            committed
        };
        self.committing = Some(start(&self.shared, commit));
    }

    /// Tries `batches` in place: their result, or `None` when the store would wait on more
    /// than its own sync (they are then handed off the workers, as any commit). A store that
    /// panics fails the commit as a failed task would, and the peer retries it.
    fn commit_in_place(
        &mut self,
        batches: Arc<Vec<PersistBatch>>,
    ) -> Option<Result<(), StoreError>> {
        let began = std::time::Instant::now();
        let store = &self.shared.store;
        let tried = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            store.commit_in_place(&self.id, &batches)
        }))
        .unwrap_or(Some(Err(StoreError::TaskFailed)));
        match tried {
            Some(result) => {
                metrics::histogram!(super::metric::STORE_COMMIT_MS)
                    .record(began.elapsed().as_secs_f64() * 1e3);
                Some(result)
            }
            None => {
                self.commit_off_workers(batches);
                None
            }
        }
    }

    /// Whether a commit of `records` is tried in place on this task's worker: only on a
    /// blocking store, only a small one, and only when no link bytes and no command wait for
    /// this task; the store still declines one that would wait on more than its own sync
    /// ([`crate::store::Store::commit_in_place`]). Then the sync holds the worker for as long
    /// as it takes, where handing it to a blocking thread and being woken again costs two
    /// thread wakes on the path of whatever waits for the commit (an awaited send's hop ack);
    /// under load commits grow and input waits, and they run on the blocking pool while the
    /// task goes on. How a commit runs changes when its result arrives, never what the peer
    /// does with it.
    fn commits_in_place(&self, records: usize) -> bool {
        self.shared.store.is_blocking()
            && records <= SUBSTRATE_INLINE_COMMIT_RECORDS_MAX
            && self.nothing_waits()
    }

    /// No link bytes and no command wait for this task (asked when a commit is chosen to run
    /// in place, and again when it is about to).
    fn nothing_waits(&self) -> bool {
        self.link_rx.is_empty() && self.commands.is_idle()
    }

    /// Does what the peer's outputs say, then moves its frames to the writer while it has
    /// room, until the peer has nothing more.
    fn execute(&mut self) {
        loop {
            let mut progress = false;
            while let Some(output) = self.peer.poll_output() {
                progress = true;
                self.output(output);
            }
            // Frames leave the peer only when the writer has room for them: a slow socket
            // holds them there instead of in an ever longer queue.
            let room = self.writer.as_ref().is_some_and(|w| w.capacity() > 0);
            if room {
                self.out.reserve(SUBSTRATE_WRITE_RESERVE_BYTES);
            }
            while room
                && self.out.len() < SUBSTRATE_WRITE_CHUNK_BYTES
                && self.peer.poll_transmit(&mut self.out)
            {}
            if !self.out.is_empty() {
                let chunks = self.out.take();
                if let Some(writer) = &self.writer {
                    // Room was checked before the frames were taken.
                    let _ = writer.try_send(chunks);
                }
                progress = true;
            }
            if !progress {
                break;
            }
        }
        // A connection the peer did not bind (refused while its state cannot load, or after
        // a shutdown) is dropped, which closes it.
        self.pending = None;
    }

    fn output(&mut self, output: Output) {
        match output {
            Output::Load => {
                let (store, id) = (self.shared.store.clone(), self.id.clone());
                // The peer asks for one load at a time (core's `Peer` decides; a second
                // would leave the first's result unread).
                debug_assert!(self.loading.is_none(), "a load is in flight");
                self.loading = Some(start(&self.shared, move || store.load(&id)));
            }
            Output::Commit(batches) => {
                // One commit at a time, wherever it runs.
                debug_assert!(
                    self.committing.is_none() && self.in_place.is_none(),
                    "a commit is in flight"
                );
                let records: usize = batches.iter().map(|batch| batch.records.len()).sum();
                if self.commits_in_place(records) {
                    self.in_place = Some(batches);
                } else {
                    self.commit_off_workers(batches);
                }
            }
            Output::Dial { attempt } => {
                let shared = self.shared.clone();
                let id = self.id.clone();
                let tx = self.link_tx.clone();
                let nonce = shared.random_bytes();
                debug!(attempt, "dialing");
                tokio::spawn(async move {
                    let result = shared.transport.dial(&id, nonce).await;
                    let _ = tx.send(LinkMsg::Dialed(result)).await;
                });
            }
            Output::Bind { generation } => {
                let stream = self
                    .pending
                    .take()
                    .expect("the peer binds the connection just handed to it");
                self.bind(stream, generation);
            }
            Output::Unbind => self.writer = None,
            Output::Reply { ticket, reply } => self.answer(ticket, reply),
            Output::App(event) => self.app(event),
            Output::LinkUp(negotiated) => {
                metrics::counter!(super::metric::CONN_READY, "peer" => self.id.as_str().to_owned())
                    .increment(1);
                info!(event = "substrate.conn.ready", ?negotiated, "link up");
            }
            Output::LinkDropped(close) => {
                let cause = super::metric::close_cause(&close);
                metrics::counter!(super::metric::CONN_ENDED, "peer" => self.id.as_str().to_owned(), "cause" => cause)
                    .increment(1);
                info!(event = "substrate.conn.ended", cause, %close, "dropping the link");
            }
            Output::StoreFailed { call, failures } => {
                let error = self
                    .store_error
                    .take()
                    .unwrap_or_else(|| StoreError::TaskFailed.into());
                self.shared.store_failed(&self.id, call, &error, failures);
            }
            Output::StoreRecovered { call } => self.shared.store_recovered(&self.id, call),
            Output::PublishStats => {
                if let Some(machine) = self.peer.machine() {
                    self.shared.publish(&self.id, machine);
                }
            }
            _ => {}
        }
    }

    /// Reads and writes `stream` under `generation`, replacing the bound connection.
    fn bind(&mut self, stream: Box<dyn super::transport::LinkStream>, generation: u64) {
        let (mut reader, mut writer) = super::transport::halves(stream);
        // Frames taken from here on are encoded for this writer.
        self.out = FrameChunks::new(writer.by_reference());
        let tx = self.link_tx.clone();
        tokio::spawn(async move {
            let mut blocks = ReadBlocks::default();
            loop {
                match blocks.read(&mut reader).await {
                    Ok(Some(bytes)) => {
                        if tx.send(LinkMsg::Bytes(generation, bytes)).await.is_err() {
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
        let (out_tx, mut out_rx) = mpsc::channel::<Vec<Bytes>>(SUBSTRATE_WRITE_CHUNKS_MAX);
        tokio::spawn(async move {
            while let Some(mut chunks) = out_rx.recv().await {
                if writer.write_chunks(&mut chunks).await.is_err() {
                    return;
                }
            }
            writer.shutdown().await;
        });
        self.writer = Some(out_tx);
    }

    /// Answers the command `ticket`.
    fn answer(&mut self, ticket: Ticket, reply: Reply) {
        // Looked at in place: a `res` part leaves its request waiting, and a reply of another
        // kind (never made) leaves the caller waiting for its own.
        let reply = match (self.answers.get_mut(ticket), reply) {
            (Some(Answer::Req(sink)), Reply::Res(body)) => return sink.res(ticket, body),
            (Some(Answer::Unit(_)), reply @ (Reply::Done | Reply::Failed(_)))
            | (Some(Answer::Sent(_)), reply @ (Reply::Sent(_) | Reply::Failed(_)))
            | (Some(Answer::Req(_)), reply @ (Reply::End(_) | Reply::Failed(_))) => reply,
            _ => return,
        };
        let answer = self.answers.remove(ticket).expect("found above");
        let error = |failure: Failure| failure_error(failure, self.load_error.as_ref());
        match (answer, reply) {
            (Answer::Unit(tx), Reply::Done) => drop(tx.send(Ok(()))),
            (Answer::Sent(tx), Reply::Sent(op_id)) => {
                debug!(%op_id, "acked");
                drop(tx.send(Ok(op_id)));
            }
            (Answer::Req(sink), Reply::End(body)) => sink.end(body),
            (Answer::Unit(tx), Reply::Failed(failure)) => drop(tx.send(Err(error(failure)))),
            (Answer::Sent(tx), Reply::Failed(failure)) => {
                if let Failure::Futile(code) = &failure {
                    info!(event = "substrate.futile", code = %code, "an op ended futile");
                }
                drop(tx.send(Err(error(failure))));
            }
            (Answer::Req(sink), Reply::Failed(failure)) => sink.fail(error(failure)),
            _ => unreachable!("matched above"),
        }
    }

    /// An event the app hears of.
    fn app(&self, event: Event) {
        match event {
            Event::OpenRequested { obj, kind, cap, .. } => {
                self.inbound(Inbound::Open(OpenRequest {
                    peer: self.id.clone(),
                    obj,
                    kind,
                    cap,
                    handle: self.handle.clone(),
                }));
            }
            Event::Delivered(op) => {
                let _span = tracing::debug_span!("op", obj = %op.obj, op_id = %op.id).entered();
                let handle = self.handle.clone();
                let peer = self.id.clone();
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
            Event::Closed { obj, reason, .. } => {
                self.inbound(Inbound::Closed {
                    peer: self.id.clone(),
                    obj,
                    reason,
                });
            }
            Event::LinkDead => info!("no traffic within the dead-after interval"),
            Event::Violation { what } => {
                tracing::warn!(what, "the peer sent a frame no honest peer sends: link cut")
            }
            _ => {}
        }
    }

    fn inbound(&self, item: Inbound) {
        let _ = self.shared.inbound_tx.send(item);
    }
}

/// The error a caller sees for `failure`; `load_error` is why the store cannot load.
fn failure_error(failure: Failure, load_error: Option<&StoreFailure>) -> Error {
    match failure {
        Failure::Command(error) => Error::Command(error),
        Failure::Futile(code) => Error::Futile(code),
        Failure::Rejected(code) => Error::Rejected(code),
        Failure::Remote(code) => Error::Remote(code),
        Failure::Closed(reason) => Error::Closed(reason),
        Failure::StoreUnavailable => Error::Store(
            load_error
                .cloned()
                .unwrap_or_else(|| StoreError::TaskFailed.into()),
        ),
        Failure::ReplyTooLarge(max) => {
            metrics::counter!("tether_substrate_replies_too_large").increment(1);
            Error::ReplyTooLarge(max)
        }
        _ => Error::Shutdown,
    }
}

/// A link's reads, laid end to end in blocks of [`SUBSTRATE_READ_CHUNK_BYTES`]: each read is
/// split off the block it filled, and the decoder keeps what it decodes as views of it. A
/// fresh block is taken only when less than [`SUBSTRATE_READ_ROOM_MIN_BYTES`] is left, so
/// small reads share a block (a peer pacing its bytes cannot make each body it sends hold a
/// block of its own).
#[derive(Default)]
struct ReadBlocks {
    block: BytesMut,
}

impl ReadBlocks {
    /// The next read's bytes; `None` at the end of the stream.
    async fn read(
        &mut self,
        reader: &mut (impl tokio::io::AsyncRead + Unpin),
    ) -> std::io::Result<Option<Bytes>> {
        if self.block.capacity() - self.block.len() < SUBSTRATE_READ_ROOM_MIN_BYTES {
            self.block = BytesMut::with_capacity(SUBSTRATE_READ_CHUNK_BYTES);
        }
        match reader.read_buf(&mut self.block).await? {
            0 => Ok(None),
            _ => Ok(Some(self.block.split().freeze())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::substrate::transport::{BoxFuture, Transport};
    use crate::substrate::{AllowAll, Authorizer, Substrate};
    use tether_core::substrate::capabilities;
    use tether_core::substrate::handshake::{negotiate, Auth, Channel};
    use tokio::io::AsyncWriteExt;

    /// Knows an address for every peer; its dials and accepts never end (the test hands the
    /// task its connections itself).
    struct Silent;

    impl Transport for Silent {
        fn can_dial(&self, _: &PeerId) -> bool {
            true
        }

        fn dial<'a>(&'a self, _: &'a PeerId, _: [u8; 16]) -> BoxFuture<'a, std::io::Result<Link>> {
            Box::pin(std::future::pending())
        }

        fn accept(&self) -> BoxFuture<'_, std::io::Result<(PeerId, Link)>> {
            Box::pin(std::future::pending())
        }
    }

    fn link(stream: tokio::io::DuplexStream, conn_id: &[u8]) -> Link {
        Link {
            stream: Box::new(stream),
            channel: Channel {
                conn_id: conn_id.to_vec(),
                binding: Vec::new(),
            },
            source: None,
        }
    }

    /// A dial that ended and an inbound connection verified for the same peer reach its task
    /// in one wake: each is bound to its own generation in turn, the dialed one is replaced
    /// (its writer ends, so its far end reads the dialer's hello, then the end) and the
    /// adopted one is the bound link. The shell once kept one pending connection for both
    /// hand-overs, and the second `Bind` found none and panicked the task.
    #[tokio::test]
    async fn a_dial_and_an_adopt_in_one_wake_each_bind_their_own_connection() {
        let auth = Auth::SharedKey(b"k".to_vec());
        let substrate = Substrate::builder(PeerId::new("me"), Silent)
            .auth(auth.clone())
            .authorize(Authorizer::new(AllowAll))
            .seed(7)
            .start()
            .expect("starts");
        let shared = substrate.inner.shared.clone();
        let (tx, rx) = super::super::commands::channel();
        let pinned = Arc::new(AtomicBool::new(true));
        let mut task = PeerExecutor::new(PeerId::new("p"), shared, rx, tx.clone(), pinned, false);
        task.execute();
        let loaded = finished(task.loading.as_mut()).await;
        task.wake(Wake::Loaded(loaded));
        assert!(task.peer.machine().is_some(), "the state is loaded");
        let before = task.peer.generation();

        let (dialed_near, mut dialed_far) = tokio::io::duplex(64 * 1024);
        let (adopted_near, _adopted_far) = tokio::io::duplex(64 * 1024);
        let caps = capabilities(&auth, Vec::new(), 32);
        let negotiated = negotiate(&caps, &caps).expect("the same offer agrees");
        tx.control(Command::Attach(Box::new(super::super::preauth::Verified {
            link: link(adopted_near, b"adopted"),
            negotiated,
            rest: Bytes::new(),
        })));
        // The dial's end wakes the task; the verified inbound link waits in its commands.
        task.wake(Wake::Link(LinkMsg::Dialed(Ok(link(
            dialed_near,
            b"dialed",
        )))));

        // Each bind moves the generation past the connection it replaces.
        assert!(task.peer.generation() > before + 1, "two connections bound");
        assert!(task.writer.is_some(), "the adopted connection is bound");
        assert!(task.pending.is_none());
        let mut hello = Vec::new();
        dialed_far
            .read_to_end(&mut hello)
            .await
            .expect("the replaced connection ends cleanly");
        assert!(!hello.is_empty(), "the dialer's hello went out on it first");
    }

    /// A peer's bytes paced one small write at a time are read end to end into one block
    /// until its room runs low, then into one fresh block: a body kept from a small read
    /// holds its share of a block, never a block of its own.
    #[tokio::test]
    async fn small_reads_lie_end_to_end_in_shared_blocks() {
        let (mut near, mut far) = tokio::io::duplex(4096);
        let mut blocks = ReadBlocks::default();
        let mut reads = Vec::new();
        for i in 0..70u8 {
            far.write_all(&[i; 1000]).await.unwrap();
            let read = blocks.read(&mut near).await.unwrap().expect("bytes");
            assert_eq!(&read[..], &[i; 1000][..]);
            reads.push(read);
        }
        let fresh_blocks = reads
            .windows(2)
            .filter(|pair| pair[1].as_ptr() != pair[0].as_ptr().wrapping_add(pair[0].len()))
            .count();
        // 62 reads fill a 64 KiB block to less than 4 KiB of room; the rest share the next.
        assert_eq!(fresh_blocks, 1);
        drop(far);
        assert!(blocks.read(&mut near).await.unwrap().is_none());
    }
}
