//! Model checking: every op sequence up to a bound, run on the model and on core in lockstep.
//!
//! At every step the two must make the same observation, and the laws of docs/conformance/README.md
//! must hold on both: register once, terminate once, zero state after termination, disposition =
//! route while live / straggler while in the ring / no_route after eviction; a gate never holds
//! more than it was given; a window never grants more than was consumed; a reorder buffer delivers
//! each seq exactly once and in order; a writer numbers flow frames without gaps and writes at most
//! one terminal, last. Distinct model states are counted.

use std::collections::HashSet;
use std::hash::Hash;
use std::num::NonZeroUsize;

use tether_core::request::{
    self as core_request, Acquire, CreditGate, Credits, Disposition, ReceiveWindow, ReorderBuffer,
    RequestKey, RequestTable, RequestTableConfig, Seq, TerminationKind, WriteGate, Written,
};
use tether_core::time::Time;
use tether_core::wire::bifaci::{FrameType, MessageId};

use crate::model;

/// What one exploration covered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The machine.
    pub machine: &'static str,
    /// The bound, in words.
    pub bound: String,
    /// Op sequences run (every prefix counts once).
    pub sequences: u64,
    /// Distinct model states reached.
    pub states: usize,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} sequences, {} distinct states ({})",
            self.machine, self.sequences, self.states, self.bound
        )
    }
}

/// Bounds of a full exploration.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Longest table op sequence.
    pub table_ops: usize,
    /// Longest gate and window op sequence.
    pub credit_ops: usize,
    /// Longest reorder arrival sequence.
    pub reorder_ops: usize,
    /// Longest writer frame sequence.
    pub writer_ops: usize,
}

impl Bounds {
    /// The bounds the issue asks for (run in release: about 10^7 sequences).
    pub const FULL: Bounds = Bounds {
        table_ops: 6,
        credit_ops: 8,
        reorder_ops: 7,
        writer_ops: 5,
    };
    /// Small bounds for the unit tests.
    pub const QUICK: Bounds = Bounds {
        table_ops: 4,
        credit_ops: 5,
        reorder_ops: 5,
        writer_ops: 3,
    };
}

/// Runs every exploration within `bounds`.
pub fn explore_all(bounds: Bounds) -> Result<Vec<Report>, String> {
    Ok(vec![
        explore_table(bounds.table_ops)?,
        explore_gate(bounds.credit_ops)?,
        explore_window(bounds.credit_ops)?,
        explore_reorder(bounds.reorder_ops)?,
        explore_writer(bounds.writer_ops)?,
    ])
}

/// A depth-first walk over every sequence of `ops` up to `depth`, carrying a state. `step`
/// applies one op to a copy of the state (checking laws) or reports a violation.
struct Walk<S, O> {
    ops: Vec<O>,
    depth: usize,
    sequences: u64,
    states: HashSet<S>,
}

impl<S: Clone + Eq + Hash, O: std::fmt::Debug> Walk<S, O> {
    fn new(ops: Vec<O>, depth: usize) -> Self {
        Self {
            ops,
            depth,
            sequences: 0,
            states: HashSet::new(),
        }
    }

    /// Walks from `start`, the model state and core's state side by side.
    fn run<C: Clone>(
        &mut self,
        start: (S, C),
        step: &impl Fn(&mut S, &mut C, &O) -> Result<(), String>,
    ) -> Result<(), String> {
        let mut trail = Vec::new();
        self.visit(start, step, &mut trail)
    }

    fn visit<C: Clone>(
        &mut self,
        (model, core): (S, C),
        step: &impl Fn(&mut S, &mut C, &O) -> Result<(), String>,
        trail: &mut Vec<usize>,
    ) -> Result<(), String> {
        self.sequences += 1;
        self.states.insert(model.clone());
        if trail.len() == self.depth {
            return Ok(());
        }
        for index in 0..self.ops.len() {
            let (mut next_model, mut next_core) = (model.clone(), core.clone());
            trail.push(index);
            if let Err(why) = step(&mut next_model, &mut next_core, &self.ops[index]) {
                let ops: Vec<&O> = trail.iter().map(|i| &self.ops[*i]).collect();
                return Err(format!("{why} after {ops:?}"));
            }
            self.visit((next_model, next_core), step, trail)?;
            trail.pop();
        }
        Ok(())
    }
}

