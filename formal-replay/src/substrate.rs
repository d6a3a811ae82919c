//! The substrate against an independent model of what it promises, over every action sequence
//! within a small scope and over long random ones.
//!
//! The world is two core machines in core's in-memory harness (real codec on the wire). An
//! action is one thing the environment does: the app of A sends, a store commits its oldest
//! batch, the link delivers any frame in flight (so it reorders) or all of them as one read,
//! delivers one and keeps a copy (so it duplicates), loses one, the link drops and comes back,
//! a node crashes (losing everything uncommitted), 31 s pass, a stray op for an unknown object
//! arrives, or B's app closes the queue.
//!
//! The model is [`Promises`]: written from the guarantees of docs/spec/substrate.md alone, it knows
//! nothing of outboxes, windows or frontiers. After every action it judges what the apps observed:
//!
//! - exactly once, in order: per object, what B's app consumed is an in-order subsequence of
//!   what A's app asked for (its sends and reqs, in the order asked), each op once, never one
//!   A was told is futile; of those A never committed (a crash lost them), B may only have
//!   consumed sends, which may travel while their commit runs;
//! - every op has at most one outcome (acked and futile never both);
//! - every op A was told is hop-acked is durable at B (held, in the inbox or consumed);
//! - one bounce per stray op id;
//! - nothing is lost unless it got a terminal outcome: from every reached state, healing the
//!   link and letting everything settle ends with every promised op (committed by A) either
//!   consumed at B or reported futile at A (exactly one of the two), every op A never
//!   committed with at most one of them, every consumed req answered once, and A's outbox
//!   empty.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::{BuildHasher, Hash, Hasher};
use std::time::Duration;

use bytes::Bytes;
use tether_core::substrate::harness::{Harness, Party};
use tether_core::substrate::{Config, Event, Op};
use tether_core::wire::envelope::{Address, Env, Envelope, ObjKind, Verb};

/// The objects A uses: a queue (sends) and a session (reqs, answered by B's app).
const OBJECTS: [(&str, ObjKind); 2] = [("q0", ObjKind::Queue), ("s1", ObjKind::Session)];

/// One thing the environment does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// A's app sends on the queue (`0`) or makes a req on the session (`1`).
    Send(u8),
    /// B's app answers its oldest unanswered req with `end` (which consumes it).
    Answer,
    /// A node's store commits its oldest batch.
    Commit(Party),
    /// The link delivers frame `n` of those towards a node.
    Deliver(Party, u8),
    /// The link delivers every frame in flight towards a node, in order, as one read (one
    /// step of its machine).
    DeliverAll(Party),
    /// The link delivers frame `n` towards a node and keeps a copy in flight.
    Duplicate(Party, u8),
    /// The link loses frame `n` towards a node.
    Drop(Party, u8),
    /// The link goes down and comes back (a new connection).
    Reconnect,
    /// A node crashes and restarts from its store.
    Crash(Party),
    /// 31 s pass (gap resync, keepalive).
    Wait,
    /// A stray send for an unknown object reaches B (always the same op id).
    Stray,
    /// B's app closes the queue: A's ops still un-acked end futile.
    Close,
}

/// How much of each fault a trace may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Scope {
    /// Ops in flight per object.
    pub window: usize,
    /// Sends in total.
    pub sends: u8,
    /// Reconnects.
    pub reconnects: u8,
    /// Crashes per node.
    pub crashes: u8,
    /// Duplications.
    pub duplicates: u8,
    /// Waits.
    pub waits: u8,
    /// Stray ops.
    pub strays: u8,
    /// Closes of the queue by B.
    pub closes: u8,
    /// Longest trace.
    pub depth: usize,
}

impl Scope {
    /// The scope CI checks (run in release), for windows 1 and 2.
    pub const FULL: [Scope; 2] = [
        Self::FULL_WINDOW_1,
        Scope {
            window: 2,
            ..Self::FULL_WINDOW_1
        },
    ];
    const FULL_WINDOW_1: Scope = Scope {
        window: 1,
        sends: 3,
        reconnects: 2,
        crashes: 1,
        duplicates: 1,
        waits: 1,
        strays: 2,
        closes: 1,
        depth: 8,
    };
    /// A small scope for unit tests.
    pub const QUICK: Scope = Scope {
        window: 2,
        sends: 2,
        reconnects: 1,
        crashes: 1,
        duplicates: 1,
        waits: 0,
        strays: 1,
        closes: 1,
        depth: 6,
    };
}

