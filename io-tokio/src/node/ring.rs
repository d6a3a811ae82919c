//! A bounded single-producer/single-consumer byte ring with async wakeups: the buffer
//! between a protocol's worker and the driver's network pumps (docs/spec/driver.md §2.3).
//!
//! The producer copies bytes in with [`RingWriter::write`] (as many as fit) or
//! [`RingWriter::write_all`] (waits for room); each write commits and wakes the reader. The
//! consumer looks at committed bytes in place with [`RingReader::peek`] and frees them with
//! [`RingReader::consume`] only when it is done with them (the send pump does so after the
//! network accepted them), which wakes the writer. Either side closing wakes the other.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;

struct State {
    buf: Box<[u8]>,
    head: usize,
    len: usize,
    writer_closed: bool,
    reader_closed: bool,
}

struct Shared {
    state: Mutex<State>,
    readable: Notify,
    writable: Notify,
    /// Notified each time the writer starts waiting for room.
    writer_blocked: Notify,
    /// Times the writer found the ring full and waited.
    writer_waits: AtomicU64,
    /// Times the reader found the ring empty and waited.
    reader_waits: AtomicU64,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The producing end.
pub struct RingWriter {
    shared: Arc<Shared>,
}

/// The consuming end.
pub struct RingReader {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RingWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingWriter").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for RingReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingReader").finish_non_exhaustive()
    }
}

/// The writer closed the ring and every byte was consumed: the stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the other end of the ring is closed")]
pub struct RingClosed;

/// A ring of `capacity` bytes (at least 1).
pub fn ring(capacity: usize) -> (RingWriter, RingReader) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            buf: vec![0; capacity.max(1)].into_boxed_slice(),
            head: 0,
            len: 0,
            writer_closed: false,
            reader_closed: false,
        }),
        readable: Notify::new(),
        writable: Notify::new(),
        writer_blocked: Notify::new(),
        writer_waits: AtomicU64::new(0),
        reader_waits: AtomicU64::new(0),
    });
    (
        RingWriter {
            shared: shared.clone(),
        },
        RingReader { shared },
    )
}

impl RingWriter {
    /// Copies as much of `bytes` as fits and commits it; returns how much. Fails once the
    /// reader is closed.
    pub fn write(&self, bytes: &[u8]) -> Result<usize, RingClosed> {
        let mut state = self.shared.lock();
        if state.reader_closed {
            return Err(RingClosed);
        }
        let capacity = state.buf.len();
        let n = bytes.len().min(capacity - state.len);
        let tail = (state.head + state.len) % capacity;
        let first = n.min(capacity - tail);
        state.buf[tail..tail + first].copy_from_slice(&bytes[..first]);
        state.buf[..n - first].copy_from_slice(&bytes[first..n]);
        state.len += n;
        drop(state);
        if n > 0 {
            self.shared.readable.notify_one();
        }
        Ok(n)
    }

    /// Writes all of `bytes`, waiting for room as the reader consumes.
    pub async fn write_all(&self, mut bytes: &[u8]) -> Result<(), RingClosed> {
        while !bytes.is_empty() {
            let writable = self.shared.writable.notified();
            let n = self.write(bytes)?;
            bytes = &bytes[n..];
            if n == 0 {
                self.shared.writer_waits.fetch_add(1, Ordering::Relaxed);
                self.shared.writer_blocked.notify_waiters();
                writable.await;
            }
        }
        Ok(())
    }

    /// No more bytes: the reader sees the end once it consumed everything.
    pub fn close(&self) {
        self.shared.lock().writer_closed = true;
        self.shared.readable.notify_one();
    }

    /// Times the writer waited for room.
    pub fn waits(&self) -> u64 {
        self.shared.writer_waits.load(Ordering::Relaxed)
    }
}

impl Drop for RingWriter {
    fn drop(&mut self) {
        self.close();
    }
}

