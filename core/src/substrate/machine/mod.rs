//! The per-peer substrate machine (docs/spec/substrate.md): objects, outbox, sequencer, dedupe,
//! finality and the authorize gate, with no I/O.
//!
//! # Driving it
//!
//! Inputs are `handle_*` calls and app commands, each taking `now`. After every input, drain
//! the outputs: [`Machine::poll_persist`] (hand each batch to the store, in order),
//! [`Machine::poll_transmit`] (frames for the link, in order), [`Machine::poll_event`] (for the
//! app), then sleep until [`Machine::poll_timeout`] and call [`Machine::handle_timeout`].
//! When the store has committed batches, call [`Machine::handle_persisted`] with the highest
//! committed id.
//!
//! # The two rules that give exactly-once
//!
//! - Nothing is transmitted before the batch holding it is persisted, except a send whose seq
//!   is below the object's committed seq reservation: it travels while its batch commits.
//!   Should this side die first, it may have been delivered, and no other op ever takes its
//!   seq (a restart resumes at the reservation and announces the floor past the unused rest).
//!   An op leaves the outbox only when a hop ack citing its current receipt arrives (or a
//!   terminal answer ends it).
//! - Nothing is acknowledged or reported before the batch that made it durable is persisted:
//!   hop acks, re-acks of duplicates, bounces and every app event wait for their batch. One
//!   report names a commit of the peer instead: the hop ack of an op the peer applied in order
//!   ([`Event::Acked`]) is reported as it arrives, before this side's removal of the op is
//!   persisted (see `Object::acked_in_order` for why a crash in between cannot contradict it).
//!
//! Each object has one sequence authority per direction. The receiver delivers in seq order,
//! holds early ops (persisted before they are acked), re-acks anything below the frontier and
//! asks for a `resync` when a gap is older than 30 s.
//!
//! # Flow control
//!
//! The receiver holds at most `W` ops of an object (its receive window, offered in the
//! handshake): delivered and not yet consumed, plus held above the frontier. It gives the
//! sender credit, `limit = next + W − unconsumed`, on every ack and in a credit update when
//! the app's consumption frees room; the limit never falls, and it is only given once the state
//! it counts is durable, so it holds across a restart. The sender transmits only seqs below the
//! limit it was given. A stopped consumer therefore stops the sender (its app's sends wait
//! for outbox room), and an op is never refused for want of room: `out_of_seq` answers only a
//! peer that sent past its credit.
//!
//! # Floors
//!
//! An op that ends at its sender without being delivered (a terminal answer, TTL expiry) would
//! leave a gap. The sender closes it by carrying `floor`, the lowest seq still in its outbox,
//! on every op, and in a floor announcement (a `resync` carrying `floor`) when an op in the
//! middle ended and nothing else carries the news, or when the receiver asks. Every seq below
//! the floor has ended or was acked: the receiver delivers the acked ones it holds, in order,
//! and skips only the seqs it never received.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use bytes::Bytes;

use super::authorize::{AuthorizeContext, Authorizer};
use super::durable::{
    BatchId, DurableState, ObjectRecord, ObjectState, Op, PersistBatch, Record, Seq, Side,
};
use super::finality::{self, class_of, Class};
use super::{Config, PeerId, Stats};
use crate::limits::{
    ENVELOPE_INLINE_BODY_BYTES_MAX, ENVELOPE_TEXT_BYTES_MAX,
    SUBSTRATE_SPARE_LARGE_STEP_BUFFERS_MAX, SUBSTRATE_SPARE_LARGE_STEP_BUFFER_ENTRIES_MAX,
    SUBSTRATE_SPARE_STEP_BUFFERS_MAX, SUBSTRATE_SPARE_STEP_BUFFER_ENTRIES_MAX,
};
use crate::retry::{Backoff, Jitter};
use crate::time::Time;
use crate::wire::envelope::{
    Address, Env, Envelope, EnvelopeDecoder, EnvelopeError, ObjKind, OpId, Verb,
};
use crate::wire::text::ByText;
use crate::wire::{DecodeError, StreamDecoder};

mod frames;
mod inbound;
mod outbox;
mod steps;
mod timers;

use frames::*;
use outbox::{Outbox, Outgoing};

/// Type byte of the keepalive control frame.
pub const TYPE_KEEPALIVE: u8 = 0x03;

/// What the app learns.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Event {
    /// The remote opened an object; answer with [`Machine::accept`] or [`Machine::reject`].
    OpenRequested {
        /// Address.
        obj: Address,
        /// Session or queue.
        kind: ObjKind,
        /// The open's op id.
        op_id: OpId,
        /// The capability token presented, unparsed.
        cap: Option<String>,
    },
    /// The remote accepted an object this side opened.
    Opened {
        /// Address.
        obj: Address,
    },
    /// The remote rejected an object this side opened.
    Rejected {
        /// Address.
        obj: Address,
        /// The reject code.
        code: Option<String>,
    },
    /// A send or req of the remote, durable here; call [`Machine::consume`] when done with it.
    Delivered(Op),
    /// The remote's app answered a req of this side (res, end or err).
    Answered {
        /// Address.
        obj: Address,
        /// The req's op id.
        req_id: OpId,
        /// Res, End or Err.
        verb: Verb,
        /// Its body.
        body: Option<Bytes>,
        /// Its code (err).
        code: Option<String>,
    },
    /// The object was closed (by the remote when `by_remote`).
    Closed {
        /// Address.
        obj: Address,
        /// The reason given.
        reason: Option<String>,
        /// Whether the remote closed it.
        by_remote: bool,
    },
    /// An op of this side is durable at the remote (hop ack).
    Acked {
        /// Address.
        obj: Address,
        /// The op id.
        op_id: OpId,
    },
    /// An op of this side ended without effect (a terminal error, a close, TTL expiry).
    Futile {
        /// Address.
        obj: Address,
        /// The op id.
        op_id: OpId,
        /// Why.
        code: String,
    },
    /// Nothing was heard for the dead-after interval: the shell should drop the link.
    LinkDead,
    /// The peer sent a frame no honest peer sends (`what` names it): it was dropped unapplied
    /// and counted, and the shell should drop the link. Nothing it carried moved any state.
    Violation {
        /// What was wrong with the frame.
        what: &'static str,
    },
}

