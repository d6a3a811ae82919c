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

use bytes::Bytes;

use super::finality::Code;
use super::handshake::{Negotiated, Role};
use super::link::PeerLink;
use super::machine::{CommandError, Event, Machine, Refused};
use super::{Address, ObjName, OpId, PeerId, PersistBatch};
use crate::limits::{
    SUBSTRATE_ADOPT_WAIT_MS, SUBSTRATE_LAZY_COMMIT_BATCHES_MAX, SUBSTRATE_LAZY_COMMIT_MS,
    SUBSTRATE_REDIAL_BASE_MS, SUBSTRATE_REDIAL_CAP_MS, SUBSTRATE_REPLY_BYTES_MAX,
    SUBSTRATE_REPLY_PART_OVERHEAD_BYTES, SUBSTRATE_RING_GAP_MAX, SUBSTRATE_RING_SLOTS_MAX,
    SUBSTRATE_STATS_EVERY_MS, SUBSTRATE_STORE_RETRY_BASE_MS, SUBSTRATE_STORE_RETRY_CAP_MS,
    SUBSTRATE_UNCOMMITTED_BATCHES_MAX, SUBSTRATE_UNCOMMITTED_RECORDS_MAX,
    SUBSTRATE_WAITING_SENDS_MAX,
};
use crate::retry::{Backoff, Jitter, Retry};
use crate::ring::Ring;
use crate::time::Time;
use crate::wire::envelope::{FrameSink, Verb};

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

/// The longest a batch nothing waits on is held back before it is committed on its own
/// ([`SUBSTRATE_LAZY_COMMIT_MS`]).
pub const LAZY_COMMIT: Duration = Duration::from_millis(SUBSTRATE_LAZY_COMMIT_MS);

/// How often a peer's counters are published ([`Output::PublishStats`]).
pub const STATS_EVERY: Duration = Duration::from_millis(SUBSTRATE_STATS_EVERY_MS);

mod io;
pub use io::*;

