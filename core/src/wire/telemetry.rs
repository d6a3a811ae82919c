//! DSQ2 telemetry streams (docs/spec/driver.md §5.2–§5.4).
//!
//! One unidirectional stream carries one header and then records, with no outer framing:
//!
//! ```text
//! header  = "DSQ2" flow_id[16] token_len:u16 LE token
//!           varint len + postcard StreamDescriptor
//!           varint len + postcard Vec<ChannelDescriptor>
//! record  = 0x01 varint len + postcard ChannelDescriptor        channel declared
//!         | 0x02 varint len + entries                           raw batch
//!         | 0x03                                                stream ended
//!         | 0x04 varint raw_len varint comp_len + LZ4 block     LZ4 batch (read only)
//!         | 0x05 varint raw_len varint comp_len + zstd frame    zstd batch
//! entry   = varint channel_id, varint position, varint payload_len, payload
//! ```
//!
//! The first entry of a batch carries its absolute position; each later entry carries its
//! position minus the previous entry's, so positions never decrease within a batch.
//!
//! Every error is fatal: a telemetry stream has no frame boundary to resynchronise on.
//! Every record and every decompressed batch is bounded by [`TELEMETRY_RECORD_BYTES_MAX`];
//! every batch, raw or decompressed, by [`TELEMETRY_BATCH_EVENTS_MAX`] events (the most a
//! writer puts in one), counted as its entries are walked, before any frame is handed out: a
//! few hundred compressed bytes can declare megabytes of 3-byte entries, and no reader holds
//! more than one batch's bound of them. Descriptor lists are bounded by
//! [`TELEMETRY_HEADER_CHANNELS_MAX`] and [`TELEMETRY_LABELS_MAX`].

use std::fmt;
use std::marker::PhantomData;

use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Deserializer, Serialize};

use super::varint::{self, VarintError};
use super::{Format, FormatError, Input};
use crate::limits::{
    TELEMETRY_BATCH_BYTES_TARGET, TELEMETRY_BATCH_EVENTS_MAX, TELEMETRY_HEADER_CHANNELS_MAX,
    TELEMETRY_LABELS_MAX, TELEMETRY_RECORD_BYTES_MAX, TELEMETRY_TOKEN_BYTES_MAX,
    TELEMETRY_ZSTD_LEVEL,
};

/// The four bytes every telemetry stream starts with.
pub const MAGIC: [u8; 4] = *b"DSQ2";

/// Record tags.
const TAG_CHANNEL_DECLARED: u8 = 0x01;
const TAG_RAW_BATCH: u8 = 0x02;
const TAG_STREAM_ENDED: u8 = 0x03;
const TAG_LZ4_BATCH: u8 = 0x04;
const TAG_ZSTD_BATCH: u8 = 0x05;

/// Who publishes a stream. Postcard field order is part of the wire format.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamDescriptor {
    /// Stream name.
    pub name: String,
    /// Publishing node (iroh endpoint key).
    pub node_id: [u8; 32],
    /// Unix time the stream started, in milliseconds.
    pub started_at_ms: u64,
    /// Free-form labels, at most [`TELEMETRY_LABELS_MAX`].
    #[serde(deserialize_with = "bounded_seq::<_, _, TELEMETRY_LABELS_MAX>")]
    pub labels: Vec<(String, String)>,
}

/// One channel of a stream. Postcard field order is part of the wire format.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChannelDescriptor {
    /// Id that batch entries cite.
    pub channel_id: u64,
    /// Channel name.
    pub name: String,
    /// Content type of the channel's payloads (opaque to tether).
    pub content_type: String,
    /// Free-form labels, at most [`TELEMETRY_LABELS_MAX`].
    #[serde(deserialize_with = "bounded_seq::<_, _, TELEMETRY_LABELS_MAX>")]
    pub labels: Vec<(String, String)>,
}

/// The header snapshot that opens a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Flow this stream belongs to.
    pub flow_id: [u8; 16],
    /// Subscription token, at most [`TELEMETRY_TOKEN_BYTES_MAX`] bytes.
    pub token: Bytes,
    /// The stream.
    pub stream: StreamDescriptor,
    /// Channels known when the stream opened, at most [`TELEMETRY_HEADER_CHANNELS_MAX`].
    pub channels: Vec<ChannelDescriptor>,
}

/// One telemetry event: a payload at a position of a channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TelemetryFrame {
    /// Channel the event belongs to.
    pub channel_id: u64,
    /// Absolute position (at most 63 bits).
    pub position: u64,
    /// Opaque payload.
    pub payload: Bytes,
}

/// How a batch travelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Record `0x02`.
    None,
    /// Record `0x04` (accepted from older senders, never written).
    Lz4,
    /// Record `0x05`.
    Zstd,
}

impl Compression {
    /// `none`, `lz4` or `zstd`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Lz4 => "lz4",
            Self::Zstd => "zstd",
        }
    }
}

/// A validated batch. Its frames are decoded lazily from the raw entries, which were fully
/// checked when the batch was decoded, so iterating cannot fail and allocates nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    compression: Compression,
    entries: Bytes,
    len: usize,
}

impl Batch {
    /// How the batch travelled.
    pub fn compression(&self) -> Compression {
        self.compression
    }

    /// Number of frames.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a batch without frames.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The batch's entry bytes as they were before compression (validated), for callers that
    /// store or forward batches without looking inside.
    pub fn raw_entries(&self) -> &Bytes {
        &self.entries
    }

    /// The frames, with absolute positions, in stream order.
    pub fn frames(&self) -> BatchFrames<'_> {
        BatchFrames {
            entries: &self.entries,
            at: 0,
            previous: None,
        }
    }
}

/// Iterator over a [`Batch`].
#[derive(Debug, Clone)]
pub struct BatchFrames<'a> {
    entries: &'a Bytes,
    at: usize,
    previous: Option<u64>,
}

impl Iterator for BatchFrames<'_> {
    type Item = TelemetryFrame;

    fn next(&mut self) -> Option<TelemetryFrame> {
        if self.at == self.entries.len() {
            return None;
        }
        // `validate_entries` walked these exact bytes with the same parser and succeeded.
        let entry = parse_entry(self.entries, self.at, self.previous)
            .expect("batch entries were validated at decode");
        self.at = entry.payload.end;
        self.previous = Some(entry.position);
        let payload = self.entries.slice(entry.payload);
        Some(TelemetryFrame {
            channel_id: entry.channel_id,
            position: entry.position,
            payload,
        })
    }
}

