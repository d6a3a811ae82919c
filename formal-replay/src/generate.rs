//! Writing new conformance scripts with the reference model as the oracle.
//!
//! Cases alternate between two sources: an exhaustive enumeration of short op sequences over a
//! small alphabet of each section (in length-then-lexicographic order, starting at an offset
//! the seed picks, so successive seeds cover successive slices), and seeded random walks with
//! longer sequences and edge values (0, 1, the window, 2^63−1, 2^64−1). Inputs are chosen
//! here; every observation is filled in by the model.

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};

use crate::model;
use crate::replay::{complete_with_model, known_section};
use crate::script::{ScriptFile, SwitchOp};

/// Longest random walk, in ops.
const WALK_OPS_MAX: usize = 24;

/// Writes `cases` cases of `section` from `seed`.
pub fn generate(section: &str, seed: u64, cases: usize) -> Result<ScriptFile, String> {
    let section = known_section(section)?;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut generated = Vec::with_capacity(cases);
    let offset = seed.wrapping_mul(cases as u64);
    for index in 0..cases {
        let inputs = if index % 2 == 0 {
            let nth = offset.wrapping_add(index as u64 / 2);
            enumerated(section, nth)
        } else {
            walk(section, &mut rng)
        };
        let case = complete_with_model(section, &inputs).map_err(|failure| {
            format!("generated {section} case {index} is outside the format: {failure}")
        })?;
        generated.push(case);
    }
    Ok(ScriptFile {
        section: section.to_owned(),
        cases: generated,
    })
}

/// The `n`-th sequence over `symbols` symbols in length-then-lexicographic order (bijective
/// base-`symbols` numeration: 0 is the empty sequence).
pub fn nth_sequence(symbols: usize, mut n: u64) -> Vec<usize> {
    let base = symbols as u64;
    let mut digits = Vec::new();
    while n > 0 {
        n -= 1;
        digits.push((n % base) as usize);
        n /= base;
    }
    digits.reverse();
    digits
}

const STREAM_POOL: [Option<&str>; 6] = [
    None,
    Some(""),
    Some("a"),
    Some("b"),
    Some("A"),
    Some("input"),
];
const REASONS: [&str; 5] = ["", "END", "ERR", "cancelled", "a b"];

fn known_codes() -> Vec<u8> {
    model::FRAME_TYPES.iter().map(|row| row.code).collect()
}

fn enumerated(section: &str, n: u64) -> Value {
    match section {
        "frame_types" => frame_types_case((n % 256) as u8),
        "ledger" => {
            let codes = known_codes();
            let values: [u64; 6] = [0, 1, 2, 31, 32, 1 << 40];
            let code = codes[(n % codes.len() as u64) as usize];
            let rest = n / codes.len() as u64;
            let remaining = values[(rest % values.len() as u64) as usize];
            let granted = values[((rest / values.len() as u64) % values.len() as u64) as usize];
            json!({"remaining": remaining, "frame": code, "granted": granted, "after": 0})
        }
        "negotiate" => {
            let values = [0, 1, 2, 16, 32, u64::MAX];
            let ours = values[(n % 6) as usize];
            let theirs = values[((n / 6) % 6) as usize];
            json!({"ours": ours, "theirs": theirs, "window": null})
        }
        "grant_target" => {
            let subsets = 1u64 << STREAM_POOL.len();
            let mask = n % subsets;
            let streams: Vec<Option<&str>> = STREAM_POOL
                .iter()
                .enumerate()
                .filter(|(bit, _)| mask & (1 << bit) != 0)
                .map(|(_, stream)| *stream)
                .collect();
            let mut named_pool = STREAM_POOL.to_vec();
            // A name no stream has: a named grant never falls back to the sole stream.
            named_pool.push(Some("zz"));
            let named = named_pool[((n / subsets) % named_pool.len() as u64) as usize];
            grant_target_case(&streams, named)
        }
        "gate" => {
            let window = n % 5;
            let alphabet = [
                json!({"op": "acquire", "n": 0}),
                json!({"op": "acquire", "n": 1}),
                json!({"op": "acquire", "n": 2}),
                json!({"op": "grant", "n": 1}),
                json!({"op": "grant", "n": u64::MAX}),
                json!({"op": "close", "reason": "END"}),
            ];
            let ops = pick(&alphabet, n / 5);
            json!({"window": window, "steps": placeholder_gate_steps(ops.len()), "ops": ops})
        }
        "window" => {
            let window = n % 5;
            let ops = pick(
                &["arrive", "continuation", "consume", "flush"].map(Value::from),
                n / 5,
            );
            window_case(window, ops)
        }
        "reorder" => {
            let limit = n % 3;
            let arrivals: Vec<u64> = nth_sequence(4, n / 3)
                .into_iter()
                .map(|seq| seq as u64)
                .collect();
            reorder_case(limit, arrivals)
        }
        "writer" => {
            let codes = known_codes();
            let frames: Vec<u8> = nth_sequence(codes.len(), n)
                .into_iter()
                .map(|i| codes[i])
                .collect();
            writer_case(frames)
        }
        "table" => {
            let keep = n % 3 + 1;
            let alphabet: Vec<Value> = ["register", "terminate"]
                .iter()
                .flat_map(|op| {
                    ["x1", "x2"].iter().flat_map(move |xid| {
                        ["r1", "r2", "r3"]
                            .iter()
                            .map(move |rid| json!({"op": op, "xid": xid, "rid": rid}))
                    })
                })
                .collect();
            table_case(keep, pick(&alphabet, n / 3))
        }
        "substrate" => substrate_case(
            (n % 2 + 1) as u8,
            substrate_trace(&mut Xoshiro256PlusPlus::seed_from_u64(n), 8),
        ),
        "emission" => {
            let alphabet = [
                json!({"kind": "streamStart", "stream": "a"}),
                json!({"kind": "streamStart", "stream": "b"}),
                json!({"kind": "chunk", "stream": "a", "index": 0}),
                json!({"kind": "chunk", "stream": "a", "index": 1}),
                json!({"kind": "chunk", "stream": "b", "index": 0}),
                json!({"kind": "streamEnd", "stream": "a", "count": null}),
                json!({"kind": "streamEnd", "stream": "a", "count": 1}),
                json!({"kind": "streamEnd", "stream": "b", "count": 0}),
                json!({"kind": "end"}),
                json!({"kind": "err"}),
                json!({"kind": "other"}),
            ];
            emission_case(pick(&alphabet, n))
        }
        "driver" => {
            // Short sequences over one peer (and one off the list): the interleavings of
            // sends, batches, dial results, write failures, idleness and time.
            let alphabet = [
                json!({"op": "send", "peer": 1}),
                json!({"op": "batch", "peer": 1, "frames": 2}),
                json!({"op": "batch", "peer": 1, "frames": 1, "swim": true, "stream": 1}),
                json!({"op": "stopped", "peer": 1, "generation": 1}),
                json!({"op": "dialed", "peer": 1, "conn": 7}),
                json!({"op": "dialed", "peer": 1, "conn": null}),
                json!({"op": "write_failed", "peer": 1, "generation": 1, "frames": 1, "swim": true}),
                json!({"op": "accept", "peer": 1, "alpn": "a", "conn": 8}),
                json!({"op": "closed", "peer": 1, "channel": "actor", "generation": 1}),
                json!({"op": "idle", "peer": 1}),
                json!({"op": "fault", "peer": 1, "fatal": false, "channel": "protocol:0"}),
                json!({"op": "timeout"}),
                json!({"op": "send", "peer": 2}),
                json!({"op": "close"}),
            ];
            let mut ops = pick(&alphabet, n);
            for (i, op) in ops.iter_mut().enumerate() {
                op["at"] = json!(i as u64 * 400);
            }
            driver_case(json!([1]), ops)
        }
        "peer" => {
            // Short lives over every event, a tick after each (so retries fall due), the
            // address known in even slices.
            let events: Vec<crate::peer::PeerEvent> = nth_sequence(crate::peer::ALPHABET.len(), n)
                .into_iter()
                .enumerate()
                .map(|(i, symbol)| crate::peer::PeerEvent {
                    at: i as u64 * 6_000,
                    event: crate::peer::ALPHABET[symbol],
                })
                .collect();
            serde_json::to_value(crate::peer::blank_case(n, n % 7 != 3, events))
                .expect("cases serialize")
        }
        "join" => {
            let alphabet = [
                json!({"at": 0, "event": "connected"}),
                json!({"at": 0, "event": "sent"}),
                json!({"at": 0, "event": "failed"}),
            ];
            let mut events = pick(&alphabet, n);
            for (i, event) in events.iter_mut().enumerate() {
                event["at"] = json!(i as u64 * 1_000);
            }
            join_case(events)
        }
        "routing" => {
            let alphabet = [
                json!({"op": "know", "tag": "Chat"}),
                json!({"op": "route", "tag": "Ping", "to": 5}),
                json!({"op": "host", "actor": 9}),
                json!({"op": "unhost", "actor": 9}),
                json!({"op": "claim", "actor": 7, "host": 3, "generation": 1}),
                json!({"op": "claim", "actor": 7, "host": 4, "generation": 2}),
                json!({"op": "claim", "actor": 7, "host": 4, "generation": 3, "handoff": 3}),
                json!({"op": "claim", "actor": 7, "host": 3, "generation": 4, "from": 4}),
                json!({"op": "inbound", "dest": 1, "tag": "Ping"}),
                json!({"op": "inbound", "dest": 1, "tag": "Chat"}),
                json!({"op": "inbound", "dest": 9, "tag": "Chat"}),
                json!({"op": "egress_mailbox", "peer": 4}),
                json!({"op": "egress_actor", "actor": 7}),
                json!({"op": "write_failed", "tag": "Ping"}),
            ];
            routing_case(json!([3]), pick(&alphabet, n))
        }
        "switch" => {
            let alphabet = crate::switch::explored_ops();
            let ops: Vec<SwitchOp> = nth_sequence(alphabet.len(), n)
                .into_iter()
                .map(|i| alphabet[i].clone())
                .collect();
            let ring = [2, 64][(n % 2) as usize];
            let masters = crate::switch::explored_masters();
            let ops = crate::switch::in_domain(ring, &masters, &ops)
                .expect("the explored world is well formed");
            to_json(&crate::switch::case_inputs(ring, &masters, ops))
        }
        other => unreachable!("known_section admitted {other}"),
    }
}