/// Why an app command was refused. Nothing changes when a command is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CommandError {
    /// The address is not `[a-z0-9._/-]{1,128}` (or contains `@`).
    #[error("invalid address: {0}")]
    Address(#[from] crate::wire::envelope::AddressError),
    /// No such object, or it is closed.
    #[error("no live object {0:?}")]
    NoSuchObject(String),
    /// The object exists already.
    #[error("object {0:?} is already open")]
    AlreadyOpen(String),
    /// The object is not in a state that allows this command.
    #[error("object {0:?} does not allow this now")]
    WrongState(String),
    /// The body is above the inline bound (64 KiB).
    #[error("payload of {len} bytes exceeds {max}")]
    PayloadTooLarge {
        /// Body length.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// The object's outbox holds its maximum of un-acked ops.
    #[error("queue_full: the object's outbox is full")]
    QueueFull,
    /// This peer has the maximum number of objects.
    #[error("quota: too many objects for this peer")]
    Quota,
    /// A code, reason or capability longer than the envelope allows.
    #[error("text field longer than {ENVELOPE_TEXT_BYTES_MAX} bytes")]
    TextTooLong,
}

/// A command the machine refused, with the body it carried handed back.
#[derive(Debug)]
pub(crate) struct Refused<T> {
    pub(crate) error: CommandError,
    pub(crate) body: T,
}

#[derive(Debug, Clone, Hash)]
struct Object {
    record: ObjectRecord,
    outbox: Outbox,
    /// Early ops of the remote, with their arrival time.
    held: BTreeMap<Seq, Op>,
    /// Delivered, not yet consumed by the app.
    inbox: BTreeMap<Seq, Op>,
    /// When the current gap was first seen.
    gap_since: Option<Time>,
    last_resync: Option<Time>,
    /// Sending: the credit the peer gave beyond the link's initial credit (memory; the peer
    /// repeats it on every link).
    tx_limit: Seq,
    /// Sending: the highest floor told to the peer on this link.
    floor_sent: Seq,
    /// Sending: the highest seq of this side that ended without an ack (memory).
    ended_max: Option<Seq>,
    /// Sending: this side's ops of the object were all made in this boot (the object was not
    /// recovered from the store), so which of them were acked is known here.
    made_here: bool,
    /// Receiving: the highest credit told to the peer on this link (beyond the initial one).
    limit_sent: Seq,
    /// Sending: seqs below this are reserved; the object's record carries it as its `tx_next`,
    /// so a restart resumes here ([`crate::limits::SUBSTRATE_SEQ_RESERVE`]).
    reserved: Seq,
    /// The batch that staged `reserved`.
    reserved_batch: BatchId,
    /// The highest reservation known committed: a send below it may go on the wire before
    /// its own batch is committed.
    reserved_durable: Seq,
    /// Its entry in the machine's timer table, if any (kept here, so that re-arming it after
    /// a step looks the object up once, not a second table too).
    armed: Option<Time>,
}

impl Object {
    /// An object; both directions start from the link's initial credit (the handshake's
    /// window, which both sides know, so neither needs telling).
    fn new(record: ObjectRecord) -> Self {
        Self {
            outbox: Outbox::default(),
            held: BTreeMap::new(),
            inbox: BTreeMap::new(),
            gap_since: None,
            last_resync: None,
            tx_limit: Seq::ZERO,
            floor_sent: Seq::ZERO,
            ended_max: None,
            limit_sent: Seq::ZERO,
            made_here: true,
            reserved: record.tx_next,
            reserved_batch: BatchId(0),
            reserved_durable: record.tx_next,
            record,
            armed: None,
        }
    }

    /// The object's record as it is persisted: its `tx_next` is the seq reservation, where a
    /// restart resumes.
    fn durable_record(&self) -> ObjectRecord {
        ObjectRecord {
            tx_next: self.reserved,
            ..self.record.clone()
        }
    }

    /// The reservation committed once `persisted` is: sends below it may go before their
    /// own commit.
    fn reserved_through(&mut self, persisted: BatchId) -> Seq {
        if self.reserved_batch <= persisted {
            self.reserved_durable = self.reserved;
        }
        self.reserved_durable
    }

    /// Whether the hop ack of `seq`, just taken out of the outbox, can be reported before
    /// that removal is committed. It can when the peer applied the op in order: then the op
    /// is below the peer's frontier for good, so should this side die before the removal is
    /// committed, the op comes back, goes out again, and is answered by an ack again, never by
    /// anything else. This side knows it when every op of its below `seq` was acked and none
    /// ended otherwise (in this boot, for an object made in it). An op the peer acked while it
    /// held it out of order is not known to be applied (a close there may discard it, and its
    /// resend would be answered `closed`): it waits for its removal's commit, as everything
    /// did before.
    fn acked_in_order(&self, seq: Seq) -> bool {
        self.made_here
            && self.ended_max.is_none()
            && self.outbox.first_seq().is_none_or(|first| first > seq)
    }

    /// The lowest seq still in the outbox, or the next to assign: the sender's `floor`.
    fn floor(&self) -> Seq {
        self.outbox.first_seq().unwrap_or(self.record.tx_next)
    }

    /// The credit this side gives the peer: seqs below it fit in `window` (held plus
    /// unconsumed). Never falls: a delivery into the inbox moves the frontier with it.
    fn receive_limit(&self, window: u64) -> Seq {
        let unconsumed = self.inbox.len() as u64;
        self.record
            .rx_next
            .saturating_add(window.saturating_sub(unconsumed))
    }

    /// The highest seq of the peer seen here, plus one.
    fn seen_end(&self) -> Seq {
        self.held
            .last_key_value()
            .map_or(self.record.rx_next, |(seq, _)| *seq + 1)
    }

    /// Whether the peer must be told the floor: an op of this side ended at or above what the
    /// peer last heard, and everything below the floor is settled.
    fn floor_unannounced(&self) -> bool {
        self.ended_max
            .is_some_and(|ended| ended >= self.floor_sent && self.floor() > ended)
    }

    fn remote_is_participant(&self) -> bool {
        match self.record.state {
            ObjectState::Live => true,
            ObjectState::AwaitingAccept => self.record.opened_by == Side::Remote,
            ObjectState::Opening | ObjectState::Closed(_) | ObjectState::Rejected(_) => false,
        }
    }
}

/// An output that waits for a batch to be persisted.
#[derive(Debug, Clone, Hash)]
enum Deferred {
    Transmit(Envelope),
    /// Transmitted as [`Deferred::Transmit`], but nothing waits on it: it does not make its
    /// batch urgent ([`Machine::awaits_persist_from`]).
    Lazily(Envelope),
    Event(Event),
}

/// The objects one step touched: pushed as the step goes (a repeat of the last one is
/// skipped), sorted and deduplicated when it ends, which is the order a set would give; the
/// buffer is kept from step to step, so a step allocates nothing for it.
#[derive(Clone, Debug, Default)]
pub(super) struct Touched(Vec<Address>);

impl Touched {
    pub(super) fn insert(&mut self, obj: Address) {
        if self.0.last() != Some(&obj) {
            self.0.push(obj);
        }
    }

    pub(super) fn remove(&mut self, obj: &Address) {
        self.0.retain(|touched| touched != obj);
    }

    pub(super) fn extend(&mut self, objs: impl IntoIterator<Item = Address>) {
        self.0.extend(objs);
    }

    /// The step's objects, each once, in order; the buffer comes back by [`Touched::restore`].
    pub(super) fn take(&mut self) -> Vec<Address> {
        let mut objs = std::mem::take(&mut self.0);
        objs.sort_unstable();
        objs.dedup();
        objs
    }

    /// Keeps `buffer`'s room for the next step, unless this one touched objects meanwhile.
    pub(super) fn restore(&mut self, mut buffer: Vec<Address>) {
        if self.0.is_empty() {
            buffer.clear();
            self.0 = buffer;
        }
    }
}

/// Emptied step buffers kept for the next steps, so that a busy peer does not allocate and
/// free a record buffer and an output buffer per input. At most
/// [`SUBSTRATE_SPARE_STEP_BUFFERS_MAX`] of each kind are kept with room for at most
/// [`SUBSTRATE_SPARE_STEP_BUFFER_ENTRIES_MAX`] entries, and at most
/// [`SUBSTRATE_SPARE_LARGE_STEP_BUFFERS_MAX`] larger ones (room for at most
/// [`SUBSTRATE_SPARE_LARGE_STEP_BUFFER_ENTRIES_MAX`]), which a read of several frames stages
/// into. A timeout that finds every batch persisted frees them, and so does the commit or link
/// loss that leaves every batch persisted with no link up. They hold no state: a clone starts
/// without them, and the fingerprint leaves them out.
#[derive(Debug, Default)]
struct Spares {
    records: Pool<Record>,
    outputs: Pool<Deferred>,
}

/// Spare buffers of one kind: small ones for most steps, large ones for reads of many frames.
#[derive(Debug)]
struct Pool<T> {
    small: Vec<Vec<T>>,
    large: Vec<Vec<T>>,
}

impl<T> Default for Pool<T> {
    fn default() -> Self {
        Self {
            small: Vec::new(),
            large: Vec::new(),
        }
    }
}

impl<T> Pool<T> {
    /// An empty buffer for a step.
    fn take(&mut self) -> Vec<T> {
        self.small.pop().unwrap_or_default()
    }

    /// Keeps `buffer`, emptied, if its room is within a bound and its pool has a place.
    fn keep(&mut self, mut buffer: Vec<T>) {
        let (pool, most) = match buffer.capacity() {
            0 => return,
            room if room <= SUBSTRATE_SPARE_STEP_BUFFER_ENTRIES_MAX => {
                (&mut self.small, SUBSTRATE_SPARE_STEP_BUFFERS_MAX)
            }
            room if room <= SUBSTRATE_SPARE_LARGE_STEP_BUFFER_ENTRIES_MAX => {
                (&mut self.large, SUBSTRATE_SPARE_LARGE_STEP_BUFFERS_MAX)
            }
            _ => return,
        };
        if pool.len() < most {
            buffer.clear();
            pool.push(buffer);
        }
    }

    /// Moves what `staged` holds, while it is small, into a large spare that takes its place
    /// (its own room kept as a spare), so that a read of many frames does not grow it entry
    /// by entry.
    fn enlarge(&mut self, staged: &mut Vec<T>) {
        if staged.capacity() <= SUBSTRATE_SPARE_STEP_BUFFER_ENTRIES_MAX {
            if let Some(mut large) = self.large.pop() {
                large.append(staged);
                let small = std::mem::replace(staged, large);
                self.keep(small);
            }
        }
    }

    /// Gives the room of `staged`, emptied and larger than a small spare, back to the spares
    /// (a small one takes its place), so that a step's room is not kept for the next one.
    fn shed(&mut self, staged: &mut Vec<T>) {
        if staged.is_empty() && staged.capacity() > SUBSTRATE_SPARE_STEP_BUFFER_ENTRIES_MAX {
            let emptied = std::mem::replace(staged, self.take());
            self.keep(emptied);
        }
    }

    #[cfg(any(test, feature = "harness"))]
    fn len(&self) -> usize {
        self.small.len() + self.large.len()
    }
}

impl Clone for Spares {
    fn clone(&self) -> Self {
        Self::default()
    }
}

/// The substrate machine for one remote peer.
#[derive(Clone)]
pub struct Machine {
    remote: PeerId,
    config: Config,
    /// In-flight ops per object (the configured window).
    window: usize,
    /// The receive window both sides agreed on in the handshake: the credit every object
    /// starts with, in both directions.
    /// As a limit: positions start at 0, so the credit is also the first limit.
    initial_credit: Seq,
    /// Jitter for transient retries, seeded per boot.
    jitter: Jitter,
    authorizer: Arc<Authorizer>,
    /// Prefix of op ids minted in this boot (a seed passed in, distinct per boot).
    boot: u64,
    minted: u64,
    objects: BTreeMap<Address, Object>,
    bounces: BTreeMap<OpId, (String, Time)>,
    /// Bounce tombstones by when they were made (the oldest is evicted or expires first).
    bounce_order: BTreeSet<(Time, OpId)>,
    /// The timer table: each object's next deadline (gap resync, transient retry, TTL expiry,
    /// retention), ordered, so the next wake and the due objects cost O(log n).
    timers: BTreeSet<(Time, Address)>,
    /// Objects the step in progress touched: their deadlines are re-armed and their outboxes
    /// offered to the link when it ends (no step walks every object).
    touched: Touched,
    /// Objects with entries in each unpersisted batch: persisting it may let them transmit.
    awaiting_persist: VecDeque<(BatchId, Address)>,
    link_up: bool,
    last_heard: Time,
    /// The peer broke the protocol on this link ([`Event::Violation`]): nothing more it sends
    /// is read until the next link is up.
    cut: bool,
    last_sent: Time,
    /// Records of the step in progress; become one batch when the step ends.
    staged: Vec<Record>,
    /// Outputs of the step in progress that wait for durability.
    staged_outputs: Vec<Deferred>,
    /// Emptied buffers for the next steps' records and outputs ([`Spares`]).
    spares: Spares,
    next_batch: BatchId,
    persisted_through: BatchId,
    waiting: VecDeque<(BatchId, Vec<Deferred>)>,
    persist: VecDeque<PersistBatch>,
    transmit: VecDeque<Envelope>,
    events: VecDeque<Event>,
    stats: Stats,
}

impl std::fmt::Debug for Machine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Machine")
            .field("remote", &self.remote)
            .field("objects", &self.objects.len())
            .field("link_up", &self.link_up)
            .field("persisted_through", &self.persisted_through)
            .finish_non_exhaustive()
    }
}

