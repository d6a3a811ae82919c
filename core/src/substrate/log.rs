//! The durable log: the substrate's [`Record`]s as an append-only file (the log store in
//! `tether::store`), one commit at a time.
//!
//! ```text
//! file    = header entry*
//! header  = magic "TTHRLOG\0" (8 bytes) | version u32 LE (2) | salt u64 LE
//!           | crc32 of the 20 bytes before u32 LE                       (version 2, 24 bytes)
//!         = magic | version u32 LE (1)                                   (version 1, 12 bytes)
//! entry   = length u32 LE | checksum u32 LE | payload (length bytes)
//! payload = tag u8 | fields
//! commit  = Begin(peer) Record* Commit
//! ```
//!
//! In version 2 an entry's checksum is the CRC-32 of the file's salt, the entry's length and
//! its payload (whose first byte is its kind), so a flipped length is caught as surely as a
//! flipped body, and bytes that were never written by this file's writer (a payload that
//! embeds a well-formed entry, a stale block of another file) do not verify: the salt is
//! random, chosen when the file is created and kept across its compactions. Version 1 (the
//! CRC-32 of the payload alone, no salt) is still read; the store rewrites such a file in
//! version 2 when it opens it.
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
//!
//! [`scan`] reads a whole file: every commit that verifies, where the bytes that do not
//! verify lie, and whether they are a torn tail (after the last complete commit: a commit a
//! crash cut short, never acknowledged) or damage (followed by commits that verify: something
//! changed bytes that were once acknowledged).

use std::ops::Range;

use bytes::Bytes;

pub mod index;

pub use index::{verify_entry, IndexError, LogIndex};

use super::{ObjectRecord, ObjectState, Op, Record, Seq, Side};
use crate::limits::LOG_ENTRY_BYTES_MAX;
use crate::time::Time;
use crate::wire::envelope::{Address, ObjKind, OpId, Verb};

/// The first bytes of a log file.
pub const LOG_MAGIC: [u8; 8] = *b"TTHRLOG\0";

/// The version of the format this module writes.
pub const LOG_VERSION: u32 = 2;

/// The first version, still read: no salt, an entry's checksum covers its payload only.
pub const LOG_VERSION_1: u32 = 1;

/// Bytes of a version 2 file header: magic, version, salt, the header's checksum.
pub const LOG_HEADER_BYTES: usize = 24;

/// Bytes of a version 1 file header: magic, then the version.
pub const LOG_HEADER_V1_BYTES: usize = 12;

/// Bytes before an entry's payload: its length, then its checksum.
pub const LOG_ENTRY_HEADER_BYTES: usize = 8;

/// How one log file spells its entries: its version and (from version 2) its salt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LogFormat {
    version: u32,
    salt: u64,
}

impl LogFormat {
    /// Version 1: no salt, checksums over payloads only (read, never written by this tether).
    pub const V1: LogFormat = LogFormat {
        version: LOG_VERSION_1,
        salt: 0,
    };

    /// The current version with `salt` (chosen at random when a file is created).
    pub fn new(salt: u64) -> Self {
        Self {
            version: LOG_VERSION,
            salt,
        }
    }

    /// The format's version.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The file's salt (0 in version 1).
    pub fn salt(&self) -> u64 {
        self.salt
    }

    /// Bytes of this format's file header.
    pub fn header_bytes(&self) -> usize {
        if self.version == LOG_VERSION_1 {
            LOG_HEADER_V1_BYTES
        } else {
            LOG_HEADER_BYTES
        }
    }

    /// An entry's checksum: version 2 covers the salt, the length and the payload.
    fn checksum(&self, length: u32, payload: &[u8]) -> u32 {
        if self.version == LOG_VERSION_1 {
            return crc32fast::hash(payload);
        }
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&self.salt.to_le_bytes());
        hasher.update(&length.to_le_bytes());
        hasher.update(payload);
        hasher.finalize()
    }
}

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
    #[error("log version {0} (this tether reads versions 1 and {LOG_VERSION})")]
    Version(u32),
    /// The file header's checksum does not match it.
    #[error("the log's header fails its checksum")]
    HeaderChecksum,
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
            LogError::HeaderChecksum => "header_checksum",
            LogError::TooLong(_) => "too_long",
            LogError::Checksum => "checksum",
            LogError::Malformed(_) => "malformed",
        }
    }
}

/// The file header of `format`.
pub fn encode_header(format: LogFormat, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&LOG_MAGIC);
    out.extend_from_slice(&format.version.to_le_bytes());
    if format.version != LOG_VERSION_1 {
        out.extend_from_slice(&format.salt.to_le_bytes());
        let checksum = crc32fast::hash(&out[start..]);
        out.extend_from_slice(&checksum.to_le_bytes());
    }
}

