//! `tether cap match` and `tether cap rank`: the JSON a user debugging routing reads, and the
//! typed error (kind and byte offset) with exit status 1 for a cap that does not parse.

use std::process::Command;

fn tether(args: &[&str]) -> (serde_json::Value, i32) {
    let output = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(args)
        .output()
        .expect("tether runs");
    let stdout = String::from_utf8(output.stdout).expect("UTF-8");
    let json = serde_json::from_str(stdout.trim()).expect("one JSON object");
    (json, output.status.code().expect("exited"))
}

const UPPER: &str = "cap:in=media:text;out=media:upper";

#[test]
fn match_says_whether_a_candidate_may_serve_a_request() {
    assert_eq!(
        tether(&["cap", "match", UPPER, UPPER]),
        (serde_json::json!({ "dispatchable": true }), 0)
    );
    // Input is contravariant: a handler of any input serves a text request.
    assert_eq!(
        tether(&["cap", "match", "cap:in=media:;out=media:upper", UPPER]),
        (serde_json::json!({ "dispatchable": true }), 0)
    );
    // Output is covariant: a handler promising only `media:` does not serve a specific output.
    assert_eq!(
        tether(&["cap", "match", "cap:in=media:text;out=media:", UPPER]),
        (serde_json::json!({ "dispatchable": false }), 0)
    );
}

#[test]
fn rank_lists_the_dispatchable_caps_best_first_in_canonical_form() {
    let generic = "cap:in=media:;out=media:upper";
    let other = "cap:in=media:pdf;out=media:text";
    let (json, code) = tether(&["cap", "rank", UPPER, generic, other, UPPER]);
    assert_eq!(code, 0);
    let ranked: Vec<String> = serde_json::from_value(json["ranked"].clone()).expect("a list");
    assert_eq!(ranked.len(), 2, "the pdf cap cannot serve: {ranked:?}");
    assert!(
        ranked[0].contains("media:text"),
        "the exact cap first: {ranked:?}"
    );
}

#[test]
fn a_cap_that_does_not_parse_is_a_typed_error_with_its_offset() {
    let (json, code) = tether(&["cap", "match", "nonsense", UPPER]);
    assert_eq!(code, 1);
    assert!(json["error"].is_string(), "{json}");
    assert_eq!(json["offset"], 0, "{json}");
    assert_eq!(json.as_object().expect("object").len(), 2, "{json}");
}
