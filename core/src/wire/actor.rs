//! Actor records: the length-delimited frames of the actor-message ALPN (docs/spec/driver.md
//! §3.1).
//!
//! ```text
//! [32B dest][u32 BE tag_len][tag (UTF-8)][u32 BE payload_len][payload]
//! ```
//!
//! Many records follow each other on one stream with no other framing. Every error is fatal:
//! a malformed actor stream is dropped while the connection survives (docs/spec/driver.md
//! §3.1), so the decoder poisons.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::{u32_be_at, Format, FormatError};
use crate::limits::{
    ACTOR_PAYLOAD_BYTES_CEILING, ACTOR_PAYLOAD_BYTES_DEFAULT, ACTOR_TAG_BYTES_MAX,
};

/// Bytes of an actor address (an iroh endpoint key or an actor id).
pub const DEST_LEN: usize = 32;

/// Bytes before the tag: dest and the tag length.
const TAG_AT: usize = DEST_LEN + 4;

/// One actor message on the wire.
///
/// A decoded record is one zero-copy handle on the received buffer; the tag and payload are
/// views of it.
#[derive(Debug, Clone)]
pub struct ActorRecord {
    dest: [u8; DEST_LEN],
    parts: Parts,
}

#[derive(Debug, Clone)]
enum Parts {
    /// As received: `[tag][u32 BE payload_len][payload]`, one handle on the receive buffer (one
    /// reference count per record instead of one per field).
    Received { bytes: Bytes, tag_len: usize },
    /// As built for sending.
    Built { tag: Bytes, payload: Bytes },
}

impl PartialEq for ActorRecord {
    /// Records are equal when they encode the same bytes, however they were made.
    fn eq(&self, other: &Self) -> bool {
        self.dest == other.dest
            && self.tag_bytes() == other.tag_bytes()
            && self.payload() == other.payload()
    }
}

impl Eq for ActorRecord {}

impl ActorRecord {
    /// A record for `dest` with network type `tag` and an already-encoded `payload`.
    ///
    /// Fails when the tag is longer than [`ACTOR_TAG_BYTES_MAX`]; the payload bound is the
    /// receiver's setting and is checked by [`ActorRecord::encode`].
    pub fn new(dest: [u8; DEST_LEN], tag: &str, payload: Bytes) -> Result<Self, ActorError> {
        if tag.len() > ACTOR_TAG_BYTES_MAX {
            return Err(ActorError::TagTooLong {
                len: tag.len() as u64,
            });
        }
        let tag = Bytes::copy_from_slice(tag.as_bytes());
        Ok(Self {
            dest,
            parts: Parts::Built { tag, payload },
        })
    }

    /// A record whose tag the caller has checked against [`ACTOR_TAG_BYTES_MAX`] (a constant
    /// tag, asserted at compile time).
    pub(crate) fn from_parts(dest: [u8; DEST_LEN], tag: Bytes, payload: Bytes) -> Self {
        debug_assert!(tag.len() <= ACTOR_TAG_BYTES_MAX);
        Self {
            dest,
            parts: Parts::Built { tag, payload },
        }
    }

    /// The addressed actor (or peer mailbox).
    #[inline]
    pub fn dest(&self) -> &[u8; DEST_LEN] {
        &self.dest
    }

    /// The network message type tag.
    pub fn tag(&self) -> &str {
        // Checked at construction and at decode; neither path stores anything else.
        std::str::from_utf8(self.tag_bytes()).expect("actor tag validated as UTF-8")
    }

    /// The opaque payload bytes.
    pub fn payload(&self) -> &[u8] {
        match &self.parts {
            Parts::Received { bytes, tag_len } => &bytes[tag_len + 4..],
            Parts::Built { payload, .. } => payload,
        }
    }