impl Machine {
    /// A machine with nothing persisted. `boot` must differ between boots of the same node
    /// (a random seed from the shell): op ids are `boot` plus a counter. `config` is applied
    /// through [`Config::checked`] (window at least 1, retention at least the queue TTL).
    pub fn new(remote: PeerId, config: Config, authorizer: Arc<Authorizer>, boot: u64) -> Self {
        let config = config.checked();
        Self {
            remote,
            window: config.in_flight_max,
            initial_credit: Seq(config.receive_window),
            jitter: Jitter::new(boot ^ 0x7e7e_7e7e),
            config,
            authorizer,
            boot,
            minted: 0,
            objects: BTreeMap::new(),
            bounces: BTreeMap::new(),
            bounce_order: BTreeSet::new(),
            timers: BTreeSet::new(),
            touched: Touched::default(),
            awaiting_persist: VecDeque::new(),
            link_up: false,
            last_heard: Time::ZERO,
            cut: false,
            last_sent: Time::ZERO,
            staged: Vec::new(),
            staged_outputs: Vec::new(),
            spares: Spares::default(),
            next_batch: BatchId(1),
            persisted_through: BatchId(0),
            waiting: VecDeque::new(),
            persist: VecDeque::new(),
            transmit: VecDeque::new(),
            events: VecDeque::new(),
            stats: Stats::default(),
        }
    }

