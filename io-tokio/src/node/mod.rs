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
//! use tether::node::{ActorBridge, DeliveryError, Node, OutFrame};
//!
//! struct Print;
//! impl ActorBridge for Print {
//!     fn deliver_raw(&self, dest: [u8; 32], tag: &str, payload: bytes::Bytes) -> Result<(), DeliveryError> {
//!         println!("{tag}: {} bytes for {:x?}", payload.len(), &dest[..4]);
//!         Ok(())
//!     }
//! }
//!
//! let node = Node::builder().bridge(Arc::new(Print)).know_tag("Chat").bind().await?;
//! let peer_addr = node.endpoint_addr(); // a real peer's address in practice
//! node.connect(peer_addr.clone()).await?;
//! let to = *peer_addr.id.as_bytes();
//! node.send(OutFrame { to, dest: to, type_tag: "Chat".into(), payload: "hi".into() });
//! node.close().await;
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;
use tether_core::limits::{NODE_READ_CHUNK_BYTES, NODE_WRITE_BATCH_BYTES};

use crossbeam_utils::CachePadded;

mod protocol;
pub mod ring;
mod substrate_link;
mod telemetry;

pub use protocol::{
    LogicalStream, ProtocolBinding, ProtocolIngress, StreamEvent, StreamFaultReason,
};
pub use substrate_link::{peer_id_of, IrohTransport, QuicStream, SUBSTRATE_ALPN};

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
    Action, Alpns, ClaimAuthorizer, ClaimRequest, ClaimVerdict, Control, ControlVerdict, DialEnd,
    DialTicket, Direction, Dispatch, Driver, DriverConfig, DriverRecord, DropReason, Drops,
    Generation, Handoff, HostClaim, Inbound, JoinStatus, NodeId, Open, Path, PeerAuth, PeerBook,
    Publisher, Refusals, Refused, RouteMemo, Routes, Send as SendVerdict, StreamVerdict,
    HOST_CLAIM_TAG, TELEMETRY_CONTROL_TAG,
};
pub use tether_core::driver::{ActorAddr, Channel};
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

impl From<Refused> for NodeError {
    fn from(_: Refused) -> Self {
        NodeError::Unauthorized
    }
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

/// The QUIC limits of a node's endpoint, set explicitly (core's limits): streams per
/// connection and what a stream and a connection may have unread toward this node.
pub fn quic_transport_config() -> iroh::endpoint::QuicTransportConfig {
    use iroh::endpoint::{QuicTransportConfig, VarInt};
    use tether_core::limits::{
        QUIC_CONNECTION_RECEIVE_WINDOW_BYTES, QUIC_STREAMS_BIDI_MAX, QUIC_STREAMS_UNI_MAX,
        QUIC_STREAM_RECEIVE_WINDOW_BYTES,
    };
    QuicTransportConfig::builder()
        .max_concurrent_bidi_streams(VarInt::from_u32(QUIC_STREAMS_BIDI_MAX))
        .max_concurrent_uni_streams(VarInt::from_u32(QUIC_STREAMS_UNI_MAX))
        .stream_receive_window(VarInt::from_u32(QUIC_STREAM_RECEIVE_WINDOW_BYTES))
        .receive_window(VarInt::from_u32(QUIC_CONNECTION_RECEIVE_WINDOW_BYTES))
        .build()
}

/// Builds a [`Node`].
pub struct NodeBuilder {
    endpoint: Option<Endpoint>,
    secret_key: Option<SecretKey>,
    relay_mode: RelayMode,
    auth: PeerAuth,
    claim_authorizer: Option<ClaimAuthorizer>,
    bind_addr: SocketAddr,
    bridge: Option<Arc<dyn ActorBridge>>,
    tags: Vec<String>,
    routes: Vec<(String, ActorAddr)>,
    hosted: Vec<ActorAddr>,
    payload_bytes_max: usize,
    batch_delay: Duration,
    egress_ring: usize,
    egress_spill: usize,
    idle_peer_timeout: Duration,
    dial_timeout: Duration,
    inbound_connections_max: usize,
    swim_tags: Option<Vec<String>>,
    actor_alpn: Vec<u8>,
    join_policy: JoinPolicy,
    substrate: bool,
    switch_host: bool,
    telemetry_sinks: Vec<tokio::sync::mpsc::Sender<TelemetryIngress>>,
    telemetry_alpn: Vec<u8>,
    protocols: Vec<(ProtocolBinding, tokio::sync::mpsc::Sender<ProtocolIngress>)>,
}

impl std::fmt::Debug for NodeBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeBuilder")
            .field("bind_addr", &self.bind_addr)
            .finish_non_exhaustive()
    }
}

/// Join timing (defaults: docs/spec/driver.md §4.3, 5 attempts, 2 s doubling to 30 s, 10 s
/// each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JoinPolicy {
    /// Time allowed to one attempt.
    pub attempt_timeout: Duration,
    /// Divides the waits between attempts (1 = the schedule of docs/spec/driver.md §4.3; tests
    /// shrink them).
    pub delay_divisor: u32,
}

impl Default for JoinPolicy {
    fn default() -> Self {
        Self {
            attempt_timeout: tether_core::driver::schedule::JOIN_ATTEMPT_TIMEOUT,
            delay_divisor: 1,
        }
    }
}

impl Default for NodeBuilder {
    fn default() -> Self {
        Self {
            endpoint: None,
            secret_key: None,
            relay_mode: RelayMode::Disabled,
            auth: PeerAuth::open(),
            claim_authorizer: None,
            bind_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            bridge: None,
            tags: Vec::new(),
            routes: Vec::new(),
            hosted: Vec::new(),
            payload_bytes_max: ACTOR_PAYLOAD_BYTES_DEFAULT,
            batch_delay: Duration::ZERO,
            egress_ring: tether_core::channel::HYBRID_RING_DEFAULT,
            egress_spill: EGRESS_SPILL_FRAMES_MAX,
            idle_peer_timeout: Duration::from_millis(EGRESS_IDLE_TEARDOWN_MS_DEFAULT),
            dial_timeout: tether_core::driver::schedule::DIAL_ATTEMPT_TIMEOUT,
            inbound_connections_max: tether_core::limits::QUIC_CONNECTIONS_INBOUND_MAX,
            swim_tags: None,
            actor_alpn: ACTOR_ALPN.to_vec(),
            join_policy: JoinPolicy::default(),
            substrate: false,
            switch_host: false,
            telemetry_sinks: Vec::new(),
            telemetry_alpn: TELEMETRY_ALPN.to_vec(),
            protocols: Vec::new(),
        }
    }
}

impl NodeBuilder {
    /// Runs tether on an endpoint the application already has (and shares with other iroh
    /// protocols) instead of binding its own: the node then accepts nothing itself. Mount
    /// its protocols on the application's `iroh::protocol::Router` with [`Node::mount`] (or
    /// [`Node::protocol_handler`] under each of [`Node::alpns`]). The endpoint's key, relays
    /// and sockets are the application's ([`NodeBuilder::secret_key`],
    /// [`NodeBuilder::relay_mode`] and [`NodeBuilder::bind_addr`] are ignored), and so is its
    /// lifetime: [`Node::close`] ends tether's connections and tasks and leaves the endpoint
    /// open.
    pub fn endpoint(mut self, endpoint: Endpoint) -> Self {
        self.endpoint = Some(endpoint);
        self
    }

    /// The node's secret key (absent: a fresh one).
    pub fn secret_key(mut self, key: [u8; 32]) -> Self {
        self.secret_key = Some(SecretKey::from_bytes(&key));
        self
    }

    /// Relay use (default: disabled).
    pub fn relay_mode(mut self, mode: RelayMode) -> Self {
        self.relay_mode = mode;
        self
    }

    /// Admits only these peers, inbound and outbound.
    pub fn allow(mut self, peers: impl IntoIterator<Item = NodeId>) -> Self {
        self.auth = PeerAuth::allow_list(peers);
        self
    }

    /// The rule for host claims that take an actor this node has no route for, or move one
    /// from its holder without the holder's handoff (default: first claims are taken, such
    /// moves refused; README "Actor ownership"). A pure function: same request, same answer.
    pub fn claim_authorizer(
        mut self,
        rule: impl Fn(&ClaimRequest) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.claim_authorizer = Some(ClaimAuthorizer::new(rule));
        self
    }

    /// Where the endpoint binds (default `127.0.0.1:0`).
    pub fn bind_addr(mut self, addr: SocketAddr) -> Self {
        self.bind_addr = addr;
        self
    }

