//! The reference model of the driver machine (the `driver` section, seed 000), written from
//! `docs/conformance/driver.md` alone. It shares no code with `tether-core` and was written
//! without reading core's driver: if the two disagree, one of them misreads the document.
//!
//! Plain data (`BTreeMap`s keyed the way the document orders things), one function per op,
//! every rule in the document's words next to the code that does it. Nothing here panics: every
//! sum is checked, and an input the document does not define is an `Err`:
//!
//! - an unknown channel, path or direction string (an unknown ALPN is not malformed: it is the
//!   `unknown` path);
//! - an `at` smaller than the previous op's;
//! - a generation past `u64::MAX`, a timer due past `u64::MAX` ms, or a drop, refusal or
//!   counter past `u64::MAX` (none is representable in a script);
//! - `steps` not one per op.
//!
//! Readings chosen where the document leaves room:
//!
//! - A step's `timeout` is the earliest due time of all pending timers, even when that time is
//!   already past (`at` moved on without a `timeout` op): the document says "when the machine
//!   next wants a `timeout` op", and a timer due in the past is still wanted.
//! - Adding 0 frames to a drop reason leaves it absent from `end.drops` ("every reason with a
//!   count above 0").

use std::collections::BTreeMap;

use crate::script::{DriverCase, DriverCounters, DriverEnd, DriverOp, DriverStep};

// -------------------------------------------------------------------------------------------
// §1: the fixed configuration

/// "idle writer timeout 1,000 ms".
const IDLE_WRITER_TIMEOUT_MS: u64 = 1_000;
/// "join delay divisor 1".
const JOIN_DELAY_DIVISOR: u64 = 1;
/// Dial: "Up to 3 attempts".
const DIAL_ATTEMPTS: u32 = 3;
/// Join: "up to 5 attempts per seed".
const JOIN_ATTEMPTS: u32 = 5;

/// "a peer `n` (0–255) names a valid key iff `n < 250`".
fn peer_is_valid(peer: u8) -> bool {
    peer < 250
}

/// Dial: "after attempt 1 fails wait 200 ms, after attempt 2 fails wait 600 ms; after attempt
/// 3 fails the dial ends". `None`: no further attempt.
fn dial_wait_after(attempt: u32) -> Option<u64> {
    match attempt {
        1 => Some(200),
        2 => Some(600),
        _ => None,
    }
}

/// Join: "after attempt *k* fails (k < 5) wait `min(2000 × 2^(k−1), 30000)` ms divided by the
/// divisor; after attempt 5 fails the join has phase `failed`". `None`: no further attempt.
fn join_wait_after(attempt: u32) -> Option<u64> {
    if attempt == 0 || attempt >= JOIN_ATTEMPTS {
        return None;
    }
    // 2000 × 2^(k−1), doubling one step at a time and capping at every step (the product is
    // monotone, so capping early gives the same minimum and cannot overflow).
    let mut wait: u64 = 2_000;
    for _ in 1..attempt {
        wait = wait.saturating_mul(2).min(30_000);
    }
    Some(wait.min(30_000) / JOIN_DELAY_DIVISOR)
}

// -------------------------------------------------------------------------------------------
// §2: strings

/// A channel: "`"actor"`, `"telemetry"`, `"protocol:0"`, `"protocol:1"`, `"switch"` or
/// `"substrate"`". The declaration order is the document's: `actor` < `telemetry` <
/// `protocol:0` < `protocol:1` < `switch` < `substrate`, so a `BTreeMap` keyed by
/// (peer, channel) is in cache order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Channel {
    Actor,
    Telemetry,
    Protocol0,
    Protocol1,
    Switch,
    Substrate,
}

impl Channel {
    fn parse(text: &str) -> Result<Channel, String> {
        match text {
            "actor" => Ok(Channel::Actor),
            "telemetry" => Ok(Channel::Telemetry),
            "protocol:0" => Ok(Channel::Protocol0),
            "protocol:1" => Ok(Channel::Protocol1),
            "switch" => Ok(Channel::Switch),
            "substrate" => Ok(Channel::Substrate),
            other => Err(format!("unknown channel {other:?}")),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Channel::Actor => "actor",
            Channel::Telemetry => "telemetry",
            Channel::Protocol0 => "protocol:0",
            Channel::Protocol1 => "protocol:1",
            Channel::Switch => "switch",
            Channel::Substrate => "substrate",
        }
    }
}

/// A path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Actor,
    Join,
    Telemetry,
    Protocol,
    Switch,
    Substrate,
    Unknown,
}

