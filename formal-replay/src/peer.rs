//! The `peer` section: the decisions of one substrate peer's life around its link (loading its
//! state, dialing and redialing, committing and retrying the store), core's
//! `substrate::peer::Peer` against a model written from the rules alone.
//!
//! A case gives the peer a jitter `seed` and whether an address is known (`dialable`), then a
//! list of timed events. Events answer what the peer asked for (`loaded`, `load_failed`,
//! `dial_ok`, `dial_failed`, `commit_ok`, `commit_failed`), or are the world's (`tick`: time
//! passes to `at`; `lost`: the connection ends; `write`: the app opens one more queue, which
//! the peer must persist; `ack`: the remote, whose store commits at once, hears what the peer
//! transmitted and answers it, so every op the peer committed is hop-acked and the peer
//! forgets it). An answer the peer did not ask for is not given: its step reads `["unasked"]`.
//!
//! After each event the step records what the peer asked for or reported, in order (`load`,
//! `dial:N` with N the failed dials before it, `commit`, `bind`, `unbind`, `link_up`,
//! `store_failed:load:N`, `store_failed:commit:N`, `store_recovered:load`,
//! `store_recovered:commit`, `refused` for a write before the state is loaded), and when the
//! next dial (`redial_at`), the next store retry (`retry_at`) and the commit of what was held
//! back (`commit_at`, left out while none is due) are due.
//!
//! The rules the model holds (from issue "machines decide", and the retry policy's doc):
//!
//! - The peer asks for its state first; a failed load is asked again after the store backoff
//!   (base 50 ms doubling to 5 s, each wait in `[ceiling/2, ceiling]`), and until it loads every
//!   command is refused.
//! - Loaded with an address known, it dials at once; a failed dial, and a lost link, dial again
//!   after the redial backoff (base 100 ms doubling to 10 s); one dial at a time, none while a
//!   connection is bound; a link that comes up resets the backoff.
//! - Every write is persisted: one commit at a time, holding everything written since the last
//!   one; a failed commit is retried, first and whole, after the store backoff, and no commit
//!   starts while a retry waits.
//! - What nothing waits on is held back (issue "durable messaging past the commit chain"):
//!   forgetting acked ops starts no commit of its own. It rides with the next commit a write
//!   starts, or, when no commit is in flight and no retry waits, is committed on its own
//!   at the first input 10 ms after the oldest batch still uncommitted was made (a failed
//!   commit's batches count as made when it failed).
//! - Jitter: one SplitMix64 stream seeded with `seed`, one value per failure (a failed load, a
//!   failed commit, a failed dial, a lost link), in the order they happen.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use serde::{Deserialize, Serialize};

use tether_core::substrate::handshake::{Auth, Channel, Role};
use tether_core::substrate::peer::{
    Command, DialFailed, Dialed, Failure, Output, Peer, Reply, StoreFault,
};
use tether_core::substrate::{AllowAll, Authorizer, Config, Machine, PeerId, PeerLink};
use tether_core::time::Time;
use tether_core::wire::envelope::ObjKind;

/// One event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PeerEventKind {
    /// The load asked for succeeded.
    Loaded,
    /// The load asked for failed.
    LoadFailed,
    /// The dial asked for connected (and its handshake completes).
    DialOk,
    /// The dial asked for failed.
    DialFailed,
    /// The commit asked for succeeded.
    CommitOk,
    /// The commit asked for failed.
    CommitFailed,
    /// Time passes to `at`.
    Tick,
    /// The bound connection ends.
    Lost,
    /// The app opens one more queue.
    Write,
    /// The remote hears what was transmitted and answers it (its store commits at once).
    Ack,
}

/// An event at `at` ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerEvent {
    /// When, in ms (never before the previous event).
    pub at: u64,
    /// What.
    pub event: PeerEventKind,
}

/// What the peer did after one event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerStep {
    /// What it asked for or reported, in order.
    pub out: Vec<String>,
    /// When the next dial is due.
    #[serde(deserialize_with = "crate::script::required")]
    pub redial_at: Option<u64>,
    /// When the next store retry (load or commit) is due.
    #[serde(deserialize_with = "crate::script::required")]
    pub retry_at: Option<u64>,
    /// When what was held back is committed on its own, if it is (absent: not due).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit_at: Option<u64>,
}

/// A case.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerCase {
    /// The jitter seed.
    pub seed: u64,
    /// Whether an address is known.
    pub dialable: bool,
    /// The events.
    pub events: Vec<PeerEvent>,
    /// One step per event.
    pub steps: Vec<PeerStep>,
}

