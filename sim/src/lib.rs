//! Deterministic simulation of the substrate shell under faults (turmoil).
//!
//! Two hosts run the real [`tether::substrate::Substrate`] over [`SimTransport`] with a
//! [`SimStore`] each: `a` opens objects on `b` and sends, requests and closes; `b` accepts
//! (or rejects, or its authorizer denies) and consumes. A schedule drawn from the seed
//! partitions the link (both ways or one way), holds and releases it (stragglers), raises
//! latency, crashes and restarts either host and runs reconnect storms. Afterwards the
//! network heals and the run continues until every op has an outcome.
//!
//! Checkers on every run: lost (acked or answered but never delivered), duplicated (one
//! message delivered under two seqs), reordered (per object), unexpected (never sent, or on
//! an object that was rejected or denied), acked-but-not-durable (a hop ack before the
//! receiver's commit), finality (a futile op that was delivered, an open that ended wrongly)
//! and liveness (the outboxes drain within a bound after the heal). The same seed gives the
//! same trace hash.

pub mod store;
pub mod transport;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};
use sha2::{Digest, Sha256};
use tether::substrate::{
    Auth, Authorizer, Code, Config, Denial, Error, Inbound, PeerId, Substrate,
};
use tether_core::limits::{SUBSTRATE_COMMANDS_MAX, SUBSTRATE_SEQ_RESERVE};
use tether_core::substrate::AuthorizeContext;
use tether_core::time::Time;
use tether_core::wire::envelope::ObjKind;

pub use store::{Disk, SimStore};
pub use transport::SimTransport;

/// Wall-clock origin of simulated time (2026-01-01), so stored times look real.
const EPOCH_MS: u64 = 1_767_225_600_000;
/// How long after the heal every op must have reached an outcome.
const LIVENESS_BOUND: Duration = Duration::from_secs(300);
/// Simulated time per turmoil step.
const TICK: Duration = Duration::from_millis(5);

/// A kind of fault the schedule may inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    /// Both directions cut, then repaired.
    Partition,
    /// One direction cut, then repaired.
    OneWay,
    /// Traffic held, then released at once (stragglers).
    Hold,
    /// Latency raised to a range, then restored.
    Latency,
    /// The sender host crashes and restarts later.
    CrashSender,
    /// The receiver host crashes and restarts later.
    CrashReceiver,
    /// Several short partitions in a row.
    Storm,
    /// Random message loss at a rate (turmoil's fail rate), then none.
    FailRate,
    /// The receiver's app stops consuming, then resumes (a stopped consumer; a receiver
    /// crash meanwhile is an app that restarts without consuming).
    Stall,
    /// A host's disk fails every load and commit for a while, then heals (a crash meanwhile
    /// restarts the host onto a disk that cannot load).
    Disk,
}

impl FaultKind {
    /// Every kind.
    pub const ALL: [FaultKind; 10] = [
        FaultKind::Partition,
        FaultKind::OneWay,
        FaultKind::Hold,
        FaultKind::Latency,
        FaultKind::CrashSender,
        FaultKind::CrashReceiver,
        FaultKind::Storm,
        FaultKind::FailRate,
        FaultKind::Stall,
        FaultKind::Disk,
    ];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Partition => "partition",
            FaultKind::OneWay => "oneway",
            FaultKind::Hold => "hold",
            FaultKind::Latency => "latency",
            FaultKind::CrashSender => "crash-a",
            FaultKind::CrashReceiver => "crash-b",
            FaultKind::Storm => "storm",
            FaultKind::FailRate => "fail-rate",
            FaultKind::Stall => "stall",
            FaultKind::Disk => "disk",
        }
    }
}

impl FromStr for FaultKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        FaultKind::ALL
            .into_iter()
            .find(|kind| kind.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = FaultKind::ALL.iter().map(|k| k.name()).collect();
                format!("unknown fault {s:?}; one of {}", names.join(", "))
            })
    }
}

/// What one run does.
#[derive(Debug, Clone)]
pub struct Options {
    /// Drives the workload, the fault schedule, turmoil and the shells' randomness.
    pub seed: u64,
    /// Fault kinds the schedule may draw from (empty: no faults).
    pub faults: Vec<FaultKind>,
    /// A deliberate bug, to show the checkers catch it (tests only).
    pub sabotage: Option<Sabotage>,
}

/// Deliberate bugs the checkers must catch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sabotage {
    /// The receiver's disk reports every third commit durable without keeping it.
    LyingReceiverDisk,
}

/// The outcome of one run.
#[derive(Debug, Clone)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// Simulated time until quiescence.
    pub simulated: Duration,
    /// Distinct messages (sends and reqs) delivered to the receiver's app.
    pub messages: u64,
    /// Faults injected, by kind.
    pub faults: BTreeMap<FaultKind, u32>,
    /// Every checker violation (empty: the run passed).
    pub violations: Vec<String>,
    /// How often the hard cases were exercised: `load failures`, `commit failures`,
    /// `stalls past W` (the consumer stopped long enough to fill the window), `deep objects`
    /// (objects pipelining at least 4 × W ops), `commands past the lane` (a's commands waited in
    /// their futures for room in the command lane).
    pub exercised: BTreeMap<&'static str, u64>,
    /// SHA-256 of the run's event trace.
    pub trace_hash: String,
    /// The event trace (simulated milliseconds, event).
    pub trace: Vec<String>,
}