fn walk(section: &str, rng: &mut Xoshiro256PlusPlus) -> Value {
    let len = rng.random_range(1..=WALK_OPS_MAX);
    match section {
        "frame_types" => frame_types_case(rng.random()),
        "ledger" => {
            let codes = known_codes();
            let code = codes[rng.random_range(0..codes.len())];
            let remaining = edge(rng) >> 1;
            let granted = edge(rng).min(i64::MAX as u64 - remaining);
            json!({"remaining": remaining, "frame": code, "granted": granted, "after": 0})
        }
        "negotiate" => json!({"ours": edge(rng), "theirs": edge(rng), "window": null}),
        "grant_target" => {
            let mut streams = Vec::new();
            for stream in STREAM_POOL {
                if rng.random_bool(0.4) {
                    streams.push(stream);
                }
            }
            let named = STREAM_POOL[rng.random_range(0..STREAM_POOL.len())];
            grant_target_case(&streams, named)
        }
        "gate" => {
            let window = edge(rng);
            let ops: Vec<Value> = (0..len)
                .map(|_| match rng.random_range(0..10) {
                    0..=4 => json!({"op": "acquire", "n": small_or_edge(rng)}),
                    5..=7 => json!({"op": "grant", "n": small_or_edge(rng)}),
                    _ => json!({"op": "close", "reason": REASONS[rng.random_range(0..REASONS.len())]}),
                })
                .collect();
            json!({"window": window, "steps": placeholder_gate_steps(ops.len()), "ops": ops})
        }
        "window" => {
            let window = [0, 1, 2, 3, 5, 8, 32, u64::MAX][rng.random_range(0..8)];
            let names = [
                "arrive",
                "arrive",
                "continuation",
                "consume",
                "consume",
                "flush",
            ];
            let ops = (0..len)
                .map(|_| Value::from(names[rng.random_range(0..names.len())]))
                .collect();
            window_case(window, ops)
        }
        "reorder" => {
            let limit = [0, 1, 2, 3, 4, 64][rng.random_range(0..6)];
            let mut next = 0u64;
            let arrivals = (0..len)
                .map(|_| {
                    let seq = next
                        .saturating_add(rng.random_range(0..4))
                        .saturating_sub(rng.random_range(0..2));
                    if seq == next {
                        next += 1;
                    }
                    seq
                })
                .collect();
            reorder_case(limit, arrivals)
        }
        "writer" => {
            let codes = known_codes();
            writer_case(
                (0..len)
                    .map(|_| codes[rng.random_range(0..codes.len())])
                    .collect(),
            )
        }
        "table" => {
            let keep = [1, 2, 3, 4, 64][rng.random_range(0..5)];
            let ops = (0..len)
                .map(|_| {
                    let op = if rng.random_bool(0.5) {
                        "register"
                    } else {
                        "terminate"
                    };
                    let xid = ["x1", "x2"][rng.random_range(0..2)];
                    let rid = ["r1", "r2", "r3"][rng.random_range(0..3)];
                    json!({"op": op, "xid": xid, "rid": rid})
                })
                .collect();
            table_case(keep, ops)
        }
        "emission" => emission_case(emission_walk(rng, len)),
        "substrate" => {
            let window = [1u8, 2, 8][rng.random_range(0..3)];
            substrate_case(window, substrate_trace(rng, 4 * len))
        }
        "driver" => {
            let everyone = rng.random_bool(0.5);
            let allow = if everyone {
                Value::Null
            } else {
                json!([0, 1, 2, 250])
            };
            driver_case(allow, driver_walk(rng, len * 2, everyone))
        }
        "peer" => {
            // Lives that answer what the peer asks most of the time, with time moving in
            // small and large steps.
            let mut at = 0u64;
            let events: Vec<crate::peer::PeerEvent> = (0..len * 2)
                .map(|_| {
                    at += match rng.random_range(0..4) {
                        0 => 0,
                        1 => rng.random_range(0..200),
                        2 => rng.random_range(0..2_000),
                        _ => rng.random_range(0..12_000),
                    };
                    let event =
                        crate::peer::ALPHABET[rng.random_range(0..crate::peer::ALPHABET.len())];
                    crate::peer::PeerEvent { at, event }
                })
                .collect();
            let seed = rng.random();
            serde_json::to_value(crate::peer::blank_case(seed, rng.random_bool(0.85), events))
                .expect("cases serialize")
        }
        "join" => {
            let mut at = 0u64;
            let kinds = ["connected", "sent", "failed", "failed", "failed"];
            let events: Vec<Value> = (0..len.min(12))
                .map(|_| {
                    at += rng.random_range(0..40_000);
                    json!({"at": at, "event": kinds[rng.random_range(0..kinds.len())]})
                })
                .collect();
            join_case(events)
        }
        "routing" => {
            let tags = ["Ping", "Ack", "JoinRequest", "Chat", "Orphan", "Nope"];
            let ops: Vec<Value> = (0..len)
                .map(|_| {
                    let tag = tags[rng.random_range(0..tags.len())];
                    let n = rng.random_range(1..6u8);
                    match rng.random_range(0..12) {
                        0 => json!({"op": "know", "tag": tag}),
                        1 => json!({"op": "route", "tag": tag, "to": n}),
                        2 => json!({"op": "host", "actor": n}),
                        3 => json!({"op": "unhost", "actor": n}),
                        4 => {
                            // Few actors, so that claims meet routes others hold.
                            let n = rng.random_range(1..4u8);
                            let host = rng.random_range(1..6u8);
                            // Mostly small generations; now and then one near the bounds.
                            let generation = match rng.random_range(0..12) {
                                0 => (1u64 << 48) + rng.random_range(0..2u64),
                                1 => (1u64 << 20) + rng.random_range(0..3u64),
                                2 => u64::MAX,
                                _ => rng.random_range(0..4u64),
                            };
                            let mut claim = json!({"op": "claim", "actor": n, "host": host,
                                "generation": generation, "forged": rng.random_bool(0.1)});
                            if rng.random_bool(0.15) {
                                claim["from"] = json!(rng.random_range(1..6u8));
                            }
                            if rng.random_bool(0.3) {
                                claim["handoff"] = json!(rng.random_range(1..6u8));
                            }
                            claim
                        }
                        5..=7 => json!({"op": "inbound", "dest": n, "tag": tag}),
                        8 => json!({"op": "egress_mailbox", "peer": n}),
                        9..=10 => json!({"op": "egress_actor", "actor": n}),
                        _ => json!({"op": "write_failed", "tag": tag}),
                    }
                })
                .collect();
            let allow = if rng.random_bool(0.5) {
                json!(null)
            } else {
                json!([1, rng.random_range(2..6u8)])
            };
            let mut case = routing_case(allow, ops);
            if rng.random_bool(0.25) {
                let pairs: Vec<Value> = (0..rng.random_range(0..8))
                    .map(|_| json!([rng.random_range(1..6u8), rng.random_range(1..6u8)]))
                    .collect();
                case["authorize"] = json!(pairs);
            }
            case
        }
        "switch" => switch_walk(rng, len),
        other => unreachable!("known_section admitted {other}"),
    }
}