    /// Where inbound records go.
    pub fn bridge(mut self, bridge: Arc<dyn ActorBridge>) -> Self {
        self.bridge = Some(bridge);
        self
    }

    /// A type tag the codec registry knows.
    pub fn know_tag(mut self, tag: &str) -> Self {
        self.tags.push(tag.to_owned());
        self
    }

    /// Gossip to this node's mailbox tagged `tag` goes to local actor `actor`.
    pub fn route_tag(mut self, tag: &str, actor: ActorAddr) -> Self {
        self.routes.push((tag.to_owned(), actor));
        self
    }

    /// A local actor application frames may address.
    pub fn host(mut self, actor: ActorAddr) -> Self {
        self.hosted.push(actor);
        self
    }

    /// Largest actor payload read (default 1 MiB).
    pub fn payload_bytes_max(mut self, max: usize) -> Self {
        self.payload_bytes_max = max;
        self
    }

    /// How long a peer's writer waits after a wake for more frames to batch into one write
    /// (default zero: one scheduler turn). Keep it at or below 1 ms.
    pub fn batch_delay(mut self, delay: Duration) -> Self {
        self.batch_delay = delay;
        self
    }

    /// Slots of each peer's egress ring (default
    /// [`HYBRID_RING_DEFAULT`](tether_core::channel::HYBRID_RING_DEFAULT)); frames beyond
    /// it spill into a linked queue bounded by [`NodeBuilder::egress_spill`], which costs more
    /// per frame. A slot holds one frame, or a run of up to
    /// [`EGRESS_RUN_FRAMES_MAX`](tether_core::limits::EGRESS_RUN_FRAMES_MAX) frames that
    /// [`Node::send_batch`] packs together. The ring is allocated with the peer's queue, about
    /// 96 bytes a slot: raise it for senders that burst thousands of lone frames at one peer.
    pub fn egress_ring(mut self, slots: usize) -> Self {
        self.egress_ring = slots.max(1);
        self
    }

    /// Frames each peer's egress queue holds past its ring (default
    /// [`EGRESS_SPILL_FRAMES_MAX`]); past them a frame is dropped, counted `egress_full`.
    pub fn egress_spill(mut self, frames: usize) -> Self {
        self.egress_spill = frames;
        self
    }

    /// How long a peer's egress queue and writer live with nothing to write before they are
    /// torn down (default [`EGRESS_IDLE_TEARDOWN_MS_DEFAULT`] ms); the next frame for the
    /// peer makes new ones. Bounds the memory of a node that talks to many short-lived peers.
    pub fn idle_peer_timeout(mut self, idle: Duration) -> Self {
        self.idle_peer_timeout = idle;
        self
    }

    /// How long a dial for a stream or a [`Node::connect`] may take to connect before it
    /// fails with [`DialTimedOut`] (default 10 s); the opens waiting on it fail with it and
    /// the next open dials afresh.
    pub fn dial_timeout(mut self, timeout: Duration) -> Self {
        self.dial_timeout = timeout;
        self
    }

    /// Connections peers dialed that the node keeps at once, over every peer and channel
    /// (default [`tether_core::limits::QUIC_CONNECTIONS_INBOUND_MAX`]); past it a connection
    /// from a new (peer, channel) is closed after its handshake, counted
    /// ([`Snapshot::refused_full`]).
    pub fn inbound_connections_max(mut self, max: usize) -> Self {
        self.inbound_connections_max = max;
        self
    }

    /// The actor-plane ALPN (default [`ACTOR_ALPN`]).
    pub fn actor_alpn(mut self, alpn: &[u8]) -> Self {
        self.actor_alpn = alpn.to_vec();
        self
    }

    /// Accepts request-switch connections ([`SWITCH_ALPN`]): this node hosts caps for a switch
    /// that dials it. Take the connections with [`Node::switch_connections`].
    pub fn switch_host(mut self) -> Self {
        self.switch_host = true;
        self
    }

    /// Serves substrate links ([`SUBSTRATE_ALPN`]); take the transport with
    /// [`Node::substrate_transport`] and give it to a `Substrate`.
    pub fn substrate(mut self) -> Self {
        self.substrate = true;
        self
    }

    /// Collects telemetry streams peers publish to this node into `sink`; called again, adds
    /// a sink (fanout: every sink gets every item). Without a sink, telemetry connections are
    /// refused. The sink is bounded (its capacity is the caller's choice; see
    /// [`TELEMETRY_SINK_ITEMS_DEFAULT`]): while it is full, the stream's reader waits and QUIC
    /// flow control slows the publisher.
    pub fn telemetry_sink(mut self, sink: tokio::sync::mpsc::Sender<TelemetryIngress>) -> Self {
        self.telemetry_sinks.push(sink);
        self
    }

    /// The telemetry ALPN (default [`TELEMETRY_ALPN`]).
    pub fn telemetry_alpn(mut self, alpn: &[u8]) -> Self {
        self.telemetry_alpn = alpn.to_vec();
        self
    }

    /// The frame tags whose failed writes are reported to the bridge as SWIM send failures
    /// (default [`tether_core::driver::SWIM_TAGS`]).
    pub fn swim_tags<I, T>(mut self, tags: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        self.swim_tags = Some(tags.into_iter().map(Into::into).collect());
        self
    }

    /// Serves `binding` on this endpoint; its lifecycle events and inbound logical streams
    /// go to `sink`, a bounded channel (see [`PROTOCOL_SINK_EVENTS_DEFAULT`]). An event that
    /// finds it full is dropped and counted (`tether_node_protocol_events_dropped`); a dropped
    /// inbound stream is closed, so its opener sees it fail.
    pub fn bind_protocol(
        mut self,
        binding: ProtocolBinding,
        sink: tokio::sync::mpsc::Sender<ProtocolIngress>,
    ) -> Self {
        self.protocols.push((binding, sink));
        self
    }

    /// Join timing.
    pub fn join_policy(mut self, policy: JoinPolicy) -> Self {
        self.join_policy = policy;
        self
    }

