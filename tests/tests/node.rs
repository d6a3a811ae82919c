//! The iroh driver over real endpoints on 127.0.0.1 (relay disabled, no port mapping: the
//! crate is built without the portmapper feature).

use crate::common;

use common::until_changed;
use std::sync::Arc;

use bytes::Bytes;
use tether::node::{
    node_id_of, ActorAddr, ActorBridge, DeliveryError, JoinPolicy, Node, NodeError, OutFrame,
};
use tether_core::driver::{DropReason, JoinPhase, NodeId};
use tokio::sync::mpsc;

type Delivery = (ActorAddr, String, Bytes);

/// Hands every delivery and send failure to the test.
struct Collect {
    delivered: mpsc::UnboundedSender<Delivery>,
    failed: mpsc::UnboundedSender<NodeId>,
}

impl ActorBridge for Collect {
    fn deliver_raw(&self, dest: ActorAddr, tag: &str, payload: Bytes) -> Result<(), DeliveryError> {
        self.delivered
            .send((dest, tag.to_owned(), payload))
            .map_err(|_| DeliveryError("test ended".into()))
    }

    fn send_failed(&self, to: NodeId) {
        let _ = self.failed.send(to);
    }
}

struct TestNode {
    node: Node,
    delivered: mpsc::UnboundedReceiver<Delivery>,
    failed: mpsc::UnboundedReceiver<NodeId>,
}

const SWIM_ACTOR: ActorAddr = ActorAddr::new([0x51; 32]);
const APP_ACTOR: ActorAddr = ActorAddr::new([0xA1; 32]);

async fn node_with(
    configure: impl FnOnce(tether::node::NodeBuilder) -> tether::node::NodeBuilder,
) -> TestNode {
    let (delivered_tx, delivered) = mpsc::unbounded_channel();
    let (failed, failed_rx) = mpsc::unbounded_channel();
    let builder = Node::builder()
        .bridge(Arc::new(Collect {
            delivered: delivered_tx,
            failed,
        }))
        .know_tag("Chat")
        .know_tag("Orphan")
        .route_tag("Ping", SWIM_ACTOR)
        .route_tag("JoinRequest", SWIM_ACTOR)
        .host(APP_ACTOR);
    let node = configure(builder).bind().await.expect("bind");
    TestNode {
        node,
        delivered,
        failed: failed_rx,
    }
}

async fn node() -> TestNode {
    node_with(|b| b).await
}

fn chat(to: &Node, n: u32) -> OutFrame {
    OutFrame {
        to: to.node_id(),
        dest: APP_ACTOR,
        type_tag: "Chat".into(),
        payload: Bytes::from(n.to_be_bytes().to_vec()),
    }
}

