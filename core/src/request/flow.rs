//! Flow ordering (docs/spec/switch.md §6.3; docs/conformance/README.md sections `reorder`,
//! `writer` and `emission`).
//!
//! A flow is one request id with one routing id. On the writing side a [`WriteGate`] numbers
//! the flow's frames `0, 1, 2, …` through its [`SeqAssigner`] and suppresses flow frames after
//! END/ERR; on the reading side a [`ReorderBuffer`] hands frames on in sequence order; the
//! [`EmissionChecker`] judges the order of one request's emitted flow frames.

use std::collections::{BTreeMap, BTreeSet};

use crate::limits::{REORDER_HELD_COUNT_DEFAULT, STREAMS_PER_REQUEST_COUNT_MAX};
use crate::wire::bifaci::{Frame, FrameType};

use super::{is_flow, write, WriteDecision};

/// A flow sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize)]
#[serde(transparent)]
pub struct Seq(pub u64);

/// Numbers one flow's written flow frames `0, 1, 2, …` without gaps. Non-flow frames carry 0
/// and consume nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeqAssigner {
    next: Seq,
}

impl SeqAssigner {
    /// A flow that has written nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// The seq a frame of type `frame` carries when it is written now.
    pub fn assign(&mut self, frame: FrameType) -> Seq {
        if !is_flow(frame) {
            return Seq(0);
        }
        let seq = self.next;
        self.next = Seq(seq.0.wrapping_add(1));
        seq
    }

    /// The seq the next flow frame will carry.
    pub fn next(&self) -> Seq {
        self.next
    }
}

/// The writer's verdict on one frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// Write the frame with this seq; `ends_flow` when it is the flow's terminal.
    Sent {
        /// The seq to put on the wire.
        seq: Seq,
        /// The frame is END or ERR.
        ends_flow: bool,
    },
    /// A flow frame after END/ERR: not written, no seq consumed; a benign straggler.
    Suppressed,
}

/// One flow's write gating (docs/conformance/README.md#writer): flow frames after END/ERR are
/// suppressed and counted as stragglers; control frames always pass with seq 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WriteGate {
    ended: bool,
    seqs: SeqAssigner,
    stragglers: u64,
}

impl WriteGate {
    /// A flow that has written nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Decides whether a frame of type `frame` is written and with which seq.
    pub fn write(&mut self, frame: FrameType) -> Written {
        match write(self.ended, frame) {
            WriteDecision::Suppress => {
                self.stragglers += 1;
                Written::Suppressed
            }
            WriteDecision::Send { ends_flow } => {
                self.ended |= ends_flow;
                Written::Sent {
                    seq: self.seqs.assign(frame),
                    ends_flow,
                }
            }
        }
    }

    /// Whether END or ERR has been written.
    pub fn is_ended(&self) -> bool {
        self.ended
    }

    /// Flow frames suppressed after the end.
    pub fn stragglers(&self) -> u64 {
        self.stragglers
    }
}

/// How a [`ReorderBuffer`] accepted an arrival.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accepted {
    /// Early: buffered until its predecessors arrive.
    Held,
    /// In order: this many items (the arrival and its held successors) were handed on.
    Delivered {
        /// Items handed to the delivery callback, at least 1.
        count: u64,
    },
}

/// Why a [`ReorderBuffer`] refused an arrival. A refusal changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RefusalKind {
    /// Below the next expected seq: delivered already.
    Stale,
    /// Already held.
    Duplicate,
    /// Early, and the buffer holds its limit.
    Overflow,
}

/// A refused arrival, handed back with its item so nothing is lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal<T> {
    /// Why it was refused.
    pub kind: RefusalKind,
    /// The item, untouched.
    pub item: T,
}

/// One flow's reorder buffer (docs/conformance/README.md#reorder): hands items on in seq order,
/// holding at most `limit` early arrivals, and at most `bytes_limit` bytes of them (as
/// [`ReorderBuffer::accept_sized`] is told each item's bytes; unlimited unless
/// [`ReorderBuffer::with_bytes_limit`] sets it).
#[derive(Debug, Clone)]
pub struct ReorderBuffer<T> {
    expected: Seq,
    held: BTreeMap<u64, (T, usize)>,
    limit: u64,
    held_bytes: usize,
    bytes_limit: usize,
}

impl<T> ReorderBuffer<T> {
    /// An empty buffer expecting seq 0 that holds at most `limit` early arrivals, which
    /// bounds its memory at `limit` items. With `limit = 0` in-order traffic flows and every
    /// early arrival overflows.
    pub fn new(limit: u64) -> Self {
        Self {
            expected: Seq(0),
            held: BTreeMap::new(),
            limit,
            held_bytes: 0,
            bytes_limit: usize::MAX,
        }
    }