    /// Binds the endpoint and starts the accept loop.
    pub async fn bind(self) -> Result<Node, NodeError> {
        let secret = self.secret_key.unwrap_or_else(SecretKey::generate);
        let mut alpns = vec![self.actor_alpn.clone(), self.telemetry_alpn.clone()];
        if self.substrate {
            alpns.push(SUBSTRATE_ALPN.to_vec());
        }
        if self.switch_host {
            alpns.push(SWITCH_ALPN.to_vec());
        }
        alpns.extend(
            self.protocols
                .iter()
                .map(|(binding, _)| binding.wire_alpn.clone()),
        );
        let relay_urls: Vec<RelayUrl> = self.relay_mode.relay_map().urls();
        let embedded = self.endpoint.is_some();
        let endpoint = match self.endpoint {
            Some(endpoint) => endpoint,
            None => Endpoint::builder(presets::Minimal)
                .transport_config(quic_transport_config())
                .secret_key(secret)
                .relay_mode(self.relay_mode)
                .alpns(alpns.clone())
                .bind_addr(self.bind_addr)
                .map_err(|error| NodeError::Bind(error.into()))?
                .bind()
                .await
                .map_err(|error| NodeError::Bind(error.into()))?,
        };
        let local = *endpoint.id().as_bytes();
        let mut routes = Routes::new(local);
        for tag in &self.tags {
            routes.know_tag(tag);
        }
        for (tag, actor) in &self.routes {
            routes.route_tag(tag, *actor);
        }
        for actor in &self.hosted {
            routes.host(*actor);
        }
        if let Some(tags) = self.swim_tags {
            routes.set_swim_tags(tags);
        }
        let (closed_tx, _) = watch::channel(false);
        let gate = Arc::new(Gate::new(DriverConfig {
            auth: self.auth,
            alpns: Alpns {
                actor: self.actor_alpn.clone(),
                telemetry: self.telemetry_alpn.clone(),
                telemetry_collect: !self.telemetry_sinks.is_empty(),
                protocols: self
                    .protocols
                    .iter()
                    .map(|(binding, _)| binding.wire_alpn.clone())
                    .collect(),
                switch: self.switch_host.then(|| SWITCH_ALPN.to_vec()),
                substrate: self.substrate.then(|| SUBSTRATE_ALPN.to_vec()),
            },
            idle_peer_timeout: self.idle_peer_timeout,
            dial_attempt_timeout: self.dial_timeout,
            join_attempt_timeout: self.join_policy.attempt_timeout,
            join_delay_divisor: self.join_policy.delay_divisor,
            valid_peer: |peer| PublicKey::from_bytes(peer).is_ok(),
            failed_opens_max: tether_core::limits::FAILED_OPENS_MAX,
            relay_hint_peers_max: tether_core::limits::RELAY_HINT_PEERS_MAX,
            inbound_connections_max: self.inbound_connections_max,
            announce_batch: tether_core::limits::ANNOUNCE_CLAIMS_BATCH_MAX,
            claim_authorizer: self.claim_authorizer,
        }));
        let substrate_peers = substrate_link::SubstratePeers::default();
        let (switch_queue, switch_connections) = if self.switch_host {
            let (tx, rx) = tokio::sync::mpsc::channel(16);
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let substrate = self.substrate;
        let inner = Arc::new_cyclic(|node| {
            let (substrate_transport, substrate_queue) = if substrate {
                let (transport, queue) = IrohTransport::new(
                    node.clone(),
                    peer_id_of(&endpoint.id()),
                    gate.clone(),
                    substrate_peers.clone(),
                );
                (Some(transport), Some(queue))
            } else {
                (None, None)
            };
            Inner {
                switch_queue,
                switch_connections: Mutex::new(switch_connections),
                adapters: {
                    let stream_ids = Arc::new(AtomicU64::new(1));
                    self.protocols
                        .into_iter()
                        .map(|(binding, sink)| {
                            Arc::new(protocol::Adapter::new(binding, sink, stream_ids.clone()))
                        })
                        .collect()
                },
                telemetry_sinks: telemetry::Sinks::new(self.telemetry_sinks),
                telemetry_alpn: self.telemetry_alpn,
                substrate_transport: Mutex::new(substrate_transport),
                substrate_peers,
                sources: Mutex::default(),
                substrate_queue,
                endpoint,
                embedded,
                alpns,
                local,
                gate,
                routes: Mutex::new(Arc::new(routes)),
                bridge: self.bridge,
                payload_bytes_max: self.payload_bytes_max,
                batch_delay: self.batch_delay,
                egress_ring: self.egress_ring,
                egress_spill: self.egress_spill,
                egress_count: watch::channel(0).0,
                relay_urls,
                actor_alpn: self.actor_alpn,
                egress: CachePadded::default(),
                counters: Counters::default(),
                handshakes: crate::handshakes::SharedHandshakes::new(
                    tether_core::limits::QUIC_HANDSHAKES_IN_PROGRESS_MAX,
                ),
                tasks: Mutex::new(JoinSet::new()),
                closed: closed_tx,
            }
        });
        if !inner.embedded {
            let accept = inner.clone();
            inner.spawn(async move { accept.accept_loop().await });
        }
        let timer = inner.clone();
        inner.spawn(async move { timer.timer_loop().await });
        info!(node = %hex(&local), "node bound");
        Ok(Node { inner })
    }
}

/// A peer's egress queue: producers push, the writer task drains.
struct PeerQueue {
    sender: Sender<Slot>,
    wake: Arc<WriterWake>,
}

/// A frame in a peer's egress queue (the peer is the queue's, so the slot does not carry it).
struct Queued {
    dest: ActorAddr,
    type_tag: std::borrow::Cow<'static, str>,
    payload: Bytes,
}

impl Queued {
    /// Bytes it holds while queued.
    fn bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.type_tag.len() + self.payload.len()
    }
}

impl From<OutFrame> for Queued {
    fn from(frame: OutFrame) -> Self {
        Self {
            dest: frame.dest,
            type_tag: frame.type_tag,
            payload: frame.payload,
        }
    }
}

/// One slot of a peer's egress queue: a frame, or a run of at most [`EGRESS_RUN_FRAMES_MAX`]
/// frames handed over together (what [`Node::send_batch`] packs; only the ring takes runs).
enum Slot {
    One(Queued),
    Run(Vec<Queued>),
}

impl Slot {
    fn into_frames(self) -> Vec<Queued> {
        match self {
            Self::One(frame) => vec![frame],
            Self::Run(run) => run,
        }
    }
}

/// The writer's side of a peer's queue: the frames of a run it has popped but not yet
/// written come before the next slot.
struct Drain {
    channel: HybridChannel<Slot>,
    run: std::vec::IntoIter<Queued>,
}

impl Drain {
    fn new(channel: HybridChannel<Slot>) -> Self {
        Self {
            channel,
            run: Vec::new().into_iter(),
        }
    }

    fn pop(&mut self) -> Option<Queued> {
        if let Some(frame) = self.run.next() {
            return Some(frame);
        }
        match self.channel.pop()? {
            Slot::One(frame) => Some(frame),
            Slot::Run(run) => {
                self.run = run.into_iter();
                self.run.next()
            }
        }
    }

    /// Whether nothing is queued (a snapshot; producers may be pushing).
    fn is_empty(&self) -> bool {
        self.run.len() == 0 && self.channel.is_empty()
    }
}

/// Wakes a peer's writer only when it is asleep: a producer that finds it awake (the usual
/// case under load) reads one flag instead of notifying per frame. The fences pair up: either
/// the writer sees a frame pushed before it fell asleep, or the producer sees it asleep.
#[derive(Default)]
struct WriterWake {
    notify: Notify,
    asleep: AtomicBool,
    /// The driver retired this writer (it ends unless a frame raced the retirement).
    retire: AtomicBool,
}

impl WriterWake {
    /// After a push: wakes the writer if it fell asleep.
    fn wake(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.asleep.load(Ordering::Relaxed) && self.asleep.swap(false, Ordering::Relaxed) {
            self.notify.notify_one();
        }
    }

    /// Wakes the writer whether or not it sleeps (there is something new besides frames).
    fn kick(&self) {
        self.notify.notify_one();
    }

    /// Sleeps until woken, unless `has_work` finds a frame pushed after the writer looked.
    async fn sleep(&self, has_work: impl Fn() -> bool) {
        let notified = self.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        self.asleep.store(true, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::SeqCst);
        if has_work() {
            self.asleep.store(false, Ordering::Relaxed);
            return;
        }
        notified.await;
    }
}

/// A dial an [`Open::Dial`] ordered under `ticket`: unless it connected, its end is reported
/// when it is dropped: failed (the opens waiting on it fail as well), or abandoned because its
/// caller went away (the next open dials).
struct OpenDial {
    inner: Arc<Inner>,
    peer: NodeId,
    channel: Channel,
    ticket: DialTicket,
    /// How it ended, unless it connected.
    end: Option<DialEnd>,
}

impl Drop for OpenDial {
    fn drop(&mut self) {
        if let Some(end) = self.end {
            let (peer, channel, ticket) = (self.peer, self.channel, self.ticket);
            self.inner.drive(|driver, now| {
                driver.handle_open_dial_failed(now, peer, channel, ticket, end)
            });
        }
    }
}

/// Reports the connection a stream was opened on unresponsive: what ran over it stopped
/// answering (a switch master whose heartbeat went unechoed). The
/// node's machine evicts that connection (that generation only: a newer one stays) and closes
/// it with [`CLOSE_UNRESPONSIVE`], so the next stream to the peer dials afresh rather than
/// queueing behind a peer that no longer reads. [`crate::switch::Switch::connect_iroh`] uses
/// it on every cut of that kind; it does nothing once the node is gone.
#[derive(Clone)]
pub struct ConnectionCut {
    inner: std::sync::Weak<Inner>,
    peer: NodeId,
    channel: Channel,
    generation: Generation,
}

impl std::fmt::Debug for ConnectionCut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionCut")
            .field("channel", &self.channel)
            .field("generation", &self.generation.get())
            .finish_non_exhaustive()
    }
}

impl ConnectionCut {
    /// Reports the connection unresponsive (see the type).
    pub fn unresponsive(&self) {
        if let Some(inner) = self.inner.upgrade() {
            let (peer, channel, generation) = (self.peer, self.channel, self.generation);
            inner.drive(|driver, now| driver.handle_unresponsive(now, peer, channel, generation));
        }
    }
}

/// An open waiting on the dial `ticket` (when set): dropped then, it reports that it went
/// away, so the dial's waiters are counted right.
struct OpenWait {
    inner: Arc<Inner>,
    peer: NodeId,
    channel: Channel,
    ticket: Option<DialTicket>,
}

impl Drop for OpenWait {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket {
            let (peer, channel) = (self.peer, self.channel);
            self.inner
                .drive(|driver, now| driver.handle_open_wait_abandoned(now, peer, channel, ticket));
        }
    }
}

