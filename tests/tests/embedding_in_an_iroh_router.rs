//! tether mounted on an application's own iroh `Router`, beside another protocol on the same
//! endpoint: the router accepts, tether's admission and ALPN dispatch decide; the substrate
//! over that node comes from one call; closing the node leaves the application's endpoint and
//! its other protocol running.

use std::sync::Arc;

use bytes::Bytes;
use tether::iroh::endpoint::Connection;
use tether::iroh::protocol::{AcceptError, ProtocolHandler, Router};
use tether::iroh::Endpoint;
use tether::node::{node_id_of, ActorBridge, DeliveryError, Node, NodeError, OutFrame};
use tether::substrate::{AllowAll, Authorizer, Inbound};
use tokio::sync::mpsc;

use crate::support;

const ECHO_ALPN: &[u8] = b"app/echo/1";
const ACTOR: tether::node::ActorAddr = tether::node::ActorAddr::new([0xE1; 32]);

/// The application's own protocol: echoes one bidirectional stream.
#[derive(Debug, Clone)]
struct Echo;

impl ProtocolHandler for Echo {
    async fn accept(&self, connection: Connection) -> Result<(), AcceptError> {
        let (mut send, mut recv) = connection.accept_bi().await?;
        let body = recv
            .read_to_end(1024)
            .await
            .map_err(AcceptError::from_err)?;
        send.write_all(&body).await.map_err(AcceptError::from_err)?;
        send.finish()?;
        connection.closed().await;
        Ok(())
    }
}

async fn echo(from: &Endpoint, to: &Endpoint, text: &[u8]) -> Vec<u8> {
    let conn = from
        .connect(loopback_addr(to), ECHO_ALPN)
        .await
        .expect("echo connect");
    let (mut send, mut recv) = conn.open_bi().await.expect("bi");
    send.write_all(text).await.expect("write");
    send.finish().expect("finish");
    let answer = recv.read_to_end(1024).await.expect("read");
    conn.close(0u32.into(), b"done");
    answer
}

fn loopback_addr(endpoint: &Endpoint) -> tether::iroh::EndpointAddr {
    endpoint.bound_sockets().into_iter().fold(
        tether::iroh::EndpointAddr::new(endpoint.id()),
        |addr, mut socket| {
            if socket.ip().is_unspecified() {
                socket.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
            }
            addr.with_ip_addr(socket)
        },
    )
}

async fn app_endpoint() -> Endpoint {
    support::loopback_endpoint().await
}

struct Frames(mpsc::UnboundedSender<Bytes>);

impl ActorBridge for Frames {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tether_shares_an_application_router_and_endpoint() {
    // The application: its endpoint, its echo protocol, and tether mounted beside it.
    let endpoint = app_endpoint().await;
    let (frames_tx, mut frames) = mpsc::unbounded_channel();
    let embedded = Node::builder()
        .endpoint(endpoint.clone())
        .substrate()
        .bridge(Arc::new(Frames(frames_tx)))
        .know_tag("Note")
        .host(ACTOR)
        .bind()
        .await
        .expect("node on the application's endpoint");
    assert_eq!(
        embedded.node_id(),
        node_id_of(&endpoint.id()),
        "one identity"
    );
    let router = embedded
        .mount(Router::builder(endpoint.clone()))
        .accept(ECHO_ALPN, Echo)
        .spawn();
    assert!(embedded
        .alpns()
        .contains(&tether::node::SUBSTRATE_ALPN.to_vec()));

    // A peer running tether on its own endpoint.
    let peer = Node::builder().substrate().bind().await.expect("peer");

    // Actor frames both ways: inbound ones reach the embedded node through the router.
    peer.connect(loopback_addr(&endpoint))
        .await
        .expect("peer dials the router");
    for n in 0..50u32 {
        peer.send(OutFrame {
            to: embedded.node_id(),
            dest: ACTOR,
            type_tag: "Note".into(),
            payload: Bytes::from(n.to_be_bytes().to_vec()),
        });
    }
    for n in 0..50u32 {
        let payload = frames.recv().await.expect("delivered");
        assert_eq!(&payload[..], &n.to_be_bytes()[..], "in order, once");
    }

    // The substrate over each node in one call; the peer sends, the embedded node receives.
    let receiver = embedded
        .substrate_builder()
        .expect("substrate enabled")
        .authorize(Authorizer::new(AllowAll))
        .start()
        .expect("start");
    assert!(
        matches!(embedded.substrate_builder(), Err(NodeError::NoSubstrate)),
        "once"
    );
    let sender = peer
        .substrate_builder()
        .expect("substrate enabled")
        .authorize(Authorizer::new(AllowAll))
        .start()
        .expect("start");
    let mut inbound = receiver.inbound().expect("inbound");
    let to = peer
        .add_substrate_peer(loopback_addr(&endpoint))
        .expect("allowed");
    let peer_handle = sender.peer(&to);
    let (queue_tx, mut bodies) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(item) = inbound.recv().await {
            match item {
                Inbound::Open(open) => open.accept().await.expect("accept"),
                Inbound::Message(message) => {
                    let _ = queue_tx.send(message.body.clone());
                    message.done();
                }
                _ => {}
            }
        }
    });
    let queue = peer_handle
        .open_queue("jobs")
        .await
        .expect("open over the router");
    for n in 0..100u32 {
        queue
            .send(n.to_be_bytes().to_vec())
            .await
            .expect("durable at the embedded node");
    }
    for n in 0..100u32 {
        let body = bodies.recv().await.expect("delivered");
        assert_eq!(&body[..], &n.to_be_bytes()[..], "exactly once, in order");
    }

    // The application's protocol shares the endpoint throughout.
    let client = app_endpoint().await;
    assert_eq!(echo(&client, &endpoint, b"hello").await, b"hello");

    // Closing tether ends its work and leaves the application's endpoint and echo running.
    sender.shutdown().await;
    receiver.shutdown().await;
    embedded.close().await;
    assert_eq!(embedded.tasks_running(), 0);
    assert_eq!(echo(&client, &endpoint, b"still here").await, b"still here");

    router.shutdown().await.expect("router shutdown");
    peer.close().await;
    client.close().await;
}