    /// Rebuilds a machine after a restart from exactly what was persisted. Unconsumed
    /// deliveries and undecided opens are reported again; outbox ops are sent again on the
    /// next link with new receipts.
    pub fn recover(
        remote: PeerId,
        config: Config,
        authorizer: Arc<Authorizer>,
        boot: u64,
        state: &DurableState,
    ) -> Self {
        let mut machine = Self::new(remote, config, authorizer, boot);
        for (name, record) in &state.objects {
            let mut object = Object::new(record.clone());
            object.made_here = false;
            // Seqs of this side below the reservation that are not in the outbox ended: acked,
            // or made and lost before their commit (a send among them may have reached the
            // peer), or never used. The floor past them is announced once nothing below it
            // is left (`Object::floor_unannounced`), so the peer never waits on them.
            if let Some(last) = record.tx_next.get().checked_sub(1) {
                object.ended_max = Some(Seq(last));
            }
            machine.objects.insert(name.clone(), object);
        }
        for ((obj, seq), op) in &state.outbox {
            if let Some(object) = machine.objects.get_mut(obj) {
                let entry = Outgoing {
                    op: op.clone(),
                    batch: BatchId(0),
                    receipt: 0,
                    in_flight: false,
                    retry_at: None,
                    recovered: true,
                    transient_failures: 0,
                };
                debug_assert_eq!(*seq, entry.op.seq);
                object.outbox.insert(entry);
            }
        }
        for ((obj, seq), op) in &state.held {
            if let Some(object) = machine.objects.get_mut(obj) {
                object.held.insert(*seq, op.clone());
                // A gap from before the restart: resync as soon as a link allows.
                object.gap_since = Some(Time::ZERO);
            }
        }
        for ((obj, seq), op) in &state.inbox {
            if let Some(object) = machine.objects.get_mut(obj) {
                object.inbox.insert(*seq, op.clone());
            }
        }
        machine.bounces = state.bounces.clone();
        machine.bounce_order = state
            .bounces
            .iter()
            .map(|(op_id, (_, at))| (*at, op_id.clone()))
            .collect();
        let names: Vec<Address> = machine.objects.keys().cloned().collect();
        for name in names {
            machine.rearm(&name);
        }
        for object in machine.objects.values() {
            if object.record.state == ObjectState::AwaitingAccept {
                machine
                    .events
                    .push_back(open_requested(&object.record, None));
            }
            for op in object.inbox.values() {
                machine.events.push_back(Event::Delivered(op.clone()));
            }
        }
        machine
    }

