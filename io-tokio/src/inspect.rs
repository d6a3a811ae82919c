//! Decoding captured wire bytes into JSON lines: the engine of `tether inspect`.
//!
//! One JSON object per decoded frame or record, binary fields as lowercase hex. On malformed
//! input everything decoded before the fault is printed, then `{"error": kind, "offset": n}`.
//! The shapes are a stable contract (docs/architecture.md §2.1).

use std::io::{self, Write};

use serde_json::{json, Map, Value};
use tether_core::wire::actor::{ActorDecoder, ActorRecord};
use tether_core::wire::bifaci::{BifaciDecoder, Frame, MessageId};
use tether_core::wire::envelope::{Envelope, EnvelopeDecoder};
use tether_core::wire::telemetry::{ChannelDescriptor, TelemetryDecoder, TelemetryItem};
use tether_core::wire::{Format, FormatError, StreamDecoder};

/// Which wire format the bytes are in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireFormat {
    /// Actor records of the actor ALPN.
    Actor,
    /// A DSQ2 telemetry stream.
    Telemetry,
    /// Request-switch (bifaci) frames.
    Bifaci,
    /// Substrate envelope frames.
    Envelope,
}

impl WireFormat {
    /// Every format, by name.
    pub const ALL: [(&'static str, WireFormat); 4] = [
        ("actor", WireFormat::Actor),
        ("telemetry", WireFormat::Telemetry),
        ("bifaci", WireFormat::Bifaci),
        ("envelope", WireFormat::Envelope),
    ];
}

impl std::str::FromStr for WireFormat {
    type Err = UnknownFormat;

