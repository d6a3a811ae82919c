//! A strict, bounded, allocation-free CBOR (RFC 8949) reader and a minimal writer, shared by
//! the bifaci and envelope codecs.
//!
//! Why not decode through `ciborium::Value`: a generic value tree allocates in proportion to the
//! structure a peer chooses (a 3 MiB frame of one-byte items would cost ~150 MiB), accepts
//! duplicate keys and cannot hand out zero-copy payload slices. The frames tether reads have a
//! fixed shape, so the reader walks them in place and only `meta` maps are skipped generically,
//! under a depth bound.
//!
//! Strictness: definite lengths only, minimal-length heads only (the preferred serialization of
//! RFC 8949 §4.2.1), no reserved additional-information values, UTF-8 checked text.

use crate::limits::CBOR_NESTING_DEPTH_MAX;
use bytes::BufMut;

/// Why bytes are not the CBOR a tether frame allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CborError {
    /// The item runs past the end of the frame.
    #[error("CBOR item runs past the end of the frame")]
    Truncated,
    /// An integer or length is not in its shortest form.
    #[error("CBOR head is not minimally encoded")]
    NonMinimal,
    /// Indefinite-length items are not accepted.
    #[error("indefinite-length CBOR is not accepted")]
    Indefinite,
    /// Additional information 28–30 is reserved by RFC 8949.
    #[error("reserved CBOR additional information")]
    Reserved,
    /// A text string that is not UTF-8.
    #[error("CBOR text is not UTF-8")]
    NotUtf8,
    /// Nesting deeper than `CBOR_NESTING_DEPTH_MAX`.
    #[error("CBOR nesting deeper than {CBOR_NESTING_DEPTH_MAX}")]
    TooDeep,
    /// The item has a different major type than the field requires.
    #[error("CBOR item has the wrong type")]
    WrongType,
}

/// CBOR major types.
pub(crate) const MAJOR_UINT: u8 = 0;
pub(crate) const MAJOR_NINT: u8 = 1;
pub(crate) const MAJOR_BYTES: u8 = 2;
pub(crate) const MAJOR_TEXT: u8 = 3;
pub(crate) const MAJOR_ARRAY: u8 = 4;
pub(crate) const MAJOR_MAP: u8 = 5;
pub(crate) const MAJOR_TAG: u8 = 6;
pub(crate) const MAJOR_SIMPLE: u8 = 7;

const SIMPLE_FALSE: u64 = 20;
const SIMPLE_TRUE: u64 = 21;

/// One decoded item head: major type and its argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Head {
    pub(crate) major: u8,
    /// Additional information (low five bits), kept for major 7 (simple values and floats).
    pub(crate) info: u8,
    pub(crate) arg: u64,
}