/// A mostly well-formed emission sequence (streams opened, chunked in order and ended with the
/// right count) with an occasional mistake, so that clean runs and every violation both occur.
fn emission_walk(rng: &mut Xoshiro256PlusPlus, len: usize) -> Vec<Value> {
    let names = ["a", "b", "c", ""];
    let mut open: Vec<(&str, u64)> = Vec::new();
    let mut started = 0;
    let mut emitted = Vec::new();
    while emitted.len() < len {
        let mistake = rng.random_bool(0.08);
        let choice = rng.random_range(0..10);
        let emission = if open.is_empty() || choice < 2 {
            let stream = if mistake || started == names.len() {
                names[rng.random_range(0..names.len())]
            } else {
                started += 1;
                names[started - 1]
            };
            open.push((stream, 0));
            json!({"kind": "streamStart", "stream": stream})
        } else if choice < 7 {
            let at = rng.random_range(0..open.len());
            let (stream, seen) = &mut open[at];
            let index = if mistake { *seen + 1 } else { *seen };
            *seen += 1;
            json!({"kind": "chunk", "stream": *stream, "index": index})
        } else if choice < 9 {
            let at = rng.random_range(0..open.len());
            let (stream, seen) = open.remove(at);
            let count = match (mistake, rng.random_bool(0.3)) {
                (true, _) => json!(seen + 1),
                (false, true) => Value::Null,
                (false, false) => json!(seen),
            };
            json!({"kind": "streamEnd", "stream": stream, "count": count})
        } else {
            ["end", "err", "other"].map(|kind| json!({"kind": kind}))[rng.random_range(0..3)]
                .clone()
        };
        emitted.push(emission);
    }
    emitted
}

/// The caps switch walks draw from: the first [`SWITCH_SERVED`] are what masters serve (under
/// a full cap grammar the third and fifth are more specific than the first and the fourth less
/// specific, so ranking decides between them; under exact matching they are merely distinct),
/// then the identity cap, one nobody serves, and one that does not parse.
const SWITCH_CAPS: [&str; 8] = [
    "cap:in=media:x;out=media:y",
    "cap:in=media:y;out=media:z",
    "cap:in=media:x;out=media:y;fast=yes",
    "cap:in=media:;out=media:y",
    "cap:in=media:x;out=media:y;q=1",
    "cap:effect=none",
    "cap:in=media:q;out=media:q",
    "nocap",
];
const SWITCH_SERVED: usize = 5;