impl Path {
    fn parse(text: &str) -> Result<Path, String> {
        match text {
            "actor" => Ok(Path::Actor),
            "join" => Ok(Path::Join),
            "telemetry" => Ok(Path::Telemetry),
            "protocol" => Ok(Path::Protocol),
            "switch" => Ok(Path::Switch),
            "substrate" => Ok(Path::Substrate),
            "unknown" => Ok(Path::Unknown),
            other => Err(format!("unknown path {other:?}")),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Path::Actor => "actor",
            Path::Join => "join",
            Path::Telemetry => "telemetry",
            Path::Protocol => "protocol",
            Path::Switch => "switch",
            Path::Substrate => "substrate",
            Path::Unknown => "unknown",
        }
    }
}

/// A direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Inbound,
    Outbound,
}

impl Direction {
    fn parse(text: &str) -> Result<Direction, String> {
        match text {
            "inbound" => Ok(Direction::Inbound),
            "outbound" => Ok(Direction::Outbound),
            other => Err(format!("unknown direction {other:?}")),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Direction::Inbound => "inbound",
            Direction::Outbound => "outbound",
        }
    }
}

/// What an ALPN dispatches to (§4 `accept`): the path, and for protocol bindings the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Alpn {
    Actor,
    Telemetry,
    Protocol(Channel),
    Switch,
    Substrate,
    Unknown,
}

impl Alpn {
    /// "`"a"` actor, `"t"` telemetry, `"p0"`/`"p1"` protocol, `"s"` switch, `"u"` substrate,
    /// anything else unknown."
    fn of(alpn: &str) -> Alpn {
        match alpn {
            "a" => Alpn::Actor,
            "t" => Alpn::Telemetry,
            "p0" => Alpn::Protocol(Channel::Protocol0),
            "p1" => Alpn::Protocol(Channel::Protocol1),
            "s" => Alpn::Switch,
            "u" => Alpn::Substrate,
            _ => Alpn::Unknown,
        }
    }

    fn path(self) -> Path {
        match self {
            Alpn::Actor => Path::Actor,
            Alpn::Telemetry => Path::Telemetry,
            Alpn::Protocol(_) => Path::Protocol,
            Alpn::Switch => Path::Switch,
            Alpn::Substrate => Path::Substrate,
            Alpn::Unknown => Path::Unknown,
        }
    }
}

// -------------------------------------------------------------------------------------------
// §3: state

/// A cache entry: a connection and its generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    conn: u64,
    generation: u64,
}

/// A dial of one peer (absent from the map: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dial {
    /// Attempt `attempt` in flight.
    InFlight { attempt: u32 },
    /// Attempt `attempt` due at `due`.
    Waiting { attempt: u32, due: u64 },
}

/// A join's phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Connecting(u32),
    Sending,
    Sent,
    Failed,
}

impl Phase {
    fn name(self) -> String {
        match self {
            Phase::Connecting(attempt) => format!("connecting:{attempt}"),
            Phase::Sending => "sending".to_string(),
            Phase::Sent => "sent".to_string(),
            Phase::Failed => "failed".to_string(),
        }
    }
}

/// A join's step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JoinStep {
    /// Attempt `attempt` in flight.
    InFlight { attempt: u32 },
    /// Attempt `attempt` waiting until `due`.
    Waiting { attempt: u32, due: u64 },
    /// Done.
    Done,
}

/// The join of one seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Join {
    phase: Phase,
    step: JoinStep,
}

/// A peer's writer (absent from the map: absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writer {
    Busy,
    IdleSince(u64),
}

/// Timer kinds, in the order `timeout` fires equal due times: "kinds order dial < join <
/// idle".
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum TimerKind {
    Dial,
    Join,
    Idle,
}

/// The machine.
#[derive(Debug, Clone)]
struct Machine {
    /// `None`: every peer admitted.
    allow: Option<Vec<u8>>,
    /// (peer, channel) → entry; iteration order is the document's cache order.
    cache: BTreeMap<(u8, Channel), Entry>,
    /// The last generation handed out (0: none yet).
    last_generation: u64,
    /// Dials by peer.
    dials: BTreeMap<u8, Dial>,
    /// Joins by seed.
    joins: BTreeMap<u8, Join>,
    /// Writers by peer.
    writers: BTreeMap<u8, Writer>,
    /// The `swim` of each known writer's last batch (absent: false).
    writer_swim: BTreeMap<u8, bool>,
    /// Whether `close` happened.
    closed: bool,
    /// Drops by reason.
    drops: BTreeMap<String, u64>,
    /// Refusals by `path/direction`.
    refusals: BTreeMap<String, u64>,
    /// The six counters.
    counters: DriverCounters,
    /// The actions queued during the current op, in order.
    actions: Vec<String>,
}

/// `*count += n`, or an error naming `what`.
fn add(count: &mut u64, n: u64, what: &str) -> Result<(), String> {
    match count.checked_add(n) {
        Some(sum) => {
            *count = sum;
            Ok(())
        }
        None => Err(format!("{what} would overflow u64")),
    }
}

