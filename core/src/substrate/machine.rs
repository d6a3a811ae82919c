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
//! - Nothing is transmitted before the batch holding it is persisted: an op enters the outbox
//!   durably, then goes on the wire; it leaves the outbox only when a hop ack citing its
//!   current receipt arrives (or a terminal answer ends it).
//! - Nothing is acknowledged or reported before the batch that made it durable is persisted:
//!   hop acks, re-acks of duplicates, bounces and every app event wait for their batch.
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
    BatchId, DurableState, ObjectRecord, ObjectState, Op, PersistBatch, Record, Side,
};
use super::finality::{self, class_of, Class};
use super::{Config, PeerId, Stats};
use crate::limits::{ENVELOPE_INLINE_BODY_BYTES_MAX, ENVELOPE_TEXT_BYTES_MAX};
use crate::retry::{Backoff, Jitter};
use crate::time::Time;
use crate::wire::envelope::{Address, Env, Envelope, EnvelopeError, ObjKind, Verb};

/// Type byte of the keepalive control frame.
pub const TYPE_KEEPALIVE: u8 = 0x03;

/// What the app learns.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Event {
    /// The remote opened an object; answer with [`Machine::accept`] or [`Machine::reject`].
    OpenRequested {
        /// Address.
        obj: String,
        /// Session or queue.
        kind: ObjKind,
        /// The open's op id.
        op_id: String,
        /// The capability token presented, unparsed.
        cap: Option<String>,
    },
    /// The remote accepted an object this side opened.
    Opened {
        /// Address.
        obj: String,
    },
    /// The remote rejected an object this side opened.
    Rejected {
        /// Address.
        obj: String,
        /// The reject code.
        code: Option<String>,
    },
    /// A send or req of the remote, durable here; call [`Machine::consume`] when done with it.
    Delivered(Op),
    /// The remote's app answered a req of this side (res, end or err).
    Answered {
        /// Address.
        obj: String,
        /// The req's op id.
        req_id: String,
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
        obj: String,
        /// The reason given.
        reason: Option<String>,
        /// Whether the remote closed it.
        by_remote: bool,
    },
    /// An op of this side is durable at the remote (hop ack).
    Acked {
        /// Address.
        obj: String,
        /// The op id.
        op_id: String,
    },
    /// An op of this side ended without effect (a terminal error, a close, TTL expiry).
    Futile {
        /// Address.
        obj: String,
        /// The op id.
        op_id: String,
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

/// One outbox entry: the durable op and its transmission state (memory only).
#[derive(Debug, Clone, Hash)]
struct Outgoing {
    op: Op,
    /// The batch that made it durable; it may go on the wire once that batch is persisted.
    batch: BatchId,
    /// Attempts so far; the receipt of the latest transmission.
    receipt: u64,
    /// On the wire and not yet acked.
    in_flight: bool,
    /// A transient error asked to wait until then.
    retry_at: Option<Time>,
    /// Rebuilt by [`Machine::recover`]: it may have been transmitted before the restart.
    recovered: bool,
    /// Transient answers in a row: the next retry backs off from this.
    transient_failures: u32,
}

impl Outgoing {
    /// Certainly never on the wire, so certainly not delivered: only such an op may end
    /// without the peer's word (peer close, TTL).
    fn never_sent(&self) -> bool {
        self.receipt == 0 && !self.recovered
    }

    /// Whether the queue TTL applies: opens, sends and reqs that never left. Answers,
    /// decisions and closes answer something the peer holds and wait for the link however
    /// long it takes (the outbox bound still applies).
    fn expires(&self) -> bool {
        self.never_sent() && matches!(self.op.verb, Verb::Open | Verb::Send | Verb::Req)
    }
}

/// One object's outbox: entries by seq, with the count of those in flight kept exact so that
/// the window check is O(1), and indexes that keep every per-wake question O(log n): which
/// entries may expire (never sent), which wait on a transient retry, and where transmission
/// resumes.
#[derive(Clone, Default)]
struct Outbox {
    entries: BTreeMap<u64, Outgoing>,
    in_flight: usize,
    /// Seqs of entries the queue TTL applies to (never sent), in seq order, which is also
    /// the order of their enqueue times within a boot.
    expirable: BTreeSet<u64>,
    /// Entries waiting on a transient retry, by when.
    retrying: BTreeSet<(Time, u64)>,
    /// No entry below this seq needs transmitting (they are in flight or waiting).
    cursor: u64,
    /// Seqs by op id (answers share the id of the req they answer), so that finding the op
    /// an answer or an err names costs a lookup, not a scan.
    by_id: BTreeMap<String, std::collections::BTreeSet<u64>>,
}

/// The entries alone: the indexes and the cursor follow from them (a fingerprint that
/// printed them would tell apart machines that behave alike).
impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("entries", &self.entries)
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

/// The same entries alone, for the same reason.
impl std::hash::Hash for Outbox {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.entries.hash(state);
        self.in_flight.hash(state);
    }
}

impl Outbox {
    fn insert(&mut self, entry: Outgoing) {
        debug_assert!(
            !entry.in_flight,
            "entries enter the outbox before any transmission"
        );
        if entry.expires() {
            self.expirable.insert(entry.op.seq);
        }
        self.cursor = self.cursor.min(entry.op.seq);
        self.by_id
            .entry(entry.op.id.clone())
            .or_default()
            .insert(entry.op.seq);
        self.entries.insert(entry.op.seq, entry);
    }

    fn remove(&mut self, seq: u64) -> Option<Outgoing> {
        let entry = self.entries.remove(&seq)?;
        self.in_flight -= usize::from(entry.in_flight);
        self.expirable.remove(&seq);
        if let Some(at) = entry.retry_at {
            self.retrying.remove(&(at, seq));
        }
        if let Some(seqs) = self.by_id.get_mut(&entry.op.id) {
            seqs.remove(&seq);
            if seqs.is_empty() {
                self.by_id.remove(&entry.op.id);
            }
        }
        Some(entry)
    }

    fn get(&self, seq: u64) -> Option<&Outgoing> {
        self.entries.get(&seq)
    }

