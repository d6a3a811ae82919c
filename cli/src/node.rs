//! `tether node`: one long-running node. Its data directory holds its secret key (so its id
//! survives restarts) and its SQLite store (so its outbox and dedupe ledger do); it prints its
//! ticket, talks to peers through the substrate, and takes commands on stdin.
//!
//! With `--json` every line on stdout is one JSON object with an `event` key (the contract
//! `tether demo` and scripts rely on); without it, the same events as sentences.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use iroh_tickets::endpoint::EndpointTicket;
use serde_json::{json, Value};
use tether::iroh::{EndpointAddr, PublicKey};
use tether::node::{
    node_id_of, Node, NodeError, RelayMode, RelayUrl, TelemetryIngress, TelemetrySource,
};
use tether::store::{LogOptions, LogStore, SqliteStore, Store, StoreError};

use crate::StoreChoice;
use tether::substrate::{
    AllowAll, Authorizer, BuildError, CommandError, Error, Inbound, ObjKind, Peer, PeerId, Queue,
    Session, Substrate,
};
use tether::switch::host::Host;
use tether::switch::{Switch, SwitchError};
use tether_core::wire::telemetry::{ChannelDescriptor, Header, StreamDescriptor, TelemetryFrame};
use tokio::io::{AsyncBufReadExt, BufReader};

/// The capability every `tether node` serves as a switch host: its input, upper-cased.
pub(crate) const UPPER: &str = "cap:in=media:text;out=media:upper";
/// The telemetry stream every `tether node` publishes: one event per message its application
/// consumed (`<obj>:<seq>`), to each subscribed collector.
pub(crate) const DELIVERIES: &str = "deliveries";
/// The switch slot the peer's host is attached under.
const PEER_SLOT: &str = "peer";

/// What `tether node` was asked to do.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    /// The data directory (created when missing).
    pub(crate) data: PathBuf,
    /// The socket to listen on (default: a free port on 127.0.0.1).
    pub(crate) listen: Option<SocketAddr>,
    /// Tickets of peers to connect to at start.
    pub(crate) connect: Vec<String>,
    /// JSON lines instead of sentences.
    pub(crate) json: bool,
    /// Where the substrate's state lives in `data`.
    pub(crate) store: StoreChoice,
    /// The relay to home on.
    pub(crate) relay: RelayChoice,
    /// Where to serve metrics in Prometheus text format.
    pub(crate) metrics: Option<SocketAddr>,
    /// The log store's compaction threshold (`LogOptions::compact_bytes_min`), when not the
    /// default.
    pub(crate) log_compact_bytes: Option<u64>,
}

/// Histogram buckets of the latency metrics, in milliseconds.
const LATENCY_BUCKETS_MS: [f64; 14] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0,
];

/// Serves everything published through the `metrics` facade on `addr` (Prometheus text
/// format, `GET /metrics`), latencies as histograms.
fn serve_metrics(addr: SocketAddr) -> Result<(), NodeCliError> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets(&LATENCY_BUCKETS_MS)
        .and_then(|builder| builder.install())
        .map_err(|error| NodeCliError::Metrics(error.to_string()))
}

/// `--relay`: a relay URL, iroh's public relays, or none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RelayChoice {
    /// Direct addresses only.
    Disabled,
    /// iroh's public relays.
    Default,
    /// This relay.
    Url(RelayUrl),
}

impl RelayChoice {
    fn mode(&self) -> RelayMode {
        match self {
            RelayChoice::Disabled => RelayMode::Disabled,
            RelayChoice::Default => RelayMode::Default,
            RelayChoice::Url(url) => RelayMode::custom([url.clone()]),
        }
    }
}

/// Parses `--relay`.
pub(crate) fn parse_relay(text: &str) -> Result<RelayChoice, String> {
    match text {
        "disabled" => Ok(RelayChoice::Disabled),
        "default" => Ok(RelayChoice::Default),
        url => url.parse().map(RelayChoice::Url).map_err(|error| {
            format!("{url:?} is not a relay URL, `default` or `disabled`: {error}")
        }),
    }
}

