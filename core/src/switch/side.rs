//! One side's view of one request: what an engine, a host or a cartridge keeps to speak a
//! request's flows correctly (docs/spec/switch.md §6.3, §7).
//!
//! A [`RequestSide`] numbers the flow frames this side writes `0, 1, 2, …`, spends one credit
//! per CHUNK from the stream's gate (CREDIT frames from the other side refill it), puts the
//! other side's flow frames back in order (at most `max_reorder_buffer` early ones), checks
//! each arriving CHUNK against the stream's receive window, and turns chunks the application
//! consumed into batched CREDIT frames. It writes nothing after its own END/ERR and accepts
//! nothing after the other side's.

use std::collections::{BTreeMap, VecDeque};

use crate::limits::{
    STREAMS_PER_REQUEST_COUNT_MAX, SWITCH_HOST_LOG_UNREAD_BYTES_MAX,
    SWITCH_LOG_UNREAD_BYTES_PER_REQUEST_MAX, SWITCH_REORDER_HELD_BYTES_MAX,
};
use crate::request::{
    is_flow, is_terminal, Acquire, CreditGate, Credits, ReceiveWindow, RefusalKind, ReorderBuffer,
    Seq, SeqAssigner,
};
use crate::wire::bifaci::{Frame, FrameType, MessageId};

/// Why this side may not write a frame now (nothing changed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    /// The stream's credit is spent: wait for a CREDIT from the other side.
    #[error("no credit on stream {0:?}: wait for a grant")]
    NoCredit(Option<String>),
    /// This side already wrote its END or ERR.
    #[error("the request's flow has ended on this side")]
    Ended,
    /// Too many streams on one request.
    #[error("too many streams on one request")]
    TooManyStreams,
}

/// Why the other side's frame is refused: the other side broke the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// A CHUNK past the stream's window.
    #[error("CREDIT_VIOLATION on stream {0:?}")]
    CreditViolation(Option<String>),
    /// A flow frame outside the reorder window, or one seen already.
    #[error("flow frame refused by the reorder buffer: {0:?}")]
    Reorder(RefusalKind),
    /// Too many streams on one request.
    #[error("too many streams on one request")]
    TooManyStreams,
    /// A flow that started unnumbered (every frame at seq 0) carried a numbered frame.
    #[error("flow frame numbered {0} in an unnumbered flow")]
    MixedNumbering(u64),
}

/// Which side of a request this is: it names the direction of the CREDIT frames it writes
/// (`meta.credit_dir`, docs/spec/capdag-v6.md §7), which capdag's switch routes by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The side that made the request: it grants credit for the answer's streams (`response`).
    Requester,
    /// The side that serves it: it grants credit for the argument streams (`request`).
    Handler,
}

/// One side of one request.
#[derive(Debug, Clone)]
pub struct RequestSide {
    id: MessageId,
    xid: Option<MessageId>,
    window: Credits,
    seqs: SeqAssigner,
    wrote_end: bool,
    gates: BTreeMap<Option<String>, CreditGate>,
    reorder: ReorderBuffer<Frame>,
    windows: BTreeMap<Option<String>, ReceiveWindow>,
    read_end: bool,
    /// Bytes of LOG frames handed on and not reported read ([`RequestSide::log_read`]).
    log_unread: usize,
    role: Role,
    /// Whether the other side may send its flow unnumbered: every frame at seq 0, as capdag's
    /// switch forwards what its engine writes (docs/spec/capdag-v6.md §8). A flow is taken as
    /// unnumbered when its second frame is numbered 0 again; from then on every frame must be.
    allow_unnumbered: bool,
    unnumbered: bool,
    /// The next `chunk_index` of each stream this side writes.
    chunk_indices: BTreeMap<Option<String>, u64>,
}

impl RequestSide {
    /// A side of request `id` (with routing id `xid` when this side talks to the switch as a
    /// master) under the negotiated `window` and reorder bound.
    pub fn new(id: MessageId, xid: Option<MessageId>, window: Credits, reorder: u64) -> Self {
        Self {
            id,
            xid,
            window,
            seqs: SeqAssigner::new(),
            wrote_end: false,
            gates: BTreeMap::new(),
            reorder: ReorderBuffer::new(reorder).with_bytes_limit(SWITCH_REORDER_HELD_BYTES_MAX),
            windows: BTreeMap::new(),
            read_end: false,
            log_unread: 0,
            role: Role::Requester,
            allow_unnumbered: false,
            unnumbered: false,
            chunk_indices: BTreeMap::new(),
        }
    }