/// `at + wait`, or an error: a due time past `u64::MAX` cannot be reported as a `timeout`.
fn due_at(at: u64, wait: u64) -> Result<u64, String> {
    at.checked_add(wait)
        .ok_or_else(|| format!("a timer due at {at} + {wait} ms would overflow u64"))
}

impl Machine {
    fn new(allow: Option<Vec<u8>>) -> Machine {
        Machine {
            allow,
            cache: BTreeMap::new(),
            last_generation: 0,
            dials: BTreeMap::new(),
            joins: BTreeMap::new(),
            writers: BTreeMap::new(),
            writer_swim: BTreeMap::new(),
            closed: false,
            drops: BTreeMap::new(),
            refusals: BTreeMap::new(),
            counters: DriverCounters::default(),
            actions: Vec::new(),
        }
    }

    // --- helpers named in §3 -----------------------------------------------------------------

    /// Adds `n` to drops `reason`.
    fn drop_frames(&mut self, reason: &str, n: u64) -> Result<(), String> {
        let count = self.drops.entry(reason.to_string()).or_insert(0);
        add(count, n, &format!("drops {reason}"))
    }

    /// "Admit *peer* on *path*, *direction*": if `allow` is not `null` and does not list the
    /// peer, count a refusal under `path/direction` and the check fails; otherwise it passes.
    fn admit(&mut self, peer: u8, path: Path, direction: Direction) -> Result<bool, String> {
        let admitted = match &self.allow {
            None => true,
            Some(list) => list.contains(&peer),
        };
        if !admitted {
            let key = format!("{}/{}", path.name(), direction.name());
            let count = self.refusals.entry(key.clone()).or_insert(0);
            add(count, 1, &format!("refusals {key}"))?;
        }
        Ok(admitted)
    }

    /// "**Dial** *peer*": if a dial of the peer is in flight or waiting, or the peer is not
    /// valid, nothing; otherwise `dials_started` += 1, the dial is in flight with attempt 1,
    /// and the action `dial:<peer>:1` is queued.
    fn dial(&mut self, peer: u8) -> Result<(), String> {
        if self.dials.contains_key(&peer) || !peer_is_valid(peer) {
            return Ok(());
        }
        add(&mut self.counters.dials_started, 1, "dials_started")?;
        self.dials.insert(peer, Dial::InFlight { attempt: 1 });
        self.actions.push(format!("dial:{peer}:1"));
        Ok(())
    }

    /// "**Cache** *conn* for *peer* on *channel*": insert it under the next generation; if
    /// the channel is `actor` and the peer has a writer (busy or idle), queue `kick:<peer>`.
    /// Caching on any other channel (`switch` and `substrate` included) queues nothing.
    /// Returns the generation.
    fn cache_insert(&mut self, conn: u64, peer: u8, channel: Channel) -> Result<u64, String> {
        let generation = self
            .last_generation
            .checked_add(1)
            .ok_or_else(|| "the generation counter would overflow u64".to_string())?;
        self.last_generation = generation;
        self.cache
            .insert((peer, channel), Entry { conn, generation });
        if channel == Channel::Actor && self.writers.contains_key(&peer) {
            self.actions.push(format!("kick:{peer}"));
        }
        Ok(generation)
    }

    // --- §4 ops ------------------------------------------------------------------------------

    /// `accept peer, alpn, conn`.
    fn accept(&mut self, peer: u8, alpn: &str, conn: u64) -> Result<Option<String>, String> {
        let alpn = Alpn::of(alpn);
        // 1. Admit on that path, inbound; if refused, result "refused" (nothing else).
        if !self.admit(peer, alpn.path(), Direction::Inbound)? {
            return Ok(Some("refused".to_string()));
        }
        // 2. If closed, result "no_adapter".
        if self.closed {
            return Ok(Some("no_adapter".to_string()));
        }
        // 3. accepted += 1. Then by path: actor, telemetry, protocol i, switch and substrate
        //    each cache on their channel and answer "<channel>:<generation>"; unknown answers
        //    "no_adapter".
        add(&mut self.counters.accepted, 1, "accepted")?;
        // Each result is the channel's name (channel.name() is "protocol:<i>" for a binding),
        // "switch" or "substrate" as the doc spells them, then the generation.
        let channel = match alpn {
            Alpn::Actor => Channel::Actor,
            Alpn::Telemetry => Channel::Telemetry,
            Alpn::Protocol(channel) => channel,
            Alpn::Switch => Channel::Switch,
            Alpn::Substrate => Channel::Substrate,
            Alpn::Unknown => return Ok(Some("no_adapter".to_string())),
        };
        let generation = self.cache_insert(conn, peer, channel)?;
        let result = format!("{}:{generation}", channel.name());
        Ok(Some(result))
    }

