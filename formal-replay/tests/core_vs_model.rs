//! Core against the reference model over long random op sequences: the model fills in every
//! observation of a random case, then core must replay it exactly. 10,000 cases per machine.

use proptest::prelude::*;
use serde_json::{json, Value};

use tether_formal_replay::replay::complete_with_model;
use tether_formal_replay::{check_case, Engine};

const CASES: u32 = 10_000;
const OPS_MAX: usize = 200;

fn agree(section: &str, inputs: Value) -> Result<(), TestCaseError> {
    let case = complete_with_model(section, &inputs)
        .map_err(|failure| TestCaseError::fail(format!("model: {failure}")))?;
    check_case(section, &case, Engine::Core)
        .map_err(|failure| TestCaseError::fail(format!("{section}: {failure}\ncase: {case}")))
}

/// Counts that stress both small windows and the top of u64.
fn amount() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 0u64..6,
        1 => Just(u64::MAX),
        1 => Just(u64::MAX - 1),
        1 => any::<u64>(),
    ]
}

fn stream() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        Just(None),
        prop::sample::select(vec!["", "a", "b", "A", "input"]).prop_map(|s| Some(s.to_owned()))
    ]
}

fn steps_like(len: usize, step: Value) -> Vec<Value> {
    vec![step; len]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(CASES))]

    #[test]
    fn frame_types(code in any::<u8>()) {
        agree("frame_types", json!({"code": code, "known": false, "flow": null, "terminal": null, "ends": null}))?;
    }

    #[test]
    fn ledger(remaining in 0u64..=i64::MAX as u64 / 2, code in prop::sample::select(vec![0u8, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]), granted in 0u64..=i64::MAX as u64 / 2) {
        agree("ledger", json!({"remaining": remaining, "frame": code, "granted": granted, "after": 0}))?;
    }

    #[test]
    fn negotiate(ours in amount(), theirs in amount()) {
        agree("negotiate", json!({"ours": ours, "theirs": theirs, "window": null}))?;
    }

    #[test]
    fn grant_target(streams in prop::collection::btree_set(stream(), 0..5), named in stream()) {
        let streams: Vec<Option<String>> = streams.into_iter().collect();
        agree("grant_target", json!({"streams": streams, "named": named, "matched": false, "target": null}))?;
    }

    #[test]
    fn gate(window in amount(), ops in prop::collection::vec(gate_op(), 0..OPS_MAX)) {
        let steps = steps_like(ops.len(), json!({"answer": null, "available": 0, "closed": null}));
        agree("gate", json!({"window": window, "ops": ops, "steps": steps}))?;
    }

    #[test]
    fn window(window in amount(), ops in prop::collection::vec(prop::sample::select(vec!["arrive", "continuation", "consume", "flush"]), 0..OPS_MAX)) {
        let steps = steps_like(ops.len(), json!({"violation": false, "grant": 0, "remaining": 0, "pending": 0}));
        agree("window", json!({"window": window, "ops": ops, "steps": steps}))?;
    }

    #[test]
    fn reorder(limit in prop_oneof![0u64..5, Just(64)], arrivals in prop::collection::vec(0u64..40, 0..OPS_MAX)) {
        let steps = steps_like(arrivals.len(), json!({"hold": true}));
        agree("reorder", json!({"limit": limit, "arrivals": arrivals, "steps": steps}))?;
    }

    #[test]
    fn writer(frames in prop::collection::vec(prop::sample::select(vec![0u8, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]), 0..OPS_MAX)) {
        let written = vec![false; frames.len()];
        let seqs = vec![Value::Null; frames.len()];
        agree("writer", json!({"frames": frames, "written": written, "seqs": seqs}))?;
    }

    #[test]
    fn table(keep in prop_oneof![1u64..5, Just(64)], ops in prop::collection::vec(table_op(), 0..OPS_MAX)) {
        let step = json!({"ok": false, "frames": ["no_route", "no_route", "no_route"]});
        let steps = steps_like(ops.len(), step);
        agree("table", json!({"keep": keep, "ops": ops, "steps": steps, "live": 0, "registered": 0}))?;
    }

    #[test]
    fn driver(allow in prop::option::of(Just(vec![0u8, 1, 2, 250])), timed in prop::collection::vec((driver_delay(), driver_op()), 0..OPS_MAX)) {
        // Time never goes back: each op comes some delay after the one before.
        let mut at = 0u64;
        let ops: Vec<Value> = timed
            .into_iter()
            .map(|(delay, mut op)| {
                at += delay;
                op["at"] = json!(at);
                op
            })
            .collect();
        agree("driver", tether_formal_replay::generate::driver_case(json!(allow), ops))?;
    }

    #[test]
    fn join(events in prop::collection::vec((0u64..40_000, prop::sample::select(vec!["connected", "sent", "failed", "failed"])), 0..16)) {
        let mut at = 0u64;
        let events: Vec<Value> = events
            .into_iter()
            .map(|(gap, kind)| {
                at += gap;
                json!({"at": at, "event": kind})
            })
            .collect();
        let steps = steps_like(events.len(), json!({"phase": "", "attempt": null, "next_at": null}));
        agree("join", json!({"events": events, "steps": steps}))?;
    }

    #[test]
    fn routing(allow in prop::option::of(prop::collection::vec(1u8..6, 0..3)), ops in prop::collection::vec(routing_op(), 0..OPS_MAX)) {
        let steps = steps_like(ops.len(), json!({"inbound": null, "egress": null, "send_failed": null, "claim": null}));
        agree("routing", json!({"mailbox": 1, "allow": allow, "ops": ops, "steps": steps, "drops": {}}))?;
    }

    #[test]
    fn emission(emitted in prop::collection::vec(emission_op(), 0..40)) {
        agree("emission", json!({"emitted": emitted, "violation": null, "at": null, "stream": null, "expected": null, "got": null}))?;
    }
}