/// One item of a telemetry stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TelemetryItem {
    /// The header; always the first item.
    Header(Header),
    /// Record `0x01`.
    ChannelDeclared(ChannelDescriptor),
    /// Records `0x02`, `0x04`, `0x05`.
    Batch(Batch),
    /// Record `0x03`; nothing may follow it.
    StreamEnded,
}

/// Why a telemetry stream could not be decoded (or encoded).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TelemetryError {
    /// The stream ended inside the header or a record.
    #[error("telemetry stream ends inside an item ({buffered} bytes left)")]
    Truncated {
        /// Bytes of the incomplete item.
        buffered: u64,
    },
    /// The stream does not start with `DSQ2`.
    #[error("telemetry stream does not start with DSQ2")]
    BadMagic,
    /// A header token longer than `u16::MAX` (encode side only: the length is a `u16`).
    #[error("telemetry token of {len} bytes exceeds {TELEMETRY_TOKEN_BYTES_MAX}")]
    TokenTooLong {
        /// Token length.
        len: u64,
    },
    /// A malformed varint.
    #[error("telemetry varint: {0}")]
    Varint(#[from] VarintError),
    /// A record, descriptor or decompressed batch above [`TELEMETRY_RECORD_BYTES_MAX`].
    #[error("telemetry record of {len} bytes exceeds {TELEMETRY_RECORD_BYTES_MAX}")]
    RecordTooLarge {
        /// Declared length.
        len: u64,
    },
    /// A record tag outside `0x01..=0x05`.
    #[error("unknown telemetry record tag {tag:#04x}")]
    UnknownRecord {
        /// The tag byte.
        tag: u8,
    },
    /// A descriptor that is not the postcard the format defines (or exceeds a count bound).
    #[error("telemetry descriptor does not decode")]
    BadDescriptor,
    /// A batch entry runs past its batch.
    #[error("telemetry batch entry runs past its batch")]
    BadEntry,
    /// A batch of more than [`TELEMETRY_BATCH_EVENTS_MAX`] events.
    #[error("telemetry batch of more than {TELEMETRY_BATCH_EVENTS_MAX} events")]
    TooManyEvents,
    /// An absolute position above 63 bits.
    #[error("telemetry position overflows 63 bits")]
    PositionOverflow,
    /// Compressed bytes that do not decompress.
    #[error("{compression} batch does not decompress")]
    Decompress {
        /// `lz4` or `zstd`.
        compression: &'static str,
    },
    /// A decompressed batch whose size is not the declared raw length.
    #[error("batch decompressed to {actual} bytes, declared {declared}")]
    RawLengthMismatch {
        /// Declared raw length.
        declared: u64,
        /// Decompressed length.
        actual: u64,
    },
    /// Bytes after the stream-ended record.
    #[error("bytes after the stream-ended record")]
    TrailingAfterEnd,
    /// A value the format cannot carry (encode side): a channel id or position above 63 bits,
    /// or more labels or channels than the bounds allow.
    #[error("value does not fit the telemetry format: {what}")]
    Unencodable {
        /// What did not fit.
        what: &'static str,
    },
}

impl FormatError for TelemetryError {
    fn is_fatal(&self) -> bool {
        true
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Truncated { .. } => "truncated",
            Self::BadMagic => "bad_magic",
            Self::TokenTooLong { .. } => "token_too_long",
            Self::Varint(VarintError::Overlong) => "varint_overlong",
            Self::Varint(_) => "varint_too_long",
            Self::RecordTooLarge { .. } => "record_too_large",
            Self::UnknownRecord { .. } => "unknown_record",
            Self::BadDescriptor => "bad_descriptor",
            Self::BadEntry => "bad_entry",
            Self::TooManyEvents => "too_many_events",
            Self::PositionOverflow => "position_overflow",
            Self::Decompress { .. } => "decompress_failed",
            Self::RawLengthMismatch { .. } => "raw_length_mismatch",
            Self::TrailingAfterEnd => "trailing_after_end",
            Self::Unencodable { .. } => "unencodable",
        }
    }
}

/// The telemetry [`Format`]; wrap it in a [`super::StreamDecoder`]. A value decodes one
/// stream from its first byte (it keeps the header's phase, and a parsed descriptor while the
/// header arrives): a new stream takes a new decoder.
#[derive(Debug, Clone, Default)]
pub struct TelemetryDecoder {
    phase: Phase,
    /// The header's stream descriptor once parsed, and where its bytes lie (from the header's
    /// first byte), while the channel list is still arriving: a descriptor of up to
    /// [`TELEMETRY_RECORD_BYTES_MAX`] is parsed once, not again on every arrival. Used only
    /// when the bytes before it say the descriptor lies exactly there again.
    stream: Option<(StreamDescriptor, std::ops::Range<usize>)>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Phase {
    #[default]
    Header,
    Records,
    Ended,
}

impl Format for TelemetryDecoder {
    type Item = TelemetryItem;
    type Error = TelemetryError;

    fn decode<I: Input>(&mut self, buf: &mut I) -> Result<Option<TelemetryItem>, TelemetryError> {
        let step = match self.phase {
            Phase::Header => decode_header(buf, &mut self.stream),
            Phase::Records => decode_record(buf),
            Phase::Ended if buf.is_empty() => Err(Stop::More),
            Phase::Ended => Err(Stop::Fail(TelemetryError::TrailingAfterEnd)),
        };
        match step {
            Ok(item) => {
                self.phase = match item {
                    TelemetryItem::StreamEnded => Phase::Ended,
                    _ => Phase::Records,
                };
                Ok(Some(item))
            }
            Err(Stop::More) => Ok(None),
            Err(Stop::Fail(error)) => Err(error),
        }
    }

    fn item_len(&self, buf: &[u8]) -> Option<usize> {
        match self.phase {
            Phase::Header => return header_len(buf),
            Phase::Records => {}
            Phase::Ended => return None,
        }
        let mut peek = Peek { buf, at: 0 };
        let body = match peek.take(1).ok()?[0] {
            TAG_CHANNEL_DECLARED | TAG_RAW_BATCH => peek.length().ok()?,
            TAG_LZ4_BATCH | TAG_ZSTD_BATCH => {
                peek.length().ok()?;
                peek.length().ok()?
            }
            // A stream's end is one byte; anything else is refused by `decode`.
            _ => return None,
        };
        peek.at.checked_add(body)
    }

