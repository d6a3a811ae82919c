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
mod text;
pub mod varint;

use bytes::BytesMut;

/// One wire format, as a step function over a receive buffer.
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
    fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Self::Item>, Self::Error>;

    /// Called once at end of stream with the number of bytes still buffered; reports a
    /// truncated tail (or a stream that ended before something the format requires).
    fn finish(&self, buffered: usize) -> Result<(), Self::Error>;
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

/// An incremental decoder: push bytes in any split, pop complete items.
///
/// Bytes are copied once into an internal buffer; every payload an item carries is a
/// zero-copy [`bytes::Bytes`] slice of that buffer. The buffer never holds more than one
/// incomplete item beyond what the caller pushed, and an item's declared length is checked
/// against its bound before the decoder waits for its body; room is reserved for at most
/// [`crate::limits::DECODE_RESERVE_AHEAD_BYTES_MAX`] of the body ahead of its bytes, so a
/// declared length costs memory only as its bytes arrive.
#[derive(Debug, Clone)]
pub struct StreamDecoder<F: Format> {
    format: F,
    buf: BytesMut,
    offset: u64,
    poisoned: Option<DecodeError<F::Error>>,
}

impl<F: Format> StreamDecoder<F> {
    /// A decoder for `format`, at stream offset 0.
    pub fn new(format: F) -> Self {
        Self {
            format,
            buf: BytesMut::new(),
            offset: 0,
            poisoned: None,
        }
    }

    /// Appends received bytes. Bytes pushed after a fatal error are discarded.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.poisoned.is_none() {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// Appends a received buffer without copying it when possible: if nothing is buffered and
    /// `bytes` is the only handle to its memory (as a buffer fresh from a socket read is), the
    /// decoder adopts it and items become slices of it. Otherwise it is copied like
    /// [`StreamDecoder::push`]. Bytes pushed after a fatal error are discarded.
    pub fn push_bytes(&mut self, bytes: bytes::Bytes) {
        if self.poisoned.is_some() {
            return;
        }
        if self.buf.is_empty() {
            match bytes.try_into_mut() {
                Ok(unique) => self.buf = unique,
                Err(shared) => self.buf.extend_from_slice(&shared),
            }
        } else {
            self.buf.extend_from_slice(&bytes);
        }
    }

    /// Pops the next complete item, `Ok(None)` when more bytes are needed.
    pub fn pop(&mut self) -> Result<Option<F::Item>, DecodeError<F::Error>> {
        if let Some(error) = &self.poisoned {
            return Err(error.clone());
        }
        let before = self.buf.len();
        let result = self.format.decode(&mut self.buf);
        let consumed = before - self.buf.len();
        let item_offset = self.offset;
        self.offset += consumed as u64;
        match result {
            Ok(item) => {
                debug_assert!(item.is_some() || consumed == 0, "Ok(None) must not consume");
                debug_assert!(
                    item.is_none() || consumed > 0,
                    "an item has at least one byte"
                );
                Ok(item)
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
                    self.buf = BytesMut::new();
                }
                Err(located)
            }
        }
    }

    /// Declares end of stream: an error if bytes of an incomplete item remain, or if the format
    /// required something the stream never carried.
    pub fn finish(&self) -> Result<(), DecodeError<F::Error>> {
        if let Some(error) = &self.poisoned {
            return Err(error.clone());
        }
        self.format
            .finish(self.buf.len())
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
    /// decoder); the decoder is left empty.
    pub fn take_buffered(&mut self) -> bytes::Bytes {
        std::mem::take(&mut self.buf).freeze()
    }

    /// Bytes the decoder's buffer holds room for (what it costs in memory now).
    pub fn buffered_capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// Bytes pushed but not yet consumed.
    pub fn buffered_len(&self) -> usize {
        self.buf.len()
    }

    /// The format, for its settings and counters.
    pub fn format(&self) -> &F {
        &self.format
    }
}

/// Takes one `u32` big-endian length-prefixed frame off the front of `buf`, returning its body
/// (without the prefix). `Ok(None)`: incomplete, `buf` untouched (room for the body is
/// reserved). `Err(len)`: the declared length exceeds `max`, `buf` untouched.
fn take_length_prefixed(buf: &mut BytesMut, max: usize) -> Result<Option<bytes::Bytes>, u64> {
    let Some(len) = u32_be_at(buf, 0) else {
        return Ok(None);
    };
    let len = len as usize;
    if len > max {
        return Err(len as u64);
    }
    if buf.len() < 4 + len {
        reserve_ahead(buf, 4 + len);
        return Ok(None);
    }
    Ok(Some(buf.split_to(4 + len).freeze().split_off(4)))
}

/// Reserves room toward a frame of `total` bytes of which `buf` holds the start: at most
/// [`crate::limits::DECODE_RESERVE_AHEAD_BYTES_MAX`] beyond what arrived.
pub(crate) fn reserve_ahead(buf: &mut BytesMut, total: usize) {
    let missing = total.saturating_sub(buf.len());
    buf.reserve(missing.min(crate::limits::DECODE_RESERVE_AHEAD_BYTES_MAX));
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
