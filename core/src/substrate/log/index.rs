//! [`LogIndex`]: where each live row's record lies in a log file, so that a compaction copies
//! the live records' bytes instead of replaying the whole file.
//!
//! A row is live while its last record writes it (an object recorded, an op in the outbox, a
//! tombstone); a record that removes it ends it. The index holds, per peer, each live row's
//! key and the byte range of the entry that wrote it last: never a body, so it is smaller than
//! the state a replay at open builds, and bounded by the same rows.

use std::collections::BTreeMap;
use std::ops::Range;

use super::{decode_entry, Entry, LogError, LogFormat, ScannedCommit};
use crate::substrate::{Address, OpId, PeerId, Record, RowKey, Seq};

/// Where each live row's record lies in one log file, per peer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogIndex {
    peers: BTreeMap<PeerId, PeerRows>,
}

/// One peer's live rows, by object and then by seq, so that a record finds its row by one
/// lookup of its address among the peer's objects and one of a number (a single map keyed by
/// whole rows compared the address's text at every step of every search).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PeerRows {
    /// Objects with at least one live row (an object with none is dropped).
    objects: BTreeMap<Address, ObjectRows>,
    bounces: BTreeMap<OpId, Range<u64>>,
}

/// One object's live rows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct ObjectRows {
    object: Option<Range<u64>>,
    outbox: BTreeMap<Seq, Range<u64>>,
    held: BTreeMap<Seq, Range<u64>>,
    inbox: BTreeMap<Seq, Range<u64>>,
}

impl ObjectRows {
    fn is_empty(&self) -> bool {
        self.object.is_none()
            && self.outbox.is_empty()
            && self.held.is_empty()
            && self.inbox.is_empty()
    }

    fn len(&self) -> usize {
        usize::from(self.object.is_some()) + self.outbox.len() + self.held.len() + self.inbox.len()
    }

    /// The rows as keys of `obj`, with their ranges.
    fn keyed<'a>(
        &'a self,
        obj: &'a Address,
    ) -> impl Iterator<Item = (RowKey, &'a Range<u64>)> + 'a {
        let ops = |rows: &'a BTreeMap<Seq, Range<u64>>, key: fn(Address, Seq) -> RowKey| {
            rows.iter()
                .map(move |(seq, at)| (key(obj.clone(), *seq), at))
        };
        self.object
            .iter()
            .map(|at| (RowKey::Object(obj.clone()), at))
            .chain(ops(&self.outbox, RowKey::Outbox))
            .chain(ops(&self.held, RowKey::Held))
            .chain(ops(&self.inbox, RowKey::Inbox))
    }

    /// The same rows, each range replaced by `place` of it.
    fn placed<E>(
        &self,
        place: &mut impl FnMut(&Range<u64>) -> Result<Range<u64>, E>,
    ) -> Result<Self, E> {
        let mut ops = |rows: &BTreeMap<Seq, Range<u64>>| -> Result<BTreeMap<Seq, Range<u64>>, E> {
            rows.iter()
                .map(|(seq, at)| Ok((*seq, place(at)?)))
                .collect()
        };
        let (outbox, held, inbox) = (ops(&self.outbox)?, ops(&self.held)?, ops(&self.inbox)?);
        Ok(Self {
            object: self.object.as_ref().map(&mut *place).transpose()?,
            outbox,
            held,
            inbox,
        })
    }
}

/// Where a record's row lives in [`PeerRows`].
enum Slot<'a> {
    Object(&'a Address),
    Op(
        &'a Address,
        fn(&mut ObjectRows) -> &mut BTreeMap<Seq, Range<u64>>,
        Seq,
    ),
    Bounce(&'a OpId),
}

fn slot(record: &Record) -> Slot<'_> {
    fn outbox(rows: &mut ObjectRows) -> &mut BTreeMap<Seq, Range<u64>> {
        &mut rows.outbox
    }
    fn held(rows: &mut ObjectRows) -> &mut BTreeMap<Seq, Range<u64>> {
        &mut rows.held
    }
    fn inbox(rows: &mut ObjectRows) -> &mut BTreeMap<Seq, Range<u64>> {
        &mut rows.inbox
    }
    match record {
        Record::Object(object) => Slot::Object(&object.obj),
        Record::ObjectRemoved { obj } => Slot::Object(obj),
        Record::Outbox(op) => Slot::Op(&op.obj, outbox, op.seq),
        Record::OutboxRemoved { obj, seq } => Slot::Op(obj, outbox, *seq),
        Record::Held(op) => Slot::Op(&op.obj, held, op.seq),
        Record::HeldRemoved { obj, seq } => Slot::Op(obj, held, *seq),
        Record::Inbox(op) => Slot::Op(&op.obj, inbox, op.seq),
        Record::InboxRemoved { obj, seq } => Slot::Op(obj, inbox, *seq),
        Record::Bounce { op_id, .. } | Record::BounceRemoved { op_id } => Slot::Bounce(op_id),
    }
}

