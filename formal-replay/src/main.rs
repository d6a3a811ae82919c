//! `tether-formal-replay`: conformance scripts and model checking for tether's request
//! lifecycle.
//!
//! - `check FILE...` replays every case against core; one line per failing case with its first
//!   divergence, then `N passed, M failed`; exit 0 iff nothing failed.
//! - `generate --section S --seed N --cases K [--out FILE]` writes a script with the model as
//!   the oracle.
//! - `explore [--quick]` checks the laws over every op sequence up to a bound and prints the
//!   sequences and distinct states explored.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use tether_formal_replay::explore::{explore_all, Bounds};
use tether_formal_replay::generate::generate;
use tether_formal_replay::{check_file, substrate, switch, Engine};

#[derive(Parser)]
#[command(name = "tether-formal-replay", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay conformance scripts against tether-core.
    Check {
        /// Script files (format and semantics: docs/conformance/README.md).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Replay against the reference model instead of core.
        #[arg(long)]
        model: bool,
    },
    /// Write a new script, the reference model filling in every observation.
    Generate {
        /// Section name: frame_types, ledger, negotiate, grant_target, gate, window, reorder,
        /// writer, table, emission, substrate, driver, join, routing or switch.
        #[arg(long)]
        section: String,
        /// Seed of the random walks and offset of the enumeration.
        #[arg(long)]
        seed: u64,
        /// Number of cases.
        #[arg(long)]
        cases: usize,
        /// Output file (stdout when absent).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Rewrite every observation of a script with the reference model, keeping its inputs:
    /// for a section whose document changed on purpose (review the diff; `check` then
    /// compares core against the refilled cases).
    Refill {
        /// The script to rewrite in place.
        file: PathBuf,
    },
    /// Model-check the laws over every op sequence up to a bound.
    Explore {
        /// Smaller bounds (seconds instead of minutes in a debug build).
        #[arg(long)]
        quick: bool,
        /// Overrides the depth of the substrate scopes.
        #[arg(long)]
        substrate_depth: Option<usize>,
        /// Overrides the depth of the switch scope.
        #[arg(long)]
        switch_depth: Option<usize>,
    },
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Check { files, model } => {
            let engine = if model { Engine::Model } else { Engine::Core };
            let (mut passed, mut failed) = (0, 0);
            for file in files {
                match check_file(&file, engine) {
                    Ok(report) => {
                        passed += report.passed;
                        failed += report.failures.len();
                        for line in report.failures {
                            println!("{line}");
                        }
                    }
                    Err(error) => {
                        println!("{error}");
                        failed += 1;
                    }
                }
            }
            println!("{passed} passed, {failed} failed");
            if failed == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Command::Generate {
            section,
            seed,
            cases,
            out,
        } => {
            let script = match generate(&section, seed, cases) {
                Ok(script) => script,
                Err(error) => {
                    eprintln!("{error}");
                    return ExitCode::from(2);
                }
            };
            let text = render(&script);
            let written = match out {
                Some(path) => {
                    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))
                }
                None => {
                    print!("{text}");
                    Ok(())
                }
            };
            match written {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("{error}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Refill { file } => match refill(&file) {
            Ok(cases) => {
                println!("{}: {cases} cases refilled", file.display());
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("{error}");
                ExitCode::from(2)
            }
        },
        Command::Explore {
            quick,
            substrate_depth,
            switch_depth,
        } => {
            let bounds = if quick { Bounds::QUICK } else { Bounds::FULL };
            let scopes: &[substrate::Scope] = if quick {
                &[substrate::Scope::QUICK]
            } else {
                &substrate::Scope::FULL
            };
            let switch_scope = if quick {
                switch::Scope::QUICK
            } else {
                switch::Scope::FULL
            };
            let switch_scope = switch::Scope {
                depth: switch_depth.unwrap_or(switch_scope.depth),
                ..switch_scope
            };
            // Each substrate scope on a thread of its own (the largest runs take minutes),
            // beside the request table and the switch on this one; printed in a fixed order.
            let (request, substrate, switch) = std::thread::scope(|threads| {
                let substrate: Vec<_> = scopes
                    .iter()
                    .map(|scope| {
                        let depth = substrate_depth.unwrap_or(scope.depth);
                        let scope = substrate::Scope { depth, ..*scope };
                        threads.spawn(move || {
                            substrate::explore(scope).map(|report| vec![report.to_string()])
                        })
                    })
                    .collect();
                let request = explore_all(bounds)
                    .map(|reports| reports.iter().map(ToString::to_string).collect::<Vec<_>>());
                let switch = switch::explore(switch_scope).map(|report| vec![report.to_string()]);
                let substrate: Vec<_> = substrate
                    .into_iter()
                    .map(|thread| thread.join().expect("an explore thread panicked"))
                    .collect();
                (request, substrate, switch)
            });
            let mut failed = false;
            for result in std::iter::once(request)
                .chain(substrate)
                .chain(std::iter::once(switch))
            {
                match result {
                    Ok(lines) => lines.iter().for_each(|line| println!("{line}")),
                    Err(error) => {
                        println!("law violated: {error}");
                        failed = true;
                    }
                }
            }
            if failed {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
    }
}

/// Reads `file`, completes each case with the model from its inputs, writes it back.
fn refill(file: &std::path::Path) -> Result<usize, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let mut script: tether_formal_replay::script::ScriptFile =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?;
    for (index, case) in script.cases.iter_mut().enumerate() {
        *case = tether_formal_replay::replay::complete_with_model(&script.section, case)
            .map_err(|failure| format!("case {index}: {failure}"))?;
    }
    std::fs::write(file, render(&script)).map_err(|e| format!("{}: {e}", file.display()))?;
    Ok(script.cases.len())
}

/// One case per line, so scripts diff well.
fn render(script: &tether_formal_replay::script::ScriptFile) -> String {
    let mut text = format!(
        "{{\"section\": {}, \"cases\": [\n",
        serde_json::Value::from(script.section.clone())
    );
    for (index, case) in script.cases.iter().enumerate() {
        let separator = if index + 1 == script.cases.len() {
            ""
        } else {
            ","
        };
        text.push_str(&format!("  {case}{separator}\n"));
    }
    text.push_str("]}\n");
    text
}
