//! Tests of the reference driver model (`driver_model.rs`).

use super::*;
use serde_json::json;

/// Parses `case` (expected steps and end written by hand from the document), runs the
/// model, and reports the first divergence.
fn check(mut case: serde_json::Value) {
    // Cases that predate claims, telemetry, the opens' tickets and relay hints leave those
    // `end` keys out: they are empty.
    if let Some(end) = case
        .get_mut("end")
        .and_then(serde_json::Value::as_object_mut)
    {
        end.entry("claims").or_insert_with(|| json!([]));
        end.entry("subscriptions").or_insert_with(|| json!([]));
        end.entry("controls").or_insert_with(|| json!({}));
        end.entry("opening").or_insert_with(|| json!([]));
        end.entry("failed_opens").or_insert_with(|| json!([]));
        end.entry("relays").or_insert_with(|| json!([]));
    }
    let case: DriverCase = serde_json::from_value(case).expect("the hand case parses");
    let got = run_case(&case).expect("the hand case is well formed");
    for (index, (want, got)) in case.steps.iter().zip(&got.steps).enumerate() {
        assert_eq!(
            want, got,
            "step {index} ({:?}) differs: want {want:?}, got {got:?}",
            case.ops[index]
        );
    }
    assert_eq!(case.end, got.end, "end differs");
    assert_eq!(case, got);
}

fn step(
    result: serde_json::Value,
    actions: &[&str],
    timeout: serde_json::Value,
) -> serde_json::Value {
    json!({"result": result, "actions": actions, "timeout": timeout})
}

fn counters(
    accepted: u64,
    dials_started: u64,
    dial_failures: u64,
    evictions: u64,
    stale_failures: u64,
    writers_retired: u64,
) -> serde_json::Value {
    json!({"accepted": accepted, "dials_started": dials_started,
               "dial_failures": dial_failures, "evictions": evictions,
               "stale_failures": stale_failures, "writers_retired": writers_retired})
}

const N: serde_json::Value = serde_json::Value::Null;

/// accept on every ALPN with no allow-list; a second actor accept replaces the entry (and
/// closes the one it replaced, both inbound) without counting as a new pair; a seventh
/// pair (peer 251, whose validity accept does not check) finds 6 inbound entries: full.
#[test]
fn accept_every_alpn_without_allow_list() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "accept", "at": 0, "peer": 1, "alpn": "a", "conn": 10},
            {"op": "accept", "at": 1, "peer": 1, "alpn": "t", "conn": 11},
            {"op": "accept", "at": 2, "peer": 2, "alpn": "p0", "conn": 12},
            {"op": "accept", "at": 3, "peer": 2, "alpn": "p1", "conn": 13},
            {"op": "accept", "at": 4, "peer": 3, "alpn": "s", "conn": 14},
            {"op": "accept", "at": 5, "peer": 3, "alpn": "u", "conn": 15},
            {"op": "accept", "at": 6, "peer": 3, "alpn": "zz", "conn": 16},
            {"op": "accept", "at": 7, "peer": 1, "alpn": "a", "conn": 17},
            {"op": "accept", "at": 8, "peer": 251, "alpn": "a", "conn": 18},
            {"op": "accept", "at": 9, "peer": 3, "alpn": "", "conn": 19}
        ],
        "steps": [
            step(json!("actor:1"), &[], N),
            step(json!("telemetry:2"), &[], N),
            step(json!("protocol:0:3"), &[], N),
            step(json!("protocol:1:4"), &[], N),
            step(json!("switch:5"), &[], N),
            step(json!("substrate:6"), &[], N),
            step(json!("no_adapter"), &[], N),
            step(json!("actor:7"), &["close:10:409"], N),
            step(json!("full"), &[], N),
            step(json!("no_adapter"), &[], N)
        ],
        "end": {
            "drops": {},
            "refusals": {},
            "counters": {"accepted": 9, "dials_started": 0, "dial_failures": 0,
                         "evictions": 0, "stale_failures": 0, "writers_retired": 0,
                         "refused_full": 1},
            "cache": [[1, "actor", 7], [1, "telemetry", 2], [2, "protocol:0", 3],
                      [2, "protocol:1", 4], [3, "switch", 5], [3, "substrate", 6]],
            "joins": {}
        }
    }));
}

/// accept on every ALPN from a peer off the allow-list (one refusal per path), then from
/// a listed peer; the `admit` op.
#[test]
fn accept_every_alpn_with_allow_list() {
    check(json!({
        "allow": [1],
        "ops": [
            {"op": "accept", "at": 0, "peer": 2, "alpn": "a", "conn": 1},
            {"op": "accept", "at": 0, "peer": 2, "alpn": "t", "conn": 2},
            {"op": "accept", "at": 0, "peer": 2, "alpn": "p0", "conn": 3},
            {"op": "accept", "at": 0, "peer": 2, "alpn": "p1", "conn": 4},
            {"op": "accept", "at": 0, "peer": 2, "alpn": "s", "conn": 5},
            {"op": "accept", "at": 0, "peer": 2, "alpn": "u", "conn": 6},
            {"op": "accept", "at": 0, "peer": 2, "alpn": "x", "conn": 7},
            {"op": "accept", "at": 1, "peer": 1, "alpn": "a", "conn": 8},
            {"op": "accept", "at": 1, "peer": 1, "alpn": "p1", "conn": 9},
            {"op": "accept", "at": 1, "peer": 1, "alpn": "s", "conn": 10},
            {"op": "accept", "at": 1, "peer": 1, "alpn": "q", "conn": 11},
            {"op": "admit", "at": 2, "peer": 2, "path": "join", "direction": "outbound"},
            {"op": "admit", "at": 2, "peer": 1, "path": "telemetry", "direction": "outbound"},
            {"op": "admit", "at": 2, "peer": 0, "path": "unknown", "direction": "inbound"}
        ],
        "steps": [
            step(json!("refused"), &[], N),
            step(json!("refused"), &[], N),
            step(json!("refused"), &[], N),
            step(json!("refused"), &[], N),
            step(json!("refused"), &[], N),
            step(json!("refused"), &[], N),
            step(json!("refused"), &[], N),
            step(json!("actor:1"), &[], N),
            step(json!("protocol:1:2"), &[], N),
            step(json!("switch:3"), &[], N),
            step(json!("no_adapter"), &[], N),
            step(json!("refused"), &[], N),
            step(json!("ok"), &[], N),
            step(json!("refused"), &[], N)
        ],
        "end": {
            "drops": {},
            "refusals": {"actor/inbound": 1, "telemetry/inbound": 1,
                         "protocol/inbound": 2, "switch/inbound": 1,
                         "substrate/inbound": 1, "unknown/inbound": 2,
                         "join/outbound": 1},
            "counters": counters(4, 0, 0, 0, 0, 0),
            "cache": [[1, "actor", 1], [1, "protocol:1", 2], [1, "switch", 3]],
            "joins": {}
        }
    }));
}

/// send: unauthorized, hit, invalid peer (≥ 250, admitted by the list), miss with a dial,
/// miss while the dial is in flight, hit after the dial connects; close queues a close
/// per cache entry in cache order; send after close.
#[test]
fn send_hit_miss_unauthorized_invalid_and_close() {
    check(json!({
        "allow": [1, 2, 251],
        "ops": [
            {"op": "send", "at": 0, "peer": 3},
            {"op": "accept", "at": 0, "peer": 1, "alpn": "a", "conn": 7},
            {"op": "send", "at": 1, "peer": 1},
            {"op": "send", "at": 2, "peer": 251},
            {"op": "send", "at": 3, "peer": 2},
            {"op": "send", "at": 4, "peer": 2},
            {"op": "dialed", "at": 5, "peer": 2, "conn": 20},
            {"op": "send", "at": 6, "peer": 2},
            {"op": "close", "at": 7},
            {"op": "send", "at": 8, "peer": 1},
            {"op": "send", "at": 9, "peer": 3}
        ],
        "steps": [
            step(json!("drop:unauthorized"), &[], N),
            step(json!("actor:1"), &[], N),
            step(json!("enqueue"), &[], N),
            step(json!("drop:invalid_node_id"), &[], N),
            step(json!("drop:cache_miss"), &["dial:2:1"], N),
            step(json!("drop:cache_miss"), &[], N),
            step(json!("gen:2"), &[], N),
            step(json!("enqueue"), &[], N),
            step(N, &["close:7:0", "close:20:0"], N),
            step(json!("drop:cache_miss"), &[], N),
            step(json!("drop:unauthorized"), &[], N)
        ],
        "end": {
            "drops": {"unauthorized": 2, "invalid_node_id": 1, "cache_miss": 3},
            "refusals": {"actor/outbound": 2},
            "counters": counters(1, 1, 0, 0, 0, 0),
            "cache": [],
            "joins": {}
        }
    }));
}

/// A dial fails three times: waits 200 ms then 600 ms, walked by `timeout` ops (one too
/// early), then ends; a late failure only counts; a new send starts a fresh dial.
#[test]
fn dial_failures_walk_the_schedule() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "send", "at": 0, "peer": 250},
            {"op": "send", "at": 100, "peer": 5},
            {"op": "dialed", "at": 1000, "peer": 5, "conn": null},
            {"op": "send", "at": 1100, "peer": 5},
            {"op": "timeout", "at": 1199},
            {"op": "timeout", "at": 1200},
            {"op": "dialed", "at": 3000, "peer": 5, "conn": null},
            {"op": "timeout", "at": 4000},
            {"op": "dialed", "at": 5000, "peer": 5, "conn": null},
            {"op": "dialed", "at": 5001, "peer": 5, "conn": null},
            {"op": "send", "at": 6000, "peer": 5},
            {"op": "dialed", "at": 6001, "peer": 5, "conn": 9}
        ],
        "steps": [
            step(json!("drop:invalid_node_id"), &[], N),
            step(json!("drop:cache_miss"), &["dial:5:1"], N),
            step(N, &[], json!(1200)),
            step(json!("drop:cache_miss"), &[], json!(1200)),
            step(N, &[], json!(1200)),
            step(N, &["dial:5:2"], N),
            step(N, &[], json!(3600)),
            step(N, &["dial:5:3"], N),
            step(N, &[], N),
            step(N, &[], N),
            step(json!("drop:cache_miss"), &["dial:5:1"], N),
            step(json!("gen:1"), &[], N)
        ],
        "end": {
            "drops": {"invalid_node_id": 1, "cache_miss": 3},
            "refusals": {},
            "counters": counters(0, 2, 4, 0, 0, 0),
            "cache": [[5, "actor", 1]],
            "joins": {}
        }
    }));
}

/// write_failed of a stale generation (no eviction, swim feedback) and of the current one
/// (eviction and redial); a batch during the redial drops; the redial kicks the busy
/// writer; evicting an invalid peer's connection dials nothing.
#[test]
fn write_failed_current_and_stale() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "connected", "at": 0, "peer": 1, "channel": "actor", "conn": 100},
            {"op": "batch", "at": 0, "peer": 1, "frames": 3},
            {"op": "connected", "at": 1, "peer": 1, "channel": "actor", "conn": 101},
            {"op": "write_failed", "at": 2, "peer": 1, "generation": 1, "frames": 3,
             "swim": true},
            {"op": "write_failed", "at": 3, "peer": 1, "generation": 2, "frames": 2,
             "swim": false},
            {"op": "write_failed", "at": 4, "peer": 1, "generation": 2, "frames": 0,
             "swim": true},
            {"op": "batch", "at": 5, "peer": 1, "frames": 4},
            {"op": "dialed", "at": 6, "peer": 1, "conn": 102},
            {"op": "batch", "at": 7, "peer": 1, "frames": 1},
            {"op": "accept", "at": 8, "peer": 252, "alpn": "a", "conn": 200},
            {"op": "write_failed", "at": 9, "peer": 252, "generation": 4, "frames": 1,
             "swim": false}
        ],
        "steps": [
            step(json!("gen:1"), &[], N),
            step(json!("write:1:100"), &[], N),
            step(json!("gen:2"), &["close:100:409", "kick:1"], N),
            step(N, &["send_failed:1"], N),
            step(N, &["dial:1:1"], N),
            step(N, &["send_failed:1"], N),
            step(json!("drop"), &[], N),
            step(json!("gen:3"), &["kick:1"], N),
            step(json!("write:3:102"), &[], N),
            step(json!("actor:4"), &[], N),
            step(N, &[], N)
        ],
        "end": {
            "drops": {"write_failed": 6, "cache_miss": 4},
            "refusals": {},
            "counters": counters(1, 1, 0, 2, 2, 0),
            "cache": [[1, "actor", 3]],
            "joins": {}
        }
    }));
}

/// A writer keeps its stream while it is on the current connection and opens a new one
/// otherwise; a stop of that stream while idle fails its generation as a write does, with
/// the last batch's SWIM flag (a second stop is stale); a writer known only by `idle`
/// reports no SWIM frame.
#[test]
fn writer_streams_kept_opened_and_stopped() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "connected", "at": 0, "peer": 1, "channel": "actor", "conn": 100},
            {"op": "batch", "at": 1, "peer": 1, "frames": 2, "swim": true},
            {"op": "batch", "at": 2, "peer": 1, "frames": 1, "stream": 1},
            {"op": "batch", "at": 3, "peer": 1, "frames": 1, "swim": true, "stream": 1},
            {"op": "idle", "at": 4, "peer": 1},
            {"op": "stopped", "at": 5, "peer": 1, "generation": 1},
            {"op": "stopped", "at": 6, "peer": 1, "generation": 1},
            {"op": "dialed", "at": 7, "peer": 1, "conn": 101},
            {"op": "batch", "at": 8, "peer": 1, "frames": 1, "stream": 1},
            {"op": "connected", "at": 9, "peer": 2, "channel": "actor", "conn": 200},
            {"op": "idle", "at": 10, "peer": 2},
            {"op": "stopped", "at": 11, "peer": 2, "generation": 3}
        ],
        "steps": [
            step(json!("gen:1"), &[], N),
            step(json!("write:1:100"), &[], N),
            step(json!("write:1:100:kept"), &[], N),
            step(json!("write:1:100:kept"), &[], N),
            step(N, &[], json!(1_004)),
            step(N, &["dial:1:1", "send_failed:1"], json!(1_004)),
            step(N, &["send_failed:1"], json!(1_004)),
            step(json!("gen:2"), &["kick:1"], json!(1_004)),
            step(json!("write:2:101"), &[], N),
            step(json!("gen:3"), &[], N),
            step(N, &[], json!(1_010)),
            step(N, &["dial:2:1"], json!(1_010))
        ],
        "end": {
            "drops": {},
            "refusals": {},
            "counters": counters(0, 2, 0, 2, 1, 0),
            "cache": [[1, "actor", 2]],
            "joins": {}
        }
    }));
}

