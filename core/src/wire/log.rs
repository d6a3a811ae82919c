//! The durable log: the substrate's [`Record`]s as an append-only file (the log store in
//! `tether::store`), one commit at a time.
//!
//! ```text
//! file    = header entry*
//! header  = magic "TTHRLOG\0" (8 bytes) | version u32 LE (1)
//! entry   = length u32 LE | crc32 of payload u32 LE | payload (length bytes)
//! payload = tag u8 | fields
//! commit  = Begin(peer) Record* Commit
//! ```
//!
//! A commit is durable once its `Commit` entry is: replay applies a peer's records only when
//! it reads the `Commit` that closes them. Integers are little-endian and fixed width; strings
//! and bodies are a u32 LE length then the bytes; an absent optional field is a 0 byte, a
//! present one a 1 byte then the field. Verbs and object kinds are their wire spellings.
//!
//! The decoder is total (every input gives an entry, "more bytes", or a typed error),
//! bounded (an entry's declared length is checked against [`LOG_ENTRY_BYTES_MAX`] before
//! anything is read or allocated; every field's length against what the entry holds) and
//! strict (unknown tags, bad UTF-8, out-of-range codes and bytes left over are errors).

use bytes::Bytes;

use crate::limits::LOG_ENTRY_BYTES_MAX;
use crate::substrate::{ObjectRecord, ObjectState, Op, Record, Side};
use crate::time::Time;
use crate::wire::envelope::{ObjKind, Verb};

/// The first bytes of a log file.
pub const LOG_MAGIC: [u8; 8] = *b"TTHRLOG\0";

/// The version of the format this module reads and writes.
pub const LOG_VERSION: u32 = 1;

/// Bytes of the file header: magic, then the version.
pub const LOG_HEADER_BYTES: usize = 12;

/// Bytes before an entry's payload: its length, then its checksum.
pub const LOG_ENTRY_HEADER_BYTES: usize = 8;

/// One entry of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A commit for `peer` starts.
    Begin {
        /// The peer the commit's records belong to.
        peer: String,
    },
    /// One durable change of the open commit.
    Record(Record),
    /// The open commit is complete.
    Commit,
}

/// Why bytes are not a log entry (or header).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    /// The file does not start with [`LOG_MAGIC`].
    #[error("not a tether log (bad magic)")]
    BadMagic,
    /// The file is of a version this module does not read.
    #[error("log version {0} (this tether reads version {LOG_VERSION})")]
    Version(u32),
    /// An entry declares more than [`LOG_ENTRY_BYTES_MAX`] bytes.
    #[error("entry of {0} bytes is over the bound")]
    TooLong(u64),
    /// An entry's checksum does not match its payload.
    #[error("entry checksum mismatch")]
    Checksum,
    /// The payload is not a valid entry.
    #[error("malformed entry: {0}")]
    Malformed(&'static str),
}

impl crate::wire::FormatError for LogError {
    fn is_fatal(&self) -> bool {
        true
    }

    fn kind(&self) -> &'static str {
        match self {
            LogError::BadMagic => "bad_magic",
            LogError::Version(_) => "version",
            LogError::TooLong(_) => "too_long",
            LogError::Checksum => "checksum",
            LogError::Malformed(_) => "malformed",
        }
    }
}

/// The file header.
pub fn encode_header(out: &mut Vec<u8>) {
    out.extend_from_slice(&LOG_MAGIC);
    out.extend_from_slice(&LOG_VERSION.to_le_bytes());
}

/// Checks a file's header: `Ok(None)` when `buf` is shorter than a header.
pub fn decode_header(buf: &[u8]) -> Result<Option<usize>, LogError> {
    let Some(header) = buf.get(..LOG_HEADER_BYTES) else {
        return Ok(None);
    };
    if header[..8] != LOG_MAGIC {
        return Err(LogError::BadMagic);
    }
    let version = u32::from_le_bytes(header[8..12].try_into().expect("four bytes"));
    if version != LOG_VERSION {
        return Err(LogError::Version(version));
    }
    Ok(Some(LOG_HEADER_BYTES))
}

