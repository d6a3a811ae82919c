//! The reference model of the request switch, written from docs/spec/switch.md alone. It shares
//! no code with `tether_core::switch` or `tether_core::request`; the only thing it takes
//! from core is the cap-URN oracle (`tether_core::cap`: parsing, `is_dispatchable`,
//! `specificity`, `is_equivalent`), which has golden vectors of its own. Ranking is done here.
//!
//! Plain data, linear searches, no indexes: it is meant to be read.
//!
//! # The world
//!
//! The engine and masters in slots (slot order = the case's order). A master is *attached*
//! while its connection lives and *healthy* once its identity echo was right; it is *routable*
//! when both. Every master's manifest is its caps plus the identity cap `cap:effect=none` (the
//! handshake puts it there). A request has an origin (the engine, or the master that made a
//! peer request), a destination master, optionally a parent (the request a peer request was
//! made on behalf of), and two legs: the *request leg* (origin → destination: the REQ, then the
//! origin's input) and the *response leg* (destination → origin).
//!
//! # Rules
//!
//! 1. **Routing** (docs/spec/switch.md §4.3–§4.4, §5.1). The candidates are the caps of routable
//!    masters, in slot order then manifest order, that are dispatchable for the request. Each has a
//!    distance `specificity(candidate) − specificity(request)`; candidates are ordered by distance
//!    0 first, then positive distances ascending, then negative ones by ascending absolute value,
//!    ties by candidate order. If a preferred cap is given and some candidate is equivalent to it,
//!    the first such candidate in that order wins; else the first candidate. No candidate:
//!    `no_handler` (counted). A cap that does not parse: `bad_cap` (engine requests; not counted as
//!    no_handler).
//! 2. **Registration** (docs/spec/switch.md §5.1, §6.1). Checks in that section's order: parse,
//!    route, then register; registering a rid that is live (whoever made it) is refused as
//!    `duplicate`. A successful registration counts, writes the REQ to the destination (seq 0
//!    of the request leg) and makes the rid live. A refused peer request is answered by an ERR
//!    to `from` (`NO_HANDLER`, `DUPLICATE_REQUEST`) outside any flow: seq 0. A refused engine
//!    request is an error returned to the engine; nothing is written.
//! 3. **Forwarding.** A frame for a live request from a side of it travels along the leg its
//!    sender writes and is renumbered on the outgoing flow: each leg numbers what it writes 0,
//!    1, 2, … without gaps (docs/spec/switch.md §6.3; docs/conformance/README.md#writer);
//!    non-flow frames (CREDIT, CANCEL, CLOSE_STREAM) carry 0.
//! 4. **Termination** (docs/spec/switch.md §6.1). END or ERR from the destination ends
//!    the request (`end` / `err`), is forwarded, and leaves no state. Cancel ends it
//!    `cancelled`, master death `master_died`. Each termination appends the rid to the
//!    recently-terminated ring, which keeps the last `ring` endings.
//! 5. **Disposition** (docs/spec/switch.md §6.2) of a frame whose rid is not live: `straggler` if
//!    the rid is in the ring (counted per wire frame type, whatever the sender and the type, CREDIT
//!    included), else `no_route` (counted). Nobody is cut for either.
//! 6. **Foreign frames** (tether's decision; core's `ForeignRequest`). A frame from a master that
//!    is neither the origin nor the destination of the live request it names cuts that master.
//! 7. **Credit** (docs/spec/switch.md §7, including tether's decision there on windows that
//!    differ per hop). Credit is end to end, so every side of every request must
//!    use one window: the switch's is the smallest initial credit of the case's masters (at
//!    most 32), and a master offering another is cut at its handshake (counted in `cuts`, never
//!    attached; a reattach of it is accepted and cut again): a master's RELAY_NOTIFY tells the
//!    switch its window and nothing tells the master the switch's (capdag's handshake, seed 001). Each stream of each leg has that window,
//!    opened at its STREAM_START. A CHUNK takes one when it is written. A master's
//!    CHUNK with none left is *held* (outcome `held`, not written), and so is every frame of
//!    that leg after it while anything is held: the switch keeps them in order. A CREDIT from
//!    the receiving side of a stream adds its grant, is forwarded to the sending side (end to
//!    end), and then lets the held frames of the credited leg go, oldest first, until the
//!    first CHUNK whose stream has no window left (`released`, each numbered on its flow as
//!    forwarded frames are); a released END or ERR of the response leg ends the request as
//!    its arrival would have, and a flow frame the destination writes after its held END or
//!    ERR is a straggler (rule 5: counted by type, dropped), as it would be had that terminal
//!    gone through. Held frames go with their request when it ends otherwise.
//!    (What one sender may hold is bounded in bytes, megabytes; past it the sender is cut
//!    with `credit_violation`. Cases carry one-byte chunks and never reach it.)
//! 8. **Cancel** (docs/spec/switch.md §8). Cancelling a live rid ends it and every live
//!    descendant (children are peer requests registered with the request as parent; the link
//!    is to that registration, so a child whose parent already ended is reached by nothing) as
//!    `cancelled`. For each: CANCEL to its destination (seq 0; `force_kill` unless the code is
//!    `ABORTED_COLLATERAL`) and ERR carrying the reason's code to its origin (next seq of the
//!    response leg). A rid that is not live: nothing, `ok = false`.
//! 9. **Stop feeds** (docs/spec/switch.md §8). A live rid: CLOSE_STREAM (seq 0) to its destination,
//!    the request stays live, `ok = true`. Else nothing, `ok = false`.
//! 10. **Master death** (close, or a cut). The slot detaches and stops being routable. Every
//!     live request it serves ends `master_died` with ERR `MASTER_DIED` to its origin (next seq
//!     of the response leg); every live request it originated ends `master_died` with CANCEL
//!     (seq 0) to its destination. Nothing else ends (a grandchild made by another master
//!     lives on). A close is not a cut.
//! 11. **Reattach** (docs/spec/switch.md §9.1). A detached slot accepts the master again at the
//!     same slot index (so slot order, hence tie-breaking, is unchanged), routable after a good
//!     echo. An attached slot, healthy or not, refuses (`ok = false`, nothing changes).
//!
//! # Domain (ops outside it make a case malformed; generators never produce them)
//!
//! Where docs/spec/switch.md does not say what happens, the section does not ask:
//! - a frame, peer request or close from a master that is not attached, or a frame or peer
//!   request from an unhealthy one;
//! - a side sending in the other side's role (`respond` from the origin, `continue` from the
//!   destination), the engine sending for a request it did not originate, the engine sending a
//!   CHUNK past its window (or any frame while it has one held), an origin's `err`;
//! - stream frames out of stream order on a live request (STREAM_START of a stream already
//!   started on that leg, CHUNK or STREAM_END of a stream not open, END while a stream of the
//!   leg is open, anything on the request leg after the origin's END): core checks emission
//!   order (docs/conformance/README.md#emission) but docs/spec/switch.md names no switch
//!   decision for it;
//! - CREDIT for a stream the credited leg has not started;
//! - a peer request whose cap does not parse, whose parent is not live or not routed to
//!   `from`, or that would be routed back to `from` (both legs would share one flow on one
//!   connection; docs/spec/switch.md does not say how they are told apart);
//! - a frame for a rid whose ring entries were partly evicted after several endings entered the
//!   ring in one op (docs/spec/switch.md does not order endings within one op, so which
//!   survived is not determined);
//! - a preferred cap that does not parse.