    // -----------------------------------------------------------------------------------------
    // Outputs

    /// The next batch to persist, in order.
    pub fn poll_persist(&mut self) -> Option<PersistBatch> {
        self.persist.pop_front()
    }

    /// The next frame to transmit, in order.
    pub fn poll_transmit(&mut self) -> Option<Envelope> {
        self.transmit.pop_front()
    }

    /// The next app event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When [`Machine::handle_timeout`] should be called next. O(log n): the link's two
    /// timers, the first entry of the timer table and the oldest tombstone.
    pub fn poll_timeout(&self) -> Option<Time> {
        let link = self.link_up.then(|| {
            let keepalive = self.last_sent.saturating_add(self.config.keepalive);
            keepalive.min(self.last_heard.saturating_add(self.config.dead_after))
        });
        let object = self.timers.first().map(|(at, _)| *at);
        let bounce = self
            .bounce_order
            .first()
            .map(|(at, _)| at.saturating_add(self.config.dedupe_retention));
        [link, object, bounce].into_iter().flatten().min()
    }

    /// Counters (serializable).
    pub fn stats(&self) -> Stats {
        let mut stats = self.stats.clone();
        stats.outbox_depth = self
            .objects
            .iter()
            .filter(|(_, object)| !object.outbox.is_empty())
            .map(|(name, object)| (name.to_string(), object.outbox.len() as u64))
            .collect();
        stats
    }

    /// The remote peer.
    pub fn remote(&self) -> &PeerId {
        &self.remote
    }

    /// The lifecycle state of `obj`, if known.
    pub fn object_state(&self, obj: &str) -> Option<ObjectState> {
        self.objects.get_text(obj).map(|object| object.record.state)
    }

    /// Feeds the whole machine state to `state`, for model checkers that deduplicate states:
    /// two machines that hash alike behave identically (the outbox's indexes and cursor, which
    /// follow from its entries, are left out).
    pub fn fingerprint<H: std::hash::Hasher>(&self, state: &mut H) {
        use std::hash::Hash;
        (&self.objects, &self.bounces, self.link_up).hash(state);
        (self.last_heard, self.last_sent, self.minted).hash(state);
        (self.next_batch, self.persisted_through, &self.waiting).hash(state);
        (&self.persist, &self.transmit, &self.events, &self.staged).hash(state);
    }

    /// Deliveries the app has not consumed (or, for reqs, not answered) yet, by object and seq.
    pub fn pending_deliveries(&self) -> Vec<&Op> {
        self.objects
            .values()
            .flat_map(|object| object.inbox.values())
            .collect()
    }

    /// No object, nothing waiting to be persisted or released: dropping this machine loses
    /// nothing that [`Machine::recover`] would not rebuild (tombstones are durable).
    pub fn is_idle(&self) -> bool {
        self.objects.is_empty()
            && self.staged.is_empty()
            && self.staged_outputs.is_empty()
            && self.waiting.is_empty()
            && self.persist.is_empty()
            && self.events.is_empty()
    }

    /// Whether anything waits for batch `from` or a later one to be persisted: an output
    /// (an ack, a credit, an app event, a report) released by its commit, an outbox op
    /// that may only go on the wire once its insert is durable, or a renewal of a seq
    /// reservation. A batch nothing waits on (an outbox op forgotten after its ack, a
    /// consumed delivery, an expired tombstone, a send already travelling below the committed
    /// reservation while the link is up) can be committed later, with the next batch something
    /// waits on; losing it in a crash only repeats what the protocol repeats anyway (a resend
    /// acked again, a delivery delivered again) or loses a send whose await never resolved
    /// (it reached the peer, which holds it, or it did not).
    pub fn awaits_persist_from(&self, from: BatchId) -> bool {
        let outbox = self
            .awaiting_persist
            .back()
            .is_some_and(|(id, _)| *id >= from);
        outbox
            || self
                .waiting
                .iter()
                .rev()
                .take_while(|(id, _)| *id >= from)
                .flat_map(|(_, outputs)| outputs)
                .any(|output| !matches!(output, Deferred::Lazily(_)))
    }

