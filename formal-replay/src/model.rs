//! The reference model: the semantics of docs/conformance/README.md (its sections `frame_types`
//! to `emission`) transcribed as directly as possible.
//!
//! Written for clarity, not speed, and sharing no code with `tether-core`: sets are vectors
//! searched linearly, counters are `u128` clamped only where the document says "saturate",
//! the ring is a plain vector of request ids. If core and this model ever disagree, one of
//! them misreads the document, and the conformance run says which case shows it.

/// One row of the frame-type table (docs/conformance/README.md#frame-type-codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameTypeRow {
    /// Wire code.
    pub code: u8,
    /// Part of a request's ordered flow.
    pub flow: bool,
    /// Ends its request.
    pub terminal: bool,
    /// `"finished"`, `"failed"` or nothing.
    pub ends: Option<&'static str>,
}

const fn row(code: u8, flow: bool, terminal: bool, ends: Option<&'static str>) -> FrameTypeRow {
    FrameTypeRow {
        code,
        flow,
        terminal,
        ends,
    }
}

/// The 15 known frame types of protocol version 6 (capdag 1.524.58, `frame.py: FrameType`).
/// Code 2 (the retired RES) is absent on purpose.
pub const FRAME_TYPES: [FrameTypeRow; 15] = [
    row(0, false, false, None),           // HELLO
    row(1, true, false, None),            // REQ
    row(3, true, false, None),            // CHUNK
    row(4, true, true, Some("finished")), // END
    row(5, true, false, None),            // LOG
    row(6, true, true, Some("failed")),   // ERR
    row(7, false, false, None),           // HEARTBEAT
    row(8, true, false, None),            // STREAM_START
    row(9, true, false, None),            // STREAM_END
    row(10, false, false, None),          // RELAY_NOTIFY
    row(11, false, false, None),          // RELAY_STATE
    row(12, false, false, None),          // CANCEL
    row(13, false, false, None),          // CREDIT
    row(14, false, false, None),          // CLOSE_STREAM
    row(15, false, false, None),          // POLICY (version 6)
];

/// Code of CHUNK.
pub const CHUNK: u8 = 3;
/// Code of CREDIT.
pub const CREDIT: u8 = 13;

/// The table row of `code`, `None` when the code is unknown.
pub fn frame_type(code: u8) -> Option<FrameTypeRow> {
    FRAME_TYPES.iter().copied().find(|row| row.code == code)
}

/// `ledger`: the ledger after one frame, in unbounded integers.
pub fn ledger(remaining: u64, frame: u8, granted: u64) -> i128 {
    let start = i128::from(remaining);
    if frame == CHUNK {
        start - 1
    } else if frame == CREDIT {
        start + i128::from(granted)
    } else {
        start
    }
}

/// `negotiate`: the smaller proposal, refused when it is 0.
pub fn negotiate(ours: u64, theirs: u64) -> Option<u64> {
    let smaller = if ours < theirs { ours } else { theirs };
    if smaller == 0 {
        None
    } else {
        Some(smaller)
    }
}

/// `grant_target`: `Some(identity)` when a gate is credited (the identity may be `None`), else
/// `None`.
pub fn grant_target(streams: &[Option<String>], named: &Option<String>) -> Option<Option<String>> {
    for stream in streams {
        if stream == named {
            return Some(stream.clone());
        }
    }
    if named.is_none() && streams.len() == 1 {
        return Some(streams[0].clone());
    }
    None
}

const U64_MAX: u128 = u64::MAX as u128;

/// `gate`: the sender's gate.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Gate {
    /// Credits still spendable.
    pub available: u128,
    /// `None` while open; the first close reason otherwise.
    pub closed: Option<String>,
}

/// A gate operation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GateOp {
    /// acquire n
    Acquire(u64),
    /// grant n
    Grant(u64),
    /// close reason
    Close(String),
}

impl Gate {
    /// A gate opened with `window`.
    pub fn opened(window: u64) -> Self {
        Gate {
            available: u128::from(window),
            closed: None,
        }
    }

