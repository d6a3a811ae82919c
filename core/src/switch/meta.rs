//! The meta fields the switch reads and writes (error codes and attribution, parent
//! requests, manifests), and the identity request.

use super::*;

/// The identity request's id on generation `generation` of `slot` (distinct per connection,
/// so a late echo of an older attempt is not mistaken for this one).
pub(super) fn identity_rid(generation: u64, slot: SlotId) -> MessageId {
    let mut id = [0u8; 16];
    id[..4].copy_from_slice(b"idty");
    id[4..8].copy_from_slice(&slot.0.to_be_bytes());
    id[8..].copy_from_slice(&generation.to_be_bytes());
    MessageId::Uuid(id)
}

/// The identity check's frames: REQ, STREAM_START, CHUNK(nonce), STREAM_END, END.
pub(super) fn identity_request(generation: u64, slot: SlotId) -> Vec<Frame> {
    let rid = identity_rid(generation, slot);
    let mut req = Frame::new(FrameType::Req, rid);
    req.cap = Some(cap::CAP_IDENTITY.to_owned());
    let mut start = Frame::new(FrameType::StreamStart, rid);
    start.stream_id = Some(IDENTITY_STREAM.to_owned());
    start.media_urn = Some("media:".to_owned());
    let mut chunk = Frame::new(FrameType::Chunk, rid);
    chunk.stream_id = Some(IDENTITY_STREAM.to_owned());
    chunk.chunk_index = Some(0);
    chunk.payload = Some(Bytes::from_static(IDENTITY_NONCE));
    let mut end_stream = Frame::new(FrameType::StreamEnd, rid);
    end_stream.stream_id = Some(IDENTITY_STREAM.to_owned());
    end_stream.chunk_count = Some(1);
    let end = Frame::new(FrameType::End, rid);
    let mut frames = [req, start, chunk, end_stream, end];
    for (seq, frame) in frames.iter_mut().enumerate() {
        frame.seq = seq as u64;
        // Like every REQ the switch writes, it carries an XID (0: the switch's own request).
        frame.routing_id = Some(MessageId::Uint(0));
    }
    frames.into()
}

pub(super) fn parse_cap(frame: &Frame) -> Result<CapUrn, String> {
    let text = frame.cap.as_deref().ok_or("REQ without a cap")?;
    CapUrn::parse(text).map_err(|error: ParseError| error.to_string())
}

/// An ERR's `meta`: `code` and `message`.
pub fn error_meta(code: &str, message: &str) -> Meta {
    let mut out = Vec::new();
    cbor::write_map(&mut out, 2);
    cbor::write_text(&mut out, "code");
    cbor::write_text(&mut out, code);
    cbor::write_text(&mut out, "message");
    cbor::write_text(&mut out, message);
    Meta::from_cbor(Bytes::from(out)).expect("a map with text keys is a valid meta")
}

/// A cancel's attribution as `meta`: `code`, `class` (when attributed) and `message`.
pub(super) fn attribution(reason: &CancelReason) -> Meta {
    let code = match reason.code {
        CancelCode::Cancelled => "CANCELLED",
        CancelCode::AbortedCollateral => "ABORTED_COLLATERAL",
        CancelCode::Aborted => "ABORTED",
    };
    let class = reason.class.map(|class| match class {
        crate::request::ErrorClass::User => "user",
        crate::request::ErrorClass::Input => "input",
        crate::request::ErrorClass::Resource => "resource",
        crate::request::ErrorClass::Environment => "environment",
        crate::request::ErrorClass::Internal => "internal",
    });
    let mut out = Vec::new();
    cbor::write_map(&mut out, 2 + usize::from(class.is_some()));
    cbor::write_text(&mut out, "code");
    cbor::write_text(&mut out, code);
    if let Some(class) = class {
        cbor::write_text(&mut out, "class");
        cbor::write_text(&mut out, class);
    }
    cbor::write_text(&mut out, "message");
    cbor::write_text(&mut out, &reason.message);
    Meta::from_cbor(Bytes::from(out)).expect("a map with text keys is a valid meta")
}

/// A RELAY_NOTIFY's `manifest` and `stats` (both byte strings, both optional).
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
