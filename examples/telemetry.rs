//! Telemetry streams over iroh on 127.0.0.1: a source names a stream, a collector subscribes
//! to it by name over the actor plane, the source's publisher dials the collector and sends
//! the DSQ2 header, then batches of events (zstd when smaller); unsubscribing ends it.
//!
//! Run with `cargo run -p tether --example telemetry`.

use bytes::Bytes;
use tether::node::{Node, TelemetryIngress};
use tether::tether_core::wire::telemetry::{
    ChannelDescriptor, Header, StreamDescriptor, TelemetryFrame,
};
use tokio::sync::mpsc;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let source = Node::builder().bind().await?;
    let (sink, mut collected) = mpsc::channel(64);
    let collector = Node::builder().telemetry_sink(sink).bind().await?;

    let header = Header {
        flow_id: [0; 16], // each subscription's own flow id replaces it
        token: Bytes::new(),
        stream: StreamDescriptor {
            name: "load".into(),
            node_id: *source.node_id().as_bytes(),
            started_at_ms: 0,
            labels: Vec::new(),
        },
        channels: vec![ChannelDescriptor {
            channel_id: 1,
            name: "cpu".into(),
            content_type: "text/plain".into(),
            labels: Vec::new(),
        }],
    };
    let load = source.telemetry_source("load", header);
    let mut subscribers = load.subscribers();

    let flow = [1; 16];
    collector
        .subscribe_telemetry(source.endpoint_addr(), "load", flow)
        .await?;
    subscribers.wait_for(|n| *n == 1).await?;
    for position in 0..100 {
        load.emit(TelemetryFrame {
            channel_id: 1,
            position,
            payload: Bytes::from(format!("cpu={}", position % 7)),
        });
    }
    let mut events = 0;
    while events < 100 {
        match collected.recv().await.expect("collector alive") {
            TelemetryIngress::Opened { header, .. } => {
                println!("collector: stream {:?} open", header.stream.name);
            }
            TelemetryIngress::Events {
                frames,
                compression,
                ..
            } => {
                events += frames.len();
                println!("collector: {} events ({compression:?})", frames.len());
            }
            other => println!("collector: {other:?}"),
        }
    }
    collector.unsubscribe_telemetry(source.node_id(), "load", flow)?;
    subscribers.wait_for(|n| *n == 0).await?;
    println!(
        "source: no subscribers left; {} frames missed",
        load.dropped()
    );
    collector.close().await;
    source.close().await;
    Ok(())
}
