//! Actor frames through `Node` (issue "iroh transport driver"): 64 B and 1 KiB frames enqueued
//! on one node until all are delivered on the other, over real iroh on loopback, beside a raw
//! iroh uni stream carrying the same actor-record bytes (coalesced the same way, and handed
//! to the stream as whole chunks without a copy, as the driver's writer hands them) to a
//! reader that decodes and counts them. Target: Node ≥ 90% of the raw messages/s. `node` sends each
//! frame with `Node::send`; `node_batch` hands the same frames to `Node::send_batch` (the egress
//! table taken, the counter bumped and the writer woken once per run instead of per frame, and
//! one ring slot per 64 frames);
//! `node_ring4096` is `node` with a 4,096-slot egress ring (the default is 1,024). The paired
//! comparison also reports the CPU time every thread of the process spent per frame (and how
//! it splits between the sending thread and the runtime's worker threads), and a
//! `channel_floor`: the same frames handed one by one through the core hybrid channel (the
//! per-frame queue docs/spec/driver.md §3.2 prescribes) to a bare writer on the raw stream,
//! with nothing of the driver around it: what the hand-off itself costs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use criterion::{criterion_main, Criterion, Throughput};
use tether::node::{ActorBridge, DeliveryError, Node, OutFrame};
use tether_benches::{caller_cpu_ns, direct_addr, loopback_endpoint, thread_cpu_ns};
use tether_core::channel::{HybridChannel, Sender};
use tether_core::stats::quantile;
use tether_core::wire::actor::{encode_record, ActorDecoder, ActorRecord};
use tether_core::wire::StreamDecoder;
use tokio::runtime::Runtime;
use tokio::sync::Notify;

const FRAMES: u64 = 20_000;
/// Rounds of the paired comparison (each is one round of every kind). A single round's ratio
/// spreads from about 60% to 120% on a 2-core VM; 300 keep the median's own sampling error
/// well under the spread between whole runs (83–92% for `send_batch` at 64 B in one session).
const PAIRED_ROUNDS: usize = 300;
/// Unmeasured rounds of each kind before a paired comparison: the connections' congestion
/// windows, the rings and the allocator start cold, and the first rounds of each kind would
/// weigh on its median.
const WARM_UP_ROUNDS: usize = 20;
const ACTOR: tether::node::ActorAddr = tether::node::ActorAddr::new([7; 32]);
const RAW_ALPN: &[u8] = b"tether/bench/raw";

/// Counts deliveries and wakes the measuring thread once, at the target (waking it per
/// frame would time the harness's wake-ups, which hit the two sides unequally).
struct Count {
    seen: AtomicU64,
    target: AtomicU64,
    notify: Notify,
}

impl Count {
    fn new() -> Self {
        Self {
            seen: AtomicU64::new(0),
            target: AtomicU64::new(u64::MAX),
            notify: Notify::new(),
        }
    }

    fn saw_one(&self) {
        if self.seen.fetch_add(1, Ordering::Relaxed) + 1 == self.target.load(Ordering::Relaxed) {
            self.notify.notify_one();
        }
    }

    /// Sets the next target: `FRAMES` more than seen so far.
    fn expect_more(&self) -> u64 {
        let target = self.seen.load(Ordering::Relaxed) + FRAMES;
        self.target.store(target, Ordering::Relaxed);
        target
    }
}

impl ActorBridge for Count {
    fn deliver_raw(
        &self,
        _: tether::node::ActorAddr,
        _: &str,
        _: Bytes,
    ) -> Result<(), DeliveryError> {
        self.saw_one();
        Ok(())
    }
}

/// The floor the egress design of docs/spec/driver.md §3.2 sets under any driver: each frame handed
/// alone through the core hybrid channel (a 1,024-slot ring and its spillover) to one writer task
/// that encodes and writes what it pops to a raw iroh stream, with the cheapest correct wake-up (a
/// flag the writer sets before it sleeps), encoding as the driver's writer does. Nothing of
/// tether's driver is on the path: no egress table, no counters, no machine, no routing on the
/// receiving side.
struct ChannelFloor {
    sender: Sender<(ActorAddr, Bytes)>,
    asleep: Arc<AtomicBool>,
    notify: Arc<Notify>,
}

type ActorAddr = tether::node::ActorAddr;