    /// The same buffer, holding at most `bytes` bytes of early arrivals.
    pub fn with_bytes_limit(mut self, bytes: usize) -> Self {
        self.bytes_limit = bytes;
        self
    }

    /// [`ReorderBuffer::accept_sized`] of an item that counts no bytes.
    pub fn accept(
        &mut self,
        seq: Seq,
        item: T,
        deliver: impl FnMut(Seq, T),
    ) -> Result<Accepted, Refusal<T>> {
        self.accept_sized(seq, item, 0, deliver)
    }

    /// Accepts item `item` numbered `seq`, of `bytes` bytes. In order: calls `deliver` with it
    /// and then with every consecutive held successor. Checks, in order: stale, then in-order
    /// delivery, then duplicate, then overflow (past `limit` items or `bytes_limit` bytes).
    pub fn accept_sized(
        &mut self,
        seq: Seq,
        item: T,
        bytes: usize,
        mut deliver: impl FnMut(Seq, T),
    ) -> Result<Accepted, Refusal<T>> {
        if seq < self.expected {
            return Err(Refusal {
                kind: RefusalKind::Stale,
                item,
            });
        }
        if seq > self.expected {
            if self.held.contains_key(&seq.0) {
                return Err(Refusal {
                    kind: RefusalKind::Duplicate,
                    item,
                });
            }
            let over_bytes = self
                .held_bytes
                .checked_add(bytes)
                .is_none_or(|total| total > self.bytes_limit);
            if self.held.len() as u64 >= self.limit || over_bytes {
                return Err(Refusal {
                    kind: RefusalKind::Overflow,
                    item,
                });
            }
            self.held.insert(seq.0, (item, bytes));
            self.held_bytes += bytes;
            return Ok(Accepted::Held);
        }
        deliver(seq, item);
        let mut count = 1;
        let mut next = seq.0.wrapping_add(1);
        while let Some((successor, bytes)) = self.held.remove(&next) {
            self.held_bytes -= bytes;
            deliver(Seq(next), successor);
            count += 1;
            next = next.wrapping_add(1);
        }
        self.expected = Seq(next);
        Ok(Accepted::Delivered { count })
    }

    /// Bytes of the early arrivals held.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// The next seq to hand on.
    pub fn expected(&self) -> Seq {
        self.expected
    }

    /// The held seqs, ascending (every one above [`ReorderBuffer::expected`]).
    pub fn held(&self) -> impl Iterator<Item = Seq> + '_ {
        self.held.keys().copied().map(Seq)
    }

    /// How many early arrivals are held.
    pub fn held_len(&self) -> usize {
        self.held.len()
    }
}

impl<T> Default for ReorderBuffer<T> {
    /// A buffer holding at most [`REORDER_HELD_COUNT_DEFAULT`] early arrivals.
    fn default() -> Self {
        Self::new(REORDER_HELD_COUNT_DEFAULT as u64)
    }
}

/// One flow frame as the [`EmissionChecker`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Emission<'a> {
    /// STREAM_START of a stream.
    StreamStart(&'a str),
    /// CHUNK number `index` (zero-based) of a stream.
    Chunk {
        /// The stream.
        stream: &'a str,
        /// The chunk's declared index.
        index: u64,
    },
    /// STREAM_END of a stream, with its declared chunk count (`None` for unbounded streams).
    StreamEnd {
        /// The stream.
        stream: &'a str,
        /// The declared count.
        count: Option<u64>,
    },
    /// END.
    End,
    /// ERR.
    Err,
    /// Any other flow frame (REQ, LOG).
    Other,
}

impl<'a> Emission<'a> {
    /// The emission a frame stands for; `None` for non-flow frames, which are not emissions.
    /// A missing stream id reads as `""`; a CHUNK without `chunk_index` reads as index
    /// `u64::MAX`, which no stream can expect, so it is reported as out of place.
    pub fn of_frame(frame: &'a Frame) -> Option<Self> {
        let stream = frame.stream_id.as_deref().unwrap_or("");
        Some(match frame.frame_type {
            FrameType::StreamStart => Emission::StreamStart(stream),
            FrameType::Chunk => Emission::Chunk {
                stream,
                index: frame.chunk_index.unwrap_or(u64::MAX),
            },
            FrameType::StreamEnd => Emission::StreamEnd {
                stream,
                count: frame.chunk_count,
            },
            FrameType::End => Emission::End,
            FrameType::Err => Emission::Err,
            other if is_flow(other) => Emission::Other,
            _ => return None,
        })
    }
}

