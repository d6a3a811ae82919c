//! Bifaci frames over any byte stream: one reader task and one writer task per connection.
//! They only move bytes; what the frames mean is decided by `tether_core::switch`.

use bytes::BytesMut;
use tether_core::limits::BIFACI_FRAME_BYTES_DEFAULT;
use tether_core::wire::bifaci::{BifaciDecoder, Frame};
use tether_core::wire::StreamDecoder;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Bytes read per socket read.
const READ_CHUNK: usize = 64 * 1024;

/// What a connection's reader reports.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // Frames are the common case; boxing each would cost more.
pub(crate) enum Incoming<T> {
    /// A decoded frame.
    Frame(T, Frame),
    /// The bytes are not frames: the connection is useless from here on.
    Undecodable(T, String),
    /// The connection ended (EOF or I/O error).
    Closed(T),
}

/// Reads frames from `reader` into `tx`, tagged `tag`. Awaits room in `tx`, so a slow consumer
/// slows the peer's socket rather than growing memory.
pub(crate) fn spawn_reader<R, T>(
    mut reader: R,
    tag: T,
    tx: mpsc::Sender<Incoming<T>>,
) -> JoinHandle<()>
where
    R: AsyncRead + Unpin + Send + 'static,
    T: Copy + Send + 'static,
{
    tokio::spawn(async move {
        let mut decoder = StreamDecoder::new(BifaciDecoder::with_frame_bytes_max(
            BIFACI_FRAME_BYTES_DEFAULT,
        ));
        let mut buf = BytesMut::with_capacity(READ_CHUNK);
        loop {
            buf.clear();
            match reader.read_buf(&mut buf).await {
                Ok(n) if n > 0 => {}
                _ => {
                    let _ = tx.send(Incoming::Closed(tag)).await;
                    return;
                }
            }
            decoder.push(&buf);
            loop {
                match decoder.pop() {
                    Ok(Some(frame)) => {
                        if tx.send(Incoming::Frame(tag, frame)).await.is_err() {
                            return;
                        }
                    }
                    Ok(None) => break,
                    Err(error) => {
                        let _ = tx
                            .send(Incoming::Undecodable(tag, error.error.to_string()))
                            .await;
                        return;
                    }
                }
            }
        }
    })
}

/// A queue of frames for a writer (bounded on the switch's side, unbounded on a host's, whose
/// writes credit already bounds).
pub(crate) trait FrameSource: Send + 'static {
    /// The next frame, waiting for one; `None` once the queue is closed and empty.
    fn recv(&mut self) -> impl std::future::Future<Output = Option<Frame>> + Send;
    /// The next frame if one is queued now.
    fn try_recv(&mut self) -> Option<Frame>;
}

impl FrameSource for mpsc::Receiver<Frame> {
    async fn recv(&mut self) -> Option<Frame> {
        mpsc::Receiver::recv(self).await
    }
    fn try_recv(&mut self) -> Option<Frame> {
        mpsc::Receiver::try_recv(self).ok()
    }
}

impl FrameSource for mpsc::UnboundedReceiver<Frame> {
    async fn recv(&mut self) -> Option<Frame> {
        mpsc::UnboundedReceiver::recv(self).await
    }
    fn try_recv(&mut self) -> Option<Frame> {
        mpsc::UnboundedReceiver::try_recv(self).ok()
    }
}

/// Writes every frame from `rx` to `writer`, coalescing what is queued; ends (closing the
/// write half) when `rx` closes or a write fails.
pub(crate) fn spawn_writer<W>(mut writer: W, mut rx: impl FrameSource) -> JoinHandle<()>
where
    W: AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let mut out = Vec::new();
        while let Some(frame) = rx.recv().await {
            out.clear();
            let mut next = Some(frame);
            while let Some(frame) = next {
                // A frame over the limit is a bug of this side: skip it rather than let the
                // peer cut the connection.
                let _ = frame.encode(BIFACI_FRAME_BYTES_DEFAULT, &mut out);
                next = if out.len() < READ_CHUNK {
                    rx.try_recv()
                } else {
                    None
                };
            }
            if writer.write_all(&out).await.is_err() {
                return;
            }
        }
        let _ = writer.shutdown().await;
    })
}