/// Checks a file's header: its format and length, or `Ok(None)` when `buf` is shorter than
/// the header its first bytes announce.
pub fn decode_header(buf: &[u8]) -> Result<Option<(LogFormat, usize)>, LogError> {
    let magic = &buf[..buf.len().min(LOG_MAGIC.len())];
    if magic != &LOG_MAGIC[..magic.len()] {
        return Err(LogError::BadMagic);
    }
    let Some(version) = buf.get(8..12) else {
        return Ok(None);
    };
    match u32::from_le_bytes(version.try_into().expect("four bytes")) {
        LOG_VERSION_1 => Ok(Some((LogFormat::V1, LOG_HEADER_V1_BYTES))),
        LOG_VERSION => {
            let Some(header) = buf.get(..LOG_HEADER_BYTES) else {
                return Ok(None);
            };
            let checksum = u32::from_le_bytes(header[20..].try_into().expect("four bytes"));
            if crc32fast::hash(&header[..20]) != checksum {
                return Err(LogError::HeaderChecksum);
            }
            let salt = u64::from_le_bytes(header[12..20].try_into().expect("eight bytes"));
            Ok(Some((LogFormat::new(salt), LOG_HEADER_BYTES)))
        }
        other => Err(LogError::Version(other)),
    }
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
pub fn encode_begin(format: LogFormat, peer: &str, out: &mut Vec<u8>) {
    begin_in(format, peer, out);
}

/// Appends a `Commit` entry.
pub fn encode_commit(format: LogFormat, out: &mut Vec<u8>) {
    commit_in(format, out);
}

/// Appends `record` as an entry.
pub fn encode_record(format: LogFormat, record: &Record, out: &mut Vec<u8>) {
    record_in(format, record, out);
}

/// The bytes [`encode_begin`] appends for `peer`.
pub fn encoded_begin_len(peer: &str) -> usize {
    let mut count = Count(0);
    begin_in(LogFormat::V1, peer, &mut count);
    count.0
}

/// The bytes [`encode_commit`] appends.
pub fn encoded_commit_len() -> usize {
    let mut count = Count(0);
    commit_in(LogFormat::V1, &mut count);
    count.0
}

/// The bytes [`encode_record`] appends for `record`, counted by the code that writes them, so
/// a commit can be sized (and a buffer laid out for it) before it is encoded.
pub fn encoded_record_len(record: &Record) -> usize {
    let mut count = Count(0);
    record_in(LogFormat::V1, record, &mut count);
    count.0
}

/// Where an entry's bytes go: a buffer, or a count of them. Encoding and sizing run the same
/// code, so they cannot disagree.
trait Sink {
    fn len(&self) -> usize;
    fn push(&mut self, byte: u8);
    fn put(&mut self, bytes: &[u8]);
    /// Seals the entry begun at `start`: its header's length and checksum.
    fn seal(&mut self, format: LogFormat, start: usize);
}

impl Sink for Vec<u8> {
    fn len(&self) -> usize {
        Vec::len(self)
    }

    fn push(&mut self, byte: u8) {
        Vec::push(self, byte);
    }

    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }

    fn seal(&mut self, format: LogFormat, start: usize) {
        let payload = &self[start + LOG_ENTRY_HEADER_BYTES..];
        // Payloads past u32 cannot be written; the store refuses records over the bound first.
        let length = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        let checksum = format.checksum(length, payload);
        self[start..start + 4].copy_from_slice(&length.to_le_bytes());
        self[start + 4..start + 8].copy_from_slice(&checksum.to_le_bytes());
    }
}

/// Counts the bytes an encoding would append.
struct Count(usize);

impl Sink for Count {
    fn len(&self) -> usize {
        self.0
    }

    fn push(&mut self, _: u8) {
        self.0 += 1;
    }

    fn put(&mut self, bytes: &[u8]) {
        self.0 += bytes.len();
    }

    fn seal(&mut self, _: LogFormat, _: usize) {}
}

fn begin_in(format: LogFormat, peer: &str, out: &mut impl Sink) {
    entry(format, out, |p| {
        p.push(TAG_BEGIN);
        put_str(p, peer);
    });
}

fn commit_in(format: LogFormat, out: &mut impl Sink) {
    entry(format, out, |p| p.push(TAG_COMMIT));
}

