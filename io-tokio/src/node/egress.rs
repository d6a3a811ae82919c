//! The actor plane's egress: each peer's queue (a ring and a bounded spillover) and the one writer
//! task that drains it in batches, asking the machine for the connection per batch.

use super::*;

/// A peer's egress queue: producers push, the writer task drains.
pub(super) struct PeerQueue {
    pub(super) sender: Sender<Slot>,
    pub(super) wake: Arc<WriterWake>,
}

/// A frame in a peer's egress queue (the peer is the queue's, so the slot does not carry it).
pub(super) struct Queued {
    pub(super) dest: ActorAddr,
    pub(super) type_tag: std::borrow::Cow<'static, str>,
    pub(super) payload: Bytes,
}

impl Queued {
    /// Bytes it holds while queued.
    pub(super) fn bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.type_tag.len() + self.payload.len()
    }
}

impl From<OutFrame> for Queued {
    fn from(frame: OutFrame) -> Self {
        Self {
            dest: frame.dest,
            type_tag: frame.type_tag,
            payload: frame.payload,
        }
    }
}

/// One slot of a peer's egress queue: a frame, or a run of at most [`EGRESS_RUN_FRAMES_MAX`]
/// frames handed over together (what [`Node::send_batch`] packs; only the ring takes runs).
pub(super) enum Slot {
    One(Queued),
    Run(Vec<Queued>),
}

impl Slot {
    pub(super) fn into_frames(self) -> Vec<Queued> {
        match self {
            Self::One(frame) => vec![frame],
            Self::Run(run) => run,
        }
    }
}

/// The writer's side of a peer's queue: the frames of a run it has popped but not yet
/// written come before the next slot.
pub(super) struct Drain {
    pub(super) channel: HybridChannel<Slot>,
    pub(super) run: std::vec::IntoIter<Queued>,
}

impl Drain {
    pub(super) fn new(channel: HybridChannel<Slot>) -> Self {
        Self {
            channel,
            run: Vec::new().into_iter(),
        }
    }

    pub(super) fn pop(&mut self) -> Option<Queued> {
        if let Some(frame) = self.run.next() {
            return Some(frame);
        }
        match self.channel.pop()? {
            Slot::One(frame) => Some(frame),
            Slot::Run(run) => {
                self.run = run.into_iter();
                self.run.next()
            }
        }
    }