fn routing_op() -> impl Strategy<Value = Value> {
    let tag = prop::sample::select(vec!["Ping", "JoinResponse", "Chat", "Orphan", "Nope"]);
    let n = 1u8..6;
    prop_oneof![
        1 => tag.clone().prop_map(|t| json!({"op": "know", "tag": t})),
        1 => (tag.clone(), n.clone()).prop_map(|(t, to)| json!({"op": "route", "tag": t, "to": to})),
        1 => n.clone().prop_map(|a| json!({"op": "host", "actor": a})),
        1 => n.clone().prop_map(|a| json!({"op": "unhost", "actor": a})),
        1 => (n.clone(), n.clone(), 0u64..4, prop::bool::weighted(0.15)).prop_map(|(a, p, g, f)| {
            json!({"op": "claim", "actor": a, "host": p, "generation": g, "forged": f})
        }),
        4 => (n.clone(), tag.clone()).prop_map(|(d, t)| json!({"op": "inbound", "dest": d, "tag": t})),
        1 => n.clone().prop_map(|p| json!({"op": "egress_mailbox", "peer": p})),
        2 => n.prop_map(|a| json!({"op": "egress_actor", "actor": a})),
        1 => tag.prop_map(|t| json!({"op": "write_failed", "tag": t})),
    ]
}

/// Delays between driver ops: often none, often past a dial backoff or the idle period,
/// sometimes past join waits.
fn driver_delay() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => Just(0u64),
        4 => 0u64..1_500,
        1 => 1_500u64..40_000,
    ]
}

