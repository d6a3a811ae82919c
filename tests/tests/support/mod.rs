//! Shared by the test files that drive iroh by hand (`mod support;`).

use tether::iroh::endpoint::presets;
use tether::iroh::{Endpoint, EndpointAddr, RelayMode, SecretKey};

/// Serves `receiver`'s inbound side as the tests' peer application does: accepts every open,
/// consumes every message (handing `(peer, body)` to the returned channel), answers every
/// request with `re:<body>`.
#[allow(dead_code)] // Not every file that shares this module runs a substrate.
pub(crate) fn serve_receiver(
    receiver: &tether::substrate::Substrate,
) -> tokio::sync::mpsc::UnboundedReceiver<(tether::substrate::PeerId, bytes::Bytes)> {
    use tether::substrate::Inbound;
    let (seen_tx, seen) = tokio::sync::mpsc::unbounded_channel();
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
    seen
}

/// A bare iroh endpoint on 127.0.0.1 with a fresh key and relays off: a peer the test
/// drives by hand.
#[allow(dead_code)] // Not every file that shares this module drives a bare endpoint.
pub(crate) async fn loopback_endpoint() -> Endpoint {
    Endpoint::builder(presets::Minimal)
        .secret_key(SecretKey::generate())
        .relay_mode(RelayMode::Disabled)
        .bind_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("addr")
        .bind()
        .await
        .expect("bind")
}

/// How to reach `endpoint` directly: its id and every socket it bound.
#[allow(dead_code)] // Not every file that shares this module dials a bare endpoint.
pub(crate) fn direct_addr(endpoint: &Endpoint) -> EndpointAddr {
    endpoint
        .bound_sockets()
        .into_iter()
        .fold(EndpointAddr::new(endpoint.id()), EndpointAddr::with_ip_addr)
}