fn record_in<S: Sink>(format: LogFormat, record: &Record, out: &mut S) {
    entry(format, out, |p: &mut S| match record {
        Record::Object(object) => {
            p.push(TAG_OBJECT);
            put_bytes(p, object.obj.as_bytes());
            put_str(p, object.kind.as_str());
            p.push(match object.opened_by {
                Side::Local => 0,
                Side::Remote => 1,
            });
            put_bytes(p, object.open_id.as_bytes());
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
            put_u64(p, object.tx_next.get());
            put_u64(p, object.rx_next.get());
        }
        Record::ObjectRemoved { obj } => {
            p.push(TAG_OBJECT_REMOVED);
            put_bytes(p, obj.as_bytes());
        }
        Record::Outbox(op) => put_op(p, TAG_OUTBOX, op),
        Record::Held(op) => put_op(p, TAG_HELD, op),
        Record::Inbox(op) => put_op(p, TAG_INBOX, op),
        Record::OutboxRemoved { obj, seq } => put_removal(p, TAG_OUTBOX_REMOVED, obj, *seq),
        Record::HeldRemoved { obj, seq } => put_removal(p, TAG_HELD_REMOVED, obj, *seq),
        Record::InboxRemoved { obj, seq } => put_removal(p, TAG_INBOX_REMOVED, obj, *seq),
        Record::Bounce { op_id, code, at } => {
            p.push(TAG_BOUNCE);
            put_bytes(p, op_id.as_bytes());
            put_str(p, code);
            put_u64(p, at.as_millis());
        }
        Record::BounceRemoved { op_id } => {
            p.push(TAG_BOUNCE_REMOVED);
            put_bytes(p, op_id.as_bytes());
        }
    });
}

/// Takes the entry at the front of `buf`: `Ok(None)` when `buf` holds less than a whole entry,
/// else the entry and the bytes it took. Bodies are slices of `buf` copied once into [`Bytes`].
pub fn decode_entry(format: LogFormat, buf: &[u8]) -> Result<Option<(Entry, usize)>, LogError> {
    decode_entry_in(format, buf, None)
}

/// [`decode_entry`]; with `shared`, the buffer `buf` lies in, a body is a slice of it instead
/// of a copy.
fn decode_entry_in(
    format: LogFormat,
    buf: &[u8],
    shared: Option<&Bytes>,
) -> Result<Option<(Entry, usize)>, LogError> {
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
    if format.checksum(length, payload) != checksum {
        return Err(LogError::Checksum);
    }
    let mut reader = Reader {
        rest: payload,
        shared,
    };
    let entry = reader.entry()?;
    if !reader.rest.is_empty() {
        return Err(LogError::Malformed("bytes after the entry"));
    }
    Ok(Some((entry, end)))
}

/// One commit that verifies, as [`scan`] hands it over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedCommit {
    /// The peer whose records these are.
    pub peer: String,
    /// The records, in the order they were written.
    pub records: Vec<Record>,
    /// Where each record's entry lies in the file, in the same order.
    pub records_at: Vec<Range<u64>>,
    /// Where the commit lies in the file, from its `Begin` to the end of its `Commit`.
    pub at: Range<u64>,
}

/// What [`scan`] found in a whole log file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogScan {
    /// The file's format.
    pub format: LogFormat,
    /// Commits that verify.
    pub commits: u64,
    /// The end of the last commit that verifies (the header's end when none does): where the
    /// next commit is written.
    pub end: u64,
    /// Byte ranges before `end` that belong to no commit that verifies, in file order: damage
    /// to bytes that were once part of acknowledged commits. Empty for a sound file.
    pub damaged: Vec<Range<u64>>,
    /// Bytes after `end`.
    pub tail: u64,
    /// Those bytes are zeros only: space prepared ahead of commits, not a torn commit.
    pub tail_zeros: bool,
}

impl LogScan {
    /// No byte before the last commit that verifies is damaged.
    pub fn is_sound(&self) -> bool {
        self.damaged.is_empty()
    }

    /// Bytes of damage in all.
    pub fn damaged_bytes(&self) -> u64 {
        bytes_in(&self.damaged)
    }
}

/// Bytes in all of `ranges`.
pub fn bytes_in(ranges: &[Range<u64>]) -> u64 {
    ranges.iter().map(|range| range.end - range.start).sum()
}

/// Reads a whole log file, handing every commit that verifies to `on_commit` in file order.
///
/// A commit verifies when its `Begin`, every record and its `Commit` decode with their
/// checksums, one right after the other. Where no commit verifies at the next offset, the scan
/// looks for the next offset at which one does (every byte is tried: a damaged length cannot
/// be trusted to skip by); the bytes in between are damage when it finds one, and the tail
/// (a commit a crash cut short, which was never acknowledged) when it does not.
///
/// `Ok(None)` when `bytes` is empty or the start of a header (a file created but never
/// committed to). A header that is not a tether log's, of an unknown version, or that fails its
/// checksum is an error: nothing in the file can be read.
pub fn scan(
    bytes: &[u8],
    on_commit: impl FnMut(ScannedCommit),
) -> Result<Option<LogScan>, LogError> {
    scan_in(bytes, None, on_commit)
}

/// [`scan`] of a buffer the caller shares: every body handed over is a slice of `bytes`, not a
/// copy (for a replay whose state is dropped soon, as a compaction's: a slice keeps the whole
/// buffer alive).
pub fn scan_shared(
    bytes: &Bytes,
    on_commit: impl FnMut(ScannedCommit),
) -> Result<Option<LogScan>, LogError> {
    scan_in(bytes, Some(bytes), on_commit)
}