use std::collections::BTreeMap;

use tether_core::cap::{self, CapUrn};

use crate::script::{
    SwitchCancelCode, SwitchCounters, SwitchFrame, SwitchIdentity, SwitchMaster, SwitchNotice,
    SwitchOp, SwitchStep, SwitchTerminated, SWITCH_HANDLER_ERR_CODE,
};

/// The switch's own initial credit offer (docs/spec/switch.md §2.4: 32 chunks).
pub const SWITCH_INITIAL_CREDIT: u64 = 32;

/// The window a switch for `masters` offers: the smallest of their initial credits, at most
/// 32, so that none is refused (rule 7).
pub fn switch_window(masters: &[SwitchMaster]) -> u64 {
    masters
        .iter()
        .map(|master| master.initial_credit)
        .fold(SWITCH_INITIAL_CREDIT, u64::min)
}

/// The largest grant a `credit` op may carry (keeps every window far from overflow).
pub const GRANT_MAX: u64 = 1 << 32;

/// The name of the engine in scripts.
pub const ENGINE: &str = "engine";

/// Who sends or receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Party {
    /// The engine.
    Engine,
    /// The master in this slot.
    Master(usize),
}

/// A request's two directions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Leg {
    /// Origin → destination.
    Request,
    /// Destination → origin.
    Response,
}

/// One stream of one leg.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Stream {
    name: String,
    open: bool,
    remaining: u64,
}

/// What one leg has carried.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
struct LegState {
    streams: Vec<Stream>,
    /// The sender's END went through (request leg only: the response leg's END ends all).
    ended: bool,
    /// The seq of the next flow frame the switch writes on this leg.
    next_seq: u64,
    /// Frames the sender wrote past a stream's window, and every frame after the first of
    /// them, in order (rule 7).
    held: Vec<(SwitchFrame, Option<String>)>,
}

/// A live request.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Request {
    rid: u64,
    /// Which registration this is (a rid may be registered again after it ended).
    registration: u64,
    origin: Party,
    destination: usize,
    /// The registration of the request this one was made on behalf of.
    parent: Option<u64>,
    request_leg: LegState,
    response_leg: LegState,
}

impl Request {
    fn leg(&mut self, leg: Leg) -> &mut LegState {
        match leg {
            Leg::Request => &mut self.request_leg,
            Leg::Response => &mut self.response_leg,
        }
    }
}

/// A master slot.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Slot {
    id: String,
    /// The manifest: its caps, then the identity cap.
    caps: Vec<String>,
    /// min(switch's offer, its offer).
    credit: u64,
    /// Whether its window is the switch's (else every attach of it is cut at the handshake).
    fits: bool,
    attached: bool,
    healthy: bool,
}

