//! Bifaci frames over any byte stream, read and written by the task that owns the connection
//! (no reader or writer tasks, no channels between the socket and the machine). They only move
//! bytes; what the frames mean is decided by `tether_core::switch`.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tether_core::limits::{
    BIFACI_FRAME_BYTES_DEFAULT, SWITCH_READ_CHUNK_BYTES, SWITCH_WRITE_BATCH_BYTES,
};

use tether_core::wire::bifaci::{BifaciDecoder, BifaciError, Frame};
use tether_core::wire::{DecodeError, StreamDecoder};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio_stream::Stream;

/// What a connection's reader yields.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // Frames are the common case; boxing each would cost more.
pub(crate) enum Incoming {
    /// A decoded frame.
    Frame(Frame),
    /// The bytes are not frames: the connection is useless from here on.
    Undecodable(DecodeError<BifaciError>),
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
            buf: vec![0u8; SWITCH_READ_CHUNK_BYTES].into_boxed_slice(),
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
                    return Poll::Ready(Some(Incoming::Undecodable(error)));
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

/// A connection's write half with its queue of frames, written by the task that owns the
/// connection whenever the socket takes bytes (no writer task between the machine and the
/// socket). Queued frames are encoded in batches of up to [`SWITCH_WRITE_BATCH_BYTES`] bytes.
pub(crate) struct FrameWriter<W> {
    writer: W,
    queue: VecDeque<Frame>,
    limit: usize,
    buf: Vec<u8>,
    written: usize,
    failed: bool,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    /// A writer that queues at most `limit` frames not yet encoded.
    pub(crate) fn new(writer: W, limit: usize) -> Self {
        Self {
            writer,
            queue: VecDeque::new(),
            limit,
            buf: Vec::new(),
            written: 0,
            failed: false,
        }
    }

    /// Queues `frame`; `false` (and the frame dropped) when `limit` frames wait already: the
    /// peer stopped reading.
    pub(crate) fn push(&mut self, frame: Frame) -> bool {
        if self.queue.len() >= self.limit {
            return false;
        }
        if !self.failed {
            self.queue.push_back(frame);
        }
        true
    }

    /// Whether nothing waits to be written.
    pub(crate) fn is_idle(&self) -> bool {
        self.failed || (self.queue.is_empty() && self.written == self.buf.len())
    }

    /// Writes what the socket takes now: `Ready(Ok)` once everything queued is written,
    /// `Pending` while the socket is full (the task is woken when it drains), `Ready(Err)`
    /// when a write failed (the connection is gone; later frames are dropped).
    pub(crate) fn poll_write_queued(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.failed {
            return Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()));
        }
        loop {
            if self.written == self.buf.len() {
                self.buf.clear();
                self.written = 0;
                while self.buf.len() < SWITCH_WRITE_BATCH_BYTES {
                    let Some(frame) = self.queue.pop_front() else {
                        break;
                    };
                    // A frame over the limit is a bug of this side: skip it rather than let
                    // the peer cut the connection.
                    let _ = frame.encode(BIFACI_FRAME_BYTES_DEFAULT, &mut self.buf);
                }
                if self.buf.is_empty() {
                    return Poll::Ready(Ok(()));
                }
            }
            match ready!(Pin::new(&mut self.writer).poll_write(cx, &self.buf[self.written..])) {
                Ok(n) if n > 0 => self.written += n,
                result => {
                    self.failed = true;
                    self.queue.clear();
                    return Poll::Ready(Err(result
                        .err()
                        .unwrap_or_else(|| std::io::ErrorKind::WriteZero.into())));
                }
            }
        }
    }

    /// Writes everything queued, then closes the write half.
    pub(crate) async fn finish(mut self) {
        if std::future::poll_fn(|cx| self.poll_write_queued(cx))
            .await
            .is_ok()
        {
            let _ = self.writer.shutdown().await;
        }
    }
}