/// open: refused off the list (counted), `dial:<ticket>` with no connection, the cached
/// one on its channel; open_failed evicts that generation only, then gives open's
/// verdict: the newer entry when its generation was replaced, `dial:` with the next ticket
/// when the entry went, and a second open of that pair then waits for that dial (one
/// waiter); the dial still in flight on `actor` stays in opening with no waiter.
#[test]
fn open_goes_on_the_cached_connection_or_dials() {
    check(json!({
        "allow": [1],
        "ops": [
            {"op": "open", "at": 0, "peer": 2, "path": "protocol", "channel": "protocol:0"},
            {"op": "open", "at": 0, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            {"op": "connected", "at": 1, "peer": 1, "channel": "protocol:0", "conn": 10},
            {"op": "open", "at": 2, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            {"op": "open", "at": 2, "peer": 1, "path": "actor", "channel": "actor"},
            {"op": "connected", "at": 3, "peer": 1, "channel": "protocol:0", "conn": 11},
            {"op": "open_failed", "at": 4, "peer": 1, "channel": "protocol:0",
             "generation": 1},
            {"op": "open", "at": 5, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            {"op": "open_failed", "at": 6, "peer": 1, "channel": "protocol:0",
             "generation": 2},
            {"op": "open", "at": 7, "peer": 1, "path": "protocol", "channel": "protocol:0"}
        ],
        "steps": [
            step(json!("refused"), &[], N),
            step(json!("dial:1"), &[], N),
            step(json!("gen:1"), &[], N),
            step(json!("cached:1:10"), &[], N),
            step(json!("dial:2"), &[], N),
            step(json!("gen:2"), &["close:10:409"], N),
            step(json!("cached:2:11"), &[], N),
            step(json!("cached:2:11"), &[], N),
            step(json!("dial:3"), &[], N),
            step(json!("wait:3"), &[], N)
        ],
        "end": {
            "drops": {},
            "refusals": {"protocol/outbound": 1},
            "counters": counters(0, 0, 0, 0, 0, 0),
            "cache": [],
            "joins": {},
            "opening": [[1, "actor", 2, 0], [1, "protocol:0", 3, 1]],
            "failed_opens": []
        }
    }));
}

/// Opening: concurrent opens of one (peer, channel) share one dial. open → dial:1, a
/// second open → wait:1; that dial fails with its waiter, so failed opens hold it, but a
/// fresh open does not look there and dials again (dial:2); connected ends that dial and
/// the failed entry too (gen), then open → cached; open_failed on that entry removes it
/// and dials (the pair is opening again), so an open waits. Other channels and peers are
/// opened on their own, each with the next ticket; `dialed` and `join_sent` (connected on
/// `actor`) end an `actor` open, a failed `dialed` does not (nor does an
/// `open_dial_failed` of a pair that is not opening change anything); an open off the
/// allow-list is refused every time, before any verdict; close empties opening, and
/// opens after it answer `closed`.
#[test]
fn concurrent_opens_share_one_dial() {
    check(json!({
        "allow": [1, 2],
        "ops": [
            {"op": "open", "at": 0, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            {"op": "open", "at": 1, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            {"op": "open_dial_failed", "at": 2, "peer": 1, "channel": "protocol:0",
             "ticket": 1, "abandoned": false},
            {"op": "open", "at": 3, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            {"op": "connected", "at": 4, "peer": 1, "channel": "protocol:0", "conn": 10},
            {"op": "open", "at": 5, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            {"op": "open_failed", "at": 6, "peer": 1, "channel": "protocol:0",
             "generation": 1},
            {"op": "open", "at": 7, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            // Other pairs: their own verdicts.
            {"op": "open", "at": 8, "peer": 1, "path": "protocol", "channel": "protocol:1"},
            {"op": "open", "at": 8, "peer": 2, "path": "protocol", "channel": "protocol:0"},
            {"op": "open", "at": 8, "peer": 3, "path": "protocol", "channel": "protocol:0"},
            {"op": "open", "at": 8, "peer": 3, "path": "protocol", "channel": "protocol:0"},
            // actor opens end with dialed / join_sent; a failed dialed leaves them.
            {"op": "open", "at": 9, "peer": 2, "path": "actor", "channel": "actor"},
            {"op": "dialed", "at": 10, "peer": 2, "conn": null},
            {"op": "open", "at": 11, "peer": 2, "path": "actor", "channel": "actor"},
            {"op": "dialed", "at": 12, "peer": 2, "conn": 20},
            {"op": "disconnect", "at": 13, "peer": 2, "channel": "actor"},
            {"op": "open", "at": 14, "peer": 2, "path": "actor", "channel": "actor"},
            {"op": "join_sent", "at": 15, "peer": 2, "conn": 21},
            {"op": "open_dial_failed", "at": 16, "peer": 2, "channel": "actor",
             "ticket": 7, "abandoned": false},
            {"op": "open", "at": 17, "peer": 2, "path": "actor", "channel": "actor"},
            // close empties opening; opens after it answer closed.
            {"op": "close", "at": 18},
            {"op": "open", "at": 19, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            {"op": "open", "at": 20, "peer": 1, "path": "protocol", "channel": "protocol:0"}
        ],
        "steps": [
            step(json!("dial:1"), &[], N),
            step(json!("wait:1"), &[], N),
            step(N, &[], N),
            step(json!("dial:2"), &[], N),
            step(json!("gen:1"), &[], N),
            step(json!("cached:1:10"), &[], N),
            step(json!("dial:3"), &[], N),
            step(json!("wait:3"), &[], N),
            step(json!("dial:4"), &[], N),
            step(json!("dial:5"), &[], N),
            step(json!("refused"), &[], N),
            step(json!("refused"), &[], N),
            step(json!("dial:6"), &[], N),
            step(N, &[], N),
            step(json!("wait:6"), &[], N),
            step(json!("gen:2"), &[], N),
            step(N, &["close:20:0"], N),
            step(json!("dial:7"), &[], N),
            step(json!("gen:3"), &[], N),
            step(N, &[], N),
            step(json!("cached:3:21"), &[], N),
            step(N, &["close:21:0"], N),
            step(json!("closed"), &[], N),
            step(json!("closed"), &[], N)
        ],
        "end": {
            "drops": {},
            "refusals": {"protocol/outbound": 2},
            "counters": counters(0, 0, 1, 0, 0, 0),
            "cache": [],
            "joins": {},
            "opening": [],
            "failed_opens": []
        }
    }));
}

/// The end of a case with no cache, joins, drops or counters: only its opens' state and
/// refusals.
fn opens_end(
    refusals: serde_json::Value,
    opening: serde_json::Value,
    failed_opens: serde_json::Value,
) -> serde_json::Value {
    json!({"drops": {}, "refusals": refusals, "counters": counters(0, 0, 0, 0, 0, 0),
               "cache": [], "joins": {}, "opening": opening, "failed_opens": failed_opens,
               "relays": []})
}

/// Checks the case made of the first `n` ops and steps with `end` (the state after op
/// `n` − 1), so a hand case can show the state half way through.
fn check_prefix(
    allow: serde_json::Value,
    ops: &[serde_json::Value],
    steps: &[serde_json::Value],
    n: usize,
    end: serde_json::Value,
) {
    check(json!({"allow": allow, "ops": ops[..n], "steps": steps[..n], "end": end}));
}

/// (a) Two opens wait on one dial (a re-ask while it is in flight answers `wait:1` and
/// changes nothing); the dial fails, so failed opens hold (ticket 1, 2 waiters); each
/// waiter's `open_waited` answers `failed`, and the entry goes after the second. A fresh
/// open in between dials (the verdict does not look at failed opens) and the second
/// waiter still hears `failed` (failed opens are looked at first); a third ask of ticket
/// 1, after the entry went, gets the verdict: one more waiter of dial 2.
#[test]
fn waiters_of_a_failed_dial_hear_failed() {
    let ops = [
        json!({"op": "open", "at": 0, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open", "at": 1, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open", "at": 2, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open_waited", "at": 3, "peer": 1, "channel": "protocol:0",
                   "ticket": 1}),
        json!({"op": "open_dial_failed", "at": 4, "peer": 1, "channel": "protocol:0",
                   "ticket": 1, "abandoned": false}),
        json!({"op": "open_waited", "at": 5, "peer": 1, "channel": "protocol:0",
                   "ticket": 1}),
        json!({"op": "open", "at": 6, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open_waited", "at": 7, "peer": 1, "channel": "protocol:0",
                   "ticket": 1}),
        json!({"op": "open_waited", "at": 8, "peer": 1, "channel": "protocol:0",
                   "ticket": 1}),
    ];
    let steps = [
        step(json!("dial:1"), &[], N),
        step(json!("wait:1"), &[], N),
        step(json!("wait:1"), &[], N),
        step(json!("wait:1"), &[], N),
        step(N, &[], N),
        step(json!("failed"), &[], N),
        step(json!("dial:2"), &[], N),
        step(json!("failed"), &[], N),
        step(json!("wait:2"), &[], N),
    ];
    // Both waiters counted, the re-ask not.
    check_prefix(
        json!(null),
        &ops,
        &steps,
        4,
        opens_end(json!({}), json!([[1, "protocol:0", 1, 2]]), json!([])),
    );
    // The dial failed: it left opening for failed opens, with its 2 waiters.
    check_prefix(
        json!(null),
        &ops,
        &steps,
        5,
        opens_end(json!({}), json!([]), json!([[1, "protocol:0", 1, 2]])),
    );
    // One waiter heard it.
    check_prefix(
        json!(null),
        &ops,
        &steps,
        6,
        opens_end(json!({}), json!([]), json!([[1, "protocol:0", 1, 1]])),
    );
    // A fresh open dials; the failed entry stays.
    check_prefix(
        json!(null),
        &ops,
        &steps,
        7,
        opens_end(
            json!({}),
            json!([[1, "protocol:0", 2, 0]]),
            json!([[1, "protocol:0", 1, 1]]),
        ),
    );
    // The second waiter heard it: the entry went. The third ask waits for dial 2.
    check_prefix(
        json!(null),
        &ops,
        &steps,
        8,
        opens_end(json!({}), json!([[1, "protocol:0", 2, 0]]), json!([])),
    );
    check_prefix(
        json!(null),
        &ops,
        &steps,
        9,
        opens_end(json!({}), json!([[1, "protocol:0", 2, 1]]), json!([])),
    );
}

/// (b) An abandoned dial leaves opening without a failed entry, whatever its waiters: the
/// first waiter that asks again dials with the next ticket, the next one waits for that
/// dial (one waiter), and asking again with the new ticket while it is in flight changes
/// nothing. A dial that fails with 0 waiters only leaves opening too.
#[test]
fn an_abandoned_dials_waiters_dial_again() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "open", "at": 0, "peer": 2, "path": "actor", "channel": "actor"},
            {"op": "open", "at": 1, "peer": 2, "path": "actor", "channel": "actor"},
            {"op": "open", "at": 2, "peer": 2, "path": "actor", "channel": "actor"},
            {"op": "open_dial_failed", "at": 3, "peer": 2, "channel": "actor",
             "ticket": 1, "abandoned": true},
            {"op": "open_waited", "at": 4, "peer": 2, "channel": "actor", "ticket": 1},
            {"op": "open_waited", "at": 5, "peer": 2, "channel": "actor", "ticket": 1},
            {"op": "open_waited", "at": 6, "peer": 2, "channel": "actor", "ticket": 2},
            {"op": "open", "at": 7, "peer": 3, "path": "protocol", "channel": "protocol:1"},
            {"op": "open_dial_failed", "at": 8, "peer": 3, "channel": "protocol:1",
             "ticket": 3, "abandoned": false}
        ],
        "steps": [
            step(json!("dial:1"), &[], N),
            step(json!("wait:1"), &[], N),
            step(json!("wait:1"), &[], N),
            step(N, &[], N),
            step(json!("dial:2"), &[], N),
            step(json!("wait:2"), &[], N),
            step(json!("wait:2"), &[], N),
            step(json!("dial:3"), &[], N),
            step(N, &[], N)
        ],
        "end": opens_end(json!({}), json!([[2, "actor", 2, 1]]), json!([]))
    }));
}

/// (c) An `open_dial_failed` whose ticket is not the pair's dial in flight changes
/// nothing: an earlier dial's ticket (stale), one not issued yet, and a pair that is not
/// opening at all. The dial in flight then fails for real: its entry replaces the older
/// failed entry of the pair, whose waiter then gets the verdict (a new dial).
#[test]
fn a_stale_dial_report_changes_nothing() {
    let ops = [
        json!({"op": "open", "at": 0, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open", "at": 0, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open_dial_failed", "at": 1, "peer": 1, "channel": "protocol:0",
                   "ticket": 1, "abandoned": false}),
        json!({"op": "open", "at": 2, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open", "at": 2, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        // Stale (ticket 1 is dial 2's predecessor), not issued yet, and another pair.
        json!({"op": "open_dial_failed", "at": 3, "peer": 1, "channel": "protocol:0",
                   "ticket": 1, "abandoned": false}),
        json!({"op": "open_dial_failed", "at": 3, "peer": 1, "channel": "protocol:0",
                   "ticket": 3, "abandoned": true}),
        json!({"op": "open_dial_failed", "at": 3, "peer": 1, "channel": "protocol:1",
                   "ticket": 2, "abandoned": false}),
        json!({"op": "open_waited", "at": 4, "peer": 1, "channel": "protocol:0",
                   "ticket": 2}),
        // Dial 2 fails: its entry replaces dial 1's.
        json!({"op": "open_dial_failed", "at": 5, "peer": 1, "channel": "protocol:0",
                   "ticket": 2, "abandoned": false}),
        json!({"op": "open_waited", "at": 6, "peer": 1, "channel": "protocol:0",
                   "ticket": 1}),
        json!({"op": "open_waited", "at": 7, "peer": 1, "channel": "protocol:0",
                   "ticket": 2}),
    ];
    let steps = [
        step(json!("dial:1"), &[], N),
        step(json!("wait:1"), &[], N),
        step(N, &[], N),
        step(json!("dial:2"), &[], N),
        step(json!("wait:2"), &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(json!("wait:2"), &[], N),
        step(N, &[], N),
        step(json!("dial:3"), &[], N),
        step(json!("failed"), &[], N),
    ];
    // Before the stale reports and after them: the same state.
    for n in [5, 9] {
        check_prefix(
            json!(null),
            &ops,
            &steps,
            n,
            opens_end(
                json!({}),
                json!([[1, "protocol:0", 2, 1]]),
                json!([[1, "protocol:0", 1, 1]]),
            ),
        );
    }
    check_prefix(
        json!(null),
        &ops,
        &steps,
        10,
        opens_end(json!({}), json!([]), json!([[1, "protocol:0", 2, 1]])),
    );
    check_prefix(
        json!(null),
        &ops,
        &steps,
        12,
        opens_end(json!({}), json!([[1, "protocol:0", 3, 0]]), json!([])),
    );
}

/// (d) Three pairs' dials fail with waiters: failed opens keep 2 entries, and the one
/// with the smallest ticket goes. Its waiter then gets the verdict of `open` (it dials
/// with the next ticket) while the others' waiters hear `failed`. When the oldest dial is
/// the last to fail, its own new entry is the smallest ticket and goes at once.
#[test]
fn failed_opens_keep_the_two_newest_tickets() {
    let ops = [
        json!({"op": "open", "at": 0, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open", "at": 0, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open", "at": 0, "peer": 1, "path": "protocol",
                   "channel": "protocol:1"}),
        json!({"op": "open", "at": 0, "peer": 1, "path": "protocol",
                   "channel": "protocol:1"}),
        json!({"op": "open", "at": 0, "peer": 1, "path": "protocol",
                   "channel": "protocol:1"}),
        json!({"op": "open", "at": 0, "peer": 2, "path": "actor", "channel": "actor"}),
        json!({"op": "open", "at": 0, "peer": 2, "path": "actor", "channel": "actor"}),
        json!({"op": "open_dial_failed", "at": 1, "peer": 1, "channel": "protocol:0",
                   "ticket": 1, "abandoned": false}),
        json!({"op": "open_dial_failed", "at": 2, "peer": 1, "channel": "protocol:1",
                   "ticket": 2, "abandoned": false}),
        json!({"op": "open_dial_failed", "at": 3, "peer": 2, "channel": "actor",
                   "ticket": 3, "abandoned": false}),
        json!({"op": "open_waited", "at": 4, "peer": 1, "channel": "protocol:0",
                   "ticket": 1}),
        json!({"op": "open_waited", "at": 5, "peer": 1, "channel": "protocol:1",
                   "ticket": 2}),
        json!({"op": "open_waited", "at": 6, "peer": 2, "channel": "actor", "ticket": 3}),
    ];
    let steps = [
        step(json!("dial:1"), &[], N),
        step(json!("wait:1"), &[], N),
        step(json!("dial:2"), &[], N),
        step(json!("wait:2"), &[], N),
        step(json!("wait:2"), &[], N),
        step(json!("dial:3"), &[], N),
        step(json!("wait:3"), &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(json!("dial:4"), &[], N),
        step(json!("failed"), &[], N),
        step(json!("failed"), &[], N),
    ];
    check_prefix(
        json!(null),
        &ops,
        &steps,
        9,
        opens_end(
            json!({}),
            json!([[2, "actor", 3, 1]]),
            json!([[1, "protocol:0", 1, 1], [1, "protocol:1", 2, 2]]),
        ),
    );
    // The third entry pushes out ticket 1.
    check_prefix(
        json!(null),
        &ops,
        &steps,
        10,
        opens_end(
            json!({}),
            json!([]),
            json!([[1, "protocol:1", 2, 2], [2, "actor", 3, 1]]),
        ),
    );
    check_prefix(
        json!(null),
        &ops,
        &steps,
        13,
        opens_end(
            json!({}),
            json!([[1, "protocol:0", 4, 0]]),
            json!([[1, "protocol:1", 2, 1]]),
        ),
    );
    // The oldest dial fails last: its own entry is the one that goes.
    check(json!({
        "allow": null,
        "ops": [
            {"op": "open", "at": 0, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            {"op": "open", "at": 0, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            {"op": "open", "at": 0, "peer": 1, "path": "protocol", "channel": "protocol:1"},
            {"op": "open", "at": 0, "peer": 1, "path": "protocol", "channel": "protocol:1"},
            {"op": "open", "at": 0, "peer": 2, "path": "actor", "channel": "actor"},
            {"op": "open", "at": 0, "peer": 2, "path": "actor", "channel": "actor"},
            {"op": "open_dial_failed", "at": 1, "peer": 1, "channel": "protocol:1",
             "ticket": 2, "abandoned": false},
            {"op": "open_dial_failed", "at": 2, "peer": 2, "channel": "actor",
             "ticket": 3, "abandoned": false},
            {"op": "open_dial_failed", "at": 3, "peer": 1, "channel": "protocol:0",
             "ticket": 1, "abandoned": false},
            {"op": "open_waited", "at": 4, "peer": 1, "channel": "protocol:0",
             "ticket": 1}
        ],
        "steps": [
            step(json!("dial:1"), &[], N),
            step(json!("wait:1"), &[], N),
            step(json!("dial:2"), &[], N),
            step(json!("wait:2"), &[], N),
            step(json!("dial:3"), &[], N),
            step(json!("wait:3"), &[], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], N),
            step(json!("dial:4"), &[], N)
        ],
        "end": opens_end(
            json!({}),
            json!([[1, "protocol:0", 4, 0]]),
            json!([[1, "protocol:1", 2, 1], [2, "actor", 3, 1]])
        )
    }));
}

/// (e) `connected` clears the pair's failed-opens entry (its Cache step does: the waiters
/// take the new connection and get `cached:`), and its dial in flight whatever the ticket;
/// a connection on another channel of the peer clears nothing; `dialed` (connected) and
/// `join_sent` do the same on `actor`.
#[test]
fn connected_clears_a_failed_open() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "open", "at": 0, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            {"op": "open", "at": 1, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            {"op": "open_dial_failed", "at": 2, "peer": 1, "channel": "protocol:0",
             "ticket": 1, "abandoned": false},
            {"op": "open", "at": 3, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            {"op": "open", "at": 4, "peer": 1, "path": "protocol", "channel": "protocol:0"},
            {"op": "connected", "at": 5, "peer": 1, "channel": "protocol:1", "conn": 11},
            {"op": "connected", "at": 6, "peer": 1, "channel": "protocol:0", "conn": 10},
            {"op": "open_waited", "at": 7, "peer": 1, "channel": "protocol:0", "ticket": 1},
            {"op": "open_waited", "at": 8, "peer": 1, "channel": "protocol:0", "ticket": 2},
            {"op": "open", "at": 9, "peer": 2, "path": "actor", "channel": "actor"},
            {"op": "open", "at": 10, "peer": 2, "path": "actor", "channel": "actor"},
            {"op": "open_dial_failed", "at": 11, "peer": 2, "channel": "actor",
             "ticket": 3, "abandoned": false},
            {"op": "dialed", "at": 12, "peer": 2, "conn": 20},
            {"op": "open_waited", "at": 13, "peer": 2, "channel": "actor", "ticket": 3},
            {"op": "open", "at": 14, "peer": 3, "path": "actor", "channel": "actor"},
            {"op": "open", "at": 15, "peer": 3, "path": "actor", "channel": "actor"},
            {"op": "open_dial_failed", "at": 16, "peer": 3, "channel": "actor",
             "ticket": 4, "abandoned": false},
            {"op": "open", "at": 17, "peer": 3, "path": "actor", "channel": "actor"},
            {"op": "join_sent", "at": 18, "peer": 3, "conn": 30}
        ],
        "steps": [
            step(json!("dial:1"), &[], N),
            step(json!("wait:1"), &[], N),
            step(N, &[], N),
            step(json!("dial:2"), &[], N),
            step(json!("wait:2"), &[], N),
            step(json!("gen:1"), &[], N),
            step(json!("gen:2"), &[], N),
            step(json!("cached:2:10"), &[], N),
            step(json!("cached:2:10"), &[], N),
            step(json!("dial:3"), &[], N),
            step(json!("wait:3"), &[], N),
            step(N, &[], N),
            step(json!("gen:3"), &[], N),
            step(json!("cached:3:20"), &[], N),
            step(json!("dial:4"), &[], N),
            step(json!("wait:4"), &[], N),
            step(N, &[], N),
            step(json!("dial:5"), &[], N),
            step(json!("gen:4"), &[], N)
        ],
        "end": {
            "drops": {},
            "refusals": {},
            "counters": counters(0, 0, 0, 0, 0, 0),
            "cache": [[1, "protocol:0", 2], [1, "protocol:1", 1], [2, "actor", 3],
                      [3, "actor", 4]],
            "joins": {},
            "opening": [],
            "failed_opens": []
        }
    }));
}

/// (f) After `close`, `open` (admitted), `open_waited` (of a dial in flight before and of
/// one that failed before) and `open_failed` answer `closed`; an `open` off the
/// allow-list still answers `refused` (admission first) and counts it; close emptied
/// opening and failed opens, an `open_dial_failed` then changes nothing, and nothing
/// puts a pair back.
#[test]
fn opens_after_close_answer_closed() {
    let ops = [
        json!({"op": "open", "at": 0, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open", "at": 1, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open_dial_failed", "at": 2, "peer": 1, "channel": "protocol:0",
                   "ticket": 1, "abandoned": false}),
        json!({"op": "open", "at": 3, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open", "at": 4, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "accept", "at": 5, "peer": 1, "alpn": "p1", "conn": 7}),
        json!({"op": "close", "at": 6}),
        json!({"op": "open", "at": 7, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open", "at": 8, "peer": 2, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open_waited", "at": 9, "peer": 1, "channel": "protocol:0",
                   "ticket": 1}),
        json!({"op": "open_waited", "at": 10, "peer": 1, "channel": "protocol:0",
                   "ticket": 2}),
        json!({"op": "open_failed", "at": 11, "peer": 1, "channel": "protocol:1",
                   "generation": 1}),
        json!({"op": "open_failed", "at": 12, "peer": 1, "channel": "protocol:0",
                   "generation": 1}),
        json!({"op": "open_dial_failed", "at": 13, "peer": 1, "channel": "protocol:0",
                   "ticket": 2, "abandoned": false}),
        json!({"op": "connected", "at": 14, "peer": 1, "channel": "protocol:0",
                   "conn": 8}),
        json!({"op": "open", "at": 15, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
    ];
    let steps = [
        step(json!("dial:1"), &[], N),
        step(json!("wait:1"), &[], N),
        step(N, &[], N),
        step(json!("dial:2"), &[], N),
        step(json!("wait:2"), &[], N),
        step(json!("protocol:1:1"), &[], N),
        step(N, &["close:7:0"], N),
        step(json!("closed"), &[], N),
        step(json!("refused"), &[], N),
        step(json!("closed"), &[], N),
        step(json!("closed"), &[], N),
        step(json!("closed"), &[], N),
        step(json!("closed"), &[], N),
        step(N, &[], N),
        step(N, &["close:8:0"], N),
        step(json!("closed"), &[], N),
    ];
    let allow = json!([1]);
    check_prefix(
        allow.clone(),
        &ops,
        &steps,
        6,
        json!({"drops": {}, "refusals": {}, "counters": counters(1, 0, 0, 0, 0, 0),
                   "cache": [[1, "protocol:1", 1]], "joins": {},
                   "opening": [[1, "protocol:0", 2, 1]],
                   "failed_opens": [[1, "protocol:0", 1, 1]]}),
    );
    check_prefix(
        allow,
        &ops,
        &steps,
        16,
        json!({"drops": {}, "refusals": {"protocol/outbound": 1},
                   "counters": counters(1, 0, 0, 0, 0, 0), "cache": [], "joins": {},
                   "opening": [], "failed_opens": []}),
    );
}

/// The end of an opens case that also accepted connections: `accepted` and the cache.
fn opens_cached_end(
    accepted: u64,
    cache: serde_json::Value,
    opening: serde_json::Value,
    failed_opens: serde_json::Value,
) -> serde_json::Value {
    json!({"drops": {}, "refusals": {}, "counters": counters(accepted, 0, 0, 0, 0, 0),
               "cache": cache, "joins": {}, "opening": opening, "failed_opens": failed_opens,
               "relays": []})
}

/// (g) An `accept` caches a pair while its open's dial is in flight (`t` on telemetry,
/// `s` on switch): the pair stays opening (only `connected` ends the dial), and a waiter
/// that asks again hears `cached:<generation>:<conn>` and is forgotten (waiters −= 1). The
/// dial then fails with a waiter left, but the pair is cached: no failed-opens entry, and
/// the last waiter hears `cached:` too (its ticket matches nothing any more). On switch
/// both waiters' asks come while the dial is in flight: the second forgets nothing below
/// 0, the pair stays opening with 0 waiters, and `connected` then ends the dial and
/// replaces the accepted entry.
#[test]
fn a_waiter_takes_an_accepted_connection() {
    let ops = [
        json!({"op": "open", "at": 0, "peer": 1, "path": "telemetry",
                   "channel": "telemetry"}),
        json!({"op": "open", "at": 1, "peer": 1, "path": "telemetry",
                   "channel": "telemetry"}),
        json!({"op": "open", "at": 2, "peer": 1, "path": "telemetry",
                   "channel": "telemetry"}),
        json!({"op": "open", "at": 3, "peer": 2, "path": "switch", "channel": "switch"}),
        json!({"op": "open", "at": 4, "peer": 2, "path": "switch", "channel": "switch"}),
        json!({"op": "accept", "at": 5, "peer": 1, "alpn": "t", "conn": 10}),
        json!({"op": "accept", "at": 6, "peer": 2, "alpn": "s", "conn": 20}),
        json!({"op": "open_waited", "at": 7, "peer": 1, "channel": "telemetry",
                   "ticket": 1}),
        json!({"op": "open_dial_failed", "at": 8, "peer": 1, "channel": "telemetry",
                   "ticket": 1, "abandoned": false}),
        json!({"op": "open_waited", "at": 9, "peer": 1, "channel": "telemetry",
                   "ticket": 1}),
        json!({"op": "open_waited", "at": 10, "peer": 2, "channel": "switch",
                   "ticket": 2}),
        json!({"op": "open_waited", "at": 11, "peer": 2, "channel": "switch",
                   "ticket": 2}),
        json!({"op": "connected", "at": 12, "peer": 2, "channel": "switch", "conn": 21}),
        json!({"op": "open_waited", "at": 13, "peer": 2, "channel": "switch",
                   "ticket": 2}),
    ];
    let steps = [
        step(json!("dial:1"), &[], N),
        step(json!("wait:1"), &[], N),
        step(json!("wait:1"), &[], N),
        step(json!("dial:2"), &[], N),
        step(json!("wait:2"), &[], N),
        step(json!("telemetry:1"), &[], N),
        step(json!("switch:2"), &[], N),
        step(json!("cached:1:10"), &[], N),
        step(N, &[], N),
        step(json!("cached:1:10"), &[], N),
        step(json!("cached:2:20"), &[], N),
        step(json!("cached:2:20"), &[], N),
        step(json!("gen:3"), &[], N),
        step(json!("cached:3:21"), &[], N),
    ];
    let accepted = json!([[1, "telemetry", 1], [2, "switch", 2]]);
    // Both accepted while their dials are in flight: both pairs still opening.
    check_prefix(
        json!(null),
        &ops,
        &steps,
        7,
        opens_cached_end(
            2,
            accepted.clone(),
            json!([[1, "telemetry", 1, 2], [2, "switch", 2, 1]]),
            json!([]),
        ),
    );
    // One telemetry waiter took the connection.
    check_prefix(
        json!(null),
        &ops,
        &steps,
        8,
        opens_cached_end(
            2,
            accepted.clone(),
            json!([[1, "telemetry", 1, 1], [2, "switch", 2, 1]]),
            json!([]),
        ),
    );
    // The telemetry dial failed with a waiter left, but the pair is cached: no entry.
    check_prefix(
        json!(null),
        &ops,
        &steps,
        9,
        opens_cached_end(2, accepted.clone(), json!([[2, "switch", 2, 1]]), json!([])),
    );
    // Two asks of the switch dial's one waiter: 1 → 0 → 0, still opening.
    check_prefix(
        json!(null),
        &ops,
        &steps,
        12,
        opens_cached_end(2, accepted, json!([[2, "switch", 2, 0]]), json!([])),
    );
    check_prefix(
        json!(null),
        &ops,
        &steps,
        14,
        opens_cached_end(
            2,
            json!([[1, "telemetry", 1], [2, "switch", 3]]),
            json!([]),
            json!([]),
        ),
    );
}

/// (h) `open_wait_abandoned` forgets a waiter of a dial in flight (3 → 2); the dial fails
/// and failed opens keep the 2 that remain; one hears `failed` (2 → 1), and abandoning
/// the last one removes the entry, so asking with that ticket again gets the verdict (a
/// new dial). Its result is always `null`, with no action.
#[test]
fn abandoned_waiters_are_forgotten() {
    let ops = [
        json!({"op": "open", "at": 0, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open", "at": 1, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open", "at": 2, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open", "at": 3, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open_wait_abandoned", "at": 4, "peer": 1, "channel": "protocol:0",
                   "ticket": 1}),
        json!({"op": "open_dial_failed", "at": 5, "peer": 1, "channel": "protocol:0",
                   "ticket": 1, "abandoned": false}),
        json!({"op": "open_waited", "at": 6, "peer": 1, "channel": "protocol:0",
                   "ticket": 1}),
        json!({"op": "open_wait_abandoned", "at": 7, "peer": 1, "channel": "protocol:0",
                   "ticket": 1}),
        json!({"op": "open_waited", "at": 8, "peer": 1, "channel": "protocol:0",
                   "ticket": 1}),
    ];
    let steps = [
        step(json!("dial:1"), &[], N),
        step(json!("wait:1"), &[], N),
        step(json!("wait:1"), &[], N),
        step(json!("wait:1"), &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(json!("failed"), &[], N),
        step(N, &[], N),
        step(json!("dial:2"), &[], N),
    ];
    check_prefix(
        json!(null),
        &ops,
        &steps,
        4,
        opens_end(json!({}), json!([[1, "protocol:0", 1, 3]]), json!([])),
    );
    check_prefix(
        json!(null),
        &ops,
        &steps,
        5,
        opens_end(json!({}), json!([[1, "protocol:0", 1, 2]]), json!([])),
    );
    // The dial failed with the 2 remaining waiters.
    check_prefix(
        json!(null),
        &ops,
        &steps,
        6,
        opens_end(json!({}), json!([]), json!([[1, "protocol:0", 1, 2]])),
    );
    check_prefix(
        json!(null),
        &ops,
        &steps,
        7,
        opens_end(json!({}), json!([]), json!([[1, "protocol:0", 1, 1]])),
    );
    // The last waiter went away: the entry goes at 0.
    check_prefix(
        json!(null),
        &ops,
        &steps,
        8,
        opens_end(json!({}), json!([]), json!([])),
    );
    check_prefix(
        json!(null),
        &ops,
        &steps,
        9,
        opens_end(json!({}), json!([[1, "protocol:0", 2, 0]]), json!([])),
    );
}

/// (i) An `accept` on a pair with a failed-opens entry removes the entry (its Cache step);
/// the entry's waiter asking again hears `cached:`. An `accept` on another channel of the
/// peer, or on an unknown ALPN (no cache insert, though `accepted` counts it), leaves the
/// entry alone. On `actor` the same (no writer and no claim: no action).
#[test]
fn an_accept_clears_a_failed_open() {
    let ops = [
        json!({"op": "open", "at": 0, "peer": 1, "path": "protocol",
                   "channel": "protocol:1"}),
        json!({"op": "open", "at": 1, "peer": 1, "path": "protocol",
                   "channel": "protocol:1"}),
        json!({"op": "open", "at": 2, "peer": 1, "path": "protocol",
                   "channel": "protocol:1"}),
        json!({"op": "open_dial_failed", "at": 3, "peer": 1, "channel": "protocol:1",
                   "ticket": 1, "abandoned": false}),
        json!({"op": "open_waited", "at": 4, "peer": 1, "channel": "protocol:1",
                   "ticket": 1}),
        json!({"op": "open", "at": 5, "peer": 2, "path": "actor", "channel": "actor"}),
        json!({"op": "open", "at": 6, "peer": 2, "path": "actor", "channel": "actor"}),
        json!({"op": "open_dial_failed", "at": 7, "peer": 2, "channel": "actor",
                   "ticket": 2, "abandoned": false}),
        json!({"op": "accept", "at": 8, "peer": 1, "alpn": "p0", "conn": 9}),
        json!({"op": "accept", "at": 9, "peer": 2, "alpn": "zz", "conn": 19}),
        json!({"op": "accept", "at": 10, "peer": 1, "alpn": "p1", "conn": 10}),
        json!({"op": "open_waited", "at": 11, "peer": 1, "channel": "protocol:1",
                   "ticket": 1}),
        json!({"op": "accept", "at": 12, "peer": 2, "alpn": "a", "conn": 20}),
        json!({"op": "open_waited", "at": 13, "peer": 2, "channel": "actor", "ticket": 2}),
    ];
    let steps = [
        step(json!("dial:1"), &[], N),
        step(json!("wait:1"), &[], N),
        step(json!("wait:1"), &[], N),
        step(N, &[], N),
        step(json!("failed"), &[], N),
        step(json!("dial:2"), &[], N),
        step(json!("wait:2"), &[], N),
        step(N, &[], N),
        step(json!("protocol:0:1"), &[], N),
        step(json!("no_adapter"), &[], N),
        step(json!("protocol:1:2"), &[], N),
        step(json!("cached:2:10"), &[], N),
        step(json!("actor:3"), &[], N),
        step(json!("cached:3:20"), &[], N),
    ];
    check_prefix(
        json!(null),
        &ops,
        &steps,
        8,
        opens_end(
            json!({}),
            json!([]),
            json!([[1, "protocol:1", 1, 1], [2, "actor", 2, 1]]),
        ),
    );
    // Another channel of the peer and an unknown ALPN: both entries stay.
    check_prefix(
        json!(null),
        &ops,
        &steps,
        10,
        opens_cached_end(
            2,
            json!([[1, "protocol:0", 1]]),
            json!([]),
            json!([[1, "protocol:1", 1, 1], [2, "actor", 2, 1]]),
        ),
    );
    // Cached on protocol:1: its entry went.
    check_prefix(
        json!(null),
        &ops,
        &steps,
        11,
        opens_cached_end(
            3,
            json!([[1, "protocol:0", 1], [1, "protocol:1", 2]]),
            json!([]),
            json!([[2, "actor", 2, 1]]),
        ),
    );
    check_prefix(
        json!(null),
        &ops,
        &steps,
        14,
        opens_cached_end(
            4,
            json!([[1, "protocol:0", 1], [1, "protocol:1", 2], [2, "actor", 3]]),
            json!([]),
            json!([]),
        ),
    );
}

/// (j) Forgetting a waiter with a ticket that matches nothing changes nothing: a ticket
/// not issued yet, 0, the pair's other (failed) dial's ticket when asked of another pair
/// or peer, and a dial's ticket after it ended. Forgetting never goes below 0: the dial in
/// flight stays opening at 0 waiters (and `open_waited` of it still answers `wait:`), and
/// when it fails with 0 waiters it keeps no entry, while the pair's older failed entry
/// stays for its own waiter until that one is abandoned. After `close` it finds nothing.
#[test]
fn forgetting_a_stale_ticket_changes_nothing() {
    let abandon = |at: u64, peer: u8, channel: &str, ticket: u64| {
        json!({"op": "open_wait_abandoned", "at": at, "peer": peer, "channel": channel,
                   "ticket": ticket})
    };
    let ops = [
        json!({"op": "open", "at": 0, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open", "at": 1, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open_dial_failed", "at": 2, "peer": 1, "channel": "protocol:0",
                   "ticket": 1, "abandoned": false}),
        json!({"op": "open", "at": 3, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        json!({"op": "open", "at": 4, "peer": 1, "path": "protocol",
                   "channel": "protocol:0"}),
        abandon(5, 1, "protocol:0", 3),
        abandon(6, 1, "protocol:0", 0),
        abandon(7, 1, "protocol:1", 2),
        abandon(8, 2, "protocol:0", 1),
        abandon(9, 1, "protocol:0", 2),
        abandon(10, 1, "protocol:0", 2),
        json!({"op": "open_waited", "at": 11, "peer": 1, "channel": "protocol:0",
                   "ticket": 2}),
        json!({"op": "open_dial_failed", "at": 12, "peer": 1, "channel": "protocol:0",
                   "ticket": 2, "abandoned": false}),
        abandon(13, 1, "protocol:0", 2),
        abandon(14, 1, "protocol:0", 1),
        abandon(15, 1, "protocol:0", 1),
        json!({"op": "close", "at": 16}),
        abandon(17, 1, "protocol:0", 1),
    ];
    let steps = [
        step(json!("dial:1"), &[], N),
        step(json!("wait:1"), &[], N),
        step(N, &[], N),
        step(json!("dial:2"), &[], N),
        step(json!("wait:2"), &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(json!("wait:2"), &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(N, &[], N),
    ];
    // Before and after the abandons that match nothing: the same state.
    for n in [5, 9] {
        check_prefix(
            json!(null),
            &ops,
            &steps,
            n,
            opens_end(
                json!({}),
                json!([[1, "protocol:0", 2, 1]]),
                json!([[1, "protocol:0", 1, 1]]),
            ),
        );
    }
    // 1 → 0 → 0: still opening; the older failed entry untouched.
    for n in [10, 11, 12] {
        check_prefix(
            json!(null),
            &ops,
            &steps,
            n,
            opens_end(
                json!({}),
                json!([[1, "protocol:0", 2, 0]]),
                json!([[1, "protocol:0", 1, 1]]),
            ),
        );
    }
    // Dial 2 failed with 0 waiters: no entry of its own, and a stale abandon of it does
    // nothing; the older entry stays.
    for n in [13, 14] {
        check_prefix(
            json!(null),
            &ops,
            &steps,
            n,
            opens_end(json!({}), json!([]), json!([[1, "protocol:0", 1, 1]])),
        );
    }
    check_prefix(
        json!(null),
        &ops,
        &steps,
        18,
        opens_end(json!({}), json!([]), json!([])),
    );
    // A failed entry held at 0 waiters (no op makes one; set directly) goes when a waiter
    // of it is forgotten, without an error; an opening at 0 stays at 0 and stays opening.
    let mut machine = Machine::new(None);
    machine.failed_opens.insert(
        (1, Channel::Switch),
        Ticketed {
            ticket: 4,
            waiters: 0,
        },
    );
    machine.opening.insert(
        (1, Channel::Telemetry),
        Ticketed {
            ticket: 5,
            waiters: 0,
        },
    );
    for (channel, ticket) in [("switch", 4), ("telemetry", 5)] {
        let step = machine
            .apply(&DriverOp::OpenWaitAbandoned {
                at: 0,
                peer: 1,
                channel: channel.to_string(),
                ticket,
            })
            .expect("well formed");
        assert_eq!(step.result, None);
        assert!(step.actions.is_empty());
    }
    assert!(machine.failed_opens.is_empty());
    assert_eq!(
        machine.opening.get(&(1, Channel::Telemetry)),
        Some(&Ticketed {
            ticket: 5,
            waiters: 0
        })
    );
}

/// The ticket counter and a dial's waiters are checked sums: past `u64::MAX` is an `Err`,
/// not a wrap.
#[test]
fn ticket_and_waiters_overflow_are_errors() {
    let open = |channel: &str| DriverOp::Open {
        at: 0,
        peer: 1,
        path: "protocol".to_string(),
        channel: channel.to_string(),
    };
    let mut machine = Machine::new(None);
    machine.last_ticket = u64::MAX - 1;
    let step = machine
        .apply(&open("protocol:0"))
        .expect("the last ticket is fine");
    assert_eq!(step.result, Some(format!("dial:{}", u64::MAX)));
    assert!(machine.apply(&open("protocol:1")).is_err());
    let mut machine = Machine::new(None);
    machine.opening.insert(
        (1, Channel::Protocol0),
        Ticketed {
            ticket: 1,
            waiters: u64::MAX - 1,
        },
    );
    let step = machine
        .apply(&open("protocol:0"))
        .expect("the last waiter is fine");
    assert_eq!(step.result, Some("wait:1".to_string()));
    assert!(machine.apply(&open("protocol:0")).is_err());
}

/// Idle writers retire 1,000 ms after going idle; a batch cancels the idle timer; a
/// second idle replaces the timer; caching on actor kicks a writer (idle or busy), other
/// channels do not; close forgets writers and cancels timers.
#[test]
fn idle_writers_retire_and_batch_cancels() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "idle", "at": 0, "peer": 1},
            {"op": "idle", "at": 500, "peer": 2},
            {"op": "batch", "at": 600, "peer": 1, "frames": 2},
            {"op": "idle", "at": 700, "peer": 2},
            {"op": "timeout", "at": 1600},
            {"op": "idle", "at": 1650, "peer": 1},
            {"op": "timeout", "at": 3000},
            {"op": "dialed", "at": 3001, "peer": 1, "conn": 5},
            {"op": "idle", "at": 3002, "peer": 1},
            {"op": "connected", "at": 3003, "peer": 1, "channel": "telemetry", "conn": 6},
            {"op": "accept", "at": 3004, "peer": 1, "alpn": "a", "conn": 7},
            {"op": "close", "at": 3005},
            {"op": "idle", "at": 3006, "peer": 1},
            {"op": "timeout", "at": 5000}
        ],
        "steps": [
            step(N, &[], json!(1000)),
            step(N, &[], json!(1000)),
            step(json!("drop"), &["dial:1:1"], json!(1500)),
            step(N, &[], json!(1700)),
            step(N, &[], json!(1700)),
            step(N, &[], json!(1700)),
            step(N, &["retire:2", "retire:1"], N),
            step(json!("gen:1"), &[], N),
            step(N, &[], json!(4002)),
            step(json!("gen:2"), &[], json!(4002)),
            step(json!("actor:3"), &["kick:1"], json!(4002)),
            step(N, &["close:7:0", "close:6:0"], N),
            step(N, &[], N),
            step(N, &[], N)
        ],
        "end": {
            "drops": {"cache_miss": 2},
            "refusals": {},
            "counters": counters(1, 1, 0, 0, 0, 2),
            "cache": [],
            "joins": {}
        }
    }));
}

/// A join fails five times: waits 2000, 4000, 8000, 16000 ms, then `failed`. A second
/// join while one is running changes nothing; failures of a waiting or finished join are
/// ignored; a failure after join_connected (phase sending) still counts.
#[test]
fn join_fails_five_times() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "join", "at": 0, "peer": 7, "relay": false, "direct": 0},
            {"op": "join", "at": 1, "peer": 7, "relay": true, "direct": 3},
            {"op": "join_failed", "at": 10, "peer": 7},
            {"op": "join_failed", "at": 20, "peer": 7},
            {"op": "timeout", "at": 2010},
            {"op": "join_failed", "at": 2100, "peer": 7},
            {"op": "timeout", "at": 6100},
            {"op": "join_failed", "at": 6200, "peer": 7},
            {"op": "timeout", "at": 14200},
            {"op": "join_failed", "at": 14300, "peer": 7},
            {"op": "timeout", "at": 30300},
            {"op": "join_connected", "at": 30400, "peer": 7},
            {"op": "join_failed", "at": 30500, "peer": 7},
            {"op": "join_failed", "at": 30600, "peer": 7},
            {"op": "join_connected", "at": 30700, "peer": 7}
        ],
        "steps": [
            step(json!("ok"), &["join:7:1"], N),
            step(json!("ok"), &[], N),
            step(N, &[], json!(2010)),
            step(N, &[], json!(2010)),
            step(N, &["join:7:2"], N),
            step(N, &[], json!(6100)),
            step(N, &["join:7:3"], N),
            step(N, &[], json!(14200)),
            step(N, &["join:7:4"], N),
            step(N, &[], json!(30300)),
            step(N, &["join:7:5"], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], N)
        ],
        "end": {
            "drops": {},
            "refusals": {},
            "counters": counters(0, 0, 0, 0, 0, 0),
            "cache": [],
            "joins": {"7": "failed"}
        }
    }));
}

/// A join refused by the allow-list; a join that connects and is sent (kicking the idle
/// writer); join_sent without a join in flight still caches; a finished join can start
/// again; close finishes joins with their phases and closes every connection that
/// arrives afterwards.
#[test]
fn join_connects_and_is_sent() {
    check(json!({
        "allow": [3, 4],
        "ops": [
            {"op": "join", "at": 0, "peer": 9, "relay": false, "direct": 1},
            {"op": "join", "at": 0, "peer": 3, "relay": true, "direct": 0},
            {"op": "join_connected", "at": 5, "peer": 3},
            {"op": "join_connected", "at": 6, "peer": 3},
            {"op": "idle", "at": 7, "peer": 3},
            {"op": "join_sent", "at": 8, "peer": 3, "conn": 30},
            {"op": "join_sent", "at": 9, "peer": 3, "conn": 31},
            {"op": "join", "at": 10, "peer": 4, "relay": false, "direct": 0},
            {"op": "join_sent", "at": 11, "peer": 4, "conn": 40},
            {"op": "join", "at": 12, "peer": 4, "relay": false, "direct": 0},
            {"op": "join_failed", "at": 13, "peer": 4},
            {"op": "close", "at": 14},
            {"op": "join", "at": 15, "peer": 4, "relay": false, "direct": 0},
            {"op": "join_sent", "at": 16, "peer": 4, "conn": 41},
            {"op": "timeout", "at": 5000},
            {"op": "connected", "at": 5001, "peer": 3, "channel": "protocol:0", "conn": 50},
            {"op": "dialed", "at": 5002, "peer": 3, "conn": 51},
            {"op": "accept", "at": 5003, "peer": 3, "alpn": "a", "conn": 52},
            {"op": "accept", "at": 5004, "peer": 5, "alpn": "a", "conn": 53}
        ],
        "steps": [
            step(json!("refused"), &[], N),
            step(json!("ok"), &["join:3:1"], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], json!(1007)),
            step(json!("gen:1"), &["kick:3"], json!(1007)),
            step(json!("gen:2"), &["close:30:409", "kick:3"], json!(1007)),
            step(json!("ok"), &["join:4:1"], json!(1007)),
            step(json!("gen:3"), &[], json!(1007)),
            step(json!("ok"), &["join:4:1"], json!(1007)),
            step(N, &[], json!(1007)),
            step(N, &["close:31:0", "close:40:0"], N),
            step(json!("ok"), &[], N),
            step(N, &["close:41:0"], N),
            step(N, &[], N),
            step(N, &["close:50:0"], N),
            step(N, &["close:51:0"], N),
            step(json!("no_adapter"), &[], N),
            step(json!("refused"), &[], N)
        ],
        "end": {
            "drops": {},
            "refusals": {"join/outbound": 1, "actor/inbound": 1},
            "counters": counters(0, 0, 0, 0, 0, 0),
            "cache": [],
            "joins": {"3": "sent", "4": "connecting:2"}
        }
    }));
}

