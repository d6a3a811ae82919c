//! Request-switch frames (docs/spec/switch.md §2, and docs/spec/capdag-v6.md for what capdag
//! 1.524.58 writes): a `u32` big-endian length, then a CBOR map with integer keys 0–21.
//!
//! | key | field | CBOR | | key | field | CBOR |
//! |---|---|---|---|---|---|---|
//! | 0 | version (= 4) | uint | | 11 | stream_id | text |
//! | 1 | frame_type | uint | | 12 | media_urn | text |
//! | 2 | id | bytes(16) or uint | | 13 | routing_id | bytes(16) or uint |
//! | 3 | seq | uint | | 14 | chunk_index | uint |
//! | 4 | content_type | text | | 15 | chunk_count | uint |
//! | 5 | meta | map, text keys | | 16 | checksum (FNV-1a 64) | uint |
//! | 6 | payload | bytes | | 17 | is_sequence | bool |
//! | 7 | len | uint | | 18 | force_kill | bool |
//! | 8 | offset | uint | | 19 | credit | uint |
//! | 9 | eof | bool | | 20 | unbounded | bool |
//! | 10 | cap | text | | 21 | output | text |
//!
//! Keys 0, 1 and 2 are required; `seq` defaults to 0 when absent (non-flow frames). Unknown
//! and duplicate keys are rejected. Protocol version 6 adds, and this decoder enforces:
//! - a CHUNK carries `chunk_index` (14) and `checksum` (16), and the checksum is the FNV-1a 64
//!   of its payload ([`checksum`]); the encoder writes it for every CHUNK;
//! - `output` (21) appears only on STREAM_START;
//! - POLICY (type 15) carries `meta.network`, one of `offline`, `no_telemetry`, `full`.
//!
//! A length above the decoder's bound is fatal; any other error is frame-local (the bad frame
//! is consumed and decoding continues after it).

use bytes::{BufMut, Bytes};

use super::cbor::{self, CborError, Reader};
use super::{length_prefixed_len, take_length_prefixed, Format, FormatError, Input};
use crate::limits::{BIFACI_FRAME_BYTES_CEILING, BIFACI_FRAME_BYTES_DEFAULT};

/// What the side that opens a switch stream over QUIC (tether's `tether/switch/1` ALPN) writes
/// before any frame. A QUIC stream reaches the other side only with its first bytes, and on this
/// link the master (the side that accepts) speaks first: these bytes announce the stream. Not a
/// bifaci frame, and never sent on a byte stream that needs no announcing (a Unix socket, TCP).
pub const QUIC_STREAM_OPENER: &[u8; 8] = b"bifaci6\n";

/// Whether the first bytes of a stream on the switch ALPN announce a switch stream.
pub fn announces_switch_stream(first: &[u8]) -> bool {
    first == QUIC_STREAM_OPENER
}

/// The only protocol version tether speaks: capdag 1.524.58's (docs/spec/capdag-v6.md §3).
pub const PROTOCOL_VERSION: u64 = 6;

/// The FNV-1a 64 of `payload`: a CHUNK's `checksum` (docs/spec/capdag-v6.md §6).
pub fn checksum(payload: &[u8]) -> u64 {
    payload.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The network policy a switch gives its masters in POLICY (`meta.network`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NetworkPolicy {
    /// No network access at all.
    Offline,
    /// Network, but no telemetry.
    NoTelemetry,
    /// Unrestricted.
    #[default]
    Full,
}

impl NetworkPolicy {
    /// Every policy.
    pub const ALL: [NetworkPolicy; 3] = [Self::Offline, Self::NoTelemetry, Self::Full];

    /// The word on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Offline => "offline",
            Self::NoTelemetry => "no_telemetry",
            Self::Full => "full",
        }
    }

    /// The policy a word names.
    pub fn parse(word: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|policy| policy.as_str() == word)
    }

    /// The POLICY frame carrying it (id 0).
    pub fn to_frame(self) -> Frame {
        let mut out = Vec::new();
        cbor::write_map(&mut out, 1);
        cbor::write_text(&mut out, "network");
        cbor::write_text(&mut out, self.as_str());
        let mut frame = Frame::new(FrameType::Policy, MessageId::Uint(0));
        frame.meta = Some(Meta(Bytes::from(out)));
        frame
    }

    /// The policy a POLICY frame's `meta` names (`None`: absent or not one of the three).
    pub fn from_meta(meta: Option<&Meta>) -> Option<Self> {
        meta_text(meta?, "network").and_then(Self::parse)
    }
}

impl std::fmt::Display for NetworkPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for NetworkPolicy {
    type Err = String;

    fn from_str(word: &str) -> Result<Self, String> {
        Self::parse(word).ok_or_else(|| format!("`{word}` is not offline, no_telemetry or full"))
    }
}

/// The text value of `key` in a meta map, if it is there and is text.
pub fn meta_text<'a>(meta: &'a Meta, key: &str) -> Option<&'a str> {
    let mut reader = Reader::new(meta.as_cbor());
    for _ in 0..reader.map().ok()? {
        if reader.text().ok()? == key {
            return reader.text().ok();
        }
        reader.skip().ok()?;
    }
    None
}