    fn finish(&self, buffered: usize) -> Result<(), TelemetryError> {
        // A stream that never carried its header is truncated even when nothing is buffered.
        if buffered > 0 || self.phase == Phase::Header {
            return Err(TelemetryError::Truncated {
                buffered: buffered as u64,
            });
        }
        Ok(())
    }
}

/// Why a parse step stopped: it needs more bytes, or the stream is bad.
enum Stop {
    More,
    Fail(TelemetryError),
}

impl<E: Into<TelemetryError>> From<E> for Stop {
    fn from(error: E) -> Self {
        Stop::Fail(error.into())
    }
}

/// A cursor over buffered bytes that may not yet hold a whole item.
struct Peek<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Peek<'a> {
    fn take(&mut self, len: usize) -> Result<&'a [u8], Stop> {
        let end = self.at.checked_add(len).ok_or(Stop::More)?;
        let bytes = self.buf.get(self.at..end).ok_or(Stop::More)?;
        self.at = end;
        Ok(bytes)
    }

    fn varint(&mut self) -> Result<u64, Stop> {
        let rest = self.buf.get(self.at..).unwrap_or_default();
        let (value, len) = varint::decode(rest)?.ok_or(Stop::More)?;
        self.at += len;
        Ok(value)
    }

    /// A varint length, checked against the record bound before anything waits for it.
    fn length(&mut self) -> Result<usize, Stop> {
        let len = self.varint()?;
        match usize::try_from(len) {
            Ok(len) if len <= TELEMETRY_RECORD_BYTES_MAX => Ok(len),
            _ => Err(TelemetryError::RecordTooLarge { len }.into()),
        }
    }
}

fn decode_header<I: Input>(
    buf: &mut I,
    parsed: &mut Option<(StreamDescriptor, std::ops::Range<usize>)>,
) -> Result<TelemetryItem, Stop> {
    let prefix = &buf[..buf.len().min(MAGIC.len())];
    if prefix != &MAGIC[..prefix.len()] {
        return Err(TelemetryError::BadMagic.into());
    }
    let mut peek = Peek { buf, at: 0 };
    peek.take(MAGIC.len())?;
    let flow_id: [u8; 16] = peek.take(16)?.try_into().expect("take(16) yields 16 bytes");
    let token_len = peek.take(2)?;
    let token_len = usize::from(u16::from_le_bytes([token_len[0], token_len[1]]));
    let token_at = peek.at;
    peek.take(token_len)?;
    let stream_len = peek.length()?;
    // `buf` starts at the header's first byte on every call, so the descriptor parsed before
    // lies where it lay (checked: a memo never stands for other bytes).
    let at = peek.at..peek.at.checked_add(stream_len).ok_or(Stop::More)?;
    let stream = match parsed.take() {
        Some((stream, lay)) if lay == at => {
            peek.at = at.end;
            stream
        }
        _ => postcard_exact(peek.take(stream_len)?)?,
    };
    let channels = (|| {
        let channels_len = peek.length()?;
        let channels: ChannelList = postcard_exact(peek.take(channels_len)?)?;
        Ok(channels)
    })();
    let channels = match channels {
        Ok(channels) => channels,
        Err(Stop::More) => {
            *parsed = Some((stream, at));
            return Err(Stop::More);
        }
        Err(stop) => return Err(stop),
    };
    let header_len = peek.at;
    let header = buf.split_front(header_len);
    let token = header.slice(token_at..token_at + token_len);
    Ok(TelemetryItem::Header(Header {
        flow_id,
        token,
        stream,
        channels: channels.0,
    }))
}

/// The length of the header at the front of `buf`, once its lengths are there (the token's
/// bytes and the descriptor's are skipped, not read).
fn header_len(buf: &[u8]) -> Option<usize> {
    let mut peek = Peek { buf, at: 0 };
    peek.take(MAGIC.len() + 16).ok()?;
    let token_len = peek.take(2).ok()?;
    let token_len = usize::from(u16::from_le_bytes([token_len[0], token_len[1]]));
    peek.at = peek.at.checked_add(token_len)?;
    let stream_len = peek.length().ok()?;
    peek.at = peek.at.checked_add(stream_len)?;
    let channels_len = peek.length().ok()?;
    peek.at.checked_add(channels_len)
}

fn decode_record<I: Input>(buf: &mut I) -> Result<TelemetryItem, Stop> {
    let mut peek = Peek { buf, at: 0 };
    let tag = peek.take(1)?[0];
    match tag {
        TAG_CHANNEL_DECLARED => {
            let len = peek.length()?;
            let channel = postcard_exact(peek.take(len)?)?;
            let _ = buf.split_front(peek.at);
            Ok(TelemetryItem::ChannelDeclared(channel))
        }
        TAG_RAW_BATCH => {
            let len = peek.length()?;
            let entries_at = peek.at;
            let entries = &buf[entries_at..];
            if entries.len() < len {
                return Err(Stop::More);
            }
            let count = validate_entries(&entries[..len])?;
            let entries = buf.split_front(entries_at + len).split_off(entries_at);
            Ok(TelemetryItem::Batch(Batch {
                compression: Compression::None,
                entries,
                len: count,
            }))
        }
        TAG_STREAM_ENDED => {
            let _ = buf.split_front(1);
            Ok(TelemetryItem::StreamEnded)
        }
        TAG_LZ4_BATCH | TAG_ZSTD_BATCH => {
            let raw_len = peek.length()?;
            let compressed_len = peek.length()?;
            let compressed = peek.take(compressed_len)?;
            let compression = if tag == TAG_LZ4_BATCH {
                Compression::Lz4
            } else {
                Compression::Zstd
            };
            let entries = decompress(compression, compressed, raw_len)?;
            let count = validate_entries(&entries)?;
            let _ = buf.split_front(peek.at);
            Ok(TelemetryItem::Batch(Batch {
                compression,
                entries: entries.into(),
                len: count,
            }))
        }
        tag => Err(TelemetryError::UnknownRecord { tag }.into()),
    }
}

/// Decompresses into at most `raw_len` bytes (already bounded by the record limit) and checks
/// the result is exactly `raw_len` long.
fn decompress(
    compression: Compression,
    compressed: &[u8],
    raw_len: usize,
) -> Result<Vec<u8>, TelemetryError> {
    let failed = TelemetryError::Decompress {
        compression: compression.as_str(),
    };
    let raw = match compression {
        Compression::Lz4 => lz4_flex::block::decompress(compressed, raw_len).map_err(|_| failed)?,
        _ => zstd::bulk::decompress(compressed, raw_len).map_err(|_| failed)?,
    };
    if raw.len() != raw_len {
        let (declared, actual) = (raw_len as u64, raw.len() as u64);
        return Err(TelemetryError::RawLengthMismatch { declared, actual });
    }
    Ok(raw)
}

