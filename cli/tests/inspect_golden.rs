//! `tether inspect` against every checked-in golden vector: the JSON lines are a stable
//! contract, and malformed vectors end in exactly one error line with exit status 1.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tether::inspect::{inspect, WireFormat};

const FORMATS: [(&str, WireFormat); 4] = [
    ("actor", WireFormat::Actor),
    ("telemetry", WireFormat::Telemetry),
    ("bifaci", WireFormat::Bifaci),
    ("envelope", WireFormat::Envelope),
];

fn golden_dir(format: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../core/tests/golden")
        .join(format)
}

fn golden_bytes(path: &Path) -> Vec<u8> {
    let text = std::fs::read_to_string(path).expect("golden vector readable");
    let digits: String = text
        .lines()
        .map(|line| line.split('#').next().unwrap_or_default())
        .flat_map(|line| line.chars().filter(|c| !c.is_whitespace()))
        .collect();
    hex::decode(digits).expect("golden vector is hex")
}

fn vectors(format: &str) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(golden_dir(format))
        .expect("golden directory exists")
        .map(|entry| entry.expect("readable entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "hex"))
        .collect();
    paths.sort();
    paths
}

#[test]
fn every_golden_vector_inspects_to_its_checked_in_json_lines() {
    let mut checked = 0;
    for (name, format) in FORMATS {
        let paths = vectors(name);
        assert!(paths.len() >= 5, "{name} has valid and malformed vectors");
        for path in paths {
            let mut out = Vec::new();
            let verdict = inspect(format, &golden_bytes(&path), &mut out).expect("in-memory write");
            let expected = std::fs::read_to_string(path.with_extension("jsonl"))
                .unwrap_or_else(|_| panic!("{} has a .jsonl beside it", path.display()));
            assert_eq!(
                String::from_utf8(out).unwrap(),
                expected,
                "{}",
                path.display()
            );
            let malformed = path
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("malformed_");
            assert_eq!(verdict.error.is_some(), malformed, "{}", path.display());
            let last: serde_json::Value =
                serde_json::from_str(expected.lines().last().expect("non-empty")).unwrap();
            assert_eq!(last.get("error").is_some(), malformed, "{}", path.display());
            checked += 1;
        }
    }
    assert!(checked >= 40, "only {checked} vectors");
}

fn tether() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tether"))
}

#[test]
fn the_binary_reads_a_file_and_exits_zero_on_a_valid_capture() {
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("../samples/telemetry.dsq2");
    let output = tether()
        .args(["inspect", "telemetry"])
        .arg(&sample)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).unwrap();
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert!(lines[0].get("header").is_some());
    assert_eq!(
        lines.last().unwrap(),
        &serde_json::json!({ "stream_ended": {} })
    );
}

#[test]
fn the_binary_reads_stdin_and_exits_one_on_malformed_input() {
    let path = golden_dir("bifaci").join("malformed_bad_version.hex");
    let mut child = tether()
        .args(["inspect", "bifaci"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&golden_bytes(&path))
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert_eq!(
        stdout,
        std::fs::read_to_string(path.with_extension("jsonl")).unwrap()
    );
}

#[test]
fn an_unreadable_file_is_a_usage_error_not_a_decode_error() {
    let output = tether()
        .args(["inspect", "actor", "/nonexistent/capture"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(output.stdout.is_empty());
}
