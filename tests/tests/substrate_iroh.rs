//! The substrate shell over iroh: the same shell as over TCP and in the simulator, with
//! `transport-identity` auth bound to the QUIC connection's keying material.

use crate::support;

use tether::node::Node;
use tether::substrate::{AllowAll, Auth, Authorizer, Substrate};
use tether_core::limits::{ENVELOPE_INLINE_BODY_BYTES_MAX, SUBSTRATE_BODY_BY_REFERENCE_MIN_BYTES};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_and_sessions_over_iroh_with_transport_identity() {
    let node_a = Node::builder().substrate().bind().await.expect("bind a");
    let node_b = Node::builder().substrate().bind().await.expect("bind b");
    let transport_a = node_a.substrate_transport().expect("substrate enabled");
    let transport_b = node_b.substrate_transport().expect("substrate enabled");
    assert!(node_a.substrate_transport().is_none(), "taken once");
    let bob = transport_a
        .add_peer(node_b.endpoint_addr())
        .expect("allowed");
    let (alice_id, bob_id) = (transport_a.local().clone(), transport_b.local().clone());
    assert_eq!(&bob, &bob_id);

    let receiver = Substrate::builder(bob_id.clone(), transport_b)
        .auth(Auth::TransportIdentity)
        .authorize(Authorizer::new(AllowAll))
        .start()
        .expect("start b");
    let mut seen = support::serve_receiver(&receiver);
    let sender = Substrate::builder(alice_id.clone(), transport_a)
        .auth(Auth::TransportIdentity)
        .authorize(Authorizer::new(AllowAll))
        .start()
        .expect("start a");

    let peer = sender.peer(&bob);
    let queue = peer.open_queue("jobs").await.expect("open queue");
    let acks: Vec<_> = (0..200u32)
        .map(|n| queue.send(n.to_be_bytes().to_vec()))
        .collect();
    for ack in acks {
        ack.await.expect("durable at b");
    }
    for n in 0..200u32 {
        let (from, body) = seen.recv().await.expect("delivered");
        assert_eq!(from, alice_id, "the peer id is the TLS-authenticated key");
        assert_eq!(&body[..], &n.to_be_bytes()[..], "exactly once, in order");
    }
    // Bodies from the threshold up go to the QUIC stream by reference, as chunks of their
    // own between the frames' heads; smaller ones are copied in. Both kinds, interleaved and
    // up to the largest inline body, arrive byte for byte and in order.
    let sizes = [
        0,
        1,
        SUBSTRATE_BODY_BY_REFERENCE_MIN_BYTES - 1,
        SUBSTRATE_BODY_BY_REFERENCE_MIN_BYTES,
        SUBSTRATE_BODY_BY_REFERENCE_MIN_BYTES + 1,
        4096,
        ENVELOPE_INLINE_BODY_BYTES_MAX,
    ];
    let bodies: Vec<Vec<u8>> = (0..3usize)
        .flat_map(|round| sizes.map(move |size| (round, size)))
        .map(|(round, size)| {
            (0..size)
                .map(|i| (i * 7 + round * 13 + size) as u8)
                .collect()
        })
        .collect();
    let acks: Vec<_> = bodies.iter().map(|body| queue.send(body.clone())).collect();
    for ack in acks {
        ack.await.expect("durable at b");
    }
    for body in &bodies {
        let (_, got) = seen.recv().await.expect("delivered");
        assert_eq!(got.len(), body.len());
        assert!(
            got[..] == body[..],
            "a body of {} bytes arrives intact",
            body.len()
        );
    }

    let session = peer.open_session("rpc").await.expect("open session");
    let reply = session.req(b"ping".to_vec()).await.expect("answered");
    assert_eq!(reply.end.as_deref(), Some(&b"re:ping"[..]));

    sender.shutdown().await;
    receiver.shutdown().await;
    node_a.close().await;
    node_b.close().await;
}
