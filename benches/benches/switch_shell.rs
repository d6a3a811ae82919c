//! The switch from async Rust over Unix socket pairs (issue "The switch from async Rust"),
//! each beside a direct connection measured in the same run:
//!
//! - requests/s, a small REQ → END, 1 and 64 in flight, through `tether::switch::Switch` and a
//!   `Host`, beside the same REQ → END frames round-tripped directly over one socket pair
//!   (encoded, decoded, answered: the transport and codec floor a direct connection costs);
//! - streamed MB/s of a 16 MiB answer in 64 KiB chunks under credit, beside the same bytes
//!   written directly over a socket pair.

use std::time::{Duration, Instant};

use criterion::{criterion_main, Criterion, Throughput};
use tether::switch::host::Host;
use tether::switch::Switch;
use tether_core::wire::bifaci::{BifaciDecoder, Frame, FrameType, MessageId};
use tether_core::wire::StreamDecoder;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::runtime::Runtime;

const SMALL: &str = "cap:in=media:text;out=media:small";
const STREAM: &str = "cap:in=media:text;out=media:stream";
const STREAM_BYTES: usize = 16 * 1024 * 1024;
const CHUNK_BYTES: usize = 64 * 1024;

fn pair() -> (UnixStream, UnixStream) {
    let (a, b) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    a.set_nonblocking(true).expect("nonblocking");
    b.set_nonblocking(true).expect("nonblocking");
    (
        UnixStream::from_std(a).expect("tokio"),
        UnixStream::from_std(b).expect("tokio"),
    )
}

async fn switch_with_host() -> Switch {
    let host = Host::new("bench")
        .handler(SMALL, |request| async move {
            let _ = request.end().await;
        })
        .handler(STREAM, |request| async move {
            let chunks = (0..STREAM_BYTES / CHUNK_BYTES).map(|_| vec![7u8; CHUNK_BYTES]);
            let _ = request.respond("out", "media:text", chunks).await;
            let _ = request.end().await;
        });
    let (a, b) = pair();
    tokio::spawn(host.serve(b));
    let switch = Switch::builder().start();
    switch.add_master("bench", a).await.expect("verified");
    switch
}

async fn through_switch(switch: &Switch, cap: &str) -> usize {
    let call = switch.request(cap).await.expect("routed");
    // The host answers without waiting for the input: the request may have ended already.
    let _ = call.finish().await;
    call.collect().await.expect("answered").len()
}

/// The direct floor: REQ and END frames over one socket pair, the far side decoding each REQ
/// and answering END.
async fn direct_echo() -> (UnixStream, tokio::task::JoinHandle<()>) {
    let (mut near, mut far) = pair();
    let task = tokio::spawn(async move {
        let mut decoder = StreamDecoder::new(BifaciDecoder::default());
        let mut buf = vec![0u8; 64 * 1024];
        let mut out = Vec::new();
        loop {
            let Ok(n) = far.read(&mut buf).await else {
                return;
            };
            if n == 0 {
                return;
            }
            decoder.push(&buf[..n]);
            out.clear();
            while let Ok(Some(frame)) = decoder.pop() {
                Frame::new(FrameType::End, frame.id)
                    .encode(1 << 20, &mut out)
                    .expect("encodes");
            }
            if far.write_all(&out).await.is_err() {
                return;
            }
        }
    });
    let _ = near.flush().await;
    (near, task)
}

async fn direct_round_trips(stream: &mut UnixStream, in_flight: u64, first: u64) {
    let mut out = Vec::new();
    for rid in first..first + in_flight {
        let mut req = Frame::new(FrameType::Req, MessageId::Uint(rid));
        req.cap = Some(SMALL.to_owned());
        req.encode(1 << 20, &mut out).expect("encodes");
    }
    stream.write_all(&out).await.expect("write");
    let mut decoder = StreamDecoder::new(BifaciDecoder::default());
    let mut buf = vec![0u8; 64 * 1024];
    let mut ended = 0;
    while ended < in_flight {
        let n = stream.read(&mut buf).await.expect("read");
        decoder.push(&buf[..n]);
        while let Ok(Some(_)) = decoder.pop() {
            ended += 1;
        }
    }
}

fn requests(c: &mut Criterion) {
    let runtime = Runtime::new().expect("runtime");
    let switch = runtime.block_on(switch_with_host());
    let (mut direct, _echo) = runtime.block_on(direct_echo());
    for in_flight in [1u64, 64] {
        let mut group = c.benchmark_group(format!("switch_shell/req_end_{in_flight}_in_flight"));
        group.throughput(criterion::Throughput::Elements(in_flight));
        group.bench_function("switch", |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let mut calls = tokio::task::JoinSet::new();
                        for _ in 0..in_flight {
                            let switch = switch.clone();
                            calls.spawn(async move { through_switch(&switch, SMALL).await });
                        }
                        while calls.join_next().await.is_some() {}
                    }
                    start.elapsed()
                })
            })
        });
        let mut next = 0u64;
        group.bench_function("baseline_direct_frames", |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        direct_round_trips(&mut direct, in_flight, next).await;
                        next += in_flight;
                    }
                    start.elapsed()
                })
            })
        });
        group.finish();
    }
}

fn streamed(c: &mut Criterion) {
    let runtime = Runtime::new().expect("runtime");
    let switch = runtime.block_on(switch_with_host());
    let mut group = c.benchmark_group("switch_shell/stream_16mib");
    group.throughput(Throughput::Bytes(STREAM_BYTES as u64));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(5));
    group.bench_function("switch", |b| {
        b.iter(|| runtime.block_on(through_switch(&switch, STREAM)))
    });
    group.bench_function("baseline_direct_bytes", |b| {
        b.iter(|| {
            runtime.block_on(async {
                let (mut near, mut far) = pair();
                let writer = tokio::spawn(async move {
                    let chunk = vec![7u8; CHUNK_BYTES];
                    for _ in 0..STREAM_BYTES / CHUNK_BYTES {
                        far.write_all(&chunk).await.expect("write");
                    }
                });
                let mut sink = Vec::with_capacity(STREAM_BYTES);
                near.read_to_end(&mut sink).await.expect("read");
                writer.await.expect("writer");
                sink.len()
            })
        })
    });
    group.finish();
}

fn benches() {
    let mut c = Criterion::default().configure_from_args();
    requests(&mut c);
    streamed(&mut c);
}

criterion_main!(benches);