impl PeerRows {
    /// Writes `at` as the place of `record`'s row, or removes the row.
    fn record(&mut self, record: &Record, at: Range<u64>) {
        let (obj, write): (&Address, &mut dyn FnMut(&mut ObjectRows)) = match slot(record) {
            Slot::Bounce(op_id) => {
                if record.removes() {
                    self.bounces.remove(op_id);
                } else {
                    self.bounces.insert(op_id.clone(), at);
                }
                return;
            }
            Slot::Object(obj) => (obj, &mut |rows: &mut ObjectRows| {
                rows.object = (!record.removes()).then(|| at.clone());
            }),
            Slot::Op(obj, kind, seq) => (obj, &mut move |rows: &mut ObjectRows| {
                if record.removes() {
                    kind(rows).remove(&seq);
                } else {
                    kind(rows).insert(seq, at.clone());
                }
            }),
        };
        match self.objects.get_mut(obj) {
            Some(rows) => {
                write(rows);
                if rows.is_empty() {
                    self.objects.remove(obj);
                }
            }
            None if record.removes() => {}
            None => {
                let mut rows = ObjectRows::default();
                write(&mut rows);
                self.objects.insert(obj.clone(), rows);
            }
        }
    }

    fn len(&self) -> usize {
        self.objects.values().map(ObjectRows::len).sum::<usize>() + self.bounces.len()
    }

    fn keyed(&self) -> impl Iterator<Item = (RowKey, &Range<u64>)> + '_ {
        self.objects
            .iter()
            .flat_map(|(obj, rows)| rows.keyed(obj))
            .chain(
                self.bounces
                    .iter()
                    .map(|(op_id, at)| (RowKey::Bounce(op_id.clone()), at)),
            )
    }

    fn placed<E>(
        &self,
        mut place: impl FnMut(&Range<u64>) -> Result<Range<u64>, E>,
    ) -> Result<Self, E> {
        let objects = self
            .objects
            .iter()
            .map(|(obj, rows)| Ok((obj.clone(), rows.placed(&mut place)?)))
            .collect::<Result<_, E>>()?;
        let bounces = self
            .bounces
            .iter()
            .map(|(op_id, at)| Ok((op_id.clone(), place(at)?)))
            .collect::<Result<_, E>>()?;
        Ok(Self { objects, bounces })
    }
}

/// A row whose entry the index names is not where it says, or not that row's record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// The bytes at the entry's range do not decode as one record entry.
    #[error("the entry at {at:?} does not decode: {error}")]
    Entry {
        /// The range the index names.
        at: Range<u64>,
        /// Why the bytes are not one entry.
        error: LogError,
    },
    /// The bytes decode as an entry that is no record of the row.
    #[error("the entry at {at:?} is not the record of its row")]
    NotTheRow {
        /// The range the index names.
        at: Range<u64>,
    },
    /// A row before the compacted prefix's end has no place in the compacted file.
    #[error("the live row at {at:?} is not in the compacted file")]
    Unplaced {
        /// Its range in the old file.
        at: Range<u64>,
    },
}

impl LogIndex {
    /// An empty index (an empty file).
    pub fn new() -> Self {
        Self::default()
    }

    /// `peer` has committed (its rows may all be gone; a compaction keeps it known).
    pub fn known(&mut self, peer: &PeerId) {
        if !self.peers.contains_key(peer) {
            self.peers.insert(peer.clone(), PeerRows::default());
        }
    }

    /// `record` of `peer` was written (and committed) at `at`: its row lies there now, or, if
    /// the record removes it, nowhere.
    pub fn record(&mut self, peer: &PeerId, record: &Record, at: Range<u64>) {
        let rows = match self.peers.get_mut(peer) {
            Some(rows) => rows,
            None => self.peers.entry(peer.clone()).or_default(),
        };
        rows.record(record, at);
    }

    /// Every record of a commit a scan handed over, in order (a commit of no record still
    /// makes its peer known).
    pub fn scanned(&mut self, commit: &ScannedCommit) {
        let peer = PeerId::new(&commit.peer);
        self.known(&peer);
        for (record, at) in commit.records.iter().zip(&commit.records_at) {
            self.record(&peer, record, at.clone());
        }
    }

    /// Live rows across all peers.
    pub fn rows(&self) -> usize {
        self.peers.values().map(PeerRows::len).sum()
    }

    /// `peer`'s live rows with where their entries lie, in file order.
    pub fn entries(&self, peer: &PeerId) -> Vec<(RowKey, Range<u64>)> {
        let mut entries: Vec<(RowKey, Range<u64>)> = self
            .peers
            .get(peer)
            .into_iter()
            .flat_map(PeerRows::keyed)
            .map(|(key, at)| (key, at.clone()))
            .collect();
        entries.sort_unstable_by_key(|(_, at)| at.start);
        entries
    }

