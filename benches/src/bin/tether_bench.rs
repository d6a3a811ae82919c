//! `tether-bench`: durable end-to-end throughput of the substrate, one producer and one
//! consumer in one process, every message synced to disk on both sides before it is
//! acknowledged (SQLite, WAL, `synchronous=FULL`), over TCP and over iroh on 127.0.0.1, with 1
//! and 16 queues and windows 1 and 32; beside it, in the same run, the bound it sits against:
//! raw SQLite inserts of the same rows committed in groups of the same size.
//!
//! Every run is checked: each message delivered exactly once and in order per queue (the
//! table says so, and the process exits non-zero otherwise). Latency is from the producer's
//! `send` to the consumer's delivery. `--sync` adds single-message durable latency: one send
//! awaited at a time.
//!
//! ```sh
//! cargo run --release -p tether-benches --bin tether-bench -- --messages 20000 --size 1024
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tether::node::Node;
use tether::store::SqliteStore;
use tether::substrate::{
    AllowAll, Auth, Authorizer, Config, Inbound, PeerId, Substrate, TcpTransport,
};
use tokio::sync::watch;

/// Which carrier a run goes over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Carrier {
    Tcp,
    Iroh,
}

/// One configuration's result.
struct Row {
    what: String,
    messages: u64,
    seconds: f64,
    p50_ms: f64,
    p99_ms: f64,
    verdict: String,
}

impl Row {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.seconds.max(1e-9)
    }
}

/// What the consumer saw: per queue the message indices in arrival order, and when each came.
#[derive(Default)]
struct Seen {
    by_queue: BTreeMap<String, Vec<u64>>,
    arrived: Vec<(u64, Instant)>,
}

struct Options {
    messages: u64,
    size: usize,
    sync: bool,
}

fn parse_args() -> Result<Options, String> {
    let mut options = Options {
        messages: 20_000,
        size: 1024,
        sync: false,
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
            "--sync" => options.sync = true,
            // cargo bench passes --bench; nothing else is accepted.
            "--bench" => {}
            other => {
                return Err(format!(
                    "unknown argument {other:?} (--messages N, --size B, --sync)"
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
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let dir = std::env::temp_dir().join(format!("tether-bench-{}", std::process::id()));
    let mut rows = Vec::new();
    for carrier in [Carrier::Iroh, Carrier::Tcp] {
        for (queues, window) in [(1, 1), (1, 32), (16, 32)] {
            let run_dir = dir.join(format!("{carrier:?}-{queues}-{window}"));
            let row = runtime.block_on(durable_run(
                &run_dir,
                carrier,
                queues,
                window,
                options.messages,
                options.size,
            ));
            eprintln!("{}: {:.0} msg/s ({})", row.what, row.rate(), row.verdict);
            rows.push(row);
        }
        if options.sync {
            let run_dir = dir.join(format!("{carrier:?}-sync"));
            let row = runtime.block_on(sync_run(
                &run_dir,
                carrier,
                options.messages.min(2_000),
                options.size,
            ));
            eprintln!("{}: {:.0} msg/s", row.what, row.rate());
            rows.push(row);
        }
    }
    for group in [1u64, 32, 512] {
        let row = raw_sqlite(
            &dir.join(format!("raw-{group}")),
            options.messages,
            options.size,
            group,
        );
        eprintln!("{}: {:.0} rows/s", row.what, row.rate());
        rows.push(row);
    }
    let _ = std::fs::remove_dir_all(&dir);
    print_table(&rows, options.size);
    if rows.iter().all(|row| row.verdict == "ok") {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}

/// A sender and a receiver substrate over `carrier`, each with its SQLite store in `dir`.
async fn pair(
    dir: &Path,
    carrier: Carrier,
    window: usize,
) -> (Substrate, Substrate, PeerId, Vec<Node>) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("bench dir");
    let config = Config {
        in_flight_max: window,
        ..Config::default()
    };
    let store = |name: &str| Arc::new(SqliteStore::open(dir.join(name)).expect("sqlite"));
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
                .store(store("bob.sqlite3"))
                .config(config.clone())
                .start()
                .expect("start");
            let sender = Substrate::builder(alice, alice_transport)
                .auth(Auth::SharedKey(b"bench".to_vec()))
                .authorize(Authorizer::new(AllowAll))
                .store(store("alice.sqlite3"))
                .config(config)
                .start()
                .expect("start");
            (sender, receiver, bob, Vec::new())
        }
        Carrier::Iroh => {
            let b = Node::builder().substrate().bind().await.expect("bind");
            let a = Node::builder().substrate().bind().await.expect("bind");
            let receiver = b
                .substrate_builder()
                .expect("substrate")
                .authorize(Authorizer::new(AllowAll))
                .store(store("bob.sqlite3"))
                .config(config.clone())
                .start()
                .expect("start");
            let sender = a
                .substrate_builder()
                .expect("substrate")
                .authorize(Authorizer::new(AllowAll))
                .store(store("alice.sqlite3"))
                .config(config)
                .start()
                .expect("start");
            let to = a.add_substrate_peer(b.endpoint_addr()).expect("allowed");
            (sender, receiver, to, vec![a, b])
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
                    let index = u64::from_be_bytes(message.body[..8].try_into().expect("8 bytes"));
                    {
                        let mut seen = seen.lock().expect("lock");
                        seen.by_queue
                            .entry(message.obj.clone())
                            .or_default()
                            .push(index);
                        seen.arrived.push((index, Instant::now()));
                    }
                    message.done();
                    count.send_modify(|n| *n += 1);
                }
                _ => {}
            }
        }
    });
}

