//! `tether-sim`: run the deterministic simulation for one seed or sweep a range of seeds.

use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use tether_sim::{run, FaultKind, Options, Report};

#[derive(Parser)]
#[command(
    name = "tether-sim",
    about = "Deterministic fault simulation of the tether substrate"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs one seed and prints its report and violations.
    Run {
        /// The seed.
        #[arg(long)]
        seed: u64,
        /// Fault kinds to draw from, comma-separated (default: all; `none` for none).
        #[arg(long)]
        faults: Option<String>,
        /// Print the event trace.
        #[arg(long)]
        trace: bool,
    },
    /// Runs every seed of `A..B`; a sample is run twice to check determinism.
    Sweep {
        /// The range, e.g. `0..200`.
        #[arg(long)]
        seeds: String,
        /// Fault kinds (as for `run`).
        #[arg(long)]
        faults: Option<String>,
        /// Every N-th seed is run twice and must give the same trace hash.
        #[arg(long, default_value_t = 10)]
        twice_every: u64,
    },
}

/// The fault kinds `--faults` names; a usage error is printed and becomes exit code 2.
fn faults(arg: Option<&str>) -> Result<Vec<FaultKind>, ExitCode> {
    let kinds = match arg {
        None => Ok(FaultKind::ALL.to_vec()),
        Some("none") => Ok(Vec::new()),
        Some(list) => list.split(',').map(str::parse).collect(),
    };
    kinds.map_err(|error: String| {
        eprintln!("{error}");
        ExitCode::from(2)
    })
}

fn reproduce(seed: u64, arg: Option<&str>) -> String {
    match arg {
        Some(list) => {
            format!("cargo run --release -p tether-sim -- run --seed {seed} --faults {list}")
        }
        None => format!("cargo run --release -p tether-sim -- run --seed {seed}"),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Run {
            seed,
            faults: arg,
            trace,
        } => {
            let kinds = match faults(arg.as_deref()) {
                Ok(kinds) => kinds,
                Err(code) => return code,
            };
            let report = run(&Options {
                seed,
                faults: kinds,
                sabotage: None,
            });
            if trace {
                for line in &report.trace {
                    println!("{line}");
                }
            }
            println!("{report}");
            for violation in &report.violations {
                println!("  violation: {violation}");
            }
            if report.passed() {
                ExitCode::SUCCESS
            } else {
                println!("reproduce: {}", reproduce(seed, arg.as_deref()));
                ExitCode::FAILURE
            }
        }
        Command::Sweep {
            seeds,
            faults: arg,
            twice_every,
        } => {
            let kinds = match faults(arg.as_deref()) {
                Ok(kinds) => kinds,
                Err(code) => return code,
            };
            let Some((a, b)) = seeds
                .split_once("..")
                .and_then(|(a, b)| Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?)))
            else {
                eprintln!("--seeds takes A..B");
                return ExitCode::from(2);
            };
            sweep(a, b, &kinds, arg.as_deref(), twice_every.max(1))
        }
    }
}

fn sweep(a: u64, b: u64, kinds: &[FaultKind], arg: Option<&str>, twice_every: u64) -> ExitCode {
    let started = Instant::now();
    let mut reports: Vec<Report> = Vec::new();
    let mut failures = Vec::new();
    let mut rerun = 0;
    for seed in a..b {
        let report = run(&Options {
            seed,
            faults: kinds.to_vec(),
            sabotage: None,
        });
        if seed % twice_every == 0 {
            rerun += 1;
            let again = run(&Options {
                seed,
                faults: kinds.to_vec(),
                sabotage: None,
            });
            if again.trace_hash != report.trace_hash {
                failures.push(format!(
                    "seed {seed}: not deterministic ({} then {})",
                    &report.trace_hash[..16],
                    &again.trace_hash[..16]
                ));
            }
        }
        if !report.passed() {
            failures.push(format!(
                "seed {seed}: {}\n    reproduce: {}",
                report.violations.join("; "),
                reproduce(seed, arg)
            ));
        }
        reports.push(report);
    }
    let simulated: f64 = reports.iter().map(|r| r.simulated.as_secs_f64()).sum();
    let messages: u64 = reports.iter().map(|r| r.messages).sum();
    let mut by_kind = std::collections::BTreeMap::new();
    for report in &reports {
        for (kind, n) in &report.faults {
            *by_kind.entry(*kind).or_insert(0u64) += u64::from(*n);
        }
    }
    let wall = started.elapsed().as_secs_f64();
    println!(
        "| seeds | simulated hours | messages | faults injected | determinism reruns | verdict |"
    );
    println!("|---|---:|---:|---|---:|---|");
    let faults: Vec<String> = by_kind
        .iter()
        .map(|(k, n)| format!("{} {n}", k.name()))
        .collect();
    println!(
        "| {a}..{b} ({}) | {:.2} | {messages} | {} | {rerun} | {} |",
        b - a,
        simulated / 3600.0,
        faults.join(", "),
        if failures.is_empty() {
            "all checkers passed"
        } else {
            "FAILED"
        }
    );
    println!(
        "wall {wall:.1}s, {:.0} simulated seconds per wall second",
        simulated / wall.max(1e-9)
    );
    for failure in &failures {
        println!("{failure}");
    }
    if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