    /// Applies `op`; returns the answer (`None` for grant and close).
    pub fn apply(&mut self, op: &GateOp) -> Option<String> {
        match op {
            GateOp::Acquire(n) => {
                if let Some(reason) = &self.closed {
                    return Some(format!("closed:{reason}"));
                }
                let n = u128::from(*n);
                if n <= self.available {
                    self.available -= n;
                    Some("acquired".to_string())
                } else {
                    Some("wait".to_string())
                }
            }
            GateOp::Grant(n) => {
                if self.closed.is_none() {
                    self.available = (self.available + u128::from(*n)).min(U64_MAX);
                }
                None
            }
            GateOp::Close(reason) => {
                if self.closed.is_none() {
                    self.closed = Some(reason.clone());
                }
                None
            }
        }
    }
}

/// A window operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WindowOp {
    /// A CHUNK arrived.
    Arrive,
    /// A CHUNK continuing an item arrived.
    Continuation,
    /// The consumer took a chunk.
    Consume,
    /// Grant everything pending.
    Flush,
}

/// `window`: the receiver's window.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Window {
    /// Chunks the sender may still send.
    pub remaining: u128,
    /// Consumed, not yet granted.
    pub pending: u128,
    /// `max(1, ⌊window/2⌋)`.
    pub batch: u128,
}

impl Window {
    /// A window opened with `window`.
    pub fn opened(window: u64) -> Self {
        let half = u128::from(window) / 2;
        Window {
            remaining: u128::from(window),
            pending: 0,
            batch: if half < 1 { 1 } else { half },
        }
    }

    /// Applies `op`; returns (violation, grant).
    pub fn apply(&mut self, op: WindowOp) -> (bool, u128) {
        match op {
            WindowOp::Arrive => {
                if self.remaining == 0 {
                    (true, 0)
                } else {
                    self.remaining -= 1;
                    (false, 0)
                }
            }
            WindowOp::Continuation => {
                if self.remaining == 0 {
                    (true, 0)
                } else {
                    // Arrive, then give the chunk back at once.
                    (false, 1)
                }
            }
            WindowOp::Consume => {
                self.pending = (self.pending + 1).min(U64_MAX);
                if self.pending >= self.batch {
                    self.grant_pending()
                } else {
                    (false, 0)
                }
            }
            WindowOp::Flush => self.grant_pending(),
        }
    }

    fn grant_pending(&mut self) -> (bool, u128) {
        let grant = self.pending;
        self.remaining = (self.remaining + grant).min(U64_MAX);
        self.pending = 0;
        (false, grant)
    }
}

/// One reorder step.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ReorderStep {
    /// Handed on, in order.
    Deliver(Vec<u64>),
    /// Buffered.
    Hold,
    /// Refused: `stale`, `duplicate` or `overflow`.
    Error(&'static str),
}

/// `reorder`: one flow's reorder buffer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reorder {
    /// Next seq to hand on (unbounded).
    pub expected: u128,
    /// Held seqs, in arrival order.
    pub held: Vec<u64>,
    /// Most seqs held at once.
    pub limit: u64,
}

impl Reorder {
    /// An empty buffer.
    pub fn start(limit: u64) -> Self {
        Reorder {
            expected: 0,
            held: Vec::new(),
            limit,
        }
    }

    /// One arrival.
    pub fn accept(&mut self, seq: u64) -> ReorderStep {
        let s = u128::from(seq);
        if s < self.expected {
            return ReorderStep::Error("stale");
        }
        if s == self.expected {
            let mut delivered = vec![seq];
            let mut next = s + 1;
            loop {
                let found = self.held.iter().position(|held| u128::from(*held) == next);
                match found {
                    Some(index) => {
                        delivered.push(self.held.remove(index));
                        next += 1;
                    }
                    None => break,
                }
            }
            self.expected = next;
            return ReorderStep::Deliver(delivered);
        }
        if self.held.contains(&seq) {
            return ReorderStep::Error("duplicate");
        }
        if self.held.len() as u128 >= u128::from(self.limit) {
            return ReorderStep::Error("overflow");
        }
        self.held.push(seq);
        ReorderStep::Hold
    }
}

/// `writer`: one flow's writer. Returns (written, seq) per frame code.
pub fn writer(frames: &[u8]) -> Vec<(bool, Option<u64>)> {
    let mut ended = false;
    let mut next: u64 = 0;
    let mut out = Vec::new();
    for code in frames {
        let row = frame_type(*code).expect("writer frames are known codes");
        if row.flow && ended {
            out.push((false, None));
        } else if row.flow {
            out.push((true, Some(next)));
            next += 1;
            if row.terminal {
                ended = true;
            }
        } else {
            out.push((true, Some(0)));
        }
    }
    out
}