    /// `connected peer, channel, conn`: if closed, queue `close:<conn>:0`, result `null`.
    /// Otherwise cache it; result `"gen:<generation>"`.
    fn connected(
        &mut self,
        peer: u8,
        channel: Channel,
        conn: u64,
    ) -> Result<Option<String>, String> {
        if self.closed {
            self.actions.push(format!("close:{conn}:0"));
            return Ok(None);
        }
        let generation = self.cache_insert(conn, peer, channel)?;
        Ok(Some(format!("gen:{generation}")))
    }

    /// `closed peer, channel, generation`: if the cache entry of (peer, channel) has this
    /// generation it is removed; otherwise nothing.
    fn closed_conn(&mut self, peer: u8, channel: Channel, generation: u64) {
        let matches = match self.cache.get(&(peer, channel)) {
            Some(entry) => entry.generation == generation,
            None => false,
        };
        if matches {
            self.cache.remove(&(peer, channel));
        }
    }

    /// `disconnect peer, channel`: if (peer, channel) is cached, remove it and queue
    /// `close:<conn>:0`.
    fn disconnect(&mut self, peer: u8, channel: Channel) {
        if let Some(entry) = self.cache.remove(&(peer, channel)) {
            self.actions.push(format!("close:{}:0", entry.conn));
        }
    }

    /// `send peer`.
    fn send(&mut self, peer: u8) -> Result<Option<String>, String> {
        // 1. Admit on actor, outbound; if refused, drop unauthorized.
        if !self.admit(peer, Path::Actor, Direction::Outbound)? {
            self.drop_frames("unauthorized", 1)?;
            return Ok(Some("drop:unauthorized".to_string()));
        }
        // 2. If closed: drop cache_miss.
        if self.closed {
            self.drop_frames("cache_miss", 1)?;
            return Ok(Some("drop:cache_miss".to_string()));
        }
        // 3. If (peer, actor) is cached: enqueue.
        if self.cache.contains_key(&(peer, Channel::Actor)) {
            return Ok(Some("enqueue".to_string()));
        }
        // 4. If the peer is not valid: drop invalid_node_id.
        if !peer_is_valid(peer) {
            self.drop_frames("invalid_node_id", 1)?;
            return Ok(Some("drop:invalid_node_id".to_string()));
        }
        // 5. Dial the peer; drop cache_miss.
        self.dial(peer)?;
        self.drop_frames("cache_miss", 1)?;
        Ok(Some("drop:cache_miss".to_string()))
    }

    /// `batch peer, frames, swim, stream`.
    fn batch(
        &mut self,
        peer: u8,
        frames: u64,
        swim: bool,
        stream: Option<u64>,
    ) -> Result<Option<String>, String> {
        // Unless closed, the writer becomes busy (its idle timer, if any, is cancelled) and
        // remembers `swim`.
        if !self.closed {
            self.writers.insert(peer, Writer::Busy);
            self.writer_swim.insert(peer, swim);
        }
        if let Some(entry) = self.cache.get(&(peer, Channel::Actor)) {
            // On the open stream when it is on this generation; else a new one first.
            let kept = if stream == Some(entry.generation) {
                ":kept"
            } else {
                ""
            };
            return Ok(Some(format!(
                "write:{}:{}{kept}",
                entry.generation, entry.conn
            )));
        }
        // Otherwise add frames to drops cache_miss, dial the peer unless closed.
        self.drop_frames("cache_miss", frames)?;
        if !self.closed {
            self.dial(peer)?;
        }
        Ok(Some("drop".to_string()))
    }

    /// `write_failed peer, generation, frames, swim`.
    fn write_failed(
        &mut self,
        peer: u8,
        generation: u64,
        frames: u64,
        swim: bool,
    ) -> Result<(), String> {
        self.drop_frames("write_failed", frames)?;
        let current = match self.cache.get(&(peer, Channel::Actor)) {
            Some(entry) => entry.generation == generation,
            None => false,
        };
        if current {
            self.cache.remove(&(peer, Channel::Actor));
            add(&mut self.counters.evictions, 1, "evictions")?;
            if !self.closed {
                self.dial(peer)?;
            }
        } else {
            add(&mut self.counters.stale_failures, 1, "stale_failures")?;
        }
        if swim {
            self.actions.push(format!("send_failed:{peer}"));
        }
        Ok(())
    }

    /// `idle peer`: unless closed, the writer becomes idle since `at` (any earlier idle timer
    /// is replaced by one due at `at` + 1,000).
    fn idle(&mut self, peer: u8, at: u64) -> Result<(), String> {
        if self.closed {
            return Ok(());
        }
        // The timer's due time must be representable.
        due_at(at, IDLE_WRITER_TIMEOUT_MS)?;
        self.writers.insert(peer, Writer::IdleSince(at));
        Ok(())
    }