/// How long `tether node` waits to be homed on its relay before it gives up.
const RELAY_HOMING_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// Runs iroh's relay server on `listen` over plain HTTP until interrupted, printing its URL.
pub(crate) async fn run_relay(listen: SocketAddr, json: bool) -> Result<(), NodeCliError> {
    let out = Out { json };
    let mut config = iroh_relay::server::ServerConfig::default();
    config.relay = Some(iroh_relay::server::RelayConfig::new(listen));
    let server = iroh_relay::server::Server::spawn(config)
        .await
        .map_err(|error| NodeCliError::Relay(error.to_string()))?;
    let addr = server
        .http_addr()
        .ok_or_else(|| NodeCliError::Relay("the relay serves no HTTP".into()))?;
    let url = format!("http://{addr}");
    out.emit("relay", json!({ "url": url }), || {
        format!("relay ready; nodes home on it with:\n  tether node --data DIR --relay {url}")
    });
    let _ = tokio::signal::ctrl_c().await;
    server
        .shutdown()
        .await
        .map_err(|error| NodeCliError::Relay(error.to_string()))
}

/// Why the node could not start or go on.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NodeCliError {
    /// The data directory or the key in it.
    #[error("cannot use the data directory {path}: {source}")]
    Data {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The key file holds something else than 64 hex digits.
    #[error("the key file {0} is not a secret key (64 hex digits)")]
    BadKey(PathBuf),
    /// The store would not open.
    #[error("cannot open the store: {0}")]
    Store(#[from] StoreError),
    /// The endpoint would not bind, or the substrate not start.
    #[error("cannot start the node: {0}")]
    Node(#[from] NodeError),
    /// The substrate would not start.
    #[error("cannot start the substrate: {0}")]
    Substrate(#[from] BuildError),
    /// A ticket that does not parse.
    #[error(transparent)]
    Ticket(#[from] TicketError),
    /// The metrics endpoint would not start.
    #[error("cannot serve metrics: {0}")]
    Metrics(String),
    /// The relay server would not start or stop cleanly.
    #[error("relay: {0}")]
    Relay(String),
    /// No relay of `--relay` answered within the deadline.
    #[error("no relay answered within {0:?}: is `--relay` right and the relay up?")]
    Offline(std::time::Duration),
}

/// A ticket that does not parse.
#[derive(Debug, thiserror::Error)]
#[error("{ticket:?} is not a ticket (expected an iroh endpoint ticket, or <node id in hex>@<ip:port>[,<ip:port>...]): {why}")]
pub(crate) struct TicketError {
    ticket: String,
    why: &'static str,
}

/// A node's ticket: iroh's endpoint ticket for its address (its id, its home relay when it has
/// one, the sockets it listens on), so iroh's own tools read it.
pub(crate) fn ticket(node: &Node) -> String {
    EndpointTicket::new(node.endpoint_addr()).to_string()
}

/// Parses a ticket: an iroh endpoint ticket (see [`ticket`]), or `<hex id>@<ip:port>[,...]`.
pub(crate) fn parse_ticket(text: &str) -> Result<EndpointAddr, TicketError> {
    let fail = |why| TicketError {
        ticket: text.to_owned(),
        why,
    };
    let text = text.trim();
    if text.starts_with("endpoint") {
        let ticket: EndpointTicket = text
            .parse()
            .map_err(|_| fail("not a valid iroh endpoint ticket"))?;
        return Ok(ticket.endpoint_addr().clone());
    }
    let (id, sockets) = text.split_once('@').ok_or(fail("no '@'"))?;
    let mut key = [0u8; 32];
    hex::decode_to_slice(id, &mut key).map_err(|_| fail("the id is not 64 hex digits"))?;
    let key = PublicKey::from_bytes(&key).map_err(|_| fail("the id is not a node key"))?;
    let mut addr = EndpointAddr::new(key);
    for socket in sockets.split(',').filter(|s| !s.is_empty()) {
        let socket: SocketAddr = socket
            .parse()
            .map_err(|_| fail("a socket is not ip:port"))?;
        addr = addr.with_ip_addr(socket);
    }
    Ok(addr)
}

/// Reads the node's secret key from `DIR/secret.key`, or makes one and keeps it there.
fn secret_key(data: &Path) -> Result<[u8; 32], NodeCliError> {
    let path = data.join("secret.key");
    let io = |source| NodeCliError::Data {
        path: path.clone(),
        source,
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let mut key = [0u8; 32];
            hex::decode_to_slice(text.trim(), &mut key)
                .map_err(|_| NodeCliError::BadKey(path.clone()))?;
            Ok(key)
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            let key = tether::iroh::SecretKey::generate().to_bytes();
            let temp = data.join("secret.key.new");
            std::fs::write(&temp, hex::encode(key)).map_err(io)?;
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(0o600))
                    .map_err(io)?;
            }
            std::fs::rename(&temp, &path).map_err(io)?;
            Ok(key)
        }
        Err(error) => Err(io(error)),
    }
}

/// Prints events, as JSON lines or sentences.
#[derive(Clone, Copy)]
struct Out {
    json: bool,
}

impl Out {
    fn emit(&self, event: &str, fields: Value, sentence: impl FnOnce() -> String) {
        if self.json {
            let mut object = serde_json::Map::new();
            object.insert("event".into(), event.into());
            if let Value::Object(fields) = fields {
                object.extend(fields);
            }
            println!("{}", Value::Object(object));
        } else {
            println!("{}", sentence());
        }
    }

    fn error(&self, command: &str, message: impl std::fmt::Display) {
        let message = message.to_string();
        self.emit(
            "error",
            json!({ "command": command, "message": message }),
            || format!("{command}: {message}"),
        );
    }
}

fn text(body: &[u8]) -> String {
    String::from_utf8_lossy(body).into_owned()
}

fn short(peer: &PeerId) -> &str {
    &peer.as_str()[..peer.as_str().len().min(8)]
}

/// Runs the node until stdin ends or says `quit`.
pub(crate) async fn run(options: Options) -> Result<(), NodeCliError> {
    let out = Out { json: options.json };
    std::fs::create_dir_all(&options.data).map_err(|source| NodeCliError::Data {
        path: options.data.clone(),
        source,
    })?;
    let key = secret_key(&options.data)?;
    // The log store itself, for its counters in `stats`.
    let mut log = None;
    let store: Arc<dyn Store> = match options.store {
        StoreChoice::Sqlite => Arc::new(SqliteStore::open(options.data.join("store.sqlite3"))?),
        StoreChoice::Log => {
            let mut log_options = LogOptions::default();
            if let Some(bytes) = options.log_compact_bytes {
                log_options.compact_bytes_min = bytes;
            }
            let store = LogStore::open_with(options.data.join("store.log"), log_options)?;
            log = Some(store.clone());
            Arc::new(store)
        }
    };
    let listen = options
        .listen
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
    let (sink, collected) = tokio::sync::mpsc::channel(256);
    let node = Node::builder()
        .secret_key(key)
        .bind_addr(listen)
        .relay_mode(options.relay.mode())
        .substrate()
        .peer_book(options.data.join("peers"))
        .switch_host()
        .telemetry_sink(sink)
        .bind()
        .await?;
    if let Some(mut connections) = node.switch_connections() {
        tokio::spawn(async move {
            while let Some((_switch, stream)) = connections.recv().await {
                tokio::spawn(upper_host().serve(stream));
            }
        });
    }
    let deliveries =
        node.telemetry_source(DELIVERIES, deliveries_header(*node.node_id().as_bytes()));
    tokio::spawn(print_telemetry(out, collected));
    let substrate = node
        .substrate_builder()?
        .store(store)
        .authorize(Authorizer::new(AllowAll))
        .start()?;
    if let Some(addr) = options.metrics {
        serve_metrics(addr)?;
        // The node's counters are published when read: read them each second for the
        // scrapes' sake, for as long as the process runs.
        let node = node.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(std::time::Duration::from_secs(1));
            loop {
                every.tick().await;
                node.snapshot();
            }
        });
        out.emit("metrics", json!({ "addr": addr.to_string() }), || {
            format!("metrics at http://{addr}/metrics")
        });
    }
    // Homed on the relay first, so that the ticket carries it.
    tokio::time::timeout(RELAY_HOMING_DEADLINE, node.online())
        .await
        .map_err(|_| NodeCliError::Offline(RELAY_HOMING_DEADLINE))?;
    let id = hex::encode(node.node_id());
    let ticket = ticket(&node);
    out.emit("ready", json!({ "id": id, "ticket": ticket }), || {
        format!("node {id} ready; others connect with:\n  tether node --data DIR --connect {ticket}\ntype 'help' for commands")
    });
    let mut shell = Shell {
        out,
        node,
        substrate,
        peer: None,
        peer_addr: None,
        objects: BTreeMap::new(),
        log,
        switch: Arc::new(Router {
            switch: Switch::builder().start(),
            attach: tokio::sync::Mutex::new(()),
        }),
        flows: 0,
    };
    for ticket in &options.connect {
        shell.connect(ticket)?;
    }
    if let Some(mut inbound) = shell.substrate.inbound() {
        tokio::spawn(async move {
            let mut consumed = 0u64;
            while let Some(item) = inbound.recv().await {
                serve(out, item, &deliveries, &mut consumed).await;
            }
        });
    }
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if !shell.command(line.trim()).await {
            break;
        }
    }
    shell.switch.switch.close().await;
    shell.substrate.shutdown().await;
    shell.node.close().await;
    out.emit("bye", json!({}), || "bye".into());
    Ok(())
}

