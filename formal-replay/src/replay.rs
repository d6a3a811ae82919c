//! Replaying one conformance case against an engine: `tether-core` or the reference model.
//!
//! Each section has one function per engine that takes a parsed case, recomputes every
//! observation from the case's inputs, and returns the case as that engine sees it. The replay
//! then compares the two as JSON and reports the first key where they differ, so a failure
//! reads `steps[2].available: expected 4, got 5`.

use std::num::NonZeroUsize;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use tether_core::driver::ask::Ask;
use tether_core::request::{
    self as core_request, Acquire, CreditGate, Credits, Direction, EmissionChecker, GrantOutcome,
    GrantRouter, Observed, ReceiveWindow, RefusalKind, ReorderBuffer, RequestKey, RequestTable,
    RequestTableConfig, Seq, Violation, WriteGate, Written,
};
use tether_core::time::Time;
use tether_core::wire::bifaci::{Frame, FrameType, MessageId};

use crate::model;
use crate::script::{
    Disposition, DriverCase, Emission, EmissionCase, Ending, FrameTypesCase, GateCase, GateOp,
    GateStep, GrantTargetCase, HoldTrue, JoinCase, JoinEventKind, JoinStep, LedgerCase,
    NegotiateCase, Node, ReorderCase, ReorderError, ReorderStep, Rid, RoutingCase, RoutingOp,
    RoutingStep, SubstrateAction, SubstrateCase, TableCase, TableOpKind, TableStep, Verdict,
    ViolationName, WindowCase, WindowOp, WindowStep, WriterCase, Xid, SECTIONS,
};

/// Which implementation a case is replayed against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// `tether-core`.
    Core,
    /// The reference model.
    Model,
}

/// Why a case did not pass.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// The case does not follow the format (bad keys, values outside the domain).
    Malformed(String),
    /// The engine disagrees with the case.
    Diverged(Box<Divergence>),
}

/// The first key where an engine disagrees with a case.
#[derive(Debug, Clone, PartialEq)]
pub struct Divergence {
    /// Where, e.g. `steps[2].available`.
    pub path: String,
    /// What the case says.
    pub expected: Value,
    /// What the engine did.
    pub got: Value,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Malformed(why) => write!(f, "malformed case: {why}"),
            Failure::Diverged(divergence) => {
                let Divergence {
                    path,
                    expected,
                    got,
                } = divergence.as_ref();
                write!(f, "{path}: expected {expected}, got {got}")
            }
        }
    }
}

/// The section named `name`, or an error naming the known ones.
pub fn known_section(name: &str) -> Result<&'static str, String> {
    SECTIONS
        .iter()
        .copied()
        .find(|known| *known == name)
        .ok_or_else(|| format!("unknown section {name:?} (known: {})", SECTIONS.join(", ")))
}

/// Replays one raw case of `section` against `engine`.
pub fn check_case(section: &str, raw: &Value, engine: Engine) -> Result<(), Failure> {
    match section {
        "frame_types" => replay(raw, engine, core_frame_types, model_frame_types),
        "ledger" => replay(raw, engine, core_ledger, model_ledger),
        "negotiate" => replay(raw, engine, core_negotiate, model_negotiate),
        "grant_target" => replay(raw, engine, core_grant_target, model_grant_target),
        "gate" => replay(raw, engine, core_gate, model_gate),
        "window" => replay(raw, engine, core_window, model_window),
        "reorder" => replay(raw, engine, core_reorder, model_reorder),
        "writer" => replay(raw, engine, core_writer, model_writer),
        "table" => replay(raw, engine, core_table, model_table),
        "emission" => replay(raw, engine, core_emission, model_emission),
        "substrate" => replay(raw, engine, substrate_trace, substrate_trace),
        "driver" => replay(raw, engine, crate::driver::run_case, model_driver),
        "join" => replay(raw, engine, core_join, model_join),
        "routing" => replay(raw, engine, core_routing, model_routing),
        "switch" => replay(
            raw,
            engine,
            crate::switch::run_case,
            crate::switch_model::run_case,
        ),
        "peer" => replay(raw, engine, crate::peer::core_peer, crate::peer::model_peer),
        other => Err(Failure::Malformed(known_section(other).unwrap_err())),
    }
}

/// Fills in the observations of a case whose inputs are set, using the model (the oracle of
/// `generate`). The case's own observations are ignored.
pub fn complete_with_model(section: &str, case: &Value) -> Result<Value, Failure> {
    fn run<C: DeserializeOwned + Serialize>(
        raw: &Value,
        model: fn(&C) -> Result<C, String>,
    ) -> Result<Value, Failure> {
        let case: C = parse(raw)?;
        let completed = model(&case).map_err(Failure::Malformed)?;
        Ok(to_json(&completed))
    }
    match section {
        "frame_types" => run(case, model_frame_types),
        "ledger" => run(case, model_ledger),
        "negotiate" => run(case, model_negotiate),
        "grant_target" => run(case, model_grant_target),
        "gate" => run(case, model_gate),
        "window" => run(case, model_window),
        "reorder" => run(case, model_reorder),
        "writer" => run(case, model_writer),
        "table" => run(case, model_table),
        "emission" => run(case, model_emission),
        "substrate" => run(case, substrate_trace),
        "driver" => run(case, model_driver),
        "join" => run(case, model_join),
        "routing" => run(case, model_routing),
        "switch" => run(case, crate::switch_model::run_case),
        "peer" => run(case, crate::peer::model_peer),
        other => Err(Failure::Malformed(known_section(other).unwrap_err())),
    }
}

