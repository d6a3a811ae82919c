//! The allow-list over real iroh on 127.0.0.1: one check every path goes through, both ways.
//! A node whose list names someone else neither reaches a peer (actor frames, connect, join,
//! telemetry publishing and subscribing, a protocol stream, the switch, the substrate) nor lets
//! the peer in on any ALPN; each refusal is counted by path before anything else happens.

use std::sync::Arc;

use bytes::Bytes;
use tether::node::{
    ActorBridge, DeliveryError, Node, NodeError, OutFrame, ProtocolBinding, ProtocolIngress,
    TelemetryIngress,
};
use tether::substrate::Transport;
use tether_core::driver::{Direction, DropReason, NodeId, Path, Refusals};
use tether_core::wire::telemetry::{Header, StreamDescriptor};
use tokio::sync::{mpsc, watch};

struct Ignore;

impl ActorBridge for Ignore {
    fn deliver_raw(
        &self,
        _: tether::node::ActorAddr,
        _: &str,
        _: Bytes,
    ) -> Result<(), DeliveryError> {
        Ok(())
    }
}

fn edge() -> ProtocolBinding {
    ProtocolBinding {
        protocol_id: "edge".into(),
        wire_alpn: b"tether/edge/1".to_vec(),
        ring_bytes: 4096,
    }
}

/// A node serving every plane, allowing only `allow` when given; with the receiving ends of
/// its telemetry and protocol sinks.
struct Full {
    node: Node,
    telemetry: mpsc::Receiver<TelemetryIngress>,
    protocol: mpsc::Receiver<ProtocolIngress>,
}

async fn full(allow: Option<NodeId>) -> Full {
    let (telemetry_tx, telemetry) = mpsc::channel(16);
    let (protocol_tx, protocol) = mpsc::channel(16);
    let mut builder = Node::builder()
        .bridge(Arc::new(Ignore))
        .know_tag("Chat")
        .telemetry_sink(telemetry_tx)
        .bind_protocol(edge(), protocol_tx)
        .switch_host()
        .substrate();
    if let Some(peer) = allow {
        builder = builder.allow([peer]);
    }
    Full {
        node: builder.bind().await.expect("bind"),
        telemetry,
        protocol,
    }
}

fn header(node_id: NodeId) -> Header {
    Header {
        flow_id: [1; 16],
        token: Bytes::from_static(b"t"),
        stream: StreamDescriptor {
            name: "metrics".into(),
            node_id: *node_id.as_bytes(),
            started_at_ms: 0,
            labels: Vec::new(),
        },
        channels: Vec::new(),
    }
}

