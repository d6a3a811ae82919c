//! `tether-bench`: durable end-to-end throughput of the substrate beside the brokers people
//! would otherwise reach for, one producer and one consumer, same workload, same run.
//!
//! - tether: every message synced to disk on both sides before it is acknowledged, on each
//!   store (`SqliteStore`: WAL, `synchronous=FULL`; `LogStore`: an append-only file,
//!   `fdatasync` per commit), over TCP and over iroh on 127.0.0.1, with 1 and 16 queues and
//!   windows 1 and 32; its fsync'd commits per message are counted.
//! - NATS JetStream and mosquitto ([`brokers`]), each started on 127.0.0.1 when its server is
//!   on `PATH` and skipped with a sentence otherwise; their fsyncs are counted under `strace`
//!   when it is on `PATH`.
//! - The bounds tether sits against, in the same process: raw SQLite inserts of the same rows
//!   committed 1, 32 and 512 at a time, raw iroh stream frames of the same size, and (with
//!   `--sync`) the disk's own sync latency: one append and `fdatasync` at a time, which the
//!   awaited send's p50 is read against, and the network's round trip: one message and a
//!   16-byte answer at a time over a raw iroh stream. An awaited send's floor is the
//!   receiver's sync plus that round trip (the sender's sync runs while the send travels);
//!   below the goals table is how far above it the send is.
//!
//! Every run is checked: each message delivered exactly once and in order per queue (the
//! table says so, and the process exits non-zero otherwise). Latency is from the producer's
//! send to the consumer's delivery. `--sync` adds single-message durable latency: one send
//! awaited at a time (and JetStream's synchronous publish beside it). The table is printed as
//! Markdown and drawn as an SVG bar chart (`--plot`). `--trace-commits PATH` writes one CSV
//! line per tether commit (which run and side, when it started, how long it took, and the
//! records it wrote by kind): how a window is cut into commits, and what each side's disk does.
//!
//! ```sh
//! cargo run --release -p tether-benches --bin tether-bench -- --messages 20000 --size 1024
//! ```

mod brokers;
mod plot;

use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use tether::node::Node;
use tether::store::{LogStore, SqliteStore, Store, StoreError};
use tether::substrate::{
    AllowAll, Auth, Authorizer, Config, Inbound, OpId, PeerId, Pending, Substrate, TcpTransport,
};
use tether_core::substrate::{effective_records, DurableState, PersistBatch, Record};
use tokio::sync::watch;

/// Which store both sides of a tether run keep their state in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoreKind {
    /// [`SqliteStore`]: WAL, `synchronous=FULL`.
    Sqlite,
    /// [`LogStore`]: one append-only file, `fdatasync` per commit.
    Log,
}

impl StoreKind {
    fn open(self, path: &Path) -> Arc<dyn Store> {
        match self {
            StoreKind::Sqlite => Arc::new(SqliteStore::open(path).expect("sqlite")),
            StoreKind::Log => Arc::new(LogStore::open(path).expect("log")),
        }
    }

    /// How a row names it.
    fn label(self) -> &'static str {
        match self {
            StoreKind::Sqlite => "SQLite",
            StoreKind::Log => "log",
        }
    }

    /// What `--only` keys of its runs start with.
    fn key_prefix(self) -> &'static str {
        match self {
            StoreKind::Sqlite => "",
            StoreKind::Log => "log-",
        }
    }
}

/// Which carrier a run goes over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Carrier {
    Tcp,
    Iroh,
}

/// One configuration's result.
pub(crate) struct Row {
    what: String,
    messages: u64,
    seconds: f64,
    p50_ms: f64,
    p99_ms: f64,
    verdict: String,
    /// Fsyncs (or fsync'd commits, for tether) per message, both sides, where counted.
    fsyncs_per_message: Option<f64>,
    /// CPU time (user and system, every thread) per message: this process for tether, this
    /// process's client plus the server for a broker. Steadier than msg/s on a noisy machine.
    cpu_us_per_message: Option<f64>,
    /// For tether: the share of the run's wall time each side's store spent in commits
    /// (sender, receiver). A store near 100% busy is the bound; one that idles waits on
    /// something else.
    store_busy: Option<[f64; 2]>,
    /// Kilobytes written to storage per message: by this process for tether and raw SQLite
    /// (every page of the WAL and of checkpoints, both sides), by the server for a broker.
    /// What the disk is asked to carry; the body alone is the message size.
    written_kb_per_message: Option<f64>,
}

impl Row {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.seconds.max(1e-9)
    }

    /// Cores this process (and a broker's server) kept busy on average.
    fn cores(&self) -> Option<f64> {
        self.cpu_us_per_message.map(|cpu| cpu * self.rate() / 1e6)
    }

    /// What a tether run sits against, from what it measured. Messages that barely share a
    /// commit wait on its latency; a store committing most of the run while tens of
    /// messages share each commit is the disk (the rest of its time is the hand-over between
    /// back-to-back commits); nearly every core busy is the CPU; otherwise messages wait on the
    /// window while commits complete (each side commits one group at a time, and credit
    /// returns after the consumer's commit).
    fn bound(&self, cores_available: f64) -> String {
        let (Some([sender, receiver]), Some(fsyncs)) = (self.store_busy, self.fsyncs_per_message)
        else {
            return "–".to_owned();
        };
        let cores = self.cores().unwrap_or(0.0);
        if fsyncs >= LATENCY_BOUND_FSYNCS {
            "commit latency".to_owned()
        } else if sender.max(receiver) >= DISK_BOUND_BUSY && fsyncs <= DISK_BOUND_FSYNCS {
            let side = if sender >= receiver {
                "sender"
            } else {
                "receiver"
            };
            format!("disk ({side}'s store)")
        } else if cores >= CPU_BOUND_SHARE * cores_available {
            "CPU".to_owned()
        } else {
            "window × commit latency".to_owned()
        }
    }
}

/// Sends a durable run keeps unacknowledged on each queue (the outside harness of the
/// durable-messaging issue kept 800): far more than a queue's window, so the window and the
/// commits pace the run, never the producer.
const SENDS_PENDING_PER_QUEUE: usize = 800;

/// Fsync'd commits per message at or above which messages barely share a commit: each waits
/// on commits of its own.
const LATENCY_BOUND_FSYNCS: f64 = 0.5;

/// A store committing at least this share of a run's wall time, with at least 20 messages
/// sharing each commit ([`DISK_BOUND_FSYNCS`]), is what bounds the run.
const DISK_BOUND_BUSY: f64 = 0.75;

/// Fsync'd commits per message at or below which commits are large enough that the disk's
/// throughput, not its latency, is what a busy store shows.
const DISK_BOUND_FSYNCS: f64 = 0.05;

/// A run keeping at least this share of the machine's cores busy is bound by the CPU.
const CPU_BOUND_SHARE: f64 = 0.85;

/// What the consumer saw: per queue the message indices in arrival order, and when each came.
#[derive(Default)]
pub(crate) struct Seen {
    by_queue: BTreeMap<String, Vec<u64>>,
    arrived: Vec<(u64, Instant)>,
}

impl Seen {
    fn record(&mut self, queue: &str, index: u64) {
        match self.by_queue.get_mut(queue) {
            Some(indices) => indices.push(index),
            None => {
                self.by_queue.insert(queue.to_owned(), vec![index]);
            }
        }
        self.arrived.push((index, Instant::now()));
    }

