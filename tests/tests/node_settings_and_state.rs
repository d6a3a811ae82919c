//! A node's settings and state queries over real iroh on 127.0.0.1: where it listens, which
//! relay it was given and is homed on, and a SWIM tag set chosen on the builder.

use std::sync::Arc;

use bytes::Bytes;
use tether::node::{ActorBridge, DeliveryError, Node, OutFrame, RelayMode, RelayUrl};
use tether_core::driver::{JoinPhase, NodeId};
use tokio::sync::mpsc;

/// Reports send failures to the test.
struct Failures(mpsc::UnboundedSender<NodeId>);

impl ActorBridge for Failures {
    fn deliver_raw(
        &self,
        _: tether::node::ActorAddr,
        _: &str,
        _: Bytes,
    ) -> Result<(), DeliveryError> {
        Ok(())
    }

    fn send_failed(&self, to: NodeId) {
        let _ = self.0.send(to);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_tells_where_it_listens_and_which_relay_it_uses() {
    let node = Node::builder().bind().await.expect("bind");
    let listen = node.listen_addr().expect("bound");
    assert!(listen.ip().is_loopback(), "{listen}");
    assert_ne!(listen.port(), 0);
    assert_eq!(Some(listen), node.direct_addresses().first().copied());
    // Relays are off by default: none configured, none homed on.
    assert_eq!(node.relay_url(), None);
    assert_eq!(node.home_relay_url(), None);
    node.close().await;

    // A custom relay (on loopback, where nothing answers: nothing leaves the machine).
    let relay: RelayUrl = "http://127.0.0.1:9/".parse().expect("a URL");
    let node = Node::builder()
        .relay_mode(RelayMode::custom([relay.clone()]))
        .bind()
        .await
        .expect("bind");
    assert_eq!(node.relay_url(), Some(relay));
    node.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_swim_tag_set_is_the_builders_choice() {
    let (failed_tx, mut failed) = mpsc::unbounded_channel();
    let a = Node::builder()
        .bridge(Arc::new(Failures(failed_tx)))
        .swim_tags(["Gossip"])
        .bind()
        .await
        .expect("bind");
    // b reads payloads of at most 16 bytes: a bigger record breaks the stream, which b stops,
    // so a's next write fails.
    let b = Node::builder()
        .payload_bytes_max(16)
        .bind()
        .await
        .expect("bind");
    let b_id = b.node_id();
    let frame = |tag: &'static str| OutFrame {
        to: b_id,
        dest: tether::node::ActorAddr::mailbox(b_id),
        type_tag: tag.into(),
        payload: Bytes::from_static(&[0; 64]),
    };
    a.connect(b.endpoint_addr()).await.expect("connect");
    let mut changes = a.changes();
    // "Ping" is not in this node's set: b stops the stream it breaks, a's writer hears the
    // stop and evicts the generation, and nothing is reported as a SWIM send failure.
    a.send(frame("Ping"));
    while a.snapshot().evictions == 0 {
        changes.changed().await.expect("alive");
    }
    assert!(
        failed.try_recv().is_err(),
        "a non-SWIM failure was reported"
    );
    // The eviction redials b; once connected again, "Gossip" is: its failure reaches the
    // bridge.
    while !a.snapshot().cache.contains_key(&hex(&b_id)) {
        changes.changed().await.expect("alive");
    }
    a.send(frame("Gossip"));
    let reported = failed.recv().await.expect("a SendFailed report");
    assert_eq!(reported, b_id);
    a.close().await;
    b.close().await;
}

fn hex(id: &NodeId) -> String {
    id.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_hint_fills_a_later_seed_address_that_has_none() {
    let a = Node::builder().bind().await.expect("bind");
    let b = Node::builder().bind().await.expect("bind");
    let c = Node::builder().bind().await.expect("bind");
    // a learns b's relay from an address that carries it (a relay on loopback, where nothing
    // answers: the connection goes direct and nothing leaves the machine).
    let relay: RelayUrl = "http://127.0.0.1:9/".parse().expect("a URL");
    a.connect(b.endpoint_addr().with_relay_url(relay))
        .await
        .expect("connect");
    // Seeds given by key and direct sockets only: b's is normalized with the hint, c's has
    // none to take.
    let mut changes = a.changes();
    a.join(vec![b.endpoint_addr(), c.endpoint_addr()]);
    let both_sent = || {
        let statuses = a.join_statuses();
        statuses.len() == 2 && statuses.values().all(|s| s.phase == JoinPhase::Sent)
    };
    while !both_sent() {
        changes.changed().await.expect("the node is alive");
    }
    let statuses = a.join_statuses();
    assert!(statuses[&hex(&b.node_id())].has_relay, "{statuses:?}");
    assert!(!statuses[&hex(&c.node_id())].has_relay, "{statuses:?}");
    for node in [a, b, c] {
        node.close().await;
    }
}