fn check_shape(case: &PeerCase) -> Result<(), String> {
    if case.events.len() != case.steps.len() {
        return Err(format!(
            "{} events but {} steps",
            case.events.len(),
            case.steps.len()
        ));
    }
    if case.events.windows(2).any(|pair| pair[1].at < pair[0].at) {
        return Err("events go back in time".into());
    }
    if case.events.iter().any(|event| event.at > DAY_MS / 2) {
        return Err("events past half a day (the link's timers are a day away)".into());
    }
    Ok(())
}

const DAY_MS: u64 = 86_400_000;

// ---------------------------------------------------------------------------------------------
// tether-core

/// The machine's own timers (keepalive, dead-after, TTLs) are a day away, so that only the
/// peer's decisions show within a case.
fn quiet_config() -> Config {
    let day = Duration::from_millis(DAY_MS);
    Config {
        keepalive: day,
        dead_after: day,
        queue_ttl: day,
        dedupe_retention: day,
        gap_resync_after: day,
        ..Config::default()
    }
}

fn quiet_link(id: &str) -> PeerLink {
    let authorizer = Arc::new(Authorizer::new(AllowAll));
    let machine = Machine::new(PeerId::new(id), quiet_config(), authorizer, 7);
    PeerLink::new(machine, Auth::None, Vec::new())
}

fn channel() -> Channel {
    Channel {
        conn_id: b"a-b".to_vec(),
        binding: Vec::new(),
    }
}

/// What core's peer asked for and was not answered yet.
#[derive(Default)]
struct Asks {
    load: bool,
    dial: bool,
    commit: bool,
}

fn drain(peer: &mut Peer, asks: &mut Asks, out: &mut Vec<String>) {
    while let Some(output) = peer.poll_output() {
        let word = match output {
            Output::Load => {
                asks.load = true;
                "load".to_owned()
            }
            Output::Dial { attempt } => {
                asks.dial = true;
                format!("dial:{attempt}")
            }
            Output::Commit(_) => {
                asks.commit = true;
                "commit".to_owned()
            }
            Output::Bind { .. } => "bind".to_owned(),
            Output::Unbind => "unbind".to_owned(),
            Output::LinkUp(_) => "link_up".to_owned(),
            Output::LinkDropped(close) => format!("link_dropped:{close}"),
            Output::StoreFailed { call, failures } => {
                format!("store_failed:{}:{failures}", call.as_str())
            }
            Output::StoreRecovered { call } => format!("store_recovered:{}", call.as_str()),
            Output::Reply {
                reply: Reply::Failed(Failure::StoreUnavailable),
                ..
            } => "refused".to_owned(),
            // Opens complete only when the remote's app accepts, which no case does; the
            // counters and app events are not decisions about the peer's life.
            _ => continue,
        };
        out.push(word);
    }
}

/// Moves bytes between the peer (bound under its generation) and a listener until both are
/// quiet; with `commit`, the listener's store commits everything it is given at once (so its
/// acks go out), otherwise it never does.
fn pump(peer: &mut Peer, listener: &mut PeerLink, now: Time, commit: bool) {
    let generation = peer.generation();
    loop {
        let (mut out, mut back) = (BytesMut::new(), BytesMut::new());
        while peer.poll_transmit(&mut out) {}
        if !out.is_empty() {
            listener.handle_bytes(now, out.freeze());
        }
        if commit {
            let machine = listener.machine_mut();
            if let Some(last) = std::iter::from_fn(|| machine.poll_persist()).last() {
                machine.handle_persisted(now, last.id);
            }
        }
        while listener.poll_transmit(&mut back) {}
        if back.is_empty() {
            return;
        }
        peer.handle_link_bytes(now, generation, back.freeze());
    }
}

