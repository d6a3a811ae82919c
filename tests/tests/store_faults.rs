//! Store faults over real TCP on 127.0.0.1: a store that fails to load refuses the peer and
//! recovers when the store does; a store that fails to commit acknowledges nothing until it
//! recovers; neither loses or duplicates a message.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tether::store::{MemoryStore, Store, StoreError};
use tether::substrate::{
    AllowAll, Auth, Authorizer, Inbound, PeerId, StoreOp, Substrate, TcpTransport,
};
use tether_core::substrate::{DurableState, PersistBatch};
use tokio::sync::{mpsc, Notify};

/// A memory store whose loads and commits fail while the test says so; every failure
/// notifies the test.
#[derive(Default)]
struct FlakyStore {
    inner: MemoryStore,
    fail_loads: AtomicBool,
    fail_commits: AtomicBool,
    failures: AtomicU64,
    failed: Notify,
}

impl FlakyStore {
    fn fail(&self) -> Result<(), StoreError> {
        self.failures.fetch_add(1, Ordering::SeqCst);
        self.failed.notify_one();
        Err(StoreError::Injected("the test broke the disk"))
    }

    /// Waits until `n` calls have failed in all.
    async fn failed_at_least(&self, n: u64) {
        while self.failures.load(Ordering::SeqCst) < n {
            self.failed.notified().await;
        }
    }
}

impl Store for FlakyStore {
    fn load(&self, peer: &PeerId) -> Result<DurableState, StoreError> {
        if self.fail_loads.load(Ordering::SeqCst) {
            self.fail()?;
        }
        self.inner.load(peer)
    }

    fn commit(&self, peer: &PeerId, batches: &[PersistBatch]) -> Result<(), StoreError> {
        if self.fail_commits.load(Ordering::SeqCst) {
            self.fail()?;
        }
        self.inner.commit(peer, batches)
    }

    fn peers(&self) -> Result<Vec<PeerId>, StoreError> {
        self.inner.peers()
    }
}

/// Bob on a flaky store, forwarding what his app receives.
async fn bob(
    store: Arc<FlakyStore>,
) -> (
    Substrate,
    std::net::SocketAddr,
    mpsc::UnboundedReceiver<Inbound>,
) {
    let transport = TcpTransport::bind(PeerId::new("bob"), "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind");
    let addr = transport.local_addr();
    let substrate = Substrate::builder(PeerId::new("bob"), transport)
        .auth(Auth::SharedKey(b"test key".to_vec()))
        .authorize(Authorizer::new(AllowAll))
        .store(store)
        .start()
        .expect("start");
    let inbound = substrate.inbound().expect("inbound");
    (substrate, addr, inbound)
}

async fn alice(bob_addr: std::net::SocketAddr) -> Substrate {
    let transport = TcpTransport::bind(PeerId::new("alice"), "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind");
    transport.add_peer(PeerId::new("bob"), bob_addr);
    Substrate::builder(PeerId::new("alice"), transport)
        .auth(Auth::SharedKey(b"test key".to_vec()))
        .authorize(Authorizer::new(AllowAll))
        .start()
        .expect("start")
}

/// The next item bob's app receives, accepting opens on the way; store reports are returned.
async fn next_message(inbound: &mut mpsc::UnboundedReceiver<Inbound>) -> Inbound {
    loop {
        match inbound.recv().await.expect("bob runs") {
            Inbound::Open(open) => open.accept().await.expect("accept"),
            other => return other,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_failure_refuses_the_peer_and_recovers() {
    let store = Arc::new(FlakyStore::default());
    store.fail_loads.store(true, Ordering::SeqCst);
    let (bob, addr, mut inbound) = bob(store.clone()).await;
    let alice = alice(addr).await;
    let peer = alice.peer(&PeerId::new("bob"));
    let opened = tokio::spawn(async move {
        let queue = peer
            .open_queue("jobs")
            .await
            .expect("open once bob's state loads");
        queue.send(b"one".to_vec()).await.expect("acked")
    });
    // Bob refuses alice's links while her state cannot load; alice redials with backoff.
    store.failed_at_least(3).await;
    match next_message(&mut inbound).await {
        Inbound::Store { op, error, .. } => {
            assert_eq!(op, StoreOp::Load);
            assert!(matches!(
                error.expect("a failure").error(),
                StoreError::Injected("the test broke the disk")
            ));
        }
        other => panic!("expected a store report, got {other:?}"),
    }
    assert!(
        !opened.is_finished(),
        "nothing is acknowledged while the peer is refused"
    );
    store.fail_loads.store(false, Ordering::SeqCst);
    match next_message(&mut inbound).await {
        Inbound::Store { op, error, .. } => assert_eq!((op, error), (StoreOp::Load, None)),
        other => panic!("expected the recovery, got {other:?}"),
    }
    match next_message(&mut inbound).await {
        Inbound::Message(message) => {
            assert_eq!(&message.body[..], b"one");
            message.done();
        }
        other => panic!("expected the message, got {other:?}"),
    }
    opened.await.expect("task");
    alice.shutdown().await;
    bob.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_failure_acknowledges_nothing_until_the_store_recovers() {
    let store = Arc::new(FlakyStore::default());
    let (bob, addr, mut inbound) = bob(store.clone()).await;
    let alice = alice(addr).await;
    let peer = alice.peer(&PeerId::new("bob"));
    let opening = tokio::spawn(async move { peer.open_queue("jobs").await });
    match inbound.recv().await.expect("bob runs") {
        Inbound::Open(open) => open.accept().await.expect("accept"),
        other => panic!("expected the open, got {other:?}"),
    }
    let queue = opening.await.expect("task").expect("open");
    store.fail_commits.store(true, Ordering::SeqCst);
    let sent = tokio::spawn(async move { queue.send(b"two".to_vec()).await });
    store.failed_at_least(3).await;
    match next_message(&mut inbound).await {
        Inbound::Store { op, error, .. } => {
            assert_eq!(op, StoreOp::Commit);
            assert!(error.is_some());
        }
        other => panic!("expected a store report, got {other:?}"),
    }
    assert!(!sent.is_finished(), "no hop ack before bob's commit");
    store.fail_commits.store(false, Ordering::SeqCst);
    let mut messages = Vec::new();
    while messages.is_empty() {
        match next_message(&mut inbound).await {
            Inbound::Message(message) => {
                messages.push(message.body.clone());
                message.done();
            }
            Inbound::Store { error: None, .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(messages, [bytes::Bytes::from_static(b"two")]);
    sent.await.expect("task").expect("acked once durable");
    alice.shutdown().await;
    bob.shutdown().await;
}