/// An order violation in a request's emitted flow frames (docs/conformance/README.md#emission).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// Anything after END or ERR.
    #[error("emission after the request's END/ERR")]
    AfterEnd,
    /// A stream started twice (a stream id is started at most once per request).
    #[error("stream {stream:?} started again")]
    StreamRestarted {
        /// The stream.
        stream: String,
    },
    /// A chunk or STREAM_END on a stream that is not open.
    #[error("stream {stream:?} is not open")]
    StreamNotOpen {
        /// The stream.
        stream: String,
    },
    /// A chunk whose index is not the number of chunks seen on its stream.
    #[error("chunk {got} of stream {stream:?} out of place, expected {expected}")]
    ChunkOutOfPlace {
        /// The stream.
        stream: String,
        /// Chunks seen so far.
        expected: u64,
        /// The chunk's index.
        got: u64,
    },
    /// A STREAM_END whose declared count is not the number of chunks seen.
    #[error("stream {stream:?} ended with count {got}, saw {expected} chunks")]
    ChunkCountWrong {
        /// The stream.
        stream: String,
        /// Chunks seen.
        expected: u64,
        /// The declared count.
        got: u64,
    },
    /// END while a stream is open (the earliest-opened one is named).
    #[error("END with stream {stream:?} still open")]
    EndWithOpenStream {
        /// The earliest-opened stream still open.
        stream: String,
    },
    /// More than [`STREAMS_PER_REQUEST_COUNT_MAX`] streams on one request (a local bound, not
    /// one of the six order violations).
    #[error("more than {STREAMS_PER_REQUEST_COUNT_MAX} streams on one request")]
    TooManyStreams,
}

/// Judges one request's emitted flow frames, in wire order (docs/conformance/README.md#emission).
/// The first violation stops the check; it judges order, not completeness.
#[derive(Debug, Clone, Default)]
pub struct EmissionChecker {
    /// Open streams in opening order, with chunks seen on each.
    open: Vec<(String, u64)>,
    closed: BTreeSet<String>,
    ended: bool,
    position: u64,
    violation: Option<(u64, Violation)>,
}

impl EmissionChecker {
    /// A checker that has seen nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Checks the next emission. Once a violation was found, every later call returns it again
    /// with its zero-based position.
    pub fn step(&mut self, emission: Emission<'_>) -> Result<(), (u64, &Violation)> {
        if self.violation.is_none() {
            if let Err(violation) = self.apply(emission) {
                self.violation = Some((self.position, violation));
            }
            self.position += 1;
        }
        match &self.violation {
            Some((at, violation)) => Err((*at, violation)),
            None => Ok(()),
        }
    }

    /// The first violation and its position, if any.
    pub fn violation(&self) -> Option<(u64, &Violation)> {
        self.violation
            .as_ref()
            .map(|(at, violation)| (*at, violation))
    }

    fn apply(&mut self, emission: Emission<'_>) -> Result<(), Violation> {
        if self.ended {
            return Err(Violation::AfterEnd);
        }
        match emission {
            Emission::StreamStart(stream) => {
                if self.open_index(stream).is_some() || self.closed.contains(stream) {
                    return Err(Violation::StreamRestarted {
                        stream: stream.to_owned(),
                    });
                }
                if self.open.len() + self.closed.len() >= STREAMS_PER_REQUEST_COUNT_MAX {
                    return Err(Violation::TooManyStreams);
                }
                self.open.push((stream.to_owned(), 0));
            }
            Emission::Chunk { stream, index } => {
                let at = self.open_or_violation(stream)?;
                let seen = &mut self.open[at].1;
                if index != *seen {
                    let expected = *seen;
                    return Err(Violation::ChunkOutOfPlace {
                        stream: stream.to_owned(),
                        expected,
                        got: index,
                    });
                }
                *seen += 1;
            }
            Emission::StreamEnd { stream, count } => {
                let at = self.open_or_violation(stream)?;
                let seen = self.open[at].1;
                if let Some(got) = count.filter(|count| *count != seen) {
                    let stream = stream.to_owned();
                    return Err(Violation::ChunkCountWrong {
                        stream,
                        expected: seen,
                        got,
                    });
                }
                let (stream, _) = self.open.remove(at);
                self.closed.insert(stream);
            }
            Emission::End => {
                if let Some((stream, _)) = self.open.first() {
                    return Err(Violation::EndWithOpenStream {
                        stream: stream.clone(),
                    });
                }
                self.ended = true;
            }
            Emission::Err => self.ended = true,
            Emission::Other => {}
        }
        Ok(())
    }