/// A random switch world and a walk through it: each op is drawn (mostly from what the live
/// requests make sensible: the destination answering in stream order, the origin continuing,
/// peer calls on behalf of a live request), tried on the model, and kept when it is inside the
/// section's domain and clear of known core divergences; up to 24 draws per op.
fn switch_walk(rng: &mut Xoshiro256PlusPlus, len: usize) -> Value {
    use crate::script::{SwitchIdentity, SwitchMaster};
    let count = rng.random_range(1..=4usize);
    let masters: Vec<SwitchMaster> = (0..count)
        .map(|i| {
            let caps = SWITCH_CAPS[..SWITCH_SERVED]
                .iter()
                .filter(|_| rng.random_bool(0.4))
                .map(|cap| (*cap).to_owned())
                .collect();
            SwitchMaster {
                id: ["a", "b", "c", "d"][i].to_owned(),
                caps,
                initial_credit: [1, 2, 3, 32][rng.random_range(0..4)],
                identity: SwitchIdentity::Echo,
            }
        })
        .collect();
    let ring = [1, 2, 3, 64][rng.random_range(0..4)];
    let mut model =
        crate::switch_model::SwitchModel::new(ring, &masters).expect("a well-formed world");
    let mut ops = Vec::new();
    for _ in 0..len {
        for _ in 0..24 {
            let op = switch_op(rng, &model);
            let mut next = model.clone();
            if let Ok(step) = next.apply(&op) {
                if crate::switch::known_divergence(&step).is_none() {
                    model = next;
                    ops.push(op);
                    break;
                }
            }
        }
    }
    to_json(&crate::switch::case_inputs(ring, &masters, ops))
}

/// The inputs of one random switch walk of up to `len` ops from `seed` (what `generate` draws
/// for its odd cases), for property tests.
pub fn switch_walk_case(seed: u64, len: usize) -> Value {
    switch_walk(&mut Xoshiro256PlusPlus::seed_from_u64(seed), len)
}

/// One op drawn for a switch walk.
fn switch_op(rng: &mut Xoshiro256PlusPlus, model: &crate::switch_model::SwitchModel) -> SwitchOp {
    use crate::script::{SwitchCancelCode, SwitchFrame};
    use crate::switch_model::Party;
    let ids = model.slot_ids();
    let live = model.live_rids();
    let rid = if !live.is_empty() && rng.random_bool(0.8) {
        live[rng.random_range(0..live.len())]
    } else {
        rng.random_range(1..=5)
    };
    let any_master = |rng: &mut Xoshiro256PlusPlus| ids[rng.random_range(0..ids.len())].clone();
    let name = |party: Party| match party {
        Party::Engine => crate::switch_model::ENGINE.to_owned(),
        Party::Master(slot) => ids[slot].clone(),
    };
    let served = model.routable_caps();
    let cap = if !served.is_empty() && rng.random_bool(0.75) {
        served[rng.random_range(0..served.len())].clone()
    } else {
        SWITCH_CAPS[rng.random_range(0..SWITCH_CAPS.len())].to_owned()
    };
    // A frame that usually keeps the leg's stream order (the model refuses the rest).
    let frame_for = |rng: &mut Xoshiro256PlusPlus, response: bool| {
        let streams = model.streams(rid, response);
        let open: Vec<&String> = streams.iter().filter(|s| s.1).map(|s| &s.0).collect();
        let fresh = ["s", "t"]
            .into_iter()
            .find(|name| streams.iter().all(|s| s.0 != *name));
        match (rng.random_range(0..10), open.first(), fresh) {
            (0..=5, Some(_), _) => {
                let stream = open[rng.random_range(0..open.len())].clone();
                (SwitchFrame::Chunk, Some(stream))
            }
            (6, Some(_), _) => {
                let stream = open[rng.random_range(0..open.len())].clone();
                (SwitchFrame::StreamEnd, Some(stream))
            }
            (0..=3, _, Some(name)) => (SwitchFrame::StreamStart, Some(name.to_owned())),
            (4..=6, _, _) => (SwitchFrame::End, None),
            (7, _, _) => (SwitchFrame::Err, None),
            _ => (SwitchFrame::Log, None),
        }
    };
    let request_weight = if live.is_empty() { 40 } else { 12 };
    let draw = rng.random_range(0..88 + request_weight);
    if draw >= 88 {
        let preferred = rng
            .random_bool(0.2)
            .then(|| SWITCH_CAPS[rng.random_range(0..SWITCH_SERVED)].to_owned());
        return SwitchOp::Request {
            rid,
            cap,
            preferred,
        };
    }
    match draw {
        0..=9 => {
            let parent = live.get(rng.random_range(0..live.len().max(1))).copied();
            let from = match parent.and_then(|p| model.destination_of(p)) {
                Some(slot) if rng.random_bool(0.8) => ids[slot].clone(),
                _ => any_master(rng),
            };
            let parent = parent.filter(|_| rng.random_bool(0.7));
            SwitchOp::PeerRequest {
                from,
                rid: rng.random_range(1..=5),
                cap,
                parent,
            }
        }
        10..=44 => {
            let from = match model.destination_of(rid) {
                Some(slot) if rng.random_bool(0.9) => ids[slot].clone(),
                _ => any_master(rng),
            };
            let (frame, stream) = frame_for(rng, true);
            SwitchOp::Respond {
                from,
                rid,
                frame,
                stream,
            }
        }
        45..=56 => {
            let from = match model.origin_of(rid) {
                Some(origin) if rng.random_bool(0.9) => name(origin),
                _ => any_master(rng),
            };
            let (mut frame, mut stream) = frame_for(rng, false);
            if frame == SwitchFrame::Err {
                (frame, stream) = (SwitchFrame::Log, None);
            }
            SwitchOp::Continue {
                from,
                rid,
                frame,
                stream,
            }
        }
        57..=68 => {
            // Usually the receiving side of a started stream.
            let response = rng.random_bool(0.6);
            let from = match (model.origin_of(rid), model.destination_of(rid)) {
                (Some(origin), _) if response => name(origin),
                (_, Some(slot)) if rng.random_bool(0.9) => ids[slot].clone(),
                _ => any_master(rng),
            };
            let streams = model.streams(rid, response);
            let stream = match streams.first() {
                Some(_) => streams[rng.random_range(0..streams.len())].0.clone(),
                None => "s".to_owned(),
            };
            SwitchOp::Credit {
                from,
                rid,
                stream,
                n: [1, 1, 2, 5][rng.random_range(0..4)],
            }
        }
        69..=74 => SwitchOp::Cancel {
            rid,
            code: [
                SwitchCancelCode::Cancelled,
                SwitchCancelCode::Aborted,
                SwitchCancelCode::AbortedCollateral,
            ][rng.random_range(0..3)],
        },
        75..=78 => SwitchOp::StopFeeds { rid },
        79..=82 => SwitchOp::Close {
            master: any_master(rng),
        },
        _ => SwitchOp::Reattach {
            master: any_master(rng),
        },
    }
}