type Runner<C> = fn(&C) -> Result<C, String>;

fn replay<C: DeserializeOwned + Serialize>(
    raw: &Value,
    engine: Engine,
    core: Runner<C>,
    model: Runner<C>,
) -> Result<(), Failure> {
    let case: C = parse(raw)?;
    let run = match engine {
        Engine::Core => core,
        Engine::Model => model,
    };
    let actual = run(&case).map_err(Failure::Malformed)?;
    match first_difference(&to_json(&case), &to_json(&actual), String::new()) {
        None => Ok(()),
        Some((path, expected, got)) => Err(Failure::Diverged(Box::new(Divergence {
            path,
            expected,
            got,
        }))),
    }
}

fn parse<C: DeserializeOwned>(raw: &Value) -> Result<C, Failure> {
    C::deserialize(raw).map_err(|error| Failure::Malformed(error.to_string()))
}

fn to_json(value: &impl Serialize) -> Value {
    serde_json::to_value(value).expect("script types serialize to JSON without fail")
}

/// The first place (in key order of `expected`) where two JSON trees differ.
fn first_difference(expected: &Value, got: &Value, path: String) -> Option<(String, Value, Value)> {
    match (expected, got) {
        // Same keys: descend. Different keys (another variant, e.g. `hold` vs `error`):
        // report the whole object, which reads better than a missing key.
        (Value::Object(left), Value::Object(right))
            if left.len() == right.len() && left.keys().all(|key| right.contains_key(key)) =>
        {
            for (key, value) in left {
                let child = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                let other = right.get(key).unwrap_or(&Value::Null);
                if let Some(found) = first_difference(value, other, child) {
                    return Some(found);
                }
            }
            None
        }
        (Value::Array(left), Value::Array(right)) if left.len() == right.len() => left
            .iter()
            .zip(right)
            .enumerate()
            .find_map(|(index, (value, other))| {
                first_difference(value, other, format!("{path}[{index}]"))
            }),
        _ if expected == got => None,
        _ => Some((path, expected.clone(), got.clone())),
    }
}

fn same_length<T, U>(ops: &[T], steps: &[U]) -> Result<(), String> {
    if ops.len() == steps.len() {
        Ok(())
    } else {
        Err(format!("{} ops but {} steps", ops.len(), steps.len()))
    }
}

fn known_type(code: u8) -> Result<FrameType, String> {
    FrameType::from_code(u64::from(code)).ok_or_else(|| format!("frame code {code} is unknown"))
}

// ---------------------------------------------------------------------------------------------
// tether-core

fn core_frame_types(case: &FrameTypesCase) -> Result<FrameTypesCase, String> {
    let frame_type = FrameType::from_code(u64::from(case.code));
    Ok(FrameTypesCase {
        code: case.code,
        known: frame_type.is_some(),
        flow: frame_type.map(core_request::is_flow),
        terminal: frame_type.map(core_request::is_terminal),
        ends: frame_type
            .and_then(core_request::terminal_of)
            .map(|ending| match ending {
                core_request::Ending::Finished => Ending::Finished,
                core_request::Ending::Failed => Ending::Failed,
            }),
    })
}

/// Through the request table: a request whose window is `remaining`, one frame observed.
fn core_ledger(case: &LedgerCase) -> Result<LedgerCase, String> {
    let frame_type = known_type(case.frame)?;
    let mut table = RequestTable::new(RequestTableConfig::default());
    let key = RequestKey {
        xid: MessageId::Uint(1),
        rid: MessageId::Uint(101),
    };
    let now = Time::ZERO;
    table
        .register(key, (), Credits::new(case.remaining), now)
        .map_err(|e| e.to_string())?;
    let observed = Observed {
        stream: Some("s"),
        frame_type,
        direction: Direction::In,
        payload_bytes: 0,
        granted: case.granted,
    };
    assert!(
        table.observe(key, observed, now),
        "the request was just registered"
    );
    let state = table.get(key).expect("the request is live");
    let after = state
        .streams
        .get(&Some("s".to_owned()))
        .map_or(0, |s| s.credit_outstanding);
    Ok(LedgerCase {
        after,
        ..case.clone()
    })
}

fn core_negotiate(case: &NegotiateCase) -> Result<NegotiateCase, String> {
    let window = core_request::negotiate(Credits::new(case.ours), Credits::new(case.theirs));
    Ok(NegotiateCase {
        window: window.map(Credits::get),
        ..case.clone()
    })
}

/// Through a [`GrantRouter`]: one gate per identity (window 0) for request 1, a decoy gate
/// named like the grant under request 2, one CREDIT of 1.
fn core_grant_target(case: &GrantTargetCase) -> Result<GrantTargetCase, String> {
    let (own, decoy) = (MessageId::Uint(1), MessageId::Uint(2));
    let mut router = GrantRouter::new();
    for stream in &case.streams {
        router
            .register(own, stream.as_deref(), Credits::ZERO)
            .map_err(|e| e.to_string())?;
    }
    router
        .register(decoy, case.named.as_deref(), Credits::ZERO)
        .map_err(|e| e.to_string())?;
    let target = match router.credit(own, case.named.as_deref(), Credits::new(1)) {
        GrantOutcome::Credited { stream } => Some(stream.map(str::to_owned)),
        GrantOutcome::Unmatched => None,
    };
    // The full grant went to the target and nowhere else.
    let credited: Vec<Option<String>> = case
        .streams
        .iter()
        .filter(|stream| {
            let gate = router
                .gate_mut(own, stream.as_deref())
                .expect("registered above");
            gate.available() != Credits::ZERO
        })
        .cloned()
        .collect();
    let decoy_gate = router
        .gate_mut(decoy, case.named.as_deref())
        .expect("registered above");
    if decoy_gate.available() != Credits::ZERO {
        return Err("core credited another request's gate".into());
    }
    if credited != target.clone().into_iter().collect::<Vec<_>>() {
        return Err(format!("core credited {credited:?} for target {target:?}"));
    }
    Ok(GrantTargetCase {
        matched: target.is_some(),
        target: target.flatten(),
        ..case.clone()
    })
}