    fn values(&self) -> impl Iterator<Item = &Outgoing> + '_ {
        self.entries.values()
    }

    fn len(&self) -> usize {
        self.entries.len()
    }

    fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn first_seq(&self) -> Option<u64> {
        self.entries.keys().next().copied()
    }

    /// The seq of the op with id `id`, if it was ever transmitted (only such ops can be
    /// answered by the peer's substrate).
    fn transmitted_seq_of(&self, id: &str) -> Option<u64> {
        self.by_id
            .get(id)?
            .iter()
            .copied()
            .find(|seq| self.entries.get(seq).is_some_and(|e| e.receipt > 0))
    }

    fn seq_of(&self, id: &str) -> Option<u64> {
        self.by_id.get(id)?.iter().next().copied()
    }

    /// Marks entries from `from` on as not in flight: they go out again with new receipts.
    fn land_from(&mut self, from: u64) {
        for entry in self.entries.range_mut(from..).map(|(_, entry)| entry) {
            self.in_flight -= usize::from(std::mem::replace(&mut entry.in_flight, false));
        }
        self.cursor = self.cursor.min(from);
    }

    /// Counts a transient answer to entry `seq`; returns the count before it (the backoff
    /// attempt).
    fn note_transient(&mut self, seq: u64) -> u32 {
        let Some(entry) = self.entries.get_mut(&seq) else {
            return 0;
        };
        let before = entry.transient_failures;
        entry.transient_failures = before.saturating_add(1);
        before
    }

    /// A transient error: the entry waits until `at`, then goes out again.
    fn retry_at(&mut self, seq: u64, at: Time) {
        if let Some(entry) = self.entries.get_mut(&seq) {
            self.in_flight -= usize::from(std::mem::replace(&mut entry.in_flight, false));
            if let Some(before) = entry.retry_at.replace(at) {
                self.retrying.remove(&(before, seq));
            }
            self.retrying.insert((at, seq));
        }
    }

    fn clear_due_retries(&mut self, now: Time) {
        while let Some(&(at, seq)) = self.retrying.first() {
            if at > now {
                break;
            }
            self.retrying.pop_first();
            if let Some(entry) = self.entries.get_mut(&seq) {
                entry.retry_at = None;
            }
            self.cursor = self.cursor.min(seq);
        }
    }

    /// Seqs of never-sent entries enqueued `ttl` or more before `now`.
    fn expired(&self, now: Time, ttl: std::time::Duration) -> Vec<u64> {
        self.expirable
            .iter()
            .copied()
            .take_while(|seq| now.saturating_since(self.entries[seq].op.at) >= ttl)
            .collect()
    }

    /// When the next entry expires, if one can.
    fn next_expiry(&self, ttl: std::time::Duration) -> Option<Time> {
        let seq = self.expirable.first()?;
        Some(self.entries[seq].op.at.saturating_add(ttl))
    }

    /// Transmits, in seq order, every entry that may go: persisted, not waiting on a retry,
    /// within `window` in flight and below the receiver's credit `limit`; while `opening` only
    /// the open may go.
    fn transmit(
        &mut self,
        persisted: BatchId,
        opening: bool,
        window: usize,
        (floor, limit): (u64, u64),
        out: &mut VecDeque<Envelope>,
    ) -> bool {
        let mut sent = false;
        let mut resume = None;
        for entry in self
            .entries
            .range_mut(self.cursor..)
            .map(|(_, entry)| entry)
        {
            let seq = entry.op.seq;
            if self.in_flight >= window || seq >= limit {
                resume = Some(seq);
                break;
            }
            if entry.in_flight || entry.retry_at.is_some() {
                continue;
            }
            // Seqs are assigned in batch order: everything after an unpersisted op is too.
            if entry.batch > persisted || (opening && entry.op.verb != Verb::Open) {
                resume = Some(seq);
                break;
            }
            entry.receipt += 1;
            entry.in_flight = true;
            self.in_flight += 1;
            self.expirable.remove(&seq);
            out.push_back(op_frame(&entry.op, entry.receipt, floor));
            sent = true;
        }
        // Everything before `resume` is in flight or waiting on a retry (which lowers the
        // cursor again when it ends).
        self.cursor =
            resume.unwrap_or_else(|| self.entries.keys().next_back().map_or(0, |s| s + 1));
        debug_assert_eq!(
            self.in_flight,
            self.entries.values().filter(|e| e.in_flight).count()
        );
        sent
    }
}

#[derive(Debug, Clone, Hash)]
struct Object {
    record: ObjectRecord,
    outbox: Outbox,
    /// Early ops of the remote, with their arrival time.
    held: BTreeMap<u64, Op>,
    /// Delivered, not yet consumed by the app.
    inbox: BTreeMap<u64, Op>,
    /// When the current gap was first seen.
    gap_since: Option<Time>,
    last_resync: Option<Time>,
    /// Sending: the credit the peer gave beyond the link's initial credit (memory; the peer
    /// repeats it on every link).
    tx_limit: u64,
    /// Sending: the highest floor told to the peer on this link.
    floor_sent: u64,
    /// Sending: the highest seq of this side that ended without an ack (memory).
    ended_max: Option<u64>,
    /// Receiving: the highest credit told to the peer on this link (beyond the initial one).
    limit_sent: u64,
}

impl Object {
    /// An object; both directions start from the link's initial credit (the handshake's
    /// window, which both sides know, so neither needs telling).
    fn new(record: ObjectRecord) -> Self {
        Self {
            record,
            outbox: Outbox::default(),
            held: BTreeMap::new(),
            inbox: BTreeMap::new(),
            gap_since: None,
            last_resync: None,
            tx_limit: 0,
            floor_sent: 0,
            ended_max: None,
            limit_sent: 0,
        }
    }

    /// The lowest seq still in the outbox, or the next to assign: the sender's `floor`.
    fn floor(&self) -> u64 {
        self.outbox.first_seq().unwrap_or(self.record.tx_next)
    }

    /// The credit this side gives the peer: seqs below it fit in `window` (held plus
    /// unconsumed). Never falls: a delivery into the inbox moves the frontier with it.
    fn receive_limit(&self, window: u64) -> u64 {
        let unconsumed = self.inbox.len() as u64;
        self.record
            .rx_next
            .saturating_add(window.saturating_sub(unconsumed))
    }

    /// The highest seq of the peer seen here, plus one.
    fn seen_end(&self) -> u64 {
        self.held
            .last_key_value()
            .map_or(self.record.rx_next, |(seq, _)| seq + 1)
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
    Event(Event),
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
    initial_credit: u64,
    /// Jitter for transient retries, seeded per boot.
    jitter: Jitter,
    authorizer: Arc<Authorizer>,
    /// Prefix of op ids minted in this boot (a seed passed in, distinct per boot).
    boot: u64,
    minted: u64,
    objects: BTreeMap<String, Object>,
    bounces: BTreeMap<String, (String, Time)>,
    /// Bounce tombstones by when they were made (the oldest is evicted or expires first).
    bounce_order: BTreeSet<(Time, String)>,
    /// The timer table: each object's next deadline (gap resync, transient retry, TTL expiry,
    /// retention), ordered, so the next wake and the due objects cost O(log n).
    timers: BTreeSet<(Time, String)>,
    /// Each armed object's entry in `timers`.
    deadlines: BTreeMap<String, Time>,
    /// Objects the step in progress touched: their deadlines are re-armed and their outboxes
    /// offered to the link when it ends (no step walks every object).
    touched: BTreeSet<String>,
    /// Objects with entries in each unpersisted batch: persisting it may let them transmit.
    awaiting_persist: VecDeque<(BatchId, String)>,
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
            initial_credit: config.receive_window,
            jitter: Jitter::new(boot ^ 0x7e7e_7e7e),
            config,
            authorizer,
            boot,
            minted: 0,
            objects: BTreeMap::new(),
            bounces: BTreeMap::new(),
            bounce_order: BTreeSet::new(),
            timers: BTreeSet::new(),
            deadlines: BTreeMap::new(),
            touched: BTreeSet::new(),
            awaiting_persist: VecDeque::new(),
            link_up: false,
            last_heard: Time::ZERO,
            cut: false,
            last_sent: Time::ZERO,
            staged: Vec::new(),
            staged_outputs: Vec::new(),
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
            let object = Object::new(record.clone());
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
        let names: Vec<String> = machine.objects.keys().cloned().collect();
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
            .map(|(name, object)| (name.clone(), object.outbox.len() as u64))
            .collect();
        stats
    }

