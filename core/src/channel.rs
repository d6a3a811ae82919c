//! [`HybridChannel`]: the per-peer egress queue of the transport driver
//! (docs/spec/driver.md §3.2). Many producers that never block, one consumer.
//!
//! A bounded ring ([`crossbeam_queue::ArrayQueue`]) is the hot path; an unbounded linked
//! spillover ([`crossbeam_queue::SegQueue`]) takes what the ring cannot. A push goes to the
//! spillover whenever the spillover is non-empty, so once anything spilled, later pushes queue
//! behind it; otherwise it tries the ring and spills when the ring is full. The consumer pops
//! the ring first, then the spillover.
//!
//! Why each producer's items come out in the order it pushed them: an item of producer P in
//! the ring was pushed when the spillover was empty, so every earlier item of P that had
//! spilled was already popped; earlier items of P still in the ring precede it there (the
//! ring is FIFO); and items of P in the spillover are in push order (the spillover is FIFO,
//! and once P spills, P keeps spilling until the spillover drains). Items of different
//! producers interleave arbitrarily.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_queue::{ArrayQueue, SegQueue};

/// Ring capacity used by [`HybridChannel::new`] when none is given.
pub const HYBRID_RING_DEFAULT: usize = 1024;

struct Shared<T> {
    ring: ArrayQueue<T>,
    /// Items past the ring, each with the bytes its producer said it holds.
    spill: SegQueue<(T, usize)>,
    /// Most items the spillover takes (a concurrent push may pass it by one per producer).
    spill_max: usize,
    /// Bytes the spillover holds now, and at most (a concurrent push may pass it by one item
    /// per producer).
    spill_bytes: AtomicUsize,
    spill_bytes_max: usize,
    /// Pushes that went to the spillover (a sign the ring is too small).
    spilled: AtomicU64,
}

/// A multi-producer, single-consumer queue whose push never blocks: it fails only when the
/// spillover holds its bound already.
pub struct HybridChannel<T> {
    shared: Arc<Shared<T>>,
}

/// A producer handle; clone freely.
pub struct Sender<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<T> std::fmt::Debug for Sender<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sender").finish_non_exhaustive()
    }
}

impl<T> std::fmt::Debug for HybridChannel<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridChannel")
            .field("len", &self.len())
            .field("spilled", &self.spilled())
            .finish()
    }
}

impl<T> HybridChannel<T> {
    /// A channel whose ring holds `ring` items (at least 1), with an unbounded spillover.
    pub fn with_ring(ring: usize) -> Self {
        Self::with_bounds(ring, usize::MAX)
    }

    /// A channel whose ring holds `ring` items (at least 1) and whose spillover takes at most
    /// `spill_max` more (a push racing another may pass it by one per producer); past it a
    /// push hands its item back.
    pub fn with_bounds(ring: usize, spill_max: usize) -> Self {
        Self::with_limits(ring, spill_max, usize::MAX)
    }

    /// As [`HybridChannel::with_bounds`], and the spillover also holds at most `spill_bytes_max`
    /// bytes of items (as [`Sender::push_sized`] counts them).
    pub fn with_limits(ring: usize, spill_max: usize, spill_bytes_max: usize) -> Self {
        Self {
            shared: Arc::new(Shared {
                ring: ArrayQueue::new(ring.max(1)),
                spill: SegQueue::new(),
                spill_max,
                spill_bytes: AtomicUsize::new(0),
                spill_bytes_max,
                spilled: AtomicU64::new(0),
            }),
        }
    }

    /// Bytes of the items in the spillover (a snapshot).
    pub fn spill_bytes(&self) -> usize {
        self.shared.spill_bytes.load(Ordering::Relaxed)
    }

    /// A channel with the default ring of [`HYBRID_RING_DEFAULT`] items.
    pub fn new() -> Self {
        Self::with_ring(HYBRID_RING_DEFAULT)
    }

    /// A producer handle.
    pub fn sender(&self) -> Sender<T> {
        Sender {
            shared: Arc::clone(&self.shared),
        }
    }

