//! `tether demo`: two real `tether node` processes on 127.0.0.1 over iroh, each with its SQLite
//! store in a temporary directory. A sends messages over several queues and a session, with
//! requests among them; midway B is killed with SIGKILL and restarted from its data directory,
//! later the link is cut. The demo then checks what B's application saw against what A was
//! asked to send, prints a table, and exits non-zero if an invariant failed.
//!
//! Every outcome is explained or flagged: a message B's application saw twice counts as a
//! duplicate unless it is the substrate's documented redelivery (the same object and seq, seen
//! again after a restart because B died before consuming it).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::procs::{free_port, Event, NodeProc};

/// What `tether demo` was asked to do.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    /// Messages A sends in all (queues and session).
    pub(crate) messages: u64,
    /// Queues they are spread over (a session carries some too).
    pub(crate) queues: u64,
    /// Requests on the session among them.
    pub(crate) requests: u64,
    /// Requests routed through the request switch to B's host, besides.
    pub(crate) routes: u64,
    /// Body size in bytes (at least what the message's name needs).
    pub(crate) size: usize,
    /// Kill B this many times, spread over the run.
    pub(crate) kills: u64,
    /// Both nodes' store.
    pub(crate) store: crate::StoreChoice,
    /// Where the nodes keep their data (default: a fresh temporary directory, removed after).
    pub(crate) dir: Option<PathBuf>,
    /// No progress bar or lines, only the table.
    pub(crate) quiet: bool,
    /// The table as one JSON object.
    pub(crate) json: bool,
    /// Nodes: 2 runs the two-node demo above; more runs `demo_many` (a ring of queues, any
    /// node killed).
    pub(crate) nodes: usize,
    /// Run `tether relay` (iroh's relay server) on 127.0.0.1 and home every node on it.
    pub(crate) relay: bool,
}

/// With `--relay`: `tether relay` as a child process on 127.0.0.1 (an unused port), and the
/// node arguments that home a node on it (none without).
pub(crate) async fn local_relay(
    exe: &Path,
    options: &Options,
    events_tx: &mpsc::UnboundedSender<Event>,
    events: &mut mpsc::UnboundedReceiver<Event>,
) -> Result<(Option<NodeProc>, Vec<String>), DemoError> {
    if !options.relay {
        return Ok((None, Vec::new()));
    }
    let relay = NodeProc::spawn_wrapped(&[], exe, "relay", "relay", 1, &[], events_tx.clone())
        .map_err(io("tether relay"))?;
    let url = loop {
        let event = next(events, "the relay to start").await?;
        if event.from == "relay" && event.value["event"] == "relay" {
            break event.value["url"].as_str().unwrap_or_default().to_owned();
        }
    };
    if !options.quiet {
        eprintln!("nodes home on iroh's relay server at {url}");
    }
    Ok((Some(relay), vec!["--relay".into(), url]))
}

/// Why the demo could not run (as opposed to an invariant it found broken).
#[derive(Debug, thiserror::Error)]
pub(crate) enum DemoError {
    #[error("cannot run {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("node {0} ended before it was ready")]
    NotReady(&'static str),
    #[error("no progress for {0:?}: {1}")]
    Stalled(Duration, String),
}

pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DemoError {
    let what = what.into();
    move |source| DemoError::Io { what, source }
}

/// How long the demo waits without any event before it calls the run stalled.
const STALL: Duration = Duration::from_secs(60);

/// What the demo saw, and the verdict.
#[derive(Debug, Default, serde::Serialize)]
pub(crate) struct Summary {
    pub(crate) sent: u64,
    pub(crate) acked: u64,
    pub(crate) delivered: u64,
    pub(crate) redelivered_after_restart: u64,
    pub(crate) duplicates: u64,
    pub(crate) lost: u64,
    pub(crate) acked_but_lost: u64,
    pub(crate) reordered: u64,
    pub(crate) requests: u64,
    pub(crate) replies: u64,
    pub(crate) wrong_replies: u64,
    pub(crate) routed: u64,
    pub(crate) routes_answered: u64,
    pub(crate) routes_retried: u64,
    pub(crate) wrong_routes: u64,
    pub(crate) telemetry_streams: u64,
    pub(crate) telemetry_events: u64,
    pub(crate) kills: u64,
    pub(crate) disconnects: u64,
    pub(crate) seconds: f64,
    pub(crate) throughput_msgs_per_s: f64,
    pub(crate) latency_p50_ms: f64,
    pub(crate) latency_p99_ms: f64,
    pub(crate) failures: Vec<String>,
}

/// A receiving application's view of one object: what each delivery was.
#[derive(Default)]
pub(crate) struct Seen {
    /// seq → message index first delivered under it, and the receiver's life that printed it.
    by_seq: BTreeMap<u64, (u64, u64)>,
    /// The last index delivered for the first time (order check).
    last: Option<u64>,
}

/// What one delivery was (see [`Seen::classify`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// Delivered for the first time, in order.
    First,
    /// Delivered for the first time, but not after the last first delivery.
    Reordered,
    /// The same message under the same seq, printed by an earlier life of the receiver that
    /// died before consuming it: the substrate's documented redelivery.
    Redelivered,
    /// Anything else seen before.
    Duplicate,
}