/// Budget left in a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Budget {
    sends: u8,
    reconnects: u8,
    crashes: [u8; 2],
    duplicates: u8,
    waits: u8,
    strays: u8,
    closes: u8,
}

/// The independent model: what the apps may observe, judged from the guarantees of
/// docs/spec/substrate.md.
#[derive(Debug, Default)]
pub struct Promises;

impl Promises {
    /// Judges one world. `Err` names the guarantee broken.
    pub fn judge(h: &Harness) -> Result<(), String> {
        let is_message = |op: &&Op| matches!(op.verb, Verb::Send | Verb::Req);
        let futile: BTreeSet<&str> =
            h.a.events
                .iter()
                .filter_map(|e| match e {
                    Event::Futile { op_id, .. } => Some(op_id.as_str()),
                    _ => None,
                })
                .collect();
        let committed = committed_by_a(h);
        for (obj, _) in OBJECTS {
            let asked: Vec<&Op> =
                h.a.made
                    .iter()
                    .filter(|op| op.obj == obj && is_message(op))
                    .collect();
            let promised: Vec<&str> = asked.iter().map(|op| op.id.as_str()).collect();
            let consumed: Vec<&str> =
                h.b.consumed
                    .iter()
                    .filter(|op| op.obj == obj)
                    .map(|op| op.id.as_str())
                    .collect();
            // Exactly once, in order: what B consumed is an in-order subsequence of what A
            // promised, never including an op A was told is futile.
            let mut rest = promised.iter();
            for id in &consumed {
                if futile.contains(id) {
                    return Err(format!("{id} was consumed at B but reported futile at A"));
                }
                if !rest.any(|promised| promised == id) {
                    return Err(format!(
                        "exactly once in order broken on {obj}: asked {promised:?}, consumed {consumed:?}"
                    ));
                }
                let early = asked.iter().any(|op| op.id == *id && op.verb != Verb::Send);
                if early && !committed.contains(id) {
                    return Err(format!("{id} was consumed at B, but A never committed it"));
                }
            }
        }
        let durable: BTreeSet<&str> =
            h.b.store
                .inbox
                .values()
                .chain(h.b.store.held.values())
                .chain(&h.b.consumed)
                .map(|op| op.id.as_str())
                .collect();
        let messages: BTreeSet<&str> =
            h.a.made
                .iter()
                .filter(is_message)
                .map(|op| op.id.as_str())
                .collect();
        for event in &h.a.events {
            if let Event::Acked { op_id, .. } = event {
                // A close by B's app may discard what B held but had not delivered yet.
                let discardable = closed_by_b(h, &obj_of(h, op_id));
                if messages.contains(op_id.as_str())
                    && !durable.contains(op_id.as_str())
                    && !discardable
                {
                    return Err(format!("{op_id} was hop-acked but is not durable at B"));
                }
                if futile.contains(op_id.as_str()) {
                    return Err(format!("{op_id} has two outcomes: acked and futile"));
                }
            }
        }
        // Answers: each req answered at most once, in the order the reqs were made.
        let reqs: Vec<&str> =
            h.a.made
                .iter()
                .filter(|op| op.verb == Verb::Req)
                .map(|op| op.id.as_str())
                .collect();
        let answered: Vec<&str> =
            h.a.events
                .iter()
                .filter_map(|e| match e {
                    Event::Answered { req_id, .. } => Some(req_id.as_str()),
                    _ => None,
                })
                .collect();
        let mut rest = reqs.iter();
        if !answered.iter().all(|id| rest.any(|req| req == id)) {
            return Err(format!(
                "answers repeated or out of order: reqs {reqs:?}, answered {answered:?}"
            ));
        }
        if h.b.machine.stats().bounces > 1 {
            return Err("more than one bounce for one op id".into());
        }
        Ok(())
    }