    /// The remote peer.
    pub fn remote(&self) -> &PeerId {
        &self.remote
    }

    /// The lifecycle state of `obj`, if known.
    pub fn object_state(&self, obj: &str) -> Option<ObjectState> {
        self.objects.get(obj).map(|object| object.record.state)
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
            object.outbox.land_from(0);
            object.floor_sent = 0;
            // The peer's credit may have grown on a link it never heard of (or the peer
            // restarted): tell it wherever it is above the start.
            let limit = object.receive_limit(window);
            object.limit_sent = 0;
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
        self.initial_credit = negotiated.clamp(1, self.config.receive_window);
    }

    /// The link is gone. Nothing is lost: un-acked ops stay in the outbox.
    pub fn handle_link_down(&mut self, now: Time) {
        self.link_up = false;
        self.stats.link_downs += 1;
        self.touch_all();
        self.end_step(now);
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
    }

    /// Time passed: keepalive, dead link, gap resync, TTL expiry, transient retries, retention.
    /// A spurious call does nothing.
    pub fn handle_timeout(&mut self, now: Time) {
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
            self.deadlines.remove(&name);
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
        if self.cut {
            return;
        }
        self.last_heard = now;
        if frame.type_byte == TYPE_KEEPALIVE {
            self.end_step(now);
            return;
        }
        let Envelope { env, body, .. } = frame;
        if let Some(what) = dishonest_number(&env) {
            self.stats.violations += 1;
            self.cut = true;
            self.link_up = false;
            self.stats.link_downs += 1;
            self.events.push_back(Event::Violation { what });
            self.end_step(now);
            return;
        }
        if let Some(obj) = &env.obj {
            self.touch(obj.as_str());
        }
        match env.kind {
            Verb::Ack => self.on_ack(&env),
            Verb::Resync => self.on_resync(now, &env),
            _ if env.seq.is_none() && env.kind == Verb::Err => self.on_substrate_err(now, &env),
            _ => self.on_op(now, env, body),
        }
        self.end_step(now);
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
    ) -> Result<String, CommandError> {
        Address::parse(obj)?;
        self.touch(obj);
        check_text(cap)?;
        if self
            .objects
            .get(obj)
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
            obj: obj.to_owned(),
            kind,
            opened_by: Side::Local,
            open_id: open_id.clone(),
            state: ObjectState::Opening,
            tx_next: 0,
            rx_next: 0,
        };
        let object = Object::new(record);
        self.objects.insert(obj.to_owned(), object);
        let mut op = self.op(now, obj, Verb::Open, open_id.clone());
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
    pub fn send(&mut self, now: Time, obj: &str, body: Bytes) -> Result<String, CommandError> {
        self.message(now, obj, Verb::Send, body)
    }

    /// A request on a live session; the peer's answers arrive as [`Event::Answered`].
    pub fn req(&mut self, now: Time, obj: &str, body: Bytes) -> Result<String, CommandError> {
        self.message(now, obj, Verb::Req, body)
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
        if !matches!(verb, Verb::Res | Verb::End | Verb::Err) {
            return Err(CommandError::WrongState(obj.to_owned()));
        }
        check_text(code)?;
        check_text(Some(req_id))?;
        check_body(body.as_ref())?;
        self.live_for_app(obj)?;
        self.touch(obj);
        self.check_room(obj)?;
        let mut op = self.op(now, obj, verb, req_id.to_owned());
        op.body = body;
        op.code = code.map(str::to_owned);
        self.enqueue(op);
        if verb != Verb::Res {
            // A final answer consumes the req in the same batch: after a crash the req is
            // either still delivered and unanswered, or answered and gone, never both.
            let object = self.objects.get_mut(obj).expect("checked live above");
            let seq = object
                .inbox
                .iter()
                .find(|(_, op)| op.id == req_id)
                .map(|(seq, _)| *seq);
            if let Some(seq) = seq {
                object.inbox.remove(&seq);
                self.staged.push(Record::InboxRemoved {
                    obj: obj.to_owned(),
                    seq,
                });
                self.stage_credit(obj);
            }
        }
        self.end_step(now);
        Ok(())
    }

    /// Closes an object. Ops enqueued before the close still go first.
    pub fn close(&mut self, now: Time, obj: &str, reason: &str) -> Result<(), CommandError> {
        check_text(Some(reason))?;
        self.touched.insert(obj.to_owned());
        let object = self.objects.get(obj).ok_or_else(|| no_such(obj))?;
        if !matches!(
            object.record.state,
            ObjectState::Live | ObjectState::Opening
        ) {
            return Err(CommandError::WrongState(obj.to_owned()));
        }
        let id = self.mint();
        let mut op = self.op(now, obj, Verb::Close, id);
        op.reason = Some(reason.to_owned());
        self.enqueue(op);
        let object = self.objects.get_mut(obj).expect("checked above");
        object.record.state = ObjectState::Closed(now);
        self.staged.push(Record::Object(object.record.clone()));
        self.drop_unanswerable_reqs(obj);
        let event = Event::Closed {
            obj: obj.to_owned(),
            reason: Some(reason.to_owned()),
            by_remote: false,
        };
        self.staged_outputs.push(Deferred::Event(event));
        self.end_step(now);
        Ok(())
    }

    /// The app is done with delivery `seq` of `obj`: its durable copy is dropped.
    pub fn consume(&mut self, now: Time, obj: &str, seq: u64) -> bool {
        if self.objects.contains_key(obj) {
            self.touch(obj);
        }
        let removed = self
            .objects
            .get_mut(obj)
            .and_then(|object| object.inbox.remove(&seq))
            .is_some();
        if removed {
            self.staged.push(Record::InboxRemoved {
                obj: obj.to_owned(),
                seq,
            });
            self.stage_credit(obj);
        }
        self.end_step(now);
        removed
    }

    // -----------------------------------------------------------------------------------------
    // Inbound