/// Where the machine placed an open once it stopped waiting.
enum Placed {
    /// On this cached connection.
    Cached(Generation, Connection),
    /// On a connection this open dials under the ticket, giving up after the timeout.
    Dial(DialTicket, Duration),
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
    egress: CachePadded<RwLock<BTreeMap<NodeId, PeerQueue>>>,
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
            .field("id", &hex(&self.inner.local))
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

impl Gate {
    fn new(config: DriverConfig) -> Self {
        Self {
            state: Mutex::new(State {
                driver: Driver::new(config),
                addrs: PeerBook::new(ADDRESS_BOOK_PEERS_MAX),
            }),
            refusals: watch::channel(Refusals::default()).0,
            changes: watch::channel(0).0,
            timer: Notify::new(),
            started: std::time::Instant::now(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn now(&self) -> Time {
        Time::from_millis(self.started.elapsed().as_millis() as u64)
    }

    /// The instant of machine time `at`.
    fn instant(&self, at: Time) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.started + Duration::from_millis(at.as_millis()))
    }

    /// Runs one input on the machine: its answer and the actions it queued.
    fn drive<R>(
        &self,
        input: impl FnOnce(&mut Driver<Connection>, Time) -> R,
    ) -> (R, Vec<Action<Connection>>) {
        let now = self.now();
        let mut state = self.lock();
        let driver = &mut state.driver;
        let (version, timeout) = (driver.version(), driver.poll_timeout());
        let answer = input(driver, now);
        let actions: Vec<_> = std::iter::from_fn(|| driver.poll_action()).collect();
        let moved = driver.version() != version;
        let rearm = driver.poll_timeout() != timeout;
        let refusals = (moved && *self.refusals.borrow() != *driver.refusals())
            .then(|| driver.refusals().clone());
        drop(state);
        if let Some(refusals) = refusals {
            self.refusals.send_replace(refusals);
        }
        if moved {
            self.changes
                .send_modify(|version| *version = version.wrapping_add(1));
        }
        if rearm {
            self.timer.notify_one();
        }
        (answer, actions)
    }

    /// Admits `peer` on `path` (a path whose only machine input is its admission), or counts
    /// the refusal.
    pub(crate) fn admit(
        &self,
        peer: &NodeId,
        path: Path,
        direction: Direction,
    ) -> Result<(), NodeError> {
        let (admitted, _) =
            self.drive(|driver, now| driver.handle_admit(now, peer, path, direction));
        admitted.map_err(NodeError::from)
    }
}

/// Actions waiting to be executed, each with the node whose machine made it.
type Pending = VecDeque<(Arc<Inner>, Action<Connection>)>;

thread_local! {
    /// The actions waiting on this thread, while an [`Executor::run`] drains them.
    static EXECUTING: std::cell::RefCell<Option<Pending>> = const { std::cell::RefCell::new(None) };
}

/// The one loop that executes the machine's actions on a thread: the outermost
/// [`Inner::drive`] drains them, an inner one only queues.
struct Executor;

impl Executor {
    fn run(inner: &Arc<Inner>, actions: Vec<Action<Connection>>) {
        let outermost = EXECUTING.with(|queue| {
            let mut queue = queue.borrow_mut();
            let outermost = queue.is_none();
            queue
                .get_or_insert_with(VecDeque::new)
                .extend(actions.into_iter().map(|action| (inner.clone(), action)));
            outermost
        });
        if !outermost {
            return;
        }
        // Cleared however the loop ends (an action that panics included), so the thread's
        // next drive drains again.
        struct Done;
        impl Drop for Done {
            fn drop(&mut self) {
                // Taken out first and dropped with no borrow held (what it drops may drive).
                let rest = EXECUTING.with(|queue| queue.borrow_mut().take());
                drop(rest);
            }
        }
        let _done = Done;
        while let Some((inner, action)) =
            EXECUTING.with(|queue| queue.borrow_mut().as_mut().and_then(VecDeque::pop_front))
        {
            inner.execute(action);
        }
    }
}

/// An address's relay URLs as text.
fn relay_strings(addr: &EndpointAddr) -> Vec<String> {
    addr.relay_urls().map(ToString::to_string).collect()
}

fn hex(id: &[u8; 32]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
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

    /// This node's address, with its bound socket addresses as direct addresses.
    pub fn endpoint_addr(&self) -> EndpointAddr {
        let mut addr = EndpointAddr::new(self.inner.endpoint.id());
        for socket in self.direct_addresses() {
            addr = addr.with_ip_addr(socket);
        }
        addr
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
        let peer = *addr.id.as_bytes();
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
    /// dropped (counted) and a background dial starts (at most one per peer).
    pub fn send(&self, frame: OutFrame) {
        self.inner.send(frame);
    }

    /// Queues every frame as [`Node::send`] does, in order, without blocking: a run of
    /// consecutive frames for one peer takes the egress table once, is counted once, wakes its
    /// writer once, and goes into the ring in slots of up to
    /// [`EGRESS_RUN_FRAMES_MAX`](tether_core::limits::EGRESS_RUN_FRAMES_MAX) frames, one
    /// hand-off to the writer per slot (what an actor flushing its outbox wants). A run the
    /// ring has no room for spills frame by frame, as lone frames do.
    pub fn send_batch(&self, frames: impl IntoIterator<Item = OutFrame>) {
        let mut frames = frames.into_iter().peekable();
        while let Some(first) = frames.next() {
            let peer = first.to;
            let run = std::iter::once(first).chain(std::iter::from_fn(|| {
                frames.next_if(|next| next.to == peer)
            }));
            self.inner.send_run(peer, run);
        }
    }

    /// Joins through `seeds`: for each, connect and write a `JoinRequest` to its mailbox, in
    /// the background with the join schedule. Never waits for convergence.
    /// A seed off the allow-list is refused (counted under `join/outbound`) and not tried.
    pub fn join(&self, seeds: Vec<EndpointAddr>) {
        for seed in seeds {
            let peer = *seed.id.as_bytes();
            let seed = self.inner.normalized(seed);
            let (relay, direct) = (seed.relay_urls().next().is_some(), seed.ip_addrs().count());
            let (joined, actions) = self
                .inner
                .gate
                .drive(|driver, now| driver.handle_join(now, peer, relay, direct));
            // A seed the machine admitted is remembered before its attempts run (they dial
            // the address remembered); a refused one leaves no state.
            match joined {
                Ok(()) => self.inner.remember(&seed),
                Err(_) => warn!(seed = %hex(&peer), "join seed not allowed"),
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
            .map(|(id, s)| (hex(id), s.clone()))
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
            .drive(|driver, now| driver.handle_register(now, claim))
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
            .drive(|driver, now| driver.handle_hand_off(now, actor, to, generation, handoff))
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
            .drive(|driver, now| driver.handle_send_to_actor(now, actor))
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
    }

    /// Makes actor `actor` not local any more (frames to it are dropped as `not_local`).
    pub fn unhost(&self, actor: &ActorAddr) {
        let mut routes = self
            .inner
            .routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Arc::make_mut(&mut routes).unhost(actor);
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
            node_id: hex(&self.inner.local),
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
                .map(|(peer, _, generation)| (hex(&peer), generation.get()))
                .collect(),
            connections: driver
                .connections()
                .map(|(peer, channel, generation)| (hex(&peer), channel, generation.get()))
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
        let peer = *source.id.as_bytes();
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
        let peer = *to.id.as_bytes();
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
        let (conn, send, recv, cut) = self
            .inner
            .open_bi_cached(addr, Channel::Switch, SWITCH_ALPN)
            .await?;
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
        self.inner.egress_write().clear();
        self.inner.egress_count.send_replace(0);
        // The machine closes every cached connection (its actions) and starts nothing new.
        self.inner.drive(|driver, now| driver.handle_close(now));
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
        info!(node = %hex(&self.inner.local), "node closed");
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
            .field("node", &hex(&self.inner.local))
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
            inner.drive(|driver, now| match why {
                Unreadable::Malformed => driver.handle_stream_fault(now, peer, channel, true),
                Unreadable::Unread => driver.handle_stream_unread(now, peer, channel),
            })
        }))
    }

    /// Runs one input on the driver machine and executes the actions it queued. Executing an
    /// action may drive the machine again (an announcement is a send, which the machine
    /// judges): those inputs' actions join the queue of the call already draining on this
    /// thread instead of being executed inside it, so the shell never re-enters itself and
    /// actions run one after another in the order the machine made them.
    fn drive<R>(self: &Arc<Self>, input: impl FnOnce(&mut Driver<Connection>, Time) -> R) -> R {
        let (answer, actions) = self.gate.drive(input);
        if !actions.is_empty() {
            Executor::run(self, actions);
        }
        answer
    }

    /// Does what the machine said.
    fn execute(self: &Arc<Self>, action: Action<Connection>) {
        match action {
            Action::Dial {
                peer,
                attempt,
                timeout,
            } => {
                let inner = self.clone();
                self.spawn(async move { inner.dial(peer, attempt, timeout).await });
            }
            Action::JoinAttempt {
                peer,
                attempt,
                timeout,
            } => {
                let inner = self.clone();
                self.spawn(async move { inner.join_attempt(peer, attempt, timeout).await });
            }
            Action::KickWriter { peer } => {
                if let Some(queue) = self.egress_read().get(&peer) {
                    queue.wake.kick();
                }
            }
            Action::RetireWriter { peer } => {
                if let Some(queue) = self.egress_read().get(&peer) {
                    queue.wake.retire.store(true, Ordering::Release);
                    queue.wake.kick();
                }
            }
            Action::SendFailed { peer } => {
                if let Some(bridge) = &self.bridge {
                    bridge.send_failed(peer);
                }
            }
            Action::Announce { peer, claim } => self.send(OutFrame {
                to: peer,
                dest: ActorAddr::mailbox(peer),
                type_tag: HOST_CLAIM_TAG.into(),
                payload: Bytes::copy_from_slice(&claim.encode()),
            }),
            Action::StartPublisher {
                collector,
                stream,
                flow_id,
                publisher,
            } => self.start_publisher(collector, stream, flow_id, publisher),
            Action::StopPublisher {
                stream, publisher, ..
            } => {
                if let Some(source) = self.source(&stream) {
                    source.inner.unsubscribe(publisher);
                }
            }
            Action::Close { conn, code } => conn.close(code.into(), b"closed"),
        }
    }

    fn source(&self, name: &str) -> Option<TelemetrySource> {
        self.sources
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
    }

    /// A collector subscribed to local stream `stream`: dial it on the telemetry ALPN and
    /// publish the header (with its flow), then events, until it unsubscribes or goes away.
    fn start_publisher(
        self: &Arc<Self>,
        collector: NodeId,
        stream: String,
        flow_id: [u8; 16],
        publisher: Publisher,
    ) {
        let subscription = (collector, stream, flow_id);
        let Some(source) = self.source(&subscription.1) else {
            // The machine knows only streams registered here; end it there all the same.
            self.drive(|driver, now| driver.handle_publisher_ended(now, &subscription, publisher));
            return;
        };
        let events = source.inner.subscribe(publisher);
        let mut header = source.inner.header.clone();
        header.flow_id = flow_id;
        let inner = self.clone();
        self.spawn(async move {
            let result = match inner.address_of(&collector) {
                Some(addr) => inner.publish_to(addr, header, events).await,
                None => Err(NodeError::InvalidNodeId),
            };
            if let Err(error) = result {
                debug!(%error, "telemetry publisher ended");
            }
            // Its end, stopped or on its own; the machine keeps a subscription started again
            // under a newer publisher meanwhile.
            source.inner.unsubscribe(publisher);
            inner.drive(|driver, now| driver.handle_publisher_ended(now, &subscription, publisher));
        });
    }

    /// Publishes `header` then `events` on a new uni stream to the collector at `to`. The
    /// machine says where the stream goes (the allow-list first, then the connection cached
    /// for the peer's telemetry ALPN, whichever side dialed it); a dead cached connection is
    /// evicted and one fresh connection dialed, cached and served as an accepted one is.
    async fn publish_to(
        self: &Arc<Self>,
        to: EndpointAddr,
        header: Header,
        events: tokio::sync::mpsc::Receiver<tether_core::wire::telemetry::TelemetryFrame>,
    ) -> Result<(), NodeError> {
        let peer = *to.id.as_bytes();
        let send = self
            .open_stream_to(
                to,
                Path::Telemetry,
                Channel::Telemetry,
                &self.telemetry_alpn,
                |_, conn| async move { conn.open_uni().await },
                |inner, generation, conn| inner.serve_telemetry(peer, generation, conn),
            )
            .await?;
        telemetry::publish(send, header, events).await
    }

    /// A new stream to `addr` on `channel` where the machine says (the allow-list for `path`
    /// first): `open` on the cached connection, whichever side dialed it (a dead one is
    /// evicted, that generation only); with none, on a fresh connection dialed on `alpn`
    /// ([`Inner::dial_cached`]), which `serve` then serves as an accepted one is. While
    /// another open's dial to the peer is in flight, this waits for it.
    async fn open_stream_to<S, E, F>(
        self: &Arc<Self>,
        addr: EndpointAddr,
        path: Path,
        channel: Channel,
        alpn: &[u8],
        open: impl Fn(Generation, Connection) -> F,
        serve: impl FnOnce(&Arc<Self>, Generation, Connection),
    ) -> Result<S, NodeError>
    where
        F: std::future::Future<Output = Result<S, E>>,
        E: Into<BoxError>,
    {
        let peer = *addr.id.as_bytes();
        let mut placed = self.open_verdict(peer, path, channel).await?;
        let ticket = loop {
            placed = match placed {
                Placed::Cached(generation, conn) => match open(generation, conn).await {
                    Ok(stream) => return Ok(stream),
                    Err(_) => {
                        self.place(peer, channel, |driver, now| {
                            Ok(driver.handle_open_failed(now, peer, channel, generation))
                        })
                        .await?
                    }
                },
                Placed::Dial(ticket, timeout) => break (ticket, timeout),
            };
        };
        let (generation, conn) = self.dial_cached(addr, alpn, channel, ticket).await?;
        serve(self, generation, conn.clone());
        match open(generation, conn).await {
            Ok(stream) => Ok(stream),
            Err(error) => {
                // The fresh connection could not open the stream: it is dead, as a cached one
                // that fails is (the next open dials afresh). This open ends with the error;
                // it does not dial again itself.
                self.drive(|driver, now| {
                    driver.handle_connection_closed(now, peer, channel, generation);
                });
                Err(NodeError::Connect(error.into()))
            }
        }
    }

    /// Where the machine places an open to `peer` on `channel` (the allow-list for `path`
    /// first): the cached connection or a dial; while another open's dial is in flight, it
    /// waits for that dial ([`Inner::place`]).
    async fn open_verdict(
        self: &Arc<Self>,
        peer: NodeId,
        path: Path,
        channel: Channel,
    ) -> Result<Placed, NodeError> {
        self.place(peer, channel, |driver, now| {
            driver.handle_open(now, peer, path, channel)
        })
        .await
    }

    /// Asks the machine where an open to `peer` on `channel` goes (`ask`: the first question)
    /// and follows its answer until the open is placed: each [`Open::Wait`] asks again once
    /// the machine's state moved (watched from before `ask`, so no move is missed); a failed
    /// dial it waited on, or the node closing, is its error.
    async fn place(
        self: &Arc<Self>,
        peer: NodeId,
        channel: Channel,
        ask: impl FnOnce(&mut Driver<Connection>, Time) -> Result<Open<Connection>, Refused>,
    ) -> Result<Placed, NodeError> {
        let mut changes = self.gate.changes.subscribe();
        let mut verdict = self.drive(ask)?;
        // Dropped while waiting on a dial, the open reports it went away.
        let mut waiting = OpenWait {
            inner: self.clone(),
            peer,
            channel,
            ticket: None,
        };
        loop {
            waiting.ticket = None;
            verdict = match verdict {
                Open::Cached(generation, conn) => return Ok(Placed::Cached(generation, conn)),
                Open::Dial { ticket, timeout } => return Ok(Placed::Dial(ticket, timeout)),
                Open::Failed => return Err(NodeError::Connect(Box::new(WaitedDialFailed))),
                Open::Closed => return Err(NodeError::Closed),
                Open::Wait(ticket) => {
                    waiting.ticket = Some(ticket);
                    changes.changed().await.map_err(|_| NodeError::Closed)?;
                    self.drive(|driver, now| driver.handle_open_waited(now, peer, channel, ticket))
                }
            };
        }
    }

    /// Dials `addr` on `alpn`, as the machine's [`Open::Dial`] ordered under `ticket`, and
    /// caches the connection under `channel`: its generation and the connection. A failed or
    /// dropped dial is reported, so the opens waiting on it go on.
    async fn dial_cached(
        self: &Arc<Self>,
        addr: EndpointAddr,
        alpn: &[u8],
        channel: Channel,
        (ticket, timeout): (DialTicket, Duration),
    ) -> Result<(Generation, Connection), NodeError> {
        let peer = *addr.id.as_bytes();
        let mut dial = OpenDial {
            inner: self.clone(),
            peer,
            channel,
            ticket,
            end: Some(DialEnd::Abandoned),
        };
        let conn = match tokio::time::timeout(timeout, self.endpoint.connect(addr, alpn)).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(error)) => {
                dial.end = Some(DialEnd::Failed);
                return Err(NodeError::Connect(error.into()));
            }
            Err(_) => {
                dial.end = Some(DialEnd::Failed);
                return Err(NodeError::Connect(Box::new(DialTimedOut(timeout))));
            }
        };
        dial.end = None;
        let generation = self
            .drive(|driver, now| driver.handle_connected(now, peer, channel, conn.clone()))
            .ok_or(NodeError::Closed)?;
        Ok((generation, conn))
    }

