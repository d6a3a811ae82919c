//! Inbound links are proven before they touch anything: the accept loop runs each new link's
//! handshake here, in a task of its own, under a bound on handshakes in progress and the
//! handshake's own deadline. Only a link whose proof verifies reaches the peer's task (which
//! is created then, not before) and replaces the peer's live link; a link claiming a peer
//! without a key record, a failed or slow proof, or one past the bound is dropped and counted.
//! Before, the claimed id in a TCP preamble created a peer task and detached the peer's live,
//! authenticated link before the new one had proven anything.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tether_core::substrate::handshake::{Handshake, Negotiated, Progress, Role};
use tether_core::substrate::{capabilities, PeerId};
use tether_core::time::Time;
use tether_core::wire::envelope::EnvelopeDecoder;
use tether_core::wire::StreamDecoder;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::transport::Link;
use super::Shared;

pub use tether_core::limits::SUBSTRATE_HANDSHAKES_IN_PROGRESS_MAX;

/// What became of inbound links (see [`super::Substrate::link_counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkCounts {
    /// Inbound links whose proof verified (each then bound to its peer).
    pub verified: u64,
    /// Dropped: they claimed a peer this side holds no key record for.
    pub unknown_peer: u64,
    /// Dropped: as many handshakes as [`SUBSTRATE_HANDSHAKES_IN_PROGRESS_MAX`] were running, or
    /// a quarter of them from the link's source.
    pub busy: u64,
    /// Handshakes in progress now.
    pub in_progress: usize,
    /// Dropped: the handshake failed (a bad proof, a malformed frame, the deadline).
    pub failed: u64,
    /// Verified links handed to their peer's task.
    pub bound: u64,
    /// Verified links dropped because a new peer would pass the substrate's peer cap.
    pub at_cap: u64,
    /// Inbound links settled, whatever became of them (see
    /// [`super::Substrate::links_settled`]).
    pub settled: u64,
}

#[derive(Debug)]
pub(super) struct Counters {
    verified: AtomicU64,
    unknown_peer: AtomicU64,
    failed: AtomicU64,
    pub(super) bound: AtomicU64,
    pub(super) at_cap: AtomicU64,
    /// Inbound links settled (bound or dropped, for any reason). Read by snapshots: a
    /// snapshot never borrows `settled`, so it may be taken inside a `wait_for` on it (a
    /// second read lock of the watch, while a settle waits to write, would deadlock).
    settled_total: AtomicU64,
    /// Set to `settled_total` when an inbound link is settled, for waiters.
    pub(super) settled: tokio::sync::watch::Sender<u64>,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            verified: AtomicU64::default(),
            unknown_peer: AtomicU64::default(),
            failed: AtomicU64::default(),
            bound: AtomicU64::default(),
            at_cap: AtomicU64::default(),
            settled_total: AtomicU64::default(),
            settled: tokio::sync::watch::channel(0).0,
        }
    }
}

impl Counters {
    pub(super) fn snapshot(&self, busy: u64, in_progress: usize) -> LinkCounts {
        LinkCounts {
            verified: self.verified.load(Ordering::Relaxed),
            unknown_peer: self.unknown_peer.load(Ordering::Relaxed),
            busy,
            in_progress,
            failed: self.failed.load(Ordering::Relaxed),
            bound: self.bound.load(Ordering::Relaxed),
            at_cap: self.at_cap.load(Ordering::Relaxed),
            settled: self.settled_total.load(Ordering::SeqCst),
        }
    }

    /// One more inbound link settled.
    pub(super) fn settle(&self) {
        let total = self.settled_total.fetch_add(1, Ordering::SeqCst) + 1;
        self.settled
            .send_modify(|settled| *settled = (*settled).max(total));
    }
}

/// A handshake slot held by one inbound link's task, given back when it drops.
pub(super) struct Slot<'a>(pub(super) &'a Shared, pub(super) Option<std::net::IpAddr>);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.handshakes.lock().end_from(self.1);
    }
}

