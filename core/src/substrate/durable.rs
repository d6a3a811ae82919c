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
use crate::wire::envelope::{Address, ObjKind, OpId, Verb};

/// Identifies a persist batch; batches are applied and reported in id order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize)]
#[serde(transparent)]
pub struct BatchId(pub u64);

/// A position in one direction of one object's op sequence (`seq`): ops are numbered from 0
/// in the order their sender enqueued them. Frontiers, floors and credit limits are positions
/// too ("every seq below it ..."); a count of ops is a plain number, and adding one to a
/// position or taking two apart is the only arithmetic between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize)]
#[serde(transparent)]
pub struct Seq(pub u64);

impl Seq {
    /// The first position.
    pub const ZERO: Seq = Seq(0);

    /// The position as a number (on the wire, in a store).
    pub const fn get(self) -> u64 {
        self.0
    }

    /// `count` positions further on, stopping at the last one.
    pub const fn saturating_add(self, count: u64) -> Seq {
        Seq(self.0.saturating_add(count))
    }
}

impl std::fmt::Display for Seq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl From<u64> for Seq {
    fn from(seq: u64) -> Self {
        Seq(seq)
    }
}

/// `count` positions further on. Positions stay below `SUBSTRATE_SEQ_MAX` (a peer's number past
/// it is refused), so this never nears overflow; overflow checks in debug builds still hold it.
impl std::ops::Add<u64> for Seq {
    type Output = Seq;
    fn add(self, count: u64) -> Seq {
        Seq(self.0 + count)
    }
}

impl std::ops::AddAssign<u64> for Seq {
    fn add_assign(&mut self, count: u64) {
        self.0 += count;
    }
}

/// How many positions lie from `earlier` up to `self` (callers compare first).
impl std::ops::Sub for Seq {
    type Output = u64;
    fn sub(self, earlier: Seq) -> u64 {
        self.0 - earlier.0
    }
}

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
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjectRecord {
    /// Its address.
    pub obj: Address,
    /// Session or queue, recorded on first introduction.
    pub kind: ObjKind,
    /// Who opened it.
    pub opened_by: Side,
    /// The op id of its `open`.
    pub open_id: OpId,
    /// Lifecycle state.
    pub state: ObjectState,
    /// The seq the next op of this side's direction gets.
    pub tx_next: Seq,
    /// The frontier of the remote's direction: every seq below it is delivered.
    pub rx_next: Seq,
}

/// One op as persisted: in the outbox (this side's), held above the frontier or in the inbox
/// (the remote's).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Op {
    /// Object address.
    pub obj: Address,
    /// Seq in its direction.
    pub seq: Seq,
    /// The op's id; for answers (accept, reject, res, end, err) the id of the op answered.
    pub id: OpId,
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
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Record {
    /// Insert or replace an object.
    Object(ObjectRecord),
    /// Forget an object (retention over).
    ObjectRemoved {
        /// Address.
        obj: Address,
    },
    /// An op enters the outbox (before it is ever transmitted).
    Outbox(Op),
    /// An outbox op was acked or ended.
    OutboxRemoved {
        /// Address.
        obj: Address,
        /// Seq.
        seq: Seq,
    },
    /// An op of the remote held above the frontier (persisted before its hop ack).
    Held(Op),
    /// A held op was delivered or skipped.
    HeldRemoved {
        /// Address.
        obj: Address,
        /// Seq.
        seq: Seq,
    },
    /// A delivered op the app has not consumed yet.
    Inbox(Op),
    /// The app consumed a delivery.
    InboxRemoved {
        /// Address.
        obj: Address,
        /// Seq.
        seq: Seq,
    },
    /// An op id bounced (unknown object): its stored outcome, re-served to duplicates.
    Bounce {
        /// The op id.
        op_id: OpId,
        /// The code it was answered with.
        code: String,
        /// When.
        at: Time,
    },
    /// A tombstone's retention is over.
    BounceRemoved {
        /// The op id.
        op_id: OpId,
    },
}

/// Records applied atomically, in id order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PersistBatch {
    /// Its id.
    pub id: BatchId,
    /// The changes.
    pub records: Vec<Record>,
}