impl Report {
    /// Whether every checker passed.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}

/// How the receiver treats an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Accept,
    Reject,
    Deny,
}

#[derive(Debug, Clone)]
struct Plan {
    obj: String,
    kind: ObjKind,
    count: u32,
    /// Ops issued before awaiting their outcomes (≥ 4 × W on deep objects).
    pipeline: u32,
    fate: Fate,
    /// Pause between pipelined batches, so that ops span the fault window.
    pause: Duration,
}

#[derive(Debug, Default)]
struct Progress {
    opened: bool,
    open_outcome: Option<String>,
    next: u32,
    acked: BTreeMap<u32, String>,
    answered: BTreeSet<u32>,
    futile: BTreeMap<u32, String>,
    finished: bool,
}

#[derive(Debug, Default)]
struct Ledger {
    log: Vec<String>,
    plans: Vec<Plan>,
    progress: BTreeMap<String, Progress>,
    /// Every delivery to b's app: (seq, op id, n), redeliveries included.
    delivered: BTreeMap<String, Vec<(u64, String, u32)>>,
    closed_at_receiver: BTreeSet<String>,
    /// The receiver's app does not consume while set (a `stall` fault).
    stalled: bool,
    /// Most items the stalled app held at once.
    stall_held_max: u64,
    /// Whether a's commands ever waited in their futures for room in the lane.
    commands_waited: bool,
    violations: Vec<String>,
    boots: BTreeMap<&'static str, u64>,
}

type Shared = Arc<Mutex<Ledger>>;

fn lock(ledger: &Shared) -> std::sync::MutexGuard<'_, Ledger> {
    ledger.lock().unwrap_or_else(PoisonError::into_inner)
}

fn sim_now() -> u64 {
    turmoil::sim_elapsed().unwrap_or_default().as_millis() as u64
}

impl Ledger {
    fn note(&mut self, line: String) {
        self.note_at(sim_now(), line);
    }

    fn note_at(&mut self, millis: u64, line: String) {
        self.log.push(format!("{millis} {line}"));
    }

    /// Op `n` of `obj`, issued at `issued_ms`, ended without success: futile (recorded for
    /// the finality check; only a TTL expiry after the TTL is a cause the schedule explains),
    /// refused (never sent: a store that could not load explains it, a full outbox does not,
    /// because `send` waits for room), or "shut down" on a running host (a violation).
    fn failed(&mut self, obj: &str, n: u32, issued_ms: u64, error: Error) {
        match error {
            Error::Futile(code) => {
                self.note(format!("futile {obj} #{n} {code}"));
                let waited = sim_now().saturating_sub(issued_ms);
                if code != Code::TtlExpired || waited < QUEUE_TTL.as_millis() as u64 {
                    self.violation(format!(
                        "{obj} #{n} ended futile ({code}) after {waited} ms: no cause in the schedule"
                    ));
                }
                self.progress
                    .get_mut(obj)
                    .expect("entry")
                    .futile
                    .insert(n, code.to_string());
            }
            Error::Shutdown => {
                self.violation(format!(
                    "{obj} #{n} resolved as shut down on a running host"
                ));
            }
            Error::Command(tether::substrate::CommandError::QueueFull) => {
                self.violation(format!("{obj} #{n} refused queue_full: send must wait"));
            }
            other => self.note(format!("refused {obj} #{n} {other}")),
        }
    }

    fn violation(&mut self, line: String) {
        self.note(format!("VIOLATION {line}"));
        self.violations.push(line);
    }
}

/// The queue TTL of every simulated host.
const QUEUE_TTL: Duration = Duration::from_secs(40);

/// `hard` draws what later sessions added (the receive window, deep pipelines, stalls and
/// disk faults) from a stream of its own, so that the main stream, and with it every older
/// seed's workload and network schedule, stays what it was.
fn config(rng: &mut Xoshiro256PlusPlus, hard: &mut Xoshiro256PlusPlus) -> Config {
    Config {
        in_flight_max: [1, 4, 32][rng.random_range(0..3)],
        receive_window: [4, 16, 64][hard.random_range(0..3)],
        keepalive: Duration::from_secs(2),
        dead_after: Duration::from_secs(6),
        gap_resync_after: Duration::from_secs(3),
        transient_retry: Duration::from_millis(200),
        queue_ttl: QUEUE_TTL,
        dedupe_retention: Duration::from_secs(3600),
        seq_reserve: [2, 16, SUBSTRATE_SEQ_RESERVE][hard.random_range(0..3)],
        ..Config::default()
    }
}

fn clock() -> tether::substrate::Clock {
    Arc::new(|| Time::from_millis(EPOCH_MS + sim_now()))
}

fn boot(ledger: &Shared, host: &'static str, seed: u64) -> u64 {
    let mut ledger = lock(ledger);
    let boots = ledger.boots.entry(host).or_default();
    *boots += 1;
    let count = *boots;
    ledger.note(format!("boot {host} #{count}"));
    // Each boot draws its own randomness: op ids must never repeat across boots.
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (count << 8) ^ u64::from(host.as_bytes()[0])
}

const KEY: &[u8] = b"simulated shared key";