impl Slot {
    fn routable(&self) -> bool {
        self.attached && self.healthy
    }
}

/// The endings one op put into the ring, and how many of them are still there. When only some
/// are left, which ones is not determined (rule: Domain).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Batch {
    rids: Vec<u64>,
    kept: usize,
}

/// How a frame stands to the live request it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// From a side: it travels `leg` to `receiver`.
    Side { leg: Leg, receiver: Party },
    /// From the master in this slot, which is no side.
    Foreign(usize),
}

/// How a frame ends a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    End,
    Err,
}

/// Where a frame for a rid goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Disposition {
    Route,
    Straggler,
    NoRoute,
    Undetermined,
}

/// The reference switch.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SwitchModel {
    slots: Vec<Slot>,
    live: Vec<Request>,
    ring: Vec<Batch>,
    ring_capacity: usize,
    registrations: u64,
    counters: Counts,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
struct Counts {
    registered: u64,
    no_handler: u64,
    cuts: u64,
    no_route: u64,
    stragglers: BTreeMap<String, u64>,
    end: u64,
    err: u64,
    cancelled: u64,
    master_died: u64,
}

/// Why an op was not applied: the case is malformed or leaves the section's domain.
pub type Refusal = String;

fn out_of_domain(why: impl std::fmt::Display) -> Refusal {
    format!("out of domain: {why}")
}

/// An empty observation.
fn step() -> SwitchStep {
    SwitchStep {
        to: None,
        seq: None,
        error: None,
        outcome: None,
        cut: None,
        ok: None,
        force_kill: None,
        ended: Vec::new(),
        notices: Vec::new(),
        released: Vec::new(),
        live: Vec::new(),
    }
}

impl SwitchModel {
    /// A switch whose ring keeps `ring` endings, with `masters` attached and checked in slot
    /// order.
    pub fn new(ring: u64, masters: &[SwitchMaster]) -> Result<Self, Refusal> {
        if ring == 0 {
            return Err("ring must be at least 1".into());
        }
        let mut slots: Vec<Slot> = Vec::new();
        let window = switch_window(masters);
        let mut counters = Counts::default();
        for master in masters {
            if master.id == ENGINE || slots.iter().any(|slot| slot.id == master.id) {
                return Err(format!("master id {:?} is taken", master.id));
            }
            if master.initial_credit == 0 {
                return Err(format!("master {}: a zero window is refused", master.id));
            }
            if let Some(bad) = master.caps.iter().find(|c| CapUrn::parse(c).is_err()) {
                return Err(format!("master {}: cap {bad:?} does not parse", master.id));
            }
            let mut caps = master.caps.clone();
            caps.push(cap::CAP_IDENTITY.to_owned());
            let fits = master.initial_credit == window;
            counters.cuts += u64::from(!fits);
            slots.push(Slot {
                id: master.id.clone(),
                caps,
                credit: master.initial_credit.min(SWITCH_INITIAL_CREDIT),
                fits,
                attached: fits,
                healthy: master.identity == SwitchIdentity::Echo,
            });
        }
        Ok(Self {
            slots,
            live: Vec::new(),
            ring: Vec::new(),
            ring_capacity: usize::try_from(ring).unwrap_or(usize::MAX),
            registrations: 0,
            counters,
        })
    }

    /// Applies one op and returns what the switch should be seen doing.
    pub fn apply(&mut self, op: &SwitchOp) -> Result<SwitchStep, Refusal> {
        let mut seen = match op {
            SwitchOp::Request {
                rid,
                cap,
                preferred,
            } => self.engine_request(*rid, cap, preferred.as_deref())?,
            SwitchOp::PeerRequest {
                from,
                rid,
                cap,
                parent,
            } => self.peer_request(from, *rid, cap, *parent)?,
            SwitchOp::Respond {
                from,
                rid,
                frame,
                stream,
            } => {
                let sender = self.sending_master(from)?;
                self.flow_frame(Party::Master(sender), true, *rid, *frame, stream.as_deref())?
            }
            SwitchOp::Continue {
                from,
                rid,
                frame,
                stream,
            } => {
                let sender = self.sender(from)?;
                self.flow_frame(sender, false, *rid, *frame, stream.as_deref())?
            }
            SwitchOp::Credit {
                from,
                rid,
                stream,
                n,
            } => {
                let sender = self.sender(from)?;
                self.credit(sender, *rid, stream, *n)?
            }
            SwitchOp::Cancel { rid, code } => self.cancel(*rid, *code),
            SwitchOp::StopFeeds { rid } => self.stop_feeds(*rid),
            SwitchOp::Close { master } => {
                let slot = self.slot_of(master)?;
                if !self.slots[slot].attached {
                    return Err(out_of_domain(format!("{master} is not attached")));
                }
                let mut seen = step();
                self.master_death(slot, &mut seen);
                seen
            }
            SwitchOp::Reattach { master } => {
                let slot = self.slot_of(master)?;
                let mut seen = step();
                let accepted = !self.slots[slot].attached;
                if accepted && self.slots[slot].fits {
                    self.slots[slot].attached = true;
                    self.slots[slot].healthy = true;
                } else if accepted {
                    self.counters.cuts += 1;
                    seen.cut = Some("handshake".into());
                }
                seen.ok = Some(accepted);
                seen
            }
        };
        seen.ended.sort_unstable();
        seen.notices.sort();
        seen.live = self.live_rids();
        Ok(seen)
    }

