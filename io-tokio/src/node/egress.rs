//! The actor plane's egress: each peer's queue (a ring and a bounded spillover) and the one writer
//! task that drains it in batches, asking the machine for the connection per batch.

use super::*;
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use tether_core::limits::{EGRESS_RUN_BLOCK_BYTES, EGRESS_TAGS_MAX};
use tether_core::wire::actor::check_record;

/// The egress table, behind the node's egress lock: each peer's queue, and the tags the queued
/// frames name by number.
///
/// A lone [`Inner::send`] usually skips the lock: each thread remembers the last few queues
/// it sent to ([`SendCache`]) and pushes into one with [`Sender::push_checked`]. A writer
/// retires its queue under the write lock and only when the queue is empty, by closing its
/// channel ([`HybridChannel::close_if_empty`]); a push that raced the close learns it and
/// settles under the lock, taking back what is stranded and sending it again
/// ([`Inner::settle_stranded`]). Nothing pushed is lost and each thread's frames keep their
/// order (core's channel tests drive the race).
#[derive(Default)]
pub(super) struct Egress {
    /// By peer, hashed: a lookup compares one id (a `BTreeMap` compares several, each a
    /// `memcmp` of 32 bytes, on every frame).
    pub(super) queues: HashMap<NodeId, Arc<PeerQueue>, foldhash::fast::RandomState>,
    pub(super) tags: TagTable,
    /// The node closed: no queue is made again.
    pub(super) closed: bool,
}

/// Tags by number, up to [`EGRESS_TAGS_MAX`]: a queued frame carries its tag's number, so its
/// slot holds 72 bytes instead of 88. Only writers add tags (those of boxed frames), so a
/// `send` takes the egress lock for reading only.
#[derive(Default)]
pub(super) struct TagTable {
    /// Every tag in the order it was added, shared with the writers (a new tag copies it).
    list: Arc<Vec<Cow<'static, str>>>,
    /// The same, by text, for the tags past the first few.
    index: HashMap<Cow<'static, str>, u32>,
}

/// Tags a lookup compares in turn before it hashes: a node sends a handful of tags, and a
/// static tag compares by its pointer.
const TAG_SCAN: usize = 8;

impl TagTable {
    /// The number of `tag`, if it has one.
    #[inline]
    pub(super) fn find(&self, tag: &str) -> Option<u32> {
        for (number, known) in self.list.iter().take(TAG_SCAN).enumerate() {
            if same_tag(known, tag) {
                return Some(number as u32);
            }
        }
        if self.list.len() <= TAG_SCAN {
            return None;
        }
        self.find_hashed(tag)
    }

    #[inline(never)]
    fn find_hashed(&self, tag: &str) -> Option<u32> {
        self.index.get(tag).copied()
    }

    /// Gives `tag` a number, unless it has one, the table is full, or the tag could never be
    /// sent (longer than the wire takes).
    pub(super) fn add(&mut self, tag: Cow<'static, str>) {
        if self.find(&tag).is_some()
            || self.list.len() >= EGRESS_TAGS_MAX
            || tag.len() > tether_core::limits::ACTOR_TAG_BYTES_MAX
        {
            return;
        }
        let number = self.list.len() as u32;
        Arc::make_mut(&mut self.list).push(tag.clone());
        self.index.insert(tag, number);
    }

    /// The tags by number, for a writer to read without the lock.
    pub(super) fn snapshot(&self) -> Arc<Vec<Cow<'static, str>>> {
        self.list.clone()
    }

    /// Tags with a number.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.list.len()
    }
}

/// A peer's egress queue: producers push, the writer task drains.
pub(super) struct PeerQueue {
    peer: NodeId,
    pub(super) sender: Sender<Slot>,
    pub(super) wake: Arc<WriterWake>,
    /// Held while frames stranded in this queue after its writer retired are sent again, so
    /// a thread whose frame another thread took back waits until it is queued anew.
    settling: Mutex<()>,
}

/// Nodes in this process so far (a thread's send cache tells them apart by number: an
/// address could be reused).
static NODES: AtomicU64 = AtomicU64::new(0);

/// A number no other node of this process has.
pub(super) fn next_node_id() -> u64 {
    NODES.fetch_add(1, Ordering::Relaxed)
}

use tether_core::limits::NODE_SEND_CACHE_QUEUES as SEND_CACHE_ENTRIES;

/// A thread's last few egress queues, found without the egress lock. An entry keeps its queue
/// allocated until replaced (at most [`SEND_CACHE_ENTRIES`] per thread); one whose writer
/// retired is closed, and a send through it goes by the table instead.
struct SendCache {
    entries: [Option<Cached>; SEND_CACHE_ENTRIES],
    /// The entry the next miss replaces.
    next: usize,
}

struct Cached {
    node: u64,
    peer: NodeId,
    queue: Arc<PeerQueue>,
    /// The node's tags by number when the entry was made: a tag past them is a miss.
    tags: Arc<Vec<Cow<'static, str>>>,
}

/// What a send through the cache did.
enum Cache {
    /// Queued; `Some` when the queue's writer may have retired around the push.
    Queued(Option<Arc<PeerQueue>>),
    /// The queue had no room (the frame is dropped, the machine counts it).
    Full,
    /// Not in the cache (or its queue retired, or its tag is new): the table decides.
    Miss,
}

impl SendCache {
    /// Queues the frame to `peer` (its payload taken out of `payload` only when queued).
    #[inline]
    fn send(
        &mut self,
        node: u64,
        peer: &NodeId,
        dest: ActorAddr,
        type_tag: &str,
        payload: &mut Option<Bytes>,
    ) -> Cache {
        let found = self
            .entries
            .iter()
            .flatten()
            .find(|entry| entry.node == node && entry.peer == *peer);
        let Some(entry) = found else {
            return Cache::Miss;
        };
        if entry.queue.sender.is_closed() {
            // Retired: let go of it (its ring) now.
            self.entries
                .iter_mut()
                .filter(|slot| {
                    slot.as_ref()
                        .is_some_and(|entry| entry.node == node && entry.peer == *peer)
                })
                .for_each(|slot| *slot = None);
            return Cache::Miss;
        }
        let tag = entry
            .tags
            .iter()
            .take(TAG_SCAN)
            .position(|known| same_tag(known, type_tag));
        let Some(tag) = tag else {
            return Cache::Miss;
        };
        let Some(payload) = payload.take() else {
            return Cache::Miss;
        };
        let bytes = std::mem::size_of::<Slot>() + payload.len();
        let slot = Slot::One(Queued {
            dest,
            payload,
            tag: tag as u32,
        });
        match entry.queue.sender.push_checked(slot, bytes) {
            Ok(closed) => {
                // The push's fence is the one the writer's sleep flag pairs with.
                entry.queue.wake.wake_fenced();
                Cache::Queued(closed.then(|| entry.queue.clone()))
            }
            Err(_) => Cache::Full,
        }
    }

