//! Building a node: its settings ([`NodeBuilder`]) and what `bind` starts.

use super::*;

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
    peer_book: Option<std::path::PathBuf>,
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
            peer_book: None,
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
    /// the next open dials afresh. Opening the stream on the connection has the same bound
    /// ([`OpenTimedOut`]).
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

    /// Keeps where each substrate peer can be reached in the file at `path`, across restarts:
    /// the addresses given to [`Node::add_substrate_peer`] and those inbound substrate links
    /// came from. After a restart the substrate dials every peer with durable state whose
    /// address the book has, as soon as that state is loaded, so a peer whose link went to
    /// the dead process gets a fresh one at once instead of waiting for QUIC's idle timeout.
    /// A file that cannot be read fails [`NodeBuilder::bind`] with [`NodeError::PeerBook`].
    pub fn peer_book(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.peer_book = Some(path.into());
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
        // Read before anything binds: a book that cannot be read binds nothing.
        let book = match &self.peer_book {
            Some(path) => {
                super::peer_book::SharedBook::open(path.clone()).map_err(NodeError::PeerBook)?
            }
            None => super::peer_book::SharedBook::default(),
        };
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
        let local = NodeId(*endpoint.id().as_bytes());
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
            valid_peer: |peer| PublicKey::from_bytes(peer.as_bytes()).is_ok(),
            failed_opens_max: tether_core::limits::FAILED_OPENS_MAX,
            relay_hint_peers_max: tether_core::limits::RELAY_HINT_PEERS_MAX,
            inbound_connections_max: self.inbound_connections_max,
            announce_batch: tether_core::limits::ANNOUNCE_CLAIMS_BATCH_MAX,
            claim_authorizer: self.claim_authorizer,
        }));
        let substrate_peers = substrate_link::SubstratePeers::new(book);
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
                routes_version: AtomicU64::new(0),
                bridge: self.bridge,
                payload_bytes_max: self.payload_bytes_max,
                batch_delay: self.batch_delay,
                egress_ring: self.egress_ring,
                egress_spill: self.egress_spill,
                egress_count: watch::channel(0).0,
                relay_urls,
                actor_alpn: self.actor_alpn,
                egress: CachePadded::default(),
                id: egress::next_node_id(),
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
        info!(node = %local, "node bound");
        Ok(Node { inner })
    }
}