    /// `dialed peer, conn`.
    fn dialed(&mut self, peer: u8, conn: Option<u64>, at: u64) -> Result<Option<String>, String> {
        match conn {
            Some(conn) => {
                // If a dial of the peer is in flight, it ends.
                if let Some(Dial::InFlight { .. }) = self.dials.get(&peer) {
                    self.dials.remove(&peer);
                }
                // Then as connected on actor.
                self.connected(peer, Channel::Actor, conn)
            }
            None => {
                add(&mut self.counters.dial_failures, 1, "dial_failures")?;
                if let Some(Dial::InFlight { attempt }) = self.dials.get(&peer).copied() {
                    // If the schedule allows another attempt and the machine is not closed,
                    // the dial waits for attempt k+1 at `at` + the wait; otherwise it ends.
                    let another = if attempt < DIAL_ATTEMPTS {
                        dial_wait_after(attempt)
                    } else {
                        None
                    };
                    match another {
                        Some(wait) if !self.closed => {
                            let due = due_at(at, wait)?;
                            let next = attempt
                                .checked_add(1)
                                .ok_or_else(|| "dial attempt overflow".to_string())?;
                            self.dials
                                .insert(peer, Dial::Waiting { attempt: next, due });
                        }
                        _ => {
                            self.dials.remove(&peer);
                        }
                    }
                }
                Ok(None)
            }
        }
    }

    /// `join peer, relay, direct`.
    fn join(&mut self, peer: u8) -> Result<Option<String>, String> {
        // 1. Admit on join, outbound; if refused, result "refused".
        if !self.admit(peer, Path::Join, Direction::Outbound)? {
            return Ok(Some("refused".to_string()));
        }
        // 2. If closed, or a join of this seed is not done: "ok", nothing changes.
        let not_done = match self.joins.get(&peer) {
            Some(join) => join.step != JoinStep::Done,
            None => false,
        };
        if self.closed || not_done {
            return Ok(Some("ok".to_string()));
        }
        // 3. A new join: phase connecting:1, attempt 1 in flight, queue join:<peer>:1.
        self.joins.insert(
            peer,
            Join {
                phase: Phase::Connecting(1),
                step: JoinStep::InFlight { attempt: 1 },
            },
        );
        self.actions.push(format!("join:{peer}:1"));
        Ok(Some("ok".to_string()))
    }

    /// `join_connected peer`: if attempt k of the seed's join is in flight and the phase is
    /// `connecting:*`, the phase becomes `sending`.
    fn join_connected(&mut self, peer: u8) {
        if let Some(join) = self.joins.get_mut(&peer) {
            let in_flight = matches!(join.step, JoinStep::InFlight { .. });
            let connecting = matches!(join.phase, Phase::Connecting(_));
            if in_flight && connecting {
                join.phase = Phase::Sending;
            }
        }
    }

    /// `join_sent peer, conn`: if an attempt of the seed's join is in flight, the phase
    /// becomes `sending` if it was connecting, then `sent`, and the join is done. In every
    /// case the connection is then handled as `connected` on `actor`.
    fn join_sent(&mut self, peer: u8, conn: u64) -> Result<Option<String>, String> {
        if let Some(join) = self.joins.get_mut(&peer) {
            if let JoinStep::InFlight { .. } = join.step {
                if let Phase::Connecting(_) = join.phase {
                    join.phase = Phase::Sending;
                }
                join.phase = Phase::Sent;
                join.step = JoinStep::Done;
            }
        }
        self.connected(peer, Channel::Actor, conn)
    }

    /// `join_failed peer`: if attempt k of the seed's join is in flight and the phase is not
    /// `sent` or `failed`: if the schedule allows attempt k+1, the phase becomes
    /// `connecting:<k+1>` and the attempt waits until `at` + the wait; otherwise the phase
    /// becomes `failed` and the join is done.
    fn join_failed(&mut self, peer: u8, at: u64) -> Result<(), String> {
        let Some(join) = self.joins.get(&peer).copied() else {
            return Ok(());
        };
        let JoinStep::InFlight { attempt } = join.step else {
            return Ok(());
        };
        if matches!(join.phase, Phase::Sent | Phase::Failed) {
            return Ok(());
        }
        let updated = match join_wait_after(attempt) {
            Some(wait) => {
                let due = due_at(at, wait)?;
                let next = attempt
                    .checked_add(1)
                    .ok_or_else(|| "join attempt overflow".to_string())?;
                Join {
                    phase: Phase::Connecting(next),
                    step: JoinStep::Waiting { attempt: next, due },
                }
            }
            None => Join {
                phase: Phase::Failed,
                step: JoinStep::Done,
            },
        };
        self.joins.insert(peer, updated);
        Ok(())
    }

