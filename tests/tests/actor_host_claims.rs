//! Signed actor host claims over real iroh on 127.0.0.1: a node that registers an actor signs
//! a claim its peers verify; `send_to_actor` follows the newest generation without naming a
//! node; replayed (stale) and forged claims change nothing.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tether::node::{ActorBridge, DeliveryError, Node, NodeError, OutFrame};
use tether_core::driver::{ActorAddr, ClaimVerdict, DropReason, HostClaim, HOST_CLAIM_TAG};
use tokio::sync::watch;

const ACTOR: ActorAddr = [42; 32];

/// Counts deliveries per actor and publishes the total.
#[derive(Default)]
struct Inbox {
    got: Mutex<BTreeMap<ActorAddr, u64>>,
    total: watch::Sender<u64>,
}

impl ActorBridge for Inbox {
    fn deliver_raw(&self, dest: ActorAddr, _: &str, _: Bytes) -> Result<(), DeliveryError> {
        *self.got.lock().expect("lock").entry(dest).or_default() += 1;
        self.total.send_modify(|n| *n += 1);
        Ok(())
    }
}

impl Inbox {
    async fn wait_for(&self, total: u64) {
        let mut seen = self.total.subscribe();
        seen.wait_for(|n| *n >= total).await.expect("alive");
    }
}

async fn host(secret: [u8; 32], inbox: &Arc<Inbox>) -> Node {
    Node::builder()
        .secret_key(secret)
        .bridge(inbox.clone())
        .know_tag("Chat")
        .bind()
        .await
        .expect("bind")
}

/// Waits until `node`'s received claims satisfy `done`.
async fn until_claims(node: &Node, done: impl Fn(&BTreeMap<ClaimVerdict, u64>) -> bool) {
    let mut changes = node.changes();
    while !done(&node.claim_verdicts()) {
        changes.changed().await.expect("alive");
    }
}