/// Walks every entry of a batch, returning how many there are (at most
/// [`TELEMETRY_BATCH_EVENTS_MAX`]: the walk stops at the first entry past it).
fn validate_entries(entries: &[u8]) -> Result<usize, TelemetryError> {
    let (mut at, mut count, mut previous) = (0, 0, None);
    while at < entries.len() {
        if count == TELEMETRY_BATCH_EVENTS_MAX {
            return Err(TelemetryError::TooManyEvents);
        }
        let entry = parse_entry(entries, at, previous)?;
        previous = Some(entry.position);
        at = entry.payload.end;
        count += 1;
    }
    Ok(count)
}

/// One entry as parsed in place: absolute position and where its payload lies.
struct EntryAt {
    channel_id: u64,
    position: u64,
    payload: std::ops::Range<usize>,
}

/// Parses the entry starting at `at`; `previous` is the prior entry's absolute position.
fn parse_entry(
    entries: &[u8],
    at: usize,
    previous: Option<u64>,
) -> Result<EntryAt, TelemetryError> {
    let mut peek = Peek { buf: entries, at };
    let parsed = (|| {
        let channel_id = peek.varint()?;
        let encoded_position = peek.varint()?;
        let len = usize::try_from(peek.varint()?).map_err(|_| Stop::More)?;
        let payload_at = peek.at;
        peek.take(len)?;
        Ok::<_, Stop>((channel_id, encoded_position, payload_at..peek.at))
    })();
    let (channel_id, encoded_position, payload) = match parsed {
        Ok(parsed) => parsed,
        // Inside a complete batch, "needs more bytes" means the entry overruns the batch.
        Err(Stop::More) => return Err(TelemetryError::BadEntry),
        Err(Stop::Fail(error)) => return Err(error),
    };
    let position = match previous {
        None => Some(encoded_position),
        Some(previous) => previous.checked_add(encoded_position),
    };
    match position {
        Some(position) if varint::fits(position) => Ok(EntryAt {
            channel_id,
            position,
            payload,
        }),
        _ => Err(TelemetryError::PositionOverflow),
    }
}

/// Decodes one postcard value that must span exactly `bytes`.
fn postcard_exact<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, TelemetryError> {
    match postcard::take_from_bytes(bytes) {
        Ok((value, [])) => Ok(value),
        _ => Err(TelemetryError::BadDescriptor),
    }
}

/// The header's channel list, decoded under [`TELEMETRY_HEADER_CHANNELS_MAX`].
#[derive(Deserialize)]
struct ChannelList(
    #[serde(deserialize_with = "bounded_seq::<_, _, TELEMETRY_HEADER_CHANNELS_MAX>")]
    Vec<ChannelDescriptor>,
);

/// Deserializes a sequence, refusing more than `MAX` elements before allocating for them.
fn bounded_seq<'de, D, T, const MAX: usize>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Bounded<T, const MAX: usize>(PhantomData<T>);

    impl<'de, T: Deserialize<'de>, const MAX: usize> serde::de::Visitor<'de> for Bounded<T, MAX> {
        type Value = Vec<T>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "a sequence of at most {MAX} elements")
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let declared = seq.size_hint().unwrap_or(0);
            if declared > MAX {
                return Err(serde::de::Error::invalid_length(declared, &self));
            }
            let mut items = Vec::with_capacity(declared);
            while let Some(item) = seq.next_element()? {
                if items.len() == MAX {
                    return Err(serde::de::Error::invalid_length(MAX + 1, &self));
                }
                items.push(item);
            }
            Ok(items)
        }
    }

    deserializer.deserialize_seq(Bounded::<T, MAX>(PhantomData))
}

// ---------------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------------

impl Header {
    /// Appends the header, refusing anything its decoder would reject.
    pub fn encode(&self, out: &mut BytesMut) -> Result<(), TelemetryError> {
        if self.token.len() > TELEMETRY_TOKEN_BYTES_MAX {
            return Err(TelemetryError::TokenTooLong {
                len: self.token.len() as u64,
            });
        }
        check_labels(&self.stream.labels)?;
        if self.channels.len() > TELEMETRY_HEADER_CHANNELS_MAX {
            return Err(TelemetryError::Unencodable {
                what: "more channels than the bound",
            });
        }
        self.channels
            .iter()
            .try_for_each(|c| check_labels(&c.labels))?;
        let stream = postcard_bytes(&self.stream)?;
        let channels = postcard_bytes(&self.channels)?;
        out.put_slice(&MAGIC);
        out.put_slice(&self.flow_id);
        out.put_u16_le(self.token.len() as u16);
        out.put_slice(&self.token);
        put_length_prefixed(&stream, out);
        put_length_prefixed(&channels, out);
        Ok(())
    }
}

/// Appends a `0x01` channel-declared record.
pub fn encode_channel_declared(
    channel: &ChannelDescriptor,
    out: &mut BytesMut,
) -> Result<(), TelemetryError> {
    check_labels(&channel.labels)?;
    let bytes = postcard_bytes(channel)?;
    out.put_u8(TAG_CHANNEL_DECLARED);
    put_length_prefixed(&bytes, out);
    Ok(())
}

/// Appends the `0x03` stream-ended record.
pub fn encode_stream_ended(out: &mut BytesMut) {
    out.put_u8(TAG_STREAM_ENDED);
}

/// Appends one batch holding exactly `frames`, raw or zstd (never LZ4, which is read-only).
///
/// Positions must not decrease (a batch carries unsigned deltas), the raw entries must fit
/// [`TELEMETRY_RECORD_BYTES_MAX`] and there may be at most [`TELEMETRY_BATCH_EVENTS_MAX`]
/// frames. [`BatchWriter`] is the writer that picks batch boundaries
/// and compression by itself; this is the exact-control form.
pub fn encode_batch(
    frames: &[TelemetryFrame],
    compression: Compression,
    out: &mut BytesMut,
) -> Result<(), TelemetryError> {
    if frames.len() > TELEMETRY_BATCH_EVENTS_MAX {
        return Err(TelemetryError::Unencodable {
            what: "more events than a batch holds",
        });
    }
    let mut entries = Vec::new();
    let mut previous = None;
    for frame in frames {
        if previous.is_some_and(|previous| frame.position < previous) {
            return Err(TelemetryError::Unencodable {
                what: "a position below its predecessor",
            });
        }
        entry_len(frame)?;
        put_entry(frame, previous, &mut entries);
        previous = Some(frame.position);
    }
    if entries.len() > TELEMETRY_RECORD_BYTES_MAX {
        return Err(TelemetryError::RecordTooLarge {
            len: entries.len() as u64,
        });
    }
    match compression {
        Compression::None => put_raw_batch(&entries, out),
        Compression::Zstd => {
            let compressed =
                zstd::bulk::compress(&entries, TELEMETRY_ZSTD_LEVEL).map_err(|_| {
                    TelemetryError::Unencodable {
                        what: "zstd refused the batch",
                    }
                })?;
            if compressed.len() > TELEMETRY_RECORD_BYTES_MAX {
                return Err(TelemetryError::RecordTooLarge {
                    len: compressed.len() as u64,
                });
            }
            put_compressed_batch(TAG_ZSTD_BATCH, entries.len(), &compressed, out);
        }
        Compression::Lz4 => {
            return Err(TelemetryError::Unencodable {
                what: "LZ4 batches are read-only",
            });
        }
    }
    Ok(())
}

