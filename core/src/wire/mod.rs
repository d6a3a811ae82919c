//! The wire (and on-disk) formats of tether and the incremental decoder they share.
//!
//! | module | carries | framing |
//! |---|---|---|
//! | [`actor`] | actor messages on the actor ALPN | fixed header, two lengths |
//! | [`telemetry`] | DSQ2 telemetry streams | header, then tagged records |
//! | [`bifaci`] | request-switch frames | u32 BE length + CBOR map |
//! | [`envelope`] | substrate frames | u32 BE length + type + CBOR |
//!
//! The log store's file format lives with the records it holds, in `crate::substrate::log`
//! (it implements [`FormatError`] like these).
//!
//! The wire formats are specified in docs/spec/driver.md §3.1 (actor) and §5.2 (telemetry),
//! docs/spec/switch.md §2 (bifaci) and docs/spec/substrate.md §2 (envelope).
//!
//! Each format implements [`Format`]; [`StreamDecoder`] turns a format into an incremental
//! decoder that accepts bytes in any split and tracks the stream offset of every error.
//!
//! # Errors: fatal and frame-local
//!
//! A *fatal* error means the stream can no longer be framed (a length over its bound, a bad
//! magic, an unknown record tag): the decoder is poisoned and keeps answering the same error.
//! A *frame-local* error means one length-delimited frame was well framed but its content is
//! invalid: the frame is consumed and the next [`StreamDecoder::pop`] continues after it, so a
//! caller can answer the bad frame (say, with a typed reject) and keep the stream.

pub mod actor;
pub mod bifaci;
pub(crate) mod cbor;
pub mod envelope;
pub mod telemetry;
pub(crate) mod text;
pub mod varint;

use std::collections::VecDeque;

use bytes::{Buf, Bytes, BytesMut};

/// One wire format, as a step function over the front of a receive buffer.
pub trait Format {
    /// What one successful step yields.
    type Item;
    /// The format's typed error.
    type Error: FormatError;

    /// Takes one item from the front of `buf`.
    ///
    /// Contract (checked by [`StreamDecoder`] in debug builds):
    /// - `Ok(None)`: more bytes are needed; `buf` is untouched.
    /// - `Ok(Some(item))`: the item's bytes were split off the front of `buf`.
    /// - `Err(e)` with `e.is_fatal()`: `buf` is untouched and the stream is unusable.
    /// - `Err(e)` otherwise: the bad frame's bytes were split off the front of `buf`.
    ///
    /// A step must not depend on where the stream was cut: `buf` is any prefix of the
    /// stream's unread bytes.
    fn decode<I: Input>(&mut self, buf: &mut I) -> Result<Option<Self::Item>, Self::Error>;

    /// How many bytes the item at the front of `buf` spans, when `buf` holds enough of it to
    /// tell (a length prefix). Only a hint: [`StreamDecoder`] uses it to join exactly one
    /// item's bytes when an item straddles two received chunks, and `decode` still judges
    /// every length. `None` (the default): it cannot tell yet, and the decoder joins bytes in
    /// growing steps.
    fn item_len(&self, buf: &[u8]) -> Option<usize> {
        let _ = buf;
        None
    }

    /// Called once at end of stream with the number of bytes still buffered; reports a
    /// truncated tail (or a stream that ended before something the format requires).
    fn finish(&self, buffered: usize) -> Result<(), Self::Error>;
}

/// The buffered bytes a [`Format`] decodes from: a view of them and a way to split bytes off
/// their front as a shared handle, without copying. [`StreamDecoder`] hands a format either a
/// received chunk as it came ([`Bytes`]) or the bytes it joined for an item that straddled
/// chunks ([`BytesMut`]).
pub trait Input: std::ops::Deref<Target = [u8]> + sealed::Sealed {
    /// Splits the first `at` bytes off the front (panics past the end: formats check the
    /// length first).
    fn split_front(&mut self, at: usize) -> Bytes;
}

impl Input for Bytes {
    fn split_front(&mut self, at: usize) -> Bytes {
        self.split_to(at)
    }
}

impl Input for BytesMut {
    fn split_front(&mut self, at: usize) -> Bytes {
        self.split_to(at).freeze()
    }
}

mod sealed {
    /// Only the decoder's two buffer kinds are inputs.
    pub trait Sealed {}
    impl Sealed for bytes::Bytes {}
    impl Sealed for bytes::BytesMut {}
}

/// What every format error can say about itself.
pub trait FormatError: std::error::Error + Clone {
    /// True when the stream cannot be framed past this error.
    fn is_fatal(&self) -> bool;
    /// A stable snake_case name for logs, metrics and `tether inspect`.
    fn kind(&self) -> &'static str;
}

