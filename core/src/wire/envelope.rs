//! Substrate frames (docs/spec/substrate.md §2): a `u32` big-endian length, a type byte, then a
//! CBOR map `{"env": {...}, "body": bytes}` (`body` optional).
//!
//! The length counts the type byte and the CBOR. Type `0x00` is reserved; `0x01` is an
//! envelope, `0x02` a bulk chunk, `0x03`–`0x0f` control, `0x10`–`0xff` application.
//!
//! `env` has text keys: `v` (must be 1), `kind` (the verb), `obj` (an address), `objKind`
//! (`session` | `queue`), `id` (producer-stable op id), `seq`, `receipt` (delivery attempt,
//! from 1), and the verb-specific `code`, `message`, `reason`, `fromSeq`, `cap` (capability
//! token), `floor` (the sender's low-water mark) and `limit` (the receiver's credit). Unknown
//! and duplicate keys are rejected.
//!
//! A length above [`ENVELOPE_FRAME_BYTES_MAX`] is fatal. Every other error is frame-local: the
//! frame is consumed, and the caller answers it (an address with `@` is `routing_not_supported`,
//! an oversized body `payload_too_large`) and keeps the connection.

use bytes::{BufMut, Bytes, BytesMut};

use super::cbor::{self, CborError, Reader};
use super::text::Text;

use super::{length_prefixed_len, take_length_prefixed, Format, FormatError, Input};
use crate::limits::{
    ADDRESS_BYTES_MAX, ENVELOPE_CHUNK_BODY_BYTES_MAX, ENVELOPE_ENV_KEYS_MAX,
    ENVELOPE_FRAME_BYTES_MAX, ENVELOPE_INLINE_BODY_BYTES_MAX, ENVELOPE_TEXT_BYTES_MAX,
};

/// The envelope version tether speaks.
pub const ENVELOPE_VERSION: u64 = 1;

/// Type byte of an envelope frame.
pub const TYPE_ENVELOPE: u8 = 0x01;
/// Type byte of a bulk-chunk frame (body bound [`ENVELOPE_CHUNK_BODY_BYTES_MAX`]).
pub const TYPE_BULK_CHUNK: u8 = 0x02;

/// What a type that is its text (an [`Address`], an [`OpId`]) implements through its
/// `as_str`: formatting, borrowing as `str`, comparing with text, serializing as a string.
macro_rules! text_handle {
    ($ty:ty) => {
        impl std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                std::fmt::Debug::fmt(self.as_str(), f)
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::ops::Deref for $ty {
            type Target = str;
            fn deref(&self) -> &str {
                self.as_str()
            }
        }

        impl std::borrow::Borrow<str> for $ty {
            fn borrow(&self) -> &str {
                self.as_str()
            }
        }

        impl AsRef<str> for $ty {
            fn as_ref(&self) -> &str {
                self.as_str()
            }
        }

        impl PartialEq<str> for $ty {
            fn eq(&self, other: &str) -> bool {
                self.0.as_bytes() == other.as_bytes()
            }
        }

        impl PartialEq<&str> for $ty {
            fn eq(&self, other: &&str) -> bool {
                self.0.as_bytes() == other.as_bytes()
            }
        }

        impl $ty {
            /// The text's UTF-8 bytes, without the check [`Self::as_str`] makes on text held
            /// in place (core has no `unsafe` to skip it): for writing and comparing.
            #[inline]
            pub fn as_bytes(&self) -> &[u8] {
                self.0.as_bytes()
            }
        }

        impl crate::wire::text::TextKey for $ty {
            #[inline]
            fn probe(text: &str) -> Option<Self> {
                Text::inline(text).map(Self)
            }
        }

        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }
    };
}

/// A substrate address: an opaque token matched, never parsed (`[a-z0-9._/-]{1,128}`).
///
/// It is also the object's handle everywhere past the decoder. An address of up to 30 bytes is
/// held in place, so the records, frames and events of one object carry it without touching
/// the allocator or a reference count that the app's, the peer's and the store's threads would
/// move in turn; a longer one is shared. It compares, orders and hashes as its text, and
/// borrows as `str`, so maps keyed by it are looked up with a plain `&str`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Address(Text<ADDRESS_INLINE_BYTES>);

/// The longest address kept inline (an [`Address`] is then 32 bytes); a longer one is shared.
const ADDRESS_INLINE_BYTES: usize = 30;

/// Why a string is not an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AddressError {
    /// An `@` anywhere: the substrate does not route (answered `routing_not_supported`).
    #[error("addresses with `@` are not routed")]
    RoutingNotSupported,
    /// Empty, longer than 128 bytes, or a character outside `[a-z0-9._/-]`.
    #[error("address is not [a-z0-9._/-]{{1,{ADDRESS_BYTES_MAX}}}")]
    Invalid,
}

impl Address {
    /// Validates `text` as an address. An `@` wins over every other defect.
    pub fn parse(text: &str) -> Result<Self, AddressError> {
        if text.contains('@') {
            return Err(AddressError::RoutingNotSupported);
        }
        let allowed = |b: u8| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'/' | b'-');
        if text.is_empty() || text.len() > ADDRESS_BYTES_MAX || !text.bytes().all(allowed) {
            return Err(AddressError::Invalid);
        }
        Ok(Self(Text::new(text)))
    }

    /// [`Address::parse`] of text read off the wire as bytes not yet checked as UTF-8: an
    /// address is ASCII, so a valid one needs no other check; anything else is answered as
    /// the text reader and `parse` would answer it (not UTF-8 first).
    fn parse_wire(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        let allowed = |b: &u8| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'/' | b'-');
        if !bytes.is_empty() && bytes.len() <= ADDRESS_BYTES_MAX && bytes.iter().all(allowed) {
            return Ok(Self(
                Text::ascii(bytes).expect("the address charset is ASCII"),
            ));
        }
        let text =
            std::str::from_utf8(bytes).map_err(|_| EnvelopeError::Cbor(CborError::NotUtf8))?;
        Self::parse(text).map_err(EnvelopeError::from)
    }

    /// The address text.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

text_handle!(Address);

/// An object's name as an app gave it, before it is checked against [`Address`]'s rules
/// (the substrate machine checks it when the command runs, as it would a `&str`). Held in
/// place when short, so that a command carrying one costs no allocation for it.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjName(Text<ADDRESS_INLINE_BYTES>);