    /// Milliseconds from each message's send (`sent_at`, by index) to its arrival.
    fn latencies_ms(&self, sent_at: &[Instant]) -> Vec<f64> {
        self.arrived
            .iter()
            .map(|(index, at)| at.duration_since(sent_at[*index as usize]).as_secs_f64() * 1e3)
            .collect()
    }
}

/// CPU time (user and system, all threads) process `pid` (this one when `None`) has used so
/// far: this process's from `clock_gettime`, another's from `/proc` (Linux; `None`
/// elsewhere), where the kernel counts it in `USER_HZ` ticks, 100 per second on Linux.
pub(crate) fn cpu_seconds(pid: Option<u32>) -> Option<f64> {
    let Some(pid) = pid else {
        // This process: to the nanosecond, every thread it ran, ended ones included (the
        // kernel's tick counts in `/proc/self/stat` would round 20,000 messages' CPU to
        // 0.5 µs a message).
        let spent = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
        return Some(spent.tv_sec as f64 + spent.tv_nsec as f64 / 1e9);
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at the state, field 3;
    // utime and stime are fields 14 and 15, in clock ticks (10 ms).
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// Bytes the disk holding `dir` has written so far, after flushing that file system's dirty
/// pages (Linux: sectors written, from `/sys/dev/block/MAJOR:MINOR/stat`; `None` elsewhere).
///
/// Counted at the device, not per process: a broker that never syncs leaves its writes in the
/// page cache (the flush counts them), and the kernel's per-process `write_bytes` charges a
/// synced overwrite of a file's existing blocks far more than the disk writes (measured here:
/// 2 MiB a commit, against 5.4 KB at the device). Other processes' writes count too, so the
/// machine should be otherwise quiet.
pub(crate) fn written_bytes(dir: &Path) -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::MetadataExt;
        // `sync -f`: syncfs(2) on the file system holding `dir`.
        let flushed = std::process::Command::new("sync")
            .arg("-f")
            .arg(dir)
            .status()
            .ok()?;
        if !flushed.success() {
            return None;
        }
        let dev = std::fs::metadata(dir).ok()?.dev();
        let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
        let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
        let stat = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/stat")).ok()?;
        let sectors: u64 = stat.split_whitespace().nth(6)?.parse().ok()?;
        Some(sectors * 512)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = dir;
        None
    }
}

/// Kilobytes written per message between two [`written_bytes`] readings.
pub(crate) fn written_kb_per_message(
    before: Option<u64>,
    after: Option<u64>,
    messages: u64,
) -> Option<f64> {
    Some(after?.saturating_sub(before?) as f64 / 1e3 / messages.max(1) as f64)
}

/// CPU microseconds per message between two [`cpu_seconds`] readings.
pub(crate) fn cpu_per_message(
    before: Option<f64>,
    after: Option<f64>,
    messages: u64,
) -> Option<f64> {
    Some((after? - before?) / messages.max(1) as f64 * 1e6)
}

/// The index a body carries in its first 8 bytes (`u64::MAX` for a body too short to).
fn index_of(body: &[u8]) -> u64 {
    body.get(..8)
        .and_then(|prefix| prefix.try_into().ok())
        .map_or(u64::MAX, u64::from_be_bytes)
}

/// A store whose commits (one sync each) are counted and timed, run as the store itself would
/// run them: a commit the store takes in place on the caller's worker
/// ([`Store::commit_in_place`]) is taken so here too, or the bench would measure every commit
/// handed to the blocking pool where a user's small ones are not.
struct Counted {
    store: Arc<dyn Store>,
    commits: Arc<AtomicU64>,
    /// Nanoseconds spent in commits.
    busy_ns: Arc<AtomicU64>,
    /// Where its commits are traced, with `--trace-commits`.
    trace: Option<CommitTrace>,
}

/// The file `--trace-commits` names, once opened.
static COMMIT_TRACE: OnceLock<Mutex<std::io::BufWriter<std::fs::File>>> = OnceLock::new();

/// One store's commits, traced: the run (its key), the side, and when the run's pair began.
struct CommitTrace {
    run: String,
    side: &'static str,
    began: Instant,
}

/// The columns of a commit's trace line: the records a commit writes, by kind.
const TRACE_KINDS: [&str; 8] = [
    "objects",
    "outbox",
    "outbox_removed",
    "held",
    "held_removed",
    "inbox",
    "inbox_removed",
    "bounces",
];

impl CommitTrace {
    fn header() -> String {
        format!(
            "run,side,start_us,duration_us,in_place,batches,records,{}",
            TRACE_KINDS.join(",")
        )
    }

    /// One line: what the commit that started at `started` and took `spent` nanoseconds
    /// wrote (its effective records, those a store writes, by kind).
    fn line(
        &self,
        started: Instant,
        spent: u64,
        in_place: bool,
        batches: &[PersistBatch],
    ) -> String {
        let mut kinds = [0usize; TRACE_KINDS.len()];
        let written = effective_records(batches);
        for record in &written {
            kinds[match record {
                Record::Object(_) | Record::ObjectRemoved { .. } => 0,
                Record::Outbox(_) => 1,
                Record::OutboxRemoved { .. } => 2,
                Record::Held(_) => 3,
                Record::HeldRemoved { .. } => 4,
                Record::Inbox(_) => 5,
                Record::InboxRemoved { .. } => 6,
                Record::Bounce { .. } | Record::BounceRemoved { .. } => 7,
            }] += 1;
        }
        let kinds: Vec<String> = kinds.iter().map(usize::to_string).collect();
        format!(
            "{},{},{},{},{},{},{},{}",
            self.run,
            self.side,
            started.saturating_duration_since(self.began).as_micros(),
            spent / 1_000,
            in_place,
            batches.len(),
            written.len(),
            kinds.join(",")
        )
    }
}

impl Counted {
    fn traced(&self, started: Instant, spent: u64, in_place: bool, batches: &[PersistBatch]) {
        if let (Some(trace), Some(file)) = (&self.trace, COMMIT_TRACE.get()) {
            let line = trace.line(started, spent, in_place, batches);
            let _ = writeln!(file.lock().expect("lock"), "{line}");
        }
    }
}

impl Store for Counted {
    fn load(&self, peer: &PeerId) -> Result<DurableState, StoreError> {
        self.store.load(peer)
    }

    fn commit(&self, peer: &PeerId, batches: &[PersistBatch]) -> Result<(), StoreError> {
        self.commits.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let committed = self.store.commit(peer, batches);
        let spent = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.busy_ns.fetch_add(spent, Ordering::Relaxed);
        self.traced(started, spent, false, batches);
        committed
    }

    fn peers(&self) -> Result<Vec<PeerId>, StoreError> {
        self.store.peers()
    }

    fn is_blocking(&self) -> bool {
        self.store.is_blocking()
    }

    fn commit_in_place(
        &self,
        peer: &PeerId,
        batches: &[PersistBatch],
    ) -> Option<Result<(), StoreError>> {
        let started = Instant::now();
        let committed = self.store.commit_in_place(peer, batches)?;
        self.commits.fetch_add(1, Ordering::Relaxed);
        let spent = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.busy_ns.fetch_add(spent, Ordering::Relaxed);
        self.traced(started, spent, true, batches);
        Some(committed)
    }
}

