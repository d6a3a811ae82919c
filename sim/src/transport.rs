//! The shell's [`Transport`] over turmoil's simulated TCP, with the same preamble as
//! [`tether::substrate::TcpTransport`].

use std::collections::BTreeMap;
use std::io;

use std::sync::Arc;

use tether::substrate::transport::{dialed_link, serve_preamble_links, AcceptQueue, BoxFuture};
use tether::substrate::{Link, PeerId, Transport};

/// The port every simulated node listens on.
pub const PORT: u16 = 7000;

/// Links between simulated hosts; a peer's id is its turmoil host name.
pub struct SimTransport {
    local: PeerId,
    dials: BTreeMap<PeerId, String>,
    inbound: AcceptQueue,
}

impl std::fmt::Debug for SimTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimTransport")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl SimTransport {
    /// Listens on [`PORT`] of this host as `local`, dialing the peers in `dials`.
    pub async fn bind(local: PeerId, dials: &[PeerId]) -> io::Result<Self> {
        let listener = Arc::new(turmoil::net::TcpListener::bind(("0.0.0.0", PORT)).await?);
        let inbound = serve_preamble_links(local.clone(), move || {
            let listener = listener.clone();
            async move {
                listener
                    .accept()
                    .await
                    .map(|(stream, from)| (stream, Some(from.ip())))
            }
        });
        Ok(Self {
            local,
            dials: dials
                .iter()
                .map(|peer| (peer.clone(), peer.as_str().to_owned()))
                .collect(),
            inbound,
        })
    }
}

impl Transport for SimTransport {
    fn can_dial(&self, peer: &PeerId) -> bool {
        self.dials.contains_key(peer)
    }

    fn dial<'a>(&'a self, peer: &'a PeerId, nonce: [u8; 16]) -> BoxFuture<'a, io::Result<Link>> {
        Box::pin(async move {
            let host = self
                .dials
                .get(peer)
                .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "unknown host"))?;
            let connect = turmoil::net::TcpStream::connect((host.as_str(), PORT));
            let stream = tokio::time::timeout(std::time::Duration::from_secs(5), connect)
                .await
                .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
            dialed_link(stream, &self.local, peer, nonce).await
        })
    }

    fn accept(&self) -> BoxFuture<'_, io::Result<(PeerId, Link)>> {
        Box::pin(self.inbound.next())
    }
}
