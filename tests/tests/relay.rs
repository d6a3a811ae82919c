//! tether through a real relay: iroh's own relay server (the `iroh-relay` crate's, started
//! here on 127.0.0.1 over plain HTTP), two nodes homed on it, and a node that knows its peer
//! by id and relay alone, with no socket address. The substrate's queue and session work, and
//! the relay counts the packets it carried.

use std::net::Ipv4Addr;
use std::time::Duration;

use iroh_relay::server::{RelayConfig, Server, ServerConfig};
use tether::iroh::EndpointAddr;
use tether::node::{Node, RelayMode, RelayUrl};
use tether::substrate::{AllowAll, Auth, Authorizer, Inbound, Substrate};
use tokio::sync::mpsc;

/// Every wait here has this deadline: a relay on this machine answers in milliseconds.
const DEADLINE: Duration = Duration::from_secs(30);

/// iroh's relay server on 127.0.0.1 (an unused port), over HTTP, and its URL.
async fn local_relay() -> (Server, RelayUrl) {
    let mut config = ServerConfig::default();
    config.relay = Some(RelayConfig::new((Ipv4Addr::LOCALHOST, 0)));
    let server = Server::spawn(config).await.expect("the relay starts");
    let addr = server.http_addr().expect("serves HTTP");
    let url: RelayUrl = format!("http://{addr}").parse().expect("a relay URL");
    (server, url)
}

async fn homed_node(relay: &RelayUrl) -> Node {
    let node = Node::builder()
        .substrate()
        .relay_mode(RelayMode::custom([relay.clone()]))
        .bind()
        .await
        .expect("bind");
    tokio::time::timeout(DEADLINE, node.online())
        .await
        .expect("homed on the local relay");
    node
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_reach_each_other_through_a_real_relay_knowing_only_its_url() {
    let (relay, url) = local_relay().await;
    let (node_a, node_b) = tokio::join!(homed_node(&url), homed_node(&url));
    assert_eq!(node_a.home_relay_url().as_ref(), Some(&url));
    let addr_b = node_b.endpoint_addr();
    assert_eq!(
        addr_b.relay_urls().collect::<Vec<_>>(),
        [&url],
        "a node's address carries its home relay"
    );

    // A knows B by id and relay only: no socket address at all.
    let relay_only = EndpointAddr::new(addr_b.id).with_relay_url(url.clone());
    assert_eq!(relay_only.ip_addrs().count(), 0);
    let transport_a = node_a.substrate_transport().expect("substrate enabled");
    let transport_b = node_b.substrate_transport().expect("substrate enabled");
    let bob = transport_a.add_peer(relay_only).expect("allowed");
    let alice = transport_a.local().clone();

    let receiver = Substrate::builder(transport_b.local().clone(), transport_b)
        .auth(Auth::TransportIdentity)
        .authorize(Authorizer::new(AllowAll))
        .start()
        .expect("start b");
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let mut inbound = receiver.inbound().expect("inbound");
    tokio::spawn(async move {
        while let Some(item) = inbound.recv().await {
            match item {
                Inbound::Open(open) => open.accept().await.expect("accept"),
                Inbound::Message(message) => {
                    let _ = seen_tx.send((message.peer.clone(), message.body.clone()));
                    message.done();
                }
                Inbound::Request(request) => {
                    let mut answer = b"re:".to_vec();
                    answer.extend_from_slice(&request.body);
                    request.end(answer).await.expect("answer");
                }
                _ => {}
            }
        }
    });
    let sender = Substrate::builder(alice.clone(), transport_a)
        .auth(Auth::TransportIdentity)
        .authorize(Authorizer::new(AllowAll))
        .start()
        .expect("start a");
    let peer = sender.peer(&bob);
    let work = async {
        let queue = peer.open_queue("jobs").await.expect("open queue");
        let acks: Vec<_> = (0..100u32)
            .map(|n| queue.send(n.to_be_bytes().to_vec()))
            .collect();
        for ack in acks {
            ack.await.expect("durable at b");
        }
        for n in 0..100u32 {
            let (from, body) = seen.recv().await.expect("delivered");
            assert_eq!(from, alice);
            assert_eq!(&body[..], &n.to_be_bytes()[..], "exactly once, in order");
        }
        let session = peer.open_session("rpc").await.expect("open session");
        let reply = session.req(b"ping".to_vec()).await.expect("answered");
        assert_eq!(reply.end.as_deref(), Some(&b"re:ping"[..]));
    };
    tokio::time::timeout(DEADLINE, work)
        .await
        .expect("the substrate works through the relay");

    // The first packets between them could only go through the relay.
    let metrics = &relay.metrics().server;
    assert!(
        metrics.send_packets_sent.get() > 0 && metrics.bytes_sent.get() > 0,
        "the relay carried packets: {} sent, {} bytes",
        metrics.send_packets_sent.get(),
        metrics.bytes_sent.get()
    );
    sender.shutdown().await;
    receiver.shutdown().await;
    node_a.close().await;
    node_b.close().await;
    relay.shutdown().await.expect("the relay stops");
}