    /// `fault peer, fatal, channel`: on `actor`, drop `malformed_stream` and result
    /// `"stop:1"` when `fatal`, else `"continue"`; on any other channel, `"stop:1"` and no
    /// drop.
    fn fault(&mut self, fatal: bool, channel: Channel) -> Result<Option<String>, String> {
        if channel != Channel::Actor {
            return Ok(Some("stop:1".to_string()));
        }
        self.drop_frames("malformed_stream", 1)?;
        Ok(Some(if fatal { "stop:1" } else { "continue" }.to_string()))
    }

    /// Every pending timer as (due, kind, peer). Idle since t is due at t + 1,000.
    fn timers(&self) -> Result<Vec<(u64, TimerKind, u8)>, String> {
        let mut timers = Vec::new();
        for (&peer, dial) in &self.dials {
            if let Dial::Waiting { due, .. } = *dial {
                timers.push((due, TimerKind::Dial, peer));
            }
        }
        for (&seed, join) in &self.joins {
            if let JoinStep::Waiting { due, .. } = join.step {
                timers.push((due, TimerKind::Join, seed));
            }
        }
        for (&peer, writer) in &self.writers {
            if let Writer::IdleSince(since) = *writer {
                timers.push((
                    due_at(since, IDLE_WRITER_TIMEOUT_MS)?,
                    TimerKind::Idle,
                    peer,
                ));
            }
        }
        timers.sort();
        Ok(timers)
    }

    /// `timeout`: every timer due at or before `at` fires, in order of (due time, kind, peer).
    fn timeout(&mut self, at: u64) -> Result<(), String> {
        // Firing a timer never starts another, so the due set is fixed up front.
        let due: Vec<(u64, TimerKind, u8)> = self
            .timers()?
            .into_iter()
            .filter(|&(time, _, _)| time <= at)
            .collect();
        for (_, kind, peer) in due {
            match kind {
                TimerKind::Dial => {
                    // A waiting dial with attempt k becomes in flight: queue dial:<peer>:<k>.
                    if let Some(Dial::Waiting { attempt, .. }) = self.dials.get(&peer).copied() {
                        self.dials.insert(peer, Dial::InFlight { attempt });
                        self.actions.push(format!("dial:{peer}:{attempt}"));
                    }
                }
                TimerKind::Join => {
                    // A waiting join attempt k becomes in flight: queue join:<peer>:<k>.
                    if let Some(join) = self.joins.get_mut(&peer) {
                        if let JoinStep::Waiting { attempt, .. } = join.step {
                            join.step = JoinStep::InFlight { attempt };
                            self.actions.push(format!("join:{peer}:{attempt}"));
                        }
                    }
                }
                TimerKind::Idle => {
                    // An idle writer is removed, writers_retired += 1, queue retire:<peer>.
                    if let Some(Writer::IdleSince(_)) = self.writers.get(&peer) {
                        self.writers.remove(&peer);
                        self.writer_swim.remove(&peer);
                        add(&mut self.counters.writers_retired, 1, "writers_retired")?;
                        self.actions.push(format!("retire:{peer}"));
                    }
                }
            }
        }
        Ok(())
    }

    /// `close`: closed; every timer is cancelled; every dial ends; every cache entry is
    /// removed, queuing `close:<conn>:0` in cache order; every join is done (phases
    /// unchanged); every writer is forgotten.
    fn close(&mut self) {
        self.closed = true;
        // Timers live in the dials, joins and writers below; ending those cancels them.
        self.dials.clear();
        let entries: Vec<Entry> = self.cache.values().copied().collect();
        self.cache.clear();
        for entry in entries {
            self.actions.push(format!("close:{}:0", entry.conn));
        }
        for join in self.joins.values_mut() {
            join.step = JoinStep::Done;
        }
        self.writers.clear();
        self.writer_swim.clear();
    }