/// A format error and the stream offset of the first byte of the item it concerns.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{error} at stream offset {offset}")]
pub struct DecodeError<E> {
    /// Offset, from the first byte pushed, of the item that failed.
    pub offset: u64,
    /// What went wrong.
    pub error: E,
}

/// What [`StreamDecoder::pop`] answers: an item, `None` while more bytes are needed, or the
/// error and where it stands.
pub type PopResult<F> = Result<Option<<F as Format>::Item>, DecodeError<<F as Format>::Error>>;

/// What one [`Format::decode`] answers.
type Decoded<F> = Result<Option<<F as Format>::Item>, <F as Format>::Error>;

/// An incremental decoder: push bytes in any split, pop complete items.
///
/// Received buffers ([`StreamDecoder::push_bytes`]) are kept as they came and decoded in
/// place: every payload an item carries is a zero-copy [`bytes::Bytes`] slice of the buffer
/// it arrived in. Only an item that straddles two buffers is copied, into a joining buffer
/// that takes exactly its bytes when the format can tell its length
/// ([`Format::item_len`]); the decoder then goes back to decoding in place. An item's
/// declared length is checked against its bound before the decoder waits for its body, and
/// the joining buffer takes room only for bytes that arrived, so a declared length (a
/// megabyte for an actor payload, more for a switch frame) costs memory only as its bytes
/// arrive.
#[derive(Debug, Clone)]
pub struct StreamDecoder<F: Format> {
    format: F,
    /// The front of the unread bytes while an item straddling buffers is being joined (or
    /// bytes copied in by [`StreamDecoder::push`]); decoded before `chunks` when not empty.
    joined: BytesMut,
    /// Received buffers after `joined`, in order, none empty; the front one is decoded in
    /// place.
    chunks: VecDeque<Bytes>,
    /// Bytes in `joined` and `chunks`.
    buffered: usize,
    offset: u64,
    poisoned: Option<DecodeError<F::Error>>,
}

impl<F: Format> StreamDecoder<F> {
    /// A decoder for `format`, at stream offset 0.
    pub fn new(format: F) -> Self {
        Self {
            format,
            joined: BytesMut::new(),
            chunks: VecDeque::new(),
            buffered: 0,
            offset: 0,
            poisoned: None,
        }
    }