impl ChannelFloor {
    fn start(runtime: &Runtime, conn: iroh::endpoint::Connection) -> Self {
        let channel = HybridChannel::<(ActorAddr, Bytes)>::with_ring(1024);
        let sender = channel.sender();
        let (asleep, notify) = (Arc::new(AtomicBool::new(false)), Arc::new(Notify::new()));
        let (sleeping, woken) = (asleep.clone(), notify.clone());
        runtime.spawn(async move {
            let mut send = conn.open_uni().await.expect("uni");
            let mut buf = BytesMut::new();
            loop {
                // As the driver's writer: one scheduler turn so a burst shares the write.
                tokio::task::yield_now().await;
                loop {
                    buf.clear();
                    while buf.len() < 256 * 1024 {
                        let Some((dest, payload)) = channel.pop() else {
                            break;
                        };
                        encode_record(dest.as_bytes(), "Bench", &payload, 1 << 20, &mut buf)
                            .expect("encode");
                    }
                    if buf.is_empty() {
                        break;
                    }
                    send.write_chunk(buf.split().freeze()).await.expect("write");
                }
                let notified = woken.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                sleeping.store(true, Ordering::Relaxed);
                std::sync::atomic::fence(Ordering::SeqCst);
                if !channel.is_empty() {
                    sleeping.store(false, Ordering::Relaxed);
                    continue;
                }
                notified.await;
            }
        });
        Self {
            sender,
            asleep,
            notify,
        }
    }

    fn send(&self, dest: ActorAddr, payload: Bytes) {
        self.sender
            .push((dest, payload))
            .expect("unbounded spillover");
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.asleep.load(Ordering::Relaxed) && self.asleep.swap(false, Ordering::Relaxed) {
            self.notify.notify_one();
        }
    }
}

async fn wait_for(count: &Count, target: u64) {
    loop {
        // Registered before the check, so a notify between the two is not lost.
        let notified = count.notify.notified();
        if count.seen.load(Ordering::Relaxed) >= target {
            return;
        }
        notified.await;
    }
}