/// The switch host every node runs: [`UPPER`] answers its input upper-cased.
fn upper_host() -> Host {
    Host::new("tether-node").handler(UPPER, |mut request| async move {
        let input = request.read_all().await;
        let _ = request
            .respond("out", "media:upper", [input.to_ascii_uppercase()])
            .await;
        let _ = request.end().await;
    })
}

/// The header of the [`DELIVERIES`] stream (the flow id is each subscription's own).
fn deliveries_header(node_id: [u8; 32]) -> Header {
    let started_at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64);
    Header {
        flow_id: [0; 16],
        token: bytes::Bytes::new(),
        stream: StreamDescriptor {
            name: DELIVERIES.into(),
            node_id,
            started_at_ms,
            labels: Vec::new(),
        },
        channels: vec![ChannelDescriptor {
            channel_id: 1,
            name: "consumed".into(),
            content_type: "text/plain".into(),
            labels: Vec::new(),
        }],
    }
}

/// Prints what subscribed telemetry streams bring: one line per stream opened or ended, one
/// per batch of events.
async fn print_telemetry(out: Out, mut collected: tokio::sync::mpsc::Receiver<TelemetryIngress>) {
    while let Some(item) = collected.recv().await {
        match item {
            TelemetryIngress::Opened { peer, header } => {
                let (peer, stream) = (hex::encode(peer), header.stream.name);
                out.emit(
                    "telemetry_opened",
                    json!({ "peer": peer, "stream": stream }),
                    || format!("telemetry stream {stream} of {} open", &peer[..8]),
                );
            }
            TelemetryIngress::Events { peer, frames, .. } => {
                let peer = hex::encode(peer);
                let last = frames.last().map(|frame| text(&frame.payload));
                let count = frames.len();
                out.emit(
                    "telemetry",
                    json!({ "peer": peer, "events": count, "last": last }),
                    || {
                        format!(
                            "telemetry from {}: {count} event(s), last {last:?}",
                            &peer[..8]
                        )
                    },
                );
            }
            TelemetryIngress::Ended { peer, .. } => {
                let peer = hex::encode(peer);
                out.emit("telemetry_ended", json!({ "peer": peer }), || {
                    format!("telemetry stream of {} ended", &peer[..8])
                });
            }
            TelemetryIngress::Fault { peer, kind, .. } => {
                out.error(
                    "telemetry",
                    format!("a stream of {} broke: {kind}", hex::encode(peer)),
                );
            }
            _ => {}
        }
    }
}