    /// The index of the file a compaction made: the rows that lay before `upto` in the old
    /// file moved where `moved` (old start, new start; sorted by old start) says, and the rows
    /// written after it (the commits made meanwhile, appended behind the snapshot at
    /// `appended_at`) moved with them.
    pub fn relocated(
        &self,
        upto: u64,
        appended_at: u64,
        moved: &[(u64, u64)],
    ) -> Result<LogIndex, IndexError> {
        let place = |at: &Range<u64>| {
            let length = at.end - at.start;
            let start = if at.start >= upto {
                at.start - upto + appended_at
            } else {
                match moved.binary_search_by_key(&at.start, |(old, _)| *old) {
                    Ok(found) => moved[found].1,
                    Err(_) => return Err(IndexError::Unplaced { at: at.clone() }),
                }
            };
            Ok(start..start + length)
        };
        let peers = self
            .peers
            .iter()
            .map(|(peer, rows)| Ok((peer.clone(), rows.placed(place)?)))
            .collect::<Result<_, IndexError>>()?;
        Ok(LogIndex { peers })
    }
}

/// Checks that `bytes`, read from `at` where the index places `key`'s row, are one whole
/// record entry of `format` that writes that row, and returns the record (a compaction copies
/// nothing it has not verified: damage is refused, never carried into the new file).
pub fn verify_entry(
    format: LogFormat,
    key: &RowKey,
    at: &Range<u64>,
    bytes: &[u8],
) -> Result<Record, IndexError> {
    let at = at.clone();
    match decode_entry(format, bytes) {
        Ok(Some((Entry::Record(record), used))) if used == bytes.len() => {
            if !record.removes() && record.row_key() == *key {
                Ok(record)
            } else {
                Err(IndexError::NotTheRow { at })
            }
        }
        Ok(_) => Err(IndexError::NotTheRow { at }),
        Err(error) => Err(IndexError::Entry { at, error }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::substrate::log::{
        encode_begin, encode_commit, encode_header, encode_record, scan, LOG_HEADER_BYTES,
    };
    use crate::substrate::{DurableState, ObjectRecord, ObjectState, Op, Side};
    use crate::time::Time;
    use crate::wire::envelope::ObjKind;
    use crate::wire::envelope::Verb;
    use bytes::Bytes;
    use proptest::prelude::*;

    fn op(obj: &str, seq: u64, body: u8) -> Op {
        Op {
            obj: Address::parse(obj).expect("an address"),
            seq: Seq(seq),
            id: format!("{obj}-{seq}").into(),
            verb: Verb::Send,
            obj_kind: None,
            body: Some(Bytes::from(vec![body; usize::from(body % 7)])),
            code: None,
            reason: None,
            cap: None,
            at: Time::from_millis(u64::from(body)),
        }
    }

    /// Puts and removals of every kind of row over a few rows, so rows are often written again.
    fn record() -> impl Strategy<Value = Record> {
        let obj = prop::sample::select(vec!["a", "b"]);
        prop_oneof![
            (obj.clone(), 0u64..3, any::<u8>()).prop_map(|(o, s, b)| Record::Outbox(op(o, s, b))),
            (obj.clone(), 0u64..3).prop_map(|(o, seq)| Record::OutboxRemoved {
                obj: Address::parse(o).expect("an address"),
                seq: Seq(seq)
            }),
            (obj.clone(), 0u64..3, any::<u8>()).prop_map(|(o, s, b)| Record::Inbox(op(o, s, b))),
            (obj.clone(), 0u64..3).prop_map(|(o, seq)| Record::InboxRemoved {
                obj: Address::parse(o).expect("an address"),
                seq: Seq(seq)
            }),
            (0u8..2).prop_map(|n| Record::Bounce {
                op_id: format!("x{n}").into(),
                code: "no_such_object".to_owned(),
                at: Time::from_millis(1),
            }),
            (0u8..2).prop_map(|n| Record::BounceRemoved {
                op_id: format!("x{n}").into()
            }),
            (obj.clone(), 0u64..3, any::<u8>()).prop_map(|(o, s, b)| Record::Held(op(o, s, b))),
            (obj.clone(), 0u64..3).prop_map(|(o, seq)| Record::HeldRemoved {
                obj: Address::parse(o).expect("an address"),
                seq: Seq(seq)
            }),
            (obj.clone(), 0u64..9).prop_map(|(o, next)| Record::Object(ObjectRecord {
                obj: Address::parse(o).expect("an address"),
                kind: ObjKind::Queue,
                opened_by: Side::Local,
                open_id: format!("open-{o}").into(),
                state: ObjectState::Live,
                tx_next: Seq(next),
                rx_next: Seq(0),
            })),
            obj.prop_map(|o| Record::ObjectRemoved {
                obj: Address::parse(o).expect("an address"),
            }),
        ]
    }

    /// A file of `commits` (peer number, records), as a log writer lays it out.
    fn file(format: LogFormat, commits: &[(u8, Vec<Record>)]) -> Vec<u8> {
        let mut out = Vec::new();
        encode_header(format, &mut out);
        for (peer, records) in commits {
            encode_begin(format, &format!("peer-{peer}"), &mut out);
            for record in records {
                encode_record(format, record, &mut out);
            }
            encode_commit(format, &mut out);
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// The index built from a file's scan names exactly the rows the replayed state holds,
        /// each at an entry that verifies as that row's last record. A compaction at any commit
        /// boundary (copying the live entries of the file up to it, one commit per peer in file
        /// order, then appending the commits made after it) gives a file that replays to the
        /// same state, and the index relocated as the store relocates it at the swap is the
        /// index of a scan of the new file.
        #[test]
        fn the_index_names_the_replayed_rows_and_a_compaction_at_any_point_keeps_them(
            commits in prop::collection::vec((0u8..3, prop::collection::vec(record(), 0..6)), 0..12),
            split in 0usize..13,
        ) {
            let format = LogFormat::new(7);
            let bytes = file(format, &commits);
            let split = split.min(commits.len());
            let mut index = LogIndex::new();
            let mut before = LogIndex::new();
            let mut upto = LOG_HEADER_BYTES as u64;
            let mut states: BTreeMap<PeerId, DurableState> = BTreeMap::new();
            let mut scanned = 0;
            scan(&bytes, |commit| {
                index.scanned(&commit);
                if scanned < split {
                    before.scanned(&commit);
                    upto = commit.at.end;
                }
                scanned += 1;
                states.entry(PeerId::new(&commit.peer)).or_default().apply_records(&commit.records);
            }).expect("a header").expect("whole");
            let rows: usize = states.values().map(DurableState::row_count).sum();
            prop_assert_eq!(index.rows(), rows);
            let mut copy = Vec::new();
            encode_header(format, &mut copy);
            let mut moved = Vec::new();
            let peers: Vec<PeerId> = before.peers.keys().cloned().collect();
            for peer in &peers {
                encode_begin(format, peer.as_str(), &mut copy);
                for (key, at) in before.entries(peer) {
                    let entry = &bytes[at.start as usize..at.end as usize];
                    verify_entry(format, &key, &at, entry).expect("the row's entry");
                    moved.push((at.start, copy.len() as u64));
                    copy.extend_from_slice(entry);
                }
                encode_commit(format, &mut copy);
            }
            let appended_at = copy.len() as u64;
            copy.extend_from_slice(&bytes[upto as usize..]);
            let mut again: BTreeMap<PeerId, DurableState> = BTreeMap::new();
            let mut reindexed = LogIndex::new();
            scan(&copy, |commit| {
                reindexed.scanned(&commit);
                again.entry(PeerId::new(&commit.peer)).or_default().apply_records(&commit.records);
            }).expect("a header").expect("whole");
            prop_assert_eq!(&again, &states);
            moved.sort_unstable();
            prop_assert_eq!(index.relocated(upto, appended_at, &moved).expect("placed"), reindexed);
        }
    }

    #[test]
    fn an_entry_that_is_not_its_rows_record_is_refused() {
        let format = LogFormat::new(3);
        let put = Record::Outbox(op("a", 1, 9));
        let mut bytes = Vec::new();
        encode_record(format, &put, &mut bytes);
        let at = 0..bytes.len() as u64;
        assert_eq!(
            verify_entry(format, &put.row_key(), &at, &bytes),
            Ok(put.clone())
        );
        let other = Record::Outbox(op("a", 2, 9)).row_key();
        assert_eq!(
            verify_entry(format, &other, &at, &bytes),
            Err(IndexError::NotTheRow { at: at.clone() })
        );
        bytes[12] ^= 1;
        assert!(matches!(
            verify_entry(format, &put.row_key(), &at, &bytes),
            Err(IndexError::Entry { .. })
        ));
        // Of another file (another salt): its checksum does not verify here.
        let mut foreign = Vec::new();
        encode_record(LogFormat::new(4), &put, &mut foreign);
        assert!(verify_entry(format, &put.row_key(), &at, &foreign).is_err());
        // A row the index moved nowhere is refused, not dropped.
        let mut index = LogIndex::new();
        index.record(&PeerId::new("p"), &put, 30..40);
        assert_eq!(
            index.relocated(100, 24, &[(20, 24)]),
            Err(IndexError::Unplaced { at: 30..40 })
        );
    }
}