/// What one record writes: the row it inserts, replaces or deletes (only ever used to tell
/// rows apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Row<'a> {
    Object(&'a str),
    Outbox(Seq, &'a str),
    Held(Seq, &'a str),
    Inbox(Seq, &'a str),
    Bounce(&'a str),
}

impl Record {
    /// The row this record writes.
    fn row(&self) -> Row<'_> {
        match self {
            Record::Object(object) => Row::Object(&object.obj),
            Record::ObjectRemoved { obj } => Row::Object(obj),
            Record::Outbox(op) => Row::Outbox(op.seq, &op.obj),
            Record::OutboxRemoved { obj, seq } => Row::Outbox(*seq, obj),
            Record::Held(op) => Row::Held(op.seq, &op.obj),
            Record::HeldRemoved { obj, seq } => Row::Held(*seq, obj),
            Record::Inbox(op) => Row::Inbox(op.seq, &op.obj),
            Record::InboxRemoved { obj, seq } => Row::Inbox(*seq, obj),
            Record::Bounce { op_id, .. } => Row::Bounce(op_id),
            Record::BounceRemoved { op_id } => Row::Bounce(op_id),
        }
    }
}

/// The row a record writes, owned: what an index of where each live row's record lies in a
/// store is keyed by ([`crate::substrate::log::LogIndex`]).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RowKey {
    /// An object, by address.
    Object(Address),
    /// An outbox op, by address and seq.
    Outbox(Address, Seq),
    /// A held op, by address and seq.
    Held(Address, Seq),
    /// An unconsumed delivery, by address and seq.
    Inbox(Address, Seq),
    /// A bounce tombstone, by op id.
    Bounce(OpId),
}

impl Record {
    /// The row this record writes, owned (the row [`effective_records`] compares by).
    pub fn row_key(&self) -> RowKey {
        match self {
            Record::Object(object) => RowKey::Object(object.obj.clone()),
            Record::ObjectRemoved { obj } => RowKey::Object(obj.clone()),
            Record::Outbox(op) => RowKey::Outbox(op.obj.clone(), op.seq),
            Record::OutboxRemoved { obj, seq } => RowKey::Outbox(obj.clone(), *seq),
            Record::Held(op) => RowKey::Held(op.obj.clone(), op.seq),
            Record::HeldRemoved { obj, seq } => RowKey::Held(obj.clone(), *seq),
            Record::Inbox(op) => RowKey::Inbox(op.obj.clone(), op.seq),
            Record::InboxRemoved { obj, seq } => RowKey::Inbox(obj.clone(), *seq),
            Record::Bounce { op_id, .. } | Record::BounceRemoved { op_id } => {
                RowKey::Bounce(op_id.clone())
            }
        }
    }

    /// The record deletes its row (otherwise it writes the row whole).
    pub fn removes(&self) -> bool {
        matches!(
            self,
            Record::ObjectRemoved { .. }
                | Record::OutboxRemoved { .. }
                | Record::HeldRemoved { .. }
                | Record::InboxRemoved { .. }
                | Record::BounceRemoved { .. }
        )
    }
}

/// The records of `batches` that decide the state they leave, in order: a record that a later
/// record of the same group writes over (an object recorded again or removed, an op row
/// replaced or removed) is left out, and so is a second delete of a row. Applying what this
/// returns to any state leaves exactly what applying every record of `batches` would: the
/// writes it leaves out are ones no state after the group can show. A store committing a
/// group in one transaction writes only these (an object's frontier once per group, not once
/// per op).
// A hash map, never iterated: what it decides (which records are kept) and their order are
// the same whatever its seed.
#[allow(clippy::disallowed_types)]
pub fn effective_records(batches: &[PersistBatch]) -> Vec<&Record> {
    use std::collections::HashMap;
    let records: Vec<&Record> = batches.iter().flat_map(|batch| &batch.records).collect();
    if records.len() < 2 {
        return records;
    }
    // Each row's last record so far, by one hash lookup per record (a sort of the rows with
    // their positions compared text on every step: 740 instructions a record under callgrind
    // in `tether-store-cost`, the log store's costliest part). The seed is random per
    // process, so a peer choosing object names cannot make the rows collide on purpose; what
    // is returned does not depend on it.
    let mut last: HashMap<Row<'_>, usize, foldhash::fast::RandomState> =
        HashMap::with_capacity_and_hasher(records.len(), Default::default());
    let mut kept = vec![true; records.len()];
    for (at, record) in records.iter().enumerate() {
        if let Some(before) = last.insert(record.row(), at) {
            kept[before] = false;
        }
    }
    if last.len() == records.len() {
        // Every row written once: nothing to leave out.
        return records;
    }
    records
        .into_iter()
        .zip(kept)
        .filter_map(|(record, kept)| kept.then_some(record))
        .collect()
}

/// Everything one peer's machine has persisted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct DurableState {
    /// Objects by address.
    pub objects: BTreeMap<Address, ObjectRecord>,
    /// Outbox ops by (address, seq).
    pub outbox: BTreeMap<(Address, Seq), Op>,
    /// Held ops by (address, seq).
    pub held: BTreeMap<(Address, Seq), Op>,
    /// Unconsumed deliveries by (address, seq).
    pub inbox: BTreeMap<(Address, Seq), Op>,
    /// Bounce tombstones by op id: (code, when).
    pub bounces: BTreeMap<OpId, (String, Time)>,
}

impl DurableState {
    /// Applies one batch, in record order.
    pub fn apply(&mut self, batch: &PersistBatch) {
        self.apply_records(&batch.records);
    }

    fn apply_record(&mut self, record: &Record) {
        let key = |obj: &Address, seq: Seq| (obj.clone(), seq);
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

    /// Applies `records` in order (what [`effective_records`] returns).
    pub fn apply_records<'a>(&mut self, records: impl IntoIterator<Item = &'a Record>) {
        for record in records {
            self.apply_record(record);
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn addr(text: &str) -> Address {
        Address::parse(text).expect("a valid address")
    }

    fn op(obj: &str, seq: u64, body: u8) -> Op {
        Op {
            obj: addr(obj),
            seq: Seq(seq),
            id: format!("{obj}-{seq}").into(),
            verb: Verb::Send,
            obj_kind: None,
            body: Some(Bytes::from(vec![body])),
            code: None,
            reason: None,
            cap: None,
            at: Time::from_millis(u64::from(body)),
        }
    }

    fn object(obj: &str, next: u64) -> ObjectRecord {
        ObjectRecord {
            obj: addr(obj),
            kind: ObjKind::Queue,
            opened_by: Side::Local,
            open_id: "o".into(),
            state: ObjectState::Live,
            tx_next: Seq(next),
            rx_next: Seq(next),
        }
    }

    /// Records over a few rows, so that later records often write rows earlier ones did.
    fn record() -> impl Strategy<Value = Record> {
        let obj = prop::sample::select(vec!["a", "b"]);
        let seq = 0u64..3;
        prop_oneof![
            (obj.clone(), 0u64..4).prop_map(|(obj, next)| Record::Object(object(obj, next))),
            obj.clone()
                .prop_map(|obj| Record::ObjectRemoved { obj: addr(obj) }),
            (obj.clone(), seq.clone(), any::<u8>())
                .prop_map(|(o, s, b)| Record::Outbox(op(o, s, b))),
            (obj.clone(), seq.clone()).prop_map(|(o, seq)| Record::OutboxRemoved {
                obj: addr(o),
                seq: Seq(seq)
            }),
            (obj.clone(), seq.clone(), any::<u8>()).prop_map(|(o, s, b)| Record::Held(op(o, s, b))),
            (obj.clone(), seq.clone()).prop_map(|(o, seq)| Record::HeldRemoved {
                obj: addr(o),
                seq: Seq(seq)
            }),
            (obj.clone(), seq.clone(), any::<u8>())
                .prop_map(|(o, s, b)| Record::Inbox(op(o, s, b))),
            (obj, seq).prop_map(|(o, seq)| Record::InboxRemoved {
                obj: addr(o),
                seq: Seq(seq)
            }),
            (0u8..2, any::<u8>()).prop_map(|(n, at)| Record::Bounce {
                op_id: format!("x{n}").into(),
                code: "no_such_object".to_owned(),
                at: Time::from_millis(u64::from(at)),
            }),
            (0u8..2).prop_map(|n| Record::BounceRemoved {
                op_id: format!("x{n}").into()
            }),
        ]
    }

    fn batches(records: Vec<Vec<Record>>) -> Vec<PersistBatch> {
        records
            .into_iter()
            .enumerate()
            .map(|(i, records)| PersistBatch {
                id: BatchId(i as u64 + 1),
                records,
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// From any state, the effective records of a group leave exactly the state all of
        /// its records leave, and never more records.
        #[test]
        fn the_effective_records_leave_the_state_every_record_leaves(
            before in prop::collection::vec(record(), 0..12),
            group in prop::collection::vec(prop::collection::vec(record(), 0..6), 0..6),
        ) {
            let mut start = DurableState::default();
            start.apply(&PersistBatch { id: BatchId(0), records: before });
            let group = batches(group);
            let mut every = start.clone();
            for batch in &group {
                every.apply(batch);
            }
            let effective = effective_records(&group);
            let mut compacted = start;
            compacted.apply_records(effective.iter().copied());
            prop_assert_eq!(compacted, every);
            prop_assert!(effective.len() <= group.iter().map(|b| b.records.len()).sum::<usize>());
        }
    }

    #[test]
    fn an_object_recorded_per_op_is_written_once_per_group() {
        let group = batches(vec![
            vec![
                Record::Object(object("a", 1)),
                Record::Outbox(op("a", 0, 1)),
            ],
            vec![
                Record::Object(object("a", 2)),
                Record::Outbox(op("a", 1, 2)),
            ],
            vec![
                Record::Object(object("a", 3)),
                Record::Outbox(op("a", 2, 3)),
                Record::OutboxRemoved {
                    obj: addr("a"),
                    seq: Seq::ZERO,
                },
            ],
        ]);
        let effective = effective_records(&group);
        assert_eq!(
            effective,
            vec![
                &Record::Outbox(op("a", 1, 2)),
                &Record::Object(object("a", 3)),
                &Record::Outbox(op("a", 2, 3)),
                &Record::OutboxRemoved {
                    obj: addr("a"),
                    seq: Seq::ZERO
                },
            ]
        );
    }
}