/// What peers ask of this node: opens are accepted, messages printed then consumed (and
/// counted on the [`DELIVERIES`] stream), requests answered with `re:` and their body.
async fn serve(out: Out, item: Inbound, deliveries: &TelemetrySource, consumed: &mut u64) {
    match item {
        Inbound::Open(open) => {
            let (peer, obj, kind) = (open.peer.clone(), open.obj.clone(), open.kind);
            let kind = kind_name(kind);
            match open.accept().await {
                Ok(()) => out.emit(
                    "accepted",
                    json!({ "peer": peer.as_str(), "obj": obj, "kind": kind }),
                    || format!("{} opened {kind} {obj}", short(&peer)),
                ),
                Err(error) => out.error("accept", error),
            }
        }
        Inbound::Message(message) => {
            let body = text(&message.body);
            out.emit(
                "message",
                json!({
                    "peer": message.peer.as_str(),
                    "obj": message.obj,
                    "seq": message.seq,
                    "op": message.op_id,
                    "body": body,
                }),
                || {
                    format!(
                        "{} on {} #{}: {body}",
                        short(&message.peer),
                        message.obj,
                        message.seq
                    )
                },
            );
            // Printed first: a crash before the consume commits delivers it again after the
            // restart, with the same seq (the substrate's contract with its app).
            deliveries.emit(TelemetryFrame {
                channel_id: 1,
                position: *consumed,
                payload: format!("{}:{}", message.obj, message.seq).into(),
            });
            *consumed += 1;
            message.done();
        }
        Inbound::Request(request) => {
            let body = text(&request.body);
            out.emit(
                "request",
                json!({
                    "peer": request.peer.as_str(),
                    "obj": request.obj,
                    "seq": request.seq,
                    "body": body,
                }),
                || format!("{} asks on {}: {body}", short(&request.peer), request.obj),
            );
            let mut answer = b"re:".to_vec();
            answer.extend_from_slice(&request.body);
            if let Err(error) = request.end(answer).await {
                out.error("answer", error);
            }
        }
        Inbound::Closed { peer, obj, reason } => {
            let reason = reason.unwrap_or_default();
            out.emit(
                "closed",
                json!({ "peer": peer.as_str(), "obj": obj, "reason": reason }),
                || format!("{} closed {obj} ({reason})", short(&peer)),
            );
        }
        Inbound::Store { peer, op, error } => {
            let error = error.map_or_else(|| "recovered".into(), |error| error.to_string());
            out.emit(
                "store",
                json!({ "peer": peer.as_str(), "op": op.as_str(), "error": error }),
                || format!("store {} for {}: {error}", op.as_str(), short(&peer)),
            );
        }
        _ => {}
    }
}