fn check(condition: bool, law: &str) -> Result<(), String> {
    if condition {
        Ok(())
    } else {
        Err(format!("law broken: {law}"))
    }
}

/// All table op sequences of length ≤ `depth` over 2 xids and 3 rids, rings of 1–3.
pub fn explore_table(depth: usize) -> Result<Report, String> {
    let ops = table_ops();
    let mut sequences = 0;
    let mut states = 0;
    for keep in 1..=3usize {
        let mut walk = Walk::new(ops.clone(), depth);
        let config = RequestTableConfig {
            ring_capacity: NonZeroUsize::new(keep).expect("keep starts at 1"),
            ..RequestTableConfig::default()
        };
        let start = (
            model::Table::empty(keep as u64),
            RequestTable::<()>::new(config),
        );
        walk.run(start, &table_step)?;
        sequences += walk.sequences;
        states += walk.states.len();
    }
    Ok(Report {
        machine: "table",
        bound: format!("ops ≤ {depth}, keep 1–3"),
        sequences,
        states,
    })
}

/// The 12 table ops: register or terminate, over 2 xids and 3 rids.
fn table_ops() -> Vec<TableOp> {
    let mut ops = Vec::new();
    for register in [true, false] {
        for xid in ["x1", "x2"] {
            for rid in ["r1", "r2", "r3"] {
                ops.push((register, xid, rid));
            }
        }
    }
    ops
}

/// (register?, xid, rid).
type TableOp = (bool, &'static str, &'static str);

fn table_step(
    model: &mut model::Table,
    core: &mut RequestTable<()>,
    &(register, xid, rid): &TableOp,
) -> Result<(), String> {
    let key = RequestKey {
        xid: id_of(xid),
        rid: id_of(rid),
    };
    let was_live = model.is_live(rid);
    let exact_live = model.live.iter().any(|(x, r)| x == xid && r == rid);
    let registered_before = model.registered;
    let (model_ok, core_ok) = if register {
        let core_ok = core.register(key, (), Credits::new(1), Time::ZERO).is_ok();
        (model.register(xid, rid), core_ok)
    } else {
        let core_ok = core
            .terminate(key, TerminationKind::End, Time::ZERO)
            .is_some();
        (model.terminate(xid, rid), core_ok)
    };
    check(model_ok == core_ok, "core and model agree on ok")?;
    if register {
        check(
            model_ok != was_live,
            "register succeeds iff the rid is not live (once)",
        )?;
        check(
            model.registered == registered_before + u64::from(model_ok),
            "registered counts",
        )?;
    } else {
        check(
            model_ok == exact_live,
            "terminate succeeds iff the exact key is live (once)",
        )?;
        if model_ok {
            let gone = core.get(key).is_none() && core.key_of(key.rid).is_none();
            check(gone, "no state remains after termination")?;
            check(
                model.ring.last().map(String::as_str) == Some(rid),
                "the ending enters the ring",
            )?;
        }
    }
    check(core.live_len() == model.live.len(), "live counts agree")?;
    check(
        core.counters().registered == model.registered,
        "registered counts agree",
    )?;
    check(
        core.ring().count() as u64 <= model.keep,
        "the ring is bounded by keep",
    )?;
    for rid in ["r1", "r2", "r3"] {
        let live = model.is_live(rid);
        let in_ring = model.ring.iter().any(|ended| ended == rid);
        let expected = match (live, in_ring) {
            (true, _) => "route",
            (false, true) => "straggler",
            (false, false) => "no_route",
        };
        check(
            model.disposition(rid) == expected,
            "disposition law (model)",
        )?;
        let core_disposition = match core.disposition(id_of(rid)) {
            Disposition::Route => "route",
            Disposition::Straggler => "straggler",
            Disposition::NoRoute => "no_route",
        };
        check(core_disposition == expected, "disposition law (core)")?;
    }
    Ok(())
}