fn core_gate(case: &GateCase) -> Result<GateCase, String> {
    same_length(&case.ops, &case.steps)?;
    let mut gate = CreditGate::new(Credits::new(case.window));
    let steps = case
        .ops
        .iter()
        .map(|op| {
            let answer = match op {
                GateOp::Acquire { n } => Some(match gate.acquire(Credits::new(*n)) {
                    Acquire::Acquired => "acquired".to_owned(),
                    Acquire::Wait => "wait".to_owned(),
                    Acquire::Closed(reason) => format!("closed:{reason}"),
                }),
                GateOp::Grant { n } => {
                    gate.grant(Credits::new(*n));
                    None
                }
                GateOp::Close { reason } => {
                    gate.close(reason);
                    None
                }
            };
            GateStep {
                answer,
                available: gate.available().get(),
                closed: gate.closed_reason().map(str::to_owned),
            }
        })
        .collect();
    Ok(GateCase {
        steps,
        ..case.clone()
    })
}

fn core_window(case: &WindowCase) -> Result<WindowCase, String> {
    same_length(&case.ops, &case.steps)?;
    let mut window = ReceiveWindow::new(Credits::new(case.window));
    let steps = case
        .ops
        .iter()
        .map(|op| {
            let step = match op {
                WindowOp::Arrive => window.arrive(),
                WindowOp::Continuation => window.continuation(),
                WindowOp::Consume => window.consume(),
                WindowOp::Flush => window.flush(),
            };
            WindowStep {
                violation: step.violation,
                grant: step.grant.get(),
                remaining: window.remaining().get(),
                pending: window.pending().get(),
            }
        })
        .collect();
    Ok(WindowCase {
        steps,
        ..case.clone()
    })
}

fn core_reorder(case: &ReorderCase) -> Result<ReorderCase, String> {
    same_length(&case.arrivals, &case.steps)?;
    let mut buffer = ReorderBuffer::new(case.limit);
    let steps = case
        .arrivals
        .iter()
        .map(|seq| {
            let mut delivered = Vec::new();
            let accepted = buffer.accept(Seq(*seq), *seq, |at, item| {
                assert_eq!(at.0, item, "the buffer hands each item on with its own seq");
                delivered.push(item);
            });
            match accepted {
                Ok(core_request::Accepted::Held) => ReorderStep::Hold(HoldTrue),
                Ok(core_request::Accepted::Delivered { .. }) => ReorderStep::Deliver(delivered),
                Err(refusal) => ReorderStep::Error(match refusal.kind {
                    RefusalKind::Stale => ReorderError::Stale,
                    RefusalKind::Duplicate => ReorderError::Duplicate,
                    RefusalKind::Overflow => ReorderError::Overflow,
                }),
            }
        })
        .collect();
    Ok(ReorderCase {
        steps,
        ..case.clone()
    })
}

/// Through the wire: each written frame is encoded as a bifaci frame and decoded again, and
/// the seq is read from what was decoded.
fn core_writer(case: &WriterCase) -> Result<WriterCase, String> {
    same_length(&case.frames, &case.written)?;
    same_length(&case.frames, &case.seqs)?;
    let mut gate = WriteGate::new();
    let mut written = Vec::new();
    let mut seqs = Vec::new();
    for code in &case.frames {
        let frame_type = known_type(*code)?;
        match gate.write(frame_type) {
            Written::Suppressed => {
                written.push(false);
                seqs.push(None);
            }
            Written::Sent { seq, .. } => {
                let mut frame = Frame::new(frame_type, MessageId::Uint(101));
                frame.routing_id = Some(MessageId::Uint(1));
                frame.seq = seq.0;
                // What version 6 requires of these types to be written at all.
                match frame_type {
                    FrameType::Chunk => frame.chunk_index = Some(0),
                    FrameType::Policy => {
                        frame.meta = tether_core::wire::bifaci::NetworkPolicy::Full
                            .to_frame()
                            .meta;
                    }
                    _ => {}
                }
                let wire = Bytes::from(frame.encode_body());
                let decoded = Frame::decode_body(&wire).map_err(|e| e.to_string())?;
                written.push(true);
                seqs.push(Some(decoded.seq));
            }
        }
    }
    Ok(WriterCase {
        written,
        seqs,
        ..case.clone()
    })
}

fn core_table(case: &TableCase) -> Result<TableCase, String> {
    same_length(&case.ops, &case.steps)?;
    let ring_capacity = ring_capacity(case)?;
    let mut table = RequestTable::new(RequestTableConfig {
        ring_capacity,
        ..RequestTableConfig::default()
    });
    let key = |xid: Xid, rid: Rid| RequestKey {
        xid: core_xid(xid),
        rid: core_rid(rid),
    };
    let now = Time::ZERO;
    let steps = case
        .ops
        .iter()
        .map(|op| {
            let ok = match op.op {
                TableOpKind::Register => table
                    .register(key(op.xid, op.rid), (), Credits::new(32), now)
                    .is_ok(),
                TableOpKind::Terminate => table
                    .terminate(key(op.xid, op.rid), core_request::TerminationKind::End, now)
                    .is_some(),
            };
            let frames = Rid::ALL.map(|rid| match table.disposition(core_rid(rid)) {
                core_request::Disposition::Route => Disposition::Route,
                core_request::Disposition::Straggler => Disposition::Straggler,
                core_request::Disposition::NoRoute => Disposition::NoRoute,
            });
            TableStep { ok, frames }
        })
        .collect();
    Ok(TableCase {
        steps,
        live: table.live_len() as u64,
        registered: table.counters().registered,
        ..case.clone()
    })
}