fn kind_name(kind: ObjKind) -> &'static str {
    match kind {
        ObjKind::Session => "session",
        _ => "queue",
    }
}

enum Object {
    Queue(Queue),
    Session(Session),
}

/// The engine side of the request switch: the peer's host attached under [`PEER_SLOT`],
/// reattached (one dial at a time) when its connection died.
struct Router {
    switch: Switch,
    attach: tokio::sync::Mutex<()>,
}

/// Why a routed request failed.
#[derive(Debug, thiserror::Error)]
enum RouteError {
    #[error(transparent)]
    Switch(#[from] SwitchError),
}

impl Router {
    async fn call(
        &self,
        node: &Node,
        host: EndpointAddr,
        body: Vec<u8>,
    ) -> Result<Vec<u8>, RouteError> {
        {
            let _one_dial = self.attach.lock().await;
            if self.switch.slot_accepts_attach(PEER_SLOT).await {
                // Over the node's one cached connection to the host; a cut for silence
                // evicts it, so the next attach dials afresh.
                self.switch.connect_iroh(PEER_SLOT, node, host).await?;
            }
        }
        let call = self.switch.request(UPPER).await?;
        call.send_stream("in", "media:text", [body]).await?;
        call.finish().await?;
        Ok(call.collect().await?)
    }
}

struct Shell {
    out: Out,
    node: Node,
    substrate: Substrate,
    peer: Option<Peer>,
    peer_addr: Option<EndpointAddr>,
    objects: BTreeMap<String, Object>,
    /// The log store, when the node runs on one (its counters go in `stats`).
    log: Option<LogStore>,
    switch: Arc<Router>,
    flows: u64,
}

const HELP: &str = "commands:
  connect <ticket>             talk to that node (it becomes the peer the commands use)
  open <queue|session> <name>  open an object on the peer (resolves when it accepts)
  send <name> <text>           a durable message; 'acked' once it is durable at the peer
  req <name> <text>            a request on a session; 'reply' with the peer's answer
  route <text>                 a request through the request switch to the peer's host
                               ('routed' with its answer: the text upper-cased)
  subscribe                    collect the peer's 'deliveries' telemetry stream (one event
                               per message it consumed) over a fresh connection
  close <name> [reason]        close an object
  disconnect                   cut the link to the peer (nothing is lost; it comes back)
  stats                        counters of the node
  help                         this text
  quit                         shut down (so does the end of stdin)";