/// Frame types. Type 2 (the old single response) is retired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum FrameType {
    /// Handshake with limits (and a manifest from the non-host side).
    Hello,
    /// A request to invoke a cap.
    Req,
    /// A chunk of a stream.
    Chunk,
    /// The request finished (terminal).
    End,
    /// Log or progress.
    Log,
    /// The request failed (terminal).
    Err,
    /// Liveness probe, answered with the same id.
    Heartbeat,
    /// A stream of a request starts.
    StreamStart,
    /// A stream of a request ends.
    StreamEnd,
    /// Capability advertisement from a relay.
    RelayNotify,
    /// Host state towards a relay.
    RelayState,
    /// Cancel a request.
    Cancel,
    /// Grant credit to a stream's sender.
    Credit,
    /// Close a request's input feeds (stop-feeds).
    CloseStream,
    /// The switch's network policy towards a master (version 6).
    Policy,
}

impl FrameType {
    /// Every frame type, in wire-code order.
    pub const ALL: [FrameType; 15] = [
        Self::Hello,
        Self::Req,
        Self::Chunk,
        Self::End,
        Self::Log,
        Self::Err,
        Self::Heartbeat,
        Self::StreamStart,
        Self::StreamEnd,
        Self::RelayNotify,
        Self::RelayState,
        Self::Cancel,
        Self::Credit,
        Self::CloseStream,
        Self::Policy,
    ];

    /// The wire code.
    pub fn code(self) -> u8 {
        match self {
            Self::Hello => 0,
            Self::Req => 1,
            Self::Chunk => 3,
            Self::End => 4,
            Self::Log => 5,
            Self::Err => 6,
            Self::Heartbeat => 7,
            Self::StreamStart => 8,
            Self::StreamEnd => 9,
            Self::RelayNotify => 10,
            Self::RelayState => 11,
            Self::Cancel => 12,
            Self::Credit => 13,
            Self::CloseStream => 14,
            Self::Policy => 15,
        }
    }

    /// The type with wire code `code`, if any.
    pub fn from_code(code: u64) -> Option<Self> {
        Self::ALL.into_iter().find(|t| u64::from(t.code()) == code)
    }

    /// Upper-case name as docs/spec/switch.md §2.3 spells it (`REQ`, `STREAM_START`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::Hello => "HELLO",
            Self::Req => "REQ",
            Self::Chunk => "CHUNK",
            Self::End => "END",
            Self::Log => "LOG",
            Self::Err => "ERR",
            Self::Heartbeat => "HEARTBEAT",
            Self::StreamStart => "STREAM_START",
            Self::StreamEnd => "STREAM_END",
            Self::RelayNotify => "RELAY_NOTIFY",
            Self::RelayState => "RELAY_STATE",
            Self::Cancel => "CANCEL",
            Self::Credit => "CREDIT",
            Self::CloseStream => "CLOSE_STREAM",
            Self::Policy => "POLICY",
        }
    }
}

/// A request or routing id: a 16-byte UUID or an integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MessageId {
    /// 16 raw bytes (CBOR byte string).
    Uuid([u8; 16]),
    /// An integer (CBOR uint).
    Uint(u64),
}

/// Serialized as the integer itself, or the UUID as 32 lowercase hex digits (snapshots, JSON).
impl serde::Serialize for MessageId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            MessageId::Uint(value) => serializer.serialize_u64(*value),
            MessageId::Uuid(bytes) => {
                use std::fmt::Write as _;
                let mut text = String::with_capacity(32);
                for byte in bytes {
                    // Writing to a String cannot fail.
                    let _ = write!(text, "{byte:02x}");
                }
                serializer.serialize_str(&text)
            }
        }
    }
}

/// A `meta` map, kept as its validated CBOR bytes (a map with text keys, well formed, nested
/// at most `CBOR_NESTING_DEPTH_MAX` deep). Decode it with any CBOR library when needed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta(Bytes);

impl Meta {
    /// Validates `cbor` as a meta map.
    pub fn from_cbor(cbor: Bytes) -> Result<Self, BifaciError> {
        let mut reader = Reader::new(&cbor);
        check_meta(&mut reader)?;
        if !reader.is_empty() {
            return Err(BifaciError::TrailingBytes);
        }
        Ok(Self(cbor))
    }

    /// The CBOR bytes of the map.
    pub fn as_cbor(&self) -> &Bytes {
        &self.0
    }
}

/// One bifaci frame. `version` is implicit: always [`PROTOCOL_VERSION`] on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)] // Each field is the key of that name: docs/spec/switch.md §2.1.
pub struct Frame {
    pub frame_type: FrameType,
    pub id: MessageId,
    pub seq: u64,
    pub content_type: Option<String>,
    pub meta: Option<Meta>,
    pub payload: Option<Bytes>,
    pub len: Option<u64>,
    pub offset: Option<u64>,
    pub eof: Option<bool>,
    pub cap: Option<String>,
    pub stream_id: Option<String>,
    pub media_urn: Option<String>,
    pub routing_id: Option<MessageId>,
    pub chunk_index: Option<u64>,
    pub chunk_count: Option<u64>,
    pub checksum: Option<u64>,
    pub is_sequence: Option<bool>,
    pub force_kill: Option<bool>,
    pub credit: Option<u64>,
    pub unbounded: Option<bool>,
    pub output: Option<String>,
}

