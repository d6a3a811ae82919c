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
mod tests {
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
                let waiters =
                    |opening: &BTreeMap<(u8, Channel), Ticketed>,
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
}
