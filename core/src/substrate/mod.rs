//! The substrate (docs/spec/substrate.md): named sessions and queues living on both sides of a
//! connection, per-object strict FIFO, exactly-once across disconnects and restarts through a
//! durable outbox and a frontier-based dedupe ledger, two acknowledgement levels, the finality
//! laws and a required, deny-by-default authorize gate.
//!
//! - [`Machine`]: one per remote peer, symmetric for dialer and listener, outliving
//!   connections. See its module for the drain order and the exactly-once rules.
//! - [`durable`]: the typed records the machine asks a store to persist, and
//!   [`DurableState`], what they add up to (the input of [`Machine::recover`]).
//! - [`authorize`]: the interceptor chain and the scope policy.
//! - [`finality`]: error codes and the class the receiver derives from them.
//! - [`handshake`]: capabilities, negotiation and the proof bound to the negotiated tuple and
//!   the connection.
//! - [`PeerLink`]: a machine bound to its current link (handshake, frame codec, machine), so
//!   that a shell only moves bytes, time and persistence results.
//! - [`peer`]: one remote peer's whole life around its [`PeerLink`]: loading its state,
//!   dials and redials, commits and their retries, commands waiting for room, its end.
//! - `harness` (feature `harness`): a deterministic in-memory world of two machines for tests
//!   and benchmarks.

pub mod authorize;
pub mod durable;
pub mod finality;
pub mod handshake;
#[cfg(any(test, feature = "harness"))]
pub mod harness;
mod link;
pub mod log;
mod machine;
pub mod peer;
pub mod preamble;

use std::collections::BTreeMap;
use std::time::Duration;

pub use crate::wire::envelope::{Address, ObjName, OpId};
pub use authorize::{AllowAll, AuthorizeContext, Authorizer, Denial, Interceptor, ScopeAuthorizer};
pub use durable::{
    effective_records, BatchId, DurableState, ObjectRecord, ObjectState, Op, PersistBatch, Record,
    RowKey, Seq, Side,
};
pub use finality::Code;
pub use link::{capabilities, LinkClose, PeerLink};
pub use machine::{CommandError, Event, Machine, TYPE_KEEPALIVE};

use crate::limits::{
    SUBSTRATE_DEAD_AFTER_MS, SUBSTRATE_DEDUPE_RETENTION_MS, SUBSTRATE_GAP_RESYNC_MS,
    SUBSTRATE_INBOX_OPS_MAX, SUBSTRATE_IN_FLIGHT_OPS_DEFAULT, SUBSTRATE_KEEPALIVE_MS,
    SUBSTRATE_OBJECTS_PER_PEER_MAX, SUBSTRATE_OUTBOX_OPS_MAX, SUBSTRATE_QUEUE_TTL_MS,
    SUBSTRATE_RECEIVE_WINDOW_DEFAULT, SUBSTRATE_SEQ_RESERVE, SUBSTRATE_TRANSIENT_RETRY_CAP_MS,
    SUBSTRATE_TRANSIENT_RETRY_MS,
};

/// A peer's identity as the transport authenticated it (e.g. an iroh endpoint id in hex).
/// Shared, not copied: every delivery, request and open carries its peer, and a clone is a
/// reference count.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PeerId(std::sync::Arc<str>);

impl serde::Serialize for PeerId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl PeerId {
    /// The peer named `id`.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into().into())
    }

    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Machine settings. [`Config::default`] holds the limits of docs/spec/substrate.md §3 (and the
/// in-flight window of §5, tether's decision).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Ops per object transmitted and not yet acked (≥ 1; 1 is stop-and-wait).
    pub in_flight_max: usize,
    /// Ops held above the receive frontier (`W`).
    pub receive_window: u64,
    /// Un-acked ops per object before `queue_full`.
    pub outbox_ops_max: usize,
    /// Live objects per peer before `quota`.
    pub objects_max: usize,
    /// A gap older than this asks for a resync (also the resync rate limit).
    pub gap_resync_after: Duration,
    /// Keepalive interval.
    pub keepalive: Duration,
    /// Silence after which the link is dead.
    pub dead_after: Duration,
    /// An op not sent within this ends as `ttl_expired`.
    pub queue_ttl: Duration,
    /// How long tombstones and closed objects are kept; never below `queue_ttl`.
    pub dedupe_retention: Duration,
    /// First wait before resending an op answered with a transient code (doubling, jittered).
    pub transient_retry: Duration,
    /// Longest wait between transient retries of one op.
    pub transient_retry_cap: Duration,
    /// Seqs an object's sender reserves durably ahead (≥ 2): a send below the committed
    /// reservation goes on the wire while its own commit runs, and a restart skips what the
    /// reservation left unused ([`SUBSTRATE_SEQ_RESERVE`]).
    pub seq_reserve: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            in_flight_max: SUBSTRATE_IN_FLIGHT_OPS_DEFAULT,
            receive_window: SUBSTRATE_RECEIVE_WINDOW_DEFAULT,
            outbox_ops_max: SUBSTRATE_OUTBOX_OPS_MAX,
            objects_max: SUBSTRATE_OBJECTS_PER_PEER_MAX,
            gap_resync_after: Duration::from_millis(SUBSTRATE_GAP_RESYNC_MS),
            keepalive: Duration::from_millis(SUBSTRATE_KEEPALIVE_MS),
            dead_after: Duration::from_millis(SUBSTRATE_DEAD_AFTER_MS),
            queue_ttl: Duration::from_millis(SUBSTRATE_QUEUE_TTL_MS),
            dedupe_retention: Duration::from_millis(SUBSTRATE_DEDUPE_RETENTION_MS),
            transient_retry: Duration::from_millis(SUBSTRATE_TRANSIENT_RETRY_MS),
            transient_retry_cap: Duration::from_millis(SUBSTRATE_TRANSIENT_RETRY_CAP_MS),
            seq_reserve: SUBSTRATE_SEQ_RESERVE,
        }
    }
}

