//! Backpressure over real TCP on 127.0.0.1: a consumer that stalls holds at most its receive
//! window, a producer far ahead of it is made to wait (never refused, never dropped), and
//! every message arrives exactly once, in order, while the app's commands stay within their lane;
//! a long answer is read as a stream with its unread parts bounded, and an answer larger than
//! the reply bound ends a gathering request with a typed error.

use std::sync::Arc;

use tether::substrate::{
    AllowAll, Auth, Authorizer, CommandError, Config, Error, Inbound, PeerId, Substrate,
    TcpTransport,
};
use tether_core::limits::SUBSTRATE_COMMANDS_MAX;
use tokio::sync::{mpsc, Mutex};

const WINDOW: u64 = 16;
const OUTBOX: usize = 64;
/// Far more than the outbox, the waiting sends (`SUBSTRATE_WAITING_SENDS_MAX`) and the
/// command lane (`SUBSTRATE_COMMANDS_MAX`) hold together: the rest wait in their futures.
const MESSAGES: u32 = 3_000;

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
        loop {
            match inbound.recv().await.expect("bob runs") {
                Inbound::Open(open) => open.accept().await.expect("accept"),
                // The close was issued right behind the sends: it comes after all of them.
                Inbound::Closed { .. } => break,
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
    let backlog = alice.peer(&PeerId::new("bob")).backlog();
    assert!(backlog.queued <= SUBSTRATE_COMMANDS_MAX, "{backlog:?}");
    assert!(
        backlog.queued + backlog.waiting <= MESSAGES as usize,
        "{backlog:?}"
    );
    // Behind them, a send that may not wait is refused once the task reaches it: the outbox
    // is full.
    let refused = queue.try_send(b"impatient".to_vec());
    // And a close issued now waits behind every send before it.
    let closed = queue.close("done");
    for (n, send) in sends.into_iter().enumerate() {
        if let Err(error) = send.await {
            panic!("send #{n}: a waiting send is never refused or dropped: {error}");
        }
        if n % 250 == 0 {
            let backlog = alice.peer(&PeerId::new("bob")).backlog();
            assert!(backlog.queued <= SUBSTRATE_COMMANDS_MAX, "{backlog:?}");
        }
    }
    assert_eq!(refused.await, Err(Error::Command(CommandError::QueueFull)));
    closed.await.expect("closed after the sends");
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

/// Bob's app: accepts opens and answers the request `big` with `parts` parts of 64 KiB, each
/// after `pace` lets it go on (when given), then `end`; any other request it ends with its body.
fn answering(
    bob: &Substrate,
    parts: usize,
    mut pace: Option<mpsc::UnboundedReceiver<()>>,
) -> tokio::task::JoinHandle<()> {
    let mut inbound = bob.inbound().expect("inbound");
    tokio::spawn(async move {
        while let Some(item) = inbound.recv().await {
            match item {
                Inbound::Open(open) => open.accept().await.expect("accept"),
                Inbound::Request(request) if &request.body[..] == b"big" => {
                    for n in 0..parts {
                        if let Some(pace) = pace.as_mut() {
                            pace.recv().await.expect("the reader paces");
                        }
                        let part = vec![n as u8; 64 * 1024];
                        request.respond(part).await.expect("respond");
                    }
                    request.end(b"the end".to_vec()).await.expect("end");
                }
                Inbound::Request(request) => {
                    let body = request.body.clone();
                    request.end(body).await.expect("end");
                    return;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_longer_than_the_reply_bound_is_read_part_by_part() {
    use tether::substrate::ReplyPart;
    use tether_core::limits::SUBSTRATE_REPLY_BYTES_MAX;
    let (bob_transport, bob_addr) = node("bob").await;
    let bob = start("bob", bob_transport);
    let (alice_transport, _) = node("alice").await;
    alice_transport.add_peer(PeerId::new("bob"), bob_addr);
    let alice = start("alice", alice_transport);
    // Past what a gathered reply may hold: only a reader that keeps up can take it all.
    let parts = SUBSTRATE_REPLY_BYTES_MAX / (64 * 1024) + 44;
    let (pace, paced) = mpsc::unbounded_channel();
    let app = answering(&bob, parts, Some(paced));
    let session = alice
        .peer(&PeerId::new("bob"))
        .open_session("rpc")
        .await
        .expect("open");
    let mut answer = session.request(b"big".to_vec());
    let mut read = 0usize;
    pace.send(()).expect("bob waits");
    loop {
        match answer.next().await.expect("a part before the end") {
            Ok(ReplyPart::Res(body)) => {
                assert_eq!(body.len(), 64 * 1024);
                assert_eq!(body[0], read as u8, "parts in order");
                read += 1;
                let _ = pace.send(());
            }
            Ok(ReplyPart::End(end)) => {
                assert_eq!(end.as_deref(), Some(&b"the end"[..]));
                break;
            }
            Err(error) => panic!("a reader that keeps up is never cut off: {error}"),
        }
    }
    assert_eq!(read, parts);
    assert!(read * 64 * 1024 > SUBSTRATE_REPLY_BYTES_MAX);
    assert!(answer.next().await.is_none(), "nothing after the end");
    assert_eq!(
        session.req(b"last".to_vec()).await,
        Ok(tether::substrate::Reply {
            res: Vec::new(),
            end: Some(b"last".to_vec().into()),
        })
    );
    app.await.expect("app");
    alice.shutdown().await;
    bob.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_falls_a_reply_bound_behind_is_cut_off_with_a_typed_error() {
    use tether::substrate::ReplyPart;
    use tether_core::limits::SUBSTRATE_REPLY_BYTES_MAX;
    let (bob_transport, bob_addr) = node("bob").await;
    let bob = start("bob", bob_transport);
    let (alice_transport, _) = node("alice").await;
    alice_transport.add_peer(PeerId::new("bob"), bob_addr);
    let alice = start("alice", alice_transport);
    let parts = SUBSTRATE_REPLY_BYTES_MAX / (64 * 1024) + 8;
    let app = answering(&bob, parts, None);
    let session = alice
        .peer(&PeerId::new("bob"))
        .open_session("rpc")
        .await
        .expect("open");
    let mut answer = session.request(b"big".to_vec());
    assert!(matches!(answer.next().await, Some(Ok(ReplyPart::Res(_)))));
    // The reader stops. A later request on the same session is answered after every part of
    // the first (one direction of a session is FIFO): when it returns, all of them arrived.
    let later = session.req(b"later".to_vec()).await.expect("answered");
    assert_eq!(later.end.as_deref(), Some(&b"later"[..]));
    let mut read = 1usize;
    let outcome = loop {
        match answer.next().await.expect("ends with an error") {
            Ok(ReplyPart::Res(_)) => read += 1,
            Ok(ReplyPart::End(_)) => panic!("a reader past the bound never sees the end"),
            Err(error) => break error,
        }
    };
    assert_eq!(outcome, Error::ReplyTooLarge(SUBSTRATE_REPLY_BYTES_MAX));
    assert!(
        read < parts,
        "the parts past the bound were dropped, not held"
    );
    assert!(answer.next().await.is_none());
    app.await.expect("app");
    alice.shutdown().await;
    bob.shutdown().await;
}
