//! The substrate over iroh: [`IrohTransport`] implements the shell's
//! [`crate::substrate::Transport`] on a [`super::Node`]'s endpoint, so the same shell that runs
//! over TCP and the simulator runs over QUIC.
//!
//! One link is one bidirectional stream on the connection the node caches for the peer under
//! [`SUBSTRATE_ALPN`], whichever side dialed it: a link that ends leaves the connection for
//! the next one, and a dead connection is evicted by generation as every cached one is. The
//! peer id is the remote endpoint key as TLS authenticated it (hex), and the channel binding
//! is TLS keying material both ends export, so `Auth::TransportIdentity` proves the handshake
//! ran over this very QUIC connection.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};

use iroh::endpoint::{Connection, RecvStream, SendStream};
use iroh::{EndpointAddr, PublicKey};
use tether_core::driver::machine::Channel as DriverChannel;
use tether_core::driver::{Direction, NodeId, Path};
use tether_core::substrate::handshake::Channel;
use tether_core::substrate::PeerId;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;

use super::{Gate, Inner, NodeError};
use crate::substrate::transport::{AcceptQueue, BoxFuture};
use crate::substrate::{Link, Transport};

/// The ALPN of substrate links.
pub const SUBSTRATE_ALPN: &[u8] = b"tether/substrate/1";
/// Label of the exported keying material used as channel binding.
const BINDING_LABEL: &[u8] = b"tether substrate channel binding";

/// The substrate's links over a node's endpoint.
pub struct IrohTransport {
    /// The node whose cached connections carry the links (gone once the node is dropped).
    node: Weak<Inner>,
    gate: Arc<Gate>,
    local: PeerId,
    peers: SubstratePeers,
    inbound: AcceptQueue,
}

/// How to reach each substrate peer: shared by the transport and its node.
pub(super) type SubstratePeers = Arc<super::peer_book::SharedBook>;

impl std::fmt::Debug for IrohTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IrohTransport")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

/// The node id the driver uses for an iroh endpoint: its public key's bytes.
pub fn node_id_of(key: &PublicKey) -> NodeId {
    NodeId::new(*key.as_bytes())
}

/// The peer id the substrate uses for an iroh node: its key in lowercase hex.
pub fn peer_id_of(key: &PublicKey) -> PeerId {
    PeerId::new(node_id_of(key).to_string())
}

impl IrohTransport {
    pub(super) fn new(
        node: Weak<Inner>,
        local: PeerId,
        gate: Arc<Gate>,
        peers: SubstratePeers,
    ) -> (Self, mpsc::Sender<(PeerId, Link)>) {
        let (tx, inbound) = AcceptQueue::new(64);
        let transport = Self {
            node,
            gate,
            local,
            peers,
            inbound,
        };
        (transport, tx)
    }

    /// This node's substrate peer id.
    pub fn local(&self) -> &PeerId {
        &self.local
    }

    /// Records how to reach a peer; this side then dials it. A peer off the node's allow-list
    /// is refused (counted under `substrate/outbound`) and not recorded.
    pub fn add_peer(&self, addr: EndpointAddr) -> Result<PeerId, NodeError> {
        add_peer(&self.gate, &self.peers, addr)
    }

    fn addr_of(&self, peer: &PeerId) -> Option<EndpointAddr> {
        self.peers.with(|book| book.addr_of(peer))
    }
}

/// Records how to reach a substrate peer, if the allow-list admits it.
pub(super) fn add_peer(
    gate: &Gate,
    peers: &SubstratePeers,
    addr: EndpointAddr,
) -> Result<PeerId, NodeError> {
    gate.admit(&node_id_of(&addr.id), Path::Substrate, Direction::Outbound)?;
    let peer = peer_id_of(&addr.id);
    if peers.with(|book| book.add(addr)) {
        if let Err(error) = peers.persist() {
            // The address is in use now; only its copy for after a restart is missing.
            tracing::warn!(%error, "peer book not written");
        }
    }
    Ok(peer)
}