/// disconnect (missing and present), closed (stale and current generation), fault.
#[test]
fn disconnect_closed_and_fault() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "connected", "at": 0, "peer": 1, "channel": "actor", "conn": 10},
            {"op": "connected", "at": 0, "peer": 1, "channel": "protocol:1", "conn": 11},
            {"op": "connected", "at": 0, "peer": 0, "channel": "telemetry", "conn": 12},
            {"op": "disconnect", "at": 1, "peer": 1, "channel": "telemetry"},
            {"op": "disconnect", "at": 2, "peer": 1, "channel": "actor"},
            {"op": "closed", "at": 3, "peer": 1, "channel": "protocol:1", "generation": 1},
            {"op": "closed", "at": 4, "peer": 1, "channel": "protocol:1", "generation": 2},
            {"op": "connected", "at": 5, "peer": 1, "channel": "protocol:0", "conn": 13},
            {"op": "fault", "at": 6, "peer": 1, "fatal": true},
            {"op": "fault", "at": 7, "peer": 1, "fatal": false},
            {"op": "fault", "at": 8, "peer": 1, "fatal": false, "channel": "telemetry"},
            {"op": "fault", "at": 8, "peer": 0, "fatal": true, "channel": "protocol:1"},
            {"op": "unread", "at": 9, "peer": 1, "channel": "protocol:0"},
            {"op": "unread", "at": 9, "peer": 2, "channel": "telemetry"}
        ],
        "steps": [
            step(json!("gen:1"), &[], N),
            step(json!("gen:2"), &[], N),
            step(json!("gen:3"), &[], N),
            step(N, &[], N),
            step(N, &["close:10:0"], N),
            step(N, &[], N),
            step(N, &[], N),
            step(json!("gen:4"), &[], N),
            step(json!("stop:1"), &[], N),
            step(json!("continue"), &[], N),
            step(json!("stop:1"), &[], N),
            step(json!("stop:1"), &[], N),
            step(json!("stop:2"), &[], N),
            step(json!("stop:2"), &[], N)
        ],
        "end": {
            "drops": {"malformed_stream": 2},
            "refusals": {},
            "counters": counters(0, 0, 0, 0, 0, 0),
            "cache": [[0, "telemetry", 3], [1, "protocol:0", 4]],
            "joins": {}
        }
    }));
}