/// Core bounds its ring; a ring longer than the script's terminations behaves the same as an
/// unbounded one, so the capacity is the smaller of `keep` and the number of ops.
fn ring_capacity(case: &TableCase) -> Result<NonZeroUsize, String> {
    if case.keep == 0 {
        return Err("keep must be at least 1".into());
    }
    let bound = case.ops.len().max(1) as u64;
    let capacity = usize::try_from(case.keep.min(bound)).expect("bounded by a usize length");
    Ok(NonZeroUsize::new(capacity).expect("keep and bound are both at least 1"))
}

fn core_xid(xid: Xid) -> MessageId {
    MessageId::Uint(match xid {
        Xid::X1 => 1,
        Xid::X2 => 2,
    })
}

fn core_rid(rid: Rid) -> MessageId {
    MessageId::Uint(match rid {
        Rid::R1 => 101,
        Rid::R2 => 102,
        Rid::R3 => 103,
    })
}

fn core_emission(case: &EmissionCase) -> Result<EmissionCase, String> {
    let mut checker = EmissionChecker::new();
    for emission in &case.emitted {
        let emission = match emission {
            Emission::StreamStart { stream } => core_request::Emission::StreamStart(stream),
            Emission::Chunk { stream, index } => core_request::Emission::Chunk {
                stream,
                index: *index,
            },
            Emission::StreamEnd { stream, count } => core_request::Emission::StreamEnd {
                stream,
                count: *count,
            },
            Emission::End {} => core_request::Emission::End,
            Emission::Err {} => core_request::Emission::Err,
            Emission::Other {} => core_request::Emission::Other,
        };
        if checker.step(emission).is_err() {
            break;
        }
    }
    let mut result = EmissionCase {
        emitted: case.emitted.clone(),
        violation: None,
        at: None,
        stream: None,
        expected: None,
        got: None,
    };
    if let Some((at, violation)) = checker.violation() {
        result.at = Some(at);
        let (name, stream, counts) = match violation {
            Violation::AfterEnd => (ViolationName::AfterEnd, None, None),
            Violation::StreamRestarted { stream } => {
                (ViolationName::StreamRestarted, Some(stream), None)
            }
            Violation::StreamNotOpen { stream } => {
                (ViolationName::StreamNotOpen, Some(stream), None)
            }
            Violation::ChunkOutOfPlace {
                stream,
                expected,
                got,
            } => (
                ViolationName::ChunkOutOfPlace,
                Some(stream),
                Some((*expected, *got)),
            ),
            Violation::ChunkCountWrong {
                stream,
                expected,
                got,
            } => (
                ViolationName::ChunkCountWrong,
                Some(stream),
                Some((*expected, *got)),
            ),
            Violation::EndWithOpenStream { stream } => {
                (ViolationName::EndWithOpenStream, Some(stream), None)
            }
            other => {
                return Err(format!(
                    "core reported a violation outside the format: {other}"
                ))
            }
        };
        result.violation = Some(name);
        result.stream = stream.cloned();
        result.expected = counts.map(|(expected, _)| expected);
        result.got = counts.map(|(_, got)| got);
    }
    Ok(result)
}

// ---------------------------------------------------------------------------------------------
// the reference model

fn model_frame_types(case: &FrameTypesCase) -> Result<FrameTypesCase, String> {
    let row = model::frame_type(case.code);
    Ok(FrameTypesCase {
        code: case.code,
        known: row.is_some(),
        flow: row.map(|row| row.flow),
        terminal: row.map(|row| row.terminal),
        ends: row.and_then(|row| row.ends).map(|ends| {
            if ends == "finished" {
                Ending::Finished
            } else {
                Ending::Failed
            }
        }),
    })
}

fn model_ledger(case: &LedgerCase) -> Result<LedgerCase, String> {
    if model::frame_type(case.frame).is_none() {
        return Err(format!("frame code {} is unknown", case.frame));
    }
    let after = model::ledger(case.remaining, case.frame, case.granted);
    let after = i64::try_from(after).map_err(|_| format!("ledger {after} does not fit i64"))?;
    Ok(LedgerCase {
        after,
        ..case.clone()
    })
}

fn model_negotiate(case: &NegotiateCase) -> Result<NegotiateCase, String> {
    Ok(NegotiateCase {
        window: model::negotiate(case.ours, case.theirs),
        ..case.clone()
    })
}

fn model_grant_target(case: &GrantTargetCase) -> Result<GrantTargetCase, String> {
    for (index, stream) in case.streams.iter().enumerate() {
        if case.streams[..index].contains(stream) {
            return Err(format!("stream {stream:?} registered twice"));
        }
    }
    let target = model::grant_target(&case.streams, &case.named);
    Ok(GrantTargetCase {
        matched: target.is_some(),
        target: target.flatten(),
        ..case.clone()
    })
}

