//! `tether demo --nodes N` (N ≥ 3): N real `tether node` processes on 127.0.0.1, each with its
//! durable store, each sending over a queue to each of its next few nodes (a ring of
//! [`FANOUT`] successors). Meanwhile nodes chosen at random are killed with SIGKILL and
//! restarted from their data directories (senders and receivers alike), and links are cut.
//! At the end the demo checks, queue by queue, what each receiving application saw against
//! what its sender acknowledged, prints a table per pair and the totals, and exits non-zero if
//! an invariant failed.
//!
//! The invariants, per queue: every message whose send was acknowledged is delivered; nothing
//! is delivered twice except the substrate's documented redelivery (the same seq, seen again by
//! a later life of a receiver that died before consuming it); first deliveries come in the
//! order sent. A message written to a sender that was then killed before it acknowledged it
//! may be lost (its process died with it): it is counted as `unconfirmed`, never as a failure.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::time::Instant;

use tokio::sync::mpsc;

use crate::demo::{
    io, local_relay, next, spawn, write, Delivery, DemoError, Options, Progress, Seen,
};
use crate::procs::{free_port, Event, NodeProc};

/// How many successors each node sends to (fewer when there are fewer other nodes).
pub(crate) const FANOUT: usize = 3;

/// One node: its process (none while it is being restarted), incarnation and setup state.
struct Member {
    name: &'static str,
    args: Vec<String>,
    life: u64,
    process: Option<NodeProc>,
    ticket: Option<String>,
    /// Its queues opened in this life (sends go to it only once all are).
    opened: usize,
}

/// One queue `q<from>-<to>`: what was written, acknowledged and delivered.
#[derive(Default)]
struct Lane {
    from: usize,
    to: usize,
    /// The next index to write.
    written: u64,
    /// Indices written to the sender's current life and not acknowledged yet.
    pending: BTreeSet<u64>,
    acked: BTreeSet<u64>,
    delivered: BTreeSet<u64>,
    seen: Seen,
    redelivered: u64,
    duplicates: u64,
    reordered: u64,
    sent_at: HashMap<u64, Instant>,
}

/// One pair's row of the table.
#[derive(Debug, serde::Serialize)]
pub(crate) struct LaneSummary {
    pub(crate) from: String,
    pub(crate) to: String,
    pub(crate) written: u64,
    pub(crate) acked: u64,
    pub(crate) delivered: u64,
    pub(crate) unconfirmed: u64,
    pub(crate) redelivered_after_restart: u64,
    pub(crate) duplicates: u64,
    pub(crate) reordered: u64,
    pub(crate) acked_but_lost: u64,
}

/// What the demo saw over all pairs, and the verdict.
#[derive(Debug, Default, serde::Serialize)]
pub(crate) struct ManySummary {
    pub(crate) nodes: usize,
    pub(crate) pairs: Vec<LaneSummary>,
    pub(crate) written: u64,
    pub(crate) acked: u64,
    pub(crate) delivered: u64,
    pub(crate) unconfirmed: u64,
    pub(crate) duplicates: u64,
    pub(crate) reordered: u64,
    pub(crate) acked_but_lost: u64,
    pub(crate) kills: u64,
    pub(crate) disconnects: u64,
    pub(crate) seconds: f64,
    pub(crate) throughput_msgs_per_s: f64,
    pub(crate) latency_p50_ms: f64,
    pub(crate) latency_p99_ms: f64,
    /// Resident memory of the node processes at the end (largest, and mean), in KiB.
    pub(crate) rss_kib_max: u64,
    pub(crate) rss_kib_mean: u64,
    pub(crate) failures: Vec<String>,
}

/// A small deterministic generator (which node dies when), seeded per run.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n.max(1)
    }
}

fn lane_name(from: usize, to: usize) -> String {
    format!("q{from}-{to}")
}

fn parse_lane(obj: &str) -> Option<(usize, usize)> {
    let (from, to) = obj.strip_prefix('q')?.split_once('-')?;
    Some((from.parse().ok()?, to.parse().ok()?))
}

/// `<obj>:<index>:` padded to `size`.
fn body(obj: &str, index: u64, size: usize) -> String {
    let mut body = format!("{obj}:{index}:");
    while body.len() < size {
        body.push('.');
    }
    body
}

fn parse_index(body: &str) -> Option<u64> {
    body.split(':').nth(1)?.parse().ok()
}

struct World {
    members: Vec<Member>,
    lanes: Vec<Lane>,
    /// Lane index by (from, to).
    lane_of: BTreeMap<(usize, usize), usize>,
    targets: Vec<Vec<usize>>,
    latencies: Vec<f64>,
    failures: Vec<String>,
}

