//! tether inside an application that already runs iroh: the application's endpoint and
//! `Router` carry its own protocol (an echo here, iroh-blobs or iroh-gossip in real life) and
//! tether's protocols beside it. tether admits and dispatches its own ALPNs; closing the node
//! ends tether's work and leaves the application's endpoint running.
//!
//! Run with `cargo run -p tether --example embed`.

use std::sync::Arc;

use tether::iroh::endpoint::{presets, Connection};
use tether::iroh::protocol::{AcceptError, ProtocolHandler, Router};
use tether::iroh::{Endpoint, EndpointAddr, RelayMode};
use tether::node::Node;
use tether::store::MemoryStore;
use tether::substrate::{AllowAll, Authorizer, Inbound};

const ECHO_ALPN: &[u8] = b"app/echo/1";

/// The application's own protocol.
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

/// Where an endpoint bound to 127.0.0.1 listens.
fn addr_of(endpoint: &Endpoint) -> EndpointAddr {
    endpoint
        .bound_sockets()
        .into_iter()
        .fold(EndpointAddr::new(endpoint.id()), EndpointAddr::with_ip_addr)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The application's endpoint (loopback only, no relay).
    let endpoint = Endpoint::builder(presets::Minimal)
        .relay_mode(RelayMode::Disabled)
        .bind_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))?
        .bind()
        .await?;
    // tether on it, mounted on the application's router beside the echo protocol.
    let node = Node::builder()
        .endpoint(endpoint.clone())
        .substrate()
        .bind()
        .await?;
    let router = node
        .mount(Router::builder(endpoint.clone()))
        .accept(ECHO_ALPN, Echo)
        .spawn();
    println!("one endpoint {} speaks:", endpoint.id().fmt_short());
    for alpn in node.alpns().iter().map(|a| a.as_slice()).chain([ECHO_ALPN]) {
        println!("  {}", String::from_utf8_lossy(alpn));
    }
    let receiver = node
        .substrate_builder()?
        .store(Arc::new(MemoryStore::default()))
        .authorize(Authorizer::new(AllowAll))
        .start()?;
    let mut inbound = receiver.inbound().expect("taken once");

    // A peer reaches the application's substrate through the router...
    let peer = Node::builder().substrate().bind().await?;
    let sender = peer
        .substrate_builder()?
        .authorize(Authorizer::new(AllowAll))
        .start()?;
    let to = peer.add_substrate_peer(addr_of(&endpoint))?;
    let to_app = sender.peer(&to);
    let queue = to_app.open_queue("jobs");
    let accept = async {
        while let Some(item) = inbound.recv().await {
            match item {
                Inbound::Open(open) => drop(open.accept().await),
                Inbound::Message(message) => {
                    println!("app: {}", String::from_utf8_lossy(&message.body));
                    message.done();
                    return;
                }
                _ => {}
            }
        }
    };
    let (queue, ()) = tokio::join!(
        async {
            let queue = queue.await?;
            queue.send("through the application's router").await?;
            Ok::<_, tether::substrate::Error>(queue)
        },
        accept
    );
    drop(queue?);

    // ...and the echo protocol answers on the same endpoint.
    let client = Endpoint::builder(presets::Minimal)
        .relay_mode(RelayMode::Disabled)
        .bind_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))?
        .bind()
        .await?;
    let conn = client.connect(addr_of(&endpoint), ECHO_ALPN).await?;
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(b"hello").await?;
    send.finish()?;
    println!(
        "echo: {}",
        String::from_utf8_lossy(&recv.read_to_end(1024).await?)
    );

    sender.shutdown().await;
    receiver.shutdown().await;
    peer.close().await;
    node.close().await; // tether's tasks end; the application's endpoint stays up
    router.shutdown().await?;
    client.close().await;
    Ok(())
}