fn model_gate(case: &GateCase) -> Result<GateCase, String> {
    same_length(&case.ops, &case.steps)?;
    let mut gate = model::Gate::opened(case.window);
    let steps = case
        .ops
        .iter()
        .map(|op| {
            let op = match op {
                GateOp::Acquire { n } => model::GateOp::Acquire(*n),
                GateOp::Grant { n } => model::GateOp::Grant(*n),
                GateOp::Close { reason } => model::GateOp::Close(reason.clone()),
            };
            let answer = gate.apply(&op);
            let available = u64::try_from(gate.available).expect("the model saturates grants");
            GateStep {
                answer,
                available,
                closed: gate.closed.clone(),
            }
        })
        .collect();
    Ok(GateCase {
        steps,
        ..case.clone()
    })
}

fn model_window(case: &WindowCase) -> Result<WindowCase, String> {
    same_length(&case.ops, &case.steps)?;
    let mut window = model::Window::opened(case.window);
    let mut steps = Vec::new();
    for op in &case.ops {
        let op = match op {
            WindowOp::Arrive => model::WindowOp::Arrive,
            WindowOp::Continuation => model::WindowOp::Continuation,
            WindowOp::Consume => model::WindowOp::Consume,
            WindowOp::Flush => model::WindowOp::Flush,
        };
        let (violation, grant) = window.apply(op);
        let fit = |n: u128| u64::try_from(n).map_err(|_| format!("{n} does not fit u64"));
        steps.push(WindowStep {
            violation,
            grant: fit(grant)?,
            remaining: fit(window.remaining)?,
            pending: fit(window.pending)?,
        });
    }
    Ok(WindowCase {
        steps,
        ..case.clone()
    })
}

fn model_reorder(case: &ReorderCase) -> Result<ReorderCase, String> {
    same_length(&case.arrivals, &case.steps)?;
    let mut buffer = model::Reorder::start(case.limit);
    let steps = case
        .arrivals
        .iter()
        .map(|seq| match buffer.accept(*seq) {
            model::ReorderStep::Deliver(seqs) => ReorderStep::Deliver(seqs),
            model::ReorderStep::Hold => ReorderStep::Hold(HoldTrue),
            model::ReorderStep::Error("stale") => ReorderStep::Error(ReorderError::Stale),
            model::ReorderStep::Error("duplicate") => ReorderStep::Error(ReorderError::Duplicate),
            model::ReorderStep::Error(_) => ReorderStep::Error(ReorderError::Overflow),
        })
        .collect();
    Ok(ReorderCase {
        steps,
        ..case.clone()
    })
}

fn model_writer(case: &WriterCase) -> Result<WriterCase, String> {
    same_length(&case.frames, &case.written)?;
    same_length(&case.frames, &case.seqs)?;
    if let Some(code) = case
        .frames
        .iter()
        .find(|code| model::frame_type(**code).is_none())
    {
        return Err(format!("frame code {code} is unknown"));
    }
    let out = model::writer(&case.frames);
    Ok(WriterCase {
        written: out.iter().map(|(written, _)| *written).collect(),
        seqs: out.iter().map(|(_, seq)| *seq).collect(),
        ..case.clone()
    })
}

fn model_table(case: &TableCase) -> Result<TableCase, String> {
    same_length(&case.ops, &case.steps)?;
    if case.keep == 0 {
        return Err("keep must be at least 1".into());
    }
    let mut table = model::Table::empty(case.keep);
    let steps = case
        .ops
        .iter()
        .map(|op| {
            let ok = match op.op {
                TableOpKind::Register => table.register(op.xid.name(), op.rid.name()),
                TableOpKind::Terminate => table.terminate(op.xid.name(), op.rid.name()),
            };
            let frames = Rid::ALL.map(|rid| match table.disposition(rid.name()) {
                "route" => Disposition::Route,
                "straggler" => Disposition::Straggler,
                _ => Disposition::NoRoute,
            });
            TableStep { ok, frames }
        })
        .collect();
    Ok(TableCase {
        steps,
        live: table.live.len() as u64,
        registered: table.registered,
        ..case.clone()
    })
}

fn model_emission(case: &EmissionCase) -> Result<EmissionCase, String> {
    let emitted: Vec<model::Emission> = case
        .emitted
        .iter()
        .map(|emission| match emission {
            Emission::StreamStart { stream } => model::Emission::StreamStart(stream.clone()),
            Emission::Chunk { stream, index } => model::Emission::Chunk(stream.clone(), *index),
            Emission::StreamEnd { stream, count } => {
                model::Emission::StreamEnd(stream.clone(), *count)
            }
            Emission::End {} => model::Emission::End,
            Emission::Err {} => model::Emission::Err,
            Emission::Other {} => model::Emission::Other,
        })
        .collect();
    let (violation, at, stream, expected, got) = model::check_emissions(&emitted);
    let violation = violation.map(|name| match name {
        "afterEnd" => ViolationName::AfterEnd,
        "streamRestarted" => ViolationName::StreamRestarted,
        "streamNotOpen" => ViolationName::StreamNotOpen,
        "chunkOutOfPlace" => ViolationName::ChunkOutOfPlace,
        "chunkCountWrong" => ViolationName::ChunkCountWrong,
        _ => ViolationName::EndWithOpenStream,
    });
    Ok(EmissionCase {
        emitted: case.emitted.clone(),
        violation,
        at,
        stream,
        expected,
        got,
    })
}

// ---------------------------------------------------------------------------------------------
// substrate traces: core's machines run the trace, the model judges (both engines alike)

