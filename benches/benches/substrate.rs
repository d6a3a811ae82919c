//! Two in-memory substrate machines exchanging 1 KiB sends, every persist batch acknowledged
//! immediately (issue "Substrate core"): ops/s for window 1 and 32 and for 1 and 100 objects.
//! The baseline in the same run is the codec alone: encoding and decoding the same frames.
//!
//! Wall-clock here measures CPU cost per op (no link delay). Under a modelled link delay the
//! window decides throughput; `core/tests/substrate_behaviour.rs` checks in virtual time that
//! window 32 moves at least 10× the ops of window 1, and this bench prints those figures.

use std::hint::black_box;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use criterion::{criterion_main, BatchSize, Criterion, Throughput};
use tether_core::substrate::harness::{Harness, Party};
use tether_core::substrate::Config;
use tether_core::wire::envelope::{Address, Env, Envelope, EnvelopeDecoder, Verb};
use tether_core::wire::StreamDecoder;

const OPS: u64 = 2_000;

/// A harness with `objects` open queues and `OPS` sends enqueued round-robin, ready to run.
fn loaded(window: usize, objects: usize, latency: Duration) -> Harness {
    // The whole burst is enqueued up front, so the outbox bound is raised to hold it.
    let config = Config {
        in_flight_max: window,
        outbox_ops_max: OPS as usize,
        ..Config::default()
    };
    let mut h = tether_benches::harness_with_queues(config, objects, latency);
    let body = Bytes::from(vec![7u8; 1024]);
    for op in 0..OPS as usize {
        let name = format!("q{}", op % objects);
        h.with(Party::A, |m, now| m.send(now, &name, body.clone()))
            .unwrap();
    }
    h
}

fn exchange(c: &mut Criterion) {
    let mut group = c.benchmark_group("substrate/1KiB_sends");
    group.throughput(Throughput::Elements(OPS));
    group.sample_size(10);
    for (window, objects) in [(1, 1), (32, 1), (1, 100), (32, 100)] {
        let name = format!("window_{window}/objects_{objects}");
        group.bench_function(name, |b| {
            b.iter_batched(
                || loaded(window, objects, Duration::ZERO),
                |mut h| {
                    h.run();
                    assert_eq!(h.b.consumed.len() as u64, OPS);
                    h
                },
                BatchSize::PerIteration,
            )
        });
    }
    // Baseline: only the codec work for the same sends (encode, decode).
    let mut env = Env::new(Verb::Send);
    env.obj = Some(Address::parse("q0").unwrap());
    env.id = Some("00000000000000a00000000000000001".into());
    env.seq = Some(1);
    env.receipt = Some(1);
    let frame = Envelope {
        body: Some(Bytes::from(vec![7u8; 1024])),
        ..Envelope::new(env)
    };
    group.bench_function("codec_baseline", |b| {
        b.iter(|| {
            let mut decoder = StreamDecoder::new(EnvelopeDecoder);
            let mut bytes = BytesMut::new();
            for _ in 0..OPS {
                frame.encode(&mut bytes).unwrap();
                decoder.push(&bytes.split());
                black_box(decoder.pop().unwrap());
            }
        })
    });
    group.finish();
    for (window, objects) in [(1, 1), (32, 1)] {
        let mut h = loaded(window, objects, Duration::from_millis(5));
        let start = h.now;
        h.run();
        let seconds = h.now.saturating_since(start).as_secs_f64();
        eprintln!(
            "substrate virtual throughput, 5 ms one-way delay, window {window}, {objects} object: \
             {:.0} ops/s",
            OPS as f64 / seconds
        );
    }
}

fn benches() {
    let mut criterion = Criterion::default().configure_from_args();
    exchange(&mut criterion);
}

criterion_main!(benches);
