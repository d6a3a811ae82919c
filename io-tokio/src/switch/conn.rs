//! Bifaci frames over any byte stream: a reader polled by the task that owns the connection and
//! one writer task per connection. They only move bytes; what the frames mean is decided by
//! `tether_core::switch`.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tether_core::limits::BIFACI_FRAME_BYTES_DEFAULT;
use tether_core::wire::bifaci::{BifaciDecoder, Frame};
use tether_core::wire::StreamDecoder;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::Stream;

/// Bytes read per socket read.
const READ_CHUNK: usize = 64 * 1024;

/// What a connection's reader yields.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // Frames are the common case; boxing each would cost more.
pub(crate) enum Incoming {
    /// A decoded frame.
    Frame(Frame),
    /// The bytes are not frames: the connection is useless from here on.
    Undecodable(String),
    /// The connection ended (EOF or I/O error).
    Closed,
}

/// The frames arriving on a connection's read half, as a stream polled by the task that owns
/// the connection: no reader task and no channel between the socket and the machine. Bytes
/// are read only when the task asks for the next frame, so a task that falls behind slows the
/// peer's socket rather than growing memory. Ends after [`Incoming::Undecodable`] or
/// [`Incoming::Closed`].
pub(crate) struct FrameReader<R> {
    reader: R,
    decoder: StreamDecoder<BifaciDecoder>,
    buf: Box<[u8]>,
    done: bool,
}

impl<R> FrameReader<R> {
    pub(crate) fn new(reader: R) -> Self {
        Self {
            reader,
            decoder: StreamDecoder::new(BifaciDecoder::with_frame_bytes_max(
                BIFACI_FRAME_BYTES_DEFAULT,
            )),
            buf: vec![0u8; READ_CHUNK].into_boxed_slice(),
            done: false,
        }
    }
}

impl<R: AsyncRead + Unpin> Stream for FrameReader<R> {
    type Item = Incoming;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Incoming>> {
        let this = self.get_mut();
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            match this.decoder.pop() {
                Ok(Some(frame)) => return Poll::Ready(Some(Incoming::Frame(frame))),
                Ok(None) => {}
                Err(error) => {
                    this.done = true;
                    return Poll::Ready(Some(Incoming::Undecodable(error.error.to_string())));
                }
            }
            let mut buf = ReadBuf::new(&mut this.buf);
            match ready!(Pin::new(&mut this.reader).poll_read(cx, &mut buf)) {
                Ok(()) if !buf.filled().is_empty() => this.decoder.push(buf.filled()),
                _ => {
                    this.done = true;
                    return Poll::Ready(Some(Incoming::Closed));
                }
            }
        }
    }
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
