//! The iroh transport driver (docs/spec/driver.md): one endpoint per node, ALPN dispatch, a
//! connection cache with generation-scoped eviction, background dials and joins, and the actor
//! plane (a per-peer [`HybridChannel`] drained by one writer task per peer onto one long-lived
//! stream, and reader tasks decoding actor records from every inbound stream).
//!
//! Every decision is `tether_core::driver`'s; this module owns the endpoint, connections,
//! streams and tasks, and hands none of them to callers. [`Node::close`] stops all of it.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use tether::node::{node_id_of, ActorAddr, ActorBridge, DeliveryError, Node, OutFrame};
//!
//! struct Print;
//! impl ActorBridge for Print {
//!     fn deliver_raw(&self, dest: ActorAddr, tag: &str, body: bytes::Bytes) -> Result<(), DeliveryError> {
//!         println!("{tag}: {} bytes for {dest:?}", body.len());
//!         Ok(())
//!     }
//! }
//!
//! let node = Node::builder().bridge(Arc::new(Print)).know_tag("Chat").bind().await?;
//! let peer_addr = node.endpoint_addr(); // a real peer's address in practice
//! node.connect(peer_addr.clone()).await?;
//! let to = node_id_of(&peer_addr.id);
//! let dest = ActorAddr::mailbox(to); // the peer's mailbox
//! node.send(OutFrame { to, dest, type_tag: "Chat".into(), payload: "hi".into() });
//! node.close().await;
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;
use tether_core::limits::{NODE_READ_BLOCK_BYTES, NODE_READ_CHUNK_BYTES, NODE_WRITE_BATCH_BYTES};

use crossbeam_utils::CachePadded;

mod accepts;
mod builder;
mod dials;
mod egress;
mod executor;
mod ingress;
mod opens;
mod peer_book;
mod protocol;
mod publish;
pub mod ring;
mod substrate_link;
mod telemetry;

pub use builder::{quic_transport_config, JoinPolicy, NodeBuilder};
use egress::{BatchRun, Egress};

pub use opens::ConnectionCut;
use opens::Placed;
pub use peer_book::{PeerBookError, PeerBookErrorKind};

pub use protocol::{
    LogicalStream, ProtocolBinding, ProtocolIngress, StreamEvent, StreamFaultReason,
};
pub use substrate_link::{node_id_of, peer_id_of, IrohTransport, QuicStream, SUBSTRATE_ALPN};

/// The ALPN of request-switch connections: a switch opens one bidirectional stream to each
/// host (master) it attaches, on the connection cached for that host (dialed when there is
/// none), and writes the first HELLO on it.
pub const SWITCH_ALPN: &[u8] = b"tether/switch/1";

/// Switch streams a host node accepted (each is one switch-to-host connection of the switch
/// protocol; a switch node's streams share the QUIC connection cached for it): the dialling
/// switch's node id (hex) and the stream to serve (`tether::switch::host::Host::serve`).
pub type SwitchConnections = tokio::sync::mpsc::Receiver<(String, QuicStream)>;
pub use telemetry::{
    TelemetryFault, TelemetryIngress, TelemetrySource, TELEMETRY_PUBLISHER_FRAMES,
};
pub use tether_core::limits::{PROTOCOL_SINK_EVENTS_DEFAULT, TELEMETRY_SINK_ITEMS_DEFAULT};

use bytes::{Bytes, BytesMut};
use iroh::endpoint::{presets, Connection, RecvStream, SendStream};
use iroh::{Endpoint, EndpointAddr, PublicKey, SecretKey};
pub use iroh::{RelayMode, RelayUrl};
use tether_core::channel::{HybridChannel, Sender};
pub use tether_core::driver::machine::{
    CLOSE_FULL, CLOSE_REPLACED, CLOSE_SHUTDOWN, CLOSE_UNAUTHORIZED, CLOSE_UNRESPONSIVE,
};
use tether_core::driver::{
    Action, Alpns, Answer, ClaimAuthorizer, ClaimRequest, ClaimVerdict, ConnEvent, Control,
    ControlVerdict, DialEnd, DialFailure, DialTicket, Direction, Dispatch, Driver, DriverConfig,
    DriverRecord, DropReason, Drops, Generation, Handoff, HostClaim, Inbound, JoinStatus, Open,
    Path, PeerAuth, PeerBook, Publisher, Refusals, Refused, RouteMemo, Routes, SendVerdict,
    StreamVerdict, HOST_CLAIM_TAG, TELEMETRY_CONTROL_TAG,
};
pub use tether_core::driver::{ActorAddr, Channel, NodeId};
use tether_core::limits::{
    ACTOR_PAYLOAD_BYTES_DEFAULT, ADDRESS_BOOK_PEERS_MAX, EGRESS_IDLE_TEARDOWN_MS_DEFAULT,
    EGRESS_RUN_FRAMES_MAX, EGRESS_SPILL_BYTES_MAX, EGRESS_SPILL_FRAMES_MAX,
};
use tether_core::time::Time;
use tether_core::wire::actor::{encode_record, ActorDecoder, ActorRecord};
use tether_core::wire::telemetry::Header;
use tether_core::wire::{FormatError, StreamDecoder};
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;
use tracing::{debug, info, warn, Instrument};

/// The actor-plane ALPN (carries SWIM gossip and directory-routed messages alike).
pub const ACTOR_ALPN: &[u8] = b"swactor/swim/1";
/// The telemetry ALPN.
pub const TELEMETRY_ALPN: &[u8] = b"swactor/telemetry/1";

