//! A deterministic in-memory world for two substrate machines: a store per node that commits
//! batches when told, a link that can drop, duplicate, reorder and disconnect, a crash switch
//! that throws away everything a node has not committed, and virtual time.
//!
//! Frames cross the link as bytes through the real envelope codec. The app of each node
//! accepts every open and consumes every delivery; a delivery counts as *consumed* only when
//! the batch recording its consumption is committed, which is what "exactly once" means for an
//! app whose own effects commit with it. Randomness comes from a seed, so every run repeats.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use super::{
    AllowAll, Authorizer, Config, DurableState, Event, Machine, Op, PeerId, PersistBatch, Record,
};
use crate::limits::SUBSTRATE_READ_CHUNK_BYTES;
use crate::time::Time;
use crate::wire::envelope::{Envelope, EnvelopeDecoder};
use crate::wire::{FormatError, StreamDecoder};

/// Which party of the two the harness runs (not a [`crate::driver::NodeId`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Party {
    /// The first node (usually the opener).
    A,
    /// The second node.
    B,
}

impl Party {
    fn other(self) -> Party {
        match self {
            Party::A => Party::B,
            Party::B => Party::A,
        }
    }
}

/// Link faults, each a probability in per-mille, drawn from the harness seed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// Frames dropped.
    pub drop_per_mille: u32,
    /// Frames delivered twice.
    pub duplicate_per_mille: u32,
    /// Frames swapped with the next one in flight.
    pub reorder_per_mille: u32,
}

/// One node: its machine, its committed store, the batches it emitted and has not committed,
/// and what its app saw.
#[derive(Clone)]
pub struct Node {
    /// The machine.
    pub machine: Machine,
    /// What is committed.
    pub store: DurableState,
    /// Emitted, not yet committed.
    pub uncommitted: VecDeque<PersistBatch>,
    /// Every event the app received (across crashes).
    pub events: Vec<Event>,
    /// Deliveries whose consumption committed, in order: the app's durable effects.
    pub consumed: Vec<Op>,
    /// Ops of this node whose enqueue committed, in order: what it promised to deliver.
    pub enqueued: Vec<Op>,
    /// Every op this node's machine made (its batch emitted, committed or not), in order:
    /// what the peer may have seen, since a send may travel before its commit.
    pub made: Vec<Op>,
    /// Times this node crashed.
    pub crashes: u64,
    config: Config,
    authorizer: Arc<Authorizer>,
    remote: PeerId,
    boot: u64,
    auto_accept: bool,
    auto_consume: bool,
    decoder: StreamDecoder<EnvelopeDecoder>,
}

impl Node {
    fn new(remote: PeerId, config: Config, authorizer: Arc<Authorizer>, boot: u64) -> Self {
        let machine = Machine::new(
            remote.clone(),
            config.clone(),
            Arc::clone(&authorizer),
            boot,
        );
        Self {
            machine,
            store: DurableState::default(),
            uncommitted: VecDeque::new(),
            events: Vec::new(),
            consumed: Vec::new(),
            enqueued: Vec::new(),
            made: Vec::new(),
            crashes: 0,
            config,
            authorizer,
            remote,
            boot,
            auto_accept: true,
            auto_consume: true,
            decoder: StreamDecoder::new(EnvelopeDecoder),
        }
    }

    /// Hands received bytes to the machine: frames, and frame-local decode errors.
    fn feed(&mut self, now: Time, bytes: &[u8]) {
        self.decoder.push(bytes);
        loop {
            // As a link hands them on: the whole frames read together are one step.
            match self.machine.handle_decoded(now, &mut self.decoder) {
                Some(error) if !error.error.is_fatal() => {
                    self.machine.handle_bad_frame(now, &error.error);
                }
                _ => return,
            }
        }
    }

    /// Commits the oldest emitted batch (the store's transaction).
    fn commit_one(&mut self) -> Option<PersistBatch> {
        let batch = self.uncommitted.pop_front()?;
        for record in &batch.records {
            match record {
                Record::InboxRemoved { obj, seq } => {
                    if let Some(op) = self.store.inbox.get(&(obj.clone(), *seq)) {
                        self.consumed.push(op.clone());
                    }
                }
                Record::Outbox(op) => self.enqueued.push(op.clone()),
                _ => {}
            }
        }
        self.store.apply(&batch);
        Some(batch)
    }
}

/// Two nodes, one link, virtual time.
#[derive(Clone)]
pub struct Harness {
    /// Node A.
    pub a: Node,
    /// Node B.
    pub b: Node,
    /// Virtual now.
    pub now: Time,
    /// Link faults in force.
    pub faults: Faults,
    link_up: bool,
    /// Frames in flight with the time they arrive.
    a_to_b: VecDeque<(Time, Bytes)>,
    b_to_a: VecDeque<(Time, Bytes)>,
    /// One-way link delay (zero by default).
    pub latency: Duration,
    rng: u64,
    /// Frames that crossed the link.
    pub frames_delivered: u64,
}

