//! `tether-hostile`: what a hostile peer costs a node, measured from the outside (issue "A
//! hostile peer or a broken disk cannot break tether"). Each figure is the node process's own
//! peak resident memory (`VmHWM`), with its resident memory before the attack beside it.
//!
//! - `flood --connections N`: a node that admits one friend; a child process (the attacker,
//!   so its memory is not the node's) makes `N` QUIC connections to it from unlisted keys, in
//!   waves of 256. Reports the node's refusals and memory.
//! - `stall --streams N`: a node that admits the attacker's key; the attacker (a child process)
//!   opens one actor connection and `N` streams on it, each carrying the head of an actor
//!   record that declares a 1 MiB payload and nothing of the payload. Reports the node's
//!   memory after a second (a decoder that reserved what a head declares would hold N MiB).
//! - `soak --requests N`: a switch and one host in this process over a Unix socket; `N`
//!   requests answered one by one by `--concurrency` callers. Reports the host's state after
//!   (requests held, handlers running) and memory at 10% and at the end: a host that kept
//!   anything per ended request grows with `N`.
//!
//! ```sh
//! cargo run --release -p tether-benches --bin tether-hostile -- flood --connections 10000
//! cargo run --release -p tether-benches --bin tether-hostile -- soak --requests 1000000
//! ```

use std::time::Instant;

use tether::iroh::endpoint::presets;
use tether::iroh::{Endpoint, EndpointAddr, EndpointId, RelayMode, SecretKey};
use tether::node::{node_id_of, Node, ACTOR_ALPN};
use tether::switch::host::Host;
use tether::switch::Switch;
use tether_benches::arg;

const UPPER: &str = "cap:in=media:text;out=media:upper";
const WAVE: usize = 256;

/// This process's resident memory now and at its peak, in MB.
fn memory() -> (f64, f64) {
    tether_benches::memory("self")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("flood") => flood(arg(&args, "--connections", 10_000)).await,
        Some("attack") => attack(&args[1], &args[2], arg(&args, "--connections", 10_000)).await,
        Some("stall") => stall(arg(&args, "--streams", 100)).await,
        Some("stall-attack") => {
            stall_attack(&args[1], &args[2], &args[3], arg(&args, "--streams", 100)).await
        }
        Some("soak") => {
            soak(
                arg(&args, "--requests", 1_000_000),
                arg(&args, "--concurrency", 64),
            )
            .await
        }
        _ => {
            eprintln!(
                "usage: tether-hostile flood [--connections N] | stall [--streams N] \
                 | soak [--requests N] [--concurrency C]"
            );
            std::process::exit(2);
        }
    }
}

async fn flood(connections: usize) {
    let friend = SecretKey::generate().public();
    let node = Node::builder()
        .allow([node_id_of(&friend)])
        .bind()
        .await
        .expect("bind");
    let (rss_before, _) = memory();
    let id = node.node_id().to_string();
    let port = node.listen_addr().expect("bound").port().to_string();
    let started = Instant::now();
    let status = tokio::process::Command::new(std::env::current_exe().expect("exe"))
        .args([
            "attack",
            &id,
            &port,
            "--connections",
            &connections.to_string(),
        ])
        .status()
        .await
        .expect("attacker ran");
    let elapsed = started.elapsed();
    let snapshot = node.snapshot();
    let (rss_after, peak) = memory();
    println!(
        "| flood | {connections} connections | {:.1} s | refused after handshake {} | refused before handshake {} | accepted {} | cached {} | RSS before {rss_before:.1} MB | RSS after {rss_after:.1} MB | peak {peak:.1} MB | attacker {status} |",
        elapsed.as_secs_f64(),
        snapshot.refused,
        snapshot.handshakes_refused,
        snapshot.accepted,
        snapshot.connections.len(),
    );
    node.close().await;
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).expect("hex");
    }
    out
}

fn target(id: &str, port: &str) -> EndpointAddr {
    EndpointAddr::new(EndpointId::from_bytes(&unhex(id)).expect("key")).with_ip_addr(
        std::net::SocketAddr::from(([127, 0, 0, 1], port.parse::<u16>().expect("port"))),
    )
}

async fn endpoint(secret: SecretKey) -> Endpoint {
    Endpoint::builder(presets::Minimal)
        .secret_key(secret)
        .relay_mode(RelayMode::Disabled)
        .bind_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("addr")
        .bind()
        .await
        .expect("bind")
}