impl Shell {
    fn connect(&mut self, ticket: &str) -> Result<(), NodeCliError> {
        let addr = parse_ticket(ticket)?;
        let peer = self.node.add_substrate_peer(addr.clone())?;
        self.peer_addr = Some(addr);
        self.out
            .emit("connected", json!({ "peer": peer.as_str() }), || {
                format!("talking to {}", peer.as_str())
            });
        self.peer = Some(self.substrate.peer(&peer));
        Ok(())
    }

    /// Runs one command line; `false` to stop.
    async fn command(&mut self, line: &str) -> bool {
        let mut words = line.splitn(3, ' ');
        let verb = words.next().unwrap_or_default();
        let (first, rest) = (words.next(), words.next());
        match (verb, first, rest) {
            ("", _, _) => {}
            ("quit" | "exit", _, _) => return false,
            ("help", _, _) => self
                .out
                .emit("help", json!({ "text": HELP }), || HELP.into()),
            ("connect", Some(ticket), None) => {
                if let Err(error) = self.connect(ticket) {
                    self.out.error("connect", error);
                }
            }
            ("open", Some(kind), Some(name)) => self.open(kind, name).await,
            ("send", Some(name), body) => self.send(name, body.unwrap_or_default()),
            ("req", Some(name), body) => self.req(name, body.unwrap_or_default()),
            ("route", Some(first), rest) => {
                let body = match rest {
                    Some(rest) => format!("{first} {rest}"),
                    None => first.to_owned(),
                };
                self.route(body);
            }
            ("subscribe", None, None) => self.subscribe().await,
            ("close", Some(name), reason) => self.close(name, reason.unwrap_or("closed")).await,
            ("disconnect", None, None) => match &self.peer {
                Some(peer) => {
                    peer.disconnect();
                    self.out.emit(
                        "disconnected",
                        json!({ "peer": peer.id().as_str() }),
                        || "link cut; it comes back by itself".into(),
                    );
                }
                None => self
                    .out
                    .error("disconnect", "no peer yet: connect <ticket> first"),
            },
            ("stats", None, None) => {
                let snapshot = self.node.snapshot();
                let peers: Vec<String> = self
                    .substrate
                    .peers()
                    .iter()
                    .map(|peer| peer.as_str().to_owned())
                    .collect();
                // The current peer's connections: each path, and whether they send through a
                // relay or straight to an address now.
                let paths = self
                    .peer_addr
                    .as_ref()
                    .map(|addr| self.node.paths(&node_id_of(&addr.id)))
                    .unwrap_or_default();
                let route = |relay: bool| {
                    paths
                        .iter()
                        .any(|path| path.selected && path.relay == relay)
                };
                let via = match (route(true), route(false)) {
                    (_, true) => "direct",
                    (true, false) => "relay",
                    (false, false) => "none",
                };
                // The store's lock can be held for a while (a compaction's swap, a gc): read
                // its counters off the async workers.
                let log = match self.log.clone() {
                    Some(store) => tokio::task::spawn_blocking(move || store.stats())
                        .await
                        .ok(),
                    None => None,
                };
                let mut sentence = format!(
                    "{} substrate peer(s); actor frames enqueued {}, delivered {}; {} cached connection(s); to the peer: {via}",
                    peers.len(),
                    snapshot.frames_enqueued,
                    snapshot.frames_delivered,
                    snapshot.cache.len()
                );
                if let Some(log) = &log {
                    sentence.push_str(&format!(
                        "; log store {} bytes, {} compaction(s)",
                        log.bytes, log.compactions
                    ));
                }
                let log =
                    log.map(|log| json!({ "bytes": log.bytes, "compactions": log.compactions }));
                self.out.emit(
                    "stats",
                    json!({ "peers": peers, "node": snapshot, "paths": paths, "via": via, "log": log }),
                    || sentence,
                );
            }
            _ => self
                .out
                .error(verb, format!("cannot read {line:?}; type 'help'")),
        }
        true
    }