struct Options {
    messages: u64,
    size: usize,
    sync: bool,
    brokers: bool,
    /// Run only the configurations whose key contains one of these (all when empty).
    only: Vec<String>,
    plot: PathBuf,
    /// How many times the whole selection runs; the table shows each configuration's median
    /// and its ratios as medians of the ratios within a round.
    rounds: u64,
    /// Rounds run first and not reported (`--warm-up N`, 1 unless told).
    warm_up: u64,
    /// Where every tether commit is traced, one CSV line each (`--trace-commits PATH`).
    trace_commits: Option<PathBuf>,
}

impl Options {
    /// Whether the configuration keyed `key` (`iroh-16-32`, `tcp-sync`, `jetstream`,
    /// `mosquitto`, `raw-iroh`, `raw-sqlite-32`, ...) runs.
    fn runs(&self, key: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|only| key.contains(only.as_str()))
    }
}

fn parse_args() -> Result<Options, String> {
    let mut options = Options {
        messages: 20_000,
        size: 1024,
        sync: false,
        brokers: true,
        only: Vec::new(),
        plot: PathBuf::from("tether-bench.svg"),
        rounds: 1,
        warm_up: 1,
        trace_commits: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or(format!("{name} takes a number"))
        };
        match arg.as_str() {
            "--messages" => options.messages = value("--messages")?,
            "--size" => options.size = value("--size")? as usize,
            "--rounds" => options.rounds = value("--rounds")?.max(1),
            "--warm-up" => options.warm_up = value("--warm-up")?,
            "--sync" => options.sync = true,
            "--no-brokers" => options.brokers = false,
            "--only" => options.only.push(args.next().ok_or("--only takes a key")?),
            "--plot" => {
                options.plot = args
                    .next()
                    .map(PathBuf::from)
                    .ok_or("--plot takes a path")?
            }
            "--trace-commits" => {
                options.trace_commits = Some(
                    args.next()
                        .map(PathBuf::from)
                        .ok_or("--trace-commits takes a path")?,
                )
            }
            // cargo bench passes --bench; nothing else is accepted.
            "--bench" => {}
            other => {
                return Err(format!(
                    "unknown argument {other:?} (--messages N, --size B, --rounds N, \
                     --warm-up N, --sync, --no-brokers, --only KEY, --plot PATH, \
                     --trace-commits PATH)"
                ))
            }
        }
    }
    if options.size < 8 {
        return Err("--size must be at least 8 (each body carries its index)".into());
    }
    Ok(options)
}