async fn stall(streams: usize) {
    let secret = SecretKey::generate();
    let node = Node::builder()
        .allow([node_id_of(&secret.public())])
        .bind()
        .await
        .expect("bind");
    let (rss_before, _) = memory();
    let port = node.listen_addr().expect("bound").port().to_string();
    let mut child = tokio::process::Command::new(std::env::current_exe().expect("exe"))
        .args([
            "stall-attack",
            &node.node_id().to_string(),
            &port,
            &hex(&secret.to_bytes()),
            "--streams",
            &streams.to_string(),
        ])
        .spawn()
        .expect("attacker");
    // A benchmark, not a test: the attacker's heads are read within this.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let (rss_after, peak) = memory();
    let snapshot = node.snapshot();
    println!(
        "| stall | {streams} streams declaring 1 MiB each | accepted {} | RSS before {rss_before:.1} MB | RSS after {rss_after:.1} MB | peak {peak:.1} MB |",
        snapshot.accepted
    );
    let _ = child.kill().await;
    node.close().await;
}

async fn stall_attack(id: &str, port: &str, secret: &str, streams: usize) {
    let attacker = endpoint(SecretKey::from_bytes(&unhex(secret))).await;
    let conn = attacker
        .connect(target(id, port), ACTOR_ALPN)
        .await
        .expect("a listed key connects");
    let mut head = Vec::new();
    head.extend_from_slice(&[0u8; 32]);
    head.extend_from_slice(&4u32.to_be_bytes());
    head.extend_from_slice(b"Chat");
    head.extend_from_slice(&(1u32 << 20).to_be_bytes());
    let mut open = Vec::new();
    for _ in 0..streams {
        let Ok(mut stream) = conn.open_uni().await else {
            break;
        };
        let _ = stream.write_all(&head).await;
        open.push(stream);
    }
    // Hold every stream open, the payloads never sent, until killed.
    std::future::pending::<()>().await;
}

async fn attack(id: &str, port: &str, connections: usize) {
    let target = target(id, port);
    let attacker = endpoint(SecretKey::generate()).await;
    for wave in (0..connections).step_by(WAVE) {
        let attempts: Vec<_> = (wave..(wave + WAVE).min(connections))
            .map(|_| {
                let (attacker, target) = (attacker.clone(), target.clone());
                tokio::spawn(async move {
                    if let Ok(conn) = attacker.connect(target, ACTOR_ALPN).await {
                        let _ = conn.closed().await;
                    }
                })
            })
            .collect();
        for attempt in attempts {
            let _ = attempt.await;
        }
    }
    attacker.close().await;
}

async fn soak(requests: usize, concurrency: usize) {
    let host = Host::new("soak").handler(UPPER, |mut request| async move {
        let input = request.read_all().await;
        let _ = request
            .respond("output", "media:upper", [input.to_ascii_uppercase()])
            .await;
        let _ = request.end().await;
    });
    let handle = host.handle();
    let (a, b) = std::os::unix::net::UnixStream::pair().expect("pair");
    a.set_nonblocking(true).expect("nonblocking");
    b.set_nonblocking(true).expect("nonblocking");
    let (switch_side, host_side) = (
        tokio::net::UnixStream::from_std(a).expect("tokio"),
        tokio::net::UnixStream::from_std(b).expect("tokio"),
    );
    let serving = tokio::spawn(host.serve(host_side));
    let switch = Switch::builder().start();
    switch
        .add_master("soak", switch_side)
        .await
        .expect("attached");
    let (rss_before, _) = memory();
    let started = Instant::now();
    let tenth = requests / 10;
    let mut at_tenth = 0.0;
    let per_caller = requests / concurrency.max(1);
    let mut done = 0;
    while done < requests {
        let batch = (requests - done).min(tenth.max(1));
        let callers: Vec<_> = (0..concurrency.max(1))
            .map(|caller| {
                let switch = switch.clone();
                // The batch split over the callers, the first ones taking its remainder (a
                // count that is no multiple of the callers still ends).
                let count =
                    batch / concurrency.max(1) + usize::from(caller < batch % concurrency.max(1));
                tokio::spawn(async move {
                    for _ in 0..count {
                        let call = switch.request(UPPER).await.expect("routed");
                        call.send_stream("in", "media:text", [b"abc".to_vec()])
                            .await
                            .expect("sent");
                        call.finish().await.expect("finished");
                        let answer = call.collect().await.expect("answered");
                        assert_eq!(answer, b"ABC");
                    }
                    count
                })
            })
            .collect();
        for caller in callers {
            done += caller.await.expect("caller");
        }
        if at_tenth == 0.0 {
            at_tenth = memory().0;
        }
        if per_caller == 0 {
            break;
        }
    }
    let elapsed = started.elapsed();
    let state = handle.state().await.expect("serving");
    let (rss_after, peak) = memory();
    println!(
        "| soak | {done} requests | {:.1} s ({:.0} req/s) | held {} | handlers {} | ended {} | RSS before {rss_before:.1} MB | at 10% {at_tenth:.1} MB | after {rss_after:.1} MB | peak {peak:.1} MB |",
        elapsed.as_secs_f64(),
        done as f64 / elapsed.as_secs_f64(),
        state.machine_requests,
        state.handlers_running,
        state.stats.ended,
    );
    switch.close().await;
    let _ = serving.await;
}