    /// The payload as a zero-copy handle (shares the received buffer).
    pub fn payload_bytes(&self) -> Bytes {
        match &self.parts {
            Parts::Received { bytes, tag_len } => bytes.slice(tag_len + 4..),
            Parts::Built { payload, .. } => payload.clone(),
        }
    }

    /// The payload, consuming the record without touching a reference count.
    #[inline]
    pub fn into_payload(self) -> Bytes {
        match self.parts {
            Parts::Received { mut bytes, tag_len } => {
                bytes.advance(tag_len + 4);
                bytes
            }
            Parts::Built { payload, .. } => payload,
        }
    }

    /// The tag's bytes (valid UTF-8), for comparisons that need no `&str`.
    #[inline]
    pub fn tag_bytes(&self) -> &[u8] {
        match &self.parts {
            Parts::Received { bytes, tag_len } => &bytes[..*tag_len],
            Parts::Built { tag, .. } => tag,
        }
    }

    /// Bytes this record takes on the wire.
    pub fn encoded_len(&self) -> usize {
        TAG_AT + self.tag_bytes().len() + 4 + self.payload().len()
    }

    /// Appends the record to `out`, refusing a payload above `payload_bytes_max` (the bound the
    /// receiving [`ActorDecoder`] enforces).
    pub fn encode(
        &self,
        payload_bytes_max: usize,
        out: &mut impl BufMut,
    ) -> Result<(), ActorError> {
        // The tag was checked when the record was made or decoded.
        check_payload(self.payload().len(), payload_bytes_max)?;
        put_record(&self.dest, self.tag_bytes(), self.payload(), out);
        Ok(())
    }
}

/// Appends the record `[dest][tag_len][tag][payload_len][payload]` to `out` without building
/// an [`ActorRecord`] (the sending hot path): refuses a tag above [`ACTOR_TAG_BYTES_MAX`] and a
/// payload above `payload_bytes_max`, writing nothing then.
#[inline]
pub fn encode_record(
    dest: &[u8; DEST_LEN],
    tag: &str,
    payload: &[u8],
    payload_bytes_max: usize,
    out: &mut impl BufMut,
) -> Result<(), ActorError> {
    check_record(tag, payload.len(), payload_bytes_max)?;
    put_record(dest, tag.as_bytes(), payload, out);
    Ok(())
}

/// Whether a record tagged `tag` with a payload of `payload_len` bytes can be encoded under
/// `payload_bytes_max` (what [`encode_record`] refuses, judged without encoding): a sender
/// refuses such a frame when it is handed over, not when its batch is written.
#[inline]
pub fn check_record(
    tag: &str,
    payload_len: usize,
    payload_bytes_max: usize,
) -> Result<(), ActorError> {
    if tag.len() > ACTOR_TAG_BYTES_MAX {
        return Err(ActorError::TagTooLong {
            len: tag.len() as u64,
        });
    }
    check_payload(payload_len, payload_bytes_max)
}

/// The payload half of [`check_record`].
#[inline]
fn check_payload(payload_len: usize, payload_bytes_max: usize) -> Result<(), ActorError> {
    if payload_len > payload_bytes_max.min(ACTOR_PAYLOAD_BYTES_CEILING) {
        return Err(ActorError::PayloadTooLarge {
            len: payload_len as u64,
            max: payload_bytes_max as u64,
        });
    }
    Ok(())
}

/// Appends a record whose tag and payload were checked.
fn put_record(dest: &[u8; DEST_LEN], tag: &[u8], payload: &[u8], out: &mut impl BufMut) {
    debug_assert!(tag.len() <= ACTOR_TAG_BYTES_MAX);
    // The header (and a short tag) goes in as one slice: each `put_*` checks for room.
    const SHORT_TAG: usize = 32;
    if tag.len() <= SHORT_TAG {
        let mut head = [0u8; TAG_AT + SHORT_TAG + 4];
        head[..DEST_LEN].copy_from_slice(dest);
        head[DEST_LEN..TAG_AT].copy_from_slice(&(tag.len() as u32).to_be_bytes());
        let payload_len_at = TAG_AT + tag.len();
        head[TAG_AT..payload_len_at].copy_from_slice(tag);
        head[payload_len_at..payload_len_at + 4]
            .copy_from_slice(&(payload.len() as u32).to_be_bytes());
        out.put_slice(&head[..payload_len_at + 4]);
    } else {
        out.put_slice(dest);
        out.put_u32(tag.len() as u32);
        out.put_slice(tag);
        out.put_u32(payload.len() as u32);
    }
    out.put_slice(payload);
}

