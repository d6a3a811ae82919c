//! The reference model of the driver machine (the `driver` section, docs/spec/driver.md), written
//! from `docs/conformance/driver.md` alone. It shares no code with `tether-core` and was written
//! without reading core's driver: if the two disagree, one of them misreads the document.
//!
//! Plain data (`BTreeMap`s keyed the way the document orders things), one function per op,
//! every rule in the document's words next to the code that does it. Nothing here panics: every
//! sum is checked, and an input the document does not define is an `Err`:
//!
//! - an unknown channel, path or direction string (an unknown ALPN is not malformed: it is the
//!   `unknown` path);
//! - a `control` payload that is not lowercase hex (odd length, or a character other than
//!   `0`–`9`, `a`–`f`), or an `ended` flow that is not exactly 32 lowercase hex digits: the
//!   document writes both "in lowercase hex", so an uppercase digit is malformed too (a payload
//!   that *is* hex but does not decode as a control record is not malformed input: it is the
//!   `malformed` verdict);
//! - a relay string (any entry of `relays_seen`'s `relays` or of `relays_for`'s `given`) that
//!   is not "a non-empty string of at most 64 characters from `a`–`z`, `0`–`9`, `:`, `/`,
//!   `.`, `-`": empty, longer than 64 characters, or with any other character (an uppercase
//!   letter, a space, `_`, a non-ASCII character); checked before the op changes anything;
//! - an `at` smaller than the previous op's;
//! - a generation, a ticket or a publisher number past `u64::MAX`, a timer due past
//!   `u64::MAX` ms, a relay-hint record count past `u64::MAX`, or a drop, refusal, control
//!   verdict, waiters count or counter past `u64::MAX` (none is representable in a script);
//! - `steps` not one per op.
//!
//! Readings chosen where the document leaves room:
//!
//! - A step's `timeout` is the earliest due time of all pending timers, even when that time is
//!   already past (`at` moved on without a `timeout` op): the document says "when the machine
//!   next wants a `timeout` op", and a timer due in the past is still wanted.
//! - Adding 0 frames to a drop reason leaves it absent from `end.drops` ("every reason with a
//!   count above 0"); `egress_full` with `frames` 0 likewise.
//! - `register` step 3 ("4,096 claims are held") cannot happen: an actor is 0–255, so at most
//!   256 claims are ever held. The model keeps the rule anyway, as written.
//! - `close` leaves claims, streams and subscriptions alone (its rule does not name them);
//!   `register`, `stream`, `control` and `ended` behave the same before and after `close` (none
//!   of their rules mentions it; after `close` no `actor` connection is cached, so `register`
//!   announces to nobody).
//! - `end.subscriptions` sorts streams and flows as strings, byte by byte (for the flow's
//!   lowercase hex that is also the order of its bytes). It lists the live subscriptions
//!   only, without their publisher numbers (its shape is `[collector, stream, flow]`).
//! - The publisher counter is one for the whole machine: every `started` subscription takes
//!   the next number (the first is 1), whatever its collector, stream or flow; the other
//!   verdicts (`full` and `ignored` included) take none. `close` does not reset it (its rule
//!   does not name it), so a subscription started after `close` takes the next number too.
//! - `ended peer, name, flow, publisher` compares `publisher` as a number with the number the
//!   live (peer, name, flow) subscription was started with. Any other number is the
//!   "otherwise nothing changes" branch, not an error: 0 or any number never issued, the
//!   number of an earlier subscription of the same (peer, name, flow) (stopped by an
//!   unsubscribe, or ended, before it started again), or the number of another live
//!   subscription; so is an `ended` of a (peer, name, flow) that is not live at all. It
//!   counts nothing and queues nothing, before or after `close`.
//! - A refused `open` counts its refusal, answers `refused` and changes nothing else: it is
//!   not a waiter, orders no dial and takes no ticket. Admission comes before the verdict
//!   (and so before the verdict's closed check): after `close` an `open` from a peer off
//!   the allow-list still answers `refused` and counts the refusal; an admitted one answers
//!   `closed`. `open_waited` and `open_failed` have no admission at all (the document says
//!   so for both), so they never count a refusal, also when they fall back to the verdict.
//! - "The first dial an open orders gets ticket 1": a dial ordered by the verdict given to
//!   `open_failed` or to `open_waited`'s fallback is an open's dial too and takes the next
//!   ticket from the same counter. `open` does not check the peer's validity (its rule does
//!   not say so), so an invalid peer's pair is opening like any other.
//! - The opener that orders a dial is not one of its waiters ("0 waiters"); only a `wait`
//!   verdict (of `open`, of `open_failed`, or of `open_waited`'s fallback) adds one.
//!   `open_waited` of a dial still in flight ("nothing changes") does not add another: that
//!   open was counted when it was first told to wait.
//! - `open_waited`'s fallback "the verdict of `open`" is the whole verdict, with its effects:
//!   a pair opening under another ticket counts one more waiter and answers that ticket's
//!   `wait:`, a pair neither cached nor opening becomes opening with the next ticket (so the
//!   first waiter of an abandoned dial, or of an evicted or replaced failed-opens entry,
//!   dials, and the ones after it wait for that dial). A ticket never issued (0 included) or
//!   long gone is not malformed input: it just matches nothing and falls back the same way.
//! - `open_waited` looks, in order, at closed, the cache, failed opens (this ticket), opening
//!   (this ticket), then falls back to the verdict, as written. A cached pair answers
//!   `cached:` whatever the ticket (stale, never issued, another dial's), after forgetting a
//!   waiter of that ticket (which does nothing when the ticket matches neither the pair's
//!   opening nor its failed-opens entry). So a pair cached by an `accept` while its dial is
//!   still in flight stays opening (only `connected` ends the dial), and each waiter that
//!   asks again takes one off its waiters. The failed-opens check comes before the opening
//!   check: a waiter of a failed dial hears `failed` even when a later `open` has meanwhile
//!   put the pair back into opening under a new ticket. Conversely the verdict never looks
//!   at failed opens: a fresh `open` of a pair with a failed-opens entry dials (or waits) and
//!   the entry stays for its own waiters.
//! - "**Forget a waiter**" is one rule for `open_waited` (cached and failed branches) and
//!   `open_wait_abandoned`: the opening with that ticket first, else the failed-opens entry
//!   with that ticket, else nothing; "not below 0" is a floor at 0, not an error. An opening
//!   pair stays opening at 0 waiters (its dial is still in flight, and a later failure of it
//!   then keeps no entry: "waiters are more than 0"); only a failed-opens entry "goes at 0".
//!   The opening's ticket and the failed entry's are never equal (a failed entry's dial has
//!   left opening, and a new dial takes a new ticket), so at most one of them can match.
//! - `open_wait_abandoned` has no admission and no closed check (its rule names neither;
//!   after `close` opening and failed opens are empty, so it finds nothing). Its ticket is
//!   compared as a number; a stale, future or never-issued ticket (0 included) is the
//!   "otherwise nothing" branch, not an error. Result `null`, no action.
//! - `open_dial_failed`'s "the entry with the smallest ticket goes" is taken over all entries
//!   after the insert, the new one included: when an older dial fails after newer ones, the
//!   new entry itself is the oldest ticket and is the one dropped. Tickets come from one
//!   counter and each dial has its own, so the smallest is unique. An entry replaced for its
//!   pair, or dropped by the cap, is simply gone: its remaining waiters fall to the verdict.
//!   A failed dial with 0 waiters, a failed dial of a pair that is cached (an `accept` came
//!   while it was in flight), and an abandoned dial (any waiters) only leave opening. "Not
//!   cached" is looked at after the dial left opening; a cached pair's old failed-opens entry
//!   cannot exist (caching removed it), so nothing else changes.
//! - `open_dial_failed` counts nothing (`dial_failures` belongs to `dialed`), and its result
//!   is `null` also when nothing changes; its `ticket` is compared as a number, a mismatch
//!   (stale, future or never issued) is the "nothing changes" branch, not an error.
//! - `connected` takes the pair out of opening before its closed check (the rule states it
//!   before "If closed"); failed opens are left to the Cache step, which clears the pair on
//!   every insert (after `close` nothing is cached, and failed opens are empty anyway). After
//!   `close` nothing can put a pair back into either (every verdict then answers `closed`).
//!   `open_failed` after `close` does its `closed` part (nothing is cached then) and answers
//!   `closed`.
//! - The Cache step's "(peer, channel) leaves failed opens" is the same for every insert:
//!   `accept` on a caching path (actor, telemetry, protocol, switch, substrate; not an
//!   unknown ALPN, nor a refused or closed `accept`), `connected`, `dialed` connected and
//!   `join_sent`. "Its waiters take this connection" is explanation: nothing counts them;
//!   when they ask again they hear `cached:` and forget nothing (their ticket matches no
//!   entry any more). The Cache step does not touch opening.
//! - Only `connected` (and `dialed` connected / `join_sent`, handled as `connected` on
//!   `actor`), `open_dial_failed` and `close` take pairs out of opening; only a cache insert,
//!   forgetting the last waiter (`open_waited` or `open_wait_abandoned`), a replacement or the
//!   cap in `open_dial_failed`, and `close` take them out of failed opens: a `closed`,
//!   `disconnect`, `unresponsive` or failed `dialed` does neither. `close` does not reset the
//!   ticket counter (its rule does not name it, and no ticket is handed out after it).
//! - A generation named by an op (`closed`, `open_failed`, `write_failed`, `stopped`,
//!   `unresponsive`) is compared as a number with the cached entry's: the document says such a
//!   generation "is ≥ 1 and may be one never issued", and since generations start at 1, a 0
//!   is read as one more generation never issued. It matches no entry (the "otherwise" branch
//!   of each rule), it is not an error.
//! - `unresponsive` does exactly what its rule lists: the entry goes, `evictions` += 1 and
//!   `close:<conn>:408` is queued with the entry's connection; nothing else. On any channel,
//!   `actor` included, it dials nobody (unlike `write_failed`, its rule does not say to dial),
//!   kicks no writer and leaves writers, opening and failed opens alone. A generation that
//!   does not match (a newer connection, another channel's, none cached) counts nothing
//!   (`stale_failures` belongs to `write_failed` and `stopped`). It does not look at closed:
//!   after `close` nothing is cached, so it always does nothing then. Result `null`.
//! - `relays_seen` and `relays_for` do exactly what their rules list: no admission (no
//!   refusal is counted, also for a peer off the allow-list), no look at closed, no validity
//!   check of the peer (a peer ≥ 250 has a hint like any other), no action, no timer.
//!   `close` leaves the relay hints alone (its rule does not name them), so hints recorded
//!   before it are still returned, and `relays_seen` still records after it.
//! - A hint is the list as seen, in its order and with any repeats (`["r", "r"]` is a hint of
//!   two relays, answered `"r,r"`): the document defines no normalising. Re-recording a peer
//!   with the very same relays still makes it the newest.
//! - "The peer recorded longest ago" is by the last record of each peer: every non-empty
//!   `relays_seen` stamps its peer with the next number of one counter, and the smallest stamp
//!   goes. `relays_for` records nothing, so asking for a peer's hint does not make it newer.
//!   A record adds at most one peer, so at most one peer loses its hint; re-recording a peer
//!   that has a hint never forgets anyone. An empty `relays_seen` neither records nor evicts.
//! - `relays_for` always answers a string: the joined relays, or `""` when `given` is empty
//!   and the peer has no hint (never `null`).
//! - "At most 64 characters" counts characters; every allowed character is ASCII, so for a
//!   valid relay that is also its length in bytes.

