//! Two shells over real TCP on 127.0.0.1: 10,000 messages across a forced disconnect and a
//! restart of the receiver from its SQLite file, each delivered exactly once and in order per
//! object.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tether::store::{LogStore, SqliteStore, Store};
use tether::substrate::{AllowAll, Auth, Authorizer, Inbound, PeerId, Substrate, TcpTransport};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

const OBJECTS: usize = 4;
const MESSAGES: usize = 10_000;
const WAVE: usize = 250;

/// A TCP proxy whose connections the test can cut, and whose target can move.
struct Proxy {
    addr: SocketAddr,
    target: watch::Sender<SocketAddr>,
    cut: watch::Sender<u64>,
    connections: Arc<std::sync::atomic::AtomicUsize>,
    _task: JoinHandle<()>,
}

impl Proxy {
    async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("addr");
        let (target_tx, target_rx) = watch::channel(target);
        let (cut_tx, cut_rx) = watch::channel(0u64);
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = connections.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let target = *target_rx.borrow();
                let mut cut = cut_rx.clone();
                cut.mark_unchanged();
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Self {
            addr,
            target: target_tx,
            cut: cut_tx,
            connections,
            _task: task,
        }
    }

    /// Drops every connection through the proxy now.
    fn cut(&self) {
        self.cut.send_modify(|n| *n += 1);
    }
}

fn temp_db(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tether-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join("receiver.db")
}

/// What the receiver's app recorded, and a count to wait on.
#[derive(Clone)]
struct Received {
    by_object: Arc<Mutex<BTreeMap<String, Vec<u32>>>>,
    count: Arc<watch::Sender<usize>>,
}

/// Opens the receiver's store at a path.
type OpenStore = fn(&PathBuf) -> Arc<dyn Store>;

fn sqlite(db: &PathBuf) -> Arc<dyn Store> {
    Arc::new(SqliteStore::open(db).expect("open db"))
}

fn log(db: &PathBuf) -> Arc<dyn Store> {
    Arc::new(LogStore::open(db).expect("open log"))
}

