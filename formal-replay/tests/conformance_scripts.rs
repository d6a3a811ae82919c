//! The checked-in conformance scripts pass against core and against the model, and the
//! `check` command reports failures the way docs/architecture.md §2.2 promises.

use std::path::{Path, PathBuf};
use std::process::Command;

use tether_formal_replay::script::SECTIONS;
use tether_formal_replay::{check_file, check_text, Engine};

fn scripts() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts");
    SECTIONS
        .iter()
        .map(|section| dir.join(format!("{section}.json")))
        .collect()
}

#[test]
fn every_section_has_a_script_of_at_least_fifteen_cases_that_core_and_model_pass() {
    for path in scripts() {
        for engine in [Engine::Core, Engine::Model] {
            let report = check_file(&path, engine).unwrap();
            assert!(
                report.failures.is_empty(),
                "{engine:?}: {:?}",
                report.failures
            );
            assert!(
                report.passed >= 15,
                "{}: {} cases",
                path.display(),
                report.passed
            );
        }
    }
}

#[test]
fn a_wrong_expectation_is_reported_with_its_first_divergence() {
    let text = r#"{"section": "reorder", "cases": [
        {"limit": 2, "arrivals": [1, 0], "steps": [{"hold": true}, {"deliver": [0, 1]}]},
        {"limit": 0, "arrivals": [1], "steps": [{"hold": true}]}
    ]}"#;
    let report = check_text("inline", text, Engine::Core).unwrap();
    assert_eq!(report.passed, 1);
    assert_eq!(
        report.failures,
        ["inline: case 1: steps[0]: expected {\"hold\":true}, got {\"error\":\"overflow\"}"]
    );
}

#[test]
fn an_unknown_section_is_a_clear_error() {
    let error = check_text(
        "x.json",
        r#"{"section": "credits", "cases": []}"#,
        Engine::Core,
    )
    .unwrap_err();
    assert!(error.contains("unknown section \"credits\""), "{error}");
}

fn binary() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tether-formal-replay"))
}

#[test]
fn check_command_passes_the_scripts_and_fails_a_broken_one() {
    let output = binary().arg("check").args(scripts()).output().unwrap();
    assert!(output.status.success());
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(stdout.ends_with(" passed, 0 failed\n"), "{stdout}");

    let broken = std::env::temp_dir().join(format!("tether-broken-{}.json", std::process::id()));
    std::fs::write(
        &broken,
        r#"{"section": "negotiate", "cases": [{"ours": 1, "theirs": 0, "window": 1}]}"#,
    )
    .unwrap();
    let output = binary().arg("check").arg(&broken).output().unwrap();
    std::fs::remove_file(&broken).unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert!(
        lines[0].ends_with("case 0: window: expected 1, got null"),
        "{stdout}"
    );
    assert_eq!(lines[1], "0 passed, 1 failed");
}

#[test]
fn generated_scripts_check_clean_against_core() {
    let dir = std::env::temp_dir().join(format!("tether-generated-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut files = Vec::new();
    for section in SECTIONS {
        let path = dir.join(format!("{section}.json"));
        let status = binary()
            .args([
                "generate",
                "--section",
                section,
                "--seed",
                "11",
                "--cases",
                "40",
                "--out",
            ])
            .arg(&path)
            .status()
            .unwrap();
        assert!(status.success());
        files.push(path);
    }
    let output = binary().arg("check").args(&files).output().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        String::from_utf8(output.stdout).unwrap(),
        format!("{} passed, 0 failed\n", 40 * SECTIONS.len())
    );
}