    /// The next item: ring first, then spillover.
    #[inline]
    pub fn pop(&self) -> Option<T> {
        self.shared.ring.pop().or_else(|| {
            let (item, bytes) = self.shared.spill.pop()?;
            self.shared.spill_bytes.fetch_sub(bytes, Ordering::Relaxed);
            Some(item)
        })
    }

    /// Items queued (a snapshot; producers may be pushing).
    #[inline]
    pub fn len(&self) -> usize {
        self.shared.ring.len() + self.shared.spill.len()
    }

    /// Whether nothing is queued (a snapshot).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pushes that went to the spillover so far.
    pub fn spilled(&self) -> u64 {
        self.shared.spilled.load(Ordering::Relaxed)
    }
}

impl<T> Default for HybridChannel<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Sender<T> {
    /// Queues `item` without blocking; hands it back when the spillover holds its bound (see
    /// [`HybridChannel::with_bounds`]).
    #[inline]
    pub fn push(&self, item: T) -> Result<(), T> {
        self.push_sized(item, 0)
    }

    /// [`Sender::push`] of an item holding `bytes` bytes: should it spill, it is handed back
    /// when the spillover's bytes would pass their bound too (see
    /// [`HybridChannel::with_limits`]).
    #[inline]
    pub fn push_sized(&self, item: T, bytes: usize) -> Result<(), T> {
        let shared = &*self.shared;
        let item = if shared.spill.is_empty() {
            match shared.ring.push(item) {
                Ok(()) => return Ok(()),
                Err(item) => item,
            }
        } else {
            item
        };
        let held = shared.spill_bytes.load(Ordering::Relaxed);
        if shared.spill.len() >= shared.spill_max
            || held.saturating_add(bytes) > shared.spill_bytes_max
        {
            return Err(item);
        }
        shared.spilled.fetch_add(1, Ordering::Relaxed);
        shared.spill_bytes.fetch_add(bytes, Ordering::Relaxed);
        shared.spill.push((item, bytes));
        Ok(())
    }

    /// Queues `item` in the ring if [`Sender::push`] would put it there (nothing has spilled
    /// and the ring has room); otherwise hands it back and queues nothing. A producer that
    /// packs several items into one (a run) uses it to keep the spillover's bound in single
    /// items: a packed item that does not fit is unpacked and pushed item by item.
    #[inline]
    pub fn push_ring(&self, item: T) -> Result<(), T> {
        let shared = &*self.shared;
        if !shared.spill.is_empty() {
            return Err(item);
        }
        shared.ring.push(item)
    }
}