impl World {
    /// The commands that (re)open node `i`'s queues: connect to each target, open its queue.
    /// A restarted node needs nothing for the nodes that send to it: its substrate dials
    /// every peer it has durable state for from its peer book, and that fresh link replaces
    /// the sender's link to the dead process (which would otherwise wait for QUIC's idle
    /// timeout: iroh's stateless-reset key does not survive a restart).
    fn setup(&self, i: usize) -> Option<String> {
        let mut commands = String::new();
        for &j in &self.targets[i] {
            let ticket = self.members[j].ticket.as_ref()?;
            commands.push_str(&format!(
                "connect {ticket}\nopen queue {}\n",
                lane_name(i, j)
            ));
        }
        Some(commands)
    }

    fn ready_to_send(&self, i: usize) -> bool {
        let member = &self.members[i];
        member.process.is_some() && member.opened >= self.targets[i].len()
    }

    fn account(&mut self, event: &Event) {
        let Some(i) = self.members.iter().position(|m| m.name == event.from) else {
            return;
        };
        let value = &event.value;
        let text = |key: &str| value[key].as_str().unwrap_or_default().to_owned();
        match value["event"].as_str().unwrap_or_default() {
            "opened" if event.life == self.members[i].life => self.members[i].opened += 1,
            "acked" => {
                let lane = parse_lane(&text("obj")).and_then(|key| self.lane_of.get(&key));
                if let (Some(&lane), Some(index)) = (lane, parse_index(&text("body"))) {
                    let lane = &mut self.lanes[lane];
                    lane.pending.remove(&index);
                    lane.acked.insert(index);
                }
            }
            "message" => {
                let obj = text("obj");
                let lane = parse_lane(&obj).and_then(|key| self.lane_of.get(&key).copied());
                let (Some(lane), Some(index)) = (lane, parse_index(&text("body"))) else {
                    self.failures.push(format!(
                        "{} delivered a body nobody sent: {value}",
                        event.from
                    ));
                    return;
                };
                let seq = value["seq"].as_u64().unwrap_or_default();
                let lane = &mut self.lanes[lane];
                let seen_before = lane.delivered.contains(&index);
                match lane.seen.classify(seq, index, event.life, seen_before) {
                    Delivery::Redelivered => lane.redelivered += 1,
                    Delivery::Duplicate => lane.duplicates += 1,
                    delivery @ (Delivery::First | Delivery::Reordered) => {
                        lane.reordered += u64::from(delivery == Delivery::Reordered);
                        lane.delivered.insert(index);
                        if let Some(at) = lane.sent_at.remove(&index) {
                            self.latencies.push(at.elapsed().as_secs_f64() * 1e3);
                        }
                    }
                }
            }
            "send_failed" | "error" => self.failures.push(format!(
                "{} (life {}) reported: {value}",
                event.from, event.life
            )),
            _ => {}
        }
    }

    /// Every lane wrote its share, nothing written to a live sender waits for its ack, and
    /// every acknowledged message was delivered.
    fn settled(&self, per_lane: u64) -> bool {
        self.lanes.iter().all(|lane| {
            lane.written >= per_lane
                && lane.pending.is_empty()
                && lane
                    .acked
                    .iter()
                    .all(|index| lane.delivered.contains(index))
        })
    }

    fn delivered(&self) -> u64 {
        self.lanes
            .iter()
            .map(|lane| lane.delivered.len() as u64)
            .sum()
    }
}