/// One driver op without its time: peers 0–3 and 250 (invalid), small generations and
/// connection numbers so that current, replaced and unknown ones all occur.
fn driver_op() -> impl Strategy<Value = Value> {
    use tether_formal_replay::generate::{
        driver_control_payload, driver_flow, DRIVER_ALPNS, DRIVER_CHANNELS, DRIVER_FLOWS,
        DRIVER_PATHS, DRIVER_PEERS, DRIVER_STREAMS,
    };
    let peer = prop::sample::select(DRIVER_PEERS.to_vec());
    let channel = prop::sample::select(DRIVER_CHANNELS.to_vec());
    let alpn = prop::sample::select(DRIVER_ALPNS.to_vec());
    let path = prop::sample::select(DRIVER_PATHS.to_vec());
    let direction = prop::sample::select(vec!["inbound", "outbound"]);
    let generation = 1u64..10;
    let conn = 0u64..20;
    prop_oneof![
        2 => (peer.clone(), alpn, conn.clone()).prop_map(|(p, a, c)| json!({"op": "accept", "peer": p, "alpn": a, "conn": c})),
        1 => (peer.clone(), channel.clone(), conn.clone()).prop_map(|(p, ch, c)| json!({"op": "connected", "peer": p, "channel": ch, "conn": c})),
        1 => (peer.clone(), channel.clone(), generation.clone()).prop_map(|(p, ch, g)| json!({"op": "closed", "peer": p, "channel": ch, "generation": g})),
        1 => (peer.clone(), channel.clone()).prop_map(|(p, ch)| json!({"op": "disconnect", "peer": p, "channel": ch})),
        1 => (peer.clone(), channel.clone(), generation.clone()).prop_map(|(p, ch, g)| json!({"op": "unresponsive", "peer": p, "channel": ch, "generation": g})),
        // Relay hints over more peers than the 3 kept, so the oldest is forgotten.
        1 => (peer.clone(), prop::collection::vec(prop::sample::select(vec!["r1", "r2", "https://r3.example/"]), 0..3))
            .prop_map(|(p, r)| json!({"op": "relays_seen", "peer": p, "relays": r})),
        1 => (peer.clone(), prop::collection::vec(prop::sample::select(vec!["r1", "r4"]), 0..2))
            .prop_map(|(p, g)| json!({"op": "relays_for", "peer": p, "given": g})),
        // Dial ends and waiters asking again over the same few pairs the opens use, with
        // tickets small enough to match the dials in flight.
        1 => (0u8..2, prop::sample::select(vec!["telemetry", "switch"]), 1u64..5, any::<bool>())
            .prop_map(|(p, ch, t, a)| json!({"op": "open_dial_failed", "peer": p, "channel": ch, "ticket": t, "abandoned": a})),
        1 => (0u8..2, prop::sample::select(vec!["telemetry", "switch"]), 1u64..5)
            .prop_map(|(p, ch, t)| json!({"op": "open_waited", "peer": p, "channel": ch, "ticket": t})),
        1 => (0u8..2, prop::sample::select(vec!["telemetry", "switch"]), 1u64..5)
            .prop_map(|(p, ch, t)| json!({"op": "open_wait_abandoned", "peer": p, "channel": ch, "ticket": t})),
        // A connection from the peer while an open's dial is in flight.
        1 => (0u8..2, prop::sample::select(vec!["t", "s"]), 0u64..20)
            .prop_map(|(p, a, c)| json!({"op": "accept", "peer": p, "alpn": a, "conn": c})),
        // Opens over few peers and channels, so that waits for a dial in flight are common.
        2 => (0u8..2, prop::sample::select(vec!["telemetry", "switch"]), prop::sample::select(vec!["telemetry", "switch", "actor"]))
            .prop_map(|(p, ch, pa)| json!({"op": "open", "peer": p, "path": pa, "channel": ch})),
        1 => (0u8..2, prop::sample::select(vec!["telemetry", "switch"]), 1u64..6)
            .prop_map(|(p, ch, g)| json!({"op": "open_failed", "peer": p, "channel": ch, "generation": g})),
        1 => (0u8..2, prop::sample::select(vec!["telemetry", "switch"]), 0u64..20)
            .prop_map(|(p, ch, c)| json!({"op": "connected", "peer": p, "channel": ch, "conn": c})),
        1 => (peer.clone(), path, direction).prop_map(|(p, pa, d)| json!({"op": "admit", "peer": p, "path": pa, "direction": d})),
        3 => peer.clone().prop_map(|p| json!({"op": "send", "peer": p})),
        2 => (peer.clone(), 0u64..5).prop_map(|(p, f)| json!({"op": "batch", "peer": p, "frames": f})),
        2 => (peer.clone(), generation, 0u64..5, any::<bool>()).prop_map(|(p, g, f, s)| json!({"op": "write_failed", "peer": p, "generation": g, "frames": f, "swim": s})),
        1 => peer.clone().prop_map(|p| json!({"op": "idle", "peer": p})),
        2 => (peer.clone(), prop::option::of(conn.clone())).prop_map(|(p, c)| json!({"op": "dialed", "peer": p, "conn": c})),
        1 => (peer.clone(), any::<bool>(), 0u64..3).prop_map(|(p, r, d)| json!({"op": "join", "peer": p, "relay": r, "direct": d})),
        1 => peer.clone().prop_map(|p| json!({"op": "join_connected", "peer": p})),
        1 => (peer.clone(), conn).prop_map(|(p, c)| json!({"op": "join_sent", "peer": p, "conn": c})),
        1 => peer.clone().prop_map(|p| json!({"op": "join_failed", "peer": p})),
        1 => (peer.clone(), any::<bool>()).prop_map(|(p, f)| json!({"op": "fault", "peer": p, "fatal": f})),
        1 => (0u64..5).prop_map(|f| json!({"op": "egress_full", "frames": f})),
        1 => (0u8..4, 1u64..5, prop::bool::weighted(0.1)).prop_map(|(a, g, f)| json!({"op": "register", "actor": a, "generation": g, "forged": f})),
        1 => prop::sample::select(DRIVER_STREAMS.to_vec()).prop_map(|n| json!({"op": "stream", "name": n})),
        // Controls: subscribe and unsubscribe mostly, sometimes op 3, cut short or one byte long.
        3 => (peer.clone(), prop::sample::select(vec![1u8, 1, 2, 2, 3]), prop::sample::select(DRIVER_FLOWS.to_vec()), prop::sample::select(DRIVER_STREAMS.to_vec()), 0u8..8)
            .prop_map(|(p, op, flow, name, tweak)| {
                let mut payload = driver_control_payload(op, flow, name.as_bytes());
                match tweak {
                    0 => payload.truncate(payload.len() - 2),
                    1 => payload.push_str("00"),
                    _ => {}
                }
                json!({"op": "control", "peer": p, "payload": payload})
            }),
        1 => (peer, prop::sample::select(DRIVER_STREAMS.to_vec()), prop::sample::select(DRIVER_FLOWS.to_vec()), 0..5u64)
            .prop_map(|(p, n, f, publisher)| json!({"op": "ended", "peer": p, "name": n,
                "flow": driver_flow(f), "publisher": publisher})),
        3 => Just(json!({"op": "timeout"})),
        1 => prop::bool::weighted(0.05)
            .prop_map(|close| json!({"op": if close { "close" } else { "timeout" }})),
    ]
}

