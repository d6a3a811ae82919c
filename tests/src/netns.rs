//! Separated hosts for tests: network namespaces on this machine, joined by veth pairs, with
//! addresses from the benchmarking range 198.18.0.0/15 that only these namespaces use. Every
//! namespace is deleted when its [`Topology`] drops (its interfaces go with it). Needs root
//! (`CAP_NET_ADMIN`); [`unavailable`] says why not, for a test to skip loudly.
//!
//! The topology: host A (`198.18.1.2`) and host B (`198.18.2.2`) each hang off a router R
//! (`198.18.1.1`, `198.18.2.1`), which also holds the relay's address `198.19.0.1`. A and B
//! reach the relay; they reach each other only while R forwards
//! ([`Topology::set_forwarding`]), so with forwarding off the relay is their only path.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::procs::{next, Event, NodeProc};

/// How long a path change may take before a test fails (a hang guard: iroh finds a new
/// direct path within seconds, and notices a dead one within its path idle timeout).
pub const PATH_CHANGE_DEADLINE: Duration = Duration::from_secs(90);
/// The relay's port on [`RELAY_ADDR`].
pub const RELAY_PORT: u16 = 3340;

/// A name no other namespace or interface of this machine has: this process's id and a count
/// (the end-to-end tests share one process, and run side by side), at most 10 characters
/// after `prefix`, within an interface name's 15.
fn unique() -> String {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{}x{n}", std::process::id())
}

/// Host A's address.
pub const A_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 2);
/// Host B's address.
pub const B_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 2);
/// The relay's address, on the router.
pub const RELAY_ADDR: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 1);

/// Runs `ip <args>`; an error names the command and what it printed.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .map_err(|error| format!("ip {}: {error}", args.join(" ")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// Runs `<program> <args>` inside namespace `ns`.
pub fn exec(ns: &str, program: &str, args: &[&str]) -> Result<(), String> {
    let mut all = vec!["netns", "exec", ns, program];
    all.extend_from_slice(args);
    ip(&all)
}

/// Runs `<program> <args>` inside namespace `ns`; what it printed.
pub fn exec_output(ns: &str, program: &str, args: &[&str]) -> Result<String, String> {
    let output = Command::new("ip")
        .args(["netns", "exec", ns, program])
        .args(args)
        .output()
        .map_err(|error| format!("{program} {}: {error}", args.join(" ")))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

/// What an [`Impairment`] did to the packets, read from netfilter's own counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Impaired {
    /// Packets dropped.
    pub dropped: u64,
    /// Packets sent twice.
    pub duplicated: u64,
    /// Packets held (delayed, and reordered by it).
    pub held: u64,
}

impl std::fmt::Display for Impaired {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} packets dropped, {} duplicated, {} held",
            self.dropped, self.duplicated, self.held
        )
    }
}

/// Why `tc netem` cannot shape a link here (this kernel lacks `sch_netem`), or `None`.
pub fn netem_unavailable() -> Option<String> {
    let probe = format!("ttnetem{}", unique());
    ip(&["netns", "add", &probe]).ok()?;
    let tried = exec(&probe, "ip", &["link", "set", "lo", "up"]).and_then(|()| {
        exec(
            &probe,
            "tc",
            &["qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
        )
    });
    let _ = ip(&["netns", "del", &probe]);
    tried
        .err()
        .map(|error| format!("this kernel cannot run tc netem ({error})"))
}

/// Why namespaces cannot be made here, or `None` when they can.
pub fn unavailable() -> Option<String> {
    let probe = format!("ttprobe{}", unique());
    match ip(&["netns", "add", &probe]) {
        Ok(()) => {
            let _ = ip(&["netns", "del", &probe]);
            None
        }
        Err(error) => Some(format!(
            "network namespaces cannot be made here (needs root and iproute2): {error}"
        )),
    }
}

/// Hosts A and B and router R (see the module docs).
#[derive(Debug)]
pub struct Topology {
    /// Host A's namespace.
    pub a: String,
    /// Host B's namespace.
    pub b: String,
    /// The router's namespace (the relay runs here).
    pub r: String,
    /// Each host's link to the router, as (namespace, interface): everything A and B send,
    /// to each other or to the relay, leaves through one of these.
    host_links: Vec<(String, String)>,
    /// The router's end of each host's link, A's then B's.
    router_links: Vec<String>,
    /// The `tether-impair` process serving the router's packet queue, while one runs.
    impairer: Option<std::process::Child>,
}

/// A fault netfilter makes in the router on everything it sends toward either host (from
/// the other host or from the relay), for kernels without `sch_netem`: loss and duplication
/// are the kernel's own (iptables `statistic` with `DROP`; nftables `dup` at the link's
/// egress); delay, jitter and reordering hold the packets the kernel queues (NFQUEUE) in
/// `tether-impair`, which gives each back to the kernel when its time comes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Impairment {
    /// Packets dropped, in tenths of a percent (every n-th packet).
    pub loss_permille: u32,
    /// Packets sent twice, in percent (every n-th packet).
    pub duplicate_percent: u32,
    /// Each packet held this long, in milliseconds…
    pub delay_ms: u64,
    /// …plus or minus up to this (uniform): packets overtake one another.
    pub jitter_ms: u64,
    /// Packets sent on at once, ahead of those held, in percent.
    pub reorder_percent: u64,
}