fn id_of(name: &str) -> MessageId {
    MessageId::Uint(match name {
        "x1" => 1,
        "x2" => 2,
        "r1" => 101,
        "r2" => 102,
        _ => 103,
    })
}

/// Gate model state plus the total ever granted (for the "never holds more than given" law).
type GateState = (model::Gate, u128, u128);

/// All gate op sequences of length ≤ `depth` for windows 0–4.
pub fn explore_gate(depth: usize) -> Result<Report, String> {
    let ops = vec![
        model::GateOp::Acquire(0),
        model::GateOp::Acquire(1),
        model::GateOp::Acquire(2),
        model::GateOp::Grant(1),
        model::GateOp::Grant(u64::MAX),
        model::GateOp::Close("a".into()),
    ];
    let mut sequences = 0;
    let mut states = 0;
    for window in 0..=4u64 {
        let mut walk = Walk::new(ops.clone(), depth);
        let start: (GateState, CreditGate) = (
            (model::Gate::opened(window), u128::from(window), 0),
            CreditGate::new(Credits::new(window)),
        );
        walk.run(start, &gate_step)?;
        sequences += walk.sequences;
        states += walk.states.len();
    }
    Ok(Report {
        machine: "gate",
        bound: format!("ops ≤ {depth}, windows 0–4"),
        sequences,
        states,
    })
}

fn gate_step(
    (model, given, taken): &mut GateState,
    core: &mut CreditGate,
    op: &model::GateOp,
) -> Result<(), String> {
    let was_closed = model.closed.is_some();
    let answer = model.apply(op);
    let core_answer = match op {
        model::GateOp::Acquire(n) => Some(match core.acquire(Credits::new(*n)) {
            Acquire::Acquired => "acquired".to_owned(),
            Acquire::Wait => "wait".to_owned(),
            Acquire::Closed(reason) => format!("closed:{reason}"),
        }),
        model::GateOp::Grant(n) => {
            core.grant(Credits::new(*n));
            None
        }
        model::GateOp::Close(reason) => {
            core.close(reason);
            None
        }
    };
    check(answer == core_answer, "core and model agree on the answer")?;
    check(
        u128::from(core.available().get()) == model.available,
        "available agrees",
    )?;
    check(
        core.closed_reason() == model.closed.as_deref(),
        "close reason agrees",
    )?;
    match op {
        model::GateOp::Acquire(n) if answer.as_deref() == Some("acquired") => {
            check(!was_closed, "a closed gate never hands out credit")?;
            *taken += u128::from(*n);
        }
        model::GateOp::Grant(n) if !was_closed => *given += u128::from(*n),
        _ => {}
    }
    check(
        model.available <= *given - *taken,
        "a gate never holds more than it was given",
    )?;
    Ok(())
}

/// Window model state plus totals: accepted arrivals, consumes, continuation grants, grants.
type WindowState = (model::Window, [u128; 4]);

/// All window op sequences of length ≤ `depth` for windows 0–4.
pub fn explore_window(depth: usize) -> Result<Report, String> {
    let ops = WINDOW_OPS.to_vec();
    let mut sequences = 0;
    let mut states = 0;
    for window in 0..=4u64 {
        let mut walk = Walk::new(ops.clone(), depth);
        let start: (WindowState, (u64, ReceiveWindow)) = (
            (model::Window::opened(window), [0; 4]),
            (window, ReceiveWindow::new(Credits::new(window))),
        );
        walk.run(start, &window_step)?;
        sequences += walk.sequences;
        states += walk.states.len();
    }
    Ok(Report {
        machine: "window",
        bound: format!("ops ≤ {depth}, windows 0–4"),
        sequences,
        states,
    })
}

const WINDOW_OPS: [model::WindowOp; 4] = [
    model::WindowOp::Arrive,
    model::WindowOp::Continuation,
    model::WindowOp::Consume,
    model::WindowOp::Flush,
];