    /// Remembers `queue` as `peer`'s, in place of the entry for it or the oldest.
    fn remember(&mut self, node: u64, peer: NodeId, queue: &Arc<PeerQueue>, tags: &TagTable) {
        let at = self
            .entries
            .iter()
            .position(|entry| {
                entry
                    .as_ref()
                    .is_some_and(|entry| entry.node == node && entry.peer == peer)
            })
            .unwrap_or_else(|| {
                let at = self.next;
                self.next = (at + 1) % SEND_CACHE_ENTRIES;
                at
            });
        self.entries[at] = Some(Cached {
            node,
            peer,
            queue: queue.clone(),
            tags: tags.snapshot(),
        });
    }
}

thread_local! {
    static SEND_CACHE: RefCell<SendCache> = const {
        RefCell::new(SendCache {
            entries: [const { None }; SEND_CACHE_ENTRIES],
            next: 0,
        })
    };
}

/// A frame in a peer's egress queue (the peer is the queue's, so the slot does not carry it),
/// its tag named by number in the egress table's [`TagTable`].
pub(super) struct Queued {
    pub(super) dest: ActorAddr,
    pub(super) payload: Bytes,
    pub(super) tag: u32,
}

/// A frame whose tag had no number when it was queued: it carries the tag itself.
pub(super) struct Loose {
    pub(super) dest: ActorAddr,
    pub(super) type_tag: Cow<'static, str>,
    pub(super) payload: Bytes,
}

/// A run of frames for one peer encoded by its sender (what [`Node::send_batch`] hands
/// over): the writer hands the records to the stream as they are, without a copy.
pub(super) struct Encoded {
    /// Split off a [`RunBuffer`]'s block, after the run one `send_batch` call encoded before
    /// it in the same block.
    records: BytesMut,
    frames: u64,
    /// A frame of the run carries a SWIM tag (as the writer judges a batch).
    swim: bool,
}

impl Encoded {
    /// The run's frames for `to` again, decoded from the records (core's decoder: what was
    /// encoded by core's rule decodes whole).
    fn into_frames(self, to: NodeId, payload_bytes_max: usize) -> Vec<OutFrame> {
        let mut decoder =
            StreamDecoder::new(ActorDecoder::with_payload_bytes_max(payload_bytes_max));
        decoder.push_bytes(self.records.freeze());
        std::iter::from_fn(|| decoder.pop().ok().flatten())
            .map(|record| OutFrame {
                to,
                dest: ActorAddr::new(*record.dest()),
                type_tag: Cow::Owned(record.tag().to_owned()),
                payload: record.into_payload(),
            })
            .collect()
    }
}

/// A frame as queued and as the writer pops it: its tag by number, or the tag itself; or a
/// run of frames encoded already.
pub(super) enum Popped {
    Numbered(Queued),
    Loose(Loose),
    Encoded(Encoded),
}

impl Popped {
    /// `frame` as queued: its tag numbered if `tags` has it.
    #[inline(always)]
    fn of(frame: OutFrame, tags: &TagTable) -> Self {
        match tags.find(&frame.type_tag) {
            Some(tag) => Self::Numbered(Queued {
                dest: frame.dest,
                payload: frame.payload,
                tag,
            }),
            None => Self::Loose(Loose {
                dest: frame.dest,
                type_tag: frame.type_tag,
                payload: frame.payload,
            }),
        }
    }

    /// Bytes it holds while queued.
    #[inline]
    fn bytes(&self) -> usize {
        match self {
            Self::Numbered(frame) => std::mem::size_of::<Slot>() + frame.payload.len(),
            Self::Loose(frame) => {
                std::mem::size_of::<Slot>()
                    + std::mem::size_of::<More>()
                    + frame.type_tag.len()
                    + frame.payload.len()
            }
            Self::Encoded(run) => {
                std::mem::size_of::<Slot>() + std::mem::size_of::<More>() + run.records.len()
            }
        }
    }

    /// The frames for `to` again, a tag by number read in `tags` (numbers never change).
    fn into_frames(
        self,
        to: NodeId,
        tags: &[Cow<'static, str>],
        payload_bytes_max: usize,
    ) -> Vec<OutFrame> {
        match self {
            Self::Numbered(frame) => vec![OutFrame {
                to,
                dest: frame.dest,
                type_tag: tags[frame.tag as usize].clone(),
                payload: frame.payload,
            }],
            Self::Loose(frame) => vec![OutFrame {
                to,
                dest: frame.dest,
                type_tag: frame.type_tag,
                payload: frame.payload,
            }],
            Self::Encoded(run) => run.into_frames(to, payload_bytes_max),
        }
    }

    /// The slot that holds it alone.
    #[inline]
    fn into_slot(self) -> Slot {
        match self {
            Self::Numbered(frame) => Slot::One(frame),
            Self::Loose(frame) => Slot::More(Box::new(More::Loose(frame))),
            Self::Encoded(run) => Slot::More(Box::new(More::Encoded(run))),
        }
    }
}

/// One slot of a peer's egress queue: a frame whose tag has a number (the hot path), or, boxed,
/// a run of at most [`EGRESS_RUN_FRAMES_MAX`] frames handed over together (what
/// [`Node::send_batch`] packs; only the ring takes runs) or a frame carrying its own tag.
pub(super) enum Slot {
    One(Queued),
    More(Box<More>),
}

// The slot crosses from the sending core to the writer's with every frame: as small as the
// channel floor's (an actor address and a payload handle).
const _: () = assert!(std::mem::size_of::<Slot>() <= 72);

/// The slots that are not a lone numbered frame.
pub(super) enum More {
    Loose(Loose),
    Encoded(Encoded),
}

impl Slot {
    /// What the slot holds, as the writer pops it.
    #[inline]
    fn into_popped(self) -> Popped {
        match self {
            Self::One(frame) => Popped::Numbered(frame),
            Self::More(more) => match *more {
                More::Loose(frame) => Popped::Loose(frame),
                More::Encoded(run) => Popped::Encoded(run),
            },
        }
    }
}

/// The writer's side of a peer's queue.
pub(super) struct Drain {
    pub(super) channel: HybridChannel<Slot>,
}

impl Drain {
    pub(super) fn new(channel: HybridChannel<Slot>) -> Self {
        Self { channel }
    }

    #[inline]
    pub(super) fn pop(&mut self) -> Option<Popped> {
        self.channel.pop().map(Slot::into_popped)
    }

    /// Whether nothing is queued (a snapshot; producers may be pushing).
    pub(super) fn is_empty(&self) -> bool {
        self.channel.is_empty()
    }
}

/// Wakes a peer's writer only when it is asleep: a producer that finds it awake (the usual
/// case under load) reads one flag instead of notifying per frame. The fences pair up: either
/// the writer sees a frame pushed before it fell asleep, or the producer sees it asleep.
#[derive(Default)]
pub(super) struct WriterWake {
    pub(super) notify: Notify,
    pub(super) asleep: AtomicBool,
    /// The driver retired this writer (it ends unless a frame raced the retirement).
    pub(super) retire: AtomicBool,
}

impl WriterWake {
    /// After a push: wakes the writer if it fell asleep.
    pub(super) fn wake(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.asleep.load(Ordering::Relaxed) && self.asleep.swap(false, Ordering::Relaxed) {
            self.notify.notify_one();
        }
    }

