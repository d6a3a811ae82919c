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
//!
//! # Closing without a lock on the producers' path
//!
//! The consumer may end: [`HybridChannel::close_if_empty`] closes the channel only when it
//! holds nothing, and a producer that pushed without any lock learns from
//! [`Sender::push_checked`] whether its item may have landed in a closed channel. The two
//! sides are a store-then-load pair each, separated by a sequentially consistent fence
//! (the consumer marks closed, fences, looks for items; the producer pushes, fences, looks
//! at the mark), so at least one of them sees the other: either the consumer finds the item
//! and reopens, or the producer finds the mark. A producer that finds it must wait until the
//! close is settled (the caller's lock, under which the consumer closes) and, if it held,
//! take back what is stranded with [`Sender::take_stranded`]: nothing pushed is lost.

use std::sync::atomic::{fence, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_queue::{ArrayQueue, SegQueue};

/// The channel's close states (see the module's docs).
const OPEN: u8 = 0;
const CLOSED: u8 = 1;
const ENDED: u8 = 2;

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
    /// [`OPEN`], [`CLOSED`] (by the consumer's [`HybridChannel::close_if_empty`], undone
    /// there when an item raced it) or [`ENDED`] (by [`Sender::close`], for good).
    closed: AtomicU8,
}

impl<T> Shared<T> {
    /// The next item: ring first, then spillover.
    #[inline]
    fn pop(&self) -> Option<T> {
        self.ring.pop().or_else(|| {
            let (item, bytes) = self.spill.pop()?;
            self.spill_bytes.fetch_sub(bytes, Ordering::Relaxed);
            Some(item)
        })
    }
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
                closed: AtomicU8::new(OPEN),
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
        self.shared.pop()
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

