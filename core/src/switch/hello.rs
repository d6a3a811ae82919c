//! The per-master handshake's data: limits carried in a HELLO's `meta`, the manifest a master
//! advertises, and the identity nonce (docs/spec/switch.md §3.3–§3.4).
//!
//! A HELLO's `meta` is a CBOR map with text keys: `version`, `max_frame`, `max_chunk`,
//! `max_reorder_buffer`, `initial_credit` (unsigned integers) and, from a master, `manifest`
//! (the manifest's JSON as a byte string). Unknown keys are skipped (the map is extensible);
//! a known key of the wrong type is an error.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::cap::{CapUrn, ParseError};
use crate::limits::{
    BIFACI_CHUNK_BYTES_DEFAULT, BIFACI_FRAME_BYTES_CEILING, BIFACI_FRAME_BYTES_DEFAULT,
    CREDIT_WINDOW_CHUNKS_DEFAULT, MANIFEST_CAPS_MAX, REORDER_HELD_COUNT_DEFAULT,
};
use crate::wire::bifaci::{Frame, FrameType, MessageId, Meta, PROTOCOL_VERSION};
use crate::wire::cbor::{self, Reader};

/// The limits one side proposes in its HELLO; both sides use the minimum of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Limits {
    /// Largest encoded frame, in bytes.
    pub max_frame: u64,
    /// Largest CHUNK payload, in bytes.
    pub max_chunk: u64,
    /// Early frames a reorder buffer holds per flow.
    pub max_reorder_buffer: u64,
    /// Initial per-stream credit window, in chunks.
    pub initial_credit: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_frame: BIFACI_FRAME_BYTES_DEFAULT as u64,
            max_chunk: BIFACI_CHUNK_BYTES_DEFAULT as u64,
            max_reorder_buffer: REORDER_HELD_COUNT_DEFAULT as u64,
            initial_credit: CREDIT_WINDOW_CHUNKS_DEFAULT,
        }
    }
}

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The HELLO's `meta` is missing, not a map, or a known key has the wrong type.
    #[error("malformed HELLO: {0}")]
    Malformed(&'static str),
    /// The peer speaks another protocol version.
    #[error("protocol version {theirs}, this side speaks {PROTOCOL_VERSION}")]
    Version {
        /// What the peer declared.
        theirs: u64,
    },
    /// A limit is missing or zero (a zero window would block every stream).
    #[error("limit {0} is missing or zero")]
    ZeroLimit(&'static str),
    /// A master's HELLO carries no manifest.
    #[error("HELLO without a manifest")]
    NoManifest,
    /// The manifest is not the JSON shape a manifest has, or has too many caps.
    #[error("bad manifest: {0}")]
    BadManifest(String),
    /// A cap in the manifest does not parse.
    #[error("manifest cap {index} does not parse: {error}")]
    BadCap {
        /// Its position in the manifest.
        index: usize,
        /// Why.
        error: ParseError,
    },
    /// The manifest lacks the identity cap every master must serve.
    #[error("manifest lacks the identity cap")]
    NoIdentity,
    /// The master did not answer the HELLO within the budget.
    #[error("no HELLO within the handshake budget")]
    Timeout,
    /// A master proposed a smaller credit window than the switch: its peers could not know to
    /// send it less (credit is end to end), so every side must use the switch's window.
    #[error("initial credit {theirs} is below the switch's {ours}")]
    WindowBelowSwitch {
        /// What the master proposed.
        theirs: u64,
        /// The switch's window.
        ours: u64,
    },
    /// The identity check failed (wrong echo, an error, or no answer in time).
    #[error("identity check failed: {0}")]
    Identity(&'static str),
}

impl Limits {
    /// The limits both sides use: the minimum of each; refused when either proposed a zero.
    pub fn negotiate(&self, theirs: &Limits) -> Result<Limits, HandshakeError> {
        let agreed = Limits {
            max_frame: self
                .max_frame
                .min(theirs.max_frame)
                .min(BIFACI_FRAME_BYTES_CEILING as u64),
            max_chunk: self.max_chunk.min(theirs.max_chunk),
            max_reorder_buffer: self.max_reorder_buffer.min(theirs.max_reorder_buffer),
            initial_credit: self.initial_credit.min(theirs.initial_credit),
        };
        for (name, value) in [
            ("max_frame", agreed.max_frame),
            ("max_chunk", agreed.max_chunk),
            ("max_reorder_buffer", agreed.max_reorder_buffer),
            ("initial_credit", agreed.initial_credit),
        ] {
            if value == 0 {
                return Err(HandshakeError::ZeroLimit(name));
            }
        }
        Ok(agreed)
    }
}

/// A HELLO's contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The proposed limits.
    pub limits: Limits,
    /// The manifest's JSON (a master's HELLO only).
    pub manifest: Option<Bytes>,
}

impl Hello {
    /// The HELLO frame carrying it (id 0).
    pub fn to_frame(&self) -> Frame {
        let mut frame = Frame::new(FrameType::Hello, MessageId::Uint(0));
        frame.meta = Some(self.to_meta());
        frame
    }

    /// Encodes as a HELLO `meta` map.
    pub fn to_meta(&self) -> Meta {
        let mut out = Vec::new();
        let pairs = 5 + usize::from(self.manifest.is_some());
        cbor::write_map(&mut out, pairs);
        for (key, value) in [
            ("version", PROTOCOL_VERSION),
            ("max_frame", self.limits.max_frame),
            ("max_chunk", self.limits.max_chunk),
            ("max_reorder_buffer", self.limits.max_reorder_buffer),
            ("initial_credit", self.limits.initial_credit),
        ] {
            cbor::write_text(&mut out, key);
            cbor::write_uint(&mut out, value);
        }
        if let Some(manifest) = &self.manifest {
            cbor::write_text(&mut out, "manifest");
            cbor::write_bytes(&mut out, manifest);
        }
        Meta::from_cbor(Bytes::from(out)).expect("a map with text keys is a valid meta")
    }

    /// Decodes a HELLO's `meta`. Missing limits read as 0 (refused by
    /// [`Limits::negotiate`]); the version must be [`PROTOCOL_VERSION`].
    pub fn from_meta(meta: Option<&Meta>) -> Result<Hello, HandshakeError> {
        let meta = meta.ok_or(HandshakeError::Malformed("no meta"))?;
        let mut reader = Reader::new(meta.as_cbor());
        let pairs = reader
            .map()
            .map_err(|_| HandshakeError::Malformed("meta is not a map"))?;
        let mut limits = Limits {
            max_frame: 0,
            max_chunk: 0,
            max_reorder_buffer: 0,
            initial_credit: 0,
        };
        let mut version = None;
        let mut manifest = None;
        for _ in 0..pairs {
            let key = reader
                .text()
                .map_err(|_| HandshakeError::Malformed("meta key"))?;
            let number = |reader: &mut Reader<'_>, name| {
                reader.uint().map_err(|_| HandshakeError::Malformed(name))
            };
            match key {
                "version" => version = Some(number(&mut reader, "version")?),
                "max_frame" => limits.max_frame = number(&mut reader, "max_frame")?,
                "max_chunk" => limits.max_chunk = number(&mut reader, "max_chunk")?,
                "max_reorder_buffer" => {
                    limits.max_reorder_buffer = number(&mut reader, "max_reorder_buffer")?;
                }
                "initial_credit" => {
                    limits.initial_credit = number(&mut reader, "initial_credit")?;
                }
                "manifest" => {
                    let bytes = reader
                        .bytes()
                        .map_err(|_| HandshakeError::Malformed("manifest"))?;
                    manifest = Some(Bytes::copy_from_slice(bytes));
                }
                _ => {
                    reader
                        .skip()
                        .map_err(|_| HandshakeError::Malformed("meta value"))?;
                }
            }
        }
        match version {
            Some(PROTOCOL_VERSION) => Ok(Hello { limits, manifest }),
            Some(theirs) => Err(HandshakeError::Version { theirs }),
            None => Err(HandshakeError::Malformed("no version")),
        }
    }
}