fn to_json(value: &impl serde::Serialize) -> Value {
    serde_json::to_value(value).expect("script types serialize")
}

/// A random environment trace for the substrate section.
fn substrate_trace(rng: &mut Xoshiro256PlusPlus, len: usize) -> Vec<Value> {
    let node = |rng: &mut Xoshiro256PlusPlus| if rng.random_bool(0.5) { "a" } else { "b" };
    (0..len)
        .map(|_| match rng.random_range(0..25) {
            0..=3 => json!({"do": "send", "n": rng.random_range(0..2)}),
            4..=5 => json!({"do": "answer"}),
            6..=11 => json!({"do": "commit", "node": node(rng)}),
            12..=18 => json!({"do": "deliver", "to": node(rng), "index": rng.random_range(0..3)}),
            19 => json!({"do": "duplicate", "to": node(rng), "index": rng.random_range(0..3)}),
            20 => json!({"do": "drop", "to": node(rng), "index": rng.random_range(0..3)}),
            21 => json!({"do": "reconnect"}),
            22 => json!({"do": "crash", "node": node(rng)}),
            23 => json!({"do": if rng.random_bool(0.5) { "wait" } else { "stray" }}),
            _ => json!({"do": "close"}),
        })
        .collect()
}

fn substrate_case(window: u8, actions: Vec<Value>) -> Value {
    json!({"window": window, "actions": actions, "verdict": "ok"})
}

fn edge(rng: &mut Xoshiro256PlusPlus) -> u64 {
    match rng.random_range(0..8) {
        0 => 0,
        1 => 1,
        2 => u64::MAX,
        3 => u64::MAX - 1,
        4 => i64::MAX as u64,
        5 => rng.random_range(2..64),
        _ => rng.random(),
    }
}

fn small_or_edge(rng: &mut Xoshiro256PlusPlus) -> u64 {
    if rng.random_bool(0.8) {
        rng.random_range(0..5)
    } else {
        edge(rng)
    }
}

fn pick(alphabet: &[Value], n: u64) -> Vec<Value> {
    nth_sequence(alphabet.len(), n)
        .into_iter()
        .map(|i| alphabet[i].clone())
        .collect()
}

fn frame_types_case(code: u8) -> Value {
    json!({"code": code, "known": false, "flow": null, "terminal": null, "ends": null})
}

fn grant_target_case(streams: &[Option<&str>], named: Option<&str>) -> Value {
    json!({"streams": streams, "named": named, "matched": false, "target": null})
}

fn placeholder_gate_steps(len: usize) -> Vec<Value> {
    vec![json!({"answer": null, "available": 0, "closed": null}); len]
}

fn window_case(window: u64, ops: Vec<Value>) -> Value {
    let steps =
        vec![json!({"violation": false, "grant": 0, "remaining": 0, "pending": 0}); ops.len()];
    json!({"window": window, "ops": ops, "steps": steps})
}

fn reorder_case(limit: u64, arrivals: Vec<u64>) -> Value {
    let steps = vec![json!({"hold": true}); arrivals.len()];
    json!({"limit": limit, "arrivals": arrivals, "steps": steps})
}

fn writer_case(frames: Vec<u8>) -> Value {
    let written = vec![false; frames.len()];
    let seqs = vec![Value::Null; frames.len()];
    json!({"frames": frames, "written": written, "seqs": seqs})
}

fn table_case(keep: u64, ops: Vec<Value>) -> Value {
    let step = json!({"ok": false, "frames": ["no_route", "no_route", "no_route"]});
    let steps = vec![step; ops.len()];
    json!({"keep": keep, "ops": ops, "steps": steps, "live": 0, "registered": 0})
}

fn emission_case(emitted: Vec<Value>) -> Value {
    json!({"emitted": emitted, "violation": null, "at": null, "stream": null,
        "expected": null, "got": null})
}

/// A driver case with its inputs set and every observation empty (the model fills them).
pub fn driver_case(allow: Value, ops: Vec<Value>) -> Value {
    let steps: Vec<Value> = ops
        .iter()
        .map(|_| json!({"result": null, "actions": [], "timeout": null}))
        .collect();
    let end = json!({"drops": {}, "refusals": {}, "counters": {"accepted": 0,
        "dials_started": 0, "dial_failures": 0, "evictions": 0, "stale_failures": 0,
        "writers_retired": 0}, "cache": [], "joins": {}, "claims": [], "subscriptions": [],
        "controls": {}, "opening": [], "failed_opens": [], "relays": []});
    json!({"allow": allow, "ops": ops, "steps": steps, "end": end})
}

/// The driver section's inputs drawn from: peers (250 is invalid), ALPNs (`x` is unknown),
/// channels and paths.
pub const DRIVER_PEERS: [u8; 5] = [0, 1, 2, 3, 250];
/// See [`DRIVER_PEERS`].
pub const DRIVER_ALPNS: [&str; 7] = ["a", "t", "p0", "p1", "s", "u", "x"];
/// See [`DRIVER_PEERS`].
pub const DRIVER_CHANNELS: [&str; 6] = [
    "actor",
    "telemetry",
    "protocol:0",
    "protocol:1",
    "switch",
    "substrate",
];
/// See [`DRIVER_PEERS`].
pub const DRIVER_PATHS: [&str; 7] = [
    "actor",
    "join",
    "telemetry",
    "protocol",
    "switch",
    "substrate",
    "unknown",
];

/// The driver section's telemetry stream names (for `stream`, `control` and `ended`).
pub const DRIVER_STREAMS: [&str; 2] = ["s0", "s1"];
/// The driver section's flows: 16 bytes of each of these values.
pub const DRIVER_FLOWS: [u8; 3] = [0, 1, 2];