    /// The live rids, ascending.
    pub fn live_rids(&self) -> Vec<u64> {
        let mut rids: Vec<u64> = self.live.iter().map(|r| r.rid).collect();
        rids.sort_unstable();
        rids
    }

    /// The counters as a case reports them.
    pub fn counters(&self) -> SwitchCounters {
        let c = &self.counters;
        SwitchCounters {
            registered: c.registered,
            no_handler: c.no_handler,
            cuts: c.cuts,
            no_route: c.no_route,
            stragglers: c.stragglers.clone(),
            terminated: SwitchTerminated {
                end: c.end,
                err: c.err,
                cancelled: c.cancelled,
                master_died: c.master_died,
            },
        }
    }

    /// The id of each slot, in slot order.
    pub fn slot_ids(&self) -> Vec<String> {
        self.slots.iter().map(|slot| slot.id.clone()).collect()
    }

    /// Whether the master in `slot` can be routed to.
    pub fn is_routable(&self, slot: usize) -> bool {
        self.slots[slot].routable()
    }

    /// Whether the master in `slot` is attached.
    pub fn is_attached(&self, slot: usize) -> bool {
        self.slots[slot].attached
    }

    /// The destination slot of live `rid`.
    pub fn destination_of(&self, rid: u64) -> Option<usize> {
        self.find(rid).map(|at| self.live[at].destination)
    }

    /// The origin of live `rid`.
    pub fn origin_of(&self, rid: u64) -> Option<Party> {
        self.find(rid).map(|at| self.live[at].origin)
    }

    /// The streams of live `rid`'s response leg (`response`) or request leg, in start order,
    /// each with whether it is still open.
    pub fn streams(&self, rid: u64, response: bool) -> Vec<(String, bool)> {
        self.find(rid).map_or_else(Vec::new, |at| {
            let request = &self.live[at];
            let leg = if response {
                &request.response_leg
            } else {
                &request.request_leg
            };
            leg.streams
                .iter()
                .map(|s| (s.name.clone(), s.open))
                .collect()
        })
    }

    /// The caps some routable master serves, identity cap excluded.
    pub fn routable_caps(&self) -> Vec<String> {
        let mut caps: Vec<String> = Vec::new();
        for slot in self.slots.iter().filter(|s| s.routable()) {
            for cap in &slot.caps {
                if cap != cap::CAP_IDENTITY && !caps.contains(cap) {
                    caps.push(cap.clone());
                }
            }
        }
        caps
    }

    /// Whether a frame for `rid` (not live) would be a straggler: the rid is in the ring for
    /// certain.
    pub fn is_straggler(&self, rid: u64) -> bool {
        self.disposition(rid) == Disposition::Straggler
    }

    /// The slot a master will be routed to for `cap` (with `preferred`), if any.
    pub fn route_of(&self, cap: &str, preferred: Option<&str>) -> Option<usize> {
        let request = CapUrn::parse(cap).ok()?;
        let preferred = preferred.and_then(|p| CapUrn::parse(p).ok());
        self.route(&request, preferred.as_ref())
    }

    // -----------------------------------------------------------------------------------------
    // requests

    fn engine_request(
        &mut self,
        rid: u64,
        cap: &str,
        preferred: Option<&str>,
    ) -> Result<SwitchStep, Refusal> {
        let preferred = match preferred {
            None => None,
            Some(text) => Some(
                CapUrn::parse(text)
                    .map_err(|_| out_of_domain(format!("preferred {text:?} does not parse")))?,
            ),
        };
        let mut seen = step();
        let Ok(request) = CapUrn::parse(cap) else {
            seen.error = Some("bad_cap".into());
            return Ok(seen);
        };
        let Some(destination) = self.route(&request, preferred.as_ref()) else {
            self.counters.no_handler += 1;
            seen.error = Some("no_handler".into());
            return Ok(seen);
        };
        if self.find(rid).is_some() {
            seen.error = Some("duplicate".into());
            return Ok(seen);
        }
        self.register(rid, Party::Engine, destination, None, &mut seen);
        Ok(seen)
    }

