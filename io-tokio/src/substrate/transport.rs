//! The boundary between the substrate shell and a network: dial a peer, accept links, one
//! ordered byte stream per link. [`TcpTransport`] is here; the simulator implements it over
//! turmoil and the iroh driver over QUIC, so all of them run the same shell.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use tether_core::driver::admission::Handshakes;
use tether_core::substrate::handshake::Channel;
use tether_core::substrate::PeerId;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tracing::warn;

/// A boxed future, as the transport methods return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// An ordered, reliable byte stream of one link.
pub trait LinkStream: AsyncRead + AsyncWrite + Send + Unpin + Any {}

impl<S: AsyncRead + AsyncWrite + Send + Unpin + Any> LinkStream for S {}

/// How a bound link's frames are written.
pub(crate) enum LinkWriter {
    /// A QUIC stream: it queues owned chunks as they are, so bodies go by reference.
    #[cfg(feature = "iroh")]
    Quic {
        send: iroh::endpoint::SendStream,
        /// Held while the stream is written (the streams keep the connection too).
        _conn: iroh::endpoint::Connection,
    },
    /// Any other stream: chunks are written as bytes.
    Stream(tokio::io::WriteHalf<Box<dyn LinkStream>>),
}

impl LinkWriter {
    /// The smallest body worth a chunk of its own on this writer:
    /// [`tether_core::limits::SUBSTRATE_BODY_BY_REFERENCE_MIN_BYTES`] on QUIC, none elsewhere
    /// (a byte stream would take each chunk with a write of its own).
    pub(crate) fn by_reference(&self) -> usize {
        match self {
            #[cfg(feature = "iroh")]
            Self::Quic { .. } => tether_core::limits::SUBSTRATE_BODY_BY_REFERENCE_MIN_BYTES,
            Self::Stream(_) => usize::MAX,
        }
    }

    /// Writes `chunks` in order, whole.
    pub(crate) async fn write_chunks(&mut self, chunks: &mut [Bytes]) -> io::Result<()> {
        match self {
            #[cfg(feature = "iroh")]
            Self::Quic { send, .. } => send.write_all_chunks(chunks).await.map_err(Into::into),
            Self::Stream(stream) => {
                for chunk in chunks.iter() {
                    stream.write_all(chunk).await?;
                }
                Ok(())
            }
        }
    }

    /// Ends the stream after what was written.
    pub(crate) async fn shutdown(&mut self) {
        match self {
            #[cfg(feature = "iroh")]
            Self::Quic { send, .. } => {
                let _ = send.finish();
            }
            Self::Stream(stream) => {
                let _ = stream.shutdown().await;
            }
        }
    }
}

/// Splits a link's stream into its reading half and its [`LinkWriter`]: a QUIC stream into
/// its own halves, any other through `tokio::io::split`.
pub(crate) fn halves(
    stream: Box<dyn LinkStream>,
) -> (Box<dyn AsyncRead + Send + Unpin>, LinkWriter) {
    #[cfg(feature = "iroh")]
    if (&*stream as &dyn Any).is::<crate::node::QuicStream>() {
        let stream: Box<dyn Any> = stream;
        let quic = stream
            .downcast::<crate::node::QuicStream>()
            .expect("the type was just checked");
        let (conn, send, recv) = quic.into_parts();
        return (Box::new(recv), LinkWriter::Quic { send, _conn: conn });
    }
    let (read, write) = tokio::io::split(stream);
    (Box::new(read), LinkWriter::Stream(write))
}

/// One established link: its byte stream and what the handshake binds it to.
pub struct Link {
    /// The byte stream.
    pub stream: Box<dyn LinkStream>,
    /// Connection id and channel-binding bytes for the handshake proof.
    pub channel: Channel,
    /// Where an inbound link came from (its IP address), when the transport knows: the
    /// source whose share of the handshake slots it counts against.
    pub source: Option<IpAddr>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("channel", &self.channel)
            .finish_non_exhaustive()
    }
}

/// How the shell reaches peers.
pub trait Transport: Send + Sync + 'static {
    /// Whether this side knows how to reach `peer` (the side that does dials and redials; the
    /// other side waits for the peer's links).
    fn can_dial(&self, peer: &PeerId) -> bool;

    /// Opens a link to `peer`; `nonce` is fresh randomness for the connection id.
    fn dial<'a>(&'a self, peer: &'a PeerId, nonce: [u8; 16]) -> BoxFuture<'a, io::Result<Link>>;

    /// The next inbound link and the peer it claims to be (the handshake proves it).
    fn accept(&self) -> BoxFuture<'_, io::Result<(PeerId, Link)>>;
}