/// Batches telemetry events the way docs/spec/driver.md §5.3 prescribes.
///
/// Events are taken without waiting; a batch closes at [`TELEMETRY_BATCH_BYTES_TARGET`] raw
/// bytes, at [`TELEMETRY_BATCH_EVENTS_MAX`] events, or before an event whose position is below
/// its predecessor's. A closed batch is written as zstd level 1 only when the whole compressed
/// record is smaller than the raw record.
pub struct BatchWriter {
    compressor: zstd::bulk::Compressor<'static>,
    entries: Vec<u8>,
    compressed: Vec<u8>,
    count: usize,
    previous: Option<u64>,
    stats: BatchWriterStats,
}

/// What a [`BatchWriter`] has written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchWriterStats {
    /// Events written.
    pub events: u64,
    /// Batches written raw (`0x02`).
    pub raw_batches: u64,
    /// Batches written compressed (`0x05`).
    pub zstd_batches: u64,
}

impl fmt::Debug for BatchWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchWriter")
            .field("pending_events", &self.count)
            .field("pending_bytes", &self.entries.len())
            .field("stats", &self.stats)
            .finish()
    }
}

impl BatchWriter {
    /// A writer with an empty batch.
    ///
    /// # Panics
    /// If zstd cannot allocate a compression context (out of memory).
    pub fn new() -> Self {
        let compressor = zstd::bulk::Compressor::new(TELEMETRY_ZSTD_LEVEL)
            .expect("zstd accepts level 1 and allocates a context");
        Self {
            compressor,
            entries: Vec::with_capacity(TELEMETRY_BATCH_BYTES_TARGET),
            compressed: Vec::new(),
            count: 0,
            previous: None,
            stats: BatchWriterStats::default(),
        }
    }

    /// Takes events from `next` until it returns `None` (nothing more available right now),
    /// writes every batch they fill into `out`, and closes the last one. Returns the number of
    /// events taken.
    pub fn drain(
        &mut self,
        mut next: impl FnMut() -> Option<TelemetryFrame>,
        out: &mut BytesMut,
    ) -> Result<usize, TelemetryError> {
        let mut taken = 0;
        while let Some(frame) = next() {
            self.push(&frame, out)?;
            taken += 1;
        }
        self.flush(out);
        Ok(taken)
    }

    /// Adds one event, first closing the open batch into `out` if the event does not belong in
    /// it. A refused event leaves the writer unchanged.
    pub fn push(
        &mut self,
        frame: &TelemetryFrame,
        out: &mut BytesMut,
    ) -> Result<(), TelemetryError> {
        let entry_len = entry_len(frame)?;
        if entry_len > TELEMETRY_RECORD_BYTES_MAX {
            return Err(TelemetryError::RecordTooLarge {
                len: entry_len as u64,
            });
        }
        let goes_backwards = self
            .previous
            .is_some_and(|previous| frame.position < previous);
        let overflows = self.entries.len() + entry_len > TELEMETRY_BATCH_BYTES_TARGET;
        if self.count > 0 && (goes_backwards || overflows) {
            self.flush(out);
        }
        put_entry(frame, self.previous, &mut self.entries);
        self.previous = Some(frame.position);
        self.count += 1;
        self.stats.events += 1;
        if self.count == TELEMETRY_BATCH_EVENTS_MAX
            || self.entries.len() >= TELEMETRY_BATCH_BYTES_TARGET
        {
            self.flush(out);
        }
        Ok(())
    }

    /// Closes the open batch (if any) into `out`.
    pub fn flush(&mut self, out: &mut BytesMut) {
        if self.count == 0 {
            return;
        }
        debug_assert!(self.entries.len() <= TELEMETRY_RECORD_BYTES_MAX);
        let raw_record_len =
            1 + varint::encoded_len(self.entries.len() as u64) + self.entries.len();
        self.compressed.clear();
        self.compressed
            .reserve(zstd::zstd_safe::compress_bound(self.entries.len()));
        let compressed = self
            .compressor
            .compress_to_buffer(&self.entries, &mut self.compressed);
        let zstd_record_len = compressed.ok().map(|len| {
            1 + varint::encoded_len(self.entries.len() as u64)
                + varint::encoded_len(len as u64)
                + len
        });
        match zstd_record_len {
            Some(len) if len < raw_record_len => {
                put_compressed_batch(TAG_ZSTD_BATCH, self.entries.len(), &self.compressed, out);
                self.stats.zstd_batches += 1;
            }
            _ => {
                put_raw_batch(&self.entries, out);
                self.stats.raw_batches += 1;
            }
        }
        self.entries.clear();
        self.count = 0;
        self.previous = None;
    }

    /// What has been written so far.
    pub fn stats(&self) -> BatchWriterStats {
        self.stats
    }
}

impl Default for BatchWriter {
    fn default() -> Self {
        Self::new()
    }
}

fn check_labels(labels: &[(String, String)]) -> Result<(), TelemetryError> {
    if labels.len() > TELEMETRY_LABELS_MAX {
        return Err(TelemetryError::Unencodable {
            what: "more labels than the bound",
        });
    }
    Ok(())
}

fn postcard_bytes<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, TelemetryError> {
    let bytes = postcard::to_allocvec(value).map_err(|_| TelemetryError::Unencodable {
        what: "postcard refused the descriptor",
    })?;
    if bytes.len() > TELEMETRY_RECORD_BYTES_MAX {
        return Err(TelemetryError::RecordTooLarge {
            len: bytes.len() as u64,
        });
    }
    Ok(bytes)
}