use std::collections::{BTreeMap, BTreeSet};

use crate::script::{hex, DriverCase, DriverCounters, DriverEnd, DriverOp, DriverStep};

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
/// "failed opens kept 2".
const FAILED_OPENS_KEPT: usize = 2;
/// "relay hints kept 3 peers".
const RELAY_HINTS_KEPT: usize = 3;

/// §1: "at most 6 connections peers dialed are cached".
const INBOUND_CONNECTIONS_MAX: usize = 6;

/// §1: "claims announced per batch: 2".
const ANNOUNCE_BATCH: usize = 2;

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

/// A control verdict: "`"started"`, `"stopped"`, `"ignored"`, `"unknown_stream"`, `"full"`,
/// `"malformed"`".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Started,
    Stopped,
    Ignored,
    UnknownStream,
    Full,
    Malformed,
}

impl Verdict {
    fn name(self) -> &'static str {
        match self {
            Verdict::Started => "started",
            Verdict::Stopped => "stopped",
            Verdict::Ignored => "ignored",
            Verdict::UnknownStream => "unknown_stream",
            Verdict::Full => "full",
            Verdict::Malformed => "malformed",
        }
    }
}

/// A relay: "a non-empty string of at most 64 characters".
const RELAY_MAX_CHARS: usize = 64;