/// Accepts on the switch (`s`) and substrate (`u`) ALPNs are cached on their channels
/// under the next generation, without kicking the peer's writer; `closed` with a stale
/// generation (another channel's, or one replaced) keeps the entry, with its own removes
/// it; `open`, `connected`, `fault`, `unread`, `open_failed` and `disconnect` take both
/// channels; the cache sorts `protocol:1` < `switch` < `substrate`; an actor accept kicks.
#[test]
fn switch_and_substrate_are_cached() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "idle", "at": 0, "peer": 1},
            {"op": "accept", "at": 1, "peer": 1, "alpn": "s", "conn": 10},
            {"op": "accept", "at": 2, "peer": 1, "alpn": "u", "conn": 11},
            {"op": "accept", "at": 3, "peer": 0, "alpn": "u", "conn": 12},
            {"op": "open", "at": 4, "peer": 1, "path": "switch", "channel": "switch"},
            {"op": "closed", "at": 5, "peer": 1, "channel": "switch", "generation": 2},
            {"op": "closed", "at": 6, "peer": 1, "channel": "substrate", "generation": 1},
            {"op": "accept", "at": 7, "peer": 1, "alpn": "s", "conn": 13},
            {"op": "closed", "at": 8, "peer": 1, "channel": "switch", "generation": 1},
            {"op": "open", "at": 9, "peer": 1, "path": "switch", "channel": "switch"},
            {"op": "closed", "at": 10, "peer": 1, "channel": "switch", "generation": 4},
            {"op": "closed", "at": 11, "peer": 1, "channel": "substrate", "generation": 2},
            {"op": "open", "at": 12, "peer": 1, "path": "substrate",
             "channel": "substrate"},
            {"op": "connected", "at": 13, "peer": 1, "channel": "switch", "conn": 14},
            {"op": "fault", "at": 14, "peer": 1, "fatal": false, "channel": "switch"},
            {"op": "unread", "at": 15, "peer": 0, "channel": "substrate"},
            {"op": "open_failed", "at": 16, "peer": 0, "channel": "substrate",
             "generation": 3},
            {"op": "disconnect", "at": 17, "peer": 1, "channel": "switch"},
            {"op": "accept", "at": 18, "peer": 2, "alpn": "u", "conn": 15},
            {"op": "accept", "at": 19, "peer": 2, "alpn": "s", "conn": 16},
            {"op": "accept", "at": 20, "peer": 2, "alpn": "p1", "conn": 17},
            {"op": "accept", "at": 21, "peer": 2, "alpn": "a", "conn": 18},
            {"op": "accept", "at": 22, "peer": 1, "alpn": "a", "conn": 19}
        ],
        "steps": [
            step(N, &[], json!(1000)),
            step(json!("switch:1"), &[], json!(1000)),
            step(json!("substrate:2"), &[], json!(1000)),
            step(json!("substrate:3"), &[], json!(1000)),
            step(json!("cached:1:10"), &[], json!(1000)),
            step(N, &[], json!(1000)),
            step(N, &[], json!(1000)),
            step(json!("switch:4"), &["close:10:409"], json!(1000)),
            step(N, &[], json!(1000)),
            step(json!("cached:4:13"), &[], json!(1000)),
            step(N, &[], json!(1000)),
            step(N, &[], json!(1000)),
            step(json!("dial:1"), &[], json!(1000)),
            step(json!("gen:5"), &[], json!(1000)),
            step(json!("stop:1"), &[], json!(1000)),
            step(json!("stop:2"), &[], json!(1000)),
            step(json!("dial:2"), &[], json!(1000)),
            step(N, &["close:14:0"], json!(1000)),
            step(json!("substrate:6"), &[], json!(1000)),
            step(json!("switch:7"), &[], json!(1000)),
            step(json!("protocol:1:8"), &[], json!(1000)),
            step(json!("actor:9"), &[], json!(1000)),
            step(json!("actor:10"), &["kick:1"], json!(1000))
        ],
        "end": {
            "drops": {},
            "refusals": {},
            "counters": counters(9, 0, 0, 0, 0, 0),
            "cache": [[1, "actor", 10], [2, "actor", 9], [2, "protocol:1", 8],
                      [2, "switch", 7], [2, "substrate", 6]],
            "joins": {},
            "opening": [[0, "substrate", 2, 0], [1, "substrate", 1, 0]],
            "failed_opens": []
        }
    }));
}