    /// Un-acked ops across all objects.
    pub fn outbox_len(&self) -> usize {
        self.objects
            .values()
            .map(|object| object.outbox.len())
            .sum()
    }

    // -----------------------------------------------------------------------------------------
    // Inputs

    /// A link to the peer is up (a new connection, after authentication). Every un-acked op is
    /// sent again with a new receipt.
    pub fn handle_link_up(&mut self, now: Time) {
        self.link_up = true;
        self.cut = false;
        self.last_heard = now;
        self.last_sent = now;
        self.stats.link_ups += 1;
        self.touch_all();
        let window = self.config.receive_window;
        for (name, object) in &mut self.objects {
            object.outbox.land_from(Seq::ZERO);
            object.floor_sent = Seq::ZERO;
            // The peer's credit may have grown on a link it never heard of (or the peer
            // restarted): tell it wherever it is above the start.
            let limit = object.receive_limit(window);
            object.limit_sent = Seq::ZERO;
            // A peer that never got past the starting credit learns of more from the ack of
            // the op that uses its last seq; only one beyond it needs telling now.
            if limit > self.initial_credit && object.seen_end() >= self.initial_credit {
                object.limit_sent = limit;
                self.stats.credits_sent += 1;
                let frame = credit_frame(name, limit);
                self.staged_outputs.push(Deferred::Transmit(frame));
            }
        }
        self.end_step(now);
    }

    /// The receive window this side offers in a handshake.
    pub fn receive_window(&self) -> u64 {
        self.config.receive_window
    }

    /// [`Machine::handle_link_up`], with `first` (the handshake's last frames) sent before
    /// anything of the machine.
    pub fn handle_link_up_with(&mut self, now: Time, first: Vec<Envelope>) {
        for frame in first.into_iter().rev() {
            self.transmit.push_front(frame);
        }
        self.handle_link_up(now);
    }

    /// Sets the credit every object starts with to the receive window the link's handshake
    /// agreed on (the smaller of the two offers, never above this side's). Both sides know it,
    /// so neither needs telling. Call before [`Machine::handle_link_up`].
    pub fn set_initial_credit(&mut self, negotiated: u64) {
        self.initial_credit = Seq(negotiated.clamp(1, self.config.receive_window));
    }

    /// The link is gone. Nothing is lost: un-acked ops stay in the outbox.
    pub fn handle_link_down(&mut self, now: Time) {
        self.link_up = false;
        self.stats.link_downs += 1;
        self.touch_all();
        self.end_step(now);
        self.trim_spares();
    }

    /// Spare buffers held (records, outputs), for tests of their reuse and release.
    #[cfg(any(test, feature = "harness"))]
    pub fn spare_buffers(&self) -> (usize, usize) {
        (self.spares.records.len(), self.spares.outputs.len())
    }

    /// Hands back the record buffer of a batch the store is done with, for a later step to
    /// stage into (an optimisation only: a buffer never handed back is simply freed). Call it
    /// after [`Machine::handle_persisted`] for the batch.
    pub fn recycle(&mut self, batch: PersistBatch) {
        if !self.steps_stopped() {
            self.spares.records.keep(batch.records);
        }
    }

    /// Whether buffers handed back are kept for the next steps (they are not once the steps
    /// have stopped, [`Machine::recycle`]).
    pub fn keeps_spares(&self) -> bool {
        !self.steps_stopped()
    }

    /// Every batch emitted is persisted.
    fn quiescent(&self) -> bool {
        self.persisted_through.0 + 1 == self.next_batch.0
    }

    /// Every batch persisted and no link to bring more steps: spares would only be held (with
    /// the link up, the keepalive's timeout frees them, [`Machine::handle_timeout`]). A busy
    /// peer's commits often leave nothing outstanding for a moment; freeing there would undo
    /// the reuse.
    fn steps_stopped(&self) -> bool {
        self.quiescent() && !self.link_up
    }

    /// Frees the spares once the peer's steps have stopped ([`Machine::steps_stopped`]).
    fn trim_spares(&mut self) {
        if self.steps_stopped() {
            self.spares = Spares::default();
        }
    }

    /// The store committed every batch up to and including `batch`.
    pub fn handle_persisted(&mut self, now: Time, batch: BatchId) {
        if batch <= self.persisted_through {
            return;
        }
        debug_assert!(
            batch < self.next_batch,
            "only emitted batches can be persisted"
        );
        self.persisted_through = batch;
        while self
            .awaiting_persist
            .front()
            .is_some_and(|(id, _)| *id <= batch)
        {
            let (_, obj) = self.awaiting_persist.pop_front().expect("front exists");
            self.touched.insert(obj);
        }
        while self.waiting.front().is_some_and(|(id, _)| *id <= batch) {
            let (_, outputs) = self.waiting.pop_front().expect("front exists");
            self.release(outputs);
        }
        self.end_step(now);
        self.trim_spares();
    }