    fn peer_request(
        &mut self,
        from: &str,
        rid: u64,
        cap: &str,
        parent: Option<u64>,
    ) -> Result<SwitchStep, Refusal> {
        let origin = self.sending_master(from)?;
        let parent = match parent {
            None => None,
            Some(parent_rid) => match self.find(parent_rid) {
                Some(at) if self.live[at].destination == origin => Some(self.live[at].registration),
                _ => {
                    return Err(out_of_domain(format!(
                        "parent {parent_rid} is not a live request routed to {from}"
                    )))
                }
            },
        };
        let request = CapUrn::parse(cap)
            .map_err(|_| out_of_domain(format!("peer request cap {cap:?} does not parse")))?;
        let mut seen = step();
        let refuse = |seen: &mut SwitchStep, error: &str, code: &str| {
            seen.error = Some(error.into());
            seen.notices.push(SwitchNotice {
                rid,
                to: from.to_owned(),
                frame: "ERR".into(),
                code: Some(code.into()),
                seq: 0,
            });
        };
        let Some(destination) = self.route(&request, None) else {
            self.counters.no_handler += 1;
            refuse(&mut seen, "no_handler", "NO_HANDLER");
            return Ok(seen);
        };
        // A master's share of the table: its live peer requests.
        let share = self
            .live
            .iter()
            .filter(|request| request.origin == Party::Master(origin))
            .count();
        if share >= tether_core::limits::SWITCH_PEER_REQUESTS_PER_MASTER_MAX {
            refuse(&mut seen, "quota", "QUOTA");
            return Ok(seen);
        }
        if self.find(rid).is_some() {
            refuse(&mut seen, "duplicate", "DUPLICATE_REQUEST");
            return Ok(seen);
        }
        if destination == origin {
            return Err(out_of_domain(format!(
                "peer request {rid} would be routed back to {from}"
            )));
        }
        self.register(rid, Party::Master(origin), destination, parent, &mut seen);
        Ok(seen)
    }

    fn register(
        &mut self,
        rid: u64,
        origin: Party,
        destination: usize,
        parent: Option<u64>,
        seen: &mut SwitchStep,
    ) {
        self.registrations += 1;
        self.counters.registered += 1;
        self.live.push(Request {
            rid,
            registration: self.registrations,
            origin,
            destination,
            parent,
            request_leg: LegState {
                next_seq: 1, // the REQ took 0
                ..LegState::default()
            },
            response_leg: LegState::default(),
        });
        seen.to = Some(self.slots[destination].id.clone());
        seen.seq = Some(0);
    }

    /// Rule 1.
    fn route(&self, request: &CapUrn, preferred: Option<&CapUrn>) -> Option<usize> {
        let wanted = i128::from(request.specificity());
        // (distance class, |distance|, candidate order, slot, cap)
        let mut ranked: Vec<(u8, i128, usize, usize, CapUrn)> = Vec::new();
        for (slot, master) in self.slots.iter().enumerate() {
            if !master.routable() {
                continue;
            }
            for text in &master.caps {
                let candidate = CapUrn::parse(text).expect("manifest caps were parsed at setup");
                if !cap::is_dispatchable(&candidate, request) {
                    continue;
                }
                let distance = i128::from(candidate.specificity()) - wanted;
                let class = match distance {
                    0 => 0,
                    d if d > 0 => 1,
                    _ => 2,
                };
                let order = ranked.len();
                ranked.push((class, distance.abs(), order, slot, candidate));
            }
        }
        ranked.sort_by_key(|(class, distance, order, _, _)| (*class, *distance, *order));
        if let Some(preferred) = preferred {
            if let Some(found) = ranked.iter().find(|c| c.4.is_equivalent(preferred)) {
                return Some(found.3);
            }
        }
        ranked.first().map(|c| c.3)
    }

    // -----------------------------------------------------------------------------------------
    // frames

