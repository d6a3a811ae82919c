//! A ring-backed protocol binding over real iroh on loopback: 64 MiB through 64 KiB rings,
//! with backpressure on both sides, and the lifecycle events of the logical stream.

use tether::iroh::endpoint::VarInt;
use tether::node::{Node, ProtocolBinding, StreamEvent, StreamFaultReason};
use tokio::sync::mpsc;

use crate::support;

const TOTAL: usize = 64 * 1024 * 1024;
const RING: usize = 64 * 1024;

fn binding() -> ProtocolBinding {
    ProtocolBinding {
        protocol_id: "edge".into(),
        wire_alpn: b"tether/edge/1".to_vec(),
        ring_bytes: RING,
    }
}

type Events = mpsc::Receiver<tether::node::ProtocolIngress>;

/// A node serving the `edge` binding, and its protocol events.
async fn bound() -> (Node, Events) {
    let (sink, events) = mpsc::channel(tether::node::PROTOCOL_SINK_EVENTS_DEFAULT);
    let node = Node::builder()
        .bind_protocol(binding(), sink)
        .bind()
        .await
        .expect("bind");
    (node, events)
}

/// The bytes sent: a pattern of prime length, so no ring boundary lines up with it.
fn payload() -> Vec<u8> {
    let pattern: Vec<u8> = (0..65_521usize)
        .map(|i| (i.wrapping_mul(31) ^ (i >> 7)) as u8)
        .collect();
    let mut bytes = Vec::with_capacity(TOTAL);
    while bytes.len() < TOTAL {
        let take = (TOTAL - bytes.len()).min(pattern.len());
        bytes.extend_from_slice(&pattern[..take]);
    }
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_mib_through_small_rings_with_backpressure_both_ways() {
    let ((a, _events_a), (b, mut events_b)) = (bound().await, bound().await);

    let outbound = a
        .open_stream(b.endpoint_addr(), "edge", 42)
        .await
        .expect("open");
    let writer = tokio::spawn(async move {
        let chunk = payload();
        for piece in chunk.chunks(100_000) {
            outbound
                .egress
                .write_all(piece)
                .await
                .expect("peer reading");
        }
        let waits = outbound.egress.waits();
        drop(outbound); // closes the egress ring: the stream ends after its bytes
        waits
    });

    let inbound = loop {
        let event = events_b.recv().await.expect("events");
        assert_eq!(event.peer, a.node_id());
        assert_eq!(event.protocol_id, "edge");
        if let StreamEvent::StreamOpened(stream) = event.event {
            break stream;
        }
    };
    assert_eq!(inbound.protocol_stream_id, 42);
    // Let the receive pump fill the ring and pause before reading anything.
    inbound.ingress.writer_blocked().await;

    let expected = payload();
    let mut received = 0usize;
    let mut buf = vec![0u8; 7_919];
    loop {
        let n = inbound.ingress.read(&mut buf).await;
        if n == 0 {
            break;
        }
        assert!(
            buf[..n] == expected[received..received + n],
            "bytes at {received}"
        );
        received += n;
    }
    assert_eq!(received, TOTAL);
    assert!(
        writer.await.expect("writer") > 0,
        "the sender's ring filled and waited"
    );
    assert!(
        inbound.ingress.writer_waits() > 0,
        "the receive pump paused on a full ring"
    );

    let mut saw_ready = false;
    let mut saw_ended = false;
    while let Ok(event) = events_b.try_recv() {
        match event.event {
            StreamEvent::StreamReady { stream_id } => saw_ready |= stream_id == inbound.stream_id,
            StreamEvent::StreamEnded { stream_id } => saw_ended |= stream_id == inbound.stream_id,
            _ => {}
        }
    }
    assert!(
        saw_ready && saw_ended,
        "ready {saw_ready}, ended {saw_ended}"
    );
    a.close().await;
    b.close().await;
    assert_eq!(a.tasks_running() + b.tasks_running(), 0);
}

/// The next `StreamOpened` on `events` (other events skipped).
async fn next_opened(events: &mut Events) -> tether::node::LogicalStream {
    loop {
        let event = events.recv().await.expect("events");
        if let StreamEvent::StreamOpened(stream) = event.event {
            return stream;
        }
    }
}

/// Reads `n` bytes from a stream's ingress ring.
async fn read_exact(stream: &tether::node::LogicalStream, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    let mut at = 0;
    while at < n {
        let read = stream.ingress.read(&mut out[at..]).await;
        assert!(read > 0, "stream ended after {at} of {n} bytes");
        at += read;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logical_streams_share_one_connection_per_peer_either_way_with_per_node_ids() {
    let ((a, mut events_a), (b, mut events_b)) = (bound().await, bound().await);

    // Three streams from a to b: one connection, ids from 1 on both nodes.
    let mut outbound = Vec::new();
    for protocol_stream_id in [10u64, 11, 12] {
        let stream = a
            .open_stream(b.endpoint_addr(), "edge", protocol_stream_id)
            .await
            .expect("open");
        stream
            .egress
            .write_all(&protocol_stream_id.to_be_bytes())
            .await
            .expect("write");
        outbound.push(stream);
    }
    let ids: Vec<u64> = outbound.iter().map(|s| s.stream_id).collect();
    assert_eq!(ids, [1, 2, 3], "a's own stream ids");
    let mut inbound = Vec::new();
    for _ in 0..3 {
        let stream = next_opened(&mut events_b).await;
        let body = read_exact(&stream, 8).await;
        assert_eq!(body, stream.protocol_stream_id.to_be_bytes());
        inbound.push(stream);
    }
    inbound.sort_by_key(|s| s.protocol_stream_id);
    let ids: Vec<u64> = inbound.iter().map(|s| s.stream_id).collect();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, [1, 2, 3], "b's own stream ids");
    assert_eq!(b.snapshot().accepted, 1, "three streams, one connection");

    // b opens a stream back: it rides the connection a dialed, so a accepts nothing.
    let back = b
        .open_stream(a.endpoint_addr(), "edge", 99)
        .await
        .expect("open back");
    assert_eq!(back.stream_id, 4);
    back.egress.write_all(b"pong").await.expect("write");
    let at_a = next_opened(&mut events_a).await;
    assert_eq!(at_a.protocol_stream_id, 99);
    assert_eq!(at_a.stream_id, 4, "a's fourth stream");
    assert_eq!(read_exact(&at_a, 4).await, b"pong");
    assert_eq!(a.snapshot().accepted, 0, "no connection dialed a");

    a.close().await;
    b.close().await;
    assert_eq!(a.tasks_running() + b.tasks_running(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_its_id_faults_one_reset_before_it_does_not_and_one_nobody_reads_is_stopped(
) {
    let (b, mut events_b) = bound().await;
    let raw = support::loopback_endpoint().await;
    let conn = raw
        .connect(b.endpoint_addr(), &binding().wire_alpn)
        .await
        .expect("connect");

    // Three bytes of an id, then a reset: the stream never began, so nothing is reported.
    let (mut reset, _reset_recv) = conn.open_bi().await.expect("bi");
    reset.write_all(&[0, 0, 5]).await.expect("write");
    reset.reset(VarInt::from_u32(77)).expect("reset");
    // Three bytes of an eight-byte id, then the end: a framing fault, and the connection stays.
    let (mut short, _short_recv) = conn.open_bi().await.expect("bi");
    short.write_all(&[0, 0, 7]).await.expect("write");
    short.finish().expect("finish");

    // A good stream on the same connection opens; once the protocol drops it, the next bytes
    // find no reader and the machine stops the sender with STOP_UNREAD (2, not the 0 a
    // stream dropped unread gets from QUIC).
    let (mut send, _recv) = conn.open_bi().await.expect("bi");
    send.write_all(&[&9u64.to_be_bytes()[..], b"hello"].concat())
        .await
        .expect("write");
    // b reads each stream's id on its own, so the events of the three may come in any order:
    // the third opens, and there is exactly one fault, the short stream's.
    let mut faults = Vec::new();
    let mut opened = None;
    while opened.is_none() || faults.is_empty() {
        match events_b.recv().await.expect("events").event {
            StreamEvent::StreamFault { reason, .. } => faults.push(reason),
            StreamEvent::StreamOpened(stream) => opened = Some(stream),
            _ => {}
        }
    }
    let stream = opened.expect("opened");
    assert_eq!(
        faults,
        [StreamFaultReason::Framing],
        "a reset before the id is no fault"
    );
    assert_eq!(stream.protocol_stream_id, 9);
    assert_eq!(read_exact(&stream, 5).await, b"hello");
    drop(stream);
    send.write_all(b"unread").await.expect("write");
    assert_eq!(
        send.stopped().await.expect("stopped"),
        Some(VarInt::from_u32(tether_core::driver::machine::STOP_UNREAD))
    );
    raw.close().await;
    b.close().await;
}

/// A stream that sends part of its id and then nothing holds up no other stream of the
/// connection: the next one opens at once (before, the node read every stream's id in turn,
/// so one silent stream blocked the connection's later streams for good); the silent one is
/// stopped at its deadline (`StreamFaultReason::Timeout`, not waited for here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_silent_before_its_id_holds_up_no_other_stream() {
    let (b, mut events_b) = bound().await;
    let raw = support::loopback_endpoint().await;
    let conn = raw
        .connect(b.endpoint_addr(), &binding().wire_alpn)
        .await
        .expect("connect");
    let mut silent = Vec::new();
    for _ in 0..20 {
        let (mut send, recv) = conn.open_bi().await.expect("bi");
        send.write_all(&[0, 0, 1]).await.expect("write");
        silent.push((send, recv));
    }
    let (mut send, _recv) = conn.open_bi().await.expect("bi");
    send.write_all(&[&5u64.to_be_bytes()[..], b"on time"].concat())
        .await
        .expect("write");
    let stream = next_opened(&mut events_b).await;
    assert_eq!(stream.protocol_stream_id, 5);
    assert_eq!(read_exact(&stream, 7).await, b"on time");
    drop(silent);
    raw.close().await;
    b.close().await;
}