    /// [`WriterWake::wake`] after a push that fenced already ([`Sender::push_checked`]).
    #[inline]
    pub(super) fn wake_fenced(&self) {
        if self.asleep.load(Ordering::Relaxed) && self.asleep.swap(false, Ordering::Relaxed) {
            self.notify.notify_one();
        }
    }

    /// Wakes the writer whether or not it sleeps (there is something new besides frames).
    pub(super) fn kick(&self) {
        self.notify.notify_one();
    }

    /// Sleeps until woken, unless `has_work` finds a frame pushed after the writer looked.
    pub(super) async fn sleep(&self, has_work: impl Fn() -> bool) {
        let notified = self.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        self.asleep.store(true, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::SeqCst);
        if has_work() {
            self.asleep.store(false, Ordering::Relaxed);
            return;
        }
        notified.await;
    }
}

impl Inner {
    /// Whether the wire can carry `frame` (core's rule); a frame it cannot is counted (the
    /// machine's drop) and goes no further, so a writer never meets one.
    #[inline]
    pub(super) fn sendable(self: &Arc<Self>, frame: &OutFrame) -> bool {
        let payload = frame.payload.len();
        let checked = check_record(&frame.type_tag, payload, self.payload_bytes_max).is_ok();
        if !checked {
            self.unsendable();
        }
        checked
    }

    /// A frame the wire cannot carry was handed over: the machine counts it.
    #[cold]
    #[inline(never)]
    fn unsendable(self: &Arc<Self>) {
        self.drive(|driver, now| driver.handle_unencodable(now, 1));
    }

    /// The next frame of `frames` that is [`Inner::sendable`] (the others are counted).
    #[inline]
    pub(super) fn next_sendable(
        self: &Arc<Self>,
        frames: &mut impl Iterator<Item = OutFrame>,
    ) -> Option<OutFrame> {
        frames.find(|frame| self.sendable(frame))
    }

    /// One frame: through this thread's [`SendCache`] without the egress lock when it knows
    /// the peer's queue, else as [`Inner::send_run`] with a run of one, without the run's
    /// iterator layers (each moves the frame once more, which a lone 64 B frame feels).
    #[inline]
    pub(super) fn send(self: &Arc<Self>, frame: OutFrame) {
        let OutFrame {
            to,
            dest,
            type_tag,
            payload,
        } = frame;
        // Moved into the queue only on a hit: the frame is not moved whole again.
        let mut payload = Some(payload);
        let cached = SEND_CACHE
            .try_with(|cache| match cache.try_borrow_mut() {
                Ok(mut cache) => cache.send(self.id, &to, dest, &type_tag, &mut payload),
                Err(_) => Cache::Miss,
            })
            .unwrap_or(Cache::Miss);
        match cached {
            Cache::Queued(stranded) => {
                self.counters.enqueued.fetch_add(1, Ordering::Relaxed);
                if let Some(queue) = stranded {
                    self.settle_stranded(queue);
                }
            }
            Cache::Full => self.drive(|driver, now| driver.handle_egress_full(now, 1)),
            Cache::Miss => self.send_by_table(OutFrame {
                to,
                dest,
                type_tag,
                payload: payload.expect("queued only on a hit"),
            }),
        }
    }

    /// A lone frame the thread's cache could not place: by the egress table, and the queue
    /// it finds remembered for the next.
    #[inline(never)]
    fn send_by_table(self: &Arc<Self>, frame: OutFrame) {
        {
            let egress = self.egress_read();
            if let Some(queue) = egress.queues.get(&frame.to) {
                let peer = frame.to;
                let frame = Popped::of(frame, &egress.tags);
                let bytes = frame.bytes();
                let queued = queue.sender.push_sized(frame.into_slot(), bytes).is_ok();
                let _ = SEND_CACHE.try_with(|cache| {
                    if let Ok(mut cache) = cache.try_borrow_mut() {
                        cache.remember(self.id, peer, queue, &egress.tags);
                    }
                });
                return self.enqueued(queue, u64::from(queued), u64::from(!queued), false);
            }
        }
        self.send_run(frame.to, &mut std::iter::once(frame).peekable());
    }

    /// A push through the cache found its queue closed: once the close is settled (writers
    /// close under the egress lock), and if it held, what is stranded in the queue is taken
    /// back and sent again by the table, as frames sent now would be. Not counted again:
    /// `frames_enqueued` counts each frame once, when it enters a queue.
    #[cold]
    #[inline(never)]
    pub(super) fn settle_stranded(self: &Arc<Self>, queue: Arc<PeerQueue>) {
        let (held, tags) = {
            let egress = self.egress_read();
            (queue.sender.is_closed(), egress.tags.snapshot())
        };
        if !held {
            // The writer found the frame and stayed.
            return;
        }
        let _settling = queue
            .settling
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let peer = queue.peer;
        let frames: Vec<OutFrame> = std::iter::from_fn(|| queue.sender.take_stranded())
            .flat_map(|slot| {
                slot.into_popped()
                    .into_frames(peer, &tags, self.payload_bytes_max)
            })
            .collect();
        if frames.is_empty() {
            return;
        }
        self.send_run_counted(peer, &mut frames.into_iter().peekable(), true);
    }

    /// Queues frames all addressed to `peer`, in order.
    pub(super) fn send_run(self: &Arc<Self>, peer: NodeId, frames: &mut impl Run) {
        self.send_run_counted(peer, frames, false);
    }

    /// [`Inner::send_run`]; `counted` when the frames entered a queue before (taken back from
    /// a retired one): queued again, they are not counted again.
    fn send_run_counted(self: &Arc<Self>, peer: NodeId, frames: &mut impl Run, counted: bool) {
        // The hot path: the peer has a queue (it was admitted when the queue started, and the
        // allow-list is fixed). Its writer asks the machine for the connection per batch.
        {
            let egress = self.egress_read();
            if let Some(queue) = egress.queues.get(&peer) {
                return self.enqueue(queue, &egress.tags, frames, counted);
            }
        }
        if frames.peek_frame().is_none() {
            return;
        }
        let verdict = self.ask(|driver, now| driver.handle_send(now, peer), Answer::send);
        if verdict != SendVerdict::Enqueue {
            // The slow path: each further frame is judged (and counted) as a lone send is.
            frames.drop_frame();
            while let Some(frame) = frames.take_frame() {
                self.send(frame);
            }
            return;
        }
        let mut egress = self.egress_write();
        if egress.closed {
            // The node closed after the machine let the run through: asked again, each frame
            // is refused and counted.
            drop(egress);
            while let Some(frame) = frames.take_frame() {
                self.send(frame);
            }
            return;
        }
        let Egress { queues, tags, .. } = &mut *egress;
        let fresh = !queues.contains_key(&peer);
        let queue = queues.entry(peer).or_insert_with(|| {
            let channel = HybridChannel::with_limits(
                self.egress_ring,
                self.egress_spill,
                EGRESS_SPILL_BYTES_MAX,
            );
            let queue = Arc::new(PeerQueue {
                peer,
                sender: channel.sender(),
                wake: Arc::default(),
                settling: Mutex::new(()),
            });
            let (inner, wake) = (self.clone(), queue.wake.clone());
            self.spawn(
                async move { inner.write_peer(peer, channel, wake).await }
                    .instrument(tracing::debug_span!("writer", peer = %peer)),
            );
            queue
        });
        self.enqueue(queue, tags, frames, counted);
        if fresh {
            // The next lone send to the peer from this thread skips the table.
            let _ = SEND_CACHE.try_with(|cache| {
                if let Ok(mut cache) = cache.try_borrow_mut() {
                    cache.remember(self.id, peer, queue, tags);
                }
            });
            bump(&self.counters.queues_started);
            self.egress_count.send_replace(queues.len());
        }
    }