impl std::fmt::Display for Impairment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if self.delay_ms > 0 || self.jitter_ms > 0 {
            parts.push(format!("delay {}ms ± {}ms", self.delay_ms, self.jitter_ms));
        }
        if self.reorder_percent > 0 {
            parts.push(format!("reorder {}%", self.reorder_percent));
        }
        if self.loss_permille > 0 {
            parts.push(format!(
                "loss {}.{}%",
                self.loss_permille / 10,
                self.loss_permille % 10
            ));
        }
        if self.duplicate_percent > 0 {
            parts.push(format!("duplicate {}%", self.duplicate_percent));
        }
        write!(f, "{}", parts.join(", "))
    }
}

/// Why netfilter cannot impair packets here (no `iptables` or `nft`, or a kernel without
/// nftables or NFQUEUE), or `None`.
pub fn impairment_unavailable(tether_impair: &Path) -> Option<String> {
    let probe = format!("ttnft{}", unique());
    if let Err(error) = ip(&["netns", "add", &probe]) {
        return Some(error);
    }
    let tried = exec(
        &probe,
        "iptables",
        &[
            "-A",
            "OUTPUT",
            "-o",
            "lo",
            "-j",
            "NFQUEUE",
            "--queue-num",
            "0",
            "--queue-bypass",
        ],
    )
    .and_then(|()| exec(&probe, "iptables", &["-F", "OUTPUT"]))
    .and_then(|()| exec(&probe, "nft", &["add", "table", "netdev", "probe"]))
    .and_then(|()| {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &probe])
            .arg(tether_impair)
            .args(["--queue", "0"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|error| format!("tether-impair: {error}"))?;
        let ready = first_line(&mut child);
        let _ = child.kill();
        let output = child
            .wait_with_output()
            .map_err(|error| error.to_string())?;
        match ready.as_deref() {
            Some("ready") => Ok(()),
            _ => Err(String::from_utf8_lossy(&output.stderr).trim().to_owned()),
        }
    });
    let _ = ip(&["netns", "del", &probe]);
    tried
        .err()
        .map(|error| format!("netfilter cannot impair packets here ({error})"))
}

/// The first line a child prints on stdout (it keeps running).
fn first_line(child: &mut std::process::Child) -> Option<String> {
    use std::io::BufRead;
    let stdout = child.stdout.take()?;
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line).ok()?;
    Some(line.trim().to_owned())
}

impl Topology {
    /// Builds the namespaces, links and addresses, forwarding off.
    pub fn build() -> Result<Self, String> {
        let id = unique();
        let topology = Self {
            a: format!("tt{id}a"),
            b: format!("tt{id}b"),
            r: format!("tt{id}r"),
            host_links: Vec::new(),
            router_links: Vec::new(),
            impairer: None,
        };
        let mut topology = topology;
        for ns in [&topology.a, &topology.b, &topology.r] {
            ip(&["netns", "add", ns])?;
            exec(ns, "ip", &["link", "set", "lo", "up"])?;
        }
        let r = topology.r.clone();
        for (host, side, host_addr, router_addr) in [
            (&topology.a, "a", A_ADDR, "198.18.1.1"),
            (&topology.b, "b", B_ADDR, "198.18.2.1"),
        ] {
            let (host_if, router_if) = (format!("h{side}{id}"), format!("r{side}{id}"));
            topology.host_links.push((host.clone(), host_if.clone()));
            topology.router_links.push(router_if.clone());
            ip(&[
                "link", "add", &host_if, "netns", host, "type", "veth", "peer", "name", &router_if,
                "netns", &r,
            ])?;
            exec(
                host,
                "ip",
                &["addr", "add", &format!("{host_addr}/24"), "dev", &host_if],
            )?;
            exec(host, "ip", &["link", "set", &host_if, "up"])?;
            exec(host, "ip", &["route", "add", "default", "via", router_addr])?;
            exec(
                &r,
                "ip",
                &[
                    "addr",
                    "add",
                    &format!("{router_addr}/24"),
                    "dev",
                    &router_if,
                ],
            )?;
            exec(&r, "ip", &["link", "set", &router_if, "up"])?;
        }
        exec(
            &r,
            "ip",
            &["addr", "add", &format!("{RELAY_ADDR}/32"), "dev", "lo"],
        )?;
        topology.set_forwarding(false)?;
        Ok(topology)
    }