/// The section on core's `Peer`.
pub fn core_peer(case: &PeerCase) -> Result<PeerCase, String> {
    check_shape(case)?;
    let mut peer = Peer::new(PeerId::new("b"), true, case.dialable, case.seed);
    let mut asks = Asks::default();
    let mut first = Vec::new();
    drain(&mut peer, &mut asks, &mut first);
    if first != ["load"] {
        return Err(format!("the peer began with {first:?}"));
    }
    let mut writes = 0u32;
    let mut listener: Option<PeerLink> = None;
    let mut steps = Vec::with_capacity(case.events.len());
    for event in &case.events {
        let now = Time::from_millis(event.at);
        let mut out = Vec::new();
        let asked = match event.event {
            PeerEventKind::Loaded | PeerEventKind::LoadFailed => &mut asks.load,
            PeerEventKind::DialOk | PeerEventKind::DialFailed => &mut asks.dial,
            PeerEventKind::CommitOk | PeerEventKind::CommitFailed => &mut asks.commit,
            _ => &mut true,
        };
        if !*asked {
            out.push("unasked".to_owned());
        } else {
            *asked = false;
            match event.event {
                PeerEventKind::Loaded => peer.handle_loaded(now, Ok(quiet_link("b"))),
                PeerEventKind::LoadFailed => peer.handle_loaded(now, Err(StoreFault)),
                PeerEventKind::DialOk => {
                    let dialed = Dialed {
                        channel: channel(),
                        nonce: vec![1; 16],
                    };
                    peer.handle_dialed(now, Ok(dialed));
                    drain(&mut peer, &mut asks, &mut out);
                    let remote = listener.insert(quiet_link("a"));
                    remote.link_up(now, Role::Listener, channel(), vec![2; 16]);
                    pump(&mut peer, remote, now, false);
                }
                PeerEventKind::DialFailed => peer.handle_dialed(now, Err(DialFailed)),
                PeerEventKind::CommitOk => peer.handle_committed(now, Ok(())),
                PeerEventKind::CommitFailed => peer.handle_committed(now, Err(StoreFault)),
                PeerEventKind::Tick => peer.handle_timeout(now),
                PeerEventKind::Lost => {
                    listener = None;
                    peer.handle_link_closed(now, peer.generation());
                }
                PeerEventKind::Ack => {
                    if let Some(remote) = listener.as_mut() {
                        pump(&mut peer, remote, now, true);
                    }
                }
                PeerEventKind::Write => {
                    writes += 1;
                    let open = Command::Open {
                        kind: ObjKind::Queue,
                        obj: format!("q{writes}").into(),
                        cap: None,
                    };
                    peer.handle_command(now, u64::from(writes), open);
                }
            }
            drain(&mut peer, &mut asks, &mut out);
        }
        let timers = peer.timers();
        steps.push(PeerStep {
            out,
            redial_at: timers.redial.map(Time::as_millis),
            retry_at: timers.store_retry.map(Time::as_millis),
            commit_at: timers.commit.map(Time::as_millis),
        });
    }
    Ok(PeerCase {
        steps,
        ..case.clone()
    })
}

// ---------------------------------------------------------------------------------------------
// the model

/// SplitMix64, the published generator.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Capped exponential backoff with equal jitter: the `failures`-th failure in a row (from 1)
/// waits in `[c/2, c]`, `c = min(cap, base·2^(failures−1))`.
fn wait(base: u64, cap: u64, failures: u32, entropy: u64) -> u64 {
    let exponent = (failures - 1).min(20);
    let ceiling = base.saturating_mul(1 << exponent).min(cap).max(1);
    let half = ceiling / 2;
    half + entropy % (ceiling - half + 1)
}

const STORE: (u64, u64) = (50, 5_000);
/// How long what nothing waits on is held back, in ms.
const LAZY: u64 = 10;
const REDIAL: (u64, u64) = (100, 10_000);

#[derive(Default)]
struct Model {
    loaded: bool,
    load_asked: bool,
    load_failures: u32,
    dialing: bool,
    bound: bool,
    dial_failures: u32,
    redial_at: Option<u64>,
    commit_failures: u32,
    retry_at: Option<u64>,
    /// Writes in the commit in flight, and whether it holds forgetting too.
    committing: u32,
    committing_forgets: bool,
    /// Writes not handed to the store yet.
    written: u32,
    /// Forgetting not handed to the store yet.
    forgets: bool,
    /// When the oldest batch not handed to the store was made.
    held_since: Option<u64>,
    /// Writes committed and not acked yet.
    unacked: u32,
}

