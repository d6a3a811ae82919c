//! `tether demo` end to end with small counts: real node processes, B killed with SIGKILL and
//! restarted, the link cut; the JSON summary must show every message delivered once and in
//! order, every request and routed request answered, telemetry from B, and the exit code
//! must say the invariants held.

/// Runs `tether demo <args> --json --quiet` in a fresh directory named after `tag`; asserts
/// it exited 0 and returns its JSON summary.
fn demo(tag: &str, args: &[&str]) -> serde_json::Value {
    let dir = std::env::temp_dir().join(format!("tether-{tag}-{}", std::process::id()));
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tether-under-test"))
        .arg("demo")
        .args(args)
        .args(["--json", "--quiet", "--dir"])
        .arg(&dir)
        .output()
        .expect("the demo runs");
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let summary: serde_json::Value = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .unwrap_or_else(|| panic!("no JSON summary in {stdout:?}"));
    assert!(
        output.status.success(),
        "exit {:?}: {summary:#}",
        output.status
    );
    summary
}

#[test]
fn the_demo_with_small_counts_reports_every_invariant_held() {
    let summary = demo(
        "demo-test",
        &[
            "--messages",
            "1500",
            "--queues",
            "3",
            "--requests",
            "30",
            "--routes",
            "40",
            "--kills",
            "2",
        ],
    );
    let count = |key: &str| summary[key].as_u64().unwrap_or_else(|| panic!("{key}"));
    assert_eq!(count("sent"), 1500);
    assert_eq!(count("delivered"), 1500);
    for broken in [
        "duplicates",
        "lost",
        "acked_but_lost",
        "reordered",
        "wrong_replies",
    ] {
        assert_eq!(count(broken), 0, "{broken}: {summary:#}");
    }
    assert_eq!(count("requests"), 30);
    assert_eq!(count("replies"), 30);
    assert_eq!(count("routed"), 40);
    assert_eq!(count("routes_answered"), 40);
    assert_eq!(count("wrong_routes"), 0);
    assert_eq!(count("kills"), 2);
    assert_eq!(count("disconnects"), 1);
    assert!(count("telemetry_events") > 0, "{summary:#}");
    assert!(count("telemetry_streams") >= 1, "{summary:#}");
    assert!(summary["failures"].as_array().is_some_and(Vec::is_empty));
}

/// `tether demo --nodes 8 --relay`: eight node processes homed on iroh's relay server (a
/// `tether relay` process), each sending over a queue to each of its next three, three nodes
/// killed with SIGKILL and restarted (senders and receivers alike), two links cut; every pair's row and the totals must show nothing acknowledged lost, nothing
/// duplicated, nothing reordered, and the exit code must say so.
#[test]
fn the_demo_with_eight_nodes_reports_every_pair_and_every_invariant_held() {
    let summary = demo(
        "demo-many",
        &[
            "--nodes",
            "8",
            "--messages",
            "2400",
            "--kills",
            "3",
            "--relay",
        ],
    );
    let count = |key: &str| summary[key].as_u64().unwrap_or_else(|| panic!("{key}"));
    assert_eq!(count("nodes"), 8);
    let pairs = summary["pairs"].as_array().expect("a row per pair");
    assert_eq!(pairs.len(), 24, "each of 8 nodes sends to its next 3");
    assert_eq!(count("written"), 2400);
    assert_eq!(count("kills"), 3);
    assert_eq!(count("disconnects"), 2);
    for broken in ["duplicates", "acked_but_lost", "reordered"] {
        assert_eq!(count(broken), 0, "{broken}: {summary:#}");
    }
    for pair in pairs {
        assert!(
            pair["delivered"].as_u64().unwrap_or(0) > 0 && pair["acked"].as_u64().unwrap_or(0) > 0,
            "every pair carried traffic: {pair}"
        );
    }
    assert!(summary["failures"].as_array().is_some_and(Vec::is_empty));
}