fn scan_in(
    bytes: &[u8],
    shared: Option<&Bytes>,
    mut on_commit: impl FnMut(ScannedCommit),
) -> Result<Option<LogScan>, LogError> {
    let Some((format, start)) = decode_header(bytes)? else {
        return Ok(None);
    };
    let mut at = start;
    let mut end = start;
    let mut commits = 0;
    let mut damaged = Vec::new();
    while at < bytes.len() {
        if let Some(commit) = commit_at(format, bytes, at, shared) {
            at = usize::try_from(commit.at.end).expect("within the buffer");
            end = at;
            commits += 1;
            on_commit(commit);
            continue;
        }
        // Version 1 has no salt: a body can hold bytes that verify as a whole commit, so a
        // version 1 file is never searched past its first failure (what follows is its tail,
        // as that version always read it).
        if is_zeros(&bytes[at..]) || format.version() == LOG_VERSION_1 {
            break;
        }
        match (at + 1..bytes.len())
            .filter(|from| could_begin(bytes, *from))
            .find(|from| commit_at(format, bytes, *from, None).is_some())
        {
            Some(next) => {
                damaged.push(at as u64..next as u64);
                at = next;
            }
            None => break,
        }
    }
    Ok(Some(LogScan {
        format,
        commits,
        end: end as u64,
        damaged,
        tail: (bytes.len() - end) as u64,
        tail_zeros: is_zeros(&bytes[end..]),
    }))
}

/// The longest `Begin` entry: its tag, a peer id's length and the longest peer id a log
/// holds (a resync candidate declaring more is no `Begin`, and costs no checksum).
const BEGIN_PAYLOAD_BYTES_MAX: usize = 1 + 4 + 4096;

/// Whether an entry starting at `at` could be a `Begin`: its declared length fits one and its
/// first payload byte is the tag. A cheap filter before any checksum, so that looking for the
/// next commit costs a few byte reads per offset whatever the bytes hold.
fn could_begin(bytes: &[u8], at: usize) -> bool {
    let Some(header) = bytes.get(at..at + LOG_ENTRY_HEADER_BYTES + 1) else {
        return false;
    };
    let length = u32::from_le_bytes(header[..4].try_into().expect("four bytes")) as usize;
    (5..=BEGIN_PAYLOAD_BYTES_MAX).contains(&length) && header[LOG_ENTRY_HEADER_BYTES] == TAG_BEGIN
}

/// The commit that starts at `at` and verifies whole, if one does.
fn commit_at(
    format: LogFormat,
    bytes: &[u8],
    at: usize,
    shared: Option<&Bytes>,
) -> Option<ScannedCommit> {
    let (Entry::Begin { peer }, used) = decode_entry_in(format, &bytes[at..], shared).ok()?? else {
        return None;
    };
    let mut next = at + used;
    let mut records = Vec::new();
    let mut records_at = Vec::new();
    loop {
        match decode_entry_in(format, &bytes[next..], shared).ok()?? {
            (Entry::Record(record), used) => {
                records.push(record);
                records_at.push(next as u64..(next + used) as u64);
                next += used;
            }
            (Entry::Commit, used) => {
                return Some(ScannedCommit {
                    peer,
                    records,
                    records_at,
                    at: at as u64..(next + used) as u64,
                })
            }
            (Entry::Begin { .. }, _) => return None,
        }
    }
}

fn is_zeros(bytes: &[u8]) -> bool {
    bytes.iter().all(|byte| *byte == 0)
}

/// Writes one entry: a placeholder header, the payload `fill` writes, then the real header.
fn entry<S: Sink>(format: LogFormat, out: &mut S, fill: impl FnOnce(&mut S)) {
    let start = out.len();
    out.put(&[0; LOG_ENTRY_HEADER_BYTES]);
    fill(out);
    out.seal(format, start);
}

fn put_u64(out: &mut impl Sink, value: u64) {
    out.put(&value.to_le_bytes());
}

fn put_bytes(out: &mut impl Sink, bytes: &[u8]) {
    let length = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    out.put(&length.to_le_bytes());
    out.put(bytes);
}

fn put_str(out: &mut impl Sink, text: &str) {
    put_bytes(out, text.as_bytes());
}

fn put_opt_str(out: &mut impl Sink, text: Option<&str>) {
    match text {
        None => out.push(0),
        Some(text) => {
            out.push(1);
            put_str(out, text);
        }
    }
}