async fn sender(
    ledger: Shared,
    disk: Arc<Mutex<Disk>>,
    receiver_disk: Arc<Mutex<Disk>>,
    seed: u64,
    config: Config,
) -> turmoil::Result {
    let boot_seed = boot(&ledger, "a", seed);
    let transport = SimTransport::bind(PeerId::new("a"), &[PeerId::new("b")]).await?;
    let substrate = Substrate::builder(PeerId::new("a"), transport)
        .auth(Auth::SharedKey(KEY.to_vec()))
        .authorize(Authorizer::new(tether::substrate::AllowAll))
        .store(Arc::new(SimStore::new(disk)))
        .config(config)
        .clock(clock())
        .seed(boot_seed)
        .start()?;
    let mut inbound = substrate.inbound().expect("fresh");
    let notes = ledger.clone();
    tokio::spawn(async move {
        while let Some(item) = inbound.recv().await {
            if let Inbound::Store { op, error, .. } = item {
                lock(&notes).note(format!("store a {} {error:?}", op.as_str()));
            }
        }
    });
    let bob = substrate.peer(&PeerId::new("b"));
    let plans = lock(&ledger).plans.clone();
    let mut tasks = Vec::new();
    for plan in plans {
        let (ledger, bob, receiver_disk) = (ledger.clone(), bob.clone(), receiver_disk.clone());
        tasks.push(tokio::spawn(async move {
            drive_object(&ledger, &bob, &receiver_disk, &plan).await;
        }));
    }
    for task in tasks {
        task.await?;
    }
    std::future::pending::<()>().await;
    Ok(())
}

async fn drive_object(
    ledger: &Shared,
    bob: &tether::substrate::Peer,
    receiver_disk: &Arc<Mutex<Disk>>,
    plan: &Plan,
) {
    let obj = plan.obj.as_str();
    let opened = lock(ledger)
        .progress
        .entry(obj.to_owned())
        .or_default()
        .opened;
    if !opened {
        let result = bob.open(plan.kind, obj, None).await;
        let mut l = lock(ledger);
        let outcome = match &result {
            Ok(()) => "accepted".to_owned(),
            Err(Error::Command(tether::substrate::CommandError::AlreadyOpen(_))) => {
                "recovered".to_owned()
            }
            Err(Error::Rejected(code)) => format!("rejected:{code}"),
            Err(Error::Futile(code)) => format!("futile:{code}"),
            Err(other) => format!("error:{other}"),
        };
        l.note(format!("open {obj} -> {outcome}"));
        let expected = match plan.fate {
            Fate::Accept => ["accepted", "recovered"].contains(&outcome.as_str()),
            Fate::Reject => outcome == "rejected:approval_denied" || outcome == "recovered",
            Fate::Deny => ["rejected:scope_denied", "futile:scope_denied", "recovered"]
                .contains(&outcome.as_str()),
        };
        // An open whose outcome went to an earlier boot is "recovered"; a TTL expiry while
        // partitioned is a legitimate end for any open.
        if !expected && outcome != "futile:ttl_expired" {
            l.violation(format!("open {obj} ({:?}) ended {outcome}", plan.fate));
        }
        let progress = l.progress.entry(obj.to_owned()).or_default();
        progress.opened = true;
        progress.open_outcome = Some(outcome.clone());
        if !(outcome == "accepted" || outcome == "recovered") {
            progress.finished = true;
            return;
        }
    }
    if lock(ledger).progress[obj].finished {
        return;
    }
    let queue = bob.queue(obj);
    let session = bob.session(obj);
    loop {
        let start = lock(ledger).progress[obj].next;
        if start >= plan.count {
            break;
        }
        let end = (start + plan.pipeline).min(plan.count);
        let mut sends = Vec::new();
        let mut reqs = Vec::new();
        let issued = sim_now();
        for n in start..end {
            let body = n.to_be_bytes().to_vec();
            lock(ledger).progress.get_mut(obj).expect("entry").next = n + 1;
            match plan.kind {
                ObjKind::Queue => sends.push((n, queue.send(body))),
                ObjKind::Session => reqs.push((n, session.req(body))),
            }
        }
        let backlog = bob.backlog();
        lock(ledger).commands_waited |= backlog.waiting > 0;
        if backlog.queued > SUBSTRATE_COMMANDS_MAX {
            lock(ledger).violation(format!(
                "a's command lane to b holds {} commands, past {SUBSTRATE_COMMANDS_MAX}",
                backlog.queued
            ));
        }
        for (n, pending) in sends {
            let result = pending.await;
            let mut l = lock(ledger);
            match result {
                Ok(op_id) => {
                    let durable = receiver_disk
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .ever_received
                        .contains(op_id.as_str());
                    if !durable {
                        l.violation(format!("{obj} #{n} acked but not durable at b"));
                    }
                    l.note(format!("ack {obj} #{n}"));
                    l.progress
                        .get_mut(obj)
                        .expect("entry")
                        .acked
                        .insert(n, op_id.to_string());
                }
                Err(error) => l.failed(obj, n, issued, error),
            }
        }
        for (n, pending) in reqs {
            let result = pending.await;
            let mut l = lock(ledger);
            match result {
                Ok(reply) => {
                    if reply.end.as_deref() != Some(&n.to_be_bytes()[..]) {
                        l.violation(format!("{obj} #{n} answered with a wrong body"));
                    }
                    l.note(format!("answer {obj} #{n}"));
                    l.progress.get_mut(obj).expect("entry").answered.insert(n);
                }
                Err(error) => l.failed(obj, n, issued, error),
            }
        }
        tokio::time::sleep(plan.pause).await;
    }
    let closed = match plan.kind {
        ObjKind::Queue => queue.close("done").await,
        ObjKind::Session => session.close("done").await,
    };
    let mut l = lock(ledger);
    l.note(format!("close {obj} -> {closed:?}"));
    l.progress.get_mut(obj).expect("entry").finished = true;
}