    /// The same side, as `role`.
    pub fn with_role(mut self, role: Role) -> Self {
        self.role = role;
        self
    }

    /// The same side, accepting an unnumbered flow from the other side (every frame at seq 0:
    /// a switch that does not number what it forwards, as capdag's does not).
    pub fn accepting_unnumbered(mut self) -> Self {
        self.allow_unnumbered = true;
        self
    }

    /// The request id.
    pub fn id(&self) -> MessageId {
        self.id
    }

    /// A frame of this request of type `frame_type` addressed as this side writes it.
    pub fn frame(&self, frame_type: FrameType) -> Frame {
        let mut frame = Frame::new(frame_type, self.id);
        frame.routing_id = self.xid;
        frame
    }

    /// Prepares `frame` for writing: a flow frame gets the next seq, a CHUNK spends one credit
    /// of its stream (and gets its stream's next `chunk_index` unless it has one). Refused
    /// (nothing changes) without credit or after this side's END/ERR.
    pub fn write(&mut self, frame: &mut Frame) -> Result<(), WriteError> {
        frame.id = self.id;
        frame.routing_id = self.xid;
        if !is_flow(frame.frame_type) {
            frame.seq = 0;
            return Ok(());
        }
        if self.wrote_end {
            return Err(WriteError::Ended);
        }
        if frame.frame_type == FrameType::Chunk {
            let stream = frame.stream_id.clone();
            if !self.gates.contains_key(&stream)
                && self.gates.len() >= STREAMS_PER_REQUEST_COUNT_MAX
            {
                return Err(WriteError::TooManyStreams);
            }
            let window = self.window;
            let gate = self
                .gates
                .entry(stream.clone())
                .or_insert_with(|| CreditGate::new(window));
            if gate.acquire(Credits::new(1)) != Acquire::Acquired {
                return Err(WriteError::NoCredit(stream));
            }
            let next = self.chunk_indices.entry(stream).or_insert(0);
            let index = *frame.chunk_index.get_or_insert(*next);
            *next = index.saturating_add(1);
        }
        frame.seq = self.seqs.assign(frame.frame_type).0;
        self.wrote_end |= is_terminal(frame.frame_type);
        Ok(())
    }

    /// Whether a CHUNK on `stream` could be written now.
    pub fn has_credit(&self, stream: Option<&str>) -> bool {
        let key = stream.map(str::to_owned);
        self.gates
            .get(&key)
            .is_none_or(|gate| gate.available().get() > 0 && gate.closed_reason().is_none())
    }

    /// A frame from the other side: CREDIT refills a gate (returned as nothing to deliver);
    /// flow frames come back in order through `deliver`, CHUNKs checked against their window.
    /// Frames after the other side's END/ERR are dropped (stragglers).
    pub fn read(&mut self, frame: Frame, mut deliver: impl FnMut(Frame)) -> Result<(), ReadError> {
        if frame.frame_type == FrameType::Credit {
            let stream = frame.stream_id.clone();
            let granted = Credits::new(frame.credit.unwrap_or(0));
            if let Some(gate) = self.gates.get_mut(&stream) {
                gate.grant(granted);
            } else if self.gates.len() < STREAMS_PER_REQUEST_COUNT_MAX {
                let mut gate = CreditGate::new(self.window);
                gate.grant(granted);
                self.gates.insert(stream, gate);
            }
            return Ok(());
        }
        if !is_flow(frame.frame_type) {
            deliver(frame);
            return Ok(());
        }
        if self.read_end {
            return Ok(());
        }
        let mut ready = delivered();
        let starts_unnumbered = self.allow_unnumbered
            && !self.unnumbered
            && frame.seq == 0
            && self.reorder.expected() == Seq(1)
            && self.reorder.held_len() == 0;
        self.unnumbered |= starts_unnumbered;
        if self.unnumbered {
            if frame.seq != 0 {
                return Err(ReadError::MixedNumbering(frame.seq));
            }
            ready.push(frame);
        } else {
            let bytes = frame.held_bytes();
            self.reorder
                .accept_sized(Seq(frame.seq), frame, bytes, |_, frame| ready.push(frame))
                .map_err(|refusal| ReadError::Reorder(refusal.kind))?;
        }
        for frame in ready {
            if self.read_end {
                break;
            }
            if frame.frame_type == FrameType::Chunk {
                let stream = frame.stream_id.clone();
                if !self.windows.contains_key(&stream)
                    && self.windows.len() >= STREAMS_PER_REQUEST_COUNT_MAX
                {
                    return Err(ReadError::TooManyStreams);
                }
                let window = self.window;
                let receive = self
                    .windows
                    .entry(stream.clone())
                    .or_insert_with(|| ReceiveWindow::new(window));
                if receive.arrive().violation {
                    return Err(ReadError::CreditViolation(stream));
                }
            }
            self.read_end |= is_terminal(frame.frame_type);
            deliver(frame);
        }
        Ok(())
    }