/// A cursor over one complete frame.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pos == self.buf.len()
    }

    #[cfg(test)]
    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    fn take(&mut self, len: usize) -> Result<&'a [u8], CborError> {
        let end = self.pos.checked_add(len).ok_or(CborError::Truncated)?;
        let bytes = self.buf.get(self.pos..end).ok_or(CborError::Truncated)?;
        self.pos = end;
        Ok(bytes)
    }

    fn take_be(&mut self, len: usize) -> Result<u64, CborError> {
        let bytes = self.take(len)?;
        Ok(bytes.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    pub(crate) fn head(&mut self) -> Result<Head, CborError> {
        let initial = self.take(1)?[0];
        let major = initial >> 5;
        let info = initial & 0x1f;
        let (arg, floor) = match info {
            0..=23 => (u64::from(info), 0),
            24 => (self.take_be(1)?, 24),
            25 => (self.take_be(2)?, 0x100),
            26 => (self.take_be(4)?, 0x1_0000),
            27 => (self.take_be(8)?, 0x1_0000_0000),
            28..=30 => return Err(CborError::Reserved),
            _ => return Err(CborError::Indefinite),
        };
        // Floats (major 7, info 25–27) carry bits, not a length: no minimality rule.
        // Simple values in the one-byte form must be 32 or above (RFC 8949 §3.3).
        let is_float = major == MAJOR_SIMPLE && info >= 25;
        let floor = if major == MAJOR_SIMPLE && info == 24 {
            32
        } else {
            floor
        };
        if !is_float && arg < floor {
            return Err(CborError::NonMinimal);
        }
        Ok(Head { major, info, arg })
    }

    fn expect(&mut self, major: u8) -> Result<u64, CborError> {
        let head = self.head()?;
        if head.major != major {
            return Err(CborError::WrongType);
        }
        Ok(head.arg)
    }

    fn length(&mut self, major: u8) -> Result<usize, CborError> {
        let len = self.expect(major)?;
        // A length can never exceed what is left of the frame; checking here keeps every
        // later `usize` conversion and allocation honest.
        let remaining = self.buf.len() - self.pos;
        usize::try_from(len)
            .ok()
            .filter(|&len| len <= remaining)
            .ok_or(CborError::Truncated)
    }

    pub(crate) fn uint(&mut self) -> Result<u64, CborError> {
        self.expect(MAJOR_UINT)
    }

    pub(crate) fn bytes(&mut self) -> Result<&'a [u8], CborError> {
        let len = self.length(MAJOR_BYTES)?;
        self.take(len)
    }

    pub(crate) fn text(&mut self) -> Result<&'a str, CborError> {
        std::str::from_utf8(self.text_bytes()?).map_err(|_| CborError::NotUtf8)
    }

    /// A text item's bytes, not yet checked as UTF-8: for a caller that matches them against
    /// known ASCII (a key, a verb), where only a miss needs the check.
    pub(crate) fn text_bytes(&mut self) -> Result<&'a [u8], CborError> {
        let len = self.length(MAJOR_TEXT)?;
        self.take(len)
    }

    pub(crate) fn bool(&mut self) -> Result<bool, CborError> {
        let head = self.head()?;
        match (head.major, head.arg) {
            (MAJOR_SIMPLE, SIMPLE_FALSE) if head.info < 24 => Ok(false),
            (MAJOR_SIMPLE, SIMPLE_TRUE) if head.info < 24 => Ok(true),
            _ => Err(CborError::WrongType),
        }
    }

    /// Reads a map head and returns its number of pairs. Each pair needs at least two bytes,
    /// so the count is checked against what is left of the frame.
    pub(crate) fn map(&mut self) -> Result<usize, CborError> {
        let pairs = self.expect(MAJOR_MAP)?;
        let remaining = (self.buf.len() - self.pos) as u64;
        if pairs > remaining / 2 {
            return Err(CborError::Truncated);
        }
        usize::try_from(pairs).map_err(|_| CborError::Truncated)
    }

    /// Peeks at the next item's major type without consuming it.
    pub(crate) fn peek_major(&self) -> Option<u8> {
        self.buf.get(self.pos).map(|b| b >> 5)
    }

    /// Skips one well-formed item of any type, nesting at most `CBOR_NESTING_DEPTH_MAX` deep,
    /// and returns the bytes it spanned.
    pub(crate) fn skip(&mut self) -> Result<&'a [u8], CborError> {
        let start = self.pos;
        self.skip_at(0)?;
        Ok(&self.buf[start..self.pos])
    }

    fn skip_at(&mut self, depth: usize) -> Result<(), CborError> {
        if depth > CBOR_NESTING_DEPTH_MAX {
            return Err(CborError::TooDeep);
        }
        let head = self.head()?;
        match head.major {
            MAJOR_UINT | MAJOR_NINT | MAJOR_SIMPLE => Ok(()),
            MAJOR_BYTES => {
                let len = usize::try_from(head.arg).map_err(|_| CborError::Truncated)?;
                self.take(len).map(drop)
            }
            MAJOR_TEXT => {
                let len = usize::try_from(head.arg).map_err(|_| CborError::Truncated)?;
                std::str::from_utf8(self.take(len)?)
                    .map(drop)
                    .map_err(|_| CborError::NotUtf8)
            }
            MAJOR_ARRAY | MAJOR_MAP => {
                let per_entry = if head.major == MAJOR_MAP { 2 } else { 1 };
                // Each item is at least one byte: bound the loop by what is left.
                let items = head
                    .arg
                    .checked_mul(per_entry)
                    .ok_or(CborError::Truncated)?;
                if items > (self.buf.len() - self.pos) as u64 {
                    return Err(CborError::Truncated);
                }
                for _ in 0..items {
                    self.skip_at(depth + 1)?;
                }
                Ok(())
            }
            _ => {
                debug_assert_eq!(head.major, MAJOR_TAG);
                self.skip_at(depth + 1)
            }
        }
    }
}