/// A link that proved it is `peer`'s: what the peer's task adopts.
pub(super) struct Verified {
    pub(super) link: Link,
    pub(super) negotiated: Negotiated,
    /// Bytes that followed the handshake, already read.
    pub(super) rest: Bytes,
}

/// Runs the listener's side of `link`'s handshake with `peer`; `None` (counted) when the
/// link is to be dropped.
pub(super) async fn verify(shared: &Shared, peer: &PeerId, mut link: Link) -> Option<Verified> {
    let Some(auth) = shared.auth.for_peer(peer.as_str()) else {
        shared.preauth.unknown_peer.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            peer = peer.as_str(),
            "inbound link claims a peer without a key record: dropped"
        );
        return None;
    };
    // The window the machine offers (its config as checked).
    let window = shared.config.clone().checked().receive_window;
    let caps = capabilities(&auth, shared.features.clone(), window);
    let started = (shared.clock)();
    let nonce = shared.random_bytes().to_vec();
    let mut handshake = Handshake::start(
        started,
        Role::Listener,
        auth,
        caps,
        link.channel.clone(),
        nonce,
    );
    let budget = tether_core::substrate::handshake::PROOF_BUDGET;
    let result = tokio::time::timeout(budget + Duration::from_millis(1), async {
        let mut decoder = StreamDecoder::new(EnvelopeDecoder);
        loop {
            flush(&mut handshake, &mut link).await.ok()?;
            let mut buf = BytesMut::with_capacity(4096);
            if link.stream.read_buf(&mut buf).await.ok()? == 0 {
                return None;
            }
            decoder.push_bytes(buf.freeze());
            while let Some(frame) = decoder.pop().ok()? {
                let now: Time = (shared.clock)();
                match handshake.handle_frame(now, &frame).ok()? {
                    Progress::Pending => {}
                    Progress::Ready(negotiated) => {
                        // Our proof goes out before the link is handed over.
                        flush(&mut handshake, &mut link).await.ok()?;
                        return Some((negotiated, decoder.take_buffered()));
                    }
                }
            }
        }
    })
    .await;
    match result {
        Ok(Some((negotiated, rest))) => {
            shared.preauth.verified.fetch_add(1, Ordering::Relaxed);
            Some(Verified {
                link,
                negotiated,
                rest,
            })
        }
        _ => {
            shared.preauth.failed.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                peer = peer.as_str(),
                "inbound link's handshake failed: dropped"
            );
            None
        }
    }
}

async fn flush(handshake: &mut Handshake, link: &mut Link) -> std::io::Result<()> {
    let mut out = BytesMut::new();
    while let Some(frame) = handshake.poll_transmit() {
        frame
            .encode(&mut out)
            .map_err(|error| std::io::Error::new(std::io::ErrorKind::InvalidData, error))?;
    }
    if !out.is_empty() {
        link.stream.write_all(&out).await?;
        link.stream.flush().await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A waiter's `wait_for` closure runs under the watch's lock; `link_counts` is what it
    /// calls there. A snapshot that touched the watch would then wait on itself (here, under
    /// the write lock, at once; in the field, a read lock behind a settle queued to write).
    #[test]
    fn a_snapshot_never_touches_the_watch_waiters_hold_while_they_read_it() {
        let (done, finished) = std::sync::mpsc::channel();
        // On a thread of its own, so that a snapshot that deadlocks fails this test at the
        // deadline below instead of hanging it.
        std::thread::spawn(move || {
            let counters = Counters::default();
            counters.settle();
            let mut seen = None;
            counters.settled.send_modify(|settled| {
                seen = Some((*settled, counters.snapshot(0, 0).settled));
            });
            counters.settle();
            let after = (
                *counters.settled.subscribe().borrow(),
                counters.snapshot(0, 0).settled,
            );
            let _ = done.send((seen, after));
        });
        let (seen, after) = finished
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("a snapshot taken under the watch's lock deadlocked");
        assert_eq!(seen, Some((1, 1)));
        assert_eq!(after, (2, 2));
    }
}