    /// Pushes `frames` into `queue`: counted once for all of them, the writer woken as each run
    /// goes in (so it starts on the first while the rest are encoded) and after the last. Runs
    /// of up to [`EGRESS_RUN_FRAMES_MAX`] are encoded here, on the sending thread, into one
    /// ring slot each (the writer hands the records to the stream as they are); a run the
    /// ring has no room for is pushed frame by frame, as lone frames are, so the spillover
    /// stays bounded in frames.
    pub(super) fn enqueue(
        self: &Arc<Self>,
        queue: &PeerQueue,
        tags: &TagTable,
        frames: &mut impl Run,
        counted: bool,
    ) {
        let (mut enqueued, mut full, mut unencodable) = (0u64, 0u64, 0u64);
        let mut count = |frames: u64, queued: bool| {
            if queued {
                enqueued += frames;
            } else {
                full += frames;
            }
        };
        let push_one = |frame: OutFrame, count: &mut dyn FnMut(u64, bool)| {
            let frame = Popped::of(frame, tags);
            let bytes = frame.bytes();
            count(1, queue.sender.push_sized(frame.into_slot(), bytes).is_ok());
        };
        // The runs are split off the blocks of one buffer (the runs of a block share its
        // allocation, end to end).
        let (mut routes, mut records) = (None, RunBuffer::default());
        while let Some(first) = frames.take_frame() {
            if frames.peek_frame().is_none() || !queue.sender.ring_has_room() {
                push_one(first, &mut count);
                continue;
            }
            let routes = routes.get_or_insert_with(|| self.routes_now());
            let (run, skipped) =
                encode_run(first, frames, routes, &mut records, self.payload_bytes_max);
            unencodable += skipped;
            let frames_in_run = run.frames;
            match queue
                .sender
                .push_ring(Slot::More(Box::new(More::Encoded(run))))
            {
                Ok(()) => {
                    count(frames_in_run, true);
                    // The writer starts on the first run while the rest are encoded (woken
                    // only if it sleeps: a flag read per run of frames).
                    queue.wake.wake();
                }
                Err(refused) => {
                    // Another producer took the room: unpacked, frame by frame.
                    let unpacked = refused.into_popped().into_frames(
                        queue.peer,
                        &tags.list,
                        self.payload_bytes_max,
                    );
                    // Every record decodes (core encoded them); were one not to, it is counted.
                    unencodable += frames_in_run.saturating_sub(unpacked.len() as u64);
                    for frame in unpacked {
                        push_one(frame, &mut count);
                    }
                }
            }
        }
        self.enqueued(queue, enqueued, full, counted);
        if unencodable > 0 {
            self.drive(|driver, now| driver.handle_unencodable(now, unencodable));
        }
    }

    /// After pushing into `queue`: `enqueued` frames went in (counted, the writer woken once)
    /// and `full` found no room (the machine counts the drops).
    /// (`counted`: they were counted when they first entered a queue.)
    pub(super) fn enqueued(
        self: &Arc<Self>,
        queue: &PeerQueue,
        enqueued: u64,
        full: u64,
        counted: bool,
    ) {
        if enqueued > 0 {
            queue.wake.wake();
            if !counted {
                self.counters
                    .enqueued
                    .fetch_add(enqueued, Ordering::Relaxed);
            }
        }
        if full > 0 {
            self.drive(|driver, now| driver.handle_egress_full(now, full));
        }
    }

    /// The driver retired `peer`'s writer: its queue is closed and torn down unless a frame
    /// arrived (then the writer goes on and reports again when it drains). Under the write
    /// lock, so a push through a thread's cache that raced the close settles after it (see
    /// [`Egress`]). `true` when the writer should end.
    pub(super) fn retire_queue(
        &self,
        peer: &NodeId,
        wake: &Arc<WriterWake>,
        queue: &Drain,
    ) -> bool {
        let mut egress = self.egress_write();
        if !queue.channel.close_if_empty() {
            return false;
        }
        let queues = &mut egress.queues;
        if queues
            .get(peer)
            .is_some_and(|queue| Arc::ptr_eq(&queue.wake, wake))
        {
            queues.remove(peer);
            bump(&self.counters.queues_retired);
            self.egress_count.send_replace(queues.len());
            debug!(peer = %peer, "idle egress queue torn down");
        }
        true
    }

