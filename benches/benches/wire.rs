//! Wire codec throughput, each beside a `memcpy` of the same bytes measured in the same run.
//!
//! Targets (issue "Workspace foundation"): actor-record decode of 1 KiB records at ≥ 50% of
//! memcpy throughput; telemetry batch encode within 1.2× the time of plain zstd level-1
//! compression of the same entry bytes. The telemetry groups also time "gather + zstd-1": one
//! copy of the entries into a contiguous buffer, then the compression; an encoder that takes
//! events as separate buffers cannot do less, so it is the floor the encoder is held against.

use std::hint::black_box;

use bytes::{Bytes, BytesMut};
use criterion::{criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use tether_core::wire::actor::{ActorDecoder, ActorRecord};
use tether_core::wire::bifaci::{BifaciDecoder, Frame, FrameType, MessageId};
use tether_core::wire::envelope::{Address, Env, Envelope, EnvelopeDecoder, ObjKind, Verb};
use tether_core::wire::telemetry::{
    BatchWriter, Header, StreamDescriptor, TelemetryDecoder, TelemetryFrame, TelemetryItem,
};
use tether_core::wire::{Format, StreamDecoder};

/// Payload sizes the issue names.
const SIZES: [usize; 2] = [1024, 64 * 1024];

/// Bytes per measured stream: enough records that per-iteration setup is noise.
const STREAM_BYTES: usize = 1024 * 1024;

fn payload(len: usize) -> Bytes {
    // Text-like bytes: compressible the way telemetry and messages usually are.
    let text = b"{\"cpu\":0.42,\"mem\":1834,\"host\":\"node-a\",\"ts\":1700000000000}\n";
    text.iter()
        .cycle()
        .take(len)
        .copied()
        .collect::<Vec<u8>>()
        .into()
}

/// Pushes `bytes` into a long-lived decoder (as a connection's reader would) and pops every
/// item; the decoder's buffer is reused across iterations.
fn decode_all<F: Format>(decoder: &mut StreamDecoder<F>, bytes: &[u8]) -> usize {
    decoder.push(bytes);
    let mut count = 0;
    while let Some(item) = decoder.pop().expect("benchmark input is valid") {
        black_box(item);
        count += 1;
    }
    count
}

fn memcpy_baseline(c: &mut Criterion, group_name: &str, bytes: &[u8]) -> Vec<u8> {
    let mut dst = vec![0u8; bytes.len()];
    let mut group = c.benchmark_group(group_name);
    group.throughput(Throughput::Bytes(bytes.len() as u64));
    group.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(bytes)))
    });
    group.finish();
    dst
}

/// Benchmarks one length-delimited format: a stream of copies of one item, decoded by a
/// long-lived decoder and encoded item by item, beside a memcpy of the same bytes.
fn bench_codec<F: Format>(
    c: &mut Criterion,
    name: &str,
    format: F,
    encode_one: impl Fn(&mut Vec<u8>),
) {
    let mut stream = Vec::new();
    let mut items = 0;
    while stream.len() < STREAM_BYTES {
        encode_one(&mut stream);
        items += 1;
    }
    memcpy_baseline(c, name, &stream);
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Bytes(stream.len() as u64));
    let mut decoder = StreamDecoder::new(format);
    group.bench_function("decode", |b| b.iter(|| decode_all(&mut decoder, &stream)));
    // Zero-copy: the decoder keeps each received buffer (fresh per iteration, made outside the
    // timing) and items are slices of it, as when a reader hands over what a socket read filled.
    group.bench_function("decode_zero_copy", |b| {
        b.iter_batched(
            || Bytes::from(stream.clone()),
            |received| {
                decoder.push_bytes(received);
                let mut count = 0;
                while let Some(item) = decoder.pop().expect("benchmark input is valid") {
                    black_box(item);
                    count += 1;
                }
                count
            },
            BatchSize::LargeInput,
        )
    });
    let mut out = Vec::with_capacity(stream.len());
    group.bench_function("encode", |b| {
        b.iter(|| {
            out.clear();
            for _ in 0..items {
                encode_one(&mut out);
            }
        })
    });
    group.finish();
}

fn actor(c: &mut Criterion) {
    for size in SIZES {
        let record = ActorRecord::new([7; 32], "app.message", payload(size)).unwrap();
        let format = ActorDecoder::with_payload_bytes_max(size);
        bench_codec(c, &format!("actor/{size}"), format, |out| {
            record.encode(usize::MAX, out).unwrap()
        });
    }
}

/// Metric lines whose numbers vary from event to event, as real telemetry does (a simple
/// deterministic generator; the repeated line of [`payload`] is the best case for zstd).
fn varied_payload(len: usize, seed: u64) -> Bytes {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut text = String::with_capacity(len + 96);
    while text.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let (cpu, mem, ts) = (
            state % 1000,
            (state >> 10) % 65_536,
            1_700_000_000_000 + (state >> 20) % 1_000_000,
        );
        text.push_str(&format!(
            "{{\"cpu\":0.{cpu:03},\"mem\":{mem},\"host\":\"node-a\",\"ts\":{ts}}}\n"
        ));
    }
    text.truncate(len);
    Bytes::from(text)
}

/// Makes the payload of event `i` with `len` bytes.
type MakePayload = fn(usize, u64) -> Bytes;