    /// Appends received bytes (copied). Bytes pushed after a fatal error are discarded.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.poisoned.is_some() || bytes.is_empty() {
            return;
        }
        if self.chunks.is_empty() {
            self.joined.extend_from_slice(bytes);
        } else {
            self.chunks.push_back(Bytes::copy_from_slice(bytes));
        }
        self.buffered += bytes.len();
    }

    /// Appends a received buffer without copying it: items that lie whole in it are slices
    /// of it. Bytes pushed after a fatal error are discarded.
    pub fn push_bytes(&mut self, bytes: Bytes) {
        if self.poisoned.is_some() || bytes.is_empty() {
            return;
        }
        self.buffered += bytes.len();
        self.chunks.push_back(bytes);
    }

    /// Pops the next complete item, `Ok(None)` when more bytes are needed.
    ///
    /// Inlined for its usual case, an item that lies whole in the front buffer: the item is
    /// then built where the caller keeps it (returned from a call, it was written and read
    /// back through memory, which a 64 B actor record felt).
    #[inline]
    pub fn pop(&mut self) -> PopResult<F> {
        if self.poisoned.is_none() && self.joined.is_empty() {
            if let Some((consumed, result)) = self.decode_front() {
                if let Ok(Some(item)) = result {
                    debug_assert!(consumed > 0, "an item has at least one byte");
                    self.buffered -= consumed;
                    self.offset += consumed as u64;
                    return Ok(Some(item));
                }
                if let Some(settled) = self.settle(consumed, result) {
                    return settled;
                }
            }
        }
        self.pop_slow()
    }

    /// [`StreamDecoder::pop`] past its usual case.
    #[inline(never)]
    fn pop_slow(&mut self) -> PopResult<F> {
        if let Some(error) = &self.poisoned {
            return Err(error.clone());
        }
        loop {
            let (consumed, result) = if !self.joined.is_empty() {
                let before = self.joined.len();
                let result = self.format.decode(&mut self.joined);
                (before - self.joined.len(), result)
            } else if let Some(decoded) = self.decode_front() {
                decoded
            } else {
                return Ok(None);
            };
            if let Some(settled) = self.settle(consumed, result) {
                return settled;
            }
        }
    }

    /// One decode in place from the front buffer (dropped once empty): bytes consumed and
    /// the format's answer; `None` with no buffer.
    #[inline(always)]
    fn decode_front(&mut self) -> Option<(usize, Decoded<F>)> {
        let front = self.chunks.front_mut()?;
        let before = front.len();
        let result = self.format.decode(front);
        let consumed = before - front.len();
        if front.is_empty() {
            self.chunks.pop_front();
        }
        Some((consumed, result))
    }

    /// Accounts for `consumed` bytes and `result` of one decode: the answer to return, or
    /// `None` when the item at the front was incomplete and bytes were joined to it (decode
    /// again).
    #[inline(never)]
    fn settle(&mut self, consumed: usize, result: Decoded<F>) -> Option<PopResult<F>> {
        self.buffered -= consumed;
        let item_offset = self.offset;
        self.offset += consumed as u64;
        match result {
            Ok(None) => {
                debug_assert!(consumed == 0, "Ok(None) must not consume");
                if self.join() {
                    None
                } else {
                    Some(Ok(None))
                }
            }
            Ok(Some(item)) => {
                debug_assert!(consumed > 0, "an item has at least one byte");
                Some(Ok(Some(item)))
            }
            Err(error) => {
                let fatal = error.is_fatal();
                debug_assert!(!fatal || consumed == 0, "a fatal error must not consume");
                debug_assert!(
                    fatal || consumed > 0,
                    "a frame-local error consumes its frame"
                );
                let located = DecodeError {
                    offset: item_offset,
                    error,
                };
                if fatal {
                    self.poisoned = Some(located.clone());
                    self.joined = BytesMut::new();
                    self.chunks = VecDeque::new();
                    self.buffered = 0;
                }
                Some(Err(located))
            }
        }
    }

    /// The item at the front is incomplete: moves bytes of the following buffers behind it
    /// into `joined`, up to the item's end when the format can tell its length, else as many
    /// again as `joined` holds (at least [`crate::limits::DECODE_JOIN_STEP_BYTES`]), keeping
    /// no byte past the item's end once a step completed its header. False when no buffer
    /// follows (the item waits for bytes to arrive).
    fn join(&mut self) -> bool {
        if self.joined.is_empty() {
            if self.chunks.len() < 2 {
                return false;
            }
            let front = self.chunks.pop_front().expect("two buffers");
            self.joined.reserve(front.len());
            self.joined.extend_from_slice(&front);
        } else if self.chunks.is_empty() {
            return false;
        }
        let have = self.joined.len();
        let known = self.format.item_len(&self.joined).filter(|len| *len > have);
        let wanted = known.map_or(have.max(crate::limits::DECODE_JOIN_STEP_BYTES), |len| {
            len - have
        });
        let available = self.buffered - have;
        let mut copy = wanted.min(available);
        // Room for bytes that arrived only: a declared length is a claim.
        self.joined.reserve(copy);
        for chunk in &self.chunks {
            if copy == 0 {
                break;
            }
            let take = copy.min(chunk.len());
            self.joined.extend_from_slice(&chunk[..take]);
            copy -= take;
        }
        // A step (no length known before it) may have copied the end of a header and bytes
        // past its item: keep the item's bytes only, so what follows it is decoded in place.
        let keep = match known.or_else(|| self.format.item_len(&self.joined)) {
            Some(len) if len > have => len.min(self.joined.len()),
            _ => self.joined.len(),
        };
        self.joined.truncate(keep);
        let mut consume = keep - have;
        while consume > 0 {
            let front = self.chunks.front_mut().expect("copied from these buffers");
            let take = consume.min(front.len());
            front.advance(take);
            if front.is_empty() {
                self.chunks.pop_front();
            }
            consume -= take;
        }
        true
    }

    /// Declares end of stream: an error if bytes of an incomplete item remain, or if the format
    /// required something the stream never carried.
    pub fn finish(&self) -> Result<(), DecodeError<F::Error>> {
        if let Some(error) = &self.poisoned {
            return Err(error.clone());
        }
        self.format
            .finish(self.buffered)
            .map_err(|error| DecodeError {
                offset: self.offset,
                error,
            })
    }

    /// Bytes consumed by popped items and frame-local errors so far.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Takes the bytes pushed but not yet consumed (to hand the rest of a stream to another
    /// decoder); the decoder is left empty, and done: its format may hold the state of an
    /// item it was waiting on.
    pub fn take_buffered(&mut self) -> Bytes {
        self.buffered = 0;
        let chunks = std::mem::take(&mut self.chunks);
        if self.joined.is_empty() && chunks.len() == 1 {
            return chunks.into_iter().next().expect("one buffer");
        }
        let mut all = std::mem::take(&mut self.joined);
        for chunk in chunks {
            all.extend_from_slice(&chunk);
        }
        all.freeze()
    }

    /// Bytes the decoder holds in memory now: the joining buffer's room and the received
    /// buffers' unread bytes.
    pub fn buffered_capacity(&self) -> usize {
        self.joined.capacity() + (self.buffered - self.joined.len())
    }

    /// Bytes pushed but not yet consumed.
    pub fn buffered_len(&self) -> usize {
        self.buffered
    }

    /// The format, for its settings and counters.
    pub fn format(&self) -> &F {
        &self.format
    }
}