/// §2: "A **relay** is a non-empty string of at most 64 characters from `a`–`z`, `0`–`9`,
/// `:`, `/`, `.`, `-` (a URL-like name; any other string is malformed input)." Anything else
/// is an `Err` naming `what`.
fn check_relay(text: &str, what: &str) -> Result<(), String> {
    if text.is_empty() {
        return Err(format!("{what}: a relay is a non-empty string, not \"\""));
    }
    let chars = text.chars().count();
    if chars > RELAY_MAX_CHARS {
        return Err(format!(
            "{what}: relay {text:?} has {chars} characters, more than {RELAY_MAX_CHARS}"
        ));
    }
    let allowed = |c: char| {
        c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, ':' | '/' | '.' | '-')
    };
    if let Some(bad) = text.chars().find(|&c| !allowed(c)) {
        return Err(format!(
            "{what}: relay {text:?} has {bad:?}, not one of a-z, 0-9, ':', '/', '.', '-'"
        ));
    }
    Ok(())
}

/// Every string of a list of relays (`relays_seen`'s `relays`, `relays_for`'s `given`) must be
/// a relay; an empty list is fine.
fn check_relays(relays: &[String], what: &str) -> Result<(), String> {
    relays.iter().try_for_each(|relay| check_relay(relay, what))
}

// -------------------------------------------------------------------------------------------
// Claims, streams and control records (§2, §4 `register`, `control`, `ended`)

/// "A **flow** is 16 bytes written as 32 lowercase hex digits."
const FLOW_BYTES: usize = 16;
/// `register` 3: "If no claim for the actor is held and 4,096 claims are held".
const CLAIMS_MAX: usize = 4_096;

/// `register` 4: a generation past 2^48, or more than 2^20 past the one held.
fn jumps(held: Option<u64>, generation: u64) -> bool {
    generation > 1 << 48
        || held.is_some_and(|held| generation > held && generation - held > 1 << 20)
}
/// `control` 3: "else if 256 subscriptions are live, or 32 of this peer's, `full`".
const SUBSCRIPTIONS_MAX: usize = 256;
/// `control` 3: a peer's share of [`SUBSCRIPTIONS_MAX`].
const SUBSCRIPTIONS_PER_PEER_MAX: usize = 32;
/// `control` 2: "*n* = 0 or *n* > 128 ... the verdict is `malformed`".
const NAME_MAX: usize = 128;
/// `control` 2: "an op other than 1 (subscribe) and 2 (unsubscribe)".
const CONTROL_SUBSCRIBE: u8 = 1;
/// See [`CONTROL_SUBSCRIBE`].
const CONTROL_UNSUBSCRIBE: u8 = 2;

/// One lowercase hex digit's value.
fn hex_digit(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        _ => None,
    }
}

/// Bytes "in lowercase hex" (the `control` payload, the `ended` flow) → the bytes. Anything
/// else (odd length, another character, an uppercase digit) is malformed input: an `Err`.
fn parse_hex(text: &str, what: &str) -> Result<Vec<u8>, String> {
    let pairs = text.as_bytes().chunks_exact(2);
    if !pairs.remainder().is_empty() {
        return Err(format!(
            "{what} {text:?} is not lowercase hex (an odd number of digits)"
        ));
    }
    pairs
        .map(|pair| {
            let high = pair.first().copied().and_then(hex_digit);
            let low = pair.get(1).copied().and_then(hex_digit);
            match (high, low) {
                (Some(high), Some(low)) => Ok((high << 4) | low),
                _ => Err(format!(
                    "{what} {text:?} is not lowercase hex (digits 0-9 and a-f)"
                )),
            }
        })
        .collect()
}

/// A flow named by an op: "16 bytes written as 32 lowercase hex digits", else an `Err`.
/// Returns the flow as written (lowercase hex is canonical, so it compares as the bytes do).
fn parse_flow(text: &str) -> Result<String, String> {
    let bytes = parse_hex(text, "flow")?;
    if bytes.len() != FLOW_BYTES {
        return Err(format!(
            "flow {text:?} is {} bytes, not {FLOW_BYTES} (32 lowercase hex digits)",
            bytes.len()
        ));
    }
    Ok(hex(&bytes))
}

/// A decoded control record (`control` 2).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Control {
    /// Op 1: subscribe `flow` (lowercase hex) to the stream `name`.
    Subscribe { flow: String, name: String },
    /// Op 2: unsubscribe.
    Unsubscribe { flow: String, name: String },
}

/// `control` 2: "Decode the payload: op (1 byte), flow (16 bytes), name length *n* (1 byte),
/// then exactly *n* bytes of name. Fewer bytes than these fields, or more; *n* = 0 or
/// *n* > 128; a name that is not UTF-8; or an op other than 1 (subscribe) and 2
/// (unsubscribe): the verdict is `malformed`." `None`: malformed.
fn decode_control(bytes: &[u8]) -> Option<Control> {
    // op (1 byte)
    let (&op, rest) = bytes.split_first()?;
    // flow (16 bytes)
    if rest.len() < FLOW_BYTES {
        return None;
    }
    let (flow, rest) = rest.split_at(FLOW_BYTES);
    // name length n (1 byte)
    let (&n, name) = rest.split_first()?;
    let n = usize::from(n);
    // n = 0 or n > 128; then exactly n bytes of name (fewer or more: malformed)
    if n == 0 || n > NAME_MAX || name.len() != n {
        return None;
    }
    // a name that is not UTF-8
    let name = std::str::from_utf8(name).ok()?.to_string();
    let flow = hex(flow);
    // an op other than 1 (subscribe) and 2 (unsubscribe)
    match op {
        CONTROL_SUBSCRIBE => Some(Control::Subscribe { flow, name }),
        CONTROL_UNSUBSCRIBE => Some(Control::Unsubscribe { flow, name }),
        _ => None,
    }
}

// -------------------------------------------------------------------------------------------
// §3: state

