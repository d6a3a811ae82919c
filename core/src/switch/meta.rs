//! The meta fields the switch reads and writes (error codes and attribution, parent
//! requests, manifests), and the identity request.

use super::*;

/// The identity check's request id on generation `generation` of `slot` (distinct per
/// connection, so a late echo of an older attempt is not mistaken for this one, and distinct
/// between the connect-time check and the runtime `probe`).
pub(super) fn identity_rid(generation: u64, slot: SlotId, probe: bool) -> MessageId {
    let mut id = [0u8; 16];
    id[..4].copy_from_slice(if probe { b"prob" } else { b"idty" });
    id[4..8].copy_from_slice(&slot.0.to_be_bytes());
    id[8..].copy_from_slice(&generation.to_be_bytes());
    MessageId::Uuid(id)
}

/// The identity check's frames as capdag writes them (docs/spec/capdag-v6.md §11.3–§11.4):
/// REQ for the identity cap (empty payload, `application/cbor`), STREAM_START on `stream`,
/// one CHUNK carrying `payload`, STREAM_END, END; all at seq 0, and with `xid` (none for the
/// connect-time check, one from the counter for the runtime probe).
pub(super) fn identity_request(
    rid: MessageId,
    xid: Option<MessageId>,
    stream: &str,
    payload: Bytes,
) -> Vec<Frame> {
    let mut req = Frame::new(FrameType::Req, rid);
    req.cap = Some(cap::CAP_IDENTITY.to_owned());
    req.content_type = Some("application/cbor".to_owned());
    req.payload = Some(Bytes::new());
    let mut start = Frame::new(FrameType::StreamStart, rid);
    start.stream_id = Some(stream.to_owned());
    start.media_urn = Some("media:".to_owned());
    let mut chunk = Frame::new(FrameType::Chunk, rid);
    chunk.stream_id = Some(stream.to_owned());
    chunk.chunk_index = Some(0);
    chunk.payload = Some(payload);
    let mut end_stream = Frame::new(FrameType::StreamEnd, rid);
    end_stream.stream_id = Some(stream.to_owned());
    end_stream.chunk_count = Some(1);
    let mut end = Frame::new(FrameType::End, rid);
    end.eof = Some(true);
    let mut frames = [req, start, chunk, end_stream, end];
    for frame in &mut frames {
        frame.routing_id = xid;
    }
    frames.into()
}

/// The content of a CHUNK payload that is one CBOR byte string, if it is one.
pub(super) fn cbor_bytes_content(payload: &[u8]) -> Option<&[u8]> {
    let mut reader = Reader::new(payload);
    let content = reader.bytes().ok()?;
    reader.is_empty().then_some(content)
}

pub(super) fn parse_cap(frame: &Frame) -> Result<CapUrn, EngineError> {
    let text = frame.cap.as_deref().ok_or(EngineError::NoCap)?;
    CapUrn::parse(text).map_err(EngineError::BadCap)
}

/// An ERR's `meta`: `code`, `attribution_class` and `message`, as capdag's readers require
/// (docs/spec/capdag-v6.md §7).
pub fn error_meta(code: &str, class: ErrorClass, message: &str) -> Meta {
    let mut out = Vec::new();
    cbor::write_map(&mut out, 3);
    cbor::write_text(&mut out, "code");
    cbor::write_text(&mut out, code);
    cbor::write_text(&mut out, "attribution_class");
    cbor::write_text(&mut out, class.as_str());
    cbor::write_text(&mut out, "message");
    cbor::write_text(&mut out, message);
    Meta::from_cbor(Bytes::from(out)).expect("a map with text keys is a valid meta")
}

/// The wire word of a cancel's code.
fn cancel_code(reason: &CancelReason) -> &'static str {
    match reason.code {
        CancelCode::Cancelled => "CANCELLED",
        CancelCode::AbortedCollateral => "ABORTED_COLLATERAL",
        CancelCode::Aborted => "ABORTED",
    }
}

/// A CANCEL's `meta`: `code`, `attribution_class` (when attributed) and `message`.
pub(super) fn cancel_meta(reason: &CancelReason) -> Meta {
    let mut out = Vec::new();
    cbor::write_map(&mut out, 2 + usize::from(reason.class.is_some()));
    cbor::write_text(&mut out, "code");
    cbor::write_text(&mut out, cancel_code(reason));
    if let Some(class) = reason.class {
        cbor::write_text(&mut out, "attribution_class");
        cbor::write_text(&mut out, class.as_str());
    }
    cbor::write_text(&mut out, "message");
    cbor::write_text(&mut out, &reason.message);
    Meta::from_cbor(Bytes::from(out)).expect("a map with text keys is a valid meta")
}

/// The ERR a cancel ends the origin's flow with: the cancel's code and message, and its class
/// (`internal` when unattributed, as capdag's hosts answer an unattributed cancel).
pub(super) fn cancel_error_meta(reason: &CancelReason) -> Meta {
    error_meta(
        cancel_code(reason),
        reason.class.unwrap_or(ErrorClass::Internal),
        &reason.message,
    )
}

