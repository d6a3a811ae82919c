//! The preamble that opens every link of the stream transports (TCP, the simulator):
//!
//! ```text
//! preamble = "TTH1" | id_len u8 (≤ 128) | dialer id (UTF-8, id_len bytes) | nonce (16 bytes)
//! ```
//!
//! It names who the dialer *claims* to be; nothing it says is trusted until the link's
//! handshake proof verifies (the shell runs that before the link touches any state). The
//! decoder is total, bounded (at most [`PREAMBLE_BYTES_MAX`] bytes are ever needed) and strict.

use super::handshake::Channel;

/// Magic bytes opening every link of the stream transports.
pub const PREAMBLE_MAGIC: [u8; 4] = *b"TTH1";
/// Longest peer id in a preamble.
pub const PREAMBLE_ID_BYTES_MAX: usize = 128;
/// Random bytes that make each connection id distinct.
pub const CONN_NONCE_BYTES: usize = 16;
/// Bytes before the id: the magic and the id's length.
pub const PREAMBLE_HEAD_BYTES: usize = 5;
/// The longest preamble.
pub const PREAMBLE_BYTES_MAX: usize =
    PREAMBLE_HEAD_BYTES + PREAMBLE_ID_BYTES_MAX + CONN_NONCE_BYTES;

/// A decoded preamble.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preamble {
    /// The id the dialer claims.
    pub dialer: String,
    /// The dialer's fresh bytes for the connection id.
    pub nonce: [u8; CONN_NONCE_BYTES],
}

/// Why bytes are not a preamble.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PreambleError {
    /// The bytes do not start with [`PREAMBLE_MAGIC`].
    #[error("not a tether link")]
    BadMagic,
    /// The id is longer than [`PREAMBLE_ID_BYTES_MAX`].
    #[error("peer id of {0} bytes is too long")]
    IdTooLong(usize),
    /// The id is not UTF-8.
    #[error("peer id is not UTF-8")]
    IdNotUtf8,
}

/// The whole preamble's length, from its first [`PREAMBLE_HEAD_BYTES`].
pub fn preamble_len(head: &[u8; PREAMBLE_HEAD_BYTES]) -> Result<usize, PreambleError> {
    if head[..4] != PREAMBLE_MAGIC {
        return Err(PreambleError::BadMagic);
    }
    let id_len = usize::from(head[4]);
    if id_len > PREAMBLE_ID_BYTES_MAX {
        return Err(PreambleError::IdTooLong(id_len));
    }
    Ok(PREAMBLE_HEAD_BYTES + id_len + CONN_NONCE_BYTES)
}

/// The preamble at the front of `bytes` and its length; `Ok(None)` when more bytes are needed.
pub fn decode_preamble(bytes: &[u8]) -> Result<Option<(Preamble, usize)>, PreambleError> {
    let Some(head) = bytes.first_chunk::<PREAMBLE_HEAD_BYTES>() else {
        // A wrong magic is refused as soon as its bytes are there.
        let magic = &bytes[..bytes.len().min(4)];
        return if magic == &PREAMBLE_MAGIC[..magic.len()] {
            Ok(None)
        } else {
            Err(PreambleError::BadMagic)
        };
    };
    let len = preamble_len(head)?;
    let Some(whole) = bytes.get(..len) else {
        return Ok(None);
    };
    let (id, nonce) =
        whole[PREAMBLE_HEAD_BYTES..].split_at(len - PREAMBLE_HEAD_BYTES - CONN_NONCE_BYTES);
    let dialer = std::str::from_utf8(id).map_err(|_| PreambleError::IdNotUtf8)?;
    Ok(Some((
        Preamble {
            dialer: dialer.to_owned(),
            nonce: nonce.try_into().expect("16 bytes"),
        },
        len,
    )))
}

/// Appends the preamble of `dialer` with `nonce`.
pub fn encode_preamble(
    dialer: &str,
    nonce: &[u8; CONN_NONCE_BYTES],
    out: &mut Vec<u8>,
) -> Result<(), PreambleError> {
    let id = dialer.as_bytes();
    if id.len() > PREAMBLE_ID_BYTES_MAX {
        return Err(PreambleError::IdTooLong(id.len()));
    }
    out.extend_from_slice(&PREAMBLE_MAGIC);
    out.push(id.len() as u8);
    out.extend_from_slice(id);
    out.extend_from_slice(nonce);
    Ok(())
}

/// The link's channel: the connection id binds both peer ids (the dialer's first) and the
/// nonce, so a shared-key proof also proves the claimed identities. Stream transports have no
/// channel-binding bytes.
pub fn channel(dialer: &str, listener: &str, nonce: &[u8]) -> Channel {
    let mut conn_id = Vec::new();
    for part in [dialer.as_bytes(), listener.as_bytes(), nonce] {
        conn_id.extend_from_slice(&(part.len() as u32).to_be_bytes());
        conn_id.extend_from_slice(part);
    }
    Channel {
        conn_id,
        binding: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golden_preamble_and_strict_refusals() {
        let mut out = Vec::new();
        encode_preamble("ab", &[7; 16], &mut out).unwrap();
        assert_eq!(
            hex::encode(&out),
            concat!("54544831", "02", "6162", "07070707070707070707070707070707")
        );
        for cut in 0..out.len() {
            assert_eq!(decode_preamble(&out[..cut]), Ok(None), "cut at {cut}");
        }
        let (preamble, used) = decode_preamble(&out).unwrap().unwrap();
        assert_eq!(
            (preamble.dialer.as_str(), preamble.nonce, used),
            ("ab", [7; 16], out.len())
        );
        assert_eq!(decode_preamble(b"TTX"), Err(PreambleError::BadMagic));
        assert_eq!(
            decode_preamble(&[b'T', b'T', b'H', b'1', 200]),
            Err(PreambleError::IdTooLong(200))
        );
        let mut bad = out.clone();
        bad[5] = 0xff;
        assert_eq!(decode_preamble(&bad), Err(PreambleError::IdNotUtf8));
        assert_eq!(
            encode_preamble(&"x".repeat(129), &[0; 16], &mut Vec::new()),
            Err(PreambleError::IdTooLong(129))
        );
    }

    proptest! {
        #[test]
        fn preambles_round_trip_and_any_bytes_decode_totally(
            id in "[a-z0-9-]{0,128}",
            nonce in any::<[u8; 16]>(),
            junk in prop::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut out = Vec::new();
            encode_preamble(&id, &nonce, &mut out).unwrap();
            out.extend_from_slice(&junk);
            let (preamble, used) = decode_preamble(&out).unwrap().unwrap();
            prop_assert_eq!(preamble, Preamble { dialer: id, nonce });
            prop_assert!(used <= PREAMBLE_BYTES_MAX);
            if let Ok(Some((_, used))) = decode_preamble(&junk) {
                prop_assert!(used <= junk.len());
            }
        }
    }
}