    /// The application consumed one CHUNK of `stream`: a CREDIT frame to write when a batch
    /// is due.
    pub fn consume(&mut self, stream: Option<&str>) -> Option<Frame> {
        let key = stream.map(str::to_owned);
        let step = self.windows.get_mut(&key)?.consume();
        self.credit_frame(key, step.grant)
    }

    /// Bytes of LOG frames handed on and not read yet.
    pub fn log_unread(&self) -> usize {
        self.log_unread
    }

    /// A LOG frame of `bytes` is handed on when this side's unread LOG bytes stay within
    /// `request_max` and `room` (what the caller's total allows): whether it is.
    pub fn pass_log(&mut self, bytes: usize, request_max: usize, room: usize) -> bool {
        let within = self
            .log_unread
            .checked_add(bytes)
            .is_some_and(|unread| unread <= request_max)
            && bytes <= room;
        if within {
            self.log_unread += bytes;
        }
        within
    }

    /// The reader read `bytes` of LOG frames: the bytes released (at most what was unread).
    pub fn log_read(&mut self, bytes: usize) -> usize {
        let released = bytes.min(self.log_unread);
        self.log_unread -= released;
        released
    }

    /// Bytes of the other side's early flow frames held for reordering.
    pub fn held_bytes(&self) -> usize {
        self.reorder.held_bytes()
    }

    /// Grants everything consumed but not granted yet on `stream` (call before waiting).
    pub fn flush(&mut self, stream: Option<&str>) -> Option<Frame> {
        let key = stream.map(str::to_owned);
        let step = self.windows.get_mut(&key)?.flush();
        self.credit_frame(key, step.grant)
    }

    fn credit_frame(&self, stream: Option<String>, grant: Credits) -> Option<Frame> {
        if grant.get() == 0 || self.read_end {
            return None;
        }
        let mut frame = self.frame(FrameType::Credit);
        frame.stream_id = stream;
        frame.credit = Some(grant.get());
        frame.meta = Some(credit_dir_meta(self.role));
        Some(frame)
    }

    /// Whether this side wrote its END/ERR.
    pub fn wrote_end(&self) -> bool {
        self.wrote_end
    }

    /// Whether the other side's END/ERR arrived.
    pub fn read_end(&self) -> bool {
        self.read_end
    }
}

/// A CREDIT's `meta`: `credit_dir`, `response` from a requester and `request` from a handler
/// (static CBOR: no allocation per grant).
fn credit_dir_meta(role: Role) -> crate::wire::bifaci::Meta {
    let cbor: &'static [u8] = match role {
        Role::Requester => b"\xa1\x6acredit_dir\x68response",
        Role::Handler => b"\xa1\x6acredit_dir\x67request",
    };
    crate::wire::bifaci::Meta::from_cbor(bytes::Bytes::from_static(cbor))
        .expect("a map with text keys is a valid meta")
}

/// A buffer for the frames one read delivers. Almost every read delivers exactly one frame in
/// order: room for one is a small allocation, where a vector's first growth would take room
/// for four frames (over a kilobyte, past the allocator's per-thread fast path).
pub(crate) fn delivered() -> Vec<Frame> {
    Vec::with_capacity(1)
}

/// The frames of one whole stream of request `id`: STREAM_START (with `media`), one CHUNK per
/// payload (indexed from 0), STREAM_END with the count. Lazy, so a long stream is never held.
pub fn stream_frames<I, B>(
    id: MessageId,
    stream: &str,
    media: &str,
    payloads: I,
) -> StreamFrames<I::IntoIter>
where
    I: IntoIterator<Item = B>,
    B: Into<bytes::Bytes>,
{
    let mut template = Frame::new(FrameType::StreamStart, id);
    template.stream_id = Some(stream.to_owned());
    StreamFrames {
        template,
        media: Some(media.to_owned()),
        payloads: Some(payloads.into_iter()),
        count: 0,
    }
}

/// See [`stream_frames`].
#[derive(Debug)]
pub struct StreamFrames<I> {
    template: Frame,
    /// Taken by the STREAM_START.
    media: Option<String>,
    /// `None` once STREAM_END was yielded.
    payloads: Option<I>,
    count: u64,
}