/// The caps a manifest advertises, in manifest order (which is registration order for ties).
pub fn manifest_caps(json: &[u8]) -> Result<Vec<CapUrn>, HandshakeError> {
    #[derive(Deserialize)]
    struct Manifest {
        #[serde(default)]
        cap_groups: Vec<Group>,
    }
    #[derive(Deserialize)]
    struct Group {
        #[serde(default)]
        caps: Vec<Entry>,
    }
    #[derive(Deserialize)]
    struct Entry {
        urn: String,
    }
    let manifest: Manifest = serde_json::from_slice(json)
        .map_err(|error| HandshakeError::BadManifest(error.to_string()))?;
    let count: usize = manifest.cap_groups.iter().map(|g| g.caps.len()).sum();
    if count > MANIFEST_CAPS_MAX {
        return Err(HandshakeError::BadManifest(format!(
            "{count} caps, at most {MANIFEST_CAPS_MAX}"
        )));
    }
    let mut caps = Vec::with_capacity(count);
    for (index, entry) in manifest
        .cap_groups
        .iter()
        .flat_map(|group| &group.caps)
        .enumerate()
    {
        let cap =
            CapUrn::parse(&entry.urn).map_err(|error| HandshakeError::BadCap { index, error })?;
        caps.push(cap);
    }
    let identity = crate::cap::identity();
    if !caps.iter().any(|cap| cap.is_equivalent(&identity)) {
        return Err(HandshakeError::NoIdentity);
    }
    Ok(caps)
}

