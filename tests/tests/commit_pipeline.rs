//! Pipelined commits over real TCP on 127.0.0.1: a peer's driver keeps one commit in flight
//! while the next group collects, and that changes nothing a sender can see. The receiver's
//! store holds its commits at a gate the test opens and closes, and every acknowledgement the
//! sender gets is checked, the moment it arrives, against what the receiver's store had
//! committed by then.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use tether::store::{MemoryStore, Store, StoreError};
use tether::substrate::{AllowAll, Auth, Authorizer, Inbound, PeerId, Substrate, TcpTransport};
use tether_core::substrate::{DurableState, PersistBatch, Record};
use tokio::sync::Notify;

/// A memory store whose commits wait at a gate while it is held, and which remembers the ids
/// of the remote's ops it has committed.
#[derive(Default)]
struct GatedStore {
    inner: MemoryStore,
    gate: Mutex<Gate>,
    opened: Condvar,
    /// A commit reached the gate.
    arrived: Notify,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

#[derive(Default)]
struct Gate {
    held: bool,
    /// Times the gate opened: a commit waits only for the first opening after it arrived.
    openings: u64,
    /// Commits that reached the gate (held or not).
    arrivals: u64,
    committed_ops: BTreeSet<String>,
}

impl GatedStore {
    fn hold(&self) -> u64 {
        let mut gate = self.gate.lock().expect("gate");
        gate.held = true;
        gate.arrivals
    }

    fn open(&self) {
        let mut gate = self.gate.lock().expect("gate");
        gate.held = false;
        gate.openings += 1;
        self.opened.notify_all();
    }

    /// Waits until a commit arrives at the gate after `seen` had.
    async fn arrival_after(&self, seen: u64) {
        loop {
            let notified = self.arrived.notified();
            if self.gate.lock().expect("gate").arrivals > seen {
                return;
            }
            notified.await;
        }
    }

    fn has_committed(&self, op_id: &str) -> bool {
        self.gate
            .lock()
            .expect("gate")
            .committed_ops
            .contains(op_id)
    }
}

impl Store for GatedStore {
    fn load(&self, peer: &PeerId) -> Result<DurableState, StoreError> {
        self.inner.load(peer)
    }

    fn commit(&self, peer: &PeerId, batches: &[PersistBatch]) -> Result<(), StoreError> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let mut gate = self.gate.lock().expect("gate");
        gate.arrivals += 1;
        self.arrived.notify_waiters();
        let arrived_before = gate.openings;
        while gate.held && gate.openings == arrived_before {
            gate = self.opened.wait(gate).expect("gate");
        }
        let result = self.inner.commit(peer, batches);
        for record in batches.iter().flat_map(|batch| &batch.records) {
            if let Record::Inbox(op) | Record::Held(op) = record {
                gate.committed_ops.insert(op.id.to_string());
            }
        }
        drop(gate);
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        result
    }

    fn peers(&self) -> Result<Vec<PeerId>, StoreError> {
        self.inner.peers()
    }

    fn is_blocking(&self) -> bool {
        true
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_ack_reaches_the_sender_before_the_receivers_commit_while_commits_pipeline() {
    let store = Arc::new(GatedStore::default());
    let key = || Auth::SharedKey(b"pipeline".to_vec());
    let localhost = "127.0.0.1:0".parse().expect("addr");
    let (alice_id, bob_id) = (PeerId::new("alice"), PeerId::new("bob"));
    let bob_transport = TcpTransport::bind(bob_id.clone(), localhost)
        .await
        .expect("bind");
    let alice_transport = TcpTransport::bind(alice_id.clone(), localhost)
        .await
        .expect("bind");
    alice_transport.add_peer(bob_id.clone(), bob_transport.local_addr());
    let bob = Substrate::builder(bob_id.clone(), bob_transport)
        .auth(key())
        .authorize(Authorizer::new(AllowAll))
        .store(store.clone())
        .start()
        .expect("bob");
    let alice = Substrate::builder(alice_id, alice_transport)
        .auth(key())
        .authorize(Authorizer::new(AllowAll))
        .start()
        .expect("alice");
    let mut inbound = bob.inbound().expect("inbound");
    let received = tokio::spawn(async move {
        let mut bodies = Vec::new();
        while let Some(item) = inbound.recv().await {
            match item {
                Inbound::Open(open) => open.accept().await.expect("accept"),
                Inbound::Message(message) => {
                    bodies.push(message.body.to_vec());
                    message.done();
                    if bodies.len() == 200 {
                        return bodies;
                    }
                }
                _ => {}
            }
        }
        bodies
    });
    let queue = alice.peer(&bob_id).open_queue("jobs").await.expect("open");

    // Ten rounds: the gate closes, one send reaches bob's store and waits there, nineteen
    // more follow it into bob while it waits, and the gate opens. Every ack is checked
    // against bob's committed ops as it arrives.
    let mut acks = Vec::new();
    for round in 0..10u32 {
        let seen = store.hold();
        for i in 0..20u32 {
            let send = queue.send(format!("{round}/{i}").into_bytes());
            let bobs_store = store.clone();
            acks.push(tokio::spawn(async move {
                let op_id = send.await.expect("acked");
                assert!(
                    bobs_store.has_committed(&op_id),
                    "op {op_id} was acknowledged before bob committed it"
                );
            }));
            if i == 0 {
                store.arrival_after(seen).await;
            }
        }
        store.open();
    }
    for ack in acks {
        ack.await.expect("ack checked");
    }
    let bodies = received.await.expect("bob's app");
    let expected: Vec<Vec<u8>> = (0..10u32)
        .flat_map(|round| (0..20u32).map(move |i| format!("{round}/{i}").into_bytes()))
        .collect();
    assert_eq!(bodies, expected, "every message once, in order");
    assert_eq!(
        store.max_in_flight.load(Ordering::SeqCst),
        1,
        "one commit in flight per peer at a time"
    );
    alice.shutdown().await;
    bob.shutdown().await;
}