    /// `respond` (`as_destination`) or `continue`.
    fn flow_frame(
        &mut self,
        sender: Party,
        as_destination: bool,
        rid: u64,
        frame: SwitchFrame,
        stream: Option<&str>,
    ) -> Result<SwitchStep, Refusal> {
        if frame.has_stream() != stream.is_some() {
            return Err(format!(
                "{} {} a stream",
                frame.wire_name(),
                if frame.has_stream() {
                    "needs"
                } else {
                    "takes no"
                }
            ));
        }
        if !as_destination && frame == SwitchFrame::Err {
            return Err(out_of_domain("an origin's ERR"));
        }
        let mut seen = step();
        let Some(at) = self.find(rid) else {
            self.unrouted(rid, frame.wire_name(), &mut seen)?;
            return Ok(seen);
        };
        let (leg, receiver) = match self.role(at, sender, as_destination)? {
            Role::Side { leg, receiver } => (leg, receiver),
            Role::Foreign(m) => {
                self.cut(m, "foreign_request", &mut seen);
                return Ok(seen);
            }
        };
        let window = self.window(at);
        let receiver = self.name(receiver);
        let state = self.live[at].leg(leg);
        let terminal_held = state
            .held
            .last()
            .is_some_and(|(held, _)| matches!(held, SwitchFrame::End | SwitchFrame::Err));
        if leg == Leg::Response && terminal_held {
            // Rule 7: what the destination wrote after its held END or ERR is the straggler it
            // would be had that terminal gone through (rule 5).
            *self
                .counters
                .stragglers
                .entry(frame.wire_name().to_owned())
                .or_default() += 1;
            seen.outcome = Some("straggler".into());
            return Ok(seen);
        }
        if state.ended {
            return Err(out_of_domain(format!(
                "a frame after the origin's END on {rid}"
            )));
        }
        let position = stream.and_then(|name| state.streams.iter().position(|s| s.name == name));
        let open = position.is_some_and(|p| state.streams[p].open);
        match frame {
            SwitchFrame::StreamStart if position.is_some() => {
                return Err(out_of_domain("a stream started twice on one leg"))
            }
            SwitchFrame::StreamStart => state.streams.push(Stream {
                name: stream.expect("stream frames name a stream").to_owned(),
                open: true,
                remaining: window,
            }),
            SwitchFrame::Chunk | SwitchFrame::StreamEnd if !open => {
                return Err(out_of_domain("a stream frame on a stream that is not open"))
            }
            SwitchFrame::Chunk => {}
            SwitchFrame::StreamEnd => state.streams[position.expect("open")].open = false,
            SwitchFrame::End if state.streams.iter().any(|s| s.open) => {
                return Err(out_of_domain("END while a stream is open"))
            }
            SwitchFrame::End if leg == Leg::Request => state.ended = true,
            SwitchFrame::End | SwitchFrame::Err | SwitchFrame::Log => {}
        }
        let spent =
            frame == SwitchFrame::Chunk && state.streams[position.expect("open")].remaining == 0;
        if spent || !state.held.is_empty() {
            if sender == Party::Engine {
                return Err(out_of_domain("the engine past its window"));
            }
            state.held.push((frame, stream.map(str::to_owned)));
            seen.outcome = Some("held".into());
            return Ok(seen);
        }
        let (seq, ended) = self.write_flow(at, leg, frame, stream);
        seen.to = Some(receiver);
        seen.seq = Some(seq);
        seen.outcome = Some("routed".into());
        seen.ended.extend(ended);
        Ok(seen)
    }

    /// Writes one flow frame of live request `at` on `leg`: a CHUNK takes one of its stream's
    /// window, the frame gets the leg's next seq, and an END or ERR of the response leg ends
    /// the request (rule 4). Returns the seq and the rid it ended.
    fn write_flow(
        &mut self,
        at: usize,
        leg: Leg,
        frame: SwitchFrame,
        stream: Option<&str>,
    ) -> (u64, Option<u64>) {
        let state = self.live[at].leg(leg);
        if frame == SwitchFrame::Chunk {
            let target = state
                .streams
                .iter_mut()
                .find(|s| Some(s.name.as_str()) == stream)
                .expect("a chunk's stream was opened");
            target.remaining -= 1;
        }
        let seq = state.next_seq;
        state.next_seq += 1;
        let ending = match (leg, frame) {
            (Leg::Response, SwitchFrame::End) => Some(Ending::End),
            (Leg::Response, SwitchFrame::Err) => Some(Ending::Err),
            _ => None,
        };
        let Some(ending) = ending else {
            return (seq, None);
        };
        let ended = self.live.remove(at);
        match ending {
            Ending::End => self.counters.end += 1,
            Ending::Err => self.counters.err += 1,
        }
        self.enter_ring(vec![ended.rid]);
        (seq, Some(ended.rid))
    }

    /// Rule 7: lets the held frames of `leg` of live request `at` go, oldest first, while the
    /// first of them is not a CHUNK whose stream has no window left.
    fn release(&mut self, at: usize, leg: Leg, to: &str, seen: &mut SwitchStep) {
        let rid = self.live[at].rid;
        loop {
            let state = self.live[at].leg(leg);
            let Some((frame, stream)) = state.held.first().cloned() else {
                return;
            };
            if frame == SwitchFrame::Chunk {
                let target = state
                    .streams
                    .iter()
                    .find(|s| Some(&s.name) == stream.as_ref())
                    .expect("a held chunk's stream was opened");
                if target.remaining == 0 {
                    return;
                }
            }
            state.held.remove(0);
            let (seq, ended) = self.write_flow(at, leg, frame, stream.as_deref());
            seen.released.push(SwitchNotice {
                rid,
                to: to.to_owned(),
                frame: frame.wire_name().to_owned(),
                code: (frame == SwitchFrame::Err).then(|| SWITCH_HANDLER_ERR_CODE.to_owned()),
                seq,
            });
            if let Some(rid) = ended {
                seen.ended.push(rid);
                return;
            }
        }
    }

    /// Rule 6 and the domain: which leg a frame from `sender` travels, or that `sender` is no
    /// side of live request `at` (a master is cut for that).
    fn role(&self, at: usize, sender: Party, as_destination: bool) -> Result<Role, Refusal> {
        let request = &self.live[at];
        let rid = request.rid;
        match (sender, as_destination) {
            (Party::Master(m), true) if request.destination == m => Ok(Role::Side {
                leg: Leg::Response,
                receiver: request.origin,
            }),
            (s, false) if request.origin == s => Ok(Role::Side {
                leg: Leg::Request,
                receiver: Party::Master(request.destination),
            }),
            (Party::Master(m), _)
                if request.destination == m || request.origin == Party::Master(m) =>
            {
                Err(out_of_domain(format!(
                    "{} sends for {rid} in the other side's role",
                    self.name(sender)
                )))
            }
            (Party::Master(m), _) => Ok(Role::Foreign(m)),
            (Party::Engine, _) => Err(out_of_domain(format!(
                "the engine is no side of request {rid}"
            ))),
        }
    }

