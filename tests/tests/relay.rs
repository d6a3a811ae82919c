//! tether through a real relay: iroh's own relay server (the `iroh-relay` crate's, started
//! here on 127.0.0.1 over plain HTTP), two nodes homed on it, and a node that knows its peer
//! by id and relay alone, with no socket address. The substrate's queue and session work, and
//! the relay counts the packets it carried.

use crate::support;

use std::net::Ipv4Addr;
use std::time::Duration;

use iroh_relay::server::{RelayConfig, Server, ServerConfig};
use tether::iroh::EndpointAddr;
use tether::node::{Node, RelayMode, RelayUrl};
use tether::substrate::{AllowAll, Auth, Authorizer, Substrate};
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
    let mut seen = support::serve_receiver(&receiver);
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

/// The command line: `tether relay` serves iroh's relay, two `tether node --relay URL` home
/// on it, each prints an iroh endpoint ticket carrying the relay, and a node given a ticket
/// with the relay alone (no socket address) sends a durable message through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tether_nodes_home_on_tether_relay_and_talk_through_it() {
    use iroh_tickets::endpoint::EndpointTicket;
    use tether_tests::procs::{next, NodeProc};

    let tether = std::path::Path::new(env!("CARGO_BIN_EXE_tether-under-test"));
    let dir = std::env::temp_dir().join(format!("tether-relay-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let mut relay =
        NodeProc::spawn_wrapped(&[], tether, "relay", "relay", 1, &[], events_tx.clone())
            .expect("tether relay starts");
    let event = next(&mut events, "the relay's URL").await;
    assert_eq!(event.kind(), "relay", "{:?}", event.value);
    let url = event.text("url");
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");

    let data = |who: &str| dir.join(who).display().to_string();
    let a_args = vec![
        "--data".to_owned(),
        data("a"),
        "--relay".into(),
        url.clone(),
    ];
    let a = NodeProc::spawn(tether, "a", 1, &a_args, events_tx.clone()).expect("node a starts");
    let ticket: EndpointTicket = ready(&mut events).await.parse().expect("an iroh ticket");
    let addr = ticket.endpoint_addr();
    assert_eq!(
        addr.relay_urls()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        [format!("{url}/")],
        "the ticket carries the node's home relay"
    );
    assert!(addr.ip_addrs().count() >= 1, "and its sockets");

    let relay_url: RelayUrl = url.parse().expect("a relay URL");
    let relay_only = EndpointTicket::new(EndpointAddr::new(addr.id).with_relay_url(relay_url));
    let b_args = vec![
        "--data".to_owned(),
        data("b"),
        "--relay".into(),
        url.clone(),
        "--connect".into(),
        relay_only.to_string(),
    ];
    let mut b = NodeProc::spawn(tether, "b", 1, &b_args, events_tx.clone()).expect("node b starts");
    ready(&mut events).await;
    b.write("open queue q\nsend q hello-through-the-relay\n")
        .await
        .expect("commands");
    let (mut acked, mut delivered) = (false, false);
    while !(acked && delivered) {
        let event = next(&mut events, "the message and its ack").await;
        match (event.from, event.kind()) {
            ("b", "acked") => acked = true,
            ("a", "message") => {
                assert_eq!(event.text("body"), "hello-through-the-relay");
                delivered = true;
            }
            (_, "error") => panic!("{:?}", event.value),
            _ => {}
        }
    }
    a.quit().await;
    b.quit().await;
    relay.kill().await.expect("the relay stops");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The ticket of the next node that says it is ready.
async fn ready(events: &mut mpsc::UnboundedReceiver<tether_tests::procs::Event>) -> String {
    loop {
        let event = tether_tests::procs::next(events, "a node ready").await;
        if event.kind() == "ready" {
            return event.text("ticket");
        }
    }
}