const TAG_BEGIN: u8 = 1;
const TAG_COMMIT: u8 = 2;
const TAG_OBJECT: u8 = 3;
const TAG_OBJECT_REMOVED: u8 = 4;
const TAG_OUTBOX: u8 = 5;
const TAG_OUTBOX_REMOVED: u8 = 6;
const TAG_HELD: u8 = 7;
const TAG_HELD_REMOVED: u8 = 8;
const TAG_INBOX: u8 = 9;
const TAG_INBOX_REMOVED: u8 = 10;
const TAG_BOUNCE: u8 = 11;
const TAG_BOUNCE_REMOVED: u8 = 12;

/// Appends a `Begin` entry for `peer`.
pub fn encode_begin(peer: &str, out: &mut Vec<u8>) {
    entry(out, |p| {
        p.push(TAG_BEGIN);
        put_str(p, peer);
    });
}

/// Appends a `Commit` entry.
pub fn encode_commit(out: &mut Vec<u8>) {
    entry(out, |p| p.push(TAG_COMMIT));
}

/// Appends `record` as an entry.
pub fn encode_record(record: &Record, out: &mut Vec<u8>) {
    entry(out, |p| match record {
        Record::Object(object) => {
            p.push(TAG_OBJECT);
            put_str(p, &object.obj);
            put_str(p, object.kind.as_str());
            p.push(match object.opened_by {
                Side::Local => 0,
                Side::Remote => 1,
            });
            put_str(p, &object.open_id);
            let (state, at) = match object.state {
                ObjectState::Opening => (0, None),
                ObjectState::AwaitingAccept => (1, None),
                ObjectState::Live => (2, None),
                ObjectState::Closed(at) => (3, Some(at)),
                ObjectState::Rejected(at) => (4, Some(at)),
            };
            p.push(state);
            if let Some(at) = at {
                put_u64(p, at.as_millis());
            }
            put_u64(p, object.tx_next);
            put_u64(p, object.rx_next);
        }
        Record::ObjectRemoved { obj } => {
            p.push(TAG_OBJECT_REMOVED);
            put_str(p, obj);
        }
        Record::Outbox(op) => put_op(p, TAG_OUTBOX, op),
        Record::Held(op) => put_op(p, TAG_HELD, op),
        Record::Inbox(op) => put_op(p, TAG_INBOX, op),
        Record::OutboxRemoved { obj, seq } => put_removal(p, TAG_OUTBOX_REMOVED, obj, *seq),
        Record::HeldRemoved { obj, seq } => put_removal(p, TAG_HELD_REMOVED, obj, *seq),
        Record::InboxRemoved { obj, seq } => put_removal(p, TAG_INBOX_REMOVED, obj, *seq),
        Record::Bounce { op_id, code, at } => {
            p.push(TAG_BOUNCE);
            put_str(p, op_id);
            put_str(p, code);
            put_u64(p, at.as_millis());
        }
        Record::BounceRemoved { op_id } => {
            p.push(TAG_BOUNCE_REMOVED);
            put_str(p, op_id);
        }
    });
}

/// Takes the entry at the front of `buf`: `Ok(None)` when `buf` holds less than a whole entry,
/// else the entry and the bytes it took. Bodies are slices of `buf` copied once into [`Bytes`].
pub fn decode_entry(buf: &[u8]) -> Result<Option<(Entry, usize)>, LogError> {
    let Some(header) = buf.get(..LOG_ENTRY_HEADER_BYTES) else {
        return Ok(None);
    };
    let length = u32::from_le_bytes(header[..4].try_into().expect("four bytes"));
    let checksum = u32::from_le_bytes(header[4..].try_into().expect("four bytes"));
    if length as usize > LOG_ENTRY_BYTES_MAX {
        return Err(LogError::TooLong(u64::from(length)));
    }
    let end = LOG_ENTRY_HEADER_BYTES + length as usize;
    let Some(payload) = buf.get(LOG_ENTRY_HEADER_BYTES..end) else {
        return Ok(None);
    };
    if crc32fast::hash(payload) != checksum {
        return Err(LogError::Checksum);
    }
    let mut reader = Reader { rest: payload };
    let entry = reader.entry()?;
    if !reader.rest.is_empty() {
        return Err(LogError::Malformed("bytes after the entry"));
    }
    Ok(Some((entry, end)))
}