/// `unresponsive`: a liveness cut of an older connection (generation 1, replaced by 2 on
/// the same pair) changes nothing; of the current one removes it, counts an eviction and
/// closes it with code 408; a second report of it changes nothing. On `actor` it is evicted
/// like any other channel and no dial is queued (the next `send` dials). Generation 0,
/// another channel's pair and anything after `close` match nothing; an unknown channel is
/// an `Err`; `evictions` past `u64::MAX` is an `Err`.
#[test]
fn unresponsive_evicts_only_the_current_connection() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "connected", "at": 0, "peer": 1, "channel": "switch", "conn": 10},
            {"op": "connected", "at": 1, "peer": 1, "channel": "switch", "conn": 11},
            {"op": "unresponsive", "at": 2, "peer": 1, "channel": "switch",
             "generation": 1},
            {"op": "unresponsive", "at": 3, "peer": 1, "channel": "switch",
             "generation": 2},
            {"op": "unresponsive", "at": 4, "peer": 1, "channel": "switch",
             "generation": 2},
            {"op": "accept", "at": 5, "peer": 2, "alpn": "a", "conn": 12},
            {"op": "unresponsive", "at": 6, "peer": 2, "channel": "actor",
             "generation": 0},
            {"op": "unresponsive", "at": 6, "peer": 2, "channel": "telemetry",
             "generation": 3},
            {"op": "unresponsive", "at": 7, "peer": 2, "channel": "actor",
             "generation": 3},
            {"op": "send", "at": 8, "peer": 2},
            {"op": "connected", "at": 9, "peer": 1, "channel": "protocol:1", "conn": 13},
            {"op": "close", "at": 10},
            {"op": "unresponsive", "at": 11, "peer": 1, "channel": "protocol:1",
             "generation": 4}
        ],
        "steps": [
            step(json!("gen:1"), &[], N),
            step(json!("gen:2"), &["close:10:409"], N),
            // Generation 1 is not the entry's (2): a newer connection stays.
            step(N, &[], N),
            // The entry's generation: removed, evictions 1, close with 408.
            step(N, &["close:11:408"], N),
            // Nothing cached on (1, switch) any more.
            step(N, &[], N),
            step(json!("actor:3"), &[], N),
            // Generation 0 matches nothing; (2, telemetry) is not cached.
            step(N, &[], N),
            step(N, &[], N),
            // Evicted like any other channel: no dial.
            step(N, &["close:12:408"], N),
            // (2, actor) is gone: send dials and drops cache_miss.
            step(json!("drop:cache_miss"), &["dial:2:1"], N),
            step(json!("gen:4"), &[], N),
            // close ends the dial and closes (1, protocol:1) with 0.
            step(N, &["close:13:0"], N),
            step(N, &[], N)
        ],
        "end": {
            "drops": {"cache_miss": 1},
            "refusals": {},
            "counters": counters(1, 1, 0, 2, 0, 0),
            "cache": [],
            "joins": {}
        }
    }));
    // An unknown channel is undefined input.
    for channel in ["Switch", "protocol:2", ""] {
        let case = case_with(json!([{"op": "unresponsive", "at": 0, "peer": 1,
                                         "channel": channel, "generation": 1}]));
        assert!(run_case(&case).is_err(), "{channel:?} should be malformed");
    }
    // evictions past u64::MAX.
    let mut machine = Machine::new(None);
    machine.counters.evictions = u64::MAX;
    let connected = DriverOp::Connected {
        at: 0,
        peer: 1,
        channel: "switch".to_string(),
        conn: 1,
    };
    machine.apply(&connected).expect("well formed");
    let unresponsive = DriverOp::Unresponsive {
        at: 0,
        peer: 1,
        channel: "switch".to_string(),
        generation: 1,
    };
    assert!(machine.apply(&unresponsive).is_err());
}

/// One timeout fires timers of every kind in (due, kind, peer) order: an idle writer due
/// earlier first, then at equal due times dials (by peer), the join, the idle writer.
#[test]
fn timeout_fires_in_due_kind_peer_order() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "join", "at": 0, "peer": 3, "relay": false, "direct": 0},
            {"op": "send", "at": 0, "peer": 2},
            {"op": "send", "at": 0, "peer": 1},
            {"op": "join_failed", "at": 1000, "peer": 3},
            {"op": "idle", "at": 1900, "peer": 5},
            {"op": "idle", "at": 2000, "peer": 0},
            {"op": "dialed", "at": 2800, "peer": 2, "conn": null},
            {"op": "dialed", "at": 2800, "peer": 1, "conn": null},
            {"op": "timeout", "at": 3000}
        ],
        "steps": [
            step(json!("ok"), &["join:3:1"], N),
            step(json!("drop:cache_miss"), &["dial:2:1"], N),
            step(json!("drop:cache_miss"), &["dial:1:1"], N),
            step(N, &[], json!(3000)),
            step(N, &[], json!(2900)),
            step(N, &[], json!(2900)),
            step(N, &[], json!(2900)),
            step(N, &[], json!(2900)),
            step(N, &["retire:5", "dial:1:2", "dial:2:2", "join:3:2", "retire:0"], N)
        ],
        "end": {
            "drops": {"cache_miss": 2},
            "refusals": {},
            "counters": counters(0, 2, 2, 0, 0, 2),
            "cache": [],
            "joins": {"3": "connecting:2"}
        }
    }));
}

/// Close while a dial waits cancels its timer and ends it; afterwards batches drop
/// without dialing or making the writer busy, write failures are stale, sends miss,
/// idle does nothing, a second close does nothing.
#[test]
fn close_ends_dials_and_later_ops() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "send", "at": 0, "peer": 1},
            {"op": "dialed", "at": 10, "peer": 1, "conn": null},
            {"op": "close", "at": 20},
            {"op": "timeout", "at": 300},
            {"op": "dialed", "at": 400, "peer": 1, "conn": null},
            {"op": "batch", "at": 500, "peer": 1, "frames": 2},
            {"op": "write_failed", "at": 600, "peer": 1, "generation": 1, "frames": 1,
             "swim": true},
            {"op": "send", "at": 700, "peer": 1},
            {"op": "idle", "at": 800, "peer": 1},
            {"op": "close", "at": 900}
        ],
        "steps": [
            step(json!("drop:cache_miss"), &["dial:1:1"], N),
            step(N, &[], json!(210)),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], N),
            step(json!("drop"), &[], N),
            step(N, &["send_failed:1"], N),
            step(json!("drop:cache_miss"), &[], N),
            step(N, &[], N),
            step(N, &[], N)
        ],
        "end": {
            "drops": {"cache_miss": 4, "write_failed": 1},
            "refusals": {},
            "counters": counters(0, 1, 2, 0, 1, 0),
            "cache": [],
            "joins": {}
        }
    }));
}

/// 16 bytes of `byte`, written as a flow is (32 lowercase hex digits).
fn flow(byte: u8) -> String {
    hex(&[byte; FLOW_BYTES])
}

/// A control record's payload in lowercase hex: `op`, 16 bytes of `flow_byte`, the name's
/// length (one byte), the name, then `extra` trailing bytes.
fn payload(op: u8, flow_byte: u8, name: &[u8], extra: &[u8]) -> String {
    let mut bytes = vec![op];
    bytes.extend_from_slice(&[flow_byte; FLOW_BYTES]);
    bytes.push(u8::try_from(name.len()).expect("a test name fits one length byte"));
    bytes.extend_from_slice(name);
    bytes.extend_from_slice(extra);
    hex(&bytes)
}

/// register: ok, stale (equal and lower generation), forged (even with a higher
/// generation), ok for a second actor and for a newer generation; each ok announces to
/// every peer with a cached `actor` connection, by peer (not to a peer cached on
/// `telemetry` only); a later actor accept or dial announces every claim, by actor, to
/// the new connection's peer (after the kick), a telemetry accept announces nothing; after
/// close a register is ok and announces to nobody (a connection arriving then is closed,
/// not cached, so it learns nothing), and claims stay.
#[test]
fn register_claims_and_announce() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "accept", "at": 0, "peer": 2, "alpn": "a", "conn": 20},
            {"op": "connected", "at": 1, "peer": 1, "channel": "actor", "conn": 10},
            {"op": "connected", "at": 2, "peer": 3, "channel": "telemetry", "conn": 30},
            {"op": "register", "at": 3, "actor": 5, "generation": 2, "forged": false},
            {"op": "register", "at": 4, "actor": 5, "generation": 2, "forged": false},
            {"op": "register", "at": 5, "actor": 5, "generation": 1, "forged": false},
            {"op": "register", "at": 6, "actor": 5, "generation": 9, "forged": true},
            {"op": "register", "at": 7, "actor": 0, "generation": 1, "forged": false},
            {"op": "register", "at": 8, "actor": 5, "generation": 3, "forged": false},
            {"op": "idle", "at": 9, "peer": 4},
            {"op": "accept", "at": 10, "peer": 4, "alpn": "a", "conn": 40},
            {"op": "accept", "at": 11, "peer": 4, "alpn": "t", "conn": 41},
            {"op": "dialed", "at": 12, "peer": 3, "conn": 31},
            {"op": "register", "at": 13, "actor": 255, "generation": 7, "forged": false},
            {"op": "close", "at": 14},
            {"op": "register", "at": 15, "actor": 1, "generation": 1, "forged": false},
            {"op": "join_sent", "at": 16, "peer": 3, "conn": 50},
            {"op": "register", "at": 17, "actor": 5, "generation": 3, "forged": false}
        ],
        "steps": [
            step(json!("actor:1"), &[], N),
            step(json!("gen:2"), &[], N),
            step(json!("gen:3"), &[], N),
            step(json!("ok"), &["announce:1:5:2", "announce:2:5:2"], N),
            step(json!("stale"), &[], N),
            step(json!("stale"), &[], N),
            step(json!("bad_signature"), &[], N),
            step(json!("ok"), &["announce:1:0:1", "announce:2:0:1"], N),
            step(json!("ok"), &["announce:1:5:3", "announce:2:5:3"], N),
            step(N, &[], json!(1009)),
            step(
                json!("actor:4"),
                &["kick:4", "announce:4:0:1", "announce:4:5:3"],
                json!(1009)
            ),
            step(json!("telemetry:5"), &[], json!(1009)),
            step(json!("gen:6"), &["announce:3:0:1", "announce:3:5:3"], json!(1009)),
            step(
                json!("ok"),
                &["announce:1:255:7", "announce:2:255:7", "announce:3:255:7",
                  "announce:4:255:7"],
                json!(1009)
            ),
            step(
                N,
                &["close:10:0", "close:20:0", "close:31:0", "close:30:0", "close:40:0",
                  "close:41:0"],
                N
            ),
            step(json!("ok"), &[], N),
            step(N, &["close:50:0"], N),
            step(json!("stale"), &[], N)
        ],
        "end": {
            "drops": {},
            "refusals": {},
            "counters": counters(3, 0, 0, 0, 0, 0),
            "cache": [],
            "joins": {},
            "claims": [[0, 1], [1, 1], [5, 3], [255, 7]],
            "subscriptions": [],
            "controls": {}
        }
    }));
}