    /// Applies one op; returns its step.
    fn apply(&mut self, op: &DriverOp) -> Result<DriverStep, String> {
        self.actions.clear();
        let result = match op {
            DriverOp::Accept {
                peer, alpn, conn, ..
            } => self.accept(*peer, alpn, *conn)?,
            DriverOp::Connected {
                peer,
                channel,
                conn,
                ..
            } => {
                let channel = Channel::parse(channel)?;
                self.connected(*peer, channel, *conn)?
            }
            DriverOp::Closed {
                peer,
                channel,
                generation,
                ..
            } => {
                let channel = Channel::parse(channel)?;
                self.closed_conn(*peer, channel, *generation);
                None
            }
            DriverOp::Disconnect { peer, channel, .. } => {
                let channel = Channel::parse(channel)?;
                self.disconnect(*peer, channel);
                None
            }
            DriverOp::Admit {
                peer,
                path,
                direction,
                ..
            } => {
                let path = Path::parse(path)?;
                let direction = Direction::parse(direction)?;
                let admitted = self.admit(*peer, path, direction)?;
                Some(if admitted { "ok" } else { "refused" }.to_string())
            }
            DriverOp::Send { peer, .. } => self.send(*peer)?,
            DriverOp::Open {
                peer,
                path,
                channel,
                ..
            } => {
                // Admit on `path`, outbound; then the cache says where the stream goes.
                let path = Path::parse(path)?;
                let channel = Channel::parse(channel)?;
                Some(if !self.admit(*peer, path, Direction::Outbound)? {
                    "refused".to_string()
                } else if let Some(entry) = self.cache.get(&(*peer, channel)) {
                    format!("cached:{}:{}", entry.generation, entry.conn)
                } else {
                    "dial".to_string()
                })
            }
            DriverOp::OpenFailed {
                peer,
                channel,
                generation,
                ..
            } => {
                // As closed; the stream then goes on a fresh connection.
                let channel = Channel::parse(channel)?;
                self.closed_conn(*peer, channel, *generation);
                Some("dial".to_string())
            }
            DriverOp::Batch {
                peer,
                frames,
                swim,
                stream,
                ..
            } => self.batch(*peer, *frames, *swim, *stream)?,
            DriverOp::Stopped {
                peer, generation, ..
            } => {
                // As write_failed with no frames and the writer's remembered swim.
                let swim = self.writers.contains_key(peer)
                    && self.writer_swim.get(peer).copied().unwrap_or(false);
                self.write_failed(*peer, *generation, 0, swim)?;
                None
            }
            DriverOp::WriteFailed {
                peer,
                generation,
                frames,
                swim,
                ..
            } => {
                self.write_failed(*peer, *generation, *frames, *swim)?;
                None
            }
            DriverOp::Idle { at, peer } => {
                self.idle(*peer, *at)?;
                None
            }
            DriverOp::Dialed { at, peer, conn } => self.dialed(*peer, *conn, *at)?,
            // `relay` and `direct` are hints the machine records but no observation shows.
            DriverOp::Join { peer, .. } => self.join(*peer)?,
            DriverOp::JoinConnected { peer, .. } => {
                self.join_connected(*peer);
                None
            }
            DriverOp::JoinSent { peer, conn, .. } => self.join_sent(*peer, *conn)?,
            DriverOp::JoinFailed { at, peer } => {
                self.join_failed(*peer, *at)?;
                None
            }
            DriverOp::Fault { fatal, channel, .. } => {
                let channel = Channel::parse(channel.as_deref().unwrap_or("actor"))?;
                self.fault(*fatal, channel)?
            }
            DriverOp::Unread { channel, .. } => {
                // Any channel: the peer is told to stop sending; nothing else changes.
                Channel::parse(channel)?;
                Some("stop:2".to_string())
            }
            DriverOp::Timeout { at } => {
                self.timeout(*at)?;
                None
            }
            DriverOp::Close { .. } => {
                self.close();
                None
            }
        };
        // "when the machine next wants a `timeout` op after this op": the earliest due time.
        let timeout = self.timers()?.first().map(|&(due, _, _)| due);
        Ok(DriverStep {
            result,
            actions: std::mem::take(&mut self.actions),
            timeout,
        })
    }

    /// The `end` record.
    fn end(&self) -> DriverEnd {
        DriverEnd {
            drops: self
                .drops
                .iter()
                .filter(|(_, &count)| count > 0)
                .map(|(reason, &count)| (reason.clone(), count))
                .collect(),
            refusals: self
                .refusals
                .iter()
                .filter(|(_, &count)| count > 0)
                .map(|(key, &count)| (key.clone(), count))
                .collect(),
            counters: self.counters.clone(),
            cache: self
                .cache
                .iter()
                .map(|(&(peer, channel), entry)| {
                    (peer, channel.name().to_string(), entry.generation)
                })
                .collect(),
            joins: self
                .joins
                .iter()
                .map(|(seed, join)| (seed.to_string(), join.phase.name()))
                .collect(),
        }
    }
}