    /// Time passed: keepalive, dead link, gap resync, TTL expiry, transient retries, retention.
    /// A spurious call changes no state (it may free spare buffers, which are not state).
    pub fn handle_timeout(&mut self, now: Time) {
        if self.quiescent() {
            // Nothing outstanding at a timeout (with the link up, the keepalive's comes at
            // most SUBSTRATE_KEEPALIVE_MS after the last send): the spares are not needed.
            self.spares = Spares::default();
        }
        if self.link_up {
            if now.saturating_since(self.last_heard) >= self.config.dead_after {
                self.link_up = false;
                self.stats.link_downs += 1;
                self.events.push_back(Event::LinkDead);
            } else if now.saturating_since(self.last_sent) >= self.config.keepalive {
                let mut keepalive = Envelope::new(Env::new(Verb::Ack));
                keepalive.type_byte = TYPE_KEEPALIVE;
                self.send_now(now, keepalive);
            }
        }
        while let Some((at, name)) = self.timers.first().cloned() {
            if at > now {
                break;
            }
            // Disarmed here; `end_step` re-arms whatever is still pending.
            self.timers.pop_first();
            if let Some(object) = self.objects.get_mut(&name) {
                object.armed = None;
            }
            self.touched.insert(name.clone());
            self.object_timers(now, &name);
        }
        while let Some((at, op_id)) = self.bounce_order.first().cloned() {
            if now.saturating_since(at) < self.config.dedupe_retention {
                break;
            }
            self.bounce_order.pop_first();
            self.bounces.remove(&op_id);
            self.staged.push(Record::BounceRemoved { op_id });
        }
        self.end_step(now);
    }

    /// One decoded frame from the peer.
    pub fn handle_frame(&mut self, now: Time, frame: Envelope) {
        self.handle_frames(now, [frame]);
    }

    /// Frames decoded from one read of the link, in order: each is handled as
    /// [`Machine::handle_frame`] handles it, and the step ends once, after the last. Their
    /// records are one batch and the outputs they stage wait for it, where one step per frame
    /// made a batch per frame (a window of ops read together was committed as one group either
    /// way); each object they touched is looked at once for what it may transmit. A frame
    /// that cuts the link ends the step there, and the frames after it are taken and ignored.
    /// A read that held no whole frame is no step.
    pub fn handle_frames(&mut self, now: Time, frames: impl IntoIterator<Item = Envelope>) {
        let mut taken = 0usize;
        for frame in frames {
            if !self.cut {
                if taken == 1 {
                    // A read of several frames stages into large spares, if there are any.
                    self.spares.records.enlarge(&mut self.staged);
                    self.spares.outputs.enlarge(&mut self.staged_outputs);
                }
                self.take_frame(now, frame);
                taken += 1;
            }
        }
        if taken > 0 {
            self.end_step(now);
        }
    }

    /// Every whole frame `decoder` holds, as one step ([`Machine::handle_frames`]), up to a
    /// frame that fails to decode: its error is returned for the caller to answer (a
    /// frame-local one with [`Machine::handle_bad_frame`]), the frames behind it still held.
    pub fn handle_decoded(
        &mut self,
        now: Time,
        decoder: &mut StreamDecoder<EnvelopeDecoder>,
    ) -> Option<DecodeError<EnvelopeError>> {
        let mut failed = None;
        self.handle_frames(
            now,
            std::iter::from_fn(|| match decoder.pop() {
                Ok(frame) => frame,
                Err(error) => {
                    failed = Some(error);
                    None
                }
            }),
        );
        failed
    }

    /// One frame's part of a step ([`Machine::handle_frame`]), without ending it.
    fn take_frame(&mut self, now: Time, frame: Envelope) {
        self.last_heard = now;
        if frame.type_byte == TYPE_KEEPALIVE {
            return;
        }
        let Envelope { env, body, .. } = frame;
        if let Some(what) = dishonest_number(&env) {
            self.stats.violations += 1;
            self.cut = true;
            self.link_up = false;
            self.stats.link_downs += 1;
            self.events.push_back(Event::Violation { what });
            return;
        }
        if let Some(obj) = &env.obj {
            self.touch(obj);
        }
        match env.kind {
            Verb::Ack => self.on_ack(&env),
            Verb::Resync => self.on_resync(now, &env),
            _ if env.seq.is_none() && env.kind == Verb::Err => self.on_substrate_err(now, &env),
            _ => self.on_op(now, env, body),
        }
    }

    /// A frame that did not decode (a frame-local error; fatal errors end the link in the
    /// shell). Counted; an op whose address contains `@` is answered with one terminal
    /// `routing_not_supported`.
    pub fn handle_bad_frame(&mut self, now: Time, error: &EnvelopeError) {
        self.last_heard = now;
        self.stats.malformed += 1;
        if let EnvelopeError::RoutingNotSupported { id: Some(id) } = error {
            let mut env = Env::new(Verb::Err);
            env.id = Some(id.clone());
            env.code = Some(finality::ROUTING_NOT_SUPPORTED.to_owned());
            self.send_now(now, Envelope::new(env));
        }
        self.end_step(now);
    }

    // -----------------------------------------------------------------------------------------
    // App commands

    /// Opens an object of `kind` at `obj`, presenting `cap`. Returns the open's op id.
    pub fn open(
        &mut self,
        now: Time,
        kind: ObjKind,
        obj: &str,
        cap: Option<&str>,
    ) -> Result<OpId, CommandError> {
        // A name the machine holds was parsed when it came in.
        let name = match self.interned(obj) {
            Some(name) => name,
            None => Address::parse(obj)?,
        };
        self.touch(&name);
        check_text(cap)?;
        if self
            .objects
            .get(&name)
            .is_some_and(|o| !o.record.state.is_terminal())
        {
            return Err(CommandError::AlreadyOpen(obj.to_owned()));
        }
        if self.live_object_count() >= self.config.objects_max {
            return Err(CommandError::Quota);
        }
        self.bound_retained_objects();
        let open_id = self.mint();
        let record = ObjectRecord {
            obj: name.clone(),
            kind,
            opened_by: Side::Local,
            open_id: open_id.clone(),
            state: ObjectState::Opening,
            tx_next: Seq::ZERO,
            rx_next: Seq::ZERO,
        };
        self.put_object(name.clone(), Object::new(record));
        let mut op = self.op(now, &name, Verb::Open, open_id.clone());
        op.obj_kind = Some(kind);
        op.cap = cap.map(str::to_owned);
        self.enqueue(op);
        self.end_step(now);
        Ok(open_id)
    }