/// Why an actor stream could not be decoded. All of these end the stream.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ActorError {
    /// The stream ended inside a record.
    #[error("actor stream ends inside a record ({buffered} bytes left)")]
    Truncated {
        /// Bytes of the incomplete record.
        buffered: u64,
    },
    /// `tag_len` above [`ACTOR_TAG_BYTES_MAX`].
    #[error("actor tag of {len} bytes exceeds {ACTOR_TAG_BYTES_MAX}")]
    TagTooLong {
        /// Declared tag length.
        len: u64,
    },
    /// The tag is not UTF-8.
    #[error("actor tag is not UTF-8")]
    TagNotUtf8,
    /// `payload_len` above the decoder's setting.
    #[error("actor payload of {len} bytes exceeds {max}")]
    PayloadTooLarge {
        /// Declared payload length.
        len: u64,
        /// The bound in force.
        max: u64,
    },
}

impl FormatError for ActorError {
    fn is_fatal(&self) -> bool {
        true
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Truncated { .. } => "truncated",
            Self::TagTooLong { .. } => "tag_too_long",
            Self::TagNotUtf8 => "tag_not_utf8",
            Self::PayloadTooLarge { .. } => "payload_too_large",
        }
    }
}

/// The actor-record [`Format`]; wrap it in a [`super::StreamDecoder`].
#[derive(Debug, Clone)]
pub struct ActorDecoder {
    payload_bytes_max: usize,
}

impl Default for ActorDecoder {
    fn default() -> Self {
        Self {
            payload_bytes_max: ACTOR_PAYLOAD_BYTES_DEFAULT,
        }
    }
}

impl ActorDecoder {
    /// A decoder accepting payloads up to `payload_bytes_max`, clamped to
    /// [`ACTOR_PAYLOAD_BYTES_CEILING`].
    pub fn with_payload_bytes_max(payload_bytes_max: usize) -> Self {
        Self {
            payload_bytes_max: payload_bytes_max.min(ACTOR_PAYLOAD_BYTES_CEILING),
        }
    }

    /// The payload bound in force.
    pub fn payload_bytes_max(&self) -> usize {
        self.payload_bytes_max
    }
}

impl Format for ActorDecoder {
    type Item = ActorRecord;
    type Error = ActorError;

    fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<ActorRecord>, ActorError> {
        let Some(tag_len) = u32_be_at(buf, DEST_LEN) else {
            return Ok(None);
        };
        let tag_len = tag_len as usize;
        if tag_len > ACTOR_TAG_BYTES_MAX {
            return Err(ActorError::TagTooLong {
                len: tag_len as u64,
            });
        }
        let payload_len_at = TAG_AT + tag_len;
        let Some(payload_len) = u32_be_at(buf, payload_len_at) else {
            return Ok(None);
        };
        let payload_len = payload_len as usize;
        if payload_len > self.payload_bytes_max {
            let (len, max) = (payload_len as u64, self.payload_bytes_max as u64);
            return Err(ActorError::PayloadTooLarge { len, max });
        }
        // The tag is complete here: reject it before waiting for a payload we would discard.
        let tag = &buf[TAG_AT..payload_len_at];
        // Tags are almost always ASCII; `is_ascii` is a word-at-a-time check that inlines.
        if !tag.is_ascii() && std::str::from_utf8(tag).is_err() {
            return Err(ActorError::TagNotUtf8);
        }
        let total = payload_len_at + 4 + payload_len;
        if buf.len() < total {
            super::reserve_ahead(buf, total);
            return Ok(None);
        }
        // One handle on the buffer per record: tag and payload are views of it.
        let mut bytes = buf.split_to(total).freeze();
        let mut dest = [0u8; DEST_LEN];
        dest.copy_from_slice(&bytes[..DEST_LEN]);
        bytes.advance(TAG_AT);
        let parts = Parts::Received { bytes, tag_len };
        Ok(Some(ActorRecord { dest, parts }))
    }

