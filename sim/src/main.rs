//! `tether-sim`: run the deterministic simulation for one seed or sweep a range of seeds.

use std::collections::BTreeMap;
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
        /// Runs the range in N child processes at once (one simulation per process).
        #[arg(long, default_value_t = 1)]
        jobs: u64,
        /// Prints one JSON summary line instead of the table (what `--jobs` children print).
        #[arg(long, hide = true)]
        json: bool,
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
            jobs,
            json,
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
            let twice_every = twice_every.max(1);
            let started = Instant::now();
            let summary = if jobs > 1 {
                match parallel(a, b, jobs, arg.as_deref(), twice_every) {
                    Ok(summary) => summary,
                    Err(error) => {
                        eprintln!("{error}");
                        return ExitCode::from(2);
                    }
                }
            } else {
                sweep(a, b, &kinds, arg.as_deref(), twice_every)
            };
            if json {
                println!("{}", serde_json::to_string(&summary).expect("plain data"));
            } else {
                summary.print(a, b, started.elapsed().as_secs_f64());
            }
            if summary.failures.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// What a sweep (or one `--jobs` child's part of it) adds up to.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Summary {
    seeds: u64,
    simulated_secs: f64,
    messages: u64,
    faults: BTreeMap<String, u64>,
    exercised: BTreeMap<String, u64>,
    reruns: u64,
    failures: Vec<String>,
}

impl Summary {
    fn add(&mut self, other: Summary) {
        self.seeds += other.seeds;
        self.simulated_secs += other.simulated_secs;
        self.messages += other.messages;
        for (k, n) in other.faults {
            *self.faults.entry(k).or_default() += n;
        }
        for (k, n) in other.exercised {
            *self.exercised.entry(k).or_default() += n;
        }
        self.reruns += other.reruns;
        self.failures.extend(other.failures);
    }

    fn print(&self, a: u64, b: u64, wall: f64) {
        println!(
            "| seeds | simulated hours | messages | faults injected | determinism reruns | verdict |"
        );
        println!("|---|---:|---:|---|---:|---|");
        let faults: Vec<String> = self
            .faults
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        println!(
            "| {a}..{b} ({}) | {:.2} | {} | {} | {} | {} |",
            self.seeds,
            self.simulated_secs / 3600.0,
            self.messages,
            faults.join(", "),
            self.reruns,
            if self.failures.is_empty() {
                "all checkers passed"
            } else {
                "FAILED"
            }
        );
        let exercised: Vec<String> = self
            .exercised
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        println!("exercised: {}", exercised.join(", "));
        println!(
            "wall {wall:.1}s, {:.0} simulated seconds per wall second",
            self.simulated_secs / wall.max(1e-9)
        );
        for failure in &self.failures {
            println!("{failure}");
        }
    }
}

/// Splits `a..b` over `jobs` child processes of this binary and adds up their summaries.
fn parallel(
    a: u64,
    b: u64,
    jobs: u64,
    arg: Option<&str>,
    twice_every: u64,
) -> Result<Summary, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    let chunk = (b - a).div_ceil(jobs).max(1);
    let mut children = Vec::new();
    let mut start = a;
    while start < b {
        let end = (start + chunk).min(b);
        let mut command = std::process::Command::new(&exe);
        command.args(["sweep", "--seeds", &format!("{start}..{end}"), "--json"]);
        command.args(["--twice-every", &twice_every.to_string()]);
        if let Some(list) = arg {
            command.args(["--faults", list]);
        }
        command.stdout(std::process::Stdio::piped());
        children.push(
            command
                .spawn()
                .map_err(|e| format!("cannot start a job: {e}"))?,
        );
        start = end;
    }
    let mut total = Summary::default();
    for child in children {
        let output = child
            .wait_with_output()
            .map_err(|e| format!("a job failed: {e}"))?;
        let text = String::from_utf8_lossy(&output.stdout);
        let line = text.lines().last().unwrap_or_default();
        let part: Summary =
            serde_json::from_str(line).map_err(|e| format!("a job printed no summary: {e}"))?;
        total.add(part);
    }
    Ok(total)
}

fn sweep(a: u64, b: u64, kinds: &[FaultKind], arg: Option<&str>, twice_every: u64) -> Summary {
    let mut summary = Summary::default();
    for seed in a..b {
        let report = run(&Options {
            seed,
            faults: kinds.to_vec(),
            sabotage: None,
        });
        if seed % twice_every == 0 {
            summary.reruns += 1;
            let again = run(&Options {
                seed,
                faults: kinds.to_vec(),
                sabotage: None,
            });
            if again.trace_hash != report.trace_hash {
                summary.failures.push(format!(
                    "seed {seed}: not deterministic ({} then {})",
                    &report.trace_hash[..16],
                    &again.trace_hash[..16]
                ));
            }
        }
        if !report.passed() {
            summary.failures.push(format!(
                "seed {seed}: {}\n    reproduce: {}",
                report.violations.join("; "),
                reproduce(seed, arg)
            ));
        }
        summary.add(part_of(&report));
    }
    summary
}

/// One run as a summary.
fn part_of(report: &Report) -> Summary {
    Summary {
        seeds: 1,
        simulated_secs: report.simulated.as_secs_f64(),
        messages: report.messages,
        faults: report
            .faults
            .iter()
            .map(|(kind, n)| (kind.name().to_owned(), u64::from(*n)))
            .collect(),
        exercised: report
            .exercised
            .iter()
            .map(|(k, n)| ((*k).to_owned(), *n))
            .collect(),
        reruns: 0,
        failures: Vec::new(),
    }
}