/// The next `count` frames delivered to `node`, by number. A frame that never comes fails
/// the test after a minute (a deadline against a hang, never a wait for an event).
async fn receive(node: &mut TestNode, count: usize) -> Vec<u32> {
    let mut numbers = Vec::new();
    while numbers.len() < count {
        let delivered =
            tokio::time::timeout(std::time::Duration::from_secs(60), node.delivered.recv());
        let Ok(delivered) = delivered.await else {
            panic!("{} of {count} frames arrived: {numbers:?}", numbers.len());
        };
        let (dest, tag, payload) = delivered.expect("bridge alive");
        assert_eq!((dest, tag.as_str()), (APP_ACTOR, "Chat"));
        numbers.push(u32::from_be_bytes(
            payload[..4].try_into().expect("4 bytes"),
        ));
    }
    numbers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actor_frames_cross_two_and_three_nodes_in_order() {
    let a = node().await;
    let mut b = node().await;
    let mut c = node().await;
    a.node.connect(b.node.endpoint_addr()).await.expect("a-b");
    a.node.connect(c.node.endpoint_addr()).await.expect("a-c");
    b.node.connect(c.node.endpoint_addr()).await.expect("b-c");
    for n in 0..300 {
        a.node.send(chat(&b.node, n));
        a.node.send(chat(&c.node, n));
        b.node.send(chat(&c.node, 1_000 + n));
    }
    assert_eq!(receive(&mut b, 300).await, (0..300).collect::<Vec<_>>());
    let at_c = receive(&mut c, 600).await;
    let from_a: Vec<u32> = at_c.iter().copied().filter(|n| *n < 1_000).collect();
    let from_b: Vec<u32> = at_c.iter().copied().filter(|n| *n >= 1_000).collect();
    assert_eq!(from_a, (0..300).collect::<Vec<_>>(), "FIFO per sender");
    assert_eq!(from_b, (1_000..1_300).collect::<Vec<_>>());
    let snapshot = a.node.snapshot();
    assert_eq!(snapshot.frames_enqueued, 600);
    assert_eq!(snapshot.cache.len(), 2);
    for n in [a, b, c] {
        n.node.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_batch_keeps_order_per_peer_and_judges_each_frame_like_send() {
    let a = node().await;
    let mut b = node().await;
    let mut c = node().await;
    a.node.connect(b.node.endpoint_addr()).await.expect("a-b");
    a.node.connect(c.node.endpoint_addr()).await.expect("a-c");
    // Runs of varying length, interleaved between b and c, and a run of three for a peer
    // the node never met (a cache miss each, as three lone sends would be).
    let stranger = tether::iroh::SecretKey::generate().public();
    let mut frames = Vec::new();
    let (mut to_b, mut to_c) = (0u32, 0u32);
    for run in 1..=40u32 {
        for _ in 0..run % 7 + 1 {
            if run % 2 == 0 {
                frames.push(chat(&b.node, to_b));
                to_b += 1;
            } else {
                frames.push(chat(&c.node, to_c));
                to_c += 1;
            }
        }
    }
    for n in 0..3 {
        let mut frame = chat(&b.node, n);
        frame.to = node_id_of(&stranger);
        frames.insert(10, frame);
    }
    // Frames the wire cannot carry, each dropped and counted where it stands: inside the
    // last run (one for its peer, one for the other, which does not end the run), where the
    // first run (2 frames to c) gives way to the second (to b), and first of all.
    let unsendable = |to: &TestNode| {
        let mut frame = chat(&to.node, 0);
        frame.type_tag = "x"
            .repeat(tether_core::limits::ACTOR_TAG_BYTES_MAX + 1)
            .into();
        frame
    };
    let at = frames.len() - 5;
    frames.insert(at, unsendable(&b));
    frames.insert(at, unsendable(&c));
    frames.insert(2, unsendable(&b));
    frames.insert(0, unsendable(&b));
    a.node.send_batch(frames);
    assert_eq!(
        receive(&mut b, to_b as usize).await,
        (0..to_b).collect::<Vec<_>>()
    );
    assert_eq!(
        receive(&mut c, to_c as usize).await,
        (0..to_c).collect::<Vec<_>>()
    );
    let snapshot = a.node.snapshot();
    assert_eq!(snapshot.frames_enqueued, u64::from(to_b + to_c));
    assert_eq!(snapshot.drops.get(DropReason::CacheMiss), 3);
    assert_eq!(snapshot.drops.get(DropReason::WriteFailed), 4);
    for n in [a, b, c] {
        n.node.close().await;
    }
}

/// `send_batch` asks the caller's iterator for frames until it says there are no more, and
/// never again: an iterator that is not fused (a queue drained with `from_fn`, say) keeps
/// what is pushed to it after the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_batch_never_asks_past_the_end_of_its_frames() {
    struct Unfused<'a> {
        to: &'a Node,
        sent: u32,
        asked_after_end: u32,
    }
    impl Iterator for Unfused<'_> {
        type Item = OutFrame;
        fn next(&mut self) -> Option<OutFrame> {
            // Ends after 100 frames (a run longer than one ring slot), then would give 10 more
            // (and end again) if asked again.
            if self.sent >= 100 {
                self.asked_after_end += 1;
                if self.asked_after_end == 1 || self.sent == 110 {
                    return None;
                }
            }
            self.sent += 1;
            Some(chat(self.to, self.sent - 1))
        }
    }
    let a = node().await;
    let mut b = node().await;
    a.node.connect(b.node.endpoint_addr()).await.expect("a-b");
    let mut frames = Unfused {
        to: &b.node,
        sent: 0,
        asked_after_end: 0,
    };
    a.node.send_batch(&mut frames);
    assert_eq!((frames.sent, frames.asked_after_end), (100, 1));
    assert_eq!(receive(&mut b, 100).await, (0..100).collect::<Vec<_>>());
    for n in [a, b] {
        n.node.close().await;
    }
}