/// The section on the model.
pub fn model_peer(case: &PeerCase) -> Result<PeerCase, String> {
    check_shape(case)?;
    let mut jitter = SplitMix(case.seed);
    let mut m = Model {
        load_asked: true,
        ..Model::default()
    };
    let mut steps = Vec::with_capacity(case.events.len());
    for event in &case.events {
        let at = event.at;
        let mut out: Vec<String> = Vec::new();
        let asked = match event.event {
            PeerEventKind::Loaded | PeerEventKind::LoadFailed => m.load_asked,
            PeerEventKind::DialOk | PeerEventKind::DialFailed => m.dialing,
            PeerEventKind::CommitOk | PeerEventKind::CommitFailed => {
                m.committing > 0 || m.committing_forgets
            }
            _ => true,
        };
        if !asked {
            out.push("unasked".into());
        }
        // Whether the event reaches the peer at all: a lost connection that was not bound, or
        // an ack with nothing to acknowledge, is no input (and so no moment to decide at).
        let mut may_commit = match event.event {
            PeerEventKind::Lost => m.bound,
            PeerEventKind::Ack => m.bound && m.unacked > 0,
            _ => true,
        };
        match event.event {
            _ if !asked => may_commit = false,
            PeerEventKind::Loaded => {
                m.load_asked = false;
                m.loaded = true;
                m.retry_at = None;
                if m.load_failures > 0 {
                    out.push("store_recovered:load".into());
                }
                if case.dialable {
                    m.redial_at = Some(at);
                }
            }
            PeerEventKind::LoadFailed => {
                m.load_asked = false;
                m.load_failures += 1;
                let (base, cap) = STORE;
                m.retry_at = Some(at + wait(base, cap, m.load_failures, jitter.next()));
                out.push(format!("store_failed:load:{}", m.load_failures));
            }
            PeerEventKind::DialOk => {
                m.dialing = false;
                m.bound = true;
                m.dial_failures = 0;
                m.redial_at = None;
                out.push("bind".into());
                out.push("link_up".into());
            }
            PeerEventKind::DialFailed => {
                m.dialing = false;
                m.dial_failures += 1;
                let (base, cap) = REDIAL;
                m.redial_at = Some(at + wait(base, cap, m.dial_failures, jitter.next()));
            }
            PeerEventKind::CommitOk => {
                m.unacked += m.committing;
                m.committing = 0;
                m.committing_forgets = false;
                if m.commit_failures > 0 {
                    out.push("store_recovered:commit".into());
                }
                m.commit_failures = 0;
                m.retry_at = None;
            }
            PeerEventKind::CommitFailed => {
                // Everything of the failed commit waits again, in front.
                m.written += m.committing;
                m.forgets |= m.committing_forgets;
                m.committing = 0;
                m.committing_forgets = false;
                m.held_since.get_or_insert(at);
                m.commit_failures += 1;
                let (base, cap) = STORE;
                m.retry_at = Some(at + wait(base, cap, m.commit_failures, jitter.next()));
                out.push(format!("store_failed:commit:{}", m.commit_failures));
            }
            PeerEventKind::Tick => {
                if !m.loaded {
                    if m.retry_at.is_some_and(|due| due <= at) && !m.load_asked {
                        m.retry_at = None;
                        m.load_asked = true;
                        out.push("load".into());
                    }
                } else {
                    if m.retry_at.is_some_and(|due| due <= at) {
                        m.retry_at = None;
                    }
                    if m.redial_at.is_some_and(|due| due <= at) && !m.dialing && !m.bound {
                        m.redial_at = None;
                        m.dialing = true;
                        out.push(format!("dial:{}", m.dial_failures));
                    }
                }
            }
            PeerEventKind::Lost => {
                if m.bound {
                    m.bound = false;
                    out.push("unbind".into());
                    if case.dialable && !m.dialing {
                        m.dial_failures += 1;
                        let (base, cap) = REDIAL;
                        m.redial_at = Some(at + wait(base, cap, m.dial_failures, jitter.next()));
                    }
                }
            }
            PeerEventKind::Write => {
                if m.loaded {
                    m.written += 1;
                    m.held_since.get_or_insert(at);
                } else {
                    out.push("refused".into());
                }
            }
            PeerEventKind::Ack => {
                if m.bound && m.unacked > 0 {
                    m.unacked = 0;
                    m.forgets = true;
                    m.held_since.get_or_insert(at);
                }
            }
        }
        let may_start = m.loaded && m.committing == 0 && !m.committing_forgets;
        let may_start = may_start && m.retry_at.is_none();
        let due = m.written > 0 || m.held_since.is_some_and(|since| since + LAZY <= at);
        if may_commit && may_start && (m.written > 0 || m.forgets) && due {
            m.committing = m.written;
            m.committing_forgets = m.forgets;
            m.written = 0;
            m.forgets = false;
            m.held_since = None;
            out.push("commit".into());
        }
        let idle = m.loaded && m.committing == 0 && !m.committing_forgets;
        let commit_at = m
            .held_since
            .filter(|_| idle && m.retry_at.is_none())
            .map(|since| since + LAZY);
        steps.push(PeerStep {
            out,
            redial_at: m.redial_at,
            retry_at: m.retry_at,
            commit_at,
        });
    }
    Ok(PeerCase {
        steps,
        ..case.clone()
    })
}

