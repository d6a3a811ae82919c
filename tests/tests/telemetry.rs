//! The telemetry adapter over real iroh on loopback: a header and 100,000 events across zstd
//! and raw batches arrive in order with identical payloads; broken streams become typed
//! faults.

use bytes::Bytes;
use tether::node::{Node, NodeId, TelemetryFault, TelemetryIngress, TELEMETRY_ALPN};
use tether_core::wire::telemetry::{
    ChannelDescriptor, Compression, Header, StreamDescriptor, TelemetryFrame,
};
use tokio::sync::mpsc;

use crate::support;

const EVENTS: u64 = 100_000;

fn header(node_id: NodeId) -> Header {
    Header {
        flow_id: [9; 16],
        token: Bytes::from_static(b"token"),
        stream: StreamDescriptor {
            name: "metrics".into(),
            node_id: *node_id.as_bytes(),
            started_at_ms: 1_767_225_600_000,
            labels: vec![("host".into(), "a".into())],
        },
        channels: vec![ChannelDescriptor {
            channel_id: 1,
            name: "cpu".into(),
            content_type: "application/octet-stream".into(),
            labels: Vec::new(),
        }],
    }
}

/// Event `i`: the first half compress well (zstd batches), the second half do not (raw).
fn event(i: u64) -> TelemetryFrame {
    let payload = if i < EVENTS / 2 {
        Bytes::from(format!("cpu=42 host=a sample={:08}", i % 10))
    } else {
        // A cheap pseudo-random generator: incompressible enough for zstd to lose.
        let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let bytes: Vec<u8> = (0..48)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        Bytes::from(bytes)
    };
    TelemetryFrame {
        channel_id: 1 + i % 3,
        position: i,
        payload,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_and_100k_events_arrive_in_order_across_zstd_and_raw_batches() {
    header_and_events_arrive_in_order(tether::node::TELEMETRY_SINK_ITEMS_DEFAULT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_of_one_item_slows_the_publisher_and_loses_nothing() {
    // The collector buffers at most one item: its stream reader waits, QUIC flow control
    // holds the publisher back, and every event still arrives, in order.
    header_and_events_arrive_in_order(1).await;
}

async fn header_and_events_arrive_in_order(sink_items: usize) {
    let (sink, mut ingress) = mpsc::channel(sink_items);
    let collector = Node::builder()
        .telemetry_sink(sink)
        .bind()
        .await
        .expect("collector");
    let publisher = Node::builder().bind().await.expect("publisher");
    let (events_tx, events_rx) = mpsc::channel(4096);
    let done = publisher.publish_telemetry(
        collector.endpoint_addr(),
        header(publisher.node_id()),
        events_rx,
    );
    let feeder = tokio::spawn(async move {
        for i in 0..EVENTS {
            events_tx.send(event(i)).await.expect("publisher alive");
        }
    });
    match ingress.recv().await.expect("opened") {
        TelemetryIngress::Opened { peer, header: got } => {
            assert_eq!(peer, publisher.node_id());
            assert_eq!(got, header(publisher.node_id()));
        }
        other => panic!("expected the header first, got {other:?}"),
    }
    let (mut next, mut zstd, mut raw) = (0u64, 0, 0);
    loop {
        match ingress.recv().await.expect("ingress") {
            TelemetryIngress::Events {
                frames,
                compression,
                flow_id,
                ..
            } => {
                assert_eq!(flow_id, [9; 16]);
                match compression {
                    Compression::Zstd => zstd += 1,
                    Compression::None => raw += 1,
                    Compression::Lz4 => panic!("never written"),
                }
                for frame in frames {
                    assert_eq!(frame, event(next), "event {next} in order, identical");
                    next += 1;
                }
            }
            TelemetryIngress::Ended { .. } => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(next, EVENTS);
    assert!(
        zstd > 0 && raw > 0,
        "both batch kinds: {zstd} zstd, {raw} raw"
    );
    feeder.await.expect("feeder");
    done.await
        .expect("outcome")
        .expect("the publisher ended cleanly");
    publisher.close().await;
    collector.close().await;
}

/// A zstd batch record whose entries are 16 MiB of zeros: every 3 bytes an empty event.
fn zstd_bomb() -> Vec<u8> {
    let raw_len = tether_core::limits::TELEMETRY_RECORD_BYTES_MAX / 3 * 3;
    let compressed = zstd::bulk::compress(&vec![0; raw_len], 19).expect("compress");
    assert!(compressed.len() < 1024, "{} bytes", compressed.len());
    let mut record = vec![0x05];
    for value in [raw_len, compressed.len()] {
        let mut value = value as u64;
        while value >= 0x80 {
            record.push((value as u8) | 0x80);
            value >>= 7;
        }
        record.push(value as u8);
    }
    record.extend_from_slice(&compressed);
    record
}

async fn raw_stream(collector: &Node, bytes: &[u8]) {
    let endpoint = support::loopback_endpoint().await;
    let conn = endpoint
        .connect(collector.endpoint_addr(), TELEMETRY_ALPN)
        .await
        .expect("connect");
    let mut send = conn.open_uni().await.expect("uni");
    send.write_all(bytes).await.expect("write");
    send.finish().expect("finish");
    let _ = send.stopped().await;
    endpoint.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_streams_are_reported_as_typed_faults() {
    let (sink, mut ingress) = mpsc::channel(tether::node::TELEMETRY_SINK_ITEMS_DEFAULT);
    let collector = Node::builder()
        .telemetry_sink(sink)
        .bind()
        .await
        .expect("collector");
    let mut good_header = bytes::BytesMut::new();
    header(NodeId::new([1; 32]))
        .encode(&mut good_header)
        .expect("encode");
    let cases: Vec<(Vec<u8>, TelemetryFault)> = vec![
        (
            b"NOPE and more bytes here".to_vec(),
            TelemetryFault::BadHeader,
        ),
        (
            [&good_header[..], &[0x09]].concat(),
            TelemetryFault::BadRecordTag,
        ),
        // A raw batch declaring 32 MiB.
        (
            [&good_header[..], &[0x02, 0x80, 0x80, 0x80, 0x10]].concat(),
            TelemetryFault::Oversize,
        ),
        (
            good_header[..good_header.len() - 3].to_vec(),
            TelemetryFault::Truncated,
        ),
        // A decompression bomb: a zstd batch of a few hundred bytes declaring 16 MiB of 3-byte
        // entries (5.6 million events). Refused at the batch's event bound, before any frame
        // is handed to a sink.
        (
            [&good_header[..], &zstd_bomb()].concat(),
            TelemetryFault::Oversize,
        ),
    ];
    for (bytes, expected) in cases {
        raw_stream(&collector, &bytes).await;
        loop {
            match ingress.recv().await.expect("ingress") {
                TelemetryIngress::Fault { fault, .. } => {
                    assert_eq!(fault, expected);
                    break;
                }
                TelemetryIngress::Opened { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    collector.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sink_of_a_fanout_gets_every_item_on_a_custom_alpn() {
    let (first, mut first_rx) = mpsc::channel(tether::node::TELEMETRY_SINK_ITEMS_DEFAULT);
    let (second, mut second_rx) = mpsc::channel(tether::node::TELEMETRY_SINK_ITEMS_DEFAULT);
    let alpn = b"acme/telemetry/2";
    let collector = Node::builder()
        .telemetry_alpn(alpn)
        .telemetry_sink(first)
        .telemetry_sink(second)
        .bind()
        .await
        .expect("collector");
    let publisher = Node::builder()
        .telemetry_alpn(alpn)
        .bind()
        .await
        .expect("publisher");
    publish(&publisher, &collector, 0..10).await;
    for rx in [&mut first_rx, &mut second_rx] {
        let (_, frames) = one_stream(rx).await;
        assert_eq!(frames, (0..10).map(event).collect::<Vec<_>>());
    }
    publisher.close().await;
    collector.close().await;
}

/// Reads one published stream from `ingress`: its publisher and the events it carried.
async fn one_stream(
    ingress: &mut mpsc::Receiver<TelemetryIngress>,
) -> (NodeId, Vec<TelemetryFrame>) {
    let (mut from, mut frames) = (None, Vec::new());
    loop {
        match ingress.recv().await.expect("item") {
            TelemetryIngress::Opened { peer, .. } => from = Some(peer),
            TelemetryIngress::Events { frames: batch, .. } => frames.extend(batch),
            TelemetryIngress::Ended { .. } => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    (from.expect("a header first"), frames)
}

/// Publishes events `range` from `from` to `to` and waits until the publisher ends cleanly.
async fn publish(from: &Node, to: &Node, range: std::ops::Range<u64>) {
    let (events_tx, events_rx) = mpsc::channel(16);
    let done = from.publish_telemetry(to.endpoint_addr(), header(from.node_id()), events_rx);
    for i in range {
        events_tx.send(event(i)).await.expect("publisher alive");
    }
    drop(events_tx);
    done.await.expect("outcome").expect("published");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_between_two_nodes_share_one_connection_whichever_side_dialed_it() {
    let (a_sink, mut a_ingress) = mpsc::channel(tether::node::TELEMETRY_SINK_ITEMS_DEFAULT);
    let (b_sink, mut b_ingress) = mpsc::channel(tether::node::TELEMETRY_SINK_ITEMS_DEFAULT);
    let a = Node::builder()
        .telemetry_sink(a_sink)
        .bind()
        .await
        .expect("a");
    let b = Node::builder()
        .telemetry_sink(b_sink)
        .bind()
        .await
        .expect("b");

    // Two publishes from a to b: the second stream goes on the connection the first dialed.
    publish(&a, &b, 0..3).await;
    assert_eq!(
        one_stream(&mut b_ingress).await,
        (a.node_id(), (0..3).map(event).collect())
    );
    publish(&a, &b, 3..6).await;
    assert_eq!(
        one_stream(&mut b_ingress).await,
        (a.node_id(), (3..6).map(event).collect())
    );
    assert_eq!(
        b.snapshot().accepted,
        1,
        "b accepted one telemetry connection"
    );

    // b publishes back on the connection a dialed: a accepts nothing, and collects it.
    publish(&b, &a, 6..9).await;
    assert_eq!(
        one_stream(&mut a_ingress).await,
        (b.node_id(), (6..9).map(event).collect())
    );
    assert_eq!(a.snapshot().accepted, 0, "a dialed the only connection");
    assert_eq!(b.snapshot().accepted, 1);
    a.close().await;
    b.close().await;
}