impl Seen {
    /// Classifies the delivery of message `index` under `seq` by the receiver's `life`;
    /// `seen_before` says whether `index` was delivered for the first time already.
    pub(crate) fn classify(
        &mut self,
        seq: u64,
        index: u64,
        life: u64,
        seen_before: bool,
    ) -> Delivery {
        match self.by_seq.get(&seq) {
            Some(&(first, earlier)) if first == index && earlier < life => Delivery::Redelivered,
            Some(_) => Delivery::Duplicate,
            None if seen_before => Delivery::Duplicate,
            None => {
                self.by_seq.insert(seq, (index, life));
                let in_order = self.last.is_none_or(|last| index > last);
                self.last = Some(index);
                if in_order {
                    Delivery::First
                } else {
                    Delivery::Reordered
                }
            }
        }
    }
}

/// Runs the demo; its exit code says whether every invariant held.
pub(crate) async fn run(options: Options) -> Result<ExitCode, DemoError> {
    let exe = std::env::current_exe().map_err(io("the tether binary"))?;
    let (dir, temporary) = match &options.dir {
        Some(dir) => (dir.clone(), false),
        None => (
            std::env::temp_dir().join(format!("tether-demo-{}", std::process::id())),
            true,
        ),
    };
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(io(dir.display().to_string()))?;
    if options.nodes > 2 {
        let result = crate::demo_many::drive(&exe, &dir, &options).await;
        if temporary {
            let _ = std::fs::remove_dir_all(&dir);
        }
        let summary = result?;
        return Ok(report(
            &summary,
            &summary.failures,
            options.json,
            crate::demo_many::print_table,
        ));
    }
    let result = drive(&exe, &dir, &options).await;
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let summary = result?;
    Ok(report(
        &summary,
        &summary.failures,
        options.json,
        print_table,
    ))
}