/// A case with `events` and empty observations, for `generate`.
pub fn blank_case(seed: u64, dialable: bool, events: Vec<PeerEvent>) -> PeerCase {
    let steps = events
        .iter()
        .map(|_| PeerStep {
            out: Vec::new(),
            redial_at: None,
            retry_at: None,
            commit_at: None,
        })
        .collect();
    PeerCase {
        seed,
        dialable,
        events,
        steps,
    }
}

/// The events a generated case draws from, in enumeration order.
pub const ALPHABET: [PeerEventKind; 10] = [
    PeerEventKind::Tick,
    PeerEventKind::Loaded,
    PeerEventKind::LoadFailed,
    PeerEventKind::DialOk,
    PeerEventKind::DialFailed,
    PeerEventKind::Write,
    PeerEventKind::CommitOk,
    PeerEventKind::CommitFailed,
    PeerEventKind::Lost,
    PeerEventKind::Ack,
];

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    #[test]
    fn the_model_and_core_agree_on_a_hand_made_life() {
        use PeerEventKind::*;
        let events = [
            (0, LoadFailed),
            (10, Tick),
            (60, Tick),
            (60, Write),
            (60, Loaded),
            (60, Tick),
            (60, Write),
            (61, DialFailed),
            (61, CommitFailed),
            (400, Tick),
            (400, Tick),
            (400, CommitOk),
            (400, DialOk),
            (900, Lost),
            (2_000, Tick),
            (2_000, DialOk),
        ]
        .map(|(at, event)| PeerEvent { at, event })
        .to_vec();
        let case = blank_case(9, true, events);
        let core = core_peer(&case).expect("core runs it");
        let model = model_peer(&case).expect("the model runs it");
        assert_eq!(core.steps, model.steps);
        assert_eq!(core.steps[0].out, ["store_failed:load:1"]);
        assert_eq!(core.steps[3].out, ["refused"]);
        assert!(core.steps[15].out.contains(&"link_up".to_owned()));
    }

    #[test]
    fn forgetting_acked_ops_is_held_back_until_a_write_or_its_deadline() {
        use PeerEventKind::*;
        let events = [
            (0, Loaded),
            (0, Tick),
            (0, DialOk),
            (1, Write),
            (2, CommitOk),
            // The remote acks the open: its forgetting waits.
            (3, Ack),
            (12, Tick),
            // A write takes it along.
            (12, Write),
            (14, CommitOk),
            (15, Ack),
            // Alone, it goes 10 ms after it was made.
            (25, Tick),
            (26, CommitFailed),
            (30, Tick),
            (90, Tick),
            (91, CommitOk),
        ]
        .map(|(at, event)| PeerEvent { at, event })
        .to_vec();
        let case = blank_case(4, true, events);
        let core = core_peer(&case).expect("core runs it");
        let model = model_peer(&case).expect("the model runs it");
        assert_eq!(core.steps, model.steps);
        let outs: Vec<_> = core.steps.iter().map(|step| step.out.clone()).collect();
        assert_eq!(outs[2], ["bind", "link_up"], "{outs:?}");
        assert!(outs[5].is_empty());
        assert_eq!(core.steps[5].commit_at, Some(13));
        assert!(outs[6].is_empty());
        assert_eq!(outs[7], ["commit"]);
        assert_eq!(core.steps[9].commit_at, Some(25));
        assert_eq!(outs[10], ["commit"]);
        assert_eq!(outs[11], ["store_failed:commit:1"]);
        assert!(outs[12].is_empty());
        assert_eq!(outs[13], ["commit"]);
        assert_eq!(outs[14], ["store_recovered:commit"]);
    }

    #[test]
    fn jittered_waits_stay_within_the_policy() {
        let mut jitter = SplitMix(3);
        for failures in 1..30 {
            let w = wait(100, 10_000, failures, jitter.next());
            let ceiling = (100u64 << (failures - 1).min(20)).min(10_000);
            assert!(w >= ceiling / 2 && w <= ceiling);
        }
    }

    #[test]
    fn bytes_of_an_unbound_link_are_ignored() {
        let mut peer = Peer::new(PeerId::new("b"), true, true, 1);
        let _ = peer.poll_output();
        peer.handle_loaded(Time::ZERO, Ok(quiet_link("b")));
        peer.handle_link_bytes(Time::ZERO, 0, Bytes::from_static(b"junk"));
        assert!(peer.link().is_some_and(|link| !link.is_up()));
    }
}