    fn peer(&self, command: &str) -> Option<&Peer> {
        if self.peer.is_none() {
            self.out
                .error(command, "no peer yet: connect <ticket> first");
        }
        self.peer.as_ref()
    }

    async fn open(&mut self, kind: &str, name: &str) {
        let Some(peer) = self.peer("open") else {
            return;
        };
        let opened = match kind {
            "queue" => peer.open_queue(name).await.map(Object::Queue),
            "session" => peer.open_session(name).await.map(Object::Session),
            _ => {
                return self
                    .out
                    .error("open", format!("{kind:?} is neither queue nor session"))
            }
        };
        // An object this node opened in an earlier life lives on in its store: resume it.
        let (opened, resumed) = match opened {
            Err(Error::Command(CommandError::AlreadyOpen(_))) => match kind {
                "queue" => (Ok(Object::Queue(peer.queue(name))), true),
                _ => (Ok(Object::Session(peer.session(name))), true),
            },
            other => (other, false),
        };
        match opened {
            Ok(object) => {
                self.objects.insert(name.to_owned(), object);
                self.out.emit(
                    "opened",
                    json!({ "obj": name, "kind": kind, "resumed": resumed }),
                    || match resumed {
                        true => format!("{kind} {name} open (resumed from the store)"),
                        false => format!("{kind} {name} open"),
                    },
                );
            }
            Err(error) => self.out.error("open", error),
        }
    }

    fn object(&self, command: &str, name: &str) -> Option<&Object> {
        let object = self.objects.get(name);
        if object.is_none() {
            self.out.error(
                command,
                format!("{name} is not open: open queue {name} first"),
            );
        }
        object
    }

    fn send(&self, name: &str, body: &str) {
        let Some(object) = self.object("send", name) else {
            return;
        };
        let pending = match object {
            Object::Queue(queue) => queue.send(body.to_owned()),
            Object::Session(session) => session.send(body.to_owned()),
        };
        let (out, name, body) = (self.out, name.to_owned(), body.to_owned());
        tokio::spawn(async move {
            match pending.await {
                Ok(op) => out.emit(
                    "acked",
                    json!({ "obj": name, "op": op, "body": body }),
                    || format!("{name}: durable at the peer: {body}"),
                ),
                Err(error) => out.emit(
                    "send_failed",
                    json!({ "obj": name, "body": body, "message": error.to_string() }),
                    || format!("{name}: not sent ({error}): {body}"),
                ),
            }
        });
    }