    fn on_op(&mut self, now: Time, env: Env, body: Option<Bytes>) {
        let (Some(obj), Some(id), Some(seq)) = (env.obj.clone(), env.id.clone(), env.seq) else {
            self.stats.malformed += 1;
            return;
        };
        let obj = obj.as_str().to_owned();
        let initiating = matches!(env.kind, Verb::Open | Verb::Send | Verb::Req | Verb::Close);
        if initiating {
            let ctx = AuthorizeContext {
                peer: &self.remote,
                verb: env.kind,
                obj: &obj,
                obj_kind: env.obj_kind,
                cap: env.cap.as_deref(),
            };
            if let Err(denial) = self.authorizer.check(&ctx) {
                let key = format!("{}:{}", env.kind.as_str(), denial.code);
                *self.stats.denials.entry(key).or_default() += 1;
                self.send_now(now, substrate_err(&obj, &id, &denial.code));
                return;
            }
        }
        let op = Op {
            obj: obj.clone(),
            seq,
            id,
            verb: env.kind,
            obj_kind: env.obj_kind,
            body,
            code: env.code,
            reason: env.reason,
            cap: env.cap,
            at: now,
        };
        let receipt = env.receipt.unwrap_or(1);
        let known = self.objects.get(&obj).is_some_and(|object| {
            !(op.verb == Verb::Open
                && object.record.state.is_terminal()
                && object.record.open_id != op.id)
        });
        if !known {
            self.on_unknown_object(now, op, receipt);
            return;
        }
        let object = self.objects.get(&obj).expect("known");
        let killing = matches!(op.verb, Verb::Close | Verb::Err);
        if killing && !object.remote_is_participant() && op.seq >= object.record.rx_next {
            // Law 2: finality only from a participant, refused before the frontier moves.
            self.stats.finality_rejected += 1;
            return;
        }
        self.sequence(now, op, receipt, env.floor.unwrap_or(0));
    }

    /// An op for an object this side does not know.
    fn on_unknown_object(&mut self, now: Time, op: Op, receipt: u64) {
        match op.verb {
            Verb::Open => {
                if self.live_object_count() >= self.config.objects_max {
                    self.send_now(now, substrate_err(&op.obj, &op.id, finality::QUOTA));
                    return;
                }
                self.bound_retained_objects();
                let record = ObjectRecord {
                    obj: op.obj.clone(),
                    kind: op.obj_kind.unwrap_or(ObjKind::Session),
                    opened_by: Side::Remote,
                    open_id: op.id.clone(),
                    state: ObjectState::AwaitingAccept,
                    tx_next: 0,
                    rx_next: 0,
                };
                let object = Object::new(record);
                self.objects.insert(op.obj.clone(), object);
                self.sequence(now, op, receipt, 0);
            }
            // Laws 2 and 4: a killing verb or an err to an unknown object is never bounced.
            Verb::Close | Verb::Err => self.stats.finality_rejected += 1,
            _ => self.bounce(now, &op),
        }
    }

    /// Law 3: one bounce per op id; a duplicate is re-served the stored outcome.
    fn bounce(&mut self, now: Time, op: &Op) {
        if let Some((code, _)) = self.bounces.get(&op.id) {
            self.stats.bounces_reserved += 1;
            let frame = substrate_err(&op.obj, &op.id, &code.clone());
            self.staged_outputs.push(Deferred::Transmit(frame));
            return;
        }
        if self.bounces.len() >= crate::limits::SUBSTRATE_BOUNCES_MAX {
            let (_, oldest) = self
                .bounce_order
                .pop_first()
                .expect("the map is full, so not empty");
            self.bounces.remove(&oldest);
            self.staged.push(Record::BounceRemoved { op_id: oldest });
            self.stats.bounces_evicted += 1;
        }
        let code = finality::NO_SUCH_OBJECT.to_owned();
        self.bounces.insert(op.id.clone(), (code.clone(), now));
        self.bounce_order.insert((now, op.id.clone()));
        self.staged.push(Record::Bounce {
            op_id: op.id.clone(),
            code: code.clone(),
            at: now,
        });
        self.stats.bounces += 1;
        self.staged_outputs
            .push(Deferred::Transmit(substrate_err(&op.obj, &op.id, &code)));
    }

    /// The receiving half of per-object FIFO.
    fn sequence(&mut self, now: Time, op: Op, receipt: u64, floor: u64) {
        let obj = op.obj.clone();
        self.advance_to_floor(now, &obj, floor);
        let window = self.config.receive_window;
        let object = self
            .objects
            .get_mut(&obj)
            .expect("callers create the object");
        let next = object.record.rx_next;
        if op.seq < next || object.held.contains_key(&op.seq) {
            self.stats.duplicates += 1;
            // Waits for the latest unpersisted batch: the original may still be in it.
            self.stage_ack(&obj, &op.id, op.seq, receipt);
            return;
        }
        if op.seq >= object.receive_limit(window) {
            // Past the credit this side gave: only a misbehaving peer sends this.
            self.stats.out_of_seq += 1;
            self.send_now(now, substrate_err(&obj, &op.id, finality::OUT_OF_SEQ));
            return;
        }
        if op.seq > next {
            self.stats.deferred += 1;
            object.gap_since.get_or_insert(now);
            self.staged.push(Record::Held(op.clone()));
            let (id, seq) = (op.id.clone(), op.seq);
            object.held.insert(op.seq, op);
            self.stage_ack(&obj, &id, seq, receipt);
            return;
        }
        object.record.rx_next = next + 1;
        let (id, seq) = (op.id.clone(), op.seq);
        self.apply(now, op);
        self.deliver_held(now, &obj);
        self.stage_ack(&obj, &id, seq, receipt);
    }

    /// The peer's floor: every seq of its direction below `floor` ended there or was acked.
    /// The acked ones are held here (durably): they are delivered, in order. Only the seqs
    /// never received are skipped.
    fn advance_to_floor(&mut self, now: Time, obj: &str, floor: u64) {
        let Some(object) = self.objects.get_mut(obj) else {
            return;
        };
        let from = object.record.rx_next;
        if floor <= from {
            return;
        }
        let held_below = object.held.range(..floor).count() as u64;
        self.stats.skipped_below_floor += floor - from - held_below;
        loop {
            let object = self.objects.get_mut(obj).expect("checked above");
            let Some(entry) = object.held.first_entry().filter(|e| *e.key() < floor) else {
                break;
            };
            let op = entry.remove();
            object.record.rx_next = op.seq + 1;
            self.staged.push(Record::HeldRemoved {
                obj: obj.to_owned(),
                seq: op.seq,
            });
            self.apply(now, op);
        }
        let object = self.objects.get_mut(obj).expect("checked above");
        object.record.rx_next = object.record.rx_next.max(floor);
        self.deliver_held(now, obj);
    }

    /// A hop ack of the peer's op `seq`, with news of this side's credit when there is any,
    /// released with the batch that made the op durable.
    fn stage_ack(&mut self, obj: &str, id: &str, seq: u64, receipt: u64) {
        let limit = self.credit_news(obj);
        let frame = ack_frame(obj, id, seq, receipt, limit);
        self.staged_outputs.push(Deferred::Transmit(frame));
    }

    /// The app freed room in `obj`: a credit update if there is news worth one. It waits for
    /// the batch that freed the room.
    fn stage_credit(&mut self, obj: &str) {
        if let Some(limit) = self.credit_news(obj) {
            self.stats.credits_sent += 1;
            self.staged_outputs
                .push(Deferred::Transmit(credit_frame(obj, limit)));
        }
    }