// A concurrency primitive is tested with real threads: the one place core spawns any.
#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn one_producer_is_fifo_across_the_ring_and_the_spillover() {
        let channel = HybridChannel::with_ring(4);
        let tx = channel.sender();
        let mut expected = 0;
        let mut next = 0;
        // Push bursts larger than the ring, popping a few in between.
        for burst in [10, 3, 7, 1, 20] {
            for _ in 0..burst {
                tx.push(next).expect("unbounded spillover");
                next += 1;
            }
            for _ in 0..burst / 2 + 1 {
                if let Some(item) = channel.pop() {
                    assert_eq!(item, expected);
                    expected += 1;
                }
            }
        }
        while let Some(item) = channel.pop() {
            assert_eq!(item, expected);
            expected += 1;
        }
        assert_eq!(expected, next);
        assert!(channel.spilled() > 0, "the bursts overflowed the ring");
    }

    #[test]
    fn the_spillover_is_bounded_in_bytes_as_well_as_items() {
        let channel = HybridChannel::with_limits(1, 100, 1_000);
        let tx = channel.sender();
        // The ring takes the first whatever its size; the spillover counts bytes.
        tx.push_sized(0, 5_000).expect("ring");
        tx.push_sized(1, 600).expect("spill");
        assert_eq!(tx.push_sized(2, 401), Err(2), "600 + 401 > 1,000");
        tx.push_sized(3, 400).expect("exactly 1,000");
        assert_eq!(channel.spill_bytes(), 1_000);
        assert_eq!(channel.pop(), Some(0));
        assert_eq!(channel.pop(), Some(1));
        assert_eq!(channel.spill_bytes(), 400);
        tx.push_sized(4, 600).expect("room again");
        assert_eq!(channel.pop(), Some(3));
        assert_eq!(channel.pop(), Some(4));
        assert_eq!(channel.spill_bytes(), 0);
    }

    /// `push_ring` takes the ring's room and nothing else: it refuses once the ring is full
    /// and while anything is spilled, and what it queued keeps its place among `push`es.
    #[test]
    fn push_ring_never_spills_and_keeps_order() {
        let channel = HybridChannel::with_ring(3);
        let tx = channel.sender();
        assert_eq!(tx.push_ring(0), Ok(()));
        assert_eq!(tx.push(1), Ok(()));
        assert_eq!(tx.push_ring(2), Ok(()));
        assert_eq!(tx.push_ring(9), Err(9), "the ring is full");
        assert_eq!(tx.push(3), Ok(()), "push spills");
        assert_eq!(channel.pop(), Some(0));
        assert_eq!(tx.push_ring(9), Err(9), "the ring has room but 3 spilled");
        assert_eq!(channel.spilled(), 1);
        let drained: Vec<_> = std::iter::from_fn(|| channel.pop()).collect();
        assert_eq!(drained, [1, 2, 3]);
        assert_eq!(tx.push_ring(4), Ok(()), "empty again");
        assert_eq!(channel.pop(), Some(4));
    }

    /// Many threads push concurrently while the consumer pops: nothing lost, nothing
    /// duplicated, each producer's items in its order, no push ever blocks.
    #[test]
    fn many_producers_fifo_per_producer_no_loss_under_contention() {
        const PRODUCERS: u64 = 8;
        const ITEMS: u64 = 50_000;
        for ring in [1, 16, 1024] {
            let channel = HybridChannel::with_ring(ring);
            let done = Arc::new(AtomicBool::new(false));
            // The consumer parks when it finds nothing; every push unparks it (a token is
            // kept, so a push between its look and its park is not missed).
            let consumer = std::thread::current();
            let producers: Vec<_> = (0..PRODUCERS)
                .map(|p| {
                    let tx = channel.sender();
                    let consumer = consumer.clone();
                    std::thread::spawn(move || {
                        for i in 0..ITEMS {
                            tx.push((p, i)).expect("unbounded spillover");
                            consumer.unpark();
                        }
                    })
                })
                .collect();
            let mut next: BTreeMap<u64, u64> = BTreeMap::new();
            let mut received = 0;
            let finisher = {
                let done = Arc::clone(&done);
                std::thread::spawn(move || {
                    for producer in producers {
                        producer.join().expect("producer");
                    }
                    done.store(true, Ordering::SeqCst);
                    consumer.unpark();
                })
            };
            loop {
                match channel.pop() {
                    Some((p, i)) => {
                        let expected = next.entry(p).or_insert(0);
                        assert_eq!(i, *expected, "producer {p} out of order (ring {ring})");
                        *expected += 1;
                        received += 1;
                    }
                    None if done.load(Ordering::SeqCst) && channel.is_empty() => break,
                    None => std::thread::park(),
                }
            }
            finisher.join().expect("finisher");
            assert_eq!(received, PRODUCERS * ITEMS, "ring {ring}: every item once");
            assert!(next.values().all(|n| *n == ITEMS));
        }
    }

    #[test]
    fn past_its_bound_the_spillover_hands_items_back_and_order_holds() {
        let channel = HybridChannel::with_bounds(2, 3);
        let tx = channel.sender();
        for i in 0..5 {
            assert_eq!(tx.push(i), Ok(()), "ring 2 + spillover 3");
        }
        assert_eq!(tx.push(5), Err(5), "full: handed back, not queued");
        assert_eq!(channel.len(), 5);
        assert_eq!(channel.pop(), Some(0));
        assert_eq!(channel.pop(), Some(1));
        // The ring has room, but the spillover still holds 2, 3, 4: a new item must queue
        // behind them, and the spillover is full.
        assert_eq!(tx.push(6), Err(6));
        assert_eq!(channel.pop(), Some(2));
        assert_eq!(tx.push(7), Ok(()));
        let rest: Vec<_> = std::iter::from_fn(|| channel.pop()).collect();
        assert_eq!(rest, vec![3, 4, 7]);
    }
}
