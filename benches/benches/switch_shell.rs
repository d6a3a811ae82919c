//! The switch from async Rust over Unix socket pairs (issue "The switch from async Rust"),
//! each beside a direct connection measured in the same run:
//!
//! - requests/s, a small REQ → END, 1 and 64 in flight, through `tether::switch::Switch` and a
//!   `Host`, beside a direct host connection: the engine holds the socket to the same `Host`
//!   itself and drives the core switch machine inline (the same handshake, routing, numbering
//!   and credit, with no switch task, command channel or writer task between). The goal is the
//!   switch at ≥ 80% of the direct connection. A third line, the same REQ → END frames echoed
//!   by a bare decoder with no host runtime, is the transport and codec floor;
//! - streamed MB/s of a 16 MiB answer in 64 KiB chunks under credit, through the switch and
//!   over the direct host connection, beside the same bytes written raw over a socket pair.

use std::time::{Duration, Instant};

use criterion::{criterion_main, Criterion, Throughput};
use tether::switch::host::Host;
use tether::switch::Switch;
use tether_core::request::Credits;
use tether_core::switch::ask::Ask;
use tether_core::switch::side::RequestSide;
use tether_core::switch::{ConnId, Event, Peer, Switch as Machine, SwitchConfig};
use tether_core::time::Time;
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

fn bench_host() -> Host {
    Host::new("bench")
        .handler(SMALL, |request| async move {
            let _ = request.end().await;
        })
        .handler(STREAM, |request| async move {
            let chunks = (0..STREAM_BYTES / CHUNK_BYTES).map(|_| vec![7u8; CHUNK_BYTES]);
            let _ = request.respond("out", "media:text", chunks).await;
            let _ = request.end().await;
        })
}

async fn switch_with_host() -> Switch {
    let (a, b) = pair();
    tokio::spawn(bench_host().serve(b));
    let switch = Switch::builder().start();
    switch.add_master("bench", a).await.expect("verified");
    switch
}

async fn through_switch(switch: &Switch, cap: &str) -> usize {
    // No input: the switch writes the REQ and its END in one exchange with its task.
    let call = switch.call(cap, []).await.expect("routed");
    call.collect().await.expect("answered").len()
}

/// An engine connected straight to a host: one task owns the socket and the core machine.
struct DirectEngine {
    machine: Machine,
    conn: ConnId,
    socket: UnixStream,
    decoder: StreamDecoder<BifaciDecoder>,
    buf: Vec<u8>,
    out: Vec<u8>,
    next_rid: u64,
    epoch: Instant,
}

impl DirectEngine {
    async fn connect() -> Self {
        let (a, b) = pair();
        tokio::spawn(bench_host().serve(b));
        let epoch = Instant::now();
        let mut machine = Machine::new(SwitchConfig::default(), &[]);
        let conn = machine
            .ask_attach(Time::ZERO, "direct", [3; 32])
            .expect("attach");
        let mut direct = Self {
            machine,
            conn,
            socket: a,
            decoder: StreamDecoder::new(BifaciDecoder::default()),
            buf: vec![0u8; 64 * 1024],
            out: Vec::new(),
            next_rid: 0,
            epoch,
        };
        loop {
            direct.flush(&mut Vec::new()).await;
            while let Some(event) = direct.machine.poll_event() {
                if matches!(event, Event::MasterReady { .. }) {
                    return direct;
                }
            }
            direct.read(&mut Vec::new()).await;
        }
    }

    fn now(&self) -> Time {
        Time::from_millis(self.epoch.elapsed().as_millis() as u64)
    }

    /// Writes what the machine sends the host; keeps what it sends the engine.
    async fn flush(&mut self, engine: &mut Vec<Frame>) {
        self.out.clear();
        while let Some(transmit) = self.machine.poll_transmit() {
            match transmit.to {
                Peer::Master(_) => transmit
                    .frame
                    .encode(1 << 20, &mut self.out)
                    .expect("encodes"),
                Peer::Engine => engine.push(transmit.frame),
            }
        }
        if !self.out.is_empty() {
            self.socket.write_all(&self.out).await.expect("write");
        }
    }