    fn open_index(&self, stream: &str) -> Option<usize> {
        self.open.iter().position(|(open, _)| open == stream)
    }

    fn open_or_violation(&self, stream: &str) -> Result<usize, Violation> {
        self.open_index(stream)
            .ok_or_else(|| Violation::StreamNotOpen {
                stream: stream.to_owned(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writer_numbers_flow_frames_and_suppresses_after_the_end() {
        let mut gate = WriteGate::new();
        let written: Vec<Written> = [3, 4, 5, 13]
            .into_iter()
            .map(|code| gate.write(FrameType::from_code(code).unwrap()))
            .collect();
        assert_eq!(
            written,
            [
                Written::Sent {
                    seq: Seq(0),
                    ends_flow: false
                },
                Written::Sent {
                    seq: Seq(1),
                    ends_flow: true
                },
                Written::Suppressed,
                Written::Sent {
                    seq: Seq(0),
                    ends_flow: false
                },
            ]
        );
        assert_eq!(gate.stragglers(), 1);
    }

    #[test]
    fn reorder_prefers_duplicate_over_overflow_and_delivers_runs() {
        let mut buffer = ReorderBuffer::new(2);
        let mut out = Vec::new();
        assert_eq!(buffer.accept(Seq(1), 'b', |_, _| {}), Ok(Accepted::Held));
        assert_eq!(buffer.accept(Seq(2), 'c', |_, _| {}), Ok(Accepted::Held));
        assert_eq!(
            buffer.accept(Seq(2), 'x', |_, _| {}).unwrap_err().kind,
            RefusalKind::Duplicate
        );
        assert_eq!(
            buffer.accept(Seq(3), 'd', |_, _| {}).unwrap_err().kind,
            RefusalKind::Overflow
        );
        let accepted = buffer.accept(Seq(0), 'a', |seq, item| out.push((seq.0, item)));
        assert_eq!(accepted, Ok(Accepted::Delivered { count: 3 }));
        assert_eq!(out, [(0, 'a'), (1, 'b'), (2, 'c')]);
        assert_eq!(
            buffer.accept(Seq(1), 'b', |_, _| {}).unwrap_err().kind,
            RefusalKind::Stale
        );
    }

    #[test]
    fn reorder_holds_early_arrivals_within_their_bytes() {
        let mut buffer = ReorderBuffer::new(8).with_bytes_limit(100);
        assert_eq!(
            buffer.accept_sized(Seq(1), 'b', 60, |_, _| {}),
            Ok(Accepted::Held)
        );
        // 60 + 41 > 100: refused, nothing changes; 40 fits exactly.
        assert_eq!(
            buffer
                .accept_sized(Seq(2), 'c', 41, |_, _| {})
                .unwrap_err()
                .kind,
            RefusalKind::Overflow
        );
        assert_eq!(buffer.held_bytes(), 60);
        assert_eq!(
            buffer.accept_sized(Seq(2), 'c', 40, |_, _| {}),
            Ok(Accepted::Held)
        );
        // A length that would overflow the count is refused too.
        assert_eq!(
            buffer
                .accept_sized(Seq(3), 'd', usize::MAX, |_, _| {})
                .unwrap_err()
                .kind,
            RefusalKind::Overflow
        );
        // An in-order arrival is never held, whatever its size; delivery frees the bytes.
        let mut out = Vec::new();
        let delivered = buffer.accept_sized(Seq(0), 'a', 1_000, |_, item| out.push(item));
        assert_eq!(delivered, Ok(Accepted::Delivered { count: 3 }));
        assert_eq!(out, ['a', 'b', 'c']);
        assert_eq!(buffer.held_bytes(), 0);
    }

    #[test]
    fn checker_names_the_earliest_open_stream_and_stops_at_the_first_violation() {
        let mut checker = EmissionChecker::new();
        assert!(checker.step(Emission::StreamStart("a")).is_ok());
        assert!(checker.step(Emission::StreamStart("b")).is_ok());
        let (at, violation) = checker.step(Emission::End).unwrap_err();
        assert_eq!(at, 2);
        assert_eq!(
            violation,
            &Violation::EndWithOpenStream { stream: "a".into() }
        );
        assert_eq!(checker.step(Emission::Other).unwrap_err().0, 2);
    }
}