impl Harness {
    /// Two nodes with the same settings, authorizers of their own, link down.
    pub fn new(
        config: Config,
        authorize_a: Authorizer,
        authorize_b: Authorizer,
        seed: u64,
    ) -> Self {
        let config = config.checked();
        Self {
            a: Node::new(
                PeerId::new("b"),
                config.clone(),
                Arc::new(authorize_a),
                0xa000,
            ),
            b: Node::new(PeerId::new("a"), config, Arc::new(authorize_b), 0xb000),
            now: Time::from_millis(1_000),
            faults: Faults::default(),
            link_up: false,
            a_to_b: VecDeque::new(),
            b_to_a: VecDeque::new(),
            latency: Duration::ZERO,
            rng: seed | 1,
            frames_delivered: 0,
        }
    }

    /// Two nodes with `config` whose authorizers allow everything (the common test setup).
    pub fn allowing_all(config: Config, seed: u64) -> Self {
        Self::new(
            config,
            Authorizer::new(AllowAll),
            Authorizer::new(AllowAll),
            seed,
        )
    }

    /// The node `id`.
    pub fn node(&mut self, id: Party) -> &mut Node {
        match id {
            Party::A => &mut self.a,
            Party::B => &mut self.b,
        }
    }

    /// The node `id`, read-only.
    pub fn node_ref(&self, id: Party) -> &Node {
        match id {
            Party::A => &self.a,
            Party::B => &self.b,
        }
    }

    /// Whether node `id` answers opens by itself (default true).
    pub fn set_auto_accept(&mut self, id: Party, accept: bool) {
        self.node(id).auto_accept = accept;
    }

    /// Whether node `id`'s app consumes sends as they are delivered (default true).
    pub fn set_auto_consume(&mut self, id: Party, consume: bool) {
        self.node(id).auto_consume = consume;
    }

    /// Node `id`'s app consumes every pending send now.
    pub fn consume_all(&mut self, id: Party) {
        self.consume_some(id, usize::MAX);
    }

    /// Node `id`'s app consumes its `count` oldest pending sends (by object, then seq).
    pub fn consume_some(&mut self, id: Party, count: usize) {
        let now = self.now;
        let node = self.node(id);
        let pending: Vec<(crate::wire::envelope::Address, super::Seq)> = node
            .machine
            .pending_deliveries()
            .into_iter()
            .filter(|op| op.verb != crate::wire::envelope::Verb::Req)
            .take(count)
            .map(|op| (op.obj.clone(), op.seq))
            .collect();
        for (obj, seq) in pending {
            node.machine.consume(now, &obj, seq);
        }
        self.collect(id);
    }

    /// Brings the link up on both sides.
    pub fn connect(&mut self) {
        self.link_up = true;
        let now = self.now;
        self.a.machine.handle_link_up(now);
        self.b.machine.handle_link_up(now);
        self.a.decoder = StreamDecoder::new(EnvelopeDecoder);
        self.b.decoder = StreamDecoder::new(EnvelopeDecoder);
        self.collect_all();
    }

    /// Drops the link: frames in flight are lost.
    pub fn disconnect(&mut self) {
        self.link_up = false;
        self.a_to_b.clear();
        self.b_to_a.clear();
        let now = self.now;
        self.a.machine.handle_link_down(now);
        self.b.machine.handle_link_down(now);
        self.collect_all();
    }

    /// Crashes node `id`: its machine and every uncommitted batch are gone; it restarts from
    /// its store. The link drops (a crash ends connections).
    pub fn crash(&mut self, id: Party) {
        let was_up = self.link_up;
        self.disconnect();
        let node = self.node(id);
        node.uncommitted.clear();
        node.crashes += 1;
        node.boot += 1;
        node.machine = Machine::recover(
            node.remote.clone(),
            node.config.clone(),
            Arc::clone(&node.authorizer),
            node.boot,
            &node.store,
        );
        self.collect(id);
        if was_up {
            self.connect();
        }
    }

    /// Moves virtual time forward by `by` and fires due timers.
    pub fn advance(&mut self, by: Duration) {
        self.now = self.now.saturating_add(by);
        let now = self.now;
        for id in [Party::A, Party::B] {
            let node = self.node(id);
            if node.machine.poll_timeout().is_some_and(|at| at <= now) {
                node.machine.handle_timeout(now);
            }
            self.collect(id);
        }
    }

    /// Runs an app command on node `id` and collects its outputs.
    pub fn with<T>(&mut self, id: Party, command: impl FnOnce(&mut Machine, Time) -> T) -> T {
        let now = self.now;
        let result = command(&mut self.node(id).machine, now);
        self.collect(id);
        result
    }