    /// Reads what the host sent and hands every frame to the machine.
    async fn read(&mut self, engine: &mut Vec<Frame>) {
        let n = self.socket.read(&mut self.buf).await.expect("read");
        self.decoder.push(&self.buf[..n]);
        let now = self.now();
        while let Ok(Some(frame)) = self.decoder.pop() {
            self.machine.handle_master_frame(now, self.conn, frame);
        }
        self.flush(engine).await;
    }

    /// A request for `cap` with no input (REQ, then END).
    fn start(&mut self, cap: &str) -> RequestSide {
        let now = self.now();
        self.next_rid += 1;
        let mut side = RequestSide::new(
            MessageId::Uint(self.next_rid),
            None,
            Credits::new(self.machine.window()),
            64,
        );
        let mut req = side.frame(FrameType::Req);
        req.cap = Some(cap.to_owned());
        side.write(&mut req).expect("numbered");
        self.machine
            .ask_engine_request(now, req, None)
            .expect("routed");
        let mut end = side.frame(FrameType::End);
        side.write(&mut end).expect("numbered");
        // The host may have answered already: an END after that is refused, harmlessly.
        let _ = self.machine.ask_engine_frame(now, end);
        side
    }

    /// `in_flight` requests, all answered.
    async fn round_trips(&mut self, in_flight: u64) {
        for _ in 0..in_flight {
            self.start(SMALL);
        }
        let mut engine = Vec::new();
        let mut ended = 0;
        self.flush(&mut engine).await;
        loop {
            ended += engine
                .drain(..)
                .filter(|frame| matches!(frame.frame_type, FrameType::End | FrameType::Err))
                .count() as u64;
            if ended == in_flight {
                return;
            }
            self.read(&mut engine).await;
        }
    }

    /// The streamed answer's bytes, read in order with each CHUNK's credit granted back as
    /// it is consumed (what a `Call` does).
    async fn streamed(&mut self) -> usize {
        let mut side = self.start(STREAM);
        let (mut engine, mut body, mut ended) = (Vec::new(), 0, false);
        self.flush(&mut engine).await;
        while !ended {
            for frame in std::mem::take(&mut engine) {
                let mut chunks = Vec::new();
                let _ = side.read(frame, |frame| {
                    ended |= matches!(frame.frame_type, FrameType::End | FrameType::Err);
                    if frame.frame_type == FrameType::Chunk {
                        body += frame.payload.as_ref().map_or(0, |p| p.len());
                        chunks.push(frame.stream_id);
                    }
                });
                for stream in chunks {
                    if let Some(credit) = side.consume(stream.as_deref()) {
                        let now = self.now();
                        let _ = self.machine.ask_engine_frame(now, credit);
                    }
                }
            }
            self.flush(&mut engine).await;
            if !ended && engine.is_empty() {
                self.read(&mut engine).await;
            }
        }
        body
    }
}

/// The transport and codec floor: REQ and END frames over one socket pair, the far side decoding each REQ
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
    let (mut echo, _echo) = runtime.block_on(direct_echo());
    let mut direct = runtime.block_on(DirectEngine::connect());
    for in_flight in [1u64, 64] {
        let mut group = c.benchmark_group(format!("switch_shell/req_end_{in_flight}_in_flight"));
        group.throughput(criterion::Throughput::Elements(in_flight));
        group.bench_function("switch", |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        // In this one task, as the direct engine runs its requests.
                        let calls = (0..in_flight).map(|_| through_switch(&switch, SMALL));
                        futures::future::join_all(calls).await;
                    }
                    start.elapsed()
                })
            })
        });
        group.bench_function("baseline_direct_host", |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        direct.round_trips(in_flight).await;
                    }
                    start.elapsed()
                })
            })
        });
        let mut next = 0u64;
        group.bench_function("floor_echoed_frames", |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        direct_round_trips(&mut echo, in_flight, next).await;
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
    let mut direct = runtime.block_on(DirectEngine::connect());
    group.bench_function("baseline_direct_host", |b| {
        b.iter(|| {
            let body = runtime.block_on(direct.streamed());
            assert_eq!(body, STREAM_BYTES);
        })
    });
    group.bench_function("floor_raw_bytes", |b| {
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