    /// The credit to tell the peer now, if any: more than it was told, and either it may be
    /// waiting for it (it used every seq it was told) or the news is worth half a window.
    /// Telling less often keeps acks small and identical across histories.
    fn credit_news(&mut self, obj: &str) -> Option<u64> {
        let window = self.config.receive_window;
        let initial = self.initial_credit;
        let object = self.objects.get_mut(obj)?;
        let limit = object.receive_limit(window);
        let told = object.limit_sent.max(initial);
        if limit <= told {
            return None;
        }
        let peer_may_wait = object.seen_end() >= told;
        if peer_may_wait || limit - told >= (window / 2).max(1) {
            object.limit_sent = limit;
            return Some(limit);
        }
        None
    }

    /// Delivers every held op the frontier has reached, then records the frontier.
    fn deliver_held(&mut self, now: Time, obj: &str) {
        loop {
            let Some(object) = self.objects.get_mut(obj) else {
                return;
            };
            let next = object.record.rx_next;
            let Some(op) = object.held.remove(&next) else {
                if object.held.is_empty() {
                    object.gap_since = None;
                } else {
                    object.gap_since.get_or_insert(now);
                }
                self.staged.push(Record::Object(object.record.clone()));
                return;
            };
            object.record.rx_next = next + 1;
            self.staged.push(Record::HeldRemoved {
                obj: obj.to_owned(),
                seq: next,
            });
            self.apply(now, op);
        }
    }

    /// Applies one op of the remote, in order.
    fn apply(&mut self, now: Time, op: Op) {
        let object = self
            .objects
            .get_mut(&op.obj)
            .expect("sequenced ops have an object");
        let obj = op.obj.clone();
        match op.verb {
            Verb::Open => {
                let record = &object.record;
                if record.opened_by == Side::Remote && record.open_id == op.id {
                    self.staged_outputs
                        .push(Deferred::Event(open_requested(record, op.cap)));
                } else if record.opened_by == Side::Local && record.state == ObjectState::Opening {
                    // Both sides opened this address at once: the lower open id wins, on
                    // both sides alike. The winner says nothing more: the loser learns from
                    // the winner's open, which is on the wire before anything it sends next.
                    self.stats.open_conflicts += 1;
                    if op.id < record.open_id {
                        self.lose_open_race(&obj, op);
                    }
                } else {
                    // An open of an address that exists already here.
                    self.stats.open_conflicts += 1;
                    let frame = substrate_err(&obj, &op.id, finality::OPEN_CONFLICT);
                    self.staged_outputs.push(Deferred::Transmit(frame));
                }
            }
            Verb::Send | Verb::Req | Verb::Chunk => {
                if object.record.state != ObjectState::Live {
                    let code = finality::CLOSED;
                    self.staged_outputs
                        .push(Deferred::Transmit(substrate_err(&obj, &op.id, code)));
                    return;
                }
                self.staged.push(Record::Inbox(op.clone()));
                object.inbox.insert(op.seq, op.clone());
                self.staged_outputs
                    .push(Deferred::Event(Event::Delivered(op)));
            }
            Verb::Close => {
                object.record.state = ObjectState::Closed(now);
                let event = Event::Closed {
                    obj: obj.clone(),
                    reason: op.reason,
                    by_remote: true,
                };
                self.staged_outputs.push(Deferred::Event(event));
                // Only ops never transmitted are certainly undelivered. One already on the
                // wire may have been delivered before the close: it keeps its place and gets
                // its own outcome (a re-ack, or `closed` from the peer's closed object).
                self.purge_outbox(&obj, finality::CLOSED, Outgoing::never_sent);
                self.drop_unanswerable_reqs(&obj);
            }
            Verb::Accept => {
                if object.record.state == ObjectState::Opening {
                    object.record.state = ObjectState::Live;
                    self.staged_outputs
                        .push(Deferred::Event(Event::Opened { obj: obj.clone() }));
                }
                self.end_answered(&obj, &op.id);
            }
            Verb::Reject => {
                if object.record.state == ObjectState::Opening {
                    object.record.state = ObjectState::Rejected(now);
                    let event = Event::Rejected {
                        obj: obj.clone(),
                        code: op.code.clone(),
                    };
                    self.staged_outputs.push(Deferred::Event(event));
                }
                self.end_answered(&obj, &op.id);
                let code = op
                    .code
                    .as_deref()
                    .unwrap_or(finality::APPROVAL_DENIED)
                    .to_owned();
                self.purge_outbox(&obj, &code, |_| true);
            }
            Verb::Res | Verb::End | Verb::Err => {
                self.end_answered(&obj, &op.id);
                let event = Event::Answered {
                    obj,
                    req_id: op.id,
                    verb: op.verb,
                    body: op.body,
                    code: op.code,
                };
                self.staged_outputs.push(Deferred::Event(event));
            }
            Verb::Ack | Verb::Resync => self.stats.malformed += 1,
        }
    }

    /// An answer arrived for op `id`: it was received, so it leaves the outbox (its ack may
    /// have been lost with a connection).
    fn end_answered(&mut self, obj: &str, id: &str) {
        let Some(object) = self.objects.get_mut(obj) else {
            return;
        };
        if let Some(seq) = object.outbox.seq_of(id) {
            object.outbox.remove(seq);
            self.staged.push(Record::OutboxRemoved {
                obj: obj.to_owned(),
                seq,
            });
        }
    }

    /// Ends every outbox op of `obj` matching `filter` as futile with `code` (law 5).
    fn purge_outbox(&mut self, obj: &str, code: &str, filter: impl Fn(&Outgoing) -> bool) {
        let Some(object) = self.objects.get_mut(obj) else {
            return;
        };
        let seqs: Vec<u64> = object
            .outbox
            .values()
            .filter(|e| filter(e))
            .map(|e| e.op.seq)
            .collect();
        for seq in seqs {
            let entry = object.outbox.remove(seq).expect("listed above");
            object.ended_max = object.ended_max.max(Some(seq));
            self.staged.push(Record::OutboxRemoved {
                obj: obj.to_owned(),
                seq,
            });
            *self.stats.futile.entry(code.to_owned()).or_default() += 1;
            let event = Event::Futile {
                obj: obj.to_owned(),
                op_id: entry.op.id,
                code: code.to_owned(),
            };
            self.staged_outputs.push(Deferred::Event(event));
        }
        self.staged.push(Record::Object(object.record.clone()));
    }