fn count(verdicts: &BTreeMap<ClaimVerdict, u64>, verdict: ClaimVerdict) -> u64 {
    verdicts.get(&verdict).copied().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_to_actor_follows_the_newest_valid_claim() {
    let (b_inbox, c_inbox) = (Arc::new(Inbox::default()), Arc::new(Inbox::default()));
    let a = Node::builder().bind().await.expect("bind");
    let b = host([2; 32], &b_inbox).await;
    let c_secret = [3; 32];
    let c = host(c_secret, &c_inbox).await;

    // Nothing claims the actor yet: refused, counted.
    let refused = a.send_to_actor(ACTOR, "Chat", Bytes::from_static(b"x"));
    assert!(matches!(refused, Err(NodeError::NoRoute)), "{refused:?}");
    assert_eq!(a.snapshot().drops.get(DropReason::NoRoute), 1);

    // c hosts the actor at generation 1, claimed before a connects: the claim is announced
    // on the new connection.
    c.register_actor(ACTOR, 1).expect("register");
    a.connect(c.endpoint_addr()).await.expect("connect c");
    a.connect(b.endpoint_addr()).await.expect("connect b");
    until_claims(&a, |v| count(v, ClaimVerdict::Accepted) == 1).await;
    assert_eq!(a.directory_route_count(), 1);
    a.send_to_actor(ACTOR, "Chat", Bytes::from_static(b"to c"))
        .expect("routed");
    c_inbox.wait_for(1).await;
    assert_eq!(a.location_cache_entries(), 1);

    // b takes the actor over at generation 2 (announced to the peers connected now).
    b.register_actor(ACTOR, 2).expect("register");
    until_claims(&a, |v| count(v, ClaimVerdict::Accepted) == 2).await;
    a.send_to_actor(ACTOR, "Chat", Bytes::from_static(b"to b"))
        .expect("routed");
    b_inbox.wait_for(1).await;

    // A replay of c's generation-1 claim (c announces again on a new connection) is stale.
    a.disconnect(&c.node_id());
    a.connect(c.endpoint_addr()).await.expect("reconnect c");
    until_claims(&a, |v| count(v, ClaimVerdict::Stale) >= 1).await;

    // A forgery: c signs "b hosts the actor at generation 99"... with c's key.
    let mut forged = HostClaim::sign(&c_secret, ACTOR, 99);
    forged.host = b.node_id();
    c.send(OutFrame {
        to: a.node_id(),
        dest: a.node_id(),
        type_tag: HOST_CLAIM_TAG.into(),
        payload: Bytes::copy_from_slice(&forged.encode()),
    });
    // And bytes that are no claim at all.
    c.send(OutFrame {
        to: a.node_id(),
        dest: a.node_id(),
        type_tag: HOST_CLAIM_TAG.into(),
        payload: Bytes::from_static(b"short"),
    });
    until_claims(&a, |v| count(v, ClaimVerdict::Forged) == 2).await;

    // The route is still b's: the next frame goes there, none more to c.
    a.send_to_actor(ACTOR, "Chat", Bytes::from_static(b"to b again"))
        .expect("routed");
    b_inbox.wait_for(2).await;
    assert_eq!(*c_inbox.total.borrow(), 1);
    assert_eq!(a.directory_route_count(), 1);
    let verdicts = a.claim_verdicts();
    assert_eq!(count(&verdicts, ClaimVerdict::Accepted), 2, "{verdicts:?}");
    // c cannot re-register what it already claimed at that generation.
    assert!(c.register_actor(ACTOR, 1).is_err());
    for node in [a, b, c] {
        node.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_to_actor_refuses_a_host_off_the_allow_list() {
    // a admits only b. b relays a valid claim signed by a host a does not admit (claims are
    // signed, so any peer may carry one): the route is learned, but a frame for the actor is
    // refused before anything is queued or dialed.
    let b_inbox = Arc::new(Inbox::default());
    let b = host([2; 32], &b_inbox).await;
    let a = Node::builder()
        .allow([b.node_id()])
        .bind()
        .await
        .expect("bind");
    let stranger = [9; 32];
    let claim = HostClaim::sign(&stranger, ACTOR, 1);
    a.connect(b.endpoint_addr()).await.expect("connect b");
    // `connect` returns once a's side of the handshake is done; b caches the connection when
    // it accepts it, which may come later. Sent before then, b's frame would miss its cache
    // (dropped, counted) and the claim never arrive.
    let a_key: String = a
        .node_id()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect();
    let mut changes = b.changes();
    while !b.snapshot().cache.contains_key(&a_key) {
        changes.changed().await.expect("alive");
    }
    b.send(OutFrame {
        to: a.node_id(),
        dest: a.node_id(),
        type_tag: HOST_CLAIM_TAG.into(),
        payload: Bytes::copy_from_slice(&claim.encode()),
    });
    until_claims(&a, |v| count(v, ClaimVerdict::Accepted) == 1).await;
    assert_eq!(a.directory_route_count(), 1);

    let before = a.snapshot();
    let refused = a.send_to_actor(ACTOR, "Chat", Bytes::from_static(b"x"));
    assert!(
        matches!(refused, Err(NodeError::Unauthorized)),
        "{refused:?}"
    );
    let after = a.snapshot();
    assert_eq!(
        after.refusals.get(
            tether_core::driver::Path::Actor,
            tether_core::driver::Direction::Outbound
        ),
        before.refusals.get(
            tether_core::driver::Path::Actor,
            tether_core::driver::Direction::Outbound
        ) + 1
    );
    assert_eq!(after.drops.get(DropReason::Unauthorized), 1);
    assert_eq!(
        after.frames_enqueued, before.frames_enqueued,
        "nothing queued"
    );
    assert_eq!(after.dials_started, before.dials_started, "nothing dialed");
    assert_eq!(after.cache.len(), 1, "only b's connection");
    a.close().await;
    b.close().await;
}