impl RingReader {
    /// Waits until bytes are committed (true) or the writer closed with nothing left (false).
    pub async fn readable(&self) -> bool {
        loop {
            let readable = self.shared.readable.notified();
            {
                let state = self.shared.lock();
                if state.len > 0 {
                    return true;
                }
                if state.writer_closed {
                    return false;
                }
            }
            self.shared.reader_waits.fetch_add(1, Ordering::Relaxed);
            readable.await;
        }
    }

    /// Calls `f` with the committed bytes that are contiguous in the ring (possibly fewer
    /// than all committed bytes); nothing is freed until [`RingReader::consume`].
    pub fn peek<T>(&self, f: impl FnOnce(&[u8]) -> T) -> T {
        let state = self.shared.lock();
        let capacity = state.buf.len();
        let first = state.len.min(capacity - state.head);
        f(&state.buf[state.head..state.head + first])
    }

    /// Frees the first `n` committed bytes and wakes the writer.
    pub fn consume(&self, n: usize) {
        let mut state = self.shared.lock();
        let n = n.min(state.len);
        let capacity = state.buf.len();
        state.head = (state.head + n) % capacity;
        state.len -= n;
        drop(state);
        if n > 0 {
            self.shared.writable.notify_one();
        }
    }

    /// Copies up to `out.len()` committed bytes out and frees them; 0 at end of stream.
    pub async fn read(&self, out: &mut [u8]) -> usize {
        if out.is_empty() || !self.readable().await {
            return 0;
        }
        let n = self.peek(|bytes| {
            let n = bytes.len().min(out.len());
            out[..n].copy_from_slice(&bytes[..n]);
            n
        });
        self.consume(n);
        n
    }

    /// The reader is gone: the writer's next write fails.
    pub fn close(&self) {
        self.shared.lock().reader_closed = true;
        self.shared.writable.notify_one();
    }

    /// Times the reader waited for bytes.
    pub fn waits(&self) -> u64 {
        self.shared.reader_waits.load(Ordering::Relaxed)
    }

    /// Times the writer of this ring waited for room (backpressure on the producing side).
    pub fn writer_waits(&self) -> u64 {
        self.shared.writer_waits.load(Ordering::Relaxed)
    }

    /// Resolves once the writer has waited for room at least once (the ring filled while
    /// nothing read it).
    pub async fn writer_blocked(&self) {
        loop {
            let blocked = self.shared.writer_blocked.notified();
            tokio::pin!(blocked);
            blocked.as_mut().enable();
            if self.writer_waits() > 0 {
                return;
            }
            blocked.await;
        }
    }

    /// The ring's capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.shared.lock().buf.len()
    }
}

impl Drop for RingReader {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bytes_wrap_around_and_come_out_in_order() {
        let (writer, reader) = ring(7);
        let data: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        let producer = {
            let data = data.clone();
            tokio::spawn(async move {
                for chunk in data.chunks(5) {
                    writer.write_all(chunk).await.expect("reader alive");
                }
                writer.waits()
            })
        };
        let mut got = Vec::new();
        let mut buf = [0u8; 3];
        loop {
            let n = reader.read(&mut buf).await;
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, data);
        assert!(
            producer.await.expect("producer") > 0,
            "a 7-byte ring made the writer wait"
        );
    }

    #[tokio::test]
    async fn a_closed_reader_fails_the_writer() {
        let (writer, reader) = ring(4);
        drop(reader);
        assert_eq!(writer.write(b"x"), Err(RingClosed));
        assert_eq!(writer.write_all(b"xyz").await, Err(RingClosed));
    }

    #[tokio::test]
    async fn peek_frees_nothing_until_consumed() {
        let (writer, reader) = ring(8);
        assert_eq!(writer.write(b"abcdefghij"), Ok(8));
        assert_eq!(reader.peek(|b| b.to_vec()), b"abcdefgh");
        assert_eq!(writer.write(b"z"), Ok(0), "full until consumed");
        reader.consume(3);
        assert_eq!(writer.write(b"xyz"), Ok(3));
        assert_eq!(
            reader.peek(|b| b.to_vec()),
            b"defgh",
            "contiguous part first"
        );
        reader.consume(5);
        assert_eq!(reader.peek(|b| b.to_vec()), b"xyz");
    }
}