/// Why a bifaci frame could not be decoded or encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BifaciError {
    /// The stream ended inside a frame.
    #[error("bifaci stream ends inside a frame ({buffered} bytes left)")]
    Truncated {
        /// Bytes of the incomplete frame.
        buffered: u64,
    },
    /// A frame longer than the bound in force (fatal).
    #[error("bifaci frame of {len} bytes exceeds {max}")]
    FrameTooLarge {
        /// Declared length.
        len: u64,
        /// The bound in force.
        max: u64,
    },
    /// Malformed or non-canonical CBOR.
    #[error("bifaci frame CBOR: {0}")]
    Cbor(#[from] CborError),
    /// The frame body is not a CBOR map.
    #[error("bifaci frame is not a CBOR map")]
    NotAMap,
    /// A key outside 0–21, or not an integer.
    #[error("unknown bifaci key {key}")]
    UnknownKey {
        /// The key (`u64::MAX` when it was not an unsigned integer).
        key: u64,
    },
    /// A key present twice.
    #[error("duplicate bifaci key {key}")]
    DuplicateKey {
        /// The key.
        key: u64,
    },
    /// A version other than 6.
    #[error("bifaci version {version} is not {PROTOCOL_VERSION}")]
    BadVersion {
        /// The version sent.
        version: u64,
    },
    /// A frame type code that does not exist (including the retired 2).
    #[error("unknown bifaci frame type {code}")]
    UnknownFrameType {
        /// The code sent.
        code: u64,
    },
    /// A required key (version, frame_type, id) is absent.
    #[error("bifaci frame lacks `{field}`")]
    MissingField {
        /// Field name.
        field: &'static str,
    },
    /// A field with the wrong CBOR type (an id that is neither 16 bytes nor a uint, a meta that
    /// is not a map with text keys, ...).
    #[error("bifaci field `{field}` has the wrong type")]
    WrongType {
        /// Field name.
        field: &'static str,
    },
    /// Bytes after the map inside the frame.
    #[error("bytes after the bifaci map")]
    TrailingBytes,
    /// A CHUNK whose `checksum` is not the FNV-1a 64 of its payload.
    #[error("CHUNK checksum {sent:#018x} is not its payload's {computed:#018x}")]
    BadChecksum {
        /// What the frame says.
        sent: u64,
        /// What its payload hashes to.
        computed: u64,
    },
    /// A field on a frame type that may not carry it (`output` off STREAM_START).
    #[error("bifaci field `{field}` is not allowed on {frame_type}")]
    MisplacedField {
        /// Field name.
        field: &'static str,
        /// The frame's type name.
        frame_type: &'static str,
    },
    /// A POLICY whose `meta.network` is absent or not `offline`, `no_telemetry` or `full`.
    #[error("POLICY without a known meta.network")]
    BadPolicy,
}

impl FormatError for BifaciError {
    fn is_fatal(&self) -> bool {
        matches!(self, Self::FrameTooLarge { .. } | Self::Truncated { .. })
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Truncated { .. } => "truncated",
            Self::FrameTooLarge { .. } => "frame_too_large",
            Self::Cbor(_) => "bad_cbor",
            Self::NotAMap => "not_a_map",
            Self::UnknownKey { .. } => "unknown_key",
            Self::DuplicateKey { .. } => "duplicate_key",
            Self::BadVersion { .. } => "bad_version",
            Self::UnknownFrameType { .. } => "unknown_frame_type",
            Self::MissingField { .. } => "missing_field",
            Self::WrongType { .. } => "wrong_type",
            Self::TrailingBytes => "trailing_bytes",
            Self::BadChecksum { .. } => "bad_checksum",
            Self::MisplacedField { .. } => "misplaced_field",
            Self::BadPolicy => "bad_policy",
        }
    }
}

/// The bifaci [`Format`]; wrap it in a [`super::StreamDecoder`].
#[derive(Debug, Clone)]
pub struct BifaciDecoder {
    frame_bytes_max: usize,
}

impl Default for BifaciDecoder {
    fn default() -> Self {
        Self {
            frame_bytes_max: BIFACI_FRAME_BYTES_DEFAULT,
        }
    }
}

impl BifaciDecoder {
    /// A decoder accepting frames up to `frame_bytes_max`, clamped to
    /// [`BIFACI_FRAME_BYTES_CEILING`] (the negotiated `max_frame`).
    pub fn with_frame_bytes_max(frame_bytes_max: usize) -> Self {
        Self {
            frame_bytes_max: frame_bytes_max.min(BIFACI_FRAME_BYTES_CEILING),
        }
    }

    /// The frame bound in force.
    pub fn frame_bytes_max(&self) -> usize {
        self.frame_bytes_max
    }
}

impl Format for BifaciDecoder {
    type Item = Frame;
    type Error = BifaciError;

    fn decode<I: Input>(&mut self, buf: &mut I) -> Result<Option<Frame>, BifaciError> {
        let max = self.frame_bytes_max;
        match take_length_prefixed(buf, max) {
            Ok(Some(body)) => Frame::decode_body(&body).map(Some),
            Ok(None) => Ok(None),
            Err(len) => Err(BifaciError::FrameTooLarge {
                len,
                max: max as u64,
            }),
        }
    }

    fn item_len(&self, buf: &[u8]) -> Option<usize> {
        length_prefixed_len(buf)
    }

    fn finish(&self, buffered: usize) -> Result<(), BifaciError> {
        match buffered {
            0 => Ok(()),
            n => Err(BifaciError::Truncated { buffered: n as u64 }),
        }
    }
}