    /// Whether R forwards between A and B (their direct path); the relay stays reachable
    /// either way.
    pub fn set_forwarding(&self, on: bool) -> Result<(), String> {
        let value = format!("net.ipv4.ip_forward={}", u8::from(on));
        exec(&self.r, "sysctl", &["-qw", &value])
    }

    /// Puts the queueing discipline `qdisc` (for instance `netem delay 50ms 20ms`, or
    /// `tbf rate 1mbit burst 16kbit latency 50ms`) on both hosts' links, replacing what was
    /// there; an empty `qdisc` takes it off.
    pub fn shape(&self, qdisc: &str) -> Result<(), String> {
        for (ns, link) in &self.host_links {
            if qdisc.is_empty() {
                exec(ns, "tc", &["qdisc", "del", "dev", link, "root"])?;
            } else {
                let mut args = vec!["qdisc", "replace", "dev", link, "root"];
                args.extend(qdisc.split_whitespace());
                exec(ns, "tc", &args)?;
            }
        }
        Ok(())
    }

    /// Puts `impairment` on everything the router sends toward either host, replacing the
    /// one before; `None` takes it off. `tether_impair` is the `tether-impair` program (it
    /// serves the queue while delay, jitter or reordering is asked for).
    pub fn impair(
        &mut self,
        tether_impair: &Path,
        impairment: Option<Impairment>,
    ) -> Result<(), String> {
        for args in [
            ["-F", "FORWARD"],
            ["-F", "OUTPUT"],
            ["-F", "IMPAIR"],
            ["-X", "IMPAIR"],
        ] {
            let _ = exec(&self.r, "iptables", &args);
        }
        let _ = exec(
            &self.r,
            "nft",
            &["delete", "table", "netdev", "tether_impair"],
        );
        if let Some(mut child) = self.impairer.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let Some(impairment) = impairment else {
            return Ok(());
        };
        let held = impairment.delay_ms > 0 || impairment.jitter_ms > 0;
        // Loss and the queue: iptables rules (nf_tables underneath, through its xtables
        // compatibility: kernels without nft's own `queue` expression still take them), in one
        // chain every packet toward a host goes through, so that one count spans them all.
        if impairment.loss_permille > 0 || held {
            exec(&self.r, "iptables", &["-N", "IMPAIR"])?;
            if let Some(every) = 1000u32.checked_div(impairment.loss_permille) {
                // Every n-th packet: the rate asked for, and a run of a given length always
                // loses some.
                let every = every.max(1).to_string();
                let rule = [
                    "-A",
                    "IMPAIR",
                    "-m",
                    "statistic",
                    "--mode",
                    "nth",
                    "--every",
                    &every,
                    "--packet",
                    "0",
                    "-j",
                    "DROP",
                ];
                exec(&self.r, "iptables", &rule)?;
            }
            if held {
                let rule = [
                    "-A",
                    "IMPAIR",
                    "-j",
                    "NFQUEUE",
                    "--queue-num",
                    "0",
                    "--queue-bypass",
                ];
                exec(&self.r, "iptables", &rule)?;
            }
            for chain in ["FORWARD", "OUTPUT"] {
                for link in &self.router_links {
                    exec(
                        &self.r,
                        "iptables",
                        &["-A", chain, "-o", link, "-j", "IMPAIR"],
                    )?;
                }
            }
        }
        if let Some(every) = 100u32.checked_div(impairment.duplicate_percent) {
            // The copy is marked, so that it is not copied again on its own way out.
            let mut rules = String::from("table netdev tether_impair {\n");
            for (n, link) in self.router_links.iter().enumerate() {
                rules.push_str(&format!(
                    "  chain out{n} {{\n    type filter hook egress device \"{link}\" priority 0; \
                     policy accept;\n    meta mark 0 numgen inc mod {} == 0 meta mark set 1 \
                     counter dup to \"{link}\"\n  }}\n",
                    every.max(1)
                ));
            }
            rules.push_str("}\n");
            let file = std::env::temp_dir().join(format!("tether-impair-{}.nft", self.r));
            std::fs::write(&file, rules).map_err(|error| format!("nft rules: {error}"))?;
            let applied = exec(&self.r, "nft", &["-f", &file.display().to_string()]);
            let _ = std::fs::remove_file(&file);
            applied?;
        }
        if held {
            let mut child = Command::new("ip")
                .args(["netns", "exec", &self.r])
                .arg(tether_impair)
                .args([
                    "--queue".to_owned(),
                    "0".to_owned(),
                    "--delay".to_owned(),
                    impairment.delay_ms.to_string(),
                    "--jitter".to_owned(),
                    impairment.jitter_ms.to_string(),
                    "--reorder".to_owned(),
                    impairment.reorder_percent.to_string(),
                ])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .map_err(|error| format!("tether-impair: {error}"))?;
            if first_line(&mut child).as_deref() != Some("ready") {
                let _ = child.kill();
                return Err("tether-impair did not start".to_owned());
            }
            self.impairer = Some(child);
        }
        Ok(())
    }

