//! The substrate shell over TCP loopback (issue "Tokio shell"): durable exactly-once 1 KiB
//! messages/s, both sides on `SqliteStore` files (WAL, `synchronous=FULL`), for 1 and 100
//! objects and in-flight windows 1 and 32. A message counts when the sender holds its hop ack
//! (durable at the receiver) and the receiver's app has consumed it.
//!
//! Baseline in the same run: the same 1 KiB frames over a raw loopback TCP connection, each
//! answered by an 8-byte ack, with no durability at all.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_main, Criterion, Throughput};
use tether::store::SqliteStore;
use tether::substrate::{
    AllowAll, Auth, Authorizer, Config, Inbound, PeerId, Queue, Substrate, TcpTransport,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tokio::sync::Notify;

const MESSAGES: u64 = 500;

fn temp_db(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tether-shell-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(name);
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    path
}

struct Pair {
    queues: Vec<Queue>,
    consumed: Arc<AtomicU64>,
    progress: Arc<Notify>,
    _sender: Substrate,
    _receiver: Substrate,
}

async fn pair(window: usize, objects: usize) -> Pair {
    let config = Config {
        in_flight_max: window,
        ..Config::default()
    };
    let tag = format!("w{window}o{objects}");
    let receiver_transport = TcpTransport::bind(PeerId::new("rx"), "127.0.0.1:0".parse().unwrap())
        .await
        .expect("bind");
    let receiver_addr = receiver_transport.local_addr();
    let receiver = Substrate::builder(PeerId::new("rx"), receiver_transport)
        .auth(Auth::SharedKey(b"bench".to_vec()))
        .authorize(Authorizer::new(AllowAll))
        .store(Arc::new(
            SqliteStore::open(temp_db(&format!("rx-{tag}.db"))).expect("db"),
        ))
        .config(config.clone())
        .start()
        .expect("start");
    let consumed = Arc::new(AtomicU64::new(0));
    let progress = Arc::new(Notify::new());
    let mut inbound = receiver.inbound().expect("inbound");
    let (count, notify) = (consumed.clone(), progress.clone());
    tokio::spawn(async move {
        while let Some(item) = inbound.recv().await {
            match item {
                Inbound::Open(open) => open.accept().await.expect("accept"),
                Inbound::Message(message) => {
                    message.done();
                    count.fetch_add(1, Ordering::SeqCst);
                    notify.notify_one();
                }
                _ => {}
            }
        }
    });
    let sender_transport = TcpTransport::bind(PeerId::new("tx"), "127.0.0.1:0".parse().unwrap())
        .await
        .expect("bind");
    sender_transport.add_peer(PeerId::new("rx"), receiver_addr);
    let sender = Substrate::builder(PeerId::new("tx"), sender_transport)
        .auth(Auth::SharedKey(b"bench".to_vec()))
        .authorize(Authorizer::new(AllowAll))
        .store(Arc::new(
            SqliteStore::open(temp_db(&format!("tx-{tag}.db"))).expect("db"),
        ))
        .config(config)
        .start()
        .expect("start");
    let peer = sender.peer(&PeerId::new("rx"));
    let mut queues = Vec::new();
    for i in 0..objects {
        queues.push(peer.open_queue(&format!("q/{i}")).await.expect("open"));
    }
    Pair {
        queues,
        consumed,
        progress,
        _sender: sender,
        _receiver: receiver,
    }
}

/// Sends `MESSAGES` round-robin over the pair's queues; returns when all are acked and
/// consumed.
async fn exchange(pair: &Pair) {
    let target = pair.consumed.load(Ordering::SeqCst) + MESSAGES;
    let body = vec![7u8; 1024];
    let pending: Vec<_> = (0..MESSAGES as usize)
        .map(|i| pair.queues[i % pair.queues.len()].send(body.clone()))
        .collect();
    for ack in pending {
        ack.await.expect("acked");
    }
    while pair.consumed.load(Ordering::SeqCst) < target {
        pair.progress.notified().await;
    }
}

async fn raw_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let client = TcpStream::connect(addr).await.expect("connect");
    let (server, _) = listener.accept().await.expect("accept");
    client.set_nodelay(true).expect("nodelay");
    server.set_nodelay(true).expect("nodelay");
    (client, server)
}

async fn raw_exchange(client: &mut TcpStream, server: &mut TcpStream) {
    let frame = {
        let mut frame = (1024u32).to_be_bytes().to_vec();
        frame.extend_from_slice(&[7u8; 1024]);
        frame
    };
    let write = async {
        for _ in 0..MESSAGES {
            client.write_all(&frame).await.expect("write");
        }
        let mut acks = vec![0u8; 8 * MESSAGES as usize];
        client.read_exact(&mut acks).await.expect("acks");
    };
    let serve = async {
        let mut buf = vec![0u8; 4 + 1024];
        for n in 0..MESSAGES {
            server.read_exact(&mut buf).await.expect("frame");
            server.write_all(&n.to_be_bytes()).await.expect("ack");
        }
    };
    tokio::join!(write, serve);
}

fn shell(c: &mut Criterion) {
    let runtime = Runtime::new().expect("runtime");
    let mut group = c.benchmark_group("shell/tcp_loopback_1KiB");
    group.throughput(Throughput::Elements(MESSAGES));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    let (mut client, mut server) = runtime.block_on(raw_pair());
    group.bench_function("baseline_raw_tcp_acked", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                runtime.block_on(raw_exchange(&mut client, &mut server));
            }
            start.elapsed()
        });
    });
    for (window, objects) in [(1, 1), (32, 1), (1, 100), (32, 100)] {
        let pair = runtime.block_on(pair(window, objects));
        group.bench_function(format!("window_{window}/objects_{objects}"), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    runtime.block_on(exchange(&pair));
                }
                start.elapsed()
            });
        });
    }
    group.finish();
}

fn benches() {
    let mut criterion = Criterion::default().configure_from_args();
    shell(&mut criterion);
}

criterion_main!(benches);