    pub(super) fn egress_read(&self) -> std::sync::RwLockReadGuard<'_, Egress> {
        self.egress.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn egress_write(&self) -> std::sync::RwLockWriteGuard<'_, Egress> {
        self.egress.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// The writer of one peer: drains its queue onto one long-lived uni stream of the
    /// connection the machine names per batch; reports idleness, failures and cache misses.
    pub(super) async fn write_peer(
        self: Arc<Self>,
        peer: NodeId,
        channel: HybridChannel<Slot>,
        wake: Arc<WriterWake>,
    ) {
        let mut queue = Drain::new(channel);
        let mut tags = self.egress_read().tags.snapshot();
        let mut stream: Option<(Generation, SendStream)> = None;
        let mut buf = BytesMut::new();
        // A batch's chunks: what it encoded, and runs its senders encoded.
        let mut parts = BatchParts::default();
        let mut routes = super::ingress::RoutesView::new();
        loop {
            if queue.is_empty() {
                self.drive(|driver, now| driver.handle_writer_idle(now, peer));
                let sleep = wake.sleep(|| !queue.is_empty() || wake.retire.load(Ordering::Acquire));
                // While idle, a peer that stops the stream is reported now, not at the next
                // frame (a closed connection is the reader's to report); the machine judges it.
                let stopped = async {
                    match &stream {
                        Some((generation, send)) => match send.stopped().await {
                            Ok(Some(_)) => *generation,
                            _ => std::future::pending().await,
                        },
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = sleep => {}
                    generation = stopped => {
                        stream = None;
                        self.drive(|driver, now| {
                            driver.handle_stream_stopped(now, peer, generation)
                        });
                        continue;
                    }
                }
            }
            if wake.retire.swap(false, Ordering::AcqRel) && self.retire_queue(&peer, &wake, &queue)
            {
                return;
            }
            // The latency bound: wait this long for more frames to share the write (zero:
            // one scheduler turn, so frames enqueued in the same burst go together).
            if self.batch_delay.is_zero() {
                tokio::task::yield_now().await;
            } else {
                tokio::time::sleep(self.batch_delay).await;
            }
            loop {
                let (mut frames, mut swim, mut unencodable) = (0u64, false, 0u64);
                buf.clear();
                parts.clear();
                // The tag of a boxed frame, for the table (one per batch: a new tag is rare,
                // and once it has a number its frames come numbered).
                let mut new_tag: Option<Cow<'static, str>> = None;
                {
                    let routes = routes.now(&self).0;
                    let routes = &*routes;
                    // A batch is usually one tag over and over: look the set up once per run.
                    let mut last_tag: Option<u32> = None;
                    while parts.len(&buf) < NODE_WRITE_BATCH_BYTES {
                        let Some(mut frame) = queue.pop() else { break };
                        let (dest, tag, payload, number) = match &mut frame {
                            Popped::Numbered(frame) => {
                                if tags.get(frame.tag as usize).is_none() {
                                    // Numbered by another writer after this one looked.
                                    tags = self.egress_read().tags.snapshot();
                                }
                                let tag = &tags[frame.tag as usize];
                                (&frame.dest, &**tag, &frame.payload, Some(frame.tag))
                            }
                            Popped::Loose(frame) => {
                                if new_tag.is_none() {
                                    new_tag = Some(frame.type_tag.clone());
                                }
                                (&frame.dest, &*frame.type_tag, &frame.payload, None)
                            }
                            Popped::Encoded(run) => {
                                // Encoded by its sender: handed to the stream as it is, after
                                // what the batch encoded before it.
                                frames += run.frames;
                                swim |= run.swim;
                                parts.run(&mut buf, std::mem::take(&mut run.records));
                                continue;
                            }
                        };
                        let encoded = encode_record(
                            dest.as_bytes(),
                            tag,
                            payload,
                            self.payload_bytes_max,
                            &mut buf,
                        );
                        if encoded.is_err() {
                            // Not met: every frame was judged by the same rule when it was
                            // handed over (`Inner::sendable`). Were one to fail, it is
                            // counted, never written.
                            debug_assert!(false, "a queued frame the wire cannot carry");
                            unencodable += 1;
                            continue;
                        }
                        frames += 1;
                        if !swim && (number.is_none() || number != last_tag) {
                            swim = routes.is_swim(tag);
                            last_tag = number;
                        }
                    }
                }
                if let Some(tag) = new_tag {
                    let mut egress = self.egress_write();
                    egress.tags.add(tag);
                    tags = egress.tags.snapshot();
                }
                if unencodable > 0 {
                    self.drive(|driver, now| driver.handle_unencodable(now, unencodable));
                }
                if frames == 0 {
                    break;
                }
                let on = stream.as_ref().map(|(generation, _)| *generation);
                let batch = self.ask(
                    |driver, now| driver.handle_batch(now, peer, frames, swim, on),
                    Answer::batch,
                );
                let Some(batch) = batch else {
                    continue;
                };
                let generation = batch.generation;
                if batch.open_stream {
                    stream = batch.conn.open_uni().await.ok().map(|s| (generation, s));
                }
                // The batch is handed to the stream as it is (no copy into the stream's
                // buffer); `buf` keeps the rest of its allocation for the next batch.
                let written = match (&mut stream, parts.finish(&mut buf)) {
                    (Some((_, send)), [one]) => send.write_chunk(std::mem::take(one)).await.is_ok(),
                    (Some((_, send)), many) => send.write_all_chunks(many).await.is_ok(),
                    (None, _) => false,
                };
                if written {
                    self.counters.written.fetch_add(frames, Ordering::Relaxed);
                } else {
                    stream = None;
                    self.drive(|driver, now| {
                        driver.handle_write_failed(now, peer, generation, frames, swim)
                    });
                }
            }
        }
    }
}

/// The frames of one run, all for one peer, looked at where they are held: a run is encoded
/// from each frame in place, which is then dropped there. Each layer a frame passed through
/// whole (an iterator adapter, a peek, an `Option` taken) moved all 120 bytes of it once
/// more, which 64 B frames felt as a third of the sending thread's time.
pub(super) trait Run {
    /// The run's next frame, left where it is (`None`: the run ended).
    fn peek_frame(&mut self) -> Option<&OutFrame>;
    /// Takes the run's next frame.
    fn take_frame(&mut self) -> Option<OutFrame>;
    /// Drops the run's next frame (one [`Run::peek_frame`] found, and its record was written).
    fn drop_frame(&mut self);
}

impl<I: Iterator<Item = OutFrame>> Run for std::iter::Peekable<I> {
    #[inline]
    fn peek_frame(&mut self) -> Option<&OutFrame> {
        std::iter::Peekable::peek(self)
    }

    #[inline]
    fn take_frame(&mut self) -> Option<OutFrame> {
        Iterator::next(self)
    }

    #[inline]
    fn drop_frame(&mut self) {
        Iterator::next(self);
    }
}

/// One run of [`Node::send_batch`]: each sendable frame of the caller's iterator (the others
/// counted) while they go to `peer`. A frame is held in `held` from the moment the iterator
/// hands it over until it is encoded or queued; the first frame for another peer stays
/// there, and ends the run, to start the next.
pub(super) struct BatchRun<'a, I> {
    pub(super) peer: NodeId,
    pub(super) inner: &'a Arc<Inner>,
    pub(super) frames: &'a mut I,
    pub(super) held: &'a mut Option<OutFrame>,
}

impl<I: Iterator<Item = OutFrame>> Run for BatchRun<'_, I> {
    #[inline]
    fn peek_frame(&mut self) -> Option<&OutFrame> {
        if self.held.is_none() {
            *self.held = self.inner.next_sendable(self.frames);
        }
        self.held.as_ref().filter(|frame| frame.to == self.peer)
    }

    #[inline]
    fn take_frame(&mut self) -> Option<OutFrame> {
        self.peek_frame()?;
        self.held.take()
    }

    #[inline]
    fn drop_frame(&mut self) {
        *self.held = None;
    }
}

/// `first` and up to [`EGRESS_RUN_FRAMES_MAX`] − 1 frames of `rest` after it (each judged
/// sendable when handed over) encoded as the writer would encode them, split off `records`;
/// with how many the wire could not carry after all (none; were one to fail, it is counted,
/// never written). The frames after `first` are read where `rest` holds them.
fn encode_run(
    first: OutFrame,
    rest: &mut impl Run,
    routes: &Routes<ActorAddr>,
    records: &mut RunBuffer,
    payload_bytes_max: usize,
) -> (Encoded, u64) {
    let (mut count, mut unencodable, mut swim) = (0u64, 0u64, false);
    let mut last_tag: Option<Cow<'static, str>> = None;
    // Room for the run as its first frame suggests (a run of large frames grows as it goes).
    records.room_for_run(first.type_tag.len() + first.payload.len() + 48);
    let mut encode = |frame: &OutFrame| {
        records
            .records
            .reserve(frame.type_tag.len() + frame.payload.len() + 48);
        let encoded = encode_record(
            frame.dest.as_bytes(),
            &frame.type_tag,
            &frame.payload,
            payload_bytes_max,
            &mut records.records,
        );
        if encoded.is_err() {
            debug_assert!(false, "a frame judged sendable the wire cannot carry");
            unencodable += 1;
            return;
        }
        count += 1;
        if !swim
            && last_tag
                .as_deref()
                .is_none_or(|last| !same_tag(last, &frame.type_tag))
        {
            swim = routes.is_swim(&frame.type_tag);
            last_tag = Some(frame.type_tag.clone());
        }
    };
    encode(&first);
    for _ in 1..EGRESS_RUN_FRAMES_MAX {
        let Some(frame) = rest.peek_frame() else {
            break;
        };
        encode(frame);
        rest.drop_frame();
    }
    let run = Encoded {
        records: records.records.split(),
        frames: count,
        swim,
    };
    (run, unencodable)
}