fn main() -> std::process::ExitCode {
    let options = match parse_args() {
        Ok(options) => options,
        Err(error) => {
            eprintln!("tether-bench: {error}");
            return std::process::ExitCode::from(2);
        }
    };
    if let Some(path) = &options.trace_commits {
        let opened = std::fs::File::create(path).and_then(|file| {
            let mut file = std::io::BufWriter::new(file);
            writeln!(file, "{}", CommitTrace::header())?;
            Ok(file)
        });
        match opened {
            Ok(file) => {
                let _ = COMMIT_TRACE.set(Mutex::new(file));
            }
            Err(error) => {
                eprintln!("tether-bench: --trace-commits {}: {error}", path.display());
                return std::process::ExitCode::from(2);
            }
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let dir = std::env::temp_dir().join(format!("tether-bench-{}", std::process::id()));
    // Unmeasured rounds first: the first round in a fresh process ran 20–40% more CPU per
    // message than the rounds after it (the allocator's arenas and the page tables still
    // growing, thread pools still starting), which no configuration pays in steady state.
    for round in 1..=options.warm_up {
        eprintln!(
            "warm-up round {round} of {} (not measured)",
            options.warm_up
        );
        let _ = run_round(&options, &runtime, &dir);
    }
    let mut rounds = Vec::new();
    let mut skipped = Vec::new();
    for round in 1..=options.rounds {
        if options.rounds > 1 {
            eprintln!("round {round} of {}", options.rounds);
        }
        let (rows, why) = run_round(&options, &runtime, &dir);
        rounds.push(rows);
        skipped = why;
    }
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(file) = COMMIT_TRACE.get() {
        if let Err(error) = file.lock().expect("lock").flush() {
            eprintln!("tether-bench: the commit trace was not written whole: {error}");
        }
    }
    let summaries = summarize(&rounds);
    print_table(&summaries, options.size, options.rounds);
    print_goals(&rounds);
    for why in &skipped {
        println!("\nskipped: {why}");
    }
    let medians: Vec<&Row> = summaries.iter().map(|summary| summary.row).collect();
    match plot::write(&options.plot, &medians, options.size) {
        Ok(()) => println!("\nplot: {}", options.plot.display()),
        Err(error) => eprintln!("tether-bench: the plot was not written: {error}"),
    }
    if rounds.iter().flatten().all(|row| row.verdict == "ok") {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}

/// Every selected configuration once, in a fixed order; the rows, and why brokers were
/// skipped.
fn run_round(
    options: &Options,
    runtime: &tokio::runtime::Runtime,
    dir: &Path,
) -> (Vec<Row>, Vec<String>) {
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    for store in [StoreKind::Sqlite, StoreKind::Log] {
        for carrier in [Carrier::Iroh, Carrier::Tcp] {
            let name = format!(
                "{}{}",
                store.key_prefix(),
                format!("{carrier:?}").to_lowercase()
            );
            for (queues, window) in [(1, 1), (1, 32), (16, 32)] {
                let key = format!("{name}-{queues}-{window}");
                if !options.runs(&key) {
                    continue;
                }
                let row = runtime.block_on(durable_run(
                    &dir.join(key),
                    carrier,
                    store,
                    queues,
                    window,
                    options.messages,
                    options.size,
                ));
                eprintln!("{}: {:.0} msg/s ({})", row.what, row.rate(), row.verdict);
                rows.push(row);
            }
            let key = format!("{name}-sync");
            if options.sync && options.runs(&key) {
                let row = runtime.block_on(sync_run(
                    &dir.join(key),
                    carrier,
                    store,
                    options.messages.min(2_000),
                    options.size,
                ));
                eprintln!("{}: {:.0} msg/s", row.what, row.rate());
                rows.push(row);
            }
        }
    }
    if options.brokers {
        let mut outcomes = Vec::new();
        if options.runs("jetstream-tuned") {
            outcomes.push(runtime.block_on(brokers::jetstream(
                &dir.join("nats-tuned"),
                options.messages,
                options.size,
                brokers::JetStreamShape::Tuned,
            )));
        }
        if options.runs("jetstream-defaults") {
            outcomes.push(runtime.block_on(brokers::jetstream(
                &dir.join("nats"),
                options.messages,
                options.size,
                brokers::JetStreamShape::Defaults,
            )));
        }
        if options.sync && options.runs("jetstream-sync") {
            outcomes.push(runtime.block_on(brokers::jetstream(
                &dir.join("nats-sync"),
                options.messages.min(2_000),
                options.size,
                brokers::JetStreamShape::Sync,
            )));
        }
        if options.runs("mosquitto") {
            outcomes.push(runtime.block_on(brokers::mosquitto(
                &dir.join("mosquitto"),
                options.messages,
                options.size,
            )));
        }
        for outcome in outcomes {
            match outcome {
                brokers::Outcome::Ran(row) => {
                    eprintln!("{}: {:.0} msg/s ({})", row.what, row.rate(), row.verdict);
                    rows.push(row);
                }
                brokers::Outcome::Skipped(why) => {
                    eprintln!("skipped: {why}");
                    skipped.push(why);
                }
            }
        }
    }
    if options.sync && options.runs("disk-sync") {
        let row = disk_sync(
            &dir.join("disk-sync"),
            options.messages.min(2_000),
            options.size,
        );
        eprintln!("{}: p50 {:.3} ms", row.what, row.p50_ms);
        rows.push(row);
    }
    if options.runs("raw-iroh") {
        let row = runtime.block_on(raw_iroh(options.messages * 4, options.size));
        eprintln!("{}: {:.0} frames/s", row.what, row.rate());
        rows.push(row);
    }
    if options.sync && options.runs("iroh-round-trip") {
        let row = runtime.block_on(iroh_round_trip(options.messages.min(2_000), options.size));
        eprintln!("{}: p50 {:.3} ms", row.what, row.p50_ms);
        rows.push(row);
    }
    for group in [1u64, 32, 512] {
        if !options.runs(&format!("raw-sqlite-{group}")) {
            continue;
        }
        let row = raw_sqlite(
            &dir.join(format!("raw-{group}")),
            options.messages,
            options.size,
            group,
        );
        eprintln!("{}: {:.0} rows/s", row.what, row.rate());
        rows.push(row);
    }
    (rows, skipped)
}

/// Two substrates over one carrier, and what a run needs to drive and count them.
struct Pair {
    sender: Substrate,
    receiver: Substrate,
    to: PeerId,
    nodes: Vec<Node>,
    /// Commits (fsyncs of the WAL) of both sides' stores.
    commits: Arc<AtomicU64>,
    /// Nanoseconds each side's store spent committing: sender, receiver.
    busy_ns: [Arc<AtomicU64>; 2],
}

impl Pair {
    fn busy_ns(&self) -> [u64; 2] {
        self.busy_ns
            .each_ref()
            .map(|busy| busy.load(Ordering::Relaxed))
    }
}

/// The share of `seconds` each side's store spent committing between two [`Pair::busy_ns`]
/// readings.
fn store_busy(before: [u64; 2], after: [u64; 2], seconds: f64) -> [f64; 2] {
    [0, 1].map(|side| (after[side] - before[side]) as f64 / 1e9 / seconds.max(1e-9))
}

/// A sender and a receiver substrate over `carrier`, each with its own `store` in `dir`.
async fn pair(dir: &Path, carrier: Carrier, store: StoreKind, window: usize) -> Pair {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("bench dir");
    let config = Config {
        in_flight_max: window,
        ..Config::default()
    };
    let commits = Arc::new(AtomicU64::new(0));
    let busy_ns: [Arc<AtomicU64>; 2] = Default::default();
    // The run's key: its directory is named after it.
    let run = dir
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    let began = Instant::now();
    let store = |name: &str, busy_ns: &Arc<AtomicU64>| -> Arc<dyn Store> {
        let side = if name.starts_with("alice") {
            "sender"
        } else {
            "receiver"
        };
        Arc::new(Counted {
            store: store.open(&dir.join(name)),
            commits: commits.clone(),
            busy_ns: busy_ns.clone(),
            trace: COMMIT_TRACE.get().map(|_| CommitTrace {
                run: run.clone(),
                side,
                began,
            }),
        })
    };
    match carrier {
        Carrier::Tcp => {
            let localhost = "127.0.0.1:0".parse().expect("addr");
            let (alice, bob) = (PeerId::new("alice"), PeerId::new("bob"));
            let bob_transport = TcpTransport::bind(bob.clone(), localhost)
                .await
                .expect("bind");
            let alice_transport = TcpTransport::bind(alice.clone(), localhost)
                .await
                .expect("bind");
            alice_transport.add_peer(bob.clone(), bob_transport.local_addr());
            let receiver = Substrate::builder(bob.clone(), bob_transport)
                .auth(Auth::SharedKey(b"bench".to_vec()))
                .authorize(Authorizer::new(AllowAll))
                .store(store("bob.sqlite3", &busy_ns[1]))
                .config(config.clone())
                .start()
                .expect("start");
            let sender = Substrate::builder(alice, alice_transport)
                .auth(Auth::SharedKey(b"bench".to_vec()))
                .authorize(Authorizer::new(AllowAll))
                .store(store("alice.sqlite3", &busy_ns[0]))
                .config(config)
                .start()
                .expect("start");
            Pair {
                sender,
                receiver,
                to: bob,
                nodes: Vec::new(),
                commits,
                busy_ns,
            }
        }
        Carrier::Iroh => {
            let b = Node::builder().substrate().bind().await.expect("bind");
            let a = Node::builder().substrate().bind().await.expect("bind");
            let receiver = b
                .substrate_builder()
                .expect("substrate")
                .authorize(Authorizer::new(AllowAll))
                .store(store("bob.sqlite3", &busy_ns[1]))
                .config(config.clone())
                .start()
                .expect("start");
            let sender = a
                .substrate_builder()
                .expect("substrate")
                .authorize(Authorizer::new(AllowAll))
                .store(store("alice.sqlite3", &busy_ns[0]))
                .config(config)
                .start()
                .expect("start");
            let to = a.add_substrate_peer(b.endpoint_addr()).expect("allowed");
            Pair {
                sender,
                receiver,
                to,
                nodes: vec![a, b],
                commits,
                busy_ns,
            }
        }
    }
}

/// The consumer: records each message, then consumes it; `count` counts deliveries.
fn consume(receiver: &Substrate, seen: Arc<Mutex<Seen>>, count: watch::Sender<u64>) {
    let mut inbound = receiver.inbound().expect("inbound");
    tokio::spawn(async move {
        while let Some(item) = inbound.recv().await {
            match item {
                Inbound::Open(open) => {
                    let _ = open.accept().await;
                }
                Inbound::Message(message) => {
                    seen.lock()
                        .expect("lock")
                        .record(&message.obj, index_of(&message.body));
                    message.done();
                    count.send_modify(|n| *n += 1);
                }
                _ => {}
            }
        }
    });
}

pub(crate) fn body(index: u64, size: usize) -> Vec<u8> {
    let mut body = vec![0x5a; size];
    body[..8].copy_from_slice(&index.to_be_bytes());
    body
}

/// `messages` sends spread round-robin over `queues`, up to [`SENDS_PENDING_PER_QUEUE`] of
/// them unacknowledged on each queue (its outbox and window pace them), until every one is
/// delivered and acknowledged.
async fn durable_run(
    dir: &Path,
    carrier: Carrier,
    store: StoreKind,
    queues: usize,
    window: usize,
    messages: u64,
    size: usize,
) -> Row {
    let pair = pair(dir, carrier, store, window).await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (count_tx, mut count) = watch::channel(0u64);
    consume(&pair.receiver, seen.clone(), count_tx);
    let peer = pair.sender.peer(&pair.to);
    let names: Vec<String> = (0..queues).map(|q| format!("q{q}")).collect();
    let mut handles = Vec::new();
    for name in &names {
        handles.push(peer.open_queue(name).await.expect("open"));
    }
    let commits_before = pair.commits.load(Ordering::Relaxed);
    let busy_before = pair.busy_ns();
    let cpu_before = cpu_seconds(None);
    let written_before = written_bytes(dir);
    let started = Instant::now();
    let mut sent_at = Vec::with_capacity(messages as usize);
    let mut pending: Vec<VecDeque<Pending<OpId>>> = (0..queues).map(|_| VecDeque::new()).collect();
    let mut failed = 0u64;
    for index in 0..messages {
        let queue = index as usize % queues;
        // At most `SENDS_PENDING_PER_QUEUE` unacknowledged sends per queue, each body made
        // as its send is issued (as an application streaming messages does, and as the
        // brokers' runs make theirs).
        if pending[queue].len() >= SENDS_PENDING_PER_QUEUE {
            let ack = pending[queue].pop_front().expect("full");
            failed += u64::from(ack.await.is_err());
        }
        sent_at.push(Instant::now());
        pending[queue].push_back(handles[queue].send(body(index, size)));
    }
    for ack in pending.into_iter().flatten() {
        failed += u64::from(ack.await.is_err());
    }
    count
        .wait_for(|n| *n >= messages)
        .await
        .expect("the consumer lives");
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_per_message(cpu_before, cpu_seconds(None), messages);
    let written = written_kb_per_message(written_before, written_bytes(dir), messages);
    let busy = store_busy(busy_before, pair.busy_ns(), seconds);
    let (seen, commits) = finish(pair, &seen, commits_before).await;
    let mut latencies = seen.latencies_ms(&sent_at);
    let verdict = check(&seen, &names, messages, failed);
    let (p50_ms, p99_ms) = percentiles(&mut latencies);
    Row {
        what: durable_what(carrier, store, queues, window),
        messages,
        seconds,
        p50_ms,
        p99_ms,
        verdict,
        fsyncs_per_message: Some(commits as f64 / messages as f64),
        cpu_us_per_message: cpu,
        store_busy: Some(busy),
        written_kb_per_message: written,
    }
}

/// How a durable run's row is named ([`print_goals`] finds its rows by it).
fn durable_what(carrier: Carrier, store: StoreKind, queues: usize, window: usize) -> String {
    format!(
        "tether over {carrier:?} ({} store), {queues} queue(s), window {window}",
        store.label()
    )
}

/// One send awaited at a time on one queue: the durable latency of a single message.
async fn sync_run(
    dir: &Path,
    carrier: Carrier,
    store: StoreKind,
    messages: u64,
    size: usize,
) -> Row {
    let pair = pair(dir, carrier, store, 1).await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (count_tx, mut count) = watch::channel(0u64);
    consume(&pair.receiver, seen.clone(), count_tx);
    let queue = pair
        .sender
        .peer(&pair.to)
        .open_queue("q0")
        .await
        .expect("open");
    let commits_before = pair.commits.load(Ordering::Relaxed);
    let busy_before = pair.busy_ns();
    let cpu_before = cpu_seconds(None);
    let written_before = written_bytes(dir);
    let started = Instant::now();
    let mut latencies = Vec::with_capacity(messages as usize);
    let mut failed = 0;
    for index in 0..messages {
        let at = Instant::now();
        failed += u64::from(queue.send(body(index, size)).await.is_err());
        latencies.push(at.elapsed().as_secs_f64() * 1e3);
    }
    count
        .wait_for(|n| *n >= messages)
        .await
        .expect("the consumer lives");
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_per_message(cpu_before, cpu_seconds(None), messages);
    let written = written_kb_per_message(written_before, written_bytes(dir), messages);
    let busy = store_busy(busy_before, pair.busy_ns(), seconds);
    drop(queue);
    let (seen, commits) = finish(pair, &seen, commits_before).await;
    let verdict = check(&seen, &["q0".to_owned()], messages, failed);
    let (p50_ms, p99_ms) = percentiles(&mut latencies);
    Row {
        what: sync_what(carrier, store),
        messages,
        seconds,
        p50_ms,
        p99_ms,
        verdict,
        fsyncs_per_message: Some(commits as f64 / messages as f64),
        cpu_us_per_message: cpu,
        store_busy: Some(busy),
        written_kb_per_message: written,
    }
}

/// How a sync run's row is named.
fn sync_what(carrier: Carrier, store: StoreKind) -> String {
    format!(
        "tether over {carrier:?} ({} store), one send awaited at a time (ack latency)",
        store.label()
    )
}

/// Shuts both sides down; hands back what the consumer saw and the commits since
/// `commits_before` (shutdown's own commits included: they are part of the run's cost).
async fn finish(pair: Pair, seen: &Mutex<Seen>, commits_before: u64) -> (Seen, u64) {
    pair.sender.shutdown().await;
    pair.receiver.shutdown().await;
    for node in pair.nodes {
        node.close().await;
    }
    let commits = pair.commits.load(Ordering::Relaxed) - commits_before;
    (std::mem::take(&mut *seen.lock().expect("lock")), commits)
}

/// Exactly once and in order per queue, every send acknowledged: message `i` went to queue
/// `names[i % names.len()]`.
pub(crate) fn check(seen: &Seen, names: &[String], messages: u64, failed: u64) -> String {
    let mut problems = Vec::new();
    if failed > 0 {
        problems.push(format!("{failed} sends failed"));
    }
    for (q, name) in names.iter().enumerate() {
        let expected: Vec<u64> = (0..messages)
            .filter(|i| *i as usize % names.len() == q)
            .collect();
        let got = seen.by_queue.get(name).cloned().unwrap_or_default();
        if got != expected {
            let mut sorted = got.clone();
            sorted.sort_unstable();
            sorted.dedup();
            problems.push(format!(
                "{name}: {} delivered, {} distinct, {} expected, in order: {}",
                got.len(),
                sorted.len(),
                expected.len(),
                sorted.len() == got.len() && got.windows(2).all(|w| w[0] < w[1])
            ));
        }
    }
    if problems.is_empty() {
        "ok".into()
    } else {
        problems.join("; ")
    }
}

pub(crate) use tether_core::stats::p50_p99 as percentiles;

/// The disk's bound: rows of `size` bytes inserted and committed `group` at a time (WAL,
/// `synchronous=FULL`, as the store runs).
fn raw_sqlite(dir: &PathBuf, messages: u64, size: usize, group: u64) -> Row {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("dir");
    let conn = rusqlite::Connection::open(dir.join("raw.sqlite3")).expect("open");
    conn.pragma_update(None, "journal_mode", "WAL")
        .expect("wal");
    conn.pragma_update(None, "synchronous", "FULL")
        .expect("full");
    conn.execute(
        "CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB NOT NULL)",
        [],
    )
    .expect("table");
    let payload = body(0, size);
    let cpu_before = cpu_seconds(None);
    let written_before = written_bytes(dir);
    let started = Instant::now();
    let mut id = 0u64;
    while id < messages {
        let tx = conn.unchecked_transaction().expect("begin");
        {
            let mut insert = tx
                .prepare_cached("INSERT INTO t (id, body) VALUES (?1, ?2)")
                .expect("prepare");
            for _ in 0..group.min(messages - id) {
                insert
                    .execute(rusqlite::params![id as i64, &payload])
                    .expect("insert");
                id += 1;
            }
        }
        tx.commit().expect("commit");
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_per_message(cpu_before, cpu_seconds(None), messages);
    let written = written_kb_per_message(written_before, written_bytes(dir), messages);
    Row {
        what: format!("raw SQLite, {group} row(s) per fsync'd commit"),
        messages,
        seconds,
        p50_ms: 0.0,
        p99_ms: 0.0,
        verdict: "ok".into(),
        fsyncs_per_message: Some(1.0 / group as f64),
        cpu_us_per_message: cpu,
        store_busy: None,
        written_kb_per_message: written,
    }
}

/// The disk's own sync latency, the floor under any durable ack: `syncs` appends of `size`
/// bytes to one file in `dir`, each followed by `fdatasync` and waited for, one at a time.
fn disk_sync(dir: &Path, syncs: u64, size: usize) -> Row {
    use std::io::Write;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("dir");
    let mut file = std::fs::File::create(dir.join("sync.bin")).expect("file");
    let body = vec![7u8; size];
    let mut latencies = Vec::with_capacity(syncs as usize);
    let started = Instant::now();
    for _ in 0..syncs {
        let at = Instant::now();
        file.write_all(&body).expect("write");
        file.sync_data().expect("fdatasync");
        latencies.push(at.elapsed().as_secs_f64() * 1e3);
    }
    let seconds = started.elapsed().as_secs_f64();
    let (p50_ms, p99_ms) = percentiles(&mut latencies);
    Row {
        what: DISK_SYNC.into(),
        messages: syncs,
        seconds,
        p50_ms,
        p99_ms,
        verdict: "ok".into(),
        fsyncs_per_message: Some(1.0),
        cpu_us_per_message: None,
        store_busy: None,
        written_kb_per_message: None,
    }
}

/// How the disk-sync row is named (the sync-latency goal divides by its p50).
const DISK_SYNC: &str = "the disk alone: one append and fdatasync at a time (sync latency)";

/// The network's bound: `frames` length-prefixed bodies of `size` bytes over one raw iroh uni
/// stream between two bare endpoints on 127.0.0.1, until the reader has them all.
async fn raw_iroh(frames: u64, size: usize) -> Row {
    use tokio::io::AsyncReadExt;
    let (tx, rx, conn, accepted) = tether_benches::loopback_connection(b"tether/bench/raw").await;
    let reader = tokio::spawn(async move {
        let mut recv = accepted.accept_uni().await.expect("uni stream");
        let mut received = 0u64;
        let mut frame = vec![0u8; size];
        while received < frames {
            let len = recv.read_u32().await.expect("length") as usize;
            recv.read_exact(&mut frame[..len]).await.expect("body");
            received += 1;
        }
        (received, accepted)
    });
    let mut send = conn.open_uni().await.expect("uni stream");
    let cpu_before = cpu_seconds(None);
    let mut chunk = Vec::with_capacity(64 * 1024);
    let framed = {
        let mut framed = (size as u32).to_be_bytes().to_vec();
        framed.extend_from_slice(&body(0, size));
        framed
    };
    let started = Instant::now();
    for _ in 0..frames {
        chunk.extend_from_slice(&framed);
        if chunk.len() >= 60 * 1024 {
            send.write_all(&chunk).await.expect("write");
            chunk.clear();
        }
    }
    send.write_all(&chunk).await.expect("write");
    let (received, _conn) = reader.await.expect("reader");
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_per_message(cpu_before, cpu_seconds(None), received);
    tx.close().await;
    rx.close().await;
    Row {
        what: format!("raw iroh stream, {size}-byte frames"),
        messages: received,
        seconds,
        p50_ms: 0.0,
        p99_ms: 0.0,
        verdict: "ok".into(),
        fsyncs_per_message: None,
        cpu_us_per_message: cpu,
        store_busy: None,
        written_kb_per_message: None,
    }
}

/// How the round-trip row is named.
const IROH_ROUND_TRIP: &str =
    "raw iroh: one message and a 16-byte answer at a time on one stream (round trip)";

/// The network's share of an awaited send: `trips` bodies of `size` bytes, each answered with
/// 16 bytes before the next goes, over one raw iroh bidi stream between two bare endpoints on
/// 127.0.0.1 (no store, no substrate).
async fn iroh_round_trip(trips: u64, size: usize) -> Row {
    let (tx, rx, conn, accepted) = tether_benches::loopback_connection(b"tether/bench/rtt").await;
    let echo = tokio::spawn(async move {
        let (mut send, mut recv) = accepted.accept_bi().await.expect("bidi stream");
        let mut frame = vec![0u8; size];
        for _ in 0..trips {
            recv.read_exact(&mut frame).await.expect("body");
            send.write_all(&[1u8; 16]).await.expect("answer");
        }
        accepted
    });
    let (mut send, mut recv) = conn.open_bi().await.expect("bidi stream");
    let message = body(0, size);
    let mut answer = [0u8; 16];
    let mut latencies = Vec::with_capacity(trips as usize);
    let cpu_before = cpu_seconds(None);
    let started = Instant::now();
    for _ in 0..trips {
        let sent = Instant::now();
        send.write_all(&message).await.expect("write");
        recv.read_exact(&mut answer).await.expect("answer");
        latencies.push(sent.elapsed().as_secs_f64() * 1e3);
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = cpu_per_message(cpu_before, cpu_seconds(None), trips);
    let _conn = echo.await.expect("echo");
    tx.close().await;
    rx.close().await;
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    Row {
        what: IROH_ROUND_TRIP.into(),
        messages: trips,
        seconds,
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        verdict: "ok".into(),
        fsyncs_per_message: None,
        cpu_us_per_message: cpu,
        store_busy: None,
        written_kb_per_message: None,
    }
}

/// A table cell: `value` shown, or a dash where nothing was measured.
fn or_dash<T>(value: Option<T>, show: impl FnOnce(T) -> String) -> String {
    value.map_or_else(|| "–".to_owned(), show)
}

/// One configuration over every round: the row of its median round, its rate in each round,
/// and its ratios to the baselines, each the median of ratios taken within one round (paired,
/// so a drift of the machine's speed between rounds hits both sides of a ratio alike).
struct Summary<'a> {
    row: &'a Row,
    rates: Vec<f64>,
    of_raw_32: Option<f64>,
    of_jetstream: Option<f64>,
    of_mosquitto: Option<f64>,
}

/// The baselines the table divides by, by the start of their rows' names. Where several rows
/// share the start (JetStream's two consumer shapes), a round is divided by the fastest of them:
/// what a user who wants speed would pick, whichever it was that round.
const RAW_SQLITE_32: &str = "raw SQLite, 32 ";
const JETSTREAM: &str = "NATS JetStream, file";
const MOSQUITTO: &str = "mosquitto";

/// The median of `values` (the lower of the middle two for an even count); `None` when empty.
fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    values.get(values.len().saturating_sub(1) / 2).copied()
}

/// `what`'s rate over the rate of the row named from `of` (the fastest such row), in each
/// round that has both.
fn paired_ratios(rounds: &[Vec<Row>], what: &str, of: &str) -> Vec<f64> {
    rounds
        .iter()
        .filter_map(|rows| {
            let rate = rows.iter().find(|row| row.what == what)?.rate();
            let of = rows
                .iter()
                .filter(|row| row.what.starts_with(of))
                .map(Row::rate)
                .max_by(f64::total_cmp)?;
            Some(rate / of.max(1e-9))
        })
        .collect()
}

/// Every configuration of the first round, summarized over all rounds, in its order.
fn summarize(rounds: &[Vec<Row>]) -> Vec<Summary<'_>> {
    let Some(first) = rounds.first() else {
        return Vec::new();
    };
    first
        .iter()
        .map(|row| {
            let mut runs: Vec<&Row> = rounds
                .iter()
                .filter_map(|rows| rows.iter().find(|other| other.what == row.what))
                .collect();
            let rates = runs.iter().map(|run| run.rate()).collect();
            runs.sort_by(|a, b| a.rate().total_cmp(&b.rate()));
            let ratio = |of| median(paired_ratios(rounds, &row.what, of));
            Summary {
                row: runs[(runs.len() - 1) / 2],
                rates,
                of_raw_32: ratio(RAW_SQLITE_32),
                of_jetstream: ratio(JETSTREAM),
                of_mosquitto: ratio(MOSQUITTO),
            }
        })
        .collect()
}

fn print_table(summaries: &[Summary<'_>], size: usize, rounds: u64) {
    let ratio = |of: Option<f64>| or_dash(of, |of| format!("{of:.2}×"));
    println!("\n{size}-byte messages; tether syncs its store to disk (SQLite or the log store) before every acknowledgement\n");
    if rounds > 1 {
        println!(
            "Median of {rounds} rounds: each row is its configuration's median round, and each \
             ratio the median of the ratios within a round.\n"
        );
    }
    println!(
        "| configuration | messages | msg/s | msg/s by round | p50 ms | p99 ms | fsyncs/msg \
         | KB written/msg | CPU µs/msg | cores | store busy (sender/receiver) | bound \
         | of raw SQLite (32/commit) | of JetStream | of mosquitto | check |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|");
    let cores_available = std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64);
    for summary in summaries {
        let row = summary.row;
        let by_round: Vec<String> = summary
            .rates
            .iter()
            .map(|rate| format!("{rate:.0}"))
            .collect();
        println!(
            "| {} | {} | {:.0} | {} | {:.2} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            row.what,
            row.messages,
            row.rate(),
            by_round.join(" / "),
            row.p50_ms,
            row.p99_ms,
            or_dash(row.fsyncs_per_message, |n| format!("{n:.3}")),
            or_dash(row.written_kb_per_message, |n| format!("{n:.1}")),
            or_dash(row.cpu_us_per_message, |n| format!("{n:.1}")),
            or_dash(row.cores(), |n| format!("{n:.2}")),
            or_dash(row.store_busy, |[sender, receiver]| {
                format!("{:.0}% / {:.0}%", sender * 100.0, receiver * 100.0)
            }),
            row.bound(cores_available),
            or_dash(summary.of_raw_32, |of| format!("{:.0}%", of * 100.0)),
            ratio(summary.of_jetstream),
            ratio(summary.of_mosquitto),
            row.verdict
        );
    }
}

/// The goals for tether over iroh with window [`GOAL_WINDOW`] (the durable-messaging issue's
/// against JetStream configured for speed, the first row of that name; the earlier one's
/// against mosquitto): the store, how many queues, the broker the rate is divided by, and the
/// least ratio that meets the goal in every round.
const GOALS: [(StoreKind, usize, &str, f64); 5] = [
    (StoreKind::Log, 16, JETSTREAM, 1.3),
    (StoreKind::Log, 1, JETSTREAM, 1.0),
    (StoreKind::Sqlite, 16, JETSTREAM, 1.0),
    (StoreKind::Log, 16, MOSQUITTO, 1.5),
    (StoreKind::Sqlite, 16, MOSQUITTO, 1.5),
];

/// The window the goals are set for.
const GOAL_WINDOW: usize = 32;

/// Each goal against each store: the ratio in every round and their median.
fn print_goals(rounds: &[Vec<Row>]) {
    let mut lines = Vec::new();
    for (store, queues, of, goal) in GOALS {
        let what = durable_what(Carrier::Iroh, store, queues, GOAL_WINDOW);
        let ratios = paired_ratios(rounds, &what, of);
        let goal_text = format!("≥ {goal:.1}×");
        lines.extend(goal_line(
            &what,
            of,
            &goal_text,
            &ratios,
            |r| r >= goal,
            2,
            "×",
        ));
    }
    // One send awaited at a time: its p50 over the disk's own sync p50, at most 2.5 (the
    // durable-messaging issue's; lower is better, so the ratio is the other way up).
    for store in [StoreKind::Log, StoreKind::Sqlite] {
        let what = sync_what(Carrier::Iroh, store);
        let ratios: Vec<f64> = rounds
            .iter()
            .filter_map(|rows| {
                let sync = rows.iter().find(|row| row.what == what)?.p50_ms;
                let disk = rows.iter().find(|row| row.what == DISK_SYNC)?.p50_ms;
                Some(sync / disk.max(1e-9))
            })
            .collect();
        let label = format!("{what}: p50");
        let of = "the disk's sync p50";
        lines.extend(goal_line(
            &label,
            of,
            "≤ 2.5×",
            &ratios,
            |r| r <= 2.5,
            2,
            "×",
        ));
    }
    // What an awaited send on the log store is made of: the receiver's sync and the network's
    // round trip are its floor (the sender's sync overlaps them); the rest is tether's (and
    // the runtime's) own.
    let awaited = sync_what(Carrier::Iroh, StoreKind::Log);
    let above: Vec<f64> = rounds
        .iter()
        .filter_map(|rows| {
            let p50 = |name: &str| Some(rows.iter().find(|row| row.what == name)?.p50_ms);
            let floor = p50(DISK_SYNC)? + p50(IROH_ROUND_TRIP)?;
            Some(p50(&awaited)? - floor)
        })
        .collect();
    // CPU per durable message on the log store, 16 queues: at most 12 µs.
    let what = durable_what(Carrier::Iroh, StoreKind::Log, 16, GOAL_WINDOW);
    let cpu: Vec<f64> = rounds
        .iter()
        .filter_map(|rows| rows.iter().find(|row| row.what == what)?.cpu_us_per_message)
        .collect();
    let label = format!("{what}: CPU µs per message");
    lines.extend(goal_line(
        &label,
        "–",
        "≤ 12 µs",
        &cpu,
        |c| c <= 12.0,
        1,
        " µs",
    ));
    if lines.is_empty() {
        return;
    }
    println!("\nGoals (median of the ratios within a round)\n");
    println!("| configuration | of | goal | by round | median | verdict | rounds meeting it |");
    println!("|---|---|---:|---:|---:|---|---:|");
    for line in lines {
        println!("{line}");
    }
    if let Some(median) = median(above.clone()) {
        let by_round: Vec<String> = above.iter().map(|ms| format!("{ms:.3}")).collect();
        println!(
            "\n{awaited}: p50 above its floor (the receiver's disk sync and the iroh round trip): {} ms by \
             round, median {median:.3} ms",
            by_round.join(" / ")
        );
    }
}

/// One line of the goals table: `values` by round and their median (written with `digits`
/// decimals and `unit`), whether the median meets the goal, and in how many rounds it is met;
/// none when no round has a value.
fn goal_line(
    label: &str,
    of: &str,
    goal: &str,
    values: &[f64],
    meets: impl Fn(f64) -> bool,
    digits: usize,
    unit: &str,
) -> Option<String> {
    let median = median(values.to_vec())?;
    let by_round: Vec<String> = values.iter().map(|v| format!("{v:.digits$}")).collect();
    let met = values.iter().filter(|value| meets(**value)).count();
    Some(format!(
        "| {label} | {of} | {goal} | {} | {median:.digits$}{unit} | {} | {met} of {} |",
        by_round.join(" / "),
        if meets(median) { "met" } else { "not met" },
        values.len(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tether row: `rate` msg/s over one second, `cpu_us` per message.
    fn measured(rate: u64, cpu_us: f64, fsyncs: f64, busy: [f64; 2]) -> Row {
        Row {
            what: "tether".into(),
            messages: rate,
            seconds: 1.0,
            p50_ms: 0.0,
            p99_ms: 0.0,
            verdict: "ok".into(),
            fsyncs_per_message: Some(fsyncs),
            cpu_us_per_message: Some(cpu_us),
            store_busy: Some(busy),
            written_kb_per_message: None,
        }
    }

    /// The bench runs commits as the store runs them: one the log store takes in place is
    /// taken in place through the counting wrapper (and counted), one a store declines is
    /// declined (and not counted), as `Store::commit_in_place`'s default does.
    #[test]
    fn counted_commits_run_in_place_where_the_store_would() {
        let dir = std::env::temp_dir().join(format!("tether-bench-counted-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let counted = |store: Arc<dyn Store>| Counted {
            store,
            commits: Arc::default(),
            busy_ns: Arc::default(),
            trace: None,
        };
        let batch = [PersistBatch {
            id: tether_core::substrate::BatchId(1),
            records: Vec::new(),
        }];
        let peer = PeerId::new("peer");
        let log = counted(Arc::new(
            LogStore::open(dir.join("state.log")).expect("open"),
        ));
        assert!(matches!(log.commit_in_place(&peer, &batch), Some(Ok(()))));
        assert_eq!(log.commits.load(Ordering::Relaxed), 1);
        let memory = counted(Arc::new(tether::store::MemoryStore::new()));
        assert!(memory.commit_in_place(&peer, &batch).is_none());
        assert_eq!(memory.commits.load(Ordering::Relaxed), 0);
        drop(log);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A commit's trace line counts what the store writes: an op inserted and forgotten in
    /// the same commit leaves only its removal, so the line says one removal, not an insert.
    #[test]
    fn a_traced_commit_counts_the_records_the_store_writes() {
        use tether_core::substrate::{Address, BatchId, Op, OpId, Seq};
        use tether_core::time::Time;
        use tether_core::wire::envelope::Verb;
        let obj = Address::parse("q0").expect("an address");
        let op = |seq: u64| Op {
            obj: obj.clone(),
            seq: Seq(seq),
            id: OpId::new(&format!("id-{seq}")),
            verb: Verb::Send,
            obj_kind: None,
            body: Some(bytes::Bytes::from_static(b"body")),
            code: None,
            reason: None,
            cap: None,
            at: Time::ZERO,
        };
        let batches = [
            PersistBatch {
                id: BatchId(1),
                records: vec![Record::Outbox(op(0)), Record::Outbox(op(1))],
            },
            PersistBatch {
                id: BatchId(2),
                records: vec![Record::OutboxRemoved {
                    obj: obj.clone(),
                    seq: Seq(0),
                }],
            },
        ];
        let trace = CommitTrace {
            run: "log-iroh-1-32".into(),
            side: "sender",
            began: Instant::now(),
        };
        let line = trace.line(Instant::now(), 250_000, false, &batches);
        let fields: Vec<&str> = line.split(',').collect();
        let header = CommitTrace::header();
        let columns: Vec<&str> = header.split(',').collect();
        assert_eq!(fields.len(), columns.len(), "{line}");
        let field = |name: &str| fields[columns.iter().position(|c| *c == name).expect(name)];
        assert_eq!(field("run"), "log-iroh-1-32");
        assert_eq!(field("side"), "sender");
        assert_eq!(field("duration_us"), "250");
        assert_eq!(field("batches"), "2");
        assert_eq!(field("records"), "2");
        assert_eq!(field("outbox"), "1");
        assert_eq!(field("outbox_removed"), "1");
        assert_eq!(field("inbox"), "0");
    }

    /// A row named `what` at `rate` msg/s.
    fn named(what: &str, rate: u64) -> Row {
        Row {
            what: what.into(),
            ..measured(rate, 0.0, 0.0, [0.0; 2])
        }
    }

    #[test]
    fn rounds_are_summarized_by_medians_of_ratios_within_a_round() {
        let tether = "tether over Iroh (log store), 16 queue(s), window 32";
        let jetstream = "NATS JetStream, file store";
        let rounds = vec![
            vec![named(tether, 100), named(jetstream, 50)],
            vec![named(tether, 90), named(jetstream, 100)],
            vec![named(tether, 120), named(jetstream, 100)],
        ];
        let summaries = summarize(&rounds);
        assert_eq!(summaries.len(), 2);
        assert_eq!(summaries[0].rates, [100.0, 90.0, 120.0]);
        assert_eq!(summaries[0].row.rate(), 100.0, "the median round's row");
        // The median of 2.0, 0.9 and 1.2, not the ratio of the medians (100 / 100).
        assert_eq!(summaries[0].of_jetstream, Some(1.2));
        assert_eq!(summaries[0].of_mosquitto, None, "no mosquitto row");
        assert_eq!(median(vec![3.0, 1.0, 2.0, 4.0]), Some(2.0));
        assert_eq!(median(Vec::new()), None);
    }

    #[test]
    fn a_round_is_divided_by_the_fastest_of_the_baselines_sharing_a_name() {
        let tether = "tether over Iroh (log store), 1 queue(s), window 32";
        let pulls = "NATS JetStream, file store, pulls of 256";
        let defaults = "NATS JetStream, file store, client defaults";
        let rounds = vec![
            // Pulls faster in the first round, the client's defaults in the second.
            vec![named(tether, 90), named(pulls, 60), named(defaults, 45)],
            vec![named(tether, 90), named(defaults, 100), named(pulls, 75)],
        ];
        assert_eq!(paired_ratios(&rounds, tether, JETSTREAM), [1.5, 0.9]);
    }

    #[test]
    fn the_bound_follows_what_was_measured() {
        // Two cores. Every message with commits of its own: latency, however busy the store.
        assert_eq!(
            measured(500, 1300.0, 3.9, [0.8, 0.8]).bound(2.0),
            "commit latency"
        );
        // Large groups and a receiver committing 80% of the run: its disk.
        assert_eq!(
            measured(18_000, 70.0, 0.01, [0.7, 0.8]).bound(2.0),
            "disk (receiver's store)"
        );
        // Small groups on a busy store: the window keeps the groups small.
        assert_eq!(
            measured(8_000, 110.0, 0.12, [0.8, 0.8]).bound(2.0),
            "window × commit latency"
        );
        // Idle stores, 1.8 of 2 cores busy: the CPU.
        assert_eq!(measured(20_000, 90.0, 0.01, [0.5, 0.5]).bound(2.0), "CPU");
        // Nothing saturated: messages wait on the window while commits complete.
        assert_eq!(
            measured(15_000, 80.0, 0.01, [0.6, 0.6]).bound(2.0),
            "window × commit latency"
        );
        // A broker or a raw baseline has no store of tether's to judge by.
        let mut broker = measured(25_000, 60.0, 0.0, [0.0, 0.0]);
        broker.store_busy = None;
        assert_eq!(broker.bound(2.0), "–");
    }
}