/// Takes one `u32` big-endian length-prefixed frame off the front of `buf`, returning its body
/// (without the prefix). `Ok(None)`: incomplete, `buf` untouched. `Err(len)`: the declared
/// length exceeds `max`, `buf` untouched.
fn take_length_prefixed<I: Input>(buf: &mut I, max: usize) -> Result<Option<Bytes>, u64> {
    let Some(len) = u32_be_at(buf, 0) else {
        return Ok(None);
    };
    let len = len as usize;
    if len > max {
        return Err(len as u64);
    }
    if buf.len() < 4 + len {
        return Ok(None);
    }
    let mut frame = buf.split_front(4 + len);
    frame.advance(4);
    Ok(Some(frame))
}

/// The length of the `u32` big-endian length-prefixed frame at the front of `buf`, prefix
/// included, once its prefix is there.
fn length_prefixed_len(buf: &[u8]) -> Option<usize> {
    usize::try_from(u32_be_at(buf, 0)?).ok()?.checked_add(4)
}

/// Reads a big-endian `u32` at `at`, if four bytes are there.
fn u32_be_at(buf: &[u8], at: usize) -> Option<u32> {
    let bytes = buf.get(at..at.checked_add(4)?)?;
    Some(u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
}

#[cfg(test)]
pub(crate) mod testing {
    //! Helpers shared by the codec tests.

    use super::{DecodeError, Format, StreamDecoder};

    /// Everything a decoder made of a stream: items popped until the first error, then that
    /// error or the verdict of `finish`.
    pub(crate) type Outcome<F> = (
        Vec<<F as Format>::Item>,
        Result<(), DecodeError<<F as Format>::Error>>,
    );

    /// Pushes `bytes` cut at `cuts` (any values; taken modulo the length, sorted), popping
    /// after every push, and stops at the first error.
    pub(crate) fn decode_split<F: Format>(format: F, bytes: &[u8], cuts: &[usize]) -> Outcome<F> {
        let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        points.push(0);
        points.push(bytes.len());
        points.sort_unstable();
        let mut decoder = StreamDecoder::new(format);
        let mut items = Vec::new();
        for (index, window) in points.windows(2).enumerate() {
            let part = &bytes[window[0]..window[1]];
            // Every way bytes can arrive: copied, adopted (unique), copied from a shared handle.
            match index % 3 {
                0 => decoder.push(part),
                1 => decoder.push_bytes(bytes::Bytes::copy_from_slice(part)),
                _ => {
                    let shared = bytes::Bytes::copy_from_slice(part);
                    decoder.push_bytes(shared.clone());
                    drop(shared);
                }
            }
            loop {
                match decoder.pop() {
                    Ok(Some(item)) => items.push(item),
                    Ok(None) => break,
                    Err(error) => return (items, Err(error)),
                }
            }
        }
        let verdict = decoder.finish();
        (items, verdict)
    }

    /// Parses a golden vector file: hex digits, whitespace ignored, `#` starts a comment.
    pub(crate) fn golden(text: &str) -> Vec<u8> {
        let digits: String = text
            .lines()
            .map(|line| line.split('#').next().unwrap_or_default())
            .flat_map(|line| line.chars().filter(|c| !c.is_whitespace()))
            .collect();
        hex::decode(digits).expect("golden vector is valid hex")
    }

    /// The `# expect: <kind> @ <offset>` line of a malformed golden vector.
    pub(crate) fn expect_line(text: &str) -> Option<(String, u64)> {
        let line = text.lines().find_map(|l| l.strip_prefix("# expect: "))?;
        let (kind, offset) = line.split_once(" @ ")?;
        Some((kind.to_owned(), offset.trim().parse().ok()?))
    }

    /// Checks a malformed golden vector: pushed whole or cut in two anywhere, the decoder
    /// reports the error kind and offset its `# expect:` line states.
    pub(crate) fn check_malformed<F: Format + Clone>(format: F, text: &str) {
        use super::FormatError;
        let (kind, offset) = expect_line(text).expect("vector states its error");
        let bytes = golden(text);
        for cut in 0..=bytes.len() {
            let (_, verdict) = decode_split(format.clone(), &bytes, &[cut]);
            let error = verdict.expect_err(&kind);
            assert_eq!(
                (error.error.kind(), error.offset),
                (kind.as_str(), offset),
                "cut {cut}"
            );
        }
    }
}