/// The buffer the runs of one `send_batch` call are encoded into, one after another. Each run
/// is split off the block it was encoded in, so the runs of one block lie end to end and the
/// writer joins them into one chunk without a copy ([`BytesMut::try_unsplit`]). A new block is
/// twice the last, from one run up to [`EGRESS_RUN_BLOCK_BYTES`] (a run of large frames may be
/// larger: it gets a block of its own). A block is held until the last run split off it is
/// sent and acknowledged, so a call pins at most one block, partly filled, beyond the runs it
/// encoded.
#[derive(Default)]
pub(super) struct RunBuffer {
    records: BytesMut,
    block: usize,
}

impl RunBuffer {
    /// Room for a run of frames of about `record` bytes each.
    fn room_for_run(&mut self, record: usize) {
        // Room for the run as its first frame suggests, within one write batch.
        let run = (record * EGRESS_RUN_FRAMES_MAX).min(NODE_WRITE_BATCH_BYTES);
        if self.records.capacity() < run {
            self.block = (self.block * 2).clamp(run, EGRESS_RUN_BLOCK_BYTES.max(run));
            // The block again when every run split off it is gone (its memory is warm), else
            // a new one: growing a block in place would copy the runs it held.
            if !self.records.try_reclaim(self.block) {
                self.records = BytesMut::with_capacity(self.block);
            }
        }
    }
}

/// Puts a popped run's `records` after the runs before it (`runs`, joined): joined to them
/// when it starts where they end in the same block (no copy); else they are closed as a chunk
/// in `chunks` and the run starts the next. The stream finds a packet's bytes by walking its
/// unacknowledged chunks from the oldest, so runs of small frames handed over one by one made
/// that walk long (3% of a 64 B `send_batch`'s CPU); joined, they walk as the raw stream's
/// large writes do.
fn join_run(runs: &mut Option<BytesMut>, records: BytesMut, chunks: &mut Vec<Bytes>) {
    match runs {
        Some(joined) => {
            if let Err(apart) = joined.try_unsplit(records) {
                chunks.push(std::mem::replace(joined, apart).freeze());
            }
        }
        None => *runs = Some(records),
    }
}

/// A write batch's chunks as the writer assembles them, in the order their frames were
/// popped: runs their senders encoded (joined while they lie end to end) and, between them,
/// the frames the writer encodes itself into its `buf`.
#[derive(Default)]
struct BatchParts {
    chunks: Vec<Bytes>,
    /// The runs popped since the last chunk closed, joined.
    runs: Option<BytesMut>,
    /// Bytes in `chunks` and `runs`.
    bytes: usize,
}

impl BatchParts {
    fn clear(&mut self) {
        self.chunks.clear();
        self.runs = None;
        self.bytes = 0;
    }

    /// Bytes in the batch, with what `buf` holds.
    fn len(&self, buf: &BytesMut) -> usize {
        self.bytes + buf.len()
    }

    /// A run popped after the frames `buf` holds.
    fn run(&mut self, buf: &mut BytesMut, records: BytesMut) {
        self.close(buf);
        self.bytes += records.len();
        join_run(&mut self.runs, records, &mut self.chunks);
    }

    /// What `buf` holds, as a chunk after the runs before it.
    fn close(&mut self, buf: &mut BytesMut) {
        if !buf.is_empty() {
            self.chunks.extend(self.runs.take().map(BytesMut::freeze));
            self.bytes += buf.len();
            self.chunks.push(buf.split().freeze());
        }
    }

    /// The batch's chunks in order; `buf` keeps the rest of its allocation.
    fn finish(&mut self, buf: &mut BytesMut) -> &mut [Bytes] {
        self.chunks.extend(self.runs.take().map(BytesMut::freeze));
        self.close(buf);
        &mut self.chunks
    }
}