    /// A bidirectional stream to `addr` on the connection cached for `channel` (the
    /// switch's or the substrate's), whichever side dialed it; with none (or a dead one), a
    /// fresh connection is dialed on `alpn`, cached, and served as an accepted one is. With
    /// it, the handle that reports that connection unresponsive.
    pub(super) async fn open_bi_cached(
        self: &Arc<Self>,
        addr: EndpointAddr,
        channel: Channel,
        alpn: &[u8],
    ) -> Result<(Connection, SendStream, RecvStream, ConnectionCut), NodeError> {
        let peer = *addr.id.as_bytes();
        self.open_stream_to(
            addr,
            channel.path(),
            channel,
            alpn,
            |generation, conn| async move {
                let (send, recv) = conn.open_bi().await?;
                let cut = ConnectionCut {
                    inner: Arc::downgrade(self),
                    peer,
                    channel,
                    generation,
                };
                Ok::<_, iroh::endpoint::ConnectionError>((conn, send, recv, cut))
            },
            |inner, generation, conn| inner.serve_bi(peer, channel, generation, conn),
        )
        .await
    }

    /// Serves a cached switch or substrate connection (accepted or dialed): each stream the
    /// peer opens on it is one switch connection (to the switch host's queue) or one
    /// substrate link (to the substrate's accept queue); a stream nobody here takes is
    /// stopped as the machine says. Reports the connection's end.
    fn serve_bi(
        self: &Arc<Self>,
        peer: NodeId,
        channel: Channel,
        generation: Generation,
        conn: Connection,
    ) {
        let inner = self.clone();
        self.spawn(async move {
            while let Ok((send, recv)) = conn.accept_bi().await {
                // Handed over in a task of its own: a full queue holds up that stream, not
                // the next one, nor the report of the connection's end.
                let (opened, conn) = (inner.clone(), conn.clone());
                inner.spawn(async move {
                    opened.stream_opened(peer, channel, &conn, send, recv).await;
                });
            }
            inner.drive(|driver, now| {
                driver.handle_connection_closed(now, peer, channel, generation)
            });
        });
    }