/// A flow as the driver section writes it: 16 bytes of `byte`, 32 lowercase hex digits.
pub fn driver_flow(byte: u8) -> String {
    crate::script::hex(&[byte; 16])
}

/// A `tether.TelemetryControl` record as the driver section's `control` payload (lowercase
/// hex): `op` (1 subscribe, 2 unsubscribe), 16 bytes of `flow`, the name's length (one byte),
/// the name. A name longer than 255 bytes is cut to 255.
pub fn driver_control_payload(op: u8, flow: u8, name: &[u8]) -> String {
    let name = name.get(..255).unwrap_or(name);
    let mut bytes = vec![op];
    bytes.extend_from_slice(&[flow; 16]);
    bytes.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
    bytes.extend_from_slice(name);
    crate::script::hex(&bytes)
}

/// A `control` payload: mostly (4 in 5) a well-formed subscribe (60%) or unsubscribe of one
/// of [`DRIVER_STREAMS`] and [`DRIVER_FLOWS`]; otherwise malformed: cut short, a trailing
/// byte, op 3, an empty name, a non-UTF-8 name, or a name of 129 bytes.
/// With it, when well formed, what it asks: (subscribe?, name, flow).
fn driver_control(rng: &mut Xoshiro256PlusPlus) -> (String, Option<(bool, &'static str, u8)>) {
    let flow = DRIVER_FLOWS[rng.random_range(0..DRIVER_FLOWS.len())];
    let stream = DRIVER_STREAMS[rng.random_range(0..DRIVER_STREAMS.len())];
    let name = stream.as_bytes();
    if rng.random_bool(0.8) {
        let op = if rng.random_bool(0.6) { 1 } else { 2 };
        return (
            driver_control_payload(op, flow, name),
            Some((op == 1, stream, flow)),
        );
    }
    let malformed = match rng.random_range(0..6) {
        0 => {
            // Cut short: any whole number of bytes before the last.
            let mut text = driver_control_payload(1, flow, name);
            let keep = rng.random_range(0..text.len() / 2);
            text.truncate(keep * 2);
            text
        }
        1 => driver_control_payload(1, flow, name) + "00",
        2 => driver_control_payload(3, flow, name),
        3 => driver_control_payload(1, flow, b""),
        4 => driver_control_payload(1, flow, &[0xff, 0xfe]),
        _ => driver_control_payload(1, flow, &[b's'; 129]),
    };
    (malformed, None)
}

/// What a walk guesses of the node's telemetry publishers, to draw `ended` ops that name a
/// live one: the streams registered, the subscriptions guessed live with their publisher
/// numbers, and the last number given. Exact: the allow list is open or `[0, 1, 2, 250]`, so
/// of [`DRIVER_PEERS`] only 3 is ever refused, and only by the list.
struct PublishGuess {
    everyone: bool,
    streams: BTreeSet<&'static str>,
    live: BTreeMap<(u8, &'static str, u8), u64>,
    publishers: u64,
}

impl PublishGuess {
    fn admits(&self, peer: u8) -> bool {
        self.everyone || peer != 3
    }

    /// A publisher guessed live, drawn at random, with its number; it is no longer live.
    fn end_live(&mut self, rng: &mut Xoshiro256PlusPlus) -> Option<((u8, &'static str, u8), u64)> {
        let index = rng.random_range(0..self.live.len().max(1));
        let (key, publisher) = self.live.iter().nth(index).map(|(k, p)| (*k, *p))?;
        self.ended(key, publisher);
        Some((key, publisher))
    }

    /// Publisher number `publisher` of subscription `key` ended: the subscription is no
    /// longer live if it was live with that number.
    fn ended(&mut self, key: (u8, &'static str, u8), publisher: u64) {
        if self.live.get(&key) == Some(&publisher) {
            self.live.remove(&key);
        }
    }

    /// A well-formed control from `peer`: a subscribe of a registered stream that is not
    /// live starts publisher number `publishers + 1`; an unsubscribe stops a live one.
    fn control(&mut self, peer: u8, subscribe: bool, name: &'static str, flow: u8) {
        if !self.admits(peer) {
            return;
        }
        let key = (peer, name, flow);
        if !subscribe {
            self.live.remove(&key);
        } else if self.streams.contains(name) && !self.live.contains_key(&key) {
            self.publishers += 1;
            self.live.insert(key, self.publishers);
        }
    }
}

/// What a walk focused on opens guesses of the machine's opens, to draw tickets that are
/// live: the last ticket given, and per (peer, channel) the dial guessed in flight and whether
/// a connection is guessed cached (a guess: generations are not followed).
#[derive(Default)]
struct OpenGuess {
    tickets: u64,
    in_flight: BTreeMap<(u8, &'static str), (u64, u64)>,
    cached: BTreeSet<(u8, &'static str)>,
    /// Dials guessed failed with waiters: (pair, ticket).
    failed: Vec<((u8, &'static str), u64)>,
}

/// A relay list for the relay ops: none half the time, else one or two of three relays.
fn driver_relays(rng: &mut Xoshiro256PlusPlus) -> Vec<&'static str> {
    const RELAYS: [&str; 3] = ["https://r1.example/", "https://r2.example/", "r3"];
    match rng.random_range(0..4) {
        0 | 1 => Vec::new(),
        2 => vec![RELAYS[rng.random_range(0..3)]],
        _ => vec![
            RELAYS[rng.random_range(0..3)],
            RELAYS[rng.random_range(0..3)],
        ],
    }
}

/// An op of a walk focused on opens: peers 0–1, the telemetry and switch channels, tickets
/// mostly the one guessed in flight for the pair.
fn driver_open_op(
    rng: &mut Xoshiro256PlusPlus,
    at: u64,
    conn: u64,
    guess: &mut OpenGuess,
) -> Value {
    let peer = rng.random_range(0..2u8);
    let channel = ["telemetry", "switch"][rng.random_range(0..2)];
    let pair = (peer, channel);
    let ticket = match guess.in_flight.get(&pair) {
        Some((ticket, _)) if rng.random_range(0..5) > 0 => *ticket,
        _ => guess.tickets.saturating_sub(rng.random_range(0..3)).max(1),
    };
    match rng.random_range(0..20) {
        0..=6 => {
            if let Some((_, waiters)) = guess.in_flight.get_mut(&pair) {
                *waiters += 1;
            } else if !guess.cached.contains(&pair) {
                guess.tickets += 1;
                guess.in_flight.insert(pair, (guess.tickets, 0));
            }
            json!({"op": "open", "at": at, "peer": peer, "path": channel, "channel": channel})
        }
        7 if rng.random_range(0..3) == 0 => json!({"op": "open_wait_abandoned", "at": at,
            "peer": peer, "channel": channel, "ticket": ticket}),
        7..=11 => {
            // Mostly a waiter of a dial guessed failed.
            let ((peer, channel), ticket) = match guess.failed.pop() {
                Some(failed) if rng.random_range(0..4) > 0 => failed,
                _ => (pair, ticket),
            };
            json!({"op": "open_waited", "at": at, "peer": peer, "channel": channel,
                "ticket": ticket})
        }
        12..=15 => {
            let abandoned = rng.random_range(0..4) == 0;
            if let Some((live, waiters)) = guess.in_flight.get(&pair).copied() {
                if live == ticket {
                    guess.in_flight.remove(&pair);
                    if !abandoned {
                        for _ in 0..waiters {
                            guess.failed.push((pair, ticket));
                        }
                    }
                }
            }
            json!({"op": "open_dial_failed", "at": at, "peer": peer, "channel": channel,
                "ticket": ticket, "abandoned": abandoned})
        }
        16..=17 => {
            guess.in_flight.remove(&pair);
            guess.cached.insert(pair);
            json!({"op": "connected", "at": at, "peer": peer, "channel": channel,
                "conn": conn})
        }
        18 => {
            guess.cached.remove(&pair);
            json!({"op": "open_failed", "at": at, "peer": peer, "channel": channel,
                "generation": rng.random_range(1..4u64)})
        }
        _ => {
            guess.cached.remove(&pair);
            json!({"op": "closed", "at": at, "peer": peer, "channel": channel,
                "generation": rng.random_range(1..4u64)})
        }
    }
}

/// An `ended` op: publisher number `publisher` of subscription `(peer, name, flow)` ended.
fn driver_ended(at: u64, (peer, name, flow): (u8, &str, u8), publisher: u64) -> Value {
    json!({"op": "ended", "at": at, "peer": peer, "name": name, "flow": driver_flow(flow),
        "publisher": publisher})
}

/// A random driver trace: peers 0–3 and 250 (invalid), every op, time moving by up to 3 s
/// (past dial backoffs, idle timeouts and some join waits), `timeout` often; generations and
/// connections from small ranges so that current, replaced and unknown ones all occur; host
/// claims of actors 0–2 at generations 1–4 and now and then past a bound (10% forged), and
/// handoffs, mostly of an actor the walk registered; telemetry streams, controls and
/// ended publishers over [`DRIVER_STREAMS`] and [`DRIVER_FLOWS`]; while the walk knows a
/// publisher live, half the `ended` ops end one (`everyone`: the allow list is open, which
/// that guess needs). A quarter of the walks mostly open streams to two peers on two channels,
/// so that opens wait on a dial, its end is reported under a live ticket, and waiters hear a
/// failure.
fn driver_walk(rng: &mut Xoshiro256PlusPlus, len: usize, everyone: bool) -> Vec<Value> {
    let mut at = 0u64;
    let mut conn = 0u64;
    let mut subscribed: Option<(u8, &str, u8)> = None;
    let mut publishing = PublishGuess {
        everyone,
        streams: BTreeSet::new(),
        live: BTreeMap::new(),
        publishers: 0,
    };
    let focused = rng.random_bool(0.25);
    let mut guess = OpenGuess::default();
    let mut registered: Vec<u64> = Vec::new();
    (0..len)
        .map(|index| {
            at += [0, 0, 100, 250, 700, 1_100, 3_000][rng.random_range(0..7)];
            conn += 1;
            if focused && rng.random_bool(0.7) {
                return driver_open_op(rng, at, conn, &mut guess);
            }
            // While a publisher is live, now and then it ends (its collector went away).
            if !publishing.live.is_empty() && rng.random_bool(0.1) {
                if let Some((key, publisher)) = publishing.end_live(rng) {
                    return driver_ended(at, key, publisher);
                }
            }
            let peer = DRIVER_PEERS[rng.random_range(0..DRIVER_PEERS.len())];
            let generation = rng.random_range(1..8u64);
            let channel = DRIVER_CHANNELS[rng.random_range(0..DRIVER_CHANNELS.len())];
            // Half the walks start with a telemetry stream, so subscriptions to it go live.
            if index == 0 && rng.random_bool(0.5) {
                publishing.streams.insert(DRIVER_STREAMS[0]);
                return json!({"op": "stream", "at": at, "name": DRIVER_STREAMS[0]});
            }
            match rng.random_range(0..33) {
                0..=1 => json!({"op": "accept", "at": at, "peer": peer,
                    "alpn": DRIVER_ALPNS[rng.random_range(0..DRIVER_ALPNS.len())], "conn": conn}),
                2 => json!({"op": "connected", "at": at, "peer": peer, "channel": channel,
                    "conn": conn}),
                3 => json!({"op": "closed", "at": at, "peer": peer, "channel": channel,
                    "generation": generation}),
                4 => json!({"op": "disconnect", "at": at, "peer": peer, "channel": channel}),
                5 => json!({"op": "admit", "at": at, "peer": peer,
                    "path": DRIVER_PATHS[rng.random_range(0..DRIVER_PATHS.len())],
                    "direction": if rng.random_bool(0.5) { "inbound" } else { "outbound" }}),
                6..=7 => json!({"op": "send", "at": at, "peer": peer}),
                8 => {
                    // The writer's stream: none, or on some generation (often the current).
                    let stream = if rng.random_bool(0.5) {
                        json!(generation)
                    } else {
                        Value::Null
                    };
                    json!({"op": "batch", "at": at, "peer": peer,
                        "frames": rng.random_range(1..5u64), "swim": rng.random_bool(0.3),
                        "stream": stream})
                }
                9 => json!({"op": "write_failed", "at": at, "peer": peer,
                    "generation": generation, "frames": rng.random_range(1..5u64),
                    "swim": rng.random_bool(0.5)}),
                10 => json!({"op": "idle", "at": at, "peer": peer}),
                11 => {
                    let conn = if rng.random_bool(0.5) {
                        json!(conn)
                    } else {
                        Value::Null
                    };
                    json!({"op": "dialed", "at": at, "peer": peer, "conn": conn})
                }
                12 => json!({"op": "join", "at": at, "peer": peer,
                    "relay": rng.random_bool(0.5), "direct": rng.random_range(0..3u64)}),
                13 => json!({"op": "join_connected", "at": at, "peer": peer}),
                14 => json!({"op": "join_sent", "at": at, "peer": peer, "conn": conn}),
                15 => json!({"op": "join_failed", "at": at, "peer": peer}),
                16 if rng.random_bool(0.2) => {
                    json!({"op": "unread", "at": at, "peer": peer, "channel": channel})
                }
                16 => json!({"op": "fault", "at": at, "peer": peer, "fatal": rng.random_bool(0.5),
                    "channel": channel}),
                17 => json!({"op": "stopped", "at": at, "peer": peer, "generation": generation}),
                18 => json!({"op": "open", "at": at, "peer": peer,
                    "path": DRIVER_PATHS[rng.random_range(0..DRIVER_PATHS.len())],
                    "channel": channel}),
                19 => json!({"op": "open_failed", "at": at, "peer": peer, "channel": channel,
                    "generation": generation}),
                20 => json!({"op": "egress_full", "at": at,
                    "frames": rng.random_range(1..5u64)}),
                // A handoff mostly of an actor this walk registered (so that some succeed).
                21 if rng.random_bool(0.4) => {
                    let actor = match registered.last() {
                        Some(&actor) if rng.random_bool(0.8) => actor,
                        _ => rng.random_range(0..3u64),
                    };
                    json!({"op": "hand_off", "at": at, "actor": actor, "to": peer,
                        "generation": claim_generation(rng), "forged": rng.random_bool(0.1)})
                }
                21 => {
                    let actor = rng.random_range(0..3u64);
                    registered.push(actor);
                    json!({"op": "register", "at": at, "actor": actor,
                        "generation": claim_generation(rng), "forged": rng.random_bool(0.1)})
                }
                22 => {
                    let name = DRIVER_STREAMS[rng.random_range(0..DRIVER_STREAMS.len())];
                    publishing.streams.insert(name);
                    json!({"op": "stream", "at": at, "name": name})
                }
                23..=24 => {
                    // Often the last subscription drawn ends again (an unsubscribe of it), so
                    // that stopping live ones is common; otherwise any payload.
                    let payload = match subscribed {
                        Some((collector, name, flow)) if rng.random_bool(0.4) => {
                            subscribed = None;
                            publishing.control(collector, false, name, flow);
                            return json!({"op": "control", "at": at, "peer": collector,
                                "payload": driver_control_payload(2, flow, name.as_bytes())});
                        }
                        _ if rng.random_bool(0.3) => {
                            // Mostly a stream the node has, so that the subscription starts.
                            let streams = &publishing.streams;
                            let name = if !streams.is_empty() && rng.random_bool(0.8) {
                                let index = rng.random_range(0..streams.len());
                                *streams.iter().nth(index).expect("index below the length")
                            } else {
                                DRIVER_STREAMS[rng.random_range(0..DRIVER_STREAMS.len())]
                            };
                            let flow = DRIVER_FLOWS[rng.random_range(0..DRIVER_FLOWS.len())];
                            subscribed = Some((peer, name, flow));
                            publishing.control(peer, true, name, flow);
                            driver_control_payload(1, flow, name.as_bytes())
                        }
                        _ => {
                            let (payload, asks) = driver_control(rng);
                            if let Some((subscribe, name, flow)) = asks {
                                publishing.control(peer, subscribe, name, flow);
                            }
                            payload
                        }
                    };
                    json!({"op": "control", "at": at, "peer": peer, "payload": payload})
                }
                25 => {
                    // Half the time a live publisher (as the walk guesses them) ends, with
                    // its own number; otherwise a subscription and a number drawn at random
                    // (mostly not live: nothing changes).
                    let live = if rng.random_bool(0.5) {
                        publishing.end_live(rng)
                    } else {
                        None
                    };
                    let (key, publisher) = match live {
                        Some(live) => live,
                        None => {
                            let key = (
                                peer,
                                DRIVER_STREAMS[rng.random_range(0..DRIVER_STREAMS.len())],
                                DRIVER_FLOWS[rng.random_range(0..DRIVER_FLOWS.len())],
                            );
                            let publisher = rng.random_range(0..=publishing.publishers);
                            publishing.ended(key, publisher);
                            (key, publisher)
                        }
                    };
                    driver_ended(at, key, publisher)
                }
                26 if rng.random_range(0..8) == 0 => json!({"op": "close", "at": at}),
                27 => json!({"op": "open_dial_failed", "at": at, "peer": peer,
                    "channel": channel, "ticket": rng.random_range(1..5u64),
                    "abandoned": rng.random_range(0..3) == 0}),
                30 => json!({"op": "relays_seen", "at": at, "peer": peer,
                    "relays": driver_relays(rng)}),
                31 => json!({"op": "relays_for", "at": at, "peer": peer,
                    "given": driver_relays(rng)}),
                29 => json!({"op": "unresponsive", "at": at, "peer": peer,
                    "channel": channel, "generation": generation}),
                28 => json!({"op": "open_waited", "at": at, "peer": peer,
                    "channel": channel, "ticket": rng.random_range(1..5u64)}),
                _ => json!({"op": "timeout", "at": at}),
            }
        })
        .collect()
}

/// A claim generation for the driver section: mostly small, now and then past a bound.
fn claim_generation(rng: &mut Xoshiro256PlusPlus) -> u64 {
    match rng.random_range(0..10) {
        0 => (1u64 << 48) + rng.random_range(0..2u64),
        1 => (1u64 << 20) + rng.random_range(0..3u64),
        _ => rng.random_range(1..5u64),
    }
}

fn routing_case(allow: Value, ops: Vec<Value>) -> Value {
    let steps: Vec<Value> = ops
        .iter()
        .map(|_| json!({"inbound": null, "egress": null, "send_failed": null, "claim": null}))
        .collect();
    json!({"mailbox": 1, "allow": allow, "ops": ops, "steps": steps, "drops": {}})
}

fn join_case(events: Vec<Value>) -> Value {
    let steps: Vec<Value> = events
        .iter()
        .map(|_| json!({"phase": "", "attempt": null, "next_at": null}))
        .collect();
    json!({"events": events, "steps": steps})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_are_enumerated_by_length_then_lexicographically() {
        let firsts: Vec<Vec<usize>> = (0..7).map(|n| nth_sequence(2, n)).collect();
        assert_eq!(
            firsts,
            [
                vec![],
                vec![0],
                vec![1],
                vec![0, 0],
                vec![0, 1],
                vec![1, 0],
                vec![1, 1]
            ]
        );
    }

    #[test]
    fn generation_is_a_function_of_the_seed() {
        for section in crate::script::SECTIONS {
            let once = generate(section, 7, 20).unwrap();
            let again = generate(section, 7, 20).unwrap();
            assert_eq!(once.cases, again.cases, "{section}");
            assert_eq!(once.cases.len(), 20);
        }
    }
}