/// A batch's first runs leave while the caller's iterator still hands over the rest: its
/// writer starts on the first run in the ring, not when `send_batch` returns. The iterator
/// waits, halfway through, for the receiver to see the batch's first frame (with a deadline
/// against a hang); the writer has written to the peer before, and sleeps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_starts_leaving_while_its_iterator_still_runs() {
    let a = node().await;
    let mut b = node().await;
    a.node.connect(b.node.endpoint_addr()).await.expect("a-b");
    a.node.send(chat(&b.node, 0));
    assert_eq!(receive(&mut b, 1).await, [0]);
    let (runtime, to) = (tokio::runtime::Handle::current(), b.node.node_id());
    let delivered = &mut b.delivered;
    let first = std::thread::scope(|scope| {
        let sender = scope.spawn(|| {
            let mut first = None;
            let frames = (1..1_000u32).map(|n| {
                if n == 500 {
                    let deadline = std::time::Duration::from_secs(20);
                    let next = async { tokio::time::timeout(deadline, delivered.recv()).await };
                    first = Some(runtime.block_on(next).ok().flatten().map(|(.., p)| p));
                }
                OutFrame {
                    to,
                    dest: APP_ACTOR,
                    type_tag: "Chat".into(),
                    payload: Bytes::from(n.to_be_bytes().to_vec()),
                }
            });
            a.node.send_batch(frames);
            first
        });
        sender.join().expect("the sending thread")
    });
    let first = first.expect("the iterator reached frame 500");
    assert_eq!(
        first,
        Some(Bytes::from(1u32.to_be_bytes().to_vec())),
        "the batch's first frame arrived before its iterator ended"
    );
    assert_eq!(receive(&mut b, 998).await, (2..1_000).collect::<Vec<_>>());
    for n in [a, b] {
        n.node.close().await;
    }
}

/// Long runs travel as ring slots of up to `EGRESS_RUN_FRAMES_MAX` frames, and a slot can
/// be cut between two stream writes (a write carries at most 256 KiB of records): 2,000
/// frames of 1 KiB in one batch, then a lone send, arrive once each and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_batches_cross_write_boundaries_in_order() {
    let a = node().await;
    let mut b = node().await;
    a.node.connect(b.node.endpoint_addr()).await.expect("a-b");
    let frame = |n: u32| {
        let mut payload = vec![0u8; 1024];
        payload[..4].copy_from_slice(&n.to_be_bytes());
        OutFrame {
            payload: payload.into(),
            ..chat(&b.node, n)
        }
    };
    a.node.send_batch((0..2_000).map(frame));
    a.node.send(frame(2_000));
    assert_eq!(receive(&mut b, 2_001).await, (0..2_001).collect::<Vec<_>>());
    let snapshot = a.node.snapshot();
    assert_eq!(snapshot.frames_enqueued, 2_001);
    assert!(snapshot.drops.0.is_empty(), "{:?}", snapshot.drops);
    for n in [a, b] {
        n.node.close().await;
    }
}