/// `table`: the request table over small string ids.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Table {
    /// Live (xid, rid) keys.
    pub live: Vec<(String, String)>,
    /// Recently ended rids, oldest first.
    pub ring: Vec<String>,
    /// Successful registrations.
    pub registered: u64,
    /// Ring capacity.
    pub keep: u64,
}

impl Table {
    /// An empty table remembering `keep` endings.
    pub fn empty(keep: u64) -> Self {
        Table {
            live: Vec::new(),
            ring: Vec::new(),
            registered: 0,
            keep,
        }
    }

    /// Whether `rid` is live under any xid.
    pub fn is_live(&self, rid: &str) -> bool {
        self.live.iter().any(|(_, live_rid)| live_rid == rid)
    }

    /// register(x, r).
    pub fn register(&mut self, xid: &str, rid: &str) -> bool {
        if self.is_live(rid) {
            return false;
        }
        self.live.push((xid.to_string(), rid.to_string()));
        self.registered += 1;
        true
    }

    /// terminate(x, r).
    pub fn terminate(&mut self, xid: &str, rid: &str) -> bool {
        let position = self.live.iter().position(|(x, r)| x == xid && r == rid);
        let Some(index) = position else {
            return false;
        };
        self.live.remove(index);
        self.ring.push(rid.to_string());
        if self.ring.len() as u64 > self.keep {
            self.ring.remove(0);
        }
        true
    }

    /// disposition(r): `route`, `straggler` or `no_route`.
    pub fn disposition(&self, rid: &str) -> &'static str {
        if self.is_live(rid) {
            "route"
        } else if self.ring.iter().any(|ended| ended == rid) {
            "straggler"
        } else {
            "no_route"
        }
    }
}

/// `emission`: one emission.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Emission {
    /// STREAM_START.
    StreamStart(String),
    /// CHUNK with its index.
    Chunk(String, u64),
    /// STREAM_END with its optional count.
    StreamEnd(String, Option<u64>),
    /// END.
    End,
    /// ERR.
    Err,
    /// REQ or LOG.
    Other,
}

/// The checker's verdict: (violation, at, stream, expected, got), all `None` when clean.
pub type Verdict = (
    Option<&'static str>,
    Option<u64>,
    Option<String>,
    Option<u64>,
    Option<u64>,
);

/// `emission`: checks `emitted`, stopping at the first violation.
pub fn check_emissions(emitted: &[Emission]) -> Verdict {
    let mut open: Vec<(String, u64)> = Vec::new();
    let mut closed: Vec<String> = Vec::new();
    let mut ended = false;
    for (at, emission) in emitted.iter().enumerate() {
        let at = Some(at as u64);
        if ended {
            return (Some("afterEnd"), at, None, None, None);
        }
        let open_position = |stream: &String| open.iter().position(|(s, _)| s == stream);
        match emission {
            Emission::StreamStart(stream) => {
                if open_position(stream).is_some() || closed.contains(stream) {
                    return (
                        Some("streamRestarted"),
                        at,
                        Some(stream.clone()),
                        None,
                        None,
                    );
                }
                open.push((stream.clone(), 0));
            }
            Emission::Chunk(stream, index) => {
                let Some(position) = open_position(stream) else {
                    return (Some("streamNotOpen"), at, Some(stream.clone()), None, None);
                };
                let seen = open[position].1;
                if *index != seen {
                    let stream = Some(stream.clone());
                    return (
                        Some("chunkOutOfPlace"),
                        at,
                        stream,
                        Some(seen),
                        Some(*index),
                    );
                }
                open[position].1 += 1;
            }
            Emission::StreamEnd(stream, count) => {
                let Some(position) = open_position(stream) else {
                    return (Some("streamNotOpen"), at, Some(stream.clone()), None, None);
                };
                let seen = open[position].1;
                if let Some(count) = count {
                    if *count != seen {
                        let stream = Some(stream.clone());
                        return (
                            Some("chunkCountWrong"),
                            at,
                            stream,
                            Some(seen),
                            Some(*count),
                        );
                    }
                }
                open.remove(position);
                closed.push(stream.clone());
            }
            Emission::End => {
                if let Some((stream, _)) = open.first() {
                    return (
                        Some("endWithOpenStream"),
                        at,
                        Some(stream.clone()),
                        None,
                        None,
                    );
                }
                ended = true;
            }
            Emission::Err => ended = true,
            Emission::Other => {}
        }
    }
    (None, None, None, None, None)
}