use tether_core::substrate::preamble::{
    self, decode_preamble, encode_preamble, preamble_len, CONN_NONCE_BYTES, PREAMBLE_HEAD_BYTES,
};

/// Writes the dialer's preamble (core's [`tether_core::substrate::preamble`]) and returns the
/// link's channel: the connection id binds both peer ids and the nonce, so a shared-key proof
/// also proves the claimed identities. Plain streams have no channel-binding bytes.
pub async fn write_preamble<S: AsyncWrite + Unpin>(
    stream: &mut S,
    local: &PeerId,
    remote: &PeerId,
    nonce: [u8; CONN_NONCE_BYTES],
) -> io::Result<Channel> {
    let mut bytes = Vec::new();
    encode_preamble(local.as_str(), &nonce, &mut bytes)
        .map_err(|error| io::Error::new(io::ErrorKind::InvalidInput, error))?;
    stream.write_all(&bytes).await?;
    stream.flush().await?;
    Ok(preamble::channel(local.as_str(), remote.as_str(), &nonce))
}

/// Writes the dialer's preamble on a freshly connected `stream` and makes it a link.
pub async fn dialed_link<S: LinkStream>(
    mut stream: S,
    local: &PeerId,
    remote: &PeerId,
    nonce: [u8; CONN_NONCE_BYTES],
) -> io::Result<Link> {
    let channel = write_preamble(&mut stream, local, remote, nonce).await?;
    Ok(Link {
        stream: Box::new(stream),
        channel,
        source: None,
    })
}

/// Reads a dialer's preamble (exactly its bytes, at most
/// [`tether_core::substrate::preamble::PREAMBLE_BYTES_MAX`]); returns who it claims to be and
/// the link's channel.
pub async fn read_preamble<S: AsyncRead + Unpin>(
    stream: &mut S,
    local: &PeerId,
) -> io::Result<(PeerId, Channel)> {
    let invalid = |error| io::Error::new(io::ErrorKind::InvalidData, error);
    let mut head = [0u8; PREAMBLE_HEAD_BYTES];
    stream.read_exact(&mut head).await?;
    let mut bytes = vec![0u8; preamble_len(&head).map_err(invalid)?];
    bytes[..PREAMBLE_HEAD_BYTES].copy_from_slice(&head);
    stream.read_exact(&mut bytes[PREAMBLE_HEAD_BYTES..]).await?;
    let (preamble, _) = decode_preamble(&bytes)
        .map_err(invalid)?
        .expect("every byte its head announced is here");
    let remote = PeerId::new(preamble.dialer);
    let channel = preamble::channel(remote.as_str(), local.as_str(), &preamble.nonce);
    Ok((remote, channel))
}

/// Inbound links waiting for [`Transport::accept`].
pub struct AcceptQueue {
    rx: tokio::sync::Mutex<mpsc::Receiver<(PeerId, Link)>>,
}

impl std::fmt::Debug for AcceptQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AcceptQueue")
    }
}

impl AcceptQueue {
    /// A queue and the sender that fills it.
    pub fn new(capacity: usize) -> (mpsc::Sender<(PeerId, Link)>, Self) {
        let (tx, rx) = mpsc::channel(capacity);
        let queue = Self {
            rx: tokio::sync::Mutex::new(rx),
        };
        (tx, queue)
    }

    /// The next inbound link (what [`Transport::accept`] returns).
    pub async fn next(&self) -> io::Result<(PeerId, Link)> {
        self.rx
            .lock()
            .await
            .recv()
            .await
            .ok_or_else(|| io::Error::new(io::ErrorKind::BrokenPipe, "listener stopped"))
    }
}

