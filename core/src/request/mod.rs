//! The request lifecycle of the request switch (docs/spec/switch.md §6–§7, and the sections of
//! docs/conformance/README.md that pin each decision).
//!
//! Pure decisions and small machines; no I/O, no clock (time is passed in):
//!
//! - the decisions, as plain functions over frame types: [`terminal_of`], [`is_flow`],
//!   [`dispose`], [`ledger`], [`write`](fn@write), [`negotiate`], [`grant_target`];
//! - [`RequestTable`]: requests keyed by (XID, RID), registered once, terminated once, leaving
//!   no state behind, with a bounded ring of recent terminations that tells a benign straggler
//!   from a genuine no-route drop;
//! - credit flow control: the sender's [`CreditGate`], the receiver's [`ReceiveWindow`] and the
//!   [`GrantRouter`] that applies an incoming CREDIT to the right gate;
//! - flow ordering: [`SeqAssigner`] and [`WriteGate`] on the writing side, [`ReorderBuffer`]
//!   on the reading side, and the [`EmissionChecker`] that judges one request's emitted order.
//!
//! Every machine here is deterministic and every bound is a named constant in
//! [`crate::limits`]. `tether-formal-replay` replays all of them against independent models.

mod credit;
mod flow;
mod table;

pub use credit::{
    Acquire, CreditGate, Credits, GateError, GrantOutcome, GrantRouter, ReceiveWindow, WindowStep,
};
pub use flow::{
    Accepted, Emission, EmissionChecker, Refusal, RefusalKind, ReorderBuffer, Seq, SeqAssigner,
    Violation, WriteGate, Written,
};
pub use table::{
    CancelCode, CancelReason, Counters, Direction, ErrorClass, FlowTotals, NoRouteSite, Observed,
    Phase, RegisterError, RequestKey, RequestSnapshot, RequestState, RequestTable,
    RequestTableConfig, StreamStats, Summary, TableSnapshot, Terminated, Termination,
    TerminationKind,
};

use crate::wire::bifaci::FrameType;

/// How a frame ends its request (docs/conformance/README.md#frame_types). Cancellation and master
/// death also end a request, but no frame carries them; see [`Termination`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Ending {
    /// END: the request finished.
    Finished,
    /// ERR: the request failed.
    Failed,
}

/// How a frame of type `frame` ends its request, if it does: END → finished, ERR → failed.
pub fn terminal_of(frame: FrameType) -> Option<Ending> {
    match frame {
        FrameType::End => Some(Ending::Finished),
        FrameType::Err => Some(Ending::Failed),
        _ => None,
    }
}

/// Whether `frame` belongs to a request's ordered flow: REQ, CHUNK, END, LOG, ERR,
/// STREAM_START, STREAM_END. Flow frames are numbered per flow and reordered; the others are
/// control traffic that always carries seq 0.
pub fn is_flow(frame: FrameType) -> bool {
    matches!(
        frame,
        FrameType::Req
            | FrameType::Chunk
            | FrameType::End
            | FrameType::Log
            | FrameType::Err
            | FrameType::StreamStart
            | FrameType::StreamEnd
    )
}

/// Whether `frame` ends its request (END or ERR). Every terminal type is a flow type.
pub fn is_terminal(frame: FrameType) -> bool {
    terminal_of(frame).is_some()
}

/// Where a frame for a request goes (docs/conformance/README.md#table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Disposition {
    /// The request is live: route the frame.
    Route,
    /// The request ended lately: the frame crossed its end in flight. Benign, counted per
    /// frame type, not a drop.
    Straggler,
    /// Never known within the ring's horizon: a counted drop worth a warning.
    NoRoute,
}

/// Where a frame goes given whether its request is `live` and whether it `ended_lately` (is in
/// the recently-terminated ring). Live wins over an earlier ending of the same RID.
pub fn dispose(live: bool, ended_lately: bool) -> Disposition {
    if live {
        Disposition::Route
    } else if ended_lately {
        Disposition::Straggler
    } else {
        Disposition::NoRoute
    }
}