impl ObjName {
    /// `text`, unchecked.
    pub fn new(text: &str) -> Self {
        Self(Text::new(text))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl From<&str> for ObjName {
    fn from(text: &str) -> Self {
        Self::new(text)
    }
}

impl From<String> for ObjName {
    fn from(text: String) -> Self {
        Self::new(&text)
    }
}

impl From<&Address> for ObjName {
    fn from(address: &Address) -> Self {
        Self(address.0.clone())
    }
}

text_handle!(ObjName);

/// The longest op id kept inline: tether's own ids (two 64-bit words in hex) fit.
const OP_ID_INLINE_BYTES: usize = 32;

/// An op's id (`id`): producer-stable text, at most [`ENVELOPE_TEXT_BYTES_MAX`] bytes.
///
/// Ids of up to 32 bytes (every id tether mints, and most any producer would) are held inline,
/// so making, cloning and dropping one allocates nothing; a longer id is shared. It compares,
/// orders and hashes as its text.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpId(Text<OP_ID_INLINE_BYTES>);

impl OpId {
    /// The id `text`.
    pub fn new(text: &str) -> Self {
        Self(Text::new(text))
    }

    /// Two 64-bit words as 32 lowercase hex digits, written in place (tether's own ids: the
    /// machine's boot and its counter).
    pub fn from_words(high: u64, low: u64) -> Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut bytes = [0u8; OP_ID_INLINE_BYTES];
        for (i, byte) in bytes.iter_mut().enumerate() {
            let (word, at) = if i < 16 { (high, i) } else { (low, i - 16) };
            *byte = HEX[((word >> (60 - 4 * at)) & 0xf) as usize];
        }
        let hex = std::str::from_utf8(&bytes).expect("hex digits are ASCII");
        Self(Text::inline(hex).expect("32 hex digits fit inline"))
    }

    /// The two words of an id [`OpId::from_words`] wrote (32 lowercase hex digits); `None` for
    /// any other id.
    pub fn words(&self) -> Option<(u64, u64)> {
        let text = self.0.as_str().as_bytes();
        if text.len() != OP_ID_INLINE_BYTES {
            return None;
        }
        let mut words = [0u64; 2];
        for (i, byte) in text.iter().enumerate() {
            let digit = match byte {
                b'0'..=b'9' => byte - b'0',
                b'a'..=b'f' => byte - b'a' + 10,
                _ => return None,
            };
            words[i / 16] = words[i / 16] << 4 | u64::from(digit);
        }
        Some((words[0], words[1]))
    }

    /// The id's text.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

text_handle!(OpId);

impl From<&str> for OpId {
    fn from(text: &str) -> Self {
        Self::new(text)
    }
}

impl From<String> for OpId {
    fn from(text: String) -> Self {
        Self::new(&text)
    }
}

impl PartialEq<String> for OpId {
    fn eq(&self, other: &String) -> bool {
        self.as_str() == other.as_str()
    }
}

impl PartialEq<OpId> for String {
    fn eq(&self, other: &OpId) -> bool {
        self.as_str() == other.as_str()
    }
}

impl PartialEq<OpId> for &str {
    fn eq(&self, other: &OpId) -> bool {
        *self == other.as_str()
    }
}

/// The substrate's verbs (docs/spec/substrate.md §2.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
#[allow(missing_docs)] // Each verb is named by its wire spelling.
pub enum Verb {
    Open,
    Accept,
    Reject,
    Close,
    Send,
    Ack,
    Req,
    Res,
    End,
    Err,
    Chunk,
    Resync,
}

impl Verb {
    /// Every verb.
    pub const ALL: [Verb; 12] = [
        Self::Open,
        Self::Accept,
        Self::Reject,
        Self::Close,
        Self::Send,
        Self::Ack,
        Self::Req,
        Self::Res,
        Self::End,
        Self::Err,
        Self::Chunk,
        Self::Resync,
    ];

    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Accept => "accept",
            Self::Reject => "reject",
            Self::Close => "close",
            Self::Send => "send",
            Self::Ack => "ack",
            Self::Req => "req",
            Self::Res => "res",
            Self::End => "end",
            Self::Err => "err",
            Self::Chunk => "chunk",
            Self::Resync => "resync",
        }
    }

    /// The verb spelled `text`, if any.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|verb| verb.as_str() == text)
    }
}

/// The two kinds of named object (docs/spec/substrate.md §1.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ObjKind {
    /// Request/response conversation.
    Session,
    /// One-way durable messages.
    Queue,
}

impl ObjKind {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Session => "session",
            Self::Queue => "queue",
        }
    }

    /// The kind spelled `text`, if any.
    pub fn parse(text: &str) -> Option<Self> {
        [Self::Session, Self::Queue]
            .into_iter()
            .find(|kind| kind.as_str() == text)
    }
}

/// The `env` map.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Env {
    /// The verb (`kind`).
    pub kind: Verb,
    /// The object addressed (`obj`).
    pub obj: Option<Address>,
    /// The object's kind (`objKind`), carried on first introduction.
    pub obj_kind: Option<ObjKind>,
    /// Producer-stable op id (`id`).
    pub id: Option<OpId>,
    /// Per-object sequence number (`seq`).
    pub seq: Option<u64>,
    /// Delivery attempt, from 1 (`receipt`).
    pub receipt: Option<u64>,
    /// Error or reject code (`code`).
    pub code: Option<String>,
    /// Human-readable message (`message`).
    pub message: Option<String>,
    /// Close or cancel reason (`reason`).
    pub reason: Option<String>,
    /// First sequence to resend (`fromSeq`).
    pub from_seq: Option<u64>,
    /// Capability token presented with an open (`cap`).
    pub cap: Option<String>,
    /// The sender's low-water mark for this object (`floor`): every seq of its direction below
    /// it that the receiver has not delivered was ended by the sender (a terminal answer or
    /// expiry) and will never be sent, so the receiver's frontier may skip to it.
    pub floor: Option<u64>,
    /// The receiver's credit for this object (`limit`), on acks and credit updates: the peer
    /// may transmit ops with seqs below it, and the receiver has room for every one of them.
    pub limit: Option<u64>,
}

impl Env {
    /// An env with only a verb.
    pub fn new(kind: Verb) -> Self {
        Self {
            kind,
            obj: None,
            obj_kind: None,
            id: None,
            seq: None,
            receipt: None,
            code: None,
            message: None,
            reason: None,
            from_seq: None,
            cap: None,
            floor: None,
            limit: None,
        }
    }
}

/// One substrate frame.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Envelope {
    /// The type byte (never 0).
    pub type_byte: u8,
    /// The envelope.
    pub env: Env,
    /// The opaque body, a zero-copy slice of the received frame.
    pub body: Option<Bytes>,
}