/// stream and control: subscribe started (each with the next publisher number, 1 to 6),
/// ignored (already subscribed), unknown_stream (before the stream exists; a 128-byte
/// name); malformed (17 bytes, op 3, n = 0, a non-UTF-8 name, a trailing byte, n = 129);
/// unsubscribe stopped (its publisher's number), then ignored, and ignored for a name that
/// is no stream; ended removes a live subscription with its publisher number and ignores
/// one that is not live (also when it names another live subscription's publisher); a
/// subscription ended can start again, under a new number; a control from a peer off the
/// allow-list (well-formed or not) changes nothing but the `telemetry/outbound` refusal
/// count; `end.subscriptions` sorts by collector, then stream, then flow.
#[test]
fn stream_and_control_subscriptions() {
    let (f0, f1, f2) = (flow(0), flow(1), flow(2));
    let mut short = vec![1u8];
    short.extend_from_slice(&[0u8; FLOW_BYTES]);
    let short = hex(&short);
    let publish_1_s0_0 = format!("publish:1:s0:{f0}:1");
    let publish_1_s1_1 = format!("publish:1:s1:{f1}:2");
    let publish_2_s0_2 = format!("publish:2:s0:{f2}:3");
    let unpublish_1_s1_1 = format!("unpublish:1:s1:{f1}:2");
    let publish_1_s1_0 = format!("publish:1:s1:{f0}:4");
    let publish_1_s0_2 = format!("publish:1:s0:{f2}:5");
    let publish_1_s0_0_again = format!("publish:1:s0:{f0}:6");
    check(json!({
        "allow": [1, 2],
        "ops": [
            {"op": "stream", "at": 0, "name": "s0"},
            {"op": "control", "at": 1, "peer": 1, "payload": payload(1, 0, b"s0", &[])},
            {"op": "control", "at": 2, "peer": 1, "payload": payload(1, 0, b"s0", &[])},
            {"op": "control", "at": 3, "peer": 1, "payload": payload(1, 0, b"s1", &[])},
            {"op": "stream", "at": 4, "name": "s1"},
            {"op": "control", "at": 5, "peer": 1, "payload": payload(1, 1, b"s1", &[])},
            {"op": "control", "at": 6, "peer": 2, "payload": payload(1, 2, b"s0", &[])},
            {"op": "control", "at": 7, "peer": 1, "payload": short},
            {"op": "control", "at": 8, "peer": 1, "payload": payload(3, 0, b"s0", &[])},
            {"op": "control", "at": 9, "peer": 1, "payload": payload(1, 0, b"", &[])},
            {"op": "control", "at": 10, "peer": 1,
             "payload": payload(1, 0, &[0xff, 0xfe], &[])},
            {"op": "control", "at": 11, "peer": 1, "payload": payload(1, 1, b"s0", &[0])},
            {"op": "control", "at": 12, "peer": 2,
             "payload": payload(1, 0, &[b'a'; 129], &[])},
            {"op": "control", "at": 13, "peer": 2,
             "payload": payload(1, 0, &[b'a'; 128], &[])},
            {"op": "control", "at": 14, "peer": 1, "payload": payload(2, 1, b"s1", &[])},
            {"op": "control", "at": 15, "peer": 1, "payload": payload(2, 1, b"s1", &[])},
            {"op": "control", "at": 16, "peer": 2, "payload": payload(2, 0, b"zz", &[])},
            {"op": "ended", "at": 17, "peer": 1, "name": "s0", "flow": f0, "publisher": 1},
            {"op": "ended", "at": 18, "peer": 1, "name": "s0", "flow": f0, "publisher": 1},
            // Publisher 3 is live, but for (2, s0, f2): (2, s1, f2) is not live.
            {"op": "ended", "at": 19, "peer": 2, "name": "s1", "flow": f2, "publisher": 3},
            {"op": "control", "at": 20, "peer": 1, "payload": payload(1, 0, b"s1", &[])},
            {"op": "control", "at": 21, "peer": 1, "payload": payload(1, 2, b"s0", &[])},
            {"op": "control", "at": 22, "peer": 1, "payload": payload(1, 0, b"s0", &[])},
            {"op": "control", "at": 23, "peer": 3, "payload": payload(1, 1, b"s0", &[])},
            {"op": "control", "at": 24, "peer": 3, "payload": short}
        ],
        "steps": [
            step(N, &[], N),
            step(N, &[publish_1_s0_0.as_str()], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[publish_1_s1_1.as_str()], N),
            step(N, &[publish_2_s0_2.as_str()], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[unpublish_1_s1_1.as_str()], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[publish_1_s1_0.as_str()], N),
            step(N, &[publish_1_s0_2.as_str()], N),
            step(N, &[publish_1_s0_0_again.as_str()], N),
            step(N, &[], N),
            step(N, &[], N)
        ],
        "end": {
            "drops": {},
            "refusals": {"telemetry/outbound": 2},
            "counters": counters(0, 0, 0, 0, 0, 0),
            "cache": [],
            "joins": {},
            "claims": [],
            "subscriptions": [[1, "s0", f0], [1, "s0", f2], [1, "s1", f0],
                              [2, "s0", f2]],
            "controls": {"started": 6, "ignored": 3, "unknown_stream": 2,
                         "malformed": 6, "stopped": 1}
        }
    }));
}

/// 256 live subscriptions (publishers 1 to 256): one more is `full` (nothing queued, no
/// number taken), one already subscribed is still `ignored`; an unsubscribe stops its own
/// publisher's number, and after it the next one starts as publisher 257.
#[test]
fn control_subscriptions_fill_up() {
    let mut ops = vec![json!({"op": "stream", "at": 0, "name": "s0"})];
    for peer in 0..=255u8 {
        ops.push(json!({"op": "control", "at": 0, "peer": peer,
                            "payload": payload(1, 0, b"s0", &[])}));
    }
    ops.push(json!({"op": "control", "at": 1, "peer": 0,
                        "payload": payload(1, 1, b"s0", &[])}));
    ops.push(json!({"op": "control", "at": 2, "peer": 0,
                        "payload": payload(1, 0, b"s0", &[])}));
    ops.push(json!({"op": "control", "at": 3, "peer": 5,
                        "payload": payload(2, 0, b"s0", &[])}));
    ops.push(json!({"op": "control", "at": 4, "peer": 0,
                        "payload": payload(1, 1, b"s0", &[])}));
    let got = run_case(&case_with(json!(ops))).expect("well formed");
    let last = got.steps.len() - 1;
    assert_eq!(
        got.steps[256].actions,
        vec![format!("publish:255:s0:{}:256", flow(0))]
    );
    assert_eq!(got.steps[last - 3].actions, Vec::<String>::new());
    assert_eq!(got.steps[last - 2].actions, Vec::<String>::new());
    assert_eq!(
        got.steps[last - 1].actions,
        vec![format!("unpublish:5:s0:{}:6", flow(0))]
    );
    assert_eq!(
        got.steps[last].actions,
        vec![format!("publish:0:s0:{}:257", flow(1))]
    );
    let controls: BTreeMap<String, u64> = [
        ("started".to_string(), 257),
        ("full".to_string(), 1),
        ("ignored".to_string(), 1),
        ("stopped".to_string(), 1),
    ]
    .into_iter()
    .collect();
    assert_eq!(got.end.controls, controls);
    assert_eq!(got.end.subscriptions.len(), 256);
    assert_eq!(
        got.end.subscriptions.first(),
        Some(&(0, "s0".to_string(), flow(0)))
    );
    assert!(!got
        .end
        .subscriptions
        .contains(&(5, "s0".to_string(), flow(0))));
}

/// ended names a publisher: subscribe (publisher 1), unsubscribe (`unpublish` of 1),
/// subscribe again (publisher 2); then the stopped publisher 1 ends, and the subscription
/// stays live under 2; only `ended` with publisher 2 removes it.
#[test]
fn ended_removes_only_the_live_publisher() {
    let f0 = flow(0);
    let publish_1 = format!("publish:1:s0:{f0}:1");
    let unpublish_1 = format!("unpublish:1:s0:{f0}:1");
    let publish_2 = format!("publish:1:s0:{f0}:2");
    check(json!({
        "allow": null,
        "ops": [
            {"op": "stream", "at": 0, "name": "s0"},
            {"op": "control", "at": 1, "peer": 1, "payload": payload(1, 0, b"s0", &[])},
            {"op": "control", "at": 2, "peer": 1, "payload": payload(2, 0, b"s0", &[])},
            {"op": "control", "at": 3, "peer": 1, "payload": payload(1, 0, b"s0", &[])},
            {"op": "ended", "at": 4, "peer": 1, "name": "s0", "flow": f0, "publisher": 1},
            {"op": "ended", "at": 5, "peer": 1, "name": "s0", "flow": f0, "publisher": 2}
        ],
        "steps": [
            step(N, &[], N),
            step(N, &[publish_1.as_str()], N),
            step(N, &[unpublish_1.as_str()], N),
            step(N, &[publish_2.as_str()], N),
            step(N, &[], N),
            step(N, &[], N)
        ],
        "end": {
            "drops": {},
            "refusals": {},
            "counters": counters(0, 0, 0, 0, 0, 0),
            "cache": [],
            "joins": {},
            "subscriptions": [],
            "controls": {"started": 2, "stopped": 1}
        }
    }));
    // The same, stopped before the last op: publisher 1's end leaves it live.
    let mut machine = Machine::new(None);
    let ops: Vec<DriverOp> = serde_json::from_value(json!([
        {"op": "stream", "at": 0, "name": "s0"},
        {"op": "control", "at": 1, "peer": 1, "payload": payload(1, 0, b"s0", &[])},
        {"op": "control", "at": 2, "peer": 1, "payload": payload(2, 0, b"s0", &[])},
        {"op": "control", "at": 3, "peer": 1, "payload": payload(1, 0, b"s0", &[])},
        {"op": "ended", "at": 4, "peer": 1, "name": "s0", "flow": f0, "publisher": 1}
    ]))
    .expect("parses");
    for op in &ops {
        machine.apply(op).expect("well formed");
    }
    assert_eq!(
        machine.end().subscriptions,
        vec![(1, "s0".to_string(), f0.clone())]
    );
    assert_eq!(
        machine.subscriptions.get(&(1, "s0".to_string(), f0)),
        Some(&2)
    );
}

/// egress_full adds its frames to drops `egress_full` (0 frames alone leaves it absent),
/// answers nothing, queues nothing and leaves timers alone.
#[test]
fn egress_full_adds_to_drops() {
    check(json!({
        "allow": null,
        "ops": [
            {"op": "egress_full", "at": 0, "frames": 0},
            {"op": "egress_full", "at": 1, "frames": 3},
            {"op": "idle", "at": 2, "peer": 1},
            {"op": "egress_full", "at": 3, "frames": 2},
            {"op": "send", "at": 4, "peer": 1},
            {"op": "egress_full", "at": 5, "frames": 1}
        ],
        "steps": [
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], json!(1002)),
            step(N, &[], json!(1002)),
            step(json!("drop:cache_miss"), &["dial:1:1"], json!(1002)),
            step(N, &[], json!(1002))
        ],
        "end": {
            "drops": {"egress_full": 6, "cache_miss": 1},
            "refusals": {},
            "counters": counters(0, 1, 0, 0, 0, 0),
            "cache": [],
            "joins": {},
            "claims": [],
            "subscriptions": [],
            "controls": {}
        }
    }));
    check(json!({
        "allow": null,
        "ops": [{"op": "egress_full", "at": 0, "frames": 0}],
        "steps": [step(N, &[], N)],
        "end": {
            "drops": {},
            "refusals": {},
            "counters": counters(0, 0, 0, 0, 0, 0),
            "cache": [],
            "joins": {},
            "claims": [],
            "subscriptions": [],
            "controls": {}
        }
    }));
}

/// The control decoder on its own: every field boundary.
#[test]
fn control_records_decode() {
    let decode = |text: String| decode_control(&parse_hex(&text, "payload").expect("hex"));
    assert_eq!(
        decode(payload(1, 2, b"s0", &[])),
        Some(Control::Subscribe {
            flow: flow(2),
            name: "s0".to_string()
        })
    );
    assert_eq!(
        decode(payload(2, 0xab, "é".as_bytes(), &[])),
        Some(Control::Unsubscribe {
            flow: flow(0xab),
            name: "é".to_string()
        })
    );
    assert!(decode(payload(1, 0, &[b'x'; 128], &[])).is_some());
    assert_eq!(decode(payload(1, 0, &[b'x'; 129], &[])), None);
    assert_eq!(decode(payload(0, 0, b"s0", &[])), None);
    assert_eq!(decode(payload(3, 0, b"s0", &[])), None);
    assert_eq!(decode(payload(255, 0, b"s0", &[])), None);
    assert_eq!(decode(payload(1, 0, b"", &[])), None);
    assert_eq!(decode(payload(1, 0, &[0xc3], &[])), None);
    assert_eq!(decode(payload(1, 0, b"s0", b"x")), None);
    assert_eq!(decode(String::new()), None);
    assert_eq!(decode("01".to_string()), None);
    // A declared length longer than what follows.
    let full = payload(1, 0, b"s0", &[]);
    assert_eq!(decode(full[..full.len() - 2].to_string()), None);
    // Hex and flows.
    assert_eq!(parse_hex("00ff7a", "x"), Ok(vec![0, 255, 0x7a]));
    assert!(parse_hex("0", "x").is_err());
    assert!(parse_hex("0A", "x").is_err());
    assert!(parse_hex("0g", "x").is_err());
    assert!(parse_hex("+1", "x").is_err());
    assert_eq!(parse_flow(&flow(9)), Ok(flow(9)));
    assert!(parse_flow(&flow(9)[2..]).is_err());
    assert!(parse_flow(&format!("{}00", flow(9))).is_err());
    assert!(parse_flow(&"AB".repeat(16)).is_err());
}

/// A case whose JSON is otherwise well formed, with the given ops and one dummy step each.
fn case_with(ops: serde_json::Value) -> DriverCase {
    let count = ops.as_array().map_or(0, Vec::len);
    let steps: Vec<serde_json::Value> = (0..count).map(|_| step(N, &[], N)).collect();
    serde_json::from_value(json!({
        "allow": null,
        "ops": ops,
        "steps": steps,
        "end": {"drops": {}, "refusals": {}, "counters": counters(0, 0, 0, 0, 0, 0),
                "cache": [], "joins": {}, "claims": [], "subscriptions": [],
                "controls": {}, "opening": [], "failed_opens": [], "relays": []}
    }))
    .expect("parses")
}

