//! `tether-scale`: one node with many substrate peers, measured from the outside.
//!
//! The hub is a real `tether node` process (SQLite store, 127.0.0.1); its memory is read from
//! `/proc`. The peers are `--peers N` nodes in this process (each its own iroh endpoint and
//! substrate with an in-memory store), each opening a queue to the hub. Reported:
//!
//! 1. the hub's resident memory with N peers linked and idle, per peer;
//! 2. all N sending `--messages` each at once: messages/s acknowledged, the hub's peak memory;
//! 3. the hub killed with SIGKILL and restarted on its address and data: the time until every
//!    peer has a message acknowledged by the new process;
//! 4. fan-in: 64 senders against one sender, each sending `--fan-in-messages`, msg/s.
//!
//! ```sh
//! cargo build --release -p tether-cli -p tether-benches
//! target/release/tether-scale --peers 1000
//! ```

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tether::iroh::EndpointAddr;
use tether::node::Node;
use tether::substrate::{AllowAll, Authorizer, Peer, Queue, Substrate};
use tether_benches::arg;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Every wait has this deadline (a hang guard).
const DEADLINE: Duration = Duration::from_secs(600);

struct Args {
    peers: usize,
    messages: usize,
    fan_in_messages: usize,
}

fn args() -> Args {
    let args: Vec<String> = std::env::args().skip(1).collect();
    Args {
        peers: arg(&args, "--peers", 1000),
        messages: arg(&args, "--messages", 10),
        fan_in_messages: arg(&args, "--fan-in-messages", 2000),
    }
}

/// The hub: `tether node` as a child process, and its ticket.
struct Hub {
    child: Child,
    ticket: String,
}

async fn start_hub(tether: &Path, data: &Path, port: u16) -> Hub {
    let mut child = Command::new(tether)
        .args(["node", "--json", "--data"])
        .arg(data)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("tether node starts (build it: cargo build --release -p tether-cli)");
    let stdout = child.stdout.take().expect("piped");
    let mut lines = BufReader::new(stdout).lines();
    let ticket = loop {
        let line = tokio::time::timeout(DEADLINE, lines.next_line())
            .await
            .expect("the hub starts")
            .expect("its stdout")
            .expect("a ready line");
        let value: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        if value["event"] == "ready" {
            break value["ticket"].as_str().unwrap_or_default().to_owned();
        }
    };
    // Drain its events (one per delivered message) so that it never blocks on stdout.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Hub { child, ticket }
}

/// A process's resident memory now and at its peak, in MB.
fn memory(pid: u32) -> (f64, f64) {
    tether_benches::memory(&pid.to_string())
}

/// One peer: its node, substrate and queue to the hub.
struct Member {
    _node: Node,
    _substrate: Substrate,
    _peer: Peer,
    queue: Queue,
}

async fn member(hub: &EndpointAddr, index: usize) -> Member {
    let node = Node::builder().substrate().bind().await.expect("bind");
    let substrate = node
        .substrate_builder()
        .expect("substrate")
        .authorize(Authorizer::new(AllowAll))
        .start()
        .expect("start");
    let hub_id = node.add_substrate_peer(hub.clone()).expect("allowed");
    let peer = substrate.peer(&hub_id);
    let queue = peer
        .open_queue(&format!("s{index}"))
        .await
        .expect("the hub accepts");
    Member {
        _node: node,
        _substrate: substrate,
        _peer: peer,
        queue,
    }
}

/// Each of `members` sends `each` messages; every send awaited. Returns msg/s.
async fn send_all(members: &[Member], each: usize) -> f64 {
    let started = Instant::now();
    let mut pending = Vec::new();
    for (i, member) in members.iter().enumerate() {
        for n in 0..each {
            pending.push(member.queue.send(format!("m{i}:{n}").into_bytes()));
        }
    }
    let total = pending.len();
    for send in pending {
        tokio::time::timeout(DEADLINE, send)
            .await
            .expect("acknowledged in time")
            .expect("acknowledged");
    }
    total as f64 / started.elapsed().as_secs_f64()
}

#[tokio::main]
async fn main() {
    let args = args();
    let exe = std::env::current_exe().expect("this program");
    let tether: PathBuf = exe.with_file_name("tether");
    let dir = std::env::temp_dir().join(format!("tether-scale-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let port = {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("probe");
        socket.local_addr().expect("addr").port()
    };
    let hub = start_hub(&tether, &dir.join("hub"), port).await;
    let hub_addr = tether_cli_ticket(&hub.ticket);
    let pid = hub.child.id().expect("running");
    let (baseline, _) = memory(pid);

    // 1. N peers linked, idle.
    let started = Instant::now();
    let mut members = Vec::with_capacity(args.peers);
    for chunk in (0..args.peers).collect::<Vec<_>>().chunks(64) {
        let joined = futures::future::join_all(chunk.iter().map(|&i| member(&hub_addr, i))).await;
        members.extend(joined);
    }
    let linked_s = started.elapsed().as_secs_f64();
    send_all(&members, 1).await;
    let (idle, _) = memory(pid);
    println!(
        "{} peers linked in {linked_s:.1} s; hub RSS {baseline:.1} MB alone, {idle:.1} MB with them idle: {:.1} KB per idle peer",
        args.peers,
        (idle - baseline) * 1024.0 / args.peers as f64
    );

    // 2. All of them sending.
    let rate = send_all(&members, args.messages).await;
    let (busy, peak) = memory(pid);
    println!(
        "all {} sending {} each: {rate:.0} msg/s acknowledged; hub RSS {busy:.1} MB, peak {peak:.1} MB ({:.1} KB per live peer)",
        args.peers,
        args.messages,
        (peak - baseline) * 1024.0 / args.peers as f64
    );

    // 3. The hub killed and restarted: until every peer is acknowledged again.
    let mut hub = hub;
    hub.child.kill().await.expect("SIGKILL the hub");
    let restarted = Instant::now();
    let hub = start_hub(&tether, &dir.join("hub"), port).await;
    let up_s = restarted.elapsed().as_secs_f64();
    send_all(&members, 1).await;
    println!(
        "hub restarted (SIGKILL; up again in {up_s:.1} s): all {} peers acknowledged by the new process {:.1} s after the kill",
        args.peers,
        restarted.elapsed().as_secs_f64()
    );

    // 4. Fan-in: 64 senders against one.
    let fan = members.len().min(64);
    let one = send_all(&members[..1], args.fan_in_messages).await;
    let many = send_all(&members[..fan], args.fan_in_messages / fan.max(1)).await;
    println!(
        "fan-in: 1 sender {one:.0} msg/s; {fan} senders {many:.0} msg/s ({:.2}x)",
        many / one.max(1e-9)
    );
    drop(members);
    drop(hub);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The hub's address from the iroh endpoint ticket `tether node` prints.
fn tether_cli_ticket(ticket: &str) -> EndpointAddr {
    let ticket: iroh_tickets::endpoint::EndpointTicket =
        ticket.parse().expect("an iroh endpoint ticket");
    ticket.endpoint_addr().clone()
}