fn substrate_trace(case: &SubstrateCase) -> Result<SubstrateCase, String> {
    use crate::substrate::{replay as run_trace, Action};
    use tether_core::substrate::harness::Party;
    if case.window == 0 {
        return Err("window must be at least 1".into());
    }
    let node = |node: Node| match node {
        Node::A => Party::A,
        Node::B => Party::B,
    };
    let actions: Vec<Action> = case
        .actions
        .iter()
        .map(|action| match *action {
            SubstrateAction::Send { n } => Action::Send(n),
            SubstrateAction::Answer {} => Action::Answer,
            SubstrateAction::Commit { node: n } => Action::Commit(node(n)),
            SubstrateAction::Deliver { to, index } => Action::Deliver(node(to), index),
            SubstrateAction::Duplicate { to, index } => Action::Duplicate(node(to), index),
            SubstrateAction::Drop { to, index } => Action::Drop(node(to), index),
            SubstrateAction::Reconnect {} => Action::Reconnect,
            SubstrateAction::Crash { node: n } => Action::Crash(node(n)),
            SubstrateAction::Wait {} => Action::Wait,
            SubstrateAction::Stray {} => Action::Stray,
            SubstrateAction::Close {} => Action::Close,
        })
        .collect();
    let verdict = match run_trace(usize::from(case.window), &actions) {
        Ok(()) => Verdict::Ok,
        Err(_) => Verdict::Broken,
    };
    Ok(SubstrateCase {
        verdict,
        ..case.clone()
    })
}

/// The driver section's independent model.
fn model_driver(case: &DriverCase) -> Result<DriverCase, String> {
    crate::driver_model::run_case(case)
}

/// The join section on the machine production runs: one `Driver` (the driver section's
/// configuration, every peer admitted) joining one seed at 0 ms. Time reaches the machine
/// before each event (a due attempt goes in flight), and each event is the shell's report of
/// the attempt in flight.
fn core_join(case: &JoinCase) -> Result<JoinCase, String> {
    use tether_core::driver::{Driver, JoinPhase};

    same_length(&case.events, &case.steps)?;
    let seed = tether_core::driver::NodeId([1u8; 32]);
    let mut driver: Driver<u64> = Driver::new(crate::driver::config(None));
    driver
        .ask_join(Time::ZERO, seed, false, 1)
        .map_err(|_| "the seed was refused".to_owned())?;
    // The attempts the machine starts: attempt 1 at once, each later one when it is due.
    let attempts = |driver: &mut Driver<u64>| {
        std::iter::from_fn(|| driver.poll_action())
            .filter_map(|action| match action {
                tether_core::driver::Action::JoinAttempt { attempt, .. } => Some(attempt),
                _ => None,
            })
            .collect::<Vec<u32>>()
    };
    if attempts(&mut driver) != [1] {
        return Err("the join did not start attempt 1".to_owned());
    }
    let mut waiting: Option<(u64, u32)> = None;
    let phase = |driver: &Driver<u64>| {
        driver
            .join_statuses()
            .find(|(peer, _)| **peer == seed)
            .map(|(_, status)| status.phase)
    };
    let mut steps = Vec::with_capacity(case.events.len());
    for (conn, event) in (1u64..).zip(&case.events) {
        let at = Time::from_millis(event.at);
        driver.handle_timeout(at);
        let due = waiting.filter(|(due, _)| *due <= event.at);
        let started = attempts(&mut driver);
        if started.as_slice() != due.map(|(_, attempt)| attempt).as_slice() {
            return Err(format!(
                "at {}: the machine started attempts {started:?}, waiting {waiting:?}",
                event.at
            ));
        }
        if due.is_some() {
            waiting = None;
        }
        let before = phase(&driver);
        match event.event {
            JoinEventKind::Connected => driver.handle_join_connected(at, seed),
            JoinEventKind::Sent => {
                driver.ask_join_sent(at, seed, conn);
            }
            JoinEventKind::Failed => driver.handle_join_failed(at, seed, "failed"),
        }
        // An event starts no attempt (a retry waits for its due time).
        if !attempts(&mut driver).is_empty() {
            return Err(format!(
                "at {}: an event started an attempt at once",
                event.at
            ));
        }
        let after = phase(&driver).ok_or("the join is gone")?;
        let (name, attempt) = match after {
            JoinPhase::Connecting { attempt, .. } => ("connecting", Some(attempt)),
            JoinPhase::Sending => ("sending", None),
            JoinPhase::Sent => ("sent", None),
            JoinPhase::Failed => ("failed", None),
        };
        // The join's timer is the machine's only one: it is the next attempt's due time,
        // reported when this event moved the join to a new attempt.
        let next_at = (Some(after) != before && attempt.is_some())
            .then(|| driver.poll_timeout().map(Time::as_millis))
            .flatten();
        if let (Some(due), Some(attempt)) = (next_at, attempt) {
            waiting = Some((due, attempt));
        }
        steps.push(JoinStep {
            phase: name.to_owned(),
            attempt,
            next_at,
        });
    }
    Ok(JoinCase {
        steps,
        ..case.clone()
    })
}

fn model_join(case: &JoinCase) -> Result<JoinCase, String> {
    same_length(&case.events, &case.steps)?;
    let mut join = model::JoinModel::default();
    let steps = case
        .events
        .iter()
        .map(|event| {
            let kind = match event.event {
                JoinEventKind::Connected => "connected",
                JoinEventKind::Sent => "sent",
                JoinEventKind::Failed => "failed",
            };
            let next_at = join.event(event.at, kind);
            JoinStep {
                phase: join.phase.to_owned(),
                attempt: (join.phase == "connecting").then_some(join.attempt),
                next_at,
            }
        })
        .collect();
    Ok(JoinCase {
        steps,
        ..case.clone()
    })
}