    /// Commits every batch and delivers every frame until nothing moves. Returns the number of
    /// steps taken (bounded: a livelock is a bug, reported by panic).
    pub fn run(&mut self) -> u64 {
        self.run_with(|_| false)
    }

    /// Like [`Harness::run`], but before each commit asks `crash_before(id)` whether node `id`
    /// crashes instead of committing (the crash switch).
    pub fn run_with(&mut self, mut crash_before: impl FnMut(Party) -> bool) -> u64 {
        let mut steps = 0;
        loop {
            steps += 1;
            assert!(steps < 1_000_000, "the harness did not settle");
            let mut moved = false;
            for id in [Party::A, Party::B] {
                if !self.node(id).uncommitted.is_empty() {
                    if crash_before(id) {
                        self.crash(id);
                    } else {
                        self.commit(id);
                    }
                    moved = true;
                }
            }
            if self.deliver_read(Party::A) | self.deliver_read(Party::B) {
                moved = true;
            }
            if !moved {
                // Nothing to do now: wait for the next frame still on the wire, if any.
                let fronts = self.a_to_b.front().into_iter().chain(self.b_to_a.front());
                match fronts.map(|(at, _)| *at).min() {
                    Some(at) if self.link_up && at > self.now => self.now = at,
                    _ => return steps,
                }
            }
        }
    }

    /// The frames in flight towards `to`, oldest first.
    fn wire(&mut self, to: Party) -> &mut VecDeque<(Time, Bytes)> {
        match to {
            Party::A => &mut self.b_to_a,
            Party::B => &mut self.a_to_b,
        }
    }

    /// Node `to` reads `bytes` (whole frames) and its outputs are drained.
    fn read(&mut self, to: Party, bytes: &[u8]) {
        let now = self.now;
        self.node(to).feed(now, bytes);
        self.collect(to);
    }

    /// Node `to` reads `frames` as one read: copied together once, a lone frame not at all.
    fn read_frames(&mut self, to: Party, frames: &[Bytes]) {
        match frames {
            [] => {}
            [one] => self.read(to, one),
            many => self.read(to, &many.concat()),
        }
    }

    /// Delivers the frames travelling towards `to` that have arrived, as one read of at most
    /// [`SUBSTRATE_READ_CHUNK_BYTES`] (a link hands the machine every whole frame it read
    /// together), applying faults to each: a frame lost is left out, one duplicated is read
    /// twice, and one reordered goes back behind the next and ends the read.
    fn deliver_read(&mut self, to: Party) -> bool {
        // The frames read, handed on together at the end.
        let mut parts: Vec<Bytes> = Vec::new();
        let mut len = 0;
        let mut frames = 0;
        let now = self.now;
        loop {
            let queue = self.wire(to);
            // A read takes what arrived, up to a read block of the shell's (a frame longer
            // than that whole).
            let fits = |bytes: &Bytes| len == 0 || len + bytes.len() <= SUBSTRATE_READ_CHUNK_BYTES;
            if queue
                .front()
                .is_none_or(|(at, bytes)| *at > now || !fits(bytes))
            {
                break;
            }
            let (arrives, bytes) = queue.pop_front().expect("checked above");
            frames += 1;
            if !self.link_up {
                continue;
            }
            let faults = self.faults;
            if self.chance(faults.drop_per_mille) {
                continue;
            }
            if self.chance(faults.reorder_per_mille) {
                let queue = self.wire(to);
                if !queue.is_empty() {
                    queue.insert(1.min(queue.len()), (arrives, bytes));
                    break;
                }
            }
            let copies = if self.chance(faults.duplicate_per_mille) {
                2
            } else {
                1
            };
            for _ in 0..copies {
                self.frames_delivered += 1;
                len += bytes.len();
                parts.push(bytes.clone());
            }
        }
        self.read_frames(to, &parts);
        frames > 0
    }

