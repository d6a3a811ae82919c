//! Protocol bindings (docs/spec/driver.md §2.3): non-actor protocols on the node's endpoint, each
//! under its own wire ALPN, owned by a driver adapter. Callers see logical streams (ids and a
//! pair of byte rings) and lifecycle events, never connections or QUIC streams.
//!
//! Per logical stream the driver runs two pumps: the receive pump writes network bytes into
//! the ingress ring and pauses while it is full; the send pump wakes on egress-ring commits,
//! writes the committed bytes to the network and only then consumes them from the ring.
//! A stream opens with an 8-byte big-endian protocol stream id written by the opener.
//!
//! Each adapter keeps one connection per peer, whichever side dialed it; every logical stream
//! to that peer, in either direction, is a QUIC stream on it. Stream ids are the node's own,
//! counted from 1.

use std::sync::atomic::{AtomicU64, Ordering};

use iroh::endpoint::{Connection, ReadExactError, RecvStream, SendStream};
use tether_core::driver::NodeId;
use tokio::sync::mpsc;

use super::ring::{ring, RingReader, RingWriter};
use super::{StreamJudge, Unreadable};

/// A protocol served on the node's endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtocolBinding {
    /// The logical protocol callers address.
    pub protocol_id: String,
    /// The ALPN negotiated on the wire.
    pub wire_alpn: Vec<u8>,
    /// Bytes of each ring (per direction, per logical stream).
    pub ring_bytes: usize,
}

/// One logical stream: read what the peer sent from `ingress`, write what to send into
/// `egress` (close it to end the stream).
#[derive(Debug)]
pub struct LogicalStream {
    /// The driver's id for it.
    pub stream_id: u64,
    /// The protocol's own id for it (written by the opener).
    pub protocol_stream_id: u64,
    /// Bytes from the peer.
    pub ingress: RingReader,
    /// Bytes to the peer.
    pub egress: RingWriter,
}

/// Why a logical stream failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamFaultReason {
    /// Reading from the network failed.
    Read,
    /// Writing to the network failed.
    Write,
    /// The stream ended before its 8-byte id (one reset before it is not reported: it never
    /// began).
    Framing,
    /// The stream's 8-byte id did not come within
    /// [`tether_core::limits::PROTOCOL_STREAM_ID_TIMEOUT_MS`]: the stream was stopped.
    Timeout,
}

/// A logical stream event.
#[derive(Debug)]
pub enum StreamEvent {
    /// A peer opened a stream: here are its rings.
    StreamOpened(LogicalStream),
    /// The stream's pumps run.
    StreamReady {
        /// The stream.
        stream_id: u64,
    },
    /// The peer finished sending (every byte is in the ingress ring).
    StreamEnded {
        /// The stream.
        stream_id: u64,
    },
    /// The stream failed.
    StreamFault {
        /// The stream.
        stream_id: u64,
        /// Why.
        reason: StreamFaultReason,
    },
}

/// What a protocol's sink receives.
#[derive(Debug)]
pub struct ProtocolIngress {
    /// The peer.
    pub peer: NodeId,
    /// The protocol.
    pub protocol_id: String,
    /// What happened.
    pub event: StreamEvent,
}

/// The driver's stream ids of one node, shared by its adapters: unique per node, from 1.
pub(super) type StreamIds = std::sync::Arc<AtomicU64>;

pub(super) struct Adapter {
    pub(super) binding: ProtocolBinding,
    pub(super) sink: mpsc::Sender<ProtocolIngress>,
    stream_ids: StreamIds,
}

impl Adapter {
    pub(super) fn new(
        binding: ProtocolBinding,
        sink: mpsc::Sender<ProtocolIngress>,
        stream_ids: StreamIds,
    ) -> Self {
        Self {
            binding,
            sink,
            stream_ids,
        }
    }

    /// Hands `event` to the app's sink; a full sink drops it (counted).
    fn emit(&self, peer: NodeId, event: StreamEvent) {
        let ingress = ProtocolIngress {
            peer,
            protocol_id: self.binding.protocol_id.clone(),
            event,
        };
        if let Err(mpsc::error::TrySendError::Full(_)) = self.sink.try_send(ingress) {
            metrics::counter!("tether_node_protocol_events_dropped", "protocol" => self.binding.protocol_id.clone())
                .increment(1);
        }
    }