/// Writes one entry: a placeholder header, the payload `fill` writes, then the real header.
fn entry(out: &mut Vec<u8>, fill: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0; LOG_ENTRY_HEADER_BYTES]);
    fill(out);
    let payload = &out[start + LOG_ENTRY_HEADER_BYTES..];
    // Payloads past u32 cannot be written; the store refuses records over the bound first.
    let length = u32::try_from(payload.len()).unwrap_or(u32::MAX);
    let checksum = crc32fast::hash(payload);
    out[start..start + 4].copy_from_slice(&length.to_le_bytes());
    out[start + 4..start + 8].copy_from_slice(&checksum.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, value: u64) {
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    let length = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&length.to_le_bytes());
    out.extend_from_slice(bytes);
}

fn put_str(out: &mut Vec<u8>, text: &str) {
    put_bytes(out, text.as_bytes());
}

fn put_opt_str(out: &mut Vec<u8>, text: Option<&str>) {
    match text {
        None => out.push(0),
        Some(text) => {
            out.push(1);
            put_str(out, text);
        }
    }
}

fn put_op(out: &mut Vec<u8>, tag: u8, op: &Op) {
    out.push(tag);
    put_str(out, &op.obj);
    put_u64(out, op.seq);
    put_str(out, &op.id);
    put_str(out, op.verb.as_str());
    put_opt_str(out, op.obj_kind.map(ObjKind::as_str));
    match &op.body {
        None => out.push(0),
        Some(body) => {
            out.push(1);
            put_bytes(out, body);
        }
    }
    put_opt_str(out, op.code.as_deref());
    put_opt_str(out, op.reason.as_deref());
    put_opt_str(out, op.cap.as_deref());
    put_u64(out, op.at.as_millis());
}

fn put_removal(out: &mut Vec<u8>, tag: u8, obj: &str, seq: u64) {
    out.push(tag);
    put_str(out, obj);
    put_u64(out, seq);
}

