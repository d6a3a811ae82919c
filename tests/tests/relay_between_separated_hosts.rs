//! Two `tether node` processes on separated hosts (network namespaces this test builds, see
//! `tether_tests::netns`) that can reach each other only through `tether relay`, iroh's relay
//! server, running on the router between them. The substrate's queue and session, the request
//! switch and a telemetry subscription work over the relayed path; then the router starts
//! forwarding and the connection moves to the direct path; then it stops and the connection
//! goes back to the relay; then the relay is killed and restarted. Across all of it the queue
//! loses, duplicates and reorders nothing. Needs root: elsewhere it says so and skips.

use std::path::Path;
use std::time::{Duration, Instant};

use tether_tests::netns::{self, Topology, A_ADDR, B_ADDR, RELAY_ADDR};
use tether_tests::procs::{next, Event, NodeProc};
use tokio::sync::mpsc;

/// How long a path change may take before the test fails (a hang guard: iroh finds a new
/// direct path within seconds, and notices a dead one within its path idle timeout).
const PATH_CHANGE_DEADLINE: Duration = Duration::from_secs(90);
const RELAY_PORT: u16 = 3340;

struct Run {
    tether: &'static Path,
    topology: Topology,
    events: mpsc::UnboundedReceiver<Event>,
    events_tx: mpsc::UnboundedSender<Event>,
    b: Option<NodeProc>,
    sent: u64,
    acked: u64,
    delivered: Vec<u64>,
}

impl Run {
    fn relay(&self, life: u64) -> NodeProc {
        NodeProc::spawn_wrapped(
            &Topology::inside(&self.topology.r),
            self.tether,
            "relay",
            "relay",
            life,
            &["--listen".into(), format!("{RELAY_ADDR}:{RELAY_PORT}")],
            self.events_tx.clone(),
        )
        .expect("tether relay starts")
    }

    fn node(&self, ns: &str, name: &'static str, args: Vec<String>) -> NodeProc {
        NodeProc::spawn_wrapped(
            &Topology::inside(ns),
            self.tether,
            "node",
            name,
            1,
            &args,
            self.events_tx.clone(),
        )
        .expect("tether node starts")
    }