/// Prints `summary` (as JSON, or as `table` prints it); the exit code says whether it lists
/// `failures`.
fn report<S: serde::Serialize>(
    summary: &S,
    failures: &[String],
    json: bool,
    table: fn(&S),
) -> ExitCode {
    if json {
        println!("{}", serde_json::to_string(summary).unwrap_or_default());
    } else {
        table(summary);
    }
    if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The message names: `<obj>:<index>`, padded to the body size.
fn body(obj: &str, index: u64, size: usize) -> String {
    let mut body = format!("{obj}:{index}:");
    while body.len() < size {
        body.push('.');
    }
    body
}

fn parse_body(body: &str) -> Option<(String, u64)> {
    let mut parts = body.splitn(3, ':');
    let obj = parts.next()?.to_owned();
    let index = parts.next()?.parse().ok()?;
    Some((obj, index))
}

/// Everything the demo saw, kept as the events arrive.
#[derive(Default)]
struct Books {
    summary: Summary,
    /// Per object, B's application view.
    seen: BTreeMap<String, Seen>,
    /// Messages delivered (first time).
    delivered: BTreeSet<String>,
    acked: BTreeSet<String>,
    requested: BTreeSet<String>,
    sent_at: HashMap<String, Instant>,
    latencies: Vec<f64>,
    /// Routed requests waiting for B's next life (their host died under them).
    routes_waiting: Vec<String>,
    /// Attempts per routed body.
    route_attempts: HashMap<String, u32>,
    /// Routed requests that failed [`ROUTE_ATTEMPTS`] times (each also a failure).
    routes_given_up: u64,
}

/// A routed request is tried this often before the demo calls it failed (each retry follows
/// a failure its host's death explains).
const ROUTE_ATTEMPTS: u32 = 8;

async fn drive(exe: &Path, dir: &Path, options: &Options) -> Result<Summary, DemoError> {
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let (relay, homed) = local_relay(exe, options, &events_tx, &mut events).await?;
    let port = free_port().map_err(io("a probe socket"))?;
    let mut b_args = vec![
        "--store".into(),
        options.store.as_str().into(),
        "--data".into(),
        dir.join("b").display().to_string(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
    ];
    b_args.extend(homed.iter().cloned());
    let mut b_life = 1;
    let mut b = spawn(exe, "b", b_life, &b_args, &events_tx)?;
    let ticket = loop {
        let event = next(&mut events, "b to start").await?;
        if event.value["event"] == "ready" {
            break event.value["ticket"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
        }
    };
    let mut a_args = vec![
        "--store".into(),
        options.store.as_str().into(),
        "--data".into(),
        dir.join("a").display().to_string(),
        "--connect".into(),
        ticket,
    ];
    a_args.extend(homed.iter().cloned());
    let mut a = spawn(exe, "a", 1, &a_args, &events_tx)?;

    // The objects: queues q0.., and the session s (sends and requests).
    let objects: Vec<String> = (0..options.queues.max(1))
        .map(|q| format!("q{q}"))
        .chain(std::iter::once("s".to_owned()))
        .collect();
    let mut opening = String::new();
    for obj in &objects {
        let kind = if obj == "s" { "session" } else { "queue" };
        opening.push_str(&format!("open {kind} {obj}\n"));
    }
    // B's telemetry: one event per message its application consumed.
    opening.push_str("subscribe\n");
    write(&mut a, &opening).await?;
    let mut opened = 0;
    let mut a_ticket = None;
    while opened < objects.len() || a_ticket.is_none() {
        let event = next(&mut events, "the objects to open").await?;
        match event.value["event"].as_str() {
            Some("opened") => opened += 1,
            Some("ready") if event.from == "a" => {
                a_ticket = event.value["ticket"].as_str().map(str::to_owned);
            }
            Some("error") => {
                return Err(DemoError::Stalled(
                    Duration::ZERO,
                    format!("a could not open: {}", event.value["message"]),
                ))
            }
            _ => {}
        }
    }

    // A restarted B dials A itself: A's link to the dead process would otherwise wait for
    // QUIC's idle timeout to notice that it is gone.
    b_args.extend(["--connect".to_owned(), a_ticket.unwrap_or_default()]);

    // The plan: message i goes to objects[i % len]; every k-th on the session is a request;
    // a routed request goes to the switch every `route_every` messages.
    let total = options.messages;
    let request_every = (total / objects.len() as u64)
        .checked_div(options.requests)
        .map_or(u64::MAX, |every| every.max(1));
    let route_every = total
        .checked_div(options.routes)
        .map_or(u64::MAX, |every| every.max(1));
    let kill_points: Vec<u64> = (1..=options.kills)
        .map(|k| total * k / (options.kills + 1))
        .collect();
    let disconnect_at = total * 7 / 8;

    let progress = Progress::new(total, options.quiet);
    let mut books = Books::default();
    let mut b_up = true;
    let started = Instant::now();
    let mut next_index = 0u64;
    // Sent in slices so that kills land while traffic flows.
    const SLICE: u64 = 256;
    loop {
        if next_index < total {
            let end = (next_index + SLICE).min(total);
            let mut commands = String::new();
            for i in next_index..end {
                let obj = &objects[(i % objects.len() as u64) as usize];
                let name = body(obj, i, options.size);
                // The session gets every len-th message; every request_every-th of those is a
                // request.
                let on_session = i / objects.len() as u64;
                let verb = if obj == "s"
                    && on_session.is_multiple_of(request_every)
                    && (books.requested.len() as u64) < options.requests
                {
                    books.requested.insert(name.clone());
                    "req"
                } else {
                    "send"
                };
                commands.push_str(&format!("{verb} {obj} {name}\n"));
                books.sent_at.insert(name, Instant::now());
                if i % route_every == 0 && books.summary.routed < options.routes {
                    let route = format!("route-{i}");
                    books.summary.routed += 1;
                    books.route_attempts.insert(route.clone(), 1);
                    commands.push_str(&format!("route {route}\n"));
                }
            }
            write(&mut a, &commands).await?;
            books.summary.sent += end - next_index;
            next_index = end;
        }
        // Drain what has arrived (and wait for more once everything is sent).
        let wait = next_index >= total;
        let mut retry = String::new();
        while let Some(event) = if wait {
            Some(next(&mut events, "the remaining deliveries").await?)
        } else {
            events.try_recv().ok()
        } {
            if event.from == "b" && event.life == b_life && event.value["event"] == "ready" {
                // B's new life: collect its telemetry, retry the routes its death failed.
                b_up = true;
                retry.push_str("subscribe\n");
                for route in books.routes_waiting.drain(..) {
                    retry.push_str(&format!("route {route}\n"));
                }
            }
            if let Some(route) = account(&event, &mut books) {
                if b_up {
                    retry.push_str(&format!("route {route}\n"));
                } else {
                    books.routes_waiting.push(route);
                }
            }
            if wait {
                break;
            }
        }
        if !retry.is_empty() {
            write(&mut a, &retry).await?;
        }
        progress.show(books.delivered.len() as u64);
        let delivered = books.delivered.len() as u64;
        if kill_points
            .get(books.summary.kills as usize)
            .is_some_and(|&at| delivered >= at)
        {
            // SIGKILL: no chance to flush or consume; B restarts from its directory.
            b.kill().await.map_err(io("kill b"))?;
            books.summary.kills += 1;
            b_life += 1;
            b_up = false;
            b = spawn(exe, "b", b_life, &b_args, &events_tx)?;
            progress.note("killed b (SIGKILL) and restarted it from its data dir");
        }
        if books.summary.disconnects == 0 && delivered >= disconnect_at {
            write(&mut a, "disconnect\n").await?;
            books.summary.disconnects += 1;
            progress.note("cut the link between a and b");
        }
        let summary = &books.summary;
        let all_acked = books.acked.len() as u64 + summary.replies >= total;
        let routes_done = summary.routes_answered + books.routes_given_up >= summary.routed;
        if next_index >= total && delivered >= total && all_acked && routes_done {
            break;
        }
    }
    books.summary.seconds = started.elapsed().as_secs_f64();
    progress.done();
    a.quit().await;
    b.quit().await;
    if let Some(mut relay) = relay {
        let _ = relay.kill().await;
    }
    // What arrived while they shut down (the last telemetry batches).
    while let Ok(event) = events.try_recv() {
        let _ = account(&event, &mut books);
    }
    Ok(verdict(books))
}

/// The table's figures and every invariant checked.
fn verdict(books: Books) -> Summary {
    let Books {
        mut summary,
        delivered,
        acked,
        requested,
        sent_at,
        mut latencies,
        ..
    } = books;
    summary.requests = requested.len() as u64;
    summary.delivered = delivered.len() as u64;
    summary.lost = sent_at
        .keys()
        .filter(|name| !delivered.contains(name.as_str()))
        .count() as u64;
    summary.acked = acked.len() as u64;
    summary.acked_but_lost = acked
        .iter()
        .filter(|name| !delivered.contains(name.as_str()))
        .count() as u64;
    (summary.latency_p50_ms, summary.latency_p99_ms) = tether_core::stats::p50_p99(&mut latencies);
    summary.throughput_msgs_per_s = summary.delivered as f64 / summary.seconds.max(1e-9);
    for (what, count) in [
        ("lost", summary.lost),
        ("acknowledged and lost", summary.acked_but_lost),
        ("duplicated", summary.duplicates),
        ("reordered", summary.reordered),
        ("wrongly answered", summary.wrong_replies),
        ("routed and wrongly answered", summary.wrong_routes),
    ] {
        if count > 0 {
            summary.failures.push(format!("{count} message(s) {what}"));
        }
    }
    if summary.replies != summary.requests {
        summary.failures.push(format!(
            "{} of {} requests answered",
            summary.replies, summary.requests
        ));
    }
    if summary.routes_answered != summary.routed {
        summary.failures.push(format!(
            "{} of {} routed requests answered",
            summary.routes_answered, summary.routed
        ));
    }
    if summary.delivered > 0 && summary.telemetry_events == 0 {
        summary
            .failures
            .push("no telemetry arrived from b although it consumed messages".into());
    }
    summary
}

pub(crate) async fn next(
    events: &mut mpsc::UnboundedReceiver<Event>,
    waiting_for: &str,
) -> Result<Event, DemoError> {
    match tokio::time::timeout(STALL, events.recv()).await {
        Ok(Some(event)) => Ok(event),
        Ok(None) => Err(DemoError::NotReady("a")),
        Err(_) => Err(DemoError::Stalled(
            STALL,
            format!("waiting for {waiting_for}"),
        )),
    }
}

pub(crate) async fn write(node: &mut NodeProc, commands: &str) -> Result<(), DemoError> {
    node.write(commands).await.map_err(io("write to a node"))
}

/// Starts node `name` (incarnation `life`).
pub(crate) fn spawn(
    exe: &Path,
    name: &'static str,
    life: u64,
    args: &[String],
    events: &mpsc::UnboundedSender<Event>,
) -> Result<NodeProc, DemoError> {
    NodeProc::spawn(exe, name, life, args, events.clone()).map_err(io(format!("node {name}")))
}

/// Accounts one event of either node; returns a routed request to try again (its host died
/// under it).
fn account(event: &Event, books: &mut Books) -> Option<String> {
    let value = &event.value;
    let text = |key: &str| value[key].as_str().unwrap_or_default().to_owned();
    let summary = &mut books.summary;
    match (event.from, value["event"].as_str().unwrap_or_default()) {
        ("b", "message") | ("b", "request") => {
            let name = text("body");
            let Some((obj, index)) = parse_body(&name) else {
                summary
                    .failures
                    .push(format!("b delivered a body nobody sent: {name:?}"));
                return None;
            };
            let seq = value["seq"].as_u64().unwrap_or_default();
            let seen_before = books.delivered.contains(&name);
            let delivery =
                books
                    .seen
                    .entry(obj)
                    .or_default()
                    .classify(seq, index, event.life, seen_before);
            match delivery {
                Delivery::Redelivered => summary.redelivered_after_restart += 1,
                Delivery::Duplicate => summary.duplicates += 1,
                Delivery::First | Delivery::Reordered => {
                    if delivery == Delivery::Reordered {
                        summary.reordered += 1;
                    }
                    if let Some(at) = books.sent_at.get(&name) {
                        books.latencies.push(at.elapsed().as_secs_f64() * 1e3);
                    }
                    books.delivered.insert(name);
                }
            }
        }
        ("a", "acked") => {
            books.acked.insert(text("body"));
        }
        ("a", "reply") => {
            summary.replies += 1;
            if text("answer") != format!("re:{}", text("body")) {
                summary.wrong_replies += 1;
            }
        }
        ("a", "routed") => {
            summary.routes_answered += 1;
            if text("answer") != text("body").to_ascii_uppercase() {
                summary.wrong_routes += 1;
            }
        }
        ("a", "route_failed") => {
            // Its host (B) died, or A's switch has not seen the new one yet: try again.
            let route = text("body");
            let attempts = books.route_attempts.entry(route.clone()).or_insert(1);
            if *attempts >= ROUTE_ATTEMPTS {
                books.routes_given_up += 1;
                summary.failures.push(format!(
                    "route {route} failed {attempts} times, last: {}",
                    text("message")
                ));
                return None;
            }
            *attempts += 1;
            summary.routes_retried += 1;
            return Some(route);
        }
        ("a", "telemetry_opened") => summary.telemetry_streams += 1,
        ("a", "telemetry") => summary.telemetry_events += value["events"].as_u64().unwrap_or(0),
        ("a", "send_failed") | ("a", "req_failed") | ("a", "error") | ("b", "error") => {
            summary
                .failures
                .push(format!("{} reported: {}", event.from, value));
        }
        _ => {}
    }
    None
}

/// A progress bar on a terminal (stderr), plain lines every tenth otherwise.
pub(crate) struct Progress {
    total: u64,
    quiet: bool,
    terminal: bool,
    last_tenth: std::cell::Cell<u64>,
}

impl Progress {
    pub(crate) fn new(total: u64, quiet: bool) -> Self {
        Self {
            total: total.max(1),
            quiet,
            terminal: std::io::stderr().is_terminal(),
            last_tenth: std::cell::Cell::new(0),
        }
    }

    pub(crate) fn show(&self, delivered: u64) {
        if self.quiet {
            return;
        }
        let done = delivered.min(self.total);
        if self.terminal {
            let width = 40;
            let filled = (done * width / self.total) as usize;
            eprint!(
                "\r[{}{}] {done}/{} delivered",
                "#".repeat(filled),
                " ".repeat(width as usize - filled),
                self.total
            );
        } else {
            let tenth = done * 10 / self.total;
            if tenth > self.last_tenth.get() {
                self.last_tenth.set(tenth);
                eprintln!("{}% delivered ({done}/{})", tenth * 10, self.total);
            }
        }
    }

    pub(crate) fn note(&self, what: &str) {
        if self.quiet {
            return;
        }
        if self.terminal {
            eprintln!();
        }
        eprintln!("{what}");
    }

    pub(crate) fn done(&self) {
        if !self.quiet && self.terminal {
            eprintln!();
        }
    }
}

fn print_table(summary: &Summary) {
    let rows: [(&str, String); 15] = [
        ("sent", summary.sent.to_string()),
        ("delivered (first time)", summary.delivered.to_string()),
        ("acknowledged durable", summary.acked.to_string()),
        (
            "redelivered after a restart (same seq)",
            summary.redelivered_after_restart.to_string(),
        ),
        ("duplicates", summary.duplicates.to_string()),
        ("lost", summary.lost.to_string()),
        ("acknowledged but lost", summary.acked_but_lost.to_string()),
        ("reordered", summary.reordered.to_string()),
        (
            "requests answered",
            format!("{} of {}", summary.replies, summary.requests),
        ),
        (
            "routed through the switch to b's host",
            format!(
                "{} of {} answered ({} retried after b died under them)",
                summary.routes_answered, summary.routed, summary.routes_retried
            ),
        ),
        (
            "telemetry from b",
            format!(
                "{} event(s) over {} stream(s)",
                summary.telemetry_events, summary.telemetry_streams
            ),
        ),
        (
            "b killed (SIGKILL) / links cut",
            format!("{} / {}", summary.kills, summary.disconnects),
        ),
        (
            "throughput",
            format!(
                "{:.0} msg/s over {:.1} s",
                summary.throughput_msgs_per_s, summary.seconds
            ),
        ),
        ("latency p50", format!("{:.1} ms", summary.latency_p50_ms)),
        ("latency p99", format!("{:.1} ms", summary.latency_p99_ms)),
    ];
    let width = rows.iter().map(|(name, _)| name.len()).max().unwrap_or(0);
    println!();
    for (name, value) in rows {
        println!("  {name:<width$}  {value}");
    }
    if summary.failures.is_empty() {
        println!("\nevery invariant held: nothing lost, duplicated or reordered; every acknowledged message delivered");
    } else {
        println!("\nINVARIANTS BROKEN:");
        for failure in &summary.failures {
            println!("  - {failure}");
        }
    }
}