    /// Judges the world once the link heals, B's app answers every req it holds and everything
    /// settles: nothing promised is lost and every req is answered once.
    pub fn judge_healed(h: &Harness) -> Result<(), String> {
        let mut healed = h.clone();
        healed.connect();
        healed.run();
        while apply(&mut healed, Action::Answer) {
            healed.run();
        }
        Self::judge(&healed)?;
        let futile: BTreeSet<&str> = healed
            .a
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Futile { op_id, .. } => Some(op_id.as_str()),
                _ => None,
            })
            .collect();
        let consumed: BTreeSet<&str> = healed.b.consumed.iter().map(|op| op.id.as_str()).collect();
        let answered = healed
            .a
            .events
            .iter()
            .filter(|e| matches!(e, Event::Answered { .. }))
            .count();
        let committed = committed_by_a(&healed);
        let mut answered_reqs = 0;
        for op in healed
            .a
            .made
            .iter()
            .filter(|op| matches!(op.verb, Verb::Send | Verb::Req))
        {
            // Outcomes: consumed at B, futile at A, or acked and then discarded by B's close.
            let acked = healed
                .a
                .events
                .iter()
                .any(|e| matches!(e, Event::Acked { op_id, .. } if *op_id == op.id));
            let discarded =
                acked && !consumed.contains(op.id.as_str()) && closed_by_b(&healed, &op.obj);
            let outcomes = usize::from(consumed.contains(op.id.as_str()))
                + usize::from(futile.contains(op.id.as_str()))
                + usize::from(discarded);
            // An op A never committed (a crash lost it) may have reached B before the crash,
            // or not: at most one outcome.
            let expected = if committed.contains(op.id.as_str()) {
                1..=1
            } else {
                0..=1
            };
            if !expected.contains(&outcomes) {
                return Err(format!(
                    "after healing, op {} has {outcomes} outcomes",
                    op.id
                ));
            }
            answered_reqs += usize::from(op.verb == Verb::Req && consumed.contains(op.id.as_str()));
        }
        if answered != answered_reqs || healed.a.machine.outbox_len() != 0 {
            return Err(format!(
                "after healing: {answered} answers for {answered_reqs} answered reqs, {} un-acked",
                healed.a.machine.outbox_len()
            ));
        }
        Ok(())
    }
}

/// Whether B's app closed `obj` (the close is in B's machine or its store).
fn closed_by_b(h: &Harness, obj: &str) -> bool {
    let closing = |op: &Op| op.obj == obj && op.verb == Verb::Close;
    h.b.enqueued.iter().any(closing)
        || matches!(
            h.b.machine.object_state(obj),
            Some(tether_core::substrate::ObjectState::Closed(_))
        )
}

/// The ids of A's ops whose enqueue A committed.
fn committed_by_a(h: &Harness) -> BTreeSet<&str> {
    h.a.enqueued.iter().map(|op| op.id.as_str()).collect()
}

/// The object of A's op `id`.
fn obj_of(h: &Harness, id: &str) -> String {
    h.a.made
        .iter()
        .find(|op| op.id == id)
        .map(|op| op.obj.to_string())
        .unwrap_or_default()
}

/// A world with both objects open and accepted, link up.
pub fn start(window: usize) -> Harness {
    // The smallest seq reservation: renewals are pending often, and a send past the
    // committed one waits for its commit.
    let config = Config {
        in_flight_max: window,
        seq_reserve: 2,
        ..Config::default()
    };
    let mut h = Harness::allowing_all(config, 5);
    h.connect();
    for (obj, kind) in OBJECTS {
        h.with(Party::A, |m, now| m.open(now, kind, obj, None))
            .expect("fresh objects open");
    }
    h.run();
    h
}