/// Whether two tags are the same text: the same static string (the usual case, one pointer
/// compare) or equal bytes.
#[inline]
fn same_tag(a: &str, b: &str) -> bool {
    (a.as_ptr() == b.as_ptr() && a.len() == b.len()) || a == b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::{ActorBridge, DeliveryError};
    use tether_core::driver::DropReason;
    use tokio::sync::mpsc;

    const APP: ActorAddr = ActorAddr::new([0xA7; 32]);

    struct Collect(mpsc::UnboundedSender<Bytes>);

    impl ActorBridge for Collect {
        fn deliver_raw(&self, _: ActorAddr, _: &str, payload: Bytes) -> Result<(), DeliveryError> {
            self.0
                .send(payload)
                .map_err(|_| DeliveryError("test ended".into()))
        }
    }

    /// A sender built from `sender`, connected to a receiver hosting `APP`, and what is
    /// delivered there.
    async fn connected(
        sender: crate::node::NodeBuilder,
    ) -> (Node, Node, mpsc::UnboundedReceiver<Bytes>) {
        let (tx, delivered) = mpsc::unbounded_channel();
        let receiver = Node::builder()
            .bridge(Arc::new(Collect(tx)))
            .know_tag("Chat")
            .host(APP)
            .bind()
            .await
            .expect("bind");
        let sender = sender.bind().await.expect("bind");
        sender
            .connect(receiver.endpoint_addr())
            .await
            .expect("connect");
        (sender, receiver, delivered)
    }

    fn numbered(to: NodeId, n: u8) -> OutFrame {
        OutFrame {
            to,
            dest: APP,
            type_tag: "Chat".into(),
            payload: Bytes::copy_from_slice(&[n]),
        }
    }

    /// The race a lone send through the thread's cache can lose: its push lands in a queue
    /// whose writer has just retired (closed and out of the table). What is stranded there is
    /// taken back and sent again through a new queue, in order, counted once. (One thread:
    /// the cache is the thread's.)
    #[tokio::test(flavor = "current_thread")]
    async fn frames_stranded_in_a_retired_queue_are_taken_back_and_sent_again_in_order() {
        let (sender, receiver, mut delivered) =
            connected(Node::builder().idle_peer_timeout(Duration::from_millis(20))).await;
        let to = receiver.node_id();
        // The first frame makes the queue (this thread's cache remembers it) and arrives.
        sender.send(numbered(to, 0));
        assert_eq!(&delivered.recv().await.expect("delivered")[..], [0]);
        // Its writer goes idle and retires: the queue is closed and leaves the table.
        sender
            .egress_peers()
            .wait_for(|live| *live == 0)
            .await
            .expect("alive");
        let retired = SEND_CACHE.with_borrow(|cache| {
            cache
                .entries
                .iter()
                .flatten()
                .find(|entry| entry.node == sender.inner.id && entry.peer == to)
                .map(|entry| entry.queue.clone())
                .expect("this thread sent to the peer")
        });
        assert!(retired.sender.is_closed());
        // Two pushes land after the close, as a cached send racing the retirement would
        // (counted as queued, as the cache's path counts them).
        let tags = sender.inner.egress_read().tags.snapshot();
        for n in [1, 2] {
            let frame = Popped::of(
                numbered(to, n),
                &TagTable {
                    list: tags.clone(),
                    index: HashMap::default(),
                },
            );
            let bytes = frame.bytes();
            assert_eq!(
                retired.sender.push_checked(frame.into_slot(), bytes).ok(),
                Some(true)
            );
            sender
                .inner
                .counters
                .enqueued
                .fetch_add(1, Ordering::Relaxed);
        }
        sender.inner.settle_stranded(retired.clone());
        assert_eq!(
            retired.sender.take_stranded().map(|_| ()),
            None,
            "nothing left behind"
        );
        for n in [1, 2] {
            assert_eq!(&delivered.recv().await.expect("delivered")[..], [n]);
        }
        // A later lone send finds the new queue.
        sender.send(numbered(to, 3));
        assert_eq!(&delivered.recv().await.expect("delivered")[..], [3]);
        let snapshot = sender.snapshot();
        assert_eq!(snapshot.frames_enqueued, 4, "each frame counted once");
        assert_eq!(snapshot.frames_written, 4);
        assert_eq!(snapshot.egress_queues_started, 2);
        assert!(snapshot.drops.0.is_empty(), "{:?}", snapshot.drops);
        sender.close().await;
        receiver.close().await;
    }

    fn owned(tag: &str) -> Cow<'static, str> {
        Cow::Owned(tag.to_owned())
    }

    /// After `Node::close` a send makes no queue again, through the thread's cache or the
    /// table: the machine refuses it and counts it, and nothing waits in a queue no writer
    /// drains.
    #[tokio::test(flavor = "current_thread")]
    async fn after_close_a_send_is_refused_and_counted_and_makes_no_queue() {
        let (sender, receiver, mut delivered) = connected(Node::builder()).await;
        let to = receiver.node_id();
        sender.send(numbered(to, 0));
        assert_eq!(&delivered.recv().await.expect("delivered")[..], [0]);
        sender.close().await;
        let before = sender.snapshot().drops.get(DropReason::CacheMiss);
        // Through the cache (this thread sent to the peer), then as a batch by the table.
        sender.send(numbered(to, 1));
        sender.send_batch([numbered(to, 2), numbered(to, 3)]);
        let snapshot = sender.snapshot();
        assert_eq!(snapshot.drops.get(DropReason::CacheMiss), before + 3);
        assert_eq!(snapshot.frames_enqueued, 1);
        assert!(sender.inner.egress_read().queues.is_empty());
        assert_eq!(*sender.egress_peers().borrow(), 0);
        receiver.close().await;
    }

    /// A run `send_batch` encodes on the sending thread is what the writer would have
    /// encoded frame by frame; it decodes back to the same frames (how a run that lost its
    /// ring room spills), and it is judged SWIM when one of its frames is.
    #[test]
    fn an_encoded_run_decodes_back_to_its_frames_and_carries_their_swim_judgment() {
        let to = NodeId::new([9; 32]);
        let routes = Routes::<ActorAddr>::new(to);
        let frame = |tag: &'static str, n: u8| OutFrame {
            to,
            dest: ActorAddr::new([n; 32]),
            type_tag: tag.into(),
            payload: Bytes::from(vec![n; usize::from(n)]),
        };
        let frames: Vec<OutFrame> = (1..=5).map(|n| frame("Chat", n)).collect();
        let mut records = RunBuffer::default();
        let mut rest = frames.iter().cloned().peekable();
        let first = rest.next().expect("frames");
        let (run, skipped) = encode_run(first, &mut rest, &routes, &mut records, 1 << 20);
        assert_eq!((run.frames, skipped, run.swim), (5, 0, false));
        let mut one_by_one = BytesMut::new();
        for frame in &frames {
            encode_record(
                frame.dest.as_bytes(),
                &frame.type_tag,
                &frame.payload,
                1 << 20,
                &mut one_by_one,
            )
            .expect("encodable");
        }
        assert_eq!(run.records, one_by_one, "the writer's encoding");
        let back = Popped::Encoded(run).into_frames(to, &[], 1 << 20);
        let key = |f: &OutFrame| (f.to, f.dest, f.type_tag.to_string(), f.payload.clone());
        assert_eq!(
            back.iter().map(key).collect::<Vec<_>>(),
            frames.iter().map(key).collect::<Vec<_>>()
        );
        // One SWIM frame in the run makes the run's batch a SWIM batch.
        let swim = tether_core::driver::SWIM_TAGS[0];
        let mut mixed = [frame(swim, 2), frame("Chat", 3)].into_iter().peekable();
        let (run, _) = encode_run(frame("Chat", 1), &mut mixed, &routes, &mut records, 1 << 20);
        assert!(run.swim);
        assert_eq!(run.frames, 3);
        // A run takes at most EGRESS_RUN_FRAMES_MAX frames and leaves the rest where they
        // were, in order.
        let many = EGRESS_RUN_FRAMES_MAX + 3;
        let mut rest = (0..many)
            .map(|n| frame("Chat", (n % 200) as u8 + 1))
            .peekable();
        let first = rest.next().expect("frames");
        let (run, _) = encode_run(first, &mut rest, &routes, &mut records, 1 << 20);
        assert_eq!(run.frames, EGRESS_RUN_FRAMES_MAX as u64);
        let left: Vec<u8> = rest.map(|f| f.dest.as_bytes()[0]).collect();
        let next = |n: usize| (n % 200) as u8 + 1;
        assert_eq!(
            left,
            (EGRESS_RUN_FRAMES_MAX..many).map(next).collect::<Vec<_>>()
        );
    }

    /// Routes for one peer, and frames to it whose records are 84 bytes (`n` in the
    /// destination and the payload).
    fn chat_frames() -> (Routes<ActorAddr>, impl Fn(u8) -> OutFrame) {
        let to = NodeId::new([9; 32]);
        let frame = move |n: u8| OutFrame {
            to,
            dest: ActorAddr::new([n; 32]),
            type_tag: "Chat".into(),
            payload: Bytes::from(vec![n; 40]),
        };
        (Routes::new(to), frame)
    }

    #[test]
    fn runs_encoded_in_turn_are_joined_without_a_copy_and_in_order() {
        let (routes, frame) = chat_frames();
        // Whole runs: a block holds one run, the next two, the next four, ...
        let run_of = |records: &mut RunBuffer, n: u8| {
            let mut rest = (1..EGRESS_RUN_FRAMES_MAX).map(|_| frame(n)).peekable();
            encode_run(frame(n), &mut rest, &routes, records, 1 << 20).0
        };
        let (mut one, mut other) = (RunBuffer::default(), RunBuffer::default());
        let runs = [
            run_of(&mut one, 1),
            run_of(&mut one, 2),
            run_of(&mut one, 3),
            run_of(&mut other, 4),
            run_of(&mut one, 5),
            run_of(&mut one, 6),
            run_of(&mut one, 7),
        ];
        let whole: Vec<u8> = runs.iter().flat_map(|run| run.records.to_vec()).collect();
        // Where each run lies: the runs that follow one another in memory are one chunk.
        let spans: Vec<(usize, usize)> = runs
            .iter()
            .map(|run| (run.records.as_ptr() as usize, run.records.len()))
            .collect();
        let mut expected: Vec<(usize, usize)> = Vec::new();
        for &(at, len) in &spans {
            match expected.last_mut() {
                Some((start, joined)) if *start + *joined == at => *joined += len,
                _ => expected.push((at, len)),
            }
        }
        assert!(
            expected.len() < runs.len(),
            "some runs share a block: {spans:?}"
        );
        assert!(
            expected.len() > 2,
            "another buffer's run stands apart: {spans:?}"
        );
        let (mut joined, mut chunks) = (None, Vec::new());
        for run in runs {
            join_run(&mut joined, run.records, &mut chunks);
        }
        chunks.extend(joined.take().map(BytesMut::freeze));
        let got: Vec<(usize, usize)> = chunks
            .iter()
            .map(|chunk| (chunk.as_ptr() as usize, chunk.len()))
            .collect();
        assert_eq!(got, expected, "joined where they lie, not copied");
        assert!(chunks.concat() == whole, "every record once, in order");
        // Blocks double up to their bound: 64 whole runs of 84-byte records (336 KiB) take
        // a handful of chunks, not 64.
        let mut records = RunBuffer::default();
        let (mut joined, mut chunks) = (None, Vec::new());
        for n in 0..64 {
            join_run(&mut joined, run_of(&mut records, n).records, &mut chunks);
        }
        chunks.extend(joined.take().map(BytesMut::freeze));
        let bytes: usize = chunks.iter().map(Bytes::len).sum();
        assert_eq!(bytes, 64 * EGRESS_RUN_FRAMES_MAX * 84);
        assert!(
            chunks.len() <= 12,
            "{} chunks for {bytes} bytes",
            chunks.len()
        );
    }

    #[test]
    fn a_batch_keeps_the_order_runs_and_the_writers_own_frames_were_popped_in() {
        let (routes, frame) = chat_frames();
        let encode = |frame: &OutFrame, out: &mut BytesMut| {
            encode_record(
                frame.dest.as_bytes(),
                &frame.type_tag,
                &frame.payload,
                1 << 20,
                out,
            )
            .expect("encodable");
        };
        // Popped in this order: run 1 (its block alone), run 2, a frame the writer encodes
        // itself, run 3 (end to end with run 2 in the second block), runs 4 to 7 (the third).
        let mut records = RunBuffer::default();
        let (mut popped, mut expected) = (Vec::new(), BytesMut::new());
        for n in 1..=7u8 {
            if n == 3 {
                popped.push(Err(frame(99)));
                encode(&frame(99), &mut expected);
            }
            let frames: Vec<OutFrame> = (0..EGRESS_RUN_FRAMES_MAX).map(|_| frame(n)).collect();
            for each in &frames {
                encode(each, &mut expected);
            }
            let mut rest = frames.into_iter().peekable();
            let first = rest.next().expect("a frame");
            popped.push(Ok(encode_run(
                first,
                &mut rest,
                &routes,
                &mut records,
                1 << 20,
            )
            .0));
        }
        let spans: Vec<(usize, usize)> = popped
            .iter()
            .filter_map(|run| run.as_ref().ok())
            .map(|run| (run.records.as_ptr() as usize, run.records.len()))
            .collect();
        let starts: Vec<usize> = spans.iter().map(|&(at, _)| at).collect();
        assert_eq!(
            spans[1].0 + spans[1].1,
            spans[2].0,
            "runs 2 and 3 lie end to end"
        );
        assert_ne!(spans[2].0 + spans[2].1, spans[3].0, "run 4 starts a block");
        let (mut parts, mut buf) = (BatchParts::default(), BytesMut::new());
        for item in popped {
            match item {
                Ok(mut run) => parts.run(&mut buf, std::mem::take(&mut run.records)),
                Err(frame) => encode(&frame, &mut buf),
            }
        }
        let batch = parts.len(&buf);
        let chunks = parts.finish(&mut buf).to_vec();
        assert_eq!(
            batch,
            expected.len(),
            "every byte counted toward the batch's bound"
        );
        assert!(
            chunks.concat() == expected,
            "every record once, in the order popped"
        );
        let at: Vec<usize> = chunks.iter().map(|chunk| chunk.as_ptr() as usize).collect();
        assert_eq!(
            chunks.len(),
            5,
            "runs 1, 2, the writer's frame, 3, and 4 to 7 joined"
        );
        assert_eq!(
            [at[0], at[1], at[3], at[4]],
            [starts[0], starts[1], starts[2], starts[3]],
            "no copy"
        );
        assert!(buf.is_empty());
    }

    #[test]
    fn a_tag_is_numbered_once_in_order_of_adding_by_pointer_or_by_text() {
        let mut tags = TagTable::default();
        assert_eq!(tags.find("Chat"), None);
        tags.add(Cow::Borrowed("Chat"));
        tags.add(owned("Chat"));
        assert_eq!(tags.len(), 1, "the same text twice is one tag");
        assert_eq!(tags.find("Chat"), Some(0));
        assert_eq!(tags.find(&owned("Chat")), Some(0), "found by text too");
        for n in 0..3 * TAG_SCAN {
            tags.add(owned(&format!("t{n}")));
        }
        // Past the scanned few, the index finds them.
        for n in 0..3 * TAG_SCAN {
            assert_eq!(tags.find(&format!("t{n}")), Some(n as u32 + 1));
        }
        let snapshot = tags.snapshot();
        assert_eq!(snapshot.len(), 3 * TAG_SCAN + 1);
        assert_eq!(&*snapshot[5], "t4");
    }

    #[test]
    fn the_table_holds_at_most_its_bound_and_never_an_unsendable_tag() {
        let mut tags = TagTable::default();
        tags.add(owned(
            &"x".repeat(tether_core::limits::ACTOR_TAG_BYTES_MAX + 1),
        ));
        assert_eq!(tags.len(), 0);
        for n in 0..EGRESS_TAGS_MAX + 10 {
            tags.add(owned(&format!("t{n}")));
        }
        assert_eq!(tags.len(), EGRESS_TAGS_MAX);
        assert_eq!(
            tags.find(&format!("t{}", EGRESS_TAGS_MAX - 1)),
            Some(EGRESS_TAGS_MAX as u32 - 1)
        );
        assert_eq!(tags.find(&format!("t{EGRESS_TAGS_MAX}")), None);
    }

    #[test]
    fn a_snapshot_a_writer_holds_keeps_its_numbers_while_the_table_grows() {
        let mut tags = TagTable::default();
        tags.add(owned("a"));
        let held = tags.snapshot();
        tags.add(owned("b"));
        assert_eq!(held.len(), 1, "the writer's copy is unchanged");
        assert_eq!(&*tags.snapshot()[0], "a");
        assert_eq!(&*tags.snapshot()[1], "b");
    }
}
