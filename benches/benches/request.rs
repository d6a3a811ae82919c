//! Request-lifecycle machines, each beside the bare collection operation it is built on,
//! measured in the same run (issue "Request lifecycle core"):
//!
//! - register + terminate pairs with 10,000 live requests, against a `BTreeMap` insert +
//!   remove of the same keys;
//! - `disposition` lookups (live, straggler and unknown RIDs in turn), against a `BTreeMap`
//!   `contains_key`;
//! - `ReorderBuffer` throughput with 10% of arrivals out of order, against a `VecDeque`
//!   passing the same items through in order.

use std::collections::{BTreeMap, VecDeque};
use std::hint::black_box;

use criterion::{criterion_main, Criterion, Throughput};
use tether_core::request::{
    Credits, ReorderBuffer, RequestKey, RequestTable, RequestTableConfig, Seq, TerminationKind,
};
use tether_core::time::Time;
use tether_core::wire::bifaci::MessageId;

const LIVE: u64 = 10_000;
const ARRIVALS: u64 = 10_000;

fn key(rid: u64) -> RequestKey {
    RequestKey {
        xid: MessageId::Uint(rid % 7),
        rid: MessageId::Uint(rid),
    }
}

/// A table with `LIVE` live requests and a full ring of recent terminations.
fn loaded_table() -> RequestTable<u64> {
    let mut table = RequestTable::new(RequestTableConfig::default());
    for rid in 0..LIVE + 64 {
        table
            .register(key(rid), rid, Credits::new(32), Time::ZERO)
            .expect("fresh rid");
    }
    for rid in LIVE..LIVE + 64 {
        table
            .terminate(key(rid), TerminationKind::End, Time::ZERO)
            .expect("live");
    }
    table
}

fn register_terminate(c: &mut Criterion) {
    let mut group = c.benchmark_group("request_table/register_terminate_10k_live");
    group.throughput(Throughput::Elements(1));
    let mut table = loaded_table();
    let mut next = 1_000_000u64;
    group.bench_function("table", |b| {
        b.iter(|| {
            next += 1;
            let key = key(next);
            table
                .register(key, next, Credits::new(32), Time::ZERO)
                .expect("fresh rid");
            black_box(table.terminate(key, TerminationKind::End, Time::from_millis(1)));
        })
    });
    let mut map: BTreeMap<RequestKey, u64> = (0..LIVE).map(|rid| (key(rid), rid)).collect();
    group.bench_function("btreemap_baseline", |b| {
        b.iter(|| {
            next += 1;
            map.insert(key(next), next);
            black_box(map.remove(&key(next)));
        })
    });
    group.finish();
}

fn disposition(c: &mut Criterion) {
    let mut group = c.benchmark_group("request_table/disposition");
    group.throughput(Throughput::Elements(3));
    let table = loaded_table();
    // A live rid, a straggler (in the ring) and one never known.
    let rids = [
        MessageId::Uint(5_000),
        MessageId::Uint(LIVE + 10),
        MessageId::Uint(u64::MAX),
    ];
    group.bench_function("table", |b| {
        b.iter(|| {
            for rid in rids {
                black_box(table.disposition(black_box(rid)));
            }
        })
    });
    let map: BTreeMap<MessageId, u64> = (0..LIVE).map(|rid| (MessageId::Uint(rid), rid)).collect();
    group.bench_function("btreemap_baseline", |b| {
        b.iter(|| {
            for rid in rids {
                black_box(map.contains_key(black_box(&rid)));
            }
        })
    });
    group.finish();
}

/// Seqs 0..ARRIVALS with every tenth pair swapped: 10% of arrivals come early.
fn arrivals() -> Vec<u64> {
    let mut seqs: Vec<u64> = (0..ARRIVALS).collect();
    for pair in (0..ARRIVALS as usize - 1).step_by(20) {
        seqs.swap(pair, pair + 1);
    }
    seqs
}

fn reorder(c: &mut Criterion) {
    let mut group = c.benchmark_group("reorder_buffer/10pct_out_of_order");
    group.throughput(Throughput::Elements(ARRIVALS));
    let seqs = arrivals();
    group.bench_function("reorder_buffer", |b| {
        b.iter(|| {
            let mut buffer = ReorderBuffer::new(64);
            let mut delivered = 0u64;
            for seq in &seqs {
                let accepted = buffer.accept(Seq(*seq), *seq, |_, item| {
                    delivered += 1;
                    black_box(item);
                });
                black_box(accepted.is_ok());
            }
            assert_eq!(delivered, ARRIVALS);
        })
    });
    group.bench_function("vecdeque_baseline", |b| {
        b.iter(|| {
            let mut queue = VecDeque::with_capacity(64);
            for seq in &seqs {
                queue.push_back(*seq);
                black_box(queue.pop_front());
            }
        })
    });
    group.finish();
}

fn benches() {
    let mut criterion = Criterion::default().configure_from_args();
    register_terminate(&mut criterion);
    disposition(&mut criterion);
    reorder(&mut criterion);
}

criterion_main!(benches);