    /// The next event, with the traffic it carries accounted.
    async fn event(&mut self, waiting_for: &str) -> Event {
        let event = next(&mut self.events, waiting_for).await;
        match (event.from, event.kind()) {
            ("a", "message") => {
                let body = event.text("body");
                let index = body
                    .strip_prefix('m')
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("a body the test sent: {body}"));
                self.delivered.push(index);
            }
            ("b", "acked") => self.acked += 1,
            (_, "error" | "send_failed") => panic!("{}: {:?}", event.from, event.value),
            _ => {}
        }
        event
    }

    async fn write_b(&mut self, commands: &str) {
        let b = self.b.as_mut().expect("b runs");
        b.write(commands).await.expect("b reads commands");
    }

    /// Sends `n` more messages on the queue without waiting.
    async fn send(&mut self, n: u64) {
        let commands: String = (self.sent..self.sent + n)
            .map(|i| format!("send q m{i}\n"))
            .collect();
        self.sent += n;
        self.write_b(&commands).await;
    }

    /// Waits until every message sent is acknowledged at B and delivered at A.
    async fn settle(&mut self) {
        while self.acked < self.sent || (self.delivered.len() as u64) < self.sent {
            self.event("acks and deliveries").await;
        }
    }

    /// The path B's connection to A sends on now: `relay`, `direct` or `none`.
    async fn via(&mut self) -> String {
        self.write_b("stats\n").await;
        loop {
            let event = self.event("b's stats").await;
            if event.from == "b" && event.kind() == "stats" {
                return event.text("via");
            }
        }
    }

    /// Sends traffic round after round until B's connection sends on `path`; returns the
    /// messages it took.
    async fn until_via(&mut self, path: &str) -> u64 {
        let (start, first) = (Instant::now(), self.sent);
        loop {
            self.send(5).await;
            self.settle().await;
            if self.via().await == path {
                return self.sent - first;
            }
            assert!(
                start.elapsed() < PATH_CHANGE_DEADLINE,
                "B's connection never moved to the {path} path"
            );
        }
    }

    /// Waits for one event of `kind` from `from` (the traffic before it accounted).
    async fn expect(&mut self, from: &str, kind: &str) -> Event {
        loop {
            let event = self.event(kind).await;
            if event.from == from && event.kind() == kind {
                return event;
            }
        }
    }

    /// Waits for one event of each kind from `from`, in whatever order they come.
    async fn expect_each(&mut self, from: &str, kinds: &[&str]) -> Vec<Event> {
        let mut seen: Vec<Option<Event>> = vec![None; kinds.len()];
        while seen.iter().any(Option::is_none) {
            let event = self.event("several events").await;
            if event.from != from {
                continue;
            }
            if let Some(at) = kinds.iter().position(|kind| *kind == event.kind()) {
                seen[at].get_or_insert(event);
            }
        }
        seen.into_iter().flatten().collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_relay_then_direct_then_the_relay_again_nothing_lost() {
    if let Some(why) = netns::unavailable() {
        eprintln!("SKIPPED relay_between_separated_hosts: {why}");
        return;
    }
    let topology = Topology::build().expect("the namespaces");
    let dir = std::env::temp_dir().join(format!("tether-netns-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let data = |who: &str| dir.join(who).display().to_string();
    let (events_tx, events) = mpsc::unbounded_channel();
    let mut run = Run {
        tether: Path::new(env!("CARGO_BIN_EXE_tether-under-test")),
        topology,
        events,
        events_tx,
        b: None,
        sent: 0,
        acked: 0,
        delivered: Vec::new(),
    };
    let mut relay = run.relay(1);
    let url = run.expect("relay", "relay").await.text("url");
    let a_args = vec![
        "--data".into(),
        data("a"),
        "--listen".into(),
        format!("{A_ADDR}:0"),
        "--relay".into(),
        url.clone(),
    ];
    let a = run.node(&run.topology.a.clone(), "a", a_args);
    let ticket = run.expect("a", "ready").await.text("ticket");
    let b_args = vec![
        "--data".into(),
        data("b"),
        "--listen".into(),
        format!("{B_ADDR}:0"),
        "--relay".into(),
        url.clone(),
        "--connect".into(),
        ticket,
    ];
    run.b = Some(run.node(&run.topology.b.clone(), "b", b_args));
    run.expect("b", "ready").await;
    run.write_b("open queue q\nopen session s\n").await;
    let mut opened = 0;
    while opened < 2 {
        opened += usize::from(run.expect("b", "opened").await.from == "b");
    }

    // 1. The relay is the only path: every plane works over it.
    run.send(50).await;
    run.settle().await;
    assert_eq!(run.via().await, "relay", "no direct path exists yet");
    run.write_b("req s ping\nroute hello\nsubscribe\n").await;
    let answers = run
        .expect_each("b", &["reply", "routed", "subscribed", "telemetry_opened"])
        .await;
    assert_eq!(answers[0].value["answer"].as_str(), Some("re:ping"));
    assert_eq!(answers[1].value["answer"].as_str(), Some("HELLO"));
    let relayed = run.sent;

    // 2. The router starts forwarding: the connection moves to the direct path.
    run.topology.set_forwarding(true).expect("forwarding on");
    let to_direct = run.until_via("direct").await;

    // 3. It stops: the connection goes back to the relay, and nothing is lost meanwhile.
    run.topology.set_forwarding(false).expect("forwarding off");
    let to_relay = run.until_via("relay").await;

    // 4. The relay dies with messages in flight and comes back on the same address.
    relay.kill().await.expect("the relay dies");
    run.send(20).await;
    let mut relay = run.relay(2);
    run.expect("relay", "relay").await;
    run.settle().await;

    // Exactly once, in order, across every path change.
    let expected: Vec<u64> = (0..run.sent).collect();
    assert_eq!(run.delivered, expected, "lost, duplicated or reordered");
    eprintln!(
        "relay_between_separated_hosts: {} messages ({relayed} relayed only; {to_direct} until \
         the direct path, {to_relay} until the relay again, 20 across a relay restart), \
         nothing lost, duplicated or reordered",
        run.sent
    );
    a.quit().await;
    if let Some(b) = run.b.take() {
        b.quit().await;
    }
    relay.kill().await.expect("the relay stops");
    let _ = std::fs::remove_dir_all(&dir);
}