    /// An unsequenced `err` from the substrate of the peer (bounce, denial, out_of_seq, ...)
    /// about one of this side's ops.
    fn on_substrate_err(&mut self, now: Time, env: &Env) {
        let Some(id) = env.id.as_deref() else {
            self.stats.malformed += 1;
            return;
        };
        let code = env
            .code
            .clone()
            .unwrap_or_else(|| finality::CLOSED.to_owned());
        // The object names where to look; an answer to an address the peer could not parse
        // (`routing_not_supported`) names none, so every object is searched.
        let found = self.objects.iter().find_map(|(name, object)| {
            let named = env.obj.as_ref().is_none_or(|obj| obj.as_str() == name);
            let seq = object.outbox.transmitted_seq_of(id).filter(|_| named)?;
            Some((name.clone(), seq))
        });
        let Some((obj, seq)) = found else {
            // Not an op of ours in flight: dropped and counted, never answered (law 4).
            self.stats.finality_rejected += 1;
            return;
        };
        let obj = obj.as_str();
        self.touch(obj);
        let object = self.objects.get_mut(obj).expect("found above");
        match class_of(&code) {
            Class::Transient => {
                let policy =
                    Backoff::new(self.config.transient_retry, self.config.transient_retry_cap);
                let failures = object.outbox.note_transient(seq);
                let at = now.saturating_add(policy.delay(failures, self.jitter.next_u64()));
                object.outbox.retry_at(seq, at);
                *self.stats.transient.entry(code).or_default() += 1;
            }
            Class::Terminal => {
                let is_open = seq == 0 && object.record.opened_by == Side::Local;
                if is_open && object.record.state == ObjectState::Opening {
                    object.record.state = ObjectState::Rejected(now);
                    let event = Event::Rejected {
                        obj: obj.to_owned(),
                        code: Some(code.clone()),
                    };
                    self.staged_outputs.push(Deferred::Event(event));
                    self.purge_outbox(obj, &code, |_| true);
                } else {
                    self.purge_outbox(obj, &code, |e| e.op.seq == seq);
                }
            }
        }
    }

    fn on_ack(&mut self, env: &Env) {
        let Some(obj) = env.obj.as_ref() else {
            self.stats.malformed += 1;
            return;
        };
        let obj = obj.as_str();
        if let (Some(limit), Some(object)) = (env.limit, self.objects.get_mut(obj)) {
            object.tx_limit = object.tx_limit.max(limit);
        }
        let (Some(seq), Some(receipt)) = (env.seq, env.receipt) else {
            // A credit update carries only the object and its limit.
            if env.limit.is_none() {
                self.stats.malformed += 1;
            }
            return;
        };
        let Some(object) = self.objects.get_mut(obj) else {
            self.stats.stale_receipts += 1;
            return;
        };
        match object.outbox.get(seq) {
            Some(entry) if entry.in_flight && entry.receipt == receipt => {
                let entry = object.outbox.remove(seq).expect("matched above");
                self.staged.push(Record::OutboxRemoved {
                    obj: obj.to_owned(),
                    seq,
                });
                self.stats.ops_acked += 1;
                let event = Event::Acked {
                    obj: obj.to_owned(),
                    op_id: entry.op.id,
                };
                self.staged_outputs.push(Deferred::Event(event));
            }
            _ => self.stats.stale_receipts += 1,
        }
    }

    /// A `resync` asks this side (as sender) to resend from `fromSeq` and to say its floor; one
    /// carrying `floor` instead is the peer (as sender) announcing its floor.
    fn on_resync(&mut self, now: Time, env: &Env) {
        let Some(obj) = env.obj.as_ref().map(Address::as_str) else {
            self.stats.malformed += 1;
            return;
        };
        match (env.from_seq, env.floor) {
            (Some(from), _) => {
                self.stats.resyncs_received += 1;
                let Some(object) = self.objects.get_mut(obj) else {
                    return;
                };
                // Entries from `from` go out again; first the floor, which tells the peer
                // which seqs below it to stop waiting for.
                object.outbox.land_from(from);
                let floor = object.floor();
                if floor > from {
                    object.floor_sent = object.floor_sent.max(floor);
                    self.stats.floors_sent += 1;
                    self.send_now(now, floor_frame(obj, floor));
                }
            }
            (None, Some(floor)) => {
                // Skipped seqs free credit, and nothing else would tell the peer.
                self.advance_to_floor(now, obj, floor);
                self.stage_credit(obj);
            }
            (None, None) => self.stats.malformed += 1,
        }
    }

    // -----------------------------------------------------------------------------------------
    // Timers

    fn object_timers(&mut self, now: Time, name: &str) {
        let config = self.config.clone();
        let link_up = self.link_up;
        let object = self.objects.get_mut(name).expect("listed by the caller");
        if let Some(since) = object.gap_since {
            let due = now.saturating_since(since) >= config.gap_resync_after;
            let allowed = object
                .last_resync
                .is_none_or(|last| now.saturating_since(last) >= config.gap_resync_after);
            if due && allowed && link_up {
                object.last_resync = Some(now);
                let mut env = Env::new(Verb::Resync);
                env.obj = Some(Address::parse(name).expect("stored objects have valid names"));
                env.from_seq = Some(object.record.rx_next);
                self.stats.resyncs_sent += 1;
                self.send_now(now, Envelope::new(env));
            }
        }
        let object = self.objects.get_mut(name).expect("still there");
        object.outbox.clear_due_retries(now);
        let expired = object.outbox.expired(now, config.queue_ttl);
        if let (Some(&first), Some(&last)) = (expired.first(), expired.last()) {
            // Expirable seqs expire in order: the expired ones are one run of them.
            self.purge_outbox(name, finality::TTL_EXPIRED, |e| {
                (first..=last).contains(&e.op.seq) && e.expires()
            });
        }
        let object = self.objects.get(name).expect("still there");
        let retired = match object.record.state {
            ObjectState::Closed(at) | ObjectState::Rejected(at) => {
                now.saturating_since(at) >= config.dedupe_retention
                    && object.outbox.is_empty()
                    && object.inbox.is_empty()
            }
            _ => false,
        };
        if retired {
            self.remove_object(name);
        }
    }

    /// Forgets `obj` (retired or evicted), its timer with it.
    fn remove_object(&mut self, obj: &str) {
        self.objects.remove(obj);
        if let Some(at) = self.deadlines.remove(obj) {
            self.timers.remove(&(at, obj.to_owned()));
        }
        self.touched.remove(obj);
        self.staged.push(Record::ObjectRemoved {
            obj: obj.to_owned(),
        });
    }

    /// The step in progress concerns `obj`.
    fn touch(&mut self, obj: &str) {
        if !self.touched.contains(obj) {
            self.touched.insert(obj.to_owned());
        }
    }

    /// The step concerns every object (a link change).
    fn touch_all(&mut self) {
        self.touched.extend(self.objects.keys().cloned());
    }

    /// Sets `obj`'s entry in the timer table to its next deadline (or none).
    fn rearm(&mut self, obj: &str) {
        let next = self.objects.get(obj).and_then(|o| self.next_deadline(o));
        let before = self.deadlines.get(obj).copied();
        if before == next {
            return;
        }
        if let Some(at) = before {
            self.timers.remove(&(at, obj.to_owned()));
            self.deadlines.remove(obj);
        }
        if let Some(at) = next {
            self.timers.insert((at, obj.to_owned()));
            self.deadlines.insert(obj.to_owned(), at);
        }
    }

    /// The earliest time `object` needs [`Machine::handle_timeout`]: a resync (only with a
    /// link to send it on), a transient retry, a TTL expiry, or retirement (only once nothing
    /// is left in it). O(log n).
    fn next_deadline(&self, object: &Object) -> Option<Time> {
        let config = &self.config;
        let gap = object.gap_since.filter(|_| self.link_up).map(|since| {
            let due = since.saturating_add(config.gap_resync_after);
            let allowed = object
                .last_resync
                .map_or(due, |last| last.saturating_add(config.gap_resync_after));
            due.max(allowed)
        });
        let retry = object.outbox.retrying.first().map(|(at, _)| *at);
        let expiry = object.outbox.next_expiry(config.queue_ttl);
        let retire = match object.record.state {
            ObjectState::Closed(at) | ObjectState::Rejected(at)
                if object.outbox.is_empty() && object.inbox.is_empty() =>
            {
                Some(at.saturating_add(config.dedupe_retention))
            }
            _ => None,
        };
        [gap, retry, expiry, retire].into_iter().flatten().min()
    }

