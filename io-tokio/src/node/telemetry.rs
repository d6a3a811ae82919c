//! The telemetry adapter (ALPN [`super::TELEMETRY_ALPN`], docs/spec/driver.md §5).
//!
//! Publisher: [`super::Node::publish_telemetry`] opens a uni stream to a collector, writes the
//! DSQ2 header snapshot, then live events from a subscription through a [`BatchWriter`]
//! (drained without waiting; zstd only when smaller) until the subscription closes, then the
//! stream-ended record. Collector: every uni stream on a telemetry connection is decoded and
//! forwarded to the node's sink as [`TelemetryIngress`]; a broken stream becomes one typed
//! [`TelemetryFault`] and is stopped, without closing the connection.

use super::{NodeError, StreamJudge, Unreadable};
use bytes::BytesMut;
use iroh::endpoint::{Connection, RecvStream, SendStream};
use tether_core::driver::{NodeId, Publisher};
use tether_core::wire::telemetry::{
    encode_stream_ended, BatchWriter, ChannelDescriptor, Compression, Header, TelemetryDecoder,
    TelemetryError, TelemetryFrame, TelemetryItem,
};
use tether_core::wire::StreamDecoder;
use tokio::sync::mpsc;

/// Why a telemetry stream was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TelemetryFault {
    /// The stream did not open with a valid DSQ2 header.
    BadHeader,
    /// A record tag outside `0x01..=0x05`.
    BadRecordTag,
    /// A record or decoded batch over its bounds: above 16 MiB, or a batch of more events
    /// than a writer puts in one (a decompression bomb).
    Oversize,
    /// The stream ended inside the header or a record.
    Truncated,
    /// Anything else that did not decode (bad descriptor, entry, varint, decompression...).
    DecodeFailed,
}

impl TelemetryFault {
    fn of(error: &TelemetryError, header_seen: bool) -> Self {
        match error {
            TelemetryError::Truncated { .. } => Self::Truncated,
            TelemetryError::RecordTooLarge { .. } | TelemetryError::TooManyEvents => Self::Oversize,
            TelemetryError::UnknownRecord { .. } => Self::BadRecordTag,
            _ if !header_seen => Self::BadHeader,
            _ => Self::DecodeFailed,
        }
    }
}

/// What a collector receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TelemetryIngress {
    /// A stream opened with this header snapshot.
    Opened {
        /// The publishing peer.
        peer: NodeId,
        /// The header.
        header: Header,
    },
    /// A channel declared after the header.
    ChannelDeclared {
        /// The publishing peer.
        peer: NodeId,
        /// The flow.
        flow_id: [u8; 16],
        /// The channel.
        channel: ChannelDescriptor,
    },
    /// One batch of events, in stream order.
    Events {
        /// The publishing peer.
        peer: NodeId,
        /// The flow.
        flow_id: [u8; 16],
        /// How the batch travelled.
        compression: Compression,
        /// The events.
        frames: Vec<TelemetryFrame>,
    },
    /// The publisher ended the stream.
    Ended {
        /// The publishing peer.
        peer: NodeId,
        /// The flow.
        flow_id: [u8; 16],
    },
    /// The stream broke and was dropped.
    Fault {
        /// The publishing peer.
        peer: NodeId,
        /// What broke.
        fault: TelemetryFault,
        /// The decoder's error kind (as `tether inspect` names it).
        kind: &'static str,
        /// Stream offset of the item that failed.
        offset: u64,
    },
}

/// Where collected telemetry goes: every sink gets every item (a fanout of one or more).
/// Sinks are bounded channels: a full sink makes the stream's reader wait, and QUIC flow
/// control carries that back to the publisher (telemetry is never buffered without bound).
#[derive(Clone)]
pub(super) struct Sinks(std::sync::Arc<[mpsc::Sender<TelemetryIngress>]>);

impl Sinks {
    pub(super) fn new(sinks: Vec<mpsc::Sender<TelemetryIngress>>) -> Self {
        Self(sinks.into())
    }

