//! A node's per-peer egress over real iroh on 127.0.0.1: a peer's queue and writer go away
//! after sitting idle (a node talking to many short-lived peers keeps memory for the live
//! ones), and a queue that cannot drain holds its bound and counts what it drops.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tether::node::{ActorBridge, DeliveryError, Node, OutFrame};
use tether_core::driver::DropReason;
use tether_core::limits::EGRESS_RUN_FRAMES_MAX;
use tokio::sync::mpsc;

const APP: tether::node::ActorAddr = tether::node::ActorAddr::new([0xA1; 32]);

struct Collect(mpsc::UnboundedSender<Bytes>);

impl ActorBridge for Collect {
    fn deliver_raw(
        &self,
        _: tether::node::ActorAddr,
        _: &str,
        payload: Bytes,
    ) -> Result<(), DeliveryError> {
        self.0
            .send(payload)
            .map_err(|_| DeliveryError("test ended".into()))
    }
}

/// A node hosting `APP`, and what is delivered to it.
async fn receiver() -> (Node, mpsc::UnboundedReceiver<Bytes>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let node = Node::builder()
        .bridge(Arc::new(Collect(tx)))
        .know_tag("Chat")
        .host(APP)
        .bind()
        .await
        .expect("bind");
    (node, rx)
}

fn chat(to: &Node, n: u32) -> OutFrame {
    OutFrame {
        to: to.node_id(),
        dest: APP,
        type_tag: "Chat".into(),
        payload: Bytes::copy_from_slice(&n.to_be_bytes()),
    }
}

/// Waits (on the node's events) until no peer has a queue, then checks that `queues` were
/// started and retired, and every frame was written.
async fn all_idle(sender: &Node, queues: u64) {
    sender
        .egress_peers()
        .wait_for(|live| *live == 0)
        .await
        .expect("alive");
    let snapshot = sender.snapshot();
    assert_eq!(snapshot.egress_queues_started, queues);
    assert_eq!(snapshot.egress_queues_retired, queues);
    assert_eq!(snapshot.frames_written, queues, "one frame per queue");
    assert!(snapshot.drops.0.is_empty(), "{:?}", snapshot.drops);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_peers_give_back_their_queues_and_a_later_frame_makes_a_new_one() {
    let sender = Node::builder()
        .idle_peer_timeout(Duration::from_millis(20))
        .bind()
        .await
        .expect("bind");
    let mut peers = Vec::new();
    for _ in 0..6 {
        let (node, delivered) = receiver().await;
        sender.connect(node.endpoint_addr()).await.expect("connect");
        peers.push((node, delivered));
    }
    for (n, (node, delivered)) in peers.iter_mut().enumerate() {
        sender.send(chat(node, n as u32));
        assert_eq!(
            delivered.recv().await.expect("delivered"),
            &(n as u32).to_be_bytes()[..]
        );
    }
    // Every writer goes idle and gives its queue back.
    all_idle(&sender, 6).await;
    // The next frame for a peer starts a new queue and arrives.
    let (node, delivered) = &mut peers[0];
    sender.send(chat(node, 99));
    assert_eq!(
        delivered.recv().await.expect("delivered"),
        &99u32.to_be_bytes()[..]
    );
    all_idle(&sender, 7).await;
    sender.close().await;
    for (node, _) in peers {
        node.close().await;
    }
}

/// A sender connected to `node` whose egress queue holds one ring slot and four spilled frames.
async fn tight_sender(node: &Node) -> Node {
    let sender = Node::builder()
        .egress_ring(1)
        .egress_spill(4)
        .bind()
        .await
        .expect("bind");
    sender.connect(node.endpoint_addr()).await.expect("connect");
    sender
}

/// Frames `0..count` (as `chat` numbers them) are delivered, in order.
async fn arrive_in_order(delivered: &mut mpsc::UnboundedReceiver<Bytes>, count: u32) {
    for n in 0..count {
        assert_eq!(
            delivered.recv().await.expect("delivered"),
            &n.to_be_bytes()[..]
        );
    }
}

/// One thread: the burst below runs before the peer's writer can take anything.
#[tokio::test]
async fn a_full_egress_queue_drops_past_its_bound_and_counts_it() {
    let (node, mut delivered) = receiver().await;
    let sender = tight_sender(&node).await;
    for n in 0..100 {
        sender.send(chat(&node, n));
    }
    let snapshot = sender.snapshot();
    assert_eq!(
        snapshot.frames_enqueued, 5,
        "a ring of 1 and a spillover of 4"
    );
    assert_eq!(snapshot.drops.get(DropReason::EgressFull), 95);
    // What was queued arrives, in order.
    arrive_in_order(&mut delivered, 5).await;
    sender.close().await;
    node.close().await;
}

/// One thread, as above. A batch hands its frames over in runs, one ring slot per run of up to
/// `EGRESS_RUN_FRAMES_MAX`; a run the ring has no room for is unpacked and spills frame by
/// frame, so the spillover's bound holds in frames and what passes it is counted per frame.
#[tokio::test]
async fn a_batch_fills_the_ring_by_runs_and_spills_past_it_frame_by_frame() {
    let (node, mut delivered) = receiver().await;
    let sender = tight_sender(&node).await;
    let run = EGRESS_RUN_FRAMES_MAX as u32;
    sender.send_batch((0..3 * run).map(|n| chat(&node, n)));
    let queued = run + 4;
    let snapshot = sender.snapshot();
    assert_eq!(
        snapshot.frames_enqueued,
        u64::from(queued),
        "one run in the ring's slot, four frames spilled"
    );
    assert_eq!(
        snapshot.drops.get(DropReason::EgressFull),
        u64::from(3 * run - queued)
    );
    arrive_in_order(&mut delivered, queued).await;
    sender.close().await;
    node.close().await;
}

/// One thread, as above. Large frames fill the spillover's bytes before its frames: past
/// `EGRESS_SPILL_BYTES_MAX` a frame is dropped and counted, whatever room is left in frames.
#[tokio::test]
async fn a_spillover_full_of_bytes_drops_past_its_bound_and_counts_it() {
    let (node, mut delivered) = receiver().await;
    let sender = Node::builder()
        .egress_ring(1)
        .egress_spill(10_000)
        .bind()
        .await
        .expect("bind");
    sender.connect(node.endpoint_addr()).await.expect("connect");
    const PAYLOAD: usize = 1_000_000;
    let fit = tether_core::limits::EGRESS_SPILL_BYTES_MAX / (PAYLOAD + 64 + "Chat".len());
    let sent = fit as u32 + 20;
    for n in 0..sent {
        let mut payload = vec![0u8; PAYLOAD];
        payload[..4].copy_from_slice(&n.to_be_bytes());
        let mut frame = chat(&node, n);
        frame.payload = Bytes::from(payload);
        sender.send(frame);
    }
    let snapshot = sender.snapshot();
    // One in the ring; the spillover holds what fits in its bytes (each frame's payload, tag
    // and bookkeeping), about `fit`.
    let queued = snapshot.frames_enqueued;
    assert!(
        (fit as u64 - 2..=fit as u64 + 2).contains(&queued),
        "{queued} queued, about {fit} fit"
    );
    assert_eq!(
        snapshot.drops.get(DropReason::EgressFull),
        u64::from(sent) - queued
    );
    for n in 0..queued as u32 {
        let payload = delivered.recv().await.expect("delivered");
        assert_eq!(&payload[..4], &n.to_be_bytes()[..]);
    }
    sender.close().await;
    node.close().await;
}