/// A manifest's JSON advertising `caps` (one group), for hosts and tests.
pub fn manifest_json(name: &str, caps: &[String]) -> Vec<u8> {
    let caps: Vec<serde_json::Value> = caps
        .iter()
        .map(|urn| serde_json::json!({ "urn": urn }))
        .collect();
    let manifest = serde_json::json!({
        "name": name,
        "version": "1.0.0",
        "cap_groups": [{ "name": "default", "caps": caps }],
    });
    serde_json::to_vec(&manifest).expect("a JSON value serializes")
}

/// The identity check's nonce: CBOR text `bifaci` (7 bytes; docs/spec/switch.md §3.3, fixed so
/// that it tests the protocol stack, not security).
pub const IDENTITY_NONCE: &[u8] = b"\x66bifaci";

/// The identity check's stream id.
pub const IDENTITY_STREAM: &str = "identity-verify";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hello_round_trips_through_meta() {
        let hello = Hello {
            limits: Limits::default(),
            manifest: Some(Bytes::from_static(b"{}")),
        };
        assert_eq!(Hello::from_meta(Some(&hello.to_meta())), Ok(hello));
    }

    #[test]
    fn negotiation_takes_the_minimum_and_refuses_a_zero() {
        let ours = Limits::default();
        let theirs = Limits {
            initial_credit: 4,
            max_chunk: 1 << 30,
            ..Limits::default()
        };
        let agreed = ours.negotiate(&theirs).expect("non-zero");
        assert_eq!(agreed.initial_credit, 4);
        assert_eq!(agreed.max_chunk, ours.max_chunk);
        let zero = Limits {
            initial_credit: 0,
            ..Limits::default()
        };
        assert_eq!(
            ours.negotiate(&zero),
            Err(HandshakeError::ZeroLimit("initial_credit"))
        );
    }

    #[test]
    fn another_version_is_refused() {
        let mut out = Vec::new();
        cbor::write_map(&mut out, 1);
        cbor::write_text(&mut out, "version");
        cbor::write_uint(&mut out, 3);
        let meta = Meta::from_cbor(Bytes::from(out)).expect("meta");
        assert_eq!(
            Hello::from_meta(Some(&meta)),
            Err(HandshakeError::Version { theirs: 3 })
        );
    }

    #[test]
    fn a_manifest_without_the_identity_cap_is_refused() {
        let json = manifest_json("m", &["cap:in=media:;out=media:text".to_owned()]);
        assert_eq!(manifest_caps(&json), Err(HandshakeError::NoIdentity));
        let json = manifest_json("m", &[crate::cap::CAP_IDENTITY.to_owned()]);
        assert_eq!(manifest_caps(&json).expect("parses").len(), 1);
    }

    #[test]
    fn the_nonce_is_cbor_text_bifaci() {
        let mut out = Vec::new();
        cbor::write_text(&mut out, "bifaci");
        assert_eq!(out, IDENTITY_NONCE);
    }
}