/// A join to one seed, written from docs/spec/driver.md §4.3: up to 5 attempts; the
/// wait before attempt k+1 is 2 s doubled k-1 times, capped at 30 s; connecting → sending →
/// sent, or failed after the fifth failure. Only the attempt in flight reports: an event
/// while the next attempt waits (before it is due), or after the join is done, changes
/// nothing. A written request implies the attempt connected.
#[derive(Debug, Clone)]
pub struct JoinModel {
    /// "connecting", "sending", "sent" or "failed".
    pub phase: &'static str,
    /// The current attempt (1-based).
    pub attempt: u32,
    /// When the current attempt starts, while it waits; `None` once it is in flight.
    pub due: Option<u64>,
}

impl Default for JoinModel {
    fn default() -> Self {
        JoinModel {
            phase: "connecting",
            attempt: 1,
            due: None,
        }
    }
}

impl JoinModel {
    /// One event at `at` ms; returns when the next attempt is due, if one was scheduled.
    pub fn event(&mut self, at: u64, kind: &str) -> Option<u64> {
        // Time passes first: a waiting attempt that is due goes in flight.
        if self.due.is_some_and(|due| due <= at) {
            self.due = None;
        }
        if self.due.is_some() {
            return None;
        }
        match (self.phase, kind) {
            ("connecting", "connected") => self.phase = "sending",
            ("connecting" | "sending", "sent") => self.phase = "sent",
            ("connecting" | "sending", "failed") => {
                if self.attempt >= 5 {
                    self.phase = "failed";
                } else {
                    let mut wait: u64 = 2_000;
                    for _ in 1..self.attempt {
                        wait *= 2;
                    }
                    self.attempt += 1;
                    self.phase = "connecting";
                    let due = at.saturating_add(wait.min(30_000));
                    self.due = Some(due);
                    return Some(due);
                }
            }
            _ => {}
        }
        None
    }
}

/// The actor plane's routing, written from docs/spec/driver.md §2.4, §3.2–§3.5: a record for the
/// mailbox goes by tag to the protocol actor owning it; any other record goes to the actor it
/// names when that actor is hosted here; an unknown tag is dropped first. Egress to a mailbox
/// is that peer; to an actor, the peer the route view names; either must be admitted. The
/// route view holds, per actor, the host whose claim was taken by the ownership rule of
/// README "Actor ownership" ([`RoutingModel::claim`]); a claim not taken changes nothing.
/// Only a SWIM tag's write failure is reported. Every drop counts its reason.
#[derive(Debug, Clone, Default)]
pub struct RoutingModel {
    /// This node's id (its mailbox address).
    pub mailbox: u8,
    /// `None` admits everyone.
    pub allow: Option<Vec<u8>>,
    known: Vec<String>,
    gossip: Vec<(String, u8)>,
    hosted: Vec<u8>,
    /// Per actor: (host, generation) of the claim taken last.
    view: Vec<(u8, u8, u64)>,
    /// The claim authorizer's allowed (actor, host) pairs; `None`: no authorizer.
    pub authorize: Option<Vec<(u8, u8)>>,
    /// Drops by reason, in first-seen order.
    pub drops: Vec<(&'static str, u128)>,
}

/// The SWIM message tags of docs/spec/driver.md §3.5.
const SWIM: [&str; 6] = [
    "Ping",
    "Ack",
    "PingReq",
    "IndirectAck",
    "JoinRequest",
    "JoinResponse",
];

impl RoutingModel {
    /// A node with mailbox `mailbox`, admitting `allow` (`None`: everyone), with empty tables.
    pub fn new(mailbox: u8, allow: Option<Vec<u8>>) -> Self {
        Self {
            mailbox,
            allow,
            ..Self::default()
        }
    }

    fn drop(&mut self, reason: &'static str) -> String {
        match self.drops.iter_mut().find(|(r, _)| *r == reason) {
            Some((_, n)) => *n += 1,
            None => self.drops.push((reason, 1)),
        }
        format!("drop:{reason}")
    }