/// Starts the receiver from `db`; its app records each message then marks it done.
async fn start_receiver(
    db: &PathBuf,
    open: OpenStore,
    received: Received,
) -> (Substrate, JoinHandle<()>, SocketAddr) {
    let transport = TcpTransport::bind(PeerId::new("bob"), "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind");
    let addr = transport.local_addr();
    let substrate = Substrate::builder(PeerId::new("bob"), transport)
        .auth(Auth::SharedKey(b"test key".to_vec()))
        .authorize(Authorizer::new(AllowAll))
        .store(open(db))
        .start()
        .expect("start");
    let mut inbound = substrate.inbound().expect("inbound");
    let app = tokio::spawn(async move {
        while let Some(item) = inbound.recv().await {
            match item {
                Inbound::Open(open) => open.accept().await.expect("accept"),
                Inbound::Message(message) => {
                    let n = u32::from_be_bytes(message.body[..4].try_into().expect("4 bytes"));
                    received
                        .by_object
                        .lock()
                        .expect("lock")
                        .entry(message.obj.to_string())
                        .or_default()
                        .push(n);
                    message.done();
                    received.count.send_modify(|count| *count += 1);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    });
    (substrate, app, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_messages_exactly_once_across_disconnect_and_restart() {
    exactly_once_across_disconnect_and_restart("tcp-eo", sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_messages_exactly_once_across_disconnect_and_restart_on_the_log_store() {
    exactly_once_across_disconnect_and_restart("tcp-eo-log", log).await;
}

/// 10,000 messages over `OBJECTS` queues; the link is cut mid-wave and the receiver restarted from
/// its store (opened by `open`): every message arrives once, in order.
async fn exactly_once_across_disconnect_and_restart(name: &str, open: OpenStore) {
    let db = temp_db(name);
    let received = Received {
        by_object: Arc::default(),
        count: Arc::new(watch::channel(0).0),
    };
    let (mut receiver, mut app, bob_addr) = start_receiver(&db, open, received.clone()).await;
    let proxy = Proxy::start(bob_addr).await;

    let transport = TcpTransport::bind(PeerId::new("alice"), "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind");
    transport.add_peer(PeerId::new("bob"), proxy.addr);
    let sender = Substrate::builder(PeerId::new("alice"), transport)
        .auth(Auth::SharedKey(b"test key".to_vec()))
        .authorize(Authorizer::new(AllowAll))
        .start()
        .expect("start");
    let bob = sender.peer(&PeerId::new("bob"));
    let mut queues = Vec::new();
    for i in 0..OBJECTS {
        queues.push(bob.open_queue(&format!("q/{i}")).await.expect("open"));
    }

    let per_object = MESSAGES / OBJECTS;
    for wave_start in (0..per_object).step_by(WAVE) {
        let mut pending = Vec::new();
        for n in wave_start..(wave_start + WAVE).min(per_object) {
            for queue in &queues {
                pending.push(queue.send((n as u32).to_be_bytes().to_vec()));
            }
        }
        // Faults strike while the wave's sends are in flight.
        if wave_start == 3 * WAVE {
            proxy.cut();
        }
        if wave_start == 7 * WAVE {
            // Restart the receiver from its store's file, on a new port.
            // The old one lets go of its store first: one store per path at a time.
            app.abort();
            let _ = app.await;
            receiver.shutdown().await;
            drop(receiver);
            let (next, next_app, addr) = start_receiver(&db, open, received.clone()).await;
            (receiver, app) = (next, next_app);
            proxy.target.send_replace(addr);
            proxy.cut();
        }
        for ack in pending {
            ack.await.expect("acked: durable at the receiver");
        }
    }

    // Every message is acked, so durable at the receiver; wait until its app has seen all.
    received
        .count
        .subscribe()
        .wait_for(|count| *count >= MESSAGES)
        .await
        .expect("the count lives");
    // The initial link, the one after the cut and the one to the restarted receiver.
    assert!(proxy.connections.load(std::sync::atomic::Ordering::SeqCst) >= 3);
    let received = received.by_object.lock().expect("lock").clone();
    assert_eq!(received.len(), OBJECTS);
    for (obj, numbers) in &received {
        let expected: Vec<u32> = (0..per_object as u32).collect();
        assert_eq!(numbers, &expected, "{obj}: exactly once, in order");
    }
    sender.shutdown().await;
    receiver.shutdown().await;
    app.abort();
    let _ = std::fs::remove_dir_all(db.parent().expect("dir"));
}

/// A receiver whose app forwards every message's number, consuming it only if `consume`.
async fn start_bob(
    db: &PathBuf,
    consume: bool,
) -> (
    Substrate,
    TcpTransport,
    tokio::sync::mpsc::UnboundedReceiver<u32>,
) {
    let transport = TcpTransport::bind(PeerId::new("bob"), "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind");
    let substrate = Substrate::builder(PeerId::new("bob"), transport.clone())
        .auth(Auth::SharedKey(b"test key".to_vec()))
        .authorize(Authorizer::new(AllowAll))
        .store(Arc::new(SqliteStore::open(db).expect("open db")))
        .start()
        .expect("start");
    let mut inbound = substrate.inbound().expect("inbound");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(item) = inbound.recv().await {
            match item {
                Inbound::Open(open) => open.accept().await.expect("accept"),
                Inbound::Message(message) => {
                    let n = u32::from_be_bytes(message.body[..4].try_into().expect("4 bytes"));
                    let _ = tx.send(n);
                    if consume {
                        message.done();
                    }
                }
                _ => {}
            }
        }
    });
    (substrate, transport, rx)
}

/// A receiver restarted from its store runs a task for every peer it holds state with before
/// its app says how to reach them. Naming the peer once its address is known
/// (`Substrate::peer`) makes that task dial. Here the sender cannot dial (its way to the
/// receiver leads nowhere), so its next message reaches the new receiver only over the
/// receiver's own dial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_receiver_dials_a_peer_it_learns_the_address_of_after_loading_it() {
    let db = temp_db("tcp-redial");
    let (bob, bob_transport, mut seen) = start_bob(&db, false).await;
    let proxy = Proxy::start(bob_transport.local_addr()).await;
    let transport = TcpTransport::bind(PeerId::new("alice"), "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind");
    let alice_addr = transport.local_addr();
    transport.add_peer(PeerId::new("bob"), proxy.addr);
    let sender = Substrate::builder(PeerId::new("alice"), transport)
        .auth(Auth::SharedKey(b"test key".to_vec()))
        .authorize(Authorizer::new(AllowAll))
        .start()
        .expect("start");
    let queue = sender
        .peer(&PeerId::new("bob"))
        .open_queue("q")
        .await
        .expect("open");
    // Durable at bob, seen by its app, not consumed: bob's next life delivers it again.
    queue
        .send(1u32.to_be_bytes().to_vec())
        .await
        .expect("acked");
    assert_eq!(seen.recv().await, Some(1));

    // Bob goes (and lets go of its store); alice's only way to it now leads nowhere.
    bob.shutdown().await;
    drop(bob);
    let nowhere = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    proxy
        .target
        .send_replace(nowhere.local_addr().expect("addr"));
    drop(nowhere);
    proxy.cut();

    // Bob's next life: its task for alice is running (it redelivered 1) before bob learns
    // where alice listens.
    let (bob, bob_transport, mut seen) = start_bob(&db, true).await;
    assert_eq!(seen.recv().await, Some(1), "redelivered from the store");
    bob_transport.add_peer(PeerId::new("alice"), alice_addr);
    let _alice = bob.peer(&PeerId::new("alice"));
    queue
        .send(2u32.to_be_bytes().to_vec())
        .await
        .expect("acked over bob's dial");
    assert_eq!(seen.recv().await, Some(2));
    sender.shutdown().await;
    bob.shutdown().await;
    let _ = std::fs::remove_dir_all(db.parent().expect("dir"));
}