#[test]
fn malformed_inputs_are_errors() {
    let bad = [
        json!([{"op": "connected", "at": 0, "peer": 1, "channel": "protocol:2", "conn": 1}]),
        json!([{"op": "closed", "at": 0, "peer": 1, "channel": "Actor", "generation": 1}]),
        json!([{"op": "disconnect", "at": 0, "peer": 1, "channel": ""}]),
        json!([{"op": "unread", "at": 0, "peer": 1, "channel": "Switch"}]),
        json!([{"op": "closed", "at": 0, "peer": 1, "channel": "substrate:1",
                    "generation": 1}]),
        json!([{"op": "admit", "at": 0, "peer": 1, "path": "gossip",
                    "direction": "inbound"}]),
        json!([{"op": "admit", "at": 0, "peer": 1, "path": "actor", "direction": "up"}]),
        json!([{"op": "send", "at": 5, "peer": 1}, {"op": "send", "at": 4, "peer": 1}]),
        json!([{"op": "idle", "at": u64::MAX, "peer": 1}]),
        json!([{"op": "batch", "at": 0, "peer": 1, "frames": u64::MAX},
                   {"op": "batch", "at": 0, "peer": 1, "frames": 1}]),
        json!([{"op": "send", "at": 0, "peer": 1},
                   {"op": "dialed", "at": u64::MAX, "peer": 1, "conn": null}]),
        json!([{"op": "join", "at": 0, "peer": 1, "relay": false, "direct": 0},
                   {"op": "join_failed", "at": u64::MAX - 1999, "peer": 1}]),
        // A payload or flow that is not lowercase hex; a flow not 16 bytes.
        json!([{"op": "control", "at": 0, "peer": 1, "payload": "0"}]),
        json!([{"op": "control", "at": 0, "peer": 1, "payload": "zz"}]),
        json!([{"op": "control", "at": 0, "peer": 1,
                    "payload": payload(1, 0xab, b"s0", &[]).to_uppercase()}]),
        json!([{"op": "control", "at": 0, "peer": 1, "payload": " 01"}]),
        json!([{"op": "ended", "at": 0, "peer": 1, "name": "s0", "flow": "00",
                    "publisher": 1}]),
        json!([{"op": "ended", "at": 0, "peer": 1, "name": "s0", "flow": "",
                    "publisher": 1}]),
        json!([{"op": "ended", "at": 0, "peer": 1, "name": "s0",
                    "flow": format!("{}00", flow(0)), "publisher": 1}]),
        json!([{"op": "ended", "at": 0, "peer": 1, "name": "s0",
                    "flow": "AB".repeat(16), "publisher": 1}]),
        json!([{"op": "ended", "at": 0, "peer": 1, "name": "s0",
                    "flow": "0g".repeat(16), "publisher": 1}]),
        // Drops egress_full past u64::MAX.
        json!([{"op": "egress_full", "at": 0, "frames": u64::MAX},
                   {"op": "egress_full", "at": 0, "frames": 1}]),
        // The opens' ops name a channel too.
        json!([{"op": "open_waited", "at": 0, "peer": 1, "channel": "protocol:2",
                    "ticket": 1}]),
        json!([{"op": "open_dial_failed", "at": 0, "peer": 1, "channel": "Actor",
                    "ticket": 1, "abandoned": false}]),
        json!([{"op": "open_wait_abandoned", "at": 0, "peer": 1, "channel": "switch:0",
                    "ticket": 1}]),
        json!([{"op": "unresponsive", "at": 0, "peer": 1, "channel": "Switch",
                    "generation": 1}]),
    ];
    for ops in bad {
        let case = case_with(ops.clone());
        assert!(run_case(&case).is_err(), "{ops} should be malformed");
    }
    // One step too few.
    let mut case = case_with(json!([{"op": "send", "at": 0, "peer": 1}]));
    case.steps.clear();
    assert!(run_case(&case).is_err());
    // Equal times, an unknown ALPN and the largest representable due time are fine.
    let fine = case_with(json!([
        {"op": "accept", "at": 0, "peer": 1, "alpn": "nope", "conn": 1},
        {"op": "accept", "at": 0, "peer": 1, "alpn": "A", "conn": 2},
        {"op": "idle", "at": u64::MAX - 1000, "peer": 1},
        {"op": "timeout", "at": u64::MAX},
        // An empty payload is hex (of no bytes): the `malformed` verdict, not an error.
        // Nor is a stream named "", an ended subscription that never was (with publisher
        // numbers never issued, 0 and the largest), or a claim at the largest generation allowed.
        {"op": "control", "at": u64::MAX, "peer": 1, "payload": ""},
        {"op": "stream", "at": u64::MAX, "name": ""},
        {"op": "ended", "at": u64::MAX, "peer": 1, "name": "", "flow": flow(255),
         "publisher": 0},
        {"op": "ended", "at": u64::MAX, "peer": 1, "name": "", "flow": flow(255),
         "publisher": u64::MAX},
        {"op": "register", "at": u64::MAX, "actor": 255, "generation": 1_u64 << 48,
         "forged": false},
        // A ticket never issued (0, u64::MAX) matches nothing: the verdict, and nothing.
        {"op": "open_waited", "at": u64::MAX, "peer": 1, "channel": "actor", "ticket": 0},
        {"op": "open_dial_failed", "at": u64::MAX, "peer": 1, "channel": "actor",
         "ticket": u64::MAX, "abandoned": false}
    ]));
    let got = run_case(&fine).expect("well formed");
    assert_eq!(got.steps[9].result.as_deref(), Some("dial:1"));
    assert_eq!(got.steps[10].result, None);
    assert_eq!(got.end.opening, vec![(1, "actor".to_string(), 1, 0)]);
    assert_eq!(got.steps[0].result.as_deref(), Some("no_adapter"));
    assert_eq!(got.steps[2].timeout, Some(u64::MAX));
    assert_eq!(got.steps[3].actions, vec!["retire:1".to_string()]);
    assert_eq!(got.steps[8].result.as_deref(), Some("ok"));
    assert_eq!(
        got.end.controls,
        [("malformed".to_string(), 1)]
            .into_iter()
            .collect::<BTreeMap<String, u64>>()
    );
    assert_eq!(got.end.claims, vec![(255, 1 << 48)]);
}

/// The end of a case that only records and asks for relay hints.
fn relays_end(relays: serde_json::Value) -> serde_json::Value {
    json!({"drops": {}, "refusals": {}, "counters": counters(0, 0, 0, 0, 0, 0),
               "cache": [], "joins": {}, "relays": relays})
}

