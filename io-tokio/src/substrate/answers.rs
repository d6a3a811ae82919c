//! Where a peer task sends each command's answers, by ticket.
//!
//! The task issues tickets in increasing order, and most answers come back in about that
//! order (a queue's sends are acked in order), so the entries lie in a [`Ring`] by ticket: an
//! answer finds its entry at its offset, beside those answered just before it, where a hash
//! table scattered them and its lookups missed the cache with thousands of sends in flight
//! (1.4% of the CPU of 16 queues in `tether-bench`'s profile). Commands without answers, such
//! as consumes, take tickets too: the ring fills in their numbers, up to its gap bound.

use tether_core::limits::{SUBSTRATE_RING_GAP_MAX, SUBSTRATE_RING_SLOTS_MAX};
use tether_core::ring::Ring;

use super::commands::Answer;

/// Answers by ticket.
pub(super) type Answers = Ring<Answer>;

/// No answers yet, within the ring's bounds ([`SUBSTRATE_RING_SLOTS_MAX`],
/// [`SUBSTRATE_RING_GAP_MAX`]).
pub(super) fn answers() -> Answers {
    Ring::new(SUBSTRATE_RING_SLOTS_MAX, SUBSTRATE_RING_GAP_MAX)
}