    /// Whether nothing is queued (a snapshot; producers may be pushing).
    pub(super) fn is_empty(&self) -> bool {
        self.run.len() == 0 && self.channel.is_empty()
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
    /// One frame: as [`Inner::send_run`] with a run of one, without the run's iterator
    /// layers (each moves the frame once more, which a lone 64 B frame feels).
    pub(super) fn send(self: &Arc<Self>, frame: OutFrame) {
        {
            let queues = self.egress_read();
            if let Some(queue) = queues.get(&frame.to) {
                let frame = Queued::from(frame);
                let bytes = frame.bytes();
                let queued = queue.sender.push_sized(Slot::One(frame), bytes).is_ok();
                return self.enqueued(queue, u64::from(queued), u64::from(!queued));
            }
        }
        self.send_run(frame.to, std::iter::once(frame));
    }

    /// Queues frames all addressed to `peer`, in order.
    pub(super) fn send_run(self: &Arc<Self>, peer: NodeId, frames: impl Iterator<Item = OutFrame>) {
        let mut frames = frames.peekable();
        // The hot path: the peer has a queue (it was admitted when the queue started, and the
        // allow-list is fixed). Its writer asks the machine for the connection per batch.
        {
            let queues = self.egress_read();
            if let Some(queue) = queues.get(&peer) {
                return self.enqueue(queue, frames);
            }
        }
        if frames.peek().is_none() {
            return;
        }
        let verdict = self.ask(|driver, now| driver.handle_send(now, peer), Answer::send);
        if verdict != SendVerdict::Enqueue {
            // The slow path: each further frame is judged (and counted) as a lone send is.
            frames.next();
            for frame in frames {
                self.send(frame);
            }
            return;
        }
        let mut queues = self.egress_write();
        let fresh = !queues.contains_key(&peer);
        let queue = queues.entry(peer).or_insert_with(|| {
            let channel = HybridChannel::with_limits(
                self.egress_ring,
                self.egress_spill,
                EGRESS_SPILL_BYTES_MAX,
            );
            let queue = PeerQueue {
                sender: channel.sender(),
                wake: Arc::default(),
            };
            let (inner, wake) = (self.clone(), queue.wake.clone());
            self.spawn(
                async move { inner.write_peer(peer, channel, wake).await }
                    .instrument(tracing::debug_span!("writer", peer = %peer)),
            );
            queue
        });
        self.enqueue(queue, frames);
        if fresh {
            bump(&self.counters.queues_started);
            self.egress_count.send_replace(queues.len());
        }
    }

    /// Pushes `frames` into `queue`: counted and the writer woken once for all of them. Runs
    /// of up to [`EGRESS_RUN_FRAMES_MAX`] go into one ring slot each; a run the ring has no
    /// room for is pushed frame by frame, as lone frames are.
    pub(super) fn enqueue(
        self: &Arc<Self>,
        queue: &PeerQueue,
        frames: impl Iterator<Item = OutFrame>,
    ) {
        let (mut enqueued, mut full) = (0u64, 0u64);
        let mut count = |frames: u64, queued: bool| {
            if queued {
                enqueued += frames;
            } else {
                full += frames;
            }
        };
        let mut frames = frames.map(Queued::from).peekable();
        while let Some(first) = frames.next() {
            if frames.peek().is_none() {
                let bytes = first.bytes();
                count(1, queue.sender.push_sized(Slot::One(first), bytes).is_ok());
                break;
            }
            let mut run = Vec::with_capacity(EGRESS_RUN_FRAMES_MAX);
            run.push(first);
            run.extend(frames.by_ref().take(EGRESS_RUN_FRAMES_MAX - 1));
            let frames_in_run = run.len() as u64;
            match queue.sender.push_ring(Slot::Run(run)) {
                Ok(()) => count(frames_in_run, true),
                Err(refused) => {
                    for frame in refused.into_frames() {
                        let bytes = frame.bytes();
                        count(1, queue.sender.push_sized(Slot::One(frame), bytes).is_ok());
                    }
                }
            }
        }
        self.enqueued(queue, enqueued, full);
    }

    /// After pushing into `queue`: `enqueued` frames went in (counted, the writer woken once)
    /// and `full` found no room (the machine counts the drops).
    pub(super) fn enqueued(self: &Arc<Self>, queue: &PeerQueue, enqueued: u64, full: u64) {
        if enqueued > 0 {
            queue.wake.wake();
            self.counters
                .enqueued
                .fetch_add(enqueued, Ordering::Relaxed);
        }
        if full > 0 {
            self.drive(|driver, now| driver.handle_egress_full(now, full));
        }
    }

    /// The driver retired `peer`'s writer: its queue is torn down unless a frame arrived
    /// (then the writer goes on and reports again when it drains). Producers push only under
    /// the egress lock, so once the queue is out of the map nothing can be pushed into it.
    /// `true` when the writer should end.
    pub(super) fn retire_queue(
        &self,
        peer: &NodeId,
        wake: &Arc<WriterWake>,
        queue: &Drain,
    ) -> bool {
        let mut queues = self.egress_write();
        if !queue.is_empty() {
            return false;
        }
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

    pub(super) fn egress_read(
        &self,
    ) -> std::sync::RwLockReadGuard<'_, BTreeMap<NodeId, PeerQueue>> {
        self.egress.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn egress_write(
        &self,
    ) -> std::sync::RwLockWriteGuard<'_, BTreeMap<NodeId, PeerQueue>> {
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
        let mut stream: Option<(Generation, SendStream)> = None;
        let mut buf = BytesMut::new();
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
                {
                    let routes = self.routes_now();
                    // A batch is usually one tag over and over: look the set up once per run.
                    let mut last_tag: Option<std::borrow::Cow<'static, str>> = None;
                    while buf.len() < NODE_WRITE_BATCH_BYTES {
                        let Some(frame) = queue.pop() else { break };
                        let encoded = encode_record(
                            frame.dest.as_bytes(),
                            &frame.type_tag,
                            &frame.payload,
                            self.payload_bytes_max,
                            &mut buf,
                        );
                        if encoded.is_err() {
                            unencodable += 1;
                            continue;
                        }
                        frames += 1;
                        if !swim && last_tag.as_ref() != Some(&frame.type_tag) {
                            swim = routes.is_swim(&frame.type_tag);
                            last_tag = Some(frame.type_tag);
                        }
                    }
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
                let batch = buf.split().freeze();
                let written = match &mut stream {
                    Some((_, send)) => send.write_chunk(batch).await.is_ok(),
                    None => false,
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