/// Field names by key, for errors.
const FIELD_NAMES: [&str; 22] = [
    "version",
    "frame_type",
    "id",
    "seq",
    "content_type",
    "meta",
    "payload",
    "len",
    "offset",
    "eof",
    "cap",
    "stream_id",
    "media_urn",
    "routing_id",
    "chunk_index",
    "chunk_count",
    "checksum",
    "is_sequence",
    "force_kill",
    "credit",
    "unbounded",
    "output",
];

impl Frame {
    /// Bytes this frame holds in memory: its fixed part, payload, meta and strings (what a
    /// buffer of frames is bounded by).
    pub fn held_bytes(&self) -> usize {
        let text = |field: &Option<String>| field.as_ref().map_or(0, String::len);
        std::mem::size_of::<Self>()
            + self.payload.as_ref().map_or(0, Bytes::len)
            + self.meta.as_ref().map_or(0, |meta| meta.as_cbor().len())
            + text(&self.content_type)
            + text(&self.cap)
            + text(&self.stream_id)
            + text(&self.media_urn)
            + text(&self.output)
    }

    /// A frame with only the required fields.
    pub fn new(frame_type: FrameType, id: MessageId) -> Self {
        Self {
            frame_type,
            id,
            seq: 0,
            content_type: None,
            meta: None,
            payload: None,
            len: None,
            offset: None,
            eof: None,
            cap: None,
            stream_id: None,
            media_urn: None,
            routing_id: None,
            chunk_index: None,
            chunk_count: None,
            checksum: None,
            is_sequence: None,
            force_kill: None,
            credit: None,
            unbounded: None,
            output: None,
        }
    }

    /// Decodes a frame body (the CBOR map, without its length prefix). Payload and meta are
    /// zero-copy slices of `body`.
    pub fn decode_body(body: &Bytes) -> Result<Frame, BifaciError> {
        let mut reader = Reader::new(body);
        let pairs = reader.map().map_err(|error| match error {
            CborError::WrongType => BifaciError::NotAMap,
            other => BifaciError::Cbor(other),
        })?;
        let mut seen = 0u32;
        // Placeholders for the required keys; `seen` proves each was overwritten.
        let mut frame = Frame::new(FrameType::Hello, MessageId::Uint(0));
        for _ in 0..pairs {
            let key = match reader.uint() {
                Ok(key) => key,
                Err(CborError::WrongType) => return Err(BifaciError::UnknownKey { key: u64::MAX }),
                Err(other) => return Err(other.into()),
            };
            if key > 21 {
                return Err(BifaciError::UnknownKey { key });
            }
            if seen & (1 << key) != 0 {
                return Err(BifaciError::DuplicateKey { key });
            }
            seen |= 1 << key;
            frame.read_field(key, &mut reader, body)?;
        }
        if !reader.is_empty() {
            return Err(BifaciError::TrailingBytes);
        }
        for (key, field) in FIELD_NAMES.iter().enumerate().take(3) {
            if seen & (1 << key) == 0 {
                return Err(BifaciError::MissingField { field });
            }
        }
        frame.check_by_type(seen)?;
        Ok(frame)
    }

    /// What version 6 requires of particular frame types (docs/spec/capdag-v6.md §9).
    fn check_by_type(&self, seen: u32) -> Result<(), BifaciError> {
        match self.frame_type {
            FrameType::Chunk => {
                for key in [14, 16] {
                    if seen & (1 << key) == 0 {
                        return Err(BifaciError::MissingField {
                            field: FIELD_NAMES[key],
                        });
                    }
                }
                let computed = checksum(self.payload.as_deref().unwrap_or_default());
                match self.checksum {
                    Some(sent) if sent != computed => {
                        return Err(BifaciError::BadChecksum { sent, computed })
                    }
                    _ => {}
                }
            }
            FrameType::Policy if NetworkPolicy::from_meta(self.meta.as_ref()).is_none() => {
                return Err(BifaciError::BadPolicy);
            }
            _ => {}
        }
        if self.output.is_some() && self.frame_type != FrameType::StreamStart {
            return Err(BifaciError::MisplacedField {
                field: "output",
                frame_type: self.frame_type.name(),
            });
        }
        Ok(())
    }

    /// Appends the frame (length prefix and map), refusing a body above `frame_bytes_max`.
    pub fn encode(&self, frame_bytes_max: usize, out: &mut impl BufMut) -> Result<(), BifaciError> {
        let body = self.encode_body();
        let max = frame_bytes_max.min(BIFACI_FRAME_BYTES_CEILING);
        if body.len() > max {
            return Err(BifaciError::FrameTooLarge {
                len: body.len() as u64,
                max: max as u64,
            });
        }
        out.put_u32(body.len() as u32);
        out.put_slice(&body);
        Ok(())
    }

    /// The CBOR map alone: present keys ascending, every head in its shortest form. A CHUNK's
    /// `checksum` is written as its payload's, whatever the field holds.
    pub fn encode_body(&self) -> Vec<u8> {
        let fields = self.fields();
        let mut out = Vec::with_capacity(64 + self.payload.as_ref().map_or(0, Bytes::len));
        cbor::write_map(&mut out, fields.iter().flatten().count());
        for (key, field) in fields.iter().enumerate() {
            let Some(field) = field else { continue };
            cbor::write_uint(&mut out, key as u64);
            match field {
                Value::Uint(value) => cbor::write_uint(&mut out, *value),
                Value::Text(value) => cbor::write_text(&mut out, value),
                Value::Bytes(value) => cbor::write_bytes(&mut out, value),
                Value::Cbor(value) => out.extend_from_slice(value),
                Value::Bool(value) => cbor::write_bool(&mut out, *value),
                Value::Id(MessageId::Uuid(bytes)) => cbor::write_bytes(&mut out, bytes),
                Value::Id(MessageId::Uint(value)) => cbor::write_uint(&mut out, *value),
            }
        }
        out
    }