    fn credit(
        &mut self,
        sender: Party,
        rid: u64,
        stream: &str,
        n: u64,
    ) -> Result<SwitchStep, Refusal> {
        if n == 0 || n > GRANT_MAX {
            return Err(format!("a grant is 1 to {GRANT_MAX} chunks"));
        }
        let mut seen = step();
        let Some(at) = self.find(rid) else {
            self.unrouted(rid, "CREDIT", &mut seen)?;
            return Ok(seen);
        };
        let request = &self.live[at];
        // The receiving side of a leg credits it; the grant goes to its sending side.
        let (leg, to) = match sender {
            Party::Master(m) if request.destination == m => (Leg::Request, request.origin),
            s if request.origin == s => (Leg::Response, Party::Master(request.destination)),
            Party::Master(m) => {
                self.cut(m, "foreign_request", &mut seen);
                return Ok(seen);
            }
            Party::Engine => {
                return Err(out_of_domain(format!(
                    "the engine is no side of request {rid}"
                )))
            }
        };
        let state = self.live[at].leg(leg);
        let Some(target) = state.streams.iter_mut().find(|s| s.name == stream) else {
            return Err(out_of_domain(format!(
                "credit for unstarted stream {stream}"
            )));
        };
        target.remaining += n;
        let to_name = self.name(to);
        let granting = self.name(sender);
        seen.to = Some(to_name);
        seen.seq = Some(0);
        seen.outcome = Some("routed".into());
        self.release(at, leg, &granting, &mut seen);
        Ok(seen)
    }

    /// Rule 5.
    fn unrouted(
        &mut self,
        rid: u64,
        type_name: &str,
        seen: &mut SwitchStep,
    ) -> Result<(), Refusal> {
        match self.disposition(rid) {
            Disposition::Route => unreachable!("the caller found no live request for {rid}"),
            Disposition::Straggler => {
                *self
                    .counters
                    .stragglers
                    .entry(type_name.to_owned())
                    .or_default() += 1;
                seen.outcome = Some("straggler".into());
            }
            Disposition::NoRoute => {
                self.counters.no_route += 1;
                seen.outcome = Some("no_route".into());
            }
            Disposition::Undetermined => {
                return Err(out_of_domain(format!(
                    "whether {rid} is still in the ring is not determined"
                )))
            }
        }
        Ok(())
    }

    /// Rule 7: one window for every request, the switch's (see [`switch_window`]).
    fn window(&self, _at: usize) -> u64 {
        self.slots
            .iter()
            .map(|slot| slot.credit)
            .fold(SWITCH_INITIAL_CREDIT, u64::min)
    }

    // -----------------------------------------------------------------------------------------
    // host controls and deaths

    /// Rule 8.
    fn cancel(&mut self, rid: u64, code: SwitchCancelCode) -> SwitchStep {
        let mut seen = step();
        let Some(at) = self.find(rid) else {
            seen.ok = Some(false);
            return seen;
        };
        // The request and its live descendants, through registrations.
        let mut doomed = vec![self.live[at].registration];
        let mut grew = true;
        while grew {
            grew = false;
            for request in &self.live {
                let child = request.parent.is_some_and(|p| doomed.contains(&p));
                if child && !doomed.contains(&request.registration) {
                    doomed.push(request.registration);
                    grew = true;
                }
            }
        }
        let force_kill = code != SwitchCancelCode::AbortedCollateral;
        let mut ended = Vec::new();
        for registration in doomed {
            let at = self
                .live
                .iter()
                .position(|r| r.registration == registration)
                .expect("doomed requests are live");
            let mut request = self.live.remove(at);
            seen.notices.push(SwitchNotice {
                rid: request.rid,
                to: self.slots[request.destination].id.clone(),
                frame: "CANCEL".into(),
                code: None,
                seq: 0,
            });
            let seq = request.response_leg.next_seq;
            request.response_leg.next_seq += 1;
            seen.notices.push(SwitchNotice {
                rid: request.rid,
                to: self.name(request.origin),
                frame: "ERR".into(),
                code: Some(code.as_str().into()),
                seq,
            });
            ended.push(request.rid);
        }
        self.counters.cancelled += ended.len() as u64;
        seen.ended.clone_from(&ended);
        self.enter_ring(ended);
        seen.ok = Some(true);
        seen.force_kill = Some(force_kill);
        seen
    }