    // -----------------------------------------------------------------------------------------
    // Helpers

    fn decide(&mut self, now: Time, obj: &str, reject: Option<&str>) -> Result<(), CommandError> {
        self.touched.insert(obj.to_owned());
        let object = self.objects.get_mut(obj).ok_or_else(|| no_such(obj))?;
        if object.record.state != ObjectState::AwaitingAccept {
            return Err(CommandError::WrongState(obj.to_owned()));
        }
        object.record.state = match reject {
            None => ObjectState::Live,
            Some(_) => ObjectState::Rejected(now),
        };
        let open_id = object.record.open_id.clone();
        let verb = if reject.is_some() {
            Verb::Reject
        } else {
            Verb::Accept
        };
        let mut op = self.op(now, obj, verb, open_id);
        op.code = reject.map(str::to_owned);
        self.enqueue(op);
        self.end_step(now);
        Ok(())
    }

    fn message(
        &mut self,
        now: Time,
        obj: &str,
        verb: Verb,
        body: Bytes,
    ) -> Result<String, CommandError> {
        check_body(Some(&body))?;
        self.touched.insert(obj.to_owned());
        let object = self.objects.get(obj).ok_or_else(|| no_such(obj))?;
        if !matches!(
            object.record.state,
            ObjectState::Live | ObjectState::Opening
        ) {
            return Err(CommandError::WrongState(obj.to_owned()));
        }
        self.check_room(obj)?;
        let id = self.mint();
        let mut op = self.op(now, obj, verb, id.clone());
        op.body = Some(body);
        self.enqueue(op);
        self.end_step(now);
        Ok(id)
    }

    /// Both sides opened `obj` at once and the peer's open (`theirs`) has the lower id: the
    /// object becomes the peer's, awaiting this side's decision, and this side's open and
    /// everything queued behind it end futile with `open_conflict` (only the open can have
    /// left: nothing follows an open on the wire before it is accepted).
    fn lose_open_race(&mut self, obj: &str, theirs: Op) {
        let ours = self.objects[obj].record.open_id.clone();
        let open_pending = self.objects[obj].outbox.seq_of(&ours).is_some();
        self.purge_outbox(obj, finality::OPEN_CONFLICT, |_| true);
        if !open_pending {
            // The open was hop-acked already (the winner consumed it): it still ends here.
            *self
                .stats
                .futile
                .entry(finality::OPEN_CONFLICT.to_owned())
                .or_default() += 1;
            let event = Event::Futile {
                obj: obj.to_owned(),
                op_id: ours,
                code: finality::OPEN_CONFLICT.to_owned(),
            };
            self.staged_outputs.push(Deferred::Event(event));
        }
        let object = self.objects.get_mut(obj).expect("the caller holds it");
        object.record.opened_by = Side::Remote;
        object.record.open_id = theirs.id;
        object.record.state = ObjectState::AwaitingAccept;
        if let Some(kind) = theirs.obj_kind {
            object.record.kind = kind;
        }
        self.staged.push(Record::Object(object.record.clone()));
        let event = open_requested(&object.record, theirs.cap);
        self.staged_outputs.push(Deferred::Event(event));
    }

    /// A closed object's reqs can never be answered: their deliveries leave the inbox (and
    /// are not delivered again after a restart). Sends stay until the app consumes them.
    fn drop_unanswerable_reqs(&mut self, obj: &str) {
        let Some(object) = self.objects.get_mut(obj) else {
            return;
        };
        let reqs: Vec<u64> = object
            .inbox
            .iter()
            .filter(|(_, op)| op.verb == Verb::Req)
            .map(|(seq, _)| *seq)
            .collect();
        let freed = !reqs.is_empty();
        for seq in reqs {
            object.inbox.remove(&seq);
            self.staged.push(Record::InboxRemoved {
                obj: obj.to_owned(),
                seq,
            });
        }
        if freed {
            self.stage_credit(obj);
        }
    }

    fn live_for_app(&self, obj: &str) -> Result<(), CommandError> {
        match self.objects.get(obj).map(|object| object.record.state) {
            Some(ObjectState::Live) => Ok(()),
            Some(_) => Err(CommandError::WrongState(obj.to_owned())),
            None => Err(no_such(obj)),
        }
    }

    /// Sends, reqs and answers are refused with `queue_full` at the outbox bound. The open,
    /// the accept or reject, and the close are never refused for room (each happens once per
    /// object), so an outbox holds at most `outbox_ops_max + 2` ops.
    fn check_room(&self, obj: &str) -> Result<(), CommandError> {
        let object = self.objects.get(obj).ok_or_else(|| no_such(obj))?;
        if object.outbox.len() >= self.config.outbox_ops_max {
            return Err(CommandError::QueueFull);
        }
        Ok(())
    }

    /// Keeps at most [`crate::limits::SUBSTRATE_RETAINED_OBJECTS_MAX`] closed or rejected
    /// objects: before another object is created, the oldest idle one is forgotten.
    fn bound_retained_objects(&mut self) {
        let retained = self
            .objects
            .values()
            .filter(|o| o.record.state.is_terminal())
            .count();
        if retained < crate::limits::SUBSTRATE_RETAINED_OBJECTS_MAX {
            return;
        }
        let oldest = self
            .objects
            .iter()
            .filter(|(_, o)| o.outbox.is_empty() && o.inbox.is_empty() && o.held.is_empty())
            .filter_map(|(name, o)| match o.record.state {
                ObjectState::Closed(at) | ObjectState::Rejected(at) => Some((at, name.clone())),
                _ => None,
            })
            .min();
        if let Some((_, name)) = oldest {
            self.remove_object(&name);
            self.stats.objects_evicted += 1;
        }
    }

    fn live_object_count(&self) -> usize {
        self.objects
            .values()
            .filter(|object| !object.record.state.is_terminal())
            .count()
    }

    fn mint(&mut self) -> String {
        self.minted += 1;
        format!("{:016x}{:016x}", self.boot, self.minted)
    }

    fn op(&self, now: Time, obj: &str, verb: Verb, id: String) -> Op {
        Op {
            obj: obj.to_owned(),
            seq: 0,
            id,
            verb,
            obj_kind: None,
            body: None,
            code: None,
            reason: None,
            cap: None,
            at: now,
        }
    }