    /// A stream `peer` opened on its switch or substrate connection, handed to what serves it.
    async fn stream_opened(
        self: &Arc<Self>,
        peer: NodeId,
        channel: Channel,
        conn: &Connection,
        send: SendStream,
        mut recv: RecvStream,
    ) {
        match (channel, &self.switch_queue, &self.substrate_queue) {
            (Channel::Switch, Some(queue), _) => {
                let stream = QuicStream::new(conn.clone(), send, recv);
                match queue.send((hex(&peer), stream)).await {
                    Ok(()) => return,
                    // The host stopped taking switch streams.
                    Err(refused) => recv = (refused.0).1.into_recv(),
                }
            }
            (Channel::Substrate, _, Some(queue)) => {
                let local = peer_id_of(&self.endpoint.id());
                let remote = peer_id_of(&conn.remote_id());
                match substrate_link::link(conn, send, recv, &remote, &local) {
                    Ok(link) => {
                        // A stopped substrate drops the link (its halves end themselves).
                        let _ = queue.send((remote, link)).await;
                    }
                    Err(error) => debug!(%error, "substrate link not established"),
                }
                return;
            }
            _ => {}
        }
        // Nothing here takes streams on this channel (a switch that is no host, or one whose
        // host stopped taking them): the machine says how to stop it.
        self.judge(peer, channel)
            .stop(&mut recv, Unreadable::Unread);
    }