    fn admitted(&self, peer: u8) -> bool {
        self.allow.as_ref().is_none_or(|list| list.contains(&peer))
    }

    /// The registry knows `tag`.
    pub fn know(&mut self, tag: &str) {
        if !self.known.iter().any(|t| t == tag) {
            self.known.push(tag.to_owned());
        }
    }

    /// Gossip tagged `tag` goes to protocol actor `to`; the tag becomes known.
    pub fn route(&mut self, tag: &str, to: u8) {
        self.know(tag);
        self.gossip.retain(|(t, _)| t != tag);
        self.gossip.push((tag.to_owned(), to));
    }

    /// `actor` is hosted here.
    pub fn host(&mut self, actor: u8) {
        if !self.hosted.contains(&actor) {
            self.hosted.push(actor);
        }
    }

    /// `actor` is not hosted here any more.
    pub fn unhost(&mut self, actor: u8) {
        self.hosted.retain(|a| *a != actor);
    }

    /// A claim that `host` hosts `actor` at `generation`, sent by `from`, carrying the consent
    /// of `handoff` if any. In order: `forged` (a bad signature); `relayed` (not sent by its
    /// host); `stale` (not newer than the generation held); `jump` (past 2^48, or more than
    /// 2^20 past the held one); then a claim that neither renews the holder's own route nor
    /// carries the holder's consent goes to the authorizer when there is one (`refused` unless
    /// it lists (actor, host)), and without one is `held` if anyone holds the actor; otherwise
    /// `accepted`, and the route view names `host`.
    pub fn claim(
        &mut self,
        actor: u8,
        host: u8,
        generation: u64,
        forged: bool,
        from: u8,
        handoff: Option<u8>,
    ) -> String {
        const CEILING: u64 = 1 << 48;
        const STEP: u64 = 1 << 20;
        if forged {
            return "forged".to_owned();
        }
        if from != host {
            return "relayed".to_owned();
        }
        let held = self
            .view
            .iter()
            .find(|(a, _, _)| *a == actor)
            .map(|&(_, h, g)| (h, g));
        if let Some((_, g)) = held {
            if generation <= g {
                return "stale".to_owned();
            }
        }
        let too_far = match held {
            Some((_, g)) => generation - g > STEP,
            None => false,
        };
        if generation > CEILING || too_far {
            return "jump".to_owned();
        }
        let by_holder = match held {
            Some((h, _)) => h == host || handoff == Some(h),
            None => false,
        };
        if !by_holder {
            if let Some(list) = &self.authorize {
                if !list.contains(&(actor, host)) {
                    return "refused".to_owned();
                }
            } else if held.is_some() {
                return "held".to_owned();
            }
        }
        self.view.retain(|(a, _, _)| *a != actor);
        self.view.push((actor, host, generation));
        "accepted".to_owned()
    }

    /// Where an inbound record goes.
    pub fn inbound(&mut self, dest: u8, tag: &str) -> String {
        if !self.known.iter().any(|t| t == tag) {
            return self.drop("unknown_tag");
        }
        if dest == self.mailbox {
            return match self.gossip.iter().find(|(t, _)| t == tag) {
                Some((_, to)) => format!("protocol:{to}"),
                None => self.drop("no_local_route"),
            };
        }
        if self.hosted.contains(&dest) {
            format!("actor:{dest}")
        } else {
            self.drop("not_local")
        }
    }

    fn egress_to(&mut self, peer: u8) -> String {
        if self.admitted(peer) {
            format!("peer:{peer}")
        } else {
            self.drop("unauthorized")
        }
    }

    /// Where a frame to `peer`'s mailbox goes.
    pub fn egress_mailbox(&mut self, peer: u8) -> String {
        self.egress_to(peer)
    }

    /// Where a frame to a remote actor goes.
    pub fn egress_actor(&mut self, actor: u8) -> String {
        match self.view.iter().find(|(a, _, _)| *a == actor) {
            Some(&(_, peer, _)) => self.egress_to(peer),
            None => self.drop("no_route"),
        }
    }

    /// A failed write: counted, and reported to SWIM for a SWIM tag.
    pub fn write_failed(&mut self, tag: &str) -> bool {
        self.drop("write_failed");
        SWIM.contains(&tag)
    }
}