    fn req(&self, name: &str, body: &str) {
        let Some(object) = self.object("req", name) else {
            return;
        };
        let Object::Session(session) = object else {
            return self
                .out
                .error("req", format!("{name} is a queue; requests go on sessions"));
        };
        let reply = session.req(body.to_owned());
        let (out, name, body) = (self.out, name.to_owned(), body.to_owned());
        tokio::spawn(async move {
            match reply.await {
                Ok(reply) => {
                    let answer = text(reply.end.as_deref().unwrap_or_default());
                    out.emit(
                        "reply",
                        json!({ "obj": name, "body": body, "answer": answer }),
                        || format!("{name}: {body} -> {answer}"),
                    );
                }
                Err(error) => out.emit(
                    "req_failed",
                    json!({ "obj": name, "body": body, "message": error.to_string() }),
                    || format!("{name}: request failed ({error}): {body}"),
                ),
            }
        });
    }

    fn route(&self, body: String) {
        let Some(host) = self.peer_addr.clone() else {
            return self
                .out
                .error("route", "no peer yet: connect <ticket> first");
        };
        let (out, node, router) = (self.out, self.node.clone(), self.switch.clone());
        tokio::spawn(async move {
            match router.call(&node, host, body.clone().into_bytes()).await {
                Ok(answer) => {
                    let answer = text(&answer);
                    out.emit("routed", json!({ "body": body, "answer": answer }), || {
                        format!("switch: {body} -> {answer}")
                    });
                }
                Err(error) => out.emit(
                    "route_failed",
                    json!({ "body": body, "message": error.to_string() }),
                    || format!("switch: {body} failed ({error})"),
                ),
            }
        });
    }

    async fn subscribe(&mut self) {
        let Some(source) = self.peer_addr.clone() else {
            return self
                .out
                .error("subscribe", "no peer yet: connect <ticket> first");
        };
        // A fresh connection: one cached from before the peer restarted would carry the
        // subscription nowhere.
        self.node.disconnect(&node_id_of(&source.id));
        self.flows += 1;
        let mut flow = [0u8; 16];
        flow[8..].copy_from_slice(&self.flows.to_be_bytes());
        match self
            .node
            .subscribe_telemetry(source, DELIVERIES, flow)
            .await
        {
            Ok(()) => self
                .out
                .emit("subscribed", json!({ "stream": DELIVERIES }), || {
                    format!("subscribed to the peer's {DELIVERIES} stream")
                }),
            Err(error) => self.out.error("subscribe", error),
        }
    }

    async fn close(&mut self, name: &str, reason: &str) {
        let Some(object) = self.objects.remove(name) else {
            return self.out.error("close", format!("{name} is not open"));
        };
        let closed = match &object {
            Object::Queue(queue) => queue.close(reason).await,
            Object::Session(session) => session.close(reason).await,
        };
        match closed {
            Ok(()) => self.out.emit("closed_here", json!({ "obj": name }), || {
                format!("{name} closed")
            }),
            Err(error) => self.out.error("close", error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_round_trips_and_bad_ones_say_why() {
        let key = tether::iroh::SecretKey::from_bytes(&[7; 32]).public();
        let text = format!(
            "{}@127.0.0.1:4000,127.0.0.1:4001",
            hex::encode(key.as_bytes())
        );
        let addr = parse_ticket(&text).expect("parses");
        assert_eq!(addr.id, key);
        assert_eq!(addr.ip_addrs().count(), 2);
        for (bad, why) in [
            ("nothing", "no '@'"),
            ("zz@127.0.0.1:1", "the id is not 64 hex digits"),
            (
                &*format!("{}@nope", hex::encode(key.as_bytes())),
                "a socket is not ip:port",
            ),
        ] {
            let error = parse_ticket(bad).expect_err(bad);
            assert_eq!(error.why, why);
        }
    }
}
