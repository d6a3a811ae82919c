//! Shared by the test files that drive iroh by hand (`mod support;`).

use tether::iroh::endpoint::presets;
use tether::iroh::{Endpoint, RelayMode, SecretKey};

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