fn node(c: &mut Criterion) {
    let runtime = Runtime::new().expect("runtime");
    let mut group = c.benchmark_group("node/actor_frames");
    group.throughput(Throughput::Elements(FRAMES));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));

    let count = Arc::new(Count::new());
    let (a, a_wide, b) = runtime.block_on(async {
        let a = Node::builder().bind().await.expect("a");
        // The same sender with a 4,096-slot egress ring: a burst spills far less.
        let a_wide = Node::builder()
            .egress_ring(4096)
            .bind()
            .await
            .expect("a_wide");
        let b = Node::builder()
            .bridge(count.clone())
            .know_tag("Bench")
            .host(ACTOR)
            .bind()
            .await
            .expect("b");
        a.connect(b.endpoint_addr()).await.expect("connect");
        a_wide.connect(b.endpoint_addr()).await.expect("connect");
        (a, a_wide, b)
    });

    // The raw baseline: a reader that decodes actor records from every uni stream.
    let raw_count = Arc::new(Count::new());
    let (raw_tx, raw_rx) = runtime.block_on(async {
        (
            loopback_endpoint(RAW_ALPN).await,
            loopback_endpoint(RAW_ALPN).await,
        )
    });
    {
        let (raw_rx, raw_count) = (raw_rx.clone(), raw_count.clone());
        runtime.spawn(async move {
            while let Some(incoming) = raw_rx.accept().await {
                let conn = incoming.accept().expect("accept").await.expect("conn");
                let raw_count = raw_count.clone();
                tokio::spawn(async move {
                    while let Ok(mut recv) = conn.accept_uni().await {
                        let raw_count = raw_count.clone();
                        tokio::spawn(async move {
                            let mut decoder = StreamDecoder::new(ActorDecoder::default());
                            while let Ok(Some(chunk)) = recv.read_chunk(64 * 1024).await {
                                decoder.push_bytes(chunk);
                                while let Ok(Some(_)) = decoder.pop() {
                                    raw_count.saw_one();
                                }
                            }
                        });
                    }
                });
            }
        });
    }
    let raw_send = runtime.block_on(async {
        let conn = raw_tx
            .connect(direct_addr(&raw_rx), RAW_ALPN)
            .await
            .expect("raw connect");
        let send = conn.open_uni().await.expect("uni");
        (conn, tokio::sync::Mutex::new(send))
    });

    let floor = ChannelFloor::start(&runtime, raw_send.0.clone());
    let floor_round = |payload: &Bytes| {
        let start = Instant::now();
        runtime.block_on(async {
            let target = raw_count.expect_more();
            for _ in 0..FRAMES {
                floor.send(ACTOR, payload.clone());
            }
            wait_for(&raw_count, target).await;
        });
        start.elapsed()
    };
    let node_round = |sender: &Node, payload: &Bytes, batch: bool| {
        let to = b.node_id();
        let frame = || OutFrame {
            to,
            dest: ACTOR,
            type_tag: "Bench".into(),
            payload: payload.clone(),
        };
        let start = Instant::now();
        runtime.block_on(async {
            let target = count.expect_more();
            if batch {
                sender.send_batch((0..FRAMES).map(|_| frame()));
            } else {
                for _ in 0..FRAMES {
                    sender.send(frame());
                }
            }
            wait_for(&count, target).await;
        });
        start.elapsed()
    };
    let raw_round = |payload: &Bytes| {
        let start = Instant::now();
        runtime.block_on(async {
            let target = raw_count.expect_more();
            let record =
                ActorRecord::new(*ACTOR.as_bytes(), "Bench", payload.clone()).expect("record");
            let mut buf = BytesMut::new();
            let mut send = raw_send.1.lock().await;
            for _ in 0..FRAMES {
                record.encode(1 << 20, &mut buf).expect("encode");
                if buf.len() >= 256 * 1024 {
                    send.write_chunk(buf.split().freeze()).await.expect("write");
                }
            }
            send.write_chunk(buf.split().freeze()).await.expect("write");
            drop(send);
            wait_for(&raw_count, target).await;
        });
        start.elapsed()
    };

    let payloads = [64usize, 1024].map(|size| {
        // A static payload: every frame shares it without touching a reference count, as
        // the raw baseline (which encodes one record over and over) never does either.
        (
            size,
            Bytes::from_static(Box::leak(vec![1u8; size].into_boxed_slice())),
        )
    });
    for (size, payload) in &payloads {
        for (name, sender, batch) in [
            ("node", &a, false),
            ("node_batch", &a, true),
            ("node_ring4096", &a_wide, false),
        ] {
            group.bench_function(format!("{name}/{size}B"), |bench| {
                timed(bench, || node_round(sender, payload, batch))
            });
        }
        group.bench_function(format!("raw_iroh_stream/{size}B"), |bench| {
            timed(bench, || raw_round(payload));
        });
    }
    group.finish();

    // The same comparison paired: rounds of node, batch, raw and the floor taken in turn, so a
    // drift in the machine's speed (this VM's moves by ±12% between minutes) hits all four
    // alike; the median of the per-round ratios is the figure the target is read against.
    for (size, payload) in &payloads {
        let mut ratios: [Vec<f64>; 3] = [Vec::new(), Vec::new(), Vec::new()];
        // CPU nanoseconds spent in each kind of round (node, node_batch, raw, channel floor):
        // by every thread, and by the calling thread alone (the one that sends; the rest is
        // the runtime's worker threads, where the writers, iroh and the readers run).
        let (mut cpu, mut caller) = ([0u64; 4], [0u64; 4]);
        // One round of a kind: node, node_batch, raw iroh, the channel floor.
        let round_of = |kind: usize| match kind {
            0 => node_round(&a, payload, false),
            1 => node_round(&a, payload, true),
            2 => raw_round(payload),
            _ => floor_round(payload),
        };
        let mut on_cpu = |kind: usize, round: &dyn Fn() -> Duration| {
            let before = (thread_cpu_ns(), caller_cpu_ns());
            let took = round();
            if let (Some(all), Some(after)) = (before.0, thread_cpu_ns()) {
                cpu[kind] += after.saturating_sub(all);
            }
            if let (Some(own), Some(after)) = (before.1, caller_cpu_ns()) {
                caller[kind] += after.saturating_sub(own);
            }
            took
        };
        // Profiling: `TETHER_BENCH_ONLY=node,channel_floor` (any of node, node_batch, raw,
        // channel_floor, comma-separated) runs those kinds of round in turn and nothing else, at
        // every size or at `TETHER_BENCH_SIZE` bytes alone, and reports the median of the paired
        // ratios of each kind to the last one named.
        if let Ok(only) = std::env::var("TETHER_BENCH_ONLY") {
            if std::env::var("TETHER_BENCH_SIZE").is_ok_and(|want| want != size.to_string()) {
                continue;
            }
            let names = ["node", "node_batch", "raw", "channel_floor"];
            let kinds: Vec<usize> = only
                .split(',')
                .map(|name| {
                    names
                        .iter()
                        .position(|known| *known == name)
                        .expect("TETHER_BENCH_ONLY names kinds of round")
                })
                .collect();
            let mut took = vec![Vec::new(); kinds.len()];
            // `TETHER_BENCH_ROUNDS` rounds of each kind instead of the paired comparison's
            // (a profile wants more samples).
            let rounds = std::env::var("TETHER_BENCH_ROUNDS")
                .ok()
                .and_then(|rounds| rounds.parse().ok())
                .unwrap_or(PAIRED_ROUNDS);
            // Unmeasured rounds first.
            for _ in 0..WARM_UP_ROUNDS {
                for &kind in &kinds {
                    round_of(kind);
                }
            }
            for round in 0..rounds {
                // Each round starts with the next kind, as in the full comparison below.
                for turn in 0..kinds.len() {
                    let at = (round + turn) % kinds.len();
                    let kind = kinds[at];
                    took[at].push(on_cpu(kind, &|| round_of(kind)));
                }
            }
            let frames = (rounds as u64 * FRAMES) as f64;
            for (at, &kind) in kinds.iter().enumerate() {
                let total: Duration = took[at].iter().sum();
                println!(
                    "node/actor_frames/only/{}/{size}B: {:.0} frames/s, {:.0} ns of CPU per \
                     frame ({:.0} on the sending thread)",
                    names[kind],
                    frames / total.as_secs_f64(),
                    cpu[kind] as f64 / frames,
                    caller[kind] as f64 / frames,
                );
            }
            // Every kind against the last one named, round by round.
            if let Some((baseline, others)) = took.split_last() {
                for (at, other) in others.iter().enumerate() {
                    let mut ratios: Vec<f64> = other
                        .iter()
                        .zip(baseline)
                        .map(|(other, baseline)| baseline.as_secs_f64() / other.as_secs_f64())
                        .collect();
                    println!(
                        "node/actor_frames/only/{}_vs_{}/{size}B: {:.1}% (median of paired \
                         rounds)",
                        names[kinds[at]],
                        names[kinds[kinds.len() - 1]],
                        quantile(&mut ratios, 0.5) * 100.0,
                    );
                }
            }
            continue;
        }
        // Unmeasured rounds first, as in the comparison of chosen kinds below: with a filter
        // (`-- paired`) criterion's own rounds, which would warm the nodes, do not run.
        for _ in 0..WARM_UP_ROUNDS {
            for kind in 0..4 {
                round_of(kind);
            }
        }
        for round in 0..PAIRED_ROUNDS {
            // Each round starts with the next kind: a kind that always ran after the same
            // other kind would inherit its caches and its threads' state (raw iroh's sending
            // thread ran 45 ns a frame after node_batch and 65 ns alone).
            let mut took = [Duration::ZERO; 4];
            for turn in 0..4 {
                let kind = (round + turn) % 4;
                took[kind] = on_cpu(kind, &|| round_of(kind));
            }
            let raw = took[2].as_secs_f64();
            ratios[0].push(raw / took[0].as_secs_f64());
            ratios[1].push(raw / took[1].as_secs_f64());
            ratios[2].push(raw / took[3].as_secs_f64());
        }
        let frames = (PAIRED_ROUNDS as u64 * FRAMES) as f64;
        println!(
            "node/actor_frames/paired/cpu/{size}B: ns of CPU per frame (all threads): \
             node {:.0}, node_batch {:.0}, raw iroh {:.0}, channel_floor {:.0}",
            cpu[0] as f64 / frames,
            cpu[1] as f64 / frames,
            cpu[2] as f64 / frames,
            cpu[3] as f64 / frames,
        );
        let workers = |kind: usize| cpu[kind].saturating_sub(caller[kind]) as f64 / frames;
        println!(
            "node/actor_frames/paired/cpu_split/{size}B: ns of CPU per frame, sending thread / \
             runtime threads: node {:.0} / {:.0}, node_batch {:.0} / {:.0}, \
             raw iroh {:.0} / {:.0}, channel_floor {:.0} / {:.0}",
            caller[0] as f64 / frames,
            workers(0),
            caller[1] as f64 / frames,
            workers(1),
            caller[2] as f64 / frames,
            workers(2),
            caller[3] as f64 / frames,
            workers(3),
        );
        for (name, mut ratios) in ["node", "node_batch", "channel_floor"]
            .into_iter()
            .zip(ratios)
        {
            let mut at = |q: f64| quantile(&mut ratios, q) * 100.0;
            println!(
                "node/actor_frames/paired/{name}/{size}B: {:.1}% of raw iroh frames/s \
                 (median of {PAIRED_ROUNDS} paired rounds; p10 {:.1}%, p90 {:.1}%)",
                at(0.5),
                at(0.1),
                at(0.9),
            );
        }
    }
    runtime.block_on(async {
        a.close().await;
        a_wide.close().await;
        b.close().await;
        raw_tx.close().await;
        raw_rx.close().await;
    });
}

/// Times `iters` rounds.
fn timed(bench: &mut criterion::Bencher<'_>, round: impl Fn() -> Duration) {
    bench.iter_custom(|iters| (0..iters).map(|_| round()).sum());
}

fn benches() {
    let mut criterion = Criterion::default().configure_from_args();
    node(&mut criterion);
}

criterion_main!(benches);