/// Runs the N-node demo in `dir`.
pub(crate) async fn drive(
    exe: &Path,
    dir: &Path,
    options: &Options,
) -> Result<ManySummary, DemoError> {
    let n = options.nodes;
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let fanout = FANOUT.min(n - 1);
    let mut world = World {
        members: Vec::new(),
        lanes: Vec::new(),
        lane_of: BTreeMap::new(),
        targets: (0..n)
            .map(|i| (1..=fanout).map(|d| (i + d) % n).collect())
            .collect(),
        latencies: Vec::new(),
        failures: Vec::new(),
    };
    for i in 0..n {
        for &j in &world.targets[i].clone() {
            world.lane_of.insert((i, j), world.lanes.len());
            world.lanes.push(Lane {
                from: i,
                to: j,
                ..Lane::default()
            });
        }
    }
    let (relay, homed) = local_relay(exe, options, &events_tx, &mut events).await?;
    for i in 0..n {
        let name: &'static str = Box::leak(format!("n{i}").into_boxed_str());
        let port = free_port().map_err(io("a probe socket"))?;
        let mut args = vec![
            "--store".into(),
            options.store.as_str().into(),
            "--data".into(),
            dir.join(name).display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
        ];
        args.extend(homed.iter().cloned());
        let process = spawn(exe, name, 1, &args, &events_tx)?;
        world.members.push(Member {
            name,
            args,
            life: 1,
            process: Some(process),
            ticket: None,
            opened: 0,
        });
    }
    while world.members.iter().any(|m| m.ticket.is_none()) {
        let event = next(&mut events, "every node to start").await?;
        if event.value["event"] == "ready" {
            if let Some(member) = world.members.iter_mut().find(|m| m.name == event.from) {
                member.ticket = event.value["ticket"].as_str().map(str::to_owned);
            }
        }
    }
    for i in 0..n {
        let commands = world.setup(i).expect("every ticket is known");
        let process = world.members[i].process.as_mut().expect("started");
        write(process, &commands).await?;
    }

    let per_lane = (options.messages / world.lanes.len() as u64).max(1);
    let total = per_lane * world.lanes.len() as u64;
    let kill_points: Vec<u64> = (1..=options.kills)
        .map(|k| total * k / (options.kills + 1))
        .collect();
    let disconnect_points = [total / 3, total * 2 / 3];
    let mut rng = Lcg(0x7e7e_0000 ^ u64::from(std::process::id()));
    let progress = Progress::new(total, options.quiet);
    let (mut kills, mut disconnects) = (0u64, 0u64);
    let started = Instant::now();
    const SLICE: u64 = 32;
    loop {
        // Each node ready to send writes the next slice of each of its lanes whose last slice
        // was acknowledged (so a kill takes at most a slice per lane with it, and kills land
        // while traffic flows).
        for i in 0..n {
            if !world.ready_to_send(i) {
                continue;
            }
            let mut commands = String::new();
            for &j in &world.targets[i] {
                let lane = &mut world.lanes[world.lane_of[&(i, j)]];
                if !lane.pending.is_empty() {
                    continue;
                }
                let end = (lane.written + SLICE).min(per_lane);
                for index in lane.written..end {
                    let obj = lane_name(lane.from, lane.to);
                    commands.push_str(&format!("send {obj} {}\n", body(&obj, index, options.size)));
                    lane.pending.insert(index);
                    lane.sent_at.insert(index, Instant::now());
                }
                lane.written = end;
            }
            if !commands.is_empty() {
                let process = world.members[i].process.as_mut().expect("ready");
                write(process, &commands).await?;
            }
        }
        // What has arrived; wait for more when nothing can be written.
        let mut any = false;
        while let Ok(event) = events.try_recv() {
            any = true;
            handle(&mut world, event).await?;
        }
        if !any {
            let event = next(&mut events, "deliveries and acks").await?;
            handle(&mut world, event).await?;
        }
        let delivered = world.delivered();
        progress.show(delivered);
        if kill_points
            .get(kills as usize)
            .is_some_and(|&at| delivered >= at)
        {
            // SIGKILL a node chosen at random (sender and receiver both): what was written
            // to it and not acknowledged may die with it.
            let victim = rng.below(n as u64) as usize;
            let member = &mut world.members[victim];
            if let Some(mut process) = member.process.take() {
                process.kill().await.map_err(io("kill a node"))?;
            }
            for lane in world.lanes.iter_mut().filter(|lane| lane.from == victim) {
                lane.pending.clear();
            }
            let member = &mut world.members[victim];
            member.life += 1;
            member.opened = 0;
            member.process = Some(spawn(
                exe,
                member.name,
                member.life,
                &member.args,
                &events_tx,
            )?);
            kills += 1;
            progress.note(&format!(
                "killed {} (SIGKILL) and restarted it from its data dir",
                member.name
            ));
        }
        if disconnect_points
            .get(disconnects as usize)
            .is_some_and(|&at| delivered >= at)
        {
            // A node whose queues are open (the first from a random one) cuts the link to its
            // current peer.
            let start = rng.below(n as u64) as usize;
            if let Some(i) = (0..n)
                .map(|d| (start + d) % n)
                .find(|&i| world.ready_to_send(i))
            {
                let process = world.members[i].process.as_mut().expect("ready");
                write(process, "disconnect\n").await?;
                progress.note(&format!("cut a link of {}", world.members[i].name));
                disconnects += 1;
            }
        }
        if world.settled(per_lane) && kills >= options.kills {
            break;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    progress.done();
    let rss_kib: Vec<u64> = world
        .members
        .iter()
        .filter_map(|member| member.process.as_ref()?.id())
        .filter_map(rss_kib)
        .collect();
    for member in &mut world.members {
        if let Some(process) = member.process.take() {
            process.quit().await;
        }
    }
    if let Some(mut relay) = relay {
        let _ = relay.kill().await;
    }
    let mut summary = verdict(world, n, kills, disconnects, seconds);
    summary.rss_kib_max = rss_kib.iter().copied().max().unwrap_or(0);
    summary.rss_kib_mean = rss_kib.iter().sum::<u64>() / (rss_kib.len() as u64).max(1);
    Ok(summary)
}

/// A process's resident set, in KiB (Linux; `None` elsewhere or once it is gone).
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Accounts one event; a restarted node that is ready gets its queues opened again.
async fn handle(world: &mut World, event: Event) -> Result<(), DemoError> {
    let i = world.members.iter().position(|m| m.name == event.from);
    if let Some(i) = i {
        if event.value["event"] == "ready" && event.life == world.members[i].life && event.life > 1
        {
            let commands = world.setup(i).expect("every ticket is known");
            if let Some(process) = world.members[i].process.as_mut() {
                write(process, &commands).await?;
            }
        }
    }
    world.account(&event);
    Ok(())
}

fn verdict(world: World, nodes: usize, kills: u64, disconnects: u64, seconds: f64) -> ManySummary {
    let World {
        members,
        lanes,
        mut latencies,
        failures,
        ..
    } = world;
    let mut summary = ManySummary {
        nodes,
        kills,
        disconnects,
        seconds,
        failures,
        ..ManySummary::default()
    };
    for lane in &lanes {
        let acked_but_lost = lane
            .acked
            .iter()
            .filter(|index| !lane.delivered.contains(index))
            .count() as u64;
        let unconfirmed = (0..lane.written)
            .filter(|index| !lane.acked.contains(index) && !lane.delivered.contains(index))
            .count() as u64;
        let row = LaneSummary {
            from: members[lane.from].name.to_owned(),
            to: members[lane.to].name.to_owned(),
            written: lane.written,
            acked: lane.acked.len() as u64,
            delivered: lane.delivered.len() as u64,
            unconfirmed,
            redelivered_after_restart: lane.redelivered,
            duplicates: lane.duplicates,
            reordered: lane.reordered,
            acked_but_lost,
        };
        summary.written += row.written;
        summary.acked += row.acked;
        summary.delivered += row.delivered;
        summary.unconfirmed += row.unconfirmed;
        summary.duplicates += row.duplicates;
        summary.reordered += row.reordered;
        summary.acked_but_lost += row.acked_but_lost;
        summary.pairs.push(row);
    }
    (summary.latency_p50_ms, summary.latency_p99_ms) = tether_core::stats::p50_p99(&mut latencies);
    summary.throughput_msgs_per_s = summary.delivered as f64 / seconds.max(1e-9);
    for (what, count) in [
        ("acknowledged and lost", summary.acked_but_lost),
        ("duplicated", summary.duplicates),
        ("reordered", summary.reordered),
    ] {
        if count > 0 {
            summary.failures.push(format!("{count} message(s) {what}"));
        }
    }
    summary
}

/// The table: one row per pair, then the totals and the verdict.
pub(crate) fn print_table(summary: &ManySummary) {
    println!(
        "{:<10} {:>8} {:>8} {:>9} {:>11} {:>11} {:>5} {:>6} {:>5}",
        "pair",
        "written",
        "acked",
        "delivered",
        "unconfirmed",
        "redelivered",
        "dup",
        "reord",
        "lost"
    );
    for row in &summary.pairs {
        println!(
            "{:<10} {:>8} {:>8} {:>9} {:>11} {:>11} {:>5} {:>6} {:>5}",
            format!("{}→{}", row.from, row.to),
            row.written,
            row.acked,
            row.delivered,
            row.unconfirmed,
            row.redelivered_after_restart,
            row.duplicates,
            row.reordered,
            row.acked_but_lost
        );
    }
    println!(
        "{:<10} {:>8} {:>8} {:>9} {:>11} {:>11} {:>5} {:>6} {:>5}",
        "total",
        summary.written,
        summary.acked,
        summary.delivered,
        summary.unconfirmed,
        summary
            .pairs
            .iter()
            .map(|row| row.redelivered_after_restart)
            .sum::<u64>(),
        summary.duplicates,
        summary.reordered,
        summary.acked_but_lost
    );
    println!(
        "{} nodes, {} pairs, {} kills (SIGKILL + restart), {} link cuts, {:.1} s, {:.0} msg/s, \
         latency p50 {:.1} ms p99 {:.1} ms, RSS per node {} KiB mean, {} KiB max",
        summary.nodes,
        summary.pairs.len(),
        summary.kills,
        summary.disconnects,
        summary.seconds,
        summary.throughput_msgs_per_s,
        summary.latency_p50_ms,
        summary.latency_p99_ms,
        summary.rss_kib_mean,
        summary.rss_kib_max
    );
    if summary.failures.is_empty() {
        println!("every invariant held: nothing acknowledged was lost, duplicated or reordered");
    } else {
        for failure in &summary.failures {
            println!("FAILED: {failure}");
        }
    }
}