/// A queued frame names its tag by number in the node's tag table, up to
/// `EGRESS_TAGS_MAX` tags; a frame whose tag has none yet (its first frames, or every frame
/// past the bound) is queued with its tag. Order and tags survive either way, lone and in
/// batches, and a tag too long for the wire is counted, never numbered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_keep_order_and_tags_past_the_egress_tag_table() {
    use tether_core::limits::{ACTOR_TAG_BYTES_MAX, EGRESS_TAGS_MAX};
    let tags = EGRESS_TAGS_MAX + 50;
    let tag = |n: usize| format!("T{}", n % tags);
    let a = node().await;
    let mut b =
        node_with(|builder| (0..tags).fold(builder, |builder, n| builder.know_tag(&tag(n)))).await;
    a.node.connect(b.node.endpoint_addr()).await.expect("a-b");
    let frame = |n: usize| OutFrame {
        to: b.node.node_id(),
        dest: APP_ACTOR,
        type_tag: tag(n).into(),
        payload: Bytes::from((n as u32).to_be_bytes().to_vec()),
    };
    // Every tag twice, lone and then in batches of 100; one unsendable tag among them.
    let total = 2 * tags;
    for n in 0..tags {
        a.node.send(frame(n));
    }
    a.node.send(OutFrame {
        type_tag: "x".repeat(ACTOR_TAG_BYTES_MAX + 1).into(),
        ..frame(0)
    });
    for start in (tags..total).step_by(100) {
        a.node
            .send_batch((start..(start + 100).min(total)).map(frame));
    }
    for n in 0..total {
        let (dest, got, payload) = b.delivered.recv().await.expect("bridge alive");
        let number = u32::from_be_bytes(payload[..4].try_into().expect("4 bytes"));
        assert_eq!((dest, number as usize, got), (APP_ACTOR, n, tag(n)));
    }
    let snapshot = a.node.snapshot();
    assert_eq!(snapshot.frames_written, total as u64);
    assert_eq!(snapshot.drops.get(DropReason::WriteFailed), 1);
    for n in [a, b] {
        n.node.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gossip_is_routed_by_tag_and_unroutable_frames_are_counted() {
    let a = node().await;
    let mut b = node().await;
    a.node
        .connect(b.node.endpoint_addr())
        .await
        .expect("connect");
    let b_id = b.node.node_id();
    let frame = |dest, tag: &str| OutFrame {
        to: b_id,
        dest,
        type_tag: tag.to_owned().into(),
        payload: Bytes::from_static(b"x"),
    };
    let mailbox = ActorAddr::mailbox(b_id);
    a.node.send(frame(mailbox, "Nope")); // unknown tag
    a.node.send(frame(mailbox, "Orphan")); // gossip tag without a local route
    a.node.send(frame(ActorAddr::new([0xEE; 32]), "Chat")); // an actor not hosted at b
    a.node.send(frame(mailbox, "Ping")); // gossip: to the SWIM actor
    let (dest, tag, _) = b.delivered.recv().await.expect("delivered");
    assert_eq!((dest, tag.as_str()), (SWIM_ACTOR, "Ping"));
    // The stream is FIFO: the three drops happened before the Ping was delivered.
    let drops = b.node.snapshot().drops;
    assert_eq!(drops.get(DropReason::UnknownTag), 1);
    assert_eq!(drops.get(DropReason::NoLocalRoute), 1);
    assert_eq!(drops.get(DropReason::NotLocal), 1);

    // A frame for a peer with no connection is dropped at once and a dial starts.
    let c = node().await;
    a.node.send(chat(&c.node, 1));
    let snapshot = a.node.snapshot();
    assert_eq!(snapshot.drops.get(DropReason::CacheMiss), 1);
    assert_eq!(snapshot.dials_started, 1);
    for n in [a, b, c] {
        n.node.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthorized_peer_is_refused_both_ways() {
    let a = node().await;
    let c = node().await;
    let c_id = c.node.node_id();
    let b = node_with(|builder| builder.allow([c_id])).await;
    // Outbound: b never dials a peer off its list.
    let refused = b.node.connect(a.node.endpoint_addr()).await;
    assert!(matches!(refused, Err(NodeError::Unauthorized)));
    b.node.send(chat(&a.node, 1));
    assert_eq!(b.node.snapshot().drops.get(DropReason::Unauthorized), 1);
    assert_eq!(b.node.snapshot().dials_started, 0);
    // Inbound: a's connection is closed by b as unauthorized.
    let _ = a.node.connect(b.node.endpoint_addr()).await;
    b.node
        .refusals()
        .wait_for(|refusals| refusals.total(tether_core::driver::Direction::Inbound) == 1)
        .await
        .expect("alive");
    assert!(b.node.snapshot().cache.is_empty());
    // c is on the list.
    c.node
        .connect(b.node.endpoint_addr())
        .await
        .expect("allowed");
    until_changed(&b.node, || b.node.snapshot().accepted == 1).await;
    for n in [a, b, c] {
        n.node.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_keeps_a_cached_connection_until_it_is_disconnected() {
    let a = node().await;
    let b = node().await;
    let b_key = hex(&b.node.node_id());
    a.node
        .connect(b.node.endpoint_addr())
        .await
        .expect("connect");
    let first = a.node.snapshot().cache[&b_key];
    // Connected already: nothing is dialed, the generation stays (a dial would have cached
    // a new one before `connect` returned).
    a.node.connect(b.node.endpoint_addr()).await.expect("again");
    assert_eq!(a.node.snapshot().cache[&b_key], first);
    // Disconnected: the next connect dials a new one.
    a.node.disconnect(&b.node.node_id());
    a.node
        .connect(b.node.endpoint_addr())
        .await
        .expect("after disconnect");
    assert!(a.node.snapshot().cache[&b_key] > first);
    for n in [a, b] {
        n.node.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_connects_share_one_dial() {
    let a = node().await;
    let b = node().await;
    let b_key = hex(&b.node.node_id());
    // The first asks the machine and dials; the other two find that dial in flight, wait
    // for it, and return once it cached its connection.
    let (one, two, three) = tokio::join!(
        a.node.connect(b.node.endpoint_addr()),
        a.node.connect(b.node.endpoint_addr()),
        a.node.connect(b.node.endpoint_addr()),
    );
    for connected in [one, two, three] {
        connected.expect("connect");
    }
    // The node's first and only cached connection: had each connect dialed, three would
    // have been cached one after another (generations 1, 2, 3), each replacing the last.
    let snapshot = a.node.snapshot();
    assert_eq!(snapshot.cache[&b_key], 1, "one dial for all three");
    assert_eq!(snapshot.connections.len(), 1);
    for n in [a, b] {
        n.node.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_connection_is_replaced_under_a_new_generation() {
    let a = node().await;
    let mut b = node().await;
    let b_key = hex(&b.node.node_id());
    a.node
        .connect(b.node.endpoint_addr())
        .await
        .expect("connect");
    let first = a.node.snapshot().cache[&b_key];
    a.node.send(chat(&b.node, 0));
    assert_eq!(receive(&mut b, 1).await, vec![0]);
    // b kills its side; a learns the connection closed (its reader sees the close, and the
    // entry leaves the cache). Sent before that, a frame could go to the dying stream and
    // fail there (a redial on a failed write, with no cache miss): under load that race was
    // lost once in CI.
    b.node.disconnect(&a.node.node_id());
    until_changed(&a.node, || !a.node.snapshot().cache.contains_key(&b_key)).await;
    // The next frame finds no connection, is dropped, and a dial starts (background).
    until_changed(&a.node, || {
        a.node.send(chat(&b.node, 99));
        a.node
            .snapshot()
            .cache
            .get(&b_key)
            .is_some_and(|g| *g > first)
    })
    .await;
    let snapshot = a.node.snapshot();
    assert!(snapshot.drops.get(DropReason::CacheMiss) >= 1);
    assert!(snapshot.dials_started >= 1);
    a.node.send(chat(&b.node, 7));
    let got = receive(&mut b, 1).await;
    assert!(
        got == vec![99] || got == vec![7],
        "frames flow on the new generation"
    );
    for n in [a, b] {
        n.node.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn join_sends_a_request_to_the_seed_mailbox_or_reports_failed() {
    // The live seed gets the default attempt timeout: a loaded machine's slow handshake must
    // not use up the attempts before the request is delivered (that wait has no other end).
    let a = node().await;
    let mut b = node().await;
    a.node.join(vec![b.node.endpoint_addr()]);
    let (dest, tag, payload) = b.delivered.recv().await.expect("join request");
    assert_eq!((dest, tag.as_str()), (SWIM_ACTOR, "JoinRequest"));
    assert_eq!(&payload[..], &a.node.node_id().as_bytes()[..]);
    let b_key = hex(&b.node.node_id());
    until_changed(&a.node, || {
        a.node
            .join_statuses()
            .get(&b_key)
            .is_some_and(|s| s.phase == JoinPhase::Sent)
    })
    .await;

    // A seed nobody listens for: five attempts, then Failed. Short attempts keep this part
    // quick; whatever the machine's speed, every attempt fails.
    let c = node_with(|b| {
        b.join_policy(JoinPolicy {
            attempt_timeout: std::time::Duration::from_millis(300),
            delay_divisor: 1_000,
        })
    })
    .await;
    let dead = Node::builder().bind().await.expect("bind");
    let dead_addr = dead.endpoint_addr();
    let dead_key = hex(&dead.node_id());
    dead.close().await;
    c.node.join(vec![dead_addr]);
    until_changed(&c.node, || {
        c.node
            .join_statuses()
            .get(&dead_key)
            .is_some_and(|s| s.phase == JoinPhase::Failed)
    })
    .await;
    let status = &c.node.join_statuses()[&dead_key];
    assert!(status.has_direct && !status.has_relay);
    assert!(status.last_error.is_some());
    for n in [a, b, c] {
        n.node.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_leaves_no_task_running() {
    let a = node().await;
    let mut b = node().await;
    a.node
        .connect(b.node.endpoint_addr())
        .await
        .expect("connect");
    for n in 0..10 {
        a.node.send(chat(&b.node, n));
    }
    assert_eq!(receive(&mut b, 10).await.len(), 10);
    assert!(a.node.tasks_running() > 0);
    a.node.close().await;
    b.node.close().await;
    assert_eq!(a.node.tasks_running(), 0);
    assert_eq!(b.node.tasks_running(), 0);
    a.node.send(chat(&b.node, 1));
    assert_eq!(a.node.tasks_running(), 0, "a closed node starts nothing");
}

fn hex(id: &NodeId) -> String {
    id.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_of_a_swim_frame_reports_send_failed_and_evicts_its_generation() {
    let mut a = node().await;
    // b reads payloads of at most 16 bytes: a bigger record breaks the stream, which b stops.
    let b = node_with(|builder| builder.payload_bytes_max(16)).await;
    a.node
        .connect(b.node.endpoint_addr())
        .await
        .expect("connect");
    let b_id = b.node.node_id();
    let ping = || OutFrame {
        to: b_id,
        dest: ActorAddr::mailbox(b_id),
        type_tag: "Ping".into(),
        payload: Bytes::from_static(&[0; 64]),
    };
    // One ping breaks b's stream; b stops it. a's writer hears the stop: the write failed,
    // its generation is evicted and the SWIM actor hears SendFailed for b.
    a.node.send(ping());
    let failed = a.failed.recv().await.expect("a SendFailed report");
    assert_eq!(failed, b_id);
    let snapshot = a.node.snapshot();
    assert_eq!(snapshot.evictions, 1, "{snapshot:?}");
    assert_eq!(b.node.snapshot().drops.get(DropReason::MalformedStream), 1);
    for n in [a, b] {
        n.node.close().await;
    }
}

/// A bare iroh endpoint speaking the actor ALPN, whose streams accept at most 1 KiB before
/// it reads: the test drives it by hand to put a node's write on a chosen connection.
async fn raw_peer() -> tether::iroh::Endpoint {
    use tether::iroh::endpoint::{presets, QuicTransportConfig, VarInt};
    tether::iroh::Endpoint::builder(presets::Minimal)
        .secret_key(tether::iroh::SecretKey::generate())
        .relay_mode(tether::iroh::RelayMode::Disabled)
        .alpns(vec![tether::node::ACTOR_ALPN.to_vec()])
        .transport_config(
            QuicTransportConfig::builder()
                .stream_receive_window(VarInt::from_u32(1024))
                .build(),
        )
        .bind_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("loopback")
        .bind()
        .await
        .expect("bind")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_of_a_replaced_generation_is_stale_and_evicts_nothing() {
    use tether_core::wire::actor::ActorDecoder;
    use tether_core::wire::StreamDecoder;

    let a = node().await;
    let raw = raw_peer().await;
    let raw_id = node_id_of(&raw.id());
    let raw_key = hex(&raw_id);
    let mut addr = tether::iroh::EndpointAddr::new(raw.id());
    for socket in raw.bound_sockets() {
        addr = addr.with_ip_addr(socket);
    }
    let frame = |payload: Bytes| OutFrame {
        to: raw_id,
        dest: APP_ACTOR,
        type_tag: "Chat".into(),
        payload,
    };

    // Generation 1: a dials the raw peer.
    let (connected, accepted) = tokio::join!(a.node.connect(addr), async {
        raw.accept()
            .await
            .expect("incoming")
            .accept()
            .expect("accept")
            .await
            .expect("first connection")
    });
    connected.expect("connect");
    let first_conn = accepted;
    let first = a.node.snapshot().cache[&raw_key];
    // A 64 KiB record cannot fit the 1 KiB the peer accepts unread: once the stream shows up,
    // a's writer is committed to generation 1 and waits inside that write.
    a.node.send(frame(Bytes::from(vec![7u8; 64 * 1024])));
    let _stalled = first_conn
        .accept_uni()
        .await
        .expect("a's stream on generation 1");

    // Generation 2: the peer dials a, which caches that connection in place of the first.
    let second_conn = raw
        .connect(a.node.endpoint_addr(), tether::node::ACTOR_ALPN)
        .await
        .expect("second connection");
    until_changed(&a.node, || {
        a.node.snapshot().cache.get(&raw_key) == Some(&(first + 1))
    })
    .await;

    // The first connection dies under the waiting write: a failure of generation 1, which is
    // no longer the cached one.
    first_conn.close(0u32.into(), b"replaced");
    until_changed(&a.node, || a.node.snapshot().stale_failures == 1).await;
    let snapshot = a.node.snapshot();
    assert_eq!(snapshot.evictions, 0, "{snapshot:?}");
    assert_eq!(snapshot.cache[&raw_key], first + 1, "generation 2 stays");
    assert_eq!(
        snapshot.drops.get(DropReason::WriteFailed),
        1,
        "the stalled frame"
    );

    // Frames flow on generation 2.
    a.node.send(frame(Bytes::from_static(b"next")));
    let mut recv = second_conn
        .accept_uni()
        .await
        .expect("a's stream on generation 2");
    let mut decoder = StreamDecoder::new(ActorDecoder::default());
    let record = loop {
        if let Some(record) = decoder.pop().expect("well-formed") {
            break record;
        }
        let chunk = recv.read_chunk(1024).await.expect("read").expect("open");
        decoder.push_bytes(chunk);
    };
    assert_eq!((record.tag(), record.payload()), ("Chat", &b"next"[..]));
    a.node.close().await;
    raw.close().await;
}

/// Hosts a second actor from inside a delivery: a bridge may call back into the node.
struct HostOnDelivery {
    node: std::sync::OnceLock<Node>,
    delivered: mpsc::UnboundedSender<ActorAddr>,
}

impl ActorBridge for HostOnDelivery {
    fn deliver_raw(&self, dest: ActorAddr, _: &str, _: Bytes) -> Result<(), DeliveryError> {
        if let Some(node) = self.node.get() {
            node.host(OTHER_ACTOR);
        }
        self.delivered
            .send(dest)
            .map_err(|_| DeliveryError("test ended".into()))
    }

    fn send_failed(&self, _: NodeId) {}
}

const OTHER_ACTOR: ActorAddr = ActorAddr::new([0xB2; 32]);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridge_may_change_the_routes_from_inside_a_delivery() {
    let a = node().await;
    let (delivered, mut deliveries) = mpsc::unbounded_channel();
    let bridge = Arc::new(HostOnDelivery {
        node: std::sync::OnceLock::new(),
        delivered,
    });
    let b = Node::builder()
        .bridge(bridge.clone())
        .know_tag("Chat")
        .host(APP_ACTOR)
        .bind()
        .await
        .expect("b");
    bridge.node.set(b.clone()).expect("set once");
    a.node.connect(b.endpoint_addr()).await.expect("connect");
    let to_actor = |dest| OutFrame {
        to: b.node_id(),
        dest,
        type_tag: "Chat".into(),
        payload: Bytes::from_static(b"x"),
    };
    a.node.send(to_actor(APP_ACTOR));
    assert_eq!(deliveries.recv().await, Some(APP_ACTOR));
    // The delivery above hosted OTHER_ACTOR; frames to it now arrive.
    a.node.send(to_actor(OTHER_ACTOR));
    assert_eq!(deliveries.recv().await, Some(OTHER_ACTOR));
    assert_eq!(b.snapshot().drops.get(DropReason::NotLocal), 0);
    a.node.close().await;
    b.close().await;
}

/// Unhosting an actor takes effect for the frames read after it, on a stream already
/// flowing: the reader keeps its snapshot of the tables only while they are unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_unhosted_mid_stream_gets_no_more_frames() {
    let a = node().await;
    let (delivered, mut deliveries) = mpsc::unbounded_channel();
    let bridge = Arc::new(HostOnDelivery {
        node: std::sync::OnceLock::new(),
        delivered,
    });
    let b = Node::builder()
        .bridge(bridge.clone())
        .know_tag("Chat")
        .host(APP_ACTOR)
        .host(OTHER_ACTOR)
        .bind()
        .await
        .expect("b");
    a.node.connect(b.endpoint_addr()).await.expect("connect");
    let to_actor = |dest| OutFrame {
        to: b.node_id(),
        dest,
        type_tag: "Chat".into(),
        payload: Bytes::from_static(b"x"),
    };
    for _ in 0..3 {
        a.node.send(to_actor(APP_ACTOR));
        assert_eq!(deliveries.recv().await, Some(APP_ACTOR));
    }
    b.unhost(&APP_ACTOR);
    // The same stream: the frame to the unhosted actor is read before the one after it.
    a.node.send(to_actor(APP_ACTOR));
    a.node.send(to_actor(OTHER_ACTOR));
    assert_eq!(deliveries.recv().await, Some(OTHER_ACTOR));
    assert_eq!(b.snapshot().drops.get(DropReason::NotLocal), 1);
    a.node.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_that_never_connects_fails_at_the_machines_timeout_and_the_next_dials_afresh() {
    use std::time::Duration;
    use tether::node::{DialTimedOut, NodeError, WaitedDialFailed};
    let timeout = Duration::from_millis(300);
    let a = node_with(|b| b.dial_timeout(timeout)).await;
    // A black hole: a socket that takes every datagram and answers none.
    let hole = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    let key = tether::iroh::SecretKey::generate().public();
    let addr = tether::iroh::EndpointAddr::new(key).with_ip_addr(hole.local_addr().expect("addr"));
    let cause = |result: Result<(), NodeError>| match result {
        Err(NodeError::Connect(source)) => source,
        other => panic!("a dial into a black hole cannot succeed: {other:?}"),
    };
    // The first connect dials; the second waits on that dial and fails with it.
    let (first, second) = tokio::join!(a.node.connect(addr.clone()), async {
        tokio::task::yield_now().await;
        a.node.connect(addr.clone()).await
    });
    let first = cause(first);
    assert!(
        first.downcast_ref::<DialTimedOut>() == Some(&DialTimedOut(timeout)),
        "{first}"
    );
    let second = cause(second);
    assert!(
        second.downcast_ref::<DialTimedOut>().is_some()
            || second.downcast_ref::<WaitedDialFailed>().is_some(),
        "{second}"
    );
    // Nothing of the failed dial is left in flight: the next connect dials afresh (and times
    // out again) instead of waiting forever on a dial that ended.
    let again = cause(a.node.connect(addr).await);
    assert!(again.downcast_ref::<DialTimedOut>().is_some(), "{again}");
    assert!(a.node.snapshot().connections.is_empty());
    a.node.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_connects_but_never_lets_a_stream_open_holds_an_open_only_until_its_deadline() {
    use std::time::Duration;
    use tether::iroh::endpoint::{presets, QuicTransportConfig, VarInt};
    use tether::node::{NodeError, OpenTimedOut, SWITCH_ALPN};
    // The attacker: completes the QUIC handshake on the switch ALPN, then grants no
    // bidirectional stream, ever.
    let stingy = tether::iroh::Endpoint::builder(presets::Minimal)
        .secret_key(tether::iroh::SecretKey::generate())
        .relay_mode(tether::iroh::RelayMode::Disabled)
        .alpns(vec![SWITCH_ALPN.to_vec()])
        .transport_config(
            QuicTransportConfig::builder()
                .max_concurrent_bidi_streams(VarInt::from_u32(0))
                .build(),
        )
        .bind_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("loopback")
        .bind()
        .await
        .expect("bind");
    let accepting = stingy.clone();
    let held = tokio::spawn(async move {
        let conn = accepting
            .accept()
            .await
            .expect("incoming")
            .await
            .expect("handshake");
        // Keep the connection open (never closed, never granting a stream).
        conn.closed().await
    });
    let addr = tether::iroh::EndpointAddr::new(stingy.id()).with_ip_addr(
        *stingy
            .bound_sockets()
            .iter()
            .find(|a| a.is_ipv4())
            .expect("ipv4 socket"),
    );
    let timeout = Duration::from_millis(300);
    let a = node_with(|b| b.dial_timeout(timeout)).await;
    // A fresh connection: it connects, and its stream never opens.
    match a.node.dial_switch_host(addr.clone()).await {
        Err(NodeError::Connect(source)) => assert!(
            source.downcast_ref::<OpenTimedOut>() == Some(&OpenTimedOut(timeout)),
            "{source}"
        ),
        other => panic!("a stream the peer never grants cannot open: {other:?}"),
    }
    // That connection was judged dead and left the cache: the next open dials afresh rather
    // than queueing on it.
    assert!(
        a.node.snapshot().connections.is_empty(),
        "{:?}",
        a.node.snapshot().connections
    );
    a.node.close().await;
    stingy.close().await;
    held.abort();
}