/// Waits (on the node's refusal events, not on time) until `path` was refused `inbound` at
/// least `times` times (a join retries on its schedule, so the actor path may see more).
async fn refused_inbound(refusals: &mut watch::Receiver<Refusals>, path: Path, times: u64) {
    refusals
        .wait_for(|refusals| refusals.get(path, Direction::Inbound) >= times)
        .await
        .expect("the node is alive");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_off_the_list_is_never_reached_on_any_path() {
    let stranger = Node::builder().bind().await.expect("bind");
    let guarded = full(Some(stranger.node_id())).await;
    let open = full(None).await;
    let to = open.node.endpoint_addr();
    let g = &guarded.node;

    assert!(matches!(
        g.connect(to.clone()).await,
        Err(NodeError::Unauthorized)
    ));
    g.send(OutFrame {
        to: open.node.node_id(),
        dest: tether::node::ActorAddr::mailbox(open.node.node_id()),
        type_tag: "Chat".into(),
        payload: Bytes::from_static(b"hi"),
    });
    g.join(vec![to.clone()]);
    assert!(matches!(
        g.subscribe_telemetry(to.clone(), "metrics", [2; 16]).await,
        Err(NodeError::Unauthorized)
    ));
    let (_events, subscription) = mpsc::channel(1);
    let published = g.publish_telemetry(to.clone(), header(g.node_id()), subscription);
    assert!(matches!(
        published.await.expect("an outcome"),
        Err(NodeError::Unauthorized)
    ));
    assert!(matches!(
        g.open_stream(to.clone(), "edge", 1).await,
        Err(NodeError::Unauthorized)
    ));
    assert!(matches!(
        g.dial_switch_host(to.clone()).await,
        Err(NodeError::Unauthorized)
    ));
    let substrate = g.substrate_transport().expect("substrate enabled");
    assert!(matches!(
        substrate.add_peer(to.clone()),
        Err(NodeError::Unauthorized)
    ));

    let snapshot = g.snapshot();
    let refusals = &snapshot.refusals;
    for (path, count) in [
        (Path::Actor, 3), // connect, send and a telemetry subscription
        (Path::Join, 1),
        (Path::Telemetry, 1),
        (Path::Protocol, 1),
        (Path::Switch, 1),
        (Path::Substrate, 1),
    ] {
        assert_eq!(refusals.get(path, Direction::Outbound), count, "{path:?}");
    }
    assert_eq!(refusals.total(Direction::Inbound), 0);
    // Refused before anything happened: nothing dialled, cached, joined or reached.
    assert_eq!(snapshot.drops.get(DropReason::Unauthorized), 1);
    assert_eq!(snapshot.dials_started, 0);
    assert!(snapshot.cache.is_empty());
    assert!(g.join_statuses().is_empty());
    assert!(!substrate.can_dial(&tether::node::peer_id_of(&to.id)));
    assert_eq!(open.node.snapshot().accepted, 0, "the peer saw nothing");
    for node in [&guarded.node, &open.node, &stranger] {
        node.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_off_the_list_is_refused_on_every_alpn() {
    let stranger = Node::builder().bind().await.expect("bind");
    let mut guarded = full(Some(stranger.node_id())).await;
    let open = full(None).await;
    let to = guarded.node.endpoint_addr();
    let mut refusals = guarded.node.refusals();

    // Each way in, from a peer that allows everyone: the guarded node closes the connection
    // at admission, counted under the ALPN's path.
    let _ = open.node.connect(to.clone()).await;
    refused_inbound(&mut refusals, Path::Actor, 1).await;
    open.node.join(vec![to.clone()]);
    refused_inbound(&mut refusals, Path::Actor, 2).await;
    let (_events, subscription) = mpsc::channel(1);
    let published =
        open.node
            .publish_telemetry(to.clone(), header(open.node.node_id()), subscription);
    refused_inbound(&mut refusals, Path::Telemetry, 1).await;
    assert!(published.await.expect("an outcome").is_err());
    let _ = open.node.open_stream(to.clone(), "edge", 1).await;
    refused_inbound(&mut refusals, Path::Protocol, 1).await;
    let _ = open.node.dial_switch_host(to.clone()).await;
    refused_inbound(&mut refusals, Path::Switch, 1).await;
    let substrate = open.node.substrate_transport().expect("substrate enabled");
    let peer = substrate
        .add_peer(to.clone())
        .expect("the open side allows");
    let _ = substrate.dial(&peer, [0; 16]).await;
    refused_inbound(&mut refusals, Path::Substrate, 1).await;

    // Nothing of the guarded node's state moved: no connection accepted or cached, nothing
    // handed to its telemetry, protocol or switch consumers.
    let snapshot = guarded.node.snapshot();
    assert_eq!(snapshot.accepted, 0);
    assert!(snapshot.refused >= 6, "{:?}", snapshot.refusals);
    for path in [
        Path::Telemetry,
        Path::Protocol,
        Path::Switch,
        Path::Substrate,
    ] {
        assert_eq!(
            snapshot.refusals.get(path, Direction::Inbound),
            1,
            "{path:?}"
        );
    }
    assert_eq!(snapshot.refusals.total(Direction::Outbound), 0);
    assert!(snapshot.cache.is_empty());
    assert!(guarded.telemetry.try_recv().is_err());
    assert!(guarded.protocol.try_recv().is_err());
    let mut switch = guarded.node.switch_connections().expect("switch host");
    assert!(switch.try_recv().is_err());
    for node in [&guarded.node, &open.node, &stranger] {
        node.close().await;
    }
}