    /// The timer task: hands the machine its due timeouts.
    async fn timer_loop(self: Arc<Self>) {
        loop {
            let notified = self.gate.timer.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let due = self.gate.lock().driver.poll_timeout();
            match due {
                Some(at) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(self.gate.instant(at)) => {
                            self.drive(|driver, now| driver.handle_timeout(now));
                        }
                        () = &mut notified => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// Records `addr` as how to reach its peer, with its relays as hints.
    fn remember(self: &Arc<Self>, addr: &EndpointAddr) {
        let peer = *addr.id.as_bytes();
        let relays = relay_strings(addr);
        self.drive(|driver, now| driver.handle_relays_seen(now, peer, relays));
        self.gate.lock().addrs.record(peer, addr.clone());
    }

    /// `addr`, or with no relay of its own, with the relays last seen for its peer
    /// (docs/spec/driver.md §4.3: joins record relay hints and normalize seed addresses with them).
    fn normalized(&self, addr: EndpointAddr) -> EndpointAddr {
        let given = relay_strings(&addr);
        let relays = self
            .gate
            .lock()
            .driver
            .relays_for(addr.id.as_bytes(), &given);
        if relays == given {
            return addr;
        }
        relays
            .iter()
            .filter_map(|url| url.parse::<RelayUrl>().ok())
            .fold(addr, EndpointAddr::with_relay_url)
    }

    /// How to reach `peer`: the address last seen, normalized, or its key alone.
    fn address_of(&self, peer: &NodeId) -> Option<EndpointAddr> {
        let known = self.gate.lock().addrs.get(peer).cloned();
        match known {
            Some(addr) => Some(self.normalized(addr)),
            None => PublicKey::from_bytes(peer).ok().map(EndpointAddr::new),
        }
    }

    async fn accept_loop(self: Arc<Self>) {
        while let Some(incoming) = self.endpoint.accept().await {
            // The source whose share it counts against: its IP address when it came direct (a
            // relayed one counts against the bound alone).
            let source = match incoming.remote_addr() {
                iroh::endpoint::IncomingAddr::Ip(addr) => Some(addr.ip()),
                _ => None,
            };
            if !self.handshakes.lock().begin_from(source) {
                // Refused before anything is spent on it: no task, no TLS.
                incoming.refuse();
                continue;
            }
            let inner = self.clone();
            self.spawn(async move {
                let handshake = async {
                    let accepting = incoming.accept().ok()?;
                    let deadline =
                        Duration::from_millis(tether_core::limits::QUIC_HANDSHAKE_TIMEOUT_MS);
                    tokio::time::timeout(deadline, accepting).await.ok()?.ok()
                };
                let conn = handshake.await;
                inner.handshakes.lock().end_from(source);
                if let Some(conn) = conn {
                    inner.accepted(conn);
                }
            });
        }
    }

    /// An accepted connection: the machine admits and dispatches it by ALPN.
    fn accepted(self: &Arc<Self>, conn: Connection) {
        let peer = *conn.remote_id().as_bytes();
        let dispatch =
            self.drive(|driver, now| driver.handle_accepted(now, peer, conn.alpn(), conn.clone()));
        if let Some((code, reason)) = dispatch.close() {
            conn.close(code.into(), reason);
        }
        match dispatch {
            Dispatch::Refused(_) => warn!(peer = %hex(&peer), "unauthorized peer refused"),
            Dispatch::Actor(generation) => self.read_actor_connection(peer, generation, conn),
            Dispatch::Telemetry(generation) => self.serve_telemetry(peer, generation, conn),
            Dispatch::Protocol(index, generation) => {
                let Some(adapter) = self.adapters.get(usize::from(index)).cloned() else {
                    return;
                };
                self.serve_protocol(adapter, index, generation, peer, conn);
            }
            Dispatch::Switch(generation) => {
                self.serve_bi(peer, Channel::Switch, generation, conn);
            }
            Dispatch::Substrate(generation) => {
                self.serve_bi(peer, Channel::Substrate, generation, conn);
            }
            Dispatch::NoAdapter => {
                debug!(alpn = %String::from_utf8_lossy(conn.alpn()), "no adapter for this ALPN");
            }
            Dispatch::Full => {
                warn!(peer = %hex(&peer), "inbound connections at their bound: refused");
            }
        }
    }

    /// Collects the uni streams of a telemetry connection cached under `generation` (either
    /// side may publish on it); reports its end.
    fn serve_telemetry(self: &Arc<Self>, peer: NodeId, generation: Generation, conn: Connection) {
        let (inner, sink) = (self.clone(), self.telemetry_sinks.clone());
        self.spawn(async move {
            let (spawner, judge) = (inner.clone(), inner.judge(peer, Channel::Telemetry));
            telemetry::collect(conn, peer, sink, judge, move |stream| spawner.spawn(stream)).await;
            inner.drive(|driver, now| {
                driver.handle_connection_closed(now, peer, Channel::Telemetry, generation)
            });
        });
    }

    /// Serves the streams of a cached protocol connection; reports its end.
    fn serve_protocol(
        self: &Arc<Self>,
        adapter: Arc<protocol::Adapter>,
        index: u16,
        generation: Generation,
        peer: NodeId,
        conn: Connection,
    ) {
        let (inner, judge) = (self.clone(), self.judge(peer, Channel::Protocol(index)));
        self.spawn(async move {
            let spawner = inner.clone();
            adapter
                .serve(conn, peer, judge, move |task| spawner.spawn(task))
                .await;
            inner.drive(|driver, now| {
                driver.handle_connection_closed(now, peer, Channel::Protocol(index), generation)
            });
        });
    }

    /// Reads the streams of an actor connection cached under `generation`; reports its end.
    fn read_actor_connection(
        self: &Arc<Self>,
        peer: NodeId,
        generation: Generation,
        conn: Connection,
    ) {
        debug!(peer = %hex(&peer), generation = generation.get(), "connection cached");
        let inner = self.clone();
        self.spawn(
            async move {
                while let Ok(recv) = conn.accept_uni().await {
                    let reader = inner.clone();
                    inner.spawn(async move { reader.read_stream(peer, recv).await });
                }
                inner.drive(|driver, now| {
                    driver.handle_connection_closed(now, peer, Channel::Actor, generation)
                });
            }
            .instrument(tracing::debug_span!("reader", peer = %hex(&peer))),
        );
    }

    /// A cached connection (or none) and the machine's generation: the reader follows.
    fn adopt(self: &Arc<Self>, peer: NodeId, conn: Connection, generation: Option<Generation>) {
        if let Some(generation) = generation {
            self.read_actor_connection(peer, generation, conn);
        }
    }

    /// One frame: as [`Inner::send_run`] with a run of one, without the run's iterator
    /// layers (each moves the frame once more, which a lone 64 B frame feels).
    fn send(self: &Arc<Self>, frame: OutFrame) {
        {
            let queues = self.egress_read();
            if let Some(queue) = queues.get(&frame.to) {
                let frame = Queued::from(frame);
                let bytes = frame.bytes();
                let queued = queue.sender.push_sized(Slot::One(frame), bytes).is_ok();
                return self.enqueued(queue, u64::from(queued), u64::from(!queued));
            }
        }
        self.send_run(frame.to, std::iter::once(frame));
    }

    /// Queues frames all addressed to `peer`, in order.
    fn send_run(self: &Arc<Self>, peer: NodeId, frames: impl Iterator<Item = OutFrame>) {
        let mut frames = frames.peekable();
        // The hot path: the peer has a queue (it was admitted when the queue started, and the
        // allow-list is fixed). Its writer asks the machine for the connection per batch.
        {
            let queues = self.egress_read();
            if let Some(queue) = queues.get(&peer) {
                return self.enqueue(queue, frames);
            }
        }
        if frames.peek().is_none() {
            return;
        }
        if self.drive(|driver, now| driver.handle_send(now, peer)) != SendVerdict::Enqueue {
            // The slow path: each further frame is judged (and counted) as a lone send is.
            frames.next();
            for frame in frames {
                self.send(frame);
            }
            return;
        }
        let mut queues = self.egress_write();
        let fresh = !queues.contains_key(&peer);
        let queue = queues.entry(peer).or_insert_with(|| {
            let channel = HybridChannel::with_limits(
                self.egress_ring,
                self.egress_spill,
                EGRESS_SPILL_BYTES_MAX,
            );
            let queue = PeerQueue {
                sender: channel.sender(),
                wake: Arc::default(),
            };
            let (inner, wake) = (self.clone(), queue.wake.clone());
            self.spawn(
                async move { inner.write_peer(peer, channel, wake).await }
                    .instrument(tracing::debug_span!("writer", peer = %hex(&peer))),
            );
            queue
        });
        self.enqueue(queue, frames);
        if fresh {
            bump(&self.counters.queues_started);
            self.egress_count.send_replace(queues.len());
        }
    }

    /// Pushes `frames` into `queue`: counted and the writer woken once for all of them. Runs
    /// of up to [`EGRESS_RUN_FRAMES_MAX`] go into one ring slot each; a run the ring has no
    /// room for is pushed frame by frame, as lone frames are.
    fn enqueue(self: &Arc<Self>, queue: &PeerQueue, frames: impl Iterator<Item = OutFrame>) {
        let (mut enqueued, mut full) = (0u64, 0u64);
        let mut count = |frames: u64, queued: bool| {
            if queued {
                enqueued += frames;
            } else {
                full += frames;
            }
        };
        let mut frames = frames.map(Queued::from).peekable();
        while let Some(first) = frames.next() {
            if frames.peek().is_none() {
                let bytes = first.bytes();
                count(1, queue.sender.push_sized(Slot::One(first), bytes).is_ok());
                break;
            }
            let mut run = Vec::with_capacity(EGRESS_RUN_FRAMES_MAX);
            run.push(first);
            run.extend(frames.by_ref().take(EGRESS_RUN_FRAMES_MAX - 1));
            let frames_in_run = run.len() as u64;
            match queue.sender.push_ring(Slot::Run(run)) {
                Ok(()) => count(frames_in_run, true),
                Err(refused) => {
                    for frame in refused.into_frames() {
                        let bytes = frame.bytes();
                        count(1, queue.sender.push_sized(Slot::One(frame), bytes).is_ok());
                    }
                }
            }
        }
        self.enqueued(queue, enqueued, full);
    }

    /// After pushing into `queue`: `enqueued` frames went in (counted, the writer woken once)
    /// and `full` found no room (the machine counts the drops).
    fn enqueued(self: &Arc<Self>, queue: &PeerQueue, enqueued: u64, full: u64) {
        if enqueued > 0 {
            queue.wake.wake();
            self.counters
                .enqueued
                .fetch_add(enqueued, Ordering::Relaxed);
        }
        if full > 0 {
            self.drive(|driver, now| driver.handle_egress_full(now, full));
        }
    }

    /// The driver retired `peer`'s writer: its queue is torn down unless a frame arrived
    /// (then the writer goes on and reports again when it drains). Producers push only under
    /// the egress lock, so once the queue is out of the map nothing can be pushed into it.
    /// `true` when the writer should end.
    fn retire_queue(&self, peer: &NodeId, wake: &Arc<WriterWake>, queue: &Drain) -> bool {
        let mut queues = self.egress_write();
        if !queue.is_empty() {
            return false;
        }
        if queues
            .get(peer)
            .is_some_and(|queue| Arc::ptr_eq(&queue.wake, wake))
        {
            queues.remove(peer);
            bump(&self.counters.queues_retired);
            self.egress_count.send_replace(queues.len());
            debug!(peer = %hex(peer), "idle egress queue torn down");
        }
        true
    }

    fn egress_read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<NodeId, PeerQueue>> {
        self.egress.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn egress_write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<NodeId, PeerQueue>> {
        self.egress.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// One dial attempt the machine ordered; the result goes back to it.
    async fn dial(self: Arc<Self>, peer: NodeId, attempt: u32, timeout: Duration) {
        let Some(addr) = self.address_of(&peer) else {
            let failed = Err("invalid node id".to_owned());
            self.drive(|driver, now| driver.handle_dialed(now, peer, failed));
            return;
        };
        debug!(peer = %hex(&peer), attempt, "dialing");
        let connect = self.endpoint.connect(addr, &self.actor_alpn);
        let result = match tokio::time::timeout(timeout, connect).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err("attempt timed out".to_owned()),
        };
        let conn = result.as_ref().ok().cloned();
        let generation = self.drive(|driver, now| driver.handle_dialed(now, peer, result));
        if let Some(conn) = conn {
            self.adopt(peer, conn, generation);
        }
    }

    /// The writer of one peer: drains its queue onto one long-lived uni stream of the
    /// connection the machine names per batch; reports idleness, failures and cache misses.
    async fn write_peer(
        self: Arc<Self>,
        peer: NodeId,
        channel: HybridChannel<Slot>,
        wake: Arc<WriterWake>,
    ) {
        let mut queue = Drain::new(channel);
        let mut stream: Option<(Generation, SendStream)> = None;
        let mut buf = BytesMut::new();
        loop {
            if queue.is_empty() {
                self.drive(|driver, now| driver.handle_writer_idle(now, peer));
                let sleep = wake.sleep(|| !queue.is_empty() || wake.retire.load(Ordering::Acquire));
                // While idle, a peer that stops the stream is reported now, not at the next
                // frame (a closed connection is the reader's to report); the machine judges it.
                let stopped = async {
                    match &stream {
                        Some((generation, send)) => match send.stopped().await {
                            Ok(Some(_)) => *generation,
                            _ => std::future::pending().await,
                        },
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = sleep => {}
                    generation = stopped => {
                        stream = None;
                        self.drive(|driver, now| {
                            driver.handle_stream_stopped(now, peer, generation)
                        });
                        continue;
                    }
                }
            }
            if wake.retire.swap(false, Ordering::AcqRel) && self.retire_queue(&peer, &wake, &queue)
            {
                return;
            }
            // The latency bound: wait this long for more frames to share the write (zero:
            // one scheduler turn, so frames enqueued in the same burst go together).
            if self.batch_delay.is_zero() {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(self.batch_delay).await;
            }
            loop {
                let (mut frames, mut swim, mut unencodable) = (0u64, false, 0u64);
                buf.clear();
                {
                    let routes = self.routes_now();
                    // A batch is usually one tag over and over: look the set up once per run.
                    let mut last_tag: Option<std::borrow::Cow<'static, str>> = None;
                    while buf.len() < NODE_WRITE_BATCH_BYTES {
                        let Some(frame) = queue.pop() else { break };
                        let encoded = encode_record(
                            frame.dest.as_bytes(),
                            &frame.type_tag,
                            &frame.payload,
                            self.payload_bytes_max,
                            &mut buf,
                        );
                        if encoded.is_err() {
                            unencodable += 1;
                            continue;
                        }
                        frames += 1;
                        if !swim && last_tag.as_ref() != Some(&frame.type_tag) {
                            swim = routes.is_swim(&frame.type_tag);
                            last_tag = Some(frame.type_tag);
                        }
                    }
                }
                if unencodable > 0 {
                    self.drive(|driver, now| driver.handle_unencodable(now, unencodable));
                }
                if frames == 0 {
                    break;
                }
                let on = stream.as_ref().map(|(generation, _)| *generation);
                let Some(batch) =
                    self.drive(|driver, now| driver.handle_batch(now, peer, frames, swim, on))
                else {
                    continue;
                };
                let generation = batch.generation;
                if batch.open_stream {
                    stream = batch.conn.open_uni().await.ok().map(|s| (generation, s));
                }
                // The batch is handed to the stream as it is (no copy into the stream's
                // buffer); `buf` keeps the rest of its allocation for the next batch.
                let batch = buf.split().freeze();
                let written = match &mut stream {
                    Some((_, send)) => send.write_chunk(batch).await.is_ok(),
                    None => false,
                };
                if written {
                    self.counters.written.fetch_add(frames, Ordering::Relaxed);
                } else {
                    stream = None;
                    self.drive(|driver, now| {
                        driver.handle_write_failed(now, peer, generation, frames, swim)
                    });
                }
            }
        }
    }

    /// Decodes actor records from one stream and routes each; a malformed stream is reported
    /// to the machine, which says whether to stop it (the connection stays).
    async fn read_stream(self: Arc<Self>, peer: NodeId, mut recv: RecvStream) {
        let mut memo = RouteMemo::new();
        let mut decoder =
            StreamDecoder::new(ActorDecoder::with_payload_bytes_max(self.payload_bytes_max));
        loop {
            match recv.read_chunk(NODE_READ_CHUNK_BYTES).await {
                Ok(Some(chunk)) => decoder.push_bytes(chunk),
                Ok(None) | Err(_) => return,
            }
            // One snapshot of the tables per chunk (the bridge may change them meanwhile).
            let routes = self.routes_now();
            memo.clear();
            let (mut received, mut delivered) = (0u64, 0u64);
            let fault = loop {
                match decoder.pop() {
                    Ok(Some(record)) => {
                        received += 1;
                        delivered += u64::from(self.deliver(peer, &routes, &mut memo, record));
                    }
                    Ok(None) => break None,
                    Err(error) => break Some(error),
                }
            };
            self.counters
                .received
                .fetch_add(received, Ordering::Relaxed);
            self.counters
                .delivered
                .fetch_add(delivered, Ordering::Relaxed);
            if let Some(error) = fault {
                let fatal = error.error.is_fatal();
                let verdict = self.drive(|driver, now| {
                    driver.handle_stream_fault(now, peer, Channel::Actor, fatal)
                });
                if let StreamVerdict::Stop(code) = verdict {
                    let _ = recv.stop(code.into());
                    return;
                }
            }
        }
    }

    /// A snapshot of the routing tables.
    fn routes_now(&self) -> Arc<Routes<ActorAddr>> {
        self.routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Routes one record (core's `Routes`) and hands it to the bridge; true when delivered.
    /// A drop is counted by the machine before the next record is handled;
    /// `frames_received` and `frames_delivered` are added once per chunk.
    fn deliver(
        self: &Arc<Self>,
        peer: NodeId,
        routes: &Routes<ActorAddr>,
        memo: &mut RouteMemo<ActorAddr>,
        record: ActorRecord,
    ) -> bool {
        let dest = match routes.inbound_memo(memo, &ActorAddr(*record.dest()), record.tag_bytes()) {
            Inbound::Protocol(actor) | Inbound::Actor(actor) => actor,
            Inbound::Driver => {
                let tag = memo.tag().unwrap_or_default();
                let payload = record.into_payload();
                // Signatures are checked here, before the node's lock is taken.
                let checked = DriverRecord::check(tag, &payload);
                self.drive(|driver, now| driver.handle_checked_record(now, peer, checked));
                return false;
            }
            Inbound::Drop(reason) => {
                self.drive(|driver, now| driver.handle_inbound_drop(now, reason));
                return false;
            }
        };
        // The memo holds this record's tag, checked once per run.
        let tag = memo.tag().unwrap_or_default();
        let ok = self
            .bridge
            .as_ref()
            .is_some_and(|bridge| bridge.deliver_raw(dest, tag, record.into_payload()).is_ok());
        if !ok {
            self.drive(|driver, now| driver.handle_inbound_drop(now, DropReason::DeliveryFailed));
        }
        ok
    }

    /// One join attempt the machine ordered: connect, write a `JoinRequest` to the seed's
    /// mailbox; each step goes back to the machine.
    async fn join_attempt(self: Arc<Self>, peer: NodeId, attempt: u32, timeout: Duration) {
        let Some(seed) = self.address_of(&peer) else {
            self.drive(|driver, now| driver.handle_join_failed(now, peer, "invalid node id"));
            return;
        };
        debug!(seed = %hex(&peer), attempt, "join attempt");
        let connect = self.endpoint.connect(seed, &self.actor_alpn);
        let conn = match tokio::time::timeout(timeout, connect).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(error)) => {
                let error = error.to_string();
                self.drive(|driver, now| driver.handle_join_failed(now, peer, error));
                return;
            }
            Err(_) => {
                self.drive(|driver, now| driver.handle_join_failed(now, peer, "attempt timed out"));
                return;
            }
        };
        self.drive(|driver, now| driver.handle_join_connected(now, peer));
        match self.write_join_request(&conn, peer).await {
            Ok(()) => {
                let generation =
                    self.drive(|driver, now| driver.handle_join_sent(now, peer, conn.clone()));
                self.adopt(peer, conn, generation);
            }
            Err(error) => self.drive(|driver, now| driver.handle_join_failed(now, peer, error)),
        }
    }

    /// Writes a `JoinRequest` record (payload: this node's id) to the seed's mailbox.
    async fn write_join_request(&self, conn: &Connection, seed: NodeId) -> Result<(), String> {
        let record = tether_core::driver::join_request(seed, self.local);
        let mut buf = BytesMut::new();
        record
            .encode(self.payload_bytes_max, &mut buf)
            .map_err(|e| e.to_string())?;
        let mut send = conn.open_uni().await.map_err(|e| e.to_string())?;
        send.write_all(&buf).await.map_err(|e| e.to_string())?;
        send.finish().map_err(|e| e.to_string())?;
        Ok(())
    }
}
