//! tether-benches: criterion benchmarks, each reported beside a baseline measured in the same
//! run (`cargo bench -p tether-benches`).

use iroh::endpoint::presets;
use iroh::{Endpoint, EndpointAddr, RelayMode, SecretKey};

/// A bare iroh endpoint on 127.0.0.1 (no relay, no discovery) accepting `alpn`: the raw
/// baseline the benchmarks put tether beside.
pub async fn loopback_endpoint(alpn: &[u8]) -> Endpoint {
    Endpoint::builder(presets::Minimal)
        .secret_key(SecretKey::generate())
        .relay_mode(RelayMode::Disabled)
        .alpns(vec![alpn.to_vec()])
        .bind_addr(std::net::SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("a loopback address")
        .bind()
        .await
        .expect("bind")
}

/// Where `endpoint` can be dialed directly (its bound sockets, no relay).
pub fn direct_addr(endpoint: &Endpoint) -> EndpointAddr {
    endpoint
        .bound_sockets()
        .into_iter()
        .fold(EndpointAddr::new(endpoint.id()), EndpointAddr::with_ip_addr)
}
