//! Runs the given seeds one after another in one process (all fault kinds) and prints each
//! trace hash: `cargo run --release -p tether-sim --example in_process -- 1439 1439 1440`.
//! A seed whose hash here differs from `tether-sim run --seed N` depends on process history.

fn main() {
    let seeds: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    for seed in seeds {
        let options = tether_sim::Options {
            seed,
            faults: tether_sim::FaultKind::ALL.to_vec(),
            sabotage: None,
        };
        let report = tether_sim::run(&options);
        eprint!("{seed}:{} ", &report.trace_hash[..8]);
    }
    eprintln!();
}