/// Why a substrate frame could not be decoded or encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// The stream ended inside a frame.
    #[error("substrate stream ends inside a frame ({buffered} bytes left)")]
    Truncated {
        /// Bytes of the incomplete frame.
        buffered: u64,
    },
    /// A frame longer than [`ENVELOPE_FRAME_BYTES_MAX`] (fatal).
    #[error("substrate frame of {len} bytes exceeds {ENVELOPE_FRAME_BYTES_MAX}")]
    FrameTooLarge {
        /// Declared length.
        len: u64,
    },
    /// A zero length: no type byte.
    #[error("substrate frame without a type byte")]
    Empty,
    /// Type byte `0x00`.
    #[error("substrate type byte 0x00 is reserved")]
    ReservedType,
    /// Malformed or non-canonical CBOR.
    #[error("substrate frame CBOR: {0}")]
    Cbor(#[from] CborError),
    /// A key that is not part of the format.
    #[error("unknown substrate key `{key}`")]
    UnknownKey {
        /// The key (empty when it was not text).
        key: String,
    },
    /// A key present twice.
    #[error("duplicate substrate key `{key}`")]
    DuplicateKey {
        /// The key.
        key: &'static str,
    },
    /// A required key is absent (`env`, `v`, `kind`).
    #[error("substrate frame lacks `{field}`")]
    MissingField {
        /// Field name.
        field: &'static str,
    },
    /// A field with the wrong type, or a value outside its domain (unknown verb or objKind,
    /// receipt 0, text over [`ENVELOPE_TEXT_BYTES_MAX`], more than
    /// [`ENVELOPE_ENV_KEYS_MAX`] keys).
    #[error("substrate field `{field}` is invalid")]
    Invalid {
        /// Field name.
        field: &'static str,
    },
    /// An envelope version other than 1.
    #[error("substrate envelope version {version} is not {ENVELOPE_VERSION}")]
    BadVersion {
        /// The version sent.
        version: u64,
    },
    /// `obj` is not an address.
    #[error("substrate address: {0}")]
    Address(#[from] AddressError),
    /// `obj` contains `@`. The rest of the frame decoded, so the op can be answered with one
    /// terminal `routing_not_supported` (docs/spec/substrate.md §1.2): its id is kept.
    #[error("substrate address with `@`: routing is not supported")]
    RoutingNotSupported {
        /// The op's id, if the frame carried one.
        id: Option<OpId>,
    },
    /// A body above its bound (64 KiB inline, 256 KiB bulk chunk).
    #[error("substrate body of {len} bytes exceeds {max}")]
    BodyTooLarge {
        /// Body length.
        len: u64,
        /// The bound for this frame type.
        max: u64,
    },
    /// Bytes after the CBOR map inside the frame.
    #[error("bytes after the substrate map")]
    TrailingBytes,
}

impl FormatError for EnvelopeError {
    fn is_fatal(&self) -> bool {
        matches!(self, Self::FrameTooLarge { .. } | Self::Truncated { .. })
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Truncated { .. } => "truncated",
            Self::FrameTooLarge { .. } => "frame_too_large",
            Self::Empty => "empty_frame",
            Self::ReservedType => "reserved_type",
            Self::Cbor(_) => "bad_cbor",
            Self::UnknownKey { .. } => "unknown_key",
            Self::DuplicateKey { .. } => "duplicate_key",
            Self::MissingField { .. } => "missing_field",
            Self::Invalid { .. } => "invalid_field",
            Self::BadVersion { .. } => "bad_version",
            Self::Address(AddressError::RoutingNotSupported) | Self::RoutingNotSupported { .. } => {
                "routing_not_supported"
            }
            Self::Address(_) => "invalid_address",
            Self::BodyTooLarge { .. } => "payload_too_large",
            Self::TrailingBytes => "trailing_bytes",
        }
    }
}

/// Where a link's frames are encoded: [`BytesMut`] takes every byte, [`FrameChunks`] keeps
/// large bodies as the buffers they are.
pub trait FrameSink {
    /// Appends `frame` (length, type byte, CBOR, body), refusing what a decoder would reject;
    /// on an error the sink is as it was.
    fn put_frame(&mut self, frame: &Envelope) -> Result<(), EnvelopeError>;
}

impl FrameSink for BytesMut {
    fn put_frame(&mut self, frame: &Envelope) -> Result<(), EnvelopeError> {
        frame.encode_into(self)
    }
}

/// Frames as a list of chunks for a writer that takes owned buffers (a QUIC stream queues
/// them without a copy): each frame's head is written into a shared buffer, and a body of at
/// least `by_reference` bytes follows as its own chunk, the app's buffer itself, not a copy.
/// The chunks, joined, are exactly the bytes [`Envelope::encode`] writes.
#[derive(Debug)]
pub struct FrameChunks {
    head: BytesMut,
    chunks: Vec<Bytes>,
    len: usize,
    by_reference: usize,
}

impl FrameChunks {
    /// Chunks that keep bodies of at least `by_reference` bytes by reference (`usize::MAX`:
    /// every byte copied into one buffer, for a writer that takes bytes).
    pub fn new(by_reference: usize) -> Self {
        Self {
            head: BytesMut::new(),
            chunks: Vec::new(),
            len: 0,
            by_reference,
        }
    }

    /// Makes room for `additional` bytes of heads (and copied bodies).
    pub fn reserve(&mut self, additional: usize) {
        self.head.reserve(additional);
    }

    /// Bytes of frames held, bodies kept by reference included.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no frame is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The chunks of the frames held, in order, leaving the sink empty (its buffer's spare
    /// room stays for the next frames).
    pub fn take(&mut self) -> Vec<Bytes> {
        if !self.head.is_empty() {
            self.chunks.push(self.head.split().freeze());
        }
        self.len = 0;
        std::mem::take(&mut self.chunks)
    }
}

impl FrameSink for FrameChunks {
    fn put_frame(&mut self, frame: &Envelope) -> Result<(), EnvelopeError> {
        let body = frame.body.as_ref().filter(|b| b.len() >= self.by_reference);
        let Some(body) = body else {
            let before = self.head.len();
            frame.encode_into(&mut self.head)?;
            self.len += self.head.len() - before;
            return Ok(());
        };
        let before = self.head.len();
        frame.encode_head_into(&mut self.head)?;
        self.len += self.head.len() - before + body.len();
        self.chunks.push(self.head.split().freeze());
        self.chunks.push(body.clone());
        Ok(())
    }
}

/// The substrate-frame [`Format`]; wrap it in a [`super::StreamDecoder`].
#[derive(Debug, Clone, Default)]
pub struct EnvelopeDecoder;

impl Format for EnvelopeDecoder {
    type Item = Envelope;
    type Error = EnvelopeError;

    fn decode<I: Input>(&mut self, buf: &mut I) -> Result<Option<Envelope>, EnvelopeError> {
        match take_length_prefixed(buf, ENVELOPE_FRAME_BYTES_MAX) {
            Ok(Some(frame)) => Envelope::decode_frame(&frame).map(Some),
            Ok(None) => Ok(None),
            Err(len) => Err(EnvelopeError::FrameTooLarge { len }),
        }
    }

    fn item_len(&self, buf: &[u8]) -> Option<usize> {
        length_prefixed_len(buf)
    }