    fn from_str(name: &str) -> Result<Self, UnknownFormat> {
        Self::ALL
            .iter()
            .find(|(known, _)| *known == name)
            .map(|(_, format)| *format)
            .ok_or_else(|| UnknownFormat(name.to_owned()))
    }
}

/// A format name that is none of [`WireFormat::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown wire format {0:?} (one of actor, telemetry, bifaci, envelope)")]
pub struct UnknownFormat(pub String);

/// How an inspection ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Items printed.
    pub items: usize,
    /// The error kind and offset, when the input was malformed.
    pub error: Option<(&'static str, u64)>,
}

/// Decodes `input` as `format` and writes one JSON line per item (and the error line, if any)
/// to `out`.
pub fn inspect(format: WireFormat, input: &[u8], out: &mut impl Write) -> io::Result<Verdict> {
    match format {
        WireFormat::Actor => run(ActorDecoder::default(), input, out, actor_json),
        WireFormat::Telemetry => run(TelemetryDecoder::default(), input, out, telemetry_json),
        WireFormat::Bifaci => run(BifaciDecoder::default(), input, out, bifaci_json),
        WireFormat::Envelope => run(EnvelopeDecoder, input, out, envelope_json),
    }
}

fn run<F: Format>(
    format: F,
    input: &[u8],
    out: &mut impl Write,
    render: impl Fn(&F::Item) -> Value,
) -> io::Result<Verdict> {
    let mut decoder = StreamDecoder::new(format);
    decoder.push(input);
    let mut items = 0;
    let failure = loop {
        match decoder.pop() {
            Ok(Some(item)) => {
                writeln!(out, "{}", render(&item))?;
                items += 1;
            }
            Ok(None) => break decoder.finish().err(),
            Err(error) => break Some(error),
        }
    };
    let error = failure.map(|failure| (failure.error.kind(), failure.offset));
    if let Some((kind, offset)) = error {
        writeln!(out, "{}", json!({ "error": kind, "offset": offset }))?;
    }
    Ok(Verdict { items, error })
}

fn actor_json(record: &ActorRecord) -> Value {
    json!({
        "dest": hex::encode(record.dest()),
        "tag": record.tag(),
        "payload": hex::encode(record.payload()),
    })
}

fn labels_json(labels: &[(String, String)]) -> Value {
    labels.iter().map(|(k, v)| json!([k, v])).collect()
}

fn channel_json(channel: &ChannelDescriptor) -> Value {
    json!({
        "channel_id": channel.channel_id,
        "name": channel.name,
        "content_type": channel.content_type,
        "labels": labels_json(&channel.labels),
    })
}

fn telemetry_json(item: &TelemetryItem) -> Value {
    match item {
        TelemetryItem::Header(header) => json!({ "header": {
            "flow_id": hex::encode(header.flow_id),
            "token": hex::encode(&header.token),
            "stream": {
                "name": header.stream.name,
                "node_id": hex::encode(header.stream.node_id),
                "started_at_ms": header.stream.started_at_ms,
                "labels": labels_json(&header.stream.labels),
            },
            "channels": header.channels.iter().map(channel_json).collect::<Vec<_>>(),
        }}),
        TelemetryItem::ChannelDeclared(channel) => {
            json!({ "channel_declared": channel_json(channel) })
        }
        TelemetryItem::Batch(batch) => {
            let frames: Vec<Value> = batch
                .frames()
                .map(|frame| {
                    json!({
                        "channel_id": frame.channel_id,
                        "position": frame.position,
                        "payload": hex::encode(&frame.payload),
                    })
                })
                .collect();
            json!({ "batch": { "compression": batch.compression().as_str(), "frames": frames } })
        }
        TelemetryItem::StreamEnded => json!({ "stream_ended": {} }),
    }
}

fn id_json(id: &MessageId) -> Value {
    match id {
        MessageId::Uuid(bytes) => Value::String(hex::encode(bytes)),
        MessageId::Uint(value) => json!(value),
    }
}

fn bifaci_json(frame: &Frame) -> Value {
    let mut object = Map::new();
    object.insert("type".into(), json!(frame.frame_type.name()));
    object.insert(
        "version".into(),
        json!(tether_core::wire::bifaci::PROTOCOL_VERSION),
    );
    object.insert("id".into(), id_json(&frame.id));
    object.insert("seq".into(), json!(frame.seq));
    let mut put = |name: &str, value: Option<Value>| {
        if let Some(value) = value {
            object.insert(name.into(), value);
        }
    };
    put(
        "content_type",
        frame.content_type.as_ref().map(|v| json!(v)),
    );
    put(
        "meta",
        frame.meta.as_ref().map(|meta| cbor_to_json(meta.as_cbor())),
    );
    put(
        "payload",
        frame.payload.as_ref().map(|p| json!(hex::encode(p))),
    );
    put("len", frame.len.map(|v| json!(v)));
    put("offset", frame.offset.map(|v| json!(v)));
    put("eof", frame.eof.map(|v| json!(v)));
    put("cap", frame.cap.as_ref().map(|v| json!(v)));
    put("stream_id", frame.stream_id.as_ref().map(|v| json!(v)));
    put("media_urn", frame.media_urn.as_ref().map(|v| json!(v)));
    put("routing_id", frame.routing_id.as_ref().map(id_json));
    put("chunk_index", frame.chunk_index.map(|v| json!(v)));
    put("chunk_count", frame.chunk_count.map(|v| json!(v)));
    put("checksum", frame.checksum.map(|v| json!(v)));
    put("is_sequence", frame.is_sequence.map(|v| json!(v)));
    put("force_kill", frame.force_kill.map(|v| json!(v)));
    put("credit", frame.credit.map(|v| json!(v)));
    put("unbounded", frame.unbounded.map(|v| json!(v)));
    put("output", frame.output.as_ref().map(|v| json!(v)));
    Value::Object(object)
}

/// Renders validated CBOR as JSON: byte strings as hex, tags as their content, non-text map
/// keys as their JSON text.
fn cbor_to_json(cbor: &[u8]) -> Value {
    match ciborium::from_reader::<ciborium::Value, _>(cbor) {
        Ok(value) => cbor_value_json(&value),
        // Core validated this CBOR; a disagreement between the two readers is worth showing.
        Err(error) => json!({ "undecodable_cbor": error.to_string() }),
    }
}

fn cbor_value_json(value: &ciborium::Value) -> Value {
    use ciborium::Value as C;
    match value {
        C::Integer(int) => {
            let int = i128::from(*int);
            u64::try_from(int)
                .map(Value::from)
                .or_else(|_| i64::try_from(int).map(Value::from))
                .unwrap_or_else(|_| Value::String(int.to_string()))
        }
        C::Bytes(bytes) => Value::String(hex::encode(bytes)),
        C::Float(float) => json!(float),
        C::Text(text) => Value::String(text.clone()),
        C::Bool(flag) => Value::Bool(*flag),
        C::Null => Value::Null,
        C::Tag(_, inner) => cbor_value_json(inner),
        C::Array(items) => items.iter().map(cbor_value_json).collect(),
        C::Map(pairs) => {
            let key = |k: &C| match k {
                C::Text(text) => text.clone(),
                other => cbor_value_json(other).to_string(),
            };
            Value::Object(
                pairs
                    .iter()
                    .map(|(k, v)| (key(k), cbor_value_json(v)))
                    .collect(),
            )
        }
        _ => Value::Null,
    }
}

fn envelope_json(envelope: &Envelope) -> Value {
    let env = &envelope.env;
    let mut object = Map::new();
    object.insert(
        "v".into(),
        json!(tether_core::wire::envelope::ENVELOPE_VERSION),
    );
    object.insert("kind".into(), json!(env.kind.as_str()));
    let mut put = |name: &str, value: Option<Value>| {
        if let Some(value) = value {
            object.insert(name.into(), value);
        }
    };
    put("obj", env.obj.as_ref().map(|a| json!(a.as_str())));
    put("objKind", env.obj_kind.map(|k| json!(k.as_str())));
    put("id", env.id.as_ref().map(|v| json!(v)));
    put("seq", env.seq.map(|v| json!(v)));
    put("receipt", env.receipt.map(|v| json!(v)));
    put("code", env.code.as_ref().map(|v| json!(v)));
    put("message", env.message.as_ref().map(|v| json!(v)));
    put("reason", env.reason.as_ref().map(|v| json!(v)));
    put("fromSeq", env.from_seq.map(|v| json!(v)));
    put("cap", env.cap.as_ref().map(|v| json!(v)));
    put("floor", env.floor.map(|v| json!(v)));
    put("limit", env.limit.map(|v| json!(v)));
    let mut line = Map::new();
    line.insert("type_byte".into(), json!(envelope.type_byte));
    line.insert("env".into(), Value::Object(object));
    if let Some(body) = &envelope.body {
        line.insert("body".into(), json!(hex::encode(body)));
    }
    Value::Object(line)
}