fn put_length_prefixed(bytes: &[u8], out: &mut BytesMut) {
    varint::encode(bytes.len() as u64, out);
    out.put_slice(bytes);
}

fn entry_len(frame: &TelemetryFrame) -> Result<usize, TelemetryError> {
    if !varint::fits(frame.channel_id) || !varint::fits(frame.position) {
        return Err(TelemetryError::Unencodable {
            what: "a channel id or position above 63 bits",
        });
    }
    let len = frame.payload.len();
    // Deltas are never larger than absolute positions, so this bounds the entry from above.
    Ok(varint::encoded_len(frame.channel_id)
        + varint::encoded_len(frame.position)
        + varint::encoded_len(len as u64)
        + len)
}

/// Appends one entry; the caller has checked it with [`entry_len`] and ordered positions.
fn put_entry(frame: &TelemetryFrame, previous: Option<u64>, out: &mut Vec<u8>) {
    let position = match previous {
        Some(previous) => {
            debug_assert!(
                frame.position >= previous,
                "callers start a new batch first"
            );
            frame.position - previous
        }
        None => frame.position,
    };
    varint::encode(frame.channel_id, out);
    varint::encode(position, out);
    varint::encode(frame.payload.len() as u64, out);
    out.extend_from_slice(&frame.payload);
}

fn put_raw_batch(entries: &[u8], out: &mut BytesMut) {
    out.put_u8(TAG_RAW_BATCH);
    put_length_prefixed(entries, out);
}

