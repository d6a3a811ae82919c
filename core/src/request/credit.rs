//! Credit flow control (docs/spec/switch.md §7; docs/conformance/README.md sections
//! `negotiate`, `grant_target`, `gate` and `window`).
//!
//! One credit is one CHUNK. The sender spends credit through a [`CreditGate`] per stream; the
//! receiver tracks what it may still accept in a [`ReceiveWindow`] and grants credit back in
//! batches as its consumer takes chunks. Credit is end to end: middle hops forward CREDIT
//! frames, never create or absorb them.

use std::collections::BTreeMap;

use crate::limits::{
    CREDIT_WINDOW_CHUNKS_DEFAULT, STREAMS_PER_REQUEST_COUNT_MAX, STREAM_ID_BYTES_MAX,
};
use crate::wire::bifaci::MessageId;

use super::grant_target;

/// A number of credits (chunks a sender may still send).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize)]
#[serde(transparent)]
pub struct Credits(u64);

impl Credits {
    /// No credit.
    pub const ZERO: Credits = Credits(0);
    /// The most credit a counter can hold; adding past it saturates.
    pub const MAX: Credits = Credits(u64::MAX);
    /// The window tether proposes unless configured otherwise (32 chunks, docs/spec/switch.md
    /// §2.4).
    pub const DEFAULT_WINDOW: Credits = Credits(CREDIT_WINDOW_CHUNKS_DEFAULT);

    /// `count` credits.
    pub const fn new(count: u64) -> Self {
        Self(count)
    }

    /// The count.
    pub const fn get(self) -> u64 {
        self.0
    }

    fn saturating_add(self, other: Credits) -> Credits {
        Credits(self.0.saturating_add(other.0))
    }
}

/// The sender's answer to [`CreditGate::acquire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acquire<'a> {
    /// The credits were taken; send.
    Acquired,
    /// Not enough credit; nothing was taken. Wait for a grant or a close.
    Wait,
    /// The gate is closed with this (first) reason; the stream must not send.
    Closed(&'a str),
}

/// The sender side of one stream's credit (docs/conformance/README.md#gate).
///
/// Acquisition is all or nothing; grants saturate at [`Credits::MAX`]; the first close reason
/// sticks and a closed gate refuses every acquisition while ignoring grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreditGate {
    available: Credits,
    closed: Option<String>,
}

impl CreditGate {
    /// An open gate holding the negotiated `window`.
    pub fn new(window: Credits) -> Self {
        Self {
            available: window,
            closed: None,
        }
    }

    /// Takes `n` credits if the gate is open and holds at least `n`. The closed check comes
    /// first: a closed gate refuses even when it holds enough.
    pub fn acquire(&mut self, n: Credits) -> Acquire<'_> {
        if let Some(reason) = &self.closed {
            return Acquire::Closed(reason);
        }
        match self.available.0.checked_sub(n.0) {
            Some(left) => {
                self.available = Credits(left);
                Acquire::Acquired
            }
            None => Acquire::Wait,
        }
    }

    /// Adds `n` credits (saturating). A grant after close does nothing.
    pub fn grant(&mut self, n: Credits) {
        if self.closed.is_none() {
            self.available = self.available.saturating_add(n);
        }
    }

    /// Closes the gate with `reason` unless it is closed already (the first reason sticks).
    /// `available` is left as it was.
    pub fn close(&mut self, reason: &str) {
        if self.closed.is_none() {
            self.closed = Some(reason.to_owned());
        }
    }

    /// Credits the sender may still spend.
    pub fn available(&self) -> Credits {
        self.available
    }

    /// The reason the gate was closed with, `None` while open.
    pub fn closed_reason(&self) -> Option<&str> {
        self.closed.as_deref()
    }
}

/// What one [`ReceiveWindow`] operation asks of the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowStep {
    /// The sender over-ran the window: fail the stream with `CREDIT_VIOLATION`.
    pub violation: bool,
    /// Credits to put in a CREDIT frame now (zero: send none).
    pub grant: Credits,
}

impl WindowStep {
    const QUIET: WindowStep = WindowStep {
        violation: false,
        grant: Credits::ZERO,
    };
    const VIOLATION: WindowStep = WindowStep {
        violation: true,
        grant: Credits::ZERO,
    };

    fn grant(grant: Credits) -> Self {
        Self {
            violation: false,
            grant,
        }
    }
}