    fn finish(&self, buffered: usize) -> Result<(), ActorError> {
        match buffered {
            0 => Ok(()),
            n => Err(ActorError::Truncated { buffered: n as u64 }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testing::{check_malformed, decode_split, golden};
    use crate::wire::StreamDecoder;
    use proptest::prelude::*;

    fn encode_all(records: &[ActorRecord]) -> Vec<u8> {
        let mut out = Vec::new();
        for record in records {
            record
                .encode(ACTOR_PAYLOAD_BYTES_DEFAULT, &mut out)
                .expect("within bounds");
        }
        out
    }

    #[test]
    fn golden_valid_two_records() {
        let bytes = golden(include_str!(
            "../../tests/golden/actor/valid_two_records.hex"
        ));
        let mut dest = [0u8; 32];
        dest.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let expected = vec![
            ActorRecord::new(dest, "swim.ping", Bytes::from_static(b"hi")).unwrap(),
            ActorRecord::new([0xff; 32], "", Bytes::new()).unwrap(),
        ];
        assert_eq!(encode_all(&expected), bytes);
        let (items, verdict) = decode_split(ActorDecoder::default(), &bytes, &[]);
        assert_eq!(verdict, Ok(()));
        assert_eq!(items, expected);
    }

    #[test]
    fn golden_malformed_vectors() {
        let vectors = [
            include_str!("../../tests/golden/actor/malformed_tag_too_long.hex"),
            include_str!("../../tests/golden/actor/malformed_tag_not_utf8.hex"),
            include_str!("../../tests/golden/actor/malformed_payload_too_large.hex"),
            include_str!("../../tests/golden/actor/malformed_truncated.hex"),
        ];
        for text in vectors {
            check_malformed(ActorDecoder::default(), text);
        }
    }

    /// A header declaring the largest payload costs memory only as the payload's bytes come:
    /// the decoder reserves at most `DECODE_RESERVE_AHEAD_BYTES_MAX` ahead, however much was
    /// declared, and still decodes the record whole once it is all there.
    #[test]
    fn a_declared_payload_is_not_allocated_before_its_bytes_arrive() {
        use crate::limits::DECODE_RESERVE_AHEAD_BYTES_MAX;
        let payload = vec![9u8; ACTOR_PAYLOAD_BYTES_DEFAULT];
        let record = ActorRecord::new([3; 32], "t", Bytes::from(payload.clone())).unwrap();
        let mut bytes = Vec::new();
        record
            .encode(ACTOR_PAYLOAD_BYTES_DEFAULT, &mut bytes)
            .unwrap();
        let header = DEST_LEN + 4 + 1 + 4;
        let mut decoder = StreamDecoder::new(ActorDecoder::default());
        decoder.push(&bytes[..header]);
        assert!(decoder.pop().unwrap().is_none());
        assert!(
            decoder.buffered_capacity() <= header + DECODE_RESERVE_AHEAD_BYTES_MAX,
            "{} bytes reserved for a {header}-byte header",
            decoder.buffered_capacity()
        );
        for chunk in bytes[header..].chunks(4096) {
            decoder.push(chunk);
        }
        let decoded = decoder.pop().unwrap().expect("whole");
        assert_eq!(decoded.payload(), &payload[..]);
    }

    #[test]
    fn poisoned_decoder_discards_later_bytes() {
        let bytes = golden(include_str!(
            "../../tests/golden/actor/malformed_tag_too_long.hex"
        ));
        let mut decoder = StreamDecoder::new(ActorDecoder::default());
        decoder.push(&bytes);
        let first = decoder.pop().expect_err("tag too long");
        decoder.push(&[0; 4096]);
        assert_eq!(decoder.buffered_len(), 0);
        assert_eq!(decoder.pop().expect_err("still poisoned"), first);
    }

    #[test]
    fn encoder_refuses_what_the_decoder_rejects() {
        let long = "x".repeat(ACTOR_TAG_BYTES_MAX + 1);
        let error = ActorRecord::new([0; 32], &long, Bytes::new()).unwrap_err();
        assert_eq!(error.kind(), "tag_too_long");
        let record = ActorRecord::new([0; 32], "t", Bytes::from(vec![0; 11])).unwrap();
        let error = record.encode(10, &mut Vec::new()).unwrap_err();
        assert_eq!(error, ActorError::PayloadTooLarge { len: 11, max: 10 });
        let (_, verdict) = decode_split(
            ActorDecoder::with_payload_bytes_max(10),
            &encode_all(&[record]),
            &[],
        );
        assert_eq!(verdict.unwrap_err().error.kind(), "payload_too_large");
    }

    fn record() -> impl Strategy<Value = ActorRecord> {
        let tag = proptest::string::string_regex("[a-zA-Z0-9._/é-]{0,40}").expect("valid regex");
        (
            any::<[u8; 32]>(),
            tag,
            proptest::collection::vec(any::<u8>(), 0..300),
        )
            .prop_map(|(dest, tag, payload)| ActorRecord::new(dest, &tag, payload.into()).unwrap())
    }

    proptest! {
        #[test]
        fn round_trips_in_every_split(
            records in proptest::collection::vec(record(), 0..8),
            cuts in proptest::collection::vec(any::<usize>(), 0..6),
        ) {
            let bytes = encode_all(&records);
            let (items, verdict) = decode_split(ActorDecoder::default(), &bytes, &cuts);
            prop_assert_eq!(verdict, Ok(()));
            prop_assert_eq!(items, records);
        }

        #[test]
        fn truncation_is_reported_unless_cut_on_a_boundary(
            records in proptest::collection::vec(record(), 1..4),
            back in 1usize..64,
        ) {
            let bytes = encode_all(&records);
            let cut = bytes.len().saturating_sub(back);
            let boundaries: Vec<usize> = records
                .iter()
                .scan(0, |end, r| { *end += r.encoded_len(); Some(*end) })
                .collect();
            let (items, verdict) = decode_split(ActorDecoder::default(), &bytes[..cut], &[]);
            let whole = boundaries.iter().filter(|&&end| end <= cut).count();
            prop_assert_eq!(items.len(), whole);
            let on_boundary = cut == 0 || boundaries.contains(&cut);
            let truncated = verdict.is_err_and(|e| e.error.kind() == "truncated");
            prop_assert_eq!(truncated, !on_boundary);
        }

        #[test]
        fn arbitrary_bytes_never_panic_and_reencode_stably(
            bytes in proptest::collection::vec(any::<u8>(), 0..600),
            cuts in proptest::collection::vec(any::<usize>(), 0..4),
        ) {
            let format = ActorDecoder::with_payload_bytes_max(256);
            let (items, _) = decode_split(format.clone(), &bytes, &cuts);
            for item in &items {
                prop_assert!(item.payload().len() <= 256);
                prop_assert!(item.tag().len() <= ACTOR_TAG_BYTES_MAX);
            }
            let (again, verdict) = decode_split(format, &encode_all(&items), &[]);
            prop_assert_eq!(verdict, Ok(()));
            prop_assert_eq!(again, items);
        }
    }
}