fn put_compressed_batch(tag: u8, raw_len: usize, compressed: &[u8], out: &mut BytesMut) {
    out.put_u8(tag);
    varint::encode(raw_len as u64, out);
    put_length_prefixed(compressed, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testing::{check_malformed, decode_split, golden};
    use proptest::prelude::*;

    fn frame(channel_id: u64, position: u64, payload: &[u8]) -> TelemetryFrame {
        TelemetryFrame {
            channel_id,
            position,
            payload: Bytes::copy_from_slice(payload),
        }
    }

    fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn golden_header() -> Header {
        Header {
            flow_id: core::array::from_fn(|i| i as u8),
            token: Bytes::from_static(b"abc"),
            stream: StreamDescriptor {
                name: "node-a".into(),
                node_id: [0xaa; 32],
                started_at_ms: 1_700_000_000_000,
                labels: labels(&[("env", "test")]),
            },
            channels: vec![ChannelDescriptor {
                channel_id: 7,
                name: "cpu".into(),
                content_type: "application/json".into(),
                labels: vec![],
            }],
        }
    }

    fn mem_channel() -> ChannelDescriptor {
        ChannelDescriptor {
            channel_id: 9,
            name: "mem".into(),
            content_type: "text/plain".into(),
            labels: labels(&[("unit", "kb")]),
        }
    }

    fn batch_frames(item: &TelemetryItem) -> (Compression, Vec<TelemetryFrame>) {
        match item {
            TelemetryItem::Batch(batch) => (batch.compression(), batch.frames().collect()),
            other => panic!("expected a batch, got {other:?}"),
        }
    }

    #[test]
    fn golden_valid_stream_decodes_and_its_raw_records_encode_identically() {
        let text = include_str!("../../tests/golden/telemetry/valid_stream.hex");
        let bytes = golden(text);
        let raw = vec![
            frame(7, 100, b"a"),
            frame(9, 105, b"bc"),
            frame(7, 105, b""),
        ];
        let compressed: Vec<_> = (0..4)
            .map(|i| frame(7, 1000 + i * 10, &[b'x'; 64]))
            .collect();
        for cut in [0, 1, 5, 30, 90, 130, bytes.len() - 1] {
            let (items, verdict) = decode_split(TelemetryDecoder::default(), &bytes, &[cut]);
            assert_eq!(verdict, Ok(()));
            assert_eq!(items.len(), 6);
            assert_eq!(items[0], TelemetryItem::Header(golden_header()));
            assert_eq!(items[1], TelemetryItem::ChannelDeclared(mem_channel()));
            assert_eq!(batch_frames(&items[2]), (Compression::None, raw.clone()));
            assert_eq!(
                batch_frames(&items[3]),
                (Compression::Zstd, compressed.clone())
            );
            assert_eq!(
                batch_frames(&items[4]),
                (Compression::Lz4, compressed.clone())
            );
            assert_eq!(items[5], TelemetryItem::StreamEnded);
        }
        // A byte at a time (copied and adopted in turn): the header is joined by its length
        // and its descriptor, parsed once its bytes are in, is kept while the channels come.
        let mut header = BytesMut::new();
        golden_header().encode(&mut header).unwrap();
        let decoder = TelemetryDecoder::default();
        assert_eq!(decoder.item_len(&bytes), Some(header.len()));
        assert_eq!(
            decoder.item_len(&bytes[..header.len() - 1]),
            Some(header.len())
        );
        let every: Vec<usize> = (0..bytes.len()).collect();
        let (items, verdict) = decode_split(TelemetryDecoder::default(), &bytes, &every);
        assert_eq!(verdict, Ok(()));
        assert_eq!(items.len(), 6);
        assert_eq!(items[0], TelemetryItem::Header(golden_header()));
        assert_eq!(items[5], TelemetryItem::StreamEnded);
        // The encoder writes the hand-computed bytes (zstd output may vary by library version,
        // so only the records without compression are compared byte for byte).
        let mut out = BytesMut::new();
        golden_header().encode(&mut out).unwrap();
        encode_channel_declared(&mem_channel(), &mut out).unwrap();
        encode_batch(&raw, Compression::None, &mut out).unwrap();
        assert_eq!(&out[..], &bytes[..out.len()]);
        let mut end = BytesMut::new();
        encode_stream_ended(&mut end);
        assert_eq!(&end[..], &bytes[bytes.len() - 1..]);
    }

    #[test]
    fn golden_malformed_vectors() {
        let vectors = [
            include_str!("../../tests/golden/telemetry/malformed_bad_magic.hex"),
            include_str!("../../tests/golden/telemetry/malformed_unknown_record.hex"),
            include_str!("../../tests/golden/telemetry/malformed_varint_overlong.hex"),
            include_str!("../../tests/golden/telemetry/malformed_record_too_large.hex"),
            include_str!("../../tests/golden/telemetry/malformed_raw_length_mismatch.hex"),
            include_str!("../../tests/golden/telemetry/malformed_bad_entry.hex"),
            include_str!("../../tests/golden/telemetry/malformed_too_many_events.hex"),
            include_str!("../../tests/golden/telemetry/malformed_trailing_after_end.hex"),
            include_str!("../../tests/golden/telemetry/malformed_truncated_header.hex"),
        ];
        for text in vectors {
            check_malformed(TelemetryDecoder::default(), text);
        }
    }

    /// A decompression bomb: a zstd batch of well under 1 KiB declaring 16 MiB of 3-byte
    /// entries is refused at the batch's event bound, and so is a raw batch one event past it;
    /// a batch of exactly the bound decodes, and the encoder refuses to write one past it.
    #[test]
    fn a_batch_past_the_event_bound_is_refused_however_it_travels() {
        let raw_len = TELEMETRY_RECORD_BYTES_MAX / 3 * 3;
        let compressed = zstd::bulk::compress(&vec![0; raw_len], 19).unwrap();
        assert!(compressed.len() < 1024);
        let mut bytes = BytesMut::new();
        golden_header().encode(&mut bytes).unwrap();
        let header_len = bytes.len() as u64;
        put_compressed_batch(TAG_ZSTD_BATCH, raw_len, &compressed, &mut bytes);
        let (items, verdict) = decode_split(TelemetryDecoder::default(), &bytes, &[]);
        assert_eq!(items.len(), 1, "the header only");
        let error = verdict.unwrap_err();
        assert_eq!(
            (error.error, error.offset),
            (TelemetryError::TooManyEvents, header_len)
        );

        let at_bound: Vec<_> = (0..TELEMETRY_BATCH_EVENTS_MAX as u64)
            .map(|i| frame(1, i, &[]))
            .collect();
        let mut bytes = BytesMut::new();
        golden_header().encode(&mut bytes).unwrap();
        encode_batch(&at_bound, Compression::Zstd, &mut bytes).unwrap();
        let (items, _) = decode_split(TelemetryDecoder::default(), &bytes, &[]);
        assert_eq!(items.len(), 2, "the header and the batch");
        assert_eq!(batch_frames(&items[1]).1, at_bound);
        let past: Vec<_> = (0..=TELEMETRY_BATCH_EVENTS_MAX as u64)
            .map(|i| frame(1, i, &[]))
            .collect();
        assert!(matches!(
            encode_batch(&past, Compression::None, &mut BytesMut::new()),
            Err(TelemetryError::Unencodable { .. })
        ));
    }

    #[test]
    fn empty_stream_is_truncated() {
        let (items, verdict) = decode_split(TelemetryDecoder::default(), &[], &[]);
        assert!(items.is_empty());
        assert_eq!(
            verdict.unwrap_err().error,
            TelemetryError::Truncated { buffered: 0 }
        );
    }

    #[test]
    fn writer_closes_batches_at_the_event_and_byte_bounds() {
        let mut writer = BatchWriter::new();
        let mut out = BytesMut::new();
        let mut source = (0..2500u64).map(|i| frame(1, i, &[i as u8; 8]));
        let taken = writer.drain(|| source.next(), &mut out).unwrap();
        assert_eq!(taken, 2500);
        let batches = decode_batches(&out);
        let sizes: Vec<usize> = batches.iter().map(Vec::len).collect();
        assert_eq!(sizes, [1024, 1024, 452]);
        let all: Vec<_> = batches.concat();
        assert_eq!(
            all,
            (0..2500u64)
                .map(|i| frame(1, i, &[i as u8; 8]))
                .collect::<Vec<_>>()
        );

        // 100 events of 4 KiB: the batch closes before passing 256 KiB.
        let mut out = BytesMut::new();
        let mut source = (0..100u64).map(|i| frame(2, i, &vec![(i % 251) as u8; 4096]));
        writer.drain(|| source.next(), &mut out).unwrap();
        for batch in decode_batches(&out) {
            let raw: usize = batch.iter().map(|f| f.payload.len() + 6).sum();
            assert!(
                raw <= TELEMETRY_BATCH_BYTES_TARGET,
                "batch of {raw} raw bytes"
            );
        }
    }

    #[test]
    fn writer_starts_a_new_batch_when_positions_go_back() {
        let mut writer = BatchWriter::new();
        let mut out = BytesMut::new();
        let events = [
            frame(1, 10, b"a"),
            frame(1, 20, b"b"),
            frame(2, 5, b"c"),
            frame(2, 6, b"d"),
        ];
        let mut source = events.iter().cloned();
        writer.drain(|| source.next(), &mut out).unwrap();
        let batches = decode_batches(&out);
        assert_eq!(batches, [events[..2].to_vec(), events[2..].to_vec()]);
    }

    #[test]
    fn writer_compresses_only_when_smaller() {
        let mut writer = BatchWriter::new();
        let mut out = BytesMut::new();
        let mut source = (0..64u64).map(|i| frame(1, i, b"the same payload every time"));
        writer.drain(|| source.next(), &mut out).unwrap();
        assert_eq!(writer.stats().zstd_batches, 1);
        // One tiny event: zstd framing overhead makes the compressed record larger.
        let mut out = BytesMut::new();
        let mut one = Some(frame(1, 1, b"z"));
        writer.drain(|| one.take(), &mut out).unwrap();
        assert_eq!(writer.stats().raw_batches, 1);
        assert_eq!(out[0], TAG_RAW_BATCH);
    }

    #[test]
    fn encoders_refuse_what_decoders_reject() {
        let mut header = golden_header();
        header.token = Bytes::from(vec![0; TELEMETRY_TOKEN_BYTES_MAX + 1]);
        let error = header.encode(&mut BytesMut::new()).unwrap_err();
        assert_eq!(error.kind(), "token_too_long");
        let mut header = golden_header();
        header.stream.labels = labels(&[("k", "v"); TELEMETRY_LABELS_MAX + 1]);
        assert_eq!(
            header.encode(&mut BytesMut::new()).unwrap_err().kind(),
            "unencodable"
        );
        let backwards = [frame(1, 5, b""), frame(1, 4, b"")];
        let error = encode_batch(&backwards, Compression::None, &mut BytesMut::new());
        assert_eq!(error.unwrap_err().kind(), "unencodable");
        let huge = frame(1, u64::MAX, b"");
        assert!(BatchWriter::new()
            .push(&huge, &mut BytesMut::new())
            .is_err());
    }

    #[test]
    fn header_channel_list_is_bounded() {
        let with_channels = |count: usize| {
            let mut out = BytesMut::new();
            golden_header().encode(&mut out).unwrap();
            let mut bytes = out.to_vec();
            bytes.truncate(bytes.len() - 25);
            // postcard: varint count, then `count` minimal descriptors (id 0, "", "", no labels).
            let mut list = Vec::new();
            varint::encode(count as u64, &mut list);
            list.extend(std::iter::repeat_n([0u8; 4], count).flatten());
            varint::encode(list.len() as u64, &mut bytes);
            bytes.extend_from_slice(&list);
            decode_split(TelemetryDecoder::default(), &bytes, &[])
        };
        let (items, verdict) = with_channels(TELEMETRY_HEADER_CHANNELS_MAX);
        assert_eq!(verdict, Ok(()));
        let TelemetryItem::Header(header) = &items[0] else {
            panic!("header first")
        };
        assert_eq!(header.channels.len(), TELEMETRY_HEADER_CHANNELS_MAX);
        let (_, verdict) = with_channels(TELEMETRY_HEADER_CHANNELS_MAX + 1);
        assert_eq!(verdict.unwrap_err().error, TelemetryError::BadDescriptor);
    }

    fn decode_batches(bytes: &[u8]) -> Vec<Vec<TelemetryFrame>> {
        let mut stream = BytesMut::new();
        golden_header().encode(&mut stream).unwrap();
        stream.extend_from_slice(bytes);
        let (items, verdict) = decode_split(TelemetryDecoder::default(), &stream, &[]);
        assert_eq!(verdict, Ok(()));
        items
            .iter()
            .skip(1)
            .map(|item| batch_frames(item).1)
            .collect()
    }

    fn label_list() -> impl Strategy<Value = Vec<(String, String)>> {
        proptest::collection::vec((".{0,8}", ".{0,8}"), 0..4)
    }

    fn channel() -> impl Strategy<Value = ChannelDescriptor> {
        (any::<u64>(), ".{0,12}", ".{0,12}", label_list()).prop_map(
            |(channel_id, name, content_type, labels)| ChannelDescriptor {
                channel_id,
                name,
                content_type,
                labels,
            },
        )
    }

    fn header() -> impl Strategy<Value = Header> {
        let stream = (".{0,12}", any::<[u8; 32]>(), any::<u64>(), label_list()).prop_map(
            |(name, node_id, started_at_ms, labels)| StreamDescriptor {
                name,
                node_id,
                started_at_ms,
                labels,
            },
        );
        let token = proptest::collection::vec(any::<u8>(), 0..40);
        (
            any::<[u8; 16]>(),
            token,
            stream,
            proptest::collection::vec(channel(), 0..4),
        )
            .prop_map(|(flow_id, token, stream, channels)| Header {
                flow_id,
                token: token.into(),
                stream,
                channels,
            })
    }

    fn events() -> impl Strategy<Value = Vec<TelemetryFrame>> {
        let event = (
            0..1000u64,
            0..(1u64 << 40),
            proptest::collection::vec(any::<u8>(), 0..64),
        );
        proptest::collection::vec(event, 0..40).prop_map(|events| {
            events
                .into_iter()
                .map(|(c, p, payload)| frame(c, p, &payload))
                .collect()
        })
    }

    proptest! {
        #[test]
        fn streams_round_trip_in_every_split(
            header in header(),
            declared in proptest::collection::vec(channel(), 0..3),
            events in events(),
            ended in any::<bool>(),
            cuts in proptest::collection::vec(any::<usize>(), 0..6),
        ) {
            let mut bytes = BytesMut::new();
            header.encode(&mut bytes).unwrap();
            for channel in &declared {
                encode_channel_declared(channel, &mut bytes).unwrap();
            }
            // The length hints: never wrong on any prefix, exact once the lengths are there.
            let mut alone = BytesMut::new();
            header.encode(&mut alone).unwrap();
            let fresh = TelemetryDecoder::default();
            for end in 0..alone.len() {
                let hint = fresh.item_len(&bytes[..end]);
                prop_assert!(hint.is_none() || hint == Some(alone.len()), "prefix {}", end);
            }
            prop_assert_eq!(fresh.item_len(&bytes), Some(alone.len()));
            if let Some(first) = declared.first() {
                let mut record = BytesMut::new();
                encode_channel_declared(first, &mut record).unwrap();
                let records = TelemetryDecoder { phase: Phase::Records, stream: None };
                prop_assert_eq!(records.item_len(&bytes[alone.len()..]), Some(record.len()));
            }
            let mut writer = BatchWriter::new();
            let mut source = events.iter().cloned();
            writer.drain(|| source.next(), &mut bytes).unwrap();
            if ended {
                encode_stream_ended(&mut bytes);
            }
            let (items, verdict) = decode_split(TelemetryDecoder::default(), &bytes, &cuts);
            prop_assert_eq!(verdict, Ok(()));
            prop_assert_eq!(&items[0], &TelemetryItem::Header(header));
            let channels: Vec<_> = items[1..1 + declared.len()].to_vec();
            let expected: Vec<_> = declared.into_iter().map(TelemetryItem::ChannelDeclared).collect();
            prop_assert_eq!(channels, expected);
            let decoded: Vec<TelemetryFrame> = items
                .iter()
                .filter_map(|item| match item {
                    TelemetryItem::Batch(batch) => Some(batch.frames()),
                    _ => None,
                })
                .flatten()
                .collect();
            prop_assert_eq!(decoded, events);
            prop_assert_eq!(items.last() == Some(&TelemetryItem::StreamEnded), ended);
        }

        #[test]
        fn arbitrary_bytes_never_panic_and_reencode_stably(
            tail in proptest::collection::vec(any::<u8>(), 0..400),
            cuts in proptest::collection::vec(any::<usize>(), 0..4),
        ) {
            // Start from a valid header so the fuzzing reaches the record decoder too.
            let mut bytes = BytesMut::new();
            golden_header().encode(&mut bytes).unwrap();
            bytes.extend_from_slice(&tail);
            let (items, _) = decode_split(TelemetryDecoder::default(), &bytes, &cuts);
            for item in &items {
                if let TelemetryItem::Batch(batch) = item {
                    let frames: Vec<_> = batch.frames().collect();
                    prop_assert_eq!(frames.len(), batch.len());
                    let mut again = BytesMut::new();
                    encode_batch(&frames, Compression::None, &mut again).unwrap();
                    let mut stream = BytesMut::new();
                    golden_header().encode(&mut stream).unwrap();
                    stream.extend_from_slice(&again);
                    let (redecoded, verdict) = decode_split(TelemetryDecoder::default(), &stream, &[]);
                    prop_assert_eq!(verdict, Ok(()));
                    prop_assert_eq!(batch_frames(&redecoded[1]).1, frames);
                }
            }
        }
    }
}