/// Applies `action` if it is possible; false (nothing changed) otherwise.
pub fn apply(h: &mut Harness, action: Action) -> bool {
    match action {
        Action::Send(n) => {
            let (obj, kind) = OBJECTS[usize::from(n) % OBJECTS.len()];
            let body = Bytes::from(vec![obj.as_bytes()[1]; 4]);
            match kind {
                ObjKind::Queue => h.with(Party::A, |m, now| m.send(now, obj, body)).is_ok(),
                ObjKind::Session => h.with(Party::A, |m, now| m.req(now, obj, body)).is_ok(),
            }
        }
        Action::Answer => {
            let oldest =
                h.b.machine
                    .pending_deliveries()
                    .into_iter()
                    .find(|op| op.verb == Verb::Req)
                    .map(|op| (op.obj.clone(), op.id.clone()));
            let Some((obj, id)) = oldest else {
                return false;
            };
            let body = Some(Bytes::from_static(b"done"));
            h.with(Party::B, |m, now| {
                m.answer(now, &obj, &id, Verb::End, body, None)
            })
            .is_ok()
        }
        Action::Commit(id) => h.commit(id),
        Action::Deliver(to, n) => h.deliver_at(to, usize::from(n), false),
        Action::DeliverAll(to) => h.deliver_all(to),
        Action::Duplicate(to, n) => h.deliver_at(to, usize::from(n), true),
        Action::Drop(to, n) => h.drop_at(to, usize::from(n)),
        Action::Reconnect => {
            h.disconnect();
            h.connect();
            true
        }
        Action::Crash(id) => {
            h.crash(id);
            true
        }
        Action::Wait => {
            h.advance(Duration::from_secs(31));
            true
        }
        Action::Close => {
            let (queue, _) = OBJECTS[0];
            h.with(Party::B, |m, now| m.close(now, queue, "done"))
                .is_ok()
        }
        Action::Stray => {
            let mut env = Env::new(Verb::Send);
            env.obj = Some(Address::parse("stray").expect("valid"));
            env.id = Some("stray-op".into());
            env.seq = Some(0);
            env.receipt = Some(1);
            h.inject(Party::A, &Envelope::new(env));
            true
        }
    }
}

/// The actions worth trying in `h` within `budget`.
fn enabled(h: &Harness, budget: &Budget) -> Vec<Action> {
    let mut actions = Vec::new();
    if budget.sends > 0 {
        actions.extend([Action::Send(0), Action::Send(1)]);
    }
    if h.b
        .machine
        .pending_deliveries()
        .iter()
        .any(|op| op.verb == Verb::Req)
    {
        actions.push(Action::Answer);
    }
    for id in [Party::A, Party::B] {
        if h.uncommitted(id) > 0 {
            actions.push(Action::Commit(id));
        }
        let frames = h.in_flight(id).min(3) as u8;
        if frames > 1 {
            // With one frame in flight it is `Deliver(id, 0)`.
            actions.push(Action::DeliverAll(id));
        }
        for n in 0..frames {
            actions.push(Action::Deliver(id, n));
            actions.push(Action::Drop(id, n));
            if budget.duplicates > 0 {
                actions.push(Action::Duplicate(id, n));
            }
        }
        if budget.crashes[id as usize] > 0 {
            actions.push(Action::Crash(id));
        }
    }
    if budget.reconnects > 0 {
        actions.push(Action::Reconnect);
    }
    if budget.waits > 0 {
        actions.push(Action::Wait);
    }
    if budget.strays > 0 {
        actions.push(Action::Stray);
    }
    if budget.closes > 0 {
        actions.push(Action::Close);
    }
    actions
}

fn spend(budget: &mut Budget, action: Action) {
    match action {
        Action::Send(_) => budget.sends -= 1,
        Action::Duplicate(..) => budget.duplicates -= 1,
        Action::Reconnect => budget.reconnects -= 1,
        Action::Crash(id) => budget.crashes[id as usize] -= 1,
        Action::Wait => budget.waits -= 1,
        Action::Stray => budget.strays -= 1,
        Action::Close => budget.closes -= 1,
        Action::Commit(_)
        | Action::Deliver(..)
        | Action::DeliverAll(_)
        | Action::Drop(..)
        | Action::Answer => {}
    }
}

/// What an exploration covered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubstrateReport {
    /// The scope.
    pub scope: Scope,
    /// Distinct worlds reached (machine states, stores, wire, budgets).
    pub states: usize,
    /// Transitions taken.
    pub transitions: u64,
}

