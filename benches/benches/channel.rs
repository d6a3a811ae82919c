//! `HybridChannel` (issue "iroh transport driver"): 4 producer threads push 100,000 items each
//! while one consumer pops, beside `tokio::sync::mpsc` (unbounded) and `crossbeam_channel`
//! (unbounded) doing the same in the same run. Every consumer polls without blocking, as the
//! per-peer writer does after a wake.

use std::hint::black_box;
use std::thread;

use criterion::{criterion_main, Criterion, Throughput};
use tether_core::channel::HybridChannel;

const PRODUCERS: u64 = 4;
const ITEMS: u64 = 100_000;

fn run<S: Clone + Send + 'static>(
    sender: S,
    push: fn(&S, u64),
    mut pop: impl FnMut() -> Option<u64>,
) {
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|_| {
            let sender = sender.clone();
            thread::spawn(move || {
                for i in 0..ITEMS {
                    push(&sender, i);
                }
            })
        })
        .collect();
    drop(sender);
    let mut received = 0;
    while received < PRODUCERS * ITEMS {
        match pop() {
            Some(item) => {
                black_box(item);
                received += 1;
            }
            None => std::hint::spin_loop(),
        }
    }
    for producer in producers {
        producer.join().expect("producer");
    }
}

fn channels(c: &mut Criterion) {
    let mut group = c.benchmark_group("channel/4_producers_1_consumer");
    group.throughput(Throughput::Elements(PRODUCERS * ITEMS));
    group.sample_size(10);
    group.bench_function("hybrid_channel", |b| {
        b.iter(|| {
            let channel = HybridChannel::new();
            run(
                channel.sender(),
                |s, i| s.push(i).expect("unbounded spillover"),
                || channel.pop(),
            );
        });
    });
    group.bench_function("tokio_mpsc_unbounded", |b| {
        b.iter(|| {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            run(tx, |s, i| s.send(i).expect("open"), || rx.try_recv().ok());
        });
    });
    group.bench_function("crossbeam_channel_unbounded", |b| {
        b.iter(|| {
            let (tx, rx) = crossbeam_channel::unbounded();
            run(tx, |s, i| s.send(i).expect("open"), || rx.try_recv().ok());
        });
    });
    group.finish();
}

fn benches() {
    let mut criterion = Criterion::default().configure_from_args();
    channels(&mut criterion);
}

criterion_main!(benches);