impl Config {
    /// The settings with the windows clamped (in flight at least 1, receive window in
    /// `1..=`[`SUBSTRATE_INBOX_OPS_MAX`], seq reservation at least 2) and retention raised to
    /// at least the queue TTL (dedupe must outlive every resend).
    pub fn checked(mut self) -> Self {
        self.seq_reserve = self.seq_reserve.max(2);
        self.in_flight_max = self.in_flight_max.max(1);
        self.receive_window = self.receive_window.clamp(1, SUBSTRATE_INBOX_OPS_MAX as u64);
        self.transient_retry_cap = self.transient_retry_cap.max(self.transient_retry);
        self.dedupe_retention = self.dedupe_retention.max(self.queue_ttl);
        self
    }
}

/// Counters of one machine (serde, for the `metrics` facade and snapshots).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    /// Ops this side put in its outbox.
    pub ops_enqueued: u64,
    /// Ops of this side hop-acked by the peer.
    pub ops_acked: u64,
    /// Of those, the acks reported to the app before this side's removal of the op was
    /// committed (the peer applied the op in order).
    pub acks_reported_early: u64,
    /// Sends put on the wire while the batch holding them was still being committed (below
    /// the durable seq reservation, [`crate::limits::SUBSTRATE_SEQ_RESERVE`]).
    pub sent_before_commit: u64,
    /// Un-acked ops per object (filled in by [`Machine::stats`]).
    pub outbox_depth: BTreeMap<String, u64>,
    /// Ops of the peer seen again (below the frontier or already held): re-acked only.
    pub duplicates: u64,
    /// Ops of the peer held above the frontier.
    pub deferred: u64,
    /// Denials by `verb:code`.
    pub denials: BTreeMap<String, u64>,
    /// Bounces (ops to unknown objects), one per op id.
    pub bounces: u64,
    /// Duplicates of bounced ops answered with the stored outcome.
    pub bounces_reserved: u64,
    /// Tombstones evicted at the bound.
    pub bounces_evicted: u64,
    /// Ops of this side ended futile, by code.
    pub futile: BTreeMap<String, u64>,
    /// Transient errors received, by code.
    pub transient: BTreeMap<String, u64>,
    /// Acks citing a receipt that is not the op's current one.
    pub stale_receipts: u64,
    /// Close/err from a non-participant, or errs about nothing of ours: dropped.
    pub finality_rejected: u64,
    /// Ops of the peer at or beyond the credit this side gave it: a protocol violation (a
    /// correct peer never sends past its credit), answered with the terminal `out_of_seq`.
    pub out_of_seq: u64,
    /// Seqs of the peer its floor declared ended (never to be sent), skipped by the frontier.
    pub skipped_below_floor: u64,
    /// Credit updates sent after the app consumed (acks carry credit too).
    pub credits_sent: u64,
    /// Floor announcements sent (an op in the middle ended and nothing else carried it).
    pub floors_sent: u64,
    /// Resyncs asked for.
    pub resyncs_sent: u64,
    /// Resyncs answered.
    pub resyncs_received: u64,
    /// Frames missing a field their verb needs.
    pub malformed: u64,
    /// Frames carrying a number no honest peer sends (a seq, floor, resync point or credit
    /// limit at or past [`crate::limits::SUBSTRATE_SEQ_MAX`]): dropped, and the link cut.
    pub violations: u64,
    /// Links up.
    pub link_ups: u64,
    /// Links down (including dead links).
    pub link_downs: u64,
    /// Closed or rejected objects forgotten early at the retention bound.
    pub objects_evicted: u64,
    /// Opens of an address that was opened from both sides at once (or exists already).
    pub open_conflicts: u64,
}

#[cfg(test)]
mod tests {
    use super::PeerId;

    #[test]
    fn a_peer_id_serializes_as_its_string_and_clones_share_it() {
        let peer = PeerId::new("ab12");
        assert_eq!(serde_json::to_string(&peer).expect("json"), r#""ab12""#);
        let clone = peer.clone();
        assert_eq!(clone, peer);
        assert!(std::ptr::eq(clone.as_str(), peer.as_str()));
        assert!(PeerId::new("a") < PeerId::new("b"));
    }
}