/// Runs one driver case on a fresh model: applies `case.ops` in order and returns the case
/// with `steps` and `end` replaced by the model's observations. The case's own steps and end
/// are ignored except that there must be one step per op. Inputs the document does not define
/// (see the module doc) are an `Err`.
pub fn run_case(case: &DriverCase) -> Result<DriverCase, String> {
    if case.steps.len() != case.ops.len() {
        return Err(format!(
            "the case has {} ops but {} steps (one step per op)",
            case.ops.len(),
            case.steps.len()
        ));
    }
    let mut machine = Machine::new(case.allow.clone());
    let mut steps = Vec::with_capacity(case.ops.len());
    let mut previous_at: Option<u64> = None;
    for (index, op) in case.ops.iter().enumerate() {
        let at = op.at();
        if let Some(previous) = previous_at {
            if at < previous {
                return Err(format!(
                    "op {index}: at {at} is before the previous op's at {previous}"
                ));
            }
        }
        previous_at = Some(at);
        let step = machine.apply(op).map_err(|e| format!("op {index}: {e}"))?;
        steps.push(step);
    }
    Ok(DriverCase {
        allow: case.allow.clone(),
        ops: case.ops.clone(),
        steps,
        end: machine.end(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Parses `case` (expected steps and end written by hand from the document), runs the
    /// model, and reports the first divergence.
    fn check(case: serde_json::Value) {
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

    /// accept on every ALPN with no allow-list; a second actor accept replaces the entry;
    /// accept does not check validity (peer 251 is cached).
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
                step(json!("actor:7"), &[], N),
                step(json!("actor:8"), &[], N),
                step(json!("no_adapter"), &[], N)
            ],
            "end": {
                "drops": {},
                "refusals": {},
                "counters": counters(10, 0, 0, 0, 0, 0),
                "cache": [[1, "actor", 7], [1, "telemetry", 2], [2, "protocol:0", 3],
                          [2, "protocol:1", 4], [3, "switch", 5], [3, "substrate", 6],
                          [251, "actor", 8]],
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
                step(json!("gen:2"), &["kick:1"], N),
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

    /// open: refused off the list (counted), dial with no connection, the cached one on its
    /// channel; open_failed evicts that generation only, then dial.
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
                step(json!("dial"), &[], N),
                step(json!("gen:1"), &[], N),
                step(json!("cached:1:10"), &[], N),
                step(json!("dial"), &[], N),
                step(json!("gen:2"), &[], N),
                step(json!("dial"), &[], N),
                step(json!("cached:2:11"), &[], N),
                step(json!("dial"), &[], N),
                step(json!("dial"), &[], N)
            ],
            "end": {
                "drops": {},
                "refusals": {"protocol/outbound": 1},
                "counters": counters(0, 0, 0, 0, 0, 0),
                "cache": [],
                "joins": {}
            }
        }));
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
                step(json!("gen:2"), &["kick:3"], json!(1007)),
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
                step(json!("switch:4"), &[], json!(1000)),
                step(N, &[], json!(1000)),
                step(json!("cached:4:13"), &[], json!(1000)),
                step(N, &[], json!(1000)),
                step(N, &[], json!(1000)),
                step(json!("dial"), &[], json!(1000)),
                step(json!("gen:5"), &[], json!(1000)),
                step(json!("stop:1"), &[], json!(1000)),
                step(json!("stop:2"), &[], json!(1000)),
                step(json!("dial"), &[], json!(1000)),
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
                "joins": {}
            }
        }));
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

    /// A case whose JSON is otherwise well formed, with the given ops and one dummy step each.
    fn case_with(ops: serde_json::Value) -> DriverCase {
        let count = ops.as_array().map_or(0, Vec::len);
        let steps: Vec<serde_json::Value> = (0..count).map(|_| step(N, &[], N)).collect();
        serde_json::from_value(json!({
            "allow": null,
            "ops": ops,
            "steps": steps,
            "end": {"drops": {}, "refusals": {}, "counters": counters(0, 0, 0, 0, 0, 0),
                    "cache": [], "joins": {}}
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
            {"op": "timeout", "at": u64::MAX}
        ]));
        let got = run_case(&fine).expect("well formed");
        assert_eq!(got.steps[0].result.as_deref(), Some("no_adapter"));
        assert_eq!(got.steps[2].timeout, Some(u64::MAX));
        assert_eq!(got.steps[3].actions, vec!["retire:1".to_string()]);
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
        for _ in 0..500 {
            let peers = [0u8, 1, 2, 249, 250, 255];
            let mut at: u64 = 0;
            let mut ops = Vec::new();
            for _ in 0..next(40) {
                at += next(3) * next(3_000);
                let peer = peers[next(6) as usize];
                let op = match next(17) {
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
                                "generation": next(6), "frames": next(4), "swim": next(2) == 0}),
                    8 => json!({"op": "idle", "at": at, "peer": peer}),
                    9 => json!({"op": "dialed", "at": at, "peer": peer,
                                "conn": if next(2) == 0 { json!(null) } else { json!(next(5)) }}),
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
                    14 => json!({"op": "open_failed", "at": at, "peer": peer,
                                 "channel": channels[next(6) as usize], "generation": next(4)}),
                    15 => json!({"op": "timeout", "at": at}),
                    _ => json!({"op": "close", "at": at}),
                };
                ops.push(op);
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
        }
        // Extreme values: errors are fine, panics are not.
        let extreme = case_with(json!([
            {"op": "batch", "at": u64::MAX, "peer": 255, "frames": u64::MAX},
            {"op": "write_failed", "at": u64::MAX, "peer": 255, "generation": u64::MAX,
             "frames": u64::MAX, "swim": true},
            {"op": "timeout", "at": u64::MAX}
        ]));
        let _ = run_case(&extreme);
    }
}