    fn finish(&self, buffered: usize) -> Result<(), EnvelopeError> {
        match buffered {
            0 => Ok(()),
            n => Err(EnvelopeError::Truncated { buffered: n as u64 }),
        }
    }
}

/// The env keys, in the order the encoder writes them.
const ENV_KEYS: [&str; 14] = [
    "v", "kind", "obj", "objKind", "id", "seq", "receipt", "code", "message", "reason", "fromSeq",
    "cap", "floor", "limit",
];

impl Envelope {
    /// An envelope frame (type `0x01`) without a body.
    pub fn new(env: Env) -> Self {
        Self {
            type_byte: TYPE_ENVELOPE,
            env,
            body: None,
        }
    }

    /// Decodes one frame (type byte and CBOR, without the length prefix).
    pub fn decode_frame(frame: &Bytes) -> Result<Envelope, EnvelopeError> {
        let (&type_byte, cbor) = frame.split_first().ok_or(EnvelopeError::Empty)?;
        if type_byte == 0 {
            return Err(EnvelopeError::ReservedType);
        }
        let mut reader = Reader::new(cbor);
        let (mut env, mut body) = (None, None);
        let pairs = reader.map().map_err(invalid("frame"))?;
        for _ in 0..pairs {
            match reader.text_bytes().map_err(|_| unknown_key(""))? {
                b"env" if env.is_some() => return Err(EnvelopeError::DuplicateKey { key: "env" }),
                b"env" => env = Some(read_env(&mut reader)?),
                b"body" if body.is_some() => {
                    return Err(EnvelopeError::DuplicateKey { key: "body" });
                }
                b"body" => body = Some(frame.slice_ref(reader.bytes().map_err(invalid("body"))?)),
                other => return Err(unknown_key_bytes(other)),
            }
        }
        if !reader.is_empty() {
            return Err(EnvelopeError::TrailingBytes);
        }
        let env = env.ok_or(EnvelopeError::MissingField { field: "env" })?;
        let envelope = Envelope {
            type_byte,
            env,
            body,
        };
        envelope.check_body()?;
        Ok(envelope)
    }

    /// Appends the frame (length, type byte, CBOR), refusing what a decoder would reject.
    pub fn encode(&self, out: &mut impl BufMut) -> Result<(), EnvelopeError> {
        self.check_encodable()?;
        // Everything but the body's bytes is written first, so that the body is copied once,
        // straight into `out`, after the length it counts in.
        let mut head = Vec::with_capacity(128);
        self.write_cbor_head(&mut head);
        let body = self.body.as_deref().unwrap_or_default();
        let len = 1 + head.len() + body.len();
        if len > ENVELOPE_FRAME_BYTES_MAX {
            return Err(EnvelopeError::FrameTooLarge { len: len as u64 });
        }
        out.put_u32(len as u32);
        out.put_u8(self.type_byte);
        out.put_slice(&head);
        out.put_slice(body);
        Ok(())
    }

    /// The same frame as [`Envelope::encode`], its CBOR written straight into `out` and the
    /// length filled in after (no scratch buffer); on an error `out` is as it was.
    pub fn encode_into(&self, out: &mut BytesMut) -> Result<(), EnvelopeError> {
        self.encode_head_into(out)?;
        out.put_slice(self.body.as_deref().unwrap_or_default());
        Ok(())
    }

    /// The frame up to its body's bytes (length, type byte, CBOR head) into `out`; the body's
    /// bytes are the caller's to write next. On an error `out` is as it was.
    fn encode_head_into(&self, out: &mut BytesMut) -> Result<(), EnvelopeError> {
        self.check_encodable()?;
        let start = out.len();
        out.put_u32(0);
        out.put_u8(self.type_byte);
        self.write_cbor_head(out);
        let body = self.body.as_deref().unwrap_or_default();
        let len = out.len() - start - 4 + body.len();
        if len > ENVELOPE_FRAME_BYTES_MAX {
            out.truncate(start);
            return Err(EnvelopeError::FrameTooLarge { len: len as u64 });
        }
        out[start..start + 4].copy_from_slice(&(len as u32).to_be_bytes());
        Ok(())
    }

    /// What a decoder would reject, found before anything is written.
    fn check_encodable(&self) -> Result<(), EnvelopeError> {
        if self.type_byte == 0 {
            return Err(EnvelopeError::ReservedType);
        }
        self.check_body()?;
        let lens = [
            self.env.id.as_ref().map(|id| id.as_bytes().len()),
            self.env.code.as_ref().map(String::len),
            self.env.message.as_ref().map(String::len),
            self.env.reason.as_ref().map(String::len),
            self.env.cap.as_ref().map(String::len),
        ];
        if lens
            .into_iter()
            .flatten()
            .any(|len| len > ENVELOPE_TEXT_BYTES_MAX)
        {
            return Err(EnvelopeError::Invalid { field: "text" });
        }
        if self.env.receipt == Some(0) {
            return Err(EnvelopeError::Invalid { field: "receipt" });
        }
        Ok(())
    }

    /// The CBOR map up to the body's bytes: `env`, and the body's key and length.
    fn write_cbor_head(&self, out: &mut impl BufMut) {
        cbor::write_map(out, 1 + usize::from(self.body.is_some()));
        cbor::write_text(out, "env");
        write_env(&self.env, out);
        if let Some(body) = &self.body {
            cbor::write_text(out, "body");
            cbor::write_head(out, cbor::MAJOR_BYTES, body.len() as u64);
        }
    }

    /// The body bound for this frame's type.
    pub fn body_bytes_max(&self) -> usize {
        match self.type_byte {
            TYPE_BULK_CHUNK => ENVELOPE_CHUNK_BODY_BYTES_MAX,
            _ => ENVELOPE_INLINE_BODY_BYTES_MAX,
        }
    }

    fn check_body(&self) -> Result<(), EnvelopeError> {
        let len = self.body.as_ref().map_or(0, Bytes::len);
        let max = self.body_bytes_max();
        if len > max {
            return Err(EnvelopeError::BodyTooLarge {
                len: len as u64,
                max: max as u64,
            });
        }
        Ok(())
    }
}

fn invalid(field: &'static str) -> impl Fn(CborError) -> EnvelopeError {
    move |error| match error {
        CborError::WrongType => EnvelopeError::Invalid { field },
        other => EnvelopeError::Cbor(other),
    }
}

/// An unknown key read as bytes: named if it is UTF-8 (as a text reader would have read it),
/// unnamed if not (as a text reader would have failed).
fn unknown_key_bytes(key: &[u8]) -> EnvelopeError {
    unknown_key(std::str::from_utf8(key).unwrap_or_default())
}