fn telemetry(c: &mut Criterion) {
    let kinds: [(&str, MakePayload); 2] =
        [("", |len, _| payload(len)), ("varied/", varied_payload)];
    for (kind, make) in kinds {
        for size in SIZES {
            telemetry_one(c, &format!("telemetry/{kind}{size}"), size, make);
        }
    }
}

fn telemetry_one(c: &mut Criterion, name: &str, size: usize, make: MakePayload) {
    {
        let count = STREAM_BYTES / size;
        let events: Vec<TelemetryFrame> = (0..count as u64)
            .map(|i| TelemetryFrame {
                channel_id: i % 4,
                position: i,
                payload: make(size, i),
            })
            .collect();
        let mut writer = BatchWriter::new();
        let mut encoded = BytesMut::new();
        let mut source = events.iter().cloned();
        writer.drain(|| source.next(), &mut encoded).unwrap();
        // The same entry bytes the writer compresses, batch by batch, for the zstd baseline.
        let raw_batches = raw_batches(&encoded);
        let raw_len: usize = raw_batches.iter().map(Bytes::len).sum();
        let name = name.to_owned();
        let raw: Vec<u8> = raw_batches
            .iter()
            .flat_map(|batch| batch.iter().copied())
            .collect();
        memcpy_baseline(c, &name, &raw);
        let mut group = c.benchmark_group(&name);
        group.throughput(Throughput::Bytes(raw_len as u64));
        let mut stream = BytesMut::new();
        header().encode(&mut stream).unwrap();
        stream.extend_from_slice(&encoded);
        group.bench_function("decode", |b| {
            b.iter(|| {
                decode_all(
                    &mut StreamDecoder::new(TelemetryDecoder::default()),
                    &stream,
                )
            })
        });
        let mut out = BytesMut::with_capacity(encoded.len() * 2);
        // The encoder's work only: events are pushed by reference, as a publisher that keeps
        // its events would; cloning them here would time the harness's refcount traffic.
        group.bench_function("encode", |b| {
            b.iter(|| {
                out.clear();
                for event in &events {
                    writer.push(event, &mut out).unwrap();
                }
                writer.flush(&mut out);
            })
        });
        let mut zstd = zstd::bulk::Compressor::new(1).unwrap();
        let mut buffer = Vec::with_capacity(raw_len * 2);
        group.bench_function(BenchmarkId::new("zstd-1 baseline", size), |b| {
            b.iter(|| {
                for batch in &raw_batches {
                    buffer.clear();
                    zstd.compress_to_buffer(batch, &mut buffer).unwrap();
                    black_box(&buffer);
                }
            })
        });
        // The floor for any encoder of this format: gather the entries into one buffer (the
        // events are separate allocations; a batch is one contiguous run), then compress it.
        let mut gathered = Vec::with_capacity(raw_len);
        group.bench_function(BenchmarkId::new("gather + zstd-1 floor", size), |b| {
            b.iter(|| {
                for batch in &raw_batches {
                    gathered.clear();
                    gathered.extend_from_slice(batch);
                    buffer.clear();
                    zstd.compress_to_buffer(&gathered, &mut buffer).unwrap();
                    black_box(&buffer);
                }
            })
        });
        group.finish();
    }
}

/// The raw entry bytes of every batch in an encoded stream (what the writer compressed).
fn raw_batches(encoded: &[u8]) -> Vec<Bytes> {
    let mut stream = BytesMut::new();
    header().encode(&mut stream).unwrap();
    stream.extend_from_slice(encoded);
    let mut decoder = StreamDecoder::new(TelemetryDecoder::default());
    decoder.push(&stream);
    std::iter::from_fn(|| decoder.pop().unwrap())
        .filter_map(|item| match item {
            TelemetryItem::Batch(batch) => Some(batch.raw_entries().clone()),
            _ => None,
        })
        .collect()
}

fn header() -> Header {
    Header {
        flow_id: [0; 16],
        token: Bytes::new(),
        stream: StreamDescriptor {
            name: "bench".into(),
            node_id: [0; 32],
            started_at_ms: 0,
            labels: vec![],
        },
        channels: vec![],
    }
}

fn bifaci(c: &mut Criterion) {
    for size in SIZES {
        let mut frame = Frame::new(FrameType::Chunk, MessageId::Uuid([9; 16]));
        frame.seq = 12;
        frame.stream_id = Some("output".into());
        frame.payload = Some(payload(size));
        frame.chunk_index = Some(3);
        frame.checksum = Some(0x1234_5678_9abc_def0);
        bench_codec(
            c,
            &format!("bifaci/{size}"),
            BifaciDecoder::default(),
            |out| frame.encode(usize::MAX, out).unwrap(),
        );
    }
}

fn envelope(c: &mut Criterion) {
    for size in SIZES {
        let env = Env {
            obj: Some(Address::parse("orders/eu-1").unwrap()),
            obj_kind: Some(ObjKind::Queue),
            id: Some("01HZX3K9Q4M2ABCDEF".into()),
            seq: Some(123_456),
            receipt: Some(1),
            ..Env::new(Verb::Send)
        };
        let envelope = Envelope {
            body: Some(payload(size)),
            ..Envelope::new(env)
        };
        bench_codec(c, &format!("envelope/{size}"), EnvelopeDecoder, |out| {
            envelope.encode(out).unwrap()
        });
    }
}

#[allow(missing_docs)] // criterion_group! generates an undocumented function.
mod group {
    criterion::criterion_group!(
        benches,
        super::actor,
        super::telemetry,
        super::bifaci,
        super::envelope
    );
}
criterion_main!(group::benches);
