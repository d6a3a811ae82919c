//! The per-master handshake's data, as capdag 1.524.58 speaks it (docs/spec/capdag-v6.md §11):
//! the RELAY_NOTIFY a master opens with (its limits and manifest), the manifest's shape, and
//! the identity check's streams and nonces.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::cap::{CapUrn, ParseError};
use crate::limits::{
    BIFACI_CHUNK_BYTES_DEFAULT, BIFACI_FRAME_BYTES_CEILING, BIFACI_FRAME_BYTES_DEFAULT,
    CREDIT_WINDOW_CHUNKS_DEFAULT, MANIFEST_CAPS_MAX, REORDER_HELD_COUNT_DEFAULT,
};
use crate::wire::bifaci::{Frame, FrameType, MessageId, Meta};
use crate::wire::cbor::{self, Reader};

/// The limits one side proposes; both sides use the minimum of each.
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

/// Why a manifest was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ManifestError {
    /// It is not JSON (or not UTF-8, or cut short).
    #[error("not JSON (line {line}, column {column})")]
    NotJson {
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
    },
    /// It is JSON, but not a manifest: `installed_cartridges` missing, or a field of the
    /// wrong type.
    #[error("not a manifest's shape (line {line}, column {column})")]
    Shape {
        /// 1-based line of the error.
        line: usize,
        /// 1-based column of the error.
        column: usize,
    },
    /// It lists more caps than the switch takes.
    #[error("{count} caps, at most {max}")]
    TooManyCaps {
        /// How many it lists.
        count: usize,
        /// The bound (`MANIFEST_CAPS_MAX`).
        max: usize,
    },
}

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The first frame is not the one the handshake starts with, or its `meta` is not a
    /// map, or a known key has the wrong type.
    #[error("malformed handshake: {0}")]
    Malformed(&'static str),
    /// A limit is missing or zero (a zero window would block every stream).
    #[error("limit {0} is missing or zero")]
    ZeroLimit(&'static str),
    /// A RELAY_NOTIFY without `meta.manifest`.
    #[error("RELAY_NOTIFY without a manifest")]
    NoManifest,
    /// The manifest is not the JSON shape a manifest has, or has too many caps.
    #[error("bad manifest: {0}")]
    BadManifest(#[source] ManifestError),
    /// A cap in the manifest does not parse.
    #[error("manifest cap {index} does not parse: {error}")]
    BadCap {
        /// Its position in the manifest.
        index: usize,
        /// Why.
        error: ParseError,
    },
    /// The master said nothing (no RELAY_NOTIFY) within the handshake budget.
    #[error("no RELAY_NOTIFY within the handshake budget")]
    Timeout,
    /// The switch gave no POLICY within the handshake budget.
    #[error("no POLICY within the handshake budget")]
    NoPolicy,
    /// A master proposed another credit window than the switch's. Credit is end to end, and
    /// nothing on this link tells a master the switch's window (capdag's RELAY_NOTIFY goes one
    /// way), so every side of every request must use the same one.
    #[error("initial credit {theirs} is not the switch's {ours}")]
    WindowMismatch {
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

/// A RELAY_NOTIFY's contents: what a master tells the switch first, and again whenever its
/// caps change (docs/spec/capdag-v6.md §11.1–§11.2). Its `meta` holds `manifest` (the JSON,
/// as a byte string), `max_frame` and `max_chunk` (required), `max_reorder_buffer` and
/// `initial_credit` (optional: 64 and 32 when absent or zero, as capdag reads them). Unknown
/// keys are skipped; a known key of the wrong type is an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayNotify {
    /// The limits the master proposes.
    pub limits: Limits,
    /// The manifest's JSON (`{"installed_cartridges": [...]}`).
    pub manifest: Bytes,
}

impl RelayNotify {
    /// The RELAY_NOTIFY frame carrying it (id 0).
    pub fn to_frame(&self) -> Frame {
        let mut frame = Frame::new(FrameType::RelayNotify, MessageId::Uint(0));
        frame.meta = Some(self.to_meta());
        frame
    }

    /// Encodes as a RELAY_NOTIFY `meta` map, in the order capdag writes it.
    pub fn to_meta(&self) -> Meta {
        let mut out = Vec::new();
        cbor::write_map(&mut out, 5);
        cbor::write_text(&mut out, "manifest");
        cbor::write_bytes(&mut out, &self.manifest);
        for (key, value) in [
            ("max_frame", self.limits.max_frame),
            ("max_chunk", self.limits.max_chunk),
            ("max_reorder_buffer", self.limits.max_reorder_buffer),
            ("initial_credit", self.limits.initial_credit),
        ] {
            cbor::write_text(&mut out, key);
            cbor::write_uint(&mut out, value);
        }
        Meta::from_cbor(Bytes::from(out)).expect("a map with text keys is a valid meta")
    }

    /// Decodes a RELAY_NOTIFY's `meta`.
    pub fn from_meta(meta: Option<&Meta>) -> Result<RelayNotify, HandshakeError> {
        let meta = meta.ok_or(HandshakeError::NoManifest)?;
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
        let mut manifest = None;
        for _ in 0..pairs {
            let key = reader
                .text()
                .map_err(|_| HandshakeError::Malformed("meta key"))?;
            let number = |reader: &mut Reader<'_>, name| {
                reader.uint().map_err(|_| HandshakeError::Malformed(name))
            };
            match key {
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
        let manifest = manifest.ok_or(HandshakeError::NoManifest)?;
        for (name, value) in [
            ("max_frame", limits.max_frame),
            ("max_chunk", limits.max_chunk),
        ] {
            if value == 0 {
                return Err(HandshakeError::ZeroLimit(name));
            }
        }
        if limits.max_reorder_buffer == 0 {
            limits.max_reorder_buffer = REORDER_HELD_COUNT_DEFAULT as u64;
        }
        if limits.initial_credit == 0 {
            limits.initial_credit = CREDIT_WINDOW_CHUNKS_DEFAULT;
        }
        Ok(RelayNotify { limits, manifest })
    }
}

/// The caps a manifest advertises, in manifest order (which is registration order for ties):
/// the union over `installed_cartridges[].cap_groups[].caps[].urn`. A manifest with no caps
/// is valid (the master joins healthy and capless, and is checked when caps appear).
pub fn manifest_caps(json: &[u8]) -> Result<Vec<CapUrn>, HandshakeError> {
    #[derive(Deserialize)]
    struct Manifest {
        installed_cartridges: Vec<Cartridge>,
    }
    #[derive(Deserialize)]
    struct Cartridge {
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
    let manifest: Manifest = serde_json::from_slice(json).map_err(|error| {
        let (line, column) = (error.line(), error.column());
        HandshakeError::BadManifest(match error.classify() {
            serde_json::error::Category::Data => ManifestError::Shape { line, column },
            _ => ManifestError::NotJson { line, column },
        })
    })?;
    let entries = || {
        manifest
            .installed_cartridges
            .iter()
            .flat_map(|cartridge| &cartridge.cap_groups)
            .flat_map(|group| &group.caps)
    };
    let count = entries().count();
    if count > MANIFEST_CAPS_MAX {
        return Err(HandshakeError::BadManifest(ManifestError::TooManyCaps {
            count,
            max: MANIFEST_CAPS_MAX,
        }));
    }
    let mut caps = Vec::with_capacity(count);
    for (index, entry) in entries().enumerate() {
        let cap =
            CapUrn::parse(&entry.urn).map_err(|error| HandshakeError::BadCap { index, error })?;
        caps.push(cap);
    }
    Ok(caps)
}

/// A manifest's JSON for a host `name` serving `caps`, in the shape capdag's switch requires
/// (docs/spec/capdag-v6.md §11.2): one installed cartridge holding one cap group, with the
/// runtime stats and pools (one per cap, and `all`) that make each cap dispatchable.
pub fn manifest_json(name: &str, caps: &[String]) -> Vec<u8> {
    let idle = || serde_json::json!({ "declared": 0, "configured": 0, "active": 0, "queued": 0 });
    let mut pools = serde_json::Map::new();
    for cap in caps {
        let key = CapUrn::parse(cap).map_or_else(|_| cap.clone(), |urn| urn.to_string());
        pools.insert(key, idle());
    }
    let mut all = idle();
    all["caps"] = serde_json::json!(pools.keys().cloned().collect::<Vec<_>>());
    pools.insert("all".to_owned(), all);
    let entries: Vec<serde_json::Value> = caps
        .iter()
        .map(|urn| serde_json::json!({ "urn": urn }))
        .collect();
    let manifest = serde_json::json!({
        "installed_cartridges": [{
            "registry_url": null,
            "id": name,
            "channel": "release",
            "version": env!("CARGO_PKG_VERSION"),
            "sha256": "0".repeat(64),
            "cap_groups": [{ "name": name, "caps": entries, "adapter_urns": [] }],
            "attachment_error": null,
            "runtime_stats": {
                "running": true,
                "pools": pools,
                "pid": 0,
                "active_request_count": 0,
                "peer_request_count": 0,
                "memory_footprint_mb": 0,
                "memory_rss_mb": 0,
                "restart_count": 0,
            },
            "lifecycle": "operational",
        }],
    });
    serde_json::to_vec(&manifest).expect("a JSON value serializes")
}

/// The connect-time identity check's stream id (docs/spec/capdag-v6.md §11.3).
pub const IDENTITY_STREAM: &str = "identity-verify";

/// The runtime identity probe's stream id, for a master whose caps appear after it joined
/// (docs/spec/capdag-v6.md §11.4).
pub const IDENTITY_PROBE_STREAM: &str = "identity-verify-runtime";

/// The runtime probe's nonce: CBOR text `bifaci` (7 bytes), sent and compared as they are.
pub const IDENTITY_PROBE_NONCE: &[u8] = b"\x66bifaci";

/// The stream a host answers the identity check on.
pub const IDENTITY_ECHO_STREAM: &str = "identity";

/// Bytes of the connect-time nonce (random, from the shell).
pub const IDENTITY_NONCE_BYTES: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notify_round_trips_through_meta() {
        let notify = RelayNotify {
            limits: Limits::default(),
            manifest: Bytes::from(manifest_json("m", &[crate::cap::CAP_IDENTITY.to_owned()])),
        };
        assert_eq!(RelayNotify::from_meta(Some(&notify.to_meta())), Ok(notify));
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
    fn a_notify_needs_a_manifest_and_the_two_frame_limits_and_defaults_the_others() {
        let meta = |pairs: &[(&str, u64)], manifest: bool| {
            let mut out = Vec::new();
            cbor::write_map(&mut out, pairs.len() + usize::from(manifest));
            if manifest {
                cbor::write_text(&mut out, "manifest");
                cbor::write_bytes(&mut out, br#"{"installed_cartridges": []}"#);
            }
            for (key, value) in pairs {
                cbor::write_text(&mut out, key);
                cbor::write_uint(&mut out, *value);
            }
            Meta::from_cbor(Bytes::from(out)).expect("meta")
        };
        let limits = [("max_frame", 1000), ("max_chunk", 100)];
        assert_eq!(
            RelayNotify::from_meta(Some(&meta(&limits, false))),
            Err(HandshakeError::NoManifest)
        );
        assert_eq!(
            RelayNotify::from_meta(Some(&meta(&limits[..1], true))),
            Err(HandshakeError::ZeroLimit("max_chunk"))
        );
        let notify = RelayNotify::from_meta(Some(&meta(&limits, true))).expect("valid");
        assert_eq!(notify.limits.max_reorder_buffer, 64);
        assert_eq!(notify.limits.initial_credit, 32);
        assert_eq!(manifest_caps(&notify.manifest), Ok(Vec::new()));
    }

    #[test]
    fn a_manifest_is_read_from_its_installed_cartridges() {
        let json = manifest_json(
            "m",
            &[
                "cap:in=media:;out=media:text".to_owned(),
                crate::cap::CAP_IDENTITY.to_owned(),
            ],
        );
        assert_eq!(manifest_caps(&json).expect("parses").len(), 2);
        // tether's old shape (cap groups at the top) is not a manifest.
        let old = br#"{"name": "m", "cap_groups": [{"caps": [{"urn": "cap:effect=none"}]}]}"#;
        assert!(matches!(
            manifest_caps(old),
            Err(HandshakeError::BadManifest(ManifestError::Shape { .. }))
        ));
    }

    #[test]
    fn the_probe_nonce_is_cbor_text_bifaci() {
        let mut out = Vec::new();
        cbor::write_text(&mut out, "bifaci");
        assert_eq!(out, IDENTITY_PROBE_NONCE);
    }
}