/// A text value that must be one of a few ASCII spellings, matched as bytes: a miss is answered
/// as the text reader would have answered it (not UTF-8), else as `field` invalid.
fn read_spelled<T: Copy>(
    reader: &mut Reader<'_>,
    field: &'static str,
    spellings: impl IntoIterator<Item = T>,
    spelling: impl Fn(T) -> &'static str,
) -> Result<T, EnvelopeError> {
    let bytes = reader.text_bytes().map_err(invalid(field))?;
    if let Some(found) = spellings
        .into_iter()
        .find(|&value| spelling(value).as_bytes() == bytes)
    {
        return Ok(found);
    }
    match std::str::from_utf8(bytes) {
        Ok(_) => Err(EnvelopeError::Invalid { field }),
        Err(_) => Err(EnvelopeError::Cbor(CborError::NotUtf8)),
    }
}

fn unknown_key(key: &str) -> EnvelopeError {
    // Bound the copy: the key is only for diagnostics.
    let key = key.chars().take(64).collect();
    EnvelopeError::UnknownKey { key }
}

fn read_str<'a>(reader: &mut Reader<'a>, field: &'static str) -> Result<&'a str, EnvelopeError> {
    let text = reader.text().map_err(invalid(field))?;
    if text.len() > ENVELOPE_TEXT_BYTES_MAX {
        return Err(EnvelopeError::Invalid { field });
    }
    Ok(text)
}

/// An op id: ASCII (every id tether mints) is UTF-8 as it stands and is taken without the
/// check; other text is checked as [`read_str`] checks it, in the same order.
fn read_op_id(reader: &mut Reader<'_>, field: &'static str) -> Result<OpId, EnvelopeError> {
    let bytes = reader.text_bytes().map_err(invalid(field))?;
    let text = if bytes.is_ascii() {
        None
    } else {
        Some(std::str::from_utf8(bytes).map_err(|_| EnvelopeError::Cbor(CborError::NotUtf8))?)
    };
    if bytes.len() > ENVELOPE_TEXT_BYTES_MAX {
        return Err(EnvelopeError::Invalid { field });
    }
    Ok(OpId(match text {
        Some(text) => Text::new(text),
        None => Text::ascii(bytes).expect("checked ASCII above"),
    }))
}

fn read_text(reader: &mut Reader<'_>, field: &'static str) -> Result<String, EnvelopeError> {
    read_str(reader, field).map(str::to_owned)
}

fn read_env(reader: &mut Reader<'_>) -> Result<Env, EnvelopeError> {
    let pairs = reader.map().map_err(invalid("env"))?;
    if pairs > ENVELOPE_ENV_KEYS_MAX {
        return Err(EnvelopeError::Invalid { field: "env" });
    }
    let mut seen = [false; ENV_KEYS.len()];
    let (mut version, mut kind) = (None, None);
    let mut routed = false;
    let mut env = Env::new(Verb::Open);
    for _ in 0..pairs {
        let key = reader.text_bytes().map_err(|_| unknown_key(""))?;
        let index = ENV_KEYS
            .iter()
            .position(|k| k.as_bytes() == key)
            .ok_or_else(|| unknown_key_bytes(key))?;
        let field = ENV_KEYS[index];
        if std::mem::replace(&mut seen[index], true) {
            return Err(EnvelopeError::DuplicateKey { key: field });
        }
        let uint = |reader: &mut Reader<'_>| reader.uint().map_err(invalid(field));
        match field {
            "v" => version = Some(uint(reader)?),
            "kind" => kind = Some(read_spelled(reader, field, Verb::ALL, Verb::as_str)?),
            "obj" => match Address::parse_wire(reader.text_bytes().map_err(invalid(field))?) {
                Ok(address) => env.obj = Some(address),
                // Keep decoding: the answer needs the op id, which may come later.
                Err(EnvelopeError::Address(AddressError::RoutingNotSupported)) => routed = true,
                Err(other) => return Err(other),
            },
            "objKind" => {
                let kinds = [ObjKind::Session, ObjKind::Queue];
                env.obj_kind = Some(read_spelled(reader, field, kinds, ObjKind::as_str)?);
            }
            "seq" => env.seq = Some(uint(reader)?),
            "receipt" => match uint(reader)? {
                0 => return Err(EnvelopeError::Invalid { field }),
                receipt => env.receipt = Some(receipt),
            },
            "fromSeq" => env.from_seq = Some(uint(reader)?),
            "floor" => env.floor = Some(uint(reader)?),
            "limit" => env.limit = Some(uint(reader)?),
            "id" => env.id = Some(read_op_id(reader, field)?),
            "code" => env.code = Some(read_text(reader, field)?),
            "message" => env.message = Some(read_text(reader, field)?),
            "reason" => env.reason = Some(read_text(reader, field)?),
            _ => env.cap = Some(read_text(reader, field)?),
        }
    }
    match version {
        Some(ENVELOPE_VERSION) => {}
        Some(version) => return Err(EnvelopeError::BadVersion { version }),
        None => return Err(EnvelopeError::MissingField { field: "v" }),
    }
    env.kind = kind.ok_or(EnvelopeError::MissingField { field: "kind" })?;
    if routed {
        return Err(EnvelopeError::RoutingNotSupported { id: env.id });
    }
    Ok(env)
}