    /// Sends `item` to every sink, waiting for room in each; an error once no sink is left.
    async fn send(&self, item: TelemetryIngress) -> Result<(), ()> {
        let mut alive = false;
        for sink in self.0.iter() {
            alive |= sink.send(item.clone()).await.is_ok();
        }
        if alive {
            Ok(())
        } else {
            Err(())
        }
    }
}

/// Reads every telemetry stream the peer opens on `conn` into the sinks.
pub(super) async fn collect(
    conn: Connection,
    peer: NodeId,
    sink: Sinks,
    judge: StreamJudge,
    spawn: impl Fn(std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>),
) {
    while let Ok(recv) = conn.accept_uni().await {
        spawn(Box::pin(read_stream(
            recv,
            peer,
            sink.clone(),
            judge.clone(),
        )));
    }
}

async fn read_stream(mut recv: RecvStream, peer: NodeId, sink: Sinks, judge: StreamJudge) {
    use tether_core::wire::FormatError;
    let mut decoder = StreamDecoder::new(TelemetryDecoder::default());
    let mut flow_id = None;
    let fault = |error: &tether_core::wire::DecodeError<TelemetryError>, header_seen: bool| {
        TelemetryIngress::Fault {
            peer,
            fault: TelemetryFault::of(&error.error, header_seen),
            kind: error.error.kind(),
            offset: error.offset,
        }
    };
    loop {
        let chunk = match recv.read_chunk(64 * 1024).await {
            Ok(Some(chunk)) => chunk,
            Ok(None) | Err(_) => {
                if let Err(error) = decoder.finish() {
                    let _ = sink.send(fault(&error, flow_id.is_some())).await;
                }
                return;
            }
        };
        // Copied: iroh's chunks are views of its receive buffers, which a kept batch would pin.
        decoder.push(&chunk);
        loop {
            let item = match decoder.pop() {
                Ok(Some(item)) => item,
                Ok(None) => break,
                Err(error) => {
                    let _ = sink.send(fault(&error, flow_id.is_some())).await;
                    // The decoder cannot go on past a fault; the machine names the stop.
                    return judge.stop(&mut recv, Unreadable::Malformed);
                }
            };
            let ingress = match item {
                TelemetryItem::Header(header) => {
                    flow_id = Some(header.flow_id);
                    TelemetryIngress::Opened { peer, header }
                }
                TelemetryItem::ChannelDeclared(channel) => TelemetryIngress::ChannelDeclared {
                    peer,
                    flow_id: flow_id.unwrap_or_default(),
                    channel,
                },
                TelemetryItem::Batch(batch) => TelemetryIngress::Events {
                    peer,
                    flow_id: flow_id.unwrap_or_default(),
                    compression: batch.compression(),
                    frames: batch.frames().collect(),
                },
                TelemetryItem::StreamEnded => TelemetryIngress::Ended {
                    peer,
                    flow_id: flow_id.unwrap_or_default(),
                },
            };
            if sink.send(ingress).await.is_err() {
                // Every sink closed: nobody reads the stream any more.
                return judge.stop(&mut recv, Unreadable::Unread);
            }
        }
    }
}