    /// Rule 9.
    fn stop_feeds(&mut self, rid: u64) -> SwitchStep {
        let mut seen = step();
        let live = self.find(rid);
        if let Some(at) = live {
            seen.notices.push(SwitchNotice {
                rid,
                to: self.slots[self.live[at].destination].id.clone(),
                frame: "CLOSE_STREAM".into(),
                code: None,
                seq: 0,
            });
        }
        seen.ok = Some(live.is_some());
        seen
    }

    /// Rule 6 and rule 7's cut: the master's connection is cut, then it dies (rule 10).
    fn cut(&mut self, slot: usize, violation: &str, seen: &mut SwitchStep) {
        self.counters.cuts += 1;
        seen.outcome = Some("cut".into());
        seen.cut = Some(violation.into());
        self.master_death(slot, seen);
    }

    /// Rule 10.
    fn master_death(&mut self, slot: usize, seen: &mut SwitchStep) {
        self.slots[slot].attached = false;
        let mut ended = Vec::new();
        let mut at = 0;
        while at < self.live.len() {
            let serves = self.live[at].destination == slot;
            let originated = self.live[at].origin == Party::Master(slot);
            if !serves && !originated {
                at += 1;
                continue;
            }
            let mut request = self.live.remove(at);
            if serves {
                let seq = request.response_leg.next_seq;
                request.response_leg.next_seq += 1;
                seen.notices.push(SwitchNotice {
                    rid: request.rid,
                    to: self.name(request.origin),
                    frame: "ERR".into(),
                    code: Some("MASTER_DIED".into()),
                    seq,
                });
            } else {
                seen.notices.push(SwitchNotice {
                    rid: request.rid,
                    to: self.slots[request.destination].id.clone(),
                    frame: "CANCEL".into(),
                    code: None,
                    seq: 0,
                });
            }
            ended.push(request.rid);
        }
        self.counters.master_died += ended.len() as u64;
        seen.ended.extend(&ended);
        self.enter_ring(ended);
    }

    // -----------------------------------------------------------------------------------------
    // the ring

    /// Rule 4: the endings of one op enter the ring together; the oldest entries leave one by
    /// one while it holds more than its capacity.
    fn enter_ring(&mut self, rids: Vec<u64>) {
        if rids.is_empty() {
            return;
        }
        let kept = rids.len();
        self.ring.push(Batch { rids, kept });
        let mut held: usize = self.ring.iter().map(|b| b.kept).sum();
        while held > self.ring_capacity {
            let oldest = self
                .ring
                .iter_mut()
                .find(|b| b.kept > 0)
                .expect("a ring over capacity holds something");
            oldest.kept -= 1;
            held -= 1;
        }
        self.ring.retain(|b| b.kept > 0);
    }

    fn disposition(&self, rid: u64) -> Disposition {
        if self.find(rid).is_some() {
            return Disposition::Route;
        }
        let holding: Vec<&Batch> = self.ring.iter().filter(|b| b.rids.contains(&rid)).collect();
        if holding.iter().any(|b| b.kept == b.rids.len()) {
            Disposition::Straggler
        } else if holding.is_empty() {
            Disposition::NoRoute
        } else {
            Disposition::Undetermined
        }
    }

    // -----------------------------------------------------------------------------------------
    // names

    fn find(&self, rid: u64) -> Option<usize> {
        self.live.iter().position(|r| r.rid == rid)
    }

    fn slot_of(&self, id: &str) -> Result<usize, Refusal> {
        self.slots
            .iter()
            .position(|slot| slot.id == id)
            .ok_or_else(|| format!("no master {id:?}"))
    }

    /// `from` as a party able to send now.
    fn sender(&self, from: &str) -> Result<Party, Refusal> {
        if from == ENGINE {
            Ok(Party::Engine)
        } else {
            self.sending_master(from).map(Party::Master)
        }
    }

    fn sending_master(&self, from: &str) -> Result<usize, Refusal> {
        let slot = self.slot_of(from)?;
        if !self.slots[slot].attached {
            return Err(out_of_domain(format!("{from} is not attached")));
        }
        if !self.slots[slot].healthy {
            return Err(out_of_domain(format!("{from} is unhealthy")));
        }
        Ok(slot)
    }

    fn name(&self, party: Party) -> String {
        match party {
            Party::Engine => ENGINE.to_owned(),
            Party::Master(slot) => self.slots[slot].id.clone(),
        }
    }
}

/// Runs a whole case on the model: the case with every observation recomputed.
pub fn run_case(case: &crate::script::SwitchCase) -> Result<crate::script::SwitchCase, Refusal> {
    if case.ops.len() != case.steps.len() {
        return Err(format!(
            "{} ops but {} steps",
            case.ops.len(),
            case.steps.len()
        ));
    }
    let mut model = SwitchModel::new(case.ring, &case.masters)?;
    let mut steps = Vec::with_capacity(case.ops.len());
    for (index, op) in case.ops.iter().enumerate() {
        steps.push(
            model
                .apply(op)
                .map_err(|why| format!("ops[{index}]: {why}"))?,
        );
    }
    Ok(crate::script::SwitchCase {
        steps,
        counters: model.counters(),
        ..case.clone()
    })
}
