//! Shared by the test files that drive iroh by hand (`mod support;`).

use tether::iroh::endpoint::presets;
use tether::iroh::{Endpoint, EndpointAddr, RelayMode, SecretKey};

/// A bare iroh endpoint on 127.0.0.1 with a fresh key and relays off: a peer the test
/// drives by hand.
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
