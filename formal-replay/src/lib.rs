//! tether-formal-replay: reference models of tether's request-lifecycle machines, written
//! independently of `tether-core`, model checking of their laws, and step-by-step replay of
//! conformance scripts (`docs/conformance/README.md`) against core.
//!
//! - [`model`]: the reference model, docs/conformance/README.md transcribed for clarity, not
//!   speed. It shares
//!   no code with core.
//! - [`script`]: the script format, parsed strictly (every key required, no extra keys, exact
//!   64-bit integers).
//! - [`replay`]: one case against core or the model, with the first divergence.
//! - [`generate`]: new scripts with the model as the oracle (enumeration plus random walks).
//! - [`explore`]: every op sequence up to a bound, core and model in lockstep, laws checked.
//! - [`switch_model`]: the reference request switch (docs/spec/switch.md), independent of
//!   `tether_core::switch`; [`switch`]: core's switch driven through its harness for the
//!   `switch` section, and the lockstep explorer of the two.
//! - [`peer`]: the `peer` section, core's `substrate::peer::Peer` (load, dials, commits and
//!   their retries) against a model of its rules.
//!
//! The binary `tether-formal-replay` exposes `check`, `generate` and `explore`.

pub mod driver;
pub mod driver_model;
pub mod explore;
pub mod generate;
pub mod model;
pub mod peer;
pub mod replay;
#[allow(missing_docs)] // Every field is the key of that name in docs/conformance/README.md.
pub mod script;
pub mod substrate;
pub mod switch;
pub mod switch_model;

use std::path::Path;

pub use replay::{check_case, Engine, Failure};

/// The outcome of checking one script file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileReport {
    /// Cases that passed.
    pub passed: usize,
    /// One line per failing case: `FILE: case N: <first divergence>`.
    pub failures: Vec<String>,
}

/// Checks every case of the script at `path` against `engine`. A file that cannot be read or
/// parsed, or names an unknown section, is an error (no case of it can be judged).
pub fn check_file(path: &Path, engine: Engine) -> Result<FileReport, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    check_text(&path.display().to_string(), &text, engine)
}

/// Checks the script `text` (named `name` in messages) against `engine`.
pub fn check_text(name: &str, text: &str, engine: Engine) -> Result<FileReport, String> {
    let file: script::ScriptFile =
        serde_json::from_str(text).map_err(|e| format!("{name}: not a script file: {e}"))?;
    let section = replay::known_section(&file.section).map_err(|e| format!("{name}: {e}"))?;
    let mut report = FileReport::default();
    for (index, case) in file.cases.iter().enumerate() {
        match check_case(section, case, engine) {
            Ok(()) => report.passed += 1,
            Err(failure) => report
                .failures
                .push(format!("{name}: case {index}: {failure}")),
        }
    }
    Ok(report)
}