/// A RELAY_NOTIFY's `manifest` and `host_protocol_stats`-like `stats` (both byte strings, both
/// optional).
pub(super) fn notify_fields(
    meta: Option<&Meta>,
) -> Result<(Option<Bytes>, Option<Bytes>), &'static str> {
    let Some(meta) = meta else {
        return Ok((None, None));
    };
    let mut reader = Reader::new(meta.as_cbor());
    let pairs = reader.map().map_err(|_| "meta is not a map")?;
    let (mut manifest, mut stats) = (None, None);
    for _ in 0..pairs {
        let key = reader.text().map_err(|_| "meta key")?;
        match key {
            "manifest" => {
                manifest = Some(Bytes::copy_from_slice(
                    reader.bytes().map_err(|_| "manifest")?,
                ));
            }
            "stats" => {
                stats = Some(Bytes::copy_from_slice(reader.bytes().map_err(|_| "stats")?));
            }
            _ => {
                reader.skip().map_err(|_| "meta value")?;
            }
        }
    }
    Ok((manifest, stats))
}

/// The `parent_rid` a peer REQ names in its `meta` (the request it is made on behalf of), as
/// an unsigned integer or 16 bytes.
pub(super) fn parent_rid(meta: Option<&Meta>) -> Option<MessageId> {
    let mut reader = Reader::new(meta?.as_cbor());
    let pairs = reader.map().ok()?;
    for _ in 0..pairs {
        let key = reader.text().ok()?;
        if key != "parent_rid" {
            reader.skip().ok()?;
            continue;
        }
        return match reader.peek_major()? {
            cbor::MAJOR_UINT => reader.uint().ok().map(MessageId::Uint),
            cbor::MAJOR_BYTES => reader
                .bytes()
                .ok()
                .and_then(|bytes| <[u8; 16]>::try_from(bytes).ok())
                .map(MessageId::Uuid),
            _ => None,
        };
    }
    None
}

/// A peer REQ's `meta` naming its parent request.
pub fn parent_meta(parent: MessageId) -> Meta {
    let mut out = Vec::new();
    cbor::write_map(&mut out, 1);
    cbor::write_text(&mut out, "parent_rid");
    match parent {
        MessageId::Uint(value) => cbor::write_uint(&mut out, value),
        MessageId::Uuid(bytes) => cbor::write_bytes(&mut out, &bytes),
    }
    Meta::from_cbor(Bytes::from(out)).expect("a map with text keys is a valid meta")
}

/// A RELAY_NOTIFY's `meta` carrying a new manifest and/or host stats.
pub fn notify_meta(manifest: Option<&[u8]>, stats: Option<&[u8]>) -> Meta {
    let mut out = Vec::new();
    cbor::write_map(
        &mut out,
        usize::from(manifest.is_some()) + usize::from(stats.is_some()),
    );
    if let Some(manifest) = manifest {
        cbor::write_text(&mut out, "manifest");
        cbor::write_bytes(&mut out, manifest);
    }
    if let Some(stats) = stats {
        cbor::write_text(&mut out, "stats");
        cbor::write_bytes(&mut out, stats);
    }
    Meta::from_cbor(Bytes::from(out)).expect("a map with text keys is a valid meta")
}

/// An ERR's `code` from its `meta`, if it has one.
pub fn error_code(frame: &Frame) -> Option<String> {
    let mut reader = Reader::new(frame.meta.as_ref()?.as_cbor());
    let pairs = reader.map().ok()?;
    for _ in 0..pairs {
        let key = reader.text().ok()?;
        if key == "code" {
            return reader.text().ok().map(str::to_owned);
        }
        reader.skip().ok()?;
    }
    None
}

/// A successful END's `meta`: `exit_code` 0 (capdag reads an END without it as a failure).
pub fn end_ok_meta() -> Meta {
    let mut out = Vec::new();
    cbor::write_map(&mut out, 1);
    cbor::write_text(&mut out, "exit_code");
    cbor::write_uint(&mut out, 0);
    Meta::from_cbor(Bytes::from(out)).expect("a map with text keys is a valid meta")
}

/// A CHUNK payload as capdag's engines and hosts write one (docs/spec/capdag-v6.md §8), and as
/// the connect-time identity nonce travels: `bytes` as one CBOR byte string.
pub fn payload_item(bytes: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(bytes.len() + 9);
    cbor::write_bytes(&mut out, bytes);
    Bytes::from(out)
}

/// The bytes a CHUNK payload carries when it is one CBOR byte or text string, as capdag's
/// engines and hosts write them; `None` for anything else.
pub fn payload_content(payload: &[u8]) -> Option<&[u8]> {
    let mut reader = Reader::new(payload);
    let content = match reader.peek_major()? {
        cbor::MAJOR_BYTES => reader.bytes().ok()?,
        cbor::MAJOR_TEXT => reader.text().ok()?.as_bytes(),
        _ => return None,
    };
    reader.is_empty().then_some(content)
}