/// The channel of a connection: both ids in dialer-then-listener order, and exported keying
/// material.
fn channel(conn: &Connection, dialer: &PeerId, listener: &PeerId) -> io::Result<Channel> {
    let mut binding = vec![0u8; 32];
    conn.export_keying_material(&mut binding, BINDING_LABEL, b"")
        .map_err(|_| io::Error::other("cannot export keying material"))?;
    let mut conn_id = Vec::new();
    for part in [dialer.as_str().as_bytes(), listener.as_str().as_bytes()] {
        conn_id.extend_from_slice(&(part.len() as u32).to_be_bytes());
        conn_id.extend_from_slice(part);
    }
    Ok(Channel { conn_id, binding })
}

/// A link on `conn`: a stream `dialer` opened to `listener` (either may have dialed the
/// connection itself).
pub(super) fn link(
    conn: &Connection,
    send: SendStream,
    recv: RecvStream,
    dialer: &PeerId,
    listener: &PeerId,
) -> io::Result<Link> {
    Ok(Link {
        channel: channel(conn, dialer, listener)?,
        // The node's QUIC accept loop counted the connection against its source already.
        source: None,
        stream: Box::new(QuicStream::new(conn.clone(), send, recv)),
    })
}

impl Transport for IrohTransport {
    fn can_dial(&self, peer: &PeerId) -> bool {
        self.addr_of(peer).is_some()
    }

    fn dial<'a>(&'a self, peer: &'a PeerId, _nonce: [u8; 16]) -> BoxFuture<'a, io::Result<Link>> {
        Box::pin(async move {
            let addr = self
                .addr_of(peer)
                .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address for peer"))?;
            let node = self
                .node
                .upgrade()
                .ok_or_else(|| io::Error::new(io::ErrorKind::BrokenPipe, "node dropped"))?;
            let (conn, send, recv, _) = node
                .open_bi_cached(addr, DriverChannel::Substrate, SUBSTRATE_ALPN)
                .await
                .map_err(io::Error::other)?;
            link(&conn, send, recv, &self.local, peer)
        })
    }

    fn accept(&self) -> BoxFuture<'_, io::Result<(PeerId, Link)>> {
        Box::pin(self.inbound.next())
    }
}

/// One bidirectional QUIC stream as a byte stream, on a connection the node caches. Dropping
/// it finishes what it sent and stops what it did not read (the QUIC halves' own drops); the
/// connection stays for the next stream (the node closes it, or evicts it once it dies).
/// Substrate links and switch connections over iroh are these.
pub struct QuicStream {
    conn: Connection,
    send: SendStream,
    recv: RecvStream,
    /// Reports `conn` unresponsive (streams this node opened).
    cut: Option<super::ConnectionCut>,
}

impl std::fmt::Debug for QuicStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicStream")
            .field("remote", &self.conn.remote_id())
            .finish_non_exhaustive()
    }
}

impl QuicStream {
    pub(super) fn new(conn: Connection, send: SendStream, recv: RecvStream) -> Self {
        Self {
            conn,
            send,
            recv,
            cut: None,
        }
    }

    pub(super) fn with_cut(mut self, cut: super::ConnectionCut) -> Self {
        self.cut = Some(cut);
        self
    }

    /// The handle that reports the connection under this stream unresponsive (evicted and
    /// closed, so the next stream dials afresh); `None` for a stream the peer opened.
    pub fn connection_cut(&self) -> Option<super::ConnectionCut> {
        self.cut.clone()
    }

    /// The connection and the stream's halves (the substrate's writer queues owned chunks on
    /// the send half).
    pub(crate) fn into_parts(self) -> (Connection, SendStream, RecvStream) {
        (self.conn, self.send, self.recv)
    }

    /// The receive half (the rest is dropped: the send half finishes).
    pub(super) fn into_recv(self) -> RecvStream {
        self.recv
    }
}

impl AsyncRead for QuicStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        AsyncRead::poll_read(Pin::new(&mut self.recv), cx, buf)
    }
}

impl AsyncWrite for QuicStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        AsyncWrite::poll_write(Pin::new(&mut self.send), cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_flush(Pin::new(&mut self.send), cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        AsyncWrite::poll_shutdown(Pin::new(&mut self.send), cx)
    }
}