impl std::fmt::Display for SubstrateReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.scope;
        write!(
            f,
            "substrate: {} distinct states, {} transitions (window {}, {} sends over a queue and a session, \
             {} reconnects, {} crash per side, {} duplicate, {} wait, {} strays, {} close, depth {})",
            self.states,
            self.transitions,
            s.window,
            s.sends,
            s.reconnects,
            s.crashes,
            s.duplicates,
            s.waits,
            s.strays,
            s.closes,
            s.depth
        )
    }
}

/// Depth-first over every action sequence within `scope`, deduplicating worlds by a 64-bit
/// hash of their full fingerprint and the budget left (a world reached again with the same
/// budget at the same or a greater depth is not explored again); every distinct world is
/// judged by [`Promises`], healed or not, once (the judgment reads the world alone, not the
/// budget). `Err` carries the first broken guarantee with the trace that broke it.
pub fn explore(scope: Scope) -> Result<SubstrateReport, String> {
    let budget = Budget {
        sends: scope.sends,
        reconnects: scope.reconnects,
        crashes: [scope.crashes; 2],
        duplicates: scope.duplicates,
        waits: scope.waits,
        strays: scope.strays,
        closes: scope.closes,
    };
    let mut walk = Walk {
        scope,
        // A fixed, well-mixed 64-bit hash (foldhash's quality variant): worlds are hashed by
        // the million, and SipHash took a tenth of the run.
        hashing: foldhash::quality::FixedState::with_seed(0x7e7e_5eed),
        seen: HashMap::new(),
        judged: HashSet::new(),
        transitions: 0,
        trace: Vec::new(),
    };
    walk.visit(start(scope.window), budget)?;
    Ok(SubstrateReport {
        scope,
        states: walk.seen.len(),
        transitions: walk.transitions,
    })
}

struct Walk {
    scope: Scope,
    /// How worlds (and worlds with their budget) are hashed.
    hashing: foldhash::quality::FixedState,
    /// Hash of a world and its budget → the shallowest depth it was explored from.
    seen: HashMap<u64, usize>,
    /// Hashes of the worlds judged (a world reached with another budget is judged once).
    judged: HashSet<u64>,
    transitions: u64,
    trace: Vec<Action>,
}

impl Walk {
    fn visit(&mut self, world: Harness, budget: Budget) -> Result<(), String> {
        let depth = self.trace.len();
        let mut hasher = self.hashing.build_hasher();
        world.fingerprint(&mut hasher);
        let world_key = hasher.finish();
        let key = self.hashing.hash_one((world_key, budget));
        match self.seen.get(&key) {
            Some(explored_at) if *explored_at <= depth => return Ok(()),
            _ => {}
        }
        self.seen.insert(key, depth);
        if self.judged.insert(world_key) {
            let fail = |why: String, trace: &[Action]| format!("{why}\n  trace: {trace:?}");
            Promises::judge(&world).map_err(|why| fail(why, &self.trace))?;
            Promises::judge_healed(&world).map_err(|why| fail(why, &self.trace))?;
        }
        if depth == self.scope.depth {
            return Ok(());
        }
        for action in enabled(&world, &budget) {
            let mut next = world.clone();
            if !apply(&mut next, action) {
                continue;
            }
            self.transitions += 1;
            let mut left = budget;
            spend(&mut left, action);
            self.trace.push(action);
            self.visit(next, left)?;
            self.trace.pop();
        }
        Ok(())
    }
}

/// Runs `actions` from the start world for `window`, judging after every step (the random
/// traces of the property test use this).
pub fn replay(window: usize, actions: &[Action]) -> Result<(), String> {
    let mut h = start(window);
    for (step, action) in actions.iter().enumerate() {
        apply(&mut h, *action);
        Promises::judge(&h).map_err(|why| format!("step {step} ({action:?}): {why}"))?;
    }
    Promises::judge_healed(&h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quick_scope_holds_every_promise() {
        let report = explore(Scope::QUICK).unwrap();
        assert!(report.states > 1_000, "{report}");
    }
}