    /// Every field by key, `None` where absent.
    fn fields<'a>(&'a self) -> [Option<Value<'a>>; 22] {
        let text = |v: &'a Option<String>| v.as_deref().map(Value::Text);
        let uint = |v: Option<u64>| v.map(Value::Uint);
        let flag = |v: Option<bool>| v.map(Value::Bool);
        [
            Some(Value::Uint(PROTOCOL_VERSION)),
            Some(Value::Uint(u64::from(self.frame_type.code()))),
            Some(Value::Id(&self.id)),
            Some(Value::Uint(self.seq)),
            text(&self.content_type),
            self.meta.as_ref().map(|meta| Value::Cbor(meta.as_cbor())),
            self.payload.as_deref().map(Value::Bytes),
            uint(self.len),
            uint(self.offset),
            flag(self.eof),
            text(&self.cap),
            text(&self.stream_id),
            text(&self.media_urn),
            self.routing_id.as_ref().map(Value::Id),
            uint(self.chunk_index),
            uint(self.chunk_count),
            if self.frame_type == FrameType::Chunk {
                Some(Value::Uint(checksum(
                    self.payload.as_deref().unwrap_or_default(),
                )))
            } else {
                uint(self.checksum)
            },
            flag(self.is_sequence),
            flag(self.force_kill),
            uint(self.credit),
            flag(self.unbounded),
            text(&self.output),
        ]
    }

    /// Reads the value of `key` into the frame under construction.
    fn read_field(
        &mut self,
        key: u64,
        reader: &mut Reader<'_>,
        body: &Bytes,
    ) -> Result<(), BifaciError> {
        let field = FIELD_NAMES[key as usize];
        let typed = |error: CborError| match error {
            CborError::WrongType => BifaciError::WrongType { field },
            other => BifaciError::Cbor(other),
        };
        match key {
            0 => match reader.uint().map_err(typed)? {
                PROTOCOL_VERSION => {}
                version => return Err(BifaciError::BadVersion { version }),
            },
            1 => {
                let code = reader.uint().map_err(typed)?;
                self.frame_type =
                    FrameType::from_code(code).ok_or(BifaciError::UnknownFrameType { code })?;
            }
            2 => self.id = read_id(reader, field)?,
            3 => self.seq = reader.uint().map_err(typed)?,
            5 => {
                let span = check_meta(reader)?;
                self.meta = Some(Meta(body.slice_ref(span)));
            }
            6 => self.payload = Some(body.slice_ref(reader.bytes().map_err(typed)?)),
            13 => self.routing_id = Some(read_id(reader, field)?),
            4 | 10 | 11 | 12 | 21 => {
                let value = Some(reader.text().map_err(typed)?.to_owned());
                match key {
                    4 => self.content_type = value,
                    10 => self.cap = value,
                    11 => self.stream_id = value,
                    12 => self.media_urn = value,
                    _ => self.output = value,
                }
            }
            9 | 17 | 18 | 20 => {
                let value = Some(reader.bool().map_err(typed)?);
                match key {
                    9 => self.eof = value,
                    17 => self.is_sequence = value,
                    18 => self.force_kill = value,
                    _ => self.unbounded = value,
                }
            }
            _ => {
                let value = Some(reader.uint().map_err(typed)?);
                match key {
                    7 => self.len = value,
                    8 => self.offset = value,
                    14 => self.chunk_index = value,
                    15 => self.chunk_count = value,
                    16 => self.checksum = value,
                    _ => self.credit = value,
                }
            }
        }
        Ok(())
    }
}