    /// What the impairment in place did so far.
    pub fn impaired(&self) -> Result<Impaired, String> {
        let mut counts = Impaired::default();
        if let Ok(listing) = exec_output(&self.r, "iptables", &["-L", "IMPAIR", "-v", "-x", "-n"]) {
            for line in listing.lines() {
                let mut words = line.split_whitespace();
                let (Some(packets), Some(_bytes), Some(target)) =
                    (words.next(), words.next(), words.next())
                else {
                    continue;
                };
                let Ok(packets) = packets.parse::<u64>() else {
                    continue;
                };
                match target {
                    "DROP" => counts.dropped += packets,
                    "NFQUEUE" => counts.held += packets,
                    _ => {}
                }
            }
        }
        if let Ok(listing) = exec_output(
            &self.r,
            "nft",
            &["list", "table", "netdev", "tether_impair"],
        ) {
            let mut words = listing.split_whitespace();
            while let Some(word) = words.next() {
                if word == "packets" {
                    counts.duplicated += words.next().and_then(|n| n.parse().ok()).unwrap_or(0);
                }
            }
        }
        Ok(counts)
    }

    /// Takes host `host`'s link (`0` for A, `1` for B) down at the router, or brings it back:
    /// a partition of that host from everything, the relay included.
    pub fn set_link(&self, host: usize, up: bool) -> Result<(), String> {
        let state = if up { "up" } else { "down" };
        exec(
            &self.r,
            "ip",
            &["link", "set", &self.router_links[host], state],
        )
    }