/// Appends a head with the shortest argument encoding.
pub(crate) fn write_head(out: &mut (impl BufMut + ?Sized), major: u8, arg: u64) {
    debug_assert!(major <= MAJOR_SIMPLE);
    let initial = major << 5;
    match arg {
        0..=23 => out.put_u8(initial | arg as u8),
        24..=0xff => out.put_slice(&[initial | 24, arg as u8]),
        0x100..=0xffff => {
            out.put_u8(initial | 25);
            out.put_u16(arg as u16);
        }
        0x1_0000..=0xffff_ffff => {
            out.put_u8(initial | 26);
            out.put_u32(arg as u32);
        }
        _ => {
            out.put_u8(initial | 27);
            out.put_u64(arg);
        }
    }
}

pub(crate) fn write_uint(out: &mut (impl BufMut + ?Sized), value: u64) {
    write_head(out, MAJOR_UINT, value);
}

pub(crate) fn write_bytes(out: &mut (impl BufMut + ?Sized), value: &[u8]) {
    write_head(out, MAJOR_BYTES, value.len() as u64);
    out.put_slice(value);
}

pub(crate) fn write_text(out: &mut (impl BufMut + ?Sized), value: &str) {
    write_text_bytes(out, value.as_bytes());
}

/// Text given as its UTF-8 bytes (the caller holds text it knows is UTF-8 as bytes, to skip a
/// check it cannot skip otherwise).
pub(crate) fn write_text_bytes(out: &mut (impl BufMut + ?Sized), utf8: &[u8]) {
    write_head(out, MAJOR_TEXT, utf8.len() as u64);
    out.put_slice(utf8);
}

pub(crate) fn write_bool(out: &mut (impl BufMut + ?Sized), value: bool) {
    write_head(
        out,
        MAJOR_SIMPLE,
        if value { SIMPLE_TRUE } else { SIMPLE_FALSE },
    );
}

pub(crate) fn write_map(out: &mut (impl BufMut + ?Sized), pairs: usize) {
    write_head(out, MAJOR_MAP, pairs as u64);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn heads_are_minimal_both_ways() {
        for arg in [
            0u64,
            23,
            24,
            255,
            256,
            65535,
            65536,
            u32::MAX as u64,
            u64::MAX,
        ] {
            let mut out = Vec::new();
            write_uint(&mut out, arg);
            assert_eq!(Reader::new(&out).uint(), Ok(arg));
        }
        assert_eq!(
            Reader::new(&[0x18, 0x17]).uint(),
            Err(CborError::NonMinimal)
        );
        assert_eq!(
            Reader::new(&[0x19, 0x00, 0xff]).uint(),
            Err(CborError::NonMinimal)
        );
        assert_eq!(Reader::new(&[0x1f]).uint(), Err(CborError::Indefinite));
        assert_eq!(Reader::new(&[0x1c]).uint(), Err(CborError::Reserved));
        assert_eq!(Reader::new(&[0x5f]).bytes(), Err(CborError::Indefinite));
    }

    #[test]
    fn skip_is_bounded_in_depth() {
        let deep = vec![0x81u8; CBOR_NESTING_DEPTH_MAX + 2];
        assert_eq!(Reader::new(&deep).skip(), Err(CborError::TooDeep));
        let mut ok = vec![0x81u8; CBOR_NESTING_DEPTH_MAX];
        ok.push(0x00);
        assert!(Reader::new(&ok).skip().is_ok());
    }

    #[test]
    fn agrees_with_ciborium_on_what_it_writes() {
        let mut out = Vec::new();
        write_map(&mut out, 3);
        write_uint(&mut out, 1);
        write_text(&mut out, "héllo");
        write_uint(&mut out, 2);
        write_bytes(&mut out, &[0, 1, 2]);
        write_uint(&mut out, 3);
        write_bool(&mut out, true);
        let value: ciborium::Value = ciborium::from_reader(&out[..]).expect("valid CBOR");
        let expected = ciborium::Value::Map(vec![
            (1.into(), "héllo".into()),
            (2.into(), ciborium::Value::Bytes(vec![0, 1, 2])),
            (3.into(), true.into()),
        ]);
        assert_eq!(value, expected);
    }

    proptest! {
        #[test]
        fn skip_never_panics_and_stays_in_bounds(bytes in any::<Vec<u8>>()) {
            let mut reader = Reader::new(&bytes);
            if let Ok(span) = reader.skip() {
                prop_assert!(span.len() <= bytes.len());
                prop_assert_eq!(reader.position(), span.len());
            }
        }
    }
}