/// One actor frame to send: to peer `to`, for actor `dest`, typed `type_tag`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutFrame {
    /// The destination peer's node id.
    pub to: NodeId,
    /// The actor address carried on the wire (a peer mailbox for gossip).
    pub dest: ActorAddr,
    /// Selects the actor codec entry (a static tag costs no allocation).
    pub type_tag: std::borrow::Cow<'static, str>,
    /// The encoded message.
    pub payload: Bytes,
}

/// Why the actor runtime refused a delivery.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("delivery failed: {0}")]
pub struct DeliveryError(pub String);

/// Where inbound actor records go, and where SWIM write failures are reported.
pub trait ActorBridge: Send + Sync + 'static {
    /// Delivers one record to local actor `dest`.
    fn deliver_raw(
        &self,
        dest: ActorAddr,
        type_tag: &str,
        payload: Bytes,
    ) -> Result<(), DeliveryError>;

    /// A write of a SWIM-tagged frame to `to` failed (`SwimIn::SendFailed { to }`).
    fn send_failed(&self, to: NodeId) {
        let _ = to;
    }
}

/// The underlying cause of a [`NodeError`] (iroh's error, kept for its source chain).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a node could not be built or a connection made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// The endpoint could not bind.
    #[error("bind failed")]
    Bind(#[source] BoxError),
    /// The peer is not on the allow-list (nothing was dialled).
    #[error("peer not allowed")]
    Unauthorized,
    /// The peer's id is not a valid public key.
    #[error("invalid node id")]
    InvalidNodeId,
    /// The connection could not be made, or its first stream not opened or written.
    #[error("connect failed")]
    Connect(#[source] BoxError),
    /// A stream failed after it was opened (a telemetry publisher's, for one).
    #[error("stream failed")]
    Stream(#[source] BoxError),
    /// No protocol binding of this node has that protocol id.
    #[error("no protocol binding {0:?}")]
    NoBinding(String),
    /// The node was built without [`NodeBuilder::substrate`], or its substrate was taken.
    #[error("substrate not enabled on this node, or already taken")]
    NoSubstrate,
    /// The node is closed.
    #[error("node closed")]
    Closed,
    /// A telemetry stream name that is empty or longer than
    /// `TELEMETRY_STREAM_NAME_BYTES_MAX` bytes.
    #[error("invalid telemetry stream name")]
    InvalidStreamName,
    /// No host claim names the actor.
    #[error("no route to the actor")]
    NoRoute,
    /// A host claim of this node was not registered.
    #[error("host claim not registered")]
    Register(#[source] tether_core::driver::machine::RegisterError),
    /// The peer book ([`NodeBuilder::peer_book`]) could not be read.
    #[error("peer book unreadable")]
    PeerBook(#[source] PeerBookError),
}

/// The source of a [`NodeError::Connect`] for an open that found another open's dial to the
/// same peer (on the same ALPN) in flight and waited on it, and that dial failed: concurrent
/// opens share one dial and its failure, rather than each dialing an unreachable peer in turn.
/// The next open dials afresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the dial this open waited on (another open's, to the same peer) failed")]
pub struct WaitedDialFailed;

/// A dial did not connect within the time the machine gave it
/// (`tether_core::driver::Config::dial_attempt_timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the dial did not connect within {0:?}")]
pub struct DialTimedOut(pub Duration);

/// A stream could not be opened on a connection within the time the machine gave it
/// (the peer connected but never let the stream open).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the stream did not open within {0:?}")]
pub struct OpenTimedOut(pub Duration);

impl From<Refused> for NodeError {
    fn from(_: Refused) -> Self {
        NodeError::Unauthorized
    }
}

/// One network path of a cached connection: through a relay or straight to an address.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PathView {
    /// The plane whose connection this is.
    pub channel: Channel,
    /// Through a relay (`true`) or to a socket address.
    pub relay: bool,
    /// The relay URL or the socket address.
    pub remote: String,
    /// Whether the connection sends on this path now.
    pub selected: bool,
    /// Its round-trip time estimate, in milliseconds.
    pub rtt_ms: f64,
}

/// Counters and cache state of a node (serde).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Snapshot {
    /// This node's id, hex.
    pub node_id: String,
    /// Actor frames accepted by [`Node::send`] into a peer queue.
    pub frames_enqueued: u64,
    /// Actor records written to streams.
    pub frames_written: u64,
    /// Actor records read from streams.
    pub frames_received: u64,
    /// Records delivered to the bridge.
    pub frames_delivered: u64,
    /// Drops by reason.
    pub drops: Drops,
    /// Connections accepted.
    pub accepted: u64,
    /// Inbound connections refused by the allow-list.
    pub refused: u64,
    /// Inbound connections refused because the node kept as many as it may
    /// ([`NodeBuilder::inbound_connections_max`]).
    pub refused_full: u64,
    /// Incoming connections refused before their handshake: as many handshakes as
    /// [`tether_core::limits::QUIC_HANDSHAKES_IN_PROGRESS_MAX`] were in progress.
    pub handshakes_refused: u64,
    /// Inbound handshakes in progress now.
    pub handshakes_in_progress: usize,
    /// Every refusal by the allow-list, by path and direction (`"switch/inbound": 1`).
    pub refusals: Refusals,
    /// Background dials started.
    pub dials_started: u64,
    /// Dial attempts that failed.
    pub dial_failures: u64,
    /// Current-generation evictions.
    pub evictions: u64,
    /// Failures of replaced generations, ignored.
    pub stale_failures: u64,
    /// Peer egress queues (and writers) started, one per peer each time it needs one.
    pub egress_queues_started: u64,
    /// Peer egress queues torn down after sitting idle.
    pub egress_queues_retired: u64,
    /// Cached actor-plane connections: peer (hex) → generation.
    pub cache: BTreeMap<String, u64>,
    /// Every cached connection, whatever its ALPN: (peer hex, channel, generation).
    pub connections: Vec<(String, Channel, u64)>,
}

/// Why a stream reader cannot go on.
#[derive(Debug, Clone, Copy)]
pub(super) enum Unreadable {
    /// What arrived does not decode.
    Malformed,
    /// Nothing consumes what arrives.
    Unread,
}

/// The machine's verdict on a stream of one peer and channel the shell cannot go on reading
/// ([`Inner::judge`]).
#[derive(Clone)]
pub(super) struct StreamJudge(Arc<dyn Fn(Unreadable) -> StreamVerdict + Send + Sync>);

impl StreamJudge {
    /// Asks the machine about `recv`, and stops it with the code the machine names.
    pub(super) fn stop(&self, recv: &mut RecvStream, why: Unreadable) {
        if let StreamVerdict::Stop(code) = (self.0)(why) {
            let _ = recv.stop(code.into());
        }
    }
}

/// The driver machine and the shell's address book.
struct State {
    driver: Driver<Connection>,
    /// The last address given for each peer (what a dial uses), at most
    /// [`ADDRESS_BOOK_PEERS_MAX`] peers.
    addrs: PeerBook<EndpointAddr>,
}

/// Counters of the data path, kept outside the machine's lock. Those bumped per frame sit on
/// their own cache lines (readers and writers run on different threads; shared lines would
/// bounce on every frame).
#[derive(Default)]
struct Counters {
    enqueued: CachePadded<AtomicU64>,
    written: CachePadded<AtomicU64>,
    received: CachePadded<AtomicU64>,
    delivered: CachePadded<AtomicU64>,
    queues_started: AtomicU64,
    queues_retired: AtomicU64,
}

struct Inner {
    switch_queue: Option<tokio::sync::mpsc::Sender<(String, QuicStream)>>,
    switch_connections: Mutex<Option<SwitchConnections>>,
    adapters: Vec<Arc<protocol::Adapter>>,
    telemetry_sinks: telemetry::Sinks,
    telemetry_alpn: Vec<u8>,
    substrate_transport: Mutex<Option<IrohTransport>>,
    /// How to reach substrate peers (shared with the transport).
    substrate_peers: substrate_link::SubstratePeers,
    /// Local telemetry streams collectors may subscribe to, by name.
    sources: Mutex<BTreeMap<String, TelemetrySource>>,
    substrate_queue:
        Option<tokio::sync::mpsc::Sender<(tether_core::substrate::PeerId, crate::substrate::Link)>>,
    endpoint: Endpoint,
    /// The endpoint is the application's (its router accepts; close leaves it open).
    embedded: bool,
    /// Every ALPN this node speaks.
    alpns: Vec<Vec<u8>>,
    local: NodeId,
    /// The driver machine (every decision), shared with the substrate transport.
    gate: Arc<Gate>,
    /// The routing tables, replaced copy-on-write: readers and writers take a snapshot per
    /// chunk or batch, so a bridge may change them from inside a delivery.
    routes: Mutex<Arc<Routes<ActorAddr>>>,
    /// Bumped after each change of `routes`: a reader or writer keeps its snapshot (and its
    /// route memo) until this moves, instead of taking the lock per chunk or batch.
    routes_version: AtomicU64,
    bridge: Option<Arc<dyn ActorBridge>>,
    payload_bytes_max: usize,
    batch_delay: Duration,
    egress_ring: usize,
    egress_spill: usize,
    /// How many peers have an egress queue and a writer now.
    egress_count: watch::Sender<usize>,
    /// The relays the node was configured with (none when relays are disabled).
    relay_urls: Vec<RelayUrl>,
    actor_alpn: Vec<u8>,
    /// Each peer's egress queue, created by its first frame; read by every `send`. On a
    /// cache line of its own: the lock word changes twice per lone send, and a neighbour that
    /// a writer or reader task touches would pull the line away from the producing thread.
    egress: CachePadded<RwLock<Egress>>,
    /// This node among the process's nodes, for the send cache of each thread.
    id: u64,
    counters: Counters,
    /// Inbound handshakes in progress, under their bound (core decides).
    handshakes: crate::handshakes::SharedHandshakes,
    tasks: Mutex<JoinSet<()>>,
    closed: watch::Sender<bool>,
}

/// A tether node on iroh. Cheap to clone; [`Node::close`] stops everything it started.
#[derive(Clone)]
pub struct Node {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.inner.local.to_string())
            .finish_non_exhaustive()
    }
}