    fn chance(&mut self, per_mille: u32) -> bool {
        if per_mille == 0 {
            return false;
        }
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % 1000) < u64::from(per_mille)
    }

    fn collect_all(&mut self) {
        self.collect(Party::A);
        self.collect(Party::B);
    }

    /// Drains node `id`'s outputs: batches to its store queue, frames onto the link, events to
    /// its app (which accepts opens and consumes deliveries).
    fn collect(&mut self, id: Party) {
        loop {
            let now = self.now;
            let link_up = self.link_up;
            let node = self.node(id);
            let mut progressed = false;
            while let Some(batch) = node.machine.poll_persist() {
                node.made
                    .extend(batch.records.iter().filter_map(|record| match record {
                        Record::Outbox(op) => Some(op.clone()),
                        _ => None,
                    }));
                node.uncommitted.push_back(batch);
                progressed = true;
            }
            let mut frames = Vec::new();
            // Encoded one after another into one buffer, each frame split off it (a fresh
            // buffer per frame grew, and copied, at every field).
            let mut encoded = BytesMut::new();
            while let Some(frame) = node.machine.poll_transmit() {
                // Room for the head and the body at once.
                encoded.reserve(256 + frame.body.as_ref().map_or(0, Bytes::len));
                frame
                    .encode_into(&mut encoded)
                    .expect("the machine only builds valid frames");
                frames.push(encoded.split().freeze());
                progressed = true;
            }
            let mut events = Vec::new();
            while let Some(event) = node.machine.poll_event() {
                events.push(event);
                progressed = true;
            }
            for event in &events {
                match event {
                    Event::OpenRequested { obj, .. } if node.auto_accept => {
                        let _ = node.machine.accept(now, obj);
                    }
                    // Reqs stay delivered until the app answers them (which consumes them).
                    Event::Delivered(op)
                        if node.auto_consume && op.verb != crate::wire::envelope::Verb::Req =>
                    {
                        node.machine.consume(now, &op.obj, op.seq);
                    }
                    _ => {}
                }
            }
            node.events.extend(events);
            if link_up {
                let queue = match id {
                    Party::A => &mut self.a_to_b,
                    Party::B => &mut self.b_to_a,
                };
                let arrives = now.saturating_add(self.latency);
                queue.extend(frames.into_iter().map(|bytes| (arrives, bytes)));
            }
            if !progressed {
                return;
            }
        }
    }

    /// Commits node `id`'s oldest uncommitted batch and reports it persisted. False when there
    /// is none.
    pub fn commit(&mut self, id: Party) -> bool {
        let Some(committed) = self.node(id).commit_one() else {
            return false;
        };
        let now = self.now;
        let machine = &mut self.node(id).machine;
        machine.handle_persisted(now, committed.id);
        // As a peer does: the store is done with the batch, its buffer serves later steps.
        machine.recycle(committed);
        self.collect(id);
        true
    }

    /// Batches node `id` emitted and has not committed.
    pub fn uncommitted(&self, id: Party) -> usize {
        match id {
            Party::A => self.a.uncommitted.len(),
            Party::B => self.b.uncommitted.len(),
        }
    }

    /// Frames on the wire towards `to`.
    pub fn in_flight(&self, to: Party) -> usize {
        match to {
            Party::A => self.b_to_a.len(),
            Party::B => self.a_to_b.len(),
        }
    }

    /// Delivers every frame travelling towards `to`, in order, as one read (the machine takes
    /// them as one step), ignoring latency and faults. False when none is in flight.
    pub fn deliver_all(&mut self, to: Party) -> bool {
        let queue = self.wire(to);
        if queue.is_empty() {
            return false;
        }
        let frames: Vec<Bytes> = queue.drain(..).map(|(_, bytes)| bytes).collect();
        self.frames_delivered += frames.len() as u64;
        self.read_frames(to, &frames);
        true
    }

    /// Delivers frame `index` of those travelling towards `to` (any index: the link
    /// reorders), ignoring latency and faults. False when there is no such frame.
    pub fn deliver_at(&mut self, to: Party, index: usize, keep_copy: bool) -> bool {
        let queue = self.wire(to);
        let Some((arrives, bytes)) = queue.remove(index) else {
            return false;
        };
        if keep_copy {
            queue.push_back((arrives, bytes.clone()));
        }
        self.frames_delivered += 1;
        self.read(to, &bytes);
        true
    }

    /// Loses frame `index` of those travelling towards `to`.
    pub fn drop_at(&mut self, to: Party, index: usize) -> bool {
        self.wire(to).remove(index).is_some()
    }

    /// Feeds the whole world to `state`, for model checkers that deduplicate worlds.
    pub fn fingerprint<H: std::hash::Hasher>(&self, state: &mut H) {
        use std::hash::Hash;
        for n in [&self.a, &self.b] {
            n.machine.fingerprint(state);
            (&n.store, &n.uncommitted, n.enqueued.len(), n.made.len()).hash(state);
            n.consumed.len().hash(state);
            for op in &n.consumed {
                (&op.obj, op.seq).hash(state);
            }
        }
        (self.link_up, self.now, &self.a_to_b, &self.b_to_a).hash(state);
    }

    /// Injects a frame as if node `from` had sent it.
    pub fn inject(&mut self, from: Party, frame: &Envelope) {
        let mut bytes = BytesMut::new();
        frame.encode(&mut bytes).expect("test frames are valid");
        self.inject_bytes(from, bytes.freeze());
    }

    /// Injects raw bytes as if node `from` had sent them (for frames no encoder would write).
    pub fn inject_bytes(&mut self, from: Party, bytes: Bytes) {
        let now = self.now;
        self.wire(from.other()).push_back((now, bytes));
    }
}