    /// The command line prefix that runs a program inside namespace `ns`.
    pub fn inside(ns: &str) -> [&str; 4] {
        ["ip", "netns", "exec", ns]
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        if let Some(mut child) = self.impairer.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        for ns in [&self.a, &self.b, &self.r] {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// Two `tether node` processes, A in namespace `a` and B in `b`, homed on `tether relay` on
/// the router; B talks to A (a queue `q`, a session `s`) and is driven through its stdin. B
/// sends `m0, m1, …` on `q`; every event read is accounted (what A delivered, what B had
/// acknowledged), and an `error` or `send_failed` event fails the test.
pub struct Pair {
    tether: &'static Path,
    topology: Topology,
    events: mpsc::UnboundedReceiver<Event>,
    events_tx: mpsc::UnboundedSender<Event>,
    relay: Option<NodeProc>,
    relay_life: u64,
    a: Option<NodeProc>,
    b: Option<NodeProc>,
    dir: std::path::PathBuf,
    sent: u64,
    acked: u64,
    delivered: Vec<u64>,
}

impl Pair {
    /// Starts the relay, A (on [`A_ADDR`]) and B (on [`B_ADDR`], given A's ticket), and opens
    /// B's queue and session on A. `tether` is the program; data lives under `dir`.
    pub async fn start(tether: &'static Path, topology: Topology, dir: std::path::PathBuf) -> Self {
        let _ = std::fs::remove_dir_all(&dir);
        let (events_tx, events) = mpsc::unbounded_channel();
        let mut pair = Self {
            tether,
            topology,
            events,
            events_tx,
            relay: None,
            relay_life: 0,
            a: None,
            b: None,
            dir,
            sent: 0,
            acked: 0,
            delivered: Vec::new(),
        };
        let url = pair.start_relay().await;
        let data = |who: &str| pair.dir.join(who).display().to_string();
        let relay_args = |who: &str, addr: Ipv4Addr| {
            vec![
                "--data".to_owned(),
                data(who),
                "--listen".into(),
                format!("{addr}:0"),
                "--relay".into(),
                url.clone(),
            ]
        };
        let (a_args, mut b_args) = (relay_args("a", A_ADDR), relay_args("b", B_ADDR));
        pair.a = Some(pair.node(&pair.topology.a.clone(), "a", a_args));
        let ticket = pair.expect("a", "ready").await.text("ticket");
        b_args.extend(["--connect".to_owned(), ticket]);
        pair.b = Some(pair.node(&pair.topology.b.clone(), "b", b_args));
        pair.expect("b", "ready").await;
        pair.write_b("open queue q\nopen session s\n").await;
        pair.expect_each("b", &["opened"]).await;
        pair.expect_each("b", &["opened"]).await;
        pair
    }

    /// The namespaces.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The namespaces, to change.
    pub fn topology_mut(&mut self) -> &mut Topology {
        &mut self.topology
    }

    /// Messages B sent so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }

    /// The indices of the messages A delivered, in delivery order.
    pub fn delivered(&self) -> &[u64] {
        &self.delivered
    }

    /// Starts (or restarts) the relay on [`RELAY_ADDR`]:[`RELAY_PORT`]; returns its URL.
    pub async fn start_relay(&mut self) -> String {
        self.relay_life += 1;
        self.relay = Some(
            NodeProc::spawn_wrapped(
                &Topology::inside(&self.topology.r),
                self.tether,
                "relay",
                "relay",
                self.relay_life,
                &["--listen".into(), format!("{RELAY_ADDR}:{RELAY_PORT}")],
                self.events_tx.clone(),
            )
            .expect("tether relay starts"),
        );
        self.expect("relay", "relay").await.text("url")
    }

    /// Kills the relay (SIGKILL).
    pub async fn kill_relay(&mut self) {
        if let Some(mut relay) = self.relay.take() {
            relay.kill().await.expect("the relay dies");
        }
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

    /// Writes command lines to B.
    pub async fn write_b(&mut self, commands: &str) {
        let b = self.b.as_mut().expect("b runs");
        b.write(commands).await.expect("b reads commands");
    }

    /// Sends `n` more messages on the queue without waiting.
    pub async fn send(&mut self, n: u64) {
        let commands: String = (self.sent..self.sent + n)
            .map(|i| format!("send q m{i}\n"))
            .collect();
        self.sent += n;
        self.write_b(&commands).await;
    }

    /// Waits until every message sent is acknowledged at B and delivered at A.
    pub async fn settle(&mut self) {
        while self.acked < self.sent || (self.delivered.len() as u64) < self.sent {
            self.event("acks and deliveries").await;
        }
    }

    /// The path B's connection to A sends on now: `relay`, `direct` or `none`.
    pub async fn via(&mut self) -> String {
        self.write_b("stats\n").await;
        self.expect("b", "stats").await.text("via")
    }

    /// Sends traffic round after round until B's connection sends on `path`; returns the
    /// messages it took.
    pub async fn until_via(&mut self, path: &str) -> u64 {
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

    /// Waits for one event of `kind` from `from` (the traffic before it accounted; other
    /// events are passed over).
    pub async fn expect(&mut self, from: &str, kind: &str) -> Event {
        loop {
            let event = self.event(kind).await;
            if event.from == from && event.kind() == kind {
                return event;
            }
        }
    }

    /// Waits for one event of each kind from `from`, in whatever order they come.
    pub async fn expect_each(&mut self, from: &str, kinds: &[&str]) -> Vec<Event> {
        let mut seen: Vec<Option<Event>> = vec![None; kinds.len()];
        while seen.iter().any(Option::is_none) {
            let event = self.event("several events").await;
            if event.from != from {
                continue;
            }
            if let Some(at) = kinds
                .iter()
                .zip(&seen)
                .position(|(kind, seen)| *kind == event.kind() && seen.is_none())
            {
                seen[at] = Some(event);
            }
        }
        seen.into_iter().flatten().collect()
    }

    /// Asserts that A delivered every message B sent exactly once, in order.
    pub fn assert_exactly_once_in_order(&self) {
        let expected: Vec<u64> = (0..self.sent).collect();
        assert_eq!(self.delivered, expected, "lost, duplicated or reordered");
    }

    /// Stops both nodes and the relay, and removes the data.
    pub async fn stop(mut self) {
        for node in [self.a.take(), self.b.take()].into_iter().flatten() {
            node.quit().await;
        }
        self.kill_relay().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