fn body(index: u64, size: usize) -> Vec<u8> {
    let mut body = vec![0x5a; size];
    body[..8].copy_from_slice(&index.to_be_bytes());
    body
}

/// `messages` sends spread round-robin over `queues`, all issued at once (each queue's outbox
/// and window pace them), until every one is delivered and acknowledged.
async fn durable_run(
    dir: &Path,
    carrier: Carrier,
    queues: usize,
    window: usize,
    messages: u64,
    size: usize,
) -> Row {
    let (sender, receiver, to, nodes) = pair(dir, carrier, window).await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (count_tx, mut count) = watch::channel(0u64);
    consume(&receiver, seen.clone(), count_tx);
    let peer = sender.peer(&to);
    let mut handles = Vec::new();
    for q in 0..queues {
        handles.push(peer.open_queue(&format!("q{q}")).await.expect("open"));
    }
    let started = Instant::now();
    let mut sent_at = Vec::with_capacity(messages as usize);
    let mut pending = Vec::with_capacity(messages as usize);
    for index in 0..messages {
        sent_at.push(Instant::now());
        pending.push(handles[index as usize % queues].send(body(index, size)));
    }
    let mut failed = 0u64;
    for ack in pending {
        failed += u64::from(ack.await.is_err());
    }
    count
        .wait_for(|n| *n >= messages)
        .await
        .expect("the consumer lives");
    let seconds = started.elapsed().as_secs_f64();
    let seen = finish(sender, receiver, nodes, &seen).await;
    let mut latencies: Vec<f64> = seen
        .arrived
        .iter()
        .map(|(index, at)| at.duration_since(sent_at[*index as usize]).as_secs_f64() * 1e3)
        .collect();
    let verdict = check(&seen, queues, messages, failed);
    let (p50_ms, p99_ms) = percentiles(&mut latencies);
    Row {
        what: format!("tether over {carrier:?}, {queues} queue(s), window {window}"),
        messages,
        seconds,
        p50_ms,
        p99_ms,
        verdict,
    }
}

/// One send awaited at a time on one queue: the durable latency of a single message.
async fn sync_run(dir: &Path, carrier: Carrier, messages: u64, size: usize) -> Row {
    let (sender, receiver, to, nodes) = pair(dir, carrier, 1).await;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (count_tx, mut count) = watch::channel(0u64);
    consume(&receiver, seen.clone(), count_tx);
    let queue = sender.peer(&to).open_queue("q0").await.expect("open");
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
    let seen = finish(sender, receiver, nodes, &seen).await;
    let verdict = check(&seen, 1, messages, failed);
    let (p50_ms, p99_ms) = percentiles(&mut latencies);
    Row {
        what: format!("tether over {carrier:?}, one send awaited at a time (ack latency)"),
        messages,
        seconds,
        p50_ms,
        p99_ms,
        verdict,
    }
}

/// Shuts both sides down and hands back what the consumer saw.
async fn finish(
    sender: Substrate,
    receiver: Substrate,
    nodes: Vec<Node>,
    seen: &Mutex<Seen>,
) -> Seen {
    sender.shutdown().await;
    receiver.shutdown().await;
    for node in nodes {
        node.close().await;
    }
    std::mem::take(&mut *seen.lock().expect("lock"))
}

/// Exactly once and in order per queue, every send acknowledged.
fn check(seen: &Seen, queues: usize, messages: u64, failed: u64) -> String {
    let mut problems = Vec::new();
    if failed > 0 {
        problems.push(format!("{failed} sends failed"));
    }
    for q in 0..queues {
        let name = format!("q{q}");
        let expected: Vec<u64> = (0..messages)
            .filter(|i| *i as usize % queues == q)
            .collect();
        let got = seen.by_queue.get(&name).cloned().unwrap_or_default();
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

fn percentiles(latencies: &mut [f64]) -> (f64, f64) {
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| {
        latencies
            .get(((latencies.len().saturating_sub(1)) as f64 * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    (at(0.5), at(0.99))
}

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
    Row {
        what: format!("raw SQLite, {group} row(s) per fsync'd commit"),
        messages,
        seconds,
        p50_ms: 0.0,
        p99_ms: 0.0,
        verdict: "ok".into(),
    }
}

fn print_table(rows: &[Row], size: usize) {
    let raw_32 = rows
        .iter()
        .find(|row| row.what.starts_with("raw SQLite, 32 "))
        .map(Row::rate)
        .unwrap_or(f64::NAN);
    println!("\n{size}-byte messages, SQLite with fsync before every acknowledgement\n");
    println!("| configuration | messages | msg/s | p50 ms | p99 ms | of raw SQLite (32/commit) | check |");
    println!("|---|---:|---:|---:|---:|---:|---|");
    for row in rows {
        println!(
            "| {} | {} | {:.0} | {:.2} | {:.2} | {:.0}% | {} |",
            row.what,
            row.messages,
            row.rate(),
            row.p50_ms,
            row.p99_ms,
            row.rate() / raw_32 * 100.0,
            row.verdict
        );
    }
}