fn put_op(out: &mut impl Sink, tag: u8, op: &Op) {
    out.push(tag);
    // Addresses and ids as their bytes: `as_str` would check text held in place as UTF-8.
    put_bytes(out, op.obj.as_bytes());
    put_u64(out, op.seq.get());
    put_bytes(out, op.id.as_bytes());
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

fn put_removal(out: &mut impl Sink, tag: u8, obj: &Address, seq: Seq) {
    out.push(tag);
    put_bytes(out, obj.as_bytes());
    put_u64(out, seq.get());
}

/// Reads fields off the front of one entry's payload.
struct Reader<'a> {
    rest: &'a [u8],
    /// The buffer `rest` lies in, when bodies may be slices of it.
    shared: Option<&'a Bytes>,
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

    fn seq(&mut self) -> Result<Seq, LogError> {
        self.u64().map(Seq)
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

    /// An object's address: refused unless it is one the machine could have made.
    fn address(&mut self) -> Result<Address, LogError> {
        let text = std::str::from_utf8(self.bytes()?)
            .map_err(|_| LogError::Malformed("a string is not UTF-8"))?;
        Address::parse(text).map_err(|_| LogError::Malformed("an object address is not valid"))
    }

    fn op_id(&mut self) -> Result<OpId, LogError> {
        std::str::from_utf8(self.bytes()?)
            .map(OpId::new)
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
                let obj = self.address()?;
                let kind = self.kind()?;
                let opened_by = match self.u8()? {
                    0 => Side::Local,
                    1 => Side::Remote,
                    _ => return Err(LogError::Malformed("unknown side")),
                };
                let open_id = self.op_id()?;
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
                    tx_next: self.seq()?,
                    rx_next: self.seq()?,
                })
            }
            TAG_OBJECT_REMOVED => Record::ObjectRemoved {
                obj: self.address()?,
            },
            TAG_OUTBOX => Record::Outbox(self.op()?),
            TAG_HELD => Record::Held(self.op()?),
            TAG_INBOX => Record::Inbox(self.op()?),
            TAG_OUTBOX_REMOVED => Record::OutboxRemoved {
                obj: self.address()?,
                seq: self.seq()?,
            },
            TAG_HELD_REMOVED => Record::HeldRemoved {
                obj: self.address()?,
                seq: self.seq()?,
            },
            TAG_INBOX_REMOVED => Record::InboxRemoved {
                obj: self.address()?,
                seq: self.seq()?,
            },
            TAG_BOUNCE => Record::Bounce {
                op_id: self.op_id()?,
                code: self.string()?,
                at: self.time()?,
            },
            TAG_BOUNCE_REMOVED => Record::BounceRemoved {
                op_id: self.op_id()?,
            },
            _ => return Err(LogError::Malformed("unknown entry tag")),
        };
        Ok(Entry::Record(record))
    }

    fn op(&mut self) -> Result<Op, LogError> {
        let obj = self.address()?;
        let seq = self.seq()?;
        let id = self.op_id()?;
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
            let body = self.bytes()?;
            Some(match self.shared {
                Some(shared) => shared.slice_ref(body),
                None => Bytes::copy_from_slice(body),
            })
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
            obj: Address::parse("q").expect("an address"),
            seq: Seq(7),
            id: "m-1".into(),
            verb,
            obj_kind: (verb == Verb::Open).then_some(ObjKind::Queue),
            body: body.map(Bytes::copy_from_slice),
            code: None,
            reason: None,
            cap: None,
            at: Time::from_millis(258),
        }
    }

    const SALT: u64 = 0x0123_4567_89ab_cdef;

    fn v2() -> LogFormat {
        LogFormat::new(SALT)
    }

    fn decode_all(format: LogFormat, mut buf: &[u8]) -> Vec<Entry> {
        let mut entries = Vec::new();
        while let Some((entry, used)) = decode_entry(format, buf).expect("decodes") {
            entries.push(entry);
            buf = &buf[used..];
        }
        assert!(buf.is_empty(), "{} bytes left", buf.len());
        entries
    }

    /// Golden bytes of version 1 (still read): a header and a commit of one send for peer "p".
    #[test]
    fn golden_bytes_of_a_version_1_commit() {
        let mut out = Vec::new();
        encode_header(LogFormat::V1, &mut out);
        encode_begin(LogFormat::V1, "p", &mut out);
        encode_record(
            LogFormat::V1,
            &Record::Outbox(op(Verb::Send, Some(b"hi"))),
            &mut out,
        );
        encode_commit(LogFormat::V1, &mut out);
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
        assert_eq!(
            decode_header(&out),
            Ok(Some((LogFormat::V1, LOG_HEADER_V1_BYTES)))
        );
        assert_eq!(
            decode_all(LogFormat::V1, &out[LOG_HEADER_V1_BYTES..]),
            vec![
                Entry::Begin {
                    peer: "p".to_owned()
                },
                Entry::Record(Record::Outbox(op(Verb::Send, Some(b"hi")))),
                Entry::Commit,
            ]
        );
    }

    /// Golden bytes of version 2: a header with its salt and checksum, then a commit whose
    /// checksums cover the salt, each entry's length and its payload.
    #[test]
    fn golden_bytes_of_a_commit() {
        let mut out = Vec::new();
        encode_header(v2(), &mut out);
        encode_begin(v2(), "p", &mut out);
        encode_commit(v2(), &mut out);
        let expected = concat!(
            "545448524c4f4700", // magic
            "02000000",         // version 2
            "efcdab8967452301", // salt
            "5770aaee",         // crc32 of the 20 bytes before
            // Begin "p": length 6, crc of salt | length | payload, tag 1, "p"
            "06000000",
            "ed38e848",
            "01",
            "0100000070",
            // Commit: length 1, crc, tag 2
            "01000000",
            "1b32c23f",
            "02",
        );
        assert_eq!(hex::encode(&out), expected);
        assert_eq!(decode_header(&out), Ok(Some((v2(), LOG_HEADER_BYTES))));
        assert_eq!(
            decode_all(v2(), &out[LOG_HEADER_BYTES..]),
            vec![
                Entry::Begin {
                    peer: "p".to_owned()
                },
                Entry::Commit,
            ]
        );
        // Another salt: the same entries do not verify.
        assert_eq!(
            decode_entry(LogFormat::new(SALT ^ 1), &out[LOG_HEADER_BYTES..]),
            Err(LogError::Checksum)
        );
        assert_eq!(
            decode_entry(LogFormat::V1, &out[LOG_HEADER_BYTES..]),
            Err(LogError::Checksum)
        );
    }

    #[test]
    fn a_bad_header_is_refused() {
        let mut out = Vec::new();
        encode_header(v2(), &mut out);
        for cut in 0..LOG_HEADER_BYTES {
            assert_eq!(decode_header(&out[..cut]), Ok(None), "cut at {cut}");
        }
        let mut other = out.clone();
        other[0] = b'X';
        assert_eq!(decode_header(&other), Err(LogError::BadMagic));
        assert_eq!(decode_header(&other[..1]), Err(LogError::BadMagic));
        for at in 12..LOG_HEADER_BYTES {
            let mut flipped = out.clone();
            flipped[at] ^= 0x10;
            assert_eq!(
                decode_header(&flipped),
                Err(LogError::HeaderChecksum),
                "byte {at}"
            );
        }
        out[8] = 3;
        assert_eq!(decode_header(&out), Err(LogError::Version(3)));
    }

    #[test]
    fn a_cut_entry_asks_for_more_and_a_damaged_one_is_refused() {
        let mut out = Vec::new();
        encode_record(
            v2(),
            &Record::Inbox(op(Verb::Send, Some(b"body"))),
            &mut out,
        );
        for cut in 0..out.len() {
            assert_eq!(decode_entry(v2(), &out[..cut]), Ok(None), "cut at {cut}");
        }
        // Every byte is covered: the length and the kind as well as the payload (a shorter
        // length leaves the entry whole but different, and is caught by the checksum).
        for at in 0..out.len() {
            if (4..LOG_ENTRY_HEADER_BYTES).contains(&at) {
                continue;
            }
            let mut damaged = out.clone();
            damaged[at] ^= 0x01;
            assert!(
                matches!(
                    decode_entry(v2(), &damaged),
                    Err(LogError::Checksum | LogError::TooLong(_)) | Ok(None)
                ),
                "byte {at}"
            );
        }
        let mut shorter = out.clone();
        shorter[0] -= 1;
        assert_eq!(decode_entry(v2(), &shorter), Err(LogError::Checksum));
        let mut long = out.clone();
        long[..4].copy_from_slice(&(LOG_ENTRY_BYTES_MAX as u32 + 1).to_le_bytes());
        assert_eq!(
            decode_entry(v2(), &long),
            Err(LogError::TooLong(LOG_ENTRY_BYTES_MAX as u64 + 1))
        );
    }

    /// A file of three commits for peers "a", "b", "c" (one send each, `body` in "b"'s), and
    /// where each commit lies.
    fn three_commits(format: LogFormat, body: &[u8]) -> (Vec<u8>, Vec<Range<u64>>) {
        let mut out = Vec::new();
        encode_header(format, &mut out);
        let mut at = Vec::new();
        for peer in ["a", "b", "c"] {
            let start = out.len() as u64;
            encode_begin(format, peer, &mut out);
            let body = if peer == "b" { body } else { b"x" };
            encode_record(
                format,
                &Record::Outbox(op(Verb::Send, Some(body))),
                &mut out,
            );
            encode_commit(format, &mut out);
            at.push(start..out.len() as u64);
        }
        (out, at)
    }

    fn scanned(bytes: &[u8]) -> (LogScan, Vec<String>) {
        let mut peers = Vec::new();
        let scan = scan(bytes, |commit| peers.push(commit.peer))
            .expect("a header")
            .expect("a whole header");
        (scan, peers)
    }

    #[test]
    fn a_sound_file_scans_whole_and_a_zeroed_tail_is_prepared_space() {
        let (mut out, at) = three_commits(v2(), b"hello");
        let (scan, peers) = scanned(&out);
        assert!(scan.is_sound());
        assert_eq!(peers, ["a", "b", "c"]);
        assert_eq!((scan.commits, scan.end, scan.tail), (3, at[2].end, 0));
        out.extend_from_slice(&[0; 4096]);
        let (scan, _) = scanned(&out);
        assert!(scan.is_sound() && scan.tail_zeros);
        assert_eq!((scan.end, scan.tail), (at[2].end, 4096));
        assert_eq!(super::scan(&out[..LOG_HEADER_BYTES - 1], |_| {}), Ok(None));
    }

    /// A shared scan finds what a scan finds, with every body a slice of the buffer scanned
    /// (no copy), also past damage.
    #[test]
    fn a_shared_scan_hands_over_the_same_commits_with_bodies_in_the_buffer() {
        let (mut out, at) = three_commits(v2(), b"hello, shared");
        // Damage in the middle commit's body: the scan resyncs past it either way.
        let middle = usize::try_from(at[1].end).expect("small") - 20;
        out[middle] ^= 0xff;
        let mut copied = Vec::new();
        let plain = scan(&out, |commit| copied.push(commit)).expect("scans");
        let shared = Bytes::from(out);
        let mut sliced = Vec::new();
        let found = scan_shared(&shared, |commit| sliced.push(commit)).expect("scans");
        assert_eq!(found, plain);
        assert_eq!(sliced, copied);
        assert_eq!(sliced.len(), 2, "the damaged commit is not handed over");
        let range = shared.as_ptr_range();
        for commit in &sliced {
            for record in &commit.records {
                let Record::Outbox(op) = record else {
                    panic!("a send")
                };
                let body = op.body.as_ref().expect("a body");
                assert!(range.contains(&body.as_ptr()), "a slice, not a copy");
            }
        }
    }

    /// A commit cut anywhere (a crash before its sync) is a torn tail, whatever follows it in
    /// zeros: never damage.
    #[test]
    fn a_commit_cut_anywhere_is_a_torn_tail() {
        let (out, at) = three_commits(v2(), b"hello");
        for cut in at[2].start + 1..at[2].end {
            let mut torn = out[..cut as usize].to_vec();
            let (scan, peers) = scanned(&torn);
            assert!(scan.is_sound(), "cut at {cut}");
            assert_eq!(peers, ["a", "b"]);
            assert_eq!((scan.end, scan.tail), (at[1].end, cut - at[1].end));
            assert!(!scan.tail_zeros);
            torn.extend_from_slice(&[0; 64]);
            assert!(scanned(&torn).0.is_sound(), "cut at {cut}, then zeros");
        }
    }

    /// One flipped bit anywhere in a commit followed by another is damage: the commits around
    /// it verify and are handed over, and the damage covers the flipped byte.
    #[test]
    fn a_flipped_bit_before_a_later_commit_is_damage() {
        let (out, at) = three_commits(v2(), b"hello");
        for byte in at[1].clone() {
            for bit in [0x01, 0x80] {
                let mut damaged = out.clone();
                damaged[byte as usize] ^= bit;
                let (scan, peers) = scanned(&damaged);
                assert_eq!(peers, ["a", "c"], "byte {byte}");
                assert_eq!(scan.damaged, vec![at[1].clone()], "byte {byte}");
                assert_eq!(scan.end, at[2].end);
            }
        }
    }

    /// A body that embeds a well-formed commit of another salt (or of version 1) is not taken
    /// for one: a peer cannot plant a commit in the file by sending it as a message.
    #[test]
    fn a_commit_embedded_in_a_body_does_not_verify() {
        let mut planted = Vec::new();
        for format in [LogFormat::new(SALT ^ 0x5a5a), LogFormat::V1] {
            encode_begin(format, "evil", &mut planted);
            encode_commit(format, &mut planted);
        }
        let (mut out, at) = three_commits(v2(), &planted);
        out.truncate(at[2].start as usize);
        // "b"'s Begin is damaged: only the planted commits could follow it.
        out[at[1].start as usize + 9] ^= 1;
        let (scan, peers) = scanned(&out);
        assert_eq!(peers, ["a"]);
        assert!(scan.is_sound(), "a torn tail, nothing after it verifies");
        assert_eq!(scan.end, at[0].end);
    }

    /// An entry whose checksum is right but whose payload is not a record.
    fn sealed(payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        entry(v2(), &mut out, |p| p.extend_from_slice(payload));
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
            // An address the machine could never have made (upper case, or `@`).
            (
                &[TAG_OBJECT_REMOVED, 1, 0, 0, 0, b'Q'][..],
                "an object address is not valid",
            ),
            (
                &[
                    TAG_INBOX_REMOVED,
                    3,
                    0,
                    0,
                    0,
                    b'a',
                    b'@',
                    b'b',
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                ][..],
                "an object address is not valid",
            ),
        ] {
            assert_eq!(
                decode_entry(v2(), &sealed(payload)),
                Err(LogError::Malformed(why)),
                "{payload:?}"
            );
        }
        let mut bad_marker = Vec::new();
        put_op(&mut bad_marker, TAG_OUTBOX, &op(Verb::Send, None));
        // The obj_kind marker follows obj (5), seq (8), id (7), verb (8) after the tag.
        bad_marker[1 + 5 + 8 + 7 + 8] = 2;
        assert_eq!(
            decode_entry(v2(), &sealed(&bad_marker)),
            Err(LogError::Malformed(
                "an optional field's marker is not 0 or 1"
            ))
        );
    }

    pub(crate) fn record() -> impl Strategy<Value = Record> {
        let text = "[a-z/.]{0,6}";
        // Addresses are never empty (a log naming one is refused as malformed).
        let address = "[a-z/.]{1,6}".prop_map(|text| Address::parse(&text).expect("valid"));
        let id = text.prop_map(OpId::from);
        let time = any::<u64>().prop_map(Time::from_millis);
        let verb = prop::sample::select(Verb::ALL.to_vec());
        let kind = prop::sample::select(vec![ObjKind::Session, ObjKind::Queue]);
        let op = (
            (address.clone(), any::<u64>(), id.clone(), verb),
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
                    seq: Seq(seq),
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
            (
                address.clone(),
                kind,
                side,
                id.clone(),
                state,
                any::<u64>(),
                any::<u64>()
            )
                .prop_map(
                    |(obj, kind, opened_by, open_id, state, tx_next, rx_next)| {
                        Record::Object(ObjectRecord {
                            obj,
                            kind,
                            opened_by,
                            open_id,
                            state,
                            tx_next: Seq(tx_next),
                            rx_next: Seq(rx_next),
                        })
                    }
                ),
            address
                .clone()
                .prop_map(|obj| Record::ObjectRemoved { obj }),
            op.clone().prop_map(Record::Outbox),
            op.clone().prop_map(Record::Held),
            op.prop_map(Record::Inbox),
            (address.clone(), any::<u64>())
                .prop_map(|(obj, seq)| Record::OutboxRemoved { obj, seq: Seq(seq) }),
            (address.clone(), any::<u64>())
                .prop_map(|(obj, seq)| Record::HeldRemoved { obj, seq: Seq(seq) }),
            (address, any::<u64>())
                .prop_map(|(obj, seq)| Record::InboxRemoved { obj, seq: Seq(seq) }),
            (id.clone(), text, time).prop_map(|(op_id, code, at)| Record::Bounce {
                op_id,
                code,
                at
            }),
            id.prop_map(|op_id| Record::BounceRemoved { op_id }),
        ]
    }

    proptest! {
        /// The sizes a commit is laid out by are the bytes its encoding appends, in either
        /// format, for every kind of entry.
        #[test]
        fn encoded_lengths_are_the_bytes_encoding_appends(salt in any::<u64>(), peer in "[a-z0-9]{0,12}", record in record()) {
            for format in [LogFormat::V1, LogFormat::new(salt)] {
                let mut out = vec![0xAA; 3];
                encode_begin(format, &peer, &mut out);
                prop_assert_eq!(out.len() - 3, encoded_begin_len(&peer));
                let before = out.len();
                encode_record(format, &record, &mut out);
                prop_assert_eq!(out.len() - before, encoded_record_len(&record));
                let before = out.len();
                encode_commit(format, &mut out);
                prop_assert_eq!(out.len() - before, encoded_commit_len());
            }
        }

        /// Every record survives the trip, whole, and a commit's entries come back in order.
        #[test]
        fn records_round_trip(salt in any::<u64>(), peer in "[a-z0-9]{0,12}", records in prop::collection::vec(record(), 0..8)) {
            let mut out = Vec::new();
            let format = LogFormat::new(salt);
            encode_begin(format, &peer, &mut out);
            for record in &records {
                encode_record(format, record, &mut out);
            }
            encode_commit(format, &mut out);
            let mut expected = vec![Entry::Begin { peer }];
            expected.extend(records.into_iter().map(Entry::Record));
            expected.push(Entry::Commit);
            prop_assert_eq!(decode_all(format, &out), expected);
        }

        /// Any bytes: an entry, a request for more, or a typed error; never a panic, and an
        /// entry never claims more bytes than it was given.
        #[test]
        fn any_bytes_decode_totally(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            for format in [LogFormat::V1, v2()] {
                if let Ok(Some((_, used))) = decode_entry(format, &bytes) {
                    prop_assert!(used <= bytes.len());
                }
            }
            let _ = decode_header(&bytes);
            let _ = scan(&bytes, |_| {});
        }
    }
}