async fn receiver(
    ledger: Shared,
    disk: Arc<Mutex<Disk>>,
    seed: u64,
    config: Config,
) -> turmoil::Result {
    let boot_seed = boot(&ledger, "b", seed);
    let window = config.receive_window as usize;
    let transport = SimTransport::bind(PeerId::new("b"), &[]).await?;
    let deny = |ctx: &AuthorizeContext<'_>| {
        if ctx.obj.starts_with("deny/") {
            Err(Denial::scope_denied())
        } else {
            Ok(())
        }
    };
    let substrate = Substrate::builder(PeerId::new("b"), transport)
        .auth(Auth::SharedKey(KEY.to_vec()))
        .authorize(Authorizer::new(deny))
        .store(Arc::new(SimStore::new(disk)))
        .config(config)
        .clock(clock())
        .seed(boot_seed)
        .start()?;
    let mut inbound = substrate.inbound().expect("fresh");
    // What the app took and has not processed (it holds them while stalled).
    let mut holding: std::collections::VecDeque<Inbound> = std::collections::VecDeque::new();
    loop {
        let stalled = lock(&ledger).stalled;
        if !stalled {
            while let Some(item) = holding.pop_front() {
                consume(&ledger, item).await;
            }
        }
        let item = tokio::select! {
            item = inbound.recv() => item,
            () = tokio::time::sleep(STALL_POLL) => continue,
        };
        let Some(item) = item else { return Ok(()) };
        // What the app has not taken yet: at most a window of deliveries per object (the
        // inbox bound), its open and its close, and store notices.
        let backlog_max = lock(&ledger).plans.len() * (window + 2) + 16;
        if inbound.len() > backlog_max {
            lock(&ledger).violation(format!(
                "b's inbound channel holds {} items, past {backlog_max}",
                inbound.len()
            ));
        }
        match item {
            Inbound::Message(_) | Inbound::Request(_) if stalled => {
                let (obj, seq, op_id, body) = match &item {
                    Inbound::Message(m) => (&m.obj, m.seq, &m.op_id, &m.body),
                    Inbound::Request(r) => (&r.obj, r.seq, &r.req_id, &r.body),
                    _ => unreachable!("matched above"),
                };
                record_delivery(&ledger, obj, seq.get(), op_id, body);
                holding.push_back(item);
                let mut l = lock(&ledger);
                l.stall_held_max = l.stall_held_max.max(holding.len() as u64);
            }
            item => {
                if let Inbound::Message(m) = &item {
                    record_delivery(&ledger, &m.obj, m.seq.get(), &m.op_id, &m.body);
                }
                if let Inbound::Request(r) = &item {
                    record_delivery(&ledger, &r.obj, r.seq.get(), &r.req_id, &r.body);
                }
                consume(&ledger, item).await;
            }
        }
    }
}

/// How often a stalled receiver looks whether it may consume again.
const STALL_POLL: Duration = Duration::from_millis(100);

/// The receiver's app processes one item (already recorded as delivered).
async fn consume(ledger: &Shared, item: Inbound) {
    match item {
        Inbound::Open(open) => {
            let obj = open.obj.clone();
            let result = if obj.starts_with("rej/") {
                open.reject("approval_denied").await
            } else {
                open.accept().await
            };
            lock(ledger).note(format!("decided {obj} {result:?}"));
        }
        Inbound::Message(message) => message.done(),
        Inbound::Request(request) => {
            let (obj, seq, body) = (request.obj.clone(), request.seq, request.body.clone());
            if let Err(error) = request.end(body).await {
                lock(ledger).note(format!("answer {obj} seq {seq} refused: {error}"));
            }
        }
        Inbound::Closed { obj, .. } => {
            let mut l = lock(ledger);
            l.note(format!("closed {obj}"));
            l.closed_at_receiver.insert(obj.to_string());
        }
        Inbound::Store { op, error, .. } => {
            lock(ledger).note(format!("store b {} {error:?}", op.as_str()));
        }
        other => lock(ledger).violation(format!("unexpected inbound item {other:?}")),
    }
}

fn record_delivery(ledger: &Shared, obj: &str, seq: u64, op_id: &str, body: &[u8]) {
    let mut l = lock(ledger);
    let Ok(n) = <[u8; 4]>::try_from(body).map(u32::from_be_bytes) else {
        l.violation(format!("{obj} seq {seq}: unexpected body {body:?}"));
        return;
    };
    l.note(format!("deliver {obj} seq {seq} #{n}"));
    l.delivered
        .entry(obj.to_owned())
        .or_default()
        .push((seq, op_id.to_owned(), n));
}