/// Core's driver machine behind a lock, with what publishes its state: every input goes
/// through [`Gate::drive`], which returns the machine's answer and the actions it queued,
/// publishes refusals and changes, and re-arms the timer task when the next timeout moved.
pub(crate) struct Gate {
    state: Mutex<State>,
    refusals: watch::Sender<Refusals>,
    /// Bumped whenever the machine's state moves (see [`Node::changes`]).
    changes: watch::Sender<u64>,
    /// Wakes the timer task when the machine's next timeout moved.
    timer: Notify,
    started: std::time::Instant,
}

/// An address's relay URLs as text.
fn relay_strings(addr: &EndpointAddr) -> Vec<String> {
    addr.relay_urls().map(ToString::to_string).collect()
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl Node {
    /// Starts building a node.
    pub fn builder() -> NodeBuilder {
        NodeBuilder::default()
    }

    /// This node's id (its endpoint public key), which is also its mailbox address.
    pub fn node_id(&self) -> NodeId {
        self.inner.local
    }

    /// This node's address: its home relay (once it has one; see [`Node::online`]) and its
    /// bound socket addresses as direct addresses.
    pub fn endpoint_addr(&self) -> EndpointAddr {
        let mut addr = EndpointAddr::new(self.inner.endpoint.id());
        if let Some(relay) = self.home_relay_url() {
            addr = addr.with_relay_url(relay);
        }
        for socket in self.direct_addresses() {
            addr = addr.with_ip_addr(socket);
        }
        addr
    }

    /// Waits until this node is homed on one of its relays, so that its
    /// [`Node::endpoint_addr`] carries a relay others can reach it through. Returns at once
    /// when relays are disabled. It waits as long as no relay answers: bound it with a timeout
    /// where one may not.
    pub async fn online(&self) {
        if self.inner.relay_urls.is_empty() {
            return;
        }
        self.inner.endpoint.online().await;
    }

    /// The sockets the endpoint is bound to (unspecified addresses as loopback).
    pub fn direct_addresses(&self) -> Vec<SocketAddr> {
        self.inner
            .endpoint
            .bound_sockets()
            .into_iter()
            .map(|mut socket| {
                if socket.ip().is_unspecified() {
                    socket.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
                }
                socket
            })
            .collect()
    }

    /// The address the endpoint listens on (its first bound socket, an unspecified address
    /// given as loopback).
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        self.direct_addresses().into_iter().next()
    }

    /// The relay this node was configured with (the first of its relay map); `None` when
    /// relays are disabled (the default).
    pub fn relay_url(&self) -> Option<RelayUrl> {
        self.inner.relay_urls.first().cloned()
    }

    /// The relay this node is homed on now (what peers dialing through a relay use); `None`
    /// when relays are disabled or none is reachable yet.
    pub fn home_relay_url(&self) -> Option<RelayUrl> {
        self.inner.endpoint.addr().relay_urls().next().cloned()
    }

    /// Connects to `addr` now (awaitable; the actor plane dials in the background on its
    /// own). The connection is cached and its streams read. A peer with a cached connection
    /// keeps it (nothing is dialed; [`Node::disconnect`] first to replace it).
    pub async fn connect(&self, addr: EndpointAddr) -> Result<(), NodeError> {
        let peer = node_id_of(&addr.id);
        let ticket = match self
            .inner
            .open_verdict(peer, Path::Actor, Channel::Actor)
            .await?
        {
            Placed::Cached(..) => return Ok(()),
            Placed::Dial(ticket, timeout) => (ticket, timeout),
        };
        let addr = self.inner.normalized(addr);
        self.inner.remember(&addr);
        let (generation, conn) = self
            .inner
            .dial_cached(addr, &self.inner.actor_alpn, Channel::Actor, ticket)
            .await?;
        self.inner.adopt(peer, conn, Some(generation));
        Ok(())
    }

    /// Queues `frame` for its peer without blocking. With no cached connection the frame is
    /// dropped (counted) and a background dial starts (at most one per peer). A frame the wire
    /// cannot carry (a tag over [`tether_core::limits::ACTOR_TAG_BYTES_MAX`] bytes, or a payload
    /// over [`NodeBuilder::payload_bytes_max`]) is dropped here and counted as a failed write.
    pub fn send(&self, frame: OutFrame) {
        if self.inner.sendable(&frame) {
            self.inner.send(frame);
        }
    }

    /// Queues every frame as [`Node::send`] does, in order, without blocking: a run of
    /// consecutive frames for one peer takes the egress table once, is counted once, wakes its
    /// writer once, and goes into the ring in slots of up to
    /// [`tether_core::limits::EGRESS_RUN_FRAMES_MAX`] frames, one
    /// hand-off to the writer per slot (what an actor flushing its outbox wants). A run the
    /// ring has no room for spills frame by frame, as lone frames do.
    pub fn send_batch(&self, frames: impl IntoIterator<Item = OutFrame>) {
        // Fused: a caller's iterator is never asked again once it said it has no more.
        let mut frames = frames.into_iter().fuse();
        // The frame handed over and not yet queued: the next run starts with it.
        let mut held = None;
        loop {
            if held.is_none() {
                held = self.inner.next_sendable(&mut frames);
            }
            let Some(peer) = held.as_ref().map(|frame: &OutFrame| frame.to) else {
                return;
            };
            let mut run = BatchRun {
                peer,
                inner: &self.inner,
                frames: &mut frames,
                held: &mut held,
            };
            self.inner.send_run(peer, &mut run);
        }
    }

    /// Joins through `seeds`: for each, connect and write a `JoinRequest` to its mailbox, in
    /// the background with the join schedule. Never waits for convergence.
    /// A seed off the allow-list is refused (counted under `join/outbound`) and not tried.
    pub fn join(&self, seeds: Vec<EndpointAddr>) {
        for seed in seeds {
            let peer = node_id_of(&seed.id);
            let seed = self.inner.normalized(seed);
            let (relay, direct) = (seed.relay_urls().next().is_some(), seed.ip_addrs().count());
            let (joined, actions) = self.inner.gate.ask(
                |driver, now| driver.handle_join(now, peer, relay, direct),
                Answer::admitted,
            );
            // A seed the machine admitted is remembered before its attempts run (they dial
            // the address remembered); a refused one leaves no state.
            match joined {
                Ok(()) => self.inner.remember(&seed),
                Err(_) => warn!(seed = %peer, "join seed not allowed"),
            }
            for action in actions {
                self.inner.execute(action);
            }
        }
    }

    /// The status of every join, by seed id (hex).
    pub fn join_statuses(&self) -> BTreeMap<String, JoinStatus> {
        let state = self.inner.gate.lock();
        state
            .driver
            .join_statuses()
            .map(|(id, s)| (id.to_string(), s.clone()))
            .collect()
    }

    /// How many peers have an egress queue and a writer now (each torn down after
    /// [`NodeBuilder::idle_peer_timeout`] with nothing to write); changes as they come and go.
    pub fn egress_peers(&self) -> watch::Receiver<usize> {
        self.inner.egress_count.subscribe()
    }

    /// Changes whenever the node's connection state moves: a connection accepted, cached,
    /// found closed, evicted or dropped, a failure of an older generation, a dial started or
    /// failed, a join's status. Wait on it (then read [`Node::snapshot`] or
    /// [`Node::join_statuses`]) instead of polling.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.inner.gate.changes.subscribe()
    }

    /// Refusals by the allow-list so far, by path and direction; changes as they happen
    /// (`wait_for` on it to wait for one).
    pub fn refusals(&self) -> watch::Receiver<Refusals> {
        self.inner.gate.refusals.subscribe()
    }

    /// Hosts `actor` here and claims it: the node signs a host claim `(actor, this node,
    /// generation)` with its key and announces it to every peer it is connected to on the
    /// actor plane, now and on every later connection. A peer takes the claim when nobody
    /// holds the actor there, or this node does (a renewal at a higher generation); an actor
    /// another node holds moves here only with its handoff
    /// ([`Node::register_handed_off_actor`]) or the peer's claim authorizer (README "Actor
    /// ownership"). Refused when this node already claimed the actor at `generation` or
    /// higher, or the generation jumps past the bounds peers keep.
    pub fn register_actor(&self, actor: ActorAddr, generation: u64) -> Result<(), NodeError> {
        let secret = self.inner.endpoint.secret_key().to_bytes();
        self.register_claim(actor, HostClaim::sign(&secret, actor, generation))
    }

    /// Hosts `actor` here, moved from the node that held it: `handoff` is that node's consent
    /// ([`Node::hand_off_actor`] there) to this node at `generation`. Peers that hold the
    /// previous host's route take this node's claim.
    pub fn register_handed_off_actor(
        &self,
        actor: ActorAddr,
        generation: u64,
        handoff: Handoff,
    ) -> Result<(), NodeError> {
        let secret = self.inner.endpoint.secret_key().to_bytes();
        let claim = HostClaim::sign(&secret, actor, generation).with_handoff(handoff);
        self.register_claim(actor, claim)
    }

    fn register_claim(&self, actor: ActorAddr, claim: HostClaim) -> Result<(), NodeError> {
        self.inner
            .ask(
                |driver, now| driver.handle_register(now, claim),
                Answer::registered,
            )
            .map_err(NodeError::Register)?;
        self.host(actor);
        Ok(())
    }

    /// Consents that `actor`, hosted here, move to node `to` at `generation` (higher than
    /// this node's claim): returns the signed [`Handoff`] for `to` to register with
    /// ([`Node::register_handed_off_actor`]). This node stops hosting the actor at once: it
    /// announces no more claims for it, delivers no more records to it, and routes its frames
    /// to `to`.
    pub fn hand_off_actor(
        &self,
        actor: ActorAddr,
        to: NodeId,
        generation: u64,
    ) -> Result<Handoff, NodeError> {
        let secret = self.inner.endpoint.secret_key().to_bytes();
        let handoff = Handoff::sign(&secret, &actor, &to, generation);
        self.inner
            .ask(
                |driver, now| driver.handle_hand_off(now, actor, to, generation, handoff),
                Answer::registered,
            )
            .map_err(NodeError::Register)?;
        self.unhost(&actor);
        Ok(handoff)
    }

    /// Sends a frame to `actor`, hosted by whichever peer its newest host claim names (the
    /// route view, through the location cache), without naming the peer. A frame for an
    /// actor no claim names is dropped (counted as `no_route`).
    pub fn send_to_actor(
        &self,
        actor: ActorAddr,
        type_tag: impl Into<std::borrow::Cow<'static, str>>,
        payload: Bytes,
    ) -> Result<(), NodeError> {
        let to = self
            .inner
            .ask(
                |driver, now| driver.handle_send_to_actor(now, actor),
                Answer::route,
            )
            .map_err(|reason| match reason {
                DropReason::Unauthorized => NodeError::Unauthorized,
                _ => NodeError::NoRoute,
            })?;
        self.inner.send(OutFrame {
            to,
            dest: actor,
            type_tag: type_tag.into(),
            payload,
        });
        Ok(())
    }

    /// Actors in the route view (verified host claims, newest generation each).
    pub fn directory_route_count(&self) -> usize {
        self.inner.gate.lock().driver.directory_route_count()
    }

    /// Actor locations cached for the egress path.
    pub fn location_cache_entries(&self) -> usize {
        self.inner.gate.lock().driver.location_cache_entries()
    }

    /// Host claims received, by verdict (`accepted`, `stale`, `forged`, `full`, `relayed`,
    /// `held`, `jump`, `refused`).
    pub fn claim_verdicts(&self) -> BTreeMap<ClaimVerdict, u64> {
        self.inner.gate.lock().driver.claim_verdicts().clone()
    }

    /// Makes actor `actor` local (application frames to it are delivered).
    pub fn host(&self, actor: ActorAddr) {
        let mut routes = self
            .inner
            .routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Arc::make_mut(&mut routes).host(actor);
        self.inner.routes_version.fetch_add(1, Ordering::Release);
    }

    /// Makes actor `actor` not local any more (frames to it are dropped as `not_local`).
    pub fn unhost(&self, actor: &ActorAddr) {
        let mut routes = self
            .inner
            .routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Arc::make_mut(&mut routes).unhost(actor);
        self.inner.routes_version.fetch_add(1, Ordering::Release);
    }

    /// The network paths of every cached connection to `peer` (each plane's), as iroh
    /// sees them now: which go through a relay, which straight to an address, and which each
    /// connection sends on.
    pub fn paths(&self, peer: &NodeId) -> Vec<PathView> {
        let connections: Vec<(Channel, Connection)> = {
            let state = self.inner.gate.lock();
            state
                .driver
                .connections()
                .filter(|(cached, _, _)| cached == peer)
                .filter_map(|(_, channel, _)| {
                    state
                        .driver
                        .connection(peer, channel)
                        .map(|(_, conn)| (channel, conn))
                })
                .collect()
        };
        let mut views = Vec::new();
        for (channel, conn) in connections {
            for path in conn.paths().iter() {
                let remote = path.remote_addr();
                views.push(PathView {
                    channel,
                    relay: path.is_relay(),
                    remote: match remote {
                        iroh::TransportAddr::Ip(socket) => socket.to_string(),
                        iroh::TransportAddr::Relay(url) => url.to_string(),
                        other => format!("{other:?}"),
                    },
                    selected: path.is_selected(),
                    rtt_ms: path.rtt().as_secs_f64() * 1e3,
                });
            }
        }
        views
    }

    /// Counters, drops by reason and cache entries with their generations. Each call also
    /// publishes the counters through the `metrics` facade (`tether_node_*`, labelled by
    /// node; drops labelled by reason).
    pub fn snapshot(&self) -> Snapshot {
        let snapshot = self.collect_snapshot();
        let node = snapshot.node_id.clone();
        for (name, value) in [
            ("frames_enqueued", snapshot.frames_enqueued),
            ("frames_written", snapshot.frames_written),
            ("frames_received", snapshot.frames_received),
            ("frames_delivered", snapshot.frames_delivered),
            ("accepted", snapshot.accepted),
            ("refused", snapshot.refused),
            ("refused_full", snapshot.refused_full),
            ("dials_started", snapshot.dials_started),
            ("dial_failures", snapshot.dial_failures),
            ("evictions", snapshot.evictions),
            ("stale_failures", snapshot.stale_failures),
        ] {
            metrics::counter!(format!("tether_node_{name}"), "node" => node.clone())
                .absolute(value);
        }
        for (reason, count) in &snapshot.drops.0 {
            let reason = reason.as_str();
            metrics::counter!("tether_node_drops", "node" => node.clone(), "reason" => reason)
                .absolute(*count);
        }
        snapshot
    }

    fn collect_snapshot(&self) -> Snapshot {
        let c = &self.inner.counters;
        let state = self.inner.gate.lock();
        let driver = &state.driver;
        let refusals = driver.refusals().clone();
        let counters = driver.counters();
        let (handshakes_refused, handshakes_in_progress) = {
            let handshakes = self.inner.handshakes.lock();
            (handshakes.refused(), handshakes.in_progress())
        };
        Snapshot {
            node_id: self.inner.local.to_string(),
            frames_enqueued: c.enqueued.load(Ordering::Relaxed),
            frames_written: c.written.load(Ordering::Relaxed),
            frames_received: c.received.load(Ordering::Relaxed),
            frames_delivered: c.delivered.load(Ordering::Relaxed),
            drops: driver.drops().clone(),
            accepted: counters.accepted,
            refused: refusals.total(Direction::Inbound),
            refused_full: counters.refused_full,
            refusals,
            handshakes_refused,
            handshakes_in_progress,
            dials_started: counters.dials_started,
            dial_failures: counters.dial_failures,
            egress_queues_started: c.queues_started.load(Ordering::Relaxed),
            egress_queues_retired: c.queues_retired.load(Ordering::Relaxed),
            evictions: counters.evictions,
            stale_failures: counters.stale_failures,
            cache: driver
                .connections()
                .filter(|(_, channel, _)| *channel == Channel::Actor)
                .map(|(peer, _, generation)| (peer.to_string(), generation.get()))
                .collect(),
            connections: driver
                .connections()
                .map(|(peer, channel, generation)| (peer.to_string(), channel, generation.get()))
                .collect(),
        }
    }

    /// A local telemetry stream named `name` that collectors subscribe to over the actor
    /// plane ([`Node::subscribe_telemetry`]): each subscription dials its collector and
    /// publishes `header` (with the subscription's flow id), then every frame emitted on the
    /// returned source, until the collector unsubscribes or goes away.
    pub fn telemetry_source(&self, name: &str, header: Header) -> TelemetrySource {
        let source = TelemetrySource::new(header);
        self.inner
            .sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name.to_owned(), source.clone());
        self.inner
            .drive(|driver, now| driver.handle_telemetry_stream(now, name));
        source
    }

    /// Subscribes this node (a collector: built with a telemetry sink) to stream `stream` of
    /// the node at `source`, as flow `flow_id`: a control record on the actor plane (connecting
    /// first if needed); the source then publishes to this node's sink.
    pub async fn subscribe_telemetry(
        &self,
        source: EndpointAddr,
        stream: &str,
        flow_id: [u8; 16],
    ) -> Result<(), NodeError> {
        let control = Control::Subscribe {
            name: stream.to_owned(),
            flow_id,
        };
        control.encode().ok_or(NodeError::InvalidStreamName)?;
        let peer = node_id_of(&source.id);
        // The record must reach the source: on the cached connection, or a new one.
        self.connect(source).await?;
        self.send_control(peer, &control)
    }

    /// Ends this node's subscription `flow_id` to stream `stream` of `source` (the source's
    /// publisher ends the stream; the sink sees it end).
    pub fn unsubscribe_telemetry(
        &self,
        source: NodeId,
        stream: &str,
        flow_id: [u8; 16],
    ) -> Result<(), NodeError> {
        let control = Control::Unsubscribe {
            name: stream.to_owned(),
            flow_id,
        };
        self.send_control(source, &control)
    }

    /// Sends a subscription control record to `source`'s mailbox.
    fn send_control(&self, source: NodeId, control: &Control) -> Result<(), NodeError> {
        let payload = control.encode().ok_or(NodeError::InvalidStreamName)?;
        self.send(OutFrame {
            to: source,
            dest: ActorAddr::mailbox(source),
            type_tag: TELEMETRY_CONTROL_TAG.into(),
            payload: payload.into(),
        });
        Ok(())
    }

    /// Subscription control records this node received, by verdict, and how many
    /// subscriptions it publishes to now.
    pub fn telemetry_control(&self) -> (BTreeMap<ControlVerdict, u64>, usize) {
        let state = self.inner.gate.lock();
        (
            state.driver.control_verdicts().clone(),
            state.driver.telemetry_subscriptions(),
        )
    }

    /// Publishes a telemetry stream to the collector at `to`: the `header` snapshot, then
    /// every event of `subscription` until it closes, batched (zstd when smaller). Runs in the
    /// background; the returned receiver reports how it ended.
    pub fn publish_telemetry(
        &self,
        to: EndpointAddr,
        header: tether_core::wire::telemetry::Header,
        subscription: tokio::sync::mpsc::Receiver<tether_core::wire::telemetry::TelemetryFrame>,
    ) -> tokio::sync::oneshot::Receiver<Result<(), NodeError>> {
        let (done, outcome) = tokio::sync::oneshot::channel();
        let inner = self.inner.clone();
        self.inner.spawn(async move {
            let result = inner.publish_to(to, header, subscription).await;
            let _ = done.send(result);
        });
        outcome
    }

    /// Opens a logical stream of `protocol_id` to the peer at `to`, announcing
    /// `protocol_stream_id`; the driver runs its pumps and the caller gets its rings.
    pub async fn open_stream(
        &self,
        to: EndpointAddr,
        protocol_id: &str,
        protocol_stream_id: u64,
    ) -> Result<LogicalStream, NodeError> {
        let (index, adapter) = self
            .inner
            .adapters
            .iter()
            .enumerate()
            .find(|(_, adapter)| adapter.binding.protocol_id == protocol_id)
            .and_then(|(index, adapter)| Some((u16::try_from(index).ok()?, adapter.clone())))
            .ok_or_else(|| NodeError::NoBinding(protocol_id.to_owned()))?;
        let peer = node_id_of(&to.id);
        // One connection per peer and protocol (either side may have dialed it): the machine
        // says which carries the stream, and what follows a dead one.
        let channel = Channel::Protocol(index);
        let (mut send, recv) = self
            .inner
            .open_stream_to(
                to,
                Path::Protocol,
                channel,
                &adapter.binding.wire_alpn,
                |_, conn| async move { conn.open_bi().await },
                |inner, generation, conn| {
                    inner.serve_protocol(adapter.clone(), index, generation, peer, conn);
                },
            )
            .await?;
        send.write_all(&protocol_stream_id.to_be_bytes())
            .await
            .map_err(|error| NodeError::Connect(error.into()))?;
        let inner = self.inner.clone();
        let judge = self.inner.judge(peer, channel);
        let stream = adapter.start(peer, protocol_stream_id, send, recv, judge, &move |task| {
            inner.spawn(task)
        });
        Ok(stream)
    }

    /// Switch connections accepted by a node built with [`NodeBuilder::switch_host`]; taken
    /// once.
    pub fn switch_connections(&self) -> Option<SwitchConnections> {
        self.inner
            .switch_connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// A stream to the host node at `addr` for a request switch ([`SWITCH_ALPN`]). It rides
    /// the switch connection cached for the peer (dialed when there is none, or when the
    /// cached one is dead). Refused before dialling when the peer is not on the allow-list.
    /// [`crate::switch::Switch::connect_iroh`] dials with it and also evicts the connection
    /// when its master is cut for silence; given to `Switch::add_master` instead, the
    /// connection is evicted only once it dies (report a cut with
    /// [`QuicStream::connection_cut`]).
    pub async fn dial_switch_host(&self, addr: EndpointAddr) -> Result<QuicStream, NodeError> {
        let (conn, mut send, recv, cut) = self
            .inner
            .open_bi_cached(addr, Channel::Switch, SWITCH_ALPN)
            .await?;
        // The host speaks first on this link: the opener's bytes make the stream exist there.
        send.write_all(tether_core::wire::bifaci::QUIC_STREAM_OPENER)
            .await
            .map_err(|error| NodeError::Stream(Box::new(error)))?;
        Ok(QuicStream::new(conn, send, recv).with_cut(cut))
    }

    /// The substrate transport of a node built with [`NodeBuilder::substrate`]; taken once.
    pub fn substrate_transport(&self) -> Option<IrohTransport> {
        self.inner
            .substrate_transport
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// The substrate over this node, in one call: its links ride this node's endpoint
    /// ([`SUBSTRATE_ALPN`]), each peer is the key TLS authenticated, and the handshake binds
    /// its proof to that very connection (`Auth::TransportIdentity`). Set the authorizer, the
    /// store and the rest on the builder, `start` it, and name peers with
    /// [`Node::add_substrate_peer`]. [`NodeError::NoSubstrate`] unless the node was built with
    /// [`NodeBuilder::substrate`]; once only.
    pub fn substrate_builder(&self) -> Result<crate::substrate::SubstrateBuilder, NodeError> {
        let transport = self.substrate_transport().ok_or(NodeError::NoSubstrate)?;
        let local = transport.local().clone();
        Ok(crate::substrate::Substrate::builder(local, transport)
            .auth(tether_core::substrate::handshake::Auth::TransportIdentity))
    }

    /// Records how to reach the substrate peer at `addr` (this side may then dial it); its
    /// substrate peer id. Refused (counted under `substrate/outbound`) when the allow-list
    /// does not admit it.
    pub fn add_substrate_peer(
        &self,
        addr: EndpointAddr,
    ) -> Result<tether_core::substrate::PeerId, NodeError> {
        substrate_link::add_peer(&self.inner.gate, &self.inner.substrate_peers, addr)
    }

    /// Closes the cached connection to `peer` (if any); the next frame for it dials again.
    pub fn disconnect(&self, peer: &NodeId) {
        let peer = *peer;
        self.inner
            .drive(|driver, now| driver.handle_disconnect(now, peer, Channel::Actor));
    }

    /// Every ALPN this node speaks (actor, telemetry, and the substrate, switch and protocol
    /// bindings it was built with).
    pub fn alpns(&self) -> Vec<Vec<u8>> {
        self.inner.alpns.clone()
    }

    /// The node as an iroh protocol handler, for an application's `Router` (see
    /// [`NodeBuilder::endpoint`]): every connection it is handed goes through the same
    /// admission and ALPN dispatch as the node's own accept loop.
    pub fn protocol_handler(&self) -> NodeProtocol {
        NodeProtocol {
            inner: self.inner.clone(),
        }
    }

    /// Registers [`Node::protocol_handler`] under each of [`Node::alpns`] on `router`,
    /// beside whatever other protocols the application mounts there.
    pub fn mount(&self, router: iroh::protocol::RouterBuilder) -> iroh::protocol::RouterBuilder {
        self.alpns().into_iter().fold(router, |router, alpn| {
            router.accept(alpn, self.protocol_handler())
        })
    }

    /// Tasks still running (0 after [`Node::close`]).
    pub fn tasks_running(&self) -> usize {
        self.inner
            .tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Closes every connection and stops the accept loop, readers, writers, dials and joins;
    /// returns when all of them have ended.
    pub async fn close(&self) {
        self.inner.closed.send_replace(true);
        // The machine closes every cached connection (its actions) and starts nothing new:
        // from here it refuses (and counts) every send.
        self.inner.drive(|driver, now| driver.handle_close(now));
        let queues: Vec<Arc<egress::PeerQueue>> = {
            // A send that finds a queue through its thread's cache pushes without the lock:
            // closing each queue sends it (and any frame it pushed) back to the machine. A
            // closed table makes no queue again (a send the machine let through just before
            // it closed asks again, and is refused).
            let mut egress = self.inner.egress_write();
            egress.closed = true;
            for queue in egress.queues.values() {
                queue.sender.close();
            }
            egress.queues.drain().map(|(_, queue)| queue).collect()
        };
        self.inner.egress_count.send_replace(0);
        if !self.inner.embedded {
            self.inner.endpoint.close().await;
        }
        let mut tasks = std::mem::take(
            &mut *self
                .inner
                .tasks
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
        // What the writers never popped goes now, not when a thread's send cache lets go of
        // its queue.
        for queue in queues {
            while queue.sender.take_stranded().is_some() {}
        }
        info!(node = %self.inner.local, "node closed");
    }
}

/// A [`Node`] mounted on an application's iroh `Router` ([`Node::protocol_handler`]).
#[derive(Clone)]
pub struct NodeProtocol {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for NodeProtocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeProtocol")
            .field("node", &self.inner.local.to_string())
            .finish()
    }
}

impl iroh::protocol::ProtocolHandler for NodeProtocol {
    async fn accept(&self, connection: Connection) -> Result<(), iroh::protocol::AcceptError> {
        // The node's tasks hold the connection; the router's handle may go. A closed node's
        // machine dispatches it nowhere.
        self.inner.accepted(connection);
        Ok(())
    }
}

impl Inner {
    fn is_closed(&self) -> bool {
        *self.closed.borrow()
    }

    /// Spawns a task the node owns (aborted and awaited by close).
    fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        if self.is_closed() {
            return;
        }
        let mut tasks = self.tasks.lock().unwrap_or_else(PoisonError::into_inner);
        // Reap finished tasks so the set does not grow with every stream ever read.
        while tasks.try_join_next().is_some() {}
        tasks.spawn(task);
    }

    /// What the machine says of a stream from `peer` on `channel` that cannot be read on.
    fn judge(self: &Arc<Self>, peer: NodeId, channel: Channel) -> StreamJudge {
        let inner = self.clone();
        StreamJudge(Arc::new(move |why| {
            inner.ask(
                |driver, now| match why {
                    Unreadable::Malformed => driver.handle_stream_fault(now, peer, channel, true),
                    Unreadable::Unread => driver.handle_stream_unread(now, peer, channel),
                },
                Answer::stream,
            )
        }))
    }
}