/// The receiver side of one stream's credit (docs/conformance/README.md#window).
///
/// Grants are batched: consumed chunks accumulate in `pending` until they reach
/// `max(1, ⌊window/2⌋)`, then all of them are granted at once. [`ReceiveWindow::flush`] grants
/// whatever is pending before the receiver blocks, so a sender with a small window never stalls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiveWindow {
    remaining: Credits,
    pending: Credits,
    batch: Credits,
}

impl ReceiveWindow {
    /// A window of `window` chunks. A zero window is a valid object (every arrival is a
    /// violation until something is consumed) though negotiation never produces one.
    pub fn new(window: Credits) -> Self {
        let batch = Credits((window.0 / 2).max(1));
        Self {
            remaining: window,
            pending: Credits::ZERO,
            batch,
        }
    }

    /// A CHUNK arrived. With nothing remaining it is a violation and nothing changes (the
    /// refused chunk is not counted).
    pub fn arrive(&mut self) -> WindowStep {
        match self.remaining.0.checked_sub(1) {
            Some(left) => {
                self.remaining = Credits(left);
                WindowStep::QUIET
            }
            None => WindowStep::VIOLATION,
        }
    }

    /// A CHUNK arrived that continues an item already begun: checked like
    /// [`ReceiveWindow::arrive`], then given back at once (grant 1), because the consumer
    /// grants per item and an item longer than the window could otherwise never complete.
    pub fn continuation(&mut self) -> WindowStep {
        let step = self.arrive();
        if step.violation {
            return step;
        }
        self.remaining = self.remaining.saturating_add(Credits(1));
        WindowStep::grant(Credits(1))
    }

    /// The consumer took one chunk. Grants everything pending once the batch is reached.
    /// Not checked against arrivals: it is the receiver's own bookkeeping.
    pub fn consume(&mut self) -> WindowStep {
        self.pending = self.pending.saturating_add(Credits(1));
        if self.pending >= self.batch {
            self.flush()
        } else {
            WindowStep::QUIET
        }
    }

    /// Grants everything pending now; call before blocking on anything.
    pub fn flush(&mut self) -> WindowStep {
        let grant = std::mem::take(&mut self.pending);
        self.remaining = self.remaining.saturating_add(grant);
        WindowStep::grant(grant)
    }

    /// Chunks the sender may still send before over-running the receiver.
    pub fn remaining(&self) -> Credits {
        self.remaining
    }

    /// Chunks consumed but not yet granted back.
    pub fn pending(&self) -> Credits {
        self.pending
    }

    /// The grant batch, `max(1, ⌊window/2⌋)`.
    pub fn batch(&self) -> Credits {
        self.batch
    }
}

/// Where [`GrantRouter::credit`] applied a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantOutcome<'a> {
    /// The gate of this stream (`None`: the request's no-stream gate) received the full grant.
    Credited {
        /// The credited gate's identity.
        stream: Option<&'a str>,
    },
    /// No gate of the request matched: a harmless no-op (grants only ever unblock).
    Unmatched,
}

/// Why [`GrantRouter::register`] refused a gate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GateError {
    /// The request already has a gate for this stream.
    #[error("a credit gate for this stream is already registered")]
    Duplicate,
    /// The request already has [`STREAMS_PER_REQUEST_COUNT_MAX`] gates.
    #[error("more than {STREAMS_PER_REQUEST_COUNT_MAX} streams on one request")]
    TooManyStreams,
    /// The stream id is longer than [`STREAM_ID_BYTES_MAX`].
    #[error("stream id longer than {STREAM_ID_BYTES_MAX} bytes")]
    StreamIdTooLong,
}

/// The sender's credit gates, keyed by (request id, stream), and the routing of incoming
/// CREDIT frames to them by [`grant_target`]. Only the request's own gates are candidates.
#[derive(Debug, Clone, Default)]
pub struct GrantRouter {
    gates: BTreeMap<MessageId, Vec<(Option<String>, CreditGate)>>,
}