    /// Closes the channel if it holds nothing; `false` (and the channel stays open) when an
    /// item is queued, however recently pushed. `true` for a channel ended by
    /// [`Sender::close`], whatever it holds. A producer whose push raced the close learns
    /// it from [`Sender::push_checked`]. The caller serialises this with the producers'
    /// settling (see the module's docs): while it runs, a producer may see the channel
    /// closed and then open again.
    pub fn close_if_empty(&self) -> bool {
        let closed = &self.shared.closed;
        if closed
            .compare_exchange(OPEN, CLOSED, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            // Closed already (ended for good by `Sender::close`).
            return true;
        }
        fence(Ordering::SeqCst);
        if self.is_empty() {
            return true;
        }
        // Reopened, unless it ended meanwhile (an end is never undone).
        let _ = closed.compare_exchange(CLOSED, OPEN, Ordering::Relaxed, Ordering::Relaxed);
        false
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
    #[inline(always)]
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

    /// [`Sender::push_sized`], then whether the channel is closed, with the fence the close
    /// handshake needs between the two (see the module's docs): `Ok(true)` when the item was
    /// queued and the channel may have been closed around it; the caller then settles the
    /// close and takes back what is stranded. The fence also orders the push before whatever
    /// the caller reads next (a consumer's sleep flag).
    #[inline]
    pub fn push_checked(&self, item: T, bytes: usize) -> Result<bool, T> {
        self.push_sized(item, bytes)?;
        fence(Ordering::SeqCst);
        Ok(self.shared.closed.load(Ordering::Relaxed) != OPEN)
    }

    /// Closes the channel whatever it holds (its consumer is ending for good): producers
    /// that push from now on learn it from [`Sender::push_checked`], and what is queued is
    /// stranded ([`Sender::take_stranded`]).
    pub fn close(&self) {
        self.shared.closed.store(ENDED, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Whether the channel is closed now (a snapshot: a close may be in progress and be
    /// undone, see [`HybridChannel::close_if_empty`]).
    #[inline]
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Relaxed) != OPEN
    }

    /// Takes back the next item of a channel whose close held (its consumer pops no more):
    /// what producers pushed into it after its consumer last looked. `None` while the
    /// channel is open, so an open channel's items stay its consumer's. Several producers
    /// may take back concurrently: each item goes to one of them.
    pub fn take_stranded(&self) -> Option<T> {
        let shared = &*self.shared;
        if shared.closed.load(Ordering::Acquire) == OPEN {
            return None;
        }
        shared.pop()
    }

    /// Whether [`Sender::push_ring`] would find room now (a snapshot: other producers may
    /// take it first).
    #[inline]
    pub fn ring_has_room(&self) -> bool {
        self.shared.spill.is_empty() && !self.shared.ring.is_full()
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

    /// The close handshake against producers that push without a lock: the consumer closes
    /// whenever it finds the channel empty (under the settling lock, as the egress table's
    /// writer does), racing pushes that land a moment later; a producer that learns of a
    /// close settles it under the same lock and takes back what is stranded. Every item is
    /// either consumed or taken back, once; what the consumer got of each producer is a
    /// prefix, and what was taken back is the rest in order.
    #[test]
    fn a_close_racing_lock_free_pushes_strands_nothing_and_keeps_each_producers_order() {
        use std::sync::Mutex;
        const PRODUCERS: u64 = 3;
        const ITEMS: u64 = 300;
        let (mut raced, mut stranded_total) = (0u64, 0usize);
        for round in 0..200u64 {
            let channel = Arc::new(HybridChannel::with_ring(1 + (round % 4) as usize));
            // The settling lock; under it, the items taken back in the order taken.
            let settle = Arc::new(Mutex::new(Vec::new()));
            let saw_close = Arc::new(AtomicU64::new(0));
            let producers: Vec<_> = (0..PRODUCERS)
                .map(|p| {
                    let (tx, settle, saw_close) =
                        (channel.sender(), settle.clone(), saw_close.clone());
                    std::thread::spawn(move || {
                        for i in 0..ITEMS {
                            if tx.push_checked((p, i), 0).expect("unbounded spillover") {
                                saw_close.fetch_add(1, Ordering::Relaxed);
                                let mut taken = settle.lock().expect("settle");
                                if tx.is_closed() {
                                    taken.extend(std::iter::from_fn(|| tx.take_stranded()));
                                }
                            }
                        }
                    })
                })
                .collect();
            let mut consumed = Vec::new();
            loop {
                if let Some(item) = channel.pop() {
                    consumed.push(item);
                    continue;
                }
                let _settling = settle.lock().expect("settle");
                if channel.close_if_empty() {
                    break;
                }
            }
            for producer in producers {
                producer.join().expect("producer");
            }
            let stranded = std::mem::take(&mut *settle.lock().expect("settle"));
            // Nothing is left behind once every producer settled.
            assert_eq!(channel.sender().take_stranded(), None);
            raced += saw_close.load(Ordering::Relaxed);
            stranded_total += stranded.len();
            for p in 0..PRODUCERS {
                let got: Vec<u64> = consumed
                    .iter()
                    .filter(|(q, _)| *q == p)
                    .map(|x| x.1)
                    .collect();
                let back: Vec<u64> = stranded
                    .iter()
                    .filter(|(q, _)| *q == p)
                    .map(|x| x.1)
                    .collect();
                let all: Vec<u64> = got.iter().chain(&back).copied().collect();
                assert_eq!(
                    all,
                    (0..ITEMS).collect::<Vec<_>>(),
                    "round {round}, producer {p}: consumed {got:?}, taken back {back:?}"
                );
            }
        }
        // The races were run, not skipped: producers met closes and took items back.
        assert!(
            raced > 0 && stranded_total > 0,
            "raced {raced}, stranded {stranded_total}"
        );
    }

    #[test]
    fn a_close_is_refused_while_anything_is_queued_and_an_open_channel_strands_nothing() {
        let channel = HybridChannel::with_ring(2);
        let tx = channel.sender();
        assert_eq!(tx.push_checked(1, 0), Ok(false));
        assert!(!channel.close_if_empty(), "an item is queued");
        assert!(!tx.is_closed());
        assert_eq!(
            tx.take_stranded(),
            None,
            "an open channel's items are its consumer's"
        );
        assert_eq!(channel.pop(), Some(1));
        assert!(channel.close_if_empty());
        assert_eq!(
            tx.push_checked(2, 0),
            Ok(true),
            "the producer learns of the close"
        );
        assert_eq!(
            channel.pop(),
            Some(2),
            "still poppable; the caller decides who takes it"
        );
        assert_eq!(tx.push_checked(3, 0), Ok(true));
        assert_eq!(tx.take_stranded(), Some(3));
        assert_eq!(tx.take_stranded(), None);
        let other = HybridChannel::with_ring(1);
        other.sender().push(7).expect("push");
        other.sender().close();
        assert!(other.close_if_empty(), "an end is never undone");
        assert!(other.sender().is_closed());
        assert_eq!(
            other.sender().take_stranded(),
            Some(7),
            "a forced close strands its items"
        );
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