fn window_step(
    (model, totals): &mut WindowState,
    (window, core): &mut (u64, ReceiveWindow),
    op: &model::WindowOp,
) -> Result<(), String> {
    let (violation, grant) = model.apply(*op);
    let step = match op {
        model::WindowOp::Arrive => core.arrive(),
        model::WindowOp::Continuation => core.continuation(),
        model::WindowOp::Consume => core.consume(),
        model::WindowOp::Flush => core.flush(),
    };
    check(
        step.violation == violation && u128::from(step.grant.get()) == grant,
        "step agrees",
    )?;
    check(
        u128::from(core.remaining().get()) == model.remaining,
        "remaining agrees",
    )?;
    check(
        u128::from(core.pending().get()) == model.pending,
        "pending agrees",
    )?;
    let [arrived, consumed, continued, granted] = totals;
    if !violation {
        match op {
            model::WindowOp::Arrive => *arrived += 1,
            model::WindowOp::Continuation => {
                *arrived += 1;
                *continued += 1;
            }
            model::WindowOp::Consume => *consumed += 1,
            model::WindowOp::Flush => {}
        }
    }
    *granted += grant;
    check(
        *granted + model.pending == *consumed + *continued,
        "never over-granted",
    )?;
    check(
        model.remaining + *arrived == u128::from(*window) + *granted,
        "remaining = window − arrivals + grants",
    )?;
    if violation {
        let arrival = matches!(op, model::WindowOp::Arrive | model::WindowOp::Continuation);
        check(
            arrival && model.remaining == 0 && grant == 0,
            "violations only on a full window",
        )?;
    }
    Ok(())
}

/// Reorder model state plus everything delivered so far.
type ReorderState = (model::Reorder, Vec<u64>);

/// All arrival sequences over seqs 0–4 of length ≤ `depth`, limits 0–3.
pub fn explore_reorder(depth: usize) -> Result<Report, String> {
    let ops: Vec<u64> = (0..5).collect();
    let mut sequences = 0;
    let mut states = 0;
    for limit in 0..=3u64 {
        let mut walk = Walk::new(ops.clone(), depth);
        let start: (ReorderState, ReorderBuffer<u64>) = (
            (model::Reorder::start(limit), Vec::new()),
            ReorderBuffer::new(limit),
        );
        walk.run(start, &reorder_step)?;
        sequences += walk.sequences;
        states += walk.states.len();
    }
    Ok(Report {
        machine: "reorder",
        bound: format!("arrivals ≤ {depth}, seqs 0–4, limits 0–3"),
        sequences,
        states,
    })
}

fn reorder_step(
    (model, delivered): &mut ReorderState,
    core: &mut ReorderBuffer<u64>,
    seq: &u64,
) -> Result<(), String> {
    let step = model.accept(*seq);
    let mut core_delivered = Vec::new();
    let accepted = core.accept(Seq(*seq), *seq, |_, item| core_delivered.push(item));
    let agrees = match (&step, &accepted) {
        (model::ReorderStep::Deliver(seqs), Ok(_)) => *seqs == core_delivered,
        (model::ReorderStep::Hold, Ok(core_request::Accepted::Held)) => true,
        (model::ReorderStep::Error(kind), Err(refusal)) => {
            *kind == format!("{:?}", refusal.kind).to_lowercase()
        }
        _ => false,
    };
    check(agrees, "core and model agree on the step")?;
    if let model::ReorderStep::Deliver(seqs) = step {
        delivered.extend(seqs);
    }
    let in_order: Vec<u64> = (0..delivered.len() as u64).collect();
    check(
        *delivered == in_order,
        "each seq delivered exactly once, in order",
    )?;
    check(
        model.expected == delivered.len() as u128,
        "expected is one past the last delivery",
    )?;
    check(
        model
            .held
            .iter()
            .all(|held| u128::from(*held) > model.expected),
        "held seqs are early",
    )?;
    check(
        model.held.len() as u64 <= model.limit,
        "the buffer holds at most its limit",
    )?;
    check(core.held_len() == model.held.len(), "held counts agree")?;
    Ok(())
}

/// Writer model state: (ended, next seq), derived from the model's output for the frames so far.
type WriterState = (bool, u64);

/// All frame sequences over the 14 known types of length ≤ `depth`.
pub fn explore_writer(depth: usize) -> Result<Report, String> {
    let ops: Vec<u8> = model::FRAME_TYPES.iter().map(|row| row.code).collect();
    let mut walk = Walk::new(ops, depth);
    walk.run(((false, 0), (WriteGate::new(), Vec::new())), &writer_step)?;
    Ok(Report {
        machine: "writer",
        bound: format!("frames ≤ {depth}, 14 types"),
        sequences: walk.sequences,
        states: walk.states.len(),
    })
}