    /// Gives `op` the object's next seq and puts it in the outbox, durably (row insert and seq
    /// bump in one batch).
    fn enqueue(&mut self, mut op: Op) {
        let batch = self.next_batch;
        let object = self
            .objects
            .get_mut(&op.obj)
            .expect("commands check the object");
        op.seq = object.record.tx_next;
        object.record.tx_next += 1;
        let op_obj = op.obj.clone();
        self.staged.push(Record::Object(object.record.clone()));
        self.staged.push(Record::Outbox(op.clone()));
        let entry = Outgoing {
            op,
            batch,
            receipt: 0,
            in_flight: false,
            retry_at: None,
            recovered: false,
            transient_failures: 0,
        };
        object.outbox.insert(entry);
        self.stats.ops_enqueued += 1;
        if self.awaiting_persist.back() != Some(&(batch, op_obj.clone())) {
            self.awaiting_persist.push_back((batch, op_obj));
        }
    }

    /// Sends a frame that needs no durability (keepalive, resync, denial, out_of_seq).
    fn send_now(&mut self, now: Time, frame: Envelope) {
        if self.link_up {
            self.last_sent = now;
            self.transmit.push_back(frame);
        }
    }

    fn release(&mut self, outputs: Vec<Deferred>) {
        for output in outputs {
            match output {
                Deferred::Transmit(frame) => {
                    if self.link_up {
                        self.transmit.push_back(frame);
                    }
                }
                Deferred::Event(event) => self.events.push_back(event),
            }
        }
    }

    /// Ends every input: staged records become one batch, and the outputs staged with them
    /// wait for it; outputs staged without records wait for the latest unpersisted batch.
    fn end_step(&mut self, now: Time) {
        let outputs = std::mem::take(&mut self.staged_outputs);
        if !self.staged.is_empty() {
            let id = self.next_batch;
            self.next_batch = BatchId(id.0 + 1);
            let records = std::mem::take(&mut self.staged);
            self.persist.push_back(PersistBatch { id, records });
            self.waiting.push_back((id, outputs));
        } else if !outputs.is_empty() {
            match self.waiting.back_mut() {
                Some((_, waiting)) => waiting.extend(outputs),
                None => self.release(outputs),
            }
        }
        let touched = std::mem::take(&mut self.touched);
        if self.link_up {
            self.transmit_ready(now, &touched);
        }
        for obj in &touched {
            self.rearm(obj);
        }
    }

    /// Puts every persisted, transmittable outbox op of the `touched` objects on the wire,
    /// within each object's window and credit (an object no input touched has nothing new
    /// to send: what unblocks an object is an input about it).
    fn transmit_ready(&mut self, now: Time, touched: &BTreeSet<String>) {
        let window = self.window;
        let persisted = self.persisted_through;
        let initial_credit = self.initial_credit;
        for name in touched {
            let Some(object) = self.objects.get_mut(name) else {
                continue;
            };
            let floor = object.floor();
            let opening = object.record.state == ObjectState::Opening;
            let limit = object.tx_limit.max(initial_credit);
            if object.outbox.transmit(
                persisted,
                opening,
                window,
                (floor, limit),
                &mut self.transmit,
            ) {
                object.floor_sent = object.floor_sent.max(floor);
                self.last_sent = now;
            }
            // The first op waits for credit the peer may only give once it knows the floor
            // (a restart forgot what ended below it): the floor goes alone.
            let credit_blocked = object
                .outbox
                .first_seq()
                .is_some_and(|first| first >= limit);
            if object.floor_unannounced() || (credit_blocked && floor > object.floor_sent) {
                object.floor_sent = floor;
                self.stats.floors_sent += 1;
                self.transmit.push_back(floor_frame(name, floor));
                self.last_sent = now;
            }
        }
    }
}

fn check_text(text: Option<&str>) -> Result<(), CommandError> {
    match text {
        Some(text) if text.len() > ENVELOPE_TEXT_BYTES_MAX => Err(CommandError::TextTooLong),
        _ => Ok(()),
    }
}

fn check_body(body: Option<&Bytes>) -> Result<(), CommandError> {
    match body {
        Some(body) if body.len() > ENVELOPE_INLINE_BODY_BYTES_MAX => {
            Err(CommandError::PayloadTooLarge {
                len: body.len(),
                max: ENVELOPE_INLINE_BODY_BYTES_MAX,
            })
        }
        _ => Ok(()),
    }
}

fn no_such(obj: &str) -> CommandError {
    CommandError::NoSuchObject(obj.to_owned())
}

fn open_requested(record: &ObjectRecord, cap: Option<String>) -> Event {
    Event::OpenRequested {
        obj: record.obj.clone(),
        kind: record.kind,
        op_id: record.open_id.clone(),
        cap,
    }
}

fn address(obj: &str) -> Address {
    Address::parse(obj).expect("the machine only stores addresses it parsed")
}

fn op_frame(op: &Op, receipt: u64, floor: u64) -> Envelope {
    let mut env = Env::new(op.verb);
    env.obj = Some(address(&op.obj));
    env.obj_kind = op.obj_kind;
    env.id = Some(op.id.clone());
    env.seq = Some(op.seq);
    env.receipt = Some(receipt);
    env.code = op.code.clone();
    env.reason = op.reason.clone();
    env.cap = op.cap.clone();
    env.floor = Some(floor);
    Envelope {
        body: op.body.clone(),
        ..Envelope::new(env)
    }
}

fn ack_frame(obj: &str, id: &str, seq: u64, receipt: u64, limit: Option<u64>) -> Envelope {
    let mut env = Env::new(Verb::Ack);
    env.obj = Some(address(obj));
    env.id = Some(id.to_owned());
    env.seq = Some(seq);
    env.receipt = Some(receipt);
    env.limit = limit;
    Envelope::new(env)
}

/// A credit update: the peer may transmit seqs of `obj` below `limit`.
fn credit_frame(obj: &str, limit: u64) -> Envelope {
    let mut env = Env::new(Verb::Ack);
    env.obj = Some(address(obj));
    env.limit = Some(limit);
    Envelope::new(env)
}

/// The first number in `env` that no honest peer sends: a seq, floor, resync point or credit
/// limit at or past [`crate::limits::SUBSTRATE_SEQ_MAX`].
fn dishonest_number(env: &Env) -> Option<&'static str> {
    let max = crate::limits::SUBSTRATE_SEQ_MAX;
    [
        (env.seq, "a seq past the bound"),
        (env.floor, "a floor past the bound"),
        (env.from_seq, "a resync point past the bound"),
        (env.limit, "a credit limit past the bound"),
    ]
    .into_iter()
    .find_map(|(value, what)| value.is_some_and(|value| value >= max).then_some(what))
}

/// A floor announcement: every seq of this side's direction of `obj` below `floor` ended or
/// was acked.
fn floor_frame(obj: &str, floor: u64) -> Envelope {
    let mut env = Env::new(Verb::Resync);
    env.obj = Some(address(obj));
    env.floor = Some(floor);
    Envelope::new(env)
}

/// An unsequenced terminal or transient `err` about op `id` (bounce, denial, out_of_seq).
fn substrate_err(obj: &str, id: &str, code: &str) -> Envelope {
    let mut env = Env::new(Verb::Err);
    env.obj = Some(address(obj));
    env.id = Some(id.to_owned());
    env.code = Some(code.to_owned());
    Envelope::new(env)
}