impl GrantRouter {
    /// An empty router.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers the gate of `stream` (`None`: frames without a stream id) of request `rid`,
    /// holding `window`.
    pub fn register(
        &mut self,
        rid: MessageId,
        stream: Option<&str>,
        window: Credits,
    ) -> Result<(), GateError> {
        if stream.is_some_and(|id| id.len() > STREAM_ID_BYTES_MAX) {
            return Err(GateError::StreamIdTooLong);
        }
        let gates = self.gates.entry(rid).or_default();
        if gates.iter().any(|(id, _)| id.as_deref() == stream) {
            return Err(GateError::Duplicate);
        }
        if gates.len() >= STREAMS_PER_REQUEST_COUNT_MAX {
            return Err(GateError::TooManyStreams);
        }
        gates.push((stream.map(str::to_owned), CreditGate::new(window)));
        Ok(())
    }

    /// The gate of (`rid`, `stream`), if registered.
    pub fn gate_mut(&mut self, rid: MessageId, stream: Option<&str>) -> Option<&mut CreditGate> {
        let gates = self.gates.get_mut(&rid)?;
        gates
            .iter_mut()
            .find(|(id, _)| id.as_deref() == stream)
            .map(|(_, gate)| gate)
    }

    /// Applies a CREDIT of `n` for request `rid` naming `named` to the gate [`grant_target`]
    /// picks, which receives the full grant.
    pub fn credit(&mut self, rid: MessageId, named: Option<&str>, n: Credits) -> GrantOutcome<'_> {
        let Some(gates) = self.gates.get_mut(&rid) else {
            return GrantOutcome::Unmatched;
        };
        let identities: Vec<Option<&str>> = gates.iter().map(|(id, _)| id.as_deref()).collect();
        let Some(index) = grant_target(&identities, named) else {
            return GrantOutcome::Unmatched;
        };
        let (stream, gate) = &mut gates[index];
        gate.grant(n);
        GrantOutcome::Credited {
            stream: stream.as_deref(),
        }
    }

    /// Closes every gate of `rid` with `reason` and forgets them: any terminal releases all of
    /// a request's waiters with an error. Returns how many gates were closed.
    pub fn close_request(&mut self, rid: MessageId, reason: &str) -> usize {
        let Some(mut gates) = self.gates.remove(&rid) else {
            return 0;
        };
        for (_, gate) in &mut gates {
            gate.close(reason);
        }
        gates.len()
    }

    /// Requests with at least one gate.
    pub fn request_count(&self) -> usize {
        self.gates.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_refuses_partial_acquire_and_keeps_first_close_reason() {
        let mut gate = CreditGate::new(Credits::new(2));
        assert_eq!(gate.acquire(Credits::new(3)), Acquire::Wait);
        assert_eq!(gate.available(), Credits::new(2));
        gate.close("END");
        gate.close("ERR");
        gate.grant(Credits::new(5));
        assert_eq!(gate.acquire(Credits::new(1)), Acquire::Closed("END"));
        assert_eq!(gate.available(), Credits::new(2));
    }

    #[test]
    fn window_batches_grants_at_half_the_window() {
        let mut window = ReceiveWindow::new(Credits::new(4));
        assert!(!window.arrive().violation);
        assert!(!window.arrive().violation);
        assert_eq!(window.consume().grant, Credits::ZERO);
        assert_eq!(window.consume().grant, Credits::new(2));
        assert_eq!(window.remaining(), Credits::new(4));
        let mut zero = ReceiveWindow::new(Credits::ZERO);
        assert!(zero.arrive().violation);
        assert_eq!(zero.batch(), Credits::new(1));
    }

    #[test]
    fn router_credits_only_the_requests_own_gates() {
        let mut router = GrantRouter::new();
        router
            .register(MessageId::Uint(1), Some("a"), Credits::new(1))
            .unwrap();
        router
            .register(MessageId::Uint(2), Some("b"), Credits::new(1))
            .unwrap();
        assert_eq!(
            router.credit(MessageId::Uint(1), Some("b"), Credits::new(4)),
            GrantOutcome::Unmatched
        );
        assert_eq!(
            router.credit(MessageId::Uint(1), None, Credits::new(4)),
            GrantOutcome::Credited { stream: Some("a") }
        );
        assert_eq!(
            router
                .gate_mut(MessageId::Uint(2), Some("b"))
                .unwrap()
                .available(),
            Credits::new(1)
        );
        assert_eq!(
            router.register(MessageId::Uint(1), Some("a"), Credits::new(1)),
            Err(GateError::Duplicate)
        );
        assert_eq!(router.close_request(MessageId::Uint(1), "END"), 1);
        assert_eq!(router.request_count(), 1);
    }
}