/// Sends and reqs in flight, by the counter of their op ids ([`Machine::minted_counter`]):
/// ids are minted in order and mostly acked in about that order, so a ring finds each beside
/// the last one, where a hash table of thousands of 40-byte ids missed the cache on every ack.
type Waiters = Ring<Waiter>;

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
    /// Since when the oldest of `uncommitted` waits: batches nothing waits on are held back
    /// until one that something waits on comes, or [`LAZY_COMMIT`] after this.
    held_since: Option<Time>,
    committing: Option<Arc<Vec<PersistBatch>>>,
    /// The list of the last commit's batches, emptied, for the next commit to fill: a busy
    /// peer's commit carries hundreds of batches, and a fresh list grew to them one doubling
    /// at a time. Kept while the machine keeps its spare step buffers (at most
    /// [`SUBSTRATE_UNCOMMITTED_BATCHES_MAX`] entries), freed by a timeout that finds nothing
    /// uncommitted or in flight.
    spare_batches: Vec<PersistBatch>,
    store_retry: Retry,
    /// Commands waiting for room in their object's outbox, in arrival order per object.
    parked: BTreeMap<String, VecDeque<(Ticket, Command)>>,
    /// Objects whose outbox may have room again (an op left it).
    freed: BTreeSet<Address>,
    /// Sends and reqs in flight, by op id: one lookup per ack, in a map that holds every send
    /// in flight (thousands, where a tree's search compared a dozen ids).
    waiters: Waiters,
    /// Opens in flight, by object: the open's op id and ticket.
    opens: BTreeMap<ObjName, (OpId, Ticket)>,
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
            held_since: None,
            committing: None,
            spare_batches: Vec::new(),
            store_retry: Retry::new(STORE_RETRY),
            parked: BTreeMap::new(),
            freed: BTreeSet::new(),
            waiters: Ring::new(SUBSTRATE_RING_SLOTS_MAX, SUBSTRATE_RING_GAP_MAX),
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
    pub fn poll_transmit(&mut self, out: &mut impl FrameSink) -> bool {
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
            commit: self.lazy_commit_due(),
        }
    }

    /// When [`Peer::handle_timeout`] is due.
    pub fn poll_timeout(&self) -> Option<Time> {
        let Timers {
            link,
            redial,
            store_retry,
            adopt,
            commit,
        } = self.timers();
        [link, redial, store_retry, adopt, commit]
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
    /// batches or [`SUBSTRATE_UNCOMMITTED_RECORDS_MAX`] records wait for the store. The commit
    /// in flight does not count: its batches are the disk's, and reading on while it syncs lets
    /// the next commit carry the acks that arrived meanwhile. A failed commit's batches wait
    /// again, so during an outage the bound trips and the peer's writes back up instead of
    /// this memory.
    pub fn reads_link(&self) -> bool {
        self.uncommitted.len() < SUBSTRATE_UNCOMMITTED_BATCHES_MAX
            && self
                .uncommitted
                .iter()
                .map(|batch| batch.records.len())
                .sum::<usize>()
                < SUBSTRATE_UNCOMMITTED_RECORDS_MAX
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
                    let machine = link.machine_mut();
                    machine.handle_persisted(now, last);
                    // The store is done with them: their buffers serve the next steps, and
                    // their list the next commit.
                    if let Ok(mut batches) = Arc::try_unwrap(batches) {
                        batches.drain(..).for_each(|batch| machine.recycle(batch));
                        if machine.keeps_spares()
                            && batches.capacity() <= SUBSTRATE_UNCOMMITTED_BATCHES_MAX
                            && batches.capacity() > self.spare_batches.capacity()
                        {
                            self.spare_batches = batches;
                        }
                    }
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
                if self.committing.is_none() && self.uncommitted.is_empty() {
                    // Quiet: the next commit is not near (the machine frees its spares alike).
                    self.spare_batches = Vec::new();
                }
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
        // In the order the commands came.
        let mut waiting: Vec<Ticket> = self
            .waiters
            .drain()
            .map(|(Waiter::Send(ticket) | Waiter::Req(ticket))| ticket)
            .collect();
        waiting.sort_unstable();
        for ticket in waiting {
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
            // A refused body comes back with the error, so a parked command keeps it without
            // the machine's or a second reference to it.
            Command::Send { obj, body, wait } => match machine.message(now, &obj, Verb::Send, body)
            {
                Ok(id) => {
                    let key = machine.minted_counter(&id).expect("the machine minted it");
                    self.waiters.insert(key, Waiter::Send(ticket));
                    None
                }
                Err(Refused { error, body }) => Some((Command::Send { obj, body, wait }, error)),
            },
            Command::Req { obj, body, wait } => match machine.message(now, &obj, Verb::Req, body) {
                Ok(id) => {
                    let key = machine.minted_counter(&id).expect("the machine minted it");
                    self.waiters.insert(key, Waiter::Req(ticket));
                    None
                }
                Err(Refused { error, body }) => Some((Command::Req { obj, body, wait }, error)),
            },
            Command::Answer {
                obj,
                req_id,
                verb,
                body,
                code,
            } => match machine.offer_answer(now, &obj, &req_id, verb, body, code.as_deref()) {
                Ok(()) => {
                    self.reply(ticket, Reply::Done);
                    None
                }
                Err(Refused { error, body }) => {
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
            if !self.uncommitted.is_empty() {
                self.held_since.get_or_insert(now);
            }
            if self.committing.is_none()
                && !self.uncommitted.is_empty()
                && self.store_retry.due().is_none()
                && self.commit_now(now)
            {
                let next = std::mem::take(&mut self.spare_batches);
                let batches = Arc::new(std::mem::replace(&mut self.uncommitted, next));
                self.held_since = None;
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

    /// Whether the batches waiting go to the store now: something waits on one of them (an
    /// output or an outbox op to transmit), the peer is stopping, enough of them piled up, or
    /// the oldest was held [`LAZY_COMMIT`]. Otherwise they ride with the next commit that
    /// something waits on, so a side that forgets acked ops and consumed deliveries does not
    /// put a sync of its own in front of the next send or the next arrival.
    fn commit_now(&self, now: Time) -> bool {
        let Some(first) = self.uncommitted.first() else {
            return false;
        };
        let awaited = match &self.stage {
            Stage::Ready(link) => link.machine().awaits_persist_from(first.id),
            Stage::Loading { .. } => true,
        };
        awaited
            || self.stopping
            || self.uncommitted.len() >= SUBSTRATE_LAZY_COMMIT_BATCHES_MAX
            || self.lazy_commit_due().is_some_and(|at| at <= now)
    }

    /// When the batches held back are committed on their own, if a commit could start.
    fn lazy_commit_due(&self) -> Option<Time> {
        if self.committing.is_some() || self.store_retry.due().is_some() {
            return None;
        }
        self.held_since
            .map(|since| since.saturating_add(LAZY_COMMIT))
    }

    /// The key of this side's op `id` among the waiters (`None`: not an id this side minted).
    fn minted(&self, id: &OpId) -> Option<u64> {
        match &self.stage {
            Stage::Ready(link) => link.machine().minted_counter(id),
            Stage::Loading { .. } => None,
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
                if let Some(key) = self.minted(&op_id) {
                    if let Some(&Waiter::Send(ticket)) = self.waiters.get(key) {
                        self.waiters.remove(key);
                        self.reply(ticket, Reply::Sent(op_id));
                    }
                }
            }
            Event::Futile { obj, op_id, code } => {
                self.freed.insert(obj.clone());
                match self.minted(&op_id).and_then(|key| self.waiters.remove(key)) {
                    Some(Waiter::Send(ticket) | Waiter::Req(ticket)) => {
                        self.unread.remove(&ticket);
                        self.reply(ticket, Reply::Failed(Failure::Futile(Code::parse(&code))));
                    }
                    None => {
                        let name = ObjName::from(&obj);
                        let its_open = self.opens.get(&name).is_some_and(|(id, _)| *id == op_id);
                        if let Some((_, ticket)) =
                            its_open.then(|| self.opens.remove(&name)).flatten()
                        {
                            self.reply(ticket, Reply::Failed(Failure::Futile(Code::parse(&code))));
                        }
                    }
                }
            }
            Event::Opened { obj } => {
                if let Some((_, ticket)) = self.opens.remove(&ObjName::from(&obj)) {
                    self.reply(ticket, Reply::Done);
                }
            }
            Event::Rejected { obj, code } => {
                if let Some((_, ticket)) = self.opens.remove(&ObjName::from(&obj)) {
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
                let Some(key) = self.minted(&req_id) else {
                    return;
                };
                let Some(&Waiter::Req(ticket)) = self.waiters.get(key) else {
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
                    self.waiters.remove(key);
                    self.unread.remove(&ticket);
                }
                self.reply(ticket, reply);
            }
            Event::Closed {
                obj,
                reason,
                by_remote,
            } => {
                if let Some((_, ticket)) = self.opens.remove(&ObjName::from(&obj)) {
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
mod tests;
