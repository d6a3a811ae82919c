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

use bytes::{Buf, BufMut, Bytes};

use super::{u32_be_at, Format, FormatError, Input};
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

    #[inline(always)]
    fn decode<I: Input>(&mut self, buf: &mut I) -> Result<Option<ActorRecord>, ActorError> {
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
            return Ok(None);
        }
        // One handle on the buffer per record: tag and payload are views of it.
        let mut bytes = buf.split_front(total);
        let mut dest = [0u8; DEST_LEN];
        dest.copy_from_slice(&bytes[..DEST_LEN]);
        bytes.advance(TAG_AT);
        let parts = Parts::Received { bytes, tag_len };
        Ok(Some(ActorRecord { dest, parts }))
    }

    fn item_len(&self, buf: &[u8]) -> Option<usize> {
        let tag_len = usize::try_from(u32_be_at(buf, DEST_LEN)?).ok()?;
        let payload_len_at = TAG_AT.checked_add(tag_len)?;
        let payload_len = usize::try_from(u32_be_at(buf, payload_len_at)?).ok()?;
        payload_len_at.checked_add(4)?.checked_add(payload_len)
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
    /// the decoder joins what arrived, never room for what was declared, and still decodes
    /// the record whole once it is all there, through any split.
    #[test]
    fn a_declared_payload_is_not_allocated_before_its_bytes_arrive() {
        let payload = vec![9u8; ACTOR_PAYLOAD_BYTES_DEFAULT];
        let record = ActorRecord::new([3; 32], "t", Bytes::from(payload.clone())).unwrap();
        let mut bytes = Vec::new();
        record
            .encode(ACTOR_PAYLOAD_BYTES_DEFAULT, &mut bytes)
            .unwrap();
        let header = DEST_LEN + 4 + 1 + 4;
        let push = |decoder: &mut StreamDecoder<ActorDecoder>, part: &[u8], adopt: bool| match adopt
        {
            true => decoder.push_bytes(Bytes::copy_from_slice(part)),
            false => decoder.push(part),
        };
        for adopt in [false, true] {
            let mut decoder = StreamDecoder::new(ActorDecoder::default());
            push(&mut decoder, &bytes[..header], adopt);
            push(&mut decoder, &bytes[header..header + 1], adopt);
            assert!(decoder.pop().unwrap().is_none());
            assert!(
                decoder.buffered_capacity() <= 2 * (header + 1) + 64,
                "{} bytes held for {} that arrived (adopt: {adopt})",
                decoder.buffered_capacity(),
                header + 1
            );
            for chunk in bytes[header + 1..].chunks(4096) {
                push(&mut decoder, chunk, adopt);
            }
            let decoded = decoder.pop().unwrap().expect("whole");
            assert_eq!(decoded.payload(), &payload[..]);
        }
    }

    /// Received buffers are decoded in place: a record lying whole in a pushed buffer is a
    /// view of that buffer's memory, and a record straddling two buffers is joined from
    /// exactly its own bytes, after which decoding goes back to the second buffer in place.
    #[test]
    fn records_are_views_of_the_buffers_they_arrived_in() {
        let records: Vec<ActorRecord> = (0..40u8)
            .map(|i| ActorRecord::new([i; 32], "t", Bytes::from(vec![i; 64])).unwrap())
            .collect();
        let bytes = encode_all(&records);
        let one = bytes.len() / records.len();
        // Cut inside record 13, well past its header, so its length is known.
        let cut = 13 * one + one / 2;
        let first = Bytes::copy_from_slice(&bytes[..cut]);
        let second = Bytes::copy_from_slice(&bytes[cut..]);
        let within = |record: &ActorRecord, buffer: &Bytes| {
            let payload = record.payload().as_ptr() as usize;
            let start = buffer.as_ptr() as usize;
            (start..start + buffer.len()).contains(&payload)
        };
        let mut decoder = StreamDecoder::new(ActorDecoder::default());
        decoder.push_bytes(first.clone());
        decoder.push_bytes(second.clone());
        let mut popped = Vec::new();
        while let Some(record) = decoder.pop().unwrap() {
            popped.push(record);
        }
        assert_eq!(popped, records);
        for (i, record) in popped.iter().enumerate() {
            match i {
                0..=12 => assert!(within(record, &first), "record {i} copied"),
                13 => assert!(
                    !within(record, &first) && !within(record, &second),
                    "the straddling record is joined"
                ),
                _ => assert!(within(record, &second), "record {i} copied"),
            }
        }
        assert_eq!(
            (decoder.buffered_len(), decoder.offset()),
            (0, bytes.len() as u64)
        );
        assert_eq!(decoder.finish(), Ok(()));
    }

    /// A header cut short (its length not known yet) is joined in steps until the record is
    /// whole; a step that copied past the record's end keeps only the record's bytes, so the
    /// records after it are views of the buffer they came in, whole and in order.
    #[test]
    fn a_record_whose_header_straddles_buffers_is_joined() {
        for size in [40usize, 5000] {
            let records: Vec<ActorRecord> = (0..12u8)
                .map(|i| ActorRecord::new([i; 32], "tag", Bytes::from(vec![i; size])).unwrap())
                .collect();
            let bytes = encode_all(&records);
            let one = bytes.len() / records.len();
            for cut in [one + 1, one + DEST_LEN + 2, one + TAG_AT + 1] {
                let parts = [&bytes[..cut], &bytes[cut..cut + 10], &bytes[cut + 10..]]
                    .map(Bytes::copy_from_slice);
                let mut decoder = StreamDecoder::new(ActorDecoder::default());
                let mut popped = Vec::new();
                for part in &parts {
                    decoder.push_bytes(part.clone());
                    while let Some(record) = decoder.pop().unwrap() {
                        popped.push(record);
                    }
                }
                assert_eq!(popped, records, "size {size}, cut {cut}");
                assert_eq!(decoder.buffered_len(), 0);
                let last = &parts[2];
                let (start, end) = (last.as_ptr() as usize, last.as_ptr() as usize + last.len());
                for (i, record) in popped.iter().enumerate().skip(2) {
                    let at = record.payload().as_ptr() as usize;
                    assert!(
                        (start..end).contains(&at),
                        "size {size}, cut {cut}: record {i} was copied"
                    );
                }
            }
        }
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
        /// However the stream is cut into received buffers, a record that lies whole in one
        /// of them is a view of it (no copy); only records across a cut are joined.
        #[test]
        fn only_records_across_a_cut_are_copied(
            records in proptest::collection::vec(record(), 1..12),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
        ) {
            let bytes = encode_all(&records);
            let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
            points.extend([0, bytes.len()]);
            points.sort_unstable();
            points.dedup();
            let parts: Vec<(usize, Bytes)> = points
                .windows(2)
                .map(|w| (w[0], Bytes::copy_from_slice(&bytes[w[0]..w[1]])))
                .collect();
            let mut decoder = StreamDecoder::new(ActorDecoder::default());
            let mut popped = Vec::new();
            for (_, part) in &parts {
                decoder.push_bytes(part.clone());
                while let Some(record) = decoder.pop().unwrap() {
                    popped.push(record);
                }
            }
            prop_assert_eq!(&popped, &records);
            let mut start = 0;
            for record in &popped {
                let mut one = Vec::new();
                record.encode(ACTOR_PAYLOAD_BYTES_DEFAULT, &mut one).unwrap();
                let end = start + one.len();
                let home = parts.iter().find(|(at, part)| *at <= start && end <= at + part.len());
                if let (Some((at, part)), false) = (home, record.payload().is_empty()) {
                    let payload_at = end - record.payload().len() - at;
                    prop_assert_eq!(record.payload().as_ptr(), part[payload_at..].as_ptr());
                }
                start = end;
            }
        }

        #[test]
        fn round_trips_in_every_split(
            records in proptest::collection::vec(record(), 0..8),
            cuts in proptest::collection::vec(any::<usize>(), 0..6),
        ) {
            let bytes = encode_all(&records);
            if let Some(first) = records.first() {
                let one = encode_all(std::slice::from_ref(first));
                prop_assert_eq!(ActorDecoder::default().item_len(&bytes), Some(one.len()));
            }
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