// ---------------------------------------------------------------------------------------------
// routing (tether's own section)

fn routing_step() -> RoutingStep {
    RoutingStep {
        inbound: None,
        egress: None,
        send_failed: None,
        claim: None,
    }
}

/// The routing section on what production runs: inbound records through the shell's
/// `Routes` (with and without its memo; their drops reported to the machine as the reader
/// does), and everything else through one `Driver` (the driver section's configuration): egress
/// to a mailbox is `handle_send`, to an actor `handle_send_to_actor` (route view, location
/// cache, allow-list; every peer has a cached actor connection), claims `handle_claim` on
/// signed bytes, and a failed write
/// `handle_write_failed` with the SWIM flag `Routes` gives the writer. Peer `n` is the node
/// whose Ed25519 secret key is `[n; 32]`; actor `n` is the address `[n; 32]`.
fn core_routing(case: &RoutingCase) -> Result<RoutingCase, String> {
    use tether_core::driver::directory::CLAIM_BYTES;
    use tether_core::driver::{
        Action, Channel, ClaimVerdict, Driver, Generation, Inbound, PeerAuth, RouteMemo, Routes,
        SendVerdict,
    };

    same_length(&case.ops, &case.steps)?;
    let addr = |n: u8| tether_core::driver::ActorAddr([n; 32]);
    // Node ids are public keys: peer `n` is the host of its claims.
    let node = |n: u8| crate::driver::signed_claim(n, 0, 0).host;
    let named = std::cell::RefCell::new(std::collections::BTreeMap::new());
    // A peer the machine names was named to it by a claim, so its number is known.
    let number = |id: tether_core::driver::NodeId| {
        named
            .borrow()
            .get(&id)
            .map_or_else(|| "?".to_owned(), |n: &u8| n.to_string())
    };
    let mut config = crate::driver::config(None);
    if let Some(list) = &case.allow {
        config.auth = PeerAuth::allow_list(list.iter().map(|n| node(*n)));
    }
    if let Some(list) = &case.authorize {
        let allowed: std::collections::BTreeSet<(
            tether_core::driver::ActorAddr,
            tether_core::driver::NodeId,
        )> = list.iter().map(|(a, h)| (addr(*a), node(*h))).collect();
        config.claim_authorizer = Some(tether_core::driver::ClaimAuthorizer::new(
            move |request: &tether_core::driver::ClaimRequest| {
                allowed.contains(&(request.actor, request.host))
            },
        ));
    }
    let mut driver: Driver<u64> = Driver::new(config);
    let mut routes: Routes<u8> = Routes::new(tether_core::driver::NodeId([case.mailbox; 32]));
    // The shell routes through a memo; replay both ways and let any disagreement show.
    let mut memo = RouteMemo::new();
    let now = Time::ZERO;
    let mut steps = Vec::with_capacity(case.ops.len());
    for op in &case.ops {
        let mut step = routing_step();
        match op {
            RoutingOp::Know { tag } => {
                routes.know_tag(tag);
                memo.clear();
            }
            RoutingOp::Route { tag, to } => {
                routes.route_tag(tag, *to);
                memo.clear();
            }
            RoutingOp::Host { actor } => {
                routes.host(addr(*actor));
                memo.clear();
            }
            RoutingOp::Unhost { actor } => {
                routes.unhost(&addr(*actor));
                memo.clear();
            }
            RoutingOp::Claim {
                actor,
                host,
                generation,
                forged,
                from,
                handoff,
            } => {
                named.borrow_mut().insert(node(*host), *host);
                let mut claim = crate::driver::signed_claim(*host, *actor, *generation);
                if let Some(holder) = handoff {
                    claim = claim.with_handoff(tether_core::driver::Handoff::sign(
                        &[*holder; 32],
                        &claim.actor,
                        &claim.host,
                        claim.generation,
                    ));
                }
                let mut bytes = claim.encode();
                if *forged {
                    // The last byte of the host's signature: no longer the host's.
                    bytes[CLAIM_BYTES - 1] ^= 1;
                }
                let sender = node(from.unwrap_or(*host));
                step.claim = Some(
                    match driver.ask_claim(now, sender, &bytes) {
                        ClaimVerdict::Accepted => "accepted",
                        ClaimVerdict::Stale => "stale",
                        ClaimVerdict::Forged => "forged",
                        ClaimVerdict::Full => "full",
                        ClaimVerdict::Relayed => "relayed",
                        ClaimVerdict::Held => "held",
                        ClaimVerdict::Jump => "jump",
                        ClaimVerdict::Refused => "refused",
                    }
                    .to_owned(),
                );
            }
            RoutingOp::Inbound { dest, tag } => {
                let direct = routes.inbound(&addr(*dest), tag);
                let memoized = routes.inbound_memo(&mut memo, &addr(*dest), tag.as_bytes());
                step.inbound = Some(if direct != memoized {
                    format!("memo disagrees: {memoized:?} vs {direct:?}")
                } else {
                    match direct {
                        Inbound::Protocol(to) => format!("protocol:{to}"),
                        Inbound::Actor(actor) => format!("actor:{}", actor.0[0]),
                        // Only the driver's own tags go to the driver; the section's tags
                        // never name them.
                        Inbound::Driver => "driver".to_owned(),
                        Inbound::Drop(why) => {
                            driver.handle_inbound_drop(now, why);
                            format!("drop:{}", why.as_str())
                        }
                    }
                });
            }
            RoutingOp::EgressMailbox { peer } => {
                // The section is about where frames go, not dialing: every peer has a cached
                // actor connection (connected before its first frame).
                if driver.connection(&node(*peer), Channel::Actor).is_none() {
                    driver.ask_connected(now, node(*peer), Channel::Actor, u64::from(*peer));
                }
                step.egress = Some(match driver.ask_send(now, node(*peer)) {
                    SendVerdict::Enqueue => format!("peer:{peer}"),
                    SendVerdict::Dropped(why) => format!("drop:{}", why.as_str()),
                });
            }
            RoutingOp::EgressActor { actor } => {
                step.egress = Some(match driver.ask_send_to_actor(now, addr(*actor)) {
                    Ok(peer) => format!("peer:{}", number(peer)),
                    Err(why) => format!("drop:{}", why.as_str()),
                });
            }
            RoutingOp::WriteFailed { tag } => {
                let swim = routes.is_swim(tag);
                let first = Generation::new(1).ok_or("generation 1")?;
                driver.handle_write_failed(now, node(case.mailbox), first, 1, swim);
                step.send_failed = Some(false);
            }
        }
        // What the shell executes: a dial for a mailbox egress, the SWIM report of a failed
        // write.
        while let Some(action) = driver.poll_action() {
            if let Action::SendFailed { .. } = action {
                step.send_failed = Some(true);
            }
        }
        steps.push(step);
    }
    let drops = driver
        .drops()
        .0
        .iter()
        .map(|(why, n)| (why.as_str().to_owned(), *n))
        .collect();
    Ok(RoutingCase {
        steps,
        drops,
        ..case.clone()
    })
}

