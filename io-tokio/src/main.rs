//! The `tether` command.
//!
//! - `tether inspect <actor|telemetry|bifaci|envelope> [FILE]`: decode captured wire bytes
//!   (stdin without FILE) into JSON lines; exit 1 on malformed input.

use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tether::inspect::{inspect, WireFormat};

#[derive(Parser)]
#[command(
    name = "tether",
    version,
    about = "Reliable, authenticated messaging over iroh"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Decode captured wire bytes into one JSON object per line.
    Inspect {
        /// The wire format of the bytes.
        format: WireFormat,
        /// File to read; stdin when absent.
        file: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Inspect { format, file } => run_inspect(format, file),
    }
}

fn run_inspect(format: WireFormat, file: Option<PathBuf>) -> ExitCode {
    let input = match &file {
        Some(path) => std::fs::read(path),
        None => {
            let mut bytes = Vec::new();
            io::stdin().read_to_end(&mut bytes).map(|_| bytes)
        }
    };
    let input = match input {
        Ok(input) => input,
        Err(error) => {
            let source = file.map_or("stdin".into(), |p| p.display().to_string());
            eprintln!("tether inspect: cannot read {source}: {error}");
            return ExitCode::from(2);
        }
    };
    let stdout = io::stdout();
    let mut out = io::BufWriter::new(stdout.lock());
    let verdict = inspect(format, &input, &mut out);
    let flushed = out.flush();
    match (verdict, flushed) {
        (Ok(verdict), Ok(())) if verdict.error.is_none() => ExitCode::SUCCESS,
        (Ok(_), Ok(())) => ExitCode::FAILURE,
        (Err(error), _) | (_, Err(error)) => {
            eprintln!("tether inspect: cannot write output: {error}");
            ExitCode::from(2)
        }
    }
}
