//! The substrate shell over iroh: the same shell as over TCP and in the simulator, with
//! `transport-identity` auth bound to the QUIC connection's keying material.

use crate::support;

use tether::node::Node;
use tether::substrate::{AllowAll, Auth, Authorizer, Substrate};

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
    let session = peer.open_session("rpc").await.expect("open session");
    let reply = session.req(b"ping".to_vec()).await.expect("answered");
    assert_eq!(reply.end.as_deref(), Some(&b"re:ping"[..]));

    sender.shutdown().await;
    receiver.shutdown().await;
    node_a.close().await;
    node_b.close().await;
}
