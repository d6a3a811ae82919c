//! What the substrate persists, as typed records, and the state they add up to.
//!
//! The machine never writes anything itself: it emits [`PersistBatch`]es, a store applies each
//! batch atomically (one transaction) and reports it persisted, and only then does the machine
//! transmit the ops, hop-ack the deliveries and emit the events the batch made durable.
//! [`DurableState::apply`] is the reference meaning of a batch; every store must end up with
//! the same state, and [`super::Machine::recover`] rebuilds a machine from it.
//!
//! What is kept, and why it does not grow with the number of ops ever exchanged: each object's
//! sequence frontier (`rx_next`) answers for every op below it, so an op leaves no per-op record
//! once it is delivered and consumed. Explicit records exist only for what the frontier cannot
//! answer: un-acked outbox ops, delivered ops the app has not consumed, ops held above the
//! frontier, bounce tombstones (op ids to unknown objects) and closed objects during the
//! retention period.

use std::collections::BTreeMap;

use bytes::Bytes;

use crate::time::Time;
use crate::wire::envelope::{ObjKind, Verb};

/// Identifies a persist batch; batches are applied and reported in id order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize)]
#[serde(transparent)]
pub struct BatchId(pub u64);

/// Which side opened an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    /// This side.
    Local,
    /// The remote peer.
    Remote,
}

/// An object's lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ObjectState {
    /// This side sent `open` and awaits `accept` or `reject`.
    Opening,
    /// The remote opened it; the app has not accepted or rejected yet.
    AwaitingAccept,
    /// Accepted: both sides are participants.
    Live,
    /// Closed at the given time (kept for the retention period to answer duplicates).
    Closed(Time),
    /// Rejected at the given time (kept likewise).
    Rejected(Time),
}

impl ObjectState {
    /// Closed or rejected.
    pub fn is_terminal(self) -> bool {
        matches!(self, ObjectState::Closed(_) | ObjectState::Rejected(_))
    }
}

/// The durable part of one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectRecord {
    /// Its address.
    pub obj: String,
    /// Session or queue, recorded on first introduction.
    pub kind: ObjKind,
    /// Who opened it.
    pub opened_by: Side,
    /// The op id of its `open`.
    pub open_id: String,
    /// Lifecycle state.
    pub state: ObjectState,
    /// The seq the next op of this side's direction gets.
    pub tx_next: u64,
    /// The frontier of the remote's direction: every seq below it is delivered.
    pub rx_next: u64,
}

/// One op as persisted: in the outbox (this side's), held above the frontier or in the inbox
/// (the remote's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    /// Object address.
    pub obj: String,
    /// Seq in its direction.
    pub seq: u64,
    /// The op's id; for answers (accept, reject, res, end, err) the id of the op answered.
    pub id: String,
    /// The verb.
    pub verb: Verb,
    /// For opens: the object kind.
    pub obj_kind: Option<ObjKind>,
    /// Opaque body.
    pub body: Option<Bytes>,
    /// Error or reject code.
    pub code: Option<String>,
    /// Close reason.
    pub reason: Option<String>,
    /// Capability token (opens).
    pub cap: Option<String>,
    /// When it was enqueued (outbox) or received (held, inbox).
    pub at: Time,
}

/// One durable change. A batch of them is applied atomically.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    /// Insert or replace an object.
    Object(ObjectRecord),
    /// Forget an object (retention over).
    ObjectRemoved {
        /// Address.
        obj: String,
    },
    /// An op enters the outbox (before it is ever transmitted).
    Outbox(Op),
    /// An outbox op was acked or ended.
    OutboxRemoved {
        /// Address.
        obj: String,
        /// Seq.
        seq: u64,
    },
    /// An op of the remote held above the frontier (persisted before its hop ack).
    Held(Op),
    /// A held op was delivered or skipped.
    HeldRemoved {
        /// Address.
        obj: String,
        /// Seq.
        seq: u64,
    },
    /// A delivered op the app has not consumed yet.
    Inbox(Op),
    /// The app consumed a delivery.
    InboxRemoved {
        /// Address.
        obj: String,
        /// Seq.
        seq: u64,
    },
    /// An op id bounced (unknown object): its stored outcome, re-served to duplicates.
    Bounce {
        /// The op id.
        op_id: String,
        /// The code it was answered with.
        code: String,
        /// When.
        at: Time,
    },
    /// A tombstone's retention is over.
    BounceRemoved {
        /// The op id.
        op_id: String,
    },
}

/// Records applied atomically, in id order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PersistBatch {
    /// Its id.
    pub id: BatchId,
    /// The changes.
    pub records: Vec<Record>,
}

/// Everything one peer's machine has persisted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DurableState {
    /// Objects by address.
    pub objects: BTreeMap<String, ObjectRecord>,
    /// Outbox ops by (address, seq).
    pub outbox: BTreeMap<(String, u64), Op>,
    /// Held ops by (address, seq).
    pub held: BTreeMap<(String, u64), Op>,
    /// Unconsumed deliveries by (address, seq).
    pub inbox: BTreeMap<(String, u64), Op>,
    /// Bounce tombstones by op id: (code, when).
    pub bounces: BTreeMap<String, (String, Time)>,
}

impl DurableState {
    /// Applies one batch, in record order.
    pub fn apply(&mut self, batch: &PersistBatch) {
        for record in &batch.records {
            self.apply_record(record);
        }
    }

    fn apply_record(&mut self, record: &Record) {
        let key = |obj: &str, seq: u64| (obj.to_owned(), seq);
        match record {
            Record::Object(object) => {
                self.objects.insert(object.obj.clone(), object.clone());
            }
            Record::ObjectRemoved { obj } => {
                self.objects.remove(obj);
            }
            Record::Outbox(op) => {
                self.outbox.insert(key(&op.obj, op.seq), op.clone());
            }
            Record::OutboxRemoved { obj, seq } => {
                self.outbox.remove(&key(obj, *seq));
            }
            Record::Held(op) => {
                self.held.insert(key(&op.obj, op.seq), op.clone());
            }
            Record::HeldRemoved { obj, seq } => {
                self.held.remove(&key(obj, *seq));
            }
            Record::Inbox(op) => {
                self.inbox.insert(key(&op.obj, op.seq), op.clone());
            }
            Record::InboxRemoved { obj, seq } => {
                self.inbox.remove(&key(obj, *seq));
            }
            Record::Bounce { op_id, code, at } => {
                self.bounces.insert(op_id.clone(), (code.clone(), *at));
            }
            Record::BounceRemoved { op_id } => {
                self.bounces.remove(op_id);
            }
        }
    }

    /// Rows kept: a measure of durable size that must not grow with ops ever exchanged.
    pub fn row_count(&self) -> usize {
        self.objects.len()
            + self.outbox.len()
            + self.held.len()
            + self.inbox.len()
            + self.bounces.len()
    }
}
