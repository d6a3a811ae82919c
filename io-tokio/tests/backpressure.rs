//! Backpressure over real TCP on 127.0.0.1: a consumer that stalls holds at most its receive
//! window, a producer far ahead of it is made to wait (never refused, never dropped), and
//! every message arrives exactly once, in order; an answer larger than the reply bound ends its
//! request with a typed error.

use std::sync::Arc;

use tether::substrate::{
    AllowAll, Auth, Authorizer, CommandError, Config, Error, Inbound, PeerId, Substrate,
    TcpTransport,
};
use tokio::sync::{mpsc, Mutex};

const WINDOW: u64 = 16;
const OUTBOX: usize = 64;
/// Far more than the outbox holds, within what may wait for room behind it
/// (`SUBSTRATE_WAITING_SENDS_MAX`).
const MESSAGES: u32 = 1_000;

fn config() -> Config {
    Config {
        receive_window: WINDOW,
        outbox_ops_max: OUTBOX,
        ..Config::default()
    }
}

async fn node(name: &str) -> (TcpTransport, std::net::SocketAddr) {
    let transport = TcpTransport::bind(PeerId::new(name), "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind");
    let addr = transport.local_addr();
    (transport, addr)
}

fn start(name: &str, transport: TcpTransport) -> Substrate {
    Substrate::builder(PeerId::new(name), transport)
        .auth(Auth::SharedKey(b"test key".to_vec()))
        .authorize(Authorizer::new(AllowAll))
        .config(config())
        .start()
        .expect("start")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_consumer_holds_at_most_its_window_and_the_producer_waits() {
    let (bob_transport, bob_addr) = node("bob").await;
    let bob = start("bob", bob_transport);
    let (alice_transport, _) = node("alice").await;
    alice_transport.add_peer(PeerId::new("bob"), bob_addr);
    let alice = start("alice", alice_transport);

    // Bob's app takes deliveries but processes them only in bursts of a full window: it is
    // stalled until the window is full, so the stall always outlasts the window.
    let mut inbound = bob.inbound().expect("inbound");
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let most_held = Arc::new(Mutex::new(0usize));
    let held_max = most_held.clone();
    let app = tokio::spawn(async move {
        let mut holding = Vec::new();
        let mut received = Vec::new();
        while received.len() < MESSAGES as usize {
            match inbound.recv().await.expect("bob runs") {
                Inbound::Open(open) => open.accept().await.expect("accept"),
                Inbound::Message(message) => {
                    received.push(u32::from_be_bytes(message.body[..4].try_into().expect("4")));
                    holding.push(message);
                    let mut most = held_max.lock().await;
                    *most = (*most).max(holding.len());
                    let full = holding.len() as u64 == WINDOW;
                    if full || received.len() == MESSAGES as usize {
                        holding.drain(..).for_each(|message| message.done());
                    }
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        let _ = done_tx.send(received);
    });

    let queue = alice
        .peer(&PeerId::new("bob"))
        .open_queue("jobs")
        .await
        .expect("open");
    // Every send is issued at once: far more than the outbox holds.
    let sends: Vec<_> = (0..MESSAGES)
        .map(|n| queue.send(n.to_be_bytes().to_vec()))
        .collect();
    // Behind them, a send that may not wait is refused at once: the outbox is full.
    let refused = queue.try_send(b"impatient".to_vec()).await;
    assert_eq!(refused, Err(Error::Command(CommandError::QueueFull)));
    for send in sends {
        send.await
            .expect("a waiting send is never refused or dropped");
    }
    let received = done_rx.recv().await.expect("the app finished");
    assert_eq!(
        received,
        (0..MESSAGES).collect::<Vec<_>>(),
        "exactly once, in order"
    );
    assert_eq!(
        *most_held.lock().await,
        WINDOW as usize,
        "the stalled consumer held a full window and never more"
    );
    app.await.expect("app");
    alice.shutdown().await;
    bob.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_past_the_reply_bound_ends_the_request_with_a_typed_error() {
    use tether_core::limits::SUBSTRATE_REPLY_BYTES_MAX;
    let (bob_transport, bob_addr) = node("bob").await;
    let bob = start("bob", bob_transport);
    let (alice_transport, _) = node("alice").await;
    alice_transport.add_peer(PeerId::new("bob"), bob_addr);
    let alice = start("alice", alice_transport);
    let mut inbound = bob.inbound().expect("inbound");
    let app = tokio::spawn(async move {
        loop {
            match inbound.recv().await.expect("bob runs") {
                Inbound::Open(open) => open.accept().await.expect("accept"),
                Inbound::Request(request) => {
                    // One part more than the bound holds, then the end.
                    let part = vec![7u8; 64 * 1024];
                    for _ in 0..=SUBSTRATE_REPLY_BYTES_MAX / part.len() {
                        request.respond(part.clone()).await.expect("respond");
                    }
                    request.end(Vec::new()).await.expect("end");
                    return;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    });
    let session = alice
        .peer(&PeerId::new("bob"))
        .open_session("rpc")
        .await
        .expect("open");
    let reply = session.req(b"everything".to_vec()).await;
    assert_eq!(reply, Err(Error::ReplyTooLarge(SUBSTRATE_REPLY_BYTES_MAX)));
    app.await.expect("app");
    alice.shutdown().await;
    bob.shutdown().await;
}