/// Reads fields off the front of one entry's payload.
struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], LogError> {
        if self.rest.len() < n {
            return Err(LogError::Malformed("a field runs past the entry"));
        }
        let (taken, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(taken)
    }

    fn u8(&mut self) -> Result<u8, LogError> {
        Ok(self.take(1)?[0])
    }

    fn u64(&mut self) -> Result<u64, LogError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("eight bytes"),
        ))
    }

    fn bytes(&mut self) -> Result<&'a [u8], LogError> {
        let length = u32::from_le_bytes(self.take(4)?.try_into().expect("four bytes"));
        self.take(length as usize)
    }

    fn string(&mut self) -> Result<String, LogError> {
        std::str::from_utf8(self.bytes()?)
            .map(str::to_owned)
            .map_err(|_| LogError::Malformed("a string is not UTF-8"))
    }

    fn present(&mut self) -> Result<bool, LogError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(LogError::Malformed(
                "an optional field's marker is not 0 or 1",
            )),
        }
    }

    fn opt_string(&mut self) -> Result<Option<String>, LogError> {
        if self.present()? {
            self.string().map(Some)
        } else {
            Ok(None)
        }
    }

    fn time(&mut self) -> Result<Time, LogError> {
        self.u64().map(Time::from_millis)
    }

    fn kind(&mut self) -> Result<ObjKind, LogError> {
        std::str::from_utf8(self.bytes()?)
            .ok()
            .and_then(ObjKind::parse)
            .ok_or(LogError::Malformed("unknown object kind"))
    }

    fn entry(&mut self) -> Result<Entry, LogError> {
        let record = match self.u8()? {
            TAG_BEGIN => {
                return Ok(Entry::Begin {
                    peer: self.string()?,
                })
            }
            TAG_COMMIT => return Ok(Entry::Commit),
            TAG_OBJECT => {
                let obj = self.string()?;
                let kind = self.kind()?;
                let opened_by = match self.u8()? {
                    0 => Side::Local,
                    1 => Side::Remote,
                    _ => return Err(LogError::Malformed("unknown side")),
                };
                let open_id = self.string()?;
                let state = match self.u8()? {
                    0 => ObjectState::Opening,
                    1 => ObjectState::AwaitingAccept,
                    2 => ObjectState::Live,
                    3 => ObjectState::Closed(self.time()?),
                    4 => ObjectState::Rejected(self.time()?),
                    _ => return Err(LogError::Malformed("unknown object state")),
                };
                Record::Object(ObjectRecord {
                    obj,
                    kind,
                    opened_by,
                    open_id,
                    state,
                    tx_next: self.u64()?,
                    rx_next: self.u64()?,
                })
            }
            TAG_OBJECT_REMOVED => Record::ObjectRemoved {
                obj: self.string()?,
            },
            TAG_OUTBOX => Record::Outbox(self.op()?),
            TAG_HELD => Record::Held(self.op()?),
            TAG_INBOX => Record::Inbox(self.op()?),
            TAG_OUTBOX_REMOVED => Record::OutboxRemoved {
                obj: self.string()?,
                seq: self.u64()?,
            },
            TAG_HELD_REMOVED => Record::HeldRemoved {
                obj: self.string()?,
                seq: self.u64()?,
            },
            TAG_INBOX_REMOVED => Record::InboxRemoved {
                obj: self.string()?,
                seq: self.u64()?,
            },
            TAG_BOUNCE => Record::Bounce {
                op_id: self.string()?,
                code: self.string()?,
                at: self.time()?,
            },
            TAG_BOUNCE_REMOVED => Record::BounceRemoved {
                op_id: self.string()?,
            },
            _ => return Err(LogError::Malformed("unknown entry tag")),
        };
        Ok(Entry::Record(record))
    }

    fn op(&mut self) -> Result<Op, LogError> {
        let obj = self.string()?;
        let seq = self.u64()?;
        let id = self.string()?;
        let verb = std::str::from_utf8(self.bytes()?)
            .ok()
            .and_then(Verb::parse)
            .ok_or(LogError::Malformed("unknown verb"))?;
        let obj_kind = if self.present()? {
            Some(self.kind()?)
        } else {
            None
        };
        let body = if self.present()? {
            Some(Bytes::copy_from_slice(self.bytes()?))
        } else {
            None
        };
        Ok(Op {
            obj,
            seq,
            id,
            verb,
            obj_kind,
            body,
            code: self.opt_string()?,
            reason: self.opt_string()?,
            cap: self.opt_string()?,
            at: self.time()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn op(verb: Verb, body: Option<&[u8]>) -> Op {
        Op {
            obj: "q".to_owned(),
            seq: 7,
            id: "m-1".to_owned(),
            verb,
            obj_kind: (verb == Verb::Open).then_some(ObjKind::Queue),
            body: body.map(Bytes::copy_from_slice),
            code: None,
            reason: None,
            cap: None,
            at: Time::from_millis(258),
        }
    }

    fn decode_all(mut buf: &[u8]) -> Vec<Entry> {
        let mut entries = Vec::new();
        while let Some((entry, used)) = decode_entry(buf).expect("decodes") {
            entries.push(entry);
            buf = &buf[used..];
        }
        assert!(buf.is_empty(), "{} bytes left", buf.len());
        entries
    }

    /// Golden bytes: a header and a commit of one send for peer "p".
    #[test]
    fn golden_bytes_of_a_commit() {
        let mut out = Vec::new();
        encode_header(&mut out);
        encode_begin("p", &mut out);
        encode_record(&Record::Outbox(op(Verb::Send, Some(b"hi"))), &mut out);
        encode_commit(&mut out);
        let expected = concat!(
            "545448524c4f4700", // magic
            "01000000",         // version 1
            // Begin "p": length 6, crc, tag 1, "p"
            "06000000",
            "8a2afb17",
            "01",
            "0100000070",
            // Outbox: length 48
            "30000000",
            "2085e5d0",
            "05",               // tag
            "0100000071",       // obj "q"
            "0700000000000000", // seq 7
            "030000006d2d31",   // id "m-1"
            "0400000073656e64", // verb "send"
            "00",               // no object kind
            "01020000006869",   // body "hi"
            "00",               // no code
            "00",               // no reason
            "00",               // no cap
            "0201000000000000", // at 258 ms
            // Commit: length 1, crc, tag 2
            "01000000",
            "a18e0c3c",
            "02",
        );
        assert_eq!(hex::encode(&out), expected);
        assert_eq!(decode_header(&out), Ok(Some(LOG_HEADER_BYTES)));
        assert_eq!(
            decode_all(&out[LOG_HEADER_BYTES..]),
            vec![
                Entry::Begin {
                    peer: "p".to_owned()
                },
                Entry::Record(Record::Outbox(op(Verb::Send, Some(b"hi")))),
                Entry::Commit,
            ]
        );
    }

    #[test]
    fn a_bad_header_is_refused() {
        let mut out = Vec::new();
        encode_header(&mut out);
        assert_eq!(decode_header(&out[..11]), Ok(None));
        let mut other = out.clone();
        other[0] = b'X';
        assert_eq!(decode_header(&other), Err(LogError::BadMagic));
        out[8] = 2;
        assert_eq!(decode_header(&out), Err(LogError::Version(2)));
    }

    #[test]
    fn a_cut_entry_asks_for_more_and_a_damaged_one_is_refused() {
        let mut out = Vec::new();
        encode_record(&Record::Inbox(op(Verb::Send, Some(b"body"))), &mut out);
        for cut in 0..out.len() {
            assert_eq!(decode_entry(&out[..cut]), Ok(None), "cut at {cut}");
        }
        for at in LOG_ENTRY_HEADER_BYTES..out.len() {
            let mut damaged = out.clone();
            damaged[at] ^= 0x40;
            assert_eq!(decode_entry(&damaged), Err(LogError::Checksum), "byte {at}");
        }
        let mut long = out.clone();
        long[..4].copy_from_slice(&(LOG_ENTRY_BYTES_MAX as u32 + 1).to_le_bytes());
        assert_eq!(
            decode_entry(&long),
            Err(LogError::TooLong(LOG_ENTRY_BYTES_MAX as u64 + 1))
        );
    }

    /// An entry whose checksum is right but whose payload is not a record.
    fn sealed(payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        entry(&mut out, |p| p.extend_from_slice(payload));
        out
    }

    #[test]
    fn strict_payloads() {
        for (payload, why) in [
            (&[][..], "a field runs past the entry"),
            (&[99][..], "unknown entry tag"),
            (&[TAG_COMMIT, 0][..], "bytes after the entry"),
            (&[TAG_BEGIN, 1, 0, 0, 0, 0xff][..], "a string is not UTF-8"),
            (
                &[TAG_BEGIN, 9, 0, 0, 0, b'a'][..],
                "a field runs past the entry",
            ),
        ] {
            assert_eq!(
                decode_entry(&sealed(payload)),
                Err(LogError::Malformed(why)),
                "{payload:?}"
            );
        }
        let mut bad_marker = Vec::new();
        put_op(&mut bad_marker, TAG_OUTBOX, &op(Verb::Send, None));
        // The obj_kind marker follows obj (5), seq (8), id (7), verb (8) after the tag.
        bad_marker[1 + 5 + 8 + 7 + 8] = 2;
        assert_eq!(
            decode_entry(&sealed(&bad_marker)),
            Err(LogError::Malformed(
                "an optional field's marker is not 0 or 1"
            ))
        );
    }

    pub(crate) fn record() -> impl Strategy<Value = Record> {
        let text = "[a-z/.]{0,6}";
        let time = any::<u64>().prop_map(Time::from_millis);
        let verb = prop::sample::select(Verb::ALL.to_vec());
        let kind = prop::sample::select(vec![ObjKind::Session, ObjKind::Queue]);
        let op = (
            (text, any::<u64>(), text, verb),
            prop::option::of(kind.clone()),
            prop::option::of(prop::collection::vec(any::<u8>(), 0..32)),
            (
                prop::option::of(text),
                prop::option::of(text),
                prop::option::of(text),
            ),
            time.clone(),
        )
            .prop_map(
                |((obj, seq, id, verb), obj_kind, body, (code, reason, cap), at)| Op {
                    obj,
                    seq,
                    id,
                    verb,
                    obj_kind,
                    body: body.map(Bytes::from),
                    code,
                    reason,
                    cap,
                    at,
                },
            );
        let state = prop_oneof![
            Just(ObjectState::Opening),
            Just(ObjectState::AwaitingAccept),
            Just(ObjectState::Live),
            time.clone().prop_map(ObjectState::Closed),
            time.clone().prop_map(ObjectState::Rejected),
        ];
        let side = prop::sample::select(vec![Side::Local, Side::Remote]);
        prop_oneof![
            (text, kind, side, text, state, any::<u64>(), any::<u64>()).prop_map(
                |(obj, kind, opened_by, open_id, state, tx_next, rx_next)| {
                    Record::Object(ObjectRecord {
                        obj,
                        kind,
                        opened_by,
                        open_id,
                        state,
                        tx_next,
                        rx_next,
                    })
                }
            ),
            text.prop_map(|obj| Record::ObjectRemoved { obj }),
            op.clone().prop_map(Record::Outbox),
            op.clone().prop_map(Record::Held),
            op.prop_map(Record::Inbox),
            (text, any::<u64>()).prop_map(|(obj, seq)| Record::OutboxRemoved { obj, seq }),
            (text, any::<u64>()).prop_map(|(obj, seq)| Record::HeldRemoved { obj, seq }),
            (text, any::<u64>()).prop_map(|(obj, seq)| Record::InboxRemoved { obj, seq }),
            (text, text, time).prop_map(|(op_id, code, at)| Record::Bounce { op_id, code, at }),
            text.prop_map(|op_id| Record::BounceRemoved { op_id }),
        ]
    }

    proptest! {
        /// Every record survives the trip, whole, and a commit's entries come back in order.
        #[test]
        fn records_round_trip(peer in "[a-z0-9]{0,12}", records in prop::collection::vec(record(), 0..8)) {
            let mut out = Vec::new();
            encode_begin(&peer, &mut out);
            for record in &records {
                encode_record(record, &mut out);
            }
            encode_commit(&mut out);
            let mut expected = vec![Entry::Begin { peer }];
            expected.extend(records.into_iter().map(Entry::Record));
            expected.push(Entry::Commit);
            prop_assert_eq!(decode_all(&out), expected);
        }

        /// Any bytes: an entry, a request for more, or a typed error; never a panic, and an
        /// entry never claims more bytes than it was given.
        #[test]
        fn any_bytes_decode_totally(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(Some((_, used))) = decode_entry(&bytes) {
                prop_assert!(used <= bytes.len());
            }
            let _ = decode_header(&bytes);
        }
    }
}
