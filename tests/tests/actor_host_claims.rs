//! Signed actor host claims over real iroh on 127.0.0.1: a node that registers an actor signs
//! a claim its peers verify; `send_to_actor` follows it without naming a node; the actor moves
//! only with its holder's handoff (or the peer's claim authorizer); forged, relayed, stale,
//! jumping and unconsented claims change nothing, whoever sends them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tether::node::{ActorBridge, DeliveryError, Node, NodeError, OutFrame};
use tether_core::driver::{ActorAddr, ClaimVerdict, DropReason, HostClaim, HOST_CLAIM_TAG};
use tether_core::limits::CLAIM_GENERATION_MAX;
use tokio::sync::watch;

const ACTOR: ActorAddr = ActorAddr::new([42; 32]);

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

/// `from` sends claim bytes to `to`'s mailbox, as any peer can.
fn send_claim(from: &Node, to: &Node, bytes: Vec<u8>) {
    from.send(OutFrame {
        to: to.node_id(),
        dest: ActorAddr::mailbox(to.node_id()),
        type_tag: HOST_CLAIM_TAG.into(),
        payload: Bytes::from(bytes),
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_moves_only_with_its_holders_handoff() {
    let (b_inbox, c_inbox) = (Arc::new(Inbox::default()), Arc::new(Inbox::default()));
    let a = Node::builder().bind().await.expect("bind");
    let b_secret = [2; 32];
    let b = host(b_secret, &b_inbox).await;
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

    // b takes the actor at a higher generation on its own say: a keeps c's route.
    b.register_actor(ACTOR, 5).expect("register");
    until_claims(&a, |v| count(v, ClaimVerdict::Held) == 1).await;
    assert_eq!(a.directory_route_count(), 1);

    // c hands the actor off to b at generation 6; b registers it with c's consent.
    let handoff = c.hand_off_actor(ACTOR, b.node_id(), 6).expect("hand off");
    assert!(
        c.hand_off_actor(ACTOR, b.node_id(), 7).is_err(),
        "c hosts it no more"
    );
    b.register_handed_off_actor(ACTOR, 6, handoff)
        .expect("register with the handoff");
    until_claims(&a, |v| count(v, ClaimVerdict::Accepted) == 2).await;
    a.send_to_actor(ACTOR, "Chat", Bytes::from_static(b"to b"))
        .expect("routed");
    b_inbox.wait_for(1).await;

    // A replay of b's claim (b announces again on a new connection) is stale.
    a.disconnect(&b.node_id());
    a.connect(b.endpoint_addr()).await.expect("reconnect b");
    until_claims(&a, |v| count(v, ClaimVerdict::Stale) >= 1).await;

    // c, no longer the holder, attacks b's route every way it can:
    // its own newer claim, without consent;
    send_claim(&c, &a, HostClaim::sign(&c_secret, ACTOR, 7).encode());
    // "b hosts the actor at generation 99", signed with c's key;
    let mut forged = HostClaim::sign(&c_secret, ACTOR, 99);
    forged.host = b.node_id();
    send_claim(&c, &a, forged.encode());
    // bytes that are no claim at all;
    send_claim(&c, &a, b"short".to_vec());
    // a genuine claim of b's it got hold of, carried by c;
    send_claim(&c, &a, HostClaim::sign(&b_secret, ACTOR, 8).encode());
    // a claim of its own at the largest generation, for an actor nobody holds.
    send_claim(
        &c,
        &a,
        HostClaim::sign(&c_secret, ActorAddr::new([43; 32]), u64::MAX).encode(),
    );
    until_claims(&a, |v| {
        count(v, ClaimVerdict::Held) == 2
            && count(v, ClaimVerdict::Forged) == 2
            && count(v, ClaimVerdict::Relayed) == 1
            && count(v, ClaimVerdict::Jump) == 1
    })
    .await;

    // The route is still b's: the next frame goes there, none more to c.
    a.send_to_actor(ACTOR, "Chat", Bytes::from_static(b"to b again"))
        .expect("routed");
    b_inbox.wait_for(2).await;
    assert_eq!(*c_inbox.total.borrow(), 1);
    assert_eq!(a.directory_route_count(), 1);
    let verdicts = a.claim_verdicts();
    assert_eq!(count(&verdicts, ClaimVerdict::Accepted), 2, "{verdicts:?}");
    // b cannot register past the bounds peers keep.
    assert!(b.register_actor(ACTOR, CLAIM_GENERATION_MAX + 1).is_err());
    assert!(b.register_actor(ACTOR, u64::MAX).is_err());
    for node in [a, b, c] {
        node.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_authorizer_binds_actors_to_their_owners() {
    // a's rule: an actor's address starts with its host's first 8 bytes.
    let a = Node::builder()
        .claim_authorizer(|request| request.actor.as_bytes()[..8] == request.host.as_bytes()[..8])
        .bind()
        .await
        .expect("bind");
    let b_inbox = Arc::new(Inbox::default());
    let b = host([2; 32], &b_inbox).await;
    let mut owned = [7u8; 32];
    owned[..8].copy_from_slice(&b.node_id().as_bytes()[..8]);
    let owned = ActorAddr::new(owned);
    b.register_actor(ACTOR, 1).expect("register");
    b.register_actor(owned, 1).expect("register");
    a.connect(b.endpoint_addr()).await.expect("connect b");
    until_claims(&a, |v| {
        count(v, ClaimVerdict::Accepted) == 1 && count(v, ClaimVerdict::Refused) == 1
    })
    .await;
    a.send_to_actor(owned, "Chat", Bytes::from_static(b"x"))
        .expect("routed");
    b_inbox.wait_for(1).await;
    assert!(matches!(
        a.send_to_actor(ACTOR, "Chat", Bytes::from_static(b"x")),
        Err(NodeError::NoRoute)
    ));
    a.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_to_actor_refuses_a_host_off_the_allow_list() {
    // a admits only b. a hosts an actor and hands it off to a node it does not admit: its
    // route names that node, and a frame for the actor is refused before anything is queued
    // or dialed.
    let b_inbox = Arc::new(Inbox::default());
    let b = host([2; 32], &b_inbox).await;
    let a = Node::builder()
        .allow([b.node_id()])
        .bind()
        .await
        .expect("bind");
    let stranger = HostClaim::sign(&[9; 32], ACTOR, 1).host;
    a.connect(b.endpoint_addr()).await.expect("connect b");
    a.register_actor(ACTOR, 1).expect("register");
    a.hand_off_actor(ACTOR, stranger, 2).expect("hand off");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_peer_learns_every_actor_batch_by_batch() {
    // More claims than one announce batch: the rest follow as the writer drains.
    const ACTORS: usize = 3 * tether_core::limits::ANNOUNCE_CLAIMS_BATCH_MAX + 5;
    let inbox = Arc::new(Inbox::default());
    let c = host([3; 32], &inbox).await;
    for n in 0..ACTORS {
        let mut actor = [0u8; 32];
        actor[..8].copy_from_slice(&(n as u64).to_be_bytes());
        c.register_actor(ActorAddr::new(actor), 1)
            .expect("register");
    }
    let a = Node::builder().bind().await.expect("bind");
    a.connect(c.endpoint_addr()).await.expect("connect c");
    until_claims(&a, |v| count(v, ClaimVerdict::Accepted) == ACTORS as u64).await;
    assert_eq!(a.directory_route_count(), ACTORS);
    a.close().await;
    c.close().await;
}