/// Relay hints, by hand from §3 and §4: an empty `relays_seen` records nothing; a hint is
/// the answer when `given` is empty, `given` when it is not; re-recording a peer replaces
/// its hint and makes it the newest; a fourth peer forgets the peer recorded longest ago
/// (by its last record: re-records count, `relays_for` does not); `end.relays` is sorted
/// by peer, not by record. Then every malformed relay string, in either op, is an `Err`.
#[test]
fn relay_hints_recorded_replaced_and_forgotten() {
    let r1 = "https://relay-1.example:443";
    let ops = [
        // 0, 1: an empty list is no hint; no hint and no `given` answer "".
        json!({"op": "relays_seen", "at": 0, "peer": 1, "relays": []}),
        json!({"op": "relays_for", "at": 1, "peer": 1, "given": []}),
        // 2–4: peer 1's hint is the answer for an empty `given`; a non-empty `given` wins.
        json!({"op": "relays_seen", "at": 2, "peer": 1, "relays": [r1]}),
        json!({"op": "relays_for", "at": 3, "peer": 1, "given": []}),
        json!({"op": "relays_for", "at": 4, "peer": 1,
                   "given": ["r9.example", "r8.example"]}),
        // 5–8: peers 2 and 3, then peer 1 again: its hint is replaced and it is the newest
        // (records oldest first: 2, 3, 1).
        json!({"op": "relays_seen", "at": 5, "peer": 2,
                   "relays": ["r2a.example", "r2b.example"]}),
        json!({"op": "relays_seen", "at": 6, "peer": 3, "relays": ["r3.example"]}),
        json!({"op": "relays_seen", "at": 7, "peer": 1,
                   "relays": ["r1b.example", "r1c.example"]}),
        json!({"op": "relays_for", "at": 8, "peer": 1, "given": []}),
        // 9–12: a fourth peer: peer 2, recorded longest ago, is forgotten (not peer 1,
        // whose first record is older but who was recorded again). Peer 2 then answers ""
        // for an empty `given`, and `given` for a non-empty one. (Records: 3, 1, 4.)
        json!({"op": "relays_seen", "at": 9, "peer": 4, "relays": ["r4.example"]}),
        json!({"op": "relays_for", "at": 10, "peer": 2, "given": []}),
        json!({"op": "relays_for", "at": 11, "peer": 2, "given": ["r2x.example"]}),
        json!({"op": "relays_for", "at": 12, "peer": 1, "given": []}),
        // 13–16: an empty record of a fifth peer forgets nobody; asking for peer 3 does
        // not make it newer, so peer 255 forgets it. (Records: 1, 4, 255.)
        json!({"op": "relays_seen", "at": 13, "peer": 0, "relays": []}),
        json!({"op": "relays_for", "at": 14, "peer": 3, "given": []}),
        json!({"op": "relays_seen", "at": 15, "peer": 255, "relays": ["r255.example"]}),
        json!({"op": "relays_for", "at": 16, "peer": 3, "given": []}),
        // 17–19: re-recording peer 4 (3 peers: nobody forgotten) makes it newer than
        // 255, so the next new peer forgets peer 1. (Records: 255, 4, 2.)
        json!({"op": "relays_seen", "at": 17, "peer": 4, "relays": ["r4b.example"]}),
        json!({"op": "relays_seen", "at": 18, "peer": 2, "relays": ["r2c.example"]}),
        json!({"op": "relays_for", "at": 19, "peer": 1, "given": []}),
    ];
    let steps = [
        step(N, &[], N),
        step(json!(""), &[], N),
        step(N, &[], N),
        step(json!(r1), &[], N),
        step(json!("r9.example,r8.example"), &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(json!("r1b.example,r1c.example"), &[], N),
        step(N, &[], N),
        step(json!(""), &[], N),
        step(json!("r2x.example"), &[], N),
        step(json!("r1b.example,r1c.example"), &[], N),
        step(N, &[], N),
        step(json!("r3.example"), &[], N),
        step(N, &[], N),
        step(json!(""), &[], N),
        step(N, &[], N),
        step(N, &[], N),
        step(json!(""), &[], N),
    ];
    let allow = json!(null);
    // After op 1: no hint.
    check_prefix(allow.clone(), &ops, &steps, 2, relays_end(json!([])));
    // After op 8: three peers, by peer (the records were 2, 3, 1).
    check_prefix(
        allow.clone(),
        &ops,
        &steps,
        9,
        relays_end(json!([
            [1, ["r1b.example", "r1c.example"]],
            [2, ["r2a.example", "r2b.example"]],
            [3, ["r3.example"]]
        ])),
    );
    // After op 12: peer 2 forgotten.
    check_prefix(
        allow.clone(),
        &ops,
        &steps,
        13,
        relays_end(json!([
            [1, ["r1b.example", "r1c.example"]],
            [3, ["r3.example"]],
            [4, ["r4.example"]]
        ])),
    );
    // After op 16: peer 3 forgotten.
    check_prefix(
        allow.clone(),
        &ops,
        &steps,
        17,
        relays_end(json!([
            [1, ["r1b.example", "r1c.example"]],
            [4, ["r4.example"]],
            [255, ["r255.example"]]
        ])),
    );
    // The whole case: peer 1 forgotten.
    check_prefix(
        allow,
        &ops,
        &steps,
        ops.len(),
        relays_end(json!([
            [2, ["r2c.example"]],
            [4, ["r4b.example"]],
            [255, ["r255.example"]]
        ])),
    );

    // Malformed relay strings: an uppercase letter, a space, the empty string, 65
    // characters, a character outside the set, a non-ASCII one; alone or after a valid
    // relay, in `relays_seen`'s `relays` and in `relays_for`'s `given` (also when the
    // peer has a hint).
    let long = "a".repeat(65);
    let bad = [
        "R1.example",
        "r1 example",
        "",
        long.as_str(),
        "r1_example",
        "é",
    ];
    for relay in bad {
        for list in [json!([relay]), json!(["r1.example", relay])] {
            for ops in [
                json!([{"op": "relays_seen", "at": 0, "peer": 1, "relays": list}]),
                json!([{"op": "relays_for", "at": 0, "peer": 1, "given": list}]),
                json!([{"op": "relays_seen", "at": 0, "peer": 1, "relays": ["r1.example"]},
                           {"op": "relays_for", "at": 1, "peer": 1, "given": list}]),
            ] {
                let case = case_with(ops.clone());
                assert!(run_case(&case).is_err(), "{ops} should be malformed");
            }
        }
    }
    // Every allowed character, and exactly 64 characters, are fine.
    let all = "abcdefghijklmnopqrstuvwxyz0123456789:/.-";
    let longest = "a".repeat(64);
    let fine = case_with(json!([
        {"op": "relays_seen", "at": 0, "peer": 1, "relays": [all, longest]},
        {"op": "relays_for", "at": 1, "peer": 1, "given": []},
        {"op": "relays_for", "at": 2, "peer": 2, "given": [longest, all]}
    ]));
    let got = run_case(&fine).expect("well formed");
    assert_eq!(got.steps[1].result, Some(format!("{all},{longest}")));
    assert_eq!(got.steps[2].result, Some(format!("{longest},{all}")));
    assert_eq!(
        got.end.relays,
        vec![(1, vec![all.to_string(), longest.clone()])]
    );
}

/// Readings (module doc): the relay ops have no admission (a peer off the allow-list
/// records and asks, no refusal), and `close` leaves the hints (its rule does not name
/// them); a hint keeps its order and repeats.
#[test]
fn relay_hints_ignore_admission_and_close() {
    check(json!({
        "allow": [1],
        "ops": [
            {"op": "relays_seen", "at": 0, "peer": 2, "relays": ["r2.example"]},
            {"op": "close", "at": 1},
            {"op": "relays_seen", "at": 2, "peer": 251,
             "relays": ["r.example", "q.example", "r.example"]},
            {"op": "relays_for", "at": 3, "peer": 2, "given": []},
            {"op": "relays_for", "at": 4, "peer": 251, "given": []}
        ],
        "steps": [
            step(N, &[], N),
            step(N, &[], N),
            step(N, &[], N),
            step(json!("r2.example"), &[], N),
            step(json!("r.example,q.example,r.example"), &[], N)
        ],
        "end": relays_end(json!([[2, ["r2.example"]],
                                 [251, ["r.example", "q.example", "r.example"]]]))
    }));
}

#[test]
fn generation_overflow_is_an_error() {
    let mut machine = Machine::new(None);
    machine.last_generation = u64::MAX - 1;
    let op = |conn| DriverOp::Connected {
        at: 0,
        peer: 1,
        channel: "actor".to_string(),
        conn,
    };
    let step = machine.apply(&op(1)).expect("the last generation is fine");
    assert_eq!(step.result, Some(format!("gen:{}", u64::MAX)));
    assert!(machine.apply(&op(2)).is_err());
}

#[test]
fn join_and_dial_schedules() {
    assert_eq!(join_wait_after(0), None);
    assert_eq!(join_wait_after(1), Some(2_000));
    assert_eq!(join_wait_after(2), Some(4_000));
    assert_eq!(join_wait_after(3), Some(8_000));
    assert_eq!(join_wait_after(4), Some(16_000));
    assert_eq!(join_wait_after(5), None);
    assert_eq!(join_wait_after(u32::MAX), None);
    assert_eq!(dial_wait_after(1), Some(200));
    assert_eq!(dial_wait_after(2), Some(600));
    assert_eq!(dial_wait_after(3), None);
}

/// Random op sequences (a fixed linear congruential generator, edge values included)
/// never panic; well-formed ones succeed and give one step per op.
#[test]
fn random_cases_never_panic() {
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move |bound: u64| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % bound.max(1)
    };
    let channels = crate::generate::DRIVER_CHANNELS;
    let alpns = ["a", "t", "p0", "p1", "s", "u", "zz"];
    let paths = [
        "actor",
        "join",
        "telemetry",
        "protocol",
        "switch",
        "substrate",
        "unknown",
    ];
    let streams = ["s0", "s1", ""];
    // Control record names: two streams, an empty one (n = 0) and a non-UTF-8 one.
    let names: [&[u8]; 4] = [b"s0", b"s1", b"", &[0xff]];
    // Relay strings, all valid: a walk's `relays_seen` and `relays_for` lists are 0–2 of
    // them.
    let relay_names = [
        "https://relay-1.example:443",
        "r2.example",
        "quic://10.0.0.3/x",
    ];
    // What the walks reached, so that the opens' rules are exercised and not just parsed:
    // `wait:` and `failed` answers, and failed dials that pushed an entry out of failed
    // opens (the cap of 2).
    let (mut waits, mut failed, mut evicted) = (0u32, 0u32, 0u32);
    // ... and relay hints that forgot a peer (the cap of 3; the walk draws from 6 peers).
    let mut forgotten = 0u32;
    // ... and the waiters' side of caching: a waiter of a dial in flight that heard
    // `cached:` and was forgotten, an `open_wait_abandoned` that forgot a waiter, a failed
    // dial with waiters kept out of failed opens because its pair was cached, and an
    // `accept` that took a pair out of failed opens.
    let (mut took_cached, mut abandons, mut kept_out, mut cleared) = (0u32, 0u32, 0u32, 0u32);
    for _ in 0..500 {
        let peers = [0u8, 1, 2, 249, 250, 255];
        let mut at: u64 = 0;
        let mut ops = Vec::new();
        if next(3) == 0 {
            // A walk about opens: several opens of five pairs (admitted by both allows
            // below), then a report of each pair's dial (sometimes after an `accept` of
            // the pair on its ALPN while that dial is in flight, or a waiter asking again
            // or going away), then mostly their waiters asking again or going away, among
            // fresh opens, accepts, stale reports, connections and a rare close.
            let pairs: [(u8, &str, &str, &str); 5] = [
                (1, "protocol", "protocol:0", "p0"),
                (1, "protocol", "protocol:1", "p1"),
                (250, "actor", "actor", "a"),
                (1, "telemetry", "telemetry", "t"),
                (250, "switch", "switch", "s"),
            ];
            // The ticket of each pair's first dial: one counter, in the order the pairs
            // are first opened (0: never opened, a ticket that matches nothing).
            let mut tickets = [0u64; 5];
            let mut issued = 0u64;
            for _ in 0..4 + next(14) {
                let index = next(5) as usize;
                let (peer, path, channel, _) = pairs[index];
                if tickets[index] == 0 {
                    issued += 1;
                    tickets[index] = issued;
                }
                ops.push(json!({"op": "open", "at": at, "peer": peer, "path": path,
                                    "channel": channel}));
            }
            // Mostly the pair's first dial's ticket (`own`); one time in `odds` another
            // small one (0–7: 0 and unissued ones match nothing, others may be a later
            // dial's).
            fn ticket_of(next: &mut impl FnMut(u64) -> u64, own: u64, odds: u64) -> u64 {
                if next(odds) == 0 {
                    next(8)
                } else {
                    own
                }
            }
            let first = next(5) as usize;
            for offset in 0..5 {
                at += next(50);
                let index = (first + offset) % 5;
                let (peer, _, channel, alpn) = pairs[index];
                let own = tickets[index];
                // While the dial is in flight: a connection accepted on the pair's ALPN,
                // then maybe a waiter asking again (it hears `cached:`) or going away.
                if next(3) == 0 {
                    ops.push(json!({"op": "accept", "at": at, "peer": peer, "alpn": alpn,
                                        "conn": next(5)}));
                }
                match next(4) {
                    0 => ops.push(json!({"op": "open_waited", "at": at, "peer": peer,
                                             "channel": channel,
                                             "ticket": ticket_of(&mut next, own, 4)})),
                    1 => ops.push(json!({"op": "open_wait_abandoned", "at": at,
                                             "peer": peer, "channel": channel,
                                             "ticket": ticket_of(&mut next, own, 4)})),
                    _ => {}
                }
                ops.push(json!({"op": "open_dial_failed", "at": at, "peer": peer,
                                    "channel": channel, "ticket": ticket_of(&mut next, own, 4),
                                    "abandoned": next(3) == 0}));
            }
            for _ in 0..2 + next(14) {
                at += next(50);
                let index = next(5) as usize;
                let (peer, path, channel, alpn) = pairs[index];
                let own = tickets[index];
                let op = match next(14) {
                    0..=5 => json!({"op": "open_waited", "at": at, "peer": peer,
                                        "channel": channel,
                                        "ticket": ticket_of(&mut next, own, 3)}),
                    6 | 7 => json!({"op": "open_wait_abandoned", "at": at, "peer": peer,
                                        "channel": channel,
                                        "ticket": ticket_of(&mut next, own, 3)}),
                    8 | 9 => json!({"op": "open", "at": at, "peer": peer, "path": path,
                                        "channel": channel}),
                    10 => json!({"op": "open_dial_failed", "at": at, "peer": peer,
                                     "channel": channel, "ticket": ticket_of(&mut next, own, 2),
                                     "abandoned": next(3) == 0}),
                    11 => json!({"op": "accept", "at": at, "peer": peer, "alpn": alpn,
                                     "conn": next(5)}),
                    12 if next(2) == 0 => json!({"op": "connected", "at": at,
                                     "peer": peer, "channel": channel, "conn": next(5)}),
                    12 => json!({"op": "closed", "at": at, "peer": peer,
                                     "channel": channel, "generation": next(4)}),
                    _ if next(4) == 0 => json!({"op": "close", "at": at}),
                    _ => json!({"op": "open_failed", "at": at, "peer": peer,
                                    "channel": channel, "generation": next(3)}),
                };
                ops.push(op);
            }
        } else {
            for _ in 0..next(40) {
                at += next(3) * next(3_000);
                let peer = peers[next(6) as usize];
                let op = match next(28) {
                    0 => json!({"op": "accept", "at": at, "peer": peer,
                                    "alpn": alpns[next(7) as usize], "conn": next(5)}),
                    1 => json!({"op": "connected", "at": at, "peer": peer,
                                    "channel": channels[next(6) as usize], "conn": next(5)}),
                    2 => json!({"op": "closed", "at": at, "peer": peer,
                                    "channel": channels[next(6) as usize], "generation": next(6)}),
                    3 => json!({"op": "disconnect", "at": at, "peer": peer,
                                    "channel": channels[next(6) as usize]}),
                    4 => json!({"op": "admit", "at": at, "peer": peer,
                                    "path": paths[next(7) as usize], "direction": "outbound"}),
                    5 => json!({"op": "send", "at": at, "peer": peer}),
                    6 => json!({"op": "batch", "at": at, "peer": peer, "frames": next(4),
                                    "swim": next(2) == 0, "stream": next(4)}),
                    7 => json!({"op": "write_failed", "at": at, "peer": peer,
                                    "generation": next(6), "frames": next(4),
                                    "swim": next(2) == 0}),
                    8 => json!({"op": "idle", "at": at, "peer": peer}),
                    9 => json!({"op": "dialed", "at": at, "peer": peer,
                                    "conn": (next(2) != 0).then(|| next(5))}),
                    10 => json!({"op": "join", "at": at, "peer": peer, "relay": false,
                                     "direct": 0}),
                    11 => json!({"op": "join_connected", "at": at, "peer": peer}),
                    12 => json!({"op": "join_sent", "at": at, "peer": peer, "conn": next(5)}),
                    13 => json!({"op": "join_failed", "at": at, "peer": peer}),
                    14 if next(2) == 0 => {
                        json!({"op": "fault", "at": at, "peer": peer, "fatal": next(2) == 0,
                                   "channel": channels[next(6) as usize]})
                    }
                    14 if next(3) == 0 => json!({"op": "unread", "at": at, "peer": peer,
                                     "channel": channels[next(6) as usize]}),
                    14 if next(2) == 0 => json!({"op": "stopped", "at": at, "peer": peer,
                                     "generation": next(4)}),
                    14 if next(2) == 0 => json!({"op": "open", "at": at, "peer": peer,
                                     "path": paths[next(7) as usize],
                                     "channel": channels[next(6) as usize]}),
                    14 if next(3) == 0 => json!({"op": "open_dial_failed", "at": at,
                                     "peer": peer, "channel": channels[next(6) as usize],
                                     "ticket": next(4) + 1, "abandoned": next(3) == 0}),
                    14 if next(2) == 0 => json!({"op": "open_waited", "at": at,
                                     "peer": peer, "channel": channels[next(6) as usize],
                                     "ticket": next(4) + 1}),
                    14 if next(2) == 0 => json!({"op": "open_wait_abandoned", "at": at,
                                     "peer": peer, "channel": channels[next(6) as usize],
                                     "ticket": next(4) + 1}),
                    14 => json!({"op": "open_failed", "at": at, "peer": peer,
                                     "channel": channels[next(6) as usize], "generation": next(4)}),
                    15 => json!({"op": "egress_full", "at": at, "frames": next(4)}),
                    16 => json!({"op": "register", "at": at, "actor": next(5),
                                     "generation": next(5), "forged": next(10) == 0}),
                    17 => json!({"op": "stream", "at": at, "name": streams[next(3) as usize]}),
                    18 | 19 => {
                        // Mostly subscribe / unsubscribe; ops 0 and 3; sometimes cut short
                        // or one byte too long.
                        let mut bytes = vec![[1u8, 2, 1, 2, 0, 3][next(6) as usize]];
                        bytes.extend_from_slice(&[next(3) as u8; FLOW_BYTES]);
                        let name = names[next(4) as usize];
                        bytes.push(name.len() as u8);
                        bytes.extend_from_slice(name);
                        match next(6) {
                            0 => bytes.truncate(next(bytes.len() as u64 + 1) as usize),
                            1 => bytes.push(0),
                            _ => {}
                        }
                        json!({"op": "control", "at": at, "peer": peer, "payload": hex(&bytes)})
                    }
                    // Publisher numbers from a small range (0 included: it matches
                    // nothing), so that it often names a live subscription's.
                    20 => json!({"op": "ended", "at": at, "peer": peer,
                                     "name": streams[next(3) as usize],
                                     "flow": flow(next(3) as u8), "publisher": next(5)}),
                    21 => json!({"op": "timeout", "at": at}),
                    // As often as `closed`, generations from the same small range (0
                    // included: it matches nothing), so it often names the current one.
                    22 => json!({"op": "unresponsive", "at": at, "peer": peer,
                                     "channel": channels[next(6) as usize],
                                     "generation": next(6)}),
                    // Three arms for `relays_seen`, so that a walk often records more than
                    // 3 peers and the oldest is forgotten; lists of 0–2 relays (0: no
                    // hint), repeats possible.
                    23..=25 => {
                        let relays: Vec<&str> = (0..next(3))
                            .map(|_| relay_names[next(3) as usize])
                            .collect();
                        json!({"op": "relays_seen", "at": at, "peer": peer,
                                   "relays": relays})
                    }
                    26 => {
                        let given: Vec<&str> = (0..next(3))
                            .map(|_| relay_names[next(3) as usize])
                            .collect();
                        json!({"op": "relays_for", "at": at, "peer": peer, "given": given})
                    }
                    _ => json!({"op": "close", "at": at}),
                };
                ops.push(op);
            }
        }
        let allow = if next(2) == 0 {
            json!(null)
        } else {
            json!([1, 250])
        };
        let mut case = case_with(json!(ops));
        case.allow = serde_json::from_value(allow).expect("allow");
        let got = run_case(&case).expect("well formed");
        assert_eq!(got.steps.len(), case.ops.len());
        for step in &got.steps {
            match step.result.as_deref() {
                Some("failed") => failed += 1,
                Some(result) if result.starts_with("wait:") => waits += 1,
                _ => {}
            }
        }
        // The same walk on a machine we can look into: failed opens never hold more than
        // 2 entries, and a failed dial with waiters that adds a third pushes one out;
        // failed opens never hold a cached pair or an entry at 0 waiters.
        let mut machine = Machine::new(case.allow.clone());
        for op in &case.ops {
            // A failed dial of the pair in flight with waiters (it leaves opening).
            let fails_with_waiters = match op {
                DriverOp::OpenDialFailed {
                    peer,
                    channel,
                    ticket,
                    abandoned,
                    ..
                } => {
                    let key = (*peer, Channel::parse(channel).expect("a channel"));
                    (!*abandoned
                        && machine
                            .opening
                            .get(&key)
                            .is_some_and(|open| open.ticket == *ticket && open.waiters > 0))
                    .then_some(key)
                }
                _ => None,
            };
            // ... that adds an entry to failed opens (the pair is not cached and has none).
            let inserts = fails_with_waiters.is_some_and(|key| {
                !machine.cache.contains_key(&key) && !machine.failed_opens.contains_key(&key)
            });
            let full = machine.failed_opens.len() == FAILED_OPENS_KEPT;
            let opening_before = machine.opening.clone();
            let failed_before = machine.failed_opens.clone();
            let cache_before = machine.cache.clone();
            // A non-empty record of a peer without a hint while 3 peers have one.
            let forgets = match op {
                DriverOp::RelaysSeen { peer, relays, .. } => {
                    !relays.is_empty()
                        && !machine.relay_hints.contains_key(peer)
                        && machine.relay_hints.len() == RELAY_HINTS_KEPT
                }
                _ => false,
            };
            let before = machine.relay_hints.clone();
            let observed = machine.apply(op).expect("well formed");
            assert!(machine.failed_opens.len() <= FAILED_OPENS_KEPT);
            assert!(machine.relay_hints.len() <= RELAY_HINTS_KEPT);
            for (key, entry) in &machine.failed_opens {
                assert!(
                    !machine.cache.contains_key(key),
                    "{key:?} failed and cached"
                );
                assert!(entry.waiters > 0, "{key:?} held at 0 waiters");
            }
            if inserts && full {
                evicted += 1;
            }
            // A failed dial with waiters of a cached pair keeps no entry.
            if let Some(key) = fails_with_waiters {
                if cache_before.contains_key(&key) {
                    assert!(!machine.failed_opens.contains_key(&key));
                    kept_out += 1;
                }
            }
            // Waiters of all opening and failed-opens entries.
            let waiters = |opening: &BTreeMap<(u8, Channel), Ticketed>,
                           failed: &BTreeMap<(u8, Channel), Ticketed>| {
                opening
                    .values()
                    .chain(failed.values())
                    .map(|entry| entry.waiters)
                    .sum::<u64>()
            };
            match op {
                // Forgetting: at most one waiter, the cache and opening's pairs untouched,
                // no answer and no action.
                DriverOp::OpenWaitAbandoned { .. } => {
                    assert_eq!(observed.result, None);
                    assert!(observed.actions.is_empty());
                    assert_eq!(machine.cache, cache_before);
                    assert!(machine.opening.keys().eq(opening_before.keys()));
                    let (was, is) = (
                        waiters(&opening_before, &failed_before),
                        waiters(&machine.opening, &machine.failed_opens),
                    );
                    assert!(is == was || is + 1 == was, "{was} waiters became {is}");
                    if is < was {
                        abandons += 1;
                    }
                }
                // A waiter of a dial in flight that hears `cached:` is forgotten.
                DriverOp::OpenWaited {
                    peer,
                    channel,
                    ticket,
                    ..
                } => {
                    let key = (*peer, Channel::parse(channel).expect("a channel"));
                    let in_flight = opening_before
                        .get(&key)
                        .filter(|open| open.ticket == *ticket && open.waiters > 0);
                    let cached = observed
                        .result
                        .as_deref()
                        .is_some_and(|result| result.starts_with("cached:"));
                    if let (Some(open), true) = (in_flight, cached) {
                        assert_eq!(
                            machine.opening.get(&key).map(|now| now.waiters + 1),
                            Some(open.waiters)
                        );
                        took_cached += 1;
                    }
                }
                // An accept that cached a pair with a failed-opens entry took it out.
                DriverOp::Accept { peer, .. } => {
                    let took_out = failed_before.keys().any(|key| {
                        key.0 == *peer
                            && machine.cache.get(key) != cache_before.get(key)
                            && !machine.failed_opens.contains_key(key)
                    });
                    if took_out {
                        cleared += 1;
                    }
                }
                _ => {}
            }
            match op {
                // The peer recorded longest ago is the one forgotten.
                DriverOp::RelaysSeen { peer, relays, .. } if forgets => {
                    let oldest = before
                        .iter()
                        .min_by_key(|(_, hint)| hint.recorded)
                        .map(|(&peer, _)| peer)
                        .expect("3 hints");
                    assert!(!machine.relay_hints.contains_key(&oldest));
                    assert_eq!(
                        machine.relay_hints.get(peer).map(|hint| &hint.relays),
                        Some(relays)
                    );
                    forgotten += 1;
                }
                // `relays_for` changes nothing.
                DriverOp::RelaysFor { .. } => {
                    assert_eq!(machine.relay_hints, before);
                    assert!(observed.result.is_some());
                }
                _ => {}
            }
        }
    }
    assert!(
        waits > 0
            && failed > 0
            && evicted > 0
            && forgotten > 0
            && took_cached > 0
            && abandons > 0
            && kept_out > 0
            && cleared > 0,
        "the walks reached {waits} waits, {failed} failed, {evicted} evictions, \
             {forgotten} forgotten relay hints, {took_cached} waiters that took a cached \
             connection, {abandons} abandoned waiters, {kept_out} failed dials of cached \
             pairs, {cleared} failed opens cleared by an accept"
    );
    // Extreme values: errors are fine, panics are not.
    let extreme = case_with(json!([
        {"op": "batch", "at": u64::MAX, "peer": 255, "frames": u64::MAX},
        {"op": "write_failed", "at": u64::MAX, "peer": 255, "generation": u64::MAX,
         "frames": u64::MAX, "swim": true},
        {"op": "timeout", "at": u64::MAX}
    ]));
    let _ = run_case(&extreme);
    let extreme = case_with(json!([
        {"op": "egress_full", "at": u64::MAX, "frames": u64::MAX},
        {"op": "register", "at": u64::MAX, "actor": 255, "generation": 1_u64 << 48,
         "forged": false},
        {"op": "control", "at": u64::MAX, "peer": 255, "payload": "ff".repeat(300)},
        {"op": "control", "at": u64::MAX, "peer": 255, "payload": "é"},
        {"op": "ended", "at": u64::MAX, "peer": 255, "name": "é", "flow": "é",
         "publisher": u64::MAX}
    ]));
    let _ = run_case(&extreme);
}