    /// Starts the pumps of one QUIC stream; returns the caller's ends.
    pub(super) fn start(
        self: &std::sync::Arc<Self>,
        peer: NodeId,
        protocol_stream_id: u64,
        send: SendStream,
        recv: RecvStream,
        judge: StreamJudge,
        spawn: &impl Fn(std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>),
    ) -> LogicalStream {
        let stream_id = self.stream_ids.fetch_add(1, Ordering::Relaxed);
        let (ingress_writer, ingress) = ring(self.binding.ring_bytes);
        let (egress, egress_reader) = ring(self.binding.ring_bytes);
        let adapter = self.clone();
        spawn(Box::pin(async move {
            adapter
                .receive_pump(peer, stream_id, recv, ingress_writer, judge)
                .await;
        }));
        let adapter = self.clone();
        spawn(Box::pin(async move {
            adapter
                .send_pump(peer, stream_id, send, egress_reader)
                .await;
        }));
        LogicalStream {
            stream_id,
            protocol_stream_id,
            ingress,
            egress,
        }
    }

    /// Network → ingress ring; pauses while the ring is full.
    async fn receive_pump(
        &self,
        peer: NodeId,
        stream_id: u64,
        mut recv: RecvStream,
        ring: RingWriter,
        judge: StreamJudge,
    ) {
        let chunk_max = self.binding.ring_bytes.max(1);
        loop {
            match recv.read_chunk(chunk_max).await {
                Ok(Some(chunk)) => {
                    if ring.write_all(&chunk).await.is_err() {
                        // The protocol dropped its reader.
                        return judge.stop(&mut recv, Unreadable::Unread);
                    }
                }
                // The event goes first: a reader that sees the end of the ring finds it.
                Ok(None) => {
                    self.emit(peer, StreamEvent::StreamEnded { stream_id });
                    return ring.close();
                }
                Err(_) => {
                    let reason = StreamFaultReason::Read;
                    self.emit(peer, StreamEvent::StreamFault { stream_id, reason });
                    return ring.close();
                }
            }
        }
    }

    /// Egress ring → network; consumes ring bytes only after the network took them.
    async fn send_pump(
        &self,
        peer: NodeId,
        stream_id: u64,
        mut send: SendStream,
        ring: RingReader,
    ) {
        let mut buf = Vec::with_capacity(ring.capacity());
        while ring.readable().await {
            buf.clear();
            ring.peek(|bytes| buf.extend_from_slice(bytes));
            if send.write_all(&buf).await.is_err() {
                let reason = StreamFaultReason::Write;
                return self.emit(peer, StreamEvent::StreamFault { stream_id, reason });
            }
            ring.consume(buf.len());
        }
        let _ = send.finish();
        let _ = send.stopped().await;
    }

    /// Serves the streams the peer opens on `conn` until it closes (one connection per peer
    /// under this ALPN, cached by the driver machine, whichever side dialed it).
    pub(super) async fn serve(
        self: std::sync::Arc<Self>,
        conn: Connection,
        peer: NodeId,
        judge: StreamJudge,
        spawn: impl Fn(std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>)
            + Clone
            + Send
            + Sync
            + 'static,
    ) {
        while let Ok((send, recv)) = conn.accept_bi().await {
            // Each stream's id is read on its own, under a deadline: a stream that never sends
            // it holds up nothing but itself, and not for long.
            let (adapter, judge, spawner) = (self.clone(), judge.clone(), spawn.clone());
            spawn(Box::pin(async move {
                adapter.begin(peer, send, recv, judge, spawner).await;
            }));
        }
    }

    /// Reads a new stream's 8-byte id (within its deadline) and starts it.
    async fn begin(
        self: std::sync::Arc<Self>,
        peer: NodeId,
        send: SendStream,
        mut recv: RecvStream,
        judge: StreamJudge,
        spawn: impl Fn(std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>),
    ) {
        let mut id = [0u8; 8];
        let deadline =
            std::time::Duration::from_millis(tether_core::limits::PROTOCOL_STREAM_ID_TIMEOUT_MS);
        let reason = match tokio::time::timeout(deadline, recv.read_exact(&mut id)).await {
            Ok(Ok(())) => None,
            // Reset by the peer (or the connection lost) before its id: the stream never
            // began, and no protocol has heard of it; nothing was malformed.
            Ok(Err(ReadExactError::ReadError(_))) => return,
            // Finished before its id, or silent past the deadline: the machine names the stop,
            // the protocol hears of the fault.
            Ok(Err(ReadExactError::FinishedEarly(_))) => Some(StreamFaultReason::Framing),
            Err(_) => Some(StreamFaultReason::Timeout),
        };
        if let Some(reason) = reason {
            judge.stop(&mut recv, Unreadable::Malformed);
            self.emit(
                peer,
                StreamEvent::StreamFault {
                    stream_id: 0,
                    reason,
                },
            );
            return;
        }
        let id = u64::from_be_bytes(id);
        let stream = self.start(peer, id, send, recv, judge, &spawn);
        let stream_id = stream.stream_id;
        self.emit(peer, StreamEvent::StreamOpened(stream));
        self.emit(peer, StreamEvent::StreamReady { stream_id });
    }
}