fn model_routing(case: &RoutingCase) -> Result<RoutingCase, String> {
    same_length(&case.ops, &case.steps)?;
    let mut model = model::RoutingModel::new(case.mailbox, case.allow.clone());
    model.authorize = case.authorize.clone();
    let steps = case
        .ops
        .iter()
        .map(|op| {
            let mut step = routing_step();
            match op {
                RoutingOp::Know { tag } => model.know(tag),
                RoutingOp::Route { tag, to } => model.route(tag, *to),
                RoutingOp::Host { actor } => model.host(*actor),
                RoutingOp::Unhost { actor } => model.unhost(*actor),
                RoutingOp::Claim {
                    actor,
                    host,
                    generation,
                    forged,
                    from,
                    handoff,
                } => {
                    step.claim = Some(model.claim(
                        *actor,
                        *host,
                        *generation,
                        *forged,
                        from.unwrap_or(*host),
                        *handoff,
                    ));
                }
                RoutingOp::Inbound { dest, tag } => step.inbound = Some(model.inbound(*dest, tag)),
                RoutingOp::EgressMailbox { peer } => {
                    step.egress = Some(model.egress_mailbox(*peer));
                }
                RoutingOp::EgressActor { actor } => step.egress = Some(model.egress_actor(*actor)),
                RoutingOp::WriteFailed { tag } => step.send_failed = Some(model.write_failed(tag)),
            }
            step
        })
        .collect();
    let mut drops = std::collections::BTreeMap::new();
    for (why, n) in &model.drops {
        let n = u64::try_from(*n).map_err(|_| "drop count past u64".to_owned())?;
        drops.insert((*why).to_owned(), n);
    }
    Ok(RoutingCase {
        steps,
        drops,
        ..case.clone()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn divergence_names_the_first_differing_key() {
        let case = json!({"window": 2, "ops": [{"op": "acquire", "n": 1}],
            "steps": [{"answer": "acquired", "available": 5, "closed": null}]});
        let failure = check_case("gate", &case, Engine::Core).unwrap_err();
        assert_eq!(failure.to_string(), "steps[0].available: expected 5, got 1");
    }

    #[test]
    fn missing_nullable_keys_and_extra_keys_are_malformed() {
        let missing = json!({"ours": 1, "theirs": 2});
        assert!(matches!(
            check_case("negotiate", &missing, Engine::Core),
            Err(Failure::Malformed(_))
        ));
        let extra = json!({"ours": 1, "theirs": 2, "window": 1, "note": "x"});
        assert!(matches!(
            check_case("negotiate", &extra, Engine::Core),
            Err(Failure::Malformed(_))
        ));
        let extra_unit = json!({"emitted": [{"kind": "end", "stream": "a"}], "violation": null,
            "at": null, "stream": null, "expected": null, "got": null});
        assert!(matches!(
            check_case("emission", &extra_unit, Engine::Core),
            Err(Failure::Malformed(_))
        ));
        let hold_false = json!({"limit": 1, "arrivals": [1], "steps": [{"hold": false}]});
        assert!(matches!(
            check_case("reorder", &hold_false, Engine::Core),
            Err(Failure::Malformed(_))
        ));
    }

    #[test]
    fn unknown_sections_are_named() {
        let error = check_case("gates", &json!({}), Engine::Core).unwrap_err();
        assert!(error.to_string().contains("unknown section \"gates\""));
    }

    #[test]
    fn integers_are_exact_at_the_top_of_u64() {
        let case = json!({"window": 1, "ops": [{"op": "grant", "n": 18446744073709551615u64}],
            "steps": [{"answer": null, "available": 18446744073709551615u64, "closed": null}]});
        assert_eq!(check_case("gate", &case, Engine::Core), Ok(()));
        assert_eq!(check_case("gate", &case, Engine::Model), Ok(()));
    }
}