fn writer_step(
    state: &mut WriterState,
    (core, frames): &mut (WriteGate, Vec<u8>),
    code: &u8,
) -> Result<(), String> {
    frames.push(*code);
    let model_out = model::writer(frames);
    let (written, seq) = *model_out.last().expect("one frame was just added");
    let frame_type = FrameType::from_code(u64::from(*code)).expect("explored codes are known");
    let core_out = match core.write(frame_type) {
        Written::Sent { seq, .. } => (true, Some(seq.0)),
        Written::Suppressed => (false, None),
    };
    check(
        core_out == (written, seq),
        "core and model agree on the frame",
    )?;
    let row = |code: &u8| model::frame_type(*code).expect("explored codes are known");
    let written_flow: Vec<(u8, u64)> = frames
        .iter()
        .zip(&model_out)
        .filter(|(code, (written, _))| *written && row(code).flow)
        .map(|(code, (_, seq))| (*code, seq.expect("written frames carry a seq")))
        .collect();
    let seqs: Vec<u64> = written_flow.iter().map(|(_, seq)| *seq).collect();
    check(
        seqs == (0..seqs.len() as u64).collect::<Vec<_>>(),
        "flow seqs have no gap",
    )?;
    let terminals: Vec<usize> = written_flow
        .iter()
        .enumerate()
        .filter(|(_, (code, _))| row(code).terminal)
        .map(|(at, _)| at)
        .collect();
    check(terminals.len() <= 1, "at most one terminal is written")?;
    check(
        terminals.iter().all(|at| at + 1 == written_flow.len()),
        "the terminal is the last flow frame",
    )?;
    check(
        core.is_ended() != terminals.is_empty(),
        "core's ended flag agrees",
    )?;
    *state = (!terminals.is_empty(), written_flow.len() as u64);
    Ok(())
}

/// The request table, core and model in lockstep with every law checked after each op; the
/// stateful fuzz target drives it with arbitrary op bytes.
pub struct TableLockstep {
    ops: Vec<TableOp>,
    model: model::Table,
    core: RequestTable<()>,
}

impl TableLockstep {
    /// An empty table remembering `keep` (≥ 1) endings.
    pub fn new(keep: NonZeroUsize) -> Self {
        let config = RequestTableConfig {
            ring_capacity: keep,
            ..RequestTableConfig::default()
        };
        Self {
            ops: table_ops(),
            model: model::Table::empty(keep.get() as u64),
            core: RequestTable::new(config),
        }
    }

    /// Applies op `op % 12` to both; an error names the broken law.
    pub fn apply(&mut self, op: u8) -> Result<(), String> {
        let op = self.ops[usize::from(op) % self.ops.len()];
        table_step(&mut self.model, &mut self.core, &op)
    }
}

/// The receive window, core and model in lockstep with the grant laws checked after each op.
pub struct WindowLockstep {
    model: WindowState,
    core: (u64, ReceiveWindow),
}

impl WindowLockstep {
    /// A window of `window` chunks (kept below 2^32 so no counter saturates and the
    /// conservation laws stay exact).
    pub fn new(window: u32) -> Self {
        let window = u64::from(window);
        Self {
            model: (model::Window::opened(window), [0; 4]),
            core: (window, ReceiveWindow::new(Credits::new(window))),
        }
    }

    /// Applies op `op % 4` (arrive, continuation, consume, flush) to both.
    pub fn apply(&mut self, op: u8) -> Result<(), String> {
        let op = WINDOW_OPS[usize::from(op) % WINDOW_OPS.len()];
        window_step(&mut self.model, &mut self.core, &op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laws_hold_within_the_quick_bounds() {
        let reports = explore_all(Bounds::QUICK).unwrap();
        assert_eq!(reports.len(), 5);
        for report in reports {
            assert!(report.sequences > 100, "{report}");
            assert!(report.states > 3, "{report}");
        }
    }
}
