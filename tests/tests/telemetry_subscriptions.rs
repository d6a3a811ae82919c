//! Telemetry subscription control over the actor plane, on real iroh at 127.0.0.1: a
//! collector subscribes to a source's stream by name, the source's publisher starts (header
//! with the collector's flow, then events), and stops when the collector unsubscribes; an
//! unknown stream is refused and counted; a subscription started again outlives the
//! publisher stopped before it.

use bytes::Bytes;
use tether::node::{Node, NodeError, NodeId, TelemetryIngress};
use tether_core::driver::ControlVerdict;
use tether_core::wire::telemetry::{ChannelDescriptor, Header, StreamDescriptor, TelemetryFrame};
use tokio::sync::mpsc;

const FLOW: [u8; 16] = [5; 16];

fn header(node_id: NodeId) -> Header {
    Header {
        flow_id: [0; 16],
        token: Bytes::from_static(b"token"),
        stream: StreamDescriptor {
            name: "metrics".into(),
            node_id: *node_id.as_bytes(),
            started_at_ms: 1_767_225_600_000,
            labels: Vec::new(),
        },
        channels: vec![ChannelDescriptor {
            channel_id: 1,
            name: "cpu".into(),
            content_type: "text/plain".into(),
            labels: Vec::new(),
        }],
    }
}

fn frame(position: u64) -> TelemetryFrame {
    TelemetryFrame {
        channel_id: 1,
        position,
        payload: Bytes::from(format!("cpu={position}")),
    }
}

/// A source with stream "metrics" and a collector, with what the collector collects.
async fn nodes() -> (
    Node,
    Node,
    mpsc::Receiver<TelemetryIngress>,
    tether::node::TelemetrySource,
) {
    let source = Node::builder().bind().await.expect("bind");
    let (sink, collected) = mpsc::channel(64);
    let collector = Node::builder()
        .telemetry_sink(sink)
        .bind()
        .await
        .expect("bind");
    let metrics = source.telemetry_source("metrics", header(source.node_id()));
    (source, collector, collected, metrics)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_subscribes_and_unsubscribes_by_name() {
    let (source, collector, mut collected, metrics) = nodes().await;
    let mut subscribers = metrics.subscribers();

    // Emitted with nobody subscribed: goes nowhere.
    metrics.emit(frame(0));

    collector
        .subscribe_telemetry(source.endpoint_addr(), "metrics", FLOW)
        .await
        .expect("subscribe");
    subscribers.wait_for(|n| *n == 1).await.expect("alive");
    let Some(TelemetryIngress::Opened { peer, header }) = collected.recv().await else {
        panic!("the stream opens with its header");
    };
    assert_eq!(peer, source.node_id());
    assert_eq!(header.flow_id, FLOW, "the collector's flow");
    assert_eq!(header.stream.name, "metrics");

    for position in 1..=3 {
        metrics.emit(frame(position));
    }
    let mut positions = Vec::new();
    while positions.len() < 3 {
        match collected.recv().await.expect("open") {
            TelemetryIngress::Events {
                frames, flow_id, ..
            } => {
                assert_eq!(flow_id, FLOW);
                positions.extend(frames.iter().map(|f| f.position));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(positions, vec![1, 2, 3], "in order, nothing from before");

    collector
        .unsubscribe_telemetry(source.node_id(), "metrics", FLOW)
        .expect("unsubscribe");
    subscribers.wait_for(|n| *n == 0).await.expect("alive");
    match collected.recv().await.expect("open") {
        TelemetryIngress::Ended { flow_id, .. } => assert_eq!(flow_id, FLOW),
        other => panic!("the stream ends, got {other:?}"),
    }
    let (verdicts, live) = source.telemetry_control();
    assert_eq!(verdicts[&ControlVerdict::Started], 1);
    assert_eq!(verdicts[&ControlVerdict::Stopped], 1);
    assert_eq!(live, 0);

    // A stream the source does not have: refused, counted, nothing starts.
    let mut changes = source.changes();
    collector
        .subscribe_telemetry(source.endpoint_addr(), "disk", FLOW)
        .await
        .expect("sent");
    while !source
        .telemetry_control()
        .0
        .contains_key(&ControlVerdict::UnknownStream)
    {
        changes.changed().await.expect("alive");
    }
    assert_eq!(source.telemetry_control().1, 0);
    assert_eq!(*metrics.subscribers().borrow(), 0);

    // A name past the bound never leaves the collector.
    let long = "x".repeat(200);
    assert!(matches!(
        collector
            .subscribe_telemetry(source.endpoint_addr(), &long, FLOW)
            .await,
        Err(NodeError::InvalidStreamName)
    ));
    source.close().await;
    collector.close().await;
}

/// A collector that unsubscribes and at once subscribes again with the same flow gets a new
/// publisher, and the old one, ending after the new one started, leaves it running: its end
/// is the machine's to judge (publisher numbers), not a blanket unsubscribe. (Whether the
/// old publisher ends before or after the new one's first event is a race: with a shell that
/// unsubscribes by key alone this fails in about half the runs. The deterministic proofs are
/// core's: the driver harness and the conformance case for `ended`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_started_again_outlives_its_stopped_publisher() {
    let (source, collector, mut collected, metrics) = nodes().await;
    let mut subscribers = metrics.subscribers();
    collector
        .subscribe_telemetry(source.endpoint_addr(), "metrics", FLOW)
        .await
        .expect("subscribe");
    subscribers.wait_for(|n| *n == 1).await.expect("alive");
    assert!(matches!(
        collected.recv().await,
        Some(TelemetryIngress::Opened { .. })
    ));

    // Off and on again, back to back on the actor stream.
    collector
        .unsubscribe_telemetry(source.node_id(), "metrics", FLOW)
        .expect("unsubscribe");
    collector
        .subscribe_telemetry(source.endpoint_addr(), "metrics", FLOW)
        .await
        .expect("subscribe again");
    // The first stream ends and the second opens (the collector sees both).
    let (mut ended, mut opened) = (false, false);
    while !(ended && opened) {
        match collected.recv().await.expect("open") {
            TelemetryIngress::Ended { flow_id, .. } => {
                assert_eq!(flow_id, FLOW);
                ended = true;
            }
            TelemetryIngress::Opened { header, .. } => {
                assert_eq!(header.flow_id, FLOW);
                opened = true;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let (verdicts, live) = source.telemetry_control();
    assert_eq!(verdicts[&ControlVerdict::Started], 2);
    assert_eq!(verdicts[&ControlVerdict::Stopped], 1);
    assert_eq!(live, 1, "the second subscription is live");

    // The second publisher carries what is emitted now.
    metrics.emit(frame(7));
    match collected.recv().await.expect("open") {
        TelemetryIngress::Events { frames, .. } => {
            assert_eq!(frames.iter().map(|f| f.position).collect::<Vec<_>>(), [7]);
        }
        other => panic!("the second publisher goes on, got {other:?}"),
    }
    assert_eq!(source.telemetry_control().1, 1);
    source.close().await;
    collector.close().await;
}