fn gate_op() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => amount().prop_map(|n| json!({"op": "acquire", "n": n})),
        3 => amount().prop_map(|n| json!({"op": "grant", "n": n})),
        1 => prop::sample::select(vec!["", "END", "ERR", "x y"]).prop_map(|r| json!({"op": "close", "reason": r})),
    ]
}

fn table_op() -> impl Strategy<Value = Value> {
    (
        prop::sample::select(vec!["register", "terminate"]),
        prop::sample::select(vec!["x1", "x2"]),
        prop::sample::select(vec!["r1", "r2", "r3"]),
    )
        .prop_map(|(op, xid, rid)| json!({"op": op, "xid": xid, "rid": rid}))
}

/// Emissions over few streams and small indexes, so that well-ordered runs are common.
fn emission_op() -> impl Strategy<Value = Value> {
    let stream = prop::sample::select(vec!["a", "b", ""]);
    prop_oneof![
        2 => stream.clone().prop_map(|s| json!({"kind": "streamStart", "stream": s})),
        4 => (stream.clone(), 0u64..3).prop_map(|(s, i)| json!({"kind": "chunk", "stream": s, "index": i})),
        2 => (stream, prop::option::of(0u64..3)).prop_map(|(s, c)| json!({"kind": "streamEnd", "stream": s, "count": c})),
        1 => Just(json!({"kind": "end"})),
        1 => Just(json!({"kind": "err"})),
        1 => Just(json!({"kind": "other"})),
    ]
}