    /// Accepts an object the remote opened.
    pub fn accept(&mut self, now: Time, obj: &str) -> Result<(), CommandError> {
        self.decide(now, obj, None)
    }

    /// Rejects an object the remote opened, with `code` (e.g. `approval_denied`).
    pub fn reject(&mut self, now: Time, obj: &str, code: &str) -> Result<(), CommandError> {
        check_text(Some(code))?;
        self.decide(now, obj, Some(code))
    }

    /// A one-way message on a live object (or one still opening: it follows the open).
    /// Returns its op id; [`Event::Acked`] reports it durable at the peer.
    pub fn send(&mut self, now: Time, obj: &str, body: Bytes) -> Result<OpId, CommandError> {
        self.message(now, obj, Verb::Send, body)
            .map_err(|refused| refused.error)
    }

    /// A request on a live session; the peer's answers arrive as [`Event::Answered`].
    pub fn req(&mut self, now: Time, obj: &str, body: Bytes) -> Result<OpId, CommandError> {
        self.message(now, obj, Verb::Req, body)
            .map_err(|refused| refused.error)
    }

    /// Answers the remote's req `req_id` with `verb` (Res, End or Err). A final answer (End or
    /// Err) also consumes the req's delivery, atomically with the answer.
    pub fn answer(
        &mut self,
        now: Time,
        obj: &str,
        req_id: &str,
        verb: Verb,
        body: Option<Bytes>,
        code: Option<&str>,
    ) -> Result<(), CommandError> {
        self.offer_answer(now, obj, req_id, verb, body, code)
            .map_err(|refused| refused.error)
    }

    /// [`Machine::answer`], handing a refused body back (as [`Machine::message`] does).
    pub(crate) fn offer_answer(
        &mut self,
        now: Time,
        obj: &str,
        req_id: &str,
        verb: Verb,
        body: Option<Bytes>,
        code: Option<&str>,
    ) -> Result<(), Refused<Option<Bytes>>> {
        let checked = self.check_answer(obj, req_id, verb, body.as_ref(), code);
        let name = match checked {
            Ok(name) => name,
            Err(error) => return Err(Refused { error, body }),
        };
        let mut op = self.op(now, &name, verb, OpId::new(req_id));
        op.body = body;
        op.code = code.map(str::to_owned);
        self.enqueue(op);
        // A final answer consumes the req in the same batch: after a crash the req is either
        // still delivered and unanswered, or answered and gone, never both.
        if let (true, Some(object)) = (verb != Verb::Res, self.objects.get_mut(&name)) {
            let seq = object
                .inbox
                .iter()
                .find(|(_, op)| op.id == req_id)
                .map(|(seq, _)| *seq);
            if let Some(seq) = seq {
                object.inbox.remove(&seq);
                self.staged.push(Record::InboxRemoved {
                    obj: name.clone(),
                    seq,
                });
                self.stage_credit(&name);
            }
        }
        self.end_step(now);
        Ok(())
    }

    /// Everything [`Machine::answer`] checks before it enqueues, in order; the object's name.
    fn check_answer(
        &mut self,
        obj: &str,
        req_id: &str,
        verb: Verb,
        body: Option<&Bytes>,
        code: Option<&str>,
    ) -> Result<Address, CommandError> {
        if !matches!(verb, Verb::Res | Verb::End | Verb::Err) {
            return Err(CommandError::WrongState(obj.to_owned()));
        }
        check_text(code)?;
        check_text(Some(req_id))?;
        check_body(body)?;
        self.live_for_app(obj)?;
        let name = self.interned(obj).ok_or_else(|| no_such(obj))?;
        self.touch(&name);
        self.check_room(&name)?;
        Ok(name)
    }

    /// Closes an object. Ops enqueued before the close still go first.
    pub fn close(&mut self, now: Time, obj: &str, reason: &str) -> Result<(), CommandError> {
        check_text(Some(reason))?;
        let name = self.touch_open(obj)?;
        let id = self.mint();
        let mut op = self.op(now, &name, Verb::Close, id);
        op.reason = Some(reason.to_owned());
        self.enqueue(op);
        if let Some(object) = self.objects.get_mut(&name) {
            object.record.state = ObjectState::Closed(now);
            self.staged.push(Record::Object(object.durable_record()));
        }
        self.drop_unanswerable_reqs(&name);
        let event = Event::Closed {
            obj: name,
            reason: Some(reason.to_owned()),
            by_remote: false,
        };
        self.staged_outputs.push(Deferred::Event(event));
        self.end_step(now);
        Ok(())
    }

    /// The app is done with delivery `seq` of `obj`: its durable copy is dropped.
    pub fn consume(&mut self, now: Time, obj: &str, seq: Seq) -> bool {
        let name = self.interned(obj);
        if let Some(name) = &name {
            self.touch(name);
        }
        let removed = name
            .as_ref()
            .and_then(|name| self.objects.get_mut(name))
            .and_then(|object| object.inbox.remove(&seq))
            .is_some();
        if let (true, Some(name)) = (removed, name) {
            self.staged.push(Record::InboxRemoved {
                obj: name.clone(),
                seq,
            });
            self.stage_credit(&name);
        }
        self.end_step(now);
        removed
    }
}