/// A cache entry: a connection and its generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    conn: u64,
    generation: u64,
    /// Whether the peer dialed it (`accept`).
    inbound: bool,
}

/// An open's dial in flight (in opening) or one that failed while opens waited for it (in
/// failed opens): "the dial's *ticket* and its *waiters*". In opening, the waiters are "the
/// number of opens told to wait for it"; in failed opens, "how many of those waiters have not
/// asked again yet".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ticketed {
    ticket: u64,
    waiters: u64,
}

/// A peer's relay hint: "the relays last seen in an address of it (a list of strings)", and
/// when it was recorded (the stamp of its record; a larger stamp is newer).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Hint {
    relays: Vec<String>,
    recorded: u64,
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
    /// "**Opening**: per (peer, channel) whose dial for an `open` is in flight (so that
    /// concurrent opens share one connection): the dial's *ticket* and its *waiters*, the
    /// number of opens told to wait for it." Iteration order is `end.opening`'s.
    opening: BTreeMap<(u8, Channel), Ticketed>,
    /// "**Failed opens**: per (peer, channel): the ticket of a dial that failed while opens
    /// waited for it, and how many of those waiters have not asked again yet. At most 2
    /// entries." Iteration order is `end.failed_opens`'.
    failed_opens: BTreeMap<(u8, Channel), Ticketed>,
    /// "**Tickets**: one counter for the whole machine; the first dial an open orders gets
    /// ticket 1, each later one the next integer." The last ticket handed out (0: none yet).
    last_ticket: u64,
    /// "**Relay hints**: per peer, the relays last seen in an address of it (a list of
    /// strings), for at most 3 peers. Each record makes its peer the newest; when a record
    /// makes more than 3 peers, the peer recorded longest ago is forgotten." Iteration order
    /// (by peer) is `end.relays`'; the newest is the largest `recorded`.
    relay_hints: BTreeMap<u8, Hint>,
    /// The stamp of the last relay-hint record (0: none yet): one counter, each record the
    /// next integer, so "recorded longest ago" is the smallest stamp held.
    last_relay_record: u64,
    /// Joins by seed.
    joins: BTreeMap<u8, Join>,
    /// Writers by peer.
    writers: BTreeMap<u8, Writer>,
    /// The `swim` of each known writer's last batch (absent: false).
    writer_swim: BTreeMap<u8, bool>,
    /// "**Claims**: this node's own host claims: per actor, the generation registered last."
    claims: BTreeMap<u8, u64>,
    /// "**Announcing**: peers with announcements pending, each with the last actor announced
    /// (none yet: `None`)."
    announcing: BTreeMap<u8, Option<u8>>,
    /// "**Streams**: the names of this node's telemetry streams."
    streams: BTreeSet<String>,
    /// "**Subscriptions**: a set of (collector, stream, flow), each with the number of the
    /// publisher started for it", the flow in lowercase hex; the value is that publisher
    /// number. Key order is `end.subscriptions`' order.
    subscriptions: BTreeMap<(u8, String, String), u64>,
    /// "The **publisher counter** starts at 0": the number of the last publisher started (0:
    /// none yet); each `started` subscription adds 1 and takes the sum.
    last_publisher: u64,
    /// Whether `close` happened.
    closed: bool,
    /// Drops by reason.
    drops: BTreeMap<String, u64>,
    /// Refusals by `path/direction`.
    refusals: BTreeMap<String, u64>,
    /// Control verdict counts by verdict name.
    controls: BTreeMap<String, u64>,
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
            opening: BTreeMap::new(),
            failed_opens: BTreeMap::new(),
            last_ticket: 0,
            relay_hints: BTreeMap::new(),
            last_relay_record: 0,
            joins: BTreeMap::new(),
            writers: BTreeMap::new(),
            writer_swim: BTreeMap::new(),
            claims: BTreeMap::new(),
            announcing: BTreeMap::new(),
            streams: BTreeSet::new(),
            subscriptions: BTreeMap::new(),
            last_publisher: 0,
            closed: false,
            drops: BTreeMap::new(),
            refusals: BTreeMap::new(),
            controls: BTreeMap::new(),
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

    /// "**Cache** *conn* for *peer* on *channel*, *inbound* or not": insert it under the next
    /// generation; if it replaced an entry of the same direction, queue `close:<old conn>:409`;
    /// if the channel is `actor` and the peer has a writer (busy or idle), queue `kick:<peer>`;
    /// (peer, channel) leaves failed opens (its waiters take this connection); then, if the
    /// channel is `actor`, queue `announce:<peer>:<actor>:<generation>` for every claim, by
    /// actor (a new connection learns this node's actors). The generation in an announce is
    /// the claim's, not the connection's. Caching on any other channel (`switch` and
    /// `substrate` included) queues nothing. Returns the generation.
    ///
    /// Every insert goes through here (`accept` on a caching path, `connected`, `dialed`
    /// connected, `join_sent`), so every one clears the pair's failed-opens entry. Opening is
    /// not touched: only `connected` (and what is handled as it) ends the pair's dial.
    fn cache_insert(
        &mut self,
        conn: u64,
        peer: u8,
        channel: Channel,
        inbound: bool,
    ) -> Result<u64, String> {
        let generation = self
            .last_generation
            .checked_add(1)
            .ok_or_else(|| "the generation counter would overflow u64".to_string())?;
        self.last_generation = generation;
        let entry = Entry {
            conn,
            generation,
            inbound,
        };
        if let Some(old) = self.cache.insert((peer, channel), entry) {
            if old.inbound == inbound {
                self.actions.push(format!("close:{}:409", old.conn));
            }
        }
        if channel == Channel::Actor && self.writers.contains_key(&peer) {
            self.actions.push(format!("kick:{peer}"));
        }
        // (peer, channel) leaves failed opens (its waiters take this connection);
        self.failed_opens.remove(&(peer, channel));
        if channel == Channel::Actor {
            // The peer learns this node's claims from the first, batch by batch.
            self.announcing.insert(peer, None);
            self.announce_more(peer);
        }
        Ok(generation)
    }

    /// "**Announce more** to *peer*": if the peer has announcements pending: if (peer, actor)
    /// is not cached, it has none pending; otherwise queue `announce:<peer>:<actor>:<claim>`
    /// for the next claims by actor after the last one announced (from the first if none
    /// was), at most 2; if 2 were queued, the last of them is the last announced, otherwise
    /// the peer has none pending.
    fn announce_more(&mut self, peer: u8) {
        let Some(&after) = self.announcing.get(&peer) else {
            return;
        };
        if !self.cache.contains_key(&(peer, Channel::Actor)) {
            self.announcing.remove(&peer);
            return;
        }
        let next: Vec<(u8, u64)> = self
            .claims
            .iter()
            .filter(|(actor, _)| after.is_none_or(|last| **actor > last))
            .take(ANNOUNCE_BATCH)
            .map(|(actor, claim)| (*actor, *claim))
            .collect();
        for (actor, claim) in &next {
            self.actions
                .push(format!("announce:{peer}:{actor}:{claim}"));
        }
        if next.len() == ANNOUNCE_BATCH {
            self.announcing
                .insert(peer, next.last().map(|(actor, _)| *actor));
        } else {
            self.announcing.remove(&peer);
        }
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
        // Each result is the channel's name (channel.name() is "protocol:<i>" for a binding),
        // "switch" or "substrate" as the doc spells them, then the generation.
        let channel = match alpn {
            Alpn::Actor => Some(Channel::Actor),
            Alpn::Telemetry => Some(Channel::Telemetry),
            Alpn::Protocol(channel) => Some(channel),
            Alpn::Switch => Some(Channel::Switch),
            Alpn::Substrate => Some(Channel::Substrate),
            Alpn::Unknown => None,
        };
        // 3. If the ALPN names a channel, (peer, channel) is not cached, and 6 cache entries
        //    are inbound: refused_full += 1, result "full".
        if let Some(channel) = channel {
            let inbound = self.cache.values().filter(|entry| entry.inbound).count();
            if !self.cache.contains_key(&(peer, channel)) && inbound >= INBOUND_CONNECTIONS_MAX {
                add(&mut self.counters.refused_full, 1, "refused_full")?;
                return Ok(Some("full".to_string()));
            }
        }
        // 4. accepted += 1. Then by path: actor, telemetry, protocol i, switch and substrate
        //    each cache on their channel and answer "<channel>:<generation>"; unknown answers
        //    "no_adapter".
        add(&mut self.counters.accepted, 1, "accepted")?;
        let Some(channel) = channel else {
            return Ok(Some("no_adapter".to_string()));
        };
        let generation = self.cache_insert(conn, peer, channel, true)?;
        let result = format!("{}:{generation}", channel.name());
        Ok(Some(result))
    }

    /// `connected peer, channel, conn`: an outbound connection was established. (peer,
    /// channel) leaves opening (whatever its ticket: its waiters take the new connection). If
    /// closed, queue `close:<conn>:0`, result `null`. Otherwise cache it; result
    /// `"gen:<generation>"`.
    ///
    /// Failed opens are the Cache step's (it clears the pair when it caches); when closed
    /// nothing is cached and failed opens are empty anyway. `dialed` (connected) and
    /// `join_sent` are handled as `connected` on `actor`, so they too make (peer, `actor`)
    /// leave opening (and, caching, failed opens).
    fn connected(
        &mut self,
        peer: u8,
        channel: Channel,
        conn: u64,
    ) -> Result<Option<String>, String> {
        // (peer, channel) leaves opening (whatever its ticket: its waiters take the new
        // connection), before the closed check: it leaves either way.
        self.opening.remove(&(peer, channel));
        if self.closed {
            self.actions.push(format!("close:{conn}:0"));
            return Ok(None);
        }
        let generation = self.cache_insert(conn, peer, channel, false)?;
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

    /// `unresponsive peer, channel, generation`: what ran over that connection stopped
    /// answering (a liveness cut, such as a switch master's unechoed heartbeat). If the cache
    /// entry of (peer, channel) has this generation: remove it, `evictions` += 1, queue
    /// `close:<conn>:408`. Otherwise nothing (a newer connection stays).
    ///
    /// No dial, on any channel (the rule does not say to dial), and no `stale_failures`.
    fn unresponsive(&mut self, peer: u8, channel: Channel, generation: u64) -> Result<(), String> {
        // If the cache entry of (peer, channel) has this generation:
        let current = match self.cache.get(&(peer, channel)) {
            Some(&entry) if entry.generation == generation => Some(entry),
            _ => None,
        };
        if let Some(entry) = current {
            // remove it,
            self.cache.remove(&(peer, channel));
            // `evictions` += 1,
            add(&mut self.counters.evictions, 1, "evictions")?;
            // queue `close:<conn>:408`.
            self.actions.push(format!("close:{}:408", entry.conn));
        }
        // Otherwise nothing (a newer connection stays).
        Ok(())
    }

    /// The **verdict** of `open` (also `open_failed`'s result and `open_waited`'s fallback):
    /// "if closed, result `"closed"`; else if (peer, channel) is cached, result
    /// `"cached:<generation>:<conn>"`; else if (peer, channel) is opening, its waiters += 1,
    /// result `"wait:<ticket>"` with the ticket of that dial (the application asks again with
    /// `open_waited` once the machine's state moved); else (peer, channel) becomes opening
    /// with the next ticket and 0 waiters, result `"dial:<ticket>"`."
    fn verdict(&mut self, peer: u8, channel: Channel) -> Result<String, String> {
        // if closed, result "closed"
        if self.closed {
            return Ok("closed".to_string());
        }
        // else if (peer, channel) is cached, result "cached:<generation>:<conn>"
        if let Some(entry) = self.cache.get(&(peer, channel)) {
            return Ok(format!("cached:{}:{}", entry.generation, entry.conn));
        }
        // else if (peer, channel) is opening, its waiters += 1, result "wait:<ticket>" with
        // the ticket of that dial
        if let Some(open) = self.opening.get_mut(&(peer, channel)) {
            add(&mut open.waiters, 1, "an opening's waiters")?;
            return Ok(format!("wait:{}", open.ticket));
        }
        // else (peer, channel) becomes opening with the next ticket and 0 waiters, result
        // "dial:<ticket>"
        let ticket = self
            .last_ticket
            .checked_add(1)
            .ok_or_else(|| "the ticket counter would overflow u64".to_string())?;
        self.last_ticket = ticket;
        self.opening
            .insert((peer, channel), Ticketed { ticket, waiters: 0 });
        Ok(format!("dial:{ticket}"))
    }

    /// `open peer, path, channel`: "Admit on `path`, outbound; if refused, result
    /// `"refused"`. Otherwise its **verdict**". A refused open changes nothing else (it is no
    /// waiter and orders no dial), closed or not.
    fn open(&mut self, peer: u8, path: Path, channel: Channel) -> Result<Option<String>, String> {
        if !self.admit(peer, path, Direction::Outbound)? {
            return Ok(Some("refused".to_string()));
        }
        Ok(Some(self.verdict(peer, channel)?))
    }

    /// "**Forget a waiter** of ticket *t*" for (peer, channel): "if (peer, channel) is opening
    /// with ticket *t*, its waiters −= 1 (not below 0); else if failed opens hold (peer,
    /// channel) with ticket *t*, its waiters −= 1 (not below 0) and the entry goes at 0;
    /// otherwise nothing."
    ///
    /// An opening pair stays opening at 0 waiters (its dial is still in flight; only the
    /// failed-opens entry "goes at 0").
    fn forget_a_waiter(&mut self, peer: u8, channel: Channel, ticket: u64) {
        // if (peer, channel) is opening with ticket t, its waiters −= 1 (not below 0);
        if let Some(open) = self.opening.get_mut(&(peer, channel)) {
            if open.ticket == ticket {
                open.waiters = open.waiters.saturating_sub(1);
                return;
            }
        }
        // else if failed opens hold (peer, channel) with ticket t, its waiters −= 1 (not
        // below 0) and the entry goes at 0;
        if let Some(failed) = self.failed_opens.get_mut(&(peer, channel)) {
            if failed.ticket == ticket {
                failed.waiters = failed.waiters.saturating_sub(1);
                if failed.waiters == 0 {
                    self.failed_opens.remove(&(peer, channel));
                }
            }
        }
        // otherwise nothing.
    }

    /// `open_waited peer, channel, ticket`: an open told `wait:<ticket>` asks again (no
    /// admission).
    fn open_waited(
        &mut self,
        peer: u8,
        channel: Channel,
        ticket: u64,
    ) -> Result<Option<String>, String> {
        // If closed, result "closed".
        if self.closed {
            return Ok(Some("closed".to_string()));
        }
        // Else if (peer, channel) is cached (a connection came meanwhile, whichever side made
        // it): forget a waiter of the ticket, result "cached:<generation>:<conn>".
        if let Some(&entry) = self.cache.get(&(peer, channel)) {
            self.forget_a_waiter(peer, channel, ticket);
            return Ok(Some(format!("cached:{}:{}", entry.generation, entry.conn)));
        }
        // Else if failed opens hold (peer, channel) with this ticket (that dial failed while
        // this open waited for it): forget a waiter of the ticket, result "failed".
        let failed_here = self
            .failed_opens
            .get(&(peer, channel))
            .is_some_and(|failed| failed.ticket == ticket);
        if failed_here {
            self.forget_a_waiter(peer, channel, ticket);
            return Ok(Some("failed".to_string()));
        }
        // Else if (peer, channel) is opening with this ticket (the dial is still in flight),
        // result "wait:<ticket>" and nothing changes.
        if let Some(open) = self.opening.get(&(peer, channel)) {
            if open.ticket == ticket {
                return Ok(Some(format!("wait:{ticket}")));
            }
        }
        // Otherwise the verdict of `open`.
        Ok(Some(self.verdict(peer, channel)?))
    }

    /// `open_wait_abandoned peer, channel, ticket`: an open told `wait:<ticket>` went away
    /// before it was placed: forget a waiter of the ticket. Result `null`. No admission and no
    /// closed check (its rule names neither; after `close` opening and failed opens are empty,
    /// so there is nothing to forget).
    fn open_wait_abandoned(&mut self, peer: u8, channel: Channel, ticket: u64) {
        self.forget_a_waiter(peer, channel, ticket);
    }

    /// `open_failed peer, channel, generation`: "as `closed` (the entry goes if it has this
    /// generation), then the result is the verdict of `open` (no admission)". The verdict is
    /// `closed` after `close`, `cached:` when the entry stays (another generation), `wait:`
    /// (one more waiter) when the pair is opening, else `dial:` with the next ticket.
    fn open_failed(
        &mut self,
        peer: u8,
        channel: Channel,
        generation: u64,
    ) -> Result<Option<String>, String> {
        self.closed_conn(peer, channel, generation);
        Ok(Some(self.verdict(peer, channel)?))
    }

    /// `open_dial_failed peer, channel, ticket, abandoned`: the dial an `open` ordered with
    /// this ticket failed (`abandoned` false) or its caller went away (`abandoned` true).
    /// Result `null`.
    fn open_dial_failed(&mut self, peer: u8, channel: Channel, ticket: u64, abandoned: bool) {
        // Unless (peer, channel) is opening with this ticket, nothing changes (a later dial
        // is not ended by an earlier one's report).
        let open = match self.opening.get(&(peer, channel)) {
            Some(&open) if open.ticket == ticket => open,
            _ => return,
        };
        // Otherwise it leaves opening;
        self.opening.remove(&(peer, channel));
        // then, if the dial failed, its waiters are more than 0 and (peer, channel) is not
        // cached (had a connection come, its waiters take it), failed opens of (peer,
        // channel) become (ticket, waiters), replacing any entry there;
        if !abandoned && open.waiters > 0 && !self.cache.contains_key(&(peer, channel)) {
            self.failed_opens.insert((peer, channel), open);
            // if that makes more than 2 entries, the entry with the smallest ticket goes (its
            // waiters, when they ask again, get the verdict of `open`).
            if self.failed_opens.len() > FAILED_OPENS_KEPT {
                let oldest = self
                    .failed_opens
                    .iter()
                    .min_by_key(|(_, failed)| failed.ticket)
                    .map(|(&key, _)| key);
                if let Some(key) = oldest {
                    self.failed_opens.remove(&key);
                }
            }
        }
        // An abandoned dial's waiters ask again and the first of them dials: nothing to do
        // here; `open_waited` finds neither entry and gives the verdict of `open`. The
        // waiters of a failed dial of a cached pair ask again and hear `cached:` (the cache
        // is looked at first).
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
        // Then announce more to the peer.
        self.announce_more(peer);
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

    /// `relays_seen peer, relays`: an address of the peer carried `relays` (a list of relay
    /// strings). Result `null`.
    fn relays_seen(&mut self, peer: u8, relays: &[String]) -> Result<(), String> {
        // (a list of relay strings): any other string is malformed input.
        check_relays(relays, "relays_seen")?;
        // An empty list changes nothing (it is no hint).
        if relays.is_empty() {
            return Ok(());
        }
        // Otherwise the peer's hint becomes `relays` and the peer the newest (a hint it had
        // is replaced);
        let recorded = self
            .last_relay_record
            .checked_add(1)
            .ok_or_else(|| "the relay-hint record counter would overflow u64".to_string())?;
        self.last_relay_record = recorded;
        self.relay_hints.insert(
            peer,
            Hint {
                relays: relays.to_vec(),
                recorded,
            },
        );
        // then, if more than 3 peers have hints, the peer recorded longest ago loses its
        // hint. (One record adds at most one peer, so at most one goes; the newest, just
        // recorded, is never the one.)
        if self.relay_hints.len() > RELAY_HINTS_KEPT {
            let oldest = self
                .relay_hints
                .iter()
                .min_by_key(|(_, hint)| hint.recorded)
                .map(|(&peer, _)| peer);
            if let Some(oldest) = oldest {
                self.relay_hints.remove(&oldest);
            }
        }
        Ok(())
    }

    /// `relays_for peer, given`: the relays to reach the peer by, for an address of it that
    /// carries `given`. Nothing changes.
    fn relays_for(&self, peer: u8, given: &[String]) -> Result<Option<String>, String> {
        check_relays(given, "relays_for")?;
        // `given` when it is not empty, else the peer's hint (none: empty).
        let relays: &[String] = if !given.is_empty() {
            given
        } else {
            match self.relay_hints.get(&peer) {
                Some(hint) => hint.relays.as_slice(),
                None => &[],
            }
        };
        // The result is those relays joined by `,` (the empty string when there are none).
        Ok(Some(relays.join(",")))
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

    /// `egress_full frames`: a peer's egress queue had no room for `frames` frames: add
    /// `frames` to drops `egress_full`.
    fn egress_full(&mut self, frames: u64) -> Result<(), String> {
        self.drop_frames("egress_full", frames)
    }

    /// `register actor, generation, forged`: the application registers a host claim of this
    /// node for the actor.
    fn register(&mut self, actor: u8, generation: u64, forged: bool) -> Option<String> {
        // 1. If `forged`: result "bad_signature", nothing else.
        if forged {
            return Some("bad_signature".to_string());
        }
        match self.claims.get(&actor) {
            // 2. If a claim for the actor is held with a generation ≥ `generation`: result
            //    "stale".
            Some(&held) if held >= generation => return Some("stale".to_string()),
            // 3. If no claim for the actor is held and 4,096 claims are held: result "full".
            None if self.claims.len() >= CLAIMS_MAX => return Some("full".to_string()),
            _ => {}
        }
        // 4. If `generation` > 2^48, or a claim is held and `generation` is more than 2^20
        //    past it: result "jump".
        if jumps(self.claims.get(&actor).copied(), generation) {
            return Some("jump".to_string());
        }
        // 5. Otherwise the claim for the actor becomes `generation`; queue
        //    `announce:<peer>:<actor>:<generation>` for every peer with a cached `actor`
        //    connection, by peer; result "ok". (The cache iterates by (peer, channel), so
        //    each such peer comes once, in order.)
        self.claims.insert(actor, generation);
        for &(peer, channel) in self.cache.keys() {
            if channel == Channel::Actor {
                self.actions
                    .push(format!("announce:{peer}:{actor}:{generation}"));
            }
        }
        Some("ok".to_string())
    }

    /// `hand_off actor, to, generation, forged`: this node consents that an actor it hosts
    /// move to peer `to` at `generation`.
    fn hand_off(&mut self, actor: u8, generation: u64, forged: bool) -> Option<String> {
        // 1. If no claim for the actor is held: result "not_hosted".
        let Some(&held) = self.claims.get(&actor) else {
            return Some("not_hosted".to_string());
        };
        // 2. If `forged`: result "bad_signature".
        if forged {
            return Some("bad_signature".to_string());
        }
        // 3. If `generation` ≤ the generation held: result "stale".
        if generation <= held {
            return Some("stale".to_string());
        }
        // 4. If `generation` jumps as in `register` 4: result "jump".
        if jumps(Some(held), generation) {
            return Some("jump".to_string());
        }
        // 5. Otherwise the claim for the actor is dropped (nothing more is announced for
        //    it); result "ok".
        self.claims.remove(&actor);
        Some("ok".to_string())
    }

    /// `stream name`: this node has a telemetry stream `name` (collectors may subscribe to
    /// it). Result `null`.
    fn stream(&mut self, name: &str) {
        self.streams.insert(name.to_string());
    }

    /// `control peer, payload`: an actor record tagged `tether.TelemetryControl` from the
    /// peer (a collector), `payload` its bytes in lowercase hex. Result `null`.
    fn control(&mut self, peer: u8, payload: &str) -> Result<(), String> {
        // The payload must be lowercase hex at all (a script that is not is malformed input,
        // whoever sent it); decoding the bytes is step 2.
        let bytes = parse_hex(payload, "control payload")?;
        // 1. Admit the peer on `telemetry`, outbound (a subscription publishes to it); if
        //    refused, nothing else.
        if !self.admit(peer, Path::Telemetry, Direction::Outbound)? {
            return Ok(());
        }
        // 2. Decode the payload; anything that does not decode: the verdict is `malformed`.
        let verdict = match decode_control(&bytes) {
            None => Verdict::Malformed,
            // 3. Subscribe: if the name is not a stream of this node, `unknown_stream`; else
            //    if (peer, name, flow) is subscribed, `ignored`; else if 256 subscriptions are
            //    live, or 32 of this peer's, `full`; else the publisher counter += 1, and the
            //    subscription is live
            //    with that number p: `started`, and `publish:<peer>:<name>:<flow>:<p>` is
            //    queued.
            Some(Control::Subscribe { flow, name }) => {
                let key = (peer, name, flow);
                if !self.streams.contains(&key.1) {
                    Verdict::UnknownStream
                } else if self.subscriptions.contains_key(&key) {
                    Verdict::Ignored
                } else if self.subscriptions.len() >= SUBSCRIPTIONS_MAX
                    || self
                        .subscriptions
                        .keys()
                        .filter(|(p, ..)| *p == peer)
                        .count()
                        >= SUBSCRIPTIONS_PER_PEER_MAX
                {
                    Verdict::Full
                } else {
                    add(&mut self.last_publisher, 1, "the publisher counter")?;
                    let publisher = self.last_publisher;
                    self.actions
                        .push(format!("publish:{peer}:{}:{}:{publisher}", key.1, key.2));
                    self.subscriptions.insert(key, publisher);
                    Verdict::Started
                }
            }
            // 4. Unsubscribe: if (peer, name, flow) is subscribed, with publisher p, it is
            //    removed, `stopped`, and `unpublish:<peer>:<name>:<flow>:<p>` is queued; else
            //    `ignored`.
            Some(Control::Unsubscribe { flow, name }) => {
                let key = (peer, name, flow);
                match self.subscriptions.remove(&key) {
                    Some(publisher) => {
                        self.actions
                            .push(format!("unpublish:{peer}:{}:{}:{publisher}", key.1, key.2));
                        Verdict::Stopped
                    }
                    None => Verdict::Ignored,
                }
            }
        };
        // 5. The verdict's count += 1.
        let name = verdict.name();
        let count = self.controls.entry(name.to_string()).or_insert(0);
        add(count, 1, &format!("controls {name}"))
    }

    /// `ended peer, name, flow, publisher`: publisher number `publisher` of that subscription
    /// ended (its collector went away, or it was stopped): the subscription is removed if it
    /// is live with that publisher number; otherwise nothing changes (a publisher stopped by
    /// an unsubscribe ends after the same subscription started again under a new number,
    /// which stays live). Result `null`.
    fn ended(&mut self, peer: u8, name: &str, flow: &str, publisher: u64) -> Result<(), String> {
        let flow = parse_flow(flow)?;
        let key = (peer, name.to_string(), flow);
        if self.subscriptions.get(&key) == Some(&publisher) {
            self.subscriptions.remove(&key);
        }
        Ok(())
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

    /// `close`: closed; every timer is cancelled; every dial ends; opening and failed opens
    /// become empty; every cache entry is removed, queuing `close:<conn>:0` in cache order;
    /// every join is done (phases unchanged); every writer is forgotten.
    fn close(&mut self) {
        self.closed = true;
        // Timers live in the dials, joins and writers below; ending those cancels them.
        self.dials.clear();
        self.announcing.clear();
        self.opening.clear();
        self.failed_opens.clear();
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
            DriverOp::Unresponsive {
                peer,
                channel,
                generation,
                ..
            } => {
                let channel = Channel::parse(channel)?;
                self.unresponsive(*peer, channel, *generation)?;
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
                let path = Path::parse(path)?;
                let channel = Channel::parse(channel)?;
                self.open(*peer, path, channel)?
            }
            DriverOp::OpenFailed {
                peer,
                channel,
                generation,
                ..
            } => {
                let channel = Channel::parse(channel)?;
                self.open_failed(*peer, channel, *generation)?
            }
            DriverOp::OpenWaited {
                peer,
                channel,
                ticket,
                ..
            } => {
                let channel = Channel::parse(channel)?;
                self.open_waited(*peer, channel, *ticket)?
            }
            DriverOp::OpenWaitAbandoned {
                peer,
                channel,
                ticket,
                ..
            } => {
                let channel = Channel::parse(channel)?;
                self.open_wait_abandoned(*peer, channel, *ticket);
                None
            }
            DriverOp::OpenDialFailed {
                peer,
                channel,
                ticket,
                abandoned,
                ..
            } => {
                let channel = Channel::parse(channel)?;
                self.open_dial_failed(*peer, channel, *ticket, *abandoned);
                None
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
            DriverOp::RelaysSeen { peer, relays, .. } => {
                self.relays_seen(*peer, relays)?;
                None
            }
            DriverOp::RelaysFor { peer, given, .. } => self.relays_for(*peer, given)?,
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
            DriverOp::EgressFull { frames, .. } => {
                self.egress_full(*frames)?;
                None
            }
            DriverOp::Register {
                actor,
                generation,
                forged,
                ..
            } => self.register(*actor, *generation, *forged),
            DriverOp::HandOff {
                actor,
                generation,
                forged,
                ..
            } => self.hand_off(*actor, *generation, *forged),
            DriverOp::Stream { name, .. } => {
                self.stream(name);
                None
            }
            DriverOp::Control { peer, payload, .. } => {
                self.control(*peer, payload)?;
                None
            }
            DriverOp::Ended {
                peer,
                name,
                flow,
                publisher,
                ..
            } => {
                self.ended(*peer, name, flow, *publisher)?;
                None
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
            // "sorted by actor"
            claims: self
                .claims
                .iter()
                .map(|(&actor, &generation)| (actor, generation))
                .collect(),
            // "sorted by (collector, stream, flow)"
            subscriptions: self.subscriptions.keys().cloned().collect(),
            // "every control verdict with a count above 0"
            controls: self
                .controls
                .iter()
                .filter(|(_, &count)| count > 0)
                .map(|(verdict, &count)| (verdict.clone(), count))
                .collect(),
            // "the opens' dials in flight, sorted by (peer, channel)"
            opening: Self::ticketed(&self.opening),
            // "the failed dials whose waiters have not all heard it, sorted by (peer,
            // channel)"
            failed_opens: Self::ticketed(&self.failed_opens),
            // "each peer's relay hint, sorted by peer"
            relays: self
                .relay_hints
                .iter()
                .map(|(&peer, hint)| (peer, hint.relays.clone()))
                .collect(),
        }
    }

    /// `[[peer, channel, ticket, waiters], ...]` of an opening or failed-opens map, sorted
    /// by (peer, channel) with channels in cache order (the map's own order).
    fn ticketed(map: &BTreeMap<(u8, Channel), Ticketed>) -> Vec<(u8, String, u64, u64)> {
        map.iter()
            .map(|(&(peer, channel), open)| {
                (peer, channel.name().to_string(), open.ticket, open.waiters)
            })
            .collect()
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
#[path = "driver_model_tests.rs"]
mod tests;