/// One scheduled change to the simulated network or hosts.
#[derive(Debug, Clone)]
enum Action {
    Partition,
    Repair,
    PartitionOneWay(&'static str, &'static str),
    Hold,
    Release,
    Latency(Duration),
    Crash(&'static str),
    Restart(&'static str),
    FailRate(f64),
    Stall(bool),
    Disk(&'static str, bool),
}

/// The kinds later sessions added, drawn from the `hard` stream.
const HARD_KINDS: [FaultKind; 2] = [FaultKind::Stall, FaultKind::Disk];

fn schedule(
    rng: &mut Xoshiro256PlusPlus,
    hard: &mut Xoshiro256PlusPlus,
    kinds: &[FaultKind],
) -> (Vec<(Duration, Action)>, BTreeMap<FaultKind, u32>, Duration) {
    let mut actions = Vec::new();
    let mut counts = BTreeMap::new();
    let window = Duration::from_secs(rng.random_range(60..180));
    if kinds.is_empty() {
        return (actions, counts, Duration::from_secs(5));
    }
    let base: Vec<FaultKind> = kinds
        .iter()
        .copied()
        .filter(|kind| !HARD_KINDS.contains(kind))
        .collect();
    if !base.is_empty() {
        for _ in 0..rng.random_range(2..9) {
            let kind = base[rng.random_range(0..base.len())];
            let at = Duration::from_millis(rng.random_range(2_000..window.as_millis() as u64));
            let lasting = Duration::from_millis(rng.random_range(500..50_000));
            *counts.entry(kind).or_default() += 1;
            fault_actions(rng, kind, at, lasting, &mut actions);
        }
    }
    for kind in kinds.iter().filter(|kind| HARD_KINDS.contains(kind)) {
        for _ in 0..hard.random_range(0..3) {
            let at = Duration::from_millis(hard.random_range(2_000..window.as_millis() as u64));
            let lasting = Duration::from_millis(hard.random_range(500..30_000));
            *counts.entry(*kind).or_default() += 1;
            fault_actions(hard, *kind, at, lasting, &mut actions);
        }
    }
    actions.sort_by_key(|(at, _)| *at);
    let end = actions.last().map_or(window, |(at, _)| *at).max(window);
    (actions, counts, end)
}

/// The actions of one fault of `kind` starting `at` and `lasting`.
fn fault_actions(
    rng: &mut Xoshiro256PlusPlus,
    kind: FaultKind,
    at: Duration,
    lasting: Duration,
    actions: &mut Vec<(Duration, Action)>,
) {
    {
        match kind {
            FaultKind::Partition => {
                actions.push((at, Action::Partition));
                actions.push((at + lasting, Action::Repair));
            }
            FaultKind::OneWay => {
                let (from, to) = if rng.random_range(0..2) == 0 {
                    ("a", "b")
                } else {
                    ("b", "a")
                };
                actions.push((at, Action::PartitionOneWay(from, to)));
                actions.push((at + lasting, Action::Repair));
            }
            FaultKind::Hold => {
                actions.push((at, Action::Hold));
                actions.push((at + lasting / 4, Action::Release));
            }
            FaultKind::Latency => {
                let max = Duration::from_millis(rng.random_range(20..2_000));
                actions.push((at, Action::Latency(max)));
                actions.push((at + lasting, Action::Latency(Duration::from_millis(5))));
            }
            FaultKind::CrashSender | FaultKind::CrashReceiver => {
                let host = if kind == FaultKind::CrashSender {
                    "a"
                } else {
                    "b"
                };
                actions.push((at, Action::Crash(host)));
                actions.push((at + lasting / 2, Action::Restart(host)));
            }
            FaultKind::FailRate => {
                let rate = f64::from(rng.random_range(1..40u32)) / 1_000.0;
                actions.push((at, Action::FailRate(rate)));
                actions.push((at + lasting, Action::FailRate(0.0)));
            }
            FaultKind::Stall => {
                actions.push((at, Action::Stall(true)));
                actions.push((at + lasting, Action::Stall(false)));
            }
            FaultKind::Disk => {
                let host = if rng.random_range(0..2) == 0 {
                    "a"
                } else {
                    "b"
                };
                let down = lasting / 2;
                actions.push((at, Action::Disk(host, true)));
                if rng.random_range(0..2) == 0 {
                    // The host restarts onto the failing disk: its state cannot load.
                    actions.push((at + down / 3, Action::Crash(host)));
                    actions.push((at + down / 2, Action::Restart(host)));
                }
                actions.push((at + down, Action::Disk(host, false)));
            }
            FaultKind::Storm => {
                let mut t = at;
                for _ in 0..rng.random_range(3..8) {
                    actions.push((t, Action::Partition));
                    t += Duration::from_millis(rng.random_range(100..1_500));
                    actions.push((t, Action::Repair));
                    t += Duration::from_millis(rng.random_range(100..1_500));
                }
            }
        }
    }
}

/// The workload for a receiver with receive window `window`: 2–5 objects, some pipelining
/// at least 4 × W ops (deep), some with 1,000+ ops, plus a rejected and a denied object.
fn plans(rng: &mut Xoshiro256PlusPlus, hard: &mut Xoshiro256PlusPlus, window: u64) -> Vec<Plan> {
    let mut plans = Vec::new();
    let window = u32::try_from(window).expect("windows are small");
    for i in 0..rng.random_range(2..6) {
        let kind = if rng.random_range(0..3) == 0 {
            ObjKind::Session
        } else {
            ObjKind::Queue
        };
        let prefix = if kind == ObjKind::Queue { "q" } else { "s" };
        let mut count = rng.random_range(50..300);
        let deep = hard.random_range(0..3) == 0;
        let pipeline = if deep {
            hard.random_range(4 * window..6 * window + 1)
        } else {
            6
        };
        let mut long = false;
        if deep && hard.random_range(0..3) == 0 {
            count = hard.random_range(1_000..1_500);
            long = true;
        }
        plans.push(Plan {
            obj: format!("{prefix}/{i}"),
            kind,
            count,
            pipeline,
            fate: Fate::Accept,
            // A long object pauses a tenth as long, so it still finishes within the
            // liveness bound after the heal.
            pause: Duration::from_millis(rng.random_range(200..4_000) / if long { 10 } else { 1 }),
        });
    }
    plans.push(Plan {
        obj: "rej/0".to_owned(),
        kind: ObjKind::Queue,
        count: 3,
        pipeline: 6,
        fate: Fate::Reject,
        pause: Duration::ZERO,
    });
    plans.push(Plan {
        obj: "deny/0".to_owned(),
        kind: ObjKind::Session,
        count: 3,
        pipeline: 6,
        fate: Fate::Deny,
        pause: Duration::ZERO,
    });
    plans
}

/// Turns some queues into floods: 2,500–3,500 ops issued at once, past the outbox, the sends
/// that may wait for room (`SUBSTRATE_WAITING_SENDS_MAX`) and the command lane
/// (`SUBSTRATE_COMMANDS_MAX`) together, so that the task stops taking commands and callers
/// hold the rest.
fn flood_some(flood: &mut Xoshiro256PlusPlus, plans: &mut [Plan]) {
    for plan in plans.iter_mut() {
        if plan.fate == Fate::Accept && plan.kind == ObjKind::Queue && flood.random_range(0..6) == 0
        {
            plan.count = flood.random_range(2_500..3_500);
            plan.pipeline = plan.count;
            plan.pause = Duration::from_millis(flood.random_range(20..400));
        }
    }
}

/// tokio numbers tasks from one process-wide counter, and when turmoil crashes a host the order
/// in which tokio drops its tasks (so the order in which its sockets send RST and FIN) follows
/// those numbers. Every run therefore starts the counter where a fresh process does, modulo
/// [`TASK_ID_ALIGN`], so that a seed's trace does not depend on what ran before it in the
/// process (seed 1440 after seeds 1439 and 1439 did, before this).
fn align_task_ids() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime builds");
    runtime.block_on(async {
        loop {
            let task = tokio::spawn(async {});
            let id = task.id().to_string().parse::<u64>().ok();
            let _ = task.await;
            // Task ids count from 1 in a fresh process: stop when the next one is ≡ 1 (or at
            // once, should a tokio release print ids some other way).
            if id.is_none_or(|id| id % TASK_ID_ALIGN == 0) {
                return;
            }
        }
    });
}

/// The modulus of task-id alignment: a power of two above tokio's shard counts.
const TASK_ID_ALIGN: u64 = 4096;

/// Runs one seed to quiescence (or the liveness bound) and checks it.
///
/// The trace is a function of the seed as long as no other tokio work spawns tasks in the
/// process while it runs: run seeds one after another, not on parallel threads.
pub fn run(options: &Options) -> Report {
    align_task_ids();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(options.seed);
    let mut hard = Xoshiro256PlusPlus::seed_from_u64(options.seed.rotate_left(17) ^ 0x5eed_4a4d);
    let ledger: Shared = Arc::default();
    let window_b = [4, 16, 64][hard.random_range(0..3)];
    // A third stream for floods (added later still), so older seeds keep their schedules.
    let mut flood = Xoshiro256PlusPlus::seed_from_u64(options.seed.rotate_left(29) ^ 0xf1_00d5);
    let mut plans = plans(&mut rng, &mut hard, window_b);
    flood_some(&mut flood, &mut plans);
    lock(&ledger).plans = plans;
    let mut config_a = config(&mut rng, &mut hard);
    if flood.random_range(0..4) == 0 {
        // A small outbox: floods reach the waiting-sends bound and the command lane sooner.
        config_a.outbox_ops_max = 64;
    }
    let config_b = Config {
        receive_window: window_b,
        ..config(&mut rng, &mut hard)
    };
    let (actions, fault_counts, faults_end) = schedule(&mut rng, &mut hard, &options.faults);
    let disk_a: Arc<Mutex<Disk>> = Arc::default();
    let disk_b: Arc<Mutex<Disk>> = Arc::default();
    disk_a
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .window_max = Some(config_a.receive_window);
    disk_b
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .window_max = Some(config_b.receive_window);
    for (disk, config) in [(&disk_a, &config_a), (&disk_b, &config_b)] {
        disk.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .outbox_max = Some(config.outbox_ops_max as u64 + 2);
    }
    let disks = [("a", disk_a.clone()), ("b", disk_b.clone())];
    if options.sabotage == Some(Sabotage::LyingReceiverDisk) {
        disk_b
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .lies_every = Some(3);
    }

    let mut sim = turmoil::Builder::new()
        .simulation_duration(Duration::from_secs(24 * 3600))
        .tick_duration(TICK)
        .min_message_latency(Duration::from_millis(1))
        .max_message_latency(Duration::from_millis(5))
        .rng_seed(options.seed)
        .build();
    let seed = options.seed;
    {
        let (ledger, disk) = (ledger.clone(), disk_b.clone());
        sim.host("b", move || {
            receiver(ledger.clone(), disk.clone(), seed, config_b.clone())
        });
    }
    {
        let (ledger, disk, disk_b) = (ledger.clone(), disk_a.clone(), disk_b.clone());
        sim.host("a", move || {
            sender(
                ledger.clone(),
                disk.clone(),
                disk_b.clone(),
                seed,
                config_a.clone(),
            )
        });
    }

    let mut next_action = 0;
    let mut healed = false;
    let mut violations = Vec::new();
    loop {
        if let Err(error) = sim.step() {
            violations.push(format!("a host failed: {error}"));
            break;
        }
        let now = sim.elapsed();
        while next_action < actions.len() && actions[next_action].0 <= now {
            apply(&mut sim, &actions[next_action].1, &ledger, &disks);
            lock(&ledger).note_at(
                now.as_millis() as u64,
                format!("fault {:?}", actions[next_action].1),
            );
            next_action += 1;
        }
        if !healed && now >= faults_end {
            heal(&mut sim, &ledger, &disks);
            lock(&ledger).note_at(now.as_millis() as u64, "heal".to_owned());
            healed = true;
        }
        if healed {
            if quiescent(&ledger, &disk_a, &disk_b) {
                break;
            }
            if now >= faults_end + LIVENESS_BOUND {
                violations.push(format!(
                    "liveness: not quiescent {}s after the heal ({})",
                    LIVENESS_BOUND.as_secs(),
                    outstanding(&ledger, &disk_a, &disk_b)
                ));
                break;
            }
        }
    }
    let simulated = sim.elapsed();
    drop(sim);
    let ledger = std::mem::take(&mut *lock(&ledger));
    check(&ledger, &mut violations);
    let mut exercised = BTreeMap::new();
    for (host, disk) in &disks {
        let disk = disk.lock().unwrap_or_else(PoisonError::into_inner);
        *exercised.entry("load failures").or_default() += disk.failed_loads;
        *exercised.entry("commit failures").or_default() += disk.failed_commits;
        for over in disk.bound_violations.iter().take(3) {
            violations.push(format!("bound: host {host}: {over}"));
        }
    }
    exercised.insert(
        "stalls past W",
        u64::from(ledger.stall_held_max >= window_b),
    );
    let deep = ledger
        .plans
        .iter()
        .filter(|plan| u64::from(plan.pipeline) >= 4 * window_b)
        .count() as u64;
    exercised.insert("deep objects", deep);
    exercised.insert("commands past the lane", u64::from(ledger.commands_waited));
    let floods = ledger
        .plans
        .iter()
        .filter(|plan| plan.count >= 2_500)
        .count() as u64;
    exercised.insert("floods", floods);
    let messages = ledger
        .delivered
        .values()
        .map(|d| d.iter().map(|(_, _, n)| *n).collect::<BTreeSet<_>>().len() as u64)
        .sum();
    let mut hash = Sha256::new();
    for line in &ledger.log {
        hash.update(line.as_bytes());
        hash.update(b"\n");
    }
    Report {
        seed: options.seed,
        simulated,
        messages,
        faults: fault_counts,
        exercised,
        violations,
        trace_hash: hex::encode(hash.finalize()),
        trace: ledger.log,
    }
}

/// The hosts' disks, by host name.
type Disks = [(&'static str, Arc<Mutex<Disk>>); 2];

fn set_disk(disks: &Disks, host: &str, failing: bool) {
    for (name, disk) in disks {
        if *name == host {
            disk.lock().unwrap_or_else(PoisonError::into_inner).failing = failing;
        }
    }
}

fn apply(sim: &mut turmoil::Sim<'_>, action: &Action, ledger: &Shared, disks: &Disks) {
    match action {
        Action::Stall(stalled) => lock(ledger).stalled = *stalled,
        Action::Disk(host, failing) => set_disk(disks, host, *failing),
        Action::Partition => sim.partition("a", "b"),
        Action::Repair => {
            sim.repair("a", "b");
        }
        Action::PartitionOneWay(from, to) => sim.partition_oneway(*from, *to),
        Action::Hold => sim.hold("a", "b"),
        Action::Release => sim.release("a", "b"),
        Action::Latency(max) => sim.set_max_message_latency(*max),
        Action::Crash(host) => {
            if sim.is_host_running(*host) {
                sim.crash(*host);
            }
        }
        Action::Restart(host) => {
            if !sim.is_host_running(*host) {
                sim.bounce(*host);
            }
        }
        Action::FailRate(rate) => sim.set_fail_rate(*rate),
    }
}

fn heal(sim: &mut turmoil::Sim<'_>, ledger: &Shared, disks: &Disks) {
    lock(ledger).stalled = false;
    for host in ["a", "b"] {
        set_disk(disks, host, false);
    }
    sim.set_fail_rate(0.0);
    sim.repair("a", "b");
    sim.release("a", "b");
    sim.set_max_message_latency(Duration::from_millis(5));
    for host in ["a", "b"] {
        if !sim.is_host_running(host) {
            sim.bounce(host);
        }
    }
}

/// Every object finished at the sender, and nothing is left in either durable outbox or
/// inbox.
fn quiescent(ledger: &Shared, disk_a: &Arc<Mutex<Disk>>, disk_b: &Arc<Mutex<Disk>>) -> bool {
    let finished = {
        let l = lock(ledger);
        l.plans
            .iter()
            .all(|plan| l.progress.get(&plan.obj).is_some_and(|p| p.finished))
    };
    let drained = |disk: &Arc<Mutex<Disk>>| {
        let disk = disk.lock().unwrap_or_else(PoisonError::into_inner);
        disk.peers
            .values()
            .all(|state| state.outbox.is_empty() && state.inbox.is_empty() && state.held.is_empty())
    };
    finished && drained(disk_a) && drained(disk_b)
}

/// What keeps a run from quiescence.
fn outstanding(ledger: &Shared, disk_a: &Arc<Mutex<Disk>>, disk_b: &Arc<Mutex<Disk>>) -> String {
    let mut parts = Vec::new();
    {
        let l = lock(ledger);
        for plan in &l.plans {
            if !l.progress.get(&plan.obj).is_some_and(|p| p.finished) {
                let next = l.progress.get(&plan.obj).map_or(0, |p| p.next);
                parts.push(format!("{} unfinished at #{next}/{}", plan.obj, plan.count));
            }
        }
    }
    for (name, disk) in [("a", disk_a), ("b", disk_b)] {
        let disk = disk.lock().unwrap_or_else(PoisonError::into_inner);
        for state in disk.peers.values() {
            let rows = |map: &BTreeMap<
                (tether_core::substrate::Address, tether_core::substrate::Seq),
                tether_core::substrate::Op,
            >| {
                map.keys()
                    .map(|(o, s)| format!("{o}:{s}"))
                    .take(4)
                    .collect::<Vec<_>>()
            };
            for (what, map) in [
                ("outbox", &state.outbox),
                ("held", &state.held),
                ("inbox", &state.inbox),
            ] {
                if !map.is_empty() {
                    parts.push(format!("{name} {what} {} {:?}", map.len(), rows(map)));
                }
            }
        }
    }
    parts.join("; ")
}

fn check(ledger: &Ledger, violations: &mut Vec<String>) {
    violations.extend(ledger.violations.iter().cloned());
    for plan in &ledger.plans {
        let obj = &plan.obj;
        let progress = ledger.progress.get(obj);
        let deliveries = ledger
            .delivered
            .get(obj)
            .map(Vec::as_slice)
            .unwrap_or_default();
        if plan.fate != Fate::Accept && !deliveries.is_empty() {
            violations.push(format!(
                "unexpected: {obj} was {:?} but delivered",
                plan.fate
            ));
        }
        // Order and duplicates: a seq seen again must carry the same message (a redelivery
        // of an unconsumed message after a restart); a new seq must be above every seq and
        // message before it.
        let mut by_seq: BTreeMap<u64, u32> = BTreeMap::new();
        let mut seqs_of: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
        let (mut top_seq, mut top_n) = (None, None);
        for (seq, _, n) in deliveries {
            match by_seq.get(seq) {
                Some(first) if first != n => {
                    violations.push(format!("{obj}: seq {seq} carried #{first} then #{n}"));
                }
                Some(_) => {}
                None => {
                    if top_seq.is_some_and(|top| *seq <= top) || top_n.is_some_and(|top| *n <= top)
                    {
                        violations.push(format!(
                            "reordered: {obj} seq {seq} #{n} after seq {top_seq:?} #{top_n:?}"
                        ));
                    }
                    top_seq = Some(*seq);
                    top_n = Some(*n);
                    by_seq.insert(*seq, *n);
                }
            }
            seqs_of.entry(*n).or_default().insert(*seq);
        }
        for (n, seqs) in &seqs_of {
            if seqs.len() > 1 {
                violations.push(format!("duplicated: {obj} #{n} delivered at seqs {seqs:?}"));
            }
        }
        let Some(progress) = progress else { continue };
        for n in seqs_of.keys() {
            if *n >= progress.next {
                violations.push(format!("unexpected: {obj} #{n} was never sent"));
            }
        }
        for n in progress.acked.keys().chain(progress.answered.iter()) {
            if !seqs_of.contains_key(n) {
                violations.push(format!(
                    "lost: {obj} #{n} acked or answered, never delivered"
                ));
            }
        }
        for (n, code) in &progress.futile {
            if seqs_of.contains_key(n) {
                violations.push(format!(
                    "finality: {obj} #{n} futile ({code}) but delivered"
                ));
            }
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let faults: Vec<String> = self
            .faults
            .iter()
            .map(|(kind, n)| format!("{}={n}", kind.name()))
            .collect();
        write!(
            f,
            "seed {:>6}  {:>8.1}s simulated  {:>5} messages  faults [{}]  {}  trace {}",
            self.seed,
            self.simulated.as_secs_f64(),
            self.messages,
            faults.join(" "),
            if self.passed() { "ok" } else { "FAILED" },
            &self.trace_hash[..16],
        )
    }
}