/// Runs an accept loop over `accept` (a listener's accept: a stream and the IP address it came
/// from, if known) in a task: each new stream's preamble is read in a task of its own, within
/// 5 s, so a slow or silent client never holds up others; at most
/// [`tether_core::limits::PREAMBLE_READS_IN_PROGRESS_MAX`] at once, at most a quarter of them
/// from one source (core's `Handshakes`), past which a stream is closed unread. Identified
/// links go to the returned queue. An accept that fails (a connection aborted before it was
/// taken, the process out of descriptors) is logged and the loop goes on, after a pause that
/// doubles while failures repeat (at most 1 s).
pub fn serve_preamble_links<S, A, F>(local: PeerId, mut accept: A) -> AcceptQueue
where
    S: LinkStream,
    A: FnMut() -> F + Send + 'static,
    F: Future<Output = io::Result<(S, Option<IpAddr>)>> + Send,
{
    let (tx, queue) = AcceptQueue::new(64);
    let reading = Arc::new(Mutex::new(Handshakes::new(
        tether_core::limits::PREAMBLE_READS_IN_PROGRESS_MAX,
    )));
    tokio::spawn(async move {
        let mut pause = ACCEPT_PAUSE_MIN;
        loop {
            let accepted = accept().await;
            if tx.is_closed() {
                break;
            }
            let (mut stream, source) = match accepted {
                Ok(accepted) => {
                    pause = ACCEPT_PAUSE_MIN;
                    accepted
                }
                Err(error) => {
                    warn!(%error, "accepting a substrate connection failed; going on");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(ACCEPT_PAUSE_MAX);
                    continue;
                }
            };
            let admitted = reading
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .begin_from(source);
            if !admitted {
                // Closed unread: no task, nothing kept.
                continue;
            }
            let (tx, local, reading) = (tx.clone(), local.clone(), reading.clone());
            tokio::spawn(async move {
                // The slot is given back however the task ends.
                let _slot = ReadSlot(reading, source);
                let identified = tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    read_preamble(&mut stream, &local),
                )
                .await;
                if let Ok(Ok((peer, channel))) = identified {
                    let link = Link {
                        stream: Box::new(stream),
                        channel,
                        source,
                    };
                    let _ = tx.send((peer, link)).await;
                }
            });
        }
    });
    queue
}

/// The first pause after a failed accept, and the longest.
const ACCEPT_PAUSE_MIN: std::time::Duration = std::time::Duration::from_millis(5);
const ACCEPT_PAUSE_MAX: std::time::Duration = std::time::Duration::from_secs(1);

/// A preamble-reading slot, given back when its task ends.
struct ReadSlot(Arc<Mutex<Handshakes>>, Option<IpAddr>);

impl Drop for ReadSlot {
    fn drop(&mut self) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .end_from(self.1);
    }
}

/// Links over TCP with the tether preamble. It has no channel binding: use `shared-key`
/// authentication (or `none`, explicitly) with it.
#[derive(Clone)]
pub struct TcpTransport {
    local: PeerId,
    local_addr: SocketAddr,
    peers: Arc<Mutex<HashMap<PeerId, SocketAddr>>>,
    inbound: Arc<AcceptQueue>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("local", &self.local)
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

impl TcpTransport {
    /// Listens on `addr` (e.g. `127.0.0.1:0`) as `local`. Inbound preambles are read in a task
    /// per connection, so a slow or silent client never holds up others.
    pub async fn bind(local: PeerId, addr: SocketAddr) -> io::Result<Self> {
        let listener = Arc::new(TcpListener::bind(addr).await?);
        let local_addr = listener.local_addr()?;
        let inbound = serve_preamble_links(local.clone(), move || {
            let listener = listener.clone();
            async move {
                let (stream, from) = listener.accept().await?;
                stream.set_nodelay(true)?;
                Ok((stream, Some(from.ip())))
            }
        });
        Ok(Self {
            local,
            local_addr,
            peers: Arc::default(),
            inbound: Arc::new(inbound),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Records where `peer` listens; this side then dials it.
    pub fn add_peer(&self, peer: PeerId, addr: SocketAddr) {
        self.peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(peer, addr);
    }

    fn addr_of(&self, peer: &PeerId) -> Option<SocketAddr> {
        self.peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(peer)
            .copied()
    }
}

impl Transport for TcpTransport {
    fn can_dial(&self, peer: &PeerId) -> bool {
        self.addr_of(peer).is_some()
    }

    fn dial<'a>(&'a self, peer: &'a PeerId, nonce: [u8; 16]) -> BoxFuture<'a, io::Result<Link>> {
        Box::pin(async move {
            let addr = self
                .addr_of(peer)
                .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address for peer"))?;
            let stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            dialed_link(stream, &self.local, peer, nonce).await
        })
    }

    fn accept(&self) -> BoxFuture<'_, io::Result<(PeerId, Link)>> {
        Box::pin(self.inbound.next())
    }
}