/// One field value, borrowed from a [`Frame`] for encoding.
enum Value<'a> {
    Uint(u64),
    Text(&'a str),
    Bytes(&'a [u8]),
    Cbor(&'a [u8]),
    Bool(bool),
    Id(&'a MessageId),
}

fn read_id(reader: &mut Reader<'_>, field: &'static str) -> Result<MessageId, BifaciError> {
    let wrong = BifaciError::WrongType { field };
    match reader.peek_major() {
        Some(cbor::MAJOR_UINT) => Ok(MessageId::Uint(reader.uint()?)),
        Some(cbor::MAJOR_BYTES) => {
            let bytes: [u8; 16] = reader.bytes()?.try_into().map_err(|_| wrong)?;
            Ok(MessageId::Uuid(bytes))
        }
        Some(_) => Err(wrong),
        None => Err(CborError::Truncated.into()),
    }
}

/// Checks that the next item is a map with text keys and well-formed values; returns its span.
fn check_meta<'a>(reader: &mut Reader<'a>) -> Result<&'a [u8], BifaciError> {
    let wrong = BifaciError::WrongType { field: "meta" };
    if reader.peek_major() != Some(cbor::MAJOR_MAP) {
        return Err(if reader.is_empty() {
            CborError::Truncated.into()
        } else {
            wrong
        });
    }
    let span = reader.skip()?;
    // Walk it again to check the keys: `skip` already proved it well formed and bounded.
    let mut inner = Reader::new(span);
    for _ in 0..inner.map()? {
        inner.text().map_err(|_| wrong.clone())?;
        inner.skip()?;
    }
    Ok(span)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testing::{check_malformed, decode_split, golden};
    use proptest::prelude::*;

    fn encode_all(frames: &[Frame]) -> Vec<u8> {
        let mut out = Vec::new();
        for frame in frames {
            frame
                .encode(BIFACI_FRAME_BYTES_DEFAULT, &mut out)
                .expect("within bounds");
        }
        out
    }

    fn golden_frames() -> Vec<Frame> {
        let uuid: [u8; 16] = hex::decode("00112233445566778899aabbccddeeff")
            .unwrap()
            .try_into()
            .unwrap();
        let mut req = Frame::new(FrameType::Req, MessageId::Uuid(uuid));
        req.content_type = Some("application/cbor".into());
        req.meta = Some(Meta::from_cbor(Bytes::from_static(&[0xa1, 0x61, b'k', 0x01])).unwrap());
        req.payload = Some(Bytes::from_static(&[1, 2]));
        req.cap = Some("cap:effect=none".into());
        let mut chunk = Frame::new(FrameType::Chunk, MessageId::Uint(7));
        chunk.seq = 3;
        chunk.payload = Some(Bytes::from_static(b"hi"));
        chunk.stream_id = Some("s1".into());
        chunk.routing_id = Some(MessageId::Uint(42));
        chunk.chunk_index = Some(0);
        chunk.checksum = Some(628_919_584_683_901_914); // FNV-1a 64 of "hi"
        let heartbeat = Frame::new(FrameType::Heartbeat, MessageId::Uint(0));
        let mut credit = Frame::new(FrameType::Credit, MessageId::Uint(7));
        credit.len = Some(1000);
        credit.offset = Some(5);
        credit.eof = Some(false);
        credit.stream_id = Some("s1".into());
        credit.media_urn = Some("media:bytes".into());
        credit.chunk_count = Some(2);
        credit.is_sequence = Some(true);
        credit.force_kill = Some(false);
        credit.credit = Some(16);
        credit.unbounded = Some(true);
        vec![req, chunk, heartbeat, credit]
    }

    #[test]
    fn golden_valid_frames_both_ways() {
        let bytes = golden(include_str!("../../tests/golden/bifaci/valid_frames.hex"));
        let expected = golden_frames();
        assert_eq!(encode_all(&expected), bytes);
        let (items, verdict) = decode_split(BifaciDecoder::default(), &bytes, &[7, 80]);
        assert_eq!(verdict, Ok(()));
        assert_eq!(items, expected);
    }

    #[test]
    fn ciborium_reads_what_we_write() {
        for frame in golden_frames() {
            let body = frame.encode_body();
            let value: ciborium::Value = ciborium::from_reader(&body[..]).expect("valid CBOR");
            let map = value.as_map().expect("a map");
            let key = |k: u64| map.iter().find(|(key, _)| *key == ciborium::Value::from(k));
            assert_eq!(key(0).unwrap().1, ciborium::Value::from(6));
            assert_eq!(
                key(1).unwrap().1,
                ciborium::Value::from(frame.frame_type.code())
            );
        }
    }

    /// Every frame capdag 1.524.58 wrote (tests/capdag/gen_vectors.py, all 15 types) decodes
    /// field for field and encodes back to the very bytes capdag wrote.
    #[test]
    fn every_frame_capdag_writes_decodes_and_encodes_back_byte_for_byte() {
        let vectors: Vec<serde_json::Value> =
            serde_json::from_str(include_str!("../../../tests/data/capdag/frames.json"))
                .expect("the checked-in vectors are JSON");
        let mut types = std::collections::BTreeSet::new();
        for vector in &vectors {
            let name = vector["name"].as_str().expect("named");
            let bytes = hex::decode(vector["hex"].as_str().expect("hex")).expect("hex");
            let (frames, verdict) = decode_split(BifaciDecoder::default(), &bytes, &[3, 17]);
            assert_eq!(verdict, Ok(()), "{name}");
            let [frame] = frames.as_slice() else {
                panic!("{name}: one frame, got {}", frames.len());
            };
            let fields = &vector["fields"];
            assert_eq!(
                u64::from(frame.frame_type.code()),
                fields["frame_type"],
                "{name}"
            );
            assert_eq!(frame.seq, fields["seq"], "{name}");
            let text = |value: &Option<String>| value.as_deref().map(serde_json::Value::from);
            for (key, ours) in [
                ("cap", text(&frame.cap)),
                ("stream_id", text(&frame.stream_id)),
                ("media_urn", text(&frame.media_urn)),
                ("content_type", text(&frame.content_type)),
                ("output", text(&frame.output)),
            ] {
                assert_eq!(ours.unwrap_or_default(), fields[key], "{name}: {key}");
            }
            for (key, ours) in [
                ("chunk_index", frame.chunk_index),
                ("chunk_count", frame.chunk_count),
                ("checksum", frame.checksum),
                ("credit", frame.credit),
                ("len", frame.len),
                ("offset", frame.offset),
            ] {
                assert_eq!(
                    ours.map(serde_json::Value::from).unwrap_or_default(),
                    fields[key],
                    "{name}: {key}"
                );
            }
            let mut out = Vec::new();
            frame
                .encode(BIFACI_FRAME_BYTES_DEFAULT, &mut out)
                .expect("encodes");
            assert_eq!(hex::encode(&out), vector["hex"].as_str().unwrap(), "{name}");
            types.insert(frame.frame_type);
        }
        assert_eq!(types.len(), FrameType::ALL.len(), "every type is covered");
    }

    #[test]
    fn a_chunk_must_carry_its_index_and_the_checksum_of_its_payload() {
        let mut chunk = Frame::new(FrameType::Chunk, MessageId::Uint(1));
        chunk.chunk_index = Some(0);
        chunk.payload = Some(Bytes::from_static(b"hello, tether"));
        // The encoder writes the checksum whatever the field says.
        chunk.checksum = Some(1);
        let body = Bytes::from(chunk.encode_body());
        let decoded = Frame::decode_body(&body).expect("decodes");
        assert_eq!(decoded.checksum, Some(checksum(b"hello, tether")));
        assert_eq!(checksum(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(checksum(&[0]), 0xaf63_bd4c_8601_b7df);
        // A flipped payload bit is refused.
        let mut bytes = body.to_vec();
        let at = bytes
            .windows(5)
            .position(|w| w == b"hello")
            .expect("payload");
        bytes[at] ^= 1;
        assert!(matches!(
            Frame::decode_body(&Bytes::from(bytes)),
            Err(BifaciError::BadChecksum { .. })
        ));
        // Without key 14 or key 16.
        for key in [14u8, 16] {
            let mut map = ciborium::Value::Map(vec![
                (0.into(), 6.into()),
                (1.into(), 3.into()),
                (2.into(), 1.into()),
            ]);
            if let ciborium::Value::Map(pairs) = &mut map {
                let other = if key == 14 { 16 } else { 14 };
                let value = if other == 16 { checksum(b"") } else { 0 };
                pairs.push((other.into(), value.into()));
            }
            let mut out = Vec::new();
            ciborium::into_writer(&map, &mut out).unwrap();
            assert_eq!(
                Frame::decode_body(&Bytes::from(out)),
                Err(BifaciError::MissingField {
                    field: FIELD_NAMES[key as usize]
                })
            );
        }
    }

    #[test]
    fn policy_needs_a_known_network_and_output_belongs_to_stream_start() {
        for policy in NetworkPolicy::ALL {
            let frame = policy.to_frame();
            let decoded = Frame::decode_body(&Bytes::from(frame.encode_body())).unwrap();
            assert_eq!(
                NetworkPolicy::from_meta(decoded.meta.as_ref()),
                Some(policy)
            );
        }
        let mut bare = Frame::new(FrameType::Policy, MessageId::Uint(0));
        assert_eq!(
            Frame::decode_body(&Bytes::from(bare.encode_body())),
            Err(BifaciError::BadPolicy)
        );
        let mut out = Vec::new();
        cbor::write_map(&mut out, 1);
        cbor::write_text(&mut out, "network");
        cbor::write_text(&mut out, "everything");
        bare.meta = Some(Meta::from_cbor(Bytes::from(out)).unwrap());
        assert_eq!(
            Frame::decode_body(&Bytes::from(bare.encode_body())),
            Err(BifaciError::BadPolicy)
        );
        let mut end = Frame::new(FrameType::End, MessageId::Uint(1));
        end.output = Some("x".into());
        assert_eq!(
            Frame::decode_body(&Bytes::from(end.encode_body())),
            Err(BifaciError::MisplacedField {
                field: "output",
                frame_type: "END"
            })
        );
    }

    #[test]
    fn golden_malformed_vectors() {
        let vectors = [
            include_str!("../../tests/golden/bifaci/malformed_bad_cbor.hex"),
            include_str!("../../tests/golden/bifaci/malformed_bad_cbor_nonminimal.hex"),
            include_str!("../../tests/golden/bifaci/malformed_bad_version.hex"),
            include_str!("../../tests/golden/bifaci/malformed_duplicate_key.hex"),
            include_str!("../../tests/golden/bifaci/malformed_frame_too_large.hex"),
            include_str!("../../tests/golden/bifaci/malformed_missing_field.hex"),
            include_str!("../../tests/golden/bifaci/malformed_not_a_map.hex"),
            include_str!("../../tests/golden/bifaci/malformed_trailing_bytes.hex"),
            include_str!("../../tests/golden/bifaci/malformed_truncated.hex"),
            include_str!("../../tests/golden/bifaci/malformed_unknown_frame_type.hex"),
            include_str!("../../tests/golden/bifaci/malformed_unknown_key.hex"),
            include_str!("../../tests/golden/bifaci/malformed_wrong_type.hex"),
            include_str!("../../tests/golden/bifaci/malformed_wrong_type_short_uuid.hex"),
            include_str!("../../tests/golden/bifaci/malformed_bad_checksum.hex"),
            include_str!("../../tests/golden/bifaci/malformed_misplaced_field.hex"),
            include_str!("../../tests/golden/bifaci/malformed_bad_policy.hex"),
        ];
        for text in vectors {
            check_malformed(BifaciDecoder::default(), text);
        }
    }

    #[test]
    fn a_frame_local_error_leaves_the_stream_usable() {
        let bad = golden(include_str!(
            "../../tests/golden/bifaci/malformed_bad_version.hex"
        ));
        let mut bytes = bad.clone();
        bytes.extend(encode_all(&golden_frames()));
        let mut decoder = crate::wire::StreamDecoder::new(BifaciDecoder::default());
        decoder.push(&bytes);
        assert_eq!(
            decoder.pop().unwrap().unwrap().frame_type,
            FrameType::Heartbeat
        );
        assert_eq!(decoder.pop().unwrap_err().error.kind(), "bad_version");
        let rest: Vec<Frame> = std::iter::from_fn(|| decoder.pop().unwrap()).collect();
        assert_eq!(rest, golden_frames());
    }

    #[test]
    fn frame_bound_is_a_setting_with_a_ceiling() {
        let mut big = Frame::new(FrameType::Chunk, MessageId::Uint(1));
        big.payload = Some(Bytes::from(vec![0; 200]));
        assert!(big.encode(100, &mut Vec::new()).is_err());
        let bytes = encode_all(&[big]);
        let (_, verdict) = decode_split(BifaciDecoder::with_frame_bytes_max(100), &bytes, &[]);
        assert_eq!(verdict.unwrap_err().error.kind(), "frame_too_large");
        let clamped = BifaciDecoder::with_frame_bytes_max(usize::MAX);
        assert_eq!(clamped.frame_bytes_max(), BIFACI_FRAME_BYTES_CEILING);
    }

    fn id() -> impl Strategy<Value = MessageId> {
        prop_oneof![
            any::<[u8; 16]>().prop_map(MessageId::Uuid),
            any::<u64>().prop_map(MessageId::Uint)
        ]
    }

    fn meta() -> impl Strategy<Value = Meta> {
        proptest::collection::btree_map(".{0,6}", any::<i64>(), 0..4).prop_map(|map| {
            let value =
                ciborium::Value::Map(map.into_iter().map(|(k, v)| (k.into(), v.into())).collect());
            let mut bytes = Vec::new();
            ciborium::into_writer(&value, &mut bytes).expect("in-memory write");
            Meta::from_cbor(bytes.into()).expect("ciborium writes canonical maps")
        })
    }

    fn frame() -> impl Strategy<Value = Frame> {
        let text = || proptest::option::of(".{0,12}");
        let uint = || proptest::option::of(any::<u64>());
        let flag = || proptest::option::of(any::<bool>());
        let payload = proptest::option::of(proptest::collection::vec(any::<u8>(), 0..64));
        let head = (
            proptest::sample::select(FrameType::ALL.to_vec()),
            id(),
            any::<u64>(),
        );
        let texts = (text(), text(), text(), text());
        let uints = (uint(), uint(), uint(), uint(), uint(), uint());
        let flags = (flag(), flag(), flag(), flag());
        let rest = (
            proptest::option::of(meta()),
            payload,
            proptest::option::of(id()),
        );
        let extra = (
            proptest::option::of(".{0,12}"),
            proptest::sample::select(NetworkPolicy::ALL.to_vec()),
        );
        (head, texts, uints, flags, rest, extra).prop_map(
            |(head, texts, uints, flags, rest, extra)| {
                let mut frame = Frame::new(head.0, head.1);
                frame.seq = head.2;
                (
                    frame.content_type,
                    frame.cap,
                    frame.stream_id,
                    frame.media_urn,
                ) = texts;
                (
                    frame.len,
                    frame.offset,
                    frame.chunk_index,
                    frame.chunk_count,
                ) = (uints.0, uints.1, uints.2, uints.3);
                (frame.checksum, frame.credit) = (uints.4, uints.5);
                (
                    frame.eof,
                    frame.is_sequence,
                    frame.force_kill,
                    frame.unbounded,
                ) = flags;
                frame.meta = rest.0;
                frame.payload = rest.1.map(Bytes::from);
                frame.routing_id = rest.2;
                // What version 6 requires of some types.
                match frame.frame_type {
                    FrameType::Chunk => {
                        frame.chunk_index = Some(frame.chunk_index.unwrap_or(0));
                        frame.checksum =
                            Some(checksum(frame.payload.as_deref().unwrap_or_default()));
                    }
                    FrameType::StreamStart => frame.output = extra.0,
                    FrameType::Policy => frame.meta = extra.1.to_frame().meta,
                    _ => {}
                }
                frame
            },
        )
    }

    proptest! {
        #[test]
        fn round_trips_in_every_split(
            frames in proptest::collection::vec(frame(), 0..6),
            cuts in proptest::collection::vec(any::<usize>(), 0..6),
        ) {
            let bytes = encode_all(&frames);
            let (items, verdict) = decode_split(BifaciDecoder::default(), &bytes, &cuts);
            prop_assert_eq!(verdict, Ok(()));
            prop_assert_eq!(items, frames);
        }

        #[test]
        fn arbitrary_bodies_never_panic_and_reencode_stably(
            body in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            let body = Bytes::from(body);
            if let Ok(frame) = Frame::decode_body(&body) {
                let again = Frame::decode_body(&Bytes::from(frame.encode_body()));
                prop_assert_eq!(again, Ok(frame));
            }
        }

        #[test]
        fn arbitrary_streams_never_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
            cuts in proptest::collection::vec(any::<usize>(), 0..4),
        ) {
            let format = BifaciDecoder::with_frame_bytes_max(128);
            let _ = decode_split(format, &bytes, &cuts);
        }
    }
}
