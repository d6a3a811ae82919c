//! A deterministic workload of core alone, for instruction counts: two in-memory substrate
//! machines (core's harness, every persist acknowledged at once) move `--ops` sends of 1 KiB
//! over 16 queues at window 32, enqueued 800 at a time. Nothing in it reads a clock or the
//! network, so the same binary runs the same instructions to within 0.01% (two runs of
//! 807.6M differed by 12k): on a machine whose timings cannot separate 1–3%, judge a change
//! to core by `valgrind --tool=callgrind target/release/tether-core-cost` before and after.

use bytes::Bytes;
use tether_core::substrate::harness::Party;
use tether_core::substrate::Config;

/// Sends enqueued between two runs of the harness (an app's burst).
const BURST: usize = 800;
const OBJECTS: usize = 16;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let ops = tether_benches::arg(&args, "--ops", 20_000);
    let config = Config {
        in_flight_max: 32,
        outbox_ops_max: ops.max(BURST),
        ..Config::default()
    };
    let mut h = tether_benches::harness_with_queues(config, OBJECTS, std::time::Duration::ZERO);
    let body = Bytes::from(vec![7u8; 1024]);
    for round in 0..ops.div_ceil(BURST) {
        for op in round * BURST..ops.min((round + 1) * BURST) {
            let name = format!("q{}", op % OBJECTS);
            h.with(Party::A, |m, now| m.send(now, &name, body.clone()))
                .expect("room for the burst");
        }
        h.run();
    }
    assert_eq!(h.b.consumed.len(), ops, "every send consumed once");
    println!("{ops} sends over {OBJECTS} queues consumed");
}
