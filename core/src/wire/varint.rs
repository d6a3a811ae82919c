//! Unsigned varints as in the multiformats unsigned-varint rules: LEB128, little-endian groups
//! of 7 bits, at most 9 bytes (so at most 63 bits), minimal encoding only.
//!
//! Used by the telemetry stream for lengths, channel ids and positions.

use crate::limits::{VARINT_BYTES_MAX, VARINT_VALUE_MAX};

/// Why bytes are not a valid unsigned varint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VarintError {
    /// A longer encoding than the value needs (a trailing `0x00` group).
    #[error("varint is not minimally encoded")]
    Overlong,
    /// More than nine bytes, or a ninth byte that still asks for more.
    #[error("varint is longer than {VARINT_BYTES_MAX} bytes")]
    TooLong,
}

/// Decodes a varint from the front of `buf`.
///
/// Returns `Ok(None)` when `buf` ends before the varint does (and could still be completed),
/// `Ok(Some((value, len)))` otherwise. Never reads past the ninth byte.
pub fn decode(buf: &[u8]) -> Result<Option<(u64, usize)>, VarintError> {
    let mut value: u64 = 0;
    for (index, &byte) in buf.iter().take(VARINT_BYTES_MAX).enumerate() {
        value |= u64::from(byte & 0x7f) << (7 * index);
        if byte & 0x80 == 0 {
            if byte == 0 && index > 0 {
                return Err(VarintError::Overlong);
            }
            return Ok(Some((value, index + 1)));
        }
    }
    if buf.len() >= VARINT_BYTES_MAX {
        return Err(VarintError::TooLong);
    }
    Ok(None)
}

/// Number of bytes `value` takes on the wire.
///
/// # Panics
/// If `value` exceeds [`VARINT_VALUE_MAX`] (a caller bug: check with [`fits`] first).
pub fn encoded_len(value: u64) -> usize {
    assert!(fits(value), "varint value {value} exceeds 63 bits");
    let bits = 64 - (value | 1).leading_zeros() as usize;
    bits.div_ceil(7)
}

/// True when `value` can be carried by a varint (at most 63 bits).
pub fn fits(value: u64) -> bool {
    value <= VARINT_VALUE_MAX
}

/// Appends the minimal encoding of `value` to `out`.
///
/// # Panics
/// If `value` exceeds [`VARINT_VALUE_MAX`] (a caller bug: check with [`fits`] first).
pub fn encode(value: u64, out: &mut impl bytes::BufMut) {
    assert!(fits(value), "varint value {value} exceeds 63 bits");
    let mut rest = value;
    while rest >= 0x80 {
        out.put_u8((rest as u8) | 0x80);
        rest >>= 7;
    }
    out.put_u8(rest as u8);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encode_vec(value: u64) -> Vec<u8> {
        let mut out = Vec::new();
        encode(value, &mut out);
        out
    }

    #[test]
    fn golden_vectors_from_the_multiformats_spec() {
        let cases: [(u64, &[u8]); 7] = [
            (1, &[0x01]),
            (127, &[0x7f]),
            (128, &[0x80, 0x01]),
            (255, &[0xff, 0x01]),
            (300, &[0xac, 0x02]),
            (16384, &[0x80, 0x80, 0x01]),
            (
                VARINT_VALUE_MAX,
                &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f],
            ),
        ];
        for (value, bytes) in cases {
            assert_eq!(encode_vec(value), bytes, "encode {value}");
            assert_eq!(
                decode(bytes),
                Ok(Some((value, bytes.len()))),
                "decode {value}"
            );
        }
        assert_eq!(encode_vec(0), [0x00]);
    }

    #[test]
    fn rejects_overlong_and_too_long() {
        assert_eq!(decode(&[0x81, 0x00]), Err(VarintError::Overlong));
        assert_eq!(decode(&[0x80, 0x80, 0x00]), Err(VarintError::Overlong));
        assert_eq!(decode(&[0xff; 9]), Err(VarintError::TooLong));
        assert_eq!(decode(&[0xff; 12]), Err(VarintError::TooLong));
        assert_eq!(decode(&[0x80; 8]), Ok(None));
        assert_eq!(decode(&[]), Ok(None));
    }

    proptest! {
        #[test]
        fn round_trips_with_exact_length(value in 0..=VARINT_VALUE_MAX, tail in any::<Vec<u8>>()) {
            let mut bytes = encode_vec(value);
            prop_assert_eq!(bytes.len(), encoded_len(value));
            let len = bytes.len();
            bytes.extend_from_slice(&tail);
            prop_assert_eq!(decode(&bytes), Ok(Some((value, len))));
            // Every strict prefix asks for more bytes.
            for cut in 0..len {
                prop_assert_eq!(decode(&bytes[..cut]), Ok(None));
            }
        }

        #[test]
        fn arbitrary_bytes_decode_to_their_unique_encoding(bytes in any::<Vec<u8>>()) {
            if let Ok(Some((value, len))) = decode(&bytes) {
                prop_assert_eq!(&encode_vec(value)[..], &bytes[..len]);
            }
        }
    }
}