/// A stream's diagnostic credit ledger after observing one frame
/// (docs/conformance/README.md#ledger): CHUNK −1, CREDIT +`granted`, anything else unchanged
/// (`granted` is ignored for non-CREDIT frames). It never refuses and may go negative (a producer
/// that over-ran its window); it saturates at the ends of `i64` rather than wrap.
pub fn ledger(remaining: i64, frame: FrameType, granted: u64) -> i64 {
    match frame {
        FrameType::Chunk => remaining.saturating_sub(1),
        FrameType::Credit => remaining.saturating_add(i64::try_from(granted).unwrap_or(i64::MAX)),
        _ => remaining,
    }
}

/// What the writer does with a frame (docs/conformance/README.md#writer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WriteDecision {
    /// A flow frame after its flow ended: not written, counted as a benign straggler.
    Suppress,
    /// Written; `ends_flow` when it is the flow's terminal (END or ERR).
    Send {
        /// The frame ends its flow.
        ends_flow: bool,
    },
}

/// Whether a frame of type `frame` is written on a flow that has `ended` already. Control
/// frames always pass; a flow frame after END/ERR is suppressed.
pub fn write(ended: bool, frame: FrameType) -> WriteDecision {
    if !is_flow(frame) {
        WriteDecision::Send { ends_flow: false }
    } else if ended {
        WriteDecision::Suppress
    } else {
        WriteDecision::Send {
            ends_flow: is_terminal(frame),
        }
    }
}

/// The per-stream credit window two peers agree on: the smaller proposal, or `None` (refused)
/// when either proposes 0, since a zero window would block every stream at its first chunk.
pub fn negotiate(ours: Credits, theirs: Credits) -> Option<Credits> {
    let window = ours.min(theirs);
    (window.get() != 0).then_some(window)
}

/// Which of a request's registered sending streams an incoming CREDIT credits
/// (docs/conformance/README.md#grant_target). `streams` are the request's gate identities (`None` =
/// the gate of a sender whose frames carry no stream id), `named` the grant's stream. Returns the
/// index into `streams`, or `None` when the grant credits nothing:
///
/// 1. the named identity (`None` included) when it is registered, exactly, case-sensitively;
/// 2. otherwise, for an unnamed grant, the sole registered identity;
/// 3. otherwise nothing (a named grant never falls back to the sole stream).
pub fn grant_target(streams: &[Option<&str>], named: Option<&str>) -> Option<usize> {
    if let Some(index) = streams.iter().position(|stream| *stream == named) {
        return Some(index);
    }
    (named.is_none() && streams.len() == 1).then_some(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_and_terminal_types_match_the_reference_table() {
        let flow: Vec<u8> = FrameType::ALL
            .into_iter()
            .filter(|t| is_flow(*t))
            .map(FrameType::code)
            .collect();
        assert_eq!(flow, [1, 3, 4, 5, 6, 8, 9]);
        let terminal: Vec<u8> = FrameType::ALL
            .into_iter()
            .filter(|t| is_terminal(*t))
            .map(FrameType::code)
            .collect();
        assert_eq!(terminal, [4, 6]);
        assert_eq!(FrameType::from_code(2), None);
    }

    #[test]
    fn grant_target_prefers_exact_match_and_never_falls_back_for_named_grants() {
        assert_eq!(grant_target(&[Some("a"), Some("b")], None), None);
        assert_eq!(grant_target(&[None, Some("a")], None), Some(0));
        assert_eq!(grant_target(&[Some("a")], None), Some(0));
        assert_eq!(grant_target(&[Some("a")], Some("b")), None);
        assert_eq!(grant_target(&[Some("A")], Some("a")), None);
        assert_eq!(grant_target(&[Some("")], Some("")), Some(0));
        assert_eq!(grant_target(&[], None), None);
    }

    #[test]
    fn ledger_saturates_instead_of_wrapping() {
        assert_eq!(ledger(i64::MIN, FrameType::Chunk, 0), i64::MIN);
        assert_eq!(ledger(1, FrameType::Credit, u64::MAX), i64::MAX);
        assert_eq!(ledger(5, FrameType::End, 9), 5);
    }

    #[test]
    fn write_passes_control_frames_after_the_end() {
        assert_eq!(
            write(true, FrameType::Credit),
            WriteDecision::Send { ends_flow: false }
        );
        assert_eq!(write(true, FrameType::Log), WriteDecision::Suppress);
        assert_eq!(
            write(false, FrameType::Err),
            WriteDecision::Send { ends_flow: true }
        );
    }
}