impl<I, B> Iterator for StreamFrames<I>
where
    I: Iterator<Item = B>,
    B: Into<bytes::Bytes>,
{
    type Item = Frame;

    fn next(&mut self) -> Option<Frame> {
        let mut frame = self.template.clone();
        if let Some(media) = self.media.take() {
            frame.media_urn = Some(media);
            return Some(frame);
        }
        let payloads = self.payloads.as_mut()?;
        match payloads.next() {
            Some(payload) => {
                frame.frame_type = FrameType::Chunk;
                frame.chunk_index = Some(self.count);
                frame.payload = Some(payload.into());
                self.count += 1;
            }
            None => {
                self.payloads = None;
                frame.frame_type = FrameType::StreamEnd;
                frame.chunk_count = Some(self.count);
            }
        }
        Some(frame)
    }
}

/// The frames a read of `side` delivered, but a LOG frame only while the side's unread LOG
/// bytes and `total` (over every request of a host, or every call of an engine) stay within
/// [`SWITCH_LOG_UNREAD_BYTES_PER_REQUEST_MAX`] and [`SWITCH_HOST_LOG_UNREAD_BYTES_MAX`]; the
/// others are dropped, counted in `dropped`.
pub fn pass_logs(
    side: &mut RequestSide,
    delivered: Vec<Frame>,
    total: &mut usize,
    dropped: &mut u64,
) -> Vec<Frame> {
    delivered
        .into_iter()
        .filter(|frame| {
            if frame.frame_type != FrameType::Log {
                return true;
            }
            let bytes = frame.held_bytes();
            let room = SWITCH_HOST_LOG_UNREAD_BYTES_MAX.saturating_sub(*total);
            if side.pass_log(bytes, SWITCH_LOG_UNREAD_BYTES_PER_REQUEST_MAX, room) {
                *total += bytes;
                true
            } else {
                *dropped += 1;
                false
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(stream: &str) -> Frame {
        let mut frame = Frame::new(FrameType::Chunk, MessageId::Uint(1));
        frame.stream_id = Some(stream.to_owned());
        frame
    }

    #[test]
    fn a_whole_stream_is_start_indexed_chunks_and_an_end_with_the_count() {
        let frames: Vec<Frame> = stream_frames(
            MessageId::Uint(3),
            "out",
            "media:text",
            [b"a".to_vec(), b"b".to_vec()],
        )
        .collect();
        let types: Vec<FrameType> = frames.iter().map(|f| f.frame_type).collect();
        assert_eq!(
            types,
            [
                FrameType::StreamStart,
                FrameType::Chunk,
                FrameType::Chunk,
                FrameType::StreamEnd
            ]
        );
        assert_eq!(frames[0].media_urn.as_deref(), Some("media:text"));
        assert_eq!(frames[2].chunk_index, Some(1));
        assert_eq!(frames[3].chunk_count, Some(2));
        assert!(frames.iter().all(|f| f.stream_id.as_deref() == Some("out")));
    }

    #[test]
    fn held_writes_wait_behind_a_chunk_without_credit_and_go_in_order_after_a_grant() {
        let mut side = RequestSide::new(MessageId::Uint(1), None, Credits::new(1), 4);
        let mut held: HeldWrites<u32> = HeldWrites::new();
        held.push(chunk("a"), 1);
        held.push(chunk("a"), 2);
        // Another stream has credit, but a flow is written in order: it waits behind.
        held.push(chunk("b"), 3);
        let waits = |error: &WriteError| matches!(error, WriteError::NoCredit(_));
        let ready = |held: &mut HeldWrites<u32>, side: &mut RequestSide| {
            std::iter::from_fn(|| held.pop_ready(|frame| side.write(frame), waits))
                .map(|(written, token)| (written.map(|frame| frame.seq), token))
                .collect::<Vec<_>>()
        };
        assert_eq!(ready(&mut held, &mut side), [(Ok(0), 1)]);
        assert_eq!(held.len(), 2, "the second chunk of a waits, b behind it");
        let mut grant = Frame::new(FrameType::Credit, MessageId::Uint(1));
        grant.stream_id = Some("a".to_owned());
        grant.credit = Some(1);
        side.read(grant, |_| {}).expect("a grant");
        assert_eq!(ready(&mut held, &mut side), [(Ok(1), 2), (Ok(2), 3)]);
        assert!(held.is_empty());
        // A write refused for good is handed back with its error, not held.
        let mut end = Frame::new(FrameType::End, MessageId::Uint(1));
        side.write(&mut end).expect("the end");
        held.push(chunk("b"), 4);
        assert_eq!(ready(&mut held, &mut side), [(Err(WriteError::Ended), 4)]);
        held.push(chunk("b"), 5);
        assert_eq!(
            held.drain().map(|(_, token)| token).collect::<Vec<_>>(),
            [5]
        );
    }

    #[test]
    fn writes_are_numbered_and_chunks_spend_credit_until_a_grant() {
        let mut side = RequestSide::new(MessageId::Uint(1), None, Credits::new(2), 4);
        let mut start = Frame::new(FrameType::StreamStart, MessageId::Uint(1));
        side.write(&mut start).expect("flow");
        assert_eq!(start.seq, 0);
        let (mut a, mut b, mut c) = (chunk("s"), chunk("s"), chunk("s"));
        side.write(&mut a).expect("credit 1");
        side.write(&mut b).expect("credit 2");
        assert_eq!(
            side.write(&mut c),
            Err(WriteError::NoCredit(Some("s".into())))
        );
        assert_eq!(b.seq, 2);
        let mut grant = Frame::new(FrameType::Credit, MessageId::Uint(1));
        grant.stream_id = Some("s".into());
        grant.credit = Some(1);
        side.read(grant, |_| panic!("credit is not delivered"))
            .expect("fine");
        side.write(&mut c).expect("granted");
        assert_eq!(c.seq, 3, "a refused write consumed no seq");
        let mut end = Frame::new(FrameType::End, MessageId::Uint(1));
        side.write(&mut end).expect("end");
        assert_eq!(side.write(&mut chunk("s")), Err(WriteError::Ended));
    }

    #[test]
    fn reads_are_reordered_windowed_and_consumption_grants_in_batches() {
        let mut side = RequestSide::new(MessageId::Uint(1), None, Credits::new(2), 4);
        let mut delivered = Vec::new();
        let mut second = chunk("s");
        second.seq = 1;
        side.read(second, |f| delivered.push(f.seq)).expect("held");
        assert!(delivered.is_empty());
        side.read(chunk("s"), |f| delivered.push(f.seq))
            .expect("in order");
        assert_eq!(delivered, [0, 1]);
        let grant = side
            .consume(Some("s"))
            .expect("batch of 1 for a window of 2");
        assert_eq!(grant.credit, Some(1));
        let mut third = chunk("s");
        third.seq = 2;
        side.read(third, |_| {}).expect("the grant made room");
        let mut fourth = chunk("s");
        fourth.seq = 3;
        assert_eq!(
            side.read(fourth, |_| {}),
            Err(ReadError::CreditViolation(Some("s".into()))),
            "a violation is fatal: the connection is cut"
        );
    }
}

/// One request's writes held for credit, in order: a CHUNK whose stream has no credit waits,
/// and every later write of the request waits behind it (a flow is written in order). The
/// rule is here so that every shell that writes a request (the switch's engine side, a host)
/// holds writes the same way; the shell keeps its own `token` (a reply channel) beside each.
#[derive(Debug)]
pub struct HeldWrites<T> {
    queue: VecDeque<(Frame, T)>,
}

impl<T> Default for HeldWrites<T> {
    fn default() -> Self {
        Self {
            queue: VecDeque::new(),
        }
    }
}

impl<T> HeldWrites<T> {
    /// Nothing held.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes held.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Queues `frame` behind the writes held.
    pub fn push(&mut self, frame: Frame, token: T) {
        self.queue.push_back((frame, token));
    }

    /// The next write that may go now, prepared by `write` (for a [`RequestSide`], its
    /// [`RequestSide::write`]: seq assigned, credit spent), or refused for good with its
    /// error; `None` while the first held write waits for credit, or when nothing is held.
    /// Call again until `None`: after a CREDIT was read, held writes may go.
    pub fn pop_ready<E>(
        &mut self,
        mut write: impl FnMut(&mut Frame) -> Result<(), E>,
        waits: impl Fn(&E) -> bool,
    ) -> Option<(Result<Frame, E>, T)> {
        let (mut frame, token) = self.queue.pop_front()?;
        match write(&mut frame) {
            Ok(()) => Some((Ok(frame), token)),
            Err(error) if waits(&error) => {
                self.queue.push_front((frame, token));
                None
            }
            Err(error) => Some((Err(error), token)),
        }
    }

    /// Everything held, given back (the request ended: the shell answers each token).
    pub fn drain(&mut self) -> impl Iterator<Item = (Frame, T)> + '_ {
        self.queue.drain(..)
    }
}