fn write_env<'a>(env: &'a Env, out: &mut impl BufMut) {
    enum V<'a> {
        // UTF-8 held as bytes: an address or op id held in place gives its bytes unchecked.
        Text(&'a [u8]),
        Uint(u64),
    }
    let text = |v: &'a Option<String>| v.as_deref().map(|t| V::Text(t.as_bytes()));
    let values: [Option<V<'a>>; ENV_KEYS.len()] = [
        Some(V::Uint(ENVELOPE_VERSION)),
        Some(V::Text(env.kind.as_str().as_bytes())),
        env.obj.as_ref().map(|a| V::Text(a.as_bytes())),
        env.obj_kind.map(|k| V::Text(k.as_str().as_bytes())),
        env.id.as_ref().map(|id| V::Text(id.as_bytes())),
        env.seq.map(V::Uint),
        env.receipt.map(V::Uint),
        text(&env.code),
        text(&env.message),
        text(&env.reason),
        env.from_seq.map(V::Uint),
        text(&env.cap),
        env.floor.map(V::Uint),
        env.limit.map(V::Uint),
    ];
    cbor::write_map(out, values.iter().flatten().count());
    for (key, value) in ENV_KEYS.iter().zip(&values) {
        let Some(value) = value else { continue };
        cbor::write_text(out, key);
        match value {
            V::Text(text) => cbor::write_text_bytes(out, text),
            V::Uint(value) => cbor::write_uint(out, *value),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testing::{check_malformed, decode_split, golden};
    use proptest::prelude::*;

    fn encode_all(envelopes: &[Envelope]) -> Vec<u8> {
        let mut out = Vec::new();
        for envelope in envelopes {
            envelope.encode(&mut out).expect("within bounds");
        }
        out
    }

    fn env(kind: Verb, obj: &str) -> Env {
        Env {
            obj: Some(Address::parse(obj).unwrap()),
            ..Env::new(kind)
        }
    }

    fn golden_envelopes() -> Vec<Envelope> {
        let op = Some(OpId::from("01HZX3K9Q4M2"));
        let send = Env {
            obj_kind: Some(ObjKind::Queue),
            id: op.clone(),
            seq: Some(7),
            receipt: Some(1),
            ..env(Verb::Send, "orders/eu-1")
        };
        let ack = Env {
            id: op,
            seq: Some(7),
            receipt: Some(1),
            ..env(Verb::Ack, "orders/eu-1")
        };
        let err = Env {
            obj_kind: Some(ObjKind::Session),
            id: Some("op-9".into()),
            code: Some("scope_denied".into()),
            message: Some("not allowed".into()),
            reason: Some("policy".into()),
            ..env(Verb::Err, "chat.room_1")
        };
        let resync = Env {
            from_seq: Some(300),
            ..env(Verb::Resync, "orders/eu-1")
        };
        let open = Env {
            obj_kind: Some(ObjKind::Session),
            id: Some("op-1".into()),
            cap: Some("tok-123".into()),
            ..env(Verb::Open, "chat.room_1")
        };
        let chunk = Env {
            id: Some("op-2".into()),
            seq: Some(0),
            ..env(Verb::Chunk, "blobs")
        };
        vec![
            Envelope {
                body: Some(Bytes::from_static(b"hello")),
                ..Envelope::new(send)
            },
            Envelope::new(ack),
            Envelope::new(err),
            Envelope {
                type_byte: 0x03,
                ..Envelope::new(resync)
            },
            Envelope::new(open),
            Envelope {
                type_byte: TYPE_BULK_CHUNK,
                env: chunk,
                body: Some(vec![0xab; 300].into()),
            },
        ]
    }

    #[test]
    fn golden_valid_frames_both_ways() {
        let bytes = golden(include_str!("../../tests/golden/envelope/valid_frames.hex"));
        let expected = golden_envelopes();
        assert_eq!(encode_all(&expected), bytes);
        let (items, verdict) = decode_split(EnvelopeDecoder, &bytes, &[3, 50, 200]);
        assert_eq!(verdict, Ok(()));
        assert_eq!(items, expected);
    }

    #[test]
    fn golden_malformed_vectors() {
        let vectors = [
            include_str!("../../tests/golden/envelope/malformed_bad_version.hex"),
            include_str!("../../tests/golden/envelope/malformed_duplicate_key.hex"),
            include_str!("../../tests/golden/envelope/malformed_empty_frame.hex"),
            include_str!("../../tests/golden/envelope/malformed_frame_too_large.hex"),
            include_str!("../../tests/golden/envelope/malformed_invalid_address.hex"),
            include_str!("../../tests/golden/envelope/malformed_invalid_field.hex"),
            include_str!("../../tests/golden/envelope/malformed_invalid_field_verb.hex"),
            include_str!("../../tests/golden/envelope/malformed_missing_field.hex"),
            include_str!("../../tests/golden/envelope/malformed_payload_too_large.hex"),
            include_str!("../../tests/golden/envelope/malformed_reserved_type.hex"),
            include_str!("../../tests/golden/envelope/malformed_routing_not_supported.hex"),
            include_str!("../../tests/golden/envelope/malformed_trailing_bytes.hex"),
            include_str!("../../tests/golden/envelope/malformed_truncated.hex"),
            include_str!("../../tests/golden/envelope/malformed_unknown_key.hex"),
        ];
        for text in vectors {
            check_malformed(EnvelopeDecoder, text);
        }
    }

    #[test]
    fn addresses_follow_the_charset_and_at_wins() {
        assert!(Address::parse("a").is_ok());
        assert!(Address::parse(&"a".repeat(ADDRESS_BYTES_MAX)).is_ok());
        assert_eq!(
            Address::parse(&"a".repeat(ADDRESS_BYTES_MAX + 1)),
            Err(AddressError::Invalid)
        );
        assert_eq!(Address::parse(""), Err(AddressError::Invalid));
        assert_eq!(Address::parse("Q"), Err(AddressError::Invalid));
        assert_eq!(Address::parse("a b"), Err(AddressError::Invalid));
        assert_eq!(
            Address::parse("a@b"),
            Err(AddressError::RoutingNotSupported)
        );
        let long_with_at = format!("{}@", "A".repeat(200));
        assert_eq!(
            Address::parse(&long_with_at),
            Err(AddressError::RoutingNotSupported)
        );
    }

    #[test]
    fn encoder_refuses_what_the_decoder_rejects() {
        let mut big = golden_envelopes().remove(0);
        big.body = Some(vec![0; ENVELOPE_INLINE_BODY_BYTES_MAX + 1].into());
        assert_eq!(
            big.encode(&mut Vec::new()).unwrap_err().kind(),
            "payload_too_large"
        );
        big.type_byte = TYPE_BULK_CHUNK;
        assert!(
            big.encode(&mut Vec::new()).is_ok(),
            "bulk chunks carry up to 256 KiB"
        );
        big.type_byte = 0;
        assert_eq!(
            big.encode(&mut Vec::new()).unwrap_err().kind(),
            "reserved_type"
        );
        let mut zero = golden_envelopes().remove(1);
        zero.env.receipt = Some(0);
        assert_eq!(
            zero.encode(&mut Vec::new()).unwrap_err().kind(),
            "invalid_field"
        );
        let mut chatty = golden_envelopes().remove(1);
        chatty.env.message = Some("m".repeat(ENVELOPE_TEXT_BYTES_MAX + 1));
        assert_eq!(
            chatty.encode(&mut Vec::new()).unwrap_err().kind(),
            "invalid_field"
        );
    }

    fn envelope() -> impl Strategy<Value = Envelope> {
        let text = || proptest::option::of(".{0,10}");
        let uint = || proptest::option::of(any::<u64>());
        let obj =
            proptest::option::of("[a-z0-9._/-]{1,20}".prop_map(|a| Address::parse(&a).unwrap()));
        let kind = proptest::sample::select(Verb::ALL.to_vec());
        let obj_kind =
            proptest::option::of(prop_oneof![Just(ObjKind::Session), Just(ObjKind::Queue)]);
        let receipt = proptest::option::of(1..u64::MAX);
        let head = (1u8..=255, kind, obj, obj_kind, receipt);
        let rest = (
            text(),
            text(),
            text(),
            text(),
            text(),
            uint(),
            uint(),
            uint(),
            uint(),
        );
        let body = proptest::option::of(proptest::collection::vec(any::<u8>(), 0..100));
        (head, rest, body).prop_map(|(head, rest, body)| {
            let mut env = Env::new(head.1);
            (env.obj, env.obj_kind, env.receipt) = (head.2, head.3, head.4);
            (env.id, env.code, env.message, env.reason, env.cap) =
                (rest.0.map(OpId::from), rest.1, rest.2, rest.3, rest.4);
            (env.seq, env.from_seq, env.floor, env.limit) = (rest.5, rest.6, rest.7, rest.8);
            Envelope {
                type_byte: head.0,
                env,
                body: body.map(Bytes::from),
            }
        })
    }

    proptest! {
        /// An id written from two words gives them back, and only such an id has words: any
        /// other text (another length, upper case, not hex) has none.
        #[test]
        fn an_id_gives_back_the_words_it_was_written_from(
            high in any::<u64>(),
            low in any::<u64>(),
            other in "[0-9a-zA-Z-]{0,40}",
        ) {
            prop_assert_eq!(OpId::from_words(high, low).words(), Some((high, low)));
            let is_words = other.len() == 32
                && other.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
            prop_assert_eq!(OpId::new(&other).words().is_some(), is_words, "{}", other);
        }
    }

    proptest! {
        /// Frames put into chunks are, joined, the bytes `encode` writes, whatever the
        /// threshold; a body at or past it is its own chunk and the caller's buffer itself (no
        /// copy), a smaller one is copied in; the count is the bytes held, and a take leaves the
        /// sink empty for the next frames. A frame the encoder refuses leaves the sink as it was.
        #[test]
        fn chunks_join_to_the_encoded_frames_and_keep_large_bodies_by_reference(
            batches in proptest::collection::vec(proptest::collection::vec(envelope(), 0..6), 1..4),
            by_reference in prop_oneof![Just(0usize), 1usize..100, Just(usize::MAX)],
        ) {
            let mut sink = FrameChunks::new(by_reference);
            for envelopes in batches {
                let mut expected = Vec::new();
                for envelope in &envelopes {
                    envelope.encode(&mut expected).expect("within bounds");
                    sink.put_frame(envelope).expect("within bounds");
                }
                let mut refused = envelopes.first().cloned().unwrap_or_else(|| golden_envelopes().remove(0));
                refused.type_byte = 0;
                prop_assert!(sink.put_frame(&refused).is_err());
                prop_assert_eq!(sink.len(), expected.len());
                let chunks = sink.take();
                prop_assert!(sink.is_empty());
                prop_assert_eq!(sink.len(), 0);
                let joined: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
                prop_assert_eq!(&joined, &expected);
                let referenced: Vec<&Bytes> = envelopes
                    .iter()
                    .filter_map(|e| e.body.as_ref())
                    .filter(|b| b.len() >= by_reference)
                    .collect();
                let mut found = chunks.iter().filter(|c| {
                    referenced.iter().any(|b| b.as_ptr() == c.as_ptr() && b.len() == c.len())
                });
                for body in &referenced {
                    let chunk = found.next();
                    prop_assert!(chunk.is_some_and(|c| c.as_ptr() == body.as_ptr()), "body kept by reference");
                }
                if by_reference == usize::MAX {
                    prop_assert!(chunks.len() <= 1, "one buffer when nothing goes by reference");
                }
            }
        }

        #[test]
        fn round_trips_in_every_split(
            envelopes in proptest::collection::vec(envelope(), 0..6),
            cuts in proptest::collection::vec(any::<usize>(), 0..6),
        ) {
            let bytes = encode_all(&envelopes);
            let (items, verdict) = decode_split(EnvelopeDecoder, &bytes, &cuts);
            prop_assert_eq!(verdict, Ok(()));
            prop_assert_eq!(items, envelopes);
        }

        /// `encode_into` writes exactly what `encode` writes after whatever `out` held, and
        /// refuses exactly what it refuses, leaving `out` as it was.
        #[test]
        fn encoding_in_place_writes_what_encode_writes(
            envelope in envelope(),
            held in proptest::collection::vec(any::<u8>(), 0..40),
            flaw in 0u8..4,
        ) {
            let mut envelope = envelope;
            match flaw {
                1 => envelope.env.receipt = Some(0),
                2 => envelope.type_byte = 0,
                3 => envelope.env.message = Some("m".repeat(ENVELOPE_TEXT_BYTES_MAX + 1)),
                _ => {}
            }
            let mut expected = held.clone();
            let verdict = envelope.encode(&mut expected);
            let mut out = BytesMut::from(&held[..]);
            prop_assert_eq!(envelope.encode_into(&mut out), verdict.clone());
            if verdict.is_err() {
                prop_assert_eq!(&out[..], &held[..]);
            }
            prop_assert_eq!(&out[..], &expected[..]);
        }

        #[test]
        fn arbitrary_frames_never_panic_and_reencode_stably(
            frame in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            if let Ok(envelope) = Envelope::decode_frame(&Bytes::from(frame)) {
                let mut bytes = Vec::new();
                envelope.encode(&mut bytes).unwrap();
                let again = Envelope::decode_frame(&Bytes::from(bytes).split_off(4));
                prop_assert_eq!(again, Ok(envelope));
            }
        }
    }

    #[test]
    fn minted_op_ids_are_the_two_words_in_hex_held_inline() {
        let id = OpId::from_words(0x0123_4567_89ab_cdef, 42);
        assert_eq!(
            id,
            format!("{:016x}{:016x}", 0x0123_4567_89ab_cdef_u64, 42u64)
        );
        assert_eq!(id, OpId::new(id.as_str()));
        assert!(id.0.is_inline());
    }

    proptest! {
        /// Inline and shared ids compare, order and hash as their text, whichever form each
        /// side took (the form follows the length in bytes alone), multi-byte characters
        /// included (ids compare as bytes).
        #[test]
        fn op_ids_behave_as_their_text(a in "[a-z0-9é€𝄞-]{0,40}", b in "[a-z0-9é€𝄞-]{0,40}") {
            use std::hash::{BuildHasher, RandomState};
            let (x, y) = (OpId::new(&a), OpId::new(&b));
            prop_assert_eq!(x.as_str(), a.as_str());
            prop_assert_eq!(x == y, a == b);
            prop_assert_eq!(x.cmp(&y), a.cmp(&b));
            let hasher = RandomState::new();
            prop_assert_eq!(hasher.hash_one(&x), hasher.hash_one(a.as_str()));
            prop_assert_eq!(x.0.is_inline(), a.len() <= 32);
        }

        /// A map keyed by addresses is looked up by the text alone.
        #[test]
        fn addresses_borrow_as_their_text(text in "[a-z0-9._/-]{1,128}") {
            let address = Address::parse(&text).expect("valid");
            prop_assert_eq!(address.0.is_inline(), text.len() <= ADDRESS_INLINE_BYTES);
            let mut map = std::collections::BTreeMap::new();
            map.insert(address.clone(), ());
            prop_assert!(map.contains_key(text.as_str()));
            prop_assert_eq!(address.to_string(), text);
        }

        /// A table keyed by addresses or ids is looked up by text through the probe (text
        /// that fits in place) or by `str` (longer text) alike: every present and absent text,
        /// short and long, multi-byte included, finds what `str` finds.
        #[test]
        fn lookups_by_text_find_what_str_finds(
            keys in proptest::collection::vec("[a-z0-9é-]{0,40}", 0..24),
            probes in proptest::collection::vec("[a-z0-9é-]{0,40}", 0..24),
        ) {
            use crate::wire::text::ByText;
            let ids: std::collections::BTreeMap<OpId, usize> =
                keys.iter().enumerate().map(|(i, k)| (OpId::new(k), i)).collect();
            let addresses: std::collections::BTreeMap<Address, usize> = keys
                .iter()
                .enumerate()
                .filter_map(|(i, k)| Address::parse(k).ok().map(|a| (a, i)))
                .collect();
            for text in probes.iter().chain(&keys) {
                prop_assert_eq!(ids.get_text(text), ids.get(text.as_str()));
                prop_assert_eq!(ids.get_key_value_text(text), ids.get_key_value(text.as_str()));
                prop_assert_eq!(addresses.get_text(text), addresses.get(text.as_str()));
                prop_assert_eq!(
                    addresses.get_key_value_text(text),
                    addresses.get_key_value(text.as_str())
                );
            }
        }

        /// The decoder reads keys, verbs, kinds, addresses and ids as bytes, checking UTF-8
        /// only where it must; each answers as a reader of text would: bytes that are not
        /// UTF-8 fail as such, text is then judged as text (a reference written here from
        /// `str` parsing).
        #[test]
        fn text_read_as_bytes_answers_as_text_would(
            field in 0usize..6,
            raw in proptest::collection::vec(
                prop_oneof![
                    4 => proptest::sample::select(b"abq0/._-@Sx".to_vec()),
                    1 => any::<u8>(),
                ],
                0..40,
            ),
            spelled in proptest::sample::select(vec![
                "send", "ack", "res", "queue", "session", "q0", "a@b", "kind", "bogus", "v", "env",
            ]),
            use_spelled in any::<bool>(),
        ) {
            let raw = if use_spelled { spelled.as_bytes().to_vec() } else { raw };
            let text = |out: &mut Vec<u8>, bytes: &[u8]| {
                cbor::write_head(out, cbor::MAJOR_TEXT, bytes.len() as u64);
                out.extend_from_slice(bytes);
            };
            // A send frame with the chosen text put in: 0 an outer key, 1 an env key, then
            // the values of kind, obj, objKind and id.
            let mut cbor_out = Vec::new();
            cbor::write_map(&mut cbor_out, 1);
            if field == 0 { text(&mut cbor_out, &raw) } else { cbor::write_text(&mut cbor_out, "env") }
            let pairs: [(&str, &[u8]); 5] = [
                ("kind", if field == 2 { &raw } else { b"send" }),
                ("obj", if field == 3 { &raw } else { b"q0" }),
                ("objKind", if field == 4 { &raw } else { b"queue" }),
                ("id", if field == 5 { &raw } else { b"op-1" }),
                ("v", b""),
            ];
            cbor::write_map(&mut cbor_out, pairs.len());
            for (key, value) in pairs {
                if key == "v" {
                    if field == 1 { text(&mut cbor_out, &raw) } else { cbor::write_text(&mut cbor_out, "v") }
                    cbor::write_uint(&mut cbor_out, ENVELOPE_VERSION);
                } else {
                    cbor::write_text(&mut cbor_out, key);
                    text(&mut cbor_out, value);
                }
            }
            let mut frame = vec![TYPE_ENVELOPE];
            frame.extend_from_slice(&cbor_out);
            let got = Envelope::decode_frame(&Bytes::from(frame));

            let Ok(as_text) = std::str::from_utf8(&raw) else {
                let expected = match field {
                    0 | 1 => EnvelopeError::UnknownKey { key: String::new() },
                    _ => EnvelopeError::Cbor(CborError::NotUtf8),
                };
                prop_assert_eq!(got, Err(expected));
                return Ok(());
            };
            match field {
                0 | 1 => {
                    let known = if field == 0 { &["env", "body"][..] } else { &ENV_KEYS[..] };
                    prop_assume!(!known.contains(&as_text));
                    let key = as_text.chars().take(64).collect();
                    prop_assert_eq!(got, Err(EnvelopeError::UnknownKey { key }));
                }
                2 => match Verb::parse(as_text) {
                    Some(verb) => prop_assert_eq!(got.map(|e| e.env.kind), Ok(verb)),
                    None => prop_assert_eq!(got, Err(EnvelopeError::Invalid { field: "kind" })),
                },
                3 => match Address::parse(as_text) {
                    Ok(address) => prop_assert_eq!(got.map(|e| e.env.obj), Ok(Some(address))),
                    Err(AddressError::RoutingNotSupported) => prop_assert_eq!(
                        got,
                        Err(EnvelopeError::RoutingNotSupported { id: Some(OpId::new("op-1")) })
                    ),
                    Err(error) => prop_assert_eq!(got, Err(EnvelopeError::Address(error))),
                },
                4 => match ObjKind::parse(as_text) {
                    Some(kind) => prop_assert_eq!(got.map(|e| e.env.obj_kind), Ok(Some(kind))),
                    None => prop_assert_eq!(got, Err(EnvelopeError::Invalid { field: "objKind" })),
                },
                _ => {
                    let id = got.expect("any text is an id").env.id.expect("an id");
                    prop_assert_eq!(id.as_str(), as_text);
                    prop_assert_eq!(id.0.is_inline(), as_text.len() <= OP_ID_INLINE_BYTES);
                }
            }
        }

        /// An object name is any text, unchecked, held in place when short, and orders and
        /// is looked up as its text (a name from an address is the address's text).
        #[test]
        fn object_names_are_their_text(a in ".{0,40}", b in ".{0,40}") {
            let (x, y) = (ObjName::new(&a), ObjName::new(&b));
            prop_assert_eq!(x.as_str(), a.as_str());
            prop_assert_eq!(x.cmp(&y), a.cmp(&b));
            prop_assert_eq!(x.0.is_inline(), a.len() <= ADDRESS_INLINE_BYTES);
            let mut map = std::collections::BTreeMap::new();
            map.insert(x.clone(), ());
            prop_assert!(map.contains_key(a.as_str()));
            if let Ok(address) = Address::parse(&a) {
                prop_assert_eq!(ObjName::from(&address), x);
            }
        }
    }
}
