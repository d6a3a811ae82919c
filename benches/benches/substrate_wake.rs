//! The cost of one wake of a substrate machine (issue "Exactly-once under pressure"): with 1
//! object and with 200 objects × 1,000 un-acked ops (the peer's app stopped consuming, so
//! every object waits for credit), the same run measures
//!
//! - `poll_timeout`: when the shell must wake next;
//! - a spurious `handle_timeout` (nothing due);
//! - one input step (a stale ack on one object) with everything it triggers.
//!
//! The 1-object figures are the baseline: a wake must not cost in proportion to what the
//! machine holds.

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{criterion_main, Criterion};
use tether_core::substrate::harness::{Harness, Party};
use tether_core::substrate::{Config, Machine};
use tether_core::time::Time;
use tether_core::wire::envelope::{Address, Env, Envelope, ObjKind, Verb};

const OPS_PER_OBJECT: usize = 1_000;

/// A's machine holding `objects` live queues with `OPS_PER_OBJECT` sends each, the link up and
/// B's app consuming nothing: all but B's window of each object wait at A.
fn loaded(objects: usize) -> (Machine, Time) {
    let config = Config {
        outbox_ops_max: OPS_PER_OBJECT,
        ..Config::default()
    };
    let mut h = Harness::allowing_all(config, 1);
    h.set_auto_consume(Party::B, false);
    h.connect();
    for object in 0..objects {
        let name = format!("q{object}");
        h.with(Party::A, |m, now| m.open(now, ObjKind::Queue, &name, None))
            .unwrap();
    }
    h.run();
    h.disconnect();
    let body = Bytes::from_static(&[7u8; 64]);
    for object in 0..objects {
        let name = format!("q{object}");
        for _ in 0..OPS_PER_OBJECT - 1 {
            h.with(Party::A, |m, now| m.send(now, &name, body.clone()))
                .unwrap();
        }
    }
    h.run();
    h.connect();
    h.run();
    assert!(h.a.machine.outbox_len() >= objects * (OPS_PER_OBJECT - 100));
    (h.a.machine.clone(), h.now)
}

fn stale_ack() -> Envelope {
    let mut env = Env::new(Verb::Ack);
    env.obj = Some(Address::parse("q0").expect("valid"));
    env.id = Some("stale".into());
    env.seq = Some(u64::MAX);
    env.receipt = Some(1);
    Envelope::new(env)
}

fn wake(c: &mut Criterion) {
    let mut group = c.benchmark_group("substrate_wake");
    group.measurement_time(Duration::from_secs(3));
    for objects in [1usize, 200] {
        let (machine, now) = loaded(objects);
        let label = format!("{objects}x{OPS_PER_OBJECT}");
        group.bench_function(format!("poll_timeout/{label}"), |b| {
            b.iter(|| black_box(machine.poll_timeout()))
        });
        // Both inputs leave the machine as it was (a counter aside), so one machine serves
        // every iteration.
        let quiet = now.saturating_add(Duration::from_millis(1));
        let mut m = machine.clone();
        group.bench_function(format!("spurious_timeout/{label}"), |b| {
            b.iter(|| m.handle_timeout(quiet))
        });
        let frame = stale_ack();
        let mut m = machine.clone();
        group.bench_function(format!("one_input_step/{label}"), |b| {
            b.iter(|| m.handle_frame(quiet, frame.clone()))
        });
    }
    group.finish();
}

fn benches() {
    let mut criterion = Criterion::default().configure_from_args();
    wake(&mut criterion);
}

criterion_main!(benches);