/// Writes `header` on `send`, then every event of `subscription` until it closes, then the
/// end record.
pub(super) async fn publish(
    mut send: SendStream,
    header: Header,
    mut subscription: mpsc::Receiver<TelemetryFrame>,
) -> Result<(), NodeError> {
    let mut out = BytesMut::new();
    header
        .encode(&mut out)
        .map_err(|e| NodeError::Stream(e.into()))?;
    send.write_all(&out)
        .await
        .map_err(|e| NodeError::Stream(e.into()))?;
    let mut writer = BatchWriter::new();
    loop {
        // The next event, or the collector stopping this stream or its connection going away
        // (`stopped` resolves on either): the publish ends at once, not at the next event.
        let first = tokio::select! {
            event = subscription.recv() => match event {
                Some(event) => event,
                None => break,
            },
            stopped = send.stopped() => return Err(NodeError::Stream(match stopped {
                Ok(code) => format!("the collector ended the stream ({code:?})").into(),
                Err(error) => error.into(),
            })),
        };
        out.clear();
        let mut first = Some(first);
        writer
            .drain(
                || first.take().or_else(|| subscription.try_recv().ok()),
                &mut out,
            )
            .map_err(|e| NodeError::Stream(e.into()))?;
        send.write_all(&out)
            .await
            .map_err(|e| NodeError::Stream(e.into()))?;
    }
    out.clear();
    encode_stream_ended(&mut out);
    send.write_all(&out)
        .await
        .map_err(|e| NodeError::Stream(e.into()))?;
    send.finish().map_err(|e| NodeError::Stream(e.into()))?;
    // Wait until the collector has read everything (the stream, not the shared connection,
    // ends here).
    let _ = send.stopped().await;
    Ok(())
}

pub use tether_core::limits::TELEMETRY_PUBLISHER_FRAMES;

/// The queue each publisher drains, by the machine's number for the publisher (one per
/// subscription started: a publisher stopped and still ending has its own).
type Feeds = std::collections::BTreeMap<Publisher, mpsc::Sender<TelemetryFrame>>;

/// A local telemetry stream collectors subscribe to over the actor plane
/// ([`super::Node::telemetry_source`]): every frame emitted goes to every live subscriber's
/// publisher. Cheap to clone.
#[derive(Clone)]
pub struct TelemetrySource {
    pub(super) inner: std::sync::Arc<SourceInner>,
}

pub(super) struct SourceInner {
    pub(super) header: Header,
    subscribers: std::sync::Mutex<Feeds>,
    count: tokio::sync::watch::Sender<usize>,
    dropped: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for TelemetrySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TelemetrySource")
            .field("stream", &self.inner.header.stream.name)
            .finish_non_exhaustive()
    }
}

impl TelemetrySource {
    pub(super) fn new(header: Header) -> Self {
        Self {
            inner: std::sync::Arc::new(SourceInner {
                header,
                subscribers: std::sync::Mutex::default(),
                count: tokio::sync::watch::channel(0).0,
                dropped: std::sync::atomic::AtomicU64::new(0),
            }),
        }
    }

    /// Sends `frame` to every subscriber, never waiting: a subscriber whose queue is full
    /// misses it (counted in [`TelemetrySource::dropped`]).
    pub fn emit(&self, frame: TelemetryFrame) {
        let subscribers = self.inner.subscribers();
        for sender in subscribers.values() {
            if sender.try_send(frame.clone()).is_err() {
                self.inner
                    .dropped
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    /// How many collectors are subscribed now; changes as they come and go.
    pub fn subscribers(&self) -> tokio::sync::watch::Receiver<usize> {
        self.inner.count.subscribe()
    }

    /// Frames a full subscriber queue missed.
    pub fn dropped(&self) -> u64 {
        self.inner
            .dropped
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl SourceInner {
    fn subscribers(&self) -> std::sync::MutexGuard<'_, Feeds> {
        self.subscribers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new subscriber, fed to publisher `publisher`: the receiver that publisher drains.
    pub(super) fn subscribe(&self, publisher: Publisher) -> mpsc::Receiver<TelemetryFrame> {
        let (tx, rx) = mpsc::channel(TELEMETRY_PUBLISHER_FRAMES);
        let mut subscribers = self.subscribers();
        subscribers.insert(publisher, tx);
        self.count.send_replace(subscribers.len());
        rx
    }

    /// Publisher `publisher`'s subscriber leaves: its queue closes, which ends its stream.
    pub(super) fn unsubscribe(&self, publisher: Publisher) {
        let mut subscribers = self.subscribers();
        subscribers.remove(&publisher);
        self.count.send_replace(subscribers.len());
    }
}
