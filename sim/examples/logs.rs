//! Runs the given seeds one after another in one process (all fault kinds) and writes the
//! shells' debug logs of the last one, stamped with simulated microseconds, to the file named
//! by `TETHER_SIM_LOG` (default `sim.log`): `cargo run --release -p tether-sim --example logs
//! -- 1439 1439 1440`. Diffing two such logs shows where two runs of one seed part.

struct SimTime;

impl tracing_subscriber::fmt::time::FormatTime for SimTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        match turmoil::sim_elapsed() {
            Some(elapsed) => write!(w, "{:>12}", elapsed.as_micros()),
            None => write!(w, "{:>12}", "-"),
        }
    }
}

fn main() {
    let seeds: Vec<u64> = std::env::args()
        .skip(1)
        .map(|arg| arg.parse().expect("seeds are integers"))
        .collect();
    let Some((&last, before)) = seeds.split_last() else {
        eprintln!("usage: logs SEED [SEED ...]");
        std::process::exit(2);
    };
    let options = |seed| tether_sim::Options {
        seed,
        faults: tether_sim::FaultKind::ALL.to_vec(),
        sabotage: None,
    };
    for &seed in before {
        let report = tether_sim::run(&options(seed));
        eprintln!("{seed}: trace {}", &report.trace_hash[..16]);
    }
    let path = std::env::var("TETHER_SIM_LOG").unwrap_or_else(|_| "sim.log".to_owned());
    let file = std::fs::File::create(&path).expect("log file");
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(if std::env::var_os("TETHER_SIM_TRACE").is_some() {
            tracing::Level::TRACE
        } else {
            tracing::Level::DEBUG
        })
        .with_timer(SimTime)
        .with_ansi(false)
        .with_writer(std::sync::Mutex::new(file))
        .finish();
    let report = tracing::subscriber::with_default(subscriber, || tether_sim::run(&options(last)));
    eprintln!("{last}: trace {} (log in {path})", &report.trace_hash[..16]);
}
